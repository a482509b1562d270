//! Where the CPU went while a workload group ran: the machine's busy and stolen time
//! (`/proc/stat`), the mounter's and this process's own (`/proc/PID/stat`: every thread of it).
//! The rest of the busy time is the S3 server's, the kernel's workers' and anything else running.
//! On the 2-CPU benchmark VM a row is often bound by CPU the server, the delay proxy and the
//! mounter share: these notes say by how much, and who had it.
//!
//! [`SpeedProbe`] says how fast the CPUs ran meanwhile. On the benchmark VM a loop of fixed work
//! took from one to two times its fastest CPU time from one second to the next, with nothing else
//! running in the VM and no time counted as stolen (`doc/BENCHMARKS.md`, "The machine"). A row
//! measured while the CPUs ran slow is not comparable with one measured at full speed, so every
//! group's note gives the speed it ran at.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Clock ticks per second of `/proc/stat` and `/proc/PID/stat` (`USER_HZ`).
fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// A reading of the counters.
#[derive(Debug, Clone, Copy)]
pub struct CpuSnap {
    at: Instant,
    /// Machine-wide seconds: busy (user, nice, system, irq, softirq), stolen by the hypervisor.
    busy: f64,
    steal: f64,
    /// Seconds of CPU the mounter process (all its threads) and this process have used.
    mounter: Option<f64>,
    bench: f64,
}

/// The machine's busy and stolen seconds since boot, from the `cpu` line of `/proc/stat`.
pub fn machine() -> (f64, f64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<f64> = text
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let at = |i: usize| fields.get(i).copied().unwrap_or(0.0);
    // user nice system idle iowait irq softirq steal
    let busy = at(0) + at(1) + at(2) + at(5) + at(6);
    let hz = ticks_per_second();
    (busy / hz, at(7) / hz)
}

/// Seconds of CPU process `pid` (a number, or `self`) has used (user + system, all threads), if
/// it is there.
pub fn process(pid: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces), in parentheses: state is field 3, utime
    // and stime fields 14 and 15.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / ticks_per_second())
}

impl CpuSnap {
    /// Reads the counters now; `mounter` is the mounter's process id, if known.
    pub fn now(mounter: Option<u32>) -> CpuSnap {
        let (busy, steal) = machine();
        CpuSnap {
            at: Instant::now(),
            busy,
            steal,
            mounter: mounter.and_then(|pid| process(&pid.to_string())),
            bench: process("self").unwrap_or(0.0),
        }
    }

    /// One line of the report: where the CPU went between `self` and `later`.
    pub fn describe(&self, later: &CpuSnap) -> String {
        let wall = later.at.duration_since(self.at).as_secs_f64().max(1e-3);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let busy = later.busy - self.busy;
        let mounter = self.mounter.zip(later.mounter).map(|(a, b)| b - a);
        let bench = later.bench - self.bench;
        format!(
            "{wall:.1} s, the {cores} CPUs {:.0} % busy ({:.1} % stolen); mounter {}, \
             ferry-bench (workload and delay proxy) {bench:.2} s, the rest (S3 server, kernel) {:.2} s",
            100.0 * busy / (wall * cores as f64),
            100.0 * (later.steal - self.steal) / (wall * cores as f64),
            mounter.map_or_else(|| "?".to_string(), |m| format!("{m:.2} s")),
            busy - bench - mounter.unwrap_or(0.0),
        )
    }
}

/// CPU seconds the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// A fixed amount of integer work (a few milliseconds), that no optimiser can skip.
fn fixed_work() -> u64 {
    let mut x = 1u64;
    for i in 0..PROBE_ITERATIONS {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
    }
    x
}

const PROBE_ITERATIONS: u64 = 1_000_000;
/// How often the probe runs its loop: five samples a second, about 1 % of a CPU.
const PROBE_EVERY: Duration = Duration::from_millis(200);

/// A thread that times [`fixed_work`] in CPU time every [`PROBE_EVERY`], for as long as it lives:
/// the more CPU time the same work takes, the slower the CPU ran (the host's other tenants, its
/// frequency), whatever the guest's own load (CPU time, not wall time: waiting for a CPU inside
/// the VM does not count).
pub struct SpeedProbe {
    samples: Arc<Mutex<Vec<(Instant, f64)>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SpeedProbe {
    pub fn start() -> SpeedProbe {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (samples.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("speed-probe".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    let t0 = thread_cpu();
                    std::hint::black_box(fixed_work());
                    let spent = thread_cpu() - t0;
                    s.lock().expect("probe lock").push((Instant::now(), spent));
                    std::thread::sleep(PROBE_EVERY);
                }
            })
            .ok();
        SpeedProbe {
            samples,
            stop,
            thread,
        }
    }

    /// How fast the CPUs ran between `from` and `to`: the fixed loop's fastest time in the whole
    /// run so far over its median time in that window (1 = as fast as seen; 0.5 = the same work
    /// took twice the CPU time). `None` without samples in the window.
    pub fn speed(&self, from: Instant, to: Instant) -> Option<f64> {
        let samples = self.samples.lock().expect("probe lock");
        let fastest = samples.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
        let mut window: Vec<f64> = samples
            .iter()
            .filter(|(at, _)| *at >= from && *at <= to)
            .map(|s| s.1)
            .collect();
        if window.is_empty() || fastest <= 0.0 {
            return None;
        }
        window.sort_by(|a, b| a.total_cmp(b));
        Some(fastest / window[window.len() / 2])
    }
}

impl Drop for SpeedProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe samples while it lives, and a window's speed is at most the run's fastest.
    #[test]
    fn the_probe_reports_a_speed_at_most_one() {
        let probe = SpeedProbe::start();
        let from = Instant::now();
        while probe.samples.lock().unwrap().len() < 3 {
            std::thread::sleep(Duration::from_millis(50));
            assert!(from.elapsed().as_secs() < 600, "no samples in ten minutes");
        }
        let speed = probe
            .speed(from, Instant::now())
            .expect("samples in the window");
        assert!(speed > 0.0 && speed <= 1.0, "{speed}");
        let later = Instant::now() + Duration::from_secs(3600);
        assert_eq!(probe.speed(later, later), None);
    }

    /// While this process spins, its own counter and the machine's busy time grow by at least
    /// what it spun (waited for in CPU time, not wall time: a loaded machine only makes it longer).
    #[test]
    fn a_busy_loop_is_counted() {
        let before = CpuSnap::now(Some(std::process::id()));
        let mut x = 0u64;
        let started = Instant::now();
        while process("self").unwrap() - before.bench < 0.2 {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            assert!(
                started.elapsed().as_secs() < 600,
                "no CPU time in ten minutes"
            );
        }
        let after = CpuSnap::now(Some(std::process::id()));
        let spun = after.bench - before.bench;
        assert!(spun >= 0.2, "{before:?} {after:?}");
        assert!(after.mounter.unwrap() - before.mounter.unwrap() >= 0.2);
        // Machine-wide busy time includes this process's (tick rounding aside).
        assert!(
            after.busy - before.busy >= spun - 0.05,
            "{before:?} {after:?}"
        );
        assert!(before.describe(&after).contains("% busy"));
    }
}
