//! What the agents' streams say about liveness, outside the core's lock: when each agent last
//! sent anything, when that was last written to the store, and the streams of hosts declared
//! lost while their stream stayed open. Every message of every agent touches it, so it has its
//! own small locks; no `.await` happens while one is held, and the liveness check reads it
//! twice a second.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

/// How often heartbeats move `agents.last_seen_ms` forward in the store.
pub(super) const SEEN_PERSIST_EVERY: Duration = Duration::from_secs(10);

pub(super) struct Heard {
    /// When each agent last sent anything (a heartbeat or any other message), in ms.
    last: Mutex<HashMap<String, i64>>,
    /// When `last_seen_ms` was last written to the store (at most every [`SEEN_PERSIST_EVERY`]).
    persisted: Mutex<Instant>,
    /// Streams of hosts declared lost while their stream stayed open (a cut network): the next
    /// message on one ends it, so the agent must say hello again and have the ranks of old
    /// attempts stopped.
    fenced: Mutex<HashSet<u64>>,
}

impl Heard {
    pub(super) fn new(now: Instant) -> Heard {
        Heard { last: Mutex::default(), persisted: Mutex::new(now), fenced: Mutex::default() }
    }

    /// `agent_id` sent something at `at_ms`.
    pub(super) fn note(&self, agent_id: &str, at_ms: i64) {
        lock(&self.last).insert(agent_id.to_string(), at_ms);
    }

    /// When each agent last sent anything, in ms.
    pub(super) fn last(&self) -> HashMap<String, i64> {
        lock(&self.last).clone()
    }

    /// Whether the agents' `last_seen_ms` are due to be written to the store (then the next
    /// write is [`SEEN_PERSIST_EVERY`] from now).
    pub(super) fn persist_due(&self) -> bool {
        let mut last = lock(&self.persisted);
        let due = last.elapsed() >= SEEN_PERSIST_EVERY;
        if due {
            *last = Instant::now();
        }
        due
    }

    /// Stream `conn_id` belongs to a host declared lost: its next message ends it.
    pub(super) fn fence(&self, conn_id: u64) {
        lock(&self.fenced).insert(conn_id);
    }

    /// Stream `conn_id` ended: nothing is left to fence.
    pub(super) fn unfence(&self, conn_id: u64) {
        lock(&self.fenced).remove(&conn_id);
    }

    pub(super) fn is_fenced(&self, conn_id: u64) -> bool {
        lock(&self.fenced).contains(&conn_id)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
