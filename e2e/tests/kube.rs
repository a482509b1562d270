//! Ferry's Kubernetes API code against a real etcd + kube-apiserver + kube-controller-manager
//! (testkit's `KubeCluster`): the controller's PVC reader and the node's ServiceAccount reader
//! (annotations, a missing object, an RBAC refusal — each error naming the object and mapped to
//! the code the caller acts on), and testkit's own helpers the e2e is built on (server-side apply
//! with dry run and strict validation, unknown kinds, TokenRequest claims, `--emulated-version`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use ferry_controller::pvc::PvcAnnotations;
use ferry_creds::{CredsError, ServiceAccounts};
use ferry_csi::CsiError;
use ferry_node::accounts::KubeServiceAccounts;
use ferry_testkit::apply::{apply, ApplyError, DryRun};
use ferry_testkit::kube::{create_token, KubeCluster, API_AUDIENCES};
use k8s_openapi::api::core::v1::Namespace;
use kube::{Api, Client};
use secrecy::{ExposeSecret, SecretString};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferry_kubernetes_code_against_a_real_api_server() {
    let cluster = KubeCluster::start().await.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("control plane start-up: {:?}", cluster.startup);
    // The kubeconfig the cluster writes is what csi-provisioner and `--kubeconfig` use.
    let kube = cluster.client().await.unwrap();

    // Server-side apply, dry run first: nothing is persisted.
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}});
    let namespaces: Api<Namespace> = Api::all(kube.clone());
    apply(&kube, &ns, "default", "ferry-test", DryRun::All)
        .await
        .unwrap();
    assert!(namespaces.get_opt("ml").await.unwrap().is_none());
    apply(&kube, &ns, "default", "ferry-test", DryRun::No)
        .await
        .unwrap();
    assert!(namespaces.get_opt("ml").await.unwrap().is_some());

    // Strict field validation: an unknown field is refused, naming it and the object.
    let bad = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "x", "namespace": "ml"}, "dataa": {}});
    let err = apply(&kube, &bad, "ml", "ferry-test", DryRun::All)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("dataa") && err.contains("ConfigMap/ml/x"),
        "{err}"
    );
    // An unknown kind is named as such.
    let crd = json!({"apiVersion": "example.com/v1", "kind": "Nope", "metadata": {"name": "x"}});
    let err = apply(&kube, &crd, "ml", "ferry-test", DryRun::All)
        .await
        .unwrap_err();
    assert!(matches!(err, ApplyError::UnknownKind { .. }), "{err}");
    let err = apply(
        &kube,
        &json!({"apiVersion": "v1", "kind": "Nope", "metadata": {"name": "x"}}),
        "ml",
        "ferry-test",
        DryRun::All,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ApplyError::UnknownKind { .. }), "{err}");

    // The controller's PVC reader.
    let pvc = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "imagenet", "annotations": {"s3.csi.ferry.dev/existing-prefix": "imagenet/train/"}},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}},
                 "storageClassName": "none"}});
    apply(&kube, &pvc, "ml", "ferry-test", DryRun::No)
        .await
        .unwrap();
    let a = kube.annotations("ml", "imagenet").await.unwrap();
    assert_eq!(a["s3.csi.ferry.dev/existing-prefix"], "imagenet/train/");
    match kube.annotations("ml", "absent").await.unwrap_err() {
        CsiError::NotFound(m) => assert!(m.contains("PVC ml/absent"), "{m}"),
        other => panic!("{other:?}"),
    }

    // The node's ServiceAccount reader.
    let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "trainer", "namespace": "ml",
                     "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/t"}}});
    apply(&kube, &sa, "ml", "ferry-test", DryRun::No)
        .await
        .unwrap();
    let accounts = KubeServiceAccounts(kube.clone());
    let a = accounts.annotations("ml", "trainer").await.unwrap();
    assert_eq!(
        a["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::111122223333:role/t"
    );
    match accounts.annotations("ml", "absent").await.unwrap_err() {
        CredsError::Invalid(m) => assert!(m.contains("ml/absent"), "{m}"),
        other => panic!("{other:?}"),
    }

    // TokenRequest: a JWT for the asked audience, subject and lifetime.
    let before = SystemTime::now();
    let t = create_token(&kube, "ml", "trainer", &["sts.amazonaws.com"], 3600)
        .await
        .unwrap();
    let shown = format!("{t:?}");
    assert!(
        !shown.contains(t.token.expose_secret()),
        "token in Debug: {shown}"
    );
    let expiration = SystemTime::from(t.expiration.0);
    let life = expiration.duration_since(before).unwrap();
    assert!(
        life > Duration::from_secs(3000) && life < Duration::from_secs(3700),
        "{life:?}"
    );
    let payload = t.token.expose_secret().split('.').nth(1).expect("a JWT");
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(claims["aud"], json!(["sts.amazonaws.com"]));
    assert_eq!(claims["sub"], "system:serviceaccount:ml:trainer");
    let exp = claims["exp"].as_u64().unwrap();
    assert_eq!(
        exp,
        expiration.duration_since(UNIX_EPOCH).unwrap().as_secs()
    );
    // kubelet's format of the expiry in the volume context: RFC 3339, what k8s-openapi writes.
    let wire = serde_json::to_value(&t.expiration).unwrap();
    assert!(wire.as_str().unwrap().ends_with('Z'), "{wire}");
    assert!(API_AUDIENCES.contains(&"pods.eks.amazonaws.com"));
    // An audience the API server does not serve is still issued (it is for another party).
    create_token(&kube, "ml", "trainer", &["pods.eks.amazonaws.com"], 600)
        .await
        .unwrap();
    // A TokenRequest for a service account that does not exist names it.
    let err = create_token(&kube, "ml", "nobody", &["sts.amazonaws.com"], 600)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("ml/nobody") && err.contains("404"), "{err}");

    // A token authenticates as the service account, which RBAC lets read neither PVCs nor
    // ServiceAccounts: both readers say so, naming the object and who was refused.
    let t = create_token(&kube, "ml", "trainer", &[ferry_testkit::kube::ISSUER], 600)
        .await
        .unwrap();
    let mut as_sa = cluster.config().await.unwrap();
    as_sa.auth_info = kube::config::AuthInfo {
        token: Some(SecretString::from(t.token.expose_secret())),
        ..Default::default()
    };
    let as_sa = Client::try_from(as_sa).unwrap();
    match as_sa.annotations("ml", "imagenet").await.unwrap_err() {
        CsiError::PermissionDenied(m) => assert!(
            m.contains("PVC ml/imagenet")
                && m.contains("403")
                && m.contains("system:serviceaccount:ml:trainer"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    match KubeServiceAccounts(as_sa)
        .annotations("ml", "trainer")
        .await
        .unwrap_err()
    {
        CredsError::Unavailable(m) => assert!(
            m.contains("service account ml/trainer")
                && m.contains("RBAC")
                && m.contains("system:serviceaccount:ml:trainer"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
}

/// `--emulated-version` gives an older API surface: what the e2e uses to check the chart against
/// the oldest supported Kubernetes. `resource.k8s.io/v1` (GA in 1.34) is served by 1.36 only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_version_serves_the_older_api_surface() {
    use ferry_testkit::kube::KubeClusterOptions;
    let old = KubeCluster::start_with(KubeClusterOptions {
        emulated_version: Some("1.33".into()),
        controller_manager: false,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let kube = old.client().await.unwrap();
    let claim = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "x", "namespace": "default"}, "spec": {}});
    let err = apply(&kube, &claim, "default", "ferry-test", DryRun::All)
        .await
        .unwrap_err();
    assert!(matches!(err, ApplyError::UnknownKind { .. }), "{err}");
    let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "x", "namespace": "default"}});
    apply(&kube, &sa, "default", "ferry-test", DryRun::All)
        .await
        .unwrap();

    let new = KubeCluster::start_with(KubeClusterOptions {
        emulated_version: None,
        controller_manager: false,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let kube = new.client().await.unwrap();
    let gvk = kube::api::GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceClaim");
    kube::discovery::pinned_kind(&kube, &gvk).await.unwrap();
}
