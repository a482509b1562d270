//! Test helpers shared by the workspace's integration tests: [`S3Server`] runs a real S3 server
//! (versitygw) on loopback for the duration of a test, [`FaultProxy`] breaks chosen responses on
//! the way to it, [`kube::KubeCluster`] runs a real Kubernetes control plane ([`apply`] applies
//! manifests to it), [`MotoServer`] moto
//! (S3 that enforces signatures and IAM policies, STS, IAM) and [`PodIdentityAgent`] an EKS Pod
//! Identity agent stand-in for the credentials tests, and [`init_tracing`] sets up logging.
//!
//! versitygw is found through `$FERRY_VERSITYGW`, then `$HOME/.cache/ferry-tools/bin/versitygw`,
//! then `PATH`. Without it, [`S3Server::start`] panics with install instructions: tests that need
//! a real S3 fail, they never skip silently.
//!
//! Things to know about versitygw (v1.7.0, `posix` backend) as a stand-in for S3:
//! - Objects are files under `<root>/<bucket>/`; object metadata (ETag, content type, ...) lives in
//!   `user.*` extended attributes. Where the temp dir's filesystem refuses user xattrs (tmpfs on
//!   old kernels, some overlayfs), we pass `--sidecar <dir>` so metadata goes to a side directory.
//! - Without `--keep-alive` it answers every request with `Connection: close`, unlike S3; we pass
//!   `--keep-alive` so connection reuse is exercised as in production.
//! - A bucket is a directory, so a key and a "directory" prefix cannot both exist as in S3
//!   (`a` as an object and `a/b` as another is impossible on posix): tests must not rely on that.

use std::fs::File;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub mod apply;
pub mod kube;

use ferry_s3::{S3Config, S3Credentials, S3Options, S3Store};

mod moto;
pub use moto::{moto_python, MotoServer, MotoSetup, PodIdentityAgent, MOTO_INSTALL_HINT};
pub mod fault_proxy;
pub use fault_proxy::{Fault, FaultPlan, FaultProxy};

/// How to install versitygw; part of every "not found" panic.
pub const VERSITYGW_INSTALL_HINT: &str = "versitygw (the S3 server the integration tests run) was not found. Install it with:\n    GOBIN=$HOME/.cache/ferry-tools/bin go install github.com/versity/versitygw/cmd/versitygw@v1.7.0\nor point FERRY_VERSITYGW at the binary, or put `versitygw` on PATH.";

const ACCESS_KEY: &str = "ferry-test-access-key";
const SECRET_KEY: &str = "ferry-test-secret-key-0123456789";
const REGION: &str = "us-east-1";
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Installs a `tracing` subscriber that writes through the test harness (so output is captured per
/// test) and honours `RUST_LOG` (default `info`). Calling it more than once is fine.
pub fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Whether a test may run, given whether its prerequisite (`/dev/fuse`, root, a tool) is there:
/// `true` if it is; otherwise, in CI (`CI=true`), a panic naming it, so a missing prerequisite
/// fails the run instead of counting as a pass; elsewhere `false` with a loud line on stderr (the
/// caller returns: a developer without FUSE can still run the rest).
pub fn prerequisite(present: bool, what: &str) -> bool {
    if present {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "missing prerequisite in CI: {what}"
    );
    eprintln!("SKIPPED (not in CI): missing prerequisite: {what}");
    false
}

/// Starts `sleep 600` in a private mount namespace of its own, with its working directory in its
/// copy of the mount at `dir`, which keeps that copy (and the mount's FUSE connection) alive after
/// the mount is gone from this namespace: what a pod's process that unshared its mount namespace
/// does. Kill and reap the child when done.
pub fn hold_a_copy_in_another_namespace(dir: &Path) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("sleep");
    cmd.arg("600").current_dir(dir);
    // SAFETY: the closure runs in the forked child before exec and calls only async-signal-safe
    // syscalls (unshare, mount) on NUL-terminated literals.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWNS) != 0
                || libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
        .expect("starting sleep in a mount namespace of its own")
}

/// Where the versitygw binary is, if anywhere.
pub fn versitygw_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FERRY_VERSITYGW") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    if let Some(home) = std::env::var_os("HOME") {
        let p = Path::new(&home).join(".cache/ferry-tools/bin/versitygw");
        if p.is_file() {
            return Some(p);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("versitygw"))
        .find(|p| p.is_file())
}

/// A versitygw server on `127.0.0.1:<free port>`, serving a fresh temp dir; killed on drop.
pub struct S3Server {
    child: Child,
    port: u16,
    root: PathBuf,
    log_path: PathBuf,
    sidecar: bool,
    tls: bool,
    /// The admin API's port when started with IAM.
    admin_port: Option<u16>,
    // Last: removed after the process is gone.
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for S3Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Server")
            .field("endpoint", &self.endpoint_url())
            .field("root", &self.root)
            .field("sidecar", &self.sidecar)
            .finish()
    }
}

impl S3Server {
    /// Starts a server and waits until its port answers.
    ///
    /// Panics (with install instructions) if versitygw cannot be found, and with the server's log if
    /// it does not come up. The temp dir is made under `$FERRY_TEST_TMPDIR`, else the system temp dir.
    pub fn start() -> S3Server {
        Self::start_inner(None, false)
    }

    /// Like [`S3Server::start`], serving HTTPS with this certificate and key (PEM files): for
    /// private-CA tests. [`S3Server::endpoint_url`] is then `https://127.0.0.1:<port>`.
    pub fn start_tls(cert: &Path, key: &Path) -> S3Server {
        Self::start_inner(Some((cert.to_path_buf(), key.to_path_buf())), false)
    }

    /// Starts a server that enforces access: an internal IAM (users made with
    /// [`S3Server::create_user`]) and bucket policies ([`S3Store::put_bucket_policy`]). The root
    /// credentials ([`S3Server::store`]) may do anything.
    pub fn start_with_iam() -> S3Server {
        Self::start_inner(None, true)
    }

    fn start_inner(tls: Option<(PathBuf, PathBuf)>, iam: bool) -> S3Server {
        let bin = versitygw_path().unwrap_or_else(|| panic!("{VERSITYGW_INSTALL_HINT}"));
        let base = std::env::var_os("FERRY_TEST_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = tempfile::Builder::new()
            .prefix("ferry-versitygw-")
            .tempdir_in(&base)
            .unwrap_or_else(|e| panic!("creating a temp dir under {}: {e}", base.display()));
        let root = dir.path().join("root");
        let meta = dir.path().join("meta");
        std::fs::create_dir(&root).expect("creating the server root");
        // FERRY_VERSITYGW_SIDECAR=1 forces the sidecar layout (to test it on a filesystem with xattrs).
        let sidecar = std::env::var_os("FERRY_VERSITYGW_SIDECAR").is_some_and(|v| v == "1")
            || !supports_user_xattrs(&root);
        if sidecar {
            std::fs::create_dir(&meta).expect("creating the sidecar dir");
        }
        let log_path = dir.path().join("versitygw.log");
        let iam_dir = dir.path().join("iam");
        if iam {
            std::fs::create_dir(&iam_dir).expect("creating the IAM dir");
        }

        let mut last_log = String::new();
        for _ in 0..5 {
            let port = free_port();
            let admin_port = free_port();
            let log = File::create(&log_path).expect("creating the server log");
            let mut cmd = Command::new(&bin);
            cmd.env("ROOT_ACCESS_KEY", ACCESS_KEY)
                .env("ROOT_SECRET_KEY", SECRET_KEY)
                .arg("--port")
                .arg(format!("127.0.0.1:{port}"));
            if iam {
                cmd.arg("--admin-port")
                    .arg(format!("127.0.0.1:{admin_port}"))
                    .arg("--iam-dir")
                    .arg(&iam_dir);
            }
            cmd.args(["--region", REGION, "--keep-alive", "--quiet"]);
            if let Some((cert, key)) = &tls {
                cmd.arg("--cert").arg(cert).arg("--key").arg(key);
            }
            cmd.arg("posix");
            if sidecar {
                cmd.arg("--sidecar").arg(&meta);
            }
            cmd.arg(&root)
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("cloning the log handle"))
                .stderr(log);
            let mut child = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
            let started = wait_for_port(&mut child, port).and_then(|()| match iam {
                true => wait_for_port(&mut child, admin_port),
                false => Ok(()),
            });
            match started {
                Ok(()) => {
                    return S3Server {
                        child,
                        port,
                        root,
                        log_path,
                        sidecar,
                        tls: tls.is_some(),
                        admin_port: iam.then_some(admin_port),
                        _dir: dir,
                    }
                }
                Err(why) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    last_log = read_log(&log_path);
                    // Someone took the port between our probe and the server's bind: try another.
                    if !last_log.contains("address already in use") {
                        panic!(
                            "versitygw ({}) did not start: {why}\n--- its log ---\n{last_log}",
                            bin.display()
                        );
                    }
                }
            }
        }
        panic!("versitygw could not find a free port\n--- its log ---\n{last_log}");
    }

    /// `http://127.0.0.1:<port>` (`https://` for [`S3Server::start_tls`]).
    pub fn endpoint_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn access_key(&self) -> &str {
        ACCESS_KEY
    }

    pub fn secret_key(&self) -> &str {
        SECRET_KEY
    }

    pub fn region(&self) -> &str {
        REGION
    }

    /// The posix root: bucket `b`'s objects are files under `root().join("b")`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether object metadata goes to a sidecar dir because the temp dir lacks user xattrs.
    pub fn uses_sidecar(&self) -> bool {
        self.sidecar
    }

    /// What the server printed so far (requests are not logged: it runs with `--quiet`).
    pub fn log(&self) -> String {
        read_log(&self.log_path)
    }

    /// Creates an IAM user (`role`: `user`, `userplus` or `admin`) with the admin CLI. Only on a
    /// server started with [`S3Server::start_with_iam`]; panics with the CLI's output on failure.
    pub fn create_user(&self, access_key: &str, secret_key: &str, role: &str) {
        let port = self
            .admin_port
            .expect("create_user needs a server started with S3Server::start_with_iam");
        let bin = versitygw_path().unwrap_or_else(|| panic!("{VERSITYGW_INSTALL_HINT}"));
        let out = Command::new(bin)
            .args(["admin", "--access", ACCESS_KEY, "--secret", SECRET_KEY])
            .args(["--endpoint-url", &format!("http://127.0.0.1:{port}")])
            .args([
                "create-user",
                "--access",
                access_key,
                "--secret",
                secret_key,
            ])
            .args(["--role", role])
            .output()
            .expect("running versitygw admin create-user");
        assert!(
            out.status.success(),
            "versitygw admin create-user {access_key}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Path-style config with the static credentials `access_key`/`secret_key` (e.g. a user made
    /// with [`S3Server::create_user`]).
    pub fn s3_config_as(&self, access_key: &str, secret_key: &str) -> S3Config {
        S3Config {
            credentials: S3Credentials::Static {
                access_key_id: access_key.into(),
                secret_access_key: secret_key.into(),
                session_token: None,
            },
            ..self.s3_config()
        }
    }

    /// Path-style config with static credentials for this server.
    pub fn s3_config(&self) -> S3Config {
        S3Config {
            endpoint_url: Some(self.endpoint_url()),
            region: Some(REGION.into()),
            force_path_style: true,
            credentials: S3Credentials::Static {
                access_key_id: ACCESS_KEY.into(),
                secret_access_key: SECRET_KEY.into(),
                session_token: None,
            },
            on_attempt: None,
        }
    }

    /// Retry settings for tests: few attempts and short backoffs, so failures surface fast.
    pub fn test_options() -> S3Options {
        S3Options {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
            ..S3Options::default()
        }
    }

    /// An [`S3Store`] talking to this server with [`S3Server::test_options`].
    pub async fn store(&self) -> S3Store {
        S3Store::with_options(self.s3_config(), Self::test_options())
            .await
            .expect("building an S3Store for the test server")
    }

    /// Creates a bucket through the S3 API (an existing one is fine). Panics on failure.
    pub async fn create_bucket(&self, name: &str) {
        self.store()
            .await
            .create_bucket(name)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "creating bucket {name}: {e}\n--- server log ---\n{}",
                    self.log()
                )
            });
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port that was free a moment ago.
/// `GET /healthz` on `addr` (HTTP/1.1, one connection): the status code and the body.
/// Pod `pod`'s target path for volume `pv` below kubelet root `root`
/// (`<root>/pods/<pod>/volumes/kubernetes.io~csi/<pv>/mount`), with its parent made, as kubelet
/// makes it (the target itself is the CSI driver's to make).
pub fn kubelet_target(root: &Path, pod: &str, pv: &str) -> PathBuf {
    let parent = root
        .join("pods")
        .join(pod)
        .join("volumes/kubernetes.io~csi")
        .join(pv);
    std::fs::create_dir_all(&parent).unwrap();
    parent.join("mount")
}

pub fn healthz(addr: SocketAddr) -> (u16, String) {
    use std::io::Write;
    let mut c = TcpStream::connect(addr).expect("connecting to the health endpoint");
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("sending GET /healthz");
    let mut resp = String::new();
    c.read_to_string(&mut resp).expect("reading the answer");
    let code = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {resp}"));
    let body = resp
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (code, body)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

fn wait_for_port(child: &mut Child, port: u16) -> Result<(), String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            return Err(format!("it exited with {status}"));
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "port {port} did not answer within {START_TIMEOUT:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_log(path: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_string(&mut s);
    }
    s
}

/// Whether files under `dir` accept `user.*` extended attributes (what versitygw's posix backend
/// stores metadata in).
pub fn supports_user_xattrs(dir: &Path) -> bool {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let probe = dir.join(".ferry-xattr-probe");
    if File::create(&probe).is_err() {
        return false;
    }
    let ok = CString::new(probe.as_os_str().as_bytes())
        .map(|path| {
            let name = c"user.ferry.probe";
            let value = b"1";
            // SAFETY: both strings are NUL-terminated and outlive the call; the value pointer and
            // length describe a live buffer.
            let rc = unsafe {
                libc::setxattr(
                    path.as_ptr(),
                    name.as_ptr(),
                    value.as_ptr().cast(),
                    value.len(),
                    0,
                )
            };
            rc == 0
        })
        .unwrap_or(false);
    let _ = std::fs::remove_file(&probe);
    ok
}
