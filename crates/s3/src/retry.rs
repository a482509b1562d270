//! The one retry policy of every S3 request, for both GET paths and for LIST.
//!
//! [`S3Options::max_attempts`] attempts in all, with exponential backoff and full jitter between
//! them (`initial_backoff × 2^(n-1)`, capped at `max_backoff`, times a random factor in [0, 1)):
//! the SDK's *standard* mode, whose numbers the SDK client is given for every other operation.
//! GETs (on either path) and LISTs run their attempts here, with the SDK's own retries off for
//! them, so nothing nests: one attempt is one HTTP request, its response head within
//! [`S3Options::attempt_timeout`] and (for a GET) its body within [`S3Options::body_timeout`].
//!
//! Retried: [`Kind::Throttled`], [`Kind::Transient`] (5xx, timeouts, connection failures,
//! unreadable responses), [`Kind::Corrupt`] (a body shorter or longer than it should be) and
//! [`Kind::Skewed`] (`RequestTimeTooSkewed`, or a 403 to a request signed more than 4 minutes off:
//! the response's `Date` has been recorded, so the next attempt signs with the server's time; see
//! [`crate::skew`]). Everything else fails at once, and so do credential failures (the provider
//! has its own retries, and the identity cache asks it again on the next request) and
//! `ExpiredToken` (the identity cache judges expiry by the corrected clock; see [`crate::error`]).
//! Operations the SDK retries itself retry the same 403s (`attempt::SkewRetry`).
//!
//! So a single range read costs at most `max_attempts × (attempt_timeout + body_timeout)` plus the
//! backoffs (each at most `max_backoff`): with the defaults 5 × (30 s + 120 s) + (1 + 2 + 4 + 8) s
//! ≈ 12 min 45 s, and at most 5 requests.

use std::future::Future;
use std::time::Duration;

use crate::error::{Failure, Kind};
use crate::S3Options;

/// Attempts and backoffs, from [`S3Options`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct RetryPolicy {
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl RetryPolicy {
    pub fn of(opts: &S3Options) -> RetryPolicy {
        RetryPolicy {
            max_attempts: opts.max_attempts,
            initial_backoff: opts.initial_backoff,
            max_backoff: opts.max_backoff,
        }
    }

    /// Whether a failure of this kind is worth another attempt.
    pub fn retries(kind: Kind) -> bool {
        matches!(
            kind,
            Kind::Throttled | Kind::Transient | Kind::Corrupt | Kind::Skewed
        )
    }

    /// The wait before attempt `attempt + 1`: full jitter over `initial × 2^(attempt-1)`, capped.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = self
            .initial_backoff
            .saturating_mul(1u32 << (attempt.max(1) - 1).min(20))
            .min(self.max_backoff);
        exp.mul_f64(fastrand::f64())
    }

    /// Runs `attempt` (given its number, from 1) until it succeeds, fails in a way not worth
    /// retrying, or the attempts run out; the last failure is returned.
    pub async fn run<T, F, Fut>(&self, what: &str, mut attempt: F) -> Result<T, Failure>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let mut n = 1;
        loop {
            match attempt(n).await {
                Err(f) if Self::retries(f.kind) && n < self.max_attempts => {
                    let backoff = self.backoff(n);
                    tracing::debug!(what, error = %f.detail, attempt = n, ?backoff, "retrying");
                    tokio::time::sleep(backoff).await;
                    n += 1;
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn policy(max_attempts: u32) -> RetryPolicy {
        RetryPolicy {
            max_attempts,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(250),
        }
    }

    #[test]
    fn backoff_is_jittered_and_capped() {
        let p = policy(5);
        for attempt in 1..40 {
            let b = p.backoff(attempt);
            assert!(b <= Duration::from_millis(250), "{b:?}");
            if attempt == 1 {
                assert!(b <= Duration::from_millis(100), "{b:?}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn attempts_are_bounded_and_only_retryable_kinds_retry() {
        for (kind, want) in [
            (Kind::Transient, 4),
            (Kind::Throttled, 4),
            (Kind::Corrupt, 4),
            (Kind::Skewed, 4),
            (Kind::AccessDenied, 1),
            (Kind::NotFound, 1),
            (Kind::OtherNotFound, 1),
            (Kind::Credentials, 1),
            (Kind::CredentialsUnavailable, 1),
        ] {
            let calls = AtomicU32::new(0);
            let r: Result<(), Failure> = policy(4)
                .run("test", |_| async {
                    calls.fetch_add(1, Ordering::Relaxed);
                    Err(Failure::new(kind, "x".into()))
                })
                .await;
            assert_eq!(r.unwrap_err().kind, kind);
            assert_eq!(calls.load(Ordering::Relaxed), want, "{kind:?}");
        }
        let r = policy(4)
            .run("test", |n| async move {
                if n < 3 {
                    Err(Failure::new(Kind::Transient, "x".into()))
                } else {
                    Ok(n)
                }
            })
            .await;
        assert_eq!(r.unwrap(), 3);
    }
}
