//! The query-time loop on a small hand-made graph with a scripted verifier: each edit brings the
//! expected nodes in and takes the expected ones out; the edit log survives a store round trip
//! and undoing it restores the graph's behaviour.

use candle_core::Device;
use fluxmem_connect::{Candidate, SemanticIndex, Signals};
use fluxmem_graph::{Edge, EdgeKind, Embedding, Graph, Node, NodeBody, NodeId, Semantic};
use fluxmem_models::{Embedder, HashEmbedder, Usage};
use fluxmem_refine::{refine_query, LoopModels, LoopOptions, LoopOutcome, Neighbours, Verifier};
use fluxmem_store::{CommitInfo, Writer};
use serde_json::Value;

/// Turns of one dialogue session, then unrelated long turns of another session.
const TURNS: [&str; 7] = [
    "Bob: congratulations friend",
    "Alice: I adopted a puppy from the shelter",
    "Alice: Biscuit",
    "Carol: the weather was rainy all week long",
    "Dan: the train to the city was late again today",
    "Erin: I painted the kitchen a bright yellow colour",
    "Finn: my laptop battery died during the meeting",
];

fn graph(embedder: &HashEmbedder) -> (Graph, Vec<NodeId>) {
    let mut graph = Graph::default();
    let mut ids = Vec::new();
    for (i, text) in TURNS.iter().enumerate() {
        let group = if i < 3 { "session_1" } else { "session_2" };
        let body = NodeBody::Semantic(Semantic {
            source: "conv".into(),
            position: i as i64,
            time: None,
            group: Some(group.into()),
        });
        let node = Node::new(body, "t", text, &["conv", &i.to_string()]);
        let vector = embedder.embed(&[text]).unwrap().remove(0);
        graph.upsert_embedding(Embedding {
            node_id: node.id.clone(),
            model_id: embedder.model_id().into(),
            text_sha256: String::new(),
            vector,
        });
        ids.push(node.id.clone());
        graph.insert_node(node);
    }
    (graph, ids)
}

/// Stage I ranking by hand: the given order, scores descending.
fn ranking(order: &[&NodeId]) -> Vec<Candidate> {
    order
        .iter()
        .enumerate()
        .map(|(i, id)| Candidate {
            index: i,
            node_id: (*id).clone(),
            signals: Signals::default(),
            score: 1.0 - i as f32 / 100.0,
            structure: Default::default(),
        })
        .collect()
}

/// Sufficient when one line satisfies `enough`; item scores from `score`.
struct Scripted {
    enough: fn(&str) -> bool,
    score: fn(&str) -> f32,
    calls: usize,
}

impl Verifier for Scripted {
    fn sufficient(&mut self, _query: &str, context: &str) -> fluxmem_refine::Result<f32> {
        self.calls += 1;
        Ok(if context.lines().any(self.enough) {
            1.0
        } else {
            0.0
        })
    }
    fn item_scores(&mut self, _query: &str, items: &[&str]) -> fluxmem_refine::Result<Vec<f32>> {
        self.calls += items.len();
        Ok(items.iter().map(|i| (self.score)(i)).collect())
    }
    fn sufficient_at(&self) -> f32 {
        0.5
    }
    fn distractor_below(&self) -> f32 {
        0.3
    }
    fn usage(&self) -> Usage {
        Usage {
            calls: self.calls,
            ..Usage::default()
        }
    }
    fn name(&self) -> String {
        "scripted".into()
    }
}

/// A verifier whose every context scores a little higher than the one before (0.1, 0.2, ...),
/// never sufficient under 0.5: each edit counts as a gain.
struct Rising {
    inner: Scripted,
    verified: usize,
}

impl Verifier for Rising {
    fn sufficient(&mut self, query: &str, context: &str) -> fluxmem_refine::Result<f32> {
        self.inner.sufficient(query, context)?;
        self.verified += 1;
        Ok(0.1 * self.verified as f32)
    }
    fn item_scores(&mut self, query: &str, items: &[&str]) -> fluxmem_refine::Result<Vec<f32>> {
        self.inner.item_scores(query, items)
    }
    fn sufficient_at(&self) -> f32 {
        self.inner.sufficient_at()
    }
    fn distractor_below(&self) -> f32 {
        self.inner.distractor_below()
    }
    fn usage(&self) -> Usage {
        self.inner.usage()
    }
    fn name(&self) -> String {
        "rising".into()
    }
}

fn words(text: &str) -> fluxmem_connect::Result<usize> {
    Ok(text.split_whitespace().count())
}

fn run(
    graph: &Graph,
    stage1: &[Candidate],
    verifier: &mut Scripted,
    options: &LoopOptions,
    embedder: &HashEmbedder,
) -> LoopOutcome {
    run_with(graph, stage1, verifier, options, embedder)
}

fn run_with(
    graph: &Graph,
    stage1: &[Candidate],
    verifier: &mut dyn Verifier,
    options: &LoopOptions,
    embedder: &HashEmbedder,
) -> LoopOutcome {
    let index = SemanticIndex::build(graph, "t", embedder.model_id(), &Device::Cpu).unwrap();
    let neighbours = Neighbours::build(graph, "t");
    let mut models = LoopModels {
        verifier,
        embedder,
        generator: None,
        count_tokens: &words,
    };
    refine_query(
        graph,
        &index,
        &neighbours,
        "what is the puppy called",
        stage1,
        &mut models,
        options,
        "run-1",
        7,
    )
    .unwrap()
}

/// A connect-stage ground edge of weight 0.7 from a turn to an episode.
fn ground(src: &NodeId, episode: &NodeId) -> Edge {
    Edge {
        src: src.clone(),
        dst: episode.clone(),
        kind: EdgeKind::Ground,
        weight: 0.7,
        evidence: 1,
        stage: "connect".into(),
        run_id: "c".into(),
        created_at: 1,
        active: true,
        metadata: Default::default(),
    }
}

fn context_ids(outcome: &LoopOutcome) -> Vec<NodeId> {
    outcome
        .context
        .items
        .iter()
        .map(|i| i.node_id.clone())
        .collect()
}

fn relation(edge: &Edge) -> Option<&str> {
    edge.metadata.get("relation").and_then(Value::as_str)
}

/// A budget that holds the first three lines of the ranking below (7 + 1 + 8 + 1 + 10 words).
const OPTIONS: LoopOptions = LoopOptions {
    rounds: 3,
    budget: 30,
    anchors: 1,
    expand_k: 1,
    prune_k: 3,
    expand_pool: 10,
    reshape_below: 0,
    merge_above: 0.0,
    link_weight: 0.5,
    gain: 0.2,
    sufficient_at: None,
};

#[test]
fn link_expand_brings_in_the_adjacent_turn_and_persists_on_success() {
    let embedder = HashEmbedder::new(32);
    let (graph, ids) = graph(&embedder);
    let stage1 = ranking(&[
        &ids[1], &ids[3], &ids[4], &ids[5], &ids[6], &ids[0], &ids[2],
    ]);
    let mut verifier = Scripted {
        enough: |line| line.contains("Biscuit"),
        score: |item| match item {
            _ if item.contains("puppy") || item.contains("Biscuit") => 1.0,
            _ if item.contains("weather") => 0.35,
            _ => 0.45,
        },
        calls: 0,
    };
    let outcome = run(&graph, &stage1, &mut verifier, &OPTIONS, &embedder);
    // Round 0: [puppy, weather, train]: no distractor (all >= 0.3), so under-connection; the
    // turn after the anchor ("Biscuit", 1.0) beats the turn before it (0.45) and is linked in,
    // in the place of the item the verifier scored lowest (weather, 0.35), not of the last one.
    assert_eq!(
        context_ids(&outcome)[..3],
        [ids[1].clone(), ids[2].clone(), ids[4].clone()]
    );
    assert!(
        !context_ids(&outcome).contains(&ids[3]),
        "the weakest item by the verifier made room"
    );
    assert!(outcome.sufficient);
    let attributions: Vec<&str> = outcome
        .rounds
        .iter()
        .map(|r| r.attribution.as_str())
        .collect();
    assert_eq!(attributions, ["under-connection", "sufficient"]);
    let link = &outcome
        .delta
        .edges
        .values()
        .find(|e| e.src == ids[1] && e.dst == ids[2])
        .expect("expand link");
    assert_eq!(
        (link.kind, relation(link), link.active),
        (EdgeKind::Link, Some("expand"), true)
    );
    assert!(
        (link.weight - 0.6).abs() < 1e-6,
        "0.5 + 0.2 * (1 - 0.5) after the success: {}",
        link.weight
    );
    assert_eq!(link.evidence, 2);
    let kinds: Vec<&str> = outcome
        .delta
        .edits
        .iter()
        .map(|e| e.kind.as_str())
        .collect();
    assert_eq!(kinds, ["link_expand", "credit"]);
    assert!(outcome.delta.edits[0].reason.contains("under-connection"));

    // The link persists: the next query anchored on the same turn gets "Biscuit" at round 0.
    let mut evolved = graph.clone();
    evolved.apply(outcome.delta.clone());
    let again = run(&evolved, &stage1, &mut verifier, &OPTIONS, &embedder);
    assert_eq!(again.rounds.len(), 1);
    assert_eq!(context_ids(&again)[..2], [ids[1].clone(), ids[2].clone()]);
    assert!(again.attempted.is_empty());
}

#[test]
fn link_prune_cuts_distractors_and_later_queries_leave_them_out() {
    let embedder = HashEmbedder::new(32);
    let (graph, ids) = graph(&embedder);
    let stage1 = ranking(&[
        &ids[1], &ids[3], &ids[4], &ids[2], &ids[5], &ids[6], &ids[0],
    ]);
    let mut verifier = Scripted {
        enough: |line| line.contains("Biscuit"),
        score: |item| {
            if item.contains("weather") || item.contains("train") {
                0.0
            } else {
                0.9
            }
        },
        calls: 0,
    };
    let outcome = run(&graph, &stage1, &mut verifier, &OPTIONS, &embedder);
    // Round 0: [puppy, weather, train]: two distractors of three: over-connection.
    assert_eq!(outcome.rounds[0].attribution, "over-connection");
    assert_eq!(outcome.rounds[0].edit.as_deref(), Some("link_prune"));
    let context = context_ids(&outcome);
    assert!(
        context.contains(&ids[2]),
        "the freed budget takes the next candidate, Biscuit"
    );
    assert!(
        !context.contains(&ids[3]) && !context.contains(&ids[4]),
        "distractors are out"
    );
    assert!(outcome.sufficient);
    for distractor in [&ids[3], &ids[4]] {
        let edge = outcome
            .delta
            .edges
            .values()
            .find(|e| &e.dst == distractor)
            .expect("prune link");
        assert_eq!(
            (&edge.src, relation(edge), edge.active),
            (&ids[1], Some("prune"), true)
        );
    }
    assert_eq!(
        outcome
            .delta
            .edits
            .iter()
            .filter(|e| e.kind == "link_prune")
            .count(),
        2
    );

    // Persisted: the next query anchored on the same turn never sees the distractors.
    let mut evolved = graph.clone();
    evolved.apply(outcome.delta.clone());
    let again = run(&evolved, &stage1, &mut verifier, &OPTIONS, &embedder);
    assert_eq!(again.rounds.len(), 1, "sufficient at once");
    assert!(!context_ids(&again).contains(&ids[3]));
}

#[test]
fn node_reshape_makes_a_finer_node_that_takes_the_old_ones_place() {
    let embedder = HashEmbedder::new(32);
    let (mut graph, ids) = graph(&embedder);
    // An episode the short turn grounds: the reshaped node must keep this connection.
    let episode = NodeId::from("epi-1");
    graph.upsert_edge(ground(&ids[2], &episode));
    let stage1 = ranking(&[
        &ids[2], &ids[3], &ids[4], &ids[5], &ids[6], &ids[0], &ids[1],
    ]);
    let mut verifier = Scripted {
        // Sufficient only when one item says both what was adopted and its name.
        enough: |line| line.contains("adopted") && line.contains("Biscuit"),
        score: |item| if item.contains("Biscuit") { 1.0 } else { 0.4 },
        calls: 0,
    };
    let options = LoopOptions {
        reshape_below: 5,
        ..OPTIONS
    };
    let outcome = run(&graph, &stage1, &mut verifier, &options, &embedder);
    assert_eq!(outcome.rounds[0].attribution, "granularity");
    assert!(outcome.sufficient);
    let new = outcome
        .delta
        .nodes
        .values()
        .next()
        .expect("a reshaped node");
    assert_eq!(outcome.delta.nodes.len(), 1);
    assert_eq!(new.text, format!("{} / {}", TURNS[1], TURNS[2]));
    assert_eq!(new.metadata["reshaped_from"], Value::from(ids[2].as_str()));
    assert_eq!(
        new.metadata["covers"],
        serde_json::json!([ids[1].as_str(), ids[2].as_str()])
    );
    // In the context in place of the old node, re-embedded with the store's model.
    assert_eq!(context_ids(&outcome)[0], new.id);
    let embedding = &outcome.delta.embeddings[&(new.id.clone(), embedder.model_id().to_string())];
    assert_eq!(
        embedding.vector,
        embedder.embed(&[new.embedding_text().as_str()]).unwrap()[0]
    );
    // It keeps the old node's edges, and the old node points to it.
    let copied = outcome
        .delta
        .edges
        .values()
        .find(|e| e.src == new.id && e.dst == episode)
        .expect("copied ground edge");
    assert_eq!((copied.kind, copied.weight), (EdgeKind::Ground, 0.7));
    let into = outcome
        .delta
        .edges
        .values()
        .find(|e| e.src == ids[2] && e.dst == new.id)
        .expect("reshaped_into link");
    assert_eq!(relation(into), Some("reshaped_into"));
    assert!(outcome
        .delta
        .edits
        .iter()
        .any(|e| e.kind == "node_reshape" && e.target == format!("node:{}", new.id)));
}

#[test]
fn a_failed_loop_keeps_nothing_and_stops_after_t_rounds() {
    let embedder = HashEmbedder::new(32);
    let (graph, ids) = graph(&embedder);
    let stage1 = ranking(&[
        &ids[1], &ids[3], &ids[4], &ids[5], &ids[6], &ids[0], &ids[2],
    ]);
    let mut verifier = Scripted {
        enough: |_| false,
        score: |_| 0.9,
        calls: 0,
    };
    let mut rising = Rising {
        inner: Scripted {
            enough: |_| false,
            score: |_| 0.9,
            calls: 0,
        },
        verified: 0,
    };
    let outcome = run_with(&graph, &stage1, &mut rising, &OPTIONS, &embedder);
    assert!(!outcome.sufficient);
    assert_eq!(
        outcome.rounds.len(),
        OPTIONS.rounds + 1,
        "T edits, each raising the score, T + 1 verifications"
    );
    assert!(outcome.rounds.iter().all(|r| !r.undone));
    assert!(!outcome.attempted.is_empty());
    assert!(
        outcome.delta.is_empty(),
        "edits of a failed loop do not persist"
    );
    // An edit after which the verifier scores the context no higher is undone, and the loop
    // stops on the context before it.
    let flat = run(&graph, &stage1, &mut verifier, &OPTIONS, &embedder);
    assert_eq!(flat.rounds.len(), 2, "{:?}", flat.rounds);
    assert!(flat.rounds[0].edit.is_some() && flat.rounds[0].undone);
    assert_eq!(flat.rounds[1].attribution, "no gain");
    assert_eq!(flat.rounds[1].context, flat.rounds[0].context);
    assert_eq!(context_ids(&flat), flat.rounds[0].context);
    assert!(flat.delta.is_empty());
    // T = 0 is Stage I: one verification, no edit.
    let zero = run(
        &graph,
        &stage1,
        &mut verifier,
        &LoopOptions {
            rounds: 0,
            ..OPTIONS
        },
        &embedder,
    );
    assert_eq!(zero.rounds.len(), 1);
    assert_eq!(
        context_ids(&zero),
        vec![ids[1].clone(), ids[3].clone(), ids[4].clone()]
    );
    // The stopping score can be set: at 0 the first context (scored 0) is sufficient.
    let at_zero = run(
        &graph,
        &stage1,
        &mut verifier,
        &LoopOptions {
            sufficient_at: Some(0.0),
            ..OPTIONS
        },
        &embedder,
    );
    assert!(at_zero.sufficient && at_zero.rounds.len() == 1 && at_zero.attempted.is_empty());
    // Every round carries its context.
    assert_eq!(outcome.rounds[0].context, context_ids(&zero));
    assert_eq!(
        outcome.rounds.last().unwrap().context,
        context_ids(&outcome)
    );
}

#[test]
fn edit_log_round_trips_through_the_store_and_undo_lifts_the_prune() {
    let embedder = HashEmbedder::new(32);
    let (graph, ids) = graph(&embedder);
    let stage1 = ranking(&[
        &ids[1], &ids[3], &ids[4], &ids[2], &ids[5], &ids[6], &ids[0],
    ]);
    let mut verifier = Scripted {
        enough: |line| line.contains("Biscuit"),
        score: |item| {
            if item.contains("weather") || item.contains("train") {
                0.0
            } else {
                0.9
            }
        },
        calls: 0,
    };
    let outcome = run(&graph, &stage1, &mut verifier, &OPTIONS, &embedder);
    let dir = tempfile::tempdir().unwrap();
    let mut writer = Writer::open(dir.path().join("store")).unwrap();
    let info = |stage: &str| CommitInfo {
        stage: stage.into(),
        run_id: "r".into(),
        summary: Value::Null,
        progress: Default::default(),
    };
    writer.commit(&graph, info("ingest")).unwrap();
    writer.commit(&outcome.delta, info("refine")).unwrap();
    let stored = writer.store().load().unwrap();
    assert_eq!(
        stored.edits, outcome.delta.edits,
        "the edit log round-trips"
    );
    assert!(stored
        .edits
        .iter()
        .all(|e| e.run_id == "run-1" && e.stage == "refine"));

    // Undo every edit, newest first, and commit the undo.
    let mut undo = Graph::default();
    for edit in stored.edits.iter().rev() {
        undo.apply(edit.undo().unwrap());
    }
    writer.commit(&undo, info("undo")).unwrap();
    let undone = writer.store().load().unwrap();
    let back = run(
        &undone,
        &stage1,
        &mut verifier,
        &LoopOptions {
            rounds: 0,
            ..OPTIONS
        },
        &embedder,
    );
    assert_eq!(
        context_ids(&back),
        vec![ids[1].clone(), ids[3].clone(), ids[4].clone()],
        "the prune is lifted"
    );
    assert!(
        undone.edges.values().all(|e| !e.active),
        "the links the edits made are inactive"
    );
}

#[test]
fn node_merge_makes_one_summary_of_two_redundant_items_and_frees_their_budget() {
    let embedder = HashEmbedder::new(64);
    let (mut graph, ids) = graph(&embedder);
    // A second, longer telling of the adoption, in another session: redundant with ids[1].
    let text = "Alice: I adopted a puppy from the shelter. It was a rainy day in May.";
    let body = NodeBody::Semantic(Semantic {
        source: "conv".into(),
        position: 9,
        time: None,
        group: Some("session_3".into()),
    });
    let dup = Node::new(body, "t", text, &["conv", "9"]);
    let vector = embedder.embed(&[text]).unwrap().remove(0);
    graph.upsert_embedding(Embedding {
        node_id: dup.id.clone(),
        model_id: embedder.model_id().into(),
        text_sha256: String::new(),
        vector,
    });
    let dup_id = dup.id.clone();
    graph.insert_node(dup);
    let episode = NodeId::from("epi-1");
    graph.upsert_edge(ground(&dup_id, &episode));
    let vectors = embedder.embed(&[TURNS[1], text]).unwrap();
    let cosine = fluxmem_models::cosine(&vectors[0], &vectors[1]);
    assert!(
        cosine >= 0.7,
        "the premise: the two tellings are close ({cosine})"
    );
    // Round 0 under 30 words: puppy (7), the long telling (15 + 1), then only the short turns fit.
    let stage1 = ranking(&[
        &ids[1], &dup_id, &ids[5], &ids[4], &ids[6], &ids[0], &ids[2], &ids[3],
    ]);
    let score: fn(&str) -> f32 = |item| {
        if item.contains("puppy") || item.contains("yellow") {
            1.0
        } else {
            0.4
        }
    };
    let mut verifier = Scripted {
        enough: |line| line.contains("yellow"),
        score,
        calls: 0,
    };
    let options = LoopOptions {
        merge_above: 0.7,
        ..OPTIONS
    };
    let outcome = run(&graph, &stage1, &mut verifier, &options, &embedder);
    let attributions: Vec<&str> = outcome
        .rounds
        .iter()
        .map(|r| r.attribution.as_str())
        .collect();
    assert_eq!(attributions, ["redundancy", "sufficient"]);
    assert_eq!(outcome.rounds[0].edit.as_deref(), Some("node_merge"));
    assert!(outcome.sufficient);
    let merged = outcome.delta.nodes.values().next().expect("a merged node");
    assert_eq!(outcome.delta.nodes.len(), 1);
    // The first text, then only what the second adds.
    assert_eq!(
        merged.text,
        format!("{} / It was a rainy day in May.", TURNS[1])
    );
    assert_eq!(merged.metadata["reshape"], Value::from("coarser"));
    assert_eq!(
        merged.metadata["merged_from"],
        serde_json::json!([ids[1].as_str(), dup_id.as_str()])
    );
    assert_eq!(
        merged.metadata["covers"],
        serde_json::json!([ids[1].as_str(), dup_id.as_str()])
    );
    // Shown once, in the better original's place; the budget the other held brought in the
    // item the verifier wanted.
    assert_eq!(
        context_ids(&outcome)[..2],
        [merged.id.clone(), ids[5].clone()]
    );
    assert!(!context_ids(&outcome).contains(&ids[1]) && !context_ids(&outcome).contains(&dup_id));
    // It keeps the originals' edges and both originals point to it; it is re-embedded.
    let copied = outcome
        .delta
        .edges
        .values()
        .find(|e| e.src == merged.id && e.dst == episode)
        .expect("copied ground edge");
    assert_eq!((copied.kind, copied.weight), (EdgeKind::Ground, 0.7));
    for original in [&ids[1], &dup_id] {
        let into = outcome
            .delta
            .edges
            .values()
            .find(|e| &e.src == original && e.dst == merged.id)
            .expect("reshaped_into link");
        assert_eq!(relation(into), Some("reshaped_into"));
    }
    assert!(outcome
        .delta
        .embeddings
        .contains_key(&(merged.id.clone(), embedder.model_id().to_string())));
    assert!(outcome
        .delta
        .edits
        .iter()
        .any(|e| e.kind == "node_merge" && e.target == format!("node:{}", merged.id)));
    // With merging off the same context goes to expansion instead.
    let off = run(&graph, &stage1, &mut verifier, &OPTIONS, &embedder);
    assert_ne!(off.rounds[0].attribution, "redundancy");
    assert!(off.delta.nodes.is_empty());
}
