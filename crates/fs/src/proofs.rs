//! Proofs of access for the node cache: which object versions a set of credentials was shown
//! to read (a HEAD or GET with them returned that ETag), and when.
//!
//! The node cache serves a version only to a mount whose credentials proved access to it. Mounts
//! that use the very same store (the node plugin keeps one client per endpoint and identity) have
//! the same credentials, so they share one [`Proofs`]: many pods of one identity on a node prove
//! each object once, not once per pod. Each mount still honours its own metadata TTL: a proof is
//! valid for a mount while `proven_at + min(its TTL, PROOF_LIFETIME)` has not passed.
//!
//! Why [`PROOF_LIFETIME`] bounds it: a proof stands for an access check S3 would make on every
//! GET. It can only be wrong when the identity's permission to read was taken away after the
//! check (another identity never uses it, and it names one version: a changed object has another
//! ETag). With a mount whose metadata never expires (read-only datasets), an unbounded proof
//! would keep serving the node cache's bytes to a revoked identity for the mount's life; ten
//! minutes bounds that, as the kernel's page cache does for bytes a mount already read, at one
//! access check (a HEAD, or the GET that fetches the data anyway) per version and identity every
//! ten minutes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use tokio::time::Instant;

use ferry_store::ObjectStore;

use crate::config::MetadataTtl;

/// The longest a proof lets mounts skip the access check (see the module's documentation).
pub const PROOF_LIFETIME: std::time::Duration = std::time::Duration::from_secs(600);

/// Most remembered proofs per store; past it, the oldest half is dropped (re-proved by a HEAD).
const PROOFS_MAX: usize = 1 << 20;

/// The proofs of one set of credentials: (bucket, key, ETag) → when.
#[derive(Debug)]
pub struct Proofs {
    /// Unique for the process's life: names these credentials to the node cache's single
    /// flights (never an address, which a later `Proofs` could reuse).
    id: u64,
    map: Mutex<HashMap<(String, String, String), Instant>>,
}

impl Default for Proofs {
    fn default() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Proofs {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            map: Mutex::default(),
        }
    }
}

impl Proofs {
    /// This set of credentials' id (see the field).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Records that these credentials read `bucket/key` at `etag` just now.
    pub fn prove(&self, bucket: &str, key: &str, etag: &str) {
        let now = Instant::now();
        let mut map = self.map.lock().expect("proofs lock");
        if map.len() >= PROOFS_MAX {
            let mut ages: Vec<Instant> = map.values().copied().collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            map.retain(|_, at| *at > cut);
        }
        map.insert((bucket.to_owned(), key.to_owned(), etag.to_owned()), now);
    }

    /// Whether these credentials proved access to `bucket/key` at `etag` within `ttl` (and
    /// within [`PROOF_LIFETIME`]).
    pub fn is_proven(&self, bucket: &str, key: &str, etag: &str, ttl: MetadataTtl) -> bool {
        self.is_proven_at(bucket, key, etag, ttl, Instant::now())
    }

    fn is_proven_at(
        &self,
        bucket: &str,
        key: &str,
        etag: &str,
        ttl: MetadataTtl,
        now: Instant,
    ) -> bool {
        self.proven_until(bucket, key, etag, ttl)
            .is_some_and(|until| now < until)
    }

    /// When the proof of `bucket/key` at `etag` for a mount of metadata TTL `ttl` ends (it may
    /// have ended already), if there is one.
    pub fn proven_until(
        &self,
        bucket: &str,
        key: &str,
        etag: &str,
        ttl: MetadataTtl,
    ) -> Option<Instant> {
        let lifetime = match ttl {
            MetadataTtl::Indefinite => PROOF_LIFETIME,
            MetadataTtl::Duration(d) => d.min(PROOF_LIFETIME),
        };
        let map = self.map.lock().expect("proofs lock");
        let at = map.get(&(bucket.to_owned(), key.to_owned(), etag.to_owned()))?;
        Some(at.checked_add(lifetime).unwrap_or(*at))
    }

    pub fn len(&self) -> usize {
        self.map.lock().expect("proofs lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One store (held weakly) and its proofs.
type Book = (Weak<dyn ObjectStore>, Arc<Proofs>);

/// The node's [`Proofs`], one per live store: mounts given the same store share them.
#[derive(Default)]
pub struct ProofRegistry {
    books: Mutex<Vec<Book>>,
}

impl std::fmt::Debug for ProofRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.books.lock().map(|b| b.len()).unwrap_or(0);
        f.debug_struct("ProofRegistry").field("stores", &n).finish()
    }
}

impl ProofRegistry {
    /// The proofs of `store`'s credentials. A store that is gone takes its proofs with it, so a
    /// new store at the same address never inherits them.
    pub fn for_store(&self, store: &Arc<dyn ObjectStore>) -> Arc<Proofs> {
        let mut books = self.books.lock().expect("proof registry lock");
        books.retain(|(w, _)| w.strong_count() > 0);
        let weak = Arc::downgrade(store);
        if let Some((_, p)) = books.iter().find(|(w, _)| Weak::ptr_eq(w, &weak)) {
            return p.clone();
        }
        let p = Arc::new(Proofs::default());
        books.push((weak, p.clone()));
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_store::MemoryStore;
    use std::time::Duration;

    #[test]
    fn proofs_are_shared_by_store_and_honour_each_mounts_ttl() {
        let reg = ProofRegistry::default();
        let a: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
        let b: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
        let (pa, pa2, pb) = (
            reg.for_store(&a),
            reg.for_store(&a.clone()),
            reg.for_store(&b),
        );
        assert!(Arc::ptr_eq(&pa, &pa2), "one store, one book");
        assert!(!Arc::ptr_eq(&pa, &pb), "other credentials, other book");
        pa.prove("bk", "k", "\"e1\"");
        let forever = MetadataTtl::Indefinite;
        assert!(pa2.is_proven("bk", "k", "\"e1\"", forever));
        assert!(
            !pa.is_proven("bk", "k", "\"e2\"", forever),
            "another version"
        );
        assert!(
            !pa.is_proven("other", "k", "\"e1\"", forever),
            "another bucket"
        );
        assert!(!pb.is_proven("bk", "k", "\"e1\"", forever));
        assert!(!pa.is_proven("bk", "k", "\"e1\"", MetadataTtl::Duration(Duration::ZERO)));
        // Even a mount whose metadata never expires checks access again after the lifetime.
        let later = Instant::now() + PROOF_LIFETIME + Duration::from_secs(1);
        assert!(!pa.is_proven_at("bk", "k", "\"e1\"", forever, later));
        assert!(pa.is_proven(
            "bk",
            "k",
            "\"e1\"",
            MetadataTtl::Duration(PROOF_LIFETIME * 10)
        ));
        // A dropped store's book goes with it.
        drop((a, pa, pa2));
        let c: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
        assert!(!reg.for_store(&c).is_proven("bk", "k", "\"e1\"", forever));
    }
}
