//! Receipt ingest while the controller is attacked: the rate must stay at 80 % or more of the
//! quiet rate measured in the same run.
//!
//! On a secure cluster (TLS, agent certificates, tokens, run-as), two agents with 4 flood ranks
//! each (as in `receipt_throughput`) write receipts as fast as they can, in rounds that
//! alternate quiet and attacked; the attack is
//! - 200 calls a second with a bad token, each on a new TLS connection, each carrying 1 KiB of
//!   headers: a well-formed random token and padding. They come from 1,000 source addresses in
//!   turn (127.1.0.1 to 127.1.3.250: on Linux any 127.x.y.z is the loopback, no set-up needed),
//!   as a distributed flood would;
//! - 50 `Logs --follow` streams (from four admin users) on a rank that wrote 200 MB of stdout,
//!   each reading one piece a second, reconnecting when the controller drops it for being slow.
//!
//! The controller's door (`controller/src/auth/door.rs`) counts refused calls per source
//! address: past a burst of 20 (then 2 a second) an address is limited for 10 s, and its new
//! connections beyond 10 a second are closed at accept, before their TLS handshake. Spread over
//! 1,000 addresses each makes 0.2 calls a second and is never limited (and the door tracks at
//! most 4,096 addresses): every call costs the controller its handshake and reaches the token
//! check, so the figure says what a distributed flood costs. `TRAINYARD_ATTACK_ADDRESSES=1`
//! sends them all from one address, which the door closes after 20 (the cost of a flood the
//! door stops). Each attacked run prints how many distinct addresses the calls came from, how
//! many reached the token check (answered `Unauthenticated`) and how many were turned away at
//! accept (as this client saw it, and by the controller's
//! `trainyard_connections_turned_away_total`).
//!
//! It prints each run, the medians of 3 quiet and 3 attacked runs, their ratio, what the attack
//! achieved, and how many refused calls reached `audit_log` (rate-limited). The attacker's
//! threads run at nice 19: on one 2-core machine they stand in for clients elsewhere.
//!
//! Every run writes its figures to `docs/results/receipts_under_attack-<date>.jsonl`
//! ([`trainyard_tests::results`]): one line per run (quiet or attacked, with what the attack
//! achieved), then the summary (the medians, their ratio, the attack's totals).
//!
//! Run: `cargo bench -p trainyard-tests --bench
//! receipts_under_attack` (`TRAINYARD_ATTACK=tokens` or `logs` runs one half of the attack alone,
//! `none` no attack: the noise between alternate runs; `TRAINYARD_ATTACK_ADDRESSES=N` sends the
//! bad-token calls from N addresses, 1 to 64,000; `TRAINYARD_ATTACK_PERF=FILE` profiles the
//! controller during the first attacked run with `perf record`).

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use trainyard_proto::v1::jobs_client::JobsClient;
use trainyard_proto::v1::{ListJobsRequest, LogsRequest};
use trainyard_tests::flood::{flood, median, process_cpu_s as cpu_secs};
use trainyard_tests::results::{Results, results_dir};
use trainyard_tests::{Cluster, run_account};

const PER_RANK: i64 = 50_000;
const BAD_CALLS_PER_SEC: u64 = 200;
const LOG_READERS: usize = 50;
const READER_USERS: usize = 4;
/// The source addresses the bad-token calls take in turn (`TRAINYARD_ATTACK_ADDRESSES`).
const ATTACK_ADDRESSES: u64 = 1_000;
/// At most 250 x 256 addresses fit [`attacker`]'s 127.1.x.y.
const MAX_ATTACK_ADDRESSES: u64 = 64_000;

/// A stop flag the attack tasks poll.
#[derive(Clone, Default)]
struct Stop(Arc<AtomicBool>);

impl Stop {
    fn stop(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
    fn stopped(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
struct Counts {
    bad_calls: AtomicU64,
    /// Answered `Unauthenticated`: the call passed the door and reached the token check.
    reached: AtomicU64,
    /// No connection (the door closed it at accept, before its TLS handshake).
    turned_away: AtomicU64,
    /// Any other answer.
    other: AtomicU64,
    pieces: AtomicU64,
    dropped: AtomicU64,
    /// The source addresses the bad-token calls came from.
    sources: Mutex<HashSet<[u8; 4]>>,
}

impl Counts {
    /// Distinct source addresses the bad-token calls came from.
    fn sources(&self) -> usize {
        self.sources.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// A new TLS connection to the controller from `from` (a loopback address).
async fn channel(url: &str, ca: &[u8], from: [u8; 4]) -> anyhow::Result<Channel> {
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    let endpoint = Endpoint::from_shared(url.to_string())?.local_address(Some(from.into()));
    Ok(endpoint.tls_config(tls)?.connect().await?)
}

/// The source address of the `n`th bad-token call, `addresses` of them in turn: 127.1.x.y (any
/// 127.x.y.z reaches the loopback), as attackers' hosts would, so the controller's door counts
/// them and not the bench's own `ctl` and agents on 127.0.0.1 (nor the readers on 127.0.0.3).
fn attacker(n: u64, addresses: u64) -> [u8; 4] {
    let i = n % addresses.clamp(1, MAX_ATTACK_ADDRESSES);
    [127, 1, (i / 250) as u8, (i % 250 + 1) as u8]
}
/// The slow log readers are users with valid tokens, elsewhere too.
const READERS: [u8; 4] = [127, 0, 0, 3];

/// One call with a bad (well-formed, unknown) token and 1 KiB of padding, on a new connection
/// from `from`.
async fn bad_call(url: String, ca: Arc<Vec<u8>>, n: u64, from: [u8; 4], counts: Arc<Counts>) {
    counts.bad_calls.fetch_add(1, Ordering::Relaxed);
    counts.sources.lock().unwrap_or_else(|p| p.into_inner()).insert(from);
    let Ok(ch) = channel(&url, &ca, from).await else {
        counts.turned_away.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let mut request = tonic::Request::new(ListJobsRequest::default());
    let token = format!("Bearer tyt_{n:064x}");
    request.metadata_mut().insert("authorization", token.parse().expect("ascii"));
    request.metadata_mut().insert("x-pad", "p".repeat(1024 - token.len()).parse().expect("ascii"));
    match JobsClient::new(ch).list(request).await {
        Err(s) if s.code() == tonic::Code::Unauthenticated => counts.reached.fetch_add(1, Ordering::Relaxed),
        _ => counts.other.fetch_add(1, Ordering::Relaxed),
    };
}

/// A `Logs --follow` client that reads one piece a second, reconnecting when dropped.
async fn slow_reader(
    url: String,
    ca: Arc<Vec<u8>>,
    token: String,
    job_id: u64,
    stop: Stop,
    counts: Arc<Counts>,
) {
    while !stop.stopped() {
        let Ok(ch) = channel(&url, &ca, READERS).await else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let mut request = tonic::Request::new(LogsRequest { job_id, rank: 0, tail_lines: 0, follow: true });
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().expect("ascii"));
        let Ok(response) = JobsClient::new(ch).logs(request).await else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let mut stream = response.into_inner();
        while !stop.stopped() {
            tokio::time::sleep(Duration::from_secs(1)).await;
            match stream.message().await {
                Ok(Some(_)) => counts.pieces.fetch_add(1, Ordering::Relaxed),
                _ => {
                    counts.dropped.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            };
        }
    }
}

/// The slow log readers an attack runs: none when `TRAINYARD_ATTACK` is `tokens` or `none`.
fn reader_count(only: &str) -> usize {
    if only == "tokens" || only == "none" { 0 } else { LOG_READERS }
}

/// Starts the attack (`only`: `TRAINYARD_ATTACK`; the bad-token calls from `addresses` source
/// addresses in turn); it runs until `stop`.
fn attack(
    rt: &tokio::runtime::Runtime,
    c: &Cluster,
    ca: &Arc<Vec<u8>>,
    tokens: &[String],
    chatter: u64,
    only: &str,
    addresses: u64,
) -> (Stop, Arc<Counts>) {
    let (stop, counts) = (Stop::default(), Arc::new(Counts::default()));
    let url = c.url();
    // TRAINYARD_ATTACK=tokens or logs runs one half of the attack alone (to see what each costs);
    // TRAINYARD_ATTACK=none: no attack at all, to see the noise between alternate runs.
    let readers = reader_count(only);
    let only = only.to_string();
    for i in 0..readers {
        let token = tokens[i % tokens.len()].clone();
        rt.spawn(slow_reader(url.clone(), ca.clone(), token, chatter, stop.clone(), counts.clone()));
    }
    let (stop2, counts2, ca2) = (stop.clone(), counts.clone(), ca.clone());
    rt.spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / BAD_CALLS_PER_SEC));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let in_flight = Arc::new(tokio::sync::Semaphore::new(400));
        let mut n = 0u64;
        while !stop2.stopped() && only != "logs" && only != "none" {
            tick.tick().await;
            let Ok(permit) = in_flight.clone().try_acquire_owned() else { continue };
            n += 1;
            let (url, ca, counts) = (url.clone(), ca2.clone(), counts2.clone());
            tokio::spawn(async move {
                bad_call(url, ca, n, attacker(n, addresses), counts).await;
                drop(permit);
            });
        }
    });
    (stop, counts)
}

/// CPU seconds of the controller, the agents and this process (the attacker) so far.
fn cpu(c: &Cluster) -> [f64; 3] {
    let agents = c.live_processes("trainyard-agent").into_iter().map(cpu_secs).sum();
    [c.controller_pid().map_or(0.0, cpu_secs), agents, cpu_secs(std::process::id())]
}

/// New connections the controller closed at accept so far (`trainyard_connections_turned_away_total`).
fn turned_away(c: &Cluster) -> u64 {
    let Ok((_, text)) = c.http("GET", "/metrics") else { return 0 };
    let prefix = "trainyard_connections_turned_away_total ";
    let count = text.lines().find_map(|l| l.strip_prefix(prefix)?.trim().parse::<f64>().ok());
    count.map_or(0, |v| v as u64)
}

/// Store operations by kind: count and seconds.
type Ops = BTreeMap<String, (f64, f64)>;

/// Store operations so far by kind: count and seconds (`trainyard_store_operation_seconds`).
fn store_ops(c: &Cluster) -> Ops {
    let mut ops = BTreeMap::new();
    let Ok((_, text)) = c.http("GET", "/metrics") else { return ops };
    for line in text.lines() {
        let (kind, rest) = match line.split_once("_count{op=\"").or(line.split_once("_sum{op=\"")) {
            Some((head, rest)) if head.ends_with("store_operation_seconds") => {
                (line.contains("_count{"), rest)
            }
            _ => continue,
        };
        let Some((op, value)) = rest.split_once("\"} ") else { continue };
        let value: f64 = value.trim().parse().unwrap_or(0.0);
        let entry = ops.entry(op.to_string()).or_insert((0.0, 0.0));
        if kind { entry.0 = value } else { entry.1 = value }
    }
    ops
}

/// The five store operations between two snapshots that took the most time: kind, count, seconds.
fn busiest(before: &Ops, after: &Ops) -> Vec<(String, f64, f64)> {
    let mut d: Vec<(String, f64, f64)> = after
        .iter()
        .map(|(op, (n, s))| {
            let (n0, s0) = before.get(op).copied().unwrap_or_default();
            (op.clone(), n - n0, s - s0)
        })
        .filter(|(_, n, _)| *n > 0.0)
        .collect();
    d.sort_by(|a, b| b.2.total_cmp(&a.2));
    d.truncate(5);
    d
}

/// One flood's figures.
struct Measured {
    rate: f64,
    /// CPU seconds the controller, the agents and the attacker used during it.
    cpu: [f64; 3],
    /// The store operations that took the most time: kind, count, seconds.
    busiest: Vec<(String, f64, f64)>,
}

impl Measured {
    /// As printed: the CPU each part used and the busiest store operations.
    fn used(&self) -> String {
        let used: Vec<String> = ["controller", "agents", "attacker"]
            .iter()
            .zip(self.cpu)
            .map(|(who, s)| format!("{who} {s:.1} s"))
            .collect();
        let store: Vec<String> =
            self.busiest.iter().map(|(op, n, s)| format!("{op} x{n:.0} {s:.2} s")).collect();
        format!("CPU: {}; store: {}", used.join(", "), store.join(", "))
    }

    /// Its line in the results file (what an attacked run adds comes on top).
    fn json(&self, run: usize, attacked: bool) -> serde_json::Value {
        let store: Vec<serde_json::Value> = self
            .busiest
            .iter()
            .map(|(op, n, s)| json!({"op": op, "count": n.round(), "s": round2(*s)}))
            .collect();
        json!({
            "run": run, "attacked": attacked, "rate": self.rate.round(),
            "controller_cpu_s": round1(self.cpu[0]), "agents_cpu_s": round1(self.cpu[1]),
            "attacker_cpu_s": round1(self.cpu[2]), "store_busiest": store,
        })
    }
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// One flood, with the CPU seconds each part used during it.
fn measured(c: &Cluster, name: &str) -> anyhow::Result<Measured> {
    let (before, ops_before) = (cpu(c), store_ops(c));
    let f = flood(c, name, PER_RANK, 0)?;
    let (after, ops_after) = (cpu(c), store_ops(c));
    let cpu = [after[0] - before[0], after[1] - before[1], after[2] - before[2]];
    Ok(Measured { rate: f.rate, cpu, busiest: busiest(&ops_before, &ops_after) })
}

/// What the bad-token calls of the attacked runs came to, summed over the runs.
#[derive(Default)]
struct Totals {
    calls: u64,
    reached: u64,
    turned_away: u64,
    turned_away_by_controller: u64,
    other: u64,
    /// The most distinct source addresses one attack used.
    sources: usize,
}

fn main() -> anyhow::Result<()> {
    trainyard_tests::build_release_binaries()?;
    let named: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let mut out = Results::create(&results_dir(), "receipts_under_attack", &named)?;
    // TRAINYARD_ATTACK=tokens, logs or none: one half of the attack, or none (see the top).
    let only = std::env::var("TRAINYARD_ATTACK").unwrap_or_default();
    let addresses = match std::env::var("TRAINYARD_ATTACK_ADDRESSES") {
        Err(_) => ATTACK_ADDRESSES,
        Ok(v) => match v.parse::<u64>() {
            Ok(n) if (1..=MAX_ATTACK_ADDRESSES).contains(&n) => n,
            _ => anyhow::bail!("TRAINYARD_ATTACK_ADDRESSES={v}: expected 1 to {MAX_ATTACK_ADDRESSES}"),
        },
    };
    let bad_calls_per_sec = if only == "logs" || only == "none" { 0 } else { BAD_CALLS_PER_SEC };
    // The attacker's threads run at the lowest priority: on this 2-core machine they stand in for
    // clients on other machines, so what the bench measures is what the attack costs the
    // controller, not what the attacker's own TLS handshakes take from the same cores. The
    // achieved attack rate is printed, to show the attack still ran at full strength.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(|| {
            // SAFETY: setpriority on the calling thread (Linux: nice values are per thread).
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
        })
        .build()?;
    let mut c = Cluster::start_secure()?;
    c.start_agent("node-a", 5)?;
    c.start_agent("node-b", 5)?;
    let ca = Arc::new(std::fs::read(c.pki().context("pki")?.join("ca.pem"))?);
    let account = run_account();
    let tokens: Vec<String> = (0..READER_USERS)
        .map(|i| c.add_user(&format!("reader{i}"), &["--admin", "--unix-user", &account]))
        .collect::<anyhow::Result<_>>()?;
    let chatter_spec = c.path("chatter.toml");
    std::fs::write(
        &chatter_spec,
        "name = \"chatter\"\n[resources]\ngpus = 1\n\n[engine]\nkind = \"exec\"\n\
         argv = [\"sh\", \"-c\", \"yes 'a line of training output, about one hundred bytes long, as a chatty rank writes them' | head -n 2000000; sleep 3600\"]\n\
         workdir = \"/\"\n",
    )?;
    let chatter = c.submit(&chatter_spec)?;
    c.wait_state(chatter, &["running"], Duration::from_secs(30))?;
    println!(
        "== SQLite, secure cluster: receipts quiet and under attack ({BAD_CALLS_PER_SEC} bad-token calls/s from {addresses} addresses, {LOG_READERS} slow log readers)"
    );
    let (mut quiet, mut attacked) = (Vec::new(), Vec::new());
    let mut totals = Totals::default();
    // Runs in the order Q A A Q Q A: the store grows with every run and later runs are a little
    // slower, which plain alternation would bill to the attack.
    for (run, under_attack) in [false, true, true, false, false, true].into_iter().enumerate() {
        let round = run / 2;
        if !under_attack {
            let m = measured(&c, &format!("quiet-{run}"))?;
            println!("run {run} quiet:    {:.0} receipts/s; {}", m.rate, m.used());
            out.line(&m.json(run, false))?;
            quiet.push(m.rate);
            continue;
        }
        let turned_away_before = turned_away(&c);
        let (stop, counts) = attack(&rt, &c, &ca, &tokens, chatter, &only, addresses);
        std::thread::sleep(Duration::from_secs(2));
        let started = Instant::now();
        let before = counts.bad_calls.load(Ordering::Relaxed);
        // TRAINYARD_ATTACK_PERF=FILE: a CPU profile of the controller during the first attacked run.
        let perf = match (round, std::env::var("TRAINYARD_ATTACK_PERF"), c.controller_pid()) {
            (0, Ok(file), Some(pid)) => std::process::Command::new("perf")
                .args(["record", "-F", "499", "-g", "-o", &file, "-p", &pid.to_string()])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .ok(),
            _ => None,
        };
        let m = measured(&c, &format!("attacked-{run}"))?;
        if let Some(mut perf) = perf {
            // SAFETY: kill(2) on the child we started.
            unsafe { libc::kill(perf.id() as i32, libc::SIGINT) };
            let _ = perf.wait();
        }
        let calls = counts.bad_calls.load(Ordering::Relaxed) - before;
        let secs = started.elapsed().as_secs_f64();
        // Since the attack started (its 2 s lead-in included), as the calls/s is over the run.
        let (all_calls, sources) = (counts.bad_calls.load(Ordering::Relaxed), counts.sources());
        let reached = counts.reached.load(Ordering::Relaxed);
        let turned = counts.turned_away.load(Ordering::Relaxed);
        let by_controller = turned_away(&c).saturating_sub(turned_away_before);
        let other = counts.other.load(Ordering::Relaxed);
        let pieces = counts.pieces.load(Ordering::Relaxed);
        let dropped = counts.dropped.load(Ordering::Relaxed);
        stop.stop();
        println!(
            "run {run} attacked: {:.0} receipts/s; {}; meanwhile {:.0} bad-token calls/s \
             from {sources} addresses ({reached} refused at the token check, {turned} turned away \
             at accept so far: {by_controller} by the controller's count; {other} other), \
             {pieces} log pieces read, {dropped} slow readers dropped",
            m.rate,
            m.used(),
            calls as f64 / secs,
        );
        let mut line = m.json(run, true);
        line["bad_calls_per_s"] = json!((calls as f64 / secs).round());
        line["bad_calls"] = json!(all_calls);
        line["source_addresses"] = json!(sources);
        line["reached_token_check"] = json!(reached);
        line["turned_away"] = json!(turned);
        line["turned_away_by_controller"] = json!(by_controller);
        line["other"] = json!(other);
        line["log_pieces"] = json!(pieces);
        line["readers_dropped"] = json!(dropped);
        out.line(&line)?;
        totals.calls += all_calls;
        totals.reached += reached;
        totals.turned_away += turned;
        totals.turned_away_by_controller += by_controller;
        totals.other += other;
        totals.sources = totals.sources.max(sources);
        attacked.push(m.rate);
        // The readers notice the stop within a second; their streams close.
        std::thread::sleep(Duration::from_secs(2));
    }
    let (q, a) = (median(quiet), median(attacked));
    println!(
        "quiet: median {q:.0} receipts/s; attacked: median {a:.0} receipts/s; ratio {:.2} (target >= 0.80)",
        a / q
    );
    let audited = c.query("SELECT COUNT(*) FROM audit_log WHERE actor = '-'")?;
    println!(
        "refused calls written to audit_log: {} (rate-limited; the rest counted in summary rows)",
        audited[0][0]
    );
    let attack_kind = if only.is_empty() { "all" } else { only.as_str() };
    out.line(&json!({"summary": {
        "attack": attack_kind, "bad_calls_per_s_offered": bad_calls_per_sec, "attack_addresses": addresses,
        "log_readers": reader_count(&only), "quiet_rate": q.round(), "attacked_rate": a.round(),
        "ratio": round2(a / q), "target_ratio": 0.8, "bad_calls": totals.calls,
        "reached_token_check": totals.reached, "turned_away": totals.turned_away,
        "turned_away_by_controller": totals.turned_away_by_controller, "other": totals.other,
        "source_addresses": totals.sources, "audit_log_refused_rows": audited[0][0],
    }}))?;
    c.ctl_ok(&["cancel", &chatter.to_string()])?;
    println!("results: {}", out.path().display());
    Ok(())
}
