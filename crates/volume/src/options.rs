//! PV `mountOptions` in Mountpoint's (`mount-s3`) syntax.
//!
//! Kubernetes hands a PV's `mountOptions` to the node as `mount_flags`, one string per list entry.
//! Each entry is `name`, `name value`, `name=value`, optionally with a leading `--`, as Mountpoint's
//! CSI driver accepts them, so a PV written for it works by changing only the driver name.

use std::str::FromStr;

use crate::{validate, VolumeError};

const WHAT: &str = "mount option";

/// How long metadata (attributes, listings, negative lookups) is trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetadataTtl {
    Seconds(u64),
    /// Never revalidate: for datasets that do not change while mounted.
    Indefinite,
    /// Revalidate as soon as allowed (`minimal` in mount-s3): no caching beyond one operation.
    Minimal,
}

impl FromStr for MetadataTtl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "indefinite" => Ok(MetadataTtl::Indefinite),
            "minimal" => Ok(MetadataTtl::Minimal),
            n => n.parse::<u64>().map(MetadataTtl::Seconds).map_err(|_| {
                format!(
                    "{} is not a number of seconds, \"indefinite\" or \"minimal\"",
                    crate::quote(s)
                )
            }),
        }
    }
}

/// Mount options. `None` fields take the node's defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct MountOptions {
    pub prefix: Option<String>,
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
    pub force_path_style: bool,
    pub read_only: bool,
    pub allow_delete: bool,
    pub allow_overwrite: bool,
    pub allow_other: bool,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub file_mode: Option<u16>,
    pub dir_mode: Option<u16>,
    pub metadata_ttl: Option<MetadataTtl>,
    /// `cache none`: keep this volume's reads out of the node cache.
    pub no_cache: bool,
    /// Warm the node cache after publishing: sub-prefixes of the volume (`[""]` = all of it).
    /// Set by the `prefetchOnMount` volume attribute.
    pub warm_up: Option<Vec<String>>,
}

/// Parses `prefetchOnMount`: `true` → the whole volume, `false` → none, else comma-separated
/// sub-prefixes (no leading `/`, no `.`/`..` or empty segments).
pub fn parse_warm_up(what: &'static str, value: &str) -> Result<Option<Vec<String>>, VolumeError> {
    // As YAML and Kubernetes write booleans too (`True`, `FALSE`): never a sub-prefix named so.
    match value.trim() {
        v if v.eq_ignore_ascii_case("true") => return Ok(Some(vec![String::new()])),
        v if v.eq_ignore_ascii_case("false") || v.is_empty() => return Ok(None),
        _ => {}
    }
    let mut out = Vec::new();
    for p in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let body = p.strip_suffix('/').unwrap_or(p);
        if body
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
        {
            return Err(VolumeError::invalid(
                what,
                crate::keys::PREFETCH_ON_MOUNT,
                format!("{}: sub-prefixes must be relative to the volume, without empty, '.' or '..' segments", crate::quote(p)),
            ));
        }
        out.push(p.to_owned());
    }
    Ok(Some(out))
}

/// Parses a `cache` value: `none` (opt out of the node cache) → `true`, `node` → `false`.
pub fn parse_cache(what: &'static str, value: &str) -> Result<bool, VolumeError> {
    match value {
        "none" => Ok(true),
        "node" => Ok(false),
        other => Err(VolumeError::invalid(
            what,
            "cache",
            format!(
                "{}: only \"none\" (keep this volume out of the node cache) or \"node\" is accepted; \
                 the node cache's directory and size are set on the node plugin (--cache-dir)", crate::quote(other)
            ),
        )),
    }
}

/// mount-s3 options that only tune logging or threads: accepted so migrated PVs mount, and ignored
/// because the node plugin's own settings govern them.
const IGNORED: &[&str] = &[
    "debug",
    "debug-crt",
    "no-log",
    "log-directory",
    "log-metrics",
    "max-threads",
    "foreground",
    "auto-unmount",
];

/// mount-s3 options Ferry refuses, because silently ignoring them would change what lands in S3
/// or who pays for it.
const REFUSED: &[&str] = &[
    "storage-class",
    "sse",
    "sse-kms-key-id",
    "requester-pays",
    "expected-bucket-owner",
    "transfer-acceleration",
    "dual-stack",
    "incremental-upload",
    "upload-checksums",
    "bucket-type",
    "profile",
    "allow-root",
    "cache-xz",
    "max-cache-size",
    "negative-metadata-ttl",
];

impl MountOptions {
    /// Parses mount flags. An unknown or malformed option is an error naming it, and so is an
    /// option given twice with different values (`uid=1` and `uid=2`, `ro` and `rw`): the last
    /// one winning would hide the other from whoever wrote it.
    pub fn parse<S: AsRef<str>>(flags: &[S]) -> Result<Self, VolumeError> {
        let mut o = MountOptions::default();
        // Each option's first entry, and what it alone makes of the defaults.
        let mut seen: Vec<(&'static str, &str, MountOptions)> = Vec::new();
        for raw in flags {
            let raw = raw.as_ref();
            // Kubernetes may join several options with commas in one entry.
            for entry in raw.split(',').map(str::trim).filter(|e| !e.is_empty()) {
                let mut alone = MountOptions::default();
                let key = alone.apply(entry)?;
                match seen.iter().find(|(k, _, _)| *k == key) {
                    Some((_, first, was)) if *was != alone => {
                        return Err(VolumeError::Conflict {
                            key: key.to_string(),
                            a: first.to_string(),
                            b: entry.to_string(),
                        })
                    }
                    Some(_) => {}
                    None => seen.push((key, entry, alone)),
                }
                o.apply(entry)?;
            }
        }
        Ok(o)
    }

    /// Applies one entry; returns the option it sets (`ro`, `rw` and `read-only` are one).
    fn apply(&mut self, entry: &str) -> Result<&'static str, VolumeError> {
        let entry = entry.strip_prefix("--").unwrap_or(entry);
        let (name, value) = match entry.split_once(['=', ' ']) {
            Some((n, v)) => (n.trim(), Some(v.trim())),
            None => (entry, None),
        };
        let need = |v: Option<&str>| -> Result<String, VolumeError> {
            match v {
                Some(v) if !v.is_empty() => Ok(v.to_string()),
                _ => Err(VolumeError::invalid(WHAT, name, "needs a value")),
            }
        };
        let flag = |v: Option<&str>| -> Result<bool, VolumeError> {
            match v {
                None => Ok(true),
                Some(v) => crate::parse_bool(WHAT, name, v),
            }
        };
        let num = |v: Option<&str>| -> Result<u32, VolumeError> {
            let v = need(v)?;
            match v.parse::<u32>() {
                // (uid_t)-1 means "no change" to chown(2): no file can be owned by it.
                Ok(u32::MAX) => Err(VolumeError::invalid(
                    WHAT,
                    name,
                    format!(
                        "{} is (uid_t)-1, which no file can be owned by",
                        crate::quote(&v)
                    ),
                )),
                Ok(n) => Ok(n),
                Err(_) => Err(VolumeError::invalid(
                    WHAT,
                    name,
                    format!("{} is not a number", crate::quote(&v)),
                )),
            }
        };
        let mode = |v: Option<&str>| -> Result<u16, VolumeError> {
            let v = need(v)?;
            u16::from_str_radix(v.trim_start_matches("0o"), 8)
                .ok()
                .filter(|m| *m <= 0o777)
                .ok_or_else(|| {
                    VolumeError::invalid(
                        WHAT,
                        name,
                        format!(
                            "{} is not an octal mode of permission bits (at most 777: no setuid, \
                             setgid or sticky bit)",
                            crate::quote(&v)
                        ),
                    )
                })
        };
        Ok(match name {
            "prefix" => {
                self.prefix = Some(validate::prefix(name, &need(value)?, true)?);
                "prefix"
            }
            "region" => {
                let v = need(value)?;
                validate::region(name, &v)?;
                self.region = Some(v);
                "region"
            }
            "endpoint-url" => {
                let v = need(value)?;
                validate::endpoint_url(name, &v)?;
                self.endpoint_url = Some(v);
                "endpoint-url"
            }
            "force-path-style" => {
                self.force_path_style = flag(value)?;
                "force-path-style"
            }
            "read-only" | "ro" => {
                self.read_only = flag(value)?;
                "read-only"
            }
            "rw" => {
                self.read_only = !flag(value)?;
                "read-only"
            }
            "allow-delete" => {
                self.allow_delete = flag(value)?;
                "allow-delete"
            }
            "allow-overwrite" => {
                self.allow_overwrite = flag(value)?;
                "allow-overwrite"
            }
            "allow-other" => {
                self.allow_other = flag(value)?;
                "allow-other"
            }
            "uid" => {
                self.uid = Some(num(value)?);
                "uid"
            }
            "gid" => {
                self.gid = Some(num(value)?);
                "gid"
            }
            "file-mode" => {
                self.file_mode = Some(mode(value)?);
                "file-mode"
            }
            "dir-mode" => {
                self.dir_mode = Some(mode(value)?);
                "dir-mode"
            }
            "metadata-ttl" => {
                let v = need(value)?;
                self.metadata_ttl =
                    Some(v.parse().map_err(|e| VolumeError::invalid(WHAT, name, e))?);
                "metadata-ttl"
            }
            "cache" => {
                self.no_cache = parse_cache(WHAT, &need(value)?)?;
                "cache"
            }
            // Never in conflict: nothing of them is kept.
            n if IGNORED.contains(&n) => "ignored",
            n if REFUSED.contains(&n) => {
                return Err(VolumeError::Unsupported {
                    what: WHAT,
                    key: n.to_string(),
                    reason:
                        "Ferry does not implement it yet, and ignoring it would change behaviour"
                            .to_string(),
                })
            }
            n => {
                return Err(VolumeError::Unknown {
                    what: WHAT,
                    key: n.to_string(),
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountpoint_syntax() {
        let o = MountOptions::parse(&[
            "prefix some/prefix/",
            "region us-west-2",
            "--endpoint-url=http://127.0.0.1:9000",
            "force-path-style",
            "uid=1000",
            "gid=2000",
            "dir-mode=755",
            "file-mode=0644",
            "allow-other",
            "allow-delete",
            "allow-overwrite",
            "read-only",
            "debug",
            "metadata-ttl indefinite",
        ])
        .unwrap();
        assert_eq!(o.prefix.as_deref(), Some("some/prefix/"));
        assert_eq!(o.region.as_deref(), Some("us-west-2"));
        assert_eq!(o.endpoint_url.as_deref(), Some("http://127.0.0.1:9000"));
        assert!(
            o.force_path_style
                && o.allow_other
                && o.allow_delete
                && o.allow_overwrite
                && o.read_only
        );
        assert_eq!((o.uid, o.gid), (Some(1000), Some(2000)));
        assert_eq!((o.file_mode, o.dir_mode), (Some(0o644), Some(0o755)));
        assert_eq!(o.metadata_ttl, Some(MetadataTtl::Indefinite));
    }

    #[test]
    fn comma_joined_entries() {
        let o = MountOptions::parse(&["uid=1,gid=2,allow-other"]).unwrap();
        assert_eq!((o.uid, o.gid, o.allow_other), (Some(1), Some(2), true));
    }

    /// The same option twice with different values is refused naming both entries; twice with
    /// the same value (a PV's list written by hand, `ro` beside `read-only`) is accepted.
    #[test]
    fn an_option_given_twice_with_different_values_is_a_conflict() {
        for (flags, a, b) in [
            (vec!["uid=1", "uid=2"], "uid=1", "uid=2"),
            (vec!["ro", "rw"], "ro", "rw"),
            (
                vec!["read-only", "read-only=false"],
                "read-only",
                "read-only=false",
            ),
            (
                vec!["metadata-ttl 60,metadata-ttl=indefinite"],
                "metadata-ttl 60",
                "metadata-ttl=indefinite",
            ),
            (vec!["--prefix=a/", "prefix b/"], "--prefix=a/", "prefix b/"),
        ] {
            let e = MountOptions::parse(&flags).unwrap_err();
            assert!(
                matches!(e, VolumeError::Conflict { .. }),
                "{flags:?}: {e:?}"
            );
            let m = e.to_string();
            assert!(m.contains(a) && m.contains(b), "{flags:?}: {m}");
        }
        for flags in [
            vec!["uid=1", "--uid 1"],
            vec!["ro", "read-only", "read-only=true", "rw=false"],
            vec!["debug", "debug"],
            vec!["dir-mode=755", "dir-mode=0755"],
        ] {
            MountOptions::parse(&flags).unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        }
    }

    #[test]
    fn bad_options_are_named() {
        for (flags, needle) in [
            (vec!["no-such-thing"], "no-such-thing"),
            (vec!["uid=abc"], "uid"),
            (vec!["file-mode=999"], "file-mode"),
            (vec!["file-mode=4755"], "no setuid"),
            (vec!["dir-mode=1777"], "sticky"),
            (vec!["uid=4294967295"], "(uid_t)-1"),
            (vec!["gid=4294967295"], "(uid_t)-1"),
            (vec!["region"], "region"),
            (vec!["prefix ../x"], "prefix"),
            (vec!["storage-class GLACIER"], "storage-class"),
            (vec!["allow-delete=maybe"], "allow-delete"),
            (vec!["metadata-ttl soon"], "metadata-ttl"),
        ] {
            let e = MountOptions::parse(&flags).unwrap_err();
            assert!(e.to_string().contains(needle), "{flags:?}: {e}");
        }
    }
}
