//! Applying arbitrary objects (a rendered Helm chart, test fixtures) with kube: multi-document
//! YAML into JSON objects, `kind` → REST resource through discovery, then server-side apply
//! ([`Patch::Apply`] with a field manager, taking over conflicting fields) with strict field
//! validation, optionally as a server-side dry run (`dryRun=All`: the API server runs admission
//! and validation and persists nothing).

use std::str::FromStr;

use kube::api::{DynamicObject, Patch, PatchParams};
use kube::core::GroupVersion;
use kube::discovery::{self, Scope};
use kube::{Api, Client};
use serde_json::Value;

/// Whether an apply persists anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DryRun {
    /// Persist.
    No,
    /// Admission and validation only (`?dryRun=All`).
    All,
}

/// Why an object was not applied; every variant names the object or the kind.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// An object without `apiVersion`, `kind` or `metadata.name`, or with names that do not fit
    /// in a URL path segment.
    #[error("object {object}: {reason}")]
    InvalidObject { object: String, reason: String },
    /// `kind` in `api_version` is not served by this API server (a missing CRD, a removed API, an
    /// API newer than the server).
    #[error("kind {kind} in {api_version} is not served by the API server")]
    UnknownKind { api_version: String, kind: String },
    /// The API server refused the request (strict validation, admission, RBAC) or did not answer.
    #[error("{object}: {}", describe_error(error))]
    Api { object: String, error: kube::Error },
}

/// A Kubernetes API error as a person reads it: the API server's status, reason and message, or
/// the transport failure with its causes.
pub fn describe_error(e: &kube::Error) -> String {
    if let kube::Error::Api(s) = e {
        return format!("HTTP {} {}: {}", s.code, s.reason, s.message);
    }
    ferry_store::error_chain(e)
}

/// The objects of a multi-document YAML stream (`---` separated, empty documents skipped,
/// `kind: List` expanded). Parsed by serde-saphyr, kube's own YAML parser, with its default YAML
/// 1.1 scalars: an unquoted `yes`, `no`, `on`, `off`, `y` or `n` is a boolean, as it is to helm
/// and kubectl (sigs.k8s.io/yaml), so a chart that forgets to quote one fails here too.
pub fn parse_documents(yaml: &str) -> Result<Vec<Value>, ApplyError> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(yaml).map_err(|e| ApplyError::InvalidObject {
            object: "YAML stream".into(),
            reason: e.to_string(),
        })?;
    let mut out = Vec::new();
    // Documents are counted without the empty ones.
    for (i, v) in docs.into_iter().enumerate() {
        match v {
            Value::Null => {}
            Value::Object(ref m) if m.get("kind").and_then(Value::as_str) == Some("List") => {
                if let Some(Value::Array(items)) = m.get("items") {
                    out.extend(items.iter().cloned());
                }
            }
            Value::Object(_) => out.push(v),
            other => {
                return Err(ApplyError::InvalidObject {
                    object: format!("YAML document {}", i + 1),
                    reason: format!("not an object: {other}"),
                })
            }
        }
    }
    Ok(out)
}

/// `Kind/namespace/name` (or `Kind/name`) of an object, for messages.
pub fn describe(object: &Value) -> String {
    let kind = object["kind"].as_str().unwrap_or("?");
    let name = object["metadata"]["name"].as_str().unwrap_or("?");
    match object["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{kind}/{ns}/{name}"),
        None => format!("{kind}/{name}"),
    }
}

/// Server-side apply of `object` as `field_manager` (forcing conflicts), with strict field
/// validation: an unknown or duplicate field is an error, not a warning. Namespaced objects
/// without `metadata.namespace` go to `default_namespace`. The REST resource of the object's kind
/// is looked up on every call, so a CRD created a moment ago is found. Returns the object as the
/// API server stored it (or would store it, for a dry run).
pub async fn apply(
    client: &Client,
    object: &Value,
    default_namespace: &str,
    field_manager: &str,
    dry_run: DryRun,
) -> Result<DynamicObject, ApplyError> {
    let invalid = |reason: &str| ApplyError::InvalidObject {
        object: describe(object),
        reason: reason.to_string(),
    };
    let api_version = object["apiVersion"]
        .as_str()
        .ok_or_else(|| invalid("no apiVersion"))?;
    let kind = object["kind"].as_str().ok_or_else(|| invalid("no kind"))?;
    let name = object["metadata"]["name"]
        .as_str()
        .ok_or_else(|| invalid("no metadata.name"))?;
    if !is_path_segment(name) {
        return Err(invalid("metadata.name is not a valid object name"));
    }
    let gvk = GroupVersion::from_str(api_version)
        .map_err(|e| invalid(&format!("apiVersion: {e}")))?
        .with_kind(kind);
    let unknown = || ApplyError::UnknownKind {
        api_version: api_version.to_string(),
        kind: kind.to_string(),
    };
    let (resource, caps) = match discovery::pinned_kind(client, &gvk).await {
        Ok(found) => found,
        // The group version is not served at all, or it has no such kind.
        Err(kube::Error::Api(s)) if s.code == 404 => return Err(unknown()),
        Err(kube::Error::Discovery(_)) => return Err(unknown()),
        Err(error) => {
            return Err(ApplyError::Api {
                object: describe(object),
                error,
            })
        }
    };
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Namespaced => {
            let ns = object["metadata"]["namespace"]
                .as_str()
                .unwrap_or(default_namespace);
            if !is_path_segment(ns) {
                return Err(invalid("not a valid namespace"));
            }
            Api::namespaced_with(client.clone(), ns, &resource)
        }
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    };
    let mut params = PatchParams::apply(field_manager)
        .force()
        .validation_strict();
    if dry_run == DryRun::All {
        params = params.dry_run();
    }
    api.patch(name, &params, &Patch::Apply(object))
        .await
        .map_err(|error| ApplyError::Api {
            object: describe(object),
            error,
        })
}

/// A namespace or object name that stays one URL path segment (kube puts names into paths as
/// they are).
fn is_path_segment(s: &str) -> bool {
    !(s.is_empty() || s == "." || s == ".." || s.contains(['/', '?', '#', '%']))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_lists_and_empties() {
        let yaml = "---\n# a comment only\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\napiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Secret, metadata: {name: b, namespace: ns}}\n";
        let docs = parse_documents(yaml).unwrap();
        let names: Vec<String> = docs.iter().map(describe).collect();
        assert_eq!(names, ["ConfigMap/a", "Secret/ns/b"]);
        let err = parse_documents("- 1\n- 2\n").unwrap_err();
        assert!(err.to_string().contains("YAML document 1"), "{err}");
    }

    #[test]
    fn names_stay_one_path_segment() {
        assert!(is_path_segment("ok-name.1"));
        for bad in ["", "a/b", "a?b", "..", "a%2F"] {
            assert!(!is_path_segment(bad), "{bad}");
        }
    }
}
