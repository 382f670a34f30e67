//! What the core's parts share (the way mini-redis's `Db` shares its `Shared`): the store,
//! the settings, the role in a group, the in-memory state behind its one lock, the clock, the
//! change counter the `Watch` streams wait on, the reconciler's wake-up, and the side systems
//! that keep their own small locks. The services borrow it (`Jobs { c: &Shared }`, ...), and
//! so does the reconciler (`Reconciler(&shared)`); none of them holds the `Controller`.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use trainyard_store::Store;

use super::state::Core;
use super::{Clock, Role, heard, keys, logs, quota, steps};
use crate::config::ControllerConfig;

pub(super) struct Shared {
    pub(super) store: Arc<dyn Store>,
    pub(super) config: ControllerConfig,
    /// Leader (the one writer) or follower (reads only; `follow`).
    pub(super) role: Role,
    /// Never held across an `.await` (see the module documentation).
    pub(super) core: Mutex<Core>,
    /// Wakes the reconciler: a job or an agent changed and it may have work.
    pub(super) wake: Notify,
    pub(super) clock: Clock,
    /// Bumped whenever receipts are stored or a job changes; `Watch` streams wait on it.
    pub(super) changes: watch::Sender<u64>,
    /// When each agent last spoke, and the streams of hosts declared lost (`heard`).
    pub(super) heard: heard::Heard,
    /// Open `Logs` requests (see `logs`).
    pub(super) logs: logs::LogRelay,
    /// When each running job's ranks last wrote a step receipt (the hang watch). Its own
    /// `std::sync::Mutex`: ingest updates it once per batch and never takes the core's lock.
    pub(super) steps: steps::StepWatches,
    /// When this controller started: host-loss and hang clocks wait `reconnect_grace` after it.
    pub(super) started: Instant,
    /// Turns to record an ended job's outcome (`diagnosis::OUTCOMES_AT_ONCE` at a time).
    pub(super) outcomes: tokio::sync::Semaphore,
    /// The group's cluster id and the key of launch receipts' `[env]` hashes (a leader's; a
    /// follower neither launches nor stores receipts, and holds none).
    pub(super) keys: keys::Keys,
    /// What each job sending receipts has stored of its quota (`quota`).
    pub(super) quotas: quota::Quotas,
}

impl Shared {
    /// The in-memory state. Callers drop the guard before any `.await`.
    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Milliseconds since the Unix epoch, from the controller's [`Clock`].
    pub(super) fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Receipts were stored or a job changed: `Watch` streams look again.
    pub(super) fn bump(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// Something changed that the reconciler may act on.
    pub(super) fn wake(&self) {
        self.wake.notify_one();
    }

    /// A receiver that changes whenever receipts are stored or a job changes state.
    pub(super) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}
