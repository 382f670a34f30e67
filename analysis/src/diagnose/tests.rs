use super::*;
use trainyard_model::domain::{GpuInfo, PreflightLevel, RankState, Verdict};
use trainyard_model::records::{CheckRecord, RankId, RankObserved};
use trainyard_model::spec::{Engine, Resources};

fn spec(env: &[(&str, &str)]) -> JobSpec {
    JobSpec {
        name: "d".into(),
        resources: Resources { gpus: 16, ..Default::default() },
        engine: Engine::Exec { argv: vec!["x".into()], workdir: "/".into(), source_dir: String::new() },
        env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        preflight: PreflightLevel::None,
        max_restarts: 0,
        resume: false,
        backoff: Default::default(),
        hang: Default::default(),
        checkpoint_signal: String::new(),
        min_gpus: 0,
        priority: 0,
        disable_pinning: false,
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
}

impl Case {
    fn healthy() -> Case {
        Case {
            spec: spec(&[]),
            allocations: allocations(),
            samples: samples(|_| 702.0, |_| 57.8),
            nodes: [("a".to_string(), node(|_| 0, &[])), ("b".to_string(), node(|_| 0, &[]))].into(),
            predicted: 41.0,
        }
    }

    fn run(&self) -> Diagnosis {
        diagnose(&Input {
            spec: &self.spec,
            attempt: 0,
            allocations: &self.allocations,
            samples: &self.samples,
            nodes: &self.nodes,
            predicted_comm_ms: self.predicted,
        })
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
