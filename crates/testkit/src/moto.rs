//! [`MotoServer`]: moto (S3, IAM, STS) on loopback with IAM enforcement on, so S3 checks SigV4
//! signatures and the policies of the signing user or assumed role; and [`PodIdentityAgent`], a
//! stand-in for the EKS Pod Identity agent that hands out credentials of roles on that server.
//!
//! moto comes from PyPI into a venv outside the repository (`scripts/setup.sh`:
//! `~/.cache/ferry-tools/venv`, or `$FERRY_MOTO_PYTHON`). Set-up (buckets, users, roles) runs with
//! enforcement off; [`MotoServer::setup`] then switches it on. One deviation from stock moto, to
//! match AWS, is in `moto_server.py`: an unsigned STS `AssumeRoleWithWebIdentity` is not
//! signature-checked (moto 5.2 crashes on it otherwise).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::{free_port, read_log, wait_for_port};

/// How to install moto; part of every "not found" panic.
pub const MOTO_INSTALL_HINT: &str = "moto (the STS/IAM/S3 server the credentials tests run) was not found. Install it with:\n    python3 -m venv ~/.cache/ferry-tools/venv && ~/.cache/ferry-tools/venv/bin/pip install 'moto[server]'\n(scripts/setup.sh does), or point FERRY_MOTO_PYTHON at a python with moto.";

/// The python with moto in it, if any.
pub fn moto_python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FERRY_MOTO_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home).join(".cache/ferry-tools/venv/bin/python");
    p.is_file().then_some(p)
}

fn python() -> PathBuf {
    moto_python().unwrap_or_else(|| panic!("{MOTO_INSTALL_HINT}"))
}

fn spawn_script(
    dir: &tempfile::TempDir,
    name: &str,
    script: &str,
    args: &[String],
) -> (Child, PathBuf) {
    let path = dir.path().join(format!("{name}.py"));
    std::fs::write(&path, script).expect("writing a helper script");
    let log_path = dir.path().join(format!("{name}.log"));
    let log = std::fs::File::create(&log_path).expect("creating a log");
    let child = Command::new(python())
        .arg(&path)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("cloning the log handle"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    (child, log_path)
}

/// A moto server on `127.0.0.1:<free port>`; killed on drop.
pub struct MotoServer {
    child: Child,
    port: u16,
    log_path: PathBuf,
    _dir: tempfile::TempDir,
}

/// What [`MotoServer::setup`] made: users' access keys and roles' ARNs, by name.
#[derive(Debug, Clone, Default)]
pub struct MotoSetup {
    /// name -> (access key id, secret access key)
    pub users: HashMap<String, (String, String)>,
    /// name -> role ARN
    pub roles: HashMap<String, String>,
}

impl MotoServer {
    /// Starts moto and waits until its port answers; panics with install instructions if moto is
    /// missing.
    pub fn start() -> MotoServer {
        let dir = tempfile::Builder::new()
            .prefix("ferry-moto-")
            .tempdir()
            .expect("creating a temp dir");
        let port = free_port();
        let (mut child, log_path) = spawn_script(
            &dir,
            "moto_server",
            include_str!("moto_server.py"),
            &[
                "-H".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
            ],
        );
        if let Err(why) = wait_for_port(&mut child, port) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "moto did not start: {why}\n--- its log ---\n{}",
                read_log(&log_path)
            );
        }
        MotoServer {
            child,
            port,
            log_path,
            _dir: dir,
        }
    }

    /// `http://127.0.0.1:<port>`: S3, STS and IAM all answer here.
    pub fn endpoint_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The server's log.
    pub fn log(&self) -> String {
        read_log(&self.log_path)
    }

    /// Creates buckets with objects, IAM users with inline policies (and access keys), and roles
    /// (trusting web identities) with inline policies, then turns IAM enforcement on. `buckets`:
    /// bucket -> [(key, text)]; `users` and `roles`: name -> policy statements (JSON).
    pub fn setup(
        &self,
        buckets: &[(&str, &[(&str, &str)])],
        users: &[(&str, &str)],
        roles: &[(&str, &str)],
    ) -> MotoSetup {
        let dir = tempfile::tempdir().expect("creating a temp dir");
        let path = dir.path().join("moto_setup.py");
        std::fs::write(&path, include_str!("moto_setup.py")).expect("writing moto_setup.py");
        let buckets: Vec<String> = buckets
            .iter()
            .map(|(b, objs)| {
                let objs: Vec<String> = objs
                    .iter()
                    .map(|(k, v)| format!("{}: {}", json_str(k), json_str(v)))
                    .collect();
                format!("{}: {{{}}}", json_str(b), objs.join(", "))
            })
            .collect();
        let named = |v: &[(&str, &str)]| {
            v.iter()
                .map(|(n, statements)| format!("{}: {statements}", json_str(n)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let spec = format!(
            r#"{{"endpoint": {}, "buckets": {{{}}}, "users": {{{}}}, "roles": {{{}}}, "enforce": true}}"#,
            json_str(&self.endpoint_url()),
            buckets.join(", "),
            named(users),
            named(roles)
        );
        let mut child = Command::new(python())
            .arg(&path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running moto_setup.py");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(spec.as_bytes())
            .unwrap();
        let out = child.wait_with_output().expect("waiting for moto_setup.py");
        assert!(
            out.status.success(),
            "moto set-up failed: {}\n--- server log ---\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("moto_setup.py printed no JSON");
        let mut setup = MotoSetup::default();
        for (name, k) in v["users"].as_object().unwrap() {
            setup.users.insert(
                name.clone(),
                (
                    k["access_key_id"].as_str().unwrap().to_string(),
                    k["secret_access_key"].as_str().unwrap().to_string(),
                ),
            );
        }
        for (name, arn) in v["roles"].as_object().unwrap() {
            setup
                .roles
                .insert(name.clone(), arn.as_str().unwrap().to_string());
        }
        setup
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn json_str(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// The EKS Pod Identity agent stand-in (`pod_identity_agent.py`): answers a token associated with
/// a role (see [`PodIdentityAgent::associate`]) with that role's credentials from moto, expiring
/// after the given number of seconds; anything else with 401. Killed on drop.
pub struct PodIdentityAgent {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
    log_path: PathBuf,
}

impl PodIdentityAgent {
    pub fn start(moto: &MotoServer, expires_in_secs: u64) -> PodIdentityAgent {
        let dir = tempfile::Builder::new()
            .prefix("ferry-pia-")
            .tempdir()
            .expect("creating a temp dir");
        let port = free_port();
        std::fs::write(dir.path().join("assoc.json"), "{}").unwrap();
        std::fs::write(dir.path().join("seen"), "").unwrap();
        let (mut child, log_path) = spawn_script(
            &dir,
            "pod_identity_agent",
            include_str!("pod_identity_agent.py"),
            &[
                port.to_string(),
                moto.endpoint_url(),
                dir.path().join("assoc.json").display().to_string(),
                dir.path().join("seen").display().to_string(),
                expires_in_secs.to_string(),
            ],
        );
        if let Err(why) = wait_for_port(&mut child, port) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the Pod Identity agent stand-in did not start: {why}\n{}",
                read_log(&log_path)
            );
        }
        PodIdentityAgent {
            child,
            port,
            dir,
            log_path,
        }
    }

    /// The agent URL, as `http://169.254.170.23/v1/credentials` is on EKS.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/v1/credentials", self.port)
    }

    /// Replaces the associations: (token, label, role ARN). Only these tokens get credentials.
    pub fn associate(&self, tokens: &[(&str, &str, &str)]) {
        let map: serde_json::Map<String, serde_json::Value> = tokens
            .iter()
            .map(|(t, label, role)| {
                (
                    t.to_string(),
                    serde_json::json!({"role": role, "label": label}),
                )
            })
            .collect();
        let tmp = self.dir.path().join("assoc.json.tmp");
        std::fs::write(&tmp, serde_json::Value::Object(map).to_string()).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("assoc.json")).unwrap();
    }

    /// The label of the token of every request so far (`unknown` for unassociated tokens).
    pub fn seen(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("seen"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The stand-in's own log (errors only).
    pub fn log(&self) -> String {
        read_log(&self.log_path)
    }
}

impl Drop for PodIdentityAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
