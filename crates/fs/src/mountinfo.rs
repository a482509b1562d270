//! Reads `/proc/self/mountinfo` to tell whether (and what) a path is a mount point, unmounts
//! without following symlinks, and aborts FUSE connections. Used by `mount` and by the node plugin.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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

/// The filesystem type of Ferry's own mounts, as mountinfo shows it.
pub const FERRY_FS_TYPE: &str = "fuse.ferry";

/// One mount: its mount point, filesystem type (e.g. `fuse.ferry`), source and device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// The mount's id (the `mnt_id` of a descriptor's `fdinfo` on it).
    pub id: u64,
    pub mount_point: String,
    pub fs_type: String,
    pub source: String,
    /// The superblock's device (`st_dev` of the mount's root): for FUSE, major 0 and the
    /// connection number (`/sys/fs/fuse/connections/<minor>`) as minor.
    pub dev: (u32, u32),
}

impl MountEntry {
    /// Whether this is a Ferry mount (live, or left dead by an earlier process).
    pub fn is_ferry(&self) -> bool {
        self.fs_type == FERRY_FS_TYPE
    }
}

/// Parses mountinfo text.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let mut fields = pre.split(' ');
            let id = fields.next()?.parse().ok()?;
            let (major, minor) = fields.nth(1)?.split_once(':')?;
            let dev = (major.parse().ok()?, minor.parse().ok()?);
            let mount_point = unescape(fields.nth(1)?);
            let mut post = post.split(' ');
            let fs_type = post.next()?.to_string();
            let source = unescape(post.next().unwrap_or(""));
            Some(MountEntry {
                id,
                mount_point,
                fs_type,
                source,
                dev,
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

/// Unmounts whatever is mounted on top at `path`, never following a symlink there
/// (`UMOUNT_NOFOLLOW`). `lazy` (`MNT_DETACH`) detaches it even while it is busy (a dead FUSE mount
/// left by an earlier process cannot be unmounted any other way while something holds it);
/// otherwise a busy mount fails with `EBUSY`.
pub fn unmount(path: &Path, lazy: bool) -> io::Result<()> {
    use nix::mount::MntFlags;
    let mut flags = MntFlags::UMOUNT_NOFOLLOW;
    if lazy {
        flags |= MntFlags::MNT_DETACH;
    }
    Ok(nix::mount::umount2(path, flags)?)
}

/// Detaches whatever is mounted at `path` (`MNT_DETACH`, not following a symlink).
pub fn detach(path: &Path) -> io::Result<()> {
    unmount(path, true)
}

/// Where the kernel lists FUSE connections (the `fusectl` filesystem) by convention.
const FUSE_CONNECTIONS: &str = "/sys/fs/fuse/connections";

/// Where `fusectl` is mounted in this namespace. If it is not (a container's own `/sys` lacks it),
/// it is mounted at its usual place, once, when this process may (root).
fn fusectl() -> Option<PathBuf> {
    static TRIED: OnceLock<()> = OnceLock::new();
    let find = || {
        mounts()
            .ok()?
            .into_iter()
            .find(|m| m.fs_type == "fusectl")
            .map(|m| PathBuf::from(m.mount_point))
    };
    if let Some(p) = find() {
        return Some(p);
    }
    TRIED.get_or_init(|| {
        use nix::mount::MsFlags;
        match nix::mount::mount(
            Some("fusectl"),
            FUSE_CONNECTIONS,
            Some("fusectl"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None::<&str>,
        ) {
            Ok(()) => {
                tracing::info!("mounted fusectl at {FUSE_CONNECTIONS} (to end FUSE connections)")
            }
            Err(e) => {
                tracing::info!(error = %e, "cannot mount fusectl: FUSE connections cannot be aborted")
            }
        }
    });
    find()
}

/// Whether FUSE connection `conn` (a FUSE mount's device minor) still exists: `None` when it
/// cannot be told (`fusectl` unavailable).
pub fn connection_alive(conn: u32) -> Option<bool> {
    Some(fusectl()?.join(conn.to_string()).exists())
}

/// FUSE connection `conn`'s `abort` file, opened while the connection exists (take `conn` from a
/// mount that is still there). Connection numbers are device minors, which the kernel hands out
/// again once a connection is gone; a file opened before then stays bound to its own connection:
/// when that connection is removed, `fusectl` detaches the file from it, and writing to it then
/// does nothing. So [`ConnectionAbort::abort`] never ends another mount's connection.
#[derive(Debug)]
pub struct ConnectionAbort(std::fs::File);

impl ConnectionAbort {
    /// Opens `conn`'s abort file (`NotFound` when `fusectl` is unavailable or `conn` is gone).
    pub fn open(conn: u32) -> io::Result<ConnectionAbort> {
        let dir = fusectl().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "fusectl is not mounted (/sys/fs/fuse/connections)",
            )
        })?;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(conn.to_string()).join("abort"))?;
        Ok(ConnectionAbort(file))
    }

    /// Aborts the connection, if it still exists: every request in flight and every later one on
    /// any copy of the mount fails with `ENOTCONN`, and the serving session's reads end (`ENODEV`).
    pub fn abort(&self) -> io::Result<()> {
        use std::io::Write;
        (&self.0).write_all(b"1")
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
        assert_eq!((m[0].dev, m[1].dev), ((98, 0), (0, 44)));
        assert_eq!((m[0].id, m[1].id), (36, 40));
        assert!(m[1].is_ferry() && !m[0].is_ferry());
    }
}
