//! `ferry-node mount`, the standalone mount, against a real S3 server (versitygw): the access
//! check it makes before mounting (the one-key LIST of its own prefix that NodePublishVolume
//! makes), its errors, and a mount that passes it serving the prefix through FUSE.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use ferry_store::ObjectStore;
use ferry_testkit::S3Server;

const BUCKET: &str = "standalone";
/// An upper bound for a mount to appear on a loaded machine; never a measurement.
const PATIENCE: Duration = Duration::from_secs(60);

fn ferry_node(s3: &S3Server, keys: (&str, &str), args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry-node"));
    c.arg("mount")
        .args(args)
        .args(["--endpoint-url", &s3.endpoint_url(), "--force-path-style"])
        .args(["--region", s3.region()])
        .env("AWS_ACCESS_KEY_ID", keys.0)
        .env("AWS_SECRET_ACCESS_KEY", keys.1)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("RUST_BACKTRACE", "0");
    c
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn mounted(dir: &Path) -> bool {
    let dir = dir.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(dir.as_str()))
}

/// A missing bucket is named, once, with exit code 1, in the foreground and in the background
/// (whose parent shows its child's error and exits with its code), and nothing is mounted.
#[test]
fn a_missing_bucket_is_named_and_nothing_is_mounted() {
    let s3 = S3Server::start();
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().to_str().unwrap();
    for extra in [Some("--foreground"), None] {
        let mut args = vec!["no-such-bucket", target];
        args.extend(extra);
        let out = ferry_node(&s3, (s3.access_key(), s3.secret_key()), &args)
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert_eq!(
            err.matches("bucket \"no-such-bucket\" does not exist")
                .count(),
            1,
            "{extra:?}: {err}"
        );
        assert!(!err.contains("mount process exited"), "{err}");
        assert!(!mounted(dir.path()));
    }
}

/// `ferry-node mount standalone DIR ARGS… --foreground` against a new server that has the
/// bucket, signing with `secret` (the server's own if `None`), which must fail and mount nothing:
/// its standard error.
fn failed_mount(secret: Option<&str>, args: &[&str]) -> String {
    failed_mount_as(None, secret, args)
}

/// [`failed_mount`] with the access key `access_key` (the server's own if `None`).
fn failed_mount_as(access_key: Option<&str>, secret: Option<&str>, args: &[&str]) -> String {
    let s3 = S3Server::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(s3.create_bucket(BUCKET));
    let dir = tempfile::tempdir().unwrap();
    let mut all = vec![BUCKET, dir.path().to_str().unwrap()];
    all.extend(args);
    all.push("--foreground");
    let keys = (
        access_key.unwrap_or(s3.access_key()),
        secret.unwrap_or(s3.secret_key()),
    );
    let out = ferry_node(&s3, keys, &all).output().unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(!mounted(dir.path()), "{err}");
    err
}

/// A `--log-directory` no file can be made in is an error at start, before anything is mounted
/// (not a log lost once the mount is live).
#[test]
fn a_log_directory_that_cannot_take_a_file_is_an_error_at_start() {
    let logs = tempfile::tempdir().unwrap();
    let missing = logs.path().join("no-such-dir");
    let err = failed_mount(None, &["--log-directory", missing.to_str().unwrap()]);
    let want = format!(
        "--log-directory: creating the log file {}/ferry-mount-",
        missing.display()
    );
    assert!(err.contains(&want), "{err}");
}

#[test]
fn keys_the_server_refuses_name_the_list_permission() {
    let err = failed_mount(Some("not-the-secret-key"), &["--prefix", "data/"]);
    assert!(
        err.contains("may not list bucket \"standalone\" prefix \"data/\" (s3:ListBucket)"),
        "{err}"
    );
}

/// An access key the server does not know is not a missing bucket: the error quotes what the
/// server said. VERSITYGW: it answers such a key with `404 XAdminUserNotFound` (S3 answers 403
/// `InvalidAccessKeyId`); every 404 to the LIST was taken for `bucket "standalone" does not exist`.
#[test]
fn an_access_key_the_server_does_not_know_is_not_a_missing_bucket() {
    let err = failed_mount_as(Some("ferry-no-such-user"), None, &["--prefix", "data/"]);
    assert!(!err.contains("does not exist"), "{err}");
    assert!(
        err.contains("XAdminUserNotFound")
            && err.contains("No user exists with the provided access key ID"),
        "{err}"
    );
    assert!(
        err.contains("listing bucket \"standalone\" prefix \"data/\""),
        "{err}"
    );
}

/// A new server whose bucket holds `objects`, for a test that mounts through FUSE; `None` (the
/// test then returns) only where [`ferry_testkit::prerequisite`] lets a missing `/dev/fuse` or
/// root pass.
fn server_for_fuse(objects: &[(&str, &str)]) -> Option<S3Server> {
    let present = Path::new("/dev/fuse").exists() && nix::unistd::geteuid().is_root();
    if !ferry_testkit::prerequisite(present, "/dev/fuse and root (a real FUSE mount)") {
        return None;
    }
    let s3 = S3Server::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        s3.create_bucket(BUCKET).await;
        let root = s3.store().await;
        for (key, body) in objects {
            root.put(BUCKET, key, body.to_string().into())
                .await
                .unwrap();
        }
    });
    Some(s3)
}

/// A mount whose check passes serves its prefix. (Under an IAM policy that scopes ListBucket to
/// the prefix, S3 refuses HeadBucket, which this check used to be, and allows this LIST;
/// versitygw does not refuse that HeadBucket, so the difference is not shown here.)
#[test]
fn a_prefix_mount_serves_the_prefix() {
    let Some(s3) = server_for_fuse(&[("data/a.txt", "hello"), ("other/b.txt", "not here")]) else {
        return;
    };

    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().to_str().unwrap();
    // A free port on loopback for its metrics.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = format!("127.0.0.1:{port}");
    let mut child = ferry_node(
        &s3,
        (s3.access_key(), s3.secret_key()),
        &[
            BUCKET,
            target,
            "--prefix",
            "data/",
            "--foreground",
            "--metrics-addr",
            &metrics,
        ],
    )
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let started = Instant::now();
    while !mounted(dir.path()) {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!("the mount exited ({status}): {}", stderr(&out));
        }
        assert!(started.elapsed() < PATIENCE, "no mount in {PATIENCE:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let read = std::fs::read_to_string(dir.path().join("a.txt"));
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let live = scrape(&metrics);
    let umount = Command::new("umount").arg(dir.path()).status().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(read.unwrap(), "hello");
    assert_eq!(names, ["a.txt"]);
    assert!(
        live.lines().any(|l| l == "ferry_mounts 1"),
        "the live mount is counted: {}",
        live.lines()
            .filter(|l| l.starts_with("ferry_mounts"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    assert!(umount.success());
    assert!(status.success(), "{status}");
}

/// The body of `GET /metrics` at `addr`.
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// `ferry-node mount` without `--foreground` returns once the mount is live, and from then on the
/// background process holds none of its caller's pipes: a caller that reads the output to its
/// end (`out=$(ferry-node mount …)`, `ferry-node mount … | tee`) gets it, the start's log
/// included, and goes on.
#[test]
fn a_background_mount_lets_go_of_its_callers_pipes() {
    background_mount(false);
}

/// The same with `--log-directory`: the mount's log from then on is in a new file there, as
/// plain text.
#[test]
fn a_background_mount_with_a_log_directory_logs_there_once_live() {
    background_mount(true);
}

fn background_mount(with_logs: bool) {
    use std::io::Read;
    let Some(s3) = server_for_fuse(&[("a.txt", "hello")]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let target = dir.path().to_str().unwrap();
    let mut args = vec![BUCKET, target];
    if with_logs {
        args.extend(["--log-directory", logs.path().to_str().unwrap()]);
    }
    let mut parent = ferry_node(&s3, (s3.access_key(), s3.secret_key()), &args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Each pipe read to its end on a thread of its own: the end comes only once no process
    // holds its writing side.
    let read_to_end = |mut r: Box<dyn Read + Send>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            let _ = tx.send(s);
        });
        rx
    };
    let out = read_to_end(Box::new(parent.stdout.take().unwrap()));
    let err = read_to_end(Box::new(parent.stderr.take().unwrap()));
    let (out, err) = match (out.recv_timeout(PATIENCE), err.recv_timeout(PATIENCE)) {
        (Ok(o), Ok(e)) => (o, e),
        _ => {
            let _ = Command::new("umount").arg(dir.path()).status();
            panic!("the caller's pipes were still held {PATIENCE:?} after the mount started");
        }
    };
    assert!(parent.wait().unwrap().success(), "{out}{err}");
    let pid: u32 = out
        .trim()
        .rsplit_once("(pid ")
        .and_then(|(_, p)| p.strip_suffix(')'))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {out:?}"));
    assert!(err.contains("mounted; unmount with"), "{err}");
    // Where the mount's standard output and error go now: nowhere, or its log file.
    let fd = |n: u32| std::fs::read_link(format!("/proc/{pid}/fd/{n}")).unwrap();
    let (stdout, stderr) = (fd(1), fd(2));
    let read = std::fs::read_to_string(dir.path().join("a.txt"));
    let umount = Command::new("umount").arg(dir.path()).status().unwrap();
    let started = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(started.elapsed() < PATIENCE, "pid {pid} still running");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(read.unwrap(), "hello");
    assert!(umount.success());
    let files: Vec<_> = std::fs::read_dir(logs.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    if !with_logs {
        assert!(files.is_empty(), "{files:?}");
        assert_eq!((stdout, stderr), ("/dev/null".into(), "/dev/null".into()));
        return;
    }
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!((&stdout, &stderr), (&files[0], &files[0]));
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("ferry-mount-") && name.ends_with(&format!("-{pid}.log")),
        "{name}"
    );
    assert!(err.contains(&name), "the start's log names the file: {err}");
    let log = std::fs::read_to_string(&files[0]).unwrap();
    assert!(log.contains("unmounted externally"), "{log}");
    assert!(!log.contains('\u{1b}'), "colour codes in the file: {log}");
}

/// A directory something is already mounted on is refused, naming it and that mount, in the
/// background and in the foreground, and nothing is mounted on top (a second mount would hide the
/// first, and the background parent would have taken the first for its own).
#[test]
fn a_directory_already_mounted_on_is_refused() {
    let present = nix::unistd::geteuid().is_root();
    if !ferry_testkit::prerequisite(present, "root (a tmpfs mount to stand in the way)") {
        return;
    }
    let s3 = S3Server::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(s3.create_bucket(BUCKET));
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().to_str().unwrap();
    let tmpfs = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "in-the-way", target])
        .status()
        .unwrap();
    assert!(tmpfs.success());
    let count = || {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some(target))
            .count()
    };
    let mut errs = Vec::new();
    for extra in [None, Some("--foreground")] {
        let mut args = vec![BUCKET, target];
        args.extend(extra);
        let out = ferry_node(&s3, (s3.access_key(), s3.secret_key()), &args)
            .output()
            .unwrap();
        errs.push((out.status.success(), stderr(&out), count()));
    }
    let umount = Command::new("umount").arg(dir.path()).status().unwrap();
    for (ok, err, mounts) in errs {
        assert!(!ok, "{err}");
        assert!(
            err.contains(&format!(
                "mount directory {target} is already a mount point (tmpfs from in-the-way)"
            )),
            "{err}"
        );
        assert_eq!(mounts, 1, "only the tmpfs is mounted there: {err}");
    }
    assert!(umount.success());
}

/// Owners and modes no mount can mean are refused when parsed: (uid_t)-1 (chown's "no change":
/// even root could not create a file) and setuid, setgid or sticky bits on every file.
#[test]
fn owners_and_modes_no_mount_can_mean_are_refused() {
    for (args, want) in [
        (["--uid", "4294967295"], "(uid_t)-1"),
        (["--gid", "4294967295"], "(uid_t)-1"),
        (["--file-mode", "4755"], "no setuid"),
        (["--dir-mode", "1777"], "sticky"),
    ] {
        let err = failed_mount(None, &args);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// A value the command line refuses is named by its flag, then quoted itself (it read
/// `invalid bucket name "bucket": …`, the parameter's name where the value belongs).
#[test]
fn refused_values_are_named_by_their_flag() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().to_str().unwrap();
    for (args, want) in [
        (
            vec!["Bad_Bucket!", target],
            "invalid bucket name: \"Bad_Bucket!\"",
        ),
        (
            vec!["bucket", target, "--prefix", "/abs/"],
            "invalid --prefix: \"/abs/\"",
        ),
        (
            vec!["bucket", target, "--endpoint-url", "ftp://x"],
            "invalid --endpoint-url: \"ftp://x\"",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ferry-node"))
            .arg("mount")
            .args(&args)
            .arg("--foreground")
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// A mount point that is not a directory is refused before anything is asked of S3 (here an
/// endpoint nothing listens on, whose error would otherwise come first), with its cause once.
#[test]
fn a_mount_point_that_is_a_file_is_refused_before_s3_is_asked() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-node"))
        .args(["mount", "bucket", file.to_str().unwrap(), "--foreground"])
        .args([
            "--endpoint-url",
            "http://127.0.0.1:1",
            "--region",
            "us-east-1",
        ])
        .env("AWS_ACCESS_KEY_ID", "k")
        .env("AWS_SECRET_ACCESS_KEY", "s")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert_eq!(err.matches("is not a directory").count(), 1, "{err}");
    assert!(!err.contains("connect"), "S3 was asked first: {err}");
}

/// With an S3-compatible endpoint and no region, the region is not asked of the EC2 instance
/// metadata service (a link-local address, off EC2 only a delay and a warning): the environment,
/// the profile, else us-east-1, which signs for the test server.
#[test]
fn a_custom_endpoint_without_a_region_never_asks_imds() {
    let s3 = S3Server::start();
    assert_eq!(s3.region(), "us-east-1");
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-node"))
        .args(["mount", "no-such-bucket", dir.path().to_str().unwrap()])
        .args(["--endpoint-url", &s3.endpoint_url(), "--force-path-style"])
        .arg("--foreground")
        .env("AWS_ACCESS_KEY_ID", s3.access_key())
        .env("AWS_SECRET_ACCESS_KEY", s3.secret_key())
        .env("AWS_CONFIG_FILE", dir.path().join("no-config"))
        .env(
            "AWS_SHARED_CREDENTIALS_FILE",
            dir.path().join("no-credentials"),
        )
        .env_remove("AWS_REGION")
        .env_remove("AWS_DEFAULT_REGION")
        .env_remove("AWS_EC2_METADATA_DISABLED")
        // Should a regression ask it, the question goes to loopback, never to a link-local address.
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:1")
        .env("RUST_LOG", "debug")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = stderr(&out);
    // Signed for the server's region and answered: the bucket is missing.
    assert!(
        err.contains("bucket \"no-such-bucket\" does not exist"),
        "{err}"
    );
    assert!(!err.to_ascii_lowercase().contains("imds"), "{err}");
    assert!(!err.contains("169.254.169.254"), "{err}");
}

/// A memory budget whose share for blocks waiting to be written is less than one block leaves
/// the node cache storing nothing: said at start, not left to be found in the metrics.
#[test]
fn a_budget_too_small_for_one_cache_block_is_said_at_start() {
    let Some(s3) = server_for_fuse(&[("a.txt", "hello")]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (target, cache) = (dir.path().join("m"), dir.path().join("cache"));
    std::fs::create_dir(&target).unwrap();
    let mut child = ferry_node(
        &s3,
        (s3.access_key(), s3.secret_key()),
        &[
            BUCKET,
            target.to_str().unwrap(),
            "--foreground",
            "--cache",
            cache.to_str().unwrap(),
            "--memory-budget",
            "4MiB",
        ],
    )
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let started = Instant::now();
    while !mounted(&target) {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!("the mount exited ({status}): {}", stderr(&out));
        }
        assert!(started.elapsed() < PATIENCE, "no mount in {PATIENCE:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let read = std::fs::read_to_string(target.join("a.txt"));
    let umount = Command::new("umount").arg(&target).status().unwrap();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(read.unwrap(), "hello");
    assert!(umount.success());
    assert!(err.contains("the node cache can store nothing"), "{err}");
    assert!(
        err.contains("33554432 bytes"),
        "names the budget it needs: {err}"
    );
}
