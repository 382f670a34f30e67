//! The JSON the pages read. Shapes are documented in `docs/web.md`; the page (`controller/web/
//! app.js`) is their only client, and the browser tests assert on what it renders from them.

use std::time::Duration;

use axum::extract::Path;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::request::{Query, Web, WebState, error, int_param, query_pairs, store_error};
use crate::core::LogEvent;
use trainyard_analysis::diagnose::goodput::Goodput;
use trainyard_analysis::series::{self, Metric};
use trainyard_model::spec::Engine;
use trainyard_store::{Allocation, JobEventRecord, JobRecord};

/// Lines of rank 0's log the job page shows.
const LOG_TAIL_LINES: u32 = 40;
/// How long the job page waits for an agent to send the log tail.
const LOG_WAIT: Duration = Duration::from_secs(2);
/// Highest step or bucket count a query may name.
const MAX_STEP: i64 = 1_000_000_000;

/// `?` for handlers: an error is already the response.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(refused) => return refused.into_response(),
        }
    };
}

/// A 200 with `value` as its JSON body.
pub(super) fn json_ok(value: Value) -> Response {
    ok(value)
}

fn ok(value: Value) -> Response {
    (StatusCode::OK, [(axum::http::header::CONTENT_TYPE, "application/json")], value.to_string())
        .into_response()
}

/// `GET /api/jobs[?limit=N&active=1]`: newest first; non-admins see their own only.
pub(super) async fn jobs(state: WebState, headers: HeaderMap, query: Query) -> Response {
    let web = state.0;
    let caller = tri!(web.caller(&headers).await);
    let pairs = tri!(query_pairs(&query.0));
    let limit = tri!(int_param(&pairs, "limit", 1, 1_000)).unwrap_or(200) as u32;
    let active = pairs.iter().any(|(k, v)| k == "active" && v == "1");
    let only = (!caller.admin).then_some(caller.name.as_str());
    // Straight from the store, without `ctl status`'s per-job receipt counts: cheap on jobs of
    // millions of receipts.
    let listed = tri!(web.controller.jobs().records(active, only, limit).await.map_err(store_error));
    let mut jobs = Vec::with_capacity(listed.len());
    for j in &listed {
        let (goodput, facts) = match web.controller.diagnoses().goodput_and_facts(j.id).await {
            Ok((g, f)) => (g.goodput, Some(f)),
            Err(_) => (None, None),
        };
        let allocations = web.controller.jobs().allocations(j.id, j.attempt).await.unwrap_or_default();
        let nodes: std::collections::BTreeSet<&str> =
            allocations.iter().map(|a| a.agent_id.as_str()).collect();
        jobs.push(json!({
            "id": j.id,
            "name": j.spec.name,
            "state": j.state.to_string(),
            "user": j.owner.user,
            "gpus": j.spec.resources.gpus,
            "nodes": nodes,
            "created_at_ms": j.created_at_ms,
            "updated_at_ms": j.updated_at_ms,
            "attempt": j.attempt,
            "step": facts.and_then(|f| f.last_step),
            "total_steps": total_steps(j),
            "goodput": goodput,
            "reason": j.reason,
        }));
    }
    ok(json!({ "now_ms": web.controller.now_ms(), "jobs": jobs }))
}

/// The steps a built-in job runs (`num_iterations`); unknown for scripts.
fn total_steps(job: &JobRecord) -> Option<i64> {
    match &job.spec.engine {
        Engine::Builtin { settings, .. } => settings.get("num_iterations")?.parse().ok(),
        _ => None,
    }
}

/// Step receipts above which the job page does not diagnose live (a diagnosis reads every
/// step sample); the page says to run `ctl diagnose`, and shows the stored findings once the
/// job has ended.
const LIVE_DIAGNOSIS_MAX_RECEIPTS: u64 = 300_000;

/// `GET /api/jobs/{id}`: the job, its events and ranks, diagnosis, goodput and log tail. Reads
/// only what stays cheap on a job of millions of receipts (no scan of its receipts).
pub(super) async fn job(state: WebState, headers: HeaderMap, Path(raw): Path<String>) -> Response {
    let web = state.0;
    let caller = tri!(web.caller(&headers).await);
    let record = tri!(web.job_for(&caller, &raw).await);
    let id = record.id;
    let allocations = tri!(web.controller.jobs().allocations(id, record.attempt).await.map_err(store_error));
    let events = tri!(web.controller.jobs().events(id).await.map_err(store_error));
    let (goodput, facts) = match web.controller.diagnoses().goodput_and_facts(id).await {
        Ok((g, f)) => (Some(g), Some(f)),
        Err(_) => (None, None),
    };
    let goodput = goodput.map(|g| goodput_json(&g));
    // Rank 0's steps times the ranks bound the step receipts without counting them.
    let folded_ranks =
        web.controller.receipts().rollup_extent(id, record.attempt).await.ok().flatten().map_or(0, |e| e.2);
    let ranks = allocations.len().max(folded_ranks as usize).max(1) as u64;
    let steps_stored = facts.as_ref().map_or(0, |f| f.steps) * ranks;
    let diagnosis = live_diagnosis(&web, id, steps_stored).await;
    let findings: Vec<Value> = match web.controller.diagnoses().live_findings(id).await {
        Ok(found) => found.iter().filter(|f| f.attempt == record.attempt).map(finding_json).collect(),
        Err(_) => Vec::new(),
    };
    let ranks: Vec<Value> = allocations.iter().map(rank_json).collect();
    let events: Vec<Value> = events.iter().map(event_json).collect();
    let logs = if allocations.is_empty() { Value::Null } else { log_tail(&web, id).await };
    ok(json!({
        "id": id,
        "name": record.spec.name,
        "state": record.state.to_string(),
        "user": record.owner.user,
        "run_as": record.owner.run_as,
        "gpus": record.spec.resources.gpus,
        "attempt": record.attempt,
        "created_at_ms": record.created_at_ms,
        "updated_at_ms": record.updated_at_ms,
        "reason": record.reason,
        "step": facts.as_ref().and_then(|f| f.last_step),
        "total_steps": total_steps(&record),
        "spec_summary": spec_summary(&record),
        "goodput": goodput,
        "events": events,
        "ranks": ranks,
        "diagnosis": diagnosis,
        "findings": findings,
        "logs": logs,
        "metrics": Metric::ALL.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
    }))
}

/// The goodput of a job as the page draws it: the fraction, and the wall time split into parts.
fn goodput_json(g: &Goodput) -> Value {
    let parts = [
        ("training", g.train_ms - g.lost_ms),
        ("startup", g.startup_ms),
        ("eval", g.eval_ms),
        ("checkpoint", g.checkpoint_ms),
        ("restarts", g.restart_ms),
        ("lost", g.lost_ms),
        ("other", g.other_ms),
    ];
    json!({
        "fraction": g.goodput,
        "wall_ms": g.wall_ms,
        "summary": g.describe(),
        "parts": parts.iter().filter(|(_, ms)| *ms > 0.0).map(|(name, ms)| json!({"name": name, "ms": ms})).collect::<Vec<_>>(),
    })
}

/// The diagnosis the page shows: computed now, unless the job has too many step receipts for a
/// page load; `null` before there is anything to judge.
async fn live_diagnosis(web: &Web, id: u64, steps_stored: u64) -> Value {
    if steps_stored > LIVE_DIAGNOSIS_MAX_RECEIPTS {
        return json!({
            "verdict": format!("about {steps_stored} step receipts: too many to diagnose on a page load; run `ctl diagnose {id}`"),
            "healthy": Value::Null, "ranks": [], "findings": [],
        });
    }
    match web.controller.diagnoses().diagnose(id, None).await {
        Ok(d) if d.samples_used > 0 || !d.findings.is_empty() => json_of(&d.message(id)),
        _ => Value::Null,
    }
}

/// A live finding as the page lists it and bands it on the step-time plot.
fn finding_json(f: &trainyard_store::LiveFinding) -> Value {
    json!({
        "id": f.id,
        "cause": f.cause,
        "subject": f.subject,
        "nodes": f.nodes,
        "ranks": f.ranks,
        "summary": f.summary,
        "remedy": f.remedy,
        "first_step": f.first_step,
        "last_step": f.last_step,
        "opened_at_ms": f.opened_at_ms,
        "closed_at_ms": f.closed_at_ms,
    })
}

fn rank_json(a: &Allocation) -> Value {
    let o = &a.observed;
    json!({
        "rank": a.id.rank,
        "agent_id": a.agent_id,
        "gpu_index": a.gpu_index,
        "numa_node": a.planned_mems.parse::<i64>().ok(),
        "cpus": if o.effective_cpus.is_empty() { &a.planned_cpus } else { &o.effective_cpus },
        "state": o.state.to_string(),
        "pid": o.pid,
        "exit_code": o.exit_code,
        "signal": o.signal,
        "message": o.message,
    })
}

fn event_json(e: &JobEventRecord) -> Value {
    json!({
        "at_ms": e.at_ms,
        "state": e.to_state.to_string(),
        "from": e.from_state.map(|s| s.to_string()),
        "reason": e.reason,
        "attempt": e.attempt,
    })
}

fn spec_summary(job: &JobRecord) -> String {
    match &job.spec.engine {
        Engine::Exec { argv, .. } => format!("exec {}", argv.join(" ")),
        Engine::Builtin { preset, .. } => format!("builtin {preset}"),
    }
}

/// Rank 0's last lines, or why there are none.
async fn log_tail(web: &Web, job: u64) -> Value {
    let (request_id, mut rx) = match web.controller.jobs().logs(job, 0, LOG_TAIL_LINES, false).await {
        Ok(opened) => opened,
        Err(e) => return json!({"rank": 0, "text": "", "unavailable": e.to_string()}),
    };
    let mut text = String::new();
    let read = async {
        while let Some(event) = rx.recv().await {
            match event {
                LogEvent::Chunk { data, .. } => {
                    web.controller.jobs().log_credit(request_id, 1);
                    text.push_str(&String::from_utf8_lossy(&data));
                }
                LogEvent::Failed(why) => return Some(why),
            }
        }
        None
    };
    let outcome = tokio::time::timeout(LOG_WAIT, read).await;
    web.controller.jobs().close_logs(request_id);
    match outcome {
        Ok(None) => json!({"rank": 0, "text": text}),
        Ok(Some(why)) => json!({"rank": 0, "text": text, "unavailable": why}),
        Err(_) => json!({"rank": 0, "text": text, "unavailable": "the node did not send the logs in time"}),
    }
}

/// A wire record as the page reads it: the same fields `ctl -o json` prints.
fn json_of(record: &impl serde::Serialize) -> Value {
    serde_json::to_value(record).unwrap_or(Value::Null)
}

/// `GET /api/jobs/{id}/series?metric=M[&buckets=N&from=S&to=S&attempt=A]`: per rank, at most
/// `buckets` points `[first step, min, max, mean]` over the steps asked for (default: all).
pub(super) async fn series(
    state: WebState,
    headers: HeaderMap,
    Path(raw): Path<String>,
    query: Query,
) -> Response {
    let web = state.0;
    let caller = tri!(web.caller(&headers).await);
    let pairs = tri!(query_pairs(&query.0));
    let metric = match pairs.iter().find(|(k, _)| k == "metric") {
        None => {
            return error(StatusCode::BAD_REQUEST, "metric is required: step_ms, loss, tokens_per_s or mfu");
        }
        Some((_, m)) => match Metric::parse(m) {
            Some(m) => m,
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("unknown metric {m:?}: step_ms, loss, tokens_per_s or mfu"),
                );
            }
        },
    };
    let buckets = tri!(int_param(&pairs, "buckets", 1, i64::from(series::MAX_BUCKETS))).unwrap_or(800) as u32;
    let from = tri!(int_param(&pairs, "from", 0, MAX_STEP));
    let to = tri!(int_param(&pairs, "to", 0, MAX_STEP));
    if let (Some(f), Some(t)) = (from, to)
        && f > t
    {
        return error(StatusCode::BAD_REQUEST, format!("from={f} is after to={t}"));
    }
    let record = tri!(web.job_for(&caller, &raw).await);
    let attempt =
        tri!(int_param(&pairs, "attempt", 0, i64::from(record.attempt))).map_or(record.attempt, |a| a as u32);
    // Folds what arrived since the last request, so the plots are current.
    tri!(web.controller.receipts().fold(record.id).await.map_err(store_error));
    let extent = tri!(web.controller.receipts().rollup_extent(record.id, attempt).await.map_err(store_error));
    let empty = json!({"metric": metric.as_str(), "unit": metric.unit(), "from": from, "to": to, "bucket_steps": 0, "ranks": []});
    let Some((first, last, ranks)) = extent else { return ok(empty) };
    let (from, to) = (from.unwrap_or(first), to.unwrap_or(last).min(last));
    if from > to {
        return ok(empty);
    }
    let level = series::choose_level(to - from + 1, i64::from(ranks), buckets);
    let buckets_read = (from / level, to / level);
    let rows = tri!(
        web.controller
            .receipts()
            .rollup_rows(record.id, attempt, metric, level, buckets_read)
            .await
            .map_err(store_error)
    );
    let mut by_rank: std::collections::BTreeMap<u32, Vec<&series::RollupRow>> = Default::default();
    for r in &rows {
        by_rank.entry(r.rank).or_default().push(r);
    }
    let mut width = 0;
    let mut out = Vec::new();
    for (rank, rows) in by_rank {
        let (w, points) = series::downsample(&rows, metric, from, to, buckets);
        if points.is_empty() {
            continue;
        }
        width = w;
        out.push(json!({"rank": rank, "points": points}));
    }
    ok(json!({
        "metric": metric.as_str(),
        "unit": metric.unit(),
        "attempt": attempt,
        "from": from,
        "to": to,
        "bucket_steps": width,
        "level": level,
        "ranks": out,
    }))
}

/// `GET /api/nodes`: every node with its verdict, NUMA layout, link matrix and failing checks.
pub(super) async fn nodes(state: WebState, headers: HeaderMap) -> Response {
    let web = state.0;
    tri!(web.caller(&headers).await);
    let mut nodes = Vec::new();
    for n in web.controller.nodes().list().await {
        let report = web.controller.nodes().latest_preflight(&n.agent_id).await.ok();
        let inventory = web.controller.nodes().inventory(&n.agent_id);
        let numa: Vec<Value> = inventory.as_ref().map_or_else(Vec::new, |inv| {
            inv.numa_nodes
                .iter()
                .map(|node| {
                    let gpus: Vec<u32> =
                        inv.gpus.iter().filter(|g| g.numa_node == Some(node.id)).map(|g| g.index).collect();
                    json!({"node": node.id, "gpus": gpus, "cpus": node.cpus})
                })
                .collect()
        });
        let matrix = inventory.as_ref().filter(|inv| !inv.links.is_empty()).map(|inv| {
            let n = inv.gpus.len();
            let labels: Vec<String> = inv.gpus.iter().map(|g| format!("GPU{}", g.index)).collect();
            let rows: Vec<&[String]> = inv.links.chunks(n.max(1)).collect();
            json!({"labels": labels, "rows": rows})
        });
        let failing: Vec<Value> = report.as_ref().map_or_else(Vec::new, |r| {
            r.checks
                .iter()
                .filter(|c| c.status != trainyard_store::CheckStatus::Pass)
                .map(|c| {
                    json!({"id": c.id, "status": c.status.to_string(), "detail": format!("measured {}; expected {}", c.measured, c.expected), "remedy": c.remedy})
                })
                .collect()
        });
        nodes.push(json!({
            "agent_id": n.agent_id,
            "state": n.state,
            "address": "",
            "gpus": n.gpus,
            "gpu_model": n.gpu_model,
            "interconnect_class": Some(n.interconnect_class.clone()).filter(|c| !c.is_empty()),
            "verdict": Some(n.verdict.clone()).filter(|v| !v.is_empty()),
            "verdict_reason": n.verdict_reason,
            "preflight_level": report.as_ref().map(|r| r.level.to_string()),
            "preflight_at_ms": report.as_ref().map(|r| r.finished_at_ms),
            "running_ranks": n.gpus.saturating_sub(n.free_gpus),
            "numa": numa,
            "matrix": matrix,
            "failing": failing,
        }));
    }
    ok(json!({ "nodes": nodes }))
}

/// `GET /api/compare?a=A&b=B`: two jobs side by side and the verdict.
pub(super) async fn compare(state: WebState, headers: HeaderMap, query: Query) -> Response {
    let web = state.0;
    let caller = tri!(web.caller(&headers).await);
    let pairs = tri!(query_pairs(&query.0));
    let pick = |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let (Some(a), Some(b)) = (pick("a"), pick("b")) else {
        return error(StatusCode::BAD_REQUEST, "compare needs two jobs: ?a=JOB&b=JOB");
    };
    let a = tri!(web.job_for(&caller, &a).await).id;
    let b = tri!(web.job_for(&caller, &b).await).id;
    let c = tri!(web.controller.diagnoses().compare(a, b).await.map_err(store_error));
    ok(json_of(&trainyard_proto::v1::Comparison::from(&c)))
}
