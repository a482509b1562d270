//! [`CredentialSource`]: which credentials a volume's S3 client signs with, decided per publish.

use std::collections::HashMap;

use crate::pod::{PodRef, ServiceAccounts};
use crate::tokens::{ServiceAccountToken, POD_IDENTITY_AUDIENCE, STS_AUDIENCE};
use crate::{CredsError, StaticKeys, ROLE_ARN_ANNOTATION, STS_REGIONAL_ANNOTATION};

/// Where a volume's credentials come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CredentialSource {
    /// The driver's own: the AWS SDK default chain of the node or controller process.
    Driver,
    /// Keys from the volume's Secret.
    Static(StaticKeys),
    /// The pod's IRSA role, assumed with its `sts.amazonaws.com` token.
    PodIrsa {
        identity: Identity,
        role_arn: String,
        /// The STS region; `None` = the global endpoint (us-east-1).
        sts_region: Option<String>,
        token: ServiceAccountToken,
    },
    /// The pod's EKS Pod Identity association, through the agent with its
    /// `pods.eks.amazonaws.com` token.
    PodIdentity {
        identity: Identity,
        agent_url: String,
        token: ServiceAccountToken,
    },
}

/// Who a pod-level mount acts as: a live mount may take new tokens for the same identity, never a
/// different one. Plain data without secrets.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    pub namespace: String,
    pub service_account: String,
    pub principal: Principal,
}

/// The AWS side of an [`Identity`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Principal {
    /// IRSA: the role and the STS region used to assume it.
    Role {
        role_arn: String,
        sts_region: Option<String>,
    },
    /// Pod Identity: the agent that answers for the pod's association.
    PodIdentityAgent { agent_url: String },
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.principal {
            Principal::Role { role_arn, .. } => write!(
                f,
                "role {role_arn} (service account {}/{})",
                self.namespace, self.service_account
            ),
            Principal::PodIdentityAgent { .. } => write!(
                f,
                "the EKS Pod Identity association of service account {}/{}",
                self.namespace, self.service_account
            ),
        }
    }
}

/// Node-level settings for pod-level credentials.
#[derive(Debug, Clone)]
pub struct PodSettings {
    /// The EKS Pod Identity agent (`http://169.254.170.23/v1/credentials` on EKS).
    pub pod_identity_agent_url: String,
    /// STS region when the volume sets no `stsRegion`: the volume's or driver's region.
    pub default_sts_region: Option<String>,
}

/// Decides a pod's credentials from its ServiceAccount and kubelet's tokens: an
/// `eks.amazonaws.com/role-arn` annotation means IRSA, none means EKS Pod Identity. `sts_region` is
/// the volume's `stsRegion`; without it the regional endpoint of the default region is used when
/// the ServiceAccount asks for regional endpoints (or a region is configured), else STS's global one.
pub async fn resolve_pod_source(
    accounts: &dyn ServiceAccounts,
    pod: &PodRef,
    tokens: &HashMap<String, ServiceAccountToken>,
    sts_region: Option<&str>,
    settings: &PodSettings,
) -> Result<CredentialSource, CredsError> {
    let annotations = accounts
        .annotations(&pod.namespace, &pod.service_account)
        .await?;
    let token_for = |aud: &str| {
        tokens.get(aud).cloned().ok_or_else(|| {
            CredsError::Invalid(format!(
                "kubelet passed no service-account token for audience {aud:?} (pod {}/{}): the CSIDriver object must list it in tokenRequests",
                pod.namespace, pod.name
            ))
        })
    };
    match annotations.get(ROLE_ARN_ANNOTATION).map(|s| s.trim()) {
        Some(role_arn) if !role_arn.is_empty() => {
            if !role_arn.starts_with("arn:") || !role_arn.contains(":role/") {
                return Err(CredsError::Invalid(format!(
                    "service account {}/{} has {ROLE_ARN_ANNOTATION}={role_arn:?}, which is not a role ARN",
                    pod.namespace, pod.service_account
                )));
            }
            let regional = annotations
                .get(STS_REGIONAL_ANNOTATION)
                .is_some_and(|v| v == "true");
            let sts_region = match sts_region {
                Some(r) => Some(r.to_string()),
                None if regional => settings.default_sts_region.clone(),
                None => None,
            };
            Ok(CredentialSource::PodIrsa {
                identity: Identity {
                    namespace: pod.namespace.clone(),
                    service_account: pod.service_account.clone(),
                    principal: Principal::Role {
                        role_arn: role_arn.to_string(),
                        sts_region: sts_region.clone(),
                    },
                },
                role_arn: role_arn.to_string(),
                sts_region,
                token: token_for(STS_AUDIENCE)?,
            })
        }
        _ => Ok(CredentialSource::PodIdentity {
            identity: Identity {
                namespace: pod.namespace.clone(),
                service_account: pod.service_account.clone(),
                principal: Principal::PodIdentityAgent {
                    agent_url: settings.pod_identity_agent_url.clone(),
                },
            },
            agent_url: settings.pod_identity_agent_url.clone(),
            token: token_for(POD_IDENTITY_AUDIENCE)?,
        }),
    }
}

impl CredentialSource {
    /// The pod-level identity, if this is one.
    pub fn identity(&self) -> Option<&Identity> {
        match self {
            CredentialSource::PodIrsa { identity, .. }
            | CredentialSource::PodIdentity { identity, .. } => Some(identity),
            _ => None,
        }
    }

    /// The pod-level token, if this is one.
    pub fn token(&self) -> Option<&ServiceAccountToken> {
        match self {
            CredentialSource::PodIrsa { token, .. }
            | CredentialSource::PodIdentity { token, .. } => Some(token),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Secret;

    struct Fixed(HashMap<String, String>);

    #[async_trait::async_trait]
    impl ServiceAccounts for Fixed {
        async fn annotations(
            &self,
            _ns: &str,
            _name: &str,
        ) -> Result<HashMap<String, String>, CredsError> {
            Ok(self.0.clone())
        }
    }

    fn pod() -> PodRef {
        PodRef {
            namespace: "ml".into(),
            name: "p".into(),
            service_account: "reader".into(),
        }
    }

    fn tokens() -> HashMap<String, ServiceAccountToken> {
        [STS_AUDIENCE, POD_IDENTITY_AUDIENCE]
            .iter()
            .map(|a| {
                (
                    a.to_string(),
                    ServiceAccountToken {
                        token: Secret::new(format!("tok-{a}")),
                        expires: None,
                    },
                )
            })
            .collect()
    }

    fn settings() -> PodSettings {
        PodSettings {
            pod_identity_agent_url: "http://127.0.0.1:1/v1/credentials".into(),
            default_sts_region: Some("eu-west-1".into()),
        }
    }

    #[tokio::test]
    async fn annotation_means_irsa() {
        let sa = Fixed(HashMap::from([
            (
                ROLE_ARN_ANNOTATION.to_string(),
                "arn:aws:iam::123456789012:role/reader".to_string(),
            ),
            (STS_REGIONAL_ANNOTATION.to_string(), "true".to_string()),
        ]));
        let s = resolve_pod_source(&sa, &pod(), &tokens(), None, &settings())
            .await
            .unwrap();
        let CredentialSource::PodIrsa {
            sts_region, token, ..
        } = &s
        else {
            panic!("{s:?}")
        };
        assert_eq!(sts_region.as_deref(), Some("eu-west-1"));
        assert_eq!(token.token.expose(), "tok-sts.amazonaws.com");
        assert!(s.identity().unwrap().to_string().contains("role/reader"));
        assert!(!format!("{s:?}").contains("tok-"));
        // No regional annotation: the global endpoint, unless the volume names a region.
        let sa = Fixed(HashMap::from([(
            ROLE_ARN_ANNOTATION.to_string(),
            "arn:aws:iam::123456789012:role/reader".to_string(),
        )]));
        let s = resolve_pod_source(&sa, &pod(), &tokens(), None, &settings())
            .await
            .unwrap();
        assert!(matches!(
            s,
            CredentialSource::PodIrsa {
                sts_region: None,
                ..
            }
        ));
        let s = resolve_pod_source(&sa, &pod(), &tokens(), Some("ap-south-1"), &settings())
            .await
            .unwrap();
        assert!(
            matches!(s, CredentialSource::PodIrsa { sts_region: Some(ref r), .. } if r == "ap-south-1")
        );
    }

    #[tokio::test]
    async fn no_annotation_means_pod_identity() {
        let s = resolve_pod_source(&Fixed(HashMap::new()), &pod(), &tokens(), None, &settings())
            .await
            .unwrap();
        assert!(matches!(s, CredentialSource::PodIdentity { .. }), "{s:?}");
        let e = resolve_pod_source(
            &Fixed(HashMap::new()),
            &pod(),
            &HashMap::new(),
            None,
            &settings(),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("pods.eks.amazonaws.com"), "{e}");
    }

    #[tokio::test]
    async fn bad_role_annotation() {
        let sa = Fixed(HashMap::from([(
            ROLE_ARN_ANNOTATION.to_string(),
            "reader".to_string(),
        )]));
        let e = resolve_pod_source(&sa, &pod(), &tokens(), None, &settings())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("not a role ARN"), "{e}");
    }
}
