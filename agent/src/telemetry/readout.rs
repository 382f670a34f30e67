//! `trainyard-agent telemetry`: the sampler's readings as an operator reads them, one line per
//! GPU per reading, in text or JSON. It is what the telemetry thread sees before it summarises
//! anything into windows, so a reading can be held against `nvidia-smi` taken in the same
//! seconds (docs/telemetry.md, "Checking the sampler against nvidia-smi").

use serde_json::{Value, json};
use trainyard_proto::telemetry::reason_words;

use super::Sample;

/// One reading as a JSON object: every field the sampler read, in NVML's units converted to the
/// names `nvidia-smi --query-gpu` uses where there is one (MHz, W, C, %, MiB).
pub fn to_json(s: &Sample) -> Value {
    let links: Vec<Value> = s
        .links
        .iter()
        .map(|(link, up, [crc, replay, recovery])| {
            json!({"link": link, "up": up, "crc": crc, "replay": replay, "recovery": recovery})
        })
        .collect();
    let c = &s.counters;
    json!({
        "gpu": s.gpu,
        "uuid": s.uuid,
        "at_ms": s.at_ms,
        "clocks.sm_mhz": s.sm_clock_mhz,
        "clocks.mem_mhz": s.mem_clock_mhz,
        "clocks.max.sm_mhz": s.max_sm_clock_mhz,
        "clocks_event_reasons": format!("{:#x}", s.clock_reasons),
        "clocks_event_words": reason_words(s.clock_reasons),
        "power.draw_w": s.power_w,
        "power.limit_w": s.power_limit_w,
        "temperature.gpu_c": s.gpu_temp_c,
        "temperature.memory_c": s.mem_temp_c,
        "utilization.gpu_pct": s.util_pct,
        "memory.used_mib": s.mem_used_bytes.map(|b| b / (1024.0 * 1024.0)),
        "pcie.link.gen.current": s.pcie.map(|p| p.0),
        "pcie.link.gen.max": s.pcie.map(|p| p.1),
        "pcie.link.width.current": s.pcie.map(|p| p.2),
        "pcie.link.width.max": s.pcie.map(|p| p.3),
        "nvlinks_active": s.nvlinks.0,
        "nvlinks_present": s.nvlinks.1,
        "links": links,
        "pcie_replays": c.pcie_replays,
        "nvlink_crc": c.nvlink_crc,
        "nvlink_replay": c.nvlink_replay,
        "nvlink_recovery": c.nvlink_recovery,
        "ecc.errors.corrected.volatile.total": c.ecc_corrected,
        "ecc.errors.uncorrected.volatile.total": c.ecc_uncorrected,
        "remapped_rows.pending": s.remap_pending,
        "remapped_rows.failure": s.remap_failed,
        "xids": s.xids,
    })
}

/// One reading as a line of text, the fields `nvidia-smi dmon` shows first.
pub fn to_line(s: &Sample) -> String {
    let v = |x: Option<f64>, unit: &str| x.map_or_else(|| "-".to_string(), |x| format!("{x:.0}{unit}"));
    let pcie = s.pcie.map_or_else(|| "-".to_string(), |(g, _, w, _)| format!("gen{g}x{w}"));
    let mem = s.mem_used_bytes.map(|b| b / (1024.0 * 1024.0));
    let mut line = format!(
        "gpu {} sm {} mem {} power {}/{} temp {}/{} util {} used {} pcie {} nvlink {}/{} reasons {}",
        s.gpu,
        v(s.sm_clock_mhz, "MHz"),
        v(s.mem_clock_mhz, "MHz"),
        v(s.power_w, "W"),
        v(s.power_limit_w, "W"),
        v(s.gpu_temp_c, "C"),
        v(s.mem_temp_c, "C"),
        v(s.util_pct, "%"),
        v(mem, "MiB"),
        pcie,
        s.nvlinks.0,
        s.nvlinks.1,
        match reason_words(s.clock_reasons) {
            w if w.is_empty() => "none".to_string(),
            w => w,
        },
    );
    if !s.xids.is_empty() {
        line.push_str(&format!(" xids {:?}", s.xids));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu_sample::Counters;

    fn sample() -> Sample {
        Sample {
            gpu: 3,
            uuid: "GPU-1".into(),
            at_ms: 5,
            sm_clock_mhz: Some(1980.0),
            power_w: Some(512.25),
            mem_used_bytes: Some(2.0 * 1024.0 * 1024.0 * 1024.0),
            clock_reasons: 0x4,
            pcie: Some((5, 5, 16, 16)),
            nvlinks: (17, 18),
            links: vec![(0, true, [1, 2, 3]), (1, false, [0; 3])],
            counters: Counters { ecc_corrected: 9, ..Counters::default() },
            xids: vec![79],
            ..Sample::default()
        }
    }

    #[test]
    fn json_names_fields_as_nvidia_smi_does_and_converts_units() {
        let j = to_json(&sample());
        assert_eq!(j["memory.used_mib"], 2048.0);
        assert_eq!(j["power.draw_w"], 512.25);
        assert_eq!(j["clocks_event_words"], "sw_power_cap");
        assert_eq!(j["pcie.link.width.max"], 16);
        assert!(j["temperature.memory_c"].is_null(), "an unsupported query stays empty: {j}");
        assert_eq!(j["links"][0]["replay"], 2);
        assert_eq!(j["ecc.errors.corrected.volatile.total"], 9);
        assert_eq!(j["xids"][0], 79);
    }

    #[test]
    fn a_line_shows_what_was_read_and_dashes_for_what_was_not() {
        let line = to_line(&sample());
        assert!(line.starts_with("gpu 3 sm 1980MHz mem - power 512W/- "), "{line}");
        assert!(line.contains("pcie gen5x16 nvlink 17/18 reasons sw_power_cap xids [79]"), "{line}");
    }
}
