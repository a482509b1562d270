//! [`CredsError`]: what went wrong getting credentials. Messages name roles, service accounts,
//! keys and audiences, never a token, secret key or session token.

/// A credentials failure.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CredsError {
    /// The request or the Secret is malformed or incomplete (the CSI caller's fault).
    #[error("{0}")]
    Invalid(String),
    /// The identity provider (STS, the Pod Identity agent) refused: the role's trust policy, an
    /// expired or wrong-audience token, a pod not associated with a role.
    #[error("{0}")]
    Denied(String),
    /// The identity provider or the Kubernetes API could not be reached or failed; retrying may work.
    #[error("{0}")]
    Unavailable(String),
}
