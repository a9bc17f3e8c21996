//! The input ledger: files already ingested, so a night reads only new logs.
//!
//! `<store>/ingest-ledger.jsonl` holds one line per ingested file: its absolute path, size,
//! modification time, SHA-256 and the settings that shape its parsing (format, tenant, agent,
//! record and chunk limits, fluxmem version). A file is skipped when a line with its path and
//! settings also has its size and mtime; when only those differ (a copy, a `touch`), the file
//! is hashed and skipped if its content is the same. Anything else is read and parsed as
//! before (content-addressed ids make re-reading an appended log add only its new records).
//!
//! A line is appended after the commit that holds the file's records, so a crash in between
//! only makes the next run read the file again. The ledger is a cache of work done, never the
//! data: deleting it costs one full re-read, and `--reread` ignores it. OpenTelemetry files
//! are not recorded (their spans are grouped into episodes across the batch they arrive in),
//! nor is standard input.
//!
//! A shard of a sharded run (`--shard I/N`, into a staging store) reads the main store's ledger
//! and its own, and appends to its own; its settings name the shard, since a shard reads every
//! file but keeps only the records it owns. The merge appends the shards' lines to the main
//! store's ledger once their records are committed there (`fluxmem_store::CARRIED_LOGS`), so
//! the next night's shard I of N skips the files it read before.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, IngestOptions};

/// The ledger's file name in the store directory.
pub const LEDGER: &str = "ingest-ledger.jsonl";

/// One ingested file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entry {
    pub path: String,
    pub size: u64,
    pub mtime_ns: i128,
    pub sha256: String,
    pub settings: String,
}

/// What the ledger says of a file.
pub(crate) enum Seen {
    /// Same path, settings, size and mtime: skip without reading.
    Unchanged,
    /// Same path and settings, other size or mtime: skip if the content hash is this one.
    Maybe(String),
    /// Not in the ledger.
    New,
}

pub(crate) struct Ledger {
    path: PathBuf,
    entries: HashMap<(String, String), Entry>,
    settings: String,
}

/// Size and mtime (ns since the epoch) of a file, as the ledger compares them.
pub(crate) fn stat(path: &Path) -> Option<(u64, i128)> {
    let metadata = std::fs::metadata(path).ok()?;
    let mtime = metadata
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos() as i128;
    Some((metadata.len(), mtime))
}

/// The absolute path of `path` as the ledger keys it.
pub(crate) fn key_path(path: &Path) -> String {
    std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}

impl Ledger {
    /// The ledger of the store at `store_dir` (with `main`, a staging store's main store: its
    /// ledger is read too); an unreadable line is ignored (its file is read again), a missing
    /// file is an empty ledger.
    pub(crate) fn open(store_dir: &Path, main: Option<&Path>, options: &IngestOptions) -> Ledger {
        let path = store_dir.join(LEDGER);
        let mut entries = HashMap::new();
        let read = main
            .map(|m| m.join(LEDGER))
            .into_iter()
            .chain([path.clone()]);
        for ledger in read {
            let Ok(text) = std::fs::read_to_string(&ledger) else {
                continue;
            };
            for line in text.lines() {
                if let Ok(entry) = serde_json::from_str::<Entry>(line) {
                    entries.insert((entry.path.clone(), entry.settings.clone()), entry);
                }
            }
        }
        let mut settings = format!(
            "fluxmem {}; format {:?}; tenant {}; agent {:?}; max_record_bytes {}; chunk_words {}",
            env!("CARGO_PKG_VERSION"),
            options.format,
            options.tenant,
            options.agent_id,
            options.max_record_bytes,
            options.chunk_words
        );
        if options.shard.count > 1 {
            settings.push_str(&format!("; shard {}", options.shard));
        }
        Ledger {
            path,
            entries,
            settings,
        }
    }

    pub(crate) fn seen(&self, key: &str, size: u64, mtime_ns: i128) -> Seen {
        match self.entries.get(&(key.to_string(), self.settings.clone())) {
            Some(entry) if entry.size == size && entry.mtime_ns == mtime_ns => Seen::Unchanged,
            Some(entry) => Seen::Maybe(entry.sha256.clone()),
            None => Seen::New,
        }
    }

    /// Records a file whose records are committed.
    pub(crate) fn record(
        &mut self,
        key: String,
        size: u64,
        mtime_ns: i128,
        sha256: String,
    ) -> Result<(), Error> {
        let entry = Entry {
            path: key.clone(),
            size,
            mtime_ns,
            sha256,
            settings: self.settings.clone(),
        };
        let io = |source| Error::Ledger {
            path: self.path.clone(),
            source,
        };
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(io)?;
        let mut line = serde_json::to_vec(&entry).expect("a ledger entry serialises");
        line.push(b'\n');
        file.write_all(&line).map_err(io)?;
        self.entries.insert((key, self.settings.clone()), entry);
        Ok(())
    }
}
