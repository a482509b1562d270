//! Where each volume's S3 client comes from: one client per distinct (endpoint, credentials), made
//! on first use. Credentials are the driver's, static keys from the volume's Secret, or a pod-level
//! identity's refreshing provider (shared by every mount of that identity).

use std::collections::HashMap;
use std::sync::Arc;

use aws_credential_types::provider::SharedCredentialsProvider;
use ferry_creds::{Identity, PodCredentials, StaticKeys};
use ferry_store::{ObjectStore, S3Config, S3Credentials, S3Options, S3Store, StoreError};
use ferry_volume::Endpoint;
use tokio::sync::Mutex;

/// Whose credentials a volume's client signs with.
#[derive(Debug, Clone)]
pub enum StoreCredentials {
    /// The driver's own (its default chain, or what it was configured with).
    Driver,
    /// Keys from the volume's Secret.
    Static(StaticKeys),
    /// A pod-level identity's provider.
    Pod(PodCredentials),
}

/// Hands out the store that serves an endpoint.
#[tonic::async_trait]
pub trait Stores: Send + Sync + 'static {
    /// The store for an endpoint with the driver's credentials.
    async fn get(&self, endpoint: &Endpoint) -> Result<Arc<dyn ObjectStore>, StoreError>;

    /// The store for an endpoint with the given credentials. Only real S3 stores can sign with
    /// other credentials; the default refuses anything but the driver's.
    async fn get_as(
        &self,
        endpoint: &Endpoint,
        credentials: &StoreCredentials,
    ) -> Result<Arc<dyn ObjectStore>, StoreError> {
        match credentials {
            StoreCredentials::Driver => self.get(endpoint).await,
            _ => Err(StoreError::Credentials(
                "this store set serves only the driver's credentials".into(),
            )),
        }
    }
}

/// The part of [`StoreCredentials`] a cached client is keyed by.
#[derive(Clone, PartialEq, Eq, Hash)]
enum CredentialsKey {
    Driver,
    Static(StaticKeys),
    Pod(Identity),
}

/// Real S3 clients (counted in the metrics) with the driver's credentials (by default the AWS SDK's default chain). A
/// volume's endpoint fields override the driver-level defaults field by field.
pub struct S3Stores {
    defaults: Endpoint,
    credentials: S3Credentials,
    options: S3Options,
    clients: Mutex<HashMap<(Endpoint, CredentialsKey), Arc<S3Store>>>,
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
            options: S3Options::default(),
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// Clients with these retry, timeout and TLS settings (a private CA bundle).
    pub fn with_options(mut self, options: S3Options) -> Self {
        self.options = options;
        self
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

    /// The (cached) client for an endpoint with the driver's credentials.
    async fn client(&self, endpoint: &Endpoint) -> Result<Arc<S3Store>, StoreError> {
        self.client_as(endpoint, &StoreCredentials::Driver).await
    }

    /// The (cached) client for an endpoint and credentials.
    async fn client_as(
        &self,
        endpoint: &Endpoint,
        credentials: &StoreCredentials,
    ) -> Result<Arc<S3Store>, StoreError> {
        let e = self.resolve(endpoint);
        let key = match credentials {
            StoreCredentials::Driver => CredentialsKey::Driver,
            StoreCredentials::Static(k) => CredentialsKey::Static(k.clone()),
            StoreCredentials::Pod(p) => CredentialsKey::Pod(p.identity().clone()),
        };
        let mut clients = self.clients.lock().await;
        if let Some(c) = clients.get(&(e.clone(), key.clone())) {
            return Ok(c.clone());
        }
        let mut config = self.config(e.clone());
        let store = match credentials {
            StoreCredentials::Driver => S3Store::with_options(config, self.options.clone()).await?,
            StoreCredentials::Static(k) => {
                config.credentials = S3Credentials::Static {
                    access_key_id: k.access_key_id.clone(),
                    secret_access_key: k.secret_access_key.expose().to_string(),
                    session_token: k.session_token.as_ref().map(|t| t.expose().to_string()),
                };
                S3Store::with_options(config, self.options.clone()).await?
            }
            StoreCredentials::Pod(p) => {
                S3Store::with_credentials_provider(
                    config,
                    self.options.clone(),
                    SharedCredentialsProvider::new(p.clone()),
                )
                .await?
            }
        };
        let store = Arc::new(store);
        clients.insert((e, key), store.clone());
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

    async fn get_as(
        &self,
        endpoint: &Endpoint,
        credentials: &StoreCredentials,
    ) -> Result<Arc<dyn ObjectStore>, StoreError> {
        let client: Arc<dyn ObjectStore> = self.client_as(endpoint, credentials).await?;
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

    async fn get_as(
        &self,
        _endpoint: &Endpoint,
        _credentials: &StoreCredentials,
    ) -> Result<Arc<dyn ObjectStore>, StoreError> {
        Ok(self.0.clone())
    }
}
