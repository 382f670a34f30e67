// trainyard web view, plots.js: plots: uPlot charts of a job's series, per rank or as the median
// over ranks, with bands. An ES module of the page (see app.js); strings from the API reach the
// page through textContent, Text nodes or setAttribute, never through innerHTML.

import { BUCKETS, PLOT_HEIGHT, LEGEND_MAX_SERIES, h, fill, $, isNum, fmtInt, fmtValue, fmtAxis, api, showError, clearError, every } from "./common.js";

// ---------------------------------------------------------------- plots

/** Distinct colors for n series: golden-angle hues, alternating lightness. */
function palette(n) {
  const out = [];
  for (let i = 0; i < n; i++) {
    const hue = Math.round((i * 137.508 + 210) % 360);
    out.push(`hsl(${hue}, 70%, ${i % 2 ? 52 : 40}%)`);
  }
  return out;
}

const plots = new Set();
let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => plots.forEach((p) => p.resize()), 150);
});

/**
 * One chart in <div class="plot" id=...>: a title line and a body uPlot draws into.
 * load(range) asks fetchData(range) for {unit, x, series: [{label, color, values, width}]}
 * or null (no data yet); range is null (everything) or {from, to} in steps. Dragging on the
 * plot loads the selected range again from the server (more detail); double-click resets.
 */
class Plot {
  constructor(id, title, fetchData) {
    this.fetchData = fetchData;
    this.bands = [];
    this.range = null;
    this.seq = 0;
    this.u = null;
    this.shape = "";
    this.unit = "";
    this.titleText = h("span", { class: "plot-name" }, title);
    this.info = h("span", { class: "plot-info" });
    this.hover = h("span", { class: "plot-hover" });
    this.resetBtn = h("button", { type: "button", class: "link", hidden: true, title: "show every step" }, "reset zoom");
    this.resetBtn.addEventListener("click", () => this.reload(null));
    this.body = h("div", { class: "plot-body" });
    this.el = h("div", { class: "plot", id },
      h("div", { class: "plot-title" }, this.titleText, this.info, this.resetBtn, this.hover),
      this.body);
    plots.add(this);
  }

  setTitle(t) { this.titleText.textContent = t; }

  /** Shaded step ranges (live findings): [{from, to, label, open}]. */
  setBands(bands) {
    const key = JSON.stringify(bands);
    if (key === JSON.stringify(this.bands)) return;
    this.bands = bands;
    this.el.dataset.bands = String(bands.length);
    if (this.u) this.u.redraw(false);
  }

  drawBands(u) {
    const ctx = u.ctx;
    const { top, height } = u.bbox;
    ctx.save();
    for (const b of this.bands) {
      const x0 = u.valToPos(b.from, "x", true);
      const x1 = u.valToPos(Math.max(b.to, b.from + 1), "x", true);
      ctx.fillStyle = b.open ? "rgba(220, 38, 38, 0.14)" : "rgba(217, 119, 6, 0.12)";
      ctx.fillRect(x0, top, Math.max(2, x1 - x0), height);
    }
    ctx.restore();
  }

  async load(range = this.range) {
    const seq = ++this.seq;
    const d = await this.fetchData(range);
    if (seq !== this.seq) return; // a newer request (zoom, reset) won
    this.range = range;
    this.render(d);
  }

  /** load() for user actions: errors go to the error box instead of the caller. */
  reload(range) {
    this.load(range).then(clearError, showError);
  }

  render(d) {
    this.resetBtn.hidden = !this.range;
    if (!d || !d.series.length || !d.x.length) {
      this.destroyChart();
      this.info.textContent = "";
      fill(this.body, h("p", { class: "empty" }, "no steps yet"));
      return;
    }
    this.unit = d.unit || "";
    const data = [d.x, ...d.series.map((s) => s.values)];
    const shape = JSON.stringify([this.unit, d.series.map((s) => [s.label, s.color])]);
    this.info.textContent = d.info || "";
    if (this.u && shape === this.shape) {
      this.u.setData(data);
      return;
    }
    this.destroyChart();
    this.shape = shape;
    this.body.replaceChildren(); // uPlot appends its own root
    this.u = new uPlot(this.options(d), data, this.body);
    this.u.over.addEventListener("dblclick", () => this.reload(null));
  }

  options(d) {
    const unit = this.unit;
    const many = d.series.length > LEGEND_MAX_SERIES;
    return {
      width: this.width(),
      height: PLOT_HEIGHT,
      legend: { show: !many, live: true },
      focus: { alpha: 0.25 },
      cursor: {
        drag: { x: true, y: false, setScale: false },
        bind: { dblclick: () => null }, // our own handler asks the server for the full range
        points: { show: !many },
        focus: { prox: 24 },
      },
      scales: { x: { time: false } },
      series: [
        { label: "step", value: (u, v) => fmtInt(v) },
        ...d.series.map((s) => ({
          label: s.label,
          stroke: s.color,
          width: s.width || 1,
          spanGaps: true,
          points: { show: false },
          value: (u, v) => fmtValue(v, unit),
        })),
      ],
      axes: [
        { values: (u, splits) => splits.map((v) => fmtAxis(v, "")), size: 30 },
        { values: (u, splits) => splits.map((v) => fmtAxis(v, unit)), size: 56 },
      ],
      hooks: {
        drawClear: [(u) => this.drawBands(u)],
        setSelect: [(u) => this.onSelect(u)],
        setCursor: [(u) => this.onCursor(u, many)],
      },
    };
  }

  onSelect(u) {
    const { left, width } = u.select;
    if (width < 4) return;
    const lo = u.posToVal(left, "x");
    const hi = u.posToVal(left + width, "x");
    u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
    const from = Math.max(0, Math.floor(lo));
    const to = Math.ceil(hi);
    if (!(to > from)) return;
    u.setScale("x", { min: lo, max: hi }); // at once, from what is loaded; detail follows
    this.reload({ from, to });
  }

  /** Without a legend (many series), names the series nearest the cursor and its value. */
  onCursor(u, many) {
    if (!many) return;
    const i = u.cursor.idx;
    const top = u.cursor.top;
    if (i == null || top == null || top < 0) {
      this.hover.textContent = "";
      return;
    }
    const y = u.posToVal(top, "y");
    let best = -1;
    let bestDist = Infinity;
    for (let s = 1; s < u.data.length; s++) {
      const v = u.data[s][i];
      if (v == null || !u.series[s].show) continue;
      const dist = Math.abs(v - y);
      if (dist < bestDist) { bestDist = dist; best = s; }
    }
    this.hover.textContent = best < 0 ? "" :
      `${u.series[best].label} · step ${fmtInt(u.data[0][i])} · ${fmtValue(u.data[best][i], this.unit)}`;
  }

  width() { return Math.max(240, this.body.clientWidth || this.el.clientWidth || 600); }

  resize() {
    if (this.u && this.el.isConnected) this.u.setSize({ width: this.width(), height: PLOT_HEIGHT });
  }

  destroyChart() {
    if (this.u) {
      this.u.destroy();
      this.u = null;
      this.shape = "";
    }
  }

  dispose() {
    this.destroyChart();
    plots.delete(this);
  }
}

function seriesUrl(jobId, metric, range) {
  const q = new URLSearchParams({ metric, buckets: String(BUCKETS) });
  if (range) {
    q.set("from", String(range.from));
    q.set("to", String(range.to));
  }
  return `/api/jobs/${encodeURIComponent(jobId)}/series?${q}`;
}

function bucketInfo(resp) {
  const bs = resp.bucket_steps;
  const r = `steps ${fmtInt(resp.from)}–${fmtInt(resp.to)}`;
  return isNum(bs) && bs > 1 ? `${r} · ${fmtInt(bs)} steps/bucket` : r;
}

/**
 * The series response as one line per rank through each bucket's min and max: x = first step
 * of the bucket (y = min) and first step + half a bucket (y = max), so spikes survive.
 */
function perRankData(resp) {
  const ranks = (resp.ranks || []).filter((r) => r.points && r.points.length);
  if (!ranks.length) return null;
  const bs = isNum(resp.bucket_steps) && resp.bucket_steps > 0 ? resp.bucket_steps : 1;
  const half = bs / 2;
  const first = ranks[0].points;
  const aligned = ranks.every((r) => r.points.length === first.length &&
    r.points[0][0] === first[0][0] && r.points[r.points.length - 1][0] === first[first.length - 1][0]);
  let starts;
  let index = null;
  if (aligned) {
    starts = first.map((p) => p[0]);
  } else {
    const set = new Set();
    for (const r of ranks) for (const p of r.points) set.add(p[0]);
    starts = [...set].sort((a, b) => a - b);
    index = new Map(starts.map((s, i) => [s, i]));
  }
  const n = starts.length;
  const x = new Array(2 * n);
  for (let i = 0; i < n; i++) {
    x[2 * i] = starts[i];
    x[2 * i + 1] = starts[i] + half;
  }
  const colors = palette(ranks.length);
  const series = ranks.map((r, k) => {
    const values = new Array(2 * n).fill(null);
    const pts = r.points;
    for (let j = 0; j < pts.length; j++) {
      const p = pts[j];
      const i = index ? index.get(p[0]) : j;
      values[2 * i] = p[1];
      values[2 * i + 1] = p[2];
    }
    return { label: `rank ${r.rank}`, color: colors[k], values, width: ranks.length > 8 ? 1 : 1.5 };
  });
  return { unit: resp.unit || "", x, series, info: bucketInfo(resp) };
}

/** Per bucket, the median over ranks of each rank's mean: Map(first step -> value). */
function medianOverRanks(resp) {
  const byStep = new Map();
  for (const r of resp.ranks || []) {
    for (const p of r.points || []) {
      if (!isNum(p[3])) continue;
      let a = byStep.get(p[0]);
      if (!a) byStep.set(p[0], (a = []));
      a.push(p[3]);
    }
  }
  const out = new Map();
  for (const [step, vals] of byStep) {
    vals.sort((a, b) => a - b);
    const m = vals.length >> 1;
    out.set(step, vals.length % 2 ? vals[m] : (vals[m - 1] + vals[m]) / 2);
  }
  return out;
}

const METRIC_TITLES = { step_ms: "Step time", loss: "Loss", tokens_per_s: "Throughput", mfu: "MFU" };
const metricTitle = (m, unit) => (METRIC_TITLES[m] || m) + (unit ? ` (${unit})` : "");

export { palette, plots, Plot, seriesUrl, perRankData, medianOverRanks, metricTitle };
