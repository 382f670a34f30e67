//! The checks: pure functions from what was gathered to rows of `pass | warn | fail | skipped`.
//! Every remedy quotes what the fault cost in the field reports (docs/field-notes.md §1-§3).

use std::collections::BTreeMap;

use trainyard_proto::v1::HostInventory;

use super::facts::HostFacts;
use trainyard_proto::words::CheckStatus;

use super::probe::Health;
use super::{cuda, nccl};
use crate::topology::{self, Topology};
use trainyard_proto::v1::PreflightCheck;
use trainyard_proto::words::InterconnectClass;

/// One check's row, before it becomes the proto's `PreflightCheck`.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub id: String,
    pub status: CheckStatus,
    pub measured: String,
    pub expected: String,
    pub remedy: String,
}

impl Check {
    pub fn new(
        id: impl Into<String>,
        status: CheckStatus,
        measured: impl Into<String>,
        expected: impl Into<String>,
    ) -> Self {
        Self {
            id: id.into(),
            status,
            measured: measured.into(),
            expected: expected.into(),
            remedy: String::new(),
        }
    }

    /// A skipped check: `measured` reads `skipped: <why>`.
    pub fn skipped(id: impl Into<String>, why: &str, expected: impl Into<String>) -> Self {
        Self::new(id, CheckStatus::Skipped, format!("skipped: {why}"), expected)
    }

    pub fn remedy(mut self, remedy: impl Into<String>) -> Self {
        self.remedy = remedy.into();
        self
    }

    /// The remedy only when the check did not pass.
    pub fn remedy_if_bad(self, remedy: impl Into<String>) -> Self {
        if matches!(self.status, CheckStatus::Warn | CheckStatus::Fail) { self.remedy(remedy) } else { self }
    }

    pub(super) fn into_proto(self) -> PreflightCheck {
        PreflightCheck {
            id: self.id,
            status: self.status.as_str().to_string(),
            measured: self.measured,
            expected: self.expected,
            remedy: self.remedy,
        }
    }
}

/// `/dev/shm` below this fails: Docker's 64 MiB default makes NCCL die creating its segments
/// ("Error while creating shared memory segment") with 8 ranks.
pub const SHM_FAIL_BYTES: u64 = 256 << 20;
/// `/dev/shm` below this warns: NCCL's segments plus DataLoader workers' tensors share it.
pub const SHM_WARN_BYTES: u64 = 1 << 30;
/// Logical CPUs per GPU below this warns: each rank needs its main thread, NCCL's proxy thread
/// and data loading; fewer stalls NCCL's control threads like a NUMA split does. A warning, not
/// a failure: the node works, slower.
pub const MIN_CPUS_PER_GPU: usize = 4;

const NUMA_COST: &str = "a 4+4 NUMA split ran nanochat d26 at 1295 ms per step instead of 702 ms";
const SHM_COST: &str = "NCCL_SHM_DISABLE=1 made an NVL node 3.2x slower per step (2031 -> 6495 ms), \
    its optimizer step 13.7x";

/// The GPU model's expected class, when the model name says it.
fn expected_class(model: &str) -> Option<InterconnectClass> {
    let m = model.to_ascii_uppercase();
    if m.contains("NVL") {
        Some(InterconnectClass::NvlinkPairs)
    } else if m.contains("PCIE") {
        Some(InterconnectClass::Pcie)
    } else if m.contains("SXM") || m.contains("HBM3") || m.contains("H200") {
        Some(InterconnectClass::Nvswitch)
    } else {
        None
    }
}

/// `topology.class`: the fabric the node has against the one its GPU model comes with.
pub fn topology(inventory: &HostInventory, topo: &Topology) -> Vec<Check> {
    let class = topo.class();
    let model = inventory.gpus.first().map(|g| g.model.as_str()).unwrap_or("");
    let worst = topo.links.iter().flatten().max().map(|l| l.to_string()).unwrap_or_default();
    let measured = format!("{class} ({} GPUs, worst GPU-GPU path {worst})", topo.gpus.len());
    let floor = format!("{:.0} GB/s busbw at 1 GiB", topology::busbw_floor_gbps(class, 1 << 30));
    if topo.gpus.len() < 2 {
        let measured = format!("{class} ({} GPU: no GPU-GPU path)", topo.gpus.len());
        return vec![Check::new(
            "topology.class",
            CheckStatus::Pass,
            measured,
            "any class: nothing to compare on one GPU",
        )];
    }
    let check = match expected_class(model) {
        Some(want) if want != class => Check::new("topology.class", CheckStatus::Fail, measured, format!("{want} for {model}"))
            .remedy(format!(
                "the matrix does not show the fabric of {model}: a {worst} where {want} links were expected means \
                 a link, bridge or NVSwitch is down (check `nvidia-smi nvlink -s`, fabricmanager); PCIe-only \
                 traffic made NCCL 7.3x slower than NVSwitch in the field reports; any tuning before this is fixed is noise"
            )),
        Some(want) => Check::new("topology.class", CheckStatus::Pass, measured, format!("{want} for {model}; floor {floor}")),
        None if class == InterconnectClass::Mixed => Check::new("topology.class", CheckStatus::Warn, measured, "nvswitch, nvlink-pairs or pcie")
            .remedy("some GPU pairs are on NVLink and some are not: a link is likely down (`nvidia-smi nvlink -s`)"),
        None => Check::new("topology.class", CheckStatus::Pass, measured, format!("a known class; floor {floor}")),
    };
    vec![check]
}

/// `numa.split`, `numa.balancing`, `numa.cpus_per_gpu`.
pub fn numa(topo: &Topology, facts: &HostFacts) -> Vec<Check> {
    let per_node = topo.gpus_per_numa_node();
    let n = topo.gpus.len();
    let split = if per_node.len() > 1 {
        Check::new("numa.split", CheckStatus::Warn, format!("GPUs on NUMA nodes {}", topo.numa_layout()), format!("all {n} GPUs on one NUMA node"))
            .remedy(format!(
                "{NUMA_COST} (NCCL's CPU proxy threads starved; pthread_cond_signal calls 4,000 -> 1.58 million per \
                 10 steps): keep a job's GPUs on one NUMA node where possible and pin each rank to its GPU's node \
                 (`numactl --cpunodebind=N --membind=N`)"
            ))
    } else if per_node.is_empty() && n > 0 {
        Check::skipped(
            "numa.split",
            "the platform reports no NUMA node for the GPUs",
            format!("all {n} GPUs on one NUMA node"),
        )
    } else {
        Check::new(
            "numa.split",
            CheckStatus::Pass,
            format!("GPUs on NUMA nodes {}", topo.numa_layout()),
            format!("all {n} GPUs on one NUMA node"),
        )
    };
    let multi_node = topo.numa_nodes.len() > 1;
    let balancing = match facts.numa_balancing {
        None => Check::skipped(
            "numa.balancing",
            "/proc/sys/kernel/numa_balancing absent (kernel without automatic NUMA balancing: nothing to turn off)",
            "0",
        ),
        Some(0) => Check::new("numa.balancing", CheckStatus::Pass, "0", "0"),
        Some(v) => Check::new(
            "numa.balancing",
            if multi_node { CheckStatus::Fail } else { CheckStatus::Warn },
            v.to_string(),
            "0",
        )
        .remedy(format!(
            "automatic NUMA balancing migrates the ranks' pages between nodes under NCCL's feet; \
                 `sysctl -w kernel.numa_balancing=0` (and persist it in /etc/sysctl.d); {NUMA_COST}"
        )),
    };
    let mut worst: Option<(f64, u32, usize, usize)> = None;
    for (node, gpus) in &per_node {
        let cpus = topo.cpus_on_node(*node);
        let per_gpu = cpus as f64 / gpus.len().max(1) as f64;
        if worst.is_none_or(|(w, ..)| per_gpu < w) {
            worst = Some((per_gpu, *node, cpus, gpus.len()));
        }
    }
    let cpus = match worst {
        None => Check::skipped(
            "numa.cpus_per_gpu",
            "no GPU has a NUMA node",
            format!("at least {MIN_CPUS_PER_GPU}"),
        ),
        Some((per_gpu, node, cpus, gpus)) => {
            let status =
                if per_gpu < MIN_CPUS_PER_GPU as f64 { CheckStatus::Warn } else { CheckStatus::Pass };
            Check::new(
                "numa.cpus_per_gpu",
                status,
                format!(
                    "{} CPUs per GPU on NUMA node {node} ({cpus} CPUs, {gpus} GPUs)",
                    trim_float(per_gpu)
                ),
                format!("at least {MIN_CPUS_PER_GPU} logical CPUs per GPU on its NUMA node"),
            )
            .remedy_if_bad(format!(
                "too few CPUs per GPU stalls NCCL's control threads the way a NUMA split does ({NUMA_COST}); \
                 use a machine size with more vCPUs per GPU or fewer ranks on this node"
            ))
        }
    };
    vec![split, balancing, cpus]
}

/// `host.shm`, `env.*`, `host.nic_locality`.
pub fn host(facts: &HostFacts, job_env: &BTreeMap<String, String>) -> Vec<Check> {
    let shm_expected = format!(
        "/dev/shm mounted, at least {} MiB ({} MiB recommended)",
        SHM_FAIL_BYTES >> 20,
        SHM_WARN_BYTES >> 20
    );
    let shm_remedy = format!(
        "NCCL's intra-node transport lives in /dev/shm; mount a larger tmpfs (`mount -o remount,size=16G /dev/shm`, \
         or `--shm-size=16g` for a container). Do not work around it with NCCL_SHM_DISABLE=1: {SHM_COST}"
    );
    let shm = match facts.dev_shm_bytes {
        None => {
            Check::new("host.shm", CheckStatus::Fail, "/dev/shm not mounted", shm_expected).remedy(shm_remedy)
        }
        Some(b) => {
            let status = if b < SHM_FAIL_BYTES {
                CheckStatus::Fail
            } else if b < SHM_WARN_BYTES {
                CheckStatus::Warn
            } else {
                CheckStatus::Pass
            };
            Check::new("host.shm", status, format!("{} MiB", b >> 20), shm_expected).remedy_if_bad(shm_remedy)
        }
    };
    let mut checks = vec![shm];
    checks.push(env_check(
        facts,
        job_env,
        "NCCL_SHM_DISABLE",
        "env.nccl_shm_disable",
        CheckStatus::Fail,
        &format!("unset NCCL_SHM_DISABLE (fix /dev/shm instead): {SHM_COST} as traffic fell back to sockets"),
    ));
    checks.push(env_check(
        facts,
        job_env,
        "NCCL_P2P_DISABLE",
        "env.nccl_p2p_disable",
        CheckStatus::Fail,
        "unset NCCL_P2P_DISABLE: it routes GPU-GPU traffic through host memory instead of NVLink/PCIe P2P, \
         the same kind of fallback that made SHM-disabled runs 3.2x slower per step",
    ));
    let cdmc = resolve_env(facts, job_env, "CUDA_DEVICE_MAX_CONNECTIONS");
    checks.push(match cdmc {
        Some((value, from)) if value.trim() == "1" => Check::new(
            "env.cuda_device_max_connections", CheckStatus::Warn, format!("CUDA_DEVICE_MAX_CONNECTIONS=1 ({from})"), "unset (default 8)",
        ).remedy("CUDA_DEVICE_MAX_CONNECTIONS=1 serialises the all_gather / reduce_scatter overlap with compute; leave it unset unless the platform forces it, and then record it"),
        Some((value, from)) => Check::new("env.cuda_device_max_connections", CheckStatus::Pass, format!("CUDA_DEVICE_MAX_CONNECTIONS={value} ({from})"), "unset (default 8)"),
        None => Check::new("env.cuda_device_max_connections", CheckStatus::Pass, "unset", "unset (default 8)"),
    });
    checks.push(nic_locality(facts));
    checks
}

/// The value a rank would see (the job's overlay wins over the agent's environment) and where it
/// came from.
fn resolve_env<'a>(
    facts: &'a HostFacts,
    job_env: &'a BTreeMap<String, String>,
    name: &str,
) -> Option<(&'a str, &'static str)> {
    job_env
        .get(name)
        .map(|v| (v.as_str(), "job environment"))
        .or_else(|| facts.env.get(name).map(|v| (v.as_str(), "agent environment")))
}

/// NCCL's boolean switches disable on any non-zero integer.
fn env_check(
    facts: &HostFacts,
    job_env: &BTreeMap<String, String>,
    name: &str,
    id: &str,
    bad: CheckStatus,
    remedy: &str,
) -> Check {
    match resolve_env(facts, job_env, name) {
        Some((value, from)) if value.trim().parse::<i64>().is_ok_and(|v| v != 0) => {
            Check::new(id, bad, format!("{name}={value} ({from})"), "unset").remedy(remedy)
        }
        Some((value, from)) => {
            Check::new(id, CheckStatus::Pass, format!("{name}={value} ({from}): not disabling"), "unset")
        }
        None => Check::new(id, CheckStatus::Pass, "unset", "unset"),
    }
}

/// `host.nic_locality`: recorded for multi-node jobs, never a failure on a single node.
fn nic_locality(facts: &HostFacts) -> Check {
    let expected = "NICs recorded with their NUMA node (multi-node jobs)";
    if facts.nics.is_empty() {
        return Check::skipped(
            "host.nic_locality",
            "no NIC with a NUMA node in /sys/class/infiniband or /sys/class/net",
            expected,
        );
    }
    let list: Vec<String> = facts
        .nics
        .iter()
        .map(|n| {
            if n.numa_node < 0 {
                format!("{}:none", n.name)
            } else {
                format!("{}:node{}", n.name, n.numa_node)
            }
        })
        .collect();
    Check::new("host.nic_locality", CheckStatus::Pass, list.join(" "), expected)
}

/// `nvml` and per GPU `nvml.ecc.gpuN`, `nvml.remap.gpuN`, `nvml.pcie.gpuN`, `nvml.throttle.gpuN`.
pub fn nvml(health: &Result<Health, String>) -> Vec<Check> {
    let health = match health {
        Err(why) => {
            return vec![Check::skipped(
                "nvml",
                why,
                "NVML readable: driver, ECC, remapped rows, PCIe, clocks",
            )];
        }
        Ok(h) => h,
    };
    let mut checks = vec![Check::new(
        "nvml",
        CheckStatus::Pass,
        format!("driver {}, CUDA {}, {} GPUs", health.driver_version, health.cuda_version, health.gpus.len()),
        "NVML readable",
    )];
    for g in &health.gpus {
        let i = g.index;
        let ecc = match (g.ecc_enabled, g.ecc_uncorrected) {
            (_, Some(errors)) if errors > 0 => Check::new(format!("nvml.ecc.gpu{i}"), CheckStatus::Fail, format!("{errors} uncorrected ECC errors"), "0")
                .remedy("uncorrected ECC errors corrupt training silently: drain the node, reset the GPU (`nvidia-smi -r`) and have it serviced if they return"),
            (Some(false), _) => Check::new(format!("nvml.ecc.gpu{i}"), CheckStatus::Warn, "ECC disabled", "ECC enabled, 0 uncorrected")
                .remedy("enable ECC (`nvidia-smi -e 1`, then reboot)"),
            (None, None) => Check::skipped(format!("nvml.ecc.gpu{i}"), "ECC not reported by this GPU", "ECC enabled, 0 uncorrected"),
            _ => Check::new(format!("nvml.ecc.gpu{i}"), CheckStatus::Pass, "ECC enabled, 0 uncorrected", "ECC enabled, 0 uncorrected"),
        };
        let remap = match (g.remap_pending, g.remap_failed) {
            (_, Some(true)) => Check::new(
                format!("nvml.remap.gpu{i}"),
                CheckStatus::Fail,
                "row remapping failed",
                "no pending or failed remapping",
            )
            .remedy("the GPU ran out of spare rows: it needs service (RMA)"),
            (Some(true), _) => Check::new(
                format!("nvml.remap.gpu{i}"),
                CheckStatus::Warn,
                "row remapping pending",
                "no pending or failed remapping",
            )
            .remedy("reset the GPU (`nvidia-smi -r -i N`) or reboot so the pending remap takes effect"),
            (None, None) => Check::skipped(
                format!("nvml.remap.gpu{i}"),
                "row remapping not supported",
                "no pending or failed remapping",
            ),
            _ => Check::new(
                format!("nvml.remap.gpu{i}"),
                CheckStatus::Pass,
                "none pending, none failed",
                "no pending or failed remapping",
            ),
        };
        let pcie = match (g.pcie_width, g.pcie_gen) {
            ((Some(cur), Some(max)), link_gen) if cur < max => Check::new(
                format!("nvml.pcie.gpu{i}"), CheckStatus::Warn,
                format!("x{cur} of x{max}, gen {} of {}", opt(link_gen.0), opt(link_gen.1)), format!("x{max}"),
            ).remedy("the PCIe link trained narrower than the slot: reseat the GPU or riser; host transfers and PCIe collectives run at a fraction"),
            ((Some(cur), Some(max)), link_gen) => Check::new(
                format!("nvml.pcie.gpu{i}"), CheckStatus::Pass,
                format!("x{cur} of x{max}, gen {} of {} (gen drops at idle)", opt(link_gen.0), opt(link_gen.1)), format!("x{max}"),
            ),
            _ => Check::skipped(format!("nvml.pcie.gpu{i}"), "PCIe link not reported", "full link width"),
        };
        let throttle = if g.throttle.is_empty() {
            Check::new(
                format!("nvml.throttle.gpu{i}"),
                CheckStatus::Pass,
                format!("none (power limit {} W)", opt(g.power_limit_w)),
                "no power or thermal slowdown",
            )
        } else {
            Check::new(format!("nvml.throttle.gpu{i}"), CheckStatus::Warn, g.throttle.join(","), "no power or thermal slowdown")
                .remedy("clocks are held down by power or temperature: check cooling, PSU and the power limit (`nvidia-smi -q -d PERFORMANCE,POWER`)")
        };
        checks.extend([ecc, remap, pcie, throttle]);
    }
    checks
}

/// `26`, `0.25`: whole numbers without decimals.
fn trim_float(v: f64) -> String {
    if v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.2}") }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or("?".into(), |v| v.to_string())
}

/// `cuda.init` and per GPU `cuda.init.gpuN`. Any failure fails the node.
pub fn cuda(outcome: &cuda::Outcome, wanted: &[u32]) -> Vec<Check> {
    let expected = "cuInit, then a context, an allocation and a copy on every GPU checked";
    let n = wanted.iter().map(|&i| i as usize + 1).max().unwrap_or(0);
    let remedy = "CUDA initialisation failing (\"CUDA unknown error\") is the driver/runtime mismatch of the field \
        reports: the node is unusable until the driver matches (check `nvidia-smi`, dmesg for Xid errors; reinstall \
        the driver or reboot)";
    match outcome {
        cuda::Outcome::Skipped(why) => vec![Check::skipped("cuda.init", why, expected)],
        cuda::Outcome::InitFailed(e) => {
            vec![Check::new("cuda.init", CheckStatus::Fail, e.clone(), expected).remedy(remedy)]
        }
        cuda::Outcome::Ran { cuda_version, devices, gpus, .. } => {
            let mut checks = Vec::with_capacity(wanted.len() + 1);
            let head = format!("CUDA driver {cuda_version}, {devices} devices");
            checks.push(if *devices < n {
                Check::new("cuda.init", CheckStatus::Fail, head, format!("{n} devices")).remedy(remedy)
            } else {
                Check::new("cuda.init", CheckStatus::Pass, head, format!("{n} devices"))
            });
            for (i, result) in wanted.iter().zip(gpus) {
                checks.push(match result {
                    Ok(()) => Check::new(
                        format!("cuda.init.gpu{i}"),
                        CheckStatus::Pass,
                        "context, allocation, copy ok",
                        expected,
                    ),
                    Err(e) => Check::new(format!("cuda.init.gpu{i}"), CheckStatus::Fail, e.clone(), expected)
                        .remedy(remedy),
                });
            }
            checks
        }
    }
}

/// One row per size (`nccl.allreduce.<bytes>`) and `nccl.busbw` against the class floor.
pub fn nccl(outcome: &nccl::Outcome, class: InterconnectClass, n: usize) -> Vec<Check> {
    let expected_for = |bytes: u64| {
        format!(
            "busbw >= {:.0} GB/s at {} ({class})",
            topology::busbw_floor_gbps(class, bytes),
            human_bytes(bytes)
        )
    };
    match outcome {
        nccl::Outcome::Skipped(why) => vec![Check::skipped("nccl.busbw", why, "all_reduce busbw at the class floor")],
        nccl::Outcome::Failed(e) => vec![Check::new("nccl.busbw", CheckStatus::Fail, e.clone(), "all_reduce over all GPUs completes")
            .remedy("NCCL could not run over this node's GPUs: rerun with NCCL_DEBUG=INFO to see the transport that failed")],
        nccl::Outcome::Ran { version, results } => {
            let mut checks: Vec<Check> = results
                .iter()
                .map(|r| {
                    let busbw = if n < 2 { "busbw n/a (1 GPU)".to_string() } else { format!("busbw {:.1} GB/s", r.busbw_gbps) };
                    Check::new(
                        format!("nccl.allreduce.{}", r.bytes),
                        CheckStatus::Pass,
                        format!("{}: {:.1} us, algbw {:.1} GB/s, {busbw}", human_bytes(r.bytes), r.time_us, r.algbw_gbps),
                        format!("recorded (NCCL {version}, {n} GPUs)"),
                    )
                })
                .collect();
            let Some(last) = results.last() else {
                checks.push(Check::skipped("nccl.busbw", "the sweep measured no size", "all_reduce busbw at the class floor"));
                return checks;
            };
            if n < 2 {
                // The communicator, the collective and the timing ran (rows above); on one GPU an
                // all_reduce is a device-local copy, so busbw (x 2(n-1)/n = 0) says nothing.
                checks.push(Check::skipped(
                    "nccl.busbw",
                    &format!(
                        "1 GPU: NCCL {version} ran the all_reduce sweep (communicator, collective, timing; {:.1} us at {}), \
                         but one GPU has no GPU-to-GPU traffic, so bus bandwidth is not defined",
                        last.time_us,
                        human_bytes(last.bytes)
                    ),
                    "all_reduce busbw at the class floor (nodes of 2 or more GPUs)",
                ));
                return checks;
            }
            let floor = topology::busbw_floor_gbps(class, last.bytes);
            let status = if last.busbw_gbps >= floor {
                CheckStatus::Pass
            } else if last.busbw_gbps >= floor / 2.0 {
                CheckStatus::Warn
            } else {
                CheckStatus::Fail
            };
            checks.push(
                Check::new("nccl.busbw", status, format!("{:.1} GB/s at {}", last.busbw_gbps, human_bytes(last.bytes)), expected_for(last.bytes))
                    .remedy_if_bad(format!(
                        "bus bandwidth far below the {class} expectation is a node problem, not a model problem: check \
                         numa.split/numa.cpus_per_gpu above, `nvidia-smi nvlink -s`, and NCCL_DEBUG=INFO for the transport \
                         (SHM disabled: 3.2x step time; NUMA split: 702 -> 1295 ms per step)"
                    )),
            );
            checks
        }
    }
}

/// `1 MiB`, `256 MiB`, `1 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preflight::nccl::{Outcome, SizeResult};

    #[test]
    fn busbw_against_the_floor() {
        let ran = |gbps: f64| {
            let bytes = 1u64 << 30;
            // time for the wanted busbw over 8 GPUs
            let algbw = gbps / 1.75;
            Outcome::Ran {
                version: "2.28.3".into(),
                results: vec![SizeResult::new(bytes, 8, bytes as f64 / (algbw * 1e9) * 1e6)],
            }
        };
        let status = |o: &Outcome| nccl(o, InterconnectClass::Nvswitch, 8).last().unwrap().status;
        assert_eq!(status(&ran(380.0)), CheckStatus::Pass);
        assert_eq!(status(&ran(250.0)), CheckStatus::Warn);
        assert_eq!(status(&ran(100.0)), CheckStatus::Fail);
        let rows = nccl(&ran(380.0), InterconnectClass::Nvswitch, 8);
        assert_eq!(rows[0].id, "nccl.allreduce.1073741824");
        assert!(rows[1].measured.starts_with("380.0 GB/s at 1 GiB"), "{}", rows[1].measured);
        assert_eq!(nccl(&Outcome::Skipped("x".into()), InterconnectClass::Pcie, 8)[0].measured, "skipped: x");
        // One GPU: the sweep's rows are recorded, busbw is skipped with the reason, never a pass.
        let one = Outcome::Ran { version: "2.28.9".into(), results: vec![SizeResult::new(1 << 20, 1, 20.0)] };
        let rows = nccl(&one, InterconnectClass::Pcie, 1);
        assert_eq!(rows[0].status, CheckStatus::Pass);
        assert!(rows[0].measured.contains("busbw n/a (1 GPU)"), "{}", rows[0].measured);
        assert_eq!(rows[1].status, CheckStatus::Skipped);
        assert!(rows[1].measured.starts_with("skipped: 1 GPU: NCCL 2.28.9 ran"), "{}", rows[1].measured);
    }

    #[test]
    fn env_values_that_do_not_disable_pass() {
        let facts = HostFacts {
            env: [("NCCL_P2P_DISABLE".to_string(), "0".to_string())].into(),
            ..Default::default()
        };
        let checks = host(&facts, &BTreeMap::new());
        let p2p = checks.iter().find(|c| c.id == "env.nccl_p2p_disable").unwrap();
        assert_eq!(p2p.status, CheckStatus::Pass);
        let job = [("NCCL_P2P_DISABLE".to_string(), "1".to_string())].into();
        let checks = host(&facts, &job);
        let p2p = checks.iter().find(|c| c.id == "env.nccl_p2p_disable").unwrap();
        assert_eq!(
            (p2p.status, p2p.measured.as_str()),
            (CheckStatus::Fail, "NCCL_P2P_DISABLE=1 (job environment)")
        );
    }
}
