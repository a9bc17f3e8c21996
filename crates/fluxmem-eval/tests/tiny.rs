//! The LoCoMo harness on a tiny hand-made conversation whose answers are known, with the
//! weight-free hashing embedder.

use candle_core::Device;
use fluxmem_eval::locomo::{evaluate, LocomoOptions, SERVED};
use fluxmem_models::HashEmbedder;

const DATA: &str = r#"[{"sample_id": "tiny",
 "conversation": {"speaker_a": "Alice", "speaker_b": "Bob",
   "session_1_date_time": "1:00 pm on 1 May, 2023",
   "session_1": [
     {"speaker": "Alice", "dia_id": "D1:1", "text": "I adopted a puppy from the shelter last week"},
     {"speaker": "Bob", "dia_id": "D1:2", "text": "Congratulations, what breed is it"},
     {"speaker": "Alice", "dia_id": "D1:3", "text": "A beagle named Biscuit"}],
   "session_2_date_time": "2:00 pm on 9 May, 2023",
   "session_2": [
     {"speaker": "Bob", "dia_id": "D2:1", "text": "I started learning the violin"},
     {"speaker": "Alice", "dia_id": "D2:2", "text": "Biscuit chewed my violin case"}]},
 "qa": [
   {"question": "Where did Alice adopt the puppy?", "answer": "shelter", "evidence": ["D1:1"], "category": 4},
   {"question": "What instrument is Bob learning?", "answer": "violin", "evidence": ["D2:1"], "category": 4},
   {"question": "What is the beagle called and what did it chew?", "answer": "Biscuit, a violin case", "evidence": ["D1:3", "D2:02"], "category": 1},
   {"question": "Unanswerable", "answer": "x", "evidence": ["D9:9"], "category": 2},
   {"question": "Adversarial", "adversarial_answer": "x", "evidence": ["D1:1"], "category": 5}]}]"#;

fn run(budgets: Vec<usize>) -> fluxmem_eval::locomo::LocomoReport {
    run_on(
        DATA,
        LocomoOptions {
            budgets,
            ..LocomoOptions::default()
        },
    )
}

fn run_on(data: &str, options: LocomoOptions) -> fluxmem_eval::locomo::LocomoReport {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.json");
    std::fs::write(&path, data).unwrap();
    evaluate(
        &path,
        &options,
        &HashEmbedder::new(64),
        None,
        None,
        &Device::Cpu,
        &mut |_, _| {},
    )
    .unwrap()
}

/// The retrieval path never reads answers or evidence: with every answer and evidence id
/// changed, every system (Stage II included, whose loop edits the graph) retrieves exactly the
/// same items for every question; only the scores move.
#[test]
fn retrieval_never_reads_answers_or_evidence() {
    let poisoned = DATA
        .replace(
            r#""answer": "shelter""#,
            r#""answer": "D2:1 violin case Biscuit""#,
        )
        .replace(
            r#""answer": "violin""#,
            r#""answer": "puppy shelter adopted""#,
        )
        .replace(
            r#""evidence": ["D1:1"], "category": 4"#,
            r#""evidence": ["D2:2"], "category": 4"#,
        )
        .replace(r#""evidence": ["D2:1"]"#, r#""evidence": ["D1:2"]"#)
        .replace(
            r#""evidence": ["D1:3", "D2:02"]"#,
            r#""evidence": ["D1:1"]"#,
        );
    assert_ne!(poisoned, DATA);
    let options = || LocomoOptions {
        budgets: vec![16, 64],
        refine: fluxmem_refine::LoopOptions {
            rounds: 3,
            budget: 16,
            ..Default::default()
        },
        ..LocomoOptions::default()
    };
    let clean = run_on(DATA, options());
    let dirty = run_on(&poisoned, options());
    // Four questions: retrieval runs before the gold is read, so the one without resolvable
    // evidence is retrieved for too (and then left out of the scores).
    assert_eq!(
        clean.refine.questions, 4,
        "the Stage II loop ran on every question"
    );
    assert!(clean.refine.verifier_calls > 0);
    assert_eq!(
        clean.fingerprint, dirty.fingerprint,
        "rankings and edits are independent of the gold data"
    );
    let scores =
        |r: &fluxmem_eval::locomo::LocomoReport| serde_json::to_string(&r.systems).unwrap();
    assert_ne!(
        scores(&clean),
        scores(&dirty),
        "the scores do read the gold data"
    );
    // And the fingerprint does see retrieval: other fusion weights change it.
    let mut reweighted = options();
    reweighted.retrieval.weights = fluxmem_connect::FusionWeights {
        dense: 0.0,
        bm25: 1.0,
        judge: 0.0,
    };
    assert_ne!(run_on(DATA, reweighted).fingerprint, clean.fingerprint);
}

#[test]
fn known_answers_give_known_recall() {
    let report = run(vec![4, 1000]);
    // Category 5 is excluded by default; the D9:9 question has no resolvable evidence.
    assert_eq!(report.questions, 3);
    assert_eq!(report.evidence.questions_without_evidence, 1);
    assert_eq!(report.evidence.unresolved, vec!["D9:9".to_string()]);
    assert_eq!(report.evidence.normalized, 1, "D2:02 normalises to D2:2");
    let bm25 = &report.systems["bm25"].overall;
    // BM25 ranks only turns sharing a term with the question: "chewed" is not "chew" (no
    // stemming), so the multi-hop question finds 1 of its 2 turns: (1 + 1 + 0.5) / 3.
    assert!((bm25.recall_at_k["recall@5"] - 2.5 / 3.0).abs() < 1e-9);
    // Dense and hybrid rank all 5 turns, so recall@5 is complete.
    assert_eq!(
        report.systems["hybrid"].overall.recall_at_k["recall@5"],
        1.0
    );
    // A 4-token budget holds no line (the shortest line is 5 words with its time stamp).
    assert_eq!(bm25.recall_at_budget["4"], 0.0);
    assert_eq!(bm25.context_tokens["4"], 0.0);
    // A 1000-token budget holds the whole conversation for the systems that rank every turn.
    for system in ["dense", "hybrid", "fluxmem"] {
        assert_eq!(
            report.systems[system].overall.recall_at_budget["1000"], 1.0,
            "{system}"
        );
    }
    // BM25 ranks only turns sharing a term with the question: "chewed" is not "chew" (no
    // stemming), so the multi-hop question finds 1 of its 2 turns: (1 + 1 + 0.5) / 3.
    assert!((report.systems["bm25"].overall.recall_at_budget["1000"] - 2.5 / 3.0).abs() < 1e-9);
    let by_category = &report.systems["bm25"].by_category;
    assert_eq!(by_category["4"].questions, 2);
    assert_eq!(by_category["1"].questions, 1);
    assert!(!by_category.contains_key("5"));
    assert!(report.conversation_tokens["tiny"] > 20);
}

#[test]
fn bm25_ranks_the_single_hop_evidence_first() {
    let report = run(vec![20]);
    let single_hop = &report.systems["bm25"].by_category["4"];
    assert_eq!(single_hop.recall_at_k["recall@5"], 1.0);
    // With 20 tokens (the hashing embedder counts words), the first-ranked line fits (17 and 13
    // words with the time stamp): both single-hop answers are in their contexts.
    assert_eq!(single_hop.recall_at_budget["20"], 1.0);
}

#[test]
fn evaluation_is_deterministic() {
    let a = serde_json::to_string(&run(vec![8, 32])).unwrap();
    let b = serde_json::to_string(&run(vec![8, 32])).unwrap();
    assert_eq!(a, b);
}

/// Without units with context and without structure (adjacency, entities) the `fluxmem` system
/// is plain `hybrid`, score for score; with them (the defaults) its rankings move and the baselines' do not.
#[test]
fn the_fluxmem_system_is_hybrid_with_units_and_structure() {
    let plain = || LocomoOptions {
        budgets: vec![8, 1000],
        retrieval: fluxmem_connect::RetrievalConfig::default(),
        ..LocomoOptions::default()
    };
    let report = run_on(DATA, plain());
    let json = |r: &fluxmem_eval::locomo::LocomoReport, system: &str| {
        serde_json::to_string(&r.systems[system]).unwrap()
    };
    assert_eq!(json(&report, "fluxmem"), json(&report, "hybrid"));
    let structured = run_on(
        DATA,
        LocomoOptions {
            budgets: vec![8, 1000],
            ..LocomoOptions::default()
        },
    );
    assert_ne!(
        structured.fingerprint, report.fingerprint,
        "units and structure change the fluxmem rankings"
    );
    for system in ["bm25", "dense", "hybrid"] {
        assert_eq!(
            json(&structured, system),
            json(&report, system),
            "{system} is a baseline: it does not change"
        );
    }
    // Each part alone changes the rankings too.
    let mut adjacency_only = plain();
    adjacency_only.retrieval.adjacency = fluxmem_connect::DEFAULT_ADJACENCY;
    assert_ne!(run_on(DATA, adjacency_only).fingerprint, report.fingerprint);
    let mut units_only = plain();
    units_only.retrieval.units = fluxmem_connect::Units::CONTEXT;
    assert_ne!(run_on(DATA, units_only).fingerprint, report.fingerprint);
    // Entities: the questions name Alice and Bob, speakers of the turns.
    let mut entity_only = plain();
    entity_only.retrieval.entity = fluxmem_connect::DEFAULT_ENTITY;
    assert_ne!(run_on(DATA, entity_only).fingerprint, report.fingerprint);
}

/// Answered through the store a night built (`--through-graph`), every question ranks as the
/// `fluxmem` system ranks it in memory, score for score; the other systems do not change. With
/// Stage II, the served loop runs on what each query read from the store.
#[test]
fn the_store_a_night_built_serves_the_rankings_the_evaluation_measures() {
    let options = |through_graph, rounds, budget| LocomoOptions {
        budgets: vec![16, 1000],
        through_graph,
        refine: fluxmem_refine::LoopOptions {
            rounds,
            budget,
            ..Default::default()
        },
        ..LocomoOptions::default()
    };
    let json = |r: &fluxmem_eval::locomo::LocomoReport, system: &str| {
        serde_json::to_string(&r.systems[system]).unwrap()
    };
    let memory = run_on(DATA, options(false, 0, 16));
    let served = run_on(DATA, options(true, 0, 16));
    assert!(!memory.systems.contains_key(SERVED));
    assert_eq!(json(&served, SERVED), json(&served, "fluxmem"));
    for system in ["bm25", "dense", "hybrid", "fluxmem"] {
        assert_eq!(json(&served, system), json(&memory, system), "{system}");
    }
    let night = served.served.as_ref().expect("a served summary");
    // Retrieval runs before the gold is read: the question without evidence is answered too.
    assert_eq!(night.questions, 4);
    assert_eq!(night.rankings_differ, 0);
    assert_eq!(night.connected, 0, "LoCoMo turns are facts, not runs");

    // Stage II through the store: each served loop reads the store at one version and runs on
    // what it read; nothing else writes the store, so no commit is refused. (On this data the
    // default verifier keeps no edit, so no commit is made here: `eval locomo --through-graph
    // --refine-rounds 5` on dev commits 6, docs/locomo.md; `serve::commit_at` has its own test.)
    let refined = run_on(DATA, options(true, 3, 16));
    let night = refined.served.as_ref().unwrap();
    assert_eq!(night.questions, 4);
    assert_eq!(night.commits_refused, 0);
    assert_eq!(
        night.edits_committed, refined.refine.edits_persisted,
        "as many edits kept through the store as in memory"
    );
    assert_eq!(
        json(&refined, SERVED),
        json(&refined, "fluxmem"),
        "the loops ran on the same graph"
    );
    let again = run_on(DATA, options(true, 3, 16));
    assert_eq!(again.fingerprint, refined.fingerprint, "deterministic");
}
