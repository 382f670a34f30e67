//! `ctl watch JOB [--from POSITION] [-o json]`, and the Watch stream reader shared with
//! `submit --follow`.

use std::time::Duration;

use trainyard_proto::v1::{WatchRequest, watch_event::Event};

use super::is_terminal;
use crate::client::Controller;
use crate::output::ReceiptJson;
use crate::render;

/// The controller closes the stream once the job has ended and all its ranks have stopped
/// (ranks of a failed or cancelled job may still write their last receipts after the final
/// state). This is only the safety net: how long a quiet stream is waited on after that.
const DRAIN_AFTER_END: Duration = Duration::from_secs(10);

/// Prints every receipt of the job after `from`, until the job ends.
pub async fn run(ctl: &mut Controller, job_id: u64, from: u64, json: bool) -> anyhow::Result<()> {
    let mut out_err = None;
    stream_events(ctl, job_id, from, |event| match event {
        Event::Receipt(r) if json => match serde_json::to_string(&ReceiptJson::new(job_id, r)) {
            Ok(line) => println!("{line}"),
            Err(e) => out_err = Some(e),
        },
        Event::Receipt(r) => println!("{}", render::receipt_line(r)),
        Event::State(s) if !json => {
            println!("job {job_id}: state {} ({})", s.state, s.reason);
        }
        Event::State(_) => {}
    })
    .await?;
    match out_err {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// Calls `on` for each event of the job's Watch stream, until the controller closes it or,
/// once the job has reached a final state, the stream stays quiet for [`DRAIN_AFTER_END`].
pub async fn stream_events(
    ctl: &mut Controller,
    job_id: u64,
    after_position: u64,
    mut on: impl FnMut(&Event),
) -> anyhow::Result<()> {
    let request = WatchRequest { job_id, after_position };
    let mut stream = match ctl.jobs.watch(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Err(ctl.error(status, Some(job_id))),
    };
    let mut ended = false;
    loop {
        let next = if ended {
            match tokio::time::timeout(DRAIN_AFTER_END, stream.message()).await {
                Ok(next) => next,
                Err(_) => return Ok(()),
            }
        } else {
            stream.message().await
        };
        let event = match next {
            Ok(Some(msg)) => msg.event,
            Ok(None) => return Ok(()),
            Err(status) => return Err(ctl.error(status, Some(job_id))),
        };
        let Some(event) = event else { continue };
        if let Event::State(s) = &event {
            ended |= is_terminal(&s.state);
        }
        on(&event);
    }
}
