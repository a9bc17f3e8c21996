//! Store behaviour: round trip, upserts, corruption detection, locking, model checks.

use fluxmem_graph::{
    Changed, Edge, EdgeKind, Edit, Embedding, Episode, Graph, Node, NodeBody, NodeId, Outcome,
    Semantic, Skill, Step, ToolCall,
};
use fluxmem_store::{CommitInfo, Error, Store, Writer};
use proptest::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;

fn info(stage: &str) -> CommitInfo {
    CommitInfo {
        stage: stage.into(),
        run_id: "test-run".into(),
        ..Default::default()
    }
}

fn text() -> impl Strategy<Value = String> {
    "\\PC{0,24}"
}

fn metadata() -> impl Strategy<Value = BTreeMap<String, Value>> {
    prop::collection::btree_map(
        "[a-z_]{1,8}",
        prop_oneof![
            text().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<bool>().prop_map(Value::from),
            Just(Value::Null),
        ],
        0..3,
    )
}

fn step() -> impl Strategy<Value = Step> {
    (
        text(),
        text(),
        prop::collection::vec((text(), text(), prop::option::of(text())), 0..2),
        prop::option::of(text()),
        prop::option::of(0i64..4_000_000_000_000),
    )
        .prop_map(|(observation, action, calls, feedback, timestamp)| Step {
            observation,
            action,
            tool_calls: calls
                .into_iter()
                .map(|(name, arguments, result)| ToolCall {
                    name,
                    arguments,
                    result,
                })
                .collect(),
            feedback,
            timestamp,
        })
}

fn body() -> impl Strategy<Value = NodeBody> {
    prop_oneof![
        (
            text(),
            any::<i64>(),
            prop::option::of(text()),
            prop::option::of(text())
        )
            .prop_map(
                |(source, position, time, group)| NodeBody::Semantic(Semantic {
                    source,
                    position,
                    time,
                    group
                })
            ),
        (
            prop::collection::vec(step(), 0..4),
            prop::option::of(any::<bool>()),
            prop::option::of(-10.0f64..10.0),
            prop::option::of(text())
        )
            .prop_map(
                |(steps, success, reward, feedback)| NodeBody::Episodic(Episode {
                    steps,
                    outcome: Outcome {
                        success,
                        reward,
                        feedback
                    }
                })
            ),
        (
            1i64..9,
            prop::collection::vec(text(), 0..3),
            prop::collection::vec(text(), 0..3),
            prop::collection::vec(0.0f64..1.0, 0..4)
        )
            .prop_map(
                |(version, previous, sources, pems_history)| NodeBody::Procedural(Skill {
                    version,
                    previous_versions: previous.into_iter().map(NodeId).collect(),
                    source_episodes: sources.into_iter().map(NodeId).collect(),
                    pems_history,
                })
            ),
    ]
}

fn node() -> impl Strategy<Value = Node> {
    (
        body(),
        text(),
        text(),
        prop::option::of(text()),
        text(),
        text(),
        prop::option::of(-1_000_000_000_000i64..4_000_000_000_000),
        metadata(),
    )
        .prop_map(
            |(body, tenant, text, agent, file, locator, created_at, metadata)| {
                let mut node = Node::new(body, &tenant, &text, &[&text, &file, &locator]);
                node.agent_id = agent;
                node.source_file = file;
                node.source_locator = locator;
                node.created_at = created_at;
                node.metadata = metadata;
                node
            },
        )
}

fn graph() -> impl Strategy<Value = Graph> {
    (
        prop::collection::vec(node(), 0..12),
        prop::collection::vec(
            (
                any::<prop::sample::Index>(),
                any::<prop::sample::Index>(),
                0usize..3,
                -5.0f32..5.0,
                0i64..100,
                any::<bool>(),
                metadata(),
            ),
            0..10,
        ),
        prop::collection::vec(-1.0f32..1.0, 4),
    )
        .prop_map(|(nodes, edges, base_vector)| {
            let mut graph = Graph::default();
            for node in nodes {
                graph.upsert_node(node);
            }
            let ids: Vec<NodeId> = graph.nodes.keys().cloned().collect();
            if !ids.is_empty() {
                for (a, b, kind, weight, evidence, active, metadata) in edges {
                    graph.upsert_edge(Edge {
                        src: a.get(&ids).clone(),
                        dst: b.get(&ids).clone(),
                        kind: EdgeKind::ALL[kind],
                        weight,
                        evidence,
                        stage: "connect".into(),
                        run_id: "r1".into(),
                        created_at: 1_700_000_000_000,
                        active,
                        metadata,
                    });
                }
                let first_edge = graph.edges.values().next().cloned();
                if let Some(edge) = first_edge {
                    let mut pruned = edge.clone();
                    pruned.active = false;
                    let reason = format!("weight {}", edge.weight);
                    graph.edits.push(Edit::new(
                        "refine",
                        "r1",
                        "link_prune",
                        Changed::Edge(Some(&edge), Some(&pruned)),
                        &reason,
                        7,
                    ));
                    let node = graph.nodes.values().next().expect("ids is not empty");
                    graph.edits.push(Edit::new(
                        "refine",
                        "r1",
                        "node_reshape",
                        Changed::Node(None, Some(node)),
                        "finer",
                        8,
                    ));
                }
                for (i, id) in ids.iter().enumerate().step_by(2) {
                    let vector = base_vector.iter().map(|v| v * (i as f32 + 1.0)).collect();
                    graph.upsert_embedding(Embedding {
                        node_id: id.clone(),
                        model_id: "m".into(),
                        text_sha256: "h".into(),
                        vector,
                    });
                }
            }
            graph
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Write then read gives the same graph, through real Parquet files.
    #[test]
    fn write_then_read_is_identity(graph in graph()) {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::open(dir.path()).unwrap();
        writer.commit(&graph, info("test")).unwrap();
        drop(writer);
        let loaded = Store::open(dir.path()).unwrap().load().unwrap();
        prop_assert_eq!(loaded, graph);
    }

    /// Committing a graph in two parts gives the same graph as one commit (later wins).
    #[test]
    fn split_commits_equal_one_commit(first in graph(), second in graph()) {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::open(dir.path()).unwrap();
        writer.commit(&first, info("a")).unwrap();
        writer.commit(&second, info("b")).unwrap();
        let mut expected = first.clone();
        expected.apply(second.clone());
        prop_assert_eq!(writer.store().load().unwrap(), expected);
    }
}

fn sample_graph() -> Graph {
    let mut graph = Graph::default();
    for i in 0..5 {
        let text = format!("fact number {i}");
        let body = NodeBody::Semantic(Semantic {
            source: "doc".into(),
            position: i,
            time: None,
            group: None,
        });
        graph.insert_node(Node::new(body, "default", &text, &["doc", &text]));
    }
    graph
}

fn committed_store() -> (tempfile::TempDir, Graph) {
    let dir = tempfile::tempdir().unwrap();
    let graph = sample_graph();
    Writer::open(dir.path())
        .unwrap()
        .commit(&graph, info("ingest"))
        .unwrap();
    (dir, graph)
}

fn only_shard(dir: &std::path::Path) -> std::path::PathBuf {
    let manifest = Store::open(dir).unwrap().manifest().unwrap();
    dir.join(&manifest.shards[0].file)
}

fn expect_corrupt(dir: &std::path::Path, needle: &str) {
    match Store::open(dir).unwrap().load() {
        Err(Error::Corrupt { path, reason }) => {
            assert!(
                reason.contains(needle),
                "reason `{reason}` lacks `{needle}`"
            );
            assert!(
                path.exists() || reason.contains("missing"),
                "error names a real file: {}",
                path.display()
            );
        }
        other => panic!("expected a corruption error, got {other:?}"),
    }
}

#[test]
fn flipped_byte_is_a_checksum_error_naming_the_file() {
    let (dir, _) = committed_store();
    let shard = only_shard(dir.path());
    let mut bytes = std::fs::read(&shard).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let error = Store::open(dir.path()).unwrap().load().unwrap_err();
    let message = error.to_string();
    assert!(message.contains("checksum mismatch"), "{message}");
    assert!(
        message.contains(shard.file_name().unwrap().to_str().unwrap()),
        "names the file: {message}"
    );
}

#[test]
fn truncated_and_missing_shards_are_corruption() {
    let (dir, _) = committed_store();
    let shard = only_shard(dir.path());
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 3]).unwrap();
    expect_corrupt(dir.path(), "bytes, the manifest says");
    std::fs::remove_file(&shard).unwrap();
    expect_corrupt(dir.path(), "missing");
}

#[test]
fn foreign_parquet_with_matching_checksum_is_rejected() {
    // A valid Parquet file of another table dropped in place, manifest checksum updated to
    // match: the table tag still catches it.
    let (dir, _) = committed_store();
    let other = tempfile::tempdir().unwrap();
    let mut graph = sample_graph();
    graph.upsert_edge(Edge {
        src: graph.nodes.keys().next().unwrap().clone(),
        dst: graph.nodes.keys().nth(1).unwrap().clone(),
        kind: EdgeKind::Link,
        weight: 1.0,
        evidence: 1,
        stage: "s".into(),
        run_id: "r".into(),
        created_at: 0,
        active: true,
        metadata: BTreeMap::new(),
    });
    graph.nodes.clear();
    Writer::open(other.path())
        .unwrap()
        .commit(&graph, info("x"))
        .unwrap();
    let edges_shard = only_shard(other.path());
    let bytes = std::fs::read(&edges_shard).unwrap();
    let manifest_path = dir.path().join("manifest.json");
    let mut manifest: Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let file = manifest["shards"][0]["file"].as_str().unwrap().to_string();
    std::fs::write(dir.path().join(&file), &bytes).unwrap();
    manifest["shards"][0]["sha256"] = Value::from(fluxmem_graph::sha256_hex(&bytes));
    manifest["shards"][0]["bytes"] = Value::from(bytes.len());
    manifest["shards"][0]["rows"] = Value::from(1);
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    expect_corrupt(dir.path(), "not a fluxmem `nodes` shard");
}

#[test]
fn bad_manifest_and_other_schema_versions_are_clear_errors() {
    let (dir, _) = committed_store();
    let manifest_path = dir.path().join("manifest.json");
    let original = std::fs::read(&manifest_path).unwrap();
    let mut manifest: Value = serde_json::from_slice(&original).unwrap();
    manifest["schema_version"] = Value::from(99);
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let error = Store::open(dir.path()).unwrap().manifest().unwrap_err();
    assert!(
        matches!(error, Error::UnsupportedVersion { found: 99, .. }),
        "{error:?}"
    );
    std::fs::write(&manifest_path, b"{ not json").unwrap();
    let error = Store::open(dir.path()).unwrap().manifest().unwrap_err();
    assert!(matches!(error, Error::Corrupt { .. }), "{error:?}");
    assert!(error.to_string().contains("manifest.json"), "{error}");
}

#[test]
fn second_writer_is_refused_with_the_holder_named() {
    let dir = tempfile::tempdir().unwrap();
    let first = Writer::open(dir.path()).unwrap();
    let error = Writer::open(dir.path()).unwrap_err();
    match &error {
        Error::Locked { holder, .. } => assert!(
            holder.contains(&format!("pid {}", std::process::id())),
            "{holder}"
        ),
        other => panic!("expected Locked, got {other:?}"),
    }
    assert!(error.to_string().contains("locked by another writer"));
    drop(first);
    let again = Writer::open(dir.path()).unwrap();
    assert!(
        again.stale_lock().is_none(),
        "a clean release leaves no stale lock"
    );
}

#[test]
fn stale_lock_after_a_crash_is_taken_over_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    drop(Writer::open(dir.path()).unwrap());
    // What a killed writer leaves: a lock file naming it, with no OS lock held.
    std::fs::write(
        dir.path().join("LOCK"),
        "pid 999999 on ghost since 2026-01-01T00:00:00Z",
    )
    .unwrap();
    let writer = Writer::open(dir.path()).unwrap();
    assert_eq!(
        writer.stale_lock(),
        Some("pid 999999 on ghost since 2026-01-01T00:00:00Z")
    );
}

#[test]
fn interrupted_commit_leaves_the_old_state_and_is_cleaned_up() {
    let (dir, graph) = committed_store();
    let before = Store::open(dir.path()).unwrap().manifest().unwrap();
    // An interrupted commit: a shard written, the manifest never renamed, a temp manifest left.
    std::fs::write(
        dir.path()
            .join("shards/nodes-00000002-000-deadbeef0000.parquet"),
        b"partial",
    )
    .unwrap();
    std::fs::write(dir.path().join("manifest.json.tmp-4242"), b"{").unwrap();
    // A killed compaction's streaming writer: its file under the temporary name. One of the
    // current commit's number is not provably garbage (no writer names a file so) and stays.
    std::fs::write(
        dir.path().join("shards/edges-00000002-001.parquet.tmp"),
        b"partial",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("shards/edges-00000001-001.parquet.tmp"),
        b"not ours",
    )
    .unwrap();
    assert_eq!(Store::open(dir.path()).unwrap().load().unwrap(), graph);
    let writer = Writer::open(dir.path()).unwrap();
    assert_eq!(writer.manifest(), &before);
    assert!(!dir
        .path()
        .join("shards/nodes-00000002-000-deadbeef0000.parquet")
        .exists());
    assert!(!dir
        .path()
        .join("shards/edges-00000002-001.parquet.tmp")
        .exists());
    assert!(dir
        .path()
        .join("shards/edges-00000001-001.parquet.tmp")
        .exists());
    assert!(!dir.path().join("manifest.json.tmp-4242").exists());
}

#[test]
fn mixing_embedding_models_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let graph = sample_graph();
    let id = graph.nodes.keys().next().unwrap().clone();
    let mut first = Graph::default();
    first.upsert_embedding(Embedding {
        node_id: id.clone(),
        model_id: "minilm".into(),
        text_sha256: "h".into(),
        vector: vec![0.5; 4],
    });
    writer.commit(&first, info("embed")).unwrap();
    let mut other_model = Graph::default();
    other_model.upsert_embedding(Embedding {
        node_id: id.clone(),
        model_id: "bge".into(),
        text_sha256: "h".into(),
        vector: vec![0.5; 4],
    });
    assert!(matches!(
        writer.commit(&other_model, info("embed")),
        Err(Error::ModelMismatch { .. })
    ));
    let mut other_dim = Graph::default();
    other_dim.upsert_embedding(Embedding {
        node_id: id,
        model_id: "minilm".into(),
        text_sha256: "h".into(),
        vector: vec![0.5; 8],
    });
    let error = writer.commit(&other_dim, info("embed")).unwrap_err();
    assert!(error.to_string().contains("--reembed"), "{error}");
    assert_eq!(
        writer.manifest().version,
        1,
        "refused commits change nothing"
    );
}

#[test]
fn replace_compacts_into_one_commit() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let graph = sample_graph();
    for (i, node) in graph.nodes.values().enumerate() {
        let mut one = Graph::default();
        one.upsert_node(node.clone());
        writer.commit(&one, info(&format!("c{i}"))).unwrap();
    }
    assert_eq!(writer.manifest().shards.len(), 5);
    let full = writer.store().load().unwrap();
    writer.replace(&full, info("compact")).unwrap();
    assert_eq!(writer.manifest().shards.len(), 1);
    assert_eq!(
        std::fs::read_dir(dir.path().join("shards"))
            .unwrap()
            .count(),
        1
    );
    assert_eq!(writer.store().load().unwrap(), graph);
}

#[test]
fn a_crash_during_the_first_manifest_write_does_not_block_the_store() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("shards")).unwrap();
    std::fs::write(dir.path().join("manifest.json.tmp-99"), b"{").unwrap();
    let writer = Writer::open(dir.path()).unwrap();
    assert_eq!(writer.manifest().version, 0);
    assert!(!dir.path().join("manifest.json.tmp-99").exists());
}

#[test]
fn refuses_to_create_a_store_in_a_non_empty_foreign_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("thesis.tex"), "precious").unwrap();
    let error = Writer::open(dir.path()).unwrap_err();
    assert!(error.to_string().contains("not empty"), "{error}");
    assert!(dir.path().join("thesis.tex").exists());
}

/// Issue 13.1: a lost manifest used to make the next writer create an empty store and delete
/// every shard as an orphan.
#[test]
fn a_store_without_its_manifest_is_refused_not_recreated_and_recover_rebuilds_it() {
    let (dir, graph) = committed_store();
    let mut writer = Writer::open(dir.path()).unwrap();
    let mut more = Graph::default();
    let body = NodeBody::Semantic(Semantic {
        source: "doc".into(),
        position: 9,
        time: None,
        group: None,
    });
    more.insert_node(Node::new(
        body,
        "default",
        "a later fact",
        &["doc", "later"],
    ));
    writer.commit(&more, info("ingest")).unwrap();
    drop(writer);
    let expected = Store::open(dir.path()).unwrap().load().unwrap();
    assert_eq!(expected.nodes.len(), graph.nodes.len() + 1);
    let shard_count = || {
        std::fs::read_dir(dir.path().join("shards"))
            .unwrap()
            .count()
    };
    let shards_before = shard_count();
    std::fs::remove_file(dir.path().join("manifest.json")).unwrap();

    let error = Writer::open(dir.path()).unwrap_err();
    assert!(
        matches!(error, Error::NoManifest { shards, .. } if shards == shards_before),
        "{error}"
    );
    assert!(error.to_string().contains("store recover"), "{error}");
    assert!(matches!(
        Store::open(dir.path()),
        Err(Error::NoManifest { .. })
    ));
    assert_eq!(shard_count(), shards_before, "nothing deleted");
    assert!(
        !dir.path().join("manifest.json").exists(),
        "no empty manifest written"
    );

    let report = fluxmem_store::recover(dir.path()).unwrap();
    assert_eq!(report.version, 2);
    assert!(report.rejected.is_empty(), "{:?}", report.rejected);
    assert!(
        report.unproven.iter().any(|u| u.contains("commit 2")),
        "{:?}",
        report.unproven
    );
    assert_eq!(Store::open(dir.path()).unwrap().load().unwrap(), expected);
    let writer = Writer::open(dir.path()).unwrap();
    assert_eq!(writer.manifest().version, 2);
    assert!(
        matches!(
            fluxmem_store::recover(dir.path()),
            Err(Error::Locked { .. })
        ),
        "recover takes the writer lock"
    );
    drop(writer);
    assert!(
        matches!(
            fluxmem_store::recover(dir.path()),
            Err(Error::Recover { .. })
        ),
        "a readable manifest is not recovered over"
    );
}

#[test]
fn recover_adopts_a_complete_temporary_manifest_and_leaves_damaged_shards_in_place() {
    let (dir, graph) = committed_store();
    let original = Store::open(dir.path()).unwrap().manifest().unwrap();
    std::fs::rename(
        dir.path().join("manifest.json"),
        dir.path().join("manifest.json.tmp-77"),
    )
    .unwrap();
    assert!(matches!(
        Writer::open(dir.path()),
        Err(Error::NoManifest { .. })
    ));
    std::fs::write(
        dir.path()
            .join("shards/nodes-00000003-000-0123456789ab.parquet"),
        b"torn write",
    )
    .unwrap();
    let report = fluxmem_store::recover(dir.path()).unwrap();
    assert!(report.adopted_temporary.is_some(), "{report:?}");
    assert_eq!(report.rejected.len(), 1, "{:?}", report.rejected);
    assert!(
        report.rejected[0].1.contains("does not match"),
        "{:?}",
        report.rejected
    );
    assert!(
        dir.path()
            .join("shards/nodes-00000003-000-0123456789ab.parquet")
            .exists(),
        "nothing deleted"
    );
    let manifest = Store::open(dir.path()).unwrap().manifest().unwrap();
    assert_eq!(manifest.shards, original.shards);
    assert_eq!(
        manifest.commits, original.commits,
        "the adopted manifest's commit log is kept"
    );
    assert_eq!(Store::open(dir.path()).unwrap().load().unwrap(), graph);
}

/// A compaction's outputs carry the span of commits whose rows they hold, which their files do
/// not: recovery still adopts a temporary manifest that lists them, spans included.
#[test]
fn recover_adopts_a_temporary_manifest_that_lists_compacted_shards() {
    let (dir, graph) = committed_store();
    let mut writer = Writer::open(dir.path()).unwrap();
    for i in 0..3 {
        let mut more = Graph::default();
        let body = NodeBody::Semantic(Semantic {
            source: "doc".into(),
            position: 20 + i,
            time: None,
            group: None,
        });
        more.insert_node(Node::new(
            body,
            "default",
            &format!("a later fact {i}"),
            &["doc", &i.to_string()],
        ));
        writer.commit(&more, info("ingest")).unwrap();
    }
    let policy = fluxmem_store::CompactPolicy {
        merge_factor: 2,
        min_level_rows: 1,
        ..Default::default()
    };
    assert!(writer.compact(&policy, "compact").unwrap().committed);
    drop(writer);
    let original = Store::open(dir.path()).unwrap().manifest().unwrap();
    assert!(
        original
            .shards
            .iter()
            .any(|s| s.rows_from.is_some() && s.rows_through > s.rows_from),
        "a merged shard spans commits: {:?}",
        original.shards
    );
    let expected = Store::open(dir.path()).unwrap().load().unwrap();
    assert!(expected.nodes.len() > graph.nodes.len());
    std::fs::rename(
        dir.path().join("manifest.json"),
        dir.path().join("manifest.json.tmp-9"),
    )
    .unwrap();
    let report = fluxmem_store::recover(dir.path()).unwrap();
    assert!(report.adopted_temporary.is_some(), "{report:?}");
    // The files the compaction retired are left in place, not listed.
    assert!(
        report
            .rejected
            .iter()
            .all(|(_, why)| why.contains("not listed by the adopted manifest")),
        "{report:?}"
    );
    let manifest = Store::open(dir.path()).unwrap().manifest().unwrap();
    assert_eq!(manifest.shards, original.shards, "the spans are kept");
    assert_eq!(manifest.progress, original.progress);
    assert_eq!(Store::open(dir.path()).unwrap().load().unwrap(), expected);
}

/// Issue 13.3: with the LOCK file deleted, two writers both ran and the first one's manifest
/// overwrote the second's commit, whose shards were later deleted as orphans. Issue 40.0: the
/// second one's open-time cleanup deleted the first one's in-flight shard. The lock is now on
/// the store directory, so a deleted LOCK file lets nobody in; a writer that bypasses the lock
/// altogether (here: a commit made in a copy and put in place behind the first writer's back)
/// still cannot be overwritten, by the manifest's compare-and-swap.
#[test]
fn a_writer_whose_lock_was_lost_cannot_overwrite_another_writers_commit() {
    let (dir, graph) = committed_store();
    let mut first = Writer::open(dir.path()).unwrap();
    std::fs::remove_file(dir.path().join("LOCK")).unwrap();
    let refused = Writer::open(dir.path()).unwrap_err();
    assert!(matches!(refused, Error::Locked { .. }), "{refused}");
    let copy = tempfile::tempdir().unwrap();
    copy_files(dir.path(), copy.path());
    let mut second = Writer::open(copy.path()).unwrap();
    let mut theirs = Graph::default();
    let body = NodeBody::Semantic(Semantic {
        source: "doc".into(),
        position: 7,
        time: None,
        group: None,
    });
    theirs.insert_node(Node::new(
        body,
        "default",
        "the second writer's fact",
        &["doc", "second"],
    ));
    second.commit(&theirs, info("ingest")).unwrap();
    drop(second);
    // The foreign commit lands: its shards first, its manifest last.
    for entry in std::fs::read_dir(copy.path().join("shards"))
        .unwrap()
        .flatten()
    {
        let target = dir.path().join("shards").join(entry.file_name());
        if !target.exists() {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
    std::fs::copy(
        copy.path().join("manifest.json"),
        dir.path().join("manifest.json"),
    )
    .unwrap();
    let mut ours = Graph::default();
    let body = NodeBody::Semantic(Semantic {
        source: "doc".into(),
        position: 8,
        time: None,
        group: None,
    });
    ours.insert_node(Node::new(
        body,
        "default",
        "the first writer's fact",
        &["doc", "first"],
    ));
    let error = first.commit(&ours, info("ingest")).unwrap_err();
    assert!(matches!(error, Error::Conflict { .. }), "{error}");
    assert!(error.to_string().contains("nothing was deleted"), "{error}");
    drop(first);
    let loaded = Store::open(dir.path()).unwrap().load().unwrap();
    assert_eq!(
        loaded.nodes.len(),
        graph.nodes.len() + 1,
        "the second writer's commit survives"
    );
    assert!(loaded
        .nodes
        .values()
        .any(|n| n.text == "the second writer's fact"));
    // Reopening keeps every listed shard; the refused commit's files (same version as the
    // second writer's commit, so not provably an interrupted commit on top of it) are kept too.
    let writer = Writer::open(dir.path()).unwrap();
    assert_eq!(writer.store().load().unwrap(), loaded);
    assert_eq!(
        writer.unlisted_shards().unwrap().len(),
        1,
        "the abandoned commit's shard is reported, not deleted"
    );
}

/// Copies the files of `from` (not its folders' contents but `shards/`, one level) into `to`.
fn copy_files(from: &std::path::Path, to: &std::path::Path) {
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            if entry.file_name() == "shards" {
                std::fs::create_dir_all(&target).unwrap();
                copy_files(&entry.path(), &target);
            }
        } else if entry.file_name() != "LOCK" {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Issue 40.0, raced: while a writer commits, LOCK is deleted and a second writer tries to open
/// the store, a thousand times. The second is refused every time (so its open-time cleanup never
/// runs), and after each race the store reads whole with every commit of the first.
#[test]
fn a_deleted_lock_never_lets_a_second_writer_delete_a_running_writers_files() {
    for round in 0..1000u32 {
        let dir = tempfile::tempdir().unwrap();
        drop(Writer::open(dir.path()).unwrap());
        let (opened_tx, opened_rx) = std::sync::mpsc::channel();
        let path = dir.path().to_path_buf();
        let first = std::thread::spawn(move || {
            let mut writer = Writer::open(&path).unwrap();
            opened_tx.send(()).unwrap();
            for part in 0..2u32 {
                let mut delta = Graph::default();
                delta.insert_node(Node::new(
                    NodeBody::Semantic(Semantic {
                        source: "race".into(),
                        position: i64::from(round * 2 + part),
                        time: None,
                        group: None,
                    }),
                    "default",
                    &format!("fact {round}.{part}"),
                    &["race", &format!("{round}.{part}")],
                ));
                writer.commit(&delta, info("ingest")).unwrap();
            }
        });
        opened_rx.recv().unwrap();
        let _ = std::fs::remove_file(dir.path().join("LOCK"));
        match Writer::open(dir.path()) {
            Err(Error::Locked { .. }) => {}
            // The first writer finished before this open: it may go ahead.
            Ok(writer) => drop(writer),
            Err(other) => panic!("round {round}: {other}"),
        }
        first.join().unwrap();
        let loaded = Store::open(dir.path()).unwrap().load().unwrap();
        assert_eq!(loaded.nodes.len(), 2, "round {round}");
    }
}
