//! [`MountConfig`] and [`MetadataTtl`]: what one mount shows and how long it trusts cached metadata.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet};
use serde::{Deserialize, Serialize};

use crate::names::KEY_MAX;

/// What `fs_name` keeps as it is: letters, digits and `-._~/` (everything S3 bucket names use, and
/// the common key characters). Everything else — `%` itself, `,` (the mount option separator),
/// `=`, `\`, whitespace, control and non-ASCII characters — is percent-encoded, so any bucket and
/// prefix give a source the kernel, `fusermount` and `/proc/mounts` carry unchanged.
const FS_NAME_KEEP: &AsciiSet = ferry_store::PATH_KEEP;

/// The longest `fs_name` accepted: the kernel copies a mount source of at most a page (4 KiB), and
/// the longest encoded name (a 63-byte bucket, a 1023-byte prefix of 3-byte escapes) stays below
/// this.
pub const FS_NAME_MAX: usize = 3300;

/// The source shown in `/proc/mounts` for `bucket` and `prefix`: `ferry:bucket/prefix`, with every
/// character outside letters, digits and `-._~/` percent-encoded (`ferry:data/my%20data/`).
/// [`decode_fs_name`] gives the bucket and prefix back.
pub fn fs_name(bucket: &str, prefix: &str) -> String {
    let path = if prefix.is_empty() {
        bucket.to_owned()
    } else {
        format!("{bucket}/{prefix}")
    };
    format!("ferry:{}", utf8_percent_encode(&path, FS_NAME_KEEP))
}

/// `bucket/prefix` (or `bucket`) back from an [`fs_name`]; `None` if it is not one.
pub fn decode_fs_name(fs_name: &str) -> Option<String> {
    let encoded = fs_name.strip_prefix("ferry:")?;
    percent_decode_str(encoded)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

/// Everything one mount needs to know besides the store and the target directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountConfig {
    pub bucket: String,
    /// `""` (the whole bucket) or a key prefix ending in `/`.
    pub prefix: String,
    pub read_only: bool,
    /// `unlink` / `rmdir` allowed (otherwise `EPERM`).
    pub allow_delete: bool,
    /// Opening an existing object with `O_TRUNC` (replacing it) allowed (otherwise `EPERM`).
    pub allow_overwrite: bool,
    pub uid: u32,
    pub gid: u32,
    /// Permission bits of every file (default `0o644`).
    pub file_mode: u16,
    /// Permission bits of every directory (default `0o755`).
    pub dir_mode: u16,
    /// Let users other than the mounting one use the mount (FUSE `allow_other`).
    pub allow_other: bool,
    /// How long metadata (names, sizes, ETags, misses) learned from S3 is trusted.
    pub metadata_ttl: MetadataTtl,
    /// The source shown in `/proc/mounts`, e.g. `ferry:bucket/prefix`.
    pub fs_name: String,
    /// The S3 endpoint URL (`""` = AWS's default): part of every node-cache block key.
    #[serde(default)]
    pub endpoint: String,
    /// Whether reads use the node plugin's block cache, when it has one (`cache: none` opts out).
    #[serde(default = "yes")]
    pub node_cache: bool,
}

fn yes() -> bool {
    true
}

impl MountConfig {
    /// A read-only mount of the whole `bucket` with the default modes, owner root and a 1 s TTL.
    pub fn new(bucket: impl Into<String>) -> Self {
        let bucket = bucket.into();
        MountConfig {
            fs_name: fs_name(&bucket, ""),
            bucket,
            prefix: String::new(),
            read_only: true,
            allow_delete: false,
            allow_overwrite: false,
            uid: 0,
            gid: 0,
            file_mode: 0o644,
            dir_mode: 0o755,
            allow_other: false,
            metadata_ttl: MetadataTtl::default(),
            endpoint: String::new(),
            node_cache: true,
        }
    }

    /// Checks what the filesystem relies on: a bucket, a well-formed prefix, modes that are
    /// permission bits and an `fs_name` that survives the mount option string.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.bucket.is_empty() {
            return Err(ConfigError::new("bucket is empty"));
        }
        if !self.prefix.is_empty() {
            if !self.prefix.ends_with('/') {
                return Err(ConfigError::new("prefix must be empty or end with '/'"));
            }
            let segments = self.prefix[..self.prefix.len() - 1].split('/');
            for segment in segments {
                if segment.is_empty() || segment == "." || segment == ".." {
                    return Err(ConfigError::new(
                        "prefix has an empty, '.' or '..' segment (it must not start with '/' either)",
                    ));
                }
            }
            if self.prefix.len() >= KEY_MAX {
                return Err(ConfigError::new(
                    "prefix leaves no room for a key (1024 bytes)",
                ));
            }
        }
        if self.file_mode > 0o7777 || self.dir_mode > 0o7777 {
            return Err(ConfigError::new(
                "file_mode and dir_mode are permission bits (<= 0o7777)",
            ));
        }
        if self.fs_name.is_empty()
            || self.fs_name.len() > FS_NAME_MAX
            || self
                .fs_name
                .chars()
                .any(|c| !c.is_ascii_graphic() || matches!(c, ',' | '=' | '\\'))
        {
            return Err(ConfigError::new(
                "fs_name must be 1 to 3300 printable ASCII characters without ',', '=' or '\\' (see fs_name())",
            ));
        }
        Ok(())
    }
}

/// [`MountConfig::new`] with an empty bucket, for struct-update syntax (set `bucket` and `fs_name`).
impl Default for MountConfig {
    fn default() -> Self {
        MountConfig::new("")
    }
}

/// A [`MountConfig`] the filesystem cannot serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid mount config: {0}")]
pub struct ConfigError(String);

impl ConfigError {
    fn new(msg: &str) -> Self {
        ConfigError(msg.to_owned())
    }
}

/// How long cached metadata stays valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetadataTtl {
    Duration(Duration),
    /// Never expires: for data that does not change while mounted (datasets).
    Indefinite,
}

/// What the kernel is told for [`MetadataTtl::Indefinite`]: about 100 years (the kernel saturates
/// large values, but its seconds field is signed, so `u64::MAX` would be negative).
const KERNEL_FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl MetadataTtl {
    /// The TTL to hand to the kernel for entries and attributes.
    pub fn kernel_ttl(self) -> Duration {
        match self {
            MetadataTtl::Duration(d) => d.min(KERNEL_FOREVER),
            MetadataTtl::Indefinite => KERNEL_FOREVER,
        }
    }
}

impl Default for MetadataTtl {
    fn default() -> Self {
        MetadataTtl::Duration(Duration::from_secs(1))
    }
}

impl fmt::Display for MetadataTtl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetadataTtl::Duration(d) => write!(f, "{}", d.as_secs_f64()),
            MetadataTtl::Indefinite => f.write_str("indefinite"),
        }
    }
}

/// Parses `indefinite` (any case) or a non-negative number of seconds (`0`, `1`, `2.5`).
impl FromStr for MetadataTtl {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("indefinite") {
            return Ok(MetadataTtl::Indefinite);
        }
        let secs: f64 = s.parse().map_err(|_| {
            ConfigError(format!(
                "metadata TTL {s:?} is neither \"indefinite\" nor a number of seconds"
            ))
        })?;
        Duration::try_from_secs_f64(secs)
            .map(MetadataTtl::Duration)
            .map_err(|_| ConfigError(format!("metadata TTL {s:?} is negative or too large")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_parses() {
        assert_eq!("indefinite".parse(), Ok(MetadataTtl::Indefinite));
        assert_eq!(" Indefinite ".parse(), Ok(MetadataTtl::Indefinite));
        assert_eq!("0".parse(), Ok(MetadataTtl::Duration(Duration::ZERO)));
        assert_eq!(
            "2.5".parse(),
            Ok(MetadataTtl::Duration(Duration::from_millis(2500)))
        );
        assert!("-1".parse::<MetadataTtl>().is_err());
        assert!("soon".parse::<MetadataTtl>().is_err());
        assert!("NaN".parse::<MetadataTtl>().is_err());
        for ttl in [
            MetadataTtl::Indefinite,
            MetadataTtl::Duration(Duration::from_secs(3)),
        ] {
            assert_eq!(ttl.to_string().parse(), Ok(ttl));
        }
        assert_eq!(MetadataTtl::Indefinite.kernel_ttl(), KERNEL_FOREVER);
    }

    #[test]
    fn config_validates() {
        let ok = MountConfig::new("b");
        assert!(ok.validate().is_ok());
        for prefix in ["a", "/a/", "a//", "./", "a/../"] {
            let cfg = MountConfig {
                prefix: prefix.into(),
                ..MountConfig::new("b")
            };
            assert!(cfg.validate().is_err(), "{prefix}");
        }
        let cfg = MountConfig {
            prefix: "a/b/".into(),
            ..MountConfig::new("b")
        };
        assert!(cfg.validate().is_ok());
        assert!(MountConfig::new("").validate().is_err());
        for bad in ["a,b", "a b", "a=b", "a\\b", "é", "a\tb", ""] {
            let cfg = MountConfig {
                fs_name: bad.into(),
                ..MountConfig::new("b")
            };
            assert!(cfg.validate().is_err(), "{bad:?}");
        }
        let cfg = MountConfig {
            file_mode: 0o10000,
            ..MountConfig::new("b")
        };
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn fs_names_encode_what_the_mount_option_string_cannot_carry() {
        assert_eq!(fs_name("data", ""), "ferry:data");
        assert_eq!(fs_name("data", "a/b/"), "ferry:data/a/b/");
        assert_eq!(fs_name("data", "my data/"), "ferry:data/my%20data/");
        assert_eq!(fs_name("data", "a,b=c\\%/"), "ferry:data/a%2Cb%3Dc%5C%25/");
        assert_eq!(fs_name("data", "é\n/"), "ferry:data/%C3%A9%0A/");
        assert_eq!(
            decode_fs_name("ferry:data/a%2Cb%3Dc%5C%25/").unwrap(),
            "data/a,b=c\\%/"
        );
        // The longest prefix a volume may have, all 3-byte escapes, still fits.
        let longest = format!("{}/", "\u{3042}".repeat(1020 / 3));
        let cfg = MountConfig {
            prefix: longest.clone(),
            fs_name: fs_name(&"b".repeat(63), &longest),
            ..MountConfig::new("b")
        };
        assert!(cfg.validate().is_ok(), "{}", cfg.fs_name.len());
    }
}
