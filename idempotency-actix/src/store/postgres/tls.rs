//! Connection URLs and TLS: what `sslmode` means here, and how a connection is opened.
//!
//! tokio-postgres understands `sslmode=disable|prefer|require` only and rejects every option it
//! does not know (`sslrootcert`, `verify-full`, ...), so the libpq-style SSL options are taken
//! out of the URL here, interpreted, and turned into a rustls configuration (ring provider):
//!
//! | `sslmode`                 | encrypted            | certificate checked                    |
//! |---------------------------|----------------------|----------------------------------------|
//! | absent, `disable`, `allow`| no                   | -                                      |
//! | `prefer`                  | if the server offers | no (as libpq)                          |
//! | `require`                 | yes                  | no; with `sslrootcert`: chain (libpq)  |
//! | `verify-ca`               | yes                  | chain against the roots, not the name  |
//! | `verify-full`             | yes                  | chain and host name                    |
//!
//! Roots are the file named by `sslrootcert` (PEM, one or more certificates), or the system's
//! trust store (`rustls-native-certs`) when it is absent or `sslrootcert=system`. libpq would
//! read `~/.postgresql/root.crt` instead; the system store is what managed PostgreSQL services
//! (RDS, Cloud SQL, Azure, Supabase, Neon) chain to, so it is the more useful default for a
//! server process. Client certificates (`sslcert`/`sslkey`) are not supported and are reported
//! as an error rather than silently ignored.

use std::sync::Arc;

use diesel::ConnectionError;
use diesel_async::AsyncPgConnection;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres::config::SslMode;
use tokio_postgres::NoTls;
use tokio_postgres_rustls::MakeRustlsConnect;

/// What `sslmode` asked for, after libpq's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// A parsed connection URL: the tokio-postgres configuration plus the TLS setup to use with it.
/// Built once per pool (loading the system trust store reads files), cloned per connection.
#[derive(Clone)]
pub(crate) struct ConnectTarget {
    config: tokio_postgres::Config,
    tls: Option<Arc<ClientConfig>>,
}

impl std::fmt::Debug for ConnectTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the config: it holds the password.
        f.debug_struct("ConnectTarget")
            .field("hosts", &self.config.get_hosts())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// A URL that cannot be used, with a message that never repeats the password.
#[derive(Debug, thiserror::Error)]
#[error("invalid database URL: {0}")]
pub(crate) struct UrlError(String);

impl ConnectTarget {
    /// Append a server setting to the startup `options` (`-c name=value`): applied by the
    /// server at login, so it costs no round trip.
    pub(crate) fn append_option(&mut self, option: &str) {
        let options = match self.config.get_options() {
            Some(existing) if !existing.is_empty() => format!("{existing} {option}"),
            _ => option.to_owned(),
        };
        self.config.options(options);
    }

    /// Parse `url` (`postgres://` / `postgresql://` URL or libpq `key=value` string).
    /// `statement_timeout` is appended to the startup `options`, so it costs no round trip.
    pub(crate) fn parse(
        url: &str,
        statement_timeout: Option<std::time::Duration>,
    ) -> Result<Self, UrlError> {
        let (rest, ssl) = split_ssl_params(url)?;
        let mut config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e: tokio_postgres::Error| UrlError(e.to_string()))?;
        if let Some(timeout) = statement_timeout {
            let ms = timeout.as_millis().max(1);
            let extra = format!("-c statement_timeout={ms}");
            let options = match config.get_options() {
                Some(existing) if !existing.is_empty() => format!("{existing} {extra}"),
                _ => extra,
            };
            config.options(options);
        }
        let mode = match ssl.mode.as_deref() {
            None | Some("disable") | Some("allow") => Mode::Disable,
            Some("prefer") => Mode::Prefer,
            // libpq: `require` with a root certificate file behaves like verify-ca.
            Some("require") if ssl.rootcert.as_deref().is_some_and(|r| r != "system") => {
                Mode::VerifyCa
            }
            Some("require") => Mode::Require,
            Some("verify-ca") => Mode::VerifyCa,
            Some("verify-full") => Mode::VerifyFull,
            Some(other) => return Err(UrlError(format!("unknown sslmode `{other}`"))),
        };
        if ssl.client_cert {
            return Err(UrlError(
                "client certificates (sslcert/sslkey) are not supported".into(),
            ));
        }
        let tls = match mode {
            Mode::Disable => {
                config.ssl_mode(SslMode::Disable);
                None
            }
            Mode::Prefer => {
                config.ssl_mode(SslMode::Prefer);
                Some(Arc::new(client_config(Verify::Nothing)?))
            }
            Mode::Require => {
                config.ssl_mode(SslMode::Require);
                Some(Arc::new(client_config(Verify::Nothing)?))
            }
            Mode::VerifyCa | Mode::VerifyFull => {
                config.ssl_mode(SslMode::Require);
                let roots = load_roots(ssl.rootcert.as_deref())?;
                let verify = if mode == Mode::VerifyCa {
                    Verify::Chain(roots)
                } else {
                    Verify::ChainAndName(roots)
                };
                Some(Arc::new(client_config(verify)?))
            }
        };
        Ok(Self { config, tls })
    }

    /// Whether connections will be encrypted (always, or when the server offers it).
    #[cfg(test)]
    pub(crate) fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Open one connection and hand it to diesel-async, which drives it on the current runtime.
    pub(crate) async fn connect(&self) -> Result<AsyncPgConnection, ConnectionError> {
        match &self.tls {
            None => {
                let (client, connection) =
                    self.config.connect(NoTls).await.map_err(connect_error)?;
                AsyncPgConnection::try_from_client_and_connection(client, connection).await
            }
            Some(tls) => {
                let (client, connection) = self
                    .config
                    .connect(MakeRustlsConnect::new(ClientConfig::clone(tls)))
                    .await
                    .map_err(connect_error)?;
                AsyncPgConnection::try_from_client_and_connection(client, connection).await
            }
        }
    }
}

#[derive(Default)]
struct SslParams {
    mode: Option<String>,
    rootcert: Option<String>,
    client_cert: bool,
}

/// SSL options tokio-postgres does not know and would reject; interpreted here instead.
/// `sslcompression`, `sslcrl`, `sslsni` and friends are accepted and ignored: compression is
/// never negotiated by rustls, SNI is always sent for host names.
const IGNORED_SSL_KEYS: &[&str] = &[
    "sslcompression",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "sslpassword",
];

fn take_ssl_param(ssl: &mut SslParams, key: &str, value: String) -> bool {
    match key {
        "sslmode" => ssl.mode = Some(value),
        "sslrootcert" => ssl.rootcert = Some(value),
        "sslcert" | "sslkey" => ssl.client_cert = true,
        k if IGNORED_SSL_KEYS.contains(&k) => {}
        _ => return false,
    }
    true
}

/// Remove the SSL options from a URL or key/value string; return the rest and the options.
fn split_ssl_params(url: &str) -> Result<(String, SslParams), UrlError> {
    let mut ssl = SslParams::default();
    let trimmed = url.trim();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let Some((base, query)) = trimmed.split_once('?') else {
            return Ok((trimmed.to_owned(), ssl));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decoded = percent_decode(value)
                .ok_or_else(|| UrlError(format!("bad percent-encoding in `{key}`")))?;
            if !take_ssl_param(&mut ssl, key, decoded) {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        Ok((rest, ssl))
    } else {
        // libpq key/value form. Quoted values with spaces are not supported here; a value
        // containing `=` or a quote is passed through to tokio-postgres untouched.
        let mut kept = Vec::new();
        for token in trimmed.split_whitespace() {
            match token.split_once('=') {
                Some((key, value)) if take_ssl_param(&mut ssl, key, value.to_owned()) => {}
                _ => kept.push(token),
            }
        }
        Ok((kept.join(" "), ssl))
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

enum Verify {
    /// libpq `require`/`prefer`: encrypt, but accept any certificate.
    Nothing,
    /// `verify-ca`: the chain must lead to a root; the name is not checked.
    Chain(RootCertStore),
    /// `verify-full`: chain and host name.
    ChainAndName(RootCertStore),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn client_config(verify: Verify) -> Result<ClientConfig, UrlError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| UrlError(format!("TLS setup failed: {e}")))?;
    let config = match verify {
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoCertificateCheck(provider)))
            .with_no_client_auth(),
        Verify::ChainAndName(roots) => builder.with_root_certificates(roots).with_no_client_auth(),
        Verify::Chain(roots) => {
            let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| UrlError(format!("TLS setup failed: {e}")))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
                .with_no_client_auth()
        }
    };
    Ok(config)
}

fn load_roots(rootcert: Option<&str>) -> Result<RootCertStore, UrlError> {
    let mut roots = RootCertStore::empty();
    match rootcert {
        Some(path) if path != "system" => {
            let pem = std::fs::read(path)
                .map_err(|e| UrlError(format!("cannot read sslrootcert `{path}`: {e}")))?;
            let mut reader = pem.as_slice();
            for cert in rustls_pemfile::certs(&mut reader) {
                let cert =
                    cert.map_err(|e| UrlError(format!("bad certificate in `{path}`: {e}")))?;
                roots
                    .add(cert)
                    .map_err(|e| UrlError(format!("bad certificate in `{path}`: {e}")))?;
            }
            if roots.is_empty() {
                return Err(UrlError(format!(
                    "no certificate found in sslrootcert `{path}`"
                )));
            }
        }
        _ => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(UrlError(
                    "sslmode verify-ca/verify-full needs trusted roots, and the system trust \
                     store is empty: install ca-certificates or pass sslrootcert=<file>"
                        .into(),
                ));
            }
        }
    }
    Ok(roots)
}

/// Accepts any certificate, but still checks the handshake signatures (so the session is at
/// least bound to the key in the presented certificate). This is libpq's `sslmode=require`.
#[derive(Debug)]
struct NoCertificateCheck(Arc<CryptoProvider>);

impl ServerCertVerifier for NoCertificateCheck {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the full WebPKI check, except that a name mismatch is forgiven.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// tokio-postgres displays only "db error" or "error connecting to server"; the reason (wrong
/// password, unknown database, refused) is in the source chain, which operators need to see.
fn connect_error(error: tokio_postgres::Error) -> ConnectionError {
    let mut message = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    ConnectionError::BadConnection(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssl_params_are_taken_out_of_urls() {
        let (rest, ssl) = split_ssl_params(
            "postgres://u:p@db.example.com:5432/app?sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u:p@db.example.com:5432/app?application_name=x"
        );
        assert_eq!(ssl.mode.as_deref(), Some("verify-full"));
        assert_eq!(ssl.rootcert.as_deref(), Some("/tmp/ca.pem"));
    }

    #[test]
    fn ssl_params_are_taken_out_of_key_value_strings() {
        let (rest, ssl) = split_ssl_params("host=localhost sslmode=require dbname=app").unwrap();
        assert_eq!(rest, "host=localhost dbname=app");
        assert_eq!(ssl.mode.as_deref(), Some("require"));
    }

    #[test]
    fn modes_map_to_tls_or_not() {
        let plain = ConnectTarget::parse("postgres://u@localhost/db", None).unwrap();
        assert!(!plain.uses_tls());
        let disabled =
            ConnectTarget::parse("postgres://u@localhost/db?sslmode=disable", None).unwrap();
        assert!(!disabled.uses_tls());
        let required =
            ConnectTarget::parse("postgres://u@localhost/db?sslmode=require", None).unwrap();
        assert!(required.uses_tls());
        assert!(ConnectTarget::parse("postgres://u@localhost/db?sslmode=bogus", None).is_err());
        assert!(ConnectTarget::parse("postgres://u@localhost/db?sslcert=/x", None).is_err());
        assert!(ConnectTarget::parse(
            "postgres://u@localhost/db?sslmode=verify-full&sslrootcert=/nonexistent",
            None
        )
        .is_err());
    }

    #[test]
    fn statement_timeout_is_appended_to_options() {
        let t = ConnectTarget::parse(
            "postgres://u@localhost/db?options=-c%20search_path%3Dx",
            Some(std::time::Duration::from_secs(5)),
        )
        .unwrap();
        assert_eq!(
            t.config.get_options(),
            Some("-c search_path=x -c statement_timeout=5000")
        );
    }
}
