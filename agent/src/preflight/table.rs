//! The operator's view of a report: the GPU matrix as `nvidia-smi topo -m` prints it, then one
//! row per check (id, status, measured against expected), remedies under the rows that need one.

use std::fmt::Write;

use trainyard_proto::v1::PreflightReport;

/// Renders `report` for a terminal.
pub fn render(report: &PreflightReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "preflight {} on {} ({} level, source {}): {}  class {}",
        report.local_id,
        report.agent_id,
        report.level,
        report.source,
        report.verdict,
        report.interconnect_class
    );
    let versions: Vec<String> =
        [("driver", &report.driver_version), ("CUDA", &report.cuda_version), ("NCCL", &report.nccl_version)]
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
    if !versions.is_empty() {
        let _ = writeln!(out, "{}", versions.join(", "));
    }
    out.push('\n');
    out.push_str(&report.topology);
    out.push('\n');
    let id_width = report.checks.iter().map(|c| c.id.len()).max().unwrap_or(5).max(5);
    let _ = writeln!(out, "{:<id_width$}  {:<7}  MEASURED (EXPECTED)", "CHECK", "STATUS");
    for c in &report.checks {
        let _ =
            writeln!(out, "{:<id_width$}  {:<7}  {} (expected {})", c.id, c.status, c.measured, c.expected);
        if !c.remedy.is_empty() {
            let _ = writeln!(out, "{:<id_width$}  {:<7}  -> {}", "", "", c.remedy);
        }
    }
    let _ = writeln!(out, "\nverdict: {}", report.verdict);
    out
}
