// trainyard web view, common.js: what every page shares: constants, DOM helpers, formatting, the
// API and its errors, readiness. An ES module of the page (see app.js); strings from the API reach
// the page through textContent, Text nodes or setAttribute, never through innerHTML.

const TOKEN_KEY = "trainyard.token";
const REFRESH_MS = 5000;
const BUCKETS = 800;
const PLOT_HEIGHT = 220;
const LEGEND_MAX_SERIES = 16;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

// ---------------------------------------------------------------- DOM helpers

/** Builds an element. attrs: class, text, dataset, on<event>, or plain attributes. */
function h(tag, attrs, ...children) {
  const e = document.createElement(tag);
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v == null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = String(v);
      else if (k === "dataset") {
        for (const [dk, dv] of Object.entries(v)) if (dv != null) e.dataset[dk] = String(dv);
      }
      else if (k.startsWith("on") && typeof v === "function") e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
  }
  add(e, children);
  return e;
}

/** Appends children: nodes as they are, anything else as a Text node. */
function add(parent, children) {
  for (const c of [children].flat(Infinity)) {
    if (c == null || c === false) continue;
    parent.append(c instanceof Node ? c : String(c));
  }
  return parent;
}

/** Replaces parent's children in one step (no flicker), with add()'s rules. */
function fill(parent, ...children) {
  const frag = document.createDocumentFragment();
  add(frag, children);
  parent.replaceChildren(frag);
  return parent;
}

const $ = (sel, root = document) => root.querySelector(sel);
const app = () => $("#app") || document.body.appendChild(h("main", { id: "app" }));

/** A badge for a state word; CSS colors it by data-state. */
function badge(word, title) {
  const w = word == null || word === "" ? "none" : String(word);
  return h("span", { class: "state", dataset: { state: w }, title: title || null }, w);
}

function table(id, cls, headers) {
  const tbody = h("tbody");
  const t = h("table", { id, class: cls },
    h("thead", null, h("tr", null, headers.map((x) => {
      const [label, num] = Array.isArray(x) ? x : [x, false];
      return h("th", { class: num ? "num" : null }, label);
    }))),
    tbody);
  return { table: t, tbody };
}

const td = (content, cls) => h("td", { class: cls || null }, content);
const num = (content) => td(content, "num");
const muted = (text) => h("span", { class: "muted" }, text);

// ---------------------------------------------------------------- formatting

const nfInt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const nf1 = new Intl.NumberFormat("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
const DASH = "–";
const isNum = (v) => typeof v === "number" && Number.isFinite(v);

const fmtInt = (v) => (isNum(v) ? nfInt.format(Math.round(v)) : DASH);
const fmtMs = (v) => (isNum(v) ? nf1.format(v) + " ms" : DASH);
const fmtPct = (f) => (isNum(f) ? (f * 100).toFixed(1) + " %" : DASH);
const pad2 = (n) => String(n).padStart(2, "0");

/** Local time as YYYY-MM-DD HH:MM:SS. */
function fmtDate(ms) {
  if (!isNum(ms)) return DASH;
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ` +
    `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
}

/** A duration for people: 45s, 3m 05s, 2h 10m, 4d 3h. */
function fmtDuration(ms) {
  if (!isNum(ms)) return DASH;
  let s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s}s`;
  let m = Math.floor(s / 60);
  s %= 60;
  if (m < 60) return `${m}m ${pad2(s)}s`;
  let hr = Math.floor(m / 60);
  m %= 60;
  if (hr < 24) return `${hr}h ${pad2(m)}m`;
  const d = Math.floor(hr / 24);
  hr %= 24;
  return `${d}d ${hr}h`;
}

/** A plain number with at most 4 significant digits, no exponent for everyday magnitudes. */
function fmtNum(v) {
  if (!isNum(v)) return DASH;
  const a = Math.abs(v);
  if (a >= 10000) return fmtInt(v);
  if (a === 0) return "0";
  if (a < 0.001) return v.toExponential(2);
  return String(Number(v.toPrecision(4)));
}

/** A metric value with its unit, the way the plots' legends and hover show it. */
function fmtValue(v, unit) {
  if (!isNum(v)) return DASH;
  switch (unit) {
    case "ms": return fmtMs(v);
    case "tokens/s": case "tok/s": return fmtInt(v) + " tok/s";
    case "%": return v.toFixed(1) + " %";
    case "fraction": case "ratio": return fmtPct(v);
    default: return fmtNum(v) + (unit ? " " + unit : "");
  }
}

/** Axis ticks: short (1.2k, 3.4M) so the axis stays narrow. */
function fmtAxis(v, unit) {
  if (!isNum(v)) return "";
  if (unit === "fraction" || unit === "ratio") return (v * 100).toFixed(0) + "%";
  const a = Math.abs(v);
  if (a >= 1e9) return fmtNum(v / 1e9) + "G";
  if (a >= 1e6) return fmtNum(v / 1e6) + "M";
  if (a >= 1e4) return fmtNum(v / 1e3) + "k";
  return fmtNum(v);
}

/** [0,1,2,3,8,9] -> "0-3, 8-9"; prefix applies to each item ("GPU0-3"). */
function fmtRanges(list, prefix = "") {
  const xs = [...new Set((list || []).filter(isNum))].sort((a, b) => a - b);
  const out = [];
  for (let i = 0; i < xs.length; i++) {
    let j = i;
    while (j + 1 < xs.length && xs[j + 1] === xs[j] + 1) j++;
    out.push(j > i ? `${prefix}${xs[i]}-${xs[j]}` : `${prefix}${xs[i]}`);
    i = j;
  }
  return out.join(", ");
}

function fmtProgress(step, total) {
  if (!isNum(step)) return DASH;
  return isNum(total) ? `${fmtInt(step)} / ${fmtInt(total)}` : fmtInt(step);
}

function progressCell(step, total) {
  const box = h("div", { class: "progress" }, h("span", { class: "num" }, fmtProgress(step, total)));
  if (isNum(step) && isNum(total) && total > 0) {
    const frac = Math.min(1, Math.max(0, step / total));
    const fill = h("div");
    fill.style.width = (frac * 100).toFixed(1) + "%";
    box.append(h("div", { class: "bar", title: fmtPct(frac) }, fill));
  }
  return box;
}

// ---------------------------------------------------------------- API, errors, readiness

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function getToken() {
  try { return localStorage.getItem(TOKEN_KEY) || ""; } catch { return ""; }
}

async function api(path) {
  const headers = { Accept: "application/json" };
  const token = getToken();
  if (token) headers.Authorization = "Bearer " + token;
  let res;
  try {
    res = await fetch(path, { headers, cache: "no-store" });
  } catch (e) {
    throw new HttpError(0, `cannot reach the controller (${e.message})`);
  }
  if (!res.ok) {
    let text = "";
    try { text = (await res.text()).trim(); } catch { /* keep the status line */ }
    throw new HttpError(res.status, text || `HTTP ${res.status} ${res.statusText}`.trim());
  }
  return res.json();
}

function errorBox() {
  let e = $("#error");
  if (!e) {
    e = h("div", { class: "error", id: "error", role: "alert" });
    document.body.insertBefore(e, document.body.firstChild);
  }
  return e;
}

function showError(err) {
  const e = errorBox();
  e.textContent = err && err.message ? err.message : String(err);
  e.hidden = false;
  if (err && err.status === 401) showTokenForm();
}

function clearError() {
  const e = $("#error");
  if (e && !e.hidden) {
    e.hidden = true;
    e.textContent = "";
  }
}

function showTokenForm() {
  if ($("#token-form")) return;
  const input = h("input", {
    type: "password", id: "token-input", name: "token", autocomplete: "off", required: true,
    placeholder: "bearer token",
  });
  const form = h("form", { id: "token-form", class: "token-form" },
    h("label", { for: "token-input" }, "Token"), input, h("button", { type: "submit" }, "Save"),
    getToken() ? muted("the stored token was refused") : null);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const v = input.value.trim();
    if (!v) return;
    try { localStorage.setItem(TOKEN_KEY, v); } catch { /* nothing to keep it in */ }
    location.reload();
  });
  app().prepend(form);
  input.focus();
}

function markReady() {
  const b = document.body.dataset;
  if (b.ready === "1") return;
  b.ready = "1";
  b.renderMs = String(Math.round(performance.now()));
}

/** The first load of a page failed. */
function fail(err) {
  if (document.body.dataset.ready !== "1") {
    const loading = $("#app > .loading");
    if (loading) loading.remove();
    document.body.dataset.ready = "error";
  }
  showError(err);
  if (!(err instanceof HttpError)) console.error(err);
}

/** Calls fn every ms (after the previous call finished), skipping while the tab is hidden. */
function every(ms, fn) {
  let timer = null;
  let stopped = false;
  const stop = () => { stopped = true; clearTimeout(timer); };
  const tick = async () => {
    if (stopped) return;
    if (!document.hidden) {
      try {
        await fn(stop);
        clearError();
      } catch (e) {
        showError(e); // keep what is on screen; the next tick may succeed
      }
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  timer = setTimeout(tick, ms);
  return stop;
}

/** Lets queued work (uPlot draws in a microtask after setData) finish before marking ready. */
const settle = () => new Promise((r) => setTimeout(r, 0));

export { TOKEN_KEY, REFRESH_MS, BUCKETS, PLOT_HEIGHT, LEGEND_MAX_SERIES, TERMINAL, h, fill, $, app, badge, table, td, num, muted, nf1, DASH, isNum, fmtInt, fmtMs, fmtPct, fmtDate, fmtDuration, fmtNum, fmtValue, fmtAxis, fmtRanges, progressCell, HttpError, getToken, api, showError, clearError, markReady, fail, every, settle };
