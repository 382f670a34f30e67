//! A rank's stdout and stderr for `ctl logs`, read from the files the agent keeps in the rank's
//! run directory (nothing is copied to the store) and sent back as `LogData` on the stream.
//!
//! Memory stays bounded whatever the file sizes: the files are read in [`CHUNK`]-byte pieces,
//! each sent before the next is read, through the session's bounded channel (a slow controller
//! slows the reader, it does not queue the file). A request sends at most
//! `LOG_CREDIT_PIECES` pieces ahead of what its client has read (the controller grants more
//! with `LogCredit`), so a client that reads slowly costs the stream only what it reads. The tail is found by scanning back from the
//! end in blocks. With `follow`, new output is read every [`FOLLOW_EVERY`] until the rank has
//! ended (its `exit.json` exists) and both files are read to the end, or the request is stopped.

use std::io::SeekFrom;
use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use trainyard_proto::v1::agent_message::Msg as Out;
use trainyard_proto::v1::{AgentMessage, LogData, ReadLogs};
use trainyard_proto::words::LogStream;

/// Bytes per `LogData` message.
pub use trainyard_proto::limits::MAX_LOG_CHUNK_BYTES as CHUNK;
/// Most log bytes a second this agent sends, all requests together: logs share the agent's
/// stream with receipts and rank reports, so fifty open `ctl logs` of a chatty rank cannot crowd
/// the receipts out; and the controller drops a client that falls 16 MiB behind, so a dump goes
/// at a pace clients read rather than at what the disk gives.
pub const MAX_BYTES_PER_SEC: usize = 16 << 20;
/// The log budget while receipts are heavy ([`RECEIPTS_HEAVY_BYTES_PER_SEC`] or more in the last
/// second): logs yield to receipts. Measured on a 2-core controller, fifty `logs --follow`
/// clients connecting at once pulled their HTTP/2 windows (2 MiB each) through a 16 MiB/s budget
/// and cost a receipt flood a fifth of its rate; at 4 MiB/s they cost it nothing measurable.
pub const MIN_BYTES_PER_SEC: usize = 4 << 20;
/// Receipt bytes a second past which the log budget drops to [`MIN_BYTES_PER_SEC`]: a training
/// job's receipts are kilobytes a second; megabytes are a backlog or a flood being relayed.
pub const RECEIPTS_HEAVY_BYTES_PER_SEC: u64 = 4 << 20;

/// When the agent's log budget next has room for a piece (shared by every request).
static NEXT_PIECE: std::sync::Mutex<Option<tokio::time::Instant>> = std::sync::Mutex::new(None);

/// Receipt bytes sent: (start of the current one-second window, bytes in it, bytes in the
/// window before).
type Load = Option<(tokio::time::Instant, u64, u64)>;
static RECEIPT_LOAD: std::sync::Mutex<Load> = std::sync::Mutex::new(None);

/// The connection sent a batch of `bytes` of receipt bodies.
pub fn receipts_sent(bytes: usize) {
    let mut load = RECEIPT_LOAD.lock().unwrap_or_else(|p| p.into_inner());
    *load = roll(*load, tokio::time::Instant::now(), bytes as u64);
}

/// `load` with `bytes` more at `now`, moved on to a new window each second.
fn roll(load: Load, now: tokio::time::Instant, bytes: u64) -> Load {
    let second = Duration::from_secs(1);
    Some(match load {
        Some((start, current, before)) if now < start + second => (start, current + bytes, before),
        Some((start, current, _)) if now < start + 2 * second => (start + second, bytes, current),
        _ => (now, bytes, 0),
    })
}

/// Whether receipts sent in the last second or so reach [`RECEIPTS_HEAVY_BYTES_PER_SEC`].
fn heavy(load: Load, now: tokio::time::Instant) -> bool {
    let second = Duration::from_secs(1);
    match load {
        Some((start, current, before)) if now < start + second => {
            current.max(before) >= RECEIPTS_HEAVY_BYTES_PER_SEC
        }
        Some((start, current, _)) if now < start + 2 * second => current >= RECEIPTS_HEAVY_BYTES_PER_SEC,
        _ => false,
    }
}

/// The log budget now, bytes a second.
fn budget(now: tokio::time::Instant) -> usize {
    let load = *RECEIPT_LOAD.lock().unwrap_or_else(|p| p.into_inner());
    if heavy(load, now) { MIN_BYTES_PER_SEC } else { MAX_BYTES_PER_SEC }
}

/// Waits for the agent's log budget to have room for one more full piece.
async fn pace() {
    let at = {
        let now = tokio::time::Instant::now();
        let interval = Duration::from_micros(CHUNK as u64 * 1_000_000 / budget(now) as u64);
        let mut next = NEXT_PIECE.lock().unwrap_or_else(|p| p.into_inner());
        let at = next.map_or(now, |n| n.max(now));
        *next = Some(at + interval);
        at
    };
    tokio::time::sleep_until(at).await;
}

/// How often a followed rank's files are read for new output.
pub const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// The files of one rank.
#[derive(Debug, Clone)]
pub struct RankLogs {
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    /// Written by the shim when the rank ends: following stops once it exists.
    pub exit: PathBuf,
}

/// Serves `request` until it is answered, stopped, or the stream is gone; the last message has
/// `done` set, with `error` when the files cannot be read.
pub async fn serve(
    request: ReadLogs,
    files: RankLogs,
    tx: mpsc::Sender<AgentMessage>,
    stop: CancellationToken,
    credit: Arc<Semaphore>,
) {
    let id = request.request_id;
    let outcome = tokio::select! {
        _ = stop.cancelled() => return,
        outcome = stream(&request, &files, &tx, &credit) => outcome,
    };
    let error = match outcome {
        Ok(()) => String::new(),
        Err(Gone) => return,
        Err(Failed(e)) => e,
    };
    let _ = tx.send(message(LogData { request_id: id, done: true, error, ..Default::default() })).await;
    stop.cancel();
}

/// Why streaming ended early.
enum End {
    /// The stream to the controller is closed: nothing more to do.
    Gone,
    Failed(String),
}
use End::{Failed, Gone};

async fn stream(
    request: &ReadLogs,
    files: &RankLogs,
    tx: &mpsc::Sender<AgentMessage>,
    credit: &Semaphore,
) -> Result<(), End> {
    let what = format!("job {} attempt {} rank {}", request.job_id, request.attempt, request.rank);
    if !files.stdout.exists() && !files.stderr.exists() {
        return Err(Failed(format!(
            "no logs of {what} on this host ({} does not exist: the run directory was removed or the rank never started here)",
            files.stdout.display()
        )));
    }
    let mut offsets = [0u64; 2];
    let streams = [(LogStream::Stdout, &files.stdout), (LogStream::Stderr, &files.stderr)];
    for (k, (name, path)) in streams.iter().enumerate() {
        offsets[k] = tail_start(path, request.tail_lines)
            .await
            .map_err(|e| Failed(format!("{}: {e}", path.display())))?;
        offsets[k] = send_from(request.request_id, *name, path, offsets[k], tx, credit).await?;
    }
    if !request.follow {
        return Ok(());
    }
    loop {
        // Read once more after the rank ended, so its last lines are not lost.
        let ended = files.exit.exists();
        for (k, (name, path)) in streams.iter().enumerate() {
            offsets[k] = send_from(request.request_id, *name, path, offsets[k], tx, credit).await?;
        }
        if ended {
            return Ok(());
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

/// Sends `path` from `offset` to its current end in [`CHUNK`]s; returns the new offset. A file
/// that does not exist (yet) sends nothing.
async fn send_from(
    request_id: u64,
    stream: LogStream,
    path: &PathBuf,
    mut offset: u64,
    tx: &mpsc::Sender<AgentMessage>,
    credit: &Semaphore,
) -> Result<u64, End> {
    let Ok(mut file) = tokio::fs::File::open(path).await else { return Ok(offset) };
    let len = file.metadata().await.map_err(|e| Failed(format!("{}: {e}", path.display())))?.len();
    if len < offset {
        offset = 0; // truncated: start over
    }
    file.seek(SeekFrom::Start(offset)).await.map_err(|e| Failed(format!("{}: {e}", path.display())))?;
    let mut buf = vec![0u8; CHUNK];
    while offset < len {
        let want = CHUNK.min((len - offset) as usize);
        let n = file.read(&mut buf[..want]).await.map_err(|e| Failed(format!("{}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        offset += n as u64;
        let data =
            LogData { request_id, stream: stream.to_string(), data: buf[..n].to_vec(), ..Default::default() };
        // One piece of the client's credit (granted back as it reads), then the agent's budget.
        credit.acquire().await.map_err(|_| Gone)?.forget();
        if n == CHUNK {
            pace().await;
        }
        tx.send(message(data)).await.map_err(|_| Gone)?;
    }
    Ok(offset)
}

/// Where the last `lines` lines of `path` start (0 for the whole file, or a missing one),
/// scanning back from the end one [`CHUNK`] at a time.
async fn tail_start(path: &PathBuf, lines: u32) -> std::io::Result<u64> {
    if lines == 0 {
        return Ok(0);
    }
    let Ok(mut file) = tokio::fs::File::open(path).await else { return Ok(0) };
    let len = file.metadata().await?.len();
    let mut end = len;
    // A final newline ends the last line rather than starting an empty one.
    let mut newlines = 0u32;
    let mut buf = vec![0u8; CHUNK];
    let mut skip_final = true;
    while end > 0 {
        let start = end.saturating_sub(CHUNK as u64);
        let n = (end - start) as usize;
        file.seek(SeekFrom::Start(start)).await?;
        file.read_exact(&mut buf[..n]).await?;
        for i in (0..n).rev() {
            if buf[i] != b'\n' {
                skip_final = false;
                continue;
            }
            if skip_final {
                skip_final = false;
                continue;
            }
            newlines += 1;
            if newlines == lines {
                return Ok(start + i as u64 + 1);
            }
        }
        end = start;
    }
    Ok(0)
}

fn message(data: LogData) -> AgentMessage {
    AgentMessage { msg: Some(Out::LogData(data)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &std::path::Path) -> RankLogs {
        RankLogs {
            stdout: dir.join("stdout.log"),
            stderr: dir.join("stderr.log"),
            exit: dir.join("exit.json"),
        }
    }

    async fn collect(rx: &mut mpsc::Receiver<AgentMessage>) -> (String, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        loop {
            let Some(AgentMessage { msg: Some(Out::LogData(d)) }) = rx.recv().await else {
                panic!("stream ended early")
            };
            if d.done {
                return (String::from_utf8(out).unwrap(), String::from_utf8(err).unwrap(), d.error);
            }
            match d.stream().expect("a known stream") {
                Some(LogStream::Stdout) => out.extend(d.data),
                _ => err.extend(d.data),
            }
        }
    }

    fn plenty() -> Arc<Semaphore> {
        Arc::new(Semaphore::new(100_000))
    }

    fn request(tail_lines: u32, follow: bool) -> ReadLogs {
        ReadLogs {
            request_id: 7,
            job_id: 1,
            attempt: 0,
            rank: 3,
            tail_lines,
            follow,
            run_name: String::new(),
        }
    }

    #[tokio::test]
    async fn whole_files_tails_and_a_missing_run_directory() {
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        // Several chunks, so the tail scan crosses block boundaries.
        let big: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&f.stdout, &big).unwrap();
        std::fs::write(&f.stderr, "warning\nno newline at the end").unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        tokio::spawn(serve(request(0, false), f.clone(), tx, CancellationToken::new(), plenty()));
        let (out, err, error) = collect(&mut rx).await;
        assert_eq!(
            (out.len(), err.as_str(), error.as_str()),
            (big.len(), "warning\nno newline at the end", "")
        );

        let (tx, mut rx) = mpsc::channel(4);
        tokio::spawn(serve(request(3, false), f.clone(), tx, CancellationToken::new(), plenty()));
        let (out, err, _) = collect(&mut rx).await;
        assert_eq!(out, "line 19997\nline 19998\nline 19999\n");
        assert_eq!(err, "warning\nno newline at the end", "fewer lines than asked: the whole file");

        let (tx, mut rx) = mpsc::channel(4);
        let gone = files(&dir.path().join("nope"));
        tokio::spawn(serve(request(0, false), gone, tx, CancellationToken::new(), plenty()));
        let (_, _, error) = collect(&mut rx).await;
        assert!(error.starts_with("no logs of job 1 attempt 0 rank 3 on this host"), "{error}");
    }

    /// Following: output written later arrives, and the stream ends once the rank has ended.
    #[tokio::test]
    async fn follow_streams_new_output_until_the_rank_ends() {
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        std::fs::write(&f.stdout, "first\n").unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        tokio::spawn(serve(request(0, true), f.clone(), tx, CancellationToken::new(), plenty()));
        let writer = f.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            std::fs::write(&writer.stdout, "first\nsecond\n").unwrap();
            std::fs::write(&writer.stderr, "oops\n").unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            std::fs::write(&writer.exit, "{}").unwrap();
        });
        let (out, err, error) =
            tokio::time::timeout(Duration::from_secs(10), collect(&mut rx)).await.unwrap();
        assert_eq!((out.as_str(), err.as_str(), error.as_str()), ("first\nsecond\n", "oops\n", ""));
    }

    /// A request sends only as many pieces as it has credit for; more credit, more pieces.
    #[tokio::test]
    async fn pieces_wait_for_credit() {
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        std::fs::write(&f.stdout, vec![b'x'; 5 * CHUNK]).unwrap();
        let credit = Arc::new(Semaphore::new(2));
        let (tx, mut rx) = mpsc::channel(16);
        tokio::spawn(serve(request(0, false), f.clone(), tx, CancellationToken::new(), credit.clone()));
        let mut pieces = 0;
        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await {
            pieces += 1;
        }
        assert_eq!(pieces, 2, "two pieces of credit, two pieces");
        credit.add_permits(10);
        let (out, _, error) = tokio::time::timeout(Duration::from_secs(10), collect(&mut rx)).await.unwrap();
        assert_eq!((out.len(), error.as_str()), (3 * CHUNK, ""), "the rest once credit came");
    }

    #[test]
    fn the_log_budget_drops_while_receipts_are_heavy_and_comes_back() {
        let t0 = tokio::time::Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let heavy_bytes = RECEIPTS_HEAVY_BYTES_PER_SEC;
        assert!(!heavy(None, t0), "no receipts yet");
        let light = roll(roll(None, s(0), 1 << 20), s(500), 1 << 20);
        assert!(!heavy(light, s(600)), "2 MiB in a second is light");
        let load = roll(light, s(900), heavy_bytes);
        assert!(heavy(load, s(950)), "past the threshold within the second");
        assert!(heavy(load, s(1_500)), "the second after a heavy one");
        let next = roll(load, s(1_200), 1_000);
        assert!(heavy(next, s(1_300)), "the window before was heavy");
        assert!(!heavy(next, s(2_300)), "two quiet seconds later");
        assert!(!heavy(load, s(2_500)), "a stale heavy window is forgotten");
    }
}
