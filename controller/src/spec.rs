//! Validation of job specs at submit: a pure function, so every rule is unit-tested.
//!
//! Each error names the field as it is spelled in the TOML file (`resources.gpus`,
//! `engine.workdir`, `env.FOO BAR`) and says what is wrong, so an operator can fix the file
//! without reading code. Nothing is stored for a spec that fails here.

use std::path::Path;

use crate::domain::{InterconnectClass, PreflightLevel};
use trainyard_proto::v1::{JobSpec, job_spec::Engine};

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

/// Interconnect classes a job may require (`any`, or empty, for no requirement).
pub const INTERCONNECTS: [&str; 4] = ["nvswitch", "nvlink-pairs", "pcie", "any"];

/// Variables the agent sets for every rank; an overlay may not redefine them.
pub use trainyard_proto::contract::RANK_ENV as RESERVED_ENV;

/// Upper bounds that keep one bad spec from hurting the controller.
const MAX_NAME_LEN: usize = 128;
const MAX_GPUS: u32 = 65_536;
const MAX_RESTARTS: u32 = 100;

/// Checks everything that can be checked without knowing the fleet.
pub fn validate(spec: &JobSpec) -> Result<(), SpecError> {
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

fn validate_resources(spec: &JobSpec) -> Result<(), SpecError> {
    let Some(res) = &spec.resources else {
        return Err(bad("resources", "is missing (at least resources.gpus is required)"));
    };
    if res.gpus == 0 {
        return Err(bad("resources.gpus", "must be at least 1"));
    }
    if res.gpus > MAX_GPUS {
        return Err(bad("resources.gpus", format!("{} is more than {MAX_GPUS}", res.gpus)));
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

fn validate_engine(engine: Option<&Engine>) -> Result<(), SpecError> {
    match engine {
        None => Err(bad("engine", "is missing (engine.kind = \"exec\" with an argv, or \"builtin\")")),
        Some(Engine::Builtin(b)) => {
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
            for k in b.settings.keys() {
                if k.is_empty()
                    || !k.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                {
                    return Err(bad(format!("engine.settings.{k}"), "names are lowercase words with _"));
                }
            }
            Ok(())
        }
        Some(Engine::Exec(exec)) => {
            if exec.argv.is_empty() || exec.argv[0].is_empty() {
                return Err(bad("engine.argv", "must name a program to run"));
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

fn validate_env(spec: &JobSpec) -> Result<(), SpecError> {
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
    use trainyard_proto::v1::{BuiltinEngine, ExecEngine, Resources};

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
