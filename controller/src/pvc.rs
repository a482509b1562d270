//! Reading the PVC behind a CreateVolume: csi-provisioner (with `--extra-create-metadata`) names
//! it in the parameters (`csi.storage.k8s.io/pvc/name`, `/pvc/namespace`), and the controller
//! reads its annotations from the Kubernetes API for [`EXISTING_PREFIX_ANNOTATION`].
//!
//! [`EXISTING_PREFIX_ANNOTATION`]: ferry_volume::keys::EXISTING_PREFIX_ANNOTATION

use ferry_csi::kube_api::{describe, is_path_segment, REQUEST_TIMEOUT};
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
        let got = tokio::time::timeout(REQUEST_TIMEOUT, pvcs.get(name)).await;
        let Ok(got) = got else {
            return Err(CsiError::Unavailable(format!(
                "{what}: no answer within {} s",
                REQUEST_TIMEOUT.as_secs()
            )));
        };
        match got {
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
