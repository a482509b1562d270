//! The CSI endpoint: a unix socket named `unix:///path` (or a bare path); and [`OwnedSocket`], a
//! socket file removed at the end only while it is still the one this process bound.

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
///
/// The socket appears at `path` already listening: it is bound under a hidden name beside it and
/// renamed into place. bind(2) creates the file before listen(2) makes it accept, so a client that
/// connects as soon as the file appears (kubelet's plugin watcher reacts to the create event)
/// would otherwise be refused now and then. Kubelet's watcher ignores names starting with a dot.
pub fn bind(path: &Path) -> io::Result<UnixListenerStream> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let hidden = hidden_name(path);
    // sun_path holds 107 bytes and a NUL; a path too long for the hidden name is bound in place.
    let staged = hidden.filter(|h| h.as_os_str().len() < 108);
    let at = staged.as_deref().unwrap_or(path);
    remove_if_present(at)?;
    let listener = UnixListener::bind(at)?;
    if let Some(h) = &staged {
        if let Err(e) = std::fs::rename(h, path) {
            let _ = std::fs::remove_file(h);
            return Err(e);
        }
    }
    Ok(UnixListenerStream::new(listener))
}

/// `<dir>/.<name>.<pid>`: where [`bind`] binds before renaming.
fn hidden_name(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    Some(path.with_file_name(format!(".{name}.{}", std::process::id())))
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// A unix socket file this process bound, known by its device, inode and change time: a
/// successor that binds the same path afterwards (unlink + bind: a new file) keeps its socket when
/// this process removes "its own" on the way out. The change time is part of the identity because
/// a new file often gets the inode number the unlinked one freed.
#[derive(Debug)]
pub struct OwnedSocket {
    path: PathBuf,
    id: FileId,
}

/// Device, inode, and change time (seconds, nanoseconds) of a file.
type FileId = (u64, u64, i64, i64);

impl OwnedSocket {
    /// Binds `path` like [`bind`] (a stale file there is removed first) and remembers which file
    /// it created.
    pub fn bind(path: &Path) -> io::Result<(OwnedSocket, UnixListenerStream)> {
        let incoming = bind(path)?;
        let id = file_id(path)?;
        Ok((
            OwnedSocket {
                path: path.to_path_buf(),
                id,
            },
            incoming,
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `path` still names the socket this process bound (not removed, not replaced).
    pub fn is_ours(&self) -> bool {
        file_id(&self.path).is_ok_and(|id| id == self.id)
    }

    /// Removes the socket file if it is still ours; `Ok(false)` when it is gone or another
    /// process's (left alone).
    pub fn remove(&self) -> io::Result<bool> {
        if !self.is_ours() {
            return Ok(false);
        }
        // The path could be replaced between the check and the unlink; ferry-node's handover
        // keeps that from happening (a successor binds only once this process has exited).
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }
}

fn file_id(path: &Path) -> io::Result<FileId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path)?;
    Ok((m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed by this call, not when the future is
/// first polled: call it before announcing that the process serves, so a SIGTERM sent right after
/// that is not the default action (an exit without cleanup).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        }
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
    async fn an_owned_socket_is_removed_only_while_it_is_ours() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("reg.sock");
        let (old, _old_incoming) = OwnedSocket::bind(&path).unwrap();
        assert!(old.is_ours());
        // A successor takes the path over: unlink + bind.
        let (new, _new_incoming) = OwnedSocket::bind(&path).unwrap();
        assert!(!old.is_ours());
        assert!(!old.remove().unwrap(), "removed the successor's socket");
        assert!(path.exists());
        assert!(new.is_ours());
        assert!(new.remove().unwrap());
        assert!(!path.exists());
        assert!(!new.remove().unwrap());
    }

    #[tokio::test]
    async fn rebinds_over_a_stale_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/csi.sock");
        let first = bind(&path).unwrap();
        drop(first);
        let _second = bind(&path).unwrap();
        // Listening from the moment the file appears, and nothing left under the hidden name.
        std::os::unix::net::UnixStream::connect(&path).unwrap();
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["csi.sock"]);
    }
}
