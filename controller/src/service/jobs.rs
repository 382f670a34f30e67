//! `Jobs`: submit, get, list, cancel and watch, the fleet table and preflight reports, for
//! operators.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use trainyard_proto::v1::jobs_server::Jobs;
use trainyard_proto::v1::{
    CancelRequest, CancelResponse, CompareRequest, Comparison, CordonRequest, CordonResponse,
    DiagnoseRequest, Diagnosis, DrainRequest, DrainResponse, GetJobRequest, Job, JobStateChange, LeaderReply,
    LeaderRequest, ListJobsRequest, ListJobsResponse, LiveFindingsRequest, LiveFindingsResponse, LogChunk,
    LogsRequest, NodesRequest, NodesResponse, PreflightReport, PreflightRequest, SlurmSubmittedRequest,
    StoredReceipt, SubmitRequest, SubmitResponse, WatchEvent, WatchRequest, watch_event::Event,
};

use trainyard_proto::limits;

use super::wire::live_finding_message;
use super::{auth_status, to_status};
use crate::auth::{self, Authenticator, Caller};
use crate::core::{Controller, ControllerError, LogEvent, PREFLIGHT_RUN_TIMEOUT};
use trainyard_store::{JobState, RankState};

/// Pieces a logs client reads between two grants of credit to its agent.
const CREDIT_EVERY: u32 = 4;

/// An open `Logs` response stream; dropping it (the client went away) stops the agent's reader.
struct LogReading {
    controller: Arc<Controller>,
    request_id: u64,
}

impl Drop for LogReading {
    fn drop(&mut self) {
        self.controller.jobs().close_logs(self.request_id);
    }
}

/// Receipts read from the store per round trip of a watcher.
const WATCH_PAGE: u32 = 2_000;

/// `Watch` and `Logs` streams one user may hold open at once: each holds a task, a channel and
/// store reads, so one user's script cannot starve the others.
pub const MAX_STREAMS_PER_USER: usize = 16;

pub struct JobsService {
    controller: Arc<Controller>,
    auth: Authenticator,
    shutdown: CancellationToken,
    streams: StreamSlots,
}

/// Open streams per user.
#[derive(Clone, Default)]
struct StreamSlots(Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>);

/// One open stream of a user; the count goes down when the stream (and this) is dropped.
struct StreamSlot {
    slots: StreamSlots,
    user: String,
}

impl StreamSlots {
    fn take(&self, user: &str) -> Result<StreamSlot, Status> {
        let mut open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(user.to_string()).or_default();
        if *count >= MAX_STREAMS_PER_USER {
            return Err(Status::resource_exhausted(format!(
                "user {user} already has {count} watch/logs streams open, the most one user may have \
                 ({MAX_STREAMS_PER_USER}); close some first"
            )));
        }
        *count += 1;
        Ok(StreamSlot { slots: self.clone(), user: user.to_string() })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.slots.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.user) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.user);
            }
        }
    }
}

impl JobsService {
    pub fn new(controller: Arc<Controller>, auth: Authenticator, shutdown: CancellationToken) -> Self {
        JobsService { controller, auth, shutdown, streams: StreamSlots::default() }
    }

    /// The caller of `request`, from its bearer token; a refusal is audited as `action` on
    /// `target`.
    async fn caller<T>(&self, request: &Request<T>, action: &str, target: &str) -> Result<Caller, Status> {
        let header = request.metadata().get("authorization").map(|v| v.to_str().unwrap_or("?"));
        let now = self.controller.now_ms();
        let tokenless = match header {
            None | Some("") => self.auth.tokenless_from(request.remote_addr()),
            Some(_) => Ok(()),
        };
        if let Err(e) = tokenless {
            let why = e.to_string();
            self.auth.audit_refusal(action, target, &why, request.remote_addr(), now).await;
            return Err(auth_status(e));
        }
        match self.auth.user(header, now).await {
            Ok(caller) => Ok(caller),
            Err(e) => {
                let why = e.to_string();
                self.auth.audit_refusal(action, target, &why, request.remote_addr(), now).await;
                Err(auth_status(e))
            }
        }
    }

    /// The caller of a request about job `job_id`, refused unless it is theirs or they are an
    /// admin. An unknown job is `NotFound` for everyone.
    async fn job_caller<T>(&self, request: &Request<T>, action: &str, job_id: u64) -> Result<Caller, Status> {
        let target = format!("job:{job_id}");
        let caller = self.caller(request, action, &target).await?;
        self.check_job(&caller, action, job_id).await?;
        Ok(caller)
    }

    async fn check_job(&self, caller: &Caller, action: &str, job_id: u64) -> Result<(), Status> {
        let job = self.controller.jobs().record(job_id).await.map_err(to_status)?;
        let job = job.ok_or_else(|| to_status(ControllerError::JobNotFound(job_id)))?;
        if caller.may_access(&job.owner) {
            return Ok(());
        }
        let why = format!(
            "job {job_id} belongs to {}; only its owner or an admin may do that",
            owner_name(&job.owner)
        );
        self.refuse(caller, action, &format!("job:{job_id}"), why).await
    }

    async fn refuse<T>(&self, caller: &Caller, action: &str, target: &str, why: String) -> Result<T, Status> {
        let target = &auth::clip(target);
        tracing::warn!(user = %caller.name, action, target, reason = %why, "call refused");
        self.auth.audit(&caller.name, action, target, Err(&why), self.controller.now_ms()).await;
        Err(Status::permission_denied(why))
    }
}

fn owner_name(owner: &trainyard_store::JobOwner) -> &str {
    if owner.user.is_empty() { "no user (stored before users existed)" } else { &owner.user }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;
type LogsStream = Pin<Box<dyn Stream<Item = Result<LogChunk, Status>> + Send>>;

#[tonic::async_trait]
impl Jobs for JobsService {
    async fn submit(&self, request: Request<SubmitRequest>) -> Result<Response<SubmitResponse>, Status> {
        self.controller.role().writable().map_err(to_status)?;
        let caller = self.caller(&request, "job.submit", "job:new").await?;
        let request = request.into_inner();
        let spec = request
            .spec
            .ok_or_else(|| Status::invalid_argument("job spec rejected: the request carries no spec"))?;
        let name = format!("job:new ({})", spec.name);
        let owner = match auth::owner_for_submit(&caller, self.auth.policy(), spec.priority) {
            Ok(owner) => owner,
            Err(e) => return self.refuse(&caller, "job.submit", &name, e.to_string()).await,
        };
        if request.idempotency_key.len() > limits::MAX_SHORT_STRING_BYTES {
            return Err(Status::invalid_argument(format!(
                "the idempotency key is {} bytes long, at most {} allowed",
                request.idempotency_key.len(),
                limits::MAX_SHORT_STRING_BYTES
            )));
        }
        let key = Some(request.idempotency_key).filter(|k| !k.is_empty());
        let now = self.controller.now_ms();
        let slurm = spec.slurm.is_some();
        match self.controller.jobs().submit_as(spec, key.as_deref(), &owner).await {
            Ok(job_id) => {
                // The submitter alone learns it: the agents of the job's allocation join with it.
                let join_token =
                    if slurm { self.controller.jobs().join_token_of(job_id) } else { String::new() };
                let detail = format!(
                    "run as {}",
                    if owner.run_as.is_empty() { "the agent's account" } else { &owner.run_as }
                );
                self.auth.audit(&caller.name, "job.submit", &format!("job:{job_id}"), Ok(&detail), now).await;
                Ok(Response::new(SubmitResponse { job_id, join_token }))
            }
            Err(e) => {
                let status = to_status(e);
                self.auth.audit(&caller.name, "job.submit", &name, Err(status.message()), now).await;
                Err(status)
            }
        }
    }

    async fn get(&self, request: Request<GetJobRequest>) -> Result<Response<Job>, Status> {
        let job_id = request.get_ref().job_id;
        self.job_caller(&request, "job.get", job_id).await?;
        let job = self.controller.jobs().get(job_id).await.map_err(to_status)?;
        Ok(Response::new(job))
    }

    async fn list(&self, request: Request<ListJobsRequest>) -> Result<Response<ListJobsResponse>, Status> {
        let caller = self.caller(&request, "job.list", "jobs").await?;
        let req = request.into_inner();
        // Only admins see every job.
        let only = (!caller.admin).then_some(caller.name.as_str());
        let (jobs, left_off) =
            self.controller.jobs().list(req.active_only, only, req.limit).await.map_err(to_status)?;
        Ok(Response::new(ListJobsResponse { jobs, left_off }))
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        self.controller.role().writable().map_err(to_status)?;
        let mut req = request.get_ref().clone();
        if req.reason.len() > limits::MAX_SHORT_STRING_BYTES {
            req.reason = auth::clip_to(&req.reason, limits::MAX_SHORT_STRING_BYTES);
        }
        let caller = self.job_caller(&request, "job.cancel", req.job_id).await?;
        let target = format!("job:{}", req.job_id);
        let now = self.controller.now_ms();
        if let Err(e) = self.controller.jobs().cancel(req.job_id, &req.reason).await {
            let status = to_status(e);
            self.auth.audit(&caller.name, "job.cancel", &target, Err(status.message()), now).await;
            return Err(status);
        }
        self.auth.audit(&caller.name, "job.cancel", &target, Ok(&req.reason), now).await;
        let job = self.controller.jobs().get(req.job_id).await.map_err(to_status)?;
        Ok(Response::new(CancelResponse { job: Some(job) }))
    }

    async fn slurm_submitted(
        &self,
        request: Request<SlurmSubmittedRequest>,
    ) -> Result<Response<Job>, Status> {
        self.controller.role().writable().map_err(to_status)?;
        let req = request.get_ref().clone();
        let caller = self.job_caller(&request, "job.slurm", req.job_id).await?;
        let target = format!("job:{}", req.job_id);
        let now = self.controller.now_ms();
        let done = self.controller.jobs().slurm_submitted(req.job_id, req.slurm_job_id, &req.detail).await;
        let detail = format!("Slurm job {}", req.slurm_job_id);
        match done {
            Ok(()) => self.auth.audit(&caller.name, "job.slurm", &target, Ok(&detail), now).await,
            Err(e) => {
                let status = to_status(e);
                self.auth.audit(&caller.name, "job.slurm", &target, Err(status.message()), now).await;
                return Err(status);
            }
        }
        let job = self.controller.jobs().get(req.job_id).await.map_err(to_status)?;
        Ok(Response::new(job))
    }

    /// Answers anyone, as gRPC health does: who leads is no secret, and `ctl` asks it before
    /// the call its token is checked (and audited) for.
    async fn leader(&self, _: Request<LeaderRequest>) -> Result<Response<LeaderReply>, Status> {
        Ok(Response::new(self.controller.role().leadership()))
    }

    async fn nodes(&self, request: Request<NodesRequest>) -> Result<Response<NodesResponse>, Status> {
        self.caller(&request, "node.list", "nodes").await?;
        Ok(Response::new(NodesResponse { nodes: self.controller.nodes().list().await }))
    }

    /// Cordons a node or lifts its cordon (admins only; audited).
    async fn cordon(&self, request: Request<CordonRequest>) -> Result<Response<CordonResponse>, Status> {
        self.controller.role().writable().map_err(to_status)?;
        let target = format!("node:{}", request.get_ref().agent_id);
        let action = if request.get_ref().cordon { "node.cordon" } else { "node.uncordon" };
        let caller = self.caller(&request, action, &target).await?;
        if !caller.admin {
            let why = "only admins cordon and uncordon nodes".to_string();
            return self.refuse(&caller, action, &target, why).await;
        }
        let req = request.into_inner();
        if req.cordon && req.reason.trim().is_empty() {
            return Err(Status::invalid_argument(
                "a cordon needs a reason (ctl cordon NODE --reason \"...\")",
            ));
        }
        if req.reason.len() > trainyard_proto::limits::MAX_SHORT_STRING_BYTES {
            return Err(Status::invalid_argument(format!(
                "reason: is {} bytes long, at most {} allowed",
                req.reason.len(),
                trainyard_proto::limits::MAX_SHORT_STRING_BYTES
            )));
        }
        let reason = req.cordon.then_some(req.reason.as_str());
        let done = self.controller.nodes().cordon(&req.agent_id, reason).await;
        let failed = done.as_ref().err().map(|e| e.to_string());
        let outcome = match &failed {
            None => Ok(req.reason.as_str()),
            Some(e) => Err(e.as_str()),
        };
        self.auth.audit(&caller.name, action, &target, outcome, self.controller.now_ms()).await;
        let agent_id = done.map_err(to_status)?;
        let node = self.controller.nodes().list().await.into_iter().find(|n| n.agent_id == agent_id);
        Ok(Response::new(CordonResponse { node }))
    }

    /// Drains a node (admins only; audited): cordon, checkpoint, move.
    async fn drain(&self, request: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        self.controller.role().writable().map_err(to_status)?;
        let target = format!("node:{}", request.get_ref().agent_id);
        let caller = self.caller(&request, "node.drain", &target).await?;
        if !caller.admin {
            let why = "only admins drain nodes".to_string();
            return self.refuse(&caller, "node.drain", &target, why).await;
        }
        let req = request.into_inner();
        if req.reason.len() > trainyard_proto::limits::MAX_SHORT_STRING_BYTES {
            return Err(Status::invalid_argument(format!(
                "reason: is {} bytes long, at most {} allowed",
                req.reason.len(),
                trainyard_proto::limits::MAX_SHORT_STRING_BYTES
            )));
        }
        if req.deadline_s > 86_400 {
            return Err(Status::invalid_argument(format!(
                "deadline: {} s is more than a day; give at most 86400",
                req.deadline_s
            )));
        }
        let deadline = match req.deadline_s {
            0 => crate::core::DEFAULT_DRAIN_DEADLINE,
            s => Duration::from_secs(u64::from(s)),
        };
        let reason = if req.reason.trim().is_empty() { "drained with ctl" } else { req.reason.as_str() };
        let done = self.controller.nodes().drain(&req.agent_id, deadline, reason).await;
        let failed = done.as_ref().err().map(|e| e.to_string());
        let detail = format!("deadline {} s: {reason}", deadline.as_secs());
        let outcome = match &failed {
            None => Ok(detail.as_str()),
            Some(e) => Err(e.as_str()),
        };
        self.auth.audit(&caller.name, "node.drain", &target, outcome, self.controller.now_ms()).await;
        let (agent_id, jobs) = done.map_err(to_status)?;
        let node = self.controller.nodes().list().await.into_iter().find(|n| n.agent_id == agent_id);
        Ok(Response::new(DrainResponse { node, jobs }))
    }

    /// The node's newest report; with a run level, the report of a run asked for now (waits
    /// up to [`PREFLIGHT_RUN_TIMEOUT`] for the agent to answer).
    async fn preflight(
        &self,
        request: Request<PreflightRequest>,
    ) -> Result<Response<PreflightReport>, Status> {
        let target = format!("node:{}", request.get_ref().agent_id);
        let action =
            if request.get_ref().run_level.is_empty() { "node.preflight.read" } else { "node.preflight" };
        if !request.get_ref().run_level.is_empty() {
            self.controller.role().writable().map_err(to_status)?;
        }
        let caller = self.caller(&request, action, &target).await?;
        let req = request.into_inner();
        let report = if req.run_level.is_empty() {
            self.controller.nodes().latest_preflight(&req.agent_id).await
        } else {
            if !caller.admin {
                let why = "only admins run preflight checks on nodes".to_string();
                return self.refuse(&caller, action, &target, why).await;
            }
            let level = format!("level {}", req.run_level);
            self.auth.audit(&caller.name, action, &target, Ok(&level), self.controller.now_ms()).await;
            // A shutdown does not wait for the agent: the operator asks again after the restart.
            tokio::select! {
                report = self.controller.nodes().run_preflight(&req.agent_id, &req.run_level, PREFLIGHT_RUN_TIMEOUT) => report,
                _ = self.shutdown.cancelled() => {
                    return Err(Status::unavailable("the controller is shutting down; ask again once it is back"));
                }
            }
        };
        Ok(Response::new(report.map_err(to_status)?.into()))
    }

    async fn diagnose(&self, request: Request<DiagnoseRequest>) -> Result<Response<Diagnosis>, Status> {
        self.job_caller(&request, "job.diagnose", request.get_ref().job_id).await?;
        let req = request.into_inner();
        let d = self.controller.diagnoses().diagnose(req.job_id, req.attempt).await.map_err(to_status)?;
        Ok(Response::new(d.message(req.job_id)))
    }

    async fn compare(&self, request: Request<CompareRequest>) -> Result<Response<Comparison>, Status> {
        let caller = self.job_caller(&request, "job.compare", request.get_ref().a).await?;
        self.check_job(&caller, "job.compare", request.get_ref().b).await?;
        let req = request.into_inner();
        let c = self.controller.diagnoses().compare(req.a, req.b).await.map_err(to_status)?;
        Ok(Response::new(trainyard_proto::v1::Comparison::from(&c)))
    }

    async fn live_findings(
        &self,
        request: Request<LiveFindingsRequest>,
    ) -> Result<Response<LiveFindingsResponse>, Status> {
        self.job_caller(&request, "job.diagnose", request.get_ref().job_id).await?;
        let found =
            self.controller.diagnoses().live_findings(request.get_ref().job_id).await.map_err(to_status)?;
        Ok(Response::new(LiveFindingsResponse { findings: found.iter().map(live_finding_message).collect() }))
    }

    type WatchStream = WatchStream;
    type LogsStream = LogsStream;

    async fn logs(&self, request: Request<LogsRequest>) -> Result<Response<LogsStream>, Status> {
        // Logs come over the agent's stream, which only the leader holds.
        self.controller.role().writable().map_err(to_status)?;
        let caller = self.job_caller(&request, "job.logs", request.get_ref().job_id).await?;
        let slot = self.streams.take(&caller.name)?;
        let req = request.into_inner();
        if req.tail_lines > limits::MAX_TAIL_LINES {
            return Err(Status::invalid_argument(format!(
                "--tail {} is more than {} lines",
                req.tail_lines,
                limits::MAX_TAIL_LINES
            )));
        }
        let (request_id, rx) = self
            .controller
            .jobs()
            .logs(req.job_id, req.rank, req.tail_lines, req.follow)
            .await
            .map_err(to_status)?;
        // Every piece the client takes is credit for its agent to send one more, granted a few
        // at a time; when the client goes away (the stream is dropped), the agent stops.
        let reading = LogReading { controller: self.controller.clone(), request_id };
        let mut taken = 0u32;
        let chunks = tokio_stream::StreamExt::map(ReceiverStream::new(rx), move |event| {
            let _held = &slot;
            match event {
                LogEvent::Chunk { stream, data } => {
                    taken += 1;
                    if taken == CREDIT_EVERY {
                        reading.controller.jobs().log_credit(request_id, std::mem::take(&mut taken));
                    }
                    Ok(LogChunk { stream: stream.to_string(), data })
                }
                LogEvent::Failed(why) => Err(Status::unavailable(why)),
            }
        });
        Ok(Response::new(Box::pin(chunks)))
    }

    async fn watch(&self, request: Request<WatchRequest>) -> Result<Response<WatchStream>, Status> {
        let caller = self.job_caller(&request, "job.watch", request.get_ref().job_id).await?;
        let slot = self.streams.take(&caller.name)?;
        let req = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let watcher =
            Watcher { controller: self.controller.clone(), job_id: req.job_id, cursor: req.after_position };
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            if let Err(e) = watcher.run(&tx, shutdown).await {
                let _ = tx.send(Err(to_status(e))).await;
            }
        });
        let events = tokio_stream::StreamExt::map(ReceiverStream::new(rx), move |event| {
            let _held = &slot;
            event
        });
        Ok(Response::new(Box::pin(events)))
    }
}

/// Streams one job's receipts and state changes until the job has ended and its ranks stopped.
struct Watcher {
    controller: Arc<Controller>,
    job_id: u64,
    cursor: u64,
}

type Sink = mpsc::Sender<Result<WatchEvent, Status>>;

impl Watcher {
    async fn run(mut self, tx: &Sink, shutdown: CancellationToken) -> Result<(), ControllerError> {
        let mut changes = self.controller.subscribe();
        let mut last_state: Option<JobState> = None;
        loop {
            changes.borrow_and_update();
            // Read the job before the receipts: if it has ended here, every receipt its ranks
            // wrote is already stored (agents report an exit only after sending its receipts).
            let Some(job) = self.controller.jobs().record(self.job_id).await? else { return Ok(()) };
            let ranks_done = self
                .controller
                .jobs()
                .allocations(self.job_id, job.attempt)
                .await?
                .iter()
                .all(|a| a.observed.state.is_done() || a.observed.state == RankState::Planned);
            if last_state != Some(job.state) {
                last_state = Some(job.state);
                let change = JobStateChange {
                    state: job.state.to_string(),
                    reason: job.reason.clone(),
                    at_ms: job.updated_at_ms,
                };
                if tx.send(Ok(WatchEvent { event: Some(Event::State(change)) })).await.is_err() {
                    return Ok(());
                }
            }
            if !self.drain(tx).await? {
                return Ok(());
            }
            if job.state.is_terminal() && ranks_done {
                return Ok(());
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tx.closed() => return Ok(()),
                _ = changes.changed() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Sends every stored receipt past the cursor; false when the client went away.
    async fn drain(&mut self, tx: &Sink) -> Result<bool, ControllerError> {
        loop {
            let rows = self.controller.receipts().after(self.job_id, self.cursor, WATCH_PAGE).await?;
            let full = rows.len() == WATCH_PAGE as usize;
            for r in rows {
                self.cursor = r.position;
                let receipt = StoredReceipt {
                    position: r.position,
                    attempt: r.id.attempt,
                    rank: r.id.rank,
                    seq: r.seq,
                    kind: r.kind,
                    body: r.body,
                };
                if tx.send(Ok(WatchEvent { event: Some(Event::Receipt(receipt)) })).await.is_err() {
                    return Ok(false);
                }
            }
            if !full {
                return Ok(true);
            }
        }
    }
}
