//! The placement cost model: how long a job's collectives take per optimizer step on a given
//! placement (pure, docs/field-notes.md §1).
//!
//! Ring algorithms over `N` GPUs moving a buffer of `B` bytes at bus bandwidth `W`:
//! AllGather and ReduceScatter take `B / W * (N-1)/N`, AllReduce twice that. `W` is the peak
//! bandwidth of the slowest link class the placement uses times NCCL's efficiency at the
//! message size ([`nccl_efficiency`]): real NCCL reaches ~370-410 GB/s bus bandwidth on an
//! 8xH100 SXM node only for ~1 GB messages and ~150 GB/s for a 58 MB one.
//!
//! Checked against the field reports in docs/field-notes.md §1: nanochat d26 moves ~7.1 GB per
//! step; on SXM the model predicts ~41 ms (measured optimizer step 57.8 ms, NCCL ~49 ms per GPU),
//! on PCIe ~290 ms (375 ms), a ratio of ~7x as measured (7.3x).

use crate::links::LinkClass;

/// Node egress over the network, as bus bandwidth of collectives beyond one node: one
/// 400 Gb/s NIC per GPU over a full-bisection fat tree runs them at about node-egress speed.
pub const NETWORK_GBPS: f64 = 400.0;

/// Message size assumed when a job declares only its bytes per step: the 58 MB per NCCL call
/// measured on nanochat d26 (docs/field-notes.md §1; ZeRO-2 moves one parameter matrix per
/// call).
pub const DEFAULT_MESSAGE_BYTES: u64 = 58_000_000;

/// Peak per-GPU, per-direction bandwidth of a link class in GB/s.
///
/// - `NV#`: 25 GB/s per NVLink4 link: `NV18` (NVSwitch, SXM) 450, `NV12` (an NVL pair) 300.
/// - `PIX`/`PXB`/`PHB`: PCIe Gen5 x16, ~64 GB/s.
/// - `NODE`: PCIe across host bridges in one socket, a little below a direct PCIe path.
/// - `SYS`: PCIe plus the UPI hop between sockets (docs/field-notes.md §1: an NVL node's
///   cross-pair AllGather took 8.7 ms against 8.5 ms on PCIe, and CPU-side stalls come on top).
/// - `Network`: [`NETWORK_GBPS`]. `Unknown` is costed as `SYS`, the worst known case.
pub fn link_bandwidth_gbps(link: LinkClass) -> f64 {
    match link {
        LinkClass::Local => f64::INFINITY,
        LinkClass::NvLink(n) => 25.0 * f64::from(n),
        LinkClass::Pix | LinkClass::Pxb | LinkClass::Phb => 64.0,
        LinkClass::Node => 60.0,
        LinkClass::Sys | LinkClass::Unknown => 56.0,
        LinkClass::Network => NETWORK_GBPS,
    }
}

/// The slowest link class a placement uses: its worst link inside a node, or the network
/// when it spans nodes and the network is slower.
pub fn bottleneck(intra: LinkClass, multi_node: bool) -> LinkClass {
    if multi_node && link_bandwidth_gbps(LinkClass::Network) < link_bandwidth_gbps(intra) {
        LinkClass::Network
    } else {
        intra
    }
}

/// Half-saturation message size of the efficiency curve, in bytes.
const HALF_SATURATION_BYTES: f64 = 109e6;
/// Efficiency approached by very large messages.
const MAX_EFFICIENCY: f64 = 0.962;

/// Fraction of the link's peak that NCCL reaches for one collective of `message_bytes`:
/// `e(m) = 0.962 * m / (m + 109 MB)`, a saturation curve fitted to the two points of
/// docs/field-notes.md §1 on an 8xH100 SXM node (peak 450 GB/s): ~390 GB/s (0.87) at 1 GB and
/// ~150 GB/s (0.33) at 58 MB.
/// Small messages are latency-bound, hence the steep fall below ~100 MB.
pub fn nccl_efficiency(message_bytes: u64) -> f64 {
    let m = message_bytes as f64;
    if m <= 0.0 {
        return 0.0;
    }
    MAX_EFFICIENCY * m / (m + HALF_SATURATION_BYTES)
}

/// A collective call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    AllGather,
    ReduceScatter,
    AllReduce,
}

/// Milliseconds one ring collective over `bytes` takes on `world` GPUs whose slowest link is
/// `link`.
pub fn collective_ms(kind: Collective, bytes: u64, world: u32, link: LinkClass) -> f64 {
    if world <= 1 || bytes == 0 || link == LinkClass::Local {
        return 0.0;
    }
    let n = f64::from(world);
    let busbw = link_bandwidth_gbps(link) * 1e9 * nccl_efficiency(bytes);
    let one_pass = bytes as f64 / busbw * (n - 1.0) / n * 1e3;
    match kind {
        Collective::AllGather | Collective::ReduceScatter => one_pass,
        Collective::AllReduce => 2.0 * one_pass,
    }
}

/// Predicted collective time per optimizer step of a job that declares `bytes_per_step` of
/// collective traffic (AllGather/ReduceScatter volume, as ZeRO-2 moves it), split into calls of
/// [`DEFAULT_MESSAGE_BYTES`]. 0 when unknown (no bytes) or when there is nothing to move.
pub fn step_comm_ms(bytes_per_step: u64, world: u32, link: LinkClass) -> f64 {
    if bytes_per_step == 0 {
        return 0.0;
    }
    let calls = bytes_per_step.div_ceil(DEFAULT_MESSAGE_BYTES);
    let per_call = bytes_per_step / calls;
    calls as f64 * collective_ms(Collective::AllGather, per_call, world, link)
}

/// Tensors under this many elements are all-reduced whole instead of reduce-scattered.
pub const SMALL_TENSOR: u64 = 1024;

/// The vocabulary the built-in engine pads GPT-2's to, unless the job sets `vocab_size`.
pub const GPT2_VOCAB: u64 = 50_304;

/// The parameters of the built-in engine's GPT at `depth`, as it builds them
/// (docs/engine.md): per block the attention projections `c_q`, `c_k`, `c_v`, `c_proj`, the MLP
/// `c_fc` and `mlp_proj` and, on alternate layers, a value-embedding gate; then the token
/// embedding, the LM head, two per-layer scalar vectors and the value embeddings. `true` marks
/// the 2-D block matrices Muon updates; AdamW updates the rest.
pub fn gpt_params(depth: u64, vocab: u64) -> Vec<(Vec<u64>, bool)> {
    const HEAD_DIM: u64 = 128;
    const VE_GATE_CHANNELS: u64 = 12;
    let d = (depth * 64).div_ceil(HEAD_DIM) * HEAD_DIM;
    let heads = d / HEAD_DIM;
    let has_ve = |layer: u64| layer % 2 == (depth - 1) % 2;
    let mut params =
        vec![(vec![vocab, d], false), (vec![vocab, d], false), (vec![depth], false), (vec![depth], false)];
    for layer in 0..depth {
        params.extend([(vec![d, d], true), (vec![d, d], true), (vec![d, d], true), (vec![d, d], true)]);
        if has_ve(layer) {
            params.push((vec![heads, VE_GATE_CHANNELS], true));
        }
        params.extend([(vec![4 * d, d], true), (vec![d, 4 * d], true)]);
    }
    params.extend((0..depth).filter(|&l| has_ve(l)).map(|_| (vec![vocab, d], false)));
    params
}

/// The collective calls of one optimizer step of the built-in engine (docs/field-notes.md §6),
/// all in f32: AdamW's tensors one by one (a ReduceScatter of the gradient and an AllGather of
/// the updated shard, or one AllReduce under [`SMALL_TENSOR`] elements), and Muon's matrices
/// stacked by shape (one ReduceScatter and one AllGather per shape). Empty for exec jobs and
/// presets that do not parse.
pub fn builtin_step_calls(spec: &trainyard_model::spec::JobSpec) -> Vec<(Collective, u64)> {
    let trainyard_model::spec::Engine::Builtin { settings, .. } = &spec.engine else { return Vec::new() };
    let Some(depth) = spec.builtin_depth().filter(|d| *d > 0) else { return Vec::new() };
    let vocab = settings.get("vocab_size").and_then(|v| v.parse().ok()).unwrap_or(GPT2_VOCAB);
    let mut calls = Vec::new();
    let mut muon: std::collections::BTreeMap<Vec<u64>, u64> = std::collections::BTreeMap::new();
    for (shape, is_matrix) in gpt_params(u64::from(depth), vocab) {
        let numel: u64 = shape.iter().product();
        if is_matrix {
            *muon.entry(shape).or_default() += numel;
        } else if numel < SMALL_TENSOR {
            calls.push((Collective::AllReduce, numel * 4));
        } else {
            calls.extend([(Collective::ReduceScatter, numel * 4), (Collective::AllGather, numel * 4)]);
        }
    }
    for numel in muon.into_values() {
        calls.extend([(Collective::ReduceScatter, numel * 4), (Collective::AllGather, numel * 4)]);
    }
    calls
}

/// Predicted collective time per step of a list of calls (e.g. from [`builtin_calls`]).
pub fn calls_ms(calls: &[(Collective, u64)], world: u32, link: LinkClass) -> f64 {
    calls.iter().map(|&(kind, bytes)| collective_ms(kind, bytes, world, link)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const D26_BYTES: u64 = 7_100_000_000;

    #[test]
    fn sxm_is_about_seven_times_faster_than_pcie() {
        let sxm = step_comm_ms(D26_BYTES, 8, LinkClass::NvLink(18));
        let pcie = step_comm_ms(D26_BYTES, 8, LinkClass::Pix);
        let ratio = pcie / sxm;
        // docs/field-notes.md §1: 3.9 s vs 28.5 s of NCCL kernel time, 7.3x, in line with the ~7x
        // link-bandwidth ratio.
        assert!((6.5..7.6).contains(&ratio), "ratio {ratio}");
        // Below the measured optimizer steps (57.8 ms and 375 ms), which also hold compute.
        assert!((25.0..57.8).contains(&sxm), "sxm {sxm}");
        assert!((200.0..375.0).contains(&pcie), "pcie {pcie}");
    }

    #[test]
    fn efficiency_follows_the_measured_points() {
        let at = |bytes| link_bandwidth_gbps(LinkClass::NvLink(18)) * nccl_efficiency(bytes);
        let big = at(1_000_000_000);
        assert!((370.0..=410.0).contains(&big), "1 GB: {big} GB/s");
        let mid = at(58_000_000);
        assert!((140.0..=160.0).contains(&mid), "58 MB: {mid} GB/s");
        assert!(at(1_000_000) < 10.0, "1 MB messages are latency-bound");
    }

    #[test]
    fn ring_formulas() {
        let link = LinkClass::NvLink(18);
        let ag = collective_ms(Collective::AllGather, 1 << 30, 8, link);
        let rs = collective_ms(Collective::ReduceScatter, 1 << 30, 8, link);
        let ar = collective_ms(Collective::AllReduce, 1 << 30, 8, link);
        assert_eq!(ag, rs);
        assert!((ar - 2.0 * ag).abs() < 1e-9);
        // (N-1)/N: two GPUs move half of what eight move per byte of bandwidth.
        let two = collective_ms(Collective::AllGather, 1 << 30, 2, link);
        assert!((two / ag - (0.5 / 0.875)).abs() < 1e-9);
        assert_eq!(collective_ms(Collective::AllGather, 1 << 30, 1, link), 0.0);
        assert_eq!(step_comm_ms(0, 8, link), 0.0, "unknown bytes predict nothing");
    }

    #[test]
    fn bandwidth_is_monotone_in_link_class() {
        let order = [
            LinkClass::Sys,
            LinkClass::Node,
            LinkClass::Phb,
            LinkClass::Pxb,
            LinkClass::Pix,
            LinkClass::NvLink(4),
            LinkClass::NvLink(12),
            LinkClass::NvLink(18),
            LinkClass::Local,
        ];
        for w in order.windows(2) {
            assert!(w[0] < w[1]);
            assert!(link_bandwidth_gbps(w[0]) <= link_bandwidth_gbps(w[1]), "{w:?}");
        }
        assert_eq!(bottleneck(LinkClass::NvLink(18), true), LinkClass::Network);
        assert_eq!(bottleneck(LinkClass::Pix, true), LinkClass::Pix);
        assert_eq!(bottleneck(LinkClass::Pix, false), LinkClass::Pix);
    }

    #[test]
    fn builtin_jobs_are_costed_from_their_preset() {
        let wire = trainyard_proto::v1::JobSpec {
            name: "b".into(),
            resources: Some(trainyard_proto::v1::Resources { gpus: 8, ..Default::default() }),
            engine: Some(trainyard_proto::v1::job_spec::Engine::Builtin(
                trainyard_proto::v1::BuiltinEngine {
                    preset: "d26".into(),
                    data: "/data".into(),
                    settings: Default::default(),
                },
            )),
            ..Default::default()
        };
        let spec = trainyard_model::spec::parse(wire).unwrap();
        let calls = builtin_step_calls(&spec);
        // d26: width 1664; 26 blocks of 12 d^2, 13 VE gates, embedding, head, 13 value embeddings.
        let d = 1664u64;
        let params = 26 * 12 * d * d + 13 * 13 * 12 + 2 * 50_304 * d + 2 * 26 + 13 * 50_304 * d;
        let moved: u64 = calls.iter().filter(|c| c.0 != Collective::AllReduce).map(|c| c.1).sum();
        let reduced: u64 = calls.iter().filter(|c| c.0 == Collective::AllReduce).map(|c| c.1).sum();
        assert_eq!(moved + 2 * reduced, 2 * 4 * params, "every parameter reduced and gathered once, in f32");
        assert_eq!(
            calls.iter().filter(|c| c.0 == Collective::AllReduce).count(),
            2,
            "the two scalar vectors"
        );
        // Muon's 13 gates stack into one shape: one ReduceScatter and one AllGather for them all.
        assert!(calls.contains(&(Collective::ReduceScatter, 13 * 13 * 12 * 4)));
        let ms = calls_ms(&calls, 8, LinkClass::NvLink(18));
        assert!((20.0..200.0).contains(&ms), "d26 on SXM: {ms} ms");
        assert!(calls_ms(&calls, 8, LinkClass::Pix) > 6.0 * ms, "PCIe ~7x slower");
        let mut exec = spec.clone();
        exec.engine = trainyard_model::spec::Engine::Exec {
            argv: vec!["x".into()],
            workdir: "/".into(),
            source_dir: String::new(),
        };
        assert!(builtin_step_calls(&exec).is_empty());
    }
}
