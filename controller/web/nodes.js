// trainyard web view, nodes.js: the nodes page (inventory, NUMA, links, preflight, state). An ES
// module of the page (see app.js); strings from the API reach the page through textContent, Text
// nodes or setAttribute, never through innerHTML.

import { REFRESH_MS, h, fill, $, app, badge, table, td, num, muted, DASH, fmtInt, fmtDate, fmtRanges, api, markReady, every, settle } from "./common.js";

// ---------------------------------------------------------------- page: nodes

async function pageNodes() {
  document.title = "trainyard · nodes";
  const { table: t, tbody } = table("nodes", "grid", [
    "Node", "State", "Address", "GPUs", "Class", "Preflight", "NUMA", ["Running ranks", true],
  ]);
  const details = h("div", { class: "node-details" });
  const render = (data) => {
    const open = new Set([...details.querySelectorAll("details[open]")].map((d) => d.dataset.node));
    const first = !details.childElementCount;
    const nodes = data.nodes || [];
    fill(tbody, ...nodes.map((n) => h("tr", { dataset: { node: n.agent_id } },
      td(n.agent_id, "name"),
      td(badge(n.state)),
      td(n.address || DASH, "mono"),
      td([h("span", { class: "num" }, fmtInt(n.gpus)), " ", muted(n.gpu_model || "")]),
      td(n.interconnect_class || DASH),
      td([badge(n.verdict || "none"), " ", muted(n.preflight_level || "")]),
      td(numaSummary(n.numa), "mono"),
      num(fmtInt(n.running_ranks)))));
    if (!nodes.length) tbody.append(h("tr", { class: "empty" }, h("td", { colspan: 8 }, "no nodes")));
    fill(details, ...nodes.map((n) => nodeDetail(n,
      first ? (n.failing || []).length > 0 : open.has(n.agent_id))));
  };
  render(await api("/api/nodes"));
  fill(app(), h("div", { class: "page-head" }, h("h1", null, "Nodes"), h("a", { href: "/" }, "← Jobs")), t, details);
  await settle();
  markReady();
  every(REFRESH_MS, async () => render(await api("/api/nodes")));
}

function numaSummary(numa) {
  if (!numa || !numa.length) return DASH;
  return numa.map((n) => `${n.node}: ${(n.gpus || []).length ? fmtRanges(n.gpus, "GPU") : "no GPU"}`).join(" | ");
}

/** Colors a topology cell by link kind: NVLink, PCIe switch, across host bridge/NUMA. */
function linkKind(code) {
  const c = String(code || "").toUpperCase();
  if (c === "X") return "self";
  if (c.startsWith("NV")) return "nvlink";
  if (c === "PIX" || c === "PXB") return "pcie";
  if (c === "PHB" || c === "NODE") return "host";
  if (c === "SYS") return "sys";
  return "other";
}

function nodeDetail(n, open) {
  const m = n.matrix;
  let matrix;
  if (m && m.rows && m.rows.length) {
    const labels = m.labels || [];
    matrix = h("table", { class: "matrix" },
      h("thead", null, h("tr", null, h("th"), labels.map((l) => h("th", null, l)))),
      h("tbody", null, m.rows.map((row, i) => h("tr", null, h("th", null, labels[i] ?? String(i)),
        row.map((c) => h("td", { dataset: { link: linkKind(c) } }, c))))));
  } else {
    matrix = muted("topology unknown");
  }
  const numa = (n.numa || []).map((x) => h("li", null, `NUMA ${x.node}: `,
    (x.gpus || []).length ? fmtRanges(x.gpus, "GPU") : "no GPU", " · CPUs ", h("span", { class: "mono" }, x.cpus || DASH)));
  const failing = n.failing || [];
  const checks = failing.length
    ? h("ul", { class: "checks" }, failing.map((c) => h("li", { class: "check", dataset: { check: c.id } },
      badge(c.status), " ", h("code", null, c.id), " ", c.detail || "",
      c.remedy ? h("div", { class: "remedy" }, h("b", null, "remedy: "), c.remedy) : null)))
    : muted("no failing checks");
  return h("details", { class: "node-detail", dataset: { node: n.agent_id }, open: open || null },
    h("summary", null, h("b", null, n.agent_id), " ", badge(n.verdict || "none"),
      muted(` ${n.gpu_model || ""} · preflight ${n.preflight_level || DASH} at ${fmtDate(n.preflight_at_ms)}` +
        (failing.length ? ` · ${failing.length} failing` : ""))),
    h("div", { class: "node-body" },
      h("div", null, h("h3", null, "Topology"), matrix),
      h("div", null, h("h3", null, "NUMA"), numa.length ? h("ul", { class: "plain" }, numa) : muted("unknown"),
        h("h3", null, "Failing checks"), checks)));
}

export { pageNodes };
