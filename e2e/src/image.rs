//! Container images without a Docker daemon, for the Kubernetes e2e on a real kubelet + containerd:
//! root filesystems unpacked from the host's Debian packages (`apt-get download`, `dpkg-deb -x`),
//! each written as a one-layer OCI image archive that `ctr images import` reads.
//!
//! * `localhost/ferry:<tag>`: the Dockerfile's runtime stage — Ferry's three binaries in
//!   `/usr/local/bin`, the packages its `apt-get install` names (read out of the `Dockerfile`, so
//!   the two cannot drift) and the base it relies on from `debian:*-slim` (glibc, libgcc), of the
//!   **host's** release: the binaries are built here and linked against the host's glibc.
//! * `localhost/csi-provisioner:v6.3.0`: the static binary from `$FERRY_TOOLS`, `/csi-provisioner`.
//! * `localhost/ferry-e2e-busybox:<version>` (test pods) and `localhost/ferry-e2e-pause:<version>`
//!   (containerd's `sandbox_image`), both on one layer from Debian's `busybox-static`.
//!
//! Every image is checked before it is written: each shared library its programs need (ELF
//! `PT_INTERP` and `DT_NEEDED`, transitively) must resolve inside its root filesystem. The archives
//! are deterministic (sorted entries, mtime 0, owner root): the same inputs give the same digests.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

mod oci;
pub use oci::{layer_paths, verify_archive, write_layer, Verified};
use oci::{write_image, Blobs, ImageConfig};

/// The image the chart's controller and node plugin run.
pub const FERRY_REPO: &str = "localhost/ferry";
/// The csi-provisioner image and its version (the binary `scripts/kube-tools.sh` builds).
pub const CSI_PROVISIONER_REPO: &str = "localhost/csi-provisioner";
pub const CSI_PROVISIONER_VERSION: &str = "v6.3.0";
/// Test pods' image (busybox applets) and the pod sandbox image.
pub const BUSYBOX_REPO: &str = "localhost/ferry-e2e-busybox";
pub const PAUSE_REPO: &str = "localhost/ferry-e2e-pause";

/// Ferry's binaries, as the Dockerfile copies them into `/usr/local/bin`.
pub const FERRY_BINARIES: [&str; 3] = ["ferry-controller", "ferry-node", "ferry-fd-holder"];

/// What `debian:<release>-slim` gives the Dockerfile's runtime stage that Ferry needs, on top of
/// the packages its `apt-get install` names: glibc and libgcc (the binaries' shared libraries) and
/// libfuse3 (fuse3's dependency, for `fusermount3`). Everything else in the slim image (a shell,
/// coreutils, dpkg, apt) is left out; the library check below proves nothing needs it.
pub const FERRY_BASE_PACKAGES: [&str; 3] = ["libc6", "libgcc-s1", "libfuse3-3"];

/// The pause program: PID 1 of a pod sandbox, where signals without a handler are ignored, so it
/// traps SIGTERM and SIGINT and exits 0 on them (`wait` returns as soon as a trapped signal comes).
const PAUSE_SCRIPT: &str =
    "trap 'exit 0' TERM INT; while true; do sleep 86400 & wait $!; kill $! 2>/dev/null; done";

/// What to build and where.
#[derive(Clone, Debug)]
pub struct Options {
    /// The directory holding `ferry-controller`, `ferry-node` and `ferry-fd-holder` (e.g. `target/debug`).
    pub bins: PathBuf,
    /// Tags of the Ferry image; every one is a name in its archive (the e2e rolls the node
    /// DaemonSet from the first to a second). At least one.
    pub tags: Vec<String>,
    /// Where the archives, blobs and root filesystems go.
    pub out: PathBuf,
    /// The directory holding the `csi-provisioner` binary (`$FERRY_TOOLS`).
    pub tools: PathBuf,
    /// Where downloaded `.deb` files are kept, one directory per release (re-used when present).
    pub deb_cache: PathBuf,
    /// The Dockerfile whose runtime stage the Ferry image reproduces.
    pub dockerfile: PathBuf,
}

impl Options {
    /// The defaults: the repository's Dockerfile, `$FERRY_TOOLS` (else
    /// `$HOME/.cache/ferry-tools/bin`) and `$HOME/.cache/ferry-tools/debs`.
    pub fn new(bins: &Path, tags: &[&str], out: &Path) -> Options {
        let cache = Path::new(&std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
            .join(".cache/ferry-tools");
        Options {
            bins: bins.to_path_buf(),
            tags: tags.iter().map(|t| t.to_string()).collect(),
            out: out.to_path_buf(),
            tools: std::env::var_os("FERRY_TOOLS")
                .map(PathBuf::from)
                .unwrap_or_else(|| cache.join("bin")),
            deb_cache: cache.join("debs"),
            dockerfile: Path::new(env!("CARGO_MANIFEST_DIR")).join("../Dockerfile"),
        }
    }
}

/// One image written as an OCI archive.
#[derive(Clone, Debug)]
pub struct Image {
    /// Full names (`localhost/ferry:e2e`), all pointing at the same manifest.
    pub names: Vec<String>,
    /// The OCI image archive (`ctr images import` input).
    pub archive: PathBuf,
    /// The unpacked root filesystem the layer was made from.
    pub rootfs: PathBuf,
    /// `sha256:…` of the manifest: the image's digest in containerd.
    pub digest: String,
    /// `sha256:…` of the image config: the image id kubelet and `crictl` show.
    pub config_digest: String,
    /// Size of the (uncompressed) layer in bytes.
    pub layer_size: u64,
}

/// Builds the four images (Ferry, csi-provisioner, busybox, pause) into `opts.out`.
pub fn build_all(opts: &Options) -> Result<Vec<Image>> {
    if opts.tags.is_empty() {
        bail!("the Ferry image needs at least one tag");
    }
    fs::create_dir_all(&opts.out)?;
    let release = host_release()?;
    let debs = DebCache::new(opts.deb_cache.join(&release));
    let blobs = Blobs::new(&opts.out.join("blobs/sha256"))?;
    Ok(vec![
        build_ferry(opts, &debs, &blobs)?,
        build_csi_provisioner(opts, &blobs)?,
    ]
    .into_iter()
    .chain(build_busybox_and_pause(opts, &debs, &blobs)?)
    .collect())
}

/// Runs `ctr --address ADDRESS -n k8s.io images import --all-platforms` on each archive, then
/// checks that `ctr images ls` lists every name.
pub fn import(images: &[Image], address: &Path) -> Result<()> {
    let ctr = |args: &[&str]| -> Result<String> {
        let out = Command::new("ctr")
            .arg("--address")
            .arg(address)
            .args(["-n", "k8s.io"])
            .args(args)
            .output()
            .context("running ctr (containerd's client)")?;
        if !out.status.success() {
            bail!(
                "ctr {} failed with {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    for image in images {
        let archive = image.archive.display().to_string();
        ctr(&["images", "import", "--all-platforms", &archive])?;
    }
    let listed = ctr(&["images", "ls", "-q"])?;
    let listed: BTreeSet<&str> = listed.lines().map(str::trim).collect();
    for name in images.iter().flat_map(|i| &i.names) {
        if !listed.contains(name.as_str()) {
            bail!("{name} was imported but `ctr images ls` does not list it");
        }
    }
    Ok(())
}

fn build_ferry(opts: &Options, debs: &DebCache, blobs: &Blobs) -> Result<Image> {
    let dockerfile = fs::read_to_string(&opts.dockerfile)
        .with_context(|| format!("reading {}", opts.dockerfile.display()))?;
    let packages = ferry_packages(&dockerfile)?;
    let root = Rootfs::create(&opts.out.join("rootfs/ferry"))?;
    for pkg in &packages {
        root.unpack(&debs.get(pkg)?)?;
    }
    root.merged_usr_links()?;
    root.base_files()?;
    ca_bundle(&root.dir)?;
    for bin in FERRY_BINARIES {
        let src = opts.bins.join(bin);
        if !src.is_file() {
            bail!(
                "{} not found: build it first (cargo build -p ferry-controller -p ferry-node -p ferry-holder)",
                src.display()
            );
        }
        root.copy(&src, &format!("usr/local/bin/{bin}"), 0o755)?;
    }
    let mut programs: Vec<String> = FERRY_BINARIES
        .iter()
        .map(|b| format!("/usr/local/bin/{b}"))
        .collect();
    let fusermount = find_in_root(&root.dir, "fusermount3", &["/usr/bin", "/bin"])?;
    // fuse3's postinst makes it setuid root (for mounts by users); dpkg-deb -x runs no postinst.
    let host = resolve_in_root(&root.dir, &fusermount).expect("found above");
    fs::set_permissions(host, fs::Permissions::from_mode(0o4755))?;
    programs.push(fusermount);
    check_libraries(&root.dir, &programs)?;
    if !root.dir.join("etc/ssl/certs/ca-certificates.crt").is_file() {
        bail!("the Ferry image has no /etc/ssl/certs/ca-certificates.crt");
    }
    let config = ImageConfig {
        entrypoint: vec![],
        cmd: vec!["ferry-node".into(), "--help".into()],
        user: None,
    };
    let names: Vec<String> = opts
        .tags
        .iter()
        .map(|t| format!("{FERRY_REPO}:{t}"))
        .collect();
    write_image(
        blobs,
        &root.dir,
        &config,
        &names,
        &opts.out.join("ferry.oci.tar"),
    )
}

fn build_csi_provisioner(opts: &Options, blobs: &Blobs) -> Result<Image> {
    let src = opts.tools.join("csi-provisioner");
    if !src.is_file() {
        bail!(
            "{} not found: build it with scripts/kube-tools.sh (or set FERRY_TOOLS)",
            src.display()
        );
    }
    let root = Rootfs::create(&opts.out.join("rootfs/csi-provisioner"))?;
    root.base_files()?;
    root.copy(&src, "csi-provisioner", 0o755)?;
    check_libraries(&root.dir, &["/csi-provisioner".into()])?;
    let config = ImageConfig {
        entrypoint: vec!["/csi-provisioner".into()],
        cmd: vec![],
        user: None,
    };
    let name = format!("{CSI_PROVISIONER_REPO}:{CSI_PROVISIONER_VERSION}");
    write_image(
        blobs,
        &root.dir,
        &config,
        &[name],
        &opts.out.join("csi-provisioner.oci.tar"),
    )
}

fn build_busybox_and_pause(opts: &Options, debs: &DebCache, blobs: &Blobs) -> Result<Vec<Image>> {
    let deb = debs.get("busybox-static")?;
    let version = tag_of_version(&deb_version(&deb)?);
    let root = Rootfs::create(&opts.out.join("rootfs/busybox"))?;
    root.unpack(&deb)?;
    root.merged_usr_links()?;
    root.base_files()?;
    let busybox = find_in_root(&root.dir, "busybox", &["/usr/bin", "/bin"])?;
    // The applet links `busybox --install` would make, from the binary's own list (it is static,
    // so it runs here as it does in the image).
    let list = Command::new(root.dir.join(busybox.trim_start_matches('/')))
        .arg("--list-full")
        .output()
        .context("running busybox --list-full")?;
    if !list.status.success() {
        bail!("busybox --list-full failed: {}", list.status);
    }
    for applet in String::from_utf8(list.stdout)?.lines() {
        let link = root.dir.join(applet);
        if fs::symlink_metadata(&link).is_err() {
            fs::create_dir_all(link.parent().expect("an applet path has a directory"))?;
            std::os::unix::fs::symlink(&busybox, &link)?;
        }
    }
    check_libraries(&root.dir, std::slice::from_ref(&busybox))?;
    let shell = ImageConfig {
        entrypoint: vec![],
        cmd: vec!["sh".into()],
        user: None,
    };
    let pause = ImageConfig {
        entrypoint: vec![busybox, "sh".into(), "-c".into(), PAUSE_SCRIPT.into()],
        cmd: vec![],
        user: Some("65532:65532".into()),
    };
    Ok(vec![
        write_image(
            blobs,
            &root.dir,
            &shell,
            &[format!("{BUSYBOX_REPO}:{version}")],
            &opts.out.join("busybox.oci.tar"),
        )?,
        write_image(
            blobs,
            &root.dir,
            &pause,
            &[format!("{PAUSE_REPO}:{version}")],
            &opts.out.join("pause.oci.tar"),
        )?,
    ])
}

/// The Ferry image's packages: [`FERRY_BASE_PACKAGES`] and the runtime stage's `apt-get install`.
pub fn ferry_packages(dockerfile: &str) -> Result<Vec<String>> {
    let mut packages: Vec<String> = FERRY_BASE_PACKAGES.iter().map(|p| p.to_string()).collect();
    packages.extend(runtime_stage_packages(dockerfile)?);
    Ok(packages)
}

/// The packages the last stage of a Dockerfile installs with `apt-get install`.
pub fn runtime_stage_packages(dockerfile: &str) -> Result<Vec<String>> {
    // Logical lines: comments dropped, `\` continuations joined.
    let mut lines = Vec::new();
    let mut current = String::new();
    for line in dockerfile.lines() {
        if line.trim_start().starts_with('#') {
            continue;
        }
        match line.trim_end().strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                lines.push(std::mem::take(&mut current));
            }
        }
    }
    let stage = lines
        .iter()
        .rposition(|l| l.trim_start().to_ascii_uppercase().starts_with("FROM "))
        .context("the Dockerfile has no FROM")?;
    let mut packages = Vec::new();
    for line in &lines[stage..] {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first().map(|w| w.to_ascii_uppercase()) != Some("RUN".into()) {
            continue;
        }
        for (i, pair) in words.windows(2).enumerate() {
            if pair[0].ends_with("apt-get") && pair[1] == "install" {
                packages.extend(
                    words[i + 2..]
                        .iter()
                        .take_while(|w| !matches!(**w, "&&" | "||" | ";"))
                        .filter(|w| !w.starts_with('-'))
                        .map(|w| w.to_string()),
                );
            }
        }
    }
    if packages.is_empty() {
        bail!("the Dockerfile's last stage installs no package with apt-get install");
    }
    Ok(packages)
}

/// The host's Debian release (`VERSION_CODENAME` of `/etc/os-release`): `apt-get download` fetches
/// from the host's sources, and the binaries are linked against the host's glibc.
pub fn host_release() -> Result<String> {
    let text = fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim_matches('"').to_string())
        .filter(|v| !v.is_empty())
        .context("/etc/os-release names no VERSION_CODENAME (is this Debian?)")
}

/// The OCI architecture of this host.
pub fn host_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "arm" => "arm",
        other => other,
    }
}

/// `.deb` files of one release, downloaded with `apt-get download` on first use and kept.
struct DebCache {
    dir: PathBuf,
}

impl DebCache {
    fn new(dir: PathBuf) -> DebCache {
        DebCache { dir }
    }

    /// The cached `.deb` of `package`, downloaded when there is none.
    fn get(&self, package: &str) -> Result<PathBuf> {
        if let Some(deb) = self.cached(package)? {
            return Ok(deb);
        }
        fs::create_dir_all(&self.dir)?;
        let out = Command::new("apt-get")
            .args(["download", "-q", package])
            .current_dir(&self.dir)
            .output()
            .context("running apt-get download")?;
        if !out.status.success() {
            bail!(
                "apt-get download {package} failed ({}); is the apt mirror reachable and `apt-get update` done? {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        self.cached(package)?.with_context(|| {
            format!(
                "apt-get download {package} left no .deb in {}",
                self.dir.display()
            )
        })
    }

    fn cached(&self, package: &str) -> Result<Option<PathBuf>> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Ok(None);
        };
        let prefix = format!("{package}_");
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
            })
            .collect();
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => bail!(
                "{} holds several versions of {package}: remove the stale ones",
                self.dir.display()
            ),
        }
    }
}

/// The version in a `.deb`'s file name (`busybox-static_1%3a1.35.0-4_amd64.deb` → `1:1.35.0-4`).
fn deb_version(deb: &Path) -> Result<String> {
    let name = deb.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let version = name
        .split('_')
        .nth(1)
        .with_context(|| format!("{name} is not named package_version_arch.deb"))?;
    Ok(version.replace("%3a", ":"))
}

/// A Debian version as an image tag: no epoch, and `+`, `~` and `:` (not allowed in a tag) as `_`.
pub fn tag_of_version(version: &str) -> String {
    let version = version.split_once(':').map_or(version, |(_, v)| v);
    version
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A root filesystem being assembled in a directory.
struct Rootfs {
    dir: PathBuf,
}

impl Rootfs {
    /// An empty directory at `dir` (whatever was there is removed).
    fn create(dir: &Path) -> Result<Rootfs> {
        if dir.exists() {
            fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        fs::create_dir_all(dir)?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
        Ok(Rootfs {
            dir: dir.to_path_buf(),
        })
    }

    fn unpack(&self, deb: &Path) -> Result<()> {
        let status = Command::new("dpkg-deb")
            .arg("-x")
            .arg(deb)
            .arg(&self.dir)
            .status()
            .context("running dpkg-deb (is dpkg installed?)")?;
        if !status.success() {
            bail!("dpkg-deb -x {} failed: {status}", deb.display());
        }
        Ok(())
    }

    /// `/bin`, `/sbin`, `/lib`, `/lib64` as links into `/usr` where the packages put nothing
    /// there (releases from trixie on ship files under `/usr` only; base-files makes the links,
    /// and `PT_INTERP` still says `/lib64/ld-linux-x86-64.so.2`).
    fn merged_usr_links(&self) -> Result<()> {
        for dir in ["bin", "sbin", "lib", "lib64"] {
            let link = self.dir.join(dir);
            if fs::symlink_metadata(&link).is_err() && self.dir.join("usr").join(dir).is_dir() {
                std::os::unix::fs::symlink(format!("usr/{dir}"), link)?;
            }
        }
        Ok(())
    }

    /// What every image has: root and the chart's non-root user (65532), mount points for the
    /// runtime, `/tmp`, and name-service defaults.
    fn base_files(&self) -> Result<()> {
        for (dir, mode) in [
            ("dev", 0o755),
            ("proc", 0o555),
            ("sys", 0o555),
            ("etc", 0o755),
            ("root", 0o700),
            ("home/nonroot", 0o755),
            ("tmp", 0o1777),
        ] {
            let path = self.dir.join(dir);
            fs::create_dir_all(&path)?;
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
        }
        std::os::unix::fs::chown(self.dir.join("home/nonroot"), Some(65532), Some(65532))?;
        self.write(
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
        )?;
        self.write("etc/group", "root:x:0:\nnonroot:x:65532:\n")?;
        self.write(
            "etc/nsswitch.conf",
            "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
        )
    }

    fn write(&self, path: &str, contents: &str) -> Result<()> {
        let dst = self.dir.join(path);
        fs::create_dir_all(dst.parent().expect("a file in the rootfs has a directory"))?;
        fs::write(&dst, contents)?;
        fs::set_permissions(&dst, fs::Permissions::from_mode(0o644))?;
        Ok(())
    }

    fn copy(&self, src: &Path, path: &str, mode: u32) -> Result<()> {
        let dst = self.dir.join(path);
        fs::create_dir_all(dst.parent().expect("a file in the rootfs has a directory"))?;
        fs::copy(src, &dst).with_context(|| format!("copying {}", src.display()))?;
        fs::set_permissions(&dst, fs::Permissions::from_mode(mode))?;
        Ok(())
    }
}

/// `/etc/ssl/certs/ca-certificates.crt` as `update-ca-certificates` (ca-certificates' postinst)
/// makes it with the default `/etc/ca-certificates.conf` (every certificate selected): the
/// package's `/usr/share/ca-certificates/*/*.crt` in the order of their sorted relative paths, each
/// with a trailing newline, plus one `<name>.pem` link per certificate. The OpenSSL hash links
/// (`c_rehash`) are left out: the binaries read the bundle.
pub fn ca_bundle(root: &Path) -> Result<()> {
    let share = root.join("usr/share/ca-certificates");
    let mut certs = Vec::new();
    for dir in fs::read_dir(&share).context("the ca-certificates package is not unpacked")? {
        let dir = dir?.path();
        for cert in fs::read_dir(&dir)? {
            let cert = cert?.path();
            if cert.extension().is_some_and(|e| e == "crt") {
                certs.push(cert.strip_prefix(&share)?.to_path_buf());
            }
        }
    }
    certs.sort();
    if certs.is_empty() {
        bail!("no certificate under {}", share.display());
    }
    let etc = root.join("etc/ssl/certs");
    fs::create_dir_all(&etc)?;
    let mut bundle = Vec::new();
    for cert in &certs {
        let mut pem = fs::read(share.join(cert))?;
        if !pem.ends_with(b"\n") {
            pem.push(b'\n');
        }
        bundle.extend_from_slice(&pem);
        let stem = cert
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let link: String = stem
            .chars()
            .map(|c| match c {
                ' ' | ',' => '_',
                '(' | ')' => '=',
                c => c,
            })
            .collect();
        let link = etc.join(format!("{link}.pem"));
        if fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(Path::new("/usr/share/ca-certificates").join(cert), link)?;
        }
    }
    let path = etc.join("ca-certificates.crt");
    fs::write(&path, bundle)?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644))?;
    Ok(())
}

/// The first of `dirs` (absolute, inside `root`) holding `name`, as an absolute in-image path.
fn find_in_root(root: &Path, name: &str, dirs: &[&str]) -> Result<String> {
    dirs.iter()
        .map(|d| format!("{d}/{name}"))
        .find(|p| resolve_in_root(root, p).is_some())
        .with_context(|| format!("{name} is not in the image (looked in {})", dirs.join(", ")))
}

/// Follows `path` (absolute, as the image sees it) inside `root`, symlinks included, to a file on
/// the host; `None` when it does not resolve.
pub fn resolve_in_root(root: &Path, path: &str) -> Option<PathBuf> {
    let mut pending: Vec<String> = path
        .split('/')
        .filter(|c| !c.is_empty())
        .rev()
        .map(str::to_string)
        .collect();
    let mut at: Vec<String> = Vec::new();
    let mut links = 0;
    while let Some(component) = pending.pop() {
        match component.as_str() {
            "." => continue,
            ".." => {
                at.pop();
                continue;
            }
            _ => {}
        }
        let host = at
            .iter()
            .fold(root.to_path_buf(), |p, c| p.join(c))
            .join(&component);
        let meta = fs::symlink_metadata(&host).ok()?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > 40 {
                return None;
            }
            let target = fs::read_link(&host).ok()?;
            let target = target.to_str()?;
            if target.starts_with('/') {
                at.clear();
            }
            pending.extend(
                target
                    .split('/')
                    .filter(|c| !c.is_empty())
                    .rev()
                    .map(str::to_string),
            );
        } else {
            at.push(component);
        }
    }
    let host = at.iter().fold(root.to_path_buf(), |p, c| p.join(c));
    host.exists().then_some(host)
}

/// Checks that every program in `programs` (absolute in-image paths) and every shared library they
/// need, transitively, resolves inside `root`: the `PT_INTERP` loader and each `DT_NEEDED` in the
/// `DT_RUNPATH`/`DT_RPATH` (with `$ORIGIN`), then the loader's default directories and those of
/// `/etc/ld.so.conf.d`. Fails naming the missing library and who needs it. Static programs pass.
pub fn check_libraries(root: &Path, programs: &[String]) -> Result<()> {
    let mut dirs: Vec<String> = Vec::new();
    let triplet = format!("{}-linux-gnu", std::env::consts::ARCH);
    if let Ok(entries) = fs::read_dir(root.join("etc/ld.so.conf.d")) {
        let mut confs: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        confs.sort();
        for conf in confs {
            let text = fs::read_to_string(conf).unwrap_or_default();
            dirs.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| l.starts_with('/'))
                    .map(str::to_string),
            );
        }
    }
    for d in [
        format!("/lib/{triplet}"),
        format!("/usr/lib/{triplet}"),
        "/lib64".into(),
        "/usr/lib64".into(),
        "/lib".into(),
        "/usr/lib".into(),
    ] {
        if !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    let mut seen = BTreeSet::new();
    let mut queue: Vec<(String, String)> = programs
        .iter()
        .map(|p| (p.clone(), "the image".to_string()))
        .collect();
    while let Some((path, needed_by)) = queue.pop() {
        if !seen.insert(path.clone()) {
            continue;
        }
        let host = resolve_in_root(root, &path)
            .with_context(|| format!("{path} (needed by {needed_by}) is not in the image"))?;
        let data = fs::read(&host).with_context(|| format!("reading {}", host.display()))?;
        let elf = elf_deps(&data).with_context(|| format!("{path} is not an ELF file"))?;
        if let Some(interp) = elf.interpreter {
            queue.push((interp, path.clone()));
        }
        let origin = Path::new(&path)
            .parent()
            .map_or("/".into(), |p| p.display().to_string());
        for lib in elf.needed {
            let search = elf
                .runpath
                .iter()
                .map(|d| d.replace("$ORIGIN", &origin).replace("${ORIGIN}", &origin))
                .chain(dirs.iter().cloned());
            let found = search
                .map(|d| format!("{}/{lib}", d.trim_end_matches('/')))
                .find(|p| resolve_in_root(root, p).is_some_and(|h| h.is_file()));
            match found {
                Some(p) => queue.push((p, path.clone())),
                None => bail!(
                    "the shared library {lib} (needed by {path}) is not in the image; looked in {}",
                    dirs.join(", ")
                ),
            }
        }
    }
    Ok(())
}

/// What a program needs from the dynamic loader.
struct ElfDeps {
    interpreter: Option<String>,
    needed: Vec<String>,
    runpath: Vec<String>,
}

fn elf_deps(data: &[u8]) -> Result<ElfDeps> {
    use object::elf;
    use object::read::elf::{Dyn, FileHeader, ProgramHeader};
    use object::Endianness;
    // Ferry's images are 64-bit; a 32-bit program is refused rather than checked wrongly.
    let header = elf::FileHeader64::<Endianness>::parse(data)?;
    let endian = header.endian()?;
    let mut interpreter = None;
    for ph in header.program_headers(endian, data)? {
        if let Some(interp) = ph.interpreter(endian, data)? {
            interpreter = Some(String::from_utf8_lossy(interp).into_owned());
        }
    }
    let sections = header.sections(endian, data)?;
    let (mut needed, mut runpath) = (Vec::new(), Vec::new());
    if let Some((dynamic, index)) = sections.dynamic(endian, data)? {
        let strings = sections.strings(endian, data, index)?;
        for d in dynamic {
            let tag = d.tag32(endian).map(i64::from);
            let name = || -> Result<String> {
                Ok(String::from_utf8_lossy(d.string(endian, strings)?).into_owned())
            };
            match tag {
                Some(elf::DT_NEEDED) => needed.push(name()?),
                Some(elf::DT_RUNPATH) | Some(elf::DT_RPATH) => {
                    runpath.extend(name()?.split(':').map(str::to_string))
                }
                _ => {}
            }
        }
    }
    Ok(ElfDeps {
        interpreter,
        needed,
        runpath,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_stage_packages_are_read_from_the_dockerfile() {
        let dockerfile = include_str!("../../Dockerfile");
        let packages = runtime_stage_packages(dockerfile).unwrap();
        assert_eq!(packages, ["fuse3", "ca-certificates"]);
        // The builder stage's packages (build-essential, cmake) are not the runtime's.
        let all = ferry_packages(dockerfile).unwrap();
        assert!(!all.iter().any(|p| p == "cmake"), "{all:?}");
        for base in FERRY_BASE_PACKAGES {
            assert!(all.iter().any(|p| p == base));
        }
    }

    #[test]
    fn a_dockerfile_without_apt_get_install_in_its_last_stage_is_refused() {
        let text = "FROM a AS b\nRUN apt-get install -y x\nFROM c\nCOPY --from=b /x /x\n";
        assert!(runtime_stage_packages(text).is_err());
        let text = "FROM c\nRUN apt-get update \\\n && apt-get install -y --no-install-recommends \\\n   p1 p2 \\\n && rm -rf x\n";
        assert_eq!(runtime_stage_packages(text).unwrap(), ["p1", "p2"]);
    }

    #[test]
    fn debian_versions_become_tags() {
        assert_eq!(
            tag_of_version("1:1.35.0-4+deb12u1+b1"),
            "1.35.0-4_deb12u1_b1"
        );
        assert_eq!(tag_of_version("20250419~deb12u2"), "20250419_deb12u2");
        assert_eq!(
            deb_version(Path::new("/x/busybox-static_1%3a1.35.0-4_amd64.deb")).unwrap(),
            "1:1.35.0-4"
        );
    }

    #[test]
    fn missing_libraries_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("bin")).unwrap();
        // This test binary is a dynamic ELF program: without its libraries it is refused, with
        // the first missing one named.
        let exe = std::env::current_exe().unwrap();
        fs::copy(&exe, root.join("bin/t")).unwrap();
        let err = check_libraries(root, &["/bin/t".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("needed by"), "{err}");
        assert!(err.contains(".so"), "{err}");
    }

    /// Run on the host's ca-certificates: the bundle built the way `ca_bundle` does from the
    /// host's `/usr/share/ca-certificates` is what the host's update-ca-certificates made (which
    /// appends `/usr/local/share/ca-certificates` after it).
    #[test]
    fn the_ca_bundle_is_built_as_update_ca_certificates_builds_it() {
        let host_bundle = Path::new("/etc/ssl/certs/ca-certificates.crt");
        let conf = fs::read_to_string("/etc/ca-certificates.conf").unwrap_or_default();
        if !host_bundle.exists() || conf.lines().any(|l| l.starts_with('!')) {
            eprintln!(
                "skipped: no host bundle, or certificates deselected in /etc/ca-certificates.conf"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let share = dir.path().join("usr/share/ca-certificates");
        for entry in fs::read_dir("/usr/share/ca-certificates").unwrap() {
            let entry = entry.unwrap().path();
            let dst = share.join(entry.file_name().unwrap());
            fs::create_dir_all(&dst).unwrap();
            for cert in fs::read_dir(&entry).unwrap() {
                let cert = cert.unwrap().path();
                fs::copy(&cert, dst.join(cert.file_name().unwrap())).unwrap();
            }
        }
        ca_bundle(dir.path()).unwrap();
        let ours = fs::read(dir.path().join("etc/ssl/certs/ca-certificates.crt")).unwrap();
        let host = fs::read(host_bundle).unwrap();
        assert!(ours.len() > 100_000);
        assert!(
            host.starts_with(&ours),
            "the host's bundle does not start with ours"
        );
    }

    #[test]
    fn paths_resolve_through_links_inside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("usr/lib/x")).unwrap();
        fs::write(root.join("usr/lib/x/libz.so.1.2"), b"").unwrap();
        std::os::unix::fs::symlink("usr/lib", root.join("lib")).unwrap();
        std::os::unix::fs::symlink("libz.so.1.2", root.join("usr/lib/x/libz.so.1")).unwrap();
        std::os::unix::fs::symlink("/usr/lib/x/libz.so.1", root.join("usr/lib/abs")).unwrap();
        std::os::unix::fs::symlink("../../../../../../etc", root.join("usr/escape")).unwrap();
        assert!(resolve_in_root(root, "/lib/x/libz.so.1").is_some());
        assert!(resolve_in_root(root, "/lib/abs").is_some());
        assert!(resolve_in_root(root, "/lib/x/libm.so.6").is_none());
        // `..` stops at the root, as in a chroot: the host's /etc/passwd is not the image's.
        assert!(resolve_in_root(root, "/usr/escape/passwd").is_none());
    }
}
