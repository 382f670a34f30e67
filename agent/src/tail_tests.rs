use std::io::Write;

use super::*;

const ID: RankId = RankId { job_id: 7, attempt: 1, rank: 3 };

struct Fixture {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("receipts.jsonl");
        Self { _dir: dir, path }
    }

    fn append(&self, bytes: &[u8]) {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&self.path).unwrap();
        f.write_all(bytes).unwrap();
    }

    fn tailer(&self, acked: Position) -> Tailer {
        Tailer::new(ID, &self.path, acked)
    }
}

fn big_budget() -> Budget {
    Budget::new(10_000, 64 << 20)
}

/// Polls once with a large budget; returns the receipts and whether it caught up.
fn poll(t: &mut Tailer) -> (Vec<Receipt>, bool) {
    let mut out = Vec::new();
    let caught_up = t.poll(&mut out, &mut big_budget(), false).unwrap();
    (out, caught_up)
}

fn seqs(receipts: &[Receipt]) -> Vec<u64> {
    receipts.iter().map(|r| r.seq).collect()
}

#[test]
fn missing_file_is_empty() {
    let fx = Fixture::new();
    let (out, caught_up) = poll(&mut fx.tailer(Position::default()));
    assert!(out.is_empty());
    assert!(caught_up);
}

#[test]
fn lines_become_receipts_with_kind_step_and_body() {
    let fx = Fixture::new();
    fx.append(b"{\"kind\":\"launch\"}\n{\"kind\":\"step\",\"step\":12,\"loss\":2.5}\n");
    let mut t = fx.tailer(Position::default());
    let (out, caught_up) = poll(&mut t);
    assert!(caught_up);
    assert_eq!(seqs(&out), vec![0, 1]);
    assert_eq!(out[0].kind, "launch");
    assert_eq!(out[0].step, -1);
    assert_eq!(out[1].kind, "step");
    assert_eq!(out[1].step, 12);
    assert_eq!(out[1].body, "{\"kind\":\"step\",\"step\":12,\"loss\":2.5}");
    let key = out[1].key.unwrap();
    assert_eq!((key.job_id, key.attempt, key.rank), (7, 1, 3));
}

#[test]
fn partial_line_waits_for_its_newline() {
    let fx = Fixture::new();
    fx.append(b"{\"kind\":\"step\",\"step\":1}\n{\"kind\":\"st");
    let mut t = fx.tailer(Position::default());
    let (out, caught_up) = poll(&mut t);
    assert_eq!(seqs(&out), vec![0]);
    assert!(!caught_up, "a pending partial line is not caught up");
    let (out, _) = poll(&mut t);
    assert!(out.is_empty(), "nothing new until the newline");
    fx.append(b"ep\",\"step\":2}\n");
    let (out, caught_up) = poll(&mut t);
    assert!(caught_up);
    assert_eq!(seqs(&out), vec![1]);
    assert_eq!(out[0].body, "{\"kind\":\"step\",\"step\":2}");
    assert_eq!(t.skipped_lines(), 0);
}

#[test]
fn final_read_takes_the_last_line_without_newline() {
    let fx = Fixture::new();
    fx.append(b"{\"kind\":\"exit\"}");
    let mut t = fx.tailer(Position::default());
    let mut out = Vec::new();
    assert!(t.poll(&mut out, &mut big_budget(), true).unwrap());
    assert_eq!(seqs(&out), vec![0]);
    assert!(t.ack(0));
    assert!(t.fully_acked());
    assert_eq!(t.acked().offset, 15);
}

#[test]
fn invalid_lines_are_skipped_counted_and_use_their_seq() {
    let fx = Fixture::new();
    fx.append(b"{\"kind\":\"a\"}\n");
    fx.append(b"this is not json\n");
    fx.append(b"[1,2,3]\n");
    fx.append(b"{\"step\":3}\n");
    fx.append(b"{\"kind\":5}\n");
    fx.append(b"{\"kind\":\"bad\xff\xfe\"}\n");
    fx.append(b"\n");
    fx.append(b"{\"kind\":\"b\",\"step\":\"x\"}\n");
    let mut t = fx.tailer(Position::default());
    let (out, caught_up) = poll(&mut t);
    assert!(caught_up);
    assert_eq!(seqs(&out), vec![0, 7]);
    assert_eq!(out[1].kind, "b");
    assert_eq!(out[1].step, -1, "a non-integer step keeps the receipt, without a step");
    assert_eq!(t.skipped_lines(), 6);
}

#[test]
fn ten_megabyte_line_is_skipped_without_buffering_it() {
    let fx = Fixture::new();
    fx.append(b"{\"kind\":\"a\"}\n");
    let mut huge = b"{\"kind\":\"huge\",\"pad\":\"".to_vec();
    huge.resize(10 << 20, b'x');
    huge.extend_from_slice(b"\"}\n");
    fx.append(&huge);
    fx.append(b"{\"kind\":\"b\"}\n");
    let mut t = fx.tailer(Position::default());
    let (out, caught_up) = poll(&mut t);
    assert!(caught_up);
    assert_eq!(seqs(&out), vec![0, 2]);
    assert_eq!(t.skipped_lines(), 1);
    assert!(t.partial.capacity() <= 2 * MAX_LINE_BYTES, "buffered {} bytes", t.partial.capacity());
    // The skip rides on the ack of seq 0; acking seq 2 lands after the last line.
    t.ack(0);
    assert_eq!(t.acked().next_seq, 2);
    assert_eq!(t.acked().skipped, 1);
    t.ack(2);
    assert!(t.fully_acked());
}

#[test]
fn line_of_exactly_the_limit_is_kept() {
    let fx = Fixture::new();
    let mut line = b"{\"kind\":\"edge\",\"pad\":\"".to_vec();
    line.resize(MAX_LINE_BYTES - 2, b'y');
    line.extend_from_slice(b"\"}");
    assert_eq!(line.len(), MAX_LINE_BYTES);
    line.push(b'\n');
    fx.append(&line);
    let (out, _) = poll(&mut fx.tailer(Position::default()));
    assert_eq!(seqs(&out), vec![0]);
    assert_eq!(out[0].body.len(), MAX_LINE_BYTES);
}

#[test]
fn line_one_byte_over_the_limit_is_skipped_and_counted() {
    let fx = Fixture::new();
    let mut line = b"{\"kind\":\"edge\",\"pad\":\"".to_vec();
    line.resize(MAX_LINE_BYTES - 1, b'y');
    line.extend_from_slice(b"\"}");
    assert_eq!(line.len(), MAX_LINE_BYTES + 1);
    line.extend_from_slice(b"\n{\"kind\":\"after\"}\n");
    fx.append(&line);
    let mut t = fx.tailer(Position::default());
    let (out, _) = poll(&mut t);
    assert_eq!(seqs(&out), vec![1], "the long line is skipped, the next one kept");
    assert_eq!(t.skipped_lines(), 1);
}

#[test]
fn over_long_partial_line_is_skipped_once_its_newline_arrives() {
    let fx = Fixture::new();
    fx.append(&vec![b'z'; MAX_LINE_BYTES + 10]);
    let mut t = fx.tailer(Position::default());
    let (out, caught_up) = poll(&mut t);
    assert!(out.is_empty() && !caught_up);
    fx.append(b"zz\n{\"kind\":\"after\"}\n");
    let (out, caught_up) = poll(&mut t);
    assert!(caught_up);
    assert_eq!(seqs(&out), vec![1]);
    assert_eq!(t.skipped_lines(), 1);
}

#[test]
fn ack_advances_durable_position_to_just_after_the_line() {
    let fx = Fixture::new();
    let lines = ["{\"kind\":\"a\"}\n", "{\"kind\":\"bb\"}\n", "{\"kind\":\"ccc\"}\n"];
    for line in lines {
        fx.append(line.as_bytes());
    }
    let mut t = fx.tailer(Position::default());
    poll(&mut t);
    assert_eq!(t.acked(), Position::default());
    assert!(t.ack(7_000), "an ack past the last sent line acks them all");
    assert_eq!(t.acked().next_seq, 3);
    assert!(t.fully_acked());
    let mut t = fx.tailer(Position::default());
    poll(&mut t);
    assert!(t.ack(1));
    assert!(t.take_acked_dirty());
    assert!(!t.take_acked_dirty());
    let expected = (lines[0].len() + lines[1].len()) as u64;
    assert_eq!(t.acked(), Position { offset: expected, next_seq: 2, skipped: 0 });
    assert!(!t.ack(1), "an old ack moves nothing");
    assert!(t.has_unacked());
    assert!(!t.fully_acked());
}

#[test]
fn rewind_after_reconnect_replays_exactly_the_unacked_lines() {
    let fx = Fixture::new();
    for i in 0..5 {
        fx.append(format!("{{\"kind\":\"step\",\"step\":{i}}}\n").as_bytes());
    }
    fx.append(b"garbage\n");
    fx.append(b"{\"kind\":\"step\",\"step\":6}\n");
    let mut t = fx.tailer(Position::default());
    let (out, _) = poll(&mut t);
    assert_eq!(seqs(&out), vec![0, 1, 2, 3, 4, 6]);
    assert_eq!(t.skipped_lines(), 1);
    t.ack(2);
    t.rewind();
    let (out, caught_up) = poll(&mut t);
    assert!(caught_up);
    assert_eq!(seqs(&out), vec![3, 4, 6]);
    assert_eq!(out[0].step, 3);
    assert_eq!(t.skipped_lines(), 1, "the garbage line is not counted twice");
    t.ack(6);
    t.rewind();
    let (out, _) = poll(&mut t);
    assert!(out.is_empty());
    assert!(t.fully_acked());
}

/// The acks of a `HelloAck` arrive after the rewind: they still move the durable position, and
/// the lines they cover are not sent again.
#[test]
fn acks_after_a_rewind_skip_what_the_controller_already_stored() {
    let fx = Fixture::new();
    for i in 0..6 {
        fx.append(format!("{{\"kind\":\"step\",\"step\":{i}}}\n").as_bytes());
    }
    fx.append(b"garbage\n");
    fx.append(b"{\"kind\":\"step\",\"step\":7}\n");
    let mut t = fx.tailer(Position::default());
    let (out, _) = poll(&mut t);
    assert_eq!(seqs(&out), vec![0, 1, 2, 3, 4, 5, 7]);
    t.ack(1);
    // The stream breaks before the acks of 2..=4 arrive; the new stream's HelloAck carries 4.
    t.rewind();
    assert!(!t.ack(4), "nothing in flight moved");
    let (out, caught_up) = poll(&mut t);
    assert!(caught_up);
    assert_eq!(seqs(&out), vec![5, 7], "2..=4 were stored already");
    assert_eq!(t.acked().next_seq, 5, "the durable position moved past 4");
    assert!(t.take_acked_dirty());
    assert_eq!(t.skipped_lines(), 1);
    // An agent restarted from that durable position starts at 5.
    let mut again = fx.tailer(t.acked());
    assert_eq!(seqs(&poll(&mut again).0), vec![5, 7]);
}

#[test]
fn restart_from_persisted_position_resumes_there() {
    let fx = Fixture::new();
    for i in 0..4 {
        fx.append(format!("{{\"kind\":\"step\",\"step\":{i}}}\n").as_bytes());
    }
    let mut t = fx.tailer(Position::default());
    poll(&mut t);
    t.ack(1);
    let persisted: Position = serde_json::from_str(&serde_json::to_string(&t.acked()).unwrap()).unwrap();
    drop(t);
    fx.append(b"{\"kind\":\"step\",\"step\":4}\n");
    let mut t = fx.tailer(persisted);
    let (out, _) = poll(&mut t);
    assert_eq!(seqs(&out), vec![2, 3, 4]);
    assert_eq!(out[0].step, 2);
}

#[test]
fn skipped_lines_with_nothing_in_flight_advance_the_durable_position() {
    let fx = Fixture::new();
    fx.append(b"nope\nnope\n");
    let mut t = fx.tailer(Position::default());
    poll(&mut t);
    assert_eq!(t.acked(), Position { offset: 10, next_seq: 2, skipped: 2 });
    assert!(t.take_acked_dirty());
    assert!(t.fully_acked());
}

#[test]
fn budget_limits_a_batch_and_the_rest_follows() {
    let fx = Fixture::new();
    for i in 0..10 {
        fx.append(format!("{{\"kind\":\"step\",\"step\":{i}}}\n").as_bytes());
    }
    let mut t = fx.tailer(Position::default());
    let mut out = Vec::new();
    assert!(!t.poll(&mut out, &mut Budget::new(4, 1 << 20), false).unwrap());
    assert_eq!(seqs(&out), vec![0, 1, 2, 3]);
    let mut out = Vec::new();
    // 30 bytes: one 24-byte line fits, the second does not.
    assert!(!t.poll(&mut out, &mut Budget::new(100, 30), false).unwrap());
    assert_eq!(seqs(&out), vec![4]);
    let mut out = Vec::new();
    // A line longer than the whole byte budget still goes into an empty batch.
    assert!(!t.poll(&mut out, &mut Budget::new(100, 3), false).unwrap());
    assert_eq!(seqs(&out), vec![5]);
    let mut out = Vec::new();
    assert!(t.poll(&mut out, &mut big_budget(), false).unwrap());
    assert_eq!(seqs(&out), vec![6, 7, 8, 9]);
}

mod props {
    use proptest::prelude::*;

    use super::*;

    /// A receipts file line: a receipt, garbage (any bytes but a newline), or an over-long line.
    fn line() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            4 => (0i64..1_000_000).prop_map(|s| format!(r#"{{"kind":"step","step":{s}}}"#).into_bytes()),
            2 => proptest::collection::vec(any::<u8>().prop_filter("no newline", |b| *b != b'\n'), 0..80),
            1 => Just(vec![b'x'; MAX_LINE_BYTES + 1]),
        ]
    }

    /// What `parse_receipt` must decide, read the slow way: through a whole `serde_json::Value`.
    fn reference(bytes: &[u8]) -> Option<(String, i64)> {
        let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
        let object = value.as_object()?;
        let kind = object.get("kind")?.as_str()?;
        Some((kind.to_string(), object.get("step").and_then(serde_json::Value::as_i64).unwrap_or(-1)))
    }

    /// JSON-shaped lines: objects with `kind`, `step` and other keys in any order, repeated,
    /// escaped or of the wrong type, nested values, non-objects and cut-off text.
    fn json_line() -> impl Strategy<Value = String> {
        let key = prop_oneof![Just("kind"), Just("step"), Just("k\\u0069nd"), Just("loss"), Just("pad")];
        let value = prop_oneof![
            Just("\"step\"".to_string()),
            Just("\"ev\\u0061l\"".to_string()),
            (-5i64..1_000_000_000_000).prop_map(|n| n.to_string()),
            Just("1.5".to_string()),
            Just("null".to_string()),
            Just("[1, {\"kind\": \"inner\"}]".to_string()),
            Just("{\"step\": 3}".to_string()),
            Just("18446744073709551615".to_string()),
        ];
        let object = proptest::collection::vec((key, value), 0..6).prop_map(|pairs| {
            let fields: Vec<String> = pairs.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
            format!("{{{}}}", fields.join(", "))
        });
        prop_oneof![
            6 => object.clone(),
            1 => object.clone().prop_map(|o| format!("[{o}]")),
            1 => object.clone().prop_map(|o| format!("{o} trailing")),
            1 => (object, 0usize..40).prop_map(|(o, cut)| o[..cut.min(o.len())].to_string()),
            1 => Just("\"kind\"".to_string()),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Lines written in arbitrary pieces, polled between the pieces: every line gets its
        /// sequence number, the receipts among them are sent exactly once and in order, the
        /// rest are skipped and counted, and memory stays bounded.
        #[test]
        fn any_lines_in_any_pieces_are_sent_or_skipped_once(
            lines in proptest::collection::vec(line(), 1..12),
            cuts in proptest::collection::vec(1usize..5_000, 1..8),
        ) {
            let fx = Fixture::new();
            let mut bytes = Vec::new();
            for l in &lines {
                bytes.extend_from_slice(l);
                bytes.push(b'\n');
            }
            let mut t = fx.tailer(Position::default());
            let mut sent = Vec::new();
            let mut at = 0;
            for cut in cuts.iter().cycle() {
                if at >= bytes.len() {
                    break;
                }
                let end = (at + cut).min(bytes.len());
                fx.append(&bytes[at..end]);
                at = end;
                sent.extend(poll(&mut t).0);
                prop_assert!(t.partial.capacity() <= 2 * MAX_LINE_BYTES);
            }
            sent.extend(poll(&mut t).0);
            let expected: Vec<u64> = lines
                .iter()
                .enumerate()
                .filter(|(_, l)| l.len() <= MAX_LINE_BYTES && parse_receipt(l).is_ok())
                .map(|(i, _)| i as u64)
                .collect();
            prop_assert_eq!(seqs(&sent), expected.clone());
            prop_assert_eq!(t.skipped_lines() as usize, lines.len() - expected.len());
        }

        /// The receipt parser, which checks each line without building a `Value`, decides as
        /// the `Value` reading does: the same lines kept, with the same kind and step.
        #[test]
        fn the_streaming_parser_agrees_with_a_whole_value_reading(line in json_line()) {
            prop_assert_eq!(parse_receipt(line.as_bytes()).ok(), reference(line.as_bytes()), "{}", line);
        }
    }
}

/// A controller that never acknowledges (it does not know the job): the tailer stops reading at
/// MAX_UNACKED_BYTES past the acknowledged position, says so, and resumes once acks come.
#[test]
fn reading_waits_at_the_unacknowledged_window() {
    let fx = Fixture::new();
    let line = format!("{{\"kind\":\"step\",\"pad\":\"{}\"}}\n", "p".repeat(1000));
    let lines = (MAX_UNACKED_BYTES as usize / line.len()) + 100;
    fx.append(line.repeat(lines).as_bytes());
    let mut t = fx.tailer(Position::default());
    let mut sent = Vec::new();
    for _ in 0..10 {
        sent.extend(poll(&mut t).0);
    }
    assert!(t.held(), "reading waits");
    let window = (MAX_UNACKED_BYTES as usize).div_ceil(line.len());
    let chunk_lines = CHUNK_BYTES.div_ceil(line.len());
    assert!(
        (window..=window + chunk_lines).contains(&sent.len()),
        "the window and at most one chunk: {}",
        sent.len()
    );
    t.ack(sent.last().unwrap().seq);
    sent.extend(poll(&mut t).0);
    assert!(!t.held());
    assert_eq!(sent.len(), lines, "the rest follows once acknowledged");
}

#[test]
fn ranks_take_turns_after_the_one_that_filled_a_batch() {
    let id = |rank| RankId { job_id: 1, attempt: 0, rank };
    let ids = [id(0), id(1), id(2), id(3)];
    let order = |filled| reading_order(&ids, filled).map(|i| i.rank).collect::<Vec<_>>();
    assert_eq!(order(None), [0, 1, 2, 3]);
    assert_eq!(order(Some(id(0))), [1, 2, 3, 0]);
    assert_eq!(order(Some(id(3))), [0, 1, 2, 3]);
    // The rank that filled it has ended and was forgotten since: the next one on.
    assert_eq!(order(Some(RankId { job_id: 1, attempt: 0, rank: 9 })), [0, 1, 2, 3]);
    assert_eq!(reading_order(&ids[..2], Some(id(1))).map(|i| i.rank).collect::<Vec<_>>(), [0, 1]);
}
