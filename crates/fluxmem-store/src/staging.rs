//! Sharded execution: deterministic work splits and per-shard staging stores.

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

use crate::error::IoContext;
use crate::layout::{write_manifest, MANIFEST, SHARDS, STAGING};
use crate::manifest::{Manifest, ShardEntry};
use crate::store::TableTenants;
use crate::{CommitInfo, Error, Result, Store, Writer};
use std::collections::BTreeMap;

/// Shard `index` of `count`: a deterministic 1/count of a stage's work, chosen by hashing each
/// work item's key (a node id, an input record's position), so every item belongs to exactly
/// one shard whatever the machine or the order of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// 0-based index.
    pub index: usize,
    /// Number of shards (at least 1).
    pub count: usize,
}

impl Shard {
    /// The whole work as one shard.
    pub const ALL: Shard = Shard { index: 0, count: 1 };

    /// True when the item with `key` belongs to this shard.
    pub fn owns(&self, key: &str) -> bool {
        if self.count <= 1 {
            return true;
        }
        let digest = Sha256::digest(key.as_bytes());
        let value = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
        (value % self.count as u64) as usize == self.index
    }

    /// `I-of-N`, as used in staging directory names.
    pub fn name(&self) -> String {
        format!("{}-of-{}", self.index, self.count)
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Shard {
    type Err = Error;
    fn from_str(value: &str) -> Result<Shard> {
        let bad = |reason: &str| Error::BadShard {
            value: value.into(),
            reason: reason.into(),
        };
        let (index, count) = value
            .split_once('/')
            .ok_or_else(|| bad("expected I/N, e.g. 0/4"))?;
        let index: usize = index.trim().parse().map_err(|_| bad("I is not a number"))?;
        let count: usize = count.trim().parse().map_err(|_| bad("N is not a number"))?;
        if count == 0 {
            return Err(bad("N must be at least 1"));
        }
        if index >= count {
            return Err(bad("I must be below N (shards are numbered from 0)"));
        }
        Ok(Shard { index, count })
    }
}

/// The staging store of `shard` of `stage` under the store at `main`.
pub fn staging_dir(main: &Path, stage: &str, shard: Shard) -> PathBuf {
    main.join(STAGING).join(format!("{stage}-{}", shard.name()))
}

/// The manifest of the staging store of shard `shard` of `stage`, if it has one. It starts as
/// a copy of the main store's (progress markers included): [`staged_by`] tells whether the
/// shard itself committed.
pub fn staging_manifest(main: &Path, stage: &str, shard: Shard) -> Result<Option<Manifest>> {
    let path = staging_dir(main, stage, shard).join(MANIFEST);
    if !path.is_file() {
        return Ok(None);
    }
    Manifest::read(&path).map(Some)
}

/// Whether the staging store of `manifest`, started from the main store's version `base` and
/// finished, made a commit of stage `stage` itself (one of its last commit records, after
/// `base`). A shard that is unfinished or started from another version is the merge's to
/// refuse.
pub fn staged_by(manifest: &Manifest, stage: &str, base: u64) -> bool {
    let finished = staging_marker(manifest)
        .and_then(|marker| marker.get("done"))
        .and_then(Value::as_bool)
        == Some(true);
    finished
        && base_version(manifest) == Some(base)
        && (manifest.commits.iter()).any(|c| c.stage == stage && c.version > base)
}

/// The note the shard `shard` of `stage` left when it finished
/// ([`Writer::finish_staging_with`]; `Null` when it left none); `None` when the shard has no
/// staging store or has not finished.
pub fn staging_note(main: &Path, stage: &str, shard: Shard) -> Result<Option<Value>> {
    let dir = staging_dir(main, stage, shard);
    if !dir.join(MANIFEST).is_file() {
        return Ok(None);
    }
    let manifest = Manifest::read(&dir.join(MANIFEST))?;
    let Some(marker) = staging_marker(&manifest) else {
        return Ok(None);
    };
    if marker.get("done").and_then(Value::as_bool) != Some(true) {
        return Ok(None);
    }
    Ok(Some(marker.get("note").cloned().unwrap_or(Value::Null)))
}

/// What a merge did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct MergeReport {
    /// Shards merged.
    pub shards: usize,
    /// Nodes, edges, embeddings and edit records in the merged delta.
    pub nodes: usize,
    /// See `nodes`.
    pub edges: usize,
    /// See `nodes`.
    pub embeddings: usize,
    /// See `nodes`.
    pub edits: usize,
    /// Quarantine files moved into the main store.
    pub quarantine_files: Vec<PathBuf>,
    /// False when an earlier merge had already committed these shards (only cleanup was left).
    pub committed: bool,
}

/// Staging stores of a stage read the main store's shards through this prefix.
const TO_MAIN: &str = "../../";

/// Append-only logs a stage keeps beside its store that belong to the main store once a shard
/// is merged: ingest's ledger of the files read (a staging store's lines are appended to the
/// main store's file of the same name after the merge commits, so a file is recorded only once
/// its records are in the main store).
pub const CARRIED_LOGS: [&str; 1] = ["ingest-ledger.jsonl"];

fn staging_marker(manifest: &Manifest) -> Option<&Value> {
    manifest.progress.get("staging")
}

fn base_version(manifest: &Manifest) -> Option<u64> {
    staging_marker(manifest)
        .and_then(|s| s.get("base_version"))
        .and_then(Value::as_u64)
}

/// Creates the main store if it has no manifest yet. Shards started at the same moment on a
/// fresh store race for its writer lock: the losers wait (up to a minute) for the winner's
/// manifest instead of failing.
fn create_main(main: &Path) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !main.join(MANIFEST).is_file() {
        match Writer::open(main) {
            Ok(writer) => drop(writer),
            Err(Error::Locked { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Writer {
    /// Opens (creating if needed) the staging store of `shard` of `stage` over the store at
    /// `main` (created empty if missing). A staging store left by a killed run over the same
    /// main commit is resumed; one over an older commit is stale and started afresh.
    pub fn open_staging(main: &Path, stage: &str, shard: Shard) -> Result<Writer> {
        create_main(main)?;
        let main_manifest = Store::open(main)?.manifest()?;
        let dir = staging_dir(main, stage, shard);
        if dir.join(MANIFEST).is_file() {
            let current = Manifest::read(&dir.join(MANIFEST))?;
            if base_version(&current) == Some(main_manifest.version) {
                return Writer::open(&dir);
            }
            std::fs::remove_dir_all(&dir).at(&dir)?;
        }
        std::fs::create_dir_all(dir.join(SHARDS)).at(&dir.join(SHARDS))?;
        let mut manifest = main_manifest.clone();
        // The main store's retired files are the main store's to delete, and its tenant
        // indexes its to read.
        manifest.retired.clear();
        manifest.indexes.clear();
        for entry in &mut manifest.shards {
            entry.file = format!("{TO_MAIN}{}", entry.file);
        }
        manifest.progress.insert(
            "staging".into(),
            serde_json::json!({ "stage": stage, "shard": shard.to_string(), "base_version": main_manifest.version, "done": false }),
        );
        write_manifest(&dir, &manifest, None)?;
        Writer::open(&dir)
    }

    /// The main store of this staging store, or `None` for a main store.
    pub fn staging_main(&self) -> Option<PathBuf> {
        staging_marker(self.manifest()).map(|_| self.store().dir().join(TO_MAIN))
    }

    /// Marks this staging store's shard as finished (merge refuses unfinished shards).
    pub fn finish_staging(&mut self, run_id: &str) -> Result<()> {
        self.finish_staging_with(run_id, Value::Null)
    }

    /// [`Writer::finish_staging`], with a note of what the shard did that the merge checks
    /// (the staging marker's `note`; see [`staging_note`]).
    pub fn finish_staging_with(&mut self, run_id: &str, note: Value) -> Result<()> {
        let mut marker =
            staging_marker(self.manifest())
                .cloned()
                .ok_or_else(|| Error::Staging {
                    path: self.store().dir().to_path_buf(),
                    reason: "not a staging store".into(),
                })?;
        marker["done"] = Value::Bool(true);
        if !note.is_null() {
            marker["note"] = note;
        }
        let info = CommitInfo {
            stage: "shard-done".into(),
            run_id: run_id.into(),
            summary: Value::Null,
            progress: [("staging".to_string(), marker)].into_iter().collect(),
        };
        self.commit(&Default::default(), info)?;
        Ok(())
    }

    /// Merges the `count` finished staging stores of `stage` into this (main) store: the union
    /// of their own data in one commit (shard order, later shards win on equal keys), their
    /// quarantine files moved under `<store>/quarantine/`, then the staging stores removed.
    pub fn merge_staging(
        &mut self,
        stage: &str,
        count: usize,
        mut info: CommitInfo,
    ) -> Result<MergeReport> {
        let main = self.store().dir().to_path_buf();
        let merged_key = format!("merged.{stage}");
        let mut report = MergeReport {
            shards: count,
            ..Default::default()
        };
        let mut delta = fluxmem_graph::Graph::default();
        // Each table's staged shards: the merged shard names the union of their tenants.
        let mut staged: BTreeMap<String, Vec<ShardEntry>> = BTreeMap::new();
        let mut dirs = Vec::new();
        let mut already = false;
        for index in 0..count {
            let shard = Shard { index, count };
            let dir = staging_dir(&main, stage, shard);
            let missing = |reason: String| Error::Staging {
                path: dir.clone(),
                reason,
            };
            if !dir.join(MANIFEST).is_file() {
                return Err(missing(format!(
                    "shard {shard} of `{stage}` has no staging store; run it with --shard {shard}"
                )));
            }
            let manifest = Manifest::read(&dir.join(MANIFEST))?;
            let marker =
                staging_marker(&manifest).ok_or_else(|| missing("not a staging store".into()))?;
            if marker.get("done").and_then(Value::as_bool) != Some(true) {
                return Err(missing(format!("shard {shard} of `{stage}` has not finished; run it again with --shard {shard}")));
            }
            let base = base_version(&manifest);
            let merged = self.manifest().progress.get(&merged_key);
            if base != Some(self.manifest().version) {
                if merged
                    .and_then(|m| m.get("base_version"))
                    .and_then(Value::as_u64)
                    == base
                {
                    already = true;
                    dirs.push(dir);
                    continue;
                }
                return Err(missing(format!(
                    "shard {shard} started from store version {}, the store is now at {}; run the shard again",
                    base.map_or("?".into(), |b| b.to_string()),
                    self.manifest().version
                )));
            }
            let own: Vec<_> = manifest
                .shards
                .iter()
                .filter(|s| !s.file.starts_with(TO_MAIN))
                .cloned()
                .collect();
            for entry in &own {
                staged
                    .entry(entry.table.clone())
                    .or_default()
                    .push(entry.clone());
            }
            let graph = Store { dir: dir.clone() }.load_at(&Manifest {
                shards: own,
                ..manifest.clone()
            })?;
            delta.apply(graph);
            dirs.push(dir);
        }
        if !already {
            // Quarantine files first: once the commit lands, the staging stores may go.
            for (index, dir) in dirs.iter().enumerate() {
                let quarantine = dir.join("quarantine");
                let Ok(entries) = std::fs::read_dir(&quarantine) else {
                    continue;
                };
                let target = main.join("quarantine");
                std::fs::create_dir_all(&target).at(&target)?;
                let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
                files.sort();
                for file in files {
                    let name = format!(
                        "{stage}-{}-{}",
                        Shard { index, count }.name(),
                        file.file_name().unwrap_or_default().to_string_lossy()
                    );
                    let to = target.join(name);
                    std::fs::copy(&file, &to).at(&to)?;
                    report.quarantine_files.push(to);
                }
            }
            report.nodes = delta.nodes.len();
            report.edges = delta.edges.len();
            report.embeddings = delta.embeddings.len();
            report.edits = delta.edits.len();
            info.progress.insert(
                merged_key,
                serde_json::json!({ "shards": count, "base_version": self.manifest().version }),
            );
            let tenants: TableTenants = staged
                .iter()
                .map(|(table, entries)| (table.clone(), ShardEntry::union_of_tenants(entries)))
                .collect();
            let mut manifest = self.manifest().clone();
            self.write_commit(&mut manifest, &delta, info, Some(&tenants))?;
            report.committed = true;
        }
        // The shards' logs join the main store's once their data has (a crash before this only
        // makes the next run redo the work the lines record; a line appended twice is one).
        for dir in &dirs {
            for name in CARRIED_LOGS {
                let from = dir.join(name);
                let Ok(lines) = std::fs::read(&from) else {
                    continue;
                };
                let to = main.join(name);
                let mut file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&to)
                    .at(&to)?;
                std::io::Write::write_all(&mut file, &lines).at(&to)?;
            }
        }
        for dir in dirs {
            std::fs::remove_dir_all(&dir).at(&dir)?;
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_partition_the_work() {
        let keys: Vec<String> = (0..1000).map(|i| format!("node-{i}")).collect();
        let shards: Vec<Shard> = (0..4).map(|index| Shard { index, count: 4 }).collect();
        for key in &keys {
            assert_eq!(
                shards.iter().filter(|s| s.owns(key)).count(),
                1,
                "{key} belongs to exactly one shard"
            );
        }
        let sizes: Vec<usize> = shards
            .iter()
            .map(|s| keys.iter().filter(|k| s.owns(k)).count())
            .collect();
        assert!(sizes.iter().all(|&n| n > 150), "roughly even: {sizes:?}");
        assert!(keys.iter().all(|k| Shard::ALL.owns(k)));
    }

    #[test]
    fn shard_values_parse_with_clear_errors() {
        assert_eq!(
            "2/4".parse::<Shard>().unwrap(),
            Shard { index: 2, count: 4 }
        );
        assert_eq!(Shard { index: 2, count: 4 }.to_string(), "2/4");
        for bad in ["4/4", "1/0", "x/2", "3", ""] {
            let error = bad.parse::<Shard>().unwrap_err().to_string();
            assert!(error.starts_with(&format!("shard `{bad}`")), "{error}");
        }
    }
}
