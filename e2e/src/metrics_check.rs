//! `ferry-harness metrics`: both binaries' `/metrics`, after real work (a volume created, published
//! on a node with the block cache, files read twice, written, a missing name looked up), are
//! valid Prometheus exposition by `promtool check metrics` and hold the S3, cache and FUSE series.
//!
//! promtool is built by `scripts/setup.sh` into `$FERRY_TOOLS`. Without it the check is skipped,
//! except under `CI=true`, where a missing judge is a failure.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use ferry_proto::csi::v1 as pb;
use ferry_store::ObjectStore;
use pb::volume_capability::access_mode::Mode;

use crate::{bin_dir, mount_capability, payload, Plugin};

/// The promtool binary: `$FERRY_TOOLS/promtool` (default `~/.cache/ferry-tools/bin`), then PATH.
fn promtool() -> Option<PathBuf> {
    let tools = std::env::var_os("FERRY_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/ferry-tools/bin")
        });
    let p = tools.join("promtool");
    if p.exists() {
        return Some(p);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("promtool"))
            .find(|p| p.exists())
    })
}

/// Runs the check (see the module doc).
pub async fn run() -> Result<()> {
    let Some(promtool) = promtool() else {
        if std::env::var("CI").as_deref() == Ok("true") {
            bail!("promtool is missing (CI=true): scripts/setup.sh builds it into $FERRY_TOOLS");
        }
        println!("metrics: promtool not found (scripts/setup.sh builds it): skipped");
        println!("metrics: 0 passed, 0 failed, 1 skipped");
        return Ok(());
    };
    let cache = tempfile::Builder::new()
        .prefix("ferry-metrics-cache-")
        .tempdir()?;
    let env = vec![(
        "FERRY_CACHE_DIR".to_string(),
        Some(cache.path().display().to_string()),
    )];
    let plugin = Plugin::start_with_env(&bin_dir()?, env).await?;
    let bucket = "ferry-metrics";
    plugin.s3.create_bucket(bucket).await;
    work(&plugin, bucket).await?;

    let mut passed = 0;
    for (name, wanted) in [
        (
            "ferry-controller",
            &[
                "ferry_s3_requests_total{",
                "ferry_s3_request_duration_seconds_count{",
                "ferry_s3_attempts_total{",
            ][..],
        ),
        (
            "ferry-node",
            &[
                "ferry_s3_requests_total{op=\"get\",result=\"ok\"}",
                "ferry_s3_requests_total{op=\"put\",result=\"ok\"}",
                "ferry_s3_request_duration_seconds_bucket{op=\"get\"",
                // every HTTP attempt, from ferry-s3's hook (a ranged GET answers 206)
                "ferry_s3_attempts_total{op=\"get\",status=\"20",
                "ferry_s3_attempt_duration_seconds_count{op=\"get\"}",
                "ferry_cache_lookups_total ",
                "ferry_cache_misses_total ",
                "ferry_cache_fills_total ",
                "ferry_fuse_operations_total{op=\"read\",outcome=\"ok\"}",
                "ferry_fuse_operations_total{op=\"lookup\",outcome=\"ENOENT\"}",
                "ferry_fuse_operation_duration_seconds_bucket{op=\"open\"",
                "ferry_mounts 1",
                "ferry_inodes ",
            ][..],
        ),
    ] {
        let addr = metrics_addr(&plugin.log_path(name))?;
        let text = scrape(&addr)?;
        let saved = plugin.dir.path().join(format!("{name}.metrics"));
        std::fs::write(&saved, &text)?;
        for w in wanted {
            // A wanted text ending in a value ("ferry_mounts 1") is the whole line.
            let whole = w
                .rsplit_once(' ')
                .is_some_and(|(_, v)| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()));
            let matches = |l: &str| match whole {
                true => l == *w,
                false => l.starts_with(w) && !l.ends_with(" 0"),
            };
            if !text.lines().any(matches) {
                let nonzero: Vec<&str> = text
                    .lines()
                    .filter(|l| !l.starts_with('#') && !l.ends_with(" 0"))
                    .collect();
                bail!(
                    "{name}: no non-zero {w}… in its /metrics; non-zero series:\n{}",
                    nonzero.join("\n")
                );
            }
        }
        check(&promtool, name, &text)?;
        println!(
            "    {name}: {} series, promtool check metrics: ok",
            text.lines().filter(|l| !l.starts_with('#')).count()
        );
        passed += 1;
    }
    plugin.check_logs_for_secrets(&[])?;
    println!("metrics: {passed} passed, 0 failed");
    Ok(())
}

/// Creates a volume, publishes it on the node (with the block cache), reads files twice, writes
/// one and looks up a missing name: S3, cache and FUSE series in both processes.
async fn work(plugin: &Plugin, bucket: &str) -> Result<()> {
    let mut ctrl = plugin.controller().await?;
    let cap = mount_capability(Mode::SingleNodeWriter, &[]);
    let params: HashMap<String, String> = [
        ("bucketName", bucket),
        ("basePrefix", "metrics"),
        ("deletePolicy", "delete"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let vol = ctrl
        .create_volume(pb::CreateVolumeRequest {
            name: "pvc-metrics".into(),
            parameters: params,
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await?
        .into_inner()
        .volume
        .context("CreateVolume returned no volume")?;
    let prefix = vol
        .volume_context
        .get("prefix")
        .cloned()
        .unwrap_or_default();
    let s3 = plugin.s3.store().await;
    let files: Vec<(String, Bytes)> = (0..3u64)
        .map(|i| (format!("data/part-{i}.bin"), payload(i, 1 << 20)))
        .collect();
    for (k, v) in &files {
        s3.put(bucket, &format!("{prefix}{k}"), v.clone()).await?;
    }
    let target = plugin.target_path("metrics-pod", "pvc-metrics")?;
    let mut node = plugin.node().await?;
    node.node_publish_volume(pb::NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap),
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    })
    .await?;
    let target2 = target.clone();
    let files2 = files.clone();
    tokio::task::spawn_blocking(move || -> Result<()> {
        for _ in 0..2 {
            for (k, v) in &files2 {
                let mut got = Vec::new();
                std::fs::File::open(target2.join(k))?.read_to_end(&mut got)?;
                if got != v.as_ref() {
                    bail!("{k}: the mount returned different bytes");
                }
            }
        }
        std::fs::write(target2.join("written.txt"), b"through the mount\n")?;
        if target2.join("no-such-file").exists() {
            bail!("a missing name exists");
        }
        Ok(())
    })
    .await??;
    Ok(())
}

/// The address a process logged for its `/metrics` ("metrics at /metrics addr=…").
fn metrics_addr(log: &Path) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let line = text.lines().find(|l| l.contains("metrics at /metrics"));
        if let Some(addr) = line.and_then(|l| {
            let plain = strip_ansi(l);
            let rest = plain.split("addr=").nth(1)?;
            Some(rest.split_whitespace().next()?.to_string())
        }) {
            return Ok(addr);
        }
        if Instant::now() > deadline {
            bail!("no metrics address in {}", log.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ … final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `GET /metrics` as a plain scraper does (no OpenMetrics asked for): the body.
fn scrape(addr: &str) -> Result<String> {
    let mut s =
        std::net::TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .context("no HTTP response head")?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        bail!("GET /metrics from {addr}: {head}");
    }
    Ok(body.to_string())
}

/// `promtool check metrics` on `text`: its lint problems fail the check.
fn check(promtool: &Path, name: &str, text: &str) -> Result<()> {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", promtool.display()))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "promtool check metrics on {name}'s /metrics ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
