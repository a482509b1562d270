//! The test cluster and the API client together: a real etcd + kube-apiserver +
//! kube-controller-manager, read and written through `ferry-kube` as the controller and the node
//! plugin will use it (PVC annotations, ServiceAccount annotations, TokenRequest, server-side
//! apply with dry run).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use ferry_kube::{Client, Config, DryRun};
use ferry_testkit::kube::{KubeCluster, API_AUDIENCES};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_client_against_a_real_api_server() {
    let cluster = KubeCluster::start().await.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("control plane start-up: {:?}", cluster.startup);
    // The kubeconfig the cluster writes is what csi-provisioner and `--kubeconfig` use.
    let kube = Client::new(Config::from_kubeconfig(cluster.kubeconfig(), None).unwrap()).unwrap();

    // Server-side apply, dry run first: nothing is persisted.
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}});
    kube.apply(&ns, "default", "ferry-test", DryRun::All)
        .await
        .unwrap();
    assert!(kube
        .get_opt("/api/v1/namespaces/ml")
        .await
        .unwrap()
        .is_none());
    kube.apply(&ns, "default", "ferry-test", DryRun::No)
        .await
        .unwrap();
    assert!(kube
        .get_opt("/api/v1/namespaces/ml")
        .await
        .unwrap()
        .is_some());

    // Strict field validation: an unknown field is refused, naming it.
    let bad = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "x", "namespace": "ml"}, "dataa": {}});
    let err = kube
        .apply(&bad, "ml", "ferry-test", DryRun::All)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("dataa"), "{err}");
    // An unknown kind is named as such.
    let crd = json!({"apiVersion": "example.com/v1", "kind": "Nope", "metadata": {"name": "x"}});
    let err = kube
        .apply(&crd, "ml", "ferry-test", DryRun::All)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ferry_kube::KubeError::UnknownKind { .. }),
        "{err}"
    );

    // PVC and ServiceAccount annotations.
    let pvc = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "imagenet", "annotations": {"s3.csi.ferry.dev/existing-prefix": "imagenet/train/"}},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}},
                 "storageClassName": "none"}});
    kube.apply(&pvc, "ml", "ferry-test", DryRun::No)
        .await
        .unwrap();
    let a = kube.get_pvc("ml", "imagenet").await.unwrap();
    assert_eq!(a["s3.csi.ferry.dev/existing-prefix"], "imagenet/train/");
    let err = kube.get_pvc("ml", "absent").await.unwrap_err();
    assert!(err.is_not_found(), "{err}");

    let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "trainer", "namespace": "ml",
                     "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/t"}}});
    kube.apply(&sa, "ml", "ferry-test", DryRun::No)
        .await
        .unwrap();
    let a = kube.get_service_account("ml", "trainer").await.unwrap();
    assert_eq!(
        a["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::111122223333:role/t"
    );

    // TokenRequest: a JWT for the asked audience, subject and lifetime.
    let before = SystemTime::now();
    let t = kube
        .create_token("ml", "trainer", &["sts.amazonaws.com"], 3600)
        .await
        .unwrap();
    assert!(format!("{t:?}").contains("<redacted>"));
    let life = t.expiration.duration_since(before).unwrap();
    assert!(
        life > Duration::from_secs(3000) && life < Duration::from_secs(3700),
        "{life:?}"
    );
    let payload = t.token.expose().split('.').nth(1).expect("a JWT");
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(claims["aud"], json!(["sts.amazonaws.com"]));
    assert_eq!(claims["sub"], "system:serviceaccount:ml:trainer");
    let exp = claims["exp"].as_u64().unwrap();
    let want = t.expiration.duration_since(UNIX_EPOCH).unwrap().as_secs();
    assert_eq!(exp, want);
    assert!(API_AUDIENCES.contains(&"pods.eks.amazonaws.com"));
    // An audience the API server does not serve is still issued (it is for another party).
    kube.create_token("ml", "trainer", &["pods.eks.amazonaws.com"], 600)
        .await
        .unwrap();

    // The token authenticates as the service account, which RBAC does not let read PVCs.
    let mut as_sa = Config::from_kubeconfig(cluster.kubeconfig(), None).unwrap();
    let t = kube
        .create_token("ml", "trainer", &[ferry_testkit::kube::ISSUER], 600)
        .await
        .unwrap();
    as_sa.auth = ferry_kube::Auth::Token(t.token);
    let err = Client::new(as_sa)
        .unwrap()
        .get_pvc("ml", "imagenet")
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(403), "{err}");
    assert!(
        err.to_string().contains("system:serviceaccount:ml:trainer"),
        "{err}"
    );
}

/// `--emulated-version` gives an older API surface: what the e2e uses to check the chart against
/// the oldest supported Kubernetes. `resource.k8s.io/v1` (GA in 1.34) is served by 1.36 only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_version_serves_the_older_api_surface() {
    use ferry_testkit::kube::KubeClusterOptions;
    let old = KubeCluster::start_with(KubeClusterOptions {
        emulated_version: Some("1.33".into()),
        controller_manager: false,
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let kube = old.client().unwrap();
    let claim = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "x", "namespace": "default"}, "spec": {}});
    let err = kube
        .apply(&claim, "default", "ferry-test", DryRun::All)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ferry_kube::KubeError::UnknownKind { .. }),
        "{err}"
    );
    let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "x", "namespace": "default"}});
    kube.apply(&sa, "default", "ferry-test", DryRun::All)
        .await
        .unwrap();

    let new = KubeCluster::start_with(KubeClusterOptions {
        emulated_version: None,
        controller_manager: false,
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let kube = new.client().unwrap();
    assert!(kube
        .api_resources("resource.k8s.io/v1")
        .await
        .unwrap()
        .iter()
        .any(|r| r.kind == "ResourceClaim"));
}
