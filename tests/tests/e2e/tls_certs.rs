//! Certificates for the TLS tests (PostgreSQL's and Redis's): a CA, a server certificate for
//! `localhost` / 127.0.0.1 signed by it, and an unrelated CA, generated with rcgen (no `openssl`
//! binary needed), as PEM files in a fresh directory removed on drop.

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// The PEM files: `ca.crt`, `other-ca.crt`, `server.crt`, `server.key`.
pub struct Certs {
    dir: PathBuf,
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Certs {
    /// The path of file `name`.
    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// The contents of file `name`.
    pub fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).unwrap()
    }
}

/// A CA, a server certificate for `localhost` / 127.0.0.1 signed by it, and an unrelated CA,
/// generated with rcgen (ECDSA P-256), as PEM files in a fresh directory.
pub fn make_certs() -> Certs {
    let dir = std::env::temp_dir().join(format!(
        "idem-tls-{}-{}",
        std::process::id(),
        idempotency_actix::store::ReservationToken::random().as_uuid()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let certs = Certs { dir: dir.clone() };
    let write = |name: &str, pem: String| std::fs::write(dir.join(name), pem).unwrap();

    let ca_params = |cn: &str| {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params
    };
    let ca_key = KeyPair::generate().unwrap();
    let ca = CertifiedIssuer::self_signed(ca_params("idempotency test CA"), ca_key).unwrap();
    write("ca.crt", ca.pem());
    let other_key = KeyPair::generate().unwrap();
    let other = ca_params("some other CA").self_signed(&other_key).unwrap();
    write("other-ca.crt", other.pem());

    let mut server =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    server
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    server.is_ca = IsCa::ExplicitNoCa;
    server.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_key = KeyPair::generate().unwrap();
    let server_cert = server.signed_by(&server_key, &ca).unwrap();
    write("server.crt", server_cert.pem());
    write("server.key", server_key.serialize_pem());
    certs
}
