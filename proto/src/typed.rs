//! The one conversion between the wire's words and [`crate::words`]: a typed accessor for every
//! field of a message that carries a word. Whoever receives a message reads its words here, so
//! an unknown word is an [`UnknownWord`] naming the field's concept, the word and what was
//! expected, never a string compared against literals. Whoever builds a message writes the
//! word with the enum's `to_string()`.
//!
//! An empty optional word (`interconnect_class` or `verdict` before a node's first preflight,
//! `run_level` when no preflight is asked for) reads as `None`.

use crate::v1;
use crate::words::{
    Cause, CheckStatus, InterconnectClass, JobState, LogStream, NodeState, PreflightLevel, RankState,
    UnknownWord, Verdict,
};

/// `""` as `None`, any other word parsed.
fn optional<T: std::str::FromStr<Err = UnknownWord>>(word: &str) -> Result<Option<T>, UnknownWord> {
    if word.is_empty() { Ok(None) } else { word.parse().map(Some) }
}

impl v1::Job {
    pub fn state(&self) -> Result<JobState, UnknownWord> {
        self.state.parse()
    }
}

impl v1::JobStateChange {
    pub fn state(&self) -> Result<JobState, UnknownWord> {
        self.state.parse()
    }
}

impl v1::JobEvent {
    /// `None` for the event that created the job.
    pub fn from_state(&self) -> Result<Option<JobState>, UnknownWord> {
        optional(&self.from_state)
    }

    pub fn to_state(&self) -> Result<JobState, UnknownWord> {
        self.to_state.parse()
    }
}

impl v1::JobSide {
    pub fn state(&self) -> Result<JobState, UnknownWord> {
        self.state.parse()
    }
}

impl v1::RankStatus {
    pub fn state(&self) -> Result<RankState, UnknownWord> {
        self.state.parse()
    }
}

impl v1::RankReport {
    pub fn state(&self) -> Result<RankState, UnknownWord> {
        self.state.parse()
    }
}

impl v1::NodeInfo {
    pub fn state(&self) -> Result<NodeState, UnknownWord> {
        self.state.parse()
    }

    pub fn interconnect_class(&self) -> Result<Option<InterconnectClass>, UnknownWord> {
        optional(&self.interconnect_class)
    }

    pub fn verdict(&self) -> Result<Option<Verdict>, UnknownWord> {
        optional(&self.verdict)
    }
}

impl v1::PlacedNode {
    pub fn interconnect_class(&self) -> Result<Option<InterconnectClass>, UnknownWord> {
        optional(&self.interconnect_class)
    }

    pub fn verdict(&self) -> Result<Option<Verdict>, UnknownWord> {
        optional(&self.verdict)
    }
}

impl v1::PreflightReport {
    pub fn level(&self) -> Result<PreflightLevel, UnknownWord> {
        self.level.parse()
    }

    pub fn verdict(&self) -> Result<Verdict, UnknownWord> {
        self.verdict.parse()
    }

    /// `None` when the agent could not classify the fabric.
    pub fn interconnect_class(&self) -> Result<Option<InterconnectClass>, UnknownWord> {
        optional(&self.interconnect_class)
    }
}

impl v1::PreflightCheck {
    pub fn status(&self) -> Result<CheckStatus, UnknownWord> {
        self.status.parse()
    }
}

impl v1::PreflightRequest {
    /// The level of the preflight to run first; `None`: only show the latest report.
    pub fn run_level(&self) -> Result<Option<PreflightLevel>, UnknownWord> {
        optional(&self.run_level)
    }
}

impl v1::RunPreflight {
    pub fn level(&self) -> Result<PreflightLevel, UnknownWord> {
        self.level.parse()
    }
}

impl v1::Finding {
    pub fn cause(&self) -> Result<Cause, UnknownWord> {
        self.cause.parse()
    }
}

impl v1::LogChunk {
    pub fn stream(&self) -> Result<LogStream, UnknownWord> {
        self.stream.parse()
    }
}

impl v1::LogData {
    /// The stream of a chunk with data; `None` on the last message of a request when it carries
    /// no data.
    pub fn stream(&self) -> Result<Option<LogStream>, UnknownWord> {
        optional(&self.stream)
    }
}

/// A message whose words can be checked all at once, where it is received: every word in it
/// (nested messages included) reads as a known one, or the first that does not is named.
pub trait Words {
    fn check_words(&self) -> Result<(), UnknownWord>;
}

impl Words for v1::Job {
    fn check_words(&self) -> Result<(), UnknownWord> {
        self.state()?;
        for rank in &self.ranks {
            rank.state()?;
        }
        for event in &self.events {
            event.from_state()?;
            event.to_state()?;
        }
        Ok(())
    }
}

impl Words for v1::NodeInfo {
    fn check_words(&self) -> Result<(), UnknownWord> {
        self.state()?;
        self.interconnect_class()?;
        self.verdict()?;
        Ok(())
    }
}

impl Words for v1::PreflightReport {
    fn check_words(&self) -> Result<(), UnknownWord> {
        self.level()?;
        self.verdict()?;
        self.interconnect_class()?;
        for check in &self.checks {
            check.status()?;
        }
        Ok(())
    }
}

impl Words for v1::Diagnosis {
    fn check_words(&self) -> Result<(), UnknownWord> {
        for finding in &self.findings {
            finding.cause()?;
        }
        Ok(())
    }
}

impl Words for v1::Comparison {
    fn check_words(&self) -> Result<(), UnknownWord> {
        for side in [&self.a, &self.b].into_iter().flatten() {
            side.state()?;
            for node in &side.nodes {
                node.interconnect_class()?;
                node.verdict()?;
            }
            if let Some(diagnosis) = &side.diagnosis {
                diagnosis.check_words()?;
            }
        }
        Ok(())
    }
}

impl Words for v1::WatchEvent {
    fn check_words(&self) -> Result<(), UnknownWord> {
        match &self.event {
            Some(v1::watch_event::Event::State(change)) => change.state().map(|_| ()),
            _ => Ok(()),
        }
    }
}

impl Words for v1::LogChunk {
    fn check_words(&self) -> Result<(), UnknownWord> {
        self.stream().map(|_| ())
    }
}

impl<T: Words> Words for [T] {
    fn check_words(&self) -> Result<(), UnknownWord> {
        self.iter().try_for_each(Words::check_words)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_read_typed_and_unknown_ones_are_refused_with_their_concept() {
        let report = v1::RankReport { state: "exited".into(), ..Default::default() };
        assert_eq!(report.state(), Ok(RankState::Exited));
        let bad = v1::RankReport { state: "finished".into(), ..Default::default() };
        let err = bad.state().unwrap_err();
        assert_eq!((err.kind, err.word.as_str()), ("rank state", "finished"));
        let node = v1::NodeInfo { state: "unresponsive".into(), ..Default::default() };
        assert_eq!(
            (node.state(), node.verdict(), node.interconnect_class()),
            (Ok(NodeState::Unresponsive), Ok(None), Ok(None))
        );
        let chunk = v1::LogChunk { stream: "stdin".into(), ..Default::default() };
        assert!(chunk.stream().unwrap_err().to_string().contains("expected one of stdout, stderr"));
        let mut job = v1::Job { state: "running".into(), ..Default::default() };
        job.ranks.push(v1::RankStatus { state: "running".into(), ..Default::default() });
        assert_eq!(job.check_words(), Ok(()));
        job.ranks.push(v1::RankStatus { state: "zombie".into(), ..Default::default() });
        assert_eq!(job.check_words().unwrap_err().word, "zombie");
    }
}
