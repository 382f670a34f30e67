//! Gang placement: a pure function from (queue, fleet view) to placements and waiting reasons.
//!
//! All ranks of a job are placed at once or none are, and where they go follows the hardware
//! (docs/field-notes.md §1 and §2):
//!
//! - A job that fits on one node goes on one node. Inside a node the GPU set with the best
//!   *worst link* wins (all `NV18` beats NVLink pairs beats PCIe `PIX`/`PXB`/`PHB` beats `NODE`
//!   beats `SYS`), then the set spanning the fewest NUMA nodes, then the node it fills most
//!   tightly (so larger free sets stay whole for larger jobs).
//! - A job larger than a node (or one that names GPUs per node) takes nodes of one interconnect
//!   class: whole free nodes, the fewest possible, when the scheduler chooses the split.
//! - Constraints: interconnect class (`nvswitch`, `nvlink-pairs`, `pcie`, or any; a node whose
//!   class is not known yet satisfies only "any"), GPU model substring, minimum GPU memory.
//!
//! Why the worst link is the primary score: the cost model ([`crate::cost`]) predicts a job's
//! collective time per step from the bandwidth of the slowest link class it uses, and
//! [`LinkClass`]'s order is that bandwidth order. For one job (fixed bytes and world size) the
//! predicted time is a monotone function of the worst link, so ranking by it *is* ranking by
//! predicted cost, and it keeps working for jobs that declare no bytes. NUMA count and fit then
//! break ties the cost model cannot see (CPU proxy stalls, fragmentation).
//!
//! # Queue order and backfill
//! Jobs go by priority (higher first), then FIFO (lower job id). The first job that cannot be
//! placed now is the *head*. Without runtime estimates no one knows when GPUs free up, so the
//! rule that never delays the head is spatial: the scheduler picks the GPUs the head would take
//! once busy GPUs free up (the set needing the fewest currently busy GPUs, then the best
//! topology) and *reserves* them; later jobs are backfilled only onto free GPUs outside the
//! reservation. Whatever a backfilled job holds, it is never a GPU the head is waiting for, so
//! the head starts as soon as the jobs holding its reserved GPUs end, backfill or not. The
//! reservation is recomputed every pass, so it follows the fleet as it changes.
//!
//! Ranks are numbered node-major: the first node of a placement holds ranks `0..k`, and within a
//! node local rank `i` gets the node's `i`-th chosen GPU (ascending index).

mod pinning;
mod search;
mod types;

#[cfg(test)]
mod tests;

pub use crate::links::{LinkClass, LinkMatrix, SetScore};
pub use pinning::{CpuPlan, plan_cpus};
pub use types::{GpuView, NodePlacement, NodeView, Outcome, Placement, Request};

use search::Fleet;

/// Places one job on the free GPUs of `nodes`, or returns `None` if it does not fit now.
pub fn place(req: &Request, nodes: &[NodeView]) -> Option<Placement> {
    let mut fleet = Fleet::new(nodes);
    fleet.place_now(req).map(|found| fleet.commit(req, found))
}

/// Could the job ever run on this fleet, were every GPU free? Used to refuse at submit a job
/// that would otherwise wait forever; returns the reason when it could not. `nodes` should
/// mark every GPU free (busy ones are counted as free here anyway).
pub fn feasible(req: &Request, nodes: &[NodeView]) -> Result<(), String> {
    let mut all = nodes.to_vec();
    all.iter_mut().flat_map(|n| n.gpus.iter_mut()).for_each(|g| g.free = true);
    let mut fleet = Fleet::new(&all);
    match fleet.place_now(req) {
        Some(_) => Ok(()),
        None => Err(fleet.never_reason(req)),
    }
}

/// One scheduling pass: jobs in priority order (higher first, then lower job id, i.e. FIFO),
/// each placed on what the jobs before it left free, with backfill around the head job's
/// reservation (see the module documentation). Returns the placements and why the rest wait.
pub fn schedule(queue: &[Request], nodes: &[NodeView]) -> Outcome {
    let mut order: Vec<&Request> = queue.iter().collect();
    order.sort_by_key(|r| (std::cmp::Reverse(r.priority), r.job_id));
    let mut fleet = Fleet::new(nodes);
    let mut outcome = Outcome::default();
    for req in order {
        match fleet.place_now(req) {
            Some(found) => outcome.placements.push(fleet.commit(req, found)),
            // The first job left waiting also gets the reservation (see the module docs).
            None => outcome.waiting.push((req.job_id, fleet.waiting_reason(req))),
        }
    }
    outcome
}
