//! Reads the text of `nvidia-smi topo -m` as operators paste it: a header row of device columns
//! (`GPU#`, then NICs as `NIC#` or, from older drivers, `mlx5_#`), `CPU Affinity`,
//! `NUMA Affinity` and, from newer drivers, `GPU NUMA ID`; one row per GPU, then per NIC; the
//! legend and the NIC legend. Tabs or spaces both work (terminals and chat tools turn tabs into
//! spaces), and the underline escape codes a terminal prints around the header are dropped.

use std::collections::BTreeMap;

use super::{GpuNode, Link, Nic, NumaNode, Topology};

/// Why a pasted matrix was refused; `line` is 1-based in the pasted text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

fn err(line: usize, message: impl Into<String>) -> ParseError {
    ParseError { line, message: message.into() }
}

/// Strips ANSI escape sequences such as `ESC[4m` and `ESC[0m`.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn gpu_label(token: &str) -> Option<u32> {
    token.strip_prefix("GPU").and_then(|n| n.parse().ok())
}

struct Header {
    gpus: usize,
    nics: Vec<String>,
}

/// Parses the text of `nvidia-smi topo -m` into a [`Topology`].
pub fn parse(text: &str) -> Result<Topology, ParseError> {
    let lines: Vec<(usize, String)> = text.lines().enumerate().map(|(i, l)| (i + 1, strip_ansi(l))).collect();
    let mut rest = lines.iter().filter(|(_, l)| !l.trim().is_empty());
    let Some((header_line, header_text)) = rest.next() else {
        return Err(err(lines.len().max(1), "no header row: the text is empty"));
    };
    let header = parse_header(*header_line, header_text)?;
    let n = header.gpus;
    let width = n + header.nics.len();
    let mut gpus: Vec<GpuNode> = Vec::with_capacity(n);
    let mut links: Vec<Vec<Link>> = Vec::with_capacity(n);
    let mut gpu_to_nic: Vec<Vec<Link>> = Vec::with_capacity(n);
    let mut nic_rows: BTreeMap<usize, Vec<Link>> = BTreeMap::new();
    let mut legend_names: BTreeMap<String, String> = BTreeMap::new();
    // Where the matrix ended: the legend's line, or the last line when there is no legend.
    let mut matrix_end = lines.len();
    let mut in_legend = false;
    for (number, text) in rest {
        let number = *number;
        let trimmed = text.trim();
        if trimmed.ends_with("Legend:") {
            if !in_legend {
                matrix_end = number;
            }
            in_legend = true;
            continue;
        }
        if in_legend {
            if let Some((label, name)) = trimmed.split_once(':')
                && label.starts_with("NIC")
                && !label.contains(' ')
            {
                legend_names.insert(label.to_string(), name.trim().to_string());
            }
            continue;
        }
        let tokens: Vec<&str> = trimmed.split_whitespace().collect();
        let label = tokens[0];
        if tokens.len() < 1 + width {
            return Err(err(
                number,
                format!(
                    "row {label} has {} cells, expected {width} (one per header column)",
                    tokens.len() - 1
                ),
            ));
        }
        let cells: Vec<Link> = tokens[1..=width]
            .iter()
            .enumerate()
            .map(|(j, c)| {
                c.parse::<Link>().map_err(|e| err(number, format!("row {label}, column {}: {e}", j + 1)))
            })
            .collect::<Result<_, _>>()?;
        if let Some(index) = gpu_label(label) {
            if index as usize != gpus.len() {
                return Err(err(number, format!("row {label} out of order: expected GPU{}", gpus.len())));
            }
            if index as usize >= n {
                return Err(err(number, format!("row {label} has no column in the header ({n} GPUs)")));
            }
            let extra = &tokens[1 + width..];
            gpus.push(gpu_row(number, index, extra)?);
            links.push(cells[..n].to_vec());
            gpu_to_nic.push(cells[n..].to_vec());
        } else if let Some(k) = header.nics.iter().position(|name| name == label) {
            nic_rows.insert(k, cells);
        } else {
            return Err(err(number, format!("row label {label:?} is not a column of the header")));
        }
    }
    if gpus.len() != n {
        return Err(err(matrix_end, format!("the header lists {n} GPUs but {} GPU rows follow", gpus.len())));
    }
    check_matrix(&links, &lines)?;
    let nics = header
        .nics
        .iter()
        .enumerate()
        .map(|(k, label)| {
            let name = legend_names.get(label).cloned().unwrap_or_else(|| label.clone());
            // The GPU rows' NIC columns; NIC rows repeat them and may be missing from a paste.
            let to_gpus: Vec<Link> = gpu_to_nic.iter().map(|row| row[k]).collect();
            let to_nics = nic_rows.get(&k).map(|row| row[n..].to_vec()).unwrap_or_default();
            Nic { name, to_gpus, to_nics }
        })
        .collect();
    let numa_nodes = numa_nodes_of(&gpus);
    Ok(Topology { gpus, links, numa_nodes, nics })
}

fn parse_header(line: usize, text: &str) -> Result<Header, ParseError> {
    let tokens: Vec<&str> = text.split_whitespace().collect();
    let end = tokens.iter().position(|t| *t == "CPU").unwrap_or(tokens.len());
    let columns = &tokens[..end];
    let gpus = columns.iter().take_while(|t| gpu_label(t).is_some()).count();
    if gpus == 0 {
        return Err(err(line, "header row has no GPU columns (expected GPU0 GPU1 ... CPU Affinity)"));
    }
    for (i, t) in columns[..gpus].iter().enumerate() {
        if gpu_label(t) != Some(i as u32) {
            return Err(err(line, format!("header column {t} out of order: expected GPU{i}")));
        }
    }
    if let Some(stray) = columns[gpus..].iter().find(|t| gpu_label(t).is_some()) {
        return Err(err(line, format!("header column {stray} comes after a NIC column")));
    }
    if end == tokens.len() {
        return Err(err(line, "header row has no \"CPU Affinity\" column"));
    }
    Ok(Header { gpus, nics: columns[gpus..].iter().map(|s| s.to_string()).collect() })
}

/// The GPU row's `CPU Affinity` and `NUMA Affinity` tokens (`N/A` allowed, and a range such
/// as `0-1` read as several nodes); a trailing `GPU NUMA ID` is ignored.
fn gpu_row(line: usize, index: u32, extra: &[&str]) -> Result<GpuNode, ParseError> {
    let cpus = match extra.first() {
        None | Some(&"N/A") => String::new(),
        Some(list) => {
            trainyard_proto::contract::cpulist::parse(list)
                .map_err(|e| err(line, format!("GPU{index} CPU Affinity {list:?}: {e}")))?;
            list.to_string()
        }
    };
    // One node id, or a list or range (`0-1`) where the platform ties the GPU to several.
    let numa_affinity = match extra.get(1) {
        None | Some(&"N/A") => Vec::new(),
        Some(n) => trainyard_proto::contract::cpulist::parse(n).map_err(|_| {
            err(
                line,
                format!(
                    "GPU{index} NUMA Affinity {n:?} is not a NUMA node id, a list or range of ids, or N/A"
                ),
            )
        })?,
    };
    let numa_node = match numa_affinity.as_slice() {
        [only] => Some(*only),
        _ => None,
    };
    Ok(GpuNode { index, numa_node, numa_affinity, cpus })
}

/// `X` on the diagonal and the same code both ways; an error names the later row's line.
fn check_matrix(links: &[Vec<Link>], lines: &[(usize, String)]) -> Result<(), ParseError> {
    let line_of = |i: usize| {
        lines
            .iter()
            .find(|(_, l)| l.split_whitespace().next() == Some(&format!("GPU{i}")))
            .map_or(0, |(n, _)| *n)
    };
    for (i, row) in links.iter().enumerate() {
        for (j, cell) in row.iter().enumerate() {
            if (i == j) != (*cell == Link::X) {
                let want = if i == j { "X on the diagonal" } else { "a link code, not X" };
                return Err(err(line_of(i), format!("GPU{i} column GPU{j} is {cell}, expected {want}")));
            }
            if j < i && links[j][i] != *cell {
                return Err(err(
                    line_of(i),
                    format!("GPU{i} to GPU{j} is {cell} but GPU{j} to GPU{i} is {}", links[j][i]),
                ));
            }
        }
    }
    Ok(())
}

/// NUMA nodes from the GPUs' affinity: each node's CPU list is its GPUs' `CPU Affinity`.
fn numa_nodes_of(gpus: &[GpuNode]) -> Vec<NumaNode> {
    let mut nodes: BTreeMap<u32, String> = BTreeMap::new();
    for gpu in gpus {
        if let Some(id) = gpu.numa_node {
            nodes.entry(id).or_insert_with(|| gpu.cpus.clone());
        }
    }
    nodes.into_iter().map(|(id, cpus)| NumaNode { id, cpus }).collect()
}
