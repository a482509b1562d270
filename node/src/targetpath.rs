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
