//! A member of a controller group (docs/ha.md), from start to stop: it follows until it leads,
//! leads until it loses its lease (it was frozen, or cut off from the database), then follows
//! again; on shutdown a leader resigns, so a follower takes over at once instead of after the
//! lease runs out. The elections, the lease and the fence are `core::leader`'s; this is the loop
//! that hands the listeners from a follower to a leader and back.
//!
//! The gRPC and HTTP listeners are bound once for the process's life ([`Listeners`]): a
//! follower and then a leader serve on duplicates of the same sockets, so connections that
//! arrive while one hands over to the other wait in the kernel's backlog instead of being
//! refused.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use trainyard_store::{Lease, Store};

use crate::config::ControllerConfig;
use crate::core::Controller;
use crate::core::leader::{self, GroupConfig};
use crate::http::Exposure;
use crate::server::{self, Security};

/// How long a leader that lost its lease waits for requests in flight before it cuts them.
pub const STEP_DOWN_GRACE: Duration = Duration::from_secs(3);

/// How long a follower that is told to stop (this controller leads now) may take.
const FOLLOWER_STOP: Duration = Duration::from_secs(10);

/// The listeners a controller serves on, bound once: the gRPC one, and the HTTP one with how
/// it is exposed (none when off).
pub struct Listeners {
    pub grpc: TcpListener,
    pub http: Option<(TcpListener, Exposure)>,
}

impl Listeners {
    /// Duplicates of the sockets (the same listening socket under new descriptors), for one
    /// server's life.
    pub fn dup(&self) -> anyhow::Result<(TcpListener, Option<(TcpListener, Exposure)>)> {
        let http = match &self.http {
            Some((l, exposure)) => Some((dup_listener(l)?, exposure.clone())),
            None => None,
        };
        Ok((dup_listener(&self.grpc)?, http))
    }
}

fn dup_listener(listener: &TcpListener) -> anyhow::Result<TcpListener> {
    use std::os::fd::AsFd;
    let fd = listener.as_fd().try_clone_to_owned().context("duplicate a listening socket")?;
    let std = std::net::TcpListener::from(fd);
    std.set_nonblocking(true).context("set a listening socket non-blocking")?;
    TcpListener::from_std(std).context("register a listening socket")
}

/// What a member serves with.
#[derive(Clone)]
pub struct Member {
    pub store: Arc<dyn Store>,
    pub group: GroupConfig,
    pub config: ControllerConfig,
    pub security: Security,
}

impl Member {
    /// Serves as a member of the group on `listeners` until `shutdown()` resolves (each call a
    /// new wait for the same signal: ctrl-c or SIGTERM in the daemon).
    pub async fn serve<S, F>(&self, listeners: &Listeners, shutdown: S) -> anyhow::Result<()>
    where
        S: Fn() -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        loop {
            let Some(lease) = self.follow_until_leading(listeners, shutdown()).await? else {
                return Ok(()); // stopped while following
            };
            let fence = leader::take_office(&self.store, &lease);
            let controller = Controller::start_leading(self.store.clone(), self.config.clone(), lease)
                .await
                .context("load jobs and agents from the store")?;
            let stop = CancellationToken::new();
            let lost = leader::keep(self.store.clone(), self.group.clone(), fence.clone(), stop.clone());
            let stopping = Arc::new(AtomicBool::new(false));
            let until = {
                let (lost, stopping, signal) = (lost.clone(), stopping.clone(), shutdown());
                async move {
                    tokio::select! {
                        _ = signal => stopping.store(true, Ordering::Relaxed),
                        _ = lost.cancelled() => {}
                    }
                }
            };
            let (grpc, http) = listeners.dup()?;
            let serving = tokio::spawn(server::run(grpc, http, controller, self.security.clone(), until));
            step_down_when_lost(serving, &lost).await?;
            stop.cancel();
            if stopping.load(Ordering::Relaxed) {
                leader::resign(&self.store, &fence).await;
                return Ok(());
            }
            tracing::error!(
                epoch = fence.epoch,
                "stepped down: the lease of epoch {} was lost and nothing more was written under it; following again",
                fence.epoch
            );
        }
    }

    /// Takes part in the group's elections, serving as a follower on the listeners from the
    /// first election that finds another leader; returns this controller's lease once it leads
    /// (the follower stopped), or `None` once `shutdown` resolves.
    async fn follow_until_leading(
        &self,
        listeners: &Listeners,
        shutdown: impl Future<Output = ()>,
    ) -> anyhow::Result<Option<Lease>> {
        let (seen, mut leader) = tokio::sync::watch::channel(None);
        let stop = CancellationToken::new();
        let mut follower = {
            let (store, config, id) = (self.store.clone(), self.config.clone(), self.group.id.clone());
            let (grpc, http) = listeners.dup()?;
            let (security, stop) = (self.security.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    // The first election that did not make this controller lead.
                    told = leader.changed() => if told.is_err() { return Ok(()) },
                }
                let follower = Controller::follow(store, config, id, leader)
                    .await
                    .context("load jobs and agents from the store")?;
                server::run(grpc, http, follower, security, stop.cancelled_owned())
                    .await
                    .context("serve as a follower")
            })
        };
        let lease = leader::lead(&self.store, &self.group, shutdown, &seen).await;
        stop.cancel();
        match tokio::time::timeout(FOLLOWER_STOP, &mut follower).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::error!(error = %format!("{e:#}"), "the follower failed"),
            Ok(Err(e)) => tracing::error!(error = %e, "the follower panicked"),
            Err(_) => {
                tracing::warn!("the follower did not stop within 10 s; stopping it now");
                follower.abort();
            }
        }
        lease
    }
}

/// Waits for the leader's server to end. A lost lease ends the service at once: requests stuck
/// on a database that went away get [`STEP_DOWN_GRACE`], then their connections are cut.
async fn step_down_when_lost(
    mut serving: tokio::task::JoinHandle<anyhow::Result<()>>,
    lost: &CancellationToken,
) -> anyhow::Result<()> {
    let served = tokio::select! {
        served = &mut serving => served,
        _ = lost.cancelled() => match tokio::time::timeout(STEP_DOWN_GRACE, &mut serving).await {
            Ok(served) => served,
            Err(_) => {
                serving.abort();
                Ok(Ok(()))
            }
        },
    };
    served.context("the server task failed")?.context("serve")
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use trainyard_store::{LeaseStore as _, SqlStore};
    use trainyard_testkit::pg_server::{Durability, TempPostgres};

    use super::*;

    const TTL: Duration = Duration::from_secs(3);

    /// A member `id` of the group on the database at `url`, serving on its own loopback port
    /// until its token is cancelled.
    async fn start(url: &str, id: &str) -> (CancellationToken, tokio::task::JoinHandle<anyhow::Result<()>>) {
        let store: Arc<dyn Store> = Arc::new(SqlStore::open(url).await.expect("open the store"));
        let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = grpc.local_addr().expect("bound").to_string();
        let group = GroupConfig { id: id.into(), address, ttl: TTL, tls_ca: String::new() };
        let member = Member { store, group, config: ControllerConfig::default(), security: Security::demo() };
        let token = CancellationToken::new();
        let stop = token.clone();
        let task = tokio::spawn(async move {
            let listeners = Listeners { grpc, http: None };
            member.serve(&listeners, move || stop.clone().cancelled_owned()).await
        });
        (token, task)
    }

    /// The lease once `holds` says it is the one waited for, within `within`.
    async fn lease_when(store: &SqlStore, within: Duration, holds: impl Fn(&Lease) -> bool) -> Lease {
        let deadline = Instant::now() + within;
        loop {
            let lease = store.lease().await.expect("read the lease");
            match lease {
                Some(lease) if lease.remaining_ms > 0 && holds(&lease) => return lease,
                _ if Instant::now() > deadline => panic!("within {within:?} the lease stayed {lease:?}"),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// The hand-over loop, driven: the first member leads and the second follows; a leader that
    /// loses its lease steps down and follows again (its task goes on) while the group elects
    /// anew; a leader told to stop resigns, so the follower takes over well before the lease
    /// would have run out, and each member's task ends cleanly when told to stop.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn members_follow_lead_step_down_and_hand_over() {
        let pg = tokio::task::spawn_blocking(|| TempPostgres::start(Durability::Relaxed))
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("{e}"));
        let url = pg.create_database().unwrap_or_else(|e| panic!("{e}"));
        let observer = SqlStore::open(&url).await.expect("open the store");

        let (stop_a, a) = start(&url, "a").await;
        let first = lease_when(&observer, Duration::from_secs(20), |l| l.holder == "a").await;
        assert_eq!(first.epoch, 1);
        let (stop_b, b) = start(&url, "b").await;
        // Two renewals later "a" still leads under its first epoch: "b" follows.
        tokio::time::sleep(TTL).await;
        let kept = lease_when(&observer, Duration::from_secs(1), |_| true).await;
        assert_eq!((kept.holder.as_str(), kept.epoch), ("a", 1));

        // The lease is taken from under "a" (as when it was frozen past it): a new epoch leads,
        // and neither member's task ended.
        let pool = sqlx::PgPool::connect(&url).await.expect("connect");
        sqlx::query("UPDATE controller_lease SET expires_at_ms = 0").execute(&pool).await.expect("expire");
        let second = lease_when(&observer, Duration::from_secs(20), |l| l.epoch == 2).await;
        tokio::time::sleep(TTL).await;
        assert!(!a.is_finished() && !b.is_finished(), "a member stopped when the lease moved");
        let now = lease_when(&observer, Duration::from_secs(1), |_| true).await;
        assert_eq!((now.holder.as_str(), now.epoch), (second.holder.as_str(), 2), "one leader held on");

        // The leader is told to stop: it resigns and the other takes over at its next election.
        let mut members = vec![("a", stop_a, a), ("b", stop_b, b)];
        let at = members.iter().position(|(id, _, _)| *id == second.holder).expect("a member leads");
        let (_, stop_leader, leader) = members.remove(at);
        let (other, stop_other, other_task) = members.remove(0);
        let asked = Instant::now();
        stop_leader.cancel();
        leader.await.expect("join").expect("the leader stops cleanly");
        let third = lease_when(&observer, TTL * 3, |l| l.holder == other).await;
        assert_eq!(third.epoch, 3);
        assert!(
            asked.elapsed() < TTL,
            "taken over after {:?}: the resignation was not seen",
            asked.elapsed()
        );
        stop_other.cancel();
        other_task.await.expect("join").expect("the last member stops cleanly");
    }
}
