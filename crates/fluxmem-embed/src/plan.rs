//! Embedding in three steps, for runs spread over many workers: plan, execute, commit.
//!
//! - **Plan** ([`plan`], one process, under the writer lock, at manifest version V): the texts
//!   the run must give the model (those of the nodes to embed whose text no stored vector of the
//!   model holds), each once, keyed by its SHA-256 and put in one of [`BUCKETS`] fixed buckets
//!   ([`bucket_of`]: the key's first four bytes modulo [`BUCKETS`], whatever the worker count).
//!   Written to `scratch/embed/<run id>/` in the store: `items.parquet` (`bucket`, `key`,
//!   `text`, sorted by bucket then key, one row group per bucket) and `plan.json` (V, the
//!   model, the counts, the items file's SHA-256 and the plan's digest).
//! - **Execute** ([`Plan::execute`] for any rows of the plan, [`Plan::execute_buckets`] for
//!   whole buckets): any number of workers, in any order and batch size, retried at will. A
//!   worker needs no store and no lock, only the plan's folder. It writes its vectors to
//!   `results/` in the plan's folder (`plan`, `key`, `vector` rows; a file written to a temporary
//!   name and renamed, so a killed worker leaves no half file under a result's name).
//! - **Commit** ([`Plan::commit`], single writer): refuses a store that moved since V (other
//!   than by this plan's own earlier commits, so a killed commit resumes), then reads every
//!   result ([`Plan::results`]) and refuses a row of another plan, a key the plan does not
//!   hold, a vector of the wrong length, two different vectors for one key (non-determinism),
//!   and a planned key with no vector. It then runs the in-process embed stage with the
//!   results standing in for the model, so it writes the shards an in-process run writes: in
//!   node id order, `commit_every` nodes a commit. The embedder computes each text's vector
//!   whatever the texts beside it (see fluxmem-models' native forward), so the shard files are
//!   byte-identical to `fluxmem run`'s for any worker count, batch size and order.
//!
//! Another stage's texts for the model are planned, executed and checked the same way
//! ([`plan_texts`], [`Plan::open_for`]): connect's ground queries (`fluxmem_connect::
//! planned_queries`), whose plan lives in `scratch/embed/connect@<run id>/` and whose commit
//! runs the connect stage with the results standing in for the model.
//!
//! Planning removes the plans no commit can take any more ([`sweep_stale`]: their store moved
//! since, by another commit), such as a run's plan abandoned when its driver died.
//!
//! Limits: the plan holds the night's new texts in memory while it writes them. The commit
//! holds 36 bytes a planned text in memory; the checked vectors wait in a file beside the
//! results.

use crate::{embed_selected, node_rows, select, window_len, EmbedOptions, EmbedReport, Error};
use crate::{Progress, Result};
use arrow_array::builder::StringBuilder;
use arrow_array::{Array, FixedSizeListArray, Float32Array, RecordBatch, StringArray, UInt32Array};
use arrow_schema::{DataType, Field, Schema};
use fluxmem_graph::sha256_hex;
use fluxmem_models::Embedder;
use fluxmem_store::Writer;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ParquetRecordBatchReaderBuilder};
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::file::properties::WriterProperties;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The fixed number of buckets of a plan: enough for 64 workers to get one each, and
/// independent of how many run.
pub const BUCKETS: u32 = 64;

/// The plan's format.
const FORMAT: u32 = 1;
/// The folder of the embed plans inside the store's scratch folder, one per run id.
const FOLDER: &str = "embed";
const PLAN_FILE: &str = "plan.json";
const ITEMS_FILE: &str = "items.parquet";
const RESULTS: &str = "results";

/// The bucket of a text's key (its SHA-256, hex): its first four bytes modulo [`BUCKETS`].
pub fn bucket_of(key: &str) -> u32 {
    let head = key.get(..8).and_then(|h| u32::from_str_radix(h, 16).ok());
    head.unwrap_or(0) % BUCKETS
}

/// A plan's record (`plan.json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PlanHeader {
    /// [`FORMAT`].
    pub format: u32,
    /// The stage whose texts the plan holds: `embed` (the nodes' texts) or `connect` (its
    /// ground queries).
    pub stage: String,
    /// The stage's settings the texts depend on (connect: one query per step or per task, and
    /// the retrieval, whose entity setting shapes the dense queries); `null` for embed. A
    /// commit under other settings is refused by the stage.
    #[serde(default)]
    pub settings: serde_json::Value,
    /// The run id the plan is for (`embed@<run id>` in the commits).
    pub run_id: String,
    /// The manifest version the plan read.
    pub version: u64,
    /// The embedding model's name as the pipeline gives it (what a worker loads).
    pub embedder: String,
    /// The pipeline's device, which workers load the model on unless told otherwise (the
    /// vectors of a GPU and of the CPU differ in their last bits: keep one kind per plan).
    pub device: String,
    /// The embedding model's id (stored with every vector).
    pub model: String,
    /// Its dimension.
    pub dim: usize,
    /// [`BUCKETS`] when planned.
    pub buckets: u32,
    /// Nodes in the store, and of them the ones the commit gives a vector.
    pub nodes: usize,
    /// Nodes to embed.
    pub lacking: usize,
    /// Texts to give the model (rows of `items.parquet`).
    pub items: usize,
    /// SHA-256 of `items.parquet`.
    pub items_sha256: String,
    /// The plan's digest: SHA-256 of the fields above, as JSON. Every result row carries it.
    pub digest: String,
}

/// What executing a part of the plan did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ExecuteReport {
    /// Buckets executed.
    pub buckets: usize,
    /// Texts embedded.
    pub items: usize,
    /// Result files written.
    pub files: usize,
}

/// A plan in its folder.
#[derive(Debug, Clone)]
pub struct Plan {
    dir: PathBuf,
    header: PlanHeader,
    /// What planning this one removed of the plans no commit can take ([`sweep_stale`]).
    swept: Swept,
}

/// The plans a sweep ([`sweep_stale`]) removed, and those it could not remove (with why: the
/// sweep is best-effort, and a plan it leaves is still refused by its commit).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Swept {
    /// The folders removed, sorted.
    pub removed: Vec<PathBuf>,
    /// The folders that could not be removed, with the error.
    pub failed: Vec<(PathBuf, String)>,
}

/// The folder of `run_id`'s embed plan in the store at `store`.
pub fn plan_dir(store: &Path, run_id: &str) -> PathBuf {
    stage_plan_dir(store, crate::STAGE, run_id)
}

/// The folder of the plan of `stage`'s texts for `run_id`: `scratch/embed/<run id>` for the
/// embed stage, `scratch/embed/<stage>@<run id>` for another stage's.
pub fn stage_plan_dir(store: &Path, stage: &str, run_id: &str) -> PathBuf {
    let folder = store.join(fluxmem_store::SCRATCH).join(FOLDER);
    match stage == crate::STAGE {
        true => folder.join(run_id),
        false => folder.join(format!("{stage}@{run_id}")),
    }
}

/// The model a plan is for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanModel {
    /// Its name as the pipeline gives it (`all-minilm-l6-v2`, `hash-384`).
    pub name: String,
    /// The pipeline's device.
    pub device: String,
    /// The model's id ([`Embedder::model_id`]).
    pub id: String,
    /// Its dimension.
    pub dim: usize,
}

impl PlanModel {
    /// The model `embedder` loaded from `name` for `device`.
    pub fn of(name: &str, device: &str, embedder: &dyn Embedder) -> PlanModel {
        PlanModel {
            name: name.to_string(),
            device: device.to_string(),
            id: embedder.model_id().to_string(),
            dim: embedder.dim(),
        }
    }
}

/// Plans the embedding of the nodes of `writer`'s store that lack a vector of `model`, for
/// `run_id`. A plan left by an earlier attempt of the run id is replaced (its folder, with its
/// results, is removed: it holds only what this module wrote).
pub fn plan(
    writer: &Writer,
    model: &PlanModel,
    options: &EmbedOptions,
    run_id: &str,
) -> Result<Plan> {
    let (dim, model_id) = (model.dim, model.id.as_str());
    crate::check_model(writer, model_id, dim)?;
    let selection = select(writer, model_id, options)?;
    // Each text once, by key; then the texts a stored vector of the model already holds out.
    let mut texts: BTreeMap<String, String> = BTreeMap::new();
    for nodes in selection.lacking.chunks(window_len(options)) {
        for node in node_rows(writer, nodes)?.into_values() {
            let text = node.embedding_text();
            texts.entry(sha256_hex(text.as_bytes())).or_insert(text);
        }
    }
    writer
        .store()
        .live(writer.manifest(), "embeddings")?
        .embedding_keys(&mut |node, m, hash| {
            // As the commit reads them back: of the model, and not a stale vector it replaces.
            if m == model_id && !selection.stale.contains(node) {
                texts.remove(hash);
            }
        })?;
    let planned = Planned {
        stage: crate::STAGE,
        run_id,
        version: writer.manifest().version,
        nodes: selection.nodes,
        lacking: selection.lacking.len(),
        settings: serde_json::Value::Null,
    };
    plan_texts(writer, &planned, model, &texts)
}

/// What a plan of texts is for.
#[derive(Debug, Clone)]
pub struct Planned<'a> {
    /// The stage that gives the texts to the model.
    pub stage: &'a str,
    /// The run id.
    pub run_id: &'a str,
    /// The manifest version the texts were read at.
    pub version: u64,
    /// The nodes the stage looked at ([`PlanHeader::nodes`]).
    pub nodes: usize,
    /// Those it works on ([`PlanHeader::lacking`]).
    pub lacking: usize,
    /// The stage's settings the texts depend on ([`PlanHeader::settings`]).
    pub settings: serde_json::Value,
}

/// Writes the plan of `texts` (by key, their SHA-256) for `planned`'s stage and run id in
/// `writer`'s store ([`stage_plan_dir`]), replacing a plan an earlier attempt of the run id
/// left (its folder, results included, holds only what this module wrote), then removes the
/// plans no commit can take any more ([`sweep_stale`]).
pub fn plan_texts(
    writer: &Writer,
    planned: &Planned<'_>,
    model: &PlanModel,
    texts: &BTreeMap<String, String>,
) -> Result<Plan> {
    let dir = stage_plan_dir(writer.store().dir(), planned.stage, planned.run_id);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    std::fs::create_dir_all(dir.join(RESULTS)).map_err(io(&dir))?;
    let items_sha256 = write_items(&dir.join(ITEMS_FILE), texts)?;
    let mut header = PlanHeader {
        format: FORMAT,
        stage: planned.stage.to_string(),
        settings: planned.settings.clone(),
        run_id: planned.run_id.to_string(),
        version: planned.version,
        embedder: model.name.clone(),
        device: model.device.clone(),
        model: model.id.clone(),
        dim: model.dim,
        buckets: BUCKETS,
        nodes: planned.nodes,
        lacking: planned.lacking,
        items: texts.len(),
        items_sha256,
        digest: String::new(),
    };
    header.digest = digest(&header);
    let bytes = serde_json::to_vec_pretty(&header).expect("a plan header serialises");
    fluxmem_store::write_atomically(&dir.join(PLAN_FILE), &bytes)?;
    let swept = sweep_stale(writer, &dir);
    Ok(Plan { dir, header, swept })
}

/// Removes the plans in `writer`'s store (but `keep`) that no commit can take any more: those
/// whose store moved since they were made by a commit that is not theirs (a commit refuses such
/// a plan, [`Plan::check_unmoved`], and the store never moves back). Their folders hold only
/// what this module and its workers wrote. A folder without a readable plan record is left
/// alone (nothing proves it is a plan; planning its run id again replaces it). Best-effort: a
/// folder that cannot be removed is listed in [`Swept::failed`]. The writer holds the lock, so
/// no other plan is being written meanwhile.
pub fn sweep_stale(writer: &Writer, keep: &Path) -> Swept {
    let folder = writer
        .store()
        .dir()
        .join(fluxmem_store::SCRATCH)
        .join(FOLDER);
    let Ok(entries) = std::fs::read_dir(&folder) else {
        return Swept::default();
    };
    let mut swept = Swept::default();
    for dir in entries.flatten().map(|e| e.path()) {
        let header = std::fs::read(dir.join(PLAN_FILE))
            .ok()
            .and_then(|bytes| serde_json::from_slice::<PlanHeader>(&bytes).ok());
        let Some(header) = header.filter(|h| digest(h) == h.digest) else {
            continue;
        };
        if dir == keep || foreign_commit(writer.manifest(), &header).is_none() {
            continue;
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => swept.removed.push(dir),
            Err(error) => swept.failed.push((dir, error.to_string())),
        }
    }
    swept.removed.sort();
    swept.failed.sort();
    swept
}

/// The first commit after the plan's version that is not the plan's own (its summary does not
/// carry the plan's digest as `plan`).
fn foreign_commit<'m>(
    manifest: &'m fluxmem_store::Manifest,
    header: &PlanHeader,
) -> Option<&'m fluxmem_store::CommitRecord> {
    manifest
        .commits
        .iter()
        .filter(|c| c.version > header.version)
        .find(|c| c.summary.get("plan").and_then(|p| p.as_str()) != Some(&header.digest))
}

/// The digest of `header` with its `digest` field empty.
fn digest(header: &PlanHeader) -> String {
    let mut header = header.clone();
    header.digest = String::new();
    sha256_hex(&serde_json::to_vec(&header).expect("a plan header serialises"))
}

impl Plan {
    /// The embed plan of `run_id` in the store at `store`, if there is one, checked: its
    /// digest, format and the items file's SHA-256.
    pub fn open(store: &Path, run_id: &str) -> Result<Option<Plan>> {
        Plan::open_for(store, crate::STAGE, run_id)
    }

    /// The plan of `stage`'s texts for `run_id` ([`stage_plan_dir`]), if there is one, checked
    /// as [`Plan::open`] checks it.
    pub fn open_for(store: &Path, stage: &str, run_id: &str) -> Result<Option<Plan>> {
        let dir = stage_plan_dir(store, stage, run_id);
        let path = dir.join(PLAN_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let bytes = std::fs::read(&path).map_err(io(&path))?;
        let header: PlanHeader = serde_json::from_slice(&bytes).map_err(|e| Error::Plan {
            path: path.clone(),
            reason: format!("unreadable: {e}"),
        })?;
        if header.format != FORMAT
            || header.buckets != BUCKETS
            || header.stage != stage
            || digest(&header) != header.digest
        {
            return Err(Error::Plan {
                path,
                reason: format!(
                    "its digest, format, stage or bucket count is not this version's; plan \
                     again (`fluxmem run P --run-id R --stage {stage} --plan`)"
                ),
            });
        }
        let items = dir.join(ITEMS_FILE);
        let bytes = std::fs::read(&items).map_err(io(&items))?;
        if sha256_hex(&bytes) != header.items_sha256 {
            return Err(Error::Plan {
                path: items,
                reason: format!(
                    "its SHA-256 is not the {} that {PLAN_FILE} records; plan again",
                    header.items_sha256
                ),
            });
        }
        Ok(Some(Plan {
            dir,
            header,
            swept: Swept::default(),
        }))
    }

    /// The plan's record.
    pub fn header(&self) -> &PlanHeader {
        &self.header
    }

    /// The plan's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The plan's rows (`bucket`, `key`, `text`) of the buckets `owns` accepts, bucket by
    /// bucket in order: each bucket with its rows, sorted by key.
    pub fn items(&self, owns: &dyn Fn(u32) -> bool) -> Result<Vec<(u32, RecordBatch)>> {
        self.read_items(owns, None)
    }

    /// [`Plan::items`], of the columns `columns` names (all when `None`).
    fn read_items(
        &self,
        owns: &dyn Fn(u32) -> bool,
        columns: Option<&[usize]>,
    ) -> Result<Vec<(u32, RecordBatch)>> {
        let path = self.dir.join(ITEMS_FILE);
        let file = std::fs::File::open(&path).map_err(io(&path))?;
        let metadata =
            ArrowReaderMetadata::load(&file, Default::default()).map_err(parquet(&path))?;
        let mut batches = Vec::new();
        // One row group per bucket, in order: its statistics say which.
        for (i, group) in metadata.metadata().row_groups().iter().enumerate() {
            let bucket = match group.column(0).statistics() {
                Some(parquet::file::statistics::Statistics::Int32(s)) => s.min_opt().copied(),
                _ => None,
            };
            let Some(bucket) = bucket else {
                return Err(Error::Plan {
                    path,
                    reason: format!("row group {i} has no bucket statistics"),
                });
            };
            let bucket = bucket as u32;
            if !owns(bucket) {
                continue;
            }
            let file = file.try_clone().map_err(io(&path))?;
            let mut builder =
                ParquetRecordBatchReaderBuilder::new_with_metadata(file, metadata.clone());
            if let Some(columns) = columns {
                let mask = ProjectionMask::roots(builder.parquet_schema(), columns.iter().copied());
                builder = builder.with_projection(mask);
            }
            let reader = builder
                .with_row_groups(vec![i])
                .with_batch_size(group.num_rows().max(1) as usize)
                .build()
                .map_err(parquet(&path))?;
            for batch in reader {
                let batch = batch.map_err(|e| Error::Plan {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
                batches.push((bucket, batch));
            }
        }
        Ok(batches)
    }

    /// Embeds `items` (rows of [`Plan::items`]: `key` and `text` columns, any subset, in any
    /// order) with `embedder`, `batch_size` texts a call: `plan`, `key`, `vector` rows in the
    /// order given. A text whose SHA-256 is not its key, or another model than the plan's, is
    /// refused.
    pub fn execute(
        &self,
        items: &RecordBatch,
        embedder: &dyn Embedder,
        batch_size: usize,
    ) -> Result<RecordBatch> {
        let column = |name: &str| {
            items
                .column_by_name(name)
                .and_then(|c| c.as_any().downcast_ref::<StringArray>())
                .ok_or_else(|| Error::Plan {
                    path: self.dir.join(ITEMS_FILE),
                    reason: format!("a batch of items without a `{name}` string column"),
                })
        };
        let (keys, texts) = (column("key")?, column("text")?);
        let dim = self.header.dim;
        let rows: Vec<(&str, &str)> = (0..items.num_rows())
            .map(|i| (keys.value(i), texts.value(i)))
            .collect();
        let flat = self.embed_rows(&rows, embedder, batch_size)?;
        let values = Float32Array::from(flat);
        let vectors =
            FixedSizeListArray::try_new(vector_item(), dim as i32, Arc::new(values), None)
                .expect("dim floats a row");
        let plan = StringArray::from(vec![self.header.digest.as_str(); rows.len()]);
        let keys = StringArray::from(rows.iter().map(|(k, _)| *k).collect::<Vec<_>>());
        RecordBatch::try_new(
            results_schema(dim),
            vec![Arc::new(plan), Arc::new(keys), Arc::new(vectors)],
        )
        .map_err(|e| Error::Plan {
            path: self.dir.join(RESULTS),
            reason: e.to_string(),
        })
    }

    /// Embeds `rows` (key and text pairs of the plan's items), `batch_size` texts a call: their
    /// vectors, one after the other (`rows.len() * dim` floats). A text whose SHA-256 is not its
    /// key, or another model than the plan's, is refused. What [`Plan::execute`] and the Python
    /// workers (crates/fluxmem-py) run.
    pub fn embed_rows(
        &self,
        rows: &[(&str, &str)],
        embedder: &dyn Embedder,
        batch_size: usize,
    ) -> Result<Vec<f32>> {
        self.check_embedder(embedder)?;
        for (key, text) in rows {
            if sha256_hex(text.as_bytes()) != *key {
                return Err(Error::Plan {
                    path: self.dir.join(ITEMS_FILE),
                    reason: format!("item {key}: its text does not hash to its key"),
                });
            }
        }
        let dim = self.header.dim;
        let mut flat = Vec::with_capacity(rows.len() * dim);
        for batch in rows.chunks(batch_size.max(1)) {
            let texts: Vec<&str> = batch.iter().map(|(_, text)| *text).collect();
            let out = embedder.embed(&texts)?;
            crate::check_output(&self.header.model, dim, texts.len(), &out)?;
            for vector in out {
                flat.extend_from_slice(&vector);
            }
        }
        Ok(flat)
    }

    /// Writes `results` (of [`Plan::execute`]) to `results/<name>.parquet` in the plan's
    /// folder, atomically (a retry under the same name replaces it).
    pub fn write_results(&self, name: &str, results: &RecordBatch) -> Result<PathBuf> {
        let path = self.dir.join(RESULTS).join(format!("{name}.parquet"));
        fluxmem_store::write_atomically(&path, &parquet_bytes(results, &path)?)?;
        Ok(path)
    }

    /// Executes the buckets `owns` accepts, one result file per bucket named
    /// `b<bucket>-<worker>`, `batch_size` texts per model call.
    pub fn execute_buckets(
        &self,
        embedder: &dyn Embedder,
        owns: &dyn Fn(u32) -> bool,
        batch_size: usize,
        worker: &str,
        progress: &mut dyn Progress,
    ) -> Result<ExecuteReport> {
        let batches = self.items(owns)?;
        let mut report = ExecuteReport::default();
        progress.start(batches.iter().map(|(_, b)| b.num_rows() as u64).sum());
        for (bucket, batch) in batches {
            let results = self.execute(&batch, embedder, batch_size)?;
            self.write_results(&format!("b{bucket:02}-{worker}"), &results)?;
            report.buckets += 1;
            report.items += batch.num_rows();
            report.files += 1;
            progress.advance(batch.num_rows() as u64);
        }
        Ok(report)
    }

    /// Every result of the plan's folder, checked against the plan (see the module docs). The
    /// checked vectors go to a file beside the results as they are read (`.vectors-<pid>.f32`,
    /// removed when the [`PlannedVectors`] is dropped), so the commit holds 36 bytes a text in
    /// memory (its key and where its first vector came from), not the vectors.
    pub fn results(&self) -> Result<PlannedVectors> {
        let mut keys: Vec<[u8; 32]> = Vec::new();
        // The keys only: the texts are most of the file.
        for (_, batch) in self.read_items(&|_| true, Some(&[1]))? {
            let column = batch
                .column_by_name("key")
                .and_then(|c| c.as_any().downcast_ref::<StringArray>())
                .expect("items.parquet's second column is `key`");
            for key in column.iter().flatten() {
                keys.push(key_bytes(key).ok_or_else(|| Error::Plan {
                    path: self.dir.join(ITEMS_FILE),
                    reason: format!("key {key} is not a SHA-256"),
                })?);
            }
        }
        keys.sort_unstable();
        keys.dedup();
        let folder = self.dir.join(RESULTS);
        let mut table = VectorTable::create(&folder, keys, self.header.dim)?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(&folder)
            .map_err(io(&folder))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
            .collect();
        files.sort();
        for index in 0..files.len() {
            self.read_results(&files, index, &mut table)?;
        }
        let missing: Vec<&[u8; 32]> = table.missing().collect();
        if let Some(first) = missing.first() {
            let mut buckets: Vec<u32> = missing.iter().map(|k| bucket_of(&hex(&k[..4]))).collect();
            buckets.sort_unstable();
            buckets.dedup();
            return Err(Error::Plan {
                path: folder,
                reason: format!(
                    "{} of the {} planned texts have no vector (first: {}; buckets {buckets:?}): \
                     execute the shards that own them, then commit again",
                    missing.len(),
                    table.keys.len(),
                    hex(*first)
                ),
            });
        }
        Ok(PlannedVectors {
            model: self.header.model.clone(),
            dim: self.header.dim,
            table,
        })
    }

    /// Reads one result file into `table` (each key's vector, and the file that gave it first).
    fn read_results(&self, files: &[PathBuf], index: usize, table: &mut VectorTable) -> Result<()> {
        let path = files[index].as_path();
        let refuse = |reason: String| Error::Plan {
            path: path.to_path_buf(),
            reason,
        };
        let file = std::fs::File::open(path).map_err(io(path))?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(file)
            .and_then(|b| b.build())
            .map_err(parquet(path))?;
        let mut first_row = 0;
        for batch in reader {
            let batch = batch.map_err(|e| refuse(e.to_string()))?;
            let strings = |name: &str| {
                batch
                    .column_by_name(name)
                    .and_then(|c| c.as_any().downcast_ref::<StringArray>().cloned())
                    .ok_or_else(|| refuse(format!("no `{name}` string column")))
            };
            let (plans, keys) = (strings("plan")?, strings("key")?);
            let vectors = batch
                .column_by_name("vector")
                .and_then(|c| c.as_any().downcast_ref::<FixedSizeListArray>().cloned())
                .ok_or_else(|| refuse("no `vector` column of fixed-size lists".into()))?;
            if vectors.value_length() as usize != self.header.dim {
                return Err(refuse(format!(
                    "vectors of {} floats, the plan's model `{}` has {}",
                    vectors.value_length(),
                    self.header.model,
                    self.header.dim
                )));
            }
            let values = vectors
                .values()
                .as_any()
                .downcast_ref::<Float32Array>()
                .ok_or_else(|| refuse("vectors that are not 32-bit floats".into()))?;
            for i in 0..batch.num_rows() {
                let (row, key) = (first_row + i, keys.value(i));
                if keys.is_null(i) || vectors.is_null(i) {
                    return Err(refuse(format!("row {row}: a null key or vector")));
                }
                if plans.is_null(i) || plans.value(i) != self.header.digest {
                    return Err(refuse(format!(
                        "row {row} (key {key}) is of plan `{}`, not this plan `{}`: a result \
                         of an earlier plan of the run id; delete the file or execute again",
                        if plans.is_null(i) { "" } else { plans.value(i) },
                        self.header.digest
                    )));
                }
                let at = vectors.value_offset_at(i);
                let vector = &values.values()[at..at + self.header.dim];
                let Some(position) = key_bytes(key).and_then(|k| table.position(&k)) else {
                    return Err(refuse(format!(
                        "row {row}: key {key} is not in the plan (a tampered or foreign result)"
                    )));
                };
                if let Some(first) = table.put(position, index, vector)? {
                    return Err(refuse(format!(
                        "row {row}: key {key} has another vector in {}: the model is not \
                         deterministic (or a result was altered)",
                        files[first].display()
                    )));
                }
            }
            first_row += batch.num_rows();
        }
        Ok(())
    }

    /// Commits `vectors` (the plan's results, [`Plan::results`]) to `writer`'s store: the
    /// nodes the plan selected get their vectors, in the commits an in-process run makes.
    /// Refused when the store moved since the plan (but by this plan's own commits: a commit
    /// that was killed resumes).
    pub fn commit(
        &self,
        writer: &mut Writer,
        vectors: &dyn Embedder,
        options: &EmbedOptions,
        progress: &mut dyn Progress,
    ) -> Result<EmbedReport> {
        self.check_unmoved(writer.manifest())?;
        crate::check_model(writer, &self.header.model, self.header.dim)?;
        let run_id = format!("{FOLDER}@{}", self.header.run_id);
        embed_selected(
            writer,
            vectors,
            options,
            &run_id,
            Some(&self.header.digest),
            progress,
        )
    }

    /// Refuses a store that moved since the plan read it, but by this plan's own commits
    /// (their summaries carry its digest as `plan`: a commit that was killed resumes).
    pub fn check_unmoved(&self, manifest: &fluxmem_store::Manifest) -> Result<()> {
        let foreign = foreign_commit(manifest, &self.header);
        if manifest.version < self.header.version || foreign.is_some() {
            return Err(Error::Plan {
                path: self.dir.join(PLAN_FILE),
                reason: format!(
                    "the plan read version {} of the store, which is now at version {}{}: plan \
                     again",
                    self.header.version,
                    manifest.version,
                    foreign
                        .map(|c| format!(" (commit {} by `{}`)", c.version, c.stage))
                        .unwrap_or_default()
                ),
            });
        }
        Ok(())
    }

    /// What planning this one removed of the stale plans ([`sweep_stale`]).
    pub fn swept(&self) -> &Swept {
        &self.swept
    }

    /// Removes the plan's folder (after its commit).
    pub fn remove(self) -> Result<()> {
        std::fs::remove_dir_all(&self.dir).map_err(io(&self.dir))
    }

    fn check_embedder(&self, embedder: &dyn Embedder) -> Result<()> {
        if embedder.model_id() != self.header.model || embedder.dim() != self.header.dim {
            return Err(Error::Plan {
                path: self.dir.join(PLAN_FILE),
                reason: format!(
                    "the plan is for `{}` ({} dims), this worker runs `{}` ({} dims): run the \
                     plan's model, or plan again",
                    self.header.model,
                    self.header.dim,
                    embedder.model_id(),
                    embedder.dim()
                ),
            });
        }
        Ok(())
    }
}

/// The vectors a plan's workers made, by text key: an [`Embedder`] that looks them up, which
/// the commit runs the embed stage with. The vectors stay in a file ([`Plan::results`]).
#[derive(Debug)]
pub struct PlannedVectors {
    model: String,
    dim: usize,
    table: VectorTable,
}

impl PlannedVectors {
    /// Texts with a vector.
    pub fn len(&self) -> usize {
        self.table.keys.len()
    }

    /// True when the plan had no text to embed.
    pub fn is_empty(&self) -> bool {
        self.table.keys.is_empty()
    }
}

impl Embedder for PlannedVectors {
    fn model_id(&self) -> &str {
        &self.model
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn embed(&self, texts: &[&str]) -> fluxmem_models::Result<Vec<Vec<f32>>> {
        texts
            .iter()
            .map(|text| {
                let key: [u8; 32] = Sha256::digest(text.as_bytes()).into();
                let unknown = || fluxmem_models::Error::Format {
                    path: self.table.path.clone(),
                    reason: format!("no planned vector for the text of key {}", hex(&key)),
                };
                let position = self.table.position(&key).ok_or_else(unknown)?;
                self.table
                    .get(position)
                    .map_err(|source| fluxmem_models::Error::Io {
                        path: self.table.path.clone(),
                        source,
                    })
            })
            .collect()
    }

    fn count_tokens(&self, _: &str) -> fluxmem_models::Result<usize> {
        Err(fluxmem_models::Error::Unsupported {
            model: self.model.clone(),
            reason: "a plan's vectors count no tokens (run the model)".into(),
        })
    }
}

/// The checked vectors of a plan's commit, by key: the keys sorted in memory, the vectors in a
/// file of `dim` little-endian floats a key, in key order, removed on drop.
#[derive(Debug)]
struct VectorTable {
    keys: Vec<[u8; 32]>,
    /// For each key, 1 + the index of the result file its first vector came from (0: none yet).
    first: Vec<u32>,
    dim: usize,
    path: PathBuf,
    file: std::sync::Mutex<std::fs::File>,
}

impl VectorTable {
    /// A table of `keys` (sorted, distinct) in a new file in `folder`.
    fn create(folder: &Path, keys: Vec<[u8; 32]>, dim: usize) -> Result<VectorTable> {
        let path = folder.join(format!(".vectors-{}.f32", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io(&path))?;
        Ok(VectorTable {
            first: vec![0; keys.len()],
            keys,
            dim,
            file: std::sync::Mutex::new(file),
            path,
        })
    }

    /// The position of `key` in the table.
    fn position(&self, key: &[u8; 32]) -> Option<usize> {
        self.keys.binary_search(key).ok()
    }

    /// Stores the vector of result file `file` for the key at `position`: `Some(first file)`
    /// when the key already has another vector (bit for bit), `None` when it is stored or the
    /// same.
    fn put(&mut self, position: usize, file: usize, vector: &[f32]) -> Result<Option<usize>> {
        if self.first[position] > 0 {
            let seen = self.get(position).map_err(io(&self.path))?;
            let same = seen
                .iter()
                .map(|x| x.to_bits())
                .eq(vector.iter().map(|x| x.to_bits()));
            return Ok((!same).then_some(self.first[position] as usize - 1));
        }
        let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut handle = self.file.lock().unwrap_or_else(|p| p.into_inner());
        handle
            .seek(SeekFrom::Start(self.offset(position)))
            .and_then(|_| handle.write_all(&bytes))
            .map_err(io(&self.path))?;
        self.first[position] = file as u32 + 1;
        Ok(None)
    }

    /// The vector stored at `position`.
    fn get(&self, position: usize) -> std::io::Result<Vec<f32>> {
        let mut bytes = vec![0u8; self.dim * 4];
        let mut handle = self.file.lock().unwrap_or_else(|p| p.into_inner());
        handle.seek(SeekFrom::Start(self.offset(position)))?;
        handle.read_exact(&mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// The keys with no vector, in key order.
    fn missing(&self) -> impl Iterator<Item = &[u8; 32]> {
        self.keys
            .iter()
            .zip(&self.first)
            .filter(|(_, first)| **first == 0)
            .map(|(key, _)| key)
    }

    fn offset(&self, position: usize) -> u64 {
        (position * self.dim * 4) as u64
    }
}

impl Drop for VectorTable {
    fn drop(&mut self) {
        // Scratch of this process's commit; a failed removal leaves a file the plan's removal
        // (or the next sweep) takes with its folder.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A key's 32 bytes from its 64 lowercase hex digits, as [`sha256_hex`] writes it (`None` for
/// anything else).
fn key_bytes(key: &str) -> Option<[u8; 32]> {
    let lower_hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
    if key.len() != 64 || !key.bytes().all(lower_hex) {
        return None;
    }
    let mut bytes = [0u8; 32];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(key.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(bytes)
}

/// Lowercase hex, as [`sha256_hex`] writes keys.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn vector_item() -> Arc<Field> {
    Arc::new(Field::new("item", DataType::Float32, false))
}

fn results_schema(dim: usize) -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("plan", DataType::Utf8, false),
        Field::new("key", DataType::Utf8, false),
        Field::new(
            "vector",
            DataType::FixedSizeList(vector_item(), dim as i32),
            false,
        ),
    ]))
}

/// Writes the items (`texts` by key) sorted by bucket then key, one row group per bucket;
/// returns the file's SHA-256.
fn write_items(path: &Path, texts: &BTreeMap<String, String>) -> Result<String> {
    let mut by_bucket: BTreeMap<u32, Vec<(&str, &str)>> = BTreeMap::new();
    for (key, text) in texts {
        by_bucket
            .entry(bucket_of(key))
            .or_default()
            .push((key, text));
    }
    let schema = Arc::new(Schema::new(vec![
        Field::new("bucket", DataType::UInt32, false),
        Field::new("key", DataType::Utf8, false),
        Field::new("text", DataType::Utf8, false),
    ]));
    let mut bytes = Vec::new();
    let mut writer = ArrowWriter::try_new(&mut bytes, schema.clone(), Some(properties()))
        .map_err(parquet(path))?;
    for (bucket, rows) in by_bucket {
        let mut keys = StringBuilder::new();
        let mut texts = StringBuilder::new();
        for (key, text) in &rows {
            keys.append_value(key);
            texts.append_value(text);
        }
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(UInt32Array::from(vec![bucket; rows.len()])),
                Arc::new(keys.finish()),
                Arc::new(texts.finish()),
            ],
        )
        .expect("columns match the schema");
        writer.write(&batch).map_err(parquet(path))?;
        writer.flush().map_err(parquet(path))?;
    }
    writer.close().map_err(parquet(path))?;
    fluxmem_store::write_atomically(path, &bytes)?;
    Ok(sha256_hex(&bytes))
}

fn properties() -> WriterProperties {
    WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .set_max_row_group_row_count(None)
        .build()
}

fn parquet_bytes(batch: &RecordBatch, path: &Path) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    let mut writer = ArrowWriter::try_new(&mut bytes, batch.schema(), Some(properties()))
        .map_err(parquet(path))?;
    writer.write(batch).map_err(parquet(path))?;
    writer.close().map_err(parquet(path))?;
    Ok(bytes)
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn parquet(path: &Path) -> impl Fn(parquet::errors::ParquetError) -> Error + '_ {
    move |e| Error::Plan {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}
