//! The `connect` stage: Stage I run in batch over logged episodes, written as edges.
//!
//! For every episode not yet connected (no `ground` edge into it and no Stage I `link` edge out
//! of it, i.e. one without a Stage II `relation`), each step's observation (or, with `per_step = false`, the task) is a
//! query to the semantic retrieval; the `ground_k` best semantic nodes per query get a `ground`
//! edge to the episode (evidence = how many queries retrieved it, weight = the best fused
//! score). Each episode also gets `link` edges to its `link_k` nearest episodes by cosine
//! (exact kNN in blocks). Edges are committed every `commit_every` episodes.

use candle_core::Device;
use fluxmem_graph::{Edge, EdgeKind, Graph, NodeId, NodeKind};
use fluxmem_models::Embedder;

use fluxmem_store::{CommitInfo, Shard, Writer};
use std::collections::{BTreeMap, BTreeSet};

use crate::dense::{embedded, top_k, DenseIndex};
use crate::retrieve::{RetrievalConfig, SemanticIndex};
use crate::Result;

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// One query per step (the paper) or one per task.
    pub per_step: bool,
    /// Ground edges per query.
    pub ground_k: usize,
    /// Link edges per episode.
    pub link_k: usize,
    /// Commit after this many episodes.
    pub commit_every: usize,
    /// Stage I settings.
    pub retrieval: RetrievalConfig,
    /// The episodes this run connects (sharded runs, by episode id); all by default.
    pub shard: Shard,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            per_step: true,
            ground_k: 2,
            link_k: 5,
            commit_every: 500,
            retrieval: RetrievalConfig::default(),
            shard: Shard::ALL,
        }
    }
}

/// What the stage did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ConnectReport {
    /// Episodes in the store.
    pub episodes: usize,
    /// Episodes connected by this run.
    pub connected: usize,
    /// Episodes connected by an earlier run (in a sharded run, also those of other shards).
    pub already: usize,
    /// Ground edges written.
    pub ground_edges: usize,
    /// Link edges written.
    pub link_edges: usize,
    /// Commits made.
    pub commits: usize,
}

/// Progress callbacks of a stage that works through countable items (episodes to connect;
/// Stage II's edges to assess).
pub trait Progress {
    /// `total` items to do.
    fn start(&mut self, _total: u64) {}
    /// `done` more are done.
    fn advance(&mut self, _done: u64) {}
}

/// A [`Progress`] that shows nothing.
pub struct NoProgress;
impl Progress for NoProgress {}

/// Connects every episode of the store that is not connected yet.
pub fn connect_store(
    writer: &mut Writer,
    embedder: &dyn Embedder,
    options: &ConnectOptions,
    run_id: &str,
    device: &Device,
    progress: &mut dyn Progress,
) -> Result<ConnectReport> {
    let graph = writer.store().load()?;
    let model = embedder.model_id();
    let semantic = SemanticIndex::build(&graph, model, device)?;
    let (episodes, vectors) = embedded(&graph, NodeKind::Episodic, model)?;
    let episode_index = DenseIndex::from_vectors(&vectors, device)?;
    let connected: BTreeSet<&NodeId> = graph
        .edges
        .values()
        // Stage I edges, whoever updated them last (credit assignment re-weights them); links
        // with a `relation` come from Stage II and do not make an episode connected.
        .filter(|e| !e.metadata.contains_key("relation"))
        .flat_map(|e| match e.kind {
            EdgeKind::Ground => Some(&e.dst),
            EdgeKind::Link => Some(&e.src),
            EdgeKind::Distill => None,
        })
        .collect();
    let todo: Vec<usize> =
        (0..episodes.len()).filter(|&i| !connected.contains(&episodes[i]) && options.shard.owns(episodes[i].as_str())).collect();
    let mut report = ConnectReport { episodes: episodes.len(), already: episodes.len() - todo.len(), ..Default::default() };
    progress.start(todo.len() as u64);
    for chunk in todo.chunks(options.commit_every.max(1)) {
        let mut delta = Graph::default();
        let chunk_vectors: Vec<Vec<f32>> = chunk.iter().map(|&i| vectors[i].clone()).collect();
        // All the chunk's step queries in one embedder call (sorted by length inside).
        let queries: Vec<Vec<&str>> = chunk.iter().map(|&i| ground_queries(&graph, &episodes[i], options.per_step)).collect();
        let flat: Vec<&str> = queries.iter().flatten().copied().collect();
        let mut flat_vectors = embedder.embed(&flat)?.into_iter();
        // k + 1 neighbours: the episode itself comes back first.
        let neighbours = episode_index.scores(&chunk_vectors)?;
        for ((&i, scores), episode_queries) in chunk.iter().zip(neighbours).zip(&queries) {
            let query_vectors: Vec<Vec<f32>> = flat_vectors.by_ref().take(episode_queries.len()).collect();
            let episode = &episodes[i];
            for (j, cosine) in top_k(&scores, options.link_k + 1).into_iter().filter(|(j, _)| *j != i).take(options.link_k) {
                delta.upsert_edge(edge(&graph, episode, &episodes[j], EdgeKind::Link, cosine, 1, run_id));
                report.link_edges += 1;
            }
            for (node, (weight, evidence)) in ground(&semantic, episode_queries, &query_vectors, options)? {
                delta.upsert_edge(edge(&graph, &node, episode, EdgeKind::Ground, weight, evidence, run_id));
                report.ground_edges += 1;
            }
            report.connected += 1;
        }
        if !delta.is_empty() {
            let summary = serde_json::json!({ "connected": report.connected, "ground_edges": report.ground_edges, "link_edges": report.link_edges });
            writer.commit(&delta, CommitInfo { stage: "connect".into(), run_id: run_id.into(), summary, progress: Default::default() })?;
            report.commits += 1;
        }
        progress.advance(chunk.len() as u64);
    }
    Ok(report)
}

/// The retrieval queries of an episode: its step observations, or its task.
fn ground_queries<'g>(graph: &'g Graph, episode: &NodeId, per_step: bool) -> Vec<&'g str> {
    let node = &graph.nodes[episode];
    let mut queries: Vec<&str> = Vec::new();
    if per_step {
        queries.extend(node.episode().into_iter().flat_map(|e| &e.steps).map(|s| s.observation.as_str()).filter(|o| !o.trim().is_empty()));
    }
    if queries.is_empty() {
        queries.push(node.text.as_str());
    }
    queries
}

/// The semantic nodes that support an episode: node -> (best fused score, queries retrieving it).
fn ground(
    semantic: &SemanticIndex,
    queries: &[&str],
    vectors: &[Vec<f32>],
    options: &ConnectOptions,
) -> Result<BTreeMap<NodeId, (f32, i64)>> {
    let mut support: BTreeMap<NodeId, (f32, i64)> = BTreeMap::new();
    if semantic.is_empty() {
        return Ok(support);
    }
    for (query, vector) in queries.iter().zip(vectors) {
        for candidate in semantic.hybrid(query, vector, &options.retrieval, None)?.into_iter().take(options.ground_k) {
            let entry = support.entry(candidate.node_id).or_insert((candidate.score, 0));
            entry.0 = entry.0.max(candidate.score);
            entry.1 += 1;
        }
    }
    Ok(support)
}

/// An edge of this stage. Its time is the later `created_at` of its two nodes (the moment the
/// connection became possible), not the wall clock, so the same store always gives the same shards.
fn edge(graph: &Graph, src: &NodeId, dst: &NodeId, kind: EdgeKind, weight: f32, evidence: i64, run_id: &str) -> Edge {
    let time = |id: &NodeId| graph.nodes.get(id).and_then(|n| n.created_at).unwrap_or(0);
    Edge {
        src: src.clone(),
        dst: dst.clone(),
        kind,
        weight,
        evidence,
        stage: "connect".into(),
        run_id: run_id.into(),
        created_at: time(src).max(time(dst)),
        active: true,
        metadata: Default::default(),
    }
}
