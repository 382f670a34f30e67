//! Link classes between GPUs and the choice of a GPU set inside one node.
//!
//! A node's `links` matrix is what `nvidia-smi topo -m` prints. A set of GPUs is as fast as its
//! slowest pair (ring collectives run at the pace of their slowest hop), so a set is judged by
//! its worst link, then by how many NUMA nodes it spans (a split set pays in CPU proxy threads,
//! docs/field-notes.md §2).

use std::cmp::Reverse;

/// The class of the path between two GPUs, ordered worst to best. The order is the cost
/// model's bandwidth order ([`crate::cost::link_bandwidth_gbps`] is monotone in it, a unit test
/// holds it to that), so ranking placements by their worst link ranks them by predicted
/// communication time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkClass {
    /// No link information (no matrix in the inventory, or a code we do not know).
    Unknown,
    /// Between nodes, over the network (multi-node placements only).
    Network,
    /// `SYS`: across the SMP interconnect between NUMA nodes (UPI/QPI).
    Sys,
    /// `NODE`: across PCIe host bridges inside one NUMA node.
    Node,
    /// `PHB`: through a PCIe host bridge (the CPU).
    Phb,
    /// `PXB`: several PCIe bridges, no host bridge.
    Pxb,
    /// `PIX`: at most one PCIe bridge.
    Pix,
    /// `NV#`: a bonded set of # NVLinks (`NV12` on an H100 NVL pair, `NV18` over NVSwitch).
    NvLink(u8),
    /// One GPU: no GPU-GPU traffic at all.
    Local,
}

impl LinkClass {
    /// Parses a cell of the `nvidia-smi topo -m` matrix.
    pub fn parse(code: &str) -> LinkClass {
        let code = code.trim();
        match code {
            "X" => LinkClass::Local,
            "SYS" => LinkClass::Sys,
            "NODE" => LinkClass::Node,
            "PHB" => LinkClass::Phb,
            "PXB" => LinkClass::Pxb,
            "PIX" => LinkClass::Pix,
            _ => match code.strip_prefix("NV").and_then(|n| n.parse::<u8>().ok()) {
                Some(n) if n > 0 => LinkClass::NvLink(n),
                _ => LinkClass::Unknown,
            },
        }
    }

    /// How `ctl` and the waiting reasons name it.
    pub fn label(self) -> String {
        match self {
            LinkClass::Unknown => "unknown link".into(),
            LinkClass::Network => "network".into(),
            LinkClass::Sys => "SYS".into(),
            LinkClass::Node => "NODE".into(),
            LinkClass::Phb => "PHB".into(),
            LinkClass::Pxb => "PXB".into(),
            LinkClass::Pix => "PIX".into(),
            LinkClass::NvLink(n) => format!("NV{n}"),
            LinkClass::Local => "single GPU".into(),
        }
    }
}

/// A node's links parsed once: the pair matrix by GPU position (not GPU index), and whether
/// every off-diagonal cell is the same (then every set has that worst link and only the NUMA
/// count tells sets apart, so no enumeration is needed).
#[derive(Debug, Clone, PartialEq)]
pub struct LinkMatrix {
    n: usize,
    cells: Vec<LinkClass>,
    uniform: Option<LinkClass>,
    /// Best off-diagonal link: an upper bound on the worst link of any set of two or more.
    best: LinkClass,
}

impl LinkMatrix {
    /// Parses a row-major `n x n` matrix; anything else gives an all-`Unknown` matrix.
    pub fn parse(links: &[String], n: usize) -> LinkMatrix {
        let cells: Vec<LinkClass> = if links.len() == n * n {
            links.iter().map(|c| LinkClass::parse(c)).collect()
        } else {
            vec![LinkClass::Unknown; n * n]
        };
        let off: Vec<LinkClass> = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| cells[i * n + j].min(cells[j * n + i]))
            .collect();
        let uniform = match off.first() {
            None => Some(LinkClass::Local),
            Some(f) => off.iter().all(|c| c == f).then_some(*f),
        };
        let best = off.iter().copied().max().unwrap_or(LinkClass::Local);
        LinkMatrix { n, cells, uniform, best }
    }

    pub fn uniform(&self) -> Option<LinkClass> {
        self.uniform
    }

    /// Upper bound of the worst link of any set of `k` GPUs of this node.
    pub fn best_possible(&self, k: u32) -> LinkClass {
        if k <= 1 { LinkClass::Local } else { self.best }
    }

    /// The worst link among the GPUs (positions) of `mask`.
    pub fn worst(&self, mask: u64) -> LinkClass {
        let mut worst = LinkClass::Local;
        let mut rest = mask;
        while rest != 0 {
            let i = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let mut others = rest;
            while others != 0 {
                let j = others.trailing_zeros() as usize;
                others &= others - 1;
                worst = worst.min(self.cells[i * self.n + j].min(self.cells[j * self.n + i]));
            }
        }
        worst
    }
}

/// How good a GPU set inside one node is: worst link first, then fewer NUMA nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SetScore {
    pub worst_link: LinkClass,
    pub numa_nodes: Reverse<u32>,
}

/// Positions of the set bits of `mask`, lowest first.
pub fn bits(mask: u64) -> impl Iterator<Item = usize> {
    let mut rest = mask;
    std::iter::from_fn(move || {
        (rest != 0).then(|| {
            let b = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            b
        })
    })
}

/// Number of distinct NUMA nodes among the positions of `mask`.
pub fn numa_count(mask: u64, numa: &[i32]) -> u32 {
    let mut seen: Vec<i32> = Vec::new();
    for p in bits(mask) {
        if !seen.contains(&numa[p]) {
            seen.push(numa[p]);
        }
    }
    seen.len() as u32
}

/// Above this many candidate GPUs a node is not enumerated set by set (C(20,10) is 184,756).
const MAX_ENUMERATED: u32 = 20;

/// The best set of `k` GPUs among the positions in `avail`, or `None` if fewer are available.
/// `numa` is the NUMA node of every position.
pub fn best_set(matrix: &LinkMatrix, numa: &[i32], avail: u64, k: u32) -> Option<(u64, SetScore)> {
    let count = avail.count_ones();
    if k == 0 || count < k {
        return None;
    }
    if matrix.uniform().is_some() || count > MAX_ENUMERATED {
        let mask = fewest_numa(numa, avail, k);
        return Some((mask, score(matrix, numa, mask)));
    }
    let positions: Vec<usize> = bits(avail).collect();
    let mut best: Option<(u64, SetScore)> = None;
    // Gosper's hack over combinations of `k` of the available positions.
    let n = positions.len();
    let mut comb: u64 = (1u64 << k) - 1;
    while comb < (1u64 << n) {
        let mask = bits(comb).fold(0u64, |m, i| m | (1u64 << positions[i]));
        let s = score(matrix, numa, mask);
        if best.is_none_or(|(_, b)| s > b) {
            best = Some((mask, s));
        }
        let low = comb & comb.wrapping_neg();
        let ripple = comb + low;
        comb = (((ripple ^ comb) >> 2) / low) | ripple;
    }
    best
}

fn score(matrix: &LinkMatrix, numa: &[i32], mask: u64) -> SetScore {
    SetScore { worst_link: matrix.worst(mask), numa_nodes: Reverse(numa_count(mask, numa)) }
}

/// `k` positions of `avail` spanning as few NUMA nodes as possible: the NUMA node whose free
/// count fits `k` most tightly if one can hold them all (leaving larger free groups whole for
/// larger jobs), else NUMA nodes by decreasing free count.
pub fn fewest_numa(numa: &[i32], avail: u64, k: u32) -> u64 {
    let mut groups: Vec<(i32, u64)> = Vec::new();
    for p in bits(avail) {
        match groups.iter_mut().find(|(n, _)| *n == numa[p]) {
            Some((_, m)) => *m |= 1u64 << p,
            None => groups.push((numa[p], 1u64 << p)),
        }
    }
    if let Some((_, m)) =
        groups.iter().filter(|(_, m)| m.count_ones() >= k).min_by_key(|(n, m)| (m.count_ones(), *n))
    {
        return take_lowest(*m, k);
    }
    groups.sort_by_key(|(n, m)| (Reverse(m.count_ones()), *n));
    let mut mask = 0u64;
    let mut left = k;
    for (_, m) in groups {
        let take = take_lowest(m, left.min(m.count_ones()));
        mask |= take;
        left -= take.count_ones();
        if left == 0 {
            break;
        }
    }
    mask
}

/// The `k` lowest set bits of `mask`.
fn take_lowest(mask: u64, k: u32) -> u64 {
    bits(mask).take(k as usize).fold(0u64, |m, p| m | (1u64 << p))
}
