//! The environment of a rank: torchrun's variables, trainyard's, and the job's overlay.
//!
//! The overlay comes from the job spec, so it is the one part a user controls: it cannot
//! override the variables the agent sets (a wrong `RANK` would hang a whole job in its first
//! collective).
//!
//! The device rule: `cuda:LOCAL_RANK` is the GPU the scheduler allocated to the rank, with no
//! per-rank renumbering. Local ranks take the job's GPUs on the host in ascending index order.
//! A job that holds every GPU of its host sees them all, unmasked; a job that holds part of a
//! host gets one `CUDA_VISIBLE_DEVICES` listing its GPUs in ascending order, the same for every
//! rank of the job on that host, so the ranks and NCCL share one view. `CUDA_DEVICE_ORDER` is
//! `PCI_BUS_ID` so that CUDA numbers GPUs as NVML and `nvidia-smi` do (CUDA's own default
//! order, fastest first, may differ on mixed hosts).

use std::collections::BTreeMap;
use std::path::Path;

use trainyard_proto::v1::{Gpu, Launch, RankAssignment, job_spec};

/// Variables the agent owns; overlay entries with these names are ignored.
pub use trainyard_proto::contract::RANK_ENV as RESERVED;

/// Local id (`<agent_id>-<started_at_ms>`) of the preflight report the rank was launched under;
/// set by the launcher, absent when the agent has run no preflight yet.
pub const PREFLIGHT_REPORT: &str = "TRAINYARD_PREFLIGHT_REPORT";

/// Set for the ranks of a job that holds part of its host, never from the overlay nor inherited
/// from the agent's own environment.
pub const VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// The resume candidates from the agent to the shim, never seen by the rank.
pub const RESUME_CANDIDATES: &str = "TRAINYARD_RESUME_CANDIDATES";

/// What the host contributes to a rank's environment.
#[derive(Debug, Clone, Default)]
pub struct HostContext<'a> {
    /// Every GPU of the host (the agent's inventory).
    pub gpus: &'a [Gpu],
    /// Whether the agent's own environment sets `OMP_NUM_THREADS` (the ranks inherit it).
    pub inherited_omp_threads: bool,
}

/// `CUDA_VISIBLE_DEVICES` for the ranks of `launch` on this host: `None` when the job holds
/// every GPU of the host, else its GPU indices, ascending, comma-separated.
pub fn visible_devices(launch: &Launch, host_gpus: &[Gpu]) -> Option<String> {
    let mut mine: Vec<u32> = launch.ranks.iter().map(|a| a.gpu_index).collect();
    mine.sort_unstable();
    mine.dedup();
    let mut all: Vec<u32> = host_gpus.iter().map(|g| g.index).collect();
    all.sort_unstable();
    // An empty list would hide every GPU: a launch without ranks here leaves the mask alone.
    (!mine.is_empty() && mine != all).then(|| mine.iter().map(u32::to_string).collect::<Vec<_>>().join(","))
}

/// A rank's environment on top of the agent's own, and the overlay names that were dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    pub vars: BTreeMap<String, String>,
    pub ignored_overlay: Vec<String>,
}

/// Builds the environment of `assignment` in `launch`; `receipts` is the absolute path of
/// the rank's receipts file.
pub fn rank_env(
    launch: &Launch,
    assignment: &RankAssignment,
    receipts: &Path,
    host: &HostContext<'_>,
) -> RankEnv {
    let mut vars = BTreeMap::new();
    let mut ignored_overlay = Vec::new();
    let overlay = launch.spec.as_ref().map(|s| &s.env);
    for (name, value) in overlay.into_iter().flatten() {
        if RESERVED.contains(&name.as_str()) {
            ignored_overlay.push(name.clone());
        } else {
            vars.insert(name.clone(), value.clone());
        }
    }
    ignored_overlay.sort();
    let applied_overlay = overlay_names(&vars);
    // torchrun gives every worker OMP_NUM_THREADS=1 when it starts several per host and the
    // variable is not set, so that N ranks do not each start one thread per core.
    if launch.local_world_size > 1 && !vars.contains_key("OMP_NUM_THREADS") && !host.inherited_omp_threads {
        vars.insert("OMP_NUM_THREADS".into(), "1".into());
    }
    let nodes = if launch.node_count > 0 {
        launch.node_count
    } else {
        launch.world_size.div_ceil(launch.local_world_size.max(1))
    };
    let max_restarts = launch.spec.as_ref().and_then(|s| s.restart.as_ref()).map_or(0, |r| r.max_restarts);
    let gpu = host.gpus.iter().find(|g| g.index == assignment.gpu_index);
    let ours = [
        ("RANK", assignment.rank.to_string()),
        ("LOCAL_RANK", assignment.local_rank.to_string()),
        ("WORLD_SIZE", launch.world_size.to_string()),
        ("LOCAL_WORLD_SIZE", launch.local_world_size.to_string()),
        ("GROUP_RANK", launch.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", nodes.to_string()),
        ("ROLE_RANK", assignment.rank.to_string()),
        ("ROLE_WORLD_SIZE", launch.world_size.to_string()),
        ("ROLE_NAME", "default".to_string()),
        ("MASTER_ADDR", launch.master_addr.clone()),
        ("MASTER_PORT", launch.master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", launch.attempt.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", format!("trainyard-job-{}", launch.job_id)),
        ("TORCHELASTIC_USE_AGENT_STORE", "False".to_string()),
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_string()),
        ("NODE_RANK", launch.node_rank.to_string()),
        ("TRAINYARD_JOB_ID", launch.job_id.to_string()),
        ("TRAINYARD_ATTEMPT", launch.attempt.to_string()),
        ("TRAINYARD_RECEIPTS", receipts.display().to_string()),
        ("TRAINYARD_GPU", assignment.gpu_index.to_string()),
        ("TRAINYARD_GPU_UUID", gpu.map(|g| g.uuid.clone()).unwrap_or_default()),
        ("TRAINYARD_GPU_PCI_BUS_ID", gpu.map(|g| g.pci_bus_id.clone()).unwrap_or_default()),
        ("TRAINYARD_RESUME", if resumes(launch) { "1" } else { "0" }.to_string()),
        (
            "TRAINYARD_CHECKPOINT_REQUEST",
            crate::layout::checkpoint_request_beside(receipts).display().to_string(),
        ),
        // Chosen by the shim, as the job's user, from the candidates (`resume_candidates`).
        ("TRAINYARD_RESUME_STEP", String::new()),
        ("TRAINYARD_RESUME_PATH", String::new()),
        (RESUME_CANDIDATES, resume_candidates(launch)),
        // The overlay names that reached the process, comma-separated, so a receipt helper
        // records the overlay (and only it) in its launch receipt.
        ("TRAINYARD_ENV_OVERLAY", applied_overlay),
        ("TRAINYARD_SOURCE_DIR", source_dir(launch)),
    ];
    for (name, value) in ours {
        vars.insert(name.to_string(), value);
    }
    if let Some(list) = visible_devices(launch, host.gpus) {
        vars.insert(VISIBLE_DEVICES.to_string(), list);
    }
    RankEnv { vars, ignored_overlay }
}

/// The overlay entries kept in `vars` (called before the agent adds its own), by name.
fn overlay_names(vars: &BTreeMap<String, String>) -> String {
    vars.keys().map(String::as_str).collect::<Vec<_>>().join(",")
}

/// The directory whose git revision the rank's launch receipt records: the exec engine's
/// `source_dir`, else its `workdir`; empty for the built-in engine.
fn source_dir(launch: &Launch) -> String {
    match launch.spec.as_ref().and_then(|s| s.engine.as_ref()) {
        Some(job_spec::Engine::Exec(e)) if !e.source_dir.is_empty() => e.source_dir.clone(),
        Some(job_spec::Engine::Exec(e)) => e.workdir.clone(),
        _ => String::new(),
    }
}

/// The checkpoints of earlier attempts that every rank reported (the controller's list, newest
/// first), as the shim gets them in the rank's environment: a JSON list of `[step, path]`, a
/// relative path read from the job's workdir; empty when the attempt does not resume. The shim
/// gives the rank the newest whose path exists as the job's user sees it
/// ([`crate::supervise::pick_resume_point`]): the agent, root, never looks at a path a user
/// named.
fn resume_candidates(launch: &Launch) -> String {
    if !resumes(launch) || launch.resume_from.is_empty() {
        return String::new();
    }
    let workdir = match launch.spec.as_ref().and_then(|s| s.engine.as_ref()) {
        Some(job_spec::Engine::Exec(e)) => e.workdir.as_str(),
        _ => "",
    };
    let list: Vec<(i64, String)> = launch
        .resume_from
        .iter()
        .map(|p| (p.step, Path::new(workdir).join(&p.path).display().to_string()))
        .collect();
    serde_json::to_string(&list).unwrap_or_default()
}

/// A restarted attempt of a job whose restart policy says resume continues from the last
/// checkpoint; the rank reads that from `TRAINYARD_RESUME`.
fn resumes(launch: &Launch) -> bool {
    launch.attempt > 0 && launch.spec.as_ref().and_then(|s| s.restart.as_ref()).is_some_and(|r| r.resume)
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::JobSpec;

    fn launch() -> Launch {
        let env = [("RANK", "99"), ("FOO", "bar"), ("CUDA_VISIBLE_DEVICES", "0"), ("TRAINYARD_GPU", "5")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch {
            job_id: 12,
            attempt: 2,
            world_size: 16,
            node_rank: 1,
            local_world_size: 8,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            ranks: vec![],
            spec: Some(JobSpec { env, ..Default::default() }),
            node_count: 0,
            run_as: String::new(),
            resume_from: Vec::new(),
            run_name: String::new(),
        }
    }

    fn gpus(n: u32) -> Vec<Gpu> {
        (0..n)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{i}"),
                pci_bus_id: format!("00000000:{:02x}:00.0", 0x18 + i),
                ..Default::default()
            })
            .collect()
    }

    fn env_of(l: &Launch, a: &RankAssignment, host_gpus: &[Gpu]) -> RankEnv {
        rank_env(
            l,
            a,
            Path::new("/d/receipts.jsonl"),
            &HostContext { gpus: host_gpus, inherited_omp_threads: false },
        )
    }

    #[test]
    fn sets_torchrun_and_trainyard_variables() {
        let a = RankAssignment { rank: 11, local_rank: 3, gpu_index: 6, ..Default::default() };
        let mut l = launch();
        l.node_count = 2;
        l.spec.as_mut().unwrap().restart =
            Some(trainyard_proto::v1::RestartPolicy { max_restarts: 3, resume: true, ..Default::default() });
        let env = env_of(&l, &a, &gpus(8));
        let get = |k: &str| env.vars.get(k).map(String::as_str);
        assert_eq!(get("RANK"), Some("11"));
        assert_eq!(get("LOCAL_RANK"), Some("3"));
        assert_eq!(get("WORLD_SIZE"), Some("16"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("8"));
        assert_eq!(get("GROUP_RANK"), Some("1"));
        assert_eq!(get("GROUP_WORLD_SIZE"), Some("2"));
        assert_eq!(get("ROLE_RANK"), Some("11"));
        assert_eq!(get("ROLE_WORLD_SIZE"), Some("16"));
        assert_eq!(get("ROLE_NAME"), Some("default"));
        assert_eq!(get("NODE_RANK"), Some("1"));
        assert_eq!(get("MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("29500"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("2"));
        assert_eq!(get("TORCHELASTIC_MAX_RESTARTS"), Some("3"));
        assert_eq!(get("TORCHELASTIC_RUN_ID"), Some("trainyard-job-12"));
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), Some("False"));
        assert_eq!(get("OMP_NUM_THREADS"), Some("1"), "torchrun's default with several ranks per host");
        assert_eq!(get("CUDA_DEVICE_ORDER"), Some("PCI_BUS_ID"));
        assert_eq!(get("TRAINYARD_JOB_ID"), Some("12"));
        assert_eq!(get("TRAINYARD_ATTEMPT"), Some("2"));
        assert_eq!(get("TRAINYARD_RECEIPTS"), Some("/d/receipts.jsonl"));
        assert_eq!(get("TRAINYARD_GPU"), Some("6"));
        assert_eq!(get("TRAINYARD_GPU_UUID"), Some("GPU-6"));
        assert_eq!(get("TRAINYARD_GPU_PCI_BUS_ID"), Some("00000000:1e:00.0"));
        assert_eq!(get("TRAINYARD_RESUME"), Some("1"));
        // Every name we set is one the overlay may not redefine.
        for name in env.vars.keys().filter(|k| *k != "FOO" && *k != "OMP_NUM_THREADS") {
            assert!(RESERVED.contains(&name.as_str()), "{name} is set but not reserved");
        }
    }

    #[test]
    fn omp_threads_is_left_to_the_job_or_the_agent() {
        let a = RankAssignment::default();
        let mut l = launch();
        l.spec.as_mut().unwrap().env.insert("OMP_NUM_THREADS".into(), "4".into());
        assert_eq!(env_of(&l, &a, &gpus(8)).vars["OMP_NUM_THREADS"], "4");
        l.spec.as_mut().unwrap().env.remove("OMP_NUM_THREADS");
        let inherited = HostContext { gpus: &[], inherited_omp_threads: true };
        assert!(!rank_env(&l, &a, Path::new("/r"), &inherited).vars.contains_key("OMP_NUM_THREADS"));
        l.local_world_size = 1;
        assert!(!env_of(&l, &a, &gpus(8)).vars.contains_key("OMP_NUM_THREADS"), "one rank per host: unset");
    }

    /// A whole host: every GPU visible; part of a host (GPUs 4-7): one ascending list shared by
    /// the job's ranks there, so that cuda:LOCAL_RANK is the allocated GPU.
    #[test]
    fn visible_devices_follow_the_device_rule() {
        let assign = |gpus: &[u32]| -> Vec<RankAssignment> {
            gpus.iter()
                .enumerate()
                .map(|(local, &g)| RankAssignment {
                    rank: local as u32,
                    local_rank: local as u32,
                    gpu_index: g,
                    ..Default::default()
                })
                .collect()
        };
        let mut l = launch();
        l.ranks = assign(&[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(visible_devices(&l, &gpus(8)), None);
        assert!(!env_of(&l, &l.ranks[3].clone(), &gpus(8)).vars.contains_key(VISIBLE_DEVICES));
        l.ranks = assign(&[4, 5, 6, 7]);
        assert_eq!(visible_devices(&l, &gpus(8)).as_deref(), Some("4,5,6,7"));
        let rank0 = env_of(&l, &l.ranks[0].clone(), &gpus(8));
        assert_eq!(rank0.vars[VISIBLE_DEVICES], "4,5,6,7");
        assert_eq!(rank0.vars["LOCAL_RANK"], "0", "cuda:0 under this mask is GPU 4");
        assert_eq!(rank0.vars["TRAINYARD_GPU"], "4");
        // The list is ascending whatever order the assignments come in.
        l.ranks.reverse();
        assert_eq!(visible_devices(&l, &gpus(8)).as_deref(), Some("4,5,6,7"));
    }

    #[test]
    fn restarted_attempts_resume_when_the_policy_says_so() {
        let a = RankAssignment::default();
        let mut l = launch();
        let resume = |l: &Launch| env_of(l, &a, &[]).vars["TRAINYARD_RESUME"].clone();
        l.spec.as_mut().unwrap().restart =
            Some(trainyard_proto::v1::RestartPolicy { max_restarts: 3, resume: true, ..Default::default() });
        assert_eq!(resume(&l), "1");
        l.attempt = 0;
        assert_eq!(resume(&l), "0", "a first attempt has nothing to resume from");
        l.attempt = 1;
        l.spec.as_mut().unwrap().restart.as_mut().unwrap().resume = false;
        assert_eq!(resume(&l), "0");
        l.spec.as_mut().unwrap().restart = None;
        assert_eq!(resume(&l), "0", "no restart policy: nothing to resume");
    }

    #[test]
    fn the_resume_point_is_the_newest_checkpoint_whose_files_are_here() {
        let dir = tempfile::tempdir().unwrap();
        let present = dir.path().join("step_20");
        std::fs::create_dir_all(&present).unwrap();
        let point = |step: i64, path: &Path| trainyard_proto::v1::ResumePoint {
            step,
            path: path.display().to_string(),
        };
        let a = RankAssignment::default();
        let mut l = launch();
        l.attempt = 2;
        l.spec.as_mut().unwrap().restart =
            Some(trainyard_proto::v1::RestartPolicy { max_restarts: 3, resume: true, ..Default::default() });
        // Step 30's files did not reach this host's storage; step 20's did.
        l.resume_from =
            vec![point(30, &dir.path().join("step_30")), point(20, &present), point(10, &present)];
        let mut env = env_of(&l, &a, &[]).vars;
        crate::supervise::pick_resume_point(&mut env);
        assert_eq!(env["TRAINYARD_RESUME_STEP"], "20");
        assert_eq!(env["TRAINYARD_RESUME_PATH"], present.display().to_string());
        assert!(!env.contains_key(RESUME_CANDIDATES), "the candidates never reach the rank");
        l.resume_from.truncate(1);
        let mut env = env_of(&l, &a, &[]).vars;
        crate::supervise::pick_resume_point(&mut env);
        assert_eq!((env["TRAINYARD_RESUME_STEP"].as_str(), env["TRAINYARD_RESUME_PATH"].as_str()), ("", ""));
    }

    #[test]
    fn names_the_applied_overlay_and_the_source_directory() {
        let a = RankAssignment { local_rank: 0, ..Default::default() };
        let mut l = launch();
        let env = env_of(&l, &a, &gpus(8));
        // RANK, CUDA_VISIBLE_DEVICES and TRAINYARD_GPU were refused, and OMP_NUM_THREADS is ours.
        assert_eq!(env.vars["TRAINYARD_ENV_OVERLAY"], "FOO");
        assert_eq!(env.vars["TRAINYARD_SOURCE_DIR"], "", "no exec engine, no source");
        l.spec.as_mut().unwrap().engine = Some(job_spec::Engine::Exec(trainyard_proto::v1::ExecEngine {
            workdir: "/w".into(),
            ..Default::default()
        }));
        assert_eq!(env_of(&l, &a, &gpus(8)).vars["TRAINYARD_SOURCE_DIR"], "/w");
        if let Some(job_spec::Engine::Exec(e)) = l.spec.as_mut().unwrap().engine.as_mut() {
            e.source_dir = "/src".into();
        }
        assert_eq!(env_of(&l, &a, &gpus(8)).vars["TRAINYARD_SOURCE_DIR"], "/src");
    }

    #[test]
    fn overlay_cannot_override_ours_nor_set_cuda_visible_devices() {
        let a = RankAssignment { rank: 0, local_rank: 0, gpu_index: 0, ..Default::default() };
        let env = env_of(&launch(), &a, &gpus(8));
        assert_eq!(env.vars.get("FOO").map(String::as_str), Some("bar"));
        assert_eq!(env.vars.get("RANK").map(String::as_str), Some("0"));
        assert_eq!(env.vars.get("TRAINYARD_GPU").map(String::as_str), Some("0"));
        assert!(!env.vars.contains_key(VISIBLE_DEVICES), "no ranks in the launch: {:?}", env.vars);
        assert_eq!(env.ignored_overlay, vec!["CUDA_VISIBLE_DEVICES", "RANK", "TRAINYARD_GPU"]);
    }
}
