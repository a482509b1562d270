//! The Kubernetes-level e2e (`ferry-harness kube`): Ferry under a real API server and the real
//! csi-provisioner, with this process playing kubelet.
//!
//! 1. A cluster: our own [`KubeCluster`] (etcd + kube-apiserver + kube-controller-manager on
//!    loopback), or any cluster through `--kubeconfig` (kind, EKS, ...).
//! 2. The chart (`charts/ferry`) rendered with `helm template` and every object sent to the API
//!    server as a server-side dry run (strict field validation) — on our own cluster also against
//!    a second kube-apiserver emulating Kubernetes [`MIN_KUBE_VERSION`] — then applied for real on
//!    our own cluster (on someone else's only with `--apply-chart`: its Deployment would run a second
//!    provisioner for the same driver next to ours).
//! 3. versitygw, `ferry-controller` (reading PVCs with `--kubeconfig`) and `ferry-node` locally;
//!    csi-provisioner with `--extra-create-metadata` against the controller's unix socket.
//! 4. StorageClasses and PVCs; bound PVs whose prefixes follow the template; NodePublishVolume with
//!    the PV's volume context, pod info and a TokenRequest-issued service account token, as kubelet
//!    sends them; reads and writes through the FUSE mount checked in S3; NodeUnpublishVolume;
//!    PVC deletion and DeleteVolume for both delete policies.
//! 5. Existing datasets: a PVC annotated `s3.csi.ferry.dev/existing-prefix` binds to the preloaded
//!    prefix on the class that opts in (`existingPrefix: allow`); one outside `basePrefix`, one on
//!    a `deletePolicy: delete` class (opted in all the same), and one naming another PVC's prefix
//!    on a class without the opt-in are refused, and the refusal reaches the PVC's events.
//!
//! Every wait has an explicit deadline; nothing asserts on timing.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use ferry_proto::csi::v1 as pb;
use ferry_s3::S3Store;
use ferry_store::{ListRequest, ObjectStore};
use ferry_testkit::apply::{apply, describe, parse_documents, DryRun};
use ferry_testkit::kube::{
    create_token, load_kubeconfig, tool_path, KubeCluster, KubeClusterOptions, ServiceAccountToken,
};
use ferry_volume::keys;
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client};
use pb::volume_capability::access_mode::Mode;
use secrecy::ExposeSecret;
use serde_json::{json, Value};

use crate::{mount_capability, Plugin};

/// How long a PVC may take to bind (provisioner start-up and resync included).
pub const BIND_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a deleted PVC's PV may take to go away (DeleteVolume included).
pub const DELETE_TIMEOUT: Duration = Duration::from_secs(120);
/// The field manager of everything the e2e applies.
pub const FIELD_MANAGER: &str = "ferry-e2e";
const BUCKET: &str = "ferry-e2e";

/// What `ferry-harness kube` was asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// A cluster to run against instead of starting one.
    pub kubeconfig: Option<PathBuf>,
    /// The chart to render (default `charts/ferry` of this repository).
    pub chart: PathBuf,
    /// Apply the chart for real (always on our own cluster).
    pub apply_chart: bool,
    /// Where `ferry-controller` and `ferry-node` are.
    pub bins: PathBuf,
}

fn say(s: &str) {
    println!("\x1b[1m==> {s}\x1b[0m");
}

/// Polls `check` every 250 ms until it returns `Some`, or fails after `timeout` naming `what` and
/// the last state `check` described.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<std::result::Result<T, String>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check().await? {
            Ok(v) => return Ok(v),
            Err(state) => state,
        };
        if Instant::now() > deadline {
            bail!("{what}: not done within {timeout:?} (last state: {last})");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A child process killed on drop, its output in a log file.
struct Proc {
    name: String,
    child: std::sync::Mutex<Child>,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &str, bin: &Path, args: &[String], log: PathBuf) -> Result<Proc> {
        let f = std::fs::File::create(&log)?;
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Proc {
            name: name.into(),
            child: std::sync::Mutex::new(child),
            log,
        })
    }

    fn check_alive(&self) -> Result<()> {
        let status = self.child.lock().expect("child lock").try_wait()?;
        if let Some(status) = status {
            bail!(
                "{} exited with {status}:\n{}",
                self.name,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let child = self.child.get_mut().expect("child lock");
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Runs the whole e2e.
pub async fn run(opts: Options) -> Result<()> {
    let started = Instant::now();
    let (mut cluster, kubeconfig) = match &opts.kubeconfig {
        Some(k) => {
            say(&format!("using the cluster of {}", k.display()));
            (None, k.clone())
        }
        None => {
            say("starting etcd, kube-apiserver and kube-controller-manager on 127.0.0.1");
            let t0 = Instant::now();
            let c = KubeCluster::start().await?;
            for (name, d) in &c.startup {
                println!("    {name:<24} ready after {:.1} s", d.as_secs_f64());
            }
            println!(
                "    control plane ready in {:.1} s; logs in {}",
                t0.elapsed().as_secs_f64(),
                c.dir().display()
            );
            let k = c.kubeconfig().to_path_buf();
            (Some(c), k)
        }
    };
    let config = load_kubeconfig(&kubeconfig).await?;
    let server = config.cluster_url.to_string();
    let server = server.trim_end_matches('/').to_string();
    let kube = Client::try_from(config)?;
    let git_version = kube.apiserver_version().await?.git_version;
    println!("    API server {git_version} at {server}");

    let ns = format!("ferry-e2e-{}", std::process::id());
    let namespace = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
    apply(&kube, &namespace, &ns, FIELD_MANAGER, DryRun::No)
        .await
        .context("creating the test namespace")?;
    let result = steps(
        &opts,
        &kube,
        &kubeconfig,
        &ns,
        &git_version,
        cluster.is_some(),
    )
    .await;
    // Clean up what we created on someone else's cluster (our own one goes away entirely).
    if cluster.is_none() {
        let classes: Api<StorageClass> = Api::all(kube.clone());
        for sc in ["delete", "retain", "datasets"] {
            let _ = classes
                .delete(&format!("{ns}-{sc}"), &DeleteParams::default())
                .await;
        }
        let namespaces: Api<Namespace> = Api::all(kube.clone());
        let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    }
    if let (Err(_), Some(c)) = (&result, &mut cluster) {
        println!("    control plane logs kept: {}", c.keep_dir().display());
    }
    result?;
    say(&format!(
        "kube e2e passed in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

async fn steps(
    opts: &Options,
    kube: &Client,
    kubeconfig: &Path,
    ns: &str,
    kube_version: &str,
    own_cluster: bool,
) -> Result<()> {
    chart(
        opts,
        kube,
        ns,
        kube_version,
        own_cluster || opts.apply_chart,
        own_cluster,
    )
    .await?;

    say("starting versitygw, ferry-controller (--kubeconfig) and ferry-node");
    let kc = kubeconfig.display().to_string();
    let mut plugin = Plugin::start_with(&opts.bins, &["--kubeconfig", &kc]).await?;
    let result = scenario(kube, &kc, ns, &plugin).await;
    if result.is_err() {
        // Logs of ferry-controller, ferry-node and csi-provisioner, for the post-mortem.
        let dir = std::mem::replace(&mut plugin.dir, tempfile::tempdir()?);
        println!("    process logs kept: {}", dir.keep().display());
    }
    result
}

/// Everything after the chart, with the plugin running.
async fn scenario(kube: &Client, kc: &str, ns: &str, plugin: &Plugin) -> Result<()> {
    plugin.s3.create_bucket(BUCKET).await;
    let s3 = S3Store::new(plugin.s3.s3_config()).await?;

    say("starting csi-provisioner against ferry-controller's unix socket");
    let provisioner_bin = tool_path("csi-provisioner").context(
        "csi-provisioner not found: build it with ./scripts/kube-tools.sh or set FERRY_TOOLS",
    )?;
    let provisioner = Proc::spawn(
        "csi-provisioner",
        &provisioner_bin,
        &[
            format!("--csi-address={}", plugin.controller_socket.display()),
            format!("--kubeconfig={kc}"),
            "--extra-create-metadata".into(),
            "--leader-election=false".into(),
            "--feature-gates=Topology=false".into(),
            "--timeout=60s".into(),
            "--retry-interval-start=1s".into(),
            "--retry-interval-max=5s".into(),
            "--v=3".into(),
        ],
        plugin.dir.path().join("csi-provisioner.log"),
    )?;
    println!(
        "    logs in {} (ferry-controller.log, ferry-node.log, csi-provisioner.log)",
        plugin.dir.path().display()
    );

    // The pod's service account, whose token kubelet would hand the driver.
    let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "trainer", "namespace": ns}});
    apply(kube, &sa, ns, FIELD_MANAGER, DryRun::No).await?;

    say("StorageClasses: delete (k8s/${pvc.namespace}/${pvc.name}/${pv.name}, existingPrefix allow), retain (k8s/${pvc.namespace}/${pvc.name}), datasets (basePrefix datasets, existingPrefix allow)");
    for (suffix, base, template, policy, existing) in [
        (
            "delete",
            "k8s",
            "${pvc.namespace}/${pvc.name}/${pv.name}",
            "delete",
            // Opted in, and still refused: deleting the PVC would delete the existing data.
            Some("allow"),
        ),
        (
            "retain",
            "k8s",
            "${pvc.namespace}/${pvc.name}",
            "retain",
            None,
        ),
        (
            "datasets",
            "datasets",
            "${volume.name}",
            "retain",
            Some("allow"),
        ),
    ] {
        let mut sc = json!({
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": format!("{ns}-{suffix}")},
            "provisioner": ferry_volume::DRIVER_NAME,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
            "mountOptions": ["allow-delete"],
            "parameters": {
                keys::BUCKET_NAME: BUCKET,
                keys::BASE_PREFIX: base,
                keys::PREFIX_TEMPLATE: template,
                keys::DELETE_POLICY: policy,
            },
        });
        if let Some(v) = existing {
            sc["parameters"][keys::EXISTING_PREFIX] = json!(v);
        }
        apply(kube, &sc, ns, FIELD_MANAGER, DryRun::No).await?;
    }

    // --- deletePolicy: delete, through a real mount -------------------------------------------
    say("PVC train (deletePolicy delete): waiting for a bound PV");
    let t0 = Instant::now();
    create_pvc(
        kube,
        ns,
        "train",
        &format!("{ns}-delete"),
        "ReadWriteOnce",
        None,
    )
    .await?;
    let pv = wait_bound(kube, ns, "train", &provisioner).await?;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let prefix = pv_prefix(&pv)?;
    println!(
        "    bound to {pv_name} after {:.1} s; prefix {prefix}",
        t0.elapsed().as_secs_f64()
    );
    ensure!(
        prefix == format!("k8s/{ns}/train/{pv_name}/"),
        "PV {pv_name}: prefix {prefix:?} does not follow the template k8s/${{pvc.namespace}}/${{pvc.name}}/${{pv.name}}"
    );
    let driver = pv_csi(&pv)?.driver.clone();
    ensure!(
        driver == ferry_volume::DRIVER_NAME,
        "PV {pv_name}: driver {driver}"
    );

    let token = create_token(kube, ns, "trainer", &["sts.amazonaws.com"], 3600).await?;
    let target = plugin.target_path("pod-train", &pv_name)?;
    say(&format!(
        "NodePublishVolume (as kubelet) at {}",
        target.display()
    ));
    let mut node = plugin.node().await?;
    node.node_publish_volume(publish_request(
        &pv,
        &target,
        ns,
        "pod-train",
        &token,
        Mode::SingleNodeWriter,
    )?)
    .await
    .context("NodePublishVolume")?;
    let written = crate::payload(7, 300_000);
    std::fs::write(target.join("model.ckpt"), &written).context("writing through the mount")?;
    let key = format!("{prefix}model.ckpt");
    ensure!(
        read_object(&s3, BUCKET, &key).await? == written,
        "s3://{BUCKET}/{key} does not hold the bytes written through the mount"
    );
    let uploaded = Bytes::from_static(b"uploaded through S3\n");
    s3.put(
        BUCKET,
        &format!("{prefix}notes/readme.txt"),
        uploaded.clone(),
    )
    .await?;
    ensure!(
        std::fs::read(target.join("notes/readme.txt"))? == uploaded,
        "an object put through S3 does not read back through the mount"
    );
    println!(
        "    300000 bytes written through the mount are in S3; an S3 upload reads back through it"
    );
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: pv_handle(&pv)?,
        target_path: target.display().to_string(),
    })
    .await
    .context("NodeUnpublishVolume")?;
    ensure!(
        !target.exists(),
        "{} still exists after NodeUnpublishVolume",
        target.display()
    );

    s3.put(BUCKET, &format!("k8s/{ns}/outside.txt"), uploaded.clone())
        .await?;
    say("deleting PVC train: DeleteVolume must empty its prefix and nothing else");
    delete_pvc_and_wait(kube, ns, "train", &pv_name, &provisioner).await?;
    ensure!(
        count(&s3, BUCKET, &prefix).await? == 0,
        "deletePolicy delete: objects left under {prefix}"
    );
    ensure!(
        count(&s3, BUCKET, &format!("k8s/{ns}/outside.txt")).await? == 1,
        "deletePolicy delete removed an object outside the volume's prefix"
    );
    println!("    {prefix} is empty; k8s/{ns}/outside.txt kept");

    // --- deletePolicy: retain -----------------------------------------------------------------
    say("PVC notes (deletePolicy retain): bound, written, deleted: the data stays");
    create_pvc(
        kube,
        ns,
        "notes",
        &format!("{ns}-retain"),
        "ReadWriteOnce",
        None,
    )
    .await?;
    let pv = wait_bound(kube, ns, "notes", &provisioner).await?;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let prefix = pv_prefix(&pv)?;
    ensure!(
        prefix == format!("k8s/{ns}/notes/"),
        "PV {pv_name}: prefix {prefix:?} does not follow k8s/${{pvc.namespace}}/${{pvc.name}}"
    );
    s3.put(BUCKET, &format!("{prefix}keep.txt"), uploaded.clone())
        .await?;
    delete_pvc_and_wait(kube, ns, "notes", &pv_name, &provisioner).await?;
    ensure!(
        count(&s3, BUCKET, &prefix).await? == 1,
        "deletePolicy retain: {prefix}keep.txt is gone"
    );
    println!("    {prefix}keep.txt kept after the PV was deleted");

    // --- existing datasets ----------------------------------------------------------------------
    say("existing dataset: PVC imagenet annotated existing-prefix datasets/imagenet/train/");
    let mut dataset = Vec::new();
    for i in 0..3 {
        let (k, v) = (format!("shard-{i:03}.tar"), crate::payload(100 + i, 50_000));
        s3.put(BUCKET, &format!("datasets/imagenet/train/{k}"), v.clone())
            .await?;
        dataset.push((k, v));
    }
    create_pvc(
        kube,
        ns,
        "imagenet",
        &format!("{ns}-datasets"),
        "ReadOnlyMany",
        Some("datasets/imagenet/train/"),
    )
    .await?;
    let pv = wait_bound(kube, ns, "imagenet", &provisioner).await?;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let prefix = pv_prefix(&pv)?;
    ensure!(
        prefix == "datasets/imagenet/train/",
        "PV {pv_name}: prefix {prefix:?}, not the annotated dataset prefix"
    );
    let target = plugin.target_path("pod-imagenet", &pv_name)?;
    node.node_publish_volume(publish_request(
        &pv,
        &target,
        ns,
        "pod-imagenet",
        &token,
        Mode::MultiNodeReaderOnly,
    )?)
    .await
    .context("NodePublishVolume of the dataset")?;
    for (k, v) in &dataset {
        let got = std::fs::read(target.join(k)).with_context(|| format!("reading {k}"))?;
        ensure!(
            got == *v,
            "{k} read through the mount differs from the preloaded object"
        );
    }
    let err = std::fs::write(target.join("new.txt"), b"x")
        .err()
        .context("a write to the ReadOnlyMany dataset mount succeeded")?;
    ensure!(
        err.raw_os_error() == Some(libc::EROFS),
        "writing to the read-only dataset: {err}, not EROFS"
    );
    println!("    3 preloaded shards read through the mount; writes refused with EROFS");
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: pv_handle(&pv)?,
        target_path: target.display().to_string(),
    })
    .await?;
    delete_pvc_and_wait(kube, ns, "imagenet", &pv_name, &provisioner).await?;
    ensure!(
        count(&s3, BUCKET, "datasets/imagenet/train/").await? == 3,
        "the dataset was touched by deleting its PVC"
    );
    println!("    PVC deleted, dataset kept");

    say("refused: existing-prefix outside basePrefix, on a deletePolicy delete class, and another PVC's prefix on a class without existingPrefix allow");
    create_pvc(
        kube,
        ns,
        "outside",
        &format!("{ns}-datasets"),
        "ReadOnlyMany",
        Some("k8s/elsewhere/"),
    )
    .await?;
    create_pvc(
        kube,
        ns,
        "wipe",
        &format!("{ns}-delete"),
        "ReadOnlyMany",
        Some("k8s/shared/"),
    )
    .await?;
    // The prefix PVC notes had on the retain class (its data is still there): the class never
    // opted in, so no other PVC may bind it.
    let notes_prefix = format!("k8s/{ns}/notes/");
    create_pvc(
        kube,
        ns,
        "sneak",
        &format!("{ns}-retain"),
        "ReadWriteMany",
        Some(&notes_prefix),
    )
    .await?;
    let events: Api<Event> = Api::namespaced(kube.clone(), ns);
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(kube.clone(), ns);
    for (pvc, value, why) in [
        (
            "outside",
            "k8s/elsewhere/",
            "is not below the StorageClass's basePrefix",
        ),
        ("wipe", "k8s/shared/", "deletePolicy: delete"),
        ("sneak", notes_prefix.as_str(), "existingPrefix: allow"),
    ] {
        let msg = wait_for(
            &format!("a ProvisioningFailed event on PVC {pvc}"),
            BIND_TIMEOUT,
            || async {
                provisioner.check_alive()?;
                let events = events
                    .list(&ListParams::default().fields(&format!(
                        "involvedObject.kind=PersistentVolumeClaim,involvedObject.name={pvc}"
                    )))
                    .await?
                    .items;
                let found = events.iter().find_map(|e| {
                    let m = e.message.as_deref().unwrap_or_default();
                    (e.reason.as_deref() == Some("ProvisioningFailed")
                        && m.contains(keys::EXISTING_PREFIX_ANNOTATION))
                    .then(|| m.to_string())
                });
                Ok(found.ok_or_else(|| format!("{} events, none with the refusal", events.len())))
            },
        )
        .await?;
        ensure!(
            msg.contains("InvalidArgument") && msg.contains(value) && msg.contains(why),
            "PVC {pvc}: the event does not name the code, the prefix and the reason: {msg}"
        );
        let phase = pvcs.get(pvc).await?.status.and_then(|s| s.phase);
        ensure!(
            phase.as_deref() == Some("Pending"),
            "PVC {pvc} is {phase:?}, not Pending"
        );
        println!("    {pvc}: {msg}");
    }

    provisioner.check_alive()?;
    plugin.check_logs_for_secrets(&[token.token.expose_secret()])?;
    let prov_log = std::fs::read_to_string(&provisioner.log).unwrap_or_default();
    ensure!(
        !prov_log.contains(token.token.expose_secret()),
        "csi-provisioner's log contains the service account token"
    );
    Ok(())
}

/// The oldest Kubernetes minor version the chart must be accepted by; on our own cluster the chart
/// is also dry-run against a kube-apiserver started with `--emulated-version` of it.
pub const MIN_KUBE_VERSION: &str = "1.33";

/// Renders the chart, sends every object as a server-side dry run, then (if `persist`) applies it.
/// With `check_min_version`, also renders it for [`MIN_KUBE_VERSION`] and dry-runs it against a
/// second API server emulating that version.
async fn chart(
    opts: &Options,
    kube: &Client,
    ns: &str,
    kube_version: &str,
    persist: bool,
    check_min_version: bool,
) -> Result<()> {
    say(&format!("helm template {}", opts.chart.display()));
    let version = kube_version.trim_start_matches('v');
    let version = version.split(['-', '+']).next().unwrap_or(version);
    let objects = render(&opts.chart, ns, version)?;
    dry_run(kube, &objects, ns).await?;
    println!(
        "    {} objects accepted by kube-apiserver {kube_version} (dryRun=All, fieldValidation=Strict)",
        objects.len()
    );
    if check_min_version {
        let t0 = Instant::now();
        let mut old = KubeCluster::start_with(KubeClusterOptions {
            emulated_version: Some(MIN_KUBE_VERSION.into()),
            controller_manager: false,
            ..Default::default()
        })
        .await?;
        let old_kube = old.client().await?;
        let result = async {
            let namespace =
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            apply(&old_kube, &namespace, ns, FIELD_MANAGER, DryRun::No).await?;
            let objects = render(&opts.chart, ns, &format!("{MIN_KUBE_VERSION}.0"))?;
            dry_run(&old_kube, &objects, ns).await?;
            Ok::<_, anyhow::Error>(objects.len())
        }
        .await;
        match result {
            Ok(n) => println!(
                "    {n} objects accepted by kube-apiserver --emulated-version={MIN_KUBE_VERSION} (started and checked in {:.1} s)",
                t0.elapsed().as_secs_f64()
            ),
            Err(e) => {
                println!("    its logs kept: {}", old.keep_dir().display());
                return Err(e.context(format!(
                    "the chart on Kubernetes {MIN_KUBE_VERSION} (kube-apiserver --emulated-version)"
                )));
            }
        }
    }
    if persist {
        for o in &objects {
            apply(kube, o, ns, FIELD_MANAGER, DryRun::No)
                .await
                .with_context(|| format!("applying {}", describe(o)))?;
        }
        println!(
            "    applied: {}",
            objects.iter().map(describe).collect::<Vec<_>>().join(", ")
        );
    } else {
        println!("    not applied (someone else's cluster; --apply-chart to apply)");
    }
    Ok(())
}

/// `helm template ferry CHART --namespace NS --kube-version VERSION`, parsed.
fn render(chart: &Path, ns: &str, version: &str) -> Result<Vec<Value>> {
    if !chart.join("Chart.yaml").is_file() {
        bail!(
            "no Helm chart at {} (no Chart.yaml): the e2e renders and applies the chart; it must exist",
            chart.display()
        );
    }
    let helm = tool_path("helm")
        .context("helm not found: build it with ./scripts/kube-tools.sh or set FERRY_TOOLS")?;
    let out = Command::new(&helm)
        .args(["template", "ferry"])
        .arg(chart)
        .args(["--namespace", ns, "--kube-version", version])
        .output()
        .with_context(|| format!("running {}", helm.display()))?;
    if !out.status.success() {
        bail!(
            "helm template {} --kube-version {version} failed ({}):\n{}",
            chart.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let objects = parse_documents(&String::from_utf8_lossy(&out.stdout))?;
    ensure!(!objects.is_empty(), "the chart rendered no objects");
    Ok(objects)
}

/// Sends every object as a server-side dry run; fails listing every refused object.
async fn dry_run(kube: &Client, objects: &[Value], ns: &str) -> Result<()> {
    let mut failures = Vec::new();
    for o in objects {
        if let Err(e) = apply(kube, o, ns, FIELD_MANAGER, DryRun::All).await {
            failures.push(format!("  {e}"));
        }
    }
    if !failures.is_empty() {
        bail!(
            "the API server refused {} of {} rendered objects (server-side dry run):\n{}",
            failures.len(),
            objects.len(),
            failures.join("\n")
        );
    }
    Ok(())
}

/// Creates PVC `ns/name` of `class` (annotated with an existing prefix if given).
pub(crate) async fn create_pvc(
    kube: &Client,
    ns: &str,
    name: &str,
    class: &str,
    mode: &str,
    existing_prefix: Option<&str>,
) -> Result<()> {
    let mut pvc = json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "accessModes": [mode],
            "storageClassName": class,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    });
    if let Some(p) = existing_prefix {
        pvc["metadata"]["annotations"] = json!({ keys::EXISTING_PREFIX_ANNOTATION: p });
    }
    apply(kube, &pvc, ns, FIELD_MANAGER, DryRun::No)
        .await
        .with_context(|| format!("creating PVC {ns}/{name}"))?;
    Ok(())
}

/// Waits for PVC `ns/name` to be Bound and returns its PV.
async fn wait_bound(
    kube: &Client,
    ns: &str,
    name: &str,
    provisioner: &Proc,
) -> Result<PersistentVolume> {
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(kube.clone(), ns);
    let pv_name = wait_for(&format!("PVC {ns}/{name} Bound"), BIND_TIMEOUT, || async {
        provisioner.check_alive()?;
        let pvc = pvcs.get(name).await?;
        let phase = pvc.status.and_then(|s| s.phase).unwrap_or("?".into());
        match pvc.spec.and_then(|s| s.volume_name) {
            Some(pv) if phase == "Bound" => Ok(Ok(pv)),
            _ => Ok(Err(format!("phase {phase}"))),
        }
    })
    .await?;
    let pvs: Api<PersistentVolume> = Api::all(kube.clone());
    Ok(pvs.get(&pv_name).await?)
}

/// Deletes PVC `ns/name` and waits until its PV is gone (csi-provisioner called DeleteVolume).
async fn delete_pvc_and_wait(
    kube: &Client,
    ns: &str,
    name: &str,
    pv: &str,
    provisioner: &Proc,
) -> Result<()> {
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(kube.clone(), ns);
    pvcs.delete(name, &DeleteParams::default()).await?;
    let pvs: Api<PersistentVolume> = Api::all(kube.clone());
    wait_for(&format!("PV {pv} deleted"), DELETE_TIMEOUT, || async {
        provisioner.check_alive()?;
        Ok(match pvs.get_opt(pv).await? {
            None => Ok(()),
            Some(v) => Err(format!(
                "phase {}",
                v.status.and_then(|s| s.phase).unwrap_or("?".into())
            )),
        })
    })
    .await
}

/// The CSI source of a PV.
fn pv_csi(pv: &PersistentVolume) -> Result<&k8s_openapi::api::core::v1::CSIPersistentVolumeSource> {
    pv.spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .context("the PV has no spec.csi")
}

fn pv_handle(pv: &PersistentVolume) -> Result<String> {
    Ok(pv_csi(pv)?.volume_handle.clone())
}

pub(crate) fn pv_prefix(pv: &PersistentVolume) -> Result<String> {
    pv_csi(pv)?
        .volume_attributes
        .as_ref()
        .and_then(|a| a.get(keys::PREFIX))
        .cloned()
        .context("the PV's volumeAttributes carry no prefix")
}

/// The NodePublishVolume kubelet sends for `pv` in pod `pod` (CSIDriver `podInfoOnMount` and
/// `tokenRequests` on): the PV's attributes, pod info, and the service account token.
fn publish_request(
    pv: &PersistentVolume,
    target: &Path,
    ns: &str,
    pod: &str,
    token: &ServiceAccountToken,
    mode: Mode,
) -> Result<pb::NodePublishVolumeRequest> {
    let mut ctx: HashMap<String, String> = pv_csi(pv)?
        .volume_attributes
        .clone()
        .context("the PV has no volumeAttributes")?
        .into_iter()
        .collect();
    // The expiry as kubelet writes it: Kubernetes' RFC 3339 form of the TokenRequest's answer.
    let tokens = json!({ "sts.amazonaws.com": {
        "token": token.token.expose_secret(),
        "expirationTimestamp": token.expiration,
    }});
    for (k, v) in [
        (keys::POD_NAME, pod.to_string()),
        (keys::POD_NAMESPACE, ns.to_string()),
        (keys::POD_UID, format!("{pod}-uid")),
        (keys::SERVICE_ACCOUNT_NAME, "trainer".to_string()),
        (keys::EPHEMERAL, "false".to_string()),
        (
            "csi.storage.k8s.io/serviceAccount.tokens",
            tokens.to_string(),
        ),
    ] {
        ctx.insert(k.to_string(), v);
    }
    let options = pv
        .spec
        .as_ref()
        .and_then(|s| s.mount_options.clone())
        .unwrap_or_default();
    let flags: Vec<&str> = options.iter().map(String::as_str).collect();
    Ok(pb::NodePublishVolumeRequest {
        volume_id: pv_handle(pv)?,
        target_path: target.display().to_string(),
        volume_capability: Some(mount_capability(mode, &flags)),
        readonly: false,
        volume_context: ctx,
        ..Default::default()
    })
}

/// The whole object `bucket/key`.
pub(crate) async fn read_object(s3: &S3Store, bucket: &str, key: &str) -> Result<Bytes> {
    let info = s3.head(bucket, key).await?;
    if info.size == 0 {
        return Ok(Bytes::new());
    }
    Ok(s3.get_range(bucket, key, 0..info.size, None).await?)
}

/// How many objects there are under `prefix` (or at the key `prefix`) in `bucket`.
pub(crate) async fn count(s3: &S3Store, bucket: &str, prefix: &str) -> Result<usize> {
    let req = ListRequest {
        prefix,
        ..ListRequest::default()
    };
    let n = ferry_store::list_pages(s3, bucket, req)
        .try_fold(0, |n, page| async move { Ok(n + page.objects.len()) })
        .await?;
    Ok(n)
}
