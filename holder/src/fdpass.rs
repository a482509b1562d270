//! Framed messages with file descriptors over a unix stream socket (blocking; async callers use
//! `spawn_blocking`).
//!
//! A frame on the wire is
//!
//! ```text
//! | b"FRRY" | payload length: u32 LE | fd count: u32 LE | payload | one carrier byte (0) per extra fd chunk |
//! ```
//!
//! The fds travel in `SCM_RIGHTS` control messages, at most [`FDS_PER_CHUNK`] to a `sendmsg` (the
//! kernel refuses more than `SCM_MAX_FD` = 253 in one). The first chunk rides on the `sendmsg` of the
//! header and payload; every further chunk rides on a `sendmsg` of one carrier byte of its own, sent
//! after the payload. The kernel attaches a `sendmsg`'s fds to the first byte it queues, and a
//! `recvmsg` never returns the fds of two such sends at once, so the receiver collects fds from
//! every `recvmsg` while it reads exactly the frame's bytes — never a byte of the next frame, so
//! never a foreign fd — and once it has the last byte it has every fd, in the order they were sent.
//!
//! Invariants the receiver holds: every fd it was given is owned (and closed on any error), even
//! those of a truncated control message (`MSG_CTRUNC`, which is an error); fds arrive with
//! `O_CLOEXEC` (`MSG_CMSG_CLOEXEC`), so a child process never inherits one by accident.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// The frame's first four bytes: a peer that speaks something else fails on its first message.
pub const MAGIC: [u8; 4] = *b"FRRY";
/// The header: magic, payload length, fd count.
pub const HEADER_LEN: usize = 12;
/// The largest payload [`recv`] accepts (and [`send`] sends): a lying header must not make the
/// receiver allocate without bound.
pub const MAX_PAYLOAD: usize = 256 << 20;
/// The most fds one frame may carry. Far above what Ferry sends (the fd holder's whole table is at
/// most 4096 entries of 8 fds) and far below a count that would read as garbage.
pub const MAX_FDS: usize = 1 << 16;
/// Fds per `SCM_RIGHTS` message; below the kernel's `SCM_MAX_FD` (253).
pub const FDS_PER_CHUNK: usize = 250;
/// Room for the most fds a single `recvmsg` can return: the kernel's `SCM_MAX_FD`, whatever the
/// peer's chunking, so only running out of fds (`EMFILE`) truncates a control message.
const SCM_MAX_FD: usize = 253;
/// The payload is read in steps of this size, so a header announcing more than the peer sends
/// costs at most this much memory beyond what arrived.
const READ_STEP: usize = 1 << 20;

/// Sends one message: `payload` and `fds` (any number up to [`MAX_FDS`], in chunks of at most
/// [`FDS_PER_CHUNK`] per `sendmsg`). The caller keeps its fds; the peer receives duplicates.
pub fn send(stream: &UnixStream, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if payload.len() > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "payload of {} bytes is above the limit of {MAX_PAYLOAD}",
                payload.len()
            ),
        ));
    }
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} fds are above the limit of {MAX_FDS}", fds.len()),
        ));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut chunks = raw.chunks(FDS_PER_CHUNK);
    let header = header(payload.len(), fds.len());
    send_all(stream, &[&header, payload], chunks.next().unwrap_or(&[]))?;
    for chunk in chunks {
        send_all(stream, &[&[0u8]], chunk)?;
    }
    Ok(())
}

/// Receives one message sent by [`send`]: its payload and its fds, in order.
///
/// Errors: the stream ends before a whole message -> `UnexpectedEof` (also at a message boundary,
/// the usual end of a connection); a bad magic, a payload above [`MAX_PAYLOAD`], fds fewer or more
/// than announced or a truncated control message -> `InvalidData`. After an error the stream is
/// out of step with the peer and should be dropped.
pub fn recv(stream: &UnixStream) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    recv_with_room(stream, SCM_MAX_FD)
}

/// [`recv`] with room in the control buffer for `room` fds per `recvmsg` (tests make it small to
/// force `MSG_CTRUNC`).
fn recv_with_room(stream: &UnixStream, room: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut rx = Receiver {
        stream,
        // SAFETY: CMSG_SPACE is arithmetic on its argument.
        control: vec![0; unsafe { libc::CMSG_SPACE((room * size_of::<RawFd>()) as u32) } as usize],
        fds: Vec::new(),
        limit: MAX_FDS,
    };
    let mut header = [0u8; HEADER_LEN];
    rx.read_exact(&mut header, "before a whole header")?;
    if header[..4] != MAGIC {
        return Err(invalid(format!(
            "not a Ferry frame: magic {:?} where {MAGIC:?} belongs",
            &header[..4]
        )));
    }
    let len = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes")) as usize;
    let fd_count = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD {
        return Err(invalid(format!(
            "frame announces a payload of {len} bytes, above the limit of {MAX_PAYLOAD}"
        )));
    }
    if fd_count > MAX_FDS {
        return Err(invalid(format!(
            "frame announces {fd_count} fds, above the limit of {MAX_FDS}"
        )));
    }
    rx.limit = fd_count;
    let mut payload = Vec::with_capacity(len.min(READ_STEP));
    while payload.len() < len {
        let start = payload.len();
        payload.resize(start + (len - start).min(READ_STEP), 0);
        rx.read_exact(&mut payload[start..], "in the payload")?;
    }
    let mut carriers = vec![0u8; fd_count.div_ceil(FDS_PER_CHUNK).saturating_sub(1)];
    rx.read_exact(&mut carriers, "before the last fd")?;
    if rx.fds.len() != fd_count {
        return Err(invalid(format!(
            "frame announced {fd_count} fds but carried {}",
            rx.fds.len()
        )));
    }
    Ok((payload, rx.fds))
}

fn header(len: usize, fd_count: usize) -> [u8; HEADER_LEN] {
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&MAGIC);
    // Both fit: send checked them against MAX_PAYLOAD and MAX_FDS.
    header[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    header[8..12].copy_from_slice(&(fd_count as u32).to_le_bytes());
    header
}

/// Writes all of `parts`, with `fds` on the first `sendmsg`. A short write has already queued the
/// fds (the kernel attaches them to the first byte), so the rest goes without them.
fn send_all(stream: &UnixStream, parts: &[&[u8]], fds: &[RawFd]) -> io::Result<()> {
    let mut parts: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    let mut fds = fds;
    while !parts.is_empty() {
        let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let rights = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
        let sent = match sendmsg::<()>(
            stream.as_raw_fd(),
            &iov,
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(sent) => sent,
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        };
        fds = &[];
        advance(&mut parts, sent);
    }
    Ok(())
}

/// Drops the first `n` bytes of `parts`.
fn advance(parts: &mut Vec<&[u8]>, mut n: usize) {
    while n > 0 {
        let first = parts[0];
        if n >= first.len() {
            n -= first.len();
            parts.remove(0);
        } else {
            parts[0] = &first[n..];
            n = 0;
        }
    }
}

/// One frame being read: the fds collected so far, owned from the moment the kernel hands them over.
struct Receiver<'a> {
    stream: &'a UnixStream,
    control: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// More fds than this is an error as soon as it shows (a lying or broken peer).
    limit: usize,
}

impl Receiver<'_> {
    /// Fills `buf`, collecting every fd that arrives on the way. `at` says where in the frame, for
    /// the EOF error.
    fn read_exact(&mut self, buf: &mut [u8], at: &str) -> io::Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            // Zeroed, so that after a truncated control message nothing stale reads as a header.
            self.control.fill(0);
            let mut iov = [IoSliceMut::new(&mut buf[filled..])];
            let msg = match recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut self.control),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(msg) => msg,
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            };
            let (bytes, truncated) = (msg.bytes, msg.flags.contains(MsgFlags::MSG_CTRUNC));
            if !truncated {
                let cmsgs = msg.cmsgs().map_err(io::Error::from)?;
                for cmsg in cmsgs {
                    if let ControlMessageOwned::ScmRights(raw) = cmsg {
                        // SAFETY: the kernel installed these fds in our table for this recvmsg;
                        // nothing else knows of them, so they are ours to own and close.
                        self.fds.extend(
                            raw.into_iter()
                                .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                        );
                    }
                }
            }
            if truncated {
                close_truncated_rights(&self.control);
                return Err(invalid(
                    "control message truncated (MSG_CTRUNC): fds were lost, most likely because \
                     this process is out of file descriptors"
                        .to_string(),
                ));
            }
            if self.fds.len() > self.limit {
                return Err(invalid(format!(
                    "frame announced {} fds but carried more",
                    self.limit
                )));
            }
            if bytes == 0 {
                let (done, want) = (filled, buf.len());
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("connection closed {at} ({done} of {want} bytes read)"),
                ));
            }
            filled += bytes;
        }
        Ok(())
    }
}

/// Closes the fds of a truncated `SCM_RIGHTS` message. nix will not iterate a truncated control
/// buffer, yet the kernel has installed as many of the fds as fit (it stops at `EMFILE`), so they
/// are read straight from the buffer: at most one `SCM_RIGHTS` header, at its start (a recvmsg
/// never returns two fd sends, and nothing on these sockets asks for credentials).
fn close_truncated_rights(control: &[u8]) {
    let header_len = std::mem::size_of::<libc::cmsghdr>();
    if control.len() < header_len {
        return;
    }
    // SAFETY: `control` holds at least a cmsghdr's bytes; read_unaligned needs no alignment, and a
    // cmsghdr (integers) is valid for any bit pattern.
    let header: libc::cmsghdr = unsafe { std::ptr::read_unaligned(control.as_ptr().cast()) };
    if header.cmsg_level != libc::SOL_SOCKET || header.cmsg_type != libc::SCM_RIGHTS {
        return;
    }
    // SAFETY: CMSG_LEN is arithmetic on its argument. CMSG_LEN(0) is where a message's data starts.
    let data = unsafe { libc::CMSG_LEN(0) } as usize;
    let end = (header.cmsg_len as usize).min(control.len());
    for fd in control[data.min(end)..end].chunks_exact(std::mem::size_of::<RawFd>()) {
        let fd = RawFd::from_ne_bytes(fd.try_into().expect("an fd's bytes"));
        // SAFETY: as in read_exact: the kernel installed this fd for us and nothing else has it.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
    use nix::unistd::pipe2;

    use super::*;

    /// Sends `count` fresh pipes' write ends, receives them, and proves each received fd is its
    /// pipe by writing through it.
    fn round_trip(count: usize, payload: &[u8]) {
        let (a, b) = UnixStream::pair().unwrap();
        let pipes: Vec<(OwnedFd, OwnedFd)> = (0..count)
            .map(|_| pipe2(OFlag::O_CLOEXEC).unwrap())
            .collect();
        let writers: Vec<BorrowedFd<'_>> = pipes.iter().map(|(_, w)| w.as_fd()).collect();
        // A thread of its own: a payload larger than the socket buffer blocks until it is read.
        let (got, fds) = std::thread::scope(|s| {
            s.spawn(|| send(&a, payload, &writers).unwrap());
            recv(&b).unwrap()
        });
        assert_eq!(got, payload);
        assert_eq!(fds.len(), count);
        for (i, (fd, (reader, _))) in fds.into_iter().zip(&pipes).enumerate() {
            let flags = fcntl(&fd, FcntlArg::F_GETFD).unwrap();
            assert!(FdFlag::from_bits_truncate(flags).contains(FdFlag::FD_CLOEXEC));
            let mut writer = std::fs::File::from(fd);
            writer.write_all(&(i as u32).to_le_bytes()).unwrap();
            let mut word = [0u8; 4];
            std::fs::File::from(reader.try_clone().unwrap())
                .read_exact(&mut word)
                .unwrap();
            assert_eq!(u32::from_le_bytes(word), i as u32, "fd {i} is not its pipe");
        }
    }

    #[test]
    fn round_trips_without_fds() {
        round_trip(0, b"hello");
        round_trip(0, b"");
    }

    #[test]
    fn round_trips_one_fd() {
        round_trip(1, b"one");
    }

    #[test]
    fn round_trips_more_fds_than_one_sendmsg_carries() {
        round_trip(300, b"three hundred");
        round_trip(2 * FDS_PER_CHUNK, b"");
    }

    #[test]
    fn round_trips_a_mebibyte_with_fds() {
        let payload: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        round_trip(3, &payload);
    }

    #[test]
    fn messages_follow_each_other_without_mixing_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r1, w1) = pipe2(OFlag::O_CLOEXEC).unwrap();
        let (_r2, w2) = pipe2(OFlag::O_CLOEXEC).unwrap();
        send(&a, b"first", &[w1.as_fd()]).unwrap();
        send(&a, b"second", &[w2.as_fd(), w2.as_fd()]).unwrap();
        send(&a, b"third", &[]).unwrap();
        let (p, fds) = recv(&b).unwrap();
        assert_eq!((p.as_slice(), fds.len()), (&b"first"[..], 1));
        drop((w1, fds));
        // The only writer left of pipe 1 was the received one: the reader sees EOF.
        assert_eq!(std::fs::File::from(r1).read(&mut [0u8; 1]).unwrap(), 0);
        let (p, fds) = recv(&b).unwrap();
        assert_eq!((p.as_slice(), fds.len()), (&b"second"[..], 2));
        let (p, fds) = recv(&b).unwrap();
        assert_eq!((p.as_slice(), fds.len()), (&b"third"[..], 0));
    }

    #[test]
    fn eof_at_a_boundary_and_mid_message_is_unexpected_eof() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        assert_eq!(recv(&b).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);

        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&header(100, 0)).unwrap();
        a.write_all(&[7; 40]).unwrap();
        drop(a);
        let err = recv(&b).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
        assert!(err.to_string().contains("40 of 100"), "{err}");

        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&header(0, 0)[..5]).unwrap();
        drop(a);
        assert_eq!(recv(&b).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn a_header_that_lies_is_invalid_data() {
        // A payload above the limit is refused before anything is allocated.
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&header(MAX_PAYLOAD + 1, 0)).unwrap();
        let err = recv(&b).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(
            err.to_string().contains(&(MAX_PAYLOAD + 1).to_string()),
            "{err}"
        );

        // Fewer fds than announced (2 announced, 0 sent, and no carrier is owed for 2).
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&header(3, 2)).unwrap();
        a.write_all(b"abc").unwrap();
        let err = recv(&b).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(
            err.to_string().contains("announced 2 fds but carried 0"),
            "{err}"
        );

        // More fds than announced.
        let (a, b) = UnixStream::pair().unwrap();
        let (_r, w) = pipe2(OFlag::O_CLOEXEC).unwrap();
        send_all(&a, &[&header(1, 0), b"x"], &[w.as_raw_fd()]).unwrap();
        assert_eq!(recv(&b).unwrap_err().kind(), io::ErrorKind::InvalidData);

        // Not a frame at all.
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        let err = recv(&b).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("magic"), "{err}");
    }

    #[test]
    fn a_truncated_control_message_is_an_error_and_closes_what_arrived() {
        let (a, b) = UnixStream::pair().unwrap();
        let (reader, writer) = pipe2(OFlag::O_CLOEXEC).unwrap();
        let copies = vec![writer.as_fd(); 20];
        send(&a, b"many", &copies).unwrap();
        let err = recv_with_room(&b, 5).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("MSG_CTRUNC"), "{err}");
        drop((a, b, copies));
        drop(writer);
        // Every writer is closed, the five that reached us included: the reader sees EOF at once
        // (non-blocking: a leaked writer would show as EAGAIN instead of hanging the test).
        let flags = OFlag::from_bits_truncate(fcntl(&reader, FcntlArg::F_GETFL).unwrap());
        fcntl(&reader, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).unwrap();
        assert_eq!(std::fs::File::from(reader).read(&mut [0u8; 1]).unwrap(), 0);
    }
}
