//! The embed stage: gives every node a vector from the configured [`Embedder`].
//!
//! - Only nodes without an embedding for the model are embedded, in a deterministic order (by
//!   id), committed every [`EmbedOptions::commit_every`] nodes: an interrupted run keeps what it
//!   committed and a re-run does only the rest.
//! - An embedding cache keyed by (model, SHA-256 of the text): a node whose text was already
//!   embedded by the model (another node, an earlier version) reuses that vector.
//! - A store never mixes models: another model or dimension is [`Error::ModelMismatch`], unless
//!   [`EmbedOptions::reembed`] migrates the whole store (one commit replacing every embedding).
//!
//! ```
//! use fluxmem_embed::{embed_store, EmbedOptions, NoProgress};
//! use fluxmem_models::HashEmbedder;
//! let dir = tempfile::tempdir().unwrap();
//! let mut writer = fluxmem_store::Writer::open(dir.path()).unwrap();
//! let report = embed_store(&mut writer, &HashEmbedder::new(16), &EmbedOptions::default(), "run", &mut NoProgress).unwrap();
//! assert_eq!(report.embedded, 0);
//! ```

pub mod plan;

use fluxmem_graph::{sha256_hex, Embedding, Graph, NodeId};
use fluxmem_models::Embedder;
use fluxmem_store::{CommitInfo, Rows, Scan, Shard, Writer};
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// The stage's name (in commits, run records and `--stage`).
pub const STAGE: &str = "embed";

/// Errors of the embed stage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] fluxmem_store::Error),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] fluxmem_models::Error),
    /// The store holds embeddings of another model.
    #[error(
        "the store holds embeddings of `{store_model}` ({store_dim} dims), not `{model}` ({dim} dims); \
         run `fluxmem embed --reembed` to migrate it to `{model}`"
    )]
    ModelMismatch {
        /// The store's model.
        store_model: String,
        /// Its dimension.
        store_dim: usize,
        /// The configured model.
        model: String,
        /// Its dimension.
        dim: usize,
    },
    /// A plan of the three-step embed (see [`plan`]) or one of its results is refused.
    #[error("{path}: {reason}")]
    Plan {
        /// The plan's or the result's file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// Reading or writing a plan's file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: std::path::PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The embedder returned a vector of the wrong size or count (a bug in the embedder).
    #[error("embedder `{model}` returned {got}, expected {expected}")]
    BadOutput {
        /// The model.
        model: String,
        /// What came back.
        got: String,
        /// What was expected.
        expected: String,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How to embed.
#[derive(Debug, Clone)]
pub struct EmbedOptions {
    /// Texts per embedder call.
    pub batch_size: usize,
    /// Commit after this many newly embedded nodes.
    pub commit_every: usize,
    /// Replace every embedding of the store with the configured model's.
    pub reembed: bool,
    /// The nodes this run owns (sharded runs, by node id); [`Shard::ALL`] by default.
    pub shard: Shard,
    /// Nodes to embed read and held at once (their rows, texts and vectors), rounded up to a
    /// multiple of `commit_every`: this bounds what the stage holds of the night's nodes (of
    /// the history it keeps a 16-byte digest per stored embedding while it finds the nodes to
    /// embed, and a live flag per stored embedding row). Texts repeated from the history or
    /// from an earlier window are read back from the store, not kept. Not used by `reembed`.
    pub window: usize,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        EmbedOptions {
            batch_size: 256,
            commit_every: 2048,
            reembed: false,
            shard: Shard::ALL,
            window: 16384,
        }
    }
}

/// What the stage did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct EmbedReport {
    /// Nodes in the store.
    pub nodes: usize,
    /// Nodes that already had an embedding of this model (in a sharded run, also the nodes of
    /// other shards).
    pub already: usize,
    /// Nodes embedded by running the model.
    pub embedded: usize,
    /// Nodes whose vector came from the text-hash cache.
    pub cached: usize,
    /// Of the nodes embedded (by the model or the cache): episodes that grew since their vector
    /// was made (a conversation logged again, longer: ingest's `episode_grown` edits), whose
    /// stale vector was replaced.
    pub changed: usize,
    /// Commits made.
    pub commits: usize,
}

/// Progress callbacks.
pub use fluxmem_graph::{NoProgress, Progress};

/// Embeds every node of the store that lacks a vector for `embedder`'s model.
pub fn embed_store(
    writer: &mut Writer,
    embedder: &dyn Embedder,
    options: &EmbedOptions,
    run_id: &str,
    progress: &mut dyn Progress,
) -> Result<EmbedReport> {
    if options.reembed {
        return reembed(writer, embedder, options, run_id, progress);
    }
    check_model(writer, embedder.model_id(), embedder.dim())?;
    embed_selected(writer, embedder, options, run_id, None, progress)
}

/// Refuses `model` (`dim` floats) for a store that holds another model's vectors.
fn check_model(writer: &Writer, model: &str, dim: usize) -> Result<()> {
    match writer.manifest().embedding_model.clone() {
        Some(stored) if stored.id != model || stored.dim != dim => Err(Error::ModelMismatch {
            store_model: stored.id,
            store_dim: stored.dim,
            model: model.to_string(),
            dim,
        }),
        _ => Ok(()),
    }
}

/// The nodes a run embeds: those of its shard without a vector of the model, and the grown
/// episodes whose vector is stale, in id order.
struct Selection {
    /// Nodes in the store.
    nodes: usize,
    /// The nodes to embed, sorted by id (windows and commit boundaries depend only on the data).
    lacking: Vec<NodeId>,
    /// Of them, the grown episodes whose stored vector is of an older text.
    stale: BTreeSet<NodeId>,
}

/// Finds the nodes to embed. Only what that needs is read: the live node ids and the
/// embeddings' keys (the nodes with a vector of the model are kept as 16-byte digests of
/// their ids, not the ids).
fn select(writer: &Writer, model: &str, options: &EmbedOptions) -> Result<Selection> {
    let manifest = writer.manifest();
    let reader = writer.store();
    let mut embedded: HashSet<[u8; 16], Fast> = HashSet::default();
    // Episodes that grew after they were embedded may hold a stale vector: their stored hashes.
    let grown: BTreeSet<NodeId> = reader
        .edited_nodes(manifest, fluxmem_graph::EPISODE_GROWN)?
        .into_iter()
        .collect();
    let mut grown_hashes: BTreeMap<NodeId, String> = BTreeMap::new();
    reader
        .live(manifest, "embeddings")?
        .embedding_keys(&mut |node, m, hash| {
            if m == model {
                embedded.insert(digest(node));
                if let Some(id) = grown.get(node) {
                    grown_hashes.insert(id.clone(), hash.to_string());
                }
            }
        })?;
    let mut nodes = 0usize;
    let mut lacking: Vec<NodeId> = Vec::new();
    reader.live(manifest, "nodes")?.ids(&mut |id| {
        nodes += 1;
        if !embedded.contains(&digest(id)) && options.shard.owns(id) {
            lacking.push(NodeId(id.to_string()));
        }
    })?;
    drop(embedded);
    let stale = stale_vectors(writer, grown_hashes, options)?;
    lacking.extend(stale.iter().cloned());
    lacking.sort_unstable();
    Ok(Selection {
        nodes,
        lacking,
        stale,
    })
}

/// The windows of `lacking` a run reads and holds at once: `options.window` nodes rounded up
/// to a multiple of `commit_every`.
fn window_len(options: &EmbedOptions) -> usize {
    options
        .window
        .max(1)
        .checked_next_multiple_of(options.commit_every.max(1))
        .unwrap_or(usize::MAX)
}

/// The rows of `nodes` (their steps included: an episode's text is its steps').
fn node_rows(writer: &Writer, nodes: &[NodeId]) -> Result<BTreeMap<NodeId, fluxmem_graph::Node>> {
    let of: BTreeSet<NodeId> = nodes.iter().cloned().collect();
    let scan = Scan {
        nodes: true,
        nodes_of: Some(of.clone()),
        steps: Rows::Of(of),
        ..Default::default()
    };
    Ok(writer.store().scan_at(writer.manifest(), &scan)?.nodes)
}

/// Embeds the nodes [`select`] finds, a window at a time, committing every `commit_every`
/// (each commit's summary names `plan`, when a plan's vectors are committed).
fn embed_selected(
    writer: &mut Writer,
    embedder: &dyn Embedder,
    options: &EmbedOptions,
    run_id: &str,
    plan: Option<&str>,
    progress: &mut dyn Progress,
) -> Result<EmbedReport> {
    let model = embedder.model_id().to_string();
    let dim = embedder.dim();
    // A reader of the store as the run found it (this run's commits append shards; no listed
    // shard is removed).
    let manifest = writer.manifest().clone();
    let stored = writer.store().clone();
    let stored = stored.live(&manifest, "embeddings")?;
    let Selection {
        nodes,
        lacking,
        stale,
    } = select(writer, &model, options)?;
    // The node holding each text's vector, for texts a node to embed repeats: of the stored
    // ones (at the run's start) the highest id, found window by window in the stored keys;
    // else the first node this run embedded it for (`ran`: what this run holds follows the
    // night).
    let mut ran: BTreeMap<String, NodeId> = BTreeMap::new();
    let mut report = EmbedReport {
        nodes,
        already: nodes - lacking.len(),
        ..EmbedReport::default()
    };
    progress.start(lacking.len() as u64);
    let commit_every = options.commit_every.max(1);
    for nodes in lacking.chunks(window_len(options)) {
        let rows = node_rows(writer, nodes)?;
        // The vectors' shards then name their tenants.
        writer.know_tenants(rows.values().map(|n| (&n.id, n.tenant.as_str())));
        let todo: Vec<(NodeId, String)> = nodes
            .iter()
            .map(|id| (id.clone(), rows[id].embedding_text()))
            .collect();
        drop(rows);
        // The vectors of stored texts that a node to embed repeats, read by their node.
        let hashes: BTreeSet<String> = todo
            .iter()
            .map(|(_, text)| sha256_hex(text.as_bytes()))
            .collect();
        let mut holder: BTreeMap<&str, String> = BTreeMap::new();
        stored.embedding_keys(&mut |node, m, hash| {
            // A stale vector (of a grown episode) is no holder: this run may replace it before
            // the holder's vector is read back.
            if m != model || stale.contains(node) {
                return;
            }
            let Some(hash) = hashes.get(hash) else { return };
            match holder.get_mut(hash.as_str()) {
                Some(h) if h.as_str() >= node => {}
                Some(h) => *h = node.to_string(),
                None => {
                    holder.insert(hash.as_str(), node.to_string());
                }
            }
        })?;
        let holders: BTreeSet<NodeId> = hashes
            .iter()
            .filter_map(|h| {
                holder
                    .get(h.as_str())
                    .map(|n| NodeId(n.clone()))
                    .or_else(|| ran.get(h).cloned())
            })
            .collect();
        drop(holder);
        let mut cache: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        if !holders.is_empty() {
            let stored = writer.store().scan_at(
                writer.manifest(),
                &Scan {
                    vectors: Rows::Of(holders),
                    ..Default::default()
                },
            )?;
            for embedding in stored
                .embeddings
                .into_values()
                .filter(|e| e.model_id == model)
            {
                cache.insert(embedding.text_sha256, embedding.vector);
            }
        }
        for chunk in todo.chunks(commit_every) {
            let delta = embed_chunk(
                embedder,
                options,
                &model,
                dim,
                chunk,
                &mut cache,
                &mut report,
                progress,
            )?;
            if !delta.is_empty() {
                // Vectors only for nodes without one (of this model, the store's only one): new
                // keys; a chunk with a grown episode's vector replaces its stale one.
                let replaces = chunk.iter().filter(|(id, _)| stale.contains(id)).count();
                report.changed += replaces;
                if replaces > 0 {
                    writer.commit(&delta, commit_info(run_id, &report, &model, plan))?;
                } else {
                    writer.commit_new(&delta, commit_info(run_id, &report, &model, plan))?;
                }
                report.commits += 1;
                for embedding in delta.embeddings.into_values() {
                    ran.entry(embedding.text_sha256)
                        .or_insert(embedding.node_id);
                }
            }
        }
    }
    Ok(report)
}

/// Of the grown episodes with a vector (`stored`: their vectors' text hashes), this shard's
/// whose text now hashes otherwise: their vectors are stale.
fn stale_vectors(
    writer: &Writer,
    stored: BTreeMap<NodeId, String>,
    options: &EmbedOptions,
) -> Result<BTreeSet<NodeId>> {
    let ids: BTreeSet<NodeId> = stored
        .keys()
        .filter(|id| options.shard.owns(id.as_str()))
        .cloned()
        .collect();
    if ids.is_empty() {
        return Ok(BTreeSet::new());
    }
    let nodes = writer
        .store()
        .scan_at(
            writer.manifest(),
            &Scan {
                nodes: true,
                nodes_of: Some(ids.clone()),
                steps: Rows::Of(ids),
                ..Default::default()
            },
        )?
        .nodes;
    Ok(nodes
        .values()
        .filter(|n| stored.get(&n.id) != Some(&sha256_hex(n.embedding_text().as_bytes())))
        .map(|n| n.id.clone())
        .collect())
}

/// The digest set's hash (the keys are digests already): fast, seeded fixed.
type Fast = foldhash::fast::FixedState;

/// A 16-byte digest of a node id: the first 16 bytes of its SHA-256, as the store's row keys
/// (a node to embed taken for embedded would need a collision of 128-bit SHA-256 prefixes).
fn digest(id: &str) -> [u8; 16] {
    use sha2::Digest;
    sha2::Sha256::digest(id.as_bytes())[..16]
        .try_into()
        .expect("16 bytes")
}

/// Embeds `chunk` (node ids with their texts): each text not in `cache` once (the first node
/// with the text owns it), the others from `cache`. Returns the chunk's embeddings.
#[allow(clippy::too_many_arguments)]
fn embed_chunk(
    embedder: &dyn Embedder,
    options: &EmbedOptions,
    model: &str,
    dim: usize,
    chunk: &[(NodeId, String)],
    cache: &mut BTreeMap<String, Vec<f32>>,
    report: &mut EmbedReport,
    progress: &mut dyn Progress,
) -> Result<Graph> {
    let mut delta = Graph::default();
    let mut missing: Vec<(&str, String)> = Vec::new();
    let mut pending: BTreeSet<String> = BTreeSet::new();
    let mut waiting: Vec<(&NodeId, String)> = Vec::new();
    for (id, text) in chunk {
        let hash = sha256_hex(text.as_bytes());
        if cache.contains_key(&hash) || !pending.insert(hash.clone()) {
            report.cached += 1;
        } else {
            missing.push((text.as_str(), hash.clone()));
            report.embedded += 1;
        }
        waiting.push((id, hash));
    }
    for batch in missing.chunks(options.batch_size.max(1)) {
        let texts: Vec<&str> = batch.iter().map(|(text, _)| *text).collect();
        let vectors = embedder.embed(&texts)?;
        check_output(model, dim, texts.len(), &vectors)?;
        for ((_, hash), vector) in batch.iter().zip(vectors) {
            cache.insert(hash.clone(), vector);
        }
        progress.advance(batch.len() as u64);
    }
    progress.advance((chunk.len() - missing.len()) as u64);
    for (id, hash) in waiting {
        let vector = cache
            .get(&hash)
            .expect("every waiting text was embedded or cached")
            .clone();
        delta.upsert_embedding(Embedding {
            node_id: id.clone(),
            model_id: model.to_string(),
            text_sha256: hash,
            vector,
        });
    }
    Ok(delta)
}

/// Replaces every embedding of the store with `embedder`'s, in one commit (the whole graph is
/// read and rewritten; other models' vectors are dropped, this model's kept).
fn reembed(
    writer: &mut Writer,
    embedder: &dyn Embedder,
    options: &EmbedOptions,
    run_id: &str,
    progress: &mut dyn Progress,
) -> Result<EmbedReport> {
    let model = embedder.model_id().to_string();
    let dim = embedder.dim();
    let mut graph = writer.store().load()?;
    graph.embeddings.retain(|(_, m), _| m == &model);
    let lacking: Vec<NodeId> = graph
        .nodes
        .keys()
        .filter(|id| {
            !graph
                .embeddings
                .contains_key(&((*id).clone(), model.clone()))
        })
        .filter(|id| options.shard.owns(id.as_str()))
        .cloned()
        .collect();
    let mut report = EmbedReport {
        nodes: graph.nodes.len(),
        already: graph.nodes.len() - lacking.len(),
        ..EmbedReport::default()
    };
    let todo: Vec<(NodeId, String)> = lacking
        .iter()
        .map(|id| (id.clone(), graph.nodes[id].embedding_text()))
        .collect();
    let mut cache: BTreeMap<String, Vec<f32>> = graph
        .embeddings
        .values()
        .map(|e| (e.text_sha256.clone(), e.vector.clone()))
        .collect();
    progress.start(todo.len() as u64);
    let mut fresh = Graph::default();
    for chunk in todo.chunks(options.commit_every.max(1)) {
        fresh.apply(embed_chunk(
            embedder,
            options,
            &model,
            dim,
            chunk,
            &mut cache,
            &mut report,
            progress,
        )?);
    }
    graph.apply(fresh);
    writer.replace(&graph, commit_info(run_id, &report, &model, None))?;
    report.commits += 1;
    Ok(report)
}

fn commit_info(run_id: &str, report: &EmbedReport, model: &str, plan: Option<&str>) -> CommitInfo {
    let mut summary =
        serde_json::json!({ "model": model, "embedded": report.embedded, "cached": report.cached });
    if let Some(plan) = plan {
        summary["plan"] = plan.into();
    }
    CommitInfo {
        stage: "embed".into(),
        run_id: run_id.into(),
        summary,
        progress: Default::default(),
    }
}

fn check_output(model: &str, dim: usize, count: usize, vectors: &[Vec<f32>]) -> Result<()> {
    let bad = |got: String, expected: String| Error::BadOutput {
        model: model.into(),
        got,
        expected,
    };
    if vectors.len() != count {
        return Err(bad(
            format!("{} vectors", vectors.len()),
            format!("{count}"),
        ));
    }
    match vectors.iter().find(|v| v.len() != dim) {
        Some(v) => Err(bad(
            format!("a vector of {} floats", v.len()),
            format!("{dim}"),
        )),
        None => Ok(()),
    }
}
