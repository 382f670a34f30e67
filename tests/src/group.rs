//! More controllers of a cluster's group on its PostgreSQL: followers that take over (docs/ha.md).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};

use crate::{Cluster, bin};

/// A second controller of the group (a follower until it leads), killed when dropped.
pub struct Member {
    pub child: std::process::Child,
    /// Its gRPC URL and HTTP address.
    pub url: String,
    pub http: String,
    pub log: std::path::PathBuf,
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Member {
    /// Starts a controller with id `id` on the cluster's PostgreSQL, logging to `ID.log`;
    /// returns once it listens (a follower serves at once).
    pub fn start(c: &Cluster, id: &str) -> Result<Member> {
        Member::start_at(c, id, "127.0.0.1:0", &[])
    }

    /// [`Member::start`] listening for gRPC on `listen`, with `extra` flags.
    pub fn start_at(c: &Cluster, id: &str, listen: &str, extra: &[&str]) -> Result<Member> {
        let db = c.db_url().expect("postgres").to_string();
        let path = |ext: &str| c.path(&format!("{id}.{ext}"));
        let (addr_file, http_file, log) = (path("addr"), path("http"), path("log"));
        let child = Command::new(bin("trainyard-controller")?)
            .args(["--db", &db, "--listen", listen, "--http-listen", "127.0.0.1:0"])
            .args(extra)
            .args(["--controller-id", id, "--agent-timeout-secs", "30"])
            .arg("--addr-file")
            .arg(&addr_file)
            .arg("--http-addr-file")
            .arg(&http_file)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        let mut member = Member { child, url: String::new(), http: String::new(), log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while member.url.is_empty() || member.http.is_empty() {
            ensure!(Instant::now() < deadline, "the second controller did not listen: {}", member.logs());
            member.url = std::fs::read_to_string(&addr_file)
                .map(|a| format!("http://{}", a.trim()))
                .unwrap_or_default();
            member.http =
                std::fs::read_to_string(&http_file).map(|a| a.trim().to_string()).unwrap_or_default();
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(member)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until its log says `line`; the time it took.
    pub fn wait_log(&self, line: &str, timeout: Duration) -> Result<Duration> {
        let started = Instant::now();
        while !self.logs().contains(line) {
            ensure!(started.elapsed() < timeout, "no {line:?} within {timeout:?}: {}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(started.elapsed())
    }

    /// Its `/healthz` body.
    pub fn health(&self) -> Result<String> {
        Ok(crate::http(&self.http, "GET", "/healthz")?.1)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}
