//! The whole Stage I context for a query: semantic retrieval, episodic retrieval and procedural
//! inheritance, as ranked entries ready for [`crate::pack`].

use candle_core::Device;
use fluxmem_graph::{EdgeKind, Graph, NodeId, NodeKind};
use fluxmem_models::Judge;

use crate::dense::{embedded_in, DenseIndex, Unembedded};
use crate::fusion::Signals;
use crate::retrieve::{Candidate, RetrievalConfig, SemanticIndex, Units};
use crate::Result;
use std::collections::BTreeMap;

/// A ranked entry: node, signals, score, and why it is included.
pub type Entry = (NodeId, Signals, f32, String);

/// Indexes of one tenant of a graph for Stage I: everything it returns is that tenant's.
pub struct Retriever {
    semantic: SemanticIndex,
    episodes: Episodes,
    not_embedded: usize,
}

/// Where a [`Retriever`] ranks its tenant's episodes from.
#[derive(Debug)]
pub enum Episodes {
    /// Their vectors (`DenseIndex`), the episodes in the same order.
    Index(DenseIndex, Vec<NodeId>),
    /// Ranked already, for one query vector: a query served from its tenant's index ranks
    /// the episodes from the file as it reads it ([`crate::top_k_rows`]), and asks for them
    /// once. Asking for another vector, or for more than were ranked, is an error.
    Ranked {
        /// The query vector they were ranked for.
        query: Vec<f32>,
        /// The best first, with their cosines.
        best: Vec<(NodeId, f32)>,
        /// How many episodes were ranked (more than `best` holds when it was cut).
        of: usize,
    },
}

impl Retriever {
    /// Indexes the semantic and episodic nodes of `tenant` in `graph` with their `model`
    /// embeddings; a node without one is an error naming the fix.
    pub fn build(graph: &Graph, tenant: &str, model: &str, device: &Device) -> Result<Retriever> {
        Retriever::build_with(graph, tenant, model, device, Unembedded::Fail)
    }

    /// [`Retriever::build`], with `unembedded` saying what a node without an embedding does:
    /// fail, or stay out and count ([`Retriever::not_embedded`]).
    pub fn build_with(
        graph: &Graph,
        tenant: &str,
        model: &str,
        device: &Device,
        unembedded: Unembedded,
    ) -> Result<Retriever> {
        Retriever::build_units(graph, tenant, model, device, unembedded, Units::PLAIN)
    }

    /// [`Retriever::build_with`], with the semantic nodes indexed for BM25 as `units` says.
    pub fn build_units(
        graph: &Graph,
        tenant: &str,
        model: &str,
        device: &Device,
        unembedded: Unembedded,
        units: Units,
    ) -> Result<Retriever> {
        let semantic = SemanticIndex::build_units(graph, tenant, model, device, unembedded, units)?;
        let episodes = embedded_in(graph, NodeKind::Episodic, tenant, model, unembedded)?;
        let index = DenseIndex::from_vectors(&episodes.vectors, device)?;
        Ok(Retriever {
            not_embedded: semantic.not_embedded() + episodes.skipped,
            semantic,
            episodes: Episodes::Index(index, episodes.ids),
        })
    }

    /// [`Retriever::build_units`] with the tenant's episodes given (`episodes`, and the count
    /// of those left out for lack of a vector) instead of read from `graph`, which then needs
    /// only the tenant's semantic nodes and their vectors: a query served from the tenant's
    /// index (`fluxmem_store::MappedIndex`). The ranking is the same as from a graph holding
    /// those episodes and vectors.
    pub fn build_indexed(
        graph: &Graph,
        tenant: &str,
        model: &str,
        device: &Device,
        units: Units,
        (episodes, unembedded): (Episodes, usize),
    ) -> Result<Retriever> {
        let semantic =
            SemanticIndex::build_units(graph, tenant, model, device, Unembedded::Skip, units)?;
        Ok(Retriever {
            not_embedded: semantic.not_embedded() + unembedded,
            semantic,
            episodes,
        })
    }

    /// The tenant this retriever serves.
    pub fn tenant(&self) -> &str {
        self.semantic.tenant()
    }

    /// Semantic and episodic nodes of the tenant left out for lack of an embedding.
    pub fn not_embedded(&self) -> usize {
        self.not_embedded
    }

    /// The semantic index.
    pub fn semantic(&self) -> &SemanticIndex {
        &self.semantic
    }

    /// The `k` episodes closest to the query vector (cosine, best first).
    pub fn episodes(&self, query_vector: &[f32], k: usize) -> Result<Vec<(NodeId, f32)>> {
        match &self.episodes {
            Episodes::Index(index, ids) => {
                let ranked = index.top_k_one(query_vector, k)?;
                Ok(ranked
                    .into_iter()
                    .map(|(i, cos)| (ids[i].clone(), cos))
                    .collect())
            }
            Episodes::Ranked { query, best, of } => {
                if query.as_slice() != query_vector || (k > best.len() && best.len() < *of) {
                    return Err(crate::Error::Ranked {
                        asked: k,
                        ranked: best.len(),
                    });
                }
                Ok(best.iter().take(k).cloned().collect())
            }
        }
    }

    /// Ranked entries for `query`, all of the retriever's tenant: skills inherited from the
    /// retrieved episodes first (every procedural node of the tenant a `distill` edge leads
    /// to), then the `episodes_k` closest episodes, then the semantic nodes in hybrid order.
    pub fn retrieve<'judge>(
        &self,
        graph: &Graph,
        query: &str,
        query_vector: &[f32],
        config: &RetrievalConfig,
        judge: Option<&mut (dyn Judge + 'judge)>,
        episodes_k: usize,
    ) -> Result<Vec<Entry>> {
        let (head, semantic) =
            self.retrieve_split(graph, query, query_vector, config, judge, episodes_k)?;
        Ok(head
            .into_iter()
            .chain(semantic.iter().map(semantic_entry))
            .collect())
    }

    /// [`Retriever::retrieve`] in two parts: the skill and episode entries, and the semantic
    /// candidates (for Stage II, which rearranges them). Semantic scores include the graph
    /// support of the retrieved episodes ([`RetrievalConfig::ground_support`]).
    pub fn retrieve_split<'judge>(
        &self,
        graph: &Graph,
        query: &str,
        query_vector: &[f32],
        config: &RetrievalConfig,
        judge: Option<&mut (dyn Judge + 'judge)>,
        episodes_k: usize,
    ) -> Result<(Vec<Entry>, Vec<Candidate>)> {
        self.retrieve_split_dense(
            graph,
            query,
            query_vector,
            query_vector,
            config,
            judge,
            episodes_k,
        )
    }

    /// [`Retriever::retrieve_split`] with the semantic ranking's dense signal read from
    /// `dense_vector`, the embedding of [`SemanticIndex::dense_query`] (episodes are still found
    /// by `query_vector`, the whole query's).
    #[allow(clippy::too_many_arguments)]
    pub fn retrieve_split_dense<'judge>(
        &self,
        graph: &Graph,
        query: &str,
        query_vector: &[f32],
        dense_vector: &[f32],
        config: &RetrievalConfig,
        judge: Option<&mut (dyn Judge + 'judge)>,
        episodes_k: usize,
    ) -> Result<(Vec<Entry>, Vec<Candidate>)> {
        let episodes = self.episodes(query_vector, episodes_k)?;
        let mut skills: Vec<Entry> = Vec::new();
        for (episode, cosine) in &episodes {
            for edge in graph
                .edges
                .values()
                .filter(|e| e.active && e.kind == EdgeKind::Distill && &e.src == episode)
            {
                let own = graph
                    .nodes
                    .get(&edge.dst)
                    .is_some_and(|n| n.tenant == self.tenant());
                if own && !skills.iter().any(|(id, ..)| id == &edge.dst) {
                    let why = format!("skill distilled from retrieved episode {episode}");
                    skills.push((
                        edge.dst.clone(),
                        Signals {
                            dense: *cosine,
                            bm25: 0.0,
                            judge: None,
                        },
                        *cosine,
                        why,
                    ));
                }
            }
        }
        let mut semantic = self.semantic.hybrid(query, dense_vector, config, judge)?;
        if config.ground_support != 0.0 && !episodes.is_empty() {
            let retrieved: BTreeMap<&NodeId, f32> =
                episodes.iter().map(|(id, cos)| (id, *cos)).collect();
            // Only the tenant's semantic nodes are candidates, so a ground edge from another
            // tenant (an old store's) supports nothing.
            let mut support: BTreeMap<&NodeId, f32> = BTreeMap::new();
            for edge in graph
                .edges
                .values()
                .filter(|e| e.active && e.kind == EdgeKind::Ground)
            {
                if let Some(cos) = retrieved.get(&edge.dst) {
                    *support.entry(&edge.src).or_default() += cos * edge.weight;
                }
            }
            for candidate in &mut semantic {
                if let Some(s) = support.get(&candidate.node_id) {
                    candidate.score += config.ground_support * s;
                }
            }
            semantic.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.index.cmp(&b.index)));
        }
        let episodic = episodes.into_iter().map(|(id, cosine)| {
            let why = format!("similar past episode (cosine {cosine:.3})");
            (
                id,
                Signals {
                    dense: cosine,
                    bm25: 0.0,
                    judge: None,
                },
                cosine,
                why,
            )
        });
        Ok((skills.into_iter().chain(episodic).collect(), semantic))
    }
}

/// What structure added to a candidate's score, for its `why` (empty when nothing).
pub fn structure_note(c: &Candidate) -> String {
    let mut parts = Vec::new();
    if c.structure.neighbours > 0.0 {
        parts.push(format!("neighbours +{:.3}", c.structure.neighbours));
    }
    if c.structure.speaker > 0.0 {
        parts.push(format!("speaker named +{:.3}", c.structure.speaker));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// The entry of a semantic candidate, with why it is there.
pub fn semantic_entry(c: &Candidate) -> Entry {
    let judge = c
        .signals
        .judge
        .map(|j| format!(", judge {j:.2}"))
        .unwrap_or_default();
    let why = format!(
        "semantic match: cosine {:.3}, bm25 {:.2}{judge}, fused {:.3}{}",
        c.signals.dense,
        c.signals.bm25,
        c.score,
        structure_note(c)
    );
    (c.node_id.clone(), c.signals, c.score, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Episodes ranked for one query answer that query, as far as they were ranked, and
    /// nothing else.
    #[test]
    fn episodes_ranked_once_answer_only_their_query() {
        let graph = Graph::default();
        let query = vec![0.6, 0.8];
        let best = vec![(NodeId("epi-a".into()), 0.9), (NodeId("epi-b".into()), 0.5)];
        let build = |of: usize| {
            let episodes = Episodes::Ranked {
                query: query.clone(),
                best: best.clone(),
                of,
            };
            let units = Units::PLAIN;
            Retriever::build_indexed(&graph, "t", "m", &Device::Cpu, units, (episodes, 0)).unwrap()
        };
        let cut = build(3);
        assert_eq!(cut.episodes(&query, 1).unwrap(), best[..1]);
        assert_eq!(cut.episodes(&query, 2).unwrap(), best);
        assert!(matches!(
            cut.episodes(&query, 3),
            Err(crate::Error::Ranked {
                asked: 3,
                ranked: 2
            })
        ));
        assert!(cut.episodes(&[0.8, 0.6], 1).is_err(), "another query");
        assert_eq!(build(2).episodes(&query, 5).unwrap(), best, "all there are");
    }
}
