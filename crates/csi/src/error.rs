//! The one place where Ferry's errors become gRPC statuses, with the CSI spec's codes.

use ferry_store::StoreError;
use ferry_volume::VolumeError;
use tonic::{Code, Status};

/// How every message quotes a value from the request (see [`ferry_volume::quote`]).
pub use ferry_volume::quote;

/// The longest status message sent back: values are quoted short ([`quote`]), and this bounds
/// what any message assembled from several of them (or from a server's reply) can grow to.
pub const MESSAGE_MAX_BYTES: usize = 4096;

/// An RPC failure, by the CSI spec's meaning. Messages never carry secrets.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// A required field is missing or a value is malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// The volume (or its bucket) does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The name or target is already used with other parameters.
    #[error("{0}")]
    AlreadyExists(String),
    /// The system is not in a state that allows the operation (for example the bucket is missing).
    #[error("{0}")]
    FailedPrecondition(String),
    /// Another operation on the same volume or target is in progress.
    #[error("{0}")]
    Aborted(String),
    /// The credentials were refused by S3.
    #[error("{0}")]
    PermissionDenied(String),
    /// A dependency (S3, the FUSE device) is unreachable for now; retrying may work.
    #[error("{0}")]
    Unavailable(String),
    /// The capacity range cannot be satisfied.
    #[error("{0}")]
    OutOfRange(String),
    /// The RPC or the requested feature is not implemented.
    #[error("{0}")]
    Unimplemented(String),
    /// Anything else.
    #[error("{0}")]
    Internal(String),
}

impl From<CsiError> for Status {
    fn from(e: CsiError) -> Status {
        let code = match &e {
            CsiError::InvalidArgument(_) => Code::InvalidArgument,
            CsiError::NotFound(_) => Code::NotFound,
            CsiError::AlreadyExists(_) => Code::AlreadyExists,
            CsiError::FailedPrecondition(_) => Code::FailedPrecondition,
            CsiError::Aborted(_) => Code::Aborted,
            CsiError::PermissionDenied(_) => Code::PermissionDenied,
            CsiError::Unavailable(_) => Code::Unavailable,
            CsiError::OutOfRange(_) => Code::OutOfRange,
            CsiError::Unimplemented(_) => Code::Unimplemented,
            CsiError::Internal(_) => Code::Internal,
        };
        Status::new(code, capped(e.to_string()))
    }
}

impl From<ferry_creds::CredsError> for CsiError {
    fn from(e: ferry_creds::CredsError) -> Self {
        use ferry_creds::CredsError;
        match e {
            CredsError::Invalid(m) => CsiError::InvalidArgument(m),
            CredsError::Denied(m) => CsiError::PermissionDenied(m),
            CredsError::Unavailable(m) => CsiError::Unavailable(m),
        }
    }
}

/// A volume that names an endpoint the operator did not allow is a bad argument of the request
/// that names it (CreateVolume's parameters, NodePublishVolume's context); DeleteVolume and
/// ValidateVolumeCapabilities, which get it from a volume id, answer FailedPrecondition instead.
impl From<ferry_volume::EndpointRefused> for CsiError {
    fn from(e: ferry_volume::EndpointRefused) -> Self {
        CsiError::InvalidArgument(e.to_string())
    }
}

impl From<VolumeError> for CsiError {
    fn from(e: VolumeError) -> Self {
        CsiError::InvalidArgument(e.to_string())
    }
}

impl CsiError {
    /// Maps a store failure, with `what` saying what was being done (e.g. "checking bucket x").
    pub fn from_store(what: &str, e: StoreError) -> Self {
        let msg = format!("{what}: {e}");
        match e {
            StoreError::NotFound(_) | StoreError::NoSuchBucket(_) => CsiError::NotFound(msg),
            StoreError::AccessDenied(_) | StoreError::Credentials(_) => {
                CsiError::PermissionDenied(msg)
            }
            StoreError::InvalidRequest(_) => CsiError::InvalidArgument(msg),
            StoreError::PreconditionFailed(_) => CsiError::Aborted(msg),
            StoreError::Throttled(_)
            | StoreError::Transient(_)
            | StoreError::Corrupt(_)
            | StoreError::CredentialsUnavailable(_) => CsiError::Unavailable(msg),
            StoreError::Other(_) => CsiError::Internal(msg),
        }
    }
}

/// `msg`, cut to [`MESSAGE_MAX_BYTES`] (on a character boundary) with a note of its length.
fn capped(msg: String) -> String {
    if msg.len() <= MESSAGE_MAX_BYTES {
        return msg;
    }
    let mut cut = MESSAGE_MAX_BYTES;
    while !msg.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}… (message cut: {} bytes)", &msg[..cut], msg.len())
}

/// Shorthand for handlers.
pub type Result<T, E = CsiError> = std::result::Result<T, E>;

/// Fails with InvalidArgument naming `field` when it is empty.
pub fn require<'a>(field: &str, value: &'a str) -> Result<&'a str> {
    if value.is_empty() {
        return Err(CsiError::InvalidArgument(format!("{field} is required")));
    }
    Ok(value)
}

/// The answer to an RPC Ferry does not offer (and does not advertise).
pub fn unimplemented<T>(rpc: &str) -> std::result::Result<tonic::Response<T>, Status> {
    Err(Status::unimplemented(format!(
        "{rpc} is not supported by Ferry"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_message_never_carries_a_whole_huge_input() {
        let huge = "v".repeat(1 << 20);
        let s = Status::from(CsiError::InvalidArgument(format!("bad {huge}")));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(
            s.message().len() < MESSAGE_MAX_BYTES + 64,
            "{}",
            s.message().len()
        );
        assert!(s.message().ends_with("(message cut: 1048580 bytes)"));
        let s = Status::from(CsiError::NotFound(format!("volume {}", quote(&huge))));
        // The quote's 256 characters, its ellipsis and length, and the words around it.
        assert!(s.message().len() < 300, "{}", s.message());
        assert!(s.message().contains("(1048576 bytes)"), "{}", s.message());
    }
}
