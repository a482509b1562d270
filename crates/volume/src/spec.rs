//! What the node mounts: a volume context (from CreateVolume or a static PV's `volumeAttributes`)
//! merged with the PV's mount options.

use std::collections::HashMap;

use crate::mountpoint_v2::{self, MountpointV2, NodeCache, Notice};
use crate::{keys, validate, Endpoint, MountOptions, VolumeError, VolumeId};

/// A fully described mount: bucket, prefix, endpoint and options.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VolumeSpec {
    pub bucket: String,
    /// Empty (whole bucket) or ending in `/`.
    pub prefix: String,
    pub endpoint: Endpoint,
    pub options: MountOptions,
    /// Whose credentials sign the mount's requests.
    pub authentication: AuthenticationSource,
    /// `stsRegion`: the STS region for pod-level IRSA.
    pub sts_region: Option<String>,
    /// The attributes only Mountpoint's driver v2 knows (a migrated PV's).
    pub mountpoint_v2: MountpointV2,
}

/// The `authenticationSource` volume attribute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum AuthenticationSource {
    /// The node plugin's credentials, or the node-publish Secret's keys when kubelet passes one.
    #[default]
    Driver,
    /// The pod's own identity: IRSA or EKS Pod Identity.
    Pod,
}

const WHAT: &str = "volume attribute";

/// The volume context CreateVolume returns for a dynamic volume.
pub fn volume_context(id: &VolumeId) -> HashMap<String, String> {
    let mut ctx = HashMap::new();
    ctx.insert(keys::BUCKET_NAME.to_string(), id.bucket.clone());
    ctx.insert(keys::PREFIX.to_string(), id.prefix.clone());
    if let Some(r) = &id.endpoint.region {
        ctx.insert(keys::REGION.to_string(), r.clone());
    }
    if let Some(e) = &id.endpoint.endpoint_url {
        ctx.insert(keys::ENDPOINT_URL.to_string(), e.clone());
    }
    if id.endpoint.force_path_style {
        ctx.insert(keys::FORCE_PATH_STYLE.to_string(), "true".to_string());
    }
    ctx
}

/// Parses `authenticationSource`: `driver` (or empty) or `pod`.
pub(crate) fn authentication_source(
    what: &'static str,
    key: &str,
    v: &str,
) -> Result<AuthenticationSource, VolumeError> {
    match v {
        "driver" | "" => Ok(AuthenticationSource::Driver),
        "pod" => Ok(AuthenticationSource::Pod),
        other => Err(VolumeError::invalid(
            what,
            key,
            format!("{}: must be \"driver\" or \"pod\"", crate::quote(other)),
        )),
    }
}

fn merge(
    key: &str,
    attr: Option<String>,
    opt: Option<String>,
) -> Result<Option<String>, VolumeError> {
    match (attr, opt) {
        (Some(a), Some(b)) if a != b => Err(VolumeError::Conflict {
            key: key.to_string(),
            a,
            b,
        }),
        (a, b) => Ok(a.or(b)),
    }
}

impl VolumeSpec {
    /// Builds the spec from NodePublishVolume's volume context and mount flags. Unknown attributes
    /// are errors; attributes set by Kubernetes (`csi.storage.k8s.io/…`) are skipped. A value given
    /// both as an attribute and as a mount option must agree.
    pub fn from_publish<S: AsRef<str>>(
        context: &HashMap<String, String>,
        mount_flags: &[S],
    ) -> Result<Self, VolumeError> {
        let mut options = MountOptions::parse(mount_flags)?;
        let mut no_cache = None;
        let mut warm_up = None;
        let mut bucket = None;
        let mut prefix = None;
        let mut endpoint = Endpoint::default();
        let mut authentication = AuthenticationSource::Driver;
        let mut sts_region = None;
        let mut v2 = MountpointV2::default();
        let mut sorted: Vec<_> = context.iter().collect();
        sorted.sort();
        for (k, v) in sorted {
            if crate::apply_location(WHAT, k, v, &mut bucket, &mut endpoint)? || v2.apply(k, v)? {
                continue;
            }
            match k.as_str() {
                keys::PREFIX => prefix = Some(validate::prefix(k, v, true)?),
                // Mountpoint v2's local caches are the node cache; `""` is v2's "no cache type",
                // the default here.
                keys::CACHE => match mountpoint_v2::parse_local_cache(v) {
                    Some(c) => {
                        v2.local_cache = Some(c);
                        no_cache = Some(false);
                    }
                    None if v.is_empty() => {}
                    None => no_cache = Some(parse_cache_attribute(v)?),
                },
                keys::PREFETCH_ON_MOUNT => warm_up = crate::options::parse_warm_up(WHAT, v)?,
                keys::AUTHENTICATION_SOURCE => authentication = authentication_source(WHAT, k, v)?,
                keys::STS_REGION => {
                    validate::region(k, v)?;
                    sts_region = Some(v.clone());
                }
                keys::EPHEMERAL if v == "true" => {
                    return Err(VolumeError::Unsupported {
                        what: WHAT,
                        key: k.clone(),
                        reason: "inline ephemeral volumes are not supported".to_string(),
                    })
                }
                other => {
                    if !keys::is_kubernetes_key(other) {
                        return Err(VolumeError::Unknown {
                            what: WHAT,
                            key: other.to_string(),
                        });
                    }
                }
            }
        }
        let bucket = bucket.ok_or(VolumeError::Missing {
            what: WHAT,
            key: keys::BUCKET_NAME.to_string(),
        })?;
        let prefix = merge(keys::PREFIX, prefix, options.prefix.clone())?.unwrap_or_default();
        endpoint.region = merge(keys::REGION, endpoint.region, options.region.clone())?;
        endpoint.endpoint_url = merge(
            keys::ENDPOINT_URL,
            endpoint.endpoint_url,
            options.endpoint_url.clone(),
        )?;
        endpoint.force_path_style |= options.force_path_style;
        // v2's `Memory` medium keeps the volume's data off the node's disk; the node cache is on
        // disk, so such a volume reads uncached (the kernel's page cache still holds hot data).
        if v2.empty_dir_memory && v2.local_cache == Some(mountpoint_v2::LocalCache::EmptyDir) {
            no_cache = Some(true);
        }
        // Either one opting out keeps the volume out of the node cache.
        options.no_cache = no_cache.unwrap_or(false) || options.no_cache;
        options.warm_up = warm_up;
        Ok(VolumeSpec {
            bucket,
            prefix,
            endpoint,
            options,
            authentication,
            sts_region,
            mountpoint_v2: v2,
        })
    }

    /// One notice per Mountpoint v2 attribute of this volume that Ferry accepted without applying
    /// it as v2 would, worded for this node's cache. Empty for a volume written for Ferry.
    pub fn migration_notices(&self, node_cache: NodeCache) -> Vec<Notice> {
        self.mountpoint_v2
            .notices(!self.options.no_cache, node_cache)
    }
}

/// The `cache` attribute's Ferry values, with an error that also names v2's.
fn parse_cache_attribute(v: &str) -> Result<bool, VolumeError> {
    crate::options::parse_cache(WHAT, v).map_err(|_| {
        VolumeError::invalid(
            WHAT,
            keys::CACHE,
            format!(
                "{}: must be \"node\" (the default), \"none\" (keep this volume out of the node \
                 cache), or Mountpoint v2's \"emptyDir\" or \"ephemeral\" (the node cache)",
                crate::quote(v)
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeletePolicy;

    fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn cache_opt_out_and_warm_up_attributes() {
        let base = [("bucketName", "bkt"), ("prefix", "ds/")];
        let spec = |extra: &[(&str, &str)], flags: &[&str]| {
            let mut kv = base.to_vec();
            kv.extend_from_slice(extra);
            VolumeSpec::from_publish(&map(&kv), flags)
        };
        let plain = spec(&[], &[]).unwrap();
        assert!(!plain.options.no_cache);
        assert_eq!(plain.options.warm_up, None);
        assert!(spec(&[("cache", "none")], &[]).unwrap().options.no_cache);
        assert!(spec(&[], &["cache none"]).unwrap().options.no_cache);
        assert!(
            spec(&[("cache", "node")], &["cache=none"])
                .unwrap()
                .options
                .no_cache
        );
        assert!(!spec(&[("cache", "node")], &[]).unwrap().options.no_cache);
        let err = spec(&[], &["cache /tmp/x"]).unwrap_err().to_string();
        assert!(
            err.contains("cache") && err.contains("--cache-dir"),
            "{err}"
        );
        assert!(spec(&[("cache", "disk")], &[]).is_err());
        assert_eq!(
            spec(&[("prefetchOnMount", "true")], &[])
                .unwrap()
                .options
                .warm_up,
            Some(vec![String::new()])
        );
        assert_eq!(
            spec(&[("prefetchOnMount", "false")], &[])
                .unwrap()
                .options
                .warm_up,
            None
        );
        assert_eq!(
            spec(&[("prefetchOnMount", "train/, val/")], &[])
                .unwrap()
                .options
                .warm_up,
            Some(vec!["train/".to_owned(), "val/".to_owned()])
        );
        // Booleans as YAML and Kubernetes also write them: never a sub-prefix named "True".
        for (v, want) in [("True", Some(vec![String::new()])), ("FALSE", None)] {
            assert_eq!(
                spec(&[("prefetchOnMount", v)], &[])
                    .unwrap()
                    .options
                    .warm_up,
                want,
                "{v}"
            );
        }
        assert!(spec(&[("prefetchOnMount", "../x")], &[]).is_err());
        assert!(spec(&[("prefetchOnMount", "/abs")], &[]).is_err());
        // StorageClass: validated there and passed on to the node.
        let p = crate::StorageClassParams::parse(&map(&[
            ("bucketName", "bkt"),
            ("cache", "none"),
            ("prefetchOnMount", "true"),
        ]))
        .unwrap();
        assert_eq!(p.node_attributes.len(), 2);
        assert!(
            crate::StorageClassParams::parse(&map(&[("bucketName", "bkt"), ("cache", "x")]))
                .is_err()
        );
    }

    #[test]
    fn dynamic_context_round_trips() {
        let id = VolumeId {
            bucket: "data".into(),
            prefix: "a/b/".into(),
            endpoint: Endpoint {
                endpoint_url: Some("http://127.0.0.1:1".into()),
                region: Some("eu-west-1".into()),
                force_path_style: true,
            },
            delete_policy: DeletePolicy::Delete,
        };
        let mut ctx = volume_context(&id);
        ctx.insert(keys::POD_NAME.into(), "p".into());
        ctx.insert(
            "storage.kubernetes.io/csiProvisionerIdentity".into(),
            "1700000000000-8081-s3.csi.ferry.dev".into(),
        );
        let spec = VolumeSpec::from_publish::<&str>(&ctx, &[]).unwrap();
        assert_eq!(
            (spec.bucket.as_str(), spec.prefix.as_str()),
            ("data", "a/b/")
        );
        assert_eq!(spec.endpoint, id.endpoint);
    }

    #[test]
    fn mountpoint_static_pv() {
        let ctx = map(&[("bucketName", "my-bucket")]);
        let spec = VolumeSpec::from_publish(
            &ctx,
            &[
                "prefix datasets/",
                "region us-east-1",
                "allow-other",
                "uid=1000",
            ],
        )
        .unwrap();
        assert_eq!(spec.prefix, "datasets/");
        assert_eq!(spec.endpoint.region.as_deref(), Some("us-east-1"));
        assert_eq!(spec.options.uid, Some(1000));
        let whole = VolumeSpec::from_publish::<&str>(&ctx, &[]).unwrap();
        assert_eq!(whole.prefix, "");
    }

    #[test]
    fn pod_authentication() {
        let mut ctx = map(&[
            ("bucketName", "b-1"),
            ("authenticationSource", "pod"),
            ("stsRegion", "eu-west-1"),
        ]);
        ctx.insert(keys::SERVICE_ACCOUNT_TOKENS.into(), "{}".into());
        let spec = VolumeSpec::from_publish::<&str>(&ctx, &[]).unwrap();
        assert_eq!(spec.authentication, AuthenticationSource::Pod);
        assert_eq!(spec.sts_region.as_deref(), Some("eu-west-1"));
        let spec = VolumeSpec::from_publish::<&str>(&map(&[("bucketName", "b-1")]), &[]).unwrap();
        assert_eq!(spec.authentication, AuthenticationSource::Driver);
    }

    #[test]
    fn errors() {
        let e = VolumeSpec::from_publish::<&str>(&HashMap::new(), &[]).unwrap_err();
        assert!(e.to_string().contains("bucketName"));
        let e = VolumeSpec::from_publish(
            &map(&[("bucketName", "b-1"), ("prefix", "x/")]),
            &["prefix y/"],
        )
        .unwrap_err();
        assert!(e.to_string().contains("prefix"), "{e}");
        let e = VolumeSpec::from_publish::<&str>(
            &map(&[("bucketName", "b-1"), ("colour", "red")]),
            &[],
        )
        .unwrap_err();
        assert!(e.to_string().contains("colour"), "{e}");
        let e = VolumeSpec::from_publish::<&str>(
            &map(&[("bucketName", "b-1"), ("authenticationSource", "node")]),
            &[],
        )
        .unwrap_err();
        assert!(e.to_string().contains("authenticationSource"), "{e}");
        let e = VolumeSpec::from_publish::<&str>(
            &map(&[("bucketName", "b-1"), ("stsRegion", "not a region")]),
            &[],
        )
        .unwrap_err();
        assert!(e.to_string().contains("stsRegion"), "{e}");
    }
}
