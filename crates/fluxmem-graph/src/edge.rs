use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

use crate::NodeId;

/// The kinds of edges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EdgeKind {
    /// semantic -> episodic: this fact supported a step of this task.
    Ground,
    /// episodic -> procedural: this skill was induced from this episode.
    Distill,
    /// An association link inside or across layers, created by the stages.
    Link,
}

impl EdgeKind {
    /// All kinds, in storage order.
    pub const ALL: [EdgeKind; 3] = [EdgeKind::Ground, EdgeKind::Distill, EdgeKind::Link];

    /// The name stored in the `kind` column.
    pub fn as_str(self) -> &'static str {
        match self {
            EdgeKind::Ground => "ground",
            EdgeKind::Distill => "distill",
            EdgeKind::Link => "link",
        }
    }

    /// Parses a `kind` column value.
    pub fn parse(value: &str) -> Option<EdgeKind> {
        EdgeKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == value)
    }
}

/// What identifies an edge: a later write of the same key replaces the earlier one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct EdgeKey {
    /// Source node.
    pub src: NodeId,
    /// Destination node.
    pub dst: NodeId,
    /// Edge kind.
    pub kind: EdgeKind,
}

/// A weighted, attributed edge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Edge {
    /// Source node.
    pub src: NodeId,
    /// Destination node.
    pub dst: NodeId,
    /// Edge kind.
    pub kind: EdgeKind,
    /// Strength of the connection; stages raise and lower it from feedback.
    pub weight: f32,
    /// How many pieces of evidence (retrievals, outcomes) support the edge.
    pub evidence: i64,
    /// The stage that created or last updated the edge (`connect`, `refine`...).
    pub stage: String,
    /// The run that created or last updated the edge.
    pub run_id: String,
    /// When (ms since the Unix epoch, UTC).
    pub created_at: i64,
    /// False once pruned; pruned edges stay stored so edits can be explained and undone.
    pub active: bool,
    /// Free metadata.
    pub metadata: BTreeMap<String, Value>,
}

impl Edge {
    /// The key of this edge.
    pub fn key(&self) -> EdgeKey {
        EdgeKey {
            src: self.src.clone(),
            dst: self.dst.clone(),
            kind: self.kind,
        }
    }
}
