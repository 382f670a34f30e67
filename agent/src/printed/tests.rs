use super::*;

struct Rank {
    dir: tempfile::TempDir,
    printed: Printed,
}

fn rank(pattern: Option<&str>, position: PrintedPosition) -> Rank {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("stdout.log"), dir.path().join("stderr.log"));
    let printed = Printed::new(Parser::new(pattern).unwrap(), &out, &err, position);
    Rank { dir, printed }
}

impl Rank {
    fn print(&self, stream: &str, text: &str) {
        use std::io::Write as _;
        let mut f =
            std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join(stream)).unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }
}

fn nanochat(step: u32) -> String {
    format!(
        "step {step:05}/00100 (1.00%) | loss: 3.5 | lrm: 1.00 | dt: 100.00ms | tok/sec: 1,000 | bf16_mfu: 10.00 | epoch: 1 pq: 0 rg: 0 | total time: 0.01m\n"
    )
}

#[test]
fn printed_fields_merge_into_the_ranks_own_receipt_and_its_step_time_wins() {
    let mut r = rank(None, PrintedPosition::default());
    let t0 = Instant::now();
    r.print("stdout.log", &format!("warming up\n{}", nanochat(0)));
    r.printed.poll(t0).unwrap();
    let mut body = r#"{"kind":"step","step":0,"step_time_ms":140.0,"loss":3.7508747577667236,"sources":{"step_time_ms":"cpu_clock","loss":"wandb"}}"#.to_string();
    assert_eq!(r.printed.merge(0, &mut body, false, t0), Merge::Now);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["step_time_ms"], 100.0, "the script's own step time wins");
    assert_eq!(v["hook_step_time_ms"], 140.0);
    assert!(
        body.contains(r#""loss":3.7508747577667236"#),
        "the rank's value stays exactly as written: {body}"
    );
    assert_eq!(v["sources"]["loss"], "wandb", "the logged loss stays; the printed one is smoothed");
    assert_eq!(v["loss_smoothed"], 3.5);
    assert_eq!(v["tokens_per_s"], 1000.0);
    assert_eq!(v["sources"]["step_time_ms"], "printed nanochat");
    assert_eq!(v["sources"]["loss"], "wandb");
    assert_eq!(r.printed.counts.lines, 2);
    assert!(r.printed.due(t0 + Duration::from_secs(5), false).is_empty(), "the rank writes its own steps");
}

#[test]
fn a_receipt_waits_for_the_line_of_a_rank_that_prints_every_step_but_not_for_long() {
    let mut r = rank(None, PrintedPosition::default());
    let t0 = Instant::now();
    r.print("stdout.log", &(nanochat(0) + &nanochat(1)));
    r.printed.poll(t0).unwrap();
    for step in 0..2 {
        let mut b = format!(r#"{{"kind":"step","step":{step}}}"#);
        assert_eq!(r.printed.merge(step, &mut b, false, t0), Merge::Now);
    }
    let mut b = r#"{"kind":"step","step":2}"#.to_string();
    assert_eq!(r.printed.merge(2, &mut b, false, t0), Merge::Wait, "step 2 is expected to print");
    assert_eq!(r.printed.merge(2, &mut b, false, t0 + HOLD_FOR_LINE), Merge::Now, "not for longer");
    assert_eq!(r.printed.merge(2, &mut b, true, t0), Merge::Now, "a rank that ended prints nothing more");
    let mut b = r#"{"kind":"step","step":7}"#.to_string();
    assert_eq!(r.printed.merge(7, &mut b, false, t0), Merge::Now, "not a step it would print next");
    // A rank that prints nothing never holds its receipts.
    let mut quiet = rank(None, PrintedPosition::default());
    assert_eq!(quiet.printed.merge(0, &mut b, false, t0), Merge::Now);
}

#[test]
fn without_receipts_of_its_own_the_agent_writes_them_once_across_restarts() {
    let mut r = rank(None, PrintedPosition { written_through: -1, ..PrintedPosition::default() });
    let t0 = Instant::now();
    r.print(
        "stderr.log",
        "step:1/10 train_time:100ms step_avg:100.00ms\nstep:2/10 train_time:200ms step_avg:100.00ms\n",
    );
    r.printed.poll(t0).unwrap();
    assert!(r.printed.due(t0, false).is_empty(), "they wait for a receipt of the rank's own first");
    let lines = r.printed.due(t0 + HOLD_FOR_RECEIPT, false);
    assert_eq!(lines.len(), 2);
    let first: Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!((first["kind"].as_str(), first["step"].as_i64()), (Some("step"), Some(0)));
    assert_eq!(first["producer"], "trainyard agent (printed lines)");
    assert_eq!(first["sources"]["train_time"], "printed modded-nanogpt");
    assert_eq!(first["sources"]["step_time_ms"], "agent clock between printed lines");
    assert!(first["step_time_ms"].as_f64().is_some_and(|t| t >= 0.0), "{first}");
    // The tailer reads them back from the receipts file: they are not the rank's own.
    for line in &lines {
        let mut body = line.clone();
        assert_eq!(r.printed.merge(0, &mut body, false, t0), Merge::Now);
    }
    r.print("stderr.log", "step:3/10 train_time:300ms step_avg:100.00ms\n");
    r.printed.poll(t0).unwrap();
    assert_eq!(r.printed.due(t0 + HOLD_FOR_RECEIPT * 2, false).len(), 1, "the agent goes on writing");
    let saved = r.printed.take_dirty().expect("the position moved");
    assert_eq!(saved.written_through, 2);
    // A restarted agent from that position reads on and writes no step twice.
    r.print("stderr.log", "step:4/10 train_time:400ms step_avg:100.00ms\n");
    let mut again = rank(None, saved);
    again.dir = r.dir;
    again.printed = Printed::new(
        Parser::new(None).unwrap(),
        &again.dir.path().join("stdout.log"),
        &again.dir.path().join("stderr.log"),
        saved,
    );
    again.printed.poll(t0).unwrap();
    let lines = again.printed.due(t0, true);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains(r#""step":3"#), "{lines:?}");
}

#[test]
fn bad_lines_are_counted_long_lines_skipped_and_a_partial_line_waits() {
    let mut r = rank(Some(r"^it (?P<step>\d+) loss (?P<loss>\S+)$"), PrintedPosition::default());
    let t0 = Instant::now();
    let long = "x".repeat(MAX_LINE_BYTES + 10);
    r.print("stdout.log", &format!("it 1 loss nan\nit 2 loss 1.5\n{long}\nit 1 loss 2.0\nit 3 loss 1.2"));
    r.printed.poll(t0).unwrap();
    assert_eq!((r.printed.counts.bad, r.printed.counts.steps), (2, 1), "nan and a step going back");
    assert_eq!(r.printed.counts.lines, 3, "the long line is not a line read");
    r.print("stdout.log", "\n");
    r.printed.poll(t0).unwrap();
    assert_eq!(r.printed.counts.steps, 2, "the line is read once its newline is there");
    let saved = r.printed.take_dirty().unwrap();
    let size = std::fs::metadata(r.dir.path().join("stdout.log")).unwrap().len();
    assert_eq!(saved.stdout, size);
}

#[test]
fn hugging_face_dicts_are_numbered_in_order() {
    let mut r = rank(None, PrintedPosition { written_through: -1, ..PrintedPosition::default() });
    let t0 = Instant::now();
    r.print("stdout.log", "{'loss': '3.9', 'grad_norm': '1.0', 'learning_rate': '0.001', 'epoch': '0.01'}\n{'loss': '3.8', 'grad_norm': '1.0', 'learning_rate': '0.001', 'epoch': '0.02'}\n");
    r.printed.poll(t0).unwrap();
    let lines = r.printed.due(t0, true);
    let steps: Vec<i64> =
        lines.iter().map(|l| serde_json::from_str::<Value>(l).unwrap()["step"].as_i64().unwrap()).collect();
    assert_eq!(steps, [0, 1]);
}
