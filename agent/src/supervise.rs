//! The per-rank shim, run as `trainyard-agent supervise --status-file F --pid-file P
//! --env-file E --workdir W [--cpus LIST --mem-node N] [--uid U --gid G --groups L] -- ARGV`.
//!
//! It exists so that a rank's exit status is known even when the agent that started it was
//! killed or restarted meanwhile: the agent starts the shim in a session of its own, the shim
//! starts the rank in a new process group (pgid == rank pid, which is what cancel signals),
//! writes the rank's pid, waits, and writes `exit.json` atomically before it exits.
//!
//! The shim catches SIGTERM, SIGINT and SIGHUP with a handler that does nothing, so signals
//! meant for the agent or a closing terminal do not take it down. A handler rather than
//! `SIG_IGN`, because an ignored disposition survives `exec` and the rank would inherit it,
//! while a caught one is reset to the default in the rank.
//!
//! With `--cpus`/`--mem-node` the rank is bound between fork and exec ([`crate::pinning`]);
//! the shim itself stays unbound. With `--uid`/`--gid`/`--groups` (an agent running as root)
//! the rank drops to its job's user there too, after the binding: `setgroups`, `setgid`, then
//! `setuid`, so it can never regain root. The shim stays root to write `exit.json`.
//!
//! Nothing the job's user controls reaches the root part. The agent starts the shim with a
//! clean, fixed environment (`PATH` only), so the dynamic loader of this root process never sees
//! the overlay's `LD_PRELOAD`, `GCONV_PATH`, `MALLOC_*` and friends. The rank's environment
//! travels in a root-only file (`--env-file`, JSON) that the shim reads as data and hands to the
//! rank's `execve` only, after the drop. The checks that touch user-named paths (the workdir is a
//! directory, `argv[0]` is an executable on the rank's `PATH`) run with the effective ids of the
//! rank's user, so a job cannot probe root-only paths; the rank's `chdir` to its workdir happens
//! after `setuid`, and `argv[0]` is looked up by `execvp` in the rank, with the rank's `PATH`.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use serde::{Deserialize, Serialize};

use crate::cgroup::{Joiner, RankGroup, Usage};
use crate::layout::{write_atomic, write_replace};
use crate::pinning::Binding;

/// How long the shim waits for the rank's leftover processes to die after SIGKILL.
const LEFTOVER_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Exit code written when the rank could not be started at all (as a shell would for a
/// command it cannot run).
pub const SPAWN_FAILED_EXIT_CODE: i32 = 127;

/// The only variable of the shim's own environment: where a root process finds programs. The
/// shim runs none itself; it is there so that nothing in the shim falls back to a user's.
pub const SHIM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Largest rank environment file the shim reads: the spec's overlay is bounded at submit
/// (`trainyard_proto::limits::MAX_ENV_BYTES`), the agent's own environment and trainyard's
/// variables come on top.
pub const MAX_ENV_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// What the shim invocation names.
#[derive(Debug, Clone)]
pub struct SuperviseArgs {
    pub status_file: PathBuf,
    pub pid_file: PathBuf,
    /// The rank's whole environment (a JSON object of strings), written by the agent.
    pub env_file: PathBuf,
    /// The rank's working directory, entered after the drop to the rank's user.
    pub workdir: PathBuf,
    /// CPUs and memory node to bind the rank to; `None`: unpinned.
    pub binding: Option<Binding>,
    /// The user the rank runs as; `None`: the shim's own.
    pub user: Option<SwitchUser>,
    /// The rank's cgroups, joined between fork and exec and emptied when the rank ends.
    pub group: RankGroup,
    /// No cgroups: the shim is a child subreaper and kills the rank's orphans when it ends.
    pub subreaper: bool,
    /// The rank's stdout and stderr log files, which the shim's own stdout and stderr are: the
    /// rank writes into pipes the shim copies there, capped ([`crate::output`]). `None`: the
    /// rank writes into the files itself (an older agent's launch).
    pub logs: Option<[crate::output::Log; 2]>,
    pub argv: Vec<String>,
}

/// The ids the rank switches to before exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchUser {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// The content of `exit.json`. `error` is only there when the rank could not be started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitFile {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// CPU time and peak memory of every process of the rank (from its cgroups).
    #[serde(default, flatten)]
    pub usage: Usage,
    /// Processes of the rank still alive when it ended, killed by the shim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leftover_killed: Option<usize>,
    /// Bytes of the rank's stdout and stderr dropped: past the cap, or the disk was full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_dropped_bytes: Option<u64>,
}

impl ExitFile {
    fn from_status(status: ExitStatus) -> Self {
        Self {
            exit_code: status.code(),
            signal: status.signal(),
            error: None,
            usage: Usage::default(),
            leftover_killed: None,
            output_dropped_bytes: None,
        }
    }

    /// Reads an `exit.json`.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        Ok(serde_json::from_slice(&std::fs::read(path)?)?)
    }

    /// Writes `exit.json` into the space the agent set aside for it (`exit.slot`, allocated at
    /// launch), so a disk a job filled cannot keep a rank's exit status from being known; where
    /// there is no slot, as a fresh file.
    fn write(&self, path: &Path) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        let slot = crate::layout::exit_slot_beside(path);
        match crate::layout::fill_slot(&slot, path, &bytes) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => write_atomic(path, &bytes),
            other => other,
        }
    }
}

extern "C" fn ignore_signal(_: libc::c_int) {}

fn survive_termination_signals() -> std::io::Result<()> {
    for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe (does nothing).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Runs the shim to the end; returns the shim's own exit code (0 once `exit.json` is written).
/// Problems go to stderr, which the agent pointed at the rank's `stderr.log`.
pub fn supervise(args: &SuperviseArgs) -> i32 {
    if let Err(e) = survive_termination_signals() {
        eprintln!("trainyard-agent supervise: failed to install signal handlers: {e}");
    }
    if args.subreaper
        && let Err(e) = crate::cgroup::become_subreaper()
    {
        eprintln!("trainyard-agent supervise: cannot become a child subreaper: {e}");
    }
    let mut copiers = Copiers::default();
    let mut outcome = match run_rank(args, &mut copiers) {
        Ok(status) => ExitFile::from_status(status),
        Err(e) => {
            eprintln!("trainyard-agent supervise: {e}");
            ExitFile {
                exit_code: Some(SPAWN_FAILED_EXIT_CODE),
                signal: None,
                error: Some(e),
                usage: Usage::default(),
                leftover_killed: None,
                output_dropped_bytes: None,
            }
        }
    };
    // The rank ended: what it left behind (a `setsid` child, a daemonized loader) goes with it.
    let left = if args.group.is_empty() {
        args.subreaper.then(|| crate::cgroup::reap_orphans(LEFTOVER_WAIT))
    } else {
        match args.group.kill_and_wait(LEFTOVER_WAIT) {
            Ok(n) => Some(n),
            Err(e) => {
                eprintln!("trainyard-agent supervise: cannot empty the rank's cgroups: {e}");
                None
            }
        }
    };
    outcome.leftover_killed = left.filter(|n| *n > 0);
    // With every process of the rank gone, its pipes end: the logs are whole.
    crate::output::join(copiers.handles, LEFTOVER_WAIT);
    let dropped: u64 = copiers.dropped.iter().map(crate::output::Dropped::get).sum();
    outcome.output_dropped_bytes = (dropped > 0).then_some(dropped);
    if !args.group.is_empty() {
        outcome.usage = args.group.usage();
        if let Err(e) = args.group.remove() {
            eprintln!("trainyard-agent supervise: cannot remove the rank's cgroups: {e}");
        }
    }
    match outcome.write(&args.status_file) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("trainyard-agent supervise: failed to write {}: {e}", args.status_file.display());
            1
        }
    }
}

/// The threads copying the rank's output into its logs, and what each dropped.
#[derive(Default)]
struct Copiers {
    handles: Vec<std::thread::JoinHandle<()>>,
    dropped: Vec<crate::output::Dropped>,
}

fn run_rank(args: &SuperviseArgs, copiers: &mut Copiers) -> Result<ExitStatus, String> {
    let (program, rest) = args.argv.split_first().ok_or("spawn failed: empty argv")?;
    let mut env = read_env_file(&args.env_file)?;
    // Paths a user named are looked at as that user: a root-only directory stays unseen.
    as_user(args.user.as_ref(), || pick_resume_point(&mut env))?;
    let path_var = env.get("PATH").map_or(DEFAULT_EXECVP_PATH, String::as_str);
    as_user(args.user.as_ref(), || check_launch(program, &args.workdir, path_var))??;
    let workdir = CString::new(args.workdir.as_os_str().as_bytes())
        .map_err(|_| format!("spawn failed: workdir {} contains a NUL byte", args.workdir.display()))?;
    let mut command = Command::new(program);
    command.args(rest).env_clear().envs(&env);
    let binding = args.binding.as_ref().map(Binding::prepare);
    let user = args.user.clone();
    let joiner = Joiner::new(&args.group).map_err(|e| format!("spawn failed: the rank's cgroups: {e}"))?;
    // SAFETY: setpgid, open, write, close, fcntl, sched_setaffinity, set_mempolicy, setgroups,
    // setgid, setuid and chdir are async-signal-safe, and the binding, cgroup paths, group list
    // and workdir were prepared before the fork: nothing here allocates.
    unsafe {
        command.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Into the rank's cgroups while still root: everything it starts stays there.
            joiner.join_in_child()?;
            // Nothing the agent or the shim inherited reaches the rank.
            crate::procfs::cloexec_from(3);
            if let Some(b) = &binding {
                b.apply_in_child();
            }
            if let Some(u) = &user {
                let groups = u.groups.as_slice();
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(u.gid) != 0
                    || libc::setuid(u.uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // After the drop: a workdir the user may not enter fails here, as the user.
            if libc::chdir(workdir.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // std reports exec failures through a pipe, so spawn returns only once the rank runs.
    if args.logs.is_some() {
        command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    }
    let mut child = command.spawn().map_err(|e| format!("spawn failed: {program}: {e}"))?;
    // The rank runs: the agent learns it from this file, before the log copiers start (the
    // pipes hold what the rank writes meanwhile). Whole but not synced: a pid means nothing
    // after a power cut, which ends the rank too; synced, each rank's start waited for the
    // disk, behind every other rank's write.
    if let Err(e) = write_replace(&args.pid_file, child.id().to_string().as_bytes()) {
        eprintln!("trainyard-agent supervise: failed to write {}: {e}", args.pid_file.display());
    }
    if let Some([out, err]) = &args.logs {
        use std::os::fd::AsFd as _;
        let own = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().map(std::fs::File::from);
        if let (Some(from), Ok(file)) = (child.stdout.take(), own(std::io::stdout().as_fd())) {
            let (h, d) = crate::output::copy(from, file, out.clone());
            copiers.handles.push(h);
            copiers.dropped.push(d);
        }
        if let (Some(from), Ok(file)) = (child.stderr.take(), own(std::io::stderr().as_fd())) {
            let (h, d) = crate::output::copy(from, file, err.clone());
            copiers.handles.push(h);
            copiers.dropped.push(d);
        }
    }
    // std's wait retries on EINTR, so a caught SIGTERM does not end the wait.
    child.wait().map_err(|e| format!("wait for rank failed: {e}"))
}

/// Gives the rank the newest resume point whose path exists (`TRAINYARD_RESUME_STEP`, `_PATH`)
/// from the candidates the agent passed (`TRAINYARD_RESUME_CANDIDATES`, removed here) and the
/// complete checkpoints newer than those found beside them ([`crate::resume`]). Run with
/// the rank user's effective ids, so a path the user could not see is not chosen (and the
/// user learns nothing of root-only directories).
pub fn pick_resume_point(env: &mut BTreeMap<String, String>) {
    let Some(text) = env.remove(crate::env::RESUME_CANDIDATES) else { return };
    let reported: Vec<(i64, String)> = serde_json::from_str(&text).unwrap_or_default();
    let candidates = crate::resume::candidates(&reported);
    if let Some((step, path)) = candidates.into_iter().find(|(_, p)| Path::new(p).exists()) {
        env.insert("TRAINYARD_RESUME_STEP".into(), step.to_string());
        env.insert("TRAINYARD_RESUME_PATH".into(), path);
    }
}

/// glibc's `execvp` search path when the environment has no `PATH`.
const DEFAULT_EXECVP_PATH: &str = "/bin:/usr/bin";

/// Reads the rank's environment file: a JSON object of string values, at most
/// [`MAX_ENV_FILE_BYTES`].
pub fn read_env_file(path: &Path) -> Result<BTreeMap<String, String>, String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)
        .map_err(|e| format!("spawn failed: cannot open the rank's environment {}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_ENV_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("spawn failed: cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_ENV_FILE_BYTES {
        return Err(format!(
            "spawn failed: the rank's environment {} is over {MAX_ENV_FILE_BYTES} bytes",
            path.display()
        ));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| format!("spawn failed: the rank's environment {} is not valid: {e}", path.display()))
}

/// Runs `f` with the effective user, group and supplementary groups of `user` (the shim is
/// root and keeps root as its real and saved ids, so it can come back), then returns to root.
/// Without a user, `f` runs as the shim is. A failure to switch back is an error: the shim
/// then starts nothing.
fn as_user<T>(user: Option<&SwitchUser>, f: impl FnOnce() -> T) -> Result<T, String> {
    let Some(u) = user else { return Ok(f()) };
    let os = |what: &str| format!("spawn failed: {what}: {}", std::io::Error::last_os_error());
    // SAFETY: plain credential syscalls on this single-threaded process; the group list
    // pointers are valid for the lengths passed.
    unsafe {
        let mut saved = vec![0 as libc::gid_t; 65_536];
        let n = libc::getgroups(saved.len() as libc::c_int, saved.as_mut_ptr());
        if n < 0 {
            return Err(os("getgroups"));
        }
        saved.truncate(n as usize);
        let saved_egid = libc::getegid();
        if libc::setgroups(u.groups.len(), u.groups.as_ptr()) != 0 {
            return Err(os("setgroups to the rank's user"));
        }
        if libc::setegid(u.gid) != 0 || libc::seteuid(u.uid) != 0 {
            let e = os("setegid/seteuid to the rank's user");
            let _ = libc::seteuid(0);
            let _ = libc::setegid(saved_egid);
            let _ = libc::setgroups(saved.len(), saved.as_ptr());
            return Err(e);
        }
        let out = f();
        if libc::seteuid(0) != 0
            || libc::setegid(saved_egid) != 0
            || libc::setgroups(saved.len(), saved.as_ptr()) != 0
        {
            return Err(os("back to root after checking the launch as the rank's user"));
        }
        // The kernel made the shim undumpable when its effective uid changed; back to root,
        // it is an ordinary root process again, so an agent without CAP_SYS_PTRACE can still
        // read its /proc/<pid>/exe to know it as its own.
        libc::prctl(libc::PR_SET_DUMPABLE, 1);
        Ok(out)
    }
}

/// Fails with a clear message when the rank cannot be started: `workdir` is not a directory it
/// may enter, or `program` (relative to `workdir` when it has a `/`, else looked up on
/// `path_var`) is not an executable file. Run with the rank user's effective ids.
pub fn check_launch(program: &str, workdir: &Path, path_var: &str) -> Result<(), String> {
    match std::fs::metadata(workdir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("spawn failed: workdir {} is not a directory", workdir.display())),
        Err(e) => return Err(format!("spawn failed: workdir {}: {e}", workdir.display())),
    }
    let executable =
        |p: &Path| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') {
        if executable(&workdir.join(program)) {
            return Ok(());
        }
        return Err(format!("spawn failed: {program}: not an executable file"));
    }
    if std::env::split_paths(path_var).any(|dir| executable(&workdir.join(dir).join(program))) {
        return Ok(());
    }
    Err(format!("spawn failed: {program}: not found on PATH"))
}

/// Reads the pid file the shim writes; `None` until it is there.
pub fn read_pid_file(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The environment file's limit: a file of exactly [`MAX_ENV_FILE_BYTES`] is read; one
    /// byte more is refused, naming the file and the limit.
    #[test]
    fn the_env_file_is_read_at_its_limit_and_refused_one_past() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("env.json");
        let file_of = |bytes: u64| {
            let pad = bytes as usize - r#"{"A":""}"#.len();
            std::fs::write(&path, format!(r#"{{"A":"{}"}}"#, "x".repeat(pad))).unwrap();
        };
        file_of(MAX_ENV_FILE_BYTES);
        let env = read_env_file(&path).expect("a file at the limit is read");
        assert_eq!(env["A"].len() as u64, MAX_ENV_FILE_BYTES - 8);
        file_of(MAX_ENV_FILE_BYTES + 1);
        let refused = read_env_file(&path).expect_err("one byte past the limit is refused");
        assert!(refused.contains("over 4194304 bytes") && refused.contains("env.json"), "{refused}");
    }
}
