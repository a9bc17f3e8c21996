use fluxmem_graph::schema;
use fluxmem_graph::{Embedding, Graph, GraphStats, NodeId, Step};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::error::IoContext;
use crate::lock::WriterLock;
use crate::manifest::{CommitRecord, EmbeddingModel, Manifest, ShardEntry};
use crate::{shard, Error, Result};

pub(crate) const MANIFEST: &str = "manifest.json";
pub(crate) const SHARDS: &str = "shards";

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

    /// The whole graph of the current commit.
    pub fn load(&self) -> Result<Graph> {
        self.load_at(&self.manifest()?)
    }

    /// The whole graph of the commit `manifest` describes, every shard verified.
    pub fn load_at(&self, manifest: &Manifest) -> Result<Graph> {
        let mut graph = Graph::default();
        for commit in commits(manifest) {
            let shards: Vec<&ShardEntry> = manifest.shards.iter().filter(|s| s.commit == commit).collect();
            let mut steps: BTreeMap<NodeId, Vec<Step>> = BTreeMap::new();
            for entry in shards.iter().filter(|s| s.table == "steps") {
                for batch in shard::read(&self.dir, entry, None)? {
                    schema::steps_from_batch(&batch, &mut steps).map_err(|e| self.graph_error(entry, e))?;
                }
            }
            for entry in shards {
                let batches = match entry.table.as_str() {
                    "steps" => continue,
                    "nodes" | "edges" | "embeddings" | "edits" => shard::read(&self.dir, entry, None)?,
                    other => {
                        return Err(Error::Corrupt {
                            path: self.dir.join(MANIFEST),
                            reason: format!("unknown table `{other}` for {}", entry.file),
                        })
                    }
                };
                for batch in &batches {
                    let mapped = match entry.table.as_str() {
                        "nodes" => schema::nodes_from_batch(batch, &steps).map(|n| n.into_iter().for_each(|n| graph.upsert_node(n))),
                        "edges" => schema::edges_from_batch(batch).map(|e| e.into_iter().for_each(|e| graph.upsert_edge(e))),
                        "edits" => schema::edits_from_batch(batch).map(|e| graph.edits.extend(e)),
                        _ => schema::embeddings_from_batch(batch)
                            .map(|e| e.into_iter().for_each(|e| graph.upsert_embedding(e))),
                    };
                    mapped.map_err(|e| self.graph_error(entry, e))?;
                }
            }
        }
        Ok(graph)
    }

    /// Ids of all stored nodes (reads only the `id` column).
    pub fn node_ids(&self, manifest: &Manifest) -> Result<BTreeSet<NodeId>> {
        let mut ids = BTreeSet::new();
        for entry in manifest.shards.iter().filter(|s| s.table == "nodes") {
            for batch in shard::read(&self.dir, entry, Some(&["id"]))? {
                let column = batch.column(0);
                let strings = arrow_array::cast::AsArray::as_string::<i32>(column.as_ref());
                ids.extend(strings.iter().flatten().map(NodeId::from));
            }
        }
        Ok(ids)
    }

    /// Counts of the current commit, with its manifest.
    pub fn stats(&self) -> Result<(GraphStats, Manifest)> {
        let manifest = self.manifest()?;
        let graph = self.load_at(&manifest)?;
        Ok((graph.stats(), manifest))
    }

    fn graph_error(&self, entry: &ShardEntry, source: fluxmem_graph::Error) -> Error {
        Error::Corrupt { path: self.dir.join(&entry.file), reason: source.to_string() }
    }
}

fn commits(manifest: &Manifest) -> BTreeSet<u64> {
    manifest.shards.iter().map(|s| s.commit).collect()
}

/// The single writer of a store: holds the lock, commits atomically.
#[derive(Debug)]
pub struct Writer {
    store: Store,
    lock: WriterLock,
    manifest: Manifest,
}

impl Writer {
    /// Opens (creating if needed) the store at `dir` for writing, taking the writer lock and
    /// removing leftovers of interrupted commits.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Writer> {
        let dir = dir.into();
        let manifest_path = dir.join(MANIFEST);
        if !manifest_path.exists() {
            let foreign = std::fs::read_dir(&dir)
                .map(|entries| {
                    entries.flatten().any(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        !matches!(name.as_str(), "LOCK" | SHARDS | "quarantine" | crate::STAGING) && !name.starts_with("manifest.json.tmp")
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
        let manifest = if manifest_path.exists() {
            Manifest::read(&manifest_path)?
        } else {
            let empty = Manifest::empty();
            write_manifest(&dir, &empty)?;
            empty
        };
        let writer = Writer { store: Store { dir }, lock, manifest };
        writer.remove_orphans()?;
        Ok(writer)
    }

    /// The manifest of the last commit.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// A read handle on the same store.
    pub fn store(&self) -> &Store {
        &self.store
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
        self.write_commit(&mut manifest, delta, info)?;
        Ok(&self.manifest)
    }

    /// Replaces the whole stored graph by `graph` in one commit (compaction, model migration).
    /// Shards of earlier commits are deleted once the new manifest is in place.
    pub fn replace(&mut self, graph: &Graph, info: CommitInfo) -> Result<&Manifest> {
        let mut manifest = self.manifest.clone();
        manifest.shards.clear();
        manifest.embedding_model = None;
        self.write_commit(&mut manifest, graph, info)?;
        self.remove_orphans()?;
        Ok(&self.manifest)
    }

    fn write_commit(&mut self, manifest: &mut Manifest, delta: &Graph, info: CommitInfo) -> Result<()> {
        let dir = self.store.dir.clone();
        let version = manifest.version + 1;
        let by_model = check_embeddings(manifest, delta)?;
        let mut new_shards = Vec::new();
        if !delta.nodes.is_empty() {
            let (nodes, steps) = schema::nodes_to_batches(delta.nodes.values()).map_err(|e| graph_error(&dir, e))?;
            new_shards.push(shard::write(&dir, "nodes", version, 0, &nodes)?);
            if steps.num_rows() > 0 {
                new_shards.push(shard::write(&dir, "steps", version, 0, &steps)?);
            }
        }
        if !delta.edges.is_empty() {
            let edges = schema::edges_to_batch(delta.edges.values()).map_err(|e| graph_error(&dir, e))?;
            new_shards.push(shard::write(&dir, "edges", version, 0, &edges)?);
        }
        if !delta.edits.is_empty() {
            let edits = schema::edits_to_batch(&delta.edits).map_err(|e| graph_error(&dir, e))?;
            new_shards.push(shard::write(&dir, "edits", version, 0, &edits)?);
        }
        for (part, (model, embeddings)) in by_model.iter().enumerate() {
            let dim = embeddings[0].vector.len();
            let batch = schema::embeddings_to_batch(dim, embeddings.iter().copied()).map_err(|e| graph_error(&dir, e))?;
            new_shards.push(shard::write(&dir, "embeddings", version, part, &batch)?);
            manifest.embedding_model = Some(EmbeddingModel { id: model.clone(), dim });
        }
        fault_point("before-manifest", version);
        manifest.version = version;
        manifest.shards.extend(new_shards);
        manifest.progress.extend(info.progress);
        manifest.commits.push(CommitRecord {
            version,
            stage: info.stage,
            run_id: info.run_id,
            at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            summary: info.summary,
        });
        write_manifest(&dir, manifest)?;
        self.manifest = manifest.clone();
        fault_point("after-manifest", version);
        Ok(())
    }

    /// Deletes shard files the manifest does not list (left by an interrupted commit or
    /// superseded by [`Writer::replace`]) and stray temporary manifests.
    fn remove_orphans(&self) -> Result<()> {
        let dir = &self.store.dir;
        let live: BTreeSet<&str> = self.manifest.shards.iter().map(|s| s.file.as_str()).collect();
        let shards_dir = dir.join(SHARDS);
        for entry in std::fs::read_dir(&shards_dir).at(&shards_dir)?.flatten() {
            let name = format!("{SHARDS}/{}", entry.file_name().to_string_lossy());
            if !live.contains(name.as_str()) {
                std::fs::remove_file(entry.path()).at(&entry.path())?;
            }
        }
        for entry in std::fs::read_dir(dir).at(dir)?.flatten() {
            if entry.file_name().to_string_lossy().starts_with("manifest.json.tmp") {
                std::fs::remove_file(entry.path()).at(&entry.path())?;
            }
        }
        Ok(())
    }
}

/// Groups the delta's embeddings by model, refusing a model or dimension other than the store's.
fn check_embeddings<'a>(manifest: &Manifest, delta: &'a Graph) -> Result<BTreeMap<String, Vec<&'a Embedding>>> {
    let mut by_model: BTreeMap<String, Vec<&Embedding>> = BTreeMap::new();
    for embedding in delta.embeddings.values() {
        by_model.entry(embedding.model_id.clone()).or_default().push(embedding);
    }
    let mut expected = manifest.embedding_model.clone();
    for (model, embeddings) in &by_model {
        let dim = embeddings[0].vector.len();
        let expected_model = expected.get_or_insert_with(|| EmbeddingModel { id: model.clone(), dim });
        let mismatch = embeddings.iter().find(|e| e.vector.len() != expected_model.dim);
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

fn graph_error(dir: &Path, source: fluxmem_graph::Error) -> Error {
    Error::Graph { path: dir.to_path_buf(), source }
}

/// Writes `manifest` as `<dir>/manifest.json` atomically: temp file, fsync, rename, fsync dir.
pub(crate) fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    use std::io::Write;
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!("{MANIFEST}.tmp-{}", std::process::id()));
    let text = serde_json::to_vec_pretty(manifest).expect("a manifest always serializes");
    let mut file = std::fs::File::create(&tmp).at(&tmp)?;
    file.write_all(&text).at(&tmp)?;
    file.sync_all().at(&tmp)?;
    std::fs::rename(&tmp, &path).at(&path)?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).at(dir)?;
    Ok(())
}

/// Test hook: `FLUXMEM_FAULT=<point>:<version>` aborts the process at that point of that commit
/// (`before-manifest`: shards written, manifest not; `after-manifest`: commit done). It lets
/// the crash tests hit the exact window between shard and manifest writes.
fn fault_point(point: &str, version: u64) {
    if let Ok(spec) = std::env::var("FLUXMEM_FAULT") {
        if spec == format!("{point}:{version}") {
            std::process::abort();
        }
    }
}
