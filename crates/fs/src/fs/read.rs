//! The read path: `open` (pinning the version read), `read` through the prefetcher or the node
//! cache, FUSE passthrough of objects whole in the node cache, and prefetching the files that
//! follow in listing order.

use super::*;

/// How long a replacement of a file waits for this mount's readers of it to close
/// ([`Fs::wait_for_readers`]), or an open or unlink for its writer ([`Fs::wait_while_written`]),
/// before it is `EBUSY`.
pub(super) const READERS_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl Fs {
    // ----- files ------------------------------------------------------------------------------

    /// `open`. Reading pins the ETag (from the cache if fresh, else a HEAD). Writing needs
    /// `O_TRUNC` and `allow_overwrite`, and starts a new upload that replaces the object.
    /// `pid` is the opening process (only its `flush` completes an upload).
    pub async fn open(&self, ino: Ino, flags: i32, pid: u32) -> Result<Opened, FsError> {
        self.open_for(ino, flags, pid, None).await
    }

    /// [`Fs::open`] for the kernel's request `request` (its `unique`, journaled with the handle:
    /// see [`Fs::forget_unanswered`]).
    pub async fn open_for(
        &self,
        ino: Ino,
        flags: i32,
        pid: u32,
        request: Option<u64>,
    ) -> Result<Opened, FsError> {
        // O_RDONLY|O_TRUNC truncates too (the kernel already checked write permission).
        let write = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
        self.wait_while_written(ino).await;
        if write {
            self.wait_for_readers(ino).await;
        }
        let (key, cached) = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
            if inode.kind == Kind::Dir {
                return Err(FsError::IsDir);
            }
            if matches!(inode.state, InodeState::Writing { .. }) {
                return Err(FsError::Busy("the file is being written"));
            }
            if write && st.io.get(&ino).is_some_and(|m| m.readers > 0) {
                // The kernel keeps one size and one page cache for the inode: the readers would
                // read the new version's bytes, or stop at its size, as their own version's.
                return Err(FsError::Busy(
                    "the file is open for reading on this mount; close it first",
                ));
            }
            if write {
                if self.cfg.read_only {
                    return Err(FsError::ReadOnly);
                }
                if flags & libc::O_TRUNC == 0 {
                    return Err(FsError::NotPermitted(
                        "existing objects can only be replaced (O_TRUNC), not modified or appended",
                    ));
                }
                if !self.cfg.allow_overwrite {
                    return Err(FsError::NotPermitted(
                        "overwrites are disabled on this mount",
                    ));
                }
                let (parent, name, path) = (inode.parent, inode.name.clone(), inode.path.clone());
                let fh = st.handles.peek_next();
                let inode = st.inodes.get_mut(ino).expect("checked");
                inode.state = InodeState::Writing { fh };
                inode.meta = Some(ObjectMeta {
                    size: 0,
                    mtime: Some(now_secs()),
                    etag: None,
                });
                inode.last_open_etag = None;
                // The kernel opens it in cached mode: no passthrough open beside it.
                st.io.entry(ino).or_default().cached += 1;
                let got = st.handles.insert_for(
                    Handle::Write(WriteHandle {
                        ino,
                        parent,
                        name,
                        key: file_key(&self.cfg.prefix, &path),
                        pid,
                        written: 0,
                        pending: Vec::new(),
                        upload: None,
                        status: WriteStatus::Open,
                        replaces: true,
                        memory: Default::default(),
                        last_write: None,
                    }),
                    request,
                );
                debug_assert_eq!(got, fh);
                return Ok(Opened {
                    fh,
                    keep_cache: false,
                });
            }
            let key = file_key(&self.cfg.prefix, &inode.path);
            let fresh = inode.valid.is_valid(Instant::now())
                && inode.meta.as_ref().is_some_and(|m| m.etag.is_some());
            // With the node cache, a version whose whole file could be handed to the kernel at
            // this open (passthrough: no read of ours checks anything) is served only once this
            // mount proved access to it (a version known only from a LIST, which needs no read
            // permission, is HEADed with its own credentials). So is an open of an inode already
            // open through passthrough: the kernel hands it the same backing file, also once
            // that file has left the cache's index. Any other open proves access on its first
            // read (see `prefetch::fetch`): no round trip here.
            let joins_passthrough = st.open_through_passthrough(ino);
            let usable = |m: &ObjectMeta| match (&self.cache, m.etag.as_deref()) {
                (Some(cache), Some(etag))
                    if joins_passthrough || cache.has_whole(&self.object_key(&key, etag)) =>
                {
                    self.is_proven(&key, etag)
                }
                _ => true,
            };
            let cached = fresh
                .then(|| inode.meta.clone())
                .flatten()
                .filter(|m| usable(m));
            (key, cached)
        };
        if cached.is_none() {
            self.prepare_whole(ino, &key);
        }
        let meta = match cached {
            Some(meta) => meta,
            None => match self.head_object(&key).await {
                Ok(info) => ObjectMeta::from(&info),
                Err(e) => {
                    if let (Some(cache), StoreError::AccessDenied(_)) = (&self.cache, &e) {
                        cache.note_denied();
                    }
                    return Err(e.into());
                }
            },
        };
        let valid = self.ttl();
        let (fh, keep_cache, new_version) = {
            let mut st = self.lock();
            // The kernel makes every open of an inode open through passthrough use the same backing
            // file: the whole file of the version those handles pinned. Another version cannot be
            // read beside them (their bytes would be served as its).
            if st.passthrough_of_another_version(ino, meta.etag.as_deref()) {
                return Err(FsError::Busy(
                "another version of the file is open for reading straight from the node cache; \
                 close it first",
            ));
            }
            let inode = st.inodes.get_mut(ino).ok_or_else(|| stale(ino))?;
            // Another version than the one the kernel was told of: its size and pages are the old
            // version's, and on a mount that keeps metadata it would not ask again (reads would stop
            // at the old size, silently).
            let mut new_version = false;
            if inode.meta.as_ref() != Some(&meta) {
                new_version = inode.meta.as_ref().is_some_and(|old| {
                    old.etag != meta.etag
                            || old.size != meta.size
                            // Without an ETag, the modification time tells versions apart.
                            || (meta.etag.is_none() && old.mtime != meta.mtime)
                });
                inode.meta = Some(meta.clone());
                inode.valid = valid;
            }
            let keep_cache = meta.etag.is_some() && inode.last_open_etag == meta.etag;
            inode.last_open_etag = meta.etag.clone();
            let (parent, name) = (inode.parent, inode.name.clone());
            let mut handle = ReadHandle::new(ino, key, meta.etag, meta.size);
            handle.last_modified = meta.mtime;
            handle.cached = self.cache.is_some() && handle.etag.is_some();
            let mut fetched_ahead = false;
            if let Some(etag) = handle.etag.as_deref() {
                // Fetched ahead by a listing-order reader, for this very version: use it.
                if let Some(part) = st.small.take(&handle.key, etag) {
                    fetched_ahead = true;
                    if part.start == 0 && part.end == handle.size {
                        handle.prefetch.parts.push_back(part);
                    }
                }
            }
            if let (true, Some(cache), Some(etag)) = (handle.cached, &self.cache, &handle.etag) {
                // Read to its end, an object larger than a block becomes one file the kernel can read
                // directly (see `passthrough_file` for why smaller ones do not).
                if handle.size > cache.block_size() {
                    cache.want_whole(self.object_key(&handle.key, etag), handle.size);
                }
            }
            self.prefetch_following(&mut st, parent, &name, fetched_ahead);
            self.note_open_for_sweep(&mut st, parent);
            let io = st.io.entry(ino).or_default();
            io.cached += 1;
            io.readers += 1;
            (
                st.handles.insert_for(Handle::Read(handle), request),
                keep_cache,
                new_version,
            )
        };
        if new_version {
            // Before the open is answered, so the kernel asks for the new size before it reads.
            if let Some(inval) = self.kernel_inval.get().cloned() {
                let _ = tokio::task::spawn_blocking(move || inval.invalidate(ino)).await;
            }
        }
        Ok(Opened { fh, keep_cache })
    }

    /// Waits, up to [`READERS_WAIT`], until `ino` is no longer being written through this mount. A
    /// file closed with nothing written (`touch f`, a `mkstemp` closed at once, a lock file) is
    /// completed at its last close, which reaches Ferry only after `close` returned: an `open` or
    /// `unlink` right after it (`tempfile`'s create, close and unlink) would otherwise be `EBUSY`.
    pub(super) async fn wait_while_written(&self, ino: Ino) {
        self.wait_while(|st| {
            st.inodes
                .get(ino)
                .is_some_and(|i| matches!(i.state, InodeState::Writing { .. }))
        })
        .await
    }

    /// Waits, up to [`READERS_WAIT`], until no read handle of `ino` is open on this mount: a
    /// reader's last close reaches Ferry (`release`) only after its `close` returned, so a
    /// replacement right after a read (`cat f; cp g f`) would otherwise find it still open.
    pub(super) async fn wait_for_readers(&self, ino: Ino) {
        self.wait_while(|st| st.io.get(&ino).is_some_and(|m| m.readers > 0))
            .await
    }

    /// Polls `busy` on the state (every 2 ms, at most [`READERS_WAIT`]) until it is false: the
    /// `release` these waits are for comes moments after the `close` that sent it returned.
    async fn wait_while(&self, busy: impl Fn(&FsState) -> bool) {
        let until = tokio::time::Instant::now() + READERS_WAIT;
        while busy(&self.lock()) && tokio::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    /// The node cache's name of `key` at `etag` on this mount's endpoint and bucket.
    pub(super) fn object_key(&self, key: &str, etag: &str) -> ObjectKey {
        ObjectKey {
            endpoint: self.cfg.endpoint.clone(),
            bucket: self.cfg.bucket.clone(),
            key: key.to_owned(),
            etag: etag.to_owned(),
        }
    }

    /// While an open proves access with a HEAD: gets the node cache's whole file of the version
    /// the inode last saw ready in the background (nothing is served before the proof).
    pub(super) fn prepare_whole(&self, ino: Ino, key: &str) {
        let Some(cache) = &self.cache else { return };
        let known = self.lock().inodes.get(ino).and_then(|i| i.meta.clone());
        let Some(ObjectMeta {
            size,
            etag: Some(etag),
            ..
        }) = known
        else {
            return;
        };
        let obj = ObjectKey {
            endpoint: self.cfg.endpoint.clone(),
            bucket: self.cfg.bucket.clone(),
            key: key.to_owned(),
            etag,
        };
        if size > 0 && cache.has_whole(&obj) {
            let cache = cache.clone();
            tokio::task::spawn_blocking(move || cache.prepare_whole(&obj, size));
        }
    }

    /// The node cache's whole file of read handle `fh`'s object version, for the kernel to read
    /// directly (FUSE passthrough), with the handle switched to passthrough: only for a handle
    /// that may use the cache (its mount proved access to this version at open), whose object
    /// is whole and checked in the cache, and whose inode has no other cached-mode handle open.
    ///
    /// Never for an object of one block or less: registering a backing file costs each open an
    /// open, an ioctl and a close, and passthrough drops the inode's page cache, so a small file
    /// re-read (a loader's next epoch) would pay that per file where the kernel's page cache
    /// (`FOPEN_KEEP_CACHE`) serves it with no work at all. Measured (`ferry-bench` P12, 2,000 ×
    /// 128 KiB, epoch 2): 15,501 files/s with passthrough per open against 32,849 from the page
    /// cache. A larger object is handed over at every open once whole, also after a cached-mode
    /// read on this mount: its pages may be gone (a dataset larger than memory), and the whole
    /// file, written through the page cache, reads at least as fast.
    ///
    /// Blocking (a first use checks the file). [`Fs::passthrough_failed`] undoes the switch.
    pub fn passthrough_file(&self, fh: u64) -> Option<std::fs::File> {
        let cache = self.cache.as_ref()?;
        let (ino, obj, size) = self.passthrough_wanted(&self.lock(), fh)?;
        if !cache.has_whole(&obj) {
            return None;
        }
        let file = cache.open_whole(&obj, size)?;
        let mut st = self.lock();
        // Another open of the inode may have come meanwhile.
        self.passthrough_wanted(&st, fh)?;
        let h = st.handles.get(fh)?;
        let mut g = h.try_lock().ok()?;
        let Handle::Read(r) = &mut *g else {
            return None;
        };
        r.passthrough = true;
        let etag = r.etag.clone();
        drop(g);
        // A successor after a crash must know: it may not open the inode in cached mode.
        st.handles.set_passthrough(fh, Some(0));
        let m = st.io.entry(ino).or_default();
        m.cached -= 1;
        m.passthrough += 1;
        m.passthrough_etag = etag;
        Some(file)
    }

    /// Whether [`Fs::passthrough_file`] could hand read handle `fh` a whole file: a quick check
    /// (no disk), so an open that will not use passthrough answers without a blocking hop.
    pub fn may_passthrough(&self, fh: u64) -> bool {
        let Some(cache) = &self.cache else {
            return false;
        };
        self.passthrough_wanted(&self.lock(), fh)
            .is_some_and(|(_, obj, _)| cache.has_whole(&obj))
    }

    /// Read handle `fh`'s inode, object version and size, if the handle may switch to
    /// passthrough (see [`Fs::passthrough_file`]).
    fn passthrough_wanted(&self, st: &FsState, fh: u64) -> Option<(Ino, ObjectKey, u64)> {
        let small = self.cache.as_ref()?.block_size();
        let h = st.handles.get(fh)?;
        let g = h.try_lock().ok()?;
        let Handle::Read(r) = &*g else { return None };
        if !r.cached || r.passthrough || r.size <= small || !st.passthrough_allowed(r.ino) {
            return None;
        }
        let etag = r.etag.as_deref()?;
        if !self.is_proven(&r.key, etag) {
            return None;
        }
        Some((r.ino, self.object_key(&r.key, etag), r.size))
    }

    /// Read handle `fh` reads through the connection's backing file `id` (registered by the
    /// adapter): kept with the handle (snapshot and journal), since every later open of the inode
    /// must use the same id while it is open, in this process or a successor.
    pub fn set_backing_id(&self, fh: u64, id: u32) {
        let mut st = self.lock();
        let Some(h) = st.handles.get(fh) else { return };
        let Ok(mut g) = h.try_lock() else { return };
        let Handle::Read(r) = &mut *g else { return };
        r.backing_id = Some(id);
        drop(g);
        st.handles.set_passthrough(fh, Some(id));
    }

    /// Handle `fh` joins the passthrough handles of its inode (whose backing file, `id`, another
    /// open registered): the kernel admits no other kind of open beside them. `false` if it is
    /// not a read handle in cached mode.
    pub fn join_passthrough(&self, fh: u64, id: u32) -> bool {
        let mut st = self.lock();
        let Some(h) = st.handles.get(fh) else {
            return false;
        };
        let Ok(mut g) = h.try_lock() else {
            return false;
        };
        let Handle::Read(r) = &mut *g else {
            return false;
        };
        if r.passthrough {
            return false;
        }
        r.passthrough = true;
        r.backing_id = Some(id);
        let (ino, etag) = (r.ino, r.etag.clone());
        drop(g);
        st.handles.set_passthrough(fh, Some(id));
        let m = st.io.entry(ino).or_default();
        m.cached = m.cached.saturating_sub(1);
        if m.passthrough == 0 {
            m.passthrough_etag = etag;
        }
        m.passthrough += 1;
        true
    }

    /// The open read handles reading through a backing file: (handle, inode, backing id). A
    /// successor's adapter takes them over.
    pub fn passthrough_handles(&self) -> Vec<(u64, Ino, Option<u32>)> {
        let st = self.lock();
        st.handles
            .entries()
            .into_iter()
            .filter_map(|(fh, h)| {
                let g = h.try_lock().ok()?;
                match &*g {
                    Handle::Read(r) if r.passthrough => Some((fh, r.ino, r.backing_id)),
                    _ => None,
                }
            })
            .collect()
    }

    /// The kernel connection refused the passthrough file: handle `fh` reads through Ferry.
    pub fn passthrough_failed(&self, fh: u64) {
        let mut st = self.lock();
        let Some(h) = st.handles.get(fh) else { return };
        let Ok(mut g) = h.try_lock() else { return };
        let Handle::Read(r) = &mut *g else { return };
        if std::mem::take(&mut r.passthrough) {
            let ino = r.ino;
            drop(g);
            st.handles.set_passthrough(fh, None);
            let m = st.io.entry(ino).or_default();
            m.passthrough = m.passthrough.saturating_sub(1);
            if m.passthrough == 0 {
                m.passthrough_etag = None;
            }
            m.cached += 1;
        }
    }

    /// A failed GET: a changed or vanished object is `ESTALE` and drops the inode's cached
    /// metadata so the next open sees the new version.
    pub(super) fn read_error(&self, ino: Ino, e: StoreError) -> FsError {
        match e {
            StoreError::PreconditionFailed(_) | StoreError::NotFound(_) => {
                if let Some(inode) = self.lock().inodes.get_mut(ino) {
                    if !inode.is_local() {
                        inode.valid = Validity::Expired;
                    }
                }
                FsError::Stale(e.to_string())
            }
            e => e.into(),
        }
    }

    /// Exactly `range` of the handle's version: from the node cache when the handle may use it,
    /// else one ranged GET pinned to the handle's ETag (a short body is retried once, then `EIO`).
    pub(super) async fn get(
        &self,
        r: &ReadHandle,
        range: std::ops::Range<u64>,
    ) -> Result<Bytes, FsError> {
        let src = self.handle_source(r);
        fetch(&src, range)
            .await
            .map_err(|e| self.read_error(r.ino, e))
    }

    /// Where to read `key` at `etag` from; `proven`: this mount's credentials showed access to
    /// that version (otherwise a cached read HEADs first).
    pub(super) fn source(&self, key: &str, etag: Option<&str>, size: u64, proven: bool) -> Source {
        self.source_at(key, etag, None, size, proven)
    }

    /// [`Self::source`] of a read handle: its version as pinned at open, proven as far as the
    /// handle's [`ReadHandle::proven_until`] says ([`Self::refresh_proof`] keeps it current).
    pub(super) fn handle_source(&self, r: &ReadHandle) -> Source {
        let proven = r.cached && r.proven_until.is_some_and(|t| Instant::now() < t);
        self.source_at(&r.key, r.etag.as_deref(), r.last_modified, r.size, proven)
    }

    /// Looks the handle's proof up again only when the one it knows has ended (or it knew none):
    /// a read of a proven handle takes no lock and allocates nothing for it.
    fn refresh_proof(&self, r: &mut ReadHandle) {
        if !r.cached || r.proven_until.is_some_and(|t| Instant::now() < t) {
            return;
        }
        if let Some(etag) = r.etag.as_deref() {
            r.proven_until =
                self.proofs
                    .proven_until(&self.cfg.bucket, &r.key, etag, self.cfg.metadata_ttl);
        }
    }

    pub(super) fn source_at(
        &self,
        key: &str,
        etag: Option<&str>,
        last_modified: Option<std::time::SystemTime>,
        size: u64,
        proven: bool,
    ) -> Source {
        Source {
            store: self.store.clone(),
            bucket: self.cfg.bucket.clone(),
            key: key.to_owned(),
            etag: etag.map(str::to_owned),
            last_modified,
            size,
            cache: self.cache.as_ref().map(|cache| CacheUse {
                cache: cache.clone(),
                endpoint: self.cfg.endpoint.clone(),
                proven,
                proofs: self.proofs.clone(),
            }),
        }
    }

    /// `read`. Sequential reads are served from parts fetched ahead by tasks (a window that grows
    /// from [`PrefetchConfig::initial_window`] to the reader's share of
    /// [`PrefetchConfig::shared_window`] (at most [`PrefetchConfig::max_window`]) as the reader
    /// consumes parts, as far as the memory budget allows); a read the kernel reordered a little
    /// behind the stream is served from the parts kept behind the reader or fetched on its own,
    /// leaving the stream as it is; any other read drops the parts
    /// (aborting their GETs), resets the window and fetches just its range, rounded out to
    /// [`PrefetchConfig::random_align`].
    pub async fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Bytes, FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        let r = match &mut *g {
            Handle::Read(r) => r,
            Handle::Write(_) => return Err(FsError::BadHandle("not open for reading")),
            Handle::Dir(_) => return Err(FsError::IsDir),
        };
        if offset >= r.size || size == 0 {
            return Ok(Bytes::new());
        }
        self.refresh_proof(r);
        let end = r.size.min(offset.saturating_add(u64::from(size)));
        let cfg = &self.prefetch;
        if !r.is_sequential(offset) && r.is_reordered(offset, cfg.part_size) {
            // The kernel's read-ahead requests for one file run concurrently and can arrive out
            // of order. A read a little behind the stream that the kept parts do not cover
            // (REORDER_KEEP) is fetched on its own; the stream, its window and parts stay.
            let r = r.clone();
            drop(g);
            return self.get(&r, offset..end).await;
        }
        if !r.is_sequential(offset) {
            r.prefetch.reset();
            r.next_offset = end;
            let align = cfg.random_align.max(1);
            let start = offset - offset % align;
            let stop = r.size.min(end.div_ceil(align).saturating_mul(align));
            let r = r.clone();
            drop(g);
            let data = self.get(&r, start..stop).await?;
            return Ok(data.slice((offset - start) as usize..(end - start) as usize));
        }
        if r.prefetch.window == 0 {
            r.prefetch.start(offset, cfg, &self.budget);
        }
        if r.prefetch.span().is_some_and(|(_, e)| offset > e) {
            // Skipped ahead past everything fetched (still within the tolerance): start there.
            r.prefetch.parts.clear();
        }
        // Parts are kept a little past the reader, for reads the kernel reorders.
        r.prefetch
            .consume_before(offset.saturating_sub(REORDER_KEEP));
        let src = self.handle_source(r);
        r.prefetch.fill(&src, r.size, offset, cfg, &self.budget);

        let mut pieces: Vec<Bytes> = Vec::with_capacity(2);
        let mut pos = offset;
        while pos < end {
            let covering = r
                .prefetch
                .parts
                .iter_mut()
                .find(|p| p.start <= pos && pos < p.end);
            let piece = match covering {
                Some(part) => {
                    let (pstart, pend) = (part.start, part.end);
                    match part.data().await {
                        Ok(data) => {
                            let stop = end.min(pend);
                            let piece =
                                data.slice((pos - pstart) as usize..(stop - pstart) as usize);
                            part.note_served(stop - pos);
                            Ok(piece)
                        }
                        Err(e) => Err(self.read_error(r.ino, e)),
                    }
                }
                None => {
                    // Not fetched ahead (the budget is exhausted, or a reordered read behind
                    // the parts): fetch just this piece.
                    let stop = r
                        .prefetch
                        .parts
                        .iter()
                        .map(|p| p.start)
                        .filter(|&s| s > pos)
                        .min()
                        .unwrap_or(end)
                        .min(end);
                    self.get(r, pos..stop).await
                }
            };
            match piece {
                Ok(piece) => {
                    pos += piece.len() as u64;
                    pieces.push(piece);
                }
                Err(e) => {
                    r.prefetch.reset();
                    return Err(e);
                }
            }
        }
        let consumed = r.prefetch.consume_before(end.saturating_sub(REORDER_KEEP));
        r.prefetch.grow(consumed, cfg, &self.budget);
        r.prefetch.fill(&src, r.size, end, cfg, &self.budget);
        // A reordered read behind the stream does not move its end back.
        r.next_offset = r.next_offset.max(end);
        Ok(match pieces.len() {
            1 => pieces.pop().expect("one"),
            _ => {
                let mut out = BytesMut::with_capacity((end - offset) as usize);
                for p in pieces {
                    out.extend_from_slice(&p);
                }
                out.freeze()
            }
        })
    }

    /// Cross-file prefetch: called when the file `name` of directory `parent` is opened for
    /// reading. When the opens follow the directory's cached listing (each one a little past the
    /// furthest opened so far, or a little behind it: several readers taking entries in turn),
    /// fetches the small files after the furthest one whole, ahead of their opens: 2, 4, 8 … up
    /// to [`PrefetchConfig::small_objects_ahead`] while the pattern holds, each charged to the
    /// budget (none when it is exhausted). An open of a file this prefetch fetched
    /// (`fetched_ahead`) follows the pattern however far from the furthest one it is: of
    /// several readers taking entries in turn, one that waited on a slow GET falls further
    /// behind the others than [`ORDER_SLACK`], and a shuffled order opens a file fetched ahead
    /// only by chance.
    pub(super) fn prefetch_following(
        &self,
        st: &mut FsState,
        parent: Ino,
        name: &str,
        fetched_ahead: bool,
    ) {
        let cfg = self.prefetch;
        st.small.expire(cfg.small_object_ttl);
        if cfg.small_object_max == 0 || cfg.small_objects_ahead == 0 {
            return;
        }
        let now = Instant::now();
        let Some(dir) = st.inodes.get(parent) else {
            return;
        };
        let Some((listing, _)) = dir.cache.cached_listing(now) else {
            return;
        };
        let Ok(idx) = listing.binary_search_by(|e| e.name.as_str().cmp(name)) else {
            return;
        };
        // (furthest entry opened, streak): an open a little past the furthest one moves it and
        // extends the streak; one a little behind it (a concurrent reader) keeps the streak; so
        // does one of a file fetched ahead, wherever it is; anything else starts over.
        let (front, streak) = match st.order.get(&parent) {
            Some(&(front, streak))
                if idx > front && (idx <= front + ORDER_SLACK || fetched_ahead) =>
            {
                (idx, streak + 1)
            }
            Some(&(front, streak))
                if idx <= front && (idx + ORDER_SLACK > front || fetched_ahead) =>
            {
                (front, streak)
            }
            _ => (idx, 0),
        };
        if st.order.len() >= ORDER_MAX && !st.order.contains_key(&parent) {
            st.order.clear();
        }
        st.order.insert(parent, (front, streak));
        if streak == 0 || Self::swept(st, parent) {
            return;
        }
        let ahead = (1usize << streak.min(16)).min(cfg.small_objects_ahead);
        let listing = listing.clone();
        let dir_path = dir.path.clone();
        for e in listing.iter().skip(front + 1).take(ahead) {
            let Some(meta) = e.meta.as_ref().filter(|_| e.kind == Kind::File) else {
                continue;
            };
            let Some(etag) = meta.etag.as_deref() else {
                continue;
            };
            if meta.size == 0 || meta.size > cfg.small_object_max {
                continue;
            }
            let key = file_key(&self.cfg.prefix, &child_path(&dir_path, &e.name));
            if st.small.contains(&key, etag) {
                continue;
            }
            let Some(reservation) = self
                .budget
                .try_reserve_for(crate::budget::Use::ReadAhead, meta.size)
            else {
                break;
            };
            let proven = self.is_proven(&key, etag);
            let part = Part::spawn(
                &self.source(&key, Some(etag), meta.size, proven),
                0..meta.size,
                Some(reservation),
            );
            st.small
                .insert(key, etag.to_owned(), part, cfg.small_object_ttl);
        }
    }
}
