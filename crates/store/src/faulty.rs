//! [`FaultyStore`]: wraps any [`ObjectStore`] and injects failures, short bodies and latency.
//!
//! Faults are rules checked on every call, in the order they were added; the first rule that fires
//! decides the call's fate:
//! - [`FaultyStore::fail_next`] / [`FaultyStore::fail_with_probability`]: the call fails with the
//!   given error *before* reaching the inner store (the request was lost on the way).
//! - [`FaultyStore::fail_next_after`] / [`FaultyStore::fail_after_with_probability`]: the inner store
//!   performs the call, then the caller gets the error (the response was lost: the PUT or DELETE
//!   did happen). This is what makes retries of non-idempotent sequences interesting.
//! - [`FaultyStore::truncate_next`] / [`FaultyStore::truncate_with_probability`]: `get_range`
//!   returns `Ok` with fewer bytes than the inner store gave, as a broken transport below the
//!   length checks would. Callers must notice the short read.
//! - [`FaultyStore::set_latency`]: every matching call sleeps first (on tokio's clock, so a test
//!   with paused time does not really wait).
//!
//! Randomness comes from a seeded xorshift generator, so a seed replays the same faults for the
//! same sequence of calls.

use std::fmt;
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use crate::{
    CompletedPart, ListPage, ListRequest, ObjectInfo, ObjectStore, Op, PutResult, Result,
    StoreError, UploadsPage, UploadsRequest,
};

/// Counts of what a [`FaultyStore`] injected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Calls that failed without reaching the inner store.
    pub failed_before: u64,
    /// Calls that reached the inner store and then failed.
    pub failed_after: u64,
    /// `get_range` bodies cut short.
    pub truncated: u64,
    /// Calls that were delayed.
    pub delayed: u64,
    /// Every call, by operation (in [`Op::ALL`]'s order; see [`FaultStats::calls_of`]).
    pub calls: [u64; Op::ALL.len()],
    /// Bytes the inner store's GETs returned (before any truncation).
    pub got_bytes: u64,
}

impl FaultStats {
    /// Calls of `op` so far (failed ones included).
    pub fn calls_of(&self, op: Op) -> u64 {
        let i = Op::ALL.iter().position(|o| *o == op).expect("in Op::ALL");
        self.calls[i]
    }
}

/// A store wrapper that injects faults; see the module docs.
pub struct FaultyStore<S> {
    inner: S,
    state: Mutex<State>,
}

struct State {
    rng: XorShift,
    rules: Vec<Rule>,
    latency: Vec<(Vec<Op>, Duration, Duration)>,
    stats: FaultStats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Effect {
    FailBefore,
    FailAfter,
    Truncate,
}

struct Rule {
    ops: Vec<Op>,
    effect: Effect,
    error: StoreError,
    /// `Some(n)`: fires on the next `n` matching calls, then is removed.
    remaining: Option<u64>,
    probability: f64,
}

/// What the rules decided for one call.
struct Plan {
    effect: Option<(Effect, StoreError)>,
    delay: Duration,
    truncate_fraction: f64,
}

impl<S: fmt::Debug> fmt::Debug for FaultyStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("FaultyStore")
            .field("inner", &self.inner)
            .field("rules", &state.rules.len())
            .field("stats", &state.stats)
            .finish()
    }
}

impl<S> FaultyStore<S> {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<S: ObjectStore> FaultyStore<S> {
    /// Wraps `inner` with no faults configured; `seed` drives every random choice.
    pub fn new(inner: S, seed: u64) -> Self {
        FaultyStore {
            inner,
            state: Mutex::new(State {
                rng: XorShift::new(seed),
                rules: Vec::new(),
                latency: Vec::new(),
                stats: FaultStats::default(),
            }),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner store.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The next `n` calls of `op` fail with `error` without reaching the inner store.
    pub fn fail_next(&self, op: Op, n: u64, error: StoreError) {
        self.add(vec![op], Effect::FailBefore, error, Some(n), 1.0);
    }

    /// The next `n` calls of `op` reach the inner store (and take effect there), then fail with
    /// `error`.
    pub fn fail_next_after(&self, op: Op, n: u64, error: StoreError) {
        self.add(vec![op], Effect::FailAfter, error, Some(n), 1.0);
    }

    /// Every call of one of `ops` fails with `error` with probability `p`, before reaching the
    /// inner store. Pass [`Op::ALL`] for every operation.
    pub fn fail_with_probability(
        &self,
        ops: impl IntoIterator<Item = Op>,
        p: f64,
        error: StoreError,
    ) {
        self.add(
            ops.into_iter().collect(),
            Effect::FailBefore,
            error,
            None,
            p,
        );
    }

    /// Like [`FaultyStore::fail_with_probability`], but the inner store performs the call first.
    pub fn fail_after_with_probability(
        &self,
        ops: impl IntoIterator<Item = Op>,
        p: f64,
        error: StoreError,
    ) {
        self.add(ops.into_iter().collect(), Effect::FailAfter, error, None, p);
    }

    /// The next `n` non-empty `get_range` bodies come back shorter than the inner store returned.
    pub fn truncate_next(&self, n: u64) {
        self.add(
            vec![Op::Get],
            Effect::Truncate,
            truncated_marker(),
            Some(n),
            1.0,
        );
    }

    /// Each non-empty `get_range` body is cut short with probability `p`.
    pub fn truncate_with_probability(&self, p: f64) {
        self.add(vec![Op::Get], Effect::Truncate, truncated_marker(), None, p);
    }

    /// Every call of one of `ops` first sleeps `base` plus a uniformly random part of `jitter`.
    /// Settings for one op add up.
    pub fn set_latency(&self, ops: impl IntoIterator<Item = Op>, base: Duration, jitter: Duration) {
        self.lock()
            .latency
            .push((ops.into_iter().collect(), base, jitter));
    }

    /// Removes every fault and latency rule (the counters stay).
    pub fn clear(&self) {
        let mut state = self.lock();
        state.rules.clear();
        state.latency.clear();
    }

    /// What was injected so far.
    pub fn stats(&self) -> FaultStats {
        self.lock().stats.clone()
    }

    fn add(&self, ops: Vec<Op>, effect: Effect, error: StoreError, remaining: Option<u64>, p: f64) {
        if remaining == Some(0) {
            return;
        }
        self.lock().rules.push(Rule {
            ops,
            effect,
            error,
            remaining,
            probability: p.clamp(0.0, 1.0),
        });
    }

    /// A GET (`call`) through the rules for [`Op::Get`]: delays, failures and truncated bodies.
    async fn get_faulty(
        &self,
        call: impl std::future::Future<Output = Result<Bytes>>,
    ) -> Result<Bytes> {
        let pieces = self
            .get_pieces_faulty(async { call.await.map(|b| vec![b]) })
            .await?;
        Ok(pieces.into_iter().next().unwrap_or_default())
    }

    /// [`Self::get_faulty`] for a body in pieces: a truncation cuts the whole body, so the pieces
    /// past the cut are gone and the one it falls in is short.
    async fn get_pieces_faulty(
        &self,
        call: impl std::future::Future<Output = Result<Vec<Bytes>>>,
    ) -> Result<Vec<Bytes>> {
        let (pieces, truncate) = self.run_planned(Op::Get, call).await?;
        let total: usize = pieces.iter().map(Bytes::len).sum();
        self.lock().stats.got_bytes += total as u64;
        match truncate {
            Some(fraction) if total > 0 => {
                // Strictly shorter: somewhere in [0, total).
                let mut keep = (((total as f64) * fraction) as usize).min(total - 1);
                self.lock().stats.truncated += 1;
                let mut out = Vec::new();
                for p in pieces {
                    let n = p.len().min(keep);
                    out.push(p.slice(..n));
                    keep -= n;
                    if keep == 0 {
                        break;
                    }
                }
                Ok(out)
            }
            _ => Ok(pieces),
        }
    }

    fn plan(&self, op: Op) -> Plan {
        let mut guard = self.lock();
        let state = &mut *guard;
        if let Some(i) = Op::ALL.iter().position(|o| *o == op) {
            state.stats.calls[i] += 1;
        }
        let mut delay = Duration::ZERO;
        for (ops, base, jitter) in &state.latency {
            if ops.contains(&op) {
                delay += *base + jitter.mul_f64(state.rng.next_f64());
            }
        }
        if !delay.is_zero() {
            state.stats.delayed += 1;
        }
        let mut effect = None;
        let mut exhausted = None;
        for (i, rule) in state.rules.iter_mut().enumerate() {
            if !rule.ops.contains(&op) {
                continue;
            }
            let fires = rule.probability >= 1.0 || state.rng.next_f64() < rule.probability;
            if !fires {
                continue;
            }
            if let Some(n) = rule.remaining.as_mut() {
                *n -= 1;
                if *n == 0 {
                    exhausted = Some(i);
                }
            }
            effect = Some((rule.effect, rule.error.clone()));
            break;
        }
        if let Some(i) = exhausted {
            state.rules.remove(i);
        }
        match effect.as_ref().map(|(e, _)| *e) {
            Some(Effect::FailBefore) => state.stats.failed_before += 1,
            Some(Effect::FailAfter) => state.stats.failed_after += 1,
            Some(Effect::Truncate) | None => {}
        }
        Plan {
            effect,
            delay,
            truncate_fraction: state.rng.next_f64(),
        }
    }

    /// Runs one call of `op` through the rules.
    async fn run<T, F>(&self, op: Op, call: F) -> Result<T>
    where
        F: std::future::Future<Output = Result<T>>,
    {
        Ok(self.run_planned(op, call).await?.0)
    }

    /// [`Self::run`], also saying what fraction of a body to keep when the rule is a truncation.
    async fn run_planned<T, F>(&self, op: Op, call: F) -> Result<(T, Option<f64>)>
    where
        F: std::future::Future<Output = Result<T>>,
    {
        let plan = self.plan(op);
        if !plan.delay.is_zero() {
            tokio::time::sleep(plan.delay).await;
        }
        match plan.effect {
            Some((Effect::FailBefore, error)) => Err(error),
            Some((Effect::FailAfter, error)) => {
                // The inner outcome is discarded, as if the response never arrived.
                let _ = call.await;
                Err(error)
            }
            Some((Effect::Truncate, _)) => Ok((call.await?, Some(plan.truncate_fraction))),
            None => Ok((call.await?, None)),
        }
    }
}

/// Truncation rules carry no error; this fills the slot.
fn truncated_marker() -> StoreError {
    StoreError::Corrupt("injected truncation".into())
}

/// xorshift64*: tiny, fast, deterministic; plenty for choosing faults.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> Self {
        // The state must never be zero; mix the seed so nearby seeds diverge at once.
        let mixed = seed
            .wrapping_add(0x9e37_79b9_7f4a_7c15)
            .wrapping_mul(0xbf58_476d_1ce4_e5b9);
        XorShift(if mixed == 0 {
            0x2545_f491_4f6c_dd1d
        } else {
            mixed
        })
    }

    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[async_trait]
impl<S: ObjectStore> ObjectStore for FaultyStore<S> {
    async fn head_bucket(&self, bucket: &str) -> Result<()> {
        self.run(Op::HeadBucket, self.inner.head_bucket(bucket))
            .await
    }

    async fn list(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage> {
        self.run(Op::List, self.inner.list(bucket, req)).await
    }

    async fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo> {
        self.run(Op::Head, self.inner.head(bucket, key)).await
    }

    async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> Result<Bytes> {
        self.get_faulty(self.inner.get_range(bucket, key, range, if_match))
            .await
    }

    async fn get_range_pieces(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        piece: u64,
    ) -> Result<Vec<Bytes>> {
        self.get_pieces_faulty(
            self.inner
                .get_range_pieces(bucket, key, range, if_match, piece),
        )
        .await
    }

    async fn get_range_unmodified(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        last_modified: Option<SystemTime>,
        size: u64,
    ) -> Result<Bytes> {
        self.get_faulty(
            self.inner
                .get_range_unmodified(bucket, key, range, last_modified, size),
        )
        .await
    }

    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        self.run(Op::Put, self.inner.put(bucket, key, body)).await
    }

    async fn put_if_absent(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        self.run(Op::Put, self.inner.put_if_absent(bucket, key, body))
            .await
    }

    async fn create_multipart(&self, bucket: &str, key: &str) -> Result<String> {
        self.run(
            Op::CreateMultipart,
            self.inner.create_multipart(bucket, key),
        )
        .await
    }

    async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> Result<CompletedPart> {
        self.run(
            Op::UploadPart,
            self.inner
                .upload_part(bucket, key, upload_id, part_number, body),
        )
        .await
    }

    async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        self.run(
            Op::CompleteMultipart,
            self.inner.complete_multipart(bucket, key, upload_id, parts),
        )
        .await
    }

    async fn complete_multipart_if_absent(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        self.run(
            Op::CompleteMultipart,
            self.inner
                .complete_multipart_if_absent(bucket, key, upload_id, parts),
        )
        .await
    }

    async fn abort_multipart(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()> {
        self.run(
            Op::AbortMultipart,
            self.inner.abort_multipart(bucket, key, upload_id),
        )
        .await
    }

    async fn list_uploads(&self, bucket: &str, req: UploadsRequest<'_>) -> Result<UploadsPage> {
        self.run(Op::ListUploads, self.inner.list_uploads(bucket, req))
            .await
    }

    async fn delete(&self, bucket: &str, key: &str) -> Result<()> {
        self.run(Op::Delete, self.inner.delete(bucket, key)).await
    }

    async fn delete_many(&self, bucket: &str, keys: &[String]) -> Result<()> {
        self.run(Op::DeleteMany, self.inner.delete_many(bucket, keys))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    const B: &str = "b";

    fn faulty(seed: u64) -> FaultyStore<MemoryStore> {
        let m = MemoryStore::new();
        m.create_bucket(B);
        m.insert(B, "k", "0123456789");
        FaultyStore::new(m, seed)
    }

    fn transient() -> StoreError {
        StoreError::Transient("injected".into())
    }

    #[tokio::test]
    async fn no_rules_passes_through() {
        let f = faulty(1);
        assert_eq!(f.get_range(B, "k", 0..4, None).await.unwrap(), "0123");
        f.put(B, "x", "y".into()).await.unwrap();
        let stats = f.stats();
        assert_eq!((stats.calls_of(Op::Get), stats.calls_of(Op::Put)), (1, 1));
        assert_eq!(stats.got_bytes, 4);
        assert_eq!(
            FaultStats {
                calls: Default::default(),
                got_bytes: 0,
                ..stats
            },
            FaultStats::default(),
            "nothing injected"
        );
        assert_eq!(f.inner().stats().total_requests(), 2);
    }

    #[tokio::test]
    async fn fail_next_n_then_recover() {
        let f = faulty(1);
        f.fail_next(Op::Head, 2, transient());
        assert_eq!(f.head(B, "k").await.unwrap_err(), transient());
        // Other ops are unaffected.
        f.get_range(B, "k", 0..1, None).await.unwrap();
        assert_eq!(f.head(B, "k").await.unwrap_err(), transient());
        f.head(B, "k").await.unwrap();
        assert_eq!(f.stats().failed_before, 2);
        // Failures before the call never reach the inner store.
        assert_eq!(f.inner().stats().head, 1);
    }

    #[tokio::test]
    async fn fail_after_lets_the_call_happen() {
        let f = faulty(1);
        f.fail_next_after(Op::Put, 1, StoreError::Throttled("503".into()));
        let e = f.put(B, "new", "v".into()).await.unwrap_err();
        assert!(matches!(e, StoreError::Throttled(_)));
        assert_eq!(f.inner().get_object(B, "new").unwrap(), "v");
        assert_eq!(f.stats().failed_after, 1);
    }

    #[tokio::test]
    async fn rules_apply_in_order() {
        let f = faulty(1);
        f.fail_next(Op::Delete, 1, StoreError::AccessDenied("first".into()));
        f.fail_next(Op::Delete, 1, StoreError::NotFound("second".into()));
        assert!(matches!(
            f.delete(B, "k").await,
            Err(StoreError::AccessDenied(_))
        ));
        assert!(matches!(
            f.delete(B, "k").await,
            Err(StoreError::NotFound(_))
        ));
        f.delete(B, "k").await.unwrap();
    }

    #[tokio::test]
    async fn probability_is_seeded_and_roughly_right() {
        async fn pattern(seed: u64) -> Vec<bool> {
            let f = faulty(seed);
            f.fail_with_probability(Op::ALL, 0.3, transient());
            let mut out = Vec::new();
            for _ in 0..1000 {
                out.push(f.head(B, "k").await.is_err());
            }
            out
        }
        let a = pattern(42).await;
        assert_eq!(a, pattern(42).await, "same seed, same faults");
        assert_ne!(a, pattern(43).await, "another seed, other faults");
        let failures = a.iter().filter(|&&x| x).count();
        assert!(
            (220..380).contains(&failures),
            "{failures} of 1000 at p=0.3"
        );

        let f = faulty(7);
        f.fail_with_probability([Op::List], 0.0, transient());
        f.fail_after_with_probability([Op::Head], 1.0, transient());
        for _ in 0..20 {
            f.list(B, ListRequest::default()).await.unwrap();
            assert!(f.head(B, "k").await.is_err());
        }
        f.clear();
        f.head(B, "k").await.unwrap();
    }

    #[tokio::test]
    async fn truncation_returns_fewer_bytes() {
        let f = faulty(3);
        f.truncate_next(3);
        for _ in 0..3 {
            let body = f.get_range(B, "k", 0..10, None).await.unwrap();
            assert!(body.len() < 10, "{body:?}");
            assert!(b"0123456789".starts_with(&body));
        }
        assert_eq!(f.get_range(B, "k", 0..10, None).await.unwrap().len(), 10);
        assert_eq!(f.stats().truncated, 3);
        // A single byte comes back empty.
        f.truncate_next(1);
        assert!(f.get_range(B, "k", 5..6, None).await.unwrap().is_empty());
        f.truncate_with_probability(1.0);
        assert!(f.get_range(B, "k", 0..10, None).await.unwrap().len() < 10);
        // Errors from the inner store still come through.
        assert!(matches!(
            f.get_range(B, "k", 20..30, None).await,
            Err(StoreError::InvalidRequest(_))
        ));
    }

    #[tokio::test]
    async fn a_body_in_pieces_is_cut_as_a_whole() {
        let f = faulty(5);
        let whole = f.get_range_pieces(B, "k", 0..10, None, 3).await.unwrap();
        assert_eq!(whole, ["012", "345", "678", "9"]);
        f.truncate_next(20);
        for _ in 0..20 {
            let pieces = f.get_range_pieces(B, "k", 0..10, None, 3).await.unwrap();
            let got = pieces.concat();
            assert!(
                got.len() < 10 && b"0123456789".starts_with(&got),
                "{pieces:?}"
            );
            // Every piece but the last is whole.
            let n = pieces.len();
            assert!(pieces[..n - 1].iter().all(|p| p.len() == 3), "{pieces:?}");
        }
        assert_eq!(f.stats().truncated, 20);
        assert_eq!(f.stats().calls_of(Op::Get), 21);
    }

    #[tokio::test(start_paused = true)]
    async fn latency_uses_tokio_time() {
        let f = faulty(5);
        f.set_latency(
            [Op::Get],
            Duration::from_millis(100),
            Duration::from_millis(50),
        );
        let start = tokio::time::Instant::now();
        f.get_range(B, "k", 0..1, None).await.unwrap();
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(100) && took <= Duration::from_millis(150),
            "{took:?}"
        );
        let start = tokio::time::Instant::now();
        f.head(B, "k").await.unwrap();
        assert!(start.elapsed() < Duration::from_millis(1));
        assert_eq!(f.stats().delayed, 1);
    }

    #[tokio::test]
    async fn wraps_a_shared_dyn_store() {
        let m = MemoryStore::new();
        m.create_bucket(B);
        let shared: std::sync::Arc<dyn ObjectStore> = std::sync::Arc::new(m);
        let f = FaultyStore::new(shared, 9);
        f.fail_next(Op::HeadBucket, 1, transient());
        assert!(f.head_bucket(B).await.is_err());
        f.head_bucket(B).await.unwrap();
        assert!(format!("{f:?}").contains("FaultyStore"));
    }
}
