//! The fd holder's protocol and its blocking client.
//!
//! `ferry-fd-holder` is a tiny process beside `ferry-node` (a sidecar container in the node plugin
//! pod) whose only job is to hold file descriptors — each live mount's `/dev/fuse` fd and journal
//! memfd — so that they outlive a SIGKILL, OOM kill or panic of `ferry-node`, and to hand them back
//! to the restarted plugin. It runs nothing of the data path: this crate (the protocol, its client
//! and [`fdpass`]) is all it uses of Ferry, and it depends on none of the filesystem, store or CSI
//! crates.
//!
//! Every request and reply is one [`fdpass`] frame whose payload is a JSON object
//! with `"version": 1` ([`VERSION`]) and an `"op"` (requests) or `"reply"` (replies) tag; blobs are
//! base64. Fds ride in the frame: a deposit's (1 to [`MAX_FDS_PER_ENTRY`]), and a list reply's (all
//! entries' fds, in entry order, [`EntryInfo::fd_count`] each).
//!
//! Every request is idempotent (a deposit replaces the entry of its key, a withdraw of an absent key
//! succeeds, list and ping only read), so the client may safely send a request again on a fresh
//! connection when the old one turns out to be closed — the holder closes connections idle for
//! longer than its read timeout.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod fdpass;

/// The protocol version this build speaks; every request and reply carries it.
pub const VERSION: u32 = 1;
/// The longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// The largest blob, in bytes.
pub const MAX_BLOB_BYTES: usize = 64 << 20;
/// The most entries the holder keeps.
pub const MAX_ENTRIES: usize = 4096;
/// The most fds one entry may hold (a deposit carries at least one).
pub const MAX_FDS_PER_ENTRY: usize = 8;
/// The most bytes the holder's list reply may take: the holder refuses a deposit that would push
/// the reply past this, so that a list always fits in one frame ([`fdpass::MAX_PAYLOAD`], with room
/// for the envelope).
pub const MAX_LIST_BYTES: usize = fdpass::MAX_PAYLOAD - (1 << 20);
/// How long the client waits on the holder for one frame before it gives up: the holder answers
/// from memory, so a longer wait means it is wedged, and `ferry-node` must not hang with it.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// A request, as the client sends it (the envelope adds the version).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Keep the frame's fds and `blob` under `key`, replacing (and closing) any entry of that key.
    Deposit {
        key: String,
        #[serde(with = "base64_bytes")]
        blob: Vec<u8>,
    },
    /// Close and forget the entry of `key`; succeeds when there is none.
    Withdraw { key: String },
    /// Every entry, with duplicates of all their fds; the holder keeps its own.
    List,
    /// Is the holder there, and how much does it hold?
    Ping,
}

/// A reply, as the holder sends it (the envelope adds the version).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    Ok,
    /// The answer to [`Request::List`]; the frame carries the fds.
    Entries {
        entries: Vec<EntryInfo>,
    },
    Pong {
        pid: u32,
        entries: usize,
    },
    /// The request was refused; nothing changed.
    Error {
        message: String,
    },
}

/// One entry of a list reply, without its fds (they ride in the frame).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntryInfo {
    pub key: String,
    #[serde(with = "base64_bytes")]
    pub blob: Vec<u8>,
    /// How many of the frame's fds, counting on from the previous entry's, are this entry's.
    pub fd_count: usize,
}

/// A request or reply on the wire: the body's fields beside `"version"`.
#[derive(Debug, Serialize, Deserialize)]
struct Envelope<T> {
    version: u32,
    #[serde(flatten)]
    body: T,
}

/// Just the version, read before the rest so that a message of another version is answered with
/// an error naming both versions rather than a parse error about fields this build does not know.
#[derive(Deserialize)]
struct VersionOnly {
    version: Option<u32>,
}

/// Encodes one message of this build's version.
pub fn encode<T: Serialize>(body: T) -> Vec<u8> {
    serde_json::to_vec(&Envelope {
        version: VERSION,
        body,
    })
    .expect("a request or reply always serializes")
}

/// Decodes a message, checking its version first. The error is the message to send back (holder)
/// or to report (client).
pub fn decode<T: for<'de> Deserialize<'de>>(payload: &[u8]) -> Result<T, String> {
    let version = serde_json::from_slice::<VersionOnly>(payload)
        .map_err(|e| format!("malformed message: {e}"))?
        .version
        .ok_or("malformed message: no \"version\" field")?;
    if version != VERSION {
        return Err(format!(
            "protocol version {version} is not supported: this side speaks version {VERSION}"
        ));
    }
    serde_json::from_slice::<Envelope<T>>(payload)
        .map(|e| e.body)
        .map_err(|e| format!("malformed message: {e}"))
}

/// Checks a deposit against the limits; the holder refuses one that fails with this message.
pub fn check_deposit(key: &str, blob: &[u8], fd_count: usize) -> Result<(), String> {
    if key.is_empty() {
        return Err("the key is empty".into());
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(format!(
            "the key is {} bytes, above the limit of {MAX_KEY_BYTES}",
            key.len()
        ));
    }
    if blob.len() > MAX_BLOB_BYTES {
        return Err(format!(
            "the blob is {} bytes, above the limit of {MAX_BLOB_BYTES}",
            blob.len()
        ));
    }
    if !(1..=MAX_FDS_PER_ENTRY).contains(&fd_count) {
        return Err(format!(
            "a deposit carries 1 to {MAX_FDS_PER_ENTRY} fds, not {fd_count}"
        ));
    }
    Ok(())
}

/// What an entry adds to the list reply, in bytes: its JSON-escaped key, its base64 blob, and room
/// for the punctuation and the `fd_count` field. The holder sums this over its entries against
/// [`MAX_LIST_BYTES`].
pub fn list_bytes(key: &str, blob_len: usize) -> usize {
    let key = serde_json::to_string(key).map_or(6 * key.len() + 2, |k| k.len());
    key + blob_len.div_ceil(3) * 4 + 64
}

/// One entry handed back by [`Client::list`]: the caller owns these fds (duplicates of the holder's).
#[derive(Debug)]
pub struct HeldEntry {
    pub key: String,
    pub blob: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// What [`Client::ping`] learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pong {
    pub pid: u32,
    pub entries: usize,
}

/// A blocking client of `ferry-fd-holder` (async callers use `spawn_blocking`). It keeps one
/// connection and opens a new one when the holder has closed the old.
#[derive(Debug)]
pub struct Client {
    path: PathBuf,
    stream: Option<UnixStream>,
}

impl Client {
    /// Connects to the holder's socket now, so that a missing holder shows at once.
    pub fn connect(path: impl AsRef<Path>) -> io::Result<Client> {
        let path = path.as_ref().to_path_buf();
        let stream = Some(open(&path)?);
        Ok(Client { path, stream })
    }

    /// Deposits `fds` (1 to [`MAX_FDS_PER_ENTRY`]) and `blob` under `key`, replacing any entry of
    /// that key. The caller keeps its fds.
    pub fn deposit(&mut self, key: &str, blob: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        check_deposit(key, blob, fds.len())
            .map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))?;
        let request = Request::Deposit {
            key: key.to_owned(),
            blob: blob.to_vec(),
        };
        expect_ok(self.call(&request, fds)?.0)
    }

    /// Closes and forgets the entry of `key` in the holder; also succeeds when there is none.
    pub fn withdraw(&mut self, key: &str) -> io::Result<()> {
        let request = Request::Withdraw {
            key: key.to_owned(),
        };
        expect_ok(self.call(&request, &[])?.0)
    }

    /// Every entry the holder keeps, with duplicates of its fds (the holder keeps its own).
    pub fn list(&mut self) -> io::Result<Vec<HeldEntry>> {
        let (reply, fds) = self.call(&Request::List, &[])?;
        let entries = match reply {
            Reply::Entries { entries } => entries,
            other => return Err(unexpected(other)),
        };
        let announced: usize = entries.iter().map(|e| e.fd_count).sum();
        if announced != fds.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "fd holder listed entries of {announced} fds but sent {}",
                    fds.len()
                ),
            ));
        }
        let mut fds = fds.into_iter();
        Ok(entries
            .into_iter()
            .map(|e| HeldEntry {
                fds: fds.by_ref().take(e.fd_count).collect(),
                key: e.key,
                blob: e.blob,
            })
            .collect())
    }

    /// The holder's pid and how many entries it keeps.
    pub fn ping(&mut self) -> io::Result<Pong> {
        match self.call(&Request::Ping, &[])?.0 {
            Reply::Pong { pid, entries } => Ok(Pong { pid, entries }),
            other => Err(unexpected(other)),
        }
    }

    /// Sends `request` and reads the reply. A connection the holder has closed since the last call
    /// fails on send or as an EOF before the reply; then the request goes once more on a fresh
    /// connection (safe: every request is idempotent). An error reply becomes an `io::Error`.
    fn call(
        &mut self,
        request: &Request,
        fds: &[BorrowedFd<'_>],
    ) -> io::Result<(Reply, Vec<OwnedFd>)> {
        let payload = encode(request);
        let reused = self.stream.is_some();
        let result = match self.stream.take() {
            Some(stream) => exchange(stream, &payload, fds),
            None => exchange(open(&self.path)?, &payload, fds),
        };
        let (stream, payload, fds) = match result {
            Err(e) if reused && is_closed(&e) => exchange(open(&self.path)?, &payload, fds)?,
            other => other?,
        };
        self.stream = Some(stream);
        match decode::<Reply>(&payload) {
            Ok(Reply::Error { message }) => Err(io::Error::other(format!("fd holder: {message}"))),
            Ok(reply) => Ok((reply, fds)),
            Err(message) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("fd holder: {message}"),
            )),
        }
    }
}

fn open(path: &Path) -> io::Result<UnixStream> {
    let stream = UnixStream::connect(path)
        .map_err(|e| io::Error::new(e.kind(), format!("fd holder at {}: {e}", path.display())))?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    Ok(stream)
}

/// One request and its reply; the stream comes back only when both went through whole, so a
/// stream out of step with the holder is never used again.
fn exchange(
    stream: UnixStream,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<(UnixStream, Vec<u8>, Vec<OwnedFd>)> {
    fdpass::send(&stream, payload, fds)?;
    let (reply, fds) = fdpass::recv(&stream)?;
    Ok((stream, reply, fds))
}

/// Whether `e` says the peer had closed the connection (rather than that it refused or garbled).
fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
    )
}

fn expect_ok(reply: Reply) -> io::Result<()> {
    match reply {
        Reply::Ok => Ok(()),
        other => Err(unexpected(other)),
    }
}

fn unexpected(reply: Reply) -> io::Error {
    let tag = match reply {
        Reply::Ok => "ok",
        Reply::Entries { .. } => "entries",
        Reply::Pong { .. } => "pong",
        Reply::Error { .. } => "error",
    };
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("fd holder answered {tag:?}, which does not fit the request"),
    )
}

/// Blobs as base64 strings: a third larger than the bytes, where a JSON array of numbers is up to
/// four times larger.
mod base64_bytes {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        STANDARD
            .decode(text.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_carry_the_version_beside_their_tag() {
        let wire = encode(Request::Deposit {
            key: "vol/a".into(),
            blob: b"\x00\xffjournal".to_vec(),
        });
        let json: serde_json::Value = serde_json::from_slice(&wire).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"version": 1, "op": "deposit", "key": "vol/a", "blob": "AP9qb3VybmFs"})
        );
        assert_eq!(
            decode::<Request>(&wire).unwrap(),
            Request::Deposit {
                key: "vol/a".into(),
                blob: b"\x00\xffjournal".to_vec()
            }
        );
        let pong = encode(Reply::Pong { pid: 7, entries: 2 });
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&pong).unwrap(),
            serde_json::json!({"version": 1, "reply": "pong", "pid": 7, "entries": 2})
        );
    }

    #[test]
    fn the_client_sends_again_on_a_fresh_connection_when_the_holder_closed_the_old() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("holder.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let (closed, was_closed) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || {
            // The first connection is closed unanswered, as an idle one is.
            drop(listener.accept().unwrap());
            closed.send(()).unwrap();
            let (stream, _) = listener.accept().unwrap();
            let (payload, _) = fdpass::recv(&stream).unwrap();
            assert_eq!(decode::<Request>(&payload).unwrap(), Request::Ping);
            fdpass::send(&stream, &encode(Reply::Pong { pid: 1, entries: 0 }), &[]).unwrap();
        });
        let mut client = Client::connect(&path).unwrap();
        was_closed.recv().unwrap();
        assert_eq!(client.ping().unwrap(), Pong { pid: 1, entries: 0 });
        server.join().unwrap();
    }

    #[test]
    fn another_version_is_refused_naming_both() {
        let err = decode::<Request>(br#"{"version": 2, "op": "teleport"}"#).unwrap_err();
        assert!(
            err.contains("version 2") && err.contains("version 1"),
            "{err}"
        );
        let err = decode::<Request>(br#"{"op": "ping"}"#).unwrap_err();
        assert!(err.contains("version"), "{err}");
        let err = decode::<Request>(br#"{"version": 1, "op": "teleport"}"#).unwrap_err();
        assert!(err.starts_with("malformed message"), "{err}");
    }

    #[test]
    fn deposits_outside_the_limits_are_refused() {
        assert!(check_deposit("k", b"", 1).is_ok());
        assert!(check_deposit("", b"", 1).unwrap_err().contains("empty"));
        assert!(check_deposit(&"k".repeat(MAX_KEY_BYTES), b"", 8).is_ok());
        assert!(check_deposit(&"k".repeat(MAX_KEY_BYTES + 1), b"", 1).is_err());
        assert!(check_deposit("k", &vec![0; MAX_BLOB_BYTES + 1], 1).is_err());
        assert!(check_deposit("k", b"", 0).unwrap_err().contains("not 0"));
        assert!(check_deposit("k", b"", 9).unwrap_err().contains("not 9"));
    }

    #[test]
    fn list_bytes_bounds_the_encoded_entry() {
        for (key, blob) in [("k", 0), ("\u{1}\"\\", 1), ("vol", 1000), ("x", 3 << 20)] {
            let info = EntryInfo {
                key: key.into(),
                blob: vec![0xff; blob],
                fd_count: MAX_FDS_PER_ENTRY,
            };
            let encoded = serde_json::to_vec(&info).unwrap().len() + 1; // a comma
            assert!(encoded <= list_bytes(key, blob), "{key:?} {blob}");
        }
        // The holder's whole table at the largest blob still fits one frame.
        assert!(list_bytes(&"\u{1}".repeat(MAX_KEY_BYTES), MAX_BLOB_BYTES) < MAX_LIST_BYTES);
    }
}
