//! A private CA (`S3Options::ca_bundle`, the binaries' `--ca-bundle` / `AWS_CA_BUNDLE`): versitygw
//! serving HTTPS with a certificate from a CA made here is refused without the bundle and trusted
//! with it.

use std::path::Path;
use std::process::Command;

use ferry_s3::{S3Options, S3Store};
use ferry_store::{ObjectStore, StoreError};
use ferry_testkit::S3Server;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running openssl (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and a server certificate for 127.0.0.1 signed by it, in `dir`.
fn make_ca(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=ferry test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "server.pem",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_ca_is_trusted_only_with_the_bundle() {
    let dir = tempfile::tempdir().unwrap();
    make_ca(dir.path());
    let s3 = S3Server::start_tls(
        &dir.path().join("server.pem"),
        &dir.path().join("server.key"),
    );
    assert!(s3.endpoint_url().starts_with("https://"));
    let opts = S3Options {
        max_attempts: 1,
        ..S3Server::test_options()
    };

    let untrusted = S3Store::with_options(s3.s3_config(), opts.clone())
        .await
        .unwrap();
    let e = untrusted.create_bucket("ca-test").await.unwrap_err();
    assert!(
        matches!(e, StoreError::Transient(_) | StoreError::Other(_)),
        "{e:?}"
    );

    let trusted = S3Store::with_options(
        s3.s3_config(),
        S3Options {
            ca_bundle: Some(dir.path().join("ca.pem")),
            ..opts.clone()
        },
    )
    .await
    .unwrap();
    trusted.create_bucket("ca-test").await.unwrap();
    trusted
        .put("ca-test", "k", bytes::Bytes::from_static(b"over TLS"))
        .await
        .unwrap();
    assert_eq!(
        &trusted.get_range("ca-test", "k", 0..8, None).await.unwrap()[..],
        b"over TLS"
    );

    // A bundle that is not PEM is refused up front, naming the file.
    let e = S3Store::with_options(
        s3.s3_config(),
        S3Options {
            ca_bundle: Some(dir.path().join("ext.cnf")),
            ..opts
        },
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("ext.cnf"), "{e}");
}
