//! The S3 server behind the delay proxy (`--server`): versitygw (`ferry_testkit::S3Server`, posix
//! backend, data on tmpfs) or moto (`ferry_testkit::MotoServer` started without its IAM set-up,
//! so IAM enforcement stays off and any key may do everything, as in `crates/fs/tests`).
//!
//! Either way the objects live in RAM, out of reach of `drop_caches`: versitygw's files on
//! `/dev/shm`, moto's in its process (every object below `MOTO_S3_DEFAULT_KEY_BUFFER_SIZE` stays
//! in memory instead of spilling into a temp file on disk).

use std::path::Path;

use anyhow::{bail, Context};
use clap::ValueEnum;
use ferry_s3::{S3Config, S3Credentials};
use ferry_testkit::{MotoServer, S3Server};

/// moto without IAM enforcement checks no signature: these are the keys `crates/fs/tests` use.
const MOTO_KEY: &str = "testing";
const MOTO_SECRET: &str = "testing";
const MOTO_REGION: &str = "us-east-1";

/// Which S3 server the benchmark starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ServerKind {
    /// versitygw (posix backend, data on tmpfs).
    Versitygw,
    /// moto's server, plain S3, objects in its memory.
    Moto,
}

/// A running S3 server; stopped when dropped.
pub enum Server {
    Versitygw(S3Server),
    Moto { moto: MotoServer, port: u16 },
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
        }
    }

    /// `versitygw` or `moto`, as the report's header says.
    pub fn name(&self) -> &'static str {
        match self {
            Server::Versitygw(_) => "versitygw",
            Server::Moto { .. } => "moto",
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
        }
    }

    pub fn port(&self) -> u16 {
        match self {
            Server::Versitygw(s) => s.port(),
            Server::Moto { port, .. } => *port,
        }
    }

    pub fn region(&self) -> &str {
        match self {
            Server::Versitygw(s) => s.region(),
            Server::Moto { .. } => MOTO_REGION,
        }
    }

    pub fn access_key(&self) -> &str {
        match self {
            Server::Versitygw(s) => s.access_key(),
            Server::Moto { .. } => MOTO_KEY,
        }
    }

    pub fn secret_key(&self) -> &str {
        match self {
            Server::Versitygw(s) => s.secret_key(),
            Server::Moto { .. } => MOTO_SECRET,
        }
    }

    /// Path-style config with this server's static keys, straight to the server.
    pub fn s3_config(&self) -> S3Config {
        match self {
            Server::Versitygw(s) => s.s3_config(),
            Server::Moto { moto, .. } => S3Config {
                endpoint_url: Some(moto.endpoint_url()),
                region: Some(MOTO_REGION.into()),
                force_path_style: true,
                credentials: S3Credentials::Static {
                    access_key_id: MOTO_KEY.into(),
                    secret_access_key: MOTO_SECRET.into(),
                    session_token: None,
                },
                on_attempt: None,
            },
        }
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
