//! One cell of the `nvidia-smi topo -m` matrix.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

/// The path between two devices, ordered from best (`X`, the device itself) to worst (`SYS`).
///
/// `NV#` with more links is better than with fewer; any NVLink beats any PCIe path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// The device itself.
    X,
    /// A bonded set of this many NVLinks.
    Nv(u32),
    /// At most one PCIe bridge.
    Pix,
    /// Several PCIe bridges, no host bridge.
    Pxb,
    /// Through a PCIe host bridge (the CPU).
    Phb,
    /// Across host bridges inside one NUMA node.
    Node,
    /// Across the SMP interconnect between NUMA nodes (UPI/QPI).
    Sys,
}

impl Link {
    /// The number of NVLinks, when the path is NVLink.
    pub fn nvlinks(self) -> Option<u32> {
        match self {
            Link::Nv(n) => Some(n),
            _ => None,
        }
    }

    /// Position in the best-to-worst order; NVLink counts break ties inside `NV#`.
    fn rank(self) -> (u8, std::cmp::Reverse<u32>) {
        let (class, count) = match self {
            Link::X => (0, 0),
            Link::Nv(n) => (1, n),
            Link::Pix => (2, 0),
            Link::Pxb => (3, 0),
            Link::Phb => (4, 0),
            Link::Node => (5, 0),
            Link::Sys => (6, 0),
        };
        (class, std::cmp::Reverse(count))
    }
}

impl Ord for Link {
    fn cmp(&self, other: &Self) -> Ordering {
        self.rank().cmp(&other.rank())
    }
}

impl PartialOrd for Link {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Link::X => f.write_str("X"),
            Link::Nv(n) => write!(f, "NV{n}"),
            Link::Pix => f.write_str("PIX"),
            Link::Pxb => f.write_str("PXB"),
            Link::Phb => f.write_str("PHB"),
            Link::Node => f.write_str("NODE"),
            Link::Sys => f.write_str("SYS"),
        }
    }
}

impl FromStr for Link {
    type Err = String;

    /// Accepts the codes `nvidia-smi topo -m` prints, and `SOC` (its older name for `SYS`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let code = s.trim();
        let link = match code {
            "X" => Link::X,
            "PIX" => Link::Pix,
            "PXB" => Link::Pxb,
            "PHB" => Link::Phb,
            "NODE" => Link::Node,
            "SYS" | "SOC" => Link::Sys,
            _ => match code.strip_prefix("NV").map(str::parse::<u32>) {
                Some(Ok(n)) if n > 0 => Link::Nv(n),
                _ => {
                    return Err(format!("{code:?} is not a link code (X, NV#, PIX, PXB, PHB, NODE, SYS)"));
                }
            },
        };
        Ok(link)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_best_to_worst() {
        let mut links: Vec<Link> = ["SYS", "PIX", "NV12", "X", "NODE", "NV18", "PHB", "PXB"]
            .iter()
            .map(|c| c.parse().unwrap())
            .collect();
        links.sort();
        let codes: Vec<String> = links.iter().map(Link::to_string).collect();
        assert_eq!(codes, ["X", "NV18", "NV12", "PIX", "PXB", "PHB", "NODE", "SYS"]);
    }

    #[test]
    fn codes_round_trip_and_bad_codes_are_refused() {
        for code in ["X", "NV4", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"] {
            assert_eq!(code.parse::<Link>().unwrap().to_string(), code);
        }
        assert_eq!(" X ".parse::<Link>().unwrap(), Link::X);
        assert_eq!("SOC".parse::<Link>().unwrap(), Link::Sys);
        for bad in ["NV", "NV0", "NVx", "PCI", ""] {
            assert!(bad.parse::<Link>().is_err(), "{bad}");
        }
    }
}
