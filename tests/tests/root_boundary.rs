//! Nothing a user sends reaches a root process, and nothing of a job is readable by another
//! local user. Tried as an attacker would: a library named in the job's own `[env]`
//! (`LD_PRELOAD`) that records the uid of every process loading it, and a second account on the
//! node reading the job's files. These need root (to switch users); elsewhere they say skipped.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use trainyard_tests::{Cluster, root_or_skip};

/// The preload library of `tests/fixtures/preload`, built for this test, with its log; both in a
/// directory every account can read (the rank runs as `nobody`).
struct Preload {
    _dir: tempfile::TempDir,
    lib: PathBuf,
    log: PathBuf,
}

/// One line of the preload log: who loaded the library.
#[derive(Debug)]
struct Loaded {
    pid: u32,
    uid: u32,
    euid: u32,
    exe: String,
}

impl Preload {
    /// `None` (and a printed reason) when there is no C compiler to build it.
    fn build() -> Result<Option<Preload>> {
        let dir = tempfile::Builder::new().prefix("trainyard-preload-").tempdir_in("/tmp")?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let (lib, log) = (dir.path().join("record_loader.so"), dir.path().join("loaded.log"));
        std::fs::write(&log, b"")?;
        std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o666))?;
        let src = trainyard_tests::repo_root().join("tests/fixtures/preload/record_loader.c");
        let built = Command::new("gcc")
            .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror"])
            .arg(format!("-DLOG_PATH=\"{}\"", log.display()))
            .arg("-o")
            .arg(&lib)
            .arg(&src)
            .output();
        match built {
            Ok(out) if out.status.success() => Ok(Some(Preload { _dir: dir, lib, log })),
            Ok(out) => bail!("gcc failed: {}", String::from_utf8_lossy(&out.stderr)),
            Err(e) => {
                println!("skipped: no C compiler to build the preload library ({e})");
                Ok(None)
            }
        }
    }

    fn loaded(&self) -> Result<Vec<Loaded>> {
        let text = std::fs::read_to_string(&self.log)?;
        text.lines()
            .map(|line| {
                let mut f = line.splitn(4, ' ');
                let mut num = || -> Result<u32> { Ok(f.next().context("field")?.parse()?) };
                let (pid, uid, euid) = (num()?, num()?, num()?);
                Ok(Loaded { pid, uid, euid, exe: f.next().unwrap_or_default().to_string() })
            })
            .collect()
    }
}

fn job_with_preload(c: &Cluster, name: &str, gpus: u32, argv: &str, lib: &Path) -> PathBuf {
    let text = format!(
        "name = {name:?}\n[resources]\ngpus = {gpus}\ngpus_per_node = {gpus}\n\n\
         [engine]\nkind = \"exec\"\nargv = {argv}\nworkdir = \"/\"\n\n\
         [env]\nLD_PRELOAD = {:?}\nPYTHONSTARTUP = \"/tmp/never-read\"\nGCONV_PATH = \"/tmp\"\n",
        lib.display()
    );
    let path = c.path(&format!("{name}.toml"));
    std::fs::write(&path, text).expect("write job file");
    path
}

fn uid_of(name: &str) -> Result<(u32, u32)> {
    let id = |flag: &str| -> Result<u32> {
        let out = Command::new("id").args([flag, name]).output()?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

#[test]
fn a_library_named_in_the_overlay_never_loads_in_a_root_process() -> Result<()> {
    if !root_or_skip("run-as needs the agent to run as root; these tests do not") {
        return Ok(());
    }
    let Some(preload) = Preload::build()? else { return Ok(()) };
    let mut c = Cluster::start_secure()?;
    c.start_agent("sxm-a", 2)?;
    let (nobody, _) = uid_of("nobody")?;
    let mallory = c.add_user("mallory", &["--unix-user", "nobody"])?;
    let file = job_with_preload(&c, "preload", 2, r#"["sh", "-c", "sleep 1"]"#, &preload.lib);
    let job = c.submit_as(&mallory, &file)?;
    c.wait_state(job, &["succeeded"], Duration::from_secs(30))?;

    let loaded = preload.loaded()?;
    // Positive control: the ranks (sh, then sleep) did load it, as the user.
    assert!(loaded.iter().any(|l| l.uid == nobody && l.exe.ends_with("/sleep")), "{loaded:?}");
    for l in &loaded {
        assert!(l.uid != 0 && l.euid != 0, "a root process loaded the user's library: {l:?}");
        assert!(!l.exe.contains("trainyard"), "a trainyard process loaded it: {l:?}");
    }
    Ok(())
}

/// A workdir only root may enter is checked, and entered, as the job's user: the rank is not
/// started there, and the reason says why. (Checked as root, as before, it ran there.)
#[test]
fn a_root_only_workdir_is_refused_as_the_user() -> Result<()> {
    if !root_or_skip("run-as needs the agent to run as root; these tests do not") {
        return Ok(());
    }
    let mut c = Cluster::start_secure()?;
    c.start_agent("sxm-a", 1)?;
    let hidden = c.path("root-only");
    std::fs::create_dir_all(&hidden)?;
    std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700))?;
    let mallory = c.add_user("mallory", &["--unix-user", "nobody"])?;
    let text = format!(
        "name = \"probe\"\n[resources]\ngpus = 1\n\n[engine]\nkind = \"exec\"\nargv = [\"true\"]\nworkdir = {:?}\n",
        hidden.display().to_string()
    );
    std::fs::write(c.path("probe.toml"), text)?;
    let job = c.submit_as(&mallory, &c.path("probe.toml"))?;
    let failed = c.wait_state(job, &["failed", "succeeded"], Duration::from_secs(30))?;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert!(failed.to_string().contains("Permission denied"), "{failed}");
    Ok(())
}

#[test]
fn on_the_root_demo_the_overlay_reaches_the_rank_only() -> Result<()> {
    if !root_or_skip("the root demo (--allow-root-ranks) needs the tests to run as root") {
        return Ok(());
    }
    let Some(preload) = Preload::build()? else { return Ok(()) };
    let mut c = Cluster::start()?;
    c.start_agent("sxm-a", 2)?;
    let file = job_with_preload(&c, "preload-demo", 2, r#"["sleep", "2"]"#, &preload.lib);
    let job = c.submit(&file)?;
    let running = c.wait_state(job, &["running"], Duration::from_secs(20))?;
    let pids: Vec<u32> = running["ranks"]
        .as_array()
        .context("ranks")?
        .iter()
        .filter_map(|r| r["pid"].as_u64().map(|p| p as u32))
        .collect();
    c.wait_state(job, &["succeeded"], Duration::from_secs(30))?;
    let loaded = preload.loaded()?;
    // The operator chose root ranks, so the ranks are root; but only they load it: one line
    // per rank, from the rank's own pid, never from the shim or the agent.
    assert_eq!(loaded.len(), 2, "{loaded:?}");
    for l in &loaded {
        assert!(pids.contains(&l.pid), "loaded by {l:?}, not one of the ranks {pids:?}");
        assert!(l.exe.ends_with("/sleep"), "{l:?}");
    }
    Ok(())
}

/// Runs `cat`/`ls` as account `(uid, gid)` (no supplementary groups); true when it succeeded.
fn can_read_as(uid: u32, gid: u32, program: &str, path: &Path) -> bool {
    Command::new(program)
        .arg(path)
        .uid(uid)
        .gid(gid)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn another_local_user_reads_nothing_of_a_job() -> Result<()> {
    if !root_or_skip("two accounts on one node need the tests to run as root") {
        return Ok(());
    }
    let mut c = Cluster::start_secure()?;
    c.start_agent("sxm-a", 1)?;
    let (nobody, nogroup) = uid_of("nobody")?;
    let (other, other_gid) = uid_of("daemon")?;
    assert_ne!(other_gid, nogroup, "the second account must not share the job user's group");
    let (peer, peer_gid) = uid_of("sync")?;
    assert_eq!(peer_gid, nogroup, "the third account shares the job user's primary group");
    let alice = c.add_user("alice", &["--unix-user", "nobody"])?;
    let text = "name = \"secret\"\n[resources]\ngpus = 1\n\n[engine]\nkind = \"exec\"\n\
                argv = [\"sh\", \"-c\", \"echo '{\\\"kind\\\":\\\"step\\\",\\\"step\\\":1}' >> $TRAINYARD_RECEIPTS; echo hi; sleep 30\"]\n\
                workdir = \"/\"\n\n[env]\nAPI_KEY = \"s3cret\"\n";
    std::fs::write(c.path("secret.toml"), text)?;
    let job = c.submit_as(&alice, &c.path("secret.toml"))?;
    let status = c.wait_state(job, &["running"], Duration::from_secs(20))?;
    let attempt = status["attempt"].as_u64().context("attempt")?;
    let job_dir = c.run_dir("sxm-a", job).context("the job's run directory")?;
    let attempt_dir = job_dir.join(format!("attempt-{attempt}"));
    let rank_dir = attempt_dir.join("rank-0");
    let files = ["receipts.jsonl", "stdout.log", "stderr.log"].map(|f| rank_dir.join(f));
    let launch = attempt_dir.join("launch.json");
    std::thread::sleep(Duration::from_millis(500));

    // `sync` shares `nobody`'s primary group (nogroup), as accounts in `users` do on many
    // clusters: it may pass through the directories but neither lists them nor reads a file.
    for dir in [&job_dir, &attempt_dir, &rank_dir] {
        let m = std::fs::metadata(dir)?;
        assert_eq!((m.mode() & 0o7777, m.gid()), (0o710, nogroup), "{}", dir.display());
        assert!(!can_read_as(other, other_gid, "ls", dir), "daemon listed {}", dir.display());
        assert!(!can_read_as(peer, nogroup, "ls", dir), "sync (same group) listed {}", dir.display());
    }
    for f in &files {
        let m = std::fs::metadata(f)?;
        assert_eq!((m.mode() & 0o7777, m.uid()), (0o600, nobody), "{}", f.display());
        assert!(can_read_as(nobody, nogroup, "cat", f), "the job's user reads {}", f.display());
        assert!(!can_read_as(other, other_gid, "cat", f), "daemon read {}", f.display());
        assert!(!can_read_as(peer, nogroup, "cat", f), "sync (same group) read {}", f.display());
    }
    let m = std::fs::metadata(&launch)?;
    assert_eq!((m.mode() & 0o7777, m.uid()), (0o600, nobody), "launch.json holds the overlay");
    assert!(std::fs::read_to_string(&launch)?.contains("s3cret"));
    assert!(can_read_as(nobody, nogroup, "cat", &launch));
    assert!(!can_read_as(other, other_gid, "cat", &launch));
    assert!(!can_read_as(peer, nogroup, "cat", &launch), "sync (same group) read launch.json");
    let env = rank_dir.join("env.json");
    assert_eq!(std::fs::metadata(&env)?.mode() & 0o7777, 0o600);
    assert!(!can_read_as(nobody, nogroup, "cat", &env), "the rank's environment file is root's");
    let state = c.path("agent-sxm-a/state");
    assert_eq!(std::fs::metadata(&state)?.mode() & 0o7777, 0o700);
    c.ctl_ok(&["cancel", &job.to_string()])?;
    Ok(())
}
