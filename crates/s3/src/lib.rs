//! [`S3Store`]: the [`ObjectStore`] over aws-sdk-s3 — the only crate of Ferry that names SDK types.
//!
//! - GETs (`get_range`) are signed and sent by `raw_get` on the SDK's HTTP connector, without the
//!   SDK's orchestrator, unless [`S3Options::raw_get`] is off or the bucket needs another signing
//!   scheme; everything below holds for both paths.
//! - Retries: the SDK's *standard* mode (exponential backoff with full jitter, a retry quota; the
//!   raw GET path has no retry quota), [`S3Options::max_attempts`] attempts in all. Those cover
//!   throttling, 5xx, timeouts and connection failures. On top of that, `get_range` re-reads a body that came back short or broke
//!   mid-stream, and `list` asks again when a 2xx response does not parse (the SDK does not retry
//!   that), up to [`S3Options::body_attempts`] times.
//! - Timeouts on every request: connect, read (time to the response head) and per attempt; large
//!   uploads get a longer attempt timeout in proportion to their size.
//! - Checksums: requests carry checksums only where S3 requires them (DeleteObjects), and responses
//!   are validated only where required, because many S3-compatible servers reject or mangle the
//!   SDK's default trailing checksums. Integrity of reads rests on TLS plus the length checks here.
//! - Errors map onto [`StoreError`] by S3 error code first, HTTP status second:
//!
//! | code / status | [`StoreError`] |
//! |---|---|
//! | `NoSuchBucket`; a bare 404 to HeadBucket | `NoSuchBucket` |
//! | `NoSuchKey`, `NotFound`, `NoSuchUpload`, 404 | `NotFound` |
//! | `AccessDenied`, `InvalidAccessKeyId`, `SignatureDoesNotMatch`, `ExpiredToken`, 401, 403 | `AccessDenied` |
//! | `PreconditionFailed`, 412 | `PreconditionFailed` |
//! | `InvalidRange`, 416, other 400 | `InvalidRequest` |
//! | `SlowDown`, `Throttling*`, `RequestLimitExceeded`, `TooManyRequests`, 429, 503 | `Throttled` |
//! | `RequestTimeout`, `InternalError`, other 5xx but 501; timeouts; connection failures; a 2xx whose body cannot be read | `Transient` |
//! | the credentials provider failed (no request was sent) | `Credentials` |
//! | body shorter or longer than its headers or the range say | `Corrupt` |
//! | anything else (3xx, 405, 409, 501, ...) | `Other` |
//!
//! HEAD responses have no body, so a HeadObject on a missing bucket is a bare 404: `NotFound`.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::meta::region::RegionProviderChain;
use aws_config::BehaviorVersion;
use aws_credential_types::provider::error::CredentialsError;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
    SharedCredentialsProvider,
};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::RequestId;
use aws_sdk_s3::primitives::{ByteStream, DateTime};
use aws_sdk_s3::types::{CompletedMultipartUpload, Delete, EncodingType, ObjectIdentifier};
use bytes::Bytes;

mod raw_get;

use ferry_store::{
    CompletedPart, ListPage, ListRequest, ObjectInfo, ObjectStore, PutResult, Result, StoreError,
    Version, MAX_DELETE_BATCH, MAX_LIST_KEYS,
};

/// Where an [`S3Store`] connects and as whom.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
}

/// How an [`S3Store`] gets credentials. `Debug` never prints a secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum S3Credentials {
    /// The SDK's default chain: env, profile, web identity (IRSA), ECS, IMDS.
    #[default]
    DefaultChain,
    Static {
        access_key_id: String,
        secret_access_key: String,
        session_token: Option<String>,
    },
}

impl fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            S3Credentials::DefaultChain => f.write_str("DefaultChain"),
            S3Credentials::Static {
                access_key_id,
                session_token,
                ..
            } => f
                .debug_struct("Static")
                .field("access_key_id", access_key_id)
                .field("secret_access_key", &format_args!("<redacted>"))
                .field(
                    "session_token",
                    &session_token.as_ref().map(|_| format_args!("<redacted>")),
                )
                .finish(),
        }
    }
}

/// Retry and timeout tuning for an [`S3Store`]; [`Default`] suits production.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Options {
    /// Attempts per request in all (the SDK's standard retry mode). Default 5.
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
    /// Attempts at reading a GET body that arrives short or breaks off, and at a LIST whose 2xx
    /// response does not parse. Default 3.
    pub body_attempts: u32,
    /// A PEM file of CA certificates trusted besides the system's, for endpoints with a private
    /// CA (`--ca-bundle` / `AWS_CA_BUNDLE`). Default none.
    pub ca_bundle: Option<std::path::PathBuf>,
    /// GETs are signed and sent without the SDK's orchestrator (see `raw_get`), on the same HTTP
    /// connector settings; the SDK path serves them when off. Default on.
    pub raw_get: bool,
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
            body_attempts: 3,
            ca_bundle: None,
            raw_get: true,
        }
    }
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
    /// The credentials provider the client signs with, for [`S3Store::check_credentials`].
    credentials: Option<SharedCredentialsProvider>,
    /// GETs without the SDK's orchestrator ([`S3Options::raw_get`]; needs a credentials provider).
    raw_get: Option<Arc<raw_get::RawGet>>,
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
                secret_access_key,
                session_token.clone(),
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
        if opts.max_attempts == 0 || opts.body_attempts == 0 {
            return Err(StoreError::InvalidRequest(
                "max_attempts and body_attempts must be at least 1".into(),
            ));
        }
        let region = match &cfg.region {
            Some(r) => RegionProviderChain::first_try(Region::new(r.clone())),
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
        if let Some(path) = &opts.ca_bundle {
            loader = loader.http_client(
                https_client_with_ca_bundle(path).map_err(StoreError::InvalidRequest)?,
            );
        }
        if let Some(url) = &cfg.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        let shared = loader.load().await;
        let region = shared
            .region()
            .map(|r| r.to_string())
            .unwrap_or_else(|| "us-east-1".into());
        let endpoint_id = match shared.endpoint_url() {
            Some(url) => url.to_owned(),
            None => format!("aws:{region}"),
        };
        let raw_get = match (opts.raw_get, shared.credentials_provider()) {
            (true, Some(provider)) => {
                let tls = match &opts.ca_bundle {
                    Some(path) => {
                        Some(tls_context_with_ca_bundle(path).map_err(StoreError::InvalidRequest)?)
                    }
                    None => None,
                };
                let endpoint = raw_get::EndpointConfig {
                    region: region.clone(),
                    endpoint_url: shared.endpoint_url().map(str::to_owned),
                    force_path_style: cfg.force_path_style,
                    use_fips: shared.use_fips().unwrap_or(false),
                    use_dual_stack: shared.use_dual_stack().unwrap_or(false),
                };
                Some(Arc::new(raw_get::RawGet::new(
                    endpoint,
                    provider,
                    opts.clone(),
                    tls,
                )))
            }
            _ => None,
        };
        let s3 = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(cfg.force_path_style)
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .build();
        Ok(S3Store {
            client: aws_sdk_s3::Client::from_conf(s3),
            endpoint_id,
            opts,
            credentials: shared.credentials_provider(),
            raw_get,
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
            StoreError::Credentials(format!(
                "no credentials could be resolved: {}",
                error_chain(&e)
            ))
        })
    }

    /// The endpoint URL, or `aws:<region>` for AWS itself: a stable name for cache keys.
    pub fn endpoint_id(&self) -> String {
        self.endpoint_id.clone()
    }

    /// Per-request settings for an upload of `len` bytes: more time per attempt when large.
    fn upload_override(&self, len: usize) -> Option<aws_sdk_s3::config::Builder> {
        let needed = Duration::from_secs(len as u64 / SLOW_UPLOAD_BYTES_PER_SEC);
        (needed > self.opts.attempt_timeout).then(|| {
            aws_sdk_s3::config::Builder::new()
                .timeout_config(timeouts(&self.opts, self.opts.attempt_timeout + needed))
        })
    }

    /// One ListObjectsV2 request (the SDK's retries included).
    async fn list_once(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage, Broken> {
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
            .send()
            .await
            .map_err(|e| Broken::classify(e, Target::Bucket(bucket)))?;
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
                    etag: o.e_tag().map(str::to_owned),
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
        let delimiter = req.delimiter.filter(|d| !d.is_empty());
        let whole_prefix = |p: &String| match delimiter {
            // The segment may be empty: a key `a//b` listed under `a/` gives `a//`.
            Some(d) => p
                .strip_prefix(req.prefix)
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
            return Err(Broken::Yes(StoreError::Corrupt(format!(
                "LIST {bucket}/{}: incomplete response ({entries} entries, KeyCount {:?}, IsTruncated {:?})",
                req.prefix,
                out.key_count(),
                out.is_truncated()
            ))));
        }
        let next_token = if out.is_truncated().unwrap_or(false) {
            let token = out.next_continuation_token().map(str::to_owned);
            if token.is_none() {
                return Err(Broken::Yes(StoreError::Corrupt(format!(
                    "LIST {bucket}/{}: truncated page without a continuation token",
                    req.prefix
                ))));
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

    /// A ranged GET pinned to `pin` (none: any version), on the raw path where it serves the
    /// bucket, else through the SDK; a broken body is read again.
    async fn get_pinned(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        pin: Option<Version<'_>>,
    ) -> Result<Bytes> {
        if range.start >= range.end {
            return Err(StoreError::InvalidRequest(format!(
                "empty range {range:?} of {bucket}/{key}"
            )));
        }
        let mut attempt = 1;
        loop {
            let raw = match &self.raw_get {
                Some(raw) => raw.get(bucket, key, &range, pin).await,
                None => None,
            };
            let once = match raw {
                Some(result) => result,
                None => self.get_once(bucket, key, &range, pin).await,
            };
            match once {
                Ok(body) => return Ok(body),
                // The SDK already retried the request itself; only a broken body is ours to retry.
                Err(GetFailure::Body(e)) if attempt < self.opts.body_attempts => {
                    tracing::warn!(error = %e, attempt, "re-reading a broken GET body");
                    attempt += 1;
                }
                Err(GetFailure::Body(e) | GetFailure::Request(e)) => return Err(e),
            }
        }
    }

    /// One GET attempt whose body is checked against the range.
    async fn get_once(
        &self,
        bucket: &str,
        key: &str,
        range: &Range<u64>,
        pin: Option<Version<'_>>,
    ) -> Result<Bytes, GetFailure> {
        let what = || format!("GET {bucket}/{key} bytes {}..{}", range.start, range.end);
        let (if_match, since) = conditions(pin);
        let out = self
            .client
            .get_object()
            .bucket(bucket)
            .key(key)
            .range(format!("bytes={}-{}", range.start, range.end - 1))
            .set_if_match(if_match.map(str::to_owned))
            .set_if_unmodified_since(since.map(DateTime::from))
            .send()
            .await
            .map_err(|e| GetFailure::Request(map_sdk_error(e, Target::Object(bucket, key))))?;
        let declared = out.content_length().and_then(|l| u64::try_from(l).ok());
        let content_range = out.content_range().map(str::to_owned);
        check_version(
            &what,
            pin,
            out.e_tag(),
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
        )
        .await
    }
}

/// The `If-Match` ETag and `If-Unmodified-Since` time a pinned GET carries.
///
/// `If-Unmodified-Since` names the end of the pinned `Last-Modified` second: servers that compare
/// it with their file's sub-second modification time (versitygw's posix backend does) would
/// otherwise refuse the very version the header names. A change within that second goes unseen
/// either way; a later one fails the condition or, where a server ignores it, [`check_version`].
fn conditions(pin: Option<Version<'_>>) -> (Option<&str>, Option<SystemTime>) {
    match pin {
        None => (None, None),
        Some(Version::ETag(etag)) => (Some(etag), None),
        Some(Version::Unmodified { last_modified, .. }) => {
            let end_of_second = |t: SystemTime| {
                let secs = t
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                std::time::UNIX_EPOCH + Duration::from_secs(secs + 1)
            };
            (None, last_modified.map(end_of_second))
        }
    }
}

/// A pinned GET's response must come from the pinned version, whatever the server did with the
/// condition headers (a server that ignores `If-Match` or `If-Unmodified-Since` is caught here):
/// pinned by ETag, the response's `ETag` (when sent) must be it; pinned without one, the
/// response's `Last-Modified` (when both it and the pin have one) and the object's total size
/// (from `Content-Range`, or the whole body's length when the server ignored the range) must be
/// the pinned ones. A mismatch is `PreconditionFailed`, as the server's own 412 would be.
fn check_version(
    what: &(dyn Fn() -> String + Sync),
    pin: Option<Version<'_>>,
    etag: Option<&str>,
    last_modified: Option<SystemTime>,
    content_range: Option<&str>,
    declared: Option<u64>,
) -> Result<(), GetFailure> {
    let changed = |detail: String| {
        Err(GetFailure::Request(StoreError::PreconditionFailed(
            format!(
                "{}: the object changed since it was opened ({detail})",
                what()
            ),
        )))
    };
    // Compared without quotes or a weak marker, and without allocating (every GET passes here).
    fn bare(e: &str) -> &str {
        e.trim().trim_start_matches("W/").trim_matches('"')
    }
    match pin {
        None => Ok(()),
        Some(Version::ETag(pinned)) => match etag {
            Some(now) if bare(now) != bare(pinned) => {
                changed(format!("pinned ETag {pinned}, the server sent {now}"))
            }
            _ => Ok(()),
        },
        Some(Version::Unmodified {
            last_modified: pinned,
            size,
        }) => {
            let secs = |t: SystemTime| {
                t.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
            };
            let total = match content_range {
                Some(cr) => parse_content_range(cr).and_then(|(_, _, total)| total),
                None => declared,
            };
            let moved = matches!((pinned, last_modified), (Some(a), Some(b)) if secs(a) != secs(b));
            if moved || total.is_some_and(|t| t != size) {
                return changed(format!(
                    "no ETag; pinned Last-Modified {:?} and {size} bytes, now {:?} and {total:?} bytes",
                    pinned.map(secs),
                    last_modified.map(secs),
                ));
            }
            Ok(())
        }
    }
}

/// Reads a GET body and checks it against the range asked for and what the response headers say
/// it carries (`Content-Range`, `Content-Length`). Without `Content-Range` the server ignored the
/// range and sent the whole object, so the range is cut out of it.
async fn read_checked(
    what: &(dyn Fn() -> String + Sync),
    range: &Range<u64>,
    content_range: Option<&str>,
    declared: Option<u64>,
    body: ByteStream,
    body_timeout: Duration,
) -> Result<Bytes, GetFailure> {
    let expected = match content_range {
        Some(cr) => {
            let (first, last, _total) = parse_content_range(cr).ok_or_else(|| {
                GetFailure::Body(StoreError::Corrupt(format!(
                    "{}: bad Content-Range {cr:?}",
                    what()
                )))
            })?;
            if first != range.start || last >= range.end {
                return Err(GetFailure::Body(StoreError::Corrupt(format!(
                    "{}: server sent Content-Range {cr:?}",
                    what()
                ))));
            }
            Some(last - first + 1)
        }
        None => None,
    };
    let size_hint = expected.or(declared).unwrap_or(0);
    let body = tokio::time::timeout(body_timeout, gather(body, size_hint))
        .await
        .map_err(|_| {
            GetFailure::Body(StoreError::Transient(format!(
                "{}: body read timed out",
                what()
            )))
        })?
        .map_err(|e| {
            GetFailure::Body(StoreError::Transient(format!(
                "{}: reading the body: {}",
                what(),
                error_chain(&e)
            )))
        })?;
    let got = body.len() as u64;
    if let Some(declared) = declared {
        if got != declared {
            return Err(GetFailure::Body(StoreError::Corrupt(format!(
                "{}: got {got} bytes, Content-Length {declared}",
                what()
            ))));
        }
    }
    match expected {
        Some(expected) if got == expected => Ok(body),
        Some(expected) => Err(GetFailure::Body(StoreError::Corrupt(format!(
            "{}: got {got} bytes, expected {expected}",
            what()
        )))),
        None => {
            if range.start >= got {
                return Err(GetFailure::Request(StoreError::InvalidRequest(format!(
                    "{}: starts at or past the object's end ({got} bytes)",
                    what()
                ))));
            }
            Ok(body.slice(range.start as usize..range.end.min(got) as usize))
        }
    }
}

/// Most bytes reserved up front for a body from its declared size (a body larger than that grows).
const MAX_BODY_RESERVE: u64 = 64 * 1024 * 1024;

/// Reads a body into one buffer as its chunks arrive, each chunk dropped once copied, so a part
/// never sits in memory twice (collecting all chunks first and then joining them did that). A
/// body of one chunk is kept as it is.
async fn gather(
    mut body: ByteStream,
    size_hint: u64,
) -> std::result::Result<Bytes, aws_smithy_types::byte_stream::error::Error> {
    let Some(first) = next_chunk(&mut body).await? else {
        return Ok(Bytes::new());
    };
    let Some(second) = next_chunk(&mut body).await? else {
        return Ok(first);
    };
    let reserve = size_hint.min(MAX_BODY_RESERVE) as usize;
    let mut buf = bytes::BytesMut::with_capacity(reserve.max(first.len() + second.len()));
    buf.extend_from_slice(&first);
    buf.extend_from_slice(&second);
    while let Some(chunk) = body.try_next().await? {
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// The body's next chunk that is not empty.
async fn next_chunk(
    body: &mut ByteStream,
) -> std::result::Result<Option<Bytes>, aws_smithy_types::byte_stream::error::Error> {
    while let Some(chunk) = body.try_next().await? {
        if !chunk.is_empty() {
            return Ok(Some(chunk));
        }
    }
    Ok(None)
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

/// `bytes 0-9/10` → (0, 9, Some(10)); `bytes 0-9/*` → (0, 9, None).
fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes")?.trim_start();
    let (span, total) = rest.split_once('/')?;
    let (first, last) = span.split_once('-')?;
    let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    (first <= last).then_some((first, last, total))
}

fn to_system_time(t: Option<&DateTime>) -> Option<SystemTime> {
    t.and_then(|t| SystemTime::try_from(*t).ok())
}

fn size_of(len: Option<i64>) -> u64 {
    len.and_then(|l| u64::try_from(l).ok()).unwrap_or(0)
}

/// What a request was about, for error messages and for NotFound vs NoSuchBucket.
#[derive(Clone, Copy)]
enum Target<'a> {
    Bucket(&'a str),
    Object(&'a str, &'a str),
    Upload(&'a str, &'a str, &'a str),
}

impl fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Bucket(b) => write!(f, "bucket {b}"),
            Target::Object(b, k) => write!(f, "{b}/{k}"),
            Target::Upload(b, k, id) => write!(f, "{b}/{k} upload {id}"),
        }
    }
}

/// The [`StoreError`] variant a response maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    NotFound,
    NoSuchBucket,
    AccessDenied,
    PreconditionFailed,
    InvalidRequest,
    Throttled,
    Transient,
    Other,
}

/// Maps an HTTP status and S3 error code to a [`Kind`]:
///
/// | code / status | kind |
/// |---|---|
/// | `NoSuchBucket` | NoSuchBucket |
/// | `NoSuchKey`, `NotFound`, `NoSuchUpload`, 404 | NotFound |
/// | `AccessDenied`, `InvalidAccessKeyId`, `SignatureDoesNotMatch`, `ExpiredToken`, 401, 403 | AccessDenied |
/// | `PreconditionFailed`, 412 | PreconditionFailed |
/// | `SlowDown`, `Throttling*`, `RequestLimitExceeded`, `TooManyRequests`, 429, 503 | Throttled |
/// | `RequestTimeout`, `InternalError`, `OperationAborted`, other 5xx but 501 | Transient |
/// | `InvalidRange`, 416, other 400 | InvalidRequest |
/// | anything else (3xx, 405, 409, 501, ...) | Other |
fn classify(status: Option<u16>, code: Option<&str>) -> Kind {
    match code {
        Some("NoSuchBucket") => return Kind::NoSuchBucket,
        Some("NoSuchKey" | "NotFound" | "NoSuchUpload") => return Kind::NotFound,
        Some(
            "AccessDenied"
            | "InvalidAccessKeyId"
            | "SignatureDoesNotMatch"
            | "ExpiredToken"
            | "InvalidToken"
            | "TokenRefreshRequired"
            | "AllAccessDisabled",
        ) => return Kind::AccessDenied,
        Some("PreconditionFailed") => return Kind::PreconditionFailed,
        Some(
            "SlowDown"
            | "Throttling"
            | "ThrottlingException"
            | "ThrottledException"
            | "RequestThrottled"
            | "RequestThrottledException"
            | "RequestLimitExceeded"
            | "TooManyRequests"
            | "TooManyRequestsException"
            | "ServiceUnavailable",
        ) => return Kind::Throttled,
        Some("RequestTimeout" | "InternalError" | "OperationAborted") => return Kind::Transient,
        Some("InvalidRange") => return Kind::InvalidRequest,
        _ => {}
    }
    match status {
        Some(404) => Kind::NotFound,
        Some(401 | 403) => Kind::AccessDenied,
        Some(412) => Kind::PreconditionFailed,
        Some(429 | 503) => Kind::Throttled,
        Some(400 | 416) => Kind::InvalidRequest,
        Some(501) => Kind::Other,
        Some(s) if s >= 500 => Kind::Transient,
        _ => Kind::Other,
    }
}

/// Whether a credentials provider failure is anywhere in the error's source chain.
fn credentials_failure(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if e.downcast_ref::<CredentialsError>().is_some() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Maps any SDK failure onto [`StoreError`].
fn map_sdk_error<E>(
    err: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    target: Target<'_>,
) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    if credentials_failure(&err) {
        return StoreError::Credentials(format!("{target}: {}", error_chain(&err)));
    }
    // Service errors: code, message and status only (the SDK's Debug output of the raw response
    // is kilobytes long). Everything else: the chain of causes.
    let detail = match &err {
        SdkError::ServiceError(ctx) => format!(
            "{target}: {}: {} (HTTP {}{})",
            ctx.err().code().unwrap_or("no error code"),
            ctx.err().message().unwrap_or("no message"),
            ctx.raw().status().as_u16(),
            ctx.err()
                .meta()
                .request_id()
                .map(|id| format!(", request id {id}"))
                .unwrap_or_default(),
        ),
        _ => format!("{target}: {}", error_chain(&err)),
    };
    let (status, code) = match &err {
        SdkError::ServiceError(ctx) => (
            Some(ctx.raw().status().as_u16()),
            ctx.err().code().map(str::to_owned),
        ),
        SdkError::ResponseError(ctx) => (Some(ctx.raw().status().as_u16()), None),
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) => {
            return StoreError::Transient(detail)
        }
        SdkError::ConstructionFailure(_) => return StoreError::Other(detail),
        _ => return StoreError::Other(detail),
    };
    let kind = match (&err, classify(status, code.as_deref())) {
        // A response that could not be parsed: a server or proxy in trouble, unless 4xx says more.
        (SdkError::ResponseError(_), Kind::Other) => Kind::Transient,
        // A 2xx the SDK could not read (a body cut off or garbled) is the same trouble.
        (SdkError::ServiceError(_), Kind::Other)
            if status.is_some_and(|s| (200..300).contains(&s)) =>
        {
            Kind::Transient
        }
        (_, kind) => kind,
    };
    store_error(kind, target, detail)
}

/// The [`StoreError`] of a failed request of `kind` about `target`.
fn store_error(kind: Kind, target: Target<'_>, detail: String) -> StoreError {
    match (kind, target) {
        // HEAD has no body, so a missing bucket is a bare 404 there.
        (Kind::NotFound | Kind::NoSuchBucket, Target::Bucket(b)) => {
            StoreError::NoSuchBucket(b.to_owned())
        }
        (Kind::NoSuchBucket, Target::Object(b, _) | Target::Upload(b, _, _)) => {
            StoreError::NoSuchBucket(b.to_owned())
        }
        (Kind::NotFound, Target::Object(_, k)) => StoreError::NotFound(k.to_owned()),
        (Kind::NotFound, Target::Upload(..)) => StoreError::NotFound(detail),
        (Kind::AccessDenied, _) => StoreError::AccessDenied(detail),
        (Kind::PreconditionFailed, _) => StoreError::PreconditionFailed(detail),
        (Kind::InvalidRequest, _) => StoreError::InvalidRequest(detail),
        (Kind::Throttled, _) => StoreError::Throttled(detail),
        (Kind::Transient, _) => StoreError::Transient(detail),
        (Kind::Other, _) => StoreError::Other(detail),
    }
}

/// Maps one per-key failure of a DeleteObjects response.
fn delete_error(bucket: &str, failed: &aws_sdk_s3::types::Error, count: usize) -> StoreError {
    let key = failed.key().unwrap_or("<unknown key>");
    let detail = format!(
        "deleting {bucket}/{key} ({count} key(s) failed): {}: {}",
        failed.code().unwrap_or("?"),
        failed.message().unwrap_or("")
    );
    match classify(None, failed.code()) {
        Kind::AccessDenied => StoreError::AccessDenied(detail),
        Kind::Throttled => StoreError::Throttled(detail),
        Kind::Transient => StoreError::Transient(detail),
        Kind::NoSuchBucket => StoreError::NoSuchBucket(bucket.to_owned()),
        _ => StoreError::Other(detail),
    }
}

#[async_trait]
impl ObjectStore for S3Store {
    async fn head_bucket(&self, bucket: &str) -> Result<()> {
        self.client
            .head_bucket()
            .bucket(bucket)
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Bucket(bucket)))?;
        Ok(())
    }

    async fn list(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage> {
        // A LIST is idempotent: a 2xx that does not parse (which the SDK does not retry) is
        // asked for again, like a broken GET body.
        let mut attempt = 1;
        loop {
            match self.list_once(bucket, req.clone()).await {
                Err(Broken::Yes(e)) if attempt < self.opts.body_attempts => {
                    tracing::warn!(error = %e, attempt, "listing again after a broken response");
                    attempt += 1;
                }
                Ok(page) => return Ok(page),
                Err(Broken::Yes(e) | Broken::No(e)) => return Err(e),
            }
        }
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
            etag: out.e_tag().map(str::to_owned),
            last_modified: to_system_time(out.last_modified()),
        })
    }

    async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> Result<Bytes> {
        self.get_pinned(bucket, key, range, if_match.map(Version::ETag))
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
        self.get_pinned(bucket, key, range, Some(pin)).await
    }

    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        let len = body.len();
        let mut op = self
            .client
            .put_object()
            .bucket(bucket)
            .key(key)
            .body(ByteStream::from(body))
            .customize();
        if let Some(o) = self.upload_override(len) {
            op = op.config_override(o);
        }
        let out = op
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Object(bucket, key)))?;
        Ok(PutResult {
            etag: out.e_tag().map(str::to_owned),
        })
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
        let etag = out.e_tag().map(str::to_owned).ok_or_else(|| {
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
            .send()
            .await
            .map_err(|e| map_sdk_error(e, Target::Upload(bucket, key, upload_id)))?;
        Ok(PutResult {
            etag: out.e_tag().map(str::to_owned),
        })
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

/// How one GET attempt failed: the request (already retried by the SDK) or the body (ours to retry).
enum GetFailure {
    Request(StoreError),
    Body(StoreError),
}

/// A failed request, and whether its response broke in a way the SDK's retries do not cover
/// (see [`broken_response`]).
enum Broken {
    Yes(StoreError),
    No(StoreError),
}

impl Broken {
    fn classify<E>(
        err: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
        target: Target<'_>,
    ) -> Broken
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let broken = broken_response(&err);
        let e = map_sdk_error(err, target);
        if broken {
            Broken::Yes(e)
        } else {
            Broken::No(e)
        }
    }
}

/// Whether the response arrived as a 2xx the SDK could not parse (a garbled or short body with a
/// consistent length): a service error with the 2xx status and no error code, which the SDK does
/// not retry. (A body cut off before its length is a response error, which the SDK retries.)
fn broken_response<E>(err: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> bool
where
    E: ProvideErrorMetadata,
{
    match err {
        SdkError::ServiceError(ctx) => {
            ctx.err().code().is_none() && (200..300).contains(&ctx.raw().status().as_u16())
        }
        _ => false,
    }
}

/// Every message of an error's source chain, joined with ": ", repeats left out.
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let msg = e.to_string();
        if !out.contains(&msg) {
            out.push_str(": ");
            out.push_str(&msg);
        }
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_credential_types::provider::{future, ProvideCredentials};

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
        };
        for text in [
            format!("{creds:?}"),
            format!("{cfg:?}"),
            format!("{cfg:#?}"),
        ] {
            assert!(!text.contains("wJalr"), "{text}");
            assert!(!text.contains("FwoG"), "{text}");
            assert!(text.contains("<redacted>"), "{text}");
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
        ] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }

    #[test]
    fn classification_table() {
        let cases: &[(Option<u16>, Option<&str>, Kind)] = &[
            (Some(404), Some("NoSuchKey"), Kind::NotFound),
            (Some(404), Some("NotFound"), Kind::NotFound),
            (Some(404), None, Kind::NotFound),
            (Some(404), Some("NoSuchUpload"), Kind::NotFound),
            (Some(404), Some("NoSuchBucket"), Kind::NoSuchBucket),
            (Some(403), Some("AccessDenied"), Kind::AccessDenied),
            (Some(403), Some("SignatureDoesNotMatch"), Kind::AccessDenied),
            (Some(403), None, Kind::AccessDenied),
            (Some(400), Some("ExpiredToken"), Kind::AccessDenied),
            (
                Some(412),
                Some("PreconditionFailed"),
                Kind::PreconditionFailed,
            ),
            (Some(412), None, Kind::PreconditionFailed),
            (Some(416), Some("InvalidRange"), Kind::InvalidRequest),
            (Some(416), None, Kind::InvalidRequest),
            (Some(400), Some("InvalidArgument"), Kind::InvalidRequest),
            (Some(400), Some("RequestTimeout"), Kind::Transient),
            (Some(429), None, Kind::Throttled),
            (Some(503), Some("SlowDown"), Kind::Throttled),
            (Some(503), None, Kind::Throttled),
            (Some(500), Some("InternalError"), Kind::Transient),
            (Some(500), None, Kind::Transient),
            (Some(502), None, Kind::Transient),
            (Some(504), None, Kind::Transient),
            (Some(501), Some("NotImplemented"), Kind::Other),
            (Some(409), Some("BucketNotEmpty"), Kind::Other),
            (Some(301), Some("PermanentRedirect"), Kind::Other),
            (None, Some("SlowDown"), Kind::Throttled),
            (None, Some("InternalError"), Kind::Transient),
            (None, None, Kind::Other),
        ];
        for &(status, code, want) in cases {
            assert_eq!(classify(status, code), want, "{status:?} {code:?}");
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
            body_attempts: 0,
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

    #[derive(Debug)]
    struct Broken;

    impl ProvideCredentials for Broken {
        fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
        where
            Self: 'a,
        {
            future::ProvideCredentials::ready(Err(CredentialsError::provider_error(
                "no web identity token file",
            )))
        }
    }

    #[tokio::test]
    async fn credential_provider_failure_is_credentials() {
        let s = S3Store::build(
            local_cfg(),
            fast_opts(),
            Some(SharedCredentialsProvider::new(Broken)),
        )
        .await
        .unwrap();
        let e = s.head_bucket("b").await.unwrap_err();
        assert!(matches!(e, StoreError::Credentials(_)), "{e:?}");
        assert!(e.to_string().contains("web identity"), "{e}");
        let e = s.check_credentials().await.unwrap_err();
        assert!(matches!(e, StoreError::Credentials(_)), "{e:?}");
        assert!(e.to_string().contains("web identity"), "{e}");
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
