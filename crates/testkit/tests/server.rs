//! The test server itself: starts, serves S3 with the advertised credentials, and dies on drop.

use std::net::TcpStream;
use std::time::Duration;

use ferry_store::ObjectStore;
use ferry_testkit::{init_tracing, supports_user_xattrs, S3Server};

#[tokio::test]
async fn starts_serves_and_stops() {
    init_tracing();
    let server = S3Server::start();
    assert!(server.endpoint_url().starts_with("http://127.0.0.1:"));
    server.create_bucket("kit").await;
    server.create_bucket("kit").await; // idempotent
    let store = server.store().await;
    store.head_bucket("kit").await.unwrap();
    store.put("kit", "dir/file", "hello".into()).await.unwrap();
    // The posix backend maps keys to files.
    let on_disk = std::fs::read(server.root().join("kit/dir/file")).unwrap();
    assert_eq!(on_disk, b"hello");
    assert_eq!(server.s3_config().endpoint_url, Some(server.endpoint_url()));
    assert!(!format!("{:?}", server.s3_config()).contains(server.secret_key()));

    let port = server.port();
    let root = server.root().to_owned();
    drop(server);
    assert!(
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
            .is_err(),
        "the server must be gone after drop"
    );
    assert!(!root.exists(), "the temp dir is removed");
}

#[tokio::test]
async fn wrong_credentials_are_refused() {
    let server = S3Server::start();
    server.create_bucket("kit").await;
    let mut cfg = server.s3_config();
    cfg.credentials = ferry_s3::S3Credentials::Static {
        access_key_id: server.access_key().into(),
        secret_access_key: "not-the-secret".into(),
        session_token: None,
    };
    let store = ferry_s3::S3Store::with_options(cfg, S3Server::test_options())
        .await
        .unwrap();
    let e = store.head("kit", "x").await.unwrap_err();
    // HEAD has no body: versitygw's 403 carries no code, so this is the bare-status mapping.
    assert!(
        matches!(e, ferry_store::StoreError::AccessDenied(_)),
        "{e:?}"
    );
    let e = store.list("kit", Default::default()).await.unwrap_err();
    assert!(
        matches!(e, ferry_store::StoreError::AccessDenied(_)),
        "{e:?}"
    );
}

#[test]
fn xattr_probe_runs() {
    // Just exercises the probe; the answer depends on the filesystem.
    let dir = tempfile::tempdir().unwrap();
    let _ = supports_user_xattrs(dir.path());
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "probe file cleaned up"
    );
}
