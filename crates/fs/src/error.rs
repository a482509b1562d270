//! [`FsError`] and its one mapping to an errno ([`FsError::errno`]); nothing else picks errnos.

use ferry_store::StoreError;

/// Every way a filesystem operation can fail. The FUSE adapter replies with [`FsError::errno`].
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("read-only mount")]
    ReadOnly,
    /// Refused by the mount's policy (no delete, no overwrite, no append, no chmod...).
    #[error("operation not permitted: {0}")]
    NotPermitted(&'static str),
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    #[error("name or key too long")]
    NameTooLong,
    /// The handle cannot do this (read on a write handle, write after the upload completed).
    #[error("bad file handle: {0}")]
    BadHandle(&'static str),
    /// The file is being written through another handle of this mount.
    #[error("busy: {0}")]
    Busy(&'static str),
    /// The object changed (ETag) or vanished since it was opened, or the inode is unknown.
    #[error("stale: {0}")]
    Stale(String),
    /// S3 has no rename; `mv` answers EXDEV by copying and deleting.
    #[error("rename is not supported (S3 has no rename)")]
    CrossDevice,
    /// More than 10 000 parts of the part size.
    #[error("file too large for a multipart upload")]
    FileTooLarge,
    /// An earlier write or upload on this handle failed; the file was not created.
    #[error("an earlier upload on this handle failed")]
    UploadFailed,
    /// Not implemented at all (the kernel caches ENOSYS for some operations, e.g. xattrs).
    #[error("not implemented")]
    NotImplemented,
    /// No `ioctl` is supported: the answer a terminal query (`TCGETS`, as Python's `open` sends)
    /// expects from a regular file.
    #[error("inappropriate ioctl for a file on this mount")]
    NoIoctl,
    #[error("object store: {0}")]
    Store(#[from] StoreError),
}

impl FsError {
    /// The errno the kernel (and so the application) sees. Exhaustive on purpose: a new variant
    /// here or in [`StoreError`] must be given an errno deliberately.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::ReadOnly => libc::EROFS,
            FsError::NotPermitted(_) => libc::EPERM,
            FsError::InvalidArgument(_) => libc::EINVAL,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::BadHandle(_) => libc::EBADF,
            FsError::Busy(_) => libc::EBUSY,
            FsError::Stale(_) => libc::ESTALE,
            FsError::CrossDevice => libc::EXDEV,
            FsError::FileTooLarge => libc::EFBIG,
            FsError::UploadFailed => libc::EIO,
            FsError::NotImplemented => libc::ENOSYS,
            FsError::NoIoctl => libc::ENOTTY,
            FsError::Store(e) => match e {
                StoreError::NotFound(_) => libc::ENOENT,
                StoreError::NoSuchBucket(_) => libc::EIO,
                StoreError::AccessDenied(_) => libc::EACCES,
                // A refusal by the identity provider is a permission verdict; an identity provider
                // that could not answer is not (EIO, as for any S3 outage: applications that
                // retry on EIO recover, and none takes it for "you may not").
                StoreError::Credentials(_) => libc::EACCES,
                StoreError::CredentialsUnavailable(_) => libc::EIO,
                StoreError::PreconditionFailed(_) => libc::ESTALE,
                StoreError::InvalidRequest(_) => libc::EINVAL,
                StoreError::Throttled(_) => libc::EIO,
                StoreError::Transient(_) => libc::EIO,
                StoreError::Corrupt(_) => libc::EIO,
                StoreError::Other(_) => libc::EIO,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_map() {
        let cases = [
            (StoreError::NotFound("k".into()), libc::ENOENT),
            (StoreError::AccessDenied("k".into()), libc::EACCES),
            (StoreError::PreconditionFailed("k".into()), libc::ESTALE),
            (StoreError::Throttled("k".into()), libc::EIO),
            (StoreError::Transient("k".into()), libc::EIO),
            (StoreError::Corrupt("k".into()), libc::EIO),
            (StoreError::InvalidRequest("k".into()), libc::EINVAL),
            (StoreError::Credentials("k".into()), libc::EACCES),
            (StoreError::CredentialsUnavailable("k".into()), libc::EIO),
        ];
        for (e, errno) in cases {
            assert_eq!(FsError::from(e).errno(), errno);
        }
        assert_eq!(FsError::CrossDevice.errno(), libc::EXDEV);
        assert_eq!(FsError::ReadOnly.errno(), libc::EROFS);
        assert_eq!(FsError::NoIoctl.errno(), libc::ENOTTY);
    }
}
