//! Real cgroups on this machine: membership and kill on the cgroup2 mount, limits and the
//! freezer on the v1 hierarchies (this project's machines mount both: systemd's hybrid layout).
//! They need root; elsewhere they say skipped, and in CI (root there) a missing mount fails.

use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command};
use std::time::Duration;

use super::*;

/// The host's mounts when the test can use them; `None` (and why, printed) when not root.
fn mounts_or_skip(what: &str) -> Option<Mounts> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        assert!(std::env::var_os("CI").is_none(), "{what} must run in CI, which runs as root");
        println!("skipped: {what} needs root to create cgroups");
        return None;
    }
    Some(Mounts::read())
}

/// A unique attempt name for one test's groups.
fn attempt(test: &str) -> String {
    format!("test-{test}-{}.a0", std::process::id())
}

/// Starts `sh -c script` inside `group` (joined between fork and exec, as the shim does).
fn spawn_in(group: &RankGroup, script: &str) -> Child {
    let joiner = Joiner::new(group).unwrap();
    let mut command = Command::new("sh");
    command.args(["-c", script]);
    // SAFETY: the joiner only opens, writes and closes prepared paths.
    unsafe {
        command.pre_exec(move || joiner.join_in_child());
    }
    command.spawn().unwrap()
}

fn alive(pid: u32) -> bool {
    crate::procfs::stat(pid).is_some_and(|s| s.state != 'Z')
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{what} never happened");
}

#[test]
fn a_detached_child_lives_in_the_ranks_cgroup2_and_dies_with_it() {
    let Some(mounts) = mounts_or_skip("cgroup2 membership and kill") else { return };
    let v2 = mounts.v2.clone().expect("a cgroup2 mount");
    let tracking = Tracking::Cgroups { v2: Some(v2.join(ROOT_NAME)), v1: vec![] };
    std::fs::create_dir_all(v2.join(ROOT_NAME)).unwrap();
    let group = tracking.create(&attempt("v2"), 0, &Limits::default()).unwrap();
    let dir = std::env::temp_dir().join(format!("cgroup-v2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pidfile = dir.join("detached.pid");
    // The rank starts a child in a session of its own (out of its process group), then idles.
    let mut rank =
        spawn_in(&group, &format!("setsid sleep 300 & echo $! > {}; exec sleep 300", pidfile.display()));
    wait_until("the detached child's pid file", || {
        std::fs::read_to_string(&pidfile).is_ok_and(|t| !t.is_empty())
    });
    let detached: u32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    let pids = group.pids();
    assert!(pids.contains(&rank.id()) && pids.contains(&detached), "{pids:?}");
    assert!(group.populated());

    assert_eq!(group.kill_and_wait(Duration::from_secs(5)).unwrap(), 2);
    let _ = rank.wait();
    assert!(!alive(detached), "the setsid child outlived its rank's cgroup");
    assert!(!group.populated());
    assert!(group.usage().cpu_ms.is_some(), "cpu.stat counts every cgroup2 group");
    group.remove().unwrap();
    assert!(!group.v2.as_ref().unwrap().exists());
    assert!(
        !group.v2.as_ref().unwrap().parent().unwrap().exists(),
        "the attempt's group goes with its last rank"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn job_limits_hold_on_cgroup_v1_and_the_freezer_kills_without_a_race() {
    let Some(mounts) = mounts_or_skip("cgroup v1 limits") else { return };
    let v1: Vec<(String, PathBuf)> = ["memory", "pids", "freezer", "cpuacct"]
        .iter()
        .map(|c| {
            (c.to_string(), mounts.v1(c).unwrap_or_else(|| panic!("a v1 {c} hierarchy")).join(ROOT_NAME))
        })
        .collect();
    for (_, root) in &v1 {
        std::fs::create_dir_all(root).unwrap();
    }
    let tracking = Tracking::Cgroups { v2: None, v1: v1.clone() };
    let limits = Limits { memory_bytes: Some(256 << 20), processes: Some(16) };
    let name = attempt("v1");
    let group = tracking.create(&name, 3, &limits).unwrap();
    let read = |controller: &str, file: &str| {
        let (_, root) = v1.iter().find(|(c, _)| c == controller).unwrap();
        std::fs::read_to_string(root.join(&name).join(file)).unwrap().trim().to_string()
    };
    assert_eq!(read("memory", "memory.limit_in_bytes"), (256u64 << 20).to_string());
    assert_eq!(read("pids", "pids.max"), "16");

    // Past the process limit, fork fails inside the job; the count never goes over it.
    let mut rank = spawn_in(&group, "for i in $(seq 40); do sleep 300 & done; exec sleep 300");
    std::thread::sleep(Duration::from_millis(500));
    let n = group.pids().len();
    assert!((2..=16).contains(&n), "{n} processes under a limit of 16");
    assert!(read("pids", "pids.events").contains("max "), "the limit was hit");
    // One past the limit: the job's group refuses the next process outright.
    assert_eq!(group.kill_and_wait(Duration::from_secs(5)).unwrap(), n);
    let _ = rank.wait();
    let usage = group.usage();
    assert!(usage.cpu_ms.is_some() && usage.peak_memory_bytes.is_some_and(|b| b > 0), "{usage:?}");
    group.remove().unwrap();
}

#[test]
fn a_limit_the_host_cannot_apply_refuses_the_launch() {
    // No cgroups at all (an unprivileged agent): no limit can hold, so the launch says so.
    let none = Tracking::Subreaper("test".into());
    assert_eq!(none.create("x.a0", 0, &Limits::default()).unwrap(), RankGroup::default());
    let err = none.create("x.a0", 0, &Limits { memory_bytes: Some(1 << 30), processes: None }).unwrap_err();
    assert!(err.to_string().contains("cannot create cgroups"), "{err}");
    assert!(none.describe().contains("subreaper"));
}
