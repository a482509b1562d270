//! [`FaultProxy`]: an HTTP forwarder on loopback that sits between an S3 client and a real S3
//! server and breaks chosen responses the way a flaky network or an overloaded server does:
//! `503 SlowDown`, `500 InternalError`, a body cut off mid-way (connection closed), a body shorter
//! than the range asked for (with a matching `Content-Length`, so only a range check can notice),
//! or no answer at all.
//!
//! Faults happen on the wire, below the client's retry and body checks, so a test sees exactly what
//! the whole stack (SDK retries, [`ferry_s3::S3Store`]'s body checks, the filesystem) makes of
//! them. Plain threads; every client connection carries one request (the proxy asks the upstream
//! for `Connection: close` and closes the client side after the response), which costs a connect
//! per request on loopback and keeps the forwarding free of HTTP framing for request bodies.
//!
//! Which requests break is deterministic: the n-th request matching the plan's methods breaks when
//! `n` is a multiple of `every`, with the plan's faults taken in turn.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

/// One way to break a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// `503 SlowDown` (throttling), without reaching the server.
    SlowDown,
    /// `500 InternalError`, without reaching the server.
    InternalError,
    /// The server's response with the connection closed half-way through the body (a 2xx with a
    /// body only; other responses pass unchanged).
    CutBody,
    /// The server's response with only half of the body and `Content-Length` rewritten to match
    /// (`Content-Range` unchanged): a short body only a range check catches (2xx GETs only).
    ShortBody,
    /// The request is read and never answered (the connection stays open until the proxy stops).
    Hang,
}

/// Which requests break and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultPlan {
    /// HTTP methods the plan applies to (`"GET"`, `"HEAD"`, ...); others always pass.
    pub methods: Vec<String>,
    /// Faults used in turn.
    pub faults: Vec<Fault>,
    /// Every `every`-th matching request breaks (1 = all of them).
    pub every: u64,
    /// Only requests with a `Range` header match (an object's ranged GET; not a LIST).
    pub ranged_only: bool,
}

impl FaultPlan {
    /// Every matching request of `methods` breaks with `fault`.
    pub fn always(methods: &[&str], fault: Fault) -> FaultPlan {
        FaultPlan {
            methods: methods.iter().map(|m| m.to_string()).collect(),
            faults: vec![fault],
            every: 1,
            ranged_only: false,
        }
    }

    /// This plan for ranged requests only (an object's ranged GET; not a LIST).
    pub fn ranged(self) -> FaultPlan {
        FaultPlan {
            ranged_only: true,
            ..self
        }
    }
}

#[derive(Debug, Default)]
struct State {
    plan: Option<FaultPlan>,
    matched: u64,
    injected: Vec<Fault>,
    requests: u64,
}

/// A running fault proxy; it stops (and drops hung connections) when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    state: Arc<Mutex<State>>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:<free port>` and forwards to `upstream`, breaking nothing until
    /// [`FaultProxy::set_plan`].
    pub fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(Mutex::new(State::default()));
        let (stop2, state2) = (stop.clone(), state.clone());
        thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let (stop, state) = (stop2.clone(), state2.clone());
                    let _ = thread::Builder::new()
                        .name("fault-proxy-conn".into())
                        .spawn(move || {
                            let _ = serve(client, upstream, &state, &stop);
                        });
                }
            })?;
        Ok(FaultProxy { addr, stop, state })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the plan (`None`: pass everything) and restarts its request count.
    pub fn set_plan(&self, plan: Option<FaultPlan>) {
        let mut s = lock(&self.state);
        s.plan = plan;
        s.matched = 0;
    }

    /// Every fault injected so far, in order.
    pub fn injected(&self) -> Vec<Fault> {
        lock(&self.state).injected.clone()
    }

    /// Requests seen so far.
    pub fn requests(&self) -> u64 {
        lock(&self.state).requests
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reads until the end of an HTTP head; returns (head, bytes read past it).
fn read_head(s: &mut TcpStream) -> io::Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(i + 4);
            return Ok(Some((buf, rest)));
        }
        match s.read(&mut chunk)? {
            0 => return Ok(None),
            n => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The head with header `name` removed (case-insensitive) and `extra` lines added at its end.
fn rewrite_head(head: &[u8], name: &str, extra: &[String]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::new();
    for line in text.trim_end_matches("\r\n").split("\r\n") {
        let is_name = line
            .split_once(':')
            .is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case(name));
        if !is_name {
            out.push_str(line);
            out.push_str("\r\n");
        }
    }
    for e in extra {
        out.push_str(e);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    out.into_bytes()
}

fn header(head: &[u8], name: &str) -> Option<String> {
    String::from_utf8_lossy(head)
        .split("\r\n")
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim().to_owned())
}

fn error_response(status: &str, code: &str, head_request: bool) -> Vec<u8> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>injected by FaultProxy</Message><RequestId>FAULT</RequestId></Error>"
    );
    let len = if head_request { 0 } else { body.len() };
    let mut r = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    );
    if !head_request {
        r.push_str(&body);
    }
    r.into_bytes()
}

/// Serves one client connection (one request).
fn serve(
    mut client: TcpStream,
    upstream: SocketAddr,
    state: &Mutex<State>,
    stop: &AtomicBool,
) -> io::Result<()> {
    let Some((head, rest)) = read_head(&mut client)? else {
        return Ok(());
    };
    let method = String::from_utf8_lossy(&head)
        .split(' ')
        .next()
        .unwrap_or("")
        .to_owned();
    let ranged = header(&head, "range").is_some();
    let fault = {
        let mut s = lock(state);
        s.requests += 1;
        let matches = |p: &FaultPlan| p.methods.contains(&method) && (ranged || !p.ranged_only);
        let fault = match &s.plan {
            Some(p) if matches(p) && !p.faults.is_empty() => {
                let every = p.every.max(1);
                let n = s.matched;
                n.is_multiple_of(every)
                    .then(|| p.faults[((n / every) as usize) % p.faults.len()])
            }
            _ => None,
        };
        if s.plan.as_ref().is_some_and(matches) {
            s.matched += 1;
        }
        fault
    };
    let is_head = method == "HEAD";
    match fault {
        Some(f @ Fault::SlowDown) => {
            lock(state).injected.push(f);
            client.write_all(&error_response("503 Slow Down", "SlowDown", is_head))?;
            return client.shutdown(Shutdown::Both);
        }
        Some(f @ Fault::InternalError) => {
            lock(state).injected.push(f);
            client.write_all(&error_response(
                "500 Internal Server Error",
                "InternalError",
                is_head,
            ))?;
            return client.shutdown(Shutdown::Both);
        }
        Some(f @ Fault::Hang) => {
            lock(state).injected.push(f);
            // Hold the connection open, answering nothing, until the client gives up or we stop.
            client.set_read_timeout(Some(Duration::from_millis(200)))?;
            let mut sink = [0u8; 4096];
            while !stop.load(Ordering::Relaxed) {
                match client.read(&mut sink) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => break,
                }
            }
            return Ok(());
        }
        _ => {}
    }

    let mut server = TcpStream::connect(upstream)?;
    server.write_all(&rewrite_head(
        &head,
        "connection",
        &["Connection: close".to_owned()],
    ))?;
    server.write_all(&rest)?;
    // The request body (if any) flows on while the response comes back.
    let (mut c2, mut s2) = (client.try_clone()?, server.try_clone()?);
    let up = thread::spawn(move || {
        let _ = io::copy(&mut c2, &mut s2);
        let _ = s2.shutdown(Shutdown::Write);
    });
    let result = respond(&mut server, &mut client, fault, is_head, state);
    let _ = client.shutdown(Shutdown::Both);
    let _ = server.shutdown(Shutdown::Both);
    let _ = up.join();
    result
}

/// Forwards the server's response, breaking its body if `fault` says so.
fn respond(
    server: &mut TcpStream,
    client: &mut TcpStream,
    fault: Option<Fault>,
    is_head: bool,
    state: &Mutex<State>,
) -> io::Result<()> {
    let Some((head, mut body)) = read_head(server)? else {
        return Ok(());
    };
    let status_ok = String::from_utf8_lossy(&head)
        .split(' ')
        .nth(1)
        .is_some_and(|c| c.starts_with('2'));
    let length: Option<usize> = header(&head, "content-length").and_then(|v| v.parse().ok());
    let breakable = status_ok && !is_head && length.is_some_and(|l| l >= 2);
    match (fault, length) {
        (Some(f @ (Fault::CutBody | Fault::ShortBody)), Some(len)) if breakable => {
            // Read the whole body, then send half of it.
            while body.len() < len {
                let mut chunk = vec![0u8; 64 * 1024];
                match server.read(&mut chunk)? {
                    0 => break,
                    n => body.extend_from_slice(&chunk[..n]),
                }
            }
            let half = len / 2;
            lock(state).injected.push(f);
            if f == Fault::ShortBody {
                client.write_all(&rewrite_head(
                    &head,
                    "content-length",
                    &[format!("Content-Length: {half}")],
                ))?;
            } else {
                client.write_all(&head)?;
            }
            client.write_all(&body[..half.min(body.len())])?;
            Ok(())
        }
        _ => {
            client.write_all(&head)?;
            client.write_all(&body)?;
            io::copy(server, client)?;
            Ok(())
        }
    }
}
