//! The job state machine against in-process agents: what happens when the controller or an
//! agent goes away at an awkward moment.

use std::time::Duration;

use trainyard_proto::v1::{RankKey, controller_message::Msg};

use super::*;
use crate::config::ControllerConfig;
use crate::core::test_support::{connect, controller, report, spec, store};
use std::sync::Arc;
use trainyard_store::Store;
use trainyard_store::{Allocation, JobState, RankId, RankObserved};

async fn state_of(c: &Controller, job: u64) -> (String, String) {
    let j = c.jobs().get(job).await.expect("job");
    (j.state, j.reason)
}

#[tokio::test]
async fn a_placement_recorded_before_a_crash_is_launched_when_the_agent_returns() {
    let store = store().await;
    // The controller recorded the placement, then died before sending the launch.
    let job = store.create_job(&spec(2).try_into().unwrap(), None, "submitted", 1).await.expect("create").id;
    let allocs: Vec<Allocation> = (0..2)
        .map(|rank| Allocation {
            id: RankId { job_id: job, attempt: 0, rank },
            agent_id: "a".into(),
            gpu_index: rank,
            node_rank: 0,
            local_rank: rank,
            planned_cpus: String::new(),
            planned_mems: String::new(),
            observed: RankObserved { state: trainyard_store::RankState::Planned, ..Default::default() },
        })
        .collect();
    store.schedule(job, 0, &allocs, "placed", 2).await.expect("schedule");

    let c = controller(&store).await;
    let mut agent = connect(&c, "a", 2, None).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(agent.launched_jobs(), vec![job], "the launch is sent again");
    assert_eq!(state_of(&c, job).await.0, "launching");
    for rank in 0..2 {
        c.jobs().rank_report("a", &report(job, 0, rank, "running", -1)).await.expect("update");
    }
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(state_of(&c, job).await.0, "running");
    for rank in 0..2 {
        c.jobs().rank_report("a", &report(job, 0, rank, "exited", 0)).await.expect("update");
    }
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(state_of(&c, job).await, ("succeeded".into(), "all 2 ranks exited with code 0".into()));
    assert!(agent.sent().iter().any(|m| matches!(m, Msg::Forget(f) if f.job_id == job)), "ranks forgotten");
}

#[tokio::test]
async fn an_agent_that_returns_without_its_running_ranks_restarts_the_job_elsewhere() {
    let store = store().await;
    let c = controller(&store).await;
    let agent = connect(&c, "a", 2, None).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let job = c.jobs().submit(spec(2), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    for rank in 0..2 {
        c.jobs().rank_report("a", &report(job, 0, rank, "running", -1)).await.expect("update");
    }
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    c.nodes().disconnected("a", agent.conn_id).await.expect("disconnect");
    // Its state directory was wiped: the hello reports no ranks.
    let _back = connect(&c, "a", 2, None).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    // A host that lost its ranks is the fleet's failure: the job restarts, and the node is left
    // out until it passes a preflight (here the only node, so the job waits and says why).
    let view = c.jobs().get(job).await.expect("job");
    assert_eq!(view.state, "pending");
    assert!(view.events.iter().any(|e| e.reason.contains("agent a came back without it")), "{view:?}");
    assert_eq!(view.failures[0].kind, "host_lost");
    assert!(view.waiting_reason.contains("restart backoff") || view.waiting_reason.contains("avoiding a"));
}

#[tokio::test]
async fn ranks_on_an_agent_gone_past_the_timeout_are_lost() {
    let store = store().await;
    // No host wait: the verdict itself is under test here (host_wait_tests has the wait).
    let config = ControllerConfig::default()
        .with_agent_timeout(Duration::from_millis(50))
        .with_host_wait(Duration::ZERO)
        .with_reconnect_grace(Duration::ZERO);
    let c = Controller::start(store.clone(), config).await.expect("start");
    let agent = connect(&c, "a", 1, None).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let job = c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    c.jobs().rank_report("a", &report(job, 0, 0, "running", -1)).await.expect("update");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    c.nodes().disconnected("a", agent.conn_id).await.expect("disconnect");
    crate::core::test_support::reap(&c).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(state_of(&c, job).await.0, "running", "within the timeout nothing happens");
    tokio::time::sleep(Duration::from_millis(80)).await;
    crate::core::test_support::reap(&c).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let view = c.jobs().get(job).await.expect("job");
    assert_eq!(view.state, "pending", "restarted: a lost host does not use up max_restarts = 0");
    let restart = view.events.iter().find(|e| e.to_state == "restarting").expect("restart event");
    assert!(restart.reason.contains("agent a disconnected 0."), "{}", restart.reason);
}

#[tokio::test]
async fn ranks_of_a_finished_attempt_are_stopped_or_forgotten() {
    let store = store().await;
    let c = controller(&store).await;
    let mut agent = connect(&c, "a", 1, None).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let job = c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    c.jobs().rank_report("a", &report(job, 0, 0, "exited", 0)).await.expect("update");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    agent.sent();
    // A late report of a running rank of that finished attempt: stop it. An exited one: forget.
    c.jobs().rank_report("a", &report(job, 0, 0, "running", -1)).await.expect("update");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert!(agent.sent().iter().any(|m| matches!(m, Msg::Cancel(x) if x.job_id == job)));
    c.jobs().rank_report("a", &report(job, 0, 0, "exited", 0)).await.expect("update");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert!(agent.sent().iter().any(|m| matches!(m, Msg::Forget(x) if x.job_id == job)));
    assert_eq!(state_of(&c, job).await.0, "succeeded", "a late report changes nothing");
}

#[tokio::test]
async fn cancelling_a_pending_job_ends_it_at_once() {
    let store = store().await;
    let c = controller(&store).await;
    let _agent = connect(&c, "a", 1, None).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let running = c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let waiting = c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(state_of(&c, waiting).await.0, "pending");
    // The cancel is carried out by the reconciler; the request returns once it is stored.
    let reconciler = crate::core::reconcile::Reconciler(&c.s);
    let (record, ()) = tokio::join!(c.jobs().cancel(waiting, ""), reconciler.reconcile());
    let record = record.expect("cancel");
    assert_eq!((record.state, record.reason.as_str()), (JobState::Cancelled, "cancelled by operator"));
    assert_eq!(state_of(&c, running).await.0, "launching", "the other job is untouched");
    assert!(matches!(c.jobs().cancel(999, "").await, Err(ControllerError::JobNotFound(999))));
}

/// A store that refuses job B's placement (a real SQLite trigger, as a full disk or a broken
/// constraint would): B stays pending and says why, A's submit and placement go through, and B
/// is placed once the store takes writes again. Nobody's request fails.
#[tokio::test]
async fn a_placement_the_store_refuses_fails_no_other_request() {
    let sqlite = trainyard_store::SqlStore::sqlite_in_memory().await.expect("open store");
    sqlx::query(
        "CREATE TRIGGER refuse_job_1 BEFORE INSERT ON allocations WHEN NEW.job_id = 1 \
         BEGIN SELECT RAISE(ABORT, 'disk full'); END",
    )
    .execute(sqlite.sqlite_pool().expect("a SQLite store"))
    .await
    .expect("trigger");
    let store: Arc<dyn Store> = Arc::new(sqlite.clone());
    let c = controller(&store).await;
    let mut agent = connect(&c, "a", 2, None).await;
    let b = c.jobs().submit(spec(1), None).await.expect("B's submit is stored");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let view = c.jobs().get(b).await.expect("job");
    assert_eq!(view.state, "pending");
    assert!(
        view.waiting_reason.contains("could not be recorded") && view.waiting_reason.contains("disk full"),
        "{view:?}"
    );
    let a = c.jobs().submit(spec(1), None).await.expect("A's submit is not failed by B's placement");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(agent.launched_jobs(), vec![a]);
    assert_eq!(state_of(&c, a).await.0, "launching");

    sqlx::query("DROP TRIGGER refuse_job_1")
        .execute(sqlite.sqlite_pool().expect("a SQLite store"))
        .await
        .expect("drop trigger");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(agent.launched_jobs(), vec![b], "B is placed on the next pass");
}

/// Receipts of a job this controller does not know (a wiped or foreign database) are neither
/// stored nor acknowledged: the agent keeps them and sends them again later.
#[tokio::test]
async fn receipts_of_an_unknown_job_are_not_acknowledged() {
    use trainyard_proto::v1::{Receipt, ReceiptBatch};
    let store = store().await;
    let c = controller(&store).await;
    let _agent = connect(&c, "node-a", 8, None).await;
    let receipt = |job_id: u64, seq: u64| Receipt {
        key: Some(RankKey { job_id, attempt: 0, rank: 0 }),
        seq,
        kind: "step".into(),
        step: 1,
        body: r#"{"kind":"step","step":1}"#.into(),
    };
    let before = crate::metrics::metrics().receipts_unknown_job.get();
    let batch = ReceiptBatch { receipts: vec![receipt(4242, 0), receipt(4242, 1)] };
    let ack = c.receipts().ingest("node-a", batch).await.expect("ingest");
    assert!(ack.acks.is_empty(), "nothing acknowledged: {ack:?}");
    assert!(crate::metrics::metrics().receipts_unknown_job.get() >= before + 2);
    assert_eq!(store.receipts_after(4242, 0, 100).await.map(|r| r.len()).unwrap_or(0), 0);
}

/// A user may have `max_pending_per_user` jobs waiting: one more is refused, naming the cap;
/// another user is not held back by it.
#[tokio::test]
async fn a_user_may_have_so_many_pending_jobs_and_no_more() {
    let store = store().await;
    let config = crate::config::ControllerConfig { max_pending_per_user: 3, ..Default::default() };
    let c = Controller::start(store.clone(), config).await.expect("start");
    let _agent = connect(&c, "node-a", 8, None).await;
    let alice = trainyard_store::JobOwner { user: "alice".into(), run_as: "alice".into() };
    for _ in 0..3 {
        c.jobs().submit_as(spec(8), None, &alice).await.expect("at the cap");
    }
    let refused = c.jobs().submit_as(spec(8), None, &alice).await.expect_err("one over the cap");
    assert!(matches!(refused, ControllerError::TooMany(_)), "{refused}");
    assert!(refused.to_string().contains("(3)"), "{refused}");
    let bob = trainyard_store::JobOwner { user: "bob".into(), run_as: "bob".into() };
    c.jobs().submit_as(spec(8), None, &bob).await.expect("bob has his own cap");
}

/// The specs of one user's unfinished jobs may hold `max_spec_bytes_per_user` of the
/// controller's memory: a spec that would pass it is refused, naming the cap; another user is not
/// held back, and a job that ends gives its bytes back.
#[tokio::test]
async fn a_user_may_hold_so_many_spec_bytes_and_no_more() {
    let store = store().await;
    let parsed = trainyard_model::spec::parse(spec(8)).expect("valid");
    let one = prost::Message::encoded_len(&trainyard_proto::v1::JobSpec::from(&parsed));
    let config = crate::config::ControllerConfig { max_spec_bytes_per_user: 3 * one, ..Default::default() };
    let c = Controller::start(store.clone(), config).await.expect("start");
    let _agent = connect(&c, "node-a", 8, None).await;
    let alice = trainyard_store::JobOwner { user: "alice".into(), run_as: "alice".into() };
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(c.jobs().submit_as(spec(8), None, &alice).await.expect("at the cap"));
    }
    let refused = c.jobs().submit_as(spec(8), None, &alice).await.expect_err("one byte over");
    assert!(matches!(refused, ControllerError::TooMany(_)), "{refused}");
    assert!(refused.to_string().contains(&format!("({} bytes)", 3 * one)), "{refused}");
    let bob = trainyard_store::JobOwner { user: "bob".into(), run_as: "bob".into() };
    c.jobs().submit_as(spec(8), None, &bob).await.expect("bob has his own budget");
    // A finished job gives its bytes back.
    let reconciler = crate::core::reconcile::Reconciler(&c.s);
    let (cancelled, ()) = tokio::join!(c.jobs().cancel(ids[2], "make room"), reconciler.reconcile());
    cancelled.expect("cancel");
    c.jobs().submit_as(spec(8), None, &alice).await.expect("room again after a cancel");
}

/// A logs client that does not read never holds up the agent's stream: once its buffer is full
/// the next piece drops it at once (no wait), the agent is told to stop, and the client is told
/// why.
#[tokio::test]
async fn a_logs_client_that_does_not_read_is_dropped_without_waiting() {
    use trainyard_proto::v1::LogData;
    let store = store().await;
    let c = controller(&store).await;
    let mut agent = connect(&c, "node-a", 8, None).await;
    let job = c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let (_, mut rx) = c.jobs().logs(job, 0, 0, true).await.expect("open logs");
    let request_id = agent
        .sent()
        .into_iter()
        .find_map(|m| if let Msg::ReadLogs(r) = m { Some(r.request_id) } else { None })
        .expect("the agent was asked for logs");
    let piece =
        |n: u8| LogData { request_id, stream: "stdout".into(), data: vec![n; 16], ..Default::default() };
    let started = std::time::Instant::now();
    for n in 0..=crate::core::logs::BUFFER as u8 {
        c.jobs().log_data("node-a", piece(n));
    }
    assert!(started.elapsed() < Duration::from_secs(1), "never waits for the client");
    assert!(agent.sent().iter().any(|m| matches!(m, Msg::StopLogs(s) if s.request_id == request_id)));
    let mut got = 0;
    let mut told = String::new();
    while let Some(event) = rx.recv().await {
        match event {
            LogEvent::Chunk { .. } => got += 1,
            LogEvent::Failed(why) => told = why,
        }
    }
    assert_eq!(got, crate::core::logs::BUFFER, "what was buffered is delivered");
    assert!(told.contains("pieces were waiting"), "{told}");
}

#[tokio::test]
async fn a_shape_the_fleet_could_not_hold_is_accepted_once_a_node_joins() {
    let store = store().await;
    let c = controller(&store).await;
    let _a = connect(&c, "a", 8, None).await;
    for _ in 0..2 {
        // The second answer comes from the feasibility cache: it must be the same.
        let refused = c.jobs().submit(spec(16), None).await.expect_err("16 GPUs on one 8-GPU node");
        assert!(matches!(refused, ControllerError::Unsatisfiable(_)), "{refused}");
    }
    assert_eq!(c.s.lock().feasible.len(), 1, "one shape answered");
    // A node joins: the cached answer is stale and is asked again.
    let _b = connect(&c, "b", 8, None).await;
    c.jobs().submit(spec(16), None).await.expect("16 GPUs on two 8-GPU nodes");
    c.jobs().submit(spec(1), None).await.expect("1 GPU");
    assert_eq!(c.s.lock().feasible.len(), 2, "{:?}", c.s.lock().feasible.keys().collect::<Vec<_>>());
}

#[tokio::test]
async fn the_running_controller_places_jobs_at_most_every_schedule_interval() {
    use tokio::time::Instant;
    let store = store().await;
    let c = controller(&store).await;
    let mut agent = connect(&c, "a", 8, None).await;
    let mut next_pass = Instant::now();
    // A pass with nothing pending does not start the interval.
    assert!(crate::core::reconcile::Reconciler(&c.s).reconcile_paced(&mut next_pass).await);
    assert!(next_pass <= Instant::now(), "an empty pass paces nothing");
    let first = c.jobs().submit(spec(1), None).await.expect("submit");
    let before = Instant::now();
    assert!(
        crate::core::reconcile::Reconciler(&c.s).reconcile_paced(&mut next_pass).await,
        "a quiet controller places at once"
    );
    assert_eq!(agent.launched_jobs(), vec![first]);
    assert!(next_pass >= before + super::reconcile::SCHEDULE_EVERY, "the next pass waits the interval");
    // Within the interval (whatever the machine's speed: the next pass is set an hour away).
    next_pass = Instant::now() + Duration::from_secs(3600);
    let second = c.jobs().submit(spec(1), None).await.expect("submit");
    assert!(
        !crate::core::reconcile::Reconciler(&c.s).reconcile_paced(&mut next_pass).await,
        "the pass is owed, not run"
    );
    assert!(agent.launched_jobs().is_empty(), "placed within the interval");
    next_pass = Instant::now();
    assert!(
        crate::core::reconcile::Reconciler(&c.s).reconcile_paced(&mut next_pass).await,
        "the owed pass runs when the interval is over"
    );
    assert_eq!(agent.launched_jobs(), vec![second]);
}

#[tokio::test]
async fn an_ended_job_waits_for_a_turn_to_record_its_outcome() {
    let store = store().await;
    let c = controller(&store).await;
    let _a = connect(&c, "a", 8, None).await;
    let job = c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    c.jobs().rank_report("a", &report(job, 0, 0, "exited", 0)).await.expect("update");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(state_of(&c, job).await.0, "succeeded");
    // Every turn is taken (other jobs recording theirs): this one waits past its settling.
    let turns = c.s.outcomes.acquire_many(super::diagnosis::OUTCOMES_AT_ONCE as u32).await.expect("turns");
    let recording = tokio::spawn({
        let c = c.clone();
        async move { c.diagnoses().record_outcome(job).await }
    });
    let settle = Duration::from_millis(trainyard_analysis::series::SETTLE_MS as u64);
    tokio::time::sleep(settle + Duration::from_millis(500)).await;
    assert!(!recording.is_finished(), "recorded without a turn");
    drop(turns);
    tokio::time::timeout(Duration::from_secs(10), recording)
        .await
        .expect("recorded once a turn is free")
        .ok();
}

/// A `List` answer carries as many jobs as fit its byte budget, newest first, whole, and counts
/// the jobs it asked for and left off: at a budget of exactly three jobs' bytes three come, one
/// byte less and two come. The real budget leaves 64 KiB of the 64 MiB response limit.
#[tokio::test]
async fn a_list_answer_fits_its_budget_and_counts_what_it_left_off() {
    let store = store().await;
    let c = controller(&store).await;
    let _agent = connect(&c, "a", 1, None).await;
    for i in 0..5 {
        let mut big = spec(1);
        big.env.insert("PAD".into(), format!("{i}{}", "x".repeat(100_000)));
        c.jobs().submit(big, None).await.expect("submit");
    }
    let (all, left_off) = c.jobs().list_within(false, None, 0, usize::MAX).await.expect("list");
    assert_eq!((all.len(), left_off), (5, 0));
    let bytes = |jobs: &[trainyard_proto::v1::Job]| {
        prost::Message::encoded_len(&trainyard_proto::v1::ListJobsResponse {
            jobs: jobs.to_vec(),
            left_off: 0,
        })
    };
    let three = bytes(&all[..3]);
    let (jobs, left_off) = c.jobs().list_within(false, None, 0, three).await.expect("list");
    assert_eq!((jobs.len(), left_off), (3, 2), "at a budget of three jobs' bytes");
    assert_eq!(
        jobs.iter().map(|j| j.id).collect::<Vec<_>>(),
        all[..3].iter().map(|j| j.id).collect::<Vec<_>>()
    );
    let (jobs, left_off) = c.jobs().list_within(false, None, 0, three - 1).await.expect("list");
    assert_eq!((jobs.len(), left_off), (2, 3), "one byte under three jobs' bytes");
    assert_eq!(super::jobs::LIST_BUDGET + (64 << 10), trainyard_proto::limits::MAX_RESPONSE_BYTES);
    let (jobs, left_off) = c.jobs().list(false, None, 3).await.expect("list");
    assert_eq!((jobs.len(), left_off), (3, 0), "the limit asked for is not a job left off");
}
