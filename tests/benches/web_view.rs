//! The web view on a big job: 100,000 steps x 64 ranks (6.4 million step receipts).
//!
//! Targets (docs/web.md): the job page renders in under 2 s and its data endpoint answers in
//! under 300 ms. Builds the job's receipts straight into a SQLite store (as ingest would store
//! them, a rank slow and a few spikes included), folds them into the plot rollups, starts a real
//! controller on that store, then measures:
//! - `GET /api/jobs/1/series?metric=step_ms&buckets=800` (the job page's biggest request: 64
//!   ranks) and a zoomed window, median and p90 of 15 requests each;
//! - the job page in headless Chromium, in real time (`controller/web/dev/probe.py`: until the
//!   page's `data-ready`), median of 5 loads.
//!
//! Every run writes its figures to `docs/results/web_view-<date>.jsonl`
//! ([`trainyard_tests::results`]): one line for building the store, one per request measured,
//! one for the page render, then the summary.
//!
//! Run: `cargo bench -p trainyard-tests --bench web_view`
//! (`-- --steps N` for a smaller job).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};
use trainyard_model::receipts;
use trainyard_model::spec::{JobSpec, Resources};
use trainyard_store::{JobStore, NewReceipt, RankId, ReceiptStore, SeriesStore, SqlStore};
use trainyard_tests::results::{Results, results_dir};
use trainyard_tests::{bin, chromium, http_with, repo_root};

const RANKS: u32 = 64;

fn median(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[(v.len() - 1) * 9 / 10])
}

fn step_receipt(rank: u32, step: i64) -> NewReceipt {
    // Rank 37 is 20 % slower; every 997th step of rank 5 spikes; checkpoints every 5,000 steps.
    let mut ms = 600.0 + ((step * 7 + i64::from(rank) * 13) % 17) as f64;
    if rank == 37 {
        ms *= 1.2;
    }
    if rank == 5 && step % 997 == 0 {
        ms = 4_000.0;
    }
    if step % 5_000 == 4_999 {
        ms += 2_500.0;
    }
    let loss = 3.0 + 8.0 / (1.0 + step as f64 / 500.0);
    let body = format!(
        r#"{{"kind":"step","step":{step},"step_time_ms":{ms:.3},"loss":{loss:.4},"tokens_per_s":{:.1},"mfu":{:.4}}}"#,
        524_288.0 * 1000.0 / ms,
        0.45 * 600.0 / ms
    );
    let checked = receipts::check("step", &body).expect("a JSON object");
    NewReceipt {
        id: RankId { job_id: 1, attempt: 0, rank },
        seq: step as u64,
        kind: "step".into(),
        step: Some(step),
        body,
        problem: checked.problem,
        metrics: checked.metrics,
    }
}

/// What building the store took.
struct Built {
    stored: u64,
    store_s: f64,
    folded: u64,
    fold_s: f64,
}

async fn build_store(dir: &std::path::Path, steps: i64) -> anyhow::Result<Built> {
    std::fs::create_dir_all(dir)?;
    let store = SqlStore::open_sqlite_file(&dir.join("trainyard.db")).await?;
    let spec = JobSpec {
        resources: Resources { gpus: RANKS, gpus_per_node: 8, ..Default::default() },
        ..JobSpec::exec("d26-64gpu", RANKS, &["python3", "train.py"])
    };
    let job = store.create_job(&spec, None, "submitted", 1).await?;
    anyhow::ensure!(job.id == 1, "a fresh store");
    let started = Instant::now();
    let chunk = 250;
    let mut stored = 0u64;
    for first in (0..steps).step_by(chunk) {
        let batch: Vec<NewReceipt> = (first..(first + chunk as i64).min(steps))
            .flat_map(|s| (0..RANKS).map(move |r| step_receipt(r, s)))
            .collect();
        stored += store.insert_receipts(&batch, 1_000 + first).await?;
        if first % 10_000 == 0 {
            eprintln!("stored {stored} receipts ({:.0} s)", started.elapsed().as_secs_f64());
        }
    }
    let store_s = started.elapsed().as_secs_f64();
    eprintln!("stored {stored} receipts in {store_s:.0} s");
    let folding = Instant::now();
    let mut folded = 0;
    loop {
        let n = store.roll_up_steps(1, i64::MAX, 200_000).await?;
        folded += n;
        if n < 200_000 {
            break;
        }
    }
    let secs = folding.elapsed().as_secs_f64();
    println!(
        "folded {folded} receipts into plot rollups in {secs:.1} s ({:.0} receipts/s)",
        folded as f64 / secs
    );
    Ok(Built { stored, store_s, folded, fold_s: secs })
}

fn main() -> anyhow::Result<()> {
    trainyard_tests::build_release_binaries()?;
    let args: Vec<String> = std::env::args().collect();
    let steps: i64 = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(100_000);
    let named: Vec<String> = args.iter().skip(1).filter(|a| *a != "--bench").cloned().collect();
    let mut out = Results::create(&results_dir(), "web_view", &named)?;
    let dir = tempfile::Builder::new().prefix("trainyard-web-bench-").tempdir()?;
    let data = dir.path().join("controller");
    let built = tokio::runtime::Runtime::new()?.block_on(build_store(&data, steps))?;
    let fold_rate = (built.folded as f64 / built.fold_s).round();
    out.line(&json!({
        "phase": "build", "steps": steps, "ranks": RANKS, "receipts": built.stored,
        "store_s": built.store_s.round(), "folded": built.folded,
        "fold_s": round1(built.fold_s), "fold_rate": fold_rate,
    }))?;
    let summary = json!({"steps": steps, "ranks": RANKS, "receipts": built.stored, "fold_rate": fold_rate});

    let http_file = dir.path().join("http.addr");
    let mut controller = Command::new(bin("trainyard-controller")?)
        .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--http-addr-file"])
        .arg(&http_file)
        .arg("--data-dir")
        .arg(&data)
        .stderr(std::fs::File::create(dir.path().join("controller.log"))?)
        .stdout(Stdio::null())
        .spawn()?;
    let result = measure(&mut out, summary, &http_file, steps);
    let _ = controller.kill();
    let _ = controller.wait();
    result
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// The requests and the page render, each a line; then the summary, `summary` completed.
fn measure(
    out: &mut Results,
    mut summary: Value,
    http_file: &std::path::Path,
    steps: i64,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(http_file) {
            break a;
        }
        anyhow::ensure!(Instant::now() < deadline, "the controller did not start");
        std::thread::sleep(Duration::from_millis(50));
    };
    let time = |path: &str| -> anyhow::Result<(f64, usize)> {
        let t = Instant::now();
        let (status, body) = http_with(&addr, "GET", path, &[])?;
        anyhow::ensure!(status == 200, "{path}: {status} {body}");
        Ok((t.elapsed().as_secs_f64() * 1000.0, body.len()))
    };
    for (key, label, path) in [
        (
            "series_full",
            "full range, 800 points per rank",
            "/api/jobs/1/series?metric=step_ms&buckets=800".to_string(),
        ),
        (
            "series_zoomed",
            "zoomed to 10,000 steps",
            format!(
                "/api/jobs/1/series?metric=step_ms&buckets=800&from={}&to={}",
                steps / 2,
                steps / 2 + 9_999
            ),
        ),
        ("series_loss", "loss, full range", "/api/jobs/1/series?metric=loss&buckets=800".to_string()),
        ("job", "the job itself", "/api/jobs/1".to_string()),
    ] {
        time(&path)?; // warm the page cache, as a second viewer would find it
        let mut ms = Vec::new();
        let mut bytes = 0;
        for _ in 0..15 {
            let (t, b) = time(&path)?;
            ms.push(t);
            bytes = b;
        }
        let (p50, p90) = median(ms);
        println!("{label}: median {p50:.0} ms, p90 {p90:.0} ms ({} KiB; target < 300 ms)", bytes / 1024);
        out.line(&json!({
            "request": key, "path": path, "requests": 15, "p50_ms": p50.round(), "p90_ms": p90.round(),
            "kib": bytes / 1024, "target_ms": 300,
        }))?;
        summary[format!("{key}_p50_ms")] = json!(p50.round());
    }
    summary["request_target_ms"] = json!(300);
    if chromium().is_none() {
        println!("page render: skipped (chromium is not installed)");
        out.line(&json!({"render": "skipped", "why": "chromium is not installed"}))?;
    } else {
        let probe = repo_root().join("controller/web/dev/probe.py");
        let mut renders = Vec::new();
        for _ in 0..5 {
            let probed = Command::new("python3").arg(&probe).arg(format!("http://{addr}/jobs/1")).output()?;
            let report: Value = serde_json::from_slice(&probed.stdout)
                .with_context(|| format!("probe output: {}", String::from_utf8_lossy(&probed.stderr)))?;
            anyhow::ensure!(report["ready"] == "1", "the page did not get ready: {report}");
            renders.push(report["render_ms"].as_f64().context("render_ms")?);
        }
        let (p50, p90) = median(renders);
        println!(
            "job page, {steps} steps x {RANKS} ranks, to data-ready in Chromium: median {p50:.0} ms, p90 {p90:.0} ms (target < 2000 ms)"
        );
        out.line(&json!({
            "render": "job page to data-ready in Chromium", "loads": 5, "p50_ms": p50.round(),
            "p90_ms": p90.round(), "target_ms": 2000,
        }))?;
        summary["page_render_p50_ms"] = json!(p50.round());
        summary["page_render_p90_ms"] = json!(p90.round());
    }
    summary["page_target_ms"] = json!(2000);
    out.line(&json!({ "summary": summary }))?;
    println!("results: {}", out.path().display());
    Ok(())
}
