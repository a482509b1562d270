//! The S3 server behind the delay proxy (`--server`): versitygw (`ferry_testkit::S3Server`, posix
//! backend, data on tmpfs), moto (`ferry_testkit::MotoServer` started without its IAM set-up,
//! so IAM enforcement stays off and any key may do everything, as in `crates/fs/tests`),
//! s3s-fs (the `s3s` project's S3 server over a directory, in Rust) or rclone's `serve s3`
//! (gofakes3 over rclone's local backend, in Go); `bench/setup-peers.sh` installs the last two
//! (rclone 1.75 as `rclone-s3`, beside Debian's 1.60 that the `rclone` mounter column runs).
//!
//! Every way the objects live in RAM, out of reach of `drop_caches`: versitygw's, s3s-fs's and
//! rclone's files on `/dev/shm`, moto's in its process (every object below
//! `MOTO_S3_DEFAULT_KEY_BUFFER_SIZE` stays in memory instead of spilling into a temp file on
//! disk).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::ValueEnum;
use ferry_s3::{S3Config, S3Credentials};
use ferry_testkit::{MotoServer, S3Server};

/// moto without IAM enforcement checks no signature: these are the keys `crates/fs/tests` use.
const MOTO_KEY: &str = "testing";
const MOTO_SECRET: &str = "testing";
const MOTO_REGION: &str = "us-east-1";
/// s3s-fs and rclone check signatures with the one key pair they are started with.
const CHILD_KEY: &str = "ferrybench";
const CHILD_SECRET: &str = "ferrybench-secret";
const CHILD_REGION: &str = "us-east-1";

/// Which S3 server the benchmark starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ServerKind {
    /// versitygw (posix backend, data on tmpfs).
    Versitygw,
    /// moto's server, plain S3, objects in its memory.
    Moto,
    /// s3s-fs (the `s3s` project's server over a directory), data on tmpfs.
    S3sFs,
    /// `rclone serve s3` over a directory (rclone's local backend), data on tmpfs.
    Rclone,
}

/// A running S3 server; stopped when dropped.
pub enum Server {
    Versitygw(S3Server),
    Moto { moto: MotoServer, port: u16 },
    Child(ChildServer),
}

/// A running server process of ours (s3s-fs or rclone) serving a fresh directory; killed (and
/// the directory removed) on drop.
pub struct ChildServer {
    name: &'static str,
    child: Child,
    port: u16,
    version: String,
    // Last: removed after the process is gone.
    dir: tempfile::TempDir,
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the binary `name` is: `$env`, `~/.cache/ferry-tools/bin`, or `PATH`.
fn tool_path(name: &str, env: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let home = std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/ferry-tools/bin"));
    let path = std::env::var_os("PATH").unwrap_or_default();
    home.into_iter()
        .chain(std::env::split_paths(&path))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

impl ChildServer {
    /// Starts `kind` (s3s-fs or rclone) on a fresh directory under `/dev/shm`.
    fn start(kind: ServerKind) -> anyhow::Result<ChildServer> {
        let (name, env) = match kind {
            ServerKind::S3sFs => ("s3s-fs", "FERRY_S3S_FS"),
            ServerKind::Rclone => ("rclone-s3", "FERRY_RCLONE_S3"),
            _ => bail!("{kind:?} is not a server process of the benchmark's own"),
        };
        let Some(bin) = tool_path(name, env) else {
            bail!("{name} not found (${env}, ~/.cache/ferry-tools/bin or PATH): run bench/setup-peers.sh");
        };
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("ferry-{name}-"))
            .tempdir_in(&base)
            .with_context(|| format!("a temp dir under {}", base.display()))?;
        let root = dir.path().join("root");
        std::fs::create_dir(&root).context("the server's root")?;
        let log_path = dir.path().join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).context("the server log")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let version = Command::new(&bin)
            .arg(if kind == ServerKind::Rclone {
                "version"
            } else {
                "--version"
            })
            .output()
            .ok()
            .and_then(|o| {
                let out = String::from_utf8_lossy(&o.stdout).to_string();
                out.lines().next().map(|l| l.trim().to_string())
            })
            .unwrap_or_else(|| "?".into());
        let mut cmd = Command::new(&bin);
        match kind {
            ServerKind::Rclone => {
                cmd.args(["serve", "s3", "--addr", &format!("127.0.0.1:{port}")])
                    .args(["--auth-key", &format!("{CHILD_KEY},{CHILD_SECRET}")])
                    // No config file of the user's; no log lines per request.
                    .args(["--config", "/dev/null", "--log-level", "ERROR"])
                    .arg(&root);
            }
            _ => {
                cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--access-key", CHILD_KEY, "--secret-key", CHILD_SECRET])
                    .arg(&root);
            }
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let server = ChildServer {
            name,
            child,
            port,
            version,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                bail!("{name} did not answer on {addr} within 20 s; its log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(server)
    }

    fn endpoint_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Server {
    /// Starts `kind`; `largest_object` (bytes) is what moto must keep in memory.
    pub fn start(kind: ServerKind, largest_object: u64) -> anyhow::Result<Server> {
        match kind {
            ServerKind::Versitygw => {
                if ferry_testkit::versitygw_path().is_none() {
                    bail!(
                        "versitygw not found (~/.cache/ferry-tools/bin, $FERRY_VERSITYGW or PATH)"
                    );
                }
                // The server keeps its objects in RAM, out of reach of drop_caches.
                if std::env::var_os("FERRY_TEST_TMPDIR").is_none() && Path::new("/dev/shm").is_dir()
                {
                    std::env::set_var("FERRY_TEST_TMPDIR", "/dev/shm");
                }
                Ok(Server::Versitygw(S3Server::start()))
            }
            ServerKind::Moto => {
                if ferry_testkit::moto_python().is_none() {
                    bail!("{}", ferry_testkit::MOTO_INSTALL_HINT);
                }
                // Read by moto only (it inherits our environment).
                if std::env::var_os("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE").is_none() {
                    let size = largest_object + (1 << 20);
                    std::env::set_var("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", size.to_string());
                }
                let moto = MotoServer::start();
                let url = moto.endpoint_url();
                let port = url
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .with_context(|| format!("no port in moto's endpoint {url}"))?;
                Ok(Server::Moto { moto, port })
            }
            ServerKind::S3sFs | ServerKind::Rclone => Ok(Server::Child(ChildServer::start(kind)?)),
        }
    }

    /// `versitygw`, `moto`, `s3s-fs` or `rclone`, as the report's header says.
    pub fn name(&self) -> &'static str {
        match self {
            Server::Versitygw(_) => "versitygw",
            Server::Moto { .. } => "moto",
            Server::Child(s) => match s.name {
                "rclone-s3" => "rclone",
                other => other,
            },
        }
    }

    /// One line about the server for the report: version and where its data is.
    pub fn describe(&self) -> String {
        match self {
            Server::Versitygw(s) => format!(
                "versitygw (posix backend) at {}, data in {}, sidecar metadata: {}",
                s.endpoint_url(),
                s.root().display(),
                s.uses_sidecar()
            ),
            Server::Moto { moto, .. } => format!(
                "moto {} (server mode, IAM enforcement off) at {}, objects in its memory",
                moto_version(),
                moto.endpoint_url()
            ),
            Server::Child(s) => format!(
                "{} at {}, data in {}",
                s.version,
                s.endpoint_url(),
                s.dir.path().join("root").display()
            ),
        }
    }

    /// Whether the dataset goes up in single PUTs only (rclone: see `dataset::SINGLE_PUT`).
    pub fn single_put(&self) -> bool {
        matches!(self, Server::Child(s) if s.name == "rclone-s3")
    }

    pub fn port(&self) -> u16 {
        match self {
            Server::Versitygw(s) => s.port(),
            Server::Moto { port, .. } => *port,
            Server::Child(s) => s.port,
        }
    }

    pub fn region(&self) -> &str {
        match self {
            Server::Versitygw(s) => s.region(),
            Server::Moto { .. } => MOTO_REGION,
            Server::Child(_) => CHILD_REGION,
        }
    }

    pub fn access_key(&self) -> &str {
        match self {
            Server::Versitygw(s) => s.access_key(),
            Server::Moto { .. } => MOTO_KEY,
            Server::Child(_) => CHILD_KEY,
        }
    }

    pub fn secret_key(&self) -> &str {
        match self {
            Server::Versitygw(s) => s.secret_key(),
            Server::Moto { .. } => MOTO_SECRET,
            Server::Child(_) => CHILD_SECRET,
        }
    }

    /// Path-style config with this server's static keys, straight to the server.
    pub fn s3_config(&self) -> S3Config {
        match self {
            Server::Versitygw(s) => s.s3_config(),
            Server::Moto { moto, .. } => static_keys(moto.endpoint_url(), self),
            Server::Child(s) => static_keys(s.endpoint_url(), self),
        }
    }
}

/// Path-style config for `url` with `server`'s region and static keys.
fn static_keys(url: String, server: &Server) -> S3Config {
    S3Config {
        endpoint_url: Some(url),
        region: Some(server.region().into()),
        force_path_style: true,
        credentials: S3Credentials::Static {
            access_key_id: server.access_key().into(),
            secret_access_key: server.secret_key().into(),
            session_token: None,
        },
        on_attempt: None,
    }
}

/// The installed moto's version, or `?`.
fn moto_version() -> String {
    let Some(python) = ferry_testkit::moto_python() else {
        return "?".into();
    };
    std::process::Command::new(python)
        .args(["-c", "import moto; print(moto.__version__)"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "?".into())
}
