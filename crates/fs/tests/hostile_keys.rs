//! Keys anyone who may PUT into a bucket can write, on moto's S3 (it stores any key; versitygw's
//! posix backend refuses most of these), read through a real FUSE mount: a key with an empty
//! segment (`a//b`, `/leading`) or a control character never makes its directory's listing fail.
//! Keys that are no names are hidden, keys with control characters are names like any other, and
//! deleting the prefix (DeleteVolume's `delete_prefix`) deletes them all.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::errno;
use ferry_fs::{MemoryBudget, MetadataTtl};
use ferry_s3::{S3Config, S3Credentials, S3Store};
use ferry_store::{delete_prefix, ListRequest, ObjectStore};
use ferry_testkit::{MotoServer, S3Server};

const BUCKET: &str = "hostile";

/// Names in a directory, as bytes-exact strings.
fn names(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("readdir {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

#[test]
fn hostile_keys_never_take_a_directory_down() {
    let rt = common::fuse_runtime();
    let moto = MotoServer::start();
    let cfg = S3Config {
        endpoint_url: Some(moto.endpoint_url()),
        region: Some("us-east-1".into()),
        force_path_style: true,
        credentials: S3Credentials::Static {
            access_key_id: "testing".into(),
            secret_access_key: "testing".into(),
            session_token: None,
        },
        on_attempt: None,
    };
    let store = Arc::new(
        rt.block_on(S3Store::with_options(cfg, S3Server::test_options()))
            .unwrap(),
    );
    let objects: &[(&str, &str)] = &[
        ("ds/good.txt", "good"),
        ("ds/sub/inner.txt", "inner"),
        ("ds/a//b", "hidden: empty segment"),
        ("ds//leading", "hidden: empty first segment"),
        ("ds/ctl\x01x", "control"),
        ("ds/esc\x1b[31m", "escape"),
        ("ds/tab\there", "tab"),
        ("ds/sub/\x7f", "delete character"),
        ("ds/plus+and space%25", "needs encoding"),
        ("other/keep", "outside the prefix"),
    ];
    rt.block_on(async {
        store.create_bucket(BUCKET).await.unwrap();
        for (k, v) in objects {
            store
                .put(BUCKET, k, Bytes::from_static(v.as_bytes()))
                .await
                .unwrap_or_else(|e| panic!("PUT {k:?}: {e}"));
        }
    });

    // Every lookup asks S3 (no listing kept): the names are found through LISTs every time.
    let m = common::mount_bucket(
        &rt,
        &MemoryBudget::default(),
        store.clone(),
        BUCKET,
        "ds/",
        |c| c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO),
    );
    let root = m.root.clone();

    let want: BTreeSet<String> = [
        "a",
        "ctl\x01x",
        "tab\there",
        "esc\x1b[31m",
        "good.txt",
        "plus+and space%25",
        "sub",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(names(&root), want, "the root lists, hostile keys and all");
    assert_eq!(names(&root.join("a")), BTreeSet::new(), "a//b is hidden");
    assert_eq!(
        names(&root.join("sub")),
        ["inner.txt", "\x7f"]
            .into_iter()
            .map(String::from)
            .collect(),
        "sub"
    );
    for (name, want) in [
        ("good.txt", "good"),
        ("sub/inner.txt", "inner"),
        ("ctl\x01x", "control"),
        ("esc\x1b[31m", "escape"),
        ("tab\there", "tab"),
        ("sub/\x7f", "delete character"),
        ("plus+and space%25", "needs encoding"),
    ] {
        assert_eq!(
            fs::read_to_string(root.join(name)).unwrap(),
            want,
            "{name:?}"
        );
    }
    assert_eq!(errno(fs::metadata(root.join("leading"))), libc::ENOENT);
    m.unmount();

    // DeleteVolume's deletion: every key under the prefix goes, the hostile ones included (keys
    // XML cannot carry are deleted one by one), and nothing outside it.
    let deleted = rt
        .block_on(delete_prefix(store.as_ref(), BUCKET, "ds/"))
        .unwrap();
    assert_eq!(deleted.objects, objects.len() as u64 - 1);
    assert_eq!(deleted.uploads, 0);
    let left = rt
        .block_on(store.list(
            BUCKET,
            ListRequest {
                prefix: "",
                ..Default::default()
            },
        ))
        .unwrap();
    let left: Vec<String> = left.objects.into_iter().map(|o| o.key).collect();
    assert_eq!(left, ["other/keep"]);
}
