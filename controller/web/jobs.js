// trainyard web view, jobs.js: the jobs page and one job's page (header, goodput, diagnosis,
// findings, plots, telemetry, ranks, events). An ES module of the page (see app.js); strings from
// the API reach the page through textContent, Text nodes or setAttribute, never through innerHTML.

import { REFRESH_MS, TERMINAL, h, fill, $, app, badge, table, td, num, muted, DASH, isNum, fmtInt, fmtPct, fmtDate, fmtDuration, fmtNum, fmtRanges, progressCell, api, showError, clearError, markReady, every, settle } from "./common.js";
import { palette, plots, Plot, seriesUrl, perRankData, metricTitle } from "./plots.js";

// ---------------------------------------------------------------- page: jobs

async function pageJobs() {
  document.title = "trainyard · jobs";
  const { table: t, tbody } = table("jobs", "grid", [
    ["ID", true], "Name", "State", "User", ["GPUs", true], ["Age", true], "Progress", ["Goodput", true],
  ]);
  const updated = muted("");
  const render = (data) => {
    const now = data.now_ms;
    const rows = (data.jobs || []).map((j) => h("tr", { dataset: { jobId: j.id } },
      num(h("a", { href: `/jobs/${encodeURIComponent(j.id)}` }, String(j.id))),
      td(j.name, "name"),
      td(badge(j.state, j.reason || null)),
      td(j.user),
      num(fmtInt(j.gpus)),
      num(fmtDuration(now - j.created_at_ms)),
      td(progressCell(j.step, j.total_steps)),
      num(fmtPct(j.goodput))));
    if (!rows.length) rows.push(h("tr", { class: "empty" }, h("td", { colspan: 8 }, "no jobs")));
    fill(tbody, ...rows);
    updated.textContent = `updated ${fmtDate(isNum(now) ? now : Date.now())}`;
  };
  const data = await api("/api/jobs");
  render(data);
  fill(app(),
    h("div", { class: "page-head" }, h("h1", null, "Jobs"), h("a", { href: "/nodes" }, "Nodes →"), updated),
    t,
    compareForm("", ""));
  await settle();
  markReady();
  every(REFRESH_MS, async () => render(await api("/api/jobs")));
}

function compareForm(a, b) {
  const input = (name, value) => h("input", {
    type: "number", name, min: 1, step: 1, required: true, value: value || null, placeholder: "job id",
    "aria-label": `job ${name.toUpperCase()}`,
  });
  return h("form", { class: "compare-form", id: "compare-form", action: "/compare", method: "get" },
    h("span", null, "compare"), input("a", a), h("span", null, "vs"), input("b", b),
    h("button", { type: "submit" }, "Compare"));
}

// ---------------------------------------------------------------- page: one job

async function pageJob(id) {
  document.title = `trainyard · job ${id}`;
  let job = await api(`/api/jobs/${id}`);

  const headBox = h("section", { id: "job-header", class: "card" });
  const diagBox = h("section", { id: "diagnosis", class: "card" });
  const plotsBox = h("section", { id: "plots", class: "plots" });
  const findingsBox = h("section", { id: "live-findings-section", class: "card" });
  const telemetry = telemetrySection(id);
  const ranksBox = h("section", { id: "ranks-section" });
  const eventsBox = h("section", { id: "events-section" });
  const logsHead = h("h2", null, "Logs");
  const logs = h("pre", { id: "logs", class: "logs" });
  const { table: ranksT, tbody: ranksBody } = table("ranks", "grid", [
    ["Rank", true], "Node", ["GPU", true], ["NUMA", true], "CPUs", "State", ["PID", true], ["Exit", true], "Message",
  ]);
  const { table: eventsT, tbody: eventsBody } = table("events", "grid", ["Time", "State", ["Attempt", true], "Reason"]);
  ranksBox.append(h("h2", null, "Ranks"), ranksT);
  eventsBox.append(h("h2", null, "Events"), eventsT);

  let metricsKey = "";
  let jobPlots = [];
  const buildPlots = (metrics) => {
    jobPlots.forEach((p) => p.dispose());
    jobPlots = metrics.map((m) => {
      const p = new Plot(`plot-${m}`, metricTitle(m, ""), async (range) => {
        const resp = await api(seriesUrl(id, m, range));
        p.setTitle(metricTitle(m, resp.unit));
        return perRankData(resp);
      });
      return p;
    });
    fill(plotsBox, ...jobPlots.map((p) => p.el));
    metricsKey = JSON.stringify(metrics);
  };

  const render = (j) => {
    document.title = `trainyard · job ${j.id} ${j.name}`;
    renderJobHeader(headBox, j);
    renderDiagnosis(diagBox, j.diagnosis);
    renderFindings(findingsBox, j.findings || []);
    const stepPlot = jobPlots.find((p) => p.el.id === "plot-step_ms");
    if (stepPlot) stepPlot.setBands(findingBands(j));
    renderRanks(ranksBody, j.ranks || [], new Set(stragglersOf(j.diagnosis)));
    renderEvents(eventsBody, j.events || []);
    const atBottom = logs.scrollHeight - logs.scrollTop - logs.clientHeight < 8;
    logsHead.textContent = j.logs ? `Logs (rank ${j.logs.rank}, last lines)` : "Logs";
    logs.textContent = j.logs && j.logs.text ? j.logs.text : "no logs yet";
    if (atBottom) logs.scrollTop = logs.scrollHeight;
  };

  fill(app(), headBox, diagBox, findingsBox, plotsBox, telemetry.el,
    h("div", { class: "job-lower" }, ranksBox, h("div", null, eventsBox, h("section", null, logsHead, logs))));
  buildPlots(job.metrics || []);
  render(job);
  await Promise.all([...jobPlots.map((p) => p.load(null)), telemetry.load()]);
  await settle();
  markReady();

  if (TERMINAL.has(job.state)) return;
  // The series are the heavy part (64 ranks x 800 buckets is ~1 MB): ask for them again
  // only when the job moved on.
  const progressKey = (j) => JSON.stringify([j.step, j.attempt, j.state]);
  let plotted = progressKey(job);
  every(REFRESH_MS, async (stop) => {
    job = await api(`/api/jobs/${id}`);
    render(job);
    let stale = progressKey(job) !== plotted;
    if (JSON.stringify(job.metrics || []) !== metricsKey) {
      buildPlots(job.metrics || []);
      stale = true;
    }
    if (stale) {
      await Promise.all([...jobPlots.map((p) => p.load()), telemetry.load()]);
      plotted = progressKey(job);
    }
    if (TERMINAL.has(job.state)) stop();
  });
}

function fact(label, ...value) {
  return h("div", { class: "fact" }, h("dt", null, label), h("dd", null, ...value));
}

const PART_COLORS = {
  training: "#16a34a", startup: "#d97706", eval: "#2563eb", checkpoint: "#7c3aed",
  restart: "#dc2626", restarting: "#dc2626", lost: "#dc2626", idle: "#9ca3af", other: "#9ca3af",
};
const EXTRA_PART_COLORS = ["#0891b2", "#db2777", "#65a30d", "#ea580c", "#4f46e5", "#6b7280"];

function goodputView(g) {
  if (!g) return [DASH];
  const wall = g.wall_ms;
  const parts = (g.parts || []).filter((p) => isNum(p.ms) && p.ms > 0);
  const out = [h("span", { class: "num" }, fmtPct(g.fraction)), muted(` of ${fmtDuration(wall)}`)];
  if (parts.length && isNum(wall) && wall > 0) {
    const bar = h("div", { class: "stack" });
    const legend = h("ul", { class: "parts" });
    let extra = 0;
    for (const p of parts) {
      const color = PART_COLORS[p.name] || EXTRA_PART_COLORS[extra++ % EXTRA_PART_COLORS.length];
      const seg = h("div", { title: `${p.name}: ${fmtDuration(p.ms)} (${fmtPct(p.ms / wall)})` });
      seg.style.width = Math.min(100, (p.ms / wall) * 100).toFixed(2) + "%";
      seg.style.background = color;
      bar.append(seg);
      const sw = h("i");
      sw.style.background = color;
      legend.append(h("li", null, sw, `${p.name} `, h("span", { class: "num" }, `${fmtDuration(p.ms)} · ${fmtPct(p.ms / wall)}`)));
    }
    out.push(bar, legend);
  }
  return out;
}

function renderJobHeader(box, j) {
  const nodes = [...new Set((j.ranks || []).map((r) => r.agent_id).filter(Boolean))];
  const total = isNum(j.total_steps) && j.total_steps > 0 ? j.total_steps : null;
  fill(box,
    h("div", { class: "page-head" },
      h("h1", null, muted(`job ${j.id} `), h("span", { class: "job-name" }, j.name), " ", badge(j.state)),
      j.state && !TERMINAL.has(j.state) ? muted("refreshing every 5 s") : null),
    j.reason ? h("p", { class: "reason" }, j.reason) : null,
    h("dl", { class: "facts" },
      fact("user", j.user),
      fact("GPUs", h("span", { class: "num" }, fmtInt(j.gpus))),
      fact("attempt", h("span", { class: "num" }, fmtInt(j.attempt))),
      fact("progress", progressCell(j.step, total),
        total ? muted(` ${fmtPct(j.step / total)}`) : null),
      fact("nodes", nodes.length ? nodes.join(", ") : DASH),
      fact("created", h("span", { class: "num" }, fmtDate(j.created_at_ms))),
      fact("updated", h("span", { class: "num" }, fmtDate(j.updated_at_ms))),
      fact("spec", h("code", null, j.spec_summary || DASH))),
    h("div", { class: "goodput" }, h("span", { class: "label" }, "goodput"), ...goodputView(j.goodput)));
}

function renderFinding(f) {
  const ev = (f.evidence || []).map((e) => h("li", null, `${e.name} `,
    h("span", { class: "num" }, e.unit === "x" ? `${fmtNum(e.value)}×` : `${fmtNum(e.value)}${e.unit ? " " + e.unit : ""}`)));
  const row = (label, value) => (value == null || value === "" ? null : h("div", { class: "fact" }, h("dt", null, label), h("dd", null, value)));
  return h("div", { class: "finding", dataset: { cause: f.cause } },
    h("div", { class: "finding-head" }, h("code", { class: "cause" }, f.cause), " ", h("span", null, f.summary)),
    h("dl", { class: "facts" },
      row("nodes", (f.nodes || []).join(", ")),
      row("ranks", fmtRanges(f.ranks)),
      row("evidence", ev.length ? h("ul", { class: "evidence" }, ev) : null),
      row("expected cost", f.expected_cost),
      row("remedy", f.remedy)));
}

/** The ranks the diagnosis names as stragglers (its ranks carry the flag). */
function stragglersOf(d) {
  return ((d && d.ranks) || []).filter((r) => r.straggler).map((r) => r.rank);
}

function renderDiagnosis(box, d) {
  const head = h("h2", null, "Diagnosis");
  if (!d) {
    fill(box, head, muted("no diagnosis yet"));
    return;
  }
  const stragglers = stragglersOf(d);
  fill(box,
    head,
    h("p", { class: d.healthy ? "verdict healthy" : "verdict unhealthy" }, d.verdict),
    h("p", { class: "stragglers" }, "stragglers: ",
      stragglers.length ? h("span", { class: "num" }, "rank " + fmtRanges(stragglers)) : muted("none")),
    (d.findings || []).map(renderFinding));
}

/** The live diagnosis's findings: what it saw, where, since which step, open or closed. */
function renderFindings(box, findings) {
  const head = h("h2", null, "Live findings");
  if (!findings.length) {
    fill(box, head, muted("none: the live diagnosis has found nothing during this attempt"));
    return;
  }
  const { table: t, tbody } = table("live-findings", "grid", ["Cause", "Where", "Steps", "State", "Summary"]);
  fill(tbody, ...findings.map((f) => {
    const steps = isNum(f.first_step) ? `${fmtInt(f.first_step)}–${isNum(f.last_step) ? fmtInt(f.last_step) : ""}` : DASH;
    const open = f.closed_at_ms == null;
    return h("tr", { dataset: { findingId: f.id }, class: open ? "open" : null, title: f.remedy || "" },
      td(f.cause, "mono"), td(f.subject), num(steps), td(badge(open ? "open" : "closed")), td(f.summary, "msg"));
  }));
  fill(box, head, t);
}

/** The step-time plot's bands: each finding from its first to its last step. */
function findingBands(j) {
  return (j.findings || []).filter((f) => isNum(f.first_step)).map((f) => ({
    from: f.first_step,
    to: isNum(f.last_step) ? f.last_step : f.first_step,
    label: `${f.cause} ${f.subject}`,
    open: f.closed_at_ms == null,
  }));
}

const TELEMETRY = [["sm_clock", "SM clock"], ["power", "Power"], ["temp", "GPU temperature"]];

/**
 * A node's GPU telemetry during the job, against steps (under the step plots): a node picker
 * and one plot per metric. load() refreshes them all.
 */
function telemetrySection(id) {
  let node = null;
  const picker = h("select", { id: "telemetry-node", "aria-label": "node" });
  const note = muted("");
  const plots = TELEMETRY.map(([m, title]) => new Plot(`plot-telemetry-${m}`, title, async () => {
    const q = `/api/jobs/${id}/telemetry?metric=${m}` + (node ? `&node=${encodeURIComponent(node)}` : "");
    const resp = await api(q);
    if (resp.node && !node) node = resp.node;
    const nodes = resp.nodes || [];
    if (picker.options.length !== nodes.length) {
      fill(picker, ...nodes.map((n) => h("option", { value: n, selected: n === node ? true : null }, n)));
    }
    note.textContent = nodes.length ? "" : "no GPU telemetry for this attempt (agents without NVML, or --telemetry off)";
    if (!resp.x || !resp.x.length) return null;
    const colors = palette(resp.series.length);
    p_title(m, title, resp.unit);
    return {
      unit: resp.unit,
      x: resp.x,
      series: resp.series.map((s, k) => ({ label: s.label, color: colors[k], values: s.values, width: 1.5 })),
      info: `${resp.node} · per telemetry window`,
    };
  }));
  const p_title = (m, title, unit) => {
    const p = plots.find((x) => x.el.id === `plot-telemetry-${m}`);
    if (p) p.setTitle(`${title} (${unit})`);
  };
  picker.addEventListener("change", () => {
    node = picker.value;
    Promise.all(plots.map((p) => p.load(null))).then(clearError, showError);
  });
  const el = h("section", { id: "telemetry", class: "plots" },
    h("h2", null, "GPU telemetry ", picker), note, ...plots.map((p) => p.el));
  return { el, load: () => Promise.all(plots.map((p) => p.load(null))) };
}

function renderRanks(tbody, ranks, stragglers) {
  fill(tbody, ...ranks.map((r) => {
    const exit = r.exit_code;
    return h("tr", { dataset: { rank: r.rank }, class: stragglers.has(r.rank) ? "straggler" : null },
      num([String(r.rank), stragglers.has(r.rank) ? h("span", { class: "tag", title: "straggler" }, "slow") : null]),
      td(r.agent_id),
      num(fmtInt(r.gpu_index)),
      num(fmtInt(r.numa_node)),
      td(r.cpus || DASH, "mono"),
      td(badge(r.state)),
      num(fmtInt(r.pid)),
      td(isNum(exit) ? String(exit) : DASH, isNum(exit) && exit !== 0 ? "num bad" : "num"),
      td(r.message || "", "msg"));
  }));
  if (!ranks.length) tbody.append(h("tr", { class: "empty" }, h("td", { colspan: 9 }, "not placed yet")));
}

function renderEvents(tbody, events) {
  fill(tbody, ...events.map((e) => h("tr", { dataset: { atMs: e.at_ms } },
    td(fmtDate(e.at_ms), "mono"), td(badge(e.state)), num(fmtInt(e.attempt)), td(e.reason || ""))));
}

export { pageJobs, compareForm, pageJob, renderFinding };
