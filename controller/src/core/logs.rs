//! `Jobs.Logs`: a rank's stdout and stderr, read by its agent from the files it keeps and
//! relayed over the agent's stream to the client. Nothing is stored. The agent sends a request
//! at most `LOG_CREDIT_PIECES` pieces ahead of what its client has read, and the controller
//! grants more ([`Controller::log_credit`]) as the client reads: a slow `ctl logs --follow`
//! costs the agent's stream only what it reads. The controller holds one bounded channel per
//! open request ([`BUFFER`] pieces, more than the credit) and never waits for a client on the
//! agent's stream: a piece that finds the channel full (an agent that ignored the credit) drops
//! that client, tells it why, and stops the agent's reader, so receipts and rank reports that
//! share the stream are never held up.

use std::sync::atomic::Ordering;

use tokio::sync::mpsc;
use trainyard_proto::v1::controller_message::Msg;
use trainyard_proto::v1::{ControllerMessage, LogCredit, LogData, ReadLogs, StopLogs};
use trainyard_proto::words::LogStream;

use super::{Controller, ControllerError, Result};
use trainyard_store::JobId;

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

impl Controller {
    /// Asks the agent of `rank` of the job's current attempt for its logs; the receiver yields
    /// them and closes when they are all sent (or, with `follow`, when the rank has ended).
    pub(super) async fn open_logs(
        &self,
        job_id: JobId,
        rank: u32,
        tail_lines: u32,
        follow: bool,
    ) -> Result<(u64, mpsc::Receiver<LogEvent>)> {
        let job = self.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))?;
        let attempt = job.attempt;
        let allocations = self.store.allocations(job_id, attempt).await?;
        if allocations.is_empty() {
            return Err(ControllerError::LogsUnavailable(format!(
                "job {job_id} has no ranks placed yet (it is {}): there are no logs",
                job.state.as_str()
            )));
        }
        let Some(alloc) = allocations.iter().find(|a| a.id.rank == rank) else {
            return Err(ControllerError::BadRequest(format!(
                "job {job_id} has ranks 0 to {}; there is no rank {rank}",
                allocations.len() - 1
            )));
        };
        let agent_id = alloc.agent_id.clone();
        let link = {
            let core = self.lock();
            core.agents.get(&agent_id).and_then(|e| e.link.as_ref()).map(|l| l.tx.clone())
        };
        let Some(link) = link else {
            return Err(ControllerError::LogsUnavailable(format!(
                "node {agent_id} is not connected, so the logs of job {job_id} rank {rank} cannot be read now; they \
                 stay on that host under the agent's data directory, in runs/job-{job_id}/attempt-{attempt}/rank-{rank}/"
            )));
        };
        let request_id = self.next_log_request.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = mpsc::channel(BUFFER);
        self.log_waiters().insert(request_id, LogWaiter { agent_id: agent_id.clone(), tx });
        let read = ReadLogs { request_id, job_id, attempt, rank, tail_lines, follow };
        if link.send(ControllerMessage { msg: Some(Msg::ReadLogs(read)) }).await.is_err() {
            self.log_waiters().remove(&request_id);
            return Err(ControllerError::AgentGone(agent_id));
        }
        Ok((request_id, rx))
    }

    /// The client of `request_id` went away (or no longer wants more): its agent stops reading.
    /// Nothing when the request already ended.
    pub(super) fn close_logs(&self, request_id: u64) {
        let Some(waiter) = self.log_waiters().remove(&request_id) else { return };
        let core = self.lock();
        if let Some(link) = core.agents.get(&waiter.agent_id).and_then(|e| e.link.as_ref()) {
            let _ = link.tx.try_send(ControllerMessage { msg: Some(Msg::StopLogs(StopLogs { request_id })) });
        }
    }

    /// The client of `request_id` read `pieces` more pieces: its agent may send that many more.
    /// Lost only when the agent's stream is full or gone, and then the request fails anyway.
    pub(super) fn log_credit(&self, request_id: u64, pieces: u32) {
        let Some(agent_id) = self.log_waiters().get(&request_id).map(|w| w.agent_id.clone()) else { return };
        let core = self.lock();
        if let Some(link) = core.agents.get(&agent_id).and_then(|e| e.link.as_ref()) {
            let credit = LogCredit { request_id, pieces };
            let _ = link.tx.try_send(ControllerMessage { msg: Some(Msg::LogCredit(credit)) });
        }
    }

    /// A piece of logs from `agent_id`: forwarded to its client. The last piece closes the
    /// request; a client that went away (or stalls) closes it too and stops the agent.
    pub(super) fn log_data(&self, agent_id: &str, data: LogData) {
        let request_id = data.request_id;
        let tx = self.log_waiters().get(&request_id).filter(|w| w.agent_id == agent_id).map(|w| w.tx.clone());
        let Some(tx) = tx else { return };
        let event = match (data.done, data.error.is_empty(), data.stream()) {
            (true, true, _) => None,
            (true, false, _) => Some(LogEvent::Failed(data.error)),
            (false, _, Ok(Some(stream))) => Some(LogEvent::Chunk { stream, data: data.data }),
            (false, _, Ok(None)) => Some(LogEvent::Failed("the agent sent logs of no stream".into())),
            (false, _, Err(e)) => Some(LogEvent::Failed(format!("the agent sent logs of an {e}"))),
        };
        // Never awaited: this runs on the agent's stream.
        let delivered = match event {
            Some(event) => match tx.try_send(event) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    // Told off the agent's path, once the client has read what is queued.
                    tokio::spawn(async move {
                        let why = format!(
                            "logs stopped: {BUFFER} pieces were waiting for this client; read faster, or use --tail"
                        );
                        let _ =
                            tokio::time::timeout(SLOW_CLIENT_NOTICE, tx.send(LogEvent::Failed(why))).await;
                    });
                    false
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            },
            None => true,
        };
        if data.done || !delivered {
            self.log_waiters().remove(&request_id);
        }
        if !delivered && !data.done {
            tracing::info!(agent_id, request_id, "logs client gone or stalled; stopping the agent's reader");
            let core = self.lock();
            if let Some(link) = core.agents.get(agent_id).and_then(|e| e.link.as_ref()) {
                let _ =
                    link.tx.try_send(ControllerMessage { msg: Some(Msg::StopLogs(StopLogs { request_id })) });
            }
        }
    }

    /// `agent_id`'s stream ended: its open log requests fail with the reason.
    pub(super) fn fail_logs_of(&self, agent_id: &str) {
        let mut waiters = self.log_waiters();
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

    fn log_waiters(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, LogWaiter>> {
        self.logs.lock().unwrap_or_else(|p| p.into_inner())
    }
}
