//! Listing: [`list_pages`], the one paginated LIST loop (every caller that pages through a listing
//! uses it), and [`list_all`], a whole prefix with many LIST requests in flight.
//!
//! ListObjectsV2 pages are sequential: each page's continuation token comes with the page before,
//! so one listing of N pages costs N round trips (Mountpoint users report 45 minutes for ~100,000
//! files). [`list_all`] splits the key space instead. After a page, it guesses from the page's
//! names (their common prefix and the characters each position takes: digits, hex, letters…) where
//! the listing will be one page, two pages, … further on, and lists those ranges at once, each
//! with `StartAfter` at its start, paging on until it passes its end. The page after the first is
//! split in two halves (the first asking for half a page), so a directory of two pages is listed
//! in about one and a half page times; and once a range's pages reach the end of the listing,
//! the ranges guessed past it are not waited for.
//!
//! Guesses only cost requests, never correctness. Each range `(start, end]` keeps exactly the
//! entries (keys and common prefixes) that sort inside it, and pages until it sees an entry past
//! `end` or the listing ends. Every entry sorts into exactly one range, and the listing that
//! starts after that range's start reports it. So the ranges joined in order are exactly the
//! sequential listing, whatever the guesses were. A guess that lands past the end of the listing
//! costs one empty LIST. A guess that lands too close to the previous one costs a page read for
//! little. Names that give no usable guess (a single page, non-ASCII bytes where the names differ)
//! are listed page by page as before.
//!
//! All of this rests on S3's order: keys and common prefixes in byte order, page after page. A
//! server that lists in another order (a file-system walk that puts `a/` before `a-b`, say) is
//! caught where a page is out of order or starts before the previous one ended; the listing is
//! then made again page by page, in the server's order, so no entry is lost.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use std::future::Future;
use std::pin::pin;

use futures::future::{select, try_join_all, BoxFuture, Either, FutureExt};
use futures::{Stream, TryStreamExt};
use tokio::sync::Semaphore;

use crate::{ListPage, ListRequest, ObjectInfo, ObjectStore, Result, StoreError};

/// The pages of one sequential listing, in the server's order: `req` first, then each next page
/// with the continuation token of the page before, until a page has none. The first error ends
/// the stream. (`start_after` applies to the first request only; S3 ignores it beside a token.)
/// A server that hands out a continuation token it handed out before (a listing that would never
/// end) ends it with [`StoreError::Corrupt`].
pub fn list_pages<'a>(
    store: &'a dyn ObjectStore,
    bucket: &'a str,
    req: ListRequest<'a>,
) -> impl Stream<Item = Result<ListPage>> + Send + 'a {
    pages(bucket, req, move |req| store.list(bucket, req))
}

/// What a page says about the next one.
trait Paged {
    fn next_token(&self) -> Option<&str>;
}

impl Paged for ListPage {
    fn next_token(&self) -> Option<&str> {
        self.next_token.as_deref()
    }
}

/// The paging loop behind [`list_pages`], for any `fetch` of one page. Every token is used once:
/// a page that hands out one already used (itself, or one before it) is an error, not a loop.
fn pages<'a, P, F, Fut>(
    bucket: &'a str,
    first: ListRequest<'a>,
    fetch: F,
) -> impl Stream<Item = Result<P>> + 'a
where
    P: Paged + 'a,
    F: Fn(ListRequest<'a>) -> Fut + 'a,
    Fut: Future<Output = Result<P>> + 'a,
{
    let used: HashSet<String> = first.continuation.iter().cloned().collect();
    futures::stream::try_unfold(
        (Some(first), fetch, used),
        move |(req, fetch, mut used)| async move {
            let Some(req) = req else {
                return Ok(None);
            };
            let page = fetch(req.clone()).await?;
            let next = match page.next_token() {
                None => None,
                Some(token) if !used.insert(token.to_owned()) => {
                    return Err(StoreError::Corrupt(format!(
                    "LIST {bucket}/{}: the server handed out the continuation token {token:?} a second time (the listing would never end)",
                    req.prefix
                )));
                }
                Some(token) => Some(ListRequest {
                    continuation: Some(token.to_owned()),
                    start_after: None,
                    ..req
                }),
            };
            Ok(Some((page, (next, fetch, used))))
        },
    )
}

/// How [`list_all`] lists.
#[derive(Debug, Clone, Copy)]
pub struct ListAll<'a> {
    pub prefix: &'a str,
    /// `Some("/")` for a directory; `None` for every key under the prefix.
    pub delimiter: Option<&'a str>,
    /// LIST requests in flight at most; 1 lists page by page.
    pub concurrency: usize,
    /// `max_keys` of each request; `None` leaves the page size to the server (1,000 on S3).
    pub page_size: Option<u32>,
    /// The listing's first page, already fetched by the caller (the same prefix and delimiter,
    /// no `start_after`, the same page size): the listing goes on from it instead of asking for
    /// it again.
    pub first_page: Option<&'a ListPage>,
}

impl<'a> ListAll<'a> {
    /// A directory-style listing of `prefix` (delimiter `/`), `concurrency` requests in flight.
    pub fn dir(prefix: &'a str, concurrency: usize) -> Self {
        ListAll {
            prefix,
            delimiter: Some("/"),
            concurrency,
            page_size: None,
            first_page: None,
        }
    }
}

/// Everything under a prefix, in the order one sequential listing returns it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listed {
    pub objects: Vec<ObjectInfo>,
    pub common_prefixes: Vec<String>,
    /// LIST requests made (guesses that missed included).
    pub requests: u32,
}

/// Lists every key (and common prefix) under `opts.prefix`, with up to `opts.concurrency` LIST
/// requests in flight (see the module documentation). The first error fails the listing.
pub async fn list_all(store: &dyn ObjectStore, bucket: &str, opts: ListAll<'_>) -> Result<Listed> {
    let lister = Lister {
        store,
        bucket,
        opts,
        permits: Semaphore::new(opts.concurrency.max(1)),
        requests: AtomicU32::new(0),
        unordered: AtomicBool::new(false),
    };
    if opts.concurrency > 1 {
        let entries = lister.range(None, None, 1).await?;
        if !lister.unordered.load(Ordering::Relaxed) {
            let mut listed = Listed {
                requests: lister.requests.load(Ordering::Relaxed),
                ..Listed::default()
            };
            for entry in entries {
                match entry {
                    Entry::Object(o) => listed.objects.push(o),
                    Entry::Prefix(p) => listed.common_prefixes.push(p),
                }
            }
            return Ok(listed);
        }
        tracing::warn!(
            prefix = opts.prefix,
            "the server lists out of S3's byte order: listing page by page instead"
        );
    }
    lister.sequential().await
}

impl Lister<'_> {
    /// Every page, one after the other, as the server orders them.
    async fn sequential(&self) -> Result<Listed> {
        let mut start = Listed::default();
        let mut continuation = None;
        if let Some(first) = self.opts.first_page {
            start.objects.clone_from(&first.objects);
            start.common_prefixes.clone_from(&first.common_prefixes);
            match &first.next_token {
                Some(token) => continuation = Some(token.clone()),
                None => return Ok(start),
            }
        }
        let req = ListRequest {
            prefix: self.opts.prefix,
            delimiter: self.opts.delimiter,
            continuation,
            max_keys: self.opts.page_size,
            start_after: None,
        };
        let mut listed = list_pages(self.store, self.bucket, req)
            .inspect_ok(|_| {
                self.requests.fetch_add(1, Ordering::Relaxed);
            })
            .try_fold(start, |mut listed, page| async move {
                listed.objects.extend(page.objects);
                listed.common_prefixes.extend(page.common_prefixes);
                Ok(listed)
            })
            .await?;
        listed.requests = self.requests.load(Ordering::Relaxed);
        Ok(listed)
    }
}

enum Entry {
    Object(ObjectInfo),
    Prefix(String),
}

impl Entry {
    fn name(&self) -> &str {
        match self {
            Entry::Object(o) => &o.key,
            Entry::Prefix(p) => p,
        }
    }
}

/// One page, its entries merged into one sorted run.
struct Page {
    entries: Vec<Entry>,
    next_token: Option<String>,
}

impl Paged for Page {
    fn next_token(&self) -> Option<&str> {
        self.next_token.as_deref()
    }
}

impl Page {
    fn last(&self) -> Option<&str> {
        self.entries.last().map(Entry::name)
    }

    /// True when no entry of the range `(.., end]` can come after this page (entries only grow).
    fn ends(&self, end: Option<&str>) -> bool {
        self.next_token.is_none() || matches!((self.last(), end), (Some(l), Some(e)) if l >= e)
    }
}

struct Lister<'a> {
    store: &'a dyn ObjectStore,
    bucket: &'a str,
    opts: ListAll<'a>,
    permits: Semaphore,
    requests: AtomicU32,
    /// Set when the server was seen to list out of byte order: the ranges stop, and the
    /// listing is made again page by page.
    unordered: AtomicBool,
}

impl<'a> Lister<'a> {
    /// The first page of the listing after `start_after` (the caller's, for the whole listing).
    async fn page(&self, start_after: Option<&str>) -> Result<Page> {
        if let (None, Some(first)) = (start_after, self.opts.first_page) {
            return Ok(self.sorted(first.clone()));
        }
        self.fetch(ListRequest {
            prefix: self.opts.prefix,
            delimiter: self.opts.delimiter,
            start_after,
            continuation: None,
            max_keys: self.opts.page_size,
        })
        .await
    }

    /// One LIST request (within the limit of requests in flight), its entries sorted.
    async fn fetch(&self, req: ListRequest<'_>) -> Result<Page> {
        let page = {
            let _permit = self
                .permits
                .acquire()
                .await
                .expect("the semaphore is never closed");
            self.requests.fetch_add(1, Ordering::Relaxed);
            self.store.list(self.bucket, req).await?
        };
        Ok(self.sorted(page))
    }

    /// A page's entries merged into one sorted run; a page out of byte order is noted.
    fn sorted(&self, page: ListPage) -> Page {
        if !page.objects.is_sorted_by(|a, b| a.key < b.key)
            || !page.common_prefixes.is_sorted_by(|a, b| a < b)
        {
            self.unordered.store(true, Ordering::Relaxed);
        }
        let mut entries: Vec<Entry> = page.objects.into_iter().map(Entry::Object).collect();
        entries.extend(page.common_prefixes.into_iter().map(Entry::Prefix));
        entries.sort_by(|a, b| a.name().cmp(b.name()));
        Page {
            entries,
            next_token: page.next_token,
        }
    }

    /// The entries that sort in `(start, end]` (`None`: unbounded), listed from `start` on. An
    /// unbounded range splits itself after its first page when the page's names allow a guess:
    /// into `wave` ranges of about a page each (fewer if the requests in flight are capped lower)
    /// and a new unbounded range after them, which splits into twice as many (after the
    /// listing's first page: one range of half a page, and the unbounded one). A directory of two
    /// pages so costs at most one LIST more than the pages, and a large one soon has every
    /// request in flight.
    fn range(
        &'a self,
        start: Option<String>,
        end: Option<String>,
        wave: usize,
    ) -> BoxFuture<'a, Result<Vec<Entry>>> {
        async move {
            let first = self.page(start.as_deref()).await?;
            let mut out = Vec::new();
            let done = first.ends(end.as_deref());
            let last = first.last().map(str::to_owned);
            // After the listing's first page, the next one is split in two halves listed at
            // once (a directory of two pages is done in one and a half page times, with the
            // same number of LISTs); later ranges split a page apart.
            let halves = start.is_none();
            let splits = match (&end, done, self.opts.concurrency > 1) {
                (None, false, true) if halves => guess_splits(&first.entries, 1, 2),
                (None, false, true) => guess_splits(
                    &first.entries,
                    wave.min(self.opts.concurrency - 1).max(1),
                    1,
                ),
                _ => Vec::new(),
            };
            // The half page's first request asks for half a page (the first page was a whole one).
            let half = u32::try_from(first.entries.len() / 2)
                .ok()
                .filter(|h| halves && *h > 0);
            let token = first.next_token.clone();
            keep(&mut out, first.entries, start.as_deref(), end.as_deref());
            if done || self.unordered.load(Ordering::Relaxed) {
                return Ok(out);
            }
            if splits.is_empty() {
                out.extend(self.rest(token, last, start, end, None).await?.0);
                return Ok(out);
            }
            debug_assert!(last.as_deref() < Some(splits[0].as_str()));
            // This range now ends at the first split; the splits between them make bounded ranges,
            // and the last split starts a new unbounded one.
            let mine = self.rest(token, last, start, Some(splits[0].clone()), half);
            let mut ranges = Vec::with_capacity(splits.len());
            for (i, s) in splits.iter().enumerate() {
                ranges.push(self.range(Some(s.clone()), splits.get(i + 1).cloned(), wave * 2));
            }
            let (mine, theirs) = (pin!(mine), pin!(try_join_all(ranges)));
            match select(mine, theirs).await {
                Either::Left((mine, theirs)) => {
                    let (mine, tail) = mine?;
                    out.extend(mine);
                    match tail {
                        // The listing ended in this range's last page (a guess past the end of a
                        // directory of two pages, say): the ranges after it would only list that
                        // page's tail again, so they are not waited for.
                        Some(tail) => out.extend(tail),
                        None => out.extend(theirs.await?.into_iter().flatten()),
                    }
                }
                Either::Right((theirs, mine)) => {
                    let theirs = theirs?;
                    out.extend(mine.await?.0);
                    out.extend(theirs.into_iter().flatten());
                }
            }
            Ok(out)
        }
        .boxed()
    }

    /// Pages on from `token` (a continuation of a listing that started after `start`, whose
    /// last page ended at `last`) and keeps what sorts in `(start, end]`. When the listing ended
    /// in the last page read (no continuation token), also returns what that page held past
    /// `end`: everything the listing has after this range. The first request asks for
    /// `first_max_keys` entries if given (the rest for the listing's page size).
    async fn rest(
        &self,
        token: Option<String>,
        mut last: Option<String>,
        start: Option<String>,
        end: Option<String>,
        first_max_keys: Option<u32>,
    ) -> Result<(Vec<Entry>, Option<Vec<Entry>>)> {
        let mut out = Vec::new();
        let Some(token) = token else {
            return Ok((out, None));
        };
        let req = ListRequest {
            prefix: self.opts.prefix,
            delimiter: self.opts.delimiter,
            start_after: None,
            continuation: Some(token),
            max_keys: first_max_keys.or(self.opts.page_size),
        };
        let first_request = std::cell::Cell::new(true);
        let pages = pages(self.bucket, req, move |req| {
            let max_keys = match first_request.replace(false) {
                true => req.max_keys,
                false => self.opts.page_size,
            };
            self.fetch(ListRequest { max_keys, ..req })
        });
        futures::pin_mut!(pages);
        while !self.unordered.load(Ordering::Relaxed) {
            let Some(page) = pages.try_next().await? else {
                break;
            };
            let first = page.entries.first().map(Entry::name);
            if first.is_some_and(|f| last.as_deref().is_some_and(|l| f <= l)) {
                self.unordered.store(true, Ordering::Relaxed);
                break;
            }
            if let Some(l) = page.last() {
                last = Some(l.to_owned());
            }
            let done = page.ends(end.as_deref());
            let ended = page.next_token.is_none();
            let (inside, past): (Vec<Entry>, Vec<Entry>) = page
                .entries
                .into_iter()
                .partition(|e| end.as_deref().is_none_or(|x| e.name() <= x));
            keep(&mut out, inside, start.as_deref(), None);
            if ended && !self.unordered.load(Ordering::Relaxed) {
                return Ok((out, Some(past)));
            }
            if done {
                break;
            }
        }
        Ok((out, None))
    }
}

fn keep(out: &mut Vec<Entry>, entries: Vec<Entry>, start: Option<&str>, end: Option<&str>) {
    out.extend(
        entries
            .into_iter()
            .filter(|e| start.is_none_or(|s| e.name() > s) && end.is_none_or(|x| e.name() <= x)),
    );
}

/// At most this many positions of the names take part in a guess.
const WINDOW: usize = 16;

/// The characters a position of the names takes, as a radix: the smallest of these classes that
/// holds every character seen there (ASCII order is kept: digits < upper case < lower case).
const CLASSES: [&[u8]; 5] = [
    b"0123456789",
    b"0123456789abcdef",
    b"0123456789abcdefghijklmnopqrstuvwxyz",
    b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    b" !\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~",
];

/// Up to `count` strictly increasing guesses past the page's last name, about `1 / parts` of a
/// page apart: where the names one page (`parts` = 1), two pages, … after this page would sort,
/// extrapolated linearly over the positions where the page's names differ, each position read
/// as a digit of its own character class. Empty when the page allows no guess.
fn guess_splits(entries: &[Entry], count: usize, parts: u128) -> Vec<String> {
    let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
        return Vec::new();
    };
    let (first, last) = (first.name().as_bytes(), last.name().as_bytes());
    let n = entries.len() as u128;
    if n < 2 || count == 0 {
        return Vec::new();
    }
    let common = first.iter().zip(last).take_while(|(a, b)| a == b).count();
    // Take in the alphanumeric run the names share before they differ, so that a carry (…0999 →
    // …1000) has digits to go into.
    let mut from = common;
    while from > 0 && common - from < 4 && first[from - 1].is_ascii_alphanumeric() {
        from -= 1;
    }
    let to = (from + WINDOW).min(entries.iter().map(|e| e.name().len()).max().unwrap_or(0));
    if to <= from {
        return Vec::new();
    }
    let mut classes: Vec<&[u8]> = Vec::with_capacity(to - from);
    for pos in from..to {
        let seen = |c: &[u8]| {
            entries
                .iter()
                .all(|e| e.name().as_bytes().get(pos).is_none_or(|b| c.contains(b)))
        };
        match CLASSES.iter().find(|c| seen(c)) {
            Some(c) => classes.push(c),
            None => return Vec::new(), // a byte no class holds (non-ASCII, control)
        }
    }
    let value = |name: &[u8]| -> u128 {
        classes.iter().enumerate().fold(0u128, |v, (i, class)| {
            let digit = name
                .get(from + i)
                .and_then(|b| class.iter().position(|c| c == b))
                .unwrap_or(0);
            v * class.len() as u128 + digit as u128
        })
    };
    let max: u128 = classes.iter().fold(1u128, |m, c| m * c.len() as u128);
    let (v_first, v_last) = (value(first), value(last));
    let per_entry = (v_last.saturating_sub(v_first)) / (n - 1);
    let Some(per_page) = per_entry
        .checked_mul(n)
        .map(|p| p / parts.max(1))
        .filter(|p| *p > 0)
    else {
        return Vec::new();
    };
    let mut splits = Vec::with_capacity(count);
    for i in 1..=count as u128 {
        let Some(v) = per_page
            .checked_mul(i)
            .and_then(|d| d.checked_add(v_last))
            .filter(|v| *v < max)
        else {
            break;
        };
        let mut digits = vec![0u8; classes.len()];
        let mut rest = v;
        for (slot, class) in digits.iter_mut().zip(&classes).rev() {
            let radix = class.len() as u128;
            *slot = class[(rest % radix) as usize];
            rest /= radix;
        }
        let mut s = last[..from].to_vec();
        s.extend_from_slice(&digits);
        let Ok(s) = String::from_utf8(s) else {
            break; // not reached: a window starts on an ASCII byte, so `from` is a char boundary
        };
        if s.as_bytes() <= last || splits.last().is_some_and(|p: &String| s <= *p) {
            break;
        }
        splits.push(s);
    }
    splits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;
    use crate::ListPage;
    use async_trait::async_trait;
    use bytes::Bytes;
    use proptest::prelude::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    const B: &str = "b";

    fn names(ns: &[&str]) -> Vec<Entry> {
        ns.iter().map(|n| Entry::Prefix(n.to_string())).collect()
    }

    #[test]
    fn guesses_follow_decimal_names_across_carries() {
        let page: Vec<String> = (0..1000).map(|i| format!("d/f-{i:05}")).collect();
        let refs: Vec<&str> = page.iter().map(String::as_str).collect();
        assert_eq!(
            guess_splits(&names(&refs), 3, 1),
            ["d/f-01999", "d/f-02999", "d/f-03999"]
        );
    }

    #[test]
    fn guesses_keep_a_constant_suffix() {
        let page: Vec<String> = (0..100).map(|i| format!("img_{i:06}.jpg")).collect();
        let refs: Vec<&str> = page.iter().map(String::as_str).collect();
        assert_eq!(
            guess_splits(&names(&refs), 2, 1),
            ["img_000199.jpg", "img_000299.jpg"]
        );
    }

    #[test]
    fn guesses_spread_over_hex_names() {
        // A page of 100 three-digit hex names, 4 apart: the next pages start 400 further on each.
        // The first position has only shown '0' and '1', so it counts in decimal: fine until 'a'.
        let page: Vec<String> = (0..100).map(|i| format!("{:03x}", i * 4)).collect();
        let refs: Vec<&str> = page.iter().map(String::as_str).collect();
        assert_eq!(
            guess_splits(&names(&refs), 4, 1),
            ["31c", "4ac", "63c", "7cc"]
        );
    }

    #[test]
    fn no_guess_without_room_or_for_unusable_names() {
        assert!(guess_splits(&names(&["a"]), 4, 1).is_empty());
        // A shared non-ASCII prefix is fine; the guesses stop where the last position runs out.
        assert_eq!(
            guess_splits(&names(&["ä1", "ä2"]), 4, 1),
            ["ä4", "ä6", "ä8"]
        );
        assert!(
            guess_splits(&names(&["1ä", "2é"]), 4, 1).is_empty(),
            "non-ASCII where they differ"
        );
        // The last possible name: nothing sorts after "zz" in its class without a longer name.
        assert!(guess_splits(&names(&["zy", "zz"]), 4, 1).is_empty());
    }

    /// A store that counts LISTs in flight and yields between, so that concurrent ranges interleave.
    #[derive(Debug)]
    struct Counting {
        inner: MemoryStore,
        now: AtomicUsize,
        peak: AtomicUsize,
        /// List as a file-system walk does instead of in byte order (see `walk_list`).
        walk_order: bool,
        /// A LIST with `start_after` (a guessed range) takes an hour.
        slow_guesses: bool,
        /// `max_keys` of every LIST, in the order they were asked.
        asked: std::sync::Mutex<Vec<Option<u32>>>,
    }

    /// A LIST in the order of a file-system walk, where a directory's entries come before the
    /// names that sort between its name and its `/` (`a/` before `a-b`), as versitygw's would.
    /// Continuation tokens are entry indices.
    fn walk_list(keys: Vec<String>, req: &ListRequest<'_>) -> ListPage {
        let mut entries: Vec<(String, bool)> = keys
            .into_iter()
            .filter_map(|k| {
                let rest = k.strip_prefix(req.prefix)?;
                Some(
                    match req
                        .delimiter
                        .and_then(|d| rest.find(d).map(|i| i + d.len()))
                    {
                        Some(end) => (format!("{}{}", req.prefix, &rest[..end]), true),
                        None => (k.clone(), false),
                    },
                )
            })
            .collect();
        let walk = |n: &str| n.replace('/', "\0");
        entries.sort_by_key(|(n, _)| walk(n));
        entries.dedup();
        let from = match (&req.continuation, req.start_after) {
            (Some(t), _) => t.parse().unwrap(),
            (None, Some(after)) => entries.partition_point(|(n, _)| walk(n) <= walk(after)),
            (None, None) => 0,
        };
        let to = (from + req.max_keys.unwrap_or(1000) as usize).min(entries.len());
        let mut page = ListPage::default();
        for (name, is_prefix) in &entries[from..to] {
            if *is_prefix {
                page.common_prefixes.push(name.clone());
            } else {
                page.objects.push(ObjectInfo {
                    key: name.clone(),
                    size: 1,
                    etag: None,
                    last_modified: None,
                });
            }
        }
        page.next_token = (to < entries.len()).then(|| to.to_string());
        page
    }

    #[async_trait]
    impl ObjectStore for Counting {
        async fn head_bucket(&self, bucket: &str) -> Result<()> {
            self.inner.head_bucket(bucket).await
        }
        async fn list(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage> {
            let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(now, Ordering::SeqCst);
            self.asked.lock().unwrap().push(req.max_keys);
            let guess = self.slow_guesses && req.start_after.is_some();
            let ms = if guess { 3_600_000 } else { 10 };
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            let page = match self.walk_order {
                true => Ok(walk_list(self.inner.keys(bucket), &req)),
                false => self.inner.list(bucket, req).await,
            };
            self.now.fetch_sub(1, Ordering::SeqCst);
            page
        }
        async fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo> {
            self.inner.head(bucket, key).await
        }
        async fn get_range(
            &self,
            b: &str,
            k: &str,
            r: std::ops::Range<u64>,
            m: Option<&str>,
        ) -> Result<Bytes> {
            self.inner.get_range(b, k, r, m).await
        }
        async fn get_range_unmodified(
            &self,
            b: &str,
            k: &str,
            r: std::ops::Range<u64>,
            t: Option<std::time::SystemTime>,
            n: u64,
        ) -> Result<Bytes> {
            self.inner.get_range_unmodified(b, k, r, t, n).await
        }
        async fn put(&self, b: &str, k: &str, body: Bytes) -> Result<crate::PutResult> {
            self.inner.put(b, k, body).await
        }
        async fn put_if_absent(&self, b: &str, k: &str, body: Bytes) -> Result<crate::PutResult> {
            self.inner.put_if_absent(b, k, body).await
        }
        async fn create_multipart(&self, b: &str, k: &str) -> Result<String> {
            self.inner.create_multipart(b, k).await
        }
        async fn upload_part(
            &self,
            b: &str,
            k: &str,
            u: &str,
            n: i32,
            body: Bytes,
        ) -> Result<crate::CompletedPart> {
            self.inner.upload_part(b, k, u, n, body).await
        }
        async fn complete_multipart(
            &self,
            b: &str,
            k: &str,
            u: &str,
            parts: Vec<crate::CompletedPart>,
        ) -> Result<crate::PutResult> {
            self.inner.complete_multipart(b, k, u, parts).await
        }
        async fn complete_multipart_if_absent(
            &self,
            b: &str,
            k: &str,
            u: &str,
            parts: Vec<crate::CompletedPart>,
        ) -> Result<crate::PutResult> {
            self.inner
                .complete_multipart_if_absent(b, k, u, parts)
                .await
        }
        async fn abort_multipart(&self, b: &str, k: &str, u: &str) -> Result<()> {
            self.inner.abort_multipart(b, k, u).await
        }
        async fn list_uploads(
            &self,
            b: &str,
            req: crate::UploadsRequest<'_>,
        ) -> Result<crate::UploadsPage> {
            self.inner.list_uploads(b, req).await
        }
        async fn delete(&self, b: &str, k: &str) -> Result<()> {
            self.inner.delete(b, k).await
        }
        async fn delete_many(&self, b: &str, keys: &[String]) -> Result<()> {
            self.inner.delete_many(b, keys).await
        }
    }

    async fn store_with(keys: &[String]) -> Counting {
        let inner = MemoryStore::new();
        inner.create_bucket(B);
        for k in keys {
            inner.insert(B, k, Bytes::from_static(b"x"));
        }
        Counting {
            inner,
            now: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            walk_order: false,
            slow_guesses: false,
            asked: Default::default(),
        }
    }

    /// A server whose truncated pages hand out the same token again (or cycle through tokens)
    /// would be listed forever: the listing fails with `Corrupt` instead.
    #[tokio::test]
    async fn a_repeated_continuation_token_ends_the_listing_with_an_error() {
        // The tokens the pages hand out (then none), the pages listed, whether it fails.
        for (tokens, ok_pages, repeats) in [
            (&["t1", "t1"][..], 1, true),
            (&["t1", "t2", "t1"][..], 2, true),
            (&["t1", "t2", "t3"][..], 4, false),
        ] {
            let calls = Arc::new(AtomicUsize::new(0));
            let fetch = move |_req: ListRequest<'static>| {
                let i = calls.fetch_add(1, Ordering::SeqCst);
                let token = tokens.get(i).map(|t| t.to_string());
                async move {
                    Ok(ListPage {
                        next_token: token,
                        ..ListPage::default()
                    })
                }
            };
            let first = ListRequest {
                prefix: "p/",
                delimiter: None,
                start_after: None,
                continuation: None,
                max_keys: None,
            };
            let stream = pages("b", first, fetch);
            futures::pin_mut!(stream);
            let mut got = 0;
            let end = loop {
                match stream.try_next().await {
                    Ok(Some(_)) => got += 1,
                    Ok(None) => break None,
                    Err(e) => break Some(e),
                }
                assert!(got < 10, "{tokens:?}: the listing never ends");
            };
            assert_eq!(got, ok_pages, "{tokens:?}");
            match end {
                Some(StoreError::Corrupt(m)) if repeats => {
                    assert!(m.contains("b/p/") && m.contains("t1"), "{m}");
                }
                None if !repeats => {}
                other => panic!("{tokens:?}: {other:?}"),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_out_of_byte_order_is_listed_page_by_page() {
        // "d005-x" sorts before "d005/" in bytes, after it in a walk.
        let keys: Vec<String> = (0..300)
            .flat_map(|i| [format!("p/d{i:03}-x"), format!("p/d{i:03}/y")])
            .collect();
        let store = Counting {
            walk_order: true,
            ..store_with(&keys).await
        };
        let seq = sequential(&store, "p/", Some("/"), 50).await;
        assert_eq!(seq.objects.len() + seq.common_prefixes.len(), 600);
        let opts = ListAll {
            page_size: Some(50),
            ..ListAll::dir("p/", 8)
        };
        let par = list_all(&store, B, opts).await.unwrap();
        assert_eq!(names_of(&par), names_of(&seq), "the server's own listing");
        assert!(
            par.requests > 12,
            "ranges were tried first: {}",
            par.requests
        );
    }

    async fn sequential(
        store: &dyn ObjectStore,
        prefix: &str,
        delimiter: Option<&str>,
        page: u32,
    ) -> Listed {
        let opts = ListAll {
            prefix,
            delimiter,
            concurrency: 1,
            page_size: Some(page),
            first_page: None,
        };
        list_all(store, B, opts).await.unwrap()
    }

    fn names_of(l: &Listed) -> (Vec<&str>, Vec<&str>) {
        (
            l.objects.iter().map(|o| o.key.as_str()).collect(),
            l.common_prefixes.iter().map(String::as_str).collect(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_numbered_directory_is_listed_many_pages_at_once() {
        let keys: Vec<String> = (0..10_000).map(|i| format!("data/f-{i:06}")).collect();
        let store = store_with(&keys).await;
        let seq = sequential(&store, "data/", Some("/"), 100).await;
        assert_eq!(seq.requests, 100);
        assert_eq!(store.peak.load(Ordering::SeqCst), 1);

        store.peak.store(0, Ordering::SeqCst);
        let opts = ListAll {
            page_size: Some(100),
            ..ListAll::dir("data/", 8)
        };
        let par = list_all(&store, B, opts).await.unwrap();
        assert_eq!(names_of(&par), names_of(&seq));
        assert_eq!(store.peak.load(Ordering::SeqCst), 8, "8 LISTs in flight");
        // Decimal names are guessed exactly: each page once, plus one empty LIST past the end per
        // guess of the last wave.
        assert!(par.requests <= 100 + 8, "{} requests", par.requests);
    }

    #[tokio::test(start_paused = true)]
    async fn a_listing_that_ends_in_the_next_page_does_not_wait_for_the_guesses_past_it() {
        // Two pages; the guess half a page after the first lands before the second, whose
        // first half-page request ends the listing.
        let keys: Vec<String> = (0..100)
            .map(|i| format!("data/f-{i:04}"))
            .chain((0..40).map(|i| format!("data/g-{i:04}")))
            .collect();
        let store = Counting {
            slow_guesses: true,
            ..store_with(&keys).await
        };
        let seq = sequential(&store, "data/", Some("/"), 100).await;
        let opts = ListAll {
            page_size: Some(100),
            ..ListAll::dir("data/", 8)
        };
        let t = tokio::time::Instant::now();
        let par = list_all(&store, B, opts).await.unwrap();
        assert_eq!(names_of(&par), names_of(&seq));
        assert_eq!(par.requests, 3, "the first page, the next, one guess");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "waited for the guess: {:?}",
            t.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_directory_of_two_pages_lists_its_second_in_two_halves_at_once() {
        let keys: Vec<String> = (0..200).map(|i| format!("data/f-{i:04}")).collect();
        let store = store_with(&keys).await;
        let seq = sequential(&store, "data/", Some("/"), 100).await;
        store.peak.store(0, Ordering::SeqCst);
        store.asked.lock().unwrap().clear();
        let opts = ListAll {
            page_size: Some(100),
            ..ListAll::dir("data/", 8)
        };
        let par = list_all(&store, B, opts).await.unwrap();
        assert_eq!(names_of(&par), names_of(&seq));
        assert_eq!(
            par.requests, 3,
            "no more LISTs than page by page and one guess"
        );
        assert_eq!(store.peak.load(Ordering::SeqCst), 2, "the halves at once");
        let mut asked = store.asked.lock().unwrap().clone();
        asked.sort();
        assert_eq!(asked, [Some(50), Some(100), Some(100)]);
    }

    /// Key names of the shapes datasets use, and some that defeat every guess.
    fn key_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            (0u32..5000).prop_map(|i| format!("p/n-{i:05}")),
            (0u32..5000).prop_map(|i| format!("p/{i}")),
            "[0-9a-f]{1,6}".prop_map(|h| format!("p/{h}")),
            "[a-zA-Z0-9._-]{1,5}(/[a-z]{1,2}){0,2}".prop_map(|s| format!("p/{s}")),
            "[a-c]{1,3}/[0-9]{1,3}".prop_map(|s| format!("p/{s}")),
            "\\PC{1,4}".prop_map(|s| format!("p/{s}")),
            "[a-z]{1,3}".prop_map(|s| format!("q{s}")), // outside the prefix
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Whatever the names and the guesses, the ranges joined are exactly the sequential listing.
        #[test]
        fn parallel_listing_equals_the_sequential_one(
            keys in proptest::collection::btree_set(key_strategy(), 0..400),
            page in 1u32..40,
            concurrency in 1usize..10,
            delimiter in proptest::bool::ANY,
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
            rt.block_on(async {
                let keys: Vec<String> = keys.into_iter().collect();
                let store = Arc::new(store_with(&keys).await);
                let delimiter = delimiter.then_some("/");
                let seq = sequential(&*store, "p/", delimiter, page).await;
                let opts = ListAll { prefix: "p/", delimiter, concurrency, page_size: Some(page), first_page: None };
                let par = list_all(&*store, B, opts).await.unwrap();
                prop_assert_eq!(names_of(&par), names_of(&seq));
                prop_assert!(store.peak.load(Ordering::SeqCst) <= concurrency);
                // Going on from a first page the caller already has: the same listing, one
                // LIST fewer than on its own.
                let first = store
                    .list(B, ListRequest { prefix: "p/", delimiter, max_keys: Some(page), ..Default::default() })
                    .await
                    .unwrap();
                let from_first = list_all(&*store, B, ListAll { first_page: Some(&first), ..opts }).await.unwrap();
                prop_assert_eq!(names_of(&from_first), names_of(&seq));
                prop_assert_eq!(from_first.requests + 1, par.requests.max(1));
                Ok(())
            })?;
        }
    }
}
