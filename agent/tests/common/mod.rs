//! A fake controller on port 0 for the agent daemon's tests: it takes the agent's one stream,
//! hands every message the agent sends to the test, and sends what the test queues.
#![allow(dead_code)]

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use trainyard_agent::AgentConfig;
use trainyard_proto::v1::agent_message::Msg as Out;
use trainyard_proto::v1::agents_server::{Agents, AgentsServer};
use trainyard_proto::v1::controller_message::Msg as In;
use trainyard_proto::v1::{AgentMessage, ControllerMessage};

type ToAgent = mpsc::Receiver<Result<ControllerMessage, Status>>;

/// Hands the one expected stream's two ends to the test.
struct FakeController {
    ends: Mutex<Option<(mpsc::Sender<AgentMessage>, ToAgent)>>,
}

#[tonic::async_trait]
impl Agents for FakeController {
    type ConnectStream = Pin<Box<dyn Stream<Item = Result<ControllerMessage, Status>> + Send>>;

    async fn connect(
        &self,
        request: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let ends = self.ends.lock().map_err(|_| Status::internal("poisoned"))?.take();
        let (seen, to_agent) = ends.ok_or_else(|| Status::unavailable("one stream only"))?;
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            while let Some(Ok(message)) = inbound.next().await {
                if seen.send(message).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(to_agent))))
    }
}

/// A running agent daemon connected to a fake controller.
pub struct Fake {
    /// What the agent sent, in order.
    pub seen: mpsc::Receiver<AgentMessage>,
    /// What the controller sends to the agent.
    pub to_agent: mpsc::Sender<Result<ControllerMessage, Status>>,
    pub server: JoinHandle<Result<(), tonic::transport::Error>>,
    /// Send to shut the agent down.
    pub stop: oneshot::Sender<()>,
    pub agent: JoinHandle<anyhow::Result<()>>,
    pub dir: tempfile::TempDir,
    /// An empty working directory for ranks.
    pub work: PathBuf,
    /// The agent's data directory.
    pub data: PathBuf,
}

/// Starts the fake controller and an agent whose host file is `host` (JSON).
pub async fn start(host: &str) -> Fake {
    let dir = tempfile::tempdir().unwrap();
    let (seen_tx, seen) = mpsc::channel(64);
    let (to_agent, to_agent_rx) = mpsc::channel(64);
    let fake = FakeController { ends: Mutex::new(Some((seen_tx, to_agent_rx))) };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentsServer::new(fake))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    std::fs::write(dir.path().join("host.json"), host).unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let data = dir.path().join("data");
    let mut config =
        AgentConfig::new(format!("http://{addr}"), Some(dir.path().join("host.json")), data.clone());
    config.shim_program = env!("CARGO_BIN_EXE_trainyard-shim").into();
    // These tests run as root on CI machines; their launches name no Unix account.
    config.allow_root_ranks = true;
    let (stop, stop_rx) = oneshot::channel::<()>();
    let agent = tokio::spawn(trainyard_agent::run(config, async move {
        let _ = stop_rx.await;
    }));
    Fake { seen, to_agent, server, stop, agent, dir, work, data }
}

/// The next message the agent sent (waits up to 10 s).
pub async fn next(seen: &mut mpsc::Receiver<AgentMessage>) -> Out {
    let message = tokio::time::timeout(Duration::from_secs(10), seen.recv())
        .await
        .expect("agent said nothing for 10 s")
        .expect("agent stream ended");
    message.msg.expect("empty agent message")
}

/// A controller message as the stream carries it.
pub fn msg(m: In) -> Result<ControllerMessage, Status> {
    Ok(ControllerMessage { msg: Some(m) })
}

/// A one-rank launch of `sh -c script` in `work`, attempt 0.
pub fn sh_launch(job_id: u64, work: &std::path::Path, script: &str) -> trainyard_proto::v1::Launch {
    use trainyard_proto::v1::{ExecEngine, JobSpec, Launch, RankAssignment, job_spec};
    Launch {
        job_id,
        attempt: 0,
        world_size: 1,
        local_world_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: 29500,
        ranks: vec![RankAssignment { rank: 0, local_rank: 0, gpu_index: 0, ..Default::default() }],
        spec: Some(JobSpec {
            engine: Some(job_spec::Engine::Exec(ExecEngine {
                argv: vec!["sh".into(), "-c".into(), script.into()],
                workdir: work.display().to_string(),
                source_dir: String::new(),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}
