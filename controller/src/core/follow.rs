//! A follower: a controller of a group on PostgreSQL that does not lead (docs/ha.md).
//!
//! It serves everything that reads (`ctl status`, `watch`, `nodes`, `diagnose`, the web view,
//! `/metrics`) from the store and from a mirror of the jobs and agents that it reloads every
//! [`MIRROR_EVERY`]; it refers every write (submits, cancels, cordons, drains, preflight runs,
//! logs, which need the agent's stream, and the agents' streams themselves) to the leader the
//! elections name, as [`ControllerError::NotLeader`]. It runs no reconciler and none of the
//! liveness, hang or live-diagnosis clocks, and its store carries a fence no lease matches
//! ([`trainyard_store::Fence::read_only`]), so nothing it does can write. When it wins the lease, the daemon
//! stops it and starts a leader over the same listeners.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use trainyard_proto::v1::LeaderReply;
use trainyard_store::{Lease, Store};

use super::error::NotLeader;
use super::state::Core;
use super::{ControllerError, Result};

/// How often a follower reloads its mirror of the jobs and agents from the store.
pub const MIRROR_EVERY: Duration = Duration::from_secs(2);

/// Who a controller is in its group.
pub enum Role {
    /// The one writer: alone (SQLite, no lease), or the leader of a group under this lease.
    Leader(Option<Lease>),
    /// Another controller leads; `leader` is the lease as the latest election saw it.
    Follower { id: String, leader: watch::Receiver<Option<Lease>> },
}

impl Role {
    /// This controller leads (or serves alone): it takes writes and runs the reconciler.
    pub fn leads(&self) -> bool {
        matches!(self, Role::Leader(_))
    }

    /// `Ok` on the leader; on a follower, the refusal every write starts with.
    pub fn writable(&self) -> Result<()> {
        match self {
            Role::Leader(_) => Ok(()),
            Role::Follower { leader, .. } => {
                Err(ControllerError::NotLeader(NotLeader { leader: leader.borrow().clone() }))
            }
        }
    }

    /// Who leads, as this controller sees it (`Jobs.Leader`, `/healthz`).
    pub fn leadership(&self) -> LeaderReply {
        let reply = |leads, controller_id: &str, lease: Option<&Lease>| LeaderReply {
            leads,
            controller_id: controller_id.to_string(),
            leader_id: lease.map(|l| l.holder.clone()).unwrap_or_default(),
            leader_address: lease.map(|l| l.address.clone()).unwrap_or_default(),
            epoch: lease.map_or(0, |l| l.epoch),
        };
        match self {
            Role::Leader(lease) => {
                reply(true, lease.as_ref().map_or("", |l| l.holder.as_str()), lease.as_ref())
            }
            Role::Follower { id, leader } => reply(false, id, leader.borrow().as_ref()),
        }
    }
}

/// A follower's loop: reloads the mirror from `store` every [`MIRROR_EVERY`] and hands each
/// fresh copy to `replace`, until `shutdown`. A store error keeps the previous mirror and is
/// logged once per outage.
pub(super) async fn mirror(store: Arc<dyn Store>, replace: impl Fn(Core), shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(MIRROR_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let stored = async {
            Ok::<_, trainyard_store::StoreError>((store.snapshot().await?, store.latest_preflights().await?))
        };
        match stored.await.map(|(s, p)| Core::from_stored(s, p, tokio::time::Instant::now())) {
            Ok(fresh) => {
                failing = false;
                replace(fresh);
            }
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "follower: cannot reload jobs and agents from the store; serving the last copy");
            }
            Err(_) => {}
        }
    }
}
