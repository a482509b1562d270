//! Reads `/proc/self/mountinfo` to tell whether (and what) a path is a mount point, and detaches
//! stale mounts. Used by `mount` and by the node plugin.

use std::io;
use std::path::Path;

/// Unescapes the octal escapes (`\040` for a space) mountinfo uses in paths.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            if let Some(v) = std::str::from_utf8(&b[i + 1..i + 4])
                .ok()
                .and_then(|o| u8::from_str_radix(o, 8).ok())
            {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One mount: its mount point and filesystem type (e.g. `fuse.ferry`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: String,
    pub fs_type: String,
    pub source: String,
}

/// Parses mountinfo text.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let mount_point = unescape(pre.split(' ').nth(4)?);
            let mut post = post.split(' ');
            let fs_type = post.next()?.to_string();
            let source = unescape(post.next().unwrap_or(""));
            Some(MountEntry {
                mount_point,
                fs_type,
                source,
            })
        })
        .collect()
}

/// The mounts of this process's mount namespace.
pub fn mounts() -> io::Result<Vec<MountEntry>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// Whether `path` is a mount point (the last mount at that path wins).
pub fn mounted_at(path: &Path) -> io::Result<Option<MountEntry>> {
    let p = path.to_string_lossy();
    Ok(mounts()?.into_iter().rev().find(|m| m.mount_point == p))
}

/// Detaches whatever is mounted at `path` (MNT_DETACH: a dead FUSE mount left by a previous node
/// plugin process cannot be unmounted any other way while something still holds it).
pub fn detach(path: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: `c` is a valid NUL-terminated path that lives across the call.
    let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mountinfo() {
        let text = "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    40 36 0:44 / /var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount rw,nosuid,nodev shared:5 - fuse.ferry ferry:data/p/ rw,user_id=0";
        let m = parse(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, "/mnt/with space");
        assert_eq!(m[1].fs_type, "fuse.ferry");
        assert_eq!(m[1].source, "ferry:data/p/");
    }
}
