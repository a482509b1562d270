//! The Identity service: plugin name and version, capabilities, and a readiness probe.

use std::sync::Arc;

use std::future::Future;
use std::pin::Pin;

use tonic::{Request, Response, Status};

use crate::pb;
use crate::pb::identity_server::Identity;

/// A readiness check: `Err(reason)` when the process cannot serve. Each binary plugs in its own.
pub type Readiness =
    Box<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// Identity service of one Ferry binary.
pub struct IdentityService {
    capabilities: Vec<pb::plugin_capability::service::Type>,
    ready: Arc<Readiness>,
}

impl IdentityService {
    pub fn new(capabilities: Vec<pb::plugin_capability::service::Type>, ready: Readiness) -> Self {
        IdentityService {
            capabilities,
            ready: Arc::new(ready),
        }
    }

    /// The check behind Probe, for the health endpoint (`ferry_metrics::health`): `Err(reason)`
    /// when Probe answers not ready.
    pub fn health_check(&self) -> ferry_metrics::health::Check {
        let ready = self.ready.clone();
        Arc::new(move || ready())
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _req: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        Ok(Response::new(pb::GetPluginInfoResponse {
            name: ferry_volume::DRIVER_NAME.to_string(),
            vendor_version: crate::VERSION.to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        let capabilities = self
            .capabilities
            .iter()
            .map(|t| pb::PluginCapability {
                r#type: Some(pb::plugin_capability::Type::Service(
                    pb::plugin_capability::Service { r#type: *t as i32 },
                )),
            })
            .collect();
        Ok(Response::new(pb::GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _req: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeResponse>, Status> {
        let ready = match (self.ready)().await {
            Ok(()) => true,
            Err(reason) => {
                tracing::warn!(%reason, "probe: not ready");
                false
            }
        };
        Ok(Response::new(pb::ProbeResponse { ready: Some(ready) }))
    }
}
