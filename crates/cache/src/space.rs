//! Free space of the filesystem holding the cache directory (`statvfs`).

use std::io;
use std::path::Path;

/// Bytes available to unprivileged users on the filesystem of `path` (`f_bavail * f_frsize`).
pub fn available(path: &Path) -> io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(path)?;
    Ok(st.blocks_available().saturating_mul(st.fragment_size()))
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
