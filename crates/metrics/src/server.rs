//! The `/metrics` endpoint: a minimal HTTP/1.1 server over tokio, one response per connection.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::global;

/// Serves `GET /metrics` from the global registry on `addr` until the task is dropped. Returns the
/// bound address (useful with port 0).
pub async fn serve(addr: SocketAddr) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut len = 0;
                // Read the request head (bounded); the body, if any, is ignored.
                while len < buf.len() {
                    match tokio::time::timeout(
                        std::time::Duration::from_secs(5),
                        conn.read(&mut buf[len..]),
                    )
                    .await
                    {
                        Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                        Ok(Ok(n)) => len += n,
                    }
                    if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let head = String::from_utf8_lossy(&buf[..len]);
                let (status, body) =
                    if head.starts_with("GET /metrics ") || head.starts_with("GET / ") {
                        ("200 OK", global().render())
                    } else {
                        ("404 Not Found", "not found: try /metrics\n".to_string())
                    };
                let resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(resp.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    Ok((local, task))
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
mod tests {
    use super::*;

    #[tokio::test]
    async fn answers_metrics_requests() {
        global()
            .counter("ferry_test_server_total", "Test.", &[])
            .inc();
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 200 OK"), "{resp}");
        assert!(resp.contains("ferry_test_server_total 1"), "{resp}");
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /other HTTP/1.1\r\n\r\n").await.unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
        task.abort();
    }
}
