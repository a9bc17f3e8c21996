//! The manifest's live counts: `stats` reads them when they hold for the commit, and they are
//! always the counts of the shards.

use fluxmem_graph::{
    Edge, EdgeKind, Embedding, Episode, Graph, Node, NodeBody, NodeId, Outcome, Semantic,
};
use fluxmem_store::{CommitInfo, CompactPolicy, Store, Writer};

fn info() -> CommitInfo {
    CommitInfo {
        stage: "test".into(),
        run_id: "r".into(),
        ..Default::default()
    }
}

fn episode(i: usize) -> Node {
    Node::new(
        NodeBody::Episodic(Episode {
            steps: vec![],
            outcome: Outcome {
                success: Some(i.is_multiple_of(2)),
                reward: None,
                feedback: None,
            },
        }),
        "t",
        &format!("task {i}"),
        &[&i.to_string()],
    )
}

fn fact(i: usize) -> Node {
    Node::new(
        NodeBody::Semantic(Semantic {
            source: "doc".into(),
            position: i as i64,
            time: None,
            group: None,
        }),
        "t",
        &format!("fact {i}"),
        &[&format!("f{i}")],
    )
}

fn edge(src: &NodeId, dst: &NodeId, kind: EdgeKind, active: bool) -> Edge {
    Edge {
        src: src.clone(),
        dst: dst.clone(),
        kind,
        weight: 0.5,
        evidence: 1,
        stage: "t".into(),
        run_id: "r".into(),
        created_at: 0,
        active,
        metadata: Default::default(),
    }
}

fn vector(node: &Node) -> Embedding {
    Embedding {
        node_id: node.id.clone(),
        model_id: "m".into(),
        text_sha256: node.id.as_str().into(),
        vector: vec![1.0, 0.0],
    }
}

/// The counts `stats` gives, whether the manifest's hold, and the counts from the shards.
fn counts(dir: &std::path::Path) -> (fluxmem_graph::GraphStats, bool, fluxmem_graph::GraphStats) {
    let store = Store::open(dir).unwrap();
    let (stats, manifest) = store.stats().unwrap();
    let counted = store.count_live(&manifest).unwrap();
    assert_eq!(
        counted,
        store.load().unwrap().stats(),
        "the column count is the whole graph's"
    );
    (stats, manifest.current_counts().is_some(), counted)
}

#[test]
fn counts_follow_added_rows_lapse_on_rewrites_and_return_with_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let (stats, held, counted) = counts(dir.path());
    assert!(held, "an empty store's counts hold");
    assert_eq!(stats, counted);

    // Ingest-like and embed-like commits: only new keys; the counts carry forward.
    let mut delta = Graph::default();
    (0..6).for_each(|i| delta.upsert_node(episode(i)));
    (0..3).for_each(|i| delta.upsert_node(fact(i)));
    writer.commit_new(&delta, info()).unwrap();
    let mut delta = Graph::default();
    (0..4)
        .map(episode)
        .chain((0..3).map(fact))
        .for_each(|n| delta.upsert_embedding(vector(&n)));
    writer.commit_new(&delta, info()).unwrap();
    let (stats, held, counted) = counts(dir.path());
    assert!(held);
    assert_eq!(stats, counted);
    assert_eq!((stats.episodic, stats.semantic, stats.embedded), (6, 3, 7));

    // Connect- and refine-like commits: new edges, then some of them rewritten (one
    // deactivated). The counts lapse; stats counts from the shards.
    let mut delta = Graph::default();
    for i in 0..6 {
        delta.upsert_edge(edge(
            &fact(i % 3).id,
            &episode(i).id,
            EdgeKind::Ground,
            true,
        ));
        delta.upsert_edge(edge(
            &episode(i).id,
            &episode((i + 1) % 6).id,
            EdgeKind::Link,
            true,
        ));
    }
    writer.commit(&delta, info()).unwrap();
    let mut delta = Graph::default();
    delta.upsert_edge(edge(&fact(0).id, &episode(0).id, EdgeKind::Ground, false));
    delta.upsert_edge(edge(&episode(1).id, &episode(2).id, EdgeKind::Link, true));
    writer.commit(&delta, info()).unwrap();
    let (stats, held, counted) = counts(dir.path());
    assert!(
        !held,
        "a commit that may replace rows leaves the counts behind"
    );
    assert_eq!(stats, counted);
    assert_eq!((stats.ground, stats.link), (5, 6));

    // A commit of new keys on lapsed counts does not revive them.
    let mut delta = Graph::default();
    delta.upsert_node(episode(6));
    writer.commit_new(&delta, info()).unwrap();
    let (stats, held, counted) = counts(dir.path());
    assert!(!held);
    assert_eq!(stats, counted);

    // Compaction writes them, with its merges or on their own.
    let report = writer.compact(&CompactPolicy::default(), "c").unwrap();
    assert!(
        report.counted && !report.committed,
        "nothing to merge at this size: a counts-only commit"
    );
    let (stats, held, counted) = counts(dir.path());
    assert!(held);
    assert_eq!(stats, counted);
    assert_eq!(
        (
            stats.episodic,
            stats.semantic,
            stats.embedded,
            stats.ground,
            stats.link
        ),
        (7, 3, 7, 5, 6)
    );
    let again = writer.compact(&CompactPolicy::default(), "c").unwrap();
    assert!(
        !again.counted && !again.committed,
        "counts that hold are not written again"
    );
    let merging = CompactPolicy {
        max_dead_fraction: 0.0,
        merge_factor: 2,
        min_level_rows: 1,
        ..Default::default()
    };
    let report = writer.compact(&merging, "c").unwrap();
    assert!(report.committed && report.counted);
    let (stats, held, counted) = counts(dir.path());
    assert!(held);
    assert_eq!(stats, counted);

    // And carried forward from there by new keys.
    let mut delta = Graph::default();
    delta.upsert_node(episode(7));
    delta.upsert_embedding(vector(&episode(7)));
    writer.commit_new(&delta, info()).unwrap();
    let (stats, held, counted) = counts(dir.path());
    assert!(held);
    assert_eq!(stats, counted);
    assert_eq!((stats.episodic, stats.embedded), (8, 8));
}
