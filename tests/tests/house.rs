//! The rules of the house that cargo cannot enforce (docs/architecture.md, "Rules of the
//! house"):
//! - inside every crate, modules at any depth import one another without a circle: a circle
//!   means two modules that cannot be understood, tested or moved apart (a parent that names
//!   its children's types while they extend its own is one);
//! - the pure crates (`trainyard-model`, `trainyard-placement`, `trainyard-analysis`) depend on
//!   no database, runtime, network or HTTP crate, directly or through another crate;
//! - no source file outside tests, benches and vendored code is longer than 600 lines, in any
//!   of the repository's languages (Rust, JavaScript, Python, shell, SQL, proto), and no Rust
//!   function longer than 80 (a function a reader cannot hold is a function to split);
//! - no type has inherent `impl` blocks in more than one file: a reader finds all of a type's
//!   own methods in one place.
//!
//! The module graph is read from the source: an edge `a -> b` for every path in module `a`'s
//! code or private `use` statements that leads to module `b` (`crate::`, `super::`, `self::` or
//! a child's name), followed through re-exports to the module that defines the name; `mod` and
//! `pub use` lines only say where things live, and test modules are left out.

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

/// The code of a line, without its `//` comment (string literals holding `//` are rare
/// enough in paths not to matter).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

// ---- The module graph at every depth ----

/// One crate's modules by path (`core`, `core::faults`; the root is left out), each with its
/// code: comments, `#[cfg(test)]` modules and test-only files left out.
fn crate_modules(src: &Path) -> BTreeMap<String, String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut modules = BTreeMap::new();
    let mut test_only = BTreeSet::new();
    for file in &files {
        let Ok(rel) = file.strip_prefix(src) else { continue };
        let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        if parts.first().is_some_and(|p| p == "bin") {
            continue;
        }
        let last = parts.pop().unwrap_or_default();
        if last != "mod.rs" && !(parts.is_empty() && matches!(last.as_str(), "lib.rs" | "main.rs")) {
            parts.push(last.trim_end_matches(".rs").to_owned());
        }
        let path = parts.join("::");
        let text = std::fs::read_to_string(file).expect("read a source file");
        let mut kept = String::new();
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            if line.trim() == "#[cfg(test)]" {
                let next = lines.peek().map(|l| l.trim()).unwrap_or("");
                if let Some(name) = next.strip_prefix("mod ").and_then(|n| n.strip_suffix(';')) {
                    test_only.insert(if path.is_empty() {
                        name.to_owned()
                    } else {
                        format!("{path}::{name}")
                    });
                } else if next.starts_with("mod ") {
                    break;
                }
            }
            kept.push_str(&without_visibility_paths(code(line)));
            kept.push('\n');
        }
        modules.insert(path, kept);
    }
    modules.retain(|path, _| !test_only.contains(path));
    modules
}

/// `line` with each `pub(in path)` written `pub`: a visibility names who may see an item, not a
/// module the code depends on.
fn without_visibility_paths(line: &str) -> String {
    let mut out = line.to_string();
    while let Some(at) = out.find("pub(in ") {
        let Some(close) = out[at..].find(')') else { break };
        out.replace_range(at..at + close + 1, "pub");
    }
    out
}

/// The paths a `use` tree names, each as its segments, with the name it brings in.
fn use_paths(tree: &str, prefix: &[String], out: &mut Vec<(String, Vec<String>)>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head: Vec<String> =
            tree[..open].split("::").map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
        let mut base = prefix.to_vec();
        base.extend(head);
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let (mut depth, mut start) = (0, 0);
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    use_paths(&inner[start..i], &base, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        use_paths(&inner[start..], &base, out);
        return;
    }
    if tree.is_empty() || tree == "*" || tree.ends_with("::*") {
        return;
    }
    let (path, alias) = match tree.split_once(" as ") {
        Some((p, a)) => (p.trim(), Some(a.trim())),
        None => (tree, None),
    };
    let mut segments = prefix.to_vec();
    segments
        .extend(path.split("::").map(str::trim).filter(|s| !s.is_empty() && *s != "self").map(str::to_owned));
    let name = alias.map(str::to_owned).or_else(|| segments.last().cloned()).unwrap_or_default();
    out.push((name, segments));
}

/// A statement's start without the braces, attributes and blank space before it.
fn statement_head(s: &str) -> &str {
    let mut s = s.trim_start();
    loop {
        if let Some(rest) = s.strip_prefix(['{', '}']) {
            s = rest.trim_start();
        } else if s.starts_with("#[") {
            s = s.find(']').map_or("", |at| &s[at + 1..]).trim_start();
        } else {
            return s;
        }
    }
}

/// A `use` statement's tree, and whether it re-exports (`pub use`, `pub(crate) use`).
fn use_statement(statement: &str) -> Option<(bool, &str)> {
    let head = statement_head(statement);
    if let Some(tree) = head.strip_prefix("use ") {
        return Some((false, tree));
    }
    let after = head.strip_prefix("pub")?;
    let after = match after.strip_prefix('(') {
        Some(inner) => &inner[inner.find(')')? + 1..],
        None => after,
    };
    after.trim_start().strip_prefix("use ").map(|tree| (true, tree))
}

/// The `use` statements of a module's code: (whether re-exported, the name, its path).
fn uses_of(text: &str) -> Vec<(bool, String, Vec<String>)> {
    let mut out = Vec::new();
    for (public, tree) in text.split(';').filter_map(use_statement) {
        let mut paths = Vec::new();
        use_paths(tree, &[], &mut paths);
        out.extend(paths.into_iter().map(|(n, p)| (public, n, p)));
    }
    out
}

/// Every `a::b::c` path outside `use` and `mod` statements, as its segments.
fn code_paths(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let cleaned: String = text
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.starts_with("mod ") || t.starts_with("pub mod ") || t.starts_with("pub(crate) mod "))
        })
        .collect::<Vec<_>>()
        .join("\n");
    let statements: Vec<&str> = cleaned.split(';').collect();
    for statement in statements {
        if use_statement(statement).is_some() {
            continue;
        }
        let chars: Vec<char> = statement.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let ident = |c: char| c.is_alphanumeric() || c == '_';
            if !ident(chars[i]) || i > 0 && (ident(chars[i - 1]) || chars[i - 1] == ':') {
                i += 1;
                continue;
            }
            let mut segments = Vec::new();
            let mut j = i;
            loop {
                let start = j;
                while j < chars.len() && ident(chars[j]) {
                    j += 1;
                }
                segments.push(chars[start..j].iter().collect::<String>());
                if j + 2 < chars.len() && chars[j] == ':' && chars[j + 1] == ':' && ident(chars[j + 2]) {
                    j += 2;
                } else {
                    break;
                }
            }
            if segments.len() > 1 {
                out.push(segments);
            }
            i = j.max(i + 1);
        }
    }
    out
}

/// The module a path written in module `from` leads to, following `use` re-exports; `None` for
/// paths into other crates.
fn resolve(
    modules: &BTreeMap<String, String>,
    from: &str,
    segments: &[String],
    depth: u32,
) -> Option<String> {
    let join = |base: &[String], seg: &str| {
        let mut v = base.to_vec();
        v.push(seg.to_owned());
        v
    };
    let key = |v: &[String]| v.join("::");
    let mut base: Vec<String> =
        if from.is_empty() { Vec::new() } else { from.split("::").map(str::to_owned).collect() };
    let mut rest = segments;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        Some(first) if modules.contains_key(&key(&join(&base, first))) => {}
        _ => return None,
    }
    for seg in rest {
        let next = join(&base, seg);
        if modules.contains_key(&key(&next)) {
            base = next;
            continue;
        }
        if depth < 8 {
            let here = key(&base);
            if let Some((_, _, path)) = uses_of(&modules[&here]).into_iter().find(|(_, n, _)| n == seg) {
                return resolve(modules, &here, &path, depth + 1).or(Some(here));
            }
        }
        break;
    }
    Some(key(&base))
}

/// `module -> modules it names`, at every depth of one crate: `use` statements (re-exports
/// apart: they only say where a name lives) and paths in code, each followed through
/// re-exports to the module that defines the name.
fn deep_module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = crate_modules(src);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, text) in modules.iter().filter(|(p, _)| !p.is_empty()) {
        let edges = graph.entry(from.clone()).or_default();
        let used = uses_of(text).into_iter().filter(|(public, _, _)| !public).map(|(_, _, p)| p);
        for path in used.chain(code_paths(text)) {
            if let Some(to) = resolve(&modules, from, &path, 0).filter(|to| to != from && !to.is_empty()) {
                edges.insert(to);
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

/// The groups of modules that reach one another (strongly connected, more than one module),
/// each as a circle through all of them where the finder shows one.
fn tangles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let reach = |start: &str, edges: &dyn Fn(&str) -> Vec<String>| {
        let mut seen = BTreeSet::from([start.to_owned()]);
        let mut todo = vec![start.to_owned()];
        while let Some(n) = todo.pop() {
            for m in edges(&n) {
                if seen.insert(m.clone()) {
                    todo.push(m);
                }
            }
        }
        seen
    };
    let forward = |n: &str| graph.get(n).into_iter().flatten().cloned().collect::<Vec<_>>();
    let backward = |n: &str| {
        graph.iter().filter(|(_, to)| to.contains(n)).map(|(from, _)| from.clone()).collect::<Vec<_>>()
    };
    let mut groups: Vec<BTreeSet<String>> = Vec::new();
    for node in graph.keys() {
        if groups.iter().any(|g| g.contains(node)) {
            continue;
        }
        let group: BTreeSet<String> =
            reach(node, &forward).intersection(&reach(node, &backward)).cloned().collect();
        if group.len() > 1 {
            groups.push(group);
        }
    }
    groups
}

/// Circles still to be untangled, as (crate, the module they lie under), each with the issue
/// that does it (none today).
const TANGLES_PENDING: &[(&str, &str)] = &[];

#[test]
fn no_crate_has_a_circle_between_its_modules() {
    let mut circles = Vec::new();
    for member in members() {
        let src = root().join(&member).join("src");
        let graph = deep_module_graph(&src);
        let pending = |g: &BTreeSet<String>| {
            TANGLES_PENDING.iter().any(|(m, under)| {
                *m == member && g.iter().all(|n| n == under || n.starts_with(&format!("{under}::")))
            })
        };
        for group in tangles(&graph).into_iter().filter(|g| !pending(g)) {
            let edges: Vec<String> = group
                .iter()
                .flat_map(|from| {
                    graph[from]
                        .iter()
                        .filter(|to| group.contains(*to))
                        .map(move |to| format!("{from} -> {to}"))
                })
                .collect();
            circles.push(format!("{member}: {}", edges.join(", ")));
        }
    }
    assert!(circles.is_empty(), "modules that reach each other in a circle:\n{}", circles.join("\n"));
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
}

#[test]
fn the_module_graph_reaches_every_depth_and_follows_re_exports() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let write = |path: &str, text: &str| {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "mod core;\nmod store;\n");
    write("store.rs", "pub struct Db; // crate::core is only named here\n");
    // The parent names a child's type; the child extends the parent's: a circle one level down.
    write(
        "core/mod.rs",
        "mod faults;\nmod state;\npub use state::Core;\npub struct C { w: faults::Watch }\n",
    );
    write("core/faults.rs", "use super::C;\npub struct Watch;\nfn f() { trainyard_crate::a(); }\n");
    write(
        "core/state.rs",
        "use crate::store::Db;\npub struct Core { db: Db }\n#[cfg(test)]\nmod tests {\n    use super::super::C;\n}\n",
    );
    let g = deep_module_graph(dir.path());
    assert_eq!(g["core"], BTreeSet::from(["core::faults".to_owned()]));
    assert_eq!(g["core::faults"], BTreeSet::from(["core".to_owned()]));
    assert_eq!(g["core::state"], BTreeSet::from(["store".to_owned()]), "tests and re-exports are not edges");
    assert!(g["store"].is_empty(), "{g:?}");
    assert!(find_circle(&g).is_some());
    assert_eq!(tangles(&g), vec![BTreeSet::from(["core".to_owned(), "core::faults".to_owned()])]);
    // The parent as an index: the child's `super::Core` is the sibling that defines it.
    write("core/mod.rs", "mod faults;\nmod state;\npub use state::{Core, C};\n");
    write("core/faults.rs", "use super::Core;\npub struct Watch;\n");
    write(
        "core/state.rs",
        "use crate::store::Db;\npub struct Core {\n    db: Db,\n}\npub struct C {\n    w: super::faults::Watch,\n}\n",
    );
    let g = deep_module_graph(dir.path());
    assert_eq!(g["core::faults"], BTreeSet::from(["core::state".to_owned()]));
    assert_eq!(g["core::state"], BTreeSet::from(["core::faults".to_owned(), "store".to_owned()]));
    assert!(g["core"].is_empty(), "an index names nothing: {g:?}");
    assert_eq!(tangles(&g).len(), 1, "state and faults still name each other");
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
fn no_function_is_longer_than_80_lines() {
    let mut long = Vec::new();
    for member in members() {
        let mut files = Vec::new();
        rust_files(&root().join(&member).join("src"), &mut files);
        for file in files.into_iter().filter(|f| !exempt(f)) {
            let path = file.strip_prefix(root()).unwrap_or(&file).display().to_string();
            let text = std::fs::read_to_string(&file).expect("read a source file");
            for (name, line, length) in functions(&text) {
                let pending = LONG_FUNCTIONS_PENDING.iter().any(|(p, n, _)| *p == path && *n == name);
                if length > 80 && !pending {
                    long.push(format!("{path}:{line} fn {name} ({length} lines)"));
                }
            }
        }
    }
    assert!(long.is_empty(), "functions over 80 lines:\n{}", long.join("\n"));
}

#[test]
fn the_function_measure_skips_braces_in_strings_and_chars() {
    let text = "pub fn a() {\n    let s = \"{{\";\n    let c = '{';\n}\nfn b<'x>(v: &'x str) -> &'x str {\n    v // }\n}\n";
    assert_eq!(functions(text), vec![("a".to_owned(), 1, 4), ("b".to_owned(), 5, 3)]);
}

/// The controller's files outside its core that hold or call the store: only the daemon's
/// wiring may (`bin/`, which opens the store and hands it to the core, and `group.rs`, which
/// hands it to a leader or a follower of a controller group).
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
        .filter(|f| **f != src.join("group.rs"))
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
            text.lines().filter(|l| inherent_impl_of(code(l)).is_some_and(|name| name == service)).count()
        };
        for f in &files {
            let text = std::fs::read_to_string(f).expect("read a core file");
            let expected = usize::from(f.ends_with(file));
            assert_eq!(impls(&text), expected, "{}: `impl {service}` blocks (one, in {file})", f.display());
        }
    }
}

/// The type an inherent `impl` line is for (`impl Foo {`, `impl<'a> Foo<'a> {`), or `None` for
/// trait impls and other lines.
fn inherent_impl_of(line: &str) -> Option<String> {
    let rest = line.strip_prefix("impl")?;
    let rest = if rest.starts_with('<') {
        let mut depth = 0;
        let end = rest.char_indices().find_map(|(i, c)| {
            depth += match c {
                '<' => 1,
                '>' => -1,
                _ => 0,
            };
            (depth == 0).then_some(i)
        })?;
        &rest[end + 1..]
    } else {
        rest
    };
    let head = rest.strip_prefix(' ')?.split('{').next()?;
    if head.contains(" for ") || head.contains(" where") {
        return None;
    }
    let name: String = head.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

/// Types whose inherent impls still spread over several files, each with the issue that
/// gathers them (none today).
const SPREAD_IMPLS_PENDING: &[(&str, &str)] = &[];

#[test]
fn no_type_has_inherent_impls_in_more_than_one_file() {
    let mut spread = Vec::new();
    for member in members() {
        let mut files = Vec::new();
        rust_files(&root().join(&member).join("src"), &mut files);
        let mut by_type: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in files.into_iter().filter(|f| !exempt(f)) {
            let text = std::fs::read_to_string(&file).expect("read a source file");
            let path = file.strip_prefix(root()).unwrap_or(&file).display().to_string();
            for name in text.lines().filter_map(|l| inherent_impl_of(code(l))) {
                by_type.entry(name).or_default().insert(path.clone());
            }
        }
        for (name, files) in by_type.into_iter().filter(|(_, files)| files.len() > 1) {
            if !SPREAD_IMPLS_PENDING.contains(&(member.as_str(), name.as_str())) {
                spread.push(format!(
                    "{member}: {name} in {}",
                    files.into_iter().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    assert!(spread.is_empty(), "types with inherent impls in several files:\n{}", spread.join("\n"));
}

#[test]
fn inherent_impls_are_told_from_trait_impls() {
    assert_eq!(inherent_impl_of("impl Controller {"), Some("Controller".into()));
    assert_eq!(inherent_impl_of("impl<'a> Jobs<'a> {"), Some("Jobs".into()));
    assert_eq!(inherent_impl_of("impl<T: Into<u8>> Group<T> {"), Some("Group".into()));
    assert_eq!(inherent_impl_of("impl Default for Clock {"), None);
    assert_eq!(inherent_impl_of("impl<T> From<T> for Wrap<T> {"), None);
    assert_eq!(inherent_impl_of("    impl Nested {"), None, "only items at the start of a line");
}

/// The languages the size limit covers, by file extension.
const SOURCE_EXTENSIONS: &[&str] = &["rs", "js", "py", "sh", "sql", "proto"];

/// Every file of the repository in one of [`SOURCE_EXTENSIONS`] that git tracks.
fn tracked_sources() -> Vec<PathBuf> {
    let out = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root())
        .output()
        .expect("run git ls-files");
    assert!(out.status.success(), "git ls-files: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
        .split(|b| *b == 0)
        .filter_map(|p| std::str::from_utf8(p).ok())
        .filter(|p| p.rsplit_once('.').is_some_and(|(_, ext)| SOURCE_EXTENSIONS.contains(&ext)))
        .map(|p| root().join(p))
        .collect()
}

/// Test suites of the other languages (Python's `test_*.py`), exempt as Rust's are.
fn exempt_any(path: &Path) -> bool {
    exempt(path) || path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("test_"))
}

#[test]
fn no_source_file_of_any_language_is_longer_than_600_lines() {
    let mut long = Vec::new();
    for file in tracked_sources().into_iter().filter(|f| !exempt_any(f)) {
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        let lines = text.lines().count();
        if lines > 600 {
            long.push(format!("{} ({lines} lines)", file.strip_prefix(root()).unwrap_or(&file).display()));
        }
    }
    assert!(long.is_empty(), "source files over 600 lines:\n{}", long.join("\n"));
}
