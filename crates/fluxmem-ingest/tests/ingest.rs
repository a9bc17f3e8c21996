//! Ingestion end to end into a real store: malformed corpus, shared dev data counts,
//! idempotent re-ingest.

use fluxmem_graph::{NodeBody, NodeKind};
use fluxmem_ingest::{ingest, IngestOptions, IngestReport, NoProgress, Rejected};
use fluxmem_store::Writer;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn shared_data() -> PathBuf {
    let dir = repo().join("../shared/data");
    assert!(dir.is_dir(), "the dev data is expected at {} (the project's shared/ folder beside the repo)", dir.display());
    dir
}

fn run(store: &Path, inputs: &[PathBuf], options: &IngestOptions) -> IngestReport {
    let mut writer = Writer::open(store).unwrap();
    let report = ingest(&mut writer, inputs, options, "test-run", &mut NoProgress).unwrap();
    assert_eq!(report.read, report.ingested + report.duplicates + report.quarantined, "counts reconcile: {report:?}");
    report
}

fn quarantined(report: &IngestReport) -> Vec<Value> {
    let Some(path) = &report.quarantine_file else { return Vec::new() };
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn malformed_corpus_is_quarantined_with_file_line_field_and_reason() {
    let store = tempfile::tempdir().unwrap();
    let corpus = repo().join("tests/data/malformed");
    let report = run(store.path(), &[corpus.clone()], &IngestOptions::default());
    let expected: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(corpus.join("expected.json")).unwrap()).unwrap();
    let mut got = quarantined(&report);
    // expected.json is not an input format we detect by content: it is quarantined too.
    got.retain(|q| !q["file"].as_str().unwrap().ends_with("expected.json"));
    assert_eq!(got.len(), expected.len(), "quarantined: {got:#?}");
    for (got, want) in got.iter().zip(&expected) {
        let file = got["file"].as_str().unwrap();
        assert!(file.ends_with(want["file"].as_str().unwrap()), "{got} vs {want}");
        assert_eq!(got["line"], want["line"], "line of {got}");
        assert_eq!(got["field"], want["field"], "field of {got}");
        let reason = got["reason"].as_str().unwrap();
        assert!(reason.contains(want["reason"].as_str().unwrap()), "reason `{reason}` for {want}");
    }
    // The invalid UTF-8 line is kept byte for byte.
    let utf8 = got.iter().find(|q| q["file"].as_str().unwrap().ends_with("utf8.jsonl")).unwrap();
    assert!(utf8["raw_hex"].as_str().unwrap().contains("fffe"), "{utf8}");
    assert_eq!(report.quarantined as usize, expected.len() + 1);
    assert_eq!(report.ingested, 7, "{report:?}");
    let graph = fluxmem_store::Store::open(store.path()).unwrap().load().unwrap();
    assert!(graph.nodes.values().all(|n| !n.text.contains("never ingested")), "QA items are not memory");
    let tau = graph.nodes.values().find(|n| n.kind() == NodeKind::Episodic && n.text == "hi").expect("tau episode");
    let episode = tau.episode().unwrap();
    assert_eq!(episode.steps[0].tool_calls[0].result.as_deref(), Some("Error: nothing"));
    assert_eq!(episode.steps[0].feedback.as_deref(), Some("Error: nothing"), "tool errors are step feedback");
    assert!(!serde_json::to_string(&tau.metadata).unwrap().contains("hidden"), "gold task info is not stored");
    assert_eq!(tau.metadata["omitted_fields"], serde_json::json!(["info.task"]));
}

#[test]
fn directory_walk_survives_symlink_loops_and_reports_them() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("logs");
    std::fs::create_dir(&input).unwrap();
    std::fs::write(input.join("a.jsonl"), "{\"task\":\"one\"}\n").unwrap();
    std::os::unix::fs::symlink(&input, input.join("loop")).unwrap();
    let report = run(&dir.path().join("store"), &[input], &IngestOptions::default());
    assert_eq!((report.ingested, report.quarantined), (1, 1));
    let rejected = quarantined(&report);
    assert!(rejected[0]["file"].as_str().unwrap().ends_with("loop"));
    assert!(rejected[0]["reason"].as_str().unwrap().contains("not a regular file"));
}

#[test]
fn oversize_records_are_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("big.jsonl");
    let big = format!("{{\"task\":\"{}\"}}\n{{\"task\":\"small\"}}\n", "x".repeat(5000));
    std::fs::write(&input, big).unwrap();
    let options = IngestOptions { max_record_bytes: 1000, ..IngestOptions::default() };
    let report = run(&dir.path().join("store"), &[input], &options);
    assert_eq!((report.read, report.ingested, report.quarantined), (2, 1, 1));
    let rejected: Rejected = serde_json::from_value::<Value>(quarantined(&report)[0].clone())
        .map(|v| Rejected::new(v["file"].as_str().unwrap(), v["line"].as_u64().unwrap() as usize, "", v["reason"].as_str().unwrap(), v["raw"].as_str().unwrap().as_bytes(), usize::MAX))
        .unwrap();
    assert!(rejected.reason.contains("over the limit of 1000"), "{}", rejected.reason);
    assert_eq!(rejected.raw.len(), 1000, "raw is capped at the limit");
}

#[test]
fn shared_dev_data_gives_the_expected_counts_and_reingest_adds_nothing() {
    let data = shared_data();
    let store = tempfile::tempdir().unwrap();
    let inputs = vec![
        data.join("locomo/locomo10_dev.json"),
        data.join("tau-bench/gpt-4o-airline_dev.json"),
        data.join("alfworld/alfworld_3prompts_dev.json"),
    ];
    let report = run(store.path(), &inputs, &IngestOptions::default());
    assert_eq!(report.quarantined, 0);
    assert_eq!(report.ingested, 1763 + 84 + 24, "{report:?}");
    let graph = fluxmem_store::Store::open(store.path()).unwrap().load().unwrap();
    let count = |kind: NodeKind, source_prefix: &str| {
        graph.nodes.values().filter(|n| n.kind() == kind && n.source_file.contains(source_prefix)).count()
    };
    assert_eq!(count(NodeKind::Semantic, "locomo"), 1763, "every LoCoMo turn is a node");
    assert_eq!(count(NodeKind::Episodic, "tau-bench"), 84);
    assert_eq!(count(NodeKind::Episodic, "alfworld"), 24);
    let policy_chunks = count(NodeKind::Semantic, "tau-bench");
    assert!(policy_chunks > 5, "the airline policy is chunked into semantic nodes ({policy_chunks})");
    let successes = graph.nodes.values().filter_map(|n| n.episode()).filter(|e| e.outcome.success == Some(true)).count();
    assert_eq!(successes, 35 + 24, "35 tau-bench runs have reward 1, ALFWorld demos succeed");
    // A LoCoMo turn keeps its dia_id, session and time.
    let turn = graph.nodes.values().find(|n| n.source_locator == "conv-26/D1:1").expect("conv-26 D1:1");
    match &turn.body {
        NodeBody::Semantic(s) => {
            assert_eq!(s.group.as_deref(), Some("session_1"));
            assert_eq!(s.time.as_deref(), Some("1:56 pm on 8 May, 2023"));
        }
        other => panic!("{other:?}"),
    }
    assert!(turn.text.starts_with("Caroline: "));
    assert_eq!(turn.metadata["dia_id"], "D1:1");

    let before = fluxmem_store::Store::open(store.path()).unwrap().manifest().unwrap();
    let again = run(store.path(), &inputs, &IngestOptions::default());
    assert_eq!((again.ingested, again.duplicates, again.nodes_added), (0, 1871, 0));
    let after = fluxmem_store::Store::open(store.path()).unwrap().manifest().unwrap();
    assert_eq!(after.version, before.version, "re-ingesting commits nothing");
}

#[test]
fn jsonl_sample_keeps_unknown_fields_and_tenants() {
    let store = tempfile::tempdir().unwrap();
    let report = run(store.path(), &[repo().join("data/trajectories.jsonl")], &IngestOptions::default());
    assert_eq!((report.read, report.ingested, report.quarantined), (9, 9, 0));
    let graph = fluxmem_store::Store::open(store.path()).unwrap().load().unwrap();
    let tenants: std::collections::BTreeSet<&str> = graph.nodes.values().map(|n| n.tenant.as_str()).collect();
    assert_eq!(tenants, ["acme", "globex"].into_iter().collect());
    let failed = graph.nodes.values().find(|n| n.metadata.get("episode_id") == Some(&Value::from("run-0002"))).unwrap();
    let episode = failed.episode().unwrap();
    assert_eq!(episode.outcome.success, Some(false));
    assert_eq!(episode.steps[1].tool_calls[0].result.as_deref(), Some("Error: refund window (30 days) has passed"));
    assert_eq!(failed.agent_id.as_deref(), Some("support-bot-2"));
    assert_eq!(failed.created_at, Some(1_795_860_720_000), "started_at 2026-11-28T10:12:00Z");
}
