//! [`KubeServiceAccounts`]: the pods' ServiceAccount annotations from the Kubernetes API (kube),
//! for `authenticationSource: pod`. The node plugin's RBAC needs only `get` on `serviceaccounts`.

use ferry_csi::kube_api::{describe, is_path_segment, REQUEST_TIMEOUT};
use std::collections::HashMap;

use ferry_creds::{CredsError, ServiceAccounts};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::Api;

/// Reads ServiceAccounts with a kube client.
pub struct KubeServiceAccounts(pub kube::Client);

#[async_trait::async_trait]
impl ServiceAccounts for KubeServiceAccounts {
    async fn annotations(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<HashMap<String, String>, CredsError> {
        // kube builds the URL path from these as they are: keep them to one path segment each.
        if !is_path_segment(namespace) || !is_path_segment(name) {
            return Err(CredsError::Unavailable(format!(
                "reading service account {namespace}/{name}: not a valid namespace and name"
            )));
        }
        let accounts: Api<ServiceAccount> = Api::namespaced(self.0.clone(), namespace);
        let got = tokio::time::timeout(REQUEST_TIMEOUT, accounts.get(name)).await;
        let Ok(got) = got else {
            return Err(CredsError::Unavailable(format!(
                "reading service account {namespace}/{name}: no answer within {} s",
                REQUEST_TIMEOUT.as_secs()
            )));
        };
        let e = match got {
            Ok(sa) => {
                return Ok(sa
                    .metadata
                    .annotations
                    .unwrap_or_default()
                    .into_iter()
                    .collect())
            }
            Err(e) => e,
        };
        Err(match &e {
            kube::Error::Api(s) if s.code == 404 => CredsError::Invalid(format!(
                "service account {namespace}/{name} does not exist"
            )),
            kube::Error::Api(s) if s.code == 403 => CredsError::Unavailable(format!(
                "the node plugin may not read service account {namespace}/{name} (its RBAC needs get on serviceaccounts): {}",
                describe(&e)
            )),
            _ => CredsError::Unavailable(format!(
                "reading service account {namespace}/{name}: {}",
                describe(&e)
            )),
        })
    }
}
