//! Bad input is refused with an error naming what is wrong, and nothing is stored for it.

use std::time::Duration;

use trainyard_tests::Cluster;

/// Submits `spec` and returns ctl's stderr; asserts ctl failed.
fn rejected(c: &Cluster, name: &str, spec: &str) -> anyhow::Result<String> {
    let path = c.path(&format!("{name}.toml"));
    std::fs::write(&path, spec)?;
    let out = c.ctl(&["submit", &path.display().to_string()])?;
    assert!(
        !out.status.success(),
        "{name}: ctl submit should fail, printed {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(String::from_utf8_lossy(&out.stderr).into_owned())
}

/// An `[env]` of `n` variables of `bytes` each: each under the overlay's limits on its own.
fn big_env(n: usize, bytes: usize) -> String {
    let vars: String = (0..n).map(|i| format!("V{i} = \"{}\"\n", "x".repeat(bytes))).collect();
    format!("[env]\n{vars}")
}

fn spec(resources: &str, engine_extra: &str, workdir: &str, env: &str) -> String {
    format!(
        "name = \"bad\"\n[resources]\n{resources}\n[engine]\nkind = \"exec\"\nargv = [\"true\"]\n\
         workdir = {workdir:?}\n{engine_extra}\n{env}\n"
    )
}

#[test]
fn bad_specs_are_rejected_naming_the_field() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 8)?;
    c.start_agent("node-b", 8)?;
    // The fleet must be known before "more GPUs than the fleet has" means anything.
    let ok = c.job_file("probe", 1, 0, &["--steps", "1", "--step-ms", "1"], "");
    let probe = c.submit(&ok)?;
    c.wait_state(probe, &["succeeded"], Duration::from_secs(60))?;

    let cases = [
        ("unknown", spec("gpus = 1\ncolour = \"red\"", "", "/tmp", ""), "colour"),
        ("zero", spec("gpus = 0", "", "/tmp", ""), "resources.gpus"),
        ("toomany", spec("gpus = 64", "", "/tmp", ""), "the fleet has 16"),
        ("relative", spec("gpus = 1", "", "runs/here", ""), "engine.workdir"),
        ("envname", spec("gpus = 1", "", "/tmp", "[env]\n\"BAD NAME\" = \"1\""), "env.BAD NAME"),
        // Sizes: one over each limit is named; a whole spec over 512 KiB is refused whole, and a
        // spec file over 1 MiB is refused by ctl before anything is sent.
        (
            "pathlong",
            spec("gpus = 1", &format!("source_dir = \"/{}\"", "s".repeat(4096)), "/tmp", ""),
            "engine.source_dir",
        ),
        (
            "envbig",
            spec("gpus = 1", "", "/tmp", &format!("[env]\nBIG = \"{}\"", "x".repeat(128 << 10))),
            "at most 131072",
        ),
        ("specbig", spec("gpus = 1", "", "/tmp", &big_env(5, 120 << 10)), "at most 524288"),
        // The restart rules (docs/faults.md): each number checked where the controller reads it.
        (
            "backoff",
            spec("gpus = 1", "", "/tmp", "[restart]\nbackoff_initial_s = -1"),
            "restart.backoff_initial_s: -1 is negative",
        ),
        (
            "hangfloor",
            spec("gpus = 1", "", "/tmp", "[restart]\nhang_timeout_s = 2"),
            "restart.hang_timeout_s: 2 s is below the floor of 5 s",
        ),
        (
            "hostwait0",
            spec("gpus = 1", "", "/tmp", "[restart]\nhost_wait_s = 0"),
            "restart.host_wait_s: 0 is not a wait",
        ),
        (
            "hostwaitneg",
            spec("gpus = 1", "", "/tmp", "[restart]\nhost_wait_s = -30"),
            "restart.host_wait_s: -30 is not a wait",
        ),
        (
            "signal",
            spec("gpus = 1", "", "/tmp", "[restart]\ncheckpoint_signal = \"SIGKILL\""),
            "restart.checkpoint_signal",
        ),
        ("filebig", spec("gpus = 1", "", "/tmp", &big_env(9, 120 << 10)), "larger than 1048576 bytes"),
    ];
    for (name, text, needle) in cases {
        let err = rejected(&c, name, &text)?;
        assert!(err.contains(needle), "{name}: error should mention {needle:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: one line for a person: {err}");
    }
    let jobs = c.query("SELECT COUNT(*) FROM jobs")?;
    assert_eq!(jobs[0][0], 1, "only the probe job was stored");
    Ok(())
}

#[test]
fn garbage_receipt_lines_are_skipped_and_counted() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let file = c.job_file("garbage", 2, 0, &["--steps", "10", "--step-ms", "10", "--garbage"], "");
    let job = c.submit(&file)?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    let rows = c.query(&format!(
        "SELECT rank, SUM(kind = 'step') FROM receipts WHERE job_id = {job} GROUP BY rank ORDER BY rank"
    ))?;
    assert_eq!(rows, vec![vec![0, 10], vec![1, 10]], "valid receipts still arrive");
    for r in status["ranks"].as_array().unwrap() {
        assert_eq!(r["skipped_lines"], 3, "a non-JSON line, invalid UTF-8 and a 10 MB line: {r}");
    }
    Ok(())
}

/// A request over the `Jobs` service's 1 MiB limit is refused by the transport itself, before
/// any of it is looked at; one just under it reaches the spec check. The controller lives on.
#[test]
fn requests_over_the_message_limit_are_refused_by_the_transport() -> anyhow::Result<()> {
    use trainyard_proto::limits::MAX_REQUEST_BYTES;
    use trainyard_proto::v1::jobs_client::JobsClient;
    use trainyard_proto::v1::{JobSpec, SubmitRequest};
    let c = Cluster::start()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let submit = |env_bytes: usize| -> anyhow::Result<tonic::Status> {
        let spec = JobSpec {
            name: "big".into(),
            env: [("BIG".to_string(), "x".repeat(env_bytes))].into_iter().collect(),
            ..Default::default()
        };
        let request = SubmitRequest { spec: Some(spec), idempotency_key: String::new() };
        rt.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(c.url())?.connect().await?;
            let mut client = JobsClient::new(channel);
            Ok(client.submit(request).await.expect_err("refused"))
        })
    };
    let over = submit(MAX_REQUEST_BYTES)?;
    assert_eq!(over.code(), tonic::Code::OutOfRange, "{over:?}");
    let under = submit(MAX_REQUEST_BYTES - 64 * 1024)?;
    assert_eq!(under.code(), tonic::Code::InvalidArgument, "{under:?}");
    assert!(under.message().contains("at most 524288"), "{}", under.message());
    assert!(c.ctl(&["status"])?.status.success(), "the controller is alive");
    assert_eq!(c.query("SELECT COUNT(*) FROM jobs")?[0][0], 0);
    Ok(())
}

/// The older limits at their value and one past it: an idempotency key of 256 bytes is taken
/// and one of 257 refused naming it; `--tail` of 1,000,000 lines passes the check and one more
/// is refused naming it; request headers of 15 KiB are served and of 17 KiB refused by the
/// transport (16 KiB). The controller serves on after each.
#[test]
fn the_older_limits_hold_at_their_value_and_refuse_one_past() -> anyhow::Result<()> {
    use trainyard_proto::limits::{MAX_SHORT_STRING_BYTES, MAX_TAIL_LINES};
    use trainyard_proto::v1::jobs_client::JobsClient;
    use trainyard_proto::v1::{GetJobRequest, JobSpec, LogsRequest, SubmitRequest};
    let mut c = Cluster::start()?;
    c.start_agent("a", 1)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let client = || async {
        let channel = tonic::transport::Endpoint::from_shared(c.url())?.connect().await?;
        anyhow::Ok(JobsClient::new(channel))
    };
    let spec = JobSpec::from(&trainyard_model::spec::JobSpec::exec("keyed", 1, &["true"]));
    let submit = |key_bytes: usize| {
        let request = SubmitRequest { spec: Some(spec.clone()), idempotency_key: "k".repeat(key_bytes) };
        rt.block_on(async { anyhow::Ok(client().await?.submit(request).await) })
    };
    let job = submit(MAX_SHORT_STRING_BYTES)?.map_err(|s| anyhow::anyhow!("a 256-byte key: {s:?}"))?;
    let job = job.into_inner().job_id;
    let over = submit(MAX_SHORT_STRING_BYTES + 1)?.expect_err("a 257-byte key is refused");
    assert_eq!(over.code(), tonic::Code::InvalidArgument, "{over:?}");
    assert!(over.message().contains("idempotency key is 257 bytes long, at most 256"), "{}", over.message());

    let logs = |tail_lines: u32| {
        let request = LogsRequest { job_id: job, rank: 0, tail_lines, follow: false };
        rt.block_on(async {
            let mut client = client().await?;
            let call = tokio::time::timeout(std::time::Duration::from_secs(10), client.logs(request));
            anyhow::Ok(call.await.map(|r| r.err()))
        })
    };
    // At the limit the request gets past the check to the rank's output.
    let at = logs(MAX_TAIL_LINES)?;
    assert!(
        !matches!(&at, Ok(Some(s)) if s.message().contains("lines")),
        "--tail at the limit refused: {at:?}"
    );
    let past = logs(MAX_TAIL_LINES + 1)?.expect("answered").expect("refused");
    assert_eq!(past.code(), tonic::Code::InvalidArgument, "{past:?}");
    assert!(past.message().contains("--tail 1000001 is more than 1000000 lines"), "{}", past.message());

    let get_with_header = |bytes: usize| {
        let mut request = tonic::Request::new(GetJobRequest { job_id: job });
        let value = "h".repeat(bytes).parse().expect("ascii");
        request.metadata_mut().insert("x-padding", value);
        rt.block_on(async { anyhow::Ok(client().await?.get(request).await.map(|_| ())) })
    };
    get_with_header(15 << 10)?.map_err(|s| anyhow::anyhow!("15 KiB of headers: {s:?}"))?;
    let refused = get_with_header(17 << 10)?.expect_err("17 KiB of headers are refused");
    assert_ne!(refused.code(), tonic::Code::Ok, "{refused:?}");
    assert!(c.ctl(&["status"])?.status.success(), "the controller is alive");
    assert_eq!(c.query("SELECT COUNT(*) FROM jobs")?[0][0], 1, "only the job of the 256-byte key");
    Ok(())
}

/// A plaintext agent session on the loopback demo: says hello as `agent_id`, sends `then`, and
/// reads what the controller answers for `wait` or until the stream ends: the answers, and how
/// the stream ended (`Ok(true)`: closed by the controller, `Ok(false)`: still open at `wait`).
async fn agent_session(
    url: &str,
    agent_id: &str,
    then: Vec<trainyard_proto::v1::AgentMessage>,
    wait: std::time::Duration,
) -> (Vec<trainyard_proto::v1::ControllerMessage>, Result<bool, tonic::Status>) {
    use trainyard_proto::v1::agents_client::AgentsClient;
    use trainyard_proto::v1::{AgentMessage, Hello, agent_message};
    let channel = match tonic::transport::Endpoint::from_shared(url.to_string()).expect("url").connect().await
    {
        Ok(channel) => channel,
        Err(e) => return (vec![], Err(tonic::Status::unavailable(e.to_string()))),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let hello = Hello {
        protocol_version: trainyard_proto::PROTOCOL_VERSION,
        agent_id: agent_id.into(),
        address: "127.0.0.1".into(),
        agent_version: "limits test".into(),
        ..Default::default()
    };
    tokio::spawn(async move {
        let _ = tx.send(AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) }).await;
        for m in then {
            let _ = tx.send(m).await;
        }
        // Keep the request stream open while the answers are read.
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    });
    let client =
        AgentsClient::new(channel).max_encoding_message_size(64 << 20).max_decoding_message_size(64 << 20);
    let mut inbound = match client.clone().connect(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => return (vec![], Err(status)),
    };
    let mut got = Vec::new();
    let deadline = tokio::time::sleep(wait);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => return (got, Ok(false)),
            msg = inbound.message() => match msg {
                Ok(Some(m)) => got.push(m),
                Ok(None) => return (got, Ok(true)),
                Err(status) => return (got, Err(status)),
            },
        }
    }
}

/// An agent's messages at their limits and one past: a receipt batch just under 16 MiB is read
/// (its receipts, of no job this controller knows, are held back, not acknowledged) and one over
/// 16 MiB is refused by the transport; a telemetry batch of 1,024 windows is stored and
/// acknowledged, and one of 1,025 ends the stream unacknowledged; a batch of 20,000 receipts is
/// read and one of 20,001 ends the stream. The controller serves on.
#[test]
fn an_agents_messages_hold_their_limits_at_their_value_and_refuse_one_past() -> anyhow::Result<()> {
    use std::time::Duration;
    use trainyard_proto::limits::{MAX_AGENT_MESSAGE_BYTES, MAX_TELEMETRY_WINDOWS};
    use trainyard_proto::v1::controller_message::Msg;
    use trainyard_proto::v1::{
        AgentMessage, GpuWindow, RankKey, Receipt, ReceiptBatch, TelemetryBatch, agent_message,
    };
    let c = Cluster::start()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let batch_of = |bytes: usize| {
        // Receipts of 512 KiB (under the 1 MiB a line may have) up to `bytes` of bodies.
        let piece = 512 << 10;
        let receipts = (0..bytes.div_ceil(piece))
            .map(|seq| Receipt {
                key: Some(RankKey { job_id: 999, attempt: 0, rank: 0 }),
                seq: seq as u64,
                kind: "step".into(),
                step: seq as i64,
                body: format!(
                    "{{\"pad\":\"{}\"}}",
                    "x".repeat(piece.min(bytes - seq * piece).saturating_sub(10))
                ),
            })
            .collect();
        AgentMessage { msg: Some(agent_message::Msg::Receipts(ReceiptBatch { receipts })) }
    };
    let url = c.url();
    let (_, under) = rt.block_on(agent_session(
        &url,
        "big-a",
        vec![batch_of(MAX_AGENT_MESSAGE_BYTES - (64 << 10))],
        Duration::from_secs(3),
    ));
    assert_eq!(under.map_err(|s| s.to_string()), Ok(false), "a batch just under 16 MiB ended the stream");
    let (_, over) = rt.block_on(agent_session(
        &url,
        "big-b",
        vec![batch_of(MAX_AGENT_MESSAGE_BYTES + 1)],
        Duration::from_secs(10),
    ));
    // Refused: the controller ends the stream (an error, or closed without an answer).
    assert!(!matches!(over, Ok(false)), "a batch over 16 MiB kept the stream open: {over:?}");

    let windows = |n: usize| {
        let windows = (0..n)
            .map(|i| GpuWindow {
                gpu: (i % 8) as u32,
                start_ms: i as i64 * 1_000,
                end_ms: i as i64 * 1_000 + 1_000,
                samples: 1,
                ..Default::default()
            })
            .collect();
        AgentMessage { msg: Some(agent_message::Msg::Telemetry(TelemetryBatch { id: n as u64, windows })) }
    };
    let acked = |got: &[trainyard_proto::v1::ControllerMessage], id: u64| {
        got.iter().any(|m| matches!(&m.msg, Some(Msg::TelemetryAck(a)) if a.id == id))
    };
    let at = MAX_TELEMETRY_WINDOWS;
    let (got, open) = rt.block_on(agent_session(&url, "tele-a", vec![windows(at)], Duration::from_secs(3)));
    assert!(acked(&got, at as u64) && open.is_ok(), "1,024 windows: {open:?}, answers {got:?}");
    let (got, closed) =
        rt.block_on(agent_session(&url, "tele-b", vec![windows(at + 1)], Duration::from_secs(10)));
    assert!(!acked(&got, at as u64 + 1), "1,025 windows acknowledged");
    assert_eq!(closed.map_err(|s| s.to_string()), Ok(true), "1,025 windows: the stream goes on");
    // A batch's receipt count: 20,000 small receipts are read, 20,001 end the stream.
    let receipts = |n: usize| {
        let receipts = (0..n)
            .map(|seq| Receipt {
                key: Some(RankKey { job_id: 999, attempt: 0, rank: 1 }),
                seq: seq as u64,
                kind: "step".into(),
                step: seq as i64,
                body: "{}".into(),
            })
            .collect();
        AgentMessage { msg: Some(agent_message::Msg::Receipts(ReceiptBatch { receipts })) }
    };
    let most = trainyard_proto::limits::MAX_RECEIPT_BATCH;
    let (_, open) = rt.block_on(agent_session(&url, "count-a", vec![receipts(most)], Duration::from_secs(3)));
    assert_eq!(open.map_err(|s| s.to_string()), Ok(false), "20,000 receipts in a batch ended the stream");
    let (_, closed) =
        rt.block_on(agent_session(&url, "count-b", vec![receipts(most + 1)], Duration::from_secs(10)));
    assert_eq!(closed.map_err(|s| s.to_string()), Ok(true), "20,001 receipts in a batch: the stream goes on");
    assert_eq!(c.query("SELECT COUNT(*) FROM gpu_samples WHERE agent_id = 'tele-a'")?[0][0], at as i64);
    assert_eq!(c.query("SELECT COUNT(*) FROM gpu_samples WHERE agent_id = 'tele-b'")?[0][0], 0);
    assert_eq!(c.query("SELECT COUNT(*) FROM receipts")?[0][0], 0, "no receipt of an unknown job stored");
    assert!(c.ctl(&["status"])?.status.success(), "the controller is alive");
    Ok(())
}
