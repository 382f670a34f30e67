//! `ctl diagnose JOB [--attempt N] [-o json]`: the likely cause of a slow or uneven run.
//! `ctl diagnose JOB --follow`: the live diagnosis's findings as they open, change and close.

use trainyard_proto::v1::{DiagnoseRequest, Diagnosis, GetJobRequest, LiveFinding, LiveFindingsRequest};

use crate::client::Controller;
use crate::output::{print_out, to_json};
use crate::render::{Table, rank_ranges};

pub async fn run(ctl: &mut Controller, job_id: u64, attempt: Option<u32>, json: bool) -> anyhow::Result<()> {
    let d = match ctl.jobs.diagnose(DiagnoseRequest { job_id, attempt }).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Err(ctl.error(status, Some(job_id))),
    };
    ctl.words(&d)?;
    if json { print_out(&to_json(&d)?) } else { print_out(&text(&d)) }
}

/// How often `--follow` asks for the findings (the live diagnosis runs every 10 s).
const FOLLOW_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Prints the job's live findings as they open, change and close, until the job ends.
pub async fn follow(ctl: &mut Controller, job_id: u64, json: bool) -> anyhow::Result<()> {
    let mut seen: std::collections::HashMap<u64, LiveFinding> = std::collections::HashMap::new();
    if !json {
        print_out(&format!("following the live diagnosis of job {job_id} (Ctrl-C to stop)\n"))?;
    }
    loop {
        let found = match ctl.jobs.live_findings(LiveFindingsRequest { job_id }).await {
            Ok(r) => r.into_inner().findings,
            Err(status) => return Err(ctl.error(status, Some(job_id))),
        };
        for (event, f) in changes(&seen, found) {
            print_out(&follow_line(event, &f, json)?)?;
            seen.insert(f.id, f);
        }
        let job = match ctl.jobs.get(GetJobRequest { job_id }).await {
            Ok(r) => r.into_inner(),
            Err(status) => return Err(ctl.error(status, Some(job_id))),
        };
        let state: trainyard_proto::words::JobState = job.state.parse()?;
        if state.is_terminal() {
            if !json {
                print_out(&format!("job {job_id} {state}; the live diagnosis is over\n"))?;
            }
            return Ok(());
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

/// What changed since `seen`: `opened`, `updated` (its summary moved), `closed`, or `was` (opened
/// and closed between two looks).
pub fn changes(
    seen: &std::collections::HashMap<u64, LiveFinding>,
    found: Vec<LiveFinding>,
) -> Vec<(&'static str, LiveFinding)> {
    found
        .into_iter()
        .filter_map(|f| {
            let event = match seen.get(&f.id) {
                None if f.closed_at_ms != 0 => "was",
                None => "opened",
                Some(old) if old.closed_at_ms == 0 && f.closed_at_ms != 0 => "closed",
                Some(old) if old.summary != f.summary => "updated",
                Some(_) => return None,
            };
            Some((event, f))
        })
        .collect()
}

/// One line of `--follow`: an event and its finding.
fn follow_line(event: &str, f: &LiveFinding, json: bool) -> anyhow::Result<String> {
    if json {
        let v = serde_json::json!({
            "event": event, "id": f.id, "job_id": f.job_id, "attempt": f.attempt, "cause": f.cause,
            "subject": f.subject, "nodes": f.nodes, "ranks": f.ranks, "summary": f.summary,
            "evidence": f.evidence, "remedy": f.remedy, "opened_at_ms": f.opened_at_ms,
            "updated_at_ms": f.updated_at_ms, "closed_at_ms": (f.closed_at_ms != 0).then_some(f.closed_at_ms),
            "first_step": (f.first_step >= 0).then_some(f.first_step), "last_step": (f.last_step >= 0).then_some(f.last_step),
        });
        return Ok(format!("{v}\n"));
    }
    let steps =
        if f.first_step >= 0 { format!(" steps {}-{}", f.first_step, f.last_step) } else { String::new() };
    let mut line = format!("{event:>7} {} [{}]{steps} {}\n", f.cause, f.subject, f.summary);
    if event == "opened" {
        line += &format!("        remedy: {}\n", f.remedy);
    }
    Ok(line)
}

/// A number with its unit as people read it: "1295.0 ms", "1.84x", "0.082".
pub fn with_unit(value: f64, unit: &str) -> String {
    match unit {
        "ms" => format!("{value:.1} ms"),
        "x" => format!("{value:.2}x"),
        "" => format!("{}", (value * 1000.0).round() / 1000.0),
        other => format!("{value:.3} {other}"),
    }
}

/// The diagnosis for people: verdict, findings with evidence, cost and remedy, then the pace
/// of each node, stragglers and what could not be used.
pub fn text(d: &Diagnosis) -> String {
    let mut out = format!("job {} attempt {}: {}\n", d.job_id, d.attempt, d.verdict);
    let opt = |v: Option<f64>, unit: &str| v.map_or("-".to_string(), |v| with_unit(v, unit));
    out += &format!(
        "  read {} step receipt(s), {} compared after {} warm-up step(s); median step {}, {} tokens/s, optimizer {} (cost model {})\n",
        d.samples_used,
        d.metric,
        d.warmup_steps,
        opt(d.median_step_ms, "ms"),
        d.median_tokens_per_s.map_or("-".to_string(), |t| format!("{t:.0}")),
        opt(d.measured_optimizer_ms, "ms"),
        if d.predicted_comm_ms > 0.0 { with_unit(d.predicted_comm_ms, "ms") } else { "unknown".into() },
    );
    for f in &d.findings {
        out += &format!("\n{}  nodes {}  ranks {}\n", f.cause, f.nodes.join(","), rank_ranges(&f.ranks));
        out += &format!("  {}\n", f.summary);
        let evidence: Vec<String> =
            f.evidence.iter().map(|m| format!("{} {}", m.name, with_unit(m.value, &m.unit))).collect();
        if !evidence.is_empty() {
            out += &format!("  evidence: {}\n", evidence.join("; "));
        }
        out += &format!("  expected cost: {}\n  remedy: {}\n", f.expected_cost, f.remedy);
    }
    if !d.nodes.is_empty() {
        let mut table = Table::new(&["NODE", "RANKS", "MEDIAN", "VS FASTEST", "NUMA"]);
        for n in &d.nodes {
            table.row(vec![
                n.agent_id.clone(),
                rank_ranges(&n.ranks),
                opt(n.median_ms, "ms"),
                opt(n.vs_fastest, "x"),
                n.numa_layout.clone(),
            ]);
        }
        out += "\n";
        out += &table.render();
    }
    let stragglers: Vec<String> = d
        .ranks
        .iter()
        .filter(|r| r.straggler)
        .map(|r| {
            format!(
                "rank {} on {} ({:.2} of the median, slow in {} of {} windows)",
                r.rank, r.agent_id, r.relative, r.slow_windows, r.windows
            )
        })
        .collect();
    if !stragglers.is_empty() {
        out += &format!("\nstragglers: {}\n", stragglers.join("; "));
    }
    if !d.notes.is_empty() {
        out += "\nseen, but not why it is slow:\n";
        for n in &d.notes {
            out += &format!("  - {n}\n");
        }
    }
    if !d.unusable.is_empty() {
        out += "\ncould not use:\n";
        for u in &d.unusable {
            out += &format!("  - {u}\n");
        }
    }
    out
}
