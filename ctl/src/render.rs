//! Text rendering for people: aligned tables, ages, timestamps, one-line receipts.

use std::fmt::Write as _;

use trainyard_proto::v1::{Job, RankStatus, StoredReceipt};
use trainyard_proto::words::{RankState, ReceiptKind};

/// A table whose columns are padded to their widest cell.
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Table { rows: vec![header.iter().map(|h| h.to_string()).collect()] }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                let cells = self.rows.iter().filter_map(|r| r.get(c));
                cells.map(|s| s.chars().count()).max().unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                let _ = write!(line, "{cell:<w$}  ", w = widths[c]);
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Ranks as ranges: "0-7,9,12-15" (input in any order).
pub fn rank_ranges(ranks: &[u32]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { sorted[i].to_string() } else { format!("{}-{}", sorted[i], sorted[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// "42s", "5m", "3h", "2d": how long ago `then_ms` was.
pub fn age(now_ms: i64, then_ms: i64) -> String {
    if then_ms <= 0 {
        return "-".into();
    }
    let s = (now_ms - then_ms).max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// "2026-11-22 00:13:05.123Z" for a Unix time in milliseconds (UTC, no time-zone database).
pub fn timestamp(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    let in_day = ms.rem_euclid(86_400_000);
    let (y, m, d) = civil_from_days(days);
    let (h, min, s, milli) = (in_day / 3_600_000, in_day / 60_000 % 60, in_day / 1000 % 60, in_day % 1000);
    format!("{y:04}-{m:02}-{d:02} {h:02}:{min:02}:{s:02}.{milli:03}Z")
}

/// Howard Hinnant's days-to-civil algorithm: days since 1970-01-01 to (year, month, day).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Ranks of the current attempt that are running, and that have exited or been lost.
pub fn rank_counts(ranks: &[RankStatus]) -> (usize, usize) {
    let running = ranks.iter().filter(|r| r.state() == Ok(RankState::Running)).count();
    let done = ranks.iter().filter(|r| r.state().is_ok_and(RankState::is_done)).count();
    (running, done)
}

/// The jobs table of `ctl status`.
pub fn job_list(jobs: &[Job], now_ms: i64) -> String {
    let mut t =
        Table::new(&["ID", "NAME", "STATE", "ATTEMPT", "GPUS", "RUN/EXIT", "RECEIPTS", "AGE", "REASON"]);
    for j in jobs {
        let spec = j.spec.as_ref();
        let gpus = spec.and_then(|s| s.resources.as_ref()).map_or(0, |r| r.gpus);
        let (running, done) = rank_counts(&j.ranks);
        t.row(vec![
            j.id.to_string(),
            spec.map(|s| s.name.clone()).unwrap_or_default(),
            j.state.clone(),
            j.attempt.to_string(),
            gpus.to_string(),
            format!("{running}/{done}"),
            j.receipts.to_string(),
            age(now_ms, j.created_at_ms),
            j.reason.clone(),
        ]);
    }
    t.render()
}

/// The details of one job: state, events, ranks.
pub fn job_details(j: &Job, now_ms: i64) -> String {
    let name = j.spec.as_ref().map(|s| s.name.as_str()).unwrap_or_default();
    let mut out =
        if name.is_empty() { format!("job {}\n", j.id) } else { format!("job {} ({name})\n", j.id) };
    let _ = writeln!(out, "  state:    {} (attempt {})", j.state, j.attempt);
    let _ = writeln!(out, "  reason:   {}", j.reason);
    if !j.user.is_empty() {
        let account = if j.run_as.is_empty() { "the agent's account" } else { j.run_as.as_str() };
        let _ = writeln!(out, "  user:     {} (ranks run as {account})", j.user);
    }
    let _ =
        writeln!(out, "  created:  {} ({} ago)", timestamp(j.created_at_ms), age(now_ms, j.created_at_ms));
    let _ = writeln!(out, "  receipts: {}", j.receipts);
    if !j.waiting_reason.is_empty() {
        let _ = writeln!(out, "  waiting:  {}", j.waiting_reason);
    }
    if j.predicted_comm_ms > 0.0 || j.measured_optimizer_ms > 0.0 {
        let ms = |v: f64| if v > 0.0 { format!("{v:.1} ms") } else { "-".to_string() };
        let _ = writeln!(
            out,
            "  comm:     predicted {} per step (collectives); measured optimizer {} per step",
            ms(j.predicted_comm_ms),
            ms(j.measured_optimizer_ms)
        );
    }
    if let Some(g) = j.goodput.as_ref().filter(|g| g.wall_ms > 0.0) {
        let _ = writeln!(out, "  goodput:  {}", g.summary);
    }
    for w in &j.warnings {
        let _ = writeln!(out, "  warning:  {w}");
    }
    out.push_str("\nevents:\n");
    let mut events = Table::new(&["  TIME", "FROM", "TO", "REASON"]);
    for e in &j.events {
        let from = if e.from_state.is_empty() { "-" } else { &e.from_state };
        events.row(vec![
            format!("  {}", timestamp(e.at_ms)),
            from.to_string(),
            format!("→ {}", e.to_state),
            e.reason.clone(),
        ]);
    }
    out.push_str(&events.render());
    if !j.failures.is_empty() {
        out.push_str("\nfailures:\n");
        let mut failures =
            Table::new(&["  TIME", "ATTEMPT", "KIND", "NODE", "RANK", "BLAMED", "CHARGED", "EVIDENCE"]);
        for f in &j.failures {
            failures.row(vec![
                format!("  {}", timestamp(f.at_ms)),
                f.attempt.to_string(),
                f.kind.clone(),
                if f.agent_id.is_empty() { "-".into() } else { f.agent_id.clone() },
                if f.rank < 0 { "-".into() } else { f.rank.to_string() },
                if f.blamed { "yes" } else { "no" }.to_string(),
                if f.charged { "yes" } else { "no" }.to_string(),
                f.evidence.clone(),
            ]);
        }
        out.push_str(&failures.render());
    }
    out.push_str("\nranks:\n");
    out.push_str(&rank_table(&j.ranks));
    out
}

fn rank_table(ranks: &[RankStatus]) -> String {
    let mut t = Table::new(&[
        "  RANK", "NODE", "AGENT", "GPU", "STATE", "PID", "EXIT", "LAST SEQ", "SKIPPED", "CPUS", "MEM",
    ]);
    for r in ranks {
        t.row(vec![
            format!("  {}", r.rank),
            r.node_rank.to_string(),
            r.agent_id.clone(),
            r.gpu_index.to_string(),
            r.state.clone(),
            if r.pid == 0 { "-".into() } else { r.pid.to_string() },
            exit_text(r),
            if r.last_seq < 0 { "-".into() } else { r.last_seq.to_string() },
            r.skipped_lines.to_string(),
            binding(&r.planned_cpus, &r.effective_cpus),
            binding(&r.planned_mems, &r.effective_mems),
        ]);
    }
    t.render()
}

/// A planned binding and what the rank really got: "0-15", "0-15 (got 0-31)", "- (got 0-31)" when
/// unpinned, "-" when neither is known.
fn binding(planned: &str, effective: &str) -> String {
    match (planned.is_empty(), effective.is_empty()) {
        (true, true) => "-".into(),
        (false, true) => planned.to_string(),
        (true, false) => format!("- (got {effective})"),
        (false, false) if planned == effective => planned.to_string(),
        (false, false) => format!("{planned} (got {effective})"),
    }
}

/// "0", "1", "signal 15" or "-" while the rank has not exited.
pub fn exit_text(r: &RankStatus) -> String {
    if r.state() != Ok(RankState::Exited) {
        "-".into()
    } else if r.signal != 0 {
        format!("signal {}", r.signal)
    } else {
        r.exit_code.to_string()
    }
}

/// One line for `ctl watch`: rank, seq, kind, and the key fields of step receipts.
pub fn receipt_line(r: &StoredReceipt) -> String {
    let mut line = format!("rank {:>3}  seq {:>5}  {:<10}", r.rank, r.seq, r.kind);
    let Ok(serde_json::Value::Object(body)) = serde_json::from_str(&r.body) else {
        return line.trim_end().to_string();
    };
    // A kind outside schema v1 is a receipt the store kept flagged: shown with its step.
    let keys: &[&str] = match ReceiptKind::parse(&r.kind) {
        Some(ReceiptKind::Step) => &["step", "loss", "lr", "tokens_per_s", "step_time_ms"],
        Some(ReceiptKind::Exit) => &["code", "signal", "reason"],
        Some(ReceiptKind::Checkpoint) => &["step", "bytes", "duration_ms", "path"],
        Some(ReceiptKind::Eval) => &["step", "loss"],
        Some(ReceiptKind::Launch) => &["hostname", "pid"],
        Some(ReceiptKind::Goodput) | None => &["step"],
    };
    for key in keys {
        if let Some(v) = body.get(*key) {
            let _ = write!(line, " {key}={}", compact(v));
        }
    }
    line.trim_end().to_string()
}

fn compact(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        // Numbers as the rank wrote them: it knows their precision.
        serde_json::Value::Number(n) => n.to_string(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_utc_calendar_dates() {
        assert_eq!(timestamp(0), "1970-01-01 00:00:00.000Z");
        assert_eq!(timestamp(951_782_400_123), "2000-02-29 00:00:00.123Z");
        assert_eq!(timestamp(1_763_770_385_000), "2025-11-22 00:13:05.000Z");
    }

    #[test]
    fn ages_pick_the_largest_unit() {
        assert_eq!(age(61_000, 1_000), "1m");
        assert_eq!(age(10_000, 1_000), "9s");
        assert_eq!(age(1_000 + 90_000_000, 1_000), "1d");
        assert_eq!(age(5, 0), "-");
    }

    #[test]
    fn step_receipts_show_their_key_fields() {
        let r = StoredReceipt {
            rank: 1,
            seq: 7,
            kind: "step".into(),
            body: r#"{"kind":"step","step":6,"loss":3.25,"tokens_per_s":1000}"#.into(),
            ..Default::default()
        };
        let line = receipt_line(&r);
        assert!(line.contains("step=6 loss=3.25 tokens_per_s=1000"), "{line}");
    }

    #[test]
    fn job_details_show_events_and_ranks() {
        use trainyard_proto::v1::JobEvent;
        let job = Job {
            id: 3,
            state: "cancelled".into(),
            reason: "cancelled with ctl".into(),
            events: vec![JobEvent {
                at_ms: 1_000,
                from_state: "running".into(),
                to_state: "cancelled".into(),
                reason: "cancelled with ctl".into(),
            }],
            ranks: vec![RankStatus {
                rank: 1,
                node_rank: 0,
                agent_id: "node-a".into(),
                gpu_index: 1,
                state: "exited".into(),
                signal: 15,
                pid: 4242,
                last_seq: 12,
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = job_details(&job, 2_000);
        assert!(text.starts_with("job 3\n  state:    cancelled (attempt 0)\n"), "{text}");
        assert!(text.contains("1970-01-01 00:00:01.000Z  running  → cancelled  cancelled with ctl"));
        assert!(text.contains("  1     0     node-a  1    exited  4242  signal 15  12"), "{text}");
    }

    #[test]
    fn job_details_show_waiting_cost_binding_and_warnings() {
        let job = Job {
            id: 4,
            state: "running".into(),
            predicted_comm_ms: 41.25,
            measured_optimizer_ms: 57.8,
            warnings: vec!["rank 0 on node-a: bound to CPUs 0-31".into()],
            waiting_reason: "needs 8 GPUs on one nvswitch node; largest free set is 6".into(),
            ranks: vec![
                RankStatus {
                    rank: 0,
                    agent_id: "node-a".into(),
                    planned_cpus: "0-15".into(),
                    planned_mems: "0".into(),
                    effective_cpus: "0-31".into(),
                    effective_mems: "0".into(),
                    ..Default::default()
                },
                RankStatus { rank: 1, agent_id: "node-a".into(), ..Default::default() },
            ],
            ..Default::default()
        };
        let text = job_details(&job, 0);
        assert!(
            text.contains("  waiting:  needs 8 GPUs on one nvswitch node; largest free set is 6\n"),
            "{text}"
        );
        assert!(
            text.contains("predicted 41.2 ms per step (collectives); measured optimizer 57.8 ms"),
            "{text}"
        );
        assert!(text.contains("  warning:  rank 0 on node-a: bound to CPUs 0-31\n"), "{text}");
        assert!(text.contains("0-15 (got 0-31)  0\n"), "{text}");
    }

    #[test]
    fn table_columns_align() {
        let mut t = Table::new(&["A", "B"]);
        t.row(vec!["long".into(), "x".into()]);
        assert_eq!(t.render(), "A     B\nlong  x\n");
    }
}
