//! DeleteVolume and CreateVolume against a real S3 server (versitygw): only S3's `NoSuchBucket`
//! means a bucket is missing. Any other 404 — versitygw's answer to an access key it does not
//! know, a proxy's own 404 page — is an error quoting what the server said, never a volume
//! "deleted" whose data stays.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_controller::ControllerService;
use ferry_csi::pb;
use ferry_csi::pb::controller_server::Controller;
use ferry_csi::stores::S3Stores;
use ferry_s3::S3Credentials;
use ferry_store::ObjectStore;
use ferry_testkit::S3Server;
use ferry_volume::{DeletePolicy, Endpoint, VolumeId};
use pb::volume_capability::access_mode::Mode;
use pb::volume_capability::{AccessMode, AccessType, MountVolume};
use tonic::{Code, Request};

const BUCKET: &str = "data";

/// A controller whose own credentials are the server's root keys.
fn controller(s3: &S3Server) -> ControllerService {
    let defaults = Endpoint {
        endpoint_url: Some(s3.endpoint_url()),
        region: Some(s3.region().into()),
        force_path_style: true,
    };
    let creds = S3Credentials::Static {
        access_key_id: s3.access_key().into(),
        secret_access_key: s3.secret_key().into(),
        session_token: None,
    };
    let stores = S3Stores::with_credentials(defaults, creds).with_options(S3Server::test_options());
    ControllerService::new(Arc::new(stores))
}

/// A provisioner Secret holding an access key the server does not know.
fn stranger() -> HashMap<String, String> {
    [
        ("accessKeyId", "ferry-no-such-user"),
        ("secretAccessKey", "ferry-no-such-secret"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn delete_req(bucket: &str, secrets: HashMap<String, String>) -> pb::DeleteVolumeRequest {
    let id = VolumeId {
        bucket: bucket.into(),
        prefix: "vol/".into(),
        endpoint: Endpoint::default(),
        delete_policy: DeletePolicy::Delete,
    };
    pb::DeleteVolumeRequest {
        volume_id: id.encode(),
        secrets,
    }
}

/// The server's code and message are in `st`, and nothing says the bucket is missing.
/// VERSITYGW: an unknown access key is `404 XAdminUserNotFound` (S3 answers 403
/// `InvalidAccessKeyId`).
fn quotes_the_server(st: &tonic::Status) {
    let msg = st.message();
    assert!(
        msg.contains("XAdminUserNotFound")
            && msg.contains("No user exists with the provided access key ID"),
        "{st:?}"
    );
    assert!(!msg.contains("does not exist"), "{st:?}");
}

#[tokio::test]
async fn delete_volume_with_keys_the_server_does_not_know_fails_and_deletes_nothing() {
    ferry_testkit::init_tracing();
    let s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    let root = s3.store().await;
    root.put(BUCKET, "vol/a", "data".into()).await.unwrap();
    let ctrl = controller(&s3);

    // Not OK: csi-provisioner would remove the PV while its data stays. Internal: the server
    // answered something that is neither the volume gone nor a refusal Ferry can name.
    let st = ctrl
        .delete_volume(Request::new(delete_req(BUCKET, stranger())))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Internal, "{st:?}");
    quotes_the_server(&st);
    assert!(st.message().contains("deleting s3://data/vol/"), "{st:?}");
    assert_eq!(
        root.get_range(BUCKET, "vol/a", 0..4, None).await.unwrap(),
        "data".as_bytes(),
        "the volume's data is still there"
    );

    // The controller's own keys delete it.
    ctrl.delete_volume(Request::new(delete_req(BUCKET, HashMap::new())))
        .await
        .unwrap();
    let e = root.head(BUCKET, "vol/a").await.unwrap_err();
    assert!(matches!(e, ferry_store::StoreError::NotFound(_)), "{e:?}");

    // A bucket that is really missing (S3's NoSuchBucket) has nothing to delete: OK.
    ctrl.delete_volume(Request::new(delete_req(
        "ferry-no-such-bucket",
        HashMap::new(),
    )))
    .await
    .unwrap();
}

#[tokio::test]
async fn create_volume_with_keys_the_server_does_not_know_does_not_call_the_bucket_missing() {
    ferry_testkit::init_tracing();
    let s3 = S3Server::start();
    s3.create_bucket(BUCKET).await;
    let ctrl = controller(&s3);
    let req = |bucket: &str, secrets: HashMap<String, String>| {
        Request::new(pb::CreateVolumeRequest {
            name: "pvc-1".into(),
            parameters: [("bucketName".to_string(), bucket.to_string())].into(),
            volume_capabilities: vec![pb::VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: Some(AccessMode {
                    mode: Mode::MultiNodeMultiWriter as i32,
                }),
            }],
            secrets,
            ..Default::default()
        })
    };
    let st = ctrl
        .create_volume(req(BUCKET, stranger()))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Internal, "{st:?}");
    quotes_the_server(&st);
    let st = ctrl
        .create_volume(req("ferry-no-such-bucket", HashMap::new()))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert!(
        st.message()
            .contains("bucket \"ferry-no-such-bucket\" does not exist"),
        "{st:?}"
    );
}
