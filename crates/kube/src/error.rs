//! [`KubeError`]: everything that can go wrong talking to the Kubernetes API, each variant naming
//! what was wrong (the file, the request, the API server's own reason). Never carries a token.

use std::path::PathBuf;

/// A failed configuration load or API call.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// A kubeconfig that cannot be used: unreadable, malformed, or missing what we need.
    #[error("kubeconfig {path}: {reason}")]
    Kubeconfig { path: PathBuf, reason: String },
    /// The in-cluster configuration (service account mount, KUBERNETES_SERVICE_* env) is incomplete.
    #[error("in-cluster config: {0}")]
    InCluster(String),
    /// Neither a kubeconfig nor an in-cluster configuration was found.
    #[error("no Kubernetes configuration: pass --kubeconfig, set KUBECONFIG, run in a pod, or create ~/.kube/config")]
    NoConfig,
    /// A file named by the configuration could not be read.
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Certificates or keys that rustls refuses.
    #[error("TLS setup: {0}")]
    Tls(String),
    /// An exec credential plugin (e.g. `aws eks get-token`) failed or answered nonsense.
    #[error("exec credential plugin `{command}`: {reason}")]
    Exec { command: String, reason: String },
    /// The request did not reach the API server or its answer was cut off.
    #[error("{method} {path}: {reason}")]
    Transport {
        method: String,
        path: String,
        reason: String,
    },
    /// The request took longer than the client's timeout.
    #[error("{method} {path}: no answer within {seconds} s")]
    Timeout {
        method: String,
        path: String,
        seconds: u64,
    },
    /// The API server answered with an error status; `reason` and `message` are its own
    /// (`NotFound`, `Forbidden`, `Invalid`, ...).
    #[error("{method} {path}: HTTP {status} {reason}: {message}")]
    Api {
        method: String,
        path: String,
        status: u16,
        reason: String,
        message: String,
    },
    /// The API server answered 2xx with a body we cannot understand.
    #[error("{what}: unexpected response: {reason}")]
    Decode { what: String, reason: String },
    /// An object to apply that lacks `apiVersion`, `kind` or `metadata.name`.
    #[error("object {object}: {reason}")]
    InvalidObject { object: String, reason: String },
    /// `kind` in `apiVersion` is not served by this API server (a missing CRD, a removed API).
    #[error("kind {kind} in {api_version} is not served by the API server")]
    UnknownKind { api_version: String, kind: String },
}

impl KubeError {
    /// The HTTP status of an API error.
    pub fn status(&self) -> Option<u16> {
        match self {
            KubeError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the API server said the object does not exist.
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }
}

pub type Result<T, E = KubeError> = std::result::Result<T, E>;
