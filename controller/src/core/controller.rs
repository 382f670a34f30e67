//! [`Controller`]: the core's one owner. It holds the store, the configuration, the clock, the
//! wake-ups of the reconciler, the in-memory state behind one lock, and the side systems' own
//! small locks; the five services (`Controller::jobs`, ...) are the way in, and
//! [`Controller::run_background`] is the reconciler's loop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use trainyard_store::{Fence, Lease, Store};

use super::shared::Shared;
use super::state::Core;
use super::{
    Auth, Clock, Diagnoses, Jobs, Nodes, Receipts, Result, Role, diagnosis, faults, heard, keys, live, logs,
    steps,
};
use crate::config::ControllerConfig;

/// The controller: the core's parts (`Shared`, which the services and the reconciler borrow)
/// and the auth service.
pub struct Controller {
    pub(super) s: Shared,
    /// Users, tokens and the audit log (over the same store).
    auth: Auth,
}

/// How often telemetry past its retention is deleted.
pub(super) const PRUNE_EVERY: Duration = Duration::from_secs(600);

impl Controller {
    /// Rebuilds the in-memory state from the store. Agents count as disconnected until they
    /// say hello again; those that do not come back within `agent_timeout` lose their ranks.
    /// The controller leads: alone (SQLite), or under `lease` in a group ([`Controller::follow`]
    /// builds one that does not).
    pub async fn start(store: Arc<dyn Store>, config: ControllerConfig) -> Result<Arc<Controller>> {
        Controller::start_as(store, config, Role::Leader(None)).await
    }

    /// As [`Controller::start`], for the leader of a group under `lease`.
    pub async fn start_leading(
        store: Arc<dyn Store>,
        config: ControllerConfig,
        lease: trainyard_store::Lease,
    ) -> Result<Arc<Controller>> {
        Controller::start_as(store, config, Role::Leader(Some(lease))).await
    }

    pub(super) async fn start_as(
        store: Arc<dyn Store>,
        config: ControllerConfig,
        role: Role,
    ) -> Result<Arc<Controller>> {
        let clock = Clock::new();
        let now = Instant::now();
        let stored = async {
            Ok::<_, trainyard_store::StoreError>((store.snapshot().await?, store.latest_preflights().await?))
        };
        let mut core = match (stored.await.map(|(s, p)| Core::from_stored(s, p, now)), &role) {
            (Ok(core), _) => core,
            // A follower may start while the database is away: its mirror fills in later.
            (Err(e), Role::Follower { .. }) => {
                tracing::warn!(error = %e, "follower: the store cannot be read yet; serving an empty mirror until it can");
                Core::default()
            }
            (Err(e), Role::Leader(_)) => return Err(e.into()),
        };
        let watches = match role {
            Role::Leader(_) => faults::reload(&mut core, store.as_ref(), &config, clock.now_ms()).await?,
            Role::Follower { .. } => HashMap::new(),
        };
        let keys = match role {
            Role::Leader(_) => keys::Keys::load(store.as_ref(), clock.now_ms()).await?,
            Role::Follower { .. } => keys::Keys::default(),
        };
        core.cluster_id = keys.cluster_id().to_string();
        tracing::info!(jobs = core.jobs.len(), agents = core.agents.len(), "state reloaded from the store");
        let (changes, _) = watch::channel(0);
        let auth = Auth::new(store.clone());
        let s = Shared {
            store,
            config,
            role,
            core: Mutex::new(core),
            wake: Notify::new(),
            clock,
            changes,
            heard: heard::Heard::new(now),
            logs: logs::LogRelay::default(),
            steps: steps::StepWatches::new(watches),
            started: now,
            outcomes: tokio::sync::Semaphore::new(diagnosis::OUTCOMES_AT_ONCE),
            keys,
            quotas: Default::default(),
        };
        Ok(Arc::new(Controller { s, auth }))
    }

    /// A follower over `store`: the mirror loaded once, its store fenced read-only. `leader`
    /// follows the elections ([`crate::core::leader::lead`] sends what each one finds).
    pub async fn follow(
        store: Arc<dyn Store>,
        config: ControllerConfig,
        id: String,
        leader: watch::Receiver<Option<Lease>>,
    ) -> Result<Arc<Controller>> {
        store.set_fence(Some(Fence::read_only(&id)));
        Controller::start_as(store, config, Role::Follower { id, leader }).await
    }

    /// A follower's loop: its mirror of the jobs and agents reloaded from the store
    /// (`follow::mirror`) until `shutdown`.
    pub async fn mirror(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let store = self.s.store.clone();
        let replace = |fresh: Core| {
            let mut core = self.s.lock();
            core.agents = fresh.agents;
            core.jobs = fresh.jobs;
            drop(core);
            self.s.bump();
        };
        super::follow::mirror(store, replace, shutdown).await
    }

    /// Leader or follower, and the lease it knows of.
    pub fn role(&self) -> &Role {
        &self.s.role
    }

    /// The auth service: users, tokens and the audit log.
    pub fn auth(&self) -> &Auth {
        &self.auth
    }

    /// The jobs service: submit, cancel, read, rank reports and logs.
    pub fn jobs(&self) -> Jobs<'_> {
        Jobs { c: &self.s }
    }

    /// The diagnosis service: diagnoses, comparisons, goodput and live findings.
    pub fn diagnoses(&self) -> Diagnoses<'_> {
        Diagnoses { c: &self.s }
    }

    /// The nodes service: the fleet table, preflights, cordons and drains, and what each
    /// agent's stream says about its node.
    pub fn nodes(&self) -> Nodes<'_> {
        Nodes { c: &self.s }
    }

    /// The receipts service: step receipts and telemetry in, and their reads.
    pub fn receipts(&self) -> Receipts<'_> {
        Receipts { c: &self.s }
    }

    pub fn config(&self) -> &ControllerConfig {
        &self.s.config
    }

    /// Sets the gauges of [`crate::metrics`] from the controller's state (called on scrape).
    pub fn refresh_gauges(&self) {
        super::view::set_gauges(&self.s.lock());
    }

    /// A receiver that changes whenever receipts are stored or a job changes state.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.s.changes.subscribe()
    }

    /// Milliseconds since the Unix epoch, from the controller's [`Clock`].
    pub fn now_ms(&self) -> i64 {
        self.s.clock.now_ms()
    }

    /// Starts the live diagnosis and its alerts (`live`) with the configured webhooks, until
    /// `shutdown`; the error names a bad webhook URL or CA bundle.
    pub fn spawn_live(
        self: &Arc<Self>,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> std::result::Result<tokio::task::JoinHandle<()>, String> {
        let config = &self.s.config;
        let webhooks = crate::alerts::Webhooks::new(&config.alert_webhooks, config.alert_ca_file.as_deref())?;
        let (store, clock, every) = (self.s.store.clone(), self.s.clock, config.live_every);
        let me = self.clone();
        let running = move || live::running_contexts(&me.s.lock());
        Ok(tokio::spawn(live::cpu_counted(live::run(store, clock, every, running, webhooks, shutdown))))
    }

    /// The reconciler: runs a pass whenever a request wakes it, and every 500 ms (the reaper
    /// of vanished agents, liveness, and any pass a store error cut short) until `shutdown`
    /// resolves; the scheduling part of a pass at most every 100 ms. The only task that
    /// reconciles in a running controller.
    pub async fn run_background(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let mut prune = tokio::time::interval(PRUNE_EVERY);
        // The scheduling pass is paced (`reconcile::SCHEDULE_EVERY`): one owed comes at `next_pass`.
        let (mut next_pass, mut owed) = (Instant::now(), false);
        loop {
            let periodic = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = prune.tick() => {
                    let config = &self.s.config;
                    let now = self.now_ms();
                    super::telemetry::prune(self.s.store.as_ref(), config.telemetry_retention, config.receipt_retention, now)
                        .await;
                    continue;
                }
                _ = self.s.wake.notified() => false,
                _ = tokio::time::sleep_until(next_pass), if owed => false,
                _ = tick.tick() => true,
            };
            if periodic {
                super::reconcile::Reconciler(&self.s).mark_all();
                if let Err(e) =
                    super::liveness::check_liveness(&super::reconcile::Reconciler(&self.s), &self.s.heard)
                        .await
                {
                    tracing::error!(error = %e, "failed to check agent liveness");
                }
                super::liveness::reap_vanished_agents(
                    &super::reconcile::Reconciler(&self.s),
                    &self.s.heard,
                    &self.s.steps,
                    &self.s.logs,
                    self.s.started,
                )
                .await;
                super::faults::check_hangs(&mut self.s.lock(), &self.s.steps, self.now_ms());
                super::evict::check_evictions(&mut self.s.lock(), &self.s.steps, self.now_ms());
                super::faults::store_cordons(self.s.store.as_ref(), &self.s.core).await;
            }
            owed = !super::reconcile::Reconciler(&self.s).reconcile_paced(&mut next_pass).await;
            let ended = std::mem::take(&mut self.s.lock().ended);
            for job_id in ended {
                let controller = self.clone();
                tokio::spawn(async move { controller.diagnoses().record_outcome(job_id).await });
            }
        }
    }
}
