//! Ingestion end to end into a real store: malformed corpus, dev data counts (`dev_data_*`, needs ../shared/data),
//! idempotent re-ingest.

use fluxmem_graph::{NodeBody, NodeKind};
use fluxmem_ingest::{ingest, Format, IngestOptions, IngestReport, NoProgress, Rejected};
use fluxmem_store::Writer;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The dev data (`FLUXMEM_DEV_DATA`, default the project's `shared/data` beside the repo). Only
/// tests named `dev_data_*` use it; `scripts/test.sh` leaves them out, saying so, where it is
/// missing. Run directly without it, such a test fails with this message rather than passing.
fn dev_data() -> PathBuf {
    let dir = std::env::var_os("FLUXMEM_DEV_DATA").map(PathBuf::from).unwrap_or_else(|| repo().join("../shared/data"));
    assert!(
        dir.is_dir(),
        "the dev data is expected at {} (the project's shared/ folder beside the repo, or FLUXMEM_DEV_DATA); \
         without it run `cargo test -- --skip dev_data_` (scripts/test.sh does)",
        dir.display()
    );
    dir
}

fn run(store: &Path, inputs: &[PathBuf], options: &IngestOptions) -> IngestReport {
    run_as(store, inputs, options, "test-run")
}

fn run_as(store: &Path, inputs: &[PathBuf], options: &IngestOptions, run_id: &str) -> IngestReport {
    let mut writer = Writer::open(store).unwrap();
    let report = ingest(&mut writer, inputs, options, run_id, &mut NoProgress).unwrap();
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
fn dev_data_gives_the_expected_counts_and_reingest_adds_nothing() {
    let data = dev_data();
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

/// The texts of the nodes in the store at `store`, sorted.
fn texts(store: &Path) -> Vec<String> {
    let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
    let mut texts: Vec<String> = graph.nodes.values().map(|n| n.text.clone()).collect();
    texts.sort();
    texts
}

/// The last path component of each skipped entry, in report order.
fn skipped_names(report: &IngestReport) -> Vec<String> {
    report.skipped.iter().map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned()).collect()
}

#[test]
fn trailing_content_after_the_json_value_of_a_line_is_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("t.jsonl");
    std::fs::write(&input, "{\"task\":\"a\"} {\"task\":\"b\"}\n{\"task\":\"x\"} garbage\n{\"task\":\"fine\"}  \t\n").unwrap();
    let report = run(&dir.path().join("store"), &[input], &IngestOptions::default());
    assert_eq!((report.read, report.ingested, report.quarantined), (3, 1, 2), "{report:?}");
    let rejected = quarantined(&report);
    for (entry, line) in rejected.iter().zip([1, 2]) {
        assert!(entry["file"].as_str().unwrap().ends_with("t.jsonl"), "{entry}");
        assert_eq!(entry["line"], line, "{entry}");
        let reason = entry["reason"].as_str().unwrap();
        assert!(reason.contains("trailing content after the JSON value at column 14"), "{reason}");
    }
    assert_eq!(texts(&dir.path().join("store")), ["fine"]);
}

#[test]
fn whole_file_formats_refuse_trailing_content_too() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("alf.json");
    let transcript = "You are in a room.\\nYour task is to: put a mug in the sink.\\n> go to sink 1\\nOK.";
    std::fs::write(&input, format!("{{\"react_put_1\": \"{transcript}\"}}\n{{\"react_put_2\": \"{transcript}\"}}\n")).unwrap();
    let options = IngestOptions { format: Some(Format::Alfworld), ..IngestOptions::default() };
    let report = run(&dir.path().join("store"), &[input], &options);
    assert_eq!((report.ingested, report.quarantined), (0, 1), "{report:?}");
    let reason = quarantined(&report)[0]["reason"].as_str().unwrap().to_string();
    assert!(reason.contains("trailing content after the JSON value at column 1 of line 2"), "{reason}");
}

#[test]
fn cr_only_line_endings_are_read_as_lines() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("mac.jsonl");
    std::fs::write(&input, "{\"task\":\"one\"}\r{\"task\": 42}\r{\"task\":\"three\"}\r").unwrap();
    let report = run(&dir.path().join("store"), &[input], &IngestOptions::default());
    assert_eq!((report.read, report.ingested, report.quarantined), (3, 2, 1), "{report:?}");
    let rejected = quarantined(&report);
    assert_eq!(rejected[0]["line"], 2, "{rejected:?}");
    assert_eq!(rejected[0]["field"], "task");
    assert_eq!(texts(&dir.path().join("store")), ["one", "three"]);
}

#[test]
fn mixed_line_endings_keep_their_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("mixed.jsonl");
    std::fs::write(&input, "{\"task\":\"lf\"}\n{\"task\":\"crlf\"}\r\n{\"task\":\"cr\"}\r\r\n{\"task\": 5}\n").unwrap();
    let report = run(&dir.path().join("store"), &[input], &IngestOptions::default());
    assert_eq!((report.read, report.ingested, report.quarantined), (4, 3, 1), "{report:?}");
    assert_eq!(quarantined(&report)[0]["line"], 5, "line 4 is the blank line between `\\r` and `\\r\\n`");
}

#[test]
fn walking_next_to_the_store_skips_it_and_the_quarantine_does_not_grow() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().to_path_buf();
    std::fs::write(input.join("a.jsonl"), "{\"task\":\"one\"}\n{\"task\": 42}\n").unwrap();
    let store = input.join("fluxmem-store");
    let first = run_as(&store, &[input.clone()], &IngestOptions::default(), "first");
    assert_eq!((first.read, first.ingested, first.quarantined), (2, 1, 1), "{first:?}");
    assert_eq!(skipped_names(&first), ["fluxmem-store"]);
    assert!(first.skipped[0].reason.contains("store being written"), "{:?}", first.skipped);
    let second = run_as(&store, &[input.clone()], &IngestOptions::default(), "second");
    assert_eq!((second.read, second.duplicates, second.quarantined), (2, 1, 1), "{second:?}");
    assert_eq!(skipped_names(&second), ["fluxmem-store"]);
    assert_eq!(quarantined(&second).len(), 1, "the first run's quarantine is not re-ingested");
    // An explicit folder inside the store is skipped too.
    let inside = run_as(&store, &[store.join("quarantine")], &IngestOptions::default(), "third");
    assert_eq!((inside.read, skipped_names(&inside)), (0, vec!["quarantine".to_string()]), "{inside:?}");
}

#[test]
fn other_stores_exports_and_run_reports_are_skipped_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    let write = |path: &str, text: &str| {
        let path = input.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("a.jsonl", "{\"task\":\"one\"}\n");
    write("old-store/manifest.json", "{\"format\":\"fluxmem-store\",\"schema_version\":1}");
    write("old-store/x.jsonl", "{\"task\":\"from a store\"}\n");
    write("crashed/LOCK", "");
    write("crashed/shards/y.jsonl", "{\"task\":\"from a crashed store\"}\n");
    write("out/skills/release.json", "{\"format\":\"fluxmem-skills\"}");
    write("out/skills/skills.jsonl", "{\"task\":\"exported\"}\n");
    write("out/runs/r1/run.json", "{}");
    write("out/runs/r1/report.html", "<html></html>");
    write("out/runs/r1/z.jsonl", "{\"task\":\"from a report\"}\n");
    write("other/release.jsonl", "{\"task\":\"two\"}\n");
    let report = run(&dir.path().join("store"), &[input.clone()], &IngestOptions::default());
    assert_eq!((report.read, report.ingested, report.quarantined), (2, 2, 0), "{report:?}");
    assert_eq!(skipped_names(&report), ["crashed", "old-store", "r1", "skills"], "{:?}", report.skipped);
    assert_eq!(texts(&dir.path().join("store")), ["one", "two"]);
    // The quarantine/ and staging/ folders of another store, named explicitly.
    write("old-store/quarantine/q.jsonl", "{\"task\":\"quarantined before\"}\n");
    write("old-store/staging/ingest-0-of-2/s.jsonl", "{\"task\":\"staged\"}\n");
    let inputs = [input.join("old-store/quarantine"), input.join("old-store/staging")];
    let again = run(&dir.path().join("store"), &inputs, &IngestOptions::default());
    assert_eq!((again.read, skipped_names(&again)), (0, vec!["quarantine".to_string(), "staging".to_string()]), "{again:?}");
}

#[test]
fn files_inside_a_store_named_explicitly_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let input = dir.path().join("a.jsonl");
    std::fs::write(&input, "{\"task\": 42}\n").unwrap();
    let first = run(&store, &[input], &IngestOptions::default());
    let own = first.quarantine_file.clone().expect("a quarantine file");
    let other = dir.path().join("old-store");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("manifest.json"), "{\"format\":\"fluxmem-store\"}").unwrap();
    std::fs::write(other.join("x.jsonl"), "{\"task\":\"from a store\"}\n").unwrap();
    let report = run_as(&store, &[own, other.join("x.jsonl")], &IngestOptions::default(), "again");
    assert_eq!((report.read, report.ingested, report.quarantined), (2, 0, 2), "{report:?}");
    let rejected = quarantined(&report);
    assert!(rejected[0]["reason"].as_str().unwrap().contains("inside the store being written"), "{rejected:?}");
    assert!(rejected[1]["reason"].as_str().unwrap().contains("inside the fluxmem store"), "{rejected:?}");
}

#[test]
fn timestamps_outside_years_1970_to_9999_are_quarantined_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("times.jsonl");
    let lines = [
        r#"{"task":"max","started_at":9223372036854775807}"#,
        r#"{"task":"negative","started_at":-1}"#,
        r#"{"task":"step","steps":[{"observation":"o","timestamp":253402300800000}]}"#,
        r#"{"task":"year 10000 in UTC","started_at":"9999-12-31T23:59:59-01:00"}"#,
        r#"{"task":"last ms","started_at":253402300799999}"#,
        r#"{"task":"epoch","started_at":0,"steps":[{"timestamp":"2026-01-01T00:00:00Z"}]}"#,
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let report = run(&dir.path().join("store"), &[input], &IngestOptions::default());
    assert_eq!((report.read, report.ingested, report.quarantined), (6, 2, 4), "{report:?}");
    let rejected = quarantined(&report);
    let fields: Vec<&str> = rejected.iter().map(|r| r["field"].as_str().unwrap()).collect();
    assert_eq!(fields, ["started_at", "started_at", "steps[0].timestamp", "started_at"]);
    for entry in &rejected {
        let (field, reason) = (entry["field"].as_str().unwrap(), entry["reason"].as_str().unwrap());
        assert!(reason.contains(&format!("`{field}`")) && reason.contains("outside the years 1970..=9999"), "{reason}");
    }
    assert_eq!(texts(&dir.path().join("store")), ["epoch", "last ms"]);
}

#[test]
fn locomo_session_times_outside_the_calendar_quarantine_their_turns() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("conv.json");
    let conversation = serde_json::json!([{
        "sample_id": "c1",
        "qa": [],
        "conversation": {
            "speaker_a": "A", "speaker_b": "B",
            "session_1_date_time": "1:56 pm on 8 May, 1969",
            "session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "too early"}],
            "session_2_date_time": "1:56 pm on 8 May, 2023",
            "session_2": [{"speaker": "B", "dia_id": "D2:1", "text": "in time"}]
        }
    }]);
    std::fs::write(&input, serde_json::to_string_pretty(&conversation).unwrap()).unwrap();
    let options = IngestOptions { format: Some(Format::Locomo), ..IngestOptions::default() };
    let report = run(&dir.path().join("store"), &[input], &options);
    assert_eq!((report.ingested, report.quarantined), (1, 1), "{report:?}");
    let rejected = quarantined(&report);
    assert_eq!(rejected[0]["field"], "conversation.session_1_date_time", "{rejected:?}");
    assert!(rejected[0]["reason"].as_str().unwrap().contains("outside the years 1970..=9999"), "{rejected:?}");
    assert_eq!(texts(&dir.path().join("store")), ["B: in time"]);
}

#[test]
fn file_symlinks_in_a_walk_are_skipped_and_reported_unless_followed() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("logs");
    std::fs::create_dir(&input).unwrap();
    std::fs::write(input.join("a.jsonl"), "{\"task\":\"inside\"}\n").unwrap();
    let outside = dir.path().join("secret.jsonl");
    std::fs::write(&outside, "{\"task\":\"outside the tree\"}\n").unwrap();
    std::os::unix::fs::symlink(&outside, input.join("link.jsonl")).unwrap();
    let report = run(&dir.path().join("store"), &[input.clone()], &IngestOptions::default());
    assert_eq!((report.read, report.ingested, report.quarantined), (1, 1, 0), "{report:?}");
    assert_eq!(skipped_names(&report), ["link.jsonl"]);
    assert!(report.skipped[0].reason.contains("--follow-symlinks"), "{:?}", report.skipped);
    assert_eq!(texts(&dir.path().join("store")), ["inside"]);
    let options = IngestOptions { follow_symlinks: true, ..IngestOptions::default() };
    let followed = run(&dir.path().join("store2"), &[input], &options);
    assert_eq!((followed.ingested, followed.skipped.len()), (2, 0), "{followed:?}");
}

#[test]
fn a_symlink_named_as_an_input_is_refused_unless_followed() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("secret.jsonl");
    std::fs::write(&target, "{\"task\":\"behind a link\"}\n").unwrap();
    let link = dir.path().join("link.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let report = run(&dir.path().join("store"), &[link.clone()], &IngestOptions::default());
    assert_eq!((report.read, report.ingested, report.quarantined), (1, 0, 1), "{report:?}");
    let reason = quarantined(&report)[0]["reason"].as_str().unwrap().to_string();
    assert!(reason.contains("symbolic link") && reason.contains("pass --follow-symlinks"), "{reason}");
    let options = IngestOptions { follow_symlinks: true, ..IngestOptions::default() };
    let followed = run(&dir.path().join("store2"), &[link], &options);
    assert_eq!((followed.ingested, followed.quarantined), (1, 0), "{followed:?}");
}
