//! Credentials end to end against moto (S3 that checks SigV4 signatures and the IAM policies of
//! the signing user or assumed role; STS; IAM) and real FUSE mounts: static keys from a Secret,
//! pod-level IRSA, pod-level EKS Pod Identity (through a stand-in agent), a token renewed by
//! republish while a reader keeps reading, a role denied a prefix (EACCES), a role denied the
//! bucket (PermissionDenied naming role, bucket and action), an identity change on a live mount
//! (refused), a pod-level volume naming an endpoint the operator did not allow (refused before its
//! credentials are fetched) — all with every log line at trace level captured and searched for
//! secrets.
//!
//! The pods' ServiceAccounts live in a real kube-apiserver (testkit's `KubeCluster`), read by the
//! node through kube as in production, and their tokens come from its TokenRequest API for
//! the audiences the CSIDriver declares. moto does not verify web identity tokens; the Pod
//! Identity stand-in accepts only the tokens associated with a role.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ferry_creds::{
    PodCredentialCache, PodSettings, ProviderSettings, POD_IDENTITY_AUDIENCE, ROLE_ARN_ANNOTATION,
    STS_AUDIENCE,
};
use ferry_csi::stores::S3Stores;
use ferry_e2e::{mount_capability, ControllerClient, NodeClient};
use ferry_node::accounts::KubeServiceAccounts;
use ferry_node::mounts::MountTable;
use ferry_node::{NodeConfig, NodeService, PodAuth};
use ferry_proto::csi::v1 as pb;
use ferry_testkit::apply::{apply, DryRun};
use ferry_testkit::kube::{create_token, KubeCluster};
use ferry_testkit::{MotoServer, PodIdentityAgent};
use ferry_volume::{keys, Endpoint, MetadataTtl};
use pb::volume_capability::access_mode::Mode;
use secrecy::ExposeSecret;
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

struct Env {
    _moto: MotoServer,
    agent: PodIdentityAgent,
    _cluster: KubeCluster,
    kube: kube::Client,
    dir: tempfile::TempDir,
    ctrl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
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
        let cluster = KubeCluster::start().await.unwrap_or_else(|e| panic!("{e}"));
        let kube = cluster.client().await.unwrap();
        let ns = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}});
        apply(&kube, &ns, "default", "ferry-test", DryRun::No)
            .await
            .unwrap();
        let mut provider = ProviderSettings::load(None).await;
        provider.sdk = provider
            .sdk
            .into_builder()
            .endpoint_url(moto.endpoint_url())
            .build();
        let pod_auth = PodAuth {
            // The node reads ServiceAccounts with its own client, as in production.
            accounts: Arc::new(KubeServiceAccounts(cluster.client().await.unwrap())),
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
        let (ctrl, node) = common::serve(dir.path(), stores, node).await;
        Env {
            ctrl,
            node,
            _moto: moto,
            agent,
            _cluster: cluster,
            kube,
            dir,
            roles: setup.roles,
            user: setup.users["static-user"].clone(),
        }
    }

    /// Creates or updates `ml/<name>` with the role annotation (or none).
    async fn service_account(&self, name: &str, role: Option<&str>) {
        let mut annotations = serde_json::Map::new();
        if let Some(r) = role {
            annotations.insert(ROLE_ARN_ANNOTATION.into(), r.into());
        }
        let sa = serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": "ml", "annotations": annotations}});
        apply(&self.kube, &sa, "ml", "ferry-test", DryRun::No)
            .await
            .unwrap();
    }

    /// A token for `ml/<sa>` from the TokenRequest API, as kubelet gets for `tokenRequests`.
    async fn token(&self, sa: &str, audience: &str) -> String {
        let t = create_token(&self.kube, "ml", sa, &[audience], 3600)
            .await
            .unwrap();
        t.token.expose_secret().to_string()
    }

    /// kubelet's tokens value for a pod of `ml/<sa>`: one token per declared audience.
    async fn tokens(&self, sa: &str) -> (String, String) {
        (
            self.token(sa, STS_AUDIENCE).await,
            self.token(sa, POD_IDENTITY_AUDIENCE).await,
        )
    }

    fn target(&self, pod: &str, pv: &str) -> PathBuf {
        ferry_testkit::kubelet_target(&self.dir.path().join("kubelet"), pod, pv)
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
    tokens: &(String, String),
) -> HashMap<String, String> {
    let tokens = serde_json::json!({
        STS_AUDIENCE: {"token": tokens.0, "expirationTimestamp": "2099-01-01T00:00:00Z"},
        POD_IDENTITY_AUDIENCE: {"token": tokens.1, "expirationTimestamp": "2099-01-01T00:00:00Z"},
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
    env.service_account("reader", Some(&reader_a)).await;
    let irsa_token = env.tokens("reader").await;
    secrets_to_hide.extend([irsa_token.0.clone(), irsa_token.1.clone()]);
    let t_irsa = env.target("pod-irsa", "pv-a");
    env.publish(
        &t_irsa,
        pod_context("team-a/", "ml", "trainer-0", "reader", &irsa_token),
        HashMap::new(),
    )
    .await
    .unwrap();
    assert_eq!(
        read(t_irsa.join("hello.txt")).await.unwrap(),
        b"hello from team a"
    );
    // The tokens in the secrets instead (a CSIDriver with serviceAccountTokenInSecrets,
    // Kubernetes 1.35+), under the same key: the pod's identity, not a node-publish Secret.
    let mut ctx = pod_context("team-a/", "ml", "trainer-0", "reader", &irsa_token);
    let tokens = ctx.remove(keys::SERVICE_ACCOUNT_TOKENS).unwrap();
    let in_secrets = map(&[(keys::SERVICE_ACCOUNT_TOKENS, &tokens)]);
    let t_sec = env.target("pod-irsa-secrets", "pv-a2");
    env.publish(&t_sec, ctx, in_secrets.clone()).await.unwrap();
    assert_eq!(
        read(t_sec.join("hello.txt")).await.unwrap(),
        b"hello from team a"
    );
    env.unpublish(&t_sec).await;
    // A volume with the driver's credentials gets them too (kubelet passes them for every volume
    // of the driver): no Secret keys in them, so the node plugin's own credentials are used (this
    // node plugin has none), not an InvalidArgument "Secret without keys".
    let t_drv = env.target("pod-driver-tokens", "pv-d2");
    let e = env
        .publish(
            &t_drv,
            map(&[(keys::BUCKET_NAME, BUCKET), (keys::PREFIX, "static/")]),
            in_secrets,
        )
        .await
        .unwrap_err();
    assert_ne!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("the node plugin's credentials"),
        "{}",
        e.message()
    );
    // Republish with a new token: same identity, no remount.
    let irsa_token_2 = env.tokens("reader").await;
    secrets_to_hide.extend([irsa_token_2.0.clone(), irsa_token_2.1.clone()]);
    env.publish(
        &t_irsa,
        pod_context("team-a/", "ml", "trainer-0", "reader", &irsa_token_2),
        HashMap::new(),
    )
    .await
    .unwrap();
    // The service account now names another role: the live mount refuses to change identity.
    let other = env.roles["other"].clone();
    env.service_account("reader", Some(&other)).await;
    let e = env
        .publish(
            &t_irsa,
            pod_context("team-a/", "ml", "trainer-0", "reader", &irsa_token_2),
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
    assert!(!e.message().contains(&irsa_token_2.0), "{}", e.message());
    assert_eq!(
        read(t_irsa.join("hello.txt")).await.unwrap(),
        b"hello from team a"
    );
    env.service_account("reader", Some(&reader_a)).await;

    // --- A role allowed to list but not to read team-b/: EACCES at the mount.
    let t_b = env.target("pod-denied", "pv-b");
    env.publish(
        &t_b,
        pod_context("team-b/", "ml", "trainer-1", "reader", &irsa_token),
        HashMap::new(),
    )
    .await
    .unwrap();
    let e = read(t_b.join("secret.txt")).await.unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e:?}");
    env.unpublish(&t_b).await;

    // --- A role that may not list the bucket: PermissionDenied naming role, bucket and action.
    let no_list = env.roles["no-list"].clone();
    env.service_account("no-list", Some(&no_list)).await;
    let irsa_token = env.tokens("no-list").await;
    secrets_to_hide.extend([irsa_token.0.clone(), irsa_token.1.clone()]);
    let t_n = env.target("pod-nolist", "pv-n");
    let e = env
        .publish(
            &t_n,
            pod_context("team-a/", "ml", "trainer-2", "no-list", &irsa_token),
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
    env.service_account("pia", None).await;
    let (pia_1, pia_2) = (env.tokens("pia").await, env.tokens("pia").await);
    for t in [&pia_1, &pia_2] {
        secrets_to_hide.extend([t.0.clone(), t.1.clone()]);
    }
    env.agent.associate(&[(&pia_1.1, "t1", &reader_a)]);
    let t_p = env.target("pod-pia", "pv-p");
    env.publish(
        &t_p,
        pod_context("team-a/", "ml", "trainer-3", "pia", &pia_1),
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
    env.agent.associate(&[(&pia_2.1, "t2", &reader_a)]);
    env.publish(
        &t_p,
        pod_context("team-a/", "ml", "trainer-3", "pia", &pia_2),
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

    // --- The allowed-endpoints list holds for pod-level credentials too: a pod-level volume that
    // names an endpoint the operator did not allow is refused before the pod's credentials are
    // fetched (the agent sees no request) and before a connection is made to it.
    let recorder = common::Recorder::start();
    let asked = env.agent.seen().len();
    let mut ctx = pod_context("team-a/", "ml", "trainer-4", "pia", &pia_2);
    ctx.insert(keys::ENDPOINT_URL.into(), recorder.url.clone());
    let t_f = env.target("pod-fenced", "pv-f");
    let e = env.publish(&t_f, ctx, HashMap::new()).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains(&recorder.url), "{}", e.message());
    assert_eq!(
        env.agent.seen().len(),
        asked,
        "the pod's credentials were fetched"
    );
    assert_eq!(
        recorder.connections(),
        0,
        "the refused endpoint was connected to"
    );

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
