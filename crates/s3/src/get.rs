//! What both GET paths do with a response: the conditions a pinned GET sends, the check that the
//! response is the pinned version, and reading the body with its length checked against the range
//! and the headers.

use std::ops::Range;
use std::time::{Duration, SystemTime};

use aws_smithy_types::byte_stream::ByteStream;
use bytes::Bytes;
use ferry_store::Version;

use crate::error::{error_chain, Failure, Kind};
use crate::pagebuf::PageBuf;

/// The `If-Match` ETag and `If-Unmodified-Since` time a pinned GET carries.
///
/// `If-Unmodified-Since` names the end of the pinned `Last-Modified` second: servers that compare
/// it with their file's sub-second modification time (versitygw's posix backend does) would
/// otherwise refuse the very version the header names. A change within that second goes unseen
/// either way; a later one fails the condition or, where a server ignores it, [`check_version`].
pub(crate) fn conditions(pin: Option<Version<'_>>) -> (Option<&str>, Option<SystemTime>) {
    match pin {
        None => (None, None),
        Some(Version::ETag(etag)) => (Some(etag), None),
        Some(Version::Unmodified { last_modified, .. }) => {
            let end_of_second = |t: SystemTime| {
                let secs = t
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                std::time::UNIX_EPOCH + Duration::from_secs(secs + 1)
            };
            (None, last_modified.map(end_of_second))
        }
    }
}

/// A pinned GET's response must come from the pinned version, whatever the server did with the
/// condition headers (a server that ignores `If-Match` or `If-Unmodified-Since` is caught here):
/// pinned by ETag, the response's `ETag` (when sent) must be it; pinned without one, the
/// response's `Last-Modified` (when both it and the pin have one) and the object's total size
/// (from `Content-Range`, or the whole body's length when the server ignored the range) must be
/// the pinned ones. A mismatch is `PreconditionFailed`, as the server's own 412 would be.
pub(crate) fn check_version(
    what: &(dyn Fn() -> String + Sync),
    pin: Option<Version<'_>>,
    etag: Option<&str>,
    last_modified: Option<SystemTime>,
    content_range: Option<&str>,
    declared: Option<u64>,
) -> Result<(), Failure> {
    let changed = |detail: String| {
        Err(Failure::new(
            Kind::PreconditionFailed,
            format!(
                "{}: the object changed since it was opened ({detail})",
                what()
            ),
        ))
    };
    // Compared without quotes or a weak marker, and without allocating (every GET passes here).
    fn bare(e: &str) -> &str {
        e.trim().trim_start_matches("W/").trim_matches('"')
    }
    match pin {
        None => Ok(()),
        Some(Version::ETag(pinned)) => match etag {
            Some(now) if bare(now) != bare(pinned) => {
                changed(format!("pinned ETag {pinned}, the server sent {now}"))
            }
            _ => Ok(()),
        },
        Some(Version::Unmodified {
            last_modified: pinned,
            size,
        }) => {
            let secs = |t: SystemTime| {
                t.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
            };
            let total = match content_range {
                Some(cr) => parse_content_range(cr).and_then(|(_, _, total)| total),
                None => declared,
            };
            let moved = matches!((pinned, last_modified), (Some(a), Some(b)) if secs(a) != secs(b));
            if moved || total.is_some_and(|t| t != size) {
                return changed(format!(
                    "no ETag; pinned Last-Modified {:?} and {size} bytes, now {:?} and {total:?} bytes",
                    pinned.map(secs),
                    last_modified.map(secs),
                ));
            }
            Ok(())
        }
    }
}

/// Reads a GET body and checks it against the range asked for and what the response headers say
/// it carries (`Content-Range`, `Content-Length`). Without `Content-Range` the server ignored the
/// range and sent the whole object, so the range is cut out of it. With `piece`, the body comes
/// in buffers of that many bytes each (the last may be shorter), else in one.
pub(crate) async fn read_checked(
    what: &(dyn Fn() -> String + Sync),
    range: &Range<u64>,
    content_range: Option<&str>,
    declared: Option<u64>,
    body: ByteStream,
    body_timeout: Duration,
    piece: Option<u64>,
) -> Result<Vec<Bytes>, Failure> {
    let expected = match content_range {
        Some(cr) => {
            let (first, last, _total) = parse_content_range(cr).ok_or_else(|| {
                Failure::new(
                    Kind::Corrupt,
                    format!("{}: bad Content-Range {cr:?}", what()),
                )
            })?;
            if first != range.start || last >= range.end {
                return Err(Failure::new(
                    Kind::Corrupt,
                    format!("{}: server sent Content-Range {cr:?}", what()),
                ));
            }
            Some(last - first + 1)
        }
        None => None,
    };
    let size_hint = expected.or(declared).unwrap_or(0);
    // Pieces only of a body that is the range: a whole object is cut first.
    let read_in = piece.filter(|_| expected.is_some());
    let body = tokio::time::timeout(body_timeout, gather(body, size_hint, read_in))
        .await
        .map_err(|_| Failure::new(Kind::Transient, format!("{}: body read timed out", what())))?
        .map_err(|e| {
            Failure::new(
                Kind::Transient,
                format!("{}: reading the body: {}", what(), error_chain(&e)),
            )
        })?;
    let got: u64 = body.iter().map(|b| b.len() as u64).sum();
    if let Some(declared) = declared {
        if got != declared {
            return Err(Failure::new(
                Kind::Corrupt,
                format!("{}: got {got} bytes, Content-Length {declared}", what()),
            ));
        }
    }
    match expected {
        Some(expected) if got == expected => Ok(body),
        Some(expected) => Err(Failure::new(
            Kind::Corrupt,
            format!("{}: got {got} bytes, expected {expected}", what()),
        )),
        None => {
            if range.start >= got {
                return Err(Failure::new(
                    Kind::InvalidRequest,
                    format!(
                        "{}: starts at or past the object's end ({got} bytes)",
                        what()
                    ),
                ));
            }
            let whole = body.into_iter().next().unwrap_or_default();
            let cut = whole.slice(range.start as usize..range.end.min(got) as usize);
            Ok(match piece_of(piece) {
                Some(p) => ferry_store::split_copied(&cut, p),
                None => vec![cut],
            })
        }
    }
}

fn piece_of(piece: Option<u64>) -> Option<u64> {
    piece.filter(|p| *p > 0)
}

/// Most bytes reserved up front for a body from its declared size (a body larger than that grows).
const MAX_BODY_RESERVE: u64 = 64 * 1024 * 1024;

/// Reads a body into one buffer as its chunks arrive, each chunk dropped once copied, so a part
/// never sits in memory twice (collecting all chunks first and then joining them did that). A
/// body of one chunk is kept as it is. The buffer is a [`PageBuf`]: page-aligned, for the node
/// cache's `O_DIRECT` writes.
async fn gather(
    mut body: ByteStream,
    size_hint: u64,
    piece: Option<u64>,
) -> std::result::Result<Vec<Bytes>, aws_smithy_types::byte_stream::error::Error> {
    if let Some(piece) = piece_of(piece) {
        return gather_pieces(body, size_hint, piece).await;
    }
    let Some(first) = next_chunk(&mut body).await? else {
        return Ok(vec![Bytes::new()]);
    };
    let Some(second) = next_chunk(&mut body).await? else {
        return Ok(vec![first]);
    };
    let reserve = size_hint.min(MAX_BODY_RESERVE) as usize;
    let mut buf = PageBuf::with_capacity(reserve.max(first.len() + second.len()));
    buf.extend_from_slice(&first);
    buf.extend_from_slice(&second);
    while let Some(chunk) = body.try_next().await? {
        buf.extend_from_slice(&chunk);
    }
    Ok(vec![buf.freeze()])
}

/// [`gather`] into buffers of `piece` bytes each (the last may be shorter), each sized for what
/// it will hold: every byte is copied once, as into one buffer, and no piece shares another's.
/// Each piece is a [`PageBuf`] of its own: a node cache block starts on a page boundary.
async fn gather_pieces(
    mut body: ByteStream,
    size_hint: u64,
    piece: u64,
) -> std::result::Result<Vec<Bytes>, aws_smithy_types::byte_stream::error::Error> {
    let piece = piece.min(MAX_BODY_RESERVE) as usize;
    let mut left = size_hint as usize;
    let mut pieces = Vec::new();
    let mut buf = PageBuf::with_capacity(0);
    while let Some(chunk) = next_chunk(&mut body).await? {
        let mut chunk = &chunk[..];
        while !chunk.is_empty() {
            if buf.capacity() == 0 {
                buf = PageBuf::with_capacity(piece.min(left.max(chunk.len())));
            }
            let n = (piece - buf.len()).min(chunk.len());
            buf.extend_from_slice(&chunk[..n]);
            chunk = &chunk[n..];
            if buf.len() == piece {
                left = left.saturating_sub(piece);
                pieces.push(std::mem::replace(&mut buf, PageBuf::with_capacity(0)).freeze());
            }
        }
    }
    if !buf.is_empty() || pieces.is_empty() {
        pieces.push(buf.freeze());
    }
    Ok(pieces)
}

/// The body's next chunk that is not empty.
async fn next_chunk(
    body: &mut ByteStream,
) -> std::result::Result<Option<Bytes>, aws_smithy_types::byte_stream::error::Error> {
    while let Some(chunk) = body.try_next().await? {
        if !chunk.is_empty() {
            return Ok(Some(chunk));
        }
    }
    Ok(None)
}

/// `bytes 0-9/10` → (0, 9, Some(10)); `bytes 0-9/*` → (0, 9, None).
pub(crate) fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes")?.trim_start();
    let (span, total) = rest.split_once('/')?;
    let (first, last) = span.split_once('-')?;
    let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    // A range past the object's end is no range of it.
    (first <= last && total.is_none_or(|t| last < t)).then_some((first, last, total))
}
