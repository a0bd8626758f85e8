//! Test certificates made at test time (rcgen) and a TLS front: a real rustls server
//! that terminates TLS (optionally requiring a client certificate) and relays the
//! plaintext to a mock engine, as a TLS-terminating sidecar in front of vLLM does.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};

/// PEM files in a folder: two CAs, an engine certificate for `localhost` and
/// 127.0.0.1 signed by the first, and a client certificate signed by it.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

fn ca(name: &str) -> (CertificateParams, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    (params, key)
}

fn leaf(names: &[&str], usage: ExtendedKeyUsagePurpose) -> (CertificateParams, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let mut params = CertificateParams::new(names).unwrap();
    params.extended_key_usages = vec![usage];
    (params, key)
}

/// Makes the files in a new folder under the system's temp dir.
pub fn make_pki(tag: &str) -> Pki {
    make_pki_for(tag, &["localhost", "127.0.0.1"])
}

/// [`make_pki`] with an engine certificate for `names` alone.
pub fn make_pki_for(tag: &str, names: &[&str]) -> Pki {
    make_pki_until(tag, names, None)
}

/// [`make_pki_for`] with an engine certificate valid until 00:00 UTC of `not_after`
/// (year, month, day; without, rcgen's default: 4096-01-01).
pub fn make_pki_until(tag: &str, names: &[&str], not_after: Option<(i32, u8, u8)>) -> Pki {
    let dir = std::env::temp_dir().join(format!("prefixlb-pki-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
    let (ca_params, ca_key) = ca("prefixlb test CA");
    write("ca.pem", &ca_params.self_signed(&ca_key).unwrap().pem());
    let (other_params, other_key) = ca("another CA");
    write(
        "other-ca.pem",
        &other_params.self_signed(&other_key).unwrap().pem(),
    );
    let issuer = Issuer::new(ca_params, ca_key);
    let (mut server, server_key) = leaf(names, ExtendedKeyUsagePurpose::ServerAuth);
    if let Some((y, m, d)) = not_after {
        server.not_after = rcgen::date_time_ymd(y, m, d);
    }
    write(
        "engine.pem",
        &server.signed_by(&server_key, &issuer).unwrap().pem(),
    );
    write("engine-key.pem", &server_key.serialize_pem());
    let (mut client, client_key) = leaf(&[], ExtendedKeyUsagePurpose::ClientAuth);
    client
        .distinguished_name
        .push(DnType::CommonName, "prefixlb");
    write(
        "client.pem",
        &client.signed_by(&client_key, &issuer).unwrap().pem(),
    );
    write("client-key.pem", &client_key.serialize_pem());
    Pki { dir }
}

fn certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// A TLS server on a loopback port relaying each connection's plaintext to `engine`;
/// with `client_ca`, it requires a client certificate that CA signed.
pub async fn tls_front(pki: &Pki, engine: SocketAddr, client_ca: bool) -> SocketAddr {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    tls_front_on(pki, engine, any, client_ca).await
}

/// [`tls_front`] listening on `listen`.
pub async fn tls_front_on(
    pki: &Pki,
    engine: SocketAddr,
    listen: SocketAddr,
    client_ca: bool,
) -> SocketAddr {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = if client_ca {
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(&pki.path("ca.pem")) {
            roots.add(c).unwrap();
        }
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let key = PrivateKeyDer::from_pem_file(pki.path("engine-key.pem")).unwrap();
    let config = builder
        .with_single_cert(certs(&pki.path("engine.pem")), key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind(listen).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(sock).await else {
                    return;
                };
                let Ok(mut plain) = TcpStream::connect(engine).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    addr
}
