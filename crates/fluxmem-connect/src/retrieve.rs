//! Stage I semantic retrieval: BM25 + dense candidates fused into one ranking, optionally
//! reranked with the judge.

use candle_core::Device;
use fluxmem_graph::{Graph, NodeBody, NodeId, NodeKind};
use fluxmem_models::Judge;
use serde::{Deserialize, Serialize};

use crate::bm25::{Bm25, Bm25Params};
use crate::dense::{embedded_in, top_k, DenseIndex, Unembedded};
use crate::fusion::{fuse, FusionMode, FusionWeights, Signals};
use crate::Result;

/// The weight of structure (`RetrievalConfig::adjacency`) where retrieval answers queries:
/// `query` and the `fluxmem` system of `eval locomo` (docs/locomo.md).
pub const DEFAULT_ADJACENCY: f32 = 0.3;

/// The weight of entities (`RetrievalConfig::entity`) where retrieval answers queries, as
/// [`DEFAULT_ADJACENCY`].
pub const DEFAULT_ENTITY: f32 = 0.3;

/// Stage I settings. [`RetrievalConfig::serving`] is the retrieval the night grounds its
/// episodes with (`connect`) and the one `query` answers with: the graph stores the ranking
/// that is served. [`RetrievalConfig::default`] is plain hybrid retrieval (the baselines).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetrievalConfig {
    /// Fusion mode.
    pub fusion: FusionMode,
    /// Weights of the weighted mode.
    pub weights: FusionWeights,
    /// Dense candidates in the pool (the reference code uses 3,000).
    pub dense_pool: usize,
    /// BM25 candidates added to the pool, so lexical-only matches can enter.
    pub bm25_pool: usize,
    /// How many of the best fused candidates the judge scores (0: no judge).
    pub judge_top: usize,
    /// Weight of graph support in [`crate::Retriever`]: a semantic node's score gains
    /// `ground_support * sum(cosine(episode) * weight(node -> episode))` over the retrieved
    /// episodes it has an active `ground` edge to (weights that Stage II credit assignment moves).
    pub ground_support: f32,
    /// Structure: a candidate's fused score gains `adjacency` times the best fused score of its
    /// neighbours in the pool (the units before and after it in its source group: the turn it
    /// answers or that answers it, the paragraph it continues). Evidence sits next to what the
    /// query matches, so a strong match lifts its neighbours. 0: off.
    pub adjacency: f32,
    /// Structure: a candidate said by an entity the query names (its node's `speaker` or
    /// `author`, named in the query by its first word: "What did Caroline research?") gains
    /// `entity`, after adjacency. A question about someone is mostly answered by what they
    /// said. A query that names no speaker ranks as without it. 0: off.
    pub entity: f32,
    /// How facts are indexed for BM25 (the index is built with them).
    pub units: Units,
    /// BM25 parameters.
    #[serde(skip)]
    pub bm25: Bm25Params,
}

/// How a semantic node is indexed for BM25: its text alone ([`Units::PLAIN`]) or as a unit with
/// its context ([`Units::CONTEXT`], the default of `query` and of the `fluxmem` system of `eval
/// locomo`). The stored node, its line in a context and its vector do not change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Units {
    /// A node's BM25 text carries the text of the node before it in its source group (the
    /// question a turn answers, the sentence a chunk continues).
    pub previous: bool,
    /// BM25 terms are stemmed ([`crate::bm25::stem`]).
    pub stem: bool,
}

impl Units {
    /// Each node's own text, unstemmed (the `bm25` and `hybrid` baselines, and
    /// [`RetrievalConfig::default`]).
    pub const PLAIN: Units = Units {
        previous: false,
        stem: false,
    };
    /// The previous unit of the group joins a node's BM25 text, and terms are stemmed.
    pub const CONTEXT: Units = Units {
        previous: true,
        stem: true,
    };
}

impl std::str::FromStr for Units {
    type Err = String;
    /// `plain`, `context`, or a comma list of `previous` and `stem`.
    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "plain" | "none" => return Ok(Units::PLAIN),
            "context" => return Ok(Units::CONTEXT),
            _ => {}
        }
        let mut units = Units::PLAIN;
        for part in value.split(',').map(str::trim) {
            match part {
                "previous" => units.previous = true,
                "stem" => units.stem = true,
                other => return Err(format!("units `{other}`: expected plain, context, or a comma list of previous and stem")),
            }
        }
        Ok(units)
    }
}

impl Default for RetrievalConfig {
    fn default() -> Self {
        RetrievalConfig {
            fusion: FusionMode::Weighted,
            weights: FusionWeights::default(),
            dense_pool: 3000,
            bm25_pool: 100,
            judge_top: 0,
            ground_support: 0.3,
            adjacency: 0.0,
            entity: 0.0,
            units: Units::PLAIN,
            bm25: Bm25Params::default(),
        }
    }
}

impl RetrievalConfig {
    /// The retrieval that builds the graph and serves it: context units and both structure
    /// lifts at their defaults ([`DEFAULT_ADJACENCY`], [`DEFAULT_ENTITY`]), measured in
    /// docs/locomo.md. `connect`'s ground edges and `query`'s facts both come from it.
    pub fn serving() -> RetrievalConfig {
        RetrievalConfig {
            adjacency: DEFAULT_ADJACENCY,
            entity: DEFAULT_ENTITY,
            units: Units::CONTEXT,
            ..RetrievalConfig::default()
        }
    }
}

/// A ranked semantic candidate with every signal, for explanation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// Position in the index.
    pub index: usize,
    /// The node.
    pub node_id: NodeId,
    /// Raw signals.
    pub signals: Signals,
    /// Fused score, structure included.
    pub score: f32,
    /// What structure added to the fused signals (included in `score`).
    pub structure: Lift,
}

/// The structure lifts of a candidate's score.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Lift {
    /// From its neighbours in its source group (`RetrievalConfig::adjacency`).
    pub neighbours: f32,
    /// For being said by a speaker the query names (`RetrievalConfig::entity`).
    pub speaker: f32,
}

impl Lift {
    /// Both lifts.
    pub fn total(&self) -> f32 {
        self.neighbours + self.speaker
    }
}

/// Indexes over the semantic nodes of one tenant of a graph that have embeddings of one model.
/// BM25 statistics (document frequencies, lengths) are the tenant's own: another tenant's
/// documents never move a score.
pub struct SemanticIndex {
    tenant: String,
    ids: Vec<NodeId>,
    texts: Vec<String>,
    bm25: Bm25,
    dense: DenseIndex,
    /// Per indexed node, the indexed nodes before and after it in its source group (by position).
    neighbours: Vec<[Option<u32>; 2]>,
    /// Per indexed node, its speaker (an index into `speakers`), if it has one.
    speaker_of: Vec<Option<u32>>,
    /// The speakers' names as they are matched in queries: lowercased first words, sorted.
    speakers: Vec<String>,
    not_embedded: usize,
}

impl SemanticIndex {
    /// Indexes the semantic nodes of `tenant` in `graph` (in id order) with their `model`
    /// embeddings. A semantic node without an embedding of `model` is an error naming the fix.
    pub fn build(
        graph: &Graph,
        tenant: &str,
        model: &str,
        device: &Device,
    ) -> Result<SemanticIndex> {
        SemanticIndex::build_with(graph, tenant, model, device, Unembedded::Fail)
    }

    /// [`SemanticIndex::build`], with `unembedded` saying what a node without an embedding
    /// does: fail, or stay out of the index and count ([`SemanticIndex::not_embedded`]).
    pub fn build_with(
        graph: &Graph,
        tenant: &str,
        model: &str,
        device: &Device,
        unembedded: Unembedded,
    ) -> Result<SemanticIndex> {
        SemanticIndex::build_units(graph, tenant, model, device, unembedded, Units::PLAIN)
    }

    /// [`SemanticIndex::build_with`], indexing each node for BM25 as `units` says.
    pub fn build_units(
        graph: &Graph,
        tenant: &str,
        model: &str,
        device: &Device,
        unembedded: Unembedded,
        units: Units,
    ) -> Result<SemanticIndex> {
        let selected = embedded_in(graph, NodeKind::Semantic, tenant, model, unembedded)?;
        let texts: Vec<String> = selected
            .ids
            .iter()
            .map(|id| {
                graph
                    .nodes
                    .get(id)
                    .map(|n| n.text.clone())
                    .unwrap_or_default()
            })
            .collect();
        let neighbours = neighbours(graph, &selected.ids);
        let bm25 = units_bm25(&texts, &neighbours, units);
        let (speaker_of, speakers) = speakers(graph, &selected.ids);
        Ok(SemanticIndex {
            tenant: tenant.to_string(),
            ids: selected.ids,
            bm25,
            texts,
            dense: DenseIndex::from_vectors(&selected.vectors, device)?,
            neighbours,
            speaker_of,
            speakers,
            not_embedded: selected.skipped,
        })
    }

    /// The same nodes, vectors and neighbours, indexed for BM25 as `units` says (only the BM25
    /// index is built again; the dense index is shared).
    pub fn with_units(&self, units: Units) -> SemanticIndex {
        SemanticIndex {
            tenant: self.tenant.clone(),
            ids: self.ids.clone(),
            texts: self.texts.clone(),
            bm25: units_bm25(&self.texts, &self.neighbours, units),
            dense: self.dense.clone(),
            neighbours: self.neighbours.clone(),
            speaker_of: self.speaker_of.clone(),
            speakers: self.speakers.clone(),
            not_embedded: self.not_embedded,
        }
    }

    /// The indexed nodes before and after the node at `index` in its source group.
    pub fn neighbours(&self, index: usize) -> [Option<usize>; 2] {
        self.neighbours[index].map(|n| n.map(|n| n as usize))
    }

    /// The speakers `query` names (indexes into the index's speakers; empty when it names none).
    fn named_speakers(&self, query: &str) -> Vec<u32> {
        named_speakers(&self.speakers, query)
    }

    /// What the dense signal should read of `query` under `config`: with entities on
    /// (`config.entity` > 0) and a query that names a speaker, the query without the words that
    /// name one. Who the query is about is then carried by the entity lift; left in, the name
    /// would match the other speakers' turns that address them ("Thanks, Caroline!") as much as
    /// their own. `None`: embed the query as it is (entities off, no speaker named, or nothing
    /// left without the names).
    pub fn dense_query(&self, query: &str, config: &RetrievalConfig) -> Option<String> {
        dense_query_among(&self.speakers, query, config)
    }

    /// The tenant this index serves.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Semantic nodes of the tenant left out for lack of an embedding.
    pub fn not_embedded(&self) -> usize {
        self.not_embedded
    }

    /// Number of indexed nodes.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The node id at `index`.
    pub fn id(&self, index: usize) -> &NodeId {
        &self.ids[index]
    }

    /// The indexed text at `index`.
    pub fn text(&self, index: usize) -> &str {
        &self.texts[index]
    }

    /// How many indexed nodes contain `term` (for key-term selection).
    pub fn document_frequency(&self, term: &str) -> usize {
        self.bm25.document_frequency(term)
    }

    /// BM25 ranking (best first, zero scores dropped).
    pub fn bm25(&self, query: &str, k: usize) -> Vec<Candidate> {
        let scores = self.bm25.scores(query);
        top_k(&scores, k)
            .into_iter()
            .filter(|(_, s)| *s > 0.0)
            .map(|(index, score)| {
                self.candidate(
                    index,
                    Signals {
                        dense: 0.0,
                        bm25: score,
                        judge: None,
                    },
                    score,
                )
            })
            .collect()
    }

    /// Dense ranking (best first).
    pub fn dense(&self, query_vector: &[f32], k: usize) -> Result<Vec<Candidate>> {
        let ranked = self.dense.top_k(&[query_vector.to_vec()], k)?.remove(0);
        Ok(ranked
            .into_iter()
            .map(|(index, cos)| {
                self.candidate(
                    index,
                    Signals {
                        dense: cos,
                        bm25: 0.0,
                        judge: None,
                    },
                    cos,
                )
            })
            .collect())
    }

    /// Hybrid ranking of the pool (dense top `dense_pool` plus BM25 top `bm25_pool`), fused;
    /// with a judge, the best `judge_top` are scored by it and everything is fused again.
    /// `query_vector` is the embedding of [`SemanticIndex::dense_query`] where that is `Some`,
    /// else of `query`.
    pub fn hybrid<'judge>(
        &self,
        query: &str,
        query_vector: &[f32],
        config: &RetrievalConfig,
        judge: Option<&mut (dyn Judge + 'judge)>,
    ) -> Result<Vec<Candidate>> {
        if self.is_empty() {
            return Ok(Vec::new());
        }
        let dense_scores = self.dense.scores(&[query_vector.to_vec()])?.remove(0);
        self.hybrid_scored(query, dense_scores, config, judge)
    }

    /// [`SemanticIndex::hybrid`] for several queries: their dense scores come from one matrix
    /// product against the index (a row's scores do not depend on the other rows).
    pub fn hybrid_many(
        &self,
        queries: &[&str],
        vectors: &[Vec<f32>],
        config: &RetrievalConfig,
    ) -> Result<Vec<Vec<Candidate>>> {
        if self.is_empty() {
            return Ok(vec![Vec::new(); queries.len()]);
        }
        let dense = self.dense.scores(vectors)?;
        queries
            .iter()
            .zip(dense)
            .map(|(query, scores)| self.hybrid_scored(query, scores, config, None))
            .collect()
    }

    fn hybrid_scored<'judge>(
        &self,
        query: &str,
        dense_scores: Vec<f32>,
        config: &RetrievalConfig,
        judge: Option<&mut (dyn Judge + 'judge)>,
    ) -> Result<Vec<Candidate>> {
        let named = if config.entity > 0.0 {
            self.named_speakers(query)
        } else {
            Vec::new()
        };
        let bm25_scores = self.bm25.scores(query);
        let mut pool: Vec<usize> = top_k(&dense_scores, config.dense_pool)
            .into_iter()
            .map(|(i, _)| i)
            .collect();
        pool.extend(
            top_k(&bm25_scores, config.bm25_pool)
                .into_iter()
                .filter(|(_, s)| *s > 0.0)
                .map(|(i, _)| i),
        );
        pool.sort_unstable();
        pool.dedup();
        let mut signals: Vec<Signals> = pool
            .iter()
            .map(|&i| Signals {
                dense: dense_scores[i],
                bm25: bm25_scores[i],
                judge: None,
            })
            .collect();
        let mut ranked = self.rank(&pool, &signals, config, &named);
        if let (Some(judge), true) = (judge, config.judge_top > 0) {
            let top: Vec<usize> = ranked
                .iter()
                .take(config.judge_top)
                .map(|c| c.index)
                .collect();
            let passages: Vec<&str> = top.iter().map(|&i| self.texts[i].as_str()).collect();
            let scores = judge.score(query, &passages)?;
            for (index, score) in top.iter().zip(scores) {
                let slot = pool
                    .binary_search(index)
                    .expect("judged candidates come from the pool");
                signals[slot].judge = Some(score);
            }
            ranked = self.rank(&pool, &signals, config, &named);
        }
        Ok(ranked)
    }

    /// Fuses the pool's signals, then adds structure: adjacency, and `config.entity` for the
    /// candidates said by one of the `named` speakers.
    fn rank(
        &self,
        pool: &[usize],
        signals: &[Signals],
        config: &RetrievalConfig,
        named: &[u32],
    ) -> Vec<Candidate> {
        let fused = fuse(config.fusion, &config.weights, signals);
        let slot = |index: u32| pool.binary_search(&(index as usize)).ok();
        let structure = lifts(
            &fused,
            |k| self.neighbours[pool[k]].map(|n| n.and_then(slot)),
            |k| self.speaker_of[pool[k]].is_some_and(|s| named.binary_search(&s).is_ok()),
            config,
            !named.is_empty(),
        );
        let mut ranked: Vec<Candidate> = pool
            .iter()
            .zip(signals)
            .zip(fused)
            .zip(structure)
            .map(|(((&i, s), fused), lift)| Candidate {
                structure: lift,
                ..self.candidate(i, *s, fused + lift.total())
            })
            .collect();
        ranked.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.index.cmp(&b.index)));
        ranked
    }

    fn candidate(&self, index: usize, signals: Signals, score: f32) -> Candidate {
        Candidate {
            index,
            node_id: self.ids[index].clone(),
            signals,
            score,
            structure: Lift::default(),
        }
    }
}

/// A node's BM25 text with the previous unit of its group joined ([`Units::previous`]).
pub(crate) fn unit_text(text: &str, previous: Option<&str>) -> String {
    match previous {
        Some(before) => format!("{text}\n{before}"),
        None => text.to_string(),
    }
}

/// The structure lifts of a pool's candidates, from their `fused` scores as they were (so the
/// order of the pool does not matter): `neighbour_slots(k)`, the pool slots of candidate `k`'s
/// neighbours in its source group, and `said_by_named(k)`, whether a speaker the query names
/// said it (`any_named`: the query names one).
pub(crate) fn lifts(
    fused: &[f32],
    neighbour_slots: impl Fn(usize) -> [Option<usize>; 2],
    said_by_named: impl Fn(usize) -> bool,
    config: &RetrievalConfig,
    any_named: bool,
) -> Vec<Lift> {
    let mut structure = vec![Lift::default(); fused.len()];
    if config.adjacency > 0.0 {
        for (k, lift) in structure.iter_mut().enumerate() {
            let best = neighbour_slots(k)
                .iter()
                .flatten()
                .map(|&s| fused[s])
                .fold(f32::NEG_INFINITY, f32::max);
            if best.is_finite() {
                lift.neighbours = config.adjacency * best;
            }
        }
    }
    if config.entity > 0.0 && any_named {
        for (k, lift) in structure.iter_mut().enumerate() {
            if said_by_named(k) {
                lift.speaker = config.entity;
            }
        }
    }
    structure
}

/// A node's speaker as queries name it: the first word of its metadata `speaker` (else
/// `author`), lowercased ("Caroline", "caroline smith" -> `caroline`).
pub(crate) fn speaker_key(node: &fluxmem_graph::Node) -> Option<String> {
    let name = ["speaker", "author"]
        .iter()
        .find_map(|k| node.metadata.get(*k).and_then(|v| v.as_str()))?;
    let first = name.split_whitespace().next()?.to_lowercase();
    (!first.is_empty()).then_some(first)
}

/// The speakers of `speakers` (sorted) that `query` names, as indexes (empty when it names
/// none).
pub(crate) fn named_speakers(speakers: &[String], query: &str) -> Vec<u32> {
    let mut named: Vec<u32> = query
        .split_whitespace()
        .flat_map(|token| speakers_in(speakers, token))
        .collect();
    named.sort_unstable();
    named.dedup();
    named
}

/// The speakers a whitespace-separated token of a query names: its words, lowercased, with a
/// possessive dropped ("Caroline's" names `caroline`).
fn speakers_in<'a>(speakers: &'a [String], token: &'a str) -> impl Iterator<Item = u32> + 'a {
    token
        .split(|c: char| !c.is_alphanumeric() && c != '\'' && c != '\u{2019}')
        .map(|word| word.to_lowercase().replace('\u{2019}', "'"))
        .map(|word| {
            word.strip_suffix("'s")
                .unwrap_or(&word)
                .trim_matches('\'')
                .to_string()
        })
        .filter_map(|word| speakers.binary_search(&word).ok().map(|i| i as u32))
}

/// [`SemanticIndex::dense_query`] for a tenant whose speakers are `speakers` (sorted).
pub(crate) fn dense_query_among(
    speakers: &[String],
    query: &str,
    config: &RetrievalConfig,
) -> Option<String> {
    if config.entity <= 0.0 || speakers.is_empty() {
        return None;
    }
    let tokens: Vec<&str> = query.split_whitespace().collect();
    let kept: Vec<&str> = tokens
        .iter()
        .copied()
        .filter(|token| speakers_in(speakers, token).next().is_none())
        .collect();
    (kept.len() < tokens.len() && !kept.is_empty()).then(|| kept.join(" "))
}

/// BM25 over `texts` as `units` says: each text alone or with its previous neighbour's.
fn units_bm25(texts: &[String], neighbours: &[[Option<u32>; 2]], units: Units) -> Bm25 {
    let params = Bm25Params {
        stem: units.stem,
        ..Bm25Params::default()
    };
    if !units.previous {
        return Bm25::new(texts, params);
    }
    let joined: Vec<String> = texts
        .iter()
        .zip(neighbours)
        .map(|(text, [before, _])| unit_text(text, before.map(|b| texts[b as usize].as_str())))
        .collect();
    Bm25::new(&joined, params)
}

/// Per node of `ids`, its speaker (metadata `speaker`, else `author`), as an index into the
/// sorted, deduplicated list of speakers returned with it. A speaker is matched in queries by
/// the first word of its name, lowercased ("Caroline", "caroline smith" -> `caroline`).
fn speakers(graph: &Graph, ids: &[NodeId]) -> (Vec<Option<u32>>, Vec<String>) {
    let key = |id: &NodeId| graph.nodes.get(id).and_then(speaker_key);
    let keys: Vec<Option<String>> = ids.iter().map(key).collect();
    let mut names: Vec<String> = keys.iter().flatten().cloned().collect();
    names.sort_unstable();
    names.dedup();
    let of = keys
        .iter()
        .map(|k| {
            k.as_ref()
                .map(|k| names.binary_search(k).expect("listed") as u32)
        })
        .collect();
    (of, names)
}

/// Per node of `ids`, the nodes of `ids` before and after it in its source group: semantic
/// nodes of one `source` and `group` (a dialogue session; a document without groups is one),
/// ordered by `position`, then id.
fn neighbours(graph: &Graph, ids: &[NodeId]) -> Vec<[Option<u32>; 2]> {
    // (source, group) -> (position, index) of its nodes.
    #[allow(clippy::type_complexity)] // a local grouping, read only in this function
    let mut groups: std::collections::BTreeMap<(&str, Option<&str>), Vec<(i64, u32)>> =
        Default::default();
    for (i, id) in ids.iter().enumerate() {
        if let Some(NodeBody::Semantic(s)) = graph.nodes.get(id).map(|n| &n.body) {
            groups
                .entry((s.source.as_str(), s.group.as_deref()))
                .or_default()
                .push((s.position, i as u32));
        }
    }
    let mut out = vec![[None, None]; ids.len()];
    for members in groups.values_mut() {
        members.sort_unstable();
        for pair in members.windows(2) {
            let (a, b) = (pair[0].1, pair[1].1);
            out[a as usize][1] = Some(b);
            out[b as usize][0] = Some(a);
        }
    }
    out
}
