//! The host's non-GPU state the checks need, read from the real machine ([`HostFacts::gather`])
//! or taken from the host file's optional `host` section (fixtures).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

/// Environment variables the checks look at (in the agent's and the job's environment).
pub const WATCHED_ENV: [&str; 3] = ["NCCL_SHM_DISABLE", "NCCL_P2P_DISABLE", "CUDA_DEVICE_MAX_CONNECTIONS"];

/// What the host is, outside its GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostFacts {
    /// `/proc/sys/kernel/numa_balancing`; `None` when the file is absent (a kernel built without
    /// NUMA balancing, or a single-node machine).
    #[serde(default)]
    pub numa_balancing: Option<u32>,
    /// Size of `/dev/shm`; `None` when it is not mounted.
    #[serde(default)]
    pub dev_shm_bytes: Option<u64>,
    /// The agent's own values of [`WATCHED_ENV`] (unset ones absent).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// RDMA and network devices with their NUMA node (-1 when the platform reports none).
    #[serde(default)]
    pub nics: Vec<NicFact>,
}

/// One NIC and the NUMA node it hangs off.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicFact {
    pub name: String,
    pub numa_node: i32,
}

impl HostFacts {
    /// Reads the real machine: procfs, statvfs of /dev/shm, the environment, sysfs.
    pub fn gather() -> Self {
        let numa_balancing = std::fs::read_to_string("/proc/sys/kernel/numa_balancing")
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok());
        let env = WATCHED_ENV
            .iter()
            .filter_map(|name| std::env::var(name).ok().map(|v| (name.to_string(), v)))
            .collect();
        Self { numa_balancing, dev_shm_bytes: shm_size(Path::new("/dev/shm")), env, nics: nics() }
    }
}

/// The size of the tmpfs at `path`, or `None` when it is missing or not a directory.
fn shm_size(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    if !path.is_dir() {
        return None;
    }
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a statvfs struct owned by this frame.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return None;
    }
    Some(stat.f_blocks as u64 * stat.f_frsize as u64)
}

/// InfiniBand devices (`/sys/class/infiniband/*`) and physical network devices
/// (`/sys/class/net/*/device`), each with `device/numa_node`.
fn nics() -> Vec<NicFact> {
    let mut out = Vec::new();
    for class in ["/sys/class/infiniband", "/sys/class/net"] {
        let Ok(entries) = std::fs::read_dir(class) else { continue };
        let mut names: Vec<_> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        names.sort();
        for path in names {
            let node = path.join("device/numa_node");
            let Ok(text) = std::fs::read_to_string(&node) else { continue };
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            out.push(NicFact { name, numa_node: text.trim().parse().unwrap_or(-1) });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_this_machine_without_failing() {
        let facts = HostFacts::gather();
        // Every Linux machine that runs the tests has /dev/shm, or at least /tmp for the probe.
        assert_eq!(shm_size(Path::new("/nonexistent/shm")), None);
        assert!(shm_size(Path::new("/tmp")).is_some_and(|b| b > 0));
        assert!(facts.env.keys().all(|k| WATCHED_ENV.contains(&k.as_str())));
    }
}
