//! Clock skew between this node and the S3 server, for the raw GET path.
//!
//! The SDK corrects its signing time with `aws_runtime::service_clock_skew`: on every response it
//! takes the server's `Date`, subtracts the midpoint of the request's round trip (both ends read
//! from the client's `TimeSource`), keeps the difference for the client, and signs each later
//! request at `TimeSource::now() + skew`; a `RequestTimeTooSkewed` refusal is retried once the skew
//! is known. Its state is private to the SDK, so [`ClockSkew`] makes the same computation from the
//! same source: the `Date` of every response of both paths (the SDK path's through
//! `crate::attempt`'s interceptor), timed by the client's own `TimeSource`. The raw path signs with
//! [`ClockSkew::apply`]; the SDK path keeps signing with the SDK's own correction.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use aws_smithy_runtime_api::http::Headers;
use aws_smithy_types::date_time::{DateTime, Format};

/// A round trip longer than this gives no trustworthy skew (the SDK's limit).
const MAX_TRUSTED_REQUEST_DURATION: Duration = Duration::from_secs(15 * 60);

/// The server's clock minus ours, in milliseconds (positive: the server is ahead).
#[derive(Debug, Default)]
pub(crate) struct ClockSkew(AtomicI64);

impl ClockSkew {
    /// `now` corrected by the last skew measured.
    pub fn apply(&self, now: SystemTime) -> SystemTime {
        let ms = self.0.load(Ordering::Relaxed);
        let shift = Duration::from_millis(ms.unsigned_abs());
        if ms >= 0 {
            now.checked_add(shift)
        } else {
            now.checked_sub(shift)
        }
        .unwrap_or(now)
    }

    /// Records the skew a response shows: its `Date` against the midpoint of `sent` and
    /// `received`. A response from a cache (`Age`), without a usable `Date`, or after too long a
    /// round trip changes nothing.
    pub fn record(&self, sent: SystemTime, received: SystemTime, headers: &Headers) {
        if headers.get("age").is_some() {
            return;
        }
        let Some(server) = headers
            .get("date")
            .and_then(|d| DateTime::from_str(d, Format::HttpDate).ok())
            .and_then(|d| SystemTime::try_from(d).ok())
        else {
            return;
        };
        let elapsed = received.duration_since(sent).unwrap_or_default();
        if elapsed > MAX_TRUSTED_REQUEST_DURATION {
            return;
        }
        let midpoint = sent + elapsed / 2;
        let ms = match server.duration_since(midpoint) {
            Ok(d) => d.as_millis() as i64,
            Err(e) => -(e.duration().as_millis() as i64),
        };
        self.0.store(ms, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(kv: &[(&'static str, String)]) -> Headers {
        let mut h = Headers::new();
        for (k, v) in kv {
            h.insert(*k, v.clone());
        }
        h
    }

    #[test]
    fn a_server_twenty_minutes_behind_is_measured_and_applied() {
        let ours = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let server = ours - Duration::from_secs(20 * 60);
        let date = DateTime::from(server).fmt(Format::HttpDate).unwrap();
        let skew = ClockSkew::default();
        assert_eq!(skew.apply(ours), ours);
        skew.record(
            ours,
            ours + Duration::from_secs(2),
            &headers(&[("date", date.clone())]),
        );
        // The midpoint is one second after `ours`: the server is 20 min + 1 s behind it.
        assert_eq!(
            skew.apply(ours + Duration::from_secs(1)),
            server,
            "signs at the server's time"
        );
        // A cached response or one without a Date changes nothing.
        let other = ClockSkew::default();
        other.record(ours, ours, &headers(&[("date", date), ("age", "3".into())]));
        other.record(ours, ours, &headers(&[("date", "yesterday".into())]));
        assert_eq!(other.apply(ours), ours);
    }
}
