//! The write path: `create`, sequential `write`s buffered into multipart parts (the buffer is
//! charged to the node memory budget), and the upload's completion at `flush`, `fsync` or
//! `release`.

use super::*;

/// The first charge of a write buffer to the memory budget (a small file's whole buffer).
const WRITE_CHARGE_MIN: u64 = 64 << 10;
/// Up to this size a write buffer's charge doubles; past it, it is a whole part (and a write).
const WRITE_CHARGE_STEP: u64 = 1 << 20;

/// The pauses before an upload request (a part, a PUT, a CompleteMultipartUpload) that failed for
/// a reason that may pass is tried again (after the store's own retries): about a minute in all.
const UPLOAD_RETRY_PAUSES: [std::time::Duration; 5] = [
    std::time::Duration::from_secs(2),
    std::time::Duration::from_secs(4),
    std::time::Duration::from_secs(8),
    std::time::Duration::from_secs(16),
    std::time::Duration::from_secs(30),
];

impl Fs {
    /// `create`: a new local file and a write handle; the object appears when the upload
    /// completes (first flush by the opener, fsync, or release).
    pub async fn create(
        &self,
        parent: Ino,
        name: &OsStr,
        pid: u32,
    ) -> Result<(Entry, Opened), FsError> {
        self.create_for(parent, name, pid, None).await
    }

    /// [`Fs::create`] for the kernel's request `request` (its `unique`, journaled with the
    /// handle: see [`Fs::forget_unanswered`]).
    pub async fn create_for(
        &self,
        parent: Ino,
        name: &OsStr,
        pid: u32,
        request: Option<u64>,
    ) -> Result<(Entry, Opened), FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        let name = new_name(name)?;
        // A path's inode number is the same after an unlink: a reader still holding the unlinked
        // file would read the new file's bytes (and size) as its own. Its last close may still be
        // on its way.
        let ino = {
            let st = self.lock();
            let path = self.check_new_child(&st, parent, name)?;
            st.inodes.ino_for(parent, name, &path, Kind::File)
        };
        self.wait_for_readers(ino).await;
        let mut st = self.lock();
        let path = self.check_new_child(&st, parent, name)?;
        let key = file_key(&self.cfg.prefix, &path);
        if key.len() > KEY_MAX {
            return Err(FsError::NameTooLong);
        }
        // Again under this lock: a reader may have opened it during the wait.
        let ino = st.inodes.ino_for(parent, name, &path, Kind::File);
        if st.io.get(&ino).is_some_and(|m| m.readers > 0) {
            return Err(FsError::Busy(
                "a file of that name, deleted, is still open for reading on this mount; close it \
                 first",
            ));
        }
        let fh = st.handles.peek_next();
        let ino = st
            .inodes
            .install_child(parent, name, Kind::File)
            .ok_or_else(|| stale(parent))?;
        let inode = st.inodes.get_mut(ino).expect("installed");
        inode.state = InodeState::Writing { fh };
        inode.meta = Some(ObjectMeta {
            size: 0,
            mtime: Some(now_secs()),
            etag: None,
        });
        inode.valid = Validity::Expired;
        inode.last_open_etag = None;
        inode.lookups += 1;
        let entry = self.entry_of(inode);
        if let Some(p) = st.inodes.get_mut(parent) {
            p.cache.negative.remove(name);
        }
        st.changes += 1;
        // The kernel opens it in cached mode: no passthrough open beside it.
        st.io.entry(ino).or_default().cached += 1;
        let got = st.handles.insert_for(
            Handle::Write(WriteHandle {
                ino,
                parent,
                name: name.to_owned(),
                key,
                pid,
                written: 0,
                pending: Vec::new(),
                upload: None,
                status: WriteStatus::Open,
                replaces: false,
                memory: Default::default(),
                last_write: None,
            }),
            request,
        );
        debug_assert_eq!(got, fh);
        Ok((
            entry,
            Opened {
                fh,
                keep_cache: false,
            },
        ))
    }

    pub(super) fn set_local_size(&self, ino: Ino, size: u64) {
        if let Some(inode) = self.lock().inodes.get_mut(ino) {
            inode.meta = Some(ObjectMeta {
                size,
                mtime: Some(now_secs()),
                etag: None,
            });
        }
    }

    /// `write`: appends at the current end only; full parts are uploaded as they fill.
    pub async fn write(&self, fh: u64, offset: u64, data: &[u8]) -> Result<u32, FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        let Handle::Write(w) = &mut *g else {
            return Err(FsError::BadHandle("not open for writing"));
        };
        match w.status {
            WriteStatus::Open => {}
            WriteStatus::Completed => {
                return Err(FsError::BadHandle(
                    "the upload completed (at a close after writing, or fsync); no more writes",
                ))
            }
            WriteStatus::Failed => return Err(FsError::UploadFailed),
        }
        // A write refused ends the upload: the object is not created or replaced (its `close`
        // fails with EIO), never committed with the bytes before the gap.
        if offset != w.written {
            self.fail_write(w).await;
            return Err(FsError::InvalidArgument(
                "writes must be sequential (offset = current size); the file will not be uploaded",
            ));
        }
        let len = data.len() as u64;
        if w.written + len > (PART_SIZE * MAX_PARTS) as u64 {
            self.fail_write(w).await;
            return Err(FsError::FileTooLarge);
        }
        self.charge_buffer(w, w.pending.len() + data.len()).await;
        w.pending.extend_from_slice(data);
        w.written += len;
        if w.pending.len() >= PART_SIZE {
            while w.pending.len() >= PART_SIZE {
                let rest = w.pending.split_off(PART_SIZE);
                let part = std::mem::replace(&mut w.pending, rest);
                if let Err(e) = self.upload_part(w, part).await {
                    self.fail_write(w).await;
                    return Err(e);
                }
            }
            // The uploaded parts' memory is free again, and the charge stays a part plus a write
            // of this size (no more, after one huge write): the next part is buffered under it
            // without asking the budget again. Given back each part, it was asked again twice a
            // part, and with the budget held by writers that stopped mid-file (each keeps its
            // part's charge until it closes) every such ask waited the whole bounded wait:
            // writers went at a part per two waits.
            let keep = PART_SIZE as u64 + len.min(PART_SIZE as u64);
            w.memory.shrink_to(keep.max(w.pending.capacity() as u64));
        }
        // Stamped once the write is done: a part upload may take a while (retried for a minute),
        // and its writer is not idle.
        w.last_write = Some(Instant::now());
        self.set_local_size(w.ino, w.written);
        u32::try_from(len).map_err(|_| FsError::InvalidArgument("write larger than 4 GiB"))
    }

    /// Gives back what writers with no write for `idle` hold of the memory budget (and of the
    /// heap) beyond their buffered bytes: past a part, a writer keeps a part plus a write charged
    /// for the next part ([`Fs::charge_buffer`]), which a file written now and then for days (a
    /// training log, metrics, an event file, one per pod) would hold all along, while readers'
    /// prefetching went without. Such a writer asks the budget again at its next write. A handle
    /// in use is passed over, and no other kind is locked. Returns the bytes given back.
    pub fn shrink_idle_writers(&self, idle: std::time::Duration) -> u64 {
        let writers = self.lock().handles.writers();
        let mut freed = 0;
        for h in writers {
            let Ok(mut g) = h.try_lock() else { continue };
            let Handle::Write(w) = &mut *g else { continue };
            let idle_for = w.last_write.map(|t| t.elapsed());
            if w.status != WriteStatus::Open || idle_for.is_none_or(|d| d < idle) {
                continue;
            }
            let (charged, kept) = (w.memory.bytes(), w.pending.len() as u64);
            if charged > kept {
                w.pending.shrink_to_fit();
                w.memory.shrink_to(kept);
                freed += charged - kept;
            }
        }
        freed
    }

    /// Charges `w`'s buffer to the memory budget for `need` bytes, waiting for the budget (at most
    /// [`PrefetchConfig::write_budget_wait`]) if need be. The charge grows by doubling from
    /// [`WRITE_CHARGE_MIN`] to [`WRITE_CHARGE_STEP`] (a small file's buffer), then at once to a
    /// whole part plus the write, and stays there (a part plus the last write, two parts at most)
    /// until the upload completes or fails, or the writer is idle ([`Fs::shrink_idle_writers`]):
    /// the next parts are buffered under it. So a writer waits at most twice a file while its
    /// writes keep their size and it keeps writing, and one that waits for its part holds at most
    /// [`WRITE_CHARGE_STEP`].
    async fn charge_buffer(&self, w: &mut WriteHandle, need: usize) {
        let need = need as u64;
        let have = w.memory.bytes();
        if need <= have {
            // Under the charge, the buffer still grows to what is charged (below), never by
            // `Vec`'s doubling.
            if w.pending.capacity() < need as usize {
                w.pending.reserve_exact(have as usize - w.pending.len());
            }
            return;
        }
        let write = need.saturating_sub(w.pending.len() as u64);
        let target = if need <= WRITE_CHARGE_STEP {
            need.max((have * 2).clamp(WRITE_CHARGE_MIN, WRITE_CHARGE_STEP))
        } else {
            need.max(PART_SIZE as u64 + write)
        };
        w.memory
            .grow_to(&self.budget, target, self.prefetch.write_budget_wait)
            .await;
        // The buffer grows to what is charged, never by `Vec`'s own doubling: past a part that
        // would allocate twice the part (and copy into it) where a part and one write were
        // charged.
        let charged = w.memory.bytes() as usize;
        if w.pending.capacity() < need as usize {
            w.pending
                .reserve_exact(charged.max(need as usize) - w.pending.len());
        }
    }

    pub(super) async fn upload_part(
        &self,
        w: &mut WriteHandle,
        part: Vec<u8>,
    ) -> Result<(), FsError> {
        if w.upload.is_none() {
            let upload_id = self.store.create_multipart(self.bucket(), &w.key).await?;
            w.upload = Some(MultipartState {
                upload_id,
                parts: Vec::new(),
            });
        }
        let up = w.upload.as_mut().expect("set above");
        let number = i32::try_from(up.parts.len() + 1).map_err(|_| FsError::FileTooLarge)?;
        let part = Bytes::from(part);
        // A part is the same request again (S3 keeps the last upload of a part number).
        let (b, k, id) = (self.bucket(), &w.key, &up.upload_id);
        let what = format!("part {number}");
        let done = retried(k, &what, || {
            self.store.upload_part(b, k, id, number, part.clone())
        })
        .await?;
        up.parts.push(PartRecord {
            number,
            etag: done.etag,
        });
        Ok(())
    }

    pub(super) async fn abort_upload(&self, key: &str, up: &MultipartState) {
        if let Err(e) = self
            .store
            .abort_multipart(self.bucket(), key, &up.upload_id)
            .await
        {
            tracing::warn!(key, error = %e, "aborting a multipart upload failed");
        }
    }

    /// The upload failed: the file disappears from this mount (an overwritten object stays).
    pub(super) async fn fail_write(&self, w: &mut WriteHandle) {
        w.status = WriteStatus::Failed;
        w.pending = Vec::new();
        w.memory.release();
        if let Some(up) = w.upload.take() {
            self.abort_upload(&w.key, &up).await;
        }
        let mut st = self.lock();
        if let Some(inode) = st.inodes.get_mut(w.ino) {
            inode.state = InodeState::Remote;
            inode.meta = None;
            inode.valid = Validity::Expired;
        }
        st.inodes.maybe_remove(w.ino);
    }

    /// Finishes the upload (PUT, or last part + complete). Idempotent once completed.
    pub(super) async fn complete(&self, w: &mut WriteHandle) -> Result<(), FsError> {
        match w.status {
            WriteStatus::Open => {}
            WriteStatus::Completed => return Ok(()),
            WriteStatus::Failed => return Err(FsError::UploadFailed),
        }
        // A new name, on a mount that may not replace objects: created only if still absent
        // (`If-None-Match: *`), so that an object someone else put there since this mount looked
        // is never replaced; refused, the file is not created (`EEXIST`).
        let if_absent = !w.replaces && !self.cfg.allow_overwrite;
        let result = match w.upload.is_some() {
            false => {
                let body = Bytes::from(std::mem::take(&mut w.pending));
                // The same request again: a create whose first answer was lost finds its own
                // bytes (the store tells by their MD5).
                let (b, k) = (self.bucket(), &w.key);
                let put = retried(k, "PUT", || async {
                    if if_absent {
                        self.store.put_if_absent(b, k, body.clone()).await
                    } else {
                        self.store.put(b, k, body.clone()).await
                    }
                })
                .await;
                put.map_err(|e| created_elsewhere(e, if_absent))
            }
            true => {
                let last = std::mem::take(&mut w.pending);
                let uploaded = if last.is_empty() {
                    Ok(())
                } else {
                    self.upload_part(w, last).await
                };
                match uploaded {
                    Err(e) => Err(e),
                    Ok(()) => {
                        let up = w.upload.as_ref().expect("multipart");
                        let parts: Vec<CompletedPart> = up
                            .parts
                            .iter()
                            .map(|p| CompletedPart {
                                part_number: p.number,
                                etag: p.etag.clone(),
                            })
                            .collect();
                        // Again, a Complete whose first answer was lost finds its upload gone
                        // and the object there: the store tells it is this one by its ETag.
                        let (b, k, id) = (self.bucket(), &w.key, &up.upload_id);
                        let done = retried(k, "CompleteMultipartUpload", || async {
                            let parts = parts.clone();
                            if if_absent {
                                self.store
                                    .complete_multipart_if_absent(b, k, id, parts)
                                    .await
                            } else {
                                self.store.complete_multipart(b, k, id, parts).await
                            }
                        })
                        .await;
                        done.map_err(|e| created_elsewhere(e, if_absent))
                    }
                }
            }
        };
        let put = match result {
            Ok(put) => put,
            Err(e) => {
                tracing::warn!(key = %w.key, error = %e, "upload failed");
                self.fail_write(w).await;
                return Err(e);
            }
        };
        w.status = WriteStatus::Completed;
        w.upload = None;
        w.memory.release();
        let meta = ObjectMeta {
            size: w.written,
            mtime: Some(now_secs()),
            etag: put.etag,
        };
        let valid = self.ttl();
        let mut st = self.lock();
        st.changes += 1;
        if let Some(inode) = st.inodes.get_mut(w.ino) {
            inode.state = InodeState::Remote;
            inode.meta = Some(meta.clone());
            inode.valid = valid;
            inode.last_open_etag = None;
        }
        if let Some(p) = st.inodes.get_mut(w.parent) {
            p.cache.add_positive(
                &w.name,
                CachedEntry {
                    kind: Kind::File,
                    meta: Some(meta),
                },
            );
        }
        // Local ancestors now exist in S3 (implicitly); their parents' cached listings lack them:
        // the parents learn them (lookups find them; new `opendir`s list again).
        let mut up = w.parent;
        while let Some(dir) = st.inodes.get_mut(up) {
            if dir.state != InodeState::LocalDir {
                break;
            }
            dir.valid = valid;
            let name = dir.name.clone();
            let this = std::mem::replace(&mut up, dir.parent);
            st.inodes.set_state(this, InodeState::Remote);
            if let Some(parent) = st.inodes.get_mut(up) {
                parent.cache.add_positive(
                    &name,
                    CachedEntry {
                        kind: Kind::Dir,
                        meta: None,
                    },
                );
            }
        }
        st.inodes.maybe_remove(w.ino);
        Ok(())
    }

    /// `flush` (every `close`): completes the upload when called by the opening process after
    /// something was written, so `close` reports upload errors; other processes' closes (forked
    /// children) do nothing. A flush before the first write does nothing either: a shell's
    /// `> file` (and `dd`, `/bin/echo`) opens the file, `dup2`s it onto stdout and closes the
    /// first descriptor before anything is written; the empty file is then completed by a later
    /// flush, `fsync` or `release`. `pid` gives the caller's process id; it is asked only for a
    /// write handle with data. A failed upload is reported to the opener's flush even with
    /// nothing written (a write handle recovered from the journal has lost what was written).
    pub async fn flush(&self, fh: u64, pid: impl FnOnce() -> u32) -> Result<(), FsError> {
        self.flush_by(fh, pid, |_| Closing::Last).await
    }

    /// [`Fs::flush`]; `closing` (asked only of the opener's flush of a write handle with data,
    /// given the bytes written so far: the position of the file's descriptors) tells what the
    /// opener's close is:
    /// - [`Closing::Killed`]: the opener is on its way out of a fatal signal (`kill -9`, an OOM
    ///   kill, a crash: the kernel closes a dying process's files). The upload is abandoned, as
    ///   an unmount does: a file cut off mid-write is never committed as a truncated object, nor
    ///   does it replace a good one.
    /// - [`Closing::StillHeld`]: the opener still holds the file at another descriptor (a shell
    ///   builtin's redirection `echo x >&2` `dup2`s over the descriptor and puts it back): the
    ///   upload goes on, and the close of the last descriptor completes it.
    /// - [`Closing::Last`]: the upload completes, and the close reports how it went.
    ///
    /// An opener this mount cannot see (tgid 0: a process outside the node plugin's pid
    /// namespace) cannot be told from its children, whose closes must not complete it: its
    /// upload is completed by the last close (`release`) only.
    pub async fn flush_by(
        &self,
        fh: u64,
        pid: impl FnOnce() -> u32,
        closing: impl FnOnce(u64) -> Closing,
    ) -> Result<(), FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        match &mut *g {
            Handle::Write(w) if w.written > 0 || w.status == WriteStatus::Failed => {
                if w.pid == 0 {
                    return Ok(());
                }
                if pid() != w.pid {
                    return Ok(());
                }
                if w.status == WriteStatus::Open {
                    match closing(w.written) {
                        Closing::Killed => {
                            tracing::warn!(key = %w.key, bytes = w.written, "the writing process was killed mid-file: its upload is abandoned (never a truncated object)");
                            self.fail_write(w).await;
                            return Err(FsError::UploadFailed);
                        }
                        Closing::StillHeld => {
                            tracing::debug!(key = %w.key, "a descriptor closed while the writer holds another: the upload goes on");
                            return Ok(());
                        }
                        Closing::Last => {}
                    }
                }
                self.complete(w).await
            }
            Handle::Write(_) | Handle::Read(_) | Handle::Dir(_) => Ok(()),
        }
    }

    /// `fsync`: completes the upload (a file cannot be made durable in parts).
    pub async fn fsync(&self, fh: u64) -> Result<(), FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        match &mut *g {
            Handle::Write(w) => self.complete(w).await,
            Handle::Read(_) | Handle::Dir(_) => Ok(()),
        }
    }
}

/// Runs `attempt` (an upload request, the same each time) until it succeeds or fails for a
/// reason that will not pass, pausing [`UPLOAD_RETRY_PAUSES`] between tries: past the store's own
/// retries, a server restarting, throttling or the identity provider out for up to about a minute
/// does not lose a file (for a file of many parts, a few seconds' outage would). `what` and `key`
/// name it in the log.
async fn retried<T, F, Fut>(key: &str, what: &str, mut attempt: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut pauses = UPLOAD_RETRY_PAUSES.iter();
    loop {
        match (attempt().await, pauses.next()) {
            (Ok(done), _) => return Ok(done),
            (
                Err(
                    e @ (StoreError::Transient(_)
                    | StoreError::Throttled(_)
                    | StoreError::CredentialsUnavailable(_)),
                ),
                Some(pause),
            ) => {
                tracing::warn!(%key, request = what, error = %e, pause_s = pause.as_secs(), "an upload request failed; trying it again");
                tokio::time::sleep(*pause).await;
            }
            (Err(e), _) => return Err(e),
        }
    }
}

/// What the opening process's close of a file being written is ([`Fs::flush_by`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closing {
    /// A close of the process's last descriptor of the file: the upload completes.
    Last,
    /// A close while the process holds the file at another descriptor: the upload goes on.
    StillHeld,
    /// The process is exiting on a fatal signal: the upload is abandoned.
    Killed,
}

/// A conditional create refused because an object has the key (put by someone else since this
/// mount looked) is `EEXIST`; every other failure is the store's.
fn created_elsewhere(e: StoreError, if_absent: bool) -> FsError {
    match e {
        StoreError::PreconditionFailed(_) if if_absent => {
            tracing::warn!(error = %e, "not created: an object was put at this key meanwhile, and this mount may not replace objects");
            FsError::Exists
        }
        e => FsError::from(e),
    }
}
