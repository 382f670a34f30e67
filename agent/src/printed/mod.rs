//! The step lines a rank prints, read by the agent from the rank's stdout and stderr as they are
//! written, and merged into the rank's step receipts (docs/receipts.md, "Printed step lines").
//!
//! # Layout
//! - [`parse`]: the formats (pure).
//! - this module: [`Printed`], one rank's reader and merge.
//!
//! Two cases, told apart by whether the rank's receipts file holds step receipts of its own (the
//! bootstrap's, the helper's, the engine's):
//! - **it does**: a printed step's fields are merged into the rank's step receipt of the same
//!   step as the tailer reads it (fields the receipt lacks; a printed step time wins, as it is
//!   the script's own measure, without its evaluations and checkpoints). A step receipt waits
//!   for its printed line at most [`HOLD_FOR_LINE`], and only when the rank prints every step it
//!   is expected at (its printing stride). A printed line for a step already sent is counted
//!   late.
//! - **it does not** (a script that is not PyTorch, or `torch` imported by something the
//!   bootstrap does not see): after [`HOLD_FOR_RECEIPT`] without a receipt for its step, the
//!   agent writes the step receipt itself, appended to the rank's receipts file with the
//!   producer `trainyard agent (printed lines)`, so it gets a sequence number as every line of
//!   that file does (durable across agent restarts, never stored twice). The last step written
//!   so is saved before the line is appended: an agent killed in between loses that one
//!   receipt, it never writes it twice.
//!
//! Hugging Face's printed dict has no step: such lines are numbered by their order (the n-th
//! dict is step n-1), which holds for `logging_steps = 1`; a rank with the bootstrap gets
//! Trainer's values from `Trainer.log` instead, with their step.
//!
//! Bounded whatever the rank prints: at most [`MAX_READ_PER_POLL`] bytes of each stream a
//! poll, lines over [`MAX_LINE_BYTES`] skipped without being held, at most [`MAX_PENDING`]
//! printed steps waiting.

pub mod parse;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use parse::{Format, Parsed, Parser, StepLine};

/// How long a step receipt waits for the line its rank prints for that step.
pub const HOLD_FOR_LINE: Duration = Duration::from_millis(800);
/// How long a printed step waits for a receipt of the rank's own before the agent writes one:
/// longer than the bootstrap holds a step (1 s) plus a tick.
pub const HOLD_FOR_RECEIPT: Duration = Duration::from_millis(1500);
/// Printed steps kept waiting; the oldest go first (counted as unmatched).
pub const MAX_PENDING: usize = 512;
/// Bytes of one stream read in one poll.
pub const MAX_READ_PER_POLL: usize = 1 << 20;
/// Longer lines are skipped (read through, never held whole).
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// Printed steps older than this that found no receipt are dropped.
const MAX_PENDING_AGE: Duration = Duration::from_secs(30);

/// What survives an agent restart (in the rank's state record).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrintedPosition {
    /// Bytes of stdout and stderr read.
    pub stdout: u64,
    pub stderr: u64,
    /// The last step the agent wrote a receipt for (-1: none).
    pub written_through: i64,
    /// Hugging Face dicts counted so far (their step numbers).
    pub dicts: i64,
}

/// What the rank's state record keeps of its reader.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrintedState {
    /// The job's `[receipts] pattern`.
    pub pattern: Option<String>,
    pub position: PrintedPosition,
}

/// Counts for the rank's report and the agent's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrintedCounts {
    pub lines: u64,
    pub steps: u64,
    pub bad: u64,
    pub late: u64,
    pub unmatched: u64,
    pub written: u64,
}

/// A printed step waiting for its receipt.
#[derive(Debug, Clone)]
struct Pending {
    at: Instant,
    fields: BTreeMap<String, (f64, &'static str)>,
    /// Milliseconds a step between the polls that read new steps (a step time for a receipt
    /// the agent writes when the line gives none).
    gap_ms: Option<f64>,
}

/// The producer of the step receipts the agent writes, and how it reads in their text.
const AGENT_PRODUCER: &str = "trainyard agent (printed lines)";
const AGENT_WROTE: &str = r#""producer":"trainyard agent (printed lines)""#;

/// The source of a step time the agent measured between two printed lines.
const GAP_SOURCE: &str = "agent clock between printed lines";

/// One stream (stdout or stderr) read line by line from a position.
#[derive(Debug)]
struct Stream {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    too_long: bool,
}

impl Stream {
    fn new(path: PathBuf, offset: u64) -> Stream {
        Stream { path, offset, partial: Vec::new(), too_long: false }
    }

    /// Complete lines appended since the last call (at most [`MAX_READ_PER_POLL`] bytes).
    /// `offset` counts what was read, the partial line included; a partial line is kept.
    fn read_lines(&mut self, mut each: impl FnMut(&str)) -> std::io::Result<()> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        file.seek(SeekFrom::Start(self.offset))?;
        let mut buf = vec![0; 64 * 1024];
        let mut left = MAX_READ_PER_POLL;
        while left > 0 {
            let n = file.read(&mut buf[..left.min(64 * 1024)])?;
            if n == 0 {
                break;
            }
            left -= n;
            self.offset += n as u64;
            let mut chunk = &buf[..n];
            while let Some(i) = chunk.iter().position(|&b| b == b'\n') {
                self.take(&chunk[..i]);
                if !self.too_long {
                    each(&String::from_utf8_lossy(&self.partial));
                }
                self.partial.clear();
                self.too_long = false;
                chunk = &chunk[i + 1..];
            }
            self.take(chunk);
        }
        Ok(())
    }

    fn take(&mut self, bytes: &[u8]) {
        if self.too_long || self.partial.len() + bytes.len() > MAX_LINE_BYTES {
            self.too_long = true;
            self.partial.clear();
        } else {
            self.partial.extend_from_slice(bytes);
        }
    }

    /// The position of the last complete line (what a restarted agent reads from).
    fn line_start(&self) -> u64 {
        if self.too_long { self.offset } else { self.offset - self.partial.len() as u64 }
    }
}

/// Whether a step receipt the tailer reads goes now or waits for its printed line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    Now,
    Wait,
}

/// One rank's printed step lines.
#[derive(Debug)]
pub struct Printed {
    parser: Parser,
    out: Stream,
    err: Stream,
    pending: BTreeMap<i64, Pending>,
    /// The last two printed steps (their difference is the rank's printing stride).
    last: Option<i64>,
    stride: i64,
    /// The rank's receipts file has step receipts of its own.
    own_steps: bool,
    /// The step receipt waiting for its line, since when.
    waiting: Option<(i64, Instant)>,
    position: PrintedPosition,
    dirty: bool,
    /// When the last poll that read a new step ran (first: when reading began), and the
    /// highest step read then.
    arrival: (Instant, Option<i64>),
    pub counts: PrintedCounts,
}

impl Printed {
    /// A reader of the rank whose output files are `stdout` and `stderr`, from `position`.
    pub fn new(parser: Parser, stdout: &Path, stderr: &Path, position: PrintedPosition) -> Printed {
        Printed {
            parser,
            out: Stream::new(stdout.to_path_buf(), position.stdout),
            err: Stream::new(stderr.to_path_buf(), position.stderr),
            pending: BTreeMap::new(),
            last: None,
            stride: 0,
            own_steps: false,
            waiting: None,
            position,
            dirty: false,
            arrival: (Instant::now(), None),
            counts: PrintedCounts::default(),
        }
    }

    /// Reads what the rank printed since the last poll.
    pub fn poll(&mut self, now: Instant) -> std::io::Result<()> {
        let mut lines: Vec<String> = Vec::new();
        self.out.read_lines(|l| lines.push(l.to_string()))?;
        self.err.read_lines(|l| lines.push(l.to_string()))?;
        for line in lines {
            self.line(&line, now);
        }
        self.time_new_steps(now);
        let (out, err) = (self.out.line_start(), self.err.line_start());
        if (out, err) != (self.position.stdout, self.position.stderr) {
            self.position.stdout = out;
            self.position.stderr = err;
            self.dirty = true;
        }
        while self.pending.len() > MAX_PENDING {
            self.pending.pop_first();
            self.counts.unmatched += 1;
        }
        Ok(())
    }

    /// The steps first read in this poll share the time since the previous poll that read a
    /// new step, evenly: lines read in one go arrived together, whenever they were printed.
    fn time_new_steps(&mut self, now: Instant) {
        let (then, previous) = self.arrival;
        let Some(last) = self.last.filter(|l| previous.is_none_or(|p| *l > p)) else { return };
        let first = previous.map_or(0, |p| p + 1);
        let ms = now.duration_since(then).as_secs_f64() * 1e3 / (last - first + 1) as f64;
        for (_, p) in self.pending.range_mut(first..=last) {
            p.gap_ms.get_or_insert(ms);
        }
        self.arrival = (now, Some(last));
    }

    fn line(&mut self, line: &str, now: Instant) {
        self.counts.lines += 1;
        let s = match self.parser.parse(line) {
            Parsed::Other => return,
            Parsed::Bad(why) => {
                self.counts.bad += 1;
                tracing::debug!(reason = %why, "skipping a printed step line");
                return;
            }
            Parsed::Step(s) => s,
        };
        let step = match s.step {
            Some(step) => step,
            None => {
                self.position.dicts += 1;
                self.position.dicts - 1
            }
        };
        // Two lines of one step (modded-nanogpt's validation and training lines) merge; a
        // step before the last one printed is not a step line of this run.
        if self.last.is_some_and(|last| step < last && !self.pending.contains_key(&step)) {
            self.counts.bad += 1;
            return;
        }
        self.counts.steps += 1;
        if let Some(last) = self.last.filter(|l| step > *l) {
            self.stride = step - last;
        }
        self.last = Some(self.last.map_or(step, |l| l.max(step)));
        let entry = self.pending.entry(step).or_insert_with(|| Pending {
            at: now,
            fields: BTreeMap::new(),
            gap_ms: None,
        });
        for (name, value) in s.fields {
            entry.fields.insert(name, (value, s.format.source()));
        }
    }

    /// The tailer reads step receipt `step` of this rank with `body`: merges the printed fields
    /// of that step into it, or says to wait for them. `last_read` (the rank ended) never waits.
    pub fn merge(&mut self, step: i64, body: &mut String, last_read: bool, now: Instant) -> Merge {
        if body.contains(AGENT_WROTE) {
            return Merge::Now; // one the agent wrote from printed lines: not the rank's own
        }
        self.own_steps = true;
        let Some(p) = self.pending.remove(&step) else {
            // Until a second line shows its stride, a rank that printed is expected every step.
            let expected = self.last.is_some_and(|l| step == l + self.stride.max(1));
            let since = match self.waiting {
                Some((s, at)) if s == step => at,
                _ => {
                    self.waiting = Some((step, now));
                    now
                }
            };
            if expected && !last_read && now.duration_since(since) < HOLD_FOR_LINE {
                return Merge::Wait;
            }
            return Merge::Now;
        };
        self.waiting = None;
        if let Some(merged) = merge_into_text(body, &p.fields) {
            *body = merged;
        }
        Merge::Now
    }

    /// Step receipts the agent writes itself, for printed steps of a rank without receipts of
    /// its own that waited [`HOLD_FOR_RECEIPT`] (all of them once `ended`): JSON lines, in step
    /// order. Call [`Printed::take_dirty`] and save the position before appending them.
    pub fn due(&mut self, now: Instant, ended: bool) -> Vec<String> {
        let mut lines = Vec::new();
        let steps: Vec<i64> = self.pending.keys().copied().collect();
        for step in steps {
            let p = &self.pending[&step];
            let age = now.duration_since(p.at);
            if self.own_steps {
                if age > MAX_PENDING_AGE || ended {
                    self.pending.remove(&step);
                    self.counts.late += 1;
                }
                continue;
            }
            if !ended && age < HOLD_FOR_RECEIPT {
                break;
            }
            let p = self.pending.remove(&step).expect("a pending step");
            if step <= self.position.written_through {
                continue;
            }
            let mut map = Map::new();
            map.insert("kind".into(), "step".into());
            map.insert("schema".into(), 1.into());
            map.insert("step".into(), step.into());
            map.insert("producer".into(), AGENT_PRODUCER.into());
            let mut fields = p.fields;
            if let (false, Some(gap)) = (fields.contains_key("step_time_ms"), p.gap_ms) {
                fields.insert("step_time_ms".into(), (gap, GAP_SOURCE));
            }
            merge_fields(&mut map, &fields);
            lines.push(Value::Object(map).to_string());
            self.position.written_through = step;
            self.dirty = true;
            self.counts.written += 1;
        }
        lines
    }

    /// The position to save, when it moved since the last call.
    pub fn take_dirty(&mut self) -> Option<PrintedPosition> {
        std::mem::take(&mut self.dirty).then_some(self.position)
    }
}

/// [`merge_fields`] on a receipt's text, keeping every value the rank wrote exactly as written:
/// the body is read as raw JSON values, so no number is parsed and printed again (a float read
/// by serde_json's default parser can come back one unit in the last place off). `None` when
/// the body is not a JSON object (it goes as it is).
fn merge_into_text(body: &str, fields: &BTreeMap<String, (f64, &'static str)>) -> Option<String> {
    use serde_json::value::RawValue;
    let raw: BTreeMap<String, Box<RawValue>> = serde_json::from_str(body).ok()?;
    let mut sources: Map<String, Value> =
        raw.get("sources").and_then(|s| serde_json::from_str(s.get()).ok()).unwrap_or_default();
    let mut out: BTreeMap<String, Box<RawValue>> = raw;
    let put = |map: &mut BTreeMap<String, Box<RawValue>>, name: &str, value: f64| {
        if let Some(n) = serde_json::Number::from_f64(value)
            && let Ok(raw) = RawValue::from_string(n.to_string())
        {
            map.insert(name.to_string(), raw);
        }
    };
    for (name, (value, source)) in fields {
        if name == "step_time_ms" {
            if let Some(hook) = out.remove("step_time_ms") {
                out.insert("hook_step_time_ms".into(), hook);
            }
        } else if out.contains_key(name) {
            continue;
        }
        put(&mut out, name, *value);
        sources.insert(name.clone(), Value::String((*source).to_string()));
    }
    if !sources.is_empty() {
        out.insert("sources".into(), RawValue::from_string(Value::Object(sources).to_string()).ok()?);
    }
    serde_json::to_string(&out).ok()
}

/// Printed fields into a receipt the agent writes: those it lacks, and a printed step time over
/// another; each one's source in `sources`.
fn merge_fields(map: &mut Map<String, Value>, fields: &BTreeMap<String, (f64, &'static str)>) {
    let mut sources = match map.remove("sources") {
        Some(Value::Object(s)) => s,
        _ => Map::new(),
    };
    for (name, (value, source)) in fields {
        let Some(number) = serde_json::Number::from_f64(*value) else { continue };
        if name == "step_time_ms" {
            if let Some(hook) = map.remove("step_time_ms") {
                map.insert("hook_step_time_ms".into(), hook);
            }
        } else if map.contains_key(name) {
            continue;
        }
        map.insert(name.clone(), Value::Number(number));
        sources.insert(name.clone(), Value::String((*source).to_string()));
    }
    if !sources.is_empty() {
        map.insert("sources".into(), Value::Object(sources));
    }
}

#[cfg(test)]
mod tests;
