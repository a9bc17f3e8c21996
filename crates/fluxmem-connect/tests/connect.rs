//! The connect stage and the retriever on the tau-bench sample, with the weight-free embedder.

use candle_core::Device;
use fluxmem_connect::{connect_store, pack, ConnectOptions, NoProgress, RetrievalConfig, Retriever};
use fluxmem_graph::{EdgeKind, Graph, NodeKind};
use fluxmem_models::{Embedder, HashEmbedder};
use fluxmem_store::Writer;
use std::path::Path;

fn prepared_store(dir: &Path) -> Writer {
    let mut writer = Writer::open(dir).unwrap();
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tau-bench/airline_sample.json");
    let report = fluxmem_ingest::ingest(&mut writer, &[sample], &Default::default(), "t", &mut fluxmem_ingest::NoProgress).unwrap();
    assert_eq!(report.quarantined, 0);
    fluxmem_embed::embed_store(&mut writer, &HashEmbedder::new(64), &Default::default(), "t", &mut fluxmem_embed::NoProgress).unwrap();
    writer
}

fn connected(dir: &Path) -> Graph {
    let mut writer = prepared_store(dir);
    let report = connect_store(&mut writer, &HashEmbedder::new(64), &ConnectOptions::default(), "connect@test", &Device::Cpu, &mut NoProgress).unwrap();
    assert_eq!((report.episodes, report.connected, report.already), (4, 4, 0));
    assert!(report.ground_edges > 0 && report.link_edges == 4 * 3, "{report:?}");
    let again = connect_store(&mut writer, &HashEmbedder::new(64), &ConnectOptions::default(), "connect@test2", &Device::Cpu, &mut NoProgress).unwrap();
    assert_eq!((again.connected, again.already, again.commits), (0, 4, 0), "connected episodes are not redone");
    writer.store().load().unwrap()
}

#[test]
fn connect_writes_ground_and_link_edges_deterministically() {
    let a = tempfile::tempdir().unwrap();
    let graph = connected(a.path());
    for edge in graph.edges.values() {
        let (src, dst) = (&graph.nodes[&edge.src], &graph.nodes[&edge.dst]);
        match edge.kind {
            EdgeKind::Ground => assert!(src.kind() == NodeKind::Semantic && dst.kind() == NodeKind::Episodic),
            EdgeKind::Link => assert!(src.kind() == NodeKind::Episodic && dst.kind() == NodeKind::Episodic && edge.src != edge.dst),
            EdgeKind::Distill => panic!("connect writes no distill edges"),
        }
        assert!(edge.evidence >= 1 && edge.active);
    }
    let b = tempfile::tempdir().unwrap();
    assert_eq!(connected(b.path()).edges, graph.edges, "same store and options, same edges");
}

#[test]
fn retriever_returns_related_episodes_and_policy_for_a_task() {
    let dir = tempfile::tempdir().unwrap();
    let writer = prepared_store(dir.path());
    let graph = writer.store().load().unwrap();
    let embedder = HashEmbedder::new(64);
    let retriever = Retriever::build(&graph, embedder.model_id(), &Device::Cpu).unwrap();
    let task = graph.nodes.values().find(|n| n.kind() == NodeKind::Episodic).unwrap().text.clone();
    let vector = embedder.embed(&[task.as_str()]).unwrap().remove(0);
    let entries = retriever.retrieve(&graph, &task, &vector, &RetrievalConfig::default(), None, 2).unwrap();
    let kinds: Vec<NodeKind> = entries.iter().map(|(id, ..)| graph.nodes[id].kind()).collect();
    assert_eq!(&kinds[..2], &[NodeKind::Episodic, NodeKind::Episodic]);
    assert!(entries[0].3.contains("similar past episode"));
    // The episode whose task is the query comes first, with cosine 1.
    assert_eq!(graph.nodes[&entries[0].0].text, task);
    assert!(kinds[2..].iter().all(|k| *k == NodeKind::Semantic));
    let words = |text: &str| Ok(text.split_whitespace().count());
    let first = pack(&graph, &entries, 300, &words).unwrap();
    assert!(first.tokens <= 300 && !first.items.is_empty());
    assert_eq!(first, pack(&graph, &entries, 300, &words).unwrap(), "same query, same context");
}
