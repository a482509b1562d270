//! Reading the PVC behind a CreateVolume: csi-provisioner (with `--extra-create-metadata`) names
//! it in the parameters (`csi.storage.k8s.io/pvc/name`, `/pvc/namespace`), and the controller
//! reads its annotations from the Kubernetes API for [`EXISTING_PREFIX_ANNOTATION`].
//!
//! [`EXISTING_PREFIX_ANNOTATION`]: ferry_volume::keys::EXISTING_PREFIX_ANNOTATION

use std::collections::BTreeMap;

use ferry_csi::CsiError;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;

/// Where PVC annotations come from: the Kubernetes API in production ([`kube::Client`]),
/// a map in unit tests.
#[async_trait::async_trait]
pub trait PvcAnnotations: Send + Sync + 'static {
    /// The annotations of PVC `namespace/name`; errors name the PVC and map to the CSI code
    /// csi-provisioner should see (it retries all of them and records each as a PVC event).
    async fn annotations(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<BTreeMap<String, String>, CsiError>;
}

#[async_trait::async_trait]
impl PvcAnnotations for kube::Client {
    async fn annotations(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<BTreeMap<String, String>, CsiError> {
        let what = format!("reading PVC {namespace}/{name} for its annotations");
        // kube builds the URL path from these as they are: keep them to one path segment each.
        if !is_path_segment(namespace) || !is_path_segment(name) {
            return Err(CsiError::Unavailable(format!(
                "{what}: not a valid namespace and PVC name"
            )));
        }
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.clone(), namespace);
        match pvcs.get(name).await {
            Ok(pvc) => Ok(pvc.metadata.annotations.unwrap_or_default()),
            Err(e) => {
                let msg = format!("{what}: {}", describe(&e));
                Err(match &e {
                    // csi-provisioner asked for a PVC that is gone: nothing to provision.
                    kube::Error::Api(s) if s.code == 404 => CsiError::NotFound(msg),
                    kube::Error::Api(s) if matches!(s.code, 401 | 403) => {
                        CsiError::PermissionDenied(format!(
                            "{msg} (the controller's service account needs `get` on persistentvolumeclaims)"
                        ))
                    }
                    _ => CsiError::Unavailable(msg),
                })
            }
        }
    }
}

/// A namespace or object name that stays one URL path segment.
fn is_path_segment(s: &str) -> bool {
    !(s.is_empty() || s == "." || s == ".." || s.contains(['/', '?', '#', '%']))
}

/// A Kubernetes API error as a user reads it: the API server's status, reason and message, or the
/// transport failure with its causes ("connection refused" is not hidden behind "client error").
fn describe(e: &kube::Error) -> String {
    if let kube::Error::Api(s) = e {
        return format!("HTTP {} {}: {}", s.code, s.reason, s.message);
    }
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let c_text = c.to_string();
        // kube's variants print their source too: don't say it twice.
        if !out.ends_with(&c_text) {
            out.push_str(": ");
            out.push_str(&c_text);
        }
        cause = c.source();
    }
    out
}

#[async_trait::async_trait]
impl PvcAnnotations for BTreeMap<(String, String), BTreeMap<String, String>> {
    async fn annotations(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<BTreeMap<String, String>, CsiError> {
        self.get(&(namespace.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| CsiError::NotFound(format!("PVC {namespace}/{name} not found")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_one_path_segment() {
        assert!(is_path_segment("ok-name.1"));
        for bad in ["", "a/b", "a?b", "..", "a%2F", "a#b"] {
            assert!(!is_path_segment(bad), "{bad}");
        }
    }
}
