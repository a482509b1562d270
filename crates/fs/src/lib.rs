//! Ferry's FUSE filesystem: an S3 prefix as a POSIX directory tree.
//!
//! The core ([`fs::Fs`], with [`inode`], [`handles`], [`names`]) knows nothing of fuser: it works
//! on inode and handle numbers and returns [`FsError`]s. [`fuse`] is a thin adapter implementing
//! [`fuser::Filesystem`] on top of it, and [`FsError::errno`] is the one place errnos are chosen.
//! [`mount`] wires the two to a kernel mount. Semantics: `doc/SEMANTICS.md`.

pub mod alloc;
pub mod budget;
pub mod config;
pub mod error;
pub mod fs;
pub mod fuse;
pub mod handles;
pub mod handover;
pub mod inode;
pub mod journal;
pub mod mount;
pub mod mountinfo;
pub mod names;
pub mod prefetch;
pub mod proofs;
pub mod warmup;

pub use budget::{MemoryBudget, MountContext, PrefetchConfig, Reservation, Use};
pub use config::{ConfigError, MetadataTtl, MountConfig};
pub use error::FsError;
pub use fs::{Fs, FsSnapshot};
pub use handover::KernelInit;
pub use journal::{replay, Journal, JournalError, JournalHeader, Recovered};
pub use mount::{is_mounted, mount, resume, Frozen, MountError, MountHandle};
pub use proofs::{ProofRegistry, Proofs};
pub use warmup::{warm_up, warm_up_as, WarmUp, WarmUpReport};
