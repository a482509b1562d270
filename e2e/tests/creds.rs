//! Credentials end to end against moto (S3 that checks SigV4 signatures and the IAM policies of
//! the signing user or assumed role; STS; IAM) and real FUSE mounts: static keys from a Secret,
//! pod-level IRSA, pod-level EKS Pod Identity (through a stand-in agent), a token renewed by
//! republish while a reader keeps reading, a role denied a prefix (EACCES), a role denied the
//! bucket (PermissionDenied naming role, bucket and action), an identity change on a live mount
//! (refused) — all with every log line at trace level captured and searched for secrets.
//!
//! INTERIM (until ferry-kube lands): the pods' ServiceAccounts are an in-test map rather than a
//! kube-apiserver, and the service-account tokens are strings made here rather than TokenRequest
//! tokens (moto does not verify web identity tokens; the Pod Identity stand-in checks them against
//! its association list).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ferry_controller::ControllerService;
use ferry_creds::{
    CredsError, PodCredentialCache, PodSettings, ProviderSettings, ServiceAccounts,
    ROLE_ARN_ANNOTATION,
};
use ferry_csi::pb::controller_server::ControllerServer;
use ferry_csi::pb::node_server::NodeServer;
use ferry_csi::stores::S3Stores;
use ferry_e2e::{mount_capability, unix_channel, ControllerClient, NodeClient};
use ferry_node::mounts::MountTable;
use ferry_node::{NodeConfig, NodeService, PodAuth};
use ferry_proto::csi::v1 as pb;
use ferry_testkit::{MotoServer, PodIdentityAgent};
use ferry_volume::{keys, Endpoint, MetadataTtl};
use pb::volume_capability::access_mode::Mode;
use tonic::transport::Channel;
use tonic::Code;

const BUCKET: &str = "ferry-creds";
/// Every session token moto issues starts with this.
const MOTO_SESSION_TOKEN_PREFIX: &str = "FQoGZXIvYXdzEBYaD";

/// Everything logged in this test binary, at trace level, from every crate (the SDK's included).
fn captured() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let w = buf.clone();
        tracing_subscriber::fmt()
            .with_env_filter(ferry_csi::log::filter("trace").unwrap())
            .with_ansi(false)
            .with_writer(move || Capture(w.clone()))
            .init();
        buf
    })
    .clone()
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// INTERIM: ServiceAccount annotations by (namespace, name), standing in for the kube-apiserver.
#[derive(Default)]
struct Accounts(Mutex<HashMap<(String, String), HashMap<String, String>>>);

impl Accounts {
    fn set(&self, ns: &str, name: &str, role: Option<&str>) {
        let mut a = HashMap::new();
        if let Some(r) = role {
            a.insert(ROLE_ARN_ANNOTATION.to_string(), r.to_string());
        }
        self.0
            .lock()
            .unwrap()
            .insert((ns.to_string(), name.to_string()), a);
    }
}

#[async_trait::async_trait]
impl ServiceAccounts for Accounts {
    async fn annotations(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<HashMap<String, String>, CredsError> {
        self.0
            .lock()
            .unwrap()
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| {
                CredsError::Invalid(format!("service account {namespace}/{name} not found"))
            })
    }
}

struct Env {
    _moto: MotoServer,
    agent: PodIdentityAgent,
    dir: tempfile::TempDir,
    ctrl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    accounts: Arc<Accounts>,
    roles: HashMap<String, String>,
    user: (String, String),
}

fn allow(actions: &[&str], resources: &[&str]) -> String {
    serde_json::json!({"Effect": "Allow", "Action": actions, "Resource": resources}).to_string()
}

impl Env {
    async fn start() -> Env {
        let moto = MotoServer::start();
        let bucket_arn = format!("arn:aws:s3:::{BUCKET}");
        let list = allow(&["s3:ListBucket"], &[&bucket_arn]);
        let read_a = allow(&["s3:GetObject"], &[&format!("{bucket_arn}/team-a/*")]);
        let all = allow(&["s3:*"], &[&bucket_arn, &format!("{bucket_arn}/*")]);
        let setup = moto.setup(
            &[(
                BUCKET,
                &[
                    ("team-a/hello.txt", "hello from team a"),
                    ("team-b/secret.txt", "team b only"),
                    ("static/s.txt", "static keys work"),
                ],
            )],
            &[("static-user", &format!("[{all}]"))],
            &[
                ("reader-a", &format!("[{list}, {read_a}]")),
                ("no-list", &format!("[{read_a}]")),
                ("other", &format!("[{list}, {read_a}]")),
            ],
        );
        // Pod Identity credentials live 8 s here, so the provider refreshes every 4 s.
        let agent = PodIdentityAgent::start(&moto, 8);
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("kubelet/pods")).unwrap();
        let defaults = Endpoint {
            endpoint_url: Some(moto.endpoint_url()),
            region: Some("us-east-1".into()),
            force_path_style: true,
        };
        let stores = Arc::new(S3Stores::new(defaults));
        let accounts = Arc::new(Accounts::default());
        let mut provider = ProviderSettings::load(None).await;
        provider.sdk = provider
            .sdk
            .into_builder()
            .endpoint_url(moto.endpoint_url())
            .build();
        let pod_auth = PodAuth {
            accounts: accounts.clone(),
            cache: PodCredentialCache::new(provider),
            settings: PodSettings {
                pod_identity_agent_url: agent.url(),
                default_sts_region: Some("us-east-1".into()),
            },
        };
        let node = NodeService::with_pod_auth(
            NodeConfig {
                node_id: "creds-node".into(),
                kubelet_root: dir.path().join("kubelet"),
                default_metadata_ttl: MetadataTtl::Minimal,
            },
            stores.clone(),
            Arc::new(MountTable::default()),
            Some(pod_auth),
        );
        let ctrl_sock = dir.path().join("ctrl.sock");
        let node_sock = dir.path().join("node.sock");
        let ctrl_in = ferry_csi::endpoint::bind(&ctrl_sock).unwrap();
        let node_in = ferry_csi::endpoint::bind(&node_sock).unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .layer(ferry_csi::log::RpcLogLayer)
                .add_service(ControllerServer::new(ControllerService::new(stores)))
                .serve_with_incoming(ctrl_in),
        );
        tokio::spawn(
            tonic::transport::Server::builder()
                .layer(ferry_csi::log::RpcLogLayer)
                .add_service(NodeServer::new(node))
                .serve_with_incoming(node_in),
        );
        Env {
            ctrl: ControllerClient::new(unix_channel(&ctrl_sock).await.unwrap()),
            node: NodeClient::new(unix_channel(&node_sock).await.unwrap()),
            _moto: moto,
            agent,
            dir,
            accounts,
            roles: setup.roles,
            user: setup.users["static-user"].clone(),
        }
    }

    fn target(&self, pod: &str, pv: &str) -> PathBuf {
        let parent = self
            .dir
            .path()
            .join("kubelet/pods")
            .join(pod)
            .join("volumes/kubernetes.io~csi")
            .join(pv);
        std::fs::create_dir_all(&parent).unwrap();
        parent.join("mount")
    }

    async fn publish(
        &mut self,
        target: &Path,
        ctx: HashMap<String, String>,
        secrets: HashMap<String, String>,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: format!("vol-{}", target.display()),
                target_path: target.display().to_string(),
                volume_capability: Some(mount_capability(
                    Mode::MultiNodeReaderOnly,
                    &["metadata-ttl minimal"],
                )),
                volume_context: ctx,
                secrets,
                readonly: true,
                ..Default::default()
            })
            .await
            .map(drop)
    }

    async fn unpublish(&mut self, target: &Path) {
        self.node
            .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                volume_id: format!("vol-{}", target.display()),
                target_path: target.display().to_string(),
            })
            .await
            .unwrap();
    }
}

fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The volume context kubelet sends for a pod-level volume (podInfoOnMount, tokenRequests).
fn pod_context(
    prefix: &str,
    ns: &str,
    pod: &str,
    sa: &str,
    token: &str,
) -> HashMap<String, String> {
    let tokens = serde_json::json!({
        "sts.amazonaws.com": {"token": token, "expirationTimestamp": "2099-01-01T00:00:00Z"},
        "pods.eks.amazonaws.com": {"token": token, "expirationTimestamp": "2099-01-01T00:00:00Z"},
    });
    map(&[
        (keys::BUCKET_NAME, BUCKET),
        (keys::PREFIX, prefix),
        (keys::AUTHENTICATION_SOURCE, "pod"),
        (keys::POD_NAMESPACE, ns),
        (keys::POD_NAME, pod),
        (keys::POD_UID, pod),
        (keys::SERVICE_ACCOUNT_NAME, sa),
        (keys::SERVICE_ACCOUNT_TOKENS, &tokens.to_string()),
    ])
}

async fn read(path: PathBuf) -> std::io::Result<Vec<u8>> {
    tokio::task::spawn_blocking(move || std::fs::read(path))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn credentials_end_to_end_at_trace_level() {
    let log = captured();
    let mut env = Env::start().await;
    let mut secrets_to_hide: Vec<String> = vec![env.user.1.clone()];

    // --- Static keys from the node-publish Secret (Ferry's key names and Mountpoint's).
    let t = env.target("pod-static", "pv-static");
    let secret = map(&[
        ("accessKeyId", &env.user.0),
        ("secretAccessKey", &env.user.1),
    ]);
    env.publish(
        &t,
        map(&[(keys::BUCKET_NAME, BUCKET), (keys::PREFIX, "static/")]),
        secret.clone(),
    )
    .await
    .unwrap();
    assert_eq!(read(t.join("s.txt")).await.unwrap(), b"static keys work");
    env.unpublish(&t).await;
    let wrong = map(&[
        ("key_id", &env.user.0),
        ("access_key", "not-the-secret-key-0000"),
    ]);
    secrets_to_hide.push("not-the-secret-key-0000".into());
    let e = env
        .publish(
            &t,
            map(&[(keys::BUCKET_NAME, BUCKET), (keys::PREFIX, "static/")]),
            wrong,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains(&env.user.0), "{}", e.message());

    // --- Static keys on the controller: CreateVolume with the provisioner Secret's keys.
    let created = env
        .ctrl
        .create_volume(pb::CreateVolumeRequest {
            name: "pvc-static".into(),
            volume_capabilities: vec![mount_capability(Mode::MultiNodeReaderOnly, &[])],
            parameters: map(&[(keys::BUCKET_NAME, BUCKET), (keys::BASE_PREFIX, "dyn")]),
            secrets: secret.clone(),
            ..Default::default()
        })
        .await;
    assert!(created.is_ok(), "{created:?}");
    let denied = env
        .ctrl
        .create_volume(pb::CreateVolumeRequest {
            name: "pvc-static-2".into(),
            volume_capabilities: vec![mount_capability(Mode::MultiNodeReaderOnly, &[])],
            parameters: map(&[(keys::BUCKET_NAME, BUCKET), (keys::BASE_PREFIX, "dyn")]),
            secrets: map(&[
                ("accessKeyId", &env.user.0),
                ("secretAccessKey", "wrong-wrong-wrong"),
            ]),
            ..Default::default()
        })
        .await
        .unwrap_err();
    secrets_to_hide.push("wrong-wrong-wrong".into());
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");

    // --- Pod-level IRSA: the service account's role reads team-a/.
    let reader_a = env.roles["reader-a"].clone();
    env.accounts.set("ml", "reader", Some(&reader_a));
    let irsa_token = "irsa-token-pod-1-eyJhbGciOiJSUzI1NiJ9";
    secrets_to_hide.push(irsa_token.into());
    let t_irsa = env.target("pod-irsa", "pv-a");
    env.publish(
        &t_irsa,
        pod_context("team-a/", "ml", "trainer-0", "reader", irsa_token),
        HashMap::new(),
    )
    .await
    .unwrap();
    assert_eq!(
        read(t_irsa.join("hello.txt")).await.unwrap(),
        b"hello from team a"
    );
    // Republish with a new token: same identity, no remount.
    let irsa_token_2 = "irsa-token-pod-2-eyJhbGciOiJSUzI1NiJ9";
    secrets_to_hide.push(irsa_token_2.into());
    env.publish(
        &t_irsa,
        pod_context("team-a/", "ml", "trainer-0", "reader", irsa_token_2),
        HashMap::new(),
    )
    .await
    .unwrap();
    // The service account now names another role: the live mount refuses to change identity.
    env.accounts.set("ml", "reader", Some(&env.roles["other"]));
    let e = env
        .publish(
            &t_irsa,
            pod_context("team-a/", "ml", "trainer-0", "reader", irsa_token_2),
            HashMap::new(),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("role/reader-a") && e.message().contains("role/other"),
        "{}",
        e.message()
    );
    assert!(!e.message().contains("irsa-token"), "{}", e.message());
    assert_eq!(
        read(t_irsa.join("hello.txt")).await.unwrap(),
        b"hello from team a"
    );
    env.accounts.set("ml", "reader", Some(&reader_a));

    // --- A role allowed to list but not to read team-b/: EACCES at the mount.
    let t_b = env.target("pod-denied", "pv-b");
    env.publish(
        &t_b,
        pod_context("team-b/", "ml", "trainer-1", "reader", irsa_token),
        HashMap::new(),
    )
    .await
    .unwrap();
    let e = read(t_b.join("secret.txt")).await.unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e:?}");
    env.unpublish(&t_b).await;

    // --- A role that may not list the bucket: PermissionDenied naming role, bucket and action.
    env.accounts
        .set("ml", "no-list", Some(&env.roles["no-list"]));
    let t_n = env.target("pod-nolist", "pv-n");
    let e = env
        .publish(
            &t_n,
            pod_context("team-a/", "ml", "trainer-2", "no-list", irsa_token),
            HashMap::new(),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    for part in ["role/no-list", BUCKET, "s3:ListBucket"] {
        assert!(
            e.message().contains(part),
            "{part} missing: {}",
            e.message()
        );
    }

    // --- Pod Identity, and a token renewed by republish while a reader keeps reading.
    env.accounts.set("ml", "pia", None);
    let (pia_1, pia_2) = ("pia-token-one-eyJhbGciOi", "pia-token-two-eyJhbGciOi");
    secrets_to_hide.extend([pia_1.to_string(), pia_2.to_string()]);
    env.agent.associate(&[(pia_1, "t1", &reader_a)]);
    let t_p = env.target("pod-pia", "pv-p");
    env.publish(
        &t_p,
        pod_context("team-a/", "ml", "trainer-3", "pia", pia_1),
        HashMap::new(),
    )
    .await
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, failures) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(Mutex::new(Vec::new())),
    );
    let reader = {
        let (stop, reads, failures, f) = (
            stop.clone(),
            reads.clone(),
            failures.clone(),
            t_p.join("hello.txt"),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match std::fs::read(&f) {
                    Ok(b) if b == b"hello from team a" => {}
                    other => failures.lock().unwrap().push(format!("{other:?}")),
                }
                reads.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    // kubelet renews the token; the old one stops being accepted.
    env.agent.associate(&[(pia_2, "t2", &reader_a)]);
    env.publish(
        &t_p,
        pod_context("team-a/", "ml", "trainer-3", "pia", pia_2),
        HashMap::new(),
    )
    .await
    .unwrap();
    // Liveness only: wait (generously) until credentials were refreshed with the new token, then
    // until the reader has read through a few more refreshes.
    let deadline = Instant::now() + Duration::from_secs(180);
    let seen_t2_at = loop {
        let seen = env.agent.seen();
        if let Some(i) = seen.iter().position(|s| s == "t2") {
            break i;
        }
        assert!(
            Instant::now() < deadline,
            "no refresh with the new token: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    loop {
        let seen = env.agent.seen();
        if seen.iter().filter(|s| *s == "t2").count() >= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "refreshes stopped: {seen:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    let seen = env.agent.seen();
    assert!(seen[..seen_t2_at].iter().all(|s| s == "t1"), "{seen:?}");
    assert!(seen[seen_t2_at..].iter().all(|s| s == "t2"), "{seen:?}");
    assert!(reads.load(Ordering::Relaxed) > 0);
    assert!(
        failures.lock().unwrap().is_empty(),
        "{:?}",
        failures.lock().unwrap()
    );
    env.unpublish(&t_p).await;
    env.unpublish(&t_irsa).await;

    // --- Nothing secret in any log line, at trace level.
    let text = String::from_utf8_lossy(&log.lock().unwrap()).to_string();
    assert!(text.contains("TRACE"), "trace logging was not captured");
    if let Some(p) = std::env::var_os("FERRY_CREDS_TEST_LOG") {
        std::fs::write(p, &text).unwrap();
    }
    for s in &secrets_to_hide {
        assert!(
            !text.contains(s.as_str()),
            "a secret ({} chars) reached the log",
            s.len()
        );
    }
    assert!(
        !text.contains(MOTO_SESSION_TOKEN_PREFIX),
        "a session token reached the log"
    );
}
