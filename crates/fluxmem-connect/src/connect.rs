//! The `connect` stage: Stage I run in batch over logged episodes, written as edges.
//!
//! For every episode not yet connected (no `ground` edge into it and no Stage I `link` edge out
//! of it, i.e. one without a Stage II `relation`), each step's observation (or, with `per_step = false`, the task) is a
//! query to the semantic retrieval (the ranking `query` serves, [`RetrievalConfig::serving`]
//! by default: the same units and structure lifts); the `ground_k` best semantic nodes per
//! query get a `ground` edge to the episode (evidence = how many queries retrieved it,
//! weight = the best fused
//! score). Each episode also gets `link` edges to its `link_k` nearest episodes by cosine
//! (exact kNN, streamed over the stored vectors in blocks). Edges are committed every
//! `commit_every` episodes. Both searches run inside the episode's tenant (a per-tenant
//! semantic index, each query scored against its tenant's stored episode vectors only), so no
//! edge joins two tenants.
//!
//! The stage's model work is embedding its ground queries. [`planned_queries`] lists their
//! texts without running the retrieval, so a sharded run can plan them
//! (`fluxmem_embed::plan::plan_texts`), embed them on any number of workers and run this stage
//! in one process with an embedder that serves the results ([`ConnectOptions::plan`]): the
//! edges of a run with the model.

use candle_core::Device;
use fluxmem_graph::{
    Edge, EdgeKey, EdgeKind, Graph, IdMap, IdSet, Node, NodeBody, NodeId, NodeKind, Step,
};
use fluxmem_models::Embedder;

use fluxmem_store::{CommitInfo, Live, Rows, Scan, Shard, Writer};
use std::collections::{BTreeMap, BTreeSet};

use crate::dense::Unembedded;
use crate::dense::{DenseIndex, BLOCK_ROWS, MIN_ROWS};
use crate::facts::{fact_bytes, Query, Spill, SpilledFacts, FOLDER};
use crate::retrieve::{RetrievalConfig, SemanticIndex, Units};
use crate::{Error, Result};

/// The stage name written on connect's commits (and in its run ids).
pub const STAGE: &str = "connect";

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
    /// Stage I settings: [`RetrievalConfig::serving`] by default, the ranking `query` serves.
    pub retrieval: RetrievalConfig,
    /// The episodes this run connects (sharded runs, by episode id); all by default.
    pub shard: Shard,
    /// Bytes connect may hold for the night's work. What it keeps of every stored episode (its
    /// id as a 16-byte digest, tenant and time; the connected ones' ids) is counted first, and
    /// the rest is shared out. Half is the link search's (the night's
    /// query vectors and neighbours, and the score blocks), a quarter holds the night's
    /// episodes whole (their steps are the ground queries): a night that does not fit is done
    /// in groups of whole commits, each with its own pass over the stored vectors. The
    /// history's vectors are streamed, never held. The last quarter is the facts': the
    /// semantic nodes and their indexes are held whole while they fit it; past it they are
    /// spilled to scratch files in the store (`scratch/connect/`), split into partitions of
    /// an eighth of the budget each, and every batch of ground queries whose kept candidates
    /// fit the other eighth makes its passes over them (the same edges either way; a small
    /// budget costs many passes: `ConnectReport::fact_partitions` says how many partitions).
    pub memory: usize,
    /// The digest of the plan whose vectors the embedder serves (a planned run's commit,
    /// [`planned_queries`]), recorded as `plan` in each commit's summary so that a killed
    /// commit of the plan can resume over its own commits. `None` for a run with the model.
    pub plan: Option<String>,
}

/// [`ConnectOptions::memory`] by default: 512 MiB.
pub const DEFAULT_MEMORY: usize = 512 << 20;

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            per_step: true,
            ground_k: 2,
            link_k: 5,
            commit_every: 500,
            retrieval: RetrievalConfig::serving(),
            shard: Shard::ALL,
            memory: DEFAULT_MEMORY,
            plan: None,
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
    /// Of `connected`: episodes connected before that grew since (a conversation logged again,
    /// longer: ingest's `episode_grown` edits), grounded again with their new steps.
    pub regrounded: usize,
    /// Groups of the night's episodes held whole one after the other (see
    /// [`ConnectOptions::memory`]).
    pub groups: usize,
    /// Partitions the facts were spilled to, when they did not fit their share of
    /// [`ConnectOptions::memory`]; 0 when they were held whole.
    pub fact_partitions: usize,
    /// The retrieval the ground edges come from ([`ConnectOptions::retrieval`]).
    pub retrieval: RetrievalConfig,
}

/// Progress callbacks of a stage that works through countable items (episodes to connect;
/// Stage II's edges to assess).
pub use fluxmem_graph::{NoProgress, Progress};

/// What connect keeps of every episode in the store: its tenant (interned) and time. The link
/// search needs the tenant of every stored vector it reads, and a link's time is the later of
/// its two episodes'; nothing else of the history is held.
#[derive(Clone, Copy)]
struct Seen {
    tenant: u32,
    time: i64,
}

/// An episode to connect: its id and its tenant.
type Todo<'g> = (&'g NodeId, &'g str);

/// Connects every episode of the store that is not connected yet. Tenants never mix: an
/// episode's ground candidates are the semantic nodes of its own tenant (BM25 statistics are
/// the tenant's), its link neighbours the episodes of its own tenant. Every episode, and every
/// semantic node of a tenant with episodes to connect, must be embedded (a node without a vector
/// would silently never become a candidate); a run with nothing to connect checks nothing.
///
/// What it holds follows the night, not the history: the semantic nodes with their vectors,
/// the episodes to connect with their steps and vectors, and of every other episode its
/// tenant and time. The link search streams the stored vectors shard by shard against the
/// night's episodes, within `options.memory` (see [`ConnectOptions::memory`]).
pub fn connect_store(
    writer: &mut Writer,
    embedder: &dyn Embedder,
    options: &ConnectOptions,
    run_id: &str,
    device: &Device,
    progress: &mut dyn Progress,
) -> Result<ConnectReport> {
    let manifest = writer.manifest().clone();
    // A read handle of its own: the night is read in groups between commits.
    let store = &writer.store().clone();
    let model = embedder.model_id().to_string();
    // Scratch files a run that died left (only the names connect writes; the writer lock
    // makes this the store's only connect).
    crate::facts::sweep(&store.dir().join(fluxmem_store::SCRATCH).join(FOLDER))?;
    let NightRead {
        grown,
        existing,
        mut nodes,
        regrounded,
        memory,
    } = read_night(store, &manifest, options, embedder.dim())?;
    let mut report = ConnectReport {
        episodes: nodes.episodes.len(),
        already: nodes.episodes.len() - nodes.todo.len(),
        regrounded,
        retrieval: options.retrieval.clone(),
        ..Default::default()
    };
    if nodes.todo.is_empty() {
        return Ok(report);
    }
    let search = fact_search(
        store,
        &manifest,
        &mut nodes,
        (&model, options.retrieval.units),
        memory / 4,
        device,
    )?;
    let todo = nodes.todo_in_order();
    report.fact_partitions = search.partitions();
    // Half of the budget is the link search's; a quarter holds a group of the night's episodes
    // whole (their steps are the queries).
    let links = LinkSearch {
        store,
        manifest: &manifest,
        episodes: &nodes.episodes,
        tenants: nodes.tenants.len(),
        model: &model,
        dim: embedder.dim(),
        k: options.link_k,
        memory: memory / 2,
        device,
    };
    let night = Night {
        embedder,
        options,
        run_id,
        device,
        nodes: &nodes,
        search: &search,
        facts_share: memory / 4,
    };
    let commit_every = options.commit_every.max(1);
    let plan = options.plan.as_deref();
    let mut sizing = GroupSize::new(memory / 4, &manifest, commit_every, nodes.episodes.len());
    progress.start(todo.len() as u64);
    let mut start = 0;
    let mut marked = false;
    while start < todo.len() {
        // A group of whole commits, so that where a commit ends does not depend on the budget.
        let group = &todo[start..(start + sizing.episodes()).min(todo.len())];
        start += group.len();
        let group_ids: BTreeSet<NodeId> = group.iter().map(|(id, _)| (*id).clone()).collect();
        let group_graph = read_group(store, &manifest, &group_ids, options.per_step)?;
        // Every edge has one of the group's episodes at an end: its shards name their tenants.
        writer.know_tenants(
            group_graph
                .nodes
                .values()
                .map(|n| (&n.id, n.tenant.as_str())),
        );
        sizing.measured(group_graph.nodes.values());
        let neighbours = links.neighbours(&group_ids)?;
        report.groups += 1;
        let chunks = group.chunks(commit_every).count();
        for (i, chunk) in group.chunks(commit_every).enumerate() {
            let mut delta = night.chunk_edges(chunk, &group_graph, &neighbours, &mut report)?;
            keep_existing(&mut delta, &existing, &mut report);
            // The last commit of an unsharded run records the grown episodes as handled (a run
            // killed before it connects them again: the same edges); a sharded run's merge
            // does ([`merged_progress`]).
            let last = start >= todo.len() && i + 1 == chunks && options.shard.count <= 1;
            let marker = last.then_some(grown.seen);
            if !delta.is_empty() {
                commit(writer, &delta, (run_id, plan), &report, marker)?;
                report.commits += 1;
                marked |= marker.is_some();
            }
            progress.advance(chunk.len() as u64);
        }
    }
    if !marked && grown.seen > grown.handled && options.shard.count <= 1 {
        commit(
            writer,
            &Graph::default(),
            (run_id, plan),
            &report,
            Some(grown.seen),
        )?;
        report.commits += 1;
    }
    Ok(report)
}

/// The texts a run of [`connect_store`] with `options` would give an embedder of `model`
/// (`dim` dimensions) at the writer's version: the dense form of every ground query of the
/// episodes it would connect, each once. Planned with `fluxmem_embed::plan::plan_texts` and
/// embedded anywhere, they are all a connect run needs of the model: [`connect_store`] with
/// an embedder that serves their vectors writes the edges a run with the model writes.
pub fn planned_queries(
    writer: &Writer,
    (model, dim): (&str, usize),
    options: &ConnectOptions,
    device: &Device,
) -> Result<PlannedQueries> {
    let store = writer.store();
    // Facts spilled to scratch files are connect's own (the writer lock makes this the store's
    // only connect): a plan leaves none behind.
    let scratch = store.dir().join(fluxmem_store::SCRATCH).join(FOLDER);
    crate::facts::sweep(&scratch)?;
    let planned = plan_queries(writer, (model, dim), options, device);
    crate::facts::sweep(&scratch)?;
    planned
}

fn plan_queries(
    writer: &Writer,
    (model, dim): (&str, usize),
    options: &ConnectOptions,
    device: &Device,
) -> Result<PlannedQueries> {
    let manifest = writer.manifest();
    let store = writer.store();
    let NightRead {
        mut nodes, memory, ..
    } = read_night(store, manifest, options, dim)?;
    let mut planned = PlannedQueries {
        episodes: nodes.episodes.len(),
        todo: nodes.todo.len(),
        texts: BTreeSet::new(),
    };
    if nodes.todo.is_empty() {
        return Ok(planned);
    }
    let search = fact_search(
        store,
        manifest,
        &mut nodes,
        (model, options.retrieval.units),
        memory / 4,
        device,
    )?;
    let todo = nodes.todo_in_order();
    let mut sizing = GroupSize::new(
        memory / 4,
        manifest,
        options.commit_every.max(1),
        nodes.episodes.len(),
    );
    let mut start = 0;
    while start < todo.len() {
        let group = &todo[start..(start + sizing.episodes()).min(todo.len())];
        start += group.len();
        let ids: BTreeSet<NodeId> = group.iter().map(|(id, _)| (*id).clone()).collect();
        let graph = read_group(store, manifest, &ids, options.per_step)?;
        sizing.measured(graph.nodes.values());
        for &(episode, tenant) in group {
            for text in ground_queries(&graph, episode, options.per_step) {
                let dense = search.dense_query(tenant, text, &options.retrieval);
                planned
                    .texts
                    .insert(dense.unwrap_or_else(|| text.to_string()));
            }
        }
    }
    Ok(planned)
}

/// What [`planned_queries`] found.
#[derive(Debug, Clone, Default)]
pub struct PlannedQueries {
    /// Episodes in the store.
    pub episodes: usize,
    /// Episodes a run would connect.
    pub todo: usize,
    /// The texts it would embed, each once.
    pub texts: BTreeSet<String>,
}

/// What connect reads of the store before it grounds anything, the same for the stage and for
/// its plan ([`planned_queries`], whose texts must be the stage's queries).
struct NightRead {
    /// The episodes ingest grew since this stage last looked.
    grown: Grown,
    /// The edges the store holds already of the grown episodes.
    existing: BTreeSet<EdgeKey>,
    /// The episodes, those to connect among them, and the facts with their vectors.
    nodes: Nodes,
    /// Grown episodes that were connected before and are connected again.
    regrounded: usize,
    /// The memory budget left once every stored episode's id, tenant and time (and the
    /// connected ones' ids) are counted.
    memory: usize,
}

/// Reads the night (see [`NightRead`]). Connected episodes that grew since this stage last
/// looked are connected again; their edges that exist keep what later stages made of them
/// (credit, prunes), only new ones are added.
fn read_night(
    store: &fluxmem_store::Store,
    manifest: &fluxmem_store::Manifest,
    options: &ConnectOptions,
    dim: usize,
) -> Result<NightRead> {
    let grown = grown_since(store, manifest)?;
    // Which episodes are connected, from a stream of the live edges' ends.
    let (connected, existing) = connected_episodes(store, manifest, &grown.episodes)?;
    let nodes = read_nodes(store, manifest, &connected, &grown.episodes, options, dim)?;
    let regrounded = grown
        .episodes
        .iter()
        .filter(|id| nodes.todo.contains(*id) && connected.contains(id.as_str()))
        .count();
    let memory = options
        .memory
        .saturating_sub(connected.held_bytes() + nodes.episodes.held_bytes());
    Ok(NightRead {
        grown,
        existing,
        nodes,
        regrounded,
        memory,
    })
}

/// Takes out of `delta` the edges the store holds already (a grown episode's: connected again,
/// its existing edges keep their state), and out of the report's counts.
fn keep_existing(delta: &mut Graph, existing: &BTreeSet<EdgeKey>, report: &mut ConnectReport) {
    if existing.is_empty() {
        return;
    }
    delta.edges.retain(|key, edge| {
        let new = !existing.contains(key);
        if !new {
            match edge.kind {
                EdgeKind::Ground => report.ground_edges -= 1,
                EdgeKind::Link => report.link_edges -= 1,
                EdgeKind::Distill => {}
            }
        }
        new
    });
}

/// The progress key under which connect records how many `episode_grown` edits it has handled.
const GROWN_SEEN: &str = "connect.grown_edits";

/// The progress a sharded connect's merge records (`fluxmem run --stage connect --merge N`):
/// every `episode_grown` edit of `manifest` (the version every shard started from) handled,
/// since each shard connected again the grown episodes it owns. A shard records nothing of
/// it: shards may see different parts, and only the merge sees them all done.
pub fn merged_progress(
    store: &fluxmem_store::Store,
    manifest: &fluxmem_store::Manifest,
) -> Result<(String, serde_json::Value)> {
    let seen = store
        .edited_nodes(manifest, fluxmem_graph::EPISODE_GROWN)?
        .len();
    Ok((GROWN_SEEN.to_string(), serde_json::Value::from(seen)))
}

/// The episodes ingest grew (`episode_grown` edits, in log order) after the ones this stage
/// handled, and how many such edits the log holds.
struct Grown {
    episodes: BTreeSet<NodeId>,
    /// The edits the marker said were handled.
    handled: usize,
    seen: usize,
}

fn grown_since(store: &fluxmem_store::Store, manifest: &fluxmem_store::Manifest) -> Result<Grown> {
    let handled = manifest
        .progress
        .get(GROWN_SEEN)
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0) as usize;
    let grown = store.edited_nodes(manifest, fluxmem_graph::EPISODE_GROWN)?;
    Ok(Grown {
        seen: grown.len(),
        episodes: grown.into_iter().skip(handled).collect(),
        handled,
    })
}

/// What connect keeps of one stream of the live node rows: every stored episode's tenant and
/// time, the episodes to connect, and the semantic nodes (held whole, or spilled).
struct Nodes {
    /// Tenant names, interned ([`Seen::tenant`] indexes them).
    tenants: Vec<String>,
    episodes: IdMap<Seen>,
    /// The semantic nodes held whole (none once they were spilled).
    facts: Graph,
    spill: Option<Spill>,
    /// The episodes this run connects.
    todo: BTreeSet<NodeId>,
}

impl Nodes {
    /// The episodes to connect with their tenants, in id order (commit boundaries depend
    /// only on the data).
    fn todo_in_order(&self) -> Vec<Todo<'_>> {
        self.todo
            .iter()
            .map(|id| {
                let seen = self
                    .episodes
                    .get(id.as_str())
                    .expect("an episode to connect is an episode");
                (id, self.tenants[seen.tenant as usize].as_str())
            })
            .collect()
    }

    /// An episode's time, or a semantic node's; 0 when it has none.
    fn time(&self, id: &NodeId) -> i64 {
        self.episodes
            .get(id.as_str())
            .map(|e| e.time)
            .or_else(|| self.facts.nodes.get(id).and_then(|n| n.created_at))
            .unwrap_or(0)
    }
}

/// One stream of the live node rows: the semantic nodes whole (spilled to scratch files once
/// they outgrow their quarter of the budget, see `facts.rs`), every episode's tenant and time,
/// and the episodes to connect: not connected before, and this shard's.
fn read_nodes(
    store: &fluxmem_store::Store,
    manifest: &fluxmem_store::Manifest,
    connected: &IdSet,
    grown: &BTreeSet<NodeId>,
    options: &ConnectOptions,
    dim: usize,
) -> Result<Nodes> {
    let mut nodes = Nodes {
        tenants: Vec::new(),
        episodes: IdMap::default(),
        facts: Graph::default(),
        spill: None,
        todo: BTreeSet::new(),
    };
    let mut tenant_ids: BTreeMap<String, u32> = BTreeMap::new();
    // The spilled search has no judge: with one, the facts stay whole.
    let spillable = options.retrieval.judge_top == 0;
    let mut held = 0usize;
    let mut failure: Option<Error> = None;
    store
        .live(manifest, "nodes")?
        .nodes(&mut |node| match node.kind() {
            NodeKind::Semantic => {
                if let Some(spill) = nodes.spill.as_mut() {
                    spill.add(&node);
                    return;
                }
                held += fact_bytes(node.id.as_str(), &node.text, dim) + held_bytes(&node);
                nodes.facts.nodes.insert(node.id.clone(), node);
                // The budget less what is kept of every stored episode (counted first).
                let facts_share = options
                    .memory
                    .saturating_sub(connected.held_bytes() + nodes.episodes.held_bytes())
                    / 4;
                if spillable && held > facts_share && failure.is_none() {
                    let dir = store.dir().join(fluxmem_store::SCRATCH).join(FOLDER);
                    match Spill::create(&dir, dim, options.retrieval.units) {
                        Ok(mut started) => {
                            std::mem::take(&mut nodes.facts.nodes)
                                .into_values()
                                .for_each(|n| started.add(&n));
                            nodes.spill = Some(started);
                        }
                        Err(e) => failure = Some(e),
                    }
                }
            }
            NodeKind::Episodic => {
                let tenant = match tenant_ids.get(&node.tenant) {
                    Some(&t) => t,
                    None => {
                        let t = nodes.tenants.len() as u32;
                        nodes.tenants.push(node.tenant.clone());
                        tenant_ids.insert(node.tenant.clone(), t);
                        t
                    }
                };
                let fresh = !connected.contains(node.id.as_str()) || grown.contains(&node.id);
                if fresh && options.shard.owns(node.id.as_str()) {
                    nodes.todo.insert(node.id.clone());
                }
                nodes.episodes.insert(
                    node.id.as_str(),
                    Seen {
                        tenant,
                        time: node.created_at.unwrap_or(0),
                    },
                );
            }
            NodeKind::Procedural => {}
        })?;
    match failure {
        Some(e) => Err(e),
        None => Ok(nodes),
    }
}

/// The search of the facts of the tenants with episodes to connect: each tenant's semantic
/// index (its BM25 statistics are the tenant's own) over the facts held whole, with their
/// vectors; or, when the facts were spilled, their vectors in the scratch files too, in
/// partitions that fit half of `facts_share` (the query batches' pools get the other half).
/// Facts are indexed for BM25 as `units` say.
fn fact_search(
    store: &fluxmem_store::Store,
    manifest: &fluxmem_store::Manifest,
    nodes: &mut Nodes,
    (model, units): (&str, Units),
    facts_share: usize,
    device: &Device,
) -> Result<FactSearch> {
    let todo_tenants: BTreeSet<String> = nodes
        .todo_in_order()
        .into_iter()
        .map(|(_, tenant)| tenant.to_string())
        .collect();
    let todo_tenants: Vec<&str> = todo_tenants.iter().map(String::as_str).collect();
    if let Some(spill) = nodes.spill.take() {
        let episodes = &nodes.episodes;
        let spilled = spill.vectors(
            store,
            manifest,
            model,
            &|id| episodes.contains(id.as_str()),
            facts_share / 2,
        )?;
        spilled.check(&todo_tenants)?;
        return Ok(FactSearch::Spilled(spilled));
    }
    let fact_ids: BTreeSet<NodeId> = nodes.facts.nodes.keys().cloned().collect();
    if !fact_ids.is_empty() {
        nodes.facts.embeddings = store
            .scan_at(
                manifest,
                &Scan {
                    vectors: Rows::Of(fact_ids),
                    ..Default::default()
                },
            )?
            .embeddings;
    }
    let mut semantic: BTreeMap<String, SemanticIndex> = BTreeMap::new();
    for &tenant in &todo_tenants {
        semantic.insert(
            tenant.to_string(),
            SemanticIndex::build_units(
                &nodes.facts,
                tenant,
                model,
                device,
                Unembedded::Fail,
                units,
            )?,
        );
    }
    Ok(FactSearch::Whole(semantic))
}

/// A group of the night's episodes, whole: their nodes, and their steps when each step is a
/// ground query.
fn read_group(
    store: &fluxmem_store::Store,
    manifest: &fluxmem_store::Manifest,
    group: &BTreeSet<NodeId>,
    per_step: bool,
) -> Result<Graph> {
    let steps = if per_step {
        Rows::Of(group.clone())
    } else {
        Rows::None
    };
    Ok(store.scan_at(
        manifest,
        &Scan {
            nodes: true,
            nodes_of: Some(group.clone()),
            steps,
            ..Default::default()
        },
    )?)
}

/// What every chunk of the night is connected with.
struct Night<'a> {
    embedder: &'a dyn Embedder,
    options: &'a ConnectOptions,
    run_id: &'a str,
    device: &'a Device,
    nodes: &'a Nodes,
    search: &'a FactSearch,
    facts_share: usize,
}

impl Night<'_> {
    /// The edges of one chunk of episodes (one commit): each episode's link edges to its
    /// `neighbours`, and its ground edges to the facts its queries retrieve.
    fn chunk_edges(
        &self,
        chunk: &[Todo<'_>],
        group: &Graph,
        neighbours: &BTreeMap<NodeId, Vec<(NodeId, f32)>>,
        report: &mut ConnectReport,
    ) -> Result<Graph> {
        let queries: Vec<Vec<&str>> = chunk
            .iter()
            .map(|(id, _)| ground_queries(group, id, self.options.per_step))
            .collect();
        let mut rankings = self.rankings(chunk, &queries)?.into_iter();
        let time = |id: &NodeId| self.nodes.time(id);
        let mut delta = Graph::default();
        for (&(episode, _), episode_queries) in chunk.iter().zip(&queries) {
            for (neighbour, cosine) in neighbours.get(episode).into_iter().flatten() {
                delta.upsert_edge(edge(
                    (episode, time(episode)),
                    (neighbour, time(neighbour)),
                    EdgeKind::Link,
                    *cosine,
                    1,
                    self.run_id,
                ));
                report.link_edges += 1;
            }
            for (node, (weight, evidence, node_time)) in
                ground(rankings.by_ref().take(episode_queries.len()))
            {
                delta.upsert_edge(edge(
                    (&node, node_time),
                    (episode, time(episode)),
                    EdgeKind::Ground,
                    weight,
                    evidence,
                    self.run_id,
                ));
                report.ground_edges += 1;
            }
            report.connected += 1;
        }
        Ok(delta)
    }

    /// Each query's ranking of its tenant's facts, in query order: the best `ground_k` (node,
    /// fused score, node time). All the chunk's queries are embedded in one call (sorted by
    /// length inside), each as the dense signal reads it (without the speakers it names, when
    /// entities are on, as `query` embeds it).
    fn rankings(
        &self,
        chunk: &[Todo<'_>],
        queries: &[Vec<&str>],
    ) -> Result<Vec<Vec<(NodeId, f32, i64)>>> {
        let options = self.options;
        let dense_texts: Vec<String> = chunk
            .iter()
            .zip(queries)
            .flat_map(|(&(_, tenant), episode_queries)| {
                episode_queries.iter().map(move |&text| {
                    self.search
                        .dense_query(tenant, text, &options.retrieval)
                        .unwrap_or_else(|| text.to_string())
                })
            })
            .collect();
        let dense_refs: Vec<&str> = dense_texts.iter().map(String::as_str).collect();
        let flat_vectors = self.embedder.embed(&dense_refs)?;
        let flat: Vec<&str> = queries.iter().flatten().copied().collect();
        match self.search {
            FactSearch::Whole(semantic) => {
                let mut out = Vec::with_capacity(flat.len());
                let mut vectors = flat_vectors.iter();
                for (&(_, tenant), episode_queries) in chunk.iter().zip(queries) {
                    let query_vectors: Vec<Vec<f32>> = vectors
                        .by_ref()
                        .take(episode_queries.len())
                        .cloned()
                        .collect();
                    let index = &semantic[tenant];
                    if index.is_empty() {
                        out.extend(episode_queries.iter().map(|_| Vec::new()));
                        continue;
                    }
                    // The episode's step queries against the tenant's facts in one matrix product.
                    for ranked in
                        index.hybrid_many(episode_queries, &query_vectors, &options.retrieval)?
                    {
                        out.push(
                            ranked
                                .into_iter()
                                .take(options.ground_k)
                                .map(|c| {
                                    let t = self.nodes.time(&c.node_id);
                                    (c.node_id, c.score, t)
                                })
                                .collect(),
                        );
                    }
                }
                Ok(out)
            }
            FactSearch::Spilled(spilled) => {
                let mut asked = Vec::with_capacity(flat.len());
                for (&(_, tenant), episode_queries) in chunk.iter().zip(queries) {
                    asked.extend(episode_queries.iter().map(|text| Query {
                        tenant,
                        text,
                        vector: &[],
                    }));
                }
                for (query, vector) in asked.iter_mut().zip(&flat_vectors) {
                    query.vector = vector;
                }
                spilled.search(
                    &asked,
                    &options.retrieval,
                    options.ground_k,
                    self.facts_share / 2,
                    self.device,
                )
            }
        }
    }
}

/// The manifest progress key of the retrieval connect's ground edges came from (a
/// [`RetrievalConfig`] as JSON), written with each of its commits: `query` ranks with it by
/// default, so the store serves the ranking its edges were made with.
pub const RETRIEVAL_MARKER: &str = "connect.retrieval";

/// The retrieval the store's ground edges were made with ([`RETRIEVAL_MARKER`]), if connect
/// recorded one; an error when the recorded value is not a retrieval setting.
pub fn recorded_retrieval(
    manifest: &fluxmem_store::Manifest,
) -> std::result::Result<Option<RetrievalConfig>, serde_json::Error> {
    manifest
        .progress
        .get(RETRIEVAL_MARKER)
        .map(|value| serde_json::from_value(value.clone()))
        .transpose()
}

/// The retrieval the `count` shards of a sharded connect on `store` grounded with: the one
/// their staging stores recorded with their commits ([`RETRIEVAL_MARKER`]; a shard that
/// committed nothing recorded none), `None` when no shard did. Shards that recorded different settings are an
/// error: the merged edges would mix rankings, and `query` could serve only one of them.
pub fn staged_retrieval(
    store: &fluxmem_store::Store,
    count: usize,
) -> Result<Option<RetrievalConfig>> {
    let base = store.manifest()?.version;
    let mut agreed: Option<(RetrievalConfig, fluxmem_store::Shard)> = None;
    for index in 0..count {
        let shard = fluxmem_store::Shard { index, count };
        // A shard without a staging store, unfinished or stale: the merge says which.
        let Some(manifest) = fluxmem_store::staging_manifest(store.dir(), STAGE, shard)? else {
            continue;
        };
        // The record a shard inherited from the main store is not its own.
        if !fluxmem_store::staged_by(&manifest, STAGE, base) {
            continue;
        }
        let refused = |reason: String| Error::StagedRetrieval {
            path: fluxmem_store::staging_dir(store.dir(), STAGE, shard),
            reason,
        };
        let found = match recorded_retrieval(&manifest) {
            Ok(Some(found)) => found,
            Ok(None) => continue,
            Err(error) => {
                let record = &manifest.progress[RETRIEVAL_MARKER];
                return Err(refused(format!(
                    "its `{RETRIEVAL_MARKER}` record {record} is not a retrieval setting ({error})"
                )));
            }
        };
        match &agreed {
            Some((expected, by)) if expected != &found => {
                let json = |c: &RetrievalConfig| serde_json::to_string(c).expect("serialises");
                return Err(refused(format!(
                    "it grounded with retrieval {}, shard {by} with {}: the merged edges would mix rankings; run every shard with one setting",
                    json(&found),
                    json(expected)
                )));
            }
            Some(_) => {}
            None => agreed = Some((found, shard)),
        }
    }
    Ok(agreed.map(|(config, _)| config))
}

/// The progress that records `config` as the store's retrieval ([`RETRIEVAL_MARKER`]).
pub fn retrieval_progress(config: &RetrievalConfig) -> (String, serde_json::Value) {
    (
        RETRIEVAL_MARKER.to_string(),
        serde_json::to_value(config).expect("a retrieval config serialises"),
    )
}

/// Commits one chunk's edges, with the run's counts so far.
/// Commits `delta`; `grown_seen`: the `episode_grown` edits handled, to record.
fn commit(
    writer: &mut Writer,
    delta: &Graph,
    (run_id, plan): (&str, Option<&str>),
    report: &ConnectReport,
    grown_seen: Option<usize>,
) -> Result<()> {
    let mut summary = serde_json::json!({ "connected": report.connected, "ground_edges": report.ground_edges, "link_edges": report.link_edges });
    if let Some(plan) = plan {
        summary["plan"] = plan.into();
    }
    writer.commit(
        delta,
        CommitInfo {
            stage: STAGE.into(),
            run_id: run_id.into(),
            summary,
            progress: grown_seen
                .map(|n| (GROWN_SEEN.to_string(), serde_json::Value::from(n)))
                .into_iter()
                .chain([retrieval_progress(&report.retrieval)])
                .collect(),
        },
    )?;
    Ok(())
}

/// How many of the night's episodes a group holds whole: as many whole commits as fit the
/// group's share of the budget. The first group's episodes are guessed from the stored node
/// and step shards (their bytes per episode, times [`GroupSize::INFLATION`]); each later group
/// is sized by what the episodes read so far take in memory ([`held_bytes`]).
struct GroupSize {
    share: usize,
    commit_every: usize,
    per_episode: usize,
    measured: (usize, usize),
}

impl GroupSize {
    /// A decoded episode takes about this many times its share of the compressed shards.
    const INFLATION: usize = 20;

    /// `episodes`: the episodes the store holds (the node shards hold the facts too, so this
    /// errs on the large side).
    fn new(
        share: usize,
        manifest: &fluxmem_store::Manifest,
        commit_every: usize,
        episodes: usize,
    ) -> GroupSize {
        let bytes = |table: &str| {
            manifest
                .shards
                .iter()
                .filter(|s| s.table == table)
                .map(|s| s.bytes)
                .sum::<u64>()
        };
        let per_episode =
            ((bytes("nodes") + bytes("steps")) / episodes.max(1) as u64) as usize * Self::INFLATION;
        GroupSize {
            share: share.max(1),
            commit_every,
            per_episode: per_episode.max(1),
            measured: (0, 0),
        }
    }

    /// Episodes of the next group: whole commits, at least one.
    fn episodes(&self) -> usize {
        (self.share / self.per_episode / self.commit_every).max(1) * self.commit_every
    }

    /// Learns from a group's episodes as read.
    fn measured<'n>(&mut self, nodes: impl Iterator<Item = &'n Node>) {
        for node in nodes {
            self.measured.0 += held_bytes(node);
            self.measured.1 += 1;
        }
        if let Some(per_episode) = self.measured.0.checked_div(self.measured.1) {
            self.per_episode = per_episode.max(1);
        }
    }
}

/// About what `node` takes in memory: its strings and steps, with each allocation's
/// bookkeeping, and its metadata at twice its JSON size.
fn held_bytes(node: &Node) -> usize {
    const ALLOCATION: usize = 32;
    let text = |s: &str| s.len() + ALLOCATION;
    let mut bytes = std::mem::size_of::<Node>()
        + text(&node.id.0)
        + text(&node.tenant)
        + text(&node.text)
        + text(&node.source_file)
        + text(&node.source_locator);
    bytes += node.agent_id.as_deref().map_or(0, text);
    bytes += 2 * serde_json::to_string(&node.metadata).map_or(0, |json| json.len());
    if let NodeBody::Episodic(episode) = &node.body {
        for step in &episode.steps {
            bytes += std::mem::size_of::<Step>()
                + text(&step.observation)
                + text(&step.action)
                + step.feedback.as_deref().map_or(0, text);
            for call in &step.tool_calls {
                bytes += std::mem::size_of::<fluxmem_graph::ToolCall>()
                    + text(&call.name)
                    + text(&call.arguments)
                    + call.result.as_deref().map_or(0, text);
            }
        }
    }
    // Its key in the group's map, the map's node, and its entry in the group's id set.
    bytes + 2 * text(&node.id.0) + 64
}

/// The link search: exact cosine kNN of the night's episodes among the stored episodes of
/// their tenant, by streaming the stored vectors (see [`LinkSearch::neighbours`]).
struct LinkSearch<'a> {
    store: &'a fluxmem_store::Store,
    manifest: &'a fluxmem_store::Manifest,
    episodes: &'a IdMap<Seen>,
    tenants: usize,
    model: &'a str,
    /// The model's dimension (sizes the groups; the vectors' own length is checked).
    dim: usize,
    k: usize,
    memory: usize,
    device: &'a Device,
}

/// One tenant's queries of a group, and the stored rows waiting to be scored against them.
#[derive(Default)]
struct TenantQueries {
    ids: Vec<NodeId>,
    vectors: Vec<Vec<f32>>,
    /// The best `k + 1` (cosine, episode) of each query so far, best first, ties by id.
    best: Vec<Vec<(f32, NodeId)>>,
    pending_ids: Vec<NodeId>,
    pending: Vec<Vec<f32>>,
}

impl LinkSearch<'_> {
    /// The `k` nearest episodes of the same tenant (the episode itself left out), best first,
    /// ties by id, of each episode in `todo`: the same neighbours as one index over all the
    /// tenant's vectors (on the CPU a score depends on its query and row alone, bit for bit:
    /// [`DenseIndex::scores`]; a GPU's kernels are not checked for it).
    ///
    /// The episodes are taken in groups that fit half of the memory budget (their vectors and
    /// neighbour lists); for each group, one pass streams every live vector of the model, and
    /// the rows of a tenant are scored in blocks whose score matrix fits the other half. A
    /// night that fits the budget reads the vectors once.
    fn neighbours(&self, todo: &BTreeSet<NodeId>) -> Result<BTreeMap<NodeId, Vec<(NodeId, f32)>>> {
        let mut out = BTreeMap::new();
        let half = (self.memory / 2).max(1);
        // A query's vector, its normalised copy in the scoring, and its best k + 1.
        let per_query = self.dim.max(1) * 8 + (self.k + 1) * 64;
        let group = (half / per_query).max(1);
        let ids: Vec<&NodeId> = todo.iter().collect();
        // Which stored vector rows are live: found once, for every pass.
        let stored = self.store.live(self.manifest, "embeddings")?;
        let mut checked = false;
        for members in ids.chunks(group) {
            let wanted: BTreeSet<NodeId> = members.iter().map(|id| (*id).clone()).collect();
            let mut vectors = self
                .store
                .scan_at(
                    self.manifest,
                    &Scan {
                        vectors: Rows::Of(wanted),
                        ..Default::default()
                    },
                )?
                .embeddings;
            let mut queries: Vec<TenantQueries> = (0..self.tenants)
                .map(|_| TenantQueries::default())
                .collect();
            for id in members {
                let vector = vectors
                    .remove(&((*id).clone(), self.model.to_string()))
                    .ok_or_else(|| Error::NotEmbedded {
                        node: id.to_string(),
                        model: self.model.to_string(),
                    })?
                    .vector;
                let q = &mut queries[self
                    .episodes
                    .get(id.as_str())
                    .expect("a query is an episode")
                    .tenant as usize];
                q.ids.push((*id).clone());
                q.vectors.push(vector);
                q.best.push(Vec::new());
            }
            drop(vectors);
            for q in &queries {
                let dim = q.vectors.first().map_or(0, Vec::len);
                if let Some((id, v)) = q.ids.iter().zip(&q.vectors).find(|(_, v)| v.len() != dim) {
                    return Err(Error::Dimension {
                        node: id.to_string(),
                        model: self.model.to_string(),
                        expected: dim,
                        got: v.len(),
                    });
                }
            }
            // The other half is shared by the tenants with queries in the group (each holds a
            // block of rows and its scores).
            let active = queries.iter().filter(|q| !q.ids.is_empty()).count().max(1);
            let seen = self.stream(&stored, &mut queries, half / active)?;
            if !checked {
                self.check_embedded(&stored, &seen)?;
                checked = true;
            }
            for q in queries {
                for (id, best) in q.ids.into_iter().zip(q.best) {
                    let links: Vec<(NodeId, f32)> = best
                        .into_iter()
                        .filter(|(_, n)| *n != id)
                        .take(self.k)
                        .map(|(c, n)| (n, c))
                        .collect();
                    out.insert(id, links);
                }
            }
        }
        Ok(out)
    }

    /// One pass over the live vectors of the model, scoring each tenant's stored episodes
    /// against its queries, each tenant's blocks within `share` bytes; returns how many episode
    /// vectors each tenant has.
    fn stream(
        &self,
        stored: &Live<'_>,
        queries: &mut [TenantQueries],
        share: usize,
    ) -> Result<Vec<usize>> {
        let mut seen = vec![0usize; self.tenants];
        let mut failure: Option<Error> = None;
        stored.embeddings(&mut |embedding| {
            if failure.is_some() || embedding.model_id != self.model {
                return;
            }
            // Vectors of the semantic nodes and of nodes no longer in the store are not linked.
            let Some(episode) = self.episodes.get(embedding.node_id.as_str()) else {
                return;
            };
            let tenant = episode.tenant as usize;
            seen[tenant] += 1;
            let q = &mut queries[tenant];
            // With `k = 0` the pass only counts (every episode must still be embedded).
            if q.ids.is_empty() || self.k == 0 {
                return;
            }
            q.pending_ids.push(embedding.node_id);
            q.pending.push(embedding.vector);
            if q.pending.len() >= self.block_rows(q.ids.len(), share) {
                if let Err(e) = self.score(q) {
                    failure = Some(e);
                }
            }
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        for q in queries.iter_mut().filter(|q| !q.pending.is_empty()) {
            self.score(q)?;
        }
        Ok(seen)
    }

    /// Stored rows scored at once against `queries` queries: their score matrix (held twice,
    /// as a tensor and as rows) and their vectors (raw and normalised) fit in `share`.
    fn block_rows(&self, queries: usize, share: usize) -> usize {
        (share / (8 * queries + 8 * self.dim.max(1))).clamp(MIN_ROWS, BLOCK_ROWS)
    }

    /// Scores the pending rows against the tenant's queries and keeps the best `k + 1` of each.
    fn score(&self, q: &mut TenantQueries) -> Result<()> {
        let dim = q.vectors[0].len();
        if let Some((id, v)) = q
            .pending_ids
            .iter()
            .zip(&q.pending)
            .find(|(_, v)| v.len() != dim)
        {
            return Err(Error::Dimension {
                node: id.to_string(),
                model: self.model.to_string(),
                expected: dim,
                got: v.len(),
            });
        }
        let index = DenseIndex::new(&q.pending, dim, self.device)?;
        let keep = self.k + 1;
        for (best, scores) in q.best.iter_mut().zip(index.scores(&q.vectors)?) {
            let order =
                |a: &(f32, &NodeId), b: &(f32, &NodeId)| b.0.total_cmp(&a.0).then(a.1.cmp(b.1));
            // Only a row at least as good as the query's `k + 1`-th best so far can enter (an
            // equal score may win its tie by id).
            let floor = (best.len() == keep).then(|| best[keep - 1].0);
            let mut ranked: Vec<(f32, &NodeId)> = scores
                .into_iter()
                .zip(&q.pending_ids)
                .filter(|(s, _)| floor.is_none_or(|f| s.total_cmp(&f).is_ge()))
                .collect();
            if keep < ranked.len() {
                ranked.select_nth_unstable_by(keep - 1, order);
                ranked.truncate(keep);
            }
            let mut merged: Vec<(f32, &NodeId)> =
                best.iter().map(|(c, n)| (*c, n)).chain(ranked).collect();
            merged.sort_by(order);
            merged.truncate(keep);
            *best = merged.into_iter().map(|(c, n)| (c, n.clone())).collect();
        }
        q.pending.clear();
        q.pending_ids.clear();
        Ok(())
    }

    /// Every episode has a vector of the model: each tenant's count of vectors is its count of
    /// episodes (one row per node and model); otherwise the first episode without one, in id
    /// order, is named (found in the stored keys, no vector decoded).
    fn check_embedded(&self, stored: &Live<'_>, seen: &[usize]) -> Result<()> {
        let mut episodes = vec![0usize; self.tenants];
        self.episodes
            .values()
            .for_each(|e| episodes[e.tenant as usize] += 1);
        if episodes == seen {
            return Ok(());
        }
        let mut have = IdSet::default();
        stored.embedding_keys(&mut |node, model, _| {
            if model == self.model && self.episodes.contains(node) {
                have.insert(node);
            }
        })?;
        let missing = self
            .episodes
            .iter()
            .map(|(id, _)| id)
            .filter(|id| !have.contains(id))
            .min()
            .expect("a tenant has fewer vectors than episodes");
        Err(Error::NotEmbedded {
            node: missing,
            model: self.model.to_string(),
        })
    }
}

/// Episodes this stage connected before: a `ground` edge into them or a Stage I `link` out
/// (Stage I edges, whoever updated them last: credit assignment re-weights them; links with a
/// `relation` come from Stage II and do not make an episode connected). Streamed over the live
/// edges' ends: what stays in memory is the episodes, not the edges, and the keys of the
/// edges of the `grown` episodes.
fn connected_episodes(
    store: &fluxmem_store::Store,
    manifest: &fluxmem_store::Manifest,
    grown: &BTreeSet<NodeId>,
) -> Result<(IdSet, BTreeSet<EdgeKey>)> {
    let mut connected = IdSet::default();
    let mut existing = BTreeSet::new();
    store.live(manifest, "edges")?.edge_ends(
        &[EdgeKind::Ground, EdgeKind::Link],
        &mut |src, dst, kind, relation| {
            if grown.contains(src) || grown.contains(dst) {
                existing.insert(EdgeKey {
                    src: NodeId(src.to_string()),
                    dst: NodeId(dst.to_string()),
                    kind,
                });
            }
            let episode = match kind {
                _ if relation => return,
                EdgeKind::Ground => dst,
                EdgeKind::Link => src,
                EdgeKind::Distill => return,
            };
            connected.insert(episode);
        },
    )?;
    Ok((connected, existing))
}

/// The retrieval queries of an episode: its step observations, or its task.
fn ground_queries<'g>(graph: &'g Graph, episode: &NodeId, per_step: bool) -> Vec<&'g str> {
    let node = &graph.nodes[episode];
    let mut queries: Vec<&str> = Vec::new();
    if per_step {
        queries.extend(
            node.episode()
                .into_iter()
                .flat_map(|e| &e.steps)
                .map(|s| s.observation.as_str())
                .filter(|o| !o.trim().is_empty()),
        );
    }
    if queries.is_empty() {
        queries.push(node.text.as_str());
    }
    queries
}

/// The semantic nodes that support an episode, from its queries' rankings (each its best
/// `ground_k`): node -> (best fused score, queries retrieving it, node time).
fn ground(
    rankings: impl Iterator<Item = Vec<(NodeId, f32, i64)>>,
) -> BTreeMap<NodeId, (f32, i64, i64)> {
    let mut support: BTreeMap<NodeId, (f32, i64, i64)> = BTreeMap::new();
    for ranked in rankings {
        for (node, score, time) in ranked {
            let entry = support.entry(node).or_insert((score, 0, time));
            entry.0 = entry.0.max(score);
            entry.1 += 1;
        }
    }
    support
}

/// How connect finds an episode's facts: one index per tenant held whole, or the facts
/// spilled to scratch partitions when they do not fit (see `facts.rs`).
enum FactSearch {
    Whole(BTreeMap<String, SemanticIndex>),
    Spilled(SpilledFacts),
}

impl FactSearch {
    /// What the dense signal reads of a query of `tenant` ([`SemanticIndex::dense_query`]).
    fn dense_query(&self, tenant: &str, query: &str, config: &RetrievalConfig) -> Option<String> {
        match self {
            FactSearch::Whole(semantic) => semantic.get(tenant)?.dense_query(query, config),
            FactSearch::Spilled(spilled) => spilled.dense_query(tenant, query, config),
        }
    }

    /// The partitions the facts were spilled to; 0 when they are held whole.
    fn partitions(&self) -> usize {
        match self {
            FactSearch::Whole(_) => 0,
            FactSearch::Spilled(spilled) => spilled.partitions(),
        }
    }
}

/// An edge of this stage, between two nodes given with their `created_at`. Its time is the
/// later of the two (the moment the connection became possible), not the wall clock, so the
/// same store always gives the same shards.
fn edge(
    src: (&NodeId, i64),
    dst: (&NodeId, i64),
    kind: EdgeKind,
    weight: f32,
    evidence: i64,
    run_id: &str,
) -> Edge {
    Edge {
        src: src.0.clone(),
        dst: dst.0.clone(),
        kind,
        weight,
        evidence,
        stage: STAGE.into(),
        run_id: run_id.into(),
        created_at: src.1.max(dst.1),
        active: true,
        metadata: Default::default(),
    }
}
