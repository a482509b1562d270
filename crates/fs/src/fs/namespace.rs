//! The namespace: `lookup`, `getattr`/`setattr`, directories (`opendir`, `readdir`, `mkdir`,
//! `rmdir`), `unlink`, `rename` and `statfs` — how S3 keys under the prefix become a tree, and
//! how long what was listed is believed.

use super::*;
use crate::config::MetadataTtl;

/// Kept listings hold at most this share of the memory budget (1/4).
const LISTING_SHARE: u64 = 4;

impl Fs {
    // ----- lookup / getattr -------------------------------------------------------------------

    /// HEAD `path` and LIST `path/` concurrently. A directory wins over a file; when the LIST
    /// proves a directory, a failed HEAD does not matter. The LIST asks for a whole page (no
    /// dearer than one key when the name is a file): a directory's page comes back with it, so
    /// listing the directory next (`ls -la`) costs one round trip fewer.
    pub(super) async fn remote_lookup(
        &self,
        path: &str,
    ) -> Result<Option<(Kind, Option<ObjectMeta>, Option<ferry_store::ListPage>)>, FsError> {
        let key = file_key(&self.cfg.prefix, path);
        if key.len() > KEY_MAX {
            return Ok(None);
        }
        let dir = format!("{key}/");
        let list_req = ListRequest {
            prefix: &dir,
            delimiter: Some("/"),
            ..Default::default()
        };
        // The LIST first: `join!` polls in order, and a directory's lookup (`ls -la dir`) waits
        // for its LIST, never for the HEAD, so the HEAD's request is built after the LIST's is
        // on its way (after a cache drop, building the first of each in a process took up to
        // 3.5 ms: its code was faulted back in).
        let (list, head) = futures::join!(
            self.store.list(self.bucket(), list_req),
            self.head_object(&key)
        );
        let page = list?;
        if !page.objects.is_empty() || !page.common_prefixes.is_empty() {
            return Ok(Some((Kind::Dir, None, Some(page))));
        }
        match head {
            Ok(info) => Ok(Some((Kind::File, Some(ObjectMeta::from(&info)), None))),
            Err(StoreError::NotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Resolves `name` in `parent`: local state, then the caches, then S3 (recording a miss).
    pub(super) async fn find_child(&self, parent: Ino, name: &str) -> Result<Found, FsError> {
        self.adopt_probe(parent);
        let path = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let now = Instant::now();
            let p = st.inodes.get(parent).ok_or_else(|| stale(parent))?;
            if p.kind != Kind::Dir {
                return Err(FsError::NotDir);
            }
            let child = st.inodes.child(parent, name);
            if let Some(c) = child.filter(|c| c.is_local()) {
                return Ok(Found::Live(c.ino));
            }
            if p.cache.is_negative(name, now) {
                return Err(FsError::NotFound);
            }
            if let Some(c) = child.filter(|c| c.valid.is_valid(now)) {
                return Ok(Found::Live(c.ino));
            }
            if let Some((kind, meta)) = p.cache.cached(name, now) {
                return Ok(Found::Fresh {
                    kind,
                    meta: meta.cloned(),
                    valid: p.cache.entries_valid,
                    first_page: None,
                });
            }
            // On a mount whose objects change only through it (`indefinite`), a kept listing
            // is the directory's whole content: a name it does not hold is missing, with no
            // request (an import's or a loader's probes of names that are not there). With a
            // finite TTL a name another client created since the listing is still looked up.
            if self.cfg.metadata_ttl == MetadataTtl::Indefinite && p.cache.has_listing(now) {
                return Err(FsError::NotFound);
            }
            let path = child_path(&p.path, name);
            // With a zero TTL no listing is ever cached: nothing to probe for.
            let caches = self.ttl().is_valid(now);
            let probe = (caches && p.cache.cached_listing(now).is_none() && !p.is_local())
                .then(|| dir_prefix(&self.cfg.prefix, &p.path));
            (path, st.changes, probe)
        };
        let (path, changes, probe) = path;
        let at = Instant::now();
        let found = self.remote_lookup(&path).await;
        // The parent's probe after the lookup's own requests: on a server whose CPUs are busy,
        // a LIST the caller waits for (a cold `ls -la dir`: the directory's first page) is not
        // slowed by one it does not wait for (measured in doc/BENCHMARKS.md).
        if let Some(dprefix) = probe {
            let mut st = self.lock();
            self.probe_dir(&mut st, parent, dprefix);
        }
        match found? {
            Some((kind, meta, page)) => Ok(Found::Fresh {
                kind,
                meta,
                valid: self.ttl(),
                first_page: page.map(|page| {
                    Box::new(FirstPage {
                        page,
                        prefix: dir_prefix(&self.cfg.prefix, &path),
                        at,
                        changes,
                        own: false,
                    })
                }),
            }),
            None => {
                let valid = self.ttl();
                let mut st = self.lock();
                if let Some(p) = st.inodes.get_mut(parent) {
                    p.cache.add_negative(name, valid, Instant::now());
                }
                Err(FsError::NotFound)
            }
        }
    }

    /// Starts listing directory `dir` in the background, once per directory, page after page up
    /// to [`PROBE_PAGES`] pages: when that is the whole directory, a later lookup adopts it as
    /// the directory's cached listing ([`Fs::adopt_probe`]), so opening its files by path (no
    /// `readdir` first, e.g. a data loader in shuffled order) costs no HEAD + LIST per name after
    /// the first ones. A bigger directory costs these LISTs and is then looked up name by name.
    pub(super) fn probe_dir(&self, st: &mut FsState, dir: Ino, dprefix: String) {
        if st.probes.contains_key(&dir) || st.probed.contains(&dir) {
            return;
        }
        if st.probed.len() >= PROBED_MAX {
            st.probed.clear();
        }
        st.probed.insert(dir);
        let (store, bucket) = (self.store.clone(), self.cfg.bucket.clone());
        let task = spawn_owned(async move {
            let req = ListRequest {
                prefix: &dprefix,
                delimiter: Some("/"),
                ..Default::default()
            };
            let pages = ferry_store::list_pages(&*store, &bucket, req);
            futures::pin_mut!(pages);
            let mut builder = ListingBuilder::new(&dprefix);
            let mut listed = 0;
            while let Some(page) = futures::TryStreamExt::try_next(&mut pages).await.ok()? {
                builder.add_page(&page.objects, &page.common_prefixes);
                listed += 1;
                if page.next_token.is_some() && listed >= PROBE_PAGES {
                    return None;
                }
            }
            Some(builder.finish())
        });
        st.probes.insert(dir, (st.changes, Instant::now(), task));
    }

    /// Starts the probe of the mount's root ([`Fs::probe_dir`]) as the mount goes live, so that
    /// the first lookups and listings there, once it is done, need no request (a data loader's
    /// first `open`s by name, a pod's first `ls`). It is the probe the root's first lookup would
    /// have started. Not with a metadata TTL of 0 (nothing listed is kept). Call within a tokio
    /// runtime.
    pub fn probe_root(&self) {
        if !self.ttl().is_valid(Instant::now()) {
            return;
        }
        let mut st = self.lock();
        let Some(root) = st.inodes.get(ROOT_INO) else {
            return;
        };
        let dprefix = dir_prefix(&self.cfg.prefix, &root.path);
        self.probe_dir(&mut st, ROOT_INO, dprefix);
    }

    /// Installs `dir`'s probe listing if it finished, was complete and no change was made
    /// through this mount since it started.
    pub(super) fn adopt_probe(&self, dir: Ino) {
        let listing = {
            let mut st = self.lock();
            match st.probes.get(&dir) {
                Some((_, _, task)) if task.is_finished() => {}
                _ => return,
            }
            let (at, started, task) = st.probes.remove(&dir).expect("checked");
            let listing = futures::FutureExt::now_or_never(task)
                .and_then(Result::ok)
                .flatten();
            match listing {
                Some(l) if at == st.changes => (l, started),
                _ => return,
            }
        };
        let (listing, started) = listing;
        if self.install_listing(dir, listing, started, true).is_ok() {
            tracing::debug!(dir, "directory listing adopted from a lookup's probe");
        }
    }

    /// Puts what `find_child` found into the table; returns the inode number.
    pub(super) fn install(
        st: &mut FsState,
        parent: Ino,
        name: &str,
        found: Found,
    ) -> Result<Ino, FsError> {
        match found {
            Found::Live(ino) => st.inodes.get(ino).map(|i| i.ino).ok_or_else(|| stale(ino)),
            Found::Fresh {
                kind,
                meta,
                valid,
                first_page,
            } => {
                let ino = st
                    .inodes
                    .install_child(parent, name, kind)
                    .ok_or_else(|| stale(parent))?;
                if let Some(page) = first_page.filter(|_| kind == Kind::Dir) {
                    Self::keep_first_page(st, ino, *page);
                }
                let inode = st.inodes.get_mut(ino).expect("just installed");
                if !inode.is_local() {
                    inode.meta = meta;
                    inode.valid = valid;
                }
                Ok(ino)
            }
        }
    }

    /// `lookup`: counts one kernel reference on success.
    pub async fn lookup(&self, parent: Ino, name: &OsStr) -> Result<Entry, FsError> {
        let name = lookup_name(name)?;
        let found = self.find_child(parent, name).await?;
        let mut st = self.lock();
        let ino = Self::install(&mut st, parent, name, found)?;
        let inode = st.inodes.get_mut(ino).expect("installed");
        inode.lookups += 1;
        Ok(self.entry_of(inode))
    }

    /// `forget`: the kernel dropped `n` references.
    pub fn forget(&self, ino: Ino, n: u64) {
        self.lock().inodes.forget(ino, n);
    }

    /// `getattr`: directories and local files from the table; files from the cache or a HEAD.
    pub async fn getattr(&self, ino: Ino) -> Result<Entry, FsError> {
        let key = {
            let st = self.lock();
            let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
            if inode.kind == Kind::Dir || inode.is_local() || inode.valid.is_valid(Instant::now()) {
                return Ok(self.entry_of(inode));
            }
            file_key(&self.cfg.prefix, &inode.path)
        };
        let head = self.head_object(&key).await;
        let valid = self.ttl();
        let mut st = self.lock();
        let inode = st.inodes.get_mut(ino).ok_or_else(|| stale(ino))?;
        match head {
            Ok(info) => {
                if !inode.is_local() {
                    inode.meta = Some(ObjectMeta::from(&info));
                    inode.valid = valid;
                }
                Ok(self.entry_of(inode))
            }
            Err(StoreError::NotFound(_)) if !inode.is_local() => {
                inode.valid = Validity::Expired;
                Err(FsError::NotFound)
            }
            Err(StoreError::NotFound(_)) => Ok(self.entry_of(inode)),
            Err(e) => Err(e.into()),
        }
    }

    /// `setattr`: truncation of a file being written (to 0 or its current size); chmod/chown to
    /// the current values; times accepted and ignored. Everything else is refused.
    pub async fn setattr(&self, ino: Ino, req: SetAttr) -> Result<Entry, FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        let writer =
            {
                let st = self.lock();
                let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
                let perm = match inode.kind {
                    Kind::Dir => self.cfg.dir_mode,
                    Kind::File => self.cfg.file_mode,
                };
                if req.mode.is_some_and(|m| m & 0o7777 != u32::from(perm)) {
                    return Err(FsError::NotPermitted("chmod: modes are set per mount"));
                }
                if req.uid.is_some_and(|u| u != self.cfg.uid)
                    || req.gid.is_some_and(|g| g != self.cfg.gid)
                {
                    return Err(FsError::NotPermitted("chown: owners are set per mount"));
                }
                let known_size = inode.meta.as_ref().map(|m| m.size);
                match (inode.kind, inode.state) {
                    (Kind::Dir, _) if req.size.is_some() => return Err(FsError::IsDir),
                    (_, InodeState::Writing { fh }) => Some(fh),
                    // Truncating to the size it has changes nothing.
                    _ if req.size.is_some() && req.size == known_size => None,
                    _ if req.size.is_some() => return Err(FsError::NotPermitted(
                        "truncate: only a file being written through this mount can be truncated",
                    )),
                    _ => None,
                }
            };
        if let (Some(size), Some(fh)) = (req.size, writer) {
            let h = self.handle(fh)?;
            let mut g = h.lock().await;
            let Handle::Write(w) = &mut *g else {
                return Err(bad_fh());
            };
            match w.status {
                WriteStatus::Open => {}
                WriteStatus::Completed => {
                    return Err(FsError::BadHandle("the upload already completed"))
                }
                WriteStatus::Failed => return Err(FsError::UploadFailed),
            }
            if size != w.written {
                if size != 0 {
                    return Err(FsError::InvalidArgument(
                        "truncate: only to 0 or to the current size",
                    ));
                }
                if let Some(up) = w.upload.take() {
                    self.abort_upload(&w.key, &up).await;
                }
                w.pending.clear();
                w.written = 0;
                self.set_local_size(ino, 0);
            }
        }
        let st = self.lock();
        let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
        Ok(self.entry_of(inode))
    }

    // ----- directories ------------------------------------------------------------------------

    /// Whether directories are cached in the kernel ([`kdir`]): on mounts whose metadata is
    /// trusted for the mount's life, and on mounts with a TTL once Ferry can tell the kernel to
    /// drop a directory's cache when the TTL of what it was filled with ends (a stream held
    /// open and rewound would otherwise be answered from it past the TTL). Not with a TTL of 0.
    fn kernel_dir_cache(&self) -> bool {
        match self.cfg.metadata_ttl {
            MetadataTtl::Indefinite => true,
            MetadataTtl::Duration(d) => !d.is_zero() && self.kernel_inval.get().is_some(),
        }
    }

    /// Lets the mount tell the kernel to drop a directory's cached entries (the live session's
    /// notifier). A successor's directory handles taken over may be answered by the kernel from
    /// a cache its predecessor let it fill, whose TTL this process does not know: on a mount
    /// with a TTL their directories' caches are dropped now.
    pub fn set_kernel_invalidator(&self, inval: KernelInvalidator) {
        if self.kernel_inval.set(inval.clone()).is_err() {
            return;
        }
        if self.cfg.metadata_ttl == MetadataTtl::Indefinite {
            return;
        }
        let carried: Vec<Ino> = {
            let st = self.lock();
            st.kernel_dirs
                .iter()
                .filter(|(_, k)| k.active > 0)
                .map(|(ino, _)| *ino)
                .collect()
        };
        for ino in carried {
            inval.invalidate(ino);
        }
    }

    /// Has the kernel drop directory `ino`'s cache when `valid` ends, unless a drop is due by
    /// then anyway (on a mount with a TTL, after a stream filled it with a listing valid until
    /// then).
    fn drop_kernel_dir_at(&self, st: &mut FsState, ino: Ino, valid: Validity) {
        let Some(inval) = self.kernel_inval.get() else {
            return;
        };
        let at = match valid {
            Validity::Until(at) => at,
            Validity::Expired => Instant::now(),
            Validity::Forever => return,
        };
        if st.dir_invals.len() >= KERNEL_DIRS_MAX {
            st.dir_invals.retain(|_, timers| {
                timers.retain(|(_, timer)| !timer.is_finished());
                !timers.is_empty()
            });
        }
        let pending = st.dir_invals.entry(ino).or_default();
        pending.retain(|(_, timer)| !timer.is_finished());
        if pending.iter().any(|(due, _)| *due <= at) {
            return;
        }
        let inval = inval.clone();
        let timer = spawn_owned(async move {
            tokio::time::sleep_until(at).await;
            inval.invalidate(ino);
        });
        pending.push((at, timer));
    }

    /// `opendir`: a handle whose listing is taken at the first `readdir`, or, when the kernel's
    /// cache of the directory can hold only the directory's kept listing, pinned to that
    /// listing and told to keep the cache.
    pub fn opendir(&self, ino: Ino) -> Result<DirOpened, FsError> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
        if inode.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        let mut handle = DirHandle::new(ino);
        let cache_dir = self.kernel_dir_cache();
        let mut keep_cache = false;
        if cache_dir {
            if st.kernel_dirs.len() >= KERNEL_DIRS_MAX {
                st.kernel_dirs.retain(|_, k| k.active > 0);
            }
            let k = st.kernel_dirs.entry(ino).or_default();
            let kept = inode
                .cache
                .cached_listing(Instant::now())
                .filter(|_| !has_local_children(&st.inodes, inode));
            if let Some((listing, at)) = kept {
                let tag = k.tag_for(listing, &mut st.tags);
                if k.holds_only(tag) {
                    keep_cache = true;
                    handle.snapshot = Some(listing.clone());
                    handle.listed_at = Some(*at);
                    handle.tag = tag;
                }
            }
            if !keep_cache {
                k.dropped();
            }
        }
        let fh = st.handles.insert(Handle::Dir(handle));
        Ok(DirOpened {
            fh,
            cache_dir,
            keep_cache,
        })
    }

    /// `releasedir`.
    /// Drops directory handle `fh` (only a directory handle: a stale number never takes a file's).
    pub fn releasedir(&self, fh: u64) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let dir = st.handles.get(fh).and_then(|h| {
            h.try_lock().ok().and_then(|g| match &*g {
                Handle::Dir(d) => Some((d.ino, d.counted)),
                _ => None,
            })
        });
        if let Some((ino, counted)) = dir {
            st.handles.remove(fh);
            if counted {
                if let Some(k) = st.kernel_dirs.get_mut(&ino) {
                    k.active = k.active.saturating_sub(1);
                }
            }
        }
    }

    /// The directory's entries, local ones merged in, and when S3's part was listed: from the
    /// cached listing while it is valid, else listed (every page), refreshing the caches.
    pub(super) async fn list_dir(&self, ino: Ino) -> Result<(Snapshot, Instant), FsError> {
        let (entries, at, _) = self.list_dir_start(ino, false).await?;
        Ok((entries, at))
    }

    /// [`Fs::list_dir`]; with `stream`, a directory whose listing would go on from a lookup's
    /// first page (more pages to come, no local entries) is answered with that page's entries
    /// at once, while the rest is listed in the background (the third value is then true, and
    /// the next `list_dir` of the directory waits for that listing instead of starting one).
    /// The page leaves out names that a later page could name again (those that the page's last
    /// key starts with), so the rest joins it without duplicates.
    pub(super) async fn list_dir_start(
        &self,
        ino: Ino,
        stream: bool,
    ) -> Result<(Snapshot, Instant, bool), FsError> {
        // A probe of the directory that finished is its listing.
        self.adopt_probe(ino);
        // A cold directory that no lookup brought a first page for (its name was known from its
        // parent's listing, say) is streamed all the same: its first page is listed here, then
        // answered as a lookup's would be. Only once: a page gone stale meanwhile is not fetched
        // again.
        let mut fetched_first = false;
        loop {
            match self.list_dir_from(ino, stream, fetched_first).await? {
                Started::Done(done) => return Ok(done),
                Started::NeedsFirstPage(dprefix) => {
                    let changes = self.lock().changes;
                    let at = Instant::now();
                    let req = ListRequest {
                        prefix: &dprefix,
                        delimiter: Some("/"),
                        ..Default::default()
                    };
                    let page = self.store.list(self.bucket(), req).await?;
                    let mut st = self.lock();
                    Self::keep_first_page(
                        &mut st,
                        ino,
                        FirstPage {
                            page,
                            prefix: dprefix,
                            at,
                            changes,
                            own: true,
                        },
                    );
                    fetched_first = true;
                }
            }
        }
    }

    /// Keeps a directory's first page for its listing (at most [`FIRST_PAGES_MAX`], the oldest
    /// dropped).
    pub(super) fn keep_first_page(st: &mut FsState, ino: Ino, page: FirstPage) {
        if st.first_pages.len() >= FIRST_PAGES_MAX {
            let oldest = st.first_pages.iter().min_by_key(|(_, p)| p.at);
            if let Some(&oldest) = oldest.map(|(ino, _)| ino) {
                st.first_pages.remove(&oldest);
            }
        }
        st.first_pages.insert(ino, page);
    }

    /// [`Fs::list_dir_start`] once; [`Started::NeedsFirstPage`] when streaming wants a first page
    /// that is not there (unless `fetched_first`).
    async fn list_dir_from(
        &self,
        ino: Ino,
        stream: bool,
        fetched_first: bool,
    ) -> Result<Started, FsError> {
        let (dprefix, first, rest) = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let first = st.first_pages.remove(&ino);
            let rest = st.rest_listings.remove(&ino);
            let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
            if inode.kind != Kind::Dir {
                return Err(FsError::NotDir);
            }
            let local: Vec<ListedEntry> = inode
                .children
                .iter()
                .filter_map(|(name, child)| {
                    let c = st.inodes.get(*child).filter(|c| c.is_local())?;
                    Some(ListedEntry {
                        name: name.clone(),
                        kind: c.kind,
                        meta: c.meta.clone(),
                    })
                })
                .collect();
            if let Some((listing, at)) = inode.cache.cached_listing(Instant::now()) {
                // A rest listing no longer wanted is aborted as it is dropped.
                drop(rest);
                return Ok(Started::Done((
                    with_local(listing.clone(), local),
                    *at,
                    false,
                )));
            }
            let dprefix = dir_prefix(&self.cfg.prefix, &inode.path);
            // A lookup's first page, if it is still believed and no change was made through
            // this mount since it was listed.
            // (Not older than a minute either: its continuation token goes on from it.) The
            // listing's own page, just listed, serves if nothing changed.
            let first = first.filter(|p| {
                p.prefix == dprefix
                    && p.changes == st.changes
                    && (p.own
                        || p.at.elapsed() < FIRST_PAGE_MAX_AGE
                            && Validity::new(self.cfg.metadata_ttl, p.at).is_valid(Instant::now()))
            });
            // The listing going on from a first page served earlier, unless a change was made
            // through this mount since that page was listed (it may not show the change).
            let rest = match rest {
                // Any other is aborted as it is dropped.
                Some(r) if r.prefix == dprefix && r.changes == st.changes => Some(r),
                _ => None,
            };
            let has_local = !local.is_empty();
            let now = Instant::now();
            match first {
                Some(p)
                    if stream && rest.is_none() && !has_local && p.page.next_token.is_some() =>
                {
                    let partial = first_page_entries(&p, &dprefix, |name| {
                        !p.own && inode.cache.is_negative(name, now)
                    });
                    if !partial.is_empty() {
                        let (store, bucket) = (self.store.clone(), self.cfg.bucket.clone());
                        let (prefix, page) = (dprefix.clone(), p.page);
                        let task = spawn_owned(async move {
                            let opts = ListAll {
                                first_page: Some(&page),
                                ..ListAll::dir(&prefix, LIST_CONCURRENCY)
                            };
                            list_all(&*store, &bucket, opts).await
                        });
                        if st.rest_listings.len() >= FIRST_PAGES_MAX {
                            let oldest = st.rest_listings.iter().min_by_key(|(_, r)| r.at);
                            if let Some(&oldest) = oldest.map(|(ino, _)| ino) {
                                st.rest_listings.remove(&oldest);
                            }
                        }
                        st.rest_listings.insert(
                            ino,
                            RestListing {
                                prefix: dprefix,
                                at: p.at,
                                changes: p.changes,
                                own: p.own,
                                task,
                            },
                        );
                        return Ok(Started::Done((Arc::new(partial), p.at, true)));
                    }
                    (dprefix, Some(p), rest)
                }
                None if stream && !fetched_first && rest.is_none() && !has_local => {
                    return Ok(Started::NeedsFirstPage(dprefix));
                }
                first => (dprefix, first, rest),
            }
        };
        let mut builder = ListingBuilder::new(&dprefix);
        // The listing going on from a page served earlier: its end, as old as its first page.
        if let Some(rest) = rest {
            if let Ok(listed) = rest.task.await {
                let listed = listed?;
                builder.add_page(&listed.objects, &listed.common_prefixes);
                let (entries, at) =
                    self.install_listing(ino, builder.finish(), rest.at, !rest.own)?;
                return Ok(Started::Done((entries, at, false)));
            }
            // Aborted (dropped for a newer one): listed anew.
        }
        let started = Instant::now();
        let listed = list_all(
            &*self.store,
            self.bucket(),
            ListAll {
                first_page: first.as_ref().map(|p| &p.page),
                ..ListAll::dir(&dprefix, LIST_CONCURRENCY)
            },
        )
        .await?;
        builder.add_page(&listed.objects, &listed.common_prefixes);
        let (entries, at) = match first {
            // As old as its first page; names learned missing since a lookup's page stay
            // missing.
            Some(p) => self.install_listing(ino, builder.finish(), p.at, !p.own)?,
            None => self.install_listing(ino, builder.finish(), started, false)?,
        };
        Ok(Started::Done((entries, at, false)))
    }

    /// Makes `listing` (taken at `now`) directory `ino`'s listing: live children learn its
    /// metadata, local ones are merged in, and within the TTL it is cached (entries and the
    /// snapshot). Returns the merged entries and `now`. With `keep_negatives` (a listing that
    /// may have started before this mount learned that a name was missing), names still in the
    /// negative cache stay missing and are left out of the listing.
    pub(super) fn install_listing(
        &self,
        ino: Ino,
        listing: Listing,
        now: Instant,
        keep_negatives: bool,
    ) -> Result<(Snapshot, Instant), FsError> {
        // Believed for the TTL from when it was listed, not from now: a listing adopted late
        // (a lookup's background listing) is no fresher than its LISTs.
        let valid = Validity::new(self.cfg.metadata_ttl, now);
        let mut guard = self.lock();
        let st = &mut *guard;
        Self::log_hidden(st, listing.hidden);
        let mut remote = listing.entries;
        let dir = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
        if keep_negatives {
            let now = Instant::now();
            remote.retain(|e| !dir.cache.is_negative(&e.name, now));
        }
        let children: Vec<(String, Ino)> =
            dir.children.iter().map(|(n, i)| (n.clone(), *i)).collect();

        // Live children learn the listing's metadata; local ones replace or join it.
        let mut local = Vec::new();
        for (name, child) in children {
            let Some(c) = st.inodes.get_mut(child) else {
                continue;
            };
            if c.is_local() {
                local.push(ListedEntry {
                    name,
                    kind: c.kind,
                    meta: c.meta.clone(),
                });
            } else if let Ok(i) = remote.binary_search_by(|e| e.name.as_str().cmp(&name)) {
                // (Names are unique among children: a local one never stands in this place.)
                if remote[i].kind == c.kind {
                    if c.kind == Kind::File {
                        c.meta = remote[i].meta.clone();
                    }
                    c.valid = valid;
                }
            }
        }

        let dir = st.inodes.get_mut(ino).expect("checked above");
        if dir.state == InodeState::LocalDir && (listing.has_marker || !remote.is_empty()) {
            dir.state = InodeState::Remote;
            dir.valid = valid;
        }
        dir.cache.clear(valid);
        // Names the listing shows exist, kept or not: a name this mount remembered as missing
        // must not stay missing while `readdir` shows it.
        if valid.is_valid(now) {
            for e in &remote {
                dir.cache.negative.remove(&e.name);
            }
        }
        // Kept only if the memory budget holds it and kept listings stay within a quarter of it
        // (they are given back only when the directory is listed again or forgotten, so they must
        // never starve prefetch and writers); otherwise served and forgotten (the next readdir or
        // lookup asks S3 again).
        let charge = valid.is_valid(now).then(|| {
            let bytes = kept_listing_bytes(&remote);
            (self.budget.used_for(Use::Listing) + bytes <= self.budget.limit() / LISTING_SHARE)
                .then(|| self.budget.try_reserve_for(Use::Listing, bytes))
                .flatten()
        });
        remote.shrink_to_fit();
        let remote = Arc::new(remote);
        match charge {
            Some(Some(charge)) => dir.cache.keep(remote.clone(), now, charge),
            Some(None) => {
                tracing::debug!(
                    entries = remote.len(),
                    "memory budget spent: a listing is served but not kept"
                );
                dir.cache.entries_valid = Validity::Expired;
            }
            None => {}
        }
        Ok((with_local(remote, local), now))
    }

    /// `readdir` / `readdirplus` from offset `offset` (0 = start; a repeated 0 lists again).
    /// With `plus`, every entry the sink accepts (except `.` and `..`) counts one kernel reference.
    pub async fn readdir(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        plus: bool,
        sink: &mut (dyn DirSink + Send),
    ) -> Result<(), FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        let Handle::Dir(d) = &mut *g else {
            return Err(bad_fh());
        };
        if d.ino != ino {
            return Err(bad_fh());
        }
        let cache_dir = self.kernel_dir_cache();
        let mut retagged = false;
        // A handle pinned at `opendir` to a listing whose TTL ended before it was read lists
        // afresh, as one opened then would.
        let pinned_expired = !d.served
            && !d.partial
            && d.listed_at.is_some_and(|at| {
                !Validity::new(self.cfg.metadata_ttl, at).is_valid(Instant::now())
            });
        if d.snapshot.is_none() || (offset == 0 && d.served) || pinned_expired {
            let (entries, listed_at, partial) = self.list_dir_start(ino, true).await?;
            d.snapshot = Some(entries);
            d.listed_at = Some(listed_at);
            d.partial = partial;
            retagged = true;
        }
        let start = kdir::index(offset);
        // Past the end of a first page served while the rest was listed: the rest joins it
        // (names the page showed are not repeated; offsets already handed out keep their entry).
        let served_len = d.snapshot.as_ref().map_or(0, |s| s.len()) as u64;
        if d.partial && start >= served_len + 2 {
            let (entries, listed_at) = self.list_dir(ino).await?;
            let snapshot = Arc::make_mut(d.snapshot.get_or_insert_with(Default::default));
            let seen: HashSet<&str> = snapshot.iter().map(|e| e.name.as_str()).collect();
            let rest: Vec<ListedEntry> = entries
                .iter()
                .filter(|e| !seen.contains(e.name.as_str()))
                .cloned()
                .collect();
            snapshot.extend(rest);
            // The page and the rest are the listing itself, in its order: serve the listing
            // (shared, not a copy), under its tag, so that the cache this stream fills in the
            // kernel is known to hold that listing.
            if cache_dir && same_names(snapshot, &entries) {
                d.snapshot = Some(entries);
                retagged = true;
            }
            d.listed_at = Some(listed_at);
            d.partial = false;
        }
        d.served = true;
        let entries = d.snapshot.as_deref().map_or(&[][..], Vec::as_slice);
        let snapshot_valid = Validity::new(
            self.cfg.metadata_ttl,
            d.listed_at.unwrap_or_else(Instant::now),
        );

        let mut guard = self.lock();
        let st = &mut *guard;
        if cache_dir {
            let k = st.kernel_dirs.entry(ino).or_default();
            if retagged {
                d.tag = k.tag_for(d.snapshot.as_ref().expect("taken above"), &mut st.tags);
            }
            if offset == 0 && !d.counted {
                d.counted = true;
                k.active += 1;
            }
        }
        let now = Instant::now();
        let dir = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
        let dir_path = dir.path.clone();
        let dir_entry = self.entry_of(dir);
        let parent_ino = dir.parent;
        let parent_entry = st
            .inodes
            .get(parent_ino)
            .map_or_else(|| dir_entry.clone(), |p| self.entry_of(p));
        let mut idx = start;
        let mut ended = false;
        loop {
            let (name, kind, entry) = match idx {
                0 => (".", Kind::Dir, dir_entry.clone()),
                1 => ("..", Kind::Dir, parent_entry.clone()),
                n => {
                    let Some(e) = usize::try_from(n - 2).ok().and_then(|i| entries.get(i)) else {
                        ended = true;
                        break;
                    };
                    let entry = match st.inodes.child(ino, &e.name).filter(|c| c.kind == e.kind) {
                        Some(c) if c.is_local() || c.valid.is_valid(now) => self.entry_of(c),
                        _ => {
                            let path = child_path(&dir_path, &e.name);
                            let child_ino = st.inodes.ino_for(ino, &e.name, &path, e.kind);
                            Entry {
                                attr: self.attr_from(child_ino, e.kind, e.meta.as_ref()),
                                ttl: self.cfg.metadata_ttl.kernel_ttl(),
                            }
                        }
                    };
                    (e.name.as_str(), e.kind, entry)
                }
            };
            let full = sink.add(&DirEntry {
                ino: entry.attr.ino,
                offset: kdir::offset(d.tag, idx),
                name,
                kind,
                attr: &entry.attr,
                ttl: entry.ttl,
            });
            if full {
                break;
            }
            if plus && idx >= 2 {
                let child = st
                    .inodes
                    .install_child(ino, name, kind)
                    .ok_or_else(|| stale(ino))?;
                let c = st.inodes.get_mut(child).expect("installed");
                if !c.is_local() && !c.valid.is_valid(now) {
                    let e = &entries[(idx - 2) as usize];
                    c.meta = e.meta.clone();
                    c.valid = snapshot_valid;
                }
                c.lookups += 1;
            }
            idx += 1;
        }
        // The end of the directory (not of a first page the rest will join): the kernel marks its
        // cache complete at the empty answer there.
        if cache_dir && ended && !d.partial {
            if let Some(k) = st.kernel_dirs.get_mut(&ino) {
                k.ended(d.tag);
            }
            self.drop_kernel_dir_at(st, ino, snapshot_valid);
        }
        Ok(())
    }

    /// `mkdir`: a local directory, visible in this mount until a file written into it makes it
    /// real in S3 (no marker object is written).
    pub async fn mkdir(&self, parent: Ino, name: &OsStr) -> Result<Entry, FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        let name = new_name(name)?;
        let mut st = self.lock();
        let path = self.check_new_child(&st, parent, name)?;
        if dir_prefix(&self.cfg.prefix, &path).len() > KEY_MAX {
            return Err(FsError::NameTooLong);
        }
        let ino = st
            .inodes
            .install_child(parent, name, Kind::Dir)
            .ok_or_else(|| stale(parent))?;
        st.inodes.set_state(ino, InodeState::LocalDir);
        let inode = st.inodes.get_mut(ino).expect("installed");
        inode.lookups += 1;
        let entry = self.entry_of(inode);
        if let Some(p) = st.inodes.get_mut(parent) {
            p.cache.negative.remove(name);
        }
        st.changes += 1;
        Ok(entry)
    }

    /// Refuses to create `name` if the parent is not a directory or the name is known to exist.
    /// Returns the new child's path.
    pub(super) fn check_new_child(
        &self,
        st: &FsState,
        parent: Ino,
        name: &str,
    ) -> Result<String, FsError> {
        let now = Instant::now();
        let p = st.inodes.get(parent).ok_or_else(|| stale(parent))?;
        if p.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        let negative = p.cache.is_negative(name, now);
        let live = st.inodes.child(parent, name);
        if live.is_some_and(|c| c.is_local() || (!negative && c.valid.is_valid(now)))
            || (!negative && p.cache.cached(name, now).is_some())
        {
            return Err(FsError::Exists);
        }
        Ok(child_path(&p.path, name))
    }

    /// `EROFS` on a read-only mount, `EPERM` without `allow_delete`.
    fn may_delete(&self) -> Result<(), FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        if !self.cfg.allow_delete {
            return Err(FsError::NotPermitted("deletes are disabled on this mount"));
        }
        Ok(())
    }

    /// `unlink` (needs `allow_delete`): deletes the key.
    pub async fn unlink(&self, parent: Ino, name: &OsStr) -> Result<(), FsError> {
        self.may_delete()?;
        let name = lookup_name(name)?;
        let found = self.find_child(parent, name).await?;
        if let Found::Live(ino) = &found {
            self.wait_while_written(*ino).await;
        }
        let (key, live) = {
            let st = self.lock();
            let parent_path = &st.inodes.get(parent).ok_or_else(|| stale(parent))?.path;
            let key = file_key(&self.cfg.prefix, &child_path(parent_path, name));
            match &found {
                Found::Live(ino) => {
                    let c = st.inodes.get(*ino).ok_or_else(|| stale(*ino))?;
                    match (c.kind, c.state) {
                        (Kind::Dir, _) => return Err(FsError::IsDir),
                        (Kind::File, InodeState::Writing { .. }) => {
                            return Err(FsError::Busy("the file is being written"))
                        }
                        _ => (key, Some(*ino)),
                    }
                }
                Found::Fresh {
                    kind: Kind::Dir, ..
                } => return Err(FsError::IsDir),
                Found::Fresh { .. } => (key, st.inodes.child(parent, name).map(|c| c.ino)),
            }
        };
        self.store.delete(self.bucket(), &key).await?;
        let valid = self.ttl();
        {
            let mut st = self.lock();
            st.changes += 1;
            if let Some(c) = live.and_then(|ino| st.inodes.get_mut(ino)) {
                if c.kind == Kind::File && !c.is_local() {
                    c.meta = None;
                    c.valid = Validity::Expired;
                    c.last_open_etag = None;
                }
            }
            if let Some(p) = st.inodes.get_mut(parent) {
                p.cache.add_negative(name, valid, Instant::now());
            }
        }
        self.keep_dir_if_empty(parent).await;
        Ok(())
    }

    /// After removing an entry: if the directory has nothing left in S3 (it was implicit), keep it
    /// as a local directory, so it stays until `rmdir` as POSIX expects; and so on up the tree,
    /// since an ancestor whose only content was this directory is now implicit in nothing either
    /// (it must stay too, or the local directory would hang below a directory that does not
    /// exist). Best effort.
    pub(super) async fn keep_dir_if_empty(&self, dir: Ino) {
        let mut dir = dir;
        loop {
            let (dprefix, parent) = {
                let st = self.lock();
                match st.inodes.get(dir) {
                    Some(d) if dir != ROOT_INO && d.state == InodeState::Remote => {
                        (dir_prefix(&self.cfg.prefix, &d.path), d.parent)
                    }
                    _ => return,
                }
            };
            let req = ListRequest {
                prefix: &dprefix,
                max_keys: Some(1),
                ..Default::default()
            };
            match self.store.list(self.bucket(), req).await {
                Ok(page) if page.objects.is_empty() && page.common_prefixes.is_empty() => {
                    let mut st = self.lock();
                    if st.inodes.get(dir).map(|d| d.state) == Some(InodeState::Remote) {
                        st.inodes.set_state(dir, InodeState::LocalDir);
                    }
                    drop(st);
                    dir = parent;
                }
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "checking whether a directory became empty");
                    return;
                }
            }
        }
    }

    /// `rmdir` (needs `allow_delete`): only if nothing (no key at all, hidden ones included) is
    /// below it; deletes its marker if it has one.
    pub async fn rmdir(&self, parent: Ino, name: &OsStr) -> Result<(), FsError> {
        // Without allow_delete, only a directory nothing in S3 stands for (made here by mkdir,
        // still empty) may go: its removal deletes nothing.
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        let name = lookup_name(name)?;
        let found = self.find_child(parent, name).await?;
        let (dprefix, live) = {
            let st = self.lock();
            let parent_path = &st.inodes.get(parent).ok_or_else(|| stale(parent))?.path;
            let dprefix = dir_prefix(&self.cfg.prefix, &child_path(parent_path, name));
            let live = match &found {
                Found::Live(ino) => Some(*ino),
                Found::Fresh { kind, .. } => {
                    if *kind != Kind::Dir {
                        return Err(FsError::NotDir);
                    }
                    st.inodes
                        .child(parent, name)
                        .filter(|c| c.kind == Kind::Dir)
                        .map(|c| c.ino)
                }
            };
            if let Some(ino) = live {
                let c = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
                if c.kind != Kind::Dir {
                    return Err(FsError::NotDir);
                }
                let local_child = c
                    .children
                    .values()
                    .any(|k| st.inodes.get(*k).is_some_and(Inode::is_local));
                if local_child {
                    return Err(FsError::NotEmpty);
                }
            }
            (dprefix, live)
        };
        let page = self
            .store
            .list(
                self.bucket(),
                ListRequest {
                    prefix: &dprefix,
                    max_keys: Some(2),
                    ..Default::default()
                },
            )
            .await?;
        if page.objects.iter().any(|o| o.key != dprefix) || !page.common_prefixes.is_empty() {
            return Err(FsError::NotEmpty);
        }
        if page.objects.iter().any(|o| o.key == dprefix) {
            self.may_delete()?;
            self.store.delete(self.bucket(), &dprefix).await?;
        }
        let valid = self.ttl();
        {
            let mut st = self.lock();
            st.changes += 1;
            if let Some(ino) = live {
                st.inodes.set_state(ino, InodeState::Remote);
                if let Some(c) = st.inodes.get_mut(ino) {
                    c.valid = Validity::Expired;
                    c.cache = Default::default();
                }
                st.inodes.maybe_remove(ino);
            }
            if let Some(p) = st.inodes.get_mut(parent) {
                p.cache.add_negative(name, valid, Instant::now());
            }
        }
        self.keep_dir_if_empty(parent).await;
        Ok(())
    }

    /// `rename`: S3 has no rename. EXDEV makes `mv` fall back to copy + delete; without
    /// `allow_delete` that delete would be refused after the whole copy was uploaded (both names
    /// left), so it is EPERM at once.
    pub fn rename(&self) -> Result<(), FsError> {
        if self.cfg.read_only {
            Err(FsError::ReadOnly)
        } else if !self.cfg.allow_delete {
            Err(FsError::NotPermitted(
                "no rename in S3, and a copy could not delete the source (allow_delete is off)",
            ))
        } else {
            Err(FsError::CrossDevice)
        }
    }

    /// `statfs`: large constant numbers (S3 has no capacity), so tools that check free space write.
    pub fn statfs(&self) -> StatFs {
        const BLOCKS: u64 = 1 << 40;
        StatFs {
            blocks: BLOCKS,
            bfree: BLOCKS,
            bavail: BLOCKS,
            files: 1 << 32,
            ffree: 1 << 32,
            bsize: BLKSIZE,
            namelen: crate::names::NAME_MAX as u32,
            frsize: BLKSIZE,
        }
    }
}

/// The entries of a directory's first listing page `p` (of the directory whose key prefix is
/// `dprefix`) that no later page can name again, except names `negative` says are missing. A
/// later page holds only keys after the page's last key `L`; a name `n` of this page is named
/// again (a directory `n/` shadowing the file `n`) only if `n <= L < n/`, that is if `L` starts
/// with `n`: such names are left to the rest of the listing. (A later directory can still sort
/// before some of the page's names, `a/` after `a-b`: it is then served after them.)
fn first_page_entries(
    p: &FirstPage,
    dprefix: &str,
    negative: impl Fn(&str) -> bool,
) -> Vec<ListedEntry> {
    let page = &p.page;
    let last = page
        .objects
        .iter()
        .map(|o| o.key.as_str())
        .chain(page.common_prefixes.iter().map(String::as_str))
        .max()
        .unwrap_or_default();
    let last = last.strip_prefix(dprefix).unwrap_or_default();
    let mut builder = ListingBuilder::new(dprefix);
    builder.add_page(&page.objects, &page.common_prefixes);
    let mut entries = builder.finish().entries;
    entries.retain(|e| !last.starts_with(e.name.as_str()) && !negative(&e.name));
    entries
}

/// Whether directory `dir` has a child that exists only in this mount (its listing is then
/// merged with them: not the kept listing itself).
fn has_local_children(inodes: &InodeTable, dir: &Inode) -> bool {
    dir.children
        .values()
        .any(|c| inodes.get(*c).is_some_and(Inode::is_local))
}

/// Whether two listings name the same entries in the same order.
fn same_names(a: &[ListedEntry], b: &[ListedEntry]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.name == y.name && x.kind == y.kind)
}

/// A directory's snapshot: `listing` with this mount's `local` entries (sorted by name) replacing
/// or joining it; the listing itself, shared, when there are none.
fn with_local(listing: Snapshot, local: Vec<ListedEntry>) -> Snapshot {
    if local.is_empty() {
        return listing;
    }
    let mut entries = Vec::clone(&listing);
    for l in local {
        match entries.binary_search_by(|e| e.name.as_str().cmp(&l.name)) {
            Ok(i) => entries[i] = l,
            Err(i) => entries.insert(i, l),
        }
    }
    Arc::new(entries)
}

/// What one pass of [`Fs::list_dir_start`] came to.
enum Started {
    /// The entries, when S3's part was listed, and whether they are a first page only.
    Done((Snapshot, Instant, bool)),
    /// Streaming wants the directory's first page (its prefix), which no lookup brought.
    NeedsFirstPage(String),
}
