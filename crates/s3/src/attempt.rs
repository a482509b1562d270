//! [`Attempt`]: what one HTTP attempt reports to [`crate::S3Config::on_attempt`], on both request
//! paths; and the SDK interceptor that reports the SDK path's attempts and feeds their responses'
//! `Date` to the raw path's [`ClockSkew`].

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use aws_sdk_s3::config::interceptors::{
    BeforeDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
    FinalizerInterceptorContextRef,
};
use aws_sdk_s3::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use aws_smithy_types::config_bag::{Storable, StoreReplace};

use crate::skew::ClockSkew;

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
    const OPS: [&str; 13] = [
        "GetObject",
        "HeadObject",
        "HeadBucket",
        "ListObjectsV2",
        "PutObject",
        "CreateMultipartUpload",
        "UploadPart",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
        "DeleteObject",
        "DeleteObjects",
        "CreateBucket",
        "PutBucketPolicy",
    ];
    OPS.into_iter().find(|op| *op == name).unwrap_or("other")
}

/// When the current attempt's request went out: the monotonic clock for [`Attempt::elapsed`], the
/// client's `TimeSource` for the skew.
#[derive(Debug, Clone, Copy)]
struct Sent {
    at: Instant,
    time: Option<SystemTime>,
}

impl Storable for Sent {
    type Storer = StoreReplace<Self>;
}

/// Reports every attempt of the SDK path to the hook and records the skew its response shows.
pub(crate) struct AttemptInterceptor {
    pub hook: Option<OnAttempt>,
    pub skew: Arc<ClockSkew>,
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
        rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let time = rc.time_source().map(|t| t.now());
        cfg.interceptor_state().store_put(Sent {
            at: Instant::now(),
            time,
        });
        Ok(())
    }

    fn read_before_deserialization(
        &self,
        ctx: &BeforeDeserializationInterceptorContextRef<'_>,
        rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let sent = cfg.load::<Sent>().and_then(|s| s.time);
        let now = rc.time_source().map(|t| t.now());
        if let (Some(sent), Some(now)) = (sent, now) {
            self.skew.record(sent, now, ctx.response().headers());
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_labels_are_static() {
        assert_eq!(op_label("GetObject"), "GetObject");
        assert_eq!(op_label("ListObjectsV2"), "ListObjectsV2");
        assert_eq!(op_label("SelectObjectContent"), "other");
    }
}
