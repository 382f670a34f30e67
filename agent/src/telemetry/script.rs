//! A scripted sampler for hosts without a GPU (`--telemetry-script FILE`): every GPU reads as
//! the script's `base`, and events change one GPU (or all) from a time on: a throttle, low
//! clocks, an XID, NVLinks down, error counters climbing. The file is read again when it
//! changes, so a test can inject a fault into a running job. A file that does not parse keeps
//! the previous script and says why in the log, naming the file.
//!
//! ```json
//! {"base": {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "power_w": 600, "power_limit_w": 700},
//!  "events": [
//!    {"after_s": 60, "gpu": 3, "set": {"clock_reasons": "hw_thermal_slowdown", "sm_clock_mhz": 1100, "gpu_temp_c": 91}},
//!    {"at_ms": 1764000000000, "gpu": 5, "xid": 79},
//!    {"after_s": 30, "for_s": 20, "gpu": 2, "set": {"nvlinks_up": 16, "nvlink_crc_per_s": 40}}
//!  ]}
//! ```
//! `at_ms` is a wall-clock time; `after_s` counts from when the sampler started. An event lasts
//! `for_s` (or until `until_ms`), else for good; an XID is reported once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::SystemTime;

use serde::Deserialize;

use super::{Counters, GpuSampler, Sample};

/// What a GPU reads as; every field optional so an event sets only what it changes.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reading {
    pub sm_clock_mhz: Option<f64>,
    pub max_sm_clock_mhz: Option<f64>,
    pub mem_clock_mhz: Option<f64>,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub gpu_temp_c: Option<f64>,
    pub mem_temp_c: Option<f64>,
    pub util_pct: Option<f64>,
    pub mem_used_bytes: Option<f64>,
    /// Reason words, comma-separated (`trainyard_proto::telemetry`).
    pub clock_reasons: Option<String>,
    pub pcie_gen: Option<u32>,
    pub pcie_gen_max: Option<u32>,
    pub pcie_width: Option<u32>,
    pub pcie_width_max: Option<u32>,
    pub nvlinks_up: Option<u32>,
    pub nvlinks_total: Option<u32>,
    pub remap_pending: Option<bool>,
    pub remap_failed: Option<bool>,
    /// Counters climbing while the event lasts, per second.
    pub pcie_replays_per_s: Option<f64>,
    pub nvlink_crc_per_s: Option<f64>,
    pub ecc_corrected_per_s: Option<f64>,
    pub ecc_uncorrected_per_s: Option<f64>,
}

impl Reading {
    /// `self` with `over`'s fields where `over` has them.
    fn with(&self, over: &Reading) -> Reading {
        macro_rules! pick {
            ($($f:ident),*) => { Reading { $($f: over.$f.clone().or_else(|| self.$f.clone())),* } };
        }
        pick!(
            sm_clock_mhz,
            max_sm_clock_mhz,
            mem_clock_mhz,
            power_w,
            power_limit_w,
            gpu_temp_c,
            mem_temp_c,
            util_pct,
            mem_used_bytes,
            clock_reasons,
            pcie_gen,
            pcie_gen_max,
            pcie_width,
            pcie_width_max,
            nvlinks_up,
            nvlinks_total,
            remap_pending,
            remap_failed,
            pcie_replays_per_s,
            nvlink_crc_per_s,
            ecc_corrected_per_s,
            ecc_uncorrected_per_s
        )
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    pub at_ms: Option<i64>,
    pub after_s: Option<f64>,
    pub for_s: Option<f64>,
    pub until_ms: Option<i64>,
    /// The GPU it happens on; absent: every GPU.
    pub gpu: Option<u32>,
    pub xid: Option<u32>,
    #[serde(default)]
    pub set: Reading,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    #[serde(default)]
    pub base: Reading,
    #[serde(default)]
    pub events: Vec<Event>,
}

impl Script {
    /// Parses and checks a script; the error names what is wrong.
    pub fn parse(text: &str) -> Result<Script, String> {
        let script: Script = serde_json::from_str(text).map_err(|e| e.to_string())?;
        for (i, e) in script.events.iter().enumerate() {
            if e.at_ms.is_some() == e.after_s.is_some() {
                return Err(format!("event {i}: give exactly one of at_ms and after_s"));
            }
            for r in [&script.base, &e.set] {
                if let Some(words) = &r.clock_reasons {
                    trainyard_proto::telemetry::reason_bits(words)
                        .map_err(|why| format!("event {i}: {why}"))?;
                }
            }
        }
        Ok(script)
    }
}

/// Replays a [`Script`] file.
pub struct ScriptedSampler {
    path: PathBuf,
    script: Script,
    modified: Option<SystemTime>,
    started_ms: i64,
    counters: BTreeMap<u32, (i64, [f64; 4])>,
    /// (event index, gpu) of XIDs already reported.
    reported: BTreeSet<(usize, u32)>,
}

impl ScriptedSampler {
    /// Loads `path`; the error names the file and what is wrong with it.
    pub fn load(path: PathBuf) -> Result<ScriptedSampler, String> {
        let mut s = ScriptedSampler {
            path,
            script: Script::default(),
            modified: None,
            started_ms: super::now_ms(),
            counters: BTreeMap::new(),
            reported: BTreeSet::new(),
        };
        s.reload()?;
        Ok(s)
    }

    fn reload(&mut self) -> Result<(), String> {
        let why = |e: String| format!("telemetry script {}: {e}", self.path.display());
        let modified =
            std::fs::metadata(&self.path).and_then(|m| m.modified()).map_err(|e| why(e.to_string()))?;
        if Some(modified) == self.modified {
            return Ok(());
        }
        let text = std::fs::read_to_string(&self.path).map_err(|e| why(e.to_string()))?;
        self.modified = Some(modified);
        self.script = Script::parse(&text).map_err(why)?;
        Ok(())
    }

    fn active(&self, e: &Event, gpu: u32, now: i64) -> bool {
        let start = e.at_ms.unwrap_or_else(|| self.started_ms + (e.after_s.unwrap_or(0.0) * 1000.0) as i64);
        let end = e.until_ms.or_else(|| e.for_s.map(|s| start + (s * 1000.0) as i64)).unwrap_or(i64::MAX);
        e.gpu.is_none_or(|g| g == gpu) && now >= start && now < end
    }
}

impl GpuSampler for ScriptedSampler {
    fn sample(&mut self, gpu: u32, at_ms: i64) -> Result<Sample, String> {
        if let Err(e) = self.reload() {
            tracing::warn!(error = %e, "keeping the previous telemetry script");
        }
        let mut reading = self.script.base.clone();
        let mut xids = Vec::new();
        for (i, e) in self.script.events.iter().enumerate() {
            if !self.active(e, gpu, at_ms) {
                continue;
            }
            reading = reading.with(&e.set);
            if let Some(xid) = e.xid
                && self.reported.insert((i, gpu))
            {
                xids.push(xid);
            }
        }
        let (last, totals) = self.counters.entry(gpu).or_insert((at_ms, [0.0; 4]));
        let dt = (at_ms - *last).max(0) as f64 / 1000.0;
        *last = at_ms;
        let rates = [
            reading.pcie_replays_per_s,
            reading.nvlink_crc_per_s,
            reading.ecc_corrected_per_s,
            reading.ecc_uncorrected_per_s,
        ];
        for (total, rate) in totals.iter_mut().zip(rates) {
            *total += rate.unwrap_or(0.0) * dt;
        }
        let reasons =
            reading.clock_reasons.as_deref().map(trainyard_proto::telemetry::reason_bits).transpose()?;
        let pcie_max = (reading.pcie_gen_max.unwrap_or(5), reading.pcie_width_max.unwrap_or(16));
        let (up, total) = (reading.nvlinks_up.unwrap_or(18), reading.nvlinks_total.unwrap_or(18));
        // The links down are the highest-numbered ones; scripted NVLink errors count on link 0.
        let links =
            (0..total).map(|l| (l, l < up, if l == 0 { [totals[1] as u64, 0, 0] } else { [0; 3] })).collect();
        Ok(Sample {
            gpu,
            uuid: format!("GPU-script-{gpu:02}"),
            at_ms,
            sm_clock_mhz: reading.sm_clock_mhz,
            mem_clock_mhz: reading.mem_clock_mhz,
            max_sm_clock_mhz: reading.max_sm_clock_mhz,
            power_w: reading.power_w,
            power_limit_w: reading.power_limit_w,
            gpu_temp_c: reading.gpu_temp_c,
            mem_temp_c: reading.mem_temp_c,
            util_pct: reading.util_pct,
            mem_used_bytes: reading.mem_used_bytes,
            clock_reasons: reasons.unwrap_or(0),
            pcie: Some((
                reading.pcie_gen.unwrap_or(pcie_max.0),
                pcie_max.0,
                reading.pcie_width.unwrap_or(pcie_max.1),
                pcie_max.1,
            )),
            nvlinks: (up, total),
            links,
            counters: Counters {
                pcie_replays: totals[0] as u64,
                nvlink_crc: totals[1] as u64,
                ecc_corrected: totals[2] as u64,
                ecc_uncorrected: totals[3] as u64,
                ..Counters::default()
            },
            remap_pending: reading.remap_pending.unwrap_or(false),
            remap_failed: reading.remap_failed.unwrap_or(false),
            xids,
        })
    }

    fn describe(&self) -> String {
        format!("scripted telemetry from {} ({} event(s))", self.path.display(), self.script.events.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::telemetry::HW_THERMAL;

    fn sampler(text: &str) -> (tempfile::TempDir, ScriptedSampler) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("script.json");
        std::fs::write(&path, text).unwrap();
        let s = ScriptedSampler::load(path).unwrap();
        (dir, s)
    }

    #[test]
    fn a_throttle_and_an_xid_start_on_time_on_their_gpu() {
        let (_dir, mut s) = sampler(
            r#"{"base": {"sm_clock_mhz": 1980},
                "events": [{"at_ms": 5000, "gpu": 3, "set": {"clock_reasons": "hw_thermal_slowdown", "sm_clock_mhz": 1100}},
                           {"at_ms": 6000, "gpu": 3, "xid": 79},
                           {"at_ms": 0, "for_s": 2, "gpu": 1, "set": {"nvlink_crc_per_s": 10}}]}"#,
        );
        let before = s.sample(3, 4_000).unwrap();
        assert_eq!((before.sm_clock_mhz, before.clock_reasons), (Some(1980.0), 0));
        let during = s.sample(3, 5_500).unwrap();
        assert_eq!((during.sm_clock_mhz, during.clock_reasons), (Some(1100.0), HW_THERMAL.bit));
        assert_eq!(s.sample(2, 5_500).unwrap().clock_reasons, 0, "other GPUs untouched");
        assert_eq!(s.sample(3, 6_100).unwrap().xids, vec![79]);
        assert!(s.sample(3, 7_000).unwrap().xids.is_empty(), "an XID is reported once");
        s.sample(1, 0).unwrap();
        assert_eq!(s.sample(1, 1_000).unwrap().counters.nvlink_crc, 10);
        assert_eq!(s.sample(1, 1_500).unwrap().counters.nvlink_crc, 15);
        assert_eq!(s.sample(1, 3_000).unwrap().counters.nvlink_crc, 15, "climbs only while the event lasts");
    }

    #[test]
    fn bad_scripts_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.json");
        for (text, says) in [
            (r#"{"events": [{"gpu": 1}]}"#, "exactly one of at_ms and after_s"),
            (
                r#"{"events": [{"after_s": 1, "set": {"clock_reasons": "warm"}}]}"#,
                "unknown clock reason \"warm\"",
            ),
            (r#"{"base": {"sm_clock": 1}}"#, "unknown field `sm_clock`"),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = ScriptedSampler::load(path.clone()).err().unwrap();
            assert!(err.contains(says) && err.contains("bad.json"), "{err}");
        }
    }
}
