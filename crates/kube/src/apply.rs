//! Applying arbitrary objects (a rendered Helm chart, test fixtures): multi-document YAML into
//! JSON objects, `kind` → REST resource through API discovery, then server-side apply with strict
//! field validation, optionally as a server-side dry run (`dryRun=All`): the API server runs
//! admission and validation and persists nothing.

use std::sync::Arc;

use http::Method;
use serde::Deserialize;
use serde_json::Value;

use crate::client::{query, segment, Client, APPLY_PATCH};
use crate::error::{KubeError, Result};

/// One resource of an API group version, from discovery.
#[derive(Debug, Clone, Deserialize)]
pub struct ApiResource {
    /// The plural resource name in URLs (`persistentvolumeclaims`).
    pub name: String,
    pub kind: String,
    pub namespaced: bool,
}

/// Whether an apply persists anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DryRun {
    /// Persist.
    No,
    /// Admission and validation only (`?dryRun=All`).
    All,
}

/// The objects of a multi-document YAML stream (`---` separated, empty documents skipped,
/// `kind: List` expanded).
pub fn parse_documents(yaml: &str) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(yaml).enumerate() {
        let v: Value = Value::deserialize(doc).map_err(|e| KubeError::InvalidObject {
            object: format!("YAML document {}", i + 1),
            reason: e.to_string(),
        })?;
        match v {
            Value::Null => {}
            Value::Object(ref m) if m.get("kind").and_then(Value::as_str) == Some("List") => {
                if let Some(Value::Array(items)) = m.get("items") {
                    out.extend(items.iter().cloned());
                }
            }
            Value::Object(_) => out.push(v),
            other => {
                return Err(KubeError::InvalidObject {
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

impl Client {
    /// The resources of `api_version` (`v1`, `storage.k8s.io/v1`), cached per client.
    pub async fn api_resources(&self, api_version: &str) -> Result<Arc<Vec<ApiResource>>> {
        if let Some(r) = self
            .discovery()
            .lock()
            .expect("discovery lock")
            .get(api_version)
        {
            return Ok(r.clone());
        }
        let path = if api_version == "v1" {
            "/api/v1".to_string()
        } else {
            format!("/apis/{api_version}")
        };
        let v = match self.get(&path).await {
            Ok(v) => v,
            Err(e) if e.is_not_found() => Value::Null,
            Err(e) => return Err(e),
        };
        let resources: Vec<ApiResource> = match v.get("resources") {
            Some(r) => serde_json::from_value(r.clone()).map_err(|e| KubeError::Decode {
                what: format!("discovery of {api_version}"),
                reason: e.to_string(),
            })?,
            None => Vec::new(),
        };
        // Subresources (`pods/log`) are not objects one applies.
        let resources: Arc<Vec<ApiResource>> = Arc::new(
            resources
                .into_iter()
                .filter(|r| !r.name.contains('/'))
                .collect(),
        );
        if !resources.is_empty() {
            self.discovery()
                .lock()
                .expect("discovery lock")
                .insert(api_version.to_string(), resources.clone());
        }
        Ok(resources)
    }

    /// The REST resource of `kind` in `api_version`.
    pub async fn resource_for(&self, api_version: &str, kind: &str) -> Result<ApiResource> {
        let found = self
            .api_resources(api_version)
            .await?
            .iter()
            .find(|r| r.kind == kind)
            .cloned();
        if let Some(r) = found {
            return Ok(r);
        }
        // A CRD created a moment ago: forget the cached list and look once more.
        self.discovery()
            .lock()
            .expect("discovery lock")
            .remove(api_version);
        self.api_resources(api_version)
            .await?
            .iter()
            .find(|r| r.kind == kind)
            .cloned()
            .ok_or_else(|| KubeError::UnknownKind {
                api_version: api_version.to_string(),
                kind: kind.to_string(),
            })
    }

    /// The URL path of an object (`/api/v1/namespaces/ns/pods/x`); namespaced objects without
    /// `metadata.namespace` go to `default_namespace`.
    pub async fn object_path(&self, object: &Value, default_namespace: &str) -> Result<String> {
        let invalid = |reason: &str| KubeError::InvalidObject {
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
        let r = self.resource_for(api_version, kind).await?;
        let base = if api_version == "v1" {
            "/api/v1".to_string()
        } else {
            format!("/apis/{api_version}")
        };
        let name = segment("object name", name)?;
        Ok(if r.namespaced {
            let ns = object["metadata"]["namespace"]
                .as_str()
                .unwrap_or(default_namespace);
            format!(
                "{base}/namespaces/{}/{}/{name}",
                segment("namespace", ns)?,
                r.name
            )
        } else {
            format!("{base}/{}/{name}", r.name)
        })
    }

    /// Server-side apply of `object` as `field_manager` (taking over conflicting fields), with
    /// strict field validation: an unknown or duplicate field is an error, not a warning.
    /// Returns the object as the API server stored it (or would store it, for a dry run).
    pub async fn apply(
        &self,
        object: &Value,
        default_namespace: &str,
        field_manager: &str,
        dry_run: DryRun,
    ) -> Result<Value> {
        let path = self.object_path(object, default_namespace).await?;
        let mut url = format!(
            "{path}?fieldManager={}&force=true&fieldValidation=Strict",
            query(field_manager)
        );
        if dry_run == DryRun::All {
            url.push_str("&dryRun=All");
        }
        self.request(Method::PATCH, &url, Some((object, APPLY_PATCH)))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_lists_and_empties() {
        let yaml = "---\n# a comment only\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\napiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Secret, metadata: {name: b, namespace: n}}\n";
        let docs = parse_documents(yaml).unwrap();
        let names: Vec<String> = docs.iter().map(describe).collect();
        assert_eq!(names, ["ConfigMap/a", "Secret/n/b"]);
        let err = parse_documents("- 1\n- 2\n").unwrap_err();
        assert!(err.to_string().contains("YAML document 1"), "{err}");
    }
}
