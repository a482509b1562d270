//! The real `ferry-fd-holder` binary, driven through `ferry_holder::Client` (and raw
//! `fdpass` frames for what a well-behaved client never sends). Needs no root: pipes stand in for
//! `/dev/fuse` fds.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_holder::fdpass;
use ferry_holder::{Client, Reply};
use nix::fcntl::OFlag;
use nix::sys::signal::{kill, Signal};
use nix::unistd::{pipe2, Pid};

/// A running holder on a socket in a temporary directory; killed when dropped.
struct Holder {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Holder {
    fn start() -> Holder {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("holder.sock");
        let child = spawn(&socket, log(dir.path()));
        let holder = Holder {
            child,
            socket,
            _dir: dir,
        };
        holder.wait_ready();
        holder
    }

    /// Waits until the holder answers a ping (its start is a bind, so this is quick); a holder
    /// that exits first fails the test with its status.
    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(pong) = Client::connect(&self.socket).and_then(|mut c| c.ping()) {
                assert_eq!(pong.pid, self.child.id());
                return;
            }
            assert!(Instant::now() < deadline, "the holder did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn client(&self) -> Client {
        Client::connect(&self.socket).unwrap()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The holder's log, in the test's directory: a pipe nobody reads would block it once full.
fn log(dir: &Path) -> Stdio {
    File::create(dir.join("holder.log")).unwrap().into()
}

fn spawn(socket: &Path, stderr: Stdio) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ferry-fd-holder"))
        .arg("--socket")
        .arg(socket)
        .env("FERRY_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

/// A pipe (read end, write end) that holders spawned by tests running alongside do not inherit
/// (an inherited write end would keep a reader here from ever seeing EOF).
fn pipe() -> (OwnedFd, OwnedFd) {
    pipe2(OFlag::O_CLOEXEC).unwrap()
}

/// Writes through `writer` and reads the same bytes from `reader`: the two are one pipe.
fn assert_same_pipe(writer: OwnedFd, reader: &OwnedFd, word: &[u8]) {
    File::from(writer).write_all(word).unwrap();
    let mut got = vec![0; word.len()];
    File::from(reader.try_clone().unwrap())
        .read_exact(&mut got)
        .unwrap();
    assert_eq!(got, word);
}

/// Reads to EOF: returns only when every write end of the pipe is closed (in the holder too).
fn assert_eof(reader: OwnedFd) {
    let mut rest = Vec::new();
    File::from(reader).read_to_end(&mut rest).unwrap();
}

#[test]
fn a_deposit_is_handed_back_to_another_connection() {
    let holder = Holder::start();
    let (reader, writer) = pipe();
    holder
        .client()
        .deposit("vol-1", b"journal state", &[writer.as_fd()])
        .unwrap();
    drop(writer);

    let mut entries = holder.client().list().unwrap();
    assert_eq!(entries.len(), 1);
    let entry = entries.pop().unwrap();
    assert_eq!(
        (entry.key.as_str(), &entry.blob[..]),
        ("vol-1", &b"journal state"[..])
    );
    let [fd] = <[OwnedFd; 1]>::try_from(entry.fds).unwrap();
    assert_same_pipe(fd, &reader, b"through the holder");

    // A list is a peek: the holder still has its copy, and hands it out again.
    let mut client = holder.client();
    assert_eq!(client.ping().unwrap().entries, 1);
    let again = client.list().unwrap().pop().unwrap();
    assert_same_pipe(again.fds.into_iter().next().unwrap(), &reader, b"twice");
}

#[test]
fn entries_keep_their_fds_apart_and_in_order() {
    let holder = Holder::start();
    let pipes: Vec<(OwnedFd, OwnedFd)> = (0..5).map(|_| pipe()).collect();
    let mut client = holder.client();
    client
        .deposit("b", b"", &[pipes[0].1.as_fd(), pipes[1].1.as_fd()])
        .unwrap();
    client
        .deposit("a", &[0xff; 1000], &[pipes[2].1.as_fd()])
        .unwrap();
    client
        .deposit("c", b"c", &[pipes[3].1.as_fd(), pipes[4].1.as_fd()])
        .unwrap();
    let entries = client.list().unwrap();
    let shape: Vec<(&str, usize, usize)> = entries
        .iter()
        .map(|e| (e.key.as_str(), e.blob.len(), e.fds.len()))
        .collect();
    assert_eq!(shape, [("a", 1000, 1), ("b", 0, 2), ("c", 1, 2)]);
    let order = [2, 0, 1, 3, 4];
    for (fd, pipe) in entries.into_iter().flat_map(|e| e.fds).zip(order) {
        assert_same_pipe(fd, &pipes[pipe].0, format!("pipe {pipe}").as_bytes());
    }
}

#[test]
fn a_deposit_under_a_held_key_closes_the_old_fds() {
    let holder = Holder::start();
    let mut client = holder.client();
    let (old_reader, old_writer) = pipe();
    client
        .deposit("vol", b"old", &[old_writer.as_fd()])
        .unwrap();
    drop(old_writer);
    let (new_reader, new_writer) = pipe();
    client
        .deposit("vol", b"new", &[new_writer.as_fd()])
        .unwrap();
    drop(new_writer);

    assert_eof(old_reader);
    let entries = client.list().unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].blob, b"new");
    let fd = entries.into_iter().next().unwrap().fds.pop().unwrap();
    assert_same_pipe(fd, &new_reader, b"the new one");
}

#[test]
fn a_withdraw_closes_the_fds_and_is_idempotent() {
    let holder = Holder::start();
    let mut client = holder.client();
    let (reader, writer) = pipe();
    client.deposit("vol", b"", &[writer.as_fd()]).unwrap();
    drop(writer);
    client.withdraw("vol").unwrap();
    assert_eof(reader);
    client.withdraw("vol").unwrap();
    client.withdraw("never deposited").unwrap();
    assert!(client.list().unwrap().is_empty());
    assert_eq!(client.ping().unwrap().entries, 0);
}

#[test]
fn refused_deposits_say_why_and_change_nothing() {
    let holder = Holder::start();
    let mut client = holder.client();
    let (_reader, writer) = pipe();
    // The client checks the limits itself; raw frames show the holder does too.
    let err = client.deposit("vol", b"", &[]).unwrap_err();
    assert!(err.to_string().contains("not 0"), "{err}");
    let stream = UnixStream::connect(&holder.socket).unwrap();
    let request = br#"{"version":1,"op":"deposit","key":"vol","blob":""}"#;
    for fds in [Vec::new(), vec![writer.as_fd(); 9]] {
        fdpass::send(&stream, request, &fds).unwrap();
        let message = error_message(&stream);
        assert!(message.contains(&format!("not {}", fds.len())), "{message}");
    }
    let request = br#"{"version":1,"op":"ping"}"#;
    fdpass::send(&stream, request, &[writer.as_fd()]).unwrap();
    assert!(error_message(&stream).contains("carries no fds"));
    assert_eq!(client.ping().unwrap().entries, 0);
}

#[test]
fn another_protocol_version_is_refused_naming_both() {
    let holder = Holder::start();
    let stream = UnixStream::connect(&holder.socket).unwrap();
    fdpass::send(&stream, br#"{"version":2,"op":"ping"}"#, &[]).unwrap();
    let message = error_message(&stream);
    assert!(
        message.contains("version 2") && message.contains("version 1"),
        "{message}"
    );
    // The frame was whole, so the connection is still in step.
    fdpass::send(&stream, br#"{"version":1,"op":"ping"}"#, &[]).unwrap();
    let (payload, _) = fdpass::recv(&stream).unwrap();
    assert!(matches!(
        ferry_holder::decode::<Reply>(&payload).unwrap(),
        Reply::Pong { entries: 0, .. }
    ));
}

#[test]
fn clients_that_vanish_mid_message_or_send_garbage_do_not_hurt_the_holder() {
    let holder = Holder::start();
    let (reader, writer) = pipe();
    holder
        .client()
        .deposit("kept", b"", &[writer.as_fd()])
        .unwrap();

    // A header announcing more than follows, then gone.
    let mut stream = UnixStream::connect(&holder.socket).unwrap();
    stream.write_all(b"FRRY").unwrap();
    stream.write_all(&100u32.to_le_bytes()).unwrap();
    stream.write_all(&1u32.to_le_bytes()).unwrap();
    stream.write_all(b"{\"version\":1,").unwrap();
    drop(stream);
    // Not a frame at all.
    let mut stream = UnixStream::connect(&holder.socket).unwrap();
    stream.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    // A slow client holds up only itself: it stays connected while others are served.
    let _slow = UnixStream::connect(&holder.socket).unwrap();

    let mut client = holder.client();
    assert_eq!(client.ping().unwrap().entries, 1);
    let fd = client.list().unwrap().pop().unwrap().fds.pop().unwrap();
    drop(writer);
    assert_same_pipe(fd, &reader, b"still held");
}

#[test]
fn a_second_holder_on_a_live_socket_is_refused() {
    let holder = Holder::start();
    let second = spawn(&holder.socket, Stdio::piped())
        .wait_with_output()
        .unwrap();
    assert!(!second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains("another ferry-fd-holder")
            && stderr.contains(&holder.child.id().to_string()),
        "{stderr}"
    );
    assert_eq!(holder.client().ping().unwrap().pid, holder.child.id());
}

#[test]
fn a_stale_socket_file_is_replaced_and_the_new_one_is_private() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("holder.sock");
    drop(UnixListener::bind(&socket).unwrap());
    assert!(std::fs::metadata(&socket).unwrap().file_type().is_socket());
    let holder = Holder {
        child: spawn(&socket, log(dir.path())),
        socket: socket.clone(),
        _dir: dir,
    };
    holder.wait_ready();
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn a_file_that_is_not_a_socket_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("holder.sock");
    std::fs::write(&socket, b"precious").unwrap();
    let out = spawn(&socket, Stdio::piped()).wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a socket"));
    assert_eq!(std::fs::read(&socket).unwrap(), b"precious");
}

#[test]
fn sigterm_ends_the_holder_cleanly() {
    let mut holder = Holder::start();
    kill(Pid::from_raw(holder.child.id() as i32), Signal::SIGTERM).unwrap();
    let status = holder.child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!holder.socket.exists(), "the socket file is removed");
}

fn error_message(stream: &UnixStream) -> String {
    let (payload, fds) = fdpass::recv(stream).unwrap();
    assert!(fds.is_empty());
    match ferry_holder::decode::<Reply>(&payload).unwrap() {
        Reply::Error { message } => message,
        other => panic!("expected an error, got {other:?}"),
    }
}
