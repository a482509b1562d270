//! The benchmark's objects: their layout in the bucket, their sizes at a given `--scale`, their
//! content, and the preload that PUTs them straight to the S3 server (not through the proxy).
//!
//! Content is deterministic: the 8-byte word at offset `o` of object `seed` is
//! `splitmix64(seed ^ o/8)`, so a reader can check any sample of what it read without keeping a
//! copy (see [`check_sample`]).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use ferry_s3::S3Store;
use ferry_store::{CompletedPart, ObjectStore};
use futures::stream::{self, StreamExt, TryStreamExt};

pub const BUCKET: &str = "bench";
pub const MIB: u64 = 1024 * 1024;
const PART: u64 = 64 * MIB;

/// Names and sizes of everything the workloads read.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// P1, P2, P6, P10: one large object.
    pub big_key: String,
    pub big_size: u64,
    /// P4: many 128 KiB objects in one directory.
    pub small_dir: String,
    pub small_count: usize,
    pub small_size: u64,
    /// P5 and P14: a directory of `listing_count` entries.
    pub listing_dir: String,
    pub listing_count: usize,
    /// P7: shards read concurrently.
    pub shard_keys: Vec<String>,
    pub shard_size: u64,
    /// P11: a directory of `many_count` tiny objects.
    pub many_dir: String,
    pub many_count: usize,
    /// P3: how many files of which size each mounter writes.
    pub write_count: usize,
    pub write_size: u64,
}

impl Dataset {
    /// The sizes times `scale` (counts shrink too, with floors that keep each workload
    /// meaningful).
    pub fn new(scale: f64) -> Dataset {
        let bytes = |b: u64, floor: u64| (((b as f64) * scale) as u64).max(floor) / 4096 * 4096;
        let count = |c: usize, floor: usize| (((c as f64) * scale) as usize).max(floor);
        Dataset {
            big_key: "big/shard-1g.bin".into(),
            big_size: bytes(1024 * MIB, 16 * MIB),
            small_dir: "small".into(),
            small_count: count(2000, 100),
            small_size: 128 * 1024,
            listing_dir: "listing".into(),
            listing_count: count(2000, 100),
            shard_keys: (0..8).map(|i| format!("shards/shard-{i}.bin")).collect(),
            shard_size: bytes(256 * MIB, 4 * MIB),
            many_dir: "many".into(),
            many_count: count(100_000, 1000),
            write_count: count(500, 50),
            write_size: 8 * 1024,
        }
    }

    pub fn small_key(&self, i: usize) -> String {
        format!("{}/f-{i:05}.bin", self.small_dir)
    }
}

/// The value of the 64-bit word at word index `word` of the object with `seed` (also P12's source
/// of shuffles).
pub fn random_word(seed: u64, word: u64) -> u64 {
    let mut z =
        (seed ^ word.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seed per key, so that different objects differ.
pub fn seed_of(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Bytes `offset..offset+len` of the object with `seed` (`offset` 8-aligned).
pub fn content(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    debug_assert_eq!(offset % 8, 0);
    let mut out = Vec::with_capacity(len + 8);
    let mut w = offset / 8;
    while out.len() < len {
        out.extend_from_slice(&random_word(seed, w).to_le_bytes());
        w += 1;
    }
    out.truncate(len);
    out
}

/// Whether `data`, read at `offset` of the object with `seed`, starts with the right bytes (at
/// most 64 are compared: cheap enough to call on every buffer).
pub fn check_sample(seed: u64, offset: u64, data: &[u8]) -> bool {
    let start = offset.next_multiple_of(8);
    let skip = (start - offset) as usize;
    if skip >= data.len() {
        return true;
    }
    let n = (data.len() - skip).min(64);
    data[skip..skip + n] == content(seed, start, n)[..]
}

/// Objects of any size go up in one PUT, never a multipart upload, for a server whose multipart
/// upload the SDK cannot use: rclone's `serve s3` answers CreateMultipartUpload with an
/// `<InitiateMultipartUpload>` root (not `…Result`), which the SDK refuses. Set once by `main`,
/// before the dataset is written.
pub static SINGLE_PUT: std::sync::OnceLock<()> = std::sync::OnceLock::new();

/// Writes one object of `size` bytes: a single PUT up to 64 MiB, else a multipart upload with
/// four parts in flight (or always one PUT, see [`SINGLE_PUT`]).
pub async fn put_object(store: &S3Store, key: &str, size: u64) -> anyhow::Result<()> {
    let seed = seed_of(key);
    if size <= PART || SINGLE_PUT.get().is_some() {
        let body = Bytes::from(content(seed, 0, size as usize));
        store
            .put(BUCKET, key, body)
            .await
            .with_context(|| format!("PUT {key}"))?;
        return Ok(());
    }
    let upload = store.create_multipart(BUCKET, key).await?;
    let parts: Vec<(i32, u64)> = (0..size.div_ceil(PART))
        .map(|i| (i as i32 + 1, i * PART))
        .collect();
    let result: anyhow::Result<Vec<CompletedPart>> = stream::iter(parts)
        .map(|(n, off)| {
            let upload = upload.clone();
            async move {
                let len = PART.min(size - off) as usize;
                let body = Bytes::from(content(seed, off, len));
                store
                    .upload_part(BUCKET, key, &upload, n, body)
                    .await
                    .with_context(|| format!("UploadPart {n} of {key}"))
            }
        })
        .buffered(4)
        .try_collect()
        .await;
    match result {
        Ok(parts) => {
            store
                .complete_multipart(BUCKET, key, &upload, parts)
                .await?;
            Ok(())
        }
        Err(e) => {
            let _ = store.abort_multipart(BUCKET, key, &upload).await;
            Err(e)
        }
    }
}

/// Which parts of the dataset the selected workloads need.
#[derive(Debug, Clone, Copy, Default)]
pub struct Needs {
    pub big: bool,
    pub small: bool,
    pub listing: bool,
    pub shards: bool,
    pub many: bool,
}

/// PUTs everything `needs` asks for, with `parallel` requests in flight for the many small objects.
pub async fn preload(store: &S3Store, ds: &Dataset, needs: Needs) -> anyhow::Result<()> {
    let store = Arc::new(store.clone());
    let t = Instant::now();
    let mut jobs: Vec<(String, u64)> = Vec::new();
    if needs.big {
        jobs.push((ds.big_key.clone(), ds.big_size));
    }
    if needs.shards {
        jobs.extend(ds.shard_keys.iter().map(|k| (k.clone(), ds.shard_size)));
    }
    for (key, size) in &jobs {
        put_object(&store, key, *size).await?;
    }
    let mut small: Vec<(String, u64)> = Vec::new();
    if needs.small {
        small.extend((0..ds.small_count).map(|i| (ds.small_key(i), ds.small_size)));
    }
    if needs.listing {
        small.extend(
            (0..ds.listing_count).map(|i| (format!("{}/e-{i:05}.txt", ds.listing_dir), 1024)),
        );
    }
    if needs.many {
        small.extend((0..ds.many_count).map(|i| (format!("{}/o-{i:06}", ds.many_dir), 0)));
    }
    let total = small.len();
    stream::iter(small)
        .map(|(key, size)| {
            let store = store.clone();
            async move { put_object(&store, &key, size).await }
        })
        .buffer_unordered(64)
        .try_collect::<Vec<()>>()
        .await?;
    eprintln!(
        "preload: {} large object(s) and {total} small ones in {:.1} s",
        jobs.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
