//! [`PageBuf`]: the buffer a GET body is read into. One of a page or more starts on a page
//! boundary, so the node cache writes a block from it with `O_DIRECT` as it is (a block file
//! starts with the block's data), without first copying it into an aligned buffer of its own.
//! Measured (`ferry-bench --only P1`, 1 GiB read through the node cache, versitygw, 10 ms): the
//! cache's writer threads took 0.33–0.36 s of CPU with that copy, 0.24–0.28 s without it.

use std::alloc::Layout;
use std::ptr::NonNull;

use bytes::Bytes;

/// Alignment of a buffer of at least this many bytes (the page size, and what `O_DIRECT` needs
/// of a buffer on 512-byte and 4 KiB devices).
pub const PAGE: usize = 4096;

/// A growable byte buffer, page-aligned from [`PAGE`] bytes of capacity on, turned into
/// [`Bytes`] without a copy ([`PageBuf::freeze`]).
///
/// The page alignment is taken from inside an allocation a page larger than asked for, not
/// asked of the allocator: glibc's `memalign` splits each chunk to align it, and the pieces it
/// leaves kept P13's peak RSS (`ferry-bench`, 8 readers of 256 MiB) at 274–356 MiB against
/// 225–245 with plain `malloc`; a chunk of the same size each time is reused as it was
/// (215–232 MiB).
pub struct PageBuf {
    /// Where the allocation starts (what is freed).
    base: NonNull<u8>,
    /// Where the bytes start: the first page boundary in the allocation (or `base`, below a
    /// page).
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
}

// SAFETY: a `PageBuf` owns its allocation alone; `&PageBuf` only reads it.
unsafe impl Send for PageBuf {}
// SAFETY: as above; nothing is shared mutably.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// The allocation for `cap` bytes: a page more from a page on, to align within.
    fn layout(cap: usize) -> Layout {
        let slack = if cap >= PAGE { PAGE } else { 0 };
        Layout::from_size_align(cap + slack, 16).expect("a buffer's layout")
    }

    /// An empty buffer for `cap` bytes (no allocation for 0).
    pub fn with_capacity(cap: usize) -> Self {
        if cap == 0 {
            return Self {
                base: NonNull::dangling(),
                ptr: NonNull::dangling(),
                cap: 0,
                len: 0,
            };
        }
        let layout = Self::layout(cap);
        // SAFETY: the layout has a non-zero size.
        let base = unsafe { std::alloc::alloc(layout) };
        let base = NonNull::new(base).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        let skip = if cap >= PAGE {
            (base.as_ptr() as usize).next_multiple_of(PAGE) - base.as_ptr() as usize
        } else {
            0
        };
        // SAFETY: `skip < PAGE`, and from a page on the allocation is `cap + PAGE` bytes: the
        // buffer's `cap` bytes from `base + skip` lie within it.
        let ptr = unsafe { NonNull::new_unchecked(base.as_ptr().add(skip)) };
        Self {
            base,
            ptr,
            cap,
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Appends `data`, moving to a buffer twice as large (or as large as needed) if it does not
    /// fit: a body longer than announced still arrives whole.
    pub fn extend_from_slice(&mut self, data: &[u8]) {
        let need = self.len + data.len();
        if need > self.cap {
            let mut grown = Self::with_capacity(need.max(self.cap * 2));
            grown.extend_from_slice(self.as_ref());
            *self = grown;
        }
        // SAFETY: `need <= cap`: the destination lies within the allocation, past the bytes
        // written so far; `data` is another object's memory, so the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.as_ptr().add(self.len),
                data.len(),
            );
        }
        self.len = need;
    }

    /// The bytes written, as [`Bytes`] owning this buffer (freed when the last clone goes).
    pub fn freeze(self) -> Bytes {
        if self.cap == 0 {
            return Bytes::new();
        }
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for PageBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the first `len` bytes of the allocation were written by `extend_from_slice`
        // (for `cap == 0`, `len == 0` and a dangling, aligned pointer is valid for 0 bytes).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: `base` was allocated in `with_capacity` with this very layout.
            unsafe { std::alloc::dealloc(self.base.as_ptr(), Self::layout(self.cap)) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer of a page or more starts on a page boundary, also once it has grown, and holds
    /// exactly what was appended, in order.
    #[test]
    fn buffers_of_a_page_or_more_are_page_aligned_and_keep_every_byte() {
        for (cap, pieces) in [
            (PAGE, vec![PAGE]),
            (1 << 20, vec![100, 16 << 10, (1 << 20) - 100 - (16 << 10)]),
            (PAGE, vec![PAGE - 1, 2, 5000]),
            (0, vec![10, PAGE * 3]),
            (100, vec![50]),
        ] {
            let mut b = PageBuf::with_capacity(cap);
            let mut want = Vec::new();
            for (i, n) in pieces.iter().enumerate() {
                let data: Vec<u8> = (0..*n).map(|j| (i * 31 + j * 7) as u8).collect();
                b.extend_from_slice(&data);
                want.extend_from_slice(&data);
                if b.capacity() >= PAGE {
                    assert!(
                        (b.as_ref().as_ptr() as usize).is_multiple_of(PAGE),
                        "cap {cap}, after piece {i}"
                    );
                }
            }
            assert_eq!(b.len(), want.len());
            let bytes = b.freeze();
            assert_eq!(&bytes[..], &want[..], "cap {cap}");
            if want.len() >= PAGE {
                assert!(
                    (bytes.as_ptr() as usize).is_multiple_of(PAGE),
                    "cap {cap}: frozen"
                );
            }
        }
        assert!(PageBuf::with_capacity(0).freeze().is_empty());
    }
}
