//! Preemption notices: the agent watches a source the operator names and tells the controller
//! when this host is about to be taken away, so the jobs here checkpoint and move first (the AWS
//! spot notice gives 2 minutes, GCP 30 s).
//!
//! A source is one of:
//! - `file:PATH`: a file a cloud's metadata handler writes; its appearing is the notice, its
//!   first line the detail;
//! - `http://HOST:PORT/PATH`: a local endpoint (a metadata server or a proxy of one), polled with
//!   a GET; a 200 answer whose body is not empty, `false` or `FALSE` is the notice (GCP's
//!   `instance/preempted` says `TRUE`, AWS's `spot/instance-action` answers 404 until a notice);
//! - `cmd:PROGRAM [ARGS...]`: a command run at every poll; exit 0 with output is the notice.
//!
//! [`NoticeSource::parse`] refuses a source that cannot work (an unknown scheme, a file in a
//! directory that does not exist, a program that is not there) or that others could forge (a
//! file in a directory anyone but root or the agent's account may write) with the reason, so
//! the agent does not start with a watch that would never fire, or fire for anyone. A notice
//! file is read without following links, only when it is a regular file of root or the agent's
//! account, at most 512 bytes. A poll that fails later (the endpoint
//! down) is logged and tried again; it never stops the agent.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use trainyard_proto::v1::Notice;

/// At most this much of a notice is kept as its detail.
const MAX_DETAIL: usize = 512;
/// A poll that takes longer than this counts as failed.
const POLL_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoticeSource {
    File(PathBuf),
    Http { host: String, port: u16, path: String },
    Command(Vec<String>),
}

impl NoticeSource {
    /// Parses and checks `--preemption-notice`.
    pub fn parse(text: &str) -> Result<NoticeSource, String> {
        let bad = |why: String| Err(format!("--preemption-notice {text:?}: {why}"));
        if let Some(path) = text.strip_prefix("file:") {
            let path = PathBuf::from(path);
            if !path.is_absolute() {
                return bad("give an absolute path".into());
            }
            let dir = path.parent().unwrap_or(Path::new("/"));
            if std::fs::read_dir(dir).is_err() {
                return bad(format!("its directory {} cannot be read", dir.display()));
            }
            if let Err(why) = trusted_dir(dir) {
                return bad(why);
            }
            return Ok(NoticeSource::File(path));
        }
        if let Some(rest) = text.strip_prefix("http://") {
            let (authority, path) =
                rest.split_once('/').map_or((rest, "/".to_string()), |(a, p)| (a, format!("/{p}")));
            let Some((host, port)) = authority.rsplit_once(':') else {
                return bad(
                    "give host:port, e.g. http://169.254.169.254:80/latest/meta-data/spot/instance-action"
                        .into(),
                );
            };
            let Ok(port) = port.parse::<u16>() else { return bad(format!("{port:?} is not a port")) };
            if host.is_empty() {
                return bad("no host".into());
            }
            return Ok(NoticeSource::Http { host: host.to_string(), port, path });
        }
        if let Some(command) = text.strip_prefix("cmd:") {
            let argv: Vec<String> = command.split_whitespace().map(str::to_string).collect();
            let Some(program) = argv.first() else { return bad("no command".into()) };
            if !program_exists(program) {
                return bad(format!("{program} is not an executable file here"));
            }
            return Ok(NoticeSource::Command(argv));
        }
        bad("expected file:PATH, http://HOST:PORT/PATH or cmd:PROGRAM ARGS".into())
    }

    /// One poll: `Ok(Some(detail))` when the host is being taken away.
    pub async fn poll(&self) -> Result<Option<String>, String> {
        match tokio::time::timeout(POLL_TIMEOUT, self.poll_once()).await {
            Ok(result) => result,
            Err(_) => Err(format!("no answer within {} s", POLL_TIMEOUT.as_secs())),
        }
    }

    async fn poll_once(&self) -> Result<Option<String>, String> {
        match self {
            NoticeSource::File(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || read_notice_file(&path))
                    .await
                    .map_err(|e| format!("read the notice file: {e}"))?
            }
            NoticeSource::Http { host, port, path } => {
                let (status, body) = http_get(host, *port, path).await?;
                let text = String::from_utf8_lossy(&body).trim().to_string();
                let says_no = text.is_empty() || text.eq_ignore_ascii_case("false");
                Ok((status == 200 && !says_no).then(|| detail(&body, "")))
            }
            NoticeSource::Command(argv) => {
                let out = tokio::process::Command::new(&argv[0])
                    .args(&argv[1..])
                    .kill_on_drop(true)
                    .output()
                    .await
                    .map_err(|e| format!("run {}: {e}", argv[0]))?;
                Ok((out.status.success() && !out.stdout.is_empty()).then(|| detail(&out.stdout, "")))
            }
        }
    }
}

/// Who may own a notice file and its directory: root, or the account the agent runs as.
fn trusted_owner(uid: u32) -> bool {
    uid == 0 || uid == crate::account::effective_uid()
}

/// A notice file's directory must be one nobody else can write: otherwise a local user could
/// plant the notice (draining the node) or link it to a file only root may read.
fn trusted_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(dir).map_err(|e| format!("its directory {}: {e}", dir.display()))?;
    if !trusted_owner(m.uid()) {
        return Err(format!(
            "its directory {} belongs to uid {}, not root or this agent's account: another user could plant the notice",
            dir.display(),
            m.uid()
        ));
    }
    if m.mode() & 0o022 != 0 {
        return Err(format!(
            "its directory {} is writable by others (mode {:o}): another user could plant the notice or link it elsewhere; \
             give the agent a directory only root writes, e.g. /run/trainyard",
            dir.display(),
            m.mode() & 0o7777
        ));
    }
    Ok(())
}

/// The notice file at `path`, read safely: never through a link, only a regular file owned by
/// root or the agent's account, never blocking (a FIFO), at most [`MAX_DETAIL`] bytes.
/// `Ok(None)` while there is none; `Err` (logged, no notice) for anything else there.
fn read_notice_file(path: &Path) -> Result<Option<String>, String> {
    use std::io::Read as _;
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(format!("{} is a symbolic link: ignored, not a notice", path.display()));
        }
        Err(e) => return Err(format!("read {}: {e}", path.display())),
    };
    let m = file.metadata().map_err(|e| format!("read {}: {e}", path.display()))?;
    if !m.is_file() {
        return Err(format!("{} is not a regular file: ignored, not a notice", path.display()));
    }
    if !trusted_owner(m.uid()) {
        return Err(format!(
            "{} belongs to uid {}, not root or this agent's account: ignored, not a notice",
            path.display(),
            m.uid()
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_DETAIL as u64)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("read {}: {e}", path.display()))?;
    Ok(Some(detail(&bytes, "notice file present")))
}

fn detail(bytes: &[u8], empty: &str) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_DETAIL)]);
    let line = text.lines().next().unwrap_or("").trim();
    if line.is_empty() { empty.to_string() } else { line.to_string() }
}

fn program_exists(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    let runnable =
        |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') {
        return runnable(Path::new(program));
    }
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| runnable(&dir.join(program))))
        .unwrap_or(false)
}

/// A minimal HTTP/1.0 GET (a local metadata endpoint; no TLS, no redirects): status and body.
async fn http_get(host: &str, port: u16, path: &str) -> Result<(u16, Vec<u8>), String> {
    let mut stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("connect {host}:{port}: {e}"))?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nMetadata-Flavor: Google\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(|e| format!("send to {host}:{port}: {e}"))?;
    let mut answer = Vec::new();
    stream
        .take(64 * 1024)
        .read_to_end(&mut answer)
        .await
        .map_err(|e| format!("read from {host}:{port}: {e}"))?;
    let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n").ok_or("an answer without headers")?;
    let head = String::from_utf8_lossy(&answer[..head_end]);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {:?}", head.lines().next().unwrap_or("")))?;
    Ok((status, answer[head_end + 4..].to_vec()))
}

/// Polls `source` every `every` until a notice comes, then publishes it on `found` with its
/// deadline, `deadline` from now (once; the connection sends it, and again after a reconnect).
pub async fn watch(
    source: NoticeSource,
    every: Duration,
    deadline: Duration,
    found: tokio::sync::watch::Sender<Option<Notice>>,
) {
    let mut failing = false;
    loop {
        match source.poll().await {
            Ok(Some(detail)) => {
                tracing::warn!(
                    detail,
                    deadline_s = deadline.as_secs(),
                    "preemption notice: telling the controller"
                );
                let now =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                let deadline_ms = (now + deadline).as_millis() as i64;
                let _ = found.send(Some(Notice { kind: "preemption".into(), deadline_ms, detail }));
                return;
            }
            Ok(None) => failing = false,
            Err(e) if !failing => {
                tracing::warn!(error = %e, "cannot poll the preemption notice source; trying again");
                failing = true;
            }
            Err(_) => {}
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_that_cannot_work_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("notice");
        assert_eq!(NoticeSource::parse(&format!("file:{}", file.display())), Ok(NoticeSource::File(file)));
        let cases = [
            ("file:/no/such/dir/notice", "cannot be read"),
            ("file:relative", "absolute path"),
            ("http://metadata/x", "host:port"),
            ("http://127.0.0.1:http/x", "not a port"),
            ("cmd:/no/such/program", "not an executable file"),
            ("ftp://x", "expected file:PATH"),
        ];
        for (text, words) in cases {
            let e = NoticeSource::parse(text).unwrap_err();
            assert!(e.contains(words) && e.contains(text), "{text}: {e}");
        }
        let http =
            NoticeSource::parse("http://127.0.0.1:8080/computeMetadata/v1/instance/preempted").unwrap();
        assert_eq!(
            http,
            NoticeSource::Http {
                host: "127.0.0.1".into(),
                port: 8080,
                path: "/computeMetadata/v1/instance/preempted".into()
            }
        );
    }

    /// A notice file is the operator's: in a directory others can write, it is refused at
    /// start; a link, a FIFO, or a file another user owns is no notice; a long one is cut.
    #[tokio::test]
    async fn a_notice_file_is_read_only_when_nobody_else_could_have_put_it_there() {
        use std::os::unix::fs::PermissionsExt as _;
        let open = tempfile::tempdir().unwrap();
        std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let text = format!("file:{}", open.path().join("notice").display());
        let e = NoticeSource::parse(&text).unwrap_err();
        assert!(e.contains("writable by others") && e.contains("1777"), "{e}");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notice");
        let file = NoticeSource::File(path.clone());
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "root-only first line\n").unwrap();
        std::os::unix::fs::symlink(&secret, &path).unwrap();
        let e = file.poll().await.unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::remove_file(&path).unwrap();

        let fifo = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo on a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = file.poll().await.unwrap_err();
        assert!(e.contains("not a regular file"), "a FIFO neither blocks nor counts: {e}");
        std::fs::remove_file(&path).unwrap();

        std::fs::write(&path, "x".repeat(100_000)).unwrap();
        assert_eq!(file.poll().await.unwrap().unwrap().len(), MAX_DETAIL, "a bounded prefix");
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
            let e = file.poll().await.unwrap_err();
            assert!(e.contains("uid 65534"), "{e}");
        }
    }

    #[tokio::test]
    async fn a_file_an_endpoint_and_a_command_each_give_the_notice() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notice");
        let file = NoticeSource::File(path.clone());
        assert_eq!(file.poll().await, Ok(None));
        std::fs::write(&path, "spot: terminate at 12:00\n").unwrap();
        assert_eq!(file.poll().await, Ok(Some("spot: terminate at 12:00".into())));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let answers =
            ["HTTP/1.0 200 OK\r\n\r\nFALSE", "HTTP/1.0 404 Not Found\r\n\r\n", "HTTP/1.0 200 OK\r\n\r\nTRUE"];
        tokio::spawn(async move {
            for answer in answers {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 512];
                let _ = s.read(&mut buf).await;
                s.write_all(answer.as_bytes()).await.unwrap();
            }
        });
        let http = NoticeSource::Http { host: "127.0.0.1".into(), port, path: "/preempted".into() };
        assert_eq!(http.poll().await, Ok(None), "FALSE is no notice");
        assert_eq!(http.poll().await, Ok(None), "404 is no notice");
        assert_eq!(http.poll().await, Ok(Some("TRUE".into())));

        let quiet = NoticeSource::parse("cmd:true").unwrap();
        assert_eq!(quiet.poll().await, Ok(None), "no output: no notice");
        let loud = NoticeSource::Command(vec!["echo".into(), "preempted".into()]);
        assert_eq!(loud.poll().await, Ok(Some("preempted".into())));
    }
}
