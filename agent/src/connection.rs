//! One stream to the controller, from `Hello` to its end.
//!
//! The session owns nothing durable: it borrows the [`Launcher`] (ranks, tailers) and keeps only
//! what this stream was told (the last report sent per rank, batches awaiting their ack). A new
//! stream therefore starts by rewinding every tailer to its acknowledged position.
//!
//! Ordering rule: a rank's final report (exited or lost) goes out only after its receipts file
//! was read to the end after the rank ended and every line was sent, so the controller has the
//! receipts before it sees the exit. For the same reason `Hello` reports an ended rank whose
//! receipts are not all acknowledged as `running`; its real end follows its receipts.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::pin::Pin;
use std::time::Duration;
use trainyard_proto::contract::LEADER_METADATA;

use anyhow::anyhow;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};
use tracing::{debug, info, warn};
use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::agent_message::Msg as Out;
use trainyard_proto::v1::agents_client::AgentsClient;
use trainyard_proto::v1::controller_message::Msg as In;
use trainyard_proto::v1::{
    AgentMessage, ControllerMessage, Heartbeat, Hello, HostInventory, Launch, Leaving, PreflightReport,
    RankAck, RankReport, RankUpdate, ReceiptBatch,
};

use crate::config::AgentConfig;
use crate::launcher::Launcher;
use crate::layout::RankId;
use crate::preflight::runner::{Runner, write_report};
use crate::preflight::{self, failure_reason};
use crate::tail::Budget;
use crate::telemetry::{GpuUse, Telemetry};
use trainyard_proto::words::{RankState, ReceiptKind};

/// How long the agent waits for `HelloAck`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// How a session ended.
#[derive(Debug)]
pub enum Ended {
    /// Shutdown was asked for; `Leaving` was sent.
    Shutdown,
    /// The stream broke or never opened; `established` says whether `HelloAck` had arrived.
    Disconnected { error: anyhow::Error, established: bool },
    /// The controller refused us (protocol mismatch).
    Refused(String),
    /// The controller follows another in its group and named the leader's address (host:port):
    /// dial it next.
    NotLeader { leader: String },
    /// The job this agent joined for ended (an agent inside a Slurm allocation): it stops.
    Dismissed(String),
}

/// Who this agent is, as `Hello` says it.
#[derive(Debug, Clone)]
pub struct Identity {
    pub agent_id: String,
    pub address: String,
    pub inventory: HostInventory,
    /// Runs preflights and holds the latest report, which `Hello` carries.
    pub preflight: Runner,
    /// This host's preemption notice, once one came (`crate::notice`).
    pub notices: tokio::sync::watch::Receiver<Option<trainyard_proto::v1::Notice>>,
}

/// Runs one session over `client` until the stream ends or `shutdown` completes.
pub async fn serve<F: Future>(
    config: &AgentConfig,
    identity: &Identity,
    launcher: &mut Launcher,
    telemetry: &Telemetry,
    mut client: AgentsClient<Channel>,
    mut shutdown: Pin<&mut F>,
) -> Ended {
    let (tx, rx) = mpsc::channel(32);
    let (checked_tx, checked) = mpsc::channel(8);
    let mut session = Session {
        config,
        launcher,
        telemetry,
        telemetry_resend: true,
        tx,
        reported: HashMap::new(),
        drained: HashSet::new(),
        unacked_batches: 0,
        filled_by: None,
        metrics_at: std::time::Instant::now(),
        preflight: identity.preflight.clone(),
        checked_tx,
        checked,
        logs: HashMap::new(),
        dismissed: None,
    };
    let hello = session.hello(identity);
    if session.send(Out::Hello(hello)).await.is_err() {
        return disconnected(anyhow!("request stream closed before hello"), false);
    }
    let mut inbound = match client.connect(ReceiverStream::new(rx)).await {
        Ok(response) => response.into_inner(),
        Err(status) => return from_status(status, false),
    };
    let ack = tokio::select! {
        biased;
        _ = &mut shutdown => return session.leave(inbound).await,
        ack = tokio::time::timeout(HELLO_TIMEOUT, inbound.message()) => ack,
    };
    match ack {
        Ok(Ok(Some(ControllerMessage { msg: Some(In::HelloAck(ack)) }))) => {
            if ack.protocol_version != PROTOCOL_VERSION {
                return Ended::Refused(format!(
                    "controller speaks protocol {}, this agent speaks {PROTOCOL_VERSION}",
                    ack.protocol_version
                ));
            }
            info!(agent_id = %identity.agent_id, ranks = session.reported.len(), "connected to controller");
            crate::metrics::metrics().connected.set(1);
            crate::metrics::metrics().connects.inc();
            session.apply_acks(&ack.acks);
        }
        Ok(Ok(Some(other))) => return disconnected(anyhow!("expected HelloAck, got {other:?}"), false),
        Ok(Ok(None)) => return disconnected(anyhow!("controller closed the stream before HelloAck"), false),
        Ok(Err(status)) => return from_status(status, false),
        Err(_) => return disconnected(anyhow!("no HelloAck within {HELLO_TIMEOUT:?}"), false),
    }
    let notices = identity.notices.clone();
    let ended = session.run(inbound, notices, shutdown).await;
    crate::metrics::metrics().connected.set(0);
    ended
}

/// How often the connection loop refreshes the metrics gauges.
const METRICS_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

fn disconnected(error: anyhow::Error, established: bool) -> Ended {
    Ended::Disconnected { error, established }
}

fn from_status(status: Status, established: bool) -> Ended {
    if status.code() == Code::Unavailable
        && let Some(leader) = status.metadata().get(LEADER_METADATA).and_then(|v| v.to_str().ok())
    {
        return Ended::NotLeader { leader: leader.to_string() };
    }
    if matches!(status.code(), Code::FailedPrecondition | Code::PermissionDenied | Code::Unauthenticated) {
        Ended::Refused(status.message().to_string())
    } else {
        disconnected(anyhow!("stream failed: {status}"), established)
    }
}

struct Session<'a> {
    config: &'a AgentConfig,
    launcher: &'a mut Launcher,
    telemetry: &'a Telemetry,
    /// The telemetry batch on the wire (from an earlier stream) goes again before a new one.
    telemetry_resend: bool,
    tx: mpsc::Sender<AgentMessage>,
    /// The last report this stream carried per rank.
    reported: HashMap<RankId, RankReport>,
    /// Ended ranks whose receipts file was read to its end, after the end, on this stream.
    drained: HashSet<RankId>,
    unacked_batches: usize,
    /// The rank whose lines filled the last full batch: the next batch reads from the rank
    /// after it, so under a backlog the ranks take turns (read from the first rank every time,
    /// the last rank of a node fell tens of seconds behind in a 48,000 receipts/s soak).
    filled_by: Option<RankId>,
    /// When the metrics gauges were last refreshed.
    metrics_at: std::time::Instant,
    preflight: Runner,
    /// Launches whose preflight finished, from the tasks that ran it.
    checked_tx: mpsc::Sender<(Launch, PreflightReport)>,
    checked: mpsc::Receiver<(Launch, PreflightReport)>,
    /// `ctl logs` readers by request id: the token a reader cancels when it is done (or the
    /// controller stops it), and the credit of pieces it may still send.
    logs: HashMap<u64, (tokio_util::sync::CancellationToken, std::sync::Arc<tokio::sync::Semaphore>)>,
    /// Set when the controller dismissed this agent (its job ended, or its allocation's time
    /// limit is near): the session ends.
    dismissed: Option<trainyard_proto::v1::Dismiss>,
}

/// The stream is gone; the session ends.
struct Closed;

impl Session<'_> {
    async fn send(&self, msg: Out) -> Result<(), Closed> {
        self.tx.send(AgentMessage { msg: Some(msg) }).await.map_err(|_| Closed)
    }

    fn hello(&mut self, identity: &Identity) -> Hello {
        self.launcher.poll_exits();
        let mut ranks = Vec::new();
        for rank in self.launcher.ranks_mut() {
            rank.tailer.rewind();
            if rank.record.forget {
                continue;
            }
            let mut report = rank.record.report(rank.tailer.acked().skipped);
            if rank.record.phase.is_done() && !rank.tailer.fully_acked() {
                report.state = RankState::Running.as_str().to_string();
            }
            self.reported.insert(rank.record.id, report.clone());
            ranks.push(report);
        }
        Hello {
            protocol_version: PROTOCOL_VERSION,
            agent_id: identity.agent_id.clone(),
            address: identity.address.clone(),
            inventory: Some(identity.inventory.clone()),
            ranks,
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            preflight: self.preflight.latest(),
            join_token: self.config.slurm.as_ref().map(|s| s.join_token.clone()).unwrap_or_default(),
        }
    }

    async fn run<F: Future>(
        mut self,
        mut inbound: Streaming<ControllerMessage>,
        mut notices: tokio::sync::watch::Receiver<Option<trainyard_proto::v1::Notice>>,
        mut shutdown: Pin<&mut F>,
    ) -> Ended {
        // A notice that came before this stream (or before a reconnect) goes first.
        notices.mark_changed();
        let mut tick = tokio::time::interval(self.config.tick);
        let mut heartbeat = tokio::time::interval(self.config.heartbeat);
        let mut starting = tokio::time::interval(crate::launcher::STARTING_TICK);
        starting.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let step = tokio::select! {
                biased;
                _ = &mut shutdown => return self.leave(inbound).await,
                message = inbound.message() => match message {
                    Ok(Some(message)) => self.on_message(message).await,
                    Ok(None) => return disconnected(anyhow!("controller closed the stream"), true),
                    Err(status) => return from_status(status, true),
                },
                Some((launch, report)) = self.checked.recv() => self.launch_checked(launch, report).await,
                _ = tick.tick() => self.on_tick().await,
                _ = starting.tick(), if self.launcher.starting() => self.on_starting().await,
                _ = heartbeat.tick() => self.send(Out::Heartbeat(Heartbeat { at_ms: now_ms() })).await,
                Ok(()) = notices.changed() => {
                    let notice = notices.borrow_and_update().clone();
                    match notice {
                        Some(notice) => self.send(Out::Notice(notice)).await,
                        None => Ok(()),
                    }
                }
            };
            if step.is_err() {
                return disconnected(anyhow!("request stream closed"), true);
            }
            if let Some(dismiss) = self.dismissed.take() {
                info!(reason = %dismiss.reason, requeue = dismiss.requeue, "dismissed by the controller");
                self.stop_ranks(&dismiss.reason).await;
                if let (true, Some(slurm)) = (dismiss.requeue, &self.config.slurm) {
                    crate::slurm::requeue(&slurm.slurm_job_id).await;
                }
                return Ended::Dismissed(dismiss.reason);
            }
        }
    }

    /// Sends `Leaving`, ends the request stream, and waits briefly for the controller to close
    /// its side, so `Leaving` is delivered rather than cut off by a reset.
    async fn leave(mut self, mut inbound: Streaming<ControllerMessage>) -> Ended {
        info!("leaving: announcing shutdown to the controller");
        let mut leaving = Leaving { reason: "agent shutting down".into(), slurm_state: String::new() };
        if let Some(slurm) = self.config.slurm.clone() {
            // Inside an allocation a stop is Slurm ending it: say how (a scancel is the user's
            // cancel), and leave nothing running behind.
            leaving.slurm_state = crate::slurm::ending_state(&slurm.slurm_job_id, false, slurm.restart).await;
            leaving.reason =
                format!("Slurm is ending allocation {} ({})", slurm.slurm_job_id, leaving.slurm_state);
            let _ = self.send(Out::Leaving(leaving.clone())).await;
            self.stop_ranks(&leaving.reason).await;
            self.launcher.poll_exits();
            let _ = self.send_rank_updates().await;
        } else {
            let _ = self.send(Out::Leaving(leaving)).await;
        }
        drop(self.tx);
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            while let Ok(Some(_)) = inbound.message().await {}
        })
        .await;
        Ended::Shutdown
    }

    /// Stops every live rank (SIGTERM, SIGKILL after 5 s) and waits for them: an agent inside a
    /// Slurm allocation leaves nothing running when its allocation or job ends.
    async fn stop_ranks(&mut self, reason: &str) {
        let attempts: BTreeSet<(u64, u32)> = self
            .launcher
            .ranks_mut()
            .filter(|r| !r.record.phase.is_done())
            .map(|r| (r.record.id.job_id, r.record.id.attempt))
            .collect();
        let mut stops = Vec::new();
        for (job, attempt) in attempts {
            stops.extend(self.launcher.cancel(job, attempt, Duration::from_secs(5), reason));
        }
        for stop in stops {
            let _ = stop.await;
        }
    }

    async fn on_message(&mut self, message: ControllerMessage) -> Result<(), Closed> {
        match message.msg {
            Some(In::Dismiss(dismiss)) => self.dismissed = Some(dismiss),
            Some(In::Ack(ack)) => {
                self.unacked_batches = self.unacked_batches.saturating_sub(1);
                self.apply_acks(&ack.acks);
            }
            Some(In::Launch(launch)) => {
                info!(job_id = launch.job_id, attempt = launch.attempt, ranks = launch.ranks.len(), "launch");
                self.on_launch(launch).await?;
            }
            Some(In::Cancel(cancel)) => {
                let grace = Duration::from_millis(cancel.grace_ms);
                self.launcher.cancel(cancel.job_id, cancel.attempt, grace, &cancel.reason);
            }
            Some(In::CheckpointNow(request)) => {
                let (job, attempt) = (request.job_id, request.attempt);
                let asked = self.launcher.checkpoint_now(job, attempt, &request.signal, &request.reason);
                info!(job_id = request.job_id, attempt = request.attempt, asked, reason = %request.reason, "checkpoint requested");
            }
            Some(In::Forget(forget)) => {
                info!(job_id = forget.job_id, attempt = forget.attempt, "forget ranks once acknowledged");
                self.launcher.forget(forget.job_id, forget.attempt);
            }
            Some(In::RunPreflight(request)) => match preflight::runnable_level(&request.level) {
                Ok(level) => {
                    info!(level = level.as_str(), "preflight requested by the controller");
                    let (runner, tx) = (self.preflight.clone(), self.tx.clone());
                    tokio::spawn(async move {
                        let report = runner.run(level).await;
                        info!(verdict = %report.verdict, local_id = %report.local_id, "preflight finished");
                        let _ = tx.send(AgentMessage { msg: Some(Out::Preflight(report)) }).await;
                    });
                }
                Err(e) => warn!(error = %e, "ignoring run-preflight"),
            },
            Some(In::ReadLogs(request)) => {
                let id = RankId { job_id: request.job_id, attempt: request.attempt, rank: request.rank };
                // The rank's own files while the agent knows it; else where its run name says.
                let files = match self.launcher.get(id) {
                    Some(rank) => rank.record.files.clone(),
                    None => {
                        let run = crate::layout::run_name(id.job_id, &request.run_name)
                            .unwrap_or_else(|_| format!("job-{}", id.job_id));
                        self.launcher.layout().rank_files(&run, id)
                    }
                };
                let files =
                    crate::logs::RankLogs { stdout: files.stdout, stderr: files.stderr, exit: files.exit };
                self.logs.retain(|_, (stop, _)| !stop.is_cancelled());
                let stop = tokio_util::sync::CancellationToken::new();
                let credit = std::sync::Arc::new(tokio::sync::Semaphore::new(
                    trainyard_proto::limits::LOG_CREDIT_PIECES as usize,
                ));
                // A request id sent again replaces its reader: the old one stops, never orphaned.
                if let Some((old, _)) = self.logs.insert(request.request_id, (stop.clone(), credit.clone())) {
                    old.cancel();
                }
                debug!(request_id = request.request_id, job_id = id.job_id, rank = id.rank, "reading logs");
                tokio::spawn(crate::logs::serve(request, files, self.tx.clone(), stop, credit));
            }
            Some(In::StopLogs(stop)) => {
                if let Some((token, _)) = self.logs.remove(&stop.request_id) {
                    token.cancel();
                }
            }
            Some(In::LogCredit(credit)) => {
                if let Some((_, pieces)) = self.logs.get(&credit.request_id) {
                    // Never more than one window outstanding, whatever a controller grants.
                    let room = (trainyard_proto::limits::LOG_CREDIT_PIECES as usize)
                        .saturating_sub(pieces.available_permits());
                    pieces.add_permits((credit.pieces as usize).min(room));
                }
            }
            Some(In::TelemetryAck(ack)) => self.telemetry.ack(ack.id),
            Some(In::HelloAck(_)) => debug!("ignoring a second HelloAck"),
            None => debug!("ignoring an empty controller message"),
        }
        Ok(())
    }

    /// Runs the job's preflight level (in a task, so the stream stays served) before starting
    /// its ranks; a relaunch of known ranks, or level "none", launches at once under the
    /// latest report.
    async fn on_launch(&mut self, launch: Launch) -> Result<(), Closed> {
        let spec = launch.spec.clone().unwrap_or_default();
        let known = launch.ranks.iter().any(|a| {
            self.launcher
                .get(RankId { job_id: launch.job_id, attempt: launch.attempt, rank: a.rank })
                .is_some()
        });
        let level = match preflight::level_for_job(&spec.preflight) {
            Ok(Some(level)) if !known => level,
            Ok(_) => {
                self.launcher.set_preflight_report(self.preflight.latest().map(|r| r.local_id));
                return self.start_ranks(&launch, None).await;
            }
            Err(e) => return self.start_ranks(&launch, Some(format!("preflight failed: {e}"))).await,
        };
        let (runner, done) = (self.preflight.clone(), self.checked_tx.clone());
        let job_env: BTreeMap<String, String> = spec.env.into_iter().collect();
        let gpus: Vec<u32> = launch.ranks.iter().map(|a| a.gpu_index).collect();
        tokio::spawn(async move {
            let report = runner.run_for_job(level, job_env, launch.job_id, gpus).await;
            let _ = done.send((launch, report)).await;
        });
        Ok(())
    }

    /// A launch whose preflight finished: record the report, then start or refuse the ranks.
    async fn launch_checked(&mut self, launch: Launch, report: PreflightReport) -> Result<(), Closed> {
        info!(job_id = launch.job_id, verdict = %report.verdict, local_id = %report.local_id, "launch preflight finished");
        let refusal = failure_reason(&report);
        self.launcher.set_preflight_report(Some(report.local_id.clone()));
        self.send(Out::Preflight(report.clone())).await?;
        self.start_ranks(&launch, refusal).await?;
        // Beside launch.json, in the run directory the launch made (never one of its own).
        if let Ok(run) = crate::layout::run_name(launch.job_id, &launch.run_name) {
            let dir = self.launcher.layout().attempt_dir(&run, launch.attempt);
            let path = dir.join("preflight.json");
            if let Err(e) = dir.is_dir().then(|| write_report(&path, &report)).transpose() {
                warn!(path = %path.display(), error = %e, "failed to write preflight.json");
            }
        }
        Ok(())
    }

    /// Starts the launch's ranks, or records them `lost` with `refusal` without starting them.
    async fn start_ranks(&mut self, launch: &Launch, refusal: Option<String>) -> Result<(), Closed> {
        let ids = match &refusal {
            None => self.launcher.launch(launch),
            Some(reason) => {
                warn!(job_id = launch.job_id, attempt = launch.attempt, %reason, "ranks not started");
                self.launcher.refuse(launch, reason)
            }
        };
        for id in ids {
            // Idempotent relaunch: tell the controller where the rank is again.
            self.reported.remove(&id);
        }
        // Ranks whose shims have already started them are reported `running`, not first
        // `launching` and a tick later `running`: each report is a transaction on the controller.
        self.launcher.poll_exits();
        self.send_rank_updates().await
    }

    fn apply_acks(&mut self, acks: &[RankAck]) {
        for ack in acks {
            let Some(key) = &ack.key else { continue };
            if let Some(rank) = self.launcher.get_mut(RankId::from(key)) {
                rank.tailer.ack(ack.seq);
            }
        }
    }

    /// Between ticks, while ranks are starting: each is reported `running` as soon as its
    /// shim has exec'd it.
    async fn on_starting(&mut self) -> Result<(), Closed> {
        if self.launcher.poll_exits().is_empty() {
            return Ok(());
        }
        self.send_rank_updates().await
    }

    async fn on_tick(&mut self) -> Result<(), Closed> {
        self.launcher.poll_exits();
        self.send_receipts().await?;
        self.send_rank_updates().await?;
        self.send_telemetry().await?;
        self.launcher.persist_acks();
        if self.metrics_at.elapsed() >= METRICS_EVERY {
            self.metrics_at = std::time::Instant::now();
            crate::metrics::metrics().observe(self.launcher, self.unacked_batches);
            crate::metrics::metrics().telemetry_pending.set(self.telemetry.pending() as i64);
        }
        for id in self.launcher.drop_forgotten() {
            self.reported.remove(&id);
            self.drained.remove(&id);
        }
        Ok(())
    }

    /// Reads new receipt lines into batches while the unacknowledged window has room.
    async fn send_receipts(&mut self) -> Result<(), Closed> {
        while self.unacked_batches < self.config.max_unacked_batches {
            let most = self.config.max_batch_receipts.min(trainyard_proto::limits::MAX_RECEIPT_BATCH);
            let mut budget = Budget::new(most, self.config.max_batch_bytes);
            let mut receipts = Vec::new();
            let layout = self.launcher.layout().clone();
            let ids: Vec<RankId> = self.launcher.ranks().map(|r| r.record.id).collect();
            let mut filled = None;
            for id in crate::tail::reading_order(&ids, self.filled_by) {
                let Some(rank) = self.launcher.get_mut(id) else { continue };
                let ended = rank.record.phase.is_done();
                match rank.read(&mut receipts, &mut budget, &layout) {
                    Ok(true) if ended => {
                        self.drained.insert(id);
                    }
                    Ok(_) => {}
                    Err(e) => warn!(rank_id = %id, path = %rank.tailer.path().display(), error = %e,
                        "failed to read receipts"),
                }
                if budget.exhausted() && filled.is_none() {
                    filled = Some(id);
                }
            }
            self.filled_by = filled.or(self.filled_by);
            if receipts.is_empty() {
                return Ok(());
            }
            // Which step each rank reached, for the telemetry windows: one lock per batch.
            let steps = receipts
                .iter()
                .filter(|r| r.step >= 0 && r.kind == ReceiptKind::Step.as_str())
                .filter_map(|r| r.key.as_ref().map(|k| (RankId::from(k), r.step)));
            self.telemetry.note_steps(steps, crate::telemetry::now_ms());
            let bytes: usize = receipts.iter().map(|r| r.body.len()).sum();
            crate::logs::receipts_sent(bytes);
            let m = crate::metrics::metrics();
            m.receipts_relayed.inc_by(receipts.len() as u64);
            m.receipt_bytes_relayed.inc_by(bytes as u64);
            self.send(Out::Receipts(ReceiptBatch { receipts })).await?;
            self.unacked_batches += 1;
            if !budget.exhausted() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Tells the sampler which GPUs run ranks, and sends the next telemetry batch when none is
    /// awaiting its ack (telemetry never crowds out receipts: one batch of it at a time, sent
    /// after the tick's receipts).
    async fn send_telemetry(&mut self) -> Result<(), Closed> {
        let gpus = self
            .launcher
            .ranks()
            .filter(|r| r.record.phase == RankState::Running)
            .map(|r| GpuUse { rank: r.record.id, gpu: r.record.gpu_index })
            .collect();
        self.telemetry.set_gpus(gpus);
        let resend = std::mem::take(&mut self.telemetry_resend);
        match self.telemetry.next_batch(resend) {
            Some(batch) => self.send(Out::Telemetry(batch)).await,
            None => Ok(()),
        }
    }

    /// Sends a `RankUpdate` for every rank whose report changed since this stream last carried
    /// it, holding back final reports until the rank's receipts are all sent.
    async fn send_rank_updates(&mut self) -> Result<(), Closed> {
        let mut updates = Vec::new();
        for rank in self.launcher.ranks() {
            let id = rank.record.id;
            if rank.record.phase.is_done() && !self.drained.contains(&id) {
                continue;
            }
            let report = rank.record.report(rank.tailer.skipped_lines());
            if self.reported.get(&id) != Some(&report) {
                updates.push((id, report));
            }
        }
        for (id, report) in updates {
            debug!(rank_id = %id, state = %report.state, "rank update");
            self.send(Out::RankUpdate(RankUpdate { report: Some(report.clone()) })).await?;
            self.reported.insert(id, report);
        }
        Ok(())
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
