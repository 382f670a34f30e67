// trainyard web view, compare.js: the comparison page: two runs side by side, their series
// overlaid. An ES module of the page (see app.js); strings from the API reach the page through
// textContent, Text nodes or setAttribute, never through innerHTML.

import { h, fill, $, app, badge, table, td, num, muted, nf1, DASH, isNum, fmtInt, fmtMs, api, markReady, settle } from "./common.js";
import { plots, Plot, seriesUrl, medianOverRanks } from "./plots.js";
import { compareForm, renderFinding } from "./jobs.js";

// ---------------------------------------------------------------- page: compare

async function pageCompare() {
  document.title = "trainyard · compare";
  const q = new URLSearchParams(location.search);
  const a = (q.get("a") || "").trim();
  const b = (q.get("b") || "").trim();
  const valid = (s) => /^\d+$/.test(s);
  if (!valid(a) || !valid(b)) {
    fill(app(), h("h1", null, "Compare two jobs"),
      h("p", { class: "muted" }, "Pick two job ids: placement, environment, versions and step times side by side."),
      compareForm(a, b));
    await settle();
    markReady();
    return;
  }
  document.title = `trainyard · job ${a} vs ${b}`;
  const c = await api(`/api/compare?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
  const A = c.a || {};
  const B = c.b || {};
  const label = (s, fallback) => `job ${s.job_id ?? fallback}`;

  const { table: t, tbody } = table("compare", "grid sides", ["", label(A, a), label(B, b)]);
  const side = (fn) => [fn(A), fn(B)];
  const row = (name, [x, y], differ) => h("tr", { class: differ ? "diff" : null }, h("th", null, name), td(x), td(y));
  const stat = (s, k, f) => (s && isNum(s[k]) ? f(s[k]) : DASH);
  const steps = (s) => h("span", { class: "num" },
    `${stat(s.step_time_ms, "p10", (v) => nf1.format(v))} / ${stat(s.step_time_ms, "p50", (v) => nf1.format(v))} / ${stat(s.step_time_ms, "p90", fmtMs)}`,
    s.step_time_ms && isNum(s.step_time_ms.n) ? muted(` (n=${fmtInt(s.step_time_ms.n)})`) : null);
  const nodesOf = (s) => (s.nodes || []).map((n) => h("div", { class: "side-node" },
    h("b", null, n.agent_id), ` · ${fmtInt(n.ranks)} ranks · NUMA `, h("span", { class: "mono" }, n.numa_layout || DASH),
    ` · ${n.interconnect_class || DASH} `, badge(n.verdict || "none")));
  const findingsOf = (s) => {
    const d = s.diagnosis;
    if (!d) return muted("no diagnosis");
    return [h("div", { class: d.healthy ? "verdict healthy" : "verdict unhealthy" }, d.verdict),
      (d.findings || []).map(renderFinding)];
  };
  const key = (s) => JSON.stringify((s.nodes || []).map((n) => [n.agent_id, n.ranks, n.numa_layout, n.interconnect_class]));
  tbody.append(
    row("name", side((s) => s.job_id != null
      ? h("a", { href: `/jobs/${encodeURIComponent(s.job_id)}` }, s.name || String(s.job_id)) : s.name)),
    row("state", side((s) => [badge(s.state), muted(` attempt ${fmtInt(s.attempt)}`)])),
    row("nodes", side(nodesOf), key(A) !== key(B)),
    row("step time p10 / p50 / p90", side(steps)),
    row("tokens/s p50", side((s) => h("span", { class: "num" }, stat(s.tokens_per_s, "p50", fmtInt)))),
    row("findings", side(findingsOf)));

  const diffTable = (id, rows, empty) => {
    const { table: dt, tbody: db } = table(id, "grid diff-table", ["name", label(A, a), label(B, b)]);
    const cell = (v) => (v == null || v === "" ? td(muted("unset")) : td(v, "mono"));
    db.append(...(rows || []).map((r) => h("tr", { class: (r.a ?? "") !== (r.b ?? "") ? "diff" : null },
      td(r.name, "mono"), cell(r.a), cell(r.b))));
    if (!(rows || []).length) db.append(h("tr", { class: "empty" }, h("td", { colspan: 3 }, empty)));
    return dt;
  };

  const ratio = isNum(c.step_time_ratio) ? h("p", { class: "ratio" }, "step-time ratio (B / A): ",
    h("span", { class: "num" }, c.step_time_ratio.toFixed(2) + "×")) : null;
  const diffs = (c.differences || []).length
    ? h("ul", { id: "differences", class: "differences" }, c.differences.map((d) => h("li", null, d))) : null;

  const plot = new Plot("plot-compare", "Step time, median over ranks (ms)", async (range) => {
    const [ra, rb] = await Promise.all([a, b].map((j) => api(seriesUrl(j, "step_ms", range))));
    return overlayData([[label(A, a), ra], [label(B, b), rb]]);
  });

  fill(app(),
    h("div", { class: "page-head" }, h("h1", null, `Job ${a} vs job ${b}`), compareForm(a, b)),
    h("p", { id: "verdict", class: "verdict" }, c.verdict || DASH),
    ratio, diffs, t,
    h("section", { class: "plots one" }, plot.el),
    h("div", { class: "two-col" },
      h("section", null, h("h2", null, "Environment"), diffTable("env-diff", c.env, "no differences")),
      h("section", null, h("h2", null, "Provenance"), diffTable("provenance-diff", c.provenance, "nothing recorded"))));
  await plot.load(null);
  await settle();
  markReady();
}

/** Two jobs' median step times on one x axis (bucket centres), gaps where one has none. */
function overlayData(sides) {
  const meds = sides.map(([, resp]) => {
    const half = isNum(resp.bucket_steps) ? resp.bucket_steps / 2 : 0;
    const m = medianOverRanks(resp);
    return new Map([...m].map(([s, v]) => [s + half, v]));
  });
  const xs = [...new Set(meds.flatMap((m) => [...m.keys()]))].sort((p, q) => p - q);
  if (!xs.length) return null;
  const colors = ["#2563eb", "#dc2626"];
  const bs = sides.map(([, r]) => r.bucket_steps).filter(isNum);
  return {
    unit: sides[0][1].unit || "ms",
    x: xs,
    series: sides.map(([name], i) => ({
      label: name, color: colors[i], width: 1.5, values: xs.map((x) => meds[i].get(x) ?? null),
    })),
    info: bs.length ? `${fmtInt(Math.max(...bs))} steps/bucket` : "",
  };
}

export { pageCompare };
