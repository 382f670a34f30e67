//! Where this host mounts its cgroup hierarchies (`/proc/self/mountinfo`) and where the agent
//! itself sits in each (`/proc/self/cgroup`): trainyard's groups go under the agent's own, so
//! a service manager's delegation (systemd's `Delegate=yes`) and a container's limits hold for
//! the ranks too. Pure parsing, unit-tested on the layouts of the field: a pure cgroup2 host,
//! systemd's hybrid layout, and a container's nested groups.

use std::path::PathBuf;

/// The agent's own cgroups on this host: the directory of each, under its hierarchy's mount.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mounts {
    /// In the cgroup2 (unified) hierarchy, if mounted (`/sys/fs/cgroup` on a pure v2 host,
    /// `/sys/fs/cgroup/unified` in systemd's hybrid layout).
    pub v2: Option<PathBuf>,
    /// In the v1 hierarchies of the controllers trainyard uses, by controller name (`freezer`,
    /// `memory`, `pids`, `cpuacct`).
    pub v1: Vec<(String, PathBuf)>,
}

/// The v1 controllers trainyard uses: kill (freezer), limits (memory, pids), accounting
/// (cpuacct, memory).
pub const V1_CONTROLLERS: [&str; 4] = ["freezer", "memory", "pids", "cpuacct"];

impl Mounts {
    /// This process's cgroups; empty when `/proc/self/mountinfo` cannot be read.
    pub fn read() -> Mounts {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Mounts::parse(&mountinfo).under(&own)
    }

    /// The mounts joined with the process's own path in each hierarchy, from the text of
    /// `/proc/<pid>/cgroup` (`0::/path` for v2, `N:controller,...:/path` for v1).
    pub fn under(self, own: &str) -> Mounts {
        let path_of = |wanted: &dyn Fn(&str) -> bool| {
            own.lines().find_map(|l| {
                let mut f = l.splitn(3, ':');
                let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
                wanted(controllers).then(|| path.trim_start_matches('/').to_string())
            })
        };
        let v2 = self.v2.map(|m| m.join(path_of(&|c| c.is_empty()).unwrap_or_default()));
        let v1 = self
            .v1
            .into_iter()
            .map(|(c, m)| {
                let own = path_of(&|list| list.split(',').any(|x| x == c)).unwrap_or_default();
                (c, m.join(own))
            })
            .collect();
        Mounts { v2, v1 }
    }

    /// Parses mountinfo text: `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE
    /// SOURCE SUPER_OPTS`. A v1 hierarchy names its controllers in its super options.
    pub fn parse(text: &str) -> Mounts {
        let mut m = Mounts::default();
        for line in text.lines() {
            let Some((head, tail)) = line.split_once(" - ") else { continue };
            let head: Vec<&str> = head.split(' ').collect();
            let tail: Vec<&str> = tail.split(' ').collect();
            let (Some(point), Some(fstype)) = (head.get(4), tail.first()) else { continue };
            let point = PathBuf::from(unescape(point));
            match *fstype {
                "cgroup2" if m.v2.is_none() => m.v2 = Some(point),
                "cgroup" => {
                    let opts = tail.get(2).copied().unwrap_or_default();
                    for c in opts.split(',').filter(|c| V1_CONTROLLERS.contains(c)) {
                        if !m.v1.iter().any(|(name, _)| name == c) {
                            m.v1.push((c.to_string(), point.clone()));
                        }
                    }
                }
                _ => {}
            }
        }
        m
    }

    /// The mount of v1 controller `name`.
    pub fn v1(&self, name: &str) -> Option<&PathBuf> {
        self.v1.iter().find(|(n, _)| n == name).map(|(_, p)| p)
    }
}

/// mountinfo escapes space, tab, newline and backslash as octal (`\040`).
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Some(v) =
                std::str::from_utf8(&bytes[i + 1..i + 4]).ok().and_then(|o| u8::from_str_radix(o, 8).ok())
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pure_v2_host() {
        let text = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n\
                    24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n";
        let m = Mounts::parse(text);
        assert_eq!(m.v2, Some(PathBuf::from("/sys/fs/cgroup")));
        assert!(m.v1.is_empty());
    }

    #[test]
    fn systemds_hybrid_layout_and_shared_hierarchies() {
        let text = "\
25 24 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:5 - cgroup2 cgroup2 rw\n\
27 25 0:24 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n\
30 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n\
31 25 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
32 25 0:29 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer\n\
33 25 0:30 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n\
34 25 0:31 / /mnt/odd\\040dir rw - cgroup cgroup rw,blkio\n";
        let m = Mounts::parse(text);
        assert_eq!(m.v2, Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(m.v1("cpuacct"), Some(&PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")));
        assert_eq!(m.v1("memory"), Some(&PathBuf::from("/sys/fs/cgroup/memory")));
        assert_eq!(m.v1("freezer"), Some(&PathBuf::from("/sys/fs/cgroup/freezer")));
        assert_eq!(m.v1("pids"), Some(&PathBuf::from("/sys/fs/cgroup/pids")));
        assert_eq!(m.v1.len(), 4, "blkio and name=systemd are not ours: {m:?}");
        assert_eq!(unescape("/mnt/odd\\040dir"), "/mnt/odd dir");
    }

    #[test]
    fn groups_go_under_the_agents_own() {
        let text = "26 25 0:23 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
                    31 25 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
                    30 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n";
        let own = "4:memory:/process_api/36eb\n2:cpu,cpuacct:/\n0::/system.slice/trainyard-agent.service\n";
        let m = Mounts::parse(text).under(own);
        assert_eq!(m.v2, Some(PathBuf::from("/sys/fs/cgroup/unified/system.slice/trainyard-agent.service")));
        assert_eq!(m.v1("memory"), Some(&PathBuf::from("/sys/fs/cgroup/memory/process_api/36eb")));
        assert_eq!(m.v1("cpuacct"), Some(&PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/")));
    }

    #[test]
    fn garbage_is_no_mount() {
        assert_eq!(Mounts::parse("nonsense\n - \n1 2 3\n"), Mounts::default());
    }
}
