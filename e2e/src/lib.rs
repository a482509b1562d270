//! End-to-end harness: runs the real `ferry-controller` and `ferry-node` binaries against a real S3
//! server (versitygw on loopback) and talks CSI to them over their unix sockets, as kubelet and
//! csi-provisioner would. [`kube`] is the Kubernetes-level e2e on a real API server; [`image`] builds
//! its container images without a Docker daemon.

pub mod image;
pub mod kube;
pub mod metrics_check;
pub mod node;
pub mod realnode;
pub mod takeover;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_proto::csi::v1 as pb;
use ferry_testkit::S3Server;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

pub use pb::controller_client::ControllerClient;
pub use pb::identity_client::IdentityClient;
pub use pb::node_client::NodeClient;

/// Connects a gRPC channel to a unix socket.
pub async fn unix_channel(path: &Path) -> Result<Channel> {
    let path = path.to_path_buf();
    Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .with_context(|| "connecting to the CSI socket")
}

/// The directory holding this executable's sibling binaries (`target/debug` or `target/release`).
pub fn bin_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe
        .parent()
        .context("executable has no directory")?
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    Ok(dir)
}

/// A running plugin: S3 server, controller and node processes, and a scratch kubelet root.
pub struct Plugin {
    pub s3: S3Server,
    pub dir: tempfile::TempDir,
    pub controller_socket: PathBuf,
    pub node_socket: PathBuf,
    children: Vec<(String, Child)>,
    bins: PathBuf,
    /// Environment changes applied after the defaults: `None` removes a variable.
    env: Vec<(String, Option<String>)>,
}

impl Plugin {
    /// Starts versitygw, then `ferry-controller` and `ferry-node` from `bins`, configured to use
    /// that server by default with its root credentials and to allow no other endpoint, and waits
    /// until both answer Probe.
    pub async fn start(bins: &Path) -> Result<Self> {
        Self::start_full(bins, &[], Vec::new()).await
    }

    /// Like [`Plugin::start`], with the processes' environment changed after the defaults
    /// (`None` removes a variable): another S3 endpoint, other driver credentials, a log level.
    pub async fn start_with_env(bins: &Path, env: Vec<(String, Option<String>)>) -> Result<Self> {
        Self::start_full(bins, &[], env).await
    }

    /// [`Plugin::start`] with extra `ferry-controller` arguments (e.g. `--kubeconfig`).
    pub async fn start_with(bins: &Path, controller_args: &[&str]) -> Result<Self> {
        Self::start_full(bins, controller_args, Vec::new()).await
    }

    /// [`Plugin::start`] with extra `ferry-controller` arguments and environment changes.
    pub async fn start_full(
        bins: &Path,
        controller_args: &[&str],
        env: Vec<(String, Option<String>)>,
    ) -> Result<Self> {
        let s3 = S3Server::start();
        let dir = tempfile::Builder::new().prefix("ferry-e2e-").tempdir()?;
        std::fs::create_dir_all(dir.path().join("kubelet/pods"))?;
        let mut plugin = Plugin {
            controller_socket: dir.path().join("controller/csi.sock"),
            node_socket: dir.path().join("node/csi.sock"),
            s3,
            dir,
            children: Vec::new(),
            bins: bins.to_path_buf(),
            env,
        };
        let endpoint = format!("unix://{}", plugin.controller_socket.display());
        let mut args = vec!["--csi-endpoint", &endpoint, "--metrics-addr", "127.0.0.1:0"];
        args.extend_from_slice(controller_args);
        let ctrl = plugin.spawn(bins, "ferry-controller", &args)?;
        plugin.children.push(("ferry-controller".into(), ctrl));
        plugin.start_node()?;
        for socket in [plugin.controller_socket.clone(), plugin.node_socket.clone()] {
            plugin.wait_ready(&socket).await?;
        }
        Ok(plugin)
    }

    /// Starts a `ferry-node serve` process (the log is appended to across restarts).
    pub fn start_node(&mut self) -> Result<()> {
        self.start_node_with(&[], &[])
    }

    /// [`Plugin::start_node`] with extra arguments and environment variables.
    pub fn start_node_with(&mut self, extra: &[&str], env: &[(&str, &str)]) -> Result<()> {
        let kubelet = self.kubelet_root();
        let (socket, kubelet) = (
            format!("unix://{}", self.node_socket.display()),
            kubelet.display().to_string(),
        );
        let mut args = vec![
            "serve",
            "--csi-endpoint",
            &socket,
            "--node-id",
            "e2e-node",
            "--kubelet-root",
            &kubelet,
            "--metrics-addr",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        let saved = self.env.len();
        self.env.extend(
            env.iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string()))),
        );
        let node = self.spawn(&self.bins.clone(), "ferry-node", &args);
        self.env.truncate(saved);
        self.children.push(("ferry-node".into(), node?));
        Ok(())
    }

    /// Whether the oldest `name` process is still running.
    pub fn running(&mut self, name: &str) -> Result<bool> {
        match self.children.iter_mut().find(|(n, _)| n == name) {
            Some((_, c)) => Ok(c.try_wait()?.is_none()),
            None => Ok(false),
        }
    }

    /// The pid of the newest process started as `name` (for RSS, fd and thread counts); it may
    /// have exited since.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.children
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.id())
    }

    /// Sets an environment variable for every process started from now on.
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.push((key.to_string(), Some(value.to_string())));
    }

    /// Starts `ferry-fd-holder` and makes every node plugin started from now on deposit its
    /// mounts there (`FERRY_HOLDER_SOCKET`).
    /// Each call starts another holder (as each node plugin pod has its own), used by the node
    /// plugins started after it.
    pub fn start_holder(&mut self) -> Result<PathBuf> {
        let socket = (0..)
            .map(|i| self.dir.path().join(format!("holder-{i}.sock")))
            .find(|p| !p.exists())
            .expect("a free name");
        let holder = self.spawn(
            &self.bins.clone(),
            "ferry-fd-holder",
            &["--socket", &socket.display().to_string()],
        )?;
        self.children.push(("ferry-fd-holder".into(), holder));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            if Instant::now() > deadline {
                bail!("ferry-fd-holder did not create {}", socket.display());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.env.push((
            "FERRY_HOLDER_SOCKET".into(),
            Some(socket.display().to_string()),
        ));
        Ok(socket)
    }

    /// Waits until the node plugin answers Probe (after [`Plugin::start_node`]).
    pub async fn wait_node(&mut self) -> Result<()> {
        let socket = self.node_socket.clone();
        self.wait_ready(&socket).await
    }

    /// Waits (at most `timeout`) for the oldest running `name` process to exit by itself, and
    /// forgets it.
    pub fn wait_exit(&mut self, name: &str, timeout: Duration) -> Result<std::process::ExitStatus> {
        let i = self.children.iter().position(|(n, _)| n == name);
        self.wait_exit_of(i, name, timeout)
    }

    /// [`Plugin::wait_exit`] for the newest `name` process.
    pub fn wait_exit_newest(
        &mut self,
        name: &str,
        timeout: Duration,
    ) -> Result<std::process::ExitStatus> {
        let i = self.children.iter().rposition(|(n, _)| n == name);
        self.wait_exit_of(i, name, timeout)
    }

    fn wait_exit_of(
        &mut self,
        i: Option<usize>,
        name: &str,
        timeout: Duration,
    ) -> Result<std::process::ExitStatus> {
        let i = i.with_context(|| format!("{name} is not running"))?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.children[i].1.try_wait()? {
                self.children.remove(i);
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!(
                    "{name} (pid {}) did not exit within {timeout:?}",
                    self.children[i].1.id()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `signal` to the oldest running `name` process and waits for it to exit.
    pub fn signal_process(&mut self, name: &str, signal: i32) -> Result<std::process::ExitStatus> {
        let i = self
            .children
            .iter()
            .position(|(n, _)| n == name)
            .with_context(|| format!("{name} is not running"))?;
        let (_, mut child) = self.children.remove(i);
        kill(&child, signal);
        Ok(child.wait()?)
    }

    /// Sends `signal` to the oldest running `name` process and returns at once.
    pub fn send_signal(&mut self, name: &str, signal: i32) -> Result<()> {
        let (_, child) = self
            .children
            .iter()
            .find(|(n, _)| n == name)
            .with_context(|| format!("{name} is not running"))?;
        kill(child, signal);
        Ok(())
    }

    /// Waits (at most `timeout`) until `name`'s log holds `line` past its first `from` bytes.
    pub fn wait_log(&self, name: &str, from: u64, line: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = std::fs::read(self.log_path(name)).unwrap_or_default();
            let tail = log.get(from as usize..).unwrap_or_default();
            if String::from_utf8_lossy(tail).contains(line) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{name}'s log has no {line:?} after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// How long `name`'s log is now (for [`Plugin::wait_log`]).
    pub fn log_len(&self, name: &str) -> u64 {
        std::fs::metadata(self.log_path(name)).map_or(0, |m| m.len())
    }

    /// Sends SIGTERM to one process and waits for it to exit.
    pub fn stop_process(&mut self, name: &str) -> Result<std::process::ExitStatus> {
        self.signal_process(name, libc::SIGTERM)
    }

    fn spawn(&self, bins: &Path, name: &str, args: &[&str]) -> Result<Child> {
        let exe = bins.join(name);
        if !exe.exists() {
            bail!(
                "{} not found: build it first (cargo build -p {name})",
                exe.display()
            );
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(name))?;
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", std::env::var_os("HOME").unwrap_or_default())
            .env(
                "FERRY_LOG",
                std::env::var("FERRY_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("AWS_ACCESS_KEY_ID", self.s3.access_key())
            .env("AWS_SECRET_ACCESS_KEY", self.s3.secret_key())
            .env("AWS_REGION", "us-east-1")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("FERRY_ENDPOINT_URL", self.s3.endpoint_url())
            // Only the local server: a volume naming any other endpoint (AWS's too) is refused.
            .env("FERRY_ALLOWED_ENDPOINTS", self.s3.endpoint_url())
            .env("FERRY_FORCE_PATH_STYLE", "true");
        for (k, v) in &self.env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))
    }

    /// Where a process's log goes.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// Fails if a secret (the S3 secret key, or any of `extra`) appears in a process's log.
    pub fn check_logs_for_secrets(&self, extra: &[&str]) -> Result<()> {
        for name in ["ferry-controller", "ferry-node"] {
            let log = std::fs::read_to_string(self.log_path(name)).unwrap_or_default();
            for secret in std::iter::once(self.s3.secret_key()).chain(extra.iter().copied()) {
                if !secret.is_empty() && log.contains(secret) {
                    bail!("{name}'s log contains a secret");
                }
            }
        }
        Ok(())
    }

    /// The kubelet root the node plugin accepts targets under.
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.path().join("kubelet")
    }

    /// A kubelet-style target path for a pod and a PV (its parent is created, as kubelet does).
    pub fn target_path(&self, pod_uid: &str, pv: &str) -> Result<PathBuf> {
        let parent = self
            .kubelet_root()
            .join("pods")
            .join(pod_uid)
            .join("volumes/kubernetes.io~csi")
            .join(pv);
        std::fs::create_dir_all(&parent)?;
        Ok(parent.join("mount"))
    }

    async fn wait_ready(&mut self, socket: &Path) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            for (name, child) in &mut self.children {
                if let Some(status) = child.try_wait()? {
                    let log = std::fs::read_to_string(self.dir.path().join(format!("{name}.log")))
                        .unwrap_or_default();
                    bail!("{name} exited with {status} during start-up:\n{log}");
                }
            }
            if socket.exists() && probe_ready(socket).await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} did not become ready within 60 s", socket.display());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn controller(&self) -> Result<ControllerClient<Channel>> {
        Ok(ControllerClient::new(
            unix_channel(&self.controller_socket).await?,
        ))
    }

    pub async fn node(&self) -> Result<NodeClient<Channel>> {
        Ok(NodeClient::new(unix_channel(&self.node_socket).await?))
    }

    /// Sends SIGTERM to both processes and waits for them.
    pub fn stop(&mut self) {
        for (_, child) in &mut self.children {
            kill(child, libc::SIGTERM);
        }
        for (_, child) in &mut self.children {
            let _ = child.wait();
        }
        self.children.clear();
        // ferry-node leaves its mounts when it stops (a successor may take them over): those a
        // step left under this plugin's directory are detached, so no dead FUSE mount outlives
        // the harness.
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut ours: Vec<String> = ferry_fs::mountinfo::parse(&text)
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|m| Path::new(m).starts_with(self.dir.path()))
            .collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in ours {
            let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether the CSI plugin at `socket` answers Probe with ready (or without a readiness).
pub async fn probe_ready(socket: &Path) -> bool {
    let Ok(ch) = unix_channel(socket).await else {
        return false;
    };
    IdentityClient::new(ch)
        .probe(pb::ProbeRequest {})
        .await
        .is_ok_and(|r| r.into_inner().ready.unwrap_or(true))
}

/// A deterministic pseudo-random payload.
pub fn payload(seed: u64, len: usize) -> bytes::Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    bytes::Bytes::from(v)
}

/// A mount capability with the given access mode and mount flags.
pub fn mount_capability(
    mode: pb::volume_capability::access_mode::Mode,
    flags: &[&str],
) -> pb::VolumeCapability {
    pb::VolumeCapability {
        access_type: Some(pb::volume_capability::AccessType::Mount(
            pb::volume_capability::MountVolume {
                fs_type: String::new(),
                mount_flags: flags.iter().map(|s| s.to_string()).collect(),
                volume_mount_group: String::new(),
            },
        )),
        access_mode: Some(pb::volume_capability::AccessMode { mode: mode as i32 }),
    }
}

/// Sends `signal` to a child process of ours.
fn kill(child: &Child, signal: i32) {
    // SAFETY: kill(2) on a child pid we own; at worst it fails with ESRCH.
    unsafe {
        libc::kill(child.id() as libc::pid_t, signal);
    }
}
