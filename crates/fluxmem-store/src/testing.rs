//! Helpers of this crate's unit tests.

use fluxmem_graph::{EdgeKind, NodeId};
use std::collections::BTreeMap;

/// A ground edge `epi-<i>` -> `sem-1` for this crate's unit tests.
pub(crate) fn test_edge(i: usize, weight: f32, active: bool) -> fluxmem_graph::Edge {
    fluxmem_graph::Edge {
        src: NodeId(format!("epi-{i:04}")),
        dst: NodeId("sem-1".into()),
        kind: EdgeKind::Ground,
        weight,
        evidence: 1,
        stage: "t".into(),
        run_id: "r".into(),
        created_at: 0,
        active,
        metadata: BTreeMap::new(),
    }
}
