//! HTTPS on the client port (`server.tls_cert_file`, `server.tls_key_file`, and
//! `server.tls_client_ca_file` to require client certificates): the rustls server that
//! takes each connection's handshake, offering HTTP/2 and HTTP/1.1 by ALPN, which a
//! reload replaces (a renewed certificate, as cert-manager writes one, is served from
//! the next handshake on; open connections keep theirs).

use std::io::{self, Read};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::BytesMut;
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::ServerConfig;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use x509_parser::extensions::GeneralName;

use crate::config::ListenerTls;
use crate::proxy::tenant::CertifiedName;

/// The client port's TLS: its rustls server, built from the config's
/// [`ListenerTls`] and rebuilt by each reload.
pub struct ClientTls {
    server: ArcSwap<ServerConfig>,
    /// The certificate it shows.
    shown: ArcSwap<CertifiedKey>,
}

/// A rustls server showing `tls`'s certificate to every client, whatever name it asks
/// for, asking for client certificates if it says so, offering HTTP/2 and HTTP/1.1.
fn server(tls: &ListenerTls) -> ServerConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions");
    let builder = match &tls.clients {
        Some(verifier) => builder.with_client_cert_verifier(verifier.clone()),
        None => builder.with_no_client_auth(),
    };
    let shown = SingleCertAndKey::from(tls.key.clone());
    let mut config = builder.with_cert_resolver(Arc::new(shown));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config
}

/// `tls` without its clients' CAs.
pub fn admin(tls: &ListenerTls) -> ListenerTls {
    ListenerTls {
        clients: None,
        ..tls.clone()
    }
}

/// Why a client's handshake did not end in a TLS connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It spoke plain HTTP (answered 400 `https_required`).
    PlainHttp,
    /// No handshake within `header_read_timeout`.
    Timeout,
    /// The handshake failed (no protocol version or cipher in common, an alert from
    /// the client rejecting our certificate, bytes that are not TLS) or the client left.
    Failed,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::PlainHttp => "plain_http",
            Refusal::Timeout => "timeout",
            Refusal::Failed => "failed",
        }
    }
}

/// A connection after its handshake, and the protocol the client chose by ALPN.
pub struct Accepted {
    pub stream: TlsStream<TcpStream>,
    /// The client and the listener agreed on HTTP/2 (ALPN `h2`).
    pub http2: bool,
}

impl ClientTls {
    /// The TLS server `tls` describes.
    pub fn new(tls: &ListenerTls) -> ClientTls {
        ClientTls {
            server: ArcSwap::from_pointee(server(tls)),
            shown: ArcSwap::new(tls.key.clone()),
        }
    }

    /// The admin port's: `tls`'s certificate, asking no client for one (probes and
    /// scrapers cannot show one; `admin_token` guards the port).
    pub fn for_admin(tls: &ListenerTls) -> ClientTls {
        ClientTls::new(&admin(tls))
    }

    /// Serves `tls` from the next handshake on.
    pub fn renew(&self, tls: &ListenerTls) {
        self.server.store(Arc::new(server(tls)));
        self.shown.store(tls.key.clone());
    }

    /// The certificate shown now.
    pub fn shown(&self) -> Arc<CertifiedKey> {
        self.shown.load_full()
    }

    /// Takes a client's handshake, within `limit` (a client that opens a connection
    /// and sends nothing holds it no longer than one that sends no request head). A
    /// client that speaks plain HTTP to the port is answered 400 in plain HTTP, saying
    /// so, where a TLS alert would reach it as a garbled response.
    pub async fn accept(
        &self,
        stream: TcpStream,
        limit: Duration,
    ) -> Result<Accepted, (Refusal, io::Error)> {
        let handshake = async {
            if !opens_with_tls(&stream)
                .await
                .map_err(|e| (Refusal::Failed, e))?
            {
                return Err((Refusal::PlainHttp, refuse_plain_http(stream).await));
            }
            TlsAcceptor::from(self.server.load_full())
                .accept(stream)
                .await
                .map_err(|e| (Refusal::Failed, e))
        };
        let timed_out = || {
            let e = io::Error::new(io::ErrorKind::TimedOut, "no TLS handshake in time");
            (Refusal::Timeout, e)
        };
        let stream = tokio::time::timeout(limit, handshake)
            .await
            .map_err(|_| timed_out())??;
        let http2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
        Ok(Accepted { stream, http2 })
    }
}

/// A TLS record of the handshake (a ClientHello) opens with this byte.
const HANDSHAKE_RECORD: u8 = 0x16;

/// Whether the client's first byte opens a TLS handshake (looked at, not read).
async fn opens_with_tls(stream: &TcpStream) -> io::Result<bool> {
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await? {
        0 => Err(io::ErrorKind::UnexpectedEof.into()),
        _ => Ok(first[0] == HANDSHAKE_RECORD),
    }
}

/// Answers a plain-HTTP request on the HTTPS port, then closes; the error to log.
async fn refuse_plain_http(mut stream: TcpStream) -> io::Error {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const BODY: &str = r#"{"error":{"message":"this port serves HTTPS: use https://","type":"invalid_request_error","code":"https_required"}}"#;
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = stream.write_all(answer.as_bytes()).await;
    let _ = stream.shutdown().await;
    // Read what the client still sends for a moment (a request body): closing with
    // unread bytes would reset the connection and could lose the answer.
    let mut sink = [0u8; 4096];
    let linger = async { while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {} };
    let _ = tokio::time::timeout(Duration::from_secs(1), linger).await;
    io::Error::new(io::ErrorKind::InvalidData, "plain HTTP on the HTTPS port")
}

/// Reads into `buf` what a TLS connection can give without waiting: plaintext rustls
/// holds decrypted, then records the socket already has (read with `try_read`, which
/// registers no waker). `WouldBlock` when there is none; `Ok(0)` at the client's close.
pub fn try_read_buf(stream: &mut TlsStream<TcpStream>, buf: &mut BytesMut) -> io::Result<usize> {
    let (tcp, tls) = stream.get_mut();
    loop {
        let start = buf.len();
        let room = 16 * 1024;
        buf.resize(start + room, 0);
        let read = tls.reader().read(&mut buf[start..]);
        buf.truncate(start + *read.as_ref().unwrap_or(&0));
        match read {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        // Nothing decrypted: take what the socket holds, without waiting for more.
        if tls.read_tls(&mut Nonblocking(tcp))? == 0 {
            return Ok(0);
        }
        tls.process_new_packets().map_err(io::Error::other)?;
    }
}

/// The name in the certificate a client showed, if it showed one (mTLS).
pub fn certified_name(stream: &TlsStream<TcpStream>) -> Option<CertifiedName> {
    let leaf = stream.get_ref().1.peer_certificates()?.first()?;
    name_in(leaf).map(|n| CertifiedName(n.into()))
}

/// Longest name taken from a certificate (a SPIFFE ID fits).
const MAX_NAME_CHARS: usize = 128;

/// A certificate's name: its subject's common name, else its first DNS name, else its
/// first URI (a SPIFFE ID); printable ASCII, at most [`MAX_NAME_CHARS`].
fn name_in(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let common = cert
        .subject()
        .iter_common_name()
        .find_map(|cn| cn.as_str().ok().map(str::to_string));
    let alternative = || {
        let san = cert.subject_alternative_name().ok()??;
        let names = &san.value.general_names;
        let dns = names.iter().find_map(|n| match n {
            GeneralName::DNSName(d) => Some(*d),
            _ => None,
        });
        let uri = || {
            names.iter().find_map(|n| match n {
                GeneralName::URI(u) => Some(*u),
                _ => None,
            })
        };
        dns.or_else(uri).map(str::to_string)
    };
    let name = common.or_else(alternative)?;
    let name = name.trim();
    let fits = !name.is_empty()
        && name.len() <= MAX_NAME_CHARS
        && name.bytes().all(|b| b.is_ascii_graphic() || b == b' ');
    fits.then(|| name.to_string())
}

/// A socket read as `std::io::Read` that never waits: `WouldBlock` when it has nothing.
struct Nonblocking<'a>(&'a TcpStream);

impl Read for Nonblocking<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_read(buf)
    }
}

#[cfg(test)]
mod tests {
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType};

    use super::*;

    fn cert(common_name: Option<&str>, names: Vec<SanType>) -> Vec<u8> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        if let Some(cn) = common_name {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        params.subject_alt_names = names;
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn a_certificate_is_named_by_its_common_name_else_its_dns_name_else_its_uri() {
        let dns = || SanType::DnsName("svc.llm.internal".try_into().unwrap());
        let spiffe = || SanType::URI("spiffe://cluster.local/ns/llm/sa/rag".try_into().unwrap());
        let named = |cn, names| name_in(&cert(cn, names));
        assert_eq!(
            named(Some("team-a"), vec![dns(), spiffe()]).as_deref(),
            Some("team-a")
        );
        assert_eq!(
            named(None, vec![spiffe(), dns()]).as_deref(),
            Some("svc.llm.internal")
        );
        assert_eq!(
            named(None, vec![spiffe()]).as_deref(),
            Some("spiffe://cluster.local/ns/llm/sa/rag")
        );
        assert_eq!(named(Some("Team B"), vec![]).as_deref(), Some("Team B"));
        // No name, one too long, or one that is not printable: none.
        assert_eq!(named(None, vec![]), None);
        let long = "x".repeat(129);
        assert_eq!(named(Some(&long), vec![]), None);
        assert_eq!(named(Some("tab\there"), vec![]), None);
        assert_eq!(name_in(b"not a certificate"), None);
    }
}
