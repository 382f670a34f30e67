//! The spec's rules, one test per field family.
use super::*;
use trainyard_proto::v1::{BuiltinEngine, ExecEngine, JobSpec, Resources, job_spec::Engine};

#[test]
fn parse_keeps_every_field_and_the_wire_form_round_trips() {
    let mut wire = good();
    wire.env.insert("NCCL_DEBUG".into(), "WARN".into());
    wire.priority = -3;
    wire.restart = Some(trainyard_proto::v1::RestartPolicy {
        max_restarts: 2,
        resume: true,
        backoff_initial_s: 1.0,
        backoff_factor: 2.0,
        backoff_cap_s: 60.0,
        hang_timeout_s: 300.0,
        hang_factor: 10.0,
        checkpoint_signal: "SIGUSR1".into(),
        min_gpus: 8,
        host_wait_s: Some(240.0),
    });
    wire.resources.as_mut().unwrap().interconnect = "nvlink-pairs".into();
    let spec = parse(wire.clone()).unwrap();
    assert_eq!(spec.preflight, PreflightLevel::Quick);
    assert_eq!(spec.resources.interconnect, Some(InterconnectClass::NvlinkPairs));
    assert_eq!((spec.max_restarts, spec.resume, spec.priority), (2, true, -3));
    assert_eq!(WireSpec::from(&spec), wire);
    assert_eq!(super::JobSpec::try_from(WireSpec::from(&spec)), Ok(spec));
    // Empty words are the defaults, spelled out on the way back.
    wire.preflight.clear();
    wire.resources.as_mut().unwrap().interconnect.clear();
    let spec = parse(wire).unwrap();
    assert_eq!((spec.preflight, spec.resources.interconnect), (PreflightLevel::None, None));
    let back = WireSpec::from(&spec);
    assert_eq!((back.preflight.as_str(), back.resources.unwrap().interconnect.as_str()), ("none", "any"));
}

fn good() -> JobSpec {
    JobSpec {
        name: "demo".into(),
        resources: Some(Resources { gpus: 16, gpus_per_node: 8, ..Default::default() }),
        engine: Some(Engine::Exec(ExecEngine {
            argv: vec!["python3".into(), "rank.py".into()],
            workdir: "/srv/run".into(),
            source_dir: String::new(),
        })),
        preflight: "quick".into(),
        ..Default::default()
    }
}

fn field_of(spec: &JobSpec) -> String {
    validate(spec).expect_err("spec should be rejected").field
}

/// Every size limit of a spec: at the limit it passes, one above it is refused naming the
/// field and the limit.
#[test]
fn every_size_limit_holds_at_its_value_and_refuses_one_more() {
    type Edit = fn(&mut JobSpec, usize);
    fn exec(spec: &mut JobSpec) -> &mut ExecEngine {
        match spec.engine.as_mut() {
            Some(Engine::Exec(e)) => e,
            _ => unreachable!("good() is an exec spec"),
        }
    }
    fn builtin(spec: &mut JobSpec) -> &mut BuiltinEngine {
        if !matches!(spec.engine, Some(Engine::Builtin(_))) {
            spec.engine = Some(Engine::Builtin(BuiltinEngine {
                preset: "d4".into(),
                data: "/d".into(),
                settings: Default::default(),
            }));
        }
        match spec.engine.as_mut() {
            Some(Engine::Builtin(b)) => b,
            _ => unreachable!(),
        }
    }
    let path = |n: usize| format!("/{}", "p".repeat(n - 1));
    let cases: Vec<(&str, usize, Edit)> = vec![
        ("name", MAX_NAME_LEN, |s, n| s.name = "n".repeat(n)),
        ("resources.gpu_model", MAX_SHORT_STRING_BYTES, |s, n| {
            s.resources.as_mut().unwrap().gpu_model = "m".repeat(n)
        }),
        ("engine.argv", MAX_ARGV_ITEMS, |s, n| exec(s).argv = vec!["a".into(); n]),
        ("engine.argv", MAX_ARGV_BYTES, |s, n| exec(s).argv = vec!["a".repeat(n)]),
        ("engine.workdir", MAX_PATH_BYTES, |s, n| exec(s).workdir = format!("/{}", "w".repeat(n - 1))),
        ("engine.source_dir", MAX_PATH_BYTES, |s, n| exec(s).source_dir = format!("/{}", "s".repeat(n - 1))),
        ("engine.data", MAX_PATH_BYTES, |s, n| builtin(s).data = format!("/{}", "d".repeat(n - 1))),
        ("engine.settings", MAX_SETTINGS, |s, n| {
            builtin(s).settings = (0..n).map(|i| (format!("k{i}"), "1".to_string())).collect()
        }),
        ("engine.settings", MAX_SETTINGS_BYTES, |s, n| {
            builtin(s).settings = [("k".to_string(), "v".repeat(n - 1))].into_iter().collect()
        }),
        ("env", MAX_ENV_VARS, |s, n| s.env = (0..n).map(|i| (format!("V{i}"), String::new())).collect()),
        ("env", MAX_ENV_BYTES, |s, n| s.env = [("V".to_string(), "x".repeat(n - 1))].into_iter().collect()),
    ];
    for (field, limit, edit) in cases {
        let mut at = good();
        edit(&mut at, limit);
        assert_eq!(validate(&at), Ok(()), "{field} at its limit {limit}");
        let mut over = good();
        edit(&mut over, limit + 1);
        let err = validate(&over).expect_err("one over the limit");
        assert_eq!(err.field, field, "{err}");
        assert!(err.reason.contains(&limit.to_string()), "{field}: {err}");
    }
    // The whole spec, encoded, is checked first, before any field is looked at: every field
    // at its limit together still fits; a larger one is refused whole.
    let mut all = good();
    exec(&mut all).argv = vec!["a".repeat(MAX_ARGV_BYTES)];
    all.env = [("V".to_string(), "x".repeat(MAX_ENV_BYTES - 1))].into_iter().collect();
    exec(&mut all).workdir = path(MAX_PATH_BYTES);
    exec(&mut all).source_dir = path(MAX_PATH_BYTES);
    assert_eq!(validate(&all), Ok(()));
    // So every launch of an accepted spec reaches its agents: the largest spec with a rank
    // map of 1,024 ranks on one host is far under the agent stream's message limit.
    let rank = trainyard_proto::v1::RankAssignment { cpus: "0-1023".repeat(8), ..Default::default() };
    let mut max = good();
    huge_spec_at_the_limit(&mut max);
    let launch =
        trainyard_proto::v1::Launch { spec: Some(max), ranks: vec![rank; 1024], ..Default::default() };
    let encoded = prost::Message::encoded_len(&launch);
    assert!(encoded < trainyard_proto::limits::MAX_AGENT_MESSAGE_BYTES / 4, "{encoded} bytes");
    let mut huge = good();
    huge.env = [("V".to_string(), "x".repeat(MAX_SPEC_BYTES))].into_iter().collect();
    assert_eq!(validate(&huge).unwrap_err().field, "spec");
}

/// A spec whose environment fills the whole encoded limit.
fn huge_spec_at_the_limit(spec: &mut JobSpec) {
    let room = MAX_SPEC_BYTES - prost::Message::encoded_len(spec) - 16;
    spec.env = [("V".to_string(), "x".repeat(room))].into_iter().collect();
    assert!(prost::Message::encoded_len(spec) <= MAX_SPEC_BYTES);
}

#[test]
fn a_good_spec_passes() {
    assert_eq!(validate(&good()), Ok(()));
}

#[test]
fn zero_gpus_is_rejected() {
    let mut spec = good();
    spec.resources.as_mut().unwrap().gpus = 0;
    assert_eq!(field_of(&spec), "resources.gpus");
}

#[test]
fn uneven_split_is_rejected() {
    let mut spec = good();
    spec.resources.as_mut().unwrap().gpus = 12;
    assert_eq!(field_of(&spec), "resources.gpus_per_node");
}

#[test]
fn relative_workdir_is_rejected() {
    let mut spec = good();
    if let Some(Engine::Exec(exec)) = spec.engine.as_mut() {
        exec.workdir = "runs/demo".into();
    }
    let err = validate(&spec).unwrap_err();
    assert_eq!(err.field, "engine.workdir");
    assert!(err.reason.contains("relative"), "{err}");
}

#[test]
fn bad_env_names_are_rejected() {
    for name in ["1ABC", "FOO BAR", "", "A-B", "RANK"] {
        let mut spec = good();
        spec.env.insert(name.into(), "x".into());
        assert_eq!(field_of(&spec), format!("env.{name}"), "name {name:?}");
    }
}

#[test]
fn empty_argv_and_missing_engine_are_rejected() {
    let mut spec = good();
    spec.engine = Some(Engine::Exec(ExecEngine { workdir: "/x".into(), ..Default::default() }));
    assert_eq!(field_of(&spec), "engine.argv");
    spec.engine = None;
    assert_eq!(field_of(&spec), "engine");
    spec.engine = Some(Engine::Builtin(BuiltinEngine::default()));
    assert_eq!(field_of(&spec), "engine.preset");
    let mut b = BuiltinEngine { preset: "d4".into(), data: "/data/shards".into(), ..Default::default() };
    spec.engine = Some(Engine::Builtin(b.clone()));
    assert!(validate(&spec).is_ok());
    b.preset = "d0".into();
    spec.engine = Some(Engine::Builtin(b.clone()));
    assert_eq!(field_of(&spec), "engine.preset");
    b.preset = "d4".into();
    b.data = "shards".into();
    spec.engine = Some(Engine::Builtin(b));
    assert_eq!(field_of(&spec), "engine.data");
}

#[test]
fn unknown_levels_are_rejected() {
    let mut spec = good();
    spec.preflight = "thorough".into();
    assert_eq!(field_of(&spec), "preflight");
    let mut spec = good();
    spec.resources.as_mut().unwrap().interconnect = "infiniband".into();
    assert_eq!(field_of(&spec), "resources.interconnect");
}

#[test]
fn env_names_follow_posix() {
    assert!(is_env_name("NCCL_DEBUG"));
    assert!(is_env_name("_x1"));
    assert!(!is_env_name("9x"));
    assert!(!is_env_name("x.y"));
}

#[test]
fn min_gpus_must_fit_the_job_and_its_nodes() {
    let with = |min: u32| {
        let mut w = good();
        w.restart = Some(trainyard_proto::v1::RestartPolicy { min_gpus: min, ..Default::default() });
        parse(w)
    };
    assert_eq!(with(8).map(|s| s.min_gpus), Ok(8));
    let e = with(32).unwrap_err();
    assert_eq!(e.field, "restart.min_gpus");
    assert!(e.reason.contains("more than resources.gpus (16)"), "{}", e.reason);
    let e = with(4).unwrap_err();
    assert!(e.reason.contains("not a multiple of resources.gpus_per_node (8)"), "{}", e.reason);
}

#[test]
fn a_receipts_pattern_must_compile_and_name_its_step_and_round_trips() {
    let mut wire = good();
    let with =
        |pattern: &str| trainyard_proto::v1::ReceiptsSpec { disable_auto: false, pattern: pattern.into() };
    for bad in ["(unclosed", r"loss=(?P<loss>\S+)"] {
        wire.receipts = Some(with(bad));
        let e = validate(&wire).expect_err(bad);
        assert_eq!(e.field, "receipts.pattern", "{e}");
    }
    wire.receipts = Some(with(&"a".repeat(MAX_PATTERN_BYTES + 1)));
    assert!(validate(&wire).unwrap_err().reason.contains("at most 1024"));
    wire.receipts = Some(with(r"^it (?P<step>\d+)"));
    let spec = parse(wire.clone()).unwrap();
    assert_eq!(spec.receipts, ReceiptsPolicy { auto: true, pattern: Some(r"^it (?P<step>\d+)".into()) });
    assert_eq!(WireSpec::from(&spec).receipts, wire.receipts);
    wire.receipts = Some(trainyard_proto::v1::ReceiptsSpec { disable_auto: true, pattern: String::new() });
    let spec = parse(wire.clone()).unwrap();
    assert!(!spec.receipts.auto);
    assert_eq!(WireSpec::from(&spec).receipts, wire.receipts);
    wire.receipts = None;
    assert_eq!(WireSpec::from(&parse(wire).unwrap()).receipts, None, "the default stays unwritten");
}
