//! A night's credit pass reads what the night added (the watermark, the statistics stored on
//! the semantic nodes) and commits exactly what a pass over every edge commits: nine nights
//! over two tenants, with pruning and recovery, fractional rewards, failures linked to
//! successes, a task whose first success comes late, a cross-tenant edge, an old edge
//! rewritten by another stage, compactions between nights and one inside a night (its shards
//! mix rows from before and after the watermark), and a base rate that drifts.

mod common;

use fluxmem_graph::{
    Edge, EdgeKind, Edit, Episode, Graph, Node, NodeBody, NodeId, Outcome, Semantic,
};
use fluxmem_refine::{
    refine_store, CreditOptions, CreditReport, CreditStats, NoProgress, STATS_KEY, WATERMARK_MARKER,
};
use fluxmem_store::{CommitInfo, CompactPolicy, Writer};
use serde_json::Value;

const TENANTS: [&str; 2] = ["t", "u"];

fn fact(tenant: &str, i: usize) -> Node {
    let body = NodeBody::Semantic(Semantic {
        source: "policy".into(),
        position: i as i64,
        time: None,
        group: None,
    });
    Node::new(
        body,
        tenant,
        &format!("fact {i} of {tenant}"),
        &[tenant, &i.to_string()],
    )
}

/// A deterministic hash of an episode number and a salt.
fn h(j: usize, salt: usize) -> usize {
    let mut x = (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (salt as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    x as usize
}

use common::connect_edge as edge;

/// The episodes `from..to` of night `night`, grounded in two or three facts of their tenant,
/// linked to the episode before them in their tenant, as connect writes them.
fn night(night: usize, from: usize, to: usize, facts: &[Vec<Node>]) -> Graph {
    let mut graph = Graph::default();
    let mut last: [Option<NodeId>; 2] = [None, None];
    for j in from..to {
        let t = j % 2;
        let tenant = TENANTS[t];
        // Night 8 fails far more often: the base rates drift and are estimated again.
        let base: usize = if night == 8 { 15 } else { 60 };
        let mut used = vec![h(j, 1) % 6, h(j, 2) % 6];
        let mut rate = (base + if used.contains(&0) { 25 } else { 0 })
            .saturating_sub(if used.contains(&5) { 30 } else { 0 });
        // Fact 7 comes in on night 2: three failures (pruned), then successes (recovered),
        // then failures again.
        if night >= 2 && j % 10 == 3 {
            used.push(7);
            rate = match night {
                2 => 0,
                3 | 4 => 100,
                _ => 0,
            };
        }
        // Fact 6 comes in on night 4 with successes, then fails from night 5 on: pruned on
        // night 6, a night that reads only what was added.
        if (night == 4 && j % 20 == 9) || (night >= 5 && j % 10 == 9) {
            used.push(6);
            rate = if night == 4 { 100 } else { 0 };
        }
        used.sort_unstable();
        used.dedup();
        // A rare task: its first success comes on night 4, after failures that had no link.
        let rare = j % 17 == 5;
        let success = if rare {
            night >= 4 && h(j, 4).is_multiple_of(2)
        } else {
            h(j, 3) % 100 < rate
        };
        let task = if rare {
            "rare".to_string()
        } else {
            format!("task {}", h(j, 5) % 7)
        };
        let outcome = if j % 11 == 0 {
            Outcome {
                success: None,
                reward: Some((h(j, 6) % 1000) as f64 / 999.0),
                feedback: None,
            }
        } else {
            Outcome {
                success: Some(success),
                reward: None,
                feedback: None,
            }
        };
        let body = NodeBody::Episodic(Episode {
            steps: Vec::new(),
            outcome,
        });
        let mut e = Node::new(body, tenant, &format!("episode {j}"), &[&j.to_string()]);
        e.metadata.insert("task_id".into(), Value::from(task));
        e.source_file = "runs.jsonl".into();
        let at = 1_000 + j as i64;
        e.created_at = Some(at);
        for (k, f) in used.iter().enumerate() {
            graph.upsert_edge(edge(
                &facts[t][*f].id,
                &e.id,
                EdgeKind::Ground,
                0.3 + 0.1 * k as f32,
                at,
            ));
        }
        if let Some(previous) = &last[t] {
            graph.upsert_edge(edge(&e.id, previous, EdgeKind::Link, 0.8, at));
        }
        // Now and then a link into the other tenant (an older store's mistake): isolated.
        if j % 37 == 0 {
            if let Some(other) = &last[1 - t] {
                graph.upsert_edge(edge(&e.id, other, EdgeKind::Link, 0.5, at));
            }
        }
        last[t] = Some(e.id.clone());
        graph.insert_node(e);
    }
    graph
}

/// A night as the pipeline writes it: the episodes in an ingest commit (new ids only), then
/// the edges in a connect commit.
fn commit_night(writer: &mut Writer, graph: &Graph) {
    let mut nodes = Graph::default();
    graph.nodes.values().for_each(|n| {
        nodes.insert_node(n.clone());
    });
    let mut edges = Graph::default();
    graph
        .edges
        .values()
        .for_each(|e| edges.upsert_edge(e.clone()));
    commit(writer, &nodes, "ingest");
    commit(writer, &edges, "connect");
}

fn commit(writer: &mut Writer, graph: &Graph, stage: &str) {
    writer
        .commit(
            graph,
            CommitInfo {
                stage: stage.into(),
                run_id: stage.into(),
                summary: Value::Null,
                progress: Default::default(),
            },
        )
        .unwrap();
}

/// The store's graph, and its refine edit records in log order: what the two runs must agree on.
fn state(writer: &Writer) -> (Graph, Vec<Edit>) {
    let mut graph = writer.store().load().unwrap();
    let edits = graph
        .edits
        .iter()
        .filter(|e| e.stage == "refine")
        .cloned()
        .collect();
    graph.edits.clear();
    (graph, edits)
}

#[test]
fn a_delta_night_commits_what_a_full_pass_commits() {
    let facts: Vec<Vec<Node>> = TENANTS
        .iter()
        .map(|t| (0..8).map(|i| fact(t, i)).collect())
        .collect();
    let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut delta = Writer::open(dirs.0.path().join("store")).unwrap();
    let mut full = Writer::open(dirs.1.path().join("store")).unwrap();
    let mut facts_graph = Graph::default();
    facts.iter().flatten().for_each(|f| {
        facts_graph.insert_node(f.clone());
    });
    for writer in [&mut delta, &mut full] {
        commit(writer, &facts_graph, "ingest");
    }
    let sizes = [300, 40, 40, 40, 40, 40, 120, 40, 120];
    let mut from = 0;
    let mut reports: Vec<(CreditReport, CreditReport)> = Vec::new();
    for (n, size) in sizes.into_iter().enumerate() {
        let graph = night(n, from, from + size, &facts);
        from += size;
        for writer in [&mut delta, &mut full] {
            commit_night(writer, &graph);
            if n == 3 {
                // Another stage rewrites two counted ground edges (new Stage I weight, the
                // credit keys kept): their node is read whole.
                let old = writer.store().load().unwrap();
                let mut rewrite = Graph::default();
                for e in old
                    .edges
                    .values()
                    .filter(|e| e.kind == EdgeKind::Ground && e.metadata.contains_key("outcomes"))
                    .take(2)
                {
                    let mut e = e.clone();
                    e.weight *= 0.9;
                    e.metadata.insert("stage1_weight".into(), Value::from(0.25));
                    rewrite.upsert_edge(e);
                }
                assert_eq!(rewrite.edges.len(), 2);
                commit(writer, &rewrite, "query");
            }
        }
        if n == 5 {
            // A compaction between the night's commits and refine merges rows from both sides
            // of the watermark (every unit on one level, merged into one): the night reads
            // those shards too.
            let policy = CompactPolicy {
                merge_factor: 2,
                min_level_rows: 1000,
                ..Default::default()
            };
            for writer in [&mut delta, &mut full] {
                assert!(writer.compact(&policy, "compact").unwrap().committed);
            }
            let manifest = delta.manifest();
            let mark = manifest.progress[WATERMARK_MARKER]["version"]
                .as_u64()
                .unwrap();
            let since = manifest.since(mark, &["nodes", "edges"]);
            assert!(
                since.mixed.shards.iter().any(|s| s.table == "nodes")
                    && since.mixed.shards.iter().any(|s| s.table == "edges"),
                "{:?}",
                since.mixed.shards
            );
        }
        let run_id = format!("refine@{n}");
        // Every night that can be read as a delta is, however much it mixes.
        let options = CreditOptions {
            commit_every: 50,
            max_delta_share: 1.0,
            ..Default::default()
        };
        let a = refine_store(&mut delta, &options, &run_id, &mut NoProgress).unwrap();
        let b = refine_store(
            &mut full,
            &CreditOptions {
                full: true,
                ..options.clone()
            },
            &run_id,
            &mut NoProgress,
        )
        .unwrap();
        assert!(!b.delta);
        let counts = |r: &CreditReport| {
            (
                r.reweighted,
                r.pruned,
                r.reactivated,
                r.expanded,
                r.isolated,
                r.edits,
                r.stats_written,
                r.base_rate.clone(),
            )
        };
        assert_eq!(counts(&a), counts(&b), "night {n}: delta {a:?}\nfull {b:?}");
        let (graph_a, edits_a) = state(&delta);
        let (graph_b, edits_b) = state(&full);
        assert_eq!(
            graph_a.nodes, graph_b.nodes,
            "night {n}: the node rows (credit statistics) differ"
        );
        assert_eq!(graph_a.edges, graph_b.edges, "night {n}: the edges differ");
        assert_eq!(edits_a, edits_b, "night {n}: the edit logs differ");
        // Every fact with outcomes behind it holds its statistics, and they are the sums.
        for f in facts.iter().flatten() {
            let behind: Vec<&Edge> = graph_a
                .edges
                .values()
                .filter(|e| e.src == f.id && e.kind == EdgeKind::Ground)
                .collect();
            let stored = graph_a.nodes[&f.id]
                .metadata
                .get(STATS_KEY)
                .map(|v| serde_json::from_value::<CreditStats>(v.clone()).unwrap());
            match stored {
                Some(stats) => {
                    assert_eq!(
                        stats.n as usize,
                        behind.len(),
                        "night {n}: {} counts its edges",
                        f.text
                    );
                    let credits: Vec<f64> = behind
                        .iter()
                        .map(|e| e.metadata["credit"].as_f64().unwrap())
                        .collect();
                    let lo = credits.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = credits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    assert_eq!(
                        (stats.lo, stats.hi),
                        (lo, hi),
                        "night {n}: {} holds its edges' credit range",
                        f.text
                    );
                }
                None => assert!(
                    behind.is_empty(),
                    "night {n}: {} has edges and no statistics",
                    f.text
                ),
            }
        }
        if n % 3 == 1 {
            let policy = CompactPolicy {
                merge_factor: 2,
                min_level_rows: 10,
                ..Default::default()
            };
            for writer in [&mut delta, &mut full] {
                assert!(
                    writer.compact(&policy, "compact").unwrap().committed,
                    "night {n}: compaction merges"
                );
            }
        }
        reports.push((a, b));
    }
    // The nights did what this test is for.
    let delta_nights: Vec<&CreditReport> =
        reports.iter().map(|(a, _)| a).filter(|a| a.delta).collect();
    assert!(
        delta_nights.len() >= 5,
        "most nights read only what was added: {:?}",
        reports.iter().map(|(a, _)| a.delta).collect::<Vec<_>>()
    );
    assert!(
        !reports[8].0.delta && !reports[8].0.base_rate_estimated.is_empty(),
        "the drifting night re-estimates and reads everything"
    );
    assert!(
        delta_nights.iter().any(|a| a.whole_nodes > 0),
        "some node is read whole"
    );
    assert!(
        delta_nights.iter().any(|a| a.pruned > 0),
        "a delta night prunes"
    );
    assert!(
        delta_nights.iter().any(|a| a.reactivated > 0),
        "a delta night re-activates"
    );
    assert!(
        delta_nights.iter().any(|a| a.expanded > 0),
        "a delta night links failures"
    );
    assert!(
        delta_nights.iter().any(|a| a.isolated > 0),
        "a delta night isolates"
    );
    assert!(
        delta_nights.iter().any(|a| a.commits > 1),
        "a delta night commits in chunks"
    );
    assert!(
        reports[5].0.delta,
        "the night with mixed shards reads them as a delta"
    );
    for (a, b) in reports
        .iter()
        .enumerate()
        .filter(|(n, _)| *n != 5)
        .map(|(_, r)| r)
    {
        if a.delta {
            assert!(
                a.edges_decided * 3 < b.edges_decided,
                "a delta night decides on a part of the edges: {} of {}",
                a.edges_decided,
                b.edges_decided
            );
        }
    }
}

/// A run with nothing new commits nothing; settings that change the credits make the next run
/// read every edge, and the one after reads what was added since.
#[test]
fn a_rerun_after_a_change_of_settings_reads_everything() {
    let facts: Vec<Vec<Node>> = TENANTS
        .iter()
        .map(|t| (0..8).map(|i| fact(t, i)).collect())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path().join("store")).unwrap();
    let mut graph = night(0, 0, 200, &facts);
    facts.iter().flatten().for_each(|f| {
        graph.insert_node(f.clone());
    });
    commit(&mut writer, &graph, "connect");
    // A prior that holds through a small night's drift.
    let options = CreditOptions {
        prior_drift: 0.1,
        ..Default::default()
    };
    let first = refine_store(&mut writer, &options, "r1", &mut NoProgress).unwrap();
    assert!(!first.delta && first.stats_written > 0);
    commit_night(&mut writer, &night(1, 200, 230, &facts));
    let second = refine_store(&mut writer, &options, "r2", &mut NoProgress).unwrap();
    assert!(second.delta, "{second:?}");
    let nothing = refine_store(&mut writer, &options, "r3", &mut NoProgress).unwrap();
    assert_eq!(
        (nothing.edits, nothing.stats_written, nothing.commits),
        (0, 0, 0),
        "{nothing:?}"
    );
    // Other settings: every edge is read, the credits follow the new prior.
    let other = CreditOptions {
        prior: 4.0,
        ..options.clone()
    };
    let third = refine_store(&mut writer, &other, "r4", &mut NoProgress).unwrap();
    assert!(!third.delta && third.edits > 0, "{third:?}");
    let again = refine_store(&mut writer, &other, "r5", &mut NoProgress).unwrap();
    assert!(again.delta && again.edits == 0, "{again:?}");
}

/// A node's credit that crosses the prune line by less than the tolerance (its third failure
/// gives it the evidence to be pruned) has its old edges read and pruned with the new one, as
/// a full pass prunes them.
#[test]
fn crossing_the_prune_line_within_the_tolerance_reads_the_node_whole() {
    let f = fact("t", 0);
    let other = fact("t", 1);
    let episode = |j: usize, success: bool| {
        let body = NodeBody::Episodic(Episode {
            steps: Vec::new(),
            outcome: Outcome {
                success: Some(success),
                reward: None,
                feedback: None,
            },
        });
        let mut e = Node::new(body, "t", &format!("episode {j}"), &[&j.to_string()]);
        e.created_at = Some(j as i64);
        e
    };
    // Night 1: two failures behind f (credit 2/(2+2) = 0.5, two outcomes: kept), and a base
    // rate of 0.5 from episodes grounded in the other fact.
    let mut first = Graph::default();
    first.insert_node(f.clone());
    first.insert_node(other.clone());
    for j in 0..2 {
        let e = episode(j, false);
        first.upsert_edge(edge(&f.id, &e.id, EdgeKind::Ground, 0.5, 0));
        first.insert_node(e);
    }
    for j in 2..6 {
        let e = episode(j, j < 5);
        first.upsert_edge(edge(&other.id, &e.id, EdgeKind::Ground, 0.5, 0));
        first.insert_node(e);
    }
    // Night 2: a third failure: credit (0 + 2 * 0.5) / (3 + 2) / 0.5 = 0.4, three outcomes: pruned, though it moved by 0.1 only.
    let mut second = Graph::default();
    let e = episode(6, false);
    second.upsert_edge(edge(&f.id, &e.id, EdgeKind::Ground, 0.5, 0));
    second.insert_node(e);
    // And a success elsewhere, so the base rate stays 0.5.
    let e = episode(7, true);
    second.upsert_edge(edge(&other.id, &e.id, EdgeKind::Ground, 0.5, 0));
    second.insert_node(e);
    let options = CreditOptions {
        tolerance: 0.2,
        link_failures: false,
        ..Default::default()
    };
    let mut stores = Vec::new();
    for full in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::open(dir.path().join("store")).unwrap();
        commit(&mut writer, &first, "connect");
        let one = refine_store(&mut writer, &options, "r1", &mut NoProgress).unwrap();
        assert_eq!(one.pruned, 0, "{one:?}");
        commit(&mut writer, &second, "connect");
        let two = refine_store(
            &mut writer,
            &CreditOptions {
                full,
                ..options.clone()
            },
            "r2",
            &mut NoProgress,
        )
        .unwrap();
        assert_eq!(
            (two.delta, two.pruned, two.whole_nodes),
            (!full, 3, if full { 0 } else { 1 }),
            "{two:?}"
        );
        let graph = state(&writer).0;
        assert!(
            graph
                .edges
                .values()
                .filter(|e| e.src == f.id)
                .all(|e| !e.active),
            "every edge of f is pruned"
        );
        stores.push((dir, graph));
    }
    assert_eq!(stores[0].1.edges, stores[1].1.edges);
    assert_eq!(stores[0].1.nodes, stores[1].1.nodes);
}

/// A fact whose statistics were lost (another stage rewrote its row without them) and that
/// gains edges has its outcomes counted again from all its edges, as a full pass counts them.
#[test]
fn a_fact_that_lost_its_statistics_is_counted_again_whole() {
    let facts: Vec<Vec<Node>> = TENANTS
        .iter()
        .map(|t| (0..8).map(|i| fact(t, i)).collect())
        .collect();
    let options = CreditOptions {
        prior_drift: 0.1,
        link_failures: false,
        ..Default::default()
    };
    let mut graphs = Vec::new();
    let mut reports = Vec::new();
    for full in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::open(dir.path().join("store")).unwrap();
        let mut first = night(0, 0, 200, &facts);
        facts.iter().flatten().for_each(|f| {
            first.insert_node(f.clone());
        });
        commit(&mut writer, &first, "connect");
        refine_store(&mut writer, &options, "r1", &mut NoProgress).unwrap();
        // Another stage writes fact 0 of t again, without its metadata.
        let mut lost = Graph::default();
        lost.upsert_node(facts[0][0].clone());
        commit(&mut writer, &lost, "other");
        commit_night(&mut writer, &night(1, 200, 240, &facts));
        let report = refine_store(
            &mut writer,
            &CreditOptions {
                full,
                ..options.clone()
            },
            "r2",
            &mut NoProgress,
        )
        .unwrap();
        graphs.push(state(&writer));
        reports.push(report);
        drop(dir);
    }
    assert!(
        reports[0].delta && reports[0].whole_nodes >= 1,
        "{:?}",
        reports[0]
    );
    assert_eq!(graphs[0].0.nodes, graphs[1].0.nodes);
    assert_eq!(graphs[0].0.edges, graphs[1].0.edges);
    assert_eq!(graphs[0].1, graphs[1].1);
    let stats = &graphs[0].0.nodes[&facts[0][0].id].metadata[STATS_KEY];
    let counted = graphs[0]
        .0
        .edges
        .values()
        .filter(|e| e.src == facts[0][0].id && e.kind == EdgeKind::Ground)
        .count();
    assert_eq!(
        stats["n"].as_u64().unwrap() as usize,
        counted,
        "all its edges counted"
    );
}
