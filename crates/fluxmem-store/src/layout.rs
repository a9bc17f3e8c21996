//! The store directory's names, and the writes every layer above shares: the manifest's
//! atomic, compare-and-swap replacement and directory syncs. With `error`, `manifest` and
//! `lock`, the lowest layer (see the crate docs): it imports nothing else of this crate.

use std::path::Path;

use crate::error::IoContext;
use crate::manifest::Manifest;
use crate::{Error, Result};

pub(crate) const MANIFEST: &str = "manifest.json";
pub(crate) const SHARDS: &str = "shards";
/// The folder of the tenant vector indexes (derived data; see the `index` module).
pub(crate) const INDEXES: &str = "indexes";

/// The directory under a store that holds the staging stores of sharded runs.
pub const STAGING: &str = "staging";

/// The folder of a store where a stage keeps scratch files for the length of a run (connect's
/// spilled facts, written under the writer lock; a sharded embed's plan, written under it, and
/// its workers' results, written beside it without it); each stage deletes its own.
pub const SCRATCH: &str = "scratch";

/// Writes `manifest` as `<dir>/manifest.json` atomically: temp file, fsync, rename, fsync dir.
/// Returns the SHA-256 of the bytes written.
///
/// With `expected`, the manifest on disk must still be the one with that hash (the one this
/// writer read or wrote last); otherwise another writer committed meanwhile (the lock was
/// lost, e.g. its file deleted) and the write is refused with [`Error::Conflict`] before the
/// rename, so neither writer's commit is overwritten and nothing is deleted.
pub(crate) fn write_manifest(
    dir: &Path,
    manifest: &Manifest,
    expected: Option<&str>,
) -> Result<String> {
    use std::io::Write;
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!("{MANIFEST}.tmp-{}", std::process::id()));
    let text = serde_json::to_vec_pretty(manifest).expect("a manifest always serializes");
    let mut file = std::fs::File::create(&tmp).at(&tmp)?;
    file.write_all(&text).at(&tmp)?;
    file.sync_all().at(&tmp)?;
    if let Some(expected) = expected {
        let current = std::fs::read(&path).map(|bytes| fluxmem_graph::sha256_hex(&bytes));
        let changed = match &current {
            Ok(hash) => hash != expected,
            Err(_) => true,
        };
        if changed {
            let _ = std::fs::remove_file(&tmp);
            let found = match current {
                Ok(_) => Manifest::read(&path)
                    .map(|m| format!("version {}", m.version))
                    .unwrap_or_else(|e| e.to_string()),
                Err(e) => format!("unreadable: {e}"),
            };
            return Err(Error::Conflict {
                path,
                reason: format!(
                    "the manifest changed under this writer (now {found}; this writer was about to write version {}): \
                     another writer committed while this one held the lock (was the LOCK file deleted?); \
                     this commit is abandoned and nothing was deleted",
                    manifest.version
                ),
            });
        }
    }
    std::fs::rename(&tmp, &path).at(&path)?;
    sync_dir(dir)?;
    Ok(fluxmem_graph::sha256_hex(&text))
}

/// Writes `bytes` to `path` atomically and durably: to `.<name>.tmp-<pid>` beside it, synced,
/// renamed over `path`, and the folder synced, so a crash leaves the old file or the new one,
/// never a part. A failed write removes its temporary file. Stages' scratch files (plans) are
/// written with it; their sweeps know the temporary name.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temporary = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&temporary).at(&temporary)?;
        file.write_all(bytes).at(&temporary)?;
        file.sync_all().at(&temporary)?;
        std::fs::rename(&temporary, path).at(path)
    })();
    if written.is_err() {
        // Best effort: the error that matters is the one being returned.
        let _ = std::fs::remove_file(&temporary);
    }
    written?;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => sync_dir(dir),
        _ => Ok(()),
    }
}

/// Fsyncs the directory `dir` itself, so the entries created or renamed in it survive a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).at(dir)
}

/// Test hook: `FLUXMEM_FAULT=<point>:<version>` aborts the process at that point of that commit
/// (`before-manifest`: shards written, manifest not; `after-manifest`: commit done). It lets
/// the crash tests hit the exact window between shard and manifest writes.
pub(crate) fn fault_point(point: &str, version: u64) {
    if let Ok(spec) = std::env::var("FLUXMEM_FAULT") {
        if spec == format!("{point}:{version}") {
            std::process::abort();
        }
    }
}

/// True when the store has a staging store (a sharded run started and not merged).
pub(crate) fn staging_in_progress(dir: &Path) -> bool {
    std::fs::read_dir(dir.join(STAGING))
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false)
}
