//! `mount-s3-bench`: a small mount program on top of Mountpoint's published library crates
//! (`mountpoint-s3-fs`, `mountpoint-s3-client`), so that Ferry's benchmark can compare against
//! Mountpoint's data path. crates.io carries only the libraries, not the `mount-s3` CLI; this is
//! our own minimal front end, written against the library API, with mount-s3's defaults where the
//! library leaves a choice (8 MiB parts, 16 FUSE threads, 95% of memory as the memory target).
//!
//! Usage:
//!   mount-s3-bench BUCKET DIR [--endpoint-url URL] [--region R] [--force-path-style]
//!                  [--read-only] [--metadata-ttl SECS|indefinite|minimal]
//!                  [--allow-delete] [--allow-overwrite] [--no-upload-checksums]
//!
//! It always runs in the foreground; SIGINT/SIGTERM or `umount DIR` ends it. Credentials come from
//! the CRT's default chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment).

use std::path::PathBuf;

use anyhow::{Context, bail};
use mountpoint_s3_client::config::{AddressingStyle, S3ClientAuthConfig};
use mountpoint_s3_client::user_agent::UserAgent;
use mountpoint_s3_fs::data_cache::DataCacheConfig;
use mountpoint_s3_fs::fs::{CacheConfig, TimeToLive, UploadChecksumAlgorithm};
use mountpoint_s3_fs::fuse::config::{FuseOptions, FuseSessionConfig, MountPoint};
use mountpoint_s3_fs::memory::{CandidateSize, PagedPool, effective_total_memory};
use mountpoint_s3_fs::s3::config::{
    ClientConfig, MemoryLimitSetting, PartConfig, Region, TargetThroughputSetting,
};
use mountpoint_s3_fs::s3::{Bucket, Prefix, S3Path};
use mountpoint_s3_fs::{MountpointConfig, Runtime, S3FilesystemConfig, Superblock, SuperblockConfig};

const PART_SIZE: usize = 8 * 1024 * 1024;
const FUSE_THREADS: usize = 16;

struct Args {
    bucket: String,
    dir: PathBuf,
    endpoint_url: Option<String>,
    region: String,
    path_style: bool,
    read_only: bool,
    ttl: Option<TimeToLive>,
    allow_delete: bool,
    allow_overwrite: bool,
    upload_checksums: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut positional = Vec::new();
    let mut a = Args {
        bucket: String::new(),
        dir: PathBuf::new(),
        endpoint_url: None,
        region: "us-east-1".into(),
        path_style: false,
        read_only: false,
        ttl: None,
        allow_delete: false,
        allow_overwrite: false,
        upload_checksums: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--endpoint-url" => a.endpoint_url = Some(value("--endpoint-url")?),
            "--region" => a.region = value("--region")?,
            "--force-path-style" => a.path_style = true,
            "--read-only" => a.read_only = true,
            "--allow-delete" => a.allow_delete = true,
            "--allow-overwrite" => a.allow_overwrite = true,
            "--no-upload-checksums" => a.upload_checksums = false,
            "--foreground" | "-f" => {}
            "--metadata-ttl" => {
                let v = value("--metadata-ttl")?;
                a.ttl = Some(TimeToLive::new_from_str(&v).map_err(|e| anyhow::anyhow!("--metadata-ttl {v}: {e}"))?);
            }
            s if s.starts_with('-') => bail!("unknown flag {s}"),
            _ => positional.push(arg),
        }
    }
    let [bucket, dir] = <[String; 2]>::try_from(positional)
        .map_err(|_| anyhow::anyhow!("usage: mount-s3-bench BUCKET DIR [flags]"))?;
    a.bucket = bucket;
    a.dir = PathBuf::from(dir);
    Ok(a)
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;

    let memory_limit = MemoryLimitSetting::Default(effective_total_memory() as usize * 95 / 100);
    let part_config = PartConfig::with_part_size(PART_SIZE).validate(memory_limit)?;
    let pool = PagedPool::config()
        .with_candidate_sizes([
            CandidateSize::new(part_config.read_size_bytes),
            CandidateSize::new(part_config.write_size_bytes),
        ])
        .with_memory_limit(memory_limit.bytes())
        .build();

    let s3_path = S3Path::new(Bucket::new(args.bucket.clone())?, Prefix::empty());
    let client = ClientConfig {
        region: Region::new_user_specified(args.region.clone()),
        endpoint_url: args.endpoint_url.clone(),
        addressing_style: if args.path_style { AddressingStyle::Path } else { AddressingStyle::Automatic },
        dual_stack: false,
        transfer_acceleration: false,
        auth_config: S3ClientAuthConfig::Default,
        requester_pays: false,
        expected_bucket_owner: None,
        throughput_target: TargetThroughputSetting::Default,
        bind: None,
        part_config,
        user_agent: UserAgent::new(Some("ferry-bench-mountpoint".into())),
        tls_config: None,
    }
    .create_client(pool.clone(), Some(&s3_path))
    .context("creating the S3 client")?;

    let cache_config = args.ttl.map(CacheConfig::new).unwrap_or_default();
    let fs_config = S3FilesystemConfig {
        cache_config: cache_config.clone(),
        allow_delete: args.allow_delete,
        allow_overwrite: args.allow_overwrite,
        read_only: args.read_only,
        upload_checksum_algorithm: args.upload_checksums.then_some(UploadChecksumAlgorithm::Crc32c),
        ..Default::default()
    };
    let fuse_config = FuseSessionConfig::new(
        MountPoint::new(&args.dir)?,
        FuseOptions {
            read_only: args.read_only,
            ..Default::default()
        },
        FUSE_THREADS,
    )?;
    let superblock = Superblock::new(
        client.clone(),
        s3_path,
        SuperblockConfig {
            cache_config,
            s3_personality: fs_config.s3_personality,
        },
    );
    let runtime = Runtime::new(client.event_loop_group());
    let session = MountpointConfig::new(fuse_config, fs_config, DataCacheConfig::default())?
        .create_fuse_session(superblock, client, runtime, pool)?;
    eprintln!("mount-s3-bench: mounted {} at {}", args.bucket, args.dir.display());
    session.join()
}
