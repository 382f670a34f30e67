//! Chaos: a 4-host job over 6 network-namespace hosts (two spares), with one failure injected
//! every T seconds from a fixed seed, and what it cost.
//!
//! The job: 4 stand-in ranks (`examples/rank.py --collective`: a TCP barrier every step, so a
//! dead or cut peer stops the others as NCCL would) that checkpoint every C seconds and resume
//! after the newest complete checkpoint. Failures, in turn from a seeded shuffle:
//! - `rank_kill`: SIGKILL one rank;
//! - `agent_kill`: SIGKILL a host's agent (its ranks live on); it comes back after a while;
//! - `partition`: cut a host's network for 20 s;
//! - `hang`: SIGSTOP one rank (alive, but the collective stops: the others wait in it);
//! - `preemption`: a notice on a host (the file its agent watches); the host is replaced (its
//!   agent restarted) a while after.
//!
//! Prints, from the receipts (ranks stamp each step with their wall clock): ETTR (step time
//! kept / wall), beside the bound the checkpoint interval alone allows; per kind, MTTR (the
//! failure to every rank stepping again) with the ranks' own start-up apart; steps redone;
//! trainyard's own share of the wall time for rank kills, agent kills and preemptions (MTTR
//! minus start-up, summed, over wall time); and the receipt check: per (attempt, rank) every
//! seq from the first to the last stored, once.
//!
//! Run (root: namespace hosts): `cargo bench -p trainyard-tests --bench chaos -- [--quick]
//! [--failures N] [--every S] [--checkpoint S] [--seed X]` (default 20 failures every 30 s,
//! checkpoints every 5 s; --quick: 5 failures every 20 s).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use trainyard_tests::Cluster;

const KINDS: [&str; 5] = ["rank_kill", "agent_kill", "partition", "hang", "preemption"];
const STEP_MS: u64 = 50;
const WORLD: usize = 4;
const HOSTS: usize = 6;

struct Options {
    failures: usize,
    every: Duration,
    checkpoint: Duration,
    seed: u64,
    /// How long a killed agent or a preempted host stays away.
    away: Duration,
}

fn options() -> Result<Options> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let mut o = Options {
        failures: if quick { 5 } else { 20 },
        every: Duration::from_secs(if quick { 20 } else { 30 }),
        checkpoint: Duration::from_secs(5),
        seed: 7,
        away: Duration::from_secs(if quick { 15 } else { 60 }),
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

/// Pids of the python processes of `job`'s `attempt` with `RANK=rank`.
fn rank_pids(job: u64, attempt: u64, rank: usize) -> Vec<i32> {
    let wants = [
        format!("TRAINYARD_JOB_ID={job}\0"),
        format!("TRAINYARD_ATTEMPT={attempt}\0"),
        format!("\0RANK={rank}\0"),
    ];
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            comm.starts_with("python")
                && wants.iter().all(|w| env.windows(w.len()).any(|x| x == w.as_bytes()))
        })
        .collect()
}

struct Injected {
    kind: &'static str,
    at_ms: i64,
    host: String,
    attempt: u64,
}

fn main() -> Result<()> {
    trainyard_tests::build_release_binaries()?;
    let o = options()?;
    let flags = [("--agent-timeout-secs", "8"), ("--cancel-grace-secs", "2")];
    let Some(mut c) = Cluster::start_lab(HOSTS, &flags)? else {
        println!("chaos: skipped (network-namespace hosts need root and iproute2)");
        return Ok(());
    };
    let dir = c.dir.path().to_path_buf();
    let notice = move |h: usize| dir.join(format!("notice-h{h}")).display().to_string();
    for h in 0..HOSTS {
        let source = format!("file:{}", notice(h));
        c.start_agent_on_env(h, &format!("h{h}"), 1, &[("TRAINYARD_PREEMPTION_NOTICE", &source)])?;
    }
    let every_steps = (o.checkpoint.as_millis() as u64 / STEP_MS).max(1).to_string();
    // Ranks run as the cluster's run account: the checkpoint directory must be theirs to write.
    let ckpt = c.path("ckpt");
    std::fs::create_dir_all(&ckpt)?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&ckpt, std::fs::Permissions::from_mode(0o1777))?;
    }
    let ckpt = ckpt.display().to_string();
    let args = [
        "--steps",
        "100000000",
        "--step-ms",
        &STEP_MS.to_string(),
        "--collective",
        "--collective-timeout",
        "3600",
        "--checkpoint-dir",
        &ckpt,
        "--checkpoint-every",
        &every_steps,
    ];
    let restart = "[restart]\nmax_restarts = 100\nresume = true\nhang_timeout_s = 10\nbackoff_initial_s = 0.5\nbackoff_cap_s = 2\n";
    let job = c.submit(&c.job_file("chaos", WORLD as u32, 1, &args, restart))?;
    c.wait_first_steps(job, WORLD as i64, Duration::from_secs(120))?;
    let started_ms = now_ms();
    println!(
        "chaos: job {job}, {WORLD} ranks over {HOSTS} hosts, {} failures every {} s, checkpoints every {} s, seed {}",
        o.failures,
        o.every.as_secs(),
        o.checkpoint.as_secs(),
        o.seed
    );
    let mut rng = Rng(o.seed);
    let mut order: Vec<&'static str> = (0..o.failures).map(|i| KINDS[i % KINDS.len()]).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut injected = Vec::new();
    let mut returns: Vec<(Instant, usize)> = Vec::new();
    let mut heals: Vec<(Instant, String)> = Vec::new();
    for (i, kind) in order.iter().enumerate() {
        let due = Instant::now() + o.every;
        let status = c.status(job)?;
        let attempt = status["attempt"].as_u64().unwrap_or(0);
        let ranks = status["ranks"].as_array().cloned().unwrap_or_default();
        let rank = rng.below(WORLD);
        let host = ranks.get(rank).and_then(|r| r["agent_id"].as_str()).unwrap_or("h0").to_string();
        let h: usize = host.trim_start_matches('h').parse().unwrap_or(0);
        let at_ms = now_ms();
        match *kind {
            "rank_kill" | "hang" => {
                let sig = if *kind == "hang" { libc::SIGSTOP } else { libc::SIGKILL };
                for pid in rank_pids(job, attempt, rank) {
                    // SAFETY: kill(2) on a rank process this bench's cluster started.
                    unsafe { libc::kill(pid, sig) };
                }
            }
            "agent_kill" => {
                c.kill_agent(&host);
                returns.push((Instant::now() + o.away, h));
            }
            "partition" => {
                c.cut(&host)?;
                heals.push((Instant::now() + Duration::from_secs(20), host.clone()));
            }
            "preemption" => {
                std::fs::write(notice(h), "chaos: spot instance-action terminate\n")?;
                returns.push((Instant::now() + o.away, h));
            }
            _ => bail!("unknown kind {kind}"),
        }
        println!("chaos: {:>2}/{} {kind} on {host} (rank {rank}, attempt {attempt})", i + 1, order.len());
        injected.push(Injected { kind, at_ms, host, attempt });
        while Instant::now() < due {
            std::thread::sleep(Duration::from_millis(200));
            for (_, host) in heals.iter().filter(|(t, _)| *t <= Instant::now()) {
                c.heal(host)?;
            }
            heals.retain(|(t, _)| *t > Instant::now());
            let back: Vec<usize> =
                returns.iter().filter(|(t, _)| *t <= Instant::now()).map(|(_, h)| *h).collect();
            returns.retain(|(t, _)| *t > Instant::now());
            for h in back {
                // A killed agent restarts; a preempted host comes back as a fresh machine.
                let _ = std::fs::remove_file(notice(h));
                c.kill_agent(&format!("h{h}"));
                let source = format!("file:{}", notice(h));
                c.start_agent_on_env(h, &format!("h{h}"), 1, &[("TRAINYARD_PREEMPTION_NOTICE", &source)])?;
            }
        }
    }
    for (_, host) in &heals {
        c.heal(host)?;
    }
    let ended_ms = now_ms();
    report(&c, job, &o, &injected, started_ms, ended_ms)?;
    c.ctl_ok(&["cancel", &job.to_string()])?;
    Ok(())
}

/// (attempt, rank, step, step_time_ms, at_ms) of every step receipt.
type Step = (u64, usize, i64, f64, i64);

fn steps(c: &Cluster, job: u64) -> Result<Vec<Step>> {
    let rows = c.query_text(&format!(
        "SELECT CAST(attempt AS TEXT), CAST(rank AS TEXT), CAST(step AS TEXT), \
         CAST(json_extract(body, '$.step_time_ms') AS TEXT), CAST(json_extract(body, '$.at_ms') AS TEXT) \
         FROM receipts WHERE job_id = {job} AND kind = 'step' ORDER BY attempt, rank, step"
    ))?;
    Ok(rows
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
        .collect())
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn report(c: &Cluster, job: u64, o: &Options, injected: &[Injected], start: i64, end: i64) -> Result<()> {
    let failures = c.status(job)?["failures"].as_array().cloned().unwrap_or_default();
    for f in &failures {
        println!(
            "chaos: failure of attempt {}: {} on {} (blamed {}, charged {}): {}",
            f["attempt"],
            f["kind"].as_str().unwrap_or(""),
            f["agent_id"].as_str().unwrap_or(""),
            f["blamed"],
            f["charged"],
            f["evidence"].as_str().unwrap_or("")
        );
    }
    let all = steps(c, job)?;
    let wall_ms = (end - start) as f64;
    // Rank 0's steps inside the measured window: the newest attempt's receipt of a step is kept.
    let rank0: Vec<&Step> = all.iter().filter(|s| s.1 == 0 && s.4 >= start && s.4 <= end).collect();
    let mut newest: BTreeMap<i64, &Step> = BTreeMap::new();
    for s in &rank0 {
        newest
            .entry(s.2)
            .and_modify(|k| {
                if s.0 > k.0 {
                    *k = s
                }
            })
            .or_insert(s);
    }
    let kept_ms: f64 = newest.values().map(|s| s.3).sum();
    let redone = rank0.len() - newest.len();
    let redone_ms: f64 = rank0.iter().map(|s| s.3).sum::<f64>() - kept_ms;
    let ettr = kept_ms / wall_ms;
    let bound = 1.0 - (o.checkpoint.as_secs_f64() / 2.0) / o.every.as_secs_f64();
    // MTTR per failure: from the injection to every rank stepping again (in the attempt that
    // runs after it); the ranks' start-up (launch to first step) apart.
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
    let mut by_kind: BTreeMap<&str, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    let mut own_ms = 0.0;
    for (i, f) in injected.iter().enumerate() {
        let next = injected.get(i + 1).map_or(end, |n| n.at_ms);
        let attempts: BTreeSet<u64> =
            all.iter().filter(|s| s.4 > f.at_ms && s.4 < next).map(|s| s.0).collect();
        let Some(&after) = attempts.iter().next_back() else { continue };
        let first_per_rank: Vec<i64> = (0..WORLD)
            .filter_map(|r| {
                all.iter().filter(|s| s.0 == after && s.1 == r && s.4 > f.at_ms).map(|s| s.4).min()
            })
            .collect();
        if first_per_rank.len() < WORLD {
            continue;
        }
        let mttr = (*first_per_rank.iter().max().unwrap_or(&f.at_ms) - f.at_ms) as f64;
        let startup = if after > f.attempt {
            launch_at
                .get(&after)
                .map_or(0.0, |l| (*first_per_rank.iter().min().unwrap_or(l) - l).max(0) as f64)
        } else {
            0.0
        };
        let entry = by_kind.entry(f.kind).or_default();
        entry.0.push(mttr);
        entry.1.push(startup);
        if matches!(f.kind, "rank_kill" | "agent_kill" | "preemption") {
            own_ms += (mttr - startup).max(0.0);
        }
        println!(
            "chaos: {:<10} on {:<3} at +{:>5.1} s: every rank stepping again after {:>6.2} s (start-up {:.2} s, attempt {} -> {after})",
            f.kind,
            f.host,
            (f.at_ms - start) as f64 / 1000.0,
            mttr / 1000.0,
            startup / 1000.0,
            f.attempt
        );
    }
    let exits = c.query_text(&format!(
        "SELECT CAST(attempt AS TEXT), CAST(rank AS TEXT), COALESCE(json_extract(body, '$.reason'), '') FROM receipts \
         WHERE job_id = {job} AND kind = 'exit' AND json_extract(body, '$.code') != 0 ORDER BY attempt, rank"
    ))?;
    for e in &exits {
        println!("chaos: attempt {} rank {} exited: {}", e[0], e[1], e[2]);
    }
    println!(
        "chaos: wall {:.1} s, {} failures injected, {} attempts ended",
        wall_ms / 1000.0,
        injected.len(),
        failures.len()
    );
    println!(
        "chaos: ETTR {:.3} (kept step time / wall); the checkpoint interval alone allows {:.3} (1 - C/2 / T)",
        ettr, bound
    );
    println!("chaos: steps redone {redone} ({:.1} s of step time)", redone_ms / 1000.0);
    for (kind, (mttr, startup)) in &by_kind {
        println!(
            "chaos: MTTR {kind:<10} p50 {:>6.2} s (n={}), rank start-up p50 {:.2} s",
            median(mttr.clone()).unwrap_or(0.0) / 1000.0,
            mttr.len(),
            median(startup.clone()).unwrap_or(0.0) / 1000.0
        );
    }
    println!(
        "chaos: trainyard's own share for rank kills, agent kills and preemptions: {:.2} % of wall (detection, decision, placement, launch)",
        100.0 * own_ms / wall_ms
    );
    // Receipts: every (attempt, rank) holds each seq from its first to its last once.
    let rows = c.query(&format!(
        "SELECT attempt, rank, COUNT(*), COUNT(DISTINCT seq), MIN(seq), MAX(seq) FROM receipts \
         WHERE job_id = {job} GROUP BY attempt, rank"
    ))?;
    let broken: Vec<&Vec<i64>> = rows.iter().filter(|r| r[2] != r[3] || r[2] != r[5] - r[4] + 1).collect();
    if broken.is_empty() {
        println!("chaos: receipts: {} (attempt, rank) streams, each seq once, none missing", rows.len());
    } else {
        println!("chaos: receipts: BROKEN streams (attempt, rank, count, distinct, min, max): {broken:?}");
    }
    Ok(())
}
