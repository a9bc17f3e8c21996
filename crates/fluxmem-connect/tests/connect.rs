//! The connect stage and the retriever on the tau-bench sample, with the weight-free embedder.

use candle_core::Device;
use fluxmem_connect::{
    connect_store, pack, resolve_tenant, ConnectOptions, DenseIndex, Error, NoProgress,
    RetrievalConfig, Retriever, SemanticIndex, Unembedded,
};
use fluxmem_graph::{EdgeKind, Graph, NodeId, NodeKind};
use fluxmem_models::{Embedder, HashEmbedder};
use fluxmem_store::Writer;
use std::path::Path;

fn prepared_store(dir: &Path) -> Writer {
    let mut writer = Writer::open(dir).unwrap();
    let sample =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tau-bench/airline_sample.json");
    let report = fluxmem_ingest::ingest(
        &mut writer,
        &[sample],
        &Default::default(),
        "t",
        &mut fluxmem_ingest::NoProgress,
    )
    .unwrap();
    assert_eq!(report.quarantined, 0);
    fluxmem_embed::embed_store(
        &mut writer,
        &HashEmbedder::new(64),
        &Default::default(),
        "t",
        &mut fluxmem_embed::NoProgress,
    )
    .unwrap();
    writer
}

fn connected(dir: &Path) -> Graph {
    let mut writer = prepared_store(dir);
    let report = connect_store(
        &mut writer,
        &HashEmbedder::new(64),
        &ConnectOptions::default(),
        "connect@test",
        &Device::Cpu,
        &mut NoProgress,
    )
    .unwrap();
    assert_eq!(
        (report.episodes, report.connected, report.already),
        (4, 4, 0)
    );
    assert!(
        report.ground_edges > 0 && report.link_edges == 4 * 3,
        "{report:?}"
    );
    let again = connect_store(
        &mut writer,
        &HashEmbedder::new(64),
        &ConnectOptions::default(),
        "connect@test2",
        &Device::Cpu,
        &mut NoProgress,
    )
    .unwrap();
    assert_eq!(
        (again.connected, again.already, again.commits),
        (0, 4, 0),
        "connected episodes are not redone"
    );
    writer.store().load().unwrap()
}

#[test]
fn connect_writes_ground_and_link_edges_deterministically() {
    let a = tempfile::tempdir().unwrap();
    let graph = connected(a.path());
    for edge in graph.edges.values() {
        let (src, dst) = (&graph.nodes[&edge.src], &graph.nodes[&edge.dst]);
        match edge.kind {
            EdgeKind::Ground => {
                assert!(src.kind() == NodeKind::Semantic && dst.kind() == NodeKind::Episodic)
            }
            EdgeKind::Link => assert!(
                src.kind() == NodeKind::Episodic
                    && dst.kind() == NodeKind::Episodic
                    && edge.src != edge.dst
            ),
            EdgeKind::Distill => panic!("connect writes no distill edges"),
        }
        assert!(edge.evidence >= 1 && edge.active);
    }
    let b = tempfile::tempdir().unwrap();
    assert_eq!(
        connected(b.path()).edges,
        graph.edges,
        "same store and options, same edges"
    );
}

#[test]
fn retriever_returns_related_episodes_and_policy_for_a_task() {
    let dir = tempfile::tempdir().unwrap();
    let writer = prepared_store(dir.path());
    let graph = writer.store().load().unwrap();
    let embedder = HashEmbedder::new(64);
    let tenant = resolve_tenant(&graph, None).unwrap();
    let retriever = Retriever::build(&graph, &tenant, embedder.model_id(), &Device::Cpu).unwrap();
    let task = graph
        .nodes
        .values()
        .find(|n| n.kind() == NodeKind::Episodic)
        .unwrap()
        .text
        .clone();
    let vector = embedder.embed(&[task.as_str()]).unwrap().remove(0);
    let entries = retriever
        .retrieve(&graph, &task, &vector, &RetrievalConfig::default(), None, 2)
        .unwrap();
    let kinds: Vec<NodeKind> = entries
        .iter()
        .map(|(id, ..)| graph.nodes[id].kind())
        .collect();
    assert_eq!(&kinds[..2], &[NodeKind::Episodic, NodeKind::Episodic]);
    assert!(entries[0].3.contains("similar past episode"));
    // The episode whose task is the query comes first, with cosine 1.
    assert_eq!(graph.nodes[&entries[0].0].text, task);
    assert!(kinds[2..].iter().all(|k| *k == NodeKind::Semantic));
    let words = |text: &str| Ok(text.split_whitespace().count());
    let first = pack(&graph, &entries, 300, &words).unwrap();
    assert!(first.tokens <= 300 && !first.items.is_empty());
    assert_eq!(
        first,
        pack(&graph, &entries, 300, &words).unwrap(),
        "same query, same context"
    );
}

/// Two tenants whose texts overlap: without isolation, tenant acme's refund episode would be
/// grounded in globex's secret and linked to globex's episodes.
const TWO_TENANTS: &str = r#"{"type":"fact","tenant":"acme","text":"Refunds of damaged orders are issued to the original card within 30 days."}
{"type":"fact","tenant":"acme","text":"Address changes are possible while an order is processing."}
{"type":"fact","tenant":"globex","text":"Tenant B secret: refund orders to card 4111 1111 1111 1111 within 30 days."}
{"type":"fact","tenant":"globex","text":"Globex ships orders from the Springfield warehouse."}
{"tenant":"acme","episode_id":"a1","task":"Refund damaged order 1042 to the card","steps":[{"observation":"User: refund my damaged order to my card","action":"refund"}],"outcome":{"success":true}}
{"tenant":"acme","episode_id":"a2","task":"Change the address of order 1100","steps":[{"observation":"User: change the address of my order","action":"update_address"}],"outcome":{"success":false}}
{"tenant":"globex","episode_id":"b1","task":"Refund order 77 to card 4111","steps":[{"observation":"User: refund my order to card 4111","action":"refund"}],"outcome":{"success":true}}
{"tenant":"globex","episode_id":"b2","task":"Refund damaged order 78 to the card","steps":[{"observation":"User: refund my damaged order to my card","action":"refund"}],"outcome":{"success":false}}
"#;

fn two_tenant_store(dir: &Path, lines: &str) -> Writer {
    let input = dir.join("two.jsonl");
    std::fs::write(&input, lines).unwrap();
    let mut writer = Writer::open(dir.join("store")).unwrap();
    let report = fluxmem_ingest::ingest(
        &mut writer,
        &[input],
        &Default::default(),
        "t",
        &mut fluxmem_ingest::NoProgress,
    )
    .unwrap();
    assert_eq!(report.quarantined, 0);
    fluxmem_embed::embed_store(
        &mut writer,
        &HashEmbedder::new(64),
        &Default::default(),
        "t",
        &mut fluxmem_embed::NoProgress,
    )
    .unwrap();
    writer
}

#[test]
fn connect_never_joins_two_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = two_tenant_store(dir.path(), TWO_TENANTS);
    let options = ConnectOptions {
        ground_k: 3,
        link_k: 5,
        ..Default::default()
    };
    let report = connect_store(
        &mut writer,
        &HashEmbedder::new(64),
        &options,
        "connect@test",
        &Device::Cpu,
        &mut NoProgress,
    )
    .unwrap();
    assert_eq!((report.episodes, report.connected), (4, 4));
    // Each episode links to the one other episode of its tenant, not to the other tenant's two.
    assert_eq!(report.link_edges, 4, "{report:?}");
    let graph = writer.store().load().unwrap();
    assert!(!graph.edges.is_empty());
    for edge in graph.edges.values() {
        let (src, dst) = (&graph.nodes[&edge.src], &graph.nodes[&edge.dst]);
        assert_eq!(
            src.tenant, dst.tenant,
            "{:?} edge {} -> {} joins two tenants",
            edge.kind, src.text, dst.text
        );
    }
    let secret = graph
        .nodes
        .values()
        .find(|n| n.text.contains("4111 1111"))
        .unwrap();
    assert!(graph
        .edges
        .values()
        .filter(|e| e.src == secret.id)
        .all(|e| graph.nodes[&e.dst].tenant == "globex"));
}

/// BM25 statistics are per tenant: another tenant's documents do not move a score.
#[test]
fn a_tenants_scores_do_not_depend_on_other_tenants() {
    let acme_only: String = TWO_TENANTS
        .lines()
        .filter(|l| l.contains("\"acme\""))
        .map(|l| format!("{l}\n"))
        .collect();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let both = two_tenant_store(a.path(), TWO_TENANTS)
        .store()
        .load()
        .unwrap();
    let alone = two_tenant_store(b.path(), &acme_only)
        .store()
        .load()
        .unwrap();
    let embedder = HashEmbedder::new(64);
    let query = "refund my damaged order to my card";
    let vector = embedder.embed(&[query]).unwrap().remove(0);
    let ranked = |graph: &Graph| {
        let index = SemanticIndex::build(graph, "acme", embedder.model_id(), &Device::Cpu).unwrap();
        let hits = index
            .hybrid(query, &vector, &RetrievalConfig::default(), None)
            .unwrap();
        hits.into_iter()
            .map(|c| {
                (
                    c.node_id,
                    c.signals.dense.to_bits(),
                    c.signals.bm25.to_bits(),
                    c.score.to_bits(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(ranked(&both), ranked(&alone));
    assert_eq!(ranked(&both).len(), 2, "only acme's facts");
}

/// Query-time retrieval answers from what is embedded and counts what it left out; connect
/// (strict) still names the fix.
#[test]
fn retrieval_skips_and_counts_nodes_without_an_embedding() {
    let dir = tempfile::tempdir().unwrap();
    let writer = two_tenant_store(dir.path(), TWO_TENANTS);
    let mut graph = writer.store().load().unwrap();
    let embedder = HashEmbedder::new(64);
    let model = embedder.model_id().to_string();
    let dropped: NodeId = graph
        .nodes
        .values()
        .find(|n| n.tenant == "acme" && n.text.starts_with("Refunds"))
        .unwrap()
        .id
        .clone();
    graph.embeddings.remove(&(dropped.clone(), model.clone()));
    assert!(matches!(
        Retriever::build(&graph, "acme", &model, &Device::Cpu),
        Err(Error::NotEmbedded { .. })
    ));
    let retriever =
        Retriever::build_with(&graph, "acme", &model, &Device::Cpu, Unembedded::Skip).unwrap();
    assert_eq!(retriever.not_embedded(), 1);
    assert_eq!(retriever.tenant(), "acme");
    let query = "refund my damaged order";
    let vector = embedder.embed(&[query]).unwrap().remove(0);
    let entries = retriever
        .retrieve(&graph, query, &vector, &RetrievalConfig::default(), None, 5)
        .unwrap();
    let ids: Vec<&NodeId> = entries.iter().map(|(id, ..)| id).collect();
    assert_eq!(
        ids.len(),
        3,
        "two acme episodes and the one embedded acme fact: {ids:?}"
    );
    assert!(!ids.contains(&&dropped));
    assert!(ids.iter().all(|id| graph.nodes[*id].tenant == "acme"));
    let other =
        Retriever::build_with(&graph, "globex", &model, &Device::Cpu, Unembedded::Skip).unwrap();
    assert_eq!(other.not_embedded(), 0, "counted per tenant");
}

/// `count` episodes from `first` on, two tenants; tasks repeat, so many vectors are equal
/// (ties at every cut).
fn fleet(first: usize, count: usize) -> String {
    (first..first + count)
        .map(|i| {
            let tenant = if i % 3 == 0 { "globex" } else { "acme" };
            let task = format!("{} order {} for the customer", ["refund", "cancel", "ship", "track", "repair"][i % 5], i % 7);
            format!(
                "{{\"tenant\":\"{tenant}\",\"episode_id\":\"e{i:04}\",\"task\":\"{task}\",\"steps\":[{{\"observation\":\"User: please {task}\",\"action\":\"act\"}}],\"outcome\":{{\"success\":{}}}}}\n",
                i % 2 == 0
            )
        })
        .collect()
}

/// Two nights (120 episodes, then 40) connected with a budget of `memory` bytes, the store
/// compacted before the second night's connect with `compact`: the store's link edges (key and
/// weight bits), the store, and the groups the first night was done in.
fn two_nights(
    dir: &Path,
    memory: usize,
    compact: bool,
) -> (Vec<(NodeId, NodeId, u32)>, Graph, usize) {
    let mut writer = Writer::open(dir.join("store")).unwrap();
    let options = ConnectOptions {
        link_k: 5,
        commit_every: 16,
        memory,
        ..Default::default()
    };
    let mut groups = Vec::new();
    for (night, (first, count)) in [(0, 120), (120, 40)].into_iter().enumerate() {
        let input = dir.join(format!("night{night}.jsonl"));
        std::fs::write(&input, fleet(first, count)).unwrap();
        let report = fluxmem_ingest::ingest(
            &mut writer,
            &[input],
            &Default::default(),
            "t",
            &mut fluxmem_ingest::NoProgress,
        )
        .unwrap();
        assert_eq!(report.quarantined, 0);
        fluxmem_embed::embed_store(
            &mut writer,
            &HashEmbedder::new(64),
            &Default::default(),
            "t",
            &mut fluxmem_embed::NoProgress,
        )
        .unwrap();
        if compact && night == 1 {
            // The two nights' vectors in one merged shard, not two.
            let policy = fluxmem_store::CompactPolicy {
                merge_factor: 2,
                ..Default::default()
            };
            assert!(
                writer.compact(&policy, "compact@test").unwrap().committed,
                "the shards are merged"
            );
            assert_eq!(
                writer
                    .manifest()
                    .shards
                    .iter()
                    .filter(|s| s.table == "embeddings")
                    .count(),
                1
            );
        }
        let report = connect_store(
            &mut writer,
            &HashEmbedder::new(64),
            &options,
            &format!("connect@{night}"),
            &Device::Cpu,
            &mut NoProgress,
        )
        .unwrap();
        assert_eq!(report.connected, count);
        assert_eq!(
            report.commits,
            count.div_ceil(16),
            "commits of 16 episodes, whatever the groups"
        );
        groups.push(report.groups);
    }
    let graph = writer.store().load().unwrap();
    let links = graph
        .edges
        .values()
        .filter(|e| e.kind == EdgeKind::Link)
        .map(|e| (e.src.clone(), e.dst.clone(), e.weight.to_bits()))
        .collect();
    (links, graph, groups[0])
}

#[test]
fn the_link_search_streams_the_stored_vectors_within_any_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (links, graph, groups) = two_nights(
        &dir.path().join("default"),
        fluxmem_connect::DEFAULT_MEMORY,
        false,
    );
    assert_eq!(links.len(), 160 * 5, "five links per episode");
    assert_eq!(groups, 1, "the night fits the default budget");
    // One query a pass, the smallest blocks and a commit's episodes a group; a few queries a
    // pass; blocks of about 80 rows (fewer than a tenant's episodes); and the vectors in merged
    // shards.
    for (memory, compact, expected_groups) in [
        (1, false, 8),
        (20_000, false, 8),
        (368_000, false, 0),
        (1, true, 8),
    ] {
        let (small, small_graph, small_groups) = two_nights(
            &dir.path().join(format!("m{memory}-{compact}")),
            memory,
            compact,
        );
        assert_eq!(
            small, links,
            "a budget of {memory} bytes (compacted: {compact}) changes the links"
        );
        // Every edge (ground ones too) the same, but for its time (each store ingested its own
        // files, whose times differ).
        let same = |g: &Graph| {
            g.edges
                .values()
                .map(|e| (e.key(), e.weight.to_bits(), e.evidence, e.active))
                .collect::<Vec<_>>()
        };
        assert!(
            same(&small_graph) == same(&graph),
            "a budget of {memory} bytes changes the edges"
        );
        if expected_groups > 0 {
            assert_eq!(
                small_groups, expected_groups,
                "groups of the first night with {memory} bytes"
            );
        } else {
            assert!(
                (2..8).contains(&small_groups),
                "a budget between: groups of several commits ({small_groups})"
            );
        }
    }
    // The second night's links are the exact kNN over one index of all the tenant's vectors
    // (ties by id), and stay inside the tenant.
    let model = HashEmbedder::new(64).model_id().to_string();
    let second: Vec<&NodeId> = graph
        .nodes
        .values()
        .filter(|n| {
            n.episode().is_some()
                && n.metadata
                    .get("episode_id")
                    .and_then(|v| v.as_str())
                    .is_some_and(|e| e >= "e0120")
        })
        .map(|n| &n.id)
        .collect();
    assert_eq!(
        second.len(),
        40,
        "the second night's episodes are found by their episode ids"
    );
    for id in second {
        let tenant = &graph.nodes[id].tenant;
        let (ids, vectors): (Vec<&NodeId>, Vec<Vec<f32>>) = graph
            .nodes
            .values()
            .filter(|n| n.episode().is_some() && &n.tenant == tenant)
            .map(|n| {
                (
                    &n.id,
                    graph.embeddings[&(n.id.clone(), model.clone())]
                        .vector
                        .clone(),
                )
            })
            .unzip();
        let own = ids.iter().position(|i| *i == id).unwrap();
        let expected: Vec<(NodeId, NodeId, u32)> = DenseIndex::from_vectors(&vectors, &Device::Cpu)
            .unwrap()
            .top_k(&[vectors[own].clone()], 6)
            .unwrap()
            .remove(0)
            .into_iter()
            .filter(|(j, _)| *j != own)
            .take(5)
            .map(|(j, c)| (id.clone(), ids[j].clone(), c.to_bits()))
            .collect();
        let got: Vec<(NodeId, NodeId, u32)> =
            links.iter().filter(|l| &l.0 == id).cloned().collect();
        let mut expected_sorted = expected.clone();
        expected_sorted.sort();
        assert_eq!(got, expected_sorted, "episode {id}");
    }
}

#[test]
fn an_episode_without_a_vector_fails_whatever_link_k() {
    for link_k in [0, 5] {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::open(dir.path().join("store")).unwrap();
        for (night, (first, count)) in [(0, 10), (10, 1)].into_iter().enumerate() {
            let input = dir.path().join(format!("night{night}.jsonl"));
            std::fs::write(&input, fleet(first, count)).unwrap();
            fluxmem_ingest::ingest(
                &mut writer,
                &[input],
                &Default::default(),
                "t",
                &mut fluxmem_ingest::NoProgress,
            )
            .unwrap();
            if night == 0 {
                fluxmem_embed::embed_store(
                    &mut writer,
                    &HashEmbedder::new(64),
                    &Default::default(),
                    "t",
                    &mut fluxmem_embed::NoProgress,
                )
                .unwrap();
            }
        }
        let options = ConnectOptions {
            link_k,
            ..Default::default()
        };
        let err = connect_store(
            &mut writer,
            &HashEmbedder::new(64),
            &options,
            "connect@test",
            &Device::Cpu,
            &mut NoProgress,
        )
        .unwrap_err();
        assert!(
            matches!(err, Error::NotEmbedded { .. }),
            "link_k {link_k}: {err}"
        );
        assert!(
            writer.store().load().unwrap().edges.is_empty(),
            "link_k {link_k}: nothing is written"
        );
    }
}

/// An episode connected earlier that has no vector (left by an older store) is named before
/// anything is written: the link search counts each tenant's stored vectors against its
/// episodes.
#[test]
fn an_old_episode_without_a_vector_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path().join("store")).unwrap();
    for (night, (first, count)) in [(0, 10), (10, 1)].into_iter().enumerate() {
        let input = dir.path().join(format!("night{night}.jsonl"));
        std::fs::write(&input, fleet(first, count)).unwrap();
        fluxmem_ingest::ingest(
            &mut writer,
            &[input],
            &Default::default(),
            "t",
            &mut fluxmem_ingest::NoProgress,
        )
        .unwrap();
        fluxmem_embed::embed_store(
            &mut writer,
            &HashEmbedder::new(64),
            &Default::default(),
            "t",
            &mut fluxmem_embed::NoProgress,
        )
        .unwrap();
        if night == 0 {
            connect_store(
                &mut writer,
                &HashEmbedder::new(64),
                &ConnectOptions::default(),
                "connect@0",
                &Device::Cpu,
                &mut NoProgress,
            )
            .unwrap();
        }
    }
    // A copy of a stored episode under another id, with a Stage I link out (so it counts as
    // connected), and no vector.
    let graph = writer.store().load().unwrap();
    let mut orphan = graph
        .nodes
        .values()
        .find(|n| n.episode().is_some())
        .unwrap()
        .clone();
    orphan.id = NodeId("episode-without-a-vector".into());
    let link = graph
        .edges
        .values()
        .find(|e| e.kind == EdgeKind::Link && e.src != orphan.id)
        .unwrap()
        .clone();
    let mut delta = Graph::default();
    delta.upsert_edge(fluxmem_graph::Edge {
        src: orphan.id.clone(),
        ..link
    });
    delta.insert_node(orphan);
    writer
        .commit(
            &delta,
            fluxmem_store::CommitInfo {
                stage: "test".into(),
                ..Default::default()
            },
        )
        .unwrap();
    let edges = writer.store().load().unwrap().edges.len();
    let err = connect_store(
        &mut writer,
        &HashEmbedder::new(64),
        &ConnectOptions::default(),
        "connect@1",
        &Device::Cpu,
        &mut NoProgress,
    )
    .unwrap_err();
    match err {
        Error::NotEmbedded { node, .. } => assert_eq!(node, "episode-without-a-vector"),
        other => panic!("{other}"),
    }
    assert_eq!(
        writer.store().load().unwrap().edges.len(),
        edges,
        "nothing is written"
    );
}

/// Facts that do not fit their quarter of the budget are spilled to scratch partitions and
/// searched one partition at a time: the same ground edges, bit for bit (weight, evidence and
/// time), as one index per tenant held whole, with pools cut where they tie or not, over plain
/// units and over the serving retrieval's (context units, neighbours in a section, a speaker
/// a step names); the scratch files are gone after the run.
#[test]
fn facts_spilled_to_partitions_give_the_same_ground_edges() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: String, memory: usize, retrieval: &RetrievalConfig, two_tenants: bool| {
        let path = dir.path().join(name);
        std::fs::create_dir_all(&path).unwrap();
        let mut writer = if two_tenants {
            two_tenant_store(&path, TWO_TENANTS)
        } else {
            prepared_store(&path)
        };
        if two_tenants {
            // Facts of acme's questions said ten times each (ties at every cut of the pools and
            // of the ranking).
            let repeated = path.join("repeated.jsonl");
            // In four sections, said by two speakers; an episode's step names one of them.
            let mut lines: String = (0..30)
                .map(|i| format!("{{\"type\":\"fact\",\"tenant\":\"acme\",\"source\":\"faq\",\"position\":{i},\"section\":\"s{}\",\"speaker\":\"{}\",\"text\":\"Refunds for {} orders go to the original card.\"}}\n", i % 4, ["Dana Scully", "Lee"][i % 2], ["cancelled", "damaged", "late"][i % 3]))
                .collect();
            lines.push_str(r#"{"tenant":"acme","episode_id":"a3","task":"Refund a late order","steps":[{"observation":"User: what did Dana's team say about refunds for late orders?","action":"refund"}],"outcome":{"success":true}}"#);
            lines.push('\n');
            std::fs::write(&repeated, lines).unwrap();
            fluxmem_ingest::ingest(
                &mut writer,
                &[repeated],
                &Default::default(),
                "t2",
                &mut fluxmem_ingest::NoProgress,
            )
            .unwrap();
            fluxmem_embed::embed_store(
                &mut writer,
                &HashEmbedder::new(64),
                &Default::default(),
                "t2",
                &mut fluxmem_embed::NoProgress,
            )
            .unwrap();
        }
        let options = ConnectOptions {
            ground_k: 3,
            memory,
            retrieval: retrieval.clone(),
            ..Default::default()
        };
        let report = connect_store(
            &mut writer,
            &HashEmbedder::new(64),
            &options,
            "connect@test",
            &Device::Cpu,
            &mut NoProgress,
        )
        .unwrap();
        assert!(
            !writer.store().dir().join(fluxmem_store::SCRATCH).exists(),
            "the scratch files are deleted"
        );
        let graph = writer.store().load().unwrap();
        for edge in graph.edges.values() {
            assert_eq!(
                graph.nodes[&edge.src].tenant, graph.nodes[&edge.dst].tenant,
                "an edge joins two tenants"
            );
        }
        // Times too, where both stores ingested the same file (the two-tenant stores each
        // write their own files, whose times differ).
        let time = |t: i64| if two_tenants { 0 } else { t };
        let edges: Vec<_> = graph
            .edges
            .values()
            .map(|e| {
                (
                    e.key(),
                    e.weight.to_bits(),
                    e.evidence,
                    time(e.created_at),
                    e.active,
                )
            })
            .collect();
        (report, edges)
    };
    let small = |config: RetrievalConfig| RetrievalConfig {
        dense_pool: 4,
        bm25_pool: 2,
        ..config
    };
    let pools = [
        RetrievalConfig::default(),
        small(RetrievalConfig::default()),
        RetrievalConfig::serving(),
        small(RetrievalConfig::serving()),
    ];
    for (p, retrieval) in pools.iter().enumerate() {
        for two_tenants in [false, true] {
            let (whole, edges) = run(
                format!("whole-{p}-{two_tenants}"),
                fluxmem_connect::DEFAULT_MEMORY,
                retrieval,
                two_tenants,
            );
            assert_eq!(whole.fact_partitions, 0, "the facts fit the default budget");
            assert!(whole.ground_edges > 0, "{whole:?}");
            for memory in [1, 4_000, 40_000] {
                let (spilled, spilled_edges) = run(
                    format!("m{memory}-{p}-{two_tenants}"),
                    memory,
                    retrieval,
                    two_tenants,
                );
                // The two tenants' four facts fit 40 KB.
                if !(two_tenants && memory == 40_000) {
                    assert!(spilled.fact_partitions >= 2, "{memory} bytes: {spilled:?}");
                }
                assert_eq!(
                    (spilled.ground_edges, spilled.link_edges),
                    (whole.ground_edges, whole.link_edges)
                );
                let diff: Vec<_> = spilled_edges
                    .iter()
                    .zip(&edges)
                    .filter(|(a, b)| a != b)
                    .take(2)
                    .collect();
                assert!(spilled_edges == edges, "a budget of {memory} bytes changes the edges (pool {p}, two tenants: {two_tenants}): {diff:?}");
            }
        }
    }
}

/// With the facts spilled, a fact without a vector is still named before anything is written,
/// and the scratch files are deleted on the failure too.
#[test]
fn a_spilled_fact_without_a_vector_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = two_tenant_store(dir.path(), TWO_TENANTS);
    let late = dir.path().join("late.jsonl");
    // A fact of each tenant without a vector: the first tenant by name is named, whichever id
    // is lower, as the whole indexes (built tenant by tenant) name it.
    let lines: String =
        ["{\"type\":\"fact\",\"tenant\":\"acme\",\"text\":\"Exchanges need the receipt.\"}\n"]
            .into_iter()
            .chain(
                (0..8)
                    .map(|i| {
                        format!(
                    "{{\"type\":\"fact\",\"tenant\":\"globex\",\"text\":\"Globex rule {i}.\"}}\n"
                )
                    })
                    .collect::<Vec<_>>()
                    .iter()
                    .map(String::as_str),
            )
            .collect();
    std::fs::write(&late, lines).unwrap();
    fluxmem_ingest::ingest(
        &mut writer,
        &[late],
        &Default::default(),
        "late",
        &mut fluxmem_ingest::NoProgress,
    )
    .unwrap();
    let graph = writer.store().load().unwrap();
    let unembedded = graph
        .nodes
        .values()
        .find(|n| n.text.starts_with("Exchanges"))
        .unwrap()
        .id
        .to_string();
    let globex_first = graph
        .nodes
        .values()
        .filter(|n| n.text.starts_with("Globex rule"))
        .map(|n| n.id.to_string())
        .min()
        .unwrap();
    assert!(
        globex_first < unembedded,
        "a globex fact's id sorts first (else the order of tenants proves nothing)"
    );
    for memory in [1, fluxmem_connect::DEFAULT_MEMORY] {
        let options = ConnectOptions {
            memory,
            ..Default::default()
        };
        let err = connect_store(
            &mut writer,
            &HashEmbedder::new(64),
            &options,
            "connect@test",
            &Device::Cpu,
            &mut NoProgress,
        )
        .unwrap_err();
        match err {
            Error::NotEmbedded { node, .. } => assert_eq!(node, unembedded, "{memory} bytes"),
            other => panic!("{memory} bytes: {other}"),
        }
        assert!(
            writer.store().load().unwrap().edges.is_empty(),
            "nothing is written"
        );
        assert!(
            !dir.path()
                .join("store")
                .join(fluxmem_store::SCRATCH)
                .exists(),
            "the scratch files are deleted"
        );
    }
}

#[test]
fn an_episode_that_grew_after_it_was_connected_is_connected_again_once() {
    let formats = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/formats");
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path()).unwrap();
    let night = |file: Option<&str>, writer: &mut Writer| {
        if let Some(file) = file {
            fluxmem_ingest::ingest(
                writer,
                &[formats.join(file)],
                &Default::default(),
                "t",
                &mut fluxmem_ingest::NoProgress,
            )
            .unwrap();
        }
        fluxmem_embed::embed_store(
            writer,
            &HashEmbedder::new(64),
            &Default::default(),
            "t",
            &mut fluxmem_embed::NoProgress,
        )
        .unwrap();
        connect_store(
            writer,
            &HashEmbedder::new(64),
            &ConnectOptions::default(),
            "connect@test",
            &Device::Cpu,
            &mut NoProgress,
        )
        .unwrap()
    };
    // One conversation: its first turn on night 1, its second on night 2 (the episode grows).
    let first = night(Some("pydantic-ai-turn-1.jsonl"), &mut writer);
    assert_eq!((first.connected, first.regrounded), (1, 0), "{first:?}");
    // A later stage turns one of its ground edges off (credit assignment's prune).
    let graph = writer.store().load().unwrap();
    let mut pruned = graph
        .edges
        .values()
        .find(|e| e.kind == EdgeKind::Ground)
        .expect("a ground edge")
        .clone();
    pruned.active = false;
    pruned.metadata.insert("pruned_by".into(), "credit".into());
    let mut delta = Graph::default();
    delta.upsert_edge(pruned.clone());
    writer
        .commit(&delta, fluxmem_store::CommitInfo::default())
        .unwrap();
    let second = night(Some("pydantic-ai-turn-2.jsonl"), &mut writer);
    assert_eq!(
        (second.connected, second.regrounded, second.already),
        (1, 1, 0),
        "{second:?}"
    );
    let graph = writer.store().load().unwrap();
    let kept = &graph.edges[&pruned.key()];
    assert!(
        !kept.active && kept.metadata.contains_key("pruned_by"),
        "connecting again keeps what later stages made of an edge: {kept:?}"
    );
    let third = night(None, &mut writer);
    assert_eq!(
        (
            third.connected,
            third.regrounded,
            third.already,
            third.commits
        ),
        (0, 0, 1, 0),
        "handled once: {third:?}"
    );
}

/// A sharded connect's merge records the retrieval its shards grounded with: the one every
/// shard that committed recorded, not one a shard inherited from the main store; shards that
/// recorded different settings are refused, by name.
#[test]
fn the_shards_recorded_retrieval_is_the_merges_and_two_settings_are_refused() {
    use fluxmem_connect::{retrieval_progress, staged_retrieval, RetrievalConfig, STAGE};
    use fluxmem_store::{CommitInfo, Shard, Store};
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("store");
    let record = |writer: &mut Writer, config: &RetrievalConfig, stage: &str| {
        writer
            .commit(
                &Graph::default(),
                CommitInfo {
                    stage: stage.into(),
                    progress: [retrieval_progress(config)].into_iter().collect(),
                    ..Default::default()
                },
            )
            .unwrap();
    };
    let plain = RetrievalConfig::default();
    let serving = RetrievalConfig::serving();
    assert_ne!(plain, serving);
    // The main store was connected with plain retrieval on an earlier night.
    record(&mut Writer::open(&main).unwrap(), &plain, STAGE);
    let store = Store::open(&main).unwrap();
    let shard = |index| Shard { index, count: 3 };
    let mut first = Writer::open_staging(&main, STAGE, shard(0)).unwrap();
    let mut second = Writer::open_staging(&main, STAGE, shard(1)).unwrap();
    // The third shard commits nothing of connect's: the plain record it inherited is not its own.
    let mut third = Writer::open_staging(&main, STAGE, shard(2)).unwrap();
    third.finish_staging("r").unwrap();
    assert_eq!(
        staged_retrieval(&store, 3).unwrap(),
        None,
        "no shard committed"
    );
    record(&mut first, &serving, STAGE);
    record(&mut second, &serving, STAGE);
    // Unfinished shards are the merge's to refuse: not counted yet.
    assert_eq!(staged_retrieval(&store, 3).unwrap(), None);
    first.finish_staging("r").unwrap();
    second.finish_staging("r").unwrap();
    assert_eq!(staged_retrieval(&store, 3).unwrap(), Some(serving.clone()));
    record(&mut second, &plain, STAGE);
    let error = staged_retrieval(&store, 3).unwrap_err().to_string();
    assert!(error.contains("connect-1-of-3"), "{error}");
    assert!(error.contains("shard 0/3"), "{error}");
    assert!(error.contains("one setting"), "{error}");
}
