//! `Agents.Connect`: one long-lived bidirectional stream per agent.
//!
//! The first message must be a hello with our protocol version; after it, messages of one
//! stream are handled strictly in order, so a rank's receipts are stored before its exit is
//! seen. A receipt batch is acknowledged only after its transaction committed; when the store
//! fails the stream is closed without an ack, and the agent resends after reconnecting.
//!
//! An agent speaks only for itself. Under TLS its client certificate's common name is its id:
//! a hello naming another agent is refused. On any stream, a second stream of a connected agent
//! is refused, and a receipt batch or rank report about a rank another agent runs ends the
//! stream with `PermissionDenied`; nothing of it is stored.
//!
//! An agent started inside a Slurm allocation has no certificate: it joins with its job's join
//! token instead ([`AgentsService::joined_for`]), is bound to that job, and is refused (and
//! audited) with a token this group did not make, under a name not of that job, or once the
//! job has ended.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::agents_server::Agents;
use trainyard_proto::v1::{
    AgentMessage, ControllerMessage, RankReport, RankUpdate, agent_message, controller_message,
};

use crate::auth::pki;
use crate::core::{Controller, ControllerError};
use trainyard_proto::limits::{MAX_RECEIPT_BATCH, MAX_TELEMETRY_WINDOWS};

/// Messages queued towards one agent before the controller considers it stuck.
const OUTBOX: usize = 1_024;

pub struct AgentsService {
    controller: Arc<Controller>,
    /// Streams must come with a client certificate naming the agent (TLS).
    require_cert: bool,
    /// Writes the audit rows of refused joins.
    auth: crate::auth::Authenticator,
    shutdown: CancellationToken,
}

impl AgentsService {
    pub fn new(
        controller: Arc<Controller>,
        require_cert: bool,
        auth: crate::auth::Authenticator,
        shutdown: CancellationToken,
    ) -> Self {
        AgentsService { controller, require_cert, auth, shutdown }
    }

    /// The `[slurm]` job a hello with a join token joined for, or the refusal (audited).
    async fn joined_for(
        &self,
        hello: &trainyard_proto::v1::Hello,
        peer: Option<std::net::SocketAddr>,
    ) -> Result<u64, Status> {
        let now = self.controller.now_ms();
        let target = format!("node:{}", crate::auth::clip(&hello.agent_id));
        let jobs = self.controller.jobs();
        let refuse = async |why: String, status: fn(String) -> Status| {
            tracing::warn!(agent_id = %hello.agent_id, ?peer, reason = %why, "agent join refused");
            self.auth.audit_refusal("agent.join", &target, &why, peer, now).await;
            Err(status(why))
        };
        let Some(job) = jobs.join_job(&hello.join_token) else {
            return refuse(
                "the join token was not made by this controller group".into(),
                Status::unauthenticated,
            )
            .await;
        };
        if !trainyard_model::slurm::is_agent_of(&hello.agent_id, job) {
            let want = trainyard_model::slurm::agent_id(job, "NODE", 0);
            let why =
                format!("the join token is job {job}'s, but agent {:?} is not named {want}", hello.agent_id);
            return refuse(why, Status::permission_denied).await;
        }
        match jobs.get_record(job).await {
            Ok(Some(record)) if !record.state.is_terminal() => Ok(job),
            Ok(Some(record)) => {
                let why =
                    format!("job {job} has ended ({}); its allocation's agents are not taken", record.state);
                refuse(why, Status::permission_denied).await
            }
            Ok(None) => refuse(format!("job {job} does not exist"), Status::permission_denied).await,
            Err(e) => Err(super::to_status(e)),
        }
    }

    /// The agent id the stream's client certificate names; `None` when none is required.
    fn certified_id<T>(&self, request: &Request<T>) -> Result<Option<String>, Status> {
        if !self.require_cert {
            return Ok(None);
        }
        let peer = request.remote_addr();
        let Some(certs) = request.peer_certs() else {
            tracing::warn!(?peer, "agent stream refused: no client certificate");
            return Err(Status::unauthenticated(
                "agents must present a client certificate signed by the fleet's CA \
                 (trainyard-agent --tls-dir; `trainyard-controller issue-agent-cert NAME` makes one)",
            ));
        };
        match certs.first().and_then(|c| pki::common_name(c)) {
            Some(name) => Ok(Some(name)),
            None => {
                tracing::warn!(?peer, "agent stream refused: the certificate has no common name");
                Err(Status::unauthenticated("the client certificate names no agent (no common name)"))
            }
        }
    }
}

type ConnectStream = Pin<Box<dyn Stream<Item = Result<ControllerMessage, Status>> + Send>>;

#[tonic::async_trait]
impl Agents for AgentsService {
    type ConnectStream = ConnectStream;

    async fn connect(
        &self,
        request: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<ConnectStream>, Status> {
        // Only the leader holds agents' streams: a follower names it, and the agent dials it.
        self.controller.role().writable().map_err(crate::service::to_status)?;
        // Checked once the hello says whether the agent joins with a certificate or a job's token.
        let certified = self.certified_id(&request);
        let peer = request.remote_addr();
        let mut inbound = request.into_inner();
        let first =
            inbound.message().await?.ok_or_else(|| Status::invalid_argument("stream closed before hello"))?;
        let Some(agent_message::Msg::Hello(hello)) = first.msg else {
            return Err(Status::invalid_argument("the first message on an agent stream must be a hello"));
        };
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "protocol version mismatch: agent {} speaks {}, this controller speaks {PROTOCOL_VERSION}; \
                 run matching trainyard versions",
                hello.agent_id, hello.protocol_version
            )));
        }
        if hello.agent_id.is_empty() {
            return Err(Status::invalid_argument("hello carries an empty agent_id"));
        }
        let (certified, bound) = if hello.join_token.is_empty() {
            (certified?, None)
        } else {
            (certified.ok().flatten(), Some(self.joined_for(&hello, peer).await?))
        };
        if let Some(name) = certified
            && name != hello.agent_id
        {
            tracing::warn!(certificate = %name, hello = %hello.agent_id, ?peer, "agent stream refused: impostor");
            return Err(Status::permission_denied(format!(
                "this certificate is agent {name}'s, but the hello says {}; an agent speaks only for itself",
                hello.agent_id
            )));
        }
        let agent_id = hello.agent_id.clone();
        let (tx, rx) = mpsc::channel(OUTBOX);
        let conn_id = match self.controller.nodes().hello_for(hello, tx.clone(), bound).await {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(agent_id, ?peer, error = %e, "agent stream refused");
                return Err(super::to_status(e));
            }
        };
        let controller = self.controller.clone();
        let shutdown = self.shutdown.clone();
        // A refusal mid-stream ends the response with its status, after what was queued.
        let (refuse_tx, refuse_rx) = mpsc::channel(1);
        tokio::spawn(async move {
            if let Err(status) = serve(&controller, (&agent_id, conn_id), inbound, tx, shutdown).await {
                let _ = refuse_tx.send(status).await;
            }
            if let Err(e) = controller.nodes().disconnected(&agent_id, conn_id).await {
                tracing::error!(agent_id, error = %e, "failed to record an agent disconnect");
            }
        });
        let outbound = ReceiverStream::new(rx).map(Ok).merge(ReceiverStream::new(refuse_rx).map(Err));
        Ok(Response::new(Box::pin(outbound)))
    }
}

/// A refusal of something an agent sent: logged, and the status that ends its stream.
fn refused(agent_id: &str, e: ControllerError) -> Result<(), Status> {
    tracing::warn!(agent_id, error = %e, "agent message refused; closing its stream");
    Err(super::to_status(e))
}

/// Messages of one stream read ahead of their handling. The agent counts as heard from when a
/// message arrives, not when the controller gets round to handling it: read in the handling
/// loop, 1,000 agents' streams queued behind receipt batches waiting for the database looked
/// silent, and the liveness check marked them unresponsive (37,000 times in 10 minutes), which
/// kept the scheduler off most of the fleet.
const READ_AHEAD: usize = 256;

/// Handles one agent's messages in order until the stream ends, fails, or we shut down; an
/// error is the status a refused message ends the stream with.
///
/// One message at a time, a receipt batch stored before the next is read: an agent that says
/// hello again resumes each rank after the highest seq the store holds for it
/// (`Nodes::hello`), which is right only while no batch of a stream is stored once one before
/// it failed. Writing a stream's next batch while the one before commits (tried, 3ede3bf)
/// broke that: a batch failed while the database was lost, the next one committed when it was
/// back, and the agent, told of the later seq, passed over the failed batch's receipts.
async fn serve(
    controller: &Arc<Controller>,
    (agent_id, conn_id): (&str, u64),
    inbound: Streaming<AgentMessage>,
    tx: mpsc::Sender<ControllerMessage>,
    shutdown: CancellationToken,
) -> Result<(), Status> {
    let (ahead_tx, ahead) = mpsc::channel(READ_AHEAD);
    let reader = tokio::spawn(read_ahead(controller.clone(), agent_id.to_string(), inbound, ahead_tx));
    let mut inbox = Inbox { ahead, held: None };
    let result = loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            next = inbox.next() => match next {
                Some(msg) => msg,
                // The stream ended (or broke) and everything read from it is handled.
                None => break Ok(()),
            },
        };
        if controller.nodes().stream_fenced(conn_id) {
            tracing::warn!(
                agent_id,
                conn_id,
                "a host declared lost speaks again on its old stream; ending it"
            );
            break Err(Status::unavailable(
                "this host was declared lost (silent past the agent timeout); say hello again",
            ));
        }
        match handle(controller, agent_id, msg, &tx, &mut inbox).await {
            Flow::Go => {}
            Flow::End(result) => break result,
        }
    };
    reader.abort();
    result
}

/// What the handling loop reads: the messages read ahead, and one held back (read past a run
/// of rank updates, it is handled next).
struct Inbox {
    ahead: mpsc::Receiver<agent_message::Msg>,
    held: Option<agent_message::Msg>,
}

impl Inbox {
    /// The next message; `None` once the stream ended and everything read from it is handled.
    async fn next(&mut self) -> Option<agent_message::Msg> {
        match self.held.take() {
            Some(msg) => Some(msg),
            None => self.ahead.recv().await,
        }
    }

    /// `first` and the rank updates already queued behind it, each about another rank (a rank's
    /// second update ends the run, so one rank's updates stay in order); the message after the
    /// run is held for [`Inbox::next`].
    fn rank_update_run(&mut self, first: RankUpdate) -> Vec<RankReport> {
        let mut run: Vec<RankReport> = first.report.into_iter().collect();
        while let Ok(msg) = self.ahead.try_recv() {
            match msg {
                agent_message::Msg::RankUpdate(RankUpdate { report: Some(report) })
                    if run.iter().all(|r| r.key != report.key) =>
                {
                    run.push(report)
                }
                other => {
                    self.held = Some(other);
                    break;
                }
            }
        }
        run
    }
}

/// Applies a run of rank updates about distinct ranks together: their rows are stored in one
/// transaction, not one each (a launch's 8 ranks report at once), then each is acted on.
async fn rank_updates(controller: &Controller, agent_id: &str, run: Vec<RankReport>) -> Flow {
    let results = join_all(run.iter().map(|report| controller.jobs().rank_report(agent_id, report))).await;
    for result in results {
        match result {
            Ok(()) => {}
            Err(e @ ControllerError::NotYours(_)) => return Flow::End(refused(agent_id, e)),
            Err(e) => {
                tracing::error!(agent_id, error = %e, "failed to apply a rank update; closing so the agent resends");
                return Flow::End(Ok(()));
            }
        }
    }
    Flow::Go
}

/// Polls every future of `futures` until all are done; their outputs in order.
async fn join_all<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<Pin<Box<F>>> = futures.map(Box::pin).collect();
    let mut done: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut waiting = false;
        for (future, out) in pending.iter_mut().zip(done.iter_mut()).filter(|(_, out)| out.is_none()) {
            match future.as_mut().poll(cx) {
                std::task::Poll::Ready(value) => *out = Some(value),
                std::task::Poll::Pending => waiting = true,
            }
        }
        if waiting { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    done.into_iter().map(|out| out.expect("every future ran to its end")).collect()
}

/// Reads an agent's stream as it arrives, notes each message as a sign of life, and passes it
/// on to the handling loop (waiting while [`READ_AHEAD`] are queued).
async fn read_ahead(
    controller: Arc<Controller>,
    agent_id: String,
    mut inbound: Streaming<AgentMessage>,
    ahead: mpsc::Sender<agent_message::Msg>,
) {
    loop {
        match inbound.message().await {
            Ok(Some(AgentMessage { msg })) => {
                controller.nodes().seen(&agent_id);
                if let Some(msg) = msg
                    && ahead.send(msg).await.is_err()
                {
                    return;
                }
            }
            Ok(None) => return,
            Err(status) => {
                tracing::info!(agent_id, code = ?status.code(), message = status.message(), "agent stream broke");
                return;
            }
        }
    }
}

/// Whether the stream goes on after a message.
enum Flow {
    Go,
    /// The stream ends: `Ok` quietly (the agent resends what was not acknowledged), `Err`
    /// with the status of a refused message.
    End(Result<(), Status>),
}

/// Handles one message of an agent's stream.
async fn handle(
    controller: &Controller,
    agent_id: &str,
    msg: agent_message::Msg,
    tx: &mpsc::Sender<ControllerMessage>,
    inbox: &mut Inbox,
) -> Flow {
    let quietly = Flow::End(Ok(()));
    match msg {
        agent_message::Msg::Receipts(batch) => return receipts(controller, agent_id, batch, tx).await,
        agent_message::Msg::RankUpdate(first) => {
            let run = inbox.rank_update_run(first);
            return rank_updates(controller, agent_id, run).await;
        }
        agent_message::Msg::Notice(notice) => {
            if let Err(e) = controller.nodes().notice(agent_id, &notice).await {
                tracing::error!(agent_id, error = %e, "failed to act on a preemption notice; the agent sends it again");
                return quietly;
            }
        }
        agent_message::Msg::Leaving(leaving) => {
            if let Err(e) = controller.nodes().leaving(agent_id, &leaving.reason).await {
                tracing::error!(agent_id, error = %e, "failed to record that an agent is leaving");
            }
            if !leaving.slurm_state.is_empty() {
                controller.nodes().slurm_ending(agent_id, &leaving.slurm_state);
            }
        }
        // Every message counts as a sign of life (the stream's loop notes it).
        agent_message::Msg::Heartbeat(_) => {}
        agent_message::Msg::LogData(data) => controller.jobs().log_data(agent_id, data),
        agent_message::Msg::Preflight(report) => {
            if let Err(e) = controller.nodes().preflight_report(agent_id, report).await {
                tracing::error!(agent_id, error = %e, "failed to store a preflight report; closing");
                return quietly;
            }
        }
        agent_message::Msg::Telemetry(batch) => return telemetry(controller, agent_id, batch, tx).await,
        agent_message::Msg::Hello(_) => {
            tracing::warn!(agent_id, "second hello on one stream ignored");
        }
    }
    Flow::Go
}

/// A receipt batch: stored through the receipts service and acknowledged on the stream.
async fn receipts(
    controller: &Controller,
    agent_id: &str,
    batch: trainyard_proto::v1::ReceiptBatch,
    tx: &mpsc::Sender<ControllerMessage>,
) -> Flow {
    let quietly = Flow::End(Ok(()));
    if batch.receipts.len() > MAX_RECEIPT_BATCH {
        tracing::error!(
            agent_id,
            receipts = batch.receipts.len(),
            max = MAX_RECEIPT_BATCH,
            "batch too large; closing"
        );
        return quietly;
    }
    let ack = match controller.receipts().ingest(agent_id, batch).await {
        Ok(ack) => ack,
        Err(e @ ControllerError::NotYours(_)) => return Flow::End(refused(agent_id, e)),
        Err(e) => {
            tracing::error!(agent_id, error = %e, "failed to store receipts; closing so the agent resends");
            return quietly;
        }
    };
    let msg = ControllerMessage { msg: Some(controller_message::Msg::Ack(ack)) };
    if tx.send(msg).await.is_err() { quietly } else { Flow::Go }
}

/// A batch of GPU telemetry windows: stored through the receipts service and acknowledged.
async fn telemetry(
    controller: &Controller,
    agent_id: &str,
    batch: trainyard_proto::v1::TelemetryBatch,
    tx: &mpsc::Sender<ControllerMessage>,
) -> Flow {
    let quietly = Flow::End(Ok(()));
    if batch.windows.len() > MAX_TELEMETRY_WINDOWS {
        tracing::error!(
            agent_id,
            windows = batch.windows.len(),
            max = MAX_TELEMETRY_WINDOWS,
            "telemetry batch too large; closing"
        );
        return quietly;
    }
    let ack = match controller.receipts().telemetry(agent_id, batch).await {
        Ok(ack) => ack,
        Err(e @ ControllerError::NotYours(_)) => return Flow::End(refused(agent_id, e)),
        Err(e) => {
            tracing::error!(agent_id, error = %e, "failed to store GPU telemetry; closing so the agent resends");
            return quietly;
        }
    };
    let msg = ControllerMessage { msg: Some(controller_message::Msg::TelemetryAck(ack)) };
    if tx.send(msg).await.is_err() { quietly } else { Flow::Go }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::{Heartbeat, RankKey};

    fn update(rank: u32, state: &str) -> agent_message::Msg {
        let key = Some(RankKey { job_id: 7, attempt: 0, rank });
        agent_message::Msg::RankUpdate(RankUpdate {
            report: Some(RankReport { key, state: state.to_string(), ..Default::default() }),
        })
    }

    fn first(msg: agent_message::Msg) -> RankUpdate {
        match msg {
            agent_message::Msg::RankUpdate(u) => u,
            _ => unreachable!("an update"),
        }
    }

    #[tokio::test]
    async fn a_run_of_updates_stops_at_a_rank_seen_twice_and_at_another_message() {
        let (tx, ahead) = mpsc::channel(16);
        let mut inbox = Inbox { ahead, held: None };
        for msg in [update(1, "running"), update(2, "running"), update(1, "exited")] {
            tx.send(msg).await.unwrap();
        }
        let run = inbox.rank_update_run(first(update(0, "running")));
        let next = inbox.held.take();
        let ranks: Vec<u32> = run.iter().map(|r| r.key.unwrap().rank).collect();
        assert_eq!(ranks, [0, 1, 2], "rank 1's second update waits for the next run");
        let Some(agent_message::Msg::RankUpdate(held)) = next else { panic!("rank 1's exit held") };
        assert_eq!(held.report.unwrap().state, "exited");

        tx.send(update(3, "running")).await.unwrap();
        tx.send(agent_message::Msg::Heartbeat(Heartbeat::default())).await.unwrap();
        tx.send(update(4, "running")).await.unwrap();
        let run = inbox.rank_update_run(first(update(2, "exited")));
        let next = inbox.held.take();
        assert_eq!(run.len(), 2, "an update of another kind of message ends the run");
        assert!(matches!(next, Some(agent_message::Msg::Heartbeat(_))));
        let run = inbox.rank_update_run(first(update(5, "running")));
        let next = inbox.held.take();
        assert_eq!((run.len(), next.is_none()), (2, true), "an empty queue ends the run");
    }

    #[tokio::test]
    async fn join_all_runs_every_future_and_keeps_their_order() {
        let delays = [30u64, 0, 10];
        let outs = join_all(delays.iter().map(|ms| async move {
            tokio::time::sleep(std::time::Duration::from_millis(*ms)).await;
            *ms
        }))
        .await;
        assert_eq!(outs, delays);
    }
}
