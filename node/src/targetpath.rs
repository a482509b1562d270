//! Kubelet target paths: a target must lie below the kubelet root, with no `..` or relative parts,
//! and is never a symlink.
//!
//! Kubelet publishes a CSI volume at
//! `<root>/pods/<pod-uid>/volumes/kubernetes.io~csi/<pv-name>/mount`; [`pod_uid`] reads the pod uid
//! back for logs and, later, per-pod credentials. The parent is resolved ([`resolve`]); the last
//! component is looked at, never followed ([`inspect`]): a symlink there could point anywhere on
//! the host.

use std::path::{Path, PathBuf};

use ferry_csi::error::quote;
use ferry_csi::CsiError;

/// The longest name of one path component (`NAME_MAX`).
const NAME_MAX: usize = 255;
/// The longest path (`PATH_MAX` less its NUL).
const PATH_MAX: usize = 4095;

/// Checks that `target` is an absolute, normal path strictly below `root` that the kernel can
/// take: no NUL, no component over 255 bytes, at most 4095 bytes in all.
pub fn check(root: &Path, target: &str) -> Result<PathBuf, CsiError> {
    let path = Path::new(target);
    let bad = |why: &str| {
        Err(CsiError::InvalidArgument(format!(
            "target_path {} {why}",
            quote(target)
        )))
    };
    if target.contains('\0') {
        return bad("contains a NUL byte");
    }
    if target.len() > PATH_MAX {
        return bad(&format!("is longer than {PATH_MAX} bytes"));
    }
    if target.split('/').any(|s| s.len() > NAME_MAX) {
        return bad(&format!("has a component longer than {NAME_MAX} bytes"));
    }
    if !path.is_absolute() {
        return bad("must be absolute");
    }
    if target.split('/').any(|s| s == "." || s == "..") {
        return bad("must not contain '.' or '..'");
    }
    if !path.starts_with(root) || path == root {
        return bad(&format!("is outside the kubelet root {}", root.display()));
    }
    Ok(path.to_path_buf())
}

/// Resolves symlinks in the target's parent so the path used for mounting, mountinfo lookups and
/// removal is the one the kernel reports, and checks that it still lies below the (canonical)
/// kubelet root. The last component is not resolved (see [`inspect`]). `Ok(None)`: the parent
/// does not exist, so nothing can be mounted there.
pub fn resolve(canonical_root: &Path, target: &Path) -> Result<Option<PathBuf>, CsiError> {
    let shown = || quote(&target.to_string_lossy()).to_string();
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(CsiError::InvalidArgument(format!(
            "target_path {} has no parent directory",
            shown()
        )));
    };
    let parent = match std::fs::canonicalize(parent) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            return Err(CsiError::InvalidArgument(format!(
                "target_path {}: a parent is not a directory",
                shown()
            )))
        }
        Err(e) => {
            return Err(CsiError::Internal(format!(
                "resolving the parent of target_path {}: {e}",
                shown()
            )))
        }
    };
    if !parent.starts_with(canonical_root) {
        return Err(CsiError::InvalidArgument(format!(
            "target_path {} resolves outside the kubelet root {}",
            shown(),
            canonical_root.display()
        )));
    }
    Ok(Some(parent.join(name)))
}

/// What is at a (resolved) target path, looked at without following a symlink there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Nothing,
    Directory,
    /// A symlink: Ferry neither mounts through it nor removes it.
    Symlink,
    /// A file, socket, device…
    Other,
}

/// `lstat`s `target`. A dead FUSE mount there (`ENOTCONN`) counts as a directory.
pub fn inspect(target: &Path) -> Result<Found, CsiError> {
    match std::fs::symlink_metadata(target) {
        Ok(m) if m.file_type().is_symlink() => Ok(Found::Symlink),
        Ok(m) if m.is_dir() => Ok(Found::Directory),
        Ok(_) => Ok(Found::Other),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Found::Nothing),
        // The root of a dead FUSE mount (its server exited): a mount point, so a directory;
        // mountinfo tells whose.
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => Ok(Found::Directory),
        Err(e) => Err(CsiError::Internal(format!(
            "looking at target_path {}: {e}",
            quote(&target.to_string_lossy())
        ))),
    }
}

/// Whether the directory at `target` has any entry (`false` when there is nothing at `target`).
/// Only for a target [`inspect`] found to be a directory, with nothing mounted on it.
pub fn has_entries(target: &Path) -> Result<bool, CsiError> {
    match std::fs::read_dir(target) {
        Ok(mut entries) => Ok(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(CsiError::Internal(format!(
            "reading target directory {}: {e}",
            quote(&target.to_string_lossy())
        ))),
    }
}

/// The pod uid in a kubelet target path, if it has the usual shape.
pub fn pod_uid<'a>(root: &Path, target: &'a Path) -> Option<&'a str> {
    let rel = target.strip_prefix(root).ok()?;
    let mut parts = rel.iter();
    if parts.next()? != "pods" {
        return None;
    }
    parts.next()?.to_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_symlinks_and_refuses_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kubelet");
        std::fs::create_dir_all(root.join("pods/p")).unwrap();
        std::fs::create_dir_all(dir.path().join("outside")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("outside"), root.join("pods/escape")).unwrap();
        let root = std::fs::canonicalize(&root).unwrap();
        assert_eq!(
            resolve(&root, &root.join("pods/p/mount")).unwrap(),
            Some(root.join("pods/p/mount"))
        );
        assert!(resolve(&root, &root.join("pods/escape/mount")).is_err());
        assert_eq!(
            resolve(&root, &root.join("pods/missing/mount")).unwrap(),
            None
        );
    }

    #[test]
    fn inspects_without_following() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("f"), b"").unwrap();
        std::os::unix::fs::symlink(dir.path().join("d"), dir.path().join("l")).unwrap();
        let at = |n: &str| inspect(&dir.path().join(n)).unwrap();
        assert_eq!(
            (at("d"), at("f"), at("l"), at("none")),
            (
                Found::Directory,
                Found::Other,
                Found::Symlink,
                Found::Nothing
            )
        );
    }

    #[test]
    fn entries_of_a_target() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("d");
        assert!(!has_entries(&d).unwrap(), "nothing there");
        std::fs::create_dir(&d).unwrap();
        assert!(!has_entries(&d).unwrap(), "an empty directory");
        std::fs::write(d.join(".hidden"), b"").unwrap();
        assert!(has_entries(&d).unwrap(), "a dot file counts");
    }

    #[test]
    fn impossible_paths_are_invalid_arguments_quoted_short() {
        let root = Path::new("/var/lib/kubelet");
        let base = "/var/lib/kubelet/pods/1234/volumes/kubernetes.io~csi/pv-1";
        for bad in [
            format!("{base}/{}", "m".repeat(300)),
            format!("{base}/mo\0unt"),
            format!("{base}/{}", ["x"; 3000].join("/")),
            format!("{base}/{}", "m".repeat(1 << 20)),
        ] {
            match check(root, &bad) {
                Err(CsiError::InvalidArgument(m)) => {
                    // The quote's 256 characters, its ellipsis and length, and the reason.
                    assert!(m.len() < 450, "{} bytes: {}", m.len(), &m[..450]);
                    assert!(m.contains("target_path"), "{m}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn targets() {
        let root = Path::new("/var/lib/kubelet");
        let t = "/var/lib/kubelet/pods/1234/volumes/kubernetes.io~csi/pv-1/mount";
        assert_eq!(check(root, t).unwrap(), PathBuf::from(t));
        assert_eq!(pod_uid(root, Path::new(t)), Some("1234"));
        for bad in [
            "relative/path",
            "/etc/passwd",
            "/var/lib/kubelet",
            "/var/lib/kubelet/../../etc",
            "/var/lib/kubeletx/pods/a",
            "/var/lib/kubelet/./pods",
        ] {
            assert!(check(root, bad).is_err(), "{bad}");
        }
    }
}
