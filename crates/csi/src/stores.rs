//! Where each volume's S3 client comes from: one client per distinct (endpoint, credentials), made
//! on first use. Credentials are the driver's, static keys from the volume's Secret, or a pod-level
//! identity's refreshing provider (shared by every mount of that identity).
//!
//! [`Stores::permit`] is the one check of a volume's endpoint against the operator's
//! [`AllowedEndpoints`]: the controller and the node call it before anything else that could reach
//! the endpoint, and [`S3Stores`] refuses to make a client for a refused endpoint in any case.

use std::collections::HashMap;
use std::sync::Arc;

use aws_credential_types::provider::SharedCredentialsProvider;
use ferry_creds::{Identity, PodCredentials, StaticKeys};
use ferry_s3::{S3Config, S3Credentials, S3Options, S3Store};
use ferry_store::{ObjectStore, StoreError};
use ferry_volume::{AllowedEndpoints, Endpoint, EndpointRefused};
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
    /// Whether requests for a volume at `endpoint` may be sent at all (whoever signs them): the
    /// operator's allowlist. Sends nothing and makes no client.
    fn permit(&self, endpoint: &Endpoint) -> Result<(), EndpointRefused>;

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

/// A client and its metrics wrapper (what callers get).
type Client = (Arc<S3Store>, Arc<dyn ObjectStore>);

/// Real S3 clients (counted in the metrics) with the driver's credentials (by default the AWS SDK's default chain). A
/// volume's endpoint fields override the driver-level defaults field by field.
pub struct S3Stores {
    defaults: Endpoint,
    /// The endpoints volumes may name (the driver's default endpoint among them).
    allowed: AllowedEndpoints,
    credentials: S3Credentials,
    options: S3Options,
    /// One client per (endpoint, identity), with its metrics wrapper: every caller of one
    /// identity gets the very same store, so the mounts that share it share its proofs of access
    /// to cached objects (`ferry_fs::ProofRegistry`).
    clients: Mutex<HashMap<(Endpoint, CredentialsKey), Client>>,
}

impl S3Stores {
    /// Clients with the SDK's default credential chain.
    pub fn new(defaults: Endpoint) -> Self {
        Self::with_credentials(defaults, S3Credentials::DefaultChain)
    }

    /// Clients with the given credentials. Volumes may name the AWS S3 endpoints and the default
    /// endpoint (see [`S3Stores::with_allowed_endpoints`]).
    pub fn with_credentials(defaults: Endpoint, credentials: S3Credentials) -> Self {
        S3Stores {
            allowed: AllowedEndpoints::default()
                .with_default_endpoint(defaults.endpoint_url.as_deref()),
            defaults,
            credentials,
            options: S3Options::default(),
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// Volumes may name these endpoints (and the default endpoint, always).
    pub fn with_allowed_endpoints(mut self, allowed: AllowedEndpoints) -> Self {
        self.allowed = allowed.with_default_endpoint(self.defaults.endpoint_url.as_deref());
        self
    }

    /// What volumes may name, in words (for the start-up log).
    pub fn allowed_endpoints(&self) -> &AllowedEndpoints {
        &self.allowed
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
            // Every HTTP attempt (retries included) in `ferry_s3_attempts_total{op,status}`.
            on_attempt: Some(Arc::new(|a: ferry_s3::Attempt| {
                ferry_metrics::record_s3_attempt(a.op, a.status, a.elapsed)
            })),
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
        Ok(self.client_as(endpoint, &StoreCredentials::Driver).await?.0)
    }

    /// The (cached) client for an endpoint and credentials.
    async fn client_as(
        &self,
        endpoint: &Endpoint,
        credentials: &StoreCredentials,
    ) -> Result<Client, StoreError> {
        // The services ask `permit` first; this keeps any other caller from making a client for
        // an endpoint the operator did not allow.
        self.permit(endpoint)
            .map_err(|e| StoreError::InvalidRequest(e.to_string()))?;
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
                    secret_access_key: k.secret_access_key.expose().into(),
                    session_token: k.session_token.as_ref().map(|t| t.expose().into()),
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
        // Clients of a Secret's keys or of a pod identity that nothing uses any more (no mount,
        // no call in flight: the map's two references are the only ones) go before a new one
        // comes, so pods that come and go with their own credentials do not pile clients up. The
        // driver's own clients stay (few: one per endpoint; the liveness probe reuses them).
        clients.retain(|(_, key), (store, instrumented)| {
            *key == CredentialsKey::Driver
                || Arc::strong_count(instrumented) > 1
                || Arc::strong_count(store) > 2
        });
        let store = Arc::new(store);
        let client: Arc<dyn ObjectStore> = store.clone();
        let instrumented: Arc<dyn ObjectStore> =
            Arc::new(ferry_metrics::InstrumentedStore::new(client));
        clients.insert((e, key), (store.clone(), instrumented.clone()));
        Ok((store, instrumented))
    }

    /// How many clients are kept (for tests and the start-up log).
    pub async fn clients(&self) -> usize {
        self.clients.lock().await.len()
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
    fn permit(&self, endpoint: &Endpoint) -> Result<(), EndpointRefused> {
        self.allowed.check(endpoint)
    }

    async fn get(&self, endpoint: &Endpoint) -> Result<Arc<dyn ObjectStore>, StoreError> {
        self.get_as(endpoint, &StoreCredentials::Driver).await
    }

    async fn get_as(
        &self,
        endpoint: &Endpoint,
        credentials: &StoreCredentials,
    ) -> Result<Arc<dyn ObjectStore>, StoreError> {
        Ok(self.client_as(endpoint, credentials).await?.1)
    }
}

/// One store for every endpoint: for tests on the in-memory store.
pub struct FixedStore(pub Arc<dyn ObjectStore>);

#[tonic::async_trait]
impl Stores for FixedStore {
    /// The in-memory double serves every endpoint and sends nothing anywhere.
    fn permit(&self, _endpoint: &Endpoint) -> Result<(), EndpointRefused> {
        Ok(())
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(url: &str) -> Endpoint {
        Endpoint {
            endpoint_url: Some(url.into()),
            region: Some("us-east-1".into()),
            force_path_style: true,
        }
    }

    fn keys(id: &str) -> StoreCredentials {
        StoreCredentials::Static(StaticKeys {
            access_key_id: id.into(),
            secret_access_key: ferry_creds::Secret::new("secret"),
            session_token: None,
        })
    }

    #[tokio::test]
    async fn one_identity_gets_the_very_same_store_and_another_identity_another() {
        let stores = S3Stores::new(endpoint("http://127.0.0.1:9"));
        let e = Endpoint::default();
        let a = stores.get(&e).await.unwrap();
        let b = stores.get_as(&e, &StoreCredentials::Driver).await.unwrap();
        assert!(Arc::ptr_eq(&a, &b), "the driver's store is shared");
        let k1 = stores.get_as(&e, &keys("AKIA1")).await.unwrap();
        let k1_again = stores.get_as(&e, &keys("AKIA1")).await.unwrap();
        let k2 = stores.get_as(&e, &keys("AKIA2")).await.unwrap();
        assert!(Arc::ptr_eq(&k1, &k1_again), "one static key, one store");
        assert!(!Arc::ptr_eq(&k1, &k2) && !Arc::ptr_eq(&k1, &a));
        let stores =
            stores.with_allowed_endpoints(AllowedEndpoints::parse("http://127.0.0.1:10").unwrap());
        let a = stores.get(&e).await.unwrap();
        let other = stores.get(&endpoint("http://127.0.0.1:10")).await.unwrap();
        assert!(!Arc::ptr_eq(&a, &other), "another endpoint, another store");
    }

    #[tokio::test]
    async fn a_refused_endpoint_gets_no_client_whoever_signs() {
        let stores = S3Stores::new(endpoint("http://127.0.0.1:9/"))
            .with_allowed_endpoints(AllowedEndpoints::parse("https://*.example.com").unwrap());
        // No endpoint, or the driver's own default named explicitly: allowed.
        stores.permit(&Endpoint::default()).unwrap();
        stores.permit(&endpoint("http://127.0.0.1:9")).unwrap();
        stores
            .permit(&endpoint("https://minio.example.com"))
            .unwrap();
        let refused = endpoint("http://127.0.0.1:10");
        let e = stores.permit(&refused).unwrap_err();
        assert!(e.to_string().contains("http://127.0.0.1:10"), "{e}");
        for creds in [StoreCredentials::Driver, keys("AKIA1")] {
            let e = stores.get_as(&refused, &creds).await.err().unwrap();
            assert!(matches!(e, StoreError::InvalidRequest(_)), "{e:?}");
        }
        assert!(stores.clients.lock().await.is_empty(), "no client was made");
    }

    #[tokio::test]
    async fn clients_nothing_uses_go_when_the_next_one_comes_and_the_drivers_stay() {
        let stores = S3Stores::new(endpoint("http://127.0.0.1:9"));
        let e = Endpoint::default();
        drop(stores.get(&e).await.unwrap());
        let k1 = stores.get_as(&e, &keys("AKIA1")).await.unwrap();
        drop(stores.get_as(&e, &keys("AKIA2")).await.unwrap());
        assert_eq!(stores.clients().await, 3);
        // AKIA2's store is no one's any more: it goes; AKIA1's is in use, the driver's stays.
        let k3 = stores.get_as(&e, &keys("AKIA3")).await.unwrap();
        assert_eq!(stores.clients().await, 3);
        let k1_again = stores.get_as(&e, &keys("AKIA1")).await.unwrap();
        assert!(Arc::ptr_eq(&k1, &k1_again), "a store in use is kept");
        drop((k1, k1_again, k3));
        drop(stores.get_as(&e, &keys("AKIA4")).await.unwrap());
        assert_eq!(stores.clients().await, 2, "the driver's and AKIA4's");
    }
}
