//! The files of the controller's TLS, shared by the gRPC listener and the HTTPS one.

use std::path::PathBuf;

use anyhow::Context;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// The files of the controller's TLS: its certificate and key, and the CA whose certificates
/// agents present (`init-pki` writes all three).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
}

impl TlsFiles {
    /// The three files `init-pki` writes into `dir`: server.pem, server.key, ca.pem.
    pub fn in_dir(dir: &std::path::Path) -> Self {
        TlsFiles { cert: dir.join("server.pem"), key: dir.join("server.key"), client_ca: dir.join("ca.pem") }
    }

    /// Reads the files into tonic's server configuration. Client certificates are optional at
    /// the TLS layer because `ctl` has none; the `Agents` service refuses a stream without one.
    pub fn load(&self) -> anyhow::Result<ServerTlsConfig> {
        let read = |p: &PathBuf, what: &str| {
            std::fs::read(p).with_context(|| format!("read the {what} {}", p.display()))
        };
        let identity = Identity::from_pem(read(&self.cert, "certificate")?, read(&self.key, "key")?);
        let ca = Certificate::from_pem(read(&self.client_ca, "client CA")?);
        Ok(ServerTlsConfig::new().identity(identity).client_ca_root(ca).client_auth_optional(true))
    }
}
