//! [`S3Store`]: the [`ObjectStore`] over aws-sdk-s3 — the only crate of Ferry that names SDK types.
//!
//! - GETs (`get_range`) are signed and sent by `raw_get` on the SDK client's HTTP connector,
//!   identity cache and clock, without the SDK's orchestrator, unless [`S3Options::raw_get`] is off
//!   or the bucket needs another signing scheme; everything below holds for both paths.
//! - Retries: one policy (`retry.rs`), the SDK's *standard* mode's numbers: [`S3Options::max_attempts`]
//!   attempts in all, exponential backoff with full jitter. GETs (either path) and LISTs run their
//!   attempts in `retry.rs` with the SDK's retries off for them, and re-read a body that came back
//!   short or broke, or a LIST whose 2xx does not parse, as one more attempt of the same budget:
//!   nothing nests. A single range read costs at most `max_attempts` requests and
//!   `max_attempts × (attempt_timeout + body_timeout)` plus backoffs (defaults: 5 requests,
//!   ≈ 12 min 45 s). Every other operation is retried by the SDK with the same numbers.
//! - Timeouts on every request: connect, read (time to the response head) and per attempt; large
//!   uploads get a longer attempt timeout in proportion to their size.
//! - Checksums: requests carry checksums only where S3 requires them (DeleteObjects), and responses
//!   are validated only where required, because many S3-compatible servers reject or mangle the
//!   SDK's default trailing checksums. Integrity of reads rests on TLS plus the length checks here.
//! - Errors: one table (`error.rs`) maps S3 codes, HTTP statuses, transport and credentials failures
//!   of both paths onto [`StoreError`]; messages keep the code, the status and the request id.
//! - Clock skew: the client's clock is the node's corrected by the skew responses' `Date` shows, on
//!   both paths (`skew.rs`); requests are signed and credentials judged expired by it, and a 403
//!   to a request signed more than 4 minutes off is retried. [`S3Options::time_source`] sets the
//!   node's clock.
//! - Conditional creates (`put_if_absent`, `complete_multipart_if_absent`) send `If-None-Match: *`.
//!   A `412` to one is checked against the key's ETag first: the SDK may have retried a write whose
//!   first answer was lost, and then the object found is this very write (its MD5 ETag, or the
//!   multipart one from the parts' ETags). A server that answers the header `NotImplemented` (or
//!   `501`) gets the write again without it, and this store sends it no more (logged once).
//!   Likewise, a CompleteMultipartUpload answered `NoSuchUpload` is a success when the key has the
//!   multipart ETag of its parts: an attempt whose answer was lost completed it (a completed
//!   upload is gone), so a Complete can be retried.
//! - Per-attempt reports: [`S3Config::on_attempt`] is called once per HTTP attempt on both paths
//!   ([`Attempt`]).

use std::fmt;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::meta::region::RegionProviderChain;
use aws_config::BehaviorVersion;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    Credentials, IdentityCache, Region, RequestChecksumCalculation, ResponseChecksumValidation,
    SharedCredentialsProvider,
};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::complete_multipart_upload::CompleteMultipartUploadError;
use aws_sdk_s3::operation::put_object::PutObjectError;
use aws_sdk_s3::primitives::{ByteStream, DateTime};
use aws_sdk_s3::types::{CompletedMultipartUpload, Delete, EncodingType, ObjectIdentifier};
use aws_smithy_async::time::SharedTimeSource;
use bytes::Bytes;
use md5::Digest;
use secrecy::{ExposeSecret, SecretString};

mod attempt;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod get;
mod pagebuf;
mod raw_get;
mod retry;
mod skew;

pub use attempt::{Attempt, OnAttempt};

use crate::error::{delete_error, map_sdk_error, sdk_failure, Failure, Kind, Target};
use crate::get::{check_version, read_checked};
use crate::retry::RetryPolicy;
use crate::skew::{ClockSkew, CorrectedClock};

use ferry_store::{
    CompletedPart, ListPage, ListRequest, ObjectInfo, ObjectStore, Probed, PutResult, Result,
    StoreError, Upload, UploadsMarker, UploadsPage, UploadsRequest, Version, MAX_DELETE_BATCH,
    MAX_LIST_KEYS,
};

/// Where an [`S3Store`] connects and as whom.
#[derive(Clone, Default)]
pub struct S3Config {
    /// A custom endpoint (`http://127.0.0.1:7070`, `https://minio.example`); `None` = AWS (or the
    /// `AWS_ENDPOINT_URL(_S3)` environment variable).
    pub endpoint_url: Option<String>,
    /// `None` = the SDK's region chain (env, profile, IMDS), else `us-east-1`.
    pub region: Option<String>,
    /// `http://endpoint/bucket/key` instead of `http://bucket.endpoint/key`; most non-AWS servers
    /// need it.
    pub force_path_style: bool,
    pub credentials: S3Credentials,
    /// Called once per HTTP attempt of every request, on both GET paths (e.g. for per-attempt
    /// metrics by status). Must not block.
    pub on_attempt: Option<OnAttempt>,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint_url", &self.endpoint_url)
            .field("region", &self.region)
            .field("force_path_style", &self.force_path_style)
            .field("credentials", &self.credentials)
            .field("on_attempt", &self.on_attempt.is_some())
            .finish()
    }
}

/// How an [`S3Store`] gets credentials. `Debug` never prints a secret (`secrecy`).
#[derive(Clone, Debug, Default)]
pub enum S3Credentials {
    /// The SDK's default chain: env, profile, web identity (IRSA), ECS, IMDS.
    #[default]
    DefaultChain,
    Static {
        access_key_id: String,
        secret_access_key: SecretString,
        session_token: Option<SecretString>,
    },
}

/// Retry and timeout tuning for an [`S3Store`]; [`Default`] suits production.
#[derive(Debug, Clone)]
pub struct S3Options {
    /// Attempts per request in all (`retry.rs`): a GET or LIST whose body breaks counts one attempt
    /// like any other failure. Default 5.
    pub max_attempts: u32,
    /// First backoff of the standard retry mode (then doubling, with jitter). Default 1 s.
    pub initial_backoff: Duration,
    /// Backoff cap. Default 20 s.
    pub max_backoff: Duration,
    /// TCP + TLS connect. Default 5 s.
    pub connect_timeout: Duration,
    /// Time from sending a request to the response head. Default 30 s.
    pub read_timeout: Duration,
    /// One attempt of one request (uploads get more in proportion to their size). Default 30 s.
    pub attempt_timeout: Duration,
    /// Reading one GET body after its response head arrived. Default 120 s.
    pub body_timeout: Duration,
    /// A PEM file of CA certificates trusted besides the system's, for endpoints with a private
    /// CA (`--ca-bundle` / `AWS_CA_BUNDLE`). Default none.
    pub ca_bundle: Option<std::path::PathBuf>,
    /// GETs are signed and sent without the SDK's orchestrator (see `raw_get`), on the SDK
    /// client's own HTTP connector; the SDK path serves them when off. Default on.
    pub raw_get: bool,
    /// The node's clock, which the client corrects by the skew S3's responses show before signing
    /// or judging credentials' expiry (`skew.rs`); `None` = the system clock. For tests of a node
    /// whose clock is off.
    pub time_source: Option<SharedTimeSource>,
}

impl Default for S3Options {
    fn default() -> Self {
        S3Options {
            max_attempts: 5,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(120),
            ca_bundle: None,
            raw_get: true,
            time_source: None,
        }
    }
}

/// An HTTPS client that trusts the system's roots (rustls with aws-lc, as the SDK's default).
fn https_client() -> aws_sdk_s3::config::SharedHttpClient {
    use aws_smithy_http_client::tls;
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::AwsLc,
        ))
        .build_https()
}

/// An HTTPS client that trusts the system's roots and the CA certificates in `path` (PEM). The
/// error names the file and what is wrong with it.
pub fn https_client_with_ca_bundle(
    path: &std::path::Path,
) -> std::result::Result<aws_sdk_s3::config::SharedHttpClient, String> {
    use aws_smithy_http_client::tls;
    Ok(aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::AwsLc,
        ))
        .tls_context(tls_context_with_ca_bundle(path)?)
        .build_https())
}

/// The TLS settings of [`https_client_with_ca_bundle`].
fn tls_context_with_ca_bundle(
    path: &std::path::Path,
) -> std::result::Result<aws_smithy_http_client::tls::TlsContext, String> {
    use aws_smithy_http_client::tls;
    let pem = std::fs::read(path)
        .map_err(|e| format!("reading the CA bundle {}: {e}", path.display()))?;
    if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
        return Err(format!(
            "the CA bundle {} holds no PEM certificate",
            path.display()
        ));
    }
    tls::TlsContext::builder()
        .with_trust_store(tls::TrustStore::default().with_pem_certificate(pem))
        .build()
        .map_err(|e| format!("the CA bundle {}: {e}", path.display()))
}

/// Upload bandwidth assumed when stretching the attempt timeout of a large upload.
const SLOW_UPLOAD_BYTES_PER_SEC: u64 = 1024 * 1024;

/// The aws-sdk-s3 [`ObjectStore`]. Cheap to clone (the SDK client is reference-counted).
#[derive(Clone)]
pub struct S3Store {
    client: aws_sdk_s3::Client,
    endpoint_id: String,
    opts: S3Options,
    retry: RetryPolicy,
    /// The credentials provider the client signs with, for [`S3Store::check_credentials`].
    credentials: Option<SharedCredentialsProvider>,
    /// GETs without the SDK's orchestrator ([`S3Options::raw_get`]; needs a credentials provider).
    raw_get: Option<Arc<raw_get::RawGet>>,
    /// The server answered `If-None-Match: *` on a write `NotImplemented`: creates are not
    /// conditional on it.
    no_conditional_writes: Arc<std::sync::atomic::AtomicBool>,
}

impl fmt::Debug for S3Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Store")
            .field("endpoint", &self.endpoint_id)
            .finish_non_exhaustive()
    }
}

impl S3Store {
    /// A store with [`S3Options::default`].
    pub async fn new(cfg: S3Config) -> Result<S3Store> {
        Self::with_options(cfg, S3Options::default()).await
    }

    /// A store with explicit retry and timeout settings.
    pub async fn with_options(cfg: S3Config, opts: S3Options) -> Result<S3Store> {
        let provider = match &cfg.credentials {
            S3Credentials::DefaultChain => None,
            S3Credentials::Static {
                access_key_id,
                secret_access_key,
                session_token,
            } => Some(SharedCredentialsProvider::new(Credentials::new(
                access_key_id,
                secret_access_key.expose_secret(),
                session_token.as_ref().map(|t| t.expose_secret().to_owned()),
                None,
                "ferry-static",
            ))),
        };
        Self::build(cfg, opts, provider).await
    }

    /// A store that signs with `provider` (pod-level credentials that refresh themselves);
    /// `cfg.credentials` is ignored. The client's identity cache asks the provider again when the
    /// credentials it returned expire.
    pub async fn with_credentials_provider(
        cfg: S3Config,
        opts: S3Options,
        provider: SharedCredentialsProvider,
    ) -> Result<S3Store> {
        Self::build(cfg, opts, Some(provider)).await
    }

    async fn build(
        cfg: S3Config,
        opts: S3Options,
        provider: Option<SharedCredentialsProvider>,
    ) -> Result<S3Store> {
        if opts.max_attempts == 0 {
            return Err(StoreError::InvalidRequest(
                "max_attempts must be at least 1".into(),
            ));
        }
        let region = match &cfg.region {
            Some(r) => RegionProviderChain::first_try(Region::new(r.clone())),
            // An S3-compatible store's own endpoint: the instance's region (IMDS) says nothing
            // about it, and asking a link-local address off EC2 only delays the start and warns.
            None if cfg
                .endpoint_url
                .as_deref()
                .is_some_and(|u| !is_aws_endpoint(u)) =>
            {
                RegionProviderChain::first_try(
                    aws_config::environment::region::EnvironmentVariableRegionProvider::new(),
                )
                .or_else(aws_config::profile::ProfileFileRegionProvider::new())
                .or_else(Region::new("us-east-1"))
            }
            None => RegionProviderChain::default_provider().or_else(Region::new("us-east-1")),
        };
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .region(region)
            .retry_config(
                RetryConfig::standard()
                    .with_max_attempts(opts.max_attempts)
                    .with_initial_backoff(opts.initial_backoff)
                    .with_max_backoff(opts.max_backoff),
            )
            .timeout_config(timeouts(&opts, opts.attempt_timeout));
        if let Some(provider) = provider {
            loader = loader.credentials_provider(provider);
        }
        // The HTTP client is made here, not left to the SDK's default plugin, so that the raw GET
        // path can ask this very client for its connector (and so share its connection pool).
        let http_client = match &opts.ca_bundle {
            Some(path) => https_client_with_ca_bundle(path).map_err(StoreError::InvalidRequest)?,
            None => https_client(),
        };
        loader = loader.http_client(http_client);
        if let Some(url) = &cfg.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        if let Some(time) = &opts.time_source {
            loader = loader.time_source(time.clone());
        }
        let shared = loader.load().await;
        let region = shared
            .region()
            .map(|r| r.to_string())
            .unwrap_or_else(|| "us-east-1".into());
        // The one endpoint URL of the client, the raw GET path and the cache key.
        let endpoint_url = s3_endpoint_url(&shared);
        let endpoint_id = match &endpoint_url {
            Some(url) => url.to_owned(),
            None => format!("aws:{region}"),
        };
        // One identity cache for the client and the raw GET path (the SDK makes one per client
        // when none is given, out of reach): credentials fetched by either serve both.
        let identity_cache = shared
            .identity_cache()
            .unwrap_or_else(|| IdentityCache::lazy().build());
        // The client's clock is the node's corrected by the skew measured on both paths (the SDK's
        // own correction off: it would apply the skew twice), for signing and for credential
        // expiry alike (`skew.rs`).
        let clock = CorrectedClock {
            base: opts.time_source.clone().unwrap_or_default(),
            skew: Arc::new(ClockSkew::default()),
        };
        let mut s3 = aws_sdk_s3::config::Builder::from(&shared);
        s3.set_endpoint_url(endpoint_url.clone());
        let s3 = s3
            .force_path_style(cfg.force_path_style)
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .identity_cache(identity_cache.clone())
            .time_source(clock.clone())
            .disable_clock_skew_correction(true)
            .retry_classifier(attempt::SkewRetry)
            .interceptor(attempt::AttemptInterceptor {
                hook: cfg.on_attempt.clone(),
                clock: clock.clone(),
            })
            .build();
        let raw_get = match (opts.raw_get, shared.credentials_provider()) {
            (true, Some(credentials)) => {
                let endpoint = raw_get::EndpointConfig {
                    region: region.clone(),
                    endpoint_url,
                    force_path_style: cfg.force_path_style,
                    use_fips: shared.use_fips().unwrap_or(false),
                    use_dual_stack: shared.use_dual_stack().unwrap_or(false),
                };
                let raw = raw_get::RawGet::new(
                    endpoint,
                    raw_get::Shared {
                        config: &s3,
                        credentials,
                        identity_cache,
                        clock,
                        hook: cfg.on_attempt.clone(),
                    },
                    opts.clone(),
                )
                .map_err(StoreError::Other)?;
                Some(Arc::new(raw))
            }
            _ => None,
        };
        Ok(S3Store {
            client: aws_sdk_s3::Client::from_conf(s3),
            endpoint_id,
            retry: RetryPolicy::of(&opts),
            opts,
            credentials: shared.credentials_provider(),
            raw_get,
            no_conditional_writes: Default::default(),
        })
    }

    /// Creates a bucket (for tests and tooling; Ferry itself never creates buckets). A bucket that
    /// already exists and is ours is fine. Outside `us-east-1` the bucket is created in the store's
    /// region.
    pub async fn create_bucket(&self, bucket: &str) -> Result<()> {
        use aws_sdk_s3::types::{BucketLocationConstraint, CreateBucketConfiguration};
        let region = self.client.config().region().map(|r| r.to_string());
        let location = region.filter(|r| r != "us-east-1").map(|r| {
            CreateBucketConfiguration::builder()
                .location_constraint(BucketLocationConstraint::from(r.as_str()))
                .build()
        });
        match self
            .client
            .create_bucket()
            .bucket(bucket)
            .set_create_bucket_configuration(location)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("BucketAlreadyOwnedByYou") => Ok(()),
            Err(e) => Err(map_sdk_error(e, Target::Bucket(bucket))),
        }
    }

    /// Sets the bucket's policy (a JSON document); for tests that need a server to deny access.
    pub async fn put_bucket_policy(&self, bucket: &str, policy: &str) -> Result<()> {
        self.client
            .put_bucket_policy()
            .bucket(bucket)
            .policy(policy)
            .send()
            .await
            .map(drop)
            .map_err(|e| map_sdk_error(e, Target::Bucket(bucket)))
    }

    /// Resolves credentials through the configured provider (the default chain or static keys)
    /// without sending a request to S3: readiness probes use it. The error never carries a secret.
    pub async fn check_credentials(&self) -> Result<()> {
        use aws_credential_types::provider::ProvideCredentials;
        let provider = self.credentials.as_ref().ok_or_else(|| {
            StoreError::Credentials("no credentials provider is configured".into())
        })?;
        provider.provide_credentials().await.map(drop).map_err(|e| {
            let f = error::credentials_failure_of("no credentials could be resolved", &e);
            f.into_store_error(Target::Bucket(""))
        })
    }

    /// The endpoint URL, or `aws:<region>` for AWS itself: a stable name for cache keys.
    pub fn endpoint_id(&self) -> String {
        self.endpoint_id.clone()
    }

    /// PutObject, `If-None-Match: *` when `if_absent`.
    async fn send_put(
        &self,
        bucket: &str,
        key: &str,
        body: Bytes,
        if_absent: bool,
    ) -> std::result::Result<PutResult, SdkError<PutObjectError, HttpResponse>> {
        let len = body.len();
        let mut op = self
            .client
            .put_object()
            .bucket(bucket)
            .key(key)
            .body(ByteStream::from(body))
            .set_if_none_match(if_absent.then(|| "*".to_owned()))
            .customize();
        if let Some(o) = self.upload_override(len) {
            op = op.config_override(o);
        }
        let out = op.send().await?;
        Ok(PutResult {
            etag: etag_of(out.e_tag()),
        })
    }

    /// CompleteMultipartUpload, `If-None-Match: *` when `if_absent`.
    async fn send_complete(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        if_absent: bool,
    ) -> std::result::Result<PutResult, SdkError<CompleteMultipartUploadError, HttpResponse>> {
        let parts = parts
            .into_iter()
            .map(|p| {
                aws_sdk_s3::types::CompletedPart::builder()
                    .part_number(p.part_number)
                    .e_tag(p.etag)
                    .build()
            })
            .collect();
        let out = self
            .client
            .complete_multipart_upload()
            .bucket(bucket)
            .key(key)
            .upload_id(upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .set_if_none_match(if_absent.then(|| "*".to_owned()))
            .send()
            .await?;
        Ok(PutResult {
            etag: etag_of(out.e_tag()),
        })
    }

    /// A conditional create refused with `refused`: unless the object at `key` is this very
    /// write (ETag `ours`: the SDK retried a write whose first answer was lost), the refusal; a
    /// HEAD that failed for a reason that may pass, its error.
    async fn own_write_or(
        &self,
        bucket: &str,
        key: &str,
        ours: &str,
        refused: StoreError,
    ) -> Result<PutResult> {
        match self.head(bucket, key).await {
            Ok(info) if info.etag.as_deref() == Some(ours) => Ok(PutResult {
                etag: Some(ours.to_owned()),
            }),
            // Not known yet (the outage that lost the first answer may go on): an error that
            // may pass, so that the write is tried again, never a refusal of a write that may
            // have been made.
            Err(
                e @ (StoreError::Transient(_)
                | StoreError::Throttled(_)
                | StoreError::CredentialsUnavailable(_)),
            ) => Err(e),
            _ => Err(refused),
        }
    }

    /// A CompleteMultipartUpload that failed with `err`: a `NoSuchUpload` may be this very
    /// upload, completed by an earlier attempt whose answer was lost (the SDK's retry, or the
    /// file system's), since a completed upload is gone. It is, if the object at `key` has the
    /// ETag `ours` (of these parts); otherwise, and for every other failure, `err`.
    async fn completed_already_or(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        ours: Option<String>,
        err: SdkError<CompleteMultipartUploadError, HttpResponse>,
    ) -> Result<PutResult> {
        let gone = err.code() == Some("NoSuchUpload");
        let err = map_sdk_error(err, Target::Upload(bucket, key, upload_id));
        match ours {
            Some(ours) if gone => self.own_write_or(bucket, key, &ours, err).await,
            _ => Err(err),
        }
    }

    fn conditional_writes_unsupported<E: ProvideErrorMetadata>(&self, err: &E) {
        if !self.no_conditional_writes.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                endpoint = %self.endpoint_id,
                code = err.code().unwrap_or("-"),
                "the S3 server does not implement If-None-Match on writes: creates of new names may replace an object put meanwhile by someone else"
            );
        }
    }

    /// Per-request settings for an upload of `len` bytes: more time per attempt when large.
    fn upload_override(&self, len: usize) -> Option<aws_sdk_s3::config::Builder> {
        let needed = Duration::from_secs(len as u64 / SLOW_UPLOAD_BYTES_PER_SEC);
        (needed > self.opts.attempt_timeout).then(|| {
            aws_sdk_s3::config::Builder::new()
                .timeout_config(timeouts(&self.opts, self.opts.attempt_timeout + needed))
        })
    }

    /// Per-request settings for a GET or LIST: no retries of the SDK's own (`retry.rs` runs the
    /// attempts).
    fn one_attempt() -> aws_sdk_s3::config::Builder {
        aws_sdk_s3::config::Builder::new().retry_config(RetryConfig::disabled())
    }

    /// One ListObjectsV2 attempt.
    async fn list_once(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage, Failure> {
        let max_keys = req.max_keys.map(|m| m.min(MAX_LIST_KEYS) as i32);
        let out = self
            .client
            .list_objects_v2()
            .bucket(bucket)
            .set_prefix((!req.prefix.is_empty()).then(|| req.prefix.to_owned()))
            .set_delimiter(req.delimiter.filter(|d| !d.is_empty()).map(str::to_owned))
            .set_continuation_token(req.continuation)
            .set_max_keys(max_keys)
            .set_start_after(req.start_after.map(str::to_owned))
            // Keys may hold characters XML 1.0 cannot carry (control characters): asked for
            // URL-encoded, one such key cannot make a whole page unreadable.
            .encoding_type(EncodingType::Url)
            .customize()
            .config_override(Self::one_attempt())
            .send()
            .await
            .map_err(|e| sdk_failure(e, Target::Bucket(bucket)))?;
        list_page(bucket, req.prefix, req.delimiter, &out)
    }

    /// A ranged GET pinned to `pin` (none: any version), on the raw path where it serves the
    /// bucket, else through the SDK; every attempt (a broken body included) is one of `retry.rs`'s.
    async fn get_pinned(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        pin: Option<Version<'_>>,
        piece: Option<u64>,
    ) -> Result<Vec<Bytes>> {
        let target = Target::Object(bucket, key);
        if range.start >= range.end {
            return Err(StoreError::InvalidRequest(format!(
                "empty range {range:?} of {bucket}/{key}"
            )));
        }
        let raw = match &self.raw_get {
            Some(raw) => match raw.endpoint(bucket).await {
                Ok(Some(endpoint)) => Some((raw, endpoint)),
                Ok(None) => None,
                Err(f) => return Err(f.into_store_error(target)),
            },
            None => None,
        };
        self.retry
            .run("GET", |_| async {
                match &raw {
                    Some((raw, endpoint)) => {
                        raw.attempt(endpoint, bucket, key, &range, pin, piece).await
                    }
                    None => self.get_once(bucket, key, &range, pin, piece).await,
                }
            })
            .await
            .map_err(|f| f.into_store_error(target))
    }

    /// One GET attempt through the SDK, its body checked against the range.
    async fn get_once(
        &self,
        bucket: &str,
        key: &str,
        range: &Range<u64>,
        pin: Option<Version<'_>>,
        piece: Option<u64>,
    ) -> Result<Vec<Bytes>, Failure> {
        let what = || format!("GET {bucket}/{key} bytes {}..{}", range.start, range.end);
        let (if_match, since) = get::conditions(pin);
        let out = self
            .client
            .get_object()
            .bucket(bucket)
            .key(key)
            .range(format!("bytes={}-{}", range.start, range.end - 1))
            .set_if_match(if_match.map(str::to_owned))
            .set_if_unmodified_since(since.map(DateTime::from))
            .customize()
            .config_override(Self::one_attempt())
            .send()
            .await
            .map_err(|e| sdk_failure(e, Target::Object(bucket, key)))?;
        let declared = out.content_length().and_then(|l| u64::try_from(l).ok());
        let content_range = out.content_range().map(str::to_owned);
        check_version(
            &what,
            pin,
            etag_of(out.e_tag()).as_deref(),
            to_system_time(out.last_modified()),
            content_range.as_deref(),
            declared,
        )?;
        read_checked(
            &what,
            range,
            content_range.as_deref(),
            declared,
            out.body,
            self.opts.body_timeout,
            piece,
        )
        .await
    }
}

/// The S3 endpoint URL as the SDK's S3 client would take it from `shared`: one given in code, else
/// `AWS_ENDPOINT_URL_S3` (or the profile's `s3.endpoint_url`), else `AWS_ENDPOINT_URL`. It is set
/// explicitly on the client so that the raw GET path and [`S3Store::endpoint_id`] use the same.
fn s3_endpoint_url(shared: &aws_config::SdkConfig) -> Option<String> {
    if shared.get_origin("endpoint_url").is_client_config() {
        return shared.endpoint_url().map(str::to_owned);
    }
    let key = aws_types::service_config::ServiceConfigKey::builder()
        .service_id("S3")
        .env("AWS_ENDPOINT_URL")
        .profile("endpoint_url")
        .build()
        .expect("all fields set");
    shared
        .service_config()
        .and_then(|c| c.load_config(key))
        .or_else(|| shared.endpoint_url().map(str::to_owned))
}

/// The SDK timeouts for attempts of at most `attempt`.
///
/// The SDK's read timeout runs from sending the request (body included) to the response head, so
/// an upload that may take longer than [`S3Options::read_timeout`] needs a longer one too. The
/// read timeout is part of the HTTP connector's settings, and the SDK builds one connector (and
/// connection pool) per distinct setting, so it is rounded up to whole 5-minute steps to keep the
/// number of variants small.
fn timeouts(opts: &S3Options, attempt: Duration) -> TimeoutConfig {
    const STEP: u64 = 300;
    let read = if attempt <= opts.read_timeout {
        opts.read_timeout
    } else {
        Duration::from_secs(attempt.as_secs().div_ceil(STEP).max(1) * STEP).max(opts.read_timeout)
    };
    TimeoutConfig::builder()
        .connect_timeout(opts.connect_timeout)
        .read_timeout(read)
        .operation_attempt_timeout(attempt)
        .build()
}

/// The page a ListObjectsV2 answer `out` to a LIST of `prefix` and `delimiter` gives: keys
/// decoded (when the server URL-encoded them), and an answer that may have been cut short refused
/// as [`Kind::Corrupt`].
fn list_page(
    bucket: &str,
    prefix: &str,
    delimiter: Option<&str>,
    out: &aws_sdk_s3::operation::list_objects_v2::ListObjectsV2Output,
) -> Result<ListPage, Failure> {
    // A server that ignores `EncodingType` says so by not echoing it: its keys are taken as
    // they are (decoding them would corrupt keys holding `%` or `+`).
    let encoded = out.encoding_type() == Some(&EncodingType::Url);
    let text = |raw: &str| -> Option<String> {
        if !encoded {
            return Some(raw.to_owned());
        }
        let decoded = url_decode(raw);
        if decoded.is_none() {
            tracing::warn!(
                bucket,
                raw,
                "LIST returned a key that does not URL-decode to UTF-8; skipped"
            );
        }
        decoded
    };
    let objects: Vec<ObjectInfo> = out
        .contents()
        .iter()
        .filter_map(|o| {
            Some(ObjectInfo {
                key: text(o.key()?)?,
                size: size_of(o.size()),
                etag: etag_of(o.e_tag()),
                last_modified: to_system_time(o.last_modified()),
            })
        })
        .collect();
    let common_prefixes: Vec<String> = out
        .common_prefixes()
        .iter()
        .filter_map(|p| text(p.prefix()?))
        .collect();
    // A body cut short can still parse (the SDK's XML reader stops at the end of the input):
    // a page without `IsTruncated` (always sent), with fewer entries than its `KeyCount`, whose
    // last object has no `Size` (cut inside it: its key may be a prefix of the real one), or
    // with a common prefix that is not `prefix` + one segment + delimiter (cut inside it) is
    // broken, never a shorter listing.
    let (keys, entries) = (
        out.contents().len(),
        out.contents().len() + out.common_prefixes().len(),
    );
    let delimiter = delimiter.filter(|d| !d.is_empty());
    let whole_prefix = |p: &String| match delimiter {
        // The segment may be empty: a key `a//b` listed under `a/` gives `a//`.
        Some(d) => p
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.strip_suffix(d).is_some_and(|seg| !seg.contains(d))),
        None => true,
    };
    let complete = out.is_truncated().is_some()
        && out
            .key_count()
            .is_none_or(|k| usize::try_from(k).is_ok_and(|k| k == entries || k == keys))
        && out
            .contents()
            .last()
            .is_none_or(|o| o.key().is_some() && o.size().is_some())
        && common_prefixes.iter().all(whole_prefix);
    if !complete {
        return Err(Failure::new(
            Kind::Corrupt,
            format!(
                "LIST {bucket}/{}: incomplete response ({entries} entries, KeyCount {:?}, IsTruncated {:?})",
                prefix,
                out.key_count(),
                out.is_truncated()
            ),
        ));
    }
    let next_token = if out.is_truncated().unwrap_or(false) {
        let token = out.next_continuation_token().map(str::to_owned);
        if token.is_none() {
            return Err(Failure::new(
                Kind::Corrupt,
                format!(
                    "LIST {bucket}/{}: truncated page without a continuation token",
                    prefix
                ),
            ));
        }
        token
    } else {
        None
    };
    Ok(ListPage {
        objects,
        common_prefixes,
        next_token,
    })
}

/// The page a ListMultipartUploads answer `out` gives: keys and markers decoded (when the server
/// says it URL-encoded them; an upload whose key does not decode is skipped, as a LIST skips such a
/// key); a truncated page must say where the next one starts.
fn uploads_page(
    bucket: &str,
    prefix: &str,
    out: &aws_sdk_s3::operation::list_multipart_uploads::ListMultipartUploadsOutput,
) -> Result<UploadsPage> {
    let encoded = out.encoding_type() == Some(&EncodingType::Url);
    let text = |raw: &str| -> Option<String> {
        match encoded {
            true => url_decode(raw),
            false => Some(raw.to_owned()),
        }
    };
    let uploads = out
        .uploads()
        .iter()
        .filter_map(|u| {
            let (raw, upload_id) = (u.key()?, u.upload_id()?);
            let key = text(raw);
            if key.is_none() {
                tracing::warn!(
                    bucket,
                    raw,
                    "ListMultipartUploads returned a key that does not URL-decode to UTF-8; skipped"
                );
            }
            Some(Upload {
                key: key?,
                upload_id: upload_id.to_owned(),
            })
        })
        .collect();
    let corrupt = |what: &str| {
        StoreError::Corrupt(format!(
            "ListMultipartUploads {bucket}/{prefix}: truncated page {what}"
        ))
    };
    let next = match out.is_truncated() {
        Some(true) => {
            let key = out
                .next_key_marker()
                .filter(|k| !k.is_empty())
                .ok_or_else(|| corrupt("without a NextKeyMarker"))?;
            Some(UploadsMarker {
                key: text(key).ok_or_else(|| corrupt("whose NextKeyMarker does not decode"))?,
                upload_id: out
                    .next_upload_id_marker()
                    .filter(|id| !id.is_empty())
                    .map(str::to_owned),
            })
        }
        _ => None,
    };
    Ok(UploadsPage { uploads, next })
}

/// Whether a ListObjectsV2 body is whole: it ends (past trailing whitespace) with the closing
/// tag of its root. A body cut short can parse as a shorter page, which no check of the parsed
/// page can always tell (a cut between two entries of a page without `KeyCount`).
pub(crate) fn list_body_whole(body: &[u8]) -> bool {
    body.trim_ascii_end().ends_with(b"</ListBucketResult>")
}

/// Why a ListObjectsV2 answer that is not [`list_body_whole`] is refused.
pub(crate) const LIST_CUT_SHORT: &str =
    "ListObjectsV2: the response body ends before </ListBucketResult>";

/// A key or prefix from a LIST asked for with `EncodingType=url`, decoded as S3 encodes it
/// (form-style: `+` is a space, `%XX` a byte; AWS, moto and botocore agree); `None` if the bytes
/// are not UTF-8.
fn url_decode(raw: &str) -> Option<String> {
    let spaced = raw.replace('+', " ");
    percent_encoding::percent_decode_str(&spaced)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

fn to_system_time(t: Option<&DateTime>) -> Option<SystemTime> {
    t.and_then(|t| SystemTime::try_from(*t).ok())
}

/// The body read in one piece.
fn one(mut pieces: Vec<Bytes>) -> Bytes {
    pieces.pop().unwrap_or_default()
}

fn size_of(len: Option<i64>) -> u64 {
    len.and_then(|l| u64::try_from(l).ok()).unwrap_or(0)
}

#[async_trait]
impl ObjectStore for S3Store {
    async fn head_bucket(&self, bucket: &str) -> Result<()> {
        let failure = match self.client.head_bucket().bucket(bucket).send().await {
            Ok(_) => return Ok(()),
            Err(e) => sdk_failure(e, Target::Bucket(bucket)),
        };
        if failure.kind != Kind::NotFound {
            return Err(failure.into_store_error(Target::Bucket(bucket)));
        }
        // HeadBucket's 404 has no body, so no code: a missing bucket and an access key the server
        // does not know look alike. A one-key LIST (the same s3:ListBucket permission) has one.
        let probe = ListRequest {
            max_keys: Some(1),
            ..Default::default()
        };
        match self.list(bucket, probe).await {
            Ok(_) => Err(StoreError::Other(format!(
                "{}; yet a LIST of the bucket succeeded",
                failure.detail
            ))),
            Err(e) => Err(e),
        }
    }

    async fn list(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage> {
        // A LIST is idempotent: a 2xx that does not parse is asked for again, like a broken GET
        // body, as one more attempt of the same policy.
        self.retry
            .run("LIST", |_| self.list_once(bucket, req.clone()))
            .await
            .map_err(|f| f.into_store_error(Target::Bucket(bucket)))
    }

    async fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo> {
        let out = self
            .client
            .head_object()
            .bucket(bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Object(bucket, key)))?;
        Ok(ObjectInfo {
            key: key.to_owned(),
            size: size_of(out.content_length()),
            etag: etag_of(out.e_tag()),
            last_modified: to_system_time(out.last_modified()),
        })
    }

    /// One request: the GET of the first byte answers what a HEAD does (the ETag, Last-Modified,
    /// the size in `Content-Range`) and shows the credentials may read the bytes.
    async fn head_readable(&self, bucket: &str, key: &str) -> Result<Probed> {
        let out = match self
            .client
            .get_object()
            .bucket(bucket)
            .key(key)
            .range("bytes=0-0")
            .send()
            .await
        {
            Ok(out) => out,
            Err(e) => match map_sdk_error(e, Target::Object(bucket, key)) {
                // An empty object has no first byte (416): nothing to read, the HEAD says the rest.
                StoreError::InvalidRequest(_) => {
                    return self.head(bucket, key).await.map(Probed::read)
                }
                // Refused: the HEAD may still be answered (SSE-KMS without `kms:Decrypt`, an
                // archived object): the object is there, its bytes are not these credentials'.
                StoreError::AccessDenied(_) => {
                    return self.head(bucket, key).await.map(Probed::not_read)
                }
                e => return Err(e),
            },
        };
        let etag = etag_of(out.e_tag());
        let last_modified = to_system_time(out.last_modified());
        let size = match out.content_range() {
            Some(range) => range
                .rsplit_once('/')
                .and_then(|(_, total)| total.parse().ok())
                .ok_or_else(|| {
                    StoreError::Other(format!(
                        "GET of the first byte of {key:?}: no total size in Content-Range {range:?}"
                    ))
                })?,
            // A server that ignored the range sends the whole object: its length is the size,
            // and the body is not read (dropping it closes the connection).
            None => size_of(out.content_length()),
        };
        if out.content_range().is_some() {
            out.body.collect().await.map_err(|e| {
                StoreError::Transient(format!("reading the first byte of {key:?}: {e}"))
            })?;
        }
        Ok(Probed::read(ObjectInfo {
            key: key.to_owned(),
            size,
            etag,
            last_modified,
        }))
    }

    async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> Result<Bytes> {
        self.get_pinned(bucket, key, range, if_match.map(Version::ETag), None)
            .await
            .map(one)
    }

    async fn get_range_pieces(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        piece: u64,
    ) -> Result<Vec<Bytes>> {
        self.get_pinned(bucket, key, range, if_match.map(Version::ETag), Some(piece))
            .await
    }

    async fn get_range_unmodified(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        last_modified: Option<SystemTime>,
        size: u64,
    ) -> Result<Bytes> {
        let pin = Version::Unmodified {
            last_modified,
            size,
        };
        self.get_pinned(bucket, key, range, Some(pin), None)
            .await
            .map(one)
    }

    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        self.send_put(bucket, key, body, false)
            .await
            .map_err(|e| map_sdk_error(e, Target::Object(bucket, key)))
    }

    async fn put_if_absent(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        if self.no_conditional_writes.load(Ordering::Relaxed) {
            return self.put(bucket, key, body).await;
        }
        let err = match self.send_put(bucket, key, body.clone(), true).await {
            Ok(put) => return Ok(put),
            Err(e) => e,
        };
        match condition_answer(&err) {
            Some(ConditionAnswer::Unsupported) => {
                self.conditional_writes_unsupported(&err);
                self.put(bucket, key, body).await
            }
            Some(ConditionAnswer::Refused) => {
                let ours = format!("\"{}\"", hex(&md5::Md5::digest(&body)));
                self.own_write_or(
                    bucket,
                    key,
                    &ours,
                    map_sdk_error(err, Target::Object(bucket, key)),
                )
                .await
            }
            None => Err(map_sdk_error(err, Target::Object(bucket, key))),
        }
    }

    async fn create_multipart(&self, bucket: &str, key: &str) -> Result<String> {
        let out = self
            .client
            .create_multipart_upload()
            .bucket(bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Object(bucket, key)))?;
        out.upload_id().map(str::to_owned).ok_or_else(|| {
            StoreError::Other(format!(
                "CreateMultipartUpload {bucket}/{key}: no upload id in the response"
            ))
        })
    }

    async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> Result<CompletedPart> {
        let len = body.len();
        let mut op = self
            .client
            .upload_part()
            .bucket(bucket)
            .key(key)
            .upload_id(upload_id)
            .part_number(part_number)
            .body(ByteStream::from(body))
            .customize();
        if let Some(o) = self.upload_override(len) {
            op = op.config_override(o);
        }
        let out = op
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Upload(bucket, key, upload_id)))?;
        let etag = etag_of(out.e_tag()).ok_or_else(|| {
            StoreError::Other(format!(
                "UploadPart {bucket}/{key} part {part_number}: no ETag in the response"
            ))
        })?;
        Ok(CompletedPart { part_number, etag })
    }

    async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        let ours = multipart_etag(&parts);
        match self
            .send_complete(bucket, key, upload_id, parts, false)
            .await
        {
            Ok(put) => Ok(put),
            Err(e) => {
                self.completed_already_or(bucket, key, upload_id, ours, e)
                    .await
            }
        }
    }

    async fn complete_multipart_if_absent(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        if self.no_conditional_writes.load(Ordering::Relaxed) {
            return self.complete_multipart(bucket, key, upload_id, parts).await;
        }
        let ours = multipart_etag(&parts);
        let err = match self
            .send_complete(bucket, key, upload_id, parts.clone(), true)
            .await
        {
            Ok(put) => return Ok(put),
            Err(e) => e,
        };
        let target = Target::Upload(bucket, key, upload_id);
        match condition_answer(&err) {
            Some(ConditionAnswer::Unsupported) => {
                self.conditional_writes_unsupported(&err);
                self.complete_multipart(bucket, key, upload_id, parts).await
            }
            Some(ConditionAnswer::Refused) => match ours {
                Some(ours) => {
                    self.own_write_or(bucket, key, &ours, map_sdk_error(err, target))
                        .await
                }
                None => Err(map_sdk_error(err, target)),
            },
            None => {
                self.completed_already_or(bucket, key, upload_id, ours, err)
                    .await
            }
        }
    }

    async fn abort_multipart(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()> {
        self.client
            .abort_multipart_upload()
            .bucket(bucket)
            .key(key)
            .upload_id(upload_id)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Upload(bucket, key, upload_id)))?;
        Ok(())
    }

    async fn list_uploads(&self, bucket: &str, req: UploadsRequest<'_>) -> Result<UploadsPage> {
        let (key_marker, upload_id_marker) = match req.after {
            Some(m) => (Some(m.key), m.upload_id),
            None => (None, None),
        };
        let out = self
            .client
            .list_multipart_uploads()
            .bucket(bucket)
            .set_prefix((!req.prefix.is_empty()).then(|| req.prefix.to_owned()))
            .set_key_marker(key_marker)
            .set_upload_id_marker(upload_id_marker)
            .set_max_uploads(req.max_uploads.map(|m| m.min(MAX_LIST_KEYS) as i32))
            // As for LIST: a key XML 1.0 cannot carry does not make the page unreadable.
            .encoding_type(EncodingType::Url)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Bucket(bucket)))?;
        uploads_page(bucket, req.prefix, &out)
    }

    async fn delete(&self, bucket: &str, key: &str) -> Result<()> {
        self.client
            .delete_object()
            .bucket(bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Object(bucket, key)))?;
        Ok(())
    }

    async fn delete_many(&self, bucket: &str, keys: &[String]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        if keys.len() > MAX_DELETE_BATCH {
            return Err(StoreError::InvalidRequest(format!(
                "{} keys in one DeleteObjects, at most {MAX_DELETE_BATCH} allowed",
                keys.len()
            )));
        }
        // DeleteObjects names its keys in an XML body, which cannot carry control characters
        // (XML 1.0 forbids most; parsers rewrite `\r`): such keys are deleted one by one.
        let (plain, unsafe_in_xml): (Vec<&String>, Vec<&String>) =
            keys.iter().partition(|k| !k.chars().any(char::is_control));
        for key in unsafe_in_xml {
            self.delete(bucket, key).await?;
        }
        if plain.is_empty() {
            return Ok(());
        }
        let objects = plain
            .into_iter()
            .map(|k| ObjectIdentifier::builder().key(k).build())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| StoreError::InvalidRequest(format!("DeleteObjects {bucket}: {e}")))?;
        let delete = Delete::builder()
            .set_objects(Some(objects))
            .quiet(true)
            .build()
            .map_err(|e| StoreError::InvalidRequest(format!("DeleteObjects {bucket}: {e}")))?;
        let out = self
            .client
            .delete_objects()
            .bucket(bucket)
            .delete(delete)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Bucket(bucket)))?;
        match out.errors().first() {
            None => Ok(()),
            Some(first) => Err(delete_error(bucket, first, out.errors().len())),
        }
    }
}

/// An ETag as the server sent it, or `None` when it sent an empty one (versitygw's posix backend
/// lists files put in its directory by other means with `<ETag></ETag>`): an empty ETag is the
/// same for every version, so taken for one it would make two versions look alike (the kernel's
/// page cache and the node cache would serve the old bytes for the new version).
pub(crate) fn etag_of(e: Option<&str>) -> Option<String> {
    e.filter(|e| {
        !e.trim()
            .trim_start_matches("W/")
            .trim_matches('"')
            .is_empty()
    })
    .map(str::to_owned)
}

/// What a server's refusal of a conditional write says about the condition.
#[derive(Debug, PartialEq, Eq)]
enum ConditionAnswer {
    /// `412`: an object has the key.
    Refused,
    /// `NotImplemented` or `501`: the server does not take the header.
    Unsupported,
}

fn condition_answer<E: ProvideErrorMetadata>(
    err: &SdkError<E, HttpResponse>,
) -> Option<ConditionAnswer> {
    let status = err.raw_response().map(|r| r.status().as_u16());
    match (err.code(), status) {
        // `ConditionalRequestConflict` (409): a write to the key raced this one.
        (Some("PreconditionFailed" | "ConditionalRequestConflict"), _) | (_, Some(412)) => {
            Some(ConditionAnswer::Refused)
        }
        (Some("NotImplemented"), _) | (_, Some(501)) => Some(ConditionAnswer::Unsupported),
        _ => None,
    }
}

/// The ETag S3 gives a multipart object of `parts` (the MD5 of their MD5s, `-` their count), if
/// every part's ETag is an MD5.
fn multipart_etag(parts: &[CompletedPart]) -> Option<String> {
    let mut digests = Vec::with_capacity(parts.len() * 16);
    for p in parts {
        let h = p.etag.trim_matches('"');
        if h.len() != 32 {
            return None;
        }
        for i in (0..32).step_by(2) {
            digests.push(u8::from_str_radix(h.get(i..i + 2)?, 16).ok()?);
        }
    }
    Some(format!(
        "\"{}-{}\"",
        hex(&md5::Md5::digest(&digests)),
        parts.len()
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `url` is an AWS S3 endpoint (a host under `amazonaws.com` or `amazonaws.com.cn`: a
/// regional, FIPS, dual-stack, VPC or access point endpoint), whose region the instance's own
/// region may tell when no region is given.
fn is_aws_endpoint(url: &str) -> bool {
    let Some(host) = url
        .parse::<http::Uri>()
        .ok()
        .and_then(|u| u.host().map(str::to_ascii_lowercase))
    else {
        return false;
    };
    let host = host.trim_end_matches('.');
    ["amazonaws.com", "amazonaws.com.cn"]
        .iter()
        .any(|d| host == *d || host.ends_with(&format!(".{d}")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_aws_hosts_are_aws_endpoints() {
        for aws in [
            "https://s3.us-west-2.amazonaws.com",
            "https://bucket.vpce-0a1b-c2d3.s3.us-west-2.vpce.amazonaws.com/",
            "https://s3.cn-north-1.amazonaws.com.cn",
            "https://S3.AMAZONAWS.COM.",
        ] {
            assert!(is_aws_endpoint(aws), "{aws}");
        }
        for other in [
            "http://127.0.0.1:9000",
            "https://storage.googleapis.com",
            "https://amazonaws.com.evil.example",
            "https://notamazonaws.com",
            "not a url",
        ] {
            assert!(!is_aws_endpoint(other), "{other}");
        }
    }

    use super::*;
    use crate::get::parse_content_range;
    use aws_credential_types::provider::error::CredentialsError;
    use aws_credential_types::provider::{future, ProvideCredentials};

    #[test]
    fn a_list_body_cut_anywhere_before_its_closing_tag_is_not_whole() {
        let body = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult><Name>b</Name>\
<IsTruncated>true</IsTruncated><NextContinuationToken>t</NextContinuationToken>\
<Contents><Key>dir/a</Key><Size>1</Size></Contents></ListBucketResult>\r\n";
        assert!(list_body_whole(body));
        let end = body.len() - 2;
        for cut in 0..end {
            assert!(!list_body_whole(&body[..cut]), "cut at {cut}");
        }
        // The fuzzer's case: a page without KeyCount cut after IsTruncated read as an empty one.
        let page = fuzzing::list_response(200, &body[..body.len() / 2], "dir/", Some("/"));
        assert!(page.is_err(), "{page:?}");
        assert_eq!(
            fuzzing::list_response(200, body, "dir/", Some("/")).map(|p| p.objects.len()),
            Ok(1)
        );
    }

    #[test]
    fn debug_redacts_secrets() {
        let creds = S3Credentials::Static {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG".into(),
            session_token: Some("FwoGZXIvYXdzEBY".into()),
        };
        let cfg = S3Config {
            endpoint_url: Some("http://127.0.0.1:1".into()),
            region: None,
            force_path_style: true,
            credentials: creds.clone(),
            on_attempt: None,
        };
        for text in [
            format!("{creds:?}"),
            format!("{cfg:?}"),
            format!("{cfg:#?}"),
        ] {
            assert!(!text.contains("wJalr"), "{text}");
            assert!(!text.contains("FwoG"), "{text}");
            assert!(text.contains("REDACTED"), "{text}");
            assert!(text.contains("AKIDEXAMPLE"), "{text}");
        }
        let no_token = S3Credentials::Static {
            access_key_id: "a".into(),
            secret_access_key: "s".into(),
            session_token: None,
        };
        assert!(format!("{no_token:?}").contains("session_token: None"));
        assert_eq!(format!("{:?}", S3Credentials::DefaultChain), "DefaultChain");
    }

    #[test]
    fn upload_timeouts_grow_in_steps() {
        let opts = S3Options::default();
        let t = timeouts(&opts, opts.attempt_timeout);
        assert_eq!(t.read_timeout(), Some(opts.read_timeout));
        assert_eq!(t.operation_attempt_timeout(), Some(opts.attempt_timeout));
        assert_eq!(t.connect_timeout(), Some(opts.connect_timeout));
        let t = timeouts(&opts, Duration::from_secs(95));
        assert_eq!(t.read_timeout(), Some(Duration::from_secs(300)));
        assert_eq!(t.operation_attempt_timeout(), Some(Duration::from_secs(95)));
        let t = timeouts(&opts, Duration::from_secs(301));
        assert_eq!(t.read_timeout(), Some(Duration::from_secs(600)));
    }

    #[test]
    fn content_range_parsing() {
        assert_eq!(parse_content_range("bytes 0-9/10"), Some((0, 9, Some(10))));
        assert_eq!(parse_content_range("bytes 5-5/*"), Some((5, 5, None)));
        assert_eq!(
            parse_content_range(" bytes  2-3/100 "),
            Some((2, 3, Some(100)))
        );
        for bad in [
            "",
            "bytes */10",
            "bytes 9-0/10",
            "items 0-1/2",
            "bytes 0-x/2",
            "bytes 0-1",
            "bytes 0-9/5",
            "bytes 0-9/9",
        ] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }

    fn local_cfg() -> S3Config {
        S3Config {
            // Nothing listens on port 1: connections are refused at once, on loopback only.
            endpoint_url: Some("http://127.0.0.1:1".into()),
            region: Some("eu-west-3".into()),
            force_path_style: true,
            credentials: S3Credentials::Static {
                access_key_id: "a".into(),
                secret_access_key: "s".into(),
                session_token: None,
            },
            on_attempt: None,
        }
    }

    fn fast_opts() -> S3Options {
        S3Options {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(10),
            connect_timeout: Duration::from_secs(2),
            ..S3Options::default()
        }
    }

    #[tokio::test]
    async fn endpoint_id_names_the_endpoint_or_region() {
        let s = S3Store::with_options(local_cfg(), fast_opts())
            .await
            .unwrap();
        assert_eq!(s.endpoint_id(), "http://127.0.0.1:1");
        assert!(format!("{s:?}").contains("127.0.0.1:1"));
        let mut aws = local_cfg();
        aws.endpoint_url = None;
        // Only builds a client; sends nothing.
        let s = S3Store::with_options(aws, fast_opts()).await.unwrap();
        if std::env::var_os("AWS_ENDPOINT_URL").is_none()
            && std::env::var_os("AWS_ENDPOINT_URL_S3").is_none()
        {
            assert_eq!(s.endpoint_id(), "aws:eu-west-3");
        }
        let bad = S3Options {
            max_attempts: 0,
            ..S3Options::default()
        };
        assert!(S3Store::with_options(local_cfg(), bad).await.is_err());
    }

    #[tokio::test]
    async fn connection_refused_is_transient() {
        let s = S3Store::with_options(local_cfg(), fast_opts())
            .await
            .unwrap();
        let e = s.head("b", "k").await.unwrap_err();
        assert!(matches!(e, StoreError::Transient(_)), "{e:?}");
        assert!(e.is_retryable());
    }

    #[tokio::test]
    async fn empty_range_is_refused_without_a_request() {
        let s = S3Store::with_options(local_cfg(), fast_opts())
            .await
            .unwrap();
        let e = s.get_range("b", "k", 4..4, None).await.unwrap_err();
        assert!(matches!(e, StoreError::InvalidRequest(_)), "{e:?}");
        s.delete_many("b", &[]).await.unwrap();
        let many: Vec<String> = (0..1001).map(|i| i.to_string()).collect();
        assert!(matches!(
            s.delete_many("b", &many).await,
            Err(StoreError::InvalidRequest(_))
        ));
    }

    /// A credentials provider that fails: definitively (the provider refused) or transiently
    /// (it could not be reached), as ferry-creds reports it.
    #[derive(Debug)]
    struct Failing {
        refused: bool,
    }

    impl ProvideCredentials for Failing {
        fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
        where
            Self: 'a,
        {
            future::ProvideCredentials::ready(Err(if self.refused {
                CredentialsError::invalid_configuration("STS: AccessDenied: not authorized")
            } else {
                CredentialsError::provider_error("STS: connection refused")
            }))
        }
    }

    /// Every path of a store reports a failing provider the same way: a refusal as `Credentials`
    /// (EACCES), a provider that cannot answer as `CredentialsUnavailable` (EIO); no request goes
    /// out either way (port 1 would refuse it: `Transient`).
    #[tokio::test]
    async fn credential_failures_are_definitive_or_transient_on_every_path() {
        for refused in [true, false] {
            for raw_get in [true, false] {
                let opts = S3Options {
                    raw_get,
                    ..fast_opts()
                };
                let provider = SharedCredentialsProvider::new(Failing { refused });
                let s = S3Store::build(local_cfg(), opts, Some(provider))
                    .await
                    .unwrap();
                let check = |e: StoreError| {
                    if refused {
                        assert!(matches!(e, StoreError::Credentials(_)), "{e:?}");
                        assert!(e.to_string().contains("AccessDenied"), "{e}");
                    } else {
                        assert!(matches!(e, StoreError::CredentialsUnavailable(_)), "{e:?}");
                        assert!(e.to_string().contains("connection refused"), "{e}");
                    }
                };
                check(s.head_bucket("b").await.unwrap_err());
                check(s.get_range("b", "k", 0..10, None).await.unwrap_err());
                check(s.check_credentials().await.unwrap_err());
            }
        }
    }

    #[tokio::test]
    async fn static_credentials_check_without_a_request() {
        let s = S3Store::with_options(local_cfg(), fast_opts())
            .await
            .unwrap();
        // Port 1 refuses connections: success proves no request was sent.
        s.check_credentials().await.unwrap();
    }
}
