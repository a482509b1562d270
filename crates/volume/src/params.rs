//! StorageClass parameters of a dynamically provisioned volume, and its prefix template.

use std::collections::HashMap;

use crate::{keys, validate, AuthenticationSource, Endpoint, VolumeError};

/// What DeleteVolume does to the data under the volume's prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeletePolicy {
    /// Keep every object (the default).
    #[default]
    Retain,
    /// Delete every object under the volume's prefix, and nothing outside it.
    Delete,
}

/// Whether a PVC may bind its volume to an existing prefix with
/// [`keys::EXISTING_PREFIX_ANNOTATION`] (StorageClass parameter [`keys::EXISTING_PREFIX`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ExistingPrefixPolicy {
    /// The annotation is refused: every volume gets a fresh prefix from the template (the default).
    /// Without it, anyone who may create a PVC of the class could bind another tenant's volume.
    #[default]
    Deny,
    /// Any PVC of the class may name any prefix strictly below `basePrefix` (with
    /// `deletePolicy: retain` only), other volumes' prefixes of the class included.
    Allow,
}

/// Validated StorageClass parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageClassParams {
    pub bucket: String,
    /// Normalised: empty or ending in `/`.
    pub base_prefix: String,
    pub prefix_template: Template,
    pub endpoint: Endpoint,
    pub delete_policy: DeletePolicy,
    /// `existingPrefix`: whether the PVC annotation may bind an existing prefix. Controller-side
    /// only: not in the volume context.
    pub existing_prefix_policy: ExistingPrefixPolicy,
    /// `authenticationSource`, passed on to the node in the volume context.
    pub authentication: AuthenticationSource,
    /// `stsRegion`, passed on to the node in the volume context.
    pub sts_region: Option<String>,
    /// Node-side attributes (`cache`, `prefetchOnMount`), validated here and handed to the node
    /// in the volume context.
    pub node_attributes: Vec<(String, String)>,
}

const WHAT: &str = "StorageClass parameter";

impl StorageClassParams {
    /// Parses CreateVolume's `parameters`. Unknown keys are errors (a typo must not silently change
    /// where data goes); keys under `csi.storage.k8s.io/` belong to Kubernetes and are skipped.
    pub fn parse(params: &HashMap<String, String>) -> Result<Self, VolumeError> {
        let mut bucket = None;
        let mut base_prefix = String::new();
        let mut template = Template::default();
        let mut endpoint = Endpoint::default();
        let mut delete_policy = DeletePolicy::Retain;
        let mut existing_prefix_policy = ExistingPrefixPolicy::Deny;
        let mut authentication = AuthenticationSource::Driver;
        let mut sts_region = None;
        let mut node_attributes = Vec::new();
        let mut sorted: Vec<_> = params.iter().collect();
        sorted.sort();
        for (k, v) in sorted {
            if crate::apply_location(WHAT, k, v, &mut bucket, &mut endpoint)? {
                continue;
            }
            match k.as_str() {
                keys::BASE_PREFIX => base_prefix = validate::prefix(k, v, true)?,
                keys::CACHE => {
                    crate::options::parse_cache(WHAT, v)?;
                    node_attributes.push((k.clone(), v.clone()));
                }
                keys::PREFETCH_ON_MOUNT => {
                    crate::options::parse_warm_up(WHAT, v)?;
                    node_attributes.push((k.clone(), v.clone()));
                }
                keys::PREFIX_TEMPLATE => template = Template::parse(v)?,
                keys::AUTHENTICATION_SOURCE => {
                    authentication = crate::spec::authentication_source(WHAT, k, v)?
                }
                keys::STS_REGION => {
                    validate::region(k, v)?;
                    sts_region = Some(v.clone());
                }
                keys::DELETE_POLICY => {
                    delete_policy = match v.as_str() {
                        "retain" | "Retain" => DeletePolicy::Retain,
                        "delete" | "Delete" => DeletePolicy::Delete,
                        _ => {
                            return Err(VolumeError::invalid(
                                WHAT,
                                k,
                                format!("{} must be \"retain\" or \"delete\"", crate::quote(v)),
                            ))
                        }
                    }
                }
                keys::EXISTING_PREFIX => {
                    existing_prefix_policy = match v.as_str() {
                        "deny" => ExistingPrefixPolicy::Deny,
                        "allow" => ExistingPrefixPolicy::Allow,
                        _ => {
                            return Err(VolumeError::invalid(
                                WHAT,
                                k,
                                format!("{} must be \"deny\" or \"allow\"", crate::quote(v)),
                            ))
                        }
                    }
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
        if delete_policy == DeletePolicy::Delete && !template.is_unique_per_volume() {
            return Err(VolumeError::invalid(
                WHAT,
                keys::PREFIX_TEMPLATE,
                "with deletePolicy delete the template must contain ${volume.name} or ${pv.name}: \
                 otherwise two volumes can share a prefix and deleting one deletes the other's data",
            ));
        }
        Ok(StorageClassParams {
            bucket,
            base_prefix,
            prefix_template: template,
            endpoint,
            delete_policy,
            existing_prefix_policy,
            authentication,
            sts_region,
            node_attributes,
        })
    }

    /// What the node needs besides the volume id: `authenticationSource` and `stsRegion`, when set,
    /// and the node-side attributes (`cache`, `prefetchOnMount`).
    pub fn node_context(&self) -> HashMap<String, String> {
        let mut ctx: HashMap<String, String> = self.node_attributes.iter().cloned().collect();
        if self.authentication == AuthenticationSource::Pod {
            ctx.insert(keys::AUTHENTICATION_SOURCE.to_string(), "pod".to_string());
        }
        if let Some(r) = &self.sts_region {
            ctx.insert(keys::STS_REGION.to_string(), r.clone());
        }
        ctx
    }

    /// The prefix of the volume named `name`: `basePrefix` + the expanded template + `/`.
    pub fn volume_prefix(
        &self,
        name: &str,
        params: &HashMap<String, String>,
    ) -> Result<String, VolumeError> {
        if self.delete_policy == DeletePolicy::Delete {
            self.prefix_template.refuse_slashes(name, params)?;
        }
        let rel = self.prefix_template.expand(name, params)?;
        // Expanded to nothing (an empty volume name), the volume's prefix would be `basePrefix`
        // itself: every volume's data, which `deletePolicy: delete` would delete with this one.
        if rel.is_empty() {
            return Err(VolumeError::invalid(
                WHAT,
                keys::PREFIX_TEMPLATE,
                format!(
                    "expands to nothing for volume {}: the volume would be the whole basePrefix",
                    crate::quote(name)
                ),
            ));
        }
        validate::prefix(
            keys::PREFIX_TEMPLATE,
            &format!("{}{rel}", self.base_prefix),
            false,
        )
    }

    /// The prefix of a volume bound to an existing dataset by the PVC annotation
    /// [`keys::EXISTING_PREFIX_ANNOTATION`]: `value` is a prefix in the bucket (as one sees it in
    /// S3, `basePrefix` included) that must lie strictly below `basePrefix`. Refused with
    /// `deletePolicy: delete`, which would delete the dataset with the PVC, and unless the class
    /// opts in with `existingPrefix: allow`: otherwise anyone who may create a PVC of the class
    /// could bind another namespace's volume (its prefix is below `basePrefix` too).
    pub fn existing_prefix(&self, value: &str) -> Result<String, VolumeError> {
        let key = keys::EXISTING_PREFIX_ANNOTATION;
        let refuse = |reason: String| {
            Err(VolumeError::invalid(
                "PVC annotation",
                key,
                format!("{} {reason}", crate::quote(value)),
            ))
        };
        if self.delete_policy == DeletePolicy::Delete {
            return refuse(
                "cannot be used with the StorageClass's deletePolicy: delete (deleting the PVC \
                 would delete the existing data); use a StorageClass with deletePolicy: retain \
                 and existingPrefix: allow"
                    .to_string(),
            );
        }
        if self.existing_prefix_policy == ExistingPrefixPolicy::Deny {
            return refuse(format!(
                "is refused: the StorageClass does not allow existing prefixes (its parameter {} \
                 is not \"allow\"; an administrator opts a class in with {}: allow)",
                keys::EXISTING_PREFIX,
                keys::EXISTING_PREFIX
            ));
        }
        let prefix = match validate::prefix(key, value, false) {
            Ok(p) => p,
            Err(VolumeError::Invalid { reason, .. }) => {
                return Err(VolumeError::invalid("PVC annotation", key, reason))
            }
            Err(e) => return Err(e),
        };
        if !prefix.starts_with(&self.base_prefix) || prefix == self.base_prefix {
            return refuse(format!(
                "is not below the StorageClass's basePrefix {:?}",
                self.base_prefix
            ));
        }
        Ok(prefix)
    }
}

/// One piece of a prefix template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Literal(String),
    VolumeName,
    PvcNamespace,
    PvcName,
    PvName,
}

/// A prefix template such as `${pvc.namespace}/${pvc.name}`. The default is the volume name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template(Vec<Piece>);

impl Default for Template {
    fn default() -> Self {
        Template(vec![Piece::VolumeName])
    }
}

impl Template {
    /// Parses a template; `${volume.name}`, `${pvc.namespace}`, `${pvc.name}` and `${pv.name}` are
    /// the variables. `$$` is a literal `$`.
    pub fn parse(s: &str) -> Result<Self, VolumeError> {
        let bad = |reason: String| Err(VolumeError::invalid(WHAT, keys::PREFIX_TEMPLATE, reason));
        let mut pieces = Vec::new();
        let mut lit = String::new();
        let mut rest = s;
        while let Some(i) = rest.find('$') {
            lit.push_str(&rest[..i]);
            rest = &rest[i..];
            if let Some(r) = rest.strip_prefix("$$") {
                lit.push('$');
                rest = r;
                continue;
            }
            let Some(body) = rest.strip_prefix("${") else {
                return bad(format!(
                    "{}: '$' must start a ${{variable}} (write $$ for a literal $)",
                    crate::quote(s)
                ));
            };
            let Some(end) = body.find('}') else {
                return bad(format!("{}: unclosed ${{", crate::quote(s)));
            };
            let piece = match &body[..end] {
                "volume.name" => Piece::VolumeName,
                "pvc.namespace" => Piece::PvcNamespace,
                "pvc.name" => Piece::PvcName,
                "pv.name" => Piece::PvName,
                other => {
                    return bad(format!(
                        "{}: unknown variable ${{{other}}} (known: volume.name, pvc.namespace, pvc.name, pv.name)", crate::quote(s)
                    ))
                }
            };
            if !lit.is_empty() {
                pieces.push(Piece::Literal(std::mem::take(&mut lit)));
            }
            pieces.push(piece);
            rest = &body[end + 1..];
        }
        lit.push_str(rest);
        if !lit.is_empty() {
            pieces.push(Piece::Literal(lit));
        }
        if pieces.is_empty() {
            return bad("the template is empty".to_string());
        }
        Ok(Template(pieces))
    }

    /// Whether every volume gets a prefix of its own (the template names the volume or the PV).
    pub fn is_unique_per_volume(&self) -> bool {
        self.0
            .iter()
            .any(|p| matches!(p, Piece::VolumeName | Piece::PvName))
    }

    /// Refuses a value of the template's variables that holds a `/`. Kubernetes names never do;
    /// another CO or a hand-made request may send any name, and with a `/` one volume's prefix can
    /// be another's (`team` and `team/`) or lie inside it (`team/` and `team/x/`), so that
    /// `deletePolicy: delete` deletes that volume's data with this one. Without a `/` in the
    /// values, every prefix of one template has as many segments, so none lies inside another.
    fn refuse_slashes(
        &self,
        name: &str,
        params: &HashMap<String, String>,
    ) -> Result<(), VolumeError> {
        for p in &self.0 {
            let (var, value) = match p {
                Piece::Literal(_) => continue,
                Piece::VolumeName => ("volume.name", Some(name)),
                Piece::PvcNamespace => (
                    "pvc.namespace",
                    params.get(keys::PVC_NAMESPACE).map(String::as_str),
                ),
                Piece::PvcName => ("pvc.name", params.get(keys::PVC_NAME).map(String::as_str)),
                Piece::PvName => ("pv.name", params.get(keys::PV_NAME).map(String::as_str)),
            };
            if let Some(value) = value.filter(|v| v.contains('/')) {
                return Err(VolumeError::invalid(
                    WHAT,
                    keys::PREFIX_TEMPLATE,
                    format!(
                        "${{{var}}} is {}, which contains '/': with deletePolicy delete a volume's \
                         prefix must not lie inside another's (deleting one would delete the \
                         other's data)",
                        crate::quote(value)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Expands the template with the volume name and csi-provisioner's extra metadata.
    pub fn expand(
        &self,
        name: &str,
        params: &HashMap<String, String>,
    ) -> Result<String, VolumeError> {
        let meta = |key: &str| {
            params
                .get(key)
                .filter(|v| !v.is_empty())
                .cloned()
                .ok_or_else(|| VolumeError::Missing {
                    what: "provisioner metadata (run csi-provisioner with --extra-create-metadata)",
                    key: key.to_string(),
                })
        };
        let mut out = String::new();
        for p in &self.0 {
            match p {
                Piece::Literal(s) => out.push_str(s),
                Piece::VolumeName => out.push_str(name),
                Piece::PvcNamespace => out.push_str(&meta(keys::PVC_NAMESPACE)?),
                Piece::PvcName => out.push_str(&meta(keys::PVC_NAME)?),
                Piece::PvName => out.push_str(&meta(keys::PV_NAME)?),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn minimal_and_full() {
        let p = StorageClassParams::parse(&map(&[("bucketName", "data")])).unwrap();
        assert_eq!(p.base_prefix, "");
        assert_eq!(p.delete_policy, DeletePolicy::Retain);
        assert_eq!(p.volume_prefix("pvc-1", &HashMap::new()).unwrap(), "pvc-1/");

        let params = map(&[
            ("bucketName", "data"),
            ("basePrefix", "k8s"),
            ("prefixTemplate", "${pvc.namespace}/${pvc.name}/${pv.name}"),
            ("region", "eu-west-1"),
            ("endpointUrl", "http://127.0.0.1:9000"),
            ("forcePathStyle", "true"),
            ("deletePolicy", "delete"),
            ("csi.storage.k8s.io/pvc/name", "claim"),
            ("csi.storage.k8s.io/pvc/namespace", "ml"),
            ("csi.storage.k8s.io/pv/name", "pvc-1"),
            ("csi.storage.k8s.io/provisioner-secret-name", "s"),
        ]);
        let p = StorageClassParams::parse(&params).unwrap();
        assert_eq!(p.delete_policy, DeletePolicy::Delete);
        assert!(p.endpoint.force_path_style);
        assert_eq!(
            p.volume_prefix("pvc-1", &params).unwrap(),
            "k8s/ml/claim/pvc-1/"
        );
    }

    #[test]
    fn pod_authentication_is_passed_to_the_node() {
        let p = StorageClassParams::parse(&map(&[
            ("bucketName", "data"),
            ("authenticationSource", "pod"),
            ("stsRegion", "eu-west-1"),
        ]))
        .unwrap();
        let ctx = p.node_context();
        assert_eq!(ctx["authenticationSource"], "pod");
        assert_eq!(ctx["stsRegion"], "eu-west-1");
        let p = StorageClassParams::parse(&map(&[("bucketName", "data")])).unwrap();
        assert!(p.node_context().is_empty());
        let e = StorageClassParams::parse(&map(&[
            ("bucketName", "data"),
            ("authenticationSource", "node"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("authenticationSource"), "{e}");
    }

    #[test]
    fn errors_name_the_key() {
        let e = StorageClassParams::parse(&HashMap::new()).unwrap_err();
        assert!(e.to_string().contains("bucketName"));
        let e = StorageClassParams::parse(&map(&[("bucketName", "data"), ("bucketname", "x")]))
            .unwrap_err();
        assert!(e.to_string().contains("\"bucketname\""), "{e}");
        let e =
            StorageClassParams::parse(&map(&[("bucketName", "data"), ("deletePolicy", "wipe")]))
                .unwrap_err();
        assert!(e.to_string().contains("deletePolicy"), "{e}");
        let e = StorageClassParams::parse(&map(&[
            ("bucketName", "data"),
            ("prefixTemplate", "${pod.name}"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("pod.name"), "{e}");
    }

    #[test]
    fn existing_prefix_only_below_base_prefix_and_never_with_delete() {
        let params = |policy: &str| {
            StorageClassParams::parse(&map(&[
                ("bucketName", "data"),
                ("basePrefix", "datasets"),
                ("deletePolicy", policy),
                ("existingPrefix", "allow"),
            ]))
            .unwrap()
        };
        let p = params("retain");
        assert_eq!(
            p.existing_prefix("datasets/imagenet/train").unwrap(),
            "datasets/imagenet/train/"
        );
        assert_eq!(
            p.existing_prefix("datasets/imagenet/").unwrap(),
            "datasets/imagenet/"
        );
        for (bad, why) in [
            (
                "other/imagenet/",
                "not below the StorageClass's basePrefix \"datasets/\"",
            ),
            ("datasets/", "not below"),
            ("datasetsx/a/", "not below"),
            ("datasets/../other/", "\"..\" segment"),
            ("", "whole bucket"),
        ] {
            let e = p.existing_prefix(bad).unwrap_err().to_string();
            assert!(e.contains("s3.csi.ferry.dev/existing-prefix"), "{bad}: {e}");
            assert!(e.contains(why), "{bad}: {e}");
        }
        let e = params("delete")
            .existing_prefix("datasets/imagenet/")
            .unwrap_err()
            .to_string();
        assert!(e.contains("s3.csi.ferry.dev/existing-prefix"), "{e}");
        assert!(e.contains("\"datasets/imagenet/\""), "{e}");
        assert!(e.contains("deletePolicy: delete"), "{e}");
        // Without a basePrefix, any prefix of the bucket.
        let p =
            StorageClassParams::parse(&map(&[("bucketName", "data"), ("existingPrefix", "allow")]))
                .unwrap();
        assert_eq!(
            p.existing_prefix("imagenet/train/").unwrap(),
            "imagenet/train/"
        );
    }

    /// Any PVC of a retain class could bind any prefix below its `basePrefix` with the annotation,
    /// another namespace's dynamic volume included (the template puts those below `basePrefix`
    /// too): the class's administrator never opted in. Now only `existingPrefix: allow` lets it.
    #[test]
    fn existing_prefix_needs_the_class_to_opt_in() {
        let class = |extra: &[(&str, &str)]| {
            let mut kv = vec![
                ("bucketName", "data"),
                ("basePrefix", "k8s"),
                ("prefixTemplate", "${pvc.namespace}/${pvc.name}"),
            ];
            kv.extend_from_slice(extra);
            StorageClassParams::parse(&map(&kv))
        };
        // Another namespace's dynamic volume, below basePrefix like every volume of the class.
        let victim = "k8s/ns-a/pvc-x/";
        for opt in [&[][..], &[("existingPrefix", "deny")][..]] {
            let e = class(opt)
                .unwrap()
                .existing_prefix(victim)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("s3.csi.ferry.dev/existing-prefix"),
                "{opt:?}: {e}"
            );
            assert!(e.contains("existingPrefix: allow"), "{opt:?}: {e}");
            assert!(e.contains("\"k8s/ns-a/pvc-x/\""), "{opt:?}: {e}");
        }
        let allowed = class(&[("existingPrefix", "allow")]).unwrap();
        assert_eq!(allowed.existing_prefix(victim).unwrap(), victim);
        // A controller-side parameter: the node never sees it.
        assert!(
            allowed.node_context().is_empty(),
            "{:?}",
            allowed.node_context()
        );
        // Every other check still holds with the opt-in.
        let e = allowed.existing_prefix("k8s/").unwrap_err().to_string();
        assert!(e.contains("not below"), "{e}");
        let e = class(&[("existingPrefix", "allow"), ("deletePolicy", "delete")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("prefixTemplate"), "{e}");
        let e = class(&[
            ("existingPrefix", "allow"),
            ("deletePolicy", "delete"),
            ("prefixTemplate", "${pvc.namespace}/${volume.name}"),
        ])
        .unwrap()
        .existing_prefix(victim)
        .unwrap_err()
        .to_string();
        assert!(e.contains("deletePolicy: delete"), "{e}");
        // A bad value names the parameter and the value.
        for bad in ["yes", "true", "Allow", "", "allow "] {
            let e = class(&[("existingPrefix", bad)]).unwrap_err().to_string();
            assert!(e.contains("\"existingPrefix\""), "{bad:?}: {e}");
            assert!(e.contains(&crate::quote(bad).to_string()), "{bad:?}: {e}");
            assert!(e.contains("\"deny\" or \"allow\""), "{bad:?}: {e}");
        }
    }

    #[test]
    fn delete_policy_needs_a_prefix_per_volume() {
        for t in ["${pvc.namespace}/${pvc.name}", "${pvc.namespace}", "shared"] {
            let e = StorageClassParams::parse(&map(&[
                ("bucketName", "data"),
                ("prefixTemplate", t),
                ("deletePolicy", "delete"),
            ]))
            .unwrap_err();
            assert!(e.to_string().contains("prefixTemplate"), "{t}: {e}");
        }
        for t in ["${pvc.namespace}/${volume.name}", "${pv.name}"] {
            StorageClassParams::parse(&map(&[
                ("bucketName", "data"),
                ("prefixTemplate", t),
                ("deletePolicy", "delete"),
            ]))
            .unwrap();
        }
        // Retained volumes may share a prefix on purpose (several PVCs onto one dataset).
        StorageClassParams::parse(&map(&[
            ("bucketName", "data"),
            ("prefixTemplate", "shared"),
        ]))
        .unwrap();
    }

    #[test]
    fn template_needs_metadata_and_rejects_escapes() {
        let p = StorageClassParams::parse(&map(&[
            ("bucketName", "data"),
            ("prefixTemplate", "${pvc.name}"),
        ]))
        .unwrap();
        let e = p.volume_prefix("v", &HashMap::new()).unwrap_err();
        assert!(e.to_string().contains("extra-create-metadata"), "{e}");
        let p = StorageClassParams::parse(&map(&[
            ("bucketName", "data"),
            ("prefixTemplate", "../${volume.name}"),
        ]))
        .unwrap();
        assert!(p.volume_prefix("v", &HashMap::new()).is_err());
        let params = map(&[("csi.storage.k8s.io/pvc/name", "..")]);
        let p = StorageClassParams::parse(&map(&[
            ("bucketName", "data"),
            ("prefixTemplate", "${pvc.name}"),
        ]))
        .unwrap();
        assert!(p.volume_prefix("v", &params).is_err());
        assert_eq!(
            Template::parse("a$$b-${volume.name}")
                .unwrap()
                .expand("v", &HashMap::new())
                .unwrap(),
            "a$b-v"
        );
        assert!(Template::parse("a$b").is_err());
        assert!(Template::parse("${pvc.name").is_err());
    }

    #[test]
    fn delete_policy_refuses_a_slash_in_a_template_value() {
        let sc = |policy: &str| {
            StorageClassParams::parse(&map(&[
                ("bucketName", "data"),
                ("prefixTemplate", "${pvc.namespace}/${volume.name}"),
                ("deletePolicy", policy),
            ]))
            .unwrap()
        };
        let ns = map(&[("csi.storage.k8s.io/pvc/namespace", "ml")]);
        for name in ["team/", "team/x", "/team"] {
            let e = sc("delete")
                .volume_prefix(name, &ns)
                .unwrap_err()
                .to_string();
            assert!(e.contains("${volume.name}"), "{name}: {e}");
            assert!(e.contains(&crate::quote(name).to_string()), "{name}: {e}");
        }
        let e = sc("delete")
            .volume_prefix("v", &map(&[("csi.storage.k8s.io/pvc/namespace", "a/b")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("${pvc.namespace}"), "{e}");
        assert_eq!(sc("delete").volume_prefix("v", &ns).unwrap(), "ml/v/");
        // Retained volumes may nest or share prefixes on purpose: unchanged.
        assert_eq!(
            sc("retain").volume_prefix("team/x", &ns).unwrap(),
            "ml/team/x/"
        );
    }

    #[test]
    fn a_volume_prefix_is_never_the_base_prefix() {
        // Found by fuzzing: an empty volume name expanded `${volume.name}` to nothing, and the
        // volume got `basePrefix` itself (CreateVolume refuses an empty name first).
        let p = StorageClassParams::parse(&map(&[("bucketName", "data"), ("basePrefix", "k8s")]))
            .unwrap();
        assert!(p.volume_prefix("", &HashMap::new()).is_err());
        assert_eq!(p.volume_prefix("v", &HashMap::new()).unwrap(), "k8s/v/");
    }
}
