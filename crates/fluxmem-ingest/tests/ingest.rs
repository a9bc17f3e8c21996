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
    let dir = std::env::var_os("FLUXMEM_DEV_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("../shared/data"));
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
    assert_eq!(
        report.read,
        report.ingested + report.duplicates + report.quarantined,
        "counts reconcile: {report:?}"
    );
    report
}

fn quarantined(report: &IngestReport) -> Vec<Value> {
    let Some(path) = &report.quarantine_file else {
        return Vec::new();
    };
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn malformed_corpus_is_quarantined_with_file_line_field_and_reason() {
    let store = tempfile::tempdir().unwrap();
    let corpus = repo().join("tests/data/malformed");
    let report = run(
        store.path(),
        std::slice::from_ref(&corpus),
        &IngestOptions::default(),
    );
    let expected: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(corpus.join("expected.json")).unwrap())
            .unwrap();
    let mut got = quarantined(&report);
    // expected.json is not an input format we detect by content: it is quarantined too.
    got.retain(|q| !q["file"].as_str().unwrap().ends_with("expected.json"));
    assert_eq!(got.len(), expected.len(), "quarantined: {got:#?}");
    for (got, want) in got.iter().zip(&expected) {
        let file = got["file"].as_str().unwrap();
        assert!(
            file.ends_with(want["file"].as_str().unwrap()),
            "{got} vs {want}"
        );
        assert_eq!(got["line"], want["line"], "line of {got}");
        assert_eq!(got["field"], want["field"], "field of {got}");
        let reason = got["reason"].as_str().unwrap();
        assert!(
            reason.contains(want["reason"].as_str().unwrap()),
            "reason `{reason}` for {want}"
        );
    }
    // The invalid UTF-8 line is kept byte for byte.
    let utf8 = got
        .iter()
        .find(|q| q["file"].as_str().unwrap().ends_with("utf8.jsonl"))
        .unwrap();
    assert!(utf8["raw_hex"].as_str().unwrap().contains("fffe"), "{utf8}");
    assert_eq!(report.quarantined as usize, expected.len() + 1);
    assert_eq!(report.ingested, 7, "{report:?}");
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    assert!(
        graph
            .nodes
            .values()
            .all(|n| !n.text.contains("never ingested")),
        "QA items are not memory"
    );
    let tau = graph
        .nodes
        .values()
        .find(|n| n.kind() == NodeKind::Episodic && n.text == "hi")
        .expect("tau episode");
    let episode = tau.episode().unwrap();
    assert_eq!(
        episode.steps[0].tool_calls[0].result.as_deref(),
        Some("Error: nothing")
    );
    assert_eq!(
        episode.steps[0].feedback.as_deref(),
        Some("Error: nothing"),
        "tool errors are step feedback"
    );
    assert!(
        !serde_json::to_string(&tau.metadata)
            .unwrap()
            .contains("hidden"),
        "gold task info is not stored"
    );
    assert_eq!(
        tau.metadata["omitted_fields"],
        serde_json::json!(["info.task"])
    );
}

#[test]
fn directory_walk_survives_symlink_loops_and_reports_them() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("logs");
    std::fs::create_dir(&input).unwrap();
    std::fs::write(input.join("a.jsonl"), "{\"task\":\"one\"}\n").unwrap();
    std::os::unix::fs::symlink(&input, input.join("loop")).unwrap();
    let report = run(
        &dir.path().join("store"),
        &[input],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (1, 1));
    let rejected = quarantined(&report);
    assert!(rejected[0]["file"].as_str().unwrap().ends_with("loop"));
    assert!(rejected[0]["reason"]
        .as_str()
        .unwrap()
        .contains("not a regular file"));
}

#[test]
fn oversize_records_are_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("big.jsonl");
    let big = format!(
        "{{\"task\":\"{}\"}}\n{{\"task\":\"small\"}}\n",
        "x".repeat(5000)
    );
    std::fs::write(&input, big).unwrap();
    let options = IngestOptions {
        max_record_bytes: 1000,
        ..IngestOptions::default()
    };
    let report = run(&dir.path().join("store"), &[input], &options);
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (2, 1, 1)
    );
    let rejected: Rejected = serde_json::from_value::<Value>(quarantined(&report)[0].clone())
        .map(|v| {
            Rejected::new(
                v["file"].as_str().unwrap(),
                v["line"].as_u64().unwrap() as usize,
                "",
                v["reason"].as_str().unwrap(),
                v["raw"].as_str().unwrap().as_bytes(),
                usize::MAX,
            )
        })
        .unwrap();
    assert!(
        rejected.reason.contains("over the limit of 1000"),
        "{}",
        rejected.reason
    );
    assert_eq!(rejected.raw.len(), 1000, "raw is capped at the limit");
}

/// Issue 40.13: a huge bad record keeps a bounded excerpt in the quarantine file, with the
/// whole record's length, hash and offset, so the record is found in its input and the
/// quarantine does not grow as large as the input (or larger, once escaped).
#[test]
fn quarantined_records_keep_a_bounded_excerpt_with_hash_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("logs.jsonl");
    let good = r#"{"task": "t", "steps": [{"observation": "o", "action": "a"}]}"#;
    let bad = format!("{{\"task\": \"{}\"", "\u{0}".repeat(200_000));
    std::fs::write(&input, format!("{good}\n{bad}\n")).unwrap();
    let report = run(
        &dir.path().join("store"),
        std::slice::from_ref(&input),
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (1, 1), "{report:?}");
    let record = &quarantined(&report)[0];
    assert!(
        record["raw"].as_str().unwrap().len() <= fluxmem_ingest::EXCERPT_BYTES,
        "bounded"
    );
    assert_eq!(record["bytes"], bad.len());
    assert_eq!(record["offset"], good.len() + 1);
    assert_eq!(
        record["sha256"].as_str().unwrap(),
        fluxmem_graph::sha256_hex(bad.as_bytes())
    );
    let size = std::fs::metadata(report.quarantine_file.as_ref().unwrap())
        .unwrap()
        .len();
    assert!(
        size < 64 * 1024,
        "quarantine file of {size} bytes for a 200 KB record"
    );
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
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    let count = |kind: NodeKind, source_prefix: &str| {
        graph
            .nodes
            .values()
            .filter(|n| n.kind() == kind && n.source_file.contains(source_prefix))
            .count()
    };
    assert_eq!(
        count(NodeKind::Semantic, "locomo"),
        1763,
        "every LoCoMo turn is a node"
    );
    assert_eq!(count(NodeKind::Episodic, "tau-bench"), 84);
    assert_eq!(count(NodeKind::Episodic, "alfworld"), 24);
    let policy_chunks = count(NodeKind::Semantic, "tau-bench");
    assert!(
        policy_chunks > 5,
        "the airline policy is chunked into semantic nodes ({policy_chunks})"
    );
    let successes = graph
        .nodes
        .values()
        .filter_map(|n| n.episode())
        .filter(|e| e.outcome.success == Some(true))
        .count();
    assert_eq!(
        successes,
        35 + 24,
        "35 tau-bench runs have reward 1, ALFWorld demos succeed"
    );
    // A LoCoMo turn keeps its dia_id, session and time.
    let turn = graph
        .nodes
        .values()
        .find(|n| n.source_locator == "conv-26/D1:1")
        .expect("conv-26 D1:1");
    match &turn.body {
        NodeBody::Semantic(s) => {
            assert_eq!(s.group.as_deref(), Some("session_1"));
            assert_eq!(s.time.as_deref(), Some("1:56 pm on 8 May, 2023"));
        }
        other => panic!("{other:?}"),
    }
    assert!(turn.text.starts_with("Caroline: "));
    assert_eq!(turn.metadata["dia_id"], "D1:1");

    let before = fluxmem_store::Store::open(store.path())
        .unwrap()
        .manifest()
        .unwrap();
    // The ledger knows every file unchanged: none is read again.
    let skipped = run(store.path(), &inputs, &IngestOptions::default());
    assert_eq!(
        (skipped.files, skipped.read, skipped.ingested),
        (0, 0, 0),
        "{skipped:?}"
    );
    assert!(skipped.unchanged_files > 0, "{skipped:?}");
    let again = run(
        store.path(),
        &inputs,
        &IngestOptions {
            reread: true,
            ..Default::default()
        },
    );
    assert_eq!(
        (again.ingested, again.duplicates, again.nodes_added),
        (0, 1871, 0)
    );
    assert_eq!(
        again.files, skipped.unchanged_files,
        "--reread reads every file the ledger skipped"
    );
    let after = fluxmem_store::Store::open(store.path())
        .unwrap()
        .manifest()
        .unwrap();
    assert_eq!(
        after.version, before.version,
        "re-ingesting commits nothing"
    );
}

#[test]
fn jsonl_sample_keeps_unknown_fields_and_tenants() {
    let store = tempfile::tempdir().unwrap();
    let report = run(
        store.path(),
        &[repo().join("data/trajectories.jsonl")],
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (9, 9, 0)
    );
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    let tenants: std::collections::BTreeSet<&str> =
        graph.nodes.values().map(|n| n.tenant.as_str()).collect();
    assert_eq!(tenants, ["acme", "globex"].into_iter().collect());
    let failed = graph
        .nodes
        .values()
        .find(|n| n.metadata.get("episode_id") == Some(&Value::from("run-0002")))
        .unwrap();
    let episode = failed.episode().unwrap();
    assert_eq!(episode.outcome.success, Some(false));
    assert_eq!(
        episode.steps[1].tool_calls[0].result.as_deref(),
        Some("Error: refund window (30 days) has passed")
    );
    assert_eq!(failed.agent_id.as_deref(), Some("support-bot-2"));
    assert_eq!(
        failed.created_at,
        Some(1_795_860_720_000),
        "started_at 2026-11-28T10:12:00Z"
    );
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
    report
        .skipped
        .iter()
        .map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn trailing_content_after_the_json_value_of_a_line_is_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("t.jsonl");
    std::fs::write(
        &input,
        "{\"task\":\"a\"} {\"task\":\"b\"}\n{\"task\":\"x\"} garbage\n{\"task\":\"fine\"}  \t\n",
    )
    .unwrap();
    let report = run(
        &dir.path().join("store"),
        &[input],
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (3, 1, 2),
        "{report:?}"
    );
    let rejected = quarantined(&report);
    for (entry, line) in rejected.iter().zip([1, 2]) {
        assert!(
            entry["file"].as_str().unwrap().ends_with("t.jsonl"),
            "{entry}"
        );
        assert_eq!(entry["line"], line, "{entry}");
        let reason = entry["reason"].as_str().unwrap();
        assert!(
            reason.contains("trailing content after the JSON value at column 14"),
            "{reason}"
        );
    }
    assert_eq!(texts(&dir.path().join("store")), ["fine"]);
}

#[test]
fn whole_file_formats_refuse_trailing_content_too() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("alf.json");
    let transcript =
        "You are in a room.\\nYour task is to: put a mug in the sink.\\n> go to sink 1\\nOK.";
    std::fs::write(
        &input,
        format!("{{\"react_put_1\": \"{transcript}\"}}\n{{\"react_put_2\": \"{transcript}\"}}\n"),
    )
    .unwrap();
    let options = IngestOptions {
        format: Some(Format::Alfworld),
        ..IngestOptions::default()
    };
    let report = run(&dir.path().join("store"), &[input], &options);
    assert_eq!((report.ingested, report.quarantined), (0, 1), "{report:?}");
    let reason = quarantined(&report)[0]["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.contains("trailing content after the JSON value at column 1 of line 2"),
        "{reason}"
    );
}

#[test]
fn cr_only_line_endings_are_read_as_lines() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("mac.jsonl");
    std::fs::write(
        &input,
        "{\"task\":\"one\"}\r{\"task\": 42}\r{\"task\":\"three\"}\r",
    )
    .unwrap();
    let report = run(
        &dir.path().join("store"),
        &[input],
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (3, 2, 1),
        "{report:?}"
    );
    let rejected = quarantined(&report);
    assert_eq!(rejected[0]["line"], 2, "{rejected:?}");
    assert_eq!(rejected[0]["field"], "task");
    assert_eq!(texts(&dir.path().join("store")), ["one", "three"]);
}

#[test]
fn mixed_line_endings_keep_their_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("mixed.jsonl");
    std::fs::write(
        &input,
        "{\"task\":\"lf\"}\n{\"task\":\"crlf\"}\r\n{\"task\":\"cr\"}\r\r\n{\"task\": 5}\n",
    )
    .unwrap();
    let report = run(
        &dir.path().join("store"),
        &[input],
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (4, 3, 1),
        "{report:?}"
    );
    assert_eq!(
        quarantined(&report)[0]["line"],
        5,
        "line 4 is the blank line between `\\r` and `\\r\\n`"
    );
}

#[test]
fn walking_next_to_the_store_skips_it_and_the_quarantine_does_not_grow() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().to_path_buf();
    std::fs::write(
        input.join("a.jsonl"),
        "{\"task\":\"one\"}\n{\"task\": 42}\n",
    )
    .unwrap();
    let store = input.join("fluxmem-store");
    let first = run_as(
        &store,
        std::slice::from_ref(&input),
        &IngestOptions::default(),
        "first",
    );
    assert_eq!(
        (first.read, first.ingested, first.quarantined),
        (2, 1, 1),
        "{first:?}"
    );
    assert_eq!(skipped_names(&first), ["fluxmem-store"]);
    assert!(
        first.skipped[0].reason.contains("store being written"),
        "{:?}",
        first.skipped
    );
    let second = run_as(
        &store,
        std::slice::from_ref(&input),
        &IngestOptions {
            reread: true,
            ..Default::default()
        },
        "second",
    );
    assert_eq!(
        (second.read, second.duplicates, second.quarantined),
        (2, 1, 1),
        "{second:?}"
    );
    assert_eq!(skipped_names(&second), ["fluxmem-store"]);
    assert_eq!(
        quarantined(&second).len(),
        1,
        "the first run's quarantine is not re-ingested"
    );
    // An explicit folder inside the store is skipped too.
    let inside = run_as(
        &store,
        &[store.join("quarantine")],
        &IngestOptions::default(),
        "third",
    );
    assert_eq!(
        (inside.read, skipped_names(&inside)),
        (0, vec!["quarantine".to_string()]),
        "{inside:?}"
    );
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
    write(
        "old-store/manifest.json",
        "{\"format\":\"fluxmem-store\",\"schema_version\":1}",
    );
    write("old-store/x.jsonl", "{\"task\":\"from a store\"}\n");
    write("crashed/LOCK", "");
    write(
        "crashed/shards/y.jsonl",
        "{\"task\":\"from a crashed store\"}\n",
    );
    write("out/skills/release.json", "{\"format\":\"fluxmem-skills\"}");
    write("out/skills/skills.jsonl", "{\"task\":\"exported\"}\n");
    write("out/runs/r1/run.json", "{}");
    write("out/runs/r1/report.html", "<html></html>");
    write("out/runs/r1/z.jsonl", "{\"task\":\"from a report\"}\n");
    write("other/release.jsonl", "{\"task\":\"two\"}\n");
    let report = run(
        &dir.path().join("store"),
        std::slice::from_ref(&input),
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (2, 2, 0),
        "{report:?}"
    );
    assert_eq!(
        skipped_names(&report),
        ["crashed", "old-store", "r1", "skills"],
        "{:?}",
        report.skipped
    );
    assert_eq!(texts(&dir.path().join("store")), ["one", "two"]);
    // The quarantine/ and staging/ folders of another store, named explicitly.
    write(
        "old-store/quarantine/q.jsonl",
        "{\"task\":\"quarantined before\"}\n",
    );
    write(
        "old-store/staging/ingest-0-of-2/s.jsonl",
        "{\"task\":\"staged\"}\n",
    );
    let inputs = [
        input.join("old-store/quarantine"),
        input.join("old-store/staging"),
    ];
    let again = run(
        &dir.path().join("store"),
        &inputs,
        &IngestOptions::default(),
    );
    assert_eq!(
        (again.read, skipped_names(&again)),
        (0, vec!["quarantine".to_string(), "staging".to_string()]),
        "{again:?}"
    );
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
    std::fs::write(
        other.join("manifest.json"),
        "{\"format\":\"fluxmem-store\"}",
    )
    .unwrap();
    std::fs::write(other.join("x.jsonl"), "{\"task\":\"from a store\"}\n").unwrap();
    let report = run_as(
        &store,
        &[own, other.join("x.jsonl")],
        &IngestOptions::default(),
        "again",
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (2, 0, 2),
        "{report:?}"
    );
    let rejected = quarantined(&report);
    assert!(
        rejected[0]["reason"]
            .as_str()
            .unwrap()
            .contains("inside the store being written"),
        "{rejected:?}"
    );
    assert!(
        rejected[1]["reason"]
            .as_str()
            .unwrap()
            .contains("inside the fluxmem store"),
        "{rejected:?}"
    );
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
    let report = run(
        &dir.path().join("store"),
        &[input],
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (6, 2, 4),
        "{report:?}"
    );
    let rejected = quarantined(&report);
    let fields: Vec<&str> = rejected
        .iter()
        .map(|r| r["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        [
            "started_at",
            "started_at",
            "steps[0].timestamp",
            "started_at"
        ]
    );
    for entry in &rejected {
        let (field, reason) = (
            entry["field"].as_str().unwrap(),
            entry["reason"].as_str().unwrap(),
        );
        assert!(
            reason.contains(&format!("`{field}`"))
                && reason.contains("outside the years 1970..=9999"),
            "{reason}"
        );
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
    let options = IngestOptions {
        format: Some(Format::Locomo),
        ..IngestOptions::default()
    };
    let report = run(&dir.path().join("store"), &[input], &options);
    assert_eq!((report.ingested, report.quarantined), (1, 1), "{report:?}");
    let rejected = quarantined(&report);
    assert_eq!(
        rejected[0]["field"], "conversation.session_1_date_time",
        "{rejected:?}"
    );
    assert!(
        rejected[0]["reason"]
            .as_str()
            .unwrap()
            .contains("outside the years 1970..=9999"),
        "{rejected:?}"
    );
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
    let report = run(
        &dir.path().join("store"),
        std::slice::from_ref(&input),
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (1, 1, 0),
        "{report:?}"
    );
    assert_eq!(skipped_names(&report), ["link.jsonl"]);
    assert!(
        report.skipped[0].reason.contains("--follow-symlinks"),
        "{:?}",
        report.skipped
    );
    assert_eq!(texts(&dir.path().join("store")), ["inside"]);
    let options = IngestOptions {
        follow_symlinks: true,
        ..IngestOptions::default()
    };
    let followed = run(&dir.path().join("store2"), &[input], &options);
    assert_eq!(
        (followed.ingested, followed.skipped.len()),
        (2, 0),
        "{followed:?}"
    );
}

#[test]
fn a_symlink_named_as_an_input_is_refused_unless_followed() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("secret.jsonl");
    std::fs::write(&target, "{\"task\":\"behind a link\"}\n").unwrap();
    let link = dir.path().join("link.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let report = run(
        &dir.path().join("store"),
        std::slice::from_ref(&link),
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (1, 0, 1),
        "{report:?}"
    );
    let reason = quarantined(&report)[0]["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.contains("symbolic link") && reason.contains("pass --follow-symlinks"),
        "{reason}"
    );
    let options = IngestOptions {
        follow_symlinks: true,
        ..IngestOptions::default()
    };
    let followed = run(&dir.path().join("store2"), &[link], &options);
    assert_eq!(
        (followed.ingested, followed.quarantined),
        (1, 0),
        "{followed:?}"
    );
}

fn episodes_by_conversation(
    store: &Path,
) -> std::collections::BTreeMap<String, fluxmem_graph::Node> {
    let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
    graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Episodic)
        .filter_map(|n| {
            Some((
                n.metadata.get("conversation_id")?.as_str()?.to_string(),
                n.clone(),
            ))
        })
        .collect()
}

/// The OpenAI-style chat sample: one episode per conversation, tool results matched by call
/// id (parallel calls, a call without a result), content parts, the outcome, tenants, the
/// system prompt as shared semantic nodes, and the same conversation logged twice kept once.
#[test]
fn openai_chat_logs_become_episodes() {
    let store = tempfile::tempdir().unwrap();
    let sample = repo().join("data/openai-chat/support.jsonl");
    assert_eq!(
        Format::detect(&sample, &std::fs::read(&sample).unwrap()),
        Some(Format::OpenaiChat)
    );
    let report = run(
        store.path(),
        &[sample],
        &IngestOptions {
            tenant: "northwind".into(),
            ..Default::default()
        },
    );
    assert_eq!(
        (
            report.read,
            report.ingested,
            report.duplicates,
            report.quarantined
        ),
        (6, 5, 1, 0),
        "{report:?}"
    );
    let episodes = episodes_by_conversation(store.path());
    assert_eq!(
        episodes.keys().map(String::as_str).collect::<Vec<_>>(),
        ["c-101", "c-102", "c-103", "c-104", "c-105"]
    );
    let refund = &episodes["c-101"];
    assert_eq!(
        refund.text,
        "I want a refund for order #A1001, the book arrived damaged."
    );
    assert_eq!(refund.tenant, "northwind");
    let steps = &refund.episode().unwrap().steps;
    let calls: Vec<&str> = steps
        .iter()
        .flat_map(|s| s.tool_calls.iter().map(|c| c.name.as_str()))
        .collect();
    assert_eq!(calls, ["get_order", "refund_order"]);
    assert_eq!(
        steps[1].tool_calls[0].result.as_deref(),
        Some("{\"refunded\":true}")
    );
    assert_eq!(
        steps[0].tool_calls[0].arguments,
        "{\"order_id\": \"A1001\"}"
    );
    assert_eq!(refund.episode().unwrap().outcome.success, Some(true));
    // Content parts: the text part is the task.
    assert_eq!(
        episodes["c-102"].text,
        "Please refund order A1002, I changed my mind."
    );
    // A failed tool call is the step's feedback, and the outcome is a failure.
    let late = episodes["c-103"].episode().unwrap();
    assert_eq!(late.outcome.success, Some(false));
    assert!(late.steps[1]
        .feedback
        .as_deref()
        .unwrap()
        .starts_with("Error: refund window"));
    // Parallel calls in one step; the second has no result logged; the record's tenant wins.
    let parallel = &episodes["c-104"];
    assert_eq!(parallel.tenant, "northwind-eu");
    let first = &parallel.episode().unwrap().steps[0];
    assert_eq!(first.tool_calls.len(), 2);
    assert_eq!(
        first.tool_calls[0].result.as_deref(),
        Some("{\"status\":\"shipped\"}")
    );
    assert_eq!(first.tool_calls[1].result, None);
    // The system prompt: semantic nodes in each tenant that logged it, shared within a tenant.
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    let prompt_tenants: std::collections::BTreeSet<&str> = graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Semantic)
        .map(|n| n.tenant.as_str())
        .collect();
    assert_eq!(
        prompt_tenants,
        ["northwind", "northwind-eu"].into_iter().collect()
    );
    assert_eq!(
        graph
            .nodes
            .values()
            .filter(|n| n.kind() == NodeKind::Semantic)
            .count(),
        2,
        "one chunk per tenant"
    );
}

#[test]
fn malformed_chat_lines_are_quarantined_naming_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chat.jsonl");
    let lines = [
        r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#,
        r#"{"messages": [{"role": "user", "content": 42}]}"#,
        r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
        r#"{"messages": [{"role": "user", "content": "hi"}], "outcome": {"success": "yes"}}"#,
        r#"{"messages": []}"#,
    ];
    std::fs::write(&file, lines.join("\n")).unwrap();
    let store = tempfile::tempdir().unwrap();
    let report = run(store.path(), &[file], &IngestOptions::default());
    assert_eq!((report.ingested, report.quarantined), (1, 4));
    let got: Vec<(u64, String)> = quarantined(&report)
        .iter()
        .map(|q| {
            (
                q["line"].as_u64().unwrap(),
                q["field"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (2, "messages[0].content".to_string()),
            (3, "messages[0].role".into()),
            (4, "outcome.success".into()),
            (5, "messages".into())
        ]
    );
}

/// gzip and zstd files are read by their magic bytes, detected by the name without `.gz` /
/// `.zst`; a compressed file that does not decompress, and a binary file of no known format,
/// are one quarantined record each with at most a short excerpt. A directory mixing chat
/// logs, compressed files and fluxmem's own JSONL is read whole.
#[test]
fn compressed_files_are_read_and_broken_ones_are_one_record() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let chat = std::fs::read(repo().join("data/openai-chat/support.jsonl")).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&chat).unwrap();
    std::fs::write(dir.path().join("chat.jsonl.gz"), gz.finish().unwrap()).unwrap();
    let trajectories = std::fs::read(repo().join("data/trajectories.jsonl")).unwrap();
    std::fs::write(
        dir.path().join("trajectories.jsonl.zst"),
        zstd::encode_all(&trajectories[..], 3).unwrap(),
    )
    .unwrap();
    let mut broken = std::fs::read(dir.path().join("chat.jsonl.gz")).unwrap();
    broken.truncate(broken.len() / 2);
    std::fs::write(dir.path().join("broken.jsonl.gz"), broken).unwrap();
    let binary: Vec<u8> = (0..200_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(dir.path().join("blob.bin"), &binary).unwrap();
    let store = tempfile::tempdir().unwrap();
    let report = run(
        store.path(),
        &[dir.path().to_path_buf()],
        &IngestOptions::default(),
    );
    // 6 chat lines (1 duplicate) + 9 trajectories; 2 files quarantined whole.
    assert_eq!(
        (
            report.files,
            report.ingested,
            report.duplicates,
            report.quarantined
        ),
        (4, 14, 1, 2),
        "{report:?}"
    );
    let rejected = quarantined(&report);
    let broken = rejected
        .iter()
        .find(|q| q["file"].as_str().unwrap().ends_with("broken.jsonl.gz"))
        .unwrap();
    assert!(
        broken["reason"]
            .as_str()
            .unwrap()
            .starts_with("gzip data does not decompress"),
        "{broken}"
    );
    assert_eq!(broken["raw"], "");
    let blob = rejected
        .iter()
        .find(|q| q["file"].as_str().unwrap().ends_with("blob.bin"))
        .unwrap();
    assert!(
        blob["reason"]
            .as_str()
            .unwrap()
            .contains("cannot tell the format"),
        "{blob}"
    );
    let line = serde_json::to_string(blob).unwrap();
    assert!(
        line.len() < 2_000,
        "a short excerpt, not the file: {} bytes",
        line.len()
    );
    let episodes = episodes_by_conversation(store.path());
    assert_eq!(episodes.len(), 5, "the chat log inside the .gz");
}

fn otel_episodes(store: &Path) -> Vec<fluxmem_graph::Node> {
    let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
    let mut episodes: Vec<fluxmem_graph::Node> = graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Episodic)
        .cloned()
        .collect();
    episodes.sort_by_key(|n| n.created_at);
    episodes
}

/// The OTel sample: one episode per `invoke_agent` span, steps from chat spans' tool calls with
/// the `execute_tool` spans' results, the outcome from the agent span's status, tenant from
/// `service.name`, agent from `gen_ai.agent.id`, system instructions as a semantic node.
#[test]
fn otel_genai_traces_become_episodes() {
    let store = tempfile::tempdir().unwrap();
    let sample = repo().join("data/otel/ops-traces.json");
    assert_eq!(
        Format::detect(&sample, &std::fs::read(&sample).unwrap()),
        Some(Format::Otel)
    );
    let report = run(store.path(), &[sample], &IngestOptions::default());
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (2, 2, 0),
        "{report:?}"
    );
    let episodes = otel_episodes(store.path());
    let fixed = &episodes[0];
    assert_eq!(
        fixed.text,
        "Service checkout-api is returning 502s, please fix it."
    );
    assert_eq!(
        (fixed.tenant.as_str(), fixed.agent_id.as_deref()),
        ("globex-ops", Some("ops-bot-7"))
    );
    assert_eq!(fixed.metadata["conversation_id"], "conv-ops-1");
    let episode = fixed.episode().unwrap();
    assert_eq!(episode.outcome.success, Some(true));
    let calls: Vec<(&str, Option<&str>)> = episode
        .steps
        .iter()
        .flat_map(|s| {
            s.tool_calls
                .iter()
                .map(|c| (c.name.as_str(), c.result.as_deref()))
        })
        .collect();
    assert_eq!(
        calls,
        [
            ("get_health", Some("{\"status\":\"down\"}")),
            ("restart_service", Some("{\"restarted\":true}"))
        ]
    );
    assert_eq!(episode.steps.last().unwrap().action, "Done.");
    assert_eq!(
        fixed.outcome_source(),
        "status",
        "the agent span's OK status"
    );
    assert_eq!(episodes[1].outcome_source(), "status", "its ERROR status");
    let failed = episodes[1].episode().unwrap();
    assert_eq!(failed.outcome.success, Some(false));
    assert_eq!(
        failed.outcome.feedback.as_deref(),
        Some("service still down")
    );
    assert_eq!(
        failed.steps[1].feedback.as_deref(),
        Some("Error: permission denied"),
        "the tool span's ERROR status"
    );
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    let semantic: Vec<&fluxmem_graph::Node> = graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Semantic)
        .collect();
    assert_eq!(semantic.len(), 1, "both runs share the system instructions");
    assert_eq!(semantic[0].tenant, "globex-ops");
}

/// A trace split across two files, a span whose parent is not logged, the same file read twice
/// and a trace with no agent span: the spans are grouped after every file is read.
#[test]
fn otel_traces_split_across_files_and_broken_trees_are_grouped() {
    let sample: Value =
        serde_json::from_slice(&std::fs::read(repo().join("data/otel/ops-traces.json")).unwrap())
            .unwrap();
    let resource = sample["resourceSpans"][0].clone();
    let spans = resource["scopeSpans"][0]["spans"]
        .as_array()
        .unwrap()
        .clone();
    let file_of = |spans: &[Value]| {
        let mut r = resource.clone();
        r["scopeSpans"][0]["spans"] = Value::Array(spans.to_vec());
        serde_json::json!({ "resourceSpans": [r] })
    };
    // The first trace's spans over two files; a chat span's parent id points nowhere.
    let mut second_half: Vec<Value> = spans[3..].to_vec();
    second_half[0]["parentSpanId"] = Value::from("ffffffffffffffff");
    let lone = serde_json::json!({
        "traceId": "aaaabbbbccccddddeeeeffff00001111", "spanId": "1234567812345678", "name": "execute_tool ping",
        "startTimeUnixNano": "1795870000000000000",
        "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "execute_tool"}},
                       {"key": "gen_ai.tool.name", "value": {"stringValue": "ping"}}]
    });
    let broken = serde_json::json!({ "traceId": "aaaa", "name": "no span id" });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.json"), file_of(&spans[..3]).to_string()).unwrap();
    std::fs::write(dir.path().join("b.json"), file_of(&second_half).to_string()).unwrap();
    std::fs::write(dir.path().join("c.json"), file_of(&spans[..3]).to_string()).unwrap();
    std::fs::write(
        dir.path().join("d.json"),
        file_of(&[lone, broken]).to_string(),
    )
    .unwrap();
    let store = tempfile::tempdir().unwrap();
    let report = run(
        store.path(),
        &[dir.path().to_path_buf()],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (3, 1), "{report:?}");
    let rejected = quarantined(&report);
    assert_eq!(rejected[0]["field"], "spanId");
    assert!(
        rejected[0]["locator"]
            .as_str()
            .unwrap()
            .contains("spans[1]"),
        "{}",
        rejected[0]
    );
    let episodes = otel_episodes(store.path());
    let first = episodes
        .iter()
        .find(|e| e.metadata.get("conversation_id") == Some(&Value::from("conv-ops-1")))
        .unwrap();
    assert_eq!(
        first.metadata["otel.spans"], 6,
        "every span of the trace, counted once"
    );
    assert_eq!(
        first
            .episode()
            .unwrap()
            .steps
            .iter()
            .flat_map(|s| &s.tool_calls)
            .count(),
        2
    );
    let lone = episodes
        .iter()
        .find(|e| {
            e.metadata["otel.group"]
                .as_str()
                .unwrap()
                .starts_with("trace:")
        })
        .unwrap();
    assert_eq!(lone.episode().unwrap().steps[0].tool_calls[0].name, "ping");
    // Reading the same files again adds nothing.
    let again = run(
        store.path(),
        &[dir.path().to_path_buf()],
        &IngestOptions::default(),
    );
    assert_eq!((again.ingested, again.duplicates), (0, 3));
}

/// A trace that crosses the services of two tenants (the agent in one, a tool in the other,
/// the same conversation id) gives each tenant its own episode: tenants never mix.
#[test]
fn otel_spans_of_two_tenants_are_never_one_episode() {
    let attribute =
        |key: &str, value: &str| serde_json::json!({"key": key, "value": {"stringValue": value}});
    let resource = |service: &str, spans: Vec<Value>| serde_json::json!({"resource": {"attributes": [attribute("service.name", service)]}, "scopeSpans": [{"spans": spans}]});
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let agent = serde_json::json!({
        "traceId": trace, "spanId": "b7ad6b7169203331", "startTimeUnixNano": "1795860000000000000",
        "attributes": [attribute("gen_ai.operation.name", "invoke_agent"), attribute("gen_ai.conversation.id", "conv-x"),
                       attribute("gen_ai.input.messages", r#"[{"role":"user","parts":[{"type":"text","content":"look up order 7"}]}]"#)]
    });
    let tool = serde_json::json!({
        "traceId": trace, "spanId": "00f067aa0ba902b7", "parentSpanId": "b7ad6b7169203331", "startTimeUnixNano": "1795860001000000000",
        "attributes": [attribute("gen_ai.operation.name", "execute_tool"), attribute("gen_ai.tool.name", "get_order"),
                       attribute("gen_ai.tool.call.result", "{\"status\":\"shipped\"}")]
    });
    let file = serde_json::json!({"resourceSpans": [resource("shop-a", vec![agent]), resource("shop-b", vec![tool])]});
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.json"), file.to_string()).unwrap();
    let store = tempfile::tempdir().unwrap();
    let report = run(
        store.path(),
        &[dir.path().join("t.json")],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (2, 0), "{report:?}");
    let episodes = otel_episodes(store.path());
    let tenants: Vec<&str> = episodes.iter().map(|e| e.tenant.as_str()).collect();
    assert_eq!(
        tenants
            .iter()
            .copied()
            .collect::<std::collections::BTreeSet<_>>(),
        ["shop-a", "shop-b"].into_iter().collect()
    );
    let b = episodes.iter().find(|e| e.tenant == "shop-b").unwrap();
    assert_eq!(
        b.episode().unwrap().steps[0].tool_calls[0].name,
        "get_order",
        "shop-b's own span, in shop-b"
    );
    let a = episodes.iter().find(|e| e.tenant == "shop-a").unwrap();
    assert_eq!(a.text, "look up order 7");
    assert!(
        a.episode().unwrap().steps.is_empty(),
        "shop-b's tool call is not in shop-a's episode"
    );
}

/// The ledger skips files already ingested: unchanged (size and mtime), touched but the same
/// content (hash), and reads again a file that grew (only its new record is new), one read
/// with other settings (another tenant), and nothing of a file whose records were all
/// quarantined (the quarantine is on disk before the ledger skips it).
#[test]
fn the_ledger_reads_only_new_logs() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let logs = dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    let a = logs.join("a.jsonl");
    std::fs::write(&a, "{\"task\":\"one\"}\n").unwrap();
    std::fs::write(logs.join("bad.jsonl"), "{\"task\": 7}\n").unwrap();
    let first = run_as(
        &store,
        std::slice::from_ref(&logs),
        &IngestOptions::default(),
        "n1",
    );
    assert_eq!(
        (
            first.files,
            first.ingested,
            first.quarantined,
            first.unchanged_files
        ),
        (2, 1, 1, 0),
        "{first:?}"
    );
    let ledger = std::fs::read_to_string(store.join(fluxmem_ingest::LEDGER)).unwrap();
    assert_eq!(ledger.lines().count(), 2, "{ledger}");
    assert_eq!(
        quarantined(&first).len(),
        1,
        "the quarantined record is on disk"
    );

    let second = run_as(
        &store,
        std::slice::from_ref(&logs),
        &IngestOptions::default(),
        "n2",
    );
    assert_eq!(
        (
            second.files,
            second.read,
            second.unchanged_files,
            second.quarantine_file.is_some()
        ),
        (0, 0, 2, false),
        "{second:?}"
    );

    // Touched: new mtime, same bytes: hashed and skipped.
    let file = std::fs::File::options().append(true).open(&a).unwrap();
    file.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    drop(file);
    let touched = run_as(
        &store,
        std::slice::from_ref(&logs),
        &IngestOptions::default(),
        "n3",
    );
    assert_eq!(
        (touched.files, touched.unchanged_files),
        (0, 2),
        "{touched:?}"
    );

    // Grown: read again; the old record is a duplicate, the new one is ingested.
    std::fs::write(&a, "{\"task\":\"one\"}\n{\"task\":\"two\"}\n").unwrap();
    let grown = run_as(
        &store,
        std::slice::from_ref(&logs),
        &IngestOptions::default(),
        "n4",
    );
    assert_eq!(
        (
            grown.files,
            grown.ingested,
            grown.duplicates,
            grown.unchanged_files
        ),
        (1, 1, 1, 1),
        "{grown:?}"
    );

    // Other settings: the same file read for another tenant is new work.
    let other = run_as(
        &store,
        std::slice::from_ref(&a),
        &IngestOptions {
            tenant: "globex".into(),
            ..Default::default()
        },
        "n5",
    );
    assert_eq!((other.files, other.ingested), (1, 2), "{other:?}");
}

/// Issue 40.9: a directory of many small files commits in groups (here 2,500 one-record files
/// make 3 commits, not 2,500), the ledger knows every file afterwards, and the manifest lists a
/// handful of shards.
#[test]
fn many_small_files_commit_in_groups() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    for i in 0..2500 {
        let record = format!(
            r#"{{"episode_id": "e{i}", "task": "task {i}", "steps": [{{"observation": "o{i}", "action": "a{i}"}}]}}"#
        );
        std::fs::write(logs.join(format!("{i:05}.jsonl")), record + "\n").unwrap();
    }
    let store = dir.path().join("store");
    let report = run(
        &store,
        std::slice::from_ref(&logs),
        &IngestOptions::default(),
    );
    assert_eq!((report.files, report.ingested), (2500, 2500), "{report:?}");
    assert_eq!(report.commits, 3, "groups of 1,000 files: {report:?}");
    let manifest = fluxmem_store::Store::open(&store)
        .unwrap()
        .manifest()
        .unwrap();
    assert!(
        manifest.shards.len() <= 6,
        "{} shards",
        manifest.shards.len()
    );
    let again = run(
        &store,
        std::slice::from_ref(&logs),
        &IngestOptions::default(),
    );
    assert_eq!(
        (again.unchanged_files, again.commits),
        (2500, 0),
        "{again:?}"
    );
}

/// Issue 40.13: an OTel span whose `attributes` (or `status`) has the wrong type is
/// quarantined with the field's name and the span's path, not read as a span without them.
#[test]
fn otel_span_fields_of_the_wrong_type_are_quarantined_with_their_path() {
    let sample: Value =
        serde_json::from_slice(&std::fs::read(repo().join("data/otel/ops-traces.json")).unwrap())
            .unwrap();
    let mut file = sample.clone();
    let spans = file["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array_mut()
        .unwrap();
    spans[0]["attributes"] = Value::from("gen_ai.operation.name=chat");
    spans[1]["status"] = Value::from("ERROR");
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("traces.json");
    std::fs::write(&input, file.to_string()).unwrap();
    let store = tempfile::tempdir().unwrap();
    let report = run(store.path(), &[input], &IngestOptions::default());
    assert_eq!(report.quarantined, 2, "{report:?}");
    let rejected = quarantined(&report);
    let fields: Vec<&str> = rejected
        .iter()
        .map(|r| r["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["attributes", "status"]);
    assert!(
        rejected[0]["locator"]
            .as_str()
            .unwrap()
            .ends_with("spans[0]"),
        "{}",
        rejected[0]
    );
}

/// Issue 45.5: evaluation labels stay out of the store. An ALFWorld trajectory's name encodes
/// its task type (`<style>_<task type>_<n>`, the label `eval skills` scores clusters against);
/// no stored node carries it, or any part of the name, in its metadata.
#[test]
fn evaluation_labels_are_not_stored_in_node_metadata() {
    let store = tempfile::tempdir().unwrap();
    let report = run(
        store.path(),
        &[repo().join("data/alfworld")],
        &IngestOptions {
            format: Some(fluxmem_ingest::Format::Alfworld),
            ..Default::default()
        },
    );
    assert!(report.ingested > 0, "{report:?}");
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    let mut checked = 0;
    for node in graph.nodes.values() {
        let parts: Vec<&str> = node.source_locator.split('_').collect();
        let Some(label) = parts.get(1) else { continue };
        checked += 1;
        for (key, value) in &node.metadata {
            let text = value.to_string();
            assert!(
                !["task_type", "style", "name", "label"].contains(&key.as_str())
                    && !text.contains(label)
                    && !text.contains(&node.source_locator),
                "{}: metadata {key} = {text} carries the label `{label}`",
                node.source_locator
            );
        }
    }
    assert!(checked > 0, "the sample's trajectories have labelled names");
}

#[test]
fn every_episode_says_where_its_outcome_came_from_and_the_rule_fills_unlogged_ones() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("chats.jsonl");
    let lines = [
        // Logged.
        r#"{"id": "logged", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "outcome": {"success": false}}"#,
        // No outcome, ended with an answer: presumed success.
        r#"{"id": "answered", "messages": [{"role": "user", "content": "order 7?"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"id\": 7}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "{\"state\": \"sent\"}"}, {"role": "assistant", "content": "It was sent."}, {"role": "user", "content": "great, thanks"}]}"#,
        // No outcome, the user complains after the answer: failure.
        r#"{"id": "complained", "messages": [{"role": "user", "content": "order 8?"}, {"role": "assistant", "content": "It was sent."}, {"role": "user", "content": "That is wrong, it never left."}]}"#,
        // No outcome, the last call failed: failure.
        r#"{"id": "errored", "messages": [{"role": "user", "content": "order 9?"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": "{\"id\": 9}"}}]}, {"role": "tool", "tool_call_id": "c2", "content": "Error: timeout"}]}"#,
        // No outcome, ended on a call (a hand-off): unknown.
        r#"{"id": "handed", "messages": [{"role": "user", "content": "a human please"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "escalate", "arguments": "{}"}}]}]}"#,
    ];
    std::fs::write(&log, lines.join("\n")).unwrap();
    let store = dir.path().join("store");
    let report = run(&store, &[log], &IngestOptions::default());
    let counts: Vec<(&str, u64)> = report
        .outcomes
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(counts, [("inferred", 3), ("logged", 1), ("none", 1)]);
    let episodes = episodes_by_conversation(&store);
    let seen = |id: &str| {
        let node = &episodes[id];
        (
            node.outcome_source().to_string(),
            node.episode().unwrap().outcome.success,
        )
    };
    assert_eq!(seen("logged"), ("logged".into(), Some(false)));
    assert_eq!(seen("answered"), ("inferred".into(), Some(true)));
    assert_eq!(seen("complained"), ("inferred".into(), Some(false)));
    assert_eq!(seen("errored"), ("inferred".into(), Some(false)));
    assert_eq!(seen("handed"), ("none".into(), None));
    assert_eq!(
        episodes["handed"].metadata["outcome_rule"],
        "ended on a tool call, not an answer"
    );
}

/// A judge that reads the transcripts it is given: success when the run's last line is the
/// agent's and says "sent", an error for a run that mentions "escalate"; it keeps what it saw.
struct ScriptedJudge {
    seen: Vec<String>,
}

impl fluxmem_ingest::outcome::OutcomeJudge for ScriptedJudge {
    fn model(&self) -> &str {
        "scripted-judge"
    }
    fn judge(&mut self, transcripts: &[String]) -> Result<Vec<f32>, String> {
        self.seen.extend(transcripts.iter().cloned());
        if transcripts.iter().any(|t| t.contains("escalate")) {
            return Err("the model ran out of memory".into());
        }
        Ok(transcripts
            .iter()
            .map(|t| {
                let last = t.lines().last().unwrap_or("");
                if last.starts_with("[agent]") && last.contains("sent") {
                    0.8
                } else {
                    0.1
                }
            })
            .collect())
    }
}

#[test]
fn a_judge_gives_outcomes_only_where_the_log_says_none_and_sees_runs_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("chats.jsonl");
    let lines = [
        // Logged: never shown to the judge.
        r#"{"id": "logged", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "outcome": {"success": false}}"#,
        // The rule presumes a success; the judge agrees. The user's key never reaches it, not
        // even in part where a long line is cut (at 400 characters, inside the key).
        &format!(
            r#"{{"id": "answered", "messages": [{{"role": "user", "content": "order 7? {} my key is sk-proj-4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"}}, {{"role": "assistant", "content": "It was sent."}}]}}"#,
            "x".repeat(365)
        ),
        // The rule presumes a success; the judge disagrees.
        r#"{"id": "vague", "messages": [{"role": "user", "content": "order 8?"}, {"role": "assistant", "content": "Let me think about that."}]}"#,
        // The rule abstains (ended on a call); the judge fails on it: it stays unknown.
        r#"{"id": "handed", "messages": [{"role": "user", "content": "a human please"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "escalate", "arguments": "{}"}}]}]}"#,
    ];
    std::fs::write(&log, lines.join("\n")).unwrap();
    let store = dir.path().join("store");
    let mut judge = ScriptedJudge { seen: Vec::new() };
    let mut writer = Writer::open(&store).unwrap();
    let report = fluxmem_ingest::ingest_judged(
        &mut writer,
        &[log],
        &IngestOptions::default(),
        Some(&mut judge),
        "judged-run",
        &mut NoProgress,
    )
    .unwrap();
    drop(writer);
    let counts: Vec<(&str, u64)> = report
        .outcomes
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(counts, [("judged", 2), ("logged", 1), ("none", 1)]);
    assert_eq!(report.judge_errors, 1);
    assert_eq!(judge.seen.len(), 3, "the logged run is never judged");
    assert!(
        judge
            .seen
            .iter()
            .all(|t| !t.contains("sk-") && !t.contains("4f9a8b")),
        "the judge reads redacted runs: {:?}",
        judge.seen
    );
    assert!(
        judge.seen.iter().any(|t| t.contains("my key is")),
        "the long line is there, cut after the key's place: {:?}",
        judge.seen
    );
    let episodes = episodes_by_conversation(&store);
    let seen = |id: &str| {
        let node = &episodes[id];
        (
            node.outcome_source().to_string(),
            node.episode().unwrap().outcome.success,
            node.metadata.get("outcome_probability").cloned(),
        )
    };
    assert_eq!(seen("logged"), ("logged".into(), Some(false), None));
    assert_eq!(
        seen("answered"),
        ("judged".into(), Some(true), Some(Value::from(0.8)))
    );
    assert_eq!(
        seen("vague"),
        ("judged".into(), Some(false), Some(Value::from(0.1)))
    );
    assert_eq!(seen("handed"), ("none".into(), None, None));
    assert_eq!(
        episodes["answered"].metadata["outcome_judge"],
        "scripted-judge"
    );
    assert_eq!(
        episodes["vague"].metadata["outcome_rule"], "ended with an answer, no error, no complaint",
        "what the rule said stays beside the judge's answer"
    );
}

/// The judge reads runs redacted as the pipeline's `[redact]` says (`IngestOptions::redact`):
/// an address the settings allow stays, the others go; the default redacts both.
#[test]
fn a_judge_reads_runs_redacted_by_the_pipelines_settings() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("chats.jsonl");
    std::fs::write(
        &log,
        r#"{"id": "mail", "messages": [{"role": "user", "content": "write to support@acme.example, not to jo@home.example"}, {"role": "assistant", "content": "It was sent."}]}"#,
    )
    .unwrap();
    let seen = |redact: fluxmem_redact::RedactConfig, store: &str| -> String {
        let mut judge = ScriptedJudge { seen: Vec::new() };
        let mut writer = Writer::open(dir.path().join(store)).unwrap();
        fluxmem_ingest::ingest_judged(
            &mut writer,
            std::slice::from_ref(&log),
            &IngestOptions {
                redact,
                ..IngestOptions::default()
            },
            Some(&mut judge),
            "judged-run",
            &mut NoProgress,
        )
        .unwrap();
        assert_eq!(judge.seen.len(), 1);
        judge.seen.remove(0)
    };
    let allowed = seen(
        fluxmem_redact::RedactConfig {
            allow: vec!["support@acme.example".into()],
            ..Default::default()
        },
        "allowed",
    );
    assert!(
        allowed.contains("support@acme.example") && !allowed.contains("jo@home.example"),
        "{allowed}"
    );
    let default = seen(Default::default(), "default");
    assert!(
        !default.contains("support@acme.example") && !default.contains("jo@home.example"),
        "{default}"
    );
}

/// The fixtures the real emitters wrote (scripts/fixtures/generate.sh; versions in
/// tests/data/formats/VERSIONS.txt).
fn fixture(name: &str) -> PathBuf {
    repo().join("tests/data/formats").join(name)
}

/// The episodes of a store, by task, with (tool, result) of each call, the last action and the
/// outcome with its source.
type Seen = (Vec<(String, Option<String>)>, String, Option<bool>, String);

fn seen_episodes(store: &Path) -> std::collections::BTreeMap<String, (Seen, fluxmem_graph::Node)> {
    let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
    graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Episodic)
        .map(|n| {
            let episode = n.episode().unwrap();
            let calls = episode
                .steps
                .iter()
                .flat_map(|s| {
                    s.tool_calls
                        .iter()
                        .map(|c| (c.name.clone(), c.result.clone()))
                })
                .collect();
            let last = episode
                .steps
                .iter()
                .rev()
                .find(|s| !s.action.is_empty())
                .map(|s| s.action.clone())
                .unwrap_or_default();
            let seen = (
                calls,
                last,
                episode.outcome.success,
                n.outcome_source().to_string(),
            );
            (n.text.clone(), (seen, n.clone()))
        })
        .collect()
}

fn call(name: &str, result: Option<&str>) -> (String, Option<String>) {
    (name.to_string(), result.map(str::to_string))
}

#[test]
fn the_collectors_otlp_json_lines_are_read_line_by_line_with_errors_and_outcomes() {
    let store = tempfile::tempdir().unwrap();
    let file = fixture("otlp-collector.jsonl");
    assert_eq!(
        Format::detect(&file, &std::fs::read(&file).unwrap()),
        Some(Format::Otel),
        "detected by content in a .jsonl file"
    );
    let report = run(store.path(), &[file], &IngestOptions::default());
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (3, 3, 0),
        "{report:?}"
    );
    let episodes = seen_episodes(store.path());
    let lookup = |id: &str| format!("{{\"order_id\":\"{id}\",\"status\":\"delivered\"}}");
    let (seen, node) = &episodes["Please refund order A-100, it arrived broken."];
    assert_eq!(
        seen,
        &(
            vec![
                call("get_order", Some(&lookup("A-100"))),
                call("refund_order", Some("{\"refunded\":true}"))
            ],
            "Your refund is on its way.".to_string(),
            Some(true),
            "inferred".to_string()
        ),
        "an UNSET agent status: the rule presumes success"
    );
    assert_eq!(node.tenant, "acme-support");
    assert_eq!(node.metadata["conversation_id"], "conv-1");
    let (seen, node) = &episodes["Refund order B-200 please."];
    assert_eq!(
        seen.0,
        vec![
            call("get_order", Some(&lookup("B-200"))),
            call("refund_order", None)
        ]
    );
    assert_eq!(
        (seen.2, seen.3.as_str()),
        (Some(false), "inferred"),
        "the refund's error was never recovered"
    );
    let refund_step = node
        .episode()
        .unwrap()
        .steps
        .iter()
        .find(|s| s.tool_calls.iter().any(|c| c.name == "refund_order"))
        .unwrap();
    assert_eq!(
        refund_step.feedback.as_deref(),
        Some("payment provider timeout")
    );
    assert!(episodes.contains_key("I want my money back for order C-300."));
    // A bad line is quarantined with its line; the others go on.
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.jsonl");
    let text = std::fs::read_to_string(fixture("otlp-collector.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(
        &broken,
        format!("{}\n{{\"resourceSpans\": [\n{}\n", lines[0], lines[1]),
    )
    .unwrap();
    let report = run(
        &dir.path().join("store"),
        &[broken],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (3, 1), "{report:?}");
    let bad = quarantined(&report);
    assert_eq!(bad[0]["line"], 2, "{bad:?}");
}

#[test]
fn openinference_spans_from_phoenix_instrumentation_are_episodes_with_their_calls() {
    // Written by openinference-instrumentation-openai and openinference-instrumentation's
    // decorators (scripts/fixtures/openinference_traces.py): AGENT, LLM and TOOL spans whose
    // messages are flattened into `llm.*_messages.<i>.message.*` attributes, and TOOL spans
    // with no call id.
    let store = tempfile::tempdir().unwrap();
    let file = fixture("openinference-phoenix.jsonl");
    assert_eq!(
        Format::detect(&file, &std::fs::read(&file).unwrap()),
        Some(Format::Otel)
    );
    let report = run(store.path(), &[file], &IngestOptions::default());
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (3, 3, 0),
        "{report:?}"
    );
    let episodes = seen_episodes(store.path());
    let (seen, node) = &episodes["Please refund my order A-1001, it arrived broken."];
    assert_eq!(
        seen,
        &(
            vec![
                call(
                    "get_order",
                    Some("{\"order_id\": \"A-1001\", \"status\": \"delivered\"}")
                ),
                call(
                    "refund_order",
                    Some("{\"order_id\": \"A-1001\", \"refunded\": true}")
                ),
            ],
            "Your order A-1001 is refunded.".to_string(),
            Some(true),
            "status".to_string()
        ),
        "each tool span answers the call its LLM span requested, once"
    );
    assert_eq!(node.tenant, "acme-support");
    assert_eq!(node.metadata["conversation_id"], "session-1");
    let steps = &node.episode().unwrap().steps;
    assert_eq!(
        steps[0].tool_calls[0].arguments,
        "{\"order_id\": \"A-1001\"}"
    );
    let (seen, node) = &episodes["Refund order A-1003 please, I changed my mind."];
    assert_eq!(
        (seen.0.len(), seen.2, seen.3.as_str()),
        (2, Some(false), "status"),
        "the agent span's ERROR status: {seen:?}"
    );
    let refund = node
        .episode()
        .unwrap()
        .steps
        .iter()
        .find(|s| s.tool_calls.iter().any(|c| c.name == "refund_order"));
    assert!(
        refund
            .and_then(|s| s.feedback.as_deref())
            .is_some_and(|f| f.contains("not delivered yet")),
        "the tool's exception is the step's feedback: {refund:?}"
    );
    // The system prompt of the LLM spans is the tenant's shared semantic node.
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    assert!(graph
        .nodes
        .values()
        .any(|n| n.episode().is_none() && n.text.contains("Look an order up before changing it")));
}

#[test]
fn client_only_model_calls_are_stitched_into_runs_by_their_messages() {
    // Written by OpenLLMetry's openai instrumentation (scripts/fixtures/openllmetry_traces.py):
    // every model call its own trace, no agent span, tool results only in the next call's
    // input messages, the system prompt an input message; one run ends on an HTTP 500.
    let store = tempfile::tempdir().unwrap();
    let file = fixture("openllmetry-client.jsonl");
    let report = run(store.path(), &[file], &IngestOptions::default());
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (3, 3, 0),
        "7 calls of 3 runs: {report:?}"
    );
    let episodes = seen_episodes(store.path());
    assert_client_only_runs(
        store.path(),
        &episodes,
        ["B-2001", "B-2002", "B-2003"],
        "delivered",
        "Order B-2002 was delivered.",
    );
}

/// The three runs of the client-only fixtures (`scripted.py` `client_only_runs`), as read from
/// `store`: a refund of `ids[0]` in three calls (each result from the next call's input), a
/// lookup of `ids[1]` (status `second_status`, answered `second_answer`), a refund of `ids[2]`
/// failed by the HTTP 500 of its last call; the system prompt a shared semantic node.
fn assert_client_only_runs(
    store: &Path,
    episodes: &std::collections::BTreeMap<String, (Seen, fluxmem_graph::Node)>,
    ids: [&str; 3],
    second_status: &str,
    second_answer: &str,
) {
    let order =
        |id: &str, status: &str| format!("{{\"order_id\": \"{id}\", \"status\": \"{status}\"}}");
    let (seen, node) = &episodes[&format!("Please refund my order {}, it arrived broken.", ids[0])];
    assert_eq!(
        seen,
        &(
            vec![
                call("get_order", Some(&order(ids[0], "delivered"))),
                call(
                    "refund_order",
                    Some(&format!(
                        "{{\"order_id\": \"{}\", \"refunded\": true}}",
                        ids[0]
                    ))
                ),
            ],
            format!("Your order {} is refunded.", ids[0]),
            Some(true),
            "inferred".to_string()
        ),
        "three calls, one run: each result from the next call's input"
    );
    assert_eq!(node.metadata["otel.traces"], 3);
    let calls = &node.episode().unwrap().steps;
    assert!(
        calls
            .iter()
            .flat_map(|s| &s.tool_calls)
            .all(|c| c.arguments.contains(ids[0])),
        "each call's arguments: {calls:?}"
    );
    let (seen, _) = &episodes[&format!("Where is my order {}?", ids[1])];
    assert_eq!(
        seen.0,
        vec![call("get_order", Some(&order(ids[1], second_status)))]
    );
    assert_eq!(seen.1, second_answer);
    let (seen, node) = &episodes[&format!("Refund {} please.", ids[2])];
    assert_eq!(
        (seen.2, seen.3.as_str()),
        (Some(false), "status"),
        "the last call's HTTP 500 fails the run: {seen:?}"
    );
    assert!(node
        .episode()
        .unwrap()
        .outcome
        .feedback
        .as_deref()
        .is_some_and(|f| f.contains("500")));
    // The system prompt, carried as an input message, is the tenant's shared semantic node.
    let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
    assert!(
        graph.nodes.values().any(
            |n| n.episode().is_none() && n.text.contains("Look an order up before changing it")
        ),
        "the system prompt is a semantic node"
    );
}

#[test]
fn openai_v2_client_calls_with_messages_as_log_events_are_stitched_into_runs() {
    // Written by the OpenTelemetry project's openai-v2 instrumentation with content capture
    // (scripts/fixtures/openai_v2_traces.py): spans without content, one per model call, each
    // its own trace; the messages are GenAI events logged as log records in the span's context,
    // exported as `resourceLogs` lines beside the `resourceSpans` lines.
    let file = fixture("openai-v2-client.jsonl");
    assert_eq!(
        Format::detect(&file, &std::fs::read(&file).unwrap()),
        Some(Format::Otel),
        "a logs export request first is OTLP too"
    );
    let store = tempfile::tempdir().unwrap();
    let report = run(
        store.path(),
        std::slice::from_ref(&file),
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (3, 3, 0),
        "7 calls of 3 runs, their 30 events on their spans: {report:?}"
    );
    let episodes = seen_episodes(store.path());
    assert_client_only_runs(
        store.path(),
        &episodes,
        ["C-3001", "C-3002", "C-3003"],
        "in transit",
        "Order C-3002 is in transit.",
    );

    // The same log records again in a second file (a retried export, a copy): read once.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("logs-again.jsonl");
    let text = std::fs::read_to_string(&file).unwrap();
    let logs_only: String = text
        .lines()
        .filter(|l| l.contains("\"resourceLogs\""))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&copy, logs_only).unwrap();
    let again = dir.path().join("store");
    let report = run(&again, &[file.clone(), copy], &IngestOptions::default());
    assert_eq!((report.ingested, report.quarantined), (3, 0), "{report:?}");
    let twice = seen_episodes(&again);
    assert_eq!(
        twice.keys().collect::<Vec<_>>(),
        episodes.keys().collect::<Vec<_>>()
    );
    for (task, (seen, node)) in &twice {
        assert_eq!(seen, &episodes[task].0, "{task}");
        assert_eq!(node.id, episodes[task].1.id, "{task}: the same episode");
    }

    // The log lines without their spans: each event is quarantined with why, none dropped; a
    // log record that is no GenAI event is said too.
    let text = std::fs::read_to_string(&file).unwrap();
    let logs: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("\"resourceLogs\""))
        .collect();
    assert_eq!(logs.len(), 7);
    let dir = tempfile::tempdir().unwrap();
    let only_logs = dir.path().join("logs.jsonl");
    let mut lines: Vec<String> = logs.iter().map(|l| l.to_string()).collect();
    lines[0] = lines[0].replacen(
        "\"eventName\":\"gen_ai.system.message\"",
        "\"eventName\":\"app.started\"",
        1,
    );
    std::fs::write(&only_logs, lines.join("\n")).unwrap();
    let report = run(
        &dir.path().join("store"),
        &[only_logs],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (0, 30), "{report:?}");
    let reasons: Vec<String> = quarantined(&report)
        .iter()
        .map(|r| r["reason"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        reasons
            .iter()
            .filter(|r| r.contains("not among the spans read with it"))
            .count(),
        29
    );
    assert!(reasons
        .iter()
        .any(|r| r.contains("no GenAI event fluxmem reads (event name `app.started`)")));
}

#[test]
fn an_evaluation_logged_as_a_log_record_is_the_runs_logged_outcome() {
    // The openai-v2 fixture, and one more log line as an application that evaluates answers
    // online would emit it through the Logs API (`gen_ai.evaluation.result` in the context of
    // the model call it judged): here the answer to "Where is my order C-3002?", failed.
    let text = std::fs::read_to_string(fixture("openai-v2-client.jsonl")).unwrap();
    let spans: Vec<Value> = text
        .lines()
        .filter(|l| l.contains("\"resourceSpans\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let answered = &spans[4]["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
    let evaluation = serde_json::json!({"resourceLogs": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "acme-support"}}]},
        "scopeLogs": [{"scope": {"name": "acme.evals"}, "logRecords": [{
            "eventName": "gen_ai.evaluation.result",
            "traceId": answered["traceId"],
            "spanId": answered["spanId"],
            "attributes": [
                {"key": "gen_ai.evaluation.name", "value": {"stringValue": "answered"}},
                {"key": "gen_ai.evaluation.score.label", "value": {"stringValue": "fail"}},
                {"key": "gen_ai.evaluation.explanation", "value": {"stringValue": "the parcel was lost"}}
            ]
        }]}]
    }]});
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("with-evaluation.jsonl");
    std::fs::write(&file, format!("{text}{evaluation}\n")).unwrap();
    let report = run(
        &dir.path().join("store"),
        &[file],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (3, 0), "{report:?}");
    let episodes = seen_episodes(&dir.path().join("store"));
    let (seen, node) = &episodes["Where is my order C-3002?"];
    assert_eq!((seen.2, seen.3.as_str()), (Some(false), "logged"));
    assert_eq!(
        node.episode().unwrap().outcome.feedback.as_deref(),
        Some("evaluation answered: fail (the parcel was lost)")
    );
    let (seen, _) = &episodes["Please refund my order C-3001, it arrived broken."];
    assert_eq!(seen.3, "inferred", "the other runs are not evaluated");
}

#[test]
fn a_proxys_per_call_log_is_one_episode_per_agent_run() {
    let store = tempfile::tempdir().unwrap();
    let file = fixture("proxy-calls.jsonl");
    assert_eq!(
        Format::detect(&file, &std::fs::read(&file).unwrap()),
        Some(Format::OpenaiChat)
    );
    let report = run(store.path(), &[file], &IngestOptions::default());
    assert_eq!(
        (
            report.read,
            report.ingested,
            report.duplicates,
            report.quarantined
        ),
        (6, 2, 4, 0),
        "three calls a run: the last holds the run, the earlier ones add nothing: {report:?}"
    );
    let episodes = seen_episodes(store.path());
    let lookup = |id: &str| format!("{{\"order_id\": \"{id}\", \"status\": \"delivered\"}}");
    let (seen, node) = &episodes["Please refund order A-100."];
    assert_eq!(
        seen,
        &(
            vec![
                call("get_order", Some(&lookup("A-100"))),
                call("refund_order", Some("{\"refunded\": true}"))
            ],
            "Your refund is on its way.".to_string(),
            Some(true),
            "inferred".to_string()
        )
    );
    assert_eq!(node.metadata["layout"], "proxy");
    assert_eq!(node.metadata["versions"], 3);
    assert_eq!(
        node.metadata["tools"][1]["function"]["name"],
        "refund_order"
    );
    let (seen, _) = &episodes["Please refund order B-200."];
    assert_eq!(
        seen.0[1],
        call("refund_order", Some("Error: payment provider timeout"))
    );
    assert_eq!((seen.2, seen.3.as_str()), (Some(false), "inferred"));
    // Ingested again: nothing new.
    let again = run(
        store.path(),
        &[fixture("proxy-calls.jsonl")],
        &IngestOptions {
            reread: true,
            ..Default::default()
        },
    );
    assert_eq!((again.ingested, again.duplicates), (0, 6));
}

#[test]
fn the_openai_sdks_dumps_legacy_function_calls_and_langchain_dumps_keep_their_calls() {
    let store = tempfile::tempdir().unwrap();
    let files: Vec<PathBuf> = [
        "openai-model-dump.jsonl",
        "openai-function-call.jsonl",
        "langchain-messages.jsonl",
    ]
    .iter()
    .map(|f| fixture(f))
    .collect();
    for file in &files {
        assert_eq!(
            Format::detect(file, &std::fs::read(file).unwrap()),
            Some(Format::OpenaiChat),
            "{file:?}"
        );
    }
    let report = run(store.path(), &files, &IngestOptions::default());
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (5, 5, 0),
        "{report:?}"
    );
    // Each file's episodes: two dumps, one legacy conversation, two LangChain conversations.
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    let of_file = |file: &str| -> Vec<&fluxmem_graph::Node> {
        (graph.nodes.values())
            .filter(|n| n.kind() == NodeKind::Episodic && n.source_file.ends_with(file))
            .collect()
    };
    let counts: Vec<usize> = ["openai-model-dump.jsonl", "openai-function-call.jsonl"]
        .iter()
        .chain(["langchain-messages.jsonl"].iter())
        .map(|file| of_file(file).len())
        .collect();
    assert_eq!(counts, [2, 1, 2]);
    // The LangChain file's two conversations share their first message; the second (a bare
    // list, no system prompt) is a greeting, not a refund.
    let mut langchain: Vec<(usize, String)> = of_file("langchain-messages.jsonl")
        .iter()
        .map(|n| {
            let steps = &n.episode().unwrap().steps;
            let calls = steps.iter().map(|s| s.tool_calls.len()).sum();
            let last = steps.iter().rev().find(|s| !s.action.is_empty()).unwrap();
            (calls, last.action.clone())
        })
        .collect();
    langchain.sort();
    assert_eq!(
        langchain,
        [
            (0, "Hello! How can I help?".to_string()),
            (2, "Done: order D-400 is refunded.".to_string())
        ]
    );
    let episodes = seen_episodes(store.path());
    let by_id = |id: &str| {
        episodes
            .values()
            .find(|(_, n)| n.metadata.get("conversation_id").and_then(Value::as_str) == Some(id))
            .unwrap_or_else(|| panic!("no episode {id}"))
    };
    // model_dump() with nulls kept and left out: the same calls.
    for id in ["dump-nulls", "dump-no-nulls"] {
        let names: Vec<&str> = by_id(id).0 .0.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["get_order", "refund_order"], "{id}");
    }
    let (_, tooled) = by_id("dump-no-nulls");
    assert_eq!(tooled.metadata["parallel_tool_calls"], false);
    assert_eq!(tooled.metadata["tools"][0]["function"]["name"], "get_order");
    // Legacy function calling: the call's name, arguments and result.
    let (seen, node) = by_id("legacy-1");
    assert_eq!(
        seen.0,
        vec![call("get_order", Some("{\"status\": \"delivered\"}"))]
    );
    let arguments = &node.episode().unwrap().steps[0].tool_calls[0].arguments;
    assert_eq!(arguments, "{\"order_id\": \"C-300\"}");
    // LangChain: types mapped, tool calls with their ids and results, the system prompt shared.
    // (Keyed by task, `episodes` keeps one of the two conversations that share this one: the
    // refund, which sorts last.)
    let (seen, node) = &episodes["Please refund order D-400."];
    assert_eq!(
        seen.0,
        vec![
            call("get_order", Some("{\"status\": \"delivered\"}")),
            call("refund_order", Some("{\"refunded\": true}"))
        ]
    );
    assert_eq!(seen.1, "Done: order D-400 is refunded.");
    assert_eq!(node.metadata["layout"], "langchain");
    let arguments = &node.episode().unwrap().steps[0].tool_calls[0].arguments;
    assert_eq!(
        serde_json::from_str::<Value>(arguments).unwrap(),
        serde_json::json!({"order_id": "D-400"})
    );
}

#[test]
fn a_conversation_logged_again_longer_is_one_episode_with_the_new_turns() {
    let store = tempfile::tempdir().unwrap();
    let report = run(
        store.path(),
        &[fixture("openai-grown.jsonl")],
        &IngestOptions::default(),
    );
    assert_eq!(
        (report.read, report.ingested, report.duplicates),
        (2, 1, 1),
        "{report:?}"
    );
    let episodes = seen_episodes(store.path());
    let (seen, node) = &episodes["Please refund order A-100."];
    assert_eq!(
        seen.1, "Order A-101 has not shipped yet.",
        "the later, longer version"
    );
    assert_eq!(node.metadata["versions"], 2);
    // A version with the same id that is not a prefix contradicts it: its own episode, marked.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("conflict.jsonl");
    std::fs::write(
        &file,
        concat!(
            r#"{"id": "c", "messages": [{"role": "user", "content": "refund 1"}, {"role": "assistant", "content": "done"}]}"#,
            "\n",
            r#"{"id": "c", "messages": [{"role": "user", "content": "refund 2"}, {"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]}"#,
            "\n"
        ),
    )
    .unwrap();
    let report = run(
        &dir.path().join("store"),
        &[file],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.duplicates), (2, 0), "{report:?}");
    let episodes = seen_episodes(&dir.path().join("store"));
    let (_, shorter) = &episodes["refund 1"];
    assert!(
        shorter.metadata["conflicts_with"]
            .as_str()
            .unwrap()
            .contains("line 2"),
        "{:?}",
        shorter.metadata
    );
}

#[test]
fn spans_fluxmem_does_not_read_are_quarantined_with_what_they_were_never_an_empty_episode() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("phoenix.json");
    // OpenInference spans of kinds that carry no step (a retrieval inside a chain), with no
    // gen_ai.* attribute.
    let span = |id: &str, kind: &str| {
        serde_json::json!({
            "traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": id, "name": kind,
            "startTimeUnixNano": "1767225600000000000",
            "attributes": [
                {"key": "openinference.span.kind", "value": {"stringValue": kind}},
                {"key": "input.value", "value": {"stringValue": "hi"}}
            ]
        })
    };
    let doc = serde_json::json!({"resourceSpans": [{"scopeSpans": [{"spans": [
        span("b7ad6b7169203331", "CHAIN"), span("b7ad6b7169203332", "RETRIEVER")
    ]}]}]});
    std::fs::write(&file, doc.to_string()).unwrap();
    let report = run(
        &dir.path().join("store"),
        &[file],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (0, 1), "{report:?}");
    let reason = quarantined(&report)[0]["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.contains("no task and no step")
            && reason.contains("openinference.span.kind=CHAIN")
            && reason.contains("openinference.span.kind=RETRIEVER"),
        "{reason}"
    );
}

#[test]
fn pydantic_ai_runs_are_episodes_with_retries_errors_and_outcomes() {
    // Written by pydantic-ai's own instrumentation, versions 5 and 6, with a scripted model
    // (scripts/fixtures/pydantic_ai_traces.py): `invoke_agent`, `chat` and `execute_tool` spans;
    // a tool that asks the model to retry, and a tool that raises and fails the run.
    let store = tempfile::tempdir().unwrap();
    let file = fixture("pydantic-ai.jsonl");
    assert_eq!(
        Format::detect(&file, &std::fs::read(&file).unwrap()),
        Some(Format::Otel)
    );
    let report = run(store.path(), &[file], &IngestOptions::default());
    assert_eq!(
        (report.read, report.ingested, report.quarantined),
        (6, 6, 0),
        "one episode per run and instrumentation version: {report:?}"
    );
    let graph = fluxmem_store::Store::open(store.path())
        .unwrap()
        .load()
        .unwrap();
    let mut by_task: std::collections::BTreeMap<&str, Vec<&fluxmem_graph::Node>> =
        Default::default();
    for node in graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Episodic)
    {
        by_task.entry(node.text.as_str()).or_default().push(node);
    }
    let seen = |node: &fluxmem_graph::Node| -> Seen {
        let episode = node.episode().unwrap();
        (
            episode
                .steps
                .iter()
                .flat_map(|s| {
                    s.tool_calls
                        .iter()
                        .map(|c| (c.name.clone(), c.result.clone()))
                })
                .collect(),
            episode
                .steps
                .iter()
                .rev()
                .find(|s| !s.action.is_empty())
                .map(|s| s.action.clone())
                .unwrap_or_default(),
            episode.outcome.success,
            node.outcome_source().to_string(),
        )
    };
    let expected: [(&str, Seen); 3] = [
        (
            "Please refund my order C-3001, it arrived broken.",
            (
                vec![
                    call(
                        "get_order",
                        Some("{\"order_id\": \"C-3001\", \"status\": \"delivered\"}"),
                    ),
                    call(
                        "refund_order",
                        Some("{\"order_id\": \"C-3001\", \"refunded\": true}"),
                    ),
                ],
                "Your order C-3001 is refunded.".to_string(),
                Some(true),
                "inferred".to_string(),
            ),
        ),
        (
            "Where is my order? The number is C-3999, or maybe C-3002.",
            (
                vec![
                    call(
                        "get_order",
                        Some("no order C-3999; ask the user for the right id"),
                    ),
                    call(
                        "get_order",
                        Some("{\"order_id\": \"C-3002\", \"status\": \"shipped\"}"),
                    ),
                ],
                "Order C-3002 has shipped.".to_string(),
                Some(true),
                "inferred".to_string(),
            ),
        ),
        (
            "Refund C-3002 please.",
            (
                vec![
                    call(
                        "get_order",
                        Some("{\"order_id\": \"C-3002\", \"status\": \"shipped\"}"),
                    ),
                    call("refund_order", None),
                ],
                String::new(),
                Some(false),
                "status".to_string(),
            ),
        ),
    ];
    for (task, want) in &expected {
        let runs = &by_task[task];
        assert_eq!(runs.len(), 2, "{task}: versions 5 and 6");
        for node in runs {
            assert_eq!(&seen(node), want, "{task}");
            assert_eq!(node.tenant, "acme-support");
            assert!(node.metadata["conversation_id"]
                .as_str()
                .is_some_and(|id| !id.is_empty()));
        }
    }
    // The retried call says why, and the raising tool's step carries the exception.
    for node in &by_task["Where is my order? The number is C-3999, or maybe C-3002."] {
        let feedback = node.episode().unwrap().steps[0].feedback.as_deref();
        assert!(
            feedback.is_some_and(|f| f.contains("no order C-3999")),
            "{feedback:?}"
        );
    }
    for node in &by_task["Refund C-3002 please."] {
        let steps = &node.episode().unwrap().steps;
        assert!(steps[1]
            .feedback
            .as_deref()
            .is_some_and(|f| f.contains("refund of C-3002 refused: not delivered")));
        assert!(node
            .episode()
            .unwrap()
            .outcome
            .feedback
            .as_deref()
            .is_some_and(|f| f.contains("not delivered")));
    }
    // The system prompt is the tenant's one semantic node.
    let facts: Vec<&fluxmem_graph::Node> = graph
        .nodes
        .values()
        .filter(|n| n.episode().is_none())
        .collect();
    assert_eq!(facts.len(), 1);
    assert!(facts[0]
        .text
        .contains("Look an order up before changing it"));
}

#[test]
fn a_conversation_that_grows_in_a_later_batch_replaces_its_stored_version() {
    // The fixture's two versions of one conversation, logged on two nights.
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = std::fs::read_to_string(fixture("openai-grown.jsonl"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let (first, second) = (
        dir.path().join("night-1.jsonl"),
        dir.path().join("night-2.jsonl"),
    );
    std::fs::write(&first, format!("{}\n", lines[0])).unwrap();
    std::fs::write(&second, format!("{}\n", lines[1])).unwrap();
    let store = dir.path().join("store");
    let night1 = run(
        &store,
        std::slice::from_ref(&first),
        &IngestOptions::default(),
    );
    assert_eq!((night1.ingested, night1.grown), (1, 0), "{night1:?}");
    let before = seen_episodes(&store);
    let (short, node) = &before["Please refund order A-100."];
    let id = node.id.clone();
    let night2 = run(&store, &[second], &IngestOptions::default());
    assert_eq!(
        (
            night2.read,
            night2.ingested,
            night2.grown,
            night2.duplicates,
            night2.nodes_added
        ),
        (1, 1, 1, 0, 0),
        "the longer version is not a duplicate: {night2:?}"
    );
    let after = seen_episodes(&store);
    assert_eq!(after.len(), before.len(), "one episode, not two");
    let (long, grown) = &after["Please refund order A-100."];
    assert_eq!(grown.id, id, "the same identity");
    assert_eq!(
        long.1, "Order A-101 has not shipped yet.",
        "the new turns are stored"
    );
    let steps = |n: &fluxmem_graph::Node| n.episode().unwrap().steps.len();
    assert!(steps(grown) > steps(node), "{short:?} -> {long:?}");
    assert_eq!(grown.metadata["versions"], 2);
    // The edit log says what changed, with the version it replaced.
    let graph = fluxmem_store::Store::open(&store).unwrap().load().unwrap();
    let edits: Vec<&fluxmem_graph::Edit> = graph
        .edits
        .iter()
        .filter(|e| e.kind == "episode_grown")
        .collect();
    assert_eq!(edits.len(), 1);
    assert_eq!(edits[0].target, format!("node:{id}"));
    assert!(edits[0]
        .before
        .as_deref()
        .is_some_and(|b| b.contains("A-100")));
    // The shorter version again, a night later: nothing new.
    let late = dir.path().join("late.jsonl");
    std::fs::write(&late, format!("{}\n", lines[0])).unwrap();
    let night3 = run(&store, &[late], &IngestOptions::default());
    assert_eq!((night3.ingested, night3.duplicates), (0, 1), "{night3:?}");
    // A version with the same id that is not a prefix: an episode of its own, marked.
    let mut other: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    other["messages"][1]["content"] = "Please refund order Z-999.".into();
    let conflict = dir.path().join("conflict.jsonl");
    std::fs::write(&conflict, format!("{other}\n")).unwrap();
    let night4 = run(&store, &[conflict], &IngestOptions::default());
    assert_eq!((night4.ingested, night4.conflicting), (1, 1), "{night4:?}");
    let episodes = seen_episodes(&store);
    let (_, apart) = &episodes["Please refund order Z-999."];
    assert_ne!(apart.id, id);
    assert_eq!(apart.metadata["conflicts_with"], id.to_string());
    assert_eq!(
        episodes["Please refund order A-100."].1.metadata["versions"],
        2
    );
    // The same contradicting version again (another file): a duplicate, not a second episode.
    let again = dir.path().join("conflict-again.jsonl");
    std::fs::write(&again, format!("{other}\n")).unwrap();
    let night5 = run(&store, &[again], &IngestOptions::default());
    assert_eq!(
        (night5.ingested, night5.conflicting, night5.duplicates),
        (0, 0, 1),
        "{night5:?}"
    );
    // That divergent conversation logged again, longer: it grows its own episode.
    let mut longer = other.clone();
    for message in [
        serde_json::json!({"role": "user", "content": "and B-200 too"}),
        serde_json::json!({"role": "assistant", "content": "Looking B-200 up."}),
    ] {
        longer["messages"].as_array_mut().unwrap().push(message);
    }
    let grown_apart = dir.path().join("conflict-longer.jsonl");
    std::fs::write(&grown_apart, format!("{longer}\n")).unwrap();
    let night6 = run(&store, &[grown_apart], &IngestOptions::default());
    assert_eq!(
        (night6.ingested, night6.grown, night6.conflicting),
        (1, 1, 0),
        "{night6:?}"
    );
    let episodes = seen_episodes(&store);
    assert_eq!(
        episodes.len(),
        2,
        "the conversation and its divergent version"
    );
    let (_, apart_now) = &episodes["Please refund order Z-999."];
    assert_eq!(apart_now.id, apart.id);
    assert_eq!(apart_now.metadata["versions"], 2);
}

#[test]
fn a_conversations_next_turn_traced_on_another_night_continues_its_episode() {
    // pydantic-ai (scripts/fixtures/pydantic_ai_traces.py): one conversation of two turns, the
    // second run continuing the first's message history, a trace a turn, a turn a file.
    let turns = [
        fixture("pydantic-ai-turn-1.jsonl"),
        fixture("pydantic-ai-turn-2.jsonl"),
    ];
    let steps_of = |store: &Path| -> Vec<(Option<String>, String)> {
        let episodes = seen_episodes(store);
        assert_eq!(episodes.len(), 1, "one conversation, one episode");
        let (_, node) = episodes.values().next().unwrap();
        node.episode()
            .unwrap()
            .steps
            .iter()
            .map(|s| {
                (
                    s.tool_calls.first().map(|c| c.name.clone()),
                    s.action.clone(),
                )
            })
            .collect()
    };
    // Both turns in one batch: one episode.
    let together = tempfile::tempdir().unwrap();
    let report = run(together.path(), &turns, &IngestOptions::default());
    assert_eq!((report.ingested, report.grown), (1, 0), "{report:?}");
    let whole = steps_of(together.path());
    assert_eq!(
        whole,
        [
            (Some("get_order".to_string()), String::new()),
            (None, "Order C-3001 was delivered yesterday.".to_string()),
            (Some("refund_order".to_string()), String::new()),
            (None, "Your order C-3001 is refunded.".to_string()),
        ]
    );
    // A turn a night: the second night's turn continues the stored episode.
    let nights = tempfile::tempdir().unwrap();
    run(nights.path(), &turns[..1], &IngestOptions::default());
    assert_eq!(steps_of(nights.path()).len(), 2);
    let night2 = run(nights.path(), &turns[1..], &IngestOptions::default());
    assert_eq!(
        (
            night2.ingested,
            night2.grown,
            night2.conflicting,
            night2.duplicates
        ),
        (1, 1, 0, 0),
        "{night2:?}"
    );
    assert_eq!(
        steps_of(nights.path()),
        whole,
        "the same episode as in one batch"
    );
    let episodes = seen_episodes(nights.path());
    let (seen, node) = episodes.values().next().unwrap();
    assert_eq!(node.metadata["versions"], 2);
    assert_eq!((seen.2, seen.3.as_str()), (Some(true), "inferred"));
}

#[test]
fn an_evaluation_event_on_a_run_is_its_logged_outcome() {
    // pydantic-ai runs an application evaluates online (scripts/fixtures/pydantic_ai_traces.py):
    // the GenAI conventions' `gen_ai.evaluation.result` event on the agent span; one answer
    // judged correct, one incorrect, one not evaluated.
    let store = tempfile::tempdir().unwrap();
    let report = run(
        store.path(),
        &[fixture("pydantic-ai-evaluated.jsonl")],
        &IngestOptions::default(),
    );
    assert_eq!((report.ingested, report.quarantined), (3, 0), "{report:?}");
    let episodes = seen_episodes(store.path());
    let outcome = |task: &str| {
        let (seen, node) = &episodes[task];
        (
            seen.2,
            seen.3.clone(),
            node.episode().unwrap().outcome.feedback.clone(),
        )
    };
    assert_eq!(
        outcome("What is the status of order C-3001?"),
        (
            Some(true),
            "logged".to_string(),
            Some("evaluation Correctness: pass (the status matches the order record)".to_string())
        )
    );
    assert_eq!(
        outcome("What is the status of order C-3002?"),
        (
            Some(false),
            "logged".to_string(),
            Some(
                "evaluation Correctness: fail (the order record says shipped, not delivered)"
                    .to_string()
            )
        ),
        "the agent answered, and the rule would call it a success: the evaluation decides"
    );
    let (success, source, _) = outcome("Is order C-3001 delivered?");
    assert_eq!((success, source.as_str()), (Some(true), "inferred"));
}

#[test]
fn a_sharded_night_reads_only_the_files_its_shards_have_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("store");
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let write_log = |name: &str, first: usize| {
        let lines: String = (first..first + 6)
            .map(|i| {
                format!(
                    "{{\"episode_id\":\"e{i}\",\"task\":\"refund order {i}\",\"steps\":[{{\"observation\":\"please refund {i}\",\"action\":\"refund\"}}],\"outcome\":{{\"success\":true}}}}\n"
                )
            })
            .collect();
        std::fs::write(logs.join(name), lines).unwrap();
    };
    // One night, two shards into staging stores, then the merge.
    let night = |run: &str| -> Vec<IngestReport> {
        let reports = (0..2)
            .map(|index| {
                let shard = fluxmem_store::Shard { index, count: 2 };
                let mut writer = Writer::open_staging(&main, "ingest", shard).unwrap();
                let options = IngestOptions {
                    shard,
                    ..IngestOptions::default()
                };
                let report = ingest(
                    &mut writer,
                    std::slice::from_ref(&logs),
                    &options,
                    run,
                    &mut NoProgress,
                )
                .unwrap();
                writer.finish_staging(run).unwrap();
                report
            })
            .collect();
        Writer::open(&main)
            .unwrap()
            .merge_staging("ingest", 2, fluxmem_store::CommitInfo::default())
            .unwrap();
        reports
    };
    write_log("monday.jsonl", 0);
    let first = night("night-1");
    assert_eq!(
        first
            .iter()
            .map(|r| (r.files, r.unchanged_files))
            .collect::<Vec<_>>(),
        [(1, 0), (1, 0)]
    );
    assert_eq!(first.iter().map(|r| r.ingested).sum::<u64>(), 6);
    // The next night: one new file; each shard reads it alone.
    write_log("tuesday.jsonl", 6);
    let second = night("night-2");
    assert_eq!(
        second
            .iter()
            .map(|r| (r.files, r.unchanged_files))
            .collect::<Vec<_>>(),
        [(1, 1), (1, 1)],
        "{second:?}"
    );
    assert_eq!(second.iter().map(|r| r.ingested).sum::<u64>(), 6);
    assert_eq!(seen_episodes(&main).len(), 12);
    // The ledger's name is one the merge carries to the main store.
    assert!(fluxmem_store::CARRIED_LOGS.contains(&fluxmem_ingest::LEDGER));
}
