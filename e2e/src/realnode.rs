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
//!    location, S3 and the StorageClasses (`chart_values`) and what this loopback-only node
//!    needs (`local_values`) are set. Waits for the CSINode to list the driver: kubelet
//!    registered Ferry through its built-in registration.
//! 4. Scenarios with real pods, every byte checked with sha256: a dynamic RWX PVC written by one
//!    pod and read by another, then deleted with `deletePolicy: delete`; a static ROX PV in
//!    Mountpoint's format (with v2-only attributes) read by 3 pods at once; an existing dataset
//!    through a dynamic PVC; pod-level identity (kubelet's token, STS on moto, EACCES for a role
//!    that may not read); a non-root pod with `fsGroup`; pod deletion ending the FUSE
//!    connection; kubelet restarted under a reading pod; the node DaemonSet rolled to a new image
//!    tag under a reading pod.
//! 5. The existing-cluster path ([`run_existing`], `ferry-harness node --kubeconfig`) on the same
//!    cluster: everything removed, then installed again with the local values as a `--values`
//!    file, scenarios a, b, c, e and h, and everything removed again.
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
    /// Where the scenarios' objects go, and the harness's own view of it (to check every byte).
    s3: S3Store,
    target: S3Target,
    kubeconfig: PathBuf,
    chart: PathBuf,
    /// The e2e's values file (written by [`install`]), then the caller's (`--values`).
    values: Vec<PathBuf>,
    /// The values [`install`] writes to `values[0]`, beside the chart's defaults.
    chart_values: Value,
    busybox: String,
    /// Test pods on the host network (the local node has no pod network).
    host_network: bool,
    /// Test pods never pull their image (imported into the local node's containerd).
    pull_never: bool,
    /// What the local node run adds: kubelet, containerd, moto; `None` on an existing cluster.
    local: Option<Local>,
    /// Files the run writes (values); removed with it.
    work: tempfile::TempDir,
}

/// The one-node cluster of a local run: the node itself (its host paths, kubelet) and moto with
/// IAM and STS, for the scenarios only it allows.
struct Local {
    node: KubeNode,
    /// versitygw, kept running for the run.
    _s3_server: S3Server,
    /// S3 with IAM enforced and STS, for pod-level identity (scenario d).
    moto: ferry_testkit::MotoServer,
    moto_roles: std::collections::HashMap<String, String>,
}

/// The S3 endpoint the volumes use: reached by the harness and by the cluster's nodes alike.
#[derive(Debug, Clone)]
pub struct S3Target {
    /// `None`: AWS's endpoint for the region.
    pub endpoint_url: Option<String>,
    pub region: String,
    pub force_path_style: bool,
    /// A scratch bucket the e2e may write to (under `k8s/`, `datasets/` and `mountpoint/`).
    pub bucket: String,
    /// Static keys, for the harness and (in a Secret) for the driver; `None`: the harness uses
    /// the SDK's default chain and the driver what the `--values` files give it (IRSA, say).
    pub keys: Option<StaticKeys>,
}

/// An access key, its secret and, for temporary credentials, the session token.
#[derive(Debug, Clone)]
pub struct StaticKeys {
    pub id: String,
    pub secret: String,
    pub session_token: Option<String>,
}

impl S3Target {
    async fn store(&self) -> Result<S3Store> {
        let credentials = match &self.keys {
            Some(k) => ferry_s3::S3Credentials::Static {
                access_key_id: k.id.clone(),
                secret_access_key: k.secret.clone().into(),
                session_token: k.session_token.clone().map(Into::into),
            },
            None => ferry_s3::S3Credentials::DefaultChain,
        };
        Ok(S3Store::new(ferry_s3::S3Config {
            endpoint_url: self.endpoint_url.clone(),
            region: Some(self.region.clone()),
            force_path_style: self.force_path_style,
            credentials,
            on_attempt: None,
        })
        .await?)
    }
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
    let target = S3Target {
        endpoint_url: Some(s3_server.endpoint_url()),
        region: s3_server.region().to_string(),
        force_path_style: true,
        bucket: BUCKET.to_string(),
        keys: Some(StaticKeys {
            id: s3_server.access_key().to_string(),
            secret: s3_server.secret_key().to_string(),
            session_token: None,
        }),
    };
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
    let local = Local {
        node,
        _s3_server: s3_server,
        moto,
        moto_roles,
    };
    let mut chart_values = chart_values(&target, &images.ferry);
    merge(
        &mut chart_values,
        local_values(&local, &cluster, &images, &target),
    );
    let mut env = Env {
        kube: kube.clone(),
        s3: target.store().await?,
        target,
        kubeconfig: cluster.kubeconfig().to_path_buf(),
        chart: opts.chart.clone(),
        values: Vec::new(),
        chart_values,
        busybox: images.busybox.clone(),
        host_network: true,
        pull_never: true,
        local: Some(local),
        work: tempfile::tempdir()?,
    };
    let result = async {
        scenarios(&mut env, Some(&images.ferry_next)).await?;
        // Then the existing-cluster path, `ferry-harness node --kubeconfig`, on the same cluster:
        // the release and the test namespace removed as it removes them, then installed again
        // with the local node's values as a `--values` file.
        say("the same e2e as on an existing cluster (ferry-harness node --kubeconfig)");
        cleanup(&env).await?;
        let local = env.local.as_ref().expect("a local run");
        let overlay = env.work.path().join("local-node.yaml");
        std::fs::write(
            &overlay,
            serde_json::to_string_pretty(&local_values(local, &cluster, &images, &env.target))?,
        )?;
        run_existing(ExistingOptions {
            kubeconfig: env.kubeconfig.clone(),
            chart: env.chart.clone(),
            image: images.ferry.clone(),
            values: vec![overlay],
            s3: env.target.clone(),
            busybox: images.busybox.clone(),
            host_network: true,
        })
        .await
    }
    .await;
    if result.is_err() {
        println!(
            "    control plane logs kept: {}",
            cluster.keep_dir().display()
        );
        if let Some(local) = &mut env.local {
            println!(
                "    node logs kept (kubelet.log, containerd.log, pod-logs/): {}",
                local.node.keep_dir().display()
            );
        }
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

/// What `ferry-harness node --kubeconfig` was asked to do: the same e2e on an existing cluster
/// (kind, EKS, ...), with an image its nodes can pull and an S3 endpoint they reach.
#[derive(Debug, Clone)]
pub struct ExistingOptions {
    pub kubeconfig: PathBuf,
    /// The chart to install (default `charts/ferry` of this repository).
    pub chart: PathBuf,
    /// The Ferry image (`repository:tag`) the chart is installed with.
    pub image: String,
    /// More values files for `helm install`, after the e2e's own (credentials, node selectors).
    pub values: Vec<PathBuf>,
    pub s3: S3Target,
    /// The image of the test pods (a busybox with `sh`, `sha256sum` and `head`).
    pub busybox: String,
    /// Test pods on the host network (for nodes without a pod network, as the local one).
    pub host_network: bool,
}

/// The real-node e2e on an existing cluster: the chart installed into it, scenarios a, b, c, e
/// and h with real pods; d (needs moto's IAM and STS), f (reads the node's mount table) and g
/// (restarts kubelet) need the local node and are skipped. Everything it created is removed at
/// the end, also when a scenario failed.
pub async fn run_existing(opts: ExistingOptions) -> Result<()> {
    let started = Instant::now();
    say(&format!(
        "an existing cluster ({}), image {}, s3://{}",
        opts.kubeconfig.display(),
        opts.image,
        opts.s3.bucket
    ));
    let kube = Client::try_from(ferry_testkit::kube::load_kubeconfig(&opts.kubeconfig).await?)?;
    let mut env = Env {
        kube,
        s3: opts.s3.store().await?,
        target: opts.s3.clone(),
        kubeconfig: opts.kubeconfig.clone(),
        chart: opts.chart.clone(),
        values: opts.values.clone(),
        chart_values: chart_values(&opts.s3, &opts.image),
        busybox: opts.busybox.clone(),
        host_network: opts.host_network,
        pull_never: false,
        local: None,
        work: tempfile::tempdir()?,
    };
    // Nothing is touched unless the cluster has none of what the e2e creates: the cleanup
    // afterwards removes those names.
    preflight(&env).await?;
    let result = scenarios(&mut env, None).await;
    say("removing what the e2e created (test namespace, PVs, the release)");
    let cleaned = cleanup(&env).await;
    result?;
    cleaned?;
    say(&format!(
        "real-node e2e on an existing cluster passed in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// `next_image`: what the node DaemonSet is rolled to in scenario h (`None`: the same image, the
/// pods rolled by a changed annotation).
async fn scenarios(env: &mut Env, next_image: Option<&str>) -> Result<()> {
    install(env).await?;
    // The datasets the read scenarios use, with their checksums beside them.
    let imagenet = upload_dataset(env, "datasets/imagenet/", 1, 24).await?;
    let mini = upload_dataset(env, "mountpoint/mini/", 2, 16).await?;
    dynamic_rwx(env).await?;
    static_rox(env, &mini).await?;
    existing_dataset(env, &imagenet).await?;
    if env.local.is_some() {
        pod_identity(env).await?;
    } else {
        skipped("d. pod-level identity", "moto's IAM and STS");
    }
    non_root(env).await?;
    if env.local.is_some() {
        unpublish_on_delete(env).await?;
        kubelet_restart(env).await?;
    } else {
        skipped("f. unpublish on pod deletion", "the node's mount table");
        skipped("g. kubelet restarted under a reader", "the node's kubelet");
    }
    rolling_update(env, next_image).await?;
    Ok(())
}

fn skipped(what: &str, needs: &str) {
    println!("\x1b[1m==> {what}: skipped on an existing cluster (needs {needs})\x1b[0m");
}

/// The static PVs the scenarios create.
const STATIC_PVS: [&str; 2] = ["s3-pv", "pod-identity"];

/// Fails unless the cluster holds none of what [`scenarios`] creates (and [`cleanup`] removes):
/// the two namespaces, a Ferry CSIDriver (another release), the StorageClasses, the static PVs.
async fn preflight(env: &Env) -> Result<()> {
    let kube = &env.kube;
    let mut found = Vec::new();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(kube.clone());
    for ns in [SYSTEM_NS, NS] {
        if namespaces.get_opt(ns).await?.is_some() {
            found.push(format!("namespace {ns}"));
        }
    }
    let drivers: Api<k8s_openapi::api::storage::v1::CSIDriver> = Api::all(kube.clone());
    if drivers.get_opt(ferry_volume::DRIVER_NAME).await?.is_some() {
        found.push(format!(
            "CSIDriver {} (a Ferry release)",
            ferry_volume::DRIVER_NAME
        ));
    }
    let classes: Api<k8s_openapi::api::storage::v1::StorageClass> = Api::all(kube.clone());
    for class in ["scratch", "datasets"] {
        if classes.get_opt(class).await?.is_some() {
            found.push(format!("StorageClass {class}"));
        }
    }
    let pvs: Api<PersistentVolume> = Api::all(kube.clone());
    for pv in STATIC_PVS {
        if pvs.get_opt(pv).await?.is_some() {
            found.push(format!("PersistentVolume {pv}"));
        }
    }
    ensure!(
        found.is_empty(),
        "the cluster already has what the e2e would create and then remove: {}; nothing was changed",
        found.join(", ")
    );
    Ok(())
}

/// Removes what [`scenarios`] created on an existing cluster (checked absent before by
/// [`preflight`]): the test namespace, the PVs its claims were bound to and the static PVs, the
/// release and its namespace. Every step is tried; the first error is returned.
async fn cleanup(env: &Env) -> Result<()> {
    let mut first_error: Option<anyhow::Error> = None;
    let mut note = |r: Result<()>| {
        if let Err(e) = r {
            println!("    cleanup: {e:#}");
            first_error.get_or_insert(e);
        }
    };
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.kube.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(env.kube.clone(), NS);
    let pvs: Api<PersistentVolume> = Api::all(env.kube.clone());
    // The PVs this run's claims are bound to, and the static ones it created.
    let mut ours: BTreeSet<String> = STATIC_PVS.iter().map(|s| s.to_string()).collect();
    match pvcs.list(&ListParams::default()).await {
        Ok(list) => ours.extend(
            list.items
                .into_iter()
                .filter_map(|c| c.spec.and_then(|s| s.volume_name)),
        ),
        Err(e) => note(Err(e.into())),
    }
    note(delete_namespace(&namespaces, NS).await);
    // Provisioned PVs go through DeleteVolume (so while the release is still installed);
    // retained ones (static, `Retain`) are deleted here.
    note(
        wait_for("the e2e's PVs deleted", INSTALL_TIMEOUT, || async {
            let mut left = Vec::new();
            for name in &ours {
                let Some(pv) = pvs.get_opt(name).await? else {
                    continue;
                };
                let retained = pv
                    .spec
                    .as_ref()
                    .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
                    != Some("Delete");
                if retained && pv.metadata.deletion_timestamp.is_none() {
                    pvs.delete(name, &DeleteParams::default()).await?;
                }
                left.push(name.clone());
            }
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(left.join(", "))
            })
        })
        .await,
    );
    note(helm(env, "uninstall", &["--wait", "--ignore-not-found"]));
    note(delete_namespace(&namespaces, SYSTEM_NS).await);
    match first_error {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// Deletes namespace `ns` and waits until it is gone (with everything in it).
async fn delete_namespace(
    namespaces: &Api<k8s_openapi::api::core::v1::Namespace>,
    ns: &str,
) -> Result<()> {
    let _ = namespaces.delete(ns, &DeleteParams::default()).await;
    wait_for(
        &format!("namespace {ns} deleted"),
        INSTALL_TIMEOUT,
        || async {
            Ok(match namespaces.get_opt(ns).await? {
                None => Ok(()),
                Some(_) => Err("terminating".to_string()),
            })
        },
    )
    .await
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
        env.s3
            .put(&env.target.bucket, &format!("{prefix}{name}"), data)
            .await?;
        names.push(name);
    }
    env.s3
        .put(
            &env.target.bucket,
            &format!("{prefix}SHA256SUMS"),
            Bytes::from(sums),
        )
        .await?;
    Ok(names)
}

/// a. A dynamic RWX PVC: pod A writes files and their checksums, S3 holds exactly those bytes,
/// pod B reads them back; deleting the PVC (`deletePolicy: delete`) empties its prefix and
/// nothing else.
async fn dynamic_rwx(env: &Env) -> Result<()> {
    say("a. dynamic RWX PVC: pod A writes, pod B reads; deleting the PVC empties its prefix only");
    // Besides the files it checksums, pod A writes one through a shell whose child processes
    // inherit it (their exits must not complete it: the node plugin sees them in the node's pid
    // namespace) and has a writer killed mid-file (`kill -9`: nothing may be committed).
    crate::kube::create_pvc(&env.kube, NS, "shared", "scratch", "ReadWriteMany", None).await?;
    let pv = wait_bound(env, "shared").await?;
    let prefix = crate::kube::pv_prefix(&pv)?;
    run_pod(
        env,
        "writer",
        "set -e; mkdir -p /data/run; cd /data/run; \
         for i in 1 2 3 4 5; do head -c $((i * 300007 + 17)) /dev/urandom > part-$i.bin; done; \
         head -c 5 /dev/urandom > tiny.bin; : > empty.bin; \
         sha256sum part-*.bin tiny.bin empty.bin > SHA256SUMS; cat SHA256SUMS; \
         { echo one; sh -c 'exit 0'; echo two; } > forked.txt; \
         exec 3> fd3.txt; echo one >&3; echo two >&3; exec 3>&-; \
         dd if=/dev/urandom of=killed.bin bs=1048576 count=100000 2>/dev/null & dd=$!; \
         sleep 2; kill -9 $dd; wait $dd || echo \"dd killed: $?\"",
        &[("shared", "/data", false)],
        None,
    )
    .await?;
    // Every byte pod A wrote is in S3, as its checksums say.
    let sums = crate::kube::read_object(
        &env.s3,
        &env.target.bucket,
        &format!("{prefix}run/SHA256SUMS"),
    )
    .await?;
    let sums = String::from_utf8(sums.to_vec())?;
    let mut n = 0;
    for line in sums.lines() {
        let (sum, name) = line.split_once("  ").context("a SHA256SUMS line")?;
        let data =
            crate::kube::read_object(&env.s3, &env.target.bucket, &format!("{prefix}run/{name}"))
                .await?;
        ensure!(
            sha256_hex(&data) == sum,
            "s3://{}/{prefix}run/{name}: not the bytes pod writer wrote",
            env.target.bucket
        );
        n += 1;
    }
    ensure!(n == 7, "SHA256SUMS lists {n} files, not 7:\n{sums}");
    println!("    pod writer wrote 7 files; S3 holds the same bytes (sha256)");
    let forked = crate::kube::read_object(
        &env.s3,
        &env.target.bucket,
        &format!("{prefix}run/forked.txt"),
    )
    .await?;
    ensure!(
        &forked[..] == b"one\ntwo\n",
        "forked.txt holds {:?}: a child process's exit completed the file early",
        String::from_utf8_lossy(&forked)
    );
    let fd3 =
        crate::kube::read_object(&env.s3, &env.target.bucket, &format!("{prefix}run/fd3.txt"))
            .await?;
    ensure!(
        &fd3[..] == b"one\ntwo\n",
        "fd3.txt holds {:?}: a shell builtin's redirection completed the file early",
        String::from_utf8_lossy(&fd3)
    );
    let killed = format!("{prefix}run/killed.bin");
    ensure!(
        crate::kube::count(&env.s3, &env.target.bucket, &killed).await? == 0,
        "s3://{}/{killed}: a writer killed mid-file left an object",
        env.target.bucket
    );
    println!(
        "    a child's exit and a builtin's redirection left the file open; a writer killed mid-file left no object"
    );
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
            &env.target.bucket,
            "k8s/ml/outside.txt",
            Bytes::from_static(b"not the volume's\n"),
        )
        .await?;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    delete_pvc_and_wait(env, "shared", &pv_name).await?;
    ensure!(
        crate::kube::count(&env.s3, &env.target.bucket, &prefix).await? == 0,
        "deletePolicy delete: objects left under {prefix}"
    );
    ensure!(
        crate::kube::count(&env.s3, &env.target.bucket, "k8s/ml/outside.txt").await? == 1,
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
    pv["spec"]["csi"]["volumeAttributes"]["bucketName"] = json!(env.target.bucket);
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

/// c. An existing dataset through a dynamic PVC (the existing-prefix annotation, on the datasets
/// class that opts in with `existingPrefix: allow`).
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
    let local = env
        .local
        .as_ref()
        .context("the host checks need the local node")?;
    let target = local
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
    let local = env
        .local
        .as_ref()
        .context("pod identity needs the local node's moto")?;
    say("d. pod-level identity: kubelet's token → STS (moto) → the pod's role; a role that may not read gets EACCES");
    for (sa, role) in [("reader", "pod-reader"), ("lister", "pod-lister")] {
        let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(env.kube.clone(), NS);
        accounts
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": sa, "namespace": NS,
                    "annotations": {"eks.amazonaws.com/role-arn": local.moto_roles[role]}}}))?,
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
                    "endpointUrl": local.moto.endpoint_url(),
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

/// A reader that checks the dataset over and over, printing each pass it finished, until it is
/// deleted; a failed read ends it (exit 1) with the pass it failed in.
const READ_LOOP: &str = "n=0; while true; do \
    (cd /data && sha256sum -c -s SHA256SUMS) || { echo \"read failed in pass $n\"; exit 1; }; \
    n=$((n + 1)); echo \"pass $n\"; done";

/// The passes reader `name` has printed so far; fails once it stopped reading (a failed read).
/// Its log comes through kubelet: while kubelet restarts, this waits for it.
async fn passes(env: &Env, name: &str) -> Result<u64> {
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), NS);
    wait_for(&format!("pod {name}'s log"), POD_TIMEOUT, || async {
        let p = pods.get(name).await?;
        if phase(&p) != "Running" {
            bail!(
                "pod {name} stopped reading ({}):\n{}",
                pod_state(&p),
                pod_log(env, name).await
            );
        }
        Ok(match pods.logs(name, &LogParams::default()).await {
            Ok(log) => Ok(log
                .lines()
                .filter_map(|l| l.strip_prefix("pass "))
                .filter_map(|n| n.trim().parse().ok())
                .max()
                .unwrap_or(0)),
            Err(e) => Err(format!("no log yet: {e}")),
        })
    })
    .await
}

/// Waits until the reader has finished three more passes than `from` (the passes it had printed
/// when the event the caller waited for was over): the first may have started before it, so at
/// least two whole passes over the dataset started after it.
async fn two_more_passes(env: &Env, name: &str, from: u64) -> Result<u64> {
    wait_for(
        &format!("pod {name} to read the dataset twice more"),
        POD_TIMEOUT,
        || async {
            let n = passes(env, name).await?;
            Ok(if n >= from + 3 {
                Ok(n)
            } else {
                Err(format!("{n} passes"))
            })
        },
    )
    .await
}

/// Starts the looping reader `name` on the `imagenet` PVC and waits until it has finished a pass.
/// Returns the node it runs on.
async fn start_reader(env: &Env, name: &str) -> Result<String> {
    create_pod(env, name, READ_LOOP, &[("imagenet", "/data", true)], None).await?;
    let pod = wait_running(env, name).await?;
    wait_for(
        &format!("pod {name} to read the dataset once"),
        POD_TIMEOUT,
        || async {
            let n = passes(env, name).await?;
            Ok(if n >= 1 {
                Ok(())
            } else {
                Err("0 passes".into())
            })
        },
    )
    .await?;
    pod.spec
        .and_then(|s| s.node_name)
        .with_context(|| format!("pod {name} runs on no node"))
}

/// Stops the looping reader (it is still reading: no read failed) and returns its passes.
async fn stop_reader(env: &Env, name: &str) -> Result<u64> {
    let passes = passes(env, name).await?;
    delete_pod(env, name).await?;
    Ok(passes)
}

/// g. kubelet killed and started again while a pod reads: the pod keeps reading.
async fn kubelet_restart(env: &mut Env) -> Result<()> {
    say("g. kubelet restarted (kill -9, start) while a pod reads");
    start_reader(env, "reader-g").await?;
    let kube = env.kube.clone();
    let restarted = k8s_openapi::jiff::Timestamp::now();
    env.local
        .as_mut()
        .context("restarting kubelet needs the local node")?
        .node
        .restart_kubelet(&kube)
        .await?;
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
    let at_restart = passes(env, "reader-g").await?;
    let after = two_more_passes(env, "reader-g", at_restart).await?;
    let total = stop_reader(env, "reader-g").await?;
    println!(
        "    {total} passes over the dataset, {} of them after the new kubelet renewed its Lease; no failed read",
        total.max(after) - at_restart
    );
    Ok(())
}

/// h. The node DaemonSet rolled (to `next_image`, or by a changed pod annotation) while a pod
/// reads: the new node pod on the reader's node takes the live mount over from the old one (a
/// handover, not a crash recovery); no read fails.
async fn rolling_update(env: &Env, next_image: Option<&str>) -> Result<()> {
    let how = match next_image {
        Some(_) => "to a new image tag",
        None => "by a changed pod annotation",
    };
    say(&format!(
        "h. node DaemonSet rolled {how} (helm upgrade) while a pod reads"
    ));
    let node = start_reader(env, "reader-h").await?;
    let rolled_at = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut set = vec![
        "--set-string".to_string(),
        format!("node.podAnnotations.e2e\\.ferry\\.dev/rolled-at={rolled_at}"),
    ];
    if let Some(next) = next_image {
        let (_, tag) = next.rsplit_once(':').context("name:tag")?;
        set.extend(["--set".to_string(), format!("image.tag={tag}")]);
    }
    let set: Vec<&str> = set.iter().map(String::as_str).collect();
    helm(env, "upgrade", &set)?;
    let dss: Api<DaemonSet> = Api::namespaced(env.kube.clone(), SYSTEM_NS);
    let pods: Api<Pod> = Api::namespaced(env.kube.clone(), SYSTEM_NS);
    let rolled = |p: &Pod| {
        p.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("e2e.ferry.dev/rolled-at"))
            == Some(&rolled_at)
    };
    let new_pod = wait_for("the node DaemonSet rolled out", INSTALL_TIMEOUT, || async {
        let ds = dss.get(&format!("{RELEASE}-node")).await?;
        let generation = ds.metadata.generation.unwrap_or_default();
        let st = ds.status.unwrap_or_default();
        let on_node: Vec<Pod> = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=node"))
            .await?
            .items
            .into_iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node))
            .collect();
        // Only the reader's node: on a large cluster the rest rolls one node at a time.
        let ready = |p: &Pod| {
            p.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .is_some_and(|cs| !cs.is_empty() && cs.iter().all(|c| c.ready))
        };
        let done = st.observed_generation == Some(generation)
            && on_node.len() == 1
            && rolled(&on_node[0])
            && ready(&on_node[0]);
        Ok(match (done, on_node.first()) {
            (true, Some(p)) => Ok(p.metadata.name.clone().unwrap_or_default()),
            _ => Err(format!(
                "node pods on {node}: {} ({})",
                on_node.len(),
                on_node.iter().map(pod_state).collect::<Vec<_>>().join("; ")
            )),
        })
    })
    .await?;
    // The new node pod took the live mount over from the old one (not a crash recovery).
    let log = pods
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
    let at_rollout = passes(env, "reader-h").await?;
    two_more_passes(env, "reader-h", at_rollout).await?;
    let total = stop_reader(env, "reader-h").await?;
    println!(
        "    {new_pod} ({}) took the mounts over; {total} passes over the dataset, {} after the old pod was gone; 0 failed reads",
        next_image.unwrap_or("the same image"),
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
            // own; the local node has only the loopback plugin (nothing may leave the machine).
            "hostNetwork": env.host_network,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "main",
                "image": env.busybox,
                "imagePullPolicy": if env.pull_never { "Never" } else { "IfNotPresent" },
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

/// The chart's values on any cluster: the Ferry image, the S3 endpoint, static keys from a
/// Secret (as the README's "Credentials" shows) when there are keys, and the two StorageClasses
/// the scenarios use. Nothing else differs from the chart's defaults.
fn chart_values(target: &S3Target, image: &str) -> Value {
    let (repo, tag) = image_parts(image);
    let mut s3 = json!({"region": target.region, "forcePathStyle": target.force_path_style});
    if let Some(url) = &target.endpoint_url {
        s3["endpointUrl"] = json!(url);
    }
    let mut v = json!({
        "image": {"repository": repo, "tag": tag},
        "s3": s3,
        "storageClasses": [
            {"name": "scratch", "bucketName": target.bucket, "basePrefix": "k8s",
             "prefixTemplate": "${pvc.namespace}/${pvc.name}/${pv.name}", "deletePolicy": "delete",
             "mountOptions": ["allow-delete"]},
            {"name": "datasets", "bucketName": target.bucket, "basePrefix": "datasets",
             "existingPrefix": "allow"},
        ],
    });
    if let Some(keys) = &target.keys {
        let env = key_env(keys, &[]);
        v["controller"] = json!({"extraEnv": env});
        v["node"] = json!({"extraEnv": env});
    }
    v
}

/// The driver's environment with the keys from the `s3-keys` Secret, then `more`.
fn key_env(keys: &StaticKeys, more: &[Value]) -> Value {
    let mut env = vec![
        json!({"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3-keys", "key": "access-key"}}}),
        json!({"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "s3-keys", "key": "secret-key"}}}),
    ];
    if keys.session_token.is_some() {
        env.push(json!({"name": "AWS_SESSION_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s3-keys", "key": "session-token"}}}));
    }
    env.extend_from_slice(more);
    Value::Array(env)
}

/// `repository` and `tag` of an image reference (`registry:5000/ferry:1.0`: the tag is after the
/// last `:` that follows the last `/`; none: `latest`).
fn image_parts(image: &str) -> (&str, &str) {
    match image.rsplit_once(':') {
        Some((repo, tag)) if !tag.contains('/') => (repo, tag),
        _ => (image, "latest"),
    }
}

/// What the local node needs beside [`chart_values`]: the imported images (never pulled), and
/// what a cluster whose only network is the node's loopback needs.
fn local_values(local: &Local, cluster: &KubeCluster, images: &Images, target: &S3Target) -> Value {
    let port = cluster
        .server()
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_string();
    let (prov_repo, prov_tag) = images.provisioner.rsplit_once(':').expect("name:tag");
    // The region is given and the instance metadata service off, so nothing leaves loopback.
    let keys = target.keys.as_ref().expect("the local run has static keys");
    let env = key_env(
        keys,
        &[
            json!({"name": "AWS_REGION", "value": target.region}),
            json!({"name": "AWS_EC2_METADATA_DISABLED", "value": "true"}),
            // Pod-level identity: STS is moto (AssumeRoleWithWebIdentity).
            json!({"name": "AWS_ENDPOINT_URL_STS", "value": local.moto.endpoint_url()}),
        ],
    );
    // On the host network every port is the host's: free ones, and four different ones (each
    // port's listener is held until all four are chosen: one at a time, the kernel may hand out
    // the same port twice, and a node plugin whose metrics and health ports clash never starts).
    let [metrics, controller_metrics, controller_health, node_health] = free_ports();
    json!({
        "image": {"pullPolicy": "Never"},
        "sidecars": {"provisioner": {"image": {"repository": prov_repo, "tag": prov_tag, "pullPolicy": "Never"}}},
        "kubernetesApi": {"host": "127.0.0.1", "port": port},
        // moto, for the pod-identity volume.
        "s3": {"allowedEndpoints": [local.moto.endpoint_url()]},
        "metrics": {"port": metrics},
        "controller": {
            // One replica: on the host network the chart allows one per node.
            "replicas": 1,
            "hostNetwork": true,
            "metricsPort": controller_metrics,
            "healthPort": controller_health,
            "extraEnv": env,
        },
        "node": {
            "hostNetwork": true,
            "healthPort": node_health,
            "kubeletDir": local.node.kubelet_dir().display().to_string(),
            "cache": {"hostPath": local.node.dir().join("cache").display().to_string()},
            "extraEnv": env,
        },
    })
}

/// `b` into `a`: maps key by key, anything else replaced (as Helm merges values files).
fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

/// `helm install` of the chart; waits for the controller and node pods and for every node's
/// CSINode to list the driver (kubelet registered it).
async fn install(env: &mut Env) -> Result<()> {
    say("helm install ferry charts/ferry (its own ServiceAccounts and RBAC)");
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.kube.clone());
    for ns in [SYSTEM_NS, NS] {
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
            )
            .await
            .with_context(|| format!("creating namespace {ns} (left by an earlier run?)"))?;
    }
    if let Some(keys) = &env.target.keys {
        let secrets: Api<k8s_openapi::api::core::v1::Secret> =
            Api::namespaced(env.kube.clone(), SYSTEM_NS);
        let mut data = json!({"access-key": keys.id, "secret-key": keys.secret});
        if let Some(token) = &keys.session_token {
            data["session-token"] = json!(token);
        }
        secrets
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "s3-keys"},
                    "stringData": data,
                }))?,
            )
            .await
            .context("creating the S3 keys Secret")?;
    }
    let ours = env.work.path().join("values.yaml");
    std::fs::write(&ours, serde_json::to_string_pretty(&env.chart_values)?)?;
    env.values.insert(0, ours);
    helm(env, "install", &[])?;
    wait_chart_pods(env).await?;
    let node_pods: Api<Pod> = Api::namespaced(env.kube.clone(), SYSTEM_NS);
    let nodes: BTreeSet<String> = node_pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=node"))
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.spec.and_then(|s| s.node_name))
        .collect();
    let csinodes: Api<CSINode> = Api::all(env.kube.clone());
    wait_for(
        "every node's CSINode to list s3.csi.ferry.dev (kubelet registered the driver)",
        INSTALL_TIMEOUT,
        || async {
            let mut missing = Vec::new();
            for node in &nodes {
                let drivers: Vec<String> = csinodes
                    .get_opt(node)
                    .await?
                    .map(|n| n.spec.drivers.into_iter().map(|d| d.name).collect())
                    .unwrap_or_default();
                if !drivers.iter().any(|d| d == ferry_volume::DRIVER_NAME) {
                    missing.push(format!("{node}: {drivers:?}"));
                }
            }
            Ok(if missing.is_empty() {
                Ok(())
            } else {
                Err(missing.join("; "))
            })
        },
    )
    .await?;
    println!(
        "    controller and node pods Running; the CSINode of {} node(s) lists {}",
        nodes.len(),
        ferry_volume::DRIVER_NAME
    );
    Ok(())
}

/// `helm <verb>` of the release: `install` and `upgrade` from the chart with the values files,
/// plus `extra` arguments; any other verb (`uninstall`) with `extra` only.
fn helm(env: &Env, verb: &str, extra: &[&str]) -> Result<()> {
    let bin = ferry_testkit::kube::tool_path("helm")
        .context("helm not found: scripts/kube-tools.sh builds it")?;
    let chart = env.chart.display().to_string();
    let values: Vec<String> = env.values.iter().map(|v| v.display().to_string()).collect();
    let mut args = vec![verb, RELEASE];
    if verb == "install" || verb == "upgrade" {
        args.push(&chart);
        for v in &values {
            args.extend(["--values", v.as_str()]);
        }
    }
    args.extend(["--namespace", SYSTEM_NS]);
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

/// `N` different ports free on this machine now: every listener is held until all are bound.
fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("binding 127.0.0.1:0"))
        .collect();
    std::array::from_fn(|i| {
        listeners[i]
            .local_addr()
            .expect("a bound listener's address")
            .port()
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_reference_splits_at_the_tag_not_at_a_registry_port() {
        assert_eq!(
            image_parts("ghcr.io/you/ferry:0.1.0"),
            ("ghcr.io/you/ferry", "0.1.0")
        );
        assert_eq!(
            image_parts("registry:5000/ferry:e2e"),
            ("registry:5000/ferry", "e2e")
        );
        assert_eq!(
            image_parts("registry:5000/ferry"),
            ("registry:5000/ferry", "latest")
        );
        assert_eq!(image_parts("ferry"), ("ferry", "latest"));
    }

    #[test]
    fn values_merge_as_helm_merges_values_files() {
        let mut a = json!({"image": {"repository": "r", "tag": "t"}, "node": {"extraEnv": [1, 2]}});
        merge(
            &mut a,
            json!({"image": {"pullPolicy": "Never"}, "node": {"extraEnv": [3]}, "x": 1}),
        );
        assert_eq!(
            a,
            json!({"image": {"repository": "r", "tag": "t", "pullPolicy": "Never"},
                   "node": {"extraEnv": [3]}, "x": 1})
        );
    }
}
