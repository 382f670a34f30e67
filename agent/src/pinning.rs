//! Rank pinning on the agent's side: binding a rank to the CPUs and memory node the controller
//! planned (docs/field-notes.md §2), and reading back what the kernel really applied.
//!
//! Applied in the rank's process between fork and exec (see [`Binding::apply_in_child`]):
//! `sched_setaffinity` for the CPUs and `set_mempolicy(MPOL_BIND)` for memory, as raw calls, so
//! nothing depends on numactl. NCCL's proxy threads inherit the affinity of the thread that
//! creates them, and every thread inherits the memory policy.
//!
//! Failure policy: a binding that cannot be applied (a restricted container refusing
//! `set_mempolicy`, a CPU outside the agent's own cpuset) does not fail the rank. The rank runs,
//! the shim writes why to the rank's `stderr.log`, and the read-back below shows what the rank
//! really got, so the controller reports the mismatch as a warning on the job. A rank slowed
//! down by a missing binding is better than a job that cannot start on such hosts, and the
//! receipt says which one it was.
//!
//! Read-back: `Cpus_allowed_list` of `/proc/<pid>/status` is the affinity. `Mems_allowed_list`
//! is the cpuset's memory limit, which `MPOL_BIND` leaves alone, so on a multi-socket host it
//! cannot prove a bind by itself; the task's policy shows in `/proc/<pid>/numa_maps`
//! (`bind:0`). The effective memory binding is the bound nodes when the policy is `bind`, and
//! otherwise `Mems_allowed_list` followed by the policy, e.g. `0-1 (policy default)`, which
//! never equals a plan and so always warns.

use std::io;

use trainyard_proto::contract::cpulist;
use trainyard_proto::v1::HostInventory;

/// A binding to apply to a rank: CPU ids and the NUMA node its memory comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub cpus: Vec<u32>,
    pub mem_node: Option<u32>,
}

impl Binding {
    /// From the shim's flags; `None` when there is nothing to bind.
    pub fn from_flags(cpus: Option<&str>, mem_node: Option<u32>) -> Result<Option<Binding>, String> {
        let cpus = match cpus.filter(|c| !c.trim().is_empty()) {
            Some(list) => cpulist::parse(list).map_err(|e| format!("bad CPU list {list:?}: {e}"))?,
            None => Vec::new(),
        };
        if cpus.is_empty() && mem_node.is_none() {
            return Ok(None);
        }
        Ok(Some(Binding { cpus, mem_node }))
    }

    /// Binds the calling process. Runs between fork and exec, so it only makes raw system
    /// calls on data prepared before the fork ([`Prepared`]) and writes failures with
    /// `write(2)`; it never fails the rank (see the module documentation).
    pub fn prepare(&self) -> Prepared {
        // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let max = 8 * std::mem::size_of::<libc::cpu_set_t>() as u32;
        for &cpu in self.cpus.iter().filter(|&&c| c < max) {
            // SAFETY: cpu is below the set's capacity.
            unsafe { libc::CPU_SET(cpu as usize, &mut set) };
        }
        let mut nodemask = [0u64; 16];
        let node = self.mem_node.filter(|&n| n < 1024);
        if let Some(n) = node {
            nodemask[(n / 64) as usize] |= 1u64 << (n % 64);
        }
        Prepared { set: (!self.cpus.is_empty()).then_some(set), nodemask: node.map(|_| nodemask) }
    }
}

/// A binding in the form the system calls take, built before `fork`.
#[derive(Clone, Copy)]
pub struct Prepared {
    set: Option<libc::cpu_set_t>,
    nodemask: Option<[u64; 16]>,
}

const MPOL_BIND: libc::c_int = 2;

impl Prepared {
    /// Applies the binding to the calling process; async-signal-safe.
    pub fn apply_in_child(&self) {
        if let Some(set) = &self.set {
            // SAFETY: pid 0 is the caller; the set lives for the call.
            let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) };
            if rc != 0 {
                complain(b"trainyard-agent supervise: sched_setaffinity failed; the rank runs unpinned\n");
            }
        }
        if let Some(mask) = &self.nodemask {
            // SAFETY: the mask holds 16 * 64 bits, the maxnode passed.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_set_mempolicy,
                    MPOL_BIND,
                    mask.as_ptr(),
                    (mask.len() * 64) as libc::c_ulong,
                )
            };
            if rc != 0 {
                complain(
                    b"trainyard-agent supervise: set_mempolicy(MPOL_BIND) failed; memory is not bound\n",
                );
            }
        }
    }
}

fn complain(msg: &[u8]) {
    // SAFETY: write(2) on stderr with a valid buffer; async-signal-safe.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// What a live process is bound to, read from `/proc`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Effective {
    pub cpus: String,
    pub mems: String,
}

/// Reads the effective binding of `pid` (see the module documentation).
pub fn read_effective(pid: u32) -> io::Result<Effective> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let numa_maps = std::fs::read_to_string(format!("/proc/{pid}/numa_maps")).unwrap_or_default();
    Ok(effective_from(&status, &numa_maps))
}

/// The effective binding from the text of `status` and `numa_maps`.
pub fn effective_from(status: &str, numa_maps: &str) -> Effective {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let cpus = field("Cpus_allowed_list");
    let allowed = field("Mems_allowed_list");
    let policy = numa_maps.lines().next().and_then(|l| l.split_whitespace().nth(1)).unwrap_or("");
    let mems = match policy.strip_prefix("bind:") {
        Some(nodes) => nodes.to_string(),
        None if policy.is_empty() => allowed,
        None => format!("{allowed} (policy {policy})"),
    };
    Effective { cpus, mems }
}

/// Keeps `n` CPUs for the agent: removes the lowest-numbered `n` CPUs of the host (CPU 0 and
/// its neighbours, where housekeeping and interrupts usually land) from the NUMA nodes of the
/// inventory the controller plans from, so no rank is ever pinned to them.
pub fn reserve_cpus(inventory: &mut HostInventory, n: u32) {
    let mut all: Vec<u32> =
        inventory.numa_nodes.iter().flat_map(|node| cpulist::parse(&node.cpus).unwrap_or_default()).collect();
    all.sort_unstable();
    let kept: Vec<u32> = all.into_iter().take(n as usize).collect();
    for node in &mut inventory.numa_nodes {
        let cpus: Vec<u32> = cpulist::parse(&node.cpus)
            .unwrap_or_default()
            .into_iter()
            .filter(|c| !kept.contains(c))
            .collect();
        node.cpus = cpulist::format(&cpus);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::NumaNode;

    #[test]
    fn effective_binding_prefers_the_bound_policy() {
        let status = "Name:\tpython3\nCpus_allowed_list:\t0-15\nMems_allowed_list:\t0-1\n";
        let bound = "55d0 bind:1 file=/usr/bin/python3 mapped=1\n";
        assert_eq!(effective_from(status, bound), Effective { cpus: "0-15".into(), mems: "1".into() });
        let default = "55d0 default file=/usr/bin/python3\n";
        assert_eq!(effective_from(status, default).mems, "0-1 (policy default)");
        assert_eq!(effective_from(status, "").mems, "0-1");
    }

    #[test]
    fn reserved_cpus_leave_the_inventory() {
        let mut inv = HostInventory {
            numa_nodes: vec![NumaNode { id: 0, cpus: "0-7".into() }, NumaNode { id: 1, cpus: "8-15".into() }],
            ..Default::default()
        };
        reserve_cpus(&mut inv, 2);
        assert_eq!(inv.numa_nodes[0].cpus, "2-7");
        assert_eq!(inv.numa_nodes[1].cpus, "8-15");
    }

    /// Runs `cat FILE` bound as `binding` says, the way the shim binds a rank.
    fn bound_cat(binding: &Binding, file: &str) -> String {
        use std::os::unix::process::CommandExt;
        let prepared = binding.prepare();
        let mut cmd = std::process::Command::new("cat");
        cmd.arg(file);
        // SAFETY: apply_in_child only makes raw system calls.
        unsafe {
            cmd.pre_exec(move || {
                prepared.apply_in_child();
                Ok(())
            });
        }
        String::from_utf8(cmd.output().expect("run cat").stdout).expect("utf-8")
    }

    #[test]
    fn binding_applies_in_the_child() {
        let b = Binding::from_flags(Some("0"), Some(0)).unwrap().unwrap();
        let status = bound_cat(&b, "/proc/self/status");
        let maps = bound_cat(&b, "/proc/self/numa_maps");
        let e = effective_from(&status, &maps);
        assert_eq!(e.cpus, "0");
        // Restricted containers may refuse set_mempolicy: then the read-back says so.
        assert!(e.mems == "0" || e.mems.contains("policy"), "{e:?}");
        assert_eq!(Binding::from_flags(Some(""), None).unwrap(), None);
        assert!(Binding::from_flags(Some("a-b"), None).is_err());
    }
}
