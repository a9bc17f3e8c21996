//! Helpers shared by the credit-assignment tests.

use fluxmem_graph::{Edge, EdgeKind, NodeId};

/// An edge as connect writes it, at time `at` (ms), active, with no metadata.
pub fn connect_edge(src: &NodeId, dst: &NodeId, kind: EdgeKind, weight: f32, at: i64) -> Edge {
    Edge {
        src: src.clone(),
        dst: dst.clone(),
        kind,
        weight,
        evidence: 1,
        stage: "connect".into(),
        run_id: "connect@v1".into(),
        created_at: at,
        active: true,
        metadata: Default::default(),
    }
}
