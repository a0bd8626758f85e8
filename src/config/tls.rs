//! `[tls]`: how engines behind `https://` node URLs are trusted (the system's roots, or
//! the CA certificates of `ca_file`), and the client certificate shown to them (mTLS:
//! `client_cert_file` and `client_key_file`, PEM). The files are read and checked when
//! the config is (so `check` names one it cannot read at file:line:col); the rustls
//! client is built on the first TLS connection, so a fleet of plain-HTTP engines never
//! loads the system's roots. Also the client listener's own certificate and key
//! (`server.tls_cert_file`, `server.tls_key_file`), read and matched the same way, and
//! the CAs its clients' certificates must come from (`server.tls_client_ca_file`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore};
use toml::Spanned;

use super::file::{ServerSection, TlsSection};
use super::validate::Invalid;

/// The validated `[tls]` section, and the rustls client built from it.
pub struct TlsConfig {
    /// The CA certificates of `ca_file`; none: the system's roots.
    roots: Option<Arc<RootCertStore>>,
    /// The client certificate chain and its key (mTLS).
    identity: Option<(Vec<CertificateDer<'static>>, Arc<PrivateKeyDer<'static>>)>,
    client: OnceLock<Result<Arc<ClientConfig>, String>>,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("ca_roots", &self.roots.as_ref().map(|r| r.len()))
            .field("client_cert", &self.identity.is_some())
            .finish()
    }
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            roots: None,
            identity: None,
            client: OnceLock::new(),
        }
    }
}

impl TlsConfig {
    /// The rustls client for engine connections (built once), or why there is none.
    pub fn client(&self) -> Result<Arc<ClientConfig>, String> {
        self.client
            .get_or_init(|| {
                let roots = match &self.roots {
                    Some(roots) => roots.clone(),
                    None => Arc::new(system_roots()?),
                };
                build(roots, self.identity.as_ref()).map(Arc::new)
            })
            .clone()
    }

    /// Whether a client certificate is shown (mTLS).
    pub fn mutual(&self) -> bool {
        self.identity.is_some()
    }

    /// Certificates trusted from `ca_file` (none: the system's roots are).
    pub fn ca_certificates(&self) -> Option<usize> {
        self.roots.as_ref().map(|r| r.len())
    }
}

/// The system's root certificates (what `rustls-native-certs` finds: on Linux the
/// OpenSSL store, `/etc/ssl/certs`).
fn system_roots() -> Result<RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        return Err(format!(
            "no system root certificates found ({} errors); set [tls] ca_file",
            found.errors.len()
        ));
    }
    Ok(roots)
}

fn build(
    roots: Arc<RootCertStore>,
    identity: Option<&(Vec<CertificateDer<'static>>, Arc<PrivateKeyDer<'static>>)>,
) -> Result<ClientConfig, String> {
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
    let mut config = match identity {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(|e| format!("the client certificate and key do not go together: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    // Engines speak HTTP/1.1 to us.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// Validates `[tls]`: the files exist, parse, and (for mTLS) the key fits the
/// certificate. Paths are relative to the config file's folder.
pub(super) fn validate(t: TlsSection, dir: &Path) -> Result<Arc<TlsConfig>, Invalid> {
    let path = |s: &Spanned<String>| dir.join(s.get_ref());
    let roots = match &t.ca_file {
        None => None,
        Some(file) => {
            let certs = read_certs(&path(file)).map_err(|e| at(file, "ca_file", e))?;
            let mut roots = RootCertStore::empty();
            for c in certs {
                roots.add(c).map_err(|e| {
                    at(file, "ca_file", format!("a certificate is not usable: {e}"))
                })?;
            }
            Some(Arc::new(roots))
        }
    };
    let identity = match (&t.client_cert_file, &t.client_key_file) {
        (None, None) => None,
        (Some(cert), Some(key)) => {
            let chain = read_certs(&path(cert)).map_err(|e| at(cert, "client_cert_file", e))?;
            let der = PrivateKeyDer::from_pem_file(path(key))
                .map_err(|e| at(key, "client_key_file", format!("no private key read: {e}")))?;
            let identity = (chain, Arc::new(der));
            // The key must sign for the certificate: found now, not at the first
            // connection.
            build(Arc::new(RootCertStore::empty()), Some(&identity))
                .map_err(|e| at(key, "client_key_file", e))?;
            Some(identity)
        }
        (Some(only), None) | (None, Some(only)) => {
            return Err((
                Some(only.span()),
                "[tls] client_cert_file and client_key_file go together (mTLS needs both)".into(),
            ))
        }
    };
    Ok(Arc::new(TlsConfig {
        roots,
        identity,
        client: OnceLock::new(),
    }))
}

/// The client listener's certificate and key (`server.tls_cert_file`,
/// `server.tls_key_file`) and the verifier of its clients' certificates
/// (`server.tls_client_ca_file`), as read when the config was.
#[derive(Debug, Clone)]
pub struct ListenerTls {
    pub key: Arc<CertifiedKey>,
    /// Clients must show a certificate it accepts (mTLS).
    pub clients: Option<Arc<dyn ClientCertVerifier>>,
    /// The files read, for a reload to notice when they change.
    pub files: Vec<PathBuf>,
}

/// The client listener's certificate chain and key (`server.tls_cert_file`,
/// `server.tls_key_file`; both or neither): read, and the key checked against the
/// chain's first certificate; and the CAs of its clients' certificates
/// (`server.tls_client_ca_file`). Paths are relative to the config file's folder.
pub(super) fn listener(s: &ServerSection, dir: &Path) -> Result<Option<ListenerTls>, Invalid> {
    let (cert, key) = match (&s.tls_cert_file, &s.tls_key_file) {
        (None, None) => {
            return match &s.tls_client_ca_file {
                None => Ok(None),
                Some(ca) => Err((
                    Some(ca.span()),
                    "server.tls_client_ca_file needs server.tls_cert_file and tls_key_file (client certificates are asked for in a TLS handshake)".into(),
                )),
            }
        }
        (Some(cert), Some(key)) => (cert, key),
        (Some(only), None) | (None, Some(only)) => {
            return Err((
                Some(only.span()),
                "server.tls_cert_file and server.tls_key_file go together (HTTPS needs both)"
                    .into(),
            ))
        }
    };
    let at = |v: &Spanned<String>, name: &str, message: String| {
        (Some(v.span()), format!("server.{name}: {message}"))
    };
    let mut files = vec![dir.join(cert.get_ref()), dir.join(key.get_ref())];
    let chain = read_certs(&files[0]).map_err(|e| at(cert, "tls_cert_file", e))?;
    let der = PrivateKeyDer::from_pem_file(&files[1])
        .map_err(|e| at(key, "tls_key_file", format!("no private key read: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certified = CertifiedKey::from_der(chain, der, &provider).map_err(|e| {
        at(
            key,
            "tls_key_file",
            format!("the key does not go with the certificate: {e}"),
        )
    })?;
    let clients = match &s.tls_client_ca_file {
        None => None,
        Some(ca) => {
            let path = dir.join(ca.get_ref());
            let mut roots = RootCertStore::empty();
            for c in read_certs(&path).map_err(|e| at(ca, "tls_client_ca_file", e))? {
                roots.add(c).map_err(|e| {
                    at(
                        ca,
                        "tls_client_ca_file",
                        format!("a certificate is not usable: {e}"),
                    )
                })?;
            }
            files.push(path);
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| at(ca, "tls_client_ca_file", e.to_string()))?;
            Some(verifier)
        }
    };
    Ok(Some(ListenerTls {
        key: Arc::new(certified),
        clients,
        files,
    }))
}

/// The PEM certificates of a file (at least one).
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{} is not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

fn at(
    value: &Spanned<String>,
    key: &str,
    message: String,
) -> (Option<std::ops::Range<usize>>, String) {
    (Some(value.span()), format!("[tls] {key}: {message}"))
}
