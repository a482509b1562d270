//! Where the API server is and how to authenticate: a kubeconfig file (`--kubeconfig`,
//! `KUBECONFIG`, `~/.kube/config`) or the in-cluster service account mount. Parsed once into a
//! [`Config`]; file-backed tokens (the in-cluster one is rotated by kubelet) are re-read on use.
//!
//! Supported kubeconfig features: `current-context` or a named context; cluster `server`,
//! `certificate-authority(-data)`; user `token`, `tokenFile`, `client-certificate(-data)` +
//! `client-key(-data)`, and `exec` plugins that return a token (e.g. `aws eks get-token`).
//! Anything else that would change how we authenticate (`insecure-skip-tls-verify`, `proxy-url`,
//! `auth-provider`, basic auth) is refused with an error naming it, never ignored.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{KubeError, Result};

/// The in-cluster service account mount.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A credential (token, key, password): shown as `<redacted>` by `Debug`, no `Display`, read only
/// through [`Secret::expose`]. The one secret string type of the workspace (ferry-creds uses it).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The secret itself: pass it on, never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// How the client proves who it is.
#[derive(Debug, Clone)]
pub enum Auth {
    /// Anonymous.
    None,
    /// A bearer token.
    Token(Secret),
    /// A bearer token read from this file on every request (rotated by kubelet in a pod).
    TokenFile(PathBuf),
    /// A TLS client certificate (PEM) and its key (PEM).
    ClientCert { cert_pem: Vec<u8>, key_pem: Secret },
    /// A credential plugin run for a token, re-run when the token expires.
    Exec(ExecConfig),
}

/// An `exec` credential plugin from a kubeconfig.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    pub command: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub api_version: String,
}

/// A validated client configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// `https://host:port`, possibly with a path prefix; no trailing `/`.
    pub server: String,
    /// PEM CA bundle that signs the server's certificate; `None` trusts the system roots.
    pub ca_pem: Option<Vec<u8>>,
    pub auth: Auth,
    /// The namespace the context names (`default` if none).
    pub namespace: String,
    /// Where this came from, for error messages (`kubeconfig /path (context x)`, `in-cluster`).
    pub source: String,
}

impl Config {
    /// The first configuration found: `explicit` (e.g. `--kubeconfig`), else `$KUBECONFIG` (the
    /// first existing file of the list; files are not merged), else in-cluster when
    /// `KUBERNETES_SERVICE_HOST` is set, else `~/.kube/config`.
    pub fn infer(explicit: Option<&Path>) -> Result<Config> {
        if let Some(path) = explicit {
            return Config::from_kubeconfig(path, None);
        }
        if let Some(list) = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
            let first = std::env::split_paths(&list).find(|p| p.is_file());
            return match first {
                Some(p) => Config::from_kubeconfig(&p, None),
                None => Err(KubeError::Kubeconfig {
                    path: PathBuf::from(list),
                    reason: "KUBECONFIG names no existing file".into(),
                }),
            };
        }
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            return Config::in_cluster();
        }
        if let Some(home) = std::env::var_os("HOME") {
            let p = Path::new(&home).join(".kube/config");
            if p.is_file() {
                return Config::from_kubeconfig(&p, None);
            }
        }
        Err(KubeError::NoConfig)
    }

    /// The pod's service account: `KUBERNETES_SERVICE_HOST`/`_PORT`, the mounted CA and token
    /// (the token is re-read on every request, so kubelet's rotation is followed).
    pub fn in_cluster() -> Result<Config> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST")
            .map_err(|_| KubeError::InCluster("KUBERNETES_SERVICE_HOST is not set".into()))?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT")
            .map_err(|_| KubeError::InCluster("KUBERNETES_SERVICE_PORT is not set".into()))?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        let ca = dir.join("ca.crt");
        let ca_pem = read(&ca)?;
        let token = dir.join("token");
        if !token.is_file() {
            return Err(KubeError::InCluster(format!(
                "{} does not exist (is automountServiceAccountToken off?)",
                token.display()
            )));
        }
        let namespace = std::fs::read_to_string(dir.join("namespace"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "default".into());
        Ok(Config {
            server: format!("https://{host}:{port}"),
            ca_pem: Some(ca_pem),
            auth: Auth::TokenFile(token),
            namespace,
            source: "in-cluster".into(),
        })
    }

    /// A kubeconfig file, with `context` or its `current-context`.
    pub fn from_kubeconfig(path: &Path, context: Option<&str>) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|source| KubeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Config::parse_kubeconfig(&text, base, context).map_err(|reason| KubeError::Kubeconfig {
            path: path.to_path_buf(),
            reason,
        })
    }

    /// Parses kubeconfig text; relative file paths are resolved against `base`.
    pub fn parse_kubeconfig(
        text: &str,
        base: &Path,
        context: Option<&str>,
    ) -> std::result::Result<Config, String> {
        let raw: RawKubeconfig =
            serde_yaml::from_str(text).map_err(|e| format!("not a kubeconfig: {e}"))?;
        let ctx_name = match context {
            Some(c) => c.to_string(),
            None => raw
                .current_context
                .clone()
                .filter(|c| !c.is_empty())
                .ok_or("no current-context is set and no context was named")?,
        };
        let ctx = raw
            .contexts
            .iter()
            .find(|c| c.name == ctx_name)
            .map(|c| &c.context)
            .ok_or_else(|| format!("context {ctx_name:?} is not defined"))?;
        let cluster = raw
            .clusters
            .iter()
            .find(|c| c.name == ctx.cluster)
            .map(|c| &c.cluster)
            .ok_or_else(|| {
                format!(
                    "cluster {:?} (of context {ctx_name:?}) is not defined",
                    ctx.cluster
                )
            })?;
        let user = match &ctx.user {
            None => RawUser::default(),
            Some(u) => raw
                .users
                .iter()
                .find(|x| &x.name == u)
                .map(|x| x.user.clone())
                .ok_or_else(|| format!("user {u:?} (of context {ctx_name:?}) is not defined"))?,
        };

        let server = cluster.server.trim_end_matches('/').to_string();
        if !server.starts_with("https://") {
            return Err(format!(
                "cluster {:?}: server {server:?} is not an https:// URL (plain HTTP is not supported)",
                ctx.cluster
            ));
        }
        if cluster.insecure_skip_tls_verify {
            return Err(format!(
                "cluster {:?}: insecure-skip-tls-verify is not supported: give certificate-authority(-data)",
                ctx.cluster
            ));
        }
        if cluster.proxy_url.is_some() {
            return Err(format!(
                "cluster {:?}: proxy-url is not supported",
                ctx.cluster
            ));
        }
        let ca_pem = match (
            &cluster.certificate_authority_data,
            &cluster.certificate_authority,
        ) {
            (Some(data), _) => Some(b64("certificate-authority-data", data)?),
            (None, Some(file)) => Some(read_str(&resolve(base, file))?),
            (None, None) => None,
        };

        if user.auth_provider.is_some() {
            return Err(format!(
                "user {:?}: auth-provider plugins are not supported (use an exec plugin)",
                ctx.user
            ));
        }
        if user.username.is_some() || user.password.is_some() {
            return Err(format!("user {:?}: basic auth is not supported", ctx.user));
        }
        let cert = match (&user.client_certificate_data, &user.client_certificate) {
            (Some(d), _) => Some(b64("client-certificate-data", d)?),
            (None, Some(f)) => Some(read_str(&resolve(base, f))?),
            (None, None) => None,
        };
        let key = match (&user.client_key_data, &user.client_key) {
            (Some(d), _) => Some(b64("client-key-data", d)?),
            (None, Some(f)) => Some(read_str(&resolve(base, f))?),
            (None, None) => None,
        };
        let auth = if let Some(token) = user.token.filter(|t| !t.is_empty()) {
            Auth::Token(Secret(token))
        } else if let Some(file) = &user.token_file {
            Auth::TokenFile(resolve(base, file))
        } else if let Some(exec) = user.exec {
            Auth::Exec(ExecConfig {
                command: exec.command,
                args: exec.args,
                env: exec.env.into_iter().map(|e| (e.name, e.value)).collect(),
                api_version: exec
                    .api_version
                    .unwrap_or_else(|| "client.authentication.k8s.io/v1".into()),
            })
        } else {
            match (cert, key) {
                (Some(cert_pem), Some(key_pem)) => Auth::ClientCert {
                    cert_pem,
                    key_pem: Secret(
                        String::from_utf8(key_pem).map_err(|_| "client key is not PEM text")?,
                    ),
                },
                (Some(_), None) => {
                    return Err(format!(
                        "user {:?}: client certificate without client key",
                        ctx.user
                    ))
                }
                (None, Some(_)) => {
                    return Err(format!(
                        "user {:?}: client key without client certificate",
                        ctx.user
                    ))
                }
                (None, None) => Auth::None,
            }
        };
        Ok(Config {
            server,
            ca_pem,
            auth,
            namespace: ctx.namespace.clone().unwrap_or_else(|| "default".into()),
            source: format!("kubeconfig context {ctx_name:?}"),
        })
    }
}

fn resolve(base: &Path, file: &str) -> PathBuf {
    let p = Path::new(file);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| KubeError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_str(path: &Path) -> std::result::Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))
}

fn b64(field: &str, data: &str) -> std::result::Result<Vec<u8>, String> {
    use base64::Engine;
    let clean: String = data.chars().filter(|c| !c.is_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(clean)
        .map_err(|e| format!("{field} is not base64: {e}"))
}

#[derive(Debug, Deserialize, Default)]
struct RawKubeconfig {
    #[serde(rename = "current-context", default)]
    current_context: Option<String>,
    #[serde(default)]
    clusters: Vec<NamedCluster>,
    #[serde(default)]
    contexts: Vec<NamedContext>,
    #[serde(default)]
    users: Vec<NamedUser>,
}

#[derive(Debug, Deserialize)]
struct NamedCluster {
    name: String,
    cluster: RawCluster,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct RawCluster {
    server: String,
    #[serde(default)]
    certificate_authority: Option<String>,
    #[serde(default)]
    certificate_authority_data: Option<String>,
    #[serde(default)]
    insecure_skip_tls_verify: bool,
    #[serde(default)]
    proxy_url: Option<String>,
}

#[derive(Debug, Deserialize)]
struct NamedContext {
    name: String,
    context: RawContext,
}

#[derive(Debug, Deserialize)]
struct RawContext {
    cluster: String,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
}

#[derive(Debug, Deserialize)]
struct NamedUser {
    name: String,
    #[serde(default)]
    user: RawUser,
}

#[derive(Clone, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
struct RawUser {
    #[serde(default)]
    token: Option<String>,
    #[serde(default, rename = "tokenFile")]
    token_file: Option<String>,
    #[serde(default)]
    client_certificate: Option<String>,
    #[serde(default)]
    client_certificate_data: Option<String>,
    #[serde(default)]
    client_key: Option<String>,
    #[serde(default)]
    client_key_data: Option<String>,
    #[serde(default)]
    exec: Option<RawExec>,
    #[serde(default)]
    auth_provider: Option<serde_yaml::Value>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

// Hand-written so a token in a kubeconfig never reaches a log through `{:?}`.
impl fmt::Debug for RawUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawUser").finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawExec {
    command: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: Vec<RawEnv>,
    #[serde(default)]
    api_version: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct RawEnv {
    name: String,
    value: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECONFIG: &str = r#"
apiVersion: v1
kind: Config
current-context: admin@local
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:6443/
    certificate-authority-data: Y2EtcGVt
contexts:
- name: admin@local
  context: { cluster: local, user: admin, namespace: ml }
- name: eks
  context: { cluster: local, user: eks }
- name: tok
  context: { cluster: local, user: tok }
users:
- name: admin
  user:
    client-certificate-data: Y2VydA==
    client-key-data: a2V5
- name: eks
  user:
    exec:
      apiVersion: client.authentication.k8s.io/v1beta1
      command: aws
      args: [eks, get-token, --cluster-name, c]
      env: [{ name: AWS_PROFILE, value: p }]
- name: tok
  user: { token: s3cr3t }
"#;

    #[test]
    fn current_context_with_client_cert() {
        let c = Config::parse_kubeconfig(KUBECONFIG, Path::new("/x"), None).unwrap();
        assert_eq!(c.server, "https://127.0.0.1:6443");
        assert_eq!(c.ca_pem.as_deref(), Some(&b"ca-pem"[..]));
        assert_eq!(c.namespace, "ml");
        match c.auth {
            Auth::ClientCert { cert_pem, key_pem } => {
                assert_eq!(cert_pem, b"cert");
                assert_eq!(key_pem.expose(), "key");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn exec_and_token_users() {
        let c = Config::parse_kubeconfig(KUBECONFIG, Path::new("/x"), Some("eks")).unwrap();
        let Auth::Exec(e) = c.auth else { panic!() };
        assert_eq!(e.command, "aws");
        assert_eq!(e.args[1], "get-token");
        assert_eq!(e.env, vec![("AWS_PROFILE".to_string(), "p".to_string())]);
        assert_eq!(e.api_version, "client.authentication.k8s.io/v1beta1");
        let c = Config::parse_kubeconfig(KUBECONFIG, Path::new("/x"), Some("tok")).unwrap();
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cr3t"),
            "token leaked into Debug: {shown}"
        );
        assert!(matches!(c.auth, Auth::Token(t) if t.expose() == "s3cr3t"));
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let err = Config::parse_kubeconfig(KUBECONFIG, Path::new("/x"), Some("nope")).unwrap_err();
        assert!(err.contains("\"nope\""), "{err}");
        let insecure = KUBECONFIG.replace(
            "certificate-authority-data: Y2VydA==",
            "insecure-skip-tls-verify: true",
        );
        let insecure = insecure.replace(
            "certificate-authority-data: Y2EtcGVt",
            "insecure-skip-tls-verify: true",
        );
        let err = Config::parse_kubeconfig(&insecure, Path::new("/x"), None).unwrap_err();
        assert!(err.contains("insecure-skip-tls-verify"), "{err}");
        let http = KUBECONFIG.replace("https://127", "http://127");
        let err = Config::parse_kubeconfig(&http, Path::new("/x"), None).unwrap_err();
        assert!(err.contains("not an https"), "{err}");
    }

    #[test]
    fn relative_files_resolve_against_the_kubeconfig_dir() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.crt"), "CA").unwrap();
        let text = KUBECONFIG.replace(
            "certificate-authority-data: Y2EtcGVt",
            "certificate-authority: ca.crt",
        );
        let c = Config::parse_kubeconfig(&text, dir.path(), None).unwrap();
        assert_eq!(c.ca_pem.as_deref(), Some(&b"CA"[..]));
    }
}
