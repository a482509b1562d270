//! The CSI endpoint: a unix socket named `unix:///path` (or a bare path).

use std::io;
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

/// Parses `unix:///csi/csi.sock`, `unix:/csi/csi.sock` or `/csi/csi.sock`.
pub fn parse(endpoint: &str) -> Result<PathBuf, String> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if !path.starts_with('/') {
        return Err(format!(
            "CSI endpoint {endpoint:?} must be an absolute unix socket path like unix:///csi/csi.sock"
        ));
    }
    Ok(PathBuf::from(path))
}

/// Binds the socket, replacing a stale socket file left by a previous process and creating the
/// parent directory.
pub fn bind(path: &Path) -> io::Result<UnixListenerStream> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(UnixListenerStream::new(UnixListener::bind(path)?))
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints() {
        assert_eq!(
            parse("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            parse("unix:/csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            parse("/csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert!(parse("tcp://127.0.0.1:10000").is_err());
        assert!(parse("unix://relative.sock").is_err());
    }

    #[tokio::test]
    async fn rebinds_over_a_stale_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/csi.sock");
        let first = bind(&path).unwrap();
        drop(first);
        bind(&path).unwrap();
    }
}
