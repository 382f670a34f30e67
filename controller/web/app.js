// trainyard web view: the page's entry point, routed on location.pathname.
//
// Plain JavaScript as ES modules, no build step, no framework: this module routes to the page
// modules beside it (jobs.js, nodes.js, compare.js), which share common.js and plots.js. The
// only library is uPlot (global `uPlot`, vendored under /assets/). Every string that comes from
// the API reaches the page through textContent, Text nodes or setAttribute, never through
// innerHTML.
//
// Contract with the tests: when a page has loaded and rendered all its data it sets
// body[data-ready="1"] and body[data-render-ms] (performance.now() at that moment); when the
// first load failed it sets body[data-ready="error"]. Auto-refreshes never reset either.

import { TOKEN_KEY, $, HttpError, getToken, fail } from "./common.js";
import { pageJobs, pageJob } from "./jobs.js";
import { pageNodes } from "./nodes.js";
import { pageCompare } from "./compare.js";

// ---------------------------------------------------------------- router

function markNav(path) {
  for (const a of document.querySelectorAll("header.top nav a")) {
    const p = a.getAttribute("href");
    a.classList.toggle("current", p === "/" ? path === "/" || path.startsWith("/jobs/") : path.startsWith(p));
  }
  const forget = $("#forget-token");
  if (forget && getToken()) {
    forget.hidden = false;
    forget.addEventListener("click", () => {
      try { localStorage.removeItem(TOKEN_KEY); } catch { /* nothing stored */ }
      location.reload();
    });
  }
}

async function route() {
  const path = location.pathname.replace(/\/+$/, "") || "/";
  markNav(path);
  if (typeof uPlot !== "function") throw new Error("the plotting library (/assets/uPlot.iife.min.js) did not load");
  if (path === "/") return pageJobs();
  const m = /^\/jobs\/(\d+)$/.exec(path);
  if (m) return pageJob(m[1]);
  if (path === "/nodes") return pageNodes();
  if (path === "/compare") return pageCompare();
  throw new HttpError(404, `no page at ${path}`);
}

function start() {
  route().catch(fail);
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
