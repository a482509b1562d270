//! A node whose clock is 20 minutes off, against a real server that enforces SigV4's 15-minute
//! limit (versitygw answers `403 RequestTimeTooSkewed`, as S3 does). The clock is injected through
//! the SDK's `TimeSource` ([`S3Options::time_source`]), which the raw GET path signs with too.
//!
//! On both GET paths the first request is refused — which shows the server enforces the limit and
//! that nothing corrects a request before a response was seen —, the refusal's `Date` is recorded,
//! and the next attempt, signed at the server's time, succeeds. Without the correction (the raw
//! path signing with the local clock, as it did) every GET of such a node is refused.

use std::time::{Duration, SystemTime};

use aws_smithy_async::time::{SharedTimeSource, TimeSource};
use ferry_s3::{S3Options, S3Store};
use ferry_store::{ObjectStore, StoreError};
use ferry_testkit::S3Server;

const BUCKET: &str = "skew";

/// The system clock, `ahead` (or behind) by 20 minutes.
#[derive(Debug)]
struct Skewed {
    ahead: bool,
}

impl TimeSource for Skewed {
    fn now(&self) -> SystemTime {
        let off = Duration::from_secs(20 * 60);
        if self.ahead {
            SystemTime::now() + off
        } else {
            SystemTime::now() - off
        }
    }
}

async fn skewed_store(server: &S3Server, raw_get: bool, ahead: bool, attempts: u32) -> S3Store {
    let opts = S3Options {
        raw_get,
        max_attempts: attempts,
        time_source: Some(SharedTimeSource::new(Skewed { ahead })),
        ..S3Server::test_options()
    };
    S3Store::with_options(server.s3_config(), opts)
        .await
        .expect("building a store")
}

#[tokio::test]
async fn a_node_twenty_minutes_off_reads_on_both_get_paths() {
    let server = S3Server::start();
    server.create_bucket(BUCKET).await;
    server
        .store()
        .await
        .put(BUCKET, "k", "hello".into())
        .await
        .unwrap();
    for raw_get in [true, false] {
        for ahead in [true, false] {
            let case = format!("raw path {raw_get}, clock ahead {ahead}");
            // One attempt per GET: the first is refused for the clock, not for permissions.
            let s = skewed_store(&server, raw_get, ahead, 1).await;
            let e = s.get_range(BUCKET, "k", 0..5, None).await.unwrap_err();
            assert!(
                e.to_string().contains("RequestTimeTooSkewed"),
                "{case}: the server enforces the limit: {e}"
            );
            assert!(
                matches!(e, StoreError::Transient(_)),
                "{case}: a clock problem is not EACCES: {e:?}"
            );
            // Its `Date` was recorded: the next GET is signed at the server's time.
            assert_eq!(
                s.get_range(BUCKET, "k", 0..5, None).await.unwrap(),
                "hello",
                "{case}: after the refusal"
            );
            // With retries, a fresh store's very first GET succeeds (refused, then retried).
            let s = skewed_store(&server, raw_get, ahead, 3).await;
            assert_eq!(
                s.get_range(BUCKET, "k", 0..5, None).await.unwrap(),
                "hello",
                "{case}: first GET with retries"
            );
        }
    }
}
