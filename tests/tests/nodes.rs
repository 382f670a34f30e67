//! The fleet table and preflight verdicts through real daemons: a node whose preflight fails
//! gets no work, `ctl nodes` and `ctl preflight` say why, and the verdict survives a restart
//! of the controller.
//!
//! The failing node is a scripted agent speaking the real `Agents.Connect` protocol (hello
//! with a failing report; a new report whenever the controller sends `RunPreflight`), so these
//! assertions hold whatever the agent's own checks find on the machine running the tests.
//! The healthy node is a real `trainyard-agent` that runs the job's ranks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::agents_client::AgentsClient;
use trainyard_proto::v1::{
    AgentMessage, Gpu, Hello, HostInventory, NumaNode, PreflightCheck, PreflightReport, agent_message,
    controller_message,
};
use trainyard_tests::Cluster;

const BAD: &str = "sxm-bad";

/// An 8-GPU node split 4+4 over two NUMA nodes, whose GPU 3 fails CUDA init.
fn failing_report(level: &str, started_at_ms: i64) -> PreflightReport {
    let check = |id: &str, status: &str, measured: &str, expected: &str, remedy: &str| PreflightCheck {
        id: id.into(),
        status: status.into(),
        measured: measured.into(),
        expected: expected.into(),
        remedy: remedy.into(),
    };
    PreflightReport {
        agent_id: BAD.into(),
        local_id: format!("{BAD}-{started_at_ms}"),
        level: level.into(),
        started_at_ms,
        finished_at_ms: started_at_ms + 800,
        verdict: "fail".into(),
        interconnect_class: "nvswitch".into(),
        topology: "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV18\t0-55\t0\nGPU1\tNV18\t X \t56-111\t1\n"
            .into(),
        driver_version: "570.124.06".into(),
        cuda_version: "12.8".into(),
        source: "host-file".into(),
        checks: vec![
            check("topology.nvlink", "pass", "NV18 on all 28 pairs", "NV18 on all 28 pairs", ""),
            check("cuda.init.gpu3", "fail", "CUDA_ERROR_ECC_UNCORRECTABLE", "context, alloc, copy", "drain the node"),
            check("nccl.busbw", "skipped", "libnccl.so.2 not found", "", ""),
        ],
        ..Default::default()
    }
}

fn inventory() -> HostInventory {
    HostInventory {
        hostname: BAD.into(),
        gpus: (0..8)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{BAD}-{i}"),
                model: "NVIDIA H100 80GB HBM3".into(),
                memory_mib: 81_559,
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + i * 0x10),
                numa_node: (i / 4) as i32,
            })
            .collect(),
        numa_nodes: vec![NumaNode { id: 0, cpus: "0-55".into() }, NumaNode { id: 1, cpus: "56-111".into() }],
        links: vec![],
        cores: vec![],
    }
}

/// Controller messages the scripted agent received, by kind.
#[derive(Default)]
struct Seen {
    launches: Vec<u64>,
    runs: Vec<String>,
}

/// Connects the scripted failing node; it answers every `RunPreflight` with a new failing report
/// at the asked level, until the controller ends its stream.
fn start_scripted_agent(rt: &tokio::runtime::Runtime, url: String) -> anyhow::Result<Arc<Mutex<Seen>>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_id: BAD.into(),
        address: "127.0.0.1".into(),
        inventory: Some(inventory()),
        ranks: vec![],
        agent_version: "scripted".into(),
        preflight: Some(failing_report("quick", 1_000)),
        join_token: String::new(),
    };
    tx.try_send(AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) })?;
    let mut inbound = rt.block_on(async {
        let channel =
            tonic::transport::Endpoint::from_shared(url)?.connect().await.context("dial the controller")?;
        let mut client = AgentsClient::new(channel);
        anyhow::Ok(client.connect(ReceiverStream::new(rx)).await?.into_inner())
    })?;
    let record = seen.clone();
    rt.spawn(async move {
        let mut started_at_ms = 2_000;
        while let Ok(Some(msg)) = inbound.message().await {
            match msg.msg {
                Some(controller_message::Msg::Launch(l)) => record.lock().unwrap().launches.push(l.job_id),
                Some(controller_message::Msg::RunPreflight(run)) => {
                    record.lock().unwrap().runs.push(run.level.clone());
                    started_at_ms += 1_000;
                    let report = failing_report(&run.level, started_at_ms);
                    let msg = AgentMessage { msg: Some(agent_message::Msg::Preflight(report)) };
                    if tx.send(msg).await.is_err() {
                        return;
                    }
                }
                _ => {}
            }
        }
    });
    Ok(seen)
}

#[test]
fn failing_node_gets_no_work_and_ctl_says_why() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 1)?;
    let seen = start_scripted_agent(&rt, c.url())?;
    c.wait_agent_connected(BAD, Duration::from_secs(10))?;

    // The fleet table: the failing node with its verdict, the failing check and what it measured.
    let bad = c.node(BAD)?;
    assert_eq!(bad["state"], "connected", "{bad}");
    assert_eq!(bad["verdict"], "fail", "{bad}");
    assert_eq!(bad["verdict_reason"], "cuda.init.gpu3: CUDA_ERROR_ECC_UNCORRECTABLE", "{bad}");
    assert_eq!((bad["gpus"].as_u64(), bad["free_gpus"].as_u64()), (Some(8), Some(8)), "{bad}");
    assert_eq!(
        (bad["numa_layout"].as_str(), bad["interconnect_class"].as_str()),
        (Some("0:4 1:4"), Some("nvswitch"))
    );
    let first_report = bad["preflight_report_id"].as_u64().context("report id")?;
    assert!(first_report > 0);
    let healthy = c.node("node-a")?;
    assert_ne!(healthy["verdict"], "fail", "{healthy}");
    assert_eq!(healthy["verdict_reason"], "", "{healthy}");
    let table = c.ctl_ok(&["nodes"])?;
    let line = table.lines().find(|l| l.starts_with(BAD)).context("row of the failing node")?;
    assert!(
        line.contains("fail") && line.contains("cuda.init.gpu3: CUDA_ERROR_ECC_UNCORRECTABLE"),
        "{table}"
    );

    // Two 1-GPU jobs: both run on the 1-GPU healthy node, one after the other, although the
    // failing node has 8 idle GPUs.
    let file = c.job_file("small", 1, 0, &["--steps", "5", "--step-ms", "100"], "");
    let jobs = [c.submit(&file)?, c.submit(&file)?];
    for job in jobs {
        let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(60))?;
        assert_eq!(status["state"], "succeeded", "{status}\n{}", c.logs("controller"));
        assert_eq!(status["ranks"][0]["agent_id"], "node-a", "{status}");
    }
    assert!(seen.lock().unwrap().launches.is_empty(), "a launch reached the failing node");

    // `ctl preflight HOST` prints the GPU matrix and every check.
    let text = c.ctl_ok(&["preflight", BAD])?;
    assert!(text.starts_with(&format!("preflight report {first_report} of {BAD}: fail\n")), "{text}");
    assert!(text.contains("GPU0\t X \tNV18\t0-55\t0"), "{text}");
    for row in [
        "topology.nvlink  pass",
        "cuda.init.gpu3   fail     CUDA_ERROR_ECC_UNCORRECTABLE",
        "nccl.busbw       skipped",
    ] {
        assert!(text.contains(row), "missing {row:?}:\n{text}");
    }
    // With --run the node runs one now, and the new report is what comes back.
    let json: serde_json::Value =
        serde_json::from_str(&c.ctl_ok(&["preflight", BAD, "--run", "standard", "-o", "json"])?)?;
    assert_eq!(seen.lock().unwrap().runs, ["standard"]);
    assert_eq!(
        (json["level"].as_str(), json["verdict"].as_str()),
        (Some("standard"), Some("fail")),
        "{json}"
    );
    let second_report = json["report_id"].as_u64().context("report id")?;
    assert!(second_report > first_report, "{json}");
    assert_eq!(c.node(BAD)?["preflight_report_id"], second_report);

    // An agent of another protocol version is refused at its hello, with both versions named.
    let refused = rt.block_on(async {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION - 1,
            agent_id: "old-agent".into(),
            ..Default::default()
        };
        tx.send(AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) }).await?;
        let channel = tonic::transport::Endpoint::from_shared(c.url())?.connect().await?;
        anyhow::Ok(AgentsClient::new(channel).connect(ReceiverStream::new(rx)).await)
    })?;
    let status = refused.err().context("an agent of an older protocol was let in")?;
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    let old = PROTOCOL_VERSION - 1;
    assert!(
        status
            .message()
            .contains(&format!("agent old-agent speaks {old}, this controller speaks {PROTOCOL_VERSION}")),
        "{status:?}"
    );

    // Asking about a node nobody knows, or one that has not reported yet, is one clear line.
    let out = c.ctl(&["preflight", "sxm-nowhere"])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no node sxm-nowhere is known") && err.lines().count() == 1, "{err}");

    // After a controller restart the verdict comes back from the store.
    c.kill_controller();
    c.start_controller()?;
    c.wait_agent_connected("node-a", Duration::from_secs(20))?;
    let bad = c.node(BAD)?;
    assert_eq!(
        (bad["verdict"].as_str(), bad["state"].as_str()),
        (Some("fail"), Some("disconnected")),
        "{bad}"
    );
    assert_eq!(bad["verdict_reason"], "cuda.init.gpu3: CUDA_ERROR_ECC_UNCORRECTABLE", "{bad}");
    assert_eq!(bad["preflight_report_id"], second_report, "{bad}");
    let text = c.ctl_ok(&["preflight", BAD])?;
    assert!(text.contains("cuda.init.gpu3   fail"), "{text}");
    let rows = c.query(&format!(
        "SELECT COUNT(*), SUM(verdict = 'fail') FROM preflight_reports WHERE agent_id = '{BAD}'"
    ))?;
    assert_eq!(rows, vec![vec![2, 2]], "one report from the hello, one from the run");
    Ok(())
}

/// `ctl cordon` takes a node out of scheduling (a job waits, saying why), survives nothing but
/// `ctl uncordon`, and after it the node takes work again.
#[test]
fn a_cordoned_node_gets_no_work_until_it_is_uncordoned() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 1)?;
    let out = c.ctl_ok(&["cordon", "node-a", "--reason", "fan replaced, burn-in first"])?;
    assert!(out.contains("node-a"), "{out}");
    let node = c.node("node-a")?;
    assert_eq!(
        (node["cordon_by"].as_str(), node["cordon_reason"].as_str()),
        (Some("operator"), Some("fan replaced, burn-in first")),
        "{node}"
    );
    let job = c.submit(&c.job_file("waits", 1, 0, &["--steps", "3", "--step-ms", "50"], ""))?;
    std::thread::sleep(Duration::from_secs(2));
    let status = c.status(job)?;
    assert_eq!(status["state"], "pending", "no work on a cordoned node: {status}");
    let table = c.ctl_ok(&["nodes"])?;
    assert!(table.lines().any(|l| l.starts_with("node-a") && l.contains("cordoned")), "{table}");
    c.ctl_ok(&["uncordon", "node-a"])?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    assert!(c.node("node-a")?["cordon_by"].is_null() || c.node("node-a")?["cordon_by"] == "");
    // Bad input: a node nobody knows.
    let out = c.ctl(&["cordon", "nope", "--reason", "x"])?;
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no node nope"));
    Ok(())
}
