//! Test support for the controller's core: an in-memory store and in-process agents that
//! talk to the [`Controller`] over channels instead of gRPC streams.

use std::sync::Arc;

use tokio::sync::mpsc;
use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::{
    ControllerMessage, ExecEngine, Gpu, Hello, HostInventory, JobSpec, NumaNode, PreflightReport, Resources,
    controller_message::Msg, job_spec::Engine,
};

use super::Controller;
use crate::config::ControllerConfig;
use trainyard_store::{SqlStore, Store};

pub(super) async fn store() -> Arc<dyn Store> {
    Arc::new(SqlStore::sqlite_in_memory().await.expect("open store"))
}

pub(super) async fn controller(store: &Arc<dyn Store>) -> Arc<Controller> {
    controller_with(store, ControllerConfig::default()).await
}

pub(super) async fn controller_with(store: &Arc<dyn Store>, config: ControllerConfig) -> Arc<Controller> {
    Controller::start(store.clone(), config).await.expect("start")
}

/// The reaper's pass over vanished agents, as the running controller's loop takes it.
pub(super) async fn reap(c: &Controller) {
    let s = &c.s;
    super::liveness::reap_vanished_agents(
        &super::reconcile::Reconciler(s),
        &s.heard,
        &s.steps,
        &s.logs,
        s.started,
    )
    .await
}

/// A job as the store holds it: attempt 0 of `spec` in `state`.
pub(super) fn record(
    id: u64,
    state: trainyard_store::JobState,
    spec: trainyard_model::spec::JobSpec,
) -> trainyard_store::JobRecord {
    trainyard_store::JobRecord {
        id,
        spec,
        owner: Default::default(),
        state,
        reason: String::new(),
        attempt: 0,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

pub(super) fn inventory(host: &str, gpus: u32) -> HostInventory {
    HostInventory {
        hostname: host.into(),
        gpus: (0..gpus)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{host}-{i}"),
                model: "NVIDIA H100 80GB HBM3".into(),
                memory_mib: 81_559,
                pci_bus_id: format!("00000000:{:02x}:00.0", 0x18 + i),
                numa_node: (i * 2 / gpus) as i32,
            })
            .collect(),
        numa_nodes: vec![NumaNode { id: 0, cpus: "0-55".into() }, NumaNode { id: 1, cpus: "56-111".into() }],
        links: vec![],
        cores: vec![],
    }
}

/// Says hello as `host`; returns the agent's end of the stream with the hello ack read.
pub(super) async fn connect(
    c: &Controller,
    host: &str,
    gpus: u32,
    preflight: Option<PreflightReport>,
) -> Agent {
    let (tx, mut rx) = mpsc::channel(64);
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_id: host.into(),
        address: "127.0.0.1".into(),
        inventory: Some(inventory(host, gpus)),
        ranks: vec![],
        agent_version: "test".into(),
        preflight,
        join_token: String::new(),
    };
    let conn_id = c.nodes().hello(hello, tx).await.expect("hello");
    assert!(matches!(rx.recv().await, Some(ControllerMessage { msg: Some(Msg::HelloAck(_)) })));
    Agent { rx, conn_id }
}

pub(super) struct Agent {
    pub(super) rx: mpsc::Receiver<ControllerMessage>,
    pub(super) conn_id: u64,
}

impl Agent {
    /// Messages sent to this agent so far.
    pub(super) fn sent(&mut self) -> Vec<Msg> {
        std::iter::from_fn(|| self.rx.try_recv().ok()).filter_map(|m| m.msg).collect()
    }

    pub(super) fn launched_jobs(&mut self) -> Vec<u64> {
        self.sent()
            .into_iter()
            .filter_map(|m| if let Msg::Launch(l) = m { Some(l.job_id) } else { None })
            .collect()
    }
}

pub(super) fn spec(gpus: u32) -> JobSpec {
    JobSpec {
        name: format!("job-{gpus}"),
        resources: Some(Resources { gpus, ..Default::default() }),
        engine: Some(Engine::Exec(ExecEngine {
            argv: vec!["true".into()],
            workdir: "/tmp".into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A passing quick preflight report of `host`, finished at `at_ms`.
pub(super) fn passing_report(host: &str, at_ms: i64) -> PreflightReport {
    PreflightReport {
        agent_id: host.into(),
        local_id: format!("{host}-{at_ms}"),
        level: "quick".into(),
        started_at_ms: at_ms - 10,
        finished_at_ms: at_ms,
        verdict: "pass".into(),
        interconnect_class: "nvswitch".into(),
        topology: "GPU0\tX\n".into(),
        source: "host-file".into(),
        ..Default::default()
    }
}

/// A rank report of `state` (pid 1000 + rank).
pub(super) fn report(
    job_id: u64,
    attempt: u32,
    rank: u32,
    state: &str,
    exit_code: i32,
) -> trainyard_proto::v1::RankReport {
    trainyard_proto::v1::RankReport {
        key: Some(trainyard_proto::v1::RankKey { job_id, attempt, rank }),
        state: state.into(),
        pid: 1000 + rank,
        exit_code,
        ..Default::default()
    }
}
