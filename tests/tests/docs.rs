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
