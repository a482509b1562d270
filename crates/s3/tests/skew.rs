//! A node whose clock is 20 minutes off, against a real server that enforces SigV4's 15-minute
//! limit (versitygw answers `403 RequestTimeTooSkewed`, as S3 does). The clock is injected through
//! the SDK's `TimeSource` ([`S3Options::time_source`]), which the raw GET path signs with too.
//!
//! On both GET paths the first request is refused — which shows the server enforces the limit and
//! that nothing corrects a request before a response was seen —, the refusal's `Date` is recorded,
//! and the next attempt, signed at the server's time, succeeds. Without the correction (the raw
//! path signing with the local clock, as it did) every GET of such a node is refused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_credential_types::provider::{future, ProvideCredentials, SharedCredentialsProvider};
use aws_credential_types::Credentials;
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

/// versitygw with bucket [`BUCKET`] holding `k` = `hello`, written with a correct clock.
async fn server_with_object() -> S3Server {
    let server = S3Server::start();
    server.create_bucket(BUCKET).await;
    server
        .store()
        .await
        .put(BUCKET, "k", "hello".into())
        .await
        .unwrap();
    server
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
    let server = server_with_object().await;
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

/// HeadObject and HeadBucket answer a refusal with a bare 403 (no body, so no
/// `RequestTimeTooSkewed`): from a node whose clock is 20 minutes off, the first one is refused
/// for the clock, and must be retried signed at the server's time, not reported as EACCES
/// (`ferry-node mount` starts with a HeadBucket).
#[tokio::test]
async fn heads_from_a_node_twenty_minutes_off_are_retried_not_denied() {
    let server = server_with_object().await;
    for ahead in [true, false] {
        let s = skewed_store(&server, true, ahead, 3).await;
        s.head_bucket(BUCKET)
            .await
            .unwrap_or_else(|e| panic!("clock ahead {ahead}: HeadBucket: {e:?}"));
        let s = skewed_store(&server, true, ahead, 3).await;
        let info = s
            .head(BUCKET, "k")
            .await
            .unwrap_or_else(|e| panic!("clock ahead {ahead}: HeadObject: {e:?}"));
        assert_eq!(info.size, 5);
        // A real refusal is still one, once the clock is corrected: a missing key is 404, and a
        // bare 403 signed at the right time stays EACCES (covered by the error table's tests).
        let e = s.head(BUCKET, "missing").await.unwrap_err();
        assert!(matches!(e, StoreError::NotFound(_)), "{e:?}");
    }
}

/// Credentials whose expiry is judged by the server's time: they expire as they are handed out
/// (really), which by the clock of a node 20 minutes behind is 20 minutes away. The identity cache
/// must renew them (it asks the provider again within 5-10 s of expiry; the skew it corrects by
/// is measured from `Date`, to the second); judging by the node's clock it would keep signing with
/// them for 20 minutes, which S3 refuses with `ExpiredToken` (EACCES).
#[derive(Debug)]
struct ShortLived {
    access_key: String,
    secret_key: String,
    calls: Arc<AtomicUsize>,
}

impl ProvideCredentials for ShortLived {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        self.calls.fetch_add(1, Ordering::SeqCst);
        future::ProvideCredentials::ready(Ok(Credentials::new(
            &self.access_key,
            &self.secret_key,
            None,
            Some(SystemTime::now()),
            "short-lived",
        )))
    }
}

#[tokio::test]
async fn credentials_expire_by_the_servers_clock_on_both_paths() {
    let server = server_with_object().await;
    for raw_get in [true, false] {
        let calls = Arc::new(AtomicUsize::new(0));
        let provider = SharedCredentialsProvider::new(ShortLived {
            access_key: server.access_key().to_owned(),
            secret_key: server.secret_key().to_owned(),
            calls: calls.clone(),
        });
        let opts = S3Options {
            raw_get,
            max_attempts: 3,
            time_source: Some(SharedTimeSource::new(Skewed { ahead: false })),
            ..S3Server::test_options()
        };
        let s = S3Store::with_credentials_provider(server.s3_config(), opts, provider)
            .await
            .unwrap();
        // The first GET is refused for the clock, which teaches the store the skew.
        assert_eq!(s.get_range(BUCKET, "k", 0..5, None).await.unwrap(), "hello");
        let before = calls.load(Ordering::SeqCst);
        for _ in 0..2 {
            assert_eq!(s.get_range(BUCKET, "k", 0..5, None).await.unwrap(), "hello");
        }
        let after = calls.load(Ordering::SeqCst);
        assert!(
            after >= before + 2,
            "raw path {raw_get}: credentials expired by the server's clock were used again \
             ({before} provider calls before, {after} after two GETs)"
        );
    }
}
