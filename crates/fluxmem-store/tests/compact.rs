//! Compaction: amplification stays bounded over many nights, live rows never change, readers of
//! an earlier manifest keep working, the edit log keeps its order, the manifest stays small.

use fluxmem_graph::{
    Changed, Edge, EdgeKind, Edit, Embedding, Episode, Graph, Node, NodeBody, NodeId, Outcome, Step,
};
use fluxmem_store::{
    CommitInfo, CompactPolicy, Error, Shard, Store, Writer, KEEP_RETIRED_COMMITS,
    MANIFEST_COMMIT_LOG,
};
use std::collections::BTreeMap;

fn info(stage: &str) -> CommitInfo {
    CommitInfo {
        stage: stage.into(),
        run_id: "test-run".into(),
        ..Default::default()
    }
}

fn episode(i: usize, night: usize) -> Node {
    let steps = (0..3)
        .map(|s| Step {
            observation: format!("obs {i}.{s}"),
            action: format!("act {s}"),
            tool_calls: vec![],
            feedback: None,
            timestamp: None,
        })
        .collect();
    let mut node = Node::new(
        NodeBody::Episodic(Episode {
            steps,
            outcome: Outcome {
                success: Some(!i.is_multiple_of(3)),
                reward: None,
                feedback: None,
            },
        }),
        if i.is_multiple_of(2) {
            "acme"
        } else {
            "globex"
        },
        &format!("task {i}"),
        &["episode", &i.to_string()],
    );
    // A node rewritten on a later night (a re-ingested record's metadata) supersedes its row.
    node.metadata.insert("night".into(), night.into());
    node
}

fn edge(src: &NodeId, i: usize, weight: f32) -> Edge {
    Edge {
        src: src.clone(),
        dst: NodeId(format!("sem-{i:06}")),
        kind: EdgeKind::Ground,
        weight,
        evidence: 1,
        stage: "connect".into(),
        run_id: "r".into(),
        created_at: 0,
        active: true,
        metadata: BTreeMap::new(),
    }
}

/// Small levels so that a test of a few thousand rows goes through several merges, and small
/// batches so that every merge streams its members over many batches (an episode's steps split
/// across them).
fn policy() -> CompactPolicy {
    CompactPolicy {
        min_level_rows: 20,
        merge_factor: 4,
        batch_rows: 7,
        ..Default::default()
    }
}

/// Rows stored per live row of `table`, computed from the manifest and the loaded graph.
fn amplification(writer: &Writer, table: &str, live: usize) -> f64 {
    let stored: u64 = writer
        .manifest()
        .shards
        .iter()
        .filter(|s| s.table == table)
        .map(|s| s.rows)
        .sum();
    stored as f64 / live.max(1) as f64
}

#[test]
fn ten_nights_of_rewrites_stay_within_the_amplification_bound_with_the_same_live_rows() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    // Retired files go as soon as their commits are up (no grace in time), so the files on
    // disk below are the policy's by commit count alone.
    writer.keep_retired_for(std::time::Duration::ZERO);
    let mut expected = Graph::default();
    let mut next_episode = 0;
    for night in 0..10 {
        let mut delta = Graph::default();
        // New episodes, each with edges and an embedding.
        for _ in 0..(if night == 0 { 200 } else { 40 }) {
            let node = episode(next_episode, night);
            for k in 0..3 {
                delta.upsert_edge(edge(&node.id, next_episode * 3 + k, 1.0));
            }
            delta.upsert_embedding(Embedding {
                node_id: node.id.clone(),
                model_id: "m".into(),
                text_sha256: "h".into(),
                vector: vec![night as f32; 4],
            });
            delta.upsert_node(node);
            next_episode += 1;
        }
        // A third of the old edges reweighted and a tenth of the old episodes rewritten.
        let old: Vec<Edge> = expected.edges.values().cloned().collect();
        for (i, e) in old.iter().enumerate().filter(|(i, _)| (i + night) % 3 == 0) {
            delta.upsert_edge(Edge {
                weight: night as f32 + i as f32 / 1000.0,
                ..e.clone()
            });
        }
        let old_nodes: Vec<Node> = expected.nodes.values().cloned().collect();
        for node in old_nodes.iter().step_by(10) {
            let mut again = node.clone();
            again.metadata.insert("night".into(), night.into());
            delta.upsert_node(again);
        }
        let edit_target = expected
            .edges
            .values()
            .next()
            .cloned()
            .unwrap_or_else(|| edge(&NodeId("epi-x".into()), 0, 1.0));
        delta.edits.push(Edit::new(
            "refine",
            "r",
            "credit",
            Changed::Edge(None, Some(&edit_target)),
            &format!("night {night}"),
            night as i64,
        ));
        writer.commit(&delta, info("night")).unwrap();
        expected.apply(delta);
        let before = writer.store().load().unwrap();
        assert_eq!(
            before, expected,
            "night {night}: the store holds the live rows"
        );
        // The key indexes compaction reads are derived data: gone, damaged, or another shard's,
        // they are made again from the shards, with the same outcome.
        let keys = dir.path().join("keys");
        match night {
            3 => std::fs::remove_dir_all(&keys).unwrap(),
            5 => {
                for file in std::fs::read_dir(&keys).unwrap() {
                    let path = file.unwrap().path();
                    let mut bytes = std::fs::read(&path).unwrap();
                    let last = bytes.len() - 1;
                    bytes[last] ^= 0x40;
                    std::fs::write(&path, bytes).unwrap();
                }
            }
            7 => {
                let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&keys)
                    .unwrap()
                    .map(|f| f.unwrap().path())
                    .filter(|p| p.to_string_lossy().contains("edges-"))
                    .collect();
                files.sort();
                std::fs::copy(&files[0], &files[files.len() - 1]).unwrap();
            }
            _ => {}
        }
        let report = writer
            .compact(&policy(), &format!("compact-{night}"))
            .unwrap();
        let after = writer.store().load().unwrap();
        assert_eq!(
            after, expected,
            "night {night}: compaction changed no live row (edits included, in order)"
        );
        assert_eq!(
            writer.manifest().current_counts(),
            Some(expected.stats()),
            "night {night}: the live counts"
        );
        for (table, live) in [
            ("nodes", expected.nodes.len()),
            ("edges", expected.edges.len()),
            ("embeddings", expected.embeddings.len()),
        ] {
            let amp = amplification(&writer, table, live);
            assert!(
                amp <= 1.5,
                "night {night}: {table} amplification {amp:.3} > 1.5 ({report:?})"
            );
            assert_eq!(
                report.tables[table].live_rows as usize, live,
                "night {night}: {table} live rows"
            );
            assert!(
                report.tables[table].in_memory.is_empty(),
                "night {night}: {table} merges stream (every shard is in key order)"
            );
        }
        // Steps follow their nodes: as many step rows as the live episodes have steps, give or
        // take those of dead node rows in shards not yet rewritten.
        let steps: u64 = writer
            .manifest()
            .shards
            .iter()
            .filter(|s| s.table == "steps")
            .map(|s| s.rows)
            .sum();
        assert!(
            steps as f64 <= 1.5 * 3.0 * expected.nodes.len() as f64,
            "night {night}: {steps} step rows"
        );
    }
    let edges = writer
        .manifest()
        .shards
        .iter()
        .filter(|s| s.table == "edges")
        .count();
    assert!(
        edges <= 12,
        "log merge keeps the shard count small: {edges} edge shards after 10 nights"
    );
    // Every file on disk is listed or retired (waiting for readers), nothing else.
    let manifest = writer.manifest().clone();
    let files = std::fs::read_dir(dir.path().join("shards"))
        .unwrap()
        .count();
    assert_eq!(files, manifest.shards.len() + manifest.retired.len());
    assert!(writer.unlisted_shards().unwrap().is_empty());
    // A key index for each keyed shard on disk, and none for a shard that is gone.
    let mut indexes: Vec<String> = std::fs::read_dir(dir.path().join("keys"))
        .unwrap()
        .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    indexes.sort();
    let mut keyed: Vec<String> = manifest
        .shards
        .iter()
        .map(|s| s.file.clone())
        .chain(manifest.retired.iter().map(|r| r.file.clone()))
        .filter(|f| {
            ["nodes-", "edges-", "embeddings-"]
                .iter()
                .any(|t| f.starts_with(&format!("shards/{t}")))
        })
        .map(|f| format!("{}.keys", f.trim_start_matches("shards/")))
        .collect();
    keyed.sort();
    assert_eq!(indexes, keyed);
}

/// Five nights into a store at `dir`, compacted after each with `batch_rows`; the shards' hashes.
fn nights_compacted(dir: &std::path::Path, batch_rows: usize) -> Vec<(String, String)> {
    nights_compacted_with(dir, batch_rows, false)
}

/// [`nights_compacted`], with the key indexes deleted before each compaction when `no_indexes`.
fn nights_compacted_with(
    dir: &std::path::Path,
    batch_rows: usize,
    no_indexes: bool,
) -> Vec<(String, String)> {
    let mut writer = Writer::open(dir).unwrap();
    for night in 0..5 {
        let mut delta = Graph::default();
        for i in night * 50..night * 50 + 60 {
            // Ten of each night's episodes are the previous night's, rewritten.
            let node = episode(i, night);
            delta.upsert_edge(edge(&node.id, i, night as f32));
            delta.upsert_embedding(Embedding {
                node_id: node.id.clone(),
                model_id: "m".into(),
                text_sha256: "h".into(),
                vector: vec![night as f32; 4],
            });
            delta.upsert_node(node);
        }
        writer.commit(&delta, info("night")).unwrap();
        if no_indexes {
            std::fs::remove_dir_all(dir.join("keys")).unwrap();
        }
        writer
            .compact(
                &CompactPolicy {
                    batch_rows,
                    ..policy()
                },
                "c",
            )
            .unwrap();
    }
    let mut shards: Vec<(String, String)> = writer
        .manifest()
        .shards
        .iter()
        .map(|s| (s.table.clone(), s.sha256.clone()))
        .collect();
    shards.sort();
    shards
}

#[test]
fn a_merge_writes_the_same_shards_whatever_its_batch_size() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let small = nights_compacted(a.path(), 3);
    let large = nights_compacted(b.path(), 100_000);
    assert!(
        small.iter().any(|(table, _)| table == "steps"),
        "the nights merged nodes with steps: {small:?}"
    );
    assert_eq!(
        small, large,
        "merging 3 rows at a time or all at once writes the same bytes"
    );
    let c = tempfile::tempdir().unwrap();
    assert_eq!(
        nights_compacted_with(c.path(), 3, true),
        small,
        "the same bytes with the key indexes made from the shards each night"
    );
    let loaded = (
        Store::open(a.path()).unwrap().load().unwrap(),
        Store::open(b.path()).unwrap().load().unwrap(),
    );
    assert_eq!(loaded.0, loaded.1);
}

#[test]
fn a_reader_of_the_previous_manifest_still_reads_and_a_late_reader_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    // No grace in time: the files go as soon as their commits are up.
    writer.keep_retired_for(std::time::Duration::ZERO);
    let mut expected = Graph::default();
    for i in 0..6 {
        let mut delta = Graph::default();
        let node = episode(0, 0);
        delta.upsert_edge(edge(&node.id, 0, i as f32));
        delta.upsert_node(node);
        writer.commit(&delta, info("night")).unwrap();
        expected.apply(delta);
    }
    let old = Store::open(dir.path()).unwrap().manifest().unwrap();
    let report = writer
        .compact(
            &CompactPolicy {
                merge_factor: 8,
                ..Default::default()
            },
            "c",
        )
        .unwrap();
    assert!(report.committed && report.retired > 0, "{report:?}");
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(
        store.load_at(&old).unwrap(),
        expected,
        "the retired files are still there for a reader of the old manifest"
    );
    for n in 0..KEEP_RETIRED_COMMITS {
        writer
            .commit(&Graph::default(), info(&format!("later-{n}")))
            .unwrap();
    }
    assert!(
        writer.manifest().retired.is_empty(),
        "deleted {KEEP_RETIRED_COMMITS} commits later"
    );
    assert!(
        store.load_at(&old).is_err(),
        "an old manifest's files are gone by then"
    );
    assert_eq!(
        store.load().unwrap(),
        expected,
        "load() reads the current manifest"
    );
}

#[test]
fn compaction_is_refused_while_a_sharded_run_is_staged_and_keeps_retired_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    for i in 0..3 {
        let mut delta = Graph::default();
        let node = episode(0, i);
        delta.upsert_node(node);
        writer.commit(&delta, info("night")).unwrap();
    }
    writer.compact(&CompactPolicy::default(), "c").unwrap();
    let retired = writer.manifest().retired.len();
    assert!(retired > 0);
    let staging = Writer::open_staging(dir.path(), "embed", Shard { index: 0, count: 2 }).unwrap();
    drop(staging);
    let error = writer.compact(&CompactPolicy::default(), "c2").unwrap_err();
    assert!(matches!(error, Error::Staging { .. }), "{error}");
    assert!(error.to_string().contains("sharded run"), "{error}");
    for n in 0..3 {
        writer
            .commit(&Graph::default(), info(&format!("later-{n}")))
            .unwrap();
    }
    assert_eq!(
        writer.manifest().retired.len(),
        retired,
        "a staging store reads the main shards by path: nothing deleted"
    );
    for entry in &writer.manifest().retired {
        assert!(
            dir.path().join(&entry.file).is_file(),
            "{} kept",
            entry.file
        );
    }
}

#[test]
fn the_manifest_keeps_a_bounded_commit_log_and_the_rest_goes_to_history() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let commits = MANIFEST_COMMIT_LOG + 36;
    for n in 0..commits {
        writer
            .commit(&Graph::default(), info(&format!("c{n}")))
            .unwrap();
    }
    let manifest = writer.manifest();
    assert_eq!(manifest.commits.len(), MANIFEST_COMMIT_LOG);
    assert_eq!(manifest.commits.last().unwrap().version, commits as u64);
    let history = std::fs::read_to_string(dir.path().join(fluxmem_store::HISTORY)).unwrap();
    let versions: Vec<u64> = history
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["version"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(
        versions,
        (1..=36).collect::<Vec<u64>>(),
        "the older records, in order, none lost"
    );
}

#[test]
fn nothing_to_compact_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let mut delta = Graph::default();
    delta.upsert_node(episode(1, 0));
    writer.commit(&delta, info("ingest")).unwrap();
    let shards = writer.manifest().shards.clone();
    // The plain commit left the live counts behind: the first compaction writes them (a
    // manifest-only commit, no shard), the second finds nothing at all to do.
    let report = writer.compact(&CompactPolicy::default(), "c").unwrap();
    assert!(!report.committed && report.counted);
    assert_eq!(
        writer.manifest().shards,
        shards,
        "no shard written or retired"
    );
    assert_eq!(
        writer.manifest().current_counts().map(|c| c.episodic),
        Some(1)
    );
    let version = writer.manifest().version;
    let report = writer.compact(&CompactPolicy::default(), "c").unwrap();
    assert!(!report.committed && !report.counted);
    assert_eq!(writer.manifest().version, version);
    assert_eq!(report.tables["nodes"].live_rows, 1);
}

/// Issue 40.4: readers while a writer commits and compacts in a loop never see a false
/// "shard listed in the manifest is missing": retired files stay for their grace time, and a
/// read that meets a deleted file starts again from the newest manifest. Two readers load and
/// count for as long as the writer works (a bounded number of rounds), with zero errors.
#[test]
fn readers_under_a_compacting_writer_never_see_a_false_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    for i in 0..4 {
        let mut delta = Graph::default();
        let node = episode(i, 0);
        delta.upsert_edge(edge(&node.id, 0, i as f32));
        delta.upsert_node(node);
        writer.commit(&delta, info("seed")).unwrap();
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|reader| {
            let path = dir.path().to_path_buf();
            let done = done.clone();
            std::thread::spawn(move || {
                let store = Store::open(&path).unwrap();
                let mut reads = 0u32;
                let mut errors = Vec::new();
                while !done.load(std::sync::atomic::Ordering::Relaxed) || reads == 0 {
                    let result = if reader == 0 {
                        store.load().map(|g| g.nodes.len())
                    } else {
                        store.stats().map(|(s, _)| s.episodic)
                    };
                    if let Err(error) = result {
                        errors.push(error.to_string());
                    }
                    reads += 1;
                }
                (reads, errors)
            })
        })
        .collect();
    for round in 0..60u32 {
        let mut delta = Graph::default();
        let node = episode(100 + round as usize, 0);
        delta.upsert_edge(edge(&node.id, 0, round as f32));
        delta.upsert_node(node);
        writer.commit(&delta, info("night")).unwrap();
        writer
            .compact(
                &CompactPolicy {
                    merge_factor: 2,
                    min_level_rows: 1,
                    ..Default::default()
                },
                &format!("c{round}"),
            )
            .unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for reader in readers {
        let (reads, errors) = reader.join().unwrap();
        assert!(reads > 0);
        assert!(
            errors.is_empty(),
            "{} of {reads} reads failed: {:?}",
            errors.len(),
            &errors[..errors.len().min(3)]
        );
    }
}

/// A store of `nights` commits, each an episode, an edge and an edit row.
fn nights_with_edits(dir: &std::path::Path, nights: usize) -> Writer {
    let mut writer = Writer::open(dir).unwrap();
    for i in 0..nights {
        let mut delta = Graph::default();
        let node = episode(i, 0);
        let e = edge(&node.id, i, 1.0);
        delta.edits.push(Edit::new(
            "refine",
            "test-run",
            "link_expand",
            Changed::Edge(None, Some(&e)),
            &format!("night {i}"),
            i as i64,
        ));
        delta.upsert_edge(e);
        delta.upsert_node(node);
        writer.commit(&delta, info("night")).unwrap();
    }
    writer
}

/// Issue 40.3: with the manifest lost while a compaction's inputs still wait for deletion,
/// recovery used to adopt both the inputs and the output, doubling the edit log. The output
/// names its inputs, so recovery leaves them out and says so.
#[test]
fn recovery_after_a_compaction_keeps_the_edit_log_count() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = nights_with_edits(dir.path(), 8);
    let report = writer
        .compact(
            &CompactPolicy {
                merge_factor: 4,
                ..Default::default()
            },
            "c",
        )
        .unwrap();
    assert!(report.committed && report.retired > 0, "{report:?}");
    let expected = writer.store().load().unwrap();
    assert_eq!(expected.edits.len(), 8);
    drop(writer);
    std::fs::remove_file(dir.path().join("manifest.json")).unwrap();
    let recovered = fluxmem_store::recover(dir.path()).unwrap();
    assert!(!recovered.superseded.is_empty(), "{recovered:?}");
    let loaded = Store::open(dir.path()).unwrap().load().unwrap();
    assert_eq!(loaded.edits.len(), 8, "each edit once");
    assert_eq!(loaded.nodes, expected.nodes);
    assert_eq!(loaded.edges, expected.edges);
}

/// Issue 40.8: a deleted shard file is a state recovery handles: `stats` fails naming it,
/// `store recover` names what is lost and writes nothing, and with `accept_loss` commits a
/// manifest without it; the store then reads (without the lost rows).
#[test]
fn a_missing_shard_is_reported_and_dropped_only_when_the_loss_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let writer = nights_with_edits(dir.path(), 3);
    let manifest = writer.manifest().clone();
    drop(writer);
    let victim = manifest
        .shards
        .iter()
        .find(|s| s.table == "edges" && s.commit == 2)
        .unwrap()
        .clone();
    std::fs::remove_file(dir.path().join(&victim.file)).unwrap();
    let store = Store::open(dir.path()).unwrap();
    let error = store.stats().unwrap_err();
    assert!(error.to_string().contains("missing"), "{error}");
    let refused = fluxmem_store::recover(dir.path()).unwrap_err();
    assert!(refused.to_string().contains(&victim.file), "{refused}");
    assert!(refused.to_string().contains("--accept-loss"), "{refused}");
    assert_eq!(
        store.manifest().unwrap(),
        manifest,
        "nothing written without --accept-loss"
    );
    let report = fluxmem_store::recover_with(
        dir.path(),
        fluxmem_store::RecoverOptions { accept_loss: true },
    )
    .unwrap();
    assert_eq!(report.lost.len(), 1);
    assert_eq!(
        (report.lost[0].file.as_str(), report.lost[0].rows),
        (victim.file.as_str(), victim.rows)
    );
    let after = store.manifest().unwrap();
    assert_eq!(after.version, manifest.version + 1);
    assert_eq!(after.commits.last().unwrap().stage, "recover");
    let loaded = store.load().unwrap();
    assert_eq!(
        loaded.edges.len(),
        2,
        "the lost edge is gone, the others stay"
    );
    assert!(store.stats().is_ok());
}
