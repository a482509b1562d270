//! `ferry-bench`: the data-path benchmark of Ferry against other S3 FUSE mounters.
//!
//! It starts a local S3 server (versitygw, data on tmpfs so that dropping the page cache does not
//! slow the "remote" store; or moto, `--server moto`, objects in its memory; or s3s-fs,
//! `--server s3s-fs`, or rclone's `serve s3`, `--server rclone`, data on tmpfs), PUTs the
//! dataset straight to it, puts a delay proxy between the mounters and the server (`--rtt-ms`),
//! mounts each mounter through the proxy in turn, runs the issue's workloads on fresh mounts, and
//! prints one table. A program to run by hand as root; it is
//! never part of CI. See doc/BENCHMARKS.md.

mod cpu;
mod dataset;
mod instance;
mod mounters;
mod proxy;
mod server;
mod table;
mod workloads;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::{Parser, Subcommand};
use ferry_s3::{S3Config, S3Options, S3Store};
use ferry_store::{ListRequest, ObjectStore};
use futures::TryStreamExt;

use dataset::{Dataset, Needs, BUCKET, MIB};
use mounters::{Kind, Mode, Mount, S3Target, Tools};
use proxy::DelayProxy;
use server::{Server, ServerKind};
use table::{Column, Table};
use workloads::{Bench, Cell, Group, Row};

#[derive(Debug, Parser)]
#[command(about = "Ferry's data-path benchmark (run as root; never in CI)")]
struct Cli {
    /// Round-trip time the delay proxy adds between the mounters and the S3 server, in ms.
    #[arg(long, default_value_t = 0)]
    rtt_ms: u64,
    /// Multiplies object sizes and counts (1.0 = the issue's sizes).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Workloads to run, comma-separated (P1,P2,P3,P4,P5,P6,P7,P10,P11,P12,P13,P14); default all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Mounters to compare, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ferry,ferry-cache,mount-s3,s3fs,rclone,geesefs,goofys"
    )]
    mounters: Vec<String>,
    /// The S3 server behind the delay proxy.
    #[arg(long, value_enum, default_value_t = ServerKind::Versitygw)]
    server: ServerKind,
    /// Append the table (as Markdown) to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Deadline of each workload, in seconds.
    #[arg(long, default_value_t = 180)]
    timeout_secs: u64,
    /// P6's fio run time, in seconds.
    #[arg(long, default_value_t = 20)]
    fio_runtime: u64,
    /// ferry-node to mount with.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/ferry-node"))]
    ferry_bin: PathBuf,
    /// Where setup-peers.sh put the other mounters (default ~/.cache/ferry-tools/bin).
    #[arg(long)]
    tools_dir: Option<PathBuf>,
    /// Keep the work directory (mounter logs) instead of deleting it.
    #[arg(long)]
    keep_work: bool,
    /// Measure every group this many times (round after round, each mounter in turn within a
    /// group) and print each cell's median; the notes give every round's value.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    rounds: u32,
    #[command(subcommand)]
    internal: Option<Internal>,
}

/// Subcommands the benchmark runs itself, not meant for people.
#[derive(Debug, Subcommand)]
enum Internal {
    /// A P12 worker process (see `workloads::ml_worker`).
    #[command(name = workloads::ML_WORKER_CMD, hide = true)]
    MlWorker { root: PathBuf, size: u64 },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Internal::MlWorker { root, size }) = &cli.internal {
        return workloads::ml_worker(root, *size);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("ferry-bench must run as root (FUSE mounts, drop_caches)");
    }
    if cli.scale.is_nan() || cli.scale <= 0.0 {
        bail!("--scale must be positive");
    }
    // Two benchmarks at once would measure each other: refuse a second one.
    let _lock = instance::single_instance_lock()?;
    let started = Instant::now();
    let only: Vec<String> = cli.only.iter().map(|s| s.trim().to_uppercase()).collect();
    let selected = |r: Row| only.is_empty() || only.iter().any(|o| o == r.workload());
    // P10 is measured during P1, P13 during P7.
    let asked = |w: &str| only.iter().any(|o| o == w);
    let rows: Vec<Row> = Row::ALL
        .into_iter()
        .filter(|r| {
            selected(*r) || (*r == Row::P1 && asked("P10")) || (*r == Row::P7 && asked("P13"))
        })
        .collect();
    if rows.is_empty() {
        bail!("--only selects no workload");
    }
    let groups: Vec<Group> = Group::ALL
        .into_iter()
        .filter(|g| g.rows().iter().any(|r| rows.contains(r)))
        .collect();
    let kinds: Vec<Kind> = cli
        .mounters
        .iter()
        .map(|s| Kind::parse(s))
        .collect::<anyhow::Result<_>>()?;

    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let tools = Tools {
        ferry_bin: cli.ferry_bin.clone(),
        dir: cli
            .tools_dir
            .clone()
            .unwrap_or_else(|| home.join(".cache/ferry-tools/bin")),
    };
    let mounter_cols: Vec<(Kind, Option<String>)> =
        kinds.iter().map(|k| (*k, k.binary(&tools).err())).collect();

    let ds = Dataset::new(cli.scale);
    let needs = Needs {
        big: groups
            .iter()
            .any(|g| matches!(g, Group::Sequential | Group::Random)),
        small: groups
            .iter()
            .any(|g| matches!(g, Group::SmallOne | Group::SmallEight | Group::MlLoader)),
        listing: groups.contains(&Group::Listing) || groups.contains(&Group::ListingReadOnly),
        shards: groups.contains(&Group::Concurrent),
        many: groups.contains(&Group::Huge),
    };

    let work = make_work_dir()?;
    eprintln!("work dir: {}", work.display());
    let result = run(
        &cli,
        &tools,
        &ds,
        needs,
        &rows,
        &groups,
        &mounter_cols,
        &work,
    );
    cleanup_work_dir(&work, cli.keep_work || result.is_err());
    let report = result?;
    let took = started.elapsed();
    let report = format!(
        "{report}\nWall time of this run: {:.1} min.\n",
        took.as_secs_f64() / 60.0
    );
    instance::report(&report, cli.out.as_deref())
}

#[allow(clippy::too_many_arguments)]
fn run(
    cli: &Cli,
    tools: &Tools,
    ds: &Dataset,
    needs: Needs,
    rows: &[Row],
    groups: &[Group],
    mounter_cols: &[(Kind, Option<String>)],
    work: &Path,
) -> anyhow::Result<String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let largest = ds.big_size.max(ds.shard_size);
    let server = Server::start(cli.server, largest)?;
    eprintln!("S3 server: {}", server.describe());
    let direct = rt.block_on(S3Store::with_options(
        server.s3_config(),
        S3Options::default(),
    ))?;
    rt.block_on(direct.create_bucket(BUCKET))?;
    if server.single_put() {
        let _ = dataset::SINGLE_PUT.set(());
    }
    let calib_key = "calib/blob.bin";
    let calib_size = ds.big_size.min(256 * MIB);
    rt.block_on(async {
        dataset::put_object(&direct, calib_key, calib_size).await?;
        dataset::put_object(&direct, "calib/small.bin", 1024).await?;
        dataset::preload(&direct, ds, needs).await
    })?;

    let upstream: SocketAddr = ([127, 0, 0, 1], server.port()).into();
    let one_way = Duration::from_micros(cli.rtt_ms * 500);
    let proxy = DelayProxy::start(upstream, one_way)?;
    let proxy0 = DelayProxy::start(upstream, Duration::ZERO)?;
    let via = |url: String| -> anyhow::Result<S3Store> {
        let cfg = S3Config {
            endpoint_url: Some(url),
            ..server.s3_config()
        };
        Ok(rt.block_on(S3Store::with_options(cfg, S3Options::default()))?)
    };
    let proxied = via(proxy.url())?;
    let proxied0 = via(proxy0.url())?;

    // Calibration: what the proxy itself costs at 0 ms, and what the configured RTT adds.
    let calib_obj = [(calib_key.to_string(), calib_size)];
    let mut calib = String::new();
    for (name, store) in [
        ("direct", &direct),
        ("proxy 0 ms", &proxied0),
        ("proxy (this run)", &proxied),
    ] {
        let lat = rt.block_on(head_latency(store, 200))?;
        // Median of three, the first of which also warms the server and the connection pool.
        let mut thr = (0..3)
            .map(|_| rt.block_on(workloads::sdk_ranged(store, &calib_obj, 8 * MIB, 16)))
            .collect::<anyhow::Result<Vec<f64>>>()?;
        thr.sort_by(|a, b| a.total_cmp(b));
        let thr = thr[1];
        calib.push_str(&format!(
            "| {name} | {:.3} | {:.3} | {:.0} |\n",
            lat.0, lat.1, thr
        ));
    }
    drop(proxied0);
    drop(proxy0);
    eprintln!("calibration:\n{calib}");

    let mut notes: Vec<String> = Vec::new();

    let target = S3Target {
        endpoint_url: proxy.url(),
        bucket: BUCKET.into(),
        region: server.region().into(),
        access_key: server.access_key().into(),
        secret_key: server.secret_key().into(),
    };
    let mut bench = Bench {
        ds: ds.clone(),
        timeout: Duration::from_secs(cli.timeout_secs),
        fio_runtime: cli.fio_runtime,
        direct: direct.clone(),
        rt: rt.handle().clone(),
        run_id: format!("rtt{}-{}", cli.rtt_ms, std::process::id()),
        round: 0,
        rounds: cli.rounds,
        notes: Vec::new(),
    };
    let mut flags_used = Vec::new();
    for (kind, na) in mounter_cols {
        if na.is_some() {
            continue;
        }
        let dir0 = work.join(format!("mnt-{}", kind.name()));
        let flags = |mode: Mode| {
            let creds = work.join("s3fs.passwd");
            let cache = mounters::cache_dir(work, &dir0);
            kind.flags(&target, &dir0, &creds, &cache, mode)
                .join(" ")
                .replace(&target.secret_key, "$SECRET")
                .replace(&target.access_key, "$KEY")
        };
        flags_used.push(format!(
            "- **{}** (`{}`, {}): `{}`",
            kind.name(),
            mounters::version_of(*kind, tools),
            kind.binary(tools).unwrap_or_default().display(),
            flags(Mode::ReadWrite)
        ));
        if groups.iter().any(|g| g.mode() == Mode::ReadOnly) {
            flags_used.push(format!(
                "  - read-only (P12, P14): `{}`",
                flags(Mode::ReadOnly)
            ));
        }
        if *kind == Kind::FerryCache {
            let fs = fs_type_of(work);
            flags_used.push(format!(
                "  - the cache: a fresh, empty directory per mount under {} ({fs}{}), all removed at the end of the run; each mount's workloads waited for its block directories, as the node plugin makes them at start",
                work.display(),
                if fs == "tmpfs" {
                    ": **not a local disk**, set TMPDIR"
                } else {
                    ""
                }
            ));
        }
    }
    let mut loads: Vec<f64> = Vec::new();
    let probe = cpu::SpeedProbe::start();
    let mut rounds: Vec<HashMap<(Row, Column), Cell>> = Vec::new();
    for round in 0..cli.rounds {
        bench.round = round;
        let mut cells: HashMap<(Row, Column), Cell> = HashMap::new();
        // Notes of a run of several rounds say which round they are from.
        let at = bench.at();
        // The ceiling column.
        let ceiling = |r: anyhow::Result<f64>, notes: &mut Vec<String>, what: &str| match r {
            Ok(v) => Cell::Value(v),
            Err(e) => {
                notes.push(format!("{at}ceiling {what}: {e:#}"));
                Cell::Failed("error".into())
            }
        };
        if rows.contains(&Row::P1) {
            let objs = [(ds.big_key.clone(), ds.big_size)];
            let r = rt.block_on(workloads::sdk_ranged(&proxied, &objs, 8 * MIB, 16));
            cells.insert((Row::P1, Column::Ceiling), ceiling(r, &mut notes, "P1"));
        }
        if rows.contains(&Row::P2) {
            let r = workloads::page_cache_reference(work, &ds.big_key, ds.big_size);
            cells.insert((Row::P2, Column::Ceiling), ceiling(r, &mut notes, "P2"));
        }
        if rows.contains(&Row::P14Warm) {
            let r = workloads::local_listing_reference(work, ds.listing_count);
            cells.insert(
                (Row::P14Warm, Column::Ceiling),
                ceiling(r, &mut notes, "P14"),
            );
        }
        // P12's first epoch has the same reference as P4 with 8 readers: one GET per file, 8 at once.
        for (row, n) in [
            (Row::P4One, 1),
            (Row::P4Eight, 8),
            (Row::P12Epoch1, workloads::ML_WORKERS),
        ] {
            if rows.contains(&row) {
                let keys: Vec<String> = (0..ds.small_count).map(|i| ds.small_key(i)).collect();
                let r = rt.block_on(workloads::sdk_small(&proxied, &keys, ds.small_size, n));
                cells.insert((row, Column::Ceiling), ceiling(r, &mut notes, "P4"));
            }
        }
        for (row, dir) in [
            (Row::P5Cold, &ds.listing_dir),
            (Row::P14Cold, &ds.listing_dir),
            (Row::P11, &ds.many_dir),
        ] {
            if rows.contains(&row) {
                let r = rt.block_on(list_all(&proxied, &format!("{dir}/")));
                cells.insert((row, Column::Ceiling), ceiling(r, &mut notes, "LIST"));
            }
        }
        if rows.contains(&Row::P7) {
            let objs: Vec<(String, u64)> = ds
                .shard_keys
                .iter()
                .map(|k| (k.clone(), ds.shard_size))
                .collect();
            let r = rt.block_on(workloads::sdk_ranged(&proxied, &objs, 8 * MIB, 16));
            cells.insert((Row::P7, Column::Ceiling), ceiling(r, &mut notes, "P7"));
        }

        // Group by group, each mounter in turn: the mounters' cells of a group are measured
        // minutes apart at most, under the same conditions as far as this VM allows.
        for (i, group) in groups.iter().enumerate() {
            for (kind, na) in mounter_cols {
                if na.is_some() {
                    continue;
                }
                loads.push(load_average());
                let dir = work.join(format!("mnt-{}-{round}-{i}", kind.name()));
                let t = Instant::now();
                let wanted: Vec<Row> = group
                    .rows()
                    .iter()
                    .copied()
                    .filter(|r| rows.contains(r))
                    .collect();
                match Mount::start(*kind, tools, &target, &dir, work, group.mode()) {
                    Ok(mut mount) => {
                        let cpu = cpu::CpuSnap::now(mount.pid());
                        let results = bench.run_group(*group, &mut mount);
                        let cpu = cpu.describe(&cpu::CpuSnap::now(mount.pid()));
                        let speed = probe
                            .speed(t, Instant::now())
                            .map_or_else(|| "?".into(), |v| format!("{v:.2}"));
                        let mut names: Vec<&str> = wanted.iter().map(|r| r.workload()).collect();
                        names.dedup();
                        notes.push(format!(
                                "{at}{}'s CPU on the mount of {}: {cpu}; the CPUs ran at {speed} × the run's fastest",
                                kind.name(),
                                names.join("+")
                            ));
                        if let Some(reqs) = mount.s3_requests() {
                            notes.push(format!(
                                "{at}{}'s S3 requests on the mount of {}: {reqs}",
                                kind.name(),
                                names.join("+")
                            ));
                        }
                        let tail = mount.log_tail();
                        if let Err(e) = mount.unmount() {
                            notes.push(format!("{at}{}: unmount: {e:#}", kind.name()));
                        }
                        for (row, cell) in results {
                            if wanted.contains(&row) {
                                if matches!(cell, Cell::Failed(_)) && !tail.is_empty() {
                                    notes.push(format!(
                                        "{at}{}: log tail after {}:\n```\n{tail}\n```",
                                        kind.name(),
                                        row.workload()
                                    ));
                                }
                                eprintln!(
                                    "  {at}{:<8} {:<4} {cell:?}",
                                    kind.name(),
                                    row.workload()
                                );
                                cells.insert((row, Column::Mounter(*kind)), cell);
                            }
                        }
                    }
                    Err(e) => {
                        notes.push(format!("{at}{}: mount failed: {e:#}", kind.name()));
                        for row in &wanted {
                            cells.insert(
                                (*row, Column::Mounter(*kind)),
                                Cell::Failed("mount failed".into()),
                            );
                        }
                    }
                }
                eprintln!(
                    "{} {:?}: {:.1} s",
                    kind.name(),
                    group,
                    t.elapsed().as_secs_f64()
                );
            }
        }
        rounds.push(cells);
    }
    drop(probe);
    let cells = merge_rounds(ds, rows, mounter_cols, rounds, &mut notes);
    if rows.contains(&Row::P12Epoch1) {
        notes.insert(0, epoch_ratios(&cells, mounter_cols));
    }
    notes.extend(std::mem::take(&mut bench.notes));
    let proxy_connections = proxy.connections();
    drop(proxy);

    let table = Table {
        rows: rows.to_vec(),
        mounters: mounter_cols.to_vec(),
        cells,
    };
    let mut report = String::new();
    report.push_str(&format!(
        "### rtt {} ms, scale {}, server {}{}\n\nS3 server: {}.\n\n{}\n",
        cli.rtt_ms,
        cli.scale,
        server.name(),
        match cli.rounds {
            1 => String::new(),
            n => format!(", medians of {n} rounds"),
        },
        server.describe(),
        table.markdown(ds)
    ));
    report.push_str(&format!(
        "\nDelay proxy calibration (HEAD of a 1 KiB object, 200 sequential; ranged GETs of a {} MiB object, 8 MiB × 16 in flight, median of 3). The proxy accepted {proxy_connections} connections in this run.\n\n| path | HEAD median ms | HEAD p90 ms | GET MiB/s |\n|---|---:|---:|---:|\n{calib}",
        calib_size / MIB
    ));
    if table.rows.contains(&Row::P1) || table.rows.len() > 1 {
        report.push_str("\nIssue targets:\n\n");
        for line in table.targets() {
            report.push_str(&line);
            report.push('\n');
        }
    }
    if !loads.is_empty() {
        loads.sort_by(|a, b| a.total_cmp(b));
        report.push_str(&format!(
            "\n1-minute load average when each mount started: min {:.1}, median {:.1}, max {:.1} ({} cores).\n",
            loads[0],
            loads[loads.len() / 2],
            loads[loads.len() - 1],
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
        ));
    }
    report.push_str("\nFlags each mounter got:\n\n");
    for line in &flags_used {
        report.push_str(line);
        report.push('\n');
    }
    if !notes.is_empty() {
        report.push_str("\nNotes from this run:\n\n");
        for n in &notes {
            report.push_str(&format!("- {n}\n"));
        }
    }
    drop(server);
    Ok(report)
}

/// One table from several rounds: each cell the median of its rounds' values (the rounds that
/// failed left out; a cell no round measured keeps the first round's failure). With more than
/// one round, a note per row gives every round's value and, for `ferry-cache`, its ratio to
/// `ferry` in the same round.
fn merge_rounds(
    ds: &Dataset,
    rows: &[Row],
    mounters: &[(Kind, Option<String>)],
    rounds: Vec<HashMap<(Row, Column), Cell>>,
    notes: &mut Vec<String>,
) -> HashMap<(Row, Column), Cell> {
    let n = rounds.len();
    let mut cols: Vec<Column> = mounters
        .iter()
        .filter(|(_, na)| na.is_none())
        .map(|(k, _)| Column::Mounter(*k))
        .collect();
    cols.push(Column::Ceiling);
    let value = |r: &HashMap<(Row, Column), Cell>, row: Row, col: Column| match r.get(&(row, col)) {
        Some(Cell::Value(v)) => Some(*v),
        _ => None,
    };
    let mut merged = HashMap::new();
    for &row in rows {
        let mut parts = Vec::new();
        for &col in &cols {
            let mut values: Vec<f64> = rounds.iter().filter_map(|r| value(r, row, col)).collect();
            let cell = if values.is_empty() {
                rounds.iter().find_map(|r| r.get(&(row, col)).cloned())
            } else {
                values.sort_by(|a, b| a.total_cmp(b));
                let mid = values.len() / 2;
                Some(Cell::Value(if values.len() % 2 == 1 {
                    values[mid]
                } else {
                    (values[mid - 1] + values[mid]) / 2.0
                }))
            };
            let Some(cell) = cell else { continue };
            merged.insert((row, col), cell);
            if n > 1 {
                let each: Vec<String> = rounds
                    .iter()
                    .map(|r| match r.get(&(row, col)) {
                        Some(Cell::Value(v)) => table::fmt_value(*v),
                        Some(Cell::Failed(why)) => why.clone(),
                        None => "—".into(),
                    })
                    .collect();
                let name = match col {
                    Column::Mounter(k) => k.name(),
                    Column::Ceiling => "ceiling",
                };
                parts.push(format!("{name} {}", each.join(", ")));
            }
        }
        let (cache, plain) = (
            Column::Mounter(Kind::FerryCache),
            Column::Mounter(Kind::Ferry),
        );
        if n > 1 && cols.contains(&cache) && cols.contains(&plain) {
            let each: Vec<String> = rounds
                .iter()
                .map(|r| match (value(r, row, cache), value(r, row, plain)) {
                    (Some(c), Some(p)) if p > 0.0 => format!("{:.2}", c / p),
                    _ => "—".into(),
                })
                .collect();
            parts.push(format!("ferry-cache / ferry {}", each.join(", ")));
        }
        if !parts.is_empty() {
            notes.push(format!(
                "{}, round by round: {}",
                row.title(ds),
                parts.join("; ")
            ));
        }
    }
    merged
}

/// P12's note: each mounter's epoch 2 / epoch 1 (how much a second epoch on the same mount gains).
fn epoch_ratios(
    cells: &HashMap<(Row, Column), Cell>,
    mounters: &[(Kind, Option<String>)],
) -> String {
    let ratios: Vec<String> = mounters
        .iter()
        .filter(|(_, na)| na.is_none())
        .map(|(k, _)| {
            let value = |r: Row| match cells.get(&(r, Column::Mounter(*k))) {
                Some(Cell::Value(v)) if *v > 0.0 => Some(*v),
                _ => None,
            };
            match (value(Row::P12Epoch1), value(Row::P12Epoch2)) {
                (Some(e1), Some(e2)) => format!("{} {:.2}", k.name(), e2 / e1),
                _ => format!("{} —", k.name()),
            }
        })
        .collect();
    format!("P12 epoch 2 / epoch 1 (files/s): {}", ratios.join(", "))
}

/// Seconds to list `prefix` page by page (1000 keys a page, `/` delimiter), as a mounter's readdir
/// must at least.
async fn list_all(store: &S3Store, prefix: &str) -> anyhow::Result<f64> {
    let t = Instant::now();
    let req = ListRequest {
        prefix,
        delimiter: Some("/"),
        continuation: None,
        max_keys: Some(1000),
        start_after: None,
    };
    ferry_store::list_pages(store, BUCKET, req)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    Ok(t.elapsed().as_secs_f64())
}

/// Median and 90th percentile (ms) of `n` sequential HEADs of a small object.
async fn head_latency(store: &S3Store, n: usize) -> anyhow::Result<(f64, f64)> {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        store.head(BUCKET, "calib/small.bin").await?;
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    Ok((samples[n / 2], samples[n * 9 / 10]))
}

/// The type of the filesystem `path` is on (from `/proc/self/mountinfo`: the longest mount point
/// that is a prefix of it), e.g. `ext4` or `tmpfs`.
fn fs_type_of(path: &Path) -> String {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let mount_point = l.split(' ').nth(4)?;
            let fs = l.split(" - ").nth(1)?.split(' ').next()?;
            path.starts_with(mount_point)
                .then(|| (mount_point.len(), fs.to_string()))
        })
        .max()
        .map_or_else(|| "?".into(), |(_, fs)| fs)
}

/// The 1-minute load average (other processes on this machine disturb the numbers).
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

fn make_work_dir() -> anyhow::Result<PathBuf> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("ferry-bench-{}-{secs}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Removes the work dir, unless something is still mounted below it (removing recursively would
/// then delete objects through the mount) or `keep` is set.
fn cleanup_work_dir(work: &Path, keep: bool) {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let prefix = work.to_string_lossy().to_string();
    let live: Vec<&str> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|mp| mp.starts_with(&prefix))
        .collect();
    if !live.is_empty() {
        eprintln!(
            "warning: still mounted under {}: {live:?}; leaving it in place",
            work.display()
        );
        return;
    }
    if keep {
        eprintln!("work dir kept: {}", work.display());
    } else if let Err(e) = std::fs::remove_dir_all(work) {
        eprintln!("warning: removing {}: {e}", work.display());
    }
}
