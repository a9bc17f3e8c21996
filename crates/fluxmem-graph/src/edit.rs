use serde::{Deserialize, Serialize};

use sha2::{Digest, Sha256};
use std::fmt::Write as _;

use crate::{Edge, Graph, Node, Result};

/// One recorded change to the graph (Stage II edits, credit assignment, consolidation), kept in
/// the store's `edits` table so any change can be explained and undone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Edit {
    /// Content hash of the record.
    pub id: String,
    /// The run that made the change.
    pub run_id: String,
    /// The stage that made it.
    pub stage: String,
    /// What kind of edit: `link_expand`, `link_prune`, `node_reshape`, `credit`...
    pub kind: String,
    /// What changed: `edge:<src>><dst>:<kind>` or `node:<id>`.
    pub target: String,
    /// The target before, as JSON (`None`: it did not exist).
    pub before: Option<String>,
    /// The target after, as JSON (`None`: it was removed). For an edge that existed before, only
    /// the fields that changed (a JSON object without `src`); [`Edit::edge_after`] gives the
    /// whole edge.
    pub after: Option<String>,
    /// Why: the feedback and its attribution.
    pub reason: String,
    /// When (ms since the Unix epoch).
    pub at: i64,
}

/// A [`std::fmt::Write`] that hashes what is written.
struct Hashing(Sha256);

impl std::fmt::Write for Hashing {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.update(s.as_bytes());
        Ok(())
    }
}

/// The record of an edge or node change.
pub enum Changed<'a> {
    /// An edge, before and after.
    Edge(Option<&'a Edge>, Option<&'a Edge>),
    /// A node, before and after.
    Node(Option<&'a Node>, Option<&'a Node>),
}

/// The kind of ingest's edit that replaces an episode with a later, longer version of its
/// conversation (the later stages look for it to redo their work on that episode).
pub const EPISODE_GROWN: &str = "episode_grown";

impl Edit {
    /// An edit record of `changed`.
    pub fn new(
        stage: &str,
        run_id: &str,
        kind: &str,
        changed: Changed<'_>,
        reason: &str,
        at: i64,
    ) -> Edit {
        let (target, before, after) = match changed {
            Changed::Edge(before, after) => {
                let edge = before.or(after).expect("an edge edit names an edge");
                let after_json = match (before, after) {
                    (Some(before), Some(after)) => Some(changed_fields(before, after)),
                    (None, after) => after.map(json),
                    (Some(_), None) => None,
                };
                (
                    format!("edge:{}>{}:{}", edge.src, edge.dst, edge.kind.as_str()),
                    before.map(json),
                    after_json,
                )
            }
            Changed::Node(before, after) => {
                let node = before.or(after).expect("a node edit names a node");
                (
                    format!("node:{}", node.id),
                    before.map(json),
                    after.map(json),
                )
            }
        };
        // The hash of this text, fed to the hasher as it is formatted (no string of it is made).
        let mut identity = Hashing(Sha256::new());
        write!(
            identity,
            "{stage}\0{run_id}\0{kind}\0{target}\0{before:?}\0{after:?}\0{reason}\0{at}"
        )
        .expect("hashing cannot fail");
        Edit {
            id: crate::hex(&identity.0.finalize())[..32].to_string(),
            run_id: run_id.into(),
            stage: stage.into(),
            kind: kind.into(),
            target,
            before,
            after,
            reason: reason.into(),
            at,
        }
    }

    /// The edge after an edge edit, whole: `after` itself, or, when it holds only the changed
    /// fields, `before` with them applied. `None` for a node edit or a removal.
    pub fn edge_after(&self) -> Result<Option<Edge>> {
        let parse_error = |e: serde_json::Error| crate::Error::Value {
            row: 0,
            column: "after".into(),
            reason: e.to_string(),
        };
        let (Some(after), true) = (&self.after, self.target.starts_with("edge:")) else {
            return Ok(None);
        };
        let after: serde_json::Value = serde_json::from_str(after).map_err(parse_error)?;
        if after.get("src").is_some() {
            return serde_json::from_value(after).map(Some).map_err(parse_error);
        }
        let Some(before) = &self.before else {
            return Ok(None);
        };
        let mut whole: serde_json::Value = serde_json::from_str(before).map_err(parse_error)?;
        if let (Some(whole), Some(changed)) = (whole.as_object_mut(), after.as_object()) {
            for (key, value) in changed {
                whole.insert(key.clone(), value.clone());
            }
        }
        serde_json::from_value(whole).map(Some).map_err(parse_error)
    }

    /// The delta that undoes this edit: the target as it was before. An edge that did not exist
    /// before comes back inactive (edges are never deleted); a node that did not exist is kept
    /// (undoing its creation means undoing the edges that use it). A node is replaced only by
    /// a later version of its conversation (ingest's `episode_grown`): the undo puts the
    /// earlier version back, but the rows of the steps it did not have stay in the store.
    pub fn undo(&self) -> Result<Graph> {
        let mut delta = Graph::default();
        let parse_error = |e: serde_json::Error| crate::Error::Value {
            row: 0,
            column: "before".into(),
            reason: e.to_string(),
        };
        if self.target.starts_with("edge:") {
            match (&self.before, &self.after) {
                (Some(before), _) => {
                    delta.upsert_edge(serde_json::from_str(before).map_err(parse_error)?)
                }
                (None, Some(after)) => {
                    let mut edge: Edge = serde_json::from_str(after).map_err(parse_error)?;
                    edge.active = false;
                    delta.upsert_edge(edge);
                }
                (None, None) => {}
            }
        } else if let Some(before) = &self.before {
            delta.upsert_node(serde_json::from_str(before).map_err(parse_error)?);
        }
        Ok(delta)
    }
}

/// The top-level fields of `after` that differ from `before`, as a JSON object (the edit log
/// holds an edge once, not twice). Fields are compared as their JSON values, without turning
/// the edges into JSON first.
fn changed_fields(before: &Edge, after: &Edge) -> String {
    let mut changed = serde_json::Map::new();
    let mut field = |name: &str, differs: bool, v: &dyn erased::Json| {
        if differs {
            changed.insert(name.to_string(), v.json());
        }
    };
    field("src", before.src != after.src, &after.src);
    field("dst", before.dst != after.dst, &after.dst);
    field("kind", before.kind != after.kind, &after.kind);
    // As JSON numbers (what a comparison of the values did): -0.0 equals 0.0, NaN is null.
    #[allow(clippy::cmp_owned)] // compared as JSON values on purpose: NaN is null, so equal
    let weight_changed =
        serde_json::Value::from(before.weight) != serde_json::Value::from(after.weight);
    field("weight", weight_changed, &after.weight);
    field(
        "evidence",
        before.evidence != after.evidence,
        &after.evidence,
    );
    field("stage", before.stage != after.stage, &after.stage);
    field("run_id", before.run_id != after.run_id, &after.run_id);
    field(
        "created_at",
        before.created_at != after.created_at,
        &after.created_at,
    );
    field("active", before.active != after.active, &after.active);
    field(
        "metadata",
        before.metadata != after.metadata,
        &after.metadata,
    );
    serde_json::Value::Object(changed).to_string()
}

/// A field as a JSON value, behind one trait object (the fields have different types).
mod erased {
    pub(super) trait Json {
        fn json(&self) -> serde_json::Value;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> serde_json::Value {
            serde_json::to_value(self).expect("graph values always serialise")
        }
    }
}

fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("graph values always serialise")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EdgeKind, NodeId};

    fn edge(weight: f32, active: bool) -> Edge {
        Edge {
            src: NodeId("sem-a".into()),
            dst: NodeId("epi-b".into()),
            kind: EdgeKind::Ground,
            weight,
            evidence: 1,
            stage: "connect".into(),
            run_id: "r".into(),
            created_at: 5,
            active,
            metadata: Default::default(),
        }
    }

    /// What `changed_fields` computed before it compared fields directly: both edges as JSON
    /// values, compared key by key.
    fn changed_as_values(before: &Edge, after: &Edge) -> String {
        let before = serde_json::to_value(before).unwrap();
        let after = serde_json::to_value(after).unwrap();
        let mut changed = serde_json::Map::new();
        for (key, value) in after.as_object().unwrap() {
            if before.get(key) != Some(value) {
                changed.insert(key.clone(), value.clone());
            }
        }
        serde_json::Value::Object(changed).to_string()
    }

    #[test]
    fn changed_fields_are_those_whose_json_values_differ() {
        let base = edge(0.5, true);
        let mut variants = vec![base.clone()];
        let mut change = |f: &dyn Fn(&mut Edge)| {
            let mut e = base.clone();
            f(&mut e);
            variants.push(e);
        };
        change(&|e| e.src = NodeId("sem-z".into()));
        change(&|e| e.dst = NodeId("epi-z".into()));
        change(&|e| e.kind = EdgeKind::Link);
        change(&|e| e.weight = 0.25);
        change(&|e| e.weight = 0.0);
        change(&|e| e.weight = -0.0);
        change(&|e| e.weight = f32::NAN);
        change(&|e| e.evidence = 7);
        change(&|e| e.stage = "refine".into());
        change(&|e| e.run_id = "r9".into());
        change(&|e| e.created_at = 6);
        change(&|e| e.active = false);
        change(&|e| {
            e.metadata.insert("credit".into(), 1.5.into());
            e.metadata.insert("pruned_by".into(), "credit".into());
        });
        change(&|e| {
            e.weight = 0.1;
            e.active = false;
            e.metadata.insert("outcomes".into(), 3.into());
        });
        for a in &variants {
            for b in &variants {
                assert_eq!(
                    changed_fields(a, b),
                    changed_as_values(a, b),
                    "{a:?} -> {b:?}"
                );
            }
        }
    }

    #[test]
    fn undo_restores_the_edge_before_the_edit() {
        let (before, after) = (edge(0.5, true), edge(0.1, false));
        let prune = Edit::new(
            "refine",
            "r2",
            "link_prune",
            Changed::Edge(Some(&before), Some(&after)),
            "distractor",
            9,
        );
        assert_eq!(prune.target, "edge:sem-a>epi-b:ground");
        let undo = prune.undo().unwrap();
        assert_eq!(undo.edges.values().next(), Some(&before));
        let expand = Edit::new(
            "refine",
            "r2",
            "link_expand",
            Changed::Edge(None, Some(&before)),
            "under-connected",
            9,
        );
        assert!(
            !expand.undo().unwrap().edges.values().next().unwrap().active,
            "an added edge is deactivated"
        );
        assert_ne!(prune.id, expand.id);
        // The id is the hash of the record's fields, joined by NULs (as every stored id).
        let identity = format!(
            "refine\0r2\0link_prune\0{}\0{:?}\0{:?}\0distractor\09",
            prune.target, prune.before, prune.after
        );
        assert_eq!(prune.id, crate::sha256_hex(identity.as_bytes())[..32]);
        // The prune's `after` holds only what changed, and gives back the whole edge.
        let changed: serde_json::Value =
            serde_json::from_str(prune.after.as_deref().unwrap()).unwrap();
        let keys: Vec<&String> = changed.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["active", "weight"], "{changed}");
        assert_eq!(prune.edge_after().unwrap(), Some(after.clone()));
        assert_eq!(
            expand.edge_after().unwrap(),
            Some(before.clone()),
            "a new edge's after is whole"
        );
        assert_eq!(
            prune.id,
            Edit::new(
                "refine",
                "r2",
                "link_prune",
                Changed::Edge(Some(&before), Some(&after)),
                "distractor",
                9
            )
            .id
        );
    }
}
