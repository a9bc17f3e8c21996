//! Rebuilding a lost manifest from the shard files (`fluxmem store recover`).
//!
//! Every shard carries what a manifest entry needs: its table, commit number and the first 12
//! hex digits of its SHA-256 in its name (`<table>-<commit:08>-<part:03>-<sha256[..12]>.parquet`),
//! its table tag and schema version in the Parquet key-value metadata, and its row count in the
//! Parquet footer. Recovery verifies each file against its name, lists every shard that passes
//! and reports, as `unproven`, what a manifest knew and the shards cannot tell:
//! - whether the newest commit was complete (a commit killed before its manifest rename leaves
//!   some or all of its shards, and nothing says which were meant to be there);
//! - whether an older shard had been superseded by a compaction whose cleanup did not finish;
//! - the commit log (stages, run ids, times) and the pipeline's progress markers: stages will
//!   redo their work, which is safe because every stage is idempotent.
//!
//! A temporary manifest (`manifest.json.tmp-*`) whose every listed shard verifies is the best
//! witness there is: recovery then adopts it (and its commit log and progress) and adds any
//! verified shard of a newer commit it does not list.
//!
//! An edit-log shard written by compaction names the shards it concatenated
//! (`fluxmem.merged_from` in its metadata): those inputs, when still on disk, are superseded
//! and left out (edit rows have no key, so adopting both would count every edit twice); they
//! are reported in [`RecoverReport::superseded`].
//!
//! A store whose manifest reads fine but lists shard files that are gone is the other case
//! recovery handles: [`recover_with`] reports each missing file with its table and rows, and
//! only with [`RecoverOptions::accept_loss`] commits a manifest without them (a new version,
//! its commit record naming what was lost). Without it nothing is written.
//!
//! Nothing is deleted: files that fail verification stay where they are and are reported.

use parquet::file::reader::{FileReader, SerializedFileReader};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::IoContext;
use crate::layout::{write_manifest, MANIFEST, SHARDS};
use crate::lock::WriterLock;
use crate::manifest::{CommitRecord, EmbeddingModel, Manifest, ShardEntry, SCHEMA_VERSION};
use crate::shard::parse_shard_name;
use crate::{Error, Result};

/// What [`recover`] did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RecoverReport {
    /// The store directory.
    pub store: PathBuf,
    /// The version of the rebuilt manifest (the highest commit found).
    pub version: u64,
    /// Shards listed in the rebuilt manifest, per table.
    pub shards: BTreeMap<String, usize>,
    /// Rows listed, per table.
    pub rows: BTreeMap<String, u64>,
    /// The temporary manifest adopted as the base, if one verified.
    pub adopted_temporary: Option<PathBuf>,
    /// Files left out (and left in place), with the reason.
    pub rejected: Vec<(String, String)>,
    /// What the shards cannot prove (see the module docs).
    pub unproven: Vec<String>,
    /// Where an unreadable `manifest.json` was moved before rebuilding, if there was one.
    pub moved_aside: Option<PathBuf>,
    /// Shards left out because a compaction's output holds their rows: (file, the output).
    pub superseded: Vec<(String, String)>,
    /// Shards the readable manifest listed whose files are gone (see [`recover_with`]).
    pub lost: Vec<LostShard>,
}

/// A shard file the manifest lists and the store lacks.
#[derive(Debug, Clone, Serialize)]
pub struct LostShard {
    /// Its path in the store.
    pub file: String,
    /// Its table.
    pub table: String,
    /// The commit that wrote it.
    pub commit: u64,
    /// The rows it held (per the manifest): lost with it, unless a newer row of the same key
    /// lives in another shard.
    pub rows: u64,
}

/// How [`recover_with`] may change a store.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecoverOptions {
    /// Commit a manifest without the listed shards that are gone, losing their rows.
    pub accept_loss: bool,
}

/// Rebuilds `<dir>/manifest.json` from the shard files, holding the writer lock.
///
/// Refuses a store whose manifest reads fine and lists only files that exist. An unreadable
/// manifest is first moved aside to `manifest.json.corrupt-<n>`; nothing else is renamed or
/// deleted.
pub fn recover(dir: &Path) -> Result<RecoverReport> {
    recover_with(dir, RecoverOptions::default())
}

/// [`recover`], and for a readable manifest that lists missing shard files: with
/// `accept_loss`, a new manifest without them (their rows are lost, and named in
/// [`RecoverReport::lost`]); without it, [`Error::Recover`] naming each missing file and its
/// rows, and nothing written.
pub fn recover_with(dir: &Path, options: RecoverOptions) -> Result<RecoverReport> {
    let shards_dir = dir.join(SHARDS);
    if !shards_dir.is_dir() {
        return Err(Error::Recover {
            path: dir.into(),
            reason: "no shards/ directory: nothing to recover from".into(),
        });
    }
    let _lock = WriterLock::acquire(dir)?;
    let manifest_path = dir.join(MANIFEST);
    let mut report = RecoverReport {
        store: dir.into(),
        ..Default::default()
    };
    if manifest_path.exists() {
        match Manifest::read(&manifest_path) {
            Ok(manifest) => return drop_lost(dir, manifest, options, report),
            Err(error) => {
                let aside = (0..)
                    .map(|n| dir.join(format!("{MANIFEST}.corrupt-{n}")))
                    .find(|p| !p.exists())
                    .expect("a free name");
                std::fs::rename(&manifest_path, &aside).at(&aside)?;
                report.unproven.push(format!(
                    "the unreadable manifest ({error}) was moved to {}",
                    aside.display()
                ));
                report.moved_aside = Some(aside);
            }
        }
    }

    let (mut verified, merged) = verify_shards(&shards_dir, &mut report)?;
    drop_superseded(&mut verified, &merged, &mut report);
    let base = adopt_temporary(dir, &verified, &mut report)?;
    let mut manifest = base.unwrap_or_else(Manifest::empty);
    let listed: std::collections::BTreeSet<String> =
        manifest.shards.iter().map(|s| s.file.clone()).collect();
    let base_version = manifest.version;
    let mut added: Vec<ShardEntry> = verified
        .values()
        .filter(|s| !listed.contains(&s.file))
        .cloned()
        .collect();
    added.sort_by(|a, b| (a.commit, &a.file).cmp(&(b.commit, &b.file)));
    if report.adopted_temporary.is_some() {
        // Shards at or below the adopted manifest's version that it does not list were
        // superseded or abandoned; only newer ones are added.
        for entry in added.iter().filter(|s| s.commit <= base_version) {
            report.rejected.push((
                entry.file.clone(),
                "not listed by the adopted manifest (superseded or abandoned); left in place"
                    .into(),
            ));
        }
        added.retain(|s| s.commit > base_version);
    }
    manifest.shards.extend(added);
    manifest
        .shards
        .sort_by(|a, b| (a.commit, &a.file).cmp(&(b.commit, &b.file)));
    manifest.version = manifest
        .shards
        .iter()
        .map(|s| s.commit)
        .max()
        .unwrap_or(0)
        .max(base_version);
    // Rebuilt from the shards: the counts of any earlier manifest need not hold.
    manifest.live_counts = None;
    let known: std::collections::BTreeSet<u64> =
        manifest.commits.iter().map(|c| c.version).collect();
    let at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let commits: std::collections::BTreeSet<u64> =
        manifest.shards.iter().map(|s| s.commit).collect();
    for commit in commits.iter().filter(|c| !known.contains(c)) {
        manifest.commits.push(CommitRecord {
            version: *commit,
            stage: "recovered".into(),
            run_id: String::new(),
            at: at.clone(),
            summary: serde_json::json!({ "note": "rebuilt by `fluxmem store recover`: stage, run id and time unknown" }),
        });
    }
    manifest.commits.sort_by_key(|c| c.version);
    manifest.embedding_model = embedding_model(dir, &manifest, &mut report)?;
    if let Some(&newest) = commits.iter().max() {
        if report.adopted_temporary.is_none() || newest > base_version {
            report.unproven.push(format!(
                "commit {newest} (the newest) may be incomplete: a commit killed before its manifest was renamed leaves \
                 some of its shards, and no manifest says which were meant to be there"
            ));
        }
    }
    if report.adopted_temporary.is_none() {
        report.unproven.push(
            "the commit log (stages, run ids, times) and the pipeline's progress markers are lost: \
             `fluxmem run` will redo its stages, which only adds what is missing"
                .into(),
        );
        report.unproven.push(
            "a node, edge or embedding shard superseded by a compaction whose cleanup did not finish would be listed again; \
             its rows lose to newer commits' rows for the same key, but rows the compaction dropped come back \
             (edit-log shards name their inputs, which are left out: see `superseded`)"
                .into(),
        );
    }
    for entry in &manifest.shards {
        *report.shards.entry(entry.table.clone()).or_default() += 1;
        *report.rows.entry(entry.table.clone()).or_default() += entry.rows;
    }
    report.version = manifest.version;
    write_manifest(dir, &manifest, None)?;
    Ok(report)
}

/// A readable manifest: the listed shards that are gone, dropped from a new manifest when
/// `options.accept_loss` says so (see [`recover_with`]).
fn drop_lost(
    dir: &Path,
    manifest: Manifest,
    options: RecoverOptions,
    mut report: RecoverReport,
) -> Result<RecoverReport> {
    report.lost = manifest
        .shards
        .iter()
        .filter(|entry| !dir.join(&entry.file).is_file())
        .map(|entry| LostShard {
            file: entry.file.clone(),
            table: entry.table.clone(),
            commit: entry.commit,
            rows: entry.rows,
        })
        .collect();
    if report.lost.is_empty() {
        return Err(Error::Recover {
            path: dir.into(),
            reason: format!(
                "the store has a readable manifest (version {}) and every shard it lists is there; there is nothing to recover",
                manifest.version
            ),
        });
    }
    let lost_list: Vec<String> = report
        .lost
        .iter()
        .map(|l| format!("{} ({} rows of {})", l.file, l.rows, l.table))
        .collect();
    if !options.accept_loss {
        return Err(Error::Recover {
            path: dir.into(),
            reason: format!(
                "{} shard file(s) the manifest lists are missing: {}; restore them, or run `fluxmem store recover --accept-loss` to commit a manifest without them (their rows are lost)",
                report.lost.len(),
                lost_list.join(", ")
            ),
        });
    }
    let sha =
        fluxmem_graph::sha256_hex(&std::fs::read(dir.join(MANIFEST)).at(&dir.join(MANIFEST))?);
    let gone: std::collections::BTreeSet<&str> =
        report.lost.iter().map(|l| l.file.as_str()).collect();
    let mut next = manifest.clone();
    next.shards.retain(|s| !gone.contains(s.file.as_str()));
    next.retired.retain(|r| dir.join(&r.file).is_file());
    // The tenant indexes may hold rows of the lost shards (`store index` makes them again
    // from what is left).
    next.retire_indexes(|_| true);
    next.version += 1;
    next.live_counts = None;
    next.commits.push(CommitRecord {
        version: next.version,
        stage: "recover".into(),
        run_id: String::new(),
        at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        summary: serde_json::json!({ "lost": lost_list }),
    });
    for lost in &report.lost {
        crate::keys::remove(dir, &lost.file)?;
    }
    write_manifest(dir, &next, Some(&sha))?;
    report.unproven.push(
        "rows of the lost shards are gone unless a newer row of the same key lives in another shard; stages whose progress markers passed them will not redo them"
            .into(),
    );
    for entry in &next.shards {
        *report.shards.entry(entry.table.clone()).or_default() += 1;
        *report.rows.entry(entry.table.clone()).or_default() += entry.rows;
    }
    report.version = next.version;
    Ok(report)
}

/// Leaves out of `verified` every shard a verified compaction output names as merged into it.
fn drop_superseded(
    verified: &mut BTreeMap<String, ShardEntry>,
    merged: &MergedFrom,
    report: &mut RecoverReport,
) {
    for (output, inputs) in merged {
        if !verified.contains_key(output) {
            continue;
        }
        for input in inputs {
            if verified.remove(input).is_some() {
                report.superseded.push((input.clone(), output.clone()));
            }
        }
    }
}

/// Compaction outputs (by file) and the files each names as merged into it.
type MergedFrom = BTreeMap<String, Vec<String>>;

/// Every shard file that matches its name: content hash prefix, table tag, schema version;
/// and what each compaction output among them names as merged into it.
fn verify_shards(
    shards_dir: &Path,
    report: &mut RecoverReport,
) -> Result<(BTreeMap<String, ShardEntry>, MergedFrom)> {
    let mut names: Vec<String> = std::fs::read_dir(shards_dir)
        .at(shards_dir)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut verified = BTreeMap::new();
    let mut merged = BTreeMap::new();
    for name in names {
        let file = format!("{SHARDS}/{name}");
        match verify_one(&shards_dir.join(&name), &name) {
            Ok((entry, inputs)) => {
                if !inputs.is_empty() {
                    merged.insert(file.clone(), inputs);
                }
                verified.insert(
                    file,
                    ShardEntry {
                        file: format!("{SHARDS}/{name}"),
                        ..entry
                    },
                );
            }
            Err(reason) => report.rejected.push((file, reason)),
        }
    }
    Ok((verified, merged))
}

/// The entry of the shard at `path` when it matches its name, and the files it names as merged
/// into it (empty for any shard but a compaction's edit-log output).
fn verify_one(path: &Path, name: &str) -> std::result::Result<(ShardEntry, Vec<String>), String> {
    let parsed = parse_shard_name(name)
        .ok_or("not a fluxmem shard name (<table>-<commit>-<part>-<sha12>.parquet)")?;
    let bytes = std::fs::read(path).map_err(|e| format!("unreadable: {e}"))?;
    let sha256 = fluxmem_graph::sha256_hex(&bytes);
    if !sha256.starts_with(&parsed.sha_prefix) {
        return Err(format!(
            "content hash {} does not match the name's {}: damaged or partly written",
            &sha256[..12],
            parsed.sha_prefix
        ));
    }
    let reader = SerializedFileReader::new(bytes::Bytes::from(bytes.clone()))
        .map_err(|e| format!("not a readable Parquet file: {e}"))?;
    let metadata = reader.metadata().file_metadata();
    let lookup = |key: &str| {
        metadata
            .key_value_metadata()
            .and_then(|kvs| kvs.iter().find(|kv| kv.key == key))
            .and_then(|kv| kv.value.clone())
    };
    if lookup(crate::shard::TABLE_KEY).as_deref() != Some(parsed.table.as_str()) {
        return Err(format!(
            "table tag {:?} does not match the name's `{}`",
            lookup(crate::shard::TABLE_KEY),
            parsed.table
        ));
    }
    if lookup(crate::shard::VERSION_KEY) != Some(SCHEMA_VERSION.to_string()) {
        return Err(format!(
            "schema version {:?}, this fluxmem reads {SCHEMA_VERSION}",
            lookup(crate::shard::VERSION_KEY)
        ));
    }
    let merged_from: Vec<String> = lookup(crate::shard::MERGED_FROM_KEY)
        .map(|list| {
            serde_json::from_str(&list)
                .map_err(|e| format!("unreadable {}: {e}", crate::shard::MERGED_FROM_KEY))
        })
        .transpose()?
        .unwrap_or_default();
    Ok((
        ShardEntry {
            table: parsed.table,
            file: String::new(),
            rows: metadata.num_rows().max(0) as u64,
            bytes: bytes.len() as u64,
            sha256,
            commit: parsed.commit,
            rows_from: None,
            rows_through: None,
            tenants: None,
        },
        merged_from,
    ))
}

/// The newest temporary manifest whose every listed shard verified, if any.
fn adopt_temporary(
    dir: &Path,
    verified: &BTreeMap<String, ShardEntry>,
    report: &mut RecoverReport,
) -> Result<Option<Manifest>> {
    let mut candidates: Vec<(u64, PathBuf, Manifest)> = Vec::new();
    for entry in std::fs::read_dir(dir).at(dir)?.flatten() {
        if !entry
            .file_name()
            .to_string_lossy()
            .starts_with("manifest.json.tmp")
        {
            continue;
        }
        let path = entry.path();
        match Manifest::read(&path) {
            Ok(manifest) => {
                // The span a compaction records (`rows_from`, `rows_through`) is the manifest's
                // to say: a file does not carry it.
                let same = |listed: &ShardEntry| {
                    verified.get(&listed.file).is_some_and(|found| {
                        *found
                            == ShardEntry {
                                rows_from: None,
                                rows_through: None,
                                tenants: None,
                                ..listed.clone()
                            }
                    })
                };
                let missing: Vec<&str> = manifest
                    .shards
                    .iter()
                    .filter(|s| !same(s))
                    .map(|s| s.file.as_str())
                    .collect();
                if missing.is_empty() {
                    candidates.push((manifest.version, path, manifest));
                } else {
                    report.rejected.push((
                        path.display().to_string(),
                        format!("temporary manifest lists {} shard(s) that are missing or differ, e.g. {}", missing.len(), missing[0]),
                    ));
                }
            }
            Err(error) => report.rejected.push((
                path.display().to_string(),
                format!("temporary manifest unreadable: {error}"),
            )),
        }
    }
    candidates.sort_by_key(|(version, _, _)| *version);
    Ok(candidates.pop().map(|(_, path, manifest)| {
        report.adopted_temporary = Some(path);
        manifest
    }))
}

/// The store's embedding model, from the newest embeddings shard (its `model_id` and vector size).
fn embedding_model(
    dir: &Path,
    manifest: &Manifest,
    report: &mut RecoverReport,
) -> Result<Option<EmbeddingModel>> {
    let Some(entry) = manifest
        .shards
        .iter()
        .rev()
        .find(|s| s.table == "embeddings")
    else {
        return Ok(None);
    };
    let batches = crate::shard::read(dir, entry, None)?;
    for batch in &batches {
        let embeddings =
            fluxmem_graph::schema::embeddings_from_batch(batch).map_err(|e| Error::Corrupt {
                path: dir.join(&entry.file),
                reason: e.to_string(),
            })?;
        if let Some(first) = embeddings.first() {
            let model = EmbeddingModel {
                id: first.model_id.clone(),
                dim: first.vector.len(),
            };
            if manifest
                .embedding_model
                .as_ref()
                .is_some_and(|m| m != &model)
            {
                report.unproven.push(format!(
                    "the adopted manifest named another embedding model than {}",
                    model.id
                ));
            }
            return Ok(Some(model));
        }
    }
    Ok(None)
}
