//! The working state of one scheduling pass and the searches over it.
//!
//! Speed (docs/architecture.md: one decision over 1,000 hosts x 8 GPUs in under 10 ms): GPUs
//! are bit masks by position in the node; nodes sit in an index ordered by available GPU count,
//! so a `k`-GPU search starts at the nodes that fit it most tightly and stops at the first set
//! that no other node could beat; link matrices come parsed with the views; and
//! a request shape that failed once in a pass fails again without a search (capacity only
//! shrinks during a pass).

use std::cell::OnceCell;
use std::cmp::Reverse;
use std::collections::BTreeSet;
use std::hash::{BuildHasherDefault, Hasher};
use std::rc::Rc;

use super::types::{NodePlacement, NodeView, Placement, Request};
use crate::links::{LinkClass, LinkMatrix, SetScore, best_set, bits};
use trainyard_model::domain::InterconnectClass;

/// FNV-1a: the pass hashes a few short keys per queued job, where SipHash's DoS resistance
/// buys nothing (the keys are the operator's own job specs) and costs a third of the pass.
#[derive(Default)]
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 { 0xcbf2_9ce4_8422_2325 } else { self.0 };
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

type HashMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<Fnv>>;

/// What makes two requests interchangeable for placement (borrowed: no allocation per job).
type ShapeKey<'a> = (u32, u32, &'a str, u64, Option<InterconnectClass>, &'a [String]);

fn shape(req: &Request) -> ShapeKey<'_> {
    (req.gpus, req.gpus_per_node, &req.gpu_model, req.min_gpu_memory_mib, req.interconnect, &req.avoid)
}

struct NodeState<'a> {
    view: &'a NodeView,
    numa: Vec<i32>,
    /// Every GPU position.
    all: u64,
    /// Free now (not busy, not placed earlier in this pass).
    free: u64,
    /// Held for the head job.
    reserved: u64,
}

impl NodeState<'_> {
    fn matrix(&self) -> &LinkMatrix {
        &self.view.links
    }

    fn avail(&self) -> u64 {
        self.free & !self.reserved
    }

    /// The GPU indices of `mask`, ascending: local rank i gets the i-th lowest index, so that
    /// `cuda:LOCAL_RANK` is the rank's GPU under the job's `CUDA_VISIBLE_DEVICES` (the agent
    /// lists a job's GPUs in ascending order).
    fn gpu_indices(&self, mask: u64) -> Vec<u32> {
        let mut gpus: Vec<u32> = bits(mask).map(|p| self.view.gpus[p].index).collect();
        gpus.sort_unstable();
        gpus
    }
}

/// Whether placements may use busy GPUs: `Now` places on free GPUs; `Reserve` looks for the
/// GPUs a blocked job would take once busy ones free up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Now,
    Reserve,
}

/// A placement found, not yet committed.
pub(super) struct Found {
    /// (node, GPU positions) in node-rank order.
    nodes: Vec<(usize, u64)>,
    worst: LinkClass,
}

/// Static facts of a request shape over this fleet.
#[derive(Debug, Clone, Copy)]
struct ShapeInfo {
    /// Nodes of the right class with at least one eligible GPU.
    class_nodes: u32,
    /// Most eligible GPUs on one such node.
    max_node: u32,
    /// Eligible GPUs on all such nodes.
    total: u32,
}

pub(super) struct Fleet<'a> {
    nodes: Vec<NodeState<'a>>,
    /// (available GPUs, node) for every node with at least one.
    by_avail: BTreeSet<(u32, usize)>,
    /// Eligible GPU masks per node, by (model, min memory); absent key: every GPU.
    eligible: HashMap<(String, u64), Rc<Vec<u64>>>,
    info: HashMap<ShapeKey<'a>, ShapeInfo>,
    /// Shapes that could not be placed in this pass, with their reason once computed.
    failed: HashMap<ShapeKey<'a>, Option<String>>,
    /// Best link between two GPUs anywhere in the fleet (parsed lazily).
    top_pair: OnceCell<LinkClass>,
    /// The head job and the GPUs held for it.
    reservation: Option<(u64, Vec<(usize, u64)>)>,
}

impl<'a> Fleet<'a> {
    pub(super) fn new(views: &'a [NodeView]) -> Fleet<'a> {
        let mut order: Vec<&NodeView> = views.iter().filter(|v| v.gpus.len() <= 64).collect();
        order.sort_by(|a, b| a.agent_id.cmp(&b.agent_id));
        let nodes: Vec<NodeState> = order
            .into_iter()
            .map(|view| {
                let all = if view.gpus.len() == 64 { u64::MAX } else { (1u64 << view.gpus.len()) - 1 };
                let free =
                    view.gpus.iter().enumerate().filter(|(_, g)| g.free).fold(0, |m, (p, _)| m | 1 << p);
                let numa = view.gpus.iter().map(|g| g.numa_node).collect();
                NodeState { view, numa, all, free, reserved: 0 }
            })
            .collect();
        let by_avail = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.avail().count_ones(), i))
            .filter(|(c, _)| *c > 0)
            .collect();
        Fleet {
            nodes,
            by_avail,
            eligible: HashMap::default(),
            info: HashMap::default(),
            failed: HashMap::default(),
            top_pair: OnceCell::new(),
            reservation: None,
        }
    }

    fn elig(&mut self, req: &Request) -> Option<Rc<Vec<u64>>> {
        if req.gpu_model.is_empty() && req.min_gpu_memory_mib == 0 {
            return None;
        }
        let key = (req.gpu_model.to_lowercase(), req.min_gpu_memory_mib);
        let nodes = &self.nodes;
        let masks = self.eligible.entry(key.clone()).or_insert_with(|| {
            Rc::new(
                nodes
                    .iter()
                    .map(|n| {
                        n.view.gpus.iter().enumerate().fold(0u64, |m, (p, g)| {
                            let model_ok = key.0.is_empty() || g.model.to_lowercase().contains(&key.0);
                            if model_ok && g.memory_mib >= key.1 { m | 1 << p } else { m }
                        })
                    })
                    .collect(),
            )
        });
        Some(masks.clone())
    }

    /// The node has the interconnect class the job needs and is not one the job avoids.
    fn class_ok(req: &Request, node: &NodeState) -> bool {
        req.interconnect.is_none_or(|c| node.view.interconnect_class == Some(c))
            && !req.avoid.contains(&node.view.agent_id)
    }

    fn shape_info(&mut self, req: &'a Request) -> ShapeInfo {
        let key = shape(req);
        if let Some(info) = self.info.get(&key) {
            return *info;
        }
        let elig = self.elig(req);
        let mut info = ShapeInfo { class_nodes: 0, max_node: 0, total: 0 };
        for (i, n) in self.nodes.iter().enumerate() {
            let count = (n.all & elig.as_ref().map_or(u64::MAX, |e| e[i])).count_ones();
            if Self::class_ok(req, n) && count > 0 {
                info.class_nodes += 1;
                info.max_node = info.max_node.max(count);
                info.total += count;
            }
        }
        self.info.insert(key, info);
        info
    }

    /// Whether the job goes on one node.
    fn single(req: &Request, info: ShapeInfo) -> bool {
        req.gpus_per_node == req.gpus || (req.gpus_per_node == 0 && req.gpus <= info.max_node)
    }

    fn top_pair(&self) -> LinkClass {
        *self.top_pair.get_or_init(|| {
            self.nodes.iter().map(|n| n.matrix().best_possible(2)).max().unwrap_or(LinkClass::Local)
        })
    }

    /// Finds where the job goes on free, unreserved GPUs now.
    pub(super) fn place_now(&mut self, req: &'a Request) -> Option<Found> {
        if req.gpus == 0 || self.failed.contains_key(&shape(req)) {
            return None;
        }
        let info = self.shape_info(req);
        let found = if Self::single(req, info) {
            self.single_node(req, Mode::Now)
        } else {
            self.multi_node(req, info, Mode::Now)
        };
        if found.is_none() {
            self.failed.insert(shape(req), None);
        }
        found
    }

    fn single_node(&mut self, req: &Request, mode: Mode) -> Option<Found> {
        let k = req.gpus;
        let elig = self.elig(req);
        let elig_of = |i: usize| elig.as_ref().map_or(u64::MAX, |e| e[i]);
        let top = if k <= 1 { LinkClass::Local } else { self.top_pair() };
        let ideal = SetScore { worst_link: top, numa_nodes: Reverse(1) };
        type Key = (Reverse<u32>, SetScore, Reverse<u32>);
        let mut best: Option<(Key, usize, u64)> = None;
        // Tightest fit first: the first node reaching the ideal score cannot be beaten.
        let candidates: Box<dyn Iterator<Item = (u32, usize)>> = match mode {
            Mode::Now => Box::new(self.by_avail.range((k, 0)..).copied()),
            Mode::Reserve => Box::new((0..self.nodes.len()).map(|i| (0, i))),
        };
        for (count, i) in candidates {
            let node = &self.nodes[i];
            if !Self::class_ok(req, node) {
                continue;
            }
            let avail = match mode {
                Mode::Now => node.avail(),
                Mode::Reserve => node.all & !node.reserved,
            } & elig_of(i);
            if avail.count_ones() < k {
                continue;
            }
            let leftover = Reverse(count.saturating_sub(k));
            if mode == Mode::Now
                && let Some((b, _, _)) = &best
            {
                let bound = SetScore { worst_link: node.matrix().best_possible(k), numa_nodes: Reverse(1) };
                if (Reverse(0), bound, leftover) <= *b {
                    continue;
                }
            }
            let Some((mask, score)) = best_set(node.matrix(), &node.numa, avail, k) else { continue };
            let busy = Reverse((mask & !node.free).count_ones());
            let key = (busy, score, leftover);
            if best.as_ref().is_none_or(|(b, _, _)| key > *b) {
                best = Some((key, i, mask));
                if mode == Mode::Now && score == ideal {
                    break;
                }
            }
        }
        let ((_, score, _), i, mask) = best?;
        Some(Found { nodes: vec![(i, mask)], worst: score.worst_link })
    }

    fn multi_node(&mut self, req: &Request, info: ShapeInfo, mode: Mode) -> Option<Found> {
        let elig = self.elig(req);
        let elig_of = |i: usize| elig.as_ref().map_or(u64::MAX, |e| e[i]);
        let per_node = req.gpus_per_node;
        // Candidates by class: (busy GPUs it needs, size it offers, score, node, usable mask).
        type Cand = (Reverse<u32>, u32, SetScore, usize, u64);
        let mut groups: HashMap<Option<InterconnectClass>, Vec<Cand>> = HashMap::default();
        let from = if per_node > 0 { per_node } else { 1 };
        let candidates: Box<dyn Iterator<Item = usize>> = match mode {
            Mode::Now => Box::new(self.by_avail.range((from, 0)..).map(|&(_, i)| i)),
            Mode::Reserve => Box::new(0..self.nodes.len()),
        };
        for i in candidates {
            let node = &self.nodes[i];
            if !Self::class_ok(req, node) {
                continue;
            }
            let eligible = node.all & elig_of(i);
            let usable = match mode {
                Mode::Now => node.avail(),
                Mode::Reserve => node.all & !node.reserved,
            } & eligible;
            let cand = if per_node > 0 {
                best_set(node.matrix(), &node.numa, usable, per_node)
                    .map(|(mask, s)| (Reverse((mask & !node.free).count_ones()), per_node, s, i, mask))
            } else if usable == eligible && eligible != 0 {
                // Whole nodes: every eligible GPU of the node is usable.
                let (_, s) = best_set(node.matrix(), &node.numa, usable, usable.count_ones())?;
                Some((Reverse((usable & !node.free).count_ones()), usable.count_ones(), s, i, usable))
            } else {
                None
            };
            if let Some(c) = cand {
                groups.entry(node.view.interconnect_class).or_default().push(c);
            }
        }
        let _ = info;
        // Per class: the best nodes, as few as possible; then the best class.
        type GroupKey = (Reverse<u32>, Reverse<usize>, SetScore);
        let mut best: Option<(GroupKey, Vec<Cand>)> = None;
        for (_, mut cands) in groups {
            // Best first: fewest busy GPUs, largest, best set, then lowest node.
            cands.sort_by_key(|c| Reverse((c.0, c.1, c.2, Reverse(c.3))));
            let mut chosen = Vec::new();
            let mut sum = 0;
            for c in cands {
                if sum >= req.gpus {
                    break;
                }
                sum += c.1;
                chosen.push(c);
            }
            if sum < req.gpus {
                continue;
            }
            let busy: u32 = chosen.iter().map(|c| c.0.0).sum();
            let worst = chosen.iter().map(|c| c.2).min()?;
            let key = (Reverse(busy), Reverse(chosen.len()), worst);
            if best.as_ref().is_none_or(|(b, _)| key > *b) {
                best = Some((key, chosen));
            }
        }
        let ((_, _, worst), chosen) = best?;
        let counts = split(req.gpus, &chosen.iter().map(|c| c.1).collect::<Vec<_>>());
        let mut nodes = Vec::new();
        for (c, count) in chosen.iter().zip(counts) {
            let node = &self.nodes[c.3];
            let mask = if count == c.4.count_ones() {
                c.4
            } else {
                best_set(node.matrix(), &node.numa, c.4, count)?.0
            };
            nodes.push((c.3, mask));
        }
        Some(Found { nodes, worst: worst.worst_link })
    }

    /// Marks the GPUs of `found` taken and returns the placement.
    pub(super) fn commit(&mut self, req: &Request, found: Found) -> Placement {
        let mut first_rank = 0;
        let mut out = Vec::new();
        for (node_rank, &(i, mask)) in found.nodes.iter().enumerate() {
            let node = &mut self.nodes[i];
            self.by_avail.remove(&(node.avail().count_ones(), i));
            node.free &= !mask;
            let left = node.avail().count_ones();
            if left > 0 {
                self.by_avail.insert((left, i));
            }
            let gpus = node.gpu_indices(mask);
            let n = gpus.len() as u32;
            out.push(NodePlacement {
                agent_id: node.view.agent_id.clone(),
                node_rank: node_rank as u32,
                first_rank,
                gpus,
            });
            first_rank += n;
        }
        let bottleneck = crate::cost::bottleneck(found.worst, out.len() > 1);
        Placement { job_id: req.job_id, nodes: out, bottleneck }
    }

    /// Holds for `req` (the head of the queue) the GPUs it would take once busy ones free up.
    /// Returns what was held, for its waiting reason.
    pub(super) fn reserve_for(&mut self, req: &'a Request) -> Option<String> {
        let info = self.shape_info(req);
        let found = if Self::single(req, info) {
            self.single_node(req, Mode::Reserve)
        } else {
            self.multi_node(req, info, Mode::Reserve)
        }?;
        let mut held = Vec::new();
        for &(i, mask) in &found.nodes {
            let node = &mut self.nodes[i];
            self.by_avail.remove(&(node.avail().count_ones(), i));
            node.reserved |= mask;
            let left = node.avail().count_ones();
            if left > 0 {
                self.by_avail.insert((left, i));
            }
            held.push(format!(
                "{} {}",
                node.view.agent_id,
                trainyard_proto::contract::cpulist::format(&node.gpu_indices(mask))
            ));
        }
        self.reservation = Some((req.job_id, found.nodes));
        Some(format!("holding GPUs {} for it as they free up", held.join(", ")))
    }

    /// Why `req` cannot be placed now (the pass's view, reservation included).
    pub(super) fn waiting_reason(&mut self, req: &'a Request) -> String {
        if let Some(Some(reason)) = self.failed.get(&shape(req)) {
            return reason.clone();
        }
        let info = self.shape_info(req);
        let elig = self.elig(req);
        let elig_of = |i: usize| elig.as_ref().map_or(u64::MAX, |e| e[i]);
        let (what, class) = (what(req), class_words(req));
        let mut reason = if Self::single(req, info) {
            let largest = (0..self.nodes.len())
                .filter(|&i| Self::class_ok(req, &self.nodes[i]))
                .map(|i| (self.nodes[i].avail() & elig_of(i)).count_ones())
                .max()
                .unwrap_or(0);
            format!("needs {} {what} on one {class}node; largest free set is {largest}", req.gpus)
        } else if req.gpus_per_node > 0 {
            let p = req.gpus_per_node;
            let have = (0..self.nodes.len())
                .filter(|&i| Self::class_ok(req, &self.nodes[i]))
                .filter(|&i| (self.nodes[i].avail() & elig_of(i)).count_ones() >= p)
                .count();
            format!("needs {} {class}nodes with {p} free {what} each; {have} have them", req.gpus / p)
        } else {
            let whole = (0..self.nodes.len())
                .filter(|&i| Self::class_ok(req, &self.nodes[i]))
                .filter(|&i| {
                    let e = self.nodes[i].all & elig_of(i);
                    e != 0 && self.nodes[i].avail() & e == e
                })
                .count();
            format!("needs {} {what} on whole {class}nodes; {whole} such node(s) are free", req.gpus)
        };
        if !req.avoid.is_empty() {
            reason.push_str(&format!(" (avoiding {}, excluded after failures)", req.avoid.join(", ")));
        }
        match &self.reservation {
            Some((head, _)) if *head != req.job_id => {
                reason.push_str(&format!("; GPUs are held for job {head}, ahead in the queue"));
                self.failed.insert(shape(req), Some(reason.clone()));
            }
            Some(_) => {}
            None => {
                if let Some(held) = self.reserve_for(req) {
                    reason.push_str(&format!("; {held}"));
                }
            }
        }
        reason
    }

    /// Why `req` could never be placed on this fleet (every GPU free).
    pub(super) fn never_reason(&mut self, req: &'a Request) -> String {
        let info = self.shape_info(req);
        let elig = self.elig(req);
        let elig_of = |i: usize| elig.as_ref().map_or(u64::MAX, |e| e[i]);
        let (what, class) = (what(req), class_words(req));
        if info.class_nodes == 0 {
            return format!("needs {} {what}; the fleet has no {class}node with such GPUs", req.gpus);
        }
        if Self::single(req, info) {
            return format!(
                "needs {} {what} on one {class}node; the largest {class}node has {}",
                req.gpus, info.max_node
            );
        }
        if req.gpus_per_node > 0 {
            let p = req.gpus_per_node;
            let have = (0..self.nodes.len())
                .filter(|&i| Self::class_ok(req, &self.nodes[i]))
                .filter(|&i| (self.nodes[i].all & elig_of(i)).count_ones() >= p)
                .count();
            return format!(
                "needs {} {class}nodes with {p} {what} each; the fleet has {have} such node(s), \
                 at most {} {what} on one node",
                req.gpus / p,
                info.max_node
            );
        }
        format!(
            "needs {} {what} on whole {class}nodes; the fleet has {} on {} node(s)",
            req.gpus, info.total, info.class_nodes
        )
    }
}

/// Ranks per node: an even split when every node can take it, else node-major filling.
fn split(gpus: u32, sizes: &[u32]) -> Vec<u32> {
    let m = sizes.len() as u32;
    if m > 0 && gpus.is_multiple_of(m) && sizes.iter().all(|&s| s >= gpus / m) {
        return vec![gpus / m; sizes.len()];
    }
    let mut left = gpus;
    sizes
        .iter()
        .map(|&s| {
            let take = s.min(left);
            left -= take;
            take
        })
        .collect()
}

fn what(req: &Request) -> String {
    match (req.gpu_model.is_empty(), req.min_gpu_memory_mib) {
        (true, 0) => "GPUs".to_string(),
        (true, mem) => format!("GPUs with at least {mem} MiB"),
        (false, 0) => format!("{} GPUs", req.gpu_model),
        (false, mem) => format!("{} GPUs with at least {mem} MiB", req.gpu_model),
    }
}

fn class_words(req: &Request) -> String {
    req.interconnect.map(|c| format!("{c} ")).unwrap_or_default()
}
