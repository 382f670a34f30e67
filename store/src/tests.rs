//! The store contract as a test suite generic over [`Store`]: every backend instantiates it
//! with [`store_suite!`] and a [`Harness`], so the backends cannot drift apart.

use trainyard_proto::v1::{PreflightCheck, PreflightReport};

use crate::{
    AgentRecord, AgentState, Allocation, AuthStore, Cordon, FailureKind, FailureRecord, FleetStore, JobState,
    JobStore, NewReceipt, PreflightRecord, PreflightStore, RankId, RankObserved, RankState, ReceiptStore,
    SeriesStore, Store, StoreError,
};
use crate::{DiagnosisStore, SqlStore};
use trainyard_model::domain::{GpuInfo, Inventory, PreflightLevel};
use trainyard_model::spec::{Engine, JobSpec, Resources};
use trainyard_testkit::pg_server::{Durability, TempPostgres};

/// Opens a backend's store; `open` called twice opens the same database (restart tests).
pub trait Harness: Sized {
    type S: Store + Clone + 'static;
    async fn new() -> Self;
    async fn open(&self) -> Self::S;
}

/// Generates, in the calling module, one `#[tokio::test]` per suite function for a harness.
macro_rules! store_suite {
    ($harness:ty) => {
        store_suite!(@each $harness:
            create_get_list,
            transitions_and_conflicts,
            events_in_order_with_reasons,
            schedule_writes_allocations,
            schedule_refuses_non_pending_job_atomically,
            observe_rank_known_and_unknown,
            concurrent_rank_reports_commit_together,
            agents_upsert_with_gpus,
            snapshot_after_reopen,
            receipts_dedup,
            concurrent_batches_commit_together_and_each_learns_its_count,
            queued_batches_are_written_in_the_order_they_were_queued,
            receipts_after_pages_by_cursor,
            last_seqs_and_counts,
            preflight_round_trip_with_checks_in_order,
            preflight_same_report_twice_is_stored_once,
            preflight_latest_per_agent_after_reopen,
            binding_planned_then_effective,
            mean_optimizer_ms_of_step_receipts,
            submit_keys_are_unique,
            attempt_facts_and_outcomes,
            step_rollups_fold_each_receipt_once,
            concurrent_folds_count_each_receipt_once,
            users_tokens_owners_and_audit,
            secrets_are_created_once_and_kept,
            receipts_of_long_ended_jobs_are_pruned,
            failures_move_the_job_with_their_cause,
            cordons_survive_hellos_and_reopen,
            gpu_windows_are_stored_once_read_back_and_pruned,
            live_findings_open_update_close_and_keep_their_alerts,
            one_controller_leads_and_a_lost_lease_fences_its_writes,
        );
    };
    (@each $harness:ty: $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                let harness = <$harness as Harness>::new().await;
                super::suite::$name(&harness).await;
            }
        )+
    };
}

/// SQLite on a file in a fresh temporary directory.
pub struct SqliteHarness {
    dir: tempfile::TempDir,
}

impl Harness for SqliteHarness {
    type S = SqlStore;
    async fn new() -> Self {
        SqliteHarness { dir: tempfile::tempdir().expect("create temp dir") }
    }
    async fn open(&self) -> SqlStore {
        SqlStore::open_sqlite_file(&self.dir.path().join("trainyard.db")).await.expect("open store")
    }
}

/// A fresh database on the PostgreSQL server this test binary started (one server for all
/// tests, stopped when the process ends; see `pg_server`).
pub struct PgHarness {
    url: String,
}

/// The test binary's PostgreSQL server, started on first use.
pub fn pg_server() -> &'static TempPostgres {
    static SERVER: std::sync::OnceLock<TempPostgres> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| TempPostgres::start(Durability::Relaxed).unwrap_or_else(|e| panic!("{e}")))
}

impl Harness for PgHarness {
    type S = SqlStore;
    async fn new() -> Self {
        let url = tokio::task::spawn_blocking(|| pg_server().create_database()).await.unwrap();
        PgHarness { url: url.unwrap_or_else(|e| panic!("{e}")) }
    }
    async fn open(&self) -> SqlStore {
        SqlStore::open_postgres(&self.url).await.expect("open store")
    }
}

mod sqlite_store {
    use super::{Harness, SqliteHarness};
    store_suite!(SqliteHarness);
}

mod postgres_store {
    use super::{Harness, PgHarness};
    store_suite!(PgHarness);
}

/// Builders shared by the suite.
pub mod fixtures {
    use super::*;

    /// Store transactions of `op` so far in this process (from the store's own metrics).
    pub fn transactions(op: &str) -> u64 {
        let mut registry = prometheus_client::registry::Registry::default();
        crate::metrics::metrics().register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let key = format!("store_operation_seconds_count{{op=\"{op}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(key.as_str())).map_or(0, |n| n.trim().parse().unwrap())
    }

    pub fn spec(name: &str, gpus: u32) -> JobSpec {
        JobSpec {
            resources: Resources { gpus, gpus_per_node: gpus, ..Default::default() },
            engine: Engine::Exec {
                argv: vec!["python".into(), "train.py".into()],
                workdir: "/srv/run".into(),
                source_dir: String::new(),
            },
            env: [("WANDB_MODE".to_owned(), "offline".to_owned())].into(),
            preflight: PreflightLevel::Quick,
            priority: 3,
            ..JobSpec::exec(name, gpus, &[])
        }
    }

    pub fn allocation(job_id: u64, attempt: u32, rank: u32, agent: &str) -> Allocation {
        Allocation {
            id: RankId { job_id, attempt, rank },
            agent_id: agent.to_owned(),
            gpu_index: rank,
            node_rank: 0,
            local_rank: rank,
            planned_cpus: String::new(),
            planned_mems: String::new(),
            observed: RankObserved { state: RankState::Planned, ..Default::default() },
        }
    }

    pub fn agent(id: &str, gpus: u32, state: AgentState, now_ms: i64) -> AgentRecord {
        AgentRecord {
            agent_id: id.to_owned(),
            address: "10.0.0.7".into(),
            agent_version: "0.1.0".into(),
            inventory: Inventory {
                hostname: id.to_owned(),
                gpus: (0..gpus)
                    .map(|i| GpuInfo {
                        index: i,
                        uuid: format!("GPU-{id}-{i}"),
                        model: "NVIDIA H100 80GB HBM3".into(),
                        memory_mib: 81559,
                        pci_bus_id: format!("00000000:{:02x}:00.0", 0x18 + i),
                        numa_node: Some(i / 4),
                    })
                    .collect(),
                numa_nodes: vec![],
                links: vec![],
                cores: vec![],
            },
            state,
            last_seen_ms: now_ms,
            cordon: None,
        }
    }

    /// A preflight report of `agent` with `checks` checks; the last one has `last_status`, the
    /// others pass, and the verdict follows the last one.
    pub fn preflight(agent: &str, started_at_ms: i64, checks: usize, last_status: &str) -> PreflightRecord {
        PreflightRecord::try_from(preflight_pb(agent, started_at_ms, checks, last_status))
            .expect("known words")
    }

    /// [`preflight`] as the agent sends it (any words).
    pub fn preflight_pb(
        agent: &str,
        started_at_ms: i64,
        checks: usize,
        last_status: &str,
    ) -> PreflightReport {
        let checks = (0..checks)
            .map(|i| PreflightCheck {
                id: if i + 1 == checks { "cuda.init.gpu3".into() } else { format!("check.{i}") },
                status: if i + 1 == checks { last_status.into() } else { "pass".into() },
                measured: format!("measured {i}"),
                expected: format!("expected {i}"),
                remedy: if i + 1 == checks { "replace GPU 3 (RMA)".into() } else { String::new() },
            })
            .collect();
        PreflightReport {
            report_id: 0,
            agent_id: agent.to_owned(),
            level: "quick".into(),
            started_at_ms,
            finished_at_ms: started_at_ms + 1_500,
            verdict: if last_status == "skipped" { "pass".into() } else { last_status.into() },
            interconnect_class: "nvswitch".into(),
            topology: "\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X \n".into(),
            driver_version: "570.124.06".into(),
            cuda_version: "12.8".into(),
            nccl_version: String::new(),
            source: "host-file".into(),
            checks,
            local_id: format!("{agent}-{started_at_ms}"),
            ..Default::default()
        }
    }

    /// `n` step receipts of one rank, seq `first..first+n`.
    pub fn receipts(id: RankId, first: u64, n: u64) -> Vec<NewReceipt> {
        (first..first + n)
            .map(|seq| {
                let body = format!(
                    r#"{{"kind":"step","step":{seq},"loss":{:.3},"step_time_ms":{},"tokens_per_s":{},"optimizer_ms":7}}"#,
                    4.0 - seq as f64 * 0.01,
                    100 + seq % 10,
                    50_000 + seq
                );
                receipt(id, seq, "step", Some(seq as i64), &body)
            })
            .collect()
    }

    /// A receipt as ingest would store it (checked against schema v1).
    pub fn receipt(id: RankId, seq: u64, kind: &str, step: Option<i64>, body: &str) -> NewReceipt {
        let checked = trainyard_model::receipts::check(kind, body).expect("a JSON object");
        NewReceipt {
            id,
            seq,
            kind: kind.into(),
            step,
            body: body.into(),
            problem: checked.problem,
            metrics: checked.metrics,
        }
    }
}

/// The contract. Each function takes a harness and asserts on one area of the trait.
pub mod suite {
    use super::fixtures::*;
    use super::*;

    pub async fn create_get_list(h: &impl Harness) {
        let s = h.open().await;
        let a = s.create_job(&spec("a", 8), None, "submitted", 1_000).await.unwrap();
        let b = s.create_job(&spec("b", 2), None, "submitted", 2_000).await.unwrap();
        let c = s.create_job(&spec("c", 1), None, "submitted", 3_000).await.unwrap();
        assert_eq!(a.state, JobState::Pending);
        assert_eq!((a.attempt, a.created_at_ms, a.updated_at_ms), (0, 1_000, 1_000));
        assert_eq!(a.spec, spec("a", 8));
        assert!(a.id < b.id && b.id < c.id);
        assert_eq!(s.get_job(b.id).await.unwrap(), Some(b.clone()));
        assert_eq!(s.get_job(c.id + 100).await.unwrap(), None);

        s.transition(b.id, JobState::Pending, JobState::Cancelled, 0, "ctl cancel", 4_000).await.unwrap();
        let ids = |v: Vec<crate::JobRecord>| v.into_iter().map(|j| j.id).collect::<Vec<_>>();
        assert_eq!(ids(s.list_jobs(false, None, 10).await.unwrap()), vec![c.id, b.id, a.id]);
        assert_eq!(ids(s.list_jobs(true, None, 10).await.unwrap()), vec![c.id, a.id]);
        assert_eq!(ids(s.list_jobs(false, None, 2).await.unwrap()), vec![c.id, b.id]);
        assert_eq!(ids(s.list_jobs(true, None, 1).await.unwrap()), vec![c.id]);
    }

    pub async fn submit_keys_are_unique(h: &impl Harness) {
        let s = h.open().await;
        let a = s.create_job(&spec("a", 1), Some("key-1"), "submitted", 1).await.unwrap();
        s.create_job(&spec("plain", 1), None, "submitted", 1).await.unwrap();
        s.create_job(&spec("plain", 1), None, "submitted", 1).await.unwrap();
        let again = s.create_job(&spec("a", 1), Some("key-1"), "submitted", 2).await;
        assert!(matches!(again, Err(StoreError::Duplicate(_))), "{again:?}");
        assert_eq!(s.list_jobs(false, None, 10).await.unwrap().len(), 3, "the duplicate stored nothing");
        assert_eq!(s.job_by_key("key-1").await.unwrap().map(|j| j.id), Some(a.id));
        assert_eq!(s.job_by_key("key-2").await.unwrap(), None);
    }

    pub async fn transitions_and_conflicts(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("t", 1), None, "submitted", 1).await.unwrap();
        let r = s.transition(j.id, JobState::Pending, JobState::Scheduled, 0, "placed", 2);
        let r = r.await.unwrap();
        assert_eq!((r.state, r.reason.as_str(), r.updated_at_ms), (JobState::Scheduled, "placed", 2));
        assert_eq!(s.get_job(j.id).await.unwrap(), Some(r));

        let err = s.transition(j.id, JobState::Pending, JobState::Cancelled, 0, "late", 3).await.unwrap_err();
        match err {
            StoreError::StateConflict { job, expected, actual } => {
                assert_eq!((job, expected, actual), (j.id, JobState::Pending, JobState::Scheduled));
            }
            other => panic!("expected StateConflict, got {other:?}"),
        }
        assert_eq!(s.get_job(j.id).await.unwrap().unwrap().state, JobState::Scheduled);
        assert_eq!(s.job_events(j.id).await.unwrap().len(), 2, "a refused move writes no event");

        for (from, to, attempt) in [
            (JobState::Scheduled, JobState::Launching, 0),
            (JobState::Launching, JobState::Running, 0),
            (JobState::Running, JobState::Restarting, 1),
        ] {
            s.transition(j.id, from, to, attempt, "step", 4).await.unwrap();
        }
        assert_eq!(s.get_job(j.id).await.unwrap().unwrap().attempt, 1);

        let missing = s.transition(j.id + 1, JobState::Pending, JobState::Failed, 0, "x", 5).await;
        assert!(matches!(missing, Err(StoreError::JobNotFound(id)) if id == j.id + 1));
    }

    pub async fn events_in_order_with_reasons(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("e", 1), None, "submitted by alice", 10).await.unwrap();
        s.transition(j.id, JobState::Pending, JobState::Scheduled, 0, "placed on a", 20).await.unwrap();
        s.transition(j.id, JobState::Scheduled, JobState::Failed, 0, "agent a lost", 30).await.unwrap();
        let events = s.job_events(j.id).await.unwrap();
        let got: Vec<_> =
            events.iter().map(|e| (e.job_id, e.at_ms, e.from_state, e.to_state, e.reason.as_str())).collect();
        assert_eq!(
            got,
            vec![
                (j.id, 10, None, JobState::Pending, "submitted by alice"),
                (j.id, 20, Some(JobState::Pending), JobState::Scheduled, "placed on a"),
                (j.id, 30, Some(JobState::Scheduled), JobState::Failed, "agent a lost"),
            ]
        );
        assert!(s.job_events(j.id + 1).await.unwrap().is_empty());
        // An event that is not a transition: from and to are the job's state as it is.
        s.note_job_event(j.id, "receipts dropped from now on", 40).await.unwrap();
        let last = s.job_events(j.id).await.unwrap().pop().unwrap();
        assert_eq!(
            (last.from_state, last.to_state, last.reason.as_str(), last.at_ms),
            (Some(JobState::Failed), JobState::Failed, "receipts dropped from now on", 40)
        );
        assert!(matches!(s.note_job_event(j.id + 1, "x", 50).await, Err(StoreError::JobNotFound(_))));
    }

    pub async fn schedule_writes_allocations(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("s", 2), None, "submitted", 1).await.unwrap();
        let allocs = vec![allocation(j.id, 0, 0, "a"), allocation(j.id, 0, 1, "a")];
        let r = s.schedule(j.id, 0, &allocs, "placed on a", 5).await.unwrap();
        assert_eq!(r.state, JobState::Scheduled);
        let mut stored = s.allocations(j.id, 0).await.unwrap();
        for a in &mut stored {
            assert_eq!(a.observed.updated_at_ms, 5, "the plan is stamped with the schedule time");
            a.observed.updated_at_ms = 0;
        }
        assert_eq!(stored, allocs);
        assert!(s.allocations(j.id, 1).await.unwrap().is_empty());
        let last = s.job_events(j.id).await.unwrap().pop().unwrap();
        assert_eq!((last.to_state, last.reason.as_str()), (JobState::Scheduled, "placed on a"));
    }

    pub async fn schedule_refuses_non_pending_job_atomically(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("s", 1), None, "submitted", 1).await.unwrap();
        s.transition(j.id, JobState::Pending, JobState::Cancelled, 0, "ctl cancel", 2).await.unwrap();
        let err = s.schedule(j.id, 0, &[allocation(j.id, 0, 0, "a")], "placed", 3).await;
        assert!(matches!(err, Err(StoreError::StateConflict { actual: JobState::Cancelled, .. })));
        assert!(s.allocations(j.id, 0).await.unwrap().is_empty(), "nothing half-recorded");

        // A failing allocation insert (duplicate rank) rolls the state change back too.
        let k = s.create_job(&spec("k", 2), None, "submitted", 4).await.unwrap();
        let dup = [allocation(k.id, 0, 0, "a"), allocation(k.id, 0, 0, "b")];
        assert!(s.schedule(k.id, 0, &dup, "placed", 5).await.is_err());
        assert_eq!(s.get_job(k.id).await.unwrap().unwrap().state, JobState::Pending);
        assert!(s.allocations(k.id, 0).await.unwrap().is_empty());
        assert_eq!(s.job_events(k.id).await.unwrap().len(), 1);
    }

    pub async fn observe_rank_known_and_unknown(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("o", 1), None, "submitted", 1).await.unwrap();
        s.schedule(j.id, 0, &[allocation(j.id, 0, 0, "a")], "placed", 2).await.unwrap();
        let running = RankObserved {
            state: RankState::Exited,
            pid: Some(4242),
            exit_code: Some(1),
            signal: None,
            message: "exit status 1".into(),
            skipped_lines: 3,
            updated_at_ms: 9,
            ..Default::default()
        };
        let id = RankId { job_id: j.id, attempt: 0, rank: 0 };
        assert!(s.observe_rank(id, &running).await.unwrap());
        assert_eq!(s.allocations(j.id, 0).await.unwrap()[0].observed, running);
        assert!(!s.observe_rank(RankId { rank: 1, ..id }, &running).await.unwrap());
        assert!(!s.observe_rank(RankId { attempt: 1, ..id }, &running).await.unwrap());
        assert!(!s.observe_rank(RankId { job_id: j.id + 1, ..id }, &running).await.unwrap());
    }

    /// Group commit of rank reports: 72 reports at once (a 64-rank job starting, and 8 about
    /// ranks the store does not have) take far fewer transactions than reports, each learns
    /// whether its rank's row exists, and every row holds its own report.
    pub async fn concurrent_rank_reports_commit_together(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("burst", 64), None, "submitted", 1).await.unwrap();
        let allocations: Vec<_> = (0..64).map(|rank| allocation(j.id, 0, rank, "a")).collect();
        s.schedule(j.id, 0, &allocations, "placed", 2).await.unwrap();
        let before = transactions("observe_rank");
        let mut tasks = Vec::new();
        for rank in 0..72u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let id = RankId { job_id: j.id, attempt: 0, rank };
                let observed = RankObserved {
                    state: RankState::Running,
                    pid: Some(1000 + rank),
                    updated_at_ms: 5,
                    ..Default::default()
                };
                s.observe_rank(id, &observed).await.unwrap()
            }));
        }
        for (rank, task) in tasks.into_iter().enumerate() {
            assert_eq!(task.await.unwrap(), rank < 64, "rank {rank}: whether its row exists");
        }
        // Other tests of this binary may observe ranks meanwhile: a bound well above theirs.
        let took = transactions("observe_rank") - before;
        assert!(took <= 36, "72 reports at once took {took} transactions");
        for a in s.allocations(j.id, 0).await.unwrap() {
            assert_eq!((a.observed.state, a.observed.pid), (RankState::Running, Some(1000 + a.id.rank)));
        }
    }

    pub async fn agents_upsert_with_gpus(h: &impl Harness) {
        let s = h.open().await;
        s.upsert_agent(&agent("sxm-a", 8, AgentState::Connected, 100)).await.unwrap();
        s.upsert_agent(&agent("sxm-b", 4, AgentState::Connected, 100)).await.unwrap();
        // A second hello with a smaller inventory replaces the first.
        let again = agent("sxm-a", 2, AgentState::Connected, 200);
        s.upsert_agent(&again).await.unwrap();
        s.set_agent_state("sxm-b", AgentState::Leaving, 300).await.unwrap();
        s.set_agent_state("never-seen", AgentState::Connected, 300).await.unwrap();
        // Heartbeats move last_seen forward, never back; unknown agents are ignored.
        s.touch_agents(&[("sxm-a".into(), 5_000), ("never-seen".into(), 9_000)]).await.unwrap();
        s.touch_agents(&[("sxm-a".into(), 4_000)]).await.unwrap();

        let snap = s.snapshot().await.unwrap();
        assert_eq!(snap.agents.len(), 2);
        assert_eq!(snap.agents[0], AgentRecord { last_seen_ms: 5_000, ..again });
        assert_eq!((snap.agents[1].state, snap.agents[1].last_seen_ms), (AgentState::Leaving, 300));
        assert_eq!(snap.agents[1].inventory.gpus.len(), 4);
    }

    pub async fn failures_move_the_job_with_their_cause(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("flaky", 2), None, "submitted", 1).await.unwrap();
        s.transition(j.id, JobState::Pending, JobState::Running, 0, "up", 2).await.unwrap();
        let lost = FailureRecord {
            job_id: j.id,
            attempt: 0,
            at_ms: 10,
            kind: FailureKind::HostLost,
            agent_id: Some("sxm-b".into()),
            rank: Some(1),
            evidence: "agent sxm-b sent nothing for 8.0 s".into(),
            blamed: true,
            charged: false,
        };
        let r = s
            .fail_attempt(j.id, JobState::Running, JobState::Restarting, 0, "host lost", &lost)
            .await
            .unwrap();
        assert_eq!((r.state, r.updated_at_ms), (JobState::Restarting, 10));
        // A move that conflicts stores no failure either.
        let exit = FailureRecord {
            kind: FailureKind::RankExit,
            agent_id: None,
            rank: None,
            at_ms: 20,
            blamed: false,
            charged: true,
            ..lost.clone()
        };
        let conflict = s.fail_attempt(j.id, JobState::Running, JobState::Failed, 0, "exit", &exit).await;
        assert!(matches!(conflict, Err(StoreError::StateConflict { .. })), "{conflict:?}");
        s.transition(j.id, JobState::Restarting, JobState::Pending, 1, "again", 21).await.unwrap();
        s.transition(j.id, JobState::Pending, JobState::Running, 1, "up", 22).await.unwrap();
        let exit = FailureRecord { attempt: 1, at_ms: 30, ..exit };
        s.fail_attempt(j.id, JobState::Running, JobState::Failed, 1, "exit", &exit).await.unwrap();
        assert_eq!(s.failures(j.id).await.unwrap(), vec![lost.clone(), exit.clone()]);
        assert_eq!(s.failures_since(11).await.unwrap(), vec![exit]);
        let events = s.job_events(j.id).await.unwrap();
        assert_eq!(events.iter().filter(|e| e.reason == "host lost").count(), 1);
    }

    pub async fn cordons_survive_hellos_and_reopen(h: &impl Harness) {
        let cordon = Cordon { by: "operator".into(), reason: "bad fan".into(), at_ms: 7 };
        {
            let s = h.open().await;
            s.upsert_agent(&agent("sxm-a", 8, AgentState::Connected, 1)).await.unwrap();
            assert!(s.set_cordon("sxm-a", Some(&cordon)).await.unwrap());
            assert!(!s.set_cordon("never-seen", Some(&cordon)).await.unwrap());
            // A hello rewrites the agent's row but not its cordon.
            s.upsert_agent(&agent("sxm-a", 8, AgentState::Connected, 2)).await.unwrap();
        }
        let s = h.open().await;
        let snap = s.snapshot().await.unwrap();
        assert_eq!(snap.agents[0].cordon.as_ref(), Some(&cordon));
        s.set_cordon("sxm-a", None).await.unwrap();
        assert_eq!(s.snapshot().await.unwrap().agents[0].cordon, None);
    }

    pub async fn snapshot_after_reopen(h: &impl Harness) {
        let (active, done);
        {
            let s = h.open().await;
            s.upsert_agent(&agent("sxm-a", 8, AgentState::Connected, 1)).await.unwrap();
            active = s.create_job(&spec("active", 2), None, "submitted", 1).await.unwrap();
            done = s.create_job(&spec("done", 1), None, "submitted", 2).await.unwrap();
            let two = [allocation(active.id, 0, 0, "sxm-a"), allocation(active.id, 0, 1, "sxm-a")];
            s.schedule(active.id, 0, &two, "placed", 3).await.unwrap();
            s.transition(active.id, JobState::Scheduled, JobState::Restarting, 1, "lost", 4).await.unwrap();
            s.transition(active.id, JobState::Restarting, JobState::Pending, 1, "retry", 5).await.unwrap();
            let one = [allocation(active.id, 1, 0, "sxm-a")];
            s.schedule(active.id, 1, &one, "placed", 6).await.unwrap();
            s.schedule(done.id, 0, &[allocation(done.id, 0, 0, "sxm-a")], "placed", 7).await.unwrap();
            s.transition(done.id, JobState::Scheduled, JobState::Succeeded, 0, "exit 0", 8).await.unwrap();
            s.insert_receipts(&receipts(RankId { job_id: active.id, attempt: 1, rank: 0 }, 0, 5), 9)
                .await
                .unwrap();
        }
        let s = h.open().await;
        let snap = s.snapshot().await.unwrap();
        assert_eq!(snap.active_jobs.len(), 1);
        let job = &snap.active_jobs[0];
        assert_eq!((job.id, job.state, job.attempt), (active.id, JobState::Scheduled, 1));
        assert_eq!(job.spec, active.spec);
        let ranks: Vec<_> = snap.allocations.iter().map(|a| a.id).collect();
        assert_eq!(ranks, vec![RankId { job_id: active.id, attempt: 1, rank: 0 }]);
        assert_eq!(snap.agents.len(), 1);
        assert_eq!(snap.agents[0].inventory.gpus.len(), 8);
        assert_eq!(s.receipt_count(active.id).await.unwrap(), 5);
        assert_eq!(s.get_job(done.id).await.unwrap().unwrap().state, JobState::Succeeded);
    }

    pub async fn binding_planned_then_effective(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("pin", 2), None, "submitted", 1).await.unwrap();
        let mut a = allocation(j.id, 0, 0, "a");
        a.planned_cpus = "0-15".into();
        a.planned_mems = "0".into();
        s.schedule(j.id, 0, &[a.clone()], "placed", 2).await.unwrap();
        let planned = s.allocations(j.id, 0).await.unwrap().remove(0);
        assert_eq!((planned.planned_cpus, planned.planned_mems), (a.planned_cpus, a.planned_mems));
        let running = RankObserved {
            state: RankState::Running,
            pid: Some(7),
            effective_cpus: "0-15".into(),
            effective_mems: "0".into(),
            updated_at_ms: 3,
            ..Default::default()
        };
        let id = RankId { job_id: j.id, attempt: 0, rank: 0 };
        assert!(s.observe_rank(id, &running).await.unwrap());
        let stored = s.allocations(j.id, 0).await.unwrap().remove(0);
        assert_eq!((stored.planned_cpus.as_str(), stored.observed), ("0-15", running));
    }

    pub async fn mean_optimizer_ms_of_step_receipts(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("opt", 1), None, "submitted", 1).await.unwrap();
        assert_eq!(s.mean_optimizer_ms(j.id).await.unwrap(), None);
        let id = RankId { job_id: j.id, attempt: 0, rank: 0 };
        let bodies = [
            ("launch", r#"{"kind":"launch","optimizer_ms":1000}"#),
            ("step", r#"{"kind":"step","step":0,"step_time_ms":100,"optimizer_ms":10.0}"#),
            ("step", r#"{"kind":"step","step":1,"step_time_ms":100,"optimizer_ms":20}"#),
            ("step", r#"{"kind":"step","step":2,"step_time_ms":100}"#),
            ("step", r#"{"kind":"step","step":3,"step_time_ms":100,"optimizer_ms":"fast"}"#),
            ("step", r#"{"kind":"step","step":4,"step_time_ms":100,"optimizer_ms":-3}"#),
        ];
        let batch: Vec<NewReceipt> = bodies
            .iter()
            .enumerate()
            .map(|(seq, (kind, body))| receipt(id, seq as u64, kind, Some(seq as i64), body))
            .collect();
        s.insert_receipts(&batch, 5).await.unwrap();
        // Only valid step values count: not the launch's, not a string, not a negative time.
        assert_eq!(s.mean_optimizer_ms(j.id).await.unwrap(), Some(15.0));
        // The two bad ones are stored, flagged.
        let stored = s.receipts_after(j.id, 0, 10).await.unwrap();
        assert_eq!(stored.len(), 6);
        let (flagged, newest) = s.receipt_problems(j.id).await.unwrap();
        assert_eq!((flagged, newest.as_deref()), (2, Some("optimizer_ms -3 is out of range")));
        // What the diagnosis reads: the step receipts only, typed, the bad fields as None.
        let samples = s.step_samples(j.id, 0).await.unwrap();
        let seen: Vec<(i64, Option<f64>, bool)> =
            samples.iter().map(|x| (x.step, x.optimizer_ms, x.flagged)).collect();
        assert_eq!(
            seen,
            vec![
                (1, Some(10.0), false),
                (2, Some(20.0), false),
                (3, None, false),
                (4, None, true),
                (5, None, true)
            ]
        );
        assert!(samples.iter().all(|x| x.step_time_ms == Some(100.0) && x.rank == 0));
        assert!(s.step_samples(j.id, 1).await.unwrap().is_empty(), "another attempt has none");
    }

    pub async fn attempt_facts_and_outcomes(h: &impl Harness) {
        use trainyard_analysis::diagnose::goodput::{AttemptGoodput, Goodput};
        let s = h.open().await;
        let j = s.create_job(&spec("g", 2), None, "submitted", 1).await.unwrap();
        let id = |rank| RankId { job_id: j.id, attempt: 0, rank };
        let mut batch = receipts(id(0), 0, 3);
        batch.extend(receipts(id(1), 0, 5));
        batch.push(receipt(
            id(0),
            3,
            "checkpoint",
            Some(2),
            r#"{"kind":"checkpoint","step":2,"duration_ms":250.5}"#,
        ));
        batch.push(receipt(
            id(0),
            4,
            "eval",
            Some(2),
            r#"{"kind":"eval","step":2,"val_loss":3.1,"duration_ms":40}"#,
        ));
        batch.push(receipt(id(0), 5, "eval", Some(3), r#"{"kind":"eval","step":3,"duration_ms":"slow"}"#));
        s.insert_receipts(&batch, 77).await.unwrap();
        // Rank 0 only: 3 steps of 100-102 ms, the checkpoint and the one eval with a number.
        let f = s.attempt_facts(j.id, 0).await.unwrap();
        assert_eq!((f.steps, f.first_step, f.last_step, f.first_step_at_ms), (3, Some(0), Some(2), Some(77)));
        assert_eq!((f.train_ms, f.first_step_ms, f.checkpoint_ms, f.eval_ms), (303.0, 100.0, 250.5, 40.0));
        // Events carry their attempt.
        let events = s.job_events(j.id).await.unwrap();
        assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), vec![0]);
        let attempt = AttemptGoodput { attempt: 0, wall_ms: 1_000.0, steps_redone: 3, ..Default::default() };
        let goodput = Goodput {
            attempts: vec![attempt.clone(), AttemptGoodput { attempt: 1, ..attempt }],
            ..Default::default()
        };
        let finding = trainyard_analysis::diagnose::Finding {
            cause: trainyard_model::domain::Cause::ShmDisabled,
            summary: "off".into(),
            subject: "job".into(),
            steps: None,
            nodes: vec!["a".into()],
            ranks: vec![0, 1],
            evidence: vec![trainyard_analysis::diagnose::Measure {
                name: "x".into(),
                value: 2.5,
                unit: "ms",
            }],
            expected_cost: "",
            remedy: "fix".into(),
        };
        s.record_outcome(j.id, &goodput, 1, std::slice::from_ref(&finding), 9).await.unwrap();
        // Recording again replaces the first record (its primary keys would collide otherwise).
        s.record_outcome(j.id, &goodput, 1, &[finding], 10).await.unwrap();
        assert_eq!(
            s.step_samples(j.id, 0).await.unwrap().len(),
            8,
            "eval and checkpoint receipts are not steps"
        );
    }

    pub async fn receipts_dedup(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("r", 2), None, "submitted", 1).await.unwrap();
        let mut batch = receipts(RankId { job_id: j.id, attempt: 0, rank: 0 }, 0, 1500);
        batch.extend(receipts(RankId { job_id: j.id, attempt: 0, rank: 1 }, 0, 1500));
        assert_eq!(s.insert_receipts(&batch, 10).await.unwrap(), 3000);
        assert_eq!(s.insert_receipts(&batch, 11).await.unwrap(), 0);
        assert_eq!(s.receipt_count(j.id).await.unwrap(), 3000);
        // A replay overlapping new lines stores only the new ones.
        let overlap = receipts(RankId { job_id: j.id, attempt: 0, rank: 0 }, 1400, 200);
        assert_eq!(s.insert_receipts(&overlap, 12).await.unwrap(), 100);
        assert_eq!(s.receipt_count(j.id).await.unwrap(), 3100);
        assert_eq!(s.insert_receipts(&[], 13).await.unwrap(), 0);
        // The same seq in another attempt is another receipt.
        let next = receipts(RankId { job_id: j.id, attempt: 1, rank: 0 }, 0, 7);
        assert_eq!(s.insert_receipts(&next, 14).await.unwrap(), 7);
    }

    /// Group commit: 40 streams storing at once, each batch half replayed, each learns
    /// exactly how many of its own rows were new, and every row is stored once.
    pub async fn concurrent_batches_commit_together_and_each_learns_its_count(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("group", 40), None, "submitted", 1).await.unwrap();
        let mut tasks = Vec::new();
        for rank in 0..40u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let id = RankId { job_id: j.id, attempt: 0, rank };
                let mut counts = Vec::new();
                for round in 0..5u64 {
                    // Rows round*100 .. round*100+200: the first half repeats the last round.
                    let first = round.saturating_sub(1) * 100;
                    let n = if round == 0 { 100 } else { 200 };
                    counts.push(s.insert_receipts(&receipts(id, first, n), 10 + round as i64).await.unwrap());
                }
                counts
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), vec![100, 100, 100, 100, 100]);
        }
        assert_eq!(s.receipt_count(j.id).await.unwrap(), 40 * 500);
    }

    /// An agent's stream queues its next batch while the one before is written: batches are
    /// written in the order they were queued, whichever wait is polled first, and each learns
    /// its own count.
    pub async fn queued_batches_are_written_in_the_order_they_were_queued(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("queued", 1), None, "submitted", 1).await.unwrap();
        let id = RankId { job_id: j.id, attempt: 0, rank: 0 };
        let first = s.queue_receipts(receipts(id, 0, 300), 10);
        let second = s.queue_receipts(receipts(id, 300, 300), 11);
        let replay = s.queue_receipts(receipts(id, 200, 200), 12);
        // The last queued is waited for first: it writes the whole group, in queue order.
        assert_eq!(replay.await.unwrap(), 0);
        assert_eq!((second.await.unwrap(), first.await.unwrap()), (300, 300));
        let stored = s.receipts_after(j.id, 0, 1_000).await.unwrap();
        let seqs: Vec<u64> = stored.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, (0..600).collect::<Vec<u64>>(), "positions follow the queue's order");
    }

    pub async fn step_rollups_fold_each_receipt_once(h: &impl Harness) {
        use trainyard_analysis::series::Metric;
        let s = h.open().await;
        let j = s.create_job(&spec("plot", 2), None, "submitted", 1).await.unwrap();
        let r0 = RankId { job_id: j.id, attempt: 0, rank: 0 };
        let r1 = RankId { job_id: j.id, attempt: 0, rank: 1 };
        let mut batch = receipts(r0, 0, 300);
        batch.extend(receipts(r1, 0, 300));
        batch.push(receipt(r0, 300, "eval", Some(300), r#"{"kind":"eval","step":300,"duration_ms":5}"#));
        s.insert_receipts(&batch, 10).await.unwrap();
        assert_eq!(s.rollup_extent(j.id, 0).await.unwrap(), None, "nothing folded yet");
        // Receipts stored after the cut-off wait for a later fold.
        assert_eq!(s.roll_up_steps(j.id, 9, 1_000).await.unwrap(), 0);
        // In pieces, as the background pass and requests do.
        assert_eq!(s.roll_up_steps(j.id, 10, 250).await.unwrap(), 250);
        assert_eq!(s.roll_up_steps(j.id, 10, 1_000).await.unwrap(), 351);
        assert_eq!(s.roll_up_steps(j.id, 10, 1_000).await.unwrap(), 0);
        // A replay stores nothing, so it folds nothing.
        s.insert_receipts(&receipts(r0, 0, 300), 11).await.unwrap();
        assert_eq!(s.roll_up_steps(j.id, 11, 1_000).await.unwrap(), 0);
        assert_eq!(s.rollup_extent(j.id, 0).await.unwrap(), Some((0, 383, 2)));
        let fine = s.rollup_rows(j.id, 0, Metric::StepMs, 16, 0, 1).await.unwrap();
        assert_eq!(fine.len(), 4, "buckets 0 and 1 of both ranks");
        let b0 = fine.iter().find(|r| r.rank == 1 && r.bucket == 0).unwrap();
        let step_ms = b0.aggs[Metric::StepMs as usize];
        // step_time_ms = 100 + seq % 10 over seq 0..16
        assert_eq!((step_ms.n, step_ms.min, step_ms.max, step_ms.sum), (16, 100.0, 109.0, 1_660.0));
        let loss = s.rollup_rows(j.id, 0, Metric::Loss, 16, 0, 0).await.unwrap();
        assert_eq!(loss.iter().find(|r| r.rank == 1).unwrap().aggs[Metric::Loss as usize].n, 16);
        let mfu = s.rollup_rows(j.id, 0, Metric::Mfu, 16, 0, 0).await.unwrap();
        assert_eq!(mfu[0].aggs[Metric::Mfu as usize].n, 0, "no mfu in these receipts");
        let coarse = s.rollup_rows(j.id, 0, Metric::StepMs, 1024, 0, 0).await.unwrap();
        assert_eq!(
            coarse.iter().map(|r| r.aggs[0].n).sum::<i64>(),
            600,
            "every step once, the eval not at all"
        );
        // More steps later fold into the same buckets exactly.
        s.insert_receipts(&receipts(r0, 301, 20), 12).await.unwrap();
        assert_eq!(s.roll_up_steps(j.id, 12, 1_000).await.unwrap(), 20);
        let coarse = s.rollup_rows(j.id, 0, Metric::StepMs, 1024, 0, 0).await.unwrap();
        assert_eq!(coarse.iter().map(|r| r.aggs[0].n).sum::<i64>(), 620);
        let r0_128 = s.rollup_rows(j.id, 0, Metric::StepMs, 128, 2, 2).await.unwrap();
        assert_eq!(
            r0_128.iter().find(|r| r.rank == 0).unwrap().aggs[0].n,
            44 + 20,
            "steps 256..299 and 301..320"
        );
    }

    /// Folds that run at once (the web view's four series, the job's end, a second controller)
    /// count every receipt once: a fold that finds the watermark moved reads again from there.
    pub async fn concurrent_folds_count_each_receipt_once(h: &impl Harness) {
        use trainyard_analysis::series::Metric;
        let s = h.open().await;
        let j = s.create_job(&spec("plot", 4), None, "submitted", 1).await.unwrap();
        let mut batch = Vec::new();
        for rank in 0..4 {
            batch.extend(receipts(RankId { job_id: j.id, attempt: 0, rank }, 0, 500));
        }
        s.insert_receipts(&batch, 10).await.unwrap();
        let fold_all = async |s: &_| {
            let mut folded = 0;
            loop {
                let n = SeriesStore::roll_up_steps(s, j.id, 10, 37).await.unwrap();
                folded += n;
                if n == 0 {
                    return folded;
                }
            }
        };
        let (a, b, c, d) = tokio::join!(fold_all(&s), fold_all(&s), fold_all(&s), fold_all(&s));
        assert_eq!(a + b + c + d, 2_000, "each receipt folded by exactly one of them");
        let coarse = s.rollup_rows(j.id, 0, Metric::StepMs, 1024, 0, 0).await.unwrap();
        assert_eq!(coarse.iter().map(|r| r.aggs[0].n).sum::<i64>(), 2_000, "every step once");
    }

    pub async fn receipts_of_long_ended_jobs_are_pruned(h: &impl Harness) {
        let s = h.open().await;
        let ended = s.create_job(&spec("ended", 1), None, "submitted", 10).await.unwrap();
        let running = s.create_job(&spec("running", 1), None, "submitted", 10).await.unwrap();
        for j in [&ended, &running] {
            s.insert_receipts(&receipts(RankId { job_id: j.id, attempt: 0, rank: 0 }, 0, 5), 20)
                .await
                .unwrap();
        }
        s.transition(ended.id, JobState::Pending, JobState::Cancelled, 0, "cancelled", 100).await.unwrap();
        assert_eq!(s.prune_receipts(100).await.unwrap(), 0, "ended at 100: not before the cut");
        assert_eq!(s.prune_receipts(101).await.unwrap(), 5);
        assert_eq!(s.receipt_count(ended.id).await.unwrap(), 0);
        assert_eq!(s.receipt_count(running.id).await.unwrap(), 5, "an unfinished job keeps its receipts");
    }

    pub async fn secrets_are_created_once_and_kept(h: &impl Harness) {
        let s = h.open().await;
        assert_eq!(s.secret("env_hash_key", "first", 1).await.unwrap(), "first");
        // A second leader (or a restart) offers its own fresh value and gets the stored one.
        assert_eq!(s.secret("env_hash_key", "second", 2).await.unwrap(), "first");
        assert_eq!(s.secret("cluster_id", "c1", 3).await.unwrap(), "c1");
    }

    pub async fn users_tokens_owners_and_audit(h: &impl Harness) {
        use crate::{AuditEntry, JobOwner, UserRecord};
        let s = h.open().await;
        let alice = UserRecord {
            name: "alice".into(),
            admin: false,
            unix_user: Some("alice".into()),
            created_at_ms: 1,
            disabled_at_ms: None,
        };
        s.add_user(&alice).await.unwrap();
        assert!(matches!(s.add_user(&alice).await, Err(StoreError::Duplicate(_))));
        assert!(s.update_user(&UserRecord { admin: true, ..alice.clone() }).await.unwrap());
        assert!(s.get_user("alice").await.unwrap().unwrap().admin);
        assert!(!s.update_user(&UserRecord { name: "nobody".into(), ..alice.clone() }).await.unwrap());
        let id = s.add_token("alice", "ab12", "tyt_ab", 5, None).await.unwrap();
        s.add_token("alice", "cd34", "tyt_cd", 6, Some(100)).await.unwrap();
        assert!(matches!(
            s.add_token("alice", "ab12", "tyt_ab", 7, None).await,
            Err(StoreError::Duplicate(_))
        ));
        let (t, u) = s.token_owner("ab12").await.unwrap().unwrap();
        assert_eq!(
            (t.id, t.prefix.as_str(), u.name.as_str(), t.revoked_at_ms),
            (id, "tyt_ab", "alice", None)
        );
        assert_eq!(s.revoke_tokens("alice", Some("tyt_cd"), 9).await.unwrap(), 1);
        assert_eq!(s.revoke_tokens("alice", None, 10).await.unwrap(), 1, "the other one");
        assert_eq!(s.token_owner("ab12").await.unwrap().unwrap().0.revoked_at_ms, Some(10));
        assert_eq!(s.tokens_of("alice").await.unwrap().len(), 2);
        assert!(s.token_owner("zz").await.unwrap().is_none());
        assert!(s.token_hashes().await.unwrap().contains(&"ab12".to_string()));
        // Jobs record their owner, and lists filter on it.
        let owner = JobOwner { user: "alice".into(), run_as: "alice".into() };
        let mine = s.create_job_for(&spec("mine", 1), None, &owner, "submitted", 1).await.unwrap();
        s.create_job(&spec("legacy", 1), None, "submitted", 2).await.unwrap();
        assert_eq!(s.get_job(mine.id).await.unwrap().unwrap().owner, owner);
        let listed = s.list_jobs(false, Some("alice"), 10).await.unwrap();
        assert_eq!(listed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![mine.id]);
        assert_eq!(s.list_jobs(false, None, 10).await.unwrap().len(), 2);
        for (at, accepted) in [(1, true), (2, false)] {
            let entry = AuditEntry {
                at_ms: at,
                actor: "alice".into(),
                action: "job.cancel".into(),
                target: "job:1".into(),
                accepted,
                detail: "d".into(),
            };
            s.audit(&entry).await.unwrap();
        }
        let log = s.audit_log(10).await.unwrap();
        assert_eq!(
            log.iter().map(|e| (e.at_ms, e.accepted)).collect::<Vec<_>>(),
            vec![(2, false), (1, true)]
        );
    }

    pub async fn receipts_after_pages_by_cursor(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("w", 1), None, "submitted", 1).await.unwrap();
        let other = s.create_job(&spec("other", 1), None, "submitted", 1).await.unwrap();
        let rank = RankId { job_id: j.id, attempt: 0, rank: 0 };
        let written = receipts(rank, 0, 25);
        for (i, chunk) in written.chunks(5).enumerate() {
            s.insert_receipts(chunk, 100).await.unwrap();
            let noise = receipts(RankId { job_id: other.id, attempt: 0, rank: 0 }, i as u64, 1);
            s.insert_receipts(&noise, 100).await.unwrap();
        }
        let (mut cursor, mut seen) = (0, Vec::new());
        loop {
            let page = s.receipts_after(j.id, cursor, 10).await.unwrap();
            if page.is_empty() {
                break;
            }
            assert!(page.len() <= 10);
            for r in page {
                assert!(r.position > cursor, "positions increase");
                cursor = r.position;
                seen.push(r);
            }
        }
        assert_eq!(seen.len(), 25);
        for (r, w) in seen.iter().zip(&written) {
            assert_eq!((r.id, r.seq, &r.kind, r.step, &r.body), (w.id, w.seq, &w.kind, w.step, &w.body));
        }
        assert!(s.receipts_after(j.id, cursor, 10).await.unwrap().is_empty());
    }

    pub async fn last_seqs_and_counts(h: &impl Harness) {
        let s = h.open().await;
        let j = s.create_job(&spec("l", 3), None, "submitted", 1).await.unwrap();
        let at = |attempt, rank| RankId { job_id: j.id, attempt, rank };
        let mut batch = receipts(at(0, 0), 0, 10);
        batch.extend(receipts(at(0, 2), 5, 3));
        batch.extend(receipts(at(1, 0), 0, 4));
        s.insert_receipts(&batch, 1).await.unwrap();
        assert_eq!(s.last_seqs(j.id, 0).await.unwrap(), vec![(0, 9), (2, 7)]);
        assert_eq!(s.last_seqs(j.id, 1).await.unwrap(), vec![(0, 3)]);
        assert!(s.last_seqs(j.id, 2).await.unwrap().is_empty());
        assert_eq!(s.receipt_count(j.id).await.unwrap(), 17);
        assert_eq!(s.receipt_count(j.id + 1).await.unwrap(), 0);
        // What the job's receipts hold, for its quota: all step receipts here.
        let bytes: u64 = batch.iter().map(|r| r.body.len() as u64).sum();
        assert_eq!(s.receipt_bytes(j.id).await.unwrap(), (bytes, 0));
        assert_eq!(s.receipt_bytes(j.id + 1).await.unwrap(), (0, 0));
        // Retention takes only the receipts of jobs that ended before its cut.
        assert_eq!(s.prune_receipts(i64::MAX).await.unwrap(), 0, "the job has not ended");
        // Where each rank stands, for stall detection: last step and when it was stored.
        s.insert_receipts(&receipts(at(0, 2), 8, 1), 5).await.unwrap();
        let progress = s.step_progress(j.id, 0).await.unwrap();
        assert_eq!(progress.ranks, vec![(0, 9, 1), (2, 8, 5)]);
        assert_eq!(progress.recent_step_ms.len(), 14);
        assert_eq!(progress.recent_step_ms[0], 108.0, "newest first");
        assert_eq!(s.step_progress(j.id, 2).await.unwrap(), Default::default());
    }

    pub async fn preflight_round_trip_with_checks_in_order(h: &impl Harness) {
        let s = h.open().await;
        assert_eq!(s.latest_preflight("sxm-a").await.unwrap(), None);
        let report = preflight("sxm-a", 1_000, 40, "fail");
        let id = s.insert_preflight(&report, 5_000).await.unwrap();
        assert!(id > 0);
        let stored = s.latest_preflight("sxm-a").await.unwrap().expect("stored");
        assert_eq!(stored, PreflightRecord { report_id: id, ..report.clone() });
        // A newer report replaces it as the latest; the older one stays as history.
        let newer = preflight("sxm-a", 2_000, 3, "pass");
        let newer_id = s.insert_preflight(&newer, 6_000).await.unwrap();
        assert!(newer_id > id, "ids grow: {newer_id} after {id}");
        let latest = s.latest_preflight("sxm-a").await.unwrap().expect("stored");
        assert_eq!((latest.report_id, latest.verdict.as_str(), latest.checks.len()), (newer_id, "pass", 3));
        assert_eq!(s.latest_preflight("sxm-b").await.unwrap(), None);
        // A report without checks is a report.
        let bare =
            PreflightRecord { checks: vec![], local_id: String::new(), ..preflight("sxm-b", 1, 0, "warn") };
        let bare_id = s.insert_preflight(&bare, 7_000).await.unwrap();
        let stored = s.latest_preflight("sxm-b").await.unwrap().expect("stored");
        assert_eq!(stored, PreflightRecord { report_id: bare_id, ..bare });
        // A job's launch preflight, newer and failing, is stored with its job and GPUs but is
        // never the node's latest.
        let job =
            PreflightRecord { job_id: Some(7), gpus: vec![2, 3], ..preflight("sxm-a", 3_000, 2, "fail") };
        let job_report = s.insert_preflight(&job, 8_000).await.unwrap();
        assert!(job_report > newer_id);
        assert_eq!(s.latest_preflight("sxm-a").await.unwrap().expect("stored").report_id, newer_id);
        let all = s.latest_preflights().await.unwrap();
        assert!(all.iter().all(|r| r.job_id.is_none() && r.report_id != job_report), "{all:?}");
    }

    pub async fn preflight_same_report_twice_is_stored_once(h: &impl Harness) {
        let s = h.open().await;
        let report = preflight("sxm-a", 1_000, 5, "warn");
        let first = s.insert_preflight(&report, 5_000).await.unwrap();
        // The agent's hello after a reconnect carries the same report again.
        assert_eq!(s.insert_preflight(&report, 9_000).await.unwrap(), first);
        assert_eq!(s.latest_preflight("sxm-a").await.unwrap().expect("stored").checks.len(), 5);
        // The same local id on another agent is another report; reports without one are
        // never merged.
        let other = PreflightRecord { agent_id: "sxm-b".into(), ..report.clone() };
        assert_ne!(s.insert_preflight(&other, 9_000).await.unwrap(), first);
        let anonymous = PreflightRecord { local_id: String::new(), ..report };
        let a1 = s.insert_preflight(&anonymous, 9_000).await.unwrap();
        let a2 = s.insert_preflight(&anonymous, 9_000).await.unwrap();
        assert_ne!(a1, a2);
        // Words the schema does not know never reach the store: the record refuses them.
        let bogus = PreflightReport { verdict: "great".into(), ..preflight_pb("sxm-c", 1, 2, "pass") };
        let refused = PreflightRecord::try_from(bogus).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "unknown preflight verdict \"great\" (expected one of pass, warn, fail)"
        );
        assert!(PreflightRecord::try_from(preflight_pb("sxm-c", 2, 2, "maybe")).is_err());
        assert_eq!(s.latest_preflight("sxm-c").await.unwrap(), None);
    }

    pub async fn preflight_latest_per_agent_after_reopen(h: &impl Harness) {
        let ids;
        {
            let s = h.open().await;
            assert!(s.latest_preflights().await.unwrap().is_empty());
            let old_b = s.insert_preflight(&preflight("sxm-b", 1, 2, "pass"), 1).await.unwrap();
            let a = s.insert_preflight(&preflight("sxm-a", 2, 4, "fail"), 2).await.unwrap();
            let b = s.insert_preflight(&preflight("sxm-b", 3, 3, "warn"), 3).await.unwrap();
            assert!(old_b < b);
            ids = (a, b);
        }
        let s = h.open().await;
        let latest = s.latest_preflights().await.unwrap();
        let summary: Vec<_> = latest
            .iter()
            .map(|r| (r.agent_id.as_str(), r.report_id, r.verdict.as_str(), r.checks.len()))
            .collect();
        assert_eq!(summary, vec![("sxm-a", ids.0, "fail", 4), ("sxm-b", ids.1, "warn", 3)]);
        assert_eq!(latest[0].checks[3].id, "cuda.init.gpu3");
        assert_eq!(latest[0].checks[3].remedy, "replace GPU 3 (RMA)");
    }

    pub async fn gpu_windows_are_stored_once_read_back_and_pruned(h: &impl Harness) {
        use crate::TelemetryStore;
        let s = h.open().await;
        let j = s.create_job(&spec("hot", 2), None, "submitted", 1).await.unwrap();
        let w = crate::GpuWindowRecord {
            agent_id: "sxm-a".into(),
            gpu: 3,
            uuid: "GPU-3".into(),
            start_ms: 1_000,
            end_ms: 11_000,
            samples: 10,
            sm_clock_min: Some(1_100.0),
            sm_clock_mean: Some(1_300.5),
            sm_clock_max: Some(1_980.0),
            sm_clock_limit: 1_980.0,
            power_mean: None,
            clock_reasons: 0x40,
            pcie_gen: 4,
            pcie_gen_max: 5,
            nvlinks_up: 16,
            nvlinks_total: 18,
            nvlink_crc_errors: 12,
            remap_pending: true,
            xids: vec![79, 48],
            nvlink_detail: "link 3 down; link 7: 12 crc".into(),
            job_id: Some(j.id),
            attempt: Some(0),
            rank: Some(1),
            first_step: Some(40),
            last_step: Some(52),
            ..Default::default()
        };
        let idle = crate::GpuWindowRecord {
            nvlink_detail: String::new(),
            gpu: 4,
            job_id: None,
            attempt: None,
            rank: None,
            first_step: None,
            last_step: None,
            xids: vec![],
            ..w.clone()
        };
        assert_eq!(s.insert_gpu_windows(&[w.clone(), idle.clone()]).await.unwrap(), 2);
        assert_eq!(
            s.insert_gpu_windows(std::slice::from_ref(&w)).await.unwrap(),
            0,
            "a resent window is stored once"
        );
        let later = crate::GpuWindowRecord { start_ms: 11_000, end_ms: 21_000, ..w.clone() };
        s.insert_gpu_windows(std::slice::from_ref(&later)).await.unwrap();
        let of_job = s.job_gpu_windows_after(j.id, 0, 100).await.unwrap();
        assert_eq!(of_job.iter().map(|(_, w)| w.clone()).collect::<Vec<_>>(), vec![w.clone(), later.clone()]);
        let after_first = s.job_gpu_windows_after(j.id, of_job[0].0, 100).await.unwrap();
        assert_eq!(after_first.len(), 1, "incremental reads start after the row given");
        assert_eq!(s.attempt_gpu_windows(j.id, 0, 100).await.unwrap(), vec![w.clone(), later.clone()]);
        assert_eq!(s.node_gpu_windows("sxm-a", 0, 100).await.unwrap(), vec![w, idle, later.clone()]);
        // The live diagnosis reads the newest step receipts after a position, oldest first.
        let rank0 = RankId { job_id: j.id, attempt: 0, rank: 0 };
        s.insert_receipts(&fixtures::receipts(rank0, 0, 5), 1).await.unwrap();
        s.insert_receipts(&fixtures::receipts(RankId { attempt: 1, ..rank0 }, 0, 2), 1).await.unwrap();
        let newest = s.latest_step_samples_after(j.id, 0, 0, 3).await.unwrap();
        assert_eq!(
            newest.iter().map(|(_, x)| x.step).collect::<Vec<_>>(),
            vec![2, 3, 4],
            "the newest of this attempt, oldest first"
        );
        let all = s.latest_step_samples_after(j.id, 0, 0, 100).await.unwrap();
        assert_eq!(all.iter().map(|(_, x)| x.step).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(all[0].1.step_time_ms, Some(100.0));
        let rest = s.latest_step_samples_after(j.id, 0, all[2].0, 100).await.unwrap();
        assert_eq!(
            rest.iter().map(|(_, x)| x.step).collect::<Vec<_>>(),
            vec![3, 4],
            "after the position, this attempt only"
        );
        assert_eq!(s.prune_gpu_windows(20_000).await.unwrap(), 2, "windows that ended before the cut");
        assert_eq!(s.node_gpu_windows("sxm-a", 0, 100).await.unwrap(), vec![later]);
    }

    pub async fn one_controller_leads_and_a_lost_lease_fences_its_writes(h: &impl Harness) {
        use crate::{Election, Fence, LeaseStore};
        let (a, b) = (h.open().await, h.open().await);
        assert_eq!(
            a.lease().await.unwrap().map(|l| l.epoch),
            Some(0),
            "the row exists, expired, before any leader"
        );
        let Election::Leading(lease) = a.acquire_lease("ctl-a", "10.0.0.1:7070", "ca-1", 400).await.unwrap()
        else {
            panic!("the first controller leads");
        };
        assert_eq!((lease.holder.as_str(), lease.epoch), ("ctl-a", 1));
        let Election::Following(seen) = b.acquire_lease("ctl-b", "10.0.0.2:7070", "ca-1", 400).await.unwrap()
        else {
            panic!("the second follows while the lease holds");
        };
        assert_eq!(
            (seen.holder.as_str(), seen.epoch, seen.address.as_str(), seen.tls_ca.as_str()),
            ("ctl-a", 1, "10.0.0.1:7070", "ca-1")
        );
        let fence_a = Fence { holder: "ctl-a".into(), epoch: 1 };
        a.set_fence(Some(fence_a.clone()));
        a.create_job(&spec("led", 1), None, "submitted", 1).await.expect("the leader writes");
        assert!(a.renew_lease(&fence_a, 400).await.unwrap(), "renewed while it holds");
        // The leader freezes past its lease; the follower takes over under a new epoch.
        tokio::time::sleep(std::time::Duration::from_millis(600)).await;
        let Election::Leading(taken) = b.acquire_lease("ctl-b", "10.0.0.2:7070", "ca-1", 400).await.unwrap()
        else {
            panic!("an expired lease is taken over");
        };
        assert_eq!(taken.epoch, 2);
        // The old leader wakes: it can write nothing, and cannot renew.
        let refused = a.create_job(&spec("late", 1), None, "submitted", 2).await;
        assert!(matches!(refused, Err(StoreError::Fenced(_))), "{refused:?}");
        // ... and is told at once, to step down without waiting for its next renewal.
        tokio::time::timeout(std::time::Duration::from_secs(1), a.fenced().notified())
            .await
            .expect("a refused write notifies the fenced leader");
        assert!(!a.renew_lease(&fence_a, 400).await.unwrap());
        // A follower's read-only fence refuses every write, whatever the lease.
        let follower = h.open().await;
        follower.set_fence(Some(Fence::read_only("ctl-c")));
        let refused = follower.create_job(&spec("follower", 1), None, "submitted", 2).await;
        assert!(matches!(&refused, Err(StoreError::Fenced(m)) if m.contains("ctl-c follows")), "{refused:?}");
        let fence_b = Fence { holder: "ctl-b".into(), epoch: 2 };
        b.set_fence(Some(fence_b.clone()));
        b.create_job(&spec("new leader", 1), None, "submitted", 3).await.expect("the new leader writes");
        let names: Vec<String> =
            b.list_jobs(false, None, 10).await.unwrap().into_iter().map(|j| j.spec.name).collect();
        assert!(!names.contains(&"late".to_string()), "the fenced write left nothing: {names:?}");
        // Resigning hands over at once.
        b.resign_lease(&fence_b).await.unwrap();
        let Election::Leading(back) = a.acquire_lease("ctl-a", "10.0.0.1:7070", "ca-1", 400).await.unwrap()
        else {
            panic!("a resigned lease is free");
        };
        assert_eq!(back.epoch, 3);
    }

    pub async fn live_findings_open_update_close_and_keep_their_alerts(h: &impl Harness) {
        use crate::TelemetryStore;
        let s = h.open().await;
        let j = s.create_job(&spec("slow", 2), None, "submitted", 1).await.unwrap();
        let f = crate::LiveFinding {
            job_id: j.id,
            attempt: 0,
            cause: "gpu.thermal_throttle".into(),
            subject: "sxm-a/gpu3".into(),
            nodes: vec!["sxm-a".into()],
            ranks: vec![3],
            summary: "GPU 3 throttled".into(),
            evidence: "sm_clock=1100 MHz".into(),
            remedy: "check cooling".into(),
            first_step: Some(40),
            last_step: Some(40),
            opened_at_ms: 100,
            updated_at_ms: 100,
            ..Default::default()
        };
        let opened = s.upsert_live_finding(&f).await.unwrap();
        assert!(opened.id > 0 && opened.closed_at_ms.is_none());
        let updated = s
            .upsert_live_finding(&crate::LiveFinding {
                updated_at_ms: 200,
                ranks: vec![3, 4],
                opened_at_ms: 999,
                ..f.clone()
            })
            .await
            .unwrap();
        assert_eq!((updated.id, updated.opened_at_ms, updated.updated_at_ms), (opened.id, 100, 200));
        assert_eq!(updated.ranks, vec![3, 4]);
        assert_eq!(s.unalerted_findings(10).await.unwrap().len(), 1);
        s.mark_alerted(opened.id, true, 150).await.unwrap();
        assert!(s.unalerted_findings(10).await.unwrap().is_empty(), "opening alert delivered");
        s.close_live_finding(opened.id, 300).await.unwrap();
        assert!(s.open_live_findings().await.unwrap().is_empty());
        assert_eq!(s.unalerted_findings(10).await.unwrap()[0].closed_at_ms, Some(300), "closing alert due");
        s.mark_alerted(opened.id, false, 310).await.unwrap();
        assert!(s.unalerted_findings(10).await.unwrap().is_empty());
        // The same cause and subject later opens a new finding.
        let again = s
            .upsert_live_finding(&crate::LiveFinding { opened_at_ms: 400, updated_at_ms: 400, ..f })
            .await
            .unwrap();
        assert_ne!(again.id, opened.id);
        let all = s.live_findings(j.id, 0).await.unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].alerted_close_ms, Some(310));
        assert_eq!(s.live_findings(j.id, opened.id).await.unwrap(), vec![again]);
        // An XID failure is a failure kind the table takes.
        s.transition(j.id, JobState::Pending, JobState::Running, 0, "up", 2).await.unwrap();
        let xid = FailureRecord {
            job_id: j.id,
            attempt: 0,
            at_ms: 500,
            kind: FailureKind::GpuXid,
            agent_id: Some("sxm-a".into()),
            rank: Some(3),
            evidence: "XID 79 on GPU 3".into(),
            blamed: true,
            charged: false,
        };
        s.fail_attempt(j.id, JobState::Running, JobState::Restarting, 0, "gpu_xid", &xid).await.unwrap();
        assert_eq!(s.failures(j.id).await.unwrap(), vec![xid.clone()]);
        // A rank exit that an XID explains afterwards becomes the GPU's failure.
        s.transition(j.id, JobState::Restarting, JobState::Running, 1, "again", 600).await.unwrap();
        let exit = FailureRecord {
            attempt: 1,
            at_ms: 700,
            kind: FailureKind::RankExit,
            evidence: "rank 3 exited with code 1".into(),
            blamed: false,
            charged: true,
            ..xid.clone()
        };
        s.fail_attempt(j.id, JobState::Running, JobState::Restarting, 1, "rank_exit", &exit).await.unwrap();
        assert_eq!(
            s.blame_failure_on_xid(j.id, 1, "sxm-b", 0, "XID 79").await.unwrap(),
            None,
            "another node"
        );
        assert_eq!(s.blame_failure_on_xid(j.id, 1, "sxm-a", 701, "XID 79").await.unwrap(), None, "too old");
        let moved = s.blame_failure_on_xid(j.id, 1, "sxm-a", 650, "XID 79 on GPU 3").await.unwrap().unwrap();
        assert_eq!((moved.kind, moved.blamed, moved.charged), (FailureKind::GpuXid, true, false));
        assert_eq!(moved.evidence, "rank 3 exited with code 1; XID 79 on GPU 3");
        assert_eq!(s.failures(j.id).await.unwrap(), vec![xid, moved]);
    }
}

/// The operator views are SQL of the SQLite migration, so they are checked here, not in the suite.
#[tokio::test]
async fn sqlite_views_return_sensible_rows() {
    use fixtures::*;
    let h = SqliteHarness::new().await;
    let s = h.open().await;
    let j = s.create_job(&spec("views", 2), None, "submitted", 1).await.unwrap();
    let two = [allocation(j.id, 0, 0, "a"), allocation(j.id, 0, 1, "a")];
    s.schedule(j.id, 0, &two, "placed", 2).await.unwrap();
    let mut batch = receipts(RankId { job_id: j.id, attempt: 0, rank: 0 }, 0, 20);
    let rank0 = RankId { job_id: j.id, attempt: 0, rank: 0 };
    batch.push(receipt(rank0, 20, "checkpoint", Some(19), r#"{"kind":"checkpoint","step":19,"bytes":1024}"#));
    s.insert_receipts(&batch, 777).await.unwrap();

    type ProgressRow = (i64, i64, Option<i64>, i64, Option<i64>);
    let rows: Vec<ProgressRow> = sqlx::query_as(
        "SELECT job_id, rank, last_step, receipt_count, last_receipt_at_ms FROM job_progress \
         ORDER BY rank",
    )
    .fetch_all(s.sqlite_pool().unwrap())
    .await
    .unwrap();
    let id = j.id as i64;
    assert_eq!(rows, vec![(id, 0, Some(19), 21, Some(777)), (id, 1, None, 0, None)]);

    let (n, mean, min, max, tps): (i64, f64, f64, f64, f64) = sqlx::query_as(
        "SELECT step_receipts, mean_step_time_ms, min_step_time_ms, max_step_time_ms, \
         mean_tokens_per_s FROM step_time_summary WHERE job_id = ?",
    )
    .bind(id)
    .fetch_one(s.sqlite_pool().unwrap())
    .await
    .unwrap();
    assert_eq!((n, min, max), (20, 100.0, 109.0));
    assert!((mean - 104.5).abs() < 1e-9, "mean step time {mean}");
    assert!((tps - 50_009.5).abs() < 1e-9, "mean tokens/s {tps}");
}

#[tokio::test]
async fn sqlite_open_url_and_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("by-url.db").display());
    let s = SqlStore::open_sqlite(&url).await.unwrap();
    s.create_job(&fixtures::spec("u", 1), None, "submitted", 1).await.unwrap();
    let mode: String =
        sqlx::query_scalar("PRAGMA journal_mode").fetch_one(s.sqlite_pool().unwrap()).await.unwrap();
    assert_eq!(mode, "wal");
    let sync: i64 =
        sqlx::query_scalar("PRAGMA synchronous").fetch_one(s.sqlite_pool().unwrap()).await.unwrap();
    assert_eq!(sync, 2, "synchronous=FULL");

    for m in [SqlStore::sqlite_in_memory().await.unwrap(), SqlStore::open("sqlite::memory:").await.unwrap()] {
        let j = m.create_job(&fixtures::spec("m", 1), None, "submitted", 1).await.unwrap();
        assert_eq!(m.list_jobs(false, None, 10).await.unwrap()[0].id, j.id);
        assert_eq!(m.get_job(j.id).await.unwrap().map(|r| r.id), Some(j.id));
    }
}

/// The PostgreSQL views answer like the SQLite ones (numbers from JSON are `float8` here).
#[tokio::test]
async fn postgres_views_return_sensible_rows() {
    use fixtures::*;
    let h = PgHarness::new().await;
    let s = h.open().await;
    let j = s.create_job(&spec("views", 2), None, "submitted", 1).await.unwrap();
    let two = [allocation(j.id, 0, 0, "a"), allocation(j.id, 0, 1, "a")];
    s.schedule(j.id, 0, &two, "placed", 2).await.unwrap();
    let rank0 = RankId { job_id: j.id, attempt: 0, rank: 0 };
    let mut batch = receipts(rank0, 0, 20);
    // Not a number, and a string holding an escaped NUL: neither may break the view.
    let slow = r#"{"kind":"step","step":20,"step_time_ms":"slow","note":"a\u0000b"}"#;
    batch.push(receipt(rank0, 20, "step", Some(20), slow));
    s.insert_receipts(&batch, 777).await.unwrap();

    type ProgressRow = (i64, i64, Option<i64>, i64, Option<i64>);
    let rows: Vec<ProgressRow> = sqlx::query_as(
        "SELECT job_id, rank, last_step, receipt_count, last_receipt_at_ms FROM job_progress ORDER BY rank",
    )
    .fetch_all(s.postgres_pool().unwrap())
    .await
    .unwrap();
    let id = j.id as i64;
    assert_eq!(rows, vec![(id, 0, Some(20), 21, Some(777)), (id, 1, None, 0, None)]);

    let (n, mean, min, max, tps): (i64, f64, f64, f64, f64) = sqlx::query_as(
        "SELECT step_receipts, mean_step_time_ms, min_step_time_ms, max_step_time_ms, \
         mean_tokens_per_s FROM step_time_summary WHERE job_id = $1",
    )
    .bind(id)
    .fetch_one(s.postgres_pool().unwrap())
    .await
    .unwrap();
    assert_eq!((n, min, max), (21, 100.0, 109.0), "the non-number counts as a step without a time");
    let (flagged,): (i64,) = sqlx::query_as("SELECT flagged FROM receipt_problems WHERE job_id = $1")
        .bind(id)
        .fetch_one(s.postgres_pool().unwrap())
        .await
        .unwrap();
    assert_eq!(flagged, 1);
    assert!((mean - 104.5).abs() < 1e-9, "mean step time {mean}");
    assert!((tps - 50_009.5).abs() < 1e-9, "mean tokens/s {tps}");
}

/// Concurrent receipt batches become visible in position order, so a `Watch` cursor that read
/// up to some position never misses a row committed later with a smaller one.
#[tokio::test]
async fn postgres_receipt_positions_commit_in_order() {
    use fixtures::*;
    let h = PgHarness::new().await;
    let s = std::sync::Arc::new(h.open().await);
    let j = s.create_job(&spec("order", 4), None, "submitted", 1).await.unwrap();
    let mut writers = Vec::new();
    for rank in 0..4 {
        let s = s.clone();
        writers.push(tokio::spawn(async move {
            for chunk in 0..20 {
                let id = RankId { job_id: j.id, attempt: 0, rank };
                s.insert_receipts(&receipts(id, chunk * 50, 50), 1).await.unwrap();
            }
        }));
    }
    // A reader pages like `Watch`; every row it ever sees must be new and in order.
    let mut cursor = 0;
    let mut seen = 0;
    while seen < 4_000 {
        for r in s.receipts_after(j.id, cursor, 500).await.unwrap() {
            assert!(r.position > cursor);
            cursor = r.position;
            seen += 1;
        }
        if writers.iter().all(|w| w.is_finished()) && s.receipt_count(j.id).await.unwrap() == seen {
            break;
        }
    }
    assert_eq!(seen, 4_000, "the cursor stepped over rows");
}

/// A group of batches goes to PostgreSQL in one statement, and each batch still learns how many
/// of its rows were new and keeps its own `stored_at_ms`; a group where one rank's rows are in
/// two batches goes a statement per batch, with the same answer.
#[tokio::test]
async fn postgres_a_receipt_group_counts_each_batch() {
    use fixtures::*;
    let h = PgHarness::new().await;
    let s = h.open().await;
    let j = s.create_job(&spec("group", 2), None, "submitted", 1).await.unwrap();
    let (r0, r1) =
        (RankId { job_id: j.id, attempt: 0, rank: 0 }, RankId { job_id: j.id, attempt: 0, rank: 1 });
    s.insert_receipts(&receipts(r0, 0, 3), 1).await.unwrap();
    let mut c = s.postgres_pool().unwrap().acquire().await.unwrap();
    let (a, b) = (receipts(r0, 0, 10), receipts(r1, 0, 5));
    let counts = crate::postgres::insert_receipt_group(&mut c, &[(&a, 20), (&b, 30)]).await.unwrap();
    assert_eq!(counts, vec![7, 5], "rank 0 had 3 of its 10 rows already");
    // Rank 0 in two batches of one group: a statement each.
    let (x, y, z) = (receipts(r0, 8, 6), receipts(r1, 5, 2), receipts(r0, 12, 4));
    let counts =
        crate::postgres::insert_receipt_group(&mut c, &[(&x, 40), (&y, 40), (&z, 50)]).await.unwrap();
    assert_eq!(counts, vec![4, 2, 2], "rows 10-13, 5-6, then 14-15 were new");
    let at: Vec<(i64, i64, i64)> =
        sqlx::query_as("SELECT rank, seq, stored_at_ms FROM receipts WHERE job_id = $1 AND seq IN (2, 3, 15) ORDER BY rank, seq")
            .bind(j.id as i64)
            .fetch_all(&mut *c)
            .await
            .unwrap();
    assert_eq!(at, vec![(0, 2, 1), (0, 3, 20), (0, 15, 50), (1, 2, 30), (1, 3, 30)]);
    assert_eq!(s.receipt_count(j.id).await.unwrap(), 16 + 7);
}

/// A leader frozen inside a write transaction, past its fence check (SIGSTOP between two
/// statements; the CI caught it): its share lock on the lease row must not stop a follower
/// from taking the lease over once it runs out. The server ends the idle transaction, the
/// follower leads, and the frozen write, woken, commits nothing and is refused by its fence.
#[tokio::test]
async fn postgres_a_leader_frozen_mid_write_does_not_block_the_takeover() {
    use crate::{Election, Fence, LeaseStore};
    use std::time::{Duration, Instant};
    let h = PgHarness::new().await;
    let (a, b) = (std::sync::Arc::new(h.open().await), h.open().await);
    let Election::Leading(lease) = a.acquire_lease("ctl-a", "a:1", "", 400).await.unwrap() else {
        panic!("the first controller leads");
    };
    a.set_fence(Some(Fence { holder: "ctl-a".into(), epoch: lease.epoch }));
    let frozen = {
        let a = a.clone();
        tokio::spawn(async move {
            a.write("frozen", async |c: &mut crate::sql::Conn<'_>| {
                // Past the fence check (which share-locked the lease row); frozen for 8 s.
                tokio::time::sleep(Duration::from_secs(8)).await;
                c.query(
                    "INSERT INTO controller_lease (name, holder, epoch, address, tls_ca, expires_at_ms) \
                         VALUES ('frozen', 'ctl-a', 0, '', '', 0)",
                )
                .execute()
                .await?;
                Ok(())
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    let asked = Instant::now();
    let election = tokio::time::timeout(Duration::from_secs(5), b.acquire_lease("ctl-b", "b:1", "", 400))
        .await
        .expect("the takeover waited on the frozen leader's transaction")
        .unwrap();
    assert!(matches!(&election, Election::Leading(l) if l.epoch == lease.epoch + 1), "{election:?}");
    eprintln!("took over {:?} after the lease ran out", asked.elapsed());
    let woken = frozen.await.unwrap();
    assert!(matches!(woken, Err(StoreError::Fenced(_))), "the frozen write, woken: {woken:?}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM controller_lease WHERE name = 'frozen'")
        .fetch_one(b.postgres_pool().unwrap())
        .await
        .unwrap();
    assert_eq!(rows, 0, "the frozen write committed nothing");
}

/// PostgreSQL restarted under an open store: the next operations wait for it and succeed.
#[tokio::test]
async fn postgres_store_survives_a_server_restart() {
    use fixtures::*;
    let mut server =
        tokio::task::spawn_blocking(|| TempPostgres::start(Durability::Relaxed).unwrap()).await.unwrap();
    let url = server.url("postgres");
    let s = SqlStore::open_postgres(&url).await.unwrap();
    let j = s.create_job(&spec("restart", 1), None, "submitted", 1).await.unwrap();
    let id = RankId { job_id: j.id, attempt: 0, rank: 0 };
    s.insert_receipts(&receipts(id, 0, 10), 1).await.unwrap();
    let server = tokio::task::spawn_blocking(move || {
        server.restart().unwrap();
        server
    })
    .await
    .unwrap();
    // The pool's connections died with the old server; the store reconnects by itself.
    assert_eq!(s.insert_receipts(&receipts(id, 5, 10), 2).await.unwrap(), 5);
    assert_eq!(s.receipt_count(j.id).await.unwrap(), 15);
    drop(server);
}
