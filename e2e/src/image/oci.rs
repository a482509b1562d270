//! The OCI side of [`super`]: a root filesystem written as a deterministic one-layer image
//! (uncompressed layer tar, image config, manifest) in a content-addressed blob directory, the
//! OCI image archive (`oci-layout`, `index.json` with both name annotations, `blobs/sha256/…`)
//! that `ctr images import` reads, and [`verify_archive`], which checks one.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::{host_architecture, Image};

/// The `PATH` of Debian's images.
pub(super) const DEBIAN_PATH: &str =
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";

/// The parts of an image config the builders set.
pub(super) struct ImageConfig {
    pub(super) entrypoint: Vec<String>,
    pub(super) cmd: Vec<String>,
    pub(super) user: Option<String>,
}

/// Content-addressed blobs in `<out>/blobs/sha256`, shared by the images (busybox and pause share
/// their layer).
pub(super) struct Blobs {
    dir: PathBuf,
}

/// A blob's digest (`sha256:…`) and size.
#[derive(Clone, Debug)]
struct Blob {
    digest: String,
    size: u64,
}

impl Blobs {
    pub(super) fn new(dir: &Path) -> Result<Blobs> {
        fs::create_dir_all(dir)?;
        Ok(Blobs {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, digest: &str) -> PathBuf {
        self.dir.join(digest.trim_start_matches("sha256:"))
    }

    fn put(&self, bytes: &[u8]) -> Result<Blob> {
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(bytes)));
        fs::write(self.path(&digest), bytes)?;
        Ok(Blob {
            digest,
            size: bytes.len() as u64,
        })
    }

    /// Writes `root` as an uncompressed layer tar.
    fn put_layer(&self, root: &Path) -> Result<Blob> {
        let tmp = self.dir.join(".layer.tmp");
        let file = fs::File::create(&tmp)?;
        let mut hashed = HashingWriter::new(BufWriter::new(file));
        write_layer(root, &mut hashed)?;
        let (mut inner, digest, size) = hashed.finish();
        inner.flush()?;
        let digest = format!("sha256:{digest}");
        fs::rename(&tmp, self.path(&digest))?;
        Ok(Blob { digest, size })
    }
}

/// A writer that hashes and counts what passes through.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    size: u64,
}

impl<W: Write> HashingWriter<W> {
    fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
            size: 0,
        }
    }

    fn finish(self) -> (W, String, u64) {
        (self.inner, hex::encode(self.hasher.finalize()), self.size)
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A tar header as every entry gets it: owner root, mtime 0, the file's permission bits.
fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode & 0o7777);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(size);
    h
}

/// Writes the tree at `root` as a tar: each directory's entries sorted by name, a directory before
/// what it holds, mtime 0, the
/// owner of every entry root except what the tree gives another owner (the non-root user's home),
/// hard links as tar hard links. The same tree gives the same bytes.
pub fn write_layer<W: Write>(root: &Path, out: W) -> Result<()> {
    let mut tar = tar::Builder::new(out);
    let mut inodes: HashMap<(u64, u64), PathBuf> = HashMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut names: Vec<_> = fs::read_dir(root.join(&rel))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()?;
        names.sort();
        let mut dirs = Vec::new();
        for name in names {
            let path = rel.join(&name);
            let host = root.join(&path);
            let meta = fs::symlink_metadata(&host)?;
            let ft = meta.file_type();
            let mode = meta.permissions().mode();
            let owned = |mut h: tar::Header| {
                // Files unpacked by an unprivileged user belong to them: only the ids the builder
                // set on purpose (65532) are kept.
                if meta.uid() == 65532 {
                    h.set_uid(65532);
                    h.set_gid(65532);
                }
                h
            };
            if ft.is_dir() {
                let mut h = owned(header(tar::EntryType::Directory, mode, 0));
                tar.append_data(&mut h, &path, io::empty())?;
                dirs.push(path);
            } else if ft.is_symlink() {
                let mut h = owned(header(tar::EntryType::Symlink, 0o777, 0));
                tar.append_link(&mut h, &path, fs::read_link(&host)?)?;
            } else if ft.is_file() {
                if meta.nlink() > 1 {
                    if let Some(first) = inodes.get(&(meta.dev(), meta.ino())) {
                        let mut h = owned(header(tar::EntryType::Link, mode, 0));
                        tar.append_link(&mut h, &path, first)?;
                        continue;
                    }
                    inodes.insert((meta.dev(), meta.ino()), path.clone());
                }
                let mut h = owned(header(tar::EntryType::Regular, mode, meta.len()));
                tar.append_data(&mut h, &path, fs::File::open(&host)?)?;
            } else {
                bail!(
                    "{} is neither a file, a directory nor a link",
                    host.display()
                );
            }
        }
        // A directory's entry always comes before what it holds; the subdirectories are listed
        // next, first name first.
        stack.extend(dirs.into_iter().rev());
    }
    tar.into_inner()?.flush()?;
    Ok(())
}

/// Writes one image (one layer from `root`) into `blobs` and an OCI archive at `archive` naming it
/// `names`.
pub(super) fn write_image(
    blobs: &Blobs,
    root: &Path,
    config: &ImageConfig,
    names: &[String],
    archive: &Path,
) -> Result<Image> {
    let layer = blobs.put_layer(root)?;
    let arch = host_architecture();
    let mut cfg = json!({
        "Env": [DEBIAN_PATH],
        "WorkingDir": "/",
    });
    if !config.entrypoint.is_empty() {
        cfg["Entrypoint"] = json!(config.entrypoint);
    }
    if !config.cmd.is_empty() {
        cfg["Cmd"] = json!(config.cmd);
    }
    if let Some(user) = &config.user {
        cfg["User"] = json!(user);
    }
    let image_config = json!({
        "architecture": arch,
        "os": "linux",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": [layer.digest]},
        "history": [{"created_by": "ferry-harness images (e2e/src/image.rs)"}],
    });
    let config_blob = blobs.put(&serde_json::to_vec(&image_config)?)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": descriptor(MEDIA_CONFIG, &config_blob),
        "layers": [descriptor(MEDIA_LAYER, &layer)],
    });
    let manifest_blob = blobs.put(&serde_json::to_vec(&manifest)?)?;
    let manifests: Vec<Value> = names
        .iter()
        .map(|name| {
            let mut d = descriptor(MEDIA_MANIFEST, &manifest_blob);
            d["platform"] = json!({"architecture": arch, "os": "linux"});
            let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
            d["annotations"] = json!({
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": tag,
            });
            d
        })
        .collect();
    let index = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": manifests,
    });
    let mut files: BTreeMap<String, Source> = BTreeMap::new();
    files.insert(
        "oci-layout".into(),
        Source::Bytes(br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
    );
    files.insert(
        "index.json".into(),
        Source::Bytes(serde_json::to_vec(&index)?),
    );
    for blob in [&layer, &config_blob, &manifest_blob] {
        files.insert(
            format!("blobs/sha256/{}", blob.digest.trim_start_matches("sha256:")),
            Source::File(blobs.path(&blob.digest)),
        );
    }
    write_archive(archive, &files)?;
    Ok(Image {
        names: names.to_vec(),
        archive: archive.to_path_buf(),
        rootfs: root.to_path_buf(),
        digest: manifest_blob.digest,
        config_digest: config_blob.digest,
        layer_size: layer.size,
    })
}

fn descriptor(media_type: &str, blob: &Blob) -> Value {
    json!({"mediaType": media_type, "digest": blob.digest, "size": blob.size})
}

enum Source {
    Bytes(Vec<u8>),
    File(PathBuf),
}

/// The OCI layout as a tar: `oci-layout`, `index.json`, `blobs/sha256/…`, sorted, mtime 0.
fn write_archive(path: &Path, files: &BTreeMap<String, Source>) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut tar = tar::Builder::new(BufWriter::new(fs::File::create(&tmp)?));
    for dir in ["blobs/", "blobs/sha256/"] {
        tar.append_data(
            &mut header(tar::EntryType::Directory, 0o755, 0),
            dir,
            io::empty(),
        )?;
    }
    for (name, source) in files {
        match source {
            Source::Bytes(b) => {
                let mut h = header(tar::EntryType::Regular, 0o644, b.len() as u64);
                tar.append_data(&mut h, name, &b[..])?;
            }
            Source::File(p) => {
                let f = fs::File::open(p)?;
                let mut h = header(tar::EntryType::Regular, 0o644, f.metadata()?.len());
                tar.append_data(&mut h, name, f)?;
            }
        }
    }
    tar.into_inner()?.flush()?;
    fs::rename(&tmp, path)?;
    Ok(())
}

/// What [`verify_archive`] found in a valid archive.
#[derive(Debug)]
pub struct Verified {
    /// `io.containerd.image.name` of each index entry.
    pub names: Vec<String>,
    /// The manifest digest of each index entry.
    pub digests: Vec<String>,
    /// The image config of the first entry.
    pub config: Value,
    /// The layer of the first entry (uncompressed tar).
    pub layer: Vec<u8>,
}

/// Reads an OCI image archive and checks it: `oci-layout`, index → manifest → config → layers,
/// every blob's sha256 and size as its descriptor says, `rootfs.diff_ids` the layers' digests,
/// both name annotations on every index entry, the platform the config's.
pub fn verify_archive(path: &Path) -> Result<Verified> {
    let mut files: HashMap<String, Vec<u8>> = HashMap::new();
    let mut tar = tar::Archive::new(fs::File::open(path)?);
    for entry in tar.entries()? {
        let mut entry = entry?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = entry.path()?.to_string_lossy().into_owned();
        let mut data = Vec::new();
        entry.read_to_end(&mut data)?;
        files.insert(name, data);
    }
    let layout: Value = serde_json::from_slice(files.get("oci-layout").context("no oci-layout")?)?;
    if layout["imageLayoutVersion"] != "1.0.0" {
        bail!("oci-layout says {layout}");
    }
    let blob = |d: &Value| -> Result<&Vec<u8>> {
        let digest = d["digest"]
            .as_str()
            .context("a descriptor without digest")?;
        let hex_digest = digest
            .strip_prefix("sha256:")
            .with_context(|| format!("{digest} is not sha256"))?;
        let data = files
            .get(&format!("blobs/sha256/{hex_digest}"))
            .with_context(|| format!("blob {digest} is missing"))?;
        if hex::encode(Sha256::digest(data)) != hex_digest {
            bail!("blob {digest} does not hash to its name");
        }
        if d["size"].as_u64() != Some(data.len() as u64) {
            bail!(
                "blob {digest} is {} bytes, its descriptor says {}",
                data.len(),
                d["size"]
            );
        }
        Ok(data)
    };
    let index: Value = serde_json::from_slice(files.get("index.json").context("no index.json")?)?;
    if index["schemaVersion"] != 2 {
        bail!("index.json schemaVersion is {}", index["schemaVersion"]);
    }
    let entries = index["manifests"]
        .as_array()
        .context("index has no manifests")?;
    if entries.is_empty() {
        bail!("index has no manifests");
    }
    let mut verified = Verified {
        names: Vec::new(),
        digests: Vec::new(),
        config: Value::Null,
        layer: Vec::new(),
    };
    for entry in entries {
        let name = entry["annotations"]["io.containerd.image.name"]
            .as_str()
            .context("an index entry has no io.containerd.image.name")?;
        let reference = entry["annotations"]["org.opencontainers.image.ref.name"]
            .as_str()
            .context("an index entry has no org.opencontainers.image.ref.name")?;
        if !name.ends_with(&format!(":{reference}")) {
            bail!("{name}'s ref.name is {reference}");
        }
        if entry["mediaType"] != MEDIA_MANIFEST {
            bail!("{name} is a {}", entry["mediaType"]);
        }
        let manifest: Value = serde_json::from_slice(blob(entry)?)?;
        if manifest["mediaType"] != MEDIA_MANIFEST
            || manifest["config"]["mediaType"] != MEDIA_CONFIG
        {
            bail!("{name}: unexpected media types in {manifest}");
        }
        let config: Value = serde_json::from_slice(blob(&manifest["config"])?)?;
        if entry["platform"]["architecture"] != config["architecture"]
            || entry["platform"]["os"] != config["os"]
        {
            bail!("{name}: the index's platform is not the config's");
        }
        let layers = manifest["layers"].as_array().context("no layers")?;
        let diff_ids = config["rootfs"]["diff_ids"]
            .as_array()
            .context("no diff_ids")?;
        if layers.len() != diff_ids.len() {
            bail!(
                "{name}: {} layers, {} diff_ids",
                layers.len(),
                diff_ids.len()
            );
        }
        for (layer, diff_id) in layers.iter().zip(diff_ids) {
            if layer["mediaType"] != MEDIA_LAYER {
                bail!("{name}: a layer of type {}", layer["mediaType"]);
            }
            let data = blob(layer)?;
            // Uncompressed layers: the diff_id is the blob's own digest.
            if format!("sha256:{}", hex::encode(Sha256::digest(data))) != *diff_id {
                bail!("{name}: diff_id {diff_id} is not the layer's digest");
            }
            if verified.layer.is_empty() {
                verified.layer = data.clone();
            }
        }
        if verified.config.is_null() {
            verified.config = config;
        }
        verified.names.push(name.to_string());
        verified
            .digests
            .push(entry["digest"].as_str().unwrap_or_default().to_string());
    }
    Ok(verified)
}

/// The relative paths in a layer tar, in order (for tests and diagnostics).
pub fn layer_paths(layer: &[u8]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for entry in tar::Archive::new(layer).entries()? {
        let entry = entry?;
        let path = entry.path()?;
        let clean: PathBuf = path
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect();
        out.push(clean.display().to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small tree with what a root filesystem holds: directories, a setuid program, `/tmp`,
    /// an absolute and a relative link, a hard link, a name longer than a tar header's 100 bytes.
    fn sample_root(root: &Path) {
        let long = "d".repeat(60);
        fs::create_dir_all(root.join(format!("usr/lib/{long}/{long}"))).unwrap();
        fs::write(root.join(format!("usr/lib/{long}/{long}/libx.so")), b"lib").unwrap();
        fs::create_dir_all(root.join("usr/bin")).unwrap();
        fs::write(root.join("usr/bin/prog"), b"#!/bin/sh\n").unwrap();
        fs::set_permissions(
            root.join("usr/bin/prog"),
            fs::Permissions::from_mode(0o4755),
        )
        .unwrap();
        fs::hard_link(root.join("usr/bin/prog"), root.join("usr/bin/prog2")).unwrap();
        std::os::unix::fs::symlink("usr/bin", root.join("bin")).unwrap();
        std::os::unix::fs::symlink("/usr/bin/prog", root.join("usr/bin/abs")).unwrap();
        fs::create_dir(root.join("tmp")).unwrap();
        fs::set_permissions(root.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    }

    #[test]
    fn an_archive_is_a_valid_oci_layout_and_the_same_inputs_give_the_same_digests() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        sample_root(&root);
        let config = ImageConfig {
            entrypoint: vec!["/usr/bin/prog".into()],
            cmd: vec!["a".into()],
            user: Some("65532:65532".into()),
        };
        let names = ["localhost/x:one".to_string(), "localhost/x:two".to_string()];
        let mut digests = Vec::new();
        for run in ["a", "b"] {
            let out = dir.path().join(run);
            let blobs = Blobs::new(&out.join("blobs/sha256")).unwrap();
            let image = write_image(&blobs, &root, &config, &names, &out.join("x.tar")).unwrap();
            let verified = verify_archive(&image.archive).unwrap();
            assert_eq!(verified.names, names);
            assert_eq!(
                verified.digests,
                [image.digest.clone(), image.digest.clone()]
            );
            let c = &verified.config;
            assert_eq!(c["architecture"], host_architecture());
            assert_eq!(c["os"], "linux");
            assert_eq!(c["config"]["Entrypoint"], json!(["/usr/bin/prog"]));
            assert_eq!(c["config"]["Cmd"], json!(["a"]));
            assert_eq!(c["config"]["User"], "65532:65532");
            assert_eq!(c["config"]["Env"], json!([DEBIAN_PATH]));
            let mut entries = Vec::new();
            for e in tar::Archive::new(&verified.layer[..]).entries().unwrap() {
                let e = e.unwrap();
                let h = e.header();
                entries.push((
                    e.path().unwrap().display().to_string(),
                    h.entry_type(),
                    h.mode().unwrap(),
                    h.mtime().unwrap(),
                    h.uid().unwrap(),
                ));
            }
            let paths: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
            let long = "d".repeat(60);
            assert_eq!(
                paths,
                [
                    "bin",
                    "tmp",
                    "usr",
                    "usr/bin",
                    "usr/lib",
                    "usr/bin/abs",
                    "usr/bin/prog",
                    "usr/bin/prog2",
                    &format!("usr/lib/{long}"),
                    &format!("usr/lib/{long}/{long}"),
                    &format!("usr/lib/{long}/{long}/libx.so"),
                ]
                .map(|p| p.to_string()),
                "a directory's entries sorted, then its subdirectories' in order"
            );
            assert!(entries.iter().all(|e| e.3 == 0 && e.4 == 0), "{entries:?}");
            let kind = |p: &str| entries.iter().find(|e| e.0 == p).unwrap();
            assert_eq!(kind("tmp").2, 0o1777);
            assert_eq!(kind("usr/bin/prog").2, 0o4755);
            assert_eq!(kind("usr/bin/prog2").1, tar::EntryType::Link);
            assert_eq!(kind("bin").1, tar::EntryType::Symlink);
            digests.push(fs::read(&image.archive).unwrap());
        }
        assert!(digests[0] == digests[1], "two builds of one tree differ");

        // A blob that does not hash to its name is refused.
        let out = dir.path().join("a");
        let bad = dir.path().join("bad.tar");
        let mut builder = tar::Builder::new(fs::File::create(&bad).unwrap());
        for e in tar::Archive::new(fs::File::open(out.join("x.tar")).unwrap())
            .entries()
            .unwrap()
        {
            let mut e = e.unwrap();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            let mut h = e.header().clone();
            if e.path().unwrap().starts_with("blobs/sha256") && h.entry_type().is_file() {
                data[0] ^= 1;
            }
            builder
                .append_data(&mut h, e.path().unwrap(), &data[..])
                .unwrap();
        }
        builder.into_inner().unwrap();
        assert!(verify_archive(&bad).is_err());
    }
}
