//! FUSE metrics' label values, and [`record_fuse_op`]: one answered operation by outcome.

use std::borrow::Cow;
use std::time::Duration;

use crate::global::metrics;

/// Every operation the FUSE adapter serves (the `op` label), sorted, then `other`.
pub const OPS: [&str; 36] = [
    "access",
    "copy_file_range",
    "create",
    "fallocate",
    "flush",
    "forget",
    "fsync",
    "fsyncdir",
    "getattr",
    "getxattr",
    "ioctl",
    "link",
    "listxattr",
    "lookup",
    "lseek",
    "mkdir",
    "mknod",
    "open",
    "opendir",
    "poll",
    "read",
    "readdir",
    "readdirplus",
    "readlink",
    "release",
    "releasedir",
    "removexattr",
    "rename",
    "rmdir",
    "setattr",
    "setxattr",
    "statfs",
    "symlink",
    "unlink",
    "write",
    "other",
];

/// The `outcome` label: `ok`, each errno Ferry answers with (by name), then `other`.
pub(crate) const OUTCOMES: [(i32, &str); 21] = [
    (0, "ok"),
    (libc::ENOENT, "ENOENT"),
    (libc::EEXIST, "EEXIST"),
    (libc::ENOTDIR, "ENOTDIR"),
    (libc::EISDIR, "EISDIR"),
    (libc::ENOTEMPTY, "ENOTEMPTY"),
    (libc::EROFS, "EROFS"),
    (libc::EPERM, "EPERM"),
    (libc::EINVAL, "EINVAL"),
    (libc::ENAMETOOLONG, "ENAMETOOLONG"),
    (libc::EBADF, "EBADF"),
    (libc::EBUSY, "EBUSY"),
    (libc::ESTALE, "ESTALE"),
    (libc::EXDEV, "EXDEV"),
    (libc::EFBIG, "EFBIG"),
    (libc::EIO, "EIO"),
    (libc::ENOSYS, "ENOSYS"),
    (libc::ENOTTY, "ENOTTY"),
    (libc::EACCES, "EACCES"),
    (libc::EOPNOTSUPP, "EOPNOTSUPP"),
    (-1, "other"),
];

fn op_index(op: &str) -> usize {
    OPS[..OPS.len() - 1]
        .binary_search(&op)
        .unwrap_or(OPS.len() - 1)
}

fn outcome_index(errno: Option<i32>) -> usize {
    let code = errno.unwrap_or(0);
    OUTCOMES[..OUTCOMES.len() - 1]
        .iter()
        .position(|&(c, _)| c == code)
        .unwrap_or(OUTCOMES.len() - 1)
}

/// Records one answered FUSE operation: `op` (an entry of [`OPS`]), its outcome (`None`: a
/// success; `Some(errno)`: the error it was answered with) and the time from request to reply.
/// No lock, no allocation (but the first time an operation has an outcome).
pub fn record_fuse_op(op: &'static str, errno: Option<i32>, elapsed: Duration) {
    let fuse = &metrics().fuse;
    let op = op_index(op);
    let outcome = outcome_index(errno);
    fuse.ops
        .get(op * OUTCOMES.len() + outcome, || {
            vec![
                ("op", Cow::Borrowed(OPS[op])),
                ("outcome", Cow::Borrowed(OUTCOMES[outcome].1)),
            ]
        })
        .inc();
    fuse.seconds
        .get(op, || vec![("op", Cow::Borrowed(OPS[op]))])
        .observe(elapsed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_are_sorted_for_the_binary_search() {
        let named = &OPS[..OPS.len() - 1];
        assert!(named.windows(2).all(|w| w[0] < w[1]), "{named:?}");
        assert_eq!(OPS[op_index("write")], "write");
        assert_eq!(OPS[op_index("bmap")], "other");
    }

    #[test]
    fn outcomes_are_named() {
        record_fuse_op("lookup", Some(libc::ENOENT), Duration::from_micros(5));
        record_fuse_op("lookup", None, Duration::from_micros(5));
        record_fuse_op("getattr", Some(12345), Duration::from_micros(5));
        let text = crate::registry().encode_text();
        for want in [
            "ferry_fuse_operations_total{op=\"lookup\",outcome=\"ENOENT\"} 1\n",
            "ferry_fuse_operations_total{op=\"lookup\",outcome=\"ok\"} 1\n",
            "ferry_fuse_operations_total{op=\"getattr\",outcome=\"other\"} 1\n",
            "ferry_fuse_operation_duration_seconds_count{op=\"lookup\"} 2\n",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
    }
}
