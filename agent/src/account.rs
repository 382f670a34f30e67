//! Run-as: the Unix account a job's ranks run as, looked up on this node.
//!
//! The controller sends the submitting user's mapped account with every launch. An agent
//! running as root starts each rank as that account (the shim drops privileges between fork
//! and exec: `setgroups`, `setgid`, `setuid`) and refuses a launch that names none, names an
//! account this node lacks, or names root. An agent running as an ordinary user (a laptop, the
//! demo, CI) cannot switch: it runs ranks as itself and refuses a launch for another account.

use std::ffi::{CStr, CString};

/// A resolved account: what the shim switches to and what the rank's environment says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the primary one included), from the group database.
    pub groups: Vec<u32>,
    pub home: String,
    /// The groups of [`groups`](Self::groups) that give root, or the means to it (gid 0,
    /// [`PRIVILEGED_GROUPS`]), by name.
    pub privileged: Vec<String>,
}

/// Groups whose members hold root or a short way to it: sudo rights, the container daemons'
/// sockets, raw disks, the shadow file. A rank never runs with one of them.
pub const PRIVILEGED_GROUPS: [&str; 10] =
    ["root", "sudo", "wheel", "admin", "docker", "lxd", "incus-admin", "libvirt", "disk", "shadow"];

/// How a launch's ranks are started: as the agent itself, or switched to an account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunAs {
    Agent,
    Switch(Account),
}

/// Decides how to start the ranks of a launch for `requested` (empty: none mapped), for an
/// agent whose effective uid is `agent_uid`; `Err` is the refusal the rank's report carries.
/// `root_ranks` (the agent's `--allow-root-ranks`, for a single-user development box run as
/// root) lets a root agent run a launch that names no account as itself.
pub fn decide(
    requested: &str,
    agent_uid: u32,
    root_ranks: bool,
    lookup: impl Fn(&str) -> Option<Account>,
) -> Result<RunAs, String> {
    let as_root = agent_uid == 0;
    if requested.is_empty() {
        return if as_root && !root_ranks {
            Err("launch refused: the job names no Unix account to run as and this agent runs as root; \
                 ranks never run as root (an admin maps the user: `trainyard-controller user set NAME \
                 --unix-user ACCOUNT`)"
                .into())
        } else {
            Ok(RunAs::Agent)
        };
    }
    let Some(account) = lookup(requested) else {
        return Err(format!("launch refused: no Unix account {requested:?} on this node"));
    };
    if account.uid == 0 {
        return Err(format!(
            "launch refused: account {requested:?} is root (uid 0); ranks never run as root"
        ));
    }
    if account.gid == 0 {
        return Err(format!(
            "launch refused: account {requested:?} has group 0 (root) as its primary group; ranks never run with root's group"
        ));
    }
    if !account.privileged.is_empty() {
        return Err(format!(
            "launch refused: account {requested:?} is in the privileged group(s) {}, which give root or a way to it; \
             map the user to an account without them",
            account.privileged.join(", ")
        ));
    }
    match (as_root, account.uid == agent_uid) {
        (_, true) => Ok(RunAs::Agent),
        (true, false) => Ok(RunAs::Switch(account)),
        (false, false) => Err(format!(
            "launch refused: this agent runs as uid {agent_uid}, not root, so it cannot start ranks as \
             {requested:?} (uid {}); run the agent as root to run ranks as their users",
            account.uid
        )),
    }
}

/// The agent's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// Looks `name` up in the password and group databases (NSS, so LDAP accounts work too).
pub fn lookup(name: &str) -> Option<Account> {
    let c_name = CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: a zeroed passwd is a valid out-parameter; getpwnam_r writes into `pwd` and `buf`
    // (whose length we pass) and sets `result` to `&pwd` or null.
    let (uid, gid, home) = unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwnam_r(c_name.as_ptr(), &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result);
        if rc != 0 || result.is_null() {
            return None;
        }
        let home = if pwd.pw_dir.is_null() {
            String::new()
        } else {
            CStr::from_ptr(pwd.pw_dir).to_string_lossy().into_owned()
        };
        (pwd.pw_uid, pwd.pw_gid, home)
    };
    let groups = group_list(&c_name, gid);
    let privileged = groups
        .iter()
        .filter_map(|&g| match group_name(g) {
            Some(n) if PRIVILEGED_GROUPS.contains(&n.as_str()) => Some(n),
            _ if g == 0 => Some("gid 0".to_string()),
            _ => None,
        })
        .collect();
    Some(Account { name: name.to_string(), uid, gid, groups, home, privileged })
}

/// The name of group `gid`, from the group database.
fn group_name(gid: u32) -> Option<String> {
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: a zeroed group is a valid out-parameter; getgrgid_r writes into `grp` and `buf`
    // (whose length we pass) and sets `result` to `&grp` or null.
    unsafe {
        let mut grp: libc::group = std::mem::zeroed();
        let mut result: *mut libc::group = std::ptr::null_mut();
        let rc = libc::getgrgid_r(gid, &mut grp, buf.as_mut_ptr(), buf.len(), &mut result);
        if rc != 0 || result.is_null() || grp.gr_name.is_null() {
            return None;
        }
        Some(CStr::from_ptr(grp.gr_name).to_string_lossy().into_owned())
    }
}

fn group_list(name: &CStr, gid: u32) -> Vec<u32> {
    let mut count: libc::c_int = 64;
    loop {
        let mut groups = vec![0 as libc::gid_t; count as usize];
        // SAFETY: `groups` holds `count` entries; getgrouplist writes at most that many and
        // sets `count` to the number it needs when that is more (returning -1).
        let rc = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
        if rc >= 0 {
            groups.truncate(count as usize);
            return groups;
        }
        if count as usize <= groups.len() || count > 65_536 {
            return vec![gid];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(name: &str, uid: u32) -> Option<Account> {
        let home = format!("/home/{name}");
        Some(Account { name: name.into(), uid, gid: uid, groups: vec![uid], home, privileged: vec![] })
    }

    fn table(name: &str) -> Option<Account> {
        match name {
            "alice" => account("alice", 1001),
            "toor" => account("toor", 0),
            "dev" => account("dev", 1000),
            "wheeler" => account("wheeler", 1002).map(|a| Account { gid: 0, ..a }),
            "ops" => account("ops", 1003)
                .map(|a| Account { privileged: vec!["docker".into(), "sudo".into()], ..a }),
            _ => None,
        }
    }

    #[test]
    fn accounts_with_roots_group_or_a_privileged_one_are_refused_naming_it() {
        let e = decide("wheeler", 0, false, table).unwrap_err();
        assert!(e.contains("group 0"), "{e}");
        let e = decide("ops", 0, false, table).unwrap_err();
        assert!(e.contains("docker, sudo"), "{e}");
        // The real databases: root's own groups name gid 0; nobody's none.
        assert!(lookup("root").unwrap().privileged.iter().any(|g| g == "root" || g == "gid 0"));
        assert!(lookup("nobody").unwrap().privileged.is_empty());
    }

    #[test]
    fn root_agents_switch_to_the_mapped_account_and_never_run_ranks_as_root() {
        assert_eq!(decide("alice", 0, false, table), Ok(RunAs::Switch(table("alice").unwrap())));
        assert!(decide("", 0, false, table).unwrap_err().contains("names no Unix account"));
        assert!(decide("toor", 0, false, table).unwrap_err().contains("never run as root"));
        assert!(decide("mallory", 0, false, table).unwrap_err().contains("no Unix account \"mallory\""));
        // --allow-root-ranks only covers launches that name no account.
        assert_eq!(decide("", 0, true, table), Ok(RunAs::Agent));
        assert!(decide("toor", 0, true, table).is_err());
        assert_eq!(decide("alice", 0, true, table), Ok(RunAs::Switch(table("alice").unwrap())));
    }

    #[test]
    fn unprivileged_agents_run_ranks_as_themselves_only() {
        assert_eq!(decide("", 1000, false, table), Ok(RunAs::Agent));
        assert_eq!(decide("dev", 1000, false, table), Ok(RunAs::Agent));
        let other = decide("alice", 1000, false, table).unwrap_err();
        assert!(other.contains("cannot start ranks as \"alice\""), "{other}");
    }

    #[test]
    fn the_password_database_is_read() {
        let root = lookup("root").expect("every system has root");
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(root.groups.contains(&0));
        assert_eq!(lookup("no-such-user-trainyard"), None);
    }
}
