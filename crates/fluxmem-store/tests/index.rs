//! Tenant vector indexes hold what the shards hold, are used only while current, and are kept
//! up to date from what the commits after them added.

use fluxmem_graph::{
    Edge, EdgeKind, Embedding, Episode, Graph, Node, NodeBody, NodeId, NodeKind, Semantic,
};
use fluxmem_store::{CommitInfo, IndexHow, Store, TenantIndex, VectorBlock, Writer, INDEXED_KINDS};
use std::collections::{BTreeMap, BTreeSet};

const MODEL: &str = "test-model";

fn info(stage: &str) -> CommitInfo {
    CommitInfo {
        stage: stage.into(),
        run_id: "r".into(),
        ..Default::default()
    }
}

/// A node of `tenant`, with a vector of [`MODEL`] unless `embedded` is false.
fn add(graph: &mut Graph, tenant: &str, kind: NodeKind, text: &str, embedded: bool) -> NodeId {
    let body = match kind {
        NodeKind::Episodic => NodeBody::Episodic(Episode::default()),
        NodeKind::Semantic => NodeBody::Semantic(Semantic {
            source: "doc".into(),
            position: 0,
            time: None,
            group: None,
        }),
        NodeKind::Procedural => NodeBody::Procedural(Default::default()),
    };
    let node = Node::new(body, tenant, text, &[text]);
    let id = node.id.clone();
    if embedded {
        let seed = text.bytes().map(f32::from).sum::<f32>();
        graph.upsert_embedding(Embedding {
            node_id: id.clone(),
            model_id: MODEL.into(),
            text_sha256: String::new(),
            vector: (0..4).map(|i| seed + i as f32).collect(),
        });
    }
    graph.upsert_node(node);
    id
}

/// A store of `graph` under `dir`, indexed: its writer, a reader, its manifest and the path of
/// its (first) index file.
fn indexed(
    dir: &std::path::Path,
    graph: &Graph,
) -> (Writer, Store, fluxmem_store::Manifest, std::path::PathBuf) {
    let mut writer = Writer::open(dir).unwrap();
    writer.commit(graph, info("ingest")).unwrap();
    hows(&mut writer);
    let store = Store::open(dir).unwrap();
    let manifest = store.manifest().unwrap();
    let file = dir.join(&manifest.indexes[0].file);
    (writer, store, manifest, file)
}

/// Three embedded episodes of tenant t.
fn three_episodes(graph: &mut Graph) -> Vec<NodeId> {
    let text = |i| format!("episode {i}");
    (0..3)
        .map(|i| add(graph, "t", NodeKind::Episodic, &text(i), true))
        .collect()
}

/// An edge of `kind` from `src` to `dst`, of weight `weight`.
fn edge(graph: &mut Graph, src: &NodeId, dst: &NodeId, kind: EdgeKind, weight: f32) {
    graph.upsert_edge(Edge {
        src: src.clone(),
        dst: dst.clone(),
        kind,
        weight,
        evidence: 2,
        stage: "connect".into(),
        run_id: format!("run {weight}"),
        created_at: 7,
        active: weight > 0.1,
        metadata: BTreeMap::from([("w".to_string(), serde_json::json!(weight))]),
    });
}

/// The edges of the tenant's episodes an index must keep: from the whole graph, the ground
/// edges into them and the distill edges out of them, in key order.
fn expected_edges(graph: &Graph, tenant: &str) -> Vec<Edge> {
    let episodes = episodes_of(graph, tenant);
    let kept = |e: &&Edge| match e.kind {
        EdgeKind::Ground => episodes.contains(&e.dst),
        EdgeKind::Distill => episodes.contains(&e.src),
        EdgeKind::Link => false,
    };
    graph.edges.values().filter(kept).cloned().collect()
}

fn episodes_of(graph: &Graph, tenant: &str) -> BTreeSet<NodeId> {
    (graph.nodes.values())
        .filter(|n| n.tenant == tenant && n.kind() == NodeKind::Episodic)
        .map(|n| n.id.clone())
        .collect()
}

/// The edges `index` keeps of all of the tenant's episodes, in key order.
fn kept_edges(index: &TenantIndex, graph: &Graph, tenant: &str) -> Vec<Edge> {
    let mut edges = index.edges_of(&episodes_of(graph, tenant)).unwrap();
    edges.sort_by_key(Edge::key);
    edges
}

/// The tenant's index read whole equals what its shards hold, and the mapped file a query
/// reads gives the same ids, vectors and edges.
fn check(store: &Store, graph: &Graph, tenant: &str) {
    let index = read(store, tenant).expect("current");
    assert_eq!(index.blocks, expected(graph, tenant), "{tenant}");
    assert_eq!(
        kept_edges(&index, graph, tenant),
        expected_edges(graph, tenant),
        "{tenant}"
    );
    let manifest = store.manifest().unwrap();
    let mapped = store.map_index(&manifest, tenant, MODEL).unwrap().unwrap();
    for (kind, block) in &index.blocks {
        let ids: Vec<&str> = mapped.ids(*kind).collect();
        assert_eq!(
            ids,
            block.ids.iter().map(|i| i.as_str()).collect::<Vec<_>>()
        );
        assert_eq!(mapped.vectors(*kind), &block.vectors[..]);
        assert_eq!(mapped.unembedded(*kind).len(), block.unembedded.len());
    }
    let mut edges = mapped.edges_of(&episodes_of(graph, tenant)).unwrap();
    edges.sort_by_key(Edge::key);
    assert_eq!(edges, expected_edges(graph, tenant), "{tenant}, mapped");
}

/// What a tenant's index must hold: from the whole graph, each indexed kind's nodes of the
/// tenant in id order, with their vectors (the episodes' normalised) or among the unembedded.
fn expected(graph: &Graph, tenant: &str) -> BTreeMap<NodeKind, VectorBlock> {
    let mut blocks: BTreeMap<NodeKind, VectorBlock> = BTreeMap::new();
    for node in graph.nodes.values().filter(|n| n.tenant == tenant) {
        if !INDEXED_KINDS.contains(&node.kind()) {
            continue;
        }
        let block = blocks.entry(node.kind()).or_default();
        match graph.embeddings.get(&(node.id.clone(), MODEL.to_string())) {
            Some(e) => {
                let mut vector = e.vector.clone();
                if node.kind() == NodeKind::Episodic {
                    fluxmem_graph::normalize(&mut vector);
                }
                block.ids.push(node.id.clone());
                block.vectors.extend_from_slice(&vector);
            }
            None => block.unembedded.push(node.id.clone()),
        }
    }
    blocks
}

fn read(store: &Store, tenant: &str) -> Option<TenantIndex> {
    store
        .read_index(&store.manifest().unwrap(), tenant, MODEL)
        .unwrap()
}

/// `error` is a CRC-32 mismatch that names the index `file` of tenant t and the fix.
fn names_the_file_and_the_fix(error: &fluxmem_store::Error, file: &str) {
    let error = error.to_string();
    assert!(
        error.contains(file)
            && error.contains("CRC-32")
            && error.contains("fluxmem store index --rebuild --tenant t"),
        "{error}"
    );
}

fn hows(writer: &mut Writer) -> BTreeMap<String, IndexHow> {
    let updates = writer
        .update_indexes(MODEL, None, false, "r", &mut |_| {})
        .unwrap();
    updates.into_iter().map(|u| (u.tenant, u.how)).collect()
}

#[test]
fn an_index_holds_its_tenants_rows_and_is_kept_up_to_date_from_what_was_added() {
    let dir = tempfile::tempdir().unwrap();
    let mut graph = Graph::default();
    for tenant in ["t", "u"] {
        let skill = add(
            &mut graph,
            tenant,
            NodeKind::Procedural,
            &format!("{tenant} skill"),
            true,
        );
        let mut previous = None;
        for i in 0..6 {
            let episode = add(
                &mut graph,
                tenant,
                NodeKind::Episodic,
                &format!("{tenant} episode {i}"),
                i != 4,
            );
            let fact = add(
                &mut graph,
                tenant,
                NodeKind::Semantic,
                &format!("{tenant} fact {i}"),
                true,
            );
            // Ground edges into the episode (the unembedded one's too), a distill edge out of
            // every other one, and links, which an index does not keep.
            edge(&mut graph, &fact, &episode, EdgeKind::Ground, 0.5);
            if i % 2 == 0 {
                edge(&mut graph, &episode, &skill, EdgeKind::Distill, 0.9);
            }
            if let Some(previous) = previous.replace(episode.clone()) {
                edge(&mut graph, &episode, &previous, EdgeKind::Link, 0.7);
            }
        }
    }
    let mut writer = Writer::open(dir.path()).unwrap();
    writer.commit(&graph, info("ingest")).unwrap();
    let store = Store::open(dir.path()).unwrap();
    assert!(read(&store, "t").is_none(), "no index yet");

    let first = hows(&mut writer);
    assert_eq!(
        first,
        BTreeMap::from([("t".into(), IndexHow::Full), ("u".into(), IndexHow::Full)])
    );
    for tenant in ["t", "u"] {
        let index = read(&store, tenant).expect("current after update");
        assert_eq!(index.dim, 4);
        assert_eq!(index.block(NodeKind::Episodic).unembedded.len(), 1);
        assert_eq!(index.edges.len(), 9, "6 ground and 3 distill edges");
        check(&store, &graph, tenant);
    }
    assert_eq!(
        hows(&mut writer)["t"],
        IndexHow::Current,
        "an up-to-date index is not read again"
    );

    // Tenant t gets a new episode with a ground edge, a vector for the one it lacked, a new
    // vector for an old fact, a ground edge from it into an old episode, and a new weight for
    // an old distill edge; u gets nothing.
    let mut delta = Graph::default();
    let new = add(&mut delta, "t", NodeKind::Episodic, "t episode 6", true);
    let lacking = add(&mut delta, "t", NodeKind::Episodic, "t episode 4", true);
    let fact = add(&mut delta, "t", NodeKind::Semantic, "t fact 2", false);
    delta.upsert_embedding(Embedding {
        node_id: fact.clone(),
        model_id: MODEL.into(),
        text_sha256: String::new(),
        vector: vec![9.0, 8.0, 7.0, 6.0],
    });
    let old = (graph.nodes.values())
        .find(|n| n.tenant == "t" && n.text == "t episode 0")
        .map(|n| n.id.clone())
        .unwrap();
    let skill = (graph.nodes.values())
        .find(|n| n.tenant == "t" && n.kind() == NodeKind::Procedural)
        .map(|n| n.id.clone())
        .unwrap();
    edge(&mut delta, &fact, &new, EdgeKind::Ground, 0.25);
    edge(&mut delta, &fact, &old, EdgeKind::Ground, 0.75);
    edge(&mut delta, &old, &skill, EdgeKind::Distill, 0.05);
    writer.know_tenants([(&old, "t"), (&skill, "t")]);
    writer.commit(&delta, info("embed")).unwrap();
    graph.apply(delta);
    assert!(read(&store, "t").is_none(), "t's index is stale");
    assert!(read(&store, "u").is_some(), "u's index is still current");

    let first_file = (store.manifest().unwrap().indexes.iter())
        .find(|e| e.tenant == "t")
        .unwrap()
        .file
        .clone();
    let second = hows(&mut writer);
    assert_eq!(
        second,
        BTreeMap::from([
            ("t".into(), IndexHow::Added),
            ("u".into(), IndexHow::Current)
        ])
    );
    let index = read(&store, "t").unwrap();
    check(&store, &graph, "t");
    assert_eq!(
        index.edges.len(),
        11,
        "two more ground edges, one distill edge changed"
    );
    assert!(index.block(NodeKind::Episodic).ids.contains(&lacking));
    assert!(index.block(NodeKind::Episodic).unembedded.is_empty());

    // A compaction of rows the index already holds keeps it current; the file it replaced is
    // retired, then deleted, and a file no manifest names is swept.
    let policy = fluxmem_store::CompactPolicy {
        max_dead_fraction: 0.0,
        merge_factor: 2,
        min_level_rows: 1,
        ..Default::default()
    };
    writer.compact(&policy, "c").unwrap();
    check(&store, &graph, "t");
    let stray = dir.path().join("indexes/left-by-a-killed-run.fxvi");
    std::fs::write(&stray, b"x").unwrap();
    assert_eq!(hows(&mut writer)["t"], IndexHow::Current);
    assert!(!stray.exists(), "an unnamed file of indexes/ is swept");
    let manifest = store.manifest().unwrap();
    assert!(manifest.retired.iter().any(|r| r.file == first_file));
    assert!(dir.path().join(&first_file).exists(), "kept for readers");

    // An index commit keeps the live counts the compaction left; two commits later, with no
    // grace left, the replaced file is gone.
    let mut delta = Graph::default();
    add(&mut delta, "u", NodeKind::Episodic, "u episode 9", true);
    writer.commit(&delta, info("embed")).unwrap();
    writer.compact(&policy, "c").unwrap();
    assert!(store.manifest().unwrap().current_counts().is_some());
    writer.keep_retired_for(std::time::Duration::ZERO);
    assert_eq!(hows(&mut writer)["u"], IndexHow::Added);
    assert!(store.manifest().unwrap().current_counts().is_some());
    assert!(
        !dir.path().join(&first_file).exists(),
        "a retired index file is deleted"
    );
}

#[test]
fn a_damaged_index_is_an_error_naming_the_file_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let mut graph = Graph::default();
    three_episodes(&mut graph);
    let (mut writer, store, manifest, file) = indexed(dir.path(), &graph);
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let error = store.read_index(&manifest, "t", MODEL).unwrap_err();
    names_the_file_and_the_fix(&error, &manifest.indexes[0].file);
    // Indexing moves the store's version, so it waits for a sharded run's merge.
    std::fs::create_dir_all(dir.path().join("staging/embed-0-of-2")).unwrap();
    let refused = writer.update_indexes(MODEL, None, true, "r", &mut |_| {});
    assert!(matches!(refused, Err(fluxmem_store::Error::Staging { .. })));
    std::fs::remove_dir_all(dir.path().join("staging")).unwrap();
    // A current index whose file is gone is made again.
    let gone = dir.path().join(&store.manifest().unwrap().indexes[0].file);
    std::fs::remove_file(&gone).unwrap();
    assert_eq!(hows(&mut writer)["t"], IndexHow::Full);
    let manifest = store.manifest().unwrap();
    let file = dir.path().join(&manifest.indexes[0].file);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    // A stale index is made again from the shards when its file cannot be read.
    let mut delta = Graph::default();
    add(&mut delta, "t", NodeKind::Episodic, "episode 3", true);
    writer.commit(&delta, info("embed")).unwrap();
    graph.apply(delta);
    assert_eq!(hows(&mut writer)["t"], IndexHow::Full);
    check(&store, &graph, "t");
}

#[test]
fn a_mapped_index_checks_its_head_and_the_edges_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let mut graph = Graph::default();
    let fact = add(&mut graph, "t", NodeKind::Semantic, "fact", true);
    let episodes = three_episodes(&mut graph);
    for episode in &episodes {
        edge(&mut graph, &fact, episode, EdgeKind::Ground, 0.5);
    }
    let (_, store, manifest, file) = indexed(dir.path(), &graph);
    let clean = std::fs::read(&file).unwrap();

    // A byte of the last episode's edges (the records end 16 bytes before the file does):
    // its edges are an error naming the episode; the others' are read.
    let mut bytes = clean.clone();
    let at = bytes.len() - 16 - 10;
    bytes[at] ^= 0x01;
    std::fs::write(&file, &bytes).unwrap();
    let mapped = store.map_index(&manifest, "t", MODEL).unwrap().unwrap();
    let last = episodes.iter().max().unwrap().clone();
    let error = mapped
        .edges_of(&BTreeSet::from([last.clone()]))
        .unwrap_err();
    assert!(
        error.contains(last.as_str()) && error.contains("CRC-32"),
        "{error}"
    );
    let others: BTreeSet<NodeId> = episodes.iter().filter(|e| **e != last).cloned().collect();
    assert_eq!(mapped.edges_of(&others).unwrap().len(), 2);
    drop(mapped);

    // A byte of the vectors: the file is not mapped, and the error names it and the fix.
    let mut bytes = clean.clone();
    let first = graph.embeddings[&(fact.clone(), MODEL.to_string())].vector[0];
    let vector = (bytes.windows(4))
        .position(|w| w == first.to_le_bytes())
        .expect("the fact's vector is stored as embedded");
    bytes[vector] ^= 0x01;
    std::fs::write(&file, &bytes).unwrap();
    let error = store.map_index(&manifest, "t", MODEL).unwrap_err();
    names_the_file_and_the_fix(&error, &manifest.indexes[0].file);
}

/// An index whose edges cover none of its episodes (one put together by hand: its fields are
/// public) gives them no edges, and does not panic.
#[test]
fn an_index_without_edges_gives_its_episodes_none() {
    let mut graph = Graph::default();
    let ids: BTreeSet<NodeId> = three_episodes(&mut graph).into_iter().collect();
    let index = TenantIndex {
        tenant: "t".into(),
        model: MODEL.into(),
        dim: 4,
        blocks: expected(&graph, "t"),
        edges: Default::default(),
    };
    assert_eq!(index.edges_of(&ids), Ok(Vec::new()));
}
