//! [`Client`]: JSON over HTTPS to the API server (hyper + rustls), with the calls Ferry makes:
//! PVC and ServiceAccount annotations, TokenRequest, and generic get/create/patch/delete/list.
//! Every request has a timeout; errors carry the method, path and the API server's own reason.
//! Request and response bodies are never logged (TokenRequest answers carry tokens).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{json, Value};

use crate::apply::ApiResource;
use crate::config::{Auth, Config, ExecConfig, Secret};
use crate::error::{KubeError, Result};
use crate::time::parse_rfc3339;

/// Object annotations.
pub type Annotations = BTreeMap<String, String>;

/// How long one request may take unless [`Client::with_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Content type of a JSON merge patch.
pub const MERGE_PATCH: &str = "application/merge-patch+json";
/// Content type of a server-side apply patch (JSON is YAML).
pub const APPLY_PATCH: &str = "application/apply-patch+yaml";

type Http = hyper_util::client::legacy::Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A token issued by the TokenRequest API.
#[derive(Debug, Clone)]
pub struct ServiceAccountToken {
    pub token: Secret,
    pub expiration: SystemTime,
}

/// A Kubernetes API client. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    http: Http,
    server: String,
    auth: Auth,
    namespace: String,
    source: String,
    timeout: Duration,
    exec_token: tokio::sync::Mutex<Option<(Secret, Option<SystemTime>)>>,
    pub(crate) discovery: Mutex<HashMap<String, Arc<Vec<ApiResource>>>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.inner.server)
            .field("source", &self.inner.source)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client for `config`. Fails if its certificates or key cannot be used.
    pub fn new(config: Config) -> Result<Client> {
        Client::with_timeout(config, DEFAULT_TIMEOUT)
    }

    /// A client whose requests each give up after `timeout`.
    pub fn with_timeout(config: Config, timeout: Duration) -> Result<Client> {
        let tls = tls_config(&config)?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .build();
        let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(https);
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                server: config.server,
                auth: config.auth,
                namespace: config.namespace,
                source: config.source,
                timeout,
                exec_token: tokio::sync::Mutex::new(None),
                discovery: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// A client for [`Config::infer`]`(explicit)`.
    pub fn infer(explicit: Option<&Path>) -> Result<Client> {
        Client::new(Config::infer(explicit)?)
    }

    /// The API server's base URL.
    pub fn server(&self) -> &str {
        &self.inner.server
    }

    /// The namespace of the kubeconfig context (or the pod's), `default` if none.
    pub fn default_namespace(&self) -> &str {
        &self.inner.namespace
    }

    pub(crate) fn discovery(&self) -> &Mutex<HashMap<String, Arc<Vec<ApiResource>>>> {
        &self.inner.discovery
    }

    /// Sends one request; `path` starts with `/` and may carry a query. Returns the body of a 2xx
    /// answer, else [`KubeError::Api`] with the server's reason and message.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<(Vec<u8>, &str)>,
    ) -> Result<Bytes> {
        let uri = format!("{}{}", self.inner.server, path);
        let mut req = Request::builder()
            .method(method.clone())
            .uri(&uri)
            .header(http::header::ACCEPT, "application/json")
            .header(
                http::header::USER_AGENT,
                concat!("ferry-kube/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(token) = self.bearer().await? {
            let mut value = http::HeaderValue::from_str(&format!("Bearer {}", token.expose()))
                .map_err(|_| {
                    KubeError::Tls("the bearer token is not a valid header value".into())
                })?;
            value.set_sensitive(true);
            req = req.header(http::header::AUTHORIZATION, value);
        }
        let body = match body {
            Some((bytes, content_type)) => {
                req = req.header(http::header::CONTENT_TYPE, content_type);
                Full::new(Bytes::from(bytes))
            }
            None => Full::new(Bytes::new()),
        };
        let req = req.body(body).map_err(|e| KubeError::Transport {
            method: method.to_string(),
            path: path.to_string(),
            reason: format!("building the request: {e}"),
        })?;
        let transport = |reason: String| KubeError::Transport {
            method: method.to_string(),
            path: path.to_string(),
            reason,
        };
        let exchange = async {
            let resp = self
                .inner
                .http
                .request(req)
                .await
                .map_err(|e| transport(error_chain(&e)))?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| transport(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok::<_, KubeError>((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(self.inner.timeout, exchange)
            .await
            .map_err(|_| KubeError::Timeout {
                method: method.to_string(),
                path: path.to_string(),
                seconds: self.inner.timeout.as_secs(),
            })??;
        tracing::debug!(%method, path, status = status.as_u16(), "kube API call");
        if status.is_success() {
            return Ok(bytes);
        }
        if status == StatusCode::UNAUTHORIZED {
            // An expired exec token: the next call runs the plugin again.
            *self.inner.exec_token.lock().await = None;
        }
        let (reason, message) = match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) if v.get("kind").and_then(Value::as_str) == Some("Status") => (
                v["reason"].as_str().unwrap_or_default().to_string(),
                v["message"].as_str().unwrap_or_default().to_string(),
            ),
            _ => (
                status.canonical_reason().unwrap_or_default().to_string(),
                String::from_utf8_lossy(&bytes).chars().take(500).collect(),
            ),
        };
        Err(KubeError::Api {
            method: method.to_string(),
            path: path.to_string(),
            status: status.as_u16(),
            reason,
            message,
        })
    }

    /// [`Client::send`] with a JSON body and a JSON answer (`Value::Null` if the answer is empty).
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<(&Value, &str)>,
    ) -> Result<Value> {
        let body = body.map(|(v, ct)| (serde_json::to_vec(v).expect("a Value serializes"), ct));
        let bytes = self.send(method.clone(), path, body).await?;
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|e| KubeError::Decode {
            what: format!("{method} {path}"),
            reason: e.to_string(),
        })
    }

    /// GET a JSON object.
    pub async fn get(&self, path: &str) -> Result<Value> {
        self.request(Method::GET, path, None).await
    }

    /// GET a JSON object; `None` if it does not exist.
    pub async fn get_opt(&self, path: &str) -> Result<Option<Value>> {
        match self.get(path).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The `items` of a list (`path` may carry `?labelSelector=`/`fieldSelector=`, see [`query`]).
    pub async fn list(&self, path: &str) -> Result<Vec<Value>> {
        let v = self.get(path).await?;
        match v.get("items") {
            Some(Value::Array(items)) => Ok(items.clone()),
            Some(Value::Null) | None => Ok(Vec::new()),
            Some(_) => Err(KubeError::Decode {
                what: format!("GET {path}"),
                reason: "items is not a list".into(),
            }),
        }
    }

    /// POST an object to a collection.
    pub async fn create(&self, path: &str, object: &Value) -> Result<Value> {
        self.request(Method::POST, path, Some((object, "application/json")))
            .await
    }

    /// A JSON merge patch.
    pub async fn patch_merge(&self, path: &str, patch: &Value) -> Result<Value> {
        self.request(Method::PATCH, path, Some((patch, MERGE_PATCH)))
            .await
    }

    /// DELETE; `Ok(false)` if it was already gone.
    pub async fn delete(&self, path: &str) -> Result<bool> {
        match self.request(Method::DELETE, path, None).await {
            Ok(_) => Ok(true),
            Err(e) if e.is_not_found() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// GET `/readyz`: `Ok` once the API server says it is ready.
    pub async fn readyz(&self) -> Result<()> {
        self.send(Method::GET, "/readyz", None).await.map(drop)
    }

    /// A PersistentVolumeClaim's annotations.
    pub async fn get_pvc(&self, namespace: &str, name: &str) -> Result<Annotations> {
        let path = format!(
            "/api/v1/namespaces/{}/persistentvolumeclaims/{}",
            segment("namespace", namespace)?,
            segment("PVC name", name)?
        );
        Ok(annotations(&self.get(&path).await?))
    }

    /// A ServiceAccount's annotations (e.g. `eks.amazonaws.com/role-arn`).
    pub async fn get_service_account(&self, namespace: &str, name: &str) -> Result<Annotations> {
        let path = format!(
            "/api/v1/namespaces/{}/serviceaccounts/{}",
            segment("namespace", namespace)?,
            segment("service account name", name)?
        );
        Ok(annotations(&self.get(&path).await?))
    }

    /// A token for `namespace/service_account` from the TokenRequest API, for `audiences`, valid
    /// for `expiration_seconds` (the API server may shorten or lengthen it; see `expiration`).
    pub async fn create_token(
        &self,
        namespace: &str,
        service_account: &str,
        audiences: &[&str],
        expiration_seconds: i64,
    ) -> Result<ServiceAccountToken> {
        let path = format!(
            "/api/v1/namespaces/{}/serviceaccounts/{}/token",
            segment("namespace", namespace)?,
            segment("service account name", service_account)?
        );
        let body = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": { "audiences": audiences, "expirationSeconds": expiration_seconds },
        });
        let v = self.create(&path, &body).await?;
        let decode = |reason: &str| KubeError::Decode {
            what: format!("TokenRequest for {namespace}/{service_account}"),
            reason: reason.to_string(),
        };
        let token = v["status"]["token"]
            .as_str()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| decode("no status.token"))?;
        let expiration = v["status"]["expirationTimestamp"]
            .as_str()
            .and_then(parse_rfc3339)
            .ok_or_else(|| decode("no RFC 3339 status.expirationTimestamp"))?;
        Ok(ServiceAccountToken {
            token: Secret::new(token),
            expiration,
        })
    }

    async fn bearer(&self) -> Result<Option<Secret>> {
        match &self.inner.auth {
            Auth::None | Auth::ClientCert { .. } => Ok(None),
            Auth::Token(t) => Ok(Some(t.clone())),
            Auth::TokenFile(path) => {
                let t = std::fs::read_to_string(path).map_err(|source| KubeError::Io {
                    path: path.clone(),
                    source,
                })?;
                Ok(Some(Secret::new(t.trim())))
            }
            Auth::Exec(exec) => {
                let mut cached = self.inner.exec_token.lock().await;
                if let Some((token, expiry)) = cached.as_ref() {
                    let fresh =
                        expiry.is_none_or(|e| e > SystemTime::now() + Duration::from_secs(30));
                    if fresh {
                        return Ok(Some(token.clone()));
                    }
                }
                let (token, expiry) = run_exec(exec).await?;
                *cached = Some((token.clone(), expiry));
                Ok(Some(token))
            }
        }
    }
}

/// Runs an exec credential plugin and returns its token and expiry.
async fn run_exec(exec: &ExecConfig) -> Result<(Secret, Option<SystemTime>)> {
    let err = |reason: String| KubeError::Exec {
        command: exec.command.clone(),
        reason,
    };
    let info = json!({
        "apiVersion": exec.api_version,
        "kind": "ExecCredential",
        "spec": { "interactive": false },
    });
    let out = tokio::process::Command::new(&exec.command)
        .args(&exec.args)
        .envs(exec.env.iter().map(|(k, v)| (k, v)))
        .env("KUBERNETES_EXEC_INFO", info.to_string())
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| err(format!("cannot run it: {e}")))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(err(format!(
            "{}: {}",
            out.status,
            stderr.chars().take(500).collect::<String>()
        )));
    }
    let v: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| err(format!("its output is not an ExecCredential: {e}")))?;
    let token = v["status"]["token"]
        .as_str()
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            err("no status.token (client certificates from exec plugins are not supported)".into())
        })?;
    let expiry = v["status"]["expirationTimestamp"]
        .as_str()
        .and_then(parse_rfc3339);
    Ok((Secret::new(token), expiry))
}

fn tls_config(config: &Config) -> Result<rustls::ClientConfig> {
    let tls = |what: &str, e: &dyn std::fmt::Display| {
        KubeError::Tls(format!(
            "{} ({}): {what}: {e}",
            config.server, config.source
        ))
    };
    let mut roots = rustls::RootCertStore::empty();
    match &config.ca_pem {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| tls("CA bundle", &e))?;
                roots.add(cert).map_err(|e| tls("CA certificate", &e))?;
            }
            if roots.is_empty() {
                return Err(tls("CA bundle", &"no PEM certificate in it"));
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls("protocol versions", &e))?
        .with_root_certificates(roots);
    Ok(match &config.auth {
        Auth::ClientCert { cert_pem, key_pem } => {
            let certs = CertificateDer::pem_slice_iter(cert_pem)
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| tls("client certificate", &e))?;
            if certs.is_empty() {
                return Err(tls("client certificate", &"no PEM certificate in it"));
            }
            let key = PrivateKeyDer::from_pem_slice(key_pem.expose().as_bytes())
                .map_err(|e| tls("client key", &e))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| tls("client certificate and key", &e))?
        }
        _ => builder.with_no_client_auth(),
    })
}

/// The causes of an error, joined, so "connection refused" is not hidden behind "client error".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// `metadata.annotations` of an object (empty if none).
pub fn annotations(object: &Value) -> Annotations {
    object["metadata"]["annotations"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// Checks a name that goes into a URL path: non-empty, no `/`, `?`, `%` or `#`.
pub fn segment<'a>(what: &str, s: &'a str) -> Result<&'a str> {
    if s.is_empty() || s.contains(['/', '?', '#', '%']) || s == "." || s == ".." {
        return Err(KubeError::InvalidObject {
            object: s.to_string(),
            reason: format!("not a valid {what}"),
        });
    }
    Ok(s)
}

/// Percent-encodes a query value (label and field selectors).
pub fn query(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_and_queries() {
        assert!(segment("name", "ok-name.1").is_ok());
        for bad in ["", "a/b", "a?b", "..", "a%2F"] {
            assert!(segment("name", bad).is_err(), "{bad}");
        }
        assert_eq!(
            query("involvedObject.name=x,type!=Normal"),
            "involvedObject.name%3Dx%2Ctype%21%3DNormal"
        );
    }

    fn client(auth: Auth) -> Client {
        Client::new(Config {
            server: "https://127.0.0.1:1".into(),
            ca_pem: None,
            auth,
            namespace: "default".into(),
            source: "test".into(),
        })
        .unwrap()
    }

    #[tokio::test]
    async fn token_files_are_re_read_and_exec_plugins_cached_until_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "one\n").unwrap();
        let c = client(Auth::TokenFile(file.clone()));
        assert_eq!(c.bearer().await.unwrap().unwrap().expose(), "one");
        std::fs::write(&file, "two").unwrap();
        assert_eq!(c.bearer().await.unwrap().unwrap().expose(), "two");

        // A plugin that counts its runs and answers with an ExecCredential.
        let script = dir.path().join("plugin.sh");
        let runs = dir.path().join("runs");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho run >> {}\ntest \"$FERRY_X\" = y || exit 3\necho \"$KUBERNETES_EXEC_INFO\" | grep -q ExecCredential || exit 4\necho '{{\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"exec-token\",\"expirationTimestamp\":\"'$1'\"}}}}'\n",
                runs.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let exec = |expiry: &str| {
            client(Auth::Exec(ExecConfig {
                command: script.display().to_string(),
                args: vec![expiry.to_string()],
                env: vec![("FERRY_X".into(), "y".into())],
                api_version: "client.authentication.k8s.io/v1".into(),
            }))
        };
        let runs_so_far = || {
            std::fs::read_to_string(&runs)
                .unwrap_or_default()
                .lines()
                .count()
        };
        let fresh = exec("2999-01-01T00:00:00Z");
        for _ in 0..3 {
            assert_eq!(
                fresh.bearer().await.unwrap().unwrap().expose(),
                "exec-token"
            );
        }
        assert_eq!(runs_so_far(), 1, "a token valid until 2999 is cached");
        let expired = exec("2000-01-01T00:00:00Z");
        expired.bearer().await.unwrap();
        expired.bearer().await.unwrap();
        assert_eq!(runs_so_far(), 3, "an expired token is fetched again");

        let failing = client(Auth::Exec(ExecConfig {
            command: script.display().to_string(),
            args: vec![],
            env: vec![],
            api_version: "client.authentication.k8s.io/v1".into(),
        }));
        let err = failing.bearer().await.unwrap_err().to_string();
        assert!(
            err.contains("plugin.sh") && err.contains("exit status: 3"),
            "{err}"
        );
    }

    #[test]
    fn annotations_of_an_object() {
        let v = json!({"metadata": {"annotations": {"a": "1", "b": "2"}}});
        assert_eq!(annotations(&v).get("b").map(String::as_str), Some("2"));
        assert!(annotations(&json!({})).is_empty());
    }
}
