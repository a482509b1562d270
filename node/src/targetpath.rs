//! Kubelet target paths: a target must lie below the kubelet root, with no `..` or relative parts.
//!
//! Kubelet publishes a CSI volume at
//! `<root>/pods/<pod-uid>/volumes/kubernetes.io~csi/<pv-name>/mount`; [`pod_uid`] reads the pod uid
//! back for logs and, later, per-pod credentials.

use std::path::{Path, PathBuf};

use ferry_csi::CsiError;

/// Checks that `target` is an absolute, normal path strictly below `root`.
pub fn check(root: &Path, target: &str) -> Result<PathBuf, CsiError> {
    let path = Path::new(target);
    let bad = |why: &str| {
        Err(CsiError::InvalidArgument(format!(
            "target_path {target:?} {why}"
        )))
    };
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
/// kubelet root. `Ok(None)`: the parent does not exist, so nothing can be mounted there.
pub fn resolve(canonical_root: &Path, target: &Path) -> Result<Option<PathBuf>, CsiError> {
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(CsiError::InvalidArgument(format!(
            "target_path {} has no parent directory",
            target.display()
        )));
    };
    let parent = match std::fs::canonicalize(parent) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(CsiError::Internal(format!(
                "resolving {}: {e}",
                parent.display()
            )))
        }
    };
    if !parent.starts_with(canonical_root) {
        return Err(CsiError::InvalidArgument(format!(
            "target_path {} resolves outside the kubelet root {}",
            target.display(),
            canonical_root.display()
        )));
    }
    Ok(Some(parent.join(name)))
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
