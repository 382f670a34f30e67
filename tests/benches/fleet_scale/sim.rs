//! Simulated agents: one tokio task per host, speaking the real agent protocol (trainyard.v1
//! Agents.Connect) over its own gRPC connection, with simulated ranks instead of processes.
//!
//! An agent says hello with an 8-GPU NVSwitch inventory, heartbeats every 2 s, and follows a
//! follower's redirect to the leader. A launch starts its ranks at once: they report `running`
//! (rank 0's host picks the MASTER_PORT), write a `launch` receipt, then `step` receipts at the
//! fleet's current rate per rank, and after the job's `TRAINYARD_SIM_SECONDS` an `exit` receipt
//! and exit code 0. Receipts are kept until acknowledged and resent on the next stream, as the
//! real agent does from its rank files; past [`WINDOW`] unacknowledged receipts a rank waits.
//! As the real agent, a stream carries at most [`MAX_UNACKED_BATCHES`] receipt batches awaiting
//! their acks (the rest wait in the ranks' windows, so a heartbeat or a rank report never queues
//! behind minutes of receipts), and a rank's exit is reported once all its receipts were sent.
//! With `TRAINYARD_SIM_FLOOD=1` a rank writes as fast as its window allows (the quiet ingest
//! measurement).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;
use trainyard_proto::v1::agents_client::AgentsClient;
use trainyard_proto::v1::{
    AgentMessage, Gpu, Heartbeat, Hello, HostInventory, Launch, NumaNode, RankKey, RankReport, RankUpdate,
    Receipt, ReceiptBatch, agent_message, controller_message,
};

/// Unacknowledged receipts a rank keeps before it stops writing.
const WINDOW: usize = 20_000;
/// Receipts per batch at most (the controller takes up to 20,000).
const BATCH: usize = 2_000;
/// Receipt batches sent and not yet acknowledged, at most (the agent's `max_unacked_batches`).
const MAX_UNACKED_BATCHES: usize = 8;
const HEARTBEAT: Duration = Duration::from_secs(2);
const TICK: Duration = Duration::from_millis(200);

/// What the whole simulated fleet shares: where the controllers are, how fast ranks write, and
/// what happened.
pub struct Fleet {
    pub urls: Vec<String>,
    /// Receipts a second per running rank, as f64 bits.
    rate_bits: AtomicU64,
    pub connected: AtomicU64,
    pub connects: AtomicU64,
    pub redirects: AtomicU64,
    pub running_ranks: AtomicU64,
    pub receipts_written: AtomicU64,
    pub receipts_acked: AtomicU64,
    pub stream_errors: AtomicU64,
    pub launches: AtomicU64,
}

impl Fleet {
    pub fn new(urls: Vec<String>, rate_per_rank: f64) -> Arc<Fleet> {
        Arc::new(Fleet {
            urls,
            rate_bits: AtomicU64::new(rate_per_rank.to_bits()),
            connected: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            redirects: AtomicU64::new(0),
            running_ranks: AtomicU64::new(0),
            receipts_written: AtomicU64::new(0),
            receipts_acked: AtomicU64::new(0),
            stream_errors: AtomicU64::new(0),
            launches: AtomicU64::new(0),
        })
    }

    pub fn rate(&self) -> f64 {
        f64::from_bits(self.rate_bits.load(Ordering::Relaxed))
    }

    pub fn set_rate(&self, per_rank: f64) {
        self.rate_bits.store(per_rank.to_bits(), Ordering::Relaxed);
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// One simulated rank.
struct Rank {
    key: RankKey,
    next_seq: u64,
    /// The first sequence number not yet sent on the current stream.
    next_to_send: u64,
    unacked: VecDeque<Receipt>,
    ends_at: Instant,
    flood: bool,
    /// Receipts owed at the current rate (fractional carry).
    owed: f64,
    step: i64,
    exited: bool,
    /// Its exit was reported (after its last receipt was sent).
    exit_reported: bool,
    master_port: u32,
}

impl Rank {
    fn write(&mut self, kind: &str, body: String, fleet: &Fleet) {
        let step = if kind == "step" { self.step } else { -1 };
        let r = Receipt { key: Some(self.key), seq: self.next_seq, kind: kind.into(), step, body };
        self.next_seq += 1;
        self.unacked.push_back(r);
        fleet.receipts_written.fetch_add(1, Ordering::Relaxed);
    }

    fn report(&self) -> RankReport {
        // Exited once reported: a hello says `running` while its last receipts wait to be sent.
        let (state, exit_code) = if self.exit_reported { ("exited", 0) } else { ("running", 0) };
        RankReport {
            key: Some(self.key),
            state: state.into(),
            pid: 1000 + self.key.rank,
            exit_code,
            master_port: self.master_port,
            ..Default::default()
        }
    }
}

/// The hello of host `id`: 8 H100s on one NVSwitch, two NUMA nodes.
fn hello(id: &str, ranks: &BTreeMap<(u64, u32, u32), Rank>) -> Hello {
    let gpus = (0..8)
        .map(|i| Gpu {
            index: i,
            uuid: format!("GPU-{id}-{i}"),
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 81_559,
            pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + i * 0x10),
            numa_node: (i / 4) as i32,
        })
        .collect();
    let links = (0..64).map(|c| if c / 8 == c % 8 { "X".to_string() } else { "NV18".to_string() }).collect();
    Hello {
        protocol_version: trainyard_proto::PROTOCOL_VERSION,
        agent_id: id.into(),
        address: "127.0.0.1".into(),
        inventory: Some(HostInventory {
            hostname: id.into(),
            gpus,
            numa_nodes: vec![
                NumaNode { id: 0, cpus: "0-55".into() },
                NumaNode { id: 1, cpus: "56-111".into() },
            ],
            links,
            cores: Vec::new(),
        }),
        ranks: ranks.values().map(Rank::report).collect(),
        agent_version: "sim".into(),
        preflight: None,
        join_token: String::new(),
    }
}

/// Runs host `id` until the process ends: connects, serves, reconnects.
pub async fn agent(fleet: Arc<Fleet>, id: String, first_url: usize) {
    let mut ranks: BTreeMap<(u64, u32, u32), Rank> = BTreeMap::new();
    let mut url = fleet.urls[first_url % fleet.urls.len()].clone();
    let mut tries = 0u64;
    loop {
        let next = session(&fleet, &id, &url, &mut ranks).await;
        fleet.stream_errors.fetch_add(1, Ordering::Relaxed);
        tries += 1;
        url = match next {
            Some(leader) => {
                fleet.redirects.fetch_add(1, Ordering::Relaxed);
                leader
            }
            None => fleet.urls[(first_url + tries as usize) % fleet.urls.len()].clone(),
        };
        // Jittered, so 1,000 hosts do not dial in one instant.
        let jitter = (id.bytes().map(u64::from).sum::<u64>() * 37 + tries * 101) % 1000;
        tokio::time::sleep(Duration::from_millis(300 + jitter)).await;
    }
}

/// One stream; returns the leader's URL when the controller named another one.
async fn session(
    fleet: &Fleet,
    id: &str,
    url: &str,
    ranks: &mut BTreeMap<(u64, u32, u32), Rank>,
) -> Option<String> {
    let endpoint = Endpoint::from_shared(url.to_string())
        .ok()?
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(2))
        .keep_alive_timeout(Duration::from_secs(3));
    let channel = endpoint.connect().await.ok()?;
    let mut client = AgentsClient::new(channel)
        .max_decoding_message_size(trainyard_proto::limits::MAX_AGENT_MESSAGE_BYTES)
        .max_encoding_message_size(trainyard_proto::limits::MAX_AGENT_MESSAGE_BYTES);
    let (tx, rx) = mpsc::channel::<AgentMessage>(64);
    let first = AgentMessage { msg: Some(agent_message::Msg::Hello(hello(id, ranks))) };
    tx.send(first).await.ok()?;
    let mut inbound = match client.connect(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            let leader = status.metadata().get(trainyard_proto::contract::LEADER_METADATA)?;
            let leader = leader.to_str().ok()?;
            return Some(trainyard_proto::contract::leader_url(url, leader));
        }
    };
    fleet.connects.fetch_add(1, Ordering::Relaxed);
    fleet.connected.fetch_add(1, Ordering::Relaxed);
    serve(fleet, &tx, &mut inbound, ranks).await;
    fleet.connected.fetch_sub(1, Ordering::Relaxed);
    None
}

/// Serves an open stream until it ends.
async fn serve(
    fleet: &Fleet,
    tx: &mpsc::Sender<AgentMessage>,
    inbound: &mut tonic::Streaming<trainyard_proto::v1::ControllerMessage>,
    ranks: &mut BTreeMap<(u64, u32, u32), Rank>,
) {
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    let mut tick = tokio::time::interval(TICK);
    let mut last = Instant::now();
    // Everything unacknowledged goes again on a new stream (after the hello's acks trim it).
    let mut resend = true;
    let mut in_flight = 0;
    loop {
        tokio::select! {
            _ = heartbeat.tick() => {
                let hb = AgentMessage { msg: Some(agent_message::Msg::Heartbeat(Heartbeat { at_ms: now_ms() })) };
                if tx.send(hb).await.is_err() { return; }
            }
            _ = tick.tick() => {
                let dt = last.elapsed().as_secs_f64();
                last = Instant::now();
                let resend = std::mem::take(&mut resend);
                if !advance(fleet, tx, ranks, dt, resend, &mut in_flight).await { return; }
            }
            msg = inbound.message() => {
                let Ok(Some(msg)) = msg else { return };
                let Some(msg) = msg.msg else { continue };
                if !handle(fleet, tx, ranks, msg, &mut in_flight).await { return; }
            }
        }
    }
}

/// Writes what each running rank owes since the last tick, sends new (or, after a reconnect,
/// all unacknowledged) receipts while fewer than [`MAX_UNACKED_BATCHES`] batches await their
/// acks, and reports the exit of ranks whose receipts were all sent.
async fn advance(
    fleet: &Fleet,
    tx: &mpsc::Sender<AgentMessage>,
    ranks: &mut BTreeMap<(u64, u32, u32), Rank>,
    dt: f64,
    resend: bool,
    in_flight: &mut usize,
) -> bool {
    let rate = fleet.rate();
    let mut room = MAX_UNACKED_BATCHES.saturating_sub(*in_flight) * BATCH;
    let mut batch = Vec::new();
    let mut updates = Vec::new();
    for rank in ranks.values_mut() {
        if resend {
            rank.next_to_send = 0;
        }
        if !rank.exited {
            write_due(fleet, rank, rate, dt);
        }
        // Ordered by seq: start where the unsent ones do (not a scan of the whole window).
        let from = rank.unacked.partition_point(|r| r.seq < rank.next_to_send);
        let to = rank.unacked.len().min(from + room);
        batch.extend(rank.unacked.range(from..to).cloned());
        room -= to - from;
        rank.next_to_send = rank.unacked.get(to).map_or(rank.next_seq, |r| r.seq);
        // The exit is reported after its receipts are sent, as a real rank's file is read first.
        if rank.exited && !rank.exit_reported && rank.next_to_send == rank.next_seq {
            rank.exit_reported = true;
            updates.push(rank.report());
        }
    }
    for chunk in batch.chunks(BATCH) {
        let msg = AgentMessage {
            msg: Some(agent_message::Msg::Receipts(ReceiptBatch { receipts: chunk.to_vec() })),
        };
        if tx.send(msg).await.is_err() {
            return false;
        }
        *in_flight += 1;
    }
    for report in updates {
        let msg =
            AgentMessage { msg: Some(agent_message::Msg::RankUpdate(RankUpdate { report: Some(report) })) };
        if tx.send(msg).await.is_err() {
            return false;
        }
    }
    true
}

/// Writes the receipts a running rank owes after `dt` seconds at `rate`, and its exit receipt
/// when its time is up.
fn write_due(fleet: &Fleet, rank: &mut Rank, rate: f64, dt: f64) {
    let room = WINDOW.saturating_sub(rank.unacked.len());
    let due = if rank.flood { room } else { (rank.owed + rate * dt).floor() as usize };
    rank.owed = if rank.flood { 0.0 } else { rank.owed + rate * dt - due as f64 };
    for _ in 0..due.min(room) {
        rank.step += 1;
        let body = format!(
            r#"{{"kind":"step","schema":1,"step":{},"step_time_ms":105.5,"tokens_per_s":310000.0,"mfu":0.31,"loss":3.25,"t_ms":{}}}"#,
            rank.step,
            now_ms()
        );
        rank.write("step", body, fleet);
    }
    if Instant::now() >= rank.ends_at {
        let body =
            format!(r#"{{"kind":"exit","schema":1,"status":"ok","step":{},"t_ms":{}}}"#, rank.step, now_ms());
        rank.write("exit", body, fleet);
        rank.exited = true;
        fleet.running_ranks.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Handles one controller message; false when the stream is done.
async fn handle(
    fleet: &Fleet,
    tx: &mpsc::Sender<AgentMessage>,
    ranks: &mut BTreeMap<(u64, u32, u32), Rank>,
    msg: controller_message::Msg,
    in_flight: &mut usize,
) -> bool {
    use controller_message::Msg;
    match msg {
        Msg::HelloAck(ack) => trim(fleet, ranks, &ack.acks),
        Msg::Ack(ack) => {
            // One ack answers one batch.
            *in_flight = in_flight.saturating_sub(1);
            trim(fleet, ranks, &ack.acks);
        }
        Msg::Launch(launch) => {
            for report in start(fleet, ranks, &launch) {
                let msg = AgentMessage {
                    msg: Some(agent_message::Msg::RankUpdate(RankUpdate { report: Some(report) })),
                };
                if tx.send(msg).await.is_err() {
                    return false;
                }
            }
        }
        Msg::Cancel(cancel) => {
            for rank in ranks
                .values_mut()
                .filter(|r| r.key.job_id == cancel.job_id && r.key.attempt == cancel.attempt)
            {
                if !rank.exited {
                    rank.ends_at = Instant::now();
                }
            }
        }
        Msg::Forget(forget) => {
            ranks.retain(|_, r| {
                !(r.key.job_id == forget.job_id && r.key.attempt == forget.attempt && r.exited)
            });
        }
        _ => {}
    }
    true
}

/// Drops acknowledged receipts (a hello's acks cover ranks the controller knows).
fn trim(fleet: &Fleet, ranks: &mut BTreeMap<(u64, u32, u32), Rank>, acks: &[trainyard_proto::v1::RankAck]) {
    for ack in acks {
        let Some(k) = ack.key else { continue };
        let Some(rank) = ranks.get_mut(&(k.job_id, k.attempt, k.rank)) else { continue };
        let before = rank.unacked.len();
        while rank.unacked.front().is_some_and(|r| r.seq <= ack.seq) {
            rank.unacked.pop_front();
        }
        fleet.receipts_acked.fetch_add((before - rank.unacked.len()) as u64, Ordering::Relaxed);
    }
}

/// Starts a launch's ranks; their `running` reports.
fn start(fleet: &Fleet, ranks: &mut BTreeMap<(u64, u32, u32), Rank>, launch: &Launch) -> Vec<RankReport> {
    fleet.launches.fetch_add(1, Ordering::Relaxed);
    let env = launch.spec.as_ref().map(|s| s.env.clone()).unwrap_or_default();
    let seconds: f64 = env.get("TRAINYARD_SIM_SECONDS").and_then(|s| s.parse().ok()).unwrap_or(30.0);
    let flood = env.get("TRAINYARD_SIM_FLOOD").is_some_and(|v| v == "1");
    let master_port = if launch.master_port == 0 { 29_500 } else { launch.master_port };
    let mut reports = Vec::new();
    for a in &launch.ranks {
        let key = RankKey { job_id: launch.job_id, attempt: launch.attempt, rank: a.rank };
        let id = (key.job_id, key.attempt, key.rank);
        if ranks.contains_key(&id) {
            continue;
        }
        let mut rank = Rank {
            key,
            next_seq: 0,
            next_to_send: 0,
            unacked: VecDeque::new(),
            ends_at: Instant::now() + Duration::from_secs_f64(seconds),
            flood,
            owed: 0.0,
            step: 0,
            exited: false,
            exit_reported: false,
            master_port,
        };
        rank.write("launch", format!(r#"{{"kind":"launch","schema":1,"t_ms":{}}}"#, now_ms()), fleet);
        fleet.running_ranks.fetch_add(1, Ordering::Relaxed);
        reports.push(rank.report());
        ranks.insert(id, rank);
    }
    reports
}
