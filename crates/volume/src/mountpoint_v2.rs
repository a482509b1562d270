//! Volume attributes only Mountpoint's S3 CSI driver v2 knows, as a migrated static PV carries
//! them: what each means on Ferry, and the notices that tell the user which ones Ferry ignores.
//!
//! v2 runs one Mountpoint Pod per volume and node; these attributes shape that pod (its cache
//! volume, its resources, its ServiceAccount, its environment). Ferry serves every mount from the
//! node plugin, so most of them have no Ferry meaning: they are validated as v2 validates them,
//! accepted, and named in a notice. The local cache maps to the node cache. Refused: only
//! `mountpointEnv.HTTPS_PROXY` (ignoring it would send the volume's requests around the proxy)
//! and the environment variables v2 itself refuses. Names and values follow
//! `pkg/driver/node/volumecontext`, `pkg/podmounter/mppod/creator.go` and
//! `pkg/driver/node/envprovider` of awslabs/mountpoint-s3-csi-driver.

use std::collections::BTreeMap;

use crate::{keys, quote, VolumeError};

const WHAT: &str = "volume attribute";

/// `cache`: the v2 local cache types. Both become the node cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LocalCache {
    /// `emptyDir`: an emptyDir volume of the Mountpoint Pod.
    EmptyDir,
    /// `ephemeral`: a generic ephemeral volume (a PVC per Mountpoint Pod).
    Ephemeral,
}

impl LocalCache {
    pub fn as_str(self) -> &'static str {
        match self {
            LocalCache::EmptyDir => "emptyDir",
            LocalCache::Ephemeral => "ephemeral",
        }
    }
}

/// A Kubernetes resource quantity (`500Mi`, `1.5Gi`, `500m`, `1e3`), kept as written.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Quantity(String);

impl Quantity {
    /// Parses a quantity the way Kubernetes' `resource.ParseQuantity` accepts one: an optional
    /// sign, a decimal number, and one suffix (binary `Ki`…`Ei`, decimal `n u m k M G T P E`, or an
    /// exponent `e3`/`E3`). A negative quantity is refused: no v2 attribute takes one.
    pub fn parse(key: &str, v: &str) -> Result<Self, VolumeError> {
        let bad = || {
            VolumeError::invalid(
                WHAT,
                key,
                format!(
                    "{} is not a Kubernetes quantity (like 500Mi, 2Gi or 500m)",
                    quote(v)
                ),
            )
        };
        let body = v.strip_prefix('+').unwrap_or(v);
        let digits_end = body
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(body.len());
        let (number, suffix) = body.split_at(digits_end);
        let (int, frac) = number.split_once('.').unwrap_or((number, ""));
        if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
            return Err(bad());
        }
        let suffix_ok = match suffix {
            "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => true,
            "n" | "u" | "m" | "k" | "M" | "G" | "T" | "P" | "E" => true,
            s => s
                .strip_prefix(['e', 'E'])
                .map(|e| e.strip_prefix(['+', '-']).unwrap_or(e))
                .is_some_and(|e| !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit())),
        };
        if !suffix_ok {
            return Err(bad());
        }
        Ok(Quantity(v.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A Kubernetes object name (DNS-1123 subdomain): lowercase letters, digits, `-` and `.`, at
/// most 253 characters, starting and ending with a letter or digit.
fn object_name(key: &str, v: &str) -> Result<String, VolumeError> {
    let ok = !v.is_empty()
        && v.len() <= 253
        && v.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && v.as_bytes()[0].is_ascii_alphanumeric()
        && v.as_bytes()[v.len() - 1].is_ascii_alphanumeric();
    if ok {
        Ok(v.to_string())
    } else {
        Err(VolumeError::invalid(
            WHAT,
            key,
            format!(
                "{} is not a Kubernetes object name (lowercase letters, digits, '-' and '.')",
                quote(v)
            ),
        ))
    }
}

/// The v2-only attributes of a volume context, validated. Default: none of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct MountpointV2 {
    /// `cache: emptyDir` or `cache: ephemeral`.
    pub local_cache: Option<LocalCache>,
    pub empty_dir_size_limit: Option<Quantity>,
    /// `cacheEmptyDirMedium: Memory` (tmpfs); `""`, the node's default medium, is unset.
    pub empty_dir_memory: bool,
    pub ephemeral_storage_class: Option<String>,
    pub ephemeral_storage_request: Option<Quantity>,
    /// `mountpointContainerResources{Requests,Limits}{Cpu,Memory}`, by key.
    pub container_resources: BTreeMap<String, Quantity>,
    pub pod_service_account: Option<String>,
    /// `mountpointEnv.NAME` that Ferry accepts (and ignores), by `NAME`.
    pub env: BTreeMap<String, String>,
}

/// One v2 attribute Ferry accepted but does not apply as v2 would: the attribute, and what Ferry
/// does instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub attribute: String,
    pub message: String,
}

impl std::fmt::Display for Notice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.attribute, self.message)
    }
}

/// What the node plugin's cache is, for the wording of the notices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeCache {
    /// The node plugin runs without `--cache-dir`.
    Off,
    /// The node cache, with its `--cache-max-size` in bytes.
    On { max_size: u64 },
}

const RESOURCE_KEYS: [&str; 4] = [
    keys::MOUNTPOINT_CONTAINER_RESOURCES_REQUESTS_CPU,
    keys::MOUNTPOINT_CONTAINER_RESOURCES_REQUESTS_MEMORY,
    keys::MOUNTPOINT_CONTAINER_RESOURCES_LIMITS_CPU,
    keys::MOUNTPOINT_CONTAINER_RESOURCES_LIMITS_MEMORY,
];

impl MountpointV2 {
    /// Applies one volume-context key if it is a v2-only one, after validating its value.
    /// `Ok(false)`: not one. (`cache: emptyDir|ephemeral` is parsed by [`parse_local_cache`].)
    pub(crate) fn apply(&mut self, key: &str, value: &str) -> Result<bool, VolumeError> {
        // v2 reads an empty value as unset (`cacheEmptyDirMedium: ""` in its CONFIGURATION.md);
        // not for `mountpointEnv.*`, checked by name first.
        let attribute = RESOURCE_KEYS.contains(&key)
            || [
                keys::CACHE_EMPTY_DIR_SIZE_LIMIT,
                keys::CACHE_EMPTY_DIR_MEDIUM,
                keys::CACHE_EPHEMERAL_STORAGE_CLASS_NAME,
                keys::CACHE_EPHEMERAL_STORAGE_RESOURCE_REQUEST,
                keys::MOUNTPOINT_POD_SERVICE_ACCOUNT_NAME,
            ]
            .contains(&key);
        if attribute && value.is_empty() {
            return Ok(true);
        }
        match key {
            keys::CACHE_EMPTY_DIR_SIZE_LIMIT => {
                self.empty_dir_size_limit = Some(Quantity::parse(key, value)?)
            }
            keys::CACHE_EMPTY_DIR_MEDIUM => {
                if value != "Memory" {
                    return Err(VolumeError::invalid(
                        WHAT,
                        key,
                        format!(
                            "{}: only \"Memory\" (or \"\", the node's default medium) is accepted",
                            quote(value)
                        ),
                    ));
                }
                self.empty_dir_memory = true;
            }
            keys::CACHE_EPHEMERAL_STORAGE_CLASS_NAME => {
                self.ephemeral_storage_class = Some(object_name(key, value)?)
            }
            keys::CACHE_EPHEMERAL_STORAGE_RESOURCE_REQUEST => {
                self.ephemeral_storage_request = Some(Quantity::parse(key, value)?)
            }
            keys::MOUNTPOINT_POD_SERVICE_ACCOUNT_NAME => {
                self.pod_service_account = Some(object_name(key, value)?)
            }
            k if RESOURCE_KEYS.contains(&k) => {
                self.container_resources
                    .insert(k.to_string(), Quantity::parse(key, value)?);
            }
            k => {
                let Some(name) = k.strip_prefix(keys::MOUNTPOINT_ENV_PREFIX) else {
                    return Ok(false);
                };
                match name {
                    // Without HTTPS_PROXY (refused below) NO_PROXY changes nothing: Ferry, like
                    // mount-s3 without a proxy, sends every request directly.
                    "NO_PROXY" => {
                        self.env.insert(name.to_string(), value.to_string());
                    }
                    // An empty proxy is no proxy.
                    "HTTPS_PROXY" if value.is_empty() => {}
                    "HTTPS_PROXY" => {
                        return Err(VolumeError::Unsupported {
                            what: WHAT,
                            key: k.to_string(),
                            reason: "Ferry sends S3 and STS requests directly, never through a \
                                     proxy: ignoring it would send this volume's requests around \
                                     the proxy. Remove it if the nodes can reach S3 directly"
                                .to_string(),
                        })
                    }
                    _ => {
                        return Err(VolumeError::Unsupported {
                            what: WHAT,
                            key: k.to_string(),
                            reason:
                                "Mountpoint's driver v2 accepts only mountpointEnv.HTTPS_PROXY \
                                     and mountpointEnv.NO_PROXY, and Ferry passes no environment \
                                     to a mount"
                                    .to_string(),
                        })
                    }
                }
            }
        }
        Ok(true)
    }

    /// Whether the context had any v2-only attribute.
    pub fn is_empty(&self) -> bool {
        *self == MountpointV2::default()
    }

    /// One notice per accepted v2 attribute Ferry does not apply as v2 would. `cached`: whether
    /// the volume's reads use the node cache (not opted out with `cache none`).
    pub fn notices(&self, cached: bool, node_cache: NodeCache) -> Vec<Notice> {
        let mut out = Vec::new();
        let mut notice = |attribute: &str, message: String| {
            out.push(Notice {
                attribute: attribute.to_string(),
                message,
            })
        };
        let node_limit = match node_cache {
            NodeCache::On { max_size } => {
                format!("the node cache's limit (--cache-max-size, {max_size} bytes here), shared by every volume on the node")
            }
            NodeCache::Off => "the node cache's limit (--cache-max-size)".to_string(),
        };
        if let Some(c) = self.local_cache {
            let key = format!("{}: {}", keys::CACHE, c.as_str());
            match (cached, node_cache) {
                (false, _) if self.empty_dir_memory && c == LocalCache::EmptyDir => notice(
                    &key,
                    "with cacheEmptyDirMedium \"Memory\": mounted uncached".to_string(),
                ),
                (false, _) => notice(
                    &key,
                    "the mount option \"cache none\" keeps this volume out of the node cache: \
                     mounted uncached"
                        .to_string(),
                ),
                (true, NodeCache::Off) => notice(
                    &key,
                    "this node plugin has no cache (--cache-dir is unset): mounted uncached"
                        .to_string(),
                ),
                (true, NodeCache::On { .. }) => notice(
                    &key,
                    "served by Ferry's node cache, shared by every volume on the node, instead of \
                     a cache volume of its own"
                        .to_string(),
                ),
            }
        }
        let empty_dir = self.local_cache == Some(LocalCache::EmptyDir);
        let unused = |for_cache: &str| {
            format!("has no effect without \"cache: {for_cache}\" (as in Mountpoint's driver)")
        };
        if let Some(q) = &self.empty_dir_size_limit {
            notice(
                keys::CACHE_EMPTY_DIR_SIZE_LIMIT,
                if empty_dir {
                    format!(
                        "{}: Ferry has no per-volume cache limit; {node_limit} applies",
                        quote(q.as_str())
                    )
                } else {
                    unused("emptyDir")
                },
            );
        }
        if self.empty_dir_memory {
            let message = match empty_dir {
                false => unused("emptyDir"),
                true => {
                    "\"Memory\": v2 kept this cache off the node's disk, and Ferry's node cache \
                     is on disk (--cache-dir): the volume reads uncached (the kernel's page \
                     cache keeps hot data in memory)"
                        .to_string()
                }
            };
            notice(keys::CACHE_EMPTY_DIR_MEDIUM, message);
        }
        let ephemeral = self.local_cache == Some(LocalCache::Ephemeral);
        for (key, value) in [
            (
                keys::CACHE_EPHEMERAL_STORAGE_CLASS_NAME,
                self.ephemeral_storage_class.clone(),
            ),
            (
                keys::CACHE_EPHEMERAL_STORAGE_RESOURCE_REQUEST,
                self.ephemeral_storage_request
                    .as_ref()
                    .map(|q| q.as_str().to_string()),
            ),
        ] {
            if let Some(v) = value {
                notice(
                    key,
                    if ephemeral {
                        format!(
                            "{}: no PVC is created for a cache; {node_limit} applies",
                            quote(&v)
                        )
                    } else {
                        unused("ephemeral")
                    },
                );
            }
        }
        for (key, q) in &self.container_resources {
            notice(
                key,
                format!(
                    "{}: Ferry runs no Mountpoint Pod; the node plugin serves the mount within \
                     its DaemonSet's resources and its memory budget (--memory-budget)",
                    quote(q.as_str())
                ),
            );
        }
        if let Some(sa) = &self.pod_service_account {
            notice(
                keys::MOUNTPOINT_POD_SERVICE_ACCOUNT_NAME,
                format!(
                    "{}: Ferry runs no Mountpoint Pod. The credentials are unchanged: as in \
                     Mountpoint's driver v2 they come from authenticationSource and \
                     nodePublishSecretRef, never from the Mountpoint Pod's ServiceAccount",
                    quote(sa)
                ),
            );
        }
        for name in self.env.keys() {
            notice(
                &format!("{}{name}", keys::MOUNTPOINT_ENV_PREFIX),
                "ignored: Ferry uses no proxy, so there is nothing to exempt".to_string(),
            );
        }
        out
    }
}

/// Parses the v2 values of `cache`: `emptyDir` and `ephemeral`. `None`: not a v2 value.
pub(crate) fn parse_local_cache(value: &str) -> Option<LocalCache> {
    match value {
        "emptyDir" => Some(LocalCache::EmptyDir),
        "ephemeral" => Some(LocalCache::Ephemeral),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        for ok in [
            "1", "500Mi", "2Gi", "1.5Gi", "500m", "0.5", ".5", "1e3", "1E-3", "+4Gi", "10G", "1Ti",
        ] {
            Quantity::parse("k", ok).unwrap();
        }
        for bad in [
            "", "Gi", "1GB", "1gi", "-1Gi", "1..5", "1e", "1 Gi", "two", "1Mi ",
        ] {
            let e = Quantity::parse("cacheEmptyDirSizeLimit", bad).unwrap_err();
            assert!(
                e.to_string().contains("cacheEmptyDirSizeLimit"),
                "{bad}: {e}"
            );
        }
    }

    use crate::VolumeSpec;
    use std::collections::HashMap;

    const ON: NodeCache = NodeCache::On { max_size: 20 << 30 };

    fn spec(extra: &[(&str, &str)], flags: &[&str]) -> Result<VolumeSpec, VolumeError> {
        let mut ctx: HashMap<String, String> = extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ctx.insert("bucketName".into(), "amzn-s3-demo-bucket".into());
        VolumeSpec::from_publish(&ctx, flags)
    }

    fn notices(s: &VolumeSpec, node: NodeCache) -> Vec<String> {
        s.migration_notices(node)
            .iter()
            .map(|n| n.to_string())
            .collect()
    }

    fn refused(extra: &[(&str, &str)], key: &str, why: &str) {
        let e = spec(extra, &[]).unwrap_err().to_string();
        assert!(e.contains(&format!("{key:?}")), "{extra:?}: {e}");
        assert!(e.contains(why), "{extra:?}: {e}");
    }

    #[test]
    fn a_volume_written_for_ferry_has_no_notices() {
        let s = spec(&[("cache", "node")], &[]).unwrap();
        assert!(s.mountpoint_v2.is_empty());
        assert!(s.migration_notices(ON).is_empty());
        assert!(s.migration_notices(NodeCache::Off).is_empty());
    }

    #[test]
    fn cache_types_map_to_the_node_cache() {
        for (v, c) in [
            ("emptyDir", LocalCache::EmptyDir),
            ("ephemeral", LocalCache::Ephemeral),
        ] {
            let s = spec(&[("cache", v)], &[]).unwrap();
            assert_eq!(s.mountpoint_v2.local_cache, Some(c));
            assert!(!s.options.no_cache, "{v}");
            let n = notices(&s, ON);
            assert_eq!(n.len(), 1, "{n:?}");
            assert!(
                n[0].starts_with(&format!("cache: {v}: served by Ferry's node cache")),
                "{n:?}"
            );
            // No node cache: mounted uncached, and said so.
            let n = notices(&s, NodeCache::Off);
            assert!(
                n[0].contains("--cache-dir is unset): mounted uncached"),
                "{n:?}"
            );
            // The mount option `cache none` still opts out, and the notice says so.
            let s = spec(&[("cache", v)], &["cache none"]).unwrap();
            assert!(s.options.no_cache);
            assert!(notices(&s, ON)[0].contains("\"cache none\""));
        }
        // v2's empty cache type is the default.
        let s = spec(&[("cache", "")], &[]).unwrap();
        assert!(!s.options.no_cache && s.mountpoint_v2.is_empty());
        // An unknown cache type names every accepted value.
        for bad in ["EmptyDir", "memory", "disk"] {
            refused(&[("cache", bad)], "cache", "\"emptyDir\" or \"ephemeral\"");
        }
        // StorageClasses keep Ferry's values only (v2 has no dynamic provisioning).
        let params: HashMap<String, String> = [("bucketName", "b-1"), ("cache", "emptyDir")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert!(crate::StorageClassParams::parse(&params).is_err());
    }

    #[test]
    fn empty_dir_size_limit_names_the_node_cache_limit() {
        let s = spec(
            &[("cache", "emptyDir"), ("cacheEmptyDirSizeLimit", "500Mi")],
            &[],
        )
        .unwrap();
        assert_eq!(
            s.mountpoint_v2.empty_dir_size_limit,
            Some(Quantity("500Mi".into()))
        );
        let n = notices(&s, ON);
        assert!(
            n[1].starts_with(
                "cacheEmptyDirSizeLimit: \"500Mi\": Ferry has no per-volume cache limit"
            ) && n[1].contains("--cache-max-size, 21474836480 bytes here"),
            "{n:?}"
        );
        // Without `cache: emptyDir` v2 ignores it too.
        let s = spec(&[("cacheEmptyDirSizeLimit", "2Gi")], &[]).unwrap();
        assert!(notices(&s, ON)[0].contains("has no effect without \"cache: emptyDir\""));
        refused(
            &[("cache", "emptyDir"), ("cacheEmptyDirSizeLimit", "2GB")],
            "cacheEmptyDirSizeLimit",
            "not a Kubernetes quantity",
        );
    }

    #[test]
    fn empty_dir_medium() {
        let s = spec(
            &[("cache", "emptyDir"), ("cacheEmptyDirMedium", "Memory")],
            &[],
        )
        .unwrap();
        assert!(s.mountpoint_v2.empty_dir_memory);
        // Never written to the node's disk: uncached.
        assert!(s.options.no_cache);
        let n = notices(&s, ON);
        assert!(
            n.iter().any(|n| n.starts_with(
                "cacheEmptyDirMedium: \"Memory\": v2 kept this cache off the node's disk"
            ) && n.contains("reads uncached")),
            "{n:?}"
        );
        refused(
            &[("cacheEmptyDirMedium", "memory")],
            "cacheEmptyDirMedium",
            "only \"Memory\" (or \"\"",
        );
        // v2 reads `""` as unset, for every attribute (its CONFIGURATION.md writes
        // `cacheEmptyDirMedium: ""` out); an empty HTTPS_PROXY is no proxy.
        let mut empty: Vec<(&str, &str)> = RESOURCE_KEYS.iter().map(|k| (*k, "")).collect();
        empty.extend([
            ("cacheEmptyDirMedium", ""),
            ("cacheEmptyDirSizeLimit", ""),
            ("cacheEphemeralStorageClassName", ""),
            ("cacheEphemeralStorageResourceRequest", ""),
            ("mountpointPodServiceAccountName", ""),
            ("mountpointEnv.HTTPS_PROXY", ""),
        ]);
        let s = spec(&empty, &[]).unwrap();
        assert!(s.mountpoint_v2.is_empty(), "{:?}", s.mountpoint_v2);
        // Still refused by name.
        refused(
            &[("mountpointEnv.AWS_PROFILE", "")],
            "mountpointEnv.AWS_PROFILE",
            "accepts only",
        );
    }

    #[test]
    fn ephemeral_cache_volume() {
        let s = spec(
            &[
                ("cache", "ephemeral"),
                ("cacheEphemeralStorageClassName", "s3-cache-ebs-sc"),
                ("cacheEphemeralStorageResourceRequest", "10Gi"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(
            s.mountpoint_v2.ephemeral_storage_class.as_deref(),
            Some("s3-cache-ebs-sc")
        );
        let n = notices(&s, ON);
        assert_eq!(n.len(), 3, "{n:?}");
        assert!(n[1].starts_with("cacheEphemeralStorageClassName: \"s3-cache-ebs-sc\": no PVC"));
        assert!(n[2].starts_with("cacheEphemeralStorageResourceRequest: \"10Gi\": no PVC"));
        refused(
            &[("cacheEphemeralStorageClassName", "GP2")],
            "cacheEphemeralStorageClassName",
            "not a Kubernetes object name",
        );
        refused(
            &[("cacheEphemeralStorageResourceRequest", "lots")],
            "cacheEphemeralStorageResourceRequest",
            "not a Kubernetes quantity",
        );
    }

    #[test]
    fn container_resources_are_accepted_and_named() {
        let s = spec(
            &[
                ("mountpointContainerResourcesRequestsCpu", "500m"),
                ("mountpointContainerResourcesRequestsMemory", "1Gi"),
                ("mountpointContainerResourcesLimitsCpu", "1"),
                ("mountpointContainerResourcesLimitsMemory", "2Gi"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(s.mountpoint_v2.container_resources.len(), 4);
        let n = notices(&s, NodeCache::Off);
        assert_eq!(n.len(), 4);
        assert!(n
            .iter()
            .all(|n| n.contains("Ferry runs no Mountpoint Pod") && n.contains("--memory-budget")));
        assert!(
            n[0].starts_with("mountpointContainerResourcesLimitsCpu: \"1\""),
            "{n:?}"
        );
        for key in RESOURCE_KEYS {
            refused(&[(key, "1 GiB")], key, "not a Kubernetes quantity");
        }
    }

    #[test]
    fn pod_service_account_changes_no_credentials() {
        let s = spec(&[("mountpointPodServiceAccountName", "mp-sa")], &[]).unwrap();
        assert_eq!(
            s.mountpoint_v2.pod_service_account.as_deref(),
            Some("mp-sa")
        );
        assert_eq!(s.authentication, crate::AuthenticationSource::Driver);
        let n = notices(&s, ON);
        assert!(
            n[0].starts_with(
                "mountpointPodServiceAccountName: \"mp-sa\": Ferry runs no Mountpoint Pod"
            ) && n[0].contains("credentials are unchanged"),
            "{n:?}"
        );
        refused(
            &[("mountpointPodServiceAccountName", "MP_SA")],
            "mountpointPodServiceAccountName",
            "not a Kubernetes object name",
        );
    }

    #[test]
    fn mountpoint_env() {
        let s = spec(
            &[("mountpointEnv.NO_PROXY", "sts.us-east-1.amazonaws.com")],
            &[],
        )
        .unwrap();
        let n = notices(&s, ON);
        assert!(n[0].starts_with("mountpointEnv.NO_PROXY: ignored"), "{n:?}");
        refused(
            &[("mountpointEnv.HTTPS_PROXY", "http://proxy.example.com:3128")],
            "mountpointEnv.HTTPS_PROXY",
            "around the proxy",
        );
        // v2 refuses every other variable; so does Ferry (credentials, endpoints, retries…).
        for name in [
            "AWS_ACCESS_KEY_ID",
            "AWS_ENDPOINT_URL",
            "UNSTABLE_MOUNTPOINT_MAX_PREFETCH_WINDOW_SIZE",
            "HTTP_PROXY",
            "",
        ] {
            let key = format!("mountpointEnv.{name}");
            refused(
                &[(key.as_str(), "x")],
                &key,
                "accepts only mountpointEnv.HTTPS_PROXY",
            );
        }
    }

    #[test]
    fn object_names() {
        object_name("k", "gp2").unwrap();
        object_name("k", "s3-cache.ebs-sc").unwrap();
        for bad in ["", "GP2", "-a", "a-", "a_b", &"a".repeat(254)] {
            assert!(object_name("k", bad).is_err(), "{bad}");
        }
    }
}
