//! One benchmark at a time: two at once would measure each other; and where a report goes.

use std::path::Path;

use anyhow::{bail, Context};

/// Holds an exclusive lock on `/run/ferry-bench.lock` for the life of the returned file.
pub fn single_instance_lock() -> anyhow::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let path = Path::new("/run/ferry-bench.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on a descriptor we own, which stays open as long as `f` lives.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!(
            "another ferry-bench is running (it holds {}); run one at a time",
            path.display()
        );
    }
    Ok(f)
}

/// Prints a run's report and appends it to `out` (Markdown), if given.
pub fn report(report: &str, out: Option<&Path>) -> anyhow::Result<()> {
    use std::io::Write;
    println!("{report}");
    if let Some(out) = out {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)
            .with_context(|| format!("opening {}", out.display()))?;
        writeln!(f, "{report}")?;
    }
    Ok(())
}
