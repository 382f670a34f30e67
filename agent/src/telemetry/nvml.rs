//! The real sampler: NVML through nvml-wrapper, read-only (it never changes a GPU setting).
//!
//! Each reading is a handful of NVML queries per GPU (clocks, clocks-event reasons, power,
//! temperatures, utilisation, memory, PCIe link and replay counter, NVLink state and error
//! counters, ECC counters, row remapping). XIDs come from an NVML event set registered for
//! critical XID errors on every GPU, drained without waiting at each reading. A query the GPU
//! does not support leaves its field empty; it is not an error.

use std::collections::BTreeMap;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};

use super::{Counters, GpuSampler, Sample};
use crate::gpu_sample::LinkReading;
use crate::preflight::nvml::NOT_FOUND;

const MAX_NVLINKS: u32 = 18;
/// `NVML_FI_DEV_MEMORY_TEMP`: HBM temperature, which nvml-wrapper reads only as a field value.
const FI_MEMORY_TEMP: u32 = 82;

/// Samples GPUs through NVML.
pub struct NvmlSampler {
    nvml: &'static Nvml,
    /// Critical-XID events of every GPU; `None` where the driver refuses event sets.
    events: Option<EventSet<'static>>,
    /// XIDs drained from the event set, by GPU index, not yet handed out.
    xids: BTreeMap<u32, Vec<u32>>,
}

impl NvmlSampler {
    /// Loads NVML; the error is the reason the sampler is skipped (e.g. [`NOT_FOUND`]).
    pub fn new() -> Result<NvmlSampler, String> {
        let nvml = match Nvml::init() {
            Ok(nvml) => nvml,
            Err(NvmlError::LibloadingError(_)) => return Err(NOT_FOUND.to_string()),
            Err(e) => return Err(format!("NVML init failed: {e}")),
        };
        // One NVML handle for the agent's life: the event set borrows it.
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let events = xid_events(nvml)
            .map_err(|e| tracing::warn!(error = %e, "NVML event set refused: XIDs will not be reported"))
            .ok();
        Ok(NvmlSampler { nvml, events, xids: BTreeMap::new() })
    }

    /// GPUs NVML lists on this host (0 when it cannot count them).
    pub fn gpu_count(&self) -> u32 {
        self.nvml.device_count().unwrap_or(0)
    }

    fn drain_events(&mut self) {
        let Some(set) = &self.events else { return };
        loop {
            match set.wait(0) {
                Ok(event) => {
                    let (Ok(index), Some(XidError::Value(xid))) = (event.device.index(), event.event_data)
                    else {
                        continue;
                    };
                    self.xids.entry(index).or_default().push(u32::try_from(xid).unwrap_or(u32::MAX));
                }
                Err(NvmlError::Timeout) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "reading NVML events failed");
                    return;
                }
            }
        }
    }
}

fn xid_events(nvml: &'static Nvml) -> Result<EventSet<'static>, String> {
    let mut set = nvml.create_event_set().map_err(|e| e.to_string())?;
    for i in 0..nvml.device_count().map_err(|e| e.to_string())? {
        let device = nvml.device_by_index(i).map_err(|e| e.to_string())?;
        set = device.register_events(EventTypes::CRITICAL_XID_ERROR, set).map_err(|e| e.to_string())?;
    }
    Ok(set)
}

impl GpuSampler for NvmlSampler {
    fn sample(&mut self, gpu: u32, at_ms: i64) -> Result<Sample, String> {
        self.drain_events();
        let d = self.nvml.device_by_index(gpu).map_err(|e| format!("GPU {gpu}: {e}"))?;
        let mut s = read(&d);
        s.gpu = gpu;
        s.at_ms = at_ms;
        s.xids = self.xids.remove(&gpu).unwrap_or_default();
        (s.remap_pending, s.remap_failed) = remapped_rows(self.nvml, &d);
        Ok(s)
    }

    fn describe(&self) -> String {
        let driver = self.nvml.sys_driver_version().unwrap_or_default();
        format!("NVML (driver {driver}), XID events {}", if self.events.is_some() { "on" } else { "off" })
    }
}

fn read(d: &Device<'_>) -> Sample {
    let f = |r: Result<u32, NvmlError>| r.ok().map(f64::from);
    let pcie = match (
        d.current_pcie_link_gen(),
        d.max_pcie_link_gen(),
        d.current_pcie_link_width(),
        d.max_pcie_link_width(),
    ) {
        (Ok(g), Ok(gm), Ok(w), Ok(wm)) => Some((g, gm, w, wm)),
        _ => None,
    };
    let (nvlinks, nvlink_counters, links) = nvlinks(d);
    Sample {
        uuid: d.uuid().unwrap_or_default(),
        sm_clock_mhz: f(d.clock_info(Clock::SM)),
        mem_clock_mhz: f(d.clock_info(Clock::Memory)),
        max_sm_clock_mhz: f(d.max_clock_info(Clock::SM)),
        power_w: d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        power_limit_w: d.enforced_power_limit().ok().map(|mw| f64::from(mw) / 1000.0),
        gpu_temp_c: f(d.temperature(TemperatureSensor::Gpu)),
        mem_temp_c: memory_temp(d),
        util_pct: d.utilization_rates().ok().map(|u| f64::from(u.gpu)),
        mem_used_bytes: d.memory_info().ok().map(|m| m.used as f64),
        clock_reasons: d.current_throttle_reasons().map(|r| r.bits()).unwrap_or(0),
        pcie,
        nvlinks,
        links,
        counters: Counters {
            pcie_replays: d.pcie_replay_counter().map(u64::from).unwrap_or(0),
            ecc_corrected: d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile).unwrap_or(0),
            ecc_uncorrected: d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).unwrap_or(0),
            ..nvlink_counters
        },
        ..Sample::default()
    }
}

fn memory_temp(d: &Device<'_>) -> Option<f64> {
    let values = d.field_values_for(&[FieldId(FI_MEMORY_TEMP)]).ok()?;
    match values.into_iter().next()?.ok()?.value.ok()? {
        SampleValue::F64(v) => Some(v),
        SampleValue::U32(v) => Some(f64::from(v)),
        SampleValue::U64(v) => Some(v as f64),
        SampleValue::I64(v) => Some(v as f64),
    }
    .filter(|t| *t > 0.0)
}

/// (active, present) links, the error counters summed over the active ones, and each link.
fn nvlinks(d: &Device<'_>) -> ((u32, u32), Counters, Vec<LinkReading>) {
    let (mut up, mut total) = (0, 0);
    let mut c = Counters::default();
    let mut links = Vec::new();
    for link in 0..MAX_NVLINKS {
        let wrapper = d.link_wrapper_for(link);
        match wrapper.is_active() {
            Ok(active) => {
                total += 1;
                if !active {
                    links.push((link, false, [0; 3]));
                    continue;
                }
                up += 1;
            }
            Err(_) => continue, // no such link on this GPU
        }
        let count = |counter| wrapper.error_counter(counter).unwrap_or(0);
        let errors = [
            count(ErrorCounter::DlCrcFlit) + count(ErrorCounter::DlCrcData),
            count(ErrorCounter::DlReplay),
            count(ErrorCounter::DlRecovery),
        ];
        c.nvlink_crc += errors[0];
        c.nvlink_replay += errors[1];
        c.nvlink_recovery += errors[2];
        links.push((link, true, errors));
    }
    ((up, total), c, links)
}

/// (pending, failed) row remapping; (false, false) where the GPU has none (pre-Ampere).
fn remapped_rows(nvml: &Nvml, d: &Device<'_>) -> (bool, bool) {
    let Ok(f) = nvml.lib().nvmlDeviceGetRemappedRows.as_ref() else { return (false, false) };
    let (mut corr, mut unc, mut pending, mut failed) = (0, 0, 0, 0);
    // SAFETY: a live device handle of this NVML instance and four out-params owned here.
    let rc = unsafe { f(d.handle(), &mut corr, &mut unc, &mut pending, &mut failed) };
    (rc == 0 && pending != 0, rc == 0 && failed != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver the sampler is refused with the not-found wording the agent logs as
    /// `skipped`; with one it reads every GPU (exercised on the GPU machine, docs/gpu.md).
    #[test]
    fn the_real_sampler_reads_a_gpu_or_says_why_not() {
        match NvmlSampler::new() {
            Err(reason) => {
                assert_eq!(reason, NOT_FOUND);
                eprintln!("skipped: {reason}: the NVML sampler needs a GPU host");
            }
            Ok(mut sampler) => {
                let n = sampler.nvml.device_count().expect("device count");
                for gpu in 0..n {
                    let s = sampler.sample(gpu, 0).expect("a present GPU reads");
                    assert!(!s.uuid.is_empty() && s.sm_clock_mhz.is_some(), "{s:?}");
                }
            }
        }
    }
}
