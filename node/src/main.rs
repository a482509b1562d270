//! `ferry-node`: the CSI node plugin (`serve`) and a standalone `mount` command.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use ferry_cache::{BlockCache, CacheConfig};
use ferry_csi::endpoint::OwnedSocket;
use ferry_csi::identity::IdentityService;
use ferry_csi::pb::identity_server::IdentityServer;
use ferry_csi::pb::node_server::NodeServer;
use ferry_csi::pb::plugin_capability::service::Type as PluginCap;
use ferry_csi::stores::{S3Stores, Stores};
use ferry_node::handover::{self, MountRecord, StateDir};
use ferry_node::mounts::{MountCredentials, MountTable, Published};
use ferry_node::registration::{self, RegistrationService, RegistrationState};
use ferry_node::size::{parse_budget, parse_size, BudgetSpec};
use ferry_node::{NodeConfig, NodeService, PodAuth};
use ferry_volume::{
    AllowedEndpoints, AuthenticationSource, Endpoint, MetadataTtl, MountOptions, VolumeSpec,
};

#[derive(Debug, Parser)]
#[command(version, about = "Ferry CSI node plugin and S3 mounter")]
struct Cli {
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "FERRY_LOG", default_value = "info", global = true)]
    log: String,
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start: the size of the arguments does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the CSI Identity and Node services (the DaemonSet's command).
    Serve(ServeArgs),
    /// Mount a bucket (or a prefix of it) at a directory, like mount-s3.
    Mount(MountArgs),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// CSI endpoint, `unix:///path/to/csi.sock`.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    csi_endpoint: String,
    /// This node's id, as NodeGetInfo reports it (the Kubernetes node name).
    #[arg(long, env = "NODE_ID")]
    node_id: String,
    /// Kubelet's root directory: every target path must lie below it.
    #[arg(long, env = "KUBELET_ROOT", default_value = "/var/lib/kubelet")]
    kubelet_root: PathBuf,
    /// Default S3 endpoint URL for volumes that name none.
    #[arg(long, env = "FERRY_ENDPOINT_URL")]
    endpoint_url: Option<String>,
    /// Default region for volumes that name none.
    #[arg(long, env = "FERRY_REGION")]
    region: Option<String>,
    /// Use path-style addressing by default.
    #[arg(long, env = "FERRY_FORCE_PATH_STYLE")]
    force_path_style: bool,
    /// Endpoints a volume (StorageClass parameter, PV attribute or mount option, volume id) may
    /// name, comma-separated: `aws` (the AWS S3 endpoints of every partition), `scheme://host[:port]`
    /// patterns with `*` inside a host label (`https://*.example.com:9000`), or `*` for any.
    /// Default: `aws`. The --endpoint-url is always allowed.
    #[arg(long, env = "FERRY_ALLOWED_ENDPOINTS", value_parser = parse_allowed_endpoints)]
    allowed_endpoints: Option<AllowedEndpoints>,
    /// Metadata TTL for writable volumes without a `metadata-ttl` option: seconds, `indefinite` or
    /// `minimal` (a volume published read-only defaults to `indefinite`).
    #[arg(long, env = "FERRY_METADATA_TTL", default_value = "1", value_parser = parse_ttl)]
    metadata_ttl: MetadataTtl,
    /// Address of the Prometheus `/metrics` endpoint; `off` disables it.
    #[arg(long, env = "FERRY_METRICS_ADDR", default_value = "0.0.0.0:9810")]
    metrics_addr: String,
    /// Address of the `/healthz` endpoint (`host:port` or `:port`): 200 while the CSI Probe is
    /// ready and kubelet has not refused the registration, else 503 with the reason. Bound, like
    /// the metrics endpoint, only once this process owns the node's mounts. `off` disables it.
    #[arg(long, env = "FERRY_HEALTH_ADDR", default_value = "off")]
    health_addr: String,
    /// Kubelet's plugin registration directory (`<kubelet-root>/plugins_registry`, as mounted in
    /// this container): register the driver with kubelet through a socket there, as
    /// node-driver-registrar would. Unset: no registration (outside Kubernetes, or with the
    /// sidecar).
    #[arg(long, env = "FERRY_REGISTRATION_DIR")]
    registration_dir: Option<PathBuf>,
    /// The CSI socket's path as kubelet on the host sees it (e.g.
    /// `/var/lib/kubelet/plugins/s3.csi.ferry.dev/csi.sock`), which kubelet is told at
    /// registration. Default: the --csi-endpoint path.
    #[arg(long, env = "FERRY_KUBELET_REGISTRATION_PATH")]
    kubelet_registration_path: Option<PathBuf>,
    /// PEM file of CA certificates to trust besides the system's (S3 and STS endpoints with a
    /// private CA).
    #[arg(long, env = "AWS_CA_BUNDLE")]
    ca_bundle: Option<PathBuf>,
    /// The EKS Pod Identity agent, for `authenticationSource: pod` volumes whose service account
    /// has no `eks.amazonaws.com/role-arn` annotation.
    #[arg(long, env = "FERRY_POD_IDENTITY_AGENT_URL", default_value = ferry_creds::DEFAULT_POD_IDENTITY_AGENT_URL)]
    pod_identity_agent_url: String,
    /// Kubeconfig for the Kubernetes API (ServiceAccount reads for `authenticationSource: pod`);
    /// default: `$KUBECONFIG` (its files merged), else `~/.kube/config`, else in-cluster. Without
    /// any, pod-level volumes are refused.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Pod-level credentials are renewed this many seconds before they expire.
    #[arg(long, env = "FERRY_CREDENTIAL_REFRESH_BEFORE", default_value = "300")]
    credential_refresh_before: u64,
    /// Directory of the node's block cache, shared by every mount (a hostPath); no cache if unset.
    #[arg(long, env = "FERRY_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Most bytes the block cache keeps on disk (e.g. 20GiB).
    #[arg(long, env = "FERRY_CACHE_MAX_SIZE", default_value = "10GiB", value_parser = parse_size)]
    cache_max_size: u64,
    /// Bytes the cache leaves free on its filesystem (it evicts, or stops caching, to keep them).
    #[arg(long, env = "FERRY_CACHE_MIN_FREE", default_value = "1GiB", value_parser = parse_size)]
    cache_min_free: u64,
    /// Cache block size: a power of two from 64KiB to 64MiB.
    #[arg(long, env = "FERRY_CACHE_BLOCK_SIZE", default_value = "4MiB", value_parser = parse_size)]
    cache_block_size: u64,
    /// Never hand cached objects to the kernel to read directly (FUSE passthrough); every read
    /// then goes through Ferry and its per-block checksums.
    #[arg(long, env = "FERRY_NO_CACHE_PASSTHROUGH")]
    no_cache_passthrough: bool,
    /// Memory for data in flight, shared by all mounts (prefetched parts, write buffers, kept
    /// listings, the node cache's queued blocks): a size (2GiB) or a share of the container's
    /// memory limit (75%, with FERRY_MEMORY_LIMIT in bytes). Default 1GiB.
    #[arg(long, env = "FERRY_MEMORY_BUDGET", value_parser = parse_budget)]
    memory_budget: Option<BudgetSpec>,
    /// Directory for handing mounts to a successor process (a hostPath shared by the old and
    /// the new node plugin pod): its lock and handover socket. Default: `state/` beside the CSI
    /// socket.
    #[arg(long, env = "FERRY_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// On SIGTERM with live mounts, wait this many seconds for a successor to take them over
    /// before exiting without one (the mounts then fail with ENOTCONN).
    #[arg(long, env = "FERRY_HANDOVER_WAIT", default_value = "30")]
    handover_wait: u64,
    /// The `ferry-fd-holder` socket: every mount's FUSE descriptor and journal are deposited
    /// there, so mounts survive a crash of this process (the next one recovers them). Without
    /// it, mounts end with this process unless it hands them over.
    #[arg(long, env = "FERRY_HOLDER_SOCKET")]
    holder_socket: Option<PathBuf>,
    /// State formats this process accepts from a predecessor (tests of a format change).
    #[arg(long, hide = true, value_delimiter = ',', default_value = "1")]
    handover_readable: Vec<u32>,
}

#[derive(Debug, Args)]
struct MountArgs {
    /// Bucket to mount.
    bucket: String,
    /// Directory to mount at.
    directory: PathBuf,
    /// Mount only keys under this prefix (ends with '/').
    #[arg(long)]
    prefix: Option<String>,
    /// S3 endpoint URL (S3-compatible stores).
    #[arg(long)]
    endpoint_url: Option<String>,
    /// Bucket region.
    #[arg(long)]
    region: Option<String>,
    /// Path-style addressing.
    #[arg(long)]
    force_path_style: bool,
    /// Mount read-only.
    #[arg(long)]
    read_only: bool,
    /// Allow deleting files and directories.
    #[arg(long)]
    allow_delete: bool,
    /// Allow overwriting existing files (open with O_TRUNC).
    #[arg(long)]
    allow_overwrite: bool,
    /// Allow other users (than the one mounting) to access the mount.
    #[arg(long)]
    allow_other: bool,
    /// Owner of files and directories.
    #[arg(long, value_parser = parse_id)]
    uid: Option<u32>,
    /// Group of files and directories.
    #[arg(long, value_parser = parse_id)]
    gid: Option<u32>,
    /// Permission bits of files, octal.
    #[arg(long, value_parser = parse_mode)]
    file_mode: Option<u16>,
    /// Permission bits of directories, octal.
    #[arg(long, value_parser = parse_mode)]
    dir_mode: Option<u16>,
    /// How long metadata is trusted: seconds, `indefinite` or `minimal` (default 1 s; with
    /// `--read-only`, `indefinite`).
    #[arg(long, value_parser = parse_ttl)]
    metadata_ttl: Option<MetadataTtl>,
    /// Stay in the foreground until unmounted or interrupted.
    #[arg(short, long)]
    foreground: bool,
    /// Once the mount is live, write the log to a new file in this directory
    /// (`ferry-mount-<UTC time>-<pid>.log`) instead of standard error. Without it, a mount in the
    /// background logs nothing once it is live (mount-s3's flag name).
    #[arg(short = 'l', long)]
    log_directory: Option<PathBuf>,
    /// Set by the background parent: the mount's standard error is the parent's pipe, let go of
    /// once the mount is live.
    #[arg(long, hide = true)]
    detached: bool,
    /// Serve Prometheus metrics at this address (e.g. 127.0.0.1:9810).
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Cache object blocks in this directory (kept across mounts and restarts).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Most MiB the cache keeps on disk (mount-s3's flag). Default 10 GiB.
    #[arg(long)]
    max_cache_size: Option<u64>,
    /// Bytes the cache leaves free on its filesystem.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    cache_min_free: u64,
    /// Cache block size: a power of two from 64KiB to 64MiB.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    cache_block_size: u64,
    /// Never hand cached objects to the kernel to read directly (FUSE passthrough).
    #[arg(long)]
    no_cache_passthrough: bool,
    /// Memory for data in flight (prefetched parts, write buffers, listings, the node cache's
    /// queued blocks): a size or a share (75%) of FERRY_MEMORY_LIMIT. Default 1GiB.
    #[arg(long, env = "FERRY_MEMORY_BUDGET", value_parser = parse_budget)]
    memory_budget: Option<BudgetSpec>,
}

/// Records the whole cached files this process checked, so the next one trusts them while they
/// stay unchanged (a clean shutdown only; after a crash everything is checked again).
async fn save_checked(cache: &Arc<BlockCache>) {
    let c = cache.clone();
    match tokio::task::spawn_blocking(move || c.save_checked()).await {
        Ok(Ok(n)) => tracing::info!(files = n, "cache: checked whole files recorded"),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cache: recording checked files failed; the next start checks them again")
        }
        Err(_) => {}
    }
}

/// The node-level things every mount shares: the memory budget and the block cache.
fn mount_context(
    cache: Option<CacheConfig>,
    budget: Option<BudgetSpec>,
    passthrough: bool,
) -> anyhow::Result<ferry_fs::MountContext> {
    let mut ctx = ferry_fs::MountContext::new(tokio::runtime::Handle::current());
    ctx.passthrough = passthrough;
    if let Some(spec) = budget {
        let limit = std::env::var("FERRY_MEMORY_LIMIT").ok();
        let bytes = spec
            .resolve(limit.as_deref())
            .map_err(|e| anyhow::anyhow!("--memory-budget: {e}"))?;
        ctx.budget = ferry_fs::MemoryBudget::new(bytes);
    }
    ferry_metrics::metrics()
        .node
        .memory_budget_limit
        .set(ctx.budget.limit() as i64);
    if let Some(cfg) = cache {
        let dir = cfg.dir.clone();
        let cache = BlockCache::open(cfg)
            .with_context(|| format!("opening the cache at {}", dir.display()))?;
        let c = cache.config();
        tracing::info!(dir = %dir.display(), max_size = c.max_size, min_free = c.min_free, block_size = c.block_size, "node cache opened; indexing its blocks in the background");
        // Blocks waiting to be written hold at most a share of the budget: below one block,
        // the cache can store nothing at all, which would otherwise go unsaid.
        let queue = ctx.budget.limit() / ferry_fs::fs::CACHE_QUEUE_SHARE;
        if queue < c.block_size {
            tracing::warn!(
                memory_budget = ctx.budget.limit(),
                block_size = c.block_size,
                "the node cache can store nothing: blocks waiting to be written may hold 1/{} of the memory budget ({queue} bytes), less than one block; raise --memory-budget to at least {} bytes or lower --cache-block-size",
                ferry_fs::fs::CACHE_QUEUE_SHARE,
                c.block_size * ferry_fs::fs::CACHE_QUEUE_SHARE
            );
        }
        ctx.cache = Some(cache);
    }
    tracing::info!(memory_budget = ctx.budget.limit(), "mount context ready");
    Ok(ctx)
}

fn parse_allowed_endpoints(s: &str) -> Result<AllowedEndpoints, String> {
    AllowedEndpoints::parse(s).map_err(|e| e.to_string())
}

fn parse_ttl(s: &str) -> Result<MetadataTtl, String> {
    s.parse()
}

fn parse_mode(s: &str) -> Result<u16, String> {
    u16::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| {
            format!("{s:?} is not an octal mode of permission bits (at most 777: no setuid, setgid or sticky bit)")
        })
}

/// A uid or gid: (uid_t)-1 means "no change" to chown(2), and no file can be owned by it.
fn parse_id(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(u32::MAX) => Err(format!("{s} is (uid_t)-1, which no file can be owned by")),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

fn main() -> anyhow::Result<()> {
    ferry_node::alloc::tune();
    let cli = Cli::parse();
    match cli.command {
        Command::Mount(args) if !args.foreground => daemonize(),
        command => {
            // A mount that will log to a file logs without colours from the start.
            let to_file = matches!(&command, Command::Mount(m) if m.log_directory.is_some());
            ferry_csi::log::init_colored(&cli.log, ferry_csi::log::colors_on_stderr() && !to_file)
                .map_err(anyhow::Error::msg)?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the tokio runtime")?;
            rt.block_on(async move {
                match command {
                    Command::Serve(args) => serve(args).await,
                    Command::Mount(args) => mount(args).await,
                }
            })
        }
    }
}

/// How long the background parent waits, once the directory is mounted, for the mount process to
/// let go of its standard error (it does so right after mounting).
const DETACH_WAIT: Duration = Duration::from_secs(5);

/// Runs this same command with `--foreground` in a new session, detached, and returns once the
/// directory is mounted (or the child failed, with its status).
///
/// The child's standard error comes through this process until the mount is live (so an error
/// at start is shown here), and its standard output goes nowhere. Once live, the child lets go
/// of the pipe (see [`detach_log`]): nothing of the background process then holds the caller's
/// terminal or pipes, so `out=$(ferry-node mount …)` or `ferry-node mount … | tee` returns.
fn daemonize() -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().context("finding our own executable")?;
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    args.push("--foreground".to_string());
    args.push("--detached".to_string());
    let dir = {
        let cli = Cli::parse();
        match cli.command {
            Command::Mount(m) => std::fs::canonicalize(&m.directory)
                .with_context(|| format!("mount directory {}", m.directory.display()))?,
            Command::Serve(_) => unreachable!("only mount daemonizes"),
        }
    };
    // Here too, not only in the child: the loop below would take that mount for the new one.
    refuse_mount_point(&dir)?;
    let mut child = std::process::Command::new(exe)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .context("starting the background mount process")?;
    let mut err = child.stderr.take().expect("piped");
    let (done_tx, done) = std::sync::mpsc::channel::<()>();
    let copier = std::thread::spawn(move || {
        let _ = std::io::copy(&mut err, &mut std::io::stderr());
        let _ = done_tx.send(());
    });
    let mut mounted_since = None;
    loop {
        if let Some(status) = child.try_wait()? {
            let _ = copier.join();
            // It said why on its standard error, copied above: its exit code is ours.
            match status.code() {
                Some(code) if code != 0 => std::process::exit(code),
                _ => bail!("the mount process exited with {status} before mounting"),
            }
        }
        if mounted_since.is_none()
            && ferry_node::mountinfo::mounted_at(&dir)?.is_some_and(|m| m.fs_type.contains("ferry"))
        {
            mounted_since = Some(std::time::Instant::now());
        }
        if let Some(at) = mounted_since {
            // Its log up to here shown (it let go of the pipe), or it is slow to: mounted anyway.
            let let_go = matches!(
                done.try_recv(),
                Ok(()) | Err(std::sync::mpsc::TryRecvError::Disconnected)
            );
            if let_go || at.elapsed() > DETACH_WAIT {
                println!("mounted at {} (pid {})", dir.display(), child.id());
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A directory something is mounted on is refused, as mount-s3 does: a second mount would hide
/// the first (whose process goes on serving nobody), and `umount` would then end the wrong one.
fn refuse_mount_point(dir: &Path) -> anyhow::Result<()> {
    if let Some(m) =
        ferry_node::mountinfo::mounted_at(dir).context("reading /proc/self/mountinfo")?
    {
        bail!(
            "mount directory {} is already a mount point ({} from {}): unmount it first, or choose another directory",
            dir.display(),
            m.fs_type,
            m.source
        );
    }
    Ok(())
}

/// Where the log goes once the mount is live (see [`detach_log`]): a new file in
/// `--log-directory`, made before mounting so that a directory it cannot be made in is an error
/// at start, not a log lost later; `None` to keep standard error.
fn log_file(a: &MountArgs) -> anyhow::Result<Option<(std::fs::File, PathBuf)>> {
    let Some(dir) = &a.log_directory else {
        return Ok(None);
    };
    let path = dir.join(format!(
        "ferry-mount-{}-{}.log",
        utc_stamp(),
        std::process::id()
    ));
    let file = std::fs::OpenOptions::new()
        .append(true)
        .create_new(true)
        .open(&path)
        .with_context(|| format!("--log-directory: creating the log file {}", path.display()))?;
    Ok(Some((file, path)))
}

/// Once the mount is live: standard output and error go to `file` (the `--log-directory` one),
/// or, for a background mount without one, to `/dev/null`. Either way a background mount lets
/// go of its parent's pipe. A foreground mount without `--log-directory` keeps logging to
/// standard error.
fn detach_log(file: Option<(std::fs::File, PathBuf)>, detached: bool) -> anyhow::Result<()> {
    let target = match file {
        Some((file, path)) => {
            tracing::info!(file = %path.display(), "logging to a file from now on");
            file
        }
        None if detached => std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .context("opening /dev/null")?,
        None => return Ok(()),
    };
    nix::unistd::dup2_stdout(&target).context("redirecting standard output")?;
    nix::unistd::dup2_stderr(&target).context("redirecting standard error")?;
    Ok(())
}

/// The time now in UTC as `YYYY-MM-DDTHH-MM-SSZ` (RFC 3339 without colons, for a file name).
fn utc_stamp() -> String {
    use aws_smithy_types::date_time::{DateTime, Format};
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    DateTime::from_secs(secs)
        .fmt(Format::DateTime)
        .unwrap_or_else(|_| secs.to_string())
        .replace(':', "-")
}

/// The current context of the kubeconfig at `path`.
async fn kubeconfig(path: &Path) -> anyhow::Result<kube::Config> {
    let file = kube::config::Kubeconfig::read_from(path)
        .with_context(|| format!("reading kubeconfig {}", path.display()))?;
    kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
        .await
        .with_context(|| format!("kubeconfig {}", path.display()))
}

/// What `authenticationSource: pod` volumes need: the Kubernetes API (ServiceAccount reads), the
/// STS client settings and the Pod Identity agent. `None` when no Kubernetes configuration is
/// found (such volumes are then refused with FailedPrecondition); an explicit `--kubeconfig` that
/// does not load is an error.
async fn pod_auth(a: &ServeArgs) -> anyhow::Result<Option<PodAuth>> {
    let mut config = match &a.kubeconfig {
        Some(path) => kubeconfig(path).await.context("loading --kubeconfig")?,
        None => match kube::Config::infer().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "no Kubernetes API access: authenticationSource: pod volumes will be refused");
                return Ok(None);
            }
        },
    };
    ferry_csi::kube_api::tune(&mut config);
    let server = config.cluster_url.to_string();
    let client = kube::Client::try_from(config).context("building the Kubernetes API client")?;
    let http = match &a.ca_bundle {
        Some(p) => Some(ferry_s3::https_client_with_ca_bundle(p).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let mut provider = ferry_creds::ProviderSettings::load(http).await;
    provider.refresh_before = Duration::from_secs(a.credential_refresh_before);
    tracing::info!(%server, "pod-level credentials enabled");
    Ok(Some(PodAuth {
        accounts: Arc::new(ferry_node::accounts::KubeServiceAccounts(client)),
        cache: ferry_creds::PodCredentialCache::new(provider),
        settings: ferry_creds::PodSettings {
            pod_identity_agent_url: a.pod_identity_agent_url.clone(),
            default_sts_region: a.region.clone(),
        },
    }))
}

/// A command-line value refused by a volume check, worded for the command line: the flag, then
/// the value and what is wrong with it (a volume error quotes a parameter's name where the value
/// would read better here).
fn flag_error(flag: &str, e: ferry_volume::VolumeError) -> anyhow::Error {
    match e {
        ferry_volume::VolumeError::Invalid { reason, .. } => {
            anyhow::anyhow!("invalid {flag}: {reason}")
        }
        e => anyhow::Error::new(e).context(format!("invalid {flag}")),
    }
}

fn endpoint(
    url: &Option<String>,
    region: &Option<String>,
    path_style: bool,
) -> anyhow::Result<Endpoint> {
    if let Some(u) = url {
        ferry_volume::validate::endpoint_url("--endpoint-url", u)
            .map_err(|e| flag_error("--endpoint-url", e))?;
    }
    if let Some(r) = region {
        ferry_volume::validate::region("--region", r).map_err(|e| flag_error("--region", e))?;
    }
    Ok(Endpoint {
        endpoint_url: url.clone(),
        region: region.clone(),
        force_path_style: path_style,
    })
}

async fn mount(a: MountArgs) -> anyhow::Result<()> {
    ferry_volume::validate::bucket_name("bucket", &a.bucket)
        .map_err(|e| flag_error("bucket name", e))?;
    // The directory is checked before anything is asked of S3: a wrong one is the quicker answer.
    // Like mount(8), the directory given is resolved once (a symlink to it is followed here);
    // from then on the mount, the watch below and the unmount use that one directory.
    let dir = std::fs::canonicalize(&a.directory)
        .with_context(|| format!("mount directory {}", a.directory.display()))?;
    if !dir.is_dir() {
        bail!(
            "mount directory {} is not a directory",
            a.directory.display()
        );
    }
    refuse_mount_point(&dir)?;
    if let Some(addr) = &a.metrics_addr {
        ferry_metrics::start(addr)
            .await
            .map_err(anyhow::Error::msg)?;
    }
    let prefix = match &a.prefix {
        Some(p) => ferry_volume::validate::prefix("--prefix", p, true)
            .map_err(|e| flag_error("--prefix", e))?,
        None => String::new(),
    };
    // Whoever runs this command chooses the endpoint: it is the operator, so no allowlist applies
    // (the store is the default endpoint's, which is always allowed).
    let stores = S3Stores::new(endpoint(&a.endpoint_url, &a.region, a.force_path_style)?);
    let store = stores.get(&Endpoint::default()).await?;
    // The check NodePublishVolume makes (it also runs the LIST path once before the first `ls`).
    match ferry_store::check_prefix_access(&*store, &a.bucket, &prefix).await {
        Ok(()) => {}
        Err(ferry_store::StoreError::NoSuchBucket(_)) => {
            bail!("bucket {:?} does not exist", a.bucket)
        }
        Err(e @ ferry_store::StoreError::AccessDenied(_)) => {
            return Err(anyhow::Error::new(e).context(format!(
                "may not list bucket {:?} prefix {:?} (s3:ListBucket)",
                a.bucket, prefix
            )))
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "listing bucket {:?} prefix {:?} to check access",
                a.bucket, prefix
            )))
        }
    }
    let (uid, gid) = (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    );
    let published = Published {
        volume_id: format!("{}/{}", a.bucket, prefix),
        spec: VolumeSpec {
            bucket: a.bucket.clone(),
            prefix,
            endpoint: Endpoint::default(),
            authentication: AuthenticationSource::Driver,
            sts_region: None,
            mountpoint_v2: Default::default(),
            options: MountOptions {
                read_only: a.read_only,
                allow_delete: a.allow_delete,
                allow_overwrite: a.allow_overwrite,
                allow_other: a.allow_other,
                uid: Some(a.uid.unwrap_or(uid)),
                gid: Some(a.gid.unwrap_or(gid)),
                file_mode: a.file_mode,
                dir_mode: a.dir_mode,
                metadata_ttl: a.metadata_ttl,
                ..Default::default()
            },
        },
        read_only: a.read_only,
        mount_group: None,
        credentials: MountCredentials::Driver,
    };
    let mut config = ferry_node::service::mount_config(&published, MetadataTtl::Seconds(1));
    config.allow_other = a.allow_other;
    let log = log_file(&a)?;
    let cache = a.cache.as_ref().map(|dir| CacheConfig {
        dir: dir.clone(),
        max_size: a
            .max_cache_size
            .map_or(10 << 30, |mib| mib.saturating_mul(1 << 20)),
        min_free: a.cache_min_free,
        block_size: a.cache_block_size,
    });
    let ctx = mount_context(cache, a.memory_budget, !a.no_cache_passthrough)?;
    let cache = ctx.cache.clone();
    let handle = tokio::task::spawn_blocking(move || ferry_fs::mount(store, config, &dir, ctx))
        .await?
        .with_context(|| format!("mounting at {}", a.directory.display()))?;
    tracing::info!(bucket = %a.bucket, directory = %handle.target().display(), "mounted; unmount with `umount` or Ctrl-C");
    // The same gauge the node plugin's mount table keeps: this process's one live mount.
    let live = &ferry_metrics::metrics().node.mounts;
    live.set(1);
    if let Err(e) = detach_log(log, a.detached) {
        // Mounted and serving: a log that cannot be redirected is no reason to stop.
        tracing::warn!(error = format!("{e:#}"), "the log stays on standard error");
    }
    // Wait for a signal or for an external unmount (of this mount: compared by device, so a
    // relative or symlinked directory argument, or a mount stacked on ours, is no confusion).
    let external = async {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if !handle.is_mounted().unwrap_or(false) {
                return;
            }
        }
    };
    let interrupted = tokio::select! {
        _ = ferry_csi::endpoint::shutdown_signal() => true,
        _ = external => false,
    };
    if !interrupted {
        tracing::info!("unmounted externally");
    }
    // Detaches the mount if it is still ours (busy or not) and ends its FUSE connection, so copies
    // of it in other mount namespaces never keep this process waiting.
    tokio::task::spawn_blocking(move || handle.detach()).await??;
    live.set(0);
    if let Some(cache) = &cache {
        cache.settle().await;
        save_checked(cache).await;
    }
    Ok(())
}

/// How long a mount may take to finish its running requests when frozen for a handover.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(20);

/// Takes the node's mounts: the lock in the state directory if no process holds it, else every
/// mount of the process that does (a handover; see `ferry_node::handover`). Returns the lock
/// (held for this process's life) and the mounts handed over.
async fn take_ownership(
    state: &StateDir,
    readable: &[u32],
    keeper: &ferry_node::keeper::Keeper,
) -> anyhow::Result<(
    std::fs::File,
    Vec<(MountRecord, std::os::fd::OwnedFd)>,
    Option<std::time::Instant>,
)> {
    std::fs::create_dir_all(&state.0)
        .with_context(|| format!("creating the state directory {}", state.0.display()))?;
    // Its socket hands out every mount's /dev/fuse descriptor and publish request (secrets
    // included): only this user may reach it.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&state.0, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restricting the state directory {}", state.0.display()))?;
    }
    if let Some(lock) = handover::try_lock(&state.lock())? {
        return Ok((lock, Vec::new(), None));
    }
    let (sock, readable) = (state.socket(), readable.to_vec());
    let started = std::time::Instant::now();
    let received = match tokio::task::spawn_blocking(move || handover::request(&sock, &readable))
        .await?
    {
        Ok(received) => received,
        Err(e) if owner_went_away(&e) => {
            // The owner is on its way out (stopping past its wait for a successor, or killed):
            // once it is gone its lock is free, and what it leaves is the fd holder's to recover.
            let lock_path = state.lock();
            let lock = tokio::task::spawn_blocking(move || {
                let deadline = std::time::Instant::now() + handover::STEP_TIMEOUT;
                loop {
                    if let Some(lock) = handover::try_lock(&lock_path)? {
                        return Ok(Some(lock));
                    }
                    if std::time::Instant::now() > deadline {
                        return Ok::<_, std::io::Error>(None);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
            .await??;
            let lock = lock.with_context(|| {
                format!("another ferry-node owns this node's mounts, did not hand them over ({e}) and did not exit")
            })?;
            tracing::info!(error = %e, "the previous process exited instead of handing its mounts over; taking its place");
            return Ok((lock, Vec::new(), None));
        }
        Err(e) => {
            return Err(e)
                .context("another ferry-node owns this node's mounts and did not hand them over")
        }
    };
    let owner = received.owner_pid;
    // Deposited before the answer: once the owner is gone, the holder of this pod is the only
    // other keeper of the connections.
    let keeper = keeper.clone();
    let received = tokio::task::spawn_blocking(move || {
        for (record, device) in &received.mounts {
            keeper.keep_received(record, device).with_context(|| {
                format!(
                    "depositing the mount at {} with the fd holder",
                    record.target.display()
                )
            })?;
        }
        anyhow::Ok(received)
    })
    .await??;
    // Tests of an owner stopped in the middle of a handover (a rolling update deletes the old
    // pod as soon as the new one starts): the mounts are taken but not yet adopted.
    if let Some(go) = std::env::var_os("FERRY_TEST_ADOPT_WHEN") {
        let go = std::path::PathBuf::from(go);
        tracing::warn!(file = %go.display(), "FERRY_TEST_ADOPT_WHEN: adopting the mounts once this file exists");
        while !go.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    received
        .adopt()
        .with_context(|| format!("telling process {owner} that the mounts were taken"))?;
    // The owner exits as soon as it reads the answer.
    let received =
        tokio::task::spawn_blocking(move || received.wait_owner_exit().map(|()| received))
            .await?
            .with_context(|| format!("process {owner} handed its mounts over but did not exit"))?;
    let (lock, mounts) = (received.lock, received.mounts);
    // Tests of a successor that dies between taking the mounts and serving them: the next
    // process must recover them from what was deposited above.
    if std::env::var_os("FERRY_TEST_ABORT_AFTER_ADOPTED").is_some() {
        tracing::warn!(
            "FERRY_TEST_ABORT_AFTER_ADOPTED: aborting with the mounts taken and unserved"
        );
        std::process::abort();
    }
    tracing::info!(
        mounts = mounts.len(),
        from_pid = owner,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "mounts handed over"
    );
    Ok((lock, mounts, Some(started)))
}

/// Whether a handover request failed because the owner was gone or went away before answering
/// (not because it declined or this process refused its state).
fn owner_went_away(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        UnexpectedEof | ConnectionReset | ConnectionRefused | BrokenPipe | NotFound
    )
}

/// Serves successors on the handover socket: the first one that takes the mounts ends this
/// process (exit status 0) — nothing is unmounted.
///
/// `busy` is held from a successor's request to the end of its handover: a process that is
/// stopping waits for it (the export has taken the mounts out of the table, so without it the
/// stopping process would see none and exit in the middle of the handover).
fn serve_handovers(
    listener: std::os::unix::net::UnixListener,
    node: NodeService,
    rt: tokio::runtime::Handle,
    state: StateDir,
    lock: std::fs::File,
    busy: Arc<tokio::sync::Mutex<()>>,
) {
    use std::os::fd::AsFd;
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "handover socket accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if let Err(e) = handover::same_user(&stream) {
            tracing::warn!(error = %e, "refused a handover request");
            continue;
        }
        let hello = match handover::read_hello(&stream) {
            Ok(Some(h)) => h,
            Ok(None) => {
                tracing::warn!("a successor that cannot read this process's state format asked for the mounts; serving on");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "handover request failed");
                continue;
            }
        };
        let _busy = busy.blocking_lock();
        let started = std::time::Instant::now();
        tracing::info!(successor_pid = hello.pid, "handing the mounts over");
        let export = match rt.block_on(node.export(FREEZE_TIMEOUT)) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "cannot hand over; serving on");
                let _ = handover::decline(&stream, &e.to_string());
                continue;
            }
        };
        let answer = {
            let devices = export.devices();
            let recs: Vec<_> = export.records.iter().collect();
            handover::send_state_refs(&stream, &recs, &devices, lock.as_fd())
        };
        match answer {
            Ok(handover::Answer::Adopted) => {
                let n = export.records.len();
                export.commit();
                if let Ok(uid) = std::env::var("POD_UID") {
                    let _ = std::fs::write(state.retired(&uid), b"");
                }
                tracing::info!(
                    mounts = n,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "mounts handed over; exiting"
                );
                // Now, and without running destructors: parked requests are re-sent to the
                // successor only once this process is gone.
                std::process::exit(0);
            }
            Ok(handover::Answer::Refused { reason }) => {
                tracing::warn!(reason, "the successor refused the mounts; serving on");
                export.abort();
            }
            Err(e) => {
                tracing::warn!(error = %e, "handover failed; serving on");
                export.abort();
            }
        }
    }
}

async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let socket = ferry_csi::endpoint::parse(&a.csi_endpoint).map_err(anyhow::Error::msg)?;
    if a.node_id.is_empty() {
        bail!("--node-id (NODE_ID) must not be empty");
    }
    let kubelet_endpoint = a
        .kubelet_registration_path
        .clone()
        .unwrap_or_else(|| socket.clone());
    if !kubelet_endpoint.is_absolute() {
        bail!(
            "--kubelet-registration-path {} must be an absolute path",
            kubelet_endpoint.display()
        );
    }
    let state = StateDir(a.state_dir.clone().unwrap_or_else(|| {
        socket
            .parent()
            .unwrap_or(std::path::Path::new("/"))
            .join("state")
    }));
    if let Ok(uid) = std::env::var("POD_UID") {
        if state.retired(&uid).exists() {
            tracing::info!(pod_uid = %uid, "this pod handed its mounts to a newer one; idle until stopped");
            let stop = ferry_csi::endpoint::shutdown_signal();
            // Healthy while it waits to be deleted (kubelet would otherwise restart it over and
            // over). On the host network the newer pod holds the port: nothing to answer then.
            let retired: ferry_metrics::health::Check = Arc::new(|| Box::pin(async { Ok(()) }));
            if let Err(e) = ferry_metrics::health::start_health(&a.health_addr, retired).await {
                tracing::info!(error = %e, "no /healthz while retired");
            }
            stop.await;
            return Ok(());
        }
    }
    raise_fd_limit();
    let keeper = ferry_node::keeper::Keeper::new(a.holder_socket.clone());
    let (lock, inherited, handed_at) =
        take_ownership(&state, &a.handover_readable, &keeper).await?;
    ferry_metrics::start(&a.metrics_addr)
        .await
        .map_err(anyhow::Error::msg)?;
    let s3 = S3Stores::new(endpoint(&a.endpoint_url, &a.region, a.force_path_style)?)
        .with_options(ferry_s3::S3Options {
            ca_bundle: a.ca_bundle.clone(),
            ..Default::default()
        })
        .with_allowed_endpoints(a.allowed_endpoints.clone().unwrap_or_default());
    tracing::info!(allowed = %s3.allowed_endpoints(), "volumes may name these S3 endpoints");
    let stores: Arc<dyn Stores> = Arc::new(s3);
    let mounts = Arc::new(MountTable::default());
    let pod_auth = pod_auth(&a).await?;
    let cache = a.cache_dir.as_ref().map(|dir| CacheConfig {
        dir: dir.clone(),
        max_size: a.cache_max_size,
        min_free: a.cache_min_free,
        block_size: a.cache_block_size,
    });
    let ctx = mount_context(cache, a.memory_budget, !a.no_cache_passthrough)?;
    let cache = ctx.cache.clone();
    let node = NodeService::with_parts(
        NodeConfig {
            node_id: a.node_id.clone(),
            kubelet_root: a.kubelet_root.clone(),
            default_metadata_ttl: a.metadata_ttl,
        },
        stores,
        mounts.clone(),
        ctx,
        pod_auth,
    )
    .with_keeper(keeper.clone());
    let identity = IdentityService::new(
        // The plugin as a whole provides the controller service (served by ferry-controller).
        vec![PluginCap::ControllerService],
        Box::new(|| Box::pin(async { fuse_device_usable() })),
    );
    // After the takeover, like the metrics endpoint: during an update the old and the new node
    // pod may share the host's network.
    let registration = RegistrationState::default();
    {
        let (probe, registration) = (identity.health_check(), registration.clone());
        let check: ferry_metrics::health::Check = Arc::new(move || {
            let (probe, registration) = (probe.clone(), registration.clone());
            Box::pin(async move {
                probe().await?;
                registration.health()
            })
        });
        ferry_metrics::health::start_health(&a.health_addr, check)
            .await
            .map_err(anyhow::Error::msg)?;
    }
    let recovering = std::time::Instant::now();
    if handed_at.is_none() && keeper.enabled() {
        // No live owner: whatever the holder keeps is a dead process's.
        let (served, cut) = node.recover().await;
        if served + cut > 0 {
            record_takeover("recovery", served, cut, recovering.elapsed());
        }
    }
    tokio::spawn(ferry_node::alloc::trimmer());
    {
        let node = node.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            loop {
                tick.tick().await;
                let node = node.clone();
                let _ = tokio::task::spawn_blocking(move || node.compact_journals()).await;
            }
        });
    }
    let n = inherited.len();
    let mut failed = 0;
    // All at once: each resumes on a blocking thread of its own, and a mount waits only for its own.
    let adopted = futures::future::join_all(
        inherited
            .into_iter()
            .map(|(record, device)| node.adopt(record, device, true)),
    )
    .await;
    failed += adopted.iter().filter(|r| r.is_err()).count();
    if n > 0 {
        let pause = handed_at.map_or(Duration::ZERO, |t| t.elapsed());
        record_takeover("handover", n - failed, failed, pause);
    }
    let _ = std::fs::remove_file(state.socket());
    let listener = std::os::unix::net::UnixListener::bind(state.socket())
        .with_context(|| format!("binding the handover socket {}", state.socket().display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(state.socket(), std::fs::Permissions::from_mode(0o600))?;
    }
    let handovers = Arc::new(tokio::sync::Mutex::new(()));
    {
        let (node, rt, state, busy) = (
            node.clone(),
            tokio::runtime::Handle::current(),
            state.clone(),
            handovers.clone(),
        );
        std::thread::Builder::new()
            .name("handover".into())
            .spawn(move || serve_handovers(listener, node, rt, state, lock, busy))?;
    }
    let shutdown = ferry_csi::endpoint::shutdown_signal();
    let (csi_socket, incoming) = OwnedSocket::bind(&socket)
        .with_context(|| format!("binding CSI socket {}", socket.display()))?;
    // Last, once the CSI socket is there: kubelet calls NodeGetInfo on it as soon as it sees the
    // registration socket. Binding it anew (a successor after a handover, a restart) makes kubelet
    // register the plugin again.
    let (stop_registration, registration_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some(dir) = &a.registration_dir {
        let path = registration::socket_path(dir, ferry_volume::DRIVER_NAME);
        let service = RegistrationService {
            driver: ferry_volume::DRIVER_NAME.to_string(),
            endpoint: kubelet_endpoint.display().to_string(),
            state: registration.clone(),
        };
        let stopped = async {
            let _ = registration_stopped.await;
        };
        registration::serve(&path, service, stopped)
            .with_context(|| format!("binding the registration socket {}", path.display()))?;
    }
    tracing::info!(endpoint = %socket.display(), node_id = %a.node_id, version = ferry_csi::VERSION, "ferry-node serving");
    tonic::transport::Server::builder()
        .layer(ferry_csi::log::RpcLogLayer)
        .add_service(IdentityServer::new(identity))
        .add_service(NodeServer::new(node))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .context("serving gRPC")?;
    // The CSI services are gone: kubelet unregisters the plugin when its socket goes (as with
    // node-driver-registrar on SIGTERM). Only our own socket: a successor's stays.
    match registration.remove_socket() {
        Ok(None) => {}
        Ok(Some((path, true))) => {
            tracing::info!(socket = %path.display(), "registration socket removed")
        }
        Ok(Some((path, false))) => {
            tracing::info!(socket = %path.display(), "registration socket is another process's now; left alone")
        }
        Err(e) => tracing::warn!(error = %e, "removing the registration socket failed"),
    }
    let _ = stop_registration.send(());
    // Held from here to the end: no handover starts while this process stops with its mounts,
    // and one under way (a successor started just before the signal, as a rolling update does)
    // ends first, in this process's exit if the successor took the mounts.
    let mut quiet = handovers_ended(&handovers).await;
    if !mounts.is_empty() && a.handover_wait > 0 {
        drop(quiet);
        // A successor that connects meanwhile takes the mounts and this process exits there.
        tracing::info!(
            mounts = mounts.len(),
            wait_s = a.handover_wait,
            "stopping: waiting for a successor to take the mounts over"
        );
        tokio::time::sleep(Duration::from_secs(a.handover_wait)).await;
        quiet = handovers_ended(&handovers).await;
    }
    if let Err(e) = csi_socket.remove() {
        tracing::warn!(socket = %socket.display(), error = %e, "removing the CSI socket failed");
    }
    if let Some(cache) = &cache {
        // Blocks fetched just before the signal are still being written: finish them (bounded:
        // readers of the mounts left in place may go on filling the cache meanwhile).
        if !cache.settle_within(Duration::from_secs(20)).await {
            tracing::warn!("cache: writes still running after 20 s; stopping without them");
        }
        save_checked(cache).await;
    }
    // Live mounts are left in place: unmounting them would show pods an empty directory whose
    // writes land on the node's disk. With a descriptor holder they wait for the next process,
    // which recovers them; without one their FUSE connections end with this process and they
    // fail with ENOTCONN until kubelet unpublishes them (which detaches the dead mount).
    let live = mounts.list();
    if !live.is_empty() && keeper.enabled() {
        tracing::warn!(
            mounts = live.len(),
            "exiting with live mounts and no successor; the fd holder keeps them for the next process"
        );
        std::process::exit(0);
    }
    if !live.is_empty() {
        tracing::warn!(
            mounts = live.len(),
            "exiting with live mounts; they fail with ENOTCONN until unpublished"
        );
        for (target, volume) in &live {
            tracing::warn!(target = %target.display(), volume_id = %volume, "live mount");
        }
        std::mem::forget(mounts.drain());
    }
    // Held until the process exits: a successor that asked meanwhile finds it gone and takes
    // its place (`take_ownership`).
    std::mem::forget(quiet);
    tracing::info!("ferry-node stopped");
    Ok(())
}

/// Waits for a handover under way to end and returns the guard that keeps the next one from
/// starting.
async fn handovers_ended(
    handovers: &Arc<tokio::sync::Mutex<()>>,
) -> tokio::sync::OwnedMutexGuard<()> {
    match handovers.clone().try_lock_owned() {
        Ok(quiet) => quiet,
        Err(_) => {
            tracing::info!(
                "stopping: a handover to a successor is under way; waiting for it to end"
            );
            handovers.clone().lock_owned().await
        }
    }
}

/// Counts mounts taken over from a previous process (`how`: `handover` or `recovery`) and those
/// that could not be, and records the pause.
fn record_takeover(how: &'static str, served: usize, failed: usize, pause: Duration) {
    let m = &ferry_metrics::metrics().node;
    m.taken_over(how, served as u64);
    m.taken_over("failed", failed as u64);
    m.takeover_pause(pause);
    let ms = pause.as_millis() as u64;
    if how == "handover" {
        tracing::info!(served, failed, pause_ms = ms, "handed-over mounts serving");
    } else {
        tracing::info!(
            served,
            failed,
            elapsed_ms = ms,
            "mounts of a previous process recovered"
        );
    }
}

/// Raises the soft limit on open descriptors to the hard one: every mount holds a `/dev/fuse`
/// descriptor, a journal and a connection abort file, and a takeover receives them all at once.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit");
            }
        }
    }
}

/// Readiness: `/dev/fuse` can be opened.
fn fuse_device_usable() -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map(drop)
        .map_err(|e| format!("cannot open /dev/fuse: {e}"))
}
