//! Values the contract defines beyond the message types, shared by both ends of the wire so
//! that they cannot drift apart: the names of the rank environment, the kernel's CPU list
//! format used by `NumaNode.cpus` and `RankAssignment.cpus`, and the metadata entry in which a
//! follower of a controller group names its leader.

/// The metadata entry of a follower's `UNAVAILABLE` refusal (a write, an agent's stream) that
/// holds the leader's gRPC address, `host:port`; agents dial it next (docs/ha.md).
pub const LEADER_METADATA: &str = "trainyard-leader";

/// The URL of a leader named by its address (`host:port`, as [`LEADER_METADATA`] and
/// `LeaderReply.leader_address` give it), in the scheme of the URL of the follower that named it.
pub fn leader_url(follower_url: &str, address: &str) -> String {
    let scheme = follower_url.split_once("://").map_or("http", |(s, _)| s);
    format!("{scheme}://{}", address.trim_end_matches('/'))
}

/// A controller URL's host and port when the host is a name to resolve (not an IP literal) and
/// the port is explicit: `https://controllers.example:7070` gives `("controllers.example",
/// 7070)`. Such a name may stand for every controller of a group.
pub fn dns_name(url: &str) -> Option<(&str, u16)> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    if authority.starts_with('[') {
        return None;
    }
    let (host, port) = authority.rsplit_once(':')?;
    if host.is_empty() || host.parse::<std::net::IpAddr>().is_ok() {
        return None;
    }
    Some((host, port.parse().ok()?))
}

/// The URLs to dial for `url` whose name resolved to `addrs`: one per distinct address, in the
/// URL's scheme (IPv6 in brackets). A TLS client keeps checking the certificate against the
/// name (the controller's certificate names it, not each address).
pub fn expand_url(url: &str, addrs: &[std::net::SocketAddr]) -> Vec<String> {
    let scheme = url.split_once("://").map_or("http", |(s, _)| s);
    let mut out: Vec<String> = Vec::new();
    for a in addrs {
        let u = format!("{scheme}://{a}");
        if !out.contains(&u) {
            out.push(u);
        }
    }
    out
}

/// Variables trainyard sets for every rank (torchrun's, then trainyard's own); a job's
/// environment overlay may not redefine them. `TRAINYARD_CPUS` / `TRAINYARD_MEMS` are set only
/// when the rank is pinned, `CUDA_VISIBLE_DEVICES` only when the job holds part of a host.
/// docs/internals.md has the table of their meanings next to torchrun's.
pub const RANK_ENV: [&str; 34] = [
    // torchrun (torch.distributed.elastic's local agent) gives its workers these.
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    // The device rule: cuda:LOCAL_RANK is the rank's allocated GPU.
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    // trainyard's own.
    "NODE_RANK",
    "TRAINYARD_JOB_ID",
    "TRAINYARD_ATTEMPT",
    "TRAINYARD_RECEIPTS",
    "TRAINYARD_GPU",
    "TRAINYARD_GPU_UUID",
    "TRAINYARD_GPU_PCI_BUS_ID",
    "TRAINYARD_RESUME",
    // Where to resume from: the step and path of the newest checkpoint every rank of an earlier
    // attempt reported and whose path exists on this host (empty when there is none).
    "TRAINYARD_RESUME_STEP",
    "TRAINYARD_RESUME_PATH",
    // The shim's: the resume candidates it chooses from as the job's user (never the rank's).
    "TRAINYARD_RESUME_CANDIDATES",
    // A file the agent writes (and rewrites) when the rank should checkpoint now: a drain or a
    // preemption notice. A rank checkpoints at the end of its step when its modification time
    // moves.
    "TRAINYARD_CHECKPOINT_REQUEST",
    "TRAINYARD_CPUS",
    "TRAINYARD_MEMS",
    // Provenance for receipt helpers: the overlay names that reached the rank, and the directory
    // whose git revision the launch receipt records.
    "TRAINYARD_ENV_OVERLAY",
    "TRAINYARD_SOURCE_DIR",
    "TRAINYARD_PREFLIGHT_REPORT",
];

/// The kernel's CPU list format (`0-3,8,10-11`), as in `/sys/devices/system/node/node0/cpulist`
/// and `Cpus_allowed_list`.
pub mod cpulist {
    /// Longest range accepted, so a typo like `0-4000000000` cannot exhaust memory.
    const MAX_RANGE: u32 = 65_536;

    /// Parses a CPU list into sorted, distinct CPU ids. An empty list, a backwards range or a
    /// part that is not a number is an error that quotes the part.
    pub fn parse(text: &str) -> Result<Vec<u32>, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("empty CPU list".to_string());
        }
        let mut cpus = Vec::new();
        for part in text.split(',').map(str::trim) {
            let number = |s: &str| {
                s.trim().parse::<u32>().map_err(|_| format!("{part:?} is not a CPU id or range like \"0-3\""))
            };
            match part.split_once('-') {
                Some((lo, hi)) => {
                    let (lo, hi) = (number(lo)?, number(hi)?);
                    if lo > hi {
                        return Err(format!("range {part:?} runs backwards"));
                    }
                    if hi - lo > MAX_RANGE {
                        return Err(format!("range {part:?} is longer than {MAX_RANGE} CPUs"));
                    }
                    cpus.extend(lo..=hi);
                }
                None => cpus.push(number(part)?),
            }
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(cpus)
    }

    /// Formats sorted ids in the same format: `[0, 1, 2, 5]` -> `0-2,5`.
    pub fn format(ids: &[u32]) -> String {
        let mut out: Vec<String> = Vec::new();
        let mut i = 0;
        while i < ids.len() {
            let mut j = i;
            while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
                j += 1;
            }
            out.push(if j > i { format!("{}-{}", ids[i], ids[j]) } else { ids[i].to_string() });
            i = j + 1;
        }
        out.join(",")
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn round_trips() {
            assert_eq!(parse("0-3,8, 10-11\n").unwrap(), vec![0, 1, 2, 3, 8, 10, 11]);
            assert_eq!(format(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
            assert_eq!(parse("5,5,4").unwrap(), vec![4, 5]);
            assert_eq!(format(&[]), "");
        }

        #[test]
        fn bad_lists_say_what_is_wrong() {
            assert!(parse("3-1").unwrap_err().contains("backwards"));
            assert!(parse("x").unwrap_err().contains("\"x\""));
            assert!(parse("").unwrap_err().contains("empty"));
            assert!(parse("0-4000000").unwrap_err().contains("longer"));
        }

        mod props {
            use proptest::prelude::*;

            use super::super::*;

            proptest! {
                #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

                /// Any text (a host file's or a kernel's CPU list): ids or an error, never a panic.
                #[test]
                fn any_text_is_a_cpu_list_or_an_error(text in "[0-9,\\- x\n]{0,40}|(?s).{0,40}") {
                    if let Ok(ids) = parse(&text) {
                        prop_assert!(ids.windows(2).all(|w| w[0] < w[1]), "sorted and distinct");
                    }
                }

                /// Formatting any set of CPUs reads back the same set.
                #[test]
                fn format_then_parse_is_the_identity(mut ids in proptest::collection::vec(0u32..4096, 1..64)) {
                    ids.sort_unstable();
                    ids.dedup();
                    prop_assert_eq!(parse(&format(&ids)).unwrap(), ids);
                }
            }
        }
    }
}
