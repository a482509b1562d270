//! What a Ferry volume is, parsed and validated at the edge.
//!
//! Everything the controller and the node read from Kubernetes — StorageClass parameters, the
//! volume id, the volume context, PV mount options in Mountpoint's syntax — is turned into typed,
//! validated values here, so the gRPC services only deal with well-formed volumes. Every key is a
//! constant in [`keys`]. Errors name the offending key or option. [`allowed`] is the operator's
//! list of the endpoints a volume may name. [`mountpoint_v2`] maps the attributes only Mountpoint's
//! driver v2 knows.

pub mod allowed;
pub mod id;
pub mod keys;
pub mod mountpoint_v2;
pub mod options;
pub mod params;
pub mod quote;
pub mod spec;
pub mod validate;

pub use allowed::{AllowedEndpoints, EndpointRefused};
pub use id::VolumeId;
pub use mountpoint_v2::{MountpointV2, NodeCache, Notice};
pub use options::{MetadataTtl, MountOptions};
pub use params::{DeletePolicy, ExistingPrefixPolicy, StorageClassParams};
pub use quote::quote;
pub use spec::{AuthenticationSource, VolumeSpec};

/// The CSI driver name: the `provisioner` of a StorageClass and the `driver` of a PV.
pub const DRIVER_NAME: &str = "s3.csi.ferry.dev";

/// Where a bucket lives: the parts of the S3 client configuration that a volume may choose.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// `None`: AWS's regional endpoint.
    pub endpoint_url: Option<String>,
    /// `None`: the client's default (the SDK chain, else us-east-1).
    pub region: Option<String>,
    pub force_path_style: bool,
}

/// A volume description that cannot be used, naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    #[error("missing required {what} {}", quote(key))]
    Missing { what: &'static str, key: String },
    #[error("invalid {what} {}: {reason}", quote(key))]
    Invalid {
        what: &'static str,
        key: String,
        reason: String,
    },
    #[error("unknown {what} {}", quote(key))]
    Unknown { what: &'static str, key: String },
    #[error("unsupported {what} {}: {reason}", quote(key))]
    Unsupported {
        what: &'static str,
        key: String,
        reason: String,
    },
    #[error("conflicting values for {}: {} and {}", quote(key), quote(a), quote(b))]
    Conflict { key: String, a: String, b: String },
}

impl VolumeError {
    pub(crate) fn invalid(what: &'static str, key: &str, reason: impl Into<String>) -> Self {
        VolumeError::Invalid {
            what,
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}

/// Parses a boolean the way Kubernetes users write one in YAML string maps.
pub(crate) fn parse_bool(what: &'static str, key: &str, v: &str) -> Result<bool, VolumeError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "1" => Ok(true),
        "false" | "no" | "0" | "" => Ok(false),
        _ => Err(VolumeError::invalid(
            what,
            key,
            format!("{} is not a boolean (true or false)", quote(v)),
        )),
    }
}

/// Applies a key that StorageClass parameters and volume attributes share — `bucketName`,
/// `region`, `endpointUrl`, `forcePathStyle` — after validating its value. `Ok(false)`: not one.
pub(crate) fn apply_location(
    what: &'static str,
    key: &str,
    value: &str,
    bucket: &mut Option<String>,
    endpoint: &mut Endpoint,
) -> Result<bool, VolumeError> {
    match key {
        keys::BUCKET_NAME => {
            validate::bucket_name(key, value)?;
            *bucket = Some(value.to_string());
        }
        keys::REGION => {
            validate::region(key, value)?;
            endpoint.region = Some(value.to_string());
        }
        keys::ENDPOINT_URL => {
            validate::endpoint_url(key, value)?;
            endpoint.endpoint_url = Some(value.to_string());
        }
        keys::FORCE_PATH_STYLE => endpoint.force_path_style = parse_bool(what, key, value)?,
        _ => return Ok(false),
    }
    Ok(true)
}
