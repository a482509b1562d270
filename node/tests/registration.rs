//! The real `ferry-node serve` as kubelet meets it: the plugin registration socket in a
//! (temporary) `plugins_registry`, the `/healthz` endpoint, and the registration socket across a
//! handover and a shutdown.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferry_proto::pluginregistration::registration_client::RegistrationClient;
use ferry_proto::pluginregistration::{InfoRequest, RegistrationStatus};
use tonic::transport::{Channel, Endpoint, Uri};

const DRIVER: &str = "s3.csi.ferry.dev";
const HOST_PATH: &str = "/var/lib/kubelet/plugins/s3.csi.ferry.dev/csi.sock";
/// An upper bound for a process to start or stop on a loaded machine; never a measurement.
const PATIENCE: Duration = Duration::from_secs(60);

/// One `ferry-node serve` process with the registration socket and `/healthz` on, in `dir`.
struct Node {
    child: Child,
    health: std::net::SocketAddr,
    log: mpsc::Receiver<String>,
}

fn paths(dir: &Path) -> (PathBuf, PathBuf) {
    let registry = dir.join("plugins_registry");
    (registry.join(format!("{DRIVER}-reg.sock")), registry)
}

impl Node {
    /// Starts it and waits until it has bound its registration socket.
    fn start(dir: &Path) -> Node {
        Node::start_as(dir, None)
    }

    /// [`Node::start`] as the container of pod `pod_uid` (`POD_UID`); a pod that handed its
    /// mounts over only idles, so then it waits for that instead of the sockets.
    fn start_as(dir: &Path, pod_uid: Option<&str>) -> Node {
        let (reg_socket, registry) = paths(dir);
        std::fs::create_dir_all(&registry).unwrap();
        std::fs::create_dir_all(dir.join("kubelet")).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry-node"))
            .args(["serve", "--node-id=test-node", "--metrics-addr=off"])
            .arg(format!(
                "--csi-endpoint=unix://{}",
                dir.join("csi/csi.sock").display()
            ))
            .arg(format!("--kubelet-root={}", dir.join("kubelet").display()))
            .arg(format!("--state-dir={}", dir.join("state").display()))
            .arg(format!("--registration-dir={}", registry.display()))
            .arg(format!("--kubelet-registration-path={HOST_PATH}"))
            .arg("--health-addr=127.0.0.1:0")
            .arg("--handover-wait=0")
            // No Kubernetes API, no inherited FERRY_* settings, plain log lines.
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", dir)
            .env("NO_COLOR", "1")
            .env("FERRY_LOG", "info")
            .envs(pod_uid.map(|u| ("POD_UID", u)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting ferry-node");
        let (tx, log) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("ferry-node: {line}");
                if tx.send(line).is_err() {
                    // Still drained, so the process never blocks on a full pipe.
                    continue;
                }
            }
        });
        let deadline = Instant::now() + PATIENCE;
        let (mut health, mut serving) = (None, false);
        while health.is_none() || !serving {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match log.recv_timeout(left) {
                Ok(l) => l,
                Err(e) => panic!(
                    "ferry-node did not start serving: {e}; exit: {:?}",
                    child.try_wait()
                ),
            };
            if line.contains("health at /healthz") {
                let addr = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("addr="))
                    .expect("the health line names its address");
                health = Some(addr.parse().unwrap());
            }
            if line.contains("ferry-node serving") {
                assert!(reg_socket.exists(), "serving without a registration socket");
                serving = true;
            }
            if pod_uid.is_some() && line.contains("idle until stopped") {
                serving = true;
            }
        }
        Node {
            child,
            health: health.unwrap(),
            log,
        }
    }

    /// Waits until the log has a line containing `what`.
    fn wait_log(&self, what: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.log.recv_timeout(left) {
                Ok(l) if l.contains(what) => return l,
                Ok(_) => {}
                Err(e) => panic!("no log line with {what:?}: {e}"),
            }
        }
    }

    fn terminate(&mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
    }

    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "ferry-node did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn client(socket: &Path) -> RegistrationClient<Channel> {
    let socket = socket.to_path_buf();
    let channel = Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .expect("connecting to the registration socket");
    RegistrationClient::new(channel)
}

/// NotifyRegistrationStatus as kubelet sends it.
async fn tell(kubelet: &mut RegistrationClient<Channel>, registered: bool, error: &str) {
    kubelet
        .notify_registration_status(RegistrationStatus {
            plugin_registered: registered,
            error: error.into(),
        })
        .await
        .unwrap();
}

/// GetInfo on the registration socket answers with the driver's name.
async fn get_info(socket: &Path) {
    let info = client(socket)
        .await
        .get_info(InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, DRIVER);
}

fn fuse_usable() -> bool {
    ferry_testkit::prerequisite(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .is_ok(),
        "/dev/fuse (the node's Probe opens it: /healthz is 200 only with it)",
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn kubelet_registers_the_plugin_and_a_refusal_fails_healthz() {
    if !fuse_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path());
    let (reg_socket, _) = paths(dir.path());

    // What kubelet asks first.
    let mut kubelet = client(&reg_socket).await;
    let info = kubelet.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "CSIPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(
        info.endpoint, HOST_PATH,
        "the CSI socket as kubelet on the host sees it"
    );
    assert_eq!(info.supported_versions, vec!["1.0.0".to_string()]);

    // Healthy before kubelet's verdict and after a success.
    assert_eq!(
        ferry_testkit::healthz(node.health),
        (200, "ok\n".to_string())
    );
    tell(&mut kubelet, true, "").await;
    assert_eq!(
        ferry_testkit::healthz(node.health),
        (200, "ok\n".to_string())
    );

    // A refusal: logged at error with kubelet's words, and /healthz says why it fails.
    tell(
        &mut kubelet,
        false,
        "driver name s3.csi.ferry.dev already registered by another plugin",
    )
    .await;
    let line = node.wait_log("kubelet refused the plugin registration");
    assert!(line.contains("ERROR"), "{line}");
    assert!(
        line.contains("already registered by another plugin"),
        "{line}"
    );
    let (code, body) = ferry_testkit::healthz(node.health);
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("already registered by another plugin"),
        "{body}"
    );

    // Kubelet registers it again (a later retry): healthy again.
    tell(&mut kubelet, true, "").await;
    assert_eq!(
        ferry_testkit::healthz(node.health),
        (200, "ok\n".to_string())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_successor_registers_anew_and_a_stopping_owner_leaves_anothers_socket() {
    if !fuse_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (reg_socket, _) = paths(dir.path());

    // A stale socket at the path (a crashed process's, nobody listening): replaced at start.
    std::fs::create_dir_all(reg_socket.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&reg_socket).unwrap());
    let mut old = Node::start(dir.path());
    get_info(&reg_socket).await;

    // A successor takes the node over (handover): the old process exits, and the socket kubelet
    // reaches now is the successor's (the old one's listener is gone with it), a new one that
    // kubelet registers again.
    let mut new = Node::start(dir.path());
    assert!(old.wait_exit().success());
    get_info(&reg_socket).await;

    // Someone else binds the path while it runs: the owner's /healthz says its socket is gone, and
    // its shutdown leaves the other socket alone.
    std::fs::remove_file(&reg_socket).unwrap();
    let other = std::os::unix::net::UnixListener::bind(&reg_socket).unwrap();
    let (code, body) = ferry_testkit::healthz(new.health);
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("gone or another process's"), "{body}");
    new.terminate();
    new.wait_log("registration socket is another process's now; left alone");
    assert!(new.wait_exit().success());
    // Still the other's: a connection to the path reaches its listener.
    let _client = std::os::unix::net::UnixStream::connect(&reg_socket)
        .expect("the stopping owner removed another's socket");
    other.set_nonblocking(true).unwrap();
    other
        .accept()
        .expect("the path is no longer the other's socket");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopping_owner_removes_its_own_socket() {
    let dir = tempfile::tempdir().unwrap();
    let (reg_socket, _) = paths(dir.path());
    let mut node = Node::start(dir.path());
    node.terminate();
    node.wait_log("registration socket removed");
    assert!(node.wait_exit().success());
    assert!(!reg_socket.exists());
}

/// The first upgrade from a chart that ran node-driver-registrar: the old pod's registrar removes
/// the registration socket the new ferry-node bound. It is bound again, and answers kubelet.
#[tokio::test(flavor = "multi_thread")]
async fn a_socket_removed_by_another_process_is_bound_again() {
    let dir = tempfile::tempdir().unwrap();
    let (reg_socket, _) = paths(dir.path());
    let mut node = Node::start(dir.path());
    std::fs::remove_file(&reg_socket).unwrap();
    node.wait_log("binding it again");
    let deadline = Instant::now() + PATIENCE;
    while !reg_socket.exists() {
        assert!(Instant::now() < deadline, "the socket was not bound again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    get_info(&reg_socket).await;
    node.terminate();
    node.wait_log("registration socket removed");
    assert!(node.wait_exit().success());
    assert!(
        !reg_socket.exists(),
        "the socket bound again was left behind"
    );
}

/// A node pod that handed its mounts to a newer one idles until deleted; its /healthz answers 200
/// meanwhile, so kubelet does not restart it over and over.
#[tokio::test(flavor = "multi_thread")]
async fn a_retired_pod_is_healthy_while_it_idles() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("state")).unwrap();
    std::fs::write(dir.path().join("state/retired-old-pod"), b"").unwrap();
    let (reg_socket, _) = paths(dir.path());
    let mut node = Node::start_as(dir.path(), Some("old-pod"));
    let (code, body) = ferry_testkit::healthz(node.health);
    assert_eq!((code, body.trim()), (200, "ok"));
    assert!(!reg_socket.exists(), "a retired pod registered the plugin");
    node.terminate();
    assert!(node.wait_exit().success());
}
