//! The embed stage against a real store, with weight-free embedders.

use fluxmem_embed::{embed_store, EmbedOptions, Error, NoProgress};
use fluxmem_graph::{Graph, Node, NodeBody, Semantic};
use fluxmem_models::HashEmbedder;
use fluxmem_store::{CommitInfo, Store, Writer};
use std::sync::atomic::Ordering;

mod common;
use common::Scripted;

fn store_with(texts: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut graph = Graph::default();
    for (i, text) in texts.iter().enumerate() {
        let body = NodeBody::Semantic(Semantic {
            source: "doc".into(),
            position: i as i64,
            time: None,
            group: None,
        });
        graph.insert_node(Node::new(
            body,
            "default",
            text,
            &["doc", &i.to_string(), text],
        ));
    }
    Writer::open(dir.path())
        .unwrap()
        .commit(
            &graph,
            CommitInfo {
                stage: "ingest".into(),
                ..Default::default()
            },
        )
        .unwrap();
    dir
}

const TEXTS: [&str; 7] = [
    "alpha beta",
    "gamma",
    "alpha beta",
    "delta epsilon",
    "zeta",
    "eta theta",
    "gamma",
];

#[test]
fn embeds_every_node_once_and_reuses_vectors_of_identical_text() {
    let dir = store_with(&TEXTS);
    let mut writer = Writer::open(dir.path()).unwrap();
    let embedder = Scripted::failing_after(usize::MAX);
    let options = EmbedOptions {
        batch_size: 2,
        commit_every: 100,
        reembed: false,
        ..Default::default()
    };
    let report = embed_store(&mut writer, &embedder, &options, "r1", &mut NoProgress).unwrap();
    assert_eq!(
        (report.nodes, report.embedded, report.cached, report.already),
        (7, 5, 2, 0)
    );
    assert_eq!(
        embedder.texts.load(Ordering::SeqCst),
        5,
        "identical texts are embedded once"
    );
    let graph = writer.store().load().unwrap();
    assert_eq!(graph.stats().embedded, 7);
    let again = embed_store(&mut writer, &embedder, &options, "r2", &mut NoProgress).unwrap();
    assert_eq!(
        (again.embedded, again.cached, again.already, again.commits),
        (0, 0, 7, 0)
    );
}

#[test]
fn interrupted_run_keeps_its_commits_and_a_rerun_finishes_identically() {
    let reference_dir = store_with(&TEXTS);
    let options = EmbedOptions {
        batch_size: 1,
        commit_every: 2,
        reembed: false,
        ..Default::default()
    };
    let mut reference = Writer::open(reference_dir.path()).unwrap();
    embed_store(
        &mut reference,
        &Scripted::failing_after(usize::MAX),
        &options,
        "r",
        &mut NoProgress,
    )
    .unwrap();
    let expected = reference.store().load().unwrap();

    let dir = store_with(&TEXTS);
    let mut writer = Writer::open(dir.path()).unwrap();
    let crashing = Scripted::failing_after(3);
    assert!(embed_store(&mut writer, &crashing, &options, "r1", &mut NoProgress).is_err());
    let partial = writer.store().load().unwrap().stats().embedded;
    assert!(
        partial > 0 && partial < 7,
        "some chunks were committed before the crash ({partial})"
    );
    let resumed = Scripted::failing_after(usize::MAX);
    let report = embed_store(&mut writer, &resumed, &options, "r2", &mut NoProgress).unwrap();
    assert_eq!(report.already, partial);
    assert_eq!(
        writer.store().load().unwrap().embeddings,
        expected.embeddings
    );
}

#[test]
fn another_model_is_refused_until_reembed_migrates_the_store() {
    let dir = store_with(&TEXTS);
    let mut writer = Writer::open(dir.path()).unwrap();
    embed_store(
        &mut writer,
        &HashEmbedder::new(16),
        &EmbedOptions::default(),
        "r1",
        &mut NoProgress,
    )
    .unwrap();
    let other = HashEmbedder::new(32);
    let error = embed_store(
        &mut writer,
        &other,
        &EmbedOptions::default(),
        "r2",
        &mut NoProgress,
    )
    .unwrap_err();
    assert!(matches!(error, Error::ModelMismatch { .. }));
    assert!(error.to_string().contains("--reembed"), "{error}");
    let options = EmbedOptions {
        reembed: true,
        ..EmbedOptions::default()
    };
    let report = embed_store(&mut writer, &other, &options, "r3", &mut NoProgress).unwrap();
    assert_eq!(report.embedded, 5);
    let store = Store::open(dir.path()).unwrap();
    let manifest = store.manifest().unwrap();
    assert_eq!(manifest.embedding_model.unwrap().dim, 32);
    let graph = store.load().unwrap();
    assert_eq!(graph.embeddings.len(), 7);
    assert!(graph
        .embeddings
        .values()
        .all(|e| e.model_id == "hash-32" && e.vector.len() == 32));
    assert_eq!(graph.nodes.len(), 7, "migration keeps every node");
}

/// A run a window of two nodes at a time writes the same shards as one that holds every node
/// at once, and a text repeated in a later window is read back from the store, not embedded
/// again.
#[test]
fn a_small_window_writes_the_same_shards_and_embeds_each_text_once() {
    let shards = |window: usize| {
        let dir = store_with(&TEXTS);
        let mut writer = Writer::open(dir.path()).unwrap();
        let embedder = Scripted::failing_after(usize::MAX);
        let options = EmbedOptions {
            batch_size: 1,
            commit_every: 2,
            window,
            ..Default::default()
        };
        let report = embed_store(&mut writer, &embedder, &options, "r", &mut NoProgress).unwrap();
        let manifest = Store::open(dir.path()).unwrap().manifest().unwrap();
        let files: Vec<(String, u64, String)> = manifest
            .shards
            .iter()
            .map(|s| (s.table.clone(), s.rows, s.sha256.clone()))
            .collect();
        (report, embedder.texts.load(Ordering::SeqCst), files)
    };
    let (whole, whole_texts, whole_files) = shards(1_000);
    let (small, small_texts, small_files) = shards(2);
    assert_eq!((whole.embedded, whole.cached, whole.commits), (5, 2, 4));
    assert_eq!(small, whole);
    assert_eq!(
        (small_texts, whole_texts),
        (5, 5),
        "a text of an earlier window is not embedded again"
    );
    assert_eq!(small_files, whole_files);
}

/// A later night's nodes that repeat texts of the stored history take the stored vectors (found
/// in the live embedding keys), and only their new texts are embedded; a third run finds
/// nothing to do.
#[test]
fn a_later_night_reads_repeated_texts_back_from_the_history() {
    let dir = store_with(&TEXTS);
    let mut writer = Writer::open(dir.path()).unwrap();
    let options = EmbedOptions {
        batch_size: 1,
        commit_every: 2,
        window: 2,
        ..Default::default()
    };
    embed_store(
        &mut writer,
        &Scripted::failing_after(usize::MAX),
        &options,
        "r1",
        &mut NoProgress,
    )
    .unwrap();
    let mut night = Graph::default();
    for (i, text) in ["gamma", "zeta", "iota kappa", "alpha beta", "iota kappa"]
        .iter()
        .enumerate()
    {
        let body = NodeBody::Semantic(Semantic {
            source: "doc2".into(),
            position: i as i64,
            time: None,
            group: None,
        });
        night.insert_node(Node::new(
            body,
            "default",
            text,
            &["doc2", &i.to_string(), text],
        ));
    }
    writer
        .commit(
            &night,
            CommitInfo {
                stage: "ingest".into(),
                ..Default::default()
            },
        )
        .unwrap();
    let embedder = Scripted::failing_after(usize::MAX);
    let report = embed_store(&mut writer, &embedder, &options, "r2", &mut NoProgress).unwrap();
    assert_eq!(
        (report.nodes, report.already, report.embedded, report.cached),
        (12, 7, 1, 4),
        "{report:?}"
    );
    assert_eq!(
        embedder.texts.load(Ordering::SeqCst),
        1,
        "only `iota kappa` is new"
    );
    let graph = writer.store().load().unwrap();
    assert_eq!(graph.embeddings.len(), 12);
    // Nodes of one text have one vector, the history's.
    for node in graph.nodes.values() {
        let vector = &graph.embeddings[&(node.id.clone(), "hash-16".to_string())].vector;
        let same_text = graph
            .nodes
            .values()
            .filter(|n| n.text == node.text)
            .map(|n| &graph.embeddings[&(n.id.clone(), "hash-16".to_string())].vector);
        assert!(same_text.into_iter().all(|v| v == vector), "{}", node.text);
    }
    let again = embed_store(&mut writer, &embedder, &options, "r3", &mut NoProgress).unwrap();
    assert_eq!(
        (again.embedded, again.cached, again.already, again.commits),
        (0, 0, 12, 0)
    );
}

#[test]
fn an_episode_that_grew_after_it_was_embedded_is_embedded_again() {
    let episode = common::conversation;
    let dir = store_with(&["a fact"]);
    let mut writer = Writer::open(dir.path()).unwrap();
    let short = episode(&["look the order up"]);
    let mut night = Graph::default();
    night.insert_node(short.clone());
    writer
        .commit(
            &night,
            CommitInfo {
                stage: "ingest".into(),
                ..Default::default()
            },
        )
        .unwrap();
    let embedder = Scripted::failing_after(usize::MAX);
    let options = EmbedOptions::default();
    let first = embed_store(&mut writer, &embedder, &options, "r1", &mut NoProgress).unwrap();
    assert_eq!((first.embedded, first.changed), (2, 0));
    // The conversation logged again, longer, on the next night.
    let long = episode(&["look the order up", "refund it"]);
    assert_eq!(long.id, short.id);
    let mut night = Graph::default();
    night.insert_node(long.clone());
    night.edits.push(common::grown(&short, &long));
    writer
        .commit(
            &night,
            CommitInfo {
                stage: "ingest".into(),
                ..Default::default()
            },
        )
        .unwrap();
    let second = embed_store(&mut writer, &embedder, &options, "r2", &mut NoProgress).unwrap();
    assert_eq!(
        (
            second.embedded + second.cached,
            second.changed,
            second.already
        ),
        (1, 1, 1),
        "{second:?}"
    );
    let graph = writer.store().load().unwrap();
    let stored = graph
        .embeddings
        .values()
        .find(|e| e.node_id == long.id)
        .unwrap();
    assert_eq!(
        stored.text_sha256,
        fluxmem_graph::sha256_hex(long.embedding_text().as_bytes()),
        "the vector is of the grown text"
    );
    assert_eq!(graph.embeddings.len(), 2, "replaced, not added");
    // Embedded again, nothing is stale: the next run does nothing.
    let third = embed_store(&mut writer, &embedder, &options, "r3", &mut NoProgress).unwrap();
    assert_eq!((third.embedded, third.cached, third.changed), (0, 0, 0));
}
