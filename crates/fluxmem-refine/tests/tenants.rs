//! Tenants never mix, over random multi-tenant graphs with the weight-free embedder: after
//! connect and refine no active edge joins two tenants' nodes (and connect writes none at all),
//! and retrieval and the Stage II loop for tenant T return only T's nodes, even when an older
//! store left cross-tenant edges and the Stage I ranking handed to the loop holds other
//! tenants' candidates.

use candle_core::Device;
use fluxmem_connect::{
    connect_store, tenants, Candidate, ConnectOptions, RetrievalConfig, Retriever,
};
use fluxmem_graph::{
    sha256_hex, Edge, EdgeKey, EdgeKind, Embedding, Episode, Graph, Node, NodeBody, NodeId,
    NodeKind, Outcome, Semantic, Step,
};
use fluxmem_models::{Embedder, HashEmbedder};
use fluxmem_refine::{
    refine_query, refine_store, CreditOptions, LoopModels, LoopOptions, Neighbours, NoProgress,
};
use fluxmem_store::{CommitInfo, Writer};
use proptest::prelude::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// A small shared vocabulary, so that every tenant's texts look alike.
const WORDS: [&str; 10] = [
    "refund",
    "order",
    "card",
    "address",
    "damaged",
    "secret",
    "warehouse",
    "invoice",
    "cancel",
    "flight",
];
const TENANTS: [&str; 3] = ["acme", "globex", "initech"];
const QUERY: &str = "refund the damaged order to the card";

#[derive(Debug, Clone)]
struct Spec {
    tenant: usize,
    words: Vec<usize>,
    episode: bool,
    success: Option<bool>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        0..TENANTS.len(),
        prop::collection::vec(0..WORDS.len(), 2..6),
        any::<bool>(),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(tenant, words, episode, success)| Spec {
            tenant,
            words,
            episode,
            success,
        })
}

fn text_of(spec: &Spec) -> String {
    spec.words
        .iter()
        .map(|&w| WORDS[w])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Nodes of the specs, embedded. Facts of every tenant share one source and session, at
/// consecutive positions; episodes share one source file, with the first word as task id.
fn graph_of(specs: &[Spec], embedder: &HashEmbedder) -> Graph {
    let mut graph = Graph::default();
    for (i, spec) in specs.iter().enumerate() {
        let text = text_of(spec);
        let body = if spec.episode {
            let step = Step {
                observation: text.clone(),
                action: WORDS[spec.words[0]].into(),
                ..Default::default()
            };
            NodeBody::Episodic(Episode {
                steps: vec![step],
                outcome: Outcome {
                    success: spec.success,
                    reward: None,
                    feedback: None,
                },
            })
        } else {
            NodeBody::Semantic(Semantic {
                source: "shared.md".into(),
                position: i as i64,
                time: None,
                group: Some("s1".into()),
            })
        };
        let mut node = Node::new(body, TENANTS[spec.tenant], &text, &[&i.to_string()]);
        node.source_file = "shared.jsonl".into();
        node.created_at = Some(1000 + i as i64);
        if spec.episode {
            node.metadata
                .insert("task_id".into(), Value::from(WORDS[spec.words[0]]));
        }
        let embedded = node.embedding_text();
        let vector = embedder.embed(&[embedded.as_str()]).unwrap().remove(0);
        let model_id = embedder.model_id().to_string();
        graph.upsert_embedding(Embedding {
            node_id: node.id.clone(),
            model_id,
            text_sha256: sha256_hex(embedded.as_bytes()),
            vector,
        });
        graph.insert_node(node);
    }
    graph
}

/// Cross-tenant edges an older store could hold, between the nodes at the given positions.
fn legacy_edges(graph: &Graph, pairs: &[(usize, usize)]) -> Vec<Edge> {
    let nodes: Vec<&Node> = graph.nodes.values().collect();
    let mut out: BTreeMap<EdgeKey, Edge> = BTreeMap::new();
    for &(a, b) in pairs {
        let (src, dst) = (nodes[a % nodes.len()], nodes[b % nodes.len()]);
        if src.tenant == dst.tenant {
            continue;
        }
        let kind = if src.kind() == NodeKind::Semantic && dst.kind() == NodeKind::Episodic {
            EdgeKind::Ground
        } else {
            EdgeKind::Link
        };
        let edge = Edge {
            src: src.id.clone(),
            dst: dst.id.clone(),
            kind,
            weight: 0.9,
            evidence: 1,
            stage: "connect".into(),
            run_id: "connect@old".into(),
            created_at: 1000,
            active: true,
            metadata: Default::default(),
        };
        out.insert(edge.key(), edge);
    }
    out.into_values().collect()
}

fn tenant_of<'g>(graph: &'g Graph, extra: &'g Graph, id: &NodeId) -> Option<&'g str> {
    extra
        .nodes
        .get(id)
        .or_else(|| graph.nodes.get(id))
        .map(|n| n.tenant.as_str())
}

fn words(text: &str) -> fluxmem_connect::Result<usize> {
    Ok(text.split_whitespace().count())
}

/// Connects and refines the specs' store (with the legacy edges committed first); returns the
/// stored graph and the legacy edge keys.
fn connected_and_refined(
    dir: &std::path::Path,
    specs: &[Spec],
    pairs: &[(usize, usize)],
    embedder: &HashEmbedder,
) -> (Graph, BTreeSet<EdgeKey>) {
    let mut graph = graph_of(specs, embedder);
    let legacy = legacy_edges(&graph, pairs);
    let keys: BTreeSet<EdgeKey> = legacy.iter().map(Edge::key).collect();
    for edge in legacy {
        graph.upsert_edge(edge);
    }
    let mut writer = Writer::open(dir.join("store")).unwrap();
    writer
        .commit(
            &graph,
            CommitInfo {
                stage: "ingest".into(),
                run_id: "i".into(),
                summary: Value::Null,
                progress: Default::default(),
            },
        )
        .unwrap();
    let options = ConnectOptions {
        ground_k: 2,
        link_k: 3,
        commit_every: 4,
        ..Default::default()
    };
    connect_store(
        &mut writer,
        embedder,
        &options,
        "connect@p",
        &Device::Cpu,
        &mut NoProgress,
    )
    .unwrap();
    let credit = CreditOptions {
        min_evidence: 1,
        ..Default::default()
    };
    let first = refine_store(&mut writer, &credit, "refine@p", &mut NoProgress).unwrap();
    assert_eq!(
        first.cross_tenant,
        keys.len(),
        "every legacy edge is seen as crossing"
    );
    let again = refine_store(&mut writer, &credit, "refine@p2", &mut NoProgress).unwrap();
    assert_eq!(again.edits, 0, "a second refine changes nothing");
    (writer.store().load().unwrap(), keys)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn tenants_never_mix(specs in prop::collection::vec(spec(), 1..18), pairs in prop::collection::vec((0usize..64, 0usize..64), 0..4)) {
        let embedder = HashEmbedder::new(32);
        let dir = tempfile::tempdir().unwrap();
        let (graph, legacy) = connected_and_refined(dir.path(), &specs, &pairs, &embedder);
        for edge in graph.edges.values() {
            let (src, dst) = (&graph.nodes[&edge.src], &graph.nodes[&edge.dst]);
            if src.tenant != dst.tenant {
                prop_assert!(legacy.contains(&edge.key()), "a stage wrote a cross-tenant {:?} edge", edge.kind);
                prop_assert!(!edge.active, "a cross-tenant edge is still active");
                prop_assert_eq!(edge.metadata.get("pruned_by").and_then(Value::as_str), Some("isolation"));
            }
        }
        let model = embedder.model_id();
        let retrievers: BTreeMap<String, Retriever> =
            tenants(&graph).into_iter().map(|t| (t.clone(), Retriever::build(&graph, &t, model, &Device::Cpu).unwrap())).collect();
        let vector = embedder.embed(&[QUERY]).unwrap().remove(0);
        let config = RetrievalConfig::default();
        for (tenant, retriever) in &retrievers {
            let entries = retriever.retrieve(&graph, QUERY, &vector, &config, None, 3).unwrap();
            let own = graph.nodes.values().filter(|n| &n.tenant == tenant);
            let expected = own.clone().filter(|n| n.kind() == NodeKind::Semantic).count()
                + own.filter(|n| n.kind() == NodeKind::Episodic).count().min(3);
            prop_assert_eq!(entries.len(), expected, "every fact and the closest episodes of the tenant");
            for (id, ..) in &entries {
                prop_assert_eq!(graph.nodes[id].tenant.as_str(), tenant.as_str());
            }
            // The loop, handed other tenants' candidates ahead of its own, keeps to its tenant.
            let (_, own_stage1) = retriever.retrieve_split(&graph, QUERY, &vector, &config, None, 3).unwrap();
            let mut stage1: Vec<Candidate> = Vec::new();
            for (other, r) in &retrievers {
                if other != tenant {
                    stage1.extend(r.semantic().hybrid(QUERY, &vector, &config, None).unwrap());
                }
            }
            stage1.extend(own_stage1);
            let neighbours = Neighbours::build(&graph, tenant);
            let mut verifier = fluxmem_refine::verifier(None, retriever.semantic());
            let mut models = LoopModels { verifier: &mut *verifier, embedder: &embedder, generator: None, count_tokens: &words };
            let options = LoopOptions { rounds: 3, budget: 24, reshape_below: 4, ..Default::default() };
            let outcome = refine_query(&graph, retriever.semantic(), &neighbours, QUERY, &stage1, &mut models, &options, "query@p", 5).unwrap();
            let mut made = Graph::default();
            for node in &outcome.new_nodes {
                made.insert_node(node.clone());
            }
            for (id, ..) in &outcome.ranking {
                prop_assert_eq!(tenant_of(&graph, &made, id), Some(tenant.as_str()));
            }
            for item in &outcome.context.items {
                prop_assert_eq!(item.tenant.as_str(), tenant.as_str());
            }
            for edge in outcome.delta.edges.values() {
                let ends = (tenant_of(&graph, &made, &edge.src), tenant_of(&graph, &made, &edge.dst));
                prop_assert_eq!(ends, (Some(tenant.as_str()), Some(tenant.as_str())), "a loop edit joins two tenants");
            }
        }
    }
}
