//! Volume warm-ups (`prefetchOnMount`) as the node plugin runs them: one per (endpoint, bucket,
//! prefixes) in the process, run by one of the live mounts that asked for it, with that mount's
//! store and identity.
//!
//! A warm-up fetches with the credentials of the mount that runs it, so it ends with that mount:
//! when the mount is unpublished before the warm-up is done, the warm-up is stopped and handed to
//! another live mount that asked for the same warm-up (with that mount's credentials), or, when
//! there is none, its claim is let go so that the next publish of the volume starts it again. A
//! warm-up that fails lets its claim go too.
//! Blocks it already stored stay in the cache and are not fetched again.
//!
//! A warm-up that finished keeps its claim for the process's life, and is not run again by a
//! successor that takes the mounts over (an upgrade, or crash recovery through the descriptor
//! holder): each mount's record says whether its warm-up finished ([`MountWarmUp::finished`]),
//! and when one finishes the mounts that asked for it are deposited with the holder again
//! ([`MountWarmUp::on_finish`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ferry_cache::BlockCache;
use ferry_fs::{Proofs, WarmUp};
use ferry_store::ObjectStore;
use tokio::runtime::Handle;
use tokio::task::AbortHandle;
use tracing::{info, warn};

use crate::mounts::Mounted;

/// A mount's warm-up: what it warms, with what, and the task when this mount runs it.
pub struct MountWarmUp {
    store: Arc<dyn ObjectStore>,
    proofs: Arc<Proofs>,
    cache: Arc<BlockCache>,
    warm: WarmUp,
    /// Where its task runs: it may be started off the runtime (a handover called off puts its
    /// mounts back on the handover thread, and a claim a failed warm-up let go is taken there).
    runtime: Handle,
    task: Option<Running>,
    /// The process this one took the mount over from had finished this warm-up.
    finished_before: bool,
    /// Runs (off the runtime's workers) with the warm-up's id once it finished.
    on_finish: Option<OnFinish>,
}

/// What runs once a warm-up finished, with its id.
pub type OnFinish = Arc<dyn Fn(&str) + Send + Sync>;

/// A warm-up task this mount runs.
struct Running {
    task: AbortHandle,
    /// Set by whichever comes first: the task as it ends, or [`MountWarmUp::stop`]. The other
    /// leaves the warm-up as it is (counted once; a warm-up that has ended is not stopped).
    settled: Arc<AtomicBool>,
}

impl MountWarmUp {
    /// The warm-up of a mount of `store` (its reads prove access with `proofs`), run on `runtime`.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        proofs: Arc<Proofs>,
        cache: Arc<BlockCache>,
        warm: WarmUp,
        runtime: Handle,
    ) -> Self {
        MountWarmUp {
            store,
            proofs,
            cache,
            warm,
            runtime,
            task: None,
            finished_before: false,
            on_finish: None,
        }
    }

    /// `f` runs (off the runtime's workers) with the warm-up's id once this mount finished it.
    pub fn on_finish(mut self, f: OnFinish) -> Self {
        self.on_finish = Some(f);
        self
    }

    /// A mount taken over from a process that had (`true`) or had not finished this warm-up: one
    /// finished is not started again, its claim is held as that process held it.
    pub fn taken_over(mut self, finished: bool) -> Self {
        self.finished_before = finished;
        self
    }

    /// Whether this warm-up finished in this process (or the one it took the mounts over from).
    pub fn finished(&self) -> bool {
        self.cache.finished(&self.warm.id())
    }

    /// The warm-up's id ([`WarmUp::id`]).
    pub fn id(&self) -> String {
        self.warm.id()
    }

    /// Starts the warm-up unless this process already ran it or runs it for another mount.
    pub fn start(&mut self) {
        if self.task.is_some() {
            return;
        }
        if self.finished_before && self.cache.claim_finished(&self.warm.id()) {
            info!(bucket = %self.warm.bucket, prefixes = ?self.warm.prefixes, "warm-up finished by the previous node plugin process; not repeated");
            return;
        }
        if !self.cache.claim(&self.warm.id()) {
            info!(bucket = %self.warm.bucket, prefixes = ?self.warm.prefixes, "warm-up already running or run on this node; not repeated");
            return;
        }
        info!(bucket = %self.warm.bucket, prefixes = ?self.warm.prefixes, "warm-up started");
        self.run();
    }

    /// Runs the warm-up this process has claimed.
    fn run(&mut self) {
        let (store, proofs, cache, w, on_finish) = (
            self.store.clone(),
            self.proofs.clone(),
            self.cache.clone(),
            self.warm.clone(),
            self.on_finish.clone(),
        );
        let settled = Arc::new(AtomicBool::new(false));
        let ended = settled.clone();
        let task = self.runtime.spawn(async move {
            let (bucket, prefixes, id) = (w.bucket.clone(), w.prefixes.clone(), w.id());
            let res = ferry_fs::warm_up_as(store, proofs, cache.clone(), w).await;
            if ended.swap(true, Ordering::SeqCst) {
                // Stopped as it ended: `stop` counted it (and let its claim go or handed it on).
                return;
            }
            match res {
                Ok(r) => {
                    cache.finish(&id);
                    ferry_cache::warmup_done(if r.truncated { "truncated" } else { "ok" });
                    info!(%bucket, ?prefixes, objects = r.objects, fetched_blocks = r.fetched, cached_blocks = r.cached, bytes = r.bytes, truncated = r.truncated, denied_objects = r.denied, "warm-up done");
                    if let Some(f) = on_finish {
                        // It deposits with the descriptor holder (blocking I/O).
                        let _ = tokio::task::spawn_blocking(move || f(&id)).await;
                    }
                }
                Err(e) => {
                    // It did not warm the volume: the next publish of it starts it again (maybe
                    // with other credentials, or the error gone), as after one stopped.
                    cache.unclaim(&id);
                    ferry_cache::warmup_done("error");
                    warn!(%bucket, ?prefixes, error = %e, "warm-up failed; the next publish of the volume starts it again");
                }
            }
        });
        self.task = Some(Running {
            task: task.abort_handle(),
            settled,
        });
    }

    /// Stops the warm-up if this mount runs it and it is not done; `true` if it was stopped.
    fn stop(&mut self) -> bool {
        match self.task.take() {
            // Not once the task has ended (done and counted), even if it has not returned yet.
            Some(t) if !t.settled.swap(true, Ordering::SeqCst) => {
                t.task.abort();
                ferry_cache::warmup_done("stopped");
                true
            }
            _ => false,
        }
    }

    /// `true` if this mount started the warm-up (it may have ended since).
    pub fn started(&self) -> bool {
        self.task.is_some()
    }

    /// `true` while this mount runs the warm-up.
    pub fn is_running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.task.is_finished())
    }
}

/// After `gone` left the table `live` (unpublished): a warm-up it was running is stopped, and
/// handed to another live mount that asked for the same one, or let go (the next publish of the
/// volume starts it again). Runs under the mount table's lock, so a publish cannot slip between.
pub fn hand_over(gone: &mut Mounted, live: &mut HashMap<PathBuf, Mounted>) {
    let Some(w) = gone.warm_up.as_mut() else {
        return;
    };
    if !w.stop() {
        return;
    }
    let id = w.warm.id();
    let heir = live
        .values_mut()
        .filter_map(|m| m.warm_up.as_mut())
        .find(|o| o.warm.id() == id && Arc::ptr_eq(&o.cache, &w.cache));
    match heir {
        Some(heir) => {
            info!(bucket = %w.warm.bucket, prefixes = ?w.warm.prefixes, "the volume that ran the warm-up was unpublished; another mount of it goes on with it, with its own credentials");
            heir.run();
        }
        None => {
            info!(bucket = %w.warm.bucket, prefixes = ?w.warm.prefixes, "warm-up stopped: the volume that ran it was unpublished (its credentials); the next publish starts it again");
            w.cache.unclaim(&id);
        }
    }
}

/// A warm-up of `prefixes` in bucket `b` of `store`, into `cache`, run on `runtime` (tests).
#[cfg(test)]
fn warm_up_on(
    store: ferry_store::MemoryStore,
    cache: &Arc<BlockCache>,
    prefixes: &[&str],
    runtime: Handle,
) -> MountWarmUp {
    MountWarmUp::new(
        Arc::new(store),
        Arc::new(Proofs::default()),
        cache.clone(),
        WarmUp {
            endpoint: String::new(),
            bucket: "b".into(),
            prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
        },
        runtime,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_store::MemoryStore;

    /// A warm-up of `prefixes` in bucket `b` of `store`, into `cache`.
    fn warm_up(store: MemoryStore, cache: &Arc<BlockCache>, prefixes: &[&str]) -> MountWarmUp {
        warm_up_on(store, cache, prefixes, Handle::current())
    }

    /// Waits up to ten seconds for `w`'s task to end.
    async fn ended(w: &MountWarmUp) {
        for _ in 0..1000 {
            if !w.is_running() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("the warm-up never ended");
    }

    /// A warm-up that failed did not warm the volume: its claim is let go, so the next publish
    /// starts it again (one that ended well keeps it: it is not repeated).
    #[tokio::test]
    async fn a_failed_warm_up_lets_its_claim_go() {
        let dir = tempfile::tempdir().unwrap();
        let cache = BlockCache::open(ferry_cache::CacheConfig::new(dir.path(), 64 << 20)).unwrap();
        // No bucket: its LIST fails.
        let mut failed = warm_up(MemoryStore::new(), &cache, &["x/"]);
        failed.start();
        ended(&failed).await;
        assert!(
            cache.claim(&failed.warm.id()),
            "the failed warm-up kept its claim: no publish of the volume starts it again"
        );
        let store = MemoryStore::new();
        store.create_bucket("b");
        store.insert("b", "y/a", vec![1u8; 10]);
        let mut done = warm_up(store, &cache, &["y/"]);
        done.start();
        ended(&done).await;
        assert!(
            !cache.claim(&done.warm.id()),
            "a warm-up done is not repeated"
        );
    }

    /// A warm-up may start off the runtime: a handover called off puts its mounts back on the
    /// handover thread, where one may take the claim a failed warm-up let go.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_warm_up_starts_off_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let cache = BlockCache::open(ferry_cache::CacheConfig::new(dir.path(), 64 << 20)).unwrap();
        let mut w = warm_up(MemoryStore::new(), &cache, &["x/"]);
        let mut w = std::thread::spawn(move || {
            w.start();
            w
        })
        .join()
        .expect("started off the runtime");
        ended(&w).await;
        assert!(w.task.take().is_some(), "it ran");
    }
}

#[cfg(test)]
mod race {
    use super::*;
    use ferry_store::MemoryStore;
    use std::sync::mpsc;
    use std::sync::Mutex;
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata};

    /// A subscriber that stops the thread logging "warm-up done" until told to go on.
    struct PauseAtDone {
        reached: Mutex<mpsc::Sender<()>>,
        go_on: Mutex<mpsc::Receiver<()>>,
    }

    struct Message(bool);

    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" && format!("{value:?}") == "warm-up done" {
                self.0 = true;
            }
        }
    }

    impl tracing::Subscriber for PauseAtDone {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut m = Message(false);
            event.record(&mut m);
            if m.0 {
                self.reached.lock().unwrap().send(()).unwrap();
                let _ = self.go_on.lock().unwrap().recv();
            }
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    /// A warm-up that has ended (done, counted) but whose task has not returned yet is not
    /// stopped: stopping it would count it twice and let its claim go, so the next publish (or
    /// another mount of it) would run it all again.
    #[test]
    fn a_warm_up_that_ended_is_not_stopped() {
        let (reached_tx, reached) = mpsc::channel();
        let (go_on, go_on_rx) = mpsc::channel();
        let sub = Arc::new(PauseAtDone {
            reached: Mutex::new(reached_tx),
            go_on: Mutex::new(go_on_rx),
        });
        let s = sub.clone();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .on_thread_start(move || {
                std::mem::forget(tracing::subscriber::set_default(s.clone()));
            })
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cache = {
            let _rt = rt.enter();
            BlockCache::open(ferry_cache::CacheConfig::new(dir.path(), 64 << 20)).unwrap()
        };
        let store = MemoryStore::new();
        store.create_bucket("b");
        let mut w = warm_up_on(store, &cache, &["x/"], rt.handle().clone());
        w.start();
        reached
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the warm-up never ended");
        let stopped = w.stop();
        go_on.send(()).unwrap();
        assert!(
            !stopped,
            "a warm-up that had ended was stopped (and counted twice)"
        );
    }
}
