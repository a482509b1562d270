//! One cached block on disk: [`BlockKey`] names it, [`encode`] / [`decode`] give the file format
//! and [`BlockKey::file_id`] its file name.
//!
//! A block file is the data followed by a trailer:
//!
//! ```text
//! data        data_len bytes, at offset 0
//! index       u64 LE (block index in the object)
//! endpoint, bucket, key, etag: each u32 LE length + UTF-8 bytes
//! data_len    u64 LE
//! crc32c      u32 LE, over every byte before this field (the data and the trailer so far)
//! "FERRYBK2"  magic and format version (8 bytes)
//! ```
//!
//! The data comes first so that it sits at a page-aligned file offset: a block fetched into a
//! page-aligned buffer is written from that buffer with `O_DIRECT` as it is ([`crate::direct`]),
//! never copied into a bounce buffer first. (Format 1, `FERRYBK1`, had the header first.)
//!
//! [`decode`] accepts a file only if the checksum matches, the length is exact and the trailer
//! names the very block asked for; anything else is [`Invalid`] and the caller treats it as a miss.

use bytes::{BufMut, Bytes, BytesMut};
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"FERRYBK2";
/// The trailer's fixed end: data_len, crc32c, magic.
const END: usize = 8 + 4 + 8;

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
    id.iter().map(|b| format!("{b:02x}")).collect()
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

/// The file contents for `data` as block `key`.
pub fn encode(key: &BlockKey, data: &[u8]) -> Vec<u8> {
    let mut file = data.to_vec();
    file.extend_from_slice(&encode_tail(key, data));
    file
}

/// What [`encode`] puts after the data (the trailer): the file is `data` and then this, written
/// one after the other, so the data is never copied to build it.
pub fn encode_tail(key: &BlockKey, data: &[u8]) -> Vec<u8> {
    let mut tail = BytesMut::with_capacity(64 + key.key.len());
    tail.put_u64_le(key.index);
    put_names(&mut tail, [&key.endpoint, &key.bucket, &key.key, &key.etag]);
    tail.put_u64_le(data.len() as u64);
    let crc = crc32c::crc32c_append(crc32c::crc32c(data), &tail);
    tail.put_u32_le(crc);
    tail.put_slice(MAGIC);
    tail.to_vec()
}

/// The data of a block file, if it is intact and is block `key`.
pub fn decode(key: &BlockKey, file: Bytes) -> Result<Bytes, Invalid> {
    let n = file.len();
    if n < END + 8 + 16 || &file[n - 8..] != MAGIC {
        return Err(Invalid::Malformed);
    }
    let stored = u32::from_le_bytes(file[n - 12..n - 8].try_into().expect("4 bytes"));
    let computed = crc32c::crc32c(&file[..n - 12]);
    if stored != computed {
        return Err(Invalid::Checksum { stored, computed });
    }
    let data_len = u64::from_le_bytes(file[n - END..n - 12].try_into().expect("8 bytes"));
    let data_len = usize::try_from(data_len)
        .ok()
        .filter(|&l| l <= n - END)
        .ok_or(Invalid::Malformed)?;
    let mut r = Reader {
        body: &file[data_len..n - END],
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

/// Frames `body` as a cache file: `magic`, the crc32c of `body` (u32 LE), `body`.
pub(crate) fn seal(magic: &[u8; 8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + body.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
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
        let computed = crc32c::crc32c(&file[12..]);
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
mod tests {
    use super::*;

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

    #[test]
    fn file_ids_are_stable_and_hex_round_trips() {
        let id = key().file_id();
        assert_eq!(id, key().file_id());
        assert_eq!(parse_hex(&hex(&id)), Some(id));
        assert_eq!(parse_hex("zz"), None);
    }
}
