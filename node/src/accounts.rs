//! [`KubeServiceAccounts`]: the pods' ServiceAccount annotations from the Kubernetes API (ferry-kube),
//! for `authenticationSource: pod`. The node plugin's RBAC needs only `get` on `serviceaccounts`.

use std::collections::HashMap;

use ferry_creds::{CredsError, ServiceAccounts};

/// Reads ServiceAccounts with a ferry-kube client.
pub struct KubeServiceAccounts(pub ferry_kube::Client);

#[async_trait::async_trait]
impl ServiceAccounts for KubeServiceAccounts {
    async fn annotations(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<HashMap<String, String>, CredsError> {
        match self.0.get_service_account(namespace, name).await {
            Ok(a) => Ok(a.into_iter().collect()),
            Err(e) if e.is_not_found() => Err(CredsError::Invalid(format!(
                "service account {namespace}/{name} does not exist"
            ))),
            Err(e) if e.status() == Some(403) => Err(CredsError::Unavailable(format!(
                "the node plugin may not read service account {namespace}/{name} (its RBAC needs get on serviceaccounts): {e}"
            ))),
            Err(e) => Err(CredsError::Unavailable(format!(
                "reading service account {namespace}/{name}: {e}"
            ))),
        }
    }
}
