//! [`KubeCluster`]: a real Kubernetes control plane on loopback for tests and the e2e: etcd,
//! kube-apiserver and kube-controller-manager (only the PersistentVolume controllers: no kubelet,
//! no scheduler, no pods run). Certificates and the service account signing key are generated
//! with the `openssl` CLI into a temp dir; the admin credential is a client certificate in
//! `system:masters`. Everything is killed and removed on drop.
//!
//! The binaries are found as `$FERRY_TOOLS/<name>`, then `~/.cache/ferry-tools/bin/<name>`, then
//! `PATH`; `scripts/kube-tools.sh` builds them from the Go module proxy.
//!
//! The API server accepts service account tokens for the audiences in [`API_AUDIENCES`] (its own
//! issuer, `sts.amazonaws.com` for IRSA, `pods.eks.amazonaws.com` for EKS Pod Identity), so
//! TokenRequest can issue what kubelet would hand a CSI driver ([`create_token`]).

use std::fs::File;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::PostParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use secrecy::SecretString;

use crate::apply::describe_error;
use crate::{free_port, read_log};

/// The service account issuer of the test cluster.
pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// Audiences the test API server accepts in service account tokens.
pub const API_AUDIENCES: &[&str] = &[ISSUER, "sts.amazonaws.com", "pods.eks.amazonaws.com"];
/// The controllers kube-controller-manager runs: the PV binder (binds PVCs and PVs and marks
/// PVCs for external provisioners with `volume.kubernetes.io/storage-provisioner`) and the
/// protection finalizers' controllers, which let deleted PVCs and PVs go away.
pub const CONTROLLERS: &str = "persistentvolume-binder-controller,persistentvolume-protection-controller,persistentvolumeclaim-protection-controller,serviceaccount-controller";
/// What a cluster running pods adds: DaemonSets, Deployments and their ReplicaSets, the garbage
/// collector (owned objects go with their owner), the `kube-root-ca.crt` ConfigMap every pod's
/// service account volume mounts, the TTL controller kubelet's ConfigMap cache reads, and the node
/// lifecycle controller, which lifts the `node.kubernetes.io/not-ready` taint kubelet registers a
/// node with (without it no pod without a toleration is ever scheduled), and the namespace
/// controller (a deleted namespace's objects go with it; without it the namespace stays
/// `Terminating`).
pub const WORKLOAD_CONTROLLERS: &str = "daemonset-controller,deployment-controller,replicaset-controller,garbage-collector-controller,root-ca-certificate-publisher-controller,ttl-controller,node-lifecycle-controller,namespace-controller";

/// How long the control plane may take to become ready (a loaded 2-core machine is slow).
pub const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// How to get the binaries; part of every "not found" error.
pub const KUBE_TOOLS_HINT: &str = "build them with ./scripts/kube-tools.sh (into ~/.cache/ferry-tools/bin), or set FERRY_TOOLS to the directory holding them";

/// Why the cluster could not start; names the step and carries the process's log.
#[derive(Debug, thiserror::Error)]
pub enum KubeClusterError {
    #[error("{name} was not found: {KUBE_TOOLS_HINT}")]
    ToolMissing { name: String },
    #[error("{step}: {reason}")]
    Setup { step: String, reason: String },
    #[error(
        "{name} did not become ready: {reason}\n--- last lines of its log ({log_path}) ---\n{log}"
    )]
    NotReady {
        name: String,
        reason: String,
        log_path: PathBuf,
        log: String,
    },
}

type Result<T> = std::result::Result<T, KubeClusterError>;

/// Where a tool is: `$FERRY_TOOLS/NAME`, `~/.cache/ferry-tools/bin/NAME`, then `PATH`.
pub fn tool_path(name: &str) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("FERRY_TOOLS") {
        let p = Path::new(&dir).join(name);
        if p.is_file() {
            return Some(p);
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        let p = Path::new(&home).join(".cache/ferry-tools/bin").join(name);
        if p.is_file() {
            return Some(p);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// What to start.
#[derive(Debug, Clone)]
pub struct KubeClusterOptions {
    /// `--emulated-version` of kube-apiserver (`1.33`..`1.36` for the v1.36 binary): the API
    /// surface and defaults of that Kubernetes version, to check manifests against older clusters.
    pub emulated_version: Option<String>,
    /// Start kube-controller-manager (the PV controllers); not needed for pure API checks.
    pub controller_manager: bool,
    /// Also run what workloads need ([`WORKLOAD_CONTROLLERS`] in the controller manager, and
    /// kube-scheduler): for a cluster with a node ([`crate::kubelet::KubeNode`]).
    pub workloads: bool,
}

impl Default for KubeClusterOptions {
    fn default() -> Self {
        KubeClusterOptions {
            emulated_version: None,
            controller_manager: true,
            workloads: false,
        }
    }
}

/// A running etcd + kube-apiserver + kube-controller-manager on 127.0.0.1.
pub struct KubeCluster {
    children: Vec<(String, Child)>,
    port: u16,
    kubeconfig: PathBuf,
    path: PathBuf,
    /// `None` once [`KubeCluster::keep_dir`] was called.
    dir: Option<tempfile::TempDir>,
    /// How long each component took to come up, for reports.
    pub startup: Vec<(String, Duration)>,
}

impl std::fmt::Debug for KubeCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeCluster")
            .field("server", &self.server())
            .field("dir", &self.path)
            .finish_non_exhaustive()
    }
}

impl KubeCluster {
    /// Generates certificates, starts etcd, kube-apiserver and kube-controller-manager, and waits
    /// until the API server's `/readyz` answers ok. The temp dir is made under
    /// `$FERRY_TEST_TMPDIR`, else the system temp dir.
    pub async fn start() -> Result<KubeCluster> {
        KubeCluster::start_with(KubeClusterOptions::default()).await
    }

    /// [`KubeCluster::start`] with options. Ports are picked free just before use, so another
    /// process can take one first: a start that fails on "address already in use" is retried
    /// with new ports (as [`crate::S3Server::start`] does).
    pub async fn start_with(options: KubeClusterOptions) -> Result<KubeCluster> {
        let mut attempt = 1;
        loop {
            match KubeCluster::start_once(options.clone()).await {
                Err(KubeClusterError::NotReady { ref log, .. })
                    if attempt < 5 && log.contains("address already in use") =>
                {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once(options: KubeClusterOptions) -> Result<KubeCluster> {
        let etcd = tool("etcd")?;
        let apiserver = tool("kube-apiserver")?;
        let kcm = if options.controller_manager {
            Some(tool("kube-controller-manager")?)
        } else {
            None
        };
        let scheduler = if options.workloads {
            Some(tool("kube-scheduler")?)
        } else {
            None
        };
        let base = std::env::var_os("FERRY_TEST_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = tempfile::Builder::new()
            .prefix("ferry-kube-")
            .tempdir_in(&base)
            .map_err(|e| setup("creating a temp dir", e))?;
        let pki = dir.path().join("pki");
        std::fs::create_dir_all(&pki).map_err(|e| setup("creating the pki dir", e))?;
        generate_pki(&pki)?;

        let mut cluster = KubeCluster {
            children: Vec::new(),
            port: free_port(),
            kubeconfig: dir.path().join("kubeconfig"),
            path: dir.path().to_path_buf(),
            dir: Some(dir),
            startup: Vec::new(),
        };
        let d = cluster.path.clone();

        // etcd
        let t0 = Instant::now();
        let (client_port, peer_port) = (free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        cluster.spawn(
            "etcd",
            &etcd,
            &[
                "--name=ferry-test",
                &format!("--data-dir={}", d.join("etcd").display()),
                &format!("--listen-client-urls={etcd_url}"),
                &format!("--advertise-client-urls={etcd_url}"),
                &format!("--listen-peer-urls={peer_url}"),
                &format!("--initial-advertise-peer-urls={peer_url}"),
                &format!("--initial-cluster=ferry-test={peer_url}"),
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )?;
        cluster
            .wait_for_port("etcd", client_port, READY_TIMEOUT)
            .await?;
        cluster.startup.push(("etcd".into(), t0.elapsed()));

        // kube-apiserver
        let t0 = Instant::now();
        let p = |f: &str| pki.join(f).display().to_string();
        let emulated = options
            .emulated_version
            .as_ref()
            .map(|v| format!("--emulated-version=kube={v}"));
        let mut args: Vec<String> = vec![
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".to_string(),
            "--advertise-address=127.0.0.1".to_string(),
            format!("--secure-port={}", cluster.port),
            format!("--cert-dir={}", d.join("apiserver").display()),
            format!("--tls-cert-file={}", p("server.crt")),
            format!("--tls-private-key-file={}", p("server.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            format!("--service-account-issuer={ISSUER}"),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            format!("--api-audiences={}", API_AUDIENCES.join(",")),
            "--authorization-mode=Node,RBAC".to_string(),
            "--service-cluster-ip-range=10.0.0.0/24".to_string(),
            "--allow-privileged=true".to_string(),
            "--profiling=false".to_string(),
            "--enable-priority-and-fairness=false".to_string(),
            // Logs and exec reach a kubelet at the node's InternalIP, which for the e2e's node
            // is 127.0.0.1; the admin certificate authenticates the API server to it.
            "--kubelet-preferred-address-types=InternalIP,Hostname".to_string(),
            format!("--kubelet-client-certificate={}", p("admin.crt")),
            format!("--kubelet-client-key={}", p("admin.key")),
        ];
        args.extend(emulated);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cluster.spawn("kube-apiserver", &apiserver, &args)?;
        cluster.write_kubeconfig(&pki)?;
        let client = cluster.client().await?;
        cluster.wait_ready(&client).await?;
        cluster
            .startup
            .push(("kube-apiserver".into(), t0.elapsed()));

        // kube-controller-manager: only the PV controllers, no serving port, no leader election.
        let Some(kcm) = kcm else {
            return Ok(cluster);
        };
        let t0 = Instant::now();
        let kubeconfig = cluster.kubeconfig.display().to_string();
        let controllers = if options.workloads {
            format!("{CONTROLLERS},{WORKLOAD_CONTROLLERS}")
        } else {
            CONTROLLERS.to_string()
        };
        cluster.spawn(
            "kube-controller-manager",
            &kcm,
            &[
                &format!("--kubeconfig={kubeconfig}"),
                &format!("--controllers={controllers}"),
                &format!("--root-ca-file={}", p("ca.crt")),
                "--leader-elect=false",
                "--secure-port=0",
                "--use-service-account-credentials=false",
                "--profiling=false",
            ],
        )?;
        cluster.wait_controller_manager(&client).await?;
        cluster
            .startup
            .push(("kube-controller-manager".into(), t0.elapsed()));

        // kube-scheduler: places the chart's DaemonSet and Deployment pods on the node.
        if let Some(scheduler) = scheduler {
            let t0 = Instant::now();
            cluster.spawn(
                "kube-scheduler",
                &scheduler,
                &[
                    &format!("--kubeconfig={kubeconfig}"),
                    "--leader-elect=false",
                    "--secure-port=0",
                    "--profiling=false",
                ],
            )?;
            cluster
                .startup
                .push(("kube-scheduler".into(), t0.elapsed()));
        }
        Ok(cluster)
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// A kubeconfig with the admin credential (for csi-provisioner, kubectl, `--kubeconfig`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The temp dir holding logs (`<name>.log`), certificates and etcd's data.
    pub fn dir(&self) -> &Path {
        &self.path
    }

    /// Keeps the temp dir (logs, certificates, etcd data) after drop, for a failure's post-mortem.
    pub fn keep_dir(&mut self) -> &Path {
        if let Some(d) = self.dir.take() {
            let _ = d.keep();
        }
        &self.path
    }

    /// The cluster's CA certificate (it signs the API server's serving certificate and every
    /// client certificate).
    pub fn ca_certificate(&self) -> PathBuf {
        self.path.join("pki/ca.crt")
    }

    /// A new client certificate signed by the cluster's CA, for `subject` (an openssl `-subj`,
    /// e.g. `/O=system:nodes/CN=system:node:127.0.0.1`), as `(certificate, key)` in the pki dir.
    pub fn issue_client_certificate(
        &self,
        name: &str,
        subject: &str,
    ) -> Result<(PathBuf, PathBuf)> {
        let pki = self.path.join("pki");
        issue(&pki, name, subject, "client.ext")?;
        Ok((
            pki.join(format!("{name}.crt")),
            pki.join(format!("{name}.key")),
        ))
    }

    /// Writes a kubeconfig at `path` for this cluster with a client certificate.
    pub fn write_kubeconfig_for(
        &self,
        path: &Path,
        user: &str,
        cert: &Path,
        key: &Path,
    ) -> Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: ferry-test\nclusters:\n- name: ferry-test\n  cluster:\n    server: {}\n    certificate-authority: {}\ncontexts:\n- name: ferry-test\n  context:\n    cluster: ferry-test\n    user: {user}\nusers:\n- name: {user}\n  user:\n    client-certificate: {}\n    client-key: {}\n",
            self.server(),
            self.ca_certificate().display(),
            cert.display(),
            key.display(),
        );
        std::fs::write(path, text).map_err(|e| setup(&format!("writing {}", path.display()), e))
    }

    /// A component's log so far.
    pub fn log(&self, name: &str) -> String {
        read_log(&self.path.join(format!("{name}.log")))
    }

    /// The admin configuration: the current context of [`KubeCluster::kubeconfig`].
    pub async fn config(&self) -> Result<Config> {
        load_kubeconfig(&self.kubeconfig).await
    }

    /// An admin client.
    pub async fn client(&self) -> Result<Client> {
        Client::try_from(self.config().await?).map_err(|e| setup("building the admin client", e))
    }

    fn write_kubeconfig(&self, pki: &Path) -> Result<()> {
        use base64::Engine;
        let b64 = |f: &str| {
            std::fs::read(pki.join(f))
                .map(|b| base64::engine::general_purpose::STANDARD.encode(b))
                .map_err(|e| setup(&format!("reading pki/{f}"), e))
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: ferry-test\nclusters:\n- name: ferry-test\n  cluster:\n    server: {}\n    certificate-authority-data: {}\ncontexts:\n- name: ferry-test\n  context:\n    cluster: ferry-test\n    user: admin\n    namespace: default\nusers:\n- name: admin\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n",
            self.server(),
            b64("ca.crt")?,
            b64("admin.crt")?,
            b64("admin.key")?,
        );
        std::fs::write(&self.kubeconfig, text).map_err(|e| setup("writing the kubeconfig", e))
    }

    fn spawn(&mut self, name: &str, bin: &Path, args: &[&str]) -> Result<()> {
        let log_path = self.path.join(format!("{name}.log"));
        let log = File::create(&log_path).map_err(|e| setup(&format!("creating {name}.log"), e))?;
        let err = log
            .try_clone()
            .map_err(|e| setup(&format!("cloning {name}.log"), e))?;
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| setup(&format!("starting {}", bin.display()), e))?;
        self.children.push((name.to_string(), child));
        Ok(())
    }

    fn not_ready(&self, name: &str, reason: String) -> KubeClusterError {
        let log_path = self.path.join(format!("{name}.log"));
        let log = read_log(&log_path);
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        KubeClusterError::NotReady {
            name: name.to_string(),
            reason,
            log_path,
            log: tail,
        }
    }

    /// Fails if any component has exited.
    fn check_alive(&mut self) -> Result<()> {
        let mut dead = None;
        for (name, child) in &mut self.children {
            if let Ok(Some(status)) = child.try_wait() {
                dead = Some((name.clone(), status));
                break;
            }
        }
        match dead {
            Some((name, status)) => Err(self.not_ready(&name, format!("it exited with {status}"))),
            None => Ok(()),
        }
    }

    async fn wait_for_port(&mut self, name: &str, port: u16, timeout: Duration) -> Result<()> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.not_ready(name, format!("port {port} closed after {timeout:?}")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_ready(&mut self, client: &Client) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            self.check_alive()?;
            let readyz = http::Request::get("/readyz")
                .body(Vec::new())
                .expect("a static request");
            let last = match client.request_text(readyz).await {
                Ok(_) => return Ok(()),
                Err(e) => describe_error(&e),
            };
            if Instant::now() > deadline {
                return Err(self.not_ready(
                    "kube-apiserver",
                    format!("/readyz not ok after {READY_TIMEOUT:?}: {last}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The controller manager is working once its serviceaccount controller has made the
    /// `default` ServiceAccount in `default`.
    async fn wait_controller_manager(&mut self, client: &Client) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            self.check_alive()?;
            let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
            let last = match accounts.get_opt("default").await {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => "no default ServiceAccount yet".to_string(),
                Err(e) => describe_error(&e),
            };
            if Instant::now() > deadline {
                return Err(self.not_ready(
                    "kube-controller-manager",
                    format!("not working after {READY_TIMEOUT:?}: {last}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl Drop for KubeCluster {
    fn drop(&mut self) {
        // Reverse start order: controller manager, API server, then etcd.
        for (_, child) in self.children.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The current context of the kubeconfig at `path` (ours, or another cluster's for the e2e).
pub async fn load_kubeconfig(path: &Path) -> Result<Config> {
    let step = |what: &str| format!("{what} kubeconfig {}", path.display());
    let file = Kubeconfig::read_from(path).map_err(|e| setup(&step("reading"), e))?;
    Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .map_err(|e| setup(&step("loading"), e))
}

/// A token issued by the TokenRequest API. `Debug` does not show the token.
#[derive(Debug, Clone)]
pub struct ServiceAccountToken {
    pub token: SecretString,
    /// When the API server says it expires (it may shorten or lengthen what was asked).
    pub expiration: Time,
}

/// A TokenRequest that failed, naming the service account.
#[derive(Debug, thiserror::Error)]
#[error("TokenRequest for service account {namespace}/{service_account}: {reason}")]
pub struct TokenRequestError {
    pub namespace: String,
    pub service_account: String,
    pub reason: String,
}

/// A token for `namespace/service_account` from the TokenRequest API (the `token` subresource),
/// for `audiences`, valid for `expiration_seconds`: what kubelet hands a CSI driver for the
/// CSIDriver's `tokenRequests`.
pub async fn create_token(
    client: &Client,
    namespace: &str,
    service_account: &str,
    audiences: &[&str],
    expiration_seconds: i64,
) -> std::result::Result<ServiceAccountToken, TokenRequestError> {
    let fail = |reason: String| TokenRequestError {
        namespace: namespace.to_string(),
        service_account: service_account.to_string(),
        reason,
    };
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(audiences.iter().map(|a| a.to_string()).collect()),
            expiration_seconds: Some(expiration_seconds),
            ..Default::default()
        }),
        ..Default::default()
    };
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let answer = accounts
        .create_token_request(service_account, &PostParams::default(), &request)
        .await
        .map_err(|e| fail(describe_error(&e)))?;
    let status = answer.status.unwrap_or_default();
    let token = status
        .token
        .filter(|t| !t.is_empty())
        .ok_or_else(|| fail("the answer has no status.token".into()))?;
    let expiration = status
        .expiration_timestamp
        .ok_or_else(|| fail("the answer has no status.expirationTimestamp".into()))?;
    Ok(ServiceAccountToken {
        token: SecretString::from(token),
        expiration,
    })
}

fn tool(name: &str) -> Result<PathBuf> {
    tool_path(name).ok_or_else(|| KubeClusterError::ToolMissing { name: name.into() })
}

fn setup(step: &str, e: impl std::fmt::Display) -> KubeClusterError {
    KubeClusterError::Setup {
        step: step.to_string(),
        reason: e.to_string(),
    }
}

/// Runs `openssl` with `args` in `dir`.
fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| setup("running openssl (apt-get install openssl)", e))?;
    if !out.status.success() {
        return Err(setup(
            &format!("openssl {}", args.join(" ")),
            String::from_utf8_lossy(&out.stderr),
        ));
    }
    Ok(())
}

const EC_KEY: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:P-256",
    "-nodes",
];

/// `<name>.crt` and `<name>.key` in `dir`, for `subject`, signed by `ca.crt` with the extensions
/// of `ext` (a file in `dir`).
fn issue(dir: &Path, name: &str, subject: &str, ext: &str) -> Result<()> {
    let (key, csr, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
    );
    let mut req = vec!["req", "-new"];
    req.extend(EC_KEY);
    req.extend(["-keyout", &key, "-out", &csr, "-subj", subject]);
    openssl(dir, &req)?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "7",
            "-out",
            &crt,
            "-extfile",
            ext,
        ],
    )
}

/// A CA, the API server's serving certificate (127.0.0.1, localhost), the admin client
/// certificate (`system:masters`), and the RSA service account signing key.
fn generate_pki(dir: &Path) -> Result<()> {
    let mut ca = vec!["req", "-x509"];
    ca.extend(EC_KEY);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "7",
        "-subj",
        "/CN=ferry-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(dir, &ca)?;
    std::fs::write(
        dir.join("server.ext"),
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n",
    )
    .map_err(|e| setup("writing server.ext", e))?;
    std::fs::write(
        dir.join("client.ext"),
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
    )
    .map_err(|e| setup("writing client.ext", e))?;
    for (name, subj, ext) in [
        ("server", "/CN=kube-apiserver", "server.ext"),
        ("admin", "/O=system:masters/CN=ferry-admin", "client.ext"),
    ] {
        issue(dir, name, subj, ext)?;
    }
    openssl(
        dir,
        &[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            "sa.key",
        ],
    )?;
    openssl(dir, &["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
    Ok(())
}
