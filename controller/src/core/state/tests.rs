//! The core's in-memory state and the plain functions over it, without a store, a runtime or
//! an agent: rebuilt from what the store holds, the GPUs ranks hold, a hostname resolved, a
//! message to a full stream, and blame that cordons a node.

use std::sync::Arc;

use tokio::sync::mpsc;
use trainyard_model::domain::Inventory;
use trainyard_model::spec::JobSpec;
use trainyard_proto::v1::ControllerMessage;
use trainyard_proto::v1::controller_message::Msg;
use trainyard_store::{
    AgentRecord, AgentState, Allocation, FailureKind, FailureRecord, JobRecord, JobState, PreflightLevel,
    PreflightRecord, RankId, RankObserved, RankState, Snapshot, Verdict,
};

use super::*;
use crate::config::ControllerConfig;

fn agent(id: &str, hostname: &str, gpus: u32) -> AgentRecord {
    let wire = crate::core::test_support::inventory(hostname, gpus);
    AgentRecord {
        agent_id: id.into(),
        address: "127.0.0.1".into(),
        agent_version: "test".into(),
        inventory: Inventory::from(wire),
        state: AgentState::Connected,
        last_seen_ms: 0,
        cordon: None,
    }
}

fn job(id: u64, state: JobState) -> JobRecord {
    let spec = JobSpec::try_from(crate::core::test_support::spec(2)).expect("a valid spec");
    crate::core::test_support::record(id, state, spec)
}

fn rank(job_id: u64, rank: u32, agent: &str, gpu: u32, state: RankState) -> Allocation {
    Allocation {
        id: RankId { job_id, attempt: 0, rank },
        agent_id: agent.into(),
        gpu_index: gpu,
        node_rank: 0,
        local_rank: rank,
        planned_cpus: String::new(),
        planned_mems: String::new(),
        observed: RankObserved { state, ..Default::default() },
    }
}

fn report(agent: &str, verdict: Verdict) -> PreflightRecord {
    PreflightRecord {
        report_id: 1,
        agent_id: agent.into(),
        local_id: String::new(),
        level: PreflightLevel::Quick,
        started_at_ms: 0,
        finished_at_ms: 1,
        verdict,
        interconnect_class: None,
        driver_version: String::new(),
        cuda_version: String::new(),
        nccl_version: String::new(),
        source: "host-file".into(),
        topology: String::new(),
        checks: vec![],
        job_id: None,
        gpus: vec![],
    }
}

/// Two nodes, one running job (ranks stored out of order), one job that succeeded with a rank
/// still alive; node-a's preflight failed.
fn core() -> Core {
    let snapshot = Snapshot {
        active_jobs: vec![job(1, JobState::Running), job(2, JobState::Succeeded)],
        allocations: vec![
            rank(1, 1, "node-a", 1, RankState::Running),
            rank(1, 0, "node-a", 0, RankState::Running),
            rank(2, 0, "node-b", 3, RankState::Running),
            rank(2, 1, "node-b", 2, RankState::Exited),
        ],
        agents: vec![agent("node-a", "gpu-host-1", 4), agent("node-b", "gpu-host-2", 4)],
    };
    Core::from_stored(snapshot, vec![report("node-a", Verdict::Fail)], Instant::now())
}

#[test]
fn the_state_is_rebuilt_from_what_the_store_holds() {
    let core = core();
    let a = &core.agents["node-a"];
    assert!(a.link.is_none() && a.disconnected_since.is_some() && !a.seen_since_start);
    assert!(a.failing(), "the stored verdict holds until the node reports again");
    assert!(!core.agents["node-b"].failing());
    let ranks: Vec<u32> = core.jobs[&1].allocations.iter().map(|a| a.id.rank).collect();
    assert_eq!(ranks, [0, 1], "allocations in rank order");
    assert_eq!(core.jobs[&1].record().state, JobState::Running);
}

#[test]
fn a_gpu_is_busy_while_its_job_is_unfinished_or_its_rank_alive() {
    let busy = crate::core::fleet::busy_gpus(&core());
    let expected = [("node-a", 0), ("node-a", 1), ("node-b", 3)].map(|(a, g)| (a.to_string(), g));
    assert_eq!(busy, expected.into_iter().collect(), "node-b's GPU 2 ran a rank that exited");
}

#[test]
fn an_operator_names_a_node_by_agent_id_or_by_a_hostname_only_one_has() {
    let mut core = core();
    assert_eq!(crate::core::fleet::resolve(&core, "node-b").unwrap(), "node-b");
    assert_eq!(crate::core::fleet::resolve(&core, "gpu-host-1").unwrap(), "node-a");
    let twin = agent("node-c", "gpu-host-1", 1);
    core.agents.get_mut("node-b").unwrap().record.inventory.hostname = "other".into();
    core.agents.insert("node-c".into(), AgentEntry { record: twin, ..entry_of(&core.agents["node-a"]) });
    let err = crate::core::fleet::resolve(&core, "gpu-host-1").unwrap_err().to_string();
    assert!(err.contains("gpu-host-1"), "two agents share the hostname: {err}");
}

fn entry_of(e: &AgentEntry) -> AgentEntry {
    AgentEntry {
        record: e.record.clone(),
        link: None,
        leaving: false,
        disconnected_since: e.disconnected_since,
        preflight: None,
        unresponsive: false,
        seen_since_start: false,
        links: Arc::clone(&e.links),
        bound: None,
        dismissed: false,
    }
}

#[test]
fn a_stream_that_takes_no_more_messages_loses_its_link() {
    let mut core = core();
    let (tx, mut rx) = mpsc::channel::<ControllerMessage>(1);
    let entry = core.agents.get_mut("node-b").unwrap();
    entry.link = Some(AgentLink { conn_id: 7, tx });
    entry.disconnected_since = None;
    let stop = || Msg::StopLogs(trainyard_proto::v1::StopLogs { request_id: 1 });
    assert!(crate::core::launch::send(&mut core, "node-b", stop()));
    assert!(!crate::core::launch::send(&mut core, "node-b", stop()), "the stream is full");
    let entry = &core.agents["node-b"];
    assert!(entry.link.is_none() && entry.disconnected_since.is_some(), "the agent must say hello again");
    assert!(rx.try_recv().is_ok(), "the first message was delivered");
    assert!(!crate::core::launch::send(&mut core, "node-x", stop()), "no such agent");
}

#[test]
fn blame_within_the_window_cordons_a_node_and_the_job_avoids_it() {
    let mut core = core();
    let config = ControllerConfig { cordon_after_blames: 2, ..ControllerConfig::default() };
    let failure = |at_ms| FailureRecord {
        job_id: 1,
        attempt: 0,
        at_ms,
        kind: FailureKind::RankLost,
        agent_id: Some("node-b".into()),
        rank: Some(0),
        evidence: "supervisor vanished".into(),
        blamed: true,
        charged: false,
    };
    crate::core::faults::blame(&mut core, &failure(1_000), &config);
    assert!(core.jobs[&1].avoid.contains_key("node-b"));
    assert!(core.agents["node-b"].record.cordon.is_none(), "one blame is not yet a cordon");
    let outside = config.blame_window.as_millis() as i64 + 2_000;
    crate::core::faults::blame(&mut core, &failure(outside), &config);
    assert!(core.agents["node-b"].record.cordon.is_none(), "the first blame fell out of the window");
    crate::core::faults::blame(&mut core, &failure(outside + 1), &config);
    let cordon = core.agents["node-b"].record.cordon.clone().expect("cordoned");
    assert!(cordon.reason.contains("blamed for 2 failures"), "{}", cordon.reason);
    assert_eq!(core.cordons_to_store, vec![("node-b".to_string(), Some(cordon))], "written after the lock");
}
