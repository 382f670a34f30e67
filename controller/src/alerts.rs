//! Alert webhooks (`--alert-webhook URL`, repeatable): one JSON POST per live finding opened
//! and one per finding closed, with a Slack-compatible `text` and the finding's fields, so a
//! Slack incoming webhook, an Alertmanager-style receiver or a script all read it.
//!
//! Delivery is at least once per target: a target that does not answer 2xx within
//! [`TIMEOUT`] is tried again with a doubling delay (1 s up to [`RETRY_CAP`]); the store records
//! when a finding's opening and closing alerts were delivered to every target, so a restarted
//! controller sends only what was not delivered. Receivers deduplicate on `id` and `event`.
//!
//! A small HTTP/1.1 client over Tokio (plain, or TLS through the rustls the controller already
//! serves with, trusting the system's CA bundle or `--alert-ca-file`): a POST of one small
//! body needs no more, and no HTTP client crate has to be built for it.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use trainyard_store::LiveFinding;

/// How long one delivery may take.
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// The longest wait between two tries of one delivery.
pub const RETRY_CAP: Duration = Duration::from_secs(60);
/// Where Debian keeps the system's CA bundle.
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A webhook target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub https: bool,
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl Target {
    /// Parses `http://HOST[:PORT]/PATH` or `https://...`; the error says what is wrong.
    pub fn parse(url: &str) -> Result<Target, String> {
        let bad = |why: &str| format!("--alert-webhook {:?}: {why}", mask_path(url));
        let (https, rest) = match url.split_once("://") {
            Some(("http", rest)) => (false, rest),
            Some(("https", rest)) => (true, rest),
            _ => return Err(bad("give an http:// or https:// URL")),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.contains('@') {
            return Err(bad("credentials in the URL are not supported; put a token in the path"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
                (h, p.parse::<u16>().map_err(|_| bad("the port is not a number"))?)
            }
            _ => (authority, if https { 443 } else { 80 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Target { https, host: host.to_string(), port, path: path.to_string() })
    }

    /// The URL as logs and errors show it: the path (where Slack and friends keep the token)
    /// masked.
    fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        mask_path(&format!("{scheme}://{}:{}{}", self.host, self.port, self.path))
    }
}

/// `url` with everything after the host masked (`https://hooks.example:443/***`): a webhook's
/// path is its secret.
pub fn mask_path(url: &str) -> String {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(i) if after_scheme + i + 1 < url.len() => format!("{}/***", &url[..after_scheme + i]),
        _ => url.to_string(),
    }
}

/// The body of an alert.
#[derive(Debug, Serialize)]
pub struct Alert<'a> {
    /// Slack's field: one line for people.
    pub text: String,
    /// `opened` or `closed`.
    pub event: &'static str,
    pub id: u64,
    pub job_id: u64,
    pub attempt: u32,
    pub cause: &'a str,
    pub subject: &'a str,
    pub nodes: &'a [String],
    pub ranks: &'a [u32],
    pub summary: &'a str,
    pub evidence: &'a str,
    pub remedy: &'a str,
    pub opened_at_ms: i64,
    pub closed_at_ms: Option<i64>,
}

impl<'a> Alert<'a> {
    pub fn of(f: &'a LiveFinding, opening: bool) -> Alert<'a> {
        let text = if opening {
            format!("trainyard: job {} {} — {}. Remedy: {}", f.job_id, f.cause, f.summary, f.remedy)
        } else {
            let lasted = f.closed_at_ms.unwrap_or(f.updated_at_ms) - f.opened_at_ms;
            format!(
                "trainyard: job {} {} resolved after {:.0} s — {}",
                f.job_id,
                f.cause,
                lasted as f64 / 1000.0,
                f.summary
            )
        };
        Alert {
            text,
            event: if opening { "opened" } else { "closed" },
            id: f.id,
            job_id: f.job_id,
            attempt: f.attempt,
            cause: &f.cause,
            subject: &f.subject,
            nodes: &f.nodes,
            ranks: &f.ranks,
            summary: &f.summary,
            evidence: &f.evidence,
            remedy: &f.remedy,
            opened_at_ms: f.opened_at_ms,
            closed_at_ms: f.closed_at_ms,
        }
    }
}

/// Posts alerts to the configured targets.
#[derive(Clone)]
pub struct Webhooks {
    targets: Vec<Target>,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl Webhooks {
    /// The targets of `urls`; TLS roots come from `ca_file` (default: the system bundle), read
    /// only when a target is https. The error names the URL or file that is wrong.
    pub fn new(urls: &[String], ca_file: Option<&std::path::Path>) -> Result<Webhooks, String> {
        let targets = urls.iter().map(|u| Target::parse(u)).collect::<Result<Vec<_>, _>>()?;
        let tls = if targets.iter().any(|t| t.https) {
            let path = ca_file.unwrap_or(std::path::Path::new(SYSTEM_CA_BUNDLE));
            let pem = std::fs::read(path)
                .map_err(|e| format!("read the CA bundle for https webhooks {}: {e}", path.display()))?;
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| format!("CA bundle {}: {e}", path.display()))?;
                roots.add(cert).map_err(|e| format!("CA bundle {}: {e}", path.display()))?;
            }
            if roots.is_empty() {
                return Err(format!("CA bundle {} holds no certificate", path.display()));
            }
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
            Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
        } else {
            None
        };
        Ok(Webhooks { targets, tls })
    }

    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// Posts `alert` to target `i`; the error says what went wrong, for the log.
    pub async fn post(&self, i: usize, alert: &Alert<'_>) -> Result<(), String> {
        let target = &self.targets[i];
        let body = serde_json::to_vec(alert).map_err(|e| e.to_string())?;
        match tokio::time::timeout(TIMEOUT, self.exchange(target, &body)).await {
            Ok(Ok(status)) if (200..300).contains(&status) => Ok(()),
            Ok(Ok(status)) => Err(format!("{} answered HTTP {status}", target.url())),
            Ok(Err(e)) => Err(format!("{}: {e}", target.url())),
            Err(_) => Err(format!("{}: no answer within {TIMEOUT:?}", target.url())),
        }
    }

    async fn exchange(&self, t: &Target, body: &[u8]) -> std::io::Result<u16> {
        let tcp = tokio::net::TcpStream::connect((t.host.as_str(), t.port)).await?;
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             User-Agent: trainyard/{}\r\nConnection: close\r\n\r\n",
            t.path,
            t.host,
            body.len(),
            env!("CARGO_PKG_VERSION")
        );
        match (&self.tls, t.https) {
            (Some(tls), true) => {
                let name = ServerName::try_from(t.host.clone())
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
                let stream = tls.connect(name, tcp).await?;
                round_trip(stream, head.as_bytes(), body).await
            }
            _ => round_trip(tcp, head.as_bytes(), body).await,
        }
    }
}

/// Sends the request and reads the status line of the answer.
async fn round_trip<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
    head: &[u8],
    body: &[u8],
) -> std::io::Result<u16> {
    s.write_all(head).await?;
    s.write_all(body).await?;
    s.flush().await?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !answer.windows(2).any(|w| w == b"\r\n") && answer.len() < 8192 {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&answer);
    let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    status.ok_or_else(|| {
        let first = line.lines().next().unwrap_or("").to_string();
        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not an HTTP answer: {first:?}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_bad_ones_say_why() {
        assert_eq!(
            Target::parse("https://hooks.slack.com/services/T0/B0/xyz").unwrap(),
            Target {
                https: true,
                host: "hooks.slack.com".into(),
                port: 443,
                path: "/services/T0/B0/xyz".into()
            }
        );
        assert_eq!(Target::parse("http://127.0.0.1:9099").unwrap().path, "/");
        assert_eq!(Target::parse("http://[::1]:8080/a").unwrap().host, "::1");
        for (url, says) in [
            ("ftp://x/y", "http:// or https://"),
            ("http://:80/", "no host"),
            ("http://h:port/", "not a number"),
            ("https://user:pw@h/", "credentials"),
        ] {
            let err = Target::parse(url).unwrap_err();
            assert!(err.contains(says), "{url}: {err}");
        }
        // The path is the secret: never printed.
        let err = Target::parse("https://user:pw@hooks.slack.com/services/T0/B0/xyz").unwrap_err();
        assert!(!err.contains("xyz") && err.contains("/***"), "{err}");
        let t = Target::parse("https://hooks.slack.com/services/T0/B0/xyz").unwrap();
        assert_eq!(t.url(), "https://hooks.slack.com:443/***");
        assert_eq!(mask_path("http://127.0.0.1:9099/"), "http://127.0.0.1:9099/");
    }

    #[test]
    fn an_alert_carries_slack_text_and_the_finding() {
        let f = LiveFinding {
            id: 4,
            job_id: 7,
            cause: "gpu.thermal_throttle".into(),
            summary: "GPU 3 of b throttled".into(),
            remedy: "check cooling".into(),
            opened_at_ms: 1_000,
            closed_at_ms: Some(31_000),
            ..Default::default()
        };
        let open = serde_json::to_value(Alert::of(&f, true)).unwrap();
        assert_eq!(open["event"], "opened");
        assert_eq!(
            open["text"],
            "trainyard: job 7 gpu.thermal_throttle — GPU 3 of b throttled. Remedy: check cooling"
        );
        let closed = serde_json::to_value(Alert::of(&f, false)).unwrap();
        assert_eq!(closed["event"], "closed");
        assert!(closed["text"].as_str().unwrap().contains("resolved after 30 s"), "{closed}");
    }

    #[tokio::test]
    async fn a_post_reaches_a_local_receiver_and_a_refusal_is_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let mut got = Vec::new();
            for status in ["204 No Content", "500 Oops"] {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut request = Vec::new();
                let mut buf = vec![0u8; 8192];
                // Head, then as many body bytes as Content-Length says.
                while !String::from_utf8_lossy(&request).contains("}") {
                    let n = s.read(&mut buf).await.unwrap();
                    assert!(n > 0, "the request ended early");
                    request.extend_from_slice(&buf[..n]);
                }
                got.push(String::from_utf8_lossy(&request).to_string());
                s.write_all(format!("HTTP/1.1 {status}\r\n\r\n").as_bytes()).await.unwrap();
            }
            got
        });
        let hooks = Webhooks::new(&[format!("http://127.0.0.1:{port}/hook")], None).unwrap();
        let f = LiveFinding { id: 1, cause: "gpu.xid".into(), ..Default::default() };
        hooks.post(0, &Alert::of(&f, true)).await.unwrap();
        let err = hooks.post(0, &Alert::of(&f, false)).await.unwrap_err();
        assert!(err.contains("answered HTTP 500"), "{err}");
        let got = server.await.unwrap();
        assert!(
            got[0].starts_with("POST /hook HTTP/1.1\r\n") && got[0].contains("\"event\":\"opened\""),
            "{}",
            got[0]
        );
    }
}
