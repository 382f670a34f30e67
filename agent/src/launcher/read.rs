//! Reading a rank each tick: what it printed, then its receipts, the printed step lines merged
//! into its step receipts (see [`crate::printed`]).

use std::time::Instant;

use tracing::warn;
use trainyard_proto::v1::Receipt;

use crate::layout::Layout;
use crate::printed::{Merge, Parser, Printed};
use crate::state::RankRecord;
use crate::tail::{Budget, Tailer};

/// A rank the agent knows: its durable record, the tailer of its receipts and the reader of its
/// printed step lines ([`Rank::read`]).
#[derive(Debug)]
pub struct Rank {
    pub record: RankRecord,
    pub tailer: Tailer,
    pub printed: Option<crate::printed::Printed>,
}

impl Rank {
    /// The rank as its record describes it, read from where the record says it was read to.
    pub fn open(record: crate::state::RankRecord) -> Rank {
        let tailer = Tailer::new(record.id, record.files.receipts.clone(), record.acked);
        let printed = record.printed.as_ref().and_then(|p| match Parser::new(p.pattern.as_deref()) {
            Ok(parser) => Some(Printed::new(parser, &record.files.stdout, &record.files.stderr, p.position)),
            Err(e) => {
                warn!(rank_id = %record.id, error = %e, "the job's printed-line pattern does not compile here; its printed lines are not read");
                None
            }
        });
        Rank { record, tailer, printed }
    }

    /// Reads what the rank printed (writing the step receipts the agent owes a rank without
    /// receipts of its own), then its receipts into `out` while `budget` allows. Returns the
    /// tailer's answer: whether the receipts file was read to its end.
    pub fn read(
        &mut self,
        out: &mut Vec<Receipt>,
        budget: &mut Budget,
        layout: &Layout,
    ) -> std::io::Result<bool> {
        let ended = self.record.phase.is_done();
        let now = Instant::now();
        if let Some(printed) = &mut self.printed {
            if let Err(e) = printed.poll(now) {
                warn!(rank_id = %self.record.id, error = %e, "failed to read the rank's output");
            }
            let lines = printed.due(now, ended);
            self.save_printed(layout);
            if !lines.is_empty() {
                super::receipts_file::append(&self.record.files.receipts, &lines)?;
            }
        }
        let tailer = &mut self.tailer;
        match &mut self.printed {
            Some(printed) => tailer.poll_merged(out, budget, ended, &mut |step, body| {
                printed.merge(step, body, ended, now) == Merge::Now
            }),
            None => tailer.poll(out, budget, ended),
        }
    }

    /// Saves the reader's position when it moved: before the receipts it owes are appended, so
    /// that a restarted agent never writes one twice.
    pub fn save_printed(&mut self, layout: &Layout) {
        let (Some(printed), Some(state)) = (&mut self.printed, &mut self.record.printed) else { return };
        if let Some(position) = printed.take_dirty() {
            state.position = position;
            if let Err(e) = self.record.save(layout) {
                warn!(rank_id = %self.record.id, error = %e, "failed to save where the rank's output was read to");
            }
        }
    }
}
