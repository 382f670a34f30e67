//! `ctl logs JOB [--rank R] [--tail N] [--follow]`: a rank's stdout and stderr, read by its
//! agent from the files it keeps; stdout goes to stdout and stderr to stderr, as the rank wrote
//! them.

use std::io::Write;

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
                    std::io::stderr().write_all(&chunk.data)
                } else {
                    std::io::stdout().write_all(&chunk.data).and_then(|()| std::io::stdout().flush())
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
