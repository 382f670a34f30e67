// trainyard web view: one script for every page, routed on location.pathname.
//
// Plain JavaScript, no build step, no framework; the only library is uPlot (global `uPlot`,
// vendored under /assets/). Every string that comes from the API reaches the page through
// textContent, Text nodes or setAttribute, never through innerHTML.
//
// Contract with the tests: when a page has loaded and rendered all its data it sets
// body[data-ready="1"] and body[data-render-ms] (performance.now() at that moment); when the
// first load failed it sets body[data-ready="error"]. Auto-refreshes never reset either.
"use strict";

(() => {
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
      renderRanks(ranksBody, j.ranks || [], new Set((j.diagnosis && j.diagnosis.stragglers) || []));
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

  function renderDiagnosis(box, d) {
    const head = h("h2", null, "Diagnosis");
    if (!d) {
      fill(box, head, muted("no diagnosis yet"));
      return;
    }
    const stragglers = d.stragglers || [];
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
})();
