//! Job specs: the controller's own [`JobSpec`], and [`parse`], which checks a submitted spec and
//! turns the wire message into it. Pure functions, so every rule is unit-tested.
//!
//! Each error names the field as it is spelled in the TOML file (`resources.gpus`,
//! `engine.workdir`, `env.FOO BAR`) and says what is wrong, so an operator can fix the file
//! without reading code. Nothing is stored for a spec that fails here.

use std::collections::BTreeMap;
use std::path::Path;

use crate::domain::{InterconnectClass, PreflightLevel};
use trainyard_proto::v1 as pb;
use trainyard_proto::v1::{JobSpec as WireSpec, job_spec::Engine as WireEngine};

/// A job as the controller keeps it: every word parsed, every part present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    pub name: String,
    pub resources: Resources,
    pub engine: Engine,
    /// Environment overlay given to every rank.
    pub env: BTreeMap<String, String>,
    /// The preflight the agents run before launch (`None`: none).
    pub preflight: PreflightLevel,
    /// Attempts after the first (0: never restarts), and whether they resume from a checkpoint.
    pub max_restarts: u32,
    pub resume: bool,
    /// Higher runs first; ties go first-in first-out.
    pub priority: i32,
    /// Leave ranks unpinned.
    pub disable_pinning: bool,
}

/// What a job asks of the fleet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resources {
    /// Total GPUs, one rank each.
    pub gpus: u32,
    /// GPUs on each node; 0 lets the scheduler choose.
    pub gpus_per_node: u32,
    /// Substring the GPU model must contain; empty for any.
    pub gpu_model: String,
    /// Minimum memory per GPU in MiB; 0 for any.
    pub min_gpu_memory_mib: u64,
    /// The interconnect class every node must have; `None` for any.
    pub interconnect: Option<InterconnectClass>,
    /// Bytes of collectives per optimizer step (exec jobs); 0 when unknown.
    pub comm_bytes_per_step: u64,
}

/// What the ranks run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Engine {
    /// A program of the user's, `argv` started in `workdir`; `source_dir` (or `workdir`) is the
    /// directory whose git revision the launch receipt records.
    Exec { argv: Vec<String>, workdir: String, source_dir: String },
    /// trainyard's own engine: a model preset (`d<depth>`), a directory of token shards and
    /// further settings.
    Builtin { preset: String, data: String, settings: BTreeMap<String, String> },
}

impl JobSpec {
    /// The model depth of a built-in job (`d26` → 26).
    pub fn builtin_depth(&self) -> Option<u32> {
        match &self.engine {
            Engine::Builtin { preset, .. } => preset.strip_prefix('d')?.parse().ok(),
            Engine::Exec { .. } => None,
        }
    }
}

/// Checks a submitted spec against every rule that does not need the fleet, and turns it into
/// the controller's [`JobSpec`].
pub fn parse(spec: WireSpec) -> Result<JobSpec, SpecError> {
    validate(&spec)?;
    JobSpec::try_from(spec)
}

/// The structure alone (parts present, words known), without the limits [`validate`] adds at
/// submit: a spec stored under older rules still loads.
impl TryFrom<WireSpec> for JobSpec {
    type Error = SpecError;

    fn try_from(spec: WireSpec) -> Result<JobSpec, SpecError> {
        let res = spec.resources.ok_or_else(|| bad("resources", "is missing"))?;
        let interconnect = match res.interconnect.as_str() {
            "" | "any" => None,
            word => {
                Some(InterconnectClass::parse(word).filter(|c| *c != InterconnectClass::Mixed).ok_or_else(
                    || {
                        bad(
                            "resources.interconnect",
                            format!("{word:?} is not one of {}", INTERCONNECTS.join(", ")),
                        )
                    },
                )?)
            }
        };
        let preflight = match spec.preflight.as_str() {
            "" => PreflightLevel::None,
            word => PreflightLevel::parse(word).ok_or_else(|| {
                bad(
                    "preflight",
                    format!("{word:?} is not one of {}", crate::domain::words(PreflightLevel::ALL)),
                )
            })?,
        };
        let engine = match spec.engine.ok_or_else(|| bad("engine", "is missing"))? {
            WireEngine::Exec(e) => {
                Engine::Exec { argv: e.argv, workdir: e.workdir, source_dir: e.source_dir }
            }
            WireEngine::Builtin(b) => {
                Engine::Builtin { preset: b.preset, data: b.data, settings: b.settings.into_iter().collect() }
            }
        };
        let restart = spec.restart.unwrap_or_default();
        Ok(JobSpec {
            name: spec.name,
            resources: Resources {
                gpus: res.gpus,
                gpus_per_node: res.gpus_per_node,
                gpu_model: res.gpu_model,
                min_gpu_memory_mib: res.min_gpu_memory_mib,
                interconnect,
                comm_bytes_per_step: res.comm_bytes_per_step,
            },
            engine,
            env: spec.env.into_iter().collect(),
            preflight,
            max_restarts: restart.max_restarts,
            resume: restart.resume,
            priority: spec.priority,
            disable_pinning: spec.disable_pinning,
        })
    }
}

/// The wire form, for launches, answers and the store's encoding.
impl From<&JobSpec> for WireSpec {
    fn from(spec: &JobSpec) -> WireSpec {
        let r = &spec.resources;
        WireSpec {
            name: spec.name.clone(),
            resources: Some(pb::Resources {
                gpus: r.gpus,
                gpus_per_node: r.gpus_per_node,
                gpu_model: r.gpu_model.clone(),
                min_gpu_memory_mib: r.min_gpu_memory_mib,
                interconnect: r.interconnect.map_or("any", InterconnectClass::as_str).to_string(),
                comm_bytes_per_step: r.comm_bytes_per_step,
            }),
            engine: Some(match &spec.engine {
                Engine::Exec { argv, workdir, source_dir } => WireEngine::Exec(pb::ExecEngine {
                    argv: argv.clone(),
                    workdir: workdir.clone(),
                    source_dir: source_dir.clone(),
                }),
                Engine::Builtin { preset, data, settings } => WireEngine::Builtin(pb::BuiltinEngine {
                    preset: preset.clone(),
                    data: data.clone(),
                    settings: settings.clone().into_iter().collect(),
                }),
            }),
            env: spec.env.clone().into_iter().collect(),
            preflight: spec.preflight.as_str().to_string(),
            restart: Some(pb::RestartPolicy { max_restarts: spec.max_restarts, resume: spec.resume }),
            priority: spec.priority,
            disable_pinning: spec.disable_pinning,
        }
    }
}

/// A spec field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SpecError {
    pub field: String,
    pub reason: String,
}

fn bad(field: impl Into<String>, reason: impl Into<String>) -> SpecError {
    SpecError { field: field.into(), reason: reason.into() }
}

fn too_long(field: &str, bytes: usize, max: usize) -> SpecError {
    bad(field, format!("is {bytes} bytes long, at most {max} allowed"))
}

/// Interconnect classes a job may require (`any`, or empty, for no requirement).
pub const INTERCONNECTS: [&str; 4] = ["nvswitch", "nvlink-pairs", "pcie", "any"];

/// Variables the agent sets for every rank; an overlay may not redefine them.
pub use trainyard_proto::contract::RANK_ENV as RESERVED_ENV;

/// Upper bounds that keep one bad spec from hurting the controller; the size limits are the
/// contract's ([`trainyard_proto::limits`]), shared with `ctl` and the agents.
use trainyard_proto::limits::{
    MAX_ARGV_BYTES, MAX_ARGV_ITEMS, MAX_ENV_BYTES, MAX_ENV_VARS, MAX_NAME_BYTES as MAX_NAME_LEN,
    MAX_PATH_BYTES, MAX_SETTINGS, MAX_SETTINGS_BYTES, MAX_SHORT_STRING_BYTES, MAX_SPEC_BYTES,
};
const MAX_GPUS: u32 = 65_536;
const MAX_RESTARTS: u32 = 100;

/// Checks everything that can be checked without knowing the fleet.
pub fn validate(spec: &WireSpec) -> Result<(), SpecError> {
    let encoded = prost::Message::encoded_len(spec);
    if encoded > MAX_SPEC_BYTES {
        return Err(bad("spec", format!("is {encoded} bytes encoded, at most {MAX_SPEC_BYTES} allowed")));
    }
    validate_name(&spec.name)?;
    validate_resources(spec)?;
    validate_engine(spec.engine.as_ref())?;
    validate_env(spec)?;
    if !spec.preflight.is_empty() && PreflightLevel::parse(&spec.preflight).is_none() {
        return Err(bad(
            "preflight",
            format!("{:?} is not one of {}", spec.preflight, crate::domain::words(PreflightLevel::ALL)),
        ));
    }
    if let Some(restart) = &spec.restart
        && restart.max_restarts > MAX_RESTARTS
    {
        return Err(bad(
            "restart.max_restarts",
            format!("{} is more than {MAX_RESTARTS}", restart.max_restarts),
        ));
    }
    Ok(())
}

fn validate_name(name: &str) -> Result<(), SpecError> {
    if name.trim().is_empty() {
        return Err(bad("name", "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(bad("name", format!("is {} bytes long, at most {MAX_NAME_LEN} allowed", name.len())));
    }
    if name.chars().any(char::is_control) {
        return Err(bad("name", "must not contain control characters"));
    }
    Ok(())
}

fn validate_resources(spec: &WireSpec) -> Result<(), SpecError> {
    let Some(res) = &spec.resources else {
        return Err(bad("resources", "is missing (at least resources.gpus is required)"));
    };
    if res.gpus == 0 {
        return Err(bad("resources.gpus", "must be at least 1"));
    }
    if res.gpus > MAX_GPUS {
        return Err(bad("resources.gpus", format!("{} is more than {MAX_GPUS}", res.gpus)));
    }
    if res.gpu_model.len() > MAX_SHORT_STRING_BYTES {
        return Err(too_long("resources.gpu_model", res.gpu_model.len(), MAX_SHORT_STRING_BYTES));
    }
    if res.gpus_per_node > 0 && res.gpus % res.gpus_per_node != 0 {
        return Err(bad(
            "resources.gpus_per_node",
            format!("{} GPUs cannot be split evenly into nodes of {}", res.gpus, res.gpus_per_node),
        ));
    }
    let known =
        |s: &str| s == "any" || InterconnectClass::parse(s).is_some_and(|c| c != InterconnectClass::Mixed);
    debug_assert!(INTERCONNECTS.iter().all(|s| known(s)));
    if !res.interconnect.is_empty() && !known(&res.interconnect) {
        return Err(bad(
            "resources.interconnect",
            format!("{:?} is not one of {}", res.interconnect, INTERCONNECTS.join(", ")),
        ));
    }
    Ok(())
}

fn validate_engine(engine: Option<&WireEngine>) -> Result<(), SpecError> {
    match engine {
        None => Err(bad("engine", "is missing (engine.kind = \"exec\" with an argv, or \"builtin\")")),
        Some(WireEngine::Builtin(b)) => {
            let depth = b.preset.strip_prefix('d').and_then(|d| d.parse::<u32>().ok());
            if !matches!(depth, Some(1..=64)) {
                return Err(bad(
                    "engine.preset",
                    format!("{:?} is not d<depth> with depth 1..=64 (e.g. \"d4\")", b.preset),
                ));
            }
            if !b.data.starts_with('/') {
                return Err(bad("engine.data", "must be an absolute directory of token shards"));
            }
            absolute("engine.data", &b.data, true)?;
            if b.settings.len() > MAX_SETTINGS {
                return Err(bad(
                    "engine.settings",
                    format!("has {} entries, at most {MAX_SETTINGS} allowed", b.settings.len()),
                ));
            }
            let bytes: usize = b.settings.iter().map(|(k, v)| k.len() + v.len()).sum();
            if bytes > MAX_SETTINGS_BYTES {
                return Err(too_long("engine.settings", bytes, MAX_SETTINGS_BYTES));
            }
            for k in b.settings.keys() {
                if k.is_empty()
                    || !k.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                {
                    return Err(bad(format!("engine.settings.{k}"), "names are lowercase words with _"));
                }
            }
            Ok(())
        }
        Some(WireEngine::Exec(exec)) => {
            if exec.argv.is_empty() || exec.argv[0].is_empty() {
                return Err(bad("engine.argv", "must name a program to run"));
            }
            if exec.argv.len() > MAX_ARGV_ITEMS {
                return Err(bad(
                    "engine.argv",
                    format!("has {} arguments, at most {MAX_ARGV_ITEMS} allowed", exec.argv.len()),
                ));
            }
            let bytes: usize = exec.argv.iter().map(String::len).sum();
            if bytes > MAX_ARGV_BYTES {
                return Err(too_long("engine.argv", bytes, MAX_ARGV_BYTES));
            }
            if let Some(i) = exec.argv.iter().position(|a| a.contains('\0')) {
                return Err(bad(format!("engine.argv[{i}]"), "contains a NUL byte"));
            }
            absolute("engine.workdir", &exec.workdir, true)?;
            absolute("engine.source_dir", &exec.source_dir, false)
        }
    }
}

fn absolute(field: &str, path: &str, required: bool) -> Result<(), SpecError> {
    if path.is_empty() {
        return if required { Err(bad(field, "is required (an absolute path)")) } else { Ok(()) };
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(too_long(field, path.len(), MAX_PATH_BYTES));
    }
    if path.contains('\0') {
        return Err(bad(field, "contains a NUL byte"));
    }
    if !Path::new(path).is_absolute() {
        return Err(bad(
            field,
            format!("{path:?} is relative; give an absolute path, since ranks start on other hosts"),
        ));
    }
    Ok(())
}

/// The rule for the environment overlay: it is applied only to the rank's own process, after the
/// agent's shim has dropped to the job's user, so no variable (`LD_PRELOAD`, `PYTHONPATH`, ...)
/// reaches anything that runs as root. What is refused here is only what cannot work: a name
/// that is not a variable name, a variable trainyard sets for every rank, a NUL byte, and more
/// than [`MAX_ENV_VARS`] variables or [`MAX_ENV_BYTES`] bytes.
fn validate_env(spec: &WireSpec) -> Result<(), SpecError> {
    if spec.env.len() > MAX_ENV_VARS {
        return Err(bad("env", format!("has {} variables, at most {MAX_ENV_VARS} allowed", spec.env.len())));
    }
    let bytes: usize = spec.env.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_ENV_BYTES {
        return Err(too_long("env", bytes, MAX_ENV_BYTES));
    }
    for (name, value) in &spec.env {
        let field = format!("env.{name}");
        if !is_env_name(name) {
            return Err(bad(
                field,
                "is not a valid environment variable name (letters, digits and _, not starting with a digit)",
            ));
        }
        if RESERVED_ENV.contains(&name.as_str()) {
            return Err(bad(field, "is set by trainyard for every rank and cannot be overridden"));
        }
        if value.contains('\0') {
            return Err(bad(field, "value contains a NUL byte"));
        }
    }
    Ok(())
}

/// POSIX portable names: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::{BuiltinEngine, ExecEngine, JobSpec, Resources, job_spec::Engine};

    #[test]
    fn parse_keeps_every_field_and_the_wire_form_round_trips() {
        let mut wire = good();
        wire.env.insert("NCCL_DEBUG".into(), "WARN".into());
        wire.priority = -3;
        wire.restart = Some(trainyard_proto::v1::RestartPolicy { max_restarts: 2, resume: true });
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
            ("engine.source_dir", MAX_PATH_BYTES, |s, n| {
                exec(s).source_dir = format!("/{}", "s".repeat(n - 1))
            }),
            ("engine.data", MAX_PATH_BYTES, |s, n| builtin(s).data = format!("/{}", "d".repeat(n - 1))),
            ("engine.settings", MAX_SETTINGS, |s, n| {
                builtin(s).settings = (0..n).map(|i| (format!("k{i}"), "1".to_string())).collect()
            }),
            ("engine.settings", MAX_SETTINGS_BYTES, |s, n| {
                builtin(s).settings = [("k".to_string(), "v".repeat(n - 1))].into_iter().collect()
            }),
            ("env", MAX_ENV_VARS, |s, n| s.env = (0..n).map(|i| (format!("V{i}"), String::new())).collect()),
            ("env", MAX_ENV_BYTES, |s, n| {
                s.env = [("V".to_string(), "x".repeat(n - 1))].into_iter().collect()
            }),
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
}
