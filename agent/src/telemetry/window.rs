//! Samples into windows: per GPU, every `window` of samples becomes one [`GpuWindow`] with
//! gauges as min/mean/max, throttle reasons OR-ed, counters as deltas and XIDs listed. Pure, so
//! the arithmetic is tested without a GPU.
//!
//! A counter's delta is taken against its last reading in the previous window, so an error
//! that happens between two windows is counted once; a counter that went down (a driver
//! reload resets them) counts from zero.

use std::collections::BTreeMap;

use trainyard_proto::v1::{GpuWindow, NvlinkLink, Stat, WindowSteps};

use super::{Counters, Sample};

/// min / mean / max of the readings a window had (none: all zero).
#[derive(Debug, Clone, Copy, Default)]
struct Gauge {
    n: u32,
    min: f64,
    max: f64,
    sum: f64,
}

impl Gauge {
    fn add(&mut self, v: Option<f64>) {
        let Some(v) = v.filter(|v| v.is_finite()) else { return };
        if self.n == 0 {
            (self.min, self.max) = (v, v);
        }
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        self.sum += v;
        self.n += 1;
    }

    fn stat(&self) -> Option<Stat> {
        (self.n > 0).then(|| Stat { min: self.min, mean: self.sum / self.n as f64, max: self.max })
    }
}

/// One GPU's open window.
#[derive(Debug, Default)]
struct Open {
    start_ms: i64,
    last_ms: i64,
    samples: u32,
    uuid: String,
    sm: Gauge,
    mem: Gauge,
    max_sm: f64,
    power: Gauge,
    power_limit: f64,
    gpu_temp: Gauge,
    mem_temp: Gauge,
    util: Gauge,
    mem_used: Gauge,
    reasons: u64,
    pcie: Option<(u32, u32, u32, u32)>,
    nvlinks: (u32, u32),
    /// Per link: down at some reading, and its error deltas.
    links: BTreeMap<u32, (bool, [u64; 3])>,
    counters: Counters,
    remap_pending: bool,
    remap_failed: bool,
    xids: Vec<u32>,
}

/// Windows of every sampled GPU.
#[derive(Debug)]
pub struct Windows {
    window_ms: i64,
    open: BTreeMap<u32, Open>,
    /// Each GPU's counters at the end of its previous window.
    base: BTreeMap<u32, Counters>,
    /// Each GPU's per-link counters at its previous reading.
    link_base: BTreeMap<(u32, u32), [u64; 3]>,
}

impl Windows {
    pub fn new(window: std::time::Duration) -> Windows {
        Windows {
            window_ms: (window.as_millis() as i64).max(1),
            open: BTreeMap::new(),
            base: BTreeMap::new(),
            link_base: BTreeMap::new(),
        }
    }

    /// Adds one reading.
    pub fn push(&mut self, s: &Sample) {
        let base = *self.base.entry(s.gpu).or_insert(s.counters);
        let w = self.open.entry(s.gpu).or_insert_with(|| Open { start_ms: s.at_ms, ..Open::default() });
        w.last_ms = s.at_ms;
        w.samples += 1;
        w.uuid.clone_from(&s.uuid);
        w.sm.add(s.sm_clock_mhz);
        w.mem.add(s.mem_clock_mhz);
        w.max_sm = s.max_sm_clock_mhz.unwrap_or(w.max_sm);
        w.power.add(s.power_w);
        w.power_limit = s.power_limit_w.unwrap_or(w.power_limit);
        w.gpu_temp.add(s.gpu_temp_c);
        w.mem_temp.add(s.mem_temp_c);
        w.util.add(s.util_pct);
        w.mem_used.add(s.mem_used_bytes);
        w.reasons |= s.clock_reasons;
        if let Some((generation, generation_max, width, width_max)) = s.pcie {
            w.pcie = Some(match w.pcie {
                Some((g, gm, wd, wm)) => {
                    (g.min(generation), gm.max(generation_max), wd.min(width), wm.max(width_max))
                }
                None => (generation, generation_max, width, width_max),
            });
        }
        w.nvlinks = s.nvlinks;
        for &(link, up, now) in &s.links {
            let before = self.link_base.insert((s.gpu, link), now).unwrap_or(now);
            let entry = w.links.entry(link).or_default();
            entry.0 |= !up;
            for i in 0..3 {
                entry.1[i] += if now[i] >= before[i] { now[i] - before[i] } else { now[i] };
            }
        }
        w.counters = s.counters.since(&base);
        w.remap_pending |= s.remap_pending;
        w.remap_failed |= s.remap_failed;
        w.xids.extend(&s.xids);
    }

    /// Closes the windows that are `window` old at `now_ms` (all of them with `flush`), each
    /// with the steps `steps(gpu, start, end)` names.
    pub fn close(
        &mut self,
        now_ms: i64,
        flush: bool,
        steps: impl FnMut(u32, i64, i64) -> Vec<WindowSteps>,
    ) -> Vec<GpuWindow> {
        let due: Vec<u32> = self
            .open
            .iter()
            .filter(|(_, w)| flush || now_ms - w.start_ms >= self.window_ms)
            .map(|(gpu, _)| *gpu)
            .collect();
        self.close_these(&due, now_ms, steps)
    }

    /// Closes the windows of `gpus` now, whatever their age (an XID goes out at once).
    pub fn close_these(
        &mut self,
        due: &[u32],
        now_ms: i64,
        mut steps: impl FnMut(u32, i64, i64) -> Vec<WindowSteps>,
    ) -> Vec<GpuWindow> {
        let mut out = Vec::with_capacity(due.len());
        for &gpu in due {
            let Some(w) = self.open.remove(&gpu) else { continue };
            let end_ms = now_ms.max(w.last_ms);
            let base = self.base.entry(gpu).or_default();
            *base = base.plus(&w.counters);
            let (pcie_gen, pcie_gen_max, pcie_width, pcie_width_max) = w.pcie.unwrap_or_default();
            out.push(GpuWindow {
                gpu,
                uuid: w.uuid,
                start_ms: w.start_ms,
                end_ms,
                samples: w.samples,
                sm_clock_mhz: w.sm.stat(),
                mem_clock_mhz: w.mem.stat(),
                max_sm_clock_mhz: w.max_sm,
                power_w: w.power.stat(),
                power_limit_w: w.power_limit,
                gpu_temp_c: w.gpu_temp.stat(),
                mem_temp_c: w.mem_temp.stat(),
                util_pct: w.util.stat(),
                mem_used_bytes: w.mem_used.stat(),
                clock_reasons: w.reasons,
                pcie_gen,
                pcie_gen_max,
                pcie_width,
                pcie_width_max,
                pcie_replays: w.counters.pcie_replays,
                nvlinks_up: w.nvlinks.0,
                nvlinks_total: w.nvlinks.1,
                nvlink_crc_errors: w.counters.nvlink_crc,
                nvlink_replay_errors: w.counters.nvlink_replay,
                nvlink_recovery_errors: w.counters.nvlink_recovery,
                ecc_corrected: w.counters.ecc_corrected,
                ecc_uncorrected: w.counters.ecc_uncorrected,
                remap_pending: w.remap_pending,
                remap_failed: w.remap_failed,
                xids: w.xids,
                steps: steps(gpu, w.start_ms, end_ms),
                nvlink_links: w
                    .links
                    .iter()
                    .filter(|(_, (down, e))| *down || e.iter().any(|n| *n > 0))
                    .map(|(&link, &(down, e))| NvlinkLink {
                        link,
                        down,
                        crc_errors: e[0],
                        replay_errors: e[1],
                        recovery_errors: e[2],
                    })
                    .collect(),
            });
        }
        out
    }

    /// Forgets a GPU no rank uses any more, after its window was closed.
    pub fn forget(&mut self, gpu: u32) {
        self.open.remove(&gpu);
        self.base.remove(&gpu);
        self.link_base.retain(|(g, _), _| *g != gpu);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use trainyard_proto::telemetry::{HW_THERMAL, SW_POWER_CAP};

    fn sample(gpu: u32, at_ms: i64, sm: f64) -> Sample {
        Sample { gpu, at_ms, sm_clock_mhz: Some(sm), ..Sample::default() }
    }

    #[test]
    fn a_window_summarises_its_samples() {
        let mut w = Windows::new(Duration::from_secs(10));
        for (i, sm) in [1980.0, 1200.0, 1500.0].into_iter().enumerate() {
            let mut s = sample(3, 1_000 + i as i64 * 1000, sm);
            s.clock_reasons = if i == 1 { HW_THERMAL.bit } else { SW_POWER_CAP.bit };
            s.pcie = Some((if i == 2 { 3 } else { 5 }, 5, 16, 16));
            s.counters.nvlink_crc = 10 + i as u64 * 4;
            s.links = vec![(1, true, [0; 3]), (2, i != 1, [0; 3]), (5, true, [10 + i as u64 * 4, 0, 0])];
            s.xids = if i == 2 { vec![79] } else { vec![] };
            w.push(&s);
        }
        assert!(w.close(5_000, false, |_, _, _| vec![]).is_empty(), "not 10 s old yet");
        let out = w.close(11_000, false, |gpu, start, end| {
            vec![WindowSteps { key: None, first_step: gpu as i64, last_step: end - start }]
        });
        assert_eq!(out.len(), 1);
        let g = &out[0];
        assert_eq!((g.gpu, g.start_ms, g.end_ms, g.samples), (3, 1_000, 11_000, 3));
        let sm = g.sm_clock_mhz.unwrap();
        assert_eq!((sm.min, sm.max), (1200.0, 1980.0));
        assert!((sm.mean - 1560.0).abs() < 1e-9);
        assert_eq!(g.clock_reasons, HW_THERMAL.bit | SW_POWER_CAP.bit);
        assert_eq!((g.pcie_gen, g.pcie_gen_max, g.pcie_width, g.pcie_width_max), (3, 5, 16, 16));
        assert_eq!(g.nvlink_crc_errors, 8, "delta within the window");
        assert_eq!(
            g.nvlink_links.len(),
            2,
            "the down link and the erring link, not the clean one: {:?}",
            g.nvlink_links
        );
        assert_eq!((g.nvlink_links[0].link, g.nvlink_links[0].down), (2, true));
        assert_eq!((g.nvlink_links[1].link, g.nvlink_links[1].crc_errors), (5, 8));
        assert_eq!(g.xids, vec![79]);
        assert_eq!(g.steps[0].last_step, 10_000);
        assert!(g.power_w.is_none(), "no power readings: no stat");
    }

    #[test]
    fn counters_count_across_windows_once_and_survive_a_reset() {
        let mut w = Windows::new(Duration::from_secs(1));
        let mut s = sample(0, 0, 1.0);
        s.counters.pcie_replays = 100;
        w.push(&s);
        assert_eq!(w.close(1_000, false, |_, _, _| vec![])[0].pcie_replays, 0);
        s.at_ms = 1_500;
        s.counters.pcie_replays = 107;
        w.push(&s);
        assert_eq!(w.close(2_500, false, |_, _, _| vec![])[0].pcie_replays, 7, "between windows counts");
        s.at_ms = 3_000;
        s.counters.pcie_replays = 2;
        w.push(&s);
        assert_eq!(w.close(4_000, false, |_, _, _| vec![])[0].pcie_replays, 2, "reset: from zero");
    }

    #[test]
    fn flush_closes_young_windows() {
        let mut w = Windows::new(Duration::from_secs(10));
        w.push(&sample(1, 0, 1.0));
        w.push(&sample(2, 0, 1.0));
        assert_eq!(w.close(100, true, |_, _, _| vec![]).len(), 2);
        assert!(w.close(100_000, true, |_, _, _| vec![]).is_empty());
    }
}
