//! The small PKI `trainyard-controller init-pki` writes, so a fleet needs no outside tooling:
//! a CA, the controller's server certificate, and one client certificate per agent whose
//! common name is the agent id. Operators may bring their own certificates instead; the
//! controller only needs a server certificate, its key, and the CA that signed the agents'.
//!
//! Layout of the directory (keys are written mode 0600):
//! ```text
//! ca.pem  ca.key                  the CA (keep ca.key on the controller host, or offline)
//! server.pem  server.key          the controller's certificate (--tls-dir DIR reads these + ca.pem)
//! agents/NAME/ca.pem agent.pem agent.key   copy this directory to node NAME (agent --tls-dir)
//! ```

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

/// Default validity of certificates `init-pki` issues.
pub const DEFAULT_DAYS: u32 = 365;
/// Validity of the CA.
const CA_DAYS: i64 = 3650;

/// How long a certificate is valid: from `not_before` to `not_after`.
#[derive(Debug, Clone, Copy)]
pub struct Validity {
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl Validity {
    /// From an hour ago (clock skew between hosts) for `days` days.
    pub fn days(days: u32) -> Self {
        let now = OffsetDateTime::now_utc();
        Validity { not_before: now - Duration::hours(1), not_after: now + Duration::days(i64::from(days)) }
    }
}

/// What [`init`] wrote.
#[derive(Debug)]
pub struct Written {
    pub dir: PathBuf,
    pub agents: Vec<PathBuf>,
}

/// Writes a new CA, a server certificate for `server_names` (DNS names or IP addresses; the
/// loopback names are always added) and one client certificate per agent into `dir`. Refuses
/// to overwrite an existing CA: certificates issued from it would stop verifying.
pub fn init(dir: &Path, server_names: &[String], agents: &[String], days: u32) -> anyhow::Result<Written> {
    if dir.join("ca.key").exists() {
        bail!(
            "{} already holds a CA (ca.key); issue more agent certificates with \
             `trainyard-controller issue-agent-cert NAME --pki-dir {}` or choose an empty directory",
            dir.display(),
            dir.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let ca_key = KeyPair::generate().context("generate the CA key")?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
    ca.distinguished_name.push(DnType::CommonName, "trainyard CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let now = OffsetDateTime::now_utc();
    ca.not_before = now - Duration::hours(1);
    ca.not_after = now + Duration::days(CA_DAYS);
    let ca_cert = ca.self_signed(&ca_key).context("sign the CA certificate")?;
    write_file(&dir.join("ca.pem"), &ca_cert.pem(), false)?;
    write_file(&dir.join("ca.key"), &ca_key.serialize_pem(), true)?;
    let issuer = Issuer::new(ca, ca_key);
    let mut names: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
    for name in server_names {
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    let (cert, key) = server_cert(&issuer, &names, Validity::days(days))?;
    write_file(&dir.join("server.pem"), &cert, false)?;
    write_file(&dir.join("server.key"), &key, true)?;
    let mut written = Written { dir: dir.to_path_buf(), agents: Vec::new() };
    for agent in agents {
        written.agents.push(write_agent(dir, &issuer, &ca_cert.pem(), agent, Validity::days(days))?);
    }
    Ok(written)
}

/// Issues a client certificate for agent `name` from the CA in `dir`; returns the directory
/// to copy to the node.
pub fn issue_agent(dir: &Path, name: &str, validity: Validity) -> anyhow::Result<PathBuf> {
    let (issuer, ca_pem) = load_issuer(dir)?;
    write_agent(dir, &issuer, &ca_pem, name, validity)
}

/// A client certificate and key (PEM) for agent `name`, signed by the CA of `dir`, valid for
/// `validity` (which may lie in the past: tests prove expired certificates are refused).
pub fn agent_cert(dir: &Path, name: &str, validity: Validity) -> anyhow::Result<(String, String)> {
    let (issuer, _) = load_issuer(dir)?;
    leaf(&issuer, name, &[], ExtendedKeyUsagePurpose::ClientAuth, validity)
}

fn load_issuer(dir: &Path) -> anyhow::Result<(Issuer<'static, KeyPair>, String)> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path)
            .with_context(|| format!("read {} (run init-pki first)", path.display()))
    };
    let (ca_pem, ca_key) = (read("ca.pem")?, read("ca.key")?);
    let key = KeyPair::from_pem(&ca_key).with_context(|| format!("parse {}/ca.key", dir.display()))?;
    let issuer =
        Issuer::from_ca_cert_pem(&ca_pem, key).with_context(|| format!("parse {}/ca.pem", dir.display()))?;
    Ok((issuer, ca_pem))
}

fn write_agent(
    dir: &Path,
    issuer: &Issuer<'_, KeyPair>,
    ca_pem: &str,
    name: &str,
    validity: Validity,
) -> anyhow::Result<PathBuf> {
    check_agent_name(name)?;
    let (cert, key) = leaf(issuer, name, &[], ExtendedKeyUsagePurpose::ClientAuth, validity)?;
    let out = dir.join("agents").join(name);
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    write_file(&out.join("ca.pem"), ca_pem, false)?;
    write_file(&out.join("agent.pem"), &cert, false)?;
    write_file(&out.join("agent.key"), &key, true)?;
    Ok(out)
}

/// Agent ids become file names and certificate names: keep them to what hostnames use.
fn check_agent_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if !ok {
        bail!("agent name {name:?} must be 1-63 letters, digits, '-', '_' or '.', not starting with '.'");
    }
    Ok(())
}

fn server_cert(
    issuer: &Issuer<'_, KeyPair>,
    names: &[String],
    validity: Validity,
) -> anyhow::Result<(String, String)> {
    leaf(issuer, "trainyard-controller", names, ExtendedKeyUsagePurpose::ServerAuth, validity)
}

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    common_name: &str,
    sans: &[String],
    usage: ExtendedKeyUsagePurpose,
    validity: Validity,
) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate().context("generate a key")?;
    let mut params =
        CertificateParams::new(sans.to_vec()).with_context(|| format!("certificate names {sans:?}"))?;
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![usage];
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
    params.use_authority_key_identifier_extension = true;
    let cert =
        params.signed_by(&key, issuer).with_context(|| format!("sign the certificate of {common_name}"))?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn write_file(path: &Path, text: &str, secret: bool) -> anyhow::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .with_context(|| format!("write {}", path.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("write {}", path.display()))
}

/// The common name of a DER certificate's subject: the agent id of an agent certificate.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_writes_a_ca_a_server_and_agents_whose_names_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let written = init(dir.path(), &["ctl.example".into()], &["sxm-a".into()], 30).unwrap();
        assert_eq!(written.agents, vec![dir.path().join("agents/sxm-a")]);
        for f in [
            "ca.pem",
            "ca.key",
            "server.pem",
            "server.key",
            "agents/sxm-a/agent.pem",
            "agents/sxm-a/agent.key",
        ] {
            assert!(dir.path().join(f).is_file(), "{f}");
        }
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join("ca.key")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let pem = std::fs::read_to_string(dir.path().join("agents/sxm-a/agent.pem")).unwrap();
        let der = pem_der(&pem);
        assert_eq!(common_name(&der).as_deref(), Some("sxm-a"));
        // A second agent from the same CA, later.
        issue_agent(dir.path(), "sxm-b", Validity::days(1)).unwrap();
        let der = pem_der(&std::fs::read_to_string(dir.path().join("agents/sxm-b/agent.pem")).unwrap());
        assert_eq!(common_name(&der).as_deref(), Some("sxm-b"));
        let again = init(dir.path(), &[], &[], 30).unwrap_err().to_string();
        assert!(again.contains("already holds a CA"), "{again}");
        assert!(issue_agent(dir.path(), "../etc", Validity::days(1)).is_err());
    }

    fn pem_der(pem: &str) -> Vec<u8> {
        let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
        p.contents
    }
}
