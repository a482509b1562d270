//! Every StorageClass parameter, volume-context key and kubelet/provisioner key Ferry reads.

/// StorageClass parameter and PV `volumeAttributes` key: the bucket.
pub const BUCKET_NAME: &str = "bucketName";
/// StorageClass: the prefix under which dynamic volumes are created.
pub const BASE_PREFIX: &str = "basePrefix";
/// StorageClass: template of a dynamic volume's prefix below `basePrefix`.
pub const PREFIX_TEMPLATE: &str = "prefixTemplate";
/// StorageClass and volume attribute: the bucket's region.
pub const REGION: &str = "region";
/// StorageClass and volume attribute: an S3-compatible endpoint URL.
pub const ENDPOINT_URL: &str = "endpointUrl";
/// StorageClass and volume attribute: path-style addressing.
pub const FORCE_PATH_STYLE: &str = "forcePathStyle";
/// StorageClass: `retain` (default) or `delete`.
pub const DELETE_POLICY: &str = "deletePolicy";
/// StorageClass: `deny` (default) or `allow`: whether a PVC of the class may bind its volume to an
/// existing prefix below `basePrefix` with [`EXISTING_PREFIX_ANNOTATION`]. Read by the controller
/// only; never in the volume context.
pub const EXISTING_PREFIX: &str = "existingPrefix";
/// Volume attribute: the volume's prefix inside the bucket.
pub const PREFIX: &str = "prefix";
/// Volume attribute (PV `volumeAttributes` or StorageClass parameter): `none` keeps the volume's
/// reads out of the node cache; `node` (the default) uses it when the node plugin has one.
pub const CACHE: &str = "cache";
/// Volume attribute (PV `volumeAttributes` or StorageClass parameter): warm the node cache after
/// NodePublishVolume: `"true"` (the whole volume), `"false"`, or comma-separated sub-prefixes of
/// the volume (`"train/,val/"`).
pub const PREFETCH_ON_MOUNT: &str = "prefetchOnMount";
/// Volume attribute: whose credentials the mount uses: `driver` (default; the node plugin's own, or
/// the node-publish Secret's keys when there is one) or `pod` (the pod's IRSA role or EKS Pod
/// Identity).
pub const AUTHENTICATION_SOURCE: &str = "authenticationSource";
/// Volume attribute: the STS region (and so regional endpoint) for `authenticationSource: pod`.
pub const STS_REGION: &str = "stsRegion";

/// Mountpoint's driver v2 (volume attributes of its static PVs; see [`crate::mountpoint_v2`]).
/// `cache` also takes v2's `emptyDir` and `ephemeral`: the node cache.
pub const CACHE_EMPTY_DIR_SIZE_LIMIT: &str = "cacheEmptyDirSizeLimit";
pub const CACHE_EMPTY_DIR_MEDIUM: &str = "cacheEmptyDirMedium";
pub const CACHE_EPHEMERAL_STORAGE_CLASS_NAME: &str = "cacheEphemeralStorageClassName";
pub const CACHE_EPHEMERAL_STORAGE_RESOURCE_REQUEST: &str = "cacheEphemeralStorageResourceRequest";
pub const MOUNTPOINT_POD_SERVICE_ACCOUNT_NAME: &str = "mountpointPodServiceAccountName";
pub const MOUNTPOINT_CONTAINER_RESOURCES_REQUESTS_CPU: &str =
    "mountpointContainerResourcesRequestsCpu";
pub const MOUNTPOINT_CONTAINER_RESOURCES_REQUESTS_MEMORY: &str =
    "mountpointContainerResourcesRequestsMemory";
pub const MOUNTPOINT_CONTAINER_RESOURCES_LIMITS_CPU: &str = "mountpointContainerResourcesLimitsCpu";
pub const MOUNTPOINT_CONTAINER_RESOURCES_LIMITS_MEMORY: &str =
    "mountpointContainerResourcesLimitsMemory";
/// `mountpointEnv.NAME`: an environment variable of v2's mount-s3 process.
pub const MOUNTPOINT_ENV_PREFIX: &str = "mountpointEnv.";

/// Keys csi-provisioner adds with `--extra-create-metadata`.
pub const PVC_NAME: &str = "csi.storage.k8s.io/pvc/name";
pub const PVC_NAMESPACE: &str = "csi.storage.k8s.io/pvc/namespace";
pub const PV_NAME: &str = "csi.storage.k8s.io/pv/name";

/// PVC annotation: bind the new volume to this existing prefix in the bucket (a dataset) instead
/// of a fresh one from `prefixTemplate`. Only on a StorageClass with `existingPrefix: allow`, only
/// below its `basePrefix`, never with `deletePolicy: delete`. Read by the controller from the PVC
/// csi-provisioner names.
pub const EXISTING_PREFIX_ANNOTATION: &str = "s3.csi.ferry.dev/existing-prefix";

/// Everything under this prefix is set by Kubernetes components (provisioner metadata, secret
/// references, kubelet's pod info) and is never an error.
pub const KUBERNETES_PREFIX: &str = "csi.storage.k8s.io/";

/// csi-provisioner also records its identity on every PV it provisions
/// (`storage.kubernetes.io/csiProvisionerIdentity`); kubelet passes it on to NodePublishVolume.
pub const STORAGE_PREFIX: &str = "storage.kubernetes.io/";

/// Kubelet's pod info keys (CSIDriver `podInfoOnMount`).
pub const POD_NAME: &str = "csi.storage.k8s.io/pod.name";
pub const POD_NAMESPACE: &str = "csi.storage.k8s.io/pod.namespace";
pub const POD_UID: &str = "csi.storage.k8s.io/pod.uid";
pub const SERVICE_ACCOUNT_NAME: &str = "csi.storage.k8s.io/serviceAccount.name";
/// Kubelet's service-account tokens (CSIDriver `tokenRequests`): JSON by audience.
pub const SERVICE_ACCOUNT_TOKENS: &str = "csi.storage.k8s.io/serviceAccount.tokens";
pub const EPHEMERAL: &str = "csi.storage.k8s.io/ephemeral";

/// Whether a key is set by Kubernetes components (never an error, never ours).
pub fn is_kubernetes_key(key: &str) -> bool {
    key.starts_with(KUBERNETES_PREFIX) || key.starts_with(STORAGE_PREFIX)
}
