//! The HTTP listener (web view, /metrics) is as safe as the gRPC one. Off loopback the demo's
//! tokenless admin never applies, the listener speaks HTTPS with the controller's certificate or
//! refuses to start in plain text, /metrics needs a token unless the operator opted in, and an
//! address that floods it with bad tokens is turned away before the handshake.
//!
//! "Off loopback" is real: each test makes a network namespace of its own with a veth pair
//! carrying a private address (10.213.0.1), runs the controller and curl inside it, and removes
//! it afterwards, even when the test fails. That needs root and `ip`; elsewhere the tests say
//! skipped. The refusal of an agent's public `/metrics` needs neither.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use trainyard_tests::bin;

const ADDR: &str = "10.213.0.1";

/// A network namespace with a veth pair, `ADDR` on one end; deleted on drop with whatever runs
/// in it.
struct Netns {
    name: String,
    children: Vec<Child>,
}

impl Netns {
    fn create() -> Result<Option<Netns>> {
        // SAFETY: geteuid cannot fail and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: a network namespace needs root");
            return Ok(None);
        }
        if Command::new("ip").arg("-V").output().is_err() {
            println!("skipped: `ip` (iproute2) is not installed; deploy/setup.sh installs it");
            return Ok(None);
        }
        let name = format!(
            "ty-http-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let ns = Netns { name, children: Vec::new() };
        ns.ip(&["netns", "add", &ns.name])?;
        for args in [
            vec!["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            vec!["addr", "add", &format!("{ADDR}/24"), "dev", "v0"],
            vec!["link", "set", "v0", "up"],
            vec!["link", "set", "v1", "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut full = vec!["netns", "exec", &ns.name, "ip"];
            full.extend(args);
            ns.ip(&full)?;
        }
        Ok(Some(ns))
    }

    fn ip(&self, args: &[&str]) -> Result<()> {
        let out = Command::new("ip").args(args).output()?;
        if !out.status.success() {
            bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// `program args` inside the namespace.
    fn command(&self, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// curl inside the namespace: (status, body).
    fn curl(&self, url: &str, ca: Option<&Path>, token: Option<&str>) -> Result<(u16, String)> {
        let mut c = self.command(Path::new("curl"));
        c.args(["-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}"]);
        if let Some(ca) = ca {
            c.arg("--cacert").arg(ca);
        }
        if let Some(t) = token {
            c.args(["-H", &format!("Authorization: Bearer {t}")]);
        }
        let out = c.arg(url).output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        Ok((code.trim().parse().unwrap_or(0), body.to_string()))
    }
}

static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl Drop for Netns {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// A controller in `ns` on `dir` with `flags`; returns the HTTP address it bound, or its
/// output when it exited instead.
fn start_controller(ns: &mut Netns, dir: &Path, flags: &[&str]) -> Result<Result<String, String>> {
    let http_file = dir.join("http.addr");
    let _ = std::fs::remove_file(&http_file);
    let log = dir.join("controller.log");
    let mut child = ns
        .command(&bin("trainyard-controller")?)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--listen", "127.0.0.1:0", "--http-listen", &format!("{ADDR}:0"), "--http-addr-file"])
        .arg(&http_file)
        .args(flags)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(addr) = std::fs::read_to_string(&http_file)
            && !addr.trim().is_empty()
        {
            ns.children.push(child);
            return Ok(Ok(addr.trim().to_string()));
        }
        if child.try_wait()?.is_some() {
            return Ok(Err(std::fs::read_to_string(&log)?));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("the controller neither served nor exited: {}", std::fs::read_to_string(&log)?);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn admin(dir: &Path, args: &[&str]) -> Result<Output> {
    Ok(Command::new(bin("trainyard-controller")?)
        .args(args)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .output()?)
}

#[test]
fn plain_http_off_loopback_is_refused_unless_asked_for_and_then_needs_tokens() -> Result<()> {
    let Some(mut ns) = Netns::create()? else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let refused = start_controller(&mut ns, dir.path(), &[])?;
    let why = refused.expect_err("plain HTTP off loopback must be refused");
    assert!(why.contains("--http-insecure-plaintext-on-network"), "{why}");

    let addr = start_controller(&mut ns, dir.path(), &["--http-insecure-plaintext-on-network"])?
        .map_err(anyhow::Error::msg)?;
    let url = |p: &str| format!("http://{addr}{p}");
    // The gRPC listener is the loopback demo, but its tokenless admin stops at loopback.
    let (status, body) = ns.curl(&url("/api/jobs"), None, None)?;
    assert_eq!(status, 401, "{body}");
    let (status, body) = ns.curl(&url("/metrics"), None, None)?;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("--metrics-public"), "{body}");
    assert_eq!(ns.curl(&url("/healthz"), None, None)?.0, 200);
    let out = admin(dir.path(), &["user", "add", "ops"])?;
    let token = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(ns.curl(&url("/api/jobs"), None, Some(&token))?.0, 200);
    assert_eq!(ns.curl(&url("/metrics"), None, Some(&token))?.0, 200);
    assert_eq!(ns.curl(&url("/metrics"), None, Some("tyt_nope"))?.0, 401);
    Ok(())
}

#[test]
fn with_tls_the_http_listener_off_loopback_speaks_https_needs_tokens_and_turns_floods_away() -> Result<()> {
    let Some(mut ns) = Netns::create()? else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let pki = dir.path().join("pki");
    let out = Command::new(bin("trainyard-controller")?).args(["init-pki", "--dir"]).arg(&pki).output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = admin(dir.path(), &["user", "add", "ops", "--admin"])?;
    let token = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let tls = pki.display().to_string();
    let addr = start_controller(&mut ns, dir.path(), &["--tls-dir", &tls])?.map_err(anyhow::Error::msg)?;
    let ca = pki.join("ca.pem");
    let port = addr.rsplit_once(':').context("port")?.1.to_string();
    // The certificate names localhost and 127.0.0.1; curl reaches 10.213.0.1 under that name.
    let https = |path: &str, token: Option<&str>| -> Result<u16> {
        let mut c = ns.command(Path::new("curl"));
        c.args(["-sS", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
            .arg(&ca)
            .args(["--resolve", &format!("localhost:{port}:{ADDR}")]);
        if let Some(t) = token {
            c.args(["-H", &format!("Authorization: Bearer {t}")]);
        }
        let out = c.arg(format!("https://localhost:{port}{path}")).output()?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0))
    };
    assert_eq!(https("/healthz", None)?, 200, "HTTPS answers");
    assert_eq!(https("/api/jobs", None)?, 401, "no token, no jobs");
    assert_eq!(https("/metrics", None)?, 401, "no token, no metrics");
    assert_eq!(https("/api/jobs", Some(&token))?, 200);
    assert_eq!(https("/metrics", Some(&token))?, 200);
    // Plain HTTP to the HTTPS port gets nothing useful.
    let (status, _) = ns.curl(&format!("http://{addr}/api/jobs"), None, None)?;
    assert_ne!(status, 200, "plain HTTP must not be served on the HTTPS port");
    // A flood of made-up tokens: past its burst the address is turned away before the handshake
    // (curl sees no HTTP status at all), and a valid token from it still gets in a second later.
    let bad = format!("tyt_{}", "0".repeat(64));
    let statuses: Vec<u16> = (0..60).map(|_| https("/api/jobs", Some(&bad))).collect::<Result<_>>()?;
    let refused = statuses.iter().filter(|&&s| s == 401).count();
    let turned_away = statuses.iter().filter(|&&s| s == 0).count();
    assert_eq!(refused + turned_away, 60, "only 401s and closed connections: {statuses:?}");
    assert!(turned_away >= 10, "only {turned_away} of 60 turned away: {statuses:?}");
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(https("/api/jobs", Some(&token))?, 200, "a valid token from a limited address gets in");
    Ok(())
}

#[test]
fn metrics_public_opens_metrics_only() -> Result<()> {
    let Some(mut ns) = Netns::create()? else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let addr =
        start_controller(&mut ns, dir.path(), &["--http-insecure-plaintext-on-network", "--metrics-public"])?
            .map_err(anyhow::Error::msg)?;
    let (status, body) = ns.curl(&format!("http://{addr}/metrics"), None, None)?;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("trainyard_"), "{body}");
    assert_eq!(ns.curl(&format!("http://{addr}/api/jobs"), None, None)?.0, 401);
    Ok(())
}

#[test]
fn an_agents_metrics_off_loopback_need_the_opt_in() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let host = trainyard_tests::host_file(dir.path(), "m", 1);
    let out = Command::new(bin("trainyard-agent")?)
        .args(["--controller", "http://127.0.0.1:9", "--metrics-listen", "0.0.0.0:0", "--host-file"])
        .arg(&host)
        .arg("--data-dir")
        .arg(dir.path().join("agent"))
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--metrics-public"), "{err}");
    Ok(())
}
