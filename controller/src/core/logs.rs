//! `Jobs.Logs`: a rank's stdout and stderr, read by its agent from the files it keeps and
//! relayed over the agent's stream to the client. Nothing is stored. The agent sends a request
//! at most `LOG_CREDIT_PIECES` pieces ahead of what its client has read, and the controller
//! grants more ([`LogRelay::credit`]) as the client reads: a slow `ctl logs --follow`
//! costs the agent's stream only what it reads. The controller holds one bounded channel per
//! open request ([`BUFFER`] pieces, more than the credit) and never waits for a client on the
//! agent's stream: a piece that finds the channel full (an agent that ignored the credit) drops
//! that client, tells it why, and stops the agent's reader, so receipts and rank reports that
//! share the stream are never held up.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::mpsc;
use trainyard_proto::v1::controller_message::Msg;
use trainyard_proto::v1::{ControllerMessage, LogCredit, LogData, ReadLogs, StopLogs};
use trainyard_proto::words::LogStream;

use super::error::{ControllerError, Result};

/// Pieces of up to 64 KiB buffered per request (1 MiB): twice the agent's credit window.
pub const BUFFER: usize = 2 * trainyard_proto::limits::LOG_CREDIT_PIECES as usize;
/// How long a dropped client is given to read up to the notice that says why.
const SLOW_CLIENT_NOTICE: std::time::Duration = std::time::Duration::from_secs(30);

/// What a `Logs` client receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogEvent {
    Chunk {
        stream: LogStream,
        data: Vec<u8>,
    },
    /// The request ended with this error (the agent could not read the files, or went away).
    Failed(String),
}

/// An open request: which agent answers it and where its pieces go.
pub(super) struct LogWaiter {
    agent_id: String,
    tx: mpsc::Sender<LogEvent>,
}

/// The open `Logs` requests: which agent answers each and where its pieces go. Its own small
/// lock: pieces arrive on the agents' streams and must never wait for the core's.
#[derive(Default)]
pub(super) struct LogRelay {
    waiters: Mutex<HashMap<u64, LogWaiter>>,
    next: AtomicU64,
}

impl LogRelay {
    /// Opens a request to `agent_id` over its stream `link` for a rank's logs (`read`, whose
    /// id this fills in); the receiver yields them and closes when they are all sent (or, with
    /// `follow`, when the rank has ended).
    pub(super) async fn open(
        &self,
        agent_id: &str,
        link: mpsc::Sender<ControllerMessage>,
        mut read: ReadLogs,
    ) -> Result<(u64, mpsc::Receiver<LogEvent>)> {
        let request_id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = mpsc::channel(BUFFER);
        self.waiters().insert(request_id, LogWaiter { agent_id: agent_id.to_string(), tx });
        read.request_id = request_id;
        if link.send(ControllerMessage { msg: Some(Msg::ReadLogs(read)) }).await.is_err() {
            self.waiters().remove(&request_id);
            return Err(ControllerError::AgentGone(agent_id.to_string()));
        }
        Ok((request_id, rx))
    }

    /// The client of `request_id` went away (or no longer wants more): the request ends, and
    /// the message that stops its agent's reader is returned with the agent to send it to.
    /// `None` when the request already ended.
    pub(super) fn close(&self, request_id: u64) -> Option<(String, Msg)> {
        let waiter = self.waiters().remove(&request_id)?;
        Some((waiter.agent_id, Msg::StopLogs(StopLogs { request_id })))
    }

    /// The client of `request_id` read `pieces` more pieces: the message that lets its agent
    /// send that many more, with the agent to send it to.
    pub(super) fn credit(&self, request_id: u64, pieces: u32) -> Option<(String, Msg)> {
        let agent_id = self.waiters().get(&request_id).map(|w| w.agent_id.clone())?;
        Some((agent_id, Msg::LogCredit(LogCredit { request_id, pieces })))
    }

    /// A piece of logs from `agent_id`: forwarded to its client. The last piece closes the
    /// request; a client that went away (or stalls) closes it too, and the message that stops
    /// the agent's reader is returned, for the agent's stream.
    pub(super) fn data(&self, agent_id: &str, data: LogData) -> Option<Msg> {
        let request_id = data.request_id;
        let tx = self.waiters().get(&request_id).filter(|w| w.agent_id == agent_id).map(|w| w.tx.clone());
        let tx = tx?;
        let event = match (data.done, data.error.is_empty(), data.stream()) {
            (true, true, _) => None,
            (true, false, _) => Some(LogEvent::Failed(data.error)),
            (false, _, Ok(Some(stream))) => Some(LogEvent::Chunk { stream, data: data.data }),
            (false, _, Ok(None)) => Some(LogEvent::Failed("the agent sent logs of no stream".into())),
            (false, _, Err(e)) => Some(LogEvent::Failed(format!("the agent sent logs of an {e}"))),
        };
        // Never awaited: this runs on the agent's stream.
        let delivered = match event {
            Some(event) => deliver(&tx, event),
            None => true,
        };
        if data.done || !delivered {
            self.waiters().remove(&request_id);
        }
        (!delivered && !data.done).then(|| {
            tracing::info!(agent_id, request_id, "logs client gone or stalled; stopping the agent's reader");
            Msg::StopLogs(StopLogs { request_id })
        })
    }

    /// `agent_id`'s stream ended: its open log requests fail with the reason.
    pub(super) fn fail_agent(&self, agent_id: &str) {
        let mut waiters = self.waiters();
        let ids: Vec<u64> =
            waiters.iter().filter(|(_, w)| w.agent_id == agent_id).map(|(id, _)| *id).collect();
        for id in ids {
            if let Some(w) = waiters.remove(&id) {
                let _ = w.tx.try_send(LogEvent::Failed(format!(
                    "node {agent_id} disconnected while its logs were being read"
                )));
            }
        }
    }

    fn waiters(&self) -> MutexGuard<'_, HashMap<u64, LogWaiter>> {
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Hands `event` to a client without waiting; `false` when the client went away or its buffer
/// is full (it is told why off the agent's path, once it has read what is queued).
fn deliver(tx: &mpsc::Sender<LogEvent>, event: LogEvent) -> bool {
    match tx.try_send(event) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            let tx = tx.clone();
            tokio::spawn(async move {
                let why = format!(
                    "logs stopped: {BUFFER} pieces were waiting for this client; read faster, or use --tail"
                );
                let _ = tokio::time::timeout(SLOW_CLIENT_NOTICE, tx.send(LogEvent::Failed(why))).await;
            });
            false
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    }
}
