//! The one error table: every failure of both request paths (the SDK's and `raw_get`) becomes a
//! [`Failure`] here, and a [`Failure`] a [`StoreError`]. Messages keep the S3 error code, the HTTP
//! status and the request id.
//!
//! | code / status / failure | [`Kind`] | [`StoreError`] |
//! |---|---|---|
//! | `NoSuchBucket` | NoSuchBucket | `NoSuchBucket` |
//! | `NoSuchKey`, `NotFound`, `NoSuchUpload`, 404 without a code | NotFound | `NotFound` to a request about a key or an upload; `Other` to one about a bucket |
//! | 404 with any other code | OtherNotFound | `Other` |
//! | `AccessDenied`, `InvalidAccessKeyId`, `SignatureDoesNotMatch`, `ExpiredToken`, `InvalidToken`, `TokenRefreshRequired`, `AllAccessDisabled`, 401, 403 | AccessDenied | `AccessDenied` |
//! | `RequestTimeTooSkewed`; any 403 to a request signed more than 4 min off the time its response shows (HeadObject and HeadBucket get a bare 403) | Skewed (retried: the next attempt signs with the server's clock) | `Transient` |
//! | `PreconditionFailed`, 412 | PreconditionFailed | `PreconditionFailed` |
//! | `InvalidRange`, 416, other 400 | InvalidRequest | `InvalidRequest` |
//! | `SlowDown`, `Throttling*`, `RequestLimitExceeded`, `TooManyRequests*`, `ServiceUnavailable`, 429, 503 | Throttled | `Throttled` |
//! | `RequestTimeout`, `InternalError`, `OperationAborted`, other 5xx but 501; timeouts; connection failures; a response (2xx included) that cannot be read or parsed | Transient | `Transient` |
//! | body shorter or longer than its headers or the range say | Corrupt | `Corrupt` |
//! | the credentials provider refused or has no credentials (`CredentialsNotLoaded`, `InvalidConfiguration`) | Credentials | `Credentials` |
//! | the credentials provider could not answer (`ProviderTimedOut`, `ProviderError`, `Unhandled`: unreachable, throttled, 5xx) | CredentialsUnavailable | `CredentialsUnavailable` |
//! | anything else (3xx, 405, 409, 501, ...) | Other | `Other` |
//!
//! Codes come before statuses: a 403 `RequestTimeTooSkewed` is a clock problem, not a refusal.
//!
//! Only the code `NoSuchBucket` says a bucket is missing. Any other 404 to a request about a bucket
//! (LIST, ListMultipartUploads, DeleteObjects) is an error that quotes the server's code and
//! message: versitygw answers an access key it does not know with `404 XAdminUserNotFound`, and a
//! proxy in front of S3 may answer anything it does not route with a 404 page of its own. Taken for
//! a missing bucket, such an answer made DeleteVolume report a volume deleted while its data
//! stayed. HeadBucket's answer has no body, so its 404 says nothing either way:
//! [`crate::S3Store`] asks a one-key LIST of the bucket then, whose answer has the code. A 404 about
//! a key with a code that is not a not-found code (`XAdminUserNotFound` to a GET) does not say the
//! key is missing either: a mount answers `EIO` and logs the code, not `ENOENT`. (HeadObject's 404
//! has no body, so there it still reads as a missing key.)
//! Which kinds are retried is [`crate::retry`]'s.
//!
//! `ExpiredToken` and `TokenRefreshRequired` are refusals (EACCES), not retried: the identity cache
//! both paths share judges expiry by the server's time ([`crate::skew`]: the client's clock is
//! corrected by the measured skew) and renews credentials before it, so they mean a provider that
//! hands out expired credentials, which asking again would not change (the cache cannot be told
//! to drop an identity).
//!
//! Credentials: the SDK's [`CredentialsError`] variants are the contract. ferry-creds' pod-level
//! provider reports a refusal (STS or the Pod Identity agent said no, a bad token) as
//! `InvalidConfiguration` and a failure to get an answer as `ProviderError`. The SDK's own
//! providers (the driver's default chain) report STS refusals and outages alike as
//! `ProviderError`, so those are taken as transient: an application sees `EIO` and the log has
//! STS's message (a driver whose own credentials never resolve already fails its readiness probe).

use std::fmt;

use aws_credential_types::provider::error::CredentialsError;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::operation::RequestId;
use ferry_store::StoreError;

use crate::skew::SignedOff;

/// The [`StoreError`] variant a failure maps to, and what the retry policy looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    NotFound,
    NoSuchBucket,
    AccessDenied,
    Skewed,
    PreconditionFailed,
    InvalidRequest,
    Throttled,
    Transient,
    Corrupt,
    Credentials,
    CredentialsUnavailable,
    Other,
    /// A 404 whose code is none of the not-found codes: nothing is known to be missing.
    OtherNotFound,
}

/// What a request was about, for error messages and for NotFound vs NoSuchBucket.
#[derive(Clone, Copy)]
pub(crate) enum Target<'a> {
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

/// One failed attempt (or request): its kind and a message naming the request, the S3 error code,
/// the HTTP status and the request id where there were any.
#[derive(Debug)]
pub(crate) struct Failure {
    pub kind: Kind,
    pub detail: String,
}

impl Failure {
    pub fn new(kind: Kind, detail: String) -> Failure {
        Failure { kind, detail }
    }

    /// A response with an error status: `code`, `message` and `request_id` from its body and headers.
    pub fn response(
        what: impl fmt::Display,
        status: u16,
        code: Option<&str>,
        message: Option<&str>,
        request_id: Option<&str>,
    ) -> Failure {
        let detail = format!(
            "{what}: {}: {} (HTTP {status}{})",
            code.unwrap_or("no error code"),
            message.unwrap_or("no message"),
            request_id
                .map(|id| format!(", request id {id}"))
                .unwrap_or_default()
        );
        Failure::new(classify(Some(status), code), detail)
    }

    /// A 403 to a request signed far off the server's time ([`SignedOff`] on its response) is a
    /// clock problem until the next attempt, signed at the server's time, shows otherwise.
    pub fn signed_off(mut self, status: u16, off: Option<SignedOff>) -> Failure {
        if status == 403 && off.is_some() {
            self.kind = Kind::Skewed;
        }
        self
    }

    /// The [`StoreError`] for a request about `target`.
    pub fn into_store_error(self, target: Target<'_>) -> StoreError {
        let detail = self.detail;
        match (self.kind, target) {
            (
                Kind::NoSuchBucket,
                Target::Bucket(b) | Target::Object(b, _) | Target::Upload(b, _, _),
            ) => StoreError::NoSuchBucket(b.to_owned()),
            // Not `NoSuchBucket`: the bucket is not known to be missing (see the module docs).
            (Kind::NotFound, Target::Bucket(_)) => StoreError::Other(format!(
                "{detail} (a 404 without the code NoSuchBucket: not taken to mean the bucket is missing)"
            )),
            (Kind::NotFound, Target::Object(_, k)) => StoreError::NotFound(k.to_owned()),
            (Kind::NotFound, Target::Upload(..)) => StoreError::NotFound(detail),
            (Kind::OtherNotFound, Target::Bucket(_)) => StoreError::Other(format!(
                "{detail} (a 404 without the code NoSuchBucket: not taken to mean the bucket is missing)"
            )),
            (Kind::OtherNotFound, _) => StoreError::Other(format!(
                "{detail} (a 404 whose code is not a not-found code: not taken to mean the object is missing)"
            )),
            (Kind::AccessDenied, _) => StoreError::AccessDenied(detail),
            (Kind::PreconditionFailed, _) => StoreError::PreconditionFailed(detail),
            (Kind::InvalidRequest, _) => StoreError::InvalidRequest(detail),
            (Kind::Throttled, _) => StoreError::Throttled(detail),
            (Kind::Transient | Kind::Skewed, _) => StoreError::Transient(detail),
            (Kind::Corrupt, _) => StoreError::Corrupt(detail),
            (Kind::Credentials, _) => StoreError::Credentials(detail),
            (Kind::CredentialsUnavailable, _) => StoreError::CredentialsUnavailable(detail),
            (Kind::Other, _) => StoreError::Other(detail),
        }
    }
}

/// Maps an HTTP status and S3 error code to a [`Kind`]: the table in the module docs.
pub(crate) fn classify(status: Option<u16>, code: Option<&str>) -> Kind {
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
        Some("RequestTimeTooSkewed") => return Kind::Skewed,
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
        Some(_) if status == Some(404) => return Kind::OtherNotFound,
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

/// The kind of a credentials provider failure (see the module docs).
pub(crate) fn credentials_kind(e: &CredentialsError) -> Kind {
    match e {
        CredentialsError::CredentialsNotLoaded(_) | CredentialsError::InvalidConfiguration(_) => {
            Kind::Credentials
        }
        _ => Kind::CredentialsUnavailable,
    }
}

/// A credentials provider failure anywhere in the error's source chain.
fn credentials_failure<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a CredentialsError> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(c) = e.downcast_ref::<CredentialsError>() {
            return Some(c);
        }
        cur = e.source();
    }
    None
}

/// A failure to resolve credentials (by the SDK or the identity cache), as a [`Failure`].
pub(crate) fn credentials_failure_of(
    what: impl fmt::Display,
    err: &(dyn std::error::Error + 'static),
) -> Failure {
    let kind = credentials_failure(err).map_or(Kind::CredentialsUnavailable, credentials_kind);
    Failure::new(kind, format!("{what}: credentials: {}", error_chain(err)))
}

/// Maps any SDK failure onto a [`Failure`].
pub(crate) fn sdk_failure<E>(
    err: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    target: Target<'_>,
) -> Failure
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    if credentials_failure(&err).is_some() {
        return credentials_failure_of(target, &err);
    }
    match &err {
        SdkError::ServiceError(ctx) => {
            let status = ctx.raw().status().as_u16();
            let mut f = Failure::response(
                target,
                status,
                ctx.err().code(),
                ctx.err().message(),
                ctx.err().meta().request_id(),
            )
            .signed_off(status, ctx.raw().extension::<SignedOff>().copied());
            // A 2xx the SDK could not read (a body cut off or garbled, or not the shape S3's
            // answer has): a server in trouble. It has no code or message of its own: the
            // SDK's reason names what was wrong.
            if f.kind == Kind::Other && (200..300).contains(&status) {
                f.kind = Kind::Transient;
                f.detail = format!(
                    "{target}: the answer (HTTP {status}) could not be read: {}",
                    error_chain(&err)
                );
            }
            f
        }
        SdkError::ResponseError(ctx) => {
            let status = ctx.raw().status().as_u16();
            let kind = match classify(Some(status), None) {
                // A response that could not be parsed: a server or proxy in trouble, unless 4xx says more.
                Kind::Other => Kind::Transient,
                k => k,
            };
            Failure::new(
                kind,
                format!("{target}: {} (HTTP {status})", error_chain(&err)),
            )
            .signed_off(status, ctx.raw().extension::<SignedOff>().copied())
        }
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) => {
            Failure::new(Kind::Transient, format!("{target}: {}", error_chain(&err)))
        }
        _ => Failure::new(Kind::Other, format!("{target}: {}", error_chain(&err))),
    }
}

/// Maps any SDK failure onto [`StoreError`].
pub(crate) fn map_sdk_error<E>(
    err: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    target: Target<'_>,
) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    sdk_failure(err, target).into_store_error(target)
}

/// Maps one per-key failure of a DeleteObjects response (a code, no status of its own).
pub(crate) fn delete_error(
    bucket: &str,
    failed: &aws_sdk_s3::types::Error,
    count: usize,
) -> StoreError {
    let key = failed.key().unwrap_or("<unknown key>");
    let detail = format!(
        "deleting {bucket}/{key} ({count} key(s) failed): {}: {}",
        failed.code().unwrap_or("no error code"),
        failed.message().unwrap_or("no message")
    );
    Failure::new(classify(None, failed.code()), detail)
        .into_store_error(Target::Object(bucket, key))
}

pub(crate) use ferry_store::error_chain;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
            (Some(403), Some("RequestTimeTooSkewed"), Kind::Skewed),
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
            (None, Some("AccessDenied"), Kind::AccessDenied),
            (None, None, Kind::Other),
        ];
        for &(status, code, want) in cases {
            assert_eq!(classify(status, code), want, "{status:?} {code:?}");
        }
    }

    #[test]
    fn messages_keep_code_status_and_request_id() {
        let f = Failure::response(
            Target::Object("b", "k"),
            403,
            Some("AccessDenied"),
            Some("no"),
            Some("REQ123"),
        );
        let e = f.into_store_error(Target::Object("b", "k"));
        assert!(matches!(e, StoreError::AccessDenied(_)), "{e:?}");
        let text = e.to_string();
        for part in ["b/k", "AccessDenied", "HTTP 403", "REQ123"] {
            assert!(text.contains(part), "{text}");
        }
        let e = Failure::response(Target::Bucket("b"), 404, Some("NoSuchBucket"), None, None)
            .into_store_error(Target::Bucket("b"));
        assert_eq!(e, StoreError::NoSuchBucket("b".into()));
    }

    /// Only the code `NoSuchBucket` says a bucket is missing: any other 404 to a bucket request is
    /// an error quoting the server's code and message (versitygw's answer to an access key it does
    /// not know; a proxy's 404 page, which has no code), never `NoSuchBucket` (DeleteVolume takes
    /// that for "nothing left to delete"). A 404 about a key keeps meaning the key is missing.
    #[test]
    fn only_no_such_bucket_means_a_missing_bucket() {
        let bucket = Target::Bucket("bkt");
        let key = Target::Object("bkt", "k");
        let e = Failure::response(
            bucket,
            404,
            Some("XAdminUserNotFound"),
            Some("No user exists with the provided access key ID."),
            Some("REQ9"),
        )
        .into_store_error(bucket);
        assert!(matches!(e, StoreError::Other(_)), "{e:?}");
        let text = e.to_string();
        for part in [
            "bkt",
            "XAdminUserNotFound",
            "No user exists with the provided access key ID.",
            "HTTP 404",
            "REQ9",
            "not taken to mean the bucket is missing",
        ] {
            assert!(text.contains(part), "{part:?} in {text}");
        }
        for code in [None, Some("NotFound"), Some("NoSuchKey")] {
            let e = Failure::response(bucket, 404, code, None, None).into_store_error(bucket);
            assert!(matches!(e, StoreError::Other(_)), "{code:?}: {e:?}");
        }
        for (status, code) in [(404, Some("NoSuchBucket")), (400, Some("NoSuchBucket"))] {
            for target in [bucket, key, Target::Upload("bkt", "k", "u")] {
                let e =
                    Failure::response(target, status, code, None, None).into_store_error(target);
                assert_eq!(e, StoreError::NoSuchBucket("bkt".into()));
            }
        }
        for code in [None, Some("NoSuchKey"), Some("NotFound")] {
            let e = Failure::response(key, 404, code, None, None).into_store_error(key);
            assert_eq!(e, StoreError::NotFound("k".into()), "{code:?}");
        }
        // A GET answered `404 XAdminUserNotFound`: the key is not known to be missing, and the
        // message keeps what the server said.
        let f = Failure::response(key, 404, Some("XAdminUserNotFound"), Some("No user"), None);
        assert_eq!(f.kind, Kind::OtherNotFound);
        let e = f.into_store_error(key);
        assert!(
            matches!(&e, StoreError::Other(m) if m.contains("XAdminUserNotFound") && m.contains("not taken to mean the object is missing")),
            "{e:?}"
        );
    }

    #[test]
    fn credential_failures_are_definitive_only_when_the_provider_refused() {
        let kind = |e: CredentialsError| {
            let f = credentials_failure_of("GET b/k", &e);
            (f.kind, f.into_store_error(Target::Object("b", "k")))
        };
        // Refusals and missing configuration: definitive.
        for e in [
            CredentialsError::invalid_configuration("STS: AccessDenied: not authorized"),
            CredentialsError::not_loaded("no credentials in the chain"),
        ] {
            let (k, se) = kind(e);
            assert_eq!(k, Kind::Credentials);
            assert!(matches!(se, StoreError::Credentials(_)), "{se:?}");
        }
        // No answer, throttling, 5xx, a timeout: transient.
        for e in [
            CredentialsError::provider_error("STS: Throttling: Rate exceeded (HTTP 400)"),
            CredentialsError::provider_error("the Pod Identity agent: connection refused"),
            CredentialsError::provider_timed_out(Duration::from_secs(5)),
            CredentialsError::unhandled("unexpected"),
        ] {
            let (k, se) = kind(e);
            assert_eq!(k, Kind::CredentialsUnavailable);
            assert!(
                matches!(se, StoreError::CredentialsUnavailable(_)),
                "{se:?}"
            );
        }
    }
}
