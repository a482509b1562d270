//! A static PV written for Mountpoint's S3 CSI driver v2 (`fixtures/mountpoint-v2-static-pv.yaml`)
//! mounts on Ferry once its driver name is changed: its volume attributes and mount options parse
//! into the volume Mountpoint would mount, and every v2-only attribute is named in a notice.

use std::collections::HashMap;

use ferry_volume::mountpoint_v2::LocalCache;
use ferry_volume::{MetadataTtl, NodeCache, VolumeSpec, DRIVER_NAME};
use serde_json::Value;

const FIXTURE: &str = include_str!("fixtures/mountpoint-v2-static-pv.yaml");

/// The fixture's PV, as Ferry's node gets it: volume attributes and mount options.
fn fixture_pv() -> Value {
    let docs: Vec<Value> = serde_saphyr::from_multiple(FIXTURE).unwrap();
    docs.into_iter()
        .find(|d| d["kind"] == "PersistentVolume")
        .expect("the fixture has a PersistentVolume")
}

fn publish_inputs(pv: &Value) -> (HashMap<String, String>, Vec<String>) {
    let attrs = pv["spec"]["csi"]["volumeAttributes"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_str()
                    .expect("attribute values are strings")
                    .to_string(),
            )
        })
        .collect();
    let flags = pv["spec"]["mountOptions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    (attrs, flags)
}

#[test]
fn mountpoint_v2_static_pv_fixture() {
    let pv = fixture_pv();
    // The one field a migration changes.
    assert_eq!(pv["spec"]["csi"]["driver"], "s3.csi.aws.com");
    assert_ne!(DRIVER_NAME, "s3.csi.aws.com");
    let (ctx, flags) = publish_inputs(&pv);
    let spec = VolumeSpec::from_publish(&ctx, &flags).unwrap();
    assert_eq!(spec.bucket, "amzn-s3-demo-bucket");
    assert_eq!(spec.prefix, "datasets/v2/");
    assert_eq!(spec.options.metadata_ttl, Some(MetadataTtl::Seconds(3)));
    assert!(!spec.options.no_cache);
    assert_eq!(spec.mountpoint_v2.local_cache, Some(LocalCache::EmptyDir));
    let notices = spec.migration_notices(NodeCache::On { max_size: 10 << 30 });
    let named: Vec<&str> = notices.iter().map(|n| n.attribute.as_str()).collect();
    assert_eq!(
        named,
        [
            "cache: emptyDir",
            "cacheEmptyDirSizeLimit",
            "mountpointContainerResourcesLimitsMemory"
        ]
    );
}

/// The full example of Mountpoint's docs/CONFIGURATION.md (every v2 attribute): refused for its
/// `mountpointEnv.HTTPS_PROXY` alone, and accepted without it.
#[test]
fn configuration_md_example() {
    let mut ctx: HashMap<String, String> = [
        ("bucketName", "amzn-s3-demo-bucket"),
        ("authenticationSource", "driver"),
        ("stsRegion", "us-east-1"),
        ("cache", "emptyDir"),
        ("cacheEmptyDirSizeLimit", "1Gi"),
        ("cacheEmptyDirMedium", ""),
        ("cacheEphemeralStorageClassName", "gp2"),
        ("cacheEphemeralStorageResourceRequest", "1Gi"),
        ("mountpointContainerResourcesRequestsCpu", "500m"),
        ("mountpointContainerResourcesRequestsMemory", "1Gi"),
        ("mountpointContainerResourcesLimitsCpu", "500m"),
        ("mountpointContainerResourcesLimitsMemory", "1Gi"),
        ("mountpointEnv.HTTPS_PROXY", "http://proxy.example.com:3128"),
        ("mountpointEnv.NO_PROXY", "sts.us-east-1.amazonaws.com"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let e = VolumeSpec::from_publish(&ctx, &["region us-east-1"]).unwrap_err();
    assert!(e.to_string().contains("mountpointEnv.HTTPS_PROXY"), "{e}");
    ctx.remove("mountpointEnv.HTTPS_PROXY");
    let spec = VolumeSpec::from_publish(&ctx, &["region us-east-1"]).unwrap();
    let notices = spec.migration_notices(NodeCache::Off);
    // Every v2-only attribute is named once (the cache type with its value), but
    // `cacheEmptyDirMedium: ""`: an empty value is unset, as in v2.
    assert_eq!(notices.len(), 9, "{notices:#?}");
    for n in &notices {
        assert!(
            n.attribute == "cache: emptyDir" || ctx.contains_key(&n.attribute),
            "{n}"
        );
    }
}
