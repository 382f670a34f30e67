//! The launcher against real processes: the real shim binary, `sh -c` ranks, /proc checks.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use trainyard_agent::launcher::Launcher;
use trainyard_agent::layout::{DiskFloor, Layout, RankId};
use trainyard_agent::procfs;
use trainyard_agent::supervise::ExitFile;
use trainyard_proto::v1::{
    ExecEngine, Gpu, HostInventory, JobSpec, Launch, NumaNode, RankAssignment, job_spec,
};
use trainyard_proto::words::RankState;

/// No disk floor: the test machine's disk is not ours to keep free.
const NO_FLOOR: DiskFloor = DiskFloor { bytes: 0, percent: 0 };

fn inventory() -> HostInventory {
    let gpu = |index: u32| Gpu { index, uuid: format!("GPU-{index}"), numa_node: 0, ..Default::default() };
    HostInventory {
        hostname: "test".into(),
        gpus: vec![gpu(0), gpu(1)],
        numa_nodes: vec![NumaNode { id: 0, cpus: "0-3".into() }],
        links: vec!["X".into(), "NV4".into(), "NV4".into(), "X".into()],
        cores: vec![],
    }
}

fn launch(job_id: u64, ranks: u32, workdir: &Path, argv: &[&str], env: &[(&str, &str)]) -> Launch {
    Launch {
        job_id,
        attempt: 1,
        world_size: ranks,
        node_rank: 0,
        local_world_size: ranks,
        master_addr: "127.0.0.1".into(),
        master_port: 29500,
        ranks: (0..ranks)
            .map(|r| RankAssignment { rank: r, local_rank: r, gpu_index: r, ..Default::default() })
            .collect(),
        spec: Some(JobSpec {
            name: "t".into(),
            engine: Some(job_spec::Engine::Exec(ExecEngine {
                argv: argv.iter().map(|s| s.to_string()).collect(),
                workdir: workdir.display().to_string(),
                source_dir: String::new(),
            })),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }),
        node_count: 1,
        run_as: String::new(),
        run_name: String::new(),
        resume_from: Vec::new(),
    }
}

/// A launcher in a temporary data dir that kills every process it started when dropped, so a
/// failing test leaves nothing behind.
struct Harness {
    dir: tempfile::TempDir,
    launcher: Launcher,
}

impl Harness {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("work")).unwrap();
        let launcher = Self::launcher_over(dir.path());
        Self { dir, launcher }
    }

    fn launcher_over(data: &Path) -> Launcher {
        let shim = PathBuf::from(env!("CARGO_BIN_EXE_trainyard-agent"));
        // The test machine's disk is not ours: how full it is must not refuse these launches.
        Launcher::new(Layout::new(data.join("data")), shim, inventory())
            .unwrap()
            .allow_root_ranks(true)
            .with_limits(trainyard_agent::output::DEFAULT_CAP_BYTES, NO_FLOOR)
    }

    fn workdir(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    /// Polls until `done` holds for the rank, or fails after 10 s.
    async fn wait_for(&mut self, id: RankId, what: &str, done: impl Fn(RankState, Option<u32>) -> bool) {
        for _ in 0..200 {
            self.launcher.poll_exits();
            let r = &self.launcher.get(id).expect("rank is known").record;
            if done(r.phase, r.pid) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let r = &self.launcher.get(id).expect("rank is known").record;
        panic!("rank {id} never became {what}: it is {:?} ({:?})", r.phase, r.message);
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        for rank in self.launcher.ranks() {
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
}

fn id(job_id: u64, rank: u32) -> RankId {
    RankId { job_id, attempt: 1, rank }
}

#[tokio::test]
async fn rank_gets_its_environment_and_exit_status() {
    let mut h = Harness::new();
    let script = r#"env > "env-$RANK.txt"; echo '{"kind":"step","step":1}' >> "$TRAINYARD_RECEIPTS"; echo out; echo err >&2; exit 3"#;
    let overlay = [("FOO", "bar"), ("RANK", "99"), ("CUDA_VISIBLE_DEVICES", "0")];
    let ids = h.launcher.launch(&launch(1, 2, &h.workdir(), &["sh", "-c", script], &overlay));
    assert_eq!(ids, vec![id(1, 0), id(1, 1)]);
    for rank in 0..2 {
        h.wait_for(id(1, rank), "exited", |p, _| p == RankState::Exited).await;
        let r = &h.launcher.get(id(1, rank)).unwrap().record;
        assert_eq!((r.exit_code, r.signal), (Some(3), None));
        let exit = ExitFile::read(&r.files.exit).unwrap();
        assert_eq!((exit.exit_code, exit.signal), (Some(3), None));
        assert_eq!(std::fs::read_to_string(&r.files.stdout).unwrap(), "out\n");
        assert_eq!(std::fs::read_to_string(&r.files.stderr).unwrap(), "err\n");
        // The rank's line, then the agent's exit receipt: how it ended, what it used.
        let receipts = std::fs::read_to_string(&r.files.receipts).unwrap();
        let lines: Vec<&str> = receipts.lines().collect();
        assert_eq!(lines[0], "{\"kind\":\"step\",\"step\":1}");
        let exit: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(
            (&exit["kind"], &exit["status"], &exit["exit_code"]),
            (&"exit".into(), &"failed".into(), &3.into())
        );
        assert_eq!(lines.len(), 2, "one exit receipt: {receipts}");
        let env: HashMap<String, String> =
            std::fs::read_to_string(h.workdir().join(format!("env-{rank}.txt")))
                .unwrap()
                .lines()
                .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
                .collect();
        let expect = [
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_WORLD_SIZE", "2".into()),
            ("NODE_RANK", "0".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", "29500".into()),
            ("TRAINYARD_JOB_ID", "1".into()),
            ("TRAINYARD_ATTEMPT", "1".into()),
            ("TRAINYARD_GPU", rank.to_string()),
            ("TRAINYARD_RECEIPTS", r.files.receipts.display().to_string()),
            ("GROUP_RANK", "0".into()),
            ("GROUP_WORLD_SIZE", "1".into()),
            ("TORCHELASTIC_RUN_ID", "trainyard-job-1".into()),
            ("TORCHELASTIC_RESTART_COUNT", "1".into()),
            ("TRAINYARD_GPU_UUID", format!("GPU-{rank}")),
            ("FOO", "bar".into()),
        ];
        for (k, v) in expect {
            assert_eq!(env.get(k), Some(&v), "{k} of rank {rank}");
        }
        assert!(!env.contains_key("CUDA_VISIBLE_DEVICES"));
        assert!(h.launcher.layout().state_file(id(1, rank)).exists());
    }
    let launch_json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(h.launcher.layout().launch_json("job-1", 1)).unwrap()).unwrap();
    assert_eq!(launch_json["ranks"][1]["gpu_uuid"], "GPU-1");
    assert_eq!(launch_json["ranks"][1]["cpus"], "0-3");
}

/// The run directory is the one the controller named, unique to its job: a directory of that
/// name the agent did not make (a restored database's job, another controller's) is moved
/// aside with its files untouched, never reused; a name that could leave `runs/` is refused.
#[tokio::test]
async fn run_directories_are_named_by_the_controller_and_never_reused() {
    let mut h = Harness::new();
    let layout = h.launcher.layout().clone();
    let stale = layout.rank_dir("job-7-c0ffee00-1000", id(7, 0));
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("stdout.log"), "the previous user's output\n").unwrap();
    let mut named = launch(7, 1, &h.workdir(), &["sh", "-c", "echo mine"], &[]);
    named.run_name = "job-7-c0ffee00-1000".into();
    h.launcher.launch(&named);
    h.wait_for(id(7, 0), "exited", |p, _| p == RankState::Exited).await;
    let r = h.launcher.get(id(7, 0)).unwrap().record.clone();
    assert!(r.files.dir.starts_with(layout.run_dir("job-7-c0ffee00-1000")), "{:?}", r.files.dir);
    assert_eq!(std::fs::read_to_string(&r.files.stdout).unwrap(), "mine\n", "nothing of the old run");
    let aside: Vec<String> = std::fs::read_dir(layout.data_dir().join("runs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("job-7-c0ffee00-1000.moved-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    let old = layout.data_dir().join("runs").join(&aside[0]).join("attempt-1/rank-0/stdout.log");
    assert_eq!(std::fs::read_to_string(old).unwrap(), "the previous user's output\n");
    // Relaunching the same job (a reconnect) keeps its own directory where it is.
    h.launcher.launch(&named);
    assert!(r.files.stdout.exists());
    for (job, bad) in (80..).zip(["../etc", ".hidden", "a/b", &"x".repeat(129)]) {
        let mut hostile = launch(job, 1, &h.workdir(), &["true"], &[]);
        hostile.run_name = bad.to_string();
        h.launcher.launch(&hostile);
        let r = &h.launcher.get(id(job, 0)).unwrap().record;
        assert_eq!(r.phase, RankState::Lost, "{bad}");
        assert!(r.message.contains("run directory name"), "{}", r.message);
    }
    assert!(!layout.data_dir().join("etc").exists());
}

/// A job holding part of the host (GPU 1 of 2): its rank sees only that GPU, as cuda:0 =
/// cuda:LOCAL_RANK, and the launch record says so.
#[tokio::test]
async fn a_job_on_part_of_the_host_sees_its_gpus_only() {
    let mut h = Harness::new();
    let mut l = launch(9, 1, &h.workdir(), &["sh", "-c", r#"env > "env-part.txt""#], &[]);
    l.ranks[0].gpu_index = 1;
    h.launcher.launch(&l);
    h.wait_for(id(9, 0), "exited", |p, _| p == RankState::Exited).await;
    let env = std::fs::read_to_string(h.workdir().join("env-part.txt")).unwrap();
    for line in ["CUDA_VISIBLE_DEVICES=1", "LOCAL_RANK=0", "TRAINYARD_GPU=1", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    {
        assert!(env.lines().any(|l| l == line), "{line} missing from:\n{env}");
    }
    let launch_json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(h.launcher.layout().launch_json("job-9", 1)).unwrap()).unwrap();
    assert_eq!(launch_json["cuda_visible_devices"], "1");
    assert_eq!(launch_json["ranks"][0]["cuda_device"], "cuda:0");
    assert_eq!(launch_json["ranks"][0]["gpu_uuid"], "GPU-1");
}

#[tokio::test]
async fn launch_is_idempotent() {
    let mut h = Harness::new();
    let l = launch(2, 1, &h.workdir(), &["sleep", "30"], &[]);
    h.launcher.launch(&l);
    h.wait_for(id(2, 0), "running", |p, _| p == RankState::Running).await;
    let first = h.launcher.get(id(2, 0)).unwrap().record.clone();
    h.launcher.launch(&l);
    assert_eq!(h.launcher.get(id(2, 0)).unwrap().record.shim_pid, first.shim_pid);
    assert_eq!(h.launcher.ranks().count(), 1);
}

async fn cancel_and_check_group_gone(h: &mut Harness, job: u64, argv: &[&str], grace_ms: u64, signal: i32) {
    h.launcher.launch(&launch(job, 1, &h.workdir(), argv, &[]));
    h.wait_for(id(job, 0), "running", |p, _| p == RankState::Running).await;
    let pid = h.launcher.get(id(job, 0)).unwrap().record.pid.unwrap();
    // Let the script start its background child in the same group.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(procfs::group_has_live_member(pid));
    h.launcher.cancel(job, 1, Duration::from_millis(grace_ms), "test");
    h.wait_for(id(job, 0), "exited", |p, _| p == RankState::Exited).await;
    let r = &h.launcher.get(id(job, 0)).unwrap().record;
    assert_eq!(r.signal, Some(signal));
    assert_eq!(r.message, "cancelled: test");
    for _ in 0..40 {
        if !procfs::group_has_live_member(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("process group {pid} still has live members after cancel");
}

#[tokio::test]
async fn cancel_terminates_the_whole_group() {
    let mut h = Harness::new();
    cancel_and_check_group_gone(
        &mut h,
        3,
        &["sh", "-c", "sleep 1000 & sleep 1000; wait"],
        5000,
        libc::SIGTERM,
    )
    .await;
}

#[tokio::test]
async fn cancel_kills_a_group_that_ignores_sigterm() {
    let mut h = Harness::new();
    let script = "trap '' TERM; sleep 1000 & sleep 1000; wait";
    cancel_and_check_group_gone(&mut h, 4, &["sh", "-c", script], 300, libc::SIGKILL).await;
}

#[tokio::test]
async fn spawn_failures_become_exited_ranks_with_a_message() {
    let mut h = Harness::new();
    // The shim checks the program and the workdir (as the rank's user) and says why it failed.
    h.launcher.launch(&launch(5, 1, &h.workdir(), &["no-such-program-trainyard"], &[]));
    h.wait_for(id(5, 0), "exited", |p, _| p == RankState::Exited).await;
    let r = &h.launcher.get(id(5, 0)).unwrap().record;
    assert_eq!((r.phase, r.exit_code), (RankState::Exited, Some(127)));
    assert!(r.message.contains("not found"), "{}", r.message);
    assert!(h.launcher.layout().state_file(id(5, 0)).exists());

    h.launcher.launch(&launch(6, 1, &h.dir.path().join("missing"), &["sh", "-c", "true"], &[]));
    h.wait_for(id(6, 0), "exited", |p, _| p == RankState::Exited).await;
    let r = &h.launcher.get(id(6, 0)).unwrap().record;
    assert_eq!((r.phase, r.exit_code), (RankState::Exited, Some(127)));
    assert!(r.message.contains("workdir"), "{}", r.message);
}

/// The shim (root on a root agent) runs with a fixed environment: nothing of the overlay, nor of
/// the agent's own, reaches it; the rank gets both. Its run files are private.
#[tokio::test]
async fn the_shim_gets_a_clean_environment_and_run_files_are_private() {
    use std::os::unix::fs::PermissionsExt as _;
    let mut h = Harness::new();
    let overlay =
        [("LD_PRELOAD", "/nonexistent/trainyard-test.so"), ("GCONV_PATH", "/tmp/x"), ("FOO", "bar")];
    // A descriptor the agent holds without close-on-exec (as one a service manager passes, or
    // a device a C library opened).
    let inherited = h.dir.path().join("inherited");
    std::fs::write(&inherited, b"").unwrap();
    let path = std::ffi::CString::new(inherited.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; the descriptor is closed below.
    let leaked = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY) };
    assert!(leaked > 2);
    h.launcher.launch(&launch(11, 1, &h.workdir(), &["sleep", "30"], &overlay));
    h.wait_for(id(11, 0), "running", |p, pid| p == RankState::Running && pid.is_some()).await;
    // SAFETY: closes the descriptor duplicated above.
    unsafe { libc::close(leaked) };
    let r = h.launcher.get(id(11, 0)).unwrap().record.clone();
    let (shim_pid, rank_pid) = (r.shim_pid.unwrap() as i32, r.pid.unwrap() as i32);
    // SAFETY: getsid with pids of live processes of this test.
    let sessions = unsafe { (libc::getsid(shim_pid), libc::getsid(rank_pid)) };
    assert_eq!(sessions, (shim_pid, shim_pid), "the shim leads a session of its own, the rank is in it");
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{rank_pid}/fd"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        fds.iter().all(|fd| fd.parse::<i32>().unwrap() <= 2),
        "the rank has only stdin, stdout and stderr open: {fds:?}"
    );
    // Nor does the shim hold it open (it is marked close-on-exec before the shim's exec).
    let held = std::fs::read_dir(format!("/proc/{shim_pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .any(|target| target == inherited);
    assert!(!held, "the shim holds the descriptor its agent inherited");
    let shim = std::fs::read(format!("/proc/{}/environ", r.shim_pid.unwrap())).unwrap();
    let shim: Vec<&[u8]> = shim.split(|b| *b == 0).filter(|v| !v.is_empty()).collect();
    assert_eq!(
        shim.len(),
        1,
        "the shim has PATH only: {:?}",
        shim.iter().map(|v| String::from_utf8_lossy(v)).collect::<Vec<_>>()
    );
    assert!(shim[0].starts_with(b"PATH=/usr/local/sbin:"));
    let rank = String::from_utf8_lossy(&std::fs::read(format!("/proc/{}/environ", r.pid.unwrap())).unwrap())
        .into_owned();
    for expected in ["LD_PRELOAD=/nonexistent/trainyard-test.so", "GCONV_PATH=/tmp/x", "FOO=bar", "RANK=0"] {
        assert!(rank.split('\0').any(|v| v == expected), "{expected} missing from the rank's environment");
    }
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let layout = h.launcher.layout();
    assert_eq!(mode(&layout.state_dir()), 0o700);
    assert_eq!(mode(&layout.attempt_dir("job-11", 1)), 0o710);
    assert_eq!(mode(&layout.rank_dir("job-11", id(11, 0))), 0o710);
    assert_eq!(mode(&layout.launch_json("job-11", 1)), 0o600);
    assert_eq!(mode(&r.files.env()), 0o600);
    assert_eq!(mode(&r.files.stdout), 0o600);
    assert_eq!(mode(&layout.state_file(id(11, 0))), 0o600);
}

/// A torn state file stops the adoption with an error naming it instead of being skipped.
#[tokio::test]
async fn a_torn_state_file_is_an_error_naming_it() {
    let mut h = Harness::new();
    h.launcher.launch(&launch(12, 1, &h.workdir(), &["true"], &[]));
    h.wait_for(id(12, 0), "exited", |p, _| p == RankState::Exited).await;
    let path = h.launcher.layout().state_file(id(12, 0));
    let whole = std::fs::read(&path).unwrap();
    std::fs::write(&path, &whole[..whole.len() / 2]).unwrap();
    // A leftover temporary file of an interrupted write is not an error.
    std::fs::write(path.with_extension("json.tmp"), b"{").unwrap();
    let err = Harness::launcher_over(h.dir.path()).adopt().unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("unreadable"), "{err}");
}

#[tokio::test]
async fn restarted_launcher_adopts_ranks_and_sees_their_exit() {
    let mut h = Harness::new();
    h.launcher.launch(&launch(7, 1, &h.workdir(), &["sh", "-c", "sleep 0.5; exit 4"], &[]));
    h.wait_for(id(7, 0), "running", |p, _| p == RankState::Running).await;
    let mut adopted = Harness::launcher_over(h.dir.path());
    assert_eq!(adopted.adopt().unwrap(), 1);
    for _ in 0..100 {
        adopted.poll_exits();
        if adopted.get(id(7, 0)).unwrap().record.phase.is_done() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = &adopted.get(id(7, 0)).unwrap().record;
    assert_eq!((r.phase, r.exit_code), (RankState::Exited, Some(4)));
}

#[tokio::test]
async fn vanished_supervisor_makes_the_rank_lost_and_kills_its_group() {
    let mut h = Harness::new();
    h.launcher.launch(&launch(8, 1, &h.workdir(), &["sleep", "1000"], &[]));
    h.wait_for(id(8, 0), "running", |p, _| p == RankState::Running).await;
    let r = h.launcher.get(id(8, 0)).unwrap().record.clone();
    let (shim, pid) = (r.shim_pid.unwrap(), r.pid.unwrap());
    assert!(procfs::killpg(shim, libc::SIGKILL).unwrap());
    h.wait_for(id(8, 0), "lost", |p, _| p == RankState::Lost).await;
    assert_eq!(h.launcher.get(id(8, 0)).unwrap().record.message, "supervisor vanished");
    for _ in 0..40 {
        if !procfs::group_has_live_member(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("rank group {pid} survived its lost supervisor");
}

/// The checkpoint a restarted rank resumes from is chosen as the job's user sees the paths:
/// one in a directory only root may enter is passed over for an older one the user can reach
/// (the rank would otherwise learn that a root-only path exists). As the shim's own account,
/// the newest is chosen.
#[tokio::test]
async fn the_resume_point_is_chosen_as_the_jobs_user() {
    use std::os::unix::fs::PermissionsExt as _;
    if trainyard_agent::account::effective_uid() != 0 {
        assert!(std::env::var_os("CI").is_none(), "CI runs as root: this must run there");
        println!("skipped: running a rank as another user needs root");
        return;
    }
    let mut h = Harness::new();
    for p in [h.dir.path().to_path_buf(), h.workdir()] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let hidden = h.dir.path().join("root-only");
    std::fs::create_dir_all(hidden.join("step_30")).unwrap();
    std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).unwrap();
    let shared = h.dir.path().join("shared");
    std::fs::create_dir_all(shared.join("step_20")).unwrap();
    let point = |step: i64, path: PathBuf| trainyard_proto::v1::ResumePoint {
        step,
        path: path.display().to_string(),
    };
    for (job, run_as, want) in [(70, "nobody", "20"), (71, "", "30")] {
        let mut l = launch(
            job,
            1,
            &h.workdir(),
            &["sh", "-c", "echo \"$TRAINYARD_RESUME_STEP $TRAINYARD_RESUME_PATH\""],
            &[],
        );
        l.run_as = run_as.into();
        l.spec.as_mut().unwrap().restart =
            Some(trainyard_proto::v1::RestartPolicy { max_restarts: 3, resume: true, ..Default::default() });
        l.resume_from = vec![point(30, hidden.join("step_30")), point(20, shared.join("step_20"))];
        h.launcher.launch(&l);
        h.wait_for(id(job, 0), "exited", |p, _| p == RankState::Exited).await;
        let r = &h.launcher.get(id(job, 0)).unwrap().record;
        let out = std::fs::read_to_string(&r.files.stdout).unwrap();
        assert!(out.starts_with(&format!("{want} ")), "{run_as:?}: {out:?} ({})", r.message);
    }
}

/// A rank's output goes through its shim into a capped log: past the cap the oldest is
/// dropped, counted in `exit.json`, and said at the end of the log; and no launch starts while
/// the data directory is under its disk floor, saying why.
#[tokio::test]
async fn output_past_its_cap_is_dropped_and_counted_and_a_full_disk_refuses_launches() {
    let mut h = Harness::new();
    h.launcher = Harness::launcher_over(h.dir.path()).with_limits(1 << 20, NO_FLOOR);
    let script = "head -c 5000000 /dev/zero | tr '\\0' x; echo; echo last-line";
    h.launcher.launch(&launch(60, 1, &h.workdir(), &["sh", "-c", script], &[]));
    h.wait_for(id(60, 0), "exited", |p, _| p == RankState::Exited).await;
    let r = &h.launcher.get(id(60, 0)).unwrap().record;
    assert_eq!(r.exit_code, Some(0), "{}", r.message);
    let dropped = r.output_dropped_bytes.expect("counted");
    let kept = std::fs::metadata(&r.files.stdout).unwrap().len()
        + std::fs::metadata(trainyard_agent::output::rotated(&r.files.stdout)).unwrap().len();
    assert!(kept <= (1 << 20) + 200, "{kept} bytes kept under a 1 MiB cap");
    assert!(dropped >= 5_000_000 - (1 << 20), "{dropped} dropped");
    let log = std::fs::read_to_string(&r.files.stdout).unwrap();
    assert!(
        log.contains("last-line") && log.contains(&format!("[trainyard: {dropped} bytes")),
        "{}",
        &log[log.len().saturating_sub(300)..]
    );

    h.launcher =
        Harness::launcher_over(h.dir.path()).with_limits(1 << 20, DiskFloor { bytes: u64::MAX, percent: 0 });
    h.launcher.launch(&launch(61, 1, &h.workdir(), &["true"], &[]));
    let r = &h.launcher.get(id(61, 0)).unwrap().record;
    assert_eq!(r.phase, RankState::Lost);
    assert!(r.message.contains("under its floor"), "{}", r.message);
}
