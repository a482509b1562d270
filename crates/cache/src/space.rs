//! Free space of the filesystem holding the cache directory (`statvfs`).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Bytes available to unprivileged users on the filesystem of `path` (`f_bavail * f_frsize`).
pub fn available(path: &Path) -> io::Result<u64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: `statvfs` is plain old data, so all-zero is a valid value of it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid, writable statvfs for the call.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(test)]
mod tests {
    #[test]
    fn available_space_of_a_real_directory_and_an_error_for_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        assert!(super::available(dir.path()).unwrap() > 0);
        assert!(super::available(&dir.path().join("missing")).is_err());
    }
}
