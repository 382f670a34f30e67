//! Several controllers (docs/architecture.md): SQLite serves one, so a second controller pointed
//! at the same SQLite file refuses to start and says why and what to use instead; the first
//! keeps serving. A controller killed with SIGKILL leaves no claim behind.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use trainyard_tests::{Cluster, bin};

/// Runs a second `trainyard-controller` on `data_dir`; (exit code, stderr) once it exits.
fn second_controller(data_dir: &std::path::Path) -> Result<(Option<i32>, String)> {
    let mut child = Command::new(bin("trainyard-controller")?)
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--listen", "127.0.0.1:0", "--http-listen", "off"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait()? {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)?;
            return Ok((status.code(), err));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("a second controller on the same SQLite file kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_second_controller_on_the_same_sqlite_file_refuses_to_start() -> Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let pid = c.controller_pid().expect("running");
    let (code, err) = second_controller(&c.path("controller"))?;
    ensure!(code == Some(1), "exit code {code:?}: {err}");
    ensure!(
        err.contains(&format!("another trainyard-controller (pid {pid}) already uses the SQLite database"))
            && err.contains("SQLite serves one controller")
            && err.contains("--db postgres://"),
        "{err}"
    );
    // The first one serves on.
    let job = c.submit(&c.job_file("still", 2, 2, &["--steps", "5", "--step-ms", "10"], ""))?;
    c.wait_state(job, &["succeeded"], Duration::from_secs(60))?;
    // Killed, it leaves no claim: a new controller starts on the same file.
    c.kill_controller();
    c.start_controller()?;
    ensure!(c.ctl_ok(&["status", &job.to_string()])?.contains("succeeded"));
    Ok(())
}
