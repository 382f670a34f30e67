//! Who holds a GPU by the driver's account: the compute processes NVML lists on it, whatever
//! cgroup (or none) they are in. A launch never starts on a GPU another process still computes
//! on (docs/security.md); the agent's own cgroups answer for the processes of its ranks, this
//! for every other (a user's job run outside trainyard, a leftover of another agent).
//!
//! [`NvmlHolders`] asks the driver; [`ScriptedHolders`] reads a file instead, standing in on
//! hosts without a GPU (the suite's), as the scripted telemetry sampler does.

use std::path::PathBuf;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

/// The compute processes on a GPU.
pub trait GpuHolders: Send + Sync + std::fmt::Debug {
    /// Pids of the compute processes on the GPU of index `gpu`.
    fn compute_pids(&self, gpu: u32) -> Result<Vec<u32>, String>;
}

/// The driver's list, through NVML.
pub struct NvmlHolders {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlHolders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NvmlHolders")
    }
}

impl NvmlHolders {
    /// Loads NVML; the error says why it cannot be used (no driver on this host).
    pub fn new() -> Result<Self, String> {
        match Nvml::init() {
            Ok(nvml) => Ok(Self { nvml }),
            Err(NvmlError::LibloadingError(_)) => Err("NVML (libnvidia-ml.so.1) not found".into()),
            Err(e) => Err(format!("NVML init failed: {e}")),
        }
    }
}

impl GpuHolders for NvmlHolders {
    fn compute_pids(&self, gpu: u32) -> Result<Vec<u32>, String> {
        let device = self.nvml.device_by_index(gpu).map_err(|e| format!("NVML: GPU {gpu}: {e}"))?;
        let processes = device
            .running_compute_processes()
            .map_err(|e| format!("NVML: the compute processes of GPU {gpu}: {e}"))?;
        Ok(processes.into_iter().map(|p| p.pid).collect())
    }
}

/// A JSON file of `{"GPU index": [pid, ...]}`, read at every question (a test changes it while
/// the agent runs). A missing file holds nothing.
#[derive(Debug)]
pub struct ScriptedHolders {
    path: PathBuf,
}

impl ScriptedHolders {
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }
}

impl GpuHolders for ScriptedHolders {
    fn compute_pids(&self, gpu: u32) -> Result<Vec<u32>, String> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(format!("{}: {e}", self.path.display())),
        };
        let held: std::collections::BTreeMap<String, Vec<u32>> =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", self.path.display()))?;
        Ok(held.get(&gpu.to_string()).cloned().unwrap_or_default())
    }
}

/// `Err` naming the holder when a compute process is on GPU `gpu`; an answer the driver cannot
/// give is logged and leaves the decision to the cgroups.
pub fn refuse_if_held(gpu: u32, holders: &dyn GpuHolders) -> Result<(), String> {
    match holders.compute_pids(gpu) {
        Ok(pids) => match pids.first() {
            None => Ok(()),
            Some(&pid) => Err(format!(
                "launch refused: GPU {gpu} is in use by process {pid} ({}){}, by the driver's account: a GPU is \
                 never shared with another job's process; end it, or leave the node to the jobs trainyard runs",
                describe(pid),
                if pids.len() > 1 { format!(" and {} more", pids.len() - 1) } else { String::new() }
            )),
        },
        Err(why) => {
            tracing::warn!(gpu, %why, "cannot read the GPU's compute processes; the rank's cgroups decide alone");
            Ok(())
        }
    }
}

/// "sleep, uid 1000" from `/proc`, the real uid (the driver's pid may be of another PID
/// namespace: then "not visible here").
fn describe(pid: u32) -> String {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"));
    match (comm, crate::procfs::real_uid(pid)) {
        (Ok(comm), Some(uid)) => format!("{}, uid {uid}", comm.trim()),
        _ => "not visible here".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_gpu_is_refused_naming_its_process_and_a_free_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("held.json");
        let holders = ScriptedHolders::new(path.clone());
        assert_eq!(refuse_if_held(0, &holders), Ok(()), "no file: nothing held");
        let me = std::process::id();
        std::fs::write(&path, format!(r#"{{"0": [{me}, 1]}}"#)).unwrap();
        let refused = refuse_if_held(0, &holders).unwrap_err();
        assert!(refused.contains(&format!("GPU 0 is in use by process {me} (")), "{refused}");
        assert!(refused.contains("and 1 more") && refused.contains("by the driver's account"), "{refused}");
        assert_eq!(refuse_if_held(1, &holders), Ok(()), "GPU 1 is free");
        std::fs::write(&path, "not json").unwrap();
        assert_eq!(refuse_if_held(0, &holders), Ok(()), "an unreadable answer leaves it to the cgroups");
    }

    /// The real source: on a host without a driver it says so instead of answering.
    #[test]
    fn nvml_says_why_it_cannot_answer_without_a_driver() {
        match NvmlHolders::new() {
            Err(why) => assert!(why.contains("NVML"), "{why}"),
            Ok(nvml) => {
                let pids = nvml.compute_pids(0);
                assert!(pids.is_ok() || pids.as_ref().is_err_and(|e| e.contains("NVML")), "{pids:?}");
            }
        }
    }
}
