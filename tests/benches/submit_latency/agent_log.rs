//! The agent's side of a launch, read from its own log: when it took the launch, when it
//! started each rank's shim (`rank started`), and so how long it spent before the first shim
//! (the ranks' records, directories and cgroups) and between two shims (one rank's environment,
//! files and spawn). Timestamps are the agent's, to the microsecond, on the bench's machine.

use std::collections::BTreeMap;
use std::path::Path;

/// Medians over the launches of `jobs`, in milliseconds: launch to the first shim started, and
/// the gap between two shims started back to back.
#[derive(Debug, Clone, Copy)]
pub struct AgentSide {
    pub launch_to_first_shim_ms: f64,
    pub shim_gap_ms: f64,
}

/// Seconds since midnight of a log line's leading RFC 3339 timestamp (`...T13:13:22.761483Z`).
fn seconds(line: &str) -> Option<f64> {
    let time = line.split_whitespace().next()?.split_once('T')?.1.strip_suffix('Z')?;
    let mut parts = time.split(':');
    let (h, m, s) = (parts.next()?.parse::<f64>().ok()?, parts.next()?.parse::<f64>().ok()?, parts.next()?);
    Some(h * 3600.0 + m * 60.0 + s.parse::<f64>().ok()?)
}

fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Reads `log` (the agent's, as the test cluster writes it) for the launches of `jobs`.
pub fn read(log: &Path, jobs: &[u64]) -> anyhow::Result<AgentSide> {
    let text = std::fs::read_to_string(log)?;
    // Per job: when its launch arrived, then when each of its shims started.
    let mut launches: BTreeMap<u64, (f64, Vec<f64>)> = BTreeMap::new();
    for line in text.lines() {
        let Some(at) = seconds(line) else { continue };
        if line.contains(" launch job_id=") {
            if let Some(job) = field(line, "job_id").and_then(|j| j.parse().ok()) {
                launches.insert(job, (at, Vec::new()));
            }
        } else if line.contains(" rank started ")
            && let Some(job) = field(line, "rank_id").and_then(|r| r.split('.').next()?.parse::<u64>().ok())
            && let Some((_, shims)) = launches.get_mut(&job)
        {
            shims.push(at);
        }
    }
    let (mut first, mut gaps) = (Vec::new(), Vec::new());
    for job in jobs {
        let Some((launch, shims)) = launches.get(job) else {
            anyhow::bail!("job {job}: no launch in {}", log.display())
        };
        if let Some(start) = shims.first() {
            first.push((start - launch) * 1e3);
        }
        gaps.extend(shims.windows(2).map(|w| (w[1] - w[0]) * 1e3));
    }
    Ok(AgentSide { launch_to_first_shim_ms: median(first), shim_gap_ms: median(gaps) })
}
