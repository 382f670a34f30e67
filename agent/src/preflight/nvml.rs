//! The NVML probe: the host's inventory and GPU health from the driver, through nvml-wrapper
//! loading `libnvidia-ml.so.1` at run time (so the agent builds and runs without a driver).
//!
//! Links: per GPU pair the number of active NVLinks whose remote end is the other GPU, plus, on
//! an NVSwitch fabric (remote end not a GPU), the links both GPUs have into the switches; with
//! no NVLink, NVML's common-ancestor level (`PIX` .. `SYS`). NUMA node and local CPUs come from
//! sysfs (`/sys/bus/pci/devices/<bus>/numa_node`, `local_cpulist`), which is what NVML's own
//! affinity reads.

use std::collections::BTreeMap;

use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TopologyLevel};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use trainyard_proto::v1::{Gpu, HostInventory, NumaNode};

use super::probe::{GpuHealth, Health, HostProbe};
use crate::topology::Link;

/// What `skipped` says when the library is absent.
pub const NOT_FOUND: &str = "NVML (libnvidia-ml.so.1) not found";
const MAX_NVLINKS: u32 = 18;

/// Why NVML cannot be used here, for the `nvml` check of a host-file probe.
pub fn host_file_reason() -> String {
    match Nvml::init() {
        Err(NvmlError::LibloadingError(_)) => NOT_FOUND.to_string(),
        Err(e) => format!("NVML present but failed to initialise: {e}"),
        Ok(_) => "inventory from the host file; NVML health not read".to_string(),
    }
}

/// The real probe: NVML plus sysfs.
pub struct NvmlProbe {
    nvml: Nvml,
    hostname: String,
}

impl NvmlProbe {
    /// Loads NVML; the error is the `skipped` reason (e.g. [`NOT_FOUND`]).
    pub fn new(hostname: String) -> Result<Self, String> {
        match Nvml::init() {
            Ok(nvml) => Ok(Self { nvml, hostname }),
            Err(NvmlError::LibloadingError(_)) => Err(NOT_FOUND.to_string()),
            Err(e) => Err(format!("NVML init failed: {e}")),
        }
    }

    fn devices(&self) -> Result<Vec<Device<'_>>, NvmlError> {
        (0..self.nvml.device_count()?).map(|i| self.nvml.device_by_index(i)).collect()
    }
}

impl HostProbe for NvmlProbe {
    fn inventory(&self) -> anyhow::Result<HostInventory> {
        let devices = self.devices()?;
        let mut gpus = Vec::with_capacity(devices.len());
        let mut bus_ids = Vec::with_capacity(devices.len());
        for (i, d) in devices.iter().enumerate() {
            let bus_id = d.pci_info()?.bus_id;
            let numa = sysfs_numa_node(&bus_id);
            gpus.push(Gpu {
                index: i as u32,
                uuid: d.uuid()?,
                model: d.name()?,
                memory_mib: d.memory_info()?.total >> 20,
                pci_bus_id: bus_id.clone(),
                numa_node: numa,
            });
            bus_ids.push(bus_id.to_ascii_lowercase());
        }
        let numa_nodes = sysfs_numa_nodes();
        for gpu in &mut gpus {
            // A platform without NUMA reports -1: the whole machine is node 0.
            if gpu.numa_node < 0 && numa_nodes.iter().any(|n| n.id == 0) {
                gpu.numa_node = 0;
            }
        }
        let links = link_matrix(&self.nvml, &devices, &bus_ids)?;
        Ok(HostInventory {
            hostname: self.hostname.clone(),
            gpus,
            numa_nodes,
            links: links.iter().flatten().map(Link::to_string).collect(),
            cores: sysfs_cores(),
        })
    }

    fn source(&self) -> &'static str {
        "nvml"
    }

    fn gpu_health(&self) -> Result<Health, String> {
        let devices = self.devices().map_err(|e| format!("NVML: {e}"))?;
        let cuda = self.nvml.sys_cuda_driver_version().ok();
        Ok(Health {
            driver_version: self.nvml.sys_driver_version().unwrap_or_default(),
            cuda_version: cuda.map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10)).unwrap_or_default(),
            gpus: devices.iter().enumerate().map(|(i, d)| health(&self.nvml, i as u32, d)).collect(),
        })
    }
}

fn health(nvml: &Nvml, index: u32, d: &Device<'_>) -> GpuHealth {
    let (remap_pending, remap_failed) =
        remapped_rows(nvml, d).map_or((None, None), |(p, f)| (Some(p), Some(f)));
    let throttle = d
        .current_throttle_reasons()
        .map(|r| {
            use nvml_wrapper::bitmasks::device::ThrottleReasons as T;
            let bad = [
                (T::SW_POWER_CAP, "sw_power_cap"),
                (T::HW_SLOWDOWN, "hw_slowdown"),
                (T::SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
                (T::HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
                (T::HW_POWER_BRAKE_SLOWDOWN, "hw_power_brake_slowdown"),
            ];
            bad.iter().filter(|(flag, _)| r.contains(*flag)).map(|(_, name)| name.to_string()).collect()
        })
        .unwrap_or_default();
    GpuHealth {
        index,
        name: d.name().unwrap_or_default(),
        ecc_enabled: d.is_ecc_enabled().ok().map(|e| e.currently_enabled),
        ecc_uncorrected: d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).ok(),
        remap_pending,
        remap_failed,
        power_limit_w: d.enforced_power_limit().ok().map(|mw| mw / 1000),
        pcie_gen: (d.current_pcie_link_gen().ok(), d.max_pcie_link_gen().ok()),
        pcie_width: (d.current_pcie_link_width().ok(), d.max_pcie_link_width().ok()),
        throttle,
    }
}

/// (pending, failure occurred) from `nvmlDeviceGetRemappedRows`, which nvml-wrapper does not
/// wrap; `None` where the GPU does not support row remapping (pre-Ampere) or the symbol is missing.
fn remapped_rows(nvml: &Nvml, d: &Device<'_>) -> Option<(bool, bool)> {
    let f = nvml.lib().nvmlDeviceGetRemappedRows.as_ref().ok()?;
    let (mut corr, mut unc, mut pending, mut failed) = (0, 0, 0, 0);
    // SAFETY: a live device handle of this NVML instance and four out-params owned here.
    let rc = unsafe { f(d.handle(), &mut corr, &mut unc, &mut pending, &mut failed) };
    (rc == 0).then_some((pending != 0, failed != 0))
}

/// The n x n link matrix: NVLink counts where there are NVLinks, else the common ancestor.
fn link_matrix(nvml: &Nvml, devices: &[Device<'_>], bus_ids: &[String]) -> Result<Vec<Vec<Link>>, NvmlError> {
    let n = devices.len();
    let mut direct = vec![vec![0u32; n]; n];
    let mut to_switch = vec![0u32; n];
    for (i, d) in devices.iter().enumerate() {
        for link in 0..MAX_NVLINKS {
            let wrapper = d.link_wrapper_for(link);
            if !wrapper.is_active().unwrap_or(false) {
                continue;
            }
            let remote = wrapper.remote_pci_info().map(|p| p.bus_id.to_ascii_lowercase()).unwrap_or_default();
            match bus_ids.iter().position(|b| *b == remote) {
                Some(j) => direct[i][j] += 1,
                None => to_switch[i] += 1,
            }
        }
    }
    let mut links = vec![vec![Link::X; n]; n];
    for i in 0..n {
        for j in 0..n {
            if i == j {
                continue;
            }
            let count = direct[i][j] + to_switch[i].min(to_switch[j]);
            links[i][j] = if count > 0 {
                Link::Nv(count)
            } else {
                ancestor(nvml.topology_common_ancestor(&devices[i], &devices[j])?)
            };
        }
    }
    Ok(links)
}

fn ancestor(level: TopologyLevel) -> Link {
    match level {
        TopologyLevel::Internal | TopologyLevel::Single => Link::Pix,
        TopologyLevel::Multiple => Link::Pxb,
        TopologyLevel::HostBridge => Link::Phb,
        TopologyLevel::Node => Link::Node,
        TopologyLevel::System => Link::Sys,
    }
}

/// sysfs spells the domain with 4 hex digits, NVML with 8: `00000000:18:00.0` -> `0000:18:00.0`.
fn sysfs_bus(bus_id: &str) -> String {
    let lower = bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => lower,
    }
}

fn sysfs_numa_node(bus_id: &str) -> i32 {
    let path = format!("/sys/bus/pci/devices/{}/numa_node", sysfs_bus(bus_id));
    std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(-1)
}

/// One entry per physical core (`/sys/devices/system/cpu/cpu*/topology/thread_siblings_list`),
/// ordered by the core's lowest CPU; empty when sysfs does not say.
pub fn sysfs_cores() -> Vec<String> {
    let mut cores: BTreeMap<u32, String> = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir("/sys/devices/system/cpu") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.strip_prefix("cpu").and_then(|n| n.parse::<u32>().ok()).is_none() {
                continue;
            }
            let Ok(list) = std::fs::read_to_string(entry.path().join("topology/thread_siblings_list")) else {
                continue;
            };
            let list = list.trim().to_string();
            if let Some(&first) = trainyard_proto::contract::cpulist::parse(&list)
                .ok()
                .and_then(|v| v.first().copied())
                .as_ref()
            {
                cores.insert(first, list);
            }
        }
    }
    cores.into_values().collect()
}

/// `/sys/devices/system/node/node*/cpulist`, nodes with CPUs only.
fn sysfs_numa_nodes() -> Vec<NumaNode> {
    let mut nodes = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir("/sys/devices/system/node") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_prefix("node").and_then(|n| n.parse::<u32>().ok()) else { continue };
            let cpus = std::fs::read_to_string(entry.path().join("cpulist")).unwrap_or_default();
            if !cpus.trim().is_empty() {
                nodes.insert(id, cpus.trim().to_string());
            }
        }
    }
    nodes.into_iter().map(|(id, cpus)| NumaNode { id, cpus }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_bus_ids_map_to_sysfs() {
        assert_eq!(sysfs_bus("00000000:18:00.0"), "0000:18:00.0");
        assert_eq!(sysfs_bus("0000:AB:00.0"), "0000:ab:00.0");
    }

    /// This machine's cores from sysfs: every logical CPU in exactly one core, siblings
    /// together (on a machine without SMT each core is one CPU).
    #[test]
    fn sysfs_cores_partition_the_cpus() {
        let cores = sysfs_cores();
        if cores.is_empty() {
            return; // no sysfs topology here: nothing to check
        }
        let mut seen = std::collections::BTreeSet::new();
        for core in &cores {
            for cpu in trainyard_proto::contract::cpulist::parse(core).expect("kernel list format") {
                assert!(seen.insert(cpu), "CPU {cpu} in two cores: {cores:?}");
            }
        }
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
        if let Ok(online) = trainyard_proto::contract::cpulist::parse(online.trim()) {
            assert_eq!(seen.into_iter().collect::<Vec<_>>(), online, "every online CPU in a core");
        }
    }

    /// CI has no driver: the probe is refused with the not-found wording.
    #[test]
    fn without_a_driver_nvml_is_not_found() {
        match NvmlProbe::new("h".into()) {
            Ok(_) => {} // a machine with a driver
            Err(reason) => {
                assert_eq!(reason, NOT_FOUND);
                assert_eq!(host_file_reason(), NOT_FOUND);
            }
        }
    }
}
