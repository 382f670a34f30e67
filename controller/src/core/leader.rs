//! Leadership of a controller group on one PostgreSQL (docs/ha.md): a controller that is not the
//! leader follows (it serves reads and refers writers and agents to the leader, `core::follow`)
//! until the leader's lease runs out or is resigned; then it takes the lease under a new epoch,
//! fences every write of its store on it, and starts. While it leads it renews the lease every
//! fifth of its TTL; when a renewal finds the lease lost (it was paused past it), none lands
//! within the TTL (cut off from the database), or a write is refused by the fence, it stops
//! serving and follows again. Its writes were refused from the moment the lease ran out (the
//! store's fence), so two leaders never write.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use trainyard_store::{Election, Fence, Lease, Store};

/// What a controller of a group needs to lead.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// This controller's id in the lease (unique in the group).
    pub id: String,
    /// Where it serves gRPC, as followers and tools should dial it.
    pub address: String,
    /// How long a lease lasts without renewal, by the database's clock.
    pub ttl: Duration,
    /// The SHA-256 (hex) of the TLS CA this controller serves under (its agents' CA), or empty
    /// for plaintext: every member of a group must have the same.
    pub tls_ca: String,
}

impl GroupConfig {
    fn ttl_ms(&self) -> i64 {
        self.ttl.as_millis() as i64
    }

    fn renew_every(&self) -> Duration {
        (self.ttl / 5).max(Duration::from_millis(100))
    }
}

/// Takes part in elections until this controller leads; returns its lease (its fence already
/// set on the store), or `None` when `shutdown` came first. Each election that finds another
/// leader is sent on `seen`, for the follower to name it; one that cannot reach the database
/// touches `seen` without a new value (this controller does not lead: it follows meanwhile).
pub async fn lead(
    store: &Arc<dyn Store>,
    group: &GroupConfig,
    shutdown: impl Future,
    seen: &watch::Sender<Option<Lease>>,
) -> anyhow::Result<Option<Lease>> {
    tokio::pin!(shutdown);
    let mut told = None;
    loop {
        match store.acquire_lease(&group.id, &group.address, &group.tls_ca, group.ttl_ms()).await {
            Ok(Election::Leading(lease)) => {
                tracing::info!(id = %group.id, epoch = lease.epoch, "leading the controller group");
                crate::metrics::metrics().leading(true, lease.epoch);
                store.set_fence(Some(fence_of(&lease)));
                return Ok(Some(lease));
            }
            Ok(Election::Following(lease)) => {
                if lease.tls_ca != group.tls_ca {
                    anyhow::bail!("{}", ca_mismatch(group, &lease));
                }
                crate::metrics::metrics().leading(false, lease.epoch);
                seen.send_replace(Some(lease.clone()));
                if told.as_ref() != Some(&(lease.holder.clone(), lease.epoch)) {
                    tracing::info!(
                        leader = %lease.holder, address = %lease.address, epoch = lease.epoch,
                        "following: another controller leads; serving reads, referring writes to it, and taking over when its lease runs out"
                    );
                    told = Some((lease.holder, lease.epoch));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach the database to elect a leader; trying again");
                // Not leading: serve as a follower meanwhile (it knows no more of the leader).
                seen.send_modify(|_| {});
            }
        }
        tokio::select! {
            _ = &mut shutdown => return Ok(None),
            _ = tokio::time::sleep(group.renew_every()) => {}
        }
    }
}

/// Why a controller whose TLS CA differs from the leader's cannot join its group.
fn ca_mismatch(group: &GroupConfig, lease: &Lease) -> String {
    let name = |ca: &str| match ca {
        "" => "plaintext (no --tls-dir)".to_string(),
        ca => format!("the TLS CA with SHA-256 {}", &ca[..ca.len().min(16)]),
    };
    format!(
        "join the controller group: this controller ({}) serves under {}, but the leader {} at {} serves \
         under {}; agents that trust one CA cannot reach a controller whose certificate another signed. \
         Give every controller of the group the same --tls-dir (the same ca.pem)",
        group.id,
        name(&group.tls_ca),
        lease.holder,
        lease.address,
        name(&lease.tls_ca)
    )
}

/// The fence of a lease: its holder and epoch.
pub fn fence_of(lease: &Lease) -> Fence {
    Fence { holder: lease.holder.clone(), epoch: lease.epoch }
}

/// Takes office under `lease`: every write of `store` is fenced on its epoch from now on (a
/// follower's read-only fence is gone with it). Returns the fence, for [`keep`] and [`resign`].
pub fn take_office(store: &Arc<dyn Store>, lease: &Lease) -> Fence {
    let fence = fence_of(lease);
    store.set_fence(Some(fence.clone()));
    fence
}

/// Renews the lease of `fence` until `stop`; cancels the returned token when the lease is
/// lost (a renewal refused, or none succeeded for a whole TTL). A write refused by the fence
/// makes it check at once rather than at the next renewal.
pub fn keep(
    store: Arc<dyn Store>,
    group: GroupConfig,
    fence: Fence,
    stop: CancellationToken,
) -> CancellationToken {
    let lost = CancellationToken::new();
    let signal = lost.clone();
    tokio::spawn(async move {
        let mut last_ok = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(group.renew_every());
        let fenced = store.fenced();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
                // A write was refused by the fence: renew now, which finds the lease gone.
                _ = fenced.notified() => {
                    tracing::warn!(epoch = fence.epoch, "a write was refused by the fence; checking the lease now");
                }
            }
            // A renewal that hangs (a database gone away: the pool waits for a connection) must
            // not outlast the lease: the lease's end bounds it.
            let renewal =
                tokio::time::timeout_at(last_ok + group.ttl, store.renew_lease(&fence, group.ttl_ms()));
            match renewal.await {
                Ok(Ok(true)) => {
                    last_ok = tokio::time::Instant::now();
                    crate::metrics::metrics().lease_renewals.inc();
                }
                Ok(Ok(false)) => {
                    // Read the lease as it stands, to say whether it ran out or was taken.
                    let now = tokio::time::timeout(group.renew_every(), store.lease()).await;
                    let why = lost_reason(&fence, now.ok().and_then(|r| r.ok()).flatten().as_ref());
                    tracing::error!(epoch = fence.epoch, "lost the lease: {why}; stepping down");
                    break;
                }
                Ok(Err(e)) => {
                    crate::metrics::metrics().lease_failures.inc();
                    tracing::warn!(error = %e, "cannot renew the lease");
                    if last_ok.elapsed() >= group.ttl {
                        tracing::error!(epoch = fence.epoch, "no renewal for a whole lease: stepping down");
                        break;
                    }
                }
                Err(_) => {
                    crate::metrics::metrics().lease_failures.inc();
                    tracing::error!(epoch = fence.epoch, "no renewal for a whole lease: stepping down");
                    break;
                }
            }
        }
        crate::metrics::metrics().leading(false, fence.epoch);
        signal.cancel();
    });
    lost
}

/// Why a renewal under `fence` found the lease gone, from the lease as it now stands: taken by
/// another controller (or by this one again, after a pause, under a new epoch), or ran out
/// with nobody taking it yet (the renewal came too late: the database or this process stalled).
fn lost_reason(fence: &Fence, now: Option<&Lease>) -> String {
    match now {
        Some(l) if l.holder != fence.holder => {
            format!("controller {} leads now (epoch {}, at {})", l.holder, l.epoch, l.address)
        }
        Some(l) if l.epoch != fence.epoch => {
            format!(
                "this controller took the lease again under epoch {} (its epoch {} ended)",
                l.epoch, fence.epoch
            )
        }
        Some(l) => format!(
            "the lease ran out {} ms before this renewal and nobody has taken it yet (the database or \
             this controller stalled)",
            -l.remaining_ms.min(0)
        ),
        None => {
            "the lease could not be read after the renewal failed (the database is unreachable)".to_string()
        }
    }
}

/// Ends the lease at once (a controller stopping on purpose), so a follower takes over now.
pub async fn resign(store: &Arc<dyn Store>, fence: &Fence) {
    match store.resign_lease(fence).await {
        Ok(()) => tracing::info!(epoch = fence.epoch, "resigned the lease"),
        Err(e) => {
            tracing::warn!(error = %e, "could not resign the lease; a follower takes over when it runs out")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, epoch: u64, remaining_ms: i64) -> Lease {
        Lease {
            holder: holder.into(),
            epoch,
            address: "10.0.0.2:7070".into(),
            remaining_ms,
            tls_ca: String::new(),
        }
    }

    /// The step-down says what happened: taken, taken back after a pause, ran out, unreadable.
    #[test]
    fn a_lost_lease_is_explained() {
        let fence = Fence { holder: "c1".into(), epoch: 4 };
        let taken = lost_reason(&fence, Some(&lease("c2", 5, 4000)));
        assert!(taken.contains("controller c2 leads now (epoch 5, at 10.0.0.2:7070)"), "{taken}");
        let again = lost_reason(&fence, Some(&lease("c1", 5, 4000)));
        assert!(again.contains("epoch 5") && again.contains("its epoch 4 ended"), "{again}");
        let ran_out = lost_reason(&fence, Some(&lease("c1", 4, -750)));
        assert!(
            ran_out.contains("ran out 750 ms before this renewal") && !ran_out.contains("leads"),
            "{ran_out}"
        );
        assert!(lost_reason(&fence, None).contains("could not be read"));
    }
}
