//! The JSON host-description file ([`HostFile`]): what the host has (GPUs, their links, NUMA
//! nodes and their CPUs) for machines without GPUs. It implements [`HostProbe`] so every code
//! path runs there; its optional `host` and `cuda` sections stand in for the machine in
//! fixtures. The file is validated completely at load, and every error names the offending field, because
//! an operator reads it once at start-up and has to fix the file from that one line.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use trainyard_proto::v1::{Gpu, HostInventory, NumaNode};

use super::facts::HostFacts;
use super::probe::{Health, HostProbe};
use super::{cuda, nvml};

/// Why a host file was refused.
#[derive(Debug, thiserror::Error)]
pub enum HostFileError {
    // The cause is in the message, not a `source`, so `{e:#}` prints it once.
    #[error("cannot read host file {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    /// serde's message names the field (unknown field, missing field, wrong type) and the line.
    #[error("host file {path} is not valid: {error}")]
    Parse { path: PathBuf, error: serde_json::Error },
    #[error("host file {path}: {field}: {reason}")]
    Invalid { path: PathBuf, field: String, reason: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileJson {
    hostname: String,
    gpus: Vec<GpuJson>,
    links: Vec<Vec<String>>,
    numa_nodes: Vec<NumaJson>,
    /// Optional: one entry per physical core, its logical CPUs (`thread_siblings_list`, e.g.
    /// `"0,112"`), so pinning keeps hyperthread siblings together.
    #[serde(default)]
    cores: Vec<String>,
    /// Optional: the host's non-GPU state, instead of reading this machine's.
    #[serde(default)]
    host: Option<HostFacts>,
    /// Optional: the CUDA check's result, instead of running it.
    #[serde(default)]
    cuda: Option<CudaJson>,
}

/// The `cuda` section: what the CUDA check finds on this (pretend) host.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct CudaJson {
    /// E.g. "12.8".
    cuda_version: String,
    /// Set when `cuInit` itself fails: the message.
    #[serde(default)]
    init_error: Option<String>,
    /// GPU index (as a string key) -> the error its context, allocation or copy gives.
    #[serde(default)]
    gpu_errors: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuJson {
    index: u32,
    uuid: String,
    model: String,
    memory_mib: u64,
    pci_bus_id: String,
    numa_node: i32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NumaJson {
    id: u32,
    cpus: String,
}

/// A validated host-description file.
#[derive(Debug, Clone)]
pub struct HostFile {
    inventory: HostInventory,
    facts: Option<HostFacts>,
    cuda: Option<CudaJson>,
}

impl HostFile {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, HostFileError> {
        let text = std::fs::read_to_string(path)
            .map_err(|error| HostFileError::Read { path: path.to_path_buf(), error })?;
        Self::parse(&text, path)
    }

    /// Validates `text`; `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, HostFileError> {
        let file: FileJson = serde_json::from_str(text)
            .map_err(|error| HostFileError::Parse { path: path.to_path_buf(), error })?;
        validate(&file).map_err(|(field, reason)| HostFileError::Invalid {
            path: path.to_path_buf(),
            field,
            reason,
        })?;
        let facts = file.host.clone();
        let cuda = file.cuda.clone();
        Ok(Self { inventory: to_inventory(file), facts, cuda })
    }

    /// The inventory without going through the trait (it cannot fail once loaded).
    pub fn host_inventory(&self) -> &HostInventory {
        &self.inventory
    }
}

impl HostProbe for HostFile {
    fn inventory(&self) -> anyhow::Result<HostInventory> {
        Ok(self.inventory.clone())
    }

    fn gpu_health(&self) -> Result<Health, String> {
        Err(nvml::host_file_reason())
    }

    fn cuda_check(&self, gpus: &[u32]) -> cuda::Outcome {
        self.cuda
            .as_ref()
            .map_or_else(|| cuda::check(gpus), |c| simulated_cuda(c, self.inventory.gpus.len(), gpus))
    }

    fn host_facts(&self) -> Option<HostFacts> {
        self.facts.clone()
    }
}

fn simulated_cuda(c: &CudaJson, devices: usize, wanted: &[u32]) -> cuda::Outcome {
    if let Some(e) = &c.init_error {
        return cuda::Outcome::InitFailed(e.clone());
    }
    let gpus =
        wanted.iter().map(|i| c.gpu_errors.get(&i.to_string()).map_or(Ok(()), |e| Err(e.clone()))).collect();
    cuda::Outcome::Ran { driver_version: String::new(), cuda_version: c.cuda_version.clone(), devices, gpus }
}

type Invalid = (String, String);

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Invalid {
    (field.into(), reason.into())
}

fn validate(file: &FileJson) -> Result<(), Invalid> {
    if file.hostname.trim().is_empty() {
        return Err(invalid("hostname", "must not be empty"));
    }
    let mut numa_ids = BTreeSet::new();
    for (i, node) in file.numa_nodes.iter().enumerate() {
        if !numa_ids.insert(node.id) {
            return Err(invalid(format!("numa_nodes[{i}].id"), format!("duplicate id {}", node.id)));
        }
        trainyard_proto::contract::cpulist::parse(&node.cpus)
            .map_err(|reason| invalid(format!("numa_nodes[{i}].cpus"), reason))?;
    }
    for (i, gpu) in file.gpus.iter().enumerate() {
        if gpu.index as usize != i {
            return Err(invalid(
                format!("gpus[{i}].index"),
                format!("is {}, expected {i} (indices are 0..n-1 in order)", gpu.index),
            ));
        }
        let known = u32::try_from(gpu.numa_node).is_ok_and(|id| numa_ids.contains(&id));
        if !known {
            return Err(invalid(
                format!("gpus[{i}].numa_node"),
                format!("{} is not an id in numa_nodes", gpu.numa_node),
            ));
        }
    }
    let mut seen = BTreeSet::new();
    for (i, core) in file.cores.iter().enumerate() {
        let cpus = trainyard_proto::contract::cpulist::parse(core)
            .map_err(|reason| invalid(format!("cores[{i}]"), reason))?;
        if cpus.is_empty() {
            return Err(invalid(format!("cores[{i}]"), "lists no CPU"));
        }
        if let Some(cpu) = cpus.iter().find(|c| !seen.insert(**c)) {
            return Err(invalid(format!("cores[{i}]"), format!("CPU {cpu} is already in another core")));
        }
    }
    if let Some(cuda) = &file.cuda {
        for key in cuda.gpu_errors.keys() {
            if !key.parse::<usize>().is_ok_and(|i| i < file.gpus.len()) {
                return Err(invalid(format!("cuda.gpu_errors.{key}"), "is not a GPU index of this file"));
            }
        }
    }
    validate_links(&file.links, file.gpus.len())
}

fn validate_links(links: &[Vec<String>], n: usize) -> Result<(), Invalid> {
    if links.len() != n {
        return Err(invalid("links", format!("has {} rows, expected {n} (one per GPU)", links.len())));
    }
    for (i, row) in links.iter().enumerate() {
        if row.len() != n {
            return Err(invalid(format!("links[{i}]"), format!("has {} cells, expected {n}", row.len())));
        }
        for (j, cell) in row.iter().enumerate() {
            let diagonal = i == j;
            if diagonal && cell != "X" {
                return Err(invalid(
                    format!("links[{i}][{j}]"),
                    format!("is {cell:?}, expected \"X\" on the diagonal"),
                ));
            }
            if !diagonal && (cell == "X" || cell.trim().is_empty()) {
                return Err(invalid(
                    format!("links[{i}][{j}]"),
                    format!("is {cell:?}, expected a link code such as \"NV18\" or \"SYS\""),
                ));
            }
        }
    }
    Ok(())
}

fn to_inventory(file: FileJson) -> HostInventory {
    HostInventory {
        hostname: file.hostname,
        gpus: file
            .gpus
            .into_iter()
            .map(|g| Gpu {
                index: g.index,
                uuid: g.uuid,
                model: g.model,
                memory_mib: g.memory_mib,
                pci_bus_id: g.pci_bus_id,
                numa_node: g.numa_node,
            })
            .collect(),
        numa_nodes: file.numa_nodes.into_iter().map(|n| NumaNode { id: n.id, cpus: n.cpus }).collect(),
        links: file.links.into_iter().flatten().collect(),
        cores: file.cores,
    }
}

/// This machine's hostname, as the kernel knows it (`localhost` if it cannot be read).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn good() -> Value {
        json!({
            "hostname": "sxm-a",
            "gpus": [
                {"index": 0, "uuid": "GPU-0", "model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                 "pci_bus_id": "00000000:18:00.0", "numa_node": 0},
                {"index": 1, "uuid": "GPU-1", "model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                 "pci_bus_id": "00000000:2a:00.0", "numa_node": 1}
            ],
            "links": [["X", "NV18"], ["NV18", "X"]],
            "numa_nodes": [{"id": 0, "cpus": "0-55,112-167"}, {"id": 1, "cpus": "56-111,168-223"}]
        })
    }

    fn parse(v: &Value) -> Result<HostFile, HostFileError> {
        HostFile::parse(&v.to_string(), Path::new("host.json"))
    }

    /// The error's text, which must name `field`.
    fn error_naming(v: &Value, field: &str) -> String {
        let err = parse(v).expect_err("file should be refused").to_string();
        assert!(err.contains(field), "error {err:?} does not name {field:?}");
        err
    }

    #[test]
    fn good_file_becomes_inventory() {
        let host = parse(&good()).unwrap();
        let inv = host.inventory().unwrap();
        assert_eq!(inv.hostname, "sxm-a");
        assert_eq!(inv.gpus.len(), 2);
        assert_eq!(inv.gpus[1].numa_node, 1);
        assert_eq!(inv.links, vec!["X", "NV18", "NV18", "X"]);
        assert_eq!(inv.numa_nodes[1].cpus, "56-111,168-223");
    }

    #[test]
    fn cores_keep_their_siblings_and_may_not_overlap() {
        let mut v = good();
        v["cores"] = json!(["0,112", "1,113"]);
        assert_eq!(parse(&v).unwrap().inventory().unwrap().cores, vec!["0,112", "1,113"]);
        assert!(parse(&good()).unwrap().inventory().unwrap().cores.is_empty(), "optional");
        v["cores"] = json!(["0,112", "112,1"]);
        let err = error_naming(&v, "cores[1]");
        assert!(err.contains("CPU 112 is already in another core"), "{err}");
        v["cores"] = json!(["0-"]);
        error_naming(&v, "cores[0]");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let mut v = good();
        v["gpus"][0]["colour"] = json!("green");
        error_naming(&v, "colour");
        let mut v = good();
        v["extra"] = json!(1);
        error_naming(&v, "extra");
    }

    #[test]
    fn missing_field_is_named() {
        let mut v = good();
        v["gpus"][1].as_object_mut().unwrap().remove("uuid");
        error_naming(&v, "uuid");
    }

    #[test]
    fn gpu_indices_must_run_in_order() {
        let mut v = good();
        v["gpus"][1]["index"] = json!(2);
        error_naming(&v, "gpus[1].index");
    }

    #[test]
    fn links_must_be_square_with_x_on_the_diagonal() {
        let mut v = good();
        v["links"] = json!([["X", "NV18"]]);
        error_naming(&v, "links");
        let mut v = good();
        v["links"] = json!([["X", "NV18"], ["NV18"]]);
        error_naming(&v, "links[1]");
        let mut v = good();
        v["links"] = json!([["X", "NV18"], ["NV18", "NV18"]]);
        error_naming(&v, "links[1][1]");
        let mut v = good();
        v["links"] = json!([["X", "X"], ["NV18", "X"]]);
        error_naming(&v, "links[0][1]");
    }

    #[test]
    fn gpu_numa_node_must_exist() {
        let mut v = good();
        v["gpus"][0]["numa_node"] = json!(3);
        error_naming(&v, "gpus[0].numa_node");
        v["gpus"][0]["numa_node"] = json!(-1);
        error_naming(&v, "gpus[0].numa_node");
    }

    #[test]
    fn cpu_lists_are_checked() {
        for bad in ["", "0-", "a", "3-1", "0,,1", "0-3;8"] {
            let mut v = good();
            v["numa_nodes"][1]["cpus"] = json!(bad);
            error_naming(&v, "numa_nodes[1].cpus");
        }
        let mut v = good();
        v["numa_nodes"][1]["id"] = json!(0);
        error_naming(&v, "numa_nodes[1].id");
    }

    #[test]
    fn empty_hostname_is_refused() {
        let mut v = good();
        v["hostname"] = json!(" ");
        error_naming(&v, "hostname");
    }
}
