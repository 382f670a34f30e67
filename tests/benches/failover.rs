//! Failover under load: three controllers on one PostgreSQL, 8 agents given all three
//! addresses, and a 16-rank receipt flood. The leader is SIGKILLed; later the new leader is
//! frozen (SIGSTOP) for 30 s and then thawed. For each, it prints how long until another
//! controller led, until it stored its first receipt of the job, and until all 8 agents were
//! connected to it; at the end the receipts lost and stored twice (both must be 0), the job's
//! outcome and attempt (a failover must not restart it), and how long the thawed leader took to
//! step down.
//!
//! Target (issue: no single point of failure): takeover under 10 s with the default lease (5 s).
//!
//! Run: `cargo bench -p trainyard-tests --bench failover [-- RECEIPTS_PER_RANK RATE_PER_RANK]`
//! (default 100,000 receipts per rank at 1,000 a second: 16,000 a second for 100 s). Writes
//! docs/results/failover-<date>.jsonl: the run's facts, one line per failover, the summary.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use trainyard_tests::group::Member;
use trainyard_tests::{Backend, Cluster, http};

/// One controller of the group as the bench sees it.
struct Controller {
    name: String,
    http: String,
    pid: u32,
}

/// What one failover measured, in seconds from the leader's loss.
#[derive(Debug, Default)]
struct Takeover {
    by: String,
    led_s: Option<f64>,
    first_receipt_s: Option<f64>,
    agents_s: Option<f64>,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// Waits (60 s at most) for a controller other than `lost` to lead, to store a receipt of `job`
/// stamped after `lost_at_ms`, and to hold all `agents` streams.
fn measure(c: &Cluster, group: &[Controller], lost: usize, job: u64, agents: i64) -> Result<Takeover> {
    let (started, lost_at_ms) = (Instant::now(), now_ms());
    let mut t = Takeover::default();
    let mut leader: Option<&Controller> = None;
    while started.elapsed() < Duration::from_secs(60) {
        let s = Some(started.elapsed().as_secs_f64());
        if leader.is_none() {
            leader = group.iter().enumerate().filter(|(i, _)| *i != lost).map(|(_, g)| g).find(|g| {
                http(&g.http, "GET", "/healthz").is_ok_and(|(_, body)| body.starts_with("ok: leads"))
            });
            if let Some(g) = leader {
                (t.by, t.led_s) = (g.name.clone(), s);
            }
        }
        if t.first_receipt_s.is_none() {
            let newest = c.query(&format!(
                "SELECT COALESCE(MAX(stored_at_ms), 0) FROM receipts WHERE job_id = {job}"
            ))?;
            if newest[0][0] > lost_at_ms {
                t.first_receipt_s = s;
            }
        }
        if let (Some(g), None) = (leader, t.agents_s) {
            let metrics = http(&g.http, "GET", "/metrics").map(|r| r.1).unwrap_or_default();
            if metrics.lines().any(|l| l == format!("trainyard_agents_connected {agents}")) {
                t.agents_s = s;
            }
        }
        if t.led_s.is_some() && t.first_receipt_s.is_some() && t.agents_s.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(t)
}

fn report(results: &mut trainyard_tests::results::Results, what: &str, t: &Takeover) -> Result<()> {
    results.line(&serde_json::json!({
        "event": what, "by": t.by, "led_s": t.led_s, "first_receipt_s": t.first_receipt_s,
        "agents_s": t.agents_s, "target_led_s": 10.0,
    }))?;
    let s = |v: Option<f64>| v.map_or("never (60 s)".to_string(), |v| format!("{v:.2} s"));
    println!(
        "{what}: {} led after {} (target 10 s); its first receipt of the flood stored after {}; all agents on it after {}",
        t.by,
        s(t.led_s),
        s(t.first_receipt_s),
        s(t.agents_s)
    );
    Ok(())
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: signalling a child process of this bench.
    unsafe { libc::kill(pid as i32, sig) };
}

fn main() -> Result<()> {
    trainyard_tests::build_release_binaries()?;
    let raw: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let mut results = trainyard_tests::results::Results::create(
        &trainyard_tests::results::results_dir(),
        "failover",
        &raw,
    )?;
    let args: Vec<i64> = raw.iter().filter_map(|a| a.parse().ok()).collect();
    let per_rank = args.first().copied().unwrap_or(100_000);
    let rate = args.get(1).copied().unwrap_or(1_000);
    let mut c = Cluster::start_on(Backend::Postgres)?;
    let (b, d) = (Member::start(&c, "ctl-b")?, Member::start(&c, "ctl-c")?);
    let group = [
        Controller {
            name: "ctl-a".into(),
            http: c.http_addr.clone(),
            pid: c.controller_pid().context("runs")?,
        },
        Controller { name: "ctl-b".into(), http: b.http.clone(), pid: b.pid() },
        Controller { name: "ctl-c".into(), http: d.http.clone(), pid: d.pid() },
    ];
    c.agent_controllers = Some(format!("{},{},{}", c.url(), b.url, d.url));
    let agents = 8;
    for i in 0..agents {
        c.start_agent(&format!("node-{i}"), 2)?;
    }
    let file = trainyard_tests::flood::flood_file(&c, "failover", (16, 2), per_rank, rate)?;
    let job = c.submit(&file)?;
    println!(
        "3 controllers, {agents} agents, a 16-rank flood of {per_rank} receipts per rank at {rate}/s ({}/s in all)",
        16 * rate
    );
    c.wait_first_steps(job, 16, Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_secs(10));
    // 1. The leader is killed.
    signal(group[0].pid, libc::SIGKILL);
    let killed = measure(&c, &group, 0, job, agents)?;
    report(&mut results, "SIGKILL of the leader", &killed)?;
    std::thread::sleep(Duration::from_secs(10));
    // 2. The new leader freezes for 30 s, then thaws.
    let frozen_at = group.iter().position(|g| g.name == killed.by).context("a new leader")?;
    let member = if frozen_at == 1 { &b } else { &d };
    let steps_before = member.logs().matches("stepped down").count();
    signal(group[frozen_at].pid, libc::SIGSTOP);
    let froze = Instant::now();
    let frozen = measure(&c, &group, frozen_at, job, agents)?;
    report(&mut results, "SIGSTOP of the leader", &frozen)?;
    std::thread::sleep(Duration::from_secs(30).saturating_sub(froze.elapsed()));
    signal(group[frozen_at].pid, libc::SIGCONT);
    let thawed = Instant::now();
    let frozen_for = froze.elapsed().as_secs_f64();
    let deadline = thawed + Duration::from_secs(30);
    while member.logs().matches("stepped down").count() == steps_before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let stepped_down = member.logs().matches("stepped down").count() > steps_before;
    let step_down_s = stepped_down.then(|| thawed.elapsed().as_secs_f64());
    match stepped_down {
        true => println!(
            "thawed after {frozen_for:.1} s frozen, the old leader stepped down {:.2} s later",
            thawed.elapsed().as_secs_f64()
        ),
        false => println!("thawed, the old leader did not step down within 30 s: {}", member.logs()),
    }
    let state = trainyard_tests::flood::wait_ended(&c, job, Duration::from_secs(600))?;
    let attempt = c.query(&format!("SELECT attempt FROM jobs WHERE id = {job}"))?[0][0];
    // What the ranks wrote (the agent's own exit receipt per rank is not part of the flood).
    let rows = c.query(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT rank * 10000000 + seq) FROM receipts WHERE job_id = {job} AND {}",
        trainyard_tests::RANK_WRITTEN
    ))?;
    let expected = 16 * per_rank;
    println!(
        "job {job} {state} on attempt {attempt}; receipts expected {expected}, stored {}, lost {}, stored twice {}",
        rows[0][0],
        expected - rows[0][1],
        rows[0][0] - rows[0][1]
    );
    results.line(&serde_json::json!({"summary": {
        "job_state": state, "attempt": attempt, "receipts_expected": expected, "stored": rows[0][0],
        "lost": expected - rows[0][1], "stored_twice": rows[0][0] - rows[0][1],
        "frozen_s": frozen_for, "thawed_leader_stepped_down_after_s": step_down_s,
        "sigkill_led_s": killed.led_s, "sigstop_led_s": frozen.led_s,
    }}))?;
    println!("results in {}", results.path().display());
    ensure!(state == "succeeded" && attempt == 0, "the job ended {state} on attempt {attempt}");
    ensure!(rows[0][0] == expected && rows[0][1] == expected, "receipts lost or doubled: {:?}", rows[0]);
    Ok(())
}
