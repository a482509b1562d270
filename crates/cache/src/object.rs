//! A whole cached object: once every block of an object version is on disk, the blocks are
//! joined into one file holding exactly the object's bytes (so the kernel can read it directly,
//! FUSE passthrough) and a sidecar `.meta` file that names the object and holds a crc32c of each
//! piece of the data:
//!
//! ```text
//! "FERRYOB2"  magic and format version (8 bytes)
//! crc32c      u32 LE, over every byte after this field
//! size        u64 LE (object size = data file length)
//! block_size  u64 LE (the cache's block size when joined)
//! chunk       u64 LE (the piece size the crcs cover: [`crate::block::CHUNK`] when written)
//! endpoint, bucket, key, etag: each u32 LE length + UTF-8 bytes
//! count       u64 LE, then count × u32 LE crc32c of each piece of the data file
//! ```
//!
//! The data file carries no header (its offsets are the object's), so it is checked against the
//! sidecar: the pieces a read covers when a block (or part of one) is read from it, and as a
//! whole the first time a process hands it to the kernel. Format 1 (`FERRYOB1`, no `chunk`: one
//! crc per block) is still read.

use bytes::{BufMut, BytesMut};
use sha2::{Digest, Sha256};

use crate::block::{put_names, seal, BlockKey, FileId, Invalid, Reader};

const MAGIC: &[u8; 8] = b"FERRYOB2";
/// Format 1: read, no longer written.
const MAGIC_1: &[u8; 8] = b"FERRYOB1";

/// One object version: (endpoint, bucket, key, ETag).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    /// The S3 endpoint the object lives at (`""` for AWS's default).
    pub endpoint: String,
    pub bucket: String,
    pub key: String,
    /// The ETag, quotes included, as the server sent it.
    pub etag: String,
}

impl ObjectKey {
    /// Block `index` of this object version.
    pub fn block(&self, index: u64) -> BlockKey {
        BlockKey {
            endpoint: self.endpoint.clone(),
            bucket: self.bucket.clone(),
            key: self.key.clone(),
            etag: self.etag.clone(),
            index,
        }
    }

    /// The stable file id of the whole-object file (never equal to a block's: another domain).
    pub fn file_id(&self) -> FileId {
        let mut h = Sha256::new();
        h.update(b"ferry-object\0");
        for field in [&self.endpoint, &self.bucket, &self.key, &self.etag] {
            h.update((field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        let digest = h.finalize();
        let mut id = [0u8; 16];
        id.copy_from_slice(&digest[..16]);
        id
    }
}

impl BlockKey {
    /// The object version this block belongs to.
    pub fn object(&self) -> ObjectKey {
        ObjectKey {
            endpoint: self.endpoint.clone(),
            bucket: self.bucket.clone(),
            key: self.key.clone(),
            etag: self.etag.clone(),
        }
    }
}

/// What the sidecar says about a whole-object file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub size: u64,
    pub block_size: u64,
    /// The bytes each crc covers (`block_size` in format 1).
    pub chunk: u64,
    /// crc32c of each `chunk` piece of the data (the last one may be shorter).
    pub crcs: Vec<u32>,
}

impl ObjectMeta {
    /// The byte range of block `index`, if the object has it.
    pub fn piece(&self, index: u64) -> Option<std::ops::Range<u64>> {
        let start = index.checked_mul(self.block_size)?;
        (start < self.size).then(|| start..self.size.min(start + self.block_size))
    }
}

/// The sidecar contents for `obj`.
pub fn encode_meta(obj: &ObjectKey, meta: &ObjectMeta) -> Vec<u8> {
    let mut body = BytesMut::with_capacity(64 + obj.key.len() + 4 * meta.crcs.len());
    body.put_u64_le(meta.size);
    body.put_u64_le(meta.block_size);
    body.put_u64_le(meta.chunk);
    put_names(&mut body, [&obj.endpoint, &obj.bucket, &obj.key, &obj.etag]);
    body.put_u64_le(meta.crcs.len() as u64);
    for crc in &meta.crcs {
        body.put_u32_le(*crc);
    }
    seal(MAGIC, &body)
}

/// The sidecar's contents, if it is intact, names `obj` and is consistent.
pub fn decode_meta(obj: &ObjectKey, file: &[u8]) -> Result<ObjectMeta, Invalid> {
    let v1 = file.get(..8) == Some(&MAGIC_1[..]);
    let mut r = if v1 {
        Reader::unseal(MAGIC_1, file, 16 + 16 + 8)?
    } else {
        Reader::unseal(MAGIC, file, 24 + 16 + 8)?
    };
    let size = r.u64()?;
    let block_size = r.u64()?;
    let chunk = if v1 { block_size } else { r.u64()? };
    if !r.names_are([&obj.endpoint, &obj.bucket, &obj.key, &obj.etag])? {
        return Err(Invalid::OtherBlock);
    }
    let count = r.u64()?;
    // Pieces tile blocks (so a block's pieces are its own, and checking a piece never needs
    // more than a block in memory).
    if block_size == 0 || chunk == 0 || block_size % chunk != 0 || count != size.div_ceil(chunk) {
        return Err(Invalid::Malformed);
    }
    let crcs = (0..count).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
    if r.rest() != 0 {
        return Err(Invalid::Malformed);
    }
    Ok(ObjectMeta {
        size,
        block_size,
        chunk,
        crcs,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn obj() -> ObjectKey {
        ObjectKey {
            endpoint: "".into(),
            bucket: "b".into(),
            key: "data/x.bin".into(),
            etag: "\"abc\"".into(),
        }
    }

    #[test]
    fn meta_round_trips_and_every_flipped_byte_is_refused() {
        let meta = ObjectMeta {
            size: 10,
            block_size: 4,
            chunk: 2,
            crcs: vec![1, 2, 3, 4, 5],
        };
        let file = encode_meta(&obj(), &meta);
        assert_eq!(decode_meta(&obj(), &file), Ok(meta.clone()));
        for i in 0..file.len() {
            let mut bad = file.clone();
            bad[i] ^= 0x01;
            assert!(
                decode_meta(&obj(), &bad).is_err(),
                "flipped byte {i} accepted"
            );
        }
        let other = ObjectKey {
            etag: "\"abd\"".into(),
            ..obj()
        };
        assert_eq!(decode_meta(&other, &file), Err(Invalid::OtherBlock));
        assert_eq!(meta.piece(2), Some(8..10));
        assert_eq!(meta.piece(3), None);
    }

    /// A format-1 sidecar, as Ferry wrote them before pieces were checked one by one.
    pub(crate) fn encode_meta_1(
        obj: &ObjectKey,
        size: u64,
        block_size: u64,
        crcs: &[u32],
    ) -> Vec<u8> {
        let mut body = BytesMut::new();
        body.put_u64_le(size);
        body.put_u64_le(block_size);
        put_names(&mut body, [&obj.endpoint, &obj.bucket, &obj.key, &obj.etag]);
        body.put_u64_le(crcs.len() as u64);
        for crc in crcs {
            body.put_u32_le(*crc);
        }
        seal(MAGIC_1, &body)
    }

    #[test]
    fn a_format_1_sidecar_is_read_with_one_piece_a_block() {
        let file = encode_meta_1(&obj(), 10, 4, &[7, 8, 9]);
        let meta = decode_meta(&obj(), &file).unwrap();
        assert_eq!(
            (meta.chunk, meta.block_size, meta.crcs),
            (4, 4, vec![7, 8, 9])
        );
        // Its count must fit its pieces.
        assert!(decode_meta(&obj(), &encode_meta_1(&obj(), 10, 4, &[7, 8])).is_err());
        // Pieces must tile blocks.
        let meta = ObjectMeta {
            size: 12,
            block_size: 4,
            chunk: 3,
            crcs: vec![1, 2, 3, 4],
        };
        assert!(decode_meta(&obj(), &encode_meta(&obj(), &meta)).is_err());
    }

    /// The fuzz corpus's seeds, written by hand from the format above (not by this code), read.
    #[test]
    fn the_documented_sidecar_formats_are_the_ones_read() {
        let obj = ObjectKey {
            endpoint: "http://127.0.0.1:7070".into(),
            bucket: "data".into(),
            key: "train/shard-0001.tar".into(),
            etag: "\"9b2cf535f27731c974343645a3985328\"".into(),
        };
        let v2 = include_bytes!("../../../fuzz/corpus/cache_files/seed-sidecar-format2");
        let meta = decode_meta(&obj, v2).unwrap();
        assert_eq!(
            (meta.size, meta.block_size, meta.chunk),
            (200 << 10, 64 << 10, 64 << 10)
        );
        assert_eq!(meta.crcs, vec![0, 1, 2, 3]);
        let v1 = include_bytes!("../../../fuzz/corpus/cache_files/seed-sidecar-format1");
        let meta = decode_meta(&obj, v1).unwrap();
        assert_eq!(
            (meta.block_size, meta.chunk, meta.crcs),
            (128 << 10, 128 << 10, vec![0, 1])
        );
    }

    #[test]
    fn an_object_and_its_blocks_never_share_a_file_id() {
        let o = obj();
        let ids: Vec<FileId> = (0..4).map(|i| o.block(i).file_id()).collect();
        assert!(!ids.contains(&o.file_id()));
        assert_eq!(o.block(2).object(), o);
    }
}
