//! [`KubeNode`]: a real node for a [`KubeCluster`] on this machine — containerd (Debian's 1.6,
//! with runc and the CNI `loopback` plugin) and kubelet, every socket and port on loopback, the
//! node named `127.0.0.1` (its InternalIP), so pods really run and CSI drivers really mount.
//!
//! Start it in two steps: [`KubeNode::start_containerd`] (then import images, see
//! [`crate::image::import`]: nothing can be pulled here, and the sandbox image must be present before the
//! first pod), then [`KubeNode::start_kubelet`].
//!
//! kubelet changes the host; [`KubeNode`] undoes it on drop, failed test or not:
//! - sysctls it sets at every start ([`KUBELET_SYSCTLS`]) are restored to what they were;
//! - its pods' containers are killed and removed, containerd and its shims stopped;
//! - every mount below the node's directory (kubelet's shared bind mount of its root dir, pods'
//!   secret and token tmpfs, CSI drivers' mounts) is unmounted (pods run on the host network:
//!   containerd makes no network namespace);
//! - the cgroups it made are removed: pods go below a cgroup root of our own
//!   (`/ferry-node-<pid>` in every hierarchy), created before and removed after;
//! - host directories it creates whatever its flags say (`/var/lib/kubelet/device-plugins`,
//!   `/var/log/containers`, ...) are removed when they did not exist before and hold no mount;
//! - it refuses to start on a machine where a kubelet runs (kubelet writes
//!   `/var/lib/kubelet/device-plugins` whatever its `--root-dir`).
//!
//! kubelet runs with a `PATH` without `/usr/sbin` and `/sbin`, so it finds no `iptables` and
//! leaves the host's rules alone.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};

use anyhow::{anyhow, Result};
use ferry_testkit::kube::{tool_path, KubeCluster, READY_TIMEOUT};

/// The node's name, and its address: kubelet must not resolve a host name (that would send a DNS
/// query off the machine), and `--node-ip` refuses loopback.
pub const NODE_NAME: &str = "127.0.0.1";

/// Sysctls kubelet sets at every start (`setupKernelTunables`); saved before and restored after.
pub const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Host paths kubelet or containerd create whatever they are told; removed at the end when they
/// were not there before and hold no mount. (`/run/containerd` only without a containerd socket
/// in it: a system containerd started meanwhile keeps its directory.)
const HOST_PATHS: &[&str] = &[
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/run/containerd",
];

/// How to start the node.
#[derive(Debug, Clone)]
pub struct KubeNodeOptions {
    /// containerd's `sandbox_image` (must be imported before the first pod).
    pub sandbox_image: String,
    /// Where the node's directory is made (default `$FERRY_TEST_TMPDIR`, else the temp dir).
    pub base_dir: Option<PathBuf>,
}

/// containerd + kubelet on loopback; everything undone on drop.
pub struct KubeNode {
    path: PathBuf,
    dir: Option<tempfile::TempDir>,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    kubelet_args: Vec<String>,
    sysctls: Vec<(String, String)>,
    host_paths_before: BTreeSet<String>,
    cgroup_root: String,
    /// kubelet's port, for its API (logs, exec through the API server).
    pub kubelet_port: u16,
    /// How long containerd and kubelet took to come up.
    pub startup: Vec<(String, Duration)>,
}

impl std::fmt::Debug for KubeNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeNode")
            .field("dir", &self.path)
            .finish_non_exhaustive()
    }
}

impl KubeNode {
    /// Starts containerd with a configuration of our own (its root, state and socket under a new
    /// directory; CRI on, no TCP service, the stream server on 127.0.0.1, runc without systemd,
    /// `restrict_oom_score_adj` since root here cannot lower `oom_score_adj`, the CNI `loopback`
    /// plugin only) and waits for its socket.
    pub async fn start_containerd(options: &KubeNodeOptions) -> Result<KubeNode> {
        let containerd = which("containerd")?;
        which("runc")?;
        // kubelet writes /var/lib/kubelet/device-plugins whatever its --root-dir: on a machine
        // that is already a Kubernetes node it would disturb the real kubelet.
        if let Some(pid) = running("kubelet") {
            return Err(setup(
                "checking the host",
                format!("a kubelet is already running here (pid {pid}): run the real-node e2e on a machine that is not a Kubernetes node"),
            ));
        }
        if Path::new("/var/lib/kubelet/device-plugins/kubelet.sock").exists() {
            return Err(setup(
                "checking the host",
                "/var/lib/kubelet/device-plugins/kubelet.sock exists: this machine is (or was) a Kubernetes node; run the real-node e2e elsewhere",
            ));
        }
        if !Path::new(CNI_BIN_DIR).join("loopback").exists() {
            return Err(setup(
                "finding the CNI loopback plugin",
                format!("{CNI_BIN_DIR}/loopback is missing: apt-get install containernetworking-plugins"),
            ));
        }
        let base = options
            .base_dir
            .clone()
            .or_else(|| std::env::var_os("FERRY_TEST_TMPDIR").map(PathBuf::from))
            .unwrap_or_else(std::env::temp_dir);
        let dir = tempfile::Builder::new()
            .prefix("ferry-node-")
            .tempdir_in(&base)
            .map_err(|e| setup("creating the node's directory", e))?;
        let path = dir.path().to_path_buf();
        let mut node = KubeNode {
            path: path.clone(),
            dir: Some(dir),
            containerd: None,
            kubelet: None,
            kubelet_args: Vec::new(),
            sysctls: Vec::new(),
            host_paths_before: HOST_PATHS
                .iter()
                .filter(|p| Path::new(p).exists())
                .map(|p| p.to_string())
                .collect(),
            cgroup_root: format!("/ferry-node-{}", std::process::id()),
            kubelet_port: 0,
            startup: Vec::new(),
        };
        for d in [
            "containerd/root",
            "containerd/state",
            "cni/net.d",
            "kubelet",
            "pod-logs",
        ] {
            std::fs::create_dir_all(path.join(d))
                .map_err(|e| setup(&format!("creating {d}"), e))?;
        }
        std::fs::write(
            path.join("cni/net.d/10-loopback.conflist"),
            r#"{"cniVersion": "0.4.0", "name": "ferry-loopback", "plugins": [{"type": "loopback"}]}"#,
        )
        .map_err(|e| setup("writing the CNI configuration", e))?;
        let config = path.join("containerd/config.toml");
        std::fs::write(&config, containerd_config(&path, &options.sandbox_image))
            .map_err(|e| setup("writing containerd's configuration", e))?;

        let t0 = Instant::now();
        let child = spawn_logged(
            &path.join("containerd.log"),
            Command::new(containerd).arg("--config").arg(&config),
        )?;
        node.containerd = Some(child);
        let sock = node.containerd_address();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            node.check_alive("containerd")?;
            if sock.exists() && node.ctr(&["version"]).is_ok_and(|o| o.status.success()) {
                break;
            }
            if Instant::now() > deadline {
                return Err(node.not_ready("containerd", "its socket does not answer".into()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        node.startup.push(("containerd".into(), t0.elapsed()));
        Ok(node)
    }

    /// containerd's socket.
    pub fn containerd_address(&self) -> PathBuf {
        self.path.join("containerd/containerd.sock")
    }

    /// kubelet's `--root-dir` (the chart's `node.kubeletDir`).
    pub fn kubelet_dir(&self) -> PathBuf {
        self.path.join("kubelet")
    }

    /// The node's directory (logs: `containerd.log`, `kubelet.log`; pods' logs in `pod-logs`).
    pub fn dir(&self) -> &Path {
        &self.path
    }

    /// Keeps the node's directory after drop (everything else is still undone).
    pub fn keep_dir(&mut self) -> &Path {
        if let Some(d) = self.dir.take() {
            let _ = d.keep();
        }
        &self.path
    }

    /// A component's log so far (`containerd`, `kubelet`).
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.path.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Runs `ctr --address <ours> -n k8s.io ARGS`.
    pub fn ctr(&self, args: &[&str]) -> Result<Output> {
        Command::new("ctr")
            .arg("--address")
            .arg(self.containerd_address())
            .args(["-n", "k8s.io"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| setup("running ctr", e))
    }

    /// Writes kubelet's configuration and credentials for `cluster`, starts kubelet and waits
    /// until the API server lists the node `127.0.0.1` as Ready.
    pub async fn start_kubelet(&mut self, cluster: &KubeCluster, client: &Client) -> Result<()> {
        kubelet_bin()?;
        let t0 = Instant::now();
        let (cert, key) = cluster.issue_client_certificate(
            "node",
            &format!("/O=system:nodes/CN=system:node:{NODE_NAME}"),
        )?;
        let kubeconfig = self.path.join("kubelet.kubeconfig");
        cluster.write_kubeconfig_for(&kubeconfig, "node", &cert, &key)?;
        self.kubelet_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let config = self.path.join("kubelet.yaml");
        std::fs::write(
            &config,
            kubelet_config(
                &self.path,
                self.kubelet_port,
                &cluster.ca_certificate(),
                &self.cgroup_root,
            ),
        )
        .map_err(|e| setup("writing kubelet's configuration", e))?;
        self.make_cgroup_root()?;
        self.sysctls = KUBELET_SYSCTLS
            .iter()
            .filter_map(|k| {
                std::fs::read_to_string(Path::new("/proc/sys").join(k))
                    .ok()
                    .map(|v| (k.to_string(), v.trim().to_string()))
            })
            .collect();
        self.kubelet_args = vec![
            format!("--config={}", config.display()),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--root-dir={}", self.kubelet_dir().display()),
            format!("--cert-dir={}", self.path.join("kubelet-pki").display()),
            format!("--hostname-override={NODE_NAME}"),
            "--v=2".into(),
        ];
        self.spawn_kubelet()?;
        self.wait_node_ready(client).await?;
        self.startup.push(("kubelet".into(), t0.elapsed()));
        Ok(())
    }

    /// Kills kubelet (SIGKILL, as a crash or a node agent upgrade would) and starts it again with
    /// the same configuration; pods and their mounts stay. Waits until the node is Ready again.
    pub async fn restart_kubelet(&mut self, client: &Client) -> Result<()> {
        if let Some(mut k) = self.kubelet.take() {
            let _ = k.kill();
            let _ = k.wait();
        }
        self.spawn_kubelet()?;
        self.wait_node_ready(client).await
    }

    fn spawn_kubelet(&mut self) -> Result<()> {
        let child = spawn_logged(
            &self.path.join("kubelet.log"),
            Command::new(kubelet_bin()?)
                .args(&self.kubelet_args)
                // No /usr/sbin, /sbin: kubelet finds no iptables and leaves the host's rules alone.
                .env("PATH", "/usr/local/bin:/usr/bin:/bin"),
        )?;
        self.kubelet = Some(child);
        Ok(())
    }

    async fn wait_node_ready(&mut self, client: &Client) -> Result<()> {
        let nodes: Api<Node> = Api::all(client.clone());
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            self.check_alive("kubelet")?;
            let last = match nodes.get_opt(NODE_NAME).await {
                Ok(Some(n)) => {
                    let ready = n
                        .status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .into_iter()
                        .find(|c| c.type_ == "Ready");
                    match ready {
                        Some(c) if c.status == "True" => return Ok(()),
                        Some(c) => {
                            format!("Ready={} ({})", c.status, c.message.unwrap_or_default())
                        }
                        None => "no Ready condition yet".into(),
                    }
                }
                Ok(None) => "node not registered yet".into(),
                Err(e) => ferry_testkit::apply::describe_error(&e),
            };
            if Instant::now() > deadline {
                return Err(self.not_ready(
                    "kubelet",
                    format!("node {NODE_NAME} not Ready after {READY_TIMEOUT:?}: {last}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn check_alive(&mut self, name: &str) -> Result<()> {
        let child = match name {
            "kubelet" => self.kubelet.as_mut(),
            _ => self.containerd.as_mut(),
        };
        if let Some(c) = child {
            if let Ok(Some(status)) = c.try_wait() {
                return Err(self.not_ready(name, format!("it exited with {status}")));
            }
        }
        Ok(())
    }

    fn not_ready(&self, name: &str, reason: String) -> anyhow::Error {
        let log_path = self.path.join(format!("{name}.log"));
        let log = self.log(name);
        let lines: Vec<&str> = log.lines().collect();
        anyhow!(
            "{name} did not become ready: {reason}\n--- last lines of its log ({}) ---\n{}",
            log_path.display(),
            lines[lines.len().saturating_sub(40)..].join("\n")
        )
    }

    fn cgroup_hierarchies() -> Vec<PathBuf> {
        std::fs::read_dir("/sys/fs/cgroup")
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.join("cgroup.procs").exists())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// kubelet refuses a cgroup root that does not exist in every hierarchy.
    fn make_cgroup_root(&self) -> Result<()> {
        for h in Self::cgroup_hierarchies() {
            let dir = h.join(self.cgroup_root.trim_start_matches('/'));
            std::fs::create_dir_all(&dir)
                .map_err(|e| setup(&format!("creating cgroup {}", dir.display()), e))?;
            // cpuset: a child has no CPUs or memory nodes until given its parent's.
            for f in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = std::fs::read_to_string(h.join(f)) {
                    let _ = std::fs::write(dir.join(f), v.trim());
                }
            }
        }
        Ok(())
    }

    /// Undoes everything; called by drop.
    fn clean_up(&mut self) {
        if let Some(mut k) = self.kubelet.take() {
            let _ = k.kill();
            let _ = k.wait();
        }
        if self.containerd.is_some() {
            // Every container and sandbox: kill the task, delete it and the container.
            let ids = self
                .ctr(&["containers", "list", "-q"])
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            for id in ids.lines().filter(|l| !l.is_empty()) {
                let _ = self.ctr(&["tasks", "kill", "-a", "-s", "SIGKILL", id]);
            }
            for id in ids.lines().filter(|l| !l.is_empty()) {
                for _ in 0..50 {
                    let out = self.ctr(&["tasks", "delete", "-f", id]);
                    let gone = out
                        .map(|o| {
                            o.status.success()
                                || String::from_utf8_lossy(&o.stderr).contains("not found")
                        })
                        .unwrap_or(true);
                    if gone {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                let _ = self.ctr(&["containers", "delete", id]);
            }
        }
        if let Some(mut c) = self.containerd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        kill_shims(&self.containerd_address());
        // Mounts below our directory, deepest first (FUSE mounts of a gone driver included).
        let mut ours: Vec<String> = mount_points()
            .into_iter()
            .filter(|m| Path::new(m).starts_with(&self.path))
            .collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in &ours {
            let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
        for h in Self::cgroup_hierarchies() {
            remove_cgroup_tree(&h.join(self.cgroup_root.trim_start_matches('/')));
        }
        for (k, v) in &self.sysctls {
            let _ = std::fs::write(Path::new("/proc/sys").join(k), v);
        }
        let mounts = mount_points();
        for p in HOST_PATHS {
            let holds_mount = mounts.iter().any(|m| Path::new(m).starts_with(p));
            let foreign = *p == "/run/containerd" && Path::new(p).join("containerd.sock").exists();
            if !self.host_paths_before.contains(*p)
                && Path::new(p).exists()
                && !holds_mount
                && !foreign
            {
                let _ = std::fs::remove_dir_all(p);
            }
        }
    }
}

impl Drop for KubeNode {
    fn drop(&mut self) {
        self.clean_up();
    }
}

const CNI_BIN_DIR: &str = "/usr/lib/cni";

fn containerd_config(dir: &Path, sandbox_image: &str) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
[grpc]
  address = "{d}/containerd/containerd.sock"
[ttrpc]
  address = "{d}/containerd/containerd.sock.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{d}/cni/net.d"
"#
    )
}

fn kubelet_config(dir: &Path, port: u16, ca: &Path, cgroup_root: &str) -> String {
    let d = dir.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 0
containerRuntimeEndpoint: unix://{d}/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
failCgroupV1: false
failSwapOn: false
podLogsDir: {d}/pod-logs
volumePluginDir: {d}/volume-plugins
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: {ca}
authorization:
  mode: AlwaysAllow
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerNode: true
syncFrequency: 5s
fileCheckFrequency: 5s
"#,
        ca = ca.display()
    )
}

fn kubelet_bin() -> Result<PathBuf> {
    tool_path("kubelet").ok_or_else(|| {
        anyhow!(
            "kubelet was not found: {}",
            ferry_testkit::kube::KUBE_TOOLS_HINT
        )
    })
}

fn which(name: &str) -> Result<PathBuf> {
    ["/usr/local/bin", "/usr/bin", "/usr/sbin", "/bin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
        .ok_or_else(|| {
            setup(
                &format!("finding {name}"),
                "not installed: apt-get install containerd runc containernetworking-plugins (scripts/setup.sh does)",
            )
        })
}

/// Spawns `cmd` with stdout and stderr appended to `log` (a restarted kubelet continues its log).
fn spawn_logged(log: &Path, cmd: &mut Command) -> Result<Child> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| setup(&format!("opening {}", log.display()), e))?;
    let err = f.try_clone().map_err(|e| setup("cloning a log file", e))?;
    cmd.stdin(Stdio::null())
        .stdout(f)
        .stderr(err)
        .spawn()
        .map_err(|e| setup("starting a node component", e))
}

fn setup(step: &str, e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("{step}: {e}")
}

/// Mount points, from /proc/self/mountinfo.
fn mount_points() -> Vec<String> {
    ferry_fs::mountinfo::parse(&std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default())
        .into_iter()
        .map(|m| m.mount_point)
        .collect()
}

/// The pid of a process whose command name is `name`, if one runs.
fn running(name: &str) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|p| {
        let pid = p.file_name().to_string_lossy().parse::<i32>().ok()?;
        let comm = std::fs::read_to_string(p.path().join("comm")).ok()?;
        (comm.trim() == name).then_some(pid)
    })
}

/// containerd 1.6 puts shim sockets under /run/containerd whatever its state dir; a shim of ours
/// names our containerd's address on its command line.
fn kill_shims(address: &Path) {
    let address = address.display().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for p in procs.flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains("containerd-shim") && cmdline.contains(&address) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Removes a cgroup and its children, deepest first; processes still inside are killed first.
fn remove_cgroup_tree(dir: &Path) {
    if !dir.exists() {
        return;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    for _ in 0..50 {
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
