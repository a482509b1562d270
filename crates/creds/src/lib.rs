//! Where a volume's S3 credentials come from, and how they stay fresh.
//!
//! - [`CredentialSource`]: the driver's own chain, static keys from a Kubernetes Secret
//!   ([`StaticKeys`]), or the pod's identity — IRSA (STS `AssumeRoleWithWebIdentity` with the
//!   pod's service-account token) or EKS Pod Identity (the agent endpoint with the pod-identity
//!   token).
//! - [`PodCredentials`]: an AWS `ProvideCredentials` for one (namespace, service account, role)
//!   that caches what STS or the agent returned, refreshes it before it expires, and signs with
//!   the newest token handed to it ([`PodCredentials::set_token`]) — so a mount keeps one S3
//!   client across kubelet's republishes.
//! - [`PodCredentialCache`]: one [`PodCredentials`] per identity on the node.
//!
//! Nothing here names aws-sdk-s3. Every secret type ([`Secret`], [`StaticKeys`],
//! [`ServiceAccountToken`]) has a redacting `Debug` and no `Display`; errors never carry one.

mod error;
mod pod;
mod provider;
mod secret;
mod source;
mod tokens;

pub use error::CredsError;
pub use pod::{session_name, PodRef, ServiceAccounts};
pub use provider::{PodCredentialCache, PodCredentials, ProviderSettings};
pub use secret::{Secret, StaticKeys};
pub use source::{resolve_pod_source, CredentialSource, Identity, PodSettings, Principal};
pub use tokens::{parse_tokens, ServiceAccountToken, POD_IDENTITY_AUDIENCE, STS_AUDIENCE};

/// ServiceAccount annotation (IRSA): the role a pod's service account assumes.
pub const ROLE_ARN_ANNOTATION: &str = "eks.amazonaws.com/role-arn";
/// ServiceAccount annotation (IRSA): `"true"` = use the regional STS endpoint.
pub const STS_REGIONAL_ANNOTATION: &str = "eks.amazonaws.com/sts-regional-endpoints";
/// Where the EKS Pod Identity agent listens on every node.
pub const DEFAULT_POD_IDENTITY_AGENT_URL: &str = "http://169.254.170.23/v1/credentials";

/// Entry points for the fuzz targets in `fuzz/` (not an API: hidden, no stability promised).
#[doc(hidden)]
pub mod fuzzing {
    /// The EKS Pod Identity agent's answer, read.
    pub use crate::provider::agent_credentials;
}
