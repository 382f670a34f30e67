//! Exact preflight verdicts for the host-description fixtures in tests/fixtures/hosts/, and the
//! not-found branches of NVML, CUDA and NCCL on a machine without them (CI).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use trainyard_agent::preflight::{self, HostFacts, Request, Scope};
use trainyard_agent::preflight::{host::HostFile, probe::HostProbe};
use trainyard_proto::v1::PreflightReport;
use trainyard_proto::words::PreflightLevel;

fn fixture(name: &str) -> HostFile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hosts").join(name);
    HostFile::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn run_with(name: &str, level: PreflightLevel, job_env: &[(&str, &str)]) -> PreflightReport {
    let host = fixture(name);
    let facts = host.host_facts().expect("fixtures carry a host section");
    let job_env: BTreeMap<String, String> =
        job_env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    preflight::run(
        &Request { level, agent_id: "node-a", job_env: &job_env, scope: Scope::Node },
        &host,
        &facts,
    )
}

fn run(name: &str) -> PreflightReport {
    run_with(name, PreflightLevel::Quick, &[])
}

/// Every check's status by id.
fn statuses(report: &PreflightReport) -> BTreeMap<String, String> {
    report.checks.iter().map(|c| (c.id.clone(), c.status.clone())).collect()
}

/// Asserts the class, the verdict and every check's status: `changed` lists the checks whose
/// status differs from a healthy node's.
fn assert_report(report: &PreflightReport, class: &str, verdict: &str, changed: &[(&str, &str)]) {
    let mut want: BTreeMap<String, String> = [
        "topology.class",
        "numa.split",
        "numa.balancing",
        "numa.cpus_per_gpu",
        "host.shm",
        "env.nccl_shm_disable",
        "env.nccl_p2p_disable",
        "env.cuda_device_max_connections",
        "host.nic_locality",
        "cuda.init",
    ]
    .iter()
    .map(|id| (id.to_string(), "pass".to_string()))
    .collect();
    for gpu in 0..8 {
        want.insert(format!("cuda.init.gpu{gpu}"), "pass".into());
    }
    // No driver in the fixtures' world: NVML health is skipped, whatever the machine.
    want.insert("nvml".into(), "skipped".into());
    for (id, status) in changed {
        want.insert(id.to_string(), status.to_string());
    }
    assert_eq!(statuses(report), want, "{}", preflight::table::render(report));
    assert_eq!(report.interconnect_class, class);
    assert_eq!(report.verdict, verdict);
    assert_eq!(report.source, "host-file");
    assert_eq!(report.local_id, format!("node-a-{}", report.started_at_ms));
    assert!(report.topology.starts_with("\tGPU0\tGPU1"), "{}", report.topology);
}

fn check<'a>(report: &'a PreflightReport, id: &str) -> &'a trainyard_proto::v1::PreflightCheck {
    report.checks.iter().find(|c| c.id == id).unwrap_or_else(|| panic!("no check {id}"))
}

#[test]
fn healthy_h100_sxm_on_one_numa_node_passes() {
    let r = run("h100-sxm-1numa.json");
    assert_report(&r, "nvswitch", "pass", &[]);
    assert_eq!(check(&r, "numa.cpus_per_gpu").measured, "26 CPUs per GPU on NUMA node 0 (208 CPUs, 8 GPUs)");
    assert_eq!(r.cuda_version, "12.8");
}

#[test]
fn h100_sxm_split_4_4_warns_with_the_measured_cost() {
    let r = run("h100-sxm-2numa.json");
    assert_report(&r, "nvswitch", "warn", &[("numa.split", "warn")]);
    let split = check(&r, "numa.split");
    assert_eq!(split.measured, "GPUs on NUMA nodes 0:4 1:4");
    assert!(split.remedy.contains("1295 ms per step instead of 702 ms"), "{}", split.remedy);
    assert!(check(&r, "host.nic_locality").measured.contains("mlx5_7:node1"));
}

#[test]
fn h100_nvl_is_nvlink_pairs() {
    let r = run("h100-nvl.json");
    assert_report(&r, "nvlink-pairs", "warn", &[("numa.split", "warn")]);
    assert!(check(&r, "topology.class").expected.starts_with("nvlink-pairs for NVIDIA H100 NVL"));
}

#[test]
fn h100_pcie_is_pcie() {
    let r = run("h100-pcie.json");
    assert_report(&r, "pcie", "warn", &[("numa.split", "warn")]);
}

#[test]
fn h200_sxm_passes() {
    let r = run("h200-sxm.json");
    assert_report(&r, "nvswitch", "pass", &[]);
}

#[test]
fn a_gpu_whose_cuda_init_fails_fails_the_node() {
    let r = run("cuda-fails-gpu3.json");
    assert_report(&r, "nvswitch", "fail", &[("cuda.init.gpu3", "fail")]);
    assert_eq!(
        preflight::failure_reason(&r).unwrap(),
        "preflight failed: cuda.init.gpu3: context: DriverError(CUDA_ERROR_UNKNOWN, \"unknown error\") \
         (expected cuInit, then a context, an allocation and a copy on every GPU checked)"
    );
    assert!(check(&r, "cuda.init.gpu3").remedy.contains("driver/runtime mismatch"));
}

/// A job's launch preflight checks the job's GPUs only: the broken GPU 3 of another job is
/// neither touched nor held against this job, and the report names the job and its GPUs.
#[test]
fn a_jobs_launch_preflight_checks_its_own_gpus_only() {
    let host = fixture("cuda-fails-gpu3.json");
    let facts = host.host_facts().expect("fixtures carry a host section");
    let env = BTreeMap::new();
    let scope = Scope::Job { job_id: 42, gpus: &[0, 1] };
    let r = preflight::run(
        &Request { level: PreflightLevel::Full, agent_id: "node-a", job_env: &env, scope },
        &host,
        &facts,
    );
    assert_eq!((r.job_id, r.gpus.as_slice()), (42, &[0, 1][..]));
    let cuda: Vec<&str> =
        r.checks.iter().map(|c| c.id.as_str()).filter(|id| id.starts_with("cuda.init.")).collect();
    assert_eq!(cuda, ["cuda.init.gpu0", "cuda.init.gpu1"], "{r:?}");
    assert_eq!(r.verdict, "pass", "{r:?}");
    // The same job on GPUs 2 and 3 meets the broken one, and says so by its index.
    let scope = Scope::Job { job_id: 42, gpus: &[2, 3] };
    let r = preflight::run(
        &Request { level: PreflightLevel::Quick, agent_id: "node-a", job_env: &env, scope },
        &host,
        &facts,
    );
    assert_eq!(r.verdict, "fail", "{r:?}");
    assert_eq!(check(&r, "cuda.init.gpu3").status, "fail");
    assert_eq!(check(&r, "cuda.init.gpu2").status, "pass");
    assert!(r.checks.iter().all(|c| c.id != "cuda.init.gpu0"), "{r:?}");
}

#[test]
fn no_dev_shm_fails_the_node() {
    let r = run("no-dev-shm.json");
    assert_report(&r, "nvswitch", "fail", &[("host.shm", "fail")]);
    let shm = check(&r, "host.shm");
    assert_eq!(shm.measured, "/dev/shm not mounted");
    assert!(shm.remedy.contains("3.2x"), "{}", shm.remedy);
}

#[test]
fn numa_balancing_on_a_two_node_machine_fails() {
    let r = run("numa-balancing-on.json");
    assert_report(&r, "nvswitch", "fail", &[("numa.split", "warn"), ("numa.balancing", "fail")]);
    assert_eq!(check(&r, "numa.balancing").measured, "1");
    assert!(check(&r, "numa.balancing").remedy.contains("sysctl -w kernel.numa_balancing=0"));
}

#[test]
fn nccl_shm_disable_in_the_job_environment_fails_the_launch() {
    let r = run_with("h100-sxm-1numa.json", PreflightLevel::Quick, &[("NCCL_SHM_DISABLE", "1")]);
    assert_report(&r, "nvswitch", "fail", &[("env.nccl_shm_disable", "fail")]);
    assert_eq!(
        preflight::failure_reason(&r).unwrap(),
        "preflight failed: env.nccl_shm_disable: NCCL_SHM_DISABLE=1 (job environment) (expected unset)"
    );
    assert!(check(&r, "env.nccl_shm_disable").remedy.contains("3.2x"));
    // Without the job's overlay the same node passes.
    assert_eq!(run("h100-sxm-1numa.json").verdict, "pass");
}

#[test]
fn cuda_device_max_connections_1_warns() {
    let r = run_with("h200-sxm.json", PreflightLevel::Quick, &[("CUDA_DEVICE_MAX_CONNECTIONS", "1")]);
    assert_report(&r, "nvswitch", "warn", &[("env.cuda_device_max_connections", "warn")]);
}

#[test]
fn standard_level_adds_the_nccl_sweep_which_says_why_it_is_skipped() {
    let r = run_with("h100-sxm-1numa.json", PreflightLevel::Standard, &[]);
    let nccl = check(&r, "nccl.busbw");
    assert_eq!(nccl.status, "skipped");
    // In a test harness the sweep cannot start the agent binary; without NCCL it says so first.
    assert!(
        nccl.measured == "skipped: NCCL (libnccl.so.2) not found"
            || nccl.measured.starts_with("skipped: the NCCL sweep runs in the trainyard-agent binary"),
        "{}",
        nccl.measured
    );
    assert_eq!(r.verdict, "pass");
    // A node whose CUDA check failed does not get an NCCL sweep.
    let r = run_with("cuda-fails-gpu3.json", PreflightLevel::Full, &[]);
    assert_eq!(check(&r, "nccl.busbw").measured, "skipped: CUDA check failed on this node");
}

/// The e2e tests' host files have no optional sections: the real machine's facts apply, and a
/// CPU-only machine with a normal /dev/shm must not fail the node.
#[test]
fn host_file_without_sections_uses_this_machine_and_does_not_fail_it() {
    let dir = tempfile::tempdir().unwrap();
    let links: Vec<Vec<&str>> =
        (0..8).map(|i| (0..8).map(|j| if i == j { "X" } else { "NV18" }).collect()).collect();
    let gpus: Vec<serde_json::Value> = (0..8)
        .map(|i| {
            serde_json::json!({"index": i, "uuid": format!("GPU-{i}"), "model": "NVIDIA H100 80GB HBM3",
            "memory_mib": 81559, "pci_bus_id": format!("00000000:{:02x}:00.0", i + 1), "numa_node": 0})
        })
        .collect();
    let doc = serde_json::json!({"hostname": "ci", "gpus": gpus, "links": links,
        "numa_nodes": [{"id": 0, "cpus": "0-1"}]});
    let path = dir.path().join("ci.json");
    std::fs::write(&path, doc.to_string()).unwrap();
    let host = HostFile::load(&path).unwrap();
    assert!(host.host_facts().is_none());
    let facts = HostFacts::gather();
    let r = preflight::run(
        &Request {
            level: PreflightLevel::Quick,
            agent_id: "ci",
            job_env: &BTreeMap::new(),
            scope: Scope::Node,
        },
        &host,
        &facts,
    );
    let cuda = check(&r, "cuda.init");
    if Path::new("/proc/driver/nvidia").exists() {
        return; // a GPU machine: the real driver answers
    }
    assert_ne!(r.verdict, "fail", "{}", preflight::table::render(&r));
    assert_eq!(
        (cuda.status.as_str(), cuda.measured.as_str()),
        ("skipped", "skipped: CUDA driver (libcuda.so.1) not found")
    );
    let nvml = check(&r, "nvml");
    assert_eq!(
        (nvml.status.as_str(), nvml.measured.as_str()),
        ("skipped", "skipped: NVML (libnvidia-ml.so.1) not found")
    );
    // 2 CPUs for 8 GPUs: a warning, never a failure.
    assert!(["pass", "warn"].contains(&check(&r, "numa.cpus_per_gpu").status.as_str()));
    let balancing = check(&r, "numa.balancing");
    assert!(["pass", "skipped"].contains(&balancing.status.as_str()), "{}", balancing.measured);
}

#[test]
fn unknown_fields_in_the_optional_sections_are_refused() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hosts/h100-sxm-1numa.json");
    let mut doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["host"]["shm"] = serde_json::json!(1);
    let e = HostFile::parse(&doc.to_string(), Path::new("x.json")).unwrap_err().to_string();
    assert!(e.contains("shm"), "{e}");
    let mut doc2 = doc.clone();
    doc2["host"].as_object_mut().unwrap().remove("shm");
    doc2["cuda"]["gpu_errors"] = serde_json::json!({"9": "x"});
    let e = HostFile::parse(&doc2.to_string(), Path::new("x.json")).unwrap_err().to_string();
    assert!(e.contains("cuda.gpu_errors.9"), "{e}");
}

#[test]
fn json_output_carries_every_check() {
    let r = run("h100-nvl.json");
    let json = preflight::to_json(&r);
    assert_eq!(json["verdict"], "warn");
    assert_eq!(json["interconnect_class"], "nvlink-pairs");
    assert_eq!(json["checks"].as_array().unwrap().len(), r.checks.len());
    let table = preflight::table::render(&r);
    assert!(table.contains("numa.split"));
    assert!(table.contains("GPU0\t X \tNV12\tNODE"), "{table}");
}
