//! The e2e's images built for real (`ferry_e2e::image`): from the built binaries and the host's
//! Debian packages, each archive a valid OCI layout, the programs run inside the unpacked root
//! filesystems with `chroot`, a second build gives the same digests, and a throwaway containerd
//! imports them and runs the busybox and pause images. Needs root, `dpkg-deb`, `apt-get` with a
//! reachable mirror, containerd and runc; without them the test is skipped, or fails under `CI=true`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use ferry_e2e::image::{self, Image};

/// Fails under CI, else says why the test is skipped.
fn missing(what: &str) -> bool {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("prerequisite missing under CI=true: {what}");
    }
    eprintln!("skipped: {what}");
    true
}

fn prerequisites_missing(bins: &Path) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return missing("not root (dpkg-deb ownership, chroot)");
    }
    for tool in ["dpkg-deb", "apt-get", "chroot", "containerd", "ctr", "runc"] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false);
        if !found {
            return missing(&format!("{tool} is not installed"));
        }
    }
    for bin in image::FERRY_BINARIES {
        if !bins.join(bin).is_file() {
            return missing(&format!(
                "{} is not built (cargo build -p ferry-controller -p ferry-node -p ferry-holder)",
                bins.join(bin).display()
            ));
        }
    }
    false
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn chroot(root: &Path, args: &[&str]) -> String {
    String::from_utf8(run(Command::new("chroot").arg(root).args(args)).stdout).unwrap()
}

fn find<'a>(images: &'a [Image], repo: &str) -> &'a Image {
    images
        .iter()
        .find(|i| i.names[0].starts_with(&format!("{repo}:")))
        .unwrap_or_else(|| panic!("no {repo} image"))
}

#[test]
fn the_e2e_images_are_built_run_and_imported() {
    let bins = ferry_e2e::bin_dir().unwrap();
    if prerequisites_missing(&bins) {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("ferry-images-")
        .tempdir()
        .unwrap();
    let mut opts = image::Options::new(&bins, &["e2e", "e2e-next"], &dir.path().join("a"));
    if !opts.tools.join("csi-provisioner").is_file() && missing("csi-provisioner is not built") {
        return;
    }
    let images = image::build_all(&opts).unwrap();
    assert_eq!(images.len(), 4);

    // Every archive is a valid OCI layout naming what build_all says.
    for i in &images {
        let v = image::verify_archive(&i.archive).unwrap();
        assert_eq!(v.names, i.names);
        assert!(v.digests.iter().all(|d| *d == i.digest));
    }
    let ferry = find(&images, image::FERRY_REPO);
    assert_eq!(
        ferry.names,
        ["localhost/ferry:e2e", "localhost/ferry:e2e-next"]
    );

    // The binaries run inside the Ferry image: every library resolves there.
    for bin in ["ferry-node", "ferry-controller"] {
        let out = chroot(
            &ferry.rootfs,
            &[&format!("/usr/local/bin/{bin}"), "--version"],
        );
        assert!(out.starts_with(bin), "{out}");
    }
    let out = chroot(&ferry.rootfs, &["/usr/local/bin/ferry-fd-holder", "--help"]);
    assert!(out.contains("Usage"), "{out}");
    let out = chroot(&ferry.rootfs, &["/bin/fusermount3", "-V"]);
    assert!(out.contains("fusermount3 version"), "{out}");
    assert!(ferry.rootfs.join("etc/fuse.conf").is_file());
    let bundle = std::fs::read_to_string(ferry.rootfs.join("etc/ssl/certs/ca-certificates.crt"));
    assert!(bundle.unwrap().matches("BEGIN CERTIFICATE").count() > 100);
    let passwd = std::fs::read_to_string(ferry.rootfs.join("etc/passwd")).unwrap();
    assert!(passwd.contains(":65532:65532:"), "{passwd}");

    // The busybox image's applets: a checksum of known bytes, and the rest the scenarios use.
    let busybox = find(&images, image::BUSYBOX_REPO);
    let out = chroot(
        &busybox.rootfs,
        &[
            "/bin/sh",
            "-c",
            "printf abc > /tmp/f && sha256sum /tmp/f && cat /tmp/f >/dev/null; \
             ls /tmp && stat -c %s /tmp/f && id -u && touch /tmp/g && sleep 0 && dd --help 2>&1 | head -1",
        ],
    );
    assert!(
        out.starts_with(
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad  /tmp/f\n"
        ),
        "{out}"
    );
    assert!(out.contains("\n3\n0\n"), "{out}");

    // Built again elsewhere from the same inputs: the same digests.
    opts.out = dir.path().join("b");
    let again = image::build_all(&opts).unwrap();
    for (a, b) in images.iter().zip(&again) {
        assert_eq!((&a.names, &a.digest), (&b.names, &b.digest));
    }

    // Imported into a containerd of our own; the busybox image runs, the pause image exits 0
    // on SIGTERM as PID 1.
    let containerd = Containerd::start(&dir.path().join("containerd"));
    image::import(&images, &containerd.socket).unwrap();
    let ctr = |args: &[&str]| -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address")
            .arg(&containerd.socket)
            .args(["-n", "k8s.io"])
            .args(args);
        c
    };
    // `--cgroup=`: no cgroup (ctr's default, /k8s.io/<id>, would leave /k8s.io on the host).
    let out = run(&mut ctr(&[
        "run",
        "--rm",
        "--cgroup=",
        &busybox.names[0],
        "ferry-images-bb",
        "sh",
        "-c",
        "printf abc | sha256sum; id -u",
    ]));
    let out = String::from_utf8(out.stdout).unwrap();
    assert!(out.starts_with("ba7816bf"), "{out}");
    let pause = find(&images, image::PAUSE_REPO);
    let mut task = ctr(&[
        "run",
        "--rm",
        "--cgroup=",
        &pause.names[0],
        "ferry-images-pause",
    ])
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    // The trap is set once the shell has started its `sleep`: two processes in the task.
    loop {
        let ps = ctr(&["task", "ps", "ferry-images-pause"]).output().unwrap();
        if ps.status.success() && String::from_utf8_lossy(&ps.stdout).lines().count() >= 3 {
            break;
        }
        assert!(
            task.try_wait().unwrap().is_none(),
            "the pause task ended by itself"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    run(&mut ctr(&[
        "task",
        "kill",
        "-s",
        "SIGTERM",
        "ferry-images-pause",
    ]));
    let status = task.wait().unwrap();
    assert!(status.success(), "pause exited with {status} on SIGTERM");
}

/// containerd with its own root, state and socket under `dir` (no TCP, no CRI), killed on drop.
struct Containerd {
    socket: PathBuf,
    child: Child,
}

impl Containerd {
    fn start(dir: &Path) -> Containerd {
        std::fs::create_dir_all(dir).unwrap();
        let socket = dir.join("containerd.sock");
        let config = dir.join("config.toml");
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{sock}\"\n[ttrpc]\n  address = \"{sock}.ttrpc\"\n\
                 [debug]\n  address = \"\"\n[metrics]\n  address = \"\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\"]\n  disable_tcp_service = true\n",
                root = dir.join("root").display(),
                state = dir.join("state").display(),
                sock = socket.display(),
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut containerd = Containerd { socket, child };
        // Ready once `ctr version` answers on the socket.
        loop {
            let ok = Command::new("ctr")
                .arg("--address")
                .arg(&containerd.socket)
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                break;
            }
            if let Some(status) = containerd.child.try_wait().unwrap() {
                panic!(
                    "containerd exited with {status}: {}",
                    std::fs::read_to_string(dir.join("containerd.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        containerd
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}
