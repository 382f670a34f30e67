//! Text rendering of the fleet: the `ctl nodes` table and a preflight report as
//! `trainyard-agent preflight` prints it (the GPU matrix, then one row per check).

use std::fmt::Write as _;

use trainyard_proto::v1::{NodeInfo, PreflightReport};

use crate::render::{Table, age, timestamp};
use trainyard_proto::words::{CheckStatus, NodeState};

/// The fleet table: one row per node, the reason a node is left alone in the last column.
pub fn node_table(nodes: &[NodeInfo], now_ms: i64) -> String {
    let mut t = Table::new(&[
        "HOST", "STATE", "GPUS", "FREE", "MODEL", "CLASS", "NUMA", "VERDICT", "REPORT", "SEEN", "REASON",
    ]);
    for n in nodes {
        t.row(vec![
            n.agent_id.clone(),
            if n.cordon_by.is_empty() { n.state.clone() } else { format!("{}, cordoned", n.state) },
            n.gpus.to_string(),
            n.free_gpus.to_string(),
            dash(n.gpu_model.strip_prefix("NVIDIA ").unwrap_or(&n.gpu_model)),
            dash(&n.interconnect_class),
            dash(&n.numa_layout),
            dash(&n.verdict),
            if n.preflight_report_id == 0 { "-".into() } else { n.preflight_report_id.to_string() },
            if n.state() == Ok(NodeState::Connected) { "now".into() } else { age(now_ms, n.last_seen_ms) },
            n.verdict_reason.clone(),
        ]);
    }
    t.render()
}

/// A report: a header, the GPU matrix as the agent measured it, the checks, and a summary.
pub fn preflight_report(r: &PreflightReport) -> String {
    let mut out = format!("preflight report {} of {}: {}\n", r.report_id, r.agent_id, dash(&r.verdict));
    let took_ms = (r.finished_at_ms - r.started_at_ms).max(0);
    let _ = writeln!(
        out,
        "  level {}, inventory from {}, started {}, took {}.{} s",
        dash(&r.level),
        dash(&r.source),
        timestamp(r.started_at_ms),
        took_ms / 1000,
        took_ms % 1000 / 100
    );
    let _ = writeln!(
        out,
        "  class {}, driver {}, CUDA {}, NCCL {}",
        dash(&r.interconnect_class),
        dash(&r.driver_version),
        dash(&r.cuda_version),
        dash(&r.nccl_version)
    );
    if !r.local_id.is_empty() {
        let _ = writeln!(out, "  ranks see TRAINYARD_PREFLIGHT_REPORT={}", r.local_id);
    }
    if !r.topology.trim().is_empty() {
        out.push('\n');
        out.push_str(r.topology.trim_end());
        out.push('\n');
    }
    out.push('\n');
    let mut t = Table::new(&["CHECK", "STATUS", "MEASURED", "EXPECTED", "REMEDY"]);
    for c in &r.checks {
        t.row(vec![c.id.clone(), c.status.clone(), dash(&c.measured), dash(&c.expected), c.remedy.clone()]);
    }
    out.push_str(&t.render());
    out.push_str(&summary(r));
    out
}

/// "verdict fail: 2 failing (cuda.init.gpu3, host.shm), 1 warning, 12 passed, 1 skipped".
fn summary(r: &PreflightReport) -> String {
    let with = |status: CheckStatus| -> Vec<&str> {
        r.checks.iter().filter(|c| c.status() == Ok(status)).map(|c| c.id.as_str()).collect()
    };
    let (fail, warn) = (with(CheckStatus::Fail), with(CheckStatus::Warn));
    let mut parts = Vec::new();
    if !fail.is_empty() {
        parts.push(format!("{} failing ({})", fail.len(), fail.join(", ")));
    }
    if !warn.is_empty() {
        let s = if warn.len() == 1 { "" } else { "s" };
        parts.push(format!("{} warning{s} ({})", warn.len(), warn.join(", ")));
    }
    parts.push(format!("{} passed", with(CheckStatus::Pass).len()));
    let skipped = with(CheckStatus::Skipped).len();
    if skipped > 0 {
        parts.push(format!("{skipped} skipped"));
    }
    format!("\nverdict {}: {}\n", dash(&r.verdict), parts.join(", "))
}

fn dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { s.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::PreflightCheck;

    fn check(id: &str, status: &str, measured: &str, expected: &str, remedy: &str) -> PreflightCheck {
        PreflightCheck {
            id: id.into(),
            status: status.into(),
            measured: measured.into(),
            expected: expected.into(),
            remedy: remedy.into(),
        }
    }

    #[test]
    fn node_table_shows_verdicts_and_reasons() {
        let nodes = vec![
            NodeInfo {
                agent_id: "sxm-a".into(),
                state: "connected".into(),
                gpus: 8,
                free_gpus: 6,
                gpu_model: "NVIDIA H100 80GB HBM3".into(),
                interconnect_class: "nvswitch".into(),
                numa_layout: "0:8".into(),
                verdict: "pass".into(),
                preflight_report_id: 3,
                ..Default::default()
            },
            NodeInfo {
                agent_id: "sxm-b".into(),
                state: "disconnected".into(),
                gpus: 8,
                free_gpus: 8,
                numa_layout: "0:4 1:4".into(),
                verdict: "fail".into(),
                verdict_reason: "cuda.init.gpu3: CUDA_ERROR_NO_DEVICE".into(),
                last_seen_ms: 1_000,
                ..Default::default()
            },
        ];
        let text = node_table(&nodes, 121_000);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "HOST   STATE         GPUS  FREE  MODEL           CLASS     NUMA     VERDICT  REPORT  SEEN  REASON"
        );
        assert_eq!(
            lines[1],
            "sxm-a  connected     8     6     H100 80GB HBM3  nvswitch  0:8      pass     3       now"
        );
        assert_eq!(
            lines[2],
            "sxm-b  disconnected  8     8     -               -         0:4 1:4  fail     -       2m    \
             cuda.init.gpu3: CUDA_ERROR_NO_DEVICE"
        );
    }

    #[test]
    fn report_prints_the_matrix_then_one_row_per_check() {
        let report = PreflightReport {
            report_id: 12,
            agent_id: "sxm-a".into(),
            local_id: "sxm-a-1000".into(),
            level: "quick".into(),
            started_at_ms: 1_000,
            finished_at_ms: 2_500,
            verdict: "fail".into(),
            interconnect_class: "nvswitch".into(),
            topology: "\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X \n".into(),
            driver_version: "570.124.06".into(),
            source: "host-file".into(),
            checks: vec![
                check("topology.nvlink", "pass", "NV18 on all 1 pairs", "NV18", ""),
                check("numa.balancing", "warn", "1", "0", "sysctl -w kernel.numa_balancing=0"),
                check("cuda.init.gpu1", "fail", "CUDA_ERROR_NO_DEVICE", "context + copy", "drain the node"),
                check("nccl.busbw", "skipped", "libnccl not found", "", ""),
            ],
            ..Default::default()
        };
        let text = preflight_report(&report);
        let expected = "\
preflight report 12 of sxm-a: fail
  level quick, inventory from host-file, started 1970-01-01 00:00:01.000Z, took 1.5 s
  class nvswitch, driver 570.124.06, CUDA -, NCCL -
  ranks see TRAINYARD_PREFLIGHT_REPORT=sxm-a-1000

\tGPU0\tGPU1
GPU0\t X \tNV18
GPU1\tNV18\t X

CHECK            STATUS   MEASURED              EXPECTED        REMEDY
topology.nvlink  pass     NV18 on all 1 pairs   NV18
numa.balancing   warn     1                     0               sysctl -w kernel.numa_balancing=0
cuda.init.gpu1   fail     CUDA_ERROR_NO_DEVICE  context + copy  drain the node
nccl.busbw       skipped  libnccl not found     -

verdict fail: 1 failing (cuda.init.gpu1), 1 warning (numa.balancing), 1 passed, 1 skipped
";
        assert_eq!(text, expected);
    }
}
