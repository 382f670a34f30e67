//! `ctl logs`: a rank's stdout and stderr read by its agent through the controller, after the
//! job ended, as a tail, followed live until the rank ends, and a clear error when the rank or
//! the node is not there.

use std::path::PathBuf;
use std::time::Duration;

use trainyard_tests::Cluster;

fn sh_job(c: &Cluster, name: &str, ranks: u32, script: &str) -> PathBuf {
    let text = format!(
        "name = {name:?}\n\n[resources]\ngpus = {ranks}\n\n[engine]\nkind = \"exec\"\n\
         argv = [\"sh\", \"-c\", {script:?}]\nworkdir = {:?}\n",
        c.path("").display().to_string()
    );
    let path = c.path(&format!("{name}.toml"));
    std::fs::write(&path, text).expect("write job file");
    path
}

fn logs(c: &Cluster, args: &[&str]) -> anyhow::Result<(bool, String, String)> {
    let mut all = vec!["logs"];
    all.extend_from_slice(args);
    let out = c.ctl(&all)?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    ))
}

#[test]
fn logs_of_an_ended_job_a_tail_and_bad_requests() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 2)?;
    let script = "for i in 1 2 3 4 5; do echo \"out $RANK $i\"; echo \"err $RANK $i\" >&2; done";
    let job = c.submit(&sh_job(&c, "chatty", 2, script))?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    let id = job.to_string();

    let (ok, out, err) = logs(&c, &[&id, "--rank", "1"])?;
    assert!(ok, "{err}");
    assert_eq!(out, (1..=5).map(|i| format!("out 1 {i}\n")).collect::<String>());
    assert_eq!(err, (1..=5).map(|i| format!("err 1 {i}\n")).collect::<String>());

    let (ok, out, _) = logs(&c, &[&id, "--tail", "2"])?;
    assert!(ok);
    assert_eq!(out, "out 0 4\nout 0 5\n", "the last 2 lines of rank 0's stdout");

    let (ok, _, err) = logs(&c, &[&id, "--rank", "7"])?;
    assert!(!ok);
    assert!(err.contains(&format!("job {job} has ranks 0 to 1; there is no rank 7")), "{err}");
    let (ok, _, err) = logs(&c, &["99"])?;
    assert!(!ok && err.contains("99"), "{err}");

    // The node is gone: the error says where the files are.
    c.kill_agent("a");
    std::thread::sleep(Duration::from_millis(500));
    let (ok, _, err) = logs(&c, &[&id])?;
    assert!(!ok);
    let run = c.run_dir("a", job).expect("the job's run directory");
    let dir = format!("runs/{}/attempt-0/rank-0/", run.file_name().unwrap().to_string_lossy());
    assert!(err.contains("node a is not connected") && err.contains(&dir), "{err}");
    Ok(())
}

/// `--follow` prints output as the rank writes it and returns by itself once the rank ends.
#[test]
fn follow_streams_until_the_rank_ends() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 1)?;
    let script = "for i in 1 2 3 4 5 6; do echo \"tick $i\"; sleep 0.3; done";
    let job = c.submit(&sh_job(&c, "ticker", 1, script))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    let started = std::time::Instant::now();
    let (ok, out, err) = logs(&c, &[&job.to_string(), "--follow"])?;
    assert!(ok, "{err}");
    assert_eq!(out, (1..=6).map(|i| format!("tick {i}\n")).collect::<String>());
    assert!(started.elapsed() < Duration::from_secs(30), "follow ended with the rank");
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(30))?;
    assert_eq!(status["state"], "succeeded");
    Ok(())
}

/// A job id that a restored (here: a new) database gives again meets nothing of the old job on
/// the node: its logs are its own, and the old job's files stay where they were, untouched.
/// (Before, the run directory was `runs/job-<id>`: the new job's output was appended to the
/// old one's and `ctl logs` showed both.)
#[test]
fn a_repeated_job_id_never_sees_the_old_jobs_files() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 1)?;
    let first = c.submit(&sh_job(&c, "first", 1, "echo the-first-users-output"))?;
    c.wait_state(first, &["succeeded"], Duration::from_secs(60))?;
    let old = c.run_dir("a", first).expect("the first job's run directory");

    c.kill_controller();
    std::fs::remove_dir_all(c.path("controller"))?;
    c.start_controller()?;
    c.wait_agent_connected("a", Duration::from_secs(30))?;
    let second = c.submit(&sh_job(&c, "second", 1, "echo the-second-users-output"))?;
    assert_eq!(second, first, "the new database numbers its jobs from the start again");
    c.wait_state(second, &["succeeded"], Duration::from_secs(60))?;

    let (ok, out, err) = logs(&c, &[&second.to_string()])?;
    assert!(ok, "{err}");
    assert_eq!(out, "the-second-users-output\n", "only the new job's output");
    let new = c.run_dir("a", second).expect("the second job's run directory");
    assert_ne!(new, old, "a run directory of its own");
    let kept = std::fs::read_to_string(old.join("attempt-0/rank-0/stdout.log"))?;
    assert_eq!(kept, "the-first-users-output\n", "the old job's files are untouched");
    Ok(())
}
