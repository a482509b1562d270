//! The real `ferry-controller`'s `/healthz`: 200 while it serves, with or without default
//! credentials (a StorageClass may bring its keys in a provisioner Secret; a Probe that waited
//! for default credentials kept csi-provisioner from ever provisioning), which it checks once
//! and says in its log.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An upper bound for the process to start on a loaded machine; never a measurement.
const PATIENCE: Duration = Duration::from_secs(60);

struct Controller(Child);

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts ferry-controller with `env` (and nothing else of this environment: no AWS settings, no
/// Kubernetes API) and returns it with its health address.
fn start(
    dir: &std::path::Path,
    env: &[(&str, &str)],
) -> (
    Controller,
    std::net::SocketAddr,
    std::sync::mpsc::Receiver<String>,
) {
    let child = Command::new(env!("CARGO_BIN_EXE_ferry-controller"))
        .arg(format!(
            "--csi-endpoint=unix://{}",
            dir.join("csi.sock").display()
        ))
        .args([
            "--metrics-addr=off",
            "--health-addr=127.0.0.1:0",
            "--region=us-east-1",
        ])
        .env_clear()
        .env("HOME", dir)
        .env("NO_COLOR", "1")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_CONFIG_FILE", dir.join("no-config"))
        .env("AWS_SHARED_CREDENTIALS_FILE", dir.join("no-credentials"))
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting ferry-controller");
    // Owned (killed and reaped on drop) from here on, whatever happens below.
    let mut controller = Controller(child);
    let stderr = controller.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("ferry-controller: {line}");
            let _ = tx.send(line);
        }
    });
    let line = line_with(&rx, "health at /healthz");
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("addr="))
        .expect("the health line names its address");
    (controller, addr.parse().unwrap(), rx)
}

/// The first line of the log (within [`PATIENCE`]) that contains `needle`.
fn line_with(log: &std::sync::mpsc::Receiver<String>, needle: &str) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = log
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("ferry-controller never logged {needle:?}: {e}"));
        if line.contains(needle) {
            return line;
        }
    }
}

#[test]
fn healthz_is_the_probe() {
    let dir = tempfile::tempdir().unwrap();
    let (_ok, addr, _) = start(
        &dir.path().join("with-credentials"),
        &[
            ("AWS_ACCESS_KEY_ID", "AKIDFERRYTEST"),
            ("AWS_SECRET_ACCESS_KEY", "ferry-test-secret"),
        ],
    );
    assert_eq!(ferry_testkit::healthz(addr), (200, "ok\n".to_string()));

    let (_no_credentials, addr, log) = start(&dir.path().join("without"), &[]);
    assert_eq!(ferry_testkit::healthz(addr), (200, "ok\n".to_string()));
    let line = line_with(&log, "the driver has no default credentials");
    assert!(line.contains("provisioner Secret"), "{line}");
}
