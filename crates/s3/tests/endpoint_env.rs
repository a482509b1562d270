//! `AWS_ENDPOINT_URL_S3` (the S3-only endpoint variable) is where every request goes, raw GETs
//! included, and names the endpoint in [`S3Store::endpoint_id`] (the cache key). Its own test
//! binary: it sets a process environment variable.

use ferry_s3::{S3Options, S3Store};
use ferry_store::ObjectStore;
use ferry_testkit::S3Server;

#[tokio::test]
async fn the_s3_only_endpoint_variable_serves_every_path() {
    let server = S3Server::start();
    server.create_bucket("env").await;
    server
        .store()
        .await
        .put("env", "k", "hello".into())
        .await
        .unwrap();
    std::env::remove_var("AWS_ENDPOINT_URL");
    std::env::set_var("AWS_ENDPOINT_URL_S3", server.endpoint_url());
    for raw_get in [true, false] {
        let mut cfg = server.s3_config();
        cfg.endpoint_url = None;
        let opts = S3Options {
            raw_get,
            ..S3Server::test_options()
        };
        let s = S3Store::with_options(cfg, opts).await.unwrap();
        assert_eq!(s.endpoint_id(), server.endpoint_url(), "raw path {raw_get}");
        s.head_bucket("env").await.unwrap();
        assert_eq!(
            s.get_range("env", "k", 0..5, None).await.unwrap(),
            "hello",
            "raw path {raw_get}"
        );
    }
}
