//! The web view in a real browser: headless Chromium loads every page against a running
//! cluster with a finished and a running job, and the rendered DOM is checked against the
//! store. Bad input to every endpoint is a 4xx with a message. With `TRAINYARD_SCREENSHOTS=DIR`
//! the pages are also saved as PNGs there (docs/screenshots/ holds the committed ones).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use trainyard_tests::{Cluster, browse, chromium, http_with};

/// Occurrences of `needle` in `haystack`.
fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

/// The inner HTML of the element whose opening tag contains `marker`, up to the next `</tag>`
/// of that element's kind (no nesting of the same tag inside: true for the page's tables).
fn element<'a>(dom: &'a str, marker: &str, tag: &str) -> &'a str {
    let Some(start) = dom.find(marker) else { return "" };
    let rest = &dom[start..];
    let end = rest.find(&format!("</{tag}>")).unwrap_or(rest.len());
    &rest[..end]
}

/// The rendered plot of `metric`: from its element to the next plot's.
fn plot<'a>(dom: &'a str, metric: &str) -> &'a str {
    let Some(start) = dom.find(&format!(r#"id="plot-{metric}""#)) else { return "" };
    let rest = &dom[start + 1..];
    &rest[..rest.find(r#"id="plot-"#).unwrap_or(rest.len())]
}

fn shot(name: &str) -> Option<PathBuf> {
    std::env::var_os("TRAINYARD_SCREENSHOTS").map(|dir| PathBuf::from(dir).join(format!("{name}.png")))
}

#[test]
fn every_page_renders_in_a_real_browser_with_the_stores_numbers() -> anyhow::Result<()> {
    if chromium().is_none() {
        println!("skipped: chromium is not installed (deploy/setup.sh installs it as root)");
        return Ok(());
    }
    let mut c = Cluster::start()?;
    c.start_agent("sxm-a", 8)?;
    c.start_agent("sxm-b", 8)?;
    let done_file = c.job_file("finished", 4, 4, &["--steps", "120", "--step-ms", "5"], "");
    let done = c.submit(&done_file)?;
    c.wait_state(done, &["succeeded"], Duration::from_secs(60))?;
    let running_file = c.job_file("running", 2, 2, &["--steps", "100000", "--step-ms", "40"], "");
    let running = c.submit(&running_file)?;
    c.wait_first_steps(running, 2, Duration::from_secs(30))?;
    std::thread::sleep(Duration::from_secs(3)); // past the rollups' settle time
    let base = format!("http://{}", c.http_addr);
    let budget = Duration::from_secs(8);

    let jobs = browse(&format!("{base}/"), budget, shot("jobs").as_deref())?;
    assert!(jobs.contains(r#"data-ready="1""#), "jobs page not ready: {jobs}");
    let table = element(&jobs, r#"id="jobs""#, "table");
    assert_eq!(count(table, "data-job-id="), 2, "{table}");
    assert!(table.contains(&format!(r#"data-job-id="{done}""#)) && table.contains("succeeded"), "{table}");
    assert!(table.contains("running"), "{table}");

    let page = browse(&format!("{base}/jobs/{done}"), budget, shot("job").as_deref())?;
    assert!(page.contains(r#"data-ready="1""#), "job page not ready: {page}");
    let events = c.query(&format!("SELECT COUNT(*) FROM job_events WHERE job_id = {done}"))?[0][0] as usize;
    assert_eq!(count(element(&page, r#"id="events""#, "table"), "data-at-ms="), events);
    assert_eq!(count(element(&page, r#"id="ranks""#, "table"), "data-rank="), 4);
    for metric in ["step_ms", "loss", "tokens_per_s"] {
        let drawn = plot(&page, metric);
        assert!(drawn.contains("<canvas"), "plot {metric} has no canvas: {drawn}");
    }
    assert!(page.contains(r#"id="diagnosis""#), "diagnosis section");
    // The diagnosis is the record `ctl diagnose -o json` prints; its stragglers come from its ranks.
    let diagnosis = element(&page, r#"id="diagnosis""#, "section");
    assert!(diagnosis.contains(r#"class="stragglers""#) && diagnosis.contains("healthy"), "{diagnosis}");

    let live = browse(&format!("{base}/jobs/{running}"), budget, None)?;
    if !live.contains(r#"data-ready="1""#) {
        let t = std::time::Instant::now();
        let api = http_with(&c.http_addr, "GET", &format!("/api/jobs/{running}"), &[]);
        let took = t.elapsed();
        let series =
            http_with(&c.http_addr, "GET", &format!("/api/jobs/{running}/series?metric=step_ms"), &[]);
        panic!("running job page not ready: {live}\nAPI ({took:?}): {api:?}\nseries: {series:?}");
    }
    assert!(plot(&live, "step_ms").contains("<canvas"));
    assert_eq!(count(element(&live, r#"id="ranks""#, "table"), "data-rank="), 2);

    let nodes = browse(&format!("{base}/nodes"), budget, shot("nodes").as_deref())?;
    assert!(nodes.contains(r#"data-ready="1""#));
    assert_eq!(count(element(&nodes, r#"id="nodes""#, "table"), "<tr data-node="), 2);
    assert!(nodes.contains(r#"class="matrix""#), "topology matrix");
    assert!(nodes.contains("NV18"), "the link codes of the host file");

    let compare =
        browse(&format!("{base}/compare?a={done}&b={running}"), budget, shot("compare").as_deref())?;
    assert!(compare.contains(r#"data-ready="1""#), "compare page not ready: {compare}");
    assert!(compare.contains(r#"id="verdict""#) && compare.contains(r#"id="compare""#));

    // The series the plots drew: every rank, points within the steps the store holds.
    let (status, body) =
        http_with(&c.http_addr, "GET", &format!("/api/jobs/{done}/series?metric=step_ms"), &[])?;
    assert_eq!(status, 200, "{body}");
    let series: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(series["ranks"].as_array().map(Vec::len), Some(4), "{series}");
    let stored = c.query(&format!(
        "SELECT MIN(step_time_ms), MAX(step_time_ms), MAX(step) FROM receipts WHERE job_id = {done} AND kind = 'step'"
    ));
    let points = series["ranks"][0]["points"].as_array().context("points")?;
    let last = points.last().context("a point")?;
    if let Ok(rows) = stored {
        assert!(last[0].as_f64().unwrap_or(-1.0) <= rows[0][2] as f64, "{last} beyond step {}", rows[0][2]);
    }
    c.ctl_ok(&["cancel", &running.to_string()])?;
    Ok(())
}

#[test]
fn bad_input_is_a_4xx_with_a_message_and_tokens_guard_the_api() -> anyhow::Result<()> {
    let mut c = Cluster::start_secure()?;
    c.start_agent("sxm-a", 2)?;
    let admin = format!("Bearer {}", c.token.clone().context("token")?);
    // The ranks run as `nobody` under root: a copy of rank.py where that account can read it.
    std::fs::copy(trainyard_tests::repo_root().join("examples/rank.py"), c.path("rank.py"))?;
    let spec = format!(
        "name = \"plain\"\n[resources]\ngpus = 1\ngpus_per_node = 1\n\n[engine]\nkind = \"exec\"\n\
         argv = [\"python3\", \"rank.py\", \"--steps\", \"20\", \"--step-ms\", \"1\"]\nworkdir = {:?}\n",
        c.dir.path().display().to_string()
    );
    std::fs::write(c.path("plain.toml"), spec)?;
    let job = c.submit(&c.path("plain.toml"))?;
    let ended = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(ended["state"], "succeeded", "{ended}");
    std::thread::sleep(Duration::from_secs(3)); // past the rollups' settle time
    let get = |path: &str, auth: Option<&str>| {
        let headers: Vec<(&str, &str)> = auth.map(|a| vec![("Authorization", a)]).unwrap_or_default();
        http_with(&c.http_addr, "GET", path, &headers)
    };
    let (status, body) = get("/api/jobs", None)?;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("no token"), "{body}");
    assert_eq!(get("/api/jobs", Some("Bearer tyt_wrong"))?.0, 401);
    assert_eq!(get("/api/jobs", Some(&admin))?.0, 200);
    let (status, page) = get("/", None)?;
    assert_eq!(status, 200, "the page itself is public; its data is not");
    assert!(page.contains("/assets/app.js"));
    let bob = c.add_user("bob", &["--unix-user", &trainyard_tests::run_account()])?;
    let (status, body) = get(&format!("/api/jobs/{job}"), Some(&format!("Bearer {bob}")))?;
    assert_eq!(status, 403, "bob may not see the admin's job: {body}");
    let bobs: serde_json::Value = serde_json::from_str(&get("/api/jobs", Some(&format!("Bearer {bob}")))?.1)?;
    assert_eq!(bobs["jobs"].as_array().map(Vec::len), Some(0));

    let s = format!("/api/jobs/{job}/series");
    let cases: Vec<(String, u16, &str)> = vec![
        ("/api/jobs/999".into(), 404, "job 999 not found"),
        ("/api/jobs/abc".into(), 400, "not a job id"),
        ("/api/jobs/99999999999999999999999".into(), 400, "not a job id"),
        ("/api/jobs/999/series?metric=loss".into(), 404, "not found"),
        (s.clone(), 400, "metric is required"),
        (format!("{s}?metric=nope"), 400, "unknown metric"),
        (format!("{s}?metric=loss&buckets=100000000"), 400, "out of range"),
        (format!("{s}?metric=loss&buckets=0"), 400, "out of range"),
        (format!("{s}?metric=loss&buckets=4001"), 400, "out of range"),
        (format!("{s}?metric=loss&to=1000000001"), 400, "out of range"),
        (format!("{s}?metric=loss&x={}", "y".repeat(4096)), 400, "query string is"),
        (format!("{s}?metric=loss&from=5&to=1"), 400, "after"),
        (format!("{s}?metric=loss&from=-1"), 400, "out of range"),
        (format!("{s}?metric=loss&to=1e99"), 400, "not a whole number"),
        (format!("{s}?metric=loss&to=99999999999999999999999999"), 400, "not a whole number"),
        (format!("{s}?metric=%zz"), 400, "malformed"),
        (format!("{s}?metric=loss&attempt=7"), 400, "out of range"),
        ("/api/compare".into(), 400, "two jobs"),
        (format!("/api/compare?a={job}&b=999"), 404, "not found"),
        ("/api/jobs?limit=abc".into(), 400, "not a whole number"),
        ("/assets/nope.js".into(), 404, "no asset"),
        ("/api/nothing".into(), 404, "no page"),
    ];
    for (path, want, says) in &cases {
        let (status, body) = get(path, Some(&admin))?;
        assert_eq!(status, *want, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body:?} should say {says:?}");
    }
    // Huge but valid ranges answer at once, with at most the points asked for.
    let (status, body) = get(&format!("{s}?metric=step_ms&from=0&to=1000000000&buckets=4000"), Some(&admin))?;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    assert!(v["ranks"][0]["points"].as_array().is_some_and(|p| !p.is_empty() && p.len() <= 4000), "{v}");
    let pid = c.controller_pid().context("controller")?;
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists(), "the controller is alive");
    Ok(())
}
