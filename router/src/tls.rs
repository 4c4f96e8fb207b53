//! TLS on the gateway's listeners, with rustls: one certificate for every listener, read from
//! its files at start and at each reload (connections already open keep theirs), and the
//! trust for `https://` replicas.

use crate::config::TlsConfig;
use pingora_core::listeners::tls::TlsSettings;
use pingora_core::protocols::ALPN;
use pingora_rustls::sign::CertifiedKey;
use pingora_rustls::{ClientHello, CryptoProvider, ResolvesServerCert};
use std::sync::{Arc, PoisonError, RwLock};

/// The certificate the listeners present, swapped on reload.
#[derive(Debug)]
pub struct Certificate {
    current: RwLock<Arc<CertifiedKey>>,
}

impl Certificate {
    pub fn load(config: &TlsConfig) -> Result<Certificate, String> {
        Ok(Certificate {
            current: RwLock::new(certified_key(config)?),
        })
    }

    /// Reads the files again; on any error the certificate in use is kept.
    pub fn reload(&self, config: &TlsConfig) -> Result<(), String> {
        let key = certified_key(config)?;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = key;
        Ok(())
    }

    /// The listener settings that present this certificate (HTTP/2 offered by ALPN).
    pub fn settings(self: &Arc<Self>) -> Result<TlsSettings, String> {
        // With a resolver the paths are never read.
        let mut settings = TlsSettings::intermediate("", "").map_err(|e| e.to_string())?;
        settings.set_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        settings.set_alpn(ALPN::H2H1);
        Ok(settings)
    }
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(
            &self.current.read().unwrap_or_else(PoisonError::into_inner),
        ))
    }
}

/// The certificate chain and key of `config`, checked to belong together.
fn certified_key(config: &TlsConfig) -> Result<Arc<CertifiedKey>, String> {
    pingora_rustls::install_default_crypto_provider();
    let (cert, key) = (config.cert_file.display(), config.key_file.display());
    let (chain, private) =
        pingora_rustls::load_certs_and_key_files(&cert.to_string(), &key.to_string())
            .map_err(|e| format!("{cert} / {key}: {e}"))?
            .ok_or_else(|| format!("{cert} holds no certificate, or {key} no private key (PEM)"))?;
    let provider = CryptoProvider::get_default().ok_or("no TLS crypto provider installed")?;
    let signer = provider
        .key_provider
        .load_private_key(private)
        .map_err(|e| format!("{key}: {e}"))?;
    let certified = CertifiedKey::new(chain, signer);
    certified
        .keys_match()
        .map_err(|e| format!("{key} is not the key of {cert}: {e}"))?;
    Ok(Arc::new(certified))
}
