//! A TCP forwarder on loopback that adds a fixed one-way delay in each direction, standing in for
//! network round-trip time (this kernel has no netem).
//!
//! Plain threads, no async runtime: every accepted connection gets its own upstream connection
//! and, per direction, a reader thread and a writer thread joined by a bounded queue of
//! timestamped chunks. The reader stamps each chunk with `arrival + delay`; the writer sleeps until
//! that instant and forwards it, so order is kept within a connection, chunks in flight overlap
//! (the delay is latency, not a bandwidth cap), and connections never wait on each other. A round
//! trip through the proxy therefore grows by `2 × delay` = the configured RTT.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;

/// Bytes read from a socket at a time.
const CHUNK: usize = 256 * 1024;
/// Chunks queued per direction before the reader blocks (bounds memory: 256 × 256 KiB = 64 MiB,
/// far above the bandwidth-delay product at loopback speed and tens of milliseconds).
const QUEUE: usize = 256;

/// A chunk (a buffer and how many of its bytes are data) and the instant it may be forwarded;
/// `None` marks the end of the stream.
type Stamped = Option<(Instant, Vec<u8>, usize)>;

/// A running delay proxy; it stops accepting when dropped (open connections drain by themselves).
pub struct DelayProxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    connections: Arc<AtomicU64>,
    /// Bytes forwarded from the server to the clients (GET bodies, headers, listings).
    down: Arc<AtomicU64>,
}

impl DelayProxy {
    /// Listens on `127.0.0.1:<free port>` and forwards every connection to `upstream`, delaying
    /// each chunk by `one_way` in each direction.
    pub fn start(upstream: SocketAddr, one_way: Duration) -> anyhow::Result<DelayProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the delay proxy")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(AtomicU64::new(0));
        let down = Arc::new(AtomicU64::new(0));
        let (stop2, conns2, down2) = (stop.clone(), connections.clone(), down.clone());
        thread::Builder::new()
            .name("proxy-accept".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    conns2.fetch_add(1, Ordering::Relaxed);
                    let down = down2.clone();
                    let _ = thread::Builder::new()
                        .name("proxy-conn".into())
                        .spawn(move || {
                            if let Err(e) = forward(client, upstream, one_way, down) {
                                eprintln!("delay proxy: connection failed: {e:#}");
                            }
                        });
                }
            })?;
        Ok(DelayProxy {
            addr,
            stop,
            connections,
            down,
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Bytes forwarded from the server to the clients so far.
    #[allow(dead_code)] // used by ferry-bench-cache only
    pub fn bytes_down(&self) -> u64 {
        self.down.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

/// Connects upstream and runs both directions until each side has closed.
fn forward(
    client: TcpStream,
    upstream: SocketAddr,
    one_way: Duration,
    down: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let server = TcpStream::connect(upstream).context("connecting upstream")?;
    for s in [&client, &server] {
        s.set_nodelay(true)?;
    }
    let up = pump(client.try_clone()?, server.try_clone()?, one_way, None)?;
    let down = pump(server, client, one_way, Some(down))?;
    for h in up.into_iter().chain(down) {
        let _ = h.join();
    }
    Ok(())
}

/// One direction: a reader thread stamping chunks and a writer thread releasing them on time.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    delay: Duration,
    counter: Option<Arc<AtomicU64>>,
) -> anyhow::Result<[thread::JoinHandle<()>; 2]> {
    let (tx, rx): (SyncSender<Stamped>, Receiver<Stamped>) = sync_channel(QUEUE);
    // Buffers go back from the writer to the reader once forwarded, instead of a fresh zeroed
    // 256 KiB allocation per read (above glibc's mmap threshold: page faults per chunk). The
    // proxy shares the two cores with the mounter being measured.
    let (give_back, spare) = sync_channel::<Vec<u8>>(QUEUE + 1);
    let to_for_reader = to.try_clone()?;
    let reader = thread::Builder::new()
        .name("proxy-rd".into())
        .spawn(move || {
            loop {
                let mut buf = spare.try_recv().unwrap_or_else(|_| vec![0u8; CHUNK]);
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if let Some(c) = &counter {
                            c.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        if tx.send(Some((Instant::now() + delay, buf, n))).is_err() {
                            // The writer is gone (peer reset): stop reading and close our side.
                            let _ = from.shutdown(Shutdown::Both);
                            let _ = to_for_reader.shutdown(Shutdown::Both);
                            return;
                        }
                    }
                }
            }
            let _ = tx.send(None);
        })?;
    let writer = thread::Builder::new()
        .name("proxy-wr".into())
        .spawn(move || {
            while let Ok(Some((due, data, n))) = rx.recv() {
                let now = Instant::now();
                if due > now {
                    thread::sleep(due - now);
                }
                if to.write_all(&data[..n]).is_err() {
                    let _ = to.shutdown(Shutdown::Both);
                    return;
                }
                let _ = give_back.try_send(data);
            }
            // The source closed (or failed): pass the half-close on after the delay as well.
            if !delay.is_zero() {
                thread::sleep(delay);
            }
            let _ = to.shutdown(Shutdown::Write);
        })?;
    Ok([reader, writer])
}
