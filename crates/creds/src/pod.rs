//! The pod a mount is for, and the one Kubernetes read pod-level credentials need: the pod's
//! ServiceAccount annotations (the node's RBAC needs only `get` on serviceaccounts).

use std::collections::HashMap;

use crate::CredsError;

/// The pod a NodePublishVolume is for (kubelet's `podInfoOnMount` keys).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub service_account: String,
}

/// Reads a ServiceAccount's annotations (the Kubernetes API in the node plugin).
#[async_trait::async_trait]
pub trait ServiceAccounts: Send + Sync + 'static {
    /// The annotations of `namespace/name`; a missing ServiceAccount is [`CredsError::Invalid`].
    async fn annotations(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<HashMap<String, String>, CredsError>;
}

/// The STS session name for a pod: `ferry-<namespace>-<pod>`, cut to STS's 64 characters and to
/// its alphabet (`[\w+=,.@-]`), so CloudTrail shows which pod acted.
pub fn session_name(pod: &PodRef) -> String {
    let raw = format!("ferry-{}-{}", pod.namespace, pod.name);
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_+=,.@-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_names_fit_sts() {
        let pod = PodRef {
            namespace: "ml".into(),
            name: "trainer-0".into(),
            service_account: "sa".into(),
        };
        assert_eq!(session_name(&pod), "ferry-ml-trainer-0");
        let long = PodRef {
            name: "x".repeat(100),
            ..pod
        };
        assert_eq!(session_name(&long).len(), 64);
    }
}
