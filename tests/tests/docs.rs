//! The documentation stays true to the repository: every relative link in the README and the
//! docs leads to a file that exists and, with an anchor, to a heading of it; docs/architecture.md
//! names every table and view the migrations create and every message of the agent stream.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// The Markdown files the checks read: the README and everything under docs/.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut dirs = vec![root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs/").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// GitHub's anchor of a heading: lower case, spaces to hyphens, other punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| match c {
            c if c.is_alphanumeric() => Some(c.to_lowercase().next().unwrap_or(c)),
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside fenced code).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// Every `](target)` of a Markdown text, outside fenced code.
fn links(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let tail = &rest[at + 2..];
            let Some(end) = tail.find(')') else { break };
            out.push(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_docs_leads_somewhere() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).expect("read a Markdown file");
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") || link.contains(' ') {
                continue;
            }
            let (path, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target =
                if path.is_empty() { file.clone() } else { file.parent().expect("a folder").join(path) };
            let shown = file.strip_prefix(root()).unwrap_or(&file).display().to_string();
            if !target.exists() {
                broken.push(format!("{shown}: ({link}): no such file"));
            } else if !anchor.is_empty() && target.extension().is_some_and(|e| e == "md") {
                let heads = anchors(&std::fs::read_to_string(&target).expect("read a link's target"));
                if !heads.contains(anchor) {
                    broken.push(format!("{shown}: ({link}): no heading with that anchor"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "links that lead nowhere:\n{}", broken.join("\n"));
}

#[test]
fn the_link_checker_reads_headings_and_links_as_github_does() {
    assert_eq!(slug(" The agent stream"), "the-agent-stream");
    assert_eq!(slug(" 5. What a receipt must hold"), "5-what-a-receipt-must-hold");
    assert_eq!(slug(" `ctl diagnose` (and compare)"), "ctl-diagnose-and-compare");
    let text = "# Top\nsee [a](b.md#c) and [d](#top)\n```\n[not](x.md)\n## Not a heading\n```\n";
    assert_eq!(links(text), ["b.md#c", "#top"]);
    assert_eq!(anchors(text), BTreeSet::from(["top".to_string()]));
}

/// The section of docs/architecture.md under `heading`, up to the next heading of its level
/// or above.
fn architecture_section(heading: &str) -> String {
    let text = std::fs::read_to_string(root().join("docs/architecture.md")).expect("read architecture.md");
    let start = text.find(heading).unwrap_or_else(|| panic!("architecture.md has no {heading:?}"));
    let level = heading.chars().take_while(|c| *c == '#').count();
    let body = &text[start + heading.len()..];
    let end = body
        .match_indices("\n#")
        .find(|(at, _)| body[at + 1..].chars().take_while(|c| *c == '#').count() <= level)
        .map_or(body.len(), |(at, _)| at);
    body[..end].to_string()
}

/// Names after `keyword` (`CREATE TABLE`, `CREATE VIEW`) in the SQLite migrations.
fn created(keyword: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(root().join("migrations/sqlite")).expect("read the migrations").flatten() {
        let text = std::fs::read_to_string(entry.path()).expect("read a migration").to_uppercase();
        let original = std::fs::read_to_string(entry.path()).expect("read a migration");
        for (at, _) in text.match_indices(keyword) {
            let rest = original[at + keyword.len()..].trim_start();
            let rest = rest.strip_prefix("IF NOT EXISTS").or_else(|| rest.strip_prefix("if not exists"));
            let rest = rest.unwrap_or(&original[at + keyword.len()..]).trim_start();
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !name.is_empty() && !name.ends_with("_new") {
                names.insert(name.to_lowercase());
            }
        }
    }
    names
}

#[test]
fn the_architecture_names_every_table_and_view() {
    let section = architecture_section("### Store");
    let tables = created("CREATE TABLE");
    assert!(tables.contains("receipts") && tables.contains("controller_lease"), "{tables:?}");
    let views = created("CREATE VIEW");
    assert!(views.contains("job_progress"), "{views:?}");
    let missing: Vec<&String> =
        tables.iter().chain(&views).filter(|n| !section.contains(&format!("`{n}`"))).collect();
    assert!(missing.is_empty(), "docs/architecture.md's Store section does not name {missing:?}");
}

/// The fields of a `oneof msg` of `message` in the agents' proto file.
fn oneof_fields(message: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join("proto/proto/trainyard/v1/agents.proto"))
        .expect("read the proto");
    let start = text.find(&format!("message {message} {{")).expect("the message");
    let body = &text[start..];
    let oneof = &body[body.find("oneof msg {").expect("a oneof")..];
    let oneof = &oneof[..oneof.find('}').expect("its end")];
    oneof
        .lines()
        .skip(1)
        .filter_map(|l| l.split("//").next()?.split_whitespace().nth(1).map(str::to_owned))
        .collect()
}

#[test]
fn the_architecture_names_every_message_of_the_agent_stream() {
    let section = architecture_section("### Agent stream");
    for message in ["AgentMessage", "ControllerMessage"] {
        let fields = oneof_fields(message);
        assert!(fields.len() >= 9, "{message}: {fields:?}");
        let missing: Vec<&String> = fields.iter().filter(|f| !section.contains(&format!("`{f}`"))).collect();
        assert!(
            missing.is_empty(),
            "docs/architecture.md's Agent stream section does not name {message}'s {missing:?}"
        );
    }
}

/// Every `[text](target)` of a Markdown text whose target is a result file (under `results/` or
/// `gpu-results/`), outside fenced code: the figures a doc quotes from it, and the file. A link's
/// text may run over lines of its paragraph.
fn result_links(text: &str) -> Vec<(String, String)> {
    let mut fenced = false;
    let mut paragraphs = vec![String::new()];
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            paragraphs.push(String::new());
        } else if !fenced && line.trim().is_empty() {
            paragraphs.push(String::new());
        } else if !fenced {
            let last = paragraphs.last_mut().expect("one paragraph at least");
            last.push(' ');
            last.push_str(line.trim());
        }
    }
    let mut out = Vec::new();
    for p in &paragraphs {
        let mut from = 0;
        while let Some(at) = p[from..].find("](").map(|a| a + from) {
            let tail = &p[at + 2..];
            let Some(end) = tail.find(')') else { break };
            let target = &tail[..end];
            if let Some(open) = p[..at].rfind('[')
                && target.contains("results/")
                && !target.contains("://")
            {
                out.push((p[open + 1..at].to_string(), target.split('#').next().unwrap_or("").to_string()));
            }
            from = at + 2 + end;
        }
    }
    out
}

/// A figure as written: its value and the places of its last written digit (2 for `4.84`, -2
/// for `82,600`, whose last two zeros may be rounding).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Quoted {
    value: f64,
    places: i32,
}

/// The numbers of a text: digits with an optional `,ddd` grouping and decimals, not part of a
/// word (`d12`, `p99`, `H200` are names, not figures) and not a date's or a version's parts.
fn numbers(text: &str) -> Vec<Quoted> {
    scan(text, true)
}

/// [`numbers`], or with `names` false every number however it is joined to the next (`1.1-1.5`
/// is two): what a result file holds.
fn scan(text: &str, names: bool) -> Vec<Quoted> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let starts =
            b[i].is_ascii_digit() && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        let mut digits = String::new();
        while j < b.len() && b[j].is_ascii_digit() {
            digits.push(b[j] as char);
            j += 1;
        }
        while j + 3 < b.len()
            && b[j] == b','
            && b[j + 1..j + 4].iter().all(u8::is_ascii_digit)
            && b.get(j + 4).is_none_or(|c| !c.is_ascii_digit())
        {
            digits.extend(b[j + 1..j + 4].iter().map(|&c| c as char));
            j += 4;
        }
        let mut decimals = String::new();
        if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_digit() {
            j += 1;
            while j < b.len() && b[j].is_ascii_digit() {
                decimals.push(b[j] as char);
                j += 1;
            }
        }
        let mut exponent = None;
        if j + 1 < b.len() && (b[j] == b'e' || b[j] == b'E') {
            let signed = matches!(b[j + 1], b'-' | b'+');
            let start = j + 1 + usize::from(signed);
            let end = start + b[start.min(b.len())..].iter().take_while(|c| c.is_ascii_digit()).count();
            if end > start {
                exponent = text[j + 1..end].parse::<i32>().ok();
                j = end;
            }
        }
        // A date (2026-11-27), a version (0.24.0) or a name that goes on (`3x3`, `8xH100`).
        let next = |k: usize| b.get(k).copied().unwrap_or(b' ');
        let goes_on = (next(j) == b'-' || next(j) == b'.') && next(j + 1).is_ascii_digit()
            || next(j) == b'x' && next(j + 1).is_ascii_alphanumeric();
        let part = i > 1 && (b[i - 1] == b'-' || b[i - 1] == b'.') && b[i - 2].is_ascii_digit();
        if !names || !goes_on && !part {
            let text = if decimals.is_empty() { digits.clone() } else { format!("{digits}.{decimals}") };
            let mut value: f64 = text.parse().unwrap_or(0.0);
            let mut places = decimals.len() as i32;
            if decimals.is_empty() && exponent.is_none() {
                // Trailing zeros of a whole number may be rounding; three significant digits hold.
                let zeros = digits.len() - digits.trim_end_matches('0').len();
                places = -(zeros.min(digits.len().saturating_sub(3)) as i32);
            }
            if let Some(e) = exponent {
                value *= 10f64.powi(e);
                places -= e;
            }
            out.push(Quoted { value, places });
        }
        i = j.max(i + 1);
    }
    out
}

/// Every number a result file holds: a JSON-lines file's values (and the numbers in its
/// strings: a paired bench keeps each run's output), or a text file's numbers.
fn file_numbers(path: &Path) -> Vec<f64> {
    fn walk(v: &serde_json::Value, out: &mut Vec<f64>) {
        match v {
            serde_json::Value::Number(n) => out.extend(n.as_f64()),
            serde_json::Value::String(s) => out.extend(scan(s, false).iter().map(|q| q.value)),
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            serde_json::Value::Object(o) => o.values().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out = Vec::new();
    if path.extension().is_some_and(|e| e == "jsonl") {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let value: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{}: a line that is not JSON: {e}", path.display()));
            walk(&value, &mut out);
        }
    } else {
        out.extend(scan(&text, false).iter().map(|q| q.value));
    }
    out
}

/// Whether `quoted` is one of `held`, as written or rounded to its places, in the same unit or
/// one step away (a fraction quoted in %, seconds in ms, ms in seconds).
fn holds(quoted: Quoted, held: &[f64]) -> bool {
    let tolerance = 0.5 * 10f64.powi(-quoted.places) * (1.0 + 1e-9) + 1e-12;
    held.iter()
        .any(|v| [1.0, 100.0, 1000.0, 0.001].iter().any(|s| (v.abs() * s - quoted.value).abs() <= tolerance))
}

/// The figures a doc quotes with a link to a result file beside them (`[82,600 receipts/s, 0.64
/// of the raw loop](results/...)`) are in that file: a figure retyped wrong, or a file
/// re-measured under a figure that was not updated, fails here.
#[test]
fn every_figure_quoted_from_a_result_file_is_in_it() {
    let mut wrong = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).expect("read a Markdown file");
        let shown = file.strip_prefix(root()).unwrap_or(&file).display().to_string();
        for (label, target) in result_links(&text) {
            let path = file.parent().expect("a folder").join(&target);
            // A folder of results quotes from its summary.
            let path = if path.is_dir() { path.join("SUMMARY.md") } else { path };
            let held = file_numbers(&path);
            for quoted in numbers(&label) {
                checked += 1;
                if !holds(quoted, &held) {
                    wrong.push(format!("{shown}: [{label}]({target}): {} is not in the file", quoted.value));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "figures not in the result file they link:\n{}", wrong.join("\n"));
    assert!(checked >= 10, "only {checked} figures are quoted from result files");
}

#[test]
fn figures_are_read_as_written() {
    let q = |v, p| Quoted { value: v, places: p };
    assert_eq!(numbers("82,600/s"), [q(82600.0, -2)]);
    assert_eq!(numbers("4.84 s and 0.56x"), [q(4.84, 2), q(0.56, 2)]);
    assert_eq!(numbers("1,600,000 receipts"), [q(1_600_000.0, -4)]);
    assert_eq!(numbers("d12 on H200, p99 51 ms"), [q(51.0, 0)]);
    assert_eq!(numbers("on 2026-11-27, torch 2.11.0, 8xH100, 36.6 %"), [q(36.6, 1)]);
    assert_eq!(numbers("[1,2,3]").len(), 3, "a JSON array is three numbers");
    assert!(holds(q(82600.0, -2), &[82_634.2]));
    assert!(!holds(q(82600.0, -2), &[82_734.2]));
    assert!(holds(q(36.6, 1), &[0.3659]), "a fraction quoted in %");
    assert!(holds(q(2719.0, 0), &[2.7192]), "seconds quoted in ms");
    assert!(!holds(q(4.84, 2), &[4.88]));
}
