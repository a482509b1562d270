//! [`PodCredentials`]: the AWS credentials provider of one pod-level identity, and
//! [`PodCredentialCache`], one per identity on the node.
//!
//! The provider keeps what STS (IRSA) or the EKS Pod Identity agent last returned and fetches anew
//! once the credentials are within [`ProviderSettings::refresh_before`] of expiring (or half their
//! lifetime, for short-lived ones), always with the newest token [`PodCredentials::set_token`] was
//! given. It tells the S3 client's identity cache that its credentials expire at that refresh
//! point, so the client asks again then. A failed refresh keeps serving the previous credentials
//! while they are still valid.

use ferry_store::error_chain;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use aws_config::{BehaviorVersion, SdkConfig};
use aws_credential_types::provider::{self, error::CredentialsError, ProvideCredentials};
use aws_credential_types::Credentials;
use aws_sdk_sts::error::{ProvideErrorMetadata, SdkError};
use aws_smithy_types::date_time::{DateTime, Format};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client as HttpClient};
use hyper_util::rt::TokioExecutor;
use tracing::{debug, warn};

use crate::pod::session_name;
use crate::{CredentialSource, CredsError, Identity, PodRef, Secret};

/// How pod-level credentials are fetched and refreshed.
#[derive(Clone, Debug)]
pub struct ProviderSettings {
    /// Fetch new credentials this long before the current ones expire. Default 5 minutes.
    pub refresh_before: Duration,
    /// Timeout of one STS or agent request. Default 10 s.
    pub request_timeout: Duration,
    /// The SDK configuration STS clients start from (HTTP client, CA bundle, and
    /// `AWS_ENDPOINT_URL_STS` / `AWS_ENDPOINT_URL`). Built by [`ProviderSettings::load`].
    pub sdk: SdkConfig,
}

impl ProviderSettings {
    /// Defaults, with the SDK configuration read from the environment (no credentials: STS's
    /// `AssumeRoleWithWebIdentity` is unsigned). `http_client`: one that trusts a private CA
    /// bundle, if the driver has one.
    pub async fn load(http_client: Option<aws_sdk_sts::config::SharedHttpClient>) -> Self {
        let mut loader = aws_config::defaults(BehaviorVersion::latest()).no_credentials();
        if let Some(c) = http_client {
            loader = loader.http_client(c);
        }
        let sdk = loader.load().await;
        ProviderSettings {
            refresh_before: Duration::from_secs(300),
            request_timeout: Duration::from_secs(10),
            sdk,
        }
    }
}

enum Fetcher {
    Sts {
        client: aws_sdk_sts::Client,
        role_arn: String,
    },
    Agent {
        client: Box<HttpClient<HttpConnector, Empty<Bytes>>>,
        url: String,
    },
}

struct Latest {
    token: Secret,
    session_name: String,
}

struct Cached {
    creds: Credentials,
    expires: SystemTime,
    refresh_at: SystemTime,
}

/// The credentials provider of one pod-level [`Identity`]. Cheap to clone; clones share the cache
/// and the token.
#[derive(Clone)]
pub struct PodCredentials {
    inner: Arc<Inner>,
}

struct Inner {
    identity: Identity,
    fetcher: Fetcher,
    settings: ProviderSettings,
    latest: Mutex<Latest>,
    cached: tokio::sync::Mutex<Option<Cached>>,
}

impl std::fmt::Debug for PodCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodCredentials")
            .field("identity", &self.inner.identity)
            .finish_non_exhaustive()
    }
}

impl PodCredentials {
    /// A provider for a pod-level source ([`CredentialSource::PodIrsa`] or
    /// [`CredentialSource::PodIdentity`]) starting with its token.
    pub fn new(
        source: &CredentialSource,
        pod: &PodRef,
        settings: ProviderSettings,
    ) -> Result<Self, CredsError> {
        let (identity, fetcher, token) = match source {
            CredentialSource::PodIrsa {
                identity,
                role_arn,
                sts_region,
                token,
            } => {
                let region = sts_region.clone().unwrap_or_else(|| "us-east-1".into());
                let conf = aws_sdk_sts::config::Builder::from(&settings.sdk)
                    .region(aws_sdk_sts::config::Region::new(region))
                    .build();
                (
                    identity.clone(),
                    Fetcher::Sts {
                        client: aws_sdk_sts::Client::from_conf(conf),
                        role_arn: role_arn.clone(),
                    },
                    token,
                )
            }
            CredentialSource::PodIdentity {
                identity,
                agent_url,
                token,
            } => {
                agent_url.parse::<http::Uri>().map_err(|e| {
                    CredsError::Invalid(format!(
                        "Pod Identity agent URL {agent_url:?} is not a URL: {e}"
                    ))
                })?;
                let client = Box::new(HttpClient::builder(TokioExecutor::new()).build_http());
                (
                    identity.clone(),
                    Fetcher::Agent {
                        client,
                        url: agent_url.clone(),
                    },
                    token,
                )
            }
            other => {
                return Err(CredsError::Invalid(format!(
                    "{other:?} is not a pod-level credential source"
                )))
            }
        };
        Ok(PodCredentials {
            inner: Arc::new(Inner {
                identity,
                fetcher,
                settings,
                latest: Mutex::new(Latest {
                    token: token.token.clone(),
                    session_name: session_name(pod),
                }),
                cached: tokio::sync::Mutex::new(None),
            }),
        })
    }

    /// Who these credentials act as.
    pub fn identity(&self) -> &Identity {
        &self.inner.identity
    }

    /// Hands over a newer token (kubelet's republish) from `pod`; the next fetch uses it. The
    /// credentials already held stay in use until their refresh point.
    pub fn set_token(&self, token: Secret, pod: &PodRef) {
        let mut latest = self.inner.latest.lock().unwrap();
        latest.token = token;
        latest.session_name = session_name(pod);
    }

    /// The current credentials, fetched when there are none or they are due for refresh.
    pub async fn credentials(&self) -> Result<Credentials, CredsError> {
        let mut cached = self.inner.cached.lock().await;
        let now = SystemTime::now();
        if let Some(c) = cached.as_ref().filter(|c| now < c.refresh_at) {
            return Ok(c.creds.clone());
        }
        match self.fetch().await {
            Ok((ak, sk, token, expires)) => {
                let refresh_at = refresh_point(now, expires, self.inner.settings.refresh_before);
                let source = match self.inner.fetcher {
                    Fetcher::Sts { .. } => "ferry-irsa",
                    Fetcher::Agent { .. } => "ferry-pod-identity",
                };
                let creds = Credentials::new(ak, sk, Some(token), Some(refresh_at), source);
                debug!(identity = %self.inner.identity, "fetched pod credentials");
                *cached = Some(Cached {
                    creds: creds.clone(),
                    expires,
                    refresh_at,
                });
                Ok(creds)
            }
            Err(e) => match cached.as_ref().filter(|c| now < c.expires) {
                Some(c) => {
                    warn!(identity = %self.inner.identity, error = %e, "refreshing pod credentials failed; the current ones are still valid");
                    let retry = (now + Duration::from_secs(30)).min(c.expires);
                    Ok(Credentials::new(
                        c.creds.access_key_id(),
                        c.creds.secret_access_key(),
                        c.creds.session_token().map(str::to_owned),
                        Some(retry),
                        "ferry-pod",
                    ))
                }
                None => Err(e),
            },
        }
    }

    async fn fetch(&self) -> Result<(String, String, String, SystemTime), CredsError> {
        let (token, session) = {
            let l = self.inner.latest.lock().unwrap();
            (l.token.clone(), l.session_name.clone())
        };
        let timeout = self.inner.settings.request_timeout;
        let id = &self.inner.identity;
        match &self.inner.fetcher {
            Fetcher::Sts { client, role_arn } => {
                let call = client
                    .assume_role_with_web_identity()
                    .role_arn(role_arn)
                    .role_session_name(&session)
                    .web_identity_token(token.expose())
                    .send();
                let out = tokio::time::timeout(timeout, call)
                    .await
                    .map_err(|_| {
                        CredsError::Unavailable(format!(
                            "assuming {id}: STS did not answer within {timeout:?}"
                        ))
                    })?
                    .map_err(|e| sts_error(id, e))?;
                let c = out.credentials().ok_or_else(|| {
                    CredsError::Unavailable(format!("assuming {id}: STS returned no credentials"))
                })?;
                let expires = SystemTime::try_from(*c.expiration()).map_err(|_| {
                    CredsError::Unavailable(format!(
                        "assuming {id}: STS returned an unusable expiration"
                    ))
                })?;
                Ok((
                    c.access_key_id().to_string(),
                    c.secret_access_key().to_string(),
                    c.session_token().to_string(),
                    expires,
                ))
            }
            Fetcher::Agent { client, url } => {
                let req = http::Request::get(url.as_str())
                    .header(http::header::AUTHORIZATION, token.expose())
                    .body(Empty::<Bytes>::new())
                    .map_err(|e| {
                        CredsError::Invalid(format!("Pod Identity agent request to {url}: {e}"))
                    })?;
                let unavailable = |what: String| {
                    CredsError::Unavailable(format!(
                        "asking the Pod Identity agent at {url} for {id}: {what}"
                    ))
                };
                let call = async {
                    let resp = client
                        .request(req)
                        .await
                        .map_err(|e| unavailable(error_chain(&e)))?;
                    let status = resp.status();
                    let body = resp
                        .into_body()
                        .collect()
                        .await
                        .map_err(|e| unavailable(error_chain(&e)))?
                        .to_bytes();
                    Ok::<_, CredsError>((status, body))
                };
                let (status, body) = tokio::time::timeout(timeout, call)
                    .await
                    .map_err(|_| unavailable(format!("no answer within {timeout:?}")))??;
                if !status.is_success() {
                    // The agent's message, cut short and scrubbed of the token in case it echoes it.
                    let text: String = String::from_utf8_lossy(&body)
                        .replace(token.expose(), "<redacted>")
                        .chars()
                        .take(300)
                        .collect();
                    let msg = format!(
                        "the Pod Identity agent at {url} refused {id}: HTTP {status}: {}",
                        text.trim()
                    );
                    // A 4xx is the agent's verdict on this pod and token, but 429 is throttling:
                    // asking again later may work.
                    return Err(
                        if status.is_client_error() && status != http::StatusCode::TOO_MANY_REQUESTS
                        {
                            CredsError::Denied(msg)
                        } else {
                            CredsError::Unavailable(msg)
                        },
                    );
                }
                agent_credentials(&body).map_err(unavailable)
            }
        }
    }
}

/// When credentials fetched at `now` and expiring at `expires` are fetched anew: `refresh_before`
/// ahead of expiry, or halfway through their life if that is shorter (so short-lived credentials
/// are not refetched on every request).
fn refresh_point(now: SystemTime, expires: SystemTime, refresh_before: Duration) -> SystemTime {
    let lifetime = expires.duration_since(now).unwrap_or_default();
    expires - refresh_before.min(lifetime / 2)
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct AgentCredentials {
    access_key_id: String,
    secret_access_key: String,
    token: String,
    expiration: String,
}

/// The agent's answer (`{"AccessKeyId", "SecretAccessKey", "Token", "Expiration", ...}`). Errors
/// say what is wrong with it, never what it holds.
pub fn agent_credentials(body: &[u8]) -> Result<(String, String, String, SystemTime), String> {
    let c: AgentCredentials = serde_json::from_slice(body).map_err(|e| {
        format!(
            "its answer is not the credentials JSON ({:?} error at line {} column {})",
            e.classify(),
            e.line(),
            e.column()
        )
    })?;
    let expires = DateTime::from_str(&c.expiration, Format::DateTime)
        .ok()
        .and_then(|t| SystemTime::try_from(t).ok())
        .ok_or_else(|| format!("its Expiration {:?} is not RFC 3339", c.expiration))?;
    Ok((c.access_key_id, c.secret_access_key, c.token, expires))
}

/// An STS failure as a [`CredsError`] naming the role and STS's code and message (STS's messages
/// carry no token).
fn sts_error<E, R>(id: &Identity, e: SdkError<E, R>) -> CredsError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match &e {
        SdkError::ServiceError(ctx) => {
            let err = ctx.err();
            let code = err.code().unwrap_or("unknown");
            let msg = format!(
                "STS refused to let {id} assume it with the pod's token (sts:AssumeRoleWithWebIdentity): {code}: {}",
                err.message().unwrap_or("")
            );
            match code {
                "AccessDenied"
                | "InvalidIdentityToken"
                | "ExpiredTokenException"
                | "IDPRejectedClaim"
                | "RegionDisabledException"
                | "MalformedPolicyDocument" => CredsError::Denied(msg),
                _ => CredsError::Unavailable(msg),
            }
        }
        _ => CredsError::Unavailable(format!("assuming {id}: {}", error_chain(&e))),
    }
}

impl ProvideCredentials for PodCredentials {
    fn provide_credentials<'a>(&'a self) -> provider::future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        provider::future::ProvideCredentials::new(async move {
            self.credentials().await.map_err(to_credentials_error)
        })
    }
}

/// A [`CredsError`] in the SDK's terms, which the S3 client's error table reads (ferry-s3's
/// `error` module): a refusal or a malformed request is `InvalidConfiguration` — definitive, the
/// application sees `EACCES` —, a provider that could not answer (unreachable, timing out,
/// throttling, 5xx) is `ProviderError` — transient, `EIO`.
fn to_credentials_error(e: CredsError) -> CredentialsError {
    match e {
        CredsError::Denied(_) | CredsError::Invalid(_) => {
            CredentialsError::invalid_configuration(e)
        }
        CredsError::Unavailable(_) => CredentialsError::provider_error(e),
    }
}

/// One [`PodCredentials`] per identity on the node: every mount of the same (namespace, service
/// account, role) shares it, and each publish or republish hands it that pod's newest token.
pub struct PodCredentialCache {
    settings: ProviderSettings,
    providers: Mutex<HashMap<Identity, PodCredentials>>,
}

impl PodCredentialCache {
    pub fn new(settings: ProviderSettings) -> Self {
        PodCredentialCache {
            settings,
            providers: Mutex::new(HashMap::new()),
        }
    }

    /// The provider for a pod-level source, made on first use, with the source's token swapped in.
    pub fn provider(
        &self,
        source: &CredentialSource,
        pod: &PodRef,
    ) -> Result<PodCredentials, CredsError> {
        let (Some(identity), Some(token)) = (source.identity(), source.token()) else {
            return Err(CredsError::Invalid(format!(
                "{source:?} is not a pod-level credential source"
            )));
        };
        let mut providers = self.providers.lock().unwrap();
        if let Some(p) = providers.get(identity) {
            p.set_token(token.token.clone(), pod);
            return Ok(p.clone());
        }
        let p = PodCredentials::new(source, pod, self.settings.clone())?;
        providers.insert(identity.clone(), p.clone());
        Ok(p)
    }

    /// Identities with a provider, for logs and tests.
    pub fn identities(&self) -> Vec<Identity> {
        let mut v: Vec<_> = self.providers.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refresh_point_is_before_expiry() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let five_min = Duration::from_secs(300);
        // An hour-long session: five minutes before it ends.
        let hour = now + Duration::from_secs(3600);
        assert_eq!(refresh_point(now, hour, five_min), hour - five_min);
        // Eight seconds: halfway.
        let short = now + Duration::from_secs(8);
        assert_eq!(
            refresh_point(now, short, five_min),
            now + Duration::from_secs(4)
        );
        // Already expired: now.
        assert_eq!(
            refresh_point(now, now - Duration::from_secs(1), five_min),
            now - Duration::from_secs(1)
        );
    }

    /// The S3 client tells a refusal (EACCES) from an outage (EIO) by these variants.
    #[test]
    fn refusals_and_outages_reach_the_sdk_as_different_variants() {
        for e in [
            CredsError::Denied("STS: AccessDenied".into()),
            CredsError::Invalid("no token".into()),
        ] {
            assert!(
                matches!(
                    to_credentials_error(e),
                    CredentialsError::InvalidConfiguration(_)
                ),
                "a refusal is definitive"
            );
        }
        let e = to_credentials_error(CredsError::Unavailable("STS: 503".into()));
        assert!(matches!(e, CredentialsError::ProviderError(_)), "{e:?}");
    }

    /// A Pod Identity agent that cannot be reached gives an outage, not a refusal.
    #[tokio::test]
    async fn an_unreachable_pod_identity_agent_is_unavailable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/v1/credentials", listener.local_addr().unwrap());
        drop(listener);
        let source = CredentialSource::PodIdentity {
            identity: Identity {
                namespace: "ns".into(),
                service_account: "sa".into(),
                principal: crate::Principal::PodIdentityAgent {
                    agent_url: url.clone(),
                },
            },
            agent_url: url,
            token: crate::ServiceAccountToken {
                token: Secret::new("tok"),
                expires: None,
            },
        };
        let settings = ProviderSettings::load(None).await;
        let pod = PodRef {
            namespace: "ns".into(),
            name: "p".into(),
            service_account: "sa".into(),
        };
        let p = PodCredentials::new(&source, &pod, settings).unwrap();
        let e = p.provide_credentials().await.unwrap_err();
        assert!(matches!(e, CredentialsError::ProviderError(_)), "{e:?}");
    }

    #[test]
    fn agent_answer() {
        let (ak, _, _, exp) = agent_credentials(
            br#"{"AccessKeyId":"ASIAX","SecretAccessKey":"sk-value","Token":"tok-value","AccountId":"1","Expiration":"2030-01-01T00:00:00Z"}"#,
        )
        .unwrap();
        assert_eq!(ak, "ASIAX");
        assert!(exp > SystemTime::now());
        let e = agent_credentials(br#"{"AccessKeyId":"ASIAX","SecretAccessKey":"sk-value"}"#)
            .unwrap_err();
        assert!(!e.contains("sk-value"), "{e}");
    }
}
