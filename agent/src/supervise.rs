//! The per-rank shim, run as
//! `trainyard-agent supervise --status-file F --pid-file P [--cpus LIST --mem-node N] -- ARGV`.
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

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use serde::{Deserialize, Serialize};

use crate::layout::write_atomic;
use crate::pinning::Binding;

/// Exit code written when the rank could not be started at all (as a shell would for a
/// command it cannot run).
pub const SPAWN_FAILED_EXIT_CODE: i32 = 127;

/// What the shim invocation names.
#[derive(Debug, Clone)]
pub struct SuperviseArgs {
    pub status_file: PathBuf,
    pub pid_file: PathBuf,
    /// CPUs and memory node to bind the rank to; `None`: unpinned.
    pub binding: Option<Binding>,
    /// The user the rank runs as; `None`: the shim's own.
    pub user: Option<SwitchUser>,
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
}

impl ExitFile {
    fn from_status(status: ExitStatus) -> Self {
        Self { exit_code: status.code(), signal: status.signal(), error: None }
    }

    /// Reads an `exit.json`.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        Ok(serde_json::from_slice(&std::fs::read(path)?)?)
    }

    fn write(&self, path: &Path) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        write_atomic(path, &bytes)
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
    let outcome = match run_rank(args) {
        Ok(status) => ExitFile::from_status(status),
        Err(e) => {
            eprintln!("trainyard-agent supervise: {e}");
            ExitFile { exit_code: Some(SPAWN_FAILED_EXIT_CODE), signal: None, error: Some(e) }
        }
    };
    match outcome.write(&args.status_file) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("trainyard-agent supervise: failed to write {}: {e}", args.status_file.display());
            1
        }
    }
}

fn run_rank(args: &SuperviseArgs) -> Result<ExitStatus, String> {
    let (program, rest) = args.argv.split_first().ok_or("spawn failed: empty argv")?;
    let mut command = Command::new(program);
    command.args(rest);
    let binding = args.binding.as_ref().map(Binding::prepare);
    let user = args.user.clone();
    // SAFETY: setpgid, sched_setaffinity, set_mempolicy, setgroups, setgid, setuid and write are
    // async-signal-safe, and the binding and group list were prepared before the fork: nothing
    // here allocates.
    unsafe {
        command.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
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
            Ok(())
        });
    }
    // std reports exec failures through a pipe, so spawn returns only once the rank runs.
    let mut child = command.spawn().map_err(|e| format!("spawn failed: {program}: {e}"))?;
    if let Err(e) = write_atomic(&args.pid_file, child.id().to_string().as_bytes()) {
        eprintln!("trainyard-agent supervise: failed to write {}: {e}", args.pid_file.display());
    }
    // std's wait retries on EINTR, so a caught SIGTERM does not end the wait.
    child.wait().map_err(|e| format!("wait for rank failed: {e}"))
}

/// Reads the pid file the shim writes; `None` until it is there.
pub fn read_pid_file(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}
