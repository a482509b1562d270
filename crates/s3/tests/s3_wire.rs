//! [`S3Store`] against a scripted HTTP server on loopback: error mapping end to end, SDK retries,
//! and the body checks (short bodies, broken streams, servers that ignore `Range`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_s3::{S3Config, S3Credentials, S3Options, S3Store};
use ferry_store::{ListRequest, ObjectStore, StoreError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A server answering the n-th request with `responses[n]` (the last one repeats), one request per
/// connection. Returns the store pointed at it and the request counter.
async fn scripted(responses: Vec<Vec<u8>>) -> (S3Store, Arc<AtomicUsize>) {
    scripted_on(true, responses).await
}

/// [`scripted`], with GETs on the raw path (`raw`) or through the SDK's orchestrator.
async fn scripted_on(raw: bool, responses: Vec<Vec<u8>>) -> (S3Store, Arc<AtomicUsize>) {
    let (addr, count) = serve(responses, None).await;
    let opts = S3Options {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        raw_get: raw,
        ..S3Options::default()
    };
    (store_at(addr, opts).await, count)
}

/// The scripted server: answers the n-th connection's request with `responses[n]` (the last one
/// repeats). With `stall = Some((n, d))` the last `n` bytes of each response follow after `d`.
async fn serve(
    responses: Vec<Vec<u8>>,
    stall: Option<(usize, Duration)>,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let served = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let n = served.fetch_add(1, Ordering::SeqCst);
            let response = responses[n.min(responses.len() - 1)].clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    }
                }
                let (held, pause) = stall.unwrap_or((0, Duration::ZERO));
                let split = response.len().saturating_sub(held);
                let _ = sock.write_all(&response[..split]).await;
                if split < response.len() {
                    let _ = sock.flush().await;
                    tokio::time::sleep(pause).await;
                    let _ = sock.write_all(&response[split..]).await;
                }
                let _ = sock.shutdown().await;
            });
        }
    });
    (addr, count)
}

/// A store with `opts` pointed at the scripted server at `addr`.
async fn store_at(addr: SocketAddr, opts: S3Options) -> S3Store {
    store_reporting(addr, opts, None).await
}

/// [`store_at`], reporting every attempt to `on_attempt`.
async fn store_reporting(
    addr: SocketAddr,
    opts: S3Options,
    on_attempt: Option<ferry_s3::OnAttempt>,
) -> S3Store {
    let cfg = S3Config {
        endpoint_url: Some(format!("http://{addr}")),
        region: Some("us-east-1".into()),
        force_path_style: true,
        credentials: S3Credentials::Static {
            access_key_id: "a".into(),
            secret_access_key: "s".into(),
            session_token: None,
        },
        on_attempt,
    };
    S3Store::with_options(cfg, opts).await.unwrap()
}

fn response(status: &str, headers: &[(&str, String)], body: &[u8]) -> Vec<u8> {
    let mut r = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    r.push_str("\r\n");
    let mut r = r.into_bytes();
    r.extend_from_slice(body);
    r
}

fn s3_error(status: &str, code: &str) -> Vec<u8> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>scripted {code}</Message><RequestId>REQ1</RequestId></Error>"
    );
    response(
        status,
        &[
            ("Content-Type", "application/xml".into()),
            ("Content-Length", body.len().to_string()),
        ],
        body.as_bytes(),
    )
}

/// A 206 whose headers promise `promised` bytes of the range; `body` is what is really sent.
fn partial(first: u64, last: u64, total: u64, content_length: usize, body: &[u8]) -> Vec<u8> {
    response(
        "206 Partial Content",
        &[
            ("Content-Range", format!("bytes {first}-{last}/{total}")),
            ("Content-Length", content_length.to_string()),
            ("ETag", "\"abc\"".into()),
        ],
        body,
    )
}

#[tokio::test]
async fn good_partial_response() {
    for raw in [true, false] {
        let (s, n) = scripted_on(raw, vec![partial(2, 5, 10, 4, b"2345")]).await;
        assert_eq!(s.get_range("b", "k", 2..6, None).await.unwrap(), "2345");
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }
}

#[tokio::test]
async fn short_body_per_content_range_is_retried_then_corrupt() {
    for raw in [true, false] {
        // Content-Length agrees with the body, but Content-Range promised 10 bytes.
        let (s, n) = scripted_on(raw, vec![partial(0, 9, 10, 5, b"01234")]).await;
        let e = s.get_range("b", "k", 0..10, None).await.unwrap_err();
        assert!(matches!(e, StoreError::Corrupt(_)), "{e:?}");
        assert_eq!(n.load(Ordering::SeqCst), 3, "max_attempts reads");
    }
}

/// Broken bodies and failed requests draw on one budget of attempts, on both paths: a GET whose
/// responses alternate between a short body and a 503 makes `max_attempts` requests, not
/// `max_attempts` requests per body attempt. Each attempt is reported once, with its status.
/// A hook that records each attempt's operation and status.
type Seen = Arc<std::sync::Mutex<Vec<(&'static str, Option<u16>)>>>;
fn recording_hook() -> (ferry_s3::OnAttempt, Seen) {
    let seen: Seen = Arc::default();
    let hook: ferry_s3::OnAttempt = {
        let seen = seen.clone();
        Arc::new(move |a: ferry_s3::Attempt| seen.lock().unwrap().push((a.op, a.status)))
    };
    (hook, seen)
}

/// `max_attempts` attempts with millisecond backoffs, on the raw GET path or the SDK's.
fn quick_retries(max_attempts: u32, raw_get: bool) -> S3Options {
    S3Options {
        max_attempts,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        raw_get,
        ..S3Options::default()
    }
}

#[tokio::test]
async fn body_and_request_failures_share_one_budget_of_attempts() {
    for raw in [true, false] {
        let short = partial(0, 9, 10, 5, b"01234");
        let slow = s3_error("503 Slow Down", "SlowDown");
        let script = [short, slow].into_iter().cycle().take(20).collect();
        let (addr, n) = serve(script, None).await;
        let (hook, seen) = recording_hook();
        let s = store_reporting(addr, quick_retries(4, raw), Some(hook)).await;
        let e = s.get_range("b", "k", 0..10, None).await.unwrap_err();
        assert!(matches!(e, StoreError::Throttled(_)), "raw {raw}: {e:?}");
        assert_eq!(n.load(Ordering::SeqCst), 4, "raw {raw}: requests");
        assert_eq!(
            *seen.lock().unwrap(),
            [
                ("GetObject", Some(206)),
                ("GetObject", Some(503)),
                ("GetObject", Some(206)),
                ("GetObject", Some(503)),
            ],
            "raw {raw}: one report per attempt"
        );
    }
}

/// An attempt that gets no response is reported without a status.
#[tokio::test]
async fn an_attempt_without_a_response_is_reported_without_a_status() {
    // Nothing listens on port 1.
    let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
    for raw in [true, false] {
        let (hook, seen) = recording_hook();
        let s = store_reporting(addr, quick_retries(2, raw), Some(hook)).await;
        let e = s.get_range("b", "k", 0..10, None).await.unwrap_err();
        assert!(matches!(e, StoreError::Transient(_)), "raw {raw}: {e:?}");
        assert_eq!(
            *seen.lock().unwrap(),
            [("GetObject", None), ("GetObject", None)],
            "raw {raw}"
        );
        seen.lock().unwrap().clear();
        let _ = s.head("b", "k").await.unwrap_err();
        assert_eq!(
            *seen.lock().unwrap(),
            [("HeadObject", None), ("HeadObject", None)],
            "raw {raw}: the SDK path's own retries report each attempt"
        );
    }
}

#[tokio::test]
async fn short_body_recovers_on_retry() {
    for raw in [true, false] {
        recovers_after(raw, partial(0, 9, 10, 5, b"01234")).await;
    }
}

/// A GET whose first response is `broken` and whose second is whole returns the whole body,
/// after two requests.
async fn recovers_after(raw: bool, broken: Vec<u8>) {
    let (s, n) = scripted_on(raw, vec![broken, partial(0, 9, 10, 10, b"0123456789")]).await;
    assert_eq!(
        s.get_range("b", "k", 0..10, None).await.unwrap(),
        "0123456789"
    );
    assert_eq!(n.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn connection_closed_mid_body_is_retried() {
    for raw in [true, false] {
        // Content-Length 10, 5 bytes, then the connection closes.
        recovers_after(raw, partial(0, 9, 10, 10, b"01234")).await;

        let (s, n) = scripted_on(raw, vec![partial(0, 9, 10, 10, b"01234")]).await;
        let e = s.get_range("b", "k", 0..10, None).await.unwrap_err();
        assert!(e.is_retryable(), "{e:?}");
        assert!(matches!(e, StoreError::Transient(_)), "{e:?}");
        assert_eq!(n.load(Ordering::SeqCst), 3);
    }
}

#[tokio::test]
async fn wrong_content_range_is_corrupt() {
    for raw in [true, false] {
        // Asked 0..10, the server sends bytes 3-9.
        let (s, _) = scripted_on(raw, vec![partial(3, 9, 10, 7, b"3456789")]).await;
        let e = s.get_range("b", "k", 0..10, None).await.unwrap_err();
        assert!(matches!(e, StoreError::Corrupt(_)), "{e:?}");
    }
}

#[tokio::test]
async fn server_ignoring_range_is_sliced() {
    for raw in [true, false] {
        let whole = response(
            "200 OK",
            &[("Content-Length", "10".into()), ("ETag", "\"abc\"".into())],
            b"0123456789",
        );
        let (s, _) = scripted_on(raw, vec![whole]).await;
        assert_eq!(s.get_range("b", "k", 2..5, None).await.unwrap(), "234");
        assert_eq!(s.get_range("b", "k", 8..50, None).await.unwrap(), "89");
        let e = s.get_range("b", "k", 10..12, None).await.unwrap_err();
        assert!(matches!(e, StoreError::InvalidRequest(_)), "{e:?}");
        // In pieces: cut out of the whole object first, then split.
        let pieces = s.get_range_pieces("b", "k", 1..9, None, 3).await.unwrap();
        assert_eq!(pieces, ["123", "456", "78"]);
    }
}

#[tokio::test]
async fn throttling_is_retried_by_the_sdk_then_throttled() {
    for raw in [true, false] {
        let (s, n) = scripted_on(raw, vec![s3_error("503 Slow Down", "SlowDown")]).await;
        let e = s.get_range("b", "k", 0..1, None).await.unwrap_err();
        assert!(matches!(e, StoreError::Throttled(_)), "{e:?}");
        assert!(e.to_string().contains("SlowDown"), "{e}");
        assert!(e.to_string().len() < 300, "concise message: {e}");
        assert_eq!(n.load(Ordering::SeqCst), 3, "max_attempts");

        let (s, n) = scripted_on(
            raw,
            vec![
                s3_error("503 Slow Down", "SlowDown"),
                partial(0, 0, 1, 1, b"x"),
            ],
        )
        .await;
        assert_eq!(s.get_range("b", "k", 0..1, None).await.unwrap(), "x");
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }
}

#[tokio::test]
async fn server_errors_are_transient() {
    let (s, n) = scripted(vec![s3_error("500 Internal Server Error", "InternalError")]).await;
    let e = s.put("b", "k", "x".into()).await.unwrap_err();
    assert!(matches!(e, StoreError::Transient(_)), "{e:?}");
    assert_eq!(n.load(Ordering::SeqCst), 3);
    // Some servers answer 500 with no body to a HEAD of a "directory" key: plain Transient.
    let (s, _) = scripted(vec![response(
        "500 Internal Server Error",
        &[("Content-Length", "0".into())],
        b"",
    )])
    .await;
    let e = s.head("b", "dir/").await.unwrap_err();
    assert!(matches!(e, StoreError::Transient(_)), "{e:?}");
}

/// A 2xx answer the SDK cannot read says why, not "no error code: no message": rclone's
/// `serve s3` (1.75) answers CreateMultipartUpload with an `<InitiateMultipartUpload>` root where
/// S3 has `<InitiateMultipartUploadResult>`, and a user's write of a large file then fails on it.
#[tokio::test]
async fn an_answer_the_sdk_cannot_read_names_what_was_wrong() {
    let body = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<InitiateMultipartUpload><Bucket>b</Bucket><Key>k</Key><UploadId>u1</UploadId></InitiateMultipartUpload>";
    let (s, _) = scripted(vec![response(
        "200 OK",
        &[
            ("Content-Type", "text/xml".into()),
            ("Content-Length", body.len().to_string()),
        ],
        body,
    )])
    .await;
    let e = s.create_multipart("b", "k").await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, StoreError::Transient(_)), "{e:?}");
    assert!(text.contains("HTTP 200"), "{text}");
    assert!(
        text.contains("could not be read") && text.contains("InitiateMultipartUpload"),
        "the SDK's reason is named: {text}"
    );
    assert!(!text.contains("no error code"), "{text}");
}

/// Whether an error is the expected one.
type Check = fn(&StoreError) -> bool;

#[tokio::test]
async fn client_errors_map_without_retries() {
    let cases: Vec<(&str, &str, Check)> = vec![
        ("403 Forbidden", "AccessDenied", |e| {
            matches!(e, StoreError::AccessDenied(_))
        }),
        (
            "404 Not Found",
            "NoSuchBucket",
            |e| matches!(e, StoreError::NoSuchBucket(b) if b == "b"),
        ),
        (
            "404 Not Found",
            "NoSuchKey",
            |e| matches!(e, StoreError::NotFound(k) if k == "k"),
        ),
        ("412 Precondition Failed", "PreconditionFailed", |e| {
            matches!(e, StoreError::PreconditionFailed(_))
        }),
        ("416 Requested Range Not Satisfiable", "InvalidRange", |e| {
            matches!(e, StoreError::InvalidRequest(_))
        }),
        ("400 Bad Request", "InvalidArgument", |e| {
            matches!(e, StoreError::InvalidRequest(_))
        }),
        ("501 Not Implemented", "NotImplemented", |e| {
            matches!(e, StoreError::Other(_))
        }),
    ];
    for (status, code, check) in cases {
        for raw in [true, false] {
            let (s, n) = scripted_on(raw, vec![s3_error(status, code)]).await;
            let e = s
                .get_range("b", "k", 0..1, Some("\"abc\""))
                .await
                .unwrap_err();
            assert!(check(&e), "{status} {code} (raw {raw}): {e:?}");
            assert_eq!(n.load(Ordering::SeqCst), 1, "{code} is not retried");
        }
    }
    // HEAD: bare statuses, no body.
    let bare = |status: &str| response(status, &[("Content-Length", "0".into())], b"");
    let (s, _) = scripted(vec![bare("404 Not Found")]).await;
    assert!(matches!(
        s.head("b", "k").await,
        Err(StoreError::NotFound(_))
    ));
    // HeadBucket's bare 404 is asked again as a one-key LIST, whose answer has the code.
    let (s, n) = scripted(vec![
        bare("404 Not Found"),
        s3_error("404 Not Found", "NoSuchBucket"),
    ])
    .await;
    assert_eq!(
        s.head_bucket("b").await,
        Err(StoreError::NoSuchBucket("b".into()))
    );
    assert_eq!(n.load(Ordering::SeqCst), 2, "HEAD, then one LIST");
    let (s, _) = scripted(vec![
        bare("404 Not Found"),
        s3_error("404 Not Found", "XAdminUserNotFound"),
    ])
    .await;
    let e = s.head_bucket("b").await.unwrap_err();
    assert!(matches!(e, StoreError::Other(_)), "{e:?}");
    assert!(e.to_string().contains("XAdminUserNotFound"), "{e}");
    let (s, _) = scripted(vec![bare("403 Forbidden")]).await;
    assert!(matches!(
        s.head("b", "k").await,
        Err(StoreError::AccessDenied(_))
    ));
    let (s, _) = scripted(vec![bare("429 Too Many Requests")]).await;
    assert!(matches!(
        s.head("b", "k").await,
        Err(StoreError::Throttled(_))
    ));
}

/// Only the code `NoSuchBucket` says a bucket is missing. A 404 with another code (versitygw's
/// answer to an access key it does not know) or none (a proxy's own 404 page) to a LIST is an
/// error that quotes what the server said, so DeleteVolume cannot take it for "nothing left to
/// delete"; a GET's 404 still means the key is missing.
#[tokio::test]
async fn a_404_to_a_bucket_request_is_a_missing_bucket_only_when_it_says_no_such_bucket() {
    let page = b"<html><body><h1>404 Not Found</h1>nginx</body></html>";
    let proxy_page = response(
        "404 Not Found",
        &[
            ("Content-Type", "text/html".into()),
            ("Content-Length", page.len().to_string()),
        ],
        page,
    );
    for (answer, says) in [
        (
            s3_error("404 Not Found", "XAdminUserNotFound"),
            "XAdminUserNotFound",
        ),
        (proxy_page, "HTTP 404"),
    ] {
        let (s, n) = scripted(vec![answer.clone()]).await;
        let e = s.list("b", ListRequest::default()).await.unwrap_err();
        assert!(matches!(e, StoreError::Other(_)), "{says}: {e:?}");
        let text = e.to_string();
        assert!(text.contains(says) && text.contains("bucket b"), "{text}");
        assert_eq!(n.load(Ordering::SeqCst), 1, "not retried");
        let (s, _) = scripted(vec![answer.clone()]).await;
        let e = ferry_store::delete_prefix(&s, "b", "vol/")
            .await
            .unwrap_err();
        assert!(!matches!(e, StoreError::NoSuchBucket(_)), "{says}: {e:?}");
        let (s, _) = scripted(vec![answer]).await;
        let e = ferry_store::check_prefix_access(&s, "b", "vol/")
            .await
            .unwrap_err();
        assert!(!matches!(e, StoreError::NoSuchBucket(_)), "{says}: {e:?}");
    }
    let (s, _) = scripted(vec![s3_error("404 Not Found", "NoSuchBucket")]).await;
    assert_eq!(
        s.list("b", ListRequest::default()).await,
        Err(StoreError::NoSuchBucket("b".into()))
    );
    let (s, _) = scripted(vec![s3_error("404 Not Found", "NoSuchKey")]).await;
    assert_eq!(
        s.get_range("b", "k", 0..1, None).await,
        Err(StoreError::NotFound("k".into()))
    );
}

#[tokio::test]
async fn delete_many_names_the_failed_key() {
    let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<DeleteResult><Error><Key>a/locked</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error></DeleteResult>";
    let ok = response(
        "200 OK",
        &[
            ("Content-Type", "application/xml".into()),
            ("Content-Length", body.len().to_string()),
        ],
        body.as_bytes(),
    );
    let (s, _) = scripted(vec![ok]).await;
    let e = s
        .delete_many("b", &["a/free".into(), "a/locked".into()])
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::AccessDenied(_)), "{e:?}");
    assert!(e.to_string().contains("a/locked"), "{e}");
}

/// Entries of the page a server answering `response` lists.
async fn s_list_ok(response: &[u8]) -> usize {
    let (s, _) = scripted(vec![response.to_vec()]).await;
    s.list("b", ListRequest::default())
        .await
        .unwrap()
        .objects
        .len()
}

fn list_body() -> String {
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>b</Name><Prefix></Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated><Contents><Key>k</Key><Size>3</Size><ETag>&quot;abc&quot;</ETag></Contents></ListBucketResult>".to_owned()
}

/// A 200 LIST whose body promises `Content-Length` bytes but sends only `sent` of them.
fn cut_list(sent: usize) -> Vec<u8> {
    let body = list_body();
    response(
        "200 OK",
        &[
            ("Content-Type", "application/xml".into()),
            ("Content-Length", body.len().to_string()),
        ],
        &body.as_bytes()[..sent],
    )
}

#[tokio::test]
async fn broken_list_responses_are_asked_again_then_transient() {
    let good = cut_list(list_body().len());
    assert_eq!(s_list_ok(&good).await, 1, "the full body is a good page");
    // Cut off mid-body, then garbled (a consistent length, but half the XML), then good.
    let garbled = {
        let body = &list_body()[..80];
        response(
            "200 OK",
            &[
                ("Content-Type", "application/xml".into()),
                ("Content-Length", body.len().to_string()),
            ],
            body.as_bytes(),
        )
    };
    let (s, n) = scripted(vec![cut_list(60), garbled.clone(), good.clone()]).await;
    let page = s.list("b", ListRequest::default()).await.unwrap();
    assert_eq!(page.objects.len(), 1);
    assert_eq!(page.objects[0].key, "k");
    assert_eq!(n.load(Ordering::SeqCst), 3, "max_attempts LISTs");

    // Cut short where the XML still parses: no entries, but KeyCount 1.
    let parses = {
        let full = list_body();
        let body = &full[..full.find("<Contents>").unwrap()];
        response(
            "200 OK",
            &[
                ("Content-Type", "application/xml".into()),
                ("Content-Length", body.len().to_string()),
            ],
            body.as_bytes(),
        )
    };
    let (s, n) = scripted(vec![parses.clone(), good.clone()]).await;
    let page = s.list("b", ListRequest::default()).await.unwrap();
    assert_eq!(page.objects.len(), 1, "never the shorter page");
    assert_eq!(n.load(Ordering::SeqCst), 2);

    // Cut inside the last key's text, where KeyCount still matches: `d/` would pass for a
    // directory marker. And cut inside a common prefix.
    let in_key = {
        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult><Name>b</Name><Prefix>d/</Prefix><KeyCount>1</KeyCount><MaxKeys>2</MaxKeys><IsTruncated>false</IsTruncated><Contents><Key>d/";
        response(
            "200 OK",
            &[("Content-Length", body.len().to_string())],
            body.as_bytes(),
        )
    };
    let in_prefix = {
        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult><Name>b</Name><Prefix>d/</Prefix><KeyCount>1</KeyCount><MaxKeys>2</MaxKeys><Delimiter>/</Delimiter><IsTruncated>false</IsTruncated><CommonPrefixes><Prefix>d/su";
        response(
            "200 OK",
            &[("Content-Length", body.len().to_string())],
            body.as_bytes(),
        )
    };
    for (broken, what) in [(&in_key, "in a key"), (&in_prefix, "in a prefix")] {
        let (s, _) = scripted(vec![broken.clone()]).await;
        let req = ListRequest {
            prefix: "d/",
            delimiter: Some("/"),
            ..ListRequest::default()
        };
        let e = s.list("b", req).await.unwrap_err();
        assert!(e.is_retryable(), "{what}: {e:?}");
    }

    // Persistently: bounded attempts, then an error (EIO), never a wrong page.
    for (broken, what) in [
        (cut_list(60), "cut off"),
        (garbled.clone(), "garbled"),
        (parses, "short but parses"),
    ] {
        let (s, n) = scripted(vec![broken]).await;
        let e = s.list("b", ListRequest::default()).await.unwrap_err();
        assert!(e.is_retryable(), "{what}: {e:?}");
        assert!(e.is_retryable());
        assert_eq!(n.load(Ordering::SeqCst), 3, "{what}: max_attempts LISTs");
    }
}

/// A body that takes longer than the attempt timeout but arrives within the body timeout is read,
/// on both paths: the attempt timeout covers the request up to the response head only.
#[tokio::test]
async fn slow_body_within_the_body_timeout_is_read() {
    for raw in [true, false] {
        // The body's 10 bytes come 800 ms after the head.
        let stall = Some((10, Duration::from_millis(800)));
        let (addr, _) = serve(vec![partial(0, 9, 10, 10, b"0123456789")], stall).await;
        let opts = S3Options {
            max_attempts: 1,
            attempt_timeout: Duration::from_millis(300),
            read_timeout: Duration::from_millis(300),
            body_timeout: Duration::from_secs(10),
            raw_get: raw,
            ..S3Options::default()
        };
        let s = store_at(addr, opts).await;
        assert_eq!(
            s.get_range("b", "k", 0..10, None).await.unwrap(),
            "0123456789",
            "raw {raw}"
        );
    }
}

/// A server that ignores `If-Match` or `If-Unmodified-Since` and answers with another version is
/// caught by the response's own headers, on both GET paths: `PreconditionFailed`, never the bytes.
#[tokio::test]
async fn a_response_from_another_version_is_refused_whatever_the_server_did() {
    let at = |t: &str, total: u64| {
        response(
            "206 Partial Content",
            &[
                ("Content-Range", format!("bytes 0-3/{total}")),
                ("Content-Length", "4".into()),
                ("Last-Modified", t.into()),
            ],
            b"0123",
        )
    };
    let ten = "Tue, 01 Dec 2026 10:00:00 GMT";
    let since = std::time::UNIX_EPOCH + Duration::from_secs(1_796_119_200);
    for raw in [true, false] {
        // By ETag: the response names another one.
        let (s, _) = scripted_on(raw, vec![partial(0, 3, 10, 4, b"0123")]).await;
        let e = s
            .get_range("b", "k", 0..4, Some("\"other\""))
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::PreconditionFailed(_)), "{e:?}");
        let (s, _) = scripted_on(raw, vec![partial(0, 3, 10, 4, b"0123")]).await;
        assert_eq!(
            s.get_range("b", "k", 0..4, Some("\"abc\"")).await.unwrap(),
            "0123"
        );
        // Without an ETag: same Last-Modified and size read; another time or size is refused.
        let (s, _) = scripted_on(raw, vec![at(ten, 10)]).await;
        assert_eq!(
            s.get_range_unmodified("b", "k", 0..4, Some(since), 10)
                .await
                .unwrap(),
            "0123"
        );
        for (changed, what) in [
            (at("Tue, 01 Dec 2026 10:00:01 GMT", 10), "a second later"),
            (at(ten, 11), "another size"),
        ] {
            let (s, _) = scripted_on(raw, vec![changed]).await;
            let e = s
                .get_range_unmodified("b", "k", 0..4, Some(since), 10)
                .await
                .unwrap_err();
            assert!(
                matches!(e, StoreError::PreconditionFailed(_)),
                "raw {raw}, {what}: {e:?}"
            );
        }
    }
}

/// LISTs ask for URL-encoded keys: an encoded page is decoded (control characters, `+` for a
/// space, `%2B` for a plus, empty segments), and a server that did not encode (no `EncodingType`
/// in its answer) has its keys taken as they are.
#[tokio::test]
async fn listings_are_url_encoded_and_decoded() {
    let page = |encoding: &str, keys: &[&str], prefixes: &[&str]| {
        let contents: String = keys
            .iter()
            .map(|k| {
                format!(
                    "<Contents><Key>{k}</Key><Size>1</Size><ETag>&quot;e&quot;</ETag></Contents>"
                )
            })
            .collect();
        let common: String = prefixes
            .iter()
            .map(|p| format!("<CommonPrefixes><Prefix>{p}</Prefix></CommonPrefixes>"))
            .collect();
        let body = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult><Name>b</Name><Prefix>d%2F</Prefix><Delimiter>%2F</Delimiter>{encoding}<KeyCount>{}</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}{common}</ListBucketResult>",
            keys.len() + prefixes.len()
        );
        response(
            "200 OK",
            &[("Content-Length", body.len().to_string())],
            body.as_bytes(),
        )
    };
    let req = || ListRequest {
        prefix: "d/",
        delimiter: Some("/"),
        ..ListRequest::default()
    };
    let encoded = page(
        "<EncodingType>url</EncodingType>",
        &["d%2Fctl%01x", "d%2Fa+b%2Bc", "d%2Fpct%2525"],
        &["d%2F%2F", "d%2Fsub%2F"],
    );
    let (s, _) = scripted(vec![encoded]).await;
    let got = s.list("b", req()).await.unwrap();
    let keys: Vec<&str> = got.objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(keys, ["d/ctl\x01x", "d/a b+c", "d/pct%25"]);
    assert_eq!(got.common_prefixes, ["d//", "d/sub/"]);
    let plain = page("", &["d/100%+"], &[]);
    let (s, _) = scripted(vec![plain]).await;
    let got = s.list("b", req()).await.unwrap();
    assert_eq!(got.objects[0].key, "d/100%+", "not encoded: taken as it is");
}

/// A CompleteMultipartUpload answered `NoSuchUpload` (AWS's answer to one sent again after an
/// earlier attempt completed the upload and its answer was lost) is a success when the object at
/// the key has the ETag of these parts (the MD5 of their MD5s, `-` their count); with any other
/// object there, it stays `NotFound`.
#[tokio::test]
async fn a_complete_whose_upload_is_gone_succeeds_if_the_object_is_its_own() {
    let part = ferry_store::CompletedPart {
        part_number: 1,
        etag: "\"0123456789abcdef0123456789abcdef\"".into(),
    };
    let head = |etag: &str| {
        response(
            "200 OK",
            &[
                ("Content-Length", "3000".into()),
                ("ETag", etag.into()),
                ("Last-Modified", "Mon, 07 Dec 2026 12:00:00 GMT".into()),
            ],
            b"",
        )
    };
    let gone = s3_error("404 Not Found", "NoSuchUpload");
    let ours = "\"4662bdea8654776d486072ff7074945e-1\"";
    let (s, n) = scripted(vec![gone.clone(), head(ours)]).await;
    let done = s
        .complete_multipart("b", "k", "up", vec![part.clone()])
        .await;
    assert_eq!(done.unwrap().etag.as_deref(), Some(ours));
    assert_eq!(n.load(Ordering::SeqCst), 2, "the Complete and a HEAD");
    let (s, _) = scripted(vec![gone.clone(), head(ours)]).await;
    let done = s
        .complete_multipart_if_absent("b", "k", "up", vec![part.clone()])
        .await;
    assert_eq!(done.unwrap().etag.as_deref(), Some(ours), "if absent");

    let theirs = "\"4662bdea8654776d486072ff7074945e-2\"";
    let (s, _) = scripted(vec![gone.clone(), head(theirs)]).await;
    let done = s
        .complete_multipart("b", "k", "up", vec![part.clone()])
        .await;
    assert!(matches!(done, Err(StoreError::NotFound(_))), "{done:?}");
    // The HEAD failing for a reason that may pass: that error (the Complete is tried again), not
    // a refusal of an upload that may have completed.
    let (s, _) = scripted(vec![gone.clone(), s3_error("503 Slow Down", "SlowDown")]).await;
    let done = s
        .complete_multipart("b", "k", "up", vec![part.clone()])
        .await;
    assert!(matches!(done, Err(StoreError::Throttled(_))), "{done:?}");
    // Any other failure is not looked into.
    let (s, n) = scripted(vec![s3_error("403 Forbidden", "AccessDenied"), head(ours)]).await;
    let done = s.complete_multipart("b", "k", "up", vec![part]).await;
    assert!(matches!(done, Err(StoreError::AccessDenied(_))), "{done:?}");
    assert_eq!(n.load(Ordering::SeqCst), 1);
}
