//! The health endpoint: `GET /healthz` answers `200 ok` while the process's check passes and
//! `503` with the check's reason otherwise — what kubelet's `livenessProbe` asks, in place of the
//! `livenessprobe` sidecar. Its own listener (not a path of `/metrics`), so it works with metrics
//! turned off; it shares the metrics endpoint's connection handling.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Response, StatusCode};

use crate::server::serve_with;

/// The process's health: `Err(reason)` when it cannot serve (for the CSI binaries, the Identity
/// service's Probe, and for the node kubelet's verdict on its registration).
pub type Check =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// A check that has not answered after this long fails (the reason says so): a probe that hangs
/// must not hold kubelet's probe until its own timeout without a word.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `GET /healthz` on `addr` from `check` until the task is dropped; returns the bound
/// address (useful with port 0).
pub async fn serve_health(
    addr: SocketAddr,
    check: Check,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_with(
        addr,
        Arc::new(move |req| {
            let check = check.clone();
            Box::pin(async move {
                let found = matches!(req.uri().path(), "/healthz" | "/");
                let method_ok = matches!(*req.method(), Method::GET | Method::HEAD);
                if !found || !method_ok {
                    return text(StatusCode::NOT_FOUND, "not found: try GET /healthz\n".into());
                }
                match tokio::time::timeout(CHECK_TIMEOUT, check()).await {
                    Ok(Ok(())) => text(StatusCode::OK, "ok\n".into()),
                    Ok(Err(reason)) => {
                        tracing::warn!(%reason, "healthz: not healthy");
                        text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n"))
                    }
                    Err(_) => {
                        tracing::warn!(timeout = ?CHECK_TIMEOUT, "healthz: the check did not answer");
                        text(
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("the health check did not answer in {CHECK_TIMEOUT:?}\n"),
                        )
                    }
                }
            })
        }),
    )
    .await
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// Starts the endpoint from a command-line value: `host:port` (`:9808` for every address), or
/// `off` for none. Returns the bound address; the server runs until the process ends.
pub async fn start_health(addr: &str, check: Check) -> Result<Option<SocketAddr>, String> {
    if addr == "off" {
        return Ok(None);
    }
    let with_host;
    let addr_full = if addr.starts_with(':') {
        with_host = format!("0.0.0.0{addr}");
        with_host.as_str()
    } else {
        addr
    };
    let sock: SocketAddr = addr_full
        .parse()
        .map_err(|_| format!("health address {addr:?} is not host:port, :port (or \"off\")"))?;
    let (bound, _task) = serve_health(sock, check)
        .await
        .map_err(|e| format!("binding the health endpoint {addr}: {e}"))?;
    tracing::info!(addr = %bound, "health at /healthz");
    Ok(Some(bound))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::tests::get;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn answers_ok_then_the_reason() {
        let healthy = Arc::new(AtomicBool::new(true));
        let h = healthy.clone();
        let check: Check = Arc::new(move || {
            let ok = h.load(Ordering::SeqCst);
            Box::pin(async move {
                if ok {
                    Ok(())
                } else {
                    Err("cannot open /dev/fuse".to_string())
                }
            })
        });
        let (addr, task) = serve_health("127.0.0.1:0".parse().unwrap(), check)
            .await
            .unwrap();
        let req = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        let resp = get(addr, req).await;
        assert!(resp.starts_with("HTTP/1.1 200 OK"), "{resp}");
        assert!(resp.ends_with("\r\n\r\nok\n"), "{resp}");
        healthy.store(false, Ordering::SeqCst);
        let resp = get(addr, req).await;
        assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
        assert!(resp.ends_with("cannot open /dev/fuse\n"), "{resp}");
        let resp = get(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_that_hangs_fails() {
        let check: Check = Arc::new(|| Box::pin(std::future::pending()));
        let (addr, task) = serve_health("127.0.0.1:0".parse().unwrap(), check)
            .await
            .unwrap();
        let resp = get(
            addr,
            "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
        assert!(resp.contains("did not answer"), "{resp}");
        task.abort();
    }

    #[tokio::test]
    async fn off_and_bad_addresses() {
        let check: Check = Arc::new(|| Box::pin(async { Ok(()) }));
        assert_eq!(start_health("off", check.clone()).await, Ok(None));
        assert!(start_health("9808", check.clone()).await.is_err());
        let bound = start_health("127.0.0.1:0", check).await.unwrap().unwrap();
        assert!(bound.ip().is_loopback());
    }
}
