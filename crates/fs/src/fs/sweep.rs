//! The directory sweep: with the node cache, a directory whose small files are being opened one
//! after another (a data loader's epoch, in any order) is fetched into the cache in the
//! background, many files at a time, so the opens that follow read from the local disk.
//!
//! Listing-order readers are served ahead by the cross-file prefetch (`read::prefetch_following`);
//! a shuffled order defeats it, and each open would wait for its own GET. The sweep starts once
//! this mount opened at least [`SWEEP_MIN_OPENS`] files of the directory out of listing order
//! (opens that follow it are left to that prefetch), none more than [`SWEEP_OPEN_GAP`] after the
//! one before, and at least one in
//! [`SWEEP_OPEN_SHARE`] of its entries (a few files picked out of a big directory never start
//! it); it runs once per directory and mount, fetches only files of at most
//! [`crate::PrefetchConfig::small_object_max`] that the cache does not hold whole, at most
//! [`SWEEP_IN_FLIGHT`] at once (and [`SWEEPS_AT_ONCE`] sweeps per mount), each file charged to the
//! memory budget once, from before its GET until its blocks are on disk, and stops at a quarter
//! of the cache's size. Each GET uses the mount's own credentials (and proves its access, see
//! `prefetch::fetch`).

use super::*;
use futures::stream::{self, StreamExt};

/// Opens in one directory before it may be swept.
const SWEEP_MIN_OPENS: u32 = 16;
/// ... and at least one in this many of its entries.
const SWEEP_OPEN_SHARE: usize = 100;
/// Files fetched at once by one sweep.
const SWEEP_IN_FLIGHT: usize = 32;
/// Sweeps of one mount running at once (a loader going through many directories, e.g. one per
/// class, starts one sweep per directory: the rest wait their turn).
pub(super) const SWEEPS_AT_ONCE: usize = 2;
/// Most directories with open counts (cleared past it).
const SWEEP_DIRS_MAX: usize = 1024;
/// An open more than this after the directory's last counted one starts the count again: the
/// opens that start a sweep are a reader going through the directory, not a few files opened
/// now and then over a job's days.
pub(super) const SWEEP_OPEN_GAP: std::time::Duration = std::time::Duration::from_secs(30);

/// Per directory: opens counted (and when the last one was), or the sweep started (its task
/// aborted when the mount goes).
#[derive(Debug)]
pub(super) enum SweepState {
    Counting { opens: u32, last: Instant },
    Started { _running: Owned<()> },
}

impl Fs {
    /// Whether `dir` is being (or was) swept: the listing-order prefetch then leaves it alone.
    pub(super) fn swept(st: &FsState, dir: Ino) -> bool {
        matches!(st.sweeps.get(&dir), Some(SweepState::Started { .. }))
    }

    /// Counts an open of a file of `parent` for reading, and starts the directory's sweep when
    /// the opens say a reader goes through it (see the module's documentation).
    pub(super) fn note_open_for_sweep(&self, st: &mut FsState, parent: Ino) {
        let Some(cache) = &self.cache else { return };
        if self.prefetch.small_object_max == 0 {
            return;
        }
        // Opens in listing order are served ahead by the listing-order prefetch, from memory.
        if st.order.get(&parent).is_some_and(|&(_, streak)| streak > 0) {
            return;
        }
        if st.sweeps.len() >= SWEEP_DIRS_MAX && !st.sweeps.contains_key(&parent) {
            st.sweeps
                .retain(|_, s| matches!(s, SweepState::Started { .. }));
            if st.sweeps.len() >= SWEEP_DIRS_MAX {
                return;
            }
        }
        let now = Instant::now();
        let counting = SweepState::Counting {
            opens: 0,
            last: now,
        };
        let opens = match st.sweeps.entry(parent).or_insert(counting) {
            SweepState::Started { .. } => return,
            SweepState::Counting { opens, last } => {
                if now.duration_since(*last) > SWEEP_OPEN_GAP {
                    *opens = 0;
                }
                *opens += 1;
                *last = now;
                *opens
            }
        };
        if opens < SWEEP_MIN_OPENS {
            return;
        }
        let Some(dir) = st.inodes.get(parent) else {
            return;
        };
        let Some((listing, _)) = dir.cache.cached_listing(now) else {
            return;
        };
        if (opens as usize) * SWEEP_OPEN_SHARE < listing.len() {
            return;
        }
        let max = self.prefetch.small_object_max;
        let files: Vec<(String, String, u64)> = listing
            .iter()
            .filter(|e| e.kind == Kind::File)
            .filter_map(|e| {
                let meta = e.meta.as_ref()?;
                let etag = meta.etag.clone()?;
                (meta.size > 0 && meta.size <= max).then(|| {
                    let key = file_key(&self.cfg.prefix, &child_path(&dir.path, &e.name));
                    (key, etag, meta.size)
                })
            })
            .collect();
        let limit = cache.config().max_size / 4;
        let mut planned = 0u64;
        let sources: Vec<(Source, ObjectKey)> = files
            .into_iter()
            .map_while(|(key, etag, size)| {
                planned += size;
                (planned <= limit).then_some((key, etag, size))
            })
            .filter_map(|(key, etag, size)| {
                // In the cache (whole, or its blocks), or fetched ahead (or opened) through this
                // mount already.
                if st.small.contains(&key, &etag) {
                    return None;
                }
                let proven = self.is_proven(&key, &etag);
                let src = self.source(&key, Some(&etag), size, proven);
                if crate::prefetch::is_cached(&src) {
                    return None;
                }
                Some((src, self.object_key(&key, &etag)))
            })
            .collect();
        tracing::debug!(
            dir = parent,
            files = sources.len(),
            "sweeping a directory into the node cache"
        );
        let (cache, budget) = (cache.clone(), self.budget.clone());
        let slots = st.sweep_slots.clone();
        let task = spawn_owned(async move {
            let Ok(_slot) = slots.acquire_owned().await else {
                return;
            };
            stream::iter(sources)
                .for_each_concurrent(SWEEP_IN_FLIGHT, |(src, obj)| {
                    let (cache, budget) = (cache.clone(), budget.clone());
                    async move {
                        // Never faster than the cache's writers (blocks over their backlog are
                        // not stored, and readers would fetch them again) ...
                        cache.writers_have_room(src.size).await;
                        // ... nor over the memory budget: a sweep can wait. The blocks fetched
                        // wait for the writers under this charge (not a second one, which near
                        // the budget would be refused and leave them unstored).
                        let held = loop {
                            match budget.try_reserve_for(crate::budget::Use::ReadAhead, src.size) {
                                Some(r) => break Arc::new(r),
                                None => {
                                    tokio::time::sleep(std::time::Duration::from_millis(50)).await
                                }
                            }
                        };
                        // Objects of one block stay blocks (see `Fs::passthrough_file`).
                        if src.size > cache.block_size() {
                            cache.want_whole(obj, src.size);
                        }
                        // Read (and cached) by the mount's readers since the sweep started.
                        if crate::prefetch::is_cached(&src) {
                            return;
                        }
                        // A failure is the opener's to see when it reads the file itself.
                        let _ = crate::prefetch::fetch_held(&src, 0..src.size, &held).await;
                    }
                })
                .await;
        });
        st.sweeps
            .insert(parent, SweepState::Started { _running: task });
    }
}
