use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::IoContext;
use crate::{Error, Result};

/// How long a refused writer waits for the holder's description to appear in an empty `LOCK`
/// (the holder writes it right after taking the lock).
const HOLDER_WAIT: Duration = Duration::from_secs(2);

/// The writer lock: an OS advisory lock (`flock`) on the store directory itself, released when
/// the holder exits, and `<store>/LOCK`, which names the holder.
///
/// The lock is on the directory, not on the `LOCK` file, so deleting `LOCK` (by hand, or by a
/// cleanup script) lets no second writer in: a writer may delete the leftovers of interrupted
/// commits at open because no other writer can be running. `LOCK` is replaced atomically (a
/// temporary file renamed over it) right after the lock is taken, so a refused writer reads a
/// whole description; one that reads none waits briefly for it.
///
/// After a crash the OS lock is gone but `LOCK` still names the dead holder: the next writer
/// takes the lock and reports the stale holder through [`WriterLock::stale`], so nothing has to
/// be removed by hand.
#[derive(Debug)]
pub struct WriterLock {
    /// The locked directory handle; the OS releases the lock when it closes.
    directory: File,
    path: PathBuf,
    stale: Option<String>,
}

impl WriterLock {
    /// Takes the lock of the store at `dir`, or fails with [`Error::Locked`].
    pub fn acquire(dir: &Path) -> Result<WriterLock> {
        let path = dir.join("LOCK");
        let directory = File::open(dir).at(dir)?;
        take(&directory, dir, &path)?;
        let previous = read_holder(&path);
        let stale = (!previous.is_empty()).then_some(previous);
        let holder = format!(
            "pid {} on {} since {}",
            std::process::id(),
            hostname(),
            chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        );
        write_atomically(dir, &path, holder.as_bytes())?;
        Ok(WriterLock {
            directory,
            path,
            stale,
        })
    }

    /// The holder named by a lock file left behind by a writer that did not exit cleanly.
    pub fn stale(&self) -> Option<&str> {
        self.stale.as_deref()
    }
}

impl Drop for WriterLock {
    fn drop(&mut self) {
        // A clean exit empties the description, so the next writer does not report a stale
        // lock; then the directory handle closes and the OS lock goes with it.
        if let Some(dir) = self.path.parent() {
            let _ = write_atomically(dir, &self.path, b"");
        }
        let _ = self.directory.unlock();
    }
}

/// The trimmed contents of `LOCK` (empty when it is missing or empty).
fn read_holder(path: &Path) -> String {
    std::fs::read_to_string(path)
        .map(|text| text.trim().to_string())
        .unwrap_or_default()
}

/// Takes the OS lock on `directory`, or fails with [`Error::Locked`] naming the holder. A
/// holder that has just taken the lock may not have written `LOCK` yet (on a new store it does
/// not exist yet): the refused writer waits up to [`HOLDER_WAIT`] for the description, trying
/// the lock again meanwhile, so a holder that finishes in that time lets it in.
fn take(directory: &File, dir: &Path, path: &Path) -> Result<()> {
    let deadline = Instant::now() + HOLDER_WAIT;
    loop {
        match directory.try_lock() {
            Ok(()) => return Ok(()),
            Err(std::fs::TryLockError::Error(source)) => {
                return Err(Error::Io {
                    path: dir.to_path_buf(),
                    source,
                })
            }
            Err(std::fs::TryLockError::WouldBlock) => {}
        }
        let holder = read_holder(path);
        if !holder.is_empty() || Instant::now() >= deadline {
            return Err(Error::Locked {
                holder: if !holder.is_empty() {
                    holder
                } else if path.exists() {
                    "unknown holder: its LOCK description is empty".to_string()
                } else {
                    "unknown holder: no LOCK file names it (LOCK was deleted)".to_string()
                },
                path: path.to_path_buf(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Replaces `path` with `bytes` by writing a temporary file beside it and renaming it over.
fn write_atomically(dir: &Path, path: &Path, bytes: &[u8]) -> Result<()> {
    let temporary = dir.join(format!("LOCK.tmp-{}", std::process::id()));
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&temporary)
        .at(&temporary)?;
    file.write_all(bytes).at(&temporary)?;
    file.sync_all().at(&temporary)?;
    std::fs::rename(&temporary, path).at(path)
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    #[test]
    fn two_writers_starting_together_on_a_new_store_name_the_holder() {
        // Issue 40.7: the refused writer said "unknown holder" when it looked before the
        // winner had written LOCK. Each round races two writers on a brand-new store.
        for round in 0..200 {
            let dir = tempfile::tempdir().unwrap();
            let (start, tried) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
            let racers: Vec<_> = (0..2)
                .map(|_| {
                    let dir = dir.path().to_path_buf();
                    let (start, tried) = (start.clone(), tried.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        let taken = WriterLock::acquire(&dir);
                        // The winner holds the lock until both have tried.
                        tried.wait();
                        taken.map(|_| ()).map_err(|e| e.to_string())
                    })
                })
                .collect();
            let results: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
            let refused: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
            for error in &refused {
                assert!(
                    error.contains("pid ") && !error.contains("unknown holder"),
                    "round {round}: {error}"
                );
            }
            assert_eq!(refused.len(), 1, "round {round}: {results:?}");
        }
    }
}
