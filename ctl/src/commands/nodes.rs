//! `ctl nodes [-o json]`: the fleet table; `ctl cordon`, `ctl uncordon` and `ctl drain`.

use trainyard_proto::v1::{CordonRequest, DrainRequest, NodesRequest};

use crate::client::Controller;
use crate::fleet;
use crate::output::{NodeJson, print_out, to_json};
use crate::render;

pub async fn run(ctl: &mut Controller, json: bool) -> anyhow::Result<()> {
    let nodes = match ctl.jobs.nodes(NodesRequest {}).await {
        Ok(r) => r.into_inner().nodes,
        Err(status) => return Err(ctl.error(status, None)),
    };
    ctl.words(nodes.as_slice())?;
    if json {
        let nodes: Vec<NodeJson> = nodes.iter().map(NodeJson::from).collect();
        print_out(&to_json(&nodes)?)
    } else if nodes.is_empty() {
        print_out("no nodes: no agent has said hello to this controller yet\n")
    } else {
        print_out(&fleet::node_table(&nodes, render::now_ms()))
    }
}

/// Cordons `host` (with a reason) or lifts its cordon, and prints the node's row.
pub async fn cordon(ctl: &mut Controller, host: &str, reason: Option<String>) -> anyhow::Result<()> {
    let request = CordonRequest {
        agent_id: host.to_string(),
        cordon: reason.is_some(),
        reason: reason.unwrap_or_default(),
    };
    let node = match ctl.jobs.cordon(request).await {
        Ok(r) => r.into_inner().node.unwrap_or_default(),
        Err(status) => return Err(ctl.error(status, None)),
    };
    ctl.words(&node)?;
    let what = if node.cordon_by.is_empty() {
        "uncordoned: it takes new work"
    } else {
        "cordoned: no new work goes there"
    };
    print_out(&format!(
        "{} {what}\n{}",
        node.agent_id,
        fleet::node_table(std::slice::from_ref(&node), render::now_ms())
    ))
}

/// Drains `host`: prints the jobs asked to checkpoint and move, and the node's row.
pub async fn drain(ctl: &mut Controller, host: &str, deadline_s: u32, reason: String) -> anyhow::Result<()> {
    let request = DrainRequest { agent_id: host.to_string(), deadline_s, reason };
    let reply = match ctl.jobs.drain(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Err(ctl.error(status, None)),
    };
    let node = reply.node.unwrap_or_default();
    ctl.words(&node)?;
    let jobs: Vec<String> = reply.jobs.iter().map(u64::to_string).collect();
    let what = match jobs.len() {
        0 => "no job runs there".to_string(),
        _ => format!(
            "job(s) {} asked to checkpoint within {deadline_s} s, then move (`ctl status JOB` follows them)",
            jobs.join(", ")
        ),
    };
    print_out(&format!(
        "{} draining: no new work goes there; {what}\n{}",
        node.agent_id,
        fleet::node_table(std::slice::from_ref(&node), render::now_ms())
    ))
}
