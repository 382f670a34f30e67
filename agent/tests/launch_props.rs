//! Property tests of the agent's handling of what a controller sends it about ranks: a launch
//! of any shape (rank numbers, GPU indices, run names, accounts, argv, env, ports), then a
//! request to checkpoint, a cancel and a forget, with any values. Whatever comes, the launcher
//! never panics, every rank the launch names ends up known in a state the controller can read
//! (a rank it could not start says why), refusals name their cause, and nothing it started
//! outlives the case. Real shims and processes, in a temporary data directory; a few dozen
//! cases, each a fresh launcher.

use std::path::Path;
use std::time::Duration;

use proptest::prelude::*;
use trainyard_agent::launcher::Launcher;
use trainyard_agent::layout::{DiskFloor, Layout};
use trainyard_agent::procfs;
use trainyard_proto::v1::{
    ExecEngine, Gpu, HostInventory, JobSpec, Launch, NumaNode, RankAssignment, job_spec,
};
use trainyard_proto::words::RankState;

fn inventory() -> HostInventory {
    let gpu = |index: u32| Gpu { index, uuid: format!("GPU-{index}"), numa_node: 0, ..Default::default() };
    HostInventory {
        hostname: "props".into(),
        gpus: vec![gpu(0), gpu(1)],
        numa_nodes: vec![NumaNode { id: 0, cpus: "0-1".into() }],
        links: vec!["X".into(), "NV4".into(), "NV4".into(), "X".into()],
        cores: vec![],
    }
}

fn launcher(data: &Path) -> Launcher {
    let shim = std::path::PathBuf::from(env!("CARGO_BIN_EXE_trainyard-agent"));
    Launcher::new(Layout::new(data.join("data")), shim, inventory())
        .expect("launcher")
        .allow_root_ranks(true)
        .with_limits(trainyard_agent::output::DEFAULT_CAP_BYTES, DiskFloor { bytes: 0, percent: 0 })
}

/// Kills every process the launcher started (ranks and shims).
fn kill_all(launcher: &Launcher) {
    for rank in launcher.ranks() {
        if let Some(pid) = rank.record.pid {
            let _ = procfs::killpg(pid, libc::SIGKILL);
        }
        if let (Some(pid), Some(start)) = (rank.record.shim_pid, rank.record.shim_start_time)
            && procfs::is_same_live_process(pid, start)
        {
            let _ = procfs::killpg(pid, libc::SIGKILL);
        }
    }
}

fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), "[a-z0-9._-]{1,12}", "(?s).{0,40}"]
}

prop_compose! {
    fn any_launch()(
        job_id in 0u64..4,
        attempt in 0u32..3,
        ranks in prop::collection::vec((0u32..4, 0u32..3, 0u32..4), 0..4),
        run_name in any_text(),
        run_as in prop_oneof![Just(String::new()), Just("root".to_string()), any_text()],
        argv in prop_oneof![
            Just(vec!["true".to_string()]),
            Just(vec!["sh".to_string(), "-c".to_string(), "exit 3".to_string()]),
            Just(Vec::new()),
            prop::collection::vec(any_text(), 0..3),
        ],
        workdir in prop_oneof![Just("/tmp".to_string()), Just(String::new()), any_text()],
        env in prop::collection::btree_map("[A-Z_]{1,10}", any_text(), 0..4),
        master_port in prop_oneof![Just(0u32), Just(29_500u32), any::<u32>()],
        world_size in 0u32..9,
    ) -> Launch {
        Launch {
            job_id,
            attempt,
            world_size,
            node_rank: 0,
            local_world_size: ranks.len() as u32,
            master_addr: "127.0.0.1".into(),
            master_port,
            ranks: ranks
                .into_iter()
                .map(|(rank, local_rank, gpu_index)| RankAssignment { rank, local_rank, gpu_index, ..Default::default() })
                .collect(),
            spec: Some(JobSpec {
                name: "props".into(),
                engine: Some(job_spec::Engine::Exec(ExecEngine { argv, workdir, source_dir: String::new() })),
                env: env.into_iter().collect(),
                ..Default::default()
            }),
            node_count: 1,
            run_as,
            run_name,
            resume_from: Vec::new(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn any_launch_then_checkpoint_cancel_and_forget_is_handled(
        launch in any_launch(),
        signal in prop_oneof![Just("SIGUSR1".to_string()), Just(String::new()), any_text()],
        reason in any_text(),
        grace_ms in 0u64..200,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut launcher = launcher(dir.path());
        let outcome = runtime.block_on(async {
            let ids = launcher.launch(&launch);
            prop_assert_eq!(ids.len(), launch.ranks.len(), "one id per assignment");
            launcher.poll_exits();
            for id in &ids {
                let Some(rank) = launcher.get(*id) else { continue };
                let r = &rank.record;
                prop_assert!(
                    matches!(r.phase, RankState::Launching | RankState::Running | RankState::Exited | RankState::Lost),
                    "{id}: {:?}", r.phase
                );
                // A rank that was not started says why.
                if r.shim_pid.is_none() {
                    prop_assert!(!r.message.is_empty(), "{id}: not started, no reason: {r:?}");
                }
                // Never on a GPU the host lacks (the first assignment of a rank number is the one).
                let first = launch.ranks.iter().find(|a| a.rank == id.rank).expect("assigned");
                if first.gpu_index >= 2 {
                    prop_assert!(r.shim_pid.is_none(), "{id} started on GPU {}: {r:?}", first.gpu_index);
                }
            }
            launcher.checkpoint_now(launch.job_id, launch.attempt, &signal, &reason);
            let stops = launcher.cancel(launch.job_id, launch.attempt, Duration::from_millis(grace_ms), &reason);
            for stop in stops {
                let _ = tokio::time::timeout(Duration::from_secs(10), stop).await;
            }
            launcher.poll_exits();
            launcher.forget(launch.job_id, launch.attempt);
            launcher.drop_forgotten();
            Ok::<(), TestCaseError>(())
        });
        kill_all(&launcher);
        outcome?;
    }
}
