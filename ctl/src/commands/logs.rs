//! `ctl logs JOB [--rank R] [--tail N] [--follow]`: a rank's stdout and stderr, read by its
//! agent from the files it keeps; stdout goes to stdout and stderr to stderr, as the rank wrote
//! them (a terminal sees its controls written out, never acted on).

use std::io::{IsTerminal as _, Write as _};

use trainyard_proto::v1::LogsRequest;

use crate::client::Controller;
use trainyard_proto::words::LogStream;

pub async fn run(
    ctl: &mut Controller,
    job_id: u64,
    rank: u32,
    tail: u32,
    follow: bool,
) -> anyhow::Result<()> {
    let request = LogsRequest { job_id, rank, tail_lines: tail, follow };
    let mut stream = match ctl.jobs.logs(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Err(ctl.error(status, Some(job_id))),
    };
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => {
                ctl.words(&chunk)?;
                let written = if chunk.stream() == Ok(LogStream::Stderr) {
                    let data = on_terminal(&chunk.data, std::io::stderr().is_terminal());
                    std::io::stderr().write_all(&data)
                } else {
                    let data = on_terminal(&chunk.data, std::io::stdout().is_terminal());
                    std::io::stdout().write_all(&data).and_then(|()| std::io::stdout().flush())
                };
                // A closed pipe (`ctl logs 3 | head`) ends the command quietly.
                if written.is_err() {
                    return Ok(());
                }
            }
            Ok(None) => return Ok(()),
            Err(status) => return Err(ctl.error(status, Some(job_id))),
        }
    }
}

/// A rank's output as written when it goes to a file or a pipe; on a terminal, its controls
/// shown as `\uXXXX` rather than acted on (a job must not rewrite the screen of whoever reads
/// its logs). A chunk may end inside a UTF-8 character: the cut bytes pass unchanged.
fn on_terminal(data: &[u8], terminal: bool) -> std::borrow::Cow<'_, [u8]> {
    if !terminal {
        return std::borrow::Cow::Borrowed(data);
    }
    let text = String::from_utf8_lossy(data);
    std::borrow::Cow::Owned(trainyard_model::text::printable(&text).into_owned().into_bytes())
}
