//! `MASTER_PORT` for a launch that came without one (this host holds rank 0).

use tracing::warn;
use trainyard_proto::v1::Launch;
use trainyard_proto::words::RankState;

use crate::state::RankRecord;

/// The port the launch's ranks already have after a re-sent launch (among `ranks`, this host's),
/// else a port free on this host (bind port 0 on every interface, as torchrun does, then
/// release it) that no live rank here was handed. The rare race with another program taking it
/// in between fails the job's rendezvous, and its restart policy retries with a new port.
pub(super) fn master_port_for<'a>(
    ranks: impl Iterator<Item = &'a RankRecord> + Clone,
    launch: &Launch,
) -> u16 {
    let mine = |r: &&RankRecord| r.id.job_id == launch.job_id && r.id.attempt == launch.attempt;
    if let Some(port) = ranks.clone().filter(mine).map(|r| r.master_port).find(|p| *p > 0) {
        return port;
    }
    let taken: std::collections::BTreeSet<u16> = ranks
        .filter(|r| !matches!(r.phase, RankState::Exited | RankState::Lost))
        .map(|r| r.master_port)
        .collect();
    for _ in 0..32 {
        match std::net::TcpListener::bind(("0.0.0.0", 0)).and_then(|l| l.local_addr()) {
            Ok(addr) if !taken.contains(&addr.port()) => return addr.port(),
            Ok(_) => continue,
            Err(e) => {
                warn!(error = %e, "cannot find a free port for MASTER_PORT");
                break;
            }
        }
    }
    0
}
