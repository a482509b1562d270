//! Reading the PVC behind a CreateVolume: csi-provisioner (with `--extra-create-metadata`) names
//! it in the parameters (`csi.storage.k8s.io/pvc/name`, `/pvc/namespace`), and the controller
//! reads its annotations from the Kubernetes API for [`EXISTING_PREFIX_ANNOTATION`].
//!
//! [`EXISTING_PREFIX_ANNOTATION`]: ferry_volume::keys::EXISTING_PREFIX_ANNOTATION

use std::collections::BTreeMap;

use ferry_csi::CsiError;

/// Where PVC annotations come from: the Kubernetes API in production ([`ferry_kube::Client`]),
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
impl PvcAnnotations for ferry_kube::Client {
    async fn annotations(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<BTreeMap<String, String>, CsiError> {
        self.get_pvc(namespace, name).await.map_err(|e| {
            let msg = format!("reading PVC {namespace}/{name} for its annotations: {e}");
            match e.status() {
                // csi-provisioner asked for a PVC that is gone: nothing to provision.
                Some(404) => CsiError::NotFound(msg),
                Some(401 | 403) => CsiError::PermissionDenied(format!(
                    "{msg} (the controller's service account needs `get` on persistentvolumeclaims)"
                )),
                _ => CsiError::Unavailable(msg),
            }
        })
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
