//! GetObject without the SDK's orchestrator: the request is signed with `aws-sigv4` and sent on the
//! SDK client's own HTTP connector (the SDK's HTTP client hands out one connector, and so one
//! connection pool, per connect/read timeout setting: the raw path asks it for the setting of the
//! SDK's own requests and gets the very connector the SDK path uses).
//!
//! Why: reading a small-file dataset is one GET per file, and per request the orchestrator's
//! interceptors, runtime-component merging, endpoint resolution, user-agent building and retry
//! bookkeeping cost more CPU than the request itself; with 8 readers of 128 KiB files (benchmark P4)
//! the machine is CPU-bound, and the SDK's share was most of Ferry's. Here a bucket's endpoint is
//! resolved once, by the SDK's own resolver (FIPS, dual-stack, path style and custom endpoints
//! included), and each attempt is an identity-cache lookup, a signature and a connector call.
//!
//! What it shares with the SDK path, so the two cannot drift apart:
//! - credentials: the SDK client's identity cache and credentials provider (the same cache
//!   partition: a refresh by either path serves both);
//! - time: the client's `TimeSource`, the node's clock corrected by the skew the responses of both
//!   paths show ([`crate::skew`]): GETs are signed, and credentials judged expired, by the same
//!   corrected clock as everything else;
//! - errors: the one error table ([`crate::error`]); the error body is read with the SDK's XML
//!   parser (`aws-smithy-xml`);
//! - retries: one attempt here is one attempt of the one retry policy ([`crate::retry`]);
//! - metrics: every attempt is reported to the same [`crate::OnAttempt`] hook.
//!
//! A bucket whose endpoint needs anything but plain SigV4 for service `s3` (S3 Express, SigV4a
//! access points) or extra headers is left to the SDK path ([`RawGet::endpoint`] gives `None`).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use aws_credential_types::provider::SharedCredentialsProvider;
use aws_runtime::auth::sigv4::SigV4AuthScheme;
use aws_sdk_s3::config::endpoint::{DefaultResolver, Params, ResolveEndpoint};
use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use aws_smithy_async::time::{SharedTimeSource, TimeSource};
use aws_smithy_runtime::client::retries::strategy::NeverRetryStrategy;
use aws_smithy_runtime_api::client::auth::static_resolver::StaticAuthSchemeOptionResolver;
use aws_smithy_runtime_api::client::auth::AuthSchemeId;
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorSettings, SharedHttpConnector,
};
use aws_smithy_runtime_api::client::identity::{
    Identity, ResolveCachedIdentity, SharedIdentityCache, SharedIdentityResolver,
};
use aws_smithy_runtime_api::client::orchestrator::{HttpRequest, HttpResponse};
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::body::SdkBody;
use aws_smithy_types::byte_stream::ByteStream;
use aws_smithy_types::config_bag::ConfigBag;
use aws_smithy_types::date_time::{DateTime, Format as DateTimeFormat};
use aws_smithy_types::Document;
use aws_smithy_xml::decode::{try_data, Document as XmlDocument};
use bytes::Bytes;
use ferry_store::Version;
use percent_encoding::utf8_percent_encode;

use crate::attempt::{Attempt, OnAttempt};
use crate::error::{credentials_failure_of, error_chain, Failure, Kind};
use crate::get::{check_version, conditions, read_checked};
use crate::skew::{CorrectedClock, SignedOff};
use crate::S3Options;

/// At most this much of an error response's body is read (for its `<Code>`).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Where a bucket's objects are and how to sign for them.
#[derive(Debug)]
pub(crate) struct BucketEndpoint {
    /// The endpoint URL without a trailing `/` (`https://b.s3.eu-west-1.amazonaws.com`,
    /// `http://127.0.0.1:7070/b`); the encoded key follows after a `/`.
    base: String,
    signing_region: String,
}

/// What endpoint resolution needs besides the bucket, as the SDK client was configured.
#[derive(Debug, Clone)]
pub(crate) struct EndpointConfig {
    pub region: String,
    pub endpoint_url: Option<String>,
    pub force_path_style: bool,
    pub use_fips: bool,
    pub use_dual_stack: bool,
}

/// What the raw path takes from the SDK client it serves beside.
pub(crate) struct Shared<'a> {
    pub config: &'a aws_sdk_s3::Config,
    pub credentials: SharedCredentialsProvider,
    pub identity_cache: SharedIdentityCache,
    /// The client's `TimeSource` (corrected) and the node's clock it corrects.
    pub clock: CorrectedClock,
    pub hook: Option<OnAttempt>,
}

/// Signed GETs on the SDK's HTTP connector; see the module docs.
pub(crate) struct RawGet {
    connector: SharedHttpConnector,
    identity: SharedIdentityResolver,
    identity_cache: SharedIdentityCache,
    /// What the identity cache needs from a client: its time source (corrected) and sleep.
    components: RuntimeComponents,
    clock: CorrectedClock,
    hook: Option<OnAttempt>,
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
    pub(crate) fn new(
        endpoint: EndpointConfig,
        shared: Shared<'_>,
        opts: S3Options,
    ) -> Result<RawGet, String> {
        let cfg = shared.config;
        let http_client = cfg
            .http_client()
            .ok_or("the SDK client has no HTTP client")?;
        let time = SharedTimeSource::new(shared.clock.clone());
        let sleep = cfg
            .sleep_impl()
            .ok_or("the SDK client has no async sleep")?;
        let identity = SharedIdentityResolver::new(shared.credentials);
        let sigv4 = AuthSchemeId::new("sigv4");
        let components = RuntimeComponents::builder("ferry-raw-get")
            .with_auth_scheme_option_resolver(Some(StaticAuthSchemeOptionResolver::new(vec![
                sigv4.clone(),
            ])))
            .with_endpoint_resolver(Some(DefaultResolver::new().into_shared_resolver()))
            .with_auth_scheme(SigV4AuthScheme::new())
            .with_identity_cache(Some(shared.identity_cache.clone()))
            .with_identity_resolver(sigv4, identity.clone())
            .with_retry_strategy(Some(NeverRetryStrategy::new()))
            .with_time_source(Some(time.clone()))
            .with_sleep_impl(Some(sleep))
            .build()
            .map_err(|e| format!("raw GET runtime components: {e}"))?;
        // The settings of the SDK's own requests (`crate::timeouts` with the attempt timeout):
        // the SDK's HTTP client returns the connector it made for them.
        let settings = HttpConnectorSettings::builder()
            .connect_timeout(opts.connect_timeout)
            .read_timeout(opts.read_timeout)
            .build();
        let connector = http_client.http_connector(&settings, &components);
        Ok(RawGet {
            connector,
            identity,
            identity_cache: shared.identity_cache,
            components,
            clock: shared.clock,
            hook: shared.hook,
            endpoint,
            resolver: DefaultResolver::new(),
            buckets: Mutex::new(HashMap::new()),
            opts,
        })
    }

    /// One attempt: sign and send the GET, check the status, read the body. The attempt timeout
    /// covers everything up to the response head and the body timeout the body, as on the SDK path.
    pub(crate) async fn attempt(
        &self,
        endpoint: &BucketEndpoint,
        bucket: &str,
        key: &str,
        range: &Range<u64>,
        pin: Option<Version<'_>>,
        piece: Option<u64>,
    ) -> Result<Vec<Bytes>, Failure> {
        let what = || format!("GET {bucket}/{key} bytes {}..{}", range.start, range.end);
        let identity = self
            .identity_cache
            .resolve_cached_identity(self.identity.clone(), &self.components, &ConfigBag::base())
            .await
            .map_err(|e| credentials_failure_of(what(), &*e))?;
        let applied = self.clock.skew.get();
        let req = self.request(endpoint, key, range, pin, &identity, &what)?;
        let (sent_at, sent) = (Instant::now(), self.clock.base.now());
        let resp = tokio::time::timeout(self.opts.attempt_timeout, self.connector.call(req)).await;
        if let Some(hook) = &self.hook {
            hook(Attempt {
                op: "GetObject",
                status: match &resp {
                    Ok(Ok(r)) => Some(r.status().as_u16()),
                    _ => None,
                },
                elapsed: sent_at.elapsed(),
            });
        }
        let resp = match resp {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => {
                let kind = if e.is_user() {
                    Kind::Other
                } else {
                    Kind::Transient
                };
                return Err(Failure::new(
                    kind,
                    format!("{}: {}", what(), error_chain(&e)),
                ));
            }
            Err(_) => {
                return Err(Failure::new(
                    Kind::Transient,
                    format!(
                        "{}: no response head within the attempt timeout ({:?})",
                        what(),
                        self.opts.attempt_timeout
                    ),
                ))
            }
        };
        let measured = self
            .clock
            .skew
            .record(sent, self.clock.base.now(), resp.headers());
        let off = SignedOff::of(applied, measured);
        self.response(resp, range, pin, off, &what, piece).await
    }

    /// The signed request.
    fn request(
        &self,
        endpoint: &BucketEndpoint,
        key: &str,
        range: &Range<u64>,
        pin: Option<Version<'_>>,
        identity: &Identity,
        what: &dyn Fn() -> String,
    ) -> Result<HttpRequest, Failure> {
        let other =
            |e: &dyn std::fmt::Display| Failure::new(Kind::Other, format!("{}: {e}", what()));
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
                .map_err(|e| other(&e))?;
            req = req.header("if-unmodified-since", date);
        }
        let mut req = req
            .body(SdkBody::empty())
            .map_err(|e| Failure::new(Kind::InvalidRequest, format!("{}: {e}", what())))?;
        let at = self.clock.now();
        sign_request(&mut req, identity, &endpoint.signing_region, at)
            .map_err(|e| other(&format_args!("signing: {e}")))?;
        HttpRequest::try_from(req).map_err(|e| other(&e))
    }

    /// The body of a 2xx response, checked; or the failure an error response says (`off`: the
    /// request was signed far off the server's time).
    async fn response(
        &self,
        resp: HttpResponse,
        range: &Range<u64>,
        pin: Option<Version<'_>>,
        off: Option<SignedOff>,
        what: &(dyn Fn() -> String + Sync),
        piece: Option<u64>,
    ) -> Result<Vec<Bytes>, Failure> {
        let status = resp.status().as_u16();
        let header = |name: &str| resp.headers().get(name).map(str::to_owned);
        let content_range = header("content-range");
        let content_length = header("content-length").and_then(|v| v.parse::<u64>().ok());
        let request_id = header("x-amz-request-id");
        let last_modified = header("last-modified")
            .and_then(|v| DateTime::from_str(&v, DateTimeFormat::HttpDate).ok())
            .and_then(|t| SystemTime::try_from(t).ok());
        let etag = crate::etag_of(header("etag").as_deref());
        let body = ByteStream::new(resp.into_body());
        if (200..300).contains(&status) {
            check_version(
                what,
                pin,
                etag.as_deref(),
                last_modified,
                content_range.as_deref(),
                content_length,
            )?;
            return read_checked(
                what,
                range,
                content_range.as_deref(),
                content_length,
                body,
                self.opts.body_timeout,
                piece,
            )
            .await;
        }
        let err = match tokio::time::timeout(self.opts.body_timeout, body.collect()).await {
            Ok(Ok(bytes)) => {
                let bytes = bytes.into_bytes();
                error_body(&bytes[..bytes.len().min(MAX_ERROR_BODY)])
            }
            _ => ErrorBody::default(),
        };
        Err(Failure::response(
            what(),
            status,
            err.code.as_deref(),
            err.message.as_deref(),
            request_id.as_deref().or(err.request_id.as_deref()),
        )
        .signed_off(status, off))
    }

    /// The bucket's endpoint, resolved once by the SDK's resolver; `None` when the SDK path must
    /// serve the bucket.
    pub(crate) async fn endpoint(
        &self,
        bucket: &str,
    ) -> Result<Option<Arc<BucketEndpoint>>, Failure> {
        self.bucket_endpoint(bucket)
            .await
            .map_err(|e| Failure::new(Kind::InvalidRequest, e))
    }

    /// The bucket's endpoint, resolved once by the SDK's resolver.
    async fn bucket_endpoint(&self, bucket: &str) -> Result<Option<Arc<BucketEndpoint>>, String> {
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
            .map_err(|e| format!("endpoint of bucket {bucket}: {e}"))?;
        let endpoint = self
            .resolver
            .resolve_endpoint(&params)
            .await
            .map_err(|e| format!("endpoint of bucket {bucket}: {e}"))?;
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
    identity: &Identity,
    region: &str,
    at: SystemTime,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut settings = SigningSettings::default();
    settings.percent_encoding_mode = PercentEncodingMode::Single;
    settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
    let params = v4::SigningParams::builder()
        .identity(identity)
        .region(region)
        .name("s3")
        .time(at)
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

/// What an S3 error body says.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ErrorBody {
    pub code: Option<String>,
    pub message: Option<String>,
    pub request_id: Option<String>,
}

/// The `<Code>`, `<Message>` and `<RequestId>` of an S3 `<Error>` body, read with the SDK's XML
/// parser; what is missing or unreadable is `None`.
pub(crate) fn error_body(body: &[u8]) -> ErrorBody {
    let mut out = ErrorBody::default();
    let Ok(mut doc) = XmlDocument::try_from(body) else {
        return out;
    };
    let Ok(mut root) = doc.root_element() else {
        return out;
    };
    if !root.start_el().matches("Error") {
        return out;
    }
    while let Some(mut tag) = root.next_tag() {
        let field = match tag.start_el().local() {
            "Code" => &mut out.code,
            "Message" => &mut out.message,
            "RequestId" => &mut out.request_id,
            _ => continue,
        };
        *field = try_data(&mut tag)
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty());
    }
    out
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
    fn error_bodies_give_code_message_and_request_id() {
        let xml = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>RequestTimeTooSkewed</Code><Message>The difference between the request time and the current time is too large.</Message><RequestTime>20261201T214233Z</RequestTime><ServerTime>2026-12-01T21:22:33Z</ServerTime><RequestId>Q6SZ81FB5C735VKJ</RequestId></Error>";
        let e = error_body(xml);
        assert_eq!(e.code.as_deref(), Some("RequestTimeTooSkewed"));
        assert!(e.message.unwrap().starts_with("The difference"));
        assert_eq!(e.request_id.as_deref(), Some("Q6SZ81FB5C735VKJ"));
        // A `<Code>` nested deeper, or text that merely looks like one, is not the error's code.
        let e =
            error_body(b"<Error><Detail><Code>Inner</Code></Detail><Code>NoSuchKey</Code></Error>");
        assert_eq!(e.code.as_deref(), Some("NoSuchKey"));
        for junk in [
            &b"<Error></Error>"[..],
            b"not xml <Code>X</Code>",
            b"<Other><Code>X</Code></Other>",
            b"",
        ] {
            assert_eq!(
                error_body(junk).code,
                None,
                "{:?}",
                String::from_utf8_lossy(junk)
            );
        }
    }
}
