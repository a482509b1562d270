//! The CSI Controller service: CreateVolume, DeleteVolume, ValidateVolumeCapabilities and
//! ControllerGetCapabilities. Every other RPC answers Unimplemented.
//!
//! A volume is a prefix in a bucket. CreateVolume checks the bucket is reachable and returns an id
//! that carries bucket, prefix, endpoint and delete policy (see [`ferry_volume::id`]), so DeleteVolume
//! needs no state. Creating writes nothing to S3: the prefix exists once something is written to it.
//!
//! A volume's endpoint must be one the operator allows ([`Stores::permit`]), checked before any
//! request: CreateVolume refuses it with InvalidArgument; DeleteVolume (of a `delete`-policy id)
//! and ValidateVolumeCapabilities, whose id was made under another policy, with FailedPrecondition.
//!
//! With a Kubernetes API ([`ControllerService::with_pvcs`]) and csi-provisioner's PVC metadata in
//! the parameters, the PVC's `s3.csi.ferry.dev/existing-prefix` annotation binds the volume to an
//! existing dataset prefix instead of a fresh one, on a StorageClass that opts in with
//! `existingPrefix: allow` (see [`StorageClassParams::existing_prefix`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferry_creds::StaticKeys;
use ferry_csi::capability;
use ferry_csi::error::{quote, require, unimplemented, Result};
use ferry_csi::inflight::{InFlight, InFlightSet};
use ferry_csi::pb;
use ferry_csi::pb::controller_server::Controller;
use ferry_csi::stores::{StoreCredentials, Stores};
use ferry_csi::CsiError;
use ferry_store::{ObjectStore, StoreError};
use ferry_volume::keys;
use ferry_volume::spec::volume_context;
use ferry_volume::{DeletePolicy, StorageClassParams, VolumeId, VolumeSpec};

use crate::pvc::PvcAnnotations;
use tonic::{Request, Response, Status};
use tracing::{info, instrument};

/// What CreateVolume answered for a name, to tell a retry from a conflicting request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Created {
    volume_id: String,
    capacity: i64,
    /// The volume context answered: what the node mounts besides the id (credentials source,
    /// node cache, warm-up). Another context is another volume.
    volume_context: HashMap<String, String>,
}

/// The controller service. CreateVolume and DeleteVolume run in tasks of their own, so a caller
/// that gives up does not cancel a prefix deletion halfway (it is idempotent, but should finish).
#[derive(Clone)]
pub struct ControllerService {
    inner: Arc<Inner>,
}

struct Inner {
    stores: Arc<dyn Stores>,
    /// Volumes created by this process, by name. A restart forgets them, which only matters for
    /// a repeated name with other parameters: the new request then succeeds instead of failing.
    created: Mutex<HashMap<String, Created>>,
    /// Names and volume ids with an operation in flight: a concurrent one gets Aborted.
    in_flight: InFlightSet<String>,
    /// PVC annotations (the Kubernetes API), if the controller has one.
    pvcs: Option<Arc<dyn PvcAnnotations>>,
}

impl ControllerService {
    pub fn new(stores: Arc<dyn Stores>) -> Self {
        ControllerService {
            inner: Arc::new(Inner {
                stores,
                created: Mutex::new(HashMap::new()),
                in_flight: InFlightSet::default(),
                pvcs: None,
            }),
        }
    }

    /// Reads PVC annotations from `pvcs` when csi-provisioner names the PVC (call before serving).
    pub fn with_pvcs(mut self, pvcs: Arc<dyn PvcAnnotations>) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("with_pvcs is called before the service is cloned")
            .pvcs = Some(pvcs);
        self
    }
}

impl Inner {
    fn begin(&self, key: String) -> Result<InFlight<String>> {
        self.in_flight.begin(key)
    }

    /// The capacity to report: what was asked for, not enforced (S3 is elastic).
    fn capacity(range: Option<&pb::CapacityRange>) -> Result<i64> {
        let Some(r) = range else { return Ok(0) };
        if r.required_bytes < 0 || r.limit_bytes < 0 {
            return Err(CsiError::InvalidArgument(
                "capacity_range bytes must not be negative".to_string(),
            ));
        }
        if r.limit_bytes > 0 && r.required_bytes > r.limit_bytes {
            return Err(CsiError::OutOfRange(format!(
                "capacity_range required_bytes {} exceeds limit_bytes {}",
                r.required_bytes, r.limit_bytes
            )));
        }
        Ok(if r.required_bytes > 0 {
            r.required_bytes
        } else {
            r.limit_bytes
        })
    }

    /// Refuses a volume id whose endpoint the operator does not allow (any more): FailedPrecondition,
    /// since the id is well-formed and only the driver's configuration stands in the way.
    /// csi-provisioner retries DeleteVolume with backoff and records the message as an event on
    /// the PV, which stays Released until the endpoint is allowed or the PV is removed.
    fn permit_id(&self, id: &VolumeId) -> Result<()> {
        self.stores
            .permit(&id.endpoint)
            .map_err(|e| CsiError::FailedPrecondition(e.to_string()))
    }

    /// The store for a volume, signed with the request's Secret keys (the StorageClass's
    /// provisioner Secret) when it has them, else with the controller's own credentials.
    async fn store(
        &self,
        id: &VolumeId,
        secrets: &HashMap<String, String>,
    ) -> Result<(Arc<dyn ObjectStore>, String)> {
        let (creds, who) = match StaticKeys::from_secrets(secrets)? {
            Some(k) => {
                let who = format!("access key {} from the provisioner Secret", k.access_key_id);
                (StoreCredentials::Static(k), who)
            }
            None => (
                StoreCredentials::Driver,
                "the controller's credentials".to_string(),
            ),
        };
        let store = self
            .stores
            .get_as(&id.endpoint, &creds)
            .await
            .map_err(|e| CsiError::from_store("creating the S3 client", e))?;
        Ok((store, who))
    }

    async fn check_bucket(&self, id: &VolumeId, secrets: &HashMap<String, String>) -> Result<()> {
        let (store, who) = self.store(id, secrets).await?;

        match ferry_store::check_prefix_access(&*store, &id.bucket, &id.prefix).await {
            Ok(_) => Ok(()),
            Err(StoreError::NoSuchBucket(_)) => Err(CsiError::FailedPrecondition(format!(
                "bucket {:?} does not exist",
                id.bucket
            ))),
            Err(e) => Err(CsiError::from_store(
                &format!(
                    "checking bucket {:?} prefix {:?} (s3:ListBucket) as {who}",
                    id.bucket, id.prefix
                ),
                e,
            )),
        }
    }

    /// The prefix named by the PVC's existing-prefix annotation, if there is a Kubernetes API,
    /// csi-provisioner named the PVC, and the PVC carries the annotation.
    async fn existing_prefix(
        &self,
        params: &StorageClassParams,
        parameters: &HashMap<String, String>,
    ) -> Result<Option<String>> {
        let Some(pvcs) = &self.pvcs else {
            return Ok(None);
        };
        let (Some(ns), Some(pvc)) = (
            parameters.get(keys::PVC_NAMESPACE),
            parameters.get(keys::PVC_NAME),
        ) else {
            return Ok(None);
        };
        let annotations = pvcs.annotations(ns, pvc).await?;
        let Some(value) = annotations.get(keys::EXISTING_PREFIX_ANNOTATION) else {
            return Ok(None);
        };
        let prefix = params
            .existing_prefix(value)
            .map_err(|e| CsiError::InvalidArgument(format!("PVC {ns}/{pvc}: {e}")))?;
        info!(pvc = %format!("{ns}/{pvc}"), prefix, "binding to an existing prefix");
        Ok(Some(prefix))
    }

    #[instrument(skip_all, fields(name = %req.name))]
    async fn create(&self, req: pb::CreateVolumeRequest) -> Result<pb::CreateVolumeResponse> {
        let name = require("name", &req.name)?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::InvalidArgument(
                "volume_capabilities are required".to_string(),
            ));
        }
        for cap in &req.volume_capabilities {
            capability::check(cap)?;
        }
        if req.volume_content_source.is_some() {
            return Err(CsiError::InvalidArgument(
                "volume_content_source is not supported: Ferry volumes cannot be cloned or restored from snapshots"
                    .to_string(),
            ));
        }
        let capacity = Self::capacity(req.capacity_range.as_ref())?;
        let params = StorageClassParams::parse(&req.parameters)?;
        self.stores.permit(&params.endpoint)?;
        let prefix = match self.existing_prefix(&params, &req.parameters).await? {
            Some(existing) => existing,
            None => params.volume_prefix(name, &req.parameters)?,
        };
        let id = VolumeId {
            bucket: params.bucket.clone(),
            prefix,
            endpoint: params.endpoint.clone(),
            delete_policy: params.delete_policy,
        };
        let mut want = Created {
            volume_id: id.encode(),
            capacity,
            volume_context: {
                let mut ctx = volume_context(&id);
                ctx.extend(params.node_context());
                ctx
            },
        };
        let _guard = self.begin(name.to_string())?;
        if let Some(prev) = self.created.lock().unwrap().get(name) {
            // The spec: the same name again is OK when the volume is compatible with the request,
            // its capacity within the range asked for (or any, with no range).
            let fits = req.capacity_range.as_ref().is_none_or(|r| {
                prev.capacity >= r.required_bytes
                    && (r.limit_bytes == 0 || prev.capacity <= r.limit_bytes)
            });
            if prev.volume_id == want.volume_id && fits {
                want.capacity = prev.capacity;
            }
            if (&prev.volume_id, prev.capacity) != (&want.volume_id, want.capacity) {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {} already exists as {} with capacity {}, not {} with capacity {}",
                    quote(name),
                    quote(&prev.volume_id),
                    prev.capacity,
                    quote(&want.volume_id),
                    want.capacity
                )));
            }
            if prev.volume_context != want.volume_context {
                let differ = |a: &HashMap<String, String>, b: &HashMap<String, String>| {
                    let mut keys: Vec<&str> = a
                        .iter()
                        .filter(|(k, v)| b.get(*k) != Some(*v))
                        .map(|(k, _)| k.as_str())
                        .collect();
                    keys.extend(b.keys().filter(|k| !a.contains_key(*k)).map(String::as_str));
                    keys.sort_unstable();
                    keys.join(", ")
                };
                return Err(CsiError::AlreadyExists(format!(
                    "volume {} already exists as {} with other parameters (they differ in {})",
                    quote(name),
                    quote(&prev.volume_id),
                    differ(&prev.volume_context, &want.volume_context)
                )));
            }
        }
        self.check_bucket(&id, &req.secrets).await?;
        self.created
            .lock()
            .unwrap()
            .insert(name.to_string(), want.clone());
        info!(volume_id = %want.volume_id, "volume created");
        Ok(pb::CreateVolumeResponse {
            volume: Some(pb::Volume {
                capacity_bytes: want.capacity,
                volume_id: want.volume_id,
                volume_context: want.volume_context,
                content_source: None,
                accessible_topology: vec![],
            }),
        })
    }

    #[instrument(skip_all, fields(volume_id = %req.volume_id))]
    async fn delete(&self, req: pb::DeleteVolumeRequest) -> Result<pb::DeleteVolumeResponse> {
        let volume_id = require("volume_id", &req.volume_id)?;
        let id = match VolumeId::parse(volume_id) {
            Ok(id) => id,
            Err(e) => {
                // Not an id Ferry made, so there is nothing of ours to delete: the spec says OK.
                info!(error = %e, "not a Ferry volume id; nothing to delete");
                return Ok(pb::DeleteVolumeResponse {});
            }
        };
        let _guard = self.begin(volume_id.to_string())?;
        self.created
            .lock()
            .unwrap()
            .retain(|_, c| c.volume_id != volume_id);
        if id.delete_policy == DeletePolicy::Retain {
            info!(bucket = %id.bucket, prefix = %id.prefix, "deletePolicy retain: data kept");
            return Ok(pb::DeleteVolumeResponse {});
        }
        self.permit_id(&id)?;
        let (store, _) = self.store(&id, &req.secrets).await?;
        match ferry_store::delete_prefix(store.as_ref(), &id.bucket, &id.prefix).await {
            Ok(n) => {
                info!(
                    bucket = %id.bucket,
                    prefix = %id.prefix,
                    objects = n.objects,
                    uploads_aborted = n.uploads,
                    "deletePolicy delete: prefix emptied"
                );
                Ok(pb::DeleteVolumeResponse {})
            }
            Err(StoreError::NoSuchBucket(_)) => Ok(pb::DeleteVolumeResponse {}),
            Err(e) => Err(CsiError::from_store(
                &format!("deleting s3://{}/{}", id.bucket, id.prefix),
                e,
            )),
        }
    }

    #[instrument(skip_all, fields(volume_id = %req.volume_id))]
    async fn validate(
        &self,
        req: pb::ValidateVolumeCapabilitiesRequest,
    ) -> Result<pb::ValidateVolumeCapabilitiesResponse> {
        let volume_id = require("volume_id", &req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::InvalidArgument(
                "volume_capabilities are required".to_string(),
            ));
        }
        // A capability without its access type or mode is a malformed request (the spec's
        // INVALID_ARGUMENT); a whole one Ferry cannot serve is answered "not confirmed" below.
        if let Some(i) = req
            .volume_capabilities
            .iter()
            .position(|c| c.access_type.is_none() || c.access_mode.is_none())
        {
            return Err(CsiError::InvalidArgument(format!(
                "volume_capabilities[{i}] needs both an access_type and an access_mode"
            )));
        }
        let id = VolumeId::parse(volume_id).map_err(|e| {
            CsiError::NotFound(format!("volume {} does not exist: {e}", quote(volume_id)))
        })?;
        self.permit_id(&id)?;
        match self.check_bucket(&id, &req.secrets).await {
            Err(CsiError::FailedPrecondition(m)) => return Err(CsiError::NotFound(m)),
            other => other?,
        }
        let not_confirmed = |message: String| {
            Ok(pb::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message,
            })
        };
        if !req.parameters.is_empty() {
            let params = StorageClassParams::parse(&req.parameters)?;
            if params.bucket != id.bucket || !id.prefix.starts_with(&params.base_prefix) {
                return not_confirmed(format!(
                    "the parameters' bucket {} and base prefix {} do not hold volume {}",
                    quote(&params.bucket),
                    quote(&params.base_prefix),
                    quote(volume_id)
                ));
            }
        }
        for cap in &req.volume_capabilities {
            if let Err(e) = capability::check(cap) {
                return not_confirmed(e.to_string());
            }
            // Echoed back as confirmed only once checked as NodePublishVolume would take it:
            // attributes it refuses, or another bucket or prefix than the id's, are not this volume.
            if req.volume_context.is_empty() {
                continue;
            }
            let spec =
                match VolumeSpec::from_publish(&req.volume_context, capability::mount_flags(cap)) {
                    Ok(spec) => spec,
                    Err(e) => return not_confirmed(format!("volume_context: {e}")),
                };
            if spec.bucket != id.bucket || spec.prefix != id.prefix {
                return not_confirmed(format!(
                    "volume_context names bucket {} prefix {}, volume {} is bucket {} prefix {}",
                    quote(&spec.bucket),
                    quote(&spec.prefix),
                    quote(volume_id),
                    quote(&id.bucket),
                    quote(&id.prefix)
                ));
            }
        }
        Ok(pb::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(pb::validate_volume_capabilities_response::Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: Default::default(),
            }),
            message: String::new(),
        })
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        let inner = self.inner.clone();
        let req = request.into_inner();
        let res = tokio::spawn(async move { inner.create(req).await })
            .await
            .map_err(|e| Status::internal(format!("CreateVolume task failed: {e}")))?;
        Ok(Response::new(res?))
    }

    async fn delete_volume(
        &self,
        request: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let inner = self.inner.clone();
        let req = request.into_inner();
        let res = tokio::spawn(async move { inner.delete(req).await })
            .await
            .map_err(|e| Status::internal(format!("DeleteVolume task failed: {e}")))?;
        Ok(Response::new(res?))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<pb::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<pb::ValidateVolumeCapabilitiesResponse>, Status> {
        Ok(Response::new(
            self.inner.validate(request.into_inner()).await?,
        ))
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<pb::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::ControllerGetCapabilitiesResponse>, Status> {
        use pb::controller_service_capability::{rpc::Type, Rpc, Type as CapType};
        Ok(Response::new(pb::ControllerGetCapabilitiesResponse {
            capabilities: vec![pb::ControllerServiceCapability {
                r#type: Some(CapType::Rpc(Rpc {
                    r#type: Type::CreateDeleteVolume as i32,
                })),
            }],
        }))
    }

    async fn controller_publish_volume(
        &self,
        _r: Request<pb::ControllerPublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerPublishVolumeResponse>, Status> {
        unimplemented("ControllerPublishVolume")
    }

    async fn controller_unpublish_volume(
        &self,
        _r: Request<pb::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerUnpublishVolumeResponse>, Status> {
        unimplemented("ControllerUnpublishVolume")
    }

    async fn list_volumes(
        &self,
        _r: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        unimplemented("ListVolumes")
    }

    async fn get_capacity(
        &self,
        _r: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::GetCapacityResponse>, Status> {
        unimplemented("GetCapacity")
    }

    async fn create_snapshot(
        &self,
        _r: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::CreateSnapshotResponse>, Status> {
        unimplemented("CreateSnapshot")
    }

    async fn delete_snapshot(
        &self,
        _r: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        unimplemented("DeleteSnapshot")
    }

    async fn list_snapshots(
        &self,
        _r: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        unimplemented("ListSnapshots")
    }

    async fn controller_expand_volume(
        &self,
        _r: Request<pb::ControllerExpandVolumeRequest>,
    ) -> Result<Response<pb::ControllerExpandVolumeResponse>, Status> {
        unimplemented("ControllerExpandVolume")
    }

    async fn controller_get_volume(
        &self,
        _r: Request<pb::ControllerGetVolumeRequest>,
    ) -> Result<Response<pb::ControllerGetVolumeResponse>, Status> {
        unimplemented("ControllerGetVolume")
    }

    async fn controller_modify_volume(
        &self,
        _r: Request<pb::ControllerModifyVolumeRequest>,
    ) -> Result<Response<pb::ControllerModifyVolumeResponse>, Status> {
        unimplemented("ControllerModifyVolume")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_csi::stores::FixedStore;
    use ferry_store::MemoryStore;
    use pb::volume_capability::access_mode::Mode;
    use pb::volume_capability::{AccessMode, AccessType, MountVolume};
    use std::collections::BTreeMap;

    fn service() -> (Arc<Inner>, Arc<MemoryStore>) {
        let mem = Arc::new(MemoryStore::new());
        mem.create_bucket("data");
        let svc = ControllerService::new(Arc::new(FixedStore(mem.clone())));
        (svc.inner, mem)
    }

    fn cap(mode: Mode) -> pb::VolumeCapability {
        pb::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    fn create_req(name: &str, params: &[(&str, &str)]) -> pb::CreateVolumeRequest {
        pb::CreateVolumeRequest {
            name: name.into(),
            parameters: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            volume_capabilities: vec![cap(Mode::MultiNodeReaderOnly)],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn existing_prefix_annotation_binds_a_dataset_or_is_refused_clearly() {
        let mem = Arc::new(MemoryStore::new());
        mem.create_bucket("data");
        let pvcs: BTreeMap<(String, String), BTreeMap<String, String>> = [
            ("imagenet", "datasets/imagenet/train/"),
            ("outside", "other/imagenet/"),
            ("plain", ""),
        ]
        .into_iter()
        .map(|(name, prefix)| {
            let mut a = BTreeMap::new();
            if !prefix.is_empty() {
                a.insert(
                    keys::EXISTING_PREFIX_ANNOTATION.to_string(),
                    prefix.to_string(),
                );
            }
            (("ml".to_string(), name.to_string()), a)
        })
        .collect();
        let svc = ControllerService::new(Arc::new(FixedStore(mem.clone())))
            .with_pvcs(Arc::new(pvcs))
            .inner;
        let req = |pvc: &str, policy: &str| {
            create_req(
                &format!("pvc-{pvc}-{policy}"),
                &[
                    ("bucketName", "data"),
                    ("basePrefix", "datasets"),
                    ("prefixTemplate", "${pvc.namespace}/${volume.name}"),
                    ("deletePolicy", policy),
                    ("existingPrefix", "allow"),
                    ("csi.storage.k8s.io/pvc/namespace", "ml"),
                    ("csi.storage.k8s.io/pvc/name", pvc),
                ],
            )
        };
        let vol = svc
            .create(req("imagenet", "retain"))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(vol.volume_context["prefix"], "datasets/imagenet/train/");
        // No annotation: the template as usual.
        let vol = svc
            .create(req("plain", "delete"))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(
            vol.volume_context["prefix"],
            "datasets/ml/pvc-plain-delete/"
        );

        for (pvc, policy, why) in [
            (
                "outside",
                "retain",
                "is not below the StorageClass's basePrefix \"datasets/\"",
            ),
            ("imagenet", "delete", "deletePolicy: delete"),
        ] {
            let st = Status::from(svc.create(req(pvc, policy)).await.unwrap_err());
            assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
            let msg = st.message();
            assert!(msg.contains(&format!("PVC ml/{pvc}")), "{msg}");
            assert!(msg.contains(keys::EXISTING_PREFIX_ANNOTATION), "{msg}");
            assert!(msg.contains(why), "{msg}");
        }
        // A PVC that is gone: NotFound, naming it.
        let st = Status::from(svc.create(req("gone", "retain")).await.unwrap_err());
        assert_eq!(st.code(), tonic::Code::NotFound, "{st:?}");
        assert!(st.message().contains("ml/gone"), "{st:?}");
    }

    /// A PVC in namespace `b` annotated with namespace `a`'s dynamic volume prefix (below the
    /// class's basePrefix, as the template puts it) was bound to it on any retain class: a
    /// tenant read and wrote another's data with the driver's credentials. Now the class must opt
    /// in with `existingPrefix: allow`; without it CreateVolume is InvalidArgument naming the
    /// PVC, the annotation and the parameter.
    #[tokio::test]
    async fn existing_prefix_annotation_needs_the_class_to_opt_in() {
        let mem = Arc::new(MemoryStore::new());
        mem.create_bucket("data");
        let mut thief = BTreeMap::new();
        thief.insert(
            keys::EXISTING_PREFIX_ANNOTATION.to_string(),
            "k8s/a/pvc-1/".to_string(),
        );
        let pvcs: BTreeMap<(String, String), BTreeMap<String, String>> =
            [(("b".to_string(), "thief".to_string()), thief)]
                .into_iter()
                .collect();
        let svc = ControllerService::new(Arc::new(FixedStore(mem.clone())))
            .with_pvcs(Arc::new(pvcs))
            .inner;
        let req = |name: &str, opt_in: Option<&str>| {
            let mut params = vec![
                ("bucketName", "data"),
                ("basePrefix", "k8s"),
                ("prefixTemplate", "${pvc.namespace}/${volume.name}"),
                ("csi.storage.k8s.io/pvc/namespace", "b"),
                ("csi.storage.k8s.io/pvc/name", "thief"),
            ];
            if let Some(v) = opt_in {
                params.push(("existingPrefix", v));
            }
            create_req(name, &params)
        };
        for (name, opt_in) in [("pvc-2", None), ("pvc-3", Some("deny"))] {
            let st = Status::from(svc.create(req(name, opt_in)).await.unwrap_err());
            assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
            let msg = st.message();
            assert!(msg.contains("PVC b/thief"), "{msg}");
            assert!(msg.contains(keys::EXISTING_PREFIX_ANNOTATION), "{msg}");
            assert!(msg.contains("existingPrefix: allow"), "{msg}");
        }
        let st = Status::from(svc.create(req("pvc-4", Some("on"))).await.unwrap_err());
        assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
        assert!(st.message().contains("\"existingPrefix\""), "{st:?}");
        assert!(st.message().contains("\"on\""), "{st:?}");
        // Opted in, the class binds it; the parameter stays the controller's.
        let vol = svc
            .create(req("pvc-5", Some("allow")))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(vol.volume_context["prefix"], "k8s/a/pvc-1/");
        assert!(
            !vol.volume_context.contains_key("existingPrefix"),
            "{:?}",
            vol.volume_context
        );
    }

    #[tokio::test]
    async fn delete_policy_delete_empties_only_the_prefix() {
        let (svc, mem) = service();
        let vol = svc
            .create(create_req(
                "imagenet",
                &[
                    ("bucketName", "data"),
                    ("prefixTemplate", "${pvc.namespace}/${volume.name}"),
                    ("deletePolicy", "delete"),
                    ("csi.storage.k8s.io/pvc/namespace", "ml"),
                    ("csi.storage.k8s.io/pvc/name", "imagenet"),
                ],
            ))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(vol.volume_context["prefix"], "ml/imagenet/");
        for i in 0..2500 {
            mem.insert("data", &format!("ml/imagenet/{i}"), "x");
        }
        mem.insert("data", "ml/imagenet2/keep", "x");
        mem.insert("data", "ml/keep", "x");
        // Multipart uploads a node left in progress (a crash, a pod killed mid-write): those
        // under the prefix go with the volume, the sibling volume's stays.
        for key in ["ml/imagenet/big", "ml/imagenet/big", "ml/imagenet/sub/big"] {
            let id = mem.create_multipart("data", key).await.unwrap();
            mem.upload_part("data", key, &id, 1, "part".into())
                .await
                .unwrap();
        }
        let kept = mem
            .create_multipart("data", "ml/imagenet2/big")
            .await
            .unwrap();
        svc.delete(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            secrets: Default::default(),
        })
        .await
        .unwrap();
        assert_eq!(mem.keys("data"), ["ml/imagenet2/keep", "ml/keep"]);
        assert_eq!(
            mem.uploads("data"),
            [("ml/imagenet2/big".to_string(), kept)],
            "no upload left under the prefix, none outside it aborted"
        );
    }

    /// A volume name with a `/` (csi-provisioner's never has one; other COs, csi-sanity or a
    /// hand-made request may send any string) made prefixes that nest or coincide: `team/` and
    /// `team/x/`, or `team` and `team/` both `team/`. With `deletePolicy: delete`, deleting one
    /// volume deleted the other's data.
    #[tokio::test]
    async fn delete_policy_volumes_never_nest_or_share_a_prefix() {
        let (svc, mem) = service();
        let params = [("bucketName", "data"), ("deletePolicy", "delete")];
        let team = svc
            .create(create_req("team", &params))
            .await
            .unwrap()
            .volume
            .unwrap();
        mem.insert("data", "team/mine", "x");
        let mut kept = Vec::new();
        for name in ["team/", "team/x", "team/x/"] {
            match svc.create(create_req(name, &params)).await {
                Ok(v) => {
                    let key = format!("{}theirs", v.volume.unwrap().volume_context["prefix"]);
                    mem.insert("data", &key, "x");
                    kept.push(key);
                }
                Err(e) => {
                    let st = Status::from(e);
                    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{name}: {st:?}");
                    assert!(
                        st.message().contains(&quote(name).to_string()),
                        "{name}: {st:?}"
                    );
                }
            }
        }
        svc.delete(pb::DeleteVolumeRequest {
            volume_id: team.volume_id,
            secrets: Default::default(),
        })
        .await
        .unwrap();
        kept.sort();
        kept.dedup();
        assert_eq!(
            mem.keys("data"),
            kept,
            "deleting volume \"team\" deleted another volume's data"
        );
    }

    /// The same name with parameters that change the volume the node mounts (its volume context:
    /// `authenticationSource`, `stsRegion`, `cache`, `prefetchOnMount`) is another volume:
    /// AlreadyExists, as for another prefix or capacity (README: "The same volume name asked
    /// again with other parameters is `AlreadyExists`"). It was OK, answering the new context.
    #[tokio::test]
    async fn same_name_with_another_volume_context_is_already_exists() {
        let (svc, _mem) = service();
        let first = svc
            .create(create_req("v5", &[("bucketName", "data")]))
            .await
            .unwrap()
            .volume
            .unwrap();
        for other in [
            [("bucketName", "data"), ("authenticationSource", "pod")],
            [("bucketName", "data"), ("cache", "none")],
            [("bucketName", "data"), ("prefetchOnMount", "true")],
        ] {
            let res = svc.create(create_req("v5", &other)).await;
            let st = Status::from(res.map(|r| r.volume.unwrap().volume_context).unwrap_err());
            assert_eq!(st.code(), tonic::Code::AlreadyExists, "{other:?}: {st:?}");
            assert!(st.message().contains("\"v5\""), "{st:?}");
            assert!(st.message().contains(other[1].0), "{st:?}");
        }
        // A retry of the first request is still served.
        let again = svc
            .create(create_req("v5", &[("bucketName", "data")]))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(again, first);
    }

    #[tokio::test]
    async fn retain_keeps_and_unknown_ids_are_ok() {
        let (svc, mem) = service();
        let vol = svc
            .create(create_req("v2", &[("bucketName", "data")]))
            .await
            .unwrap()
            .volume
            .unwrap();
        mem.insert("data", "v2/a", "x");
        svc.delete(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id,
            secrets: Default::default(),
        })
        .await
        .unwrap();
        assert_eq!(mem.keys("data"), ["v2/a"]);
        svc.delete(pb::DeleteVolumeRequest {
            volume_id: "not-ours".into(),
            secrets: Default::default(),
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn validate_and_conflicts() {
        let (svc, _mem) = service();
        let vol = svc
            .create(create_req("v3", &[("bucketName", "data")]))
            .await
            .unwrap()
            .volume
            .unwrap();
        let ok = svc
            .validate(pb::ValidateVolumeCapabilitiesRequest {
                volume_id: vol.volume_id.clone(),
                volume_capabilities: vec![cap(Mode::SingleNodeWriter)],
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(ok.confirmed.is_some());
        let refused = svc
            .validate(pb::ValidateVolumeCapabilitiesRequest {
                volume_id: vol.volume_id.clone(),
                volume_capabilities: vec![cap(Mode::MultiNodeSingleWriter)],
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(
            refused.confirmed.is_none() && refused.message.contains("MULTI_NODE_SINGLE_WRITER")
        );
        // The volume context and parameters are confirmed only once checked: the context as
        // NodePublishVolume would take it, and naming this volume's bucket and prefix; the
        // parameters holding it. Anything else is "not confirmed", with the reason.
        let validate_with = |context: &[(&str, &str)], parameters: &[(&str, &str)]| {
            let own = |kv: &[(&str, &str)]| -> HashMap<String, String> {
                kv.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            };
            svc.validate(pb::ValidateVolumeCapabilitiesRequest {
                volume_id: vol.volume_id.clone(),
                volume_capabilities: vec![cap(Mode::SingleNodeWriter)],
                volume_context: own(context),
                parameters: own(parameters),
                ..Default::default()
            })
        };
        let echoed = validate_with(
            &[("bucketName", "data"), ("prefix", "v3/")],
            &[("bucketName", "data")],
        )
        .await
        .unwrap();
        assert_eq!(
            echoed.confirmed.unwrap().volume_context["prefix"],
            "v3/",
            "{}",
            echoed.message
        );
        for (context, parameters, why) in [
            (
                &[("colour", "blue")][..],
                &[][..],
                "unknown volume attribute",
            ),
            (
                &[("bucketName", "bkt2"), ("prefix", "zzz/")],
                &[],
                "volume_context names bucket",
            ),
            (
                &[("bucketName", "data")],
                &[],
                "volume_context names bucket",
            ),
            (&[], &[("bucketName", "bkt2")], "do not hold volume"),
            (
                &[],
                &[("bucketName", "data"), ("basePrefix", "elsewhere/")],
                "do not hold volume",
            ),
        ] {
            let r = validate_with(context, parameters).await.unwrap();
            assert!(r.confirmed.is_none(), "{context:?} {parameters:?}");
            assert!(r.message.contains(why), "{why:?} in {}", r.message);
        }
        // A capability missing its access mode or type is a malformed request, not "not
        // confirmed".
        let mut no_mode = cap(Mode::SingleNodeWriter);
        no_mode.access_mode = None;
        let mut no_type = cap(Mode::SingleNodeWriter);
        no_type.access_type = None;
        for bad in [no_mode, no_type] {
            let e = svc
                .validate(pb::ValidateVolumeCapabilitiesRequest {
                    volume_id: vol.volume_id.clone(),
                    volume_capabilities: vec![cap(Mode::SingleNodeWriter), bad],
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert!(
                matches!(&e, CsiError::InvalidArgument(m) if m.contains("volume_capabilities[1]")),
                "{e:?}"
            );
        }
        let e = svc
            .validate(pb::ValidateVolumeCapabilitiesRequest {
                volume_id: "data/missing-bucket-volume".into(),
                volume_capabilities: vec![cap(Mode::SingleNodeWriter)],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(matches!(e, CsiError::NotFound(_)), "{e:?}");
        let mut other = create_req("v3", &[("bucketName", "data")]);
        other.capacity_range = Some(pb::CapacityRange {
            required_bytes: 5,
            limit_bytes: 0,
        });
        assert!(matches!(
            svc.create(other).await.unwrap_err(),
            CsiError::AlreadyExists(_)
        ));
        // A capacity range the volume fits, or none: the same volume, OK (the spec's idempotency).
        let sized = |required, limit| {
            let mut r = create_req("v5", &[("bucketName", "data")]);
            r.capacity_range = Some(pb::CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            });
            r
        };
        let first = svc
            .create(sized(10 << 30, 0))
            .await
            .unwrap()
            .volume
            .unwrap();
        for again in [
            sized(1 << 30, 0),
            sized(0, 20 << 30),
            create_req("v5", &[("bucketName", "data")]),
        ] {
            let v = svc.create(again).await.unwrap().volume.unwrap();
            assert_eq!(
                (v.volume_id, v.capacity_bytes),
                (first.volume_id.clone(), 10 << 30)
            );
        }
        assert!(matches!(
            svc.create(sized(0, 5 << 30)).await.unwrap_err(),
            CsiError::AlreadyExists(_)
        ));
        let mut bad_range = create_req("v4", &[("bucketName", "data")]);
        bad_range.capacity_range = Some(pb::CapacityRange {
            required_bytes: 10,
            limit_bytes: 5,
        });
        assert!(matches!(
            svc.create(bad_range).await.unwrap_err(),
            CsiError::OutOfRange(_)
        ));
    }
}
