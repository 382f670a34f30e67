//! `ctl nodes [-o json]`: the fleet table.

use trainyard_proto::v1::NodesRequest;

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
