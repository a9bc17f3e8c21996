//! The query-time loop of Stage II: verify the context, attribute the failure, edit, repeat.
//!
//! Round `t` (0-based) arranges the Stage I ranking with the graph's refine links, packs it
//! under the fixed budget and asks the [`Verifier`] whether it suffices. If it does, or after
//! `rounds` edits, the loop ends. Otherwise the failure is attributed and one edit is applied:
//!
//! | attribution        | when                                                        | edit          |
//! |--------------------|-------------------------------------------------------------|---------------|
//! | over-connection    | at least a third of the items score below the distractor mark | Link Prune  |
//! | redundancy         | two useful items' vectors have a cosine of at least `merge_above` | Node Reshape (coarser) |
//! | granularity        | a useful item is shorter than `reshape_below` tokens and has a preceding item in its source | Node Reshape (finer) |
//! | under-connection   | otherwise                                                   | Link Expand   |
//!
//! (If the chosen edit finds nothing to do, the next one in the order prune, expand is tried.)
//!
//! **An edit stays only when it helps, by the verifier's own judgement**: the next round's
//! context must score strictly higher than the one before the edit. If it does not, the edit is
//! undone (the delta, this query's prunes, swaps and links return to what they were) and the
//! loop ends on the context before it, with the attribution `no gain`: a verifier that cannot
//! tell what would help leaves the Stage I context as it was.
//!
//! - **Link Expand** gathers inactive nodes: the query's next dense/hybrid candidates not in the
//!   context, the BM25 matches of the feedback (the key terms the verifier found missing), and
//!   graph neighbours of the best items (the turns before and after them in the same source
//!   group, and their active edges). The verifier scores them; the best `expand_k` that are not
//!   distractors get a `link` edge (`relation: expand`) from the item that led to them. In this
//!   query's context each takes the place of the item the verifier scored lowest (not an
//!   anchor), which moves to the end of the ranking: under the fixed budget an expansion swaps
//!   the weakest items by the verifier's judgement out, and leaves the order of the rest alone.
//!   Later queries anchored on the same item see a kept link's item right after it.
//! - **Link Prune** removes the weakest `prune_k` distractors from this query's context and
//!   records an active `link` edge (`relation: prune`, a suppression) from the best item to
//!   each, so later queries anchored on the same item leave them out; an expand link to a
//!   distractor is deactivated and marked `pruned`. Undoing either edit lifts the prune.
//! - **Node Reshape** (coarser) merges two redundant useful items into one summary node (with a
//!   generator: its one-line merge of the two; without: the first text and the sentences of the
//!   second that the first does not already say), re-embeds it, copies both originals' edges,
//!   records `merged_from` and `covers` (the originals' turns: provenance), and links each
//!   original -> the summary (`relation: reshaped_into`), so rankings show the summary once in
//!   the place of the better original and the budget the other held goes to the next item.
//! - **Node Reshape** (finer) makes a new semantic node holding the preceding item of the same
//!   source group and the item (with a generator: the generator's self-contained rewrite of the
//!   two), re-embeds it, copies the old node's edges, records `reshaped_from` and `covers`, and
//!   links old -> new (`relation: reshaped_into`) so rankings show the new node in its place.
//!
//! The edits live in a delta over the graph while the loop runs. They persist (the caller
//! applies [`LoopOutcome::delta`], edit log included) only when the loop ends with a sufficient
//! context; the links that made it into that context gain weight and evidence. A failed loop
//! leaves the graph as it was, but its last context is still what the query gets.

use fluxmem_connect::{line, pack, Candidate, Context, Entry, SemanticIndex, Signals};
use fluxmem_graph::{
    sha256_hex, Changed, Edge, EdgeKey, EdgeKind, Edit, Embedding, Graph, Node, NodeBody, NodeId,
};
use fluxmem_models::{ChatMessage, Embedder, GenerateParams, Generator};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

use crate::verify::Verifier;
use crate::Result;

/// The stage name on edges, nodes and edits made by Stage II.
pub const STAGE: &str = "refine";

/// The cosine at which two useful context items count as redundant (near-duplicates for a
/// sentence embedder; set before any run, not tuned).
pub const DEFAULT_MERGE_ABOVE: f32 = 0.9;

/// Loop settings.
#[derive(Debug, Clone, Serialize)]
pub struct LoopOptions {
    /// Maximum edit rounds T (0: Stage I only).
    pub rounds: usize,
    /// Token budget of the context (fixed across rounds).
    pub budget: usize,
    /// How many of the best items anchor expansion, links and prunes.
    pub anchors: usize,
    /// Nodes brought in per expansion.
    pub expand_k: usize,
    /// Distractors cut per prune (the weakest first).
    pub prune_k: usize,
    /// Candidates gathered per expansion source.
    pub expand_pool: usize,
    /// A useful item shorter than this (tokens) is a reshape candidate (0: never reshape).
    pub reshape_below: usize,
    /// Two useful items whose vectors have at least this cosine are redundant: Node Reshape
    /// (coarser) merges them (0: never merge).
    pub merge_above: f32,
    /// Weight of a new expand link.
    pub link_weight: f32,
    /// Weight gained by a link present in a sufficient context: w += gain * (1 - w).
    pub gain: f32,
    /// The sufficiency score at which the loop stops (`None`: the verifier's own,
    /// [`Verifier::sufficient_at`]).
    pub sufficient_at: Option<f32>,
}

impl Default for LoopOptions {
    fn default() -> Self {
        LoopOptions {
            rounds: 5,
            budget: 1024,
            anchors: 3,
            expand_k: 3,
            prune_k: 3,
            expand_pool: 10,
            reshape_below: 12,
            merge_above: DEFAULT_MERGE_ABOVE,
            link_weight: 0.5,
            gain: 0.2,
            sufficient_at: None,
        }
    }
}

/// One round of the loop, for the report.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    /// The verifier's sufficiency score of this round's context.
    pub sufficiency: f32,
    /// Items in the context.
    pub items: usize,
    /// `sufficient`, `over-connection`, `redundancy`, `granularity`, `under-connection`, `stuck`
    /// (no edit found) or `no gain` (the last edit was undone: the loop ended on the context
    /// before it).
    pub attribution: String,
    /// The edit applied after this round (`link_prune`, `node_merge`, `node_reshape`,
    /// `link_expand`), if any.
    pub edit: Option<String>,
    /// The edit did not raise the verifier's score of the context, and was undone.
    pub undone: bool,
    /// The nodes of this round's context, in order (what the edit after it changed).
    pub context: Vec<NodeId>,
}

/// What the loop produced.
#[derive(Debug, Clone)]
pub struct LoopOutcome {
    /// The final arranged ranking.
    pub ranking: Vec<Entry>,
    /// The final context (packed under the budget).
    pub context: Context,
    /// The rounds, in order.
    pub rounds: Vec<Round>,
    /// True when the last context was judged sufficient.
    pub sufficient: bool,
    /// The changes to persist (nodes, edges, embeddings, edit log); empty when not sufficient.
    pub delta: Graph,
    /// Edits attempted, including those of a failed loop (which are not in `delta`).
    pub attempted: Vec<Edit>,
    /// Nodes the loop created (reshaped and merged nodes), kept or not: the final context may
    /// show them, so pack against a graph that has them.
    pub new_nodes: Vec<Node>,
}

/// Models and settings the loop needs beyond the graph.
pub struct LoopModels<'a> {
    /// Feedback.
    pub verifier: &'a mut dyn Verifier,
    /// Re-embeds reshaped and merged nodes (the store's embedding model; its vectors also tell
    /// redundant items).
    pub embedder: &'a dyn Embedder,
    /// Rewrites reshaped and merged nodes; `None`: the deterministic reshape (the two texts
    /// joined) and merge (the second's new sentences appended to the first).
    pub generator: Option<&'a mut dyn Generator>,
    /// Counts tokens of context lines (the budget's tokenizer).
    pub count_tokens: &'a dyn Fn(&str) -> fluxmem_connect::Result<usize>,
}

/// Positions of one tenant's semantic nodes in their source groups, for graph-neighbour
/// expansion (two tenants may hold sources of the same name: neither sees the other's).
pub struct Neighbours {
    by_position: BTreeMap<(String, String, i64), NodeId>,
}

impl Neighbours {
    /// Indexes the semantic nodes of `tenant` in `graph` by (source, group, position);
    /// reshaped nodes are left out (they are not turns of their own).
    pub fn build(graph: &Graph, tenant: &str) -> Neighbours {
        let by_position = graph
            .nodes
            .values()
            .filter(|n| n.tenant == tenant && !n.metadata.contains_key("reshaped_from"))
            .filter_map(|n| match &n.body {
                NodeBody::Semantic(s) => Some((
                    (
                        s.source.clone(),
                        s.group.clone().unwrap_or_default(),
                        s.position,
                    ),
                    n.id.clone(),
                )),
                _ => None,
            })
            .collect();
        Neighbours { by_position }
    }

    /// The node `offset` positions away from `node` in the same source group.
    pub fn at(&self, node: &Node, offset: i64) -> Option<&NodeId> {
        let NodeBody::Semantic(s) = &node.body else {
            return None;
        };
        self.by_position.get(&(
            s.source.clone(),
            s.group.clone().unwrap_or_default(),
            s.position + offset,
        ))
    }
}

/// The graph as the loop sees it: the base graph with the loop's delta on top.
struct View<'g> {
    base: &'g Graph,
    delta: Graph,
    /// The tenant the loop runs in: nothing of another tenant enters a ranking or an edit.
    tenant: &'g str,
}

impl View<'_> {
    fn node(&self, id: &NodeId) -> Option<&Node> {
        self.delta.nodes.get(id).or_else(|| self.base.nodes.get(id))
    }

    /// The node, when it exists and belongs to the loop's tenant.
    fn own(&self, id: &NodeId) -> Option<&Node> {
        self.node(id).filter(|n| n.tenant == self.tenant)
    }

    /// The node's vector under `model` (the delta's first: a reshaped node's).
    fn vector(&self, id: &NodeId, model: &str) -> Option<&[f32]> {
        let key = (id.clone(), model.to_string());
        self.delta
            .embeddings
            .get(&key)
            .or_else(|| self.base.embeddings.get(&key))
            .map(|e| e.vector.as_slice())
    }

    fn edge(&self, key: &EdgeKey) -> Option<&Edge> {
        self.delta
            .edges
            .get(key)
            .or_else(|| self.base.edges.get(key))
    }

    /// Edges out of `src` (delta versions win), in key order.
    fn edges_from(&self, src: &NodeId) -> Vec<&Edge> {
        let start = EdgeKey {
            src: src.clone(),
            dst: NodeId(String::new()),
            kind: EdgeKind::Ground,
        };
        let mut out: BTreeMap<&EdgeKey, &Edge> = BTreeMap::new();
        for graph in [self.base, &self.delta] {
            for (key, edge) in graph
                .edges
                .range(start.clone()..)
                .take_while(|(k, _)| &k.src == src)
            {
                out.insert(key, edge);
            }
        }
        out.into_values().collect()
    }

    fn edges_touching(&self, id: &NodeId) -> Vec<Edge> {
        let mut out: BTreeMap<EdgeKey, Edge> = BTreeMap::new();
        for graph in [self.base, &self.delta] {
            for (key, edge) in graph
                .edges
                .iter()
                .filter(|(k, _)| &k.src == id || &k.dst == id)
            {
                out.insert(key.clone(), edge.clone());
            }
        }
        out.into_values().collect()
    }

    fn set_edge(&mut self, edge: Edge, kind: &str, reason: &str, run_id: &str, at: i64) -> Edit {
        let before = self.edge(&edge.key()).cloned();
        let edit = Edit::new(
            STAGE,
            run_id,
            kind,
            Changed::Edge(before.as_ref(), Some(&edge)),
            reason,
            at,
        );
        self.delta.upsert_edge(edge);
        edit
    }
}

fn relation(edge: &Edge) -> Option<&str> {
    edge.metadata.get("relation").and_then(Value::as_str)
}

/// Runs the loop for one query in the tenant of `index` (and of `neighbours`, built for the
/// same tenant). `stage1` is the Stage I ranking (best first); candidates of another tenant in
/// it, and edges to another tenant's nodes, are ignored. `graph` is not changed: apply
/// [`LoopOutcome::delta`] to persist.
#[allow(clippy::too_many_arguments)]
pub fn refine_query(
    graph: &Graph,
    index: &SemanticIndex,
    neighbours: &Neighbours,
    query: &str,
    stage1: &[Candidate],
    models: &mut LoopModels<'_>,
    options: &LoopOptions,
    run_id: &str,
    at: i64,
) -> Result<LoopOutcome> {
    let mut view = View {
        base: graph,
        delta: Graph::default(),
        tenant: index.tenant(),
    };
    let mut excluded: BTreeSet<NodeId> = BTreeSet::new();
    let mut rounds: Vec<Round> = Vec::new();
    let mut attempted = Vec::new();
    let mut created_links: Vec<EdgeKey> = Vec::new();
    // This query's swaps: (item out, item in), each new item in the place of the context item
    // the verifier scored lowest.
    let mut swaps: Vec<(NodeId, NodeId)> = Vec::new();
    // The loop's state before the last edit, with the verifier's score of its context.
    let mut before_edit: Option<BeforeEdit> = None;
    loop {
        let ranking = swap(arrange(&view, stage1, &excluded, options.anchors), &swaps);
        let context = pack_view(&view, &ranking, options.budget, models.count_tokens)?;
        let sufficiency = models.verifier.sufficient(query, &context.text())?;
        // An edit stays only when the verifier scores the context it made higher than the one
        // before it; otherwise it is undone and the loop stops (it cannot tell what would help).
        if let Some(kept) = before_edit.take() {
            let before = kept.sufficiency;
            if sufficiency <= before {
                view.delta = kept.delta;
                excluded = kept.excluded;
                swaps = kept.swaps;
                created_links.truncate(kept.links);
                if let Some(last) = rounds.last_mut() {
                    last.undone = true;
                }
                let ranking = swap(arrange(&view, stage1, &excluded, options.anchors), &swaps);
                let context = pack_view(&view, &ranking, options.budget, models.count_tokens)?;
                return Ok(unfinished(
                    &view, ranking, context, rounds, before, "no gain", attempted,
                ));
            }
        }
        let sufficient = sufficiency
            >= options
                .sufficient_at
                .unwrap_or_else(|| models.verifier.sufficient_at());
        if sufficient || rounds.len() >= options.rounds {
            let attribution = if sufficient {
                "sufficient"
            } else {
                "out of rounds"
            };
            rounds.push(Round {
                sufficiency,
                items: context.items.len(),
                attribution: attribution.into(),
                edit: None,
                undone: false,
                context: ids(&context),
            });
            let new_nodes = view.delta.nodes.values().cloned().collect();
            let delta = if sufficient {
                persist(
                    view,
                    &context,
                    &attempted,
                    &created_links,
                    options,
                    run_id,
                    at,
                )
            } else {
                Graph::default()
            };
            return Ok(LoopOutcome {
                ranking,
                context,
                rounds,
                sufficient,
                delta,
                attempted,
                new_nodes,
            });
        }
        before_edit = Some(BeforeEdit {
            delta: view.delta.clone(),
            excluded: excluded.clone(),
            swaps: swaps.clone(),
            links: created_links.len(),
            sufficiency,
        });
        let lines: Vec<&str> = context.items.iter().map(|i| i.line.as_str()).collect();
        let scores = models.verifier.item_scores(query, &lines)?;
        let below = models.verifier.distractor_below();
        let distractors: Vec<usize> = (0..scores.len()).filter(|&i| scores[i] < below).collect();
        let reshape: Option<usize> = (options.reshape_below > 0)
            .then(|| {
                (0..scores.len()).find(|&i| {
                    scores[i] >= below
                        && context.items[i].tokens < options.reshape_below
                        && view
                            .node(&context.items[i].node_id)
                            .is_some_and(|n| reshapable(&view, neighbours, n))
                })
            })
            .flatten();
        let redundant = (options.merge_above > 0.0)
            .then(|| {
                redundant_pair(
                    &view,
                    &context,
                    &scores,
                    below,
                    models.embedder.model_id(),
                    options.merge_above,
                )
            })
            .flatten();
        let mut order: Vec<&str> = Vec::new();
        if !distractors.is_empty() && distractors.len() * 3 >= context.items.len() {
            order.push("over-connection");
        } else if redundant.is_some() {
            order.push("redundancy");
        } else if reshape.is_some() {
            order.push("granularity");
        } else {
            order.push("under-connection");
        }
        for fallback in ["over-connection", "under-connection"] {
            if !order.contains(&fallback)
                && (fallback != "over-connection" || !distractors.is_empty())
            {
                order.push(fallback);
            }
        }
        let mut applied = None;
        for attribution in &order {
            let edits = match *attribution {
                "over-connection" => prune(
                    &mut view,
                    &context,
                    &distractors,
                    options.prune_k,
                    &mut excluded,
                    query,
                    run_id,
                    at,
                ),
                "redundancy" => {
                    let (first, second) = redundant.expect("redundancy only with a pair");
                    let pair = [
                        &context.items[first].node_id,
                        &context.items[second].node_id,
                    ];
                    merge_nodes(&mut view, pair, models, query, run_id, at)?
                }
                "granularity" => {
                    let item = &context.items[reshape.expect("granularity only with a candidate")];
                    reshape_node(
                        &mut view,
                        neighbours,
                        &item.node_id,
                        models,
                        query,
                        run_id,
                        at,
                    )?
                }
                _ => {
                    let before = created_links.len();
                    let edits = expand(
                        &mut view,
                        index,
                        neighbours,
                        query,
                        stage1,
                        &context,
                        &excluded,
                        models,
                        options,
                        run_id,
                        at,
                        &mut created_links,
                    )?;
                    let brought: Vec<NodeId> = created_links[before..]
                        .iter()
                        .map(|key| key.dst.clone())
                        .collect();
                    swaps.extend(make_room(
                        &context,
                        &scores,
                        options.anchors,
                        &swaps,
                        brought,
                    ));
                    edits
                }
            };
            if !edits.is_empty() {
                let kind = edits[0].kind.clone();
                attempted.extend(edits);
                applied = Some((attribution.to_string(), kind));
                break;
            }
        }
        match applied {
            Some((attribution, kind)) => {
                rounds.push(Round {
                    sufficiency,
                    items: context.items.len(),
                    attribution,
                    edit: Some(kind),
                    undone: false,
                    context: ids(&context),
                });
            }
            None => {
                return Ok(unfinished(
                    &view,
                    ranking,
                    context,
                    rounds,
                    sufficiency,
                    "stuck",
                    attempted,
                ));
            }
        }
    }
}

/// The outcome of a loop that ends without a sufficient context (`attribution`: why), on
/// `context`: nothing persists.
fn unfinished(
    view: &View<'_>,
    ranking: Vec<Entry>,
    context: Context,
    mut rounds: Vec<Round>,
    sufficiency: f32,
    attribution: &str,
    attempted: Vec<Edit>,
) -> LoopOutcome {
    rounds.push(Round {
        sufficiency,
        items: context.items.len(),
        attribution: attribution.into(),
        edit: None,
        undone: false,
        context: ids(&context),
    });
    LoopOutcome {
        ranking,
        context,
        rounds,
        sufficient: false,
        delta: Graph::default(),
        attempted,
        new_nodes: view.delta.nodes.values().cloned().collect(),
    }
}

/// The loop's state before an edit, to undo it when it brings no gain.
struct BeforeEdit {
    delta: Graph,
    excluded: BTreeSet<NodeId>,
    swaps: Vec<(NodeId, NodeId)>,
    /// Links created before the edit.
    links: usize,
    /// The verifier's score of the context before the edit.
    sufficiency: f32,
}

fn ids(context: &Context) -> Vec<NodeId> {
    context
        .items
        .iter()
        .map(|item| item.node_id.clone())
        .collect()
}

/// The Stage I ranking with the graph's refine links applied: reshaped nodes take their
/// originals' place, nodes pruned from one of the anchors (the `anchors` best) or from this
/// query are left out, and nodes linked from an anchor by an active expand link follow it.
fn arrange(
    view: &View<'_>,
    stage1: &[Candidate],
    excluded: &BTreeSet<NodeId>,
    anchors: usize,
) -> Vec<Entry> {
    let substitute = |id: &NodeId| -> (NodeId, Option<NodeId>) {
        let mut current = id.clone();
        let mut from = None;
        // Follow reshape chains (bounded, in case of a cycle in hand-made data).
        for _ in 0..8 {
            let next = view
                .edges_from(&current)
                .into_iter()
                .find(|e| e.active && relation(e) == Some("reshaped_into"))
                .map(|e| e.dst.clone());
            match next {
                Some(next) if view.own(&next).is_some() => {
                    from.get_or_insert_with(|| current.clone());
                    current = next;
                }
                _ => break,
            }
        }
        (current, from)
    };
    let entry = |c: &Candidate| -> Entry {
        let (id, from) = substitute(&c.node_id);
        let mut why = format!(
            "semantic match: cosine {:.3}, bm25 {:.2}, fused {:.3}{}",
            c.signals.dense,
            c.signals.bm25,
            c.score,
            fluxmem_connect::structure_note(c)
        );
        if let Some(from) = from {
            why.push_str(&format!("; reshaped from {from}"));
        }
        (id, c.signals, c.score, why)
    };
    let base: Vec<Entry> = stage1
        .iter()
        .map(entry)
        .filter(|(id, ..)| !excluded.contains(id) && view.own(id).is_some())
        .collect();
    let anchor_ids: Vec<NodeId> = base
        .iter()
        .take(anchors)
        .map(|(id, ..)| id.clone())
        .collect();
    let mut pruned: BTreeSet<NodeId> = BTreeSet::new();
    let mut linked: BTreeMap<NodeId, Vec<(NodeId, f32)>> = BTreeMap::new();
    for anchor in &anchor_ids {
        for edge in view.edges_from(anchor) {
            let cut = edge.metadata.get("pruned").and_then(Value::as_bool) == Some(true);
            match (relation(edge), edge.active) {
                (Some("prune"), true) | (Some("expand"), false)
                    if (relation(edge) == Some("prune") || cut)
                        && !anchor_ids.contains(&edge.dst) =>
                {
                    pruned.insert(edge.dst.clone());
                }
                (Some("expand"), true)
                    if !excluded.contains(&edge.dst) && view.own(&edge.dst).is_some() =>
                {
                    linked
                        .entry(anchor.clone())
                        .or_default()
                        .push((edge.dst.clone(), edge.weight));
                }
                _ => {}
            }
        }
    }
    let mut out: Vec<Entry> = Vec::new();
    let mut seen: BTreeSet<NodeId> = BTreeSet::new();
    for (id, signals, score, why) in base {
        if pruned.contains(&id) || !seen.insert(id.clone()) {
            continue;
        }
        let follows = linked.remove(&id);
        out.push((id.clone(), signals, score, why));
        let mut follows = follows.unwrap_or_default();
        follows.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for (dst, weight) in follows {
            if !pruned.contains(&dst) && seen.insert(dst.clone()) {
                let why = format!("linked from {id} by refine (expand link, weight {weight:.2})");
                out.push((dst, Signals::default(), score, why));
            }
        }
    }
    out
}

/// Pairs each item an expansion brought in (best first) with the context item it replaces: the
/// ones the verifier scored lowest (the later first among equals), never an anchor, an item
/// already swapped or one brought in.
fn make_room(
    context: &Context,
    scores: &[f32],
    anchors: usize,
    swaps: &[(NodeId, NodeId)],
    brought: Vec<NodeId>,
) -> Vec<(NodeId, NodeId)> {
    let taken =
        |id: &NodeId| swaps.iter().any(|(out, inn)| out == id || inn == id) || brought.contains(id);
    let mut weakest: Vec<usize> = (anchors.min(context.items.len())..context.items.len())
        .filter(|&i| !taken(&context.items[i].node_id))
        .collect();
    weakest.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(b.cmp(&a)));
    weakest
        .into_iter()
        .zip(brought)
        .map(|(i, inn)| (context.items[i].node_id.clone(), inn))
        .collect()
}

/// Applies this query's swaps to a ranking: each item brought in takes the place of the item it
/// replaces, which moves to the end (it comes back only if the budget has room).
fn swap(mut ranking: Vec<Entry>, swaps: &[(NodeId, NodeId)]) -> Vec<Entry> {
    let mut moved_out = Vec::new();
    for (out, inn) in swaps {
        let (Some(at_out), Some(at_in)) = (
            ranking.iter().position(|e| &e.0 == out),
            ranking.iter().position(|e| &e.0 == inn),
        ) else {
            continue;
        };
        let entry_in = ranking.remove(at_in);
        let at_out = if at_in < at_out { at_out - 1 } else { at_out };
        let entry_out = std::mem::replace(&mut ranking[at_out], entry_in);
        moved_out.push(entry_out);
    }
    ranking.extend(moved_out);
    ranking
}

/// Packs entries whose nodes may live in the delta.
fn pack_view(
    view: &View<'_>,
    ranking: &[Entry],
    budget: usize,
    count: &dyn Fn(&str) -> fluxmem_connect::Result<usize>,
) -> Result<Context> {
    // Enough of the ranking to fill any budget: every entry costs at least one token.
    let head = &ranking[..ranking.len().min(budget.max(1))];
    let mut nodes = Graph::default();
    for (id, ..) in head {
        if let Some(node) = view.node(id) {
            nodes.insert_node(node.clone());
        }
    }
    Ok(pack(&nodes, head, budget, count)?)
}

#[allow(clippy::too_many_arguments)] // the edit's inputs and its record's (query, run, time)
fn prune(
    view: &mut View<'_>,
    context: &Context,
    distractors: &[usize],
    limit: usize,
    excluded: &mut BTreeSet<NodeId>,
    query: &str,
    run_id: &str,
    at: i64,
) -> Vec<Edit> {
    let Some(anchor) = context
        .items
        .iter()
        .enumerate()
        .find(|(i, _)| !distractors.contains(i))
        .map(|(_, item)| item.node_id.clone())
    else {
        // Everything is a distractor: nothing to anchor a prune on; leave them for expansion.
        return Vec::new();
    };
    let mut edits = Vec::new();
    // The weakest distractors first (they sit last in the context), at most `limit` per round.
    for &i in distractors.iter().rev().take(limit) {
        let target = context.items[i].node_id.clone();
        if target == anchor || !excluded.insert(target.clone()) {
            continue;
        }
        let key = EdgeKey {
            src: anchor.clone(),
            dst: target.clone(),
            kind: EdgeKind::Link,
        };
        let mut edge = match view.edge(&key).cloned() {
            // An expand link to a distractor is cut: deactivated and marked pruned.
            Some(mut existing) if relation(&existing) == Some("expand") => {
                existing.active = false;
                existing.metadata.insert("pruned".into(), true.into());
                existing
            }
            // Otherwise the prune is recorded as an active `prune` link (a suppression); undoing
            // it deactivates the link and lifts the prune.
            _ => new_link(view, &anchor, &target, 0.0, "prune", run_id, at),
        };
        edge.stage = STAGE.into();
        edge.run_id = run_id.into();
        let reason = format!(
            "over-connection: the verifier scored this item as a distractor for query {:?}",
            clip(query)
        );
        edits.push(view.set_edge(edge, "link_prune", &reason, run_id, at));
    }
    edits
}

#[allow(clippy::too_many_arguments)]
fn expand(
    view: &mut View<'_>,
    index: &SemanticIndex,
    neighbours: &Neighbours,
    query: &str,
    stage1: &[Candidate],
    context: &Context,
    excluded: &BTreeSet<NodeId>,
    models: &mut LoopModels<'_>,
    options: &LoopOptions,
    run_id: &str,
    at: i64,
    created: &mut Vec<EdgeKey>,
) -> Result<Vec<Edit>> {
    let in_context: BTreeSet<&NodeId> = context.items.iter().map(|i| &i.node_id).collect();
    let Some(top) = context.items.first().map(|i| i.node_id.clone()) else {
        return Ok(Vec::new());
    };
    let mut pool: Vec<(NodeId, NodeId, &'static str)> = Vec::new(); // (candidate, anchor, source)
    let add = |pool: &mut Vec<(NodeId, NodeId, &'static str)>,
               id: &NodeId,
               anchor: &NodeId,
               source: &'static str| {
        if !in_context.contains(id)
            && !excluded.contains(id)
            && !pool.iter().any(|(c, ..)| c == id)
            && view.own(id).is_some()
        {
            pool.push((id.clone(), anchor.clone(), source));
        }
    };
    // Graph neighbours of the best items: adjacent turns, then their active edges.
    for item in context.items.iter().take(options.anchors) {
        let Some(node) = view.node(&item.node_id).cloned() else {
            continue;
        };
        let origin = node
            .metadata
            .get("reshaped_from")
            .and_then(Value::as_str)
            .map(NodeId::from);
        let positional = origin
            .as_ref()
            .and_then(|o| view.node(o).cloned())
            .unwrap_or_else(|| node.clone());
        for offset in [-1, 1] {
            if let Some(id) = neighbours.at(&positional, offset) {
                add(&mut pool, id, &item.node_id, "adjacent");
            }
        }
        let edges: Vec<NodeId> = view
            .edges_from(&item.node_id)
            .into_iter()
            .filter(|e| e.active && relation(e).is_none())
            .map(|e| e.dst.clone())
            .collect();
        for id in edges.iter().take(options.expand_pool) {
            add(&mut pool, id, &item.node_id, "edge");
        }
    }
    // The feedback's neighbours: BM25 on the key terms the context lacks (coverage verifier), or
    // on the whole query otherwise.
    let context_text = context.text();
    let present: BTreeSet<String> = fluxmem_connect::terms(&context_text).into_iter().collect();
    let missing: Vec<String> = fluxmem_connect::terms(query)
        .into_iter()
        .filter(|t| !present.contains(t))
        .collect();
    if !missing.is_empty() {
        for candidate in index.bm25(&missing.join(" "), options.expand_pool) {
            add(&mut pool, &candidate.node_id, &top, "feedback");
        }
    }
    // The query's next candidates that did not make it into the context.
    for candidate in stage1
        .iter()
        .filter(|c| !in_context.contains(&c.node_id))
        .take(options.expand_pool)
    {
        add(&mut pool, &candidate.node_id, &top, "query");
    }
    if pool.is_empty() {
        return Ok(Vec::new());
    }
    let texts: Vec<String> = pool.iter().map(|(id, ..)| node_line(view, id)).collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let scores = models.verifier.item_scores(query, &refs)?;
    let below = models.verifier.distractor_below();
    let mut ranked: Vec<usize> = (0..pool.len()).filter(|&i| scores[i] >= below).collect();
    ranked.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut edits = Vec::new();
    for &i in ranked.iter().take(options.expand_k) {
        let (candidate, anchor, source) = &pool[i];
        let key = EdgeKey {
            src: anchor.clone(),
            dst: candidate.clone(),
            kind: EdgeKind::Link,
        };
        let mut edge = match view.edge(&key).cloned() {
            Some(existing) if relation(&existing) == Some("expand") => existing,
            _ => new_link(
                view,
                anchor,
                candidate,
                options.link_weight,
                "expand",
                run_id,
                at,
            ),
        };
        edge.active = true;
        edge.stage = STAGE.into();
        edge.run_id = run_id.into();
        edge.metadata.insert("found_by".into(), (*source).into());
        let reason = format!(
            "under-connection: query {:?} not covered (sufficiency below the mark); {source} candidate scored {:.2}",
            clip(query),
            scores[i]
        );
        created.push(key);
        edits.push(view.set_edge(edge, "link_expand", &reason, run_id, at));
    }
    Ok(edits)
}

/// The first pair of useful items (context order) whose vectors under `model` have a cosine of
/// at least `above`: redundant, so one summary can hold both.
fn redundant_pair(
    view: &View<'_>,
    context: &Context,
    scores: &[f32],
    below: f32,
    model: &str,
    above: f32,
) -> Option<(usize, usize)> {
    let vectors: Vec<Option<&[f32]>> = context
        .items
        .iter()
        .zip(scores)
        .map(|(item, &score)| {
            (score >= below)
                .then(|| view.vector(&item.node_id, model))
                .flatten()
        })
        .collect();
    (0..vectors.len()).find_map(|i| {
        let a = vectors[i]?;
        (i + 1..vectors.len())
            .find(|&j| vectors[j].is_some_and(|b| fluxmem_models::cosine(a, b) >= above))
            .map(|j| (i, j))
    })
}

/// The turns a node holds: those it `covers` (a reshaped or merged node), else itself.
fn covered(node: &Node) -> Vec<String> {
    match node.metadata.get("covers").and_then(Value::as_array) {
        Some(covers) => covers
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        None => vec![node.id.as_str().to_string()],
    }
}

/// The deterministic merge of two redundant texts: the first, then the sentences of the second
/// whose terms the first does not already hold (on one line).
fn merged_text(first: &str, second: &str) -> String {
    let said: BTreeSet<String> = fluxmem_connect::terms(first).into_iter().collect();
    let new: Vec<&str> = sentences(second)
        .into_iter()
        .filter(|sentence| {
            let terms = fluxmem_connect::terms(sentence);
            !terms.is_empty() && !terms.iter().all(|t| said.contains(t))
        })
        .collect();
    let one_line = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
    if new.is_empty() {
        one_line(first)
    } else {
        format!("{} / {}", one_line(first), one_line(&new.join(" ")))
    }
}

/// Sentences of `text`: split after `.`, `!` or `?` followed by whitespace.
fn sentences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if matches!(c, '.' | '!' | '?')
            && chars.peek().is_some_and(|(_, next)| next.is_whitespace())
        {
            out.push(text[start..at + c.len_utf8()].trim());
            start = at + c.len_utf8();
        }
    }
    out.push(text[start..].trim());
    out.retain(|s| !s.is_empty());
    out
}

/// Node Reshape (coarser): one summary node for two redundant items, keeping both originals'
/// provenance (`merged_from`, `covers`) and edges; each original links to it (`reshaped_into`).
fn merge_nodes(
    view: &mut View<'_>,
    pair: [&NodeId; 2],
    models: &mut LoopModels<'_>,
    query: &str,
    run_id: &str,
    at: i64,
) -> Result<Vec<Edit>> {
    let (Some(first), Some(second)) = (view.own(pair[0]).cloned(), view.own(pair[1]).cloned())
    else {
        return Ok(Vec::new());
    };
    let deterministic = merged_text(&first.text, &second.text);
    let (text, how) = match models.generator.as_deref_mut() {
        Some(generator) => {
            let prompt = format!(
                "These two notes say nearly the same thing. Merge them into one statement on one line that keeps every name, date and fact of either, saying each once.\n\n1. {}\n2. {}",
                first.text, second.text
            );
            let reply = generator.generate(
                &[ChatMessage::new("user", prompt)],
                &GenerateParams {
                    max_tokens: 128,
                    ..Default::default()
                },
            )?;
            let merged = reply.text.split_whitespace().collect::<Vec<_>>().join(" ");
            if merged.is_empty() {
                (deterministic, "deterministic (empty merge)".to_string())
            } else {
                (merged, format!("merged by {}", generator.model_id()))
            }
        }
        None => (
            deterministic,
            "deterministic: the second's new sentences after the first".to_string(),
        ),
    };
    let mut node = Node::new(
        first.body.clone(),
        &first.tenant,
        &text,
        &["merge", first.id.as_str(), second.id.as_str(), &text],
    );
    node.agent_id = first.agent_id.clone();
    node.source_file = first.source_file.clone();
    node.source_locator = format!("{} (merged)", first.source_locator);
    node.created_at = first.created_at.max(second.created_at);
    node.metadata = first.metadata.clone();
    node.metadata
        .insert("reshaped_from".into(), first.id.as_str().into());
    node.metadata.insert(
        "merged_from".into(),
        Value::from(vec![
            first.id.as_str().to_string(),
            second.id.as_str().to_string(),
        ]),
    );
    node.metadata.insert("reshape".into(), "coarser".into());
    node.metadata
        .insert("reshape_method".into(), how.clone().into());
    let mut covers = covered(&first);
    for id in covered(&second) {
        if !covers.contains(&id) {
            covers.push(id);
        }
    }
    node.metadata.insert("covers".into(), Value::from(covers));
    let reason = format!(
        "redundancy: two useful items of query {:?} say nearly the same; coarser: {how}",
        clip(query)
    );
    install_reshaped(
        view,
        node,
        &[&first.id, &second.id],
        "node_merge",
        &reason,
        models,
        run_id,
        at,
    )
}

/// Puts a reshaped or merged node into the loop's delta in the place of `originals`: re-embeds
/// it with the store's model, records it (edit `kind`), copies the originals' edges within the
/// tenant (not those between two originals; where two originals have an edge to the same node,
/// the heavier copy is kept), and links each original to it (`relation: reshaped_into`).
#[allow(clippy::too_many_arguments)]
fn install_reshaped(
    view: &mut View<'_>,
    node: Node,
    originals: &[&NodeId],
    kind: &str,
    reason: &str,
    models: &mut LoopModels<'_>,
    run_id: &str,
    at: i64,
) -> Result<Vec<Edit>> {
    let embed_text = node.embedding_text();
    let vector = models.embedder.embed(&[embed_text.as_str()])?.remove(0);
    view.delta.upsert_embedding(Embedding {
        node_id: node.id.clone(),
        model_id: models.embedder.model_id().to_string(),
        text_sha256: sha256_hex(embed_text.as_bytes()),
        vector,
    });
    let mut edits = vec![Edit::new(
        STAGE,
        run_id,
        kind,
        Changed::Node(None, Some(&node)),
        reason,
        at,
    )];
    view.delta.upsert_node(node.clone());
    // Copies in the order the originals' edges are read; a later copy of the same key replaces
    // an earlier one only when heavier.
    let mut copies: Vec<Edge> = Vec::new();
    for &original in originals {
        for edge in view.edges_touching(original) {
            let other = if &edge.src == original {
                &edge.dst
            } else {
                &edge.src
            };
            let between = other != original && originals.contains(&other);
            if between || view.node(other).is_some_and(|n| n.tenant != node.tenant) {
                continue;
            }
            let mut copy = edge.clone();
            if &copy.src == original {
                copy.src = node.id.clone();
            }
            if &copy.dst == original {
                copy.dst = node.id.clone();
            }
            copy.stage = STAGE.into();
            copy.run_id = run_id.into();
            copy.metadata.insert(
                "copied_from".into(),
                format!("{}>{}", edge.src, edge.dst).into(),
            );
            match copies.iter_mut().find(|kept| kept.key() == copy.key()) {
                Some(kept) if kept.weight < copy.weight => *kept = copy,
                Some(_) => {}
                None => copies.push(copy),
            }
        }
    }
    for copy in copies {
        edits.push(view.set_edge(copy, kind, reason, run_id, at));
    }
    for &original in originals {
        let link = new_link(view, original, &node.id, 1.0, "reshaped_into", run_id, at);
        edits.push(view.set_edge(link, kind, reason, run_id, at));
    }
    Ok(edits)
}

fn reshapable(view: &View<'_>, neighbours: &Neighbours, node: &Node) -> bool {
    !node.metadata.contains_key("reshaped_from")
        && neighbours.at(node, -1).is_some()
        && !view
            .edges_from(&node.id)
            .iter()
            .any(|e| e.active && relation(e) == Some("reshaped_into"))
}

fn reshape_node(
    view: &mut View<'_>,
    neighbours: &Neighbours,
    id: &NodeId,
    models: &mut LoopModels<'_>,
    query: &str,
    run_id: &str,
    at: i64,
) -> Result<Vec<Edit>> {
    let Some(old) = view.node(id).cloned() else {
        return Ok(Vec::new());
    };
    let Some(previous) = neighbours.at(&old, -1).and_then(|p| view.node(p)).cloned() else {
        return Ok(Vec::new());
    };
    // One line: contexts are line-per-item.
    let joined = format!("{} / {}", previous.text, old.text);
    let (text, how) = match models.generator.as_deref_mut() {
        Some(generator) => {
            let prompt = format!(
                "Rewrite the second part of this conversation excerpt (after the slash) as one self-contained statement on one line, adding the context it needs from the first part. Keep every name, date and fact.\n\n{joined}"
            );
            let reply = generator.generate(
                &[ChatMessage::new("user", prompt)],
                &GenerateParams {
                    max_tokens: 96,
                    ..Default::default()
                },
            )?;
            let rewritten = reply.text.split_whitespace().collect::<Vec<_>>().join(" ");
            let rewritten = rewritten.as_str();
            if rewritten.is_empty() {
                (joined.clone(), "joined (empty rewrite)".to_string())
            } else {
                (
                    rewritten.to_string(),
                    format!("rewritten by {}", generator.model_id()),
                )
            }
        }
        None => (joined.clone(), "joined with the preceding item".to_string()),
    };
    let mut node = Node::new(
        old.body.clone(),
        &old.tenant,
        &text,
        &["reshape", old.id.as_str(), previous.id.as_str(), &text],
    );
    node.agent_id = old.agent_id.clone();
    node.source_file = old.source_file.clone();
    node.source_locator = format!("{} (reshaped)", old.source_locator);
    node.created_at = old.created_at;
    node.metadata = old.metadata.clone();
    node.metadata
        .insert("reshaped_from".into(), old.id.as_str().into());
    node.metadata.insert("reshape".into(), "finer".into());
    node.metadata
        .insert("reshape_method".into(), how.clone().into());
    node.metadata.insert(
        "covers".into(),
        Value::from(vec![
            previous.id.as_str().to_string(),
            old.id.as_str().to_string(),
        ]),
    );
    let reason = format!(
        "granularity: a useful item of query {:?} is too short to stand alone; finer: {how}",
        clip(query)
    );
    install_reshaped(
        view,
        node,
        &[&old.id],
        "node_reshape",
        &reason,
        models,
        run_id,
        at,
    )
}

/// Keeps the loop's delta after a sufficient context: links in the context gain weight and one
/// piece of evidence; the edit log records every change.
fn persist(
    mut view: View<'_>,
    context: &Context,
    attempted: &[Edit],
    created: &[EdgeKey],
    options: &LoopOptions,
    run_id: &str,
    at: i64,
) -> Graph {
    let in_context: BTreeSet<&NodeId> = context.items.iter().map(|i| &i.node_id).collect();
    let mut credit_edits = Vec::new();
    let mut seen = BTreeSet::new();
    for key in created {
        if !seen.insert(key.clone()) || !in_context.contains(&key.dst) {
            continue;
        }
        if let Some(mut edge) = view.edge(key).cloned() {
            edge.weight += options.gain * (1.0 - edge.weight);
            edge.evidence += 1;
            credit_edits.push(view.set_edge(
                edge,
                "credit",
                "the link was in a context the verifier found sufficient",
                run_id,
                at,
            ));
        }
    }
    let mut delta = view.delta;
    delta.edits.extend(attempted.iter().cloned());
    delta.edits.extend(credit_edits);
    delta
}

fn new_link(
    view: &View<'_>,
    src: &NodeId,
    dst: &NodeId,
    weight: f32,
    relation: &str,
    run_id: &str,
    at: i64,
) -> Edge {
    let time = |id: &NodeId| view.node(id).and_then(|n| n.created_at).unwrap_or(0);
    let mut metadata = BTreeMap::new();
    metadata.insert("relation".into(), Value::from(relation));
    Edge {
        src: src.clone(),
        dst: dst.clone(),
        kind: EdgeKind::Link,
        weight,
        evidence: 1,
        stage: STAGE.into(),
        run_id: run_id.into(),
        created_at: time(src).max(time(dst)).max(at),
        active: true,
        metadata,
    }
}

fn node_line(view: &View<'_>, id: &NodeId) -> String {
    let mut graph = Graph::default();
    if let Some(node) = view.node(id) {
        graph.insert_node(node.clone());
    }
    line(&graph, id)
}

fn clip(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deterministic_merge_says_each_sentence_once() {
        // An exact repeat adds nothing; a sentence with a new term is kept, one already said is not.
        assert_eq!(
            merged_text("Deploy failed: disk full.", "Deploy failed: disk full."),
            "Deploy failed: disk full."
        );
        assert_eq!(
            merged_text(
                "Deploy failed:\n disk full.",
                "Disk full! Deploy failed. Cleaned /tmp and retried?"
            ),
            "Deploy failed: disk full. / Cleaned /tmp and retried?"
        );
        assert_eq!(sentences("a. b!c ? d"), vec!["a.", "b!c ?", "d"]);
    }
}
