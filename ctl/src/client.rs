//! The connection to the controller, and the one place where gRPC failures become sentences
//! an operator can act on.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};
use trainyard_proto::typed::Words;
use trainyard_proto::v1::LeaderRequest;
use trainyard_proto::v1::jobs_client::JobsClient;

/// A connected Jobs client that remembers the address, for the error messages.
pub struct Controller {
    pub jobs: JobsClient<InterceptedService<Channel, Bearer>>,
    pub url: String,
}

/// What ctl proves itself with: the CA it trusts the controller's certificate from, and the
/// user's token.
#[derive(Debug, Default)]
pub struct Credentials {
    pub ca: Option<PathBuf>,
    pub token: Option<String>,
}

impl Credentials {
    /// The token from `TRAINYARD_TOKEN`, else `token_file`, else `~/.config/trainyard/token`
    /// when it exists; none is fine for the loopback demo.
    pub fn from_env(ca: Option<PathBuf>, token_file: Option<PathBuf>) -> anyhow::Result<Self> {
        let token = match std::env::var("TRAINYARD_TOKEN").ok().filter(|t| !t.trim().is_empty()) {
            Some(token) => Some(token.trim().to_string()),
            None => {
                let default = std::env::var_os("HOME")
                    .map(|h| PathBuf::from(h).join(".config/trainyard/token"))
                    .filter(|p| p.is_file());
                match token_file.or(default) {
                    Some(path) => Some(
                        std::fs::read_to_string(&path)
                            .with_context(|| format!("read the token file {}", path.display()))?
                            .trim()
                            .to_string(),
                    ),
                    None => None,
                }
            }
        };
        Ok(Credentials { ca, token })
    }
}

/// Adds `authorization: Bearer TOKEN` to every call.
#[derive(Clone)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// Connects to the controller at `urls`: one URL, or several separated by commas (a controller
/// group on PostgreSQL): the first that answers, leader or follower (both serve reads). Fails
/// with the "cannot reach" message when nobody answers.
pub async fn connect(urls: &str, credentials: &Credentials) -> anyhow::Result<Controller> {
    let list: Vec<&str> = urls.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
    if list.is_empty() {
        anyhow::bail!("--controller {urls:?} names no URL");
    }
    let dials = resolve(&list).await;
    let (last, first) = dials.split_last().expect("one per URL at least");
    for (url, name) in first {
        if let Ok(controller) = connect_one(url, name.as_deref(), credentials).await {
            return Ok(controller);
        }
    }
    connect_one(&last.0, last.1.as_deref(), credentials).await
}

/// Each URL whose host is a DNS name expanded into every address the name resolves to (one
/// name for a whole controller group), with the name TLS checks; a name that does not resolve
/// is kept, so the error names it.
async fn resolve(urls: &[&str]) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for url in urls {
        let expanded = match trainyard_proto::contract::dns_name(url) {
            Some((host, port)) => match tokio::net::lookup_host((host, port)).await {
                Ok(addrs) => {
                    let addrs: Vec<std::net::SocketAddr> = addrs.collect();
                    let urls = trainyard_proto::contract::expand_url(url, &addrs);
                    urls.into_iter().map(|u| (u, Some(host.to_string()))).collect()
                }
                Err(_) => Vec::new(),
            },
            None => Vec::new(),
        };
        if expanded.is_empty() {
            out.push((url.to_string(), None));
        } else {
            out.extend(expanded);
        }
    }
    out
}

/// Connects to the controller that leads `urls`' group, for a call that writes: the first
/// that answers, or the leader it names when it follows. A lone controller always leads.
pub async fn connect_leader(urls: &str, credentials: &Credentials) -> anyhow::Result<Controller> {
    let ctl = connect(urls, credentials).await?;
    let reply = match ctl.jobs.clone().leader(LeaderRequest {}).await {
        Ok(reply) => reply.into_inner(),
        // A controller older than controller groups leads alone.
        Err(status) if status.code() == Code::Unimplemented => return Ok(ctl),
        Err(status) => return Err(ctl.error(status, None)),
    };
    if reply.leads {
        return Ok(ctl);
    }
    if reply.leader_address.is_empty() {
        anyhow::bail!(
            "the controller at {} follows and no leader is elected right now; try again in a few seconds",
            ctl.url
        );
    }
    let url = trainyard_proto::contract::leader_url(&ctl.url, &reply.leader_address);
    connect_one(&url, None, credentials).await.with_context(|| {
        format!("the controller at {} follows; it names the leader {} at {url}", ctl.url, reply.leader_id)
    })
}

/// Connects to `url`; `name` is the host name the certificate must carry when the URL holds an
/// address a name resolved to.
async fn connect_one(url: &str, name: Option<&str>, credentials: &Credentials) -> anyhow::Result<Controller> {
    let mut endpoint = Endpoint::from_shared(url.to_string())
        .map_err(|e| anyhow!("invalid controller URL {url:?}: {e} (expected e.g. http://127.0.0.1:7070)"))?
        .connect_timeout(Duration::from_secs(5));
    if url.starts_with("https://") {
        let ca = credentials.ca.as_ref().context(
            "an https:// controller needs the CA of its certificate: --ca FILE or TRAINYARD_CA (init-pki's ca.pem)",
        )?;
        let pem = std::fs::read(ca).with_context(|| format!("read the CA {}", ca.display()))?;
        let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem));
        let tls = match name {
            Some(name) => tls.domain_name(name),
            None => tls,
        };
        endpoint = endpoint.tls_config(tls).context("configure TLS")?;
    }
    let bearer = match &credentials.token {
        Some(token) => Some(
            format!("Bearer {token}")
                .parse()
                .map_err(|_| anyhow!("the token holds characters a token never has"))?,
        ),
        None => None,
    };
    let channel = endpoint.connect().await.map_err(|e| unreachable_error(url, &error_chain(&e)))?;
    let jobs = JobsClient::with_interceptor(channel, Bearer(bearer))
        .max_decoding_message_size(trainyard_proto::limits::MAX_RESPONSE_BYTES)
        .max_encoding_message_size(trainyard_proto::limits::MAX_REQUEST_BYTES);
    Ok(Controller { jobs, url: url.to_string() })
}

impl Controller {
    /// Turns a failed call into one actionable line. `job` is the id the call was about, if any.
    pub fn error(&self, status: Status, job: Option<u64>) -> anyhow::Error {
        describe(&self.url, &status, job)
    }

    /// Checks every word (state, verdict, level, status, class, cause, stream) of a reply,
    /// where it arrives: a word this ctl does not know is one line naming it, not a silent
    /// string printed or compared as if it were known.
    pub fn words<T: Words + ?Sized>(&self, reply: &T) -> anyhow::Result<()> {
        reply.check_words().map_err(|e| {
            anyhow!("the controller at {} sent an {e}: is this ctl older than the controller?", self.url)
        })
    }

    /// Turns a failed call about a node into one actionable line.
    pub fn node_error(&self, status: Status) -> anyhow::Error {
        describe_node(&self.url, &status)
    }
}

fn unreachable_error(url: &str, detail: &str) -> anyhow::Error {
    anyhow!(
        "cannot reach the controller at {url}: {detail} \
         (is trainyard-controller running? set --controller or TRAINYARD_CONTROLLER)"
    )
}

/// Maps a tonic status to the message the operator sees.
pub fn describe(url: &str, status: &Status, job: Option<u64>) -> anyhow::Error {
    let message = status.message();
    match (status.code(), job) {
        // The controller answered, but its database did not: say that, not "cannot reach".
        (Code::Unavailable, _) if message.starts_with("the controller's database") => anyhow!("{message}"),
        (Code::Unavailable, _) => unreachable_error(url, message),
        (Code::NotFound, Some(id)) => anyhow!("job {id} not found"),
        (Code::NotFound, None) => anyhow!("not found: {message}"),
        (Code::InvalidArgument, None) => {
            // The controller may already say it; say it once.
            let reason = message.strip_prefix("job spec rejected: ").unwrap_or(message);
            anyhow!("job spec rejected: {reason}")
        }
        (Code::InvalidArgument, Some(_)) => anyhow!("request rejected: {message}"),
        (Code::FailedPrecondition, _) => anyhow!("{message}"),
        (Code::Unauthenticated, _) => {
            anyhow!("the controller at {url} did not accept your credentials: {message}")
        }
        (Code::PermissionDenied, _) => anyhow!("permission denied: {message}"),
        (Code::DeadlineExceeded, _) => anyhow!("the controller at {url} did not answer in time"),
        (Code::OutOfRange | Code::ResourceExhausted, _) if message.contains("message length too large") => {
            anyhow!("the controller's answer is larger than ctl takes (64 MiB); ask for less ({message})")
        }
        (code, _) => anyhow!("controller error ({code:?}): {message}"),
    }
}

/// The controller words node errors for operators already (unknown node, not connected, no
/// report yet, no answer in time, bad level): say them as they are.
pub fn describe_node(url: &str, status: &Status) -> anyhow::Error {
    match status.code() {
        Code::NotFound | Code::FailedPrecondition | Code::DeadlineExceeded | Code::InvalidArgument => {
            anyhow!("{}", status.message())
        }
        _ => describe(url, status, None),
    }
}

/// "transport error: tcp connect error: Connection refused (os error 111)" from a source chain.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real resolver, as the agent's: a name becomes each of its addresses with the name
    /// TLS checks; an address or an unknown name stays.
    #[tokio::test]
    async fn a_controller_name_is_tried_at_each_of_its_addresses() {
        let dials =
            resolve(&["https://localhost:7070", "http://10.1.2.3:7070", "http://no-such-host.invalid:1"])
                .await;
        assert!(
            dials.iter().any(|(u, n)| u == "https://127.0.0.1:7070" && n.as_deref() == Some("localhost")),
            "{dials:?}"
        );
        assert!(dials.contains(&("http://10.1.2.3:7070".to_string(), None)), "{dials:?}");
        assert_eq!(dials.last(), Some(&("http://no-such-host.invalid:1".to_string(), None)));
    }

    const URL: &str = "http://127.0.0.1:7070";

    #[test]
    fn statuses_become_actionable_lines() {
        let unavailable = describe(URL, &Status::unavailable("connection refused"), None);
        assert!(unavailable.to_string().starts_with("cannot reach the controller at http://"));
        assert!(unavailable.to_string().contains("TRAINYARD_CONTROLLER"));
        let missing = describe(URL, &Status::not_found("no such job"), Some(7));
        assert_eq!(missing.to_string(), "job 7 not found");
        let rejected = describe(URL, &Status::invalid_argument("resources.gpus: must be >= 1"), None);
        assert_eq!(rejected.to_string(), "job spec rejected: resources.gpus: must be >= 1");
        let prefixed = Status::invalid_argument("job spec rejected: engine.workdir: relative");
        let once = describe(URL, &prefixed, None).to_string();
        assert_eq!(once, "job spec rejected: engine.workdir: relative");
    }

    #[test]
    fn node_errors_keep_the_controllers_words() {
        let missing =
            Status::not_found("no node sxm-z is known to this controller (`ctl nodes` lists the known ones)");
        assert_eq!(describe_node(URL, &missing).to_string(), missing.message());
        let slow = Status::deadline_exceeded("node sxm-a did not report its full preflight within 120 s");
        assert_eq!(describe_node(URL, &slow).to_string(), slow.message());
        let down = describe_node(URL, &Status::unavailable("connection refused")).to_string();
        assert!(down.starts_with("cannot reach the controller at http://"), "{down}");
    }

    #[tokio::test]
    async fn nobody_listening_is_reported_as_unreachable() {
        // Bind then drop to get a port that is very likely closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("bind a free port");
        let url = format!("http://127.0.0.1:{port}");
        let err = connect(&url, &Credentials::default()).await.err().expect("nothing listens there");
        let text = err.to_string();
        assert!(text.starts_with(&format!("cannot reach the controller at {url}")), "{text}");
    }
}
