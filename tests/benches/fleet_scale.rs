//! The fleet at the promised scale: 1,000 simulated agents (8 GPUs each, one tokio task and one
//! gRPC connection per host, the real agent protocol; `fleet_scale/sim.rs`) against two
//! controllers on one PostgreSQL, for 15 minutes.
//!
//! 1. Quiet ingest: 8 hosts run one 64-rank job whose ranks write receipts as fast as their
//!    acknowledgements allow; its stored rate is the quiet PostgreSQL ingest rate of this run.
//! 2. The other hosts connect (time until all 1,000 are on the leader).
//! 3. Soak: a job every 0.2 s of 1-64 GPUs and 10-59 s (the fleet about 70 % busy), ranks
//!    writing step receipts at half the quiet rate in all while at least half the fleet's GPUs
//!    run ranks. Each rank writes that total over the running ranks, but never faster than
//!    over half the GPUs (about 5 a second here): when fewer run, fewer receipts are written,
//!    as with real ranks, whose rate is their step rate. (A rate that rose without bound as
//!    ranks ended filled the remaining ranks' windows, and their exits waited behind them.)
//!    Every 30 s the leader's CPU and resident memory, and receipts written, stored and waiting
//!    in the agents.
//! 4. Failover: the leader is SIGKILLed; time until the follower leads and until all 1,000
//!    hosts are connected to it.
//!
//! Prints the leader's CPU and RSS over time, the scheduling pass median and p99 (from the
//! leader's histogram), submit to running median and p99, receipt latency rank-to-row median
//! and p99 (a sample of the soak's receipts), and every error line of both controllers.
//!
//! Run: `cargo bench -p trainyard-tests --bench fleet_scale [-- SECONDS [AGENTS]]` (default
//! 900 s, 1,000 agents). The quiet rate of one run to the next varies by a fifth on a shared
//! machine, and the soak's target with it: to compare two builds at one load, give the target
//! in receipts/s with `FLEET_SOAK_TARGET` (the quiet rate is still measured and printed).
//!
//! Every run writes its figures to `docs/results/fleet_scale-<date>.jsonl`
//! ([`trainyard_tests::results`]): one line for the quiet ingest, one for the fleet's connect,
//! one per 30 s soak sample, one for the failover, then the summary (the quiet rate, the soak
//! target and the soak's median stored rate, the leader's peak CPU and RSS, the percentiles
//! above, the failover, and the error lines counted).

#[path = "fleet_scale/sim.rs"]
mod sim;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use serde_json::{Value, json};
use trainyard_proto::v1::jobs_client::JobsClient;
use trainyard_proto::v1::{ExecEngine, JobSpec, Resources, SubmitRequest, job_spec};
use trainyard_tests::group::Member;
use trainyard_tests::results::{Results, results_dir};
use trainyard_tests::{Backend, Cluster, http, proc_status_field};

const GPUS_PER_HOST: u32 = 8;
const SUBMIT_EVERY: Duration = Duration::from_millis(200);

/// A small deterministic generator (xorshift), so every run submits the same jobs.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// CPU seconds (user + system) a process has used.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime, in clock ticks) are the 12th and 13th after the name.
    let field = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (field(11) + field(12)) / 100.0
}

fn rss_mib(pid: u32) -> f64 {
    proc_status_field(pid, "VmRSS")
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse::<f64>().ok()))
        .unwrap_or(0.0)
        / 1024.0
}

/// One value of a Prometheus text exposition (`name` with its labels, exactly).
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The `q` quantile of a histogram's buckets (the upper bound of the bucket it falls in), ms.
fn histogram_quantile_ms(text: &str, name: &str, q: f64) -> Option<f64> {
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&format!("{name}_bucket{{le=\""))?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, count.trim().parse().ok()?))
        })
        .collect();
    let total = buckets.last()?.1;
    buckets.iter().find(|(_, c)| *c >= q * total).map(|(le, _)| le * 1e3)
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn raise_open_files() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: get/setrlimit on this process with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn spec(name: &str, gpus: u32, seconds: u64, flood: bool) -> JobSpec {
    let mut env = std::collections::HashMap::new();
    env.insert("TRAINYARD_SIM_SECONDS".to_string(), seconds.to_string());
    if flood {
        env.insert("TRAINYARD_SIM_FLOOD".to_string(), "1".to_string());
    }
    JobSpec {
        name: name.into(),
        resources: Some(Resources { gpus, ..Default::default() }),
        engine: Some(job_spec::Engine::Exec(ExecEngine {
            argv: vec!["/bin/true".into()],
            workdir: "/tmp".into(),
            ..Default::default()
        })),
        env,
        ..Default::default()
    }
}

async fn submit(url: &str, spec: JobSpec) -> Result<u64> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())?.connect().await?;
    let mut client = JobsClient::new(channel);
    let reply = client.submit(SubmitRequest { spec: Some(spec), idempotency_key: String::new() }).await?;
    Ok(reply.into_inner().job_id)
}

/// Waits for `job` to end; its state.
fn wait_ended(c: &Cluster, job: u64, timeout: Duration) -> Result<String> {
    trainyard_tests::flood::wait_ended(c, job, timeout)
}

/// The group member that leads now: (gRPC URL, HTTP address, pid), the first member if none
/// says it leads.
fn leader(c: &Cluster, b: &Member) -> (String, String, u32) {
    let leads = |http_addr: &str| {
        http(http_addr, "GET", "/healthz").is_ok_and(|(_, body)| body.starts_with("ok: leads"))
    };
    if !leads(&c.http_addr) && leads(&b.http) {
        return (b.url.clone(), b.http.clone(), b.pid());
    }
    (c.url(), c.http_addr.clone(), c.controller_pid().unwrap_or(0))
}

/// Waits until the controller at `http_addr` holds `n` agent streams; seconds it took.
fn wait_connected(http_addr: &str, n: u64, timeout: Duration) -> Option<f64> {
    let started = Instant::now();
    while started.elapsed() < timeout {
        let text = http(http_addr, "GET", "/metrics").map(|r| r.1).unwrap_or_default();
        if metric(&text, "trainyard_agents_connected") == Some(n as f64) {
            return Some(started.elapsed().as_secs_f64());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

fn main() -> Result<()> {
    trainyard_tests::build_release_binaries()?;
    raise_open_files();
    let named: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut out = Results::create(&results_dir(), "fleet_scale", &named)?;
    let args: Vec<u64> = named.iter().filter_map(|a| a.parse().ok()).collect();
    let seconds = args.first().copied().unwrap_or(900);
    let agents = args.get(1).copied().unwrap_or(1000).max(8);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let c = Cluster::start_on(Backend::Postgres)?;
    let b = Member::start(&c, "ctl-b")?;
    let fleet = sim::Fleet::new(vec![c.url(), b.url.clone()], 10.0);

    // 1. Quiet ingest.
    for i in 0..8 {
        rt.spawn(sim::agent(fleet.clone(), format!("host-{i:04}"), 0));
    }
    ensure!(wait_connected(&c.http_addr, 8, Duration::from_secs(60)).is_some(), "8 agents did not connect");
    let job = rt.block_on(submit(&c.url(), spec("quiet-flood", 64, 20, true)))?;
    let state = wait_ended(&c, job, Duration::from_secs(300))?;
    let q = c.query(&format!(
        "SELECT COUNT(*), MAX(stored_at_ms) - MIN(stored_at_ms) FROM receipts WHERE job_id = {job}"
    ))?;
    let quiet = q[0][0] as f64 * 1000.0 / q[0][1].max(1) as f64;
    let given = std::env::var("FLEET_SOAK_TARGET").ok();
    let target = match given.as_deref().map(str::parse::<f64>) {
        None => quiet / 2.0,
        Some(Ok(t)) if t > 0.0 => t,
        Some(_) => {
            let given = given.as_deref().unwrap_or_default();
            anyhow::bail!("FLEET_SOAK_TARGET={given}: expected receipts per second, above 0")
        }
    };
    let whence = if given.is_some() { "given by FLEET_SOAK_TARGET" } else { "half the quiet rate" };
    println!(
        "quiet ingest: {} receipts of 64 flooding ranks in {} ms: {quiet:.0}/s (job {state}); soak target {target:.0}/s ({whence})",
        q[0][0], q[0][1]
    );
    out.line(&json!({
        "phase": "quiet", "ranks": 64, "receipts": q[0][0], "span_ms": q[0][1], "rate": quiet.round(),
        "job_state": state, "soak_target": target.round(), "soak_target_given": given.is_some(),
    }))?;
    let mut head = json!({
        "seconds": seconds, "agents": agents, "quiet_rate": quiet.round(), "soak_target": target.round(),
        "soak_target_given": given.is_some(),
    });

    // 2. The fleet connects.
    let t = Instant::now();
    for i in 8..agents {
        rt.spawn(sim::agent(fleet.clone(), format!("host-{i:04}"), 0));
        if i % 50 == 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let joined = wait_connected(&c.http_addr, agents, Duration::from_secs(300));
    let connect_s = t.elapsed().as_secs_f64();
    println!("{agents} agents connected to the leader {connect_s:.1} s after the first dial");
    out.line(&json!({
        "phase": "connect", "agents": agents, "connected_s": round1(connect_s),
        "all_connected": joined.is_some(),
    }))?;
    head["connect_s"] = json!(round1(connect_s));
    ensure!(joined.is_some(), "not every agent connected");

    // 3. Soak.
    let report = soak(&c, &b, &rt, &fleet, (seconds, agents), target, &mut out)?;

    // 4. Failover: the leader is killed, the other member takes over.
    let (_, leader_http, leader_pid) = leader(&c, &b);
    let (name, survivor) =
        if leader_http == c.http_addr { ("ctl-b", b.http.clone()) } else { ("ctl-a", c.http_addr.clone()) };
    let before = http(&leader_http, "GET", "/metrics").map(|r| r.1).unwrap_or_default();
    // SAFETY: signalling a controller process of this bench.
    unsafe { libc::kill(leader_pid as i32, libc::SIGKILL) };
    let lost = Instant::now();
    let mut led = None;
    while lost.elapsed() < Duration::from_secs(60) && led.is_none() {
        if http(&survivor, "GET", "/healthz").is_ok_and(|(_, h)| h.starts_with("ok: leads")) {
            led = Some(lost.elapsed().as_secs_f64());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let all =
        wait_connected(&survivor, agents, Duration::from_secs(120)).map(|_| lost.elapsed().as_secs_f64());
    let s = |v: Option<f64>| v.map_or("never".to_string(), |v| format!("{v:.1} s"));
    println!(
        "failover: SIGKILL of the leader; {name} led after {}, all {agents} agents on it after {} (target 30 s)",
        s(led),
        s(all)
    );
    out.line(&json!({
        "phase": "failover", "by": name, "led_s": led.map(round1), "all_connected_s": all.map(round1),
        "target_s": 30,
    }))?;
    head["failover_led_s"] = json!(led.map(round1));
    head["failover_all_connected_s"] = json!(all.map(round1));

    summary(&c, &b, &before, &report, job, &mut out, head)?;
    println!("results: {}", out.path().display());
    drop(rt);
    Ok(())
}

/// What the soak measured.
struct Soak {
    started_ms: i64,
    samples: Vec<String>,
    leader: Vec<Sample>,
    submitted: u64,
    outcomes: Vec<Outcome>,
}

/// The figures of one 30 s sample the summary reads back.
struct Sample {
    t_s: u64,
    /// The leader's CPU since the last sample, % of one core.
    cpu_pct: f64,
    rss_mib: f64,
    stored_per_s: f64,
}

/// One submit call: how long it took (ms), and its error if it failed.
type Outcome = (f64, Option<String>);

fn soak(
    c: &Cluster,
    b: &Member,
    rt: &tokio::runtime::Runtime,
    fleet: &Arc<sim::Fleet>,
    (seconds, agents): (u64, u64),
    target: f64,
    out: &mut Results,
) -> Result<Soak> {
    let (mut url, mut http_addr, mut leader) = self::leader(c, b);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // (milliseconds, error) of every submit.
    let outcomes: Arc<std::sync::Mutex<Vec<Outcome>>> = Arc::default();
    let mut seen_failures = 0;
    let started = Instant::now();
    let started_ms = now_ms();
    let (mut samples, mut leader_figures) = (Vec::new(), Vec::new());
    let (mut submitted, mut next_sample) = (0u64, Duration::ZERO);
    let scrape = |addr: &str| http(addr, "GET", "/metrics").map(|r| r.1).unwrap_or_default();
    let ingested = metric(&scrape(&http_addr), "trainyard_receipts_ingested_total").unwrap_or(0.0);
    let (mut cpu_before, mut at_before, mut ingested_before) = (cpu_s(leader), Instant::now(), ingested);
    let own = std::process::id();
    let mut own_before = cpu_s(own);
    let half_the_gpus = (agents * GPUS_PER_HOST as u64 / 2) as f64;
    let pace = |running: u64| target / (running as f64).max(half_the_gpus);
    fleet.set_rate(pace(0));
    let mut written_before = fleet.receipts_written.load(Ordering::Relaxed);
    println!("soak: {seconds} s; a job every 0.2 s of 1-64 GPUs lasting 10-59 s on {} GPUs", agents * 8);
    while started.elapsed() < Duration::from_secs(seconds) {
        let gpus = 1 + rng.below(64) as u32;
        let secs = 10 + rng.below(50);
        // On the schedule whatever a submit takes: each in its own task.
        let (job, done) = (spec(&format!("soak-{submitted}"), gpus, secs, false), outcomes.clone());
        let to = url.clone();
        rt.spawn(async move {
            let t = Instant::now();
            let ok = submit(&to, job).await.map_err(|e| format!("{e:#}"));
            done.lock().expect("not poisoned").push((t.elapsed().as_secs_f64() * 1e3, ok.err()));
        });
        submitted += 1;
        fleet.set_rate(pace(fleet.running_ranks.load(Ordering::Relaxed)));
        let failed = outcomes.lock().expect("not poisoned").iter().filter(|o| o.1.is_some()).count();
        if failed > seen_failures {
            seen_failures = failed;
            (url, http_addr, leader) = self::leader(c, b);
        }
        if started.elapsed() >= next_sample {
            let running = fleet.running_ranks.load(Ordering::Relaxed);
            let written = fleet.receipts_written.load(Ordering::Relaxed);
            let waiting = written.saturating_sub(fleet.receipts_acked.load(Ordering::Relaxed));
            let text = scrape(&http_addr);
            let ingested = metric(&text, "trainyard_receipts_ingested_total").unwrap_or(0.0);
            let (cpu, dt, own_cpu) = (cpu_s(leader), at_before.elapsed().as_secs_f64(), cpu_s(own));
            let t_s = started.elapsed().as_secs();
            let connected = metric(&text, "trainyard_agents_connected").unwrap_or(0.0);
            let fleet_gpus = agents * GPUS_PER_HOST as u64;
            let written_per_s = (written - written_before) as f64 / dt;
            let stored_per_s = (ingested - ingested_before) / dt;
            let (cpu_pct, rss) = ((cpu - cpu_before) * 100.0 / dt, rss_mib(leader));
            let fleet_cpu_pct = (own_cpu - own_before) * 100.0 / dt;
            let line = format!(
                "  t={t_s:>4} s  agents {connected:>4}  running ranks {running:>5} of {fleet_gpus}  written {written_per_s:>6.0}/s  stored {stored_per_s:>6.0}/s  waiting in agents {waiting:>8}  leader CPU {cpu_pct:>5.1} %  RSS {rss:>6.1} MiB  jobs submitted {submitted}  (simulated fleet CPU {fleet_cpu_pct:.0} %)"
            );
            (own_before, written_before) = (own_cpu, written);
            println!("{line}");
            samples.push(line);
            out.line(&json!({
                "phase": "soak", "t_s": t_s, "agents_connected": connected, "running_ranks": running,
                "gpus": fleet_gpus, "written_per_s": written_per_s.round(),
                "stored_per_s": stored_per_s.round(), "waiting_in_agents": waiting,
                "leader_cpu_pct": round1(cpu_pct), "leader_rss_mib": round1(rss),
                "jobs_submitted": submitted, "simulated_fleet_cpu_pct": fleet_cpu_pct.round(),
            }))?;
            leader_figures.push(Sample { t_s, cpu_pct, rss_mib: rss, stored_per_s });
            (cpu_before, at_before, ingested_before) = (cpu, Instant::now(), ingested);
            next_sample += Duration::from_secs(30);
        }
        std::thread::sleep(SUBMIT_EVERY);
    }
    let outcomes = outcomes.lock().expect("not poisoned").clone();
    Ok(Soak { started_ms, samples, leader: leader_figures, submitted, outcomes })
}

/// Prints the run's percentiles and error lines, and writes the summary: `head` (the figures
/// measured before) completed.
fn summary(
    c: &Cluster,
    b: &Member,
    metrics: &str,
    soak: &Soak,
    quiet_job: u64,
    out: &mut Results,
    mut head: Value,
) -> Result<()> {
    let pass = |q| histogram_quantile_ms(metrics, "trainyard_schedule_pass_seconds", q);
    println!(
        "scheduling pass (leader's histogram, bucket upper bounds): p50 <= {:.2} ms, p99 <= {:.2} ms",
        pass(0.5).unwrap_or(f64::NAN),
        pass(0.99).unwrap_or(f64::NAN)
    );
    let since = soak.started_ms;
    let waits = c.query(&format!(
        "SELECT MIN(e.at_ms) - j.created_at_ms FROM jobs j JOIN job_events e ON e.job_id = j.id \
         WHERE e.to_state = 'running' AND j.created_at_ms >= {since} GROUP BY j.id, j.created_at_ms ORDER BY 1"
    ))?;
    let pick =
        |v: &[Vec<i64>], q: f64| v.get(((v.len().max(1) - 1) as f64 * q) as usize).map_or(-1, |r| r[0]);
    println!(
        "submit to running: {} jobs ran of {} submitted; p50 {} ms, p99 {} ms",
        waits.len(),
        soak.submitted,
        pick(&waits, 0.5),
        pick(&waits, 0.99)
    );
    let mut submit_ms: Vec<f64> = soak.outcomes.iter().filter(|o| o.1.is_none()).map(|o| o.0).collect();
    submit_ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        submit_ms.get(((submit_ms.len().max(1) - 1) as f64 * q) as usize).copied().unwrap_or(f64::NAN)
    };
    let failures: Vec<&String> = soak.outcomes.iter().filter_map(|o| o.1.as_ref()).collect();
    println!(
        "submit calls: {} answered, {} failed; p50 {:.0} ms, p99 {:.0} ms{}",
        submit_ms.len(),
        failures.len(),
        at(0.5),
        at(0.99),
        failures.first().map_or(String::new(), |e| format!("; first failure: {e}"))
    );
    let lat = c.query(&format!(
        "SELECT l FROM (SELECT stored_at_ms - CAST(receipt_number(body, 't_ms') AS BIGINT) AS l \
         FROM receipts TABLESAMPLE SYSTEM (1) WHERE job_id <> {quiet_job} AND stored_at_ms >= {since}) s \
         WHERE l IS NOT NULL ORDER BY l"
    ))?;
    println!(
        "receipt rank-to-row (a 1 % sample, {} receipts): p50 {} ms, p99 {} ms",
        lat.len(),
        pick(&lat, 0.5),
        pick(&lat, 0.99)
    );
    let total = c.query("SELECT COUNT(*) FROM receipts")?;
    println!("receipts stored in all: {}", total[0][0]);
    println!("leader over the soak:");
    for s in &soak.samples {
        println!("{s}");
    }
    let mut error_lines = serde_json::Map::new();
    for (name, log) in [("ctl-a", c.logs("controller")), ("ctl-b", b.logs())] {
        let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
        println!("error lines in {name}'s log: {}", errors.len());
        for line in errors.iter().take(10) {
            println!("  {line}");
        }
        error_lines.insert(name.to_string(), json!(errors.len()));
    }
    // The leader over the soak; the first sample (at 0 s) spans too short a time for its rates.
    let later: Vec<&Sample> = soak.leader.iter().filter(|l| l.t_s > 0).collect();
    let cpu_max = later.iter().map(|l| l.cpu_pct).reduce(f64::max);
    let rss_max = soak.leader.iter().map(|l| l.rss_mib).reduce(f64::max);
    let mut stored: Vec<f64> = later.iter().map(|l| l.stored_per_s).collect();
    stored.sort_by(f64::total_cmp);
    let stored_median = stored.get(stored.len() / 2).copied();
    let figures = json!({
        "stored_per_s_median": stored_median.map(f64::round),
        "leader_cpu_pct_max": cpu_max.map(round1), "leader_rss_mib_max": rss_max.map(round1),
        "leader_rss_mib_first": soak.leader.first().map(|l| round1(l.rss_mib)),
        "leader_rss_mib_last": soak.leader.last().map(|l| round1(l.rss_mib)),
        "schedule_pass_p50_ms": pass(0.5).map(round2), "schedule_pass_p99_ms": pass(0.99).map(round2),
        "jobs_submitted": soak.submitted, "jobs_ran": waits.len(),
        "submit_to_running_p50_ms": (!waits.is_empty()).then(|| pick(&waits, 0.5)),
        "submit_to_running_p99_ms": (!waits.is_empty()).then(|| pick(&waits, 0.99)),
        "submit_calls_answered": submit_ms.len(), "submit_calls_failed": failures.len(),
        "submit_call_p50_ms": at(0.5).round(), "submit_call_p99_ms": at(0.99).round(),
        "first_submit_failure": failures.first().map(|e| e.chars().take(500).collect::<String>()),
        "rank_to_row_sampled": lat.len(),
        "rank_to_row_p50_ms": (!lat.is_empty()).then(|| pick(&lat, 0.5)),
        "rank_to_row_p99_ms": (!lat.is_empty()).then(|| pick(&lat, 0.99)),
        "receipts_stored": total[0][0], "error_lines": error_lines,
    });
    if let (Some(head), Value::Object(figures)) = (head.as_object_mut(), figures) {
        head.extend(figures);
    }
    out.line(&json!({ "summary": head }))
}
