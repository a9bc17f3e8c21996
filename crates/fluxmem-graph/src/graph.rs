use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::{Edge, EdgeKey, EdgeKind, Edit, Node, NodeId, NodeKind};

/// A node's embedding, with the model it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Embedding {
    /// The embedded node.
    pub node_id: NodeId,
    /// Model id (manifest name + revision).
    pub model_id: String,
    /// SHA-256 of the exact text that was embedded (the embedding cache key with the model).
    pub text_sha256: String,
    /// The vector; its length is the model's dimension.
    pub vector: Vec<f32>,
}

/// Node and edge counts, as `fluxmem stats` prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GraphStats {
    /// Semantic nodes.
    pub semantic: usize,
    /// Episodic nodes.
    pub episodic: usize,
    /// Procedural nodes.
    pub procedural: usize,
    /// Ground edges (active ones only).
    pub ground: usize,
    /// Distill edges (active ones only).
    pub distill: usize,
    /// Link edges (active ones only).
    pub link: usize,
    /// Nodes with at least one embedding.
    pub embedded: usize,
}

impl GraphStats {
    /// The counts of nodes of `nodes`' kinds, of active edges of `active_edges`' kinds, and
    /// `embedded` nodes (the one rule [`Graph::stats`] and the store's column-only stats share).
    pub fn count(
        nodes: impl IntoIterator<Item = NodeKind>,
        active_edges: impl IntoIterator<Item = EdgeKind>,
        embedded: usize,
    ) -> GraphStats {
        let mut stats = GraphStats {
            embedded,
            ..GraphStats::default()
        };
        for kind in nodes {
            match kind {
                NodeKind::Semantic => stats.semantic += 1,
                NodeKind::Episodic => stats.episodic += 1,
                NodeKind::Procedural => stats.procedural += 1,
            }
        }
        for kind in active_edges {
            match kind {
                EdgeKind::Ground => stats.ground += 1,
                EdgeKind::Distill => stats.distill += 1,
                EdgeKind::Link => stats.link += 1,
            }
        }
        stats
    }
}

/// The counts of two disjoint sets of rows together.
impl std::ops::Add for GraphStats {
    type Output = GraphStats;

    fn add(self, other: GraphStats) -> GraphStats {
        GraphStats {
            semantic: self.semantic + other.semantic,
            episodic: self.episodic + other.episodic,
            procedural: self.procedural + other.procedural,
            ground: self.ground + other.ground,
            distill: self.distill + other.distill,
            link: self.link + other.link,
            embedded: self.embedded + other.embedded,
        }
    }
}

/// The in-memory memory graph: nodes by id, edges by key, embeddings by (node, model).
///
/// Ordered maps keep iteration (and so everything written from a graph) deterministic.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Graph {
    /// Nodes by id.
    pub nodes: BTreeMap<NodeId, Node>,
    /// Edges by key.
    pub edges: BTreeMap<EdgeKey, Edge>,
    /// Embeddings by (node id, model id).
    pub embeddings: BTreeMap<(NodeId, String), Embedding>,
    /// The edit log, oldest first (append-only).
    pub edits: Vec<Edit>,
}

impl Graph {
    /// Inserts a node; returns false (and keeps the existing one) if the id is already present.
    pub fn insert_node(&mut self, node: Node) -> bool {
        if self.nodes.contains_key(&node.id) {
            return false;
        }
        self.nodes.insert(node.id.clone(), node);
        true
    }

    /// Inserts or replaces a node.
    pub fn upsert_node(&mut self, node: Node) {
        self.nodes.insert(node.id.clone(), node);
    }

    /// Inserts or replaces an edge.
    pub fn upsert_edge(&mut self, edge: Edge) {
        self.edges.insert(edge.key(), edge);
    }

    /// Inserts or replaces an embedding.
    pub fn upsert_embedding(&mut self, embedding: Embedding) {
        self.embeddings.insert(
            (embedding.node_id.clone(), embedding.model_id.clone()),
            embedding,
        );
    }

    /// Applies every node, edge and embedding of `other` on top of this graph (later wins).
    pub fn apply(&mut self, other: Graph) {
        self.nodes.extend(other.nodes);
        self.edges.extend(other.edges);
        self.embeddings.extend(other.embeddings);
        self.edits.extend(other.edits);
    }

    /// True when there is nothing in the graph.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
            && self.edges.is_empty()
            && self.embeddings.is_empty()
            && self.edits.is_empty()
    }

    /// Counts per node kind, per active edge kind, and embedded nodes.
    pub fn stats(&self) -> GraphStats {
        let mut embedded: Vec<&NodeId> = self.embeddings.keys().map(|(id, _)| id).collect();
        embedded.dedup();
        GraphStats::count(
            self.nodes.values().map(Node::kind),
            self.edges
                .values()
                .filter(|edge| edge.active)
                .map(|edge| edge.kind),
            embedded.len(),
        )
    }
}

/// Scales `vector` to unit length (a zero vector stays zero).
pub fn normalize(vector: &mut [f32]) {
    let norm = vector.iter().map(|v| v * v).sum::<f32>().sqrt();
    if norm > 0.0 {
        vector.iter_mut().for_each(|v| *v /= norm);
    }
}
