//! The deploy files agree with the binaries and the workspace they deploy.
//!
//! - Every `ExecStart=` of the units in deploy/systemd/ runs: the named binary is started with
//!   the unit's arguments followed by `--help` and must exit 0. clap rejects an unknown flag (or
//!   a bad value) before it gets to `--help`, so a flag the binary lacks fails here rather than
//!   on a host at boot.
//! - deploy/Containerfile builds packages of this workspace, every binary its stages copy out of
//!   the build is one of theirs, its final stages run as a non-root user, and it installs the
//!   torch version deploy/setup.sh installs.
//!
//! - The example environment files of a controller group (deploy/group/) set only variables
//!   their unit or their binary reads (`[env: NAME=]` in its `--help`).
//! - deploy/prometheus/trainyard-alerts.yml names only metrics the controller or the agent
//!   exports (their `/metrics` tables, and the DCGM exporter names the agent uses).
//!
//! The binaries must be built first (`cargo build --workspace --bins`), as for every test here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use trainyard_tests::{bin, repo_root};

#[test]
fn alerting_rules_name_metrics_that_exist() -> Result<()> {
    let root = repo_root();
    let rules = read(&root.join("deploy/prometheus/trainyard-alerts.yml"))?;
    let mut exported = BTreeSet::new();
    for source in ["controller/src/metrics.rs", "agent/src/metrics.rs", "store/src/metrics.rs"] {
        let text = read(&root.join(source))?;
        for line in text.lines() {
            // The tables: //! | `trainyard_jobs{state}` | gauge | ...
            if let Some(rest) = line.strip_prefix("//! | `") {
                let name = rest.split(['`', '{']).next().unwrap_or("");
                exported.insert(name.to_string());
            }
            // DCGM exporter names: DcgmField { name: "DCGM_FI_DEV_SM_CLOCK", ...
            if let Some(i) = line.find("name: \"DCGM_FI_") {
                let name = line[i + 7..].split('"').next().unwrap_or("");
                exported.insert(name.to_string());
            }
        }
    }
    let mut named = 0;
    for line in rules.lines().filter(|l| l.trim_start().starts_with("expr:")) {
        for word in line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("trainyard_") || word.starts_with("DCGM_FI_") {
                ensure!(
                    exported.contains(word),
                    "the alerting rules use {word}, which nothing exports: {line}"
                );
                named += 1;
            }
        }
    }
    ensure!(named >= 5, "only {named} metric names found in the rules");
    ensure!(rules.starts_with("# ") && rules.contains("\ngroups:\n"), "not a rules file");
    Ok(())
}

#[test]
fn group_env_files_set_only_variables_their_unit_or_binary_reads() -> Result<()> {
    let root = repo_root();
    let dir = root.join("deploy/group");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).with_context(|| format!("list {}", dir.display()))? {
        let path = entry?.path();
        let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let Some(stem) = file.strip_suffix(".env") else { continue };
        let role = if stem.starts_with("controller") { "controller" } else { "agent" };
        let unit = read(&root.join(format!("deploy/systemd/trainyard-{role}.service")))?;
        let help = Command::new(bin(&format!("trainyard-{role}"))?).arg("--help").output()?;
        let help = String::from_utf8_lossy(&help.stdout).into_owned();
        for line in read(&path)?.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (name, value) =
                line.split_once('=').with_context(|| format!("{file}: {line:?} is not NAME=value"))?;
            ensure!(is_variable_name(name) && !value.is_empty(), "{file}: {line:?}");
            let read_by_unit = unit.contains(&format!("${{{name}}}")) || unit.contains(&format!("${name}"));
            // `[env: NAME=value]`, or `[env: NAME]` where the value is hidden.
            let read_by_binary =
                help.contains(&format!("[env: {name}=")) || help.contains(&format!("[env: {name}]"));
            ensure!(
                read_by_unit || read_by_binary,
                "{file}: {name} is read neither by trainyard-{role}.service nor by trainyard-{role} (no [env: {name}=] in its --help)"
            );
            checked += 1;
        }
    }
    ensure!(checked >= 8, "only {checked} variables in {}", dir.display());
    Ok(())
}

#[test]
fn systemd_units_start_the_binaries_with_flags_they_have() -> Result<()> {
    let root = repo_root();
    let workspace = Workspace::load(&root)?;
    let dir = root.join("deploy/systemd");
    let mut units = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("list {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "service") {
            units.push(path);
        }
    }
    units.sort();
    let names: BTreeSet<String> =
        units.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect();
    for expected in ["trainyard-agent.service", "trainyard-controller.service"] {
        ensure!(names.contains(expected), "{} lacks {expected}: {names:?}", dir.display());
    }

    for path in &units {
        let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let unit = Unit::parse(&read(path)?).with_context(|| format!("parse {file}"))?;

        // Site settings (the database URL with its password) live outside the unit, in an
        // optional file: `EnvironmentFile=-/etc/trainyard/controller.env` for
        // trainyard-controller.service.
        if let Some(role) = file.strip_prefix("trainyard-").and_then(|f| f.strip_suffix(".service")) {
            let env_file = format!("-/etc/trainyard/{role}.env");
            ensure!(
                unit.environment_files.contains(&env_file),
                "{file}: no EnvironmentFile={env_file} (has {:?})",
                unit.environment_files
            );
        }

        ensure!(unit.exec_start.len() == 1, "{file}: {} ExecStart= lines, expected 1", unit.exec_start.len());
        let argv = unit.command_line(&unit.exec_start[0]).with_context(|| format!("{file}: ExecStart="))?;
        let (program, args) = argv.split_first().with_context(|| format!("{file}: ExecStart= is empty"))?;
        let name =
            Path::new(program).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        ensure!(
            workspace.binaries().contains(name.as_str()),
            "{file}: ExecStart= runs {program}, not a binary of this workspace ({:?})",
            workspace.binaries()
        );
        let expected_path = format!("/usr/local/bin/{name}");
        ensure!(*program == expected_path, "{file}: ExecStart= runs {program}, expected {expected_path}");

        let exe = bin(&name)?;
        let out = Command::new(&exe)
            .args(args)
            .arg("--help")
            .envs(unit.environment.iter())
            .output()
            .with_context(|| format!("run {}", exe.display()))?;
        let shown = format!("{name} {} --help", args.join(" "));
        ensure!(
            out.status.success(),
            "{file}: `{shown}` exited with {}; the unit passes a flag or value the binary does not \
             take:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        ensure!(!out.stdout.is_empty(), "{file}: `{shown}` printed no help");
    }
    Ok(())
}

#[test]
fn unit_command_lines_are_read_the_way_systemd_reads_them() -> Result<()> {
    let text = "[Unit]\nDescription=x \\\n  y\n\n[Service]\nEnvironment=A=1 \"B=two words\"\n\
                Environment=\"ARGS=--x 1\"\nEnvironmentFile=-/etc/x.env\n\
                ExecStart=-/usr/bin/prog \\\n    --a ${A} \\\n# a comment inside the command\n\
                ; and another\n    --b \"${B}\" \\\n    $ARGS $UNSET --c=$$HOME ${UNSET}\n";
    let unit = Unit::parse(text)?;
    assert_eq!(unit.environment_files, ["-/etc/x.env"]);
    assert_eq!(unit.exec_start.len(), 1, "{:?}", unit.exec_start);
    let argv = unit.command_line(&unit.exec_start[0])?;
    assert_eq!(argv, ["/usr/bin/prog", "--a", "1", "--b", "two words", "--x", "1", "--c=$HOME", ""]);
    assert!(unit.command_line("/usr/bin/prog a$A").is_err(), "a braceless variable inside a word");
    Ok(())
}

/// Every `ENTRYPOINT` of the Containerfile starts a binary of this workspace with flags it has
/// (run with `--help` after them, as the units are).
#[test]
fn containerfile_entrypoints_pass_flags_the_binaries_have() -> Result<()> {
    let text = read(&repo_root().join("deploy/Containerfile"))?;
    let mut checked = 0;
    for line in logical_lines(&text, Syntax::Containerfile) {
        let Some(array) = line.trim().strip_prefix("ENTRYPOINT ") else { continue };
        let argv: Vec<String> = serde_json::from_str(array.trim())
            .with_context(|| format!("ENTRYPOINT {array}: not the exec (JSON array) form"))?;
        let (program, args) = argv.split_first().context("an empty ENTRYPOINT")?;
        let out = Command::new(bin(program)?).args(args).arg("--help").output()?;
        ensure!(
            out.status.success(),
            "Containerfile: `{} --help` fails: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        checked += 1;
    }
    ensure!(checked == 2, "{checked} ENTRYPOINT lines, expected the controller's and the agent's");
    Ok(())
}

#[test]
fn containerfile_builds_this_workspace_and_runs_as_non_root() -> Result<()> {
    let root = repo_root();
    let workspace = Workspace::load(&root)?;
    let path = root.join("deploy/Containerfile");
    let text = read(&path)?;
    let file = path.display();
    // The escape directive would change the line continuation character this test relies on.
    for line in text.lines().take_while(|l| l.trim_start().starts_with('#')) {
        let directive: String = line.chars().filter(|c| !c.is_whitespace()).collect();
        ensure!(
            !directive.to_ascii_lowercase().starts_with("#escape="),
            "{file}: the escape directive is not supported here"
        );
    }

    let mut stages: Vec<Stage> = Vec::new();
    // Stages that another stage builds on (FROM) or copies from (COPY --from): not final.
    let mut referenced: BTreeSet<String> = BTreeSet::new();
    let mut cargo_builds = 0;
    let mut built: BTreeSet<String> = BTreeSet::new();
    let mut copied: Vec<String> = Vec::new();
    let mut torch_version: Option<String> = None;
    for line in logical_lines(&text, Syntax::Containerfile) {
        let line = line.trim();
        let (instruction, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let rest = rest.trim();
        let words: Vec<&str> = rest.split_whitespace().collect();
        match instruction.to_ascii_uppercase().as_str() {
            "FROM" => {
                let mut operands = words.iter().filter(|w| !w.starts_with("--"));
                let base = operands.next().with_context(|| format!("{file}: FROM without an image"))?;
                let name = match operands.next() {
                    Some(word) if word.eq_ignore_ascii_case("as") => {
                        Some(operands.next().with_context(|| format!("{file}: AS without a name"))?)
                    }
                    _ => None,
                };
                let parent =
                    stages.iter().find(|s| s.name.as_deref().is_some_and(|n| n.eq_ignore_ascii_case(base)));
                // A stage built on another inherits its USER.
                let user = parent.and_then(|p| p.user.clone());
                if parent.is_some() {
                    referenced.insert(base.to_ascii_lowercase());
                }
                stages.push(Stage { name: name.map(|n| n.to_ascii_lowercase()), user });
            }
            "USER" => {
                let stage = stages.last_mut().with_context(|| format!("{file}: USER before FROM"))?;
                stage.user = Some(rest.to_string());
            }
            "COPY" => {
                if let Some(from) = words.iter().find_map(|w| w.strip_prefix("--from=")) {
                    referenced.insert(from.to_ascii_lowercase());
                    let operands: Vec<&str> =
                        words.iter().copied().filter(|w| !w.starts_with("--")).collect();
                    let sources = operands.split_last().map(|(_, sources)| sources).unwrap_or_default();
                    for source in sources {
                        if let Some((_, binary)) = source.rsplit_once("/target/release/") {
                            copied.push(binary.to_string());
                        }
                    }
                }
            }
            "RUN" => {
                if let Some(at) = rest.find("cargo build") {
                    cargo_builds += 1;
                    let command =
                        rest[at + "cargo build".len()..].split(['&', ';', '|']).next().unwrap_or_default();
                    ensure!(
                        command.split_whitespace().any(|w| w == "--release"),
                        "{file}: `cargo build{command}` is not a release build"
                    );
                    built.extend(cargo_packages(command)?);
                }
            }
            "ARG" => {
                if let Some(version) = rest.strip_prefix("TORCH_VERSION=") {
                    torch_version = Some(version.trim().to_string());
                }
            }
            _ => {}
        }
    }

    ensure!(cargo_builds > 0, "{file}: no `cargo build`");
    ensure!(!built.is_empty(), "{file}: `cargo build` names no package (-p)");
    let known: Vec<&String> = workspace.packages.keys().collect();
    let mut built_binaries = BTreeSet::new();
    for package in &built {
        let binaries = workspace.packages.get(package).with_context(|| {
            format!(
                "{file}: `cargo build -p {package}`: no such package among the workspace members {known:?}"
            )
        })?;
        built_binaries.extend(binaries.iter().map(String::as_str));
    }
    ensure!(!copied.is_empty(), "{file}: no stage copies a binary out of target/release");
    for binary in &copied {
        ensure!(
            built_binaries.contains(binary.as_str()),
            "{file}: copies target/release/{binary}, which the `cargo build` does not build \
             (it builds {built_binaries:?})"
        );
    }

    let finals: Vec<&Stage> =
        stages.iter().filter(|s| s.name.as_ref().is_none_or(|n| !referenced.contains(n))).collect();
    let final_names: BTreeSet<&str> = finals.iter().filter_map(|s| s.name.as_deref()).collect();
    ensure!(
        final_names == BTreeSet::from(["agent", "controller"]) && finals.len() == 2,
        "{file}: the final stages (targets) should be `controller` and `agent`, found {final_names:?} \
         ({} final stages)",
        finals.len()
    );
    for stage in finals {
        let label = stage.name.as_deref().unwrap_or("(unnamed)");
        let user = stage
            .user
            .as_deref()
            .with_context(|| format!("{file}: stage {label} sets no USER: it runs as root"))?;
        let name = user.split(':').next().unwrap_or_default().trim();
        ensure!(
            !name.is_empty() && !name.starts_with('$'),
            "{file}: stage {label}: USER {user:?} is not a literal user this test can check"
        );
        ensure!(name != "root" && name != "0", "{file}: stage {label} runs as root (USER {user})");
    }

    let setup = read(&root.join("deploy/setup.sh"))?;
    let wanted = setup
        .lines()
        .find_map(|l| l.trim().strip_prefix("TORCH_VERSION="))
        .context("deploy/setup.sh sets no TORCH_VERSION")?
        .trim();
    ensure!(
        torch_version.as_deref() == Some(wanted),
        "{file}: ARG TORCH_VERSION is {torch_version:?}, deploy/setup.sh installs torch {wanted}"
    );
    Ok(())
}

/// A build stage of the Containerfile: its name (lower case, `FROM ... AS name`) and the user
/// its last `USER` (or the stage it is built on) sets.
struct Stage {
    name: Option<String>,
    user: Option<String>,
}

/// What a unit file's `[Service]` section says that matters here.
#[derive(Debug, Default)]
struct Unit {
    exec_start: Vec<String>,
    environment: BTreeMap<String, String>,
    environment_files: Vec<String>,
}

impl Unit {
    fn parse(text: &str) -> Result<Unit> {
        let mut unit = Unit::default();
        let mut section = String::new();
        for line in logical_lines(text, Syntax::Systemd) {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.to_string();
                continue;
            }
            let Some((key, value)) = line.split_once('=') else { bail!("not KEY=VALUE: {line:?}") };
            if section != "Service" {
                continue;
            }
            let value = value.trim();
            match key.trim() {
                // An empty ExecStart= resets the list (drop-ins use it).
                "ExecStart" if value.is_empty() => unit.exec_start.clear(),
                "ExecStart" => unit.exec_start.push(value.to_string()),
                "Environment" => {
                    for assignment in split_words(value)? {
                        let (name, val) = assignment.split_once('=').with_context(|| {
                            format!("Environment={value}: {assignment:?} is not NAME=VALUE")
                        })?;
                        unit.environment.insert(name.to_string(), val.to_string());
                    }
                }
                "EnvironmentFile" => unit.environment_files.push(value.to_string()),
                _ => {}
            }
        }
        Ok(unit)
    }

    /// The argv systemd runs for an `ExecStart=` value, as it runs it when the unit's optional
    /// environment files (`EnvironmentFile=-...`) are absent, which is the case on the machine
    /// running this test: variables come from the unit's own `Environment=` lines only. That
    /// replaces each variable with the value the unit falls back to, and drops a `$NAME` word
    /// whose variable only an environment file would set, exactly as systemd would.
    fn command_line(&self, exec_start: &str) -> Result<Vec<String>> {
        // Prefixes before the path: "-" (exit status ignored), "@" (the second word is argv[0]),
        // ":" (no variable expansion), "+", "!", "!!" (privileges), "|" (run through a shell).
        let bare = exec_start.trim_start_matches(['-', '@', ':', '+', '!', '|']);
        let prefixes = &exec_start[..exec_start.len() - bare.len()];
        ensure!(!prefixes.contains('|'), "{exec_start:?}: the shell prefix | is not supported here");
        ensure!(
            !bare.replace("%%", "").contains('%'),
            "{exec_start:?}: specifiers (%i, %h, ...) are not supported here"
        );
        let mut words = split_words(&bare.replace("%%", "%"))?;
        if prefixes.contains('@') && words.len() > 1 {
            words.remove(1);
        }
        if prefixes.contains(':') {
            return Ok(words);
        }
        let mut argv = Vec::new();
        for word in &words {
            argv.extend(self.expand(word)?);
        }
        Ok(argv)
    }

    /// One word of a command line after systemd's variable expansion: a word that is `$NAME`
    /// alone becomes the variable's value split at whitespace (no word at all when it is unset
    /// or empty); `${NAME}` anywhere in a word becomes the value, unsplit (empty when unset);
    /// `$$` is a `$`. A `$NAME` inside a longer word is refused: systemd would pass it on as it
    /// is, which is never what a unit means.
    fn expand(&self, word: &str) -> Result<Vec<String>> {
        if let Some(name) = word.strip_prefix('$').filter(|n| is_variable_name(n)) {
            return Ok(self.var(name).split_whitespace().map(str::to_string).collect());
        }
        let mut out = String::new();
        let mut rest = word;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let after = &rest[at + 1..];
            if let Some(tail) = after.strip_prefix('$') {
                out.push('$');
                rest = tail;
            } else if let Some(braced) = after.strip_prefix('{') {
                let end = braced.find('}').with_context(|| format!("{word:?}: unclosed ${{"))?;
                let name = &braced[..end];
                ensure!(is_variable_name(name), "{word:?}: {name:?} is not a variable name");
                out.push_str(self.var(name));
                rest = &braced[end + 1..];
            } else {
                bail!("{word:?}: systemd expands $NAME only as a word of its own; write ${{NAME}}");
            }
        }
        out.push_str(rest);
        Ok(vec![out])
    }

    /// A variable's value from the unit's `Environment=` lines; empty when unset.
    fn var(&self, name: &str) -> &str {
        self.environment.get(name).map(String::as_str).unwrap_or_default()
    }
}

fn is_variable_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Splits a unit file value into words as systemd does for command lines and `Environment=`:
/// at whitespace outside quotes; double or single quotes group and are removed; a backslash
/// takes the next character as it is.
fn split_words(value: &str) -> Result<Vec<String>> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (_, '\\') => {
                let next = chars.next().with_context(|| format!("{value:?} ends in a backslash"))?;
                word.get_or_insert_with(String::new).push(next);
            }
            (Some(q), _) if c == q => quote = None,
            (Some(_), _) => word.get_or_insert_with(String::new).push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                // A quoted empty string is still a word.
                word = Some(word.take().unwrap_or_default());
            }
            (None, _) if c.is_whitespace() => words.extend(word.take()),
            (None, _) => word.get_or_insert_with(String::new).push(c),
        }
    }
    ensure!(quote.is_none(), "{value:?}: unclosed quote");
    words.extend(word);
    Ok(words)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Syntax {
    Systemd,
    Containerfile,
}

/// The logical lines of a unit file or a Containerfile. A line ending in a backslash goes on
/// with the next one (the backslash becomes a space), and comment lines are dropped, also in the
/// middle of a continued line, as both systemd (systemd.syntax(7)) and Containerfile parsers
/// do. They differ on a blank line inside a continued line: it ends the line for systemd and is
/// skipped in a Containerfile.
fn logical_lines(text: &str, syntax: Syntax) -> Vec<String> {
    let is_comment = |line: &str| {
        let line = line.trim_start();
        line.starts_with('#') || (syntax == Syntax::Systemd && line.starts_with(';'))
    };
    let mut lines = Vec::new();
    let mut pending: Option<String> = None;
    for raw in text.lines() {
        let blank_inside = pending.is_some() && raw.trim().is_empty();
        if is_comment(raw) || (blank_inside && syntax == Syntax::Containerfile) {
            continue;
        }
        let mut line = pending.take().unwrap_or_default();
        match raw.trim_end().strip_suffix('\\') {
            Some(head) => {
                line.push_str(head);
                line.push(' ');
                pending = Some(line);
            }
            None => {
                line.push_str(raw);
                lines.push(line);
            }
        }
    }
    lines.extend(pending);
    lines
}

/// The packages a `cargo build` command line selects: `-p NAME`, `-pNAME`, `--package NAME`,
/// `--package=NAME`.
fn cargo_packages(args: &str) -> Result<Vec<String>> {
    let mut packages = Vec::new();
    let mut words = args.split_whitespace();
    while let Some(word) = words.next() {
        let joined =
            word.strip_prefix("--package=").or_else(|| word.strip_prefix("-p").filter(|n| !n.is_empty()));
        let name = match (word, joined) {
            ("-p" | "--package", _) => {
                words.next().with_context(|| format!("{word} without a package name"))?
            }
            (_, Some(name)) => name,
            (_, None) => continue,
        };
        packages.push(name.trim_matches(['"', '\'']).to_string());
    }
    Ok(packages)
}

/// The workspace's packages (the members of the root Cargo.toml) and the binaries each builds.
struct Workspace {
    packages: BTreeMap<String, Vec<String>>,
}

impl Workspace {
    /// Reads the manifests line by line (the tests crate has no TOML parser): `members = [...]`
    /// in the root manifest, and `name = "..."` under `[package]` and `[[bin]]` in each
    /// member's. A member without `[[bin]]` builds one binary named after the package when it
    /// has src/main.rs, as cargo does.
    fn load(root: &Path) -> Result<Workspace> {
        let manifest = read(&root.join("Cargo.toml"))?;
        let members = string_array(&manifest, "members").context("Cargo.toml: no `members = [...]`")?;
        ensure!(!members.is_empty(), "Cargo.toml: `members` is empty");
        let mut packages = BTreeMap::new();
        for member in members {
            let dir = root.join(&member);
            let text = read(&dir.join("Cargo.toml"))?;
            let mut table = String::new();
            let mut package = None;
            let mut binaries = Vec::new();
            for line in text.lines() {
                let line = line.trim();
                if line.starts_with('[') {
                    table = line.to_string();
                    continue;
                }
                let Some(value) = line.strip_prefix("name").and_then(|r| r.trim_start().strip_prefix('='))
                else {
                    continue;
                };
                let value = value.trim().trim_matches('"').to_string();
                match table.as_str() {
                    "[package]" => package = Some(value),
                    "[[bin]]" => binaries.push(value),
                    _ => {}
                }
            }
            let package = package.with_context(|| format!("{member}/Cargo.toml: no name in [package]"))?;
            if binaries.is_empty() && dir.join("src/main.rs").is_file() {
                binaries.push(package.clone());
            }
            packages.insert(package, binaries);
        }
        Ok(Workspace { packages })
    }

    fn binaries(&self) -> BTreeSet<&str> {
        self.packages.values().flatten().map(String::as_str).collect()
    }
}

/// The strings of `key = [ "a", "b" ]` in a TOML text, the array possibly spread over lines.
fn string_array(text: &str, key: &str) -> Option<Vec<String>> {
    let start = text.lines().position(|l| {
        l.trim_start().strip_prefix(key).is_some_and(|rest| rest.trim_start().starts_with('='))
    })?;
    let rest = text.lines().skip(start).collect::<Vec<_>>().join("\n");
    let open = rest.find('[')?;
    let close = open + rest[open..].find(']')?;
    Some(rest[open + 1..close].split('"').skip(1).step_by(2).map(str::to_string).collect())
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))
}

/// The demo run as root never runs its ranks as root unless the operator says so in words:
/// without `--run-ranks-as-root` it refuses to start, saying why. (Before, it added
/// `--allow-root-ranks` by itself.)
#[test]
fn the_demo_as_root_refuses_to_run_ranks_as_root_unasked() -> anyhow::Result<()> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        assert!(std::env::var_os("CI").is_none(), "CI runs as root: this must run there");
        println!("skipped: the demo's refusal is for root");
        return Ok(());
    }
    let out = std::process::Command::new("bash")
        .arg(trainyard_tests::repo_root().join("deploy/demo.sh"))
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("would run as root") && err.contains("--run-ranks-as-root"), "{err}");
    Ok(())
}
