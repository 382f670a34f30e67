//! `ctl compare A B [-o json]`: two jobs side by side and what most likely explains their
//! difference.

use trainyard_proto::v1::{CompareRequest, Comparison, Distribution, JobSide};

use super::diagnose::with_unit;
use crate::client::Controller;
use crate::output::{print_out, to_json};
use crate::render::Table;

pub async fn run(ctl: &mut Controller, a: u64, b: u64, json: bool) -> anyhow::Result<()> {
    let c = match ctl.jobs.compare(CompareRequest { a, b }).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Err(ctl.error(status, None)),
    };
    ctl.words(&c)?;
    if json { print_out(&to_json(&c)?) } else { print_out(&text(&c)) }
}

/// The comparison for people: the verdict, then one row per aspect with A and B side by side.
pub fn text(c: &Comparison) -> String {
    let empty = JobSide::default();
    let (a, b) = (c.a.as_ref().unwrap_or(&empty), c.b.as_ref().unwrap_or(&empty));
    let mut out = format!("{}\n\n", c.verdict);
    let mut t = Table::new(&[
        "",
        &format!("A: job {} {}", a.job_id, a.name),
        &format!("B: job {} {}", b.job_id, b.name),
    ]);
    let mut row = |name: &str, f: &dyn Fn(&JobSide) -> String| t.row(vec![name.to_string(), f(a), f(b)]);
    row("state", &|s| format!("{} (attempt {})", s.state, s.attempt));
    let keys: Vec<String> = {
        let mut k: Vec<String> = a.provenance.keys().chain(b.provenance.keys()).cloned().collect();
        k.sort();
        k.dedup();
        k
    };
    for key in &keys {
        row(key, &|s| s.provenance.get(key).cloned().unwrap_or_else(|| "-".into()));
    }
    row("nodes", &|s| {
        s.nodes.iter().map(|n| format!("{}({})", n.agent_id, n.ranks)).collect::<Vec<_>>().join(" ")
    });
    row("interconnect", &|s| {
        s.nodes.iter().map(|n| or_dash(&n.interconnect_class)).collect::<Vec<_>>().join(" ")
    });
    row("GPUs per NUMA node", &|s| {
        s.nodes.iter().map(|n| format!("[{}]", n.numa_layout)).collect::<Vec<_>>().join(" ")
    });
    row("preflight", &|s| s.nodes.iter().map(|n| or_dash(&n.verdict)).collect::<Vec<_>>().join(" "));
    let pct = |d: &Option<Distribution>, unit: &str| {
        d.as_ref().map_or("-".to_string(), |d| {
            format!("{} / {} / {}", with_unit(d.p10, unit), with_unit(d.p50, unit), with_unit(d.p90, unit))
        })
    };
    row("step time p10/p50/p90", &|s| pct(&s.step_time_ms, "ms"));
    row("tokens/s p10/p50/p90", &|s| {
        s.tokens_per_s.as_ref().map_or("-".into(), |d| format!("{:.0} / {:.0} / {:.0}", d.p10, d.p50, d.p90))
    });
    row("comm predicted / optimizer measured", &|s| {
        let d = s.diagnosis.clone().unwrap_or_default();
        let predicted =
            if d.predicted_comm_ms > 0.0 { with_unit(d.predicted_comm_ms, "ms") } else { "unknown".into() };
        format!("{predicted} / {}", d.measured_optimizer_ms.map_or("-".into(), |m| with_unit(m, "ms")))
    });
    row("findings", &|s| {
        let causes: Vec<String> =
            s.diagnosis.iter().flat_map(|d| d.findings.iter().map(|f| f.cause.clone())).collect();
        if causes.is_empty() { "none".into() } else { causes.join(" ") }
    });
    for d in &c.env {
        let name = format!("env {}", d.name);
        t.row(vec![
            name,
            d.a.clone().unwrap_or_else(|| "unset".into()),
            d.b.clone().unwrap_or_else(|| "unset".into()),
        ]);
    }
    out += &t.render();
    if c.differences.len() > 1 {
        out += "\nall differences, most likely first:\n";
        for d in &c.differences {
            out += &format!("  - {d}\n");
        }
    }
    out
}

fn or_dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { s.to_string() }
}
