//! `Agents.Connect`: one long-lived bidirectional stream per agent.
//!
//! The first message must be a hello with our protocol version; after it, messages of one
//! stream are handled strictly in order, so a rank's receipts are stored before its exit is
//! seen. A receipt batch is acknowledged only after its transaction committed; when the store
//! fails the stream is closed without an ack, and the agent resends after reconnecting.

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
use trainyard_proto::v1::{AgentMessage, ControllerMessage, agent_message, controller_message};

use crate::core::{Controller, MAX_BATCH};

/// Messages queued towards one agent before the controller considers it stuck.
const OUTBOX: usize = 1_024;

pub struct AgentsService {
    controller: Arc<Controller>,
    shutdown: CancellationToken,
}

impl AgentsService {
    pub fn new(controller: Arc<Controller>, shutdown: CancellationToken) -> Self {
        AgentsService { controller, shutdown }
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
        let agent_id = hello.agent_id.clone();
        let (tx, rx) = mpsc::channel(OUTBOX);
        let conn_id = self.controller.agent_hello(hello, tx.clone()).await.map_err(super::to_status)?;
        let controller = self.controller.clone();
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            serve(&controller, &agent_id, inbound, tx, shutdown).await;
            if let Err(e) = controller.agent_disconnected(&agent_id, conn_id).await {
                tracing::error!(agent_id, error = %e, "failed to record an agent disconnect");
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }
}

/// Handles one agent's messages in order until the stream ends, fails, or we shut down.
async fn serve(
    controller: &Controller,
    agent_id: &str,
    mut inbound: Streaming<AgentMessage>,
    tx: mpsc::Sender<ControllerMessage>,
    shutdown: CancellationToken,
) {
    loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => return,
            next = inbound.message() => next,
        };
        let msg = match next {
            Ok(Some(AgentMessage { msg: Some(msg) })) => {
                controller.agent_seen(agent_id);
                msg
            }
            Ok(Some(AgentMessage { msg: None })) => {
                controller.agent_seen(agent_id);
                continue;
            }
            Ok(None) => return,
            Err(status) => {
                tracing::info!(agent_id, code = ?status.code(), message = status.message(), "agent stream broke");
                return;
            }
        };
        match msg {
            agent_message::Msg::Receipts(batch) => {
                if batch.receipts.len() > MAX_BATCH {
                    tracing::error!(
                        agent_id,
                        receipts = batch.receipts.len(),
                        max = MAX_BATCH,
                        "batch too large; closing"
                    );
                    return;
                }
                let ack = match controller.ingest(batch).await {
                    Ok(ack) => ack,
                    Err(e) => {
                        tracing::error!(agent_id, error = %e, "failed to store receipts; closing so the agent resends");
                        return;
                    }
                };
                let msg = ControllerMessage { msg: Some(controller_message::Msg::Ack(ack)) };
                if tx.send(msg).await.is_err() {
                    return;
                }
            }
            agent_message::Msg::RankUpdate(update) => {
                let Some(report) = update.report else { continue };
                if let Err(e) = controller.rank_update(agent_id, &report).await {
                    tracing::error!(agent_id, error = %e, "failed to apply a rank update; closing so the agent resends");
                    return;
                }
            }
            agent_message::Msg::Leaving(leaving) => {
                if let Err(e) = controller.agent_leaving(agent_id, &leaving.reason).await {
                    tracing::error!(agent_id, error = %e, "failed to record that an agent is leaving");
                }
            }
            // Every message counts as a sign of life (see the top of the loop).
            agent_message::Msg::Heartbeat(_) => {}
            agent_message::Msg::LogData(data) => controller.log_data(agent_id, data).await,
            agent_message::Msg::Preflight(report) => {
                if let Err(e) = controller.agent_preflight(agent_id, report).await {
                    tracing::error!(agent_id, error = %e, "failed to store a preflight report; closing");
                    return;
                }
            }
            agent_message::Msg::Hello(_) => {
                tracing::warn!(agent_id, "second hello on one stream ignored");
            }
        }
    }
}
