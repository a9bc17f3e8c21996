use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::error::IoContext;
use crate::{Error, Result};

/// The writer lock: an OS advisory lock on `<store>/LOCK`, released when the holder exits.
///
/// The file also records who holds it. After a crash the OS lock is gone but the file still
/// names the dead holder: the next writer takes the lock and reports the stale holder through
/// [`WriterLock::stale`], so nothing has to be removed by hand.
#[derive(Debug)]
pub struct WriterLock {
    file: File,
    path: PathBuf,
    stale: Option<String>,
}

impl WriterLock {
    /// Takes the lock of the store at `dir`, or fails with [`Error::Locked`].
    pub fn acquire(dir: &Path) -> Result<WriterLock> {
        let path = dir.join("LOCK");
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .at(&path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = if holder.trim().is_empty() {
                    "unknown holder".to_string()
                } else {
                    holder.trim().to_string()
                };
                return Err(Error::Locked { path, holder });
            }
            Err(std::fs::TryLockError::Error(source)) => return Err(Error::Io { path, source }),
        }
        let mut previous = String::new();
        file.read_to_string(&mut previous).at(&path)?;
        let stale = (!previous.trim().is_empty()).then(|| previous.trim().to_string());
        let holder = format!(
            "pid {} on {} since {}",
            std::process::id(),
            hostname(),
            chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        );
        file.set_len(0).at(&path)?;
        file.rewind().at(&path)?;
        file.write_all(holder.as_bytes()).at(&path)?;
        file.sync_all().at(&path)?;
        Ok(WriterLock { file, path, stale })
    }

    /// The holder named by a lock file left behind by a writer that did not exit cleanly.
    pub fn stale(&self) -> Option<&str> {
        self.stale.as_deref()
    }
}

impl Drop for WriterLock {
    fn drop(&mut self) {
        // A clean exit empties the file, so the next writer does not report a stale lock.
        let _ = self.file.set_len(0);
        let _ = self.file.sync_all();
        let _ = self.file.unlock();
        let _ = &self.path;
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}
