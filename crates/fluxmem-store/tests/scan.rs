//! Projected, filtered scans read the same rows as the whole graph, minus what was left out.

use fluxmem_graph::{
    Changed, Edge, EdgeKind, Edit, Embedding, Episode, Graph, Node, NodeBody, NodeId, NodeKind,
    Outcome, Semantic, Step,
};
use fluxmem_store::{CommitInfo, Rows, Scan, Writer};
use std::collections::BTreeSet;

/// Compacts `writer`'s store as far as it goes: every level merged, every dead row dropped.
fn compact_all(writer: &mut Writer) -> fluxmem_store::CompactReport {
    writer
        .compact(
            &fluxmem_store::CompactPolicy {
                max_dead_fraction: 0.0,
                merge_factor: 2,
                min_level_rows: 1,
                ..Default::default()
            },
            "c",
        )
        .unwrap()
}

fn info() -> CommitInfo {
    CommitInfo {
        stage: "test".into(),
        run_id: "r".into(),
        ..Default::default()
    }
}

fn episode(i: usize, version: usize) -> Node {
    let steps = (0..2)
        .map(|s| Step {
            observation: format!("obs {i}.{s}.{version}"),
            action: "a".into(),
            tool_calls: vec![],
            feedback: None,
            timestamp: None,
        })
        .collect();
    Node::new(
        NodeBody::Episodic(Episode {
            steps,
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

fn edge(
    src: &NodeId,
    dst: &NodeId,
    kind: EdgeKind,
    weight: f32,
    stage: &str,
    active: bool,
) -> Edge {
    Edge {
        src: src.clone(),
        dst: dst.clone(),
        kind,
        weight,
        evidence: 1,
        stage: stage.into(),
        run_id: "r".into(),
        created_at: 0,
        active,
        metadata: Default::default(),
    }
}

/// Three commits; the second rewrites episodes 0 and 1 (new steps) and an embedding.
fn store() -> (tempfile::TempDir, Graph) {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let mut all = Graph::default();
    let fact = Node::new(
        NodeBody::Semantic(Semantic {
            source: "doc".into(),
            position: 0,
            time: None,
            group: None,
        }),
        "t",
        "a fact",
        &["f"],
    );
    for commit in 0..3 {
        let mut delta = Graph::default();
        for i in 0..4 {
            if commit == 0 || (commit == 1 && i < 2) {
                let node = episode(i, commit);
                delta.upsert_embedding(Embedding {
                    node_id: node.id.clone(),
                    model_id: "m".into(),
                    text_sha256: format!("h{i}.{commit}"),
                    vector: vec![commit as f32, i as f32],
                });
                delta.upsert_node(node);
            }
        }
        if commit == 2 {
            let edge = edge(
                &fact.id,
                &episode(0, 0).id,
                EdgeKind::Ground,
                0.5,
                "connect",
                true,
            );
            delta.edits.push(Edit::new(
                "refine",
                "r",
                "credit",
                Changed::Edge(None, Some(&edge)),
                "why",
                0,
            ));
            delta.upsert_edge(edge);
            delta.upsert_node(fact.clone());
        }
        writer.commit(&delta, info()).unwrap();
        all.apply(delta);
    }
    (dir, all)
}

fn without_steps(mut graph: Graph, keep: &BTreeSet<NodeId>) -> Graph {
    for node in graph.nodes.values_mut() {
        if let NodeBody::Episodic(e) = &mut node.body {
            if !keep.contains(&node.id) {
                e.steps.clear();
            }
        }
    }
    graph
}

#[test]
fn scans_read_what_they_ask_for_and_nothing_else() {
    let (dir, all) = store();
    let store = fluxmem_store::Store::open(dir.path()).unwrap();
    assert_eq!(store.load().unwrap(), all);
    assert_eq!(store.scan(&Scan::all()).unwrap().0, all);

    let (credit, _) = store.scan(&Scan::nodes_and_edges()).unwrap();
    let expected = Graph {
        embeddings: Default::default(),
        edits: Vec::new(),
        ..without_steps(all.clone(), &BTreeSet::new())
    };
    assert_eq!(
        credit, expected,
        "node rows without steps, edges, no vectors or edits"
    );
    assert!(credit
        .nodes
        .values()
        .filter_map(|n| n.episode())
        .all(|e| e.steps.is_empty()));

    // The steps of two episodes: the rewritten one (its newest steps) and one never rewritten.
    let keep: BTreeSet<NodeId> = [episode(0, 1).id, episode(3, 0).id].into_iter().collect();
    let (some, _) = store
        .scan(&Scan {
            nodes: true,
            steps: Rows::Of(keep.clone()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(some.nodes, without_steps(all.clone(), &keep).nodes);
    assert!(
        some.nodes[&episode(0, 1).id].episode().unwrap().steps[0]
            .observation
            .ends_with(".1"),
        "the newest commit's steps"
    );

    // The rows of those two nodes only, with their steps: what embed reads of the nodes it embeds.
    let (only, _) = store
        .scan(&Scan {
            nodes: true,
            nodes_of: Some(keep.clone()),
            steps: Rows::Of(keep.clone()),
            ..Default::default()
        })
        .unwrap();
    let mut wanted = all.nodes.clone();
    wanted.retain(|id, _| keep.contains(id));
    assert_eq!(
        only.nodes, wanted,
        "the newest rows of the ids asked for, whole, and no other node"
    );
    assert!(only.edges.is_empty() && only.embeddings.is_empty());

    // The nodes of one kind (filtered on the kind column), and of one kind among given ids.
    let (facts, _) = store
        .scan(&Scan {
            nodes: true,
            node_kinds: vec![NodeKind::Semantic],
            ..Default::default()
        })
        .unwrap();
    let mut wanted = all.nodes.clone();
    wanted.retain(|_, n| n.kind() == NodeKind::Semantic);
    assert_eq!(wanted.len(), 1);
    assert_eq!(facts.nodes, wanted, "the semantic node only");
    let (none, _) = store
        .scan(&Scan {
            nodes: true,
            nodes_of: Some(keep.clone()),
            node_kinds: vec![NodeKind::Semantic],
            ..Default::default()
        })
        .unwrap();
    assert!(none.nodes.is_empty(), "the ids asked for are episodes");
    let (episodes, _) = store
        .scan(&Scan {
            nodes: true,
            node_kinds: vec![NodeKind::Episodic, NodeKind::Procedural],
            ..Default::default()
        })
        .unwrap();
    let mut wanted = without_steps(all.clone(), &BTreeSet::new()).nodes;
    wanted.retain(|_, n| n.kind() != NodeKind::Semantic);
    assert_eq!(wanted.len(), 4);
    assert_eq!(episodes.nodes, wanted, "the episodes, without steps");

    // Keys of every embedding (the newest row's hash), vectors of one node only.
    let one: BTreeSet<NodeId> = [episode(1, 0).id].into_iter().collect();
    let (keys, _) = store
        .scan(&Scan {
            embedding_keys: true,
            vectors: Rows::Of(one.clone()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(keys.embeddings.len(), all.embeddings.len());
    for (key, embedding) in &keys.embeddings {
        assert_eq!(
            embedding.text_sha256, all.embeddings[key].text_sha256,
            "{key:?}"
        );
        if one.contains(&key.0) {
            assert_eq!(
                embedding.vector, all.embeddings[key].vector,
                "the asked-for vector, of the newest row"
            );
        } else {
            assert!(embedding.vector.is_empty(), "{key:?}: vector left unread");
        }
    }
    assert!(keys.nodes.is_empty() && keys.edges.is_empty() && keys.edits.is_empty());
    let (vectors, _) = store
        .scan(&Scan {
            vectors: Rows::Of(one.clone()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(vectors.embeddings.len(), 1);
}

/// `stats` (from key, kind and head columns) counts what the whole graph counts, and the edge
/// heads say which edges are active and which are Stage II links.
#[test]
fn stats_and_edge_heads_match_the_whole_graph() {
    let (dir, all) = store();
    let mut writer = Writer::open(dir.path()).unwrap();
    let mut delta = Graph::default();
    let (a, b) = (episode(1, 1).id, episode(2, 0).id);
    let mut link = edge(&a, &b, EdgeKind::Link, 1.0, "refine", false);
    link.metadata.insert("relation".into(), "expand".into());
    delta.upsert_edge(link);
    writer.commit(&delta, info()).unwrap();
    let mut whole = all.clone();
    whole.apply(delta);
    let store = fluxmem_store::Store::open(dir.path()).unwrap();
    let (stats, manifest) = store.stats().unwrap();
    assert_eq!(stats, whole.stats());
    let heads = store.edge_heads(&manifest).unwrap();
    assert_eq!(heads.len(), whole.edges.len());
    let head = heads[&(a, b, EdgeKind::Link)];
    assert!(!head.active && head.relation, "{head:?}");
    assert!(heads.values().filter(|h| !h.relation).all(|h| h.active));
}

/// Kind filters on edges and edits keep exactly the rows of those kinds (the newest row of an
/// edge key, edits in log order) and nothing of the other kinds.
#[test]
fn edge_and_edit_kind_filters_keep_those_kinds_only() {
    let (dir, all) = store();
    let mut writer = Writer::open(dir.path()).unwrap();
    let mut delta = Graph::default();
    let (a, b) = (episode(1, 1).id, episode(2, 0).id);
    for (kind, weight) in [(EdgeKind::Distill, 0.25), (EdgeKind::Link, 1.0)] {
        let edge = edge(&a, &b, kind, weight, "consolidate", true);
        delta.edits.push(Edit::new(
            "consolidate",
            "r",
            if kind == EdgeKind::Distill {
                "distill"
            } else {
                "skill_failed"
            },
            Changed::Edge(None, Some(&edge)),
            "why",
            0,
        ));
        delta.upsert_edge(edge);
    }
    writer.commit(&delta, info()).unwrap();
    // A later commit rewrites the distill edge: the filtered scan sees the newest row.
    let mut later = Graph::default();
    let mut edge = delta
        .edges
        .values()
        .find(|e| e.kind == EdgeKind::Distill)
        .unwrap()
        .clone();
    edge.active = false;
    later.edits.push(Edit::new(
        "consolidate",
        "r",
        "skill_failed",
        Changed::Edge(None, Some(&edge)),
        "second",
        1,
    ));
    later.upsert_edge(edge.clone());
    writer.commit(&later, info()).unwrap();
    let mut whole = all.clone();
    whole.apply(delta);
    whole.apply(later);

    let store = fluxmem_store::Store::open(dir.path()).unwrap();
    let scan = Scan {
        edges: true,
        edge_kinds: vec![EdgeKind::Distill],
        edits: true,
        edit_kinds: vec!["skill_failed".into()],
        ..Default::default()
    };
    let (read, _) = store.scan(&scan).unwrap();
    let distill: Vec<&Edge> = whole
        .edges
        .values()
        .filter(|e| e.kind == EdgeKind::Distill)
        .collect();
    assert_eq!(read.edges.values().collect::<Vec<_>>(), distill);
    assert!(
        !read.edges.values().next().unwrap().active,
        "the newest row of the edge"
    );
    let failed: Vec<&Edit> = whole
        .edits
        .iter()
        .filter(|e| e.kind == "skill_failed")
        .collect();
    assert_eq!(failed.len(), 2);
    assert_eq!(
        read.edits.iter().collect::<Vec<_>>(),
        failed,
        "in log order"
    );
    assert!(read.nodes.is_empty() && read.embeddings.is_empty());
    // Without filters, every kind.
    let (every, _) = store
        .scan(&Scan {
            edges: true,
            edits: true,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(every.edges, whole.edges);
    assert_eq!(every.edits, whole.edits);
}

/// Edges rewritten over several commits: the streamed live rows are the loaded graph's, each
/// once, before and after compaction, with the kind filter applied.
#[test]
fn live_streams_each_live_row_once_and_skips_superseded_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let fact = Node::new(
        NodeBody::Semantic(Semantic {
            source: "doc".into(),
            position: 0,
            time: None,
            group: None,
        }),
        "t",
        "a fact",
        &["f"],
    );
    let episodes: Vec<Node> = (0..6).map(|i| episode(i, 0)).collect();
    for commit in 0..4usize {
        let mut delta = Graph::default();
        if commit == 0 {
            delta.upsert_node(fact.clone());
        }
        for (i, e) in episodes.iter().enumerate() {
            // Commit 0 writes every edge; later commits rewrite some (their old rows die).
            if commit == 0 || i % (commit + 1) == 0 {
                delta.upsert_edge(edge(
                    &fact.id,
                    &e.id,
                    EdgeKind::Ground,
                    commit as f32,
                    "connect",
                    true,
                ));
                if i > 0 {
                    delta.upsert_edge(edge(
                        &e.id,
                        &episodes[i - 1].id,
                        EdgeKind::Link,
                        10.0 + commit as f32,
                        "connect",
                        commit % 2 == 0,
                    ));
                }
            }
            if commit == 0 || (commit == 2 && i < 3) {
                delta.upsert_node(episode(i, commit));
            }
        }
        writer.commit(&delta, info()).unwrap();
    }
    let check = |writer: &Writer| {
        let loaded = writer.store().load().unwrap();
        let live_edges = writer.store().live(writer.manifest(), "edges").unwrap();
        assert_eq!(live_edges.len(), loaded.edges.len() as u64);
        let mut streamed = Vec::new();
        live_edges.edges(&[], &mut |e| streamed.push(e)).unwrap();
        assert_eq!(streamed.len(), loaded.edges.len(), "each live edge once");
        for e in &streamed {
            assert_eq!(
                &loaded.edges[&e.key()],
                e,
                "the winning row of {:?}",
                e.key()
            );
        }
        let mut grounds = Vec::new();
        live_edges
            .edges(&[EdgeKind::Ground], &mut |e| grounds.push(e))
            .unwrap();
        assert_eq!(grounds.len(), 6);
        assert!(grounds.iter().all(|e| e.kind == EdgeKind::Ground));
        let mut nodes = Vec::new();
        writer
            .store()
            .live(writer.manifest(), "nodes")
            .unwrap()
            .nodes(&mut |n| nodes.push(n))
            .unwrap();
        assert_eq!(nodes.len(), loaded.nodes.len());
        for n in &nodes {
            let whole = &loaded.nodes[&n.id];
            assert_eq!(
                (&n.text, n.kind(), &n.metadata),
                (&whole.text, whole.kind(), &whole.metadata)
            );
            assert!(
                n.episode().is_none_or(|e| e.steps.is_empty()),
                "steps are not read"
            );
        }
        streamed
    };
    let before = check(&writer);
    assert!(
        before.iter().any(|e| e.weight == 3.0) && before.iter().any(|e| e.weight == 0.0),
        "rows of the first and the last commit are live"
    );
    let report = compact_all(&mut writer);
    assert!(report.committed);
    let mut after = check(&writer);
    let mut before = before;
    before.sort_by_key(|e| e.key());
    after.sort_by_key(|e| e.key());
    assert_eq!(before, after, "compaction keeps the live rows");
}

/// A filtered read over a shard of many batches and pages (the key column is read first, the
/// other columns only at the selected rows) gives the rows a whole read gives, and a filter
/// that selects nothing reads nothing.
#[test]
fn filtered_reads_over_many_batches_and_pages_give_the_whole_reads_rows() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let mut delta = Graph::default();
    for i in 0..30_000 {
        let id = NodeId(format!("ep-{i:06}"));
        delta.upsert_embedding(Embedding {
            node_id: id,
            model_id: "m".into(),
            text_sha256: format!("h{i}"),
            vector: vec![i as f32, (i % 7) as f32, 1.0, -(i as f32)],
        });
    }
    writer.commit(&delta, info()).unwrap();
    let store = fluxmem_store::Store::open(dir.path()).unwrap();
    // Ids spread over every batch, the first and the last row among them.
    let some: BTreeSet<NodeId> = (0..30_000)
        .filter(|i| i % 997 == 0 || *i == 29_999 || (8190..8195).contains(i))
        .map(|i| NodeId(format!("ep-{i:06}")))
        .collect();
    let (read, _) = store
        .scan(&Scan {
            vectors: Rows::Of(some.clone()),
            ..Default::default()
        })
        .unwrap();
    let mut wanted = delta.embeddings.clone();
    wanted.retain(|(id, _), _| some.contains(id));
    assert_eq!(read.embeddings.len(), some.len());
    assert_eq!(read.embeddings, wanted);
    let none: BTreeSet<NodeId> = [NodeId("ep-absent".into())].into_iter().collect();
    let (read, _) = store
        .scan(&Scan {
            vectors: Rows::Of(none),
            ..Default::default()
        })
        .unwrap();
    assert!(read.embeddings.is_empty());
}

#[test]
fn a_tenants_scan_reads_its_nodes_steps_edges_and_vectors_and_nothing_of_another() {
    let (dir, _) = store();
    // A second tenant, with an episode, a vector and an edge of its own.
    let mut other = Graph::default();
    let theirs = Node::new(
        NodeBody::Episodic(Episode::default()),
        "u",
        "their task",
        &["theirs"],
    );
    other.upsert_embedding(Embedding {
        node_id: theirs.id.clone(),
        model_id: "m".into(),
        text_sha256: "hu".into(),
        vector: vec![9.0, 9.0],
    });
    other.upsert_edge(edge(
        &theirs.id,
        &theirs.id,
        EdgeKind::Link,
        1.0,
        "refine",
        true,
    ));
    other.upsert_node(theirs.clone());
    Writer::open(dir.path())
        .unwrap()
        .commit(&other, info())
        .unwrap();
    let store = fluxmem_store::Store::open(dir.path()).unwrap();
    let whole = store.load().unwrap();
    let manifest = store.manifest().unwrap();
    let owners = store.node_tenants(&manifest).unwrap();
    assert_eq!(owners.len(), whole.nodes.len());
    assert!(owners.iter().all(|(id, t)| &whole.nodes[id].tenant == t));
    for tenant in ["t", "u"] {
        let ids: BTreeSet<NodeId> = owners
            .iter()
            .filter(|(_, t)| *t == tenant)
            .map(|(id, _)| id.clone())
            .collect();
        let read = store
            .scan_at(&manifest, &Scan::of_tenant(tenant, &ids))
            .unwrap();
        let mut expected = whole.clone();
        expected.nodes.retain(|id, _| ids.contains(id));
        expected.edges.retain(|_, e| ids.contains(&e.src));
        expected.embeddings.retain(|(id, _), _| ids.contains(id));
        expected.edits.clear();
        assert_eq!(read.nodes, expected.nodes, "{tenant}");
        assert_eq!(read.edges, expected.edges, "{tenant}");
        assert_eq!(read.embeddings, expected.embeddings, "{tenant}");
        assert!(read.nodes.values().all(|n| n.tenant == tenant));
        // One pass over id, tenant and kind gives the same ids, by kind too.
        assert_eq!(store.tenant_node_ids(&manifest, tenant, &[]).unwrap(), ids);
        for kind in [NodeKind::Episodic, NodeKind::Semantic] {
            let of_kind: BTreeSet<NodeId> = ids
                .iter()
                .filter(|id| whole.nodes[*id].kind() == kind)
                .cloned()
                .collect();
            assert_eq!(
                store.tenant_node_ids(&manifest, tenant, &[kind]).unwrap(),
                of_kind,
                "{tenant} {kind:?}"
            );
        }
    }
    assert!(store
        .tenant_node_ids(&manifest, "nobody", &[])
        .unwrap()
        .is_empty());
}

/// One tenant's graph in two commits, as ingest and then embed or connect write it: the nodes
/// (with their steps), then edges and vectors that name the nodes without holding them.
fn tenant_nights(writer: &mut Writer, tenant: &str, tell: bool) -> Vec<NodeId> {
    let task = |i: usize| {
        Node::new(
            NodeBody::Episodic(Episode {
                steps: vec![Step {
                    observation: format!("{tenant} obs {i}"),
                    action: "a".into(),
                    tool_calls: vec![],
                    feedback: None,
                    timestamp: None,
                }],
                outcome: Outcome::default(),
            }),
            tenant,
            &format!("{tenant} task {i}"),
            &[&i.to_string()],
        )
    };
    let mut nodes = Graph::default();
    (0..3).for_each(|i| nodes.upsert_node(task(i)));
    writer.commit(&nodes, info()).unwrap();
    let ids: Vec<NodeId> = nodes.nodes.keys().cloned().collect();
    if tell {
        writer.know_tenants(nodes.nodes.values().map(|n| (&n.id, n.tenant.as_str())));
    } else {
        writer.know_tenants([]);
    }
    let mut later = Graph::default();
    for (i, id) in ids.iter().enumerate() {
        later.upsert_embedding(Embedding {
            node_id: id.clone(),
            model_id: "m".into(),
            text_sha256: format!("{tenant}{i}"),
            vector: vec![i as f32, 1.0],
        });
        later.upsert_edge(edge(id, &ids[0], EdgeKind::Link, 0.5, "connect", true));
    }
    writer.commit(&later, info()).unwrap();
    ids
}

/// Each shard's entry names the tenants of its rows where the writer could place them all,
/// and a reader of one tenant never opens a shard that names only others: with every such
/// shard of another tenant damaged, it reads exactly what it read before (and a reader of
/// that tenant fails, so the damage would have been seen). A shard whose rows the writer
/// could not place names no tenant and is read by everyone. Compaction's merged shards name
/// the union of their members'.
#[test]
fn a_tenants_reader_skips_the_shards_that_name_only_other_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let ours = tenant_nights(&mut writer, "t", true);
    tenant_nights(&mut writer, "u", true);
    // Edges and vectors committed without their tenants told: their shards name none.
    tenant_nights(&mut writer, "v", false);
    let named = |writer: &Writer, table: &str| -> Vec<Option<Vec<String>>> {
        writer
            .manifest()
            .shards
            .iter()
            .filter(|s| s.table == table)
            .map(|s| s.tenants.clone())
            .collect()
    };
    let list = |names: &[&str]| Some(names.iter().map(|n| n.to_string()).collect::<Vec<_>>());
    for table in ["nodes", "steps"] {
        assert_eq!(
            named(&writer, table),
            [list(&["t"]), list(&["u"]), list(&["v"])],
            "{table}"
        );
    }
    for table in ["edges", "embeddings"] {
        assert_eq!(
            named(&writer, table),
            [list(&["t"]), list(&["u"]), None],
            "{table}"
        );
    }
    let store = fluxmem_store::Store::open(dir.path()).unwrap();
    let manifest = store.manifest().unwrap();
    let read = |tenant: &str| {
        let ids = store.tenant_node_ids(&manifest, tenant, &[])?;
        store.scan_at(&manifest, &Scan::of_tenant(tenant, &ids))
    };
    let before = read("t").unwrap();
    assert_eq!(
        before.nodes.keys().cloned().collect::<Vec<_>>(),
        ours,
        "the tenant's nodes"
    );
    assert_eq!((before.edges.len(), before.embeddings.len()), (3, 3));
    assert!(read("u").is_ok() && read("v").is_ok());
    // Damage every shard that names only `u`, and one that names no tenant.
    let damaged: Vec<&fluxmem_store::ShardEntry> = manifest
        .shards
        .iter()
        .filter(|s| s.tenants == list(&["u"]))
        .collect();
    assert_eq!(damaged.len(), 4);
    for entry in &damaged {
        std::fs::write(dir.path().join(&entry.file), b"not a shard").unwrap();
    }
    assert_eq!(read("t").unwrap(), before, "nothing of u was opened");
    assert!(read("u").is_err(), "u's damaged shards are read by u");
    let unnamed = manifest
        .shards
        .iter()
        .find(|s| s.table == "edges" && s.tenants.is_none())
        .unwrap();
    let bytes = std::fs::read(dir.path().join(&unnamed.file)).unwrap();
    std::fs::write(dir.path().join(&unnamed.file), b"not a shard").unwrap();
    assert!(read("t").is_err(), "a shard that names no tenant is read");
    std::fs::write(dir.path().join(&unnamed.file), bytes).unwrap();

    // A fresh store, compacted: merged shards name the union of their members' tenants.
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    tenant_nights(&mut writer, "t", true);
    tenant_nights(&mut writer, "u", true);
    let report = compact_all(&mut writer);
    assert!(report.committed);
    for table in ["nodes", "edges", "embeddings"] {
        let after = named(&writer, table);
        assert_eq!(after, [list(&["t", "u"])], "{table}");
    }
}
