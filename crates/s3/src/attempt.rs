//! [`Attempt`]: what one HTTP attempt reports to [`crate::S3Config::on_attempt`], on both request
//! paths; the SDK interceptor that reports the SDK path's attempts, feeds their responses' `Date`
//! to the one [`crate::skew::ClockSkew`] and marks responses to requests signed far off the
//! server's time ([`SignedOff`]); and the SDK retry classifier that retries a 403 so marked.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use aws_sdk_s3::config::interceptors::{
    AfterDeserializationInterceptorContextRef, BeforeDeserializationInterceptorContextMut,
    BeforeTransmitInterceptorContextRef, FinalizerInterceptorContextRef, InterceptorContext,
};
use aws_sdk_s3::config::retry::{ClassifyRetry, RetryAction};
use aws_sdk_s3::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use aws_smithy_runtime_api::client::retries::classifiers::RetryClassifierPriority;
use aws_smithy_types::config_bag::{Storable, StoreReplace};
use aws_smithy_types::retry::ErrorKind;

use crate::skew::{CorrectedClock, SignedOff};

/// One HTTP attempt of an S3 request: the operation (`"GetObject"`, `"ListObjectsV2"`, ...), the
/// response status (`None`: no HTTP response — a connection failure or a timeout) and the time
/// from sending the request to its response head (a GET's body is read after).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    pub op: &'static str,
    pub status: Option<u16>,
    pub elapsed: Duration,
}

/// Called once per HTTP attempt, on the request's task; must be cheap and must not block.
pub type OnAttempt = Arc<dyn Fn(Attempt) + Send + Sync>;

/// The S3 operations Ferry sends, by their SDK names, as `'static` labels (no allocation per
/// attempt); anything else is `"other"`.
fn op_label(name: &str) -> &'static str {
    const OPS: [&str; 14] = [
        "GetObject",
        "HeadObject",
        "HeadBucket",
        "ListObjectsV2",
        "PutObject",
        "CreateMultipartUpload",
        "UploadPart",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
        "ListMultipartUploads",
        "DeleteObject",
        "DeleteObjects",
        "CreateBucket",
        "PutBucketPolicy",
    ];
    OPS.into_iter().find(|op| *op == name).unwrap_or("other")
}

/// When the current attempt's request went out: the monotonic clock for [`Attempt::elapsed`], the
/// node's own clock for the skew, and the skew it was signed with.
#[derive(Debug, Clone, Copy)]
struct Sent {
    at: Instant,
    time: SystemTime,
    applied: i64,
}

impl Storable for Sent {
    type Storer = StoreReplace<Self>;
}

/// Reports every attempt of the SDK path to the hook and records the skew its response shows.
pub(crate) struct AttemptInterceptor {
    pub hook: Option<OnAttempt>,
    pub clock: CorrectedClock,
}

impl fmt::Debug for AttemptInterceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptInterceptor")
            .field("hook", &self.hook.is_some())
            .finish_non_exhaustive()
    }
}

impl Intercept for AttemptInterceptor {
    fn name(&self) -> &'static str {
        "FerryAttempts"
    }

    fn read_before_transmit(
        &self,
        _ctx: &BeforeTransmitInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        // Signed just before, at the clock corrected by this skew.
        cfg.interceptor_state().store_put(Sent {
            at: Instant::now(),
            time: self.clock.base.now(),
            applied: self.clock.skew.get(),
        });
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        ctx: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(sent) = cfg.load::<Sent>().copied() else {
            return Ok(());
        };
        let now = self.clock.base.now();
        let measured = self
            .clock
            .skew
            .record(sent.time, now, ctx.response().headers());
        if let Some(off) = SignedOff::of(sent.applied, measured) {
            ctx.response_mut().add_extension(off);
        }
        Ok(())
    }

    /// A ListObjectsV2 answer whose body does not end with its root's closing tag was cut short
    /// (the SDK's XML reader stops at the end of the input without an error, so the part read
    /// can look like a shorter page): refused here, as a response error (transient, retried).
    fn read_after_deserialization(
        &self,
        ctx: &AfterDeserializationInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let is_list = cfg
            .load::<Metadata>()
            .is_some_and(|m| m.name() == "ListObjectsV2");
        let r = ctx.response();
        match r.body().bytes() {
            Some(body) if is_list && r.status().is_success() && !crate::list_body_whole(body) => {
                Err(crate::LIST_CUT_SHORT.into())
            }
            _ => Ok(()),
        }
    }

    fn read_after_attempt(
        &self,
        ctx: &FinalizerInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        // No `Sent`: the attempt failed before a request went out (e.g. no credentials).
        let Some(sent) = cfg.load::<Sent>().copied() else {
            return Ok(());
        };
        cfg.interceptor_state().unset::<Sent>();
        if let Some(hook) = &self.hook {
            let op = cfg
                .load::<Metadata>()
                .map_or("other", |m| op_label(m.name()));
            hook(Attempt {
                op,
                status: ctx.response().map(|r| r.status().as_u16()),
                elapsed: sent.at.elapsed(),
            });
        }
        Ok(())
    }
}

/// Retries, for the operations the SDK retries itself, a 403 to a request signed far off the
/// server's time ([`SignedOff`]): the next attempt is signed at the server's time. (GETs and LISTs
/// get the same from the error table.) The SDK's own classifier for this is off with its skew
/// correction.
#[derive(Debug)]
pub(crate) struct SkewRetry;

impl ClassifyRetry for SkewRetry {
    fn classify_retry(&self, ctx: &InterceptorContext) -> RetryAction {
        match ctx.response() {
            Some(r) if r.status().as_u16() == 403 && r.extension::<SignedOff>().is_some() => {
                RetryAction::retryable_error(ErrorKind::ServerError)
            }
            _ => RetryAction::NoActionIndicated,
        }
    }

    fn name(&self) -> &'static str {
        "FerrySkewRetry"
    }

    fn priority(&self) -> RetryClassifierPriority {
        RetryClassifierPriority::run_after(RetryClassifierPriority::http_status_code_classifier())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_labels_are_static() {
        assert_eq!(op_label("GetObject"), "GetObject");
        assert_eq!(op_label("ListObjectsV2"), "ListObjectsV2");
        assert_eq!(op_label("ListMultipartUploads"), "ListMultipartUploads");
        assert_eq!(op_label("SelectObjectContent"), "other");
    }
}
