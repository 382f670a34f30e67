//! End-to-end harness: real `trainyard-controller`, `trainyard-agent` and `ctl` processes on
//! loopback, with ranks running `examples/rank.py`.
//!
//! # Layout
//! - [`Cluster`]: a temporary directory with a controller, agents and helpers to drive them.
//! - [`host_file`]: writes a host description standing in for an 8-GPU node.
//! - [`flood`]: the receipt flood job the ingest benches run, and what it measured.
//! - [`group`]: more controllers in a cluster's group on its PostgreSQL, followers that take over.
//! - [`netlab`]: hosts in their own network namespaces on a private bridge ([`Cluster::start_lab`]).
//! - [`raw_insert`]: the same rows through a plain sqlx loop, the ceiling ingest is read against.
//! - [`chaos`]: what the chaos bench measured and whether it met its targets.
//! - [`results`]: bench results as JSON-lines files in docs/results/.
//! - Process hygiene: every process a cluster starts carries a marker in its environment, which
//!   ranks inherit; dropping the cluster kills every process carrying it, so no test leaves a
//!   rank behind even when it fails half-way.
//!
//! Tests need the debug binaries built first (`cargo build --workspace --bins`, which
//! `deploy/test.sh` does); benches build the release ones themselves
//! ([`build_release_binaries`]). Either way they are found in the caller's profile directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use sqlx::Row;
use trainyard_agent::bootstrap::BOOTSTRAP_READY;
use trainyard_testkit::pg_server::{Durability, TempPostgres};

pub mod chaos;
pub mod flood;
pub mod group;
pub mod netlab;
pub mod raw_insert;
pub mod slurm;

pub use netlab::NetLab;
pub use trainyard_testkit::results;

/// Environment variable that marks every process of one test cluster.
const MARKER: &str = "TRAINYARD_TEST_CLUSTER";

/// Directory holding the workspace's binaries: the test executable's profile directory,
/// `target/debug` for tests and `target/release` for benches.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>
    exe.parent().and_then(Path::parent).expect("target directory").to_path_buf()
}

/// A workspace binary of the caller's own profile. Tests use the debug binaries that
/// `deploy/test.sh` builds; benches call [`build_release_binaries`] first, so they never
/// measure a debug build (which once halved the ingest figures a fresh clone reproduced).
pub fn bin(name: &str) -> Result<PathBuf> {
    let path = bin_dir().join(name);
    if !path.exists() {
        bail!("{name} is missing from {}: run `cargo build --workspace --bins` first", bin_dir().display());
    }
    Ok(path)
}

/// Builds the workspace's binaries in the release profile, for a bench: a bench measures what an
/// operator deploys. Cargo's output (progress included) goes to the terminal; a fresh clone
/// takes a few minutes on 2 cores, an up-to-date tree a fraction of a second.
pub fn build_release_binaries() -> Result<()> {
    anyhow::ensure!(
        !cfg!(debug_assertions),
        "build_release_binaries is for benches, which run in the release profile"
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!("bench: building the release binaries (cargo build --release --workspace --bins)");
    let mut build = Command::new(cargo);
    // The variables cargo set for this bench describe the tests crate, not the build: ring's
    // build script watches CARGO_MANIFEST_DIR, so passing them on made every bench rebuild ring
    // and all above it (3-4 minutes), and the next plain `cargo build --release` rebuild again.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_MANIFEST_") || name.starts_with("CARGO_PKG_") {
            build.env_remove(name.as_ref());
        }
    }
    let status = build
        .args(["build", "--release", "--workspace", "--bins"])
        .current_dir(repo_root())
        .status()
        .context("run cargo build --release")?;
    anyhow::ensure!(status.success(), "cargo build --release --workspace --bins failed ({status})");
    Ok(())
}

/// Whether the tests run as root; if not, says the test is skipped and why, and in CI (which
/// runs as root) fails instead, so a green CI proves the root tests ran.
pub fn root_or_skip(why: &str) -> bool {
    // SAFETY: geteuid cannot fail and touches no memory.
    let root = unsafe { libc::geteuid() == 0 };
    if !root {
        assert!(std::env::var_os("CI").is_none(), "{why}: CI runs as root, so this must run there");
        println!("skipped: {why}");
    }
    root
}

/// The agents' `--disk-floor-percent` as an environment variable. The harness's agents run with
/// 0 (their 1 GiB floor stays): this machine's disk is shared, and how full it is must not
/// refuse a test's launches. The test of the floor sets it back.
pub const DISK_FLOOR_PERCENT: &str = "TRAINYARD_DISK_FLOOR_PERCENT";

/// A SQL condition (SQLite and PostgreSQL) that holds for the receipts a rank wrote, leaving out
/// the exit receipt the agent appends for every rank that ran (its usage: docs/receipts.md).
pub const RANK_WRITTEN: &str =
    "(kind <> 'exit' OR body NOT LIKE '%\"producer\":\"trainyard agent (rank end)\"%')";

/// Pids of the live Python rank processes of `job`'s `attempt` (with `RANK=rank` when given),
/// on this machine, in any namespace.
pub fn rank_pids(job: u64, attempt: u64, rank: Option<u32>) -> Vec<i32> {
    let mut wants = vec![format!("TRAINYARD_JOB_ID={job}\0"), format!("TRAINYARD_ATTEMPT={attempt}\0")];
    wants.extend(rank.map(|r| format!("\0RANK={r}\0")));
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            comm.starts_with("python")
                && wants.iter().all(|w| env.windows(w.len()).any(|x| x == w.as_bytes()))
        })
        .collect()
}

/// Root of the repository (for `examples/rank.py`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repo root").to_path_buf()
}

/// A host description of an 8-GPU H100 SXM node whose NUMA node 0 holds every CPU here.
pub fn host_file(dir: &Path, hostname: &str, gpus: u32) -> PathBuf {
    let gpu_list: Vec<serde_json::Value> = (0..gpus)
        .map(|i| {
            serde_json::json!({
                "index": i,
                "uuid": format!("GPU-{hostname}-{i:04}"),
                "model": "NVIDIA H100 80GB HBM3",
                "memory_mib": 81559,
                "pci_bus_id": format!("00000000:{:02X}:00.0", 0x18 + i * 0x10),
                "numa_node": 0
            })
        })
        .collect();
    let links: Vec<Vec<String>> = (0..gpus)
        .map(|i| (0..gpus).map(|j| if i == j { "X".to_string() } else { "NV18".to_string() }).collect())
        .collect();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let doc = serde_json::json!({
        "hostname": hostname,
        "gpus": gpu_list,
        "links": links,
        "numa_nodes": [{"id": 0, "cpus": format!("0-{}", cpus - 1)}],
    });
    let path = dir.join(format!("{hostname}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&doc).expect("json")).expect("write host file");
    path
}

/// A host description with a custom NUMA layout: GPU `i` hangs off NUMA node `gpu_numa[i]`,
/// and `numa_cpus` lists the CPUs of each NUMA node (kernel list format). Links are `NV18`.
pub fn host_file_numa(dir: &Path, hostname: &str, gpu_numa: &[i32], numa_cpus: &[(u32, &str)]) -> PathBuf {
    let n = gpu_numa.len();
    let gpu_list: Vec<serde_json::Value> = gpu_numa
        .iter()
        .enumerate()
        .map(|(i, numa)| {
            serde_json::json!({
                "index": i,
                "uuid": format!("GPU-{hostname}-{i:04}"),
                "model": "NVIDIA H100 80GB HBM3",
                "memory_mib": 81559,
                "pci_bus_id": format!("00000000:{:02X}:00.0", 0x18 + i * 0x10),
                "numa_node": numa
            })
        })
        .collect();
    let links: Vec<Vec<&str>> =
        (0..n).map(|i| (0..n).map(|j| if i == j { "X" } else { "NV18" }).collect()).collect();
    let numa: Vec<serde_json::Value> =
        numa_cpus.iter().map(|(id, cpus)| serde_json::json!({"id": id, "cpus": cpus})).collect();
    let doc = serde_json::json!({"hostname": hostname, "gpus": gpu_list, "links": links, "numa_nodes": numa});
    let path = dir.join(format!("{hostname}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&doc).expect("json")).expect("write host file");
    path
}

/// The Unix account test users' ranks run as on a secure cluster: `nobody` when the tests run
/// as root (so the switch is real), else the account running them (an unprivileged agent runs
/// ranks as itself only).
pub fn run_account() -> String {
    // SAFETY: geteuid cannot fail and touches no memory.
    if unsafe { libc::geteuid() } == 0 {
        "nobody".into()
    } else {
        std::env::var("USER").unwrap_or_else(|_| "nobody".into())
    }
}

/// `.venv/bin/python` of this checkout: deploy/setup.sh installs torch and lightning there.
pub fn venv_python() -> PathBuf {
    repo_root().join(".venv/bin/python")
}

/// An interpreter with `.venv`'s torch that the account ranks run as can use, and the
/// `PYTHONPATH` it needs: `.venv`'s own python when that account can run it, else a system
/// `python3` of the same version reading `.venv`'s site-packages (a venv whose interpreter links
/// into a home directory that account cannot enter); `None` when neither imports torch.
pub fn torch_for_ranks() -> Option<(String, String)> {
    let runs = |python: &str, path: &str| {
        std::process::Command::new("runuser")
            .args(["-u", &run_account(), "--", "env"])
            .arg(format!("PYTHONPATH={path}"))
            .args([python, "-c", "import torch.distributed"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let venv = venv_python().display().to_string();
    if runs(&venv, "") {
        return Some((venv, String::new()));
    }
    let out = std::process::Command::new(&venv)
        .args([
            "-c",
            "import site, sys; print(site.getsitepackages()[0]); print('python%d.%d' % sys.version_info[:2])",
        ])
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let mut lines = text.lines();
    let (site, version) = (lines.next()?.to_string(), lines.next()?.to_string());
    let system = format!("/usr/bin/{version}");
    runs(&system, &site).then_some((system, site))
}

/// Real training scripts the tests run as jobs (tests/fixtures/scripts).
pub fn fixture_scripts() -> PathBuf {
    repo_root().join("tests/fixtures/scripts")
}

/// An `exec` job that runs .venv's python with `args`.
#[derive(Debug, Clone, Copy)]
pub struct PythonJob<'a> {
    pub name: &'a str,
    pub gpus: u32,
    pub per_node: u32,
    pub workdir: &'a Path,
    /// The directory whose git revision the launch receipt records (default: `workdir`).
    pub source_dir: Option<&'a Path>,
    pub args: &'a [&'a str],
    /// The job's `[env]` overlay.
    pub env: &'a [(&'a str, &'a str)],
}

/// `method path` over HTTP/1.1 to `addr`: (status, body).
pub fn http(addr: &str, method: &str, path: &str) -> Result<(u16, String)> {
    http_with(addr, method, path, &[])
}

/// [`http`] with extra request headers, e.g. `("Authorization", "Bearer ...")`.
pub fn http_with(addr: &str, method: &str, path: &str, headers: &[(&str, &str)]) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).with_context(|| format!("connect to {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(stream, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{extra}Connection: close\r\n\r\n")?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).context("status line")?;
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        unchunk(body)
    } else {
        body.to_string()
    };
    Ok((status, body))
}

/// The body of a chunked HTTP/1.1 response.
fn unchunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The headless Chromium of this machine (`deploy/setup.sh` installs the Debian package).
pub fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"].into_iter().find_map(|name| {
        let out = Command::new("sh").args(["-c", &format!("command -v {name}")]).output().ok()?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (out.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
    })
}

/// Loads `url` in headless Chromium, lets its scripts run for up to `budget` of virtual time,
/// and returns the rendered DOM; with `screenshot`, also writes a PNG of the page there.
pub fn browse(url: &str, budget: Duration, screenshot: Option<&Path>) -> Result<String> {
    let browser = chromium().context("chromium is not installed (deploy/setup.sh installs it)")?;
    let profile = tempfile::tempdir()?;
    let base = |c: &mut Command| {
        c.args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(format!("--virtual-time-budget={}", budget.as_millis()))
            .stdin(Stdio::null());
    };
    let mut dump = Command::new(&browser);
    base(&mut dump);
    let out = dump.arg("--dump-dom").arg(url).output().context("run chromium")?;
    if !out.status.success() {
        bail!("chromium failed on {url}: {}", String::from_utf8_lossy(&out.stderr));
    }
    if let Some(path) = screenshot {
        let mut shot = Command::new(&browser);
        base(&mut shot);
        shot.arg("--window-size=1400,1000").arg(format!("--screenshot={}", path.display())).arg(url);
        let done = shot.stdout(Stdio::null()).stderr(Stdio::null()).status().context("run chromium")?;
        if !done.success() {
            bail!("chromium could not take a screenshot of {url}");
        }
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The CPUs this process may run on, from `/proc/self/status` (the machine's real CPU ids).
pub fn allowed_cpus() -> Vec<u32> {
    let list = proc_status_field(std::process::id(), "Cpus_allowed_list").unwrap_or_else(|| "0".into());
    let mut cpus = Vec::new();
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<u32>().unwrap_or(0)..=b.parse::<u32>().unwrap_or(0)),
            None => cpus.extend(part.parse::<u32>().ok()),
        }
    }
    cpus
}

/// A field of `/proc/<pid>/status`, e.g. `Cpus_allowed_list`.
pub fn proc_status_field(pid: u32, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':').map(|v| v.trim().to_string()))
}

/// The store a test cluster's controller runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The default: a SQLite file under the cluster's directory.
    Sqlite,
    /// A PostgreSQL server of the cluster's own (see `TempPostgres`), so a test may restart it.
    Postgres,
}

/// A controller with its agents, all in one temporary directory.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    marker: String,
    controller: Option<Child>,
    pub addr: String,
    /// The controller's HTTP listener (`/metrics`), on a free port chosen at each start.
    pub http_addr: String,
    agents: HashMap<String, Child>,
    /// The cluster's PostgreSQL server and database URL ([`Backend::Postgres`] only); dropped
    /// after every process of the cluster is gone.
    postgres: Option<(TempPostgres, String)>,
    /// The PKI directory of a [`Cluster::start_secure`] cluster: its controller serves TLS,
    /// agents present certificates and `ctl` a token.
    pki: Option<PathBuf>,
    /// The token `ctl` presents by default (a secure cluster's admin).
    pub token: Option<String>,
    /// Network-namespace hosts ([`Cluster::start_lab`]); removed after every process is gone.
    lab: Option<NetLab>,
    /// The lab host each agent runs on.
    agent_hosts: HashMap<String, usize>,
    /// Controller flags that replace the harness's defaults (`--agent-timeout-secs 30`).
    controller_flags: Vec<(String, String)>,
    /// What agents are given as `--controller`, when not the cluster's one controller (a group).
    pub agent_controllers: Option<String>,
}

/// A PostgreSQL server of the cluster's own and its database URL, for [`Backend::Postgres`].
fn postgres_for(backend: Backend) -> Result<Option<(TempPostgres, String)>> {
    Ok(match backend {
        Backend::Sqlite => None,
        Backend::Postgres => {
            let server = TempPostgres::start(Durability::Full).map_err(anyhow::Error::msg)?;
            let url = server.create_database().map_err(anyhow::Error::msg)?;
            Some((server, url))
        }
    })
}

impl Cluster {
    /// Starts a controller on port 0 with its SQLite store under the cluster's directory.
    pub fn start() -> Result<Cluster> {
        Cluster::start_on(Backend::Sqlite)
    }

    /// [`Cluster::start`] with controller `flags` added, or replacing the harness's defaults
    /// (`--cancel-grace-secs 3`, `--agent-timeout-secs 30`) of the same name.
    pub fn start_with(flags: &[(&str, &str)]) -> Result<Cluster> {
        Cluster::start_on_with(Backend::Sqlite, flags)
    }

    /// Starts a controller on port 0 with its store on `backend`.
    pub fn start_on(backend: Backend) -> Result<Cluster> {
        Cluster::start_on_with(backend, &[])
    }

    /// [`Cluster::start_on`] with controller `flags` as in [`Cluster::start_with`].
    pub fn start_on_with(backend: Backend, flags: &[(&str, &str)]) -> Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("trainyard-e2e-").tempdir()?;
        let postgres = postgres_for(backend)?;
        let mut cluster = Cluster::unstarted(dir, postgres, None);
        cluster.controller_flags = flags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        cluster.start_controller()?;
        Ok(cluster)
    }

    /// Starts a controller that serves TLS with a PKI of `init-pki` (agents present client
    /// certificates, users tokens), on SQLite, with an admin user `admin` (ranks run as
    /// [`run_account`]) whose token `ctl` presents unless told otherwise ([`Cluster::ctl_as`]).
    /// The cluster's directory is world-traversable, so ranks run as `nobody` reach their files.
    pub fn start_secure() -> Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("trainyard-e2e-").tempdir()?;
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        }
        let pki = init_pki(dir.path(), &[])?;
        let mut cluster = Cluster::unstarted(dir, None, Some(pki));
        cluster.token = Some(cluster.add_user("admin", &["--admin", "--unix-user", &run_account()])?);
        cluster.start_controller()?;
        Ok(cluster)
    }

    /// A cluster in `dir` whose controller is not started yet.
    fn unstarted(
        dir: tempfile::TempDir,
        postgres: Option<(TempPostgres, String)>,
        pki: Option<PathBuf>,
    ) -> Cluster {
        Cluster {
            marker: dir.path().display().to_string(),
            dir,
            controller: None,
            addr: String::new(),
            http_addr: String::new(),
            agents: HashMap::new(),
            postgres,
            pki,
            token: None,
            lab: None,
            agent_hosts: HashMap::new(),
            controller_flags: Vec::new(),
            agent_controllers: None,
        }
    }

    /// The PostgreSQL URL of a [`Backend::Postgres`] cluster.
    pub fn db_url(&self) -> Option<&str> {
        self.postgres.as_ref().map(|(_, url)| url.as_str())
    }

    /// A cluster whose agents run on `hosts` network-namespace hosts ([`NetLab`]); its
    /// controller listens on the lab bridge's address (plain text on that isolated network,
    /// with an admin token for `ctl` whose ranks run as [`run_account`]), with `flags` (e.g. `--agent-timeout-secs 5`) replacing the
    /// harness's defaults. `None` (after printing `skipped: ...`) where no lab can be made.
    pub fn start_lab(hosts: usize, flags: &[(&str, &str)]) -> Result<Option<Cluster>> {
        Cluster::start_lab_on(Backend::Sqlite, hosts, flags)
    }

    /// [`Cluster::start_lab`] with its store on `backend`.
    pub fn start_lab_on(backend: Backend, hosts: usize, flags: &[(&str, &str)]) -> Result<Option<Cluster>> {
        Cluster::start_lab_with(backend, hosts, flags, None)
    }

    /// [`Cluster::start_lab_on`] serving TLS with a PKI of `init-pki` whose server certificate
    /// also names `sans` and the lab bridge's address (agents present client certificates).
    pub fn start_lab_tls(
        backend: Backend,
        hosts: usize,
        flags: &[(&str, &str)],
        sans: &[&str],
    ) -> Result<Option<Cluster>> {
        Cluster::start_lab_with(backend, hosts, flags, Some(sans))
    }

    fn start_lab_with(
        backend: Backend,
        hosts: usize,
        flags: &[(&str, &str)],
        sans: Option<&[&str]>,
    ) -> Result<Option<Cluster>> {
        let Some(lab) = NetLab::create(hosts)? else { return Ok(None) };
        let dir = tempfile::Builder::new().prefix("trainyard-e2e-").tempdir()?;
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        }
        let pki = match sans {
            Some(sans) => {
                let gateway = lab.gateway().to_string();
                let all: Vec<&str> = sans.iter().copied().chain([gateway.as_str()]).collect();
                Some(init_pki(dir.path(), &all)?)
            }
            None => None,
        };
        let postgres = postgres_for(backend)?;
        let mut cluster = Cluster::unstarted(dir, postgres, pki);
        cluster.lab = Some(lab);
        cluster.controller_flags = flags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        cluster.token = Some(cluster.add_user("admin", &["--admin", "--unix-user", &run_account()])?);
        cluster.start_controller()?;
        Ok(Some(cluster))
    }

    /// The CA of a TLS cluster's certificates, what `ctl` and agents trust (`None`: plaintext).
    pub fn ca(&self) -> Option<PathBuf> {
        self.pki.as_ref().map(|p| p.join("ca.pem"))
    }

    /// The lab of a [`Cluster::start_lab`] cluster.
    pub fn lab(&self) -> &NetLab {
        self.lab.as_ref().expect("a cluster started with start_lab")
    }

    /// Starts agent `name` (a node of `gpus` GPUs) inside lab host `host`.
    pub fn start_agent_on(&mut self, host: usize, name: &str, gpus: u32) -> Result<()> {
        self.start_agent_on_env(host, name, gpus, &[])
    }

    /// [`Cluster::start_agent_on`] with extra environment variables.
    pub fn start_agent_on_env(
        &mut self,
        host: usize,
        name: &str,
        gpus: u32,
        env: &[(&str, &str)],
    ) -> Result<()> {
        let file = host_file(self.dir.path(), name, gpus);
        self.agent_hosts.insert(name.to_string(), host);
        self.start_agent_env(name, &file, env)
    }

    /// Cuts the network of the lab host agent `name` runs on; [`Cluster::heal`] restores it.
    pub fn cut(&self, name: &str) -> Result<()> {
        self.lab().cut(self.agent_hosts[name])
    }

    pub fn heal(&self, name: &str) -> Result<()> {
        self.lab().heal(self.agent_hosts[name])
    }

    /// The PKI directory of a secure cluster.
    pub fn pki(&self) -> Option<&Path> {
        self.pki.as_deref()
    }

    /// Runs `trainyard-controller ARGS` on this cluster's store (user and audit commands).
    pub fn admin(&self, args: &[&str]) -> Result<Output> {
        let mut command = Command::new(bin("trainyard-controller")?);
        command.args(args);
        match &self.postgres {
            Some((_, url)) => command.args(["--db", url]),
            None => command.arg("--data-dir").arg(self.path("controller")),
        };
        command.env(MARKER, &self.marker).output().context("run trainyard-controller")
    }

    /// `trainyard-controller user add NAME EXTRA...`: returns the token it prints.
    pub fn add_user(&self, name: &str, extra: &[&str]) -> Result<String> {
        let mut args = vec!["user", "add", name];
        args.extend_from_slice(extra);
        let out = self.admin(&args)?;
        if !out.status.success() {
            bail!("user add {name} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// A fresh, empty database on the cluster's PostgreSQL server ([`Backend::Postgres`] only):
    /// the raw loop's, beside the controller's, so both write to the same server and disk.
    pub fn create_postgres_database(&self) -> Result<String> {
        let (server, _) = self.postgres.as_ref().context("this cluster runs on SQLite")?;
        server.create_database().map_err(anyhow::Error::msg)
    }

    pub fn backend(&self) -> Backend {
        if self.postgres.is_some() { Backend::Postgres } else { Backend::Sqlite }
    }

    /// Restarts the cluster's PostgreSQL server under the running controller
    /// ([`Backend::Postgres`] only).
    pub fn restart_postgres(&mut self) -> Result<()> {
        self.postgres_outage(Duration::ZERO)
    }

    /// Stops the cluster's PostgreSQL for `down` (whole seconds), then starts it again.
    pub fn postgres_outage(&mut self, down: Duration) -> Result<()> {
        let (server, _) = self.postgres.as_mut().context("this cluster runs on SQLite")?;
        server.outage(down).map_err(anyhow::Error::msg)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn url(&self) -> String {
        match self.pki {
            // The server certificate names localhost, 127.0.0.1 and ::1 (and a lab's bridge).
            Some(_) => format!("https://{}", self.addr),
            None => format!("http://{}", self.addr),
        }
    }

    fn log(&self, name: &str) -> Result<std::fs::File> {
        let path = self.path(&format!("{name}.log"));
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| path.display().to_string())
    }

    /// (Re)starts the controller on the same data directory; after a restart it listens on
    /// the same port as before, so agents find it again.
    pub fn start_controller(&mut self) -> Result<()> {
        let addr_file = self.path("controller.addr");
        let http_file = self.path("controller.http");
        let _ = std::fs::remove_file(&addr_file);
        let _ = std::fs::remove_file(&http_file);
        let listen = match (&self.lab, self.addr.is_empty()) {
            (_, false) => self.addr.clone(),
            (Some(lab), true) => format!("{}:0", lab.gateway()),
            (None, true) => "127.0.0.1:0".to_string(),
        };
        let mut command = Command::new(bin("trainyard-controller")?);
        if self.lab.is_some() && self.pki.is_none() {
            command.arg("--insecure-plaintext-on-network");
        }
        let mut flags = vec![("--cancel-grace-secs", "3"), ("--agent-timeout-secs", "30")];
        flags.retain(|(k, _)| !self.controller_flags.iter().any(|(o, _)| o == k));
        for (k, v) in
            flags.into_iter().chain(self.controller_flags.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        {
            command.args([k, v]);
        }
        match &self.postgres {
            Some((_, url)) => command.args(["--db", url]),
            None => command.arg("--data-dir").arg(self.path("controller")),
        };
        if let Some(pki) = &self.pki {
            command.arg("--tls-dir").arg(pki);
        }
        let child = command
            .args(["--listen", &listen])
            .arg("--addr-file")
            .arg(&addr_file)
            .args(["--http-listen", "127.0.0.1:0", "--http-addr-file"])
            .arg(&http_file)
            .env(MARKER, &self.marker)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(self.log("controller")?)
            .spawn()
            .context("start trainyard-controller")?;
        self.controller = Some(child);
        self.addr = wait_for_file(&addr_file, Duration::from_secs(20)).context("controller address")?;
        self.http_addr =
            wait_for_file(&http_file, Duration::from_secs(20)).context("controller HTTP address")?;
        Ok(())
    }

    /// Waits until no job of the cluster is unfinished.
    pub fn wait_all_finished(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let sql = "SELECT COUNT(*) FROM jobs WHERE state NOT IN ('succeeded', 'failed', 'cancelled')";
        while self.query(sql)?[0][0] > 0 {
            if Instant::now() > deadline {
                bail!("jobs still unfinished after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// The controller's process id, while it runs.
    pub fn controller_pid(&self) -> Option<u32> {
        self.controller.as_ref().map(Child::id)
    }

    /// Kills the controller with SIGKILL, as a crash would.
    pub fn kill_controller(&mut self) {
        if let Some(mut child) = self.controller.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts an agent standing in for a node of `gpus` GPUs.
    pub fn start_agent(&mut self, name: &str, gpus: u32) -> Result<()> {
        let host = host_file(self.dir.path(), name, gpus);
        self.start_agent_with_host_file(name, &host)
    }

    /// Starts an agent standing in for the node a host description describes (e.g. one of
    /// `tests/fixtures/hosts/`), with agent id `name`.
    pub fn start_agent_with_host_file(&mut self, name: &str, host: &Path) -> Result<()> {
        self.start_agent_env(name, host, &[])
    }

    /// Starts an agent with extra environment variables (e.g. `TRAINYARD_AGENT_FAILPOINT`).
    /// Agents of a plain cluster run ranks of jobs that name no Unix account as themselves,
    /// root included (`--allow-root-ranks`); a secure cluster's agents never do, and present
    /// a certificate `issue-agent-cert` makes for `name`.
    pub fn start_agent_env(&mut self, name: &str, host: &Path, env: &[(&str, &str)]) -> Result<()> {
        self.start_agent_program(&bin("trainyard-agent")?, name, host, env)
    }

    /// [`Cluster::start_agent_env`] with the agent binary at `agent` (a copy elsewhere: the
    /// agent starts ranks under the `trainyard-shim` beside it, or under its own `supervise`).
    pub fn start_agent_program(
        &mut self,
        agent: &Path,
        name: &str,
        host: &Path,
        env: &[(&str, &str)],
    ) -> Result<()> {
        // The agent's bootstrap compile is a Python process of its own: tests that count
        // the ranks' processes start once it ended.
        let compiled_before = self.logs(&format!("agent-{name}")).matches(BOOTSTRAP_READY).count();
        let mut command = match (&self.lab, self.agent_hosts.get(name)) {
            (Some(lab), Some(&i)) => lab.command(i, agent),
            _ => Command::new(agent),
        };
        match &self.pki {
            Some(_) => command.arg("--tls-dir").arg(self.agent_cert(name)?),
            None => command.arg("--allow-root-ranks"),
        };
        let child = command
            .env(DISK_FLOOR_PERCENT, "0")
            .envs(env.iter().copied())
            .arg("--controller")
            .arg(self.agent_controllers.clone().unwrap_or_else(|| self.url()))
            .arg("--host-file")
            .arg(host)
            .arg("--data-dir")
            .arg(self.path(&format!("agent-{name}")))
            // No --address: the agent advertises the address it reaches the controller from.
            .args(["--agent-id", name])
            // Every agent serves its metrics on a free port, named in agent-NAME.metrics.
            .args(["--metrics-listen", "127.0.0.1:0", "--metrics-addr-file"])
            .arg(self.path(&format!("agent-{name}.metrics")))
            .env(MARKER, &self.marker)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(self.log(&format!("agent-{name}"))?)
            .spawn()
            .context("start trainyard-agent")?;
        self.agents.insert(name.to_string(), child);
        self.wait_agent_connected(name, Duration::from_secs(20))?;
        self.wait_agent_log_count(name, BOOTSTRAP_READY, compiled_before + 1, Duration::from_secs(20))
    }

    /// Waits until agent `name`'s log holds `line` at least `count` times (its log is appended
    /// to across restarts).
    pub fn wait_agent_log_count(
        &self,
        name: &str,
        line: &str,
        count: usize,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while self.logs(&format!("agent-{name}")).matches(line).count() < count {
            if Instant::now() > deadline {
                bail!(
                    "agent {name} did not log {line:?} within {timeout:?}:\n{}",
                    self.logs(&format!("agent-{name}"))
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The TLS directory of agent `name` of a secure cluster, issued on first use.
    pub fn agent_cert(&self, name: &str) -> Result<PathBuf> {
        let pki = self.pki.as_ref().context("this cluster has no PKI")?;
        let dir = pki.join("agents").join(name);
        if !dir.join("agent.pem").exists() {
            let out = self.admin(&["issue-agent-cert", name, "--pki-dir", &pki.display().to_string()])?;
            if !out.status.success() {
                bail!("issue-agent-cert {name} failed: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
        Ok(dir)
    }

    /// Waits until the controller's store shows the agent connected.
    pub fn wait_agent_connected(&self, name: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let sql = format!("SELECT COUNT(*) FROM agents WHERE agent_id = '{name}' AND state = 'connected'");
        loop {
            if self.query(&sql).is_ok_and(|rows| rows[0][0] == 1) {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "agent {name} did not connect within {timeout:?}:\n{}",
                    self.logs(&format!("agent-{name}"))
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // The controller stores the row before it adds the agent to the fleet it schedules on
        // (a submit in between finds no node): wait for `ctl nodes` too, where ctl answers.
        loop {
            match self.ctl(&["nodes", "-o", "json"]) {
                Ok(out) if out.status.success() => {
                    let nodes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
                    let listed = nodes.as_array().into_iter().flatten().any(|n| {
                        n["agent_id"].as_str() == Some(name) && n["state"].as_str() == Some("connected")
                    });
                    if listed {
                        return Ok(());
                    }
                }
                _ => return Ok(()),
            }
            if Instant::now() > deadline {
                bail!("agent {name} is connected in the store but not in `ctl nodes` after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until an agent's process has ended by itself (a failpoint), and reaps it.
    pub fn wait_agent_exit(&mut self, name: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let child = self.agents.get_mut(name).context("no such agent")?;
        while child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                bail!("agent {name} still running after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.agents.remove(name);
        Ok(())
    }

    /// Sends `signal` to agent `name` (SIGSTOP freezes it, SIGCONT thaws it); its ranks are
    /// separate processes and go on.
    pub fn signal_agent(&self, name: &str, signal: i32) -> Result<()> {
        let child = self.agents.get(name).context("no such agent")?;
        // SAFETY: kill has no memory preconditions; the pid is our own child's, not yet reaped.
        let rc = unsafe { libc::kill(child.id() as i32, signal) };
        anyhow::ensure!(rc == 0, "signal {signal} to agent {name}: {}", std::io::Error::last_os_error());
        Ok(())
    }

    /// Kills an agent with SIGKILL; its ranks keep running.
    pub fn kill_agent(&mut self, name: &str) {
        if let Some(mut child) = self.agents.remove(name) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs `ctl` against this cluster (with the cluster's token, if any).
    pub fn ctl(&self, args: &[&str]) -> Result<Output> {
        self.ctl_as(self.token.as_deref(), args)
    }

    /// Runs `ctl` presenting `token` (none: no token at all).
    pub fn ctl_as(&self, token: Option<&str>, args: &[&str]) -> Result<Output> {
        let mut command = Command::new(bin("ctl")?);
        command.arg("--controller").arg(self.url()).args(args).env(MARKER, &self.marker);
        command.env_remove("TRAINYARD_TOKEN").env_remove("TRAINYARD_TOKEN_FILE").env("HOME", self.dir.path());
        if let Some(token) = token {
            command.env("TRAINYARD_TOKEN", token);
        }
        if let Some(pki) = &self.pki {
            command.env("TRAINYARD_CA", pki.join("ca.pem"));
        }
        command.output().context("run ctl")
    }

    /// Runs `ctl` and returns its stdout; fails with its stderr when it exits non-zero.
    pub fn ctl_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.ctl(args)?;
        if !out.status.success() {
            bail!("ctl {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The fleet table row of one node, as `ctl nodes -o json` shows it.
    pub fn node(&self, agent_id: &str) -> Result<serde_json::Value> {
        let nodes: serde_json::Value = serde_json::from_str(&self.ctl_ok(&["nodes", "-o", "json"])?)?;
        let rows = nodes.as_array().cloned().unwrap_or_default();
        rows.into_iter()
            .find(|n| n["agent_id"] == agent_id)
            .with_context(|| format!("node {agent_id} is not in `ctl nodes`: {nodes}"))
    }

    /// `GET`s (or `method`s) `path` from the controller's HTTP listener: (status, body).
    pub fn http(&self, method: &str, path: &str) -> Result<(u16, String)> {
        http(&self.http_addr, method, path)
    }

    /// The controller's HTTP listener address (web view, API, `/metrics`).
    pub fn http_addr(&self) -> &str {
        &self.http_addr
    }

    /// The agent's metrics listener address (every agent of a cluster serves one).
    pub fn agent_metrics_addr(&self, name: &str) -> Result<String> {
        wait_for_file(&self.path(&format!("agent-{name}.metrics")), Duration::from_secs(10))
    }

    /// Writes the spec of `job` and returns its path.
    pub fn python_job(&self, job: &PythonJob<'_>) -> PathBuf {
        let mut argv = vec![format!("{:?}", venv_python().display().to_string())];
        argv.extend(job.args.iter().map(|a| format!("{a:?}")));
        let env: String = job.env.iter().map(|(k, v)| format!("{k} = {v:?}\n")).collect();
        let source = job.source_dir.map(|d| format!("source_dir = {:?}\n", d.display().to_string()));
        let text = format!(
            "name = {:?}\n\n[resources]\ngpus = {}\ngpus_per_node = {}\n\n[engine]\nkind = \"exec\"\n\
             argv = [{}]\nworkdir = {:?}\n{}\n[env]\n{env}",
            job.name,
            job.gpus,
            job.per_node,
            argv.join(", "),
            job.workdir.display().to_string(),
            source.unwrap_or_default()
        );
        let path = self.path(&format!("{}.toml", job.name));
        std::fs::write(&path, text).expect("write job file");
        path
    }

    /// Writes a job spec running `examples/rank.py` with `args` and returns its path.
    pub fn job_file(&self, name: &str, gpus: u32, per_node: u32, args: &[&str], extra: &str) -> PathBuf {
        let mut argv = vec!["python3".to_string(), "examples/rank.py".to_string()];
        argv.extend(args.iter().map(|a| a.to_string()));
        let argv: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
        let text = format!(
            "name = {name:?}\n{extra}\n[resources]\ngpus = {gpus}\ngpus_per_node = {per_node}\n\n\
             [engine]\nkind = \"exec\"\nargv = [{}]\nworkdir = {:?}\n",
            argv.join(", "),
            repo_root().display().to_string()
        );
        let path = self.path(&format!("{name}.toml"));
        std::fs::write(&path, text).expect("write job file");
        path
    }

    /// The run directory of `job` under agent `agent`'s data directory
    /// (`runs/job-<id>-<cluster id>-<submitted ms>`; the newest submitted when a job id was
    /// given twice; `None` while there is none).
    pub fn run_dir(&self, agent: &str, job: u64) -> Option<PathBuf> {
        let runs = self.path(&format!("agent-{agent}/runs"));
        let prefix = format!("job-{job}-");
        let submitted = |name: &str| name.rsplit('-').next().and_then(|ms| ms.parse::<i64>().ok());
        std::fs::read_dir(&runs)
            .ok()?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| n.starts_with(&prefix) && !n.contains(".moved-"))
            .max_by_key(|n| submitted(n))
            .map(|n| runs.join(n))
    }

    /// Submits a job file with `ctl submit` and returns its id.
    pub fn submit(&self, file: &Path) -> Result<u64> {
        let out = self.ctl(&["submit", &file.display().to_string()])?;
        if !out.status.success() {
            bail!("ctl submit failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().with_context(|| format!("job id from ctl submit output {text:?}"))
    }

    /// Submits a job file with `ctl submit` presenting `token` (a user of a secure cluster).
    pub fn submit_as(&self, token: &str, file: &Path) -> Result<u64> {
        let out = self.ctl_as(Some(token), &["submit", &file.display().to_string()])?;
        if !out.status.success() {
            bail!("ctl submit failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    }

    /// The job as `ctl status JOB -o json` shows it.
    pub fn status(&self, job: u64) -> Result<serde_json::Value> {
        let out = self.ctl(&["status", &job.to_string(), "-o", "json"])?;
        if !out.status.success() {
            bail!("ctl status failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        serde_json::from_slice(&out.stdout).context("parse ctl status -o json")
    }

    /// Waits until the job's state is one of `states`; returns the job's status document.
    pub fn wait_state(&self, job: u64, states: &[&str], timeout: Duration) -> Result<serde_json::Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.status(job)?;
            let state = status["state"].as_str().unwrap_or_default().to_string();
            if states.contains(&state.as_str()) {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("job {job} still {state} after {timeout:?}, wanted {states:?}: {status}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until every rank of the job's current attempt shows `exited`; returns the status.
    /// (A rank's process can be gone a moment before its agent has sent its last receipts and
    /// its exit.)
    pub fn wait_ranks_exited(&self, job: u64, timeout: Duration) -> Result<serde_json::Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.status(job)?;
            let ranks = status["ranks"].as_array().cloned().unwrap_or_default();
            if !ranks.is_empty() && ranks.iter().all(|r| r["state"] == "exited") {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("job {job}: ranks not all exited after {timeout:?}: {status}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Path of the controller's SQLite database ([`Backend::Sqlite`]).
    pub fn db_path(&self) -> PathBuf {
        self.path("controller").join("trainyard.db")
    }

    /// Runs a query against the controller's database, whichever backend it is, and returns
    /// rows of integer columns. Write SQL both dialects accept (`COUNT(*) FILTER (WHERE ...)`,
    /// not `SUM(kind = 'step')`).
    pub fn query(&self, sql: &str) -> Result<Vec<Vec<i64>>> {
        self.query_cells(sql)
    }

    /// Like [`Cluster::query`], for text columns (NULL as "").
    pub fn query_text(&self, sql: &str) -> Result<Vec<Vec<String>>> {
        let rows: Vec<Vec<Option<String>>> = self.query_cells(sql)?;
        Ok(rows.into_iter().map(|r| r.into_iter().map(Option::unwrap_or_default).collect()).collect())
    }

    /// Runs a query on a fresh connection (read-only on SQLite) and decodes every cell as `T`.
    fn query_cells<T>(&self, sql: &str) -> Result<Vec<Vec<T>>>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>,
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let sql = sqlx::AssertSqlSafe(sql.to_string());
        rt.block_on(async {
            match &self.postgres {
                Some((_, url)) => {
                    let pool = sqlx::PgPool::connect(url).await?;
                    let rows = sqlx::query(sql).fetch_all(&pool).await;
                    pool.close().await;
                    cells(&rows?)
                }
                None => {
                    let url = format!("sqlite://{}?mode=ro", self.db_path().display());
                    let pool = sqlx::SqlitePool::connect(&url).await?;
                    let rows = sqlx::query(sql).fetch_all(&pool).await;
                    pool.close().await;
                    cells(&rows?)
                }
            }
        })
    }

    /// Pids of live processes (not zombies) whose environment carries this cluster's marker
    /// and that run the given program name (`python3` for ranks).
    pub fn live_processes(&self, comm_prefix: &str) -> Vec<u32> {
        marked_processes(&self.marker).into_iter().filter(|&pid| comm(pid).starts_with(comm_prefix)).collect()
    }

    /// Waits until `n` rank processes of this cluster are alive (a rank reported running may
    /// still be between fork and exec for a few milliseconds).
    pub fn wait_ranks_alive(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let alive = self.live_processes("python");
            if alive.len() == n {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} rank processes alive after {timeout:?}, expected {n}: {alive:?}", alive.len());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until every one of `ranks` ranks of the job has stored a step receipt.
    pub fn wait_first_steps(&self, job: u64, ranks: i64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let sql = format!("SELECT COUNT(DISTINCT rank) FROM receipts WHERE job_id = {job} AND kind = 'step'");
        loop {
            if self.query(&sql).is_ok_and(|rows| rows[0][0] == ranks) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("job {job}: not every rank stored a step receipt within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until no rank process of this cluster is alive.
    pub fn wait_no_ranks(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let alive = self.live_processes("python");
            if alive.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("rank processes still alive after {timeout:?}: {alive:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Contents of a daemon's log, for failure messages.
    pub fn logs(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{name}.log"))).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, mut child) in self.agents.drain() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.kill_controller();
        // Ranks and shims live in their own sessions; find them by the marker they inherited.
        for _ in 0..3 {
            let pids = marked_processes(&self.marker);
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                // SAFETY: kill(2) with a pid read from /proc; at worst the process is gone.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Every cell of `rows`, decoded as `T`.
fn cells<R: Row, T>(rows: &[R]) -> Result<Vec<Vec<T>>>
where
    T: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    let decoded = rows.iter().map(|row| (0..row.len()).map(|i| row.try_get::<T, _>(i)).collect());
    Ok(decoded.collect::<Result<Vec<Vec<T>>, sqlx::Error>>()?)
}

/// Live (non-zombie) processes whose environment has `MARKER=marker`.
fn marked_processes(marker: &str) -> Vec<u32> {
    let needle = format!("{MARKER}={marker}\0");
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|&pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            env.windows(needle.len()).any(|w| w == needle.as_bytes()) && !is_zombie(pid)
        })
        .collect()
}

fn is_zombie(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the parenthesised command name.
    stat.rsplit_once(") ").is_none_or(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X'))
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string()
}

fn wait_for_file(path: &Path, timeout: Duration) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && !text.trim().is_empty()
        {
            return Ok(text.trim().to_string());
        }
        if Instant::now() > deadline {
            bail!("{} did not appear within {timeout:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `trainyard-controller init-pki --dir DIR/pki [--san NAME]...`; the PKI directory.
fn init_pki(dir: &Path, sans: &[&str]) -> Result<PathBuf> {
    let pki = dir.join("pki");
    let mut command = Command::new(bin("trainyard-controller")?);
    command.args(["init-pki", "--dir"]).arg(&pki);
    for san in sans {
        command.args(["--san", san]);
    }
    let out = command.env(MARKER, dir.display().to_string()).output().context("run init-pki")?;
    if !out.status.success() {
        bail!("init-pki failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(pki)
}
