//! Where each volume's S3 client comes from: one client per distinct endpoint, made on first use.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_store::{ObjectStore, S3Config, S3Credentials, S3Store, StoreError};
use ferry_volume::Endpoint;
use tokio::sync::Mutex;

/// Hands out the store that serves an endpoint.
#[tonic::async_trait]
pub trait Stores: Send + Sync + 'static {
    async fn get(&self, endpoint: &Endpoint) -> Result<Arc<dyn ObjectStore>, StoreError>;
}

/// Real S3 clients (counted in the metrics) with the driver's credentials (by default the AWS SDK's default chain). A
/// volume's endpoint fields override the driver-level defaults field by field.
pub struct S3Stores {
    defaults: Endpoint,
    credentials: S3Credentials,
    clients: Mutex<HashMap<Endpoint, Arc<S3Store>>>,
}

impl S3Stores {
    /// Clients with the SDK's default credential chain.
    pub fn new(defaults: Endpoint) -> Self {
        Self::with_credentials(defaults, S3Credentials::DefaultChain)
    }

    /// Clients with the given credentials.
    pub fn with_credentials(defaults: Endpoint, credentials: S3Credentials) -> Self {
        S3Stores {
            defaults,
            credentials,
            clients: Mutex::new(HashMap::new()),
        }
    }

    fn config(&self, e: Endpoint) -> S3Config {
        S3Config {
            endpoint_url: e.endpoint_url,
            region: e.region,
            force_path_style: e.force_path_style,
            credentials: self.credentials.clone(),
        }
    }

    /// The endpoint a volume really uses once the driver's defaults fill its gaps.
    pub fn resolve(&self, e: &Endpoint) -> Endpoint {
        Endpoint {
            endpoint_url: e
                .endpoint_url
                .clone()
                .or_else(|| self.defaults.endpoint_url.clone()),
            region: e.region.clone().or_else(|| self.defaults.region.clone()),
            force_path_style: e.force_path_style || self.defaults.force_path_style,
        }
    }

    /// The (cached) client for an endpoint.
    async fn client(&self, endpoint: &Endpoint) -> Result<Arc<S3Store>, StoreError> {
        let e = self.resolve(endpoint);
        let mut clients = self.clients.lock().await;
        if let Some(c) = clients.get(&e) {
            return Ok(c.clone());
        }
        let store = Arc::new(S3Store::new(self.config(e.clone())).await?);
        clients.insert(e, store.clone());
        Ok(store)
    }

    /// Readiness: the driver-level credentials resolve. Uses the cached client, whose credentials
    /// provider caches too, so a liveness probe does not call STS or IMDS each time.
    pub async fn check_default_credentials(&self) -> Result<(), String> {
        let store = self
            .client(&Endpoint::default())
            .await
            .map_err(|e| e.to_string())?;
        store.check_credentials().await.map_err(|e| e.to_string())
    }
}

#[tonic::async_trait]
impl Stores for S3Stores {
    async fn get(&self, endpoint: &Endpoint) -> Result<Arc<dyn ObjectStore>, StoreError> {
        let client: Arc<dyn ObjectStore> = self.client(endpoint).await?;
        Ok(Arc::new(ferry_metrics::InstrumentedStore::new(client)))
    }
}

/// One store for every endpoint: for tests on the in-memory store.
pub struct FixedStore(pub Arc<dyn ObjectStore>);

#[tonic::async_trait]
impl Stores for FixedStore {
    async fn get(&self, _endpoint: &Endpoint) -> Result<Arc<dyn ObjectStore>, StoreError> {
        Ok(self.0.clone())
    }
}
