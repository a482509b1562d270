//! GetObject without the SDK's orchestrator: the request is signed with `aws-sigv4` and sent on the
//! SDK's own HTTP connector (the same TLS, connection pool, connect and read timeouts).
//!
//! Why: reading a small-file dataset is one GET per file, and per request the orchestrator's
//! interceptors, runtime-component merging, endpoint resolution, user-agent building and retry
//! bookkeeping cost more CPU than the request itself; with 8 readers of 128 KiB files (benchmark P4)
//! the machine is CPU-bound, and the SDK's share was most of Ferry's. Here a bucket's endpoint is
//! resolved once, by the SDK's own resolver (FIPS, dual-stack, path style and custom endpoints
//! included), and each GET is a signature and a connector call.
//!
//! The same rules as the SDK path apply: [`S3Options::max_attempts`] attempts with exponential
//! backoff and full jitter on throttling, 5xx, timeouts and connection failures; the per-attempt
//! timeout; error codes mapped by [`super::classify`]. Credentials come from the same provider and
//! are kept until five minutes before they expire (or until S3 says the token expired).
//!
//! A bucket whose endpoint needs anything but plain SigV4 for service `s3` (S3 Express, SigV4a
//! access points) or extra headers is left to the SDK path ([`RawGet::get`] returns `None`).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use aws_credential_types::provider::ProvideCredentials;
use aws_credential_types::Credentials;
use aws_sdk_s3::config::endpoint::{DefaultResolver, Params, ResolveEndpoint};
use aws_sdk_s3::config::SharedCredentialsProvider;
use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use aws_smithy_async::rt::sleep::TokioSleep;
use aws_smithy_http_client::tls;
use aws_smithy_runtime_api::client::http::{HttpConnector, HttpConnectorSettings};
use aws_smithy_runtime_api::client::identity::Identity;
use aws_smithy_runtime_api::client::orchestrator::{HttpRequest, HttpResponse};
use aws_smithy_types::body::SdkBody;
use aws_smithy_types::byte_stream::ByteStream;
use aws_smithy_types::Document;
use bytes::Bytes;
use percent_encoding::utf8_percent_encode;

use aws_smithy_types::date_time::{DateTime, Format as DateTimeFormat};

use super::{
    check_version, classify, conditions, error_chain, read_checked, GetFailure, Kind, S3Options,
    Target,
};
use ferry_store::{StoreError, Version};

/// Credentials are fetched again this long before they expire.
const REFRESH_BEFORE_EXPIRY: Duration = Duration::from_secs(300);
/// At most this much of an error response's body is read (for its `<Code>`).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Where a bucket's objects are and how to sign for them.
#[derive(Debug)]
struct BucketEndpoint {
    /// The endpoint URL without a trailing `/` (`https://b.s3.eu-west-1.amazonaws.com`,
    /// `http://127.0.0.1:7070/b`); the encoded key follows after a `/`.
    base: String,
    signing_region: String,
}

/// What endpoint resolution needs besides the bucket, as the SDK client was configured.
#[derive(Debug, Clone)]
pub(super) struct EndpointConfig {
    pub region: String,
    pub endpoint_url: Option<String>,
    pub force_path_style: bool,
    pub use_fips: bool,
    pub use_dual_stack: bool,
}

/// Signed GETs on the SDK's HTTP connector; see the module docs.
pub(super) struct RawGet {
    connector: aws_smithy_http_client::Connector,
    credentials: SharedCredentialsProvider,
    /// The credentials in use; the async lock makes concurrent refreshes one provider call.
    cached: tokio::sync::Mutex<Option<Credentials>>,
    endpoint: EndpointConfig,
    resolver: DefaultResolver,
    /// Per bucket: its endpoint, or `None` when the SDK path must serve it.
    buckets: Mutex<HashMap<String, Option<Arc<BucketEndpoint>>>>,
    opts: S3Options,
}

impl std::fmt::Debug for RawGet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawGet")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl RawGet {
    pub(super) fn new(
        endpoint: EndpointConfig,
        credentials: SharedCredentialsProvider,
        opts: S3Options,
        tls_context: Option<tls::TlsContext>,
    ) -> RawGet {
        let settings = HttpConnectorSettings::builder()
            .connect_timeout(opts.connect_timeout)
            .read_timeout(opts.read_timeout)
            .build();
        let builder = aws_smithy_http_client::Connector::builder()
            .connector_settings(settings)
            .sleep_impl(TokioSleep::new())
            .enable_tcp_nodelay(true)
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::AwsLc,
            ));
        let connector = match tls_context {
            Some(ctx) => builder.tls_context(ctx).build(),
            None => builder.build(),
        };
        RawGet {
            connector,
            credentials,
            cached: tokio::sync::Mutex::new(None),
            endpoint,
            resolver: DefaultResolver::new(),
            buckets: Mutex::new(HashMap::new()),
            opts,
        }
    }

    /// GETs `range` of `bucket/key`, with retries; `None` when this bucket is the SDK path's.
    pub(super) async fn get(
        &self,
        bucket: &str,
        key: &str,
        range: &Range<u64>,
        pin: Option<Version<'_>>,
    ) -> Option<Result<Bytes, GetFailure>> {
        let endpoint = match self.bucket_endpoint(bucket).await {
            Ok(Some(e)) => e,
            Ok(None) => return None,
            Err(e) => return Some(Err(GetFailure::Request(e))),
        };
        let target = Target::Object(bucket, key);
        let mut attempt = 1;
        loop {
            match self.attempt(&endpoint, target, key, range, pin).await {
                Err(GetFailure::Request(e)) if e.is_retryable() => {
                    if attempt >= self.opts.max_attempts {
                        return Some(Err(GetFailure::Request(e)));
                    }
                    let backoff = backoff(&self.opts, attempt);
                    tracing::debug!(error = %e, attempt, ?backoff, "retrying a GET");
                    tokio::time::sleep(backoff).await;
                    attempt += 1;
                }
                other => return Some(other),
            }
        }
    }

    /// One request: sign and send it, check the status, read the body. As on the SDK path, the
    /// attempt timeout covers everything up to the response head and the body timeout the body.
    async fn attempt(
        &self,
        endpoint: &BucketEndpoint,
        target: Target<'_>,
        key: &str,
        range: &Range<u64>,
        pin: Option<Version<'_>>,
    ) -> Result<Bytes, GetFailure> {
        let what = || format!("GET {target} bytes {}..{}", range.start, range.end);
        let head = self.send(endpoint, key, range, pin, &what);
        let resp = tokio::time::timeout(self.opts.attempt_timeout, head)
            .await
            .unwrap_or_else(|_| {
                Err(GetFailure::Request(StoreError::Transient(format!(
                    "{}: no response head within the attempt timeout ({:?})",
                    what(),
                    self.opts.attempt_timeout
                ))))
            })?;
        let status = resp.status().as_u16();
        let header = |name: &str| resp.headers().get(name).map(str::to_owned);
        let content_range = header("content-range");
        let content_length = header("content-length").and_then(|v| v.parse::<u64>().ok());
        let request_id = header("x-amz-request-id");
        let last_modified = header("last-modified")
            .and_then(|v| DateTime::from_str(&v, DateTimeFormat::HttpDate).ok())
            .and_then(|t| SystemTime::try_from(t).ok());
        let etag = header("etag");
        let body = ByteStream::new(resp.into_body());
        if (200..300).contains(&status) {
            check_version(
                &what,
                pin,
                etag.as_deref(),
                last_modified,
                content_range.as_deref(),
                content_length,
            )?;
            return read_checked(
                &what,
                range,
                content_range.as_deref(),
                content_length,
                body,
                self.opts.body_timeout,
            )
            .await;
        }
        let (code, message) = error_body(body, self.opts.body_timeout).await;
        if code.as_deref() == Some("ExpiredToken") {
            // The next attempt asks the provider again.
            *self.cached.lock().await = None;
        }
        let detail = format!(
            "{}: {}: {} (HTTP {status}{})",
            what(),
            code.as_deref().unwrap_or("no error code"),
            message.as_deref().unwrap_or("no message"),
            request_id
                .map(|id| format!(", request id {id}"))
                .unwrap_or_default()
        );
        let kind = match classify(Some(status), code.as_deref()) {
            // An expired token is worth one more attempt with fresh credentials.
            _ if code.as_deref() == Some("ExpiredToken") => Kind::Transient,
            k => k,
        };
        Err(GetFailure::Request(super::store_error(
            kind, target, detail,
        )))
    }

    /// Signs and sends one GET; resolves at the response head.
    async fn send(
        &self,
        endpoint: &BucketEndpoint,
        key: &str,
        range: &Range<u64>,
        pin: Option<Version<'_>>,
        what: &(dyn Fn() -> String + Sync),
    ) -> Result<HttpResponse, GetFailure> {
        let creds = self.credentials().await.map_err(GetFailure::Request)?;
        let uri = format!(
            "{}/{}",
            endpoint.base,
            utf8_percent_encode(key, ferry_store::PATH_KEEP)
        );
        let range_header = format!("bytes={}-{}", range.start, range.end - 1);
        let mut req = http::Request::builder()
            .method("GET")
            .uri(&uri)
            .header("range", &range_header);
        let (if_match, since) = conditions(pin);
        if let Some(etag) = if_match {
            req = req.header("if-match", etag);
        }
        if let Some(since) = since {
            let date = DateTime::from(since)
                .fmt(DateTimeFormat::HttpDate)
                .map_err(|e| GetFailure::Request(StoreError::Other(format!("{}: {e}", what()))))?;
            req = req.header("if-unmodified-since", date);
        }
        let mut req = req.body(SdkBody::empty()).map_err(|e| {
            GetFailure::Request(StoreError::InvalidRequest(format!("{}: {e}", what())))
        })?;
        sign_request(&mut req, &creds, &endpoint.signing_region).map_err(|e| {
            GetFailure::Request(StoreError::Other(format!("{}: signing: {e}", what())))
        })?;
        let req = HttpRequest::try_from(req)
            .map_err(|e| GetFailure::Request(StoreError::Other(format!("{}: {e}", what()))))?;
        self.connector.call(req).await.map_err(|e| {
            let detail = format!("{}: {}", what(), error_chain(&e));
            GetFailure::Request(if e.is_user() {
                StoreError::Other(detail)
            } else {
                StoreError::Transient(detail)
            })
        })
    }

    /// The credentials to sign with, from the provider when none are held or they expire soon.
    async fn credentials(&self) -> Result<Credentials, StoreError> {
        let mut cached = self.cached.lock().await;
        if let Some(c) = &*cached {
            let fresh = c.expiry().is_none_or(|exp| {
                exp.duration_since(SystemTime::now())
                    .is_ok_and(|left| left > REFRESH_BEFORE_EXPIRY)
            });
            if fresh {
                return Ok(c.clone());
            }
        }
        let c = self.credentials.provide_credentials().await.map_err(|e| {
            StoreError::Credentials(format!("loading credentials: {}", error_chain(&e)))
        })?;
        *cached = Some(c.clone());
        Ok(c)
    }

    /// The bucket's endpoint, resolved once by the SDK's resolver.
    async fn bucket_endpoint(
        &self,
        bucket: &str,
    ) -> Result<Option<Arc<BucketEndpoint>>, StoreError> {
        if let Some(e) = self.buckets.lock().expect("bucket endpoints").get(bucket) {
            return Ok(e.clone());
        }
        let cfg = &self.endpoint;
        let params = Params::builder()
            .bucket(bucket)
            .region(cfg.region.clone())
            .use_fips(cfg.use_fips)
            .use_dual_stack(cfg.use_dual_stack)
            .set_endpoint(cfg.endpoint_url.clone())
            .force_path_style(cfg.force_path_style)
            .accelerate(false)
            .build()
            .map_err(|e| StoreError::InvalidRequest(format!("endpoint of bucket {bucket}: {e}")))?;
        let endpoint =
            self.resolver.resolve_endpoint(&params).await.map_err(|e| {
                StoreError::InvalidRequest(format!("endpoint of bucket {bucket}: {e}"))
            })?;
        let usable = endpoint.headers().next().is_none();
        let resolved = sigv4_region(endpoint.properties(), &cfg.region)
            .filter(|_| usable)
            .map(|signing_region| {
                Arc::new(BucketEndpoint {
                    base: endpoint.url().trim_end_matches('/').to_owned(),
                    signing_region,
                })
            });
        if resolved.is_none() {
            tracing::debug!(bucket, "GETs of this bucket go through the SDK");
        }
        self.buckets
            .lock()
            .expect("bucket endpoints")
            .insert(bucket.to_owned(), resolved.clone());
        Ok(resolved)
    }
}

/// The signing region when an endpoint's first auth scheme is plain SigV4 for service `s3` with
/// double encoding disabled; `None` for anything else.
fn sigv4_region(
    props: &HashMap<std::borrow::Cow<'static, str>, Document>,
    region: &str,
) -> Option<String> {
    let Some(Document::Array(schemes)) = props.get("authSchemes") else {
        // No auth scheme named: the SDK signs SigV4 for the configured region.
        return Some(region.to_owned());
    };
    let Some(Document::Object(scheme)) = schemes.first() else {
        return None;
    };
    let text = |k: &str| match scheme.get(k) {
        Some(Document::String(s)) => Some(s.as_str()),
        _ => None,
    };
    let double_encoding_off = matches!(
        scheme.get("disableDoubleEncoding"),
        Some(Document::Bool(true))
    );
    (text("name") == Some("sigv4")
        && text("signingName").unwrap_or("s3") == "s3"
        && double_encoding_off)
        .then(|| text("signingRegion").unwrap_or(region).to_owned())
}

/// Signs `req` as the SDK signs S3 requests: SigV4 in headers, the payload hash in
/// `x-amz-content-sha256`, the path neither normalized nor encoded twice.
fn sign_request(
    req: &mut http::Request<SdkBody>,
    creds: &Credentials,
    region: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let identity = Identity::from(creds.clone());
    let mut settings = SigningSettings::default();
    settings.percent_encoding_mode = PercentEncodingMode::Single;
    settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("s3")
        .time(SystemTime::now())
        .settings(settings)
        .build()?
        .into();
    let uri = req.uri().to_string();
    let headers = req
        .headers()
        .iter()
        .map(|(k, v)| Ok((k.as_str(), v.to_str()?)))
        .collect::<Result<Vec<_>, http::header::ToStrError>>()?;
    let signable = SignableRequest::new("GET", uri, headers.into_iter(), SignableBody::Bytes(&[]))?;
    let (instructions, _signature) = sign(signable, &params)?.into_parts();
    instructions.apply_to_request_http1x(req);
    Ok(())
}

/// The `<Code>` and `<Message>` of an S3 error body, if it has them.
async fn error_body(body: ByteStream, timeout: Duration) -> (Option<String>, Option<String>) {
    let Ok(Ok(bytes)) = tokio::time::timeout(timeout, body.collect()).await else {
        return (None, None);
    };
    let bytes = bytes.into_bytes();
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_ERROR_BODY)]);
    (xml_text(&text, "Code"), xml_text(&text, "Message"))
}

/// The text of the first `<tag>` element.
fn xml_text(xml: &str, tag: &str) -> Option<String> {
    let open = format!("<{tag}>");
    let start = xml.find(&open)? + open.len();
    let len = xml[start..].find(&format!("</{tag}>"))?;
    Some(xml[start..start + len].trim().to_owned()).filter(|s| !s.is_empty())
}

/// The SDK standard mode's backoff before attempt `attempt + 1`: full jitter over
/// `initial × 2^(attempt-1)`, capped.
fn backoff(opts: &S3Options, attempt: u32) -> Duration {
    let exp = opts
        .initial_backoff
        .saturating_mul(1u32 << (attempt - 1).min(20))
        .min(opts.max_backoff);
    exp.mul_f64(fastrand::f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(scheme: &[(&str, Document)]) -> HashMap<std::borrow::Cow<'static, str>, Document> {
        let obj = scheme
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect();
        HashMap::from([(
            "authSchemes".into(),
            Document::Array(vec![Document::Object(obj)]),
        )])
    }

    #[test]
    fn keys_are_encoded_as_s3_paths() {
        let enc = |k| utf8_percent_encode(k, ferry_store::PATH_KEEP).to_string();
        assert_eq!(enc("a/b c/d+e=f&g"), "a/b%20c/d%2Be%3Df%26g");
        assert_eq!(enc("ü/~x-y_z.bin"), "%C3%BC/~x-y_z.bin");
        assert_eq!(enc("a//b?c#d%"), "a//b%3Fc%23d%25");
    }

    #[test]
    fn only_plain_sigv4_for_s3_is_signed_here() {
        let s = |v: &str| Document::String(v.into());
        let plain = props(&[
            ("name", s("sigv4")),
            ("signingName", s("s3")),
            ("signingRegion", s("eu-west-1")),
            ("disableDoubleEncoding", Document::Bool(true)),
        ]);
        assert_eq!(
            sigv4_region(&plain, "us-east-1").as_deref(),
            Some("eu-west-1")
        );
        let express = props(&[
            ("name", s("sigv4-s3express")),
            ("signingName", s("s3express")),
            ("disableDoubleEncoding", Document::Bool(true)),
        ]);
        assert_eq!(sigv4_region(&express, "us-east-1"), None);
        let sigv4a = props(&[
            ("name", s("sigv4a")),
            ("disableDoubleEncoding", Document::Bool(true)),
        ]);
        assert_eq!(sigv4_region(&sigv4a, "us-east-1"), None);
        assert_eq!(
            sigv4_region(&HashMap::new(), "us-east-1").as_deref(),
            Some("us-east-1")
        );
    }

    #[test]
    fn error_bodies_give_code_and_message() {
        let xml = "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code><Message>The key does not exist</Message></Error>";
        assert_eq!(xml_text(xml, "Code").as_deref(), Some("NoSuchKey"));
        assert_eq!(
            xml_text(xml, "Message").as_deref(),
            Some("The key does not exist")
        );
        assert_eq!(xml_text("<Error></Error>", "Code"), None);
        assert_eq!(xml_text("not xml", "Code"), None);
    }

    #[test]
    fn backoff_is_jittered_and_capped() {
        let opts = S3Options {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(250),
            ..S3Options::default()
        };
        for attempt in 1..40 {
            let b = backoff(&opts, attempt);
            assert!(b <= Duration::from_millis(250), "{b:?}");
            if attempt == 1 {
                assert!(b <= Duration::from_millis(100), "{b:?}");
            }
        }
    }
}
