//! One cached block on disk: [`BlockKey`] names it, [`encode`] / [`decode`] give the file format
//! and [`BlockKey::file_id`] its file name.
//!
//! A block file is the data followed by a trailer:
//!
//! ```text
//! data        data_len bytes, at offset 0
//! index       u64 LE (block index in the object)
//! endpoint, bucket, key, etag: each u32 LE length + UTF-8 bytes
//! crcs        ceil(data_len / chunk) × u32 LE: the crc32c of each piece (the last may be shorter)
//! padding     zero bytes, fewer than 4,096: the file's length is a multiple of 4 KiB
//! data_len    u64 LE
//! chunk       u32 LE (bytes per checked piece of the data: [`CHUNK`] when written)
//! crc32c      u32 LE, over the trailer before this field (index to chunk, padding included)
//! "FERRYBK4"  magic and format version (8 bytes)
//! ```
//!
//! The data comes first so that it sits at a page-aligned file offset: a block fetched into a
//! page-aligned buffer is written from that buffer with `O_DIRECT` as it is ([`crate::direct`]),
//! never copied into a bounce buffer first. (Format 1, `FERRYBK1`, had the header first.)
//!
//! The padding makes the whole file whole pages, so that it is written with `O_DIRECT` to its
//! last byte, in one `pwritev` of the data and the trailer's page(s). Format 3 (`FERRYBK3`, still
//! read) had no padding: its last piece, shorter than a page, went through the page cache (two
//! `fcntl`s, a page-cache page, a delayed allocation and a writeback of its own per file).
//!
//! The data is checked piece by piece so that a read of a few KiB reads and checks
//! [`CHUNK`]-sized pieces, not the whole block ([`read_range`]): the caller knows the block's
//! length, so the trailer's offset and length follow from the key alone and one `pread` brings
//! it. Format 2 (`FERRYBK2`), one crc32c over data and trailer, is still read (a cache written by
//! an older Ferry is kept), always whole.
//!
//! [`decode`] and [`read_range`] accept a file only if the checksums match, the length is exact
//! and the trailer names the very block asked for; anything else is [`Invalid`] and the caller
//! treats it as a miss.

use std::ops::Range;

use bytes::{BufMut, Bytes, BytesMut};
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"FERRYBK4";
/// Format 3 (no padding): read, no longer written.
const MAGIC_3: &[u8; 8] = b"FERRYBK3";
/// Format 4 pads a block file to a multiple of this (the `O_DIRECT` alignment).
const PAD: u64 = crate::direct::ALIGN as u64;
/// Format 2: read, no longer written.
const MAGIC_2: &[u8; 8] = b"FERRYBK2";
/// Format 2's fixed trailer end: data_len, crc32c, magic.
const END_2: usize = 8 + 4 + 8;

/// Bytes per checked piece of a block's data (and of a whole object's, [`crate::object`]): a
/// small read costs at most two pieces read and checked. 64 KiB keeps the crcs at 1/16,384 of
/// the data (256 bytes a 4 MiB block) while a piece costs a few microseconds to read from the page
/// cache and check, next to the tens a FUSE read costs.
pub const CHUNK: u64 = 64 << 10;

/// Which block of which object version: (endpoint, bucket, key, ETag, block index).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockKey {
    /// The S3 endpoint the object lives at (`""` for AWS's default).
    pub endpoint: String,
    pub bucket: String,
    pub key: String,
    /// The ETag, quotes included, as the server sent it.
    pub etag: String,
    /// Block number: the block covers `index * block_size ..` of the object.
    pub index: u64,
}

/// A block's file name: the first 16 bytes of a SHA-256 of the key fields.
pub type FileId = [u8; 16];

impl BlockKey {
    /// The stable file id of this block (the same in every process and version of Ferry).
    pub fn file_id(&self) -> FileId {
        let mut h = Sha256::new();
        for field in [&self.endpoint, &self.bucket, &self.key, &self.etag] {
            h.update((field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        h.update(self.index.to_le_bytes());
        let digest = h.finalize();
        let mut id = [0u8; 16];
        id.copy_from_slice(&digest[..16]);
        id
    }
}

/// Lower-case hex of a file id (the file's name; its first two characters name its directory).
pub fn hex(id: &FileId) -> String {
    // By hand: every block stored or read names its file, and a `format!` per byte was a
    // measurable share of the writer threads' CPU.
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * id.len());
    for &b in id {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// Parses [`hex`] back.
pub fn parse_hex(s: &str) -> Option<FileId> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(id)
}

/// Why a block file was not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("block file is truncated or has a bad header")]
    Malformed,
    #[error("block file checksum mismatch (stored {stored:08x}, computed {computed:08x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("block file belongs to another block")]
    OtherBlock,
}

/// The file contents for `data` as block `key` (format 4).
pub fn encode(key: &BlockKey, data: &[u8]) -> Vec<u8> {
    let mut file = data.to_vec();
    file.extend_from_slice(&encode_tail(key, data));
    file
}

/// The CRC-32C (Castagnoli, iSCSI) of `data`, the checksum of every block and object file.
/// `crc-fast` (already in the tree through the AWS SDK) folds with carry-less multiplication where
/// the CPU has it: 3–4 × the `crc32` instruction's speed on cache-hot data.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// The crc32c of each `chunk`-sized piece of `data` (the last may be shorter).
pub fn chunk_crcs(data: &[u8], chunk: u64) -> Vec<u32> {
    data.chunks(chunk as usize).map(crc32c).collect()
}

/// What [`encode`] puts after the data (the trailer, padded): the file is `data` and then this,
/// written one after the other, so the data is never copied to build it.
pub fn encode_tail(key: &BlockKey, data: &[u8]) -> Vec<u8> {
    encode_tail_as(key, data, true)
}

/// The trailer of format 4 (`padded`) or 3.
fn encode_tail_as(key: &BlockKey, data: &[u8], padded: bool) -> Vec<u8> {
    let crcs = chunk_crcs(data, CHUNK);
    let len = tail_len_as(key, data.len() as u64, padded);
    let mut tail = BytesMut::with_capacity(len);
    tail.put_u64_le(key.index);
    put_names(&mut tail, [&key.endpoint, &key.bucket, &key.key, &key.etag]);
    for crc in crcs {
        tail.put_u32_le(crc);
    }
    tail.put_bytes(0, len - END - tail.len());
    tail.put_u64_le(data.len() as u64);
    tail.put_u32_le(CHUNK as u32);
    let crc = crc32c(&tail);
    tail.put_u32_le(crc);
    tail.put_slice(if padded { MAGIC } else { MAGIC_3 });
    tail.to_vec()
}

/// The trailer's fixed end: data_len, chunk, crc32c, magic.
const END: usize = 8 + 4 + 4 + 8;

/// The length of a format-4 (`padded`) or format-3 trailer.
fn tail_len_as(key: &BlockKey, data_len: u64, padded: bool) -> usize {
    let names = [&key.endpoint, &key.bucket, &key.key, &key.etag]
        .iter()
        .map(|n| 4 + n.len())
        .sum::<usize>();
    let len = 8 + names + 4 * data_len.div_ceil(CHUNK) as usize + END;
    if padded {
        // A length no block has (the caller's or a file's, unchecked) gets no padding rather
        // than an overflow: its trailer is then not where a format-4 file's is.
        data_len
            .checked_add(len as u64)
            .and_then(|end| end.checked_next_multiple_of(PAD))
            .map_or(len, |end| (end - data_len) as usize)
    } else {
        len
    }
}

/// A format-3 or 4 trailer, checked: its piece size and crcs.
struct Tail {
    chunk: u64,
    crcs: Vec<u32>,
}

/// The data length and piece size a format-3 or 4 trailer's fixed end states, and whether it is
/// format 4 (unchecked: `file` ends with a trailer, or is no such file).
fn tail_end(file: &[u8]) -> Option<(u64, u64, bool)> {
    let n = file.len();
    if n < END {
        return None;
    }
    let padded = match &file[n - 8..] {
        m if m == MAGIC => true,
        m if m == MAGIC_3 => false,
        _ => return None,
    };
    let data_len = u64::from_le_bytes(file[n - END..n - 16].try_into().expect("8 bytes"));
    let chunk = u32::from_le_bytes(file[n - 16..n - 12].try_into().expect("4 bytes"));
    Some((data_len, u64::from(chunk), padded))
}

/// Checks `tail` (a whole format-3 or 4 trailer) against block `key` with `data_len` bytes of
/// data: a format-4 trailer's padding must be zeros and end the file at a multiple of 4 KiB.
fn check_tail(key: &BlockKey, tail: &[u8], data_len: u64) -> Result<Tail, Invalid> {
    let n = tail.len();
    let (len, chunk, padded) = tail_end(tail).ok_or(Invalid::Malformed)?;
    let stored = u32::from_le_bytes(tail[n - 12..n - 8].try_into().expect("4 bytes"));
    let computed = crc32c(&tail[..n - 12]);
    if stored != computed {
        return Err(Invalid::Checksum { stored, computed });
    }
    if len != data_len || chunk == 0 {
        return Err(Invalid::Malformed);
    }
    let mut r = Reader {
        body: &tail[..n - END],
        pos: 0,
    };
    let index = r.u64()?;
    let same = r.names_are([&key.endpoint, &key.bucket, &key.key, &key.etag])?;
    if !(same && index == key.index) {
        return Err(Invalid::OtherBlock);
    }
    let crcs = (0..data_len.div_ceil(chunk))
        .map(|_| r.u32())
        .collect::<Result<Vec<_>, _>>()?;
    let padding = r.take(r.rest())?;
    let aligned = (data_len + n as u64).is_multiple_of(PAD);
    if padded {
        if !aligned || padding.len() as u64 >= PAD || padding.iter().any(|&b| b != 0) {
            return Err(Invalid::Malformed);
        }
    } else if !padding.is_empty() {
        return Err(Invalid::Malformed);
    }
    Ok(Tail { chunk, crcs })
}

/// Checks `data` (pieces `first..` of a block, starting at piece `first`'s offset) against `crcs`.
pub(crate) fn check_chunks(
    data: &[u8],
    chunk: u64,
    crcs: &[u32],
    first: usize,
) -> Result<(), Invalid> {
    for (i, piece) in data.chunks(chunk as usize).enumerate() {
        let stored = *crcs.get(first + i).ok_or(Invalid::Malformed)?;
        let computed = crc32c(piece);
        if stored != computed {
            return Err(Invalid::Checksum { stored, computed });
        }
    }
    Ok(())
}

/// The piece-aligned span of `len` bytes that covers `within`, with `chunk`-sized pieces: the
/// span and its first piece's number.
pub(crate) fn chunk_span(within: &Range<u64>, chunk: u64, len: u64) -> (Range<u64>, usize) {
    let first = within.start / chunk;
    let end = (within.end.div_ceil(chunk) * chunk).min(len);
    (first * chunk..end, first as usize)
}

/// The data of a block file, if it is intact and is block `key`.
pub fn decode(key: &BlockKey, file: Bytes) -> Result<Bytes, Invalid> {
    let n = file.len();
    if n >= 8 && &file[n - 8..] == MAGIC_2 {
        return decode_2(key, file);
    }
    // The trailer starts where the data ends.
    let (data_len, _, _) = tail_end(&file).ok_or(Invalid::Malformed)?;
    let data_len = usize::try_from(data_len)
        .ok()
        .filter(|&l| l <= n - END)
        .ok_or(Invalid::Malformed)?;
    let tail = check_tail(key, &file[data_len..], data_len as u64)?;
    check_chunks(&file[..data_len], tail.chunk, &tail.crcs, 0)?;
    Ok(file.slice(..data_len))
}

/// A format-2 file's data (see the module docs).
fn decode_2(key: &BlockKey, file: Bytes) -> Result<Bytes, Invalid> {
    let n = file.len();
    if n < END_2 + 8 + 16 || &file[n - 8..] != MAGIC_2 {
        return Err(Invalid::Malformed);
    }
    let stored = u32::from_le_bytes(file[n - 12..n - 8].try_into().expect("4 bytes"));
    let computed = crc32c(&file[..n - 12]);
    if stored != computed {
        return Err(Invalid::Checksum { stored, computed });
    }
    let data_len = u64::from_le_bytes(file[n - END_2..n - 12].try_into().expect("8 bytes"));
    let data_len = usize::try_from(data_len)
        .ok()
        .filter(|&l| l <= n - END_2)
        .ok_or(Invalid::Malformed)?;
    let mut r = Reader {
        body: &file[data_len..n - END_2],
        pos: 0,
    };
    let index = r.u64()?;
    let same = r.names_are([&key.endpoint, &key.bucket, &key.key, &key.etag])?;
    if r.rest() != 0 {
        return Err(Invalid::Malformed);
    }
    if !(same && index == key.index) {
        return Err(Invalid::OtherBlock);
    }
    Ok(file.slice(..data_len))
}

/// Bytes `within` of block `key`'s data (`data_len` bytes) from its open file: the trailer and the
/// pieces that cover `within`, each checked, and nothing else read. `Ok(None)` when the file is
/// not a format-4 or 3 file of that length (a format-2 file: read it whole with [`decode`]).
/// Blocking.
pub fn read_range(
    file: &std::fs::File,
    key: &BlockKey,
    data_len: u64,
    within: Range<u64>,
) -> Result<Option<Bytes>, Invalid> {
    use std::os::unix::fs::FileExt;
    read_range_with(|buf, at| file.read_exact_at(buf, at), key, data_len, within)
}

/// [`read_range`] from whatever `read_exact_at` reads (a file; the fuzz target's bytes).
pub fn read_range_with(
    read_exact_at: impl Fn(&mut [u8], u64) -> std::io::Result<()>,
    key: &BlockKey,
    data_len: u64,
    within: Range<u64>,
) -> Result<Option<Bytes>, Invalid> {
    if within.start >= within.end || within.end > data_len {
        return Err(Invalid::Malformed);
    }
    // This code's format first; a shorter format-3 trailer where that finds none.
    let mut found = None;
    for padded in [true, false] {
        let mut tail = vec![0u8; tail_len_as(key, data_len, padded)];
        match read_exact_at(&mut tail, data_len) {
            Ok(()) if tail_end(&tail).is_some() => {
                found = Some(tail);
                break;
            }
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
            Err(_) => return Err(Invalid::Malformed),
        }
    }
    let Some(tail) = found else {
        return Ok(None);
    };
    let tail = check_tail(key, &tail, data_len)?;
    let (span, first) = chunk_span(&within, tail.chunk, data_len);
    let mut buf = vec![0u8; (span.end - span.start) as usize];
    read_exact_at(&mut buf, span.start).map_err(|_| Invalid::Malformed)?;
    check_chunks(&buf, tail.chunk, &tail.crcs, first)?;
    let at = (within.start - span.start) as usize..(within.end - span.start) as usize;
    Ok(Some(exactly(Bytes::from(buf), at)))
}

/// Bytes `range` of `data`: `data` itself when that is all of it, else a copy, so the caller
/// holds (and the memory budget counts) only what it asked for. A range past the end is cut
/// to it.
pub(crate) fn exactly(data: Bytes, range: std::ops::Range<usize>) -> Bytes {
    let end = range.end.min(data.len());
    let start = range.start.min(end);
    if start == 0 && end == data.len() {
        return data;
    }
    Bytes::copy_from_slice(&data[start..end])
}

/// Frames `body` as a cache file: `magic`, the crc32c of `body` (u32 LE), `body`.
pub(crate) fn seal(magic: &[u8; 8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + body.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&crc32c(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Writes the names of an object version (endpoint, bucket, key, ETag), each length-prefixed.
pub(crate) fn put_names(body: &mut BytesMut, names: [&String; 4]) {
    for field in names {
        body.put_u32_le(field.len() as u32);
        body.put_slice(field.as_bytes());
    }
}

/// Reads the body of a [`seal`]ed file field by field; every short read is [`Invalid::Malformed`].
pub(crate) struct Reader<'a> {
    body: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// The body of `file`, if its magic is `magic`, its body has at least `min_body` bytes and
    /// its checksum holds.
    pub(crate) fn unseal(
        magic: &[u8; 8],
        file: &'a [u8],
        min_body: usize,
    ) -> Result<Self, Invalid> {
        if file.len() < 12 + min_body || &file[..8] != magic {
            return Err(Invalid::Malformed);
        }
        let stored = u32::from_le_bytes(file[8..12].try_into().expect("4 bytes"));
        let computed = crc32c(&file[12..]);
        if stored != computed {
            return Err(Invalid::Checksum { stored, computed });
        }
        Ok(Reader {
            body: &file[12..],
            pos: 0,
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Invalid> {
        let s = self
            .body
            .get(self.pos..self.pos + n)
            .ok_or(Invalid::Malformed)?;
        self.pos += n;
        Ok(s)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, Invalid> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, Invalid> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    /// Whether the next names (as [`put_names`] wrote them) are `names`.
    pub(crate) fn names_are(&mut self, names: [&String; 4]) -> Result<bool, Invalid> {
        let mut same = true;
        for field in names {
            let len = self.u32()? as usize;
            same &= self.take(len)? == field.as_bytes();
        }
        Ok(same)
    }

    /// Bytes not read yet.
    pub(crate) fn rest(&self) -> usize {
        self.body.len() - self.pos
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// CRC-32C bit by bit, from its definition (reflected polynomial 0x82F63B78).
    fn crc32c_bitwise(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = (crc >> 1) ^ (0x82F6_3B78 & (crc & 1).wrapping_neg());
            }
        }
        !crc
    }

    /// Files written by earlier Ferry versions (whose checksums came from the `crc32c` crate)
    /// still check: the same CRC-32C at every length and alignment the folding code splits on.
    #[test]
    fn crc32c_is_the_castagnoli_crc_at_every_length() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        let data = data_of(200_003);
        for len in [
            1, 7, 15, 16, 31, 63, 64, 65, 255, 256, 257, 4095, 4096, 65_536, 200_000,
        ] {
            for start in [0, 1, 3] {
                let piece = &data[start..start + len];
                assert_eq!(crc32c(piece), crc32c_bitwise(piece), "{len} from {start}");
            }
        }
    }

    fn key() -> BlockKey {
        BlockKey {
            endpoint: "http://127.0.0.1:9000".into(),
            bucket: "b".into(),
            key: "data/x.bin".into(),
            etag: "\"abc\"".into(),
            index: 3,
        }
    }

    #[test]
    fn round_trip_and_every_flipped_byte_is_refused() {
        let k = key();
        let file = encode(&k, b"hello block");
        assert_eq!(
            decode(&k, Bytes::from(file.clone())).unwrap(),
            &b"hello block"[..]
        );
        for i in 0..file.len() {
            let mut bad = file.clone();
            bad[i] ^= 0x40;
            assert!(decode(&k, Bytes::from(bad)).is_err(), "flip at {i} served");
        }
        for cut in [1, 8, 12, 20, file.len() - 1] {
            let front = decode(&k, Bytes::from(file[cut..].to_vec()));
            assert!(front.is_err(), "{cut} bytes cut off the front: {front:?}");
            let back = decode(&k, Bytes::from(file[..file.len() - cut].to_vec()));
            assert_eq!(back, Err(Invalid::Malformed), "{cut} bytes cut off the end");
        }
        // The data is at offset 0, the trailer after it.
        assert_eq!(&file[..11], b"hello block");
        assert_eq!(&file[file.len() - 8..], MAGIC);
    }

    /// A block file is whole pages: its trailer's zero padding makes it so, whatever the data's
    /// length; the padding is checked (zeros, fewer than a page, the file whole pages).
    #[test]
    fn a_block_file_is_whole_pages_and_its_padding_is_checked() {
        let k = key();
        for len in [1, 100, 4096 - 60, 4096, 128 << 10, (128 << 10) + 1, 4 << 20] {
            let data = data_of(len);
            let file = encode(&k, &data);
            assert_eq!(file.len() % 4096, 0, "data of {len}");
            assert!(file.len() - len < 4096 + tail_len_as(&k, len as u64, false));
            assert_eq!(
                &decode(&k, Bytes::from(file.clone())).unwrap()[..],
                &data[..]
            );
        }
        // A trailer that does not end the file at a page, or has more than a page of padding
        // (its crc made to match): refused.
        let data = data_of(100);
        let good = encode_tail(&k, &data);
        let names = 8
            + [&k.endpoint, &k.bucket, &k.key, &k.etag]
                .iter()
                .map(|n| 4 + n.len())
                .sum::<usize>()
            + 4;
        for pad in [
            good.len() - END - names - 1,
            good.len() - END - names + 4096,
        ] {
            let mut tail = good[..names].to_vec();
            tail.extend(std::iter::repeat_n(0u8, pad));
            tail.extend_from_slice(&(data.len() as u64).to_le_bytes());
            tail.extend_from_slice(&(CHUNK as u32).to_le_bytes());
            let crc = crc32c(&tail);
            tail.extend_from_slice(&crc.to_le_bytes());
            tail.extend_from_slice(MAGIC);
            let mut file = data.clone();
            file.extend_from_slice(&tail);
            assert_eq!(
                decode(&k, Bytes::from(file)),
                Err(Invalid::Malformed),
                "padding {pad}"
            );
        }
    }

    /// A format-3 file (no padding), as the Ferry before format 4 wrote it, is read whole and in
    /// part.
    #[test]
    fn a_format_3_file_is_still_read_whole_and_in_part() {
        let k = key();
        for len in [100, 128 << 10, 3 * CHUNK as usize + 5] {
            let data = data_of(len);
            let mut file = data.clone();
            file.extend_from_slice(&encode_tail_as(&k, &data, false));
            assert_eq!(&file[file.len() - 8..], MAGIC_3);
            assert_eq!(
                &decode(&k, Bytes::from(file.clone())).unwrap()[..],
                &data[..]
            );
            let got = read_range(&file_of(&file), &k, len as u64, 10..20)
                .unwrap()
                .unwrap();
            assert_eq!(&got[..], &data[10..20]);
            let mut bad = file.clone();
            bad[len + 3] ^= 1;
            assert!(decode(&k, Bytes::from(bad)).is_err());
        }
    }

    #[test]
    fn another_blocks_file_is_refused() {
        let file = Bytes::from(encode(&key(), b"data"));
        for other in [
            BlockKey { index: 4, ..key() },
            BlockKey {
                etag: "\"abd\"".into(),
                ..key()
            },
            BlockKey {
                endpoint: String::new(),
                ..key()
            },
            BlockKey {
                bucket: "c".into(),
                ..key()
            },
        ] {
            assert_eq!(decode(&other, file.clone()), Err(Invalid::OtherBlock));
            assert_ne!(other.file_id(), key().file_id());
        }
    }

    /// A format-2 file, as Ferry wrote block files before pieces were checked one by one.
    pub(crate) fn encode_2(key: &BlockKey, data: &[u8]) -> Vec<u8> {
        let mut tail = BytesMut::new();
        tail.put_u64_le(key.index);
        put_names(&mut tail, [&key.endpoint, &key.bucket, &key.key, &key.etag]);
        tail.put_u64_le(data.len() as u64);
        let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
        digest.update(data);
        digest.update(&tail);
        let crc = digest.finalize() as u32;
        tail.put_u32_le(crc);
        tail.put_slice(MAGIC_2);
        let mut file = data.to_vec();
        file.extend_from_slice(&tail);
        file
    }

    fn file_of(bytes: &[u8]) -> std::fs::File {
        use std::io::{Seek, Write};
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f.rewind().unwrap();
        f
    }

    #[test]
    fn a_format_2_file_is_still_read_whole_and_never_in_part() {
        let k = key();
        let file = encode_2(&k, b"older block");
        assert_eq!(
            decode(&k, Bytes::from(file.clone())).unwrap(),
            &b"older block"[..]
        );
        assert_eq!(read_range(&file_of(&file), &k, 11, 2..5), Ok(None));
        let mut bad = file.clone();
        bad[3] ^= 1;
        assert!(decode(&k, Bytes::from(bad)).is_err());
    }

    fn data_of(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// A part read gives exactly the bytes asked for; a flipped data byte is refused when
        /// its piece holds some of them and does not matter otherwise; a flipped trailer byte is
        /// always refused (or, in the magic, sends the caller to the whole-file decode).
        #[test]
        fn a_part_is_read_from_the_pieces_that_hold_it(
            len in 1usize..(5 * CHUNK as usize),
            a in 0.0f64..1.0,
            b in 0.0f64..1.0,
            flip in 0.0f64..1.0,
        ) {
            let k = key();
            let data = data_of(len);
            let file = encode(&k, &data);
            let (x, y) = ((a * len as f64) as u64, (b * len as f64) as u64);
            let within = x.min(y)..(x.max(y) + 1).min(len as u64);
            let want = &data[within.start as usize..within.end as usize];
            let got = read_range(&file_of(&file), &k, len as u64, within.clone()).unwrap().unwrap();
            proptest::prop_assert_eq!(&got[..], want);

            let at = ((flip * file.len() as f64) as usize).min(file.len() - 1);
            let mut bad = file.clone();
            bad[at] ^= 0x10;
            let got = read_range(&file_of(&bad), &k, len as u64, within.clone());
            if at < len {
                let piece = at as u64 / CHUNK;
                let held = within.start / CHUNK <= piece && piece <= (within.end - 1) / CHUNK;
                if held {
                    proptest::prop_assert!(got.is_err(), "flip at {} served", at);
                } else {
                    proptest::prop_assert_eq!(&got.unwrap().unwrap()[..], want);
                }
            } else {
                proptest::prop_assert!(!matches!(got, Ok(Some(_))), "trailer flip at {} served", at);
            }
            proptest::prop_assert!(decode(&k, Bytes::from(bad)).is_err());
        }
    }

    #[test]
    fn a_part_outside_the_block_or_of_another_length_is_refused() {
        let k = key();
        let data = data_of(3 * CHUNK as usize + 5);
        let f = file_of(&encode(&k, &data));
        let len = data.len() as u64;
        assert_eq!(read_range(&f, &k, len, 4..4), Err(Invalid::Malformed));
        assert_eq!(read_range(&f, &k, len, 0..len + 1), Err(Invalid::Malformed));
        // The caller's length is wrong: the trailer is not where it says.
        assert!(!matches!(read_range(&f, &k, len - 1, 0..4), Ok(Some(_))));
        assert!(!matches!(read_range(&f, &k, len + 1, 0..4), Ok(Some(_))));
        let other = BlockKey { index: 4, ..k };
        assert_eq!(read_range(&f, &other, len, 0..4), Err(Invalid::OtherBlock));
    }

    /// The fuzz corpus's seeds, written by hand from the format above (not by this code), read.
    #[test]
    fn the_documented_formats_are_the_ones_read() {
        let k = BlockKey {
            endpoint: "http://127.0.0.1:7070".into(),
            bucket: "data".into(),
            key: "train/shard-0001.tar".into(),
            etag: "\"9b2cf535f27731c974343645a3985328\"".into(),
            index: 3,
        };
        let want = data_of(1000);
        for seed in [
            &include_bytes!("../../../fuzz/corpus/cache_files/seed-block-format4")[..],
            &include_bytes!("../../../fuzz/corpus/cache_files/seed-block-format3")[..],
            &include_bytes!("../../../fuzz/corpus/cache_files/seed-block-format2")[..],
        ] {
            let got = decode(&k, Bytes::copy_from_slice(seed)).unwrap();
            assert_eq!(&got[..], &want[..]);
        }
        for seed in [
            &include_bytes!("../../../fuzz/corpus/cache_files/seed-block-format4")[..],
            &include_bytes!("../../../fuzz/corpus/cache_files/seed-block-format3")[..],
        ] {
            let got = read_range(&file_of(seed), &k, 1000, 10..20)
                .unwrap()
                .unwrap();
            assert_eq!(&got[..], &want[10..20]);
        }
    }

    #[test]
    fn file_ids_are_stable_and_hex_round_trips() {
        let id = key().file_id();
        assert_eq!(id, key().file_id());
        assert_eq!(parse_hex(&hex(&id)), Some(id));
        assert_eq!(parse_hex("zz"), None);
        let mut id = [0u8; 16];
        id[..5].copy_from_slice(&[0x00, 0x0f, 0xa5, 0x5a, 0xff]);
        id[15] = 0x10;
        assert_eq!(hex(&id), "000fa55aff0000000000000000000010");
    }
}
