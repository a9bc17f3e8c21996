//! The `connect` stage: Stage I run in batch over logged episodes, written as edges.
//!
//! For every episode not yet connected (no `ground` edge into it and no Stage I `link` edge out
//! of it, i.e. one without a Stage II `relation`), each step's observation (or, with `per_step = false`, the task) is a
//! query to the semantic retrieval; the `ground_k` best semantic nodes per query get a `ground`
//! edge to the episode (evidence = how many queries retrieved it, weight = the best fused
//! score). Each episode also gets `link` edges to its `link_k` nearest episodes by cosine
//! (exact kNN in blocks). Edges are committed every `commit_every` episodes. Both searches
//! run inside the episode's tenant: per-tenant indexes, so no edge joins two tenants.

use candle_core::Device;
use fluxmem_graph::{Edge, EdgeKind, Graph, NodeId, NodeKind};
use fluxmem_models::Embedder;

use fluxmem_store::{CommitInfo, Rows, Scan, Shard, Writer};
use std::collections::{BTreeMap, BTreeSet};

use crate::dense::{embedded_in, top_k, DenseIndex, Unembedded};
use crate::retrieve::{RetrievalConfig, SemanticIndex};
use crate::tenant::tenants;
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

/// One tenant's Stage I indexes: its semantic nodes, and its episodes with their vectors.
struct TenantIndex {
    semantic: SemanticIndex,
    episodes: Vec<NodeId>,
    /// The vectors of the episodes to connect (their link queries), by row; the others are in
    /// `dense` only.
    queries: BTreeMap<usize, Vec<f32>>,
    dense: DenseIndex,
}

/// An episode to connect: its id, its tenant, and its row in the tenant's episode index.
type Todo<'g> = (&'g NodeId, &'g str, usize);

/// Connects every episode of the store that is not connected yet. Tenants never mix: an
/// episode's ground candidates are the semantic nodes of its own tenant (BM25 statistics are
/// the tenant's), its link neighbours the episodes of its own tenant. Every node must be
/// embedded (a node without a vector would silently never become a candidate).
pub fn connect_store(
    writer: &mut Writer,
    embedder: &dyn Embedder,
    options: &ConnectOptions,
    run_id: &str,
    device: &Device,
    progress: &mut dyn Progress,
) -> Result<ConnectReport> {
    // Node rows and vectors; of the edges only the live ones' ends, streamed (which episodes are
    // connected); the steps (the queries) only of the episodes to connect, once they are known.
    let scan = Scan { nodes: true, vectors: Rows::All, ..Default::default() };
    let (mut graph, manifest) = writer.store().scan(&scan)?;
    let connected = connected_episodes(writer.store(), &manifest)?;
    // The episodes this run connects: not connected before, and this shard's.
    let to_connect = |id: &NodeId| !connected.contains(id) && options.shard.owns(id.as_str());
    let unconnected: BTreeSet<NodeId> = graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Episodic && to_connect(&n.id))
        .map(|n| n.id.clone())
        .collect();
    if options.per_step && !unconnected.is_empty() {
        let (with_steps, _) = writer.store().scan(&Scan { nodes: true, steps: Rows::Of(unconnected), ..Default::default() })?;
        for (id, node) in with_steps.nodes {
            if node.episode().is_some_and(|e| !e.steps.is_empty()) {
                graph.nodes.insert(id, node);
            }
        }
    }
    let indexes = tenant_indexes(&graph, embedder.model_id(), device, &to_connect)?;
    // The indexes hold the vectors they need; the graph's copies are not read again.
    graph.embeddings.clear();
    let graph = graph;
    // Every episode in id order (commit boundaries depend only on the data).
    let mut episodes: Vec<Todo<'_>> = indexes
        .iter()
        .flat_map(|(tenant, index)| index.episodes.iter().enumerate().map(move |(row, id)| (id, tenant.as_str(), row)))
        .collect();
    episodes.sort_by(|a, b| a.0.cmp(b.0));
    let todo: Vec<Todo<'_>> =
        episodes.iter().copied().filter(|(id, ..)| to_connect(id)).collect();
    let mut report = ConnectReport { episodes: episodes.len(), already: episodes.len() - todo.len(), ..Default::default() };
    progress.start(todo.len() as u64);
    for chunk in todo.chunks(options.commit_every.max(1)) {
        let mut delta = Graph::default();
        // All the chunk's step queries in one embedder call (sorted by length inside).
        let queries: Vec<Vec<&str>> = chunk.iter().map(|(id, ..)| ground_queries(&graph, id, options.per_step)).collect();
        let flat: Vec<&str> = queries.iter().flatten().copied().collect();
        let mut flat_vectors = embedder.embed(&flat)?.into_iter();
        let links = link_neighbours(&indexes, chunk, options.link_k)?;
        for ((&(episode, tenant, _), neighbours), episode_queries) in chunk.iter().zip(links).zip(&queries) {
            let query_vectors: Vec<Vec<f32>> = flat_vectors.by_ref().take(episode_queries.len()).collect();
            let Some(index) = indexes.get(tenant) else { continue };
            for (j, cosine) in neighbours {
                delta.upsert_edge(edge(&graph, episode, &index.episodes[j], EdgeKind::Link, cosine, 1, run_id));
                report.link_edges += 1;
            }
            for (node, (weight, evidence)) in ground(&index.semantic, episode_queries, &query_vectors, options)? {
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

/// A [`TenantIndex`] per tenant of the graph's nodes, keeping the query vectors of the episodes
/// `to_connect` picks.
fn tenant_indexes(graph: &Graph, model: &str, device: &Device, to_connect: &dyn Fn(&NodeId) -> bool) -> Result<BTreeMap<String, TenantIndex>> {
    let mut out = BTreeMap::new();
    for tenant in tenants(graph) {
        let semantic = SemanticIndex::build(graph, &tenant, model, device)?;
        let selected = embedded_in(graph, NodeKind::Episodic, &tenant, model, Unembedded::Fail)?;
        let dense = DenseIndex::from_vectors(&selected.vectors, device)?;
        let queries = selected.ids.iter().zip(selected.vectors).enumerate().filter(|(_, (id, _))| to_connect(id)).map(|(row, (_, v))| (row, v)).collect();
        out.insert(tenant, TenantIndex { semantic, episodes: selected.ids, queries, dense });
    }
    Ok(out)
}

/// Episodes this stage connected before: a `ground` edge into them or a Stage I `link` out
/// (Stage I edges, whoever updated them last: credit assignment re-weights them; links with a
/// `relation` come from Stage II and do not make an episode connected). Streamed over the live
/// edges' ends: what stays in memory is the episodes, not the edges.
fn connected_episodes(store: &fluxmem_store::Store, manifest: &fluxmem_store::Manifest) -> Result<BTreeSet<NodeId>> {
    let mut connected = BTreeSet::new();
    store.live(manifest, "edges")?.edge_ends(&[EdgeKind::Ground, EdgeKind::Link], &mut |src, dst, kind, relation| {
        let episode = match kind {
            _ if relation => return,
            EdgeKind::Ground => dst,
            EdgeKind::Link => src,
            EdgeKind::Distill => return,
        };
        if !connected.contains(episode) {
            connected.insert(NodeId(episode.to_string()));
        }
    })?;
    Ok(connected)
}

/// The `link_k` nearest episodes of the same tenant (rows of its index, the episode itself
/// left out) of each episode of `chunk`, in chunk order. Each tenant's episodes are scored in
/// one batch against that tenant's index (a score does not depend on its batch mates).
fn link_neighbours(indexes: &BTreeMap<String, TenantIndex>, chunk: &[Todo<'_>], link_k: usize) -> Result<Vec<Vec<(usize, f32)>>> {
    let mut out = vec![Vec::new(); chunk.len()];
    let mut by_tenant: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (slot, (_, tenant, _)) in chunk.iter().enumerate() {
        by_tenant.entry(*tenant).or_default().push(slot);
    }
    for (tenant, slots) in by_tenant {
        let Some(index) = indexes.get(tenant) else { continue };
        let vectors: Vec<Vec<f32>> = slots.iter().map(|&slot| index.queries[&chunk[slot].2].clone()).collect();
        for (&slot, scores) in slots.iter().zip(index.dense.scores(&vectors)?) {
            let own = chunk[slot].2;
            // k + 1 neighbours: the episode itself comes back first.
            out[slot] = top_k(&scores, link_k + 1).into_iter().filter(|(j, _)| *j != own).take(link_k).collect();
        }
    }
    Ok(out)
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
    // The episode's step queries against the tenant's facts in one matrix product.
    for ranked in semantic.hybrid_many(queries, vectors, &options.retrieval)? {
        for candidate in ranked.into_iter().take(options.ground_k) {
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
