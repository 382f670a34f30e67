//! The TOML job spec that `ctl submit` reads, and its conversion to the proto `JobSpec`.
//!
//! Only the *shape* is checked here (field names, types, the engine kind): serde with
//! `deny_unknown_fields` at every level, so a typo is an error naming the field and its line
//! rather than a setting that silently does nothing. The *values* (zero GPUs, a relative
//! workdir, a bad env name) are the controller's to judge, so every client gets the same
//! answer; paths are passed through exactly as written.

use std::collections::{BTreeMap, HashMap};

use anyhow::Context;
use serde::Deserialize;
use toml::Spanned;
use trainyard_proto::v1::{BuiltinEngine, ExecEngine, JobSpec, Resources, RestartPolicy, job_spec::Engine};

/// MiB per GiB: the file speaks GiB, the proto MiB.
const MIB_PER_GIB: u64 = 1024;

/// A job spec file as written by the operator.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecFile {
    pub name: String,
    #[serde(default)]
    pub priority: i32,
    /// `none | quick | standard | full`; absent leaves the choice to the controller.
    #[serde(default)]
    pub preflight: String,
    pub resources: ResourcesFile,
    pub engine: EngineFile,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub restart: RestartFile,
    /// Bind each rank to its GPU's NUMA node (cores and memory); on unless set to false.
    #[serde(default = "default_true")]
    pub pinning: bool,
    #[serde(default)]
    pub receipts: ReceiptsFile,
    /// `[slurm]`: run in an allocation of a Slurm cluster (`ctl submit --slurm`).
    pub slurm: Option<SlurmFile>,
}

/// `[slurm]`: what `sbatch` is asked for (docs/slurm.md).
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SlurmFile {
    #[serde(default)]
    pub partition: String,
    #[serde(default)]
    pub account: String,
    #[serde(default)]
    pub qos: String,
    /// `sbatch --time` ("30", "4:00:00", "1-12:00:00").
    #[serde(default)]
    pub time_limit: String,
    /// Further sbatch options, one argument each.
    #[serde(default)]
    pub options: Vec<String>,
    /// Seconds before the time limit the agents are warned (SIGUSR1); default 120.
    #[serde(default)]
    pub warning_s: u32,
    /// Requeue the Slurm job at the warning, after a checkpoint.
    #[serde(default)]
    pub requeue: bool,
    /// Nodes beyond the job's own (the allocation then survives a lost node).
    #[serde(default)]
    pub spare_nodes: u32,
}

/// `[receipts]`: receipts of a script nobody changed.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptsFile {
    /// Put trainyard's bootstrap on the Python ranks' path (optimizer hooks, loggers observed,
    /// unbuffered output); on unless set to false.
    #[serde(default = "default_true")]
    pub auto: bool,
    /// A regular expression for the job's own printed step lines, with a named group `step`.
    #[serde(default)]
    pub pattern: String,
}

impl Default for ReceiptsFile {
    fn default() -> Self {
        ReceiptsFile { auto: true, pattern: String::new() }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcesFile {
    pub gpus: u32,
    #[serde(default)]
    pub gpus_per_node: u32,
    #[serde(default)]
    pub gpu_model: String,
    #[serde(default)]
    pub min_gpu_memory_gib: u64,
    /// `nvswitch | nvlink-pairs | pcie | any`.
    #[serde(default)]
    pub interconnect: String,
    /// Collective bytes per optimizer step, for the placement cost model (exec jobs).
    #[serde(default)]
    pub comm_bytes_per_step: u64,
    /// Memory all of the job's processes on one node may hold together (its cgroup there).
    #[serde(default)]
    pub memory_limit_gib: f64,
    /// Processes and threads the job may run at once on one node.
    #[serde(default)]
    pub max_processes: u32,
}

/// `[engine]`: one flat table told apart by `kind`. Flat rather than a serde tagged enum,
/// because toml reports errors inside a tagged enum at the table, not at the offending key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineFile {
    pub kind: Spanned<EngineKind>,
    // exec
    pub argv: Option<Vec<String>>,
    pub workdir: Option<String>,
    pub source_dir: Option<String>,
    // builtin
    pub preset: Option<String>,
    pub data: Option<String>,
    pub settings: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Exec,
    Builtin,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestartFile {
    #[serde(default)]
    pub max_restarts: u32,
    #[serde(default = "default_resume")]
    pub resume: bool,
    /// Seconds before the first restart, its growth per restart, and its cap (0: the
    /// controller's defaults, 1 s x 2 up to 60 s).
    #[serde(default)]
    pub backoff_initial_s: f64,
    #[serde(default)]
    pub backoff_factor: f64,
    #[serde(default)]
    pub backoff_cap_s: f64,
    /// No step receipt for max(hang_factor x median step, hang_timeout_s) is a hang (0: the
    /// defaults, 10 x and 300 s).
    #[serde(default)]
    pub hang_timeout_s: f64,
    #[serde(default)]
    pub hang_factor: f64,
    /// The signal that asks the ranks to checkpoint now ("SIGUSR1" or "SIGUSR2"), besides the
    /// request file; empty: the file only.
    #[serde(default)]
    pub checkpoint_signal: String,
    /// A restart may run on fewer GPUs, down to this many (0: always the full size).
    #[serde(default)]
    pub min_gpus: u32,
    /// Seconds an attempt waits for a silent host of it when no other placement can start now
    /// (unset: the controller's default).
    #[serde(default)]
    pub host_wait_s: Option<f64>,
}

impl Default for RestartFile {
    fn default() -> Self {
        RestartFile {
            max_restarts: 0,
            resume: default_resume(),
            backoff_initial_s: 0.0,
            backoff_factor: 0.0,
            backoff_cap_s: 0.0,
            hang_timeout_s: 0.0,
            hang_factor: 0.0,
            checkpoint_signal: String::new(),
            min_gpus: 0,
            host_wait_s: None,
        }
    }
}

fn default_resume() -> bool {
    true
}

/// Parses a spec from TOML text into the proto. The error is one line naming the field and,
/// where it is known, the line.
pub fn parse(text: &str) -> Result<JobSpec, String> {
    let file: SpecFile = toml::from_str(text).map_err(|e| one_line(&e.to_string()))?;
    let engine = engine(&file.engine).map_err(|reason| {
        let line = text[..file.engine.kind.span().start].lines().count().max(1);
        format!("line {line}: {reason}")
    })?;
    Ok(file.into_proto(engine))
}

/// Reads and parses the spec file at `path`, ready to submit.
pub fn load(path: &std::path::Path) -> anyhow::Result<JobSpec> {
    use std::io::Read as _;
    use trainyard_proto::limits::MAX_SPEC_FILE_BYTES;
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read job spec {}", path.display()))?;
    let mut text = String::new();
    file.take(MAX_SPEC_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("cannot read job spec {}", path.display()))?;
    if text.len() as u64 > MAX_SPEC_FILE_BYTES {
        anyhow::bail!(
            "job spec {} is larger than {MAX_SPEC_FILE_BYTES} bytes; a spec is a few lines",
            path.display()
        );
    }
    parse(&text).map_err(|e| anyhow::anyhow!("invalid job spec {}: {e}", path.display()))
}

/// The engine of the proto, or which keys do not fit the engine's kind. Only presence is
/// checked here; the values are the controller's to judge.
fn engine(e: &EngineFile) -> Result<Engine, String> {
    let (kind, own, foreign) = match e.kind.get_ref() {
        EngineKind::Exec => ("exec", ["argv", "workdir"], ["preset", "data", "settings"]),
        EngineKind::Builtin => ("builtin", ["preset", "data"], ["argv", "workdir", "source_dir"]),
    };
    let present = |key: &str| match key {
        "argv" => e.argv.is_some(),
        "workdir" => e.workdir.is_some(),
        "source_dir" => e.source_dir.is_some(),
        "preset" => e.preset.is_some(),
        "data" => e.data.is_some(),
        _ => e.settings.is_some(),
    };
    if let Some(key) = own.iter().find(|k| !present(k)) {
        return Err(format!("missing field `{key}` in [engine] of kind = \"{kind}\""));
    }
    if let Some(key) = foreign.iter().find(|k| present(k)) {
        return Err(format!("field `{key}` does not apply to [engine] of kind = \"{kind}\""));
    }
    let text = |v: &Option<String>| v.clone().unwrap_or_default();
    Ok(match e.kind.get_ref() {
        EngineKind::Exec => Engine::Exec(ExecEngine {
            argv: e.argv.clone().unwrap_or_default(),
            workdir: text(&e.workdir),
            source_dir: text(&e.source_dir),
        }),
        EngineKind::Builtin => Engine::Builtin(BuiltinEngine {
            preset: text(&e.preset),
            data: text(&e.data),
            settings: e.settings.clone().unwrap_or_default().into_iter().collect(),
        }),
    })
}

/// toml's messages span several lines (position, a source excerpt with a caret, reason); the
/// CLI prints one: "TOML parse error at line 7, column 8: `gpus = "x"`: invalid type: ...".
fn one_line(message: &str) -> String {
    let lines: Vec<&str> = message.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let Some((head, rest)) = lines.split_first() else {
        return String::new();
    };
    let mut out = head.to_string();
    // The excerpt line looks like "7 | gpus = \"x\""; the caret line like "|   ^^^".
    let source = rest.iter().find_map(|l| {
        let (num, text) = l.split_once('|')?;
        let num = num.trim();
        (!num.is_empty() && num.bytes().all(|b| b.is_ascii_digit())).then(|| text.trim())
    });
    if let Some(text) = source.filter(|t| !t.is_empty()) {
        out.push_str(&format!(": `{text}`"));
    }
    let reasons = rest.iter().filter(|l| !l.contains('|'));
    for reason in reasons {
        out.push_str(": ");
        out.push_str(reason);
    }
    out
}

fn default_true() -> bool {
    true
}

impl SpecFile {
    fn into_proto(self, engine: Engine) -> JobSpec {
        JobSpec {
            name: self.name,
            resources: Some(Resources {
                gpus: self.resources.gpus,
                gpus_per_node: self.resources.gpus_per_node,
                gpu_model: self.resources.gpu_model,
                min_gpu_memory_mib: self.resources.min_gpu_memory_gib.saturating_mul(MIB_PER_GIB),
                interconnect: self.resources.interconnect,
                comm_bytes_per_step: self.resources.comm_bytes_per_step,
                memory_limit_mib: (self.resources.memory_limit_gib.max(0.0) * MIB_PER_GIB as f64).round()
                    as u64,
                max_processes: self.resources.max_processes,
            }),
            engine: Some(engine),
            env: self.env.into_iter().collect::<HashMap<_, _>>(),
            preflight: self.preflight,
            restart: Some(RestartPolicy {
                max_restarts: self.restart.max_restarts,
                resume: self.restart.resume,
                backoff_initial_s: self.restart.backoff_initial_s,
                backoff_factor: self.restart.backoff_factor,
                backoff_cap_s: self.restart.backoff_cap_s,
                hang_timeout_s: self.restart.hang_timeout_s,
                hang_factor: self.restart.hang_factor,
                checkpoint_signal: self.restart.checkpoint_signal,
                min_gpus: self.restart.min_gpus,
                host_wait_s: self.restart.host_wait_s,
            }),
            priority: self.priority,
            disable_pinning: !self.pinning,
            receipts: (!self.receipts.auto || !self.receipts.pattern.is_empty()).then_some(
                trainyard_proto::v1::ReceiptsSpec {
                    disable_auto: !self.receipts.auto,
                    pattern: self.receipts.pattern,
                },
            ),
            slurm: self.slurm.map(|s| trainyard_proto::v1::SlurmSpec {
                partition: s.partition,
                account: s.account,
                qos: s.qos,
                time_limit: s.time_limit,
                options: s.options,
                warning_s: s.warning_s,
                requeue: s.requeue,
                spare_nodes: s.spare_nodes,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
name = "demo"
priority = 3
preflight = "quick"

[resources]
gpus = 16
gpus_per_node = 8
gpu_model = "H100"
min_gpu_memory_gib = 80
interconnect = "nvswitch"

[engine]
kind = "exec"
argv = ["python3", "examples/rank.py", "--steps", "50"]
workdir = "relative/on/purpose"
source_dir = "/src"

[env]
NCCL_DEBUG = "WARN"

[restart]
max_restarts = 2
resume = false
"#;

    fn error_of(text: &str) -> String {
        parse(text).expect_err("spec should be rejected")
    }

    #[test]
    fn full_spec_converts_to_the_expected_proto() {
        let spec = parse(FULL).expect("valid spec");
        let expected = JobSpec {
            name: "demo".into(),
            resources: Some(Resources {
                gpus: 16,
                gpus_per_node: 8,
                gpu_model: "H100".into(),
                min_gpu_memory_mib: 80 * 1024,
                interconnect: "nvswitch".into(),
                comm_bytes_per_step: 0,
                memory_limit_mib: 0,
                max_processes: 0,
            }),
            engine: Some(Engine::Exec(ExecEngine {
                argv: vec!["python3".into(), "examples/rank.py".into(), "--steps".into(), "50".into()],
                // Passed through unresolved: the controller rejects relative paths.
                workdir: "relative/on/purpose".into(),
                source_dir: "/src".into(),
            })),
            env: HashMap::from([("NCCL_DEBUG".to_string(), "WARN".to_string())]),
            preflight: "quick".into(),
            restart: Some(RestartPolicy { max_restarts: 2, resume: false, ..Default::default() }),
            priority: 3,
            disable_pinning: false,
            receipts: None,
            slurm: None,
        };
        assert_eq!(spec, expected);
    }

    #[test]
    fn the_sample_slurm_job_passes_the_controllers_checks() {
        let spec = parse(include_str!("../../deploy/slurm/job.toml")).expect("deploy/slurm/job.toml parses");
        trainyard_model::spec::parse(spec).expect("and the controller takes it");
    }

    #[test]
    fn a_slurm_table_is_read_and_a_typo_in_it_is_named() {
        let base = "name = \"s\"\n[resources]\ngpus = 16\ngpus_per_node = 8\n[engine]\nkind = \"exec\"\nargv = [\"python3\"]\nworkdir = \"/w\"\n";
        let spec = parse(&format!(
            "{base}[slurm]\npartition = \"gpu\"\naccount = \"lab\"\ntime_limit = \"4:00:00\"\noptions = [\"--constraint=h100\"]\nrequeue = true\nspare_nodes = 1\n"
        ))
        .unwrap();
        let slurm = spec.slurm.expect("[slurm]");
        assert_eq!(
            (slurm.partition.as_str(), slurm.account.as_str(), slurm.time_limit.as_str()),
            ("gpu", "lab", "4:00:00")
        );
        assert_eq!(slurm.options, vec!["--constraint=h100".to_string()]);
        assert!(slurm.requeue && slurm.spare_nodes == 1);
        let err = parse(&format!("{base}[slurm]\npartiton = \"gpu\"\n")).unwrap_err().to_string();
        assert!(err.contains("partiton"), "{err}");
    }

    #[test]
    fn receipts_auto_can_be_turned_off_and_a_typo_is_named() {
        let base = "name = \"r\"\n[resources]\ngpus = 1\n[engine]\nkind = \"exec\"\nargv = [\"python3\"]\nworkdir = \"/w\"\n";
        let off = parse(&format!("{base}[receipts]\nauto = false\n")).unwrap();
        assert_eq!(
            off.receipts,
            Some(trainyard_proto::v1::ReceiptsSpec { disable_auto: true, pattern: String::new() })
        );
        assert_eq!(parse(base).unwrap().receipts, None, "on by default");
        let err = parse(&format!("{base}[receipts]\nauot = false\n")).unwrap_err();
        assert!(err.contains("auot"), "{err}");
    }

    #[test]
    fn builtin_engine_and_defaults() {
        let text = r#"
name = "gpt"
[resources]
gpus = 8
[engine]
kind = "builtin"
preset = "d4"
data = "/data/shards"
[engine.settings]
lr = "0.02"
"#;
        let spec = parse(text).expect("valid spec");
        assert_eq!(
            spec.engine,
            Some(Engine::Builtin(BuiltinEngine {
                preset: "d4".into(),
                data: "/data/shards".into(),
                settings: HashMap::from([("lr".to_string(), "0.02".to_string())]),
            }))
        );
        assert_eq!(spec.priority, 0);
        assert_eq!(spec.preflight, "");
        assert_eq!(spec.restart, Some(RestartPolicy { max_restarts: 0, resume: true, ..Default::default() }));
        let res = spec.resources.expect("resources");
        assert_eq!((res.gpus_per_node, res.min_gpu_memory_mib), (0, 0));
    }

    #[test]
    fn unknown_top_level_field_is_named() {
        let msg = error_of(&FULL.replace("priority = 3", "priorty = 3"));
        assert!(msg.contains("unknown field `priorty`"), "{msg}");
        assert!(msg.contains("line"), "{msg}");
    }

    #[test]
    fn unknown_resources_field_is_named() {
        let msg = error_of(&FULL.replace("gpus_per_node = 8", "gpus_per_host = 8"));
        assert!(msg.contains("unknown field `gpus_per_host`"), "{msg}");
        assert!(msg.contains("line 8"), "{msg}");
    }

    #[test]
    fn unknown_engine_field_is_named() {
        let msg = error_of(&FULL.replace("source_dir =", "sourcedir ="));
        assert!(msg.contains("unknown field `sourcedir`"), "{msg}");
    }

    #[test]
    fn missing_engine_kind_is_named() {
        let msg = error_of(&FULL.replace("kind = \"exec\"\n", ""));
        assert!(msg.contains("missing field `kind`"), "{msg}");
    }

    #[test]
    fn unknown_engine_kind_lists_the_choices() {
        let msg = error_of(&FULL.replace("kind = \"exec\"", "kind = \"docker\""));
        assert!(msg.contains("docker") && msg.contains("exec"), "{msg}");
    }

    #[test]
    fn wrong_type_names_the_field_and_line() {
        let msg = error_of(&FULL.replace("gpus = 16", "gpus = \"sixteen\""));
        assert!(msg.contains("gpus = \"sixteen\""), "{msg}");
        assert!(msg.contains("line 7"), "{msg}");
        assert!(msg.contains("invalid type"), "{msg}");
    }

    #[test]
    fn wrong_type_inside_engine_names_the_key() {
        let msg = error_of(&FULL.replace(
            r#"argv = ["python3", "examples/rank.py", "--steps", "50"]"#,
            r#"argv = "python3 examples/rank.py""#,
        ));
        assert!(msg.contains("line 15") && msg.contains("`argv = "), "{msg}");
        assert!(msg.contains("expected a sequence"), "{msg}");
    }

    #[test]
    fn engine_keys_must_fit_the_kind() {
        let missing = error_of(&FULL.replace("workdir = \"relative/on/purpose\"\n", ""));
        assert_eq!(missing, "line 14: missing field `workdir` in [engine] of kind = \"exec\"");
        let foreign = error_of(&FULL.replace("source_dir = \"/src\"", "preset = \"d4\""));
        assert!(foreign.contains("field `preset` does not apply"), "{foreign}");
    }

    #[test]
    fn errors_are_one_line() {
        let raw = toml::from_str::<SpecFile>(&FULL.replace("gpus = 16", "gpus = \"x\""))
            .expect_err("wrong type")
            .to_string();
        assert!(raw.contains('\n'), "toml's own message spans lines");
        let line = one_line(&raw);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("TOML parse error at line 7"), "{line}");
        assert!(line.contains("`gpus = \"x\"`: invalid type"), "{line}");
    }
}

#[cfg(test)]
mod props {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

        /// Any text as a spec file: a spec or one line of error, never a panic.
        #[test]
        fn any_text_is_a_spec_or_one_line_of_error(text in "(?s).{0,300}") {
            if let Err(e) = parse(&text) {
                prop_assert!(!e.contains('\n'), "{}", e);
            }
        }

        /// A valid spec with one random edit: the same.
        #[test]
        fn edited_specs_are_a_spec_or_one_line_of_error(at in 0usize..400, len in 0usize..20, with in "(?s).{0,12}") {
            let good = "name = \"demo\"\npriority = 0\n\n[resources]\ngpus = 16\ngpus_per_node = 8\n\n\
                        [engine]\nkind = \"exec\"\nargv = [\"python3\", \"rank.py\"]\nworkdir = \"/srv\"\n\n\
                        [env]\nNCCL_DEBUG = \"WARN\"\n\n[restart]\nmax_restarts = 1\n";
            let mut chars: Vec<char> = good.chars().collect();
            let at = at % (chars.len() + 1);
            let end = (at + len).min(chars.len());
            chars.splice(at..end, with.chars());
            let text: String = chars.into_iter().collect();
            if let Err(e) = parse(&text) {
                prop_assert!(!e.contains('\n'), "{}", e);
            }
        }
    }
}
