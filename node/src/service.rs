//! The CSI Node service: NodePublishVolume mounts a prefix with the in-process FUSE filesystem,
//! NodeUnpublishVolume unmounts it and removes the target directory (unless files were written
//! into it while nothing was mounted there: those are never deleted, and never mounted over).
//!
//! Staging, expansion and volume stats are not offered (the capabilities list is empty), so kubelet
//! calls only publish and unpublish.
//!
//! NodePublishVolume refuses (InvalidArgument) a volume whose endpoint — from its attributes or its
//! `endpoint-url` mount option — the operator does not allow ([`Stores::permit`]), before its
//! credentials are decided and before any request, whoever's credentials would sign.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_creds::{
    parse_tokens, resolve_pod_source, PodCredentialCache, PodRef, PodSettings, ServiceAccounts,
    StaticKeys,
};
use ferry_csi::capability;
use ferry_csi::error::{quote, require, unimplemented, Result};
use ferry_csi::inflight::{InFlight, InFlightSet};
use ferry_csi::pb;
use ferry_csi::pb::node_server::Node;
use ferry_csi::stores::{StoreCredentials, Stores};
use ferry_csi::CsiError;
use ferry_fs::{MetadataTtl as FsTtl, MountConfig};
use ferry_store::StoreError;
use ferry_volume::{keys, AuthenticationSource, MetadataTtl, NodeCache, VolumeSpec};
use tonic::{Request, Response, Status};
use tracing::{info, instrument, warn};

use crate::handover::MountRecord;
use crate::keeper::{self, Keeper};
use crate::mountinfo;
use crate::mounts::{MountCredentials, MountTable, Mounted, Published};
use crate::targetpath;
use crate::warm::MountWarmUp;

/// Node-level settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: String,
    /// Targets must lie below this directory.
    pub kubelet_root: PathBuf,
    /// Metadata TTL for volumes that do not set `metadata-ttl`.
    pub default_metadata_ttl: MetadataTtl,
}

/// What pod-level credentials (`authenticationSource: pod`) need on the node: the ServiceAccount
/// reader, the per-identity provider cache, and the agent URL and default STS region.
pub struct PodAuth {
    pub accounts: Arc<dyn ServiceAccounts>,
    pub cache: PodCredentialCache,
    pub settings: PodSettings,
}

/// How long NodePublishVolume waits for the volume's first LIST (the access check). A hung S3
/// endpoint costs its own volume this long, never the others (each publish is a task of its own):
/// the publish fails UNAVAILABLE, and kubelet retries.
pub const PUBLISH_PROBE_TIMEOUT: Duration = Duration::from_secs(20);

/// The node service. Each publish and unpublish runs in a task of its own, so a caller that gives
/// up (kubelet's RPC timeout) cannot cancel it halfway between mounting and recording the mount.
#[derive(Clone)]
pub struct NodeService {
    inner: Arc<Inner>,
}

struct Inner {
    config: NodeConfig,
    /// The kubelet root with symlinks resolved: resolved targets are checked against it.
    canonical_root: PathBuf,
    stores: Arc<dyn Stores>,
    mounts: Arc<MountTable>,
    in_flight: InFlightSet<PathBuf>,
    /// The runtime mounts serve on and the memory budget all their prefetching shares.
    mount_context: ferry_fs::MountContext,
    /// `None`: `authenticationSource: pod` volumes are refused (no Kubernetes access).
    pod_auth: Option<PodAuth>,
    /// Publish and unpublish hold it shared; a handover holds it exclusively, so the mount table
    /// it hands over is not changing underneath it.
    ops: Arc<tokio::sync::RwLock<()>>,
    /// Deposits each mount with the descriptor holder (crash recovery).
    keeper: Keeper,
}

/// A target path as an error quotes it (cut short, see [`quote`]).
fn shown(target: &Path) -> String {
    quote(&target.display().to_string()).to_string()
}

/// Converts a volume's TTL setting into the filesystem's.
pub fn fs_ttl(ttl: MetadataTtl) -> FsTtl {
    match ttl {
        MetadataTtl::Seconds(s) => FsTtl::Duration(Duration::from_secs(s)),
        MetadataTtl::Minimal => FsTtl::Duration(Duration::ZERO),
        MetadataTtl::Indefinite => FsTtl::Indefinite,
    }
}

/// The filesystem configuration of a published volume.
///
/// CSI mounts allow other users by default: the pod's processes do not run as the node plugin's
/// user, and the kernel still enforces the file and directory modes (`default_permissions`).
pub fn mount_config(p: &Published, default_ttl: MetadataTtl) -> MountConfig {
    let o = &p.spec.options;
    MountConfig {
        bucket: p.spec.bucket.clone(),
        prefix: p.spec.prefix.clone(),
        read_only: p.read_only,
        allow_delete: o.allow_delete,
        allow_overwrite: o.allow_overwrite,
        uid: o.uid.unwrap_or(0),
        gid: o.gid.or(p.mount_group).unwrap_or(0),
        file_mode: o.file_mode.unwrap_or(if p.mount_group.is_some() {
            0o664
        } else {
            0o644
        }),
        dir_mode: o.dir_mode.unwrap_or(if p.mount_group.is_some() {
            0o775
        } else {
            0o755
        }),
        allow_other: true,
        metadata_ttl: fs_ttl(o.metadata_ttl.unwrap_or(if p.read_only {
            // Read-only datasets are immutable by default: a pod cannot change them through
            // this mount, and ML jobs re-read the same files every epoch. A `metadata-ttl`
            // mount option (PV or StorageClass) says otherwise.
            MetadataTtl::Indefinite
        } else {
            default_ttl
        })),
        fs_name: ferry_fs::config::fs_name(&p.spec.bucket, &p.spec.prefix),
        endpoint: p.spec.endpoint.endpoint_url.clone().unwrap_or_default(),
        node_cache: !o.no_cache,
    }
}

/// The warm-up a mount of `published` asks for (`prefetchOnMount`, the node cache on), fetching
/// with the mount's `store`.
fn warm_up_of(
    ctx: &ferry_fs::MountContext,
    published: &Published,
    config: &MountConfig,
    store: Arc<dyn ferry_store::ObjectStore>,
) -> Option<MountWarmUp> {
    let (Some(cache), Some(subs), true) = (
        &ctx.cache,
        &published.spec.options.warm_up,
        config.node_cache,
    ) else {
        return None;
    };
    let w = ferry_fs::WarmUp {
        endpoint: config.endpoint.clone(),
        bucket: config.bucket.clone(),
        prefixes: subs
            .iter()
            .map(|s| format!("{}{s}", config.prefix))
            .collect(),
    };
    // With the mount's identity (the proofs its store's mounts share): its readers join the
    // warm-up's GETs.
    let proofs = ctx.proofs.for_store(&store);
    Some(MountWarmUp::new(
        store,
        proofs,
        cache.clone(),
        w,
        ctx.runtime.clone(),
    ))
}

impl NodeService {
    pub fn new(config: NodeConfig, stores: Arc<dyn Stores>, mounts: Arc<MountTable>) -> Self {
        let ctx = ferry_fs::MountContext::new(tokio::runtime::Handle::current());
        Self::with_parts(config, stores, mounts, ctx, None)
    }

    /// A node service whose mounts share `ctx` (memory budget, block cache).
    pub fn with_context(
        config: NodeConfig,
        stores: Arc<dyn Stores>,
        mounts: Arc<MountTable>,
        ctx: ferry_fs::MountContext,
    ) -> Self {
        Self::with_parts(config, stores, mounts, ctx, None)
    }

    /// A node service that also serves `authenticationSource: pod` volumes.
    pub fn with_pod_auth(
        config: NodeConfig,
        stores: Arc<dyn Stores>,
        mounts: Arc<MountTable>,
        pod_auth: Option<PodAuth>,
    ) -> Self {
        let ctx = ferry_fs::MountContext::new(tokio::runtime::Handle::current());
        Self::with_parts(config, stores, mounts, ctx, pod_auth)
    }

    /// Deposits every mount with the descriptor holder `keeper` reaches (crash recovery).
    pub fn with_keeper(mut self, keeper: Keeper) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("set before the service is shared")
            .keeper = keeper;
        self
    }

    /// Rewrites each mount's journal that grew well past its live set into a new memfd and
    /// deposits that (the old one is dropped).
    pub fn compact_journals(&self) {
        self.inner.mounts.with_all(|all| {
            for m in all.values_mut() {
                let (Some(_), Some(journal)) = (&m.journal, m.handle.fs().journal()) else {
                    continue;
                };
                let (inodes, handles) = m.handle.fs().table_sizes();
                if journal.records_since_compaction() < 4 * (inodes + handles) as u64 + 10_000 {
                    continue;
                }
                let res = keeper::memfd("ferry-journal").and_then(|f| {
                    let theirs = f.try_clone()?;
                    m.handle.fs().compact_journal(theirs)?;
                    Ok(f)
                });
                match res {
                    Ok(file) => {
                        // What a later republish deposits again.
                        m.journal = Some(file);
                        self.inner.keeper.keep(m);
                    }
                    Err(e) => {
                        warn!(target = %m.handle.target().display(), error = %e, "compacting the mount's journal failed")
                    }
                }
            }
        });
    }

    /// Recovers every mount the descriptor holder kept for a process that died: rebuilt from its
    /// journal, the kernel asked to re-send what that process left unanswered. Returns (served,
    /// cut off).
    pub async fn recover(&self) -> (usize, usize) {
        let keeper = self.inner.keeper.clone();
        let kept = match tokio::task::spawn_blocking(move || keeper.take_kept()).await {
            Ok(Ok(k)) => k,
            Ok(Err(e)) => {
                warn!(error = %e, "cannot reach the fd holder: no mount is recovered");
                return (0, 0);
            }
            Err(_) => return (0, 0),
        };
        let (mut served, mut cut) = (0, 0);
        let mut readable = Vec::new();
        for entry in kept {
            match entry {
                Ok(r) => readable.push(r),
                Err(u) => {
                    cut += 1;
                    tracing::error!(key = %u.key, reason = %u.reason, "a mount kept for a previous process cannot be recovered; cutting it off (it fails with ENOTCONN until unpublished)");
                    if let Some((target, dev)) = &u.mount {
                        abandon(target, *dev);
                    }
                    let keeper = self.inner.keeper.clone();
                    let key = u.key.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        keeper.release(std::path::Path::new(&key))
                    })
                    .await;
                }
            }
        }
        // All at once, as after a handover.
        let adopted = futures::future::join_all(readable.into_iter().map(|(record, device)| {
            let target = record.target.clone();
            async move { (target, self.adopt(record, device, true).await) }
        }))
        .await;
        for (target, res) in adopted {
            match res {
                Ok(()) => served += 1,
                Err(_) => {
                    cut += 1;
                    self.inner.keeper.release(&target);
                }
            }
        }
        (served, cut)
    }

    /// A node service whose mounts share `ctx` (memory budget, block cache) and that also
    /// serves `authenticationSource: pod` volumes when `pod_auth` is given.
    pub fn with_parts(
        config: NodeConfig,
        stores: Arc<dyn Stores>,
        mounts: Arc<MountTable>,
        ctx: ferry_fs::MountContext,
        pod_auth: Option<PodAuth>,
    ) -> Self {
        let canonical_root = std::fs::canonicalize(&config.kubelet_root)
            .unwrap_or_else(|_| config.kubelet_root.clone());
        NodeService {
            inner: Arc::new(Inner {
                config,
                canonical_root,
                stores,
                mounts,
                in_flight: InFlightSet::default(),
                mount_context: ctx,
                pod_auth,
                ops: Arc::default(),
                keeper: Keeper::default(),
            }),
        }
    }
}

/// The group a publish asks files to belong to (`volume_mount_group`).
fn mount_group(cap: &pb::VolumeCapability) -> Result<Option<u32>> {
    match &cap.access_type {
        Some(pb::volume_capability::AccessType::Mount(m)) if !m.volume_mount_group.is_empty() => {
            Some(m.volume_mount_group.parse::<u32>().map_err(|_| {
                CsiError::InvalidArgument(format!(
                    "volume_mount_group {} is not a numeric group id",
                    quote(&m.volume_mount_group)
                ))
            }))
            .transpose()
        }
        _ => Ok(None),
    }
}

/// A volume-context value kubelet must pass for pod-level credentials.
fn pod_info<'a>(req: &'a pb::NodePublishVolumeRequest, key: &str, why: &str) -> Result<&'a str> {
    req.volume_context
        .get(key)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| {
            CsiError::InvalidArgument(format!(
                "authenticationSource: pod needs {key} in the volume context ({why})"
            ))
        })
}

impl Inner {
    /// Decides the credentials of a publish: the pod's identity, the Secret's keys, or the driver's.
    async fn credentials(
        &self,
        req: &pb::NodePublishVolumeRequest,
        spec: &VolumeSpec,
    ) -> Result<(StoreCredentials, MountCredentials)> {
        // A CSIDriver with serviceAccountTokenInSecrets (Kubernetes 1.35+) has kubelet pass the
        // pod's tokens in the secrets, under the key they have in the volume context otherwise:
        // not a node-publish Secret's key.
        let tokens_in_secrets = req.secrets.get(keys::SERVICE_ACCOUNT_TOKENS);
        let secret: std::collections::HashMap<String, String> = req
            .secrets
            .iter()
            .filter(|(k, _)| k.as_str() != keys::SERVICE_ACCOUNT_TOKENS)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        match spec.authentication {
            AuthenticationSource::Driver => match StaticKeys::from_secrets(&secret)? {
                Some(k) => {
                    let id = k.access_key_id.clone();
                    Ok((
                        StoreCredentials::Static(k),
                        MountCredentials::Static { access_key_id: id },
                    ))
                }
                None => Ok((StoreCredentials::Driver, MountCredentials::Driver)),
            },
            AuthenticationSource::Pod => {
                if !secret.is_empty() {
                    return Err(CsiError::InvalidArgument(
                        "authenticationSource: pod and a node-publish Secret exclude each other: remove one".into(),
                    ));
                }
                let auth = self.pod_auth.as_ref().ok_or_else(|| {
                    CsiError::FailedPrecondition(
                        "authenticationSource: pod needs Kubernetes API access, and this node plugin runs without it".into(),
                    )
                })?;
                const POD_INFO: &str = "the CSIDriver object must set podInfoOnMount: true";
                let pod = PodRef {
                    namespace: pod_info(req, keys::POD_NAMESPACE, POD_INFO)?.to_string(),
                    name: pod_info(req, keys::POD_NAME, POD_INFO)?.to_string(),
                    service_account: pod_info(req, keys::SERVICE_ACCOUNT_NAME, POD_INFO)?
                        .to_string(),
                };
                let tokens = match tokens_in_secrets {
                    Some(t) if !t.is_empty() => parse_tokens(t)?,
                    _ => parse_tokens(pod_info(
                        req,
                        keys::SERVICE_ACCOUNT_TOKENS,
                        "the CSIDriver object must declare tokenRequests for sts.amazonaws.com and pods.eks.amazonaws.com",
                    )?)?,
                };
                let source = resolve_pod_source(
                    auth.accounts.as_ref(),
                    &pod,
                    &tokens,
                    spec.sts_region.as_deref(),
                    &auth.settings,
                )
                .await?;
                let identity = source
                    .identity()
                    .cloned()
                    .ok_or_else(|| CsiError::Internal("pod source without identity".into()))?;
                // The provider is shared per identity; this hands it the pod's newest token.
                let provider = auth.cache.provider(&source, &pod)?;
                Ok((
                    StoreCredentials::Pod(provider),
                    MountCredentials::Pod(identity),
                ))
            }
        }
    }

    /// Whether the table has another volume than `volume_id` at `target`. The spec's answer to an
    /// unpublish of a volume that is not published at a target is OK, and the other volume's mount
    /// is not that request's to end: the caller answers OK and touches nothing.
    fn other_volume_at(&self, volume_id: &str, target: &Path) -> bool {
        match self.mounts.get(target) {
            Some(existing) if existing.volume_id != volume_id => {
                warn!(
                    published = %quote(&existing.volume_id),
                    "volume {} is not published at this target (another volume is): nothing to unpublish, the other volume's mount left as it is",
                    quote(volume_id)
                );
                true
            }
            _ => false,
        }
    }

    /// Takes the mount at `target` out of the table and ends it (`false`: none is recorded there).
    async fn take_down(&self, target: &Path) -> Result<bool> {
        let Some(m) = self.mounts.remove(target) else {
            return Ok(false);
        };
        // Detached in this namespace; copies elsewhere are cut off (ENOTCONN), so this never
        // waits on another mount namespace.
        let res = tokio::task::spawn_blocking(move || m.handle.detach())
            .await
            .map_err(|e| CsiError::Internal(format!("unmount task failed: {e}")))?;
        res.map_err(|e| CsiError::Internal(format!("unmounting {}: {e}", shown(target))))?;
        self.keeper.release(target);
        ferry_fs::alloc::trim_soon();
        Ok(true)
    }

    fn begin(&self, target: &Path) -> Result<InFlight<PathBuf>> {
        self.in_flight.begin(target.to_path_buf())
    }

    /// What is mounted on top at `target`, from mountinfo.
    fn mounted_at(target: &Path) -> Result<Option<mountinfo::MountEntry>> {
        mountinfo::mounted_at(target)
            .map_err(|e| CsiError::Internal(format!("reading mountinfo: {e}")))
    }

    /// The refusal for a mount at `target` that Ferry did not make: Ferry never unmounts, mounts
    /// over or removes another filesystem.
    fn foreign(target: &Path, m: &mountinfo::MountEntry) -> CsiError {
        CsiError::FailedPrecondition(format!(
            "target_path {} has a {} mount of {} that Ferry did not make; Ferry neither unmounts nor covers it (unmount it first)",
            quote(&target.to_string_lossy()),
            m.fs_type,
            quote(&m.source)
        ))
    }

    /// Detaches a Ferry mount at `target` that this process does not own: a dead FUSE mount left by
    /// an earlier node plugin process (its connection ended with that process). A mount of any
    /// other filesystem is left alone and refused.
    fn clear_stale(target: &Path) -> Result<()> {
        if let Some(m) = Self::mounted_at(target)? {
            if !m.is_ferry() {
                return Err(Self::foreign(target, &m));
            }
            // A dead mount (its process gone) answers ENOTCONN; a live one is another process's
            // (a user's `ferry-node mount`, another node plugin): not ours to end.
            let dead =
                std::fs::metadata(target).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN));
            if !dead {
                return Err(CsiError::FailedPrecondition(format!(
                    "target {} has a live Ferry mount ({}) that this node plugin did not make; not touched: unmount it",
                    shown(target),
                    quote(&m.source)
                )));
            }
            warn!(target = %target.display(), source = %m.source, "detaching a dead Ferry mount an earlier process left");
            // Opened while the dead mount still holds its connection number.
            let abort = mountinfo::ConnectionAbort::open(m.dev.1).ok();
            mountinfo::detach(target).map_err(|e| {
                CsiError::Internal(format!("detaching stale mount at {}: {e}", shown(target)))
            })?;
            // Copies in other mount namespaces keep a dead connection; end it for them too.
            if let Some(abort) = abort {
                let _ = abort.abort();
            }
        }
        Ok(())
    }

    #[instrument(skip_all, fields(volume_id = %quote(&req.volume_id), target_path = %quote(&req.target_path)))]
    async fn publish(
        &self,
        req: pb::NodePublishVolumeRequest,
    ) -> Result<pb::NodePublishVolumeResponse> {
        let _ops = self.ops.clone().read_owned().await;
        let volume_id = require("volume_id", &req.volume_id)?;
        require("target_path", &req.target_path)?;
        let cap = req.volume_capability.as_ref().ok_or_else(|| {
            CsiError::InvalidArgument("volume_capability is required".to_string())
        })?;
        let mode = capability::check(cap)?;
        let target = targetpath::check(&self.config.kubelet_root, &req.target_path)?;
        // The CO makes the parent (the spec: it SHALL ensure it exists); NOT_FOUND would say the
        // volume does not exist.
        let target = targetpath::resolve(&self.canonical_root, &target)?.ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "the parent directory of target_path {} does not exist (the CO makes it)",
                quote(&req.target_path)
            ))
        })?;
        let spec = VolumeSpec::from_publish(&req.volume_context, capability::mount_flags(cap))?;
        // Before the credentials are decided (a pod's are fetched for this endpoint's requests)
        // and before any client exists.
        self.stores.permit(&spec.endpoint)?;
        let mount_group = mount_group(cap)?;
        let _guard = self.begin(&target)?;
        match targetpath::inspect(&target)? {
            targetpath::Found::Nothing | targetpath::Found::Directory => {}
            targetpath::Found::Symlink => {
                return Err(CsiError::InvalidArgument(format!(
                    "target_path {} is a symbolic link: Ferry never mounts through one",
                    quote(&req.target_path)
                )))
            }
            targetpath::Found::Other => {
                return Err(CsiError::InvalidArgument(format!(
                    "target_path {} exists and is not a directory",
                    quote(&req.target_path)
                )))
            }
        }
        let live_credentials = self
            .mounts
            .get(&target)
            .filter(|e| e.volume_id == volume_id)
            .map(|e| e.credentials);
        let (store_credentials, credentials) = self.credentials(&req, &spec).await?;
        let live = self
            .mounts
            .is_live(&target)
            .map_err(|e| CsiError::Internal(format!("reading mountinfo: {e}")))?;
        if let Some(was) = live_credentials.filter(|was| live && *was != credentials) {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {} is mounted at {} as {was}; this publish asks for {credentials}: a live mount never changes identity (unpublish it first)",
                quote(volume_id),
                shown(&target)
            )));
        }
        let published = Published {
            volume_id: volume_id.to_string(),
            read_only: req.readonly || capability::mode_read_only(mode) || spec.options.read_only,
            spec,
            mount_group,
            credentials,
        };
        // Everything the mount needs is checked before anything is created.
        let config = mount_config(&published, self.config.default_metadata_ttl);
        config.validate().map_err(|e| {
            CsiError::InvalidArgument(format!(
                "volume {} cannot be mounted: {e}",
                quote(volume_id)
            ))
        })?;

        if let Some(existing) = self.mounts.get(&target) {
            if !live {
                // Unmounted behind our back (or its session died): forget it and mount afresh.
                warn!("the recorded mount is gone; mounting again");
                if let Some(m) = self.mounts.remove(&target) {
                    // Dropping the handle ends its connection and reaps its session; nothing of
                    // it is at the target any more, so nothing there is unmounted.
                    let _ = tokio::task::spawn_blocking(move || drop(m)).await;
                }
            } else if existing == published {
                let request = prost::Message::encode_to_vec(&req);
                self.mounts
                    .set_request(&target, request, |m| self.keeper.keep(m));
                match &published.credentials {
                    // The pod's provider already has the new token (Inner::credentials).
                    MountCredentials::Pod(id) => {
                        info!(identity = %id, "republished: token renewed")
                    }
                    _ => info!("already published"),
                }
                return Ok(pb::NodePublishVolumeResponse {});
            }
        }
        if let Some(existing) = self.mounts.get(&target) {
            return Err(CsiError::AlreadyExists(
                if existing.volume_id != published.volume_id {
                    format!(
                        "target {} already has volume {} published",
                        shown(&target),
                        quote(&existing.volume_id)
                    )
                } else {
                    format!(
                        "volume {} is already published at {} with other options",
                        quote(volume_id),
                        shown(&target)
                    )
                },
            ));
        }
        Self::clear_stale(&target)?;
        // Nothing is mounted at the target now. Kubelet never puts anything there (it makes the
        // parent directory and keeps its own file in that): entries are what something wrote
        // into the bare directory, such as a container that ran on it after its mount went
        // away. Mounted over, they would be hidden from everyone, and once unmounted again the
        // directory could not be removed (kubelet's own clean-up of the pod fails on it too).
        // The path whole, not cut short like other quoted values: it is where an operator must
        // go (checked to be at most 4095 bytes; the status message is capped in any case).
        if targetpath::has_entries(&target)? {
            return Err(CsiError::FailedPrecondition(format!(
                "target_path {:?} is a directory that is not empty, with nothing mounted on it: Ferry does not mount over files, which the volume would hide (they were written there while no volume was mounted; move them away and kubelet's next try mounts the volume)",
                target.display().to_string()
            )));
        }

        let store = self
            .stores
            .get_as(&published.spec.endpoint, &store_credentials)
            .await
            .map_err(|e| CsiError::from_store("creating the S3 client", e))?;
        let listed = tokio::time::timeout(
            PUBLISH_PROBE_TIMEOUT,
            ferry_store::check_prefix_access(
                &*store,
                &published.spec.bucket,
                &published.spec.prefix,
            ),
        )
        .await
        .map_err(|_| {
            CsiError::Unavailable(format!(
                "S3 endpoint {} did not answer a LIST of bucket {:?} prefix {} within {} s",
                published.spec.endpoint.endpoint_url.as_deref().map_or_else(
                    || "(the driver's default)".to_string(),
                    ferry_volume::validate::redact_url
                ),
                published.spec.bucket,
                quote(&published.spec.prefix),
                PUBLISH_PROBE_TIMEOUT.as_secs()
            ))
        })?;
        match listed {
            Ok(_) => {}
            Err(StoreError::NoSuchBucket(_)) => {
                return Err(CsiError::NotFound(format!(
                    "bucket {:?} does not exist",
                    published.spec.bucket
                )))
            }
            Err(e @ (StoreError::AccessDenied(_) | StoreError::Credentials(_))) => {
                return Err(CsiError::from_store(
                    &format!(
                        "{} may not list bucket {:?} prefix {} (s3:ListBucket)",
                        published.credentials,
                        published.spec.bucket,
                        quote(&published.spec.prefix)
                    ),
                    e,
                ))
            }
            // Anything else (an outage, a 404 that is not NoSuchBucket) is no refusal: what the
            // server said, as it said it.
            Err(e) => {
                return Err(CsiError::from_store(
                    &format!(
                        "listing bucket {:?} prefix {} as {} to check access",
                        published.spec.bucket,
                        quote(&published.spec.prefix),
                        published.credentials
                    ),
                    e,
                ))
            }
        }

        let created = CreatedDir::make(&target)?;
        let mut mount_context = self.mount_context.clone();
        let journal = self.journal_for(&target, &mut mount_context)?;
        let warm_store = store.clone();
        let (mount_target, mount_config) = (target.clone(), config.clone());
        let handle = tokio::task::spawn_blocking(move || {
            ferry_fs::mount(store, mount_config, &mount_target, mount_context)
        })
        .await
        .map_err(|e| CsiError::Internal(format!("mount task failed: {e}")))?
        .map_err(|e| match e {
            ferry_fs::MountError::Config(e) => CsiError::InvalidArgument(e.to_string()),
            // Swapped for a symlink or a file since it was looked at.
            ferry_fs::MountError::Target { error, .. }
                if error.kind() == std::io::ErrorKind::NotADirectory =>
            {
                CsiError::InvalidArgument(format!(
                    "target_path {}: {error}",
                    quote(&req.target_path)
                ))
            }
            e => CsiError::Internal(format!("mounting at {}: {e}", shown(&target))),
        })?;
        created.keep();
        let warm_up = warm_up_of(&self.mount_context, &published, &config, warm_store)
            .map(|w| w.on_finish(self.on_warm_up_finished()));
        info!(
            bucket = %published.spec.bucket,
            prefix = %published.spec.prefix,
            read_only = published.read_only,
            pod_uid = targetpath::pod_uid(&self.config.kubelet_root, &target).unwrap_or("-"),
            "published"
        );
        let node_cache = match &self.mount_context.cache {
            Some(c) => NodeCache::On {
                max_size: c.config().max_size,
            },
            None => NodeCache::Off,
        };
        for n in published.spec.migration_notices(node_cache) {
            warn!(volume_id = %quote(volume_id), attribute = %n.attribute, "Mountpoint v2 attribute not applied as v2 would: {}", n.message);
        }
        let request = prost::Message::encode_to_vec(&req);
        self.mounts.insert(
            target,
            Mounted {
                published,
                config,
                handle,
                request,
                journal,
                warm_up,
            },
            |m| self.keeper.keep(m),
        );
        Ok(pb::NodePublishVolumeResponse {})
    }

    #[instrument(skip_all, fields(volume_id = %quote(&req.volume_id), target_path = %quote(&req.target_path)))]
    async fn unpublish(
        &self,
        req: pb::NodeUnpublishVolumeRequest,
    ) -> Result<pb::NodeUnpublishVolumeResponse> {
        let _ops = self.ops.clone().read_owned().await;
        let volume_id = require("volume_id", &req.volume_id)?;
        require("target_path", &req.target_path)?;
        let target = targetpath::check(&self.config.kubelet_root, &req.target_path)?;
        let Some(target) = targetpath::resolve(&self.canonical_root, &target)? else {
            // Nothing can be mounted below a parent that is gone, but the mount published there
            // may still be in the table (unmounted behind our back, its directories then
            // removed): its session, and any warm-up it runs, end here.
            if let Some(key) = self.mounts.published_at(&req.target_path) {
                let _guard = self.begin(&key)?;
                if self.other_volume_at(volume_id, &key) {
                    return Ok(pb::NodeUnpublishVolumeResponse {});
                }
                info!("target's parent is gone; ending the mount published there");
                self.take_down(&key).await?;
            } else {
                info!("target's parent is gone; nothing to unpublish");
            }
            return Ok(pb::NodeUnpublishVolumeResponse {});
        };
        let _guard = self.begin(&target)?;
        if self.other_volume_at(volume_id, &target) {
            return Ok(pb::NodeUnpublishVolumeResponse {});
        }
        let found = targetpath::inspect(&target)?;
        // Only Ferry's own mount on top is unmounted: never a mount stacked on it, nor one of
        // another filesystem.
        match Self::mounted_at(&target)? {
            Some(m) if !m.is_ferry() => return Err(Self::foreign(&target, &m)),
            _ => {}
        }
        if !self.take_down(&target).await? && found != targetpath::Found::Symlink {
            Self::clear_stale(&target)?;
        }
        match found {
            // Ferry never mounts through a symlink, so none is its to remove.
            targetpath::Found::Symlink => {
                warn!("target_path is a symbolic link; left as it is");
            }
            // rmdir(2) removes the directory itself, never what a symlink points to.
            _ => match std::fs::remove_dir(&target) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
                    warn!("target_path is not a directory; left as it is");
                }
                // Files written into the bare directory while nothing was mounted there (rmdir(2)
                // of a mount point is EBUSY, so nothing is mounted on it now): the volume is
                // unpublished, and they are not the volume's to delete. An error here would be
                // retried by kubelet for ever, the pod Terminating.
                Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
                    warn!(
                        target = %target.display(),
                        "unpublished, but the target directory is not empty (files written there while no volume was mounted): it is left in place with its files, which Ferry never deletes; kubelet cannot remove it either until they are moved away"
                    );
                }
                Err(e) => {
                    return Err(CsiError::Internal(format!(
                        "removing target directory {}: {e}",
                        shown(&target)
                    )))
                }
            },
        }
        info!("unpublished");
        Ok(pb::NodeUnpublishVolumeResponse {})
    }
}

/// A target directory publish created: removed again unless the publish succeeds ([`keep`]).
///
/// [`keep`]: CreatedDir::keep
struct CreatedDir(Option<PathBuf>);

impl CreatedDir {
    /// Creates `target` (its parent exists) unless it already is a directory.
    fn make(target: &Path) -> Result<CreatedDir> {
        match std::fs::create_dir(target) {
            Ok(()) => Ok(CreatedDir(Some(target.to_path_buf()))),
            // Checked not to be a symlink or a file just before, under the in-flight guard.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(CreatedDir(None)),
            Err(e) => Err(CsiError::Internal(format!(
                "creating target directory {}: {e}",
                shown(target)
            ))),
        }
    }

    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for CreatedDir {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            if let Err(e) = std::fs::remove_dir(&dir) {
                warn!(target = %dir.display(), error = %e, "removing the target directory of a failed publish");
            }
        }
    }
}

/// This process's side of a handover in progress: CSI operations are held and every mount is
/// frozen (see [`ferry_fs::MountHandle::freeze`]); [`Export::commit`] gives them up,
/// [`Export::abort`] serves them on.
pub struct Export {
    mounts: Vec<(PathBuf, Mounted)>,
    /// Each mount's state, in the order of `mounts`.
    pub records: Vec<MountRecord>,
    table: Arc<MountTable>,
    /// A successor deposits what it received before it answers; where it shares the holder with
    /// this process (not in the chart: one holder per pod), a handover called off must deposit
    /// this process's own journals again.
    keeper: Keeper,
    _ops: tokio::sync::OwnedRwLockWriteGuard<()>,
}

impl Export {
    /// The `/dev/fuse` descriptors, in the order of [`Export::records`].
    pub fn devices(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        self.mounts
            .iter()
            .filter_map(|(_, m)| m.handle.device())
            .collect()
    }

    /// The successor has the mounts: forget them without unmounting anything.
    pub fn commit(mut self) {
        for (_, m) in std::mem::take(&mut self.mounts) {
            m.handle.hand_over();
        }
    }

    /// No handover after all: the mounts serve on here.
    pub fn abort(mut self) {
        self.put_back();
    }

    fn put_back(&mut self) {
        for (target, m) in std::mem::take(&mut self.mounts) {
            m.handle.thaw();
            self.table.insert(target, m, |m| self.keeper.keep(m));
        }
    }
}

impl Drop for Export {
    /// An export neither committed nor aborted (an unwinding panic) serves its mounts on: a
    /// `Mounted` dropped would unmount.
    fn drop(&mut self) {
        self.put_back();
    }
}

impl NodeService {
    /// Freezes every mount for a successor (each may take up to `timeout` to finish the requests
    /// it is running; one that does not makes the whole handover fail, and every mount serves on).
    pub async fn export(&self, timeout: Duration) -> anyhow::Result<Export> {
        let inner = &self.inner;
        let ops = tokio::time::timeout(timeout, inner.ops.clone().write_owned())
            .await
            .map_err(|_| anyhow::anyhow!("CSI operations still running after {timeout:?}"))?;
        let mut export = Export {
            mounts: Vec::new(),
            records: Vec::new(),
            table: inner.mounts.clone(),
            keeper: inner.keeper.clone(),
            _ops: ops,
        };
        // Every mount goes into the export before any is frozen: on any failure `abort` puts them
        // all back (a `Mounted` dropped here would unmount).
        export.mounts = inner.mounts.drain();
        if let Some((target, _)) = export
            .mounts
            .iter()
            .find(|(_, m)| m.handle.device().is_none() || m.handle.kernel_init().is_none())
        {
            let target = target.clone();
            export.abort();
            anyhow::bail!(
                "the mount at {} was made through fusermount3: it cannot be handed over",
                target.display()
            );
        }
        // A kernel that cannot re-send would leave the requests parked at the freeze unanswered.
        if let Some((target, _)) = export
            .mounts
            .iter()
            .find(|(_, m)| m.handle.kernel_init().is_some_and(|k| !k.has_resend()))
        {
            let target = target.clone();
            export.abort();
            anyhow::bail!(
                "the kernel cannot re-send FUSE requests (FUSE_NOTIFY_RESEND, Linux 6.9+), so the mount at {} cannot be handed over without hanging a request",
                target.display()
            );
        }
        // All at once, under one deadline.
        let frozen =
            futures::future::join_all(export.mounts.iter().map(|(_, m)| m.handle.freeze(timeout)))
                .await;
        let mut records = Vec::with_capacity(frozen.len());
        for ((target, m), f) in export.mounts.iter().zip(frozen) {
            match f {
                Ok(f) => records.push(MountRecord {
                    target: target.clone(),
                    dev: m.handle.device_numbers(),
                    kernel: f.kernel,
                    request: m.request.clone(),
                    snapshot: f.snapshot,
                    warmed: m.warmed(),
                }),
                Err(e) => {
                    let target = target.clone();
                    export.abort();
                    anyhow::bail!("freezing the mount at {}: {e}", target.display());
                }
            }
        }
        export.records = records;
        Ok(export)
    }

    /// Serves a mount a previous process handed over (or left behind): its credentials are
    /// rebuilt from its publish request as a publish would, then its FUSE session resumes on
    /// `device`. If that fails the mount is cut off (its connection aborted, the target detached)
    /// rather than left hanging, and the error says why.
    pub async fn adopt(
        &self,
        record: MountRecord,
        device: std::os::fd::OwnedFd,
        resend: bool,
    ) -> anyhow::Result<()> {
        let (target, dev) = (record.target.clone(), record.dev);
        let res = self.inner.adopt(record, device, resend).await;
        if let Err(e) = &res {
            warn!(target = %target.display(), error = %e, "cannot serve the mount a previous process left; cutting it off (it fails with ENOTCONN until unpublished)");
            abandon(&target, dev);
        }
        res
    }
}

/// Cuts off a mount no process will serve: aborts its connection and detaches it (if it is still
/// the one at `target`).
pub fn abandon(target: &Path, dev: (u32, u32)) {
    // Only while the mount is still there: a connection number is reused once its mount is gone,
    // and then it is another mount's. (Without the mount, the connection ends with its last
    // descriptor.)
    if let Ok(Some(m)) = mountinfo::mounted_at(target) {
        if m.dev == dev {
            if let Ok(abort) = mountinfo::ConnectionAbort::open(dev.1) {
                let _ = abort.abort();
            }
            let _ = mountinfo::detach(target);
        }
    }
}

impl Inner {
    /// With a descriptor holder: a new journal for the mount at `target`, set in `ctx` for the
    /// mount to write, and the file to deposit.
    fn journal_for(
        &self,
        target: &Path,
        ctx: &mut ferry_fs::MountContext,
    ) -> Result<Option<std::fs::File>> {
        if !self.keeper.enabled() {
            return Ok(None);
        }
        let file = keeper::memfd("ferry-journal")
            .map_err(|e| CsiError::Internal(format!("creating the mount's journal: {e}")))?;
        let theirs = file
            .try_clone()
            .map_err(|e| CsiError::Internal(format!("creating the mount's journal: {e}")))?;
        ctx.journal = Some(Arc::new(ferry_fs::Journal::new(
            theirs,
            serde_json::json!({ "target": target }),
        )));
        Ok(Some(file))
    }

    /// What runs once a warm-up finished: the live mounts that asked for it are deposited with
    /// the descriptor holder again, now saying so (a process that recovers them after a crash
    /// does not run it again).
    fn on_warm_up_finished(&self) -> crate::warm::OnFinish {
        let (mounts, keeper) = (self.mounts.clone(), self.keeper.clone());
        Arc::new(move |id: &str| {
            if keeper.enabled() {
                mounts.each_warming(id, |m| keeper.keep(m));
            }
        })
    }

    async fn adopt(
        &self,
        record: MountRecord,
        device: std::os::fd::OwnedFd,
        resend: bool,
    ) -> anyhow::Result<()> {
        use anyhow::Context;
        let req = <pb::NodePublishVolumeRequest as prost::Message>::decode(&record.request[..])
            .context("decoding the mount's publish request")?;
        let cap = req
            .volume_capability
            .as_ref()
            .context("the publish request has no volume_capability")?;
        let mode = capability::check(cap).map_err(|e| anyhow::anyhow!("{e}"))?;
        let spec = VolumeSpec::from_publish(&req.volume_context, capability::mount_flags(cap))?;
        self.stores
            .permit(&spec.endpoint)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mount_group = mount_group(cap).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (store_credentials, credentials) = self
            .credentials(&req, &spec)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let published = Published {
            volume_id: req.volume_id.clone(),
            read_only: req.readonly || capability::mode_read_only(mode) || spec.options.read_only,
            spec,
            mount_group,
            credentials,
        };
        let store = self
            .stores
            .get_as(&published.spec.endpoint, &store_credentials)
            .await
            .map_err(|e| anyhow::anyhow!("creating the S3 client: {e}"))?;
        let config = record.snapshot.config.clone();
        let mut ctx = self.mount_context.clone();
        let journal = self
            .journal_for(&record.target, &mut ctx)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let warm_up =
            warm_up_of(&self.mount_context, &published, &config, store.clone()).map(|w| {
                w.taken_over(record.warmed)
                    .on_finish(self.on_warm_up_finished())
            });
        let target = record.target.clone();
        let (snapshot, dev, kernel) = (record.snapshot, record.dev, record.kernel);
        let handle = tokio::task::spawn_blocking(move || {
            ferry_fs::resume(store, snapshot, device, dev, kernel, &target, ctx, resend)
        })
        .await??;
        info!(target = %record.target.display(), volume_id = %quote(&published.volume_id), "mount taken over");
        self.mounts.insert(
            record.target,
            Mounted {
                published,
                config,
                handle,
                request: record.request,
                journal,
                // Not started again if the predecessor had finished it (its record says so):
                // this process holds its claim as that one did. Otherwise started again (blocks
                // still cached are found, not fetched).
                warm_up,
            },
            |m| self.keeper.keep(m),
        );
        Ok(())
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_publish_volume(
        &self,
        request: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        let inner = self.inner.clone();
        let req = request.into_inner();
        let res = tokio::spawn(async move { inner.publish(req).await })
            .await
            .map_err(|e| Status::internal(format!("publish task failed: {e}")))?;
        Ok(Response::new(res?))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let inner = self.inner.clone();
        let req = request.into_inner();
        let res = tokio::spawn(async move { inner.unpublish(req).await })
            .await
            .map_err(|e| Status::internal(format!("unpublish task failed: {e}")))?;
        Ok(Response::new(res?))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        use pb::node_service_capability::{rpc::Type, Rpc, Type as CapType};
        Ok(Response::new(pb::NodeGetCapabilitiesResponse {
            capabilities: vec![pb::NodeServiceCapability {
                r#type: Some(CapType::Rpc(Rpc {
                    r#type: Type::VolumeMountGroup as i32,
                })),
            }],
        }))
    }

    async fn node_get_info(
        &self,
        _request: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        Ok(Response::new(pb::NodeGetInfoResponse {
            node_id: self.inner.config.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }

    async fn node_stage_volume(
        &self,
        _r: Request<pb::NodeStageVolumeRequest>,
    ) -> Result<Response<pb::NodeStageVolumeResponse>, Status> {
        unimplemented("NodeStageVolume")
    }

    async fn node_unstage_volume(
        &self,
        _r: Request<pb::NodeUnstageVolumeRequest>,
    ) -> Result<Response<pb::NodeUnstageVolumeResponse>, Status> {
        unimplemented("NodeUnstageVolume")
    }

    async fn node_get_volume_stats(
        &self,
        _r: Request<pb::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::NodeGetVolumeStatsResponse>, Status> {
        unimplemented("NodeGetVolumeStats")
    }

    async fn node_expand_volume(
        &self,
        _r: Request<pb::NodeExpandVolumeRequest>,
    ) -> Result<Response<pb::NodeExpandVolumeResponse>, Status> {
        unimplemented("NodeExpandVolume")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_volume::{validate, Endpoint, MountOptions};
    use proptest::prelude::*;

    fn published(bucket: &str, prefix: String) -> Published {
        Published {
            volume_id: "v".into(),
            spec: VolumeSpec {
                bucket: bucket.into(),
                prefix,
                endpoint: Endpoint::default(),
                options: MountOptions::default(),
                authentication: AuthenticationSource::Driver,
                sts_region: None,
                mountpoint_v2: Default::default(),
            },
            read_only: false,
            mount_group: None,
            credentials: MountCredentials::Driver,
        }
    }

    /// Any character, with `/` often enough to make segments.
    fn raw_prefix(max: usize) -> impl Strategy<Value = String> {
        prop::collection::vec(
            prop_oneof![
                3 => Just('/'),
                3 => prop::char::range(' ', '~'),
                1 => any::<char>(),
            ],
            0..max,
        )
        .prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        /// Issue 14 item 8: every prefix the volume validator accepts gives a mount config the
        /// filesystem accepts, whose fs_name gives the bucket and prefix back.
        #[test]
        fn every_prefix_the_validator_accepts_mounts(
            bucket in "[a-z0-9][a-z0-9-]{1,61}[a-z0-9]",
            raw in raw_prefix(60),
            long in 0usize..3,
        ) {
            // Some near the 1024-byte limit too.
            let raw = match long {
                0 => raw,
                n => format!("{}/{raw}", "\u{3042}".repeat(330 + n)),
            };
            prop_assume!(validate::bucket_name("b", &bucket).is_ok());
            if let Ok(prefix) = validate::prefix("p", &raw, true) {
                let cfg = mount_config(&published(&bucket, prefix.clone()), MetadataTtl::Seconds(1));
                prop_assert!(cfg.validate().is_ok(), "{:?}: {:?}", raw, cfg.validate());
                let path = if prefix.is_empty() { bucket.clone() } else { format!("{bucket}/{prefix}") };
                prop_assert_eq!(ferry_fs::config::decode_fs_name(&cfg.fs_name), Some(path));
            }
        }
    }

    #[test]
    fn a_target_publish_created_is_removed_unless_the_publish_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("mount");
        drop(CreatedDir::make(&t).unwrap());
        assert!(!t.exists(), "a failed publish leaves nothing behind");
        CreatedDir::make(&t).unwrap().keep();
        assert!(t.is_dir());
        // One that was there before is never removed.
        drop(CreatedDir::make(&t).unwrap());
        assert!(t.is_dir());
    }

    /// A node service on the in-memory store whose kubelet root is `dir/kubelet`.
    fn node_in(dir: &Path) -> NodeService {
        let store: Arc<dyn ferry_store::ObjectStore> = Arc::new(ferry_store::MemoryStore::new());
        node_with(dir, Arc::new(ferry_csi::stores::FixedStore(store)))
    }

    /// A node service on `stores` whose kubelet root is `dir/kubelet`.
    fn node_with(dir: &Path, stores: Arc<dyn Stores>) -> NodeService {
        let root = dir.join("kubelet");
        std::fs::create_dir_all(root.join("pods")).unwrap();
        NodeService::new(
            NodeConfig {
                node_id: "test-node".into(),
                kubelet_root: root,
                default_metadata_ttl: MetadataTtl::Seconds(1),
            },
            stores,
            Arc::new(MountTable::default()),
        )
    }

    /// A publish of a volume in bucket `bucket` at `target`, with `secrets`.
    fn publish_req(
        bucket: &str,
        target: &Path,
        secrets: &[(&str, &str)],
    ) -> pb::NodePublishVolumeRequest {
        use pb::volume_capability::{access_mode::Mode, AccessMode, AccessType, MountVolume};
        pb::NodePublishVolumeRequest {
            volume_id: "pv-1".into(),
            target_path: target.display().to_string(),
            volume_capability: Some(pb::VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: Some(AccessMode {
                    mode: Mode::MultiNodeMultiWriter as i32,
                }),
            }),
            volume_context: [(keys::BUCKET_NAME.to_string(), bucket.to_string())].into(),
            secrets: secrets
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    /// Pod `pod`'s target path for volume `pv` (its parent made, as kubelet makes it).
    fn target_in(dir: &Path, pod: &str, pv: &str) -> PathBuf {
        ferry_testkit::kubelet_target(&dir.join("kubelet"), pod, pv)
    }

    fn unpublish_req(volume_id: &str, target: &Path) -> pb::NodeUnpublishVolumeRequest {
        pb::NodeUnpublishVolumeRequest {
            volume_id: volume_id.into(),
            target_path: target.display().to_string(),
        }
    }

    /// A target directory that holds files once nothing is mounted on it (written there while the
    /// mount was gone) made every NodeUnpublishVolume fail with `INTERNAL: Directory not empty`,
    /// and kubelet retried it for ever. The volume is unpublished: OK, every time, and the files
    /// and their directory stay where they are.
    #[tokio::test]
    async fn unpublish_leaves_a_target_directory_with_files_in_place_and_answers_ok() {
        let dir = tempfile::tempdir().unwrap();
        let node = node_in(dir.path());
        let target = target_in(dir.path(), "pod-1", "pv-1");
        std::fs::create_dir_all(target.join("sub")).unwrap();
        std::fs::write(target.join("written-while-unmounted"), b"keep me").unwrap();
        std::fs::write(target.join("sub/too"), b"and me").unwrap();
        for _ in 0..2 {
            node.inner
                .unpublish(unpublish_req("pv-1", &target))
                .await
                .unwrap();
            assert_eq!(
                std::fs::read(target.join("written-while-unmounted")).unwrap(),
                b"keep me"
            );
            assert_eq!(std::fs::read(target.join("sub/too")).unwrap(), b"and me");
        }
        // An empty target is removed, as ever.
        let empty = target_in(dir.path(), "pod-2", "pv-1");
        std::fs::create_dir(&empty).unwrap();
        node.inner
            .unpublish(unpublish_req("pv-1", &empty))
            .await
            .unwrap();
        assert!(!empty.exists());
    }

    /// A publish over a directory that holds files (nothing mounted on it) is refused with
    /// FAILED_PRECONDITION naming the path, before any request or mount: the mount would hide
    /// them, and the directory could not be removed at unpublish. The files stay as they were.
    #[tokio::test]
    async fn publish_refuses_a_target_directory_with_files() {
        let dir = tempfile::tempdir().unwrap();
        let node = node_in(dir.path());
        let target = target_in(dir.path(), "pod-1", "pv-1");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join(".hidden"), b"keep me").unwrap();
        let e = node
            .inner
            .publish(publish_req("data", &target, &[]))
            .await
            .unwrap_err();
        let CsiError::FailedPrecondition(m) = &e else {
            panic!("{e:?}");
        };
        assert!(m.contains(&target.display().to_string()), "{m}");
        assert!(m.contains("not empty"), "{m}");
        assert_eq!(std::fs::read(target.join(".hidden")).unwrap(), b"keep me");
        assert!(node.inner.mounts.is_empty());
    }

    /// A target whose parent kubelet did not make breaks the CO's side of the contract; NOT_FOUND
    /// would tell kubelet the volume does not exist. FAILED_PRECONDITION names the path, and
    /// nothing is made.
    #[tokio::test]
    async fn publish_below_a_missing_parent_is_a_failed_precondition() {
        let dir = tempfile::tempdir().unwrap();
        let node = node_in(dir.path());
        let target = dir
            .path()
            .join("kubelet/pods/no-such-pod/volumes/kubernetes.io~csi/pv-1/mount");
        let e = node
            .inner
            .publish(publish_req("data", &target, &[]))
            .await
            .unwrap_err();
        let CsiError::FailedPrecondition(m) = &e else {
            panic!("{e:?}");
        };
        assert!(m.contains("parent directory"), "{m}");
        assert!(m.contains("pv-1/mount"), "{m}");
        assert!(!target.parent().unwrap().exists());
    }

    /// An access key the S3 server does not know is not a missing bucket: NodePublishVolume
    /// quotes what the server said (VERSITYGW: `404 XAdminUserNotFound`; S3 answers 403
    /// `InvalidAccessKeyId`), where it said `bucket "data" does not exist`; and leaves no target.
    #[tokio::test]
    async fn publish_with_keys_the_server_does_not_know_quotes_the_server() {
        let s3 = ferry_testkit::S3Server::start();
        s3.create_bucket("data").await;
        let dir = tempfile::tempdir().unwrap();
        let defaults = Endpoint {
            endpoint_url: Some(s3.endpoint_url()),
            region: Some(s3.region().into()),
            force_path_style: true,
        };
        let stores = ferry_csi::stores::S3Stores::new(defaults)
            .with_options(ferry_testkit::S3Server::test_options());
        let node = node_with(dir.path(), Arc::new(stores));
        let target = target_in(dir.path(), "pod-1", "pv-1");
        let secrets = [
            ("accessKeyId", "ferry-no-such-user"),
            ("secretAccessKey", "ferry-no-such-secret"),
        ];
        let e = node
            .inner
            .publish(publish_req("data", &target, &secrets))
            .await
            .unwrap_err();
        let st = Status::from(e);
        assert_eq!(st.code(), tonic::Code::Internal, "{st:?}");
        let m = st.message();
        assert!(!m.contains("does not exist"), "{m}");
        for part in [
            "XAdminUserNotFound",
            "No user exists with the provided access key ID",
            "bucket \"data\"",
            "access key ferry-no-such-user",
        ] {
            assert!(m.contains(part), "{part:?} in {m}");
        }
        assert!(!target.exists(), "no target left behind");
        // A bucket that is really missing still says so.
        let keys = [
            ("accessKeyId", s3.access_key()),
            ("secretAccessKey", s3.secret_key()),
        ];
        let e = node
            .inner
            .publish(publish_req("ferry-no-such-bucket", &target, &keys))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, CsiError::NotFound(m) if m.contains("does not exist")),
            "{e:?}"
        );
    }

    #[test]
    fn a_read_only_volume_keeps_its_metadata_unless_a_mount_option_says_otherwise() {
        use ferry_fs::MetadataTtl as Fs;
        let one = MetadataTtl::Seconds(1);
        let mut p = published("data", String::new());
        assert_eq!(
            mount_config(&p, one).metadata_ttl,
            Fs::Duration(Duration::from_secs(1))
        );
        p.read_only = true;
        assert_eq!(mount_config(&p, one).metadata_ttl, Fs::Indefinite);
        p.spec.options.metadata_ttl = Some(MetadataTtl::Seconds(60));
        assert_eq!(
            mount_config(&p, one).metadata_ttl,
            Fs::Duration(Duration::from_secs(60))
        );
        p.read_only = false;
        p.spec.options.metadata_ttl = Some(MetadataTtl::Indefinite);
        assert_eq!(mount_config(&p, one).metadata_ttl, Fs::Indefinite);
    }

    #[test]
    fn prefixes_that_broke_the_mount_option_string_now_mount() {
        for prefix in [
            "my data/",
            "a,b/",
            "x=y/",
            "back\\slash/",
            "caf\u{e9}/",
            "tab\there/",
        ] {
            let cfg = mount_config(&published("data", prefix.into()), MetadataTtl::Seconds(1));
            assert!(cfg.validate().is_ok(), "{prefix:?}: {}", cfg.fs_name);
        }
    }
}
