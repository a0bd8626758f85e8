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
    /// When the first certificate of that chain to expire does.
    identity_expires: Option<Expiry>,
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
            identity_expires: None,
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

    /// When the client certificate shown to engines expires (its chain's first to).
    pub fn client_certificate_expires(&self) -> Option<Expiry> {
        self.identity_expires
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
            let expires = expiry(&chain).map_err(|e| at(cert, "client_cert_file", e))?;
            let identity = (chain, Arc::new(der));
            // The key must sign for the certificate: found now, not at the first
            // connection.
            build(Arc::new(RootCertStore::empty()), Some(&identity))
                .map_err(|e| at(key, "client_key_file", e))?;
            Some((identity, expires))
        }
        (Some(only), None) | (None, Some(only)) => {
            return Err((
                Some(only.span()),
                "[tls] client_cert_file and client_key_file go together (mTLS needs both)".into(),
            ))
        }
    };
    let (identity, identity_expires) = identity.unzip();
    Ok(Arc::new(TlsConfig {
        roots,
        identity,
        identity_expires,
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
    /// When the first certificate of the chain to expire does.
    pub expires: Expiry,
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
    let expires = expiry(&chain).map_err(|e| at(cert, "tls_cert_file", e))?;
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
        expires,
    }))
}

/// When a certificate chain stops being valid: the earliest `notAfter` of its
/// certificates (a chain is only as valid as its shortest-lived link).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    /// Unix seconds.
    pub not_after: i64,
}

impl Expiry {
    /// Whole days from `now` (unix seconds) to the expiry; negative once past it.
    pub fn days_left(self, now: i64) -> i64 {
        (self.not_after - now).div_euclid(86_400)
    }

    /// When it expires, and how far off that is from `now` (unix seconds).
    pub fn describe(self, now: i64) -> String {
        if self.not_after <= now {
            return match (now - self.not_after) / 86_400 {
                0 => format!("EXPIRED {self} (today)"),
                1 => format!("EXPIRED {self} (1 day ago)"),
                d => format!("EXPIRED {self} ({d} days ago)"),
            };
        }
        match self.days_left(now) {
            1 => format!("expires {self} (in 1 day)"),
            d => format!("expires {self} (in {d} days)"),
        }
    }

    /// Whether it is worth a warning at `now`: expired, or within 14 days.
    pub fn is_near(self, now: i64) -> bool {
        self.days_left(now) < 14
    }
}

/// Unix seconds now.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl fmt::Display for Expiry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match x509_parser::time::ASN1Time::from_timestamp(self.not_after) {
            Ok(t) => write!(f, "{t}"),
            Err(_) => write!(f, "{} (unix seconds)", self.not_after),
        }
    }
}

/// The expiry of a chain, or why a certificate of it cannot be read.
fn expiry(chain: &[CertificateDer<'_>]) -> Result<Expiry, String> {
    let mut earliest = i64::MAX;
    for (i, der) in chain.iter().enumerate() {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("certificate {} of the chain is not X.509: {e}", i + 1))?;
        earliest = earliest.min(cert.validity().not_after.timestamp());
    }
    Ok(Expiry {
        not_after: earliest,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expiry_is_told_in_days_left_and_past_ones_are_shouted() {
        // 2031-05-17 00:00:00 UTC.
        let e = Expiry {
            not_after: 1_936_742_400,
        };
        assert_eq!(e.to_string(), "May 17 00:00:00 2031 +00:00");
        let day = 86_400;
        assert_eq!(e.days_left(e.not_after - 30 * day), 30);
        assert_eq!(e.days_left(e.not_after - 30 * day + 1), 29);
        assert_eq!(
            e.describe(e.not_after - day),
            "expires May 17 00:00:00 2031 +00:00 (in 1 day)"
        );
        assert!(!e.is_near(e.not_after - 14 * day));
        assert!(e.is_near(e.not_after - 14 * day + 1));
        assert_eq!(
            e.describe(e.not_after),
            "EXPIRED May 17 00:00:00 2031 +00:00 (today)"
        );
        assert_eq!(
            e.describe(e.not_after + 3 * day),
            "EXPIRED May 17 00:00:00 2031 +00:00 (3 days ago)"
        );
        assert!(e.is_near(e.not_after + 3 * day));
    }

    #[test]
    fn a_chain_expires_with_its_first_certificate_to() {
        let make = |y, m, d| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(vec!["a".to_string()]).unwrap();
            params.not_after = rcgen::date_time_ymd(y, m, d);
            params.self_signed(&key).unwrap().der().clone()
        };
        let (late, early) = (make(2040, 1, 1), make(2030, 6, 1));
        let want = rcgen::date_time_ymd(2030, 6, 1).unix_timestamp();
        assert_eq!(
            expiry(&[late.clone(), early.clone()]).unwrap().not_after,
            want
        );
        assert_eq!(expiry(&[early, late]).unwrap().not_after, want);
        let junk = CertificateDer::from(vec![0x30, 0x03, 1, 2, 3]);
        let e = expiry(&[junk]).unwrap_err();
        assert!(
            e.starts_with("certificate 1 of the chain is not X.509"),
            "{e}"
        );
    }
}
