//! `ctl preflight HOST [--run LEVEL] [-o json]`: a node's newest preflight report, or a new
//! one the node runs now.

use trainyard_proto::v1::PreflightRequest;
use trainyard_proto::words::PreflightLevel;

use crate::client::Controller;
use crate::fleet;
use crate::output::{PreflightJson, print_out, to_json};

pub async fn run(
    ctl: &mut Controller,
    host: &str,
    run_level: Option<PreflightLevel>,
    json: bool,
) -> anyhow::Result<()> {
    if let Some(level) = run_level
        && !json
    {
        eprintln!("asking {host} to run a {level} preflight (the controller waits up to 2 minutes)...");
    }
    let request = PreflightRequest {
        agent_id: host.to_string(),
        run_level: run_level.map(|l| l.as_str().to_string()).unwrap_or_default(),
    };
    let report = match ctl.jobs.preflight(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Err(ctl.node_error(status)),
    };
    ctl.words(&report)?;
    if json {
        print_out(&to_json(&PreflightJson::from(&report))?)
    } else {
        print_out(&fleet::preflight_report(&report))
    }
}
