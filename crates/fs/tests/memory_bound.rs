//! The memory budget holds the process's memory: writers and listings on a real FUSE mount of a
//! real S3 server (versitygw), with a small budget, stay within the budget plus a fixed margin of
//! peak RSS. A test binary of its own (one test), so no other test's memory is counted.
//!
//! Measured with the allocator as the node plugin runs it ([`ferry_fs::alloc`]): +152 MiB of
//! peak RSS without the budget (12 writers each holding a part being filled and one being
//! uploaded, every listing kept), +73 MiB with it (a 32 MiB budget), against a bound of 96.

mod common;

use std::io::Write;
use std::sync::Arc;

use common::{Env, BUCKET};
use ferry_fs::budget::Use;
use ferry_fs::MemoryBudget;
use futures::StreamExt;

const MIB: u64 = 1 << 20;
/// Large enough that one writer can always go on: 12 waiting writers hold at most 1 MiB each,
/// kept listings at most a quarter, which leaves more than the 8 MiB a writer waits for. So the
/// writers never need the node plugin's bounded wait to get out of each other's way (here it is
/// 10 min), and the peak does not depend on how fast this machine uploads.
const BUDGET: u64 = 32 * MIB;
/// What the process may hold beyond the budget: the runtime, FUSE request buffers (one 1 MiB
/// write each in flight), the S3 client's connection buffers, a listing being built.
const MARGIN: u64 = 64 * MIB;
const WRITERS: usize = 12;
const FILE_MIB: usize = 24;
const DIRS: usize = 6;
const NAMES_PER_DIR: usize = 1_500;

/// (VmRSS, VmHWM) of this process, bytes.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap()
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[test]
fn writers_and_listings_stay_within_the_memory_budget() {
    // The allocator as the node plugin runs it.
    ferry_fs::alloc::tune();
    let mut env = Env::start();
    env.budget = MemoryBudget::new(BUDGET);
    // Writers wait for the budget as long as it takes (see BUDGET; the node plugin's 5 s bound
    // exists for processes holding buffers of files only they would close).
    env.prefetch.write_budget_wait = std::time::Duration::from_secs(600);
    let prefix = env.fresh_prefix("memory");
    // Directories of long names, listed again and again while the writers write.
    env.rt.block_on(async {
        let keys: Vec<String> = (0..DIRS)
            .flat_map(|d| {
                (0..NAMES_PER_DIR).map(move |i| format!("dir-{d}/{}-{i:05}", "n".repeat(150)))
            })
            .collect();
        let store = &env.store;
        let puts: Vec<_> = futures::stream::iter(keys)
            .map(|k| {
                let key = format!("{prefix}{k}");
                async move {
                    ferry_store::ObjectStore::put(&**store, BUCKET, &key, bytes::Bytes::new()).await
                }
            })
            .buffer_unordered(32)
            .collect()
            .await;
        assert!(puts.iter().all(Result::is_ok), "preparing the directories");
    });
    let store: Arc<dyn ferry_store::ObjectStore> = env.store.clone();
    let m = env.mount(store, &prefix, |_| {});
    // The mount's steady state before the load, then the peak from here on.
    assert_eq!(
        std::fs::read_dir(m.path("dir-0")).unwrap().count(),
        NAMES_PER_DIR
    );
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM (root)");
    let (before, _) = rss();

    let chunk: Vec<u8> = (0..MIB as usize).map(|i| (i % 251) as u8).collect();
    std::thread::scope(|s| {
        for w in 0..WRITERS {
            let (path, chunk) = (m.path(&format!("out-{w}.bin")), &chunk);
            s.spawn(move || {
                let mut f = std::fs::File::create(path).unwrap();
                for _ in 0..FILE_MIB {
                    f.write_all(chunk).unwrap();
                }
                f.sync_all().unwrap();
            });
        }
        for l in 0..2 {
            let m = &m;
            s.spawn(move || {
                for round in 0..3 {
                    for d in 0..DIRS {
                        let dir = m.path(&format!("dir-{}", (d + l + round) % DIRS));
                        let mut n = 0;
                        for e in std::fs::read_dir(dir).unwrap() {
                            e.unwrap().metadata().unwrap();
                            n += 1;
                        }
                        assert_eq!(n, NAMES_PER_DIR);
                    }
                }
            });
        }
    });
    let (_, peak) = rss();
    let listing = env.budget.used_for(Use::Listing);
    eprintln!(
        "RSS before the load {} MiB, peak {} MiB (+{} MiB; budget {} MiB + margin {} MiB); \
         listings kept {} KiB",
        before / MIB,
        peak / MIB,
        peak.saturating_sub(before) / MIB,
        BUDGET / MIB,
        MARGIN / MIB,
        listing >> 10
    );
    assert!(
        listing <= BUDGET,
        "listings kept {listing} bytes, over the budget"
    );
    assert!(
        peak <= before + BUDGET + MARGIN,
        "peak RSS grew by {} MiB, more than the budget ({} MiB) and the margin ({} MiB)",
        peak.saturating_sub(before) / MIB,
        BUDGET / MIB,
        MARGIN / MIB
    );
    for w in 0..WRITERS {
        let got = std::fs::metadata(m.path(&format!("out-{w}.bin")))
            .unwrap()
            .len();
        assert_eq!(got, FILE_MIB as u64 * MIB, "writer {w}'s file");
    }

    // A file written now and then (a training log, an event file) past its first part keeps a
    // part charged for the next one only while it is written: idle for
    // `ferry_fs::mount::WRITER_IDLE`, it holds its buffered bytes and no more.
    let mut slow = std::fs::File::create(m.path("events.log")).unwrap();
    for _ in 0..9 {
        slow.write_all(&chunk).unwrap();
    }
    let held = env.budget.used_for(Use::Write);
    assert!(held > 8 * MIB, "a part charged for the next one: {held}");
    let idle = ferry_fs::mount::WRITER_IDLE;
    let start = std::time::Instant::now();
    while env.budget.used_for(Use::Write) > MIB && start.elapsed() < idle * 4 {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let idle_held = env.budget.used_for(Use::Write);
    eprintln!(
        "an idle writer held {} KiB after {:?} (past its first part: {} KiB)",
        idle_held >> 10,
        start.elapsed(),
        held >> 10
    );
    assert!(
        idle_held <= MIB,
        "an idle writer still holds {idle_held} bytes"
    );
    slow.write_all(&chunk).unwrap();
    drop(slow);
    assert_eq!(
        std::fs::metadata(m.path("events.log")).unwrap().len(),
        10 * MIB
    );
    m.unmount();
    env.assert_budget_released();
}
