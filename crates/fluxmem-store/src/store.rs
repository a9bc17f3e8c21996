use fluxmem_graph::schema;
use fluxmem_graph::{Embedding, Graph, NodeId};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use crate::error::IoContext;
use crate::layout::{
    fault_point, staging_in_progress, sync_dir, write_manifest, INDEXES, MANIFEST, SCRATCH, SHARDS,
    STAGING,
};
use crate::lock::WriterLock;
use crate::manifest::{CommitRecord, EmbeddingModel, LiveCounts, Manifest, ShardEntry};
use crate::{keys, shard, Error, Result};

/// A read handle on a store directory. Readers take no lock: they read one manifest and the
/// immutable shards it lists.
#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) dir: PathBuf,
}

/// What a commit is, for the manifest's commit log.
#[derive(Debug, Clone, Default)]
pub struct CommitInfo {
    /// The committing stage.
    pub stage: String,
    /// The run id.
    pub run_id: String,
    /// Stage-specific counts.
    pub summary: Value,
    /// Progress markers merged into [`Manifest::progress`] by key.
    pub progress: BTreeMap<String, Value>,
}

impl Store {
    /// Opens the store at `dir`, which must hold a manifest.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Store> {
        let dir = dir.into();
        if !dir.join(MANIFEST).is_file() {
            check_no_manifest(&dir)?;
            return Err(Error::NotAStore { path: dir });
        }
        Ok(Store { dir })
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The current manifest.
    pub fn manifest(&self) -> Result<Manifest> {
        Manifest::read(&self.dir.join(MANIFEST))
    }
}

/// The single writer of a store: holds the lock, commits atomically.
#[derive(Debug)]
pub struct Writer {
    pub(crate) store: Store,
    lock: WriterLock,
    pub(crate) manifest: Manifest,
    /// SHA-256 of the `manifest.json` bytes this writer read or wrote last: a commit replaces
    /// the manifest only if it is still this one (compare and swap).
    pub(crate) manifest_sha256: String,
    /// How long retired shard files stay for readers ([`crate::DEFAULT_RETIRED_GRACE`]).
    pub(crate) retired_grace: std::time::Duration,
    /// Tenants of nodes a commit's rows may name without holding them ([`Writer::know_tenants`]).
    known_tenants: HashMap<NodeId, String>,
}

/// Each table's tenant list for a commit whose rows were gathered from shards that named
/// theirs (a staging merge), in place of placing the rows one by one.
pub(crate) type TableTenants = BTreeMap<String, Option<Vec<String>>>;

impl Writer {
    /// Opens (creating if needed) the store at `dir` for writing, taking the writer lock and
    /// removing leftovers of interrupted commits on top of the current manifest.
    ///
    /// A directory that holds shard files or a temporary manifest but no `manifest.json` is a
    /// damaged store, not a new one: it is refused with [`Error::NoManifest`] (nothing is
    /// touched) and [`crate::recover`] rebuilds its manifest.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Writer> {
        let dir = dir.into();
        let manifest_path = dir.join(MANIFEST);
        if !manifest_path.exists() {
            check_no_manifest(&dir)?;
            let foreign = std::fs::read_dir(&dir)
                .map(|entries| {
                    entries.flatten().any(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        !matches!(
                            name.as_str(),
                            "LOCK"
                                | SHARDS
                                | keys::KEYS
                                | INDEXES
                                | "quarantine"
                                | STAGING
                                | SCRATCH
                        ) && !name.starts_with("manifest.json.tmp")
                            && !name.starts_with("LOCK.tmp-")
                    })
                })
                .unwrap_or(false);
            if foreign {
                return Err(Error::Corrupt {
                    path: dir,
                    reason: "directory is not empty and holds no fluxmem manifest; refusing to create a store in it".into(),
                });
            }
        }
        std::fs::create_dir_all(dir.join(SHARDS)).at(&dir.join(SHARDS))?;
        let lock = WriterLock::acquire(&dir)?;
        let (manifest, manifest_sha256) = if manifest_path.exists() {
            read_manifest_with_hash(&manifest_path)?
        } else {
            // Checked again under the lock: another writer may have created it meanwhile.
            check_no_manifest(&dir)?;
            let empty = Manifest::empty();
            let hash = write_manifest(&dir, &empty, None)?;
            (empty, hash)
        };
        let writer = Writer {
            store: Store { dir },
            lock,
            manifest,
            manifest_sha256,
            retired_grace: DEFAULT_RETIRED_GRACE,
            known_tenants: HashMap::new(),
        };
        writer.remove_interrupted()?;
        Ok(writer)
    }

    /// [`Writer::open`], waiting up to `wait` for a lock another writer holds (polling every
    /// 200 ms); `on_wait` is called once, with the holder, when the wait begins. Any other error,
    /// or the lock still held at the deadline, is returned as it is.
    pub fn open_waiting(
        dir: impl Into<PathBuf>,
        wait: std::time::Duration,
        mut on_wait: impl FnMut(&str),
    ) -> Result<Writer> {
        let dir = dir.into();
        let deadline = std::time::Instant::now() + wait;
        let mut told = false;
        loop {
            match Writer::open(&dir) {
                Err(Error::Locked { holder, .. }) if std::time::Instant::now() < deadline => {
                    if !told {
                        on_wait(&holder);
                        told = true;
                    }
                    std::thread::sleep(
                        std::time::Duration::from_millis(200)
                            .min(deadline - std::time::Instant::now()),
                    );
                }
                other => return other,
            }
        }
    }

    /// The manifest of the last commit.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// A read handle on the same store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Tells the writer the tenants of nodes that later commits' edges and embeddings may name
    /// without holding the nodes (a stage passes the nodes it read), in place of what an
    /// earlier call told. With them, each shard's entry names the tenants of its rows
    /// ([`ShardEntry::tenants`]), and a reader of another tenant skips the shard unopened; a
    /// shard with a row the writer cannot place names none. A node's tenant is part of its
    /// id, so what is told here never goes stale.
    pub fn know_tenants<'a>(&mut self, nodes: impl IntoIterator<Item = (&'a NodeId, &'a str)>) {
        self.known_tenants = nodes
            .into_iter()
            .map(|(id, tenant)| (id.clone(), tenant.to_string()))
            .collect();
    }

    /// Keeps the shard files a compaction retires for `grace` (and
    /// [`crate::KEEP_RETIRED_COMMITS`] commits) before a commit deletes them, instead of
    /// [`crate::DEFAULT_RETIRED_GRACE`]: the time a reader of an older manifest has to finish.
    pub fn keep_retired_for(&mut self, grace: std::time::Duration) {
        self.retired_grace = grace;
    }

    /// The holder named by a stale lock this writer recovered, if any.
    pub fn stale_lock(&self) -> Option<&str> {
        self.lock.stale()
    }

    /// Commits `delta` on top of the current state: its nodes, edges and embeddings replace
    /// any stored ones with the same key. Shards are written and synced first, the manifest
    /// last by atomic rename.
    pub fn commit(&mut self, delta: &Graph, info: CommitInfo) -> Result<&Manifest> {
        let mut manifest = self.manifest.clone();
        self.write_commit(&mut manifest, delta, info, None)?;
        Ok(&self.manifest)
    }

    /// [`Writer::commit`] for a delta that only adds: none of its nodes, edges or embeddings
    /// has a key the store holds (the caller knows: ingest checks new ids against the stored
    /// ones, embed writes vectors only for nodes without one). The manifest's live counts,
    /// where they held, then hold for the new commit too (plus the delta's counts), and `stats`
    /// need not read the shards. A delta that replaces rows must go through `commit`: its
    /// counts here would be wrong.
    pub fn commit_new(&mut self, delta: &Graph, info: CommitInfo) -> Result<&Manifest> {
        let mut manifest = self.manifest.clone();
        let counts = manifest
            .current_counts()
            .map(|before| before + delta.stats());
        manifest.live_counts = counts.map(|stats| LiveCounts {
            version: manifest.version + 1,
            stats,
        });
        self.write_commit(&mut manifest, delta, info, None)?;
        Ok(&self.manifest)
    }

    /// Replaces the whole stored graph by `graph` in one commit (compaction, model migration).
    /// The shards the replaced manifest listed are deleted once the new manifest is in place
    /// (they are provably garbage: this writer's compare-and-swap replaced that manifest).
    pub fn replace(&mut self, graph: &Graph, info: CommitInfo) -> Result<&Manifest> {
        let old = self.manifest.shards.clone();
        let mut manifest = self.manifest.clone();
        manifest.shards.clear();
        // The tenant indexes hold rows of the replaced shards.
        manifest.retire_indexes(|_| true);
        manifest.embedding_model = None;
        manifest.live_counts = Some(LiveCounts {
            version: manifest.version + 1,
            stats: graph.stats(),
        });
        self.write_commit(&mut manifest, graph, info, None)?;
        let live: BTreeSet<&str> = self
            .manifest
            .shards
            .iter()
            .map(|s| s.file.as_str())
            .collect();
        for entry in old
            .iter()
            .filter(|s| !live.contains(s.file.as_str()) && s.file.starts_with(SHARDS))
        {
            let path = self.store.dir.join(&entry.file);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::Io { path, source: e })
                }
                _ => {}
            }
            keys::remove(&self.store.dir, &entry.file)?;
        }
        Ok(&self.manifest)
    }

    /// Shard files in `shards/` that the manifest does not list and that are not leftovers of
    /// an interrupted commit on top of it (their commit number is not above the manifest's
    /// version). Nothing deletes them: they may be another writer's data (`fluxmem store
    /// recover` can tell).
    pub fn unlisted_shards(&self) -> Result<Vec<String>> {
        let mut live: BTreeSet<&str> = self
            .manifest
            .shards
            .iter()
            .map(|s| s.file.as_str())
            .collect();
        live.extend(self.manifest.retired.iter().map(|r| r.file.as_str()));
        let shards_dir = self.store.dir.join(SHARDS);
        let mut unlisted = Vec::new();
        for entry in std::fs::read_dir(&shards_dir).at(&shards_dir)?.flatten() {
            let name = format!("{SHARDS}/{}", entry.file_name().to_string_lossy());
            if !live.contains(name.as_str()) {
                unlisted.push(name);
            }
        }
        unlisted.sort();
        Ok(unlisted)
    }

    /// Writes `delta`'s shards and lands `manifest` with them. Each shard names the tenants of
    /// its rows as the writer places them, or as `given` says for its table.
    pub(crate) fn write_commit(
        &mut self,
        manifest: &mut Manifest,
        delta: &Graph,
        info: CommitInfo,
        given: Option<&TableTenants>,
    ) -> Result<()> {
        let dir = self.store.dir.clone();
        let version = manifest.version + 1;
        let by_model = check_embeddings(manifest, delta)?;
        // Part 0 of each table, and one embeddings part per model.
        let mut parts: BTreeMap<String, usize> = BTreeMap::new();
        let known = &self.known_tenants;
        let tenant_of = |id: &NodeId| -> Option<&str> {
            (delta.nodes.get(id).map(|n| n.tenant.as_str()))
                .or_else(|| known.get(id).map(String::as_str))
        };
        let mut new_shards = write_shards(&dir, delta, version, &tenant_of, &mut |table| {
            let part = parts.entry(table.to_string()).or_default();
            *part += 1;
            *part - 1
        })?;
        if let Some(given) = given {
            for entry in &mut new_shards {
                entry.tenants = given.get(&entry.table).cloned().flatten();
            }
        }
        for (model, embeddings) in &by_model {
            manifest.embedding_model = Some(EmbeddingModel {
                id: model.clone(),
                dim: embeddings[0].vector.len(),
            });
        }
        if !new_shards.is_empty() {
            // The new shard files' directory entries must be durable before the manifest that
            // lists them is: a crash after the rename must not leave a manifest naming files
            // the directory lost.
            sync_dir(&dir.join(SHARDS))?;
        }
        fault_point("before-manifest", version);
        manifest.version = version;
        manifest.shards.extend(new_shards);
        self.land(manifest.clone(), info)?;
        *manifest = self.manifest.clone();
        fault_point("after-manifest", version);
        Ok(())
    }

    /// Deletes what an interrupted commit on top of the current manifest left: shard files
    /// (finished, or a streaming writer's `.parquet.tmp`) whose commit number (in their name) is
    /// above the manifest's version, and temporary manifests. Those are provably garbage: a
    /// commit's files are named after the version it was about to write, and that version
    /// never landed. Any other unlisted file is kept. Key indexes (`keys/`) of shard files
    /// that are not on disk go too: they are derived from a file that is gone.
    fn remove_interrupted(&self) -> Result<()> {
        let dir = &self.store.dir;
        let shards_dir = dir.join(SHARDS);
        let live: BTreeSet<&str> = self
            .manifest
            .shards
            .iter()
            .map(|s| s.file.as_str())
            .collect();
        for entry in std::fs::read_dir(&shards_dir).at(&shards_dir)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let listed = live.contains(format!("{SHARDS}/{name}").as_str());
            let commit = shard::parse_shard_name(&name).map(|parsed| parsed.commit);
            // A streaming writer's temporary file (compaction's merges) is named by its commit too.
            let commit =
                commit.or_else(|| shard::parse_temporary_name(&name).map(|(_, commit)| commit));
            let interrupted = commit.is_some_and(|commit| commit > self.manifest.version);
            if !listed && interrupted {
                std::fs::remove_file(entry.path()).at(&entry.path())?;
            }
        }
        for entry in std::fs::read_dir(dir).at(dir)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // A lock description's temporary is a dead holder's: only the lock's holder writes
            // one, and this writer (the holder) renamed its own over `LOCK` already.
            if name.starts_with("manifest.json.tmp") || name.starts_with("LOCK.tmp-") {
                std::fs::remove_file(entry.path()).at(&entry.path())?;
            }
        }
        // Key indexes of shard files that are gone (derived data: see `keys.rs`).
        keys::sweep(dir, &|file| dir.join(file).exists())?;
        Ok(())
    }
}

/// Commits a retired shard file stays on disk after it left the manifest.
pub const KEEP_RETIRED_COMMITS: u64 = 2;

/// How long a retired shard file stays on disk after it left the manifest, at least (and
/// [`KEEP_RETIRED_COMMITS`] commits): a reader that read the older manifest has this long to
/// read its shards. Set per writer with `Writer::keep_retired_for`.
pub const DEFAULT_RETIRED_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

impl Writer {
    /// Writes `manifest` (its version already set) as the next commit: records the commit,
    /// bounds the commit log, deletes retired files whose time is up, compare-and-swaps the
    /// manifest in.
    pub(crate) fn land(&mut self, mut manifest: Manifest, info: CommitInfo) -> Result<()> {
        let dir = self.store.dir.clone();
        manifest.progress.extend(info.progress);
        manifest.commits.push(CommitRecord {
            version: manifest.version,
            stage: info.stage,
            run_id: info.run_id,
            at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            summary: info.summary,
        });
        archive_commit_log(&dir, &mut manifest)?;
        delete_retired(&dir, &mut manifest, self.retired_grace)?;
        self.manifest_sha256 = write_manifest(&dir, &manifest, Some(&self.manifest_sha256))?;
        self.manifest = manifest;
        Ok(())
    }
}

/// Commit records kept in the manifest; older ones move to `history.jsonl` beside it, so the
/// manifest stays O(live shards).
pub const MANIFEST_COMMIT_LOG: usize = 64;

/// The commit log file of records that left the manifest.
pub const HISTORY: &str = "history.jsonl";

/// Moves all but the last [`MANIFEST_COMMIT_LOG`] commit records to `history.jsonl`
/// (appended and synced before the manifest that drops them is written; a crash in between
/// can only repeat records there, never lose one).
fn archive_commit_log(dir: &std::path::Path, manifest: &mut Manifest) -> Result<()> {
    use std::io::Write;
    if manifest.commits.len() <= MANIFEST_COMMIT_LOG {
        return Ok(());
    }
    let older: Vec<CommitRecord> = manifest
        .commits
        .drain(..manifest.commits.len() - MANIFEST_COMMIT_LOG)
        .collect();
    let path = dir.join(HISTORY);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .at(&path)?;
    let mut text = Vec::new();
    for record in &older {
        serde_json::to_writer(&mut text, record).expect("a commit record serialises");
        text.push(b'\n');
    }
    file.write_all(&text).at(&path)?;
    file.sync_all().at(&path)?;
    Ok(())
}

/// Deletes the retired files whose time is up ([`KEEP_RETIRED_COMMITS`] commits after they
/// left the manifest, and `grace` after, so that a reader that started on an older manifest
/// has that long to finish) and drops them from `manifest.retired`. A file is deleted before the
/// manifest that forgets it is written, so a crash leaves it listed as retired (and gone),
/// never on disk and unlisted. Nothing is deleted while a staging store exists.
fn delete_retired(
    dir: &std::path::Path,
    manifest: &mut Manifest,
    grace: std::time::Duration,
) -> Result<()> {
    if manifest.retired.is_empty() || staging_in_progress(dir) {
        return Ok(());
    }
    let live: BTreeSet<&str> = (manifest.shards.iter().map(|s| s.file.as_str()))
        .chain(manifest.indexes.iter().map(|i| i.file.as_str()))
        .collect();
    let mut kept = Vec::new();
    let now = chrono::Utc::now().timestamp_millis();
    let grace = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
    for retired in std::mem::take(&mut manifest.retired) {
        let aged = retired
            .at_ms
            .is_none_or(|at| now.saturating_sub(at) >= grace);
        let due = retired.version + KEEP_RETIRED_COMMITS <= manifest.version && aged;
        let ours = [SHARDS, INDEXES]
            .iter()
            .any(|folder| retired.file.starts_with(&format!("{folder}/")));
        if due && ours && !live.contains(retired.file.as_str()) {
            let path = dir.join(&retired.file);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::Io { path, source: e })
                }
                _ => {}
            }
            keys::remove(dir, &retired.file)?;
        } else {
            kept.push(retired);
        }
    }
    manifest.retired = kept;
    Ok(())
}

/// Refuses a directory without `manifest.json` that still holds shard files or a temporary
/// manifest: it is a store whose manifest was lost, and writing a new empty manifest there
/// would orphan (and a later cleanup delete) all of its data.
fn check_no_manifest(dir: &Path) -> Result<()> {
    let shards = std::fs::read_dir(dir.join(SHARDS))
        .map(|entries| entries.flatten().count())
        .unwrap_or(0);
    let temporary = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with("manifest.json.tmp")
                })
                .count()
        })
        .unwrap_or(0);
    // A temporary manifest alone (a crash while creating a new store) holds no data.
    if shards > 0 {
        return Err(Error::NoManifest {
            path: dir.to_path_buf(),
            shards,
            temporary,
        });
    }
    Ok(())
}

fn read_manifest_with_hash(path: &Path) -> Result<(Manifest, String)> {
    let bytes = std::fs::read(path).at(path)?;
    let manifest = Manifest::read(path)?;
    Ok((manifest, fluxmem_graph::sha256_hex(&bytes)))
}

/// Groups the delta's embeddings by model, refusing a model or dimension other than the store's.
fn check_embeddings<'a>(
    manifest: &Manifest,
    delta: &'a Graph,
) -> Result<BTreeMap<String, Vec<&'a Embedding>>> {
    let mut by_model: BTreeMap<String, Vec<&Embedding>> = BTreeMap::new();
    for embedding in delta.embeddings.values() {
        by_model
            .entry(embedding.model_id.clone())
            .or_default()
            .push(embedding);
    }
    let mut expected = manifest.embedding_model.clone();
    for (model, embeddings) in &by_model {
        let dim = embeddings[0].vector.len();
        let expected_model = expected.get_or_insert_with(|| EmbeddingModel {
            id: model.clone(),
            dim,
        });
        let mismatch = embeddings
            .iter()
            .find(|e| e.vector.len() != expected_model.dim);
        if &expected_model.id != model || mismatch.is_some() {
            return Err(Error::ModelMismatch {
                store_model: expected_model.id.clone(),
                store_dim: expected_model.dim,
                model: model.clone(),
                dim: mismatch.map(|e| e.vector.len()).unwrap_or(dim),
            });
        }
    }
    Ok(by_model)
}

/// Writes `delta`'s tables as shards of commit `version`: nodes (their steps under the nodes
/// shard's part number), edges, edits, and one embeddings shard per model, in model order.
/// `part(table)` numbers each shard. The caller checks the embeddings' models and dimensions.
/// Each entry names its rows' tenants where `tenant_of` places every node its rows name (an
/// edge by the ends it places, one at least: what fluxmem writes never joins two tenants);
/// the edit log's entries name none.
pub(crate) fn write_shards<'a>(
    dir: &Path,
    delta: &Graph,
    version: u64,
    tenant_of: &dyn Fn(&NodeId) -> Option<&'a str>,
    part: &mut dyn FnMut(&str) -> usize,
) -> Result<Vec<ShardEntry>> {
    let mut written = Vec::new();
    let named = |tenants: Option<Vec<&str>>| ShardEntry::tenant_list(tenants);
    if !delta.nodes.is_empty() {
        let (nodes, steps) =
            schema::nodes_to_batches(delta.nodes.values()).map_err(|e| graph_error(dir, e))?;
        let index = part("nodes");
        let tenants = named(Some(
            delta.nodes.values().map(|n| n.tenant.as_str()).collect(),
        ));
        let mut entry = shard::write(dir, "nodes", version, index, &nodes)?;
        entry.tenants = tenants.clone();
        written.push(entry);
        if steps.num_rows() > 0 {
            let mut entry = shard::write(dir, "steps", version, index, &steps)?;
            entry.tenants = tenants;
            written.push(entry);
        }
    }
    if !delta.edges.is_empty() {
        let edges =
            schema::edges_to_batch(delta.edges.values()).map_err(|e| graph_error(dir, e))?;
        let mut entry = shard::write(dir, "edges", version, part("edges"), &edges)?;
        // An edge is placed by its ends, both where both are known (an older store's edge
        // joining two tenants, which refine deactivates, is then seen by both).
        let ends = |e: &fluxmem_graph::Edge| match (tenant_of(&e.src), tenant_of(&e.dst)) {
            (None, None) => None,
            (src, dst) => Some(src.into_iter().chain(dst)),
        };
        entry.tenants = named(
            (delta.edges.values())
                .map(ends)
                .collect::<Option<Vec<_>>>()
                .map(|all| all.into_iter().flatten().collect()),
        );
        written.push(entry);
    }
    if !delta.edits.is_empty() {
        let edits = schema::edits_to_batch(&delta.edits).map_err(|e| graph_error(dir, e))?;
        written.push(shard::write(dir, "edits", version, part("edits"), &edits)?);
    }
    let mut by_model: BTreeMap<&str, Vec<&Embedding>> = BTreeMap::new();
    for embedding in delta.embeddings.values() {
        by_model
            .entry(embedding.model_id.as_str())
            .or_default()
            .push(embedding);
    }
    for embeddings in by_model.values() {
        let dim = embeddings[0].vector.len();
        let batch = schema::embeddings_to_batch(dim, embeddings.iter().copied())
            .map_err(|e| graph_error(dir, e))?;
        let mut entry = shard::write(dir, "embeddings", version, part("embeddings"), &batch)?;
        entry.tenants = named(embeddings.iter().map(|e| tenant_of(&e.node_id)).collect());
        written.push(entry);
    }
    Ok(written)
}

fn graph_error(dir: &Path, source: fluxmem_graph::Error) -> Error {
    Error::Graph {
        path: dir.to_path_buf(),
        source,
    }
}
