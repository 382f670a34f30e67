//! `ctl watch JOB [--from POSITION] [-o json]`, and the Watch stream reader shared with
//! `submit --follow`.

use std::io::Write as _;
use std::ops::ControlFlow;
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

/// Prints every receipt of the job after `from`, until the job ends. A closed stdout (as in
/// `ctl watch 3 | head`) ends the watch quietly.
pub async fn run(ctl: &mut Controller, job_id: u64, from: u64, json: bool) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    let mut failed: Option<std::io::Error> = None;
    stream_events(ctl, job_id, from, |event| {
        let line = match event {
            Event::Receipt(r) if json => serde_json::to_string(&ReceiptJson::new(job_id, r))
                .unwrap_or_else(|e| format!("{{\"error\":\"cannot render receipt: {e}\"}}")),
            Event::Receipt(r) => render::receipt_line(r),
            Event::State(s) if !json => format!("job {job_id}: state {} ({})", s.state, s.reason),
            Event::State(_) => return ControlFlow::Continue(()),
        };
        let line = trainyard_model::text::printable(&line);
        match writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                failed = Some(e);
                ControlFlow::Break(())
            }
        }
    })
    .await?;
    match failed {
        Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Calls `on` for each event of the job's Watch stream, until `on` says stop, the controller
/// closes the stream or, once the job has reached a final state, the stream stays quiet for
/// [`DRAIN_AFTER_END`].
pub async fn stream_events(
    ctl: &mut Controller,
    job_id: u64,
    after_position: u64,
    mut on: impl FnMut(&Event) -> ControlFlow<()>,
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
            Ok(Some(msg)) => {
                ctl.words(&msg)?;
                msg.event
            }
            Ok(None) => return Ok(()),
            Err(status) => return Err(ctl.error(status, Some(job_id))),
        };
        let Some(event) = event else { continue };
        if let Event::State(s) = &event {
            ended |= is_terminal(s.state());
        }
        if on(&event).is_break() {
            return Ok(());
        }
    }
}
