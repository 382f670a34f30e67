//! The receipts tailer: turns the lines a rank appends to its receipts file into `Receipt`s,
//! and remembers how far the controller has acknowledged them.
//!
//! Positions are byte offsets paired with the line number (`seq`) of the line that starts
//! there, so a restarted agent can seek straight to the acknowledged point and keep numbering.
//! A line is only consumed once its newline is there (a writer may be mid-line), except when
//! the caller says the rank has ended (`final_read`): then nobody will finish the line and it
//! is taken as it is.
//!
//! Skipped lines (not UTF-8, not a JSON object with a string `kind`, over 1 MiB) use up their
//! seq and are counted. An over-long line is read through in chunks and never held in memory.
//! Their count is part of [`Position`], so a rewind does not count them twice.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use trainyard_proto::v1::Receipt;
use trainyard_proto::words::ReceiptKind;

use crate::layout::RankId;

/// Lines longer than this (without the newline) are skipped and counted, never buffered whole.
pub use trainyard_proto::limits::MAX_RECEIPT_LINE_BYTES as MAX_LINE_BYTES;

const CHUNK_BYTES: usize = 64 * 1024;

/// Bytes of a receipts file read past its acknowledged position before the tailer waits: the
/// controller stores and acknowledges within a batch or two, so only a controller that does not
/// acknowledge a rank's receipts (it does not know the job) holds a rank here. Its receipts
/// stay in the file, to be sent again on the next stream.
pub const MAX_UNACKED_BYTES: u64 = 64 << 20;

/// Ranks in the order a batch reads them (`ids` sorted): from the one after `filled_by`, the
/// rank that filled the last full batch, round to it.
pub fn reading_order(ids: &[RankId], filled_by: Option<RankId>) -> impl Iterator<Item = RankId> + '_ {
    let first = filled_by.map_or(0, |last| ids.partition_point(|id| *id <= last));
    ids[first..].iter().chain(&ids[..first]).copied()
}

/// A point in a receipts file: the start of line `next_seq`, with `skipped` lines skipped
/// before it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    pub offset: u64,
    pub next_seq: u64,
    pub skipped: u64,
}

/// How much one batch may still take, shared by the tailers of all ranks.
#[derive(Debug, Clone)]
pub struct Budget {
    receipts_left: usize,
    bytes_left: usize,
    bytes_taken: usize,
}

impl Budget {
    pub fn new(max_receipts: usize, max_bytes: usize) -> Self {
        Self { receipts_left: max_receipts, bytes_left: max_bytes, bytes_taken: 0 }
    }

    pub fn exhausted(&self) -> bool {
        self.receipts_left == 0 || self.bytes_left == 0
    }

    /// Takes room for one receipt of `bytes`. A line longer than the whole byte budget still
    /// fits into an empty batch, so no valid line can block its file forever.
    fn take(&mut self, bytes: usize) -> bool {
        let fits = bytes <= self.bytes_left || self.bytes_taken == 0;
        if self.receipts_left == 0 || !fits {
            return false;
        }
        self.receipts_left -= 1;
        self.bytes_left = self.bytes_left.saturating_sub(bytes);
        self.bytes_taken += bytes;
        true
    }
}

/// Tails one rank's receipts file.
#[derive(Debug)]
pub struct Tailer {
    id: RankId,
    path: PathBuf,
    /// Durable: acknowledged up to here.
    acked: Position,
    acked_dirty: bool,
    /// Start of the line being assembled (everything before it is consumed).
    line: Position,
    /// Bytes of the current line read so far.
    consumed: u64,
    /// The current line's bytes, unless it is over the limit (`too_long`).
    partial: Vec<u8>,
    too_long: bool,
    /// Sent, not yet acknowledged: seq of each sent receipt and the position after it (moved
    /// on past skipped lines that follow it).
    in_flight: VecDeque<(u64, Position)>,
    /// The controller has stored every receipt up to this seq, including lines this tailer has
    /// not read (again) yet: the acks of a `HelloAck`, which arrive after the rewind of a new
    /// stream. Such lines are passed over as acknowledged instead of being sent twice.
    stored_through: Option<u64>,
    /// Reading waits at [`MAX_UNACKED_BYTES`] past the acknowledged position.
    held: bool,
}

impl Tailer {
    /// A tailer that resumes at `acked` (the start of the file for a new rank).
    pub fn new(id: RankId, path: impl Into<PathBuf>, acked: Position) -> Self {
        Self {
            id,
            path: path.into(),
            acked,
            acked_dirty: false,
            line: acked,
            consumed: 0,
            partial: Vec::new(),
            too_long: false,
            in_flight: VecDeque::new(),
            stored_through: None,
            held: false,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The durable position: acknowledged up to here.
    pub fn acked(&self) -> Position {
        self.acked
    }

    /// Whether the acknowledged position moved since the last call (then persist it).
    pub fn take_acked_dirty(&mut self) -> bool {
        std::mem::take(&mut self.acked_dirty)
    }

    /// Lines skipped so far, up to where the tailer has read.
    pub fn skipped_lines(&self) -> u64 {
        self.line.skipped
    }

    /// Whether reading waits because [`MAX_UNACKED_BYTES`] are unacknowledged.
    pub fn held(&self) -> bool {
        self.held
    }

    /// Whether receipts were sent and are not acknowledged yet.
    pub fn has_unacked(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// Reads new complete lines into `out` while `budget` allows. Returns whether the file
    /// was read to its end with no line left pending (with `final_read`, a last line without
    /// newline is taken as complete). A missing file counts as empty.
    pub fn poll(
        &mut self,
        out: &mut Vec<Receipt>,
        budget: &mut Budget,
        final_read: bool,
    ) -> io::Result<bool> {
        self.poll_merged(out, budget, final_read, &mut |_, _| true)
    }

    /// [`Tailer::poll`], with `merge` called on each step receipt's body (its step, the body to
    /// change) before it is sent: `false` leaves the line unread for now (it is read again on
    /// the next poll), as a full budget does.
    pub fn poll_merged(
        &mut self,
        out: &mut Vec<Receipt>,
        budget: &mut Budget,
        final_read: bool,
        merge: &mut dyn FnMut(i64, &mut String) -> bool,
    ) -> io::Result<bool> {
        let mut file = match File::open(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(self.consumed == 0),
            Err(e) => return Err(e),
        };
        let read_from = self.line.offset + self.consumed;
        if read_from.saturating_sub(self.acked.offset) >= MAX_UNACKED_BYTES {
            if !self.held {
                self.held = true;
                tracing::warn!(
                    job_id = self.id.job_id,
                    attempt = self.id.attempt,
                    rank = self.id.rank,
                    unacked_bytes = read_from - self.acked.offset,
                    "the controller does not acknowledge this rank's receipts; holding them in the file (sent again on the next stream)"
                );
            }
            return Ok(false);
        }
        self.held = false;
        let len = file.metadata()?.len();
        if len < read_from {
            tracing::warn!(
                job_id = self.id.job_id,
                attempt = self.id.attempt,
                rank = self.id.rank,
                len,
                read_from,
                "receipts file shrank; waiting for it to grow past what was read"
            );
            return Ok(true);
        }
        file.seek(SeekFrom::Start(read_from))?;
        let read = self.read_lines(&mut file, out, budget, final_read, merge);
        start_writeback(&file, read_from, self.line.offset + self.consumed);
        read
    }

    /// The lines of `file` from where it stands, while `budget` allows: [`Tailer::poll_merged`]'s
    /// answer.
    fn read_lines(
        &mut self,
        file: &mut File,
        out: &mut Vec<Receipt>,
        budget: &mut Budget,
        final_read: bool,
        merge: &mut dyn FnMut(i64, &mut String) -> bool,
    ) -> io::Result<bool> {
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            if budget.exhausted() {
                return Ok(false);
            }
            // The window is checked per chunk read: at most one chunk past it.
            if (self.line.offset + self.consumed).saturating_sub(self.acked.offset) >= MAX_UNACKED_BYTES {
                return Ok(false);
            }
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            let mut chunk = &buf[..n];
            while let Some(i) = chunk.iter().position(|&b| b == b'\n') {
                self.append(&chunk[..i]);
                if !self.finish_line(out, budget, true, merge) {
                    return Ok(false);
                }
                chunk = &chunk[i + 1..];
                if budget.exhausted() && !chunk.is_empty() {
                    return Ok(false);
                }
            }
            self.append(chunk);
        }
        if final_read && self.consumed > 0 && !self.finish_line(out, budget, false, merge) {
            return Ok(false);
        }
        Ok(self.consumed == 0)
    }

    fn append(&mut self, bytes: &[u8]) {
        self.consumed += bytes.len() as u64;
        if self.too_long {
            return;
        }
        if self.partial.len() + bytes.len() > MAX_LINE_BYTES {
            self.too_long = true;
            self.partial = Vec::new();
        } else {
            self.partial.extend_from_slice(bytes);
        }
    }

    /// Ends the current line: a receipt into `out`, or a skip. `false` (and the line left
    /// unread, to be read again) when the budget has no room for it.
    fn finish_line(
        &mut self,
        out: &mut Vec<Receipt>,
        budget: &mut Budget,
        newline: bool,
        merge: &mut dyn FnMut(i64, &mut String) -> bool,
    ) -> bool {
        let seq = self.line.next_seq;
        let end = self.line.offset + self.consumed + u64::from(newline);
        if self.stored_through.is_some_and(|s| seq <= s) {
            // Stored already (acked before it was read again): acknowledged, not sent.
            let after = Position { offset: end, next_seq: seq + 1, skipped: self.line.skipped };
            match self.in_flight.back_mut() {
                Some(last) => last.1 = after,
                None => self.set_acked(after),
            }
            self.line = after;
            self.reset_line();
            return true;
        }
        let verdict = if self.too_long { Err("longer than 1 MiB") } else { parse_receipt(&self.partial) };
        let after = match verdict {
            Ok((kind, step)) => {
                if !budget.take(self.partial.len()) {
                    self.reset_line();
                    return false;
                }
                // parse_receipt checked the bytes are UTF-8.
                let mut body = String::from_utf8_lossy(&self.partial).into_owned();
                if kind == ReceiptKind::Step.as_str() && step >= 0 && !merge(step, &mut body) {
                    self.reset_line();
                    return false;
                }
                out.push(Receipt { key: Some(self.id.into()), seq, kind, step, body });
                let after = Position { offset: end, next_seq: seq + 1, skipped: self.line.skipped };
                self.in_flight.push_back((seq, after));
                after
            }
            Err(reason) => {
                tracing::warn!(
                    job_id = self.id.job_id,
                    attempt = self.id.attempt,
                    rank = self.id.rank,
                    seq,
                    reason,
                    "skipping receipt line"
                );
                let after = Position { offset: end, next_seq: seq + 1, skipped: self.line.skipped + 1 };
                match self.in_flight.back_mut() {
                    Some(last) => last.1 = after,
                    None => self.set_acked(after),
                }
                after
            }
        };
        self.line = after;
        self.reset_line();
        true
    }

    fn reset_line(&mut self) {
        self.consumed = 0;
        self.partial.clear();
        self.too_long = false;
    }

    fn set_acked(&mut self, position: Position) {
        if position != self.acked {
            self.acked = position;
            self.acked_dirty = true;
        }
    }

    /// The controller stored everything up to `seq`: move the durable position past it.
    /// Returns whether it moved. A `seq` beyond what was sent on this stream (the acks of a
    /// `HelloAck`, after [`Tailer::rewind`]) also takes effect: the lines up to it are passed
    /// over as acknowledged when they are read.
    pub fn ack(&mut self, seq: u64) -> bool {
        if seq >= self.line.next_seq {
            self.stored_through = Some(self.stored_through.map_or(seq, |s| s.max(seq)));
        }
        let mut advanced = None;
        while let Some(&(sent, after)) = self.in_flight.front() {
            if sent > seq {
                break;
            }
            advanced = Some(after);
            self.in_flight.pop_front();
        }
        match advanced {
            Some(after) => {
                self.set_acked(after);
                true
            }
            None => false,
        }
    }

    /// Forgets what was sent and not acknowledged, so it is read and sent again (after a
    /// reconnect, nothing unacknowledged is known to have arrived).
    pub fn rewind(&mut self) {
        self.in_flight.clear();
        self.stored_through = None;
        self.line = self.acked;
        self.reset_line();
    }

    /// Whether every line of the file, as long as it is now, is acknowledged.
    pub fn fully_acked(&self) -> bool {
        let len = std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0);
        self.in_flight.is_empty() && self.consumed == 0 && self.acked.offset >= len
    }
}

/// Asks the kernel to start writing back the bytes of a receipts file just read (`from..to`),
/// without waiting for it. A rank's receipts are written once and read once; left to the
/// kernel's periodic writeback (its dirty pages expire after 30 s by default), a flood of them
/// reaches the disk hundreds of MB at once, and every `fsync` on that disk waits meanwhile: a
/// controller's commits on the same machine stalled for up to a second every 30 s.
fn start_writeback(file: &File, from: u64, to: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(from), i64::try_from(to.saturating_sub(from))) else { return };
    if len > 0 {
        // SAFETY: `file` is an open descriptor and the call takes plain integers. It is a hint:
        // where a filesystem does not support it, nothing changes.
        unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE) };
    }
}

/// `(kind, step)` of a valid receipt line, or why it is not one. A `step` that is not an
/// integer is not a reason to drop the receipt: it is stored with step -1.
///
/// Every line is checked in full (valid JSON, one object) but only `kind` and `step` are kept:
/// building a whole `serde_json::Value` per line cost the agent more than reading the file.
fn parse_receipt(bytes: &[u8]) -> Result<(String, i64), &'static str> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not valid UTF-8")?;
    let mut de = serde_json::Deserializer::from_str(text);
    let head = match serde::Deserializer::deserialize_any(&mut de, HeadVisitor) {
        Ok(head) => head,
        Err(e) if e.is_data() => return Err("not a JSON object"),
        Err(_) => return Err("not valid JSON"),
    };
    de.end().map_err(|_| "not valid JSON")?;
    let kind = head.kind.and_then(|k| k.ok()).ok_or("no string \"kind\" field")?;
    Ok((kind, head.step.unwrap_or(-1)))
}

/// What [`parse_receipt`] keeps of a line: `kind` (`Err` when it is not a string) and `step`
/// (when an integer). A key given twice counts as its last value, as `serde_json::Value` reads it.
struct Head {
    kind: Option<Result<String, ()>>,
    step: Option<i64>,
}

struct HeadVisitor;

impl<'de> serde::de::Visitor<'de> for HeadVisitor {
    type Value = Head;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Head, A::Error> {
        let mut head = Head { kind: None, step: None };
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Kind => {
                    head.kind = Some(map.next_value::<Value>()?.as_str().map(str::to_owned).ok_or(()))
                }
                Key::Step => head.step = map.next_value::<Value>()?.as_i64(),
                Key::Other => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(head)
    }
}

/// A key of a receipt line, read without allocating.
enum Key {
    Kind,
    Step,
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct KeyVisitor;
        impl serde::de::Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Key, E> {
                Ok(match key {
                    "kind" => Key::Kind,
                    "step" => Key::Step,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
#[path = "tail_tests.rs"]
mod tests;
