//! One tower layer that logs every gRPC call once: method, status code, message and duration.
//!
//! Request and response bodies are never logged, so secrets (NodePublish `secrets`, tokens in the
//! volume context) cannot reach the log from here. Successful calls are logged at info, failed
//! and cancelled ones at warn.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::Code;
use tower::{Layer, Service};

/// The layer: `Server::builder().layer(RpcLogLayer)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RpcLogLayer;

impl<S> Layer<S> for RpcLogLayer {
    type Service = RpcLog<S>;
    fn layer(&self, inner: S) -> RpcLog<S> {
        RpcLog { inner }
    }
}

/// The service the layer wraps around the router.
#[derive(Debug, Clone)]
pub struct RpcLog<S> {
    inner: S,
}

/// Decodes the percent-encoding of a `grpc-message` header.
fn decode_message(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            if let Some(b) = raw
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl<S, B, RB> Service<http::Request<B>> for RpcLog<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let mut entry = LogEntry {
            method: req
                .uri()
                .path()
                .rsplit('/')
                .next()
                .unwrap_or("")
                .to_string(),
            start: Instant::now(),
            done: false,
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            match &res {
                Ok(resp) => {
                    // Errors come as trailers-only responses: the status is in the headers. A
                    // success carries its status in the trailers, which a unary handler sets to OK.
                    let code = resp
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|s| s.parse::<i32>().ok())
                        .map(Code::from_i32)
                        .unwrap_or(Code::Ok);
                    let message = resp
                        .headers()
                        .get("grpc-message")
                        .and_then(|v| v.to_str().ok())
                        .map(decode_message)
                        .unwrap_or_default();
                    entry.finish(code, &message);
                }
                Err(e) => entry.finish(Code::Unknown, &format!("transport error: {e}")),
            }
            res
        })
    }
}

/// One RPC's log line, written exactly once: when the response is ready, or (if the client gave up
/// and the call was dropped) with code `Cancelled`.
struct LogEntry {
    method: String,
    start: Instant,
    done: bool,
}

impl LogEntry {
    fn finish(&mut self, code: Code, message: &str) {
        self.done = true;
        let ms = self.start.elapsed().as_secs_f64() * 1000.0;
        let code_name = format!("{code:?}");
        if code == Code::Ok {
            tracing::info!(rpc = %self.method, code = %code_name, ms = format_args!("{ms:.1}"), "rpc");
        } else {
            tracing::warn!(rpc = %self.method, code = %code_name, ms = format_args!("{ms:.1}"), %message, "rpc failed");
        }
    }
}

impl Drop for LogEntry {
    fn drop(&mut self) {
        if !self.done {
            self.finish(Code::Cancelled, "the client cancelled the call");
        }
    }
}

/// Installs the process's tracing subscriber: text to stderr (coloured on a terminal only, see
/// [`colors_on_stderr`]), filtered by `filter` (an `EnvFilter` directive such as `info` or
/// `ferry_fs=debug,info`).
pub fn init(filter: &str) -> Result<(), String> {
    init_colored(filter, colors_on_stderr())
}

/// [`init`], with ANSI colours or not.
pub fn init_colored(filter: &str, ansi: bool) -> Result<(), String> {
    let filter = self::filter(filter)?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init()
        .map_err(|e| e.to_string())
}

/// Whether the log may be coloured: only on a terminal, and not when `NO_COLOR` is set
/// (no-color.org). A pod's log (kubelet's files, `kubectl logs`), a pipe or a file gets plain
/// text, not escape codes.
pub fn colors_on_stderr() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// The binaries' log filter from an `EnvFilter` directive; tests that search logs for secrets
/// build theirs here too, so they log what the binaries would. (The AWS SDK's own trace output
/// redacts `Authorization` and `x-amz-security-token` and never prints request or response
/// bodies; `e2e/tests/creds.rs` holds that to be true at trace level.)
pub fn filter(filter: &str) -> Result<tracing_subscriber::EnvFilter, String> {
    tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|e| format!("invalid log filter {filter:?}: {e}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn decodes_grpc_message() {
        assert_eq!(super::decode_message("a%20b%25c"), "a b%c");
        assert_eq!(super::decode_message("bad%zz"), "bad%zz");
    }
}
