//! Process facts from `/proc` and the signals the launcher sends, in one place so the `unsafe`
//! calls into libc stay few and small.

use std::io;
use std::path::{Path, PathBuf};

/// A process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: `R`, `S`, `Z` (zombie), ...
    pub state: char,
    /// Field 4: the parent's pid.
    pub ppid: u32,
    /// Field 5.
    pub pgrp: i32,
    /// Field 22: start time in clock ticks after boot. With the pid it identifies a process
    /// across pid reuse, which is how a restarted agent recognises its own shims.
    pub start_time: u64,
}

/// Reads `/proc/<pid>/stat`; `None` when there is no such process.
pub fn stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// Parses the text of a stat file. The command name (field 2) may hold spaces and parentheses,
/// so fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 of the file.
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        pgrp: fields.get(2)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// Whether `pid` is a live (not zombie) process that started at `start_time`.
pub fn is_same_live_process(pid: u32, start_time: u64) -> bool {
    stat(pid).is_some_and(|s| s.state != 'Z' && s.start_time == start_time)
}

/// The pids of the children of `parent` (zombies included: they still need reaping).
pub fn children_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| stat(pid).is_some_and(|s| s.ppid == parent))
        .collect()
}

/// Marks every descriptor from `first` up close-on-exec, so a program started next inherits
/// only its stdin, stdout and stderr. Between fork and exec: async-signal-safe, allocates
/// nothing; marks rather than closes, so the pipe std reports an exec failure on keeps working.
pub fn cloexec_from(first: u32) {
    // SAFETY: close_range and fcntl with integer arguments.
    unsafe {
        if libc::syscall(libc::SYS_close_range, first, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) == 0 {
            return;
        }
        // Kernels before 5.11: one fcntl per possible descriptor, up to the limit.
        let max = libc::sysconf(libc::_SC_OPEN_MAX).clamp(0, 1 << 20) as i32;
        for fd in first as i32..max {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

/// Whether `pid` is a live process started at `start_time` that runs one of `programs` (an
/// upgraded binary's " (deleted)" path counts as the same) with this process's effective uid as its
/// real uid: a shim of this agent, never a user's process that reused the pid (after a reboot,
/// start times repeat) or copied the shim's arguments.
///
/// The real uid, not the owner of `/proc/<pid>`: a shim looks at a rank's paths with the
/// rank user's effective ids for a moment ([`crate::supervise`]), and some kernels show the
/// effective uid as that owner, so a shim looked at in that moment would seem another's.
pub fn is_own_process(pid: u32, start_time: u64, programs: &[PathBuf]) -> bool {
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    is_same_live_process(pid, start_time) && real_uid(pid) == Some(me) && runs(pid, programs)
}

/// The real uid of `pid`: the first of the `Uid:` fields of `/proc/<pid>/status`.
pub fn real_uid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    line.split_whitespace().next()?.parse().ok()
}

/// Whether `pid` runs one of `programs`: its `/proc/<pid>/exe` link, or, where the link may not
/// be followed, its command name. A process that changed its effective ids is not dumpable, and
/// then only a holder of CAP_SYS_PTRACE may follow the link (an agent in a container may lack it).
fn runs(pid: u32, programs: &[PathBuf]) -> bool {
    // The agent's paths come from /proc/self/exe, already canonical: resolved again only when
    // they differ (every look at every rank would otherwise walk the paths' links).
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    match std::fs::read_link(format!("/proc/{pid}/exe")) {
        Ok(exe) => exe.to_str().is_some_and(|e| {
            let exe = Path::new(e.trim_end_matches(" (deleted)"));
            programs.iter().any(|p| exe == p) || programs.iter().any(|p| exe == canonical(p))
        }),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            // The kernel keeps the first 15 bytes of the file name as the command name.
            let comm = std::fs::read(format!("/proc/{pid}/comm")).unwrap_or_default();
            let comm = comm.strip_suffix(b"\n").unwrap_or(&comm);
            programs.iter().any(|p| {
                let wanted = canonical(p);
                let name = wanted.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default();
                !name.is_empty() && comm == &name[..name.len().min(15)]
            })
        }
        Err(_) => false,
    }
}

/// Sends `signal` to the process group `pgid`. `Ok(false)` when the group no longer exists.
pub fn killpg(pgid: u32, signal: i32) -> io::Result<bool> {
    let pgid = i32::try_from(pgid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    if pgid <= 1 {
        // Never signal "every process" or init's group by accident.
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: plain syscall with integer arguments.
    if unsafe { libc::killpg(pgid, signal) } == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ESRCH) { Ok(false) } else { Err(err) }
}

/// Whether the process group `pgid` still has a member that is not a zombie.
///
/// `kill(-pgid, 0)` also succeeds for zombies, which would make a cancelled rank whose parent
/// has not reaped it yet look alive, so this scans `/proc` instead.
pub fn group_has_live_member(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(stat)
        .any(|s| s.pgrp as i64 == pgid as i64 && s.state != 'Z')
}

/// The live processes whose command line holds `flag` followed by `value` as two arguments
/// (e.g. a shim's `--status-file <path>`), with their stat. A restarted agent finds a shim it
/// spawned but did not get to record this way: the status file path names one rank.
pub fn find_by_argument(flag: &str, value: &std::ffi::OsStr) -> Vec<(u32, ProcStat)> {
    use std::os::unix::ffi::OsStrExt;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let (flag, value) = (flag.as_bytes(), value.as_bytes());
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            args.windows(2).any(|w| w[0] == flag && w[1] == value)
        })
        .filter_map(|pid| Some((pid, stat(pid).filter(|s| s.state != 'Z')?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_name() {
        let text = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 200";
        let s = parse_stat(text).unwrap();
        assert_eq!(s.state, 'S');
        assert_eq!(s.pgrp, 4242);
        assert_eq!(s.start_time, 987654);
    }

    #[test]
    fn own_process_is_live_and_stable() {
        let pid = std::process::id();
        let s = stat(pid).unwrap();
        assert!(is_same_live_process(pid, s.start_time));
        assert!(!is_same_live_process(pid, s.start_time + 1));
    }

    #[test]
    fn this_process_is_its_own() {
        let pid = std::process::id();
        let start = stat(pid).unwrap().start_time;
        let me = std::env::current_exe().unwrap();
        let other = PathBuf::from("/bin/true");
        assert!(is_own_process(pid, start, std::slice::from_ref(&me)));
        assert!(is_own_process(pid, start, &[other.clone(), me.clone()]), "any of the programs");
        assert!(!is_own_process(pid, start, &[other]));
        assert!(!is_own_process(pid, start + 1, &[me]));
    }

    /// A process of this uid that runs as another user for a moment (as a shim does while it
    /// looks at a rank's paths) is still this uid's own: a launcher looking at it in that moment
    /// once declared the shim vanished and lost the rank.
    #[test]
    fn a_process_with_another_effective_uid_is_still_its_real_owners() {
        if unsafe { libc::geteuid() } != 0 {
            assert!(std::env::var_os("CI").is_none(), "CI runs as root: this must run there");
            println!("skipped: changing the effective uid needs root");
            return;
        }
        let mut child = std::process::Command::new("setpriv")
            .args(["--euid", "65534", "--egid", "65534", "--clear-groups", "sleep", "30"])
            .spawn()
            .expect("setpriv (util-linux) runs");
        let pid = child.id();
        let started = std::time::Instant::now();
        while std::fs::read(format!("/proc/{pid}/comm")).unwrap_or_default() != b"sleep\n" {
            assert!(started.elapsed() < std::time::Duration::from_secs(10), "sleep never started");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let start = stat(pid).unwrap().start_time;
        let sleep = std::fs::canonicalize("/usr/bin/sleep").unwrap();
        let ours = is_own_process(pid, start, &[sleep]);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(real_uid(pid), None, "gone after the wait");
        assert!(ours, "a root process with effective uid 65534 is root's own");
    }

    #[test]
    fn refuses_dangerous_groups() {
        assert!(killpg(0, 0).is_err());
        assert!(killpg(1, 0).is_err());
    }
}
