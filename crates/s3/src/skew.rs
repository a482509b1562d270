//! Clock skew between this node and the S3 server: one correction for everything that reads the
//! time.
//!
//! [`ClockSkew`] makes the computation of the SDK's `aws_runtime::service_clock_skew`: on every
//! response of either path (the SDK path's through `crate::attempt`'s interceptor) it takes the
//! server's `Date` and subtracts the midpoint of the request's round trip, both ends read from the
//! node's own clock ([`crate::S3Options::time_source`], else the system clock).
//!
//! The S3 client's `TimeSource` is a [`CorrectedClock`]: the node's clock plus the last skew
//! measured, and the SDK's own correction is off (it would add the skew a second time). So every
//! use of the time by the client is corrected, on both paths alike:
//! - signing (the SDK path's signer and the raw path, which signs at [`CorrectedClock::now`]);
//! - the identity cache deciding whether credentials have expired: with the node's clock `D`
//!   behind, the cache would keep credentials for `D` after S3 considers them expired (S3 answers
//!   `ExpiredToken`, a refusal: EACCES); judged by the server's time they are renewed before.
//!
//! A request signed with a time more than [`SKEW_DETECTION_THRESHOLD`] off the time its response
//! shows is marked ([`SignedOff`]): a 403 to it is a clock problem until shown otherwise (the error
//! table makes it [`crate::error::Kind::Skewed`], retried and signed at the server's time).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_smithy_async::time::{SharedTimeSource, TimeSource};
use aws_smithy_runtime_api::http::Headers;
use aws_smithy_types::date_time::{DateTime, Format};

/// A round trip longer than this gives no trustworthy skew (the SDK's limit).
const MAX_TRUSTED_REQUEST_DURATION: Duration = Duration::from_secs(15 * 60);

/// A request signed with a time further off the server's than this is taken as refused for its
/// clock if refused at all (the SDK's threshold; S3 itself refuses beyond 15 minutes).
pub(crate) const SKEW_DETECTION_THRESHOLD: Duration = Duration::from_secs(4 * 60);

/// On a response (an extension): its request was signed more than [`SKEW_DETECTION_THRESHOLD`] off
/// the server's time, by this many milliseconds (server minus signing time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SignedOff(pub i64);

impl SignedOff {
    /// The mark for a request signed with skew `applied` whose response showed `measured`.
    pub fn of(applied: i64, measured: Option<i64>) -> Option<SignedOff> {
        let off = measured?.saturating_sub(applied);
        (off.unsigned_abs() > SKEW_DETECTION_THRESHOLD.as_millis() as u64).then_some(SignedOff(off))
    }
}

/// The server's clock minus ours, in milliseconds (positive: the server is ahead).
#[derive(Debug, Default)]
pub(crate) struct ClockSkew(AtomicI64);

/// The node's clock corrected by the skew last measured: the S3 client's `TimeSource`.
#[derive(Debug, Clone)]
pub(crate) struct CorrectedClock {
    /// The node's own clock: what the skew is measured against.
    pub base: SharedTimeSource,
    pub skew: Arc<ClockSkew>,
}

impl TimeSource for CorrectedClock {
    fn now(&self) -> SystemTime {
        self.skew.apply(self.base.now())
    }
}

impl ClockSkew {
    /// The skew in milliseconds.
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }

    /// `now` corrected by the last skew measured.
    pub fn apply(&self, now: SystemTime) -> SystemTime {
        let ms = self.get();
        let shift = Duration::from_millis(ms.unsigned_abs());
        if ms >= 0 {
            now.checked_add(shift)
        } else {
            now.checked_sub(shift)
        }
        .unwrap_or(now)
    }

    /// Records the skew a response shows: its `Date` against the midpoint of `sent` and
    /// `received` (read from the node's own clock), and returns it. A response from a cache
    /// (`Age`), without a usable `Date`, or after too long a round trip changes nothing (`None`).
    pub fn record(&self, sent: SystemTime, received: SystemTime, headers: &Headers) -> Option<i64> {
        if headers.get("age").is_some() {
            return None;
        }
        let server = headers
            .get("date")
            .and_then(|d| DateTime::from_str(d, Format::HttpDate).ok())
            .and_then(|d| SystemTime::try_from(d).ok())?;
        let elapsed = received.duration_since(sent).unwrap_or_default();
        if elapsed > MAX_TRUSTED_REQUEST_DURATION {
            return None;
        }
        let midpoint = sent + elapsed / 2;
        let ms = match server.duration_since(midpoint) {
            Ok(d) => d.as_millis() as i64,
            Err(e) => -(e.duration().as_millis() as i64),
        };
        self.0.store(ms, Ordering::Relaxed);
        Some(ms)
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

    #[test]
    fn requests_signed_more_than_four_minutes_off_are_marked() {
        let min = 60_000;
        assert_eq!(SignedOff::of(0, None), None);
        assert_eq!(SignedOff::of(0, Some(3 * min)), None);
        assert_eq!(
            SignedOff::of(0, Some(-20 * min)),
            Some(SignedOff(-20 * min))
        );
        // Signed with the skew already corrected: not off, however large the skew.
        assert_eq!(SignedOff::of(20 * min, Some(20 * min + 500)), None);
        let f = crate::error::Failure::response("HEAD b", 403, None, None, None);
        assert_eq!(f.kind, crate::error::Kind::AccessDenied);
        assert_eq!(
            f.signed_off(403, Some(SignedOff(5 * min))).kind,
            crate::error::Kind::Skewed
        );
        let f = crate::error::Failure::response("HEAD b", 404, None, None, None);
        assert_eq!(
            f.signed_off(404, Some(SignedOff(5 * min))).kind,
            crate::error::Kind::NotFound
        );
    }
}
