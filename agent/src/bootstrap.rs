//! The Python bootstrap that gives an unchanged training script its receipts
//! (docs/receipts.md, "Receipts without code changes").
//!
//! The agent carries `python/bootstrap/sitecustomize.py` and the `trainyard_receipts` package in
//! its binary and writes them, at start, into `DATA/bootstrap/<hash>/`: a directory named by
//! the hash of its files, owned by the agent's user (root, or the user an agent in a Slurm
//! allocation runs as), mode 0755 with files 0644, so only that user can change them and every
//! job's user can read them. Every node running the same agent build has the same files under the
//! same hash, which each launch receipt records (`bootstrap_hash`).
//!
//! A rank's user cannot write there, so its interpreter would compile `sitecustomize.py` from
//! source at every start: 2 to 5 ms of a 2-core machine, most of it the compiler's first use.
//! The agent therefore compiles the directory once, when it installs it, with the interpreters
//! it is given (`--bootstrap-python`, `python3` by default): hash-checked `.pyc` files in
//! `__pycache__`, which a rank's Python of the same minor version loads (about 0.5 ms) and any
//! other ignores. Python checks each against its source's hash, so a stale one is never run.
//!
//! An `exec` rank gets the directory first on its `PYTHONPATH`, `TRAINYARD_BOOTSTRAP_HASH`, and
//! `PYTHONUNBUFFERED=1` (so its printed lines reach its output files as they are printed) unless
//! the job's `[env]` sets `PYTHONUNBUFFERED` itself. `[receipts] auto = false` leaves all three
//! out. The built-in engine writes its own receipts and gets none of them.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use trainyard_proto::v1::{Launch, job_spec};

/// The files of the bootstrap directory, relative to it, with their text.
const FILES: &[(&str, &str)] = &[
    ("sitecustomize.py", include_str!("../../python/bootstrap/sitecustomize.py")),
    ("trainyard_receipts/__init__.py", include_str!("../../python/trainyard_receipts/__init__.py")),
    ("trainyard_receipts/_auto.py", include_str!("../../python/trainyard_receipts/_auto.py")),
    ("trainyard_receipts/_cuda.py", include_str!("../../python/trainyard_receipts/_cuda.py")),
    ("trainyard_receipts/_encode.py", include_str!("../../python/trainyard_receipts/_encode.py")),
    ("trainyard_receipts/_loggers.py", include_str!("../../python/trainyard_receipts/_loggers.py")),
    ("trainyard_receipts/_provenance.py", include_str!("../../python/trainyard_receipts/_provenance.py")),
    ("trainyard_receipts/_receipts.py", include_str!("../../python/trainyard_receipts/_receipts.py")),
    ("trainyard_receipts/_version.py", include_str!("../../python/trainyard_receipts/_version.py")),
    ("trainyard_receipts/_worker.py", include_str!("../../python/trainyard_receipts/_worker.py")),
    ("trainyard_receipts/_writer.py", include_str!("../../python/trainyard_receipts/_writer.py")),
    ("trainyard_receipts/peaks.py", include_str!("../../python/trainyard_receipts/peaks.py")),
];

/// `PYTHONPATH`'s separator.
const PATH_SEP: char = ':';

/// The bootstrap as installed on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub dir: PathBuf,
    /// SHA-256 of the files (name, NUL, text, NUL, in order), hex.
    pub hash: String,
}

/// The hash of the bootstrap this agent carries.
pub fn hash() -> String {
    let mut h = Sha256::new();
    for (name, text) in FILES {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(text.as_bytes());
        h.update([0]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes the bootstrap under `data_dir/bootstrap/<hash>` unless it is there with the same
/// files (checked byte for byte: a directory changed behind the agent's back is rewritten).
pub fn install(data_dir: &Path) -> io::Result<Bootstrap> {
    let hash = hash();
    let root = data_dir.join("bootstrap");
    make_readable_dir(&root)?;
    let dir = root.join(&hash[..16]);
    if !intact(&dir) {
        let staging = root.join(format!(".{}.{}", &hash[..16], std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        for (name, text) in FILES {
            let path = staging.join(name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
                make_readable_dir(parent)?;
            }
            std::fs::write(&path, text)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        }
        make_readable_dir(&staging)?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&staging, &dir)?;
    }
    Ok(Bootstrap { dir, hash })
}

/// How long one interpreter may take to compile the bootstrap before the agent gives up on it.
const COMPILE_DEADLINE: Duration = Duration::from_secs(20);

/// Compiles the directory with each interpreter: `sys.argv[1]` is the directory.
const COMPILE: &str = "import compileall, py_compile, sys
ok = compileall.compile_dir(sys.argv[1], quiet=2, workers=1,
                            invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
sys.exit(0 if ok else 3)";

/// A compile of the bootstrap under way ([`Bootstrap::compile_in_background`]).
#[derive(Debug)]
pub struct Compiling(std::sync::Mutex<std::sync::mpsc::Receiver<()>>);

impl Compiling {
    /// Waits for the compile to end, at most `limit` (ranks started before it ends compile the
    /// source themselves, at the cost of their start).
    pub fn wait(self, limit: Duration) {
        let done = self.0.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(limit) {
            tracing::warn!(
                "the Python bootstrap is still compiling after {}s; ranks starting now compile it themselves",
                limit.as_secs()
            );
        }
    }
}

fn compile_with(python: &Path, dir: &Path) -> Result<(), String> {
    let name = python.display();
    // -I: the agent's own PYTHONPATH and user site never reach the compiler.
    let mut child = std::process::Command::new(python)
        .args(["-I", "-c", COMPILE])
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("{name}: cannot start it: {e}"))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < COMPILE_DEADLINE => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{name}: still compiling after {}s; stopped",
                    COMPILE_DEADLINE.as_secs()
                ));
            }
            Err(e) => return Err(format!("{name}: {e}")),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = io::Read::read_to_string(&mut pipe, &mut stderr);
    }
    let last = stderr.lines().last().unwrap_or("").trim();
    Err(format!("{name}: exited with {status}{}{last}", if last.is_empty() { "" } else { ": " }))
}

fn make_readable_dir(dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
}

/// Whether `dir` holds exactly the carried files.
fn intact(dir: &Path) -> bool {
    FILES.iter().all(|(name, text)| std::fs::read(dir.join(name)).is_ok_and(|b| b == text.as_bytes()))
}

impl Bootstrap {
    /// Compiles the bootstrap once with each of `pythons` (a name is looked up on `PATH`),
    /// unless its `__pycache__` is already there. Returns one line per interpreter that could
    /// not: the ranks then compile the source themselves, which only costs their start.
    pub fn precompile(&self, pythons: &[PathBuf]) -> Vec<String> {
        if self.dir.join("__pycache__").exists() {
            return Vec::new();
        }
        let failed = pythons.iter().filter_map(|python| compile_with(python, &self.dir).err()).collect();
        // Readable by every job's user, whatever the agent's umask: the cache beside each of
        // the carried files' directories.
        let dirs: std::collections::BTreeSet<&Path> =
            FILES.iter().filter_map(|(name, _)| Path::new(name).parent()).collect();
        for cache in dirs.into_iter().map(|d| self.dir.join(d).join("__pycache__")) {
            let files = std::fs::read_dir(&cache).into_iter().flatten().filter_map(Result::ok);
            for file in files {
                let _ = std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o644));
            }
            let _ = std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o755));
        }
        failed
    }

    /// [`Bootstrap::precompile`] on a thread of its own, each failure a warning in the log.
    pub fn compile_in_background(&self, pythons: Vec<PathBuf>) -> Compiling {
        let (done, compiling) = std::sync::mpsc::channel();
        let bootstrap = self.clone();
        let compile = move || {
            let started = Instant::now();
            for failed in bootstrap.precompile(&pythons) {
                tracing::warn!(
                    "cannot compile the Python bootstrap with {failed}; ranks of that Python compile it at every start"
                );
            }
            tracing::info!(
                dir = %bootstrap.dir.display(),
                ms = started.elapsed().as_millis() as u64,
                "{BOOTSTRAP_READY}"
            );
            let _ = done.send(());
        };
        if let Err(e) = std::thread::Builder::new().name("bootstrap-compile".into()).spawn(compile) {
            tracing::warn!(error = %e, "cannot start the thread that compiles the Python bootstrap");
        }
        Compiling(std::sync::Mutex::new(compiling))
    }

    /// Puts the bootstrap into a rank's environment `env` (the agent's, the account's and the
    /// rank's variables, the overlay applied) when `launch` is an `exec` job that did not turn
    /// automatic receipts off.
    pub fn apply(&self, launch: &Launch, env: &mut BTreeMap<String, String>) {
        env.remove(OWNER);
        let Some(spec) = &launch.spec else { return };
        if !matches!(spec.engine, Some(job_spec::Engine::Exec(_))) || !auto(launch) {
            return;
        }
        let dir = self.dir.display().to_string();
        let path = match env.get("PYTHONPATH").filter(|p| !p.is_empty()) {
            Some(rest) => format!("{dir}{PATH_SEP}{rest}"),
            None => dir,
        };
        env.insert("PYTHONPATH".into(), path);
        env.insert(HASH.into(), self.hash.clone());
        if !spec.env.contains_key("PYTHONUNBUFFERED") {
            env.insert("PYTHONUNBUFFERED".into(), "1".into());
        }
    }
}

/// What the agent logs once its bootstrap compile ended, whether or not every interpreter
/// could compile it: from then on no process of the agent's own runs beside the ranks.
pub const BOOTSTRAP_READY: &str = "the Python bootstrap is ready for ranks";

/// The variable that carries the bootstrap's hash into the launch receipt.
pub const HASH: &str = "TRAINYARD_BOOTSTRAP_HASH";
/// The variable the bootstrap sets in the rank's process, which its children inherit: never
/// passed to a rank from the agent's own environment.
const OWNER: &str = "TRAINYARD_RECEIPTS_OWNER";

/// The reader of printed step lines an `exec` rank of `launch` gets (none for the built-in
/// engine, which writes its own receipts, nor with `auto = false`).
pub fn printed_state(launch: &Launch) -> Option<crate::printed::PrintedState> {
    let spec = launch.spec.as_ref()?;
    if !matches!(spec.engine, Some(job_spec::Engine::Exec(_))) || !auto(launch) {
        return None;
    }
    let pattern = spec.receipts.as_ref().map(|r| r.pattern.clone()).filter(|p| !p.is_empty());
    let position = crate::printed::PrintedPosition { written_through: -1, ..Default::default() };
    Some(crate::printed::PrintedState { pattern, position })
}

/// Whether the job wants receipts without code changes (`[receipts] auto`, on by default).
pub fn auto(launch: &Launch) -> bool {
    launch.spec.as_ref().and_then(|s| s.receipts.as_ref()).is_none_or(|r| !r.disable_auto)
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::{BuiltinEngine, ExecEngine, JobSpec, ReceiptsSpec};

    fn launch(engine: job_spec::Engine, env: &[(&str, &str)], receipts: Option<ReceiptsSpec>) -> Launch {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Launch {
            spec: Some(JobSpec { engine: Some(engine), env, receipts, ..JobSpec::default() }),
            ..Launch::default()
        }
    }

    fn exec() -> job_spec::Engine {
        job_spec::Engine::Exec(ExecEngine { argv: vec!["python3".into()], ..ExecEngine::default() })
    }

    #[test]
    fn every_module_of_the_package_is_carried() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/trainyard_receipts");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".py"))
            .map(|n| format!("trainyard_receipts/{n}"))
            .collect();
        on_disk.sort();
        let carried: Vec<&str> =
            FILES.iter().map(|(n, _)| *n).filter(|n| n.starts_with("trainyard_receipts/")).collect();
        assert_eq!(carried, on_disk, "FILES must list every module of python/trainyard_receipts, sorted");
    }

    #[test]
    fn installs_once_readable_and_rewrites_a_changed_file() {
        let data = tempfile::tempdir().unwrap();
        let b = install(data.path()).unwrap();
        assert_eq!(b.hash, hash());
        let site = b.dir.join("sitecustomize.py");
        assert_eq!(std::fs::metadata(&site).unwrap().permissions().mode() & 0o777, 0o644);
        assert_eq!(std::fs::metadata(&b.dir).unwrap().permissions().mode() & 0o777, 0o755);
        std::fs::write(&site, "print('planted')").unwrap();
        let again = install(data.path()).unwrap();
        assert_eq!(again, b);
        assert!(std::fs::read_to_string(&site).unwrap().contains("trainyard's bootstrap"), "rewritten");
    }

    #[test]
    fn precompiled_once_with_python3_and_an_interpreter_that_is_not_there_is_named() {
        let data = tempfile::tempdir().unwrap();
        let b = install(data.path()).unwrap();
        let missing = PathBuf::from("/nonexistent/python9");
        let failed = b.precompile(&[missing.clone(), "python3".into()]);
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].starts_with("/nonexistent/python9: cannot start it"), "{failed:?}");
        let cache: Vec<String> = std::fs::read_dir(b.dir.join("__pycache__"))
            .expect("python3 compiled the bootstrap")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        assert!(cache.iter().any(|n| n.starts_with("sitecustomize.") && n.ends_with(".pyc")), "{cache:?}");
        let package = b.dir.join("trainyard_receipts/__pycache__");
        assert_eq!(std::fs::metadata(&package).unwrap().permissions().mode() & 0o777, 0o755);
        for pyc in std::fs::read_dir(&package).unwrap() {
            assert_eq!(pyc.unwrap().metadata().unwrap().permissions().mode() & 0o777, 0o644);
        }
        assert!(b.precompile(&[missing]).is_empty(), "compiled once: a later start does not try again");
    }

    #[test]
    fn an_exec_rank_gets_the_path_the_hash_and_unbuffered_output() {
        let b = Bootstrap { dir: "/d/bootstrap/ab".into(), hash: "abcd".into() };
        let mut env = BTreeMap::from([
            ("PYTHONPATH".to_string(), "/user/lib".to_string()),
            (OWNER.to_string(), "1:0".to_string()),
        ]);
        b.apply(&launch(exec(), &[], None), &mut env);
        assert_eq!(env["PYTHONPATH"], "/d/bootstrap/ab:/user/lib");
        assert_eq!(env[HASH], "abcd");
        assert_eq!(env["PYTHONUNBUFFERED"], "1");
        assert!(!env.contains_key(OWNER), "never inherited from the agent");
    }

    #[test]
    fn the_job_can_keep_its_buffering_or_turn_it_all_off_and_the_engine_gets_nothing() {
        let b = Bootstrap { dir: "/d/b".into(), hash: "h".into() };
        let mut env = BTreeMap::from([("PYTHONUNBUFFERED".to_string(), String::new())]);
        b.apply(&launch(exec(), &[("PYTHONUNBUFFERED", "")], None), &mut env);
        assert_eq!(env["PYTHONUNBUFFERED"], "", "the job's own setting stays");
        assert_eq!(env["PYTHONPATH"], "/d/b");

        let off = ReceiptsSpec { disable_auto: true, ..ReceiptsSpec::default() };
        let mut env = BTreeMap::new();
        b.apply(&launch(exec(), &[], Some(off)), &mut env);
        assert!(env.is_empty(), "{env:?}");

        let mut env = BTreeMap::new();
        b.apply(&launch(job_spec::Engine::Builtin(BuiltinEngine::default()), &[], None), &mut env);
        assert!(env.is_empty(), "{env:?}");
    }
}
