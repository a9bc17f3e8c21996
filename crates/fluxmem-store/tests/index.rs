//! Tenant vector indexes hold what the shards hold, are used only while current, and are kept
//! up to date from what the commits after them added.

use fluxmem_graph::{Embedding, Episode, Graph, Node, NodeBody, NodeId, NodeKind, Semantic};
use fluxmem_store::{CommitInfo, IndexHow, Store, TenantIndex, VectorBlock, Writer, INDEXED_KINDS};
use std::collections::BTreeMap;

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

/// What a tenant's index must hold: from the whole graph, each indexed kind's nodes of the
/// tenant in id order, with their vectors or among the unembedded.
fn expected(graph: &Graph, tenant: &str) -> BTreeMap<NodeKind, VectorBlock> {
    let mut blocks: BTreeMap<NodeKind, VectorBlock> = BTreeMap::new();
    for node in graph.nodes.values().filter(|n| n.tenant == tenant) {
        if !INDEXED_KINDS.contains(&node.kind()) {
            continue;
        }
        let block = blocks.entry(node.kind()).or_default();
        match graph.embeddings.get(&(node.id.clone(), MODEL.to_string())) {
            Some(e) => {
                block.ids.push(node.id.clone());
                block.vectors.extend_from_slice(&e.vector);
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
        for i in 0..6 {
            add(
                &mut graph,
                tenant,
                NodeKind::Episodic,
                &format!("{tenant} episode {i}"),
                i != 4,
            );
            add(
                &mut graph,
                tenant,
                NodeKind::Semantic,
                &format!("{tenant} fact {i}"),
                true,
            );
        }
        add(
            &mut graph,
            tenant,
            NodeKind::Procedural,
            &format!("{tenant} skill"),
            true,
        );
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
        assert_eq!(index.blocks, expected(&graph, tenant), "{tenant}");
        assert_eq!(index.block(NodeKind::Episodic).unembedded.len(), 1);
    }
    assert_eq!(
        hows(&mut writer)["t"],
        IndexHow::Current,
        "an up-to-date index is not read again"
    );

    // Tenant t gets a new episode, a vector for the one it lacked, and a new vector for an
    // old fact; u gets nothing.
    let mut delta = Graph::default();
    add(&mut delta, "t", NodeKind::Episodic, "t episode 6", true);
    let lacking = add(&mut delta, "t", NodeKind::Episodic, "t episode 4", true);
    let fact = add(&mut delta, "t", NodeKind::Semantic, "t fact 2", false);
    delta.upsert_embedding(Embedding {
        node_id: fact.clone(),
        model_id: MODEL.into(),
        text_sha256: String::new(),
        vector: vec![9.0, 8.0, 7.0, 6.0],
    });
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
    assert_eq!(index.blocks, expected(&graph, "t"));
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
    assert_eq!(read(&store, "t").unwrap().blocks, expected(&graph, "t"));
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
    for i in 0..3 {
        add(
            &mut graph,
            "t",
            NodeKind::Episodic,
            &format!("episode {i}"),
            true,
        );
    }
    let mut writer = Writer::open(dir.path()).unwrap();
    writer.commit(&graph, info("ingest")).unwrap();
    hows(&mut writer);
    let store = Store::open(dir.path()).unwrap();
    let manifest = store.manifest().unwrap();
    let file = dir.path().join(&manifest.indexes[0].file);
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let error = store
        .read_index(&manifest, "t", MODEL)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(&manifest.indexes[0].file)
            && error.contains("CRC-32")
            && error.contains("fluxmem store index --rebuild --tenant t"),
        "{error}"
    );
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
    assert_eq!(read(&store, "t").unwrap().blocks, expected(&graph, "t"));
}
