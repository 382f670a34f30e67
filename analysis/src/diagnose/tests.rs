use super::*;
use std::collections::BTreeMap;
use trainyard_model::domain::{Cause, CheckStatus, GpuInfo, Inventory, PreflightLevel, RankState, Verdict};
use trainyard_model::records::{CheckRecord, GpuWindowRecord, PreflightRecord, RankId, RankObserved};
use trainyard_model::spec::JobSpec;

fn spec(env: &[(&str, &str)]) -> JobSpec {
    JobSpec {
        env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..JobSpec::exec("d", 16, &["x"])
    }
}

/// A node of 8 GPUs, GPU i on NUMA node `numa(i)`.
fn node(numa: impl Fn(u32) -> u32, checks: &[(&str, CheckStatus, &str)]) -> NodeFacts {
    NodeFacts {
        inventory: Inventory {
            hostname: "h".into(),
            gpus: (0..8)
                .map(|i| GpuInfo { index: i, numa_node: Some(numa(i)), ..Default::default() })
                .collect(),
            ..Default::default()
        },
        preflight: Some(PreflightRecord {
            report_id: 1,
            agent_id: String::new(),
            local_id: String::new(),
            level: PreflightLevel::Quick,
            started_at_ms: 0,
            finished_at_ms: 0,
            verdict: Verdict::Pass,
            interconnect_class: Some(trainyard_model::domain::InterconnectClass::Nvswitch),
            driver_version: String::new(),
            cuda_version: String::new(),
            nccl_version: String::new(),
            source: "host-file".into(),
            topology: String::new(),
            checks: checks
                .iter()
                .map(|(id, status, measured)| CheckRecord {
                    id: id.to_string(),
                    status: *status,
                    measured: measured.to_string(),
                    expected: String::new(),
                    remedy: String::new(),
                })
                .collect(),
            job_id: None,
            gpus: vec![],
        }),
    }
}

/// Ranks 0-7 on node "a", 8-15 on node "b", each on the GPU of its local rank.
fn allocations() -> Vec<Allocation> {
    (0..16)
        .map(|rank| Allocation {
            id: RankId { job_id: 1, attempt: 0, rank },
            agent_id: if rank < 8 { "a" } else { "b" }.into(),
            gpu_index: rank % 8,
            node_rank: rank / 8,
            local_rank: rank % 8,
            planned_cpus: String::new(),
            planned_mems: String::new(),
            observed: RankObserved { state: RankState::Exited, ..Default::default() },
        })
        .collect()
}

/// 200 steps per rank: step time `ms(rank)`, optimizer `opt(rank)`.
fn samples(ms: impl Fn(u32) -> f64, opt: impl Fn(u32) -> f64) -> Vec<StepSample> {
    (0..16)
        .flat_map(|rank| {
            let (ms, opt) = (ms(rank), opt(rank));
            (0..200).map(move |step| StepSample {
                rank,
                step,
                step_time_ms: Some(ms + (step % 3) as f64),
                optimizer_ms: Some(opt),
                tokens_per_s: Some(1e6 / ms),
                ..Default::default()
            })
        })
        .collect()
}

struct Case {
    spec: JobSpec,
    allocations: Vec<Allocation>,
    samples: Vec<StepSample>,
    nodes: BTreeMap<String, NodeFacts>,
    predicted: f64,
    windows: Vec<GpuWindowRecord>,
}

impl Case {
    fn healthy() -> Case {
        Case {
            spec: spec(&[]),
            allocations: allocations(),
            samples: samples(|_| 702.0, |_| 57.8),
            nodes: [("a".to_string(), node(|_| 0, &[])), ("b".to_string(), node(|_| 0, &[]))].into(),
            predicted: 41.0,
            windows: Vec::new(),
        }
    }

    fn run(&self) -> Diagnosis {
        diagnose(&self.input())
    }

    fn input(&self) -> Input<'_> {
        Input {
            spec: &self.spec,
            attempt: 0,
            allocations: &self.allocations,
            samples: &self.samples,
            nodes: &self.nodes,
            predicted_comm_ms: self.predicted,
            windows: &self.windows,
        }
    }
}

fn causes(d: &Diagnosis) -> Vec<Cause> {
    d.findings.iter().map(|f| f.cause).collect()
}

#[test]
fn a_healthy_run_has_no_finding_and_says_so() {
    let d = Case::healthy().run();
    assert_eq!(causes(&d), vec![], "{:#?}", d.findings);
    assert!(
        d.verdict().starts_with("healthy: no finding over 3200 step receipts of 16 rank(s)"),
        "{}",
        d.verdict()
    );
    assert_eq!(d.metric, "step_time_ms");
    assert!(d.unusable.is_empty());
    assert_eq!(d.nodes[1].vs_fastest.map(|r| (r * 100.0).round()), Some(100.0));
}

#[test]
fn a_slow_node_with_its_gpus_on_two_numa_nodes_is_a_numa_split() {
    let mut c = Case::healthy();
    c.nodes.insert(
        "b".into(),
        node(|i| i / 4, &[("numa.split", CheckStatus::Warn, "GPUs on NUMA nodes 0:4 1:4")]),
    );
    c.samples = samples(|r| if r >= 8 { 1295.0 } else { 702.0 }, |_| 57.8);
    let d = c.run();
    assert_eq!(causes(&d), vec![Cause::NumaSplit], "{:#?}", d.findings);
    let f = &d.findings[0];
    assert_eq!((f.nodes.as_slice(), f.ranks.len()), (&["b".to_string()][..], 8));
    assert!(f.summary.contains("1.84x slower") && f.summary.contains("0:4 1:4"), "{}", f.summary);
    assert!(f.expected_cost.contains("1295 ms") && f.remedy.contains("NUMA node"));
    // The same slowness on a node whose GPUs share one NUMA node is not a split: its ranks are
    // stragglers nothing explains.
    c.nodes.insert("b".into(), node(|_| 0, &[]));
    let d = c.run();
    assert_eq!(causes(&d), vec![Cause::StragglerUnexplained]);
    assert_eq!(d.findings[0].ranks, (8..16).collect::<Vec<_>>());
}

#[test]
fn shm_disabled_in_the_env_is_named_with_the_optimizer_evidence() {
    let mut c = Case::healthy();
    c.spec = spec(&[("NCCL_SHM_DISABLE", "1")]);
    c.samples = samples(|_| 818.0, |_| 173.4);
    let d = c.run();
    assert_eq!(causes(&d), vec![Cause::ShmDisabled], "{:#?}", d.findings);
    let ev = &d.findings[0].evidence;
    let get = |name: &str| ev.iter().find(|m| m.name == name).map(|m| m.value);
    assert_eq!(get("median optimizer step (collectives included)"), Some(173.4));
    assert!((get("measured over predicted").unwrap() - 173.4 / 41.0).abs() < 1e-9);
    // No fabric.fallback on top although 4.2x the prediction: the transport explains it.
    c.spec = spec(&[("NCCL_SHM_DISABLE", "0")]);
    assert_eq!(causes(&c.run()), vec![Cause::FabricFallback], "0 leaves shared memory on");
}

#[test]
fn a_node_without_dev_shm_is_shm_disabled_on_that_node() {
    let mut c = Case::healthy();
    c.nodes.insert("b".into(), node(|_| 0, &[("host.shm", CheckStatus::Fail, "64 MiB")]));
    let d = c.run();
    assert_eq!(causes(&d), vec![Cause::ShmDisabled]);
    assert_eq!(d.findings[0].nodes, vec!["b".to_string()]);
}

#[test]
fn one_rank_thirty_percent_slower_is_an_unexplained_straggler_named_by_rank() {
    let mut c = Case::healthy();
    c.samples = samples(|r| if r == 11 { 912.6 } else { 702.0 }, |_| 57.8);
    let d = c.run();
    assert_eq!(causes(&d), vec![Cause::StragglerUnexplained], "{:#?}", d.findings);
    let f = &d.findings[0];
    assert_eq!((f.ranks.as_slice(), f.nodes.as_slice()), (&[11][..], &["b".to_string()][..]));
    assert!(f.summary.contains("rank 11 on b (30% slower)"), "{}", f.summary);
    assert!(d.ranks.iter().filter(|r| r.straggler).map(|r| r.rank).eq([11]));
}

#[test]
fn compute_time_is_compared_when_every_rank_reports_it() {
    // Synchronous training: every rank's whole step is the same, the slow rank shows in fwd_bwd.
    let mut c = Case::healthy();
    for s in &mut c.samples {
        s.fwd_bwd_ms = Some(if s.rank == 3 { 850.0 } else { 640.0 });
    }
    let d = c.run();
    assert_eq!(d.metric, "fwd_bwd_ms");
    assert_eq!(causes(&d), vec![Cause::StragglerUnexplained]);
    assert_eq!(d.findings[0].ranks, vec![3]);
}

#[test]
fn collectives_far_above_the_prediction_are_a_fabric_fallback() {
    let mut c = Case::healthy();
    c.samples = samples(|_| 1411.0, |_| 375.0);
    let d = c.run();
    assert_eq!(causes(&d), vec![Cause::FabricFallback]);
    assert!(d.findings[0].summary.contains("9.1x the 41.0 ms"), "{}", d.findings[0].summary);
    c.predicted = 0.0;
    assert_eq!(causes(&c.run()), vec![], "no prediction (no comm bytes): nothing to compare");
}

#[test]
fn binding_refused_p2p_connections_and_cpu_starvation() {
    let mut c = Case::healthy();
    c.allocations[9].planned_cpus = "8-15".into();
    c.allocations[9].planned_mems = "1".into();
    c.allocations[9].observed.effective_cpus = "0-63".into();
    c.allocations[9].observed.effective_mems = "0-1".into();
    c.allocations[10].planned_cpus = "16-23".into();
    c.allocations[10].observed.effective_cpus = "16,17,18,19,20,21,22,23".into();
    c.spec = spec(&[("NCCL_P2P_DISABLE", "1"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1")]);
    c.nodes.insert(
        "b".into(),
        node(|_| 0, &[("numa.cpus_per_gpu", CheckStatus::Warn, "2 CPUs per GPU on NUMA node 0")]),
    );
    c.samples = samples(|r| if r >= 8 { 1000.0 } else { 702.0 }, |_| 57.8);
    let d = c.run();
    assert_eq!(
        causes(&d),
        vec![
            Cause::NumaBindingRefused,
            Cause::CpuStarved,
            Cause::P2pDisabled,
            Cause::CudaDeviceMaxConnections
        ],
        "{:#?}",
        d.findings
    );
    assert_eq!(d.findings[0].ranks, vec![9], "the same CPUs written another way are the plan");
    assert!(
        d.verdict().starts_with("numa.binding_refused:") && d.verdict().ends_with("(and 3 more finding(s))")
    );
    // The same refused binding on nodes that all keep pace explains nothing: a note.
    c.samples = samples(|_| 702.0, |_| 57.8);
    c.spec = spec(&[]);
    let d = c.run();
    assert!(!causes(&d).contains(&Cause::NumaBindingRefused), "{:#?}", d.findings);
    assert!(
        d.notes.iter().any(|n| n.contains("rank 9: planned CPUs 8-15") && n.contains("not a cause")),
        "{:?}",
        d.notes
    );
}

#[test]
fn bad_receipts_are_reported_as_unusable_and_nothing_breaks() {
    let mut c = Case::healthy();
    for s in c.samples.iter_mut().filter(|s| s.rank == 2 && s.step % 2 == 0) {
        s.step_time_ms = None;
        s.flagged = true;
    }
    c.samples.push(StepSample { rank: 4, step: 7, step_time_ms: Some(f64::NAN), ..Default::default() });
    c.samples.push(StepSample { rank: 4, step: 8, step_time_ms: Some(-3.0), ..Default::default() });
    c.samples.push(StepSample { rank: 4, step: -1, step_time_ms: Some(5.0), ..Default::default() });
    c.allocations[5].observed.skipped_lines = 3;
    c.samples.retain(|s| s.rank != 15);
    let d = c.run();
    assert_eq!(causes(&d), vec![]);
    let text = d.unusable.join("\n");
    for needle in [
        "rank 2: 100 step receipt(s) without a usable step_time_ms",
        "rank 2: 100 step receipt(s) break receipt schema v1",
        "rank 4: 3 step receipt(s) without a usable step_time_ms",
        "rank 5: 3 line(s) of its receipts file were not JSON objects",
        "rank 15 on b: no step receipts",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
    // Nothing at all: no panic, no finding, and the verdict says there is nothing to judge.
    c.samples.clear();
    let d = c.run();
    assert_eq!((causes(&d), d.verdict()), (vec![], "no step receipts to judge yet".to_string()));
}

/// Windows of 10 steps for every rank's GPU over 200 steps; `tweak(rank, window)` changes one.
fn windows(tweak: impl Fn(u32, i64, &mut GpuWindowRecord)) -> Vec<GpuWindowRecord> {
    let mut out = Vec::new();
    for rank in 0..16u32 {
        for w in 0..20i64 {
            let mut g = GpuWindowRecord {
                agent_id: if rank < 8 { "a" } else { "b" }.into(),
                gpu: rank % 8,
                start_ms: w * 10_000,
                end_ms: (w + 1) * 10_000,
                samples: 10,
                sm_clock_mean: Some(1_980.0),
                sm_clock_min: Some(1_980.0),
                sm_clock_limit: 1_980.0,
                util_mean: Some(100.0),
                pcie_gen: 5,
                pcie_gen_max: 5,
                pcie_width: 16,
                pcie_width_max: 16,
                nvlinks_up: 18,
                nvlinks_total: 18,
                job_id: Some(1),
                attempt: Some(0),
                rank: Some(rank),
                first_step: Some(w * 10),
                last_step: Some(w * 10 + 9),
                ..Default::default()
            };
            tweak(rank, w, &mut g);
            out.push(g);
        }
    }
    out
}

fn thermal(g: &mut GpuWindowRecord) {
    g.clock_reasons = trainyard_proto::telemetry::HW_THERMAL.bit;
    g.sm_clock_mean = Some(1_100.0);
    g.sm_clock_min = Some(1_050.0);
    g.gpu_temp_max = Some(92.0);
}

#[test]
fn a_throttle_that_slows_its_rank_is_named_with_node_gpu_and_rank() {
    let mut case = Case::healthy();
    // Rank 11 (node b, GPU 3) runs 1.8x slower from step 100, when its GPU starts throttling.
    case.samples = samples(|_| 702.0, |_| 57.8);
    for s in case.samples.iter_mut().filter(|s| s.rank == 11 && s.step >= 100) {
        s.step_time_ms = s.step_time_ms.map(|t| t * 1.8);
    }
    case.windows = windows(|rank, w, g| {
        if rank == 11 && w >= 10 {
            thermal(g);
        }
    });
    let d = case.run();
    assert_eq!(causes(&d), vec![Cause::GpuThermalThrottle], "{:#?}", d.findings);
    let f = &d.findings[0];
    assert_eq!(
        (f.nodes.clone(), f.ranks.clone(), f.subject.as_str()),
        (vec!["b".to_string()], vec![11], "b/gpu3")
    );
    assert!(
        f.summary.contains("hw_thermal_slowdown") && f.summary.contains("from step 100"),
        "{}",
        f.summary
    );
    assert!(f.summary.contains("1.80x"), "{}", f.summary);
    assert_eq!(f.steps, Some((100, 199)), "the steps of the throttled windows: a plot's band");
    assert!(d.verdict().starts_with("gpu.thermal_throttle"), "{}", d.verdict());
}

#[test]
fn a_throttle_on_a_gpu_whose_rank_keeps_pace_is_telemetry_not_the_verdict() {
    let mut case = Case::healthy();
    case.windows = windows(|rank, w, g| {
        if rank == 4 && w >= 5 {
            g.clock_reasons = trainyard_proto::telemetry::SW_POWER_CAP.bit;
        }
    });
    let d = case.run();
    assert_eq!(causes(&d), vec![], "{:#?}", d.findings);
    assert_eq!(d.notes.len(), 1, "{:?}", d.notes);
    assert!(d.notes[0].contains("GPU 4 of a") && d.notes[0].contains("sw_power_cap"), "{}", d.notes[0]);
    assert!(d.notes[0].contains("ran at the job's pace"), "{}", d.notes[0]);
}

#[test]
fn a_condition_every_fast_gpu_shares_is_not_the_cause() {
    let mut case = Case::healthy();
    case.samples = samples(|r| if r == 5 { 950.0 } else { 702.0 }, |_| 57.8);
    // Every GPU downtrained its PCIe link; only rank 5 is slow: the link is not why.
    case.windows = windows(|_, _, g| g.pcie_gen = 3);
    let d = case.run();
    assert_eq!(causes(&d), vec![Cause::StragglerUnexplained], "{:#?}", d.findings);
    assert_eq!(d.findings[0].ranks, vec![5]);
    assert!(d.notes.iter().any(|n| n.contains("GPU 5 of a") && n.contains("show it too")), "{:?}", d.notes);
}

#[test]
fn health_problems_are_findings_whatever_the_pace() {
    let mut case = Case::healthy();
    case.windows = windows(|rank, w, g| {
        if rank == 2 && w == 7 {
            g.xids = vec![79];
        }
        if rank == 9 {
            g.remap_pending = true;
        }
        if rank == 12 && w == 3 {
            g.ecc_uncorrected = 1;
        }
    });
    let d = case.run();
    assert_eq!(
        causes(&d),
        vec![Cause::GpuXid, Cause::GpuRowRemapPending, Cause::GpuEcc],
        "{:#?}",
        d.findings
    );
    let xid = &d.findings[0];
    assert!(xid.summary.contains("XID 79 (GPU has fallen off the bus"), "{}", xid.summary);
    assert!(xid.remedy.starts_with("drain a"), "{}", xid.remedy);
    assert_eq!(xid.subject, "a/gpu2");
    assert_eq!(xid.steps, Some((70, 79)), "the window of the XID");
}

#[test]
fn a_numa_split_the_fast_nodes_share_is_noted_not_blamed() {
    let mut case = Case::healthy();
    case.samples = samples(|r| if r >= 8 { 1_295.0 } else { 702.0 }, |_| 57.8);
    case.nodes = [("a".to_string(), node(|i| i / 4, &[])), ("b".to_string(), node(|i| i / 4, &[]))].into();
    let d = case.run();
    assert!(!causes(&d).contains(&Cause::NumaSplit), "{:#?}", d.findings);
    assert!(
        d.notes.iter().any(|n| n.starts_with("b: the job's GPUs sit on NUMA nodes 0:4 1:4")),
        "{:?}",
        d.notes
    );
}

/// The noise target: 16 ranks, 240 steps, lognormal step times (sigma 0.15) and a 4x
/// spike on a random rank about every 40 steps, with healthy telemetry: no finding at all.
#[test]
fn a_healthy_noisy_run_has_no_finding() {
    for seed in 1..=20u64 {
        let mut noise = trainyard_testkit::noise::Noise::new(0x9E37_79B9_7F4A_7C15 ^ seed);
        let mut samples = Vec::new();
        for step in 0..240i64 {
            let spike_rank = (step % 40 == 17).then(|| (noise.uniform() * 16.0) as u32);
            for rank in 0..16u32 {
                let mut t = 702.0 * (0.15 * noise.normal()).exp();
                if spike_rank == Some(rank) {
                    t *= 4.0;
                }
                samples.push(StepSample {
                    rank,
                    step,
                    step_time_ms: Some(t),
                    optimizer_ms: Some(57.8),
                    tokens_per_s: Some(1e6 / t),
                    ..Default::default()
                });
            }
        }
        let mut case = Case::healthy();
        case.samples = samples;
        case.windows = windows(|_, _, _| {});
        case.windows.extend(windows(|_, w, g| {
            g.first_step = Some(200 + w * 2);
            g.last_step = Some(201 + w * 2);
            g.start_ms += 200_000;
        }));
        let d = case.run();
        assert_eq!(causes(&d), vec![], "seed {seed}: {:#?}", d.findings);
        assert!(d.notes.is_empty(), "seed {seed}: {:?}", d.notes);
        // The live path: the same run fed to the rolling data 10 steps a round (as a 10-s round
        // of 1-s steps would), judged and tracked each round, opens nothing either.
        let mut rolling = super::live::Rolling::default();
        let mut tracker = super::live::Tracker::default();
        rolling.add_windows(case.windows.iter().cloned());
        for round in 0..24i64 {
            let new = case.samples.iter().filter(|s| s.step / 10 == round).copied();
            rolling.add_samples(new.collect::<Vec<_>>());
            let live = rolling.judge(&Input { samples: &[], windows: &[], ..case.input() });
            let opened = tracker.round(live.findings).opened;
            assert!(opened.is_empty(), "seed {seed}, round {round}: {opened:#?}");
        }
    }
}

#[test]
fn a_slow_node_nothing_explains_is_still_named_with_its_slowdown() {
    let mut case = Case::healthy();
    // Node b's ranks all run 1.3x slower; its GPUs share one NUMA node and nothing is wrong
    // that the diagnosis can see.
    case.samples = samples(|r| if r >= 8 { 913.0 } else { 702.0 }, |_| 57.8);
    let d = case.run();
    assert_eq!(causes(&d), vec![Cause::StragglerUnexplained], "{:#?}", d.findings);
    let f = &d.findings[0];
    assert_eq!(f.nodes, vec!["b".to_string()]);
    assert_eq!(f.ranks, (8..16).collect::<Vec<u32>>());
    assert!(f.summary.contains("b runs 1.30x slower than the fastest node"), "{}", f.summary);
    assert!(
        f.evidence.iter().any(|m| m.name == "slowdown" && (m.value - 1.3).abs() < 0.01),
        "{:?}",
        f.evidence
    );
}

#[test]
fn cpu_starvation_every_node_shares_is_noted_not_blamed() {
    let mut case = Case::healthy();
    case.samples = samples(|r| if r >= 8 { 1_200.0 } else { 702.0 }, |_| 57.8);
    let starved = [("numa.cpus_per_gpu", CheckStatus::Warn, "2 CPUs per GPU")];
    case.nodes = [("a".to_string(), node(|_| 0, &starved)), ("b".to_string(), node(|_| 0, &starved))].into();
    let d = case.run();
    assert!(!causes(&d).contains(&Cause::CpuStarved), "{:#?}", d.findings);
    assert!(d.notes.iter().any(|n| n.starts_with("b: its preflight found 2 CPUs per GPU")), "{:?}", d.notes);
}

#[test]
fn nvlinks_down_on_a_slow_ranks_gpu_name_the_links() {
    let mut case = Case::healthy();
    case.samples = samples(|_| 702.0, |_| 57.8);
    for s in case.samples.iter_mut().filter(|s| s.rank == 6 && s.step >= 50) {
        s.step_time_ms = s.step_time_ms.map(|t| t * 1.5);
    }
    case.windows = windows(|rank, w, g| {
        if rank == 6 && w >= 5 {
            g.nvlinks_up = 16;
            g.nvlink_detail = "link 16 down; link 17 down".into();
        }
    });
    let d = case.run();
    assert_eq!(causes(&d), vec![Cause::NvlinkDown], "{:#?}", d.findings);
    assert!(
        d.findings[0].summary.contains("16 of 18 NVLinks up (link 16 down; link 17 down)"),
        "{}",
        d.findings[0].summary
    );
}
