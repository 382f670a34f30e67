//! Chaos: a 4-host job over 6 network-namespace hosts (two spares), with one failure injected
//! every T seconds from a fixed seed, what it cost, and whether that met the targets: the bench
//! exits non-zero when a receipt is missing or doubled, when an injected failure never recovers,
//! or when a target is missed (docs/faults.md, "The chaos bench").
//!
//! The job: 4 stand-in ranks (`examples/rank.py --collective`: a TCP barrier every step, so a
//! dead or cut peer stops the others as NCCL would) that checkpoint every C seconds and resume
//! after the newest complete checkpoint. Failures, in turn from a seeded shuffle:
//! - `rank_kill`: SIGKILL one rank;
//! - `agent_kill`: SIGKILL a host's agent (its ranks live on); it comes back after a while. It
//!   measures the adoption, which costs nothing: kept as the control;
//! - `host_reboot`: SIGKILL a host's agent and its ranks (what a reboot or a kernel panic does);
//!   it comes back after a while. The stand-in ranks' barrier breaks at once, but a real NCCL
//!   job would hang, so the controller's detection is what must be fast;
//! - `partition`: cut a host's network for 20 s;
//! - `hang`: SIGSTOP one rank (alive, but the collective stops: the others wait in it);
//! - `preemption`: a notice on a host (the file its agent watches); the host is replaced (its
//!   agent restarted) a while after.
//!
//! What it reports is computed in `trainyard_tests::chaos` (unit-tested there): per failure the
//! recovery (every rank stepping again) with the ranks' start-up apart, overlapped failures
//! counted, the hang verdict time measured, ETTR beside the bound the checkpoint interval
//! allows, the steps redone (those no restart could keep, and those the resume point lost), and
//! trainyard's own share beside the old proxy. The receipt check reads every rank's own receipts
//! file: each of its lines (seq 0 to the last) must be stored once.
//!
//! After the last failure every host comes back and the bench waits (up to the longest verdict
//! plus a minute) for the job to step again, so a slow recovery is measured, not called lost.
//! Writes docs/results/chaos-<date>.jsonl (the run's facts, one line per failure, the summary).
//! Run (root: namespace hosts): `cargo bench -p trainyard-tests --bench chaos -- [--quick]
//! [--failures N] [--every S] [--checkpoint S] [--seed X] [--defaults]` (default 20 failures
//! every 120 s, the pace, checkpoints every 30 s; --quick: 6 failures every 30 s;
//! --defaults: the controller's and the job's default knobs instead of the tuned ones).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;
use trainyard_tests::Cluster;
use trainyard_tests::chaos::{Facts, Injected, Outcome, Step, Targets};

const KINDS: [&str; 6] = ["rank_kill", "agent_kill", "host_reboot", "partition", "hang", "preemption"];
const STEP_MS: u64 = 50;
const WORLD: usize = 4;
const HOSTS: usize = 6;
const PARTITION: Duration = Duration::from_secs(20);

struct Options {
    failures: usize,
    every: Duration,
    checkpoint: Duration,
    seed: u64,
    /// How long a killed agent, a rebooted host or a preempted host stays away.
    away: Duration,
    /// The controller's and the job's default knobs (backoff, grace, hang timeout).
    defaults: bool,
}

fn options(args: &[String]) -> Result<Options> {
    let quick = args.iter().any(|a| a == "--quick");
    let mut o = Options {
        failures: if quick { 6 } else { 20 },
        every: Duration::from_secs(if quick { 30 } else { 120 }),
        checkpoint: Duration::from_secs(if quick { 5 } else { 30 }),
        seed: 7,
        away: Duration::from_secs(if quick { 15 } else { 60 }),
        defaults: args.iter().any(|a| a == "--defaults"),
    };
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    if let Some(v) = value("--failures") {
        o.failures = v.parse().context("--failures")?;
    }
    if let Some(v) = value("--every") {
        o.every = Duration::from_secs(v.parse().context("--every")?);
    }
    if let Some(v) = value("--checkpoint") {
        o.checkpoint = Duration::from_secs(v.parse().context("--checkpoint")?);
    }
    if let Some(v) = value("--seed") {
        o.seed = v.parse().context("--seed")?;
    }
    Ok(o)
}

/// splitmix64: the failure schedule from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn kill(pids: &[i32], signal: i32) {
    for pid in pids {
        // SAFETY: kill(2) on a rank process this bench's cluster started.
        unsafe { libc::kill(*pid, signal) };
    }
}

/// The lab: the cluster, its agents (each watching a notice file), and the job's spec file.
struct Lab {
    c: Cluster,
    notices: std::path::PathBuf,
    ckpt: std::path::PathBuf,
}

impl Lab {
    fn notice(&self, h: usize) -> std::path::PathBuf {
        self.notices.join(format!("notice-h{h}"))
    }

    fn start_agent(&mut self, h: usize) -> Result<()> {
        let source = format!("file:{}", self.notice(h).display());
        self.c.start_agent_on_env(h, &format!("h{h}"), 1, &[("TRAINYARD_PREEMPTION_NOTICE", &source)])
    }

    /// A host back from a kill, a reboot or a preemption: its agent started again (a fresh
    /// machine after a preemption: the notice is gone).
    fn bring_back(&mut self, h: usize) -> Result<()> {
        let _ = std::fs::remove_file(self.notice(h));
        self.c.kill_agent(&format!("h{h}"));
        self.start_agent(h)
    }
}

fn start(o: &Options) -> Result<Option<(Lab, u64)>> {
    let tuned = [("--agent-timeout-secs", "8"), ("--cancel-grace-secs", "2")];
    let flags: &[(&str, &str)] = if o.defaults { &[] } else { &tuned };
    let Some(c) = Cluster::start_lab(HOSTS, flags)? else { return Ok(None) };
    let (notices, ckpt) = (c.dir.path().to_path_buf(), c.path("ckpt"));
    let mut lab = Lab { c, notices, ckpt };
    for h in 0..HOSTS {
        lab.start_agent(h)?;
    }
    let every_steps = (o.checkpoint.as_millis() as u64 / STEP_MS).max(1).to_string();
    // Ranks run as the cluster's run account: the checkpoint directory must be theirs to write.
    std::fs::create_dir_all(&lab.ckpt)?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&lab.ckpt, std::fs::Permissions::from_mode(0o1777))?;
    }
    let ckpt = lab.ckpt.display().to_string();
    let step_ms = STEP_MS.to_string();
    let args = [
        "--steps",
        "100000000",
        "--step-ms",
        &step_ms,
        "--collective",
        "--collective-timeout",
        "3600",
        "--checkpoint-dir",
        &ckpt,
        "--checkpoint-every",
        &every_steps,
    ];
    let restart = if o.defaults {
        "[restart]\nmax_restarts = 100\nresume = true\n"
    } else {
        "[restart]\nmax_restarts = 100\nresume = true\nhang_timeout_s = 10\nbackoff_initial_s = 0.5\nbackoff_cap_s = 2\n"
    };
    let job = lab.c.submit(&lab.c.job_file("chaos", WORLD as u32, 1, &args, restart))?;
    lab.c.wait_first_steps(job, WORLD as i64, Duration::from_secs(120))?;
    Ok(Some((lab, job)))
}

/// Injects one failure of `kind` on the host of `rank`; returns it, and when the host comes back
/// (or the cut heals).
fn inject(
    lab: &mut Lab,
    job: u64,
    kind: &str,
    rank: usize,
    o: &Options,
) -> Result<(Injected, Option<(Instant, usize)>)> {
    let status = lab.c.status(job)?;
    let attempt = status["attempt"].as_u64().unwrap_or(0);
    let ranks = status["ranks"].as_array().cloned().unwrap_or_default();
    let host = ranks.get(rank).and_then(|r| r["agent_id"].as_str()).unwrap_or("h0").to_string();
    let h: usize = host.trim_start_matches('h').parse().unwrap_or(0);
    let on_host: Vec<usize> = (0..ranks.len()).filter(|r| ranks[*r]["agent_id"] == host.as_str()).collect();
    let at_ms = now_ms();
    let back = Instant::now() + o.away;
    let returns = match kind {
        "rank_kill" => {
            kill(&trainyard_tests::rank_pids(job, attempt, Some(rank as u32)), libc::SIGKILL);
            None
        }
        "hang" => {
            kill(&trainyard_tests::rank_pids(job, attempt, Some(rank as u32)), libc::SIGSTOP);
            None
        }
        "agent_kill" => {
            lab.c.kill_agent(&host);
            Some((back, h))
        }
        "host_reboot" => {
            lab.c.kill_agent(&host);
            for r in on_host {
                kill(&trainyard_tests::rank_pids(job, attempt, Some(r as u32)), libc::SIGKILL);
            }
            Some((back, h))
        }
        "partition" => {
            lab.c.cut(&host)?;
            Some((Instant::now() + PARTITION, h))
        }
        "preemption" => {
            std::fs::write(lab.notice(h), "chaos: spot instance-action terminate\n")?;
            Some((back, h))
        }
        _ => bail!("unknown kind {kind}"),
    };
    Ok((Injected { kind: kind.to_string(), at_ms, host, attempt }, returns))
}

/// Heals cuts and brings hosts back whose time has come (all of them when `all`).
fn returns_due(lab: &mut Lab, pending: &mut Vec<(Instant, usize, String)>, all: bool) -> Result<()> {
    let now = Instant::now();
    let (due, later): (Vec<_>, Vec<_>) = pending.drain(..).partition(|(t, _, _)| all || *t <= now);
    *pending = later;
    for (_, h, kind) in due {
        if kind == "partition" {
            lab.c.heal(&format!("h{h}"))?;
        } else {
            lab.bring_back(h)?;
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let o = options(&args)?;
    trainyard_tests::build_release_binaries()?;
    let Some((mut lab, job)) = start(&o)? else {
        println!("chaos: skipped (network-namespace hosts need root and iproute2)");
        return Ok(());
    };
    let mut results =
        trainyard_tests::results::Results::create(&trainyard_tests::results::results_dir(), "chaos", &args)?;
    let started_ms = now_ms();
    println!(
        "chaos: job {job}, {WORLD} ranks over {HOSTS} hosts, {} failures every {} s, checkpoints every {} s, seed {}, {} knobs",
        o.failures,
        o.every.as_secs(),
        o.checkpoint.as_secs(),
        o.seed,
        if o.defaults { "default" } else { "tuned" }
    );
    let mut rng = Rng(o.seed);
    let mut order: Vec<&'static str> = (0..o.failures).map(|i| KINDS[i % KINDS.len()]).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut injected = Vec::new();
    let mut pending: Vec<(Instant, usize, String)> = Vec::new();
    for (i, kind) in order.iter().enumerate() {
        let due = Instant::now() + o.every;
        let rank = rng.below(WORLD);
        let (inj, back) = inject(&mut lab, job, kind, rank, &o)?;
        println!(
            "chaos: {:>2}/{} {kind} on {} (rank {rank}, attempt {})",
            i + 1,
            order.len(),
            inj.host,
            inj.attempt
        );
        pending.extend(back.map(|(t, h)| (t, h, kind.to_string())));
        injected.push(inj);
        while Instant::now() < due {
            std::thread::sleep(Duration::from_millis(200));
            returns_due(&mut lab, &mut pending, false)?;
        }
    }
    let ended_ms = now_ms();
    returns_due(&mut lab, &mut pending, true)?;
    settle(&lab, job, ended_ms, &o)?;
    let facts = collect(&lab, job, injected, started_ms, ended_ms)?;
    let targets = Targets {
        agent_timeout_s: 8.0,
        hang_timeout_s: if o.defaults { 300.0 } else { 10.0 },
        every_s: o.every.as_secs_f64(),
        checkpoint_s: o.checkpoint.as_secs_f64(),
    };
    let outcomes = trainyard_tests::chaos::outcomes(&facts);
    for o in &outcomes {
        print_outcome(o, started_ms);
        results.line(
            &json!({"event": o.kind, "host": o.host, "at_s": (o.at_ms - started_ms) as f64 / 1e3,
            "recovered_s": o.recovered_ms.map(|r| r / 1e3), "startup_s": o.startup_ms / 1e3,
            "attempts": [o.attempts.0, o.attempts.1], "overlapped": o.overlapped,
            "verdict_s": o.verdict_ms.map(|v| v / 1e3)}),
        )?;
    }
    let (mut summary, mut misses) = trainyard_tests::chaos::summary(&facts, &targets, &outcomes);
    lab.c.ctl_ok(&["cancel", &job.to_string()])?;
    let broken = receipts_check(&lab, job)?;
    summary["receipts_broken"] = json!(broken);
    if !broken.is_empty() {
        misses.push(format!(
            "receipts: {} (attempt, rank) streams missing or doubling lines: {broken:?}",
            broken.len()
        ));
        summary["misses"] = json!(misses);
    }
    results.line(&json!({"summary": summary}))?;
    println!("chaos: {}", serde_json::to_string_pretty(&summary)?);
    println!("chaos: results in {}", results.path().display());
    if !misses.is_empty() {
        bail!("chaos: {} target(s) missed:\n  {}", misses.len(), misses.join("\n  "));
    }
    Ok(())
}

/// After the last failure, every host back: waits (up to the longest verdict a failure can take,
/// the hang timeout or the hold of a dead agent's ranks, plus a minute) until every rank of the
/// job steps again, so a failure that needs long to recover is measured, not called lost.
fn settle(lab: &Lab, job: u64, after_ms: i64, o: &Options) -> Result<()> {
    let longest = Duration::from_secs(if o.defaults { 300 } else { 120 }) + Duration::from_secs(60);
    let deadline = Instant::now() + longest;
    let sql = format!(
        "SELECT COUNT(DISTINCT rank) FROM receipts WHERE job_id = {job} AND kind = 'step' \
         AND CAST(json_extract(body, '$.at_ms') AS INTEGER) > {after_ms} \
         AND attempt = (SELECT attempt FROM jobs WHERE id = {job})"
    );
    while Instant::now() < deadline {
        if lab.c.query(&sql)?[0][0] == WORLD as i64 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    println!("chaos: the job did not step again within {longest:?} of the last failure");
    Ok(())
}

fn print_outcome(o: &Outcome, start: i64) {
    let recovered = o.recovered_ms.map_or("never".to_string(), |r| format!("{:.2} s", r / 1e3));
    println!(
        "chaos: {:<11} on {:<3} at +{:>6.1} s: every rank stepping again after {recovered} (start-up {:.2} s, attempt {} -> {}){}{}",
        o.kind,
        o.host,
        (o.at_ms - start) as f64 / 1e3,
        o.startup_ms / 1e3,
        o.attempts.0,
        o.attempts.1,
        o.verdict_ms.map_or(String::new(), |v| format!(", hang verdict after {:.2} s", v / 1e3)),
        if o.overlapped { " [overlapped: recovered after the next failure]" } else { "" }
    );
}

/// What the store and the disk say about the run.
fn collect(lab: &Lab, job: u64, injected: Vec<Injected>, start_ms: i64, end_ms: i64) -> Result<Facts> {
    let c = &lab.c;
    let rows = c.query_text(&format!(
        "SELECT CAST(attempt AS TEXT), CAST(rank AS TEXT), CAST(step AS TEXT), \
         CAST(json_extract(body, '$.step_time_ms') AS TEXT), CAST(json_extract(body, '$.at_ms') AS TEXT) \
         FROM receipts WHERE job_id = {job} AND kind = 'step' ORDER BY attempt, rank, step"
    ))?;
    let steps: Vec<Step> = rows
        .iter()
        .filter_map(|r| {
            Some((
                r[0].parse().ok()?,
                r[1].parse().ok()?,
                r[2].parse().ok()?,
                r[3].parse().ok()?,
                r[4].parse().ok()?,
            ))
        })
        .collect();
    let failures = c.status(job)?["failures"].as_array().cloned().unwrap_or_default();
    let failures = failures
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap_or("").to_string(),
                f["attempt"].as_u64().unwrap_or(0),
                f["at_ms"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    let launches = c.query_text(&format!(
        "SELECT CAST(attempt AS TEXT), CAST(json_extract(body, '$.at_ms') AS TEXT) FROM receipts \
         WHERE job_id = {job} AND kind = 'launch'"
    ))?;
    let mut launch_at: BTreeMap<u64, i64> = BTreeMap::new();
    for r in &launches {
        if let (Ok(a), Ok(t)) = (r[0].parse::<u64>(), r[1].parse::<i64>()) {
            launch_at.entry(a).and_modify(|v| *v = (*v).max(t)).or_insert(t);
        }
    }
    Ok(Facts {
        world: WORLD,
        steps,
        injected,
        failures,
        launch_at,
        checkpoints: checkpoints(&lab.ckpt),
        start_ms,
        end_ms,
    })
}

/// Checkpoints complete on disk (every rank's file of the step is there), with when the last
/// of them was written.
fn checkpoints(dir: &std::path::Path) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(step) = name.strip_prefix("step_").and_then(|s| s.parse::<i64>().ok()) else { continue };
        let times: Vec<i64> = (0..WORLD)
            .filter_map(|r| {
                let meta = std::fs::metadata(entry.path().join(format!("rank{r}.json"))).ok()?;
                let t = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
                Some(t.as_millis() as i64)
            })
            .collect();
        if times.len() == WORLD {
            out.push((step, times.into_iter().max().unwrap_or(0)));
        }
    }
    out.sort();
    out
}

/// A rank's receipts that the store does not hold exactly: (attempt, rank, lines in its file,
/// stored, distinct seqs stored).
type Broken = (u64, u64, i64, i64, i64);

/// Every rank's own receipts file against the store, once every rank stopped: each line (seq 0
/// to the last) stored once. Returns the (attempt, rank, lines in the file, stored, distinct)
/// that differ, after giving the agents a minute to deliver.
fn receipts_check(lab: &Lab, job: u64) -> Result<Vec<Broken>> {
    lab.c.wait_ranks_exited(job, Duration::from_secs(120))?;
    let mut files: BTreeMap<(u64, u64), i64> = BTreeMap::new();
    for h in 0..HOSTS {
        let Some(run) = lab.c.run_dir(&format!("h{h}"), job) else { continue };
        for attempt in std::fs::read_dir(&run).into_iter().flatten().flatten() {
            let name = attempt.file_name().to_string_lossy().to_string();
            let Some(a) = name.strip_prefix("attempt-").and_then(|s| s.parse::<u64>().ok()) else { continue };
            for rank in std::fs::read_dir(attempt.path()).into_iter().flatten().flatten() {
                let name = rank.file_name().to_string_lossy().to_string();
                let Some(r) = name.strip_prefix("rank-").and_then(|s| s.parse::<u64>().ok()) else {
                    continue;
                };
                let text = std::fs::read(rank.path().join("receipts.jsonl")).unwrap_or_default();
                files.insert((a, r), text.iter().filter(|b| **b == b'\n').count() as i64);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let rows = lab.c.query(&format!(
            "SELECT attempt, rank, COUNT(*), COUNT(DISTINCT seq), MIN(seq), MAX(seq) FROM receipts \
             WHERE job_id = {job} GROUP BY attempt, rank"
        ))?;
        let stored: BTreeMap<(u64, u64), &Vec<i64>> =
            rows.iter().map(|r| ((r[0] as u64, r[1] as u64), r)).collect();
        let broken: Vec<Broken> = files
            .iter()
            .filter_map(|(&(a, r), &lines)| {
                let (count, distinct, min, max) =
                    stored.get(&(a, r)).map_or((0, 0, 0, -1), |s| (s[2], s[3], s[4], s[5]));
                let whole =
                    lines == 0 || (count == lines && distinct == lines && min == 0 && max == lines - 1);
                (!whole).then_some((a, r, lines, count, distinct))
            })
            .collect();
        if broken.is_empty() {
            println!("chaos: receipts: {} (attempt, rank) files, every line stored once", files.len());
            return Ok(broken);
        }
        if Instant::now() > deadline {
            return Ok(broken);
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}
