//! TLS material checked when the config is loaded, so a bad file is a clear start-up error rather
//! than a failure (or, inside pingora's connector, a panic) when the first connection is made.

use std::path::Path;

use anyhow::{Context, bail};
use pingora::tls::{RootCertStore, load_ca_file_into_store, load_certs_and_key_files};

/// `path` is a PEM file of one or more CA certificates.
pub fn check_ca_file(path: &Path) -> anyhow::Result<()> {
    let text = path_text(path)?;
    let mut store = RootCertStore::empty();
    load_ca_file_into_store(text, &mut store)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{} is not a PEM file of CA certificates", path.display()))?;
    if store.is_empty() {
        bail!("{} holds no certificate", path.display());
    }
    Ok(())
}

/// `cert` is a PEM certificate chain and `key` its PEM private key.
pub fn check_server_files(cert: &Path, key: &Path) -> anyhow::Result<()> {
    let loaded = load_certs_and_key_files(path_text(cert)?, path_text(key)?)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| {
            format!(
                "reading the certificate {} and the key {}",
                cert.display(),
                key.display()
            )
        })?;
    match loaded {
        Some((certs, _)) if !certs.is_empty() => Ok(()),
        _ => bail!(
            "{} holds no certificate or {} no private key",
            cert.display(),
            key.display()
        ),
    }
}

/// pingora takes paths as strings; a path that is not UTF-8 cannot be handed to it.
fn path_text(path: &Path) -> anyhow::Result<&str> {
    if !path.is_file() {
        bail!("{} is not a file", path.display());
    }
    path.to_str()
        .with_context(|| format!("{} is not a UTF-8 path", path.display()))
}
