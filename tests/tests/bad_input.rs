//! Bad input is refused with an error naming what is wrong, and nothing is stored for it.

use std::time::Duration;

use trainyard_tests::Cluster;

/// Submits `spec` and returns ctl's stderr; asserts ctl failed.
fn rejected(c: &Cluster, name: &str, spec: &str) -> anyhow::Result<String> {
    let path = c.path(&format!("{name}.toml"));
    std::fs::write(&path, spec)?;
    let out = c.ctl(&["submit", &path.display().to_string()])?;
    assert!(
        !out.status.success(),
        "{name}: ctl submit should fail, printed {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(String::from_utf8_lossy(&out.stderr).into_owned())
}

fn spec(resources: &str, engine_extra: &str, workdir: &str, env: &str) -> String {
    format!(
        "name = \"bad\"\n[resources]\n{resources}\n[engine]\nkind = \"exec\"\nargv = [\"true\"]\n\
         workdir = {workdir:?}\n{engine_extra}\n{env}\n"
    )
}

#[test]
fn bad_specs_are_rejected_naming_the_field() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 8)?;
    c.start_agent("node-b", 8)?;
    // The fleet must be known before "more GPUs than the fleet has" means anything.
    let ok = c.job_file("probe", 1, 0, &["--steps", "1", "--step-ms", "1"], "");
    let probe = c.submit(&ok)?;
    c.wait_state(probe, &["succeeded"], Duration::from_secs(60))?;

    let cases = [
        ("unknown", spec("gpus = 1\ncolour = \"red\"", "", "/tmp", ""), "colour"),
        ("zero", spec("gpus = 0", "", "/tmp", ""), "resources.gpus"),
        ("toomany", spec("gpus = 64", "", "/tmp", ""), "the fleet has 16"),
        ("relative", spec("gpus = 1", "", "runs/here", ""), "engine.workdir"),
        ("envname", spec("gpus = 1", "", "/tmp", "[env]\n\"BAD NAME\" = \"1\""), "env.BAD NAME"),
    ];
    for (name, text, needle) in cases {
        let err = rejected(&c, name, &text)?;
        assert!(err.contains(needle), "{name}: error should mention {needle:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: one line for a person: {err}");
    }
    let jobs = c.query("SELECT COUNT(*) FROM jobs")?;
    assert_eq!(jobs[0][0], 1, "only the probe job was stored");
    Ok(())
}

#[test]
fn garbage_receipt_lines_are_skipped_and_counted() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let file = c.job_file("garbage", 2, 0, &["--steps", "10", "--step-ms", "10", "--garbage"], "");
    let job = c.submit(&file)?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    let rows = c.query(&format!(
        "SELECT rank, SUM(kind = 'step') FROM receipts WHERE job_id = {job} GROUP BY rank ORDER BY rank"
    ))?;
    assert_eq!(rows, vec![vec![0, 10], vec![1, 10]], "valid receipts still arrive");
    for r in status["ranks"].as_array().unwrap() {
        assert_eq!(r["skipped_lines"], 3, "a non-JSON line, invalid UTF-8 and a 10 MB line: {r}");
    }
    Ok(())
}
