//! The table of live mounts: target path -> what is mounted there and its FUSE session.
//!
//! Every mount is an in-process FUSE session of its own (its own kernel connection and thread), so
//! one mount failing does not touch the others. The table is plain data (the published request, the
//! mount config) beside each session handle.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ferry_fs::{MountConfig, MountHandle};
use ferry_volume::VolumeSpec;

use crate::warm::MountWarmUp;

/// What a NodePublishVolume asked for; a repeat with the same key is idempotent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub volume_id: String,
    pub spec: VolumeSpec,
    pub read_only: bool,
    pub mount_group: Option<u32>,
    /// Who the mount acts as (no secret in it).
    pub credentials: MountCredentials,
}

/// Whose credentials a live mount signs with: plain data without secrets, compared on republish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountCredentials {
    /// The node plugin's own.
    Driver,
    /// Keys from the node-publish Secret (the access key id is an identifier, not a secret).
    Static { access_key_id: String },
    /// The pod's identity.
    Pod(ferry_creds::Identity),
}

impl std::fmt::Display for MountCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MountCredentials::Driver => f.write_str("the node plugin's credentials"),
            MountCredentials::Static { access_key_id } => {
                write!(f, "access key {access_key_id} from the volume's Secret")
            }
            MountCredentials::Pod(id) => write!(f, "{id}"),
        }
    }
}

/// One live mount.
pub struct Mounted {
    pub published: Published,
    pub config: MountConfig,
    pub handle: MountHandle,
    /// The NodePublishVolume request (protobuf, secrets included) it was made or last
    /// republished with: what a successor process rebuilds its credentials from. Memory only.
    pub request: Vec<u8>,
    /// The memfd its journal is written to (with a descriptor holder; see `crate::keeper`).
    pub journal: Option<std::fs::File>,
    /// The warm-up it asked for (`prefetchOnMount` with the node cache on), run by one of the
    /// mounts that asked for it.
    pub warm_up: Option<MountWarmUp>,
}

impl Mounted {
    /// Whether the warm-up this mount asked for finished (in this process or its predecessor).
    pub fn warmed(&self) -> bool {
        self.warm_up.as_ref().is_some_and(|w| w.finished())
    }
}

fn mounts_gauge() -> &'static ferry_metrics::Gauge {
    &ferry_metrics::metrics().node.mounts
}

/// Live mounts by target path.
#[derive(Default)]
pub struct MountTable {
    mounts: Mutex<HashMap<PathBuf, Mounted>>,
}

impl MountTable {
    pub fn get(&self, target: &Path) -> Option<Published> {
        self.mounts
            .lock()
            .unwrap()
            .get(target)
            .map(|m| m.published.clone())
    }

    /// Whether the warm-up the mount at `target` asked for finished (`false` without one).
    pub fn warmed(&self, target: &Path) -> bool {
        self.mounts
            .lock()
            .unwrap()
            .get(target)
            .is_some_and(Mounted::warmed)
    }

    /// Whether the mount at `target` started the warm-up it asked for (it may have ended since).
    pub fn started_warm_up(&self, target: &Path) -> bool {
        self.mounts
            .lock()
            .unwrap()
            .get(target)
            .is_some_and(|m| m.warm_up.as_ref().is_some_and(MountWarmUp::started))
    }

    /// Whether the recorded mount at `target` is still the one on top there (`false` when none is
    /// recorded, or it was unmounted behind our back).
    pub fn is_live(&self, target: &Path) -> std::io::Result<bool> {
        match self.mounts.lock().unwrap().get(target) {
            Some(m) => m.handle.is_mounted(),
            None => Ok(false),
        }
    }

    /// Adds a live mount and starts the warm-up it asks for unless another mount runs it or it
    /// was run; `f` runs on the mount then (under the table's lock, so it sees whether the
    /// warm-up finished as [`MountTable::each_warming`] does).
    pub fn insert(&self, target: PathBuf, mut m: Mounted, f: impl FnOnce(&Mounted)) {
        let mut mounts = self.mounts.lock().unwrap();
        if let Some(w) = m.warm_up.as_mut() {
            w.start();
        }
        f(&m);
        mounts.insert(target, m);
        mounts_gauge().set(mounts.len() as i64);
    }

    /// Takes a mount out of the table; a warm-up it runs is stopped and handed to another mount
    /// of the same warm-up, or let go ([`crate::warm::hand_over`]).
    pub fn remove(&self, target: &Path) -> Option<Mounted> {
        let mut mounts = self.mounts.lock().unwrap();
        let mut m = mounts.remove(target);
        if let Some(m) = m.as_mut() {
            crate::warm::hand_over(m, &mut mounts);
        }
        mounts_gauge().set(mounts.len() as i64);
        m
    }

    /// The table's key for the mount a publish asked for at `target_path` (the path as the
    /// request spelled it, before symlinks in its parent were resolved): what an unpublish finds
    /// its mount by once that parent is gone and the path no longer resolves.
    pub fn published_at(&self, target_path: &str) -> Option<PathBuf> {
        self.mounts.lock().unwrap().iter().find_map(|(key, m)| {
            let req: ferry_csi::pb::NodePublishVolumeRequest =
                prost::Message::decode(&m.request[..]).ok()?;
            (req.target_path == target_path).then(|| key.clone())
        })
    }

    pub fn len(&self) -> usize {
        self.mounts.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Targets and volume ids, for logs.
    pub fn list(&self) -> Vec<(PathBuf, String)> {
        self.mounts
            .lock()
            .unwrap()
            .iter()
            .map(|(t, m)| (t.clone(), m.published.volume_id.clone()))
            .collect()
    }

    /// Records the newest request a live mount was republished with (a pod's renewed token);
    /// `f` runs on the mount afterwards (under the table's lock).
    pub fn set_request(&self, target: &Path, request: Vec<u8>, f: impl FnOnce(&Mounted)) {
        if let Some(m) = self.mounts.lock().unwrap().get_mut(target) {
            m.request = request;
            f(m);
        }
    }

    /// Runs `f` on every live mount that asked for the warm-up `id` (under the table's lock).
    pub fn each_warming(&self, id: &str, mut f: impl FnMut(&Mounted)) {
        for m in self.mounts.lock().unwrap().values() {
            if m.warm_up.as_ref().is_some_and(|w| w.id() == id) {
                f(m);
            }
        }
    }

    /// Runs `f` on every mount (for a handover).
    pub fn with_all<R>(&self, f: impl FnOnce(&mut HashMap<PathBuf, Mounted>) -> R) -> R {
        f(&mut self.mounts.lock().unwrap())
    }

    /// Takes every mount out of the table (for shutdown).
    pub fn drain(&self) -> Vec<(PathBuf, Mounted)> {
        self.mounts.lock().unwrap().drain().collect()
    }
}
