//! The commands against a scripted in-process Jobs server on port 0: no controller needed.

use std::sync::Mutex;

use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};
use trainyard_proto::v1::jobs_server::{Jobs, JobsServer};
use trainyard_proto::v1::{
    CancelRequest, CancelResponse, CompareRequest, Comparison, CordonRequest, CordonResponse,
    DiagnoseRequest, Diagnosis, DrainRequest, DrainResponse, Finding, GetJobRequest, Job, JobSpec,
    JobStateChange, LeaderReply, LeaderRequest, ListJobsRequest, ListJobsResponse, LiveFinding,
    LiveFindingsRequest, LiveFindingsResponse, LogChunk, LogsRequest, Measure, NodeInfo, NodesRequest,
    NodesResponse, PreflightReport, PreflightRequest, RankStatus, SlurmSubmittedRequest, StoredReceipt,
    SubmitRequest, SubmitResponse, WatchEvent, WatchRequest, watch_event::Event,
};

use crate::client::{Controller, connect};

/// What the fake controller does: one job, whose ranks stop after `gets_until_stopped` Gets,
/// and a Watch that replays `events` then closes.
struct Fake {
    job: Mutex<Job>,
    gets_until_stopped: Mutex<u32>,
    events: Vec<WatchEvent>,
}

#[tonic::async_trait]
impl Jobs for Fake {
    /// As a controller older than groups: it answers no `Leader` (ctl then takes it as leading).
    async fn leader(&self, _: Request<LeaderRequest>) -> Result<Response<LeaderReply>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn cordon(&self, _: Request<CordonRequest>) -> Result<Response<CordonResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn nodes(&self, _: Request<NodesRequest>) -> Result<Response<NodesResponse>, Status> {
        let node = NodeInfo {
            agent_id: "node-a".into(),
            state: "connected".into(),
            verdict: "fail".into(),
            ..Default::default()
        };
        Ok(Response::new(NodesResponse { nodes: vec![node] }))
    }

    /// Knows node-a only; a run level it cannot run.
    async fn preflight(&self, r: Request<PreflightRequest>) -> Result<Response<PreflightReport>, Status> {
        let r = r.into_inner();
        match (r.agent_id.as_str(), r.run_level.as_str()) {
            ("node-a", "") => {
                let (level, verdict) = ("quick".into(), "pass".into());
                Ok(Response::new(PreflightReport {
                    agent_id: r.agent_id,
                    level,
                    verdict,
                    ..Default::default()
                }))
            }
            ("node-a", _) => Err(Status::failed_precondition(
                "node node-a is not connected, so it cannot run a preflight now",
            )),
            (host, _) => Err(Status::not_found(format!("no node {host} is known to this controller"))),
        }
    }

    async fn submit(&self, _: Request<SubmitRequest>) -> Result<Response<SubmitResponse>, Status> {
        let job_id = self.job.lock().expect("lock").id;
        Ok(Response::new(SubmitResponse { job_id, join_token: String::new() }))
    }

    async fn slurm_submitted(&self, _: Request<SlurmSubmittedRequest>) -> Result<Response<Job>, Status> {
        Err(Status::unimplemented("no Slurm here"))
    }

    async fn get(&self, r: Request<GetJobRequest>) -> Result<Response<Job>, Status> {
        let mut job = self.job.lock().expect("lock");
        if r.get_ref().job_id != job.id {
            return Err(Status::not_found("no such job"));
        }
        let mut left = self.gets_until_stopped.lock().expect("lock");
        *left = left.saturating_sub(1);
        if *left == 0 {
            for rank in &mut job.ranks {
                rank.state = "exited".into();
                rank.signal = 15;
            }
        }
        Ok(Response::new(job.clone()))
    }

    async fn list(&self, _: Request<ListJobsRequest>) -> Result<Response<ListJobsResponse>, Status> {
        let jobs = vec![self.job.lock().expect("lock").clone()];
        Ok(Response::new(ListJobsResponse { jobs, left_off: 0 }))
    }

    async fn cancel(&self, _: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        let mut job = self.job.lock().expect("lock");
        job.state = "cancelled".into();
        Ok(Response::new(CancelResponse { job: Some(job.clone()) }))
    }

    async fn compare(&self, _: Request<CompareRequest>) -> Result<Response<Comparison>, Status> {
        Err(Status::unimplemented("compare is tested end to end"))
    }

    /// Job 7 has one finding; any other job is unknown.
    async fn diagnose(&self, r: Request<DiagnoseRequest>) -> Result<Response<Diagnosis>, Status> {
        if r.get_ref().job_id != 7 {
            return Err(Status::not_found("no such job"));
        }
        Ok(Response::new(diagnosis()))
    }

    /// Job 7 has one live finding: open at the first call; at the second it is closed and the
    /// job has succeeded.
    async fn live_findings(
        &self,
        r: Request<LiveFindingsRequest>,
    ) -> Result<Response<LiveFindingsResponse>, Status> {
        let mut job = self.job.lock().expect("lock");
        if r.get_ref().job_id != job.id {
            return Err(Status::not_found("no such job"));
        }
        let mut f = LiveFinding {
            id: 1,
            job_id: 7,
            cause: "gpu.thermal_throttle".into(),
            subject: "b/gpu3".into(),
            summary: "GPU 3 of b throttled".into(),
            remedy: "check cooling".into(),
            opened_at_ms: 1_000,
            ..Default::default()
        };
        if job.state == "running" {
            job.state = "succeeded".into();
        } else {
            f.closed_at_ms = 2_000;
        }
        Ok(Response::new(LiveFindingsResponse { findings: vec![f] }))
    }

    type LogsStream = tokio_stream::Iter<std::vec::IntoIter<Result<LogChunk, Status>>>;

    /// One line of stdout, then the node goes away mid-stream.
    async fn logs(&self, _: Request<LogsRequest>) -> Result<Response<Self::LogsStream>, Status> {
        let chunks = vec![
            Ok(LogChunk { stream: "stdout".into(), data: b"hello\n".to_vec() }),
            Err(Status::unavailable("node node-a disconnected while its logs were being read")),
        ];
        Ok(Response::new(tokio_stream::iter(chunks)))
    }

    type WatchStream = tokio_stream::Iter<std::vec::IntoIter<Result<WatchEvent, Status>>>;

    async fn watch(&self, _: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let events: Vec<_> = self.events.iter().cloned().map(Ok).collect();
        Ok(Response::new(tokio_stream::iter(events)))
    }
}

fn job(state: &str, ranks: u32) -> Job {
    let ranks = (0..ranks)
        .map(|rank| RankStatus {
            rank,
            state: "running".into(),
            agent_id: "node-a".into(),
            ..Default::default()
        })
        .collect();
    Job { id: 7, state: state.into(), ranks, ..Default::default() }
}

fn receipt(rank: u32, step: u32) -> WatchEvent {
    let body = format!(r#"{{"kind":"step","step":{step},"loss":3.0,"tokens_per_s":100}}"#);
    let receipt = StoredReceipt { rank, kind: "step".into(), body, ..Default::default() };
    WatchEvent { event: Some(Event::Receipt(receipt)) }
}

fn state(state: &str) -> WatchEvent {
    let change = JobStateChange { state: state.into(), ..Default::default() };
    WatchEvent { event: Some(Event::State(change)) }
}

async fn serve(fake: Fake) -> Controller {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let server = tonic::transport::Server::builder()
        .add_service(JobsServer::new(fake))
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);
    connect(&url, &Default::default()).await.expect("connect to the fake")
}

#[tokio::test]
async fn cancel_waits_until_every_rank_stopped() {
    let fake = Fake { job: Mutex::new(job("running", 4)), gets_until_stopped: Mutex::new(3), events: vec![] };
    let mut ctl = serve(fake).await;
    super::cancel::run(&mut ctl, 7).await.expect("cancel succeeds");
}

#[tokio::test]
async fn unknown_job_is_named() {
    let fake = Fake { job: Mutex::new(job("running", 1)), gets_until_stopped: Mutex::new(0), events: vec![] };
    let mut ctl = serve(fake).await;
    let err = super::status::run(&mut ctl, Some(99), false).await.expect_err("no job 99");
    assert_eq!(err.to_string(), "job 99 not found");
}

#[tokio::test]
async fn follow_exits_by_the_final_state() {
    let mut done = job("succeeded", 2);
    done.ranks.iter_mut().for_each(|r| r.state = "exited".into());
    let events = vec![state("running"), receipt(0, 1), receipt(1, 1), state("succeeded")];
    let fake = Fake { job: Mutex::new(done), gets_until_stopped: Mutex::new(0), events };
    let mut ctl = serve(fake).await;
    super::submit::run(&mut ctl, JobSpec::default(), None, true, None).await.expect("job succeeded");

    let events = vec![state("running"), state("failed")];
    let fake = Fake { job: Mutex::new(job("failed", 2)), gets_until_stopped: Mutex::new(0), events };
    let mut ctl = serve(fake).await;
    let err =
        super::submit::run(&mut ctl, JobSpec::default(), None, true, None).await.expect_err("job failed");
    assert!(err.to_string().starts_with("job 7 failed"), "{err}");
}

#[tokio::test]
async fn nodes_and_preflight_answer_or_say_why_not() {
    let fake = Fake { job: Mutex::new(job("running", 1)), gets_until_stopped: Mutex::new(0), events: vec![] };
    let mut ctl = serve(fake).await;
    super::nodes::run(&mut ctl, false).await.expect("table");
    super::nodes::run(&mut ctl, true).await.expect("json");
    super::preflight::run(&mut ctl, "node-a", None, false).await.expect("report");
    let err = super::preflight::run(&mut ctl, "node-z", None, false).await.expect_err("unknown node");
    assert_eq!(err.to_string(), "no node node-z is known to this controller");
    let err =
        super::preflight::run(&mut ctl, "node-a", Some(trainyard_proto::words::PreflightLevel::Quick), true)
            .await
            .expect_err("not connected");
    assert_eq!(err.to_string(), "node node-a is not connected, so it cannot run a preflight now");
}

/// A log stream that breaks (its node went away) ends `ctl logs` with the reason.
#[tokio::test]
async fn logs_end_with_the_reason_when_the_stream_breaks() {
    let fake = Fake { job: Mutex::new(job("running", 1)), gets_until_stopped: Mutex::new(0), events: vec![] };
    let mut ctl = serve(fake).await;
    let err = super::logs::run(&mut ctl, 7, 0, 0, true).await.expect_err("broken stream");
    assert!(err.to_string().contains("disconnected while its logs were being read"), "{err}");
}

fn diagnosis() -> Diagnosis {
    let finding = Finding {
        cause: "numa.split".into(),
        summary: "sxm-b runs 1.84x slower than the fastest node".into(),
        subject: "sxm-b".into(),
        nodes: vec!["sxm-b".into()],
        ranks: (8..16).chain([18]).collect(),
        evidence: vec![Measure { name: "slowdown".into(), value: 1.8449, unit: "x".into() }],
        expected_cost: "1295 ms per step instead of 702 ms".into(),
        remedy: "pin each rank to its GPU's NUMA node".into(),
    };
    Diagnosis {
        job_id: 7,
        verdict: "numa.split: sxm-b runs 1.84x slower than the fastest node".into(),
        findings: vec![finding],
        unusable: vec!["rank 3: 2 step receipt(s) without a usable step_time_ms".into()],
        metric: "step_time_ms".into(),
        median_step_ms: Some(702.04),
        ..Default::default()
    }
}

#[tokio::test]
async fn diagnose_prints_the_finding_with_its_evidence_or_names_the_unknown_job() {
    let text = super::diagnose::text(&diagnosis());
    for needle in [
        "job 7 attempt 0: numa.split: sxm-b runs 1.84x slower",
        "numa.split  nodes sxm-b  ranks 8-15,18",
        "evidence: slowdown 1.84x",
        "expected cost: 1295 ms per step instead of 702 ms",
        "remedy: pin each rank",
        "median step 702.0 ms",
        "cost model unknown",
        "could not use:\n  - rank 3: 2 step receipt(s)",
    ] {
        assert!(text.contains(needle), "{needle:?} not in:\n{text}");
    }
    let json = crate::output::to_json(&diagnosis()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        (v["findings"][0]["cause"].as_str(), v["findings"][0]["ranks"][8].as_u64()),
        (Some("numa.split"), Some(18))
    );
    let fake = Fake { job: Mutex::new(job("running", 1)), gets_until_stopped: Mutex::new(0), events: vec![] };
    let mut ctl = serve(fake).await;
    super::diagnose::run(&mut ctl, 7, None, true).await.expect("json");
    let err = super::diagnose::run(&mut ctl, 8, None, false).await.expect_err("no job 8");
    assert_eq!(err.to_string(), "job 8 not found");
}

#[tokio::test]
async fn diagnose_follow_prints_findings_as_they_open_and_close_until_the_job_ends() {
    let seen = std::collections::HashMap::new();
    let open = LiveFinding { id: 1, summary: "hot".into(), ..Default::default() };
    let events = super::diagnose::changes(&seen, vec![open.clone()]);
    assert_eq!(events.iter().map(|(e, _)| *e).collect::<Vec<_>>(), vec!["opened"]);
    let seen: std::collections::HashMap<u64, LiveFinding> = [(1, open.clone())].into();
    let closed = LiveFinding { closed_at_ms: 5, ..open.clone() };
    let hotter = LiveFinding { summary: "hotter".into(), ..open.clone() };
    assert_eq!(super::diagnose::changes(&seen, vec![closed])[0].0, "closed");
    assert_eq!(super::diagnose::changes(&seen, vec![hotter])[0].0, "updated");
    assert!(super::diagnose::changes(&seen, vec![open]).is_empty(), "nothing new: nothing printed");
    let fake = Fake { job: Mutex::new(job("running", 1)), gets_until_stopped: Mutex::new(5), events: vec![] };
    let mut ctl = serve(fake).await;
    tokio::time::timeout(std::time::Duration::from_secs(20), super::diagnose::follow(&mut ctl, 7, false))
        .await
        .expect("follow ends when the job does")
        .expect("follow");
    let err = super::diagnose::follow(&mut ctl, 8, true).await.expect_err("no job 8");
    assert_eq!(err.to_string(), "job 8 not found");
}

/// The response limit (64 MiB) where ctl reads: a `List` answer of exactly 64 MiB encoded is
/// read whole; one byte more is refused with a line that says what happened.
#[tokio::test]
async fn an_answer_of_64_mib_is_read_and_one_byte_more_is_refused() {
    use prost::Message as _;
    let limit = trainyard_proto::limits::MAX_RESPONSE_BYTES;
    let sized = |bytes: usize| {
        let mut job = job("running", 1);
        job.reason = "x".repeat(bytes);
        let over = ListJobsResponse { jobs: vec![job.clone()], left_off: 0 }.encoded_len() - bytes;
        job.reason = "x".repeat(bytes - over);
        while (ListJobsResponse { jobs: vec![job.clone()], left_off: 0 }).encoded_len() > bytes {
            job.reason.pop();
        }
        assert_eq!(ListJobsResponse { jobs: vec![job.clone()], left_off: 0 }.encoded_len(), bytes);
        job
    };
    let at = sized(limit);
    let want = at.reason.len();
    let mut ctl =
        serve(Fake { job: Mutex::new(at), gets_until_stopped: Mutex::new(0), events: vec![] }).await;
    let request = ListJobsRequest { active_only: false, limit: 0 };
    let got = ctl.jobs.list(request).await.expect("64 MiB is read");
    assert_eq!(got.into_inner().jobs[0].reason.len(), want, "the whole job");
    let past = Fake { job: Mutex::new(sized(limit + 1)), gets_until_stopped: Mutex::new(0), events: vec![] };
    let mut ctl = serve(past).await;
    let err = super::status::run(&mut ctl, None, false).await.expect_err("one byte past 64 MiB");
    assert!(
        err.to_string().starts_with("the controller's answer is larger than ctl takes (64 MiB)"),
        "{err}"
    );
}
