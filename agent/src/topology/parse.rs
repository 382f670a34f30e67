//! Reads the text of `nvidia-smi topo -m` as operators paste it: a header row of device columns
//! (`GPU#`, then NICs as `NIC#` or, from older drivers, `mlx5_#`), `CPU Affinity`,
//! `NUMA Affinity` and, from newer drivers, `GPU NUMA ID`; one row per GPU, then per NIC; the
//! legend and the NIC legend. Tabs or spaces both work (terminals and chat tools turn tabs into
//! spaces), and the underline escape codes a terminal prints around the header are dropped, as
//! is what a copy leaves of them (`^[[4m`, or `[4m` without its escape byte).
//!
//! Pastes carry more than the matrix: the shell prompt and the command above it, the next
//! prompt or other output after it. The header is the first line with GPU columns and
//! `CPU Affinity`; what comes before it is passed over. The matrix ends at the legend, or at the
//! first line after the GPU rows that is no row of link codes. Only a matrix that cannot be read
//! is an error, and the error names its line in the pasted text.

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

/// Strips ANSI escape sequences such as `ESC[4m` and `ESC[0m`, the same shown as `^[[4m`, and
/// the `[4m`, `[0m` or `[1;32m` a copy leaves when it dropped the escape byte.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if let Some(after) = rest.strip_prefix('\u{1b}').or_else(|| rest.strip_prefix("^[")) {
            // An escape sequence runs to its first letter.
            rest = after.find(|c: char| c.is_ascii_alphabetic()).map_or("", |i| &after[i + 1..]);
            continue;
        }
        if let Some(after) = rest.strip_prefix('[') {
            let params = after.find(|c: char| !(c.is_ascii_digit() || c == ';')).unwrap_or(after.len());
            if after[params..].starts_with('m') {
                rest = &after[params + 1..];
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Where the header is: the first line with GPU columns and `CPU Affinity`; failing that (so
/// that its error names it), the first line that starts with a GPU column, or the first line.
fn header_index(lines: &[(usize, String)]) -> Option<usize> {
    let tokens = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    let full = lines.iter().position(|(_, l)| {
        let t = tokens(l);
        t.iter().any(|t| gpu_label(t).is_some()) && t.windows(2).any(|w| w[0] == "CPU" && w[1] == "Affinity")
    });
    let starts_with_gpu =
        || lines.iter().position(|(_, l)| tokens(l).first().is_some_and(|t| gpu_label(t).is_some()));
    full.or_else(starts_with_gpu).or_else(|| lines.iter().position(|(_, l)| !l.trim().is_empty()))
}

/// Whether a line after the GPU rows still belongs to the matrix: a label, then `width` link
/// codes.
fn looks_like_row(tokens: &[&str], width: usize) -> bool {
    tokens.len() > width && tokens[1..=width].iter().all(|c| c.parse::<Link>().is_ok())
}

fn gpu_label(token: &str) -> Option<u32> {
    token.strip_prefix("GPU").and_then(|n| n.parse().ok())
}

struct Header {
    gpus: usize,
    nics: Vec<String>,
}

/// The matrix rows read so far.
#[derive(Default)]
struct Rows {
    gpus: Vec<GpuNode>,
    links: Vec<Vec<Link>>,
    gpu_to_nic: Vec<Vec<Link>>,
    nic_rows: BTreeMap<usize, Vec<Link>>,
}

/// Parses the text of `nvidia-smi topo -m` into a [`Topology`].
pub fn parse(text: &str) -> Result<Topology, ParseError> {
    let lines: Vec<(usize, String)> = text.lines().enumerate().map(|(i, l)| (i + 1, strip_ansi(l))).collect();
    let Some(at) = header_index(&lines) else {
        return Err(err(lines.len().max(1), "no header row: the text is empty"));
    };
    let (header_line, header_text) = &lines[at];
    let header = parse_header(*header_line, header_text)?;
    let (n, width) = (header.gpus, header.gpus + header.nics.len());
    let mut rows = Rows::default();
    let mut legend_names: BTreeMap<String, String> = BTreeMap::new();
    // Where the matrix ended: the legend's line, or the last line when there is no legend.
    let mut matrix_end = lines.len();
    let (mut in_legend, mut after_matrix) = (false, false);
    for (number, text) in lines[at + 1..].iter().filter(|(_, l)| !l.trim().is_empty()) {
        let (number, trimmed) = (*number, text.trim());
        if trimmed.ends_with("Legend:") {
            if !in_legend {
                matrix_end = number;
            }
            in_legend = true;
        } else if in_legend {
            if let Some((label, name)) = trimmed.split_once(':')
                && label.starts_with("NIC")
                && !label.contains(' ')
            {
                legend_names.insert(label.to_string(), name.trim().to_string());
            }
        } else {
            let tokens: Vec<&str> = trimmed.split_whitespace().collect();
            let nic_label = header.nics.iter().any(|name| name == tokens[0]);
            if after_matrix || (rows.gpus.len() == n && !nic_label && !looks_like_row(&tokens, width)) {
                // Other output after the matrix (the next prompt, another command): passed
                // over, but a legend further down still names the NICs.
                if !after_matrix {
                    matrix_end = number;
                }
                after_matrix = true;
            } else {
                rows.add(&header, number, &tokens)?;
            }
        }
    }
    if rows.gpus.len() != n {
        return Err(err(
            matrix_end,
            format!("the header lists {n} GPUs but {} GPU rows follow", rows.gpus.len()),
        ));
    }
    check_matrix(&rows.links, &lines[at + 1..])?;
    let nics = nics(&header, &legend_names, &rows);
    let numa_nodes = numa_nodes_of(&rows.gpus);
    Ok(Topology { gpus: rows.gpus, links: rows.links, numa_nodes, nics })
}

impl Rows {
    /// Adds the matrix row on line `number`: a GPU row (in order) or a NIC row.
    fn add(&mut self, header: &Header, number: usize, tokens: &[&str]) -> Result<(), ParseError> {
        let (n, width, label) = (header.gpus, header.gpus + header.nics.len(), tokens[0]);
        let nic_label = header.nics.iter().any(|name| name == label);
        if gpu_label(label).is_none() && !nic_label && !looks_like_row(tokens, width) {
            let gpus = self.gpus.len();
            return Err(err(
                number,
                format!(
                    "the header lists {n} GPUs but only {gpus} GPU rows come before this line, which is no row of the matrix"
                ),
            ));
        }
        if tokens.len() < 1 + width {
            let cells = tokens.len() - 1;
            return Err(err(
                number,
                format!("row {label} has {cells} cells, expected {width} (one per header column)"),
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
            if index as usize != self.gpus.len() {
                return Err(err(
                    number,
                    format!("row {label} out of order: expected GPU{}", self.gpus.len()),
                ));
            }
            if index as usize >= n {
                return Err(err(number, format!("row {label} has no column in the header ({n} GPUs)")));
            }
            self.gpus.push(gpu_row(number, index, &tokens[1 + width..])?);
            self.links.push(cells[..n].to_vec());
            self.gpu_to_nic.push(cells[n..].to_vec());
        } else if let Some(k) = header.nics.iter().position(|name| name == label) {
            self.nic_rows.insert(k, cells);
        } else {
            return Err(err(number, format!("row label {label:?} is not a column of the header")));
        }
        Ok(())
    }
}

/// The header's NICs, named by the legend where it names them.
fn nics(header: &Header, legend_names: &BTreeMap<String, String>, rows: &Rows) -> Vec<Nic> {
    header
        .nics
        .iter()
        .enumerate()
        .map(|(k, label)| {
            let name = legend_names.get(label).cloned().unwrap_or_else(|| label.clone());
            // The GPU rows' NIC columns; NIC rows repeat them and may be missing from a paste.
            let to_gpus: Vec<Link> = rows.gpu_to_nic.iter().map(|row| row[k]).collect();
            let to_nics = rows.nic_rows.get(&k).map(|row| row[header.gpus..].to_vec()).unwrap_or_default();
            Nic { name, to_gpus, to_nics }
        })
        .collect()
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
