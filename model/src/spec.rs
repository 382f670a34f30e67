//! Job specs: the controller's own [`JobSpec`], and [`parse`], which checks a submitted spec and
//! turns the wire message into it. Pure functions, so every rule is unit-tested.
//!
//! Each error names the field as it is spelled in the TOML file (`resources.gpus`,
//! `engine.workdir`, `env.FOO BAR`) and says what is wrong, so an operator can fix the file
//! without reading code. Nothing is stored for a spec that fails here.

use std::collections::BTreeMap;
use std::path::Path;

use crate::domain::{InterconnectClass, PreflightLevel};
pub use crate::restart::{Backoff, HangRule};
use trainyard_proto::v1 as pb;
use trainyard_proto::v1::{JobSpec as WireSpec, job_spec::Engine as WireEngine};

/// A job as the controller keeps it: every word parsed, every part present.
#[derive(Debug, Clone, PartialEq)]
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
    /// The wait before each new attempt.
    pub backoff: Backoff,
    /// When a running attempt counts as hung.
    pub hang: HangRule,
    /// The signal that asks ranks to checkpoint now (`SIGUSR1`, `SIGUSR2`); empty: the request
    /// file only.
    pub checkpoint_signal: String,
    /// A restart may use fewer GPUs, down to this many (0: always `resources.gpus`).
    pub min_gpus: u32,
    /// How long an attempt waits for a silent host when no other placement can start
    /// (`None`: the controller's default).
    pub host_wait: Option<std::time::Duration>,
    /// Higher runs first; ties go first-in first-out.
    pub priority: i32,
    /// Leave ranks unpinned.
    pub disable_pinning: bool,
    /// How the steps of a script that does not write receipts itself are recorded.
    pub receipts: ReceiptsPolicy,
    /// `[slurm]`: the job runs in a Slurm allocation, on the agents started inside it alone.
    pub slurm: Option<crate::slurm::SlurmOptions>,
}

/// `[receipts]` of a job (docs/receipts.md, "Receipts without code changes").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiptsPolicy {
    /// trainyard's bootstrap on the Python ranks' path, and the agent reading their printed
    /// step lines (on unless the job says `auto = false`).
    pub auto: bool,
    /// The job's own pattern for its printed step lines ([`receipts_pattern`]).
    pub pattern: Option<String>,
}

impl Default for ReceiptsPolicy {
    fn default() -> Self {
        ReceiptsPolicy { auto: true, pattern: None }
    }
}

/// The longest `[receipts] pattern` a job may give (bytes).
pub const MAX_PATTERN_BYTES: usize = 1024;
/// The compiled size a pattern may take (the regex crate's limit, bytes).
const PATTERN_SIZE_LIMIT: usize = 1 << 20;

/// Compiles a job's `[receipts] pattern`: it must compile within the size limits and have a
/// named group `step`. The error says what is wrong (the caller names the field). Rust's regex
/// matches in time linear in the line, whatever the pattern.
pub fn receipts_pattern(text: &str) -> Result<regex::Regex, String> {
    if text.len() > MAX_PATTERN_BYTES {
        return Err(format!("is {} bytes; at most {MAX_PATTERN_BYTES}", text.len()));
    }
    let re = regex::RegexBuilder::new(text)
        .size_limit(PATTERN_SIZE_LIMIT)
        .build()
        .map_err(|e| format!("does not compile: {}", e.to_string().lines().last().unwrap_or("").trim()))?;
    if !re.capture_names().flatten().any(|n| n == "step") {
        return Err("has no named group `step` (write (?P<step>\\d+) where the step number is)".into());
    }
    Ok(re)
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
    /// Memory all of the job's processes on one node may hold, in MiB; 0 for no limit.
    pub memory_limit_mib: u64,
    /// Processes and threads the job may run at once on one node; 0 for no limit.
    pub max_processes: u32,
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
    /// An exec job of `gpus` ranks running `argv` in `/`, with every other setting at its
    /// default (no preflight, no restart, pinned, receipts without code changes on): the one
    /// spec tests and benches start from, changing what they are about with `..`.
    pub fn exec(name: impl Into<String>, gpus: u32, argv: &[&str]) -> JobSpec {
        JobSpec {
            name: name.into(),
            resources: Resources { gpus, ..Default::default() },
            engine: Engine::Exec {
                argv: argv.iter().map(|a| a.to_string()).collect(),
                workdir: "/".into(),
                source_dir: String::new(),
            },
            env: Default::default(),
            preflight: PreflightLevel::None,
            max_restarts: 0,
            resume: false,
            backoff: Default::default(),
            hang: Default::default(),
            checkpoint_signal: String::new(),
            min_gpus: 0,
            host_wait: None,
            priority: 0,
            disable_pinning: false,
            receipts: Default::default(),
            slurm: None,
        }
    }

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
        let (backoff, hang) = crate::restart::rules_of(&restart);
        Ok(JobSpec {
            name: spec.name,
            resources: Resources {
                gpus: res.gpus,
                gpus_per_node: res.gpus_per_node,
                gpu_model: res.gpu_model,
                min_gpu_memory_mib: res.min_gpu_memory_mib,
                interconnect,
                comm_bytes_per_step: res.comm_bytes_per_step,
                memory_limit_mib: res.memory_limit_mib,
                max_processes: res.max_processes,
            },
            engine,
            env: spec.env.into_iter().collect(),
            preflight,
            max_restarts: restart.max_restarts,
            resume: restart.resume,
            backoff,
            hang,
            checkpoint_signal: restart.checkpoint_signal.clone(),
            min_gpus: restart.min_gpus,
            host_wait: restart.host_wait_s.map(std::time::Duration::from_secs_f64),
            priority: spec.priority,
            disable_pinning: spec.disable_pinning,
            receipts: ReceiptsPolicy {
                auto: spec.receipts.as_ref().is_none_or(|r| !r.disable_auto),
                pattern: spec.receipts.as_ref().map(|r| r.pattern.clone()).filter(|p| !p.is_empty()),
            },
            slurm: spec.slurm.as_ref().map(crate::slurm::SlurmOptions::from),
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
                memory_limit_mib: r.memory_limit_mib,
                max_processes: r.max_processes,
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
            restart: Some({
                let mut p = pb::RestartPolicy {
                    max_restarts: spec.max_restarts,
                    resume: spec.resume,
                    checkpoint_signal: spec.checkpoint_signal.clone(),
                    min_gpus: spec.min_gpus,
                    host_wait_s: spec.host_wait.map(|d| d.as_secs_f64()),
                    ..Default::default()
                };
                crate::restart::write_rules(&mut p, &spec.backoff, &spec.hang);
                p
            }),
            priority: spec.priority,
            disable_pinning: spec.disable_pinning,
            receipts: (!spec.receipts.auto || spec.receipts.pattern.is_some()).then(|| pb::ReceiptsSpec {
                disable_auto: !spec.receipts.auto,
                pattern: spec.receipts.pattern.clone().unwrap_or_default(),
            }),
            slurm: spec.slurm.as_ref().map(pb::SlurmSpec::from),
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
/// `resources.memory_limit_mib`, when set: at least enough for a Python interpreter with torch
/// imported, at most 1 PiB.
pub const MEMORY_LIMIT_MIB: std::ops::RangeInclusive<u64> = 256..=(1 << 30);
/// `resources.max_processes`, when set: at least a rank's interpreter and its threads, at most
/// the kernel's largest pid_max.
pub const MAX_PROCESSES: std::ops::RangeInclusive<u32> = 16..=4_194_304;
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
    if let Some(slurm) = &spec.slurm {
        crate::slurm::validate(slurm, spec.resources.as_ref()).map_err(|e| bad(e.field, e.reason))?;
    }
    if let Some(r) = spec.receipts.as_ref().filter(|r| !r.pattern.is_empty()) {
        receipts_pattern(&r.pattern).map_err(|e| bad("receipts.pattern", e))?;
    }
    if !spec.preflight.is_empty() && PreflightLevel::parse(&spec.preflight).is_none() {
        return Err(bad(
            "preflight",
            format!("{:?} is not one of {}", spec.preflight, crate::domain::words(PreflightLevel::ALL)),
        ));
    }
    if let Some(restart) = &spec.restart {
        if restart.max_restarts > MAX_RESTARTS {
            return Err(bad(
                "restart.max_restarts",
                format!("{} is more than {MAX_RESTARTS}", restart.max_restarts),
            ));
        }
        crate::restart::validate(restart).map_err(|e| bad(e.field, e.reason))?;
        let res = spec.resources.clone().unwrap_or_default();
        if restart.min_gpus > res.gpus {
            return Err(bad(
                "restart.min_gpus",
                format!("{} is more than resources.gpus ({})", restart.min_gpus, res.gpus),
            ));
        }
        if restart.min_gpus > 0 && res.gpus_per_node > 0 && restart.min_gpus % res.gpus_per_node != 0 {
            return Err(bad(
                "restart.min_gpus",
                format!(
                    "{} is not a multiple of resources.gpus_per_node ({})",
                    restart.min_gpus, res.gpus_per_node
                ),
            ));
        }
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
    if res.memory_limit_mib != 0 && !MEMORY_LIMIT_MIB.contains(&res.memory_limit_mib) {
        return Err(bad(
            "resources.memory_limit_mib",
            format!(
                "{} is not 0 (no limit) or {} to {}",
                res.memory_limit_mib,
                MEMORY_LIMIT_MIB.start(),
                MEMORY_LIMIT_MIB.end()
            ),
        ));
    }
    if res.max_processes != 0 && !MAX_PROCESSES.contains(&res.max_processes) {
        return Err(bad(
            "resources.max_processes",
            format!(
                "{} is not 0 (no limit) or {} to {}",
                res.max_processes,
                MAX_PROCESSES.start(),
                MAX_PROCESSES.end()
            ),
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
#[path = "spec_tests.rs"]
mod tests;
