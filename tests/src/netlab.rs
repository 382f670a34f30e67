//! Hosts that are really apart: each in its own Linux network namespace, joined by a bridge on a
//! private test subnet (10.213.S.0/24) that the test makes and removes. The controller listens
//! on the bridge's address (10.213.S.1) in the test's own namespace; host `i` is 10.213.S.(10+i)
//! behind a veth pair, so ranks rendezvous across hosts through the MASTER_ADDR their agents
//! advertise, and a partition is a link taken down ([`NetLab::cut`]).
//!
//! Needs root and `ip` (iproute2, installed by `deploy/setup.sh`): [`NetLab::create`] returns
//! `None` and prints `skipped: ...` otherwise, and fails instead when `CI` is set (CI runs as
//! root, so a green CI proves the namespace tests ran). Dropping the lab deletes its namespaces (and with
//! them the veth pairs) and its bridge, also when a test panics; a lab left behind by a killed
//! test process is removed by the next one that starts (names carry the creator's pid).

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

/// Labs are made one at a time per process: choosing a free subnet and creating it is not atomic.
static CREATE: Mutex<u32> = Mutex::new(0);

/// One host of a lab.
#[derive(Debug, Clone)]
pub struct LabHost {
    /// The network namespace (`ip netns exec NS ...` runs a program there).
    pub ns: String,
    /// The veth end on the bridge, in the test's namespace: down is a cut network.
    pub veth: String,
    pub addr: Ipv4Addr,
}

/// A bridge and `n` namespace hosts on it.
#[derive(Debug)]
pub struct NetLab {
    bridge: String,
    gateway: Ipv4Addr,
    hosts: Vec<LabHost>,
}

impl NetLab {
    /// A lab of `n` hosts, or `None` (after printing `skipped: why`) where the test cannot make
    /// one: not root, or no `ip` command.
    pub fn create(n: usize) -> Result<Option<NetLab>> {
        if !crate::root_or_skip("network-namespace hosts need root") {
            return Ok(None);
        }
        if Command::new("ip").arg("-V").output().is_err() {
            let why = "the `ip` command (iproute2) is missing; deploy/setup.sh installs it";
            anyhow::ensure!(std::env::var_os("CI").is_none(), "{why}: CI must run the namespace tests");
            eprintln!("skipped: {why}");
            return Ok(None);
        }
        anyhow::ensure!(n <= 200, "a lab has at most 200 hosts");
        let mut count = CREATE.lock().unwrap_or_else(|p| p.into_inner());
        remove_stale();
        *count += 1;
        let (pid, k) = (std::process::id(), *count);
        let subnet = free_subnet()?;
        let gateway = Ipv4Addr::new(10, 213, subnet, 1);
        let mut lab = NetLab { bridge: format!("tyb{pid}-{k}"), gateway, hosts: Vec::new() };
        ip(&["link", "add", &lab.bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{gateway}/24"), "dev", &lab.bridge])?;
        ip(&["link", "set", &lab.bridge, "up"])?;
        for i in 0..n {
            let host = LabHost {
                ns: format!("tylab-{pid}-{k}-{i}"),
                veth: format!("tyv{pid}-{k}h{i}"),
                addr: Ipv4Addr::new(10, 213, subnet, 10 + i as u8),
            };
            ip(&["netns", "add", &host.ns])?;
            lab.hosts.push(host.clone());
            ip(&["link", "add", &host.veth, "type", "veth", "peer", "name", "eth0", "netns", &host.ns])?;
            ip(&["link", "set", &host.veth, "master", &lab.bridge, "up"])?;
            let inside = |args: &[&str]| {
                let mut all = vec!["netns", "exec", &host.ns, "ip"];
                all.extend_from_slice(args);
                ip(&all)
            };
            inside(&["addr", "add", &format!("{}/24", host.addr), "dev", "eth0"])?;
            inside(&["link", "set", "eth0", "up"])?;
            inside(&["link", "set", "lo", "up"])?;
        }
        Ok(Some(lab))
    }

    /// The bridge's address, in the test's own namespace: where the controller listens.
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    pub fn host(&self, i: usize) -> &LabHost {
        &self.hosts[i]
    }

    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Cuts host `i` off the network (its link to the bridge goes down); its processes live on.
    pub fn cut(&self, i: usize) -> Result<()> {
        ip(&["link", "set", &self.hosts[i].veth, "down"])
    }

    /// Puts host `i` back on the network.
    pub fn heal(&self, i: usize) -> Result<()> {
        ip(&["link", "set", &self.hosts[i].veth, "up"])
    }

    /// Gives the bridge a second address, 10.213.S.2 (the hosts are .10 and up): a second
    /// controller in the test's namespace listens there, on the same port as the first.
    pub fn second_gateway(&self) -> Result<Ipv4Addr> {
        let o = self.gateway.octets();
        let addr = Ipv4Addr::new(o[0], o[1], o[2], 2);
        ip(&["addr", "add", &format!("{addr}/24"), "dev", &self.bridge])?;
        Ok(addr)
    }

    /// Host `i`'s own /etc/hosts (`ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts):
    /// localhost and `entries`, so a name there resolves, through the real resolver, to what
    /// the test says (several lines for one name: every address).
    pub fn set_hosts(&self, i: usize, entries: &[(Ipv4Addr, &str)]) -> Result<()> {
        let dir = netns_etc(&self.hosts[i].ns);
        std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
        let mut text = String::from("127.0.0.1 localhost\n");
        for (addr, name) in entries {
            text.push_str(&format!("{addr} {name}\n"));
        }
        std::fs::write(dir.join("hosts"), text).with_context(|| dir.display().to_string())
    }

    /// `program` to be run inside host `i`'s namespace.
    pub fn command(&self, i: usize, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[i].ns]).arg(program);
        c
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for host in &self.hosts {
            let _ = ip(&["netns", "del", &host.ns]);
            let _ = std::fs::remove_dir_all(netns_etc(&host.ns));
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// The per-namespace /etc of `ns` that `ip netns exec` mounts files from.
fn netns_etc(ns: &str) -> std::path::PathBuf {
    std::path::Path::new("/etc/netns").join(ns)
}

/// Runs `ip ARGS`; fails with its stderr.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    if !out.status.success() {
        bail!("ip {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn ip_text(args: &[&str]) -> String {
    Command::new("ip")
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// A third octet S whose 10.213.S.0/24 no interface here uses.
fn free_subnet() -> Result<u8> {
    let used = ip_text(&["-4", "-o", "addr", "show"]);
    let start = (std::process::id() % 200) as u8;
    (0..250u8)
        .map(|d| 1 + (start.wrapping_add(d) % 250))
        .find(|s| !used.contains(&format!("10.213.{s}.")))
        .context("no free 10.213.S.0/24 subnet for a test lab")
}

/// Namespaces and bridges of labs whose creating process is gone.
fn remove_stale() {
    let dead =
        |pid: &str| pid.parse::<u32>().is_ok_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists());
    for line in ip_text(&["netns", "list"]).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if let Some(pid) = name.strip_prefix("tylab-").and_then(|r| r.split('-').next())
            && dead(pid)
        {
            let _ = ip(&["netns", "del", name]);
            let _ = std::fs::remove_dir_all(netns_etc(name));
        }
    }
    for line in ip_text(&["-o", "link", "show", "type", "bridge"]).lines() {
        let name = line.split(": ").nth(1).unwrap_or_default();
        if let Some(pid) = name.strip_prefix("tyb").and_then(|r| r.split('-').next())
            && dead(pid)
        {
            let _ = ip(&["link", "del", name]);
        }
    }
}
