//! The service-account tokens kubelet hands to NodePublishVolume (CSIDriver `tokenRequests`), in
//! the volume context key `csi.storage.k8s.io/serviceAccount.tokens`:
//! `{"<audience>": {"token": "<jwt>", "expirationTimestamp": "<RFC 3339>"}, ...}`.

use std::collections::HashMap;
use std::fmt;
use std::time::SystemTime;

use aws_smithy_types::date_time::{DateTime, Format};
use serde::Deserialize;

use crate::{CredsError, Secret};

/// Audience of the token IRSA sends to STS.
pub const STS_AUDIENCE: &str = "sts.amazonaws.com";
/// Audience of the token EKS Pod Identity sends to its agent.
pub const POD_IDENTITY_AUDIENCE: &str = "pods.eks.amazonaws.com";

/// One projected service-account token. `Debug` never shows the token.
#[derive(Clone, PartialEq, Eq)]
pub struct ServiceAccountToken {
    pub token: Secret,
    pub expires: Option<SystemTime>,
}

impl fmt::Debug for ServiceAccountToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceAccountToken")
            .field("token", &self.token)
            .field("expires", &self.expires)
            .finish()
    }
}

#[derive(Deserialize)]
struct Raw {
    token: String,
    #[serde(rename = "expirationTimestamp", default)]
    expiration_timestamp: Option<String>,
}

/// Parses kubelet's tokens value by audience. A malformed value is an error that says where, never
/// what (the value holds tokens).
pub fn parse_tokens(json: &str) -> Result<HashMap<String, ServiceAccountToken>, CredsError> {
    let raw: HashMap<String, Raw> = serde_json::from_str(json).map_err(|e| {
        CredsError::Invalid(format!(
            "csi.storage.k8s.io/serviceAccount.tokens is not the JSON kubelet sends ({:?} error at line {} column {})",
            e.classify(),
            e.line(),
            e.column()
        ))
    })?;
    Ok(raw
        .into_iter()
        .map(|(aud, r)| {
            let expires = r
                .expiration_timestamp
                .as_deref()
                .and_then(|t| DateTime::from_str(t, Format::DateTime).ok())
                .and_then(|t| SystemTime::try_from(t).ok());
            (
                aud,
                ServiceAccountToken {
                    token: Secret::new(r.token),
                    expires,
                },
            )
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kubelet_format() {
        let t = parse_tokens(
            r#"{"sts.amazonaws.com":{"token":"eyJ.sts.sig","expirationTimestamp":"2030-01-02T03:04:05Z"},
                "pods.eks.amazonaws.com":{"token":"eyJ.pods.sig","expirationTimestamp":"2030-01-02T03:04:05Z"}}"#,
        )
        .unwrap();
        assert_eq!(t[STS_AUDIENCE].token.expose(), "eyJ.sts.sig");
        assert!(t[POD_IDENTITY_AUDIENCE].expires.is_some());
        assert!(!format!("{t:?}").contains("eyJ"));
    }

    #[test]
    fn errors_never_echo_the_value() {
        for bad in [
            r#"{"sts.amazonaws.com":{"token":42}} eyJ.secret"#,
            r#"{"sts.amazonaws.com":"eyJ.secret"}"#,
            "eyJ.secret",
        ] {
            let e = parse_tokens(bad).unwrap_err().to_string();
            assert!(!e.contains("eyJ"), "{e}");
            assert!(e.contains("serviceAccount.tokens"), "{e}");
        }
    }
}
