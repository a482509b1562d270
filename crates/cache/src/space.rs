//! The filesystem holding the cache directory: its free space (`statvfs`), and where it puts the
//! cache's files.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Bytes available to unprivileged users on the filesystem of `path` (`f_bavail * f_frsize`).
pub fn available(path: &Path) -> io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(path)?;
    Ok(st.blocks_available().saturating_mul(st.fragment_size()))
}

/// ext2/3/4's "top of directory hierarchies" flag (`chattr +T`, `FS_TOPDIR_FL` in
/// `linux/fs.h`).
const FS_TOPDIR_FL: libc::c_int = 0x0002_0000;

/// Marks `dir` as the top of directory hierarchies (`chattr +T`), so that ext4 places each
/// subdirectory made in it from now on in a block group of its own choosing, spread over the
/// disk, as it does the root's; files made in a subdirectory then take their inodes from its
/// group. `Ok(false)`: the filesystem has no such flag (tmpfs, XFS, …); nothing changed.
///
/// Why the cache wants it: on ext4 without a journal (`^has_journal`, what this project's
/// benchmark VM has), allocating an inode skips every free inode of its group whose file was
/// deleted in the last one to six minutes (`recently_deleted` in `fs/ext4/ialloc.c`), one inode
/// table lookup each, from the start of the group. Files made in one directory all come from one
/// group, so after a few thousand deletions near it (evictions, joins, another program's
/// cleanup) each new cache file of 128 KiB cost up to 1.4 ms of CPU, against 0.14–0.27 ms with
/// the 256 block directories spread this way (`ferry-bench-store`; `doc/BENCHMARKS.md`, issue 17,
/// twelfth session).
pub fn spread_subdirs(dir: &Path) -> io::Result<bool> {
    let f = std::fs::File::open(dir)?;
    let fd = f.as_raw_fd();
    // The kernel reads and writes an `int` for these, whatever the ioctl number's size says.
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int through the pointer, valid for the call.
    if unsafe { libc::ioctl(fd, libc::FS_IOC_GETFLAGS, &mut flags) } != 0 {
        return refused(io::Error::last_os_error());
    }
    if flags & FS_TOPDIR_FL != 0 {
        return Ok(true);
    }
    flags |= FS_TOPDIR_FL;
    // SAFETY: FS_IOC_SETFLAGS reads one int through the pointer, valid for the call.
    if unsafe { libc::ioctl(fd, libc::FS_IOC_SETFLAGS, &flags) } != 0 {
        return refused(io::Error::last_os_error());
    }
    Ok(true)
}

/// A filesystem without inode flags, or without this one, is not an error.
fn refused(e: io::Error) -> io::Result<bool> {
    match e.raw_os_error() {
        Some(libc::ENOTTY | libc::EOPNOTSUPP | libc::EINVAL) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn available_space_of_a_real_directory_and_an_error_for_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        assert!(super::available(dir.path()).unwrap() > 0);
        assert!(super::available(&dir.path().join("missing")).is_err());
    }

    /// On ext4 the flag is set (and read back); on tmpfs nothing changes and it is not an error.
    /// A missing directory is one. The temporary directory, or else `/var/tmp`, must be on ext4
    /// in CI (a missing prerequisite fails there; locally it is skipped, loudly).
    #[test]
    fn subdirectories_are_spread_where_the_filesystem_can() {
        use nix::sys::statfs::{statfs, EXT4_SUPER_MAGIC, TMPFS_MAGIC};
        use std::os::fd::AsRawFd;
        let mut ext4_seen = false;
        for parent in [std::env::temp_dir(), "/var/tmp".into()] {
            let Ok(dir) = tempfile::tempdir_in(&parent) else {
                continue;
            };
            let kind = statfs(dir.path()).unwrap().filesystem_type();
            let set = super::spread_subdirs(dir.path()).unwrap();
            assert_eq!(
                super::spread_subdirs(dir.path()).unwrap(),
                set,
                "idempotent"
            );
            if kind == TMPFS_MAGIC {
                assert!(!set, "tmpfs has no such flag");
            }
            if kind == EXT4_SUPER_MAGIC {
                ext4_seen = true;
                assert!(set, "ext4 takes the flag");
                let f = std::fs::File::open(dir.path()).unwrap();
                let mut flags: libc::c_int = 0;
                // SAFETY: as in spread_subdirs.
                let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
                assert_eq!(r, 0);
                assert_ne!(flags & super::FS_TOPDIR_FL, 0, "the flag reads back");
            }
            assert!(super::spread_subdirs(&dir.path().join("missing")).is_err());
        }
        ferry_testkit::prerequisite(
            ext4_seen,
            "an ext4 directory (the temporary directory or /var/tmp)",
        );
    }
}
