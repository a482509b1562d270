//! kubelet's plugin-registration client dials the registration socket with its path as the gRPC
//! target (`grpc.DialContext(ctx, "/var/lib/kubelet/plugins_registry/<name>-reg.sock", ...)` in
//! `pkg/kubelet/pluginmanager/operationexecutor`), so grpc-go sends that path as the HTTP/2
//! `:authority`. h2, under tonic, refuses a request whose `:authority` is not a URI authority
//! with `RST_STREAM(PROTOCOL_ERROR)` (hyperium/h2#487, open), and kubelet never registers the
//! driver. Kubernetes made its CSI client send `localhost` for this reason (kubernetes#112597),
//! not its registration client — a real kubelet found this; our own tonic client did not.
//!
//! [`localhost_authority`] puts a connection behind a rewriter that decodes each HEADERS block the
//! client sends (HPACK, with the client's dynamic table), sets `:authority` to `localhost`, and
//! encodes it again for the server (an encoder whose table the server's decoder mirrors). Every
//! other frame, and everything the server sends, passes unchanged.

use std::io;

use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};

/// The HTTP/2 client connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may announce; our frames never exceed it.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this is refused (kubelet's are a few hundred bytes).
const MAX_BLOCK: usize = 64 * 1024;
/// The largest decoded header list (names + values + 32 bytes each, as RFC 7541 counts them):
/// hyper's default, so nothing h2 would accept is refused here, and a block of references to one
/// large table entry cannot expand without bound.
const MAX_HEADER_LIST: usize = 16 * 1024;
/// The dynamic table size h2 announces (SETTINGS_HEADER_TABLE_SIZE default): a client's size
/// update above it is an error, as it would be for h2.
const TABLE_SIZE: usize = 4096;
/// How long a connection may stay silent (kubelet's calls take milliseconds): a stuck or idle
/// client does not hold its tasks forever.
const IDLE: std::time::Duration = std::time::Duration::from_secs(60);
/// Connections served at once; more wait for their turn in the accept queue.
pub const MAX_CONNECTIONS: usize = 16;

/// Serves `client` through a rewriter; the returned stream is what the gRPC server reads.
/// `permit` (one of [`MAX_CONNECTIONS`]) is held until the client's side ends.
pub fn localhost_authority<S>(client: S, permit: tokio::sync::OwnedSemaphorePermit) -> DuplexStream
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (server_side, ours) = tokio::io::duplex(64 * 1024);
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let (mut from_server, mut to_server) = tokio::io::split(ours);
    tokio::spawn(async move {
        let _permit = permit;
        if let Err(e) = rewrite(&mut from_client, &mut to_server).await {
            tracing::debug!(error = %e, "registration connection: client side ended");
        }
        let _ = to_server.shutdown().await;
    });
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
        let _ = to_client.shutdown().await;
    });
    server_side
}

/// Copies the client's frames to `out`, HEADERS blocks rewritten; ends at the client's EOF.
async fn rewrite<R, W>(input: &mut R, out: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; PREFACE.len()];
    timed(input.read_exact(&mut preface)).await?;
    if preface != PREFACE {
        return Err(invalid("not an HTTP/2 connection preface"));
    }
    out.write_all(&preface).await?;
    let mut decoder = Decoder::new();
    decoder.set_max_allowed_table_size(TABLE_SIZE);
    let mut encoder = Encoder::new();
    // A HEADERS frame whose block continues in CONTINUATION frames: (stream, flags, block).
    let mut pending: Option<(u32, u8, Vec<u8>)> = None;
    loop {
        let mut head = [0u8; 9];
        match timed(input.read_exact(&mut head)).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        if len > MAX_BLOCK {
            return Err(invalid("frame too large"));
        }
        let mut payload = vec![0u8; len];
        timed(input.read_exact(&mut payload)).await?;
        let block_done = match (kind, pending.as_mut()) {
            (HEADERS, None) => {
                let fragment = header_fragment(flags, &payload)?;
                pending = Some((stream, flags, fragment.to_vec()));
                flags & END_HEADERS != 0
            }
            (CONTINUATION, Some((s, _, block))) if *s == stream => {
                block.extend_from_slice(&payload);
                if block.len() > MAX_BLOCK {
                    return Err(invalid("header block too large"));
                }
                flags & END_HEADERS != 0
            }
            (_, Some(_)) => return Err(invalid("a frame inside a header block")),
            _ => {
                out.write_all(&head).await?;
                out.write_all(&payload).await?;
                continue;
            }
        };
        if block_done {
            let (stream, flags, block) = pending.take().expect("a pending block");
            let headers = decode(&mut decoder, &block)?;
            // Only a request's block carries :authority; a trailer block passes as it came.
            let headers = if headers.iter().any(|(n, _)| n == b":method") {
                with_localhost(headers)
            } else {
                headers
            };
            let encoded = encoder.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])));
            write_block(out, stream, flags & END_STREAM, &encoded).await?;
        }
    }
}

/// A header block decoded, refused once the list passes [`MAX_HEADER_LIST`].
fn decode(decoder: &mut Decoder, block: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut headers = Vec::new();
    let mut size = 0usize;
    decoder
        .decode_with_cb(block, |n, v| {
            size = size.saturating_add(n.len() + v.len() + 32);
            if size <= MAX_HEADER_LIST {
                headers.push((n.into_owned(), v.into_owned()));
            }
        })
        .map_err(|e| invalid(&format!("HPACK: {e}")))?;
    if size > MAX_HEADER_LIST {
        return Err(invalid("header list too large"));
    }
    Ok(headers)
}

/// `read` bounded by [`IDLE`].
async fn timed<T>(read: impl std::future::Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(IDLE, read)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the client was idle"))?
}

/// The header block fragment of a HEADERS frame: padding and priority fields removed.
fn header_fragment(flags: u8, payload: &[u8]) -> io::Result<&[u8]> {
    let mut start = 0;
    let mut end = payload.len();
    if flags & PADDED != 0 {
        let pad = *payload
            .first()
            .ok_or_else(|| invalid("empty padded frame"))? as usize;
        start = 1;
        end = end
            .checked_sub(pad)
            .ok_or_else(|| invalid("padding longer than the frame"))?;
    }
    if flags & PRIORITY != 0 {
        start += 5;
    }
    payload
        .get(start..end)
        .ok_or_else(|| invalid("HEADERS frame too short"))
}

/// `headers` with `:authority` set to `localhost` (in place, or first if absent: pseudo-headers
/// precede regular ones).
fn with_localhost(mut headers: Vec<(Vec<u8>, Vec<u8>)>) -> Vec<(Vec<u8>, Vec<u8>)> {
    match headers.iter_mut().find(|(n, _)| n == b":authority") {
        Some((_, v)) => *v = b"localhost".to_vec(),
        None => headers.insert(0, (b":authority".to_vec(), b"localhost".to_vec())),
    }
    headers
}

/// One header block as a HEADERS frame and as many CONTINUATION frames as its size needs.
async fn write_block<W: AsyncWrite + Unpin>(
    out: &mut W,
    stream: u32,
    end_stream: u8,
    block: &[u8],
) -> io::Result<()> {
    let chunks: Vec<&[u8]> = if block.is_empty() {
        vec![block]
    } else {
        block.chunks(MAX_FRAME).collect()
    };
    let last = chunks.len() - 1;
    for (i, chunk) in chunks.into_iter().enumerate() {
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        let mut flags = if i == 0 { end_stream } else { 0 };
        if i == last {
            flags |= END_HEADERS;
        }
        let len = (chunk.len() as u32).to_be_bytes();
        let mut head = [0u8; 9];
        head[..3].copy_from_slice(&len[1..]);
        head[3] = kind;
        head[4] = flags;
        head[5..].copy_from_slice(&stream.to_be_bytes());
        out.write_all(&head).await?;
        out.write_all(chunk).await?;
    }
    Ok(())
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    }

    /// Frames back from bytes: (kind, flags, stream, payload).
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while !b.is_empty() {
            let len = u32::from_be_bytes([0, b[0], b[1], b[2]]) as usize;
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            out.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        out
    }

    #[tokio::test]
    async fn authority_becomes_localhost_across_continuations_and_padding() {
        let path = b"/var/lib/kubelet/plugins_registry/s3.csi.ferry.dev-reg.sock";
        let mut client = Encoder::new();
        let first = client.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", &path[..]),
            (b"content-type", b"application/grpc"),
        ]);
        // The second request reuses the client's dynamic table (the path as an indexed field).
        let second = client.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (
                b":path",
                b"/pluginregistration.Registration/NotifyRegistrationStatus",
            ),
            (b":authority", &path[..]),
        ]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS, passed through
                                             // HEADERS split in two: padded, with priority, then a CONTINUATION.
        let (a, b) = first.split_at(first.len() / 2);
        let mut padded = vec![3u8];
        padded.extend([0, 0, 0, 0, 16]);
        padded.extend(a);
        padded.extend([0, 0, 0]);
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &padded));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        input.extend(frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0])); // DATA
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &second));
        let mut out = Vec::new();
        rewrite(&mut &input[..], &mut out).await.unwrap();

        assert_eq!(&out[..PREFACE.len()], PREFACE);
        let got = frames(&out[PREFACE.len()..]);
        assert_eq!(got.len(), 4);
        assert_eq!((got[0].0, got[0].3.len()), (0x4, 0));
        assert_eq!(
            (got[2].0, got[2].1, &got[2].3[..]),
            (0x0, END_STREAM, &[0u8, 0, 0, 0, 0][..])
        );
        let mut server = Decoder::new();
        for (i, path_header) in [(1, "GetInfo"), (3, "NotifyRegistrationStatus")] {
            let (kind, flags, stream, block) = &got[if i == 1 { 1 } else { 3 }];
            assert_eq!((*kind, *stream), (HEADERS, i));
            assert_eq!(flags & END_HEADERS, END_HEADERS);
            assert_eq!(flags & END_STREAM, if i == 1 { 0 } else { END_STREAM });
            let headers = server.decode(block).unwrap();
            let get = |n: &[u8]| {
                headers
                    .iter()
                    .find(|(k, _)| k == n)
                    .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            };
            assert_eq!(get(b":authority").as_deref(), Some("localhost"));
            assert_eq!(
                get(b":path"),
                Some(format!("/pluginregistration.Registration/{path_header}"))
            );
        }
    }

    #[tokio::test]
    async fn trailers_pass_without_an_authority_and_a_header_bomb_is_refused() {
        let mut client = Encoder::new();
        let trailers = client.encode([(&b"grpc-status"[..], &b"0"[..])]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 1, &trailers));
        let mut out = Vec::new();
        rewrite(&mut &input[..], &mut out).await.unwrap();
        let got = frames(&out[PREFACE.len()..]);
        let headers = Decoder::new().decode(&got[0].3).unwrap();
        assert_eq!(headers, vec![(b"grpc-status".to_vec(), b"0".to_vec())]);

        // One 3 KB table entry referenced 20,000 times: 60 MB decoded, were it not refused.
        let mut bomb = client.encode([(&b"x-big"[..], &[b'a'; 3000][..])]);
        bomb.extend(std::iter::repeat_n(0xbe_u8, 20_000)); // indexed: dynamic entry 62
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 3, &bomb));
        let err = rewrite(&mut &input[..], &mut Vec::new()).await.unwrap_err();
        assert!(err.to_string().contains("too large"), "{err}");
    }

    #[tokio::test]
    async fn a_connection_that_is_not_http2_is_refused() {
        let mut out = Vec::new();
        let err = rewrite(&mut &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..], &mut out)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(out.is_empty());
    }
}
