//! A real Slurm cluster for the tests (docs/slurm.md): `munged`, `slurmctld` and one `slurmd` per
//! host of a [`NetLab`], from Debian's packages (installed by `deploy/setup.sh`), configured here.
//!
//! - `munged` runs with a key and socket of this cluster's own (`AuthInfo=socket=...`), so the
//!   machine's own munge, if any, is never used or disturbed.
//! - `slurmctld` listens on the lab's bridge address in the test's namespace; `slurmd` runs as
//!   root inside each lab host's namespace as node `n<i>`, with `gpus` fake GPUs as `Gres`
//!   backed by device files (copies of `/dev/null`); jobs run as the unprivileged
//!   [`crate::run_account`]. `proctrack/linuxproc` and `task/none`: Slurm's cgroup v2 plugin
//!   does not run on these machines (cgroup v1 only), and nothing here needs the v1 one.
//! - `cred_expire=10`: a requeued job waits that long (120 s by default) before Slurm starts it
//!   again, as the nodes refuse its old, revoked credential until then.
//! - No accounting database: states come from `squeue`, `scontrol show job` and the
//!   job-completion log ([`SlurmLab::completed`]).
//!
//! Dropping it cancels every Slurm job, stops the daemons and kills whatever still runs in the
//! lab's namespaces (slurmstepd and the jobs' processes), also when a test panics.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::netlab::NetLab;

/// One test's Slurm cluster.
pub struct SlurmLab {
    dir: PathBuf,
    conf: PathBuf,
    daemons: Vec<Child>,
    namespaces: Vec<String>,
    nodes: usize,
}

/// Whether Slurm's daemons are installed here; prints `skipped: ...` (or fails under `CI`).
pub fn installed() -> bool {
    let have = |p: &str| Path::new(p).exists();
    if have("/usr/sbin/slurmctld")
        && have("/usr/sbin/slurmd")
        && have("/usr/sbin/munged")
        && have("/usr/bin/sbatch")
    {
        return true;
    }
    let why =
        "Slurm (slurmctld, slurmd, slurm-client) and munge are not installed; deploy/setup.sh installs them";
    assert!(std::env::var_os("CI").is_none(), "{why}: CI must run the Slurm tests");
    println!("skipped: {why}");
    false
}

/// A free TCP port on `ip`.
fn free_port(ip: std::net::Ipv4Addr) -> Result<u16> {
    Ok(std::net::TcpListener::bind((ip, 0))?.local_addr()?.port())
}

impl SlurmLab {
    /// Starts a cluster on every host of `lab` (node `n<i>` on host `i`, `gpus` GPUs each) with
    /// its files under `dir`, and waits until every node is idle. `extra` lines go into
    /// slurm.conf (e.g. `KillWait=5`).
    pub fn start(lab: &NetLab, dir: &Path, gpus: u32, extra: &str) -> Result<SlurmLab> {
        let dir = dir.join("slurm");
        for sub in ["munge", "state", "spool", "dev", "log"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        set_mode(&dir.join("munge"), 0o711)?;
        let key = dir.join("munge/key");
        let mut bytes = vec![0u8; 1024];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut bytes)?;
        std::fs::write(&key, bytes)?;
        set_mode(&key, 0o400)?;
        for g in 0..gpus {
            let dev = dir.join(format!("dev/gpu{g}"));
            let status = Command::new("mknod").arg(&dev).args(["c", "1", "3"]).status()?;
            ensure!(status.success(), "mknod {}", dev.display());
        }
        let conf = dir.join("slurm.conf");
        std::fs::write(&conf, slurm_conf(lab, &dir, gpus, extra)?)?;
        let last = lab.len().saturating_sub(1);
        let gres =
            format!("NodeName=n[0-{last}] Name=gpu File={}/dev/gpu[0-{}]\n", dir.display(), gpus.max(1) - 1);
        std::fs::write(dir.join("gres.conf"), gres)?;
        std::fs::write(dir.join("cgroup.conf"), "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")?;
        let namespaces = (0..lab.len()).map(|i| lab.host(i).ns.clone()).collect();
        let mut slurm = SlurmLab {
            dir: dir.clone(),
            conf: conf.clone(),
            daemons: Vec::new(),
            namespaces,
            nodes: lab.len(),
        };
        let log = |name: &str| -> Result<Stdio> {
            Ok(std::fs::File::create(dir.join(format!("log/{name}.out")))?.into())
        };
        let munged = Command::new("/usr/sbin/munged")
            .args(["-F", "-f"])
            .arg(format!("--socket={}", dir.join("munge/sock").display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--pid-file={}", dir.join("munge/pid").display()))
            .arg(format!("--seed-file={}", dir.join("munge/seed").display()))
            .arg(format!("--log-file={}", dir.join("log/munged.log").display()))
            .stdout(log("munged")?)
            .stderr(log("munged.err")?)
            .spawn()
            .context("start munged")?;
        slurm.daemons.push(munged);
        slurm.wait_for("munged's socket", Duration::from_secs(10), |s| s.dir.join("munge/sock").exists())?;
        let ctld = Command::new("/usr/sbin/slurmctld")
            .args(["-D", "-i", "-f"])
            .arg(&conf)
            .stdout(log("slurmctld")?)
            .stderr(log("slurmctld.err")?)
            .spawn()
            .context("start slurmctld")?;
        slurm.daemons.push(ctld);
        for i in 0..lab.len() {
            std::fs::create_dir_all(dir.join(format!("spool/n{i}")))?;
            let child = lab
                .command(i, Path::new("/usr/sbin/slurmd"))
                .args(["-D", "-N", &format!("n{i}"), "-f"])
                .arg(&conf)
                .stdout(log(&format!("slurmd-n{i}"))?)
                .stderr(log(&format!("slurmd-n{i}.err"))?)
                .spawn()
                .context("start slurmd")?;
            slurm.daemons.push(child);
        }
        slurm.wait_for("every Slurm node idle", Duration::from_secs(60), |s| {
            let out = s.client("sinfo").args(["-h", "-N", "-o", "%t"]).output();
            out.is_ok_and(|o| {
                let text = String::from_utf8_lossy(&o.stdout);
                text.lines().filter(|l| l.trim() == "idle").count() == s.nodes
            })
        })?;
        Ok(slurm)
    }

    /// The cluster's slurm.conf (what `SLURM_CONF` names for its clients).
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// A Slurm client command (`sbatch`, `squeue`, `scontrol`, ...) run as root, for this cluster.
    pub fn client(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `program` run as the unprivileged job user ([`crate::run_account`]) for this cluster, with
    /// `env` (and `PATH` kept): how a user on a login node runs `ctl`, `sbatch` or `scancel`.
    pub fn as_user(&self, program: &Path, env: &[(&str, String)]) -> Command {
        let mut c = Command::new("runuser");
        c.args(["-u", &crate::run_account(), "--", "env"]);
        c.arg(format!("SLURM_CONF={}", self.conf.display()));
        c.arg(format!("PATH={}", std::env::var("PATH").unwrap_or_default()));
        // sbatch passes the submitter's environment down to the agents it starts.
        c.arg(format!("{}=0", crate::DISK_FLOOR_PERCENT));
        for (name, value) in env {
            c.arg(format!("{name}={value}"));
        }
        c.arg(program);
        c
    }

    /// `program ARGS` as root; fails with its stderr.
    pub fn run(&self, program: &str, args: &[&str]) -> Result<String> {
        let out = self.client(program).args(args).output().with_context(|| format!("run {program}"))?;
        ensure!(
            out.status.success(),
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `JobState` of Slurm job `id` (`scontrol show job`), or `None` when Slurm forgot it.
    pub fn state(&self, id: u64) -> Option<String> {
        let out = self.client("scontrol").args(["show", "job", "-o", &id.to_string()]).output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split_whitespace().find_map(|f| f.strip_prefix("JobState=")).map(str::to_string)
    }

    /// The job-completion log's line of Slurm job `id`, once it ended.
    pub fn completed(&self, id: u64) -> Option<String> {
        let text = std::fs::read_to_string(self.dir.join("jobcomp.txt")).ok()?;
        let want = format!("JobId={id} ");
        text.lines().rev().find(|l| l.starts_with(&want)).map(str::to_string)
    }

    /// Waits until Slurm job `id` ended (its completion line is written); returns that line.
    pub fn wait_completed(&self, id: u64, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.completed(id) {
                return Ok(line);
            }
            ensure!(
                Instant::now() < deadline,
                "Slurm job {id} not ended within {timeout:?}: {:?}",
                self.state(id)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The pid of this cluster's `munged`, `slurmctld` or `slurmd-n<i>`.
    pub fn pid_of(&self, daemon: &str) -> Result<i32> {
        let at = match daemon {
            "munged" => 0,
            "slurmctld" => 1,
            other => {
                2 + other
                    .strip_prefix("slurmd-n")
                    .and_then(|n| n.parse::<usize>().ok())
                    .context("no such daemon")?
            }
        };
        Ok(self.daemons.get(at).context("no such daemon")?.id() as i32)
    }

    /// The daemons' logs, for a failing test's message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for name in ["slurmctld.log", "slurmd-n0.log", "slurmd-n1.log"] {
            let text = std::fs::read_to_string(self.dir.join("log").join(name)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            out.push_str(&format!("--- {name}\n"));
            for line in tail.into_iter().rev() {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// Host `i` dies: its `slurmd` and everything else running in its namespace (the agent, its
    /// ranks, Slurm's step daemons) are killed at once.
    pub fn kill_host(&mut self, i: usize) -> Result<()> {
        let child = self.daemons.get_mut(2 + i).context("no such node")?;
        child.kill()?;
        child.wait()?;
        kill_in_namespace(&self.namespaces[i]);
        Ok(())
    }

    fn wait_for(&self, what: &str, timeout: Duration, mut done: impl FnMut(&Self) -> bool) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !done(self) {
            if Instant::now() >= deadline {
                bail!("{what}: not within {timeout:?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }
}

impl Drop for SlurmLab {
    fn drop(&mut self) {
        let _ = self.client("scancel").args(["--full", "--user", &crate::run_account()]).output();
        let _ = self.client("scancel").args(["--full", "--user", "root"]).output();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let out = self.client("squeue").args(["-h", "-o", "%i"]).output();
            if out.is_ok_and(|o| o.stdout.iter().all(u8::is_ascii_whitespace)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        for child in self.daemons.iter_mut().rev() {
            // SAFETY: kill(2) on a daemon this lab started and has not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        for child in self.daemons.iter_mut().rev() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        for ns in &self.namespaces {
            kill_in_namespace(ns);
        }
    }
}

/// SIGKILL to every process in network namespace `ns` (what Slurm left there).
fn kill_in_namespace(ns: &str) {
    let Ok(target) = std::fs::metadata(format!("/var/run/netns/{ns}")) else { return };
    use std::os::unix::fs::MetadataExt as _;
    let Ok(entries) = std::fs::read_dir("/proc") else { return };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else { continue };
        if std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == target.ino()) {
            // SAFETY: kill(2) of a process in the test's own namespace.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| path.display().to_string())
}

fn slurm_conf(lab: &NetLab, dir: &Path, gpus: u32, extra: &str) -> Result<String> {
    let gateway = lab.gateway();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim().to_string();
    let d = dir.display();
    let mut text = format!(
        "ClusterName=tylab{pid}\nSlurmctldHost={host}({gateway})\nSlurmctldPort={ctld}\nSlurmdPort={slurmd}\n\
         AuthType=auth/munge\nAuthInfo=socket={d}/munge/sock,cred_expire=10\nCredType=cred/munge\nSlurmUser=root\nSlurmdUser=root\n\
         StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool/%n\nSlurmctldPidFile={d}/slurmctld.pid\n\
         SlurmdPidFile={d}/slurmd-%n.pid\nSlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd-%n.log\n\
         ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSchedulerType=sched/backfill\n\
         SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nReturnToService=2\nSlurmdTimeout=10\n\
         MpiDefault=none\nJobCompType=jobcomp/filetxt\nJobCompLoc={d}/jobcomp.txt\nGresTypes=gpu\nMinJobAge=300\n",
        pid = std::process::id(),
        ctld = free_port(gateway)?,
        slurmd = free_port(gateway)?,
    );
    text.push_str(extra);
    text.push('\n');
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let names: Vec<String> = (0..lab.len()).map(|i| format!("n{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        text.push_str(&format!(
            "NodeName={name} NodeAddr={} CPUs={cpus} RealMemory=1000 Gres=gpu:{gpus} State=UNKNOWN\n",
            lab.host(i).addr
        ));
    }
    text.push_str(&format!(
        "PartitionName=debug Nodes={} Default=YES MaxTime=INFINITE State=UP\n",
        names.join(",")
    ));
    Ok(text)
}

/// What `program` printed, as text (stdout, then stderr).
pub fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}
