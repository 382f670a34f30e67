//! A shared node: a job's processes end with the job, whatever they did to get away (`setsid`,
//! a double fork), and the job's limits hold, through real agents and real cgroups (cgroup2
//! membership and kill, cgroup v1 limits on this project's machines). The cgroup tests need
//! root; elsewhere they say skipped, and in CI (root there) a test that cannot run fails.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use trainyard_tests::{Cluster, host_file, root_or_skip};

/// A job of one rank running `script` under `sh -c`, with `resources` added to its table.
fn sh_job(c: &Cluster, name: &str, script: &str, resources: &str) -> PathBuf {
    let text = format!(
        "name = {name:?}\n\n[resources]\ngpus = 1\n{resources}\n\n[engine]\nkind = \"exec\"\n\
         argv = [\"sh\", \"-c\", {script:?}]\nworkdir = \"/tmp\"\n"
    );
    let path = c.path(&format!("{name}.toml"));
    std::fs::write(&path, text).expect("write job file");
    path
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(')').next().and_then(|r| r.split_whitespace().next()) != Some("Z"))
}

fn wait_dead(pid: u32, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    while alive(pid) {
        if Instant::now() > deadline {
            bail!("process {pid} is still alive after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn read_pid(path: &Path, within: Duration) -> Result<u32> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && let Ok(pid) = text.trim().parse()
        {
            return Ok(pid);
        }
        if Instant::now() > deadline {
            bail!("no pid in {} after {within:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The agent's exit receipt of the job's rank 0: (processes, leftover_killed, cpu_ms).
fn exit_receipt(c: &Cluster, job: u64) -> Result<Vec<String>> {
    let rows = c.query_text(&format!(
        "SELECT json_extract(body, '$.processes'), CAST(json_extract(body, '$.leftover_killed') AS TEXT), \
         CAST(json_extract(body, '$.cpu_ms') AS TEXT), json_extract(body, '$.status') FROM receipts \
         WHERE job_id = {job} AND kind = 'exit' AND json_extract(body, '$.producer') = 'trainyard agent (rank end)'"
    ))?;
    rows.into_iter().next().context("the agent's exit receipt")
}

/// A rank that starts a child in a session of its own and exits 0: the child dies with the
/// rank, in its cgroup (root) and under its shim as a child subreaper (any user). Before, it
/// kept running after its job succeeded, as the user, with the job's GPU and variables.
#[test]
fn a_detached_child_ends_with_its_rank() -> Result<()> {
    let modes: &[&str] = if root_or_skip("cgroups need root; the subreaper half runs") {
        &["auto", "subreaper"]
    } else {
        &["subreaper"]
    };
    for mode in modes {
        let mut c = Cluster::start()?;
        let host = host_file(&c.path(""), "node-a", 1);
        c.start_agent_env("node-a", &host, &[("TRAINYARD_PROCESS_TRACKING", mode)])?;
        let pidfile = c.path("detached.pid");
        let script = format!("setsid sleep 300 & echo $! > {}; sleep 0.3", pidfile.display());
        let job = c.submit(&sh_job(&c, "escape", &script, ""))?;
        let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
        assert_eq!(status["state"], "succeeded", "{mode}: {status}");
        let detached = read_pid(&pidfile, Duration::from_secs(5))?;
        wait_dead(detached, Duration::from_secs(5)).with_context(|| format!("{mode}: the setsid child"))?;
        let receipt = exit_receipt(&c, job)?;
        let held = if *mode == "auto" { "cgroup" } else { "subreaper" };
        assert_eq!(
            (receipt[0].as_str(), receipt[1].as_str(), receipt[3].as_str()),
            (held, "1", "ok"),
            "{mode}"
        );
        if *mode == "auto" {
            assert!(
                receipt[2].parse::<u64>().is_ok(),
                "the exit receipt counts the rank's CPU time: {receipt:?}"
            );
        }
    }
    Ok(())
}

/// A cancel takes every process of the job, the detached ones included, within the grace.
#[test]
fn a_cancel_takes_every_process_of_the_job() -> Result<()> {
    if !root_or_skip("cgroups need root") {
        return Ok(());
    }
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 1)?;
    let pidfile = c.path("detached.pid");
    let script =
        format!("setsid sh -c 'trap \"\" TERM; sleep 300' & echo $! > {}; exec sleep 300", pidfile.display());
    let job = c.submit(&sh_job(&c, "stubborn", &script, ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(30))?;
    let detached = read_pid(&pidfile, Duration::from_secs(10))?;
    assert!(alive(detached));
    c.ctl_ok(&["cancel", &job.to_string()])?;
    c.wait_state(job, &["cancelled"], Duration::from_secs(30))?;
    // The cluster's cancel grace is 3 s; the child ignores SIGTERM and is outside the group.
    wait_dead(detached, Duration::from_secs(10)).context("the detached child that ignores SIGTERM")?;
    Ok(())
}

/// `[resources] max_processes` and `memory_limit_gib` hold on the node: a fork bomb stops at
/// the limit, and a rank that allocates past the memory limit is killed, its job failing.
#[test]
fn a_jobs_limits_hold_on_its_node() -> Result<()> {
    if !root_or_skip("cgroups need root") {
        return Ok(());
    }
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 1)?;
    // Without the limit the rank starts its 64 children; with max_processes = 16 the 16th fork
    // fails inside the job (dash says "Cannot fork" and gives up, exit code 2).
    let forks = "for i in $(seq 64); do sleep 30 & done; kill $(jobs -p) 2>/dev/null; exit 0";
    for (limit, capped) in [("", false), ("max_processes = 16", true)] {
        let job = c.submit(&sh_job(&c, "forks", forks, limit))?;
        let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
        let want = if capped { "failed" } else { "succeeded" };
        assert_eq!(status["state"], want, "{limit:?}: {status}");
        let out = c.ctl(&["logs", &job.to_string()])?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.contains("fork"), capped, "{limit:?}: the rank's stderr: {stderr}");
    }

    let hog = "python3 -c 'b = bytearray(700 << 20); print(len(b))'";
    let job = c.submit(&sh_job(&c, "hog", hog, "memory_limit_gib = 0.5"))?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "failed", "700 MiB under a 512 MiB limit: {status}");
    let fine = "python3 -c 'b = bytearray(100 << 20); print(len(b))'";
    let job = c.submit(&sh_job(&c, "fits", fine, "memory_limit_gib = 0.5"))?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "100 MiB under a 512 MiB limit: {status}");
    Ok(())
}

/// The controller's SQLite data directory and database files are private whatever the umask
/// of whoever started it: they hold every job's spec, its users and their token hashes.
#[test]
fn the_controllers_database_is_private_whatever_the_umask() -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    use std::os::unix::process::CommandExt as _;
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let addr = dir.path().join("addr");
    let mut command = std::process::Command::new(trainyard_tests::bin("trainyard-controller")?);
    command
        .arg("--data-dir")
        .arg(&data)
        .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--addr-file"])
        .arg(&addr)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: umask is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    let mut child = command.spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !addr.exists() || std::fs::read_to_string(&addr)?.trim().is_empty() {
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("the controller never wrote its address");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mode = |p: &Path| std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777);
    let modes = (mode(&data)?, mode(&data.join("trainyard.db"))?, mode(&data.join("trainyard.db-wal"))?);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(modes, (0o700, 0o600, 0o600), "data directory, database, its WAL under umask 0");
    Ok(())
}

/// The loopback demo lets a call without a token in only from the account that started the
/// controller: `nobody` on the same host is refused, on gRPC (`ctl`) and on HTTP. A web page of
/// another site that rebinds its name to 127.0.0.1 is refused by `Host`. (Before, `nobody`
/// submitted a job without a token on a root-run demo and it ran as uid 0.)
#[test]
fn the_loopback_demo_answers_only_its_owner_and_only_loopback_names() -> Result<()> {
    use std::io::{Read as _, Write as _};
    use std::os::unix::process::CommandExt as _;
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 1)?;
    let job = sh_job(&c, "owners", "true", "");
    let owner = c.submit(&job)?;
    c.wait_state(owner, &["succeeded"], Duration::from_secs(60))?;

    // HTTP: a rebinding page's Host is refused whoever sends it.
    let mut stream = std::net::TcpStream::connect(c.http_addr())?;
    write!(stream, "GET /api/jobs HTTP/1.1\r\nHost: attacker.example:7071\r\nConnection: close\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("only requests for localhost"), "{answer}");
    let (status, _) = c.http("GET", "/api/jobs")?;
    assert_eq!(status, 200, "the owner's own browser");

    if !root_or_skip("calling as another account needs root") {
        return Ok(());
    }
    // gRPC: `ctl` as nobody, without a token.
    std::fs::set_permissions(c.path(""), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    std::fs::set_permissions(&job, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    let out = std::process::Command::new(trainyard_tests::bin("ctl")?)
        .args(["--controller", &c.url(), "submit"])
        .arg(&job)
        .uid(65534)
        .gid(65534)
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "nobody submitted without a token: {err}");
    assert!(err.contains("only from the account that started it"), "{err}");
    let jobs = c.query("SELECT COUNT(*) FROM jobs")?;
    assert_eq!(jobs[0][0], 1, "nothing was stored for nobody");
    // HTTP: curl-like, as nobody.
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import urllib.request, urllib.error\ntry:\n urllib.request.urlopen('http://{}/api/jobs')\nexcept urllib.error.HTTPError as e:\n print(e.code)",
            c.http_addr()
        ))
        .uid(65534)
        .gid(65534)
        .output()?;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "401",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Unmounts a test's file system when dropped (after the cluster using it is gone).
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// One rank fills a small real file system (a 48 MiB tmpfs) with its output while another
/// job's rank runs on the same node, whose state and exit files live there too. The other job
/// still ends as it should (not "supervisor vanished"), its exit status read; the writer's own
/// rank is never blocked or failed by the full disk, its loss counted in its exit receipt; no
/// node is blamed. (Before, the other job failed, the node was blamed, and the writer's next
/// attempt hung in `launching`.)
#[test]
fn a_rank_that_fills_the_disk_harms_no_other_job() -> Result<()> {
    if !root_or_skip("mounting a small file system needs root") {
        return Ok(());
    }
    let small = tempfile::tempdir()?;
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=48m,mode=0755", "tmpfs"])
        .arg(small.path())
        .status()?;
    anyhow::ensure!(status.success(), "mount a tmpfs at {}", small.path().display());
    let _mounted = Mounted(small.path().to_path_buf());
    let mut c = Cluster::start()?;
    std::os::unix::fs::symlink(small.path(), c.path("agent-node-a"))?;
    let host = host_file(&c.path(""), "node-a", 2);
    c.start_agent_env(
        "node-a",
        &host,
        &[("TRAINYARD_DISK_FLOOR_MIB", "1"), (trainyard_tests::DISK_FLOOR_PERCENT, "5")],
    )?;

    let other = c.submit(&sh_job(&c, "other", "sleep 4; echo other-done", ""))?;
    c.wait_state(other, &["running"], Duration::from_secs(30))?;
    let filler =
        c.submit(&sh_job(&c, "filler", "head -c 100000000 /dev/zero | tr '\\0' x; echo filler-done", ""))?;
    let status = c.wait_state(filler, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "the writer is not failed by its own full disk: {status}");
    let status = c.wait_state(other, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "the other job ends as it should: {status}");
    // The writer's output filled the file system down to its floor (5 % of 48 MiB), where the
    // shim stops writing output so the agent's records and exit statuses keep their room.
    let (free, size) = disk(small.path())?;
    assert!(free < size / 20 + (4 << 20), "the file system really filled: {free} bytes free");

    let dropped = c.query_text(&format!(
        "SELECT CAST(json_extract(body, '$.output_dropped_bytes') AS TEXT) FROM receipts WHERE job_id = {filler} \
         AND kind = 'exit' AND NOT {}",
        trainyard_tests::RANK_WRITTEN
    ))?;
    let dropped: u64 =
        dropped.first().and_then(|r| r[0].parse().ok()).context("the writer's exit receipt")?;
    assert!(dropped > 50_000_000, "the loss is counted: {dropped} bytes");
    for job in [filler, other] {
        let failures = c.status(job)?["failures"].as_array().cloned().unwrap_or_default();
        assert!(failures.is_empty(), "no failure, so no node blamed: {failures:?}");
    }
    let node = c.node("node-a")?;
    assert!(node["cordon_by"].is_null() || node["cordon_by"] == "", "{node}");
    c.kill_agent("node-a");
    Ok(())
}

fn disk(dir: &Path) -> Result<(u64, u64)> {
    let out = std::process::Command::new("df").args(["-B1", "--output=avail,size"]).arg(dir).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().nth(1).context("df output")?;
    let mut f = line.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
    Ok((f.next().unwrap_or(0), f.next().unwrap_or(0)))
}

/// A rank that writes receipts without end stops being stored at its job's quota: the rest are
/// acknowledged but dropped, counted, and shown on the job; the job itself runs on, and another
/// job is not held back. (Before, one rank grew the database by ~20 MB/s without bound.)
#[test]
fn receipts_past_a_jobs_quota_are_dropped_counted_and_shown() -> Result<()> {
    let mut c = Cluster::start_with(&[("--receipt-quota-job-mib", "1")])?;
    c.start_agent("node-a", 2)?;
    // ~2.4 MB of step receipts: over a quota of 1 MiB.
    let flood = "i=0; while [ $i -lt 20000 ]; do echo \"{\\\"kind\\\":\\\"step\\\",\\\"step\\\":$i,\\\"step_time_ms\\\":1.0,\\\"pad\\\":\\\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\\\"}\"; i=$((i+1)); done >> $TRAINYARD_RECEIPTS";
    let big = c.submit(&sh_job(&c, "flood", flood, ""))?;
    let small = c.submit(&sh_job(
        &c,
        "small",
        "echo '{\"kind\":\"step\",\"step\":0,\"step_time_ms\":1}' >> $TRAINYARD_RECEIPTS",
        "",
    ))?;
    for job in [big, small] {
        let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(120))?;
        assert_eq!(status["state"], "succeeded", "{status}");
    }
    let stored = c.query_text(&format!(
        "SELECT CAST(COUNT(*) AS TEXT), CAST(COALESCE(SUM(length(body)), 0) AS TEXT) FROM receipts WHERE job_id = {big} AND kind = 'step'"
    ))?;
    let (count, bytes): (u64, u64) = (stored[0][0].parse()?, stored[0][1].parse()?);
    assert!(bytes <= 1 << 20 && count > 5_000 && count < 20_000, "{count} receipts, {bytes} bytes stored");
    let status = c.status(big)?;
    let warnings = status["warnings"].to_string();
    assert!(
        warnings.contains("were dropped, not stored") && warnings.contains("reached its quota of 1.0 MiB"),
        "{status}"
    );
    let events = status["events"].to_string();
    assert!(events.contains("receipts dropped from now on, not stored"), "an event of the job: {events}");
    let small_steps =
        c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {small} AND kind = 'step'"))?;
    assert_eq!(small_steps[0][0], 1, "another job is not held back");
    Ok(())
}

/// A GPU another process computes on, by the driver's account, is never given to a rank: the
/// launch is refused naming the process, the job fails saying so, and once the process is gone
/// the next job runs there. This machine has no GPU, so a file stands in for NVML's list
/// (`--gpu-processes script:FILE`); the agent reads it where it would ask the driver.
#[test]
fn a_gpu_another_process_computes_on_is_not_given_to_a_rank() -> Result<()> {
    let mut c = Cluster::start()?;
    let held = c.path("gpu-processes.json");
    let mut squatter = std::process::Command::new("sleep").arg("120").spawn()?;
    std::fs::write(&held, format!(r#"{{"0": [{}]}}"#, squatter.id()))?;
    let host = host_file(c.dir.path(), "node-a", 1);
    let source = format!("script:{}", held.display());
    c.start_agent_env("node-a", &host, &[("TRAINYARD_GPU_PROCESSES", &source)])?;
    let blocked = c.submit(&sh_job(&c, "blocked", "true", ""))?;
    let status = c.wait_state(blocked, &["failed", "succeeded", "cancelled"], Duration::from_secs(60))?;
    let said = format!("GPU 0 is in use by process {} (sleep, uid", squatter.id());
    let text = status.to_string();
    let _ = squatter.kill();
    let _ = squatter.wait();
    anyhow::ensure!(status["state"] == "failed" && text.contains(&said), "{status:#}");
    std::fs::write(&held, "{}")?;
    let after = c.submit(&sh_job(&c, "after", "true", ""))?;
    let status = c.wait_state(after, &["failed", "succeeded", "cancelled"], Duration::from_secs(60))?;
    anyhow::ensure!(status["state"] == "succeeded", "once the process is gone: {status:#}");
    Ok(())
}
