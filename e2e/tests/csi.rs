//! CSI-level integration tests: the controller and node services served on unix sockets in this
//! process, a real S3 server (versitygw) on loopback, real FUSE mounts, and gRPC clients speaking
//! CSI to them the way csi-provisioner and kubelet do.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use ferry_csi::stores::S3Stores;
use ferry_e2e::{mount_capability, ControllerClient, NodeClient};
use ferry_node::keeper::Keeper;
use ferry_node::mounts::MountTable;
use ferry_node::{NodeConfig, NodeService};
use ferry_proto::csi::v1 as pb;
use ferry_s3::{S3Credentials, S3Store};
use ferry_store::{ListRequest, ObjectStore};
use ferry_testkit::{Fault, FaultPlan, FaultProxy, S3Server};
use ferry_volume::{AllowedEndpoints, DeletePolicy, Endpoint, MetadataTtl, VolumeId};
use futures::TryStreamExt;
use pb::volume_capability::access_mode::Mode;
use tonic::transport::Channel;
use tonic::Code;

struct Env {
    s3: S3Server,
    store: S3Store,
    dir: tempfile::TempDir,
    ctrl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    mounts: Arc<MountTable>,
    /// The node service `node` reaches (for a handover), and its stores.
    service: NodeService,
    stores: Arc<S3Stores>,
}

impl Env {
    async fn start() -> Env {
        Env::start_allowing(|_| None).await
    }

    /// An Env whose driver allows what `allowed` returns for its S3 server besides its default
    /// endpoint (that server); `None`: the default list (the AWS S3 endpoints).
    async fn start_allowing(allowed: impl FnOnce(&S3Server) -> Option<AllowedEndpoints>) -> Env {
        Env::start_with(allowed, None, Keeper::default()).await
    }

    /// [`Env::start_allowing`] with the node cache `cache` shared by its mounts, and its mounts
    /// deposited with the descriptor holder `keeper` reaches.
    async fn start_with(
        allowed: impl FnOnce(&S3Server) -> Option<AllowedEndpoints>,
        cache: Option<Arc<ferry_cache::BlockCache>>,
        keeper: Keeper,
    ) -> Env {
        ferry_testkit::init_tracing();
        let s3 = S3Server::start();
        let allowed = allowed(&s3);
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("kubelet/pods")).unwrap();
        let defaults = Endpoint {
            endpoint_url: Some(s3.endpoint_url().to_string()),
            region: Some("us-east-1".into()),
            force_path_style: true,
        };
        let creds = S3Credentials::Static {
            access_key_id: s3.access_key().to_string(),
            secret_access_key: s3.secret_key().into(),
            session_token: None,
        };
        let mut stores =
            S3Stores::with_credentials(defaults, creds).with_options(S3Server::test_options());
        if let Some(allowed) = allowed {
            stores = stores.with_allowed_endpoints(allowed);
        }
        let stores = Arc::new(stores);
        let mounts = Arc::new(MountTable::default());
        let mut ctx = ferry_fs::MountContext::new(tokio::runtime::Handle::current());
        ctx.cache = cache;
        let node = NodeService::with_context(
            NodeConfig {
                node_id: "test-node".into(),
                kubelet_root: dir.path().join("kubelet"),
                default_metadata_ttl: MetadataTtl::Seconds(1),
            },
            stores.clone(),
            mounts.clone(),
            ctx,
        )
        .with_keeper(keeper);
        let service = node.clone();
        let (ctrl, node) = common::serve(dir.path(), stores.clone(), node).await;
        let store = S3Store::new(s3.s3_config()).await.unwrap();
        Env {
            ctrl,
            node,
            s3,
            store,
            dir,
            mounts,
            service,
            stores,
        }
    }

    /// A node service as a node plugin process that takes over this one's mounts would make it:
    /// the same stores and kubelet root, a table of its own (returned), and its own node cache
    /// (its directory returned: a new process holds none of this one's warm-up claims).
    fn successor(&self, keeper: Keeper) -> (NodeService, Arc<MountTable>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let cache =
            ferry_cache::BlockCache::open(ferry_cache::CacheConfig::new(dir.path(), 64 << 20))
                .unwrap();
        let mut ctx = ferry_fs::MountContext::new(tokio::runtime::Handle::current());
        ctx.cache = Some(cache);
        let table = Arc::new(MountTable::default());
        let node = NodeService::with_context(
            NodeConfig {
                node_id: "test-node".into(),
                kubelet_root: self.dir.path().join("kubelet"),
                default_metadata_ttl: MetadataTtl::Seconds(1),
            },
            self.stores.clone(),
            table.clone(),
            ctx,
        )
        .with_keeper(keeper);
        (node, table, dir)
    }

    /// An Env whose node has a 64 MiB node cache (returned with its directory), and that allows
    /// a [`FaultProxy`] in front of its S3 server as an endpoint.
    async fn start_cached_behind_a_proxy() -> (
        Env,
        Arc<ferry_cache::BlockCache>,
        FaultProxy,
        tempfile::TempDir,
    ) {
        Env::start_cached_behind_a_proxy_keeping(Keeper::default()).await
    }

    /// [`Env::start_cached_behind_a_proxy`] with its mounts deposited where `keeper` says.
    async fn start_cached_behind_a_proxy_keeping(
        keeper: Keeper,
    ) -> (
        Env,
        Arc<ferry_cache::BlockCache>,
        FaultProxy,
        tempfile::TempDir,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let cache =
            ferry_cache::BlockCache::open(ferry_cache::CacheConfig::new(dir.path(), 64 << 20))
                .unwrap();
        let mut forwarder = None;
        let env = Env::start_with(
            |s3| {
                let f = FaultProxy::start(([127, 0, 0, 1], s3.port()).into()).unwrap();
                let allowed = AllowedEndpoints::parse(&format!("aws,{}", f.url())).unwrap();
                forwarder = Some(f);
                Some(allowed)
            },
            Some(cache.clone()),
            keeper,
        )
        .await;
        (env, cache, forwarder.unwrap(), dir)
    }

    fn target(&self, pod: &str, pv: &str) -> PathBuf {
        ferry_testkit::kubelet_target(&self.dir.path().join("kubelet"), pod, pv)
    }

    async fn keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let req = ListRequest {
            prefix,
            ..Default::default()
        };
        ferry_store::list_pages(&self.store, bucket, req)
            .try_fold(Vec::new(), |mut keys, page| async move {
                keys.extend(page.objects.into_iter().map(|o| o.key));
                Ok(keys)
            })
            .await
            .unwrap()
    }

    async fn publish(
        &mut self,
        volume_id: &str,
        target: &std::path::Path,
        cap: pb::VolumeCapability,
        ctx: HashMap<String, String>,
        readonly: bool,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: volume_id.into(),
                target_path: target.display().to_string(),
                volume_capability: Some(cap),
                volume_context: ctx,
                readonly,
                ..Default::default()
            })
            .await
            .map(drop)
    }

    async fn unpublish(
        &mut self,
        volume_id: &str,
        target: &std::path::Path,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                volume_id: volume_id.into(),
                target_path: target.display().to_string(),
            })
            .await
            .map(drop)
    }
}

fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn payload(seed: u8, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| {
                (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .rotate_left(seed as u32) as u8
            })
            .collect::<Vec<u8>>(),
    )
}

/// The issue's lifecycle: CreateVolume, objects written through S3, NodePublish, byte-for-byte
/// reads through the mount, NodeUnpublish, DeleteVolume with deletePolicy delete, and the prefix
/// empty while a sibling prefix is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamic_volume_lifecycle_with_delete_policy() {
    let mut env = Env::start().await;
    env.s3.create_bucket("data").await;
    // A sibling that shares the volume prefix's first characters must survive the delete.
    env.store
        .put(
            "data",
            "vols/pvc-1x/keep.txt",
            Bytes::from_static(b"sibling"),
        )
        .await
        .unwrap();
    env.store
        .put(
            "data",
            "vols/other/keep.txt",
            Bytes::from_static(b"sibling"),
        )
        .await
        .unwrap();

    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let params = map(&[
        ("bucketName", "data"),
        ("basePrefix", "vols"),
        ("deletePolicy", "delete"),
    ]);
    let vol = env
        .ctrl
        .create_volume(pb::CreateVolumeRequest {
            name: "pvc-1".into(),
            parameters: params.clone(),
            volume_capabilities: vec![cap.clone()],
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 1 << 30,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(
        vol.volume_context.get("prefix").map(String::as_str),
        Some("vols/pvc-1/")
    );
    assert_eq!(vol.capacity_bytes, 1 << 30);

    // Idempotent by name; the same name with other parameters is AlreadyExists.
    let again = env
        .ctrl
        .create_volume(pb::CreateVolumeRequest {
            name: "pvc-1".into(),
            parameters: params.clone(),
            volume_capabilities: vec![cap.clone()],
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 1 << 30,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, vol.volume_id);
    let conflict = env
        .ctrl
        .create_volume(pb::CreateVolumeRequest {
            name: "pvc-1".into(),
            parameters: map(&[("bucketName", "data"), ("basePrefix", "elsewhere")]),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(conflict.code(), Code::AlreadyExists, "{conflict:?}");

    let files: Vec<(String, Bytes)> = vec![
        ("a.txt".into(), Bytes::from_static(b"hello ferry\n")),
        ("empty".into(), Bytes::new()),
        ("dir/b.bin".into(), payload(1, 300_000)),
        ("dir/sub/c.bin".into(), payload(2, 9 << 20)),
    ];
    for (k, v) in &files {
        env.store
            .put("data", &format!("vols/pvc-1/{k}"), v.clone())
            .await
            .unwrap();
    }

    // As kubelet passes it: the PV's attributes plus what csi-provisioner and kubelet add.
    let mut ctx = vol.volume_context.clone();
    ctx.insert(
        "storage.kubernetes.io/csiProvisionerIdentity".into(),
        "1700000000000-8081-s3.csi.ferry.dev".into(),
    );
    ctx.insert("csi.storage.k8s.io/pod.name".into(), "trainer-0".into());
    let target = env.target("pod-1", "pvc-1");
    env.publish(&vol.volume_id, &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap();
    // The same request again is OK.
    env.publish(&vol.volume_id, &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap();
    let t = target.clone();
    let expected = files.clone();
    tokio::task::spawn_blocking(move || {
        let mut names: Vec<_> = std::fs::read_dir(&t)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["a.txt", "dir", "empty"]);
        for (k, v) in &expected {
            let got = std::fs::read(t.join(k)).unwrap();
            assert!(
                got == v.as_ref(),
                "{k}: bytes differ ({} vs {})",
                got.len(),
                v.len()
            );
            assert_eq!(std::fs::metadata(t.join(k)).unwrap().len(), v.len() as u64);
        }
        std::fs::write(t.join("written.txt"), b"through the mount").unwrap();
    })
    .await
    .unwrap();
    assert_eq!(
        env.store
            .get_range("data", "vols/pvc-1/written.txt", 0..17, None)
            .await
            .unwrap(),
        Bytes::from_static(b"through the mount")
    );

    env.unpublish(&vol.volume_id, &target).await.unwrap();
    assert!(!target.exists(), "unpublish removes the target directory");
    assert!(env.mounts.is_empty());
    // Unpublishing again is OK.
    env.unpublish(&vol.volume_id, &target).await.unwrap();

    env.ctrl
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            secrets: Default::default(),
        })
        .await
        .unwrap();
    assert!(
        env.keys("data", "vols/pvc-1/").await.is_empty(),
        "the prefix is empty"
    );
    assert_eq!(
        env.keys("data", "vols/").await,
        ["vols/other/keep.txt", "vols/pvc-1x/keep.txt"],
        "siblings are untouched"
    );
    // Deleting again is OK.
    env.ctrl
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id,
            secrets: Default::default(),
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retain_policy_keeps_data() {
    let mut env = Env::start().await;
    env.s3.create_bucket("keep").await;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let vol = env
        .ctrl
        .create_volume(pb::CreateVolumeRequest {
            name: "pvc-r".into(),
            parameters: map(&[("bucketName", "keep")]),
            volume_capabilities: vec![cap],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    env.store
        .put("keep", "pvc-r/x", Bytes::from_static(b"x"))
        .await
        .unwrap();
    env.ctrl
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id,
            secrets: Default::default(),
        })
        .await
        .unwrap();
    assert_eq!(env.keys("keep", "").await, ["pvc-r/x"]);
}

/// A static PV written for Mountpoint's CSI driver: `bucketName` attribute, options in mount-s3
/// syntax as PV mountOptions. Only the driver name changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mountpoint_static_pv_mounts_and_reads() {
    let mut env = Env::start().await;
    env.s3.create_bucket("mp-bucket").await;
    env.store
        .put("mp-bucket", "datasets/imagenet/0.jpg", payload(3, 4096))
        .await
        .unwrap();
    env.store
        .put("mp-bucket", "other/secret.txt", Bytes::from_static(b"no"))
        .await
        .unwrap();
    let cap = mount_capability(
        Mode::MultiNodeReaderOnly,
        &[
            "prefix datasets/",
            "uid=1000",
            "gid=2000",
            "file-mode=0444",
            "dir-mode=0555",
            "allow-other",
        ],
    );
    let target = env.target("pod-s", "static-pv");
    env.publish(
        "any-unique-handle",
        &target,
        cap,
        map(&[("bucketName", "mp-bucket")]),
        false,
    )
    .await
    .unwrap();
    let t = target.clone();
    tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::MetadataExt;
        let names: Vec<_> = std::fs::read_dir(&t)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["imagenet"]);
        let f = t.join("imagenet/0.jpg");
        assert_eq!(std::fs::read(&f).unwrap(), payload(3, 4096));
        let md = std::fs::metadata(&f).unwrap();
        assert_eq!(
            (md.uid(), md.gid(), md.mode() & 0o7777),
            (1000, 2000, 0o444)
        );
        assert_eq!(
            std::fs::metadata(t.join("imagenet")).unwrap().mode() & 0o7777,
            0o555
        );
        // A reader-only access mode makes the mount read-only.
        let err = std::fs::write(t.join("new.txt"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    })
    .await
    .unwrap();
    env.unpublish("any-unique-handle", &target).await.unwrap();
}

/// Every bad input is refused with the spec's code and a message naming what was wrong, and
/// nothing is mounted or created.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_is_refused_with_clear_errors() {
    let mut env = Env::start().await;
    env.s3.create_bucket("good-bucket").await;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let ctx = map(&[("bucketName", "good-bucket")]);

    let create = |name: &str, params: HashMap<String, String>, cap: pb::VolumeCapability| {
        pb::CreateVolumeRequest {
            name: name.into(),
            parameters: params,
            volume_capabilities: vec![cap],
            ..Default::default()
        }
    };
    let cases = vec![
        (create("", ctx.clone(), cap.clone()), "name"),
        (create("v", map(&[]), cap.clone()), "bucketName"),
        (
            create("v", map(&[("bucketName", "Bad_Bucket")]), cap.clone()),
            "bucketName",
        ),
        (
            create(
                "v",
                map(&[("bucketName", "good-bucket"), ("colour", "red")]),
                cap.clone(),
            ),
            "colour",
        ),
        (
            create(
                "v",
                map(&[("bucketName", "good-bucket"), ("prefixTemplate", "../x")]),
                cap.clone(),
            ),
            "prefix",
        ),
        (
            create(
                "v",
                ctx.clone(),
                mount_capability(Mode::SingleNodeWriter, &["bogus-opt"]),
            ),
            "bogus-opt",
        ),
        (
            create(
                "v",
                ctx.clone(),
                pb::VolumeCapability {
                    access_type: Some(pb::volume_capability::AccessType::Block(Default::default())),
                    access_mode: Some(pb::volume_capability::AccessMode {
                        mode: Mode::SingleNodeWriter as i32,
                    }),
                },
            ),
            "block",
        ),
    ];
    for (req, needle) in cases {
        let e = env.ctrl.create_volume(req).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(needle), "{needle}: {}", e.message());
    }
    let e = env
        .ctrl
        .create_volume(create(
            "v",
            map(&[("bucketName", "no-such-bucket")]),
            cap.clone(),
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("no-such-bucket"));

    // Node: target outside the kubelet root, relative, or with '..'.
    let outside = env.dir.path().join("elsewhere/mount");
    for t in [
        outside.clone(),
        PathBuf::from("relative/mount"),
        env.dir.path().join("kubelet/pods/../../x"),
    ] {
        let e = env
            .publish("vol", &t, cap.clone(), ctx.clone(), false)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{t:?}: {e:?}");
        assert!(e.message().contains("target_path"), "{}", e.message());
    }
    assert!(
        !outside.exists(),
        "nothing is created outside the kubelet root"
    );
    let target = env.target("pod-b", "pv-b");
    for (ctx, flags, needle) in [
        (map(&[]), vec![], "bucketName"),
        (map(&[("bucketName", "x")]), vec![], "bucketName"),
        (ctx.clone(), vec!["nope=1"], "nope"),
        (ctx.clone(), vec!["uid=-1"], "uid"),
    ] {
        let e = env
            .publish(
                "vol",
                &target,
                mount_capability(Mode::SingleNodeWriter, &flags),
                ctx,
                false,
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(needle), "{needle}: {}", e.message());
    }
    let e = env
        .publish(
            "vol",
            &target,
            cap.clone(),
            map(&[("bucketName", "missing-bucket")]),
            false,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(
        !target.exists(),
        "a refused publish leaves no target behind"
    );

    // Same target, another volume: AlreadyExists; same volume, other options: AlreadyExists.
    env.publish("vol-a", &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap();
    let e = env
        .publish("vol-b", &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    let e = env
        .publish("vol-a", &target, cap.clone(), ctx.clone(), true)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    // Unpublish of another volume at that target: OK (that volume is not published there, as the
    // spec has it), and the mount stays, still serving.
    env.unpublish("vol-b", &target).await.unwrap();
    assert_eq!(env.mounts.len(), 1);
    assert!(ferry_node::mountinfo::mounted_at(&target)
        .unwrap()
        .is_some());
    env.unpublish("vol-a", &target).await.unwrap();
}

/// `readonly: true` on NodePublishVolume (a PVC mounted `readOnly`) makes the mount refuse writes
/// even with a writer access mode; a second pod's mount of the same volume stays writable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readonly_publish_refuses_writes() {
    let mut env = Env::start().await;
    env.s3.create_bucket("ro-bucket").await;
    env.store
        .put("ro-bucket", "v/a.txt", Bytes::from_static(b"a"))
        .await
        .unwrap();
    let cap = mount_capability(Mode::SingleNodeMultiWriter, &[]);
    let ctx = map(&[("bucketName", "ro-bucket"), ("prefix", "v/")]);
    let (ro, rw) = (env.target("pod-ro", "pv"), env.target("pod-rw", "pv"));
    env.publish("v", &ro, cap.clone(), ctx.clone(), true)
        .await
        .unwrap();
    env.publish("v", &rw, cap.clone(), ctx.clone(), false)
        .await
        .unwrap();
    let (r, w) = (ro.clone(), rw.clone());
    tokio::task::spawn_blocking(move || {
        assert_eq!(std::fs::read(r.join("a.txt")).unwrap(), b"a");
        let err = std::fs::write(r.join("b.txt"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
        std::fs::write(w.join("b.txt"), b"x").unwrap();
    })
    .await
    .unwrap();
    env.unpublish("v", &ro).await.unwrap();
    env.unpublish("v", &rw).await.unwrap();
    assert_eq!(
        env.store
            .get_range("ro-bucket", "v/b.txt", 0..1, None)
            .await
            .unwrap(),
        Bytes::from_static(b"x")
    );
}

/// A volume published read-only is an immutable dataset: its metadata is kept for the mount's
/// life (a change in S3 is not seen after the node's 1 s default TTL), unless a `metadata-ttl`
/// mount option says otherwise; a writable volume keeps the node's default.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_volume_keeps_its_metadata_unless_a_mount_option_says_otherwise() {
    let mut env = Env::start().await;
    env.s3.create_bucket("imm-bucket").await;
    env.store
        .put("imm-bucket", "v/a.txt", Bytes::from_static(b"one"))
        .await
        .unwrap();
    let ctx = map(&[("bucketName", "imm-bucket"), ("prefix", "v/")]);
    let ro = mount_capability(Mode::MultiNodeReaderOnly, &[]);
    let ro_ttl = mount_capability(Mode::MultiNodeReaderOnly, &["metadata-ttl 1"]);
    let rw = mount_capability(Mode::MultiNodeMultiWriter, &[]);
    let targets = [
        (env.target("pod-ro", "pv"), ro, 3u64),
        (env.target("pod-ro-ttl", "pv"), ro_ttl, 10),
        (env.target("pod-rw", "pv"), rw, 10),
    ];
    for (t, cap, _) in &targets {
        env.publish("v", t, cap.clone(), ctx.clone(), false)
            .await
            .unwrap();
    }
    let paths: Vec<_> = targets.iter().map(|(t, ..)| t.clone()).collect();
    let sizes = move |paths: Vec<std::path::PathBuf>| {
        tokio::task::spawn_blocking(move || {
            paths
                .iter()
                .map(|t| std::fs::metadata(t.join("a.txt")).unwrap().len())
                .collect::<Vec<u64>>()
        })
    };
    assert_eq!(sizes(paths.clone()).await.unwrap(), [3, 3, 3]);
    env.store
        .put("imm-bucket", "v/a.txt", Bytes::from_static(b"twenty-one"))
        .await
        .unwrap();
    // Past the 1 s TTLs (Ferry's and the kernel's attribute timeout).
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let expect: Vec<u64> = targets.iter().map(|(.., size)| *size).collect();
    assert_eq!(sizes(paths).await.unwrap(), expect);
    for (t, ..) in &targets {
        env.unpublish("v", t).await.unwrap();
    }
}

/// `ferry_cache_warmups_total{result}` as this process counts it.
/// Held by the tests that count warm-ups stopped: the counters are the process's, and tests run
/// side by side.
static STOPPING_WARM_UPS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn warm_ups(result: &str) -> u64 {
    let line = format!("ferry_cache_warmups_total{{result=\"{result}\"}} ");
    ferry_metrics::render()
        .lines()
        .find_map(|l| l.strip_prefix(&line).map(|n| n.parse().unwrap()))
        .unwrap_or(0)
}

/// Waits up to a minute for `ready`; `false` if it never held.
async fn eventually(mut ready: impl FnMut() -> bool) -> bool {
    for _ in 0..3000 {
        if ready() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    false
}

/// Bucket `bucket` with three objects of one block each (`f0`..`f2`) under each of `dirs`, and
/// the publish context of a volume of one of those prefixes that warms up when it is mounted,
/// through `forwarder`.
async fn warming_volumes(
    env: &Env,
    forwarder: &FaultProxy,
    bucket: &'static str,
    dirs: &[&str],
) -> impl Fn(&str) -> HashMap<String, String> {
    env.s3.create_bucket(bucket).await;
    for dir in dirs {
        for i in 0..3u8 {
            env.store
                .put(bucket, &format!("{dir}f{i}"), payload(i, 100_000))
                .await
                .unwrap();
        }
    }
    let url = forwarder.url();
    move |prefix: &str| {
        map(&[
            ("bucketName", bucket),
            ("prefix", prefix),
            ("endpointUrl", &url),
            ("forcePathStyle", "true"),
            ("prefetchOnMount", "true"),
        ])
    }
}

/// A warm-up fetches with the credentials of the mount that runs it, so it ends with that
/// mount: unpublished before the warm-up is done, it stops it, and another mount of the volume
/// goes on with it or, with none, the next publish starts it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_warm_up_ends_with_the_mount_that_runs_it() {
    let _counting = STOPPING_WARM_UPS.lock().await;
    let (mut env, cache, forwarder, _cache_dir) = Env::start_cached_behind_a_proxy().await;
    let ctx = warming_volumes(&env, &forwarder, "warm", &["a/", "b/"]).await;
    let blocks = || cache.stats().blocks;
    let cap = mount_capability(Mode::MultiNodeReaderOnly, &[]);
    let hang = || FaultPlan::always(&["GET"], Fault::Hang).ranged();
    let stopped = warm_ups("stopped");

    // Alone: unpublished mid-way, its warm-up stops; the next publish starts it again.
    forwarder.set_plan(Some(hang()));
    let (a1, a2) = (env.target("pod-a1", "pv"), env.target("pod-a2", "pv"));
    env.publish("va", &a1, cap.clone(), ctx("a/"), true)
        .await
        .unwrap();
    assert!(
        eventually(|| forwarder.injected().len() >= 3).await,
        "the warm-up's three GETs never reached the server"
    );
    env.unpublish("va", &a1).await.unwrap();
    assert_eq!(
        warm_ups("stopped"),
        stopped + 1,
        "the warm-up was not stopped"
    );
    forwarder.set_plan(None);
    env.publish("va", &a2, cap.clone(), ctx("a/"), true)
        .await
        .unwrap();
    assert!(
        eventually(|| blocks() == 3).await,
        "the next publish did not warm the volume"
    );
    env.unpublish("va", &a2).await.unwrap();

    // Beside another mount of the volume: that mount goes on with it.
    forwarder.set_plan(Some(hang()));
    let hung = forwarder.injected().len();
    let (b1, b2) = (env.target("pod-b1", "pv"), env.target("pod-b2", "pv"));
    env.publish("vb", &b1, cap.clone(), ctx("b/"), true)
        .await
        .unwrap();
    assert!(eventually(|| forwarder.injected().len() >= hung + 3).await);
    env.publish("vb", &b2, cap.clone(), ctx("b/"), true)
        .await
        .unwrap();
    // The GETs of b1's warm-up stay unanswered; the ones made after this are served.
    forwarder.set_plan(None);
    env.unpublish("vb", &b1).await.unwrap();
    assert_eq!(
        warm_ups("stopped"),
        stopped + 2,
        "the warm-up was not stopped"
    );
    assert!(
        eventually(|| blocks() == 6).await,
        "the volume's other mount did not go on with the warm-up"
    );
    env.unpublish("vb", &b2).await.unwrap();
}

/// A warm-up that failed (here every GET answers 500) did not warm the volume: the next publish
/// of it starts it again, as after a warm-up stopped by an unpublish, instead of the node never
/// warming it again until the node plugin restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_warm_up_runs_again_at_the_next_publish() {
    let (mut env, cache, forwarder, _cache_dir) = Env::start_cached_behind_a_proxy().await;
    let ctx = warming_volumes(&env, &forwarder, "warmfail", &["d/"]).await;
    let cap = mount_capability(Mode::MultiNodeReaderOnly, &[]);
    let errors = warm_ups("error");
    forwarder.set_plan(Some(
        FaultPlan::always(&["GET"], Fault::InternalError).ranged(),
    ));
    let (t1, t2) = (env.target("pod-f1", "pv"), env.target("pod-f2", "pv"));
    env.publish("vf", &t1, cap.clone(), ctx("d/"), true)
        .await
        .unwrap();
    assert!(
        eventually(|| warm_ups("error") > errors).await,
        "the warm-up did not fail"
    );
    env.unpublish("vf", &t1).await.unwrap();
    forwarder.set_plan(None);
    env.publish("vf", &t2, cap, ctx("d/"), true).await.unwrap();
    let warmed = eventually(|| cache.stats().blocks == 3).await;
    env.unpublish("vf", &t2).await.unwrap();
    assert!(
        warmed,
        "the next publish did not warm the volume (cached blocks: {})",
        cache.stats().blocks
    );
}

/// A mount unmounted behind the driver's back whose directories were then removed (the pod's
/// volume directory gone, as after kubelet's own clean-up): its unpublish cannot resolve the
/// target any more, but still ends what the mount left running. Here that is its warm-up, whose
/// GETs hang: it is stopped, and the next publish of the volume warms it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unpublish_after_the_target_directories_are_gone_ends_the_mount() {
    let _counting = STOPPING_WARM_UPS.lock().await;
    let (mut env, cache, forwarder, _cache_dir) = Env::start_cached_behind_a_proxy().await;
    let ctx = warming_volumes(&env, &forwarder, "gone", &["d/"]).await;
    let cap = mount_capability(Mode::MultiNodeReaderOnly, &[]);
    let stopped = warm_ups("stopped");
    forwarder.set_plan(Some(FaultPlan::always(&["GET"], Fault::Hang).ranged()));
    let (t1, t2) = (env.target("pod-g1", "pv"), env.target("pod-g2", "pv"));
    env.publish("vg", &t1, cap.clone(), ctx("d/"), true)
        .await
        .unwrap();
    assert!(
        eventually(|| forwarder.injected().len() >= 3).await,
        "the warm-up's three GETs never reached the server"
    );
    ferry_node::mountinfo::detach(&t1).unwrap();
    std::fs::remove_dir_all(t1.parent().unwrap()).unwrap();

    // Another volume's id: OK, and the mount recorded there is not ended by it.
    env.unpublish("another", &t1).await.unwrap();
    assert_eq!(env.mounts.len(), 1);
    env.unpublish("vg", &t1).await.unwrap();
    assert!(env.mounts.is_empty(), "the mount is still in the table");
    assert_eq!(
        warm_ups("stopped"),
        stopped + 1,
        "the warm-up was not stopped"
    );
    // Again: nothing is left to end.
    env.unpublish("vg", &t1).await.unwrap();

    forwarder.set_plan(None);
    env.publish("vg", &t2, cap, ctx("d/"), true).await.unwrap();
    let warmed = eventually(|| cache.stats().blocks == 3).await;
    env.unpublish("vg", &t2).await.unwrap();
    assert!(
        warmed,
        "the next publish did not warm the volume (cached blocks: {})",
        cache.stats().blocks
    );
}

/// Publishes (at `env`'s node, behind `forwarder`) two volumes that warm up: `vd`, whose warm-up
/// finishes, then `vh`, whose warm-up's GETs hang (it is still running after). Returns the
/// publish context of a volume by prefix, and the targets of `vd` and `vh`.
async fn a_finished_and_a_running_warm_up(
    env: &mut Env,
    forwarder: &FaultProxy,
) -> (
    impl Fn(&str) -> HashMap<String, String>,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    let ctx = warming_volumes(env, forwarder, "handed", &["d/", "h/"]).await;
    let cap = mount_capability(Mode::MultiNodeReaderOnly, &[]);
    let (d1, h1) = (env.target("pod-d1", "pv"), env.target("pod-h1", "pv"));
    env.publish("vd", &d1, cap.clone(), ctx("d/"), true)
        .await
        .unwrap();
    assert!(
        eventually(|| env.mounts.warmed(&d1)).await,
        "the warm-up of vd never finished"
    );
    forwarder.set_plan(Some(FaultPlan::always(&["GET"], Fault::Hang).ranged()));
    env.publish("vh", &h1, cap, ctx("h/"), true).await.unwrap();
    assert!(
        eventually(|| forwarder.injected().len() >= 3).await,
        "the GETs of vh's warm-up never reached the server"
    );
    assert!(!env.mounts.warmed(&h1));
    (ctx, d1, h1)
}

/// What a successor `next` (its table `table`) that took over the mounts of
/// [`a_finished_and_a_running_warm_up`] does with their warm-ups, as decided when it took them
/// over: `vd`'s, finished, is not run again, neither for its mount nor for a later publish of it;
/// `vh`'s, unfinished, runs again. Then the mounts taken over are cut off (their predecessor's
/// session threads, parked in this process, may hold a request of theirs that nobody answers).
async fn check_the_successor_warm_ups(
    env: &Env,
    next: &NodeService,
    table: &MountTable,
    ctx: impl Fn(&str) -> HashMap<String, String>,
    d1: &std::path::Path,
    h1: &std::path::Path,
) {
    use ferry_csi::pb::node_server::Node;
    /// Cuts the mounts taken over off when the check ends, passed or not.
    struct CutOff<'a>([&'a std::path::Path; 2]);
    impl Drop for CutOff<'_> {
        fn drop(&mut self) {
            for t in self.0 {
                if let Ok(Some(m)) = ferry_node::mountinfo::mounted_at(t) {
                    ferry_node::service::abandon(t, m.dev);
                }
            }
        }
    }
    let _cut_off = CutOff([d1, h1]);
    assert_eq!(
        table.len(),
        2,
        "the successor did not take both mounts over"
    );
    assert!(
        !table.started_warm_up(d1),
        "the successor ran again the warm-up its predecessor had finished"
    );
    assert!(
        table.warmed(d1),
        "the successor does not hold vd's warm-up as finished"
    );
    assert!(
        table.started_warm_up(h1),
        "the successor did not start again the warm-up its predecessor had not finished"
    );
    let d2 = env.target("pod-d2", "pv");
    next.node_publish_volume(tonic::Request::new(pb::NodePublishVolumeRequest {
        volume_id: "vd".into(),
        target_path: d2.display().to_string(),
        volume_capability: Some(mount_capability(Mode::MultiNodeReaderOnly, &[])),
        volume_context: ctx("d/"),
        readonly: true,
        ..Default::default()
    }))
    .await
    .unwrap();
    let started = table.started_warm_up(&d2);
    next.node_unpublish_volume(tonic::Request::new(pb::NodeUnpublishVolumeRequest {
        volume_id: "vd".into(),
        target_path: d2.display().to_string(),
    }))
    .await
    .unwrap();
    assert!(
        !started,
        "a publish at the successor ran again the warm-up its predecessor had finished"
    );
}

/// A warm-up that finished is not run again by the node plugin that takes the mounts over in a
/// graceful handover (an upgrade): it would fetch the whole prefix again, evicting what the
/// volume's readers use when the dataset is larger than the cache. One still running when the
/// mounts were handed over runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handover_does_not_run_again_a_warm_up_that_finished() {
    let (mut env, _cache, forwarder, _cache_dir) = Env::start_cached_behind_a_proxy().await;
    let (ctx, d1, h1) = a_finished_and_a_running_warm_up(&mut env, &forwarder).await;

    let export = env
        .service
        .export(std::time::Duration::from_secs(30))
        .await
        .unwrap();
    // As they travel to the successor.
    let records: Vec<ferry_node::handover::MountRecord> =
        serde_json::from_slice(&serde_json::to_vec(&export.records).unwrap()).unwrap();
    let devices: Vec<std::os::fd::OwnedFd> = export
        .devices()
        .into_iter()
        .map(|d| d.try_clone_to_owned().unwrap())
        .collect();
    export.commit();
    let (next, table, _next_dir) = env.successor(Keeper::default());
    for (record, device) in records.into_iter().zip(devices) {
        next.adopt(record, device, true).await.unwrap();
    }
    check_the_successor_warm_ups(&env, &next, &table, ctx, &d1, &h1).await;
}

/// The same across a crash: the node plugin that recovers the mounts from the descriptor holder
/// does not run again a warm-up that had finished (the mounts that asked for it were deposited
/// again when it did), and runs again one that had not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_recovery_does_not_run_again_a_warm_up_that_finished() {
    let holder_dir = tempfile::tempdir().unwrap();
    let socket = holder_dir.path().join("holder.sock");
    /// Ends the holder with the test.
    struct Holder(std::process::Child);
    impl Drop for Holder {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _holder = Holder(
        std::process::Command::new(ferry_e2e::bin_dir().unwrap().join("ferry-fd-holder"))
            .args(["--socket", &socket.display().to_string()])
            .spawn()
            .expect("ferry-fd-holder (built beside the tests)"),
    );
    assert!(
        eventually(|| socket.exists()).await,
        "ferry-fd-holder did not listen"
    );
    let keeper = Keeper::new(Some(socket.clone()));
    let (mut env, _cache, forwarder, _cache_dir) =
        Env::start_cached_behind_a_proxy_keeping(keeper.clone()).await;
    let (ctx, d1, h1) = a_finished_and_a_running_warm_up(&mut env, &forwarder).await;
    // The holder learns that vd's warm-up finished once it has.
    let kept_warmed = |target: &std::path::Path| {
        let mut client = ferry_node::holder::Client::connect(&socket).unwrap();
        client.list().unwrap().into_iter().any(|e| {
            let kept: serde_json::Value = serde_json::from_slice(&e.blob).unwrap();
            kept["target"].as_str() == target.to_str() && kept["warmed"] == true
        })
    };
    assert!(
        eventually(|| kept_warmed(&d1)).await,
        "the holder was never told that vd's warm-up finished"
    );
    assert!(!kept_warmed(&h1));

    // The process stops serving without a word to anyone (as if killed): what it deposited is
    // what is left.
    env.service
        .export(std::time::Duration::from_secs(30))
        .await
        .unwrap()
        .commit();
    let (next, table, _next_dir) = env.successor(keeper);
    assert_eq!(next.recover().await, (2, 0));
    check_the_successor_warm_ups(&env, &next, &table, ctx, &d1, &h1).await;
}

/// CreateVolume refuses prefixes that would be the whole bucket or escape it, and a delete-policy
/// template that could give two volumes one prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unsafe_prefixes_are_refused() {
    let mut env = Env::start().await;
    env.s3.create_bucket("pfx").await;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    for (params, needle) in [
        (
            map(&[("bucketName", "pfx"), ("basePrefix", "/")]),
            "basePrefix",
        ),
        (
            map(&[("bucketName", "pfx"), ("basePrefix", "a/../b")]),
            "basePrefix",
        ),
        (
            map(&[("bucketName", "pfx"), ("prefixTemplate", ".")]),
            "prefix",
        ),
        (
            map(&[("bucketName", "pfx"), ("prefixTemplate", "$${x}/../..")]),
            "prefix",
        ),
        (
            map(&[
                ("bucketName", "pfx"),
                ("prefixTemplate", "${pvc.namespace}"),
                ("deletePolicy", "delete"),
            ]),
            "prefixTemplate",
        ),
    ] {
        let e = env
            .ctrl
            .create_volume(pb::CreateVolumeRequest {
                name: "v".into(),
                parameters: params.clone(),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{params:?}: {e:?}");
        assert!(e.message().contains(needle), "{needle}: {}", e.message());
    }
}

/// Fails the test if `fut` has not finished within `limit`: a safety net against a hang (an RPC
/// that never returns), not a timing assertion.
async fn within<T>(
    limit: std::time::Duration,
    what: &str,
    fut: impl std::future::Future<Output = T>,
) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not return within {limit:?}"),
    }
}

/// The mountinfo entry on top at `path`.
fn mounted_at(path: &std::path::Path) -> Option<ferry_node::mountinfo::MountEntry> {
    ferry_node::mountinfo::mounted_at(path).unwrap()
}

/// Every Ferry mount below `dir`.
fn ferry_mounts_below(dir: &std::path::Path) -> Vec<String> {
    let dir = dir.to_string_lossy().into_owned();
    ferry_node::mountinfo::mounts()
        .unwrap()
        .into_iter()
        .filter(|m| m.is_ferry() && m.mount_point.starts_with(&dir))
        .map(|m| m.mount_point)
        .collect()
}

/// Issue 14 item 1: a target whose last component is a symlink is refused (publish and republish
/// mount nothing, anywhere), and unpublish neither follows nor removes it, nor anything it points
/// to.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_symlinked_target_is_never_mounted_through_or_removed() {
    let mut env = Env::start().await;
    env.s3.create_bucket("sym").await;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let ctx = map(&[("bucketName", "sym")]);
    // One link leaves the kubelet root, one stays inside it: both are refused.
    let outside = env.dir.path().join("host-dir");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("keep"), b"host data").unwrap();
    let inside = env.dir.path().join("kubelet/pods/other-dir");
    std::fs::create_dir_all(&inside).unwrap();
    for (pod, dest) in [("pod-out", &outside), ("pod-in", &inside)] {
        let target = env.target(pod, "pv");
        std::os::unix::fs::symlink(dest, &target).unwrap();
        // Publish, then kubelet's periodic republish: refused each time, nothing mounted.
        for _ in 0..2 {
            let e = env
                .publish("vol", &target, cap.clone(), ctx.clone(), false)
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains("symbolic link"), "{}", e.message());
        }
        assert!(mounted_at(dest).is_none(), "nothing mounted at {dest:?}");
        assert!(ferry_mounts_below(env.dir.path()).is_empty());
        assert!(env.mounts.is_empty());
        // Unpublish succeeds and leaves the link and what it points to as they were.
        env.unpublish("vol", &target).await.unwrap();
        assert!(std::fs::symlink_metadata(&target)
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(dest.is_dir());
    }
    assert_eq!(std::fs::read(outside.join("keep")).unwrap(), b"host data");
}

/// Issue 14 item 2: a process that unshared its mount namespace while the volume was mounted
/// holds a copy of the mount. NodeUnpublish still returns, with the target detached and removed;
/// the copy left in the other namespace is cut off (`ENOTCONN`), so its FUSE session ends too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unpublish_returns_while_another_mount_namespace_holds_a_copy() {
    let mut env = Env::start().await;
    env.s3.create_bucket("ns-copy").await;
    env.store
        .put("ns-copy", "v/a.txt", Bytes::from_static(b"a"))
        .await
        .unwrap();
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let ctx = map(&[("bucketName", "ns-copy"), ("prefix", "v/")]);
    let target = env.target("pod-ns", "pv");
    env.publish("v", &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap();
    // A process in a private mount namespace of its own whose working directory is in its copy
    // of the mount (which keeps that copy alive even once its mount point is removed).
    let mut child = ferry_testkit::hold_a_copy_in_another_namespace(&target);
    let cwd = PathBuf::from(format!("/proc/{}/cwd", child.id()));
    let c = cwd.clone();
    let listed = tokio::task::spawn_blocking(move || std::fs::read_dir(c).map(|d| d.count()))
        .await
        .unwrap();
    assert_eq!(listed.unwrap(), 1, "the copy serves the volume");

    let res = within(
        std::time::Duration::from_secs(120),
        "NodeUnpublishVolume",
        env.unpublish("v", &target),
    )
    .await;
    let after = tokio::task::spawn_blocking(move || std::fs::read_dir(cwd).map(drop))
        .await
        .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    res.unwrap();
    assert!(!target.exists(), "the target is removed");
    assert!(env.mounts.is_empty());
    assert!(ferry_mounts_below(env.dir.path()).is_empty());
    assert_eq!(
        after.unwrap_err().raw_os_error(),
        Some(libc::ENOTCONN),
        "the copy in the other namespace is cut off"
    );
    // The same volume publishes again at the same place.
    env.publish("v", &target, cap, ctx, false).await.unwrap();
    env.unpublish("v", &target).await.unwrap();
}

/// Issue 14 item 3: a mount Ferry did not make at a target (here a tmpfs) is never unmounted,
/// covered or removed: unpublish and publish answer FAILED_PRECONDITION naming it, and leave it as
/// it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_foreign_mount_at_the_target_is_never_touched() {
    let mut env = Env::start().await;
    env.s3.create_bucket("foreign").await;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let ctx = map(&[("bucketName", "foreign")]);
    let target = env.target("pod-f", "pv");
    std::fs::create_dir(&target).unwrap();
    let c = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: NUL-terminated strings alive across the call; mount(2) only reads them.
    let rc = unsafe {
        libc::mount(
            c"ferry-test-tmpfs".as_ptr(),
            c.as_ptr(),
            c"tmpfs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    std::fs::write(target.join("theirs"), b"not ferry's").unwrap();

    let e = env.unpublish("vol", &target).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("tmpfs"), "{}", e.message());
    let e = env
        .publish("vol", &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("tmpfs"), "{}", e.message());
    let top = mounted_at(&target).expect("still mounted");
    assert_eq!(top.fs_type, "tmpfs", "nothing stacked on it");
    assert_eq!(
        std::fs::read(target.join("theirs")).unwrap(),
        b"not ferry's"
    );
    assert!(env.mounts.is_empty());

    ferry_node::mountinfo::unmount(&target, false).unwrap();
    env.publish("vol", &target, cap, ctx, false).await.unwrap();
    env.unpublish("vol", &target).await.unwrap();
    assert!(!target.exists());
}

/// Files written into a target directory while its mount was gone (unmounted behind Ferry's back,
/// a container then writing to the bare directory) made NodeUnpublishVolume fail with `INTERNAL:
/// Directory not empty` on every retry, and were hidden by the next publish. Now unpublish answers
/// OK and leaves the directory and its files as they are; publish refuses to mount over them
/// (FAILED_PRECONDITION naming the path) until they are moved away.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn files_in_a_bare_target_are_neither_deleted_nor_mounted_over() {
    let mut env = Env::start().await;
    env.s3.create_bucket("bare").await;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let ctx = map(&[("bucketName", "bare")]);
    let target = env.target("pod-bare", "pv");
    env.publish("vol", &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap();
    ferry_node::mountinfo::unmount(&target, false).unwrap();
    std::fs::write(target.join("written-while-unmounted"), b"keep me").unwrap();

    for _ in 0..2 {
        env.unpublish("vol", &target).await.unwrap();
        assert_eq!(
            std::fs::read(target.join("written-while-unmounted")).unwrap(),
            b"keep me"
        );
    }
    assert!(env.mounts.is_empty());

    let e = env
        .publish("vol", &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains(&target.display().to_string()),
        "{}",
        e.message()
    );
    assert!(mounted_at(&target).is_none(), "nothing mounted over them");
    assert!(env.mounts.is_empty());

    std::fs::remove_file(target.join("written-while-unmounted")).unwrap();
    env.publish("vol", &target, cap, ctx, false).await.unwrap();
    env.unpublish("vol", &target).await.unwrap();
    assert!(!target.exists());
}

/// Issue 14 item 8: every prefix CreateVolume hands out mounts, whatever characters it has (a
/// space, a comma, `=`, a backslash, non-ASCII); one that leaves no room for a key is refused at
/// CreateVolume and at publish (before anything is created) with INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefixes_with_any_characters_mount_and_unservable_ones_are_refused_up_front() {
    let mut env = Env::start().await;
    env.s3.create_bucket("chars").await;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    for (i, (base, name)) in [
        ("my data", "a,b"),
        ("x=y", "back\\slash"),
        ("caf\u{e9}", "sp ace,and=all"),
    ]
    .into_iter()
    .enumerate()
    {
        let vol = env
            .ctrl
            .create_volume(pb::CreateVolumeRequest {
                name: name.into(),
                parameters: map(&[("bucketName", "chars"), ("basePrefix", base)]),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let prefix = format!("{base}/{name}/");
        assert_eq!(vol.volume_context["prefix"], prefix);
        env.store
            .put(
                "chars",
                &format!("{prefix}f.txt"),
                Bytes::from_static(b"ok"),
            )
            .await
            .unwrap();
        let target = env.target(&format!("pod-{i}"), "pv");
        env.publish(
            &vol.volume_id,
            &target,
            cap.clone(),
            vol.volume_context.clone(),
            false,
        )
        .await
        .unwrap();
        let top = mounted_at(&target).unwrap();
        assert!(top.is_ferry(), "{top:?}");
        assert_eq!(
            ferry_fs::config::decode_fs_name(&top.source).as_deref(),
            Some(format!("chars/{prefix}").as_str()),
            "{top:?}"
        );
        let t = target.clone();
        let got = tokio::task::spawn_blocking(move || std::fs::read(t.join("f.txt")))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, b"ok");
        env.unpublish(&vol.volume_id, &target).await.unwrap();
    }

    // 1,023 bytes and its '/': no key fits below it.
    let base = vec!["b".repeat(249); 4].join("/");
    let name = "n".repeat(23);
    let e = env
        .ctrl
        .create_volume(pb::CreateVolumeRequest {
            name: name.clone(),
            parameters: map(&[("bucketName", "chars"), ("basePrefix", &base)]),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let target = env.target("pod-long", "pv");
    let e = env
        .publish(
            "long",
            &target,
            cap.clone(),
            map(&[
                ("bucketName", "chars"),
                ("prefix", &format!("{base}/{name}/")),
            ]),
            false,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(!target.exists(), "a refused publish creates nothing");
}

/// Issue 14 item 9: targets the kernel cannot take (a 300-byte name, a NUL) are INVALID_ARGUMENT,
/// and no error quotes a huge input back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn impossible_targets_are_invalid_and_errors_quote_inputs_short() {
    let mut env = Env::start().await;
    env.s3.create_bucket("quote").await;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let ctx = map(&[("bucketName", "quote")]);
    let parent = env.target("pod-q", "pv").parent().unwrap().to_path_buf();
    let huge = "h".repeat(1 << 20);
    for target in [
        parent.join("m".repeat(300)),
        parent.join("mo\0unt"),
        parent.join(&huge),
    ] {
        let e = env
            .publish("vol", &target, cap.clone(), ctx.clone(), false)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{:?}", e.code());
        assert!(e.message().len() < 1024, "{} bytes", e.message().len());
        let e = env.unpublish("vol", &target).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{:?}", e.code());
    }
    assert_eq!(
        std::fs::read_dir(&parent).unwrap().count(),
        0,
        "nothing created"
    );

    let short = |e: tonic::Status| {
        assert!(
            e.message().len() < 1024,
            "{:?}: {} bytes: {}",
            e.code(),
            e.message().len(),
            &e.message()[..200]
        );
        e.code()
    };
    // A volume context value, a mount flag, a parameter key and value, a volume id.
    let target = parent.join("mount");
    let e = env
        .publish(
            "vol",
            &target,
            cap.clone(),
            map(&[("bucketName", &huge)]),
            false,
        )
        .await
        .unwrap_err();
    assert_eq!(short(e), Code::InvalidArgument);
    let e = env
        .publish(
            "vol",
            &target,
            mount_capability(Mode::SingleNodeWriter, &[&format!("uid={huge}")]),
            ctx.clone(),
            false,
        )
        .await
        .unwrap_err();
    assert_eq!(short(e), Code::InvalidArgument);
    for params in [
        map(&[("bucketName", "quote"), (&huge, "x")]),
        map(&[("bucketName", "quote"), ("deletePolicy", &huge)]),
    ] {
        let e = env
            .ctrl
            .create_volume(pb::CreateVolumeRequest {
                name: "v".into(),
                parameters: params,
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(short(e), Code::InvalidArgument);
    }
    let e = env
        .ctrl
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: huge.clone(),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(short(e), Code::NotFound);
    env.publish("vol", &target, cap.clone(), ctx.clone(), false)
        .await
        .unwrap();
    // Not the volume published there: OK, and nothing is touched.
    env.unpublish(&huge, &target).await.unwrap();
    assert_eq!(env.mounts.len(), 1);
    env.unpublish("vol", &target).await.unwrap();
}

/// Issue 14 item 6: a volume may name only the endpoints the operator allows. An endpoint outside
/// the list is refused — CreateVolume and NodePublishVolume with InvalidArgument, DeleteVolume and
/// ValidateVolumeCapabilities of an id naming it with FailedPrecondition — with a message naming
/// it and the flag, before any connection is made to it, whoever's credentials would sign (the
/// driver's, or a node-publish Secret's keys). An allowed endpoint other than the default works
/// end to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn endpoints_the_operator_did_not_allow_are_refused_before_any_connection() {
    // Allowed besides the default: a forwarder to versitygw on a port of its own, named exactly.
    // Refused: the recorder, on another loopback port.
    let recorder = common::Recorder::start();
    let mut forwarder = None;
    let mut env = Env::start_allowing(|s3| {
        let f = FaultProxy::start(([127, 0, 0, 1], s3.port()).into()).unwrap();
        let allowed = AllowedEndpoints::parse(&format!("aws,{}", f.url())).unwrap();
        forwarder = Some(f);
        Some(allowed)
    })
    .await;
    let forwarder = forwarder.unwrap();
    env.s3.create_bucket("fenced").await;
    env.store
        .put(
            "fenced",
            "static/a.txt",
            Bytes::from_static(b"via the forwarder"),
        )
        .await
        .unwrap();
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let refused = recorder.url.clone();
    let assert_refused = |e: tonic::Status, code: Code| {
        assert_eq!(e.code(), code, "{e:?}");
        let m = e.message();
        assert!(m.contains(&refused), "names the endpoint: {m}");
        assert!(m.contains("--allowed-endpoints"), "names the flag: {m}");
    };

    // CreateVolume naming it: InvalidArgument.
    let create = |name: &str, endpoint: &str| pb::CreateVolumeRequest {
        name: name.into(),
        parameters: map(&[
            ("bucketName", "fenced"),
            ("endpointUrl", endpoint),
            ("forcePathStyle", "true"),
            ("deletePolicy", "delete"),
        ]),
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    };
    let e = env
        .ctrl
        .create_volume(create("pvc-refused", &refused))
        .await
        .unwrap_err();
    assert_refused(e, Code::InvalidArgument);

    // NodePublishVolume naming it as an attribute, as a mount option, or with a Secret's keys.
    let target = env.target("pod-fenced", "pv-fenced");
    let ctx = |endpoint: &str| {
        map(&[
            ("bucketName", "fenced"),
            ("prefix", "static/"),
            ("endpointUrl", endpoint),
            ("forcePathStyle", "true"),
        ])
    };
    let option = format!("endpoint-url {refused}");
    let publishes = [
        (ctx(&refused), cap.clone(), HashMap::new()),
        (
            map(&[("bucketName", "fenced"), ("prefix", "static/")]),
            mount_capability(
                Mode::SingleNodeWriter,
                &[option.as_str(), "force-path-style"],
            ),
            HashMap::new(),
        ),
        (
            ctx(&refused),
            cap.clone(),
            map(&[
                ("accessKeyId", env.s3.access_key()),
                ("secretAccessKey", env.s3.secret_key()),
            ]),
        ),
    ];
    for (context, capability, secrets) in publishes {
        let e = env
            .node
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: "pv-fenced".into(),
                target_path: target.display().to_string(),
                volume_capability: Some(capability),
                volume_context: context,
                secrets,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_refused(e, Code::InvalidArgument);
    }
    assert!(
        !target.exists(),
        "a refused publish leaves no target behind"
    );

    // A volume id naming it (made under a looser list): DeleteVolume and
    // ValidateVolumeCapabilities answer FailedPrecondition; a retained one is deleted with no
    // request at all, so it is fine.
    let id = |delete_policy| {
        VolumeId {
            bucket: "fenced".into(),
            prefix: "vol/".into(),
            endpoint: Endpoint {
                endpoint_url: Some(refused.clone()),
                region: None,
                force_path_style: true,
            },
            delete_policy,
        }
        .encode()
    };
    let e = env
        .ctrl
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id(DeletePolicy::Delete),
            secrets: Default::default(),
        })
        .await
        .unwrap_err();
    assert_refused(e, Code::FailedPrecondition);
    let e = env
        .ctrl
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: id(DeletePolicy::Retain),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_refused(e, Code::FailedPrecondition);
    env.ctrl
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id(DeletePolicy::Retain),
            secrets: Default::default(),
        })
        .await
        .unwrap();

    assert_eq!(
        recorder.connections(),
        0,
        "a refused endpoint was connected to"
    );

    // The allowed endpoint works end to end: create, publish and read, delete.
    let before = forwarder.requests();
    let vol = env
        .ctrl
        .create_volume(create("pvc-allowed", &forwarder.url()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert!(vol.volume_id.contains("endpoint="), "{}", vol.volume_id);
    env.publish(
        "pv-allowed",
        &target,
        cap.clone(),
        ctx(&forwarder.url()),
        false,
    )
    .await
    .unwrap();
    let t = target.clone();
    let got = tokio::task::spawn_blocking(move || std::fs::read(t.join("a.txt")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, b"via the forwarder");
    env.unpublish("pv-allowed", &target).await.unwrap();
    env.ctrl
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id,
            secrets: Default::default(),
        })
        .await
        .unwrap();
    assert!(
        forwarder.requests() > before,
        "the allowed endpoint's requests went through it"
    );
    assert_eq!(recorder.connections(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_s3_endpoint_fails_its_own_publish_and_delays_no_other() {
    // An endpoint that accepts connections and never answers.
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hung = format!("http://{}", hole.local_addr().unwrap());
    std::thread::spawn(move || {
        let held: Vec<_> = hole.incoming().map_while(Result::ok).collect();
        drop(held);
    });
    let env =
        Env::start_allowing(|_| Some(AllowedEndpoints::parse(&format!("aws,{hung}")).unwrap()))
            .await;
    env.s3.create_bucket("storm").await;
    env.store
        .put("storm", "ok/a.txt", Bytes::from_static(b"fine"))
        .await
        .unwrap();
    async fn publish(
        mut node: NodeClient<Channel>,
        target: PathBuf,
        context: HashMap<String, String>,
    ) -> (
        Result<tonic::Response<pb::NodePublishVolumeResponse>, tonic::Status>,
        PathBuf,
    ) {
        let res = node
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: format!("vol-{}", target.display()),
                target_path: target.display().to_string(),
                volume_capability: Some(mount_capability(Mode::SingleNodeWriter, &[])),
                volume_context: context,
                ..Default::default()
            })
            .await;
        (res, target)
    }
    let hung_publish = tokio::spawn(publish(
        env.node.clone(),
        env.target("pod-hung", "pv"),
        map(&[
            ("bucketName", "storm"),
            ("prefix", "ok/"),
            ("endpointUrl", &hung),
            ("forcePathStyle", "true"),
        ]),
    ));
    // The hung publish is under way; others publish and read while it waits.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    for pod in ["pod-1", "pod-2"] {
        let context = map(&[("bucketName", "storm"), ("prefix", "ok/")]);
        let (res, target) = publish(env.node.clone(), env.target(pod, "pv"), context).await;
        res.unwrap();
        assert_eq!(std::fs::read(target.join("a.txt")).unwrap(), b"fine");
        assert!(
            !hung_publish.is_finished(),
            "the other volumes were published while the hung one still waited"
        );
    }
    let (res, target) = hung_publish.await.unwrap();
    let e = res.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(
        e.message().contains(&hung),
        "names the endpoint: {}",
        e.message()
    );
    assert!(e.message().contains("did not answer"), "{}", e.message());
    assert!(!target.exists(), "a failed publish leaves no target behind");
}

/// Issue 16: a storm of publishes of one volume from many pods all succeed, and publishes and
/// unpublishes racing on one target each either happen or answer `Aborted` (the spec's "operation
/// pending for volume"), leaving the target either mounted once (and in the table) or not at all,
/// never a second mount, a leaked FUSE connection or an entry without a mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_publishes_and_unpublishes_stay_consistent() {
    let env = Env::start().await;
    env.s3.create_bucket("race").await;
    env.store
        .put("race", "data/a.txt", Bytes::from_static(b"race"))
        .await
        .unwrap();
    let kubelet = env.dir.path().join("kubelet");
    let context = map(&[("bucketName", "race"), ("prefix", "data/")]);
    let publish_req = |target: &std::path::Path| pb::NodePublishVolumeRequest {
        volume_id: "pv-race".into(),
        target_path: target.display().to_string(),
        volume_capability: Some(mount_capability(Mode::MultiNodeReaderOnly, &[])),
        readonly: true,
        volume_context: context.clone(),
        ..Default::default()
    };

    // One volume from 40 pods at once: every publish succeeds and every mount reads.
    let targets: Vec<PathBuf> = (0..40)
        .map(|i| env.target(&format!("pod-{i:02}"), "pv-race"))
        .collect();
    let calls = targets.iter().map(|t| {
        let (mut node, req) = (env.node.clone(), publish_req(t));
        async move { node.node_publish_volume(req).await }
    });
    for r in futures::future::join_all(calls).await {
        r.unwrap();
    }
    for t in &targets {
        assert_eq!(std::fs::read(t.join("a.txt")).unwrap(), b"race");
    }
    assert_eq!(env.mounts.len(), 40);
    assert_eq!(ferry_mounts_below(&kubelet).len(), 40);

    // Publishes and unpublishes of one target racing, round after round.
    let target = env.target("pod-race", "pv-race");
    for round in 0..12 {
        let calls = (0..6).map(|i| {
            let mut node = env.node.clone();
            let (publish, target) = (publish_req(&target), target.clone());
            async move {
                let res = if (i + round) % 3 == 0 {
                    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                        volume_id: "pv-race".into(),
                        target_path: target.display().to_string(),
                    })
                    .await
                    .map(|_| ())
                } else {
                    node.node_publish_volume(publish).await.map(|_| ())
                };
                match res {
                    Ok(()) => {}
                    Err(e) => assert_eq!(e.code(), Code::Aborted, "{e:?}"),
                }
            }
        });
        futures::future::join_all(calls).await;
        let mounted = ferry_mounts_below(&target);
        let in_table = env.mounts.get(&target).is_some();
        assert!(mounted.len() <= 1, "round {round}: mounted {mounted:?}");
        assert_eq!(
            mounted.len() == 1,
            in_table,
            "round {round}: table and mounts agree"
        );
        if in_table {
            assert_eq!(std::fs::read(target.join("a.txt")).unwrap(), b"race");
        }
    }

    // Everything unpublished at once: no mount and no FUSE connection of these is left.
    let all = targets.iter().chain(std::iter::once(&target)).map(|t| {
        let mut node = env.node.clone();
        let t = t.display().to_string();
        async move {
            node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                volume_id: "pv-race".into(),
                target_path: t,
            })
            .await
        }
    });
    for r in futures::future::join_all(all).await {
        r.unwrap();
    }
    assert!(env.mounts.is_empty());
    assert!(ferry_mounts_below(&kubelet).is_empty());
}
