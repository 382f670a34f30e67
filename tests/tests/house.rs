//! The rules of the house that cargo cannot enforce (docs/architecture.md, "Rules of the
//! house"):
//! - inside every crate, the top-level modules import one another without a circle: a circle
//!   means two modules that cannot be understood, tested or moved apart;
//! - the pure crates (`trainyard-model`, `trainyard-placement`, `trainyard-analysis`) depend on
//!   no database, runtime, network or HTTP crate, directly or through another crate;
//! - no source file outside tests, benches and vendored code is longer than 600 lines, and no
//!   function longer than 100 (aim for 80: a function a reader cannot hold is a function to
//!   split).
//!
//! The module graph is read from the source: an edge `a -> b` for every `crate::b` path
//! outside comments in the files of module `a`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// The workspace's member folders, read from the root Cargo.toml.
fn members() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("Cargo.toml")).expect("read Cargo.toml");
    let line = text.lines().find(|l| l.trim_start().starts_with("members")).expect("a members line");
    line.split('"').skip(1).step_by(2).map(str::to_owned).collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file under `src` belongs to; `None` for the crate roots and binaries.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    if matches!(first, "lib.rs" | "main.rs" | "bin") {
        return None;
    }
    Some(first.trim_end_matches(".rs").to_owned())
}

/// The code of a line, without its `//` comment (string literals holding `//` are rare
/// enough in `crate::` lines not to matter).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// `module -> modules it names through crate::`, for one crate's `src`.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(src, f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(from) = module_of(src, file) else { continue };
        let text = std::fs::read_to_string(file).expect("read a source file");
        let edges = graph.entry(from.clone()).or_default();
        for line in text.lines().map(code) {
            for (i, _) in line.match_indices("crate::") {
                let preceded_by_ident = line[..i]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$');
                if preceded_by_ident {
                    continue;
                }
                let rest = &line[i + "crate::".len()..];
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if name != from && modules.contains(&name) {
                    edges.insert(name);
                }
            }
        }
    }
    graph
}

/// A circle in `graph`, as the modules along it, if there is one.
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node.to_owned());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(circle) = visit(next, graph, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|start| visit(start, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_crate_has_a_circle_between_its_modules() {
    let mut circles = Vec::new();
    for member in members() {
        let src = root().join(&member).join("src");
        if let Some(circle) = find_circle(&module_graph(&src)) {
            circles.push(format!("{member}: {}", circle.join(" -> ")));
        }
    }
    assert!(circles.is_empty(), "modules that import each other in a circle:\n{}", circles.join("\n"));
}

#[test]
fn the_circle_finder_finds_a_circle_and_passes_a_tree() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry((*a).to_owned()).or_default().insert((*b).to_owned());
        }
        g
    };
    let tree = graph(&[("core", "store"), ("core", "cost"), ("service", "core"), ("cost", "links")]);
    assert_eq!(find_circle(&tree), None);
    let circle = graph(&[("core", "store"), ("store", "service"), ("service", "core")]);
    assert_eq!(find_circle(&circle).expect("a circle").len(), 4);
    let dir = tempfile::tempdir().expect("a temp dir");
    std::fs::write(dir.path().join("a.rs"), "use crate::b::X; // crate::c is only named here\n").unwrap();
    std::fs::write(dir.path().join("b.rs"), "fn f() { trainyard_crate::a(); crate::a::g() }\n").unwrap();
    std::fs::write(dir.path().join("c.rs"), "\n").unwrap();
    let g = module_graph(dir.path());
    assert_eq!(g["a"], BTreeSet::from(["b".to_owned()]));
    assert_eq!(g["b"], BTreeSet::from(["a".to_owned()]));
    assert!(find_circle(&g).is_some());
}

/// Crates a pure crate must not depend on: they do I/O (database, runtime, network, HTTP).
const IO_CRATES: &[&str] =
    &["sqlx", "tokio", "tonic", "axum", "hyper", "reqwest", "tokio-rustls", "tch", "nvml-wrapper", "cudarc"];

/// The crates `package` builds on, as cargo resolves them when it is built alone (its own
/// features only), without build and dev dependencies.
fn dependencies_alone(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["tree", "--offline", "--locked", "-e", "normal", "--prefix", "none", "-p", package])
        .current_dir(root())
        .output()
        .expect("run cargo tree");
    assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect()
}

#[test]
fn pure_crates_build_on_no_io_crate_even_indirectly() {
    for package in ["trainyard-model", "trainyard-placement", "trainyard-analysis"] {
        let deps = dependencies_alone(package);
        assert!(deps.iter().any(|d| d == "trainyard-proto"), "{package}: cargo tree lists {deps:?}");
        let io: Vec<&String> = deps.iter().filter(|d| IO_CRATES.contains(&d.as_str())).collect();
        assert!(io.is_empty(), "{package} is a pure crate but builds on {io:?}");
    }
}

#[test]
fn pure_crates_depend_on_no_io_crate() {
    for member in ["model", "placement", "analysis"] {
        let manifest =
            std::fs::read_to_string(root().join(member).join("Cargo.toml")).expect("read a manifest");
        let deps = manifest.split("[dependencies]").nth(1).unwrap_or("");
        let deps = deps.split("\n[").next().unwrap_or("");
        for line in deps.lines() {
            let name = line.split(['=', '.']).next().unwrap_or("").trim();
            assert!(!IO_CRATES.contains(&name), "{member} is a pure crate but depends on {name}");
        }
    }
}

/// Source files allowed past the length limit: test suites and generated or vendored code.
fn exempt(path: &Path) -> bool {
    let s = path.to_string_lossy();
    s.contains("/tests/") || s.contains("/benches/") || s.ends_with("tests.rs") || s.contains("/vendor/")
}

#[test]
fn no_source_file_is_longer_than_600_lines() {
    let mut long = Vec::new();
    for member in members() {
        let mut files = Vec::new();
        rust_files(&root().join(&member).join("src"), &mut files);
        for file in files.into_iter().filter(|f| !exempt(f)) {
            let lines = std::fs::read_to_string(&file).expect("read a source file").lines().count();
            if lines > 600 {
                long.push(format!(
                    "{} ({lines} lines)",
                    file.strip_prefix(root()).unwrap_or(&file).display()
                ));
            }
        }
    }
    assert!(long.is_empty(), "source files over 600 lines:\n{}", long.join("\n"));
}

/// Functions still longer than the limit, each with the issue that splits it.
const LONG_FUNCTIONS_PENDING: &[(&str, &str, &str)] = &[];

/// `line` without its string and char literals and its `//` comment: what braces count.
fn braces_of(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                while let Some(d) = chars.next() {
                    match d {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            // A char literal ('{', '\\'', '\\n'); a lifetime ('a) has no closing quote nearby.
            '\'' => {
                let rest: String = chars.clone().take(3).collect();
                if rest.starts_with('\\') && rest.chars().nth(2) == Some('\'') {
                    chars.nth(2);
                } else if rest.chars().nth(1) == Some('\'') {
                    chars.nth(1);
                }
            }
            '/' if chars.peek() == Some(&'/') => break,
            '{' | '}' => out.push(c),
            _ => {}
        }
    }
    out
}

/// (name, first line, length in lines) of every `fn` with a body in `text`.
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let Some(at) = code.find("fn ").filter(|&at| {
            let head = &code[..at];
            !code.starts_with("//")
                && head
                    .split_whitespace()
                    .all(|w| matches!(w, "pub" | "pub(crate)" | "pub(super)" | "async" | "const" | "unsafe"))
        }) else {
            continue;
        };
        let name: String = code[at + 3..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let mut depth = 0i32;
        let mut opened = false;
        for (j, body) in lines[i..].iter().enumerate() {
            for b in braces_of(body).chars() {
                depth += if b == '{' { 1 } else { -1 };
                opened = true;
            }
            if opened && depth == 0 {
                found.push((name.clone(), i + 1, j + 1));
                break;
            }
            if !opened && body.trim_end().ends_with(';') {
                break;
            }
        }
    }
    found
}

#[test]
fn no_function_is_longer_than_100_lines() {
    let mut long = Vec::new();
    for member in members() {
        let mut files = Vec::new();
        rust_files(&root().join(&member).join("src"), &mut files);
        for file in files.into_iter().filter(|f| !exempt(f)) {
            let path = file.strip_prefix(root()).unwrap_or(&file).display().to_string();
            let text = std::fs::read_to_string(&file).expect("read a source file");
            for (name, line, length) in functions(&text) {
                let pending = LONG_FUNCTIONS_PENDING.iter().any(|(p, n, _)| *p == path && *n == name);
                if length > 100 && !pending {
                    long.push(format!("{path}:{line} fn {name} ({length} lines)"));
                }
            }
        }
    }
    assert!(long.is_empty(), "functions over 100 lines:\n{}", long.join("\n"));
}

#[test]
fn the_function_measure_skips_braces_in_strings_and_chars() {
    let text = "pub fn a() {\n    let s = \"{{\";\n    let c = '{';\n}\nfn b<'x>(v: &'x str) -> &'x str {\n    v // }\n}\n";
    assert_eq!(functions(text), vec![("a".to_owned(), 1, 4), ("b".to_owned(), 5, 3)]);
}

/// The controller's files outside its core that hold or call the store: only the daemon's
/// wiring (`bin/`, which opens the store and hands it to the core) may.
fn store_holders_outside_core(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    // The trait itself, not `StoreError` and the like.
    let the_trait = |c: &str, name: &str| {
        c.match_indices(name).any(|(at, _)| {
            c[at + name.len()..].chars().next().is_none_or(|n| !n.is_alphanumeric() && n != '_')
        })
    };
    let names_store = |line: &str| {
        let c = code(line);
        the_trait(c, "dyn Store") || the_trait(c, "trainyard_store::Store") || c.contains("store: Arc<")
    };
    files
        .iter()
        .filter(|f| !f.starts_with(src.join("core")) && !f.starts_with(src.join("bin")) && !exempt(f))
        .filter(|f| !f.file_name().is_some_and(|n| n.to_string_lossy().ends_with("tests.rs")))
        .filter(|f| std::fs::read_to_string(f).is_ok_and(|t| t.lines().any(names_store)))
        .map(|f| f.strip_prefix(src).unwrap_or(f).display().to_string())
        .collect()
}

#[test]
fn nothing_outside_the_controllers_core_touches_the_store() {
    let holders = store_holders_outside_core(&root().join("controller/src"));
    assert!(holders.is_empty(), "files outside controller/src/core that hold the store: {holders:?}");
}

/// The core's services, each one type in one file with one `impl` (docs/architecture.md).
const SERVICES: [(&str, &str); 5] = [
    ("jobs.rs", "Jobs"),
    ("nodes.rs", "Nodes"),
    ("receipts.rs", "Receipts"),
    ("diagnosis.rs", "Diagnoses"),
    ("auth.rs", "Auth"),
];

#[test]
fn each_service_of_the_core_is_one_impl_in_one_file() {
    let core = root().join("controller/src/core");
    let mut files = Vec::new();
    rust_files(&core, &mut files);
    for (file, service) in SERVICES {
        let impls = |text: &str| {
            text.lines()
                .filter(|l| {
                    let c = code(l);
                    c.starts_with(&format!("impl {service} ")) || c.starts_with(&format!("impl {service}<"))
                })
                .count()
        };
        for f in &files {
            let text = std::fs::read_to_string(f).expect("read a core file");
            let expected = usize::from(f.ends_with(file));
            assert_eq!(impls(&text), expected, "{}: `impl {service}` blocks (one, in {file})", f.display());
        }
    }
}
