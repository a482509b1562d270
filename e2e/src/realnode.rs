//! The real-node e2e (`ferry-harness node`): Ferry installed with `helm install charts/ferry` on a
//! one-node cluster whose kubelet runs real pods, and pods reading and writing through PVCs.
//!
//! 1. versitygw on loopback; etcd, kube-apiserver, kube-controller-manager (PV binder, workload
//!    controllers, root-CA publisher) and kube-scheduler; containerd + runc + kubelet
//!    ([`crate::node::KubeNode`]), the node named `127.0.0.1`.
//! 2. Images built from this repository without a Docker daemon ([`crate::image`]) and imported
//!    into containerd: Ferry (twice, under two tags, for the rolling update), csi-provisioner, a
//!    busybox image for the test pods and the sandbox (pause) image.
//! 3. `helm install` of `charts/ferry` with its own ServiceAccounts and RBAC; only the image
//!    location and what this loopback-only node needs are set (see [`values`]). Waits for the
//!    CSINode to list the driver: kubelet registered Ferry through its built-in registration.
//! 4. Scenarios with real pods, every byte checked with sha256: a dynamic RWX PVC written by one
//!    pod and read by another, then deleted with `deletePolicy: delete`; a static ROX PV in
//!    Mountpoint's format (with v2-only attributes) read by 3 pods at once; an existing dataset
//!    through a dynamic PVC; pod-level identity (kubelet's token, STS on moto, EACCES for a role
//!    that may not read); a non-root pod with `fsGroup`; pod deletion ending the FUSE
//!    connection; kubelet restarted under a reading pod; the node DaemonSet rolled to a new image
//!    tag under a reading pod.
//!
//! Every wait has a deadline; nothing asserts on timing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use ferry_s3::S3Store;
use ferry_store::ObjectStore;
use ferry_testkit::kube::{KubeCluster, KubeClusterOptions};
use ferry_testkit::S3Server;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::kube::wait_for;
use crate::node::{KubeNode, KubeNodeOptions, NODE_NAME};

const BUCKET: &str = "ferry-node-e2e";
const RELEASE: &str = "ferry";
const SYSTEM_NS: &str = "ferry-system";
const NS: &str = "ml";
/// How long a pod may take to reach a final phase (image already imported; reads of a few MB).
const POD_TIMEOUT: Duration = Duration::from_secs(180);
/// How long the chart's pods may take to run and register.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(240);

fn say(s: &str) {
    println!("\x1b[1m==> {s}\x1b[0m");
}

/// What `ferry-harness node` was asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// The chart to install (default `charts/ferry` of this repository).
    pub chart: PathBuf,
    /// Where `ferry-controller`, `ferry-node` and `ferry-fd-holder` are (they go into the image).
    pub bins: PathBuf,
}

/// The images the e2e imports, by name.
struct Images {
    built: Vec<crate::image::Image>,
    /// `localhost/ferry:e2e`, what the chart is installed with.
    ferry: String,
    /// The same image as `localhost/ferry:e2e-next`, what the DaemonSet is rolled to.
    ferry_next: String,
    provisioner: String,
    busybox: String,
    pause: String,
}

impl Images {
    fn from(built: Vec<crate::image::Image>) -> Result<Images> {
        let name = |repo: &str, i: usize| -> Result<String> {
            built
                .iter()
                .flat_map(|b| b.names.iter())
                .filter(|n| n.starts_with(&format!("{repo}:")))
                .nth(i)
                .cloned()
                .with_context(|| format!("no image {repo} (number {i}) was built"))
        };
        Ok(Images {
            ferry: name(crate::image::FERRY_REPO, 0)?,
            ferry_next: name(crate::image::FERRY_REPO, 1)?,
            provisioner: name(crate::image::CSI_PROVISIONER_REPO, 0)?,
            busybox: name(crate::image::BUSYBOX_REPO, 0)?,
            pause: name(crate::image::PAUSE_REPO, 0)?,
            built,
        })
    }
}

/// Everything the scenarios share.
struct Env {
    kube: Client,
    s3: S3Store,
    s3_server: S3Server,
    /// S3 with IAM enforced and STS, for pod-level identity (scenario d).
    moto: ferry_testkit::MotoServer,
    moto_roles: std::collections::HashMap<String, String>,
    node: KubeNode,
    kubeconfig: PathBuf,
    chart: PathBuf,
    values: PathBuf,
    busybox: String,
}

/// Runs the whole real-node e2e.
pub async fn run(opts: Options) -> Result<()> {
    let started = Instant::now();
    say("building the images (no Docker daemon): ferry, csi-provisioner, busybox, pause");
    let t0 = Instant::now();
    let out = tempfile::tempdir()?;
    let built = crate::image::build_all(&crate::image::Options::new(
        &opts.bins,
        &["e2e", "e2e-next"],
        out.path(),
    ))
    .context("building the images")?;
    for i in &built {
        println!("    {:<52} {}", i.names.join(", "), i.digest);
    }
    println!("    built in {:.1} s", t0.elapsed().as_secs_f64());
    let images = Images::from(built)?;

    say("starting versitygw, etcd, kube-apiserver, kube-controller-manager and kube-scheduler");
    let s3_server = S3Server::start();
    s3_server.create_bucket(BUCKET).await;
    let s3 = S3Store::new(s3_server.s3_config()).await?;
    let moto = ferry_testkit::MotoServer::start();
    let moto_roles = moto_setup(&moto);
    let mut cluster = KubeCluster::start_with(KubeClusterOptions {
        workloads: true,
        ..Default::default()
    })
    .await?;
    let kube = cluster.client().await?;

    say("starting containerd and kubelet (node 127.0.0.1), importing the images");
    let mut node = KubeNode::start_containerd(&KubeNodeOptions {
        sandbox_image: images.pause.clone(),
        base_dir: None,
    })
    .await?;
    let setup = async {
        crate::image::import(&images.built, &node.containerd_address())?;
        node.start_kubelet(&cluster, &kube).await?;
        for (name, d) in cluster.startup.iter().chain(node.startup.iter()) {
            println!("    {name:<24} ready after {:.1} s", d.as_secs_f64());
        }
        Ok(())
    }
    .await;
    if let Err(e) = setup {
        println!(
            "    control plane logs kept: {}",
            cluster.keep_dir().display()
        );
        println!("    node logs kept: {}", node.keep_dir().display());
        return Err(e);
    }
    let values = node.dir().join("values.yaml");
    let mut env = Env {
        kube: kube.clone(),
        s3,
        s3_server,
        moto,
        moto_roles,
        node,
        kubeconfig: cluster.kubeconfig().to_path_buf(),
        chart: opts.chart.clone(),
        values,
        busybox: images.busybox.clone(),
    };
    let result = scenarios(&mut env, &cluster, &images).await;
    if result.is_err() {
        println!(
            "    control plane logs kept: {}",
            cluster.keep_dir().display()
        );
        println!(
            "    node logs kept (kubelet.log, containerd.log, pod-logs/): {}",
            env.node.keep_dir().display()
        );
    }
    // Pods, containerd, kubelet and what they changed on the host go first, then the control
    // plane.
    drop(env);
    result?;
    say(&format!(
        "real-node e2e passed in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

async fn scenarios(env: &mut Env, cluster: &KubeCluster, images: &Images) -> Result<()> {
    install(env, cluster, images).await?;
    // The datasets the read scenarios use, with their checksums beside them.
    let imagenet = upload_dataset(env, "datasets/imagenet/", 1, 24).await?;
    let mini = upload_dataset(env, "mountpoint/mini/", 2, 16).await?;
    dynamic_rwx(env).await?;
    static_rox(env, &mini).await?;
    existing_dataset(env, &imagenet).await?;
    pod_identity(env).await?;
    non_root(env).await?;
    unpublish_on_delete(env).await?;
    kubelet_restart(env).await?;
    rolling_update(env, images).await?;
    Ok(())
}

/// Objects under `prefix`: `count` files of pseudo-random bytes and sizes (0 B to ~1.5 MB) and a
/// `SHA256SUMS` in `sha256sum` format; returns the file names.
async fn upload_dataset(env: &Env, prefix: &str, seed: u64, count: usize) -> Result<Vec<String>> {
    let mut sums = String::new();
    let mut names = Vec::new();
    for i in 0..count {
        let len = match i {
            0 => 0,
            1 => 1,
            _ => (i * 61_231 + seed as usize * 7_919) % 1_500_000,
        };
        let data = crate::payload(seed * 1000 + i as u64, len);
        let name = format!("shard-{i:03}.bin");
        sums += &format!("{}  {name}\n", sha256_hex(&data));
        env.s3.put(BUCKET, &format!("{prefix}{name}"), data).await?;
        names.push(name);
    }
    env.s3
        .put(BUCKET, &format!("{prefix}SHA256SUMS"), Bytes::from(sums))
        .await?;
    Ok(names)
}

/// a. A dynamic RWX PVC: pod A writes files and their checksums, S3 holds exactly those bytes,
/// pod B reads them back; deleting the PVC (`deletePolicy: delete`) empties its prefix and
/// nothing else.
async fn dynamic_rwx(env: &Env) -> Result<()> {
    say("a. dynamic RWX PVC: pod A writes, pod B reads; deleting the PVC empties its prefix only");
    crate::kube::create_pvc(&env.kube, NS, "shared", "scratch", "ReadWriteMany", None).await?;
    let pv = wait_bound(env, "shared").await?;
    let prefix = crate::kube::pv_prefix(&pv)?;
    run_pod(
        env,
        "writer",
        "set -e; mkdir -p /data/run; cd /data/run; \
         for i in 1 2 3 4 5; do head -c $((i * 300007 + 17)) /dev/urandom > part-$i.bin; done; \
         head -c 5 /dev/urandom > tiny.bin; : > empty.bin; \
         sha256sum part-*.bin tiny.bin empty.bin > SHA256SUMS; cat SHA256SUMS",
        &[("shared", "/data", false)],
        None,
    )
    .await?;
    // Every byte pod A wrote is in S3, as its checksums say.
    let sums =
        crate::kube::read_object(&env.s3, BUCKET, &format!("{prefix}run/SHA256SUMS")).await?;
    let sums = String::from_utf8(sums.to_vec())?;
    let mut n = 0;
    for line in sums.lines() {
        let (sum, name) = line.split_once("  ").context("a SHA256SUMS line")?;
        let data =
            crate::kube::read_object(&env.s3, BUCKET, &format!("{prefix}run/{name}")).await?;
        ensure!(
            sha256_hex(&data) == sum,
            "s3://{BUCKET}/{prefix}run/{name}: not the bytes pod writer wrote"
        );
        n += 1;
    }
    ensure!(n == 7, "SHA256SUMS lists {n} files, not 7:\n{sums}");
    println!("    pod writer wrote 7 files; S3 holds the same bytes (sha256)");
    run_pod(
        env,
        "reader",
        "cd /data/run && sha256sum -c SHA256SUMS",
        &[("shared", "/data", false)],
        None,
    )
    .await?;
    println!("    pod reader checked every byte through its own mount");
    delete_pod(env, "writer").await?;
    delete_pod(env, "reader").await?;
    env.s3
        .put(
            BUCKET,
            "k8s/ml/outside.txt",
            Bytes::from_static(b"not the volume's\n"),
        )
        .await?;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    delete_pvc_and_wait(env, "shared", &pv_name).await?;
    ensure!(
        crate::kube::count(&env.s3, BUCKET, &prefix).await? == 0,
        "deletePolicy delete: objects left under {prefix}"
    );
    ensure!(
        crate::kube::count(&env.s3, BUCKET, "k8s/ml/outside.txt").await? == 1,
        "deletePolicy delete removed k8s/ml/outside.txt, outside the volume's prefix"
    );
    println!("    PVC deleted: {prefix} is empty, k8s/ml/outside.txt kept");
    Ok(())
}

/// b. A static ROX PV written as for Mountpoint's driver (only the driver name changed), read by
/// three pods at once.
async fn static_rox(env: &Env, files: &[String]) -> Result<()> {
    say("b. a Mountpoint v2 static PV and PVC (its docs' caching example), 3 pods reading at once");
    // The fixture the volume crate's tests parse, changed as the README's migration says (the
    // driver name), plus what differs here: bucket, prefix and namespace.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../crates/volume/tests/fixtures/mountpoint-v2-static-pv.yaml");
    let docs = ferry_testkit::apply::parse_documents(&std::fs::read_to_string(&fixture)?)
        .with_context(|| format!("parsing {}", fixture.display()))?;
    let [mut pv, mut pvc] = <[Value; 2]>::try_from(docs).map_err(|d| {
        anyhow::anyhow!(
            "{}: {} documents, not a PV and a PVC",
            fixture.display(),
            d.len()
        )
    })?;
    ensure!(
        pv["spec"]["csi"]["driver"] == "s3.csi.aws.com",
        "the fixture is not a Mountpoint PV"
    );
    pv["spec"]["csi"]["driver"] = json!(ferry_volume::DRIVER_NAME);
    pv["spec"]["csi"]["volumeAttributes"]["bucketName"] = json!(BUCKET);
    pv["spec"]["claimRef"]["namespace"] = json!(NS);
    for o in pv["spec"]["mountOptions"]
        .as_array_mut()
        .context("mountOptions")?
    {
        if o.as_str().is_some_and(|o| o.starts_with("prefix ")) {
            *o = json!("prefix mountpoint/mini/");
        }
    }
    pvc["metadata"]["namespace"] = json!(NS);
    let pvs: Api<PersistentVolume> = Api::all(env.kube.clone());
    pvs.create(&PostParams::default(), &serde_json::from_value(pv)?)
        .await
        .context("creating the static PV")?;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(env.kube.clone(), NS);
    pvcs.create(&PostParams::default(), &serde_json::from_value(pvc)?)
        .await
        .context("creating the static PV's claim")?;
    wait_bound(env, "s3-pvc").await?;
    let names = ["mp-0", "mp-1", "mp-2"];
    for name in names {
        create_pod(
            env,
            name,
            "cd /data && sha256sum -c SHA256SUMS && ! touch /data/new 2>/dev/null",
            &[("s3-pvc", "/data", true)],
            None,
        )
        .await?;
    }
    for name in names {
        succeeded(env, name).await?;
    }
    println!(
        "    3 pods read {} files at once, every byte checked; writes refused",
        files.len()
    );
    for name in names {
        delete_pod(env, name).await?;
    }
    Ok(())
}

/// c. An existing dataset through a dynamic PVC (the existing-prefix annotation).
async fn existing_dataset(env: &Env, files: &[String]) -> Result<()> {
    say("c. an existing dataset through a dynamic PVC (s3.csi.ferry.dev/existing-prefix)");
    crate::kube::create_pvc(
        &env.kube,
        NS,
        "imagenet",
        "datasets",
        "ReadOnlyMany",
        Some("datasets/imagenet/"),
    )
    .await?;
    let pv = wait_bound(env, "imagenet").await?;
    ensure!(
        crate::kube::pv_prefix(&pv)? == "datasets/imagenet/",
        "the PV's prefix is {:?}, not the annotated dataset",
        crate::kube::pv_prefix(&pv)?
    );
    run_pod(
        env,
        "imagenet",
        "cd /data && sha256sum -c SHA256SUMS && ! touch /data/new 2>/dev/null",
        &[("imagenet", "/data", true)],
        None,
    )
    .await?;
    println!(
        "    {} files of datasets/imagenet/ checked through the PVC",
        files.len()
    );
    delete_pod(env, "imagenet").await?;
    Ok(())
}

/// e. A non-root pod with fsGroup: files belong to root and the pod's fsGroup, group-writable, so
/// the pod writes and reads them.
async fn non_root(env: &Env) -> Result<()> {
    say("e. runAsUser 1000, fsGroup 2000: the pod writes and reads, files owned 0:2000");
    crate::kube::create_pvc(&env.kube, NS, "team", "scratch", "ReadWriteMany", None).await?;
    wait_bound(env, "team").await?;
    let log = run_pod(
        env,
        "team",
        "set -e; id; echo written-by-1000 > /data/own.txt; mkdir /data/dir; \
         test \"$(cat /data/own.txt)\" = written-by-1000; \
         stat -c 'file %u %g %a' /data/own.txt; stat -c 'dir %u %g %a' /data/dir",
        &[("team", "/data", false)],
        Some(json!({"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000, "runAsNonRoot": true})),
    )
    .await?;
    for want in ["file 0 2000 664", "dir 0 2000 775"] {
        ensure!(
            log.contains(want),
            "pod team: expected {want:?} in its output:\n{log}"
        );
    }
    println!("    uid 1000 wrote and read; file 0:2000 0664, directory 0:2000 0775");
    delete_pod(env, "team").await?;
    Ok(())
}

/// f. Deleting a pod makes kubelet call NodeUnpublishVolume: the target is gone and so is the
/// FUSE connection.
async fn unpublish_on_delete(env: &Env) -> Result<()> {
    say("f. pod deleted: NodeUnpublishVolume removes the target and ends the FUSE connection");
    create_pod(
        env,
        "sleeper",
        "cat /data/SHA256SUMS >/dev/null && sleep 3600",
        &[("imagenet", "/data", true)],
        None,
    )
    .await?;
    let pod = wait_running(env, "sleeper").await?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let pv = pv_of(env, "imagenet").await?;
    let target = env
        .node
        .kubelet_dir()
        .join(format!("pods/{uid}/volumes/kubernetes.io~csi/{pv}/mount"));
    let entry = ferry_fs::mountinfo::parse(&std::fs::read_to_string("/proc/self/mountinfo")?)
        .into_iter()
        .find(|m| Path::new(&m.mount_point) == target)
        .with_context(|| format!("{} is not a mount point on the host", target.display()))?;
    ensure!(
        entry.is_ferry(),
        "{} is a {} mount",
        target.display(),
        entry.fs_type
    );
    let conn = PathBuf::from(format!("/sys/fs/fuse/connections/{}", entry.dev.1));
    ensure!(
        conn.exists(),
        "{} does not exist for a live mount",
        conn.display()
    );
    let fds_before = fuse_fds();
    delete_pod(env, "sleeper").await?;
    ensure!(
        !target.exists(),
        "{} still exists after the pod was deleted",
        target.display()
    );
    ensure!(
        !conn.exists(),
        "{} is still there: the FUSE connection leaked",
        conn.display()
    );
    // The mount's /dev/fuse descriptors are closed too (ferry-node's and the fd holder's copy).
    let fds_after = fuse_fds();
    ensure!(
        fds_after < fds_before,
        "ferry-node and ferry-fd-holder hold {fds_after} /dev/fuse descriptors after the unmount, {fds_before} before"
    );
    println!(
        "    target removed, {} gone, /dev/fuse descriptors in ferry-node and the fd holder {fds_before} → {fds_after}",
        conn.display()
    );
    Ok(())
}

const MOTO_BUCKET: &str = "ferry-pod-identity";
const MOTO_TEXT: &str = "read with the pod's own role\n";

/// moto: a bucket with one object; role `pod-reader` may list and read it, role `pod-lister`
/// may only list it.
fn moto_setup(moto: &ferry_testkit::MotoServer) -> std::collections::HashMap<String, String> {
    let list = format!(
        r#"{{"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": ["arn:aws:s3:::{MOTO_BUCKET}"]}}"#
    );
    let read = format!(
        r#"{{"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": ["arn:aws:s3:::{MOTO_BUCKET}/*"]}}"#
    );
    moto.setup(
        &[(MOTO_BUCKET, &[("data/hello.txt", MOTO_TEXT)])],
        &[],
        &[
            ("pod-reader", &format!("[{list}, {read}]")),
            ("pod-lister", &format!("[{list}]")),
        ],
    )
    .roles
}

/// d. Pod-level identity: kubelet's tokenRequests token reaches Ferry, STS (moto) gives the pod's
/// role's credentials; a pod whose role may read reads, a pod whose role may only list gets
/// EACCES — after the first pod's read, so never bytes from the node cache.
async fn pod_identity(env: &Env) -> Result<()> {
    say("d. pod-level identity: kubelet's token → STS (moto) → the pod's role; a role that may not read gets EACCES");
    for (sa, role) in [("reader", "pod-reader"), ("lister", "pod-lister")] {
        let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(env.kube.clone(), NS);
        accounts
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": sa, "namespace": NS,
                    "annotations": {"eks.amazonaws.com/role-arn": env.moto_roles[role]}}}))?,
            )
            .await
            .with_context(|| format!("creating ServiceAccount {sa}"))?;
    }
    let pv = json!({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": "pod-identity"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "claimRef": {"namespace": NS, "name": "pod-identity"},
            "mountOptions": ["prefix data/"],
            "csi": {
                "driver": ferry_volume::DRIVER_NAME,
                "volumeHandle": "pod-identity",
                "volumeAttributes": {
                    "bucketName": MOTO_BUCKET,
                    "endpointUrl": env.moto.endpoint_url(),
                    "forcePathStyle": "true",
                    "region": "us-east-1",
                    "authenticationSource": "pod",
                },
            },
        },
    });
    let pvs: Api<PersistentVolume> = Api::all(env.kube.clone());
    pvs.create(&PostParams::default(), &serde_json::from_value(pv)?)
        .await?;
    let pvc = json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "pod-identity", "namespace": NS},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "resources": {"requests": {"storage": "1Gi"}}, "volumeName": "pod-identity"},
    });
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(env.kube.clone(), NS);
    pvcs.create(&PostParams::default(), &serde_json::from_value(pvc)?)
        .await?;
    wait_bound(env, "pod-identity").await?;
    let claims = [("pod-identity", "/data", true)];
    let mut reader = pod_manifest(env, "identity-reader", "cat /data/hello.txt", &claims, None);
    reader["spec"]["serviceAccountName"] = json!("reader");
    create(env, reader).await?;
    let log = succeeded(env, "identity-reader").await?;
    ensure!(
        log == MOTO_TEXT,
        "pod identity-reader read {log:?}, not the object"
    );
    let mut lister = pod_manifest(
        env,
        "identity-lister",
        "ls /data && if cat /data/hello.txt > /tmp/got 2> /tmp/err; then echo \"read: $(cat /tmp/got)\"; exit 1; fi; \
         cat /tmp/err; grep -q 'Permission denied' /tmp/err",
        &claims,
        None,
    );
    lister["spec"]["serviceAccountName"] = json!("lister");
    create(env, lister).await?;
    let log = succeeded(env, "identity-lister").await?;
    println!(
        "    role pod-reader read the object; role pod-lister listed it and got: {}",
        log.lines().last().unwrap_or_default()
    );
    delete_pod(env, "identity-reader").await?;
    delete_pod(env, "identity-lister").await?;
    Ok(())
}

/// A reader that checks the dataset over and over until the harness creates `stop` in its control
/// directory (a hostPath), writing the number of passes done there after each one, then prints
/// it; any failed read exits 1.
const READ_LOOP: &str = "n=0; while [ ! -e /control/stop ]; do \
    (cd /data && sha256sum -c -s SHA256SUMS) || { echo \"read failed in pass $n\"; exit 1; }; \
    n=$((n + 1)); echo $n > /control/passes.new && mv /control/passes.new /control/passes; \
    done; echo \"passes: $n\"";

/// The passes the reader with `control` has finished so far.
fn passes(control: &Path) -> u64 {
    std::fs::read_to_string(control.join("passes"))
        .ok()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits until the reader has finished two more passes than `from`: whole passes over the dataset
/// after the event the caller waited for, not only before it.
async fn two_more_passes(env: &Env, name: &str, control: &Path, from: u64) -> Result<u64> {
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), NS);
    wait_for(
        &format!("pod {name} to read the dataset twice more"),
        POD_TIMEOUT,
        || async {
            let p = pods.get(name).await?;
            let phase = phase(&p);
            if phase != "Running" {
                bail!(
                    "pod {name} stopped reading ({}):\n{}",
                    pod_state(&p),
                    pod_log(env, name).await
                );
            }
            let n = passes(control);
            Ok(if n >= from + 2 {
                Ok(n)
            } else {
                Err(format!("{n} passes"))
            })
        },
    )
    .await
}

/// Starts the looping reader `name` on the `imagenet` PVC and waits until it has started reading.
async fn start_reader(env: &Env, name: &str) -> Result<PathBuf> {
    let control = env.node.dir().join(format!("control-{name}"));
    std::fs::create_dir_all(&control)?;
    let mut pod = pod_manifest(env, name, READ_LOOP, &[("imagenet", "/data", true)], None);
    pod["spec"]["volumes"]
        .as_array_mut()
        .expect("volumes")
        .push(json!({"name": "control", "hostPath": {"path": control.display().to_string(), "type": "Directory"}}));
    pod["spec"]["containers"][0]["volumeMounts"]
        .as_array_mut()
        .expect("volumeMounts")
        .push(json!({"name": "control", "mountPath": "/control"}));
    create(env, pod).await?;
    wait_running(env, name).await?;
    Ok(control)
}

/// Stops the looping reader and returns its number of passes; fails if any read failed.
async fn stop_reader(env: &Env, name: &str, control: &Path) -> Result<u64> {
    std::fs::write(control.join("stop"), b"")?;
    let log = succeeded(env, name).await?;
    let passes = log
        .lines()
        .find_map(|l| l.strip_prefix("passes: "))
        .and_then(|n| n.trim().parse().ok())
        .with_context(|| format!("pod {name} printed no pass count:\n{log}"))?;
    delete_pod(env, name).await?;
    Ok(passes)
}

/// g. kubelet killed and started again while a pod reads: the pod keeps reading.
async fn kubelet_restart(env: &mut Env) -> Result<()> {
    say("g. kubelet restarted (kill -9, start) while a pod reads");
    let control = start_reader(env, "reader-g").await?;
    let kube = env.kube.clone();
    let restarted = k8s_openapi::jiff::Timestamp::now();
    env.node.restart_kubelet(&kube).await?;
    // The new kubelet is up once it renewed the node's Lease (the Node stays Ready meanwhile).
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(kube.clone(), "kube-node-lease");
    wait_for(
        "the restarted kubelet to renew its Lease",
        POD_TIMEOUT,
        || async {
            let renewed = leases
                .get(NODE_NAME)
                .await?
                .spec
                .and_then(|s| s.renew_time)
                .map(|t| t.0);
            Ok(match renewed {
                Some(t) if t > restarted => Ok(()),
                other => Err(format!("renewed at {other:?}")),
            })
        },
    )
    .await?;
    let at_restart = passes(&control);
    let after = two_more_passes(env, "reader-g", &control, at_restart).await?;
    let total = stop_reader(env, "reader-g", &control).await?;
    println!(
        "    {total} passes over the dataset, {} of them after the new kubelet renewed its Lease; no failed read",
        total.max(after) - at_restart
    );
    Ok(())
}

/// h. The node DaemonSet rolled to a new image tag while a pod reads: the new node pod takes the
/// live mount over; no read fails.
async fn rolling_update(env: &Env, images: &Images) -> Result<()> {
    say("h. node DaemonSet rolled to a new image tag (helm upgrade) while a pod reads");
    let control = start_reader(env, "reader-h").await?;
    let next = images.ferry_next.clone();
    let (_, tag) = next.rsplit_once(':').expect("name:tag");
    helm(env, "upgrade", &["--set", &format!("image.tag={tag}")])?;
    let dss: Api<DaemonSet> = Api::namespaced(env.kube.clone(), SYSTEM_NS);
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), SYSTEM_NS);
    wait_for("the node DaemonSet rolled out", INSTALL_TIMEOUT, || async {
        let ds = dss.get(&format!("{RELEASE}-node")).await?;
        let generation = ds.metadata.generation.unwrap_or_default();
        let st = ds.status.unwrap_or_default();
        let node_pods = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=node"))
            .await?
            .items;
        let images: Vec<String> = node_pods
            .iter()
            .flat_map(|p| p.spec.iter().flat_map(|s| s.containers.iter()))
            .filter(|c| c.name == "ferry-node")
            .filter_map(|c| c.image.clone())
            .collect();
        let done = st.observed_generation == Some(generation)
            && st.updated_number_scheduled == Some(1)
            && st.number_ready == 1
            && node_pods.len() == 1
            && images.iter().all(|i| *i == next);
        Ok(if done {
            Ok(())
        } else {
            Err(format!(
                "updated {:?}, ready {}, node pods {} with images {images:?}",
                st.updated_number_scheduled,
                st.number_ready,
                node_pods.len()
            ))
        })
    })
    .await?;
    // The new node pod took the live mount over from the old one (not a crash recovery).
    let new_pod = pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=node"))
        .await?
        .items
        .into_iter()
        .next()
        .and_then(|p| p.metadata.name)
        .context("no node pod")?;
    let system: Api<Pod> = Api::namespaced(env.kube.clone(), SYSTEM_NS);
    let log = system
        .logs(
            &new_pod,
            &LogParams {
                container: Some("ferry-node".into()),
                ..Default::default()
            },
        )
        .await?;
    let log = strip_ansi(&log);
    let handed = log
        .lines()
        .find(|l| l.contains("mounts handed over"))
        .with_context(|| {
            format!("{new_pod} did not take the mounts over from the old pod:\n{log}")
        })?;
    ensure!(
        !handed.contains("mounts=0"),
        "{new_pod} took no mount over: {handed}"
    );
    let at_rollout = passes(&control);
    two_more_passes(env, "reader-h", &control, at_rollout).await?;
    let total = stop_reader(env, "reader-h", &control).await?;
    println!(
        "    {new_pod} ({next}) took the mounts over; {total} passes over the dataset, {} after the old pod was gone; 0 failed reads",
        total - at_rollout
    );
    Ok(())
}

fn pod_manifest(
    env: &Env,
    name: &str,
    script: &str,
    claims: &[(&str, &str, bool)],
    security: Option<Value>,
) -> Value {
    let volumes: Vec<Value> = claims
        .iter()
        .enumerate()
        .map(|(i, (claim, _, ro))| {
            json!({"name": format!("v{i}"), "persistentVolumeClaim": {"claimName": claim, "readOnly": ro}})
        })
        .collect();
    let mounts: Vec<Value> = claims
        .iter()
        .enumerate()
        .map(|(i, (_, path, ro))| json!({"name": format!("v{i}"), "mountPath": path, "readOnly": ro}))
        .collect();
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            // containerd 1.6 wants an interface with an address from CNI for a pod network of its
            // own; this node has only the loopback plugin (nothing may leave the machine).
            "hostNetwork": true,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "main",
                "image": env.busybox,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
                "volumeMounts": mounts,
            }],
            "volumes": volumes,
        },
    });
    if let Some(sc) = security {
        pod["spec"]["securityContext"] = sc;
    }
    pod
}

/// Creates the pod `manifest` in the test namespace.
async fn create(env: &Env, manifest: Value) -> Result<()> {
    let name = manifest["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), NS);
    pods.create(&PostParams::default(), &serde_json::from_value(manifest)?)
        .await
        .with_context(|| format!("creating pod {name}"))?;
    Ok(())
}

async fn create_pod(
    env: &Env,
    name: &str,
    script: &str,
    claims: &[(&str, &str, bool)],
    security: Option<Value>,
) -> Result<()> {
    create(env, pod_manifest(env, name, script, claims, security)).await
}

/// Creates a pod, waits until it ended and returns its log; fails unless it Succeeded.
async fn run_pod(
    env: &Env,
    name: &str,
    script: &str,
    claims: &[(&str, &str, bool)],
    security: Option<Value>,
) -> Result<String> {
    create_pod(env, name, script, claims, security).await?;
    succeeded(env, name).await
}

/// Waits until pod `name` ended and returns its log; fails with its state and log unless it
/// Succeeded.
async fn succeeded(env: &Env, name: &str) -> Result<String> {
    let pod = wait_pod_done(env, name).await?;
    let log = pod_log(env, name).await;
    let phase = phase(&pod);
    ensure!(
        phase == "Succeeded",
        "pod {name}: {}\n--- its log ---\n{log}",
        pod_state(&pod)
    );
    Ok(log)
}

async fn wait_pod_done(env: &Env, name: &str) -> Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), NS);
    wait_for(&format!("pod {name} to end"), POD_TIMEOUT, || async {
        let p = pods.get(name).await?;
        let phase = phase(&p);
        Ok(if phase == "Succeeded" || phase == "Failed" {
            Ok(p)
        } else {
            Err(pod_state(&p))
        })
    })
    .await
}

async fn wait_running(env: &Env, name: &str) -> Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), NS);
    wait_for(&format!("pod {name} Running"), POD_TIMEOUT, || async {
        let p = pods.get(name).await?;
        let phase = phase(&p);
        if phase == "Failed" || phase == "Succeeded" {
            bail!(
                "pod {name} ended ({}) before the test was done with it:\n{}",
                pod_state(&p),
                pod_log(env, name).await
            );
        }
        Ok(if phase == "Running" {
            Ok(p)
        } else {
            Err(pod_state(&p))
        })
    })
    .await
}

async fn pod_log(env: &Env, name: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), NS);
    pods.logs(name, &LogParams::default())
        .await
        .unwrap_or_else(|e| format!("(no log: {e})"))
}

/// Deletes a pod and waits until it is gone (kubelet unpublished its volumes).
async fn delete_pod(env: &Env, name: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), NS);
    pods.delete(name, &DeleteParams::default()).await?;
    wait_for(&format!("pod {name} gone"), POD_TIMEOUT, || async {
        Ok(match pods.get_opt(name).await? {
            None => Ok(()),
            Some(p) => Err(pod_state(&p)),
        })
    })
    .await
}

async fn wait_bound(env: &Env, name: &str) -> Result<PersistentVolume> {
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(env.kube.clone(), NS);
    let pv = wait_for(&format!("PVC {name} Bound"), INSTALL_TIMEOUT, || async {
        let pvc = pvcs.get(name).await?;
        let phase = pvc.status.and_then(|s| s.phase).unwrap_or_default();
        Ok(match pvc.spec.and_then(|s| s.volume_name) {
            Some(pv) if phase == "Bound" => Ok(pv),
            _ => Err(format!("phase {phase}")),
        })
    })
    .await?;
    let pvs: Api<PersistentVolume> = Api::all(env.kube.clone());
    Ok(pvs.get(&pv).await?)
}

async fn pv_of(env: &Env, claim: &str) -> Result<String> {
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(env.kube.clone(), NS);
    pvcs.get(claim)
        .await?
        .spec
        .and_then(|s| s.volume_name)
        .with_context(|| format!("PVC {claim} is not bound"))
}

async fn delete_pvc_and_wait(env: &Env, name: &str, pv: &str) -> Result<()> {
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(env.kube.clone(), NS);
    pvcs.delete(name, &DeleteParams::default()).await?;
    let pvs: Api<PersistentVolume> = Api::all(env.kube.clone());
    wait_for(&format!("PV {pv} deleted"), INSTALL_TIMEOUT, || async {
        Ok(match pvs.get_opt(pv).await? {
            None => Ok(()),
            Some(v) => Err(format!(
                "phase {}",
                v.status.and_then(|s| s.phase).unwrap_or_default()
            )),
        })
    })
    .await
}

/// The chart's values for this node: the locally built images, and what a cluster whose only
/// network is the node's loopback needs. Nothing else differs from the chart's defaults.
fn values(env: &Env, cluster: &KubeCluster, images: &Images) -> Value {
    let port = cluster
        .server()
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_string();
    let (repo, tag) = images.ferry.rsplit_once(':').expect("name:tag");
    let (prov_repo, prov_tag) = images.provisioner.rsplit_once(':').expect("name:tag");
    // Static keys from a Secret, as the README's "Credentials" shows; the region is given and the
    // instance metadata service off, so nothing leaves loopback.
    let secret_env = json!([
        {"name": "AWS_REGION", "value": env.s3_server.region()},
        {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"},
        // Pod-level identity: STS is moto (AssumeRoleWithWebIdentity).
        {"name": "AWS_ENDPOINT_URL_STS", "value": env.moto.endpoint_url()},
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3-keys", "key": "access-key"}}},
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "s3-keys", "key": "secret-key"}}},
    ]);
    json!({
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "sidecars": {"provisioner": {"image": {"repository": prov_repo, "tag": prov_tag, "pullPolicy": "Never"}}},
        "kubernetesApi": {"host": "127.0.0.1", "port": port},
        "s3": {
            "endpointUrl": env.s3_server.endpoint_url(),
            "region": env.s3_server.region(),
            "forcePathStyle": true,
            // moto, for the pod-identity volume.
            "allowedEndpoints": [env.moto.endpoint_url()],
        },
        // On the host network every port is the host's: free ones, so nothing else on this
        // machine can clash.
        "metrics": {"port": free_port()},
        "controller": {
            // One replica: on the host network the chart allows one per node.
            "replicas": 1,
            "hostNetwork": true,
            "metricsPort": free_port(),
            "healthPort": free_port(),
            "extraEnv": secret_env,
        },
        "node": {
            "hostNetwork": true,
            "healthPort": free_port(),
            "kubeletDir": env.node.kubelet_dir().display().to_string(),
            "cache": {"hostPath": env.node.dir().join("cache").display().to_string()},
            "extraEnv": secret_env,
        },
        "storageClasses": [
            {"name": "scratch", "bucketName": BUCKET, "basePrefix": "k8s",
             "prefixTemplate": "${pvc.namespace}/${pvc.name}/${pv.name}", "deletePolicy": "delete",
             "mountOptions": ["allow-delete"]},
            {"name": "datasets", "bucketName": BUCKET, "basePrefix": "datasets"},
        ],
    })
}

/// `helm install` of the chart; waits for the controller and node pods and for the CSINode.
async fn install(env: &mut Env, cluster: &KubeCluster, images: &Images) -> Result<()> {
    say("helm install ferry charts/ferry (its own ServiceAccounts and RBAC)");
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.kube.clone());
    for ns in [SYSTEM_NS, NS] {
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
            )
            .await
            .with_context(|| format!("creating namespace {ns}"))?;
    }
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(env.kube.clone(), SYSTEM_NS);
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "s3-keys"},
                "stringData": {
                    "access-key": env.s3_server.access_key(),
                    "secret-key": env.s3_server.secret_key(),
                },
            }))?,
        )
        .await
        .context("creating the S3 keys Secret")?;
    let values = values(env, cluster, images);
    std::fs::write(&env.values, serde_json::to_string_pretty(&values)?)?;
    helm(env, "install", &[])?;
    wait_chart_pods(env).await?;
    let csinodes: Api<CSINode> = Api::all(env.kube.clone());
    wait_for(
        "the CSINode to list s3.csi.ferry.dev (kubelet registered the driver)",
        INSTALL_TIMEOUT,
        || async {
            let drivers: Vec<String> = csinodes
                .get_opt(NODE_NAME)
                .await?
                .map(|n| n.spec.drivers.into_iter().map(|d| d.name).collect())
                .unwrap_or_default();
            Ok(if drivers.iter().any(|d| d == ferry_volume::DRIVER_NAME) {
                Ok(())
            } else {
                Err(format!("drivers {drivers:?}"))
            })
        },
    )
    .await?;
    println!(
        "    controller and node pods Running; CSINode lists {}",
        ferry_volume::DRIVER_NAME
    );
    Ok(())
}

/// `helm <verb>` (install, upgrade) of the release from the chart with the e2e's values, plus
/// `extra` arguments.
fn helm(env: &Env, verb: &str, extra: &[&str]) -> Result<()> {
    let bin = ferry_testkit::kube::tool_path("helm")
        .context("helm not found: scripts/kube-tools.sh builds it")?;
    let (chart, values) = (
        env.chart.display().to_string(),
        env.values.display().to_string(),
    );
    let mut args = vec![
        verb,
        RELEASE,
        &chart,
        "--namespace",
        SYSTEM_NS,
        "--values",
        &values,
    ];
    args.extend_from_slice(extra);
    let out = Command::new(bin)
        .args(&args)
        .arg("--kubeconfig")
        .arg(&env.kubeconfig)
        .stdin(Stdio::null())
        .output()?;
    ensure!(
        out.status.success(),
        "helm {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Waits until every pod of the release is Running with all containers ready.
async fn wait_chart_pods(env: &Env) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), SYSTEM_NS);
    wait_for(
        "the chart's pods Running and ready",
        INSTALL_TIMEOUT,
        || async {
            let list = pods
                .list(
                    &ListParams::default().labels(&format!("app.kubernetes.io/instance={RELEASE}")),
                )
                .await?
                .items;
            let mut state = Vec::new();
            let mut components = BTreeSet::new();
            let mut all_ready = !list.is_empty();
            for p in &list {
                let name = p.metadata.name.clone().unwrap_or_default();
                let status = p.status.clone().unwrap_or_default();
                let ready = status
                    .container_statuses
                    .as_ref()
                    .is_some_and(|cs| !cs.is_empty() && cs.iter().all(|c| c.ready));
                if ready && p.metadata.deletion_timestamp.is_none() {
                    if let Some(c) = p
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get("app.kubernetes.io/component"))
                    {
                        components.insert(c.clone());
                    }
                } else {
                    all_ready = false;
                }
                state.push(format!("{name}: {}", pod_state(p)));
            }
            Ok(
                if all_ready && components.contains("node") && components.contains("controller") {
                    Ok(())
                } else {
                    Err(state.join("; "))
                },
            )
        },
    )
    .await
}

/// A pod's phase (`Pending`, `Running`, `Succeeded`, `Failed`; empty before it has one).
fn phase(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default()
}

/// A pod's phase and, for containers not running, why.
fn pod_state(p: &Pod) -> String {
    let status = p.status.clone().unwrap_or_default();
    let mut s = status.phase.unwrap_or_else(|| "?".into());
    for c in status.container_statuses.unwrap_or_default() {
        if let Some(st) = c.state {
            if let Some(w) = st.waiting {
                s += &format!(
                    " [{}: waiting {} {}]",
                    c.name,
                    w.reason.unwrap_or_default(),
                    w.message.unwrap_or_default()
                );
            } else if let Some(t) = st.terminated {
                s += &format!(
                    " [{}: exited {} {}]",
                    c.name,
                    t.exit_code,
                    t.reason.unwrap_or_default()
                );
            }
        }
    }
    for c in status.conditions.unwrap_or_default() {
        if c.status != "True" {
            if let Some(m) = c.message {
                s += &format!(" [{}: {m}]", c.type_);
            }
        }
    }
    s
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

/// `s` without terminal colour escapes (`ESC [ ... m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// How many `/dev/fuse` descriptors ferry-node and ferry-fd-holder processes hold.
fn fuse_fds() -> usize {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    procs
        .flatten()
        .filter(|p| {
            std::fs::read_to_string(p.path().join("comm"))
                .is_ok_and(|c| matches!(c.trim(), "ferry-node" | "ferry-fd-holder"))
        })
        .filter_map(|p| std::fs::read_dir(p.path().join("fd")).ok())
        .flat_map(|fds| fds.flatten())
        .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l == Path::new("/dev/fuse")))
        .count()
}

/// sha256 of `data`, hex, as `sha256sum` prints it.
fn sha256_hex(data: &[u8]) -> String {
    let d = Sha256::digest(data);
    d.iter().map(|b| format!("{b:02x}")).collect()
}
