//! The kernel's directory cache (`FOPEN_CACHE_DIR`, kernel 4.20+): what a directory's cached
//! entries in the kernel may hold, so that `opendir` asks for them to be kept
//! (`FOPEN_KEEP_CACHE`) only when they are exactly what this mount would list.
//!
//! How the kernel uses it (`fs/fuse/readdir.c`): a handle opened with `FOPEN_CACHE_DIR` appends
//! the entries it is answered to a per-directory cache, each only if it goes on exactly from the
//! cache's last entry (its position, the `d_off` we gave, equals the cache's end), and the empty
//! answer at that end marks the cache complete. Only a complete cache is read, from its start,
//! and by any handle opened with `FOPEN_CACHE_DIR`: without `FOPEN_KEEP_CACHE` the `opendir`
//! drops it first. The kernel itself resets it when a change through this mount (create,
//! unlink, …) bumps the directory's i_version, or a page of it was reclaimed.
//!
//! What Ferry adds:
//! - **Tagged offsets.** Each distinct snapshot a handle serves gets a tag, and every `d_off` of
//!   that handle carries it in its high 32 bits. A cache being filled by one snapshot can then
//!   only be gone on from by a handle serving the same snapshot: two handles listing different
//!   contents (a listing taken before and after a change) never interleave their entries into
//!   one cache. Handles serving the directory's kept listing share its tag.
//! - **Which tags a complete cache may hold.** A tag is noted when its handle is answered the end
//!   of the directory; the notes are forgotten at an `opendir` that drops the cache while no
//!   handle that started a listing in this process is still open (an open one could still fill
//!   it). `FOPEN_KEEP_CACHE` is given only when every noted tag is the tag of the listing the new
//!   handle is pinned to, and before anything is known (a new process after a handover, whose
//!   predecessor's cache may still be there) never.
//!
//! The kernel answers a complete cache without asking, also to a stream held open and rewound.
//! So on a mount with a TTL, the end of the TTL of what a cache was filled with has the kernel
//! drop it (`FUSE_NOTIFY_INVAL_INODE`, see `Fs::drop_kernel_dir_at`), and a handle pinned to a
//! listing whose TTL ended before it was read lists afresh. With a TTL of 0, or with no way to
//! notify the kernel, directories are not cached there.

use std::sync::{Arc, Weak};

use crate::names::ListedEntry;

use super::Snapshot;

/// Most tags noted per directory; past it the directory is as if nothing were known.
const NOTED_MAX: usize = 16;

/// The `d_off` of entry `index` (`.` is 0, `..` 1, the listing's entries from 2) served by a
/// handle whose snapshot has tag `tag`: where the next `readdir` goes on (`index + 1`), tag above.
pub fn offset(tag: u32, index: u64) -> u64 {
    (u64::from(tag) << 32) | (index + 1)
}

/// The entry index a `readdir` at `offset` starts from (the tag is only for the kernel's cache).
pub fn index(offset: u64) -> u64 {
    offset & 0xffff_ffff
}

/// Hands out tags: non-zero (0 marks an untagged handle), below 2^31 so every offset is a
/// positive `loff_t`, starting at a per-process value so that a successor's tags are not its
/// predecessor's, whose offsets may still be in the kernel's caches.
#[derive(Debug)]
pub struct Tags(u32);

impl Tags {
    pub fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Tags((nanos ^ std::process::id().rotate_left(16)) & 0x7fff_ffff)
    }

    /// Tags after `tag` (a successor's, above those of the handles it took over, which may
    /// still be filling the kernel's caches).
    pub fn after(tag: u32) -> Self {
        Tags(tag & 0x7fff_ffff)
    }

    fn next(&mut self) -> u32 {
        self.0 = (self.0 + 1) & 0x7fff_ffff;
        if self.0 == 0 {
            self.0 = 1;
        }
        self.0
    }
}

/// What Ferry knows of one directory's cache in the kernel.
#[derive(Debug, Default)]
pub struct KernelDir {
    /// Open handles of this directory that started a listing (were answered at offset 0) in this
    /// process: any of them may still append to the kernel's cache.
    pub active: usize,
    /// The tags a complete cache may hold; `None`: unknown (anything may be there).
    noted: Option<Vec<u32>>,
    /// The snapshot last tagged (weak: its allocation stays while it is remembered, so a new
    /// snapshot never takes its address) and its tag.
    last: Weak<Vec<ListedEntry>>,
    last_tag: u32,
}

impl KernelDir {
    /// The tag of `snapshot`: the same as the last one's if it is the same allocation (snapshots
    /// are never changed in place while shared), else a new one.
    pub fn tag_for(&mut self, snapshot: &Snapshot, tags: &mut Tags) -> u32 {
        if self.last_tag != 0 && std::ptr::eq(self.last.as_ptr(), Arc::as_ptr(snapshot)) {
            return self.last_tag;
        }
        self.last = Arc::downgrade(snapshot);
        self.last_tag = tags.next();
        self.last_tag
    }

    /// Whether a complete cache can hold nothing but `tag`'s entries (or nothing at all).
    pub fn holds_only(&self, tag: u32) -> bool {
        self.noted
            .as_ref()
            .is_some_and(|v| v.iter().all(|t| *t == tag))
    }

    /// An `opendir` without `FOPEN_KEEP_CACHE`: the kernel drops the cache's pages. What a
    /// complete cache holds from now on is filled after it, by handles that are open now or
    /// opened later; with none open that started a listing, by tags noted from now on only.
    pub fn dropped(&mut self) {
        if self.active == 0 {
            self.noted = Some(Vec::new());
        }
    }

    /// A handle with snapshot tag `tag` was answered the end of the directory: the kernel may
    /// have completed its cache with it.
    pub fn ended(&mut self, tag: u32) {
        if let Some(v) = &mut self.noted {
            if !v.contains(&tag) {
                v.push(tag);
            }
            if v.len() > NOTED_MAX {
                self.noted = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_carry_the_tag_and_give_back_the_index() {
        let off = offset(0x7fff_ffff, 41);
        assert_eq!(index(off), 42);
        assert!(i64::try_from(off).is_ok(), "a positive loff_t");
        assert_eq!(offset(0, 5), 6, "untagged offsets are plain indices");
    }

    #[test]
    fn tags_are_per_allocation_and_never_zero() {
        let mut tags = Tags(0x7fff_fffe);
        let mut k = KernelDir::default();
        let a: Snapshot = Arc::new(vec![]);
        let ta = k.tag_for(&a, &mut tags);
        assert_eq!(ta, 0x7fff_ffff);
        assert_eq!(
            k.tag_for(&a.clone(), &mut tags),
            ta,
            "the same listing, the same tag"
        );
        let b: Snapshot = Arc::new(vec![]);
        let tb = k.tag_for(&b, &mut tags);
        assert_ne!(tb, ta);
        assert_ne!(tb, 0, "wraps past zero");
        // A snapshot tagged again after another one gets a new tag: never one another
        // content had.
        assert_ne!(k.tag_for(&a, &mut tags), ta);
    }

    #[test]
    fn a_cache_is_kept_only_once_known_to_hold_one_tag() {
        let mut k = KernelDir::default();
        assert!(
            !k.holds_only(7),
            "unknown at first: a predecessor's cache may be there"
        );
        k.active = 1;
        k.dropped();
        assert!(
            !k.holds_only(7),
            "an open handle could still have filled it"
        );
        k.active = 0;
        k.dropped();
        assert!(k.holds_only(7), "dropped with no handle open: empty");
        k.ended(7);
        assert!(k.holds_only(7));
        k.active = 1;
        k.ended(8);
        assert!(
            !k.holds_only(7) && !k.holds_only(8),
            "two contents may be in it"
        );
        k.dropped();
        assert!(!k.holds_only(8), "not forgotten while a handle is open");
        k.active = 0;
        k.dropped();
        assert!(k.holds_only(8));
        for t in 0..=NOTED_MAX as u32 {
            k.ended(100 + t);
        }
        k.dropped();
        assert!(k.holds_only(1), "forgotten at a drop with none open");
        k.active = 1;
        for t in 0..=NOTED_MAX as u32 {
            k.ended(100 + t);
        }
        k.active = 0;
        assert!(!k.holds_only(100), "too many: unknown");
    }
}
