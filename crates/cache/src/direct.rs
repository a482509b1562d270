//! Cache files written with `O_DIRECT`: the filled bytes go to the disk from the caller's
//! page-aligned memory or from a reused, page-aligned buffer, with no page-cache page allocated,
//! copied into and written back per byte.
//!
//! Measured on the 2-CPU benchmark VM (ext4 on virtio, `dd` of 512 MiB in 4 MiB writes): buffered
//! writes cost 0.34–0.81 s of kernel CPU, `O_DIRECT` ones 0.05–0.06 s, at 1.2–1.4 GB/s. With the
//! page-cache copy, a cold read with the node cache on ran at 0.48–0.66 × the same read without
//! it (`doc/BENCHMARKS.md`, issue 17): the copy took the readers' CPU.
//!
//! `O_DIRECT` needs the buffer, the file offset and the length aligned to the device's logical
//! block size: [`ALIGN`] (4 KiB) covers 512-byte and 4 KiB devices. Data that is itself
//! [`ALIGN`]-aligned in memory, written at an aligned file offset (a block's data: a block file
//! starts with it, and the S3 client reads bodies into page-aligned buffers), goes to the disk
//! from where it is, whole pages at a time; only the rest is copied into the buffer. A block
//! file is whole pages (its trailer is padded, [`crate::block`]): its data and trailer go to the
//! disk in one `pwritev` ([`DirectFile::write_pages`]). A last piece shorter than a page (a file
//! that is not whole pages) is written through the page cache, at its exact length, once
//! `O_DIRECT` is cleared on the descriptor. A filesystem
//! that refuses `O_DIRECT` (tmpfs on older kernels, some FUSE or network filesystems) is found
//! by [`supported`] once, at cache open, and written through the page cache as before.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

/// Alignment of buffer, offsets and lengths.
pub const ALIGN: usize = 4096;
/// Bytes written per `pwrite`: one default block (a block file is its header plus one write).
const BUF: usize = 4 << 20;

/// A zeroed, [`ALIGN`]-aligned heap buffer of [`BUF`] bytes.
struct Aligned(NonNull<u8>);

impl Aligned {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(BUF, ALIGN).expect("valid layout")
    }

    fn new() -> Self {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        Self(NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout())))
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `self.0` points to BUF bytes allocated (and zeroed) in `new`, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr(), BUF) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.0.as_ptr(), Self::layout()) }
    }
}

thread_local! {
    /// Each writing thread's buffer, kept: its pages stay resident, where a fresh buffer per file
    /// would fault in new pages (what the page cache does per byte).
    static SPARE: RefCell<Option<Aligned>> = const { RefCell::new(None) };
}

/// A new file at `path` (created or truncated), written with `O_DIRECT` through this thread's
/// buffer. [`DirectFile::finish`] writes the last piece and sets the file's length; dropping it
/// unfinished leaves a partial file (the caller deletes it).
pub struct DirectFile {
    file: File,
    buf: Option<Aligned>,
    filled: usize,
    offset: u64,
    /// Bytes copied into the buffer (the rest went to the disk from the caller's memory).
    copied: u64,
}

impl DirectFile {
    pub fn create(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)?;
        let buf = SPARE
            .with(|s| s.borrow_mut().take())
            .unwrap_or_else(Aligned::new);
        Ok(Self {
            file,
            buf: Some(buf),
            filled: 0,
            offset: 0,
            copied: 0,
        })
    }

    /// Bytes that went through the buffer so far (not written from the caller's memory).
    pub fn copied(&self) -> u64 {
        self.copied
    }

    /// Writes `head` and then `tail` as a new file's first bytes in one `pwritev` (one device
    /// write), `head` from where it is and `tail` through the buffer, when both are whole pages,
    /// `head` page-aligned in memory and nothing written yet; `Ok(false)`, nothing written, when
    /// they are not (then write them with [`Write`]). A block file is its data and its padded
    /// trailer ([`crate::block`]).
    pub fn write_pages(&mut self, head: &[u8], tail: &[u8]) -> io::Result<bool> {
        use std::os::fd::AsRawFd;
        let whole = |b: &[u8]| b.len().is_multiple_of(ALIGN);
        if self.filled != 0
            || self.offset != 0
            || !whole(head)
            || !whole(tail)
            || tail.len() > BUF
            || !(head.as_ptr() as usize).is_multiple_of(ALIGN)
        {
            return Ok(false);
        }
        let buf = self.buf.as_mut().expect("buffer until drop").as_mut();
        buf[..tail.len()].copy_from_slice(tail);
        self.copied += tail.len() as u64;
        let tail = &buf[..tail.len()];
        let total = head.len() + tail.len();
        let mut done = 0;
        while done < total {
            let iov = |b: &[u8]| libc::iovec {
                iov_base: b.as_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            };
            let iovs: Vec<libc::iovec> = if done < head.len() {
                vec![iov(&head[done..]), iov(tail)]
            } else {
                vec![iov(&tail[done - head.len()..])]
            };
            // SAFETY: each iovec points into `head` or this file's buffer, both alive and
            // unchanged for the call; the kernel only reads them.
            let n = unsafe {
                libc::pwritev(
                    self.file.as_raw_fd(),
                    iovs.as_ptr(),
                    iovs.len() as libc::c_int,
                    done as libc::off_t,
                )
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(io::ErrorKind::WriteZero.into()),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        self.offset = total as u64;
        Ok(true)
    }

    /// Writes the buffer's first `len` bytes (a multiple of [`ALIGN`]) at the current offset.
    fn write_out(&mut self, len: usize) -> io::Result<()> {
        debug_assert_eq!(len % ALIGN, 0);
        let buf = self.buf.as_mut().expect("buffer until drop").as_mut();
        self.file.write_all_at(&buf[..len], self.offset)?;
        self.offset += len as u64;
        Ok(())
    }

    /// Writes what is left: its whole pages with `O_DIRECT`, then the last piece shorter than a
    /// page through the page cache at its exact length (`O_DIRECT` cleared on this descriptor).
    /// Padding that piece to a page and cutting the file back instead costs a second device
    /// write and a truncate, which reads the file's last block back from the disk to zero its
    /// rest: on the benchmark VM those two were more of a block file's cost than its data
    /// (`doc/BENCHMARKS.md`, issue 17). Where `O_DIRECT` cannot be cleared, the piece is padded
    /// and the file cut as before.
    pub fn finish(self) -> io::Result<()> {
        self.finish_with(clear_direct)
    }

    /// [`Self::finish`], `O_DIRECT` cleared by `clear` (tests make it fail).
    fn finish_with(mut self, clear: fn(&File) -> io::Result<()>) -> io::Result<()> {
        let filled = self.filled;
        let whole = filled / ALIGN * ALIGN;
        if whole > 0 {
            self.write_out(whole)?;
        }
        let rest = whole..filled;
        if rest.is_empty() {
            return Ok(());
        }
        let buf = self.buf.as_mut().expect("buffer until drop").as_mut();
        if clear(&self.file).is_ok() {
            return self.file.write_all_at(&buf[rest], self.offset);
        }
        let len = self.offset + rest.len() as u64;
        buf.copy_within(rest.clone(), 0);
        buf[rest.len()..ALIGN].fill(0);
        self.write_out(ALIGN)?;
        self.file.set_len(len)
    }
}

impl Write for DirectFile {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let whole = data.len() / ALIGN * ALIGN;
        if self.filled == 0 && whole > 0 && (data.as_ptr() as usize).is_multiple_of(ALIGN) {
            // Aligned in memory, at an aligned offset (nothing waits in the buffer): the pages
            // go to the disk from where they are.
            self.file.write_all_at(&data[..whole], self.offset)?;
            self.offset += whole as u64;
            return Ok(whole);
        }
        let filled = self.filled;
        let n = data.len().min(BUF - filled);
        self.buf.as_mut().expect("buffer until drop").as_mut()[filled..filled + n]
            .copy_from_slice(&data[..n]);
        self.filled += n;
        self.copied += n as u64;
        if self.filled == BUF {
            self.write_out(BUF)?;
            self.filled = 0;
        }
        Ok(n)
    }

    /// Nothing: only whole aligned pieces can be written before [`DirectFile::finish`].
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for DirectFile {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            SPARE.with(|s| *s.borrow_mut() = Some(buf));
        }
    }
}

/// Turns `O_DIRECT` off on `file`'s open file description: later writes go through the page
/// cache.
fn clear_direct(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor `file` owns; F_GETFL/F_SETFL touch no memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether files in `dir` can be written with `O_DIRECT` (one aligned page is written to a
/// scratch file, then deleted).
pub fn supported(dir: &Path) -> bool {
    let path = dir.join(format!(".direct-probe-{}", std::process::id()));
    let ok = (|| -> io::Result<()> {
        let mut f = DirectFile::create(&path)?;
        f.write_all(&[0u8; ALIGN])?;
        f.finish()?;
        Ok(())
    })();
    let _ = std::fs::remove_file(&path);
    if let Err(e) = &ok {
        tracing::info!(dir = %dir.display(), error = %e,
            "cache: O_DIRECT refused here; cache files go through the page cache");
    }
    ok.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory where O_DIRECT works; locally, `None` (loudly) where it does not; in
    /// CI (`CI=true`) a missing prerequisite fails the test.
    fn direct_dir() -> Option<tempfile::TempDir> {
        let dir = tempfile::tempdir().unwrap();
        if supported(dir.path()) {
            return Some(dir);
        }
        let what = format!("O_DIRECT in {}", dir.path().display());
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "missing prerequisite in CI: {what}"
        );
        eprintln!("SKIPPED: no {what}");
        None
    }

    /// Lengths around the buffer's and the alignment's edges come back byte for byte, with the
    /// file exactly as long as what was written.
    #[test]
    fn every_length_is_written_exactly() {
        let Some(dir) = direct_dir() else { return };
        // Also where O_DIRECT cannot be cleared: the last piece padded, the file cut back.
        let refuse: fn(&File) -> io::Result<()> = |_| Err(io::Error::other("refused"));
        for (how, clear) in [
            ("cleared", clear_direct as fn(&File) -> _),
            ("padded", refuse),
        ] {
            for len in [
                0,
                1,
                ALIGN - 1,
                ALIGN,
                ALIGN + 1,
                BUF - 1,
                BUF,
                BUF + 7,
                2 * BUF + ALIGN,
            ] {
                let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
                let path = dir.path().join(format!("f{len}-{how}"));
                let mut f = DirectFile::create(&path).unwrap();
                // Uneven pieces, as a header and a block arrive.
                let (a, b) = data.split_at(len.min(100));
                f.write_all(a).unwrap();
                f.write_all(b).unwrap();
                f.finish_with(clear).unwrap();
                assert_eq!(std::fs::read(&path).unwrap(), data, "length {len}, {how}");
            }
        }
    }

    /// Page-aligned data at an aligned offset is written from where it is, whatever follows it
    /// in the file; data that is not aligned, or comes after bytes waiting in the buffer, is
    /// copied. Every file comes back byte for byte.
    #[test]
    fn aligned_data_is_written_without_a_copy() {
        let Some(dir) = direct_dir() else { return };
        let mut src = Aligned::new();
        for (i, b) in src.as_mut().iter_mut().enumerate() {
            *b = (i * 13 + 5) as u8;
        }
        let all = src.as_mut();
        let tail = b"a trailer of 25 bytes....";
        // (data offset in the aligned source, data length, a header before it, bytes copied)
        for (at, len, head, copied) in [
            (0, BUF, 0, tail.len()),
            (0, ALIGN * 3 + 100, 0, 100 + tail.len()),
            (0, ALIGN - 1, 0, ALIGN - 1 + tail.len()),
            (ALIGN, ALIGN * 2, 0, tail.len()),
            (1, ALIGN * 2, 0, ALIGN * 2 + tail.len()),
            (0, ALIGN * 2, 7, 7 + ALIGN * 2 + tail.len()),
        ] {
            let data = &all[at..at + len];
            let header = vec![0x5Au8; head];
            let path = dir.path().join(format!("f{at}-{len}-{head}"));
            let mut f = DirectFile::create(&path).unwrap();
            f.write_all(&header).unwrap();
            f.write_all(data).unwrap();
            f.write_all(tail).unwrap();
            assert_eq!(
                f.copied(),
                copied as u64,
                "at {at}, {len} bytes, header {head}"
            );
            f.finish().unwrap();
            let mut want = header.clone();
            want.extend_from_slice(data);
            want.extend_from_slice(tail);
            assert_eq!(std::fs::read(&path).unwrap(), want, "at {at}, {len} bytes");
        }
    }

    /// Whole pages of aligned data and a whole-page trailer go out in one `pwritev`, only the
    /// trailer through the buffer, and come back byte for byte; anything else is left to
    /// `write` (nothing written, `false`).
    #[test]
    fn whole_pages_are_written_in_one_go() {
        let Some(dir) = direct_dir() else { return };
        let mut src = Aligned::new();
        for (i, b) in src.as_mut().iter_mut().enumerate() {
            *b = (i * 31 + 3) as u8;
        }
        let all = src.as_mut();
        let trailer: Vec<u8> = (0..2 * ALIGN).map(|i| (i % 251) as u8).collect();
        for (at, len, tail) in [
            (0, BUF, ALIGN),
            (0, 32 * ALIGN, ALIGN),
            (ALIGN, ALIGN, 2 * ALIGN),
        ] {
            let path = dir.path().join(format!("p{at}-{len}-{tail}"));
            let mut f = DirectFile::create(&path).unwrap();
            assert!(f.write_pages(&all[at..at + len], &trailer[..tail]).unwrap());
            assert_eq!(f.copied(), tail as u64, "only the trailer is copied");
            f.finish().unwrap();
            let mut want = all[at..at + len].to_vec();
            want.extend_from_slice(&trailer[..tail]);
            assert_eq!(
                std::fs::read(&path).unwrap(),
                want,
                "at {at}, {len} + {tail}"
            );
        }
        // Not whole pages, not aligned in memory, or after bytes already written: not taken.
        for (at, len, tail, before) in [
            (0, ALIGN + 1, ALIGN - 1, 0),
            (0, ALIGN, 100, 0),
            (1, ALIGN, ALIGN, 0),
            (0, ALIGN, ALIGN, 7),
        ] {
            let path = dir.path().join(format!("n{at}-{len}-{tail}-{before}"));
            let mut f = DirectFile::create(&path).unwrap();
            f.write_all(&vec![9u8; before]).unwrap();
            assert!(!f.write_pages(&all[at..at + len], &trailer[..tail]).unwrap());
            f.write_all(&all[at..at + len]).unwrap();
            f.write_all(&trailer[..tail]).unwrap();
            f.finish().unwrap();
            let mut want = vec![9u8; before];
            want.extend_from_slice(&all[at..at + len]);
            want.extend_from_slice(&trailer[..tail]);
            assert_eq!(
                std::fs::read(&path).unwrap(),
                want,
                "at {at}, {len} + {tail}"
            );
        }
    }

    /// An unfinished file is shorter than what was written (a cache file's length and checksum
    /// then refuse it), and the next file, through the same reused buffer, gets none of its
    /// bytes.
    #[test]
    fn an_unfinished_file_is_short_and_the_reused_buffer_leaks_nothing() {
        let Some(dir) = direct_dir() else { return };
        let mut f = DirectFile::create(&dir.path().join("a")).unwrap();
        f.write_all(&[0xAA; 3 * ALIGN]).unwrap();
        let ptr = f.buf.as_ref().unwrap().0;
        drop(f);
        assert_eq!(std::fs::metadata(dir.path().join("a")).unwrap().len(), 0);
        let mut g = DirectFile::create(&dir.path().join("b")).unwrap();
        assert_eq!(g.buf.as_ref().unwrap().0, ptr, "the thread's buffer again");
        g.write_all(b"ten bytes!").unwrap();
        g.finish().unwrap();
        assert_eq!(std::fs::read(dir.path().join("b")).unwrap(), b"ten bytes!");
    }
}
