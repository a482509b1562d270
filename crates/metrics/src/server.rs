//! The `/metrics` endpoint, on hyper (HTTP/1.1; already in the tree through tonic), and the
//! connection handling it shares with the health endpoint ([`crate::health`]).
//!
//! A scrape encodes the registry by reading the metrics' atomics: it never blocks a recorder.
//! Prometheus text (0.0.4) unless the scraper asks for OpenMetrics. An `accept` that fails (e.g.
//! out of file descriptors, which persists) is retried after a pause that doubles up to a
//! second, never in a busy loop.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ACCEPT, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;

use crate::registry::{OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE};

/// First pause after a failed `accept`; it doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// A connection has this long to send its request head, and this long in all.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// The answer to one request of an endpoint.
pub(crate) type Reply = Pin<Box<dyn Future<Output = Response<Full<Bytes>>> + Send>>;

/// What an endpoint does with a request.
pub(crate) type Handler = Arc<dyn Fn(Request<Incoming>) -> Reply + Send + Sync>;

/// Serves `GET /metrics` from the process-wide registry on `addr` until the task is dropped.
/// Returns the bound address (useful with port 0).
pub async fn serve(addr: SocketAddr) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_with(
        addr,
        Arc::new(|req| Box::pin(async move { handle(req).await.unwrap_or_else(|e| match e {}) })),
    )
    .await
}

/// How long a port in use is tried again: a node plugin that just handed its mounts over exits at
/// once, but its listeners close only as the process ends, while the successor binds the same
/// ports on the host network right after the handover.
const BIND_RETRY: std::time::Duration = std::time::Duration::from_secs(10);

/// Binds `addr`, trying a port in use again every 100 ms for up to [`BIND_RETRY`].
async fn bind_when_free(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let deadline = tokio::time::Instant::now() + BIND_RETRY;
    let mut told = false;
    loop {
        match TcpListener::bind(addr).await {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < deadline =>
            {
                if !std::mem::replace(&mut told, true) {
                    tracing::info!(%addr, "port in use (a predecessor exiting?); trying again for up to 10 s");
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// Serves `handler` on `addr` until the task is dropped; returns the bound address.
pub(crate) async fn serve_with(
    addr: SocketAddr,
    handler: Handler,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = bind_when_free(addr).await?;
    let local = listener.local_addr()?;
    let listener = std::sync::Arc::new(listener);
    let task = tokio::spawn(accept_loop(
        move || {
            let l = listener.clone();
            async move { l.accept().await.map(|(stream, _)| stream) }
        },
        handler,
    ));
    Ok((local, task))
}

/// Most connections the endpoint serves at once.
const MAX_CONNECTIONS: usize = 16;

/// Accepts connections from `accept` and serves each on its own task; on an error waits
/// (doubling from [`MIN_BACKOFF`] to [`MAX_BACKOFF`]) before the next `accept`.
async fn accept_loop<A, F, S>(mut accept: A, handler: Handler)
where
    A: FnMut() -> F,
    F: Future<Output = std::io::Result<S>>,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut backoff = MIN_BACKOFF;
    // Connections served at once: a scraper flood must not take the descriptors the process's
    // mounts, cache and CSI socket need (it waits in the listen backlog instead).
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        match accept().await {
            Ok(stream) => {
                backoff = MIN_BACKOFF;
                let handler = handler.clone();
                tokio::spawn(async move {
                    serve_connection(stream, handler).await;
                    drop(slot);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "metrics endpoint: accept failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

async fn serve_connection<S>(stream: S, handler: Handler)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| {
        let reply = handler(req);
        async move { Ok::<_, Infallible>(reply.await) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout(CONNECTION_TIMEOUT, conn).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "metrics endpoint: connection failed"),
        Err(_) => tracing::debug!("metrics endpoint: connection timed out"),
    }
}

async fn handle(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let path_ok = matches!(req.uri().path(), "/metrics" | "/");
    let method_ok = matches!(*req.method(), Method::GET | Method::HEAD);
    if !path_ok || !method_ok {
        let mut resp = Response::new(Full::new(Bytes::from_static(
            b"not found: try GET /metrics\n",
        )));
        *resp.status_mut() = StatusCode::NOT_FOUND;
        return Ok(resp);
    }
    let openmetrics = req
        .headers()
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|v| {
            // `application/openmetrics-text; version=1.0.0; q=0.9`, but not with `q=0`
            let mut parts = v.split(';').map(str::trim);
            parts.next() == Some("application/openmetrics-text")
                && !parts.any(|p| matches!(p, "q=0" | "q=0.0" | "q=0.00" | "q=0.000"))
        });
    let registry = crate::registry();
    let (body, content_type) = if openmetrics {
        (registry.encode_openmetrics(), OPENMETRICS_CONTENT_TYPE)
    } else {
        (registry.encode_text(), TEXT_CONTENT_TYPE)
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    Ok(resp)
}

/// Starts the endpoint from a command-line value: `host:port`, or `off` for none. Returns the bound
/// address; the server runs until the process ends.
pub async fn start(addr: &str) -> Result<Option<SocketAddr>, String> {
    if addr == "off" {
        return Ok(None);
    }
    let sock: SocketAddr = addr
        .parse()
        .map_err(|_| format!("metrics address {addr:?} is not host:port (or \"off\")"))?;
    let (bound, _task) = serve(sock)
        .await
        .map_err(|e| format!("binding the metrics endpoint {addr}: {e}"))?;
    tracing::info!(addr = %bound, "metrics at /metrics");
    Ok(Some(bound))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[tokio::test]
    async fn a_port_a_predecessor_still_holds_is_bound_once_it_lets_go() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(held);
        });
        let (bound, _task) = serve(addr).await.expect("bound after the holder let go");
        assert_eq!(bound, addr);
        release.join().unwrap();
    }
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    pub(crate) async fn get(addr: SocketAddr, request: &str) -> String {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(request.as_bytes()).await.unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).await.unwrap();
        resp
    }

    #[tokio::test]
    async fn answers_metrics_requests() {
        crate::metrics().cache.passthrough_opens.inc();
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
        // HTTP/1.0 and read to the end, as the benchmarks' scrapers do.
        let resp = get(addr, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await;
        assert!(resp.starts_with("HTTP/1.0 200 OK"), "{resp}");
        assert!(
            resp.contains("content-type: text/plain; version=0.0.4"),
            "{resp}"
        );
        assert!(
            resp.contains("\nferry_cache_passthrough_opens_total "),
            "{resp}"
        );
        let resp = get(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(
            resp.contains("content-type: application/openmetrics-text"),
            "{resp}"
        );
        assert!(resp.ends_with("# EOF\n"), "{resp}");
        // Refused with q=0: the text format.
        let resp = get(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain, application/openmetrics-text; q=0\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(
            resp.contains("content-type: text/plain; version=0.0.4"),
            "{resp}"
        );
        let resp = get(
            addr,
            "GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_accept_is_retried_with_a_pause_not_a_spin() {
        let calls = AtomicUsize::new(0);
        let looping = accept_loop(
            || {
                let n = calls.fetch_add(1, Ordering::Relaxed);
                assert!(n < 1000, "accept retried in a busy loop");
                async {
                    Err::<tokio::net::TcpStream, _>(std::io::Error::from_raw_os_error(libc::EMFILE))
                }
            },
            Arc::new(|_| unreachable!("no connection is accepted")),
        );
        // A minute of (paused, auto-advanced) time: ~7 doublings from 10 ms, then once a second.
        assert!(tokio::time::timeout(Duration::from_secs(60), looping)
            .await
            .is_err());
        let n = calls.load(Ordering::Relaxed);
        assert!((55..=70).contains(&n), "{n} accepts in a minute");
    }
}
