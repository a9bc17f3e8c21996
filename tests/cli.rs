//! End-to-end tests of the `fluxmem` binary: the README's main job, exit codes, kill-and-resume,
//! lock contention, and reading the shards from Python (pyarrow, DuckDB).

use fluxmem_graph::{Embedding, Graph, NodeId, NodeKind};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::walk;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fluxmem(store: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_fluxmem"));
    command
        .arg("--store")
        .arg(store)
        .arg("--no-progress")
        .env_remove("FLUXMEM_FAULT");
    command
}

fn run(command: &mut Command) -> Output {
    command.output().expect("the fluxmem binary runs")
}

/// Ingests the sample trajectories and knowledge files into `store`.
fn ingest_samples(store: &Path) {
    let output = run(fluxmem(store)
        .arg("ingest")
        .arg(repo().join("data/trajectories.jsonl"))
        .arg(repo().join("data/knowledge")));
    assert_succeeded(&output);
}

/// The command succeeded; its stderr is the failure message otherwise (reported at the caller).
#[track_caller]
fn assert_succeeded(output: &Output) {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn stdout_json(output: &Output) -> Value {
    let text = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {text}\nstderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

#[test]
fn main_job_on_the_samples_ingests_and_prints_stats() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let output = run(fluxmem(&store).arg("ingest").arg(repo().join("data")));
    assert_succeeded(&output);
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("0 quarantined"), "{text}");
    let stats = stdout_json(&run(fluxmem(&store).args(["stats", "--json"])));
    // 7 JSONL episodes, 4 tau-bench runs, 6 ALFWorld transcripts, 5 chat conversations, 2 OTel agent runs.
    assert_eq!(stats["nodes"]["episodic"], 7 + 4 + 6 + 5 + 2, "{stats}");
    assert_eq!(stats["nodes"]["procedural"], 0);
    assert_eq!(
        stats["edges"],
        serde_json::json!({"ground": 0, "distill": 0, "link": 0})
    );
    assert_eq!(stats["embedded"], 0);
    assert!(stats["manifest_version"].as_u64().unwrap() >= 1);
    let again = stdout_json(&run(fluxmem(&store)
        .args(["ingest", "--json"])
        .arg(repo().join("data"))));
    assert_eq!(again["ingested"], 0, "{again}");
    assert_eq!(again["duplicates"], again["read"]);
    assert_eq!(again["quarantine_file"], Value::Null);
}

#[test]
fn quarantine_sets_exit_status_3_and_the_json_contract() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let output = run(fluxmem(&store)
        .args(["ingest", "--json"])
        .arg(repo().join("tests/data/malformed/episodes.jsonl")));
    assert_eq!(
        output.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report = stdout_json(&output);
    for key in [
        "read",
        "ingested",
        "duplicates",
        "quarantined",
        "quarantine_file",
    ] {
        assert!(report.get(key).is_some(), "missing {key}: {report}");
    }
    assert_eq!(report["read"], 12);
    assert_eq!(report["quarantined"], 10);
    let quarantine = PathBuf::from(report["quarantine_file"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(quarantine).unwrap().lines().count(),
        10
    );
    let missing = run(fluxmem(&store).args(["ingest", "/definitely/not/here.jsonl"]));
    assert_eq!(
        missing.status.code(),
        Some(3),
        "a missing input is quarantined, not fatal"
    );
    let bad_format = run(fluxmem(&store).args(["ingest", "--format", "csv", "x"]));
    assert_eq!(bad_format.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad_format.stderr).contains("unknown format `csv`"));
}

/// `ingest --json` prints every count of the run: a conversation logged again, longer, on the
/// next night is counted as grown, and every record read is counted once.
#[test]
fn ingest_json_prints_every_count_grown_versions_too() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let log =
        std::fs::read_to_string(repo().join("tests/data/formats/openai-grown.jsonl")).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 2, "the conversation, then its longer version");
    let mut reports = Vec::new();
    for (night, line) in lines.iter().enumerate() {
        let file = dir.path().join(format!("night-{night}.jsonl"));
        std::fs::write(&file, format!("{line}\n")).unwrap();
        reports.push(stdout_json(&run(fluxmem(&store)
            .args(["ingest", "--json"])
            .arg(&file))));
    }
    for report in &reports {
        let count = |key: &str| {
            report[key]
                .as_u64()
                .unwrap_or_else(|| panic!("{key}: {report}"))
        };
        assert_eq!(
            count("read"),
            count("ingested") + count("duplicates") + count("quarantined") + count("other_shards"),
            "{report}"
        );
        assert_eq!((count("files"), count("conflicting")), (1, 0), "{report}");
    }
    assert_eq!(reports[0]["grown"], 0, "{}", reports[0]);
    assert_eq!(
        (&reports[1]["ingested"], &reports[1]["grown"]),
        (&Value::from(1), &Value::from(1)),
        "{}",
        reports[1]
    );
}

#[test]
fn stats_on_a_missing_store_says_how_to_create_one() {
    let dir = tempfile::tempdir().unwrap();
    let output = run(fluxmem(&dir.path().join("nope")).arg("stats"));
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("fluxmem ingest"));
}

#[test]
fn a_held_lock_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let writer = fluxmem_store::Writer::open(&store).unwrap();
    let output = run(fluxmem(&store)
        .arg("ingest")
        .arg(repo().join("data/trajectories.jsonl")));
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("locked by another writer")
            && stderr.contains(&format!("pid {}", std::process::id())),
        "{stderr}"
    );
    drop(writer);
    assert!(run(fluxmem(&store)
        .arg("ingest")
        .arg(repo().join("data/trajectories.jsonl")))
    .status
    .success());
}

/// Inputs that take several commits: the samples in every format plus a tiny LoCoMo
/// conversation (all in the repo), 3 records a commit.
fn resume_inputs() -> Vec<PathBuf> {
    vec![
        repo().join("data"),
        repo().join("tests/data/locomo/tiny_locomo.json"),
    ]
}

fn ingest_cmd(store: &Path) -> Command {
    let mut command = fluxmem(store);
    command
        .args(["ingest", "--batch-records", "3"])
        .args(resume_inputs());
    command
}

/// The committed content of a store: every live shard's file name, rows and checksum.
fn shard_list(store: &Path) -> Vec<(String, u64, String)> {
    let manifest = fluxmem_store::Store::open(store)
        .unwrap()
        .manifest()
        .unwrap();
    manifest
        .shards
        .into_iter()
        .map(|s| (s.file, s.rows, s.sha256))
        .collect()
}

#[test]
fn killed_ingest_resumes_to_exactly_the_uninterrupted_store() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference");
    assert!(run(&mut ingest_cmd(&reference)).status.success());
    let expected = shard_list(&reference);
    let expected_graph = fluxmem_store::Store::open(&reference)
        .unwrap()
        .load()
        .unwrap();
    let commits = fluxmem_store::Store::open(&reference)
        .unwrap()
        .manifest()
        .unwrap()
        .version;
    assert!(commits >= 8, "the input spans several commits ({commits})");

    // A crash exactly between the shard writes and the manifest rename of each commit, and
    // right after each rename.
    for version in 1..=commits {
        for point in ["before-manifest", "after-manifest"] {
            let store = dir.path().join(format!("crash-{point}-{version}"));
            let crashed =
                run(ingest_cmd(&store).env("FLUXMEM_FAULT", format!("{point}:{version}")));
            assert!(
                !crashed.status.success(),
                "the fault at {point}:{version} fired"
            );
            let resumed = run(&mut ingest_cmd(&store));
            assert_succeeded(&resumed);
            assert!(
                String::from_utf8_lossy(&resumed.stderr).contains("stale store lock"),
                "the crash left a stale lock"
            );
            assert_eq!(
                shard_list(&store),
                expected,
                "store after a crash at {point}:{version} and a re-run"
            );
            let orphans = std::fs::read_dir(store.join("shards")).unwrap().count();
            assert_eq!(orphans, expected.len(), "no leftover shard files");
            std::fs::remove_dir_all(&store).unwrap();
        }
    }

    // SIGKILL at arbitrary moments.
    let fresh = |_: &Path| {};
    let killed = Killed {
        dir: dir.path(),
        expected: &expected,
        expected_graph: &expected_graph,
    };
    killed.resume_after_sigkill(&[5, 15, 30, 60, 120], &fresh, &ingest_cmd);
}

/// A stage's store after an uninterrupted run, to compare killed runs with.
struct Killed<'a> {
    dir: &'a Path,
    expected: &'a [(String, u64, String)],
    expected_graph: &'a fluxmem_graph::Graph,
}

impl Killed<'_> {
    /// For each delay: a store made by `prepare`, `command` on it killed (SIGKILL) after the
    /// delay, then run again to the end; the store must be the uninterrupted one.
    fn resume_after_sigkill(
        &self,
        delays_ms: &[u64],
        prepare: &dyn Fn(&Path),
        command: &dyn Fn(&Path) -> Command,
    ) {
        for &delay_ms in delays_ms {
            let store = self.dir.join(format!("kill-{delay_ms}"));
            prepare(&store);
            let mut child = command(&store).spawn().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(delay_ms));
            let _ = child.kill();
            let _ = child.wait();
            let resumed = run(&mut command(&store));
            assert_succeeded(&resumed);
            assert_eq!(
                shard_list(&store),
                self.expected,
                "store after SIGKILL at {delay_ms} ms and a re-run"
            );
            assert_eq!(
                &fluxmem_store::Store::open(&store).unwrap().load().unwrap(),
                self.expected_graph
            );
        }
    }
}

fn python() -> PathBuf {
    if let Ok(python) = std::env::var("FLUXMEM_PYTHON") {
        return PathBuf::from(python);
    }
    let venv = repo().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with pyarrow and duckdb: run `python3 -m venv .venv && .venv/bin/pip install -r tests/python/requirements.txt` \
         (or `bash scripts/test.sh`, which does it), or set FLUXMEM_PYTHON"
    );
    venv
}

#[test]
fn shards_are_plain_parquet_for_pyarrow_and_duckdb() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let output = run(fluxmem(&store)
        .arg("ingest")
        .arg(repo().join("tests/data/locomo/tiny_locomo.json"))
        .arg(repo().join("data")));
    assert_succeeded(&output);
    // Embeddings come from the embed stage; here a few known vectors exercise the column type.
    let mut writer = fluxmem_store::Writer::open(&store).unwrap();
    let graph = writer.store().load().unwrap();
    let mut embeddings = Graph::default();
    for (i, id) in graph.nodes.keys().take(10).enumerate() {
        let vector = (0..8).map(|j| (i * 8 + j) as f32 / 100.0).collect();
        embeddings.upsert_embedding(Embedding {
            node_id: id.clone(),
            model_id: "test".into(),
            text_sha256: "x".into(),
            vector,
        });
    }
    writer
        .commit(
            &embeddings,
            fluxmem_store::CommitInfo {
                stage: "test".into(),
                ..Default::default()
            },
        )
        .unwrap();
    drop(writer);
    let count = |kind| graph.nodes.values().filter(|n| n.kind() == kind).count();
    let first_vector_value = embeddings.embeddings.values().next().unwrap().vector[0];
    let expected = serde_json::json!({
        "nodes": {"semantic": count(NodeKind::Semantic), "episodic": count(NodeKind::Episodic), "procedural": 0},
        "embedding_dim": 8,
        "embeddings": 10,
        "first_vector_value": first_vector_value,
        "probe": {"locator": "tiny-1/D1:1", "text": "Alice: I adopted a puppy from the shelter last week"},
    });
    let output = run(Command::new(python())
        .arg(repo().join("tests/python/read_shards.py"))
        .arg(&store)
        .arg(expected.to_string()));
    assert!(
        output.status.success(),
        "python reader failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("ok:"));
}

/// Shards that an external writer rewrote with pyarrow's defaults (the Parquet standard's
/// `element` list items, no embedded Arrow schema) read back as the same graph.
#[test]
fn shards_rewritten_by_pyarrow_read_back_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let output = run(fluxmem(&store).arg("ingest").arg(repo().join("data")));
    assert_succeeded(&output);
    let before = fluxmem_store::Store::open(&store).unwrap().load().unwrap();
    let output = run(Command::new(python())
        .arg(repo().join("tests/python/rewrite_shards.py"))
        .arg(&store));
    assert_succeeded(&output);
    let after = fluxmem_store::Store::open(&store)
        .unwrap()
        .load()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(after, before);
}

#[test]
fn help_explains_every_flag() {
    let output = run(Command::new(env!("CARGO_BIN_EXE_fluxmem")).args(["ingest", "--help"]));
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--format",
        "--tenant",
        "--agent",
        "--max-record-bytes",
        "--json",
        "--store",
        "--no-progress",
        "--batch-records",
    ] {
        assert!(help.contains(flag), "ingest --help lacks {flag}");
    }
    let output = run(Command::new(env!("CARGO_BIN_EXE_fluxmem")).arg("--help"));
    assert!(String::from_utf8_lossy(&output.stdout).contains("Exit status"));
}

#[test]
fn export_skills_twice_is_byte_identical_and_bad_flags_exit_1() {
    use fluxmem_graph::{Node, NodeBody, Skill};
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let mut graph = Graph::default();
    let body = NodeBody::Procedural(Skill {
        version: 1,
        previous_versions: vec![],
        source_episodes: vec!["epi-a".into()],
        pems_history: vec![0.3, 0.31],
    });
    let mut node = Node::new(
        body,
        "default",
        "Name: Clean \"it\"\nDescription: d\nSteps:\n1. wash\n",
        &["skill", "v1", "epi-a"],
    );
    for (key, value) in [
        ("name", serde_json::json!("Clean \"it\"")),
        ("description", serde_json::json!("d: when\ndirty")),
        ("steps", serde_json::json!(["wash"])),
    ] {
        node.metadata.insert(key.into(), value);
    }
    graph.upsert_node(node);
    let mut writer = fluxmem_store::Writer::open(&store).unwrap();
    writer
        .commit(
            &graph,
            fluxmem_store::CommitInfo {
                stage: "test".into(),
                ..Default::default()
            },
        )
        .unwrap();
    drop(writer);
    let read_all = |out: &Path| {
        let mut files: Vec<(String, Vec<u8>)> = Vec::new();
        for path in [out.join("release.json"), out.join("clean-it/SKILL.md")] {
            files.push((path.display().to_string(), std::fs::read(&path).unwrap()));
        }
        files
            .into_iter()
            .map(|(_, bytes)| bytes)
            .collect::<Vec<_>>()
    };
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for out in [&a, &b] {
        let output = run(fluxmem(&store)
            .args([
                "export", "skills", "--format", "skill-md", "--json", "--out",
            ])
            .arg(out));
        assert_succeeded(&output);
        assert_eq!(stdout_json(&output)["skills"], 1);
    }
    assert_eq!(read_all(&a), read_all(&b));
    let skill_md = String::from_utf8(read_all(&a)[1].clone()).unwrap();
    assert!(
        skill_md.contains("description: \"d: when\\ndirty\"\n"),
        "{skill_md}"
    );
    assert!(
        skill_md.contains("\nmetadata:\n  title: \"Clean \\\"it\\\"\"\n"),
        "{skill_md}"
    );
    assert!(skill_md.contains("\n  pems: \"0.31\"\n"), "{skill_md}");
    let bad = run(fluxmem(&store)
        .args(["export", "skills", "--format", "yaml", "--out"])
        .arg(dir.path().join("c")));
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("expected skill-md, jsonl or parquet"));
    let bad = run(fluxmem(&store).args(["consolidate", "--clusters", "zero"]));
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--clusters `zero`"));
}

/// The embedder gives the same bits with one thread as with two: the matrix-product kernels
/// split rows and columns over threads, never the reduced dimension.
#[test]
fn embeddings_are_the_same_bits_at_any_thread_count() {
    let texts = [
        "get_reservation_details then cancel_reservation",
        "ok",
        "The refund goes to the original payment method within 7 days.",
    ];
    let embed = |threads: &str| {
        let output = run(Command::new(env!("CARGO_BIN_EXE_fluxmem"))
            .args(["models", "embed"])
            .args(texts)
            .env("RAYON_NUM_THREADS", threads));
        assert_succeeded(&output);
        output.stdout
    };
    let one = embed("1");
    assert!(one.len() > 1000, "vectors printed");
    assert_eq!(
        one,
        embed("2"),
        "1 thread and 2 threads give identical vectors"
    );
}

/// Greedy generation gives the same text with one thread as with two, with the weights the
/// demo uses (`q8`) and with the f32 path: the logits are the same bits (the quantized dot
/// products run whole rows per thread; the f32 kernels never split a reduction).
#[test]
fn generation_is_the_same_at_any_thread_count() {
    let prompt = "List three steps to cancel a flight reservation.";
    for weights in ["q8", "dequantized"] {
        let generate = |threads: &str| {
            let output = run(Command::new(env!("CARGO_BIN_EXE_fluxmem"))
                .args([
                    "models",
                    "generate",
                    "--model",
                    "smollm2-135m-instruct-q4_1",
                    "--device",
                    "cpu",
                    "--max-tokens",
                    "48",
                    "--weights",
                    weights,
                    prompt,
                ])
                .env("RAYON_NUM_THREADS", threads));
            assert_succeeded(&output);
            String::from_utf8(output.stdout).unwrap()
        };
        let one = generate("1");
        assert!(one.split_whitespace().count() > 5, "a real answer: {one:?}");
        assert_eq!(
            one,
            generate("2"),
            "{weights}: 1 thread and 2 threads give the same text"
        );
    }
}

#[test]
fn non_finite_and_out_of_range_numbers_are_refused_before_the_store_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    assert!(run(fluxmem(&store)
        .arg("ingest")
        .arg(repo().join("data/trajectories.jsonl")))
    .status
    .success());
    let before = shard_list(&store);
    let out = dir.path().join("out");
    let out_flag = format!("--out={}", out.display());
    let cases: [(&[&str], &str); 18] = [
        (
            &["refine", "--prior", "inf"],
            "--prior `inf`: must be a finite number greater than zero",
        ),
        (
            &["refine", "--prior", "0"],
            "--prior `0`: must be a finite number greater than zero",
        ),
        (
            &["refine", "--prune-below", "nan"],
            "--prune-below `NaN`: must be a finite number",
        ),
        (
            &["refine", "--prune-below=-0.5"],
            "--prune-below `-0.5`: must be a finite number, zero or more",
        ),
        (
            &["connect", "--weights", "1,NaN,0.3"],
            "--weights `NaN`: must be a finite number",
        ),
        (
            &["connect", "--weights", "1,0.5,inf"],
            "--weights `inf`: must be a finite number",
        ),
        (
            &["connect", "--weights=1,-0.5,0.3"],
            "--weights `-0.5`: must be a finite number, zero or more",
        ),
        (
            &["consolidate", "--epsilon", "inf"],
            "--epsilon `inf`: must be a finite number",
        ),
        (
            &["consolidate", "--epsilon=-0.01"],
            "--epsilon `-0.01`: must be a finite number, zero or more",
        ),
        (
            &["export", "skills", "--min-pems", "nan", out_flag.as_str()],
            "--min-pems `NaN`: must be a finite number",
        ),
        (
            &["export", "skills", "--min-pems=-inf", out_flag.as_str()],
            "--min-pems `-inf`: must be a finite number",
        ),
        (
            &["query", "--adjacency", "nan", "refund"],
            "--adjacency `NaN`: must be a finite number",
        ),
        (
            &["query", "--adjacency=-0.3", "refund"],
            "--adjacency `-0.3`: must be a finite number, zero or more",
        ),
        (
            &["query", "--entity", "inf", "refund"],
            "--entity `inf`: must be a finite number",
        ),
        (
            &[
                "query",
                "--sufficient-at=-0.2",
                "--refine-rounds",
                "1",
                "refund",
            ],
            "--sufficient-at `-0.2`: must be a finite number, zero or more",
        ),
        (
            &[
                "query",
                "--merge-above=-0.9",
                "--refine-rounds",
                "1",
                "refund",
            ],
            "--merge-above `-0.9`: must be a finite number, zero or more",
        ),
        (
            &["eval", "locomo", "--data", "x.json", "--merge-above", "nan"],
            "--merge-above `NaN`: must be a finite number",
        ),
        (
            &["query", "--units", "prev", "refund"],
            "units `prev`: expected plain, context, or a comma list of previous and stem",
        ),
    ];
    for (args, message) in cases {
        let output = run(fluxmem(&store).args(args));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(1),
            "{args:?}: a flag value that is not valid is exit status 1: {stderr}"
        );
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert_eq!(
            shard_list(&store),
            before,
            "{args:?}: the store is untouched"
        );
        assert!(!out.exists(), "{args:?}: nothing exported");
    }
    // A store that does not exist is not created either.
    let missing = dir.path().join("missing");
    let output = run(fluxmem(&missing).args(["refine", "--prior", "inf"]));
    assert_eq!(output.status.code(), Some(1));
    assert!(!missing.exists(), "refine --prior inf created no store");
}

#[test]
fn export_skills_checks_the_output_directory_before_loading_the_store() {
    let dir = tempfile::tempdir().unwrap();
    // No store at all: the output directory is what is wrong, and it is said first.
    let store = dir.path().join("no-store");
    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let busy = dir.path().join("busy");
    std::fs::create_dir(&busy).unwrap();
    std::fs::write(busy.join("notes.txt"), "mine").unwrap();
    for (out, why) in [
        (&file, "exists and is not a directory"),
        (&busy, "holds no release.json"),
    ] {
        let output = run(fluxmem(&store).args(["export", "skills", "--out"]).arg(out));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("--out")
                && stderr.contains(&out.display().to_string())
                && stderr.contains(why),
            "{stderr}"
        );
        assert!(
            !stderr.contains("fluxmem ingest"),
            "not the missing-store error: {stderr}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(busy.join("notes.txt")).unwrap(),
        "mine"
    );
    assert!(!store.exists());
}

/// Two tenants' episodes and facts whose texts overlap; globex holds a secret.
const TWO_TENANTS: &str = r#"{"type":"fact","tenant":"acme","text":"Refunds of damaged orders go back to the original card within 30 days."}
{"type":"fact","tenant":"acme","text":"An address can be changed while the order is still processing."}
{"type":"fact","tenant":"globex","text":"Tenant B secret: refund damaged orders to card 4111 1111 1111 1111."}
{"type":"fact","tenant":"globex","text":"Globex ships every order from the Springfield warehouse."}
{"tenant":"acme","episode_id":"a1","task":"Refund damaged order 1042 to the card","steps":[{"observation":"User: my order arrived damaged, refund it to my card","action":"Issuing the refund."}],"outcome":{"success":true}}
{"tenant":"acme","episode_id":"a2","task":"Change the address of order 1100","steps":[{"observation":"User: please change the address of my order","action":"Address updated."}],"outcome":{"success":false}}
{"tenant":"globex","episode_id":"b1","task":"Refund damaged order 77 to card 4111","steps":[{"observation":"User: my order arrived damaged, refund it to card 4111","action":"Issuing the refund."}],"outcome":{"success":true}}
{"tenant":"globex","episode_id":"b2","task":"Refund damaged order 78 to the card","steps":[{"observation":"User: refund my damaged order to my card","action":"Issuing the refund."}],"outcome":{"success":false}}
"#;

/// Facts in sections, said by two speakers, and episodes whose steps ask about them (one names
/// a speaker).
const SERVED: &str = r#"{"type":"fact","tenant":"acme","source":"handbook","section":"refunds","position":0,"speaker":"Dana","text":"Refunds go back to the card the order was paid with."}
{"type":"fact","tenant":"acme","source":"handbook","section":"refunds","position":1,"speaker":"Lee","text":"Only within thirty days of delivery."}
{"type":"fact","tenant":"acme","source":"handbook","section":"refunds","position":2,"speaker":"Dana","text":"A damaged parcel needs a photo first."}
{"type":"fact","tenant":"acme","source":"handbook","section":"shipping","position":0,"speaker":"Lee","text":"Parcels leave the warehouse within two days."}
{"type":"fact","tenant":"acme","source":"handbook","section":"shipping","position":1,"speaker":"Dana","text":"Express delivery costs twelve dollars."}
{"type":"fact","tenant":"acme","source":"handbook","section":"shipping","position":2,"speaker":"Lee","text":"Addresses can change until the parcel leaves."}
{"type":"fact","tenant":"acme","source":"faq","position":0,"text":"Gift cards are never refunded to a card."}
{"type":"fact","tenant":"acme","source":"faq","position":1,"text":"A refund takes five business days to appear."}
{"tenant":"acme","episode_id":"e1","task":"Refund a damaged parcel","steps":[{"observation":"User: my parcel arrived damaged, can I get a refund to my card?","action":"ask for a photo"},{"observation":"User: here is the photo of the damaged parcel","action":"refund"}],"outcome":{"success":true}}
{"tenant":"acme","episode_id":"e2","task":"Change an address","steps":[{"observation":"User: what did Dana say about express delivery?","action":"answer"},{"observation":"User: can I still change the address of my parcel?","action":"update_address"}],"outcome":{"success":true}}
{"tenant":"acme","episode_id":"e3","task":"Refund timing","steps":[{"observation":"User: how many days until my refund shows up?","action":"answer"}],"outcome":{"success":false}}
"#;

/// The memory the night builds is the memory that is served: connect's ground edges for an
/// episode are `query`'s top facts (its `--ground-k` best) for the texts of the episode's
/// steps, with the same defaults on both sides (context units, neighbours in a section, a
/// speaker a step names), and each edge's weight is the best score query gives the fact. A
/// store connected with other settings (plain retrieval) is served with them: query follows
/// the retrieval connect recorded. On this data the two settings rank differently, so the
/// equality does not hold by accident.
#[test]
fn connect_grounds_each_step_with_the_facts_query_serves_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("served.jsonl");
    std::fs::write(&input, SERVED).unwrap();
    let plain = ["--units", "plain", "--adjacency", "0", "--entity", "0"];
    let serving = [
        "--units",
        "context",
        "--adjacency",
        "0.3",
        "--entity",
        "0.3",
    ];
    // Connect with the defaults, then with plain retrieval: query, given no flag, ranks as
    // the store's connect did (it records its retrieval); the other setting ranks otherwise.
    for (name, connect_flags, other) in [("store", &[][..], plain), ("plain", &plain[..], serving)]
    {
        let store = dir.path().join(name);
        let mut connect = vec!["connect", "--model", "hash-48", "--link-k", "0"];
        connect.extend_from_slice(connect_flags);
        for args in [
            vec!["ingest", input.to_str().unwrap()],
            vec!["embed", "--model", "hash-48"],
            connect,
        ] {
            assert_succeeded(&run(fluxmem(&store).args(&args)));
        }
        let graph = fluxmem_store::Store::open(&store).unwrap().load().unwrap();
        // query's semantic items for `text`, best first: (node, score).
        let served = |text: &str, extra: &[&str]| -> Vec<(NodeId, f32)> {
            let mut args = vec![
                "query",
                "--model",
                "hash-48",
                "--episodes",
                "0",
                "--budget",
                "100000",
                "--json",
            ];
            args.extend_from_slice(extra);
            args.push(text);
            let output = run(fluxmem(&store).args(&args));
            assert_succeeded(&output);
            let context = stdout_json(&output);
            let mut items: Vec<&Value> = context["items"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|item| item["kind"] == "semantic")
                .collect();
            items.sort_by_key(|item| item["rank"].as_u64().unwrap());
            items
                .iter()
                .map(|item| {
                    (
                        NodeId(item["node_id"].as_str().unwrap().to_string()),
                        item["score"].as_f64().unwrap() as f32,
                    )
                })
                .collect()
        };
        let mut other_differs = false;
        let mut episodes = 0;
        for episode in graph
            .nodes
            .values()
            .filter(|n| n.kind() == NodeKind::Episodic)
        {
            episodes += 1;
            let mut expected: std::collections::BTreeMap<NodeId, f32> = Default::default();
            for step in &episode.episode().unwrap().steps {
                let top: Vec<(NodeId, f32)> =
                    served(&step.observation, &[]).into_iter().take(2).collect();
                assert_eq!(top.len(), 2, "{}", step.observation);
                let otherwise: Vec<NodeId> = served(&step.observation, &other)
                    .into_iter()
                    .take(2)
                    .map(|(id, _)| id)
                    .collect();
                other_differs |=
                    otherwise != top.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>();
                for (id, score) in top {
                    let best = expected.entry(id).or_insert(score);
                    *best = best.max(score);
                }
            }
            let grounded: std::collections::BTreeMap<NodeId, f32> = graph
                .edges
                .values()
                .filter(|e| e.kind == fluxmem_graph::EdgeKind::Ground && e.dst == episode.id)
                .map(|e| (e.src.clone(), e.weight))
                .collect();
            assert_eq!(
                grounded.keys().collect::<Vec<_>>(),
                expected.keys().collect::<Vec<_>>(),
                "episode {}: connect's ground edges are query's top facts",
                episode.id
            );
            for (id, weight) in &grounded {
                assert!(
                    (weight - expected[id]).abs() < 1e-5,
                    "{id}: edge weight {weight}, query's score {}",
                    expected[id]
                );
            }
        }
        assert_eq!(episodes, 3);
        assert!(
            other_differs,
            "{name}: the other retrieval ranks these steps the same: the test shows nothing"
        );
    }
}

/// Tenants never mix: connect and refine write no cross-tenant edge, `query` needs `--tenant`
/// on a store with two tenants (naming both), answers only from that tenant, and answers from
/// what is embedded when some node is not, saying how many it left out.
#[test]
fn query_answers_from_one_tenant_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let input = dir.path().join("two.jsonl");
    std::fs::write(&input, TWO_TENANTS).unwrap();
    let stderr = |output: &Output| String::from_utf8_lossy(&output.stderr).to_string();
    for args in [
        vec!["ingest", input.to_str().unwrap()],
        vec!["embed", "--device", "cpu"],
        vec!["connect", "--device", "cpu"],
        vec!["refine"],
    ] {
        let output = run(fluxmem(&store).args(&args));
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
    }
    let graph = fluxmem_store::Store::open(&store).unwrap().load().unwrap();
    assert!(graph
        .edges
        .values()
        .any(|e| e.kind == fluxmem_graph::EdgeKind::Ground));
    for edge in graph.edges.values() {
        let (src, dst) = (&graph.nodes[&edge.src], &graph.nodes[&edge.dst]);
        assert_eq!(
            src.tenant, dst.tenant,
            "{:?} edge {:?} -> {:?} joins two tenants",
            edge.kind, src.text, dst.text
        );
    }

    let question = "refund my damaged order to my card";
    let unnamed = run(fluxmem(&store).args(["query", "--device", "cpu", question]));
    assert_eq!(unnamed.status.code(), Some(1), "{}", stderr(&unnamed));
    let message = stderr(&unnamed);
    assert!(
        message.contains("acme, globex") && message.contains("--tenant"),
        "{message}"
    );
    let unknown =
        run(fluxmem(&store).args(["query", "--device", "cpu", "--tenant", "initech", question]));
    assert_eq!(unknown.status.code(), Some(1));
    assert!(
        stderr(&unknown).contains("initech") && stderr(&unknown).contains("acme, globex"),
        "{}",
        stderr(&unknown)
    );

    let answer = run(fluxmem(&store).args([
        "query", "--device", "cpu", "--tenant", "acme", "--json", question,
    ]));
    assert!(answer.status.success(), "{}", stderr(&answer));
    assert!(
        !String::from_utf8_lossy(&answer.stdout).contains("4111"),
        "tenant B's secret leaked"
    );
    let context = stdout_json(&answer);
    assert_eq!(
        (&context["tenant"], &context["not_embedded"]),
        (&Value::from("acme"), &Value::from(0))
    );
    let items = context["items"].as_array().unwrap();
    assert_eq!(
        items.len(),
        4,
        "acme's two episodes and two facts: {context}"
    );
    assert!(
        items.iter().all(|item| item["tenant"] == "acme"),
        "{context}"
    );
    // The other tenant's data changes nothing: the same answer from a store of acme alone
    // (query reads its tenant's rows only, and every stage works within a tenant).
    let alone = dir.path().join("alone");
    let acme_only = dir.path().join("acme.jsonl");
    let acme_lines: String = TWO_TENANTS
        .lines()
        .filter(|l| l.contains("\"acme\""))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&acme_only, acme_lines).unwrap();
    for args in [
        vec!["ingest", acme_only.to_str().unwrap()],
        vec!["embed", "--device", "cpu"],
        vec!["connect", "--device", "cpu"],
        vec!["refine"],
    ] {
        let output = run(fluxmem(&alone).args(&args));
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
    }
    let alone_answer = run(fluxmem(&alone).args([
        "query", "--device", "cpu", "--tenant", "acme", "--json", question,
    ]));
    assert!(alone_answer.status.success(), "{}", stderr(&alone_answer));
    // Compared without where each item came from (the input file and line, which a fact's id
    // also holds): the same items, ranks, scores, signals and reasons.
    let answer_of = |context: &Value| -> Vec<Value> {
        context["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| {
                let mut item = item.clone();
                let object = item.as_object_mut().unwrap();
                object.remove("source");
                object.remove("node_id");
                item
            })
            .collect()
    };
    assert_eq!(answer_of(&stdout_json(&alone_answer)), answer_of(&context));

    // A fact ingested after embedding: the query answers from the rest and says so.
    let late = dir.path().join("late.jsonl");
    std::fs::write(
        &late,
        "{\"type\":\"fact\",\"tenant\":\"acme\",\"text\":\"Refunds over 500 need a manager.\"}\n",
    )
    .unwrap();
    assert!(run(fluxmem(&store).arg("ingest").arg(&late))
        .status
        .success());
    let partial = run(fluxmem(&store).args([
        "query", "--device", "cpu", "--tenant", "acme", "--json", question,
    ]));
    assert!(partial.status.success(), "{}", stderr(&partial));
    assert!(
        stderr(&partial).contains("1 nodes of tenant `acme`")
            && stderr(&partial).contains("fluxmem embed"),
        "{}",
        stderr(&partial)
    );
    let context = stdout_json(&partial);
    assert_eq!(context["not_embedded"], 1);
    assert_eq!(
        context["items"].as_array().unwrap().len(),
        4,
        "the embedded items only"
    );
}

/// `--wait S`: a writer that finds the lock held waits for it (saying so) instead of failing,
/// and still fails with the holder named when the lock is not released in time.
#[test]
fn wait_takes_the_lock_when_the_holder_lets_go() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let writer = fluxmem_store::Writer::open(&store).unwrap();
    let output = run(fluxmem(&store)
        .args(["--wait", "1", "ingest"])
        .arg(repo().join("data/trajectories.jsonl")));
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("waiting up to 1s") && stderr.contains("locked by another writer"),
        "{stderr}"
    );
    let child = fluxmem(&store)
        .args(["--wait", "60", "ingest"])
        .arg(repo().join("data/trajectories.jsonl"))
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    drop(writer);
    let output = child.wait_with_output().unwrap();
    assert_succeeded(&output);
    assert!(String::from_utf8_lossy(&output.stderr)
        .contains("waiting up to 60s for the store lock held by pid"));
}

/// A store of ten nights where each night rewrites part of the previous rows, compacted by
/// `fluxmem store compact`: killed before and after its manifest write it resumes to the same
/// store as an uninterrupted compaction; DuckDB reading the listed shards by the upsert rule
/// sees the same live rows before and after; amplification ends at most 1.5.
#[test]
fn compaction_keeps_the_live_rows_for_duckdb_and_resumes_after_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let build = |store: &Path| {
        ingest_samples(store);
        let mut writer = fluxmem_store::Writer::open(store).unwrap();
        let graph = writer.store().load().unwrap();
        let ids: Vec<NodeId> = graph.nodes.keys().cloned().collect();
        for night in 0..10u32 {
            let mut delta = Graph::default();
            for (i, id) in ids
                .iter()
                .enumerate()
                .filter(|(i, _)| (i + night as usize).is_multiple_of(2))
            {
                let vector = (0..8)
                    .map(|j| (night * 8 + j) as f32 + i as f32 / 1000.0)
                    .collect();
                delta.upsert_embedding(Embedding {
                    node_id: id.clone(),
                    model_id: "test".into(),
                    text_sha256: format!("{night}"),
                    vector,
                });
                let mut node = graph.nodes[id].clone();
                node.metadata.insert("night".into(), night.into());
                delta.upsert_node(node);
            }
            writer
                .commit(
                    &delta,
                    fluxmem_store::CommitInfo {
                        stage: "night".into(),
                        ..Default::default()
                    },
                )
                .unwrap();
        }
    };
    let live = |store: &Path| {
        let output = run(Command::new(python())
            .arg(repo().join("tests/python/live_rows.py"))
            .arg(store));
        assert_succeeded(&output);
        stdout_json(&output)
    };
    let compact = |store: &Path| run(fluxmem(store).args(["store", "compact", "--json"]));
    let reference = dir.path().join("reference");
    build(&reference);
    let before = live(&reference);
    let graph_before = fluxmem_store::Store::open(&reference)
        .unwrap()
        .load()
        .unwrap();
    let version = fluxmem_store::Store::open(&reference)
        .unwrap()
        .manifest()
        .unwrap()
        .version;
    let output = compact(&reference);
    assert_succeeded(&output);
    let report = stdout_json(&output);
    assert_eq!(report["committed"], true, "{report}");
    for table in ["nodes", "embeddings"] {
        let t = &report["tables"][table];
        let amp = t["rows_after"].as_f64().unwrap() / t["live_rows"].as_f64().unwrap();
        assert!(
            amp <= 1.5 && t["rows_before"].as_u64() > t["rows_after"].as_u64(),
            "{table}: {t}"
        );
    }
    assert_eq!(
        live(&reference),
        before,
        "DuckDB sees the same live rows after compaction"
    );
    assert_eq!(
        fluxmem_store::Store::open(&reference)
            .unwrap()
            .load()
            .unwrap(),
        graph_before
    );
    let expected = shard_list(&reference);
    // Killed in the window between shards and manifest, and just after the manifest.
    for point in ["before-manifest", "after-manifest"] {
        let store = dir.path().join(point);
        build(&store);
        let crashed = run(fluxmem(&store)
            .args(["store", "compact"])
            .env("FLUXMEM_FAULT", format!("{point}:{}", version + 1)));
        assert!(!crashed.status.success(), "the fault at {point} fired");
        let resumed = compact(&store);
        assert_succeeded(&resumed);
        assert_eq!(
            shard_list(&store),
            expected,
            "after a kill at {point} and a re-run"
        );
        assert_eq!(live(&store), before, "{point}");
        let manifest = fluxmem_store::Store::open(&store)
            .unwrap()
            .manifest()
            .unwrap();
        let on_disk = std::fs::read_dir(store.join("shards")).unwrap().count();
        assert_eq!(
            on_disk,
            manifest.shards.len() + manifest.retired.len(),
            "{point}: no leftover of the killed compaction"
        );
    }
}

/// `--model hash-<dim>` runs embed and connect without weights (what `benches/scale
/// --embedder` uses): every node gets a vector of that model and dimension, connect writes
/// edges from them, and a malformed name is refused before the store is touched.
#[test]
fn the_hash_embedder_runs_embed_and_connect_without_weights() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    ingest_samples(&store);
    let output = run(fluxmem(&store).args(["embed", "--json", "--model", "hash-48"]));
    assert_succeeded(&output);
    let report = stdout_json(&output);
    assert_eq!(report["model"], "hash-48");
    let graph = fluxmem_store::Store::open(&store).unwrap().load().unwrap();
    assert!(!graph.nodes.is_empty());
    assert_eq!(
        graph.embeddings.len(),
        graph.nodes.len(),
        "every node has a vector"
    );
    assert!(graph
        .embeddings
        .values()
        .all(|e| e.model_id == "hash-48" && e.vector.len() == 48));
    let output = run(fluxmem(&store).args(["connect", "--json", "--model", "hash-48"]));
    assert_succeeded(&output);
    let report = stdout_json(&output);
    assert!(
        report["connected"].as_u64().unwrap() > 0 && report["ground_edges"].as_u64().unwrap() > 0,
        "{report}"
    );
    let version = fluxmem_store::Store::open(&store)
        .unwrap()
        .manifest()
        .unwrap()
        .version;
    for bad in ["hash-", "hash-0", "hash-x"] {
        let output = run(fluxmem(&store).args(["embed", "--model", bad]));
        assert_eq!(output.status.code(), Some(1), "{bad}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("hash-<dim>"),
            "{bad}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    assert_eq!(
        fluxmem_store::Store::open(&store)
            .unwrap()
            .manifest()
            .unwrap()
            .version,
        version,
        "refused runs leave the store as it was"
    );
}

/// The live edges without the run that wrote them, and the refine edit log as (kind, target,
/// before, after, reason), in log order, the records' run ids left out.
#[allow(clippy::type_complexity)] // (edges, edit rows) as the assertions compare them
fn refined(
    store: &Path,
) -> (
    Vec<fluxmem_graph::Edge>,
    Vec<(String, String, Option<String>, Option<String>, String)>,
) {
    let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
    let edges = graph.edges.into_values().map(|mut e| {
        e.run_id.clear();
        e
    });
    // The JSON of a record without its run id (a resumed run has its own).
    let strip = |json: Option<String>| {
        json.map(|text| {
            let mut value: Value = serde_json::from_str(&text).unwrap();
            value.as_object_mut().unwrap().remove("run_id");
            value.to_string()
        })
    };
    let edits = graph
        .edits
        .into_iter()
        .filter(|e| e.stage == "refine")
        .map(|e| (e.kind, e.target, strip(e.before), strip(e.after), e.reason));
    (edges.collect(), edits.collect())
}

/// Refine commits `--commit-every` edges at a time, in key order: many small commits leave the
/// same edges and the same edit log as one, and a run killed after its first commit resumes
/// to them too.
#[test]
fn refine_in_small_commits_gives_the_one_commit_store_and_resumes_after_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let connected = dir.path().join("connected");
    ingest_samples(&connected);
    for stage in ["embed", "connect"] {
        let output = run(fluxmem(&connected).args([stage, "--model", "hash-48"]));
        assert_succeeded(&output);
    }
    let copy = |name: &str| {
        let to = dir.path().join(name);
        std::fs::create_dir_all(to.join("shards")).unwrap();
        copy_tree(&connected, &to);
        to
    };
    let version = fluxmem_store::Store::open(&connected)
        .unwrap()
        .manifest()
        .unwrap()
        .version;
    let one = copy("one");
    let output = run(fluxmem(&one).args(["refine", "--json"]));
    assert_succeeded(&output);
    let report = stdout_json(&output);
    let edits = report["edits"].as_u64().unwrap();
    assert!(edits > 20 && report["commits"] == 1, "{report}");
    let expected = refined(&one);

    let small = copy("small");
    let output = run(fluxmem(&small).args(["refine", "--json", "--commit-every", "7"]));
    assert_succeeded(&output);
    // A commit ends between two sources only: 7 edges or more a commit.
    let commits = stdout_json(&output)["commits"].as_u64().unwrap();
    assert!(
        commits > 1 && commits <= edits.div_ceil(7),
        "{commits} commits for {edits} edits"
    );
    assert_eq!(
        refined(&small),
        expected,
        "7 edges a commit, the same store"
    );

    let killed = copy("killed");
    let crashed = run(fluxmem(&killed)
        .args(["refine", "--commit-every", "7"])
        .env("FLUXMEM_FAULT", format!("after-manifest:{}", version + 1)));
    assert!(!crashed.status.success(), "the fault fired");
    let manifest = fluxmem_store::Store::open(&killed)
        .unwrap()
        .manifest()
        .unwrap();
    assert_eq!(manifest.version, version + 1, "one commit landed");
    let landed = manifest.commits.last().unwrap().summary["edits"]
        .as_u64()
        .unwrap();
    assert!(landed >= 7 && landed < edits, "{landed}");
    let resumed = run(fluxmem(&killed).args(["refine", "--json", "--commit-every", "7"]));
    assert_succeeded(&resumed);
    assert_eq!(
        stdout_json(&resumed)["edits"].as_u64().unwrap(),
        edits - landed,
        "the rest of the changes, none twice"
    );
    assert_eq!(
        refined(&killed),
        expected,
        "killed after the first commit and resumed: the same store"
    );
    assert_eq!(
        credit_stats(&killed),
        credit_stats(&one),
        "and the same credit statistics"
    );
    // Issue 40.10: the resumed run carries on under the run id of the run it finishes (its
    // edges and edits are labelled as the uninterrupted run's are).
    let run_ids = |store: &Path| {
        let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
        let edges: Vec<(String, String)> = graph
            .edges
            .values()
            .map(|e| (format!("{}>{}", e.src, e.dst), e.run_id.clone()))
            .collect();
        let edits: std::collections::BTreeSet<String> = graph
            .edits
            .iter()
            .filter(|e| e.stage == "refine")
            .map(|e| e.run_id.clone())
            .collect();
        (edges, edits)
    };
    let (small_ids, killed_ids) = (run_ids(&small), run_ids(&killed));
    assert_eq!(small_ids.1.len(), 1, "one refine run: {:?}", small_ids.1);
    assert_eq!(killed_ids, small_ids, "the same run ids after a kill");
}

/// Copies every file under `from` to the same place under `to` (a store, for runs side by side).
fn copy_tree(from: &Path, to: &Path) {
    for entry in walk(from) {
        let target = to.join(entry.strip_prefix(from).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &target).unwrap();
    }
}

/// Every semantic node's stored credit statistics (`credit_stats`), by id.
fn credit_stats(store: &Path) -> std::collections::BTreeMap<String, Value> {
    let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
    graph
        .nodes
        .into_values()
        .filter_map(|n| {
            n.metadata
                .get(fluxmem_refine::STATS_KEY)
                .map(|v| (n.id.to_string(), v.clone()))
        })
        .collect()
}

/// A second night's refine reads what the night added (the watermark of the first), commits in
/// small chunks, and a run killed after its first commit resumes to the edges, edit log and
/// credit statistics of an uninterrupted run, which equal those of a run that reads every edge.
#[test]
fn a_delta_refine_killed_after_a_commit_resumes_to_the_full_result() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = std::fs::read_to_string(repo().join("data/trajectories.jsonl"))
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    // Night 1: episodes of both tenants; night 2: the rest.
    #[allow(clippy::type_complexity)] // the two nights' numbered lines
    let (first, second): (Vec<(usize, &String)>, Vec<(usize, &String)>) = lines
        .iter()
        .enumerate()
        .partition(|(i, _)| [0, 1, 2, 5].contains(i));
    let write = |name: &str, rows: &[(usize, &String)]| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            rows.iter()
                .map(|(_, l)| format!("{l}\n"))
                .collect::<String>(),
        )
        .unwrap();
        path
    };
    let (night1, night2) = (
        write("night1.jsonl", &first),
        write("night2.jsonl", &second),
    );
    let base = dir.path().join("base");
    let stage = |store: &Path, args: &[&str]| {
        let output = run(fluxmem(store).args(args));
        assert!(
            output.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        output
    };
    stage(
        &base,
        &[
            "ingest",
            night1.to_str().unwrap(),
            repo().join("data/knowledge").to_str().unwrap(),
        ],
    );
    stage(&base, &["embed", "--model", "hash-48"]);
    stage(&base, &["connect", "--model", "hash-48"]);
    // A prior that holds through the second night's outcomes: the night reads what it added.
    stage(&base, &["refine", "--prior-drift", "1"]);
    stage(&base, &["ingest", night2.to_str().unwrap()]);
    stage(&base, &["embed", "--model", "hash-48"]);
    stage(&base, &["connect", "--model", "hash-48"]);
    let copy = |name: &str| {
        let to = dir.path().join(name);
        copy_tree(&base, &to);
        to
    };
    let version = fluxmem_store::Store::open(&base)
        .unwrap()
        .manifest()
        .unwrap()
        .version;
    let one = copy("one");
    // A night as large as the history: delta read all the same (--max-delta-share 1).
    let report = stdout_json(&stage(
        &one,
        &[
            "refine",
            "--json",
            "--prior-drift",
            "1",
            "--commit-every",
            "3",
            "--max-delta-share",
            "1",
        ],
    ));
    assert_eq!(report["delta"], Value::Bool(true), "{report}");
    let edits = report["edits"].as_u64().unwrap();
    assert!(
        edits > 6 && report["commits"].as_u64().unwrap() > 1,
        "{report}"
    );
    let full = copy("full");
    let report_full = stdout_json(&stage(
        &full,
        &["refine", "--json", "--prior-drift", "1", "--full"],
    ));
    assert_eq!(report_full["delta"], Value::Bool(false));
    assert!(
        report_full["edges_decided"].as_u64() > report["edges_decided"].as_u64(),
        "{report_full} {report}"
    );
    assert_eq!(
        refined(&full),
        refined(&one),
        "a delta run writes what a full run writes"
    );
    assert_eq!(credit_stats(&full), credit_stats(&one));

    let killed = copy("killed");
    let crashed = run(fluxmem(&killed)
        .args([
            "refine",
            "--prior-drift",
            "1",
            "--commit-every",
            "3",
            "--max-delta-share",
            "1",
        ])
        .env("FLUXMEM_FAULT", format!("after-manifest:{}", version + 1)));
    assert!(!crashed.status.success(), "the fault fired");
    let landed = fluxmem_store::Store::open(&killed)
        .unwrap()
        .manifest()
        .unwrap()
        .commits
        .last()
        .unwrap()
        .summary["edits"]
        .as_u64()
        .unwrap();
    assert!(landed > 0 && landed < edits, "{landed} of {edits}");
    let resumed = stdout_json(&stage(
        &killed,
        &[
            "refine",
            "--json",
            "--prior-drift",
            "1",
            "--commit-every",
            "3",
            "--max-delta-share",
            "1",
        ],
    ));
    assert_eq!(resumed["delta"], Value::Bool(true), "{resumed}");
    assert_eq!(
        resumed["edits"].as_u64().unwrap(),
        edits - landed,
        "the rest of the changes, none twice: {resumed}"
    );
    assert_eq!(
        refined(&killed),
        refined(&one),
        "killed after the first commit and resumed: the same store"
    );
    assert_eq!(credit_stats(&killed), credit_stats(&one));
    assert!(!credit_stats(&one).is_empty());
}

/// Issue 40.1: `consolidate` killed at every commit point (and by SIGKILL) and started again
/// ends with exactly the store of an uninterrupted run. With `--recluster-share 1` a run that
/// planned its clusters afresh would, on restart, fit the unfinished clusters' episodes into
/// the skills already made and never make the rest; the plan kept in the store prevents it.
#[test]
fn killed_consolidate_resumes_to_exactly_the_uninterrupted_store() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let output = run(fluxmem(&base).arg("ingest").arg(repo().join("data")));
    assert_succeeded(&output);
    let output = run(fluxmem(&base).args(["embed", "--model", "hash-48"]));
    assert_succeeded(&output);
    let before = fluxmem_store::Store::open(&base)
        .unwrap()
        .manifest()
        .unwrap()
        .version;
    let consolidate = |store: &Path| {
        let mut command = fluxmem(store);
        command.args([
            "consolidate",
            "--json",
            "--model",
            "hash-48",
            "--generator",
            "none",
            "--device",
            "cpu",
            "--recluster-share",
            "1",
        ]);
        command
    };
    let reference = dir.path().join("reference");
    copy_tree(&base, &reference);
    let output = run(&mut consolidate(&reference));
    assert_succeeded(&output);
    let report = stdout_json(&output);
    let commits = report["commits"].as_u64().unwrap();
    assert!(
        commits >= 3,
        "the samples give several cluster commits: {report}"
    );
    let expected = shard_list(&reference);
    let expected_graph = fluxmem_store::Store::open(&reference)
        .unwrap()
        .load()
        .unwrap();
    let after = fluxmem_store::Store::open(&reference)
        .unwrap()
        .manifest()
        .unwrap();
    assert_eq!(
        after.version,
        before + commits,
        "one commit per cluster, none more"
    );
    assert!(
        after
            .progress
            .get("consolidate.plan")
            .is_none_or(Value::is_null),
        "a finished run leaves no open plan"
    );
    // While a run is unfinished, the manifest names its plan's file (the plan itself, every
    // episode id of the night, is not in the manifest rewritten at every commit).
    let midway = dir.path().join("midway");
    copy_tree(&base, &midway);
    let crashed =
        run(consolidate(&midway).env("FLUXMEM_FAULT", format!("after-manifest:{}", before + 1)));
    assert!(!crashed.status.success());
    let open = fluxmem_store::Store::open(&midway)
        .unwrap()
        .manifest()
        .unwrap();
    let marker = &open.progress["consolidate.plan"];
    let file = marker["file"].as_str().unwrap();
    assert!(midway.join(file).is_file(), "{marker}");
    assert!(marker.get("clusters").is_none(), "{marker}");
    for version in before + 1..=before + commits {
        for point in ["before-manifest", "after-manifest"] {
            let store = dir.path().join(format!("crash-{point}-{version}"));
            copy_tree(&base, &store);
            let crashed =
                run(consolidate(&store).env("FLUXMEM_FAULT", format!("{point}:{version}")));
            assert!(
                !crashed.status.success(),
                "the fault at {point}:{version} fired"
            );
            let resumed = run(&mut consolidate(&store));
            assert_succeeded(&resumed);
            let resumed_report = stdout_json(&resumed);
            // The plan is open from the first commit until the last one closes it.
            let open = match point {
                "after-manifest" => version < before + commits,
                _ => version > before + 1,
            };
            assert_eq!(
                resumed_report["resumed"], open,
                "{point}:{version}: {resumed_report}"
            );
            assert_eq!(
                shard_list(&store),
                expected,
                "store after a crash at {point}:{version} and a re-run: {resumed_report}"
            );
            let plans = std::fs::read_dir(store.join("scratch/consolidate"))
                .map(|entries| entries.count())
                .unwrap_or(0);
            assert_eq!(plans, 0, "the finished run's plan file is gone");
            std::fs::remove_dir_all(&store).unwrap();
        }
    }
    let killed = Killed {
        dir: dir.path(),
        expected: &expected,
        expected_graph: &expected_graph,
    };
    killed.resume_after_sigkill(
        &[20, 60, 150],
        &|store: &Path| copy_tree(&base, store),
        &consolidate,
    );
}

/// `ingest --label-outcomes` with a real local model: the runs whose log says no outcome get
/// the model's (`judged`, with its probability and the model's name), a logged one keeps its
/// own, and the same log into another store gives the same probabilities.
#[test]
fn a_local_model_labels_the_outcomes_the_log_does_not_say() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("chats.jsonl");
    let lines = [
        r#"{"id": "logged", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "outcome": {"success": false}}"#,
        r#"{"id": "answered", "messages": [{"role": "user", "content": "Where is order 7?"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"id\": 7}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "{\"state\": \"sent\"}"}, {"role": "assistant", "content": "Order 7 was sent yesterday."}, {"role": "user", "content": "great, thanks"}]}"#,
        r#"{"id": "handed", "messages": [{"role": "user", "content": "a human please"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "escalate", "arguments": "{}"}}]}]}"#,
    ];
    std::fs::write(&log, lines.join("\n")).unwrap();
    let model = "smollm2-135m-instruct-q4_1";
    let label = |store: &Path| {
        let output = run(fluxmem(store)
            .args(["ingest", "--json", "--label-outcomes", model])
            .arg(&log));
        assert_succeeded(&output);
        let report = stdout_json(&output);
        assert_eq!(report["outcomes"]["judged"], 2, "{report}");
        assert_eq!(report["outcomes"]["logged"], 1, "{report}");
        assert_eq!(report["judge_errors"], 0, "{report}");
        assert_eq!(
            report["judge"]["calls"], 3,
            "the content-free log, then each run: {report}"
        );
        let graph = fluxmem_store::Store::open(store).unwrap().load().unwrap();
        let mut seen = std::collections::BTreeMap::new();
        for node in graph
            .nodes
            .values()
            .filter(|n| n.kind() == NodeKind::Episodic)
        {
            let id = node.metadata["conversation_id"]
                .as_str()
                .unwrap()
                .to_string();
            let p = node
                .metadata
                .get("outcome_probability")
                .and_then(Value::as_f64);
            if let Some(p) = p {
                assert!((0.0..=1.0).contains(&p), "{id}: {p}");
                assert_eq!(node.metadata["outcome_judge"], model);
                assert_eq!(
                    node.episode().unwrap().outcome.success,
                    Some(p >= 0.5),
                    "{id}: the outcome is the judge's answer"
                );
            }
            seen.insert(id, (node.outcome_source().to_string(), p));
        }
        assert_eq!(seen["logged"], ("logged".to_string(), None));
        assert_eq!(seen["answered"].0, "judged");
        assert_eq!(seen["handed"].0, "judged");
        seen
    };
    let first = label(&dir.path().join("a"));
    assert_eq!(
        first,
        label(&dir.path().join("b")),
        "the same log, the same labels"
    );
    // Query likelihood cannot answer yes or no: refused before the store is touched.
    let store = dir.path().join("c");
    let output = run(fluxmem(&store)
        .args(["ingest", "--label-outcomes", "ql"])
        .arg(&log));
    assert_eq!(output.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("a run is judged by yes or no"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!store.exists());
}

/// `query --tenant` reads its tenant's vector index (`store index`) while it is current and
/// answers byte for byte as from the shards; it does not use a stale index, and a damaged one
/// gets a warning naming the fix, and the same answer from the shards.
#[test]
fn a_query_answers_the_same_from_its_tenants_index() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let input = dir.path().join("two.jsonl");
    std::fs::write(&input, TWO_TENANTS).unwrap();
    let stderr = |output: &Output| String::from_utf8_lossy(&output.stderr).to_string();
    let night = |file: &Path| {
        for args in [
            vec!["ingest", file.to_str().unwrap()],
            vec!["embed", "--model", "hash-64"],
            vec!["connect", "--model", "hash-64"],
        ] {
            let output = run(fluxmem(&store).args(&args));
            assert!(output.status.success(), "{args:?}: {}", stderr(&output));
        }
    };
    night(&input);
    let question = "refund my damaged order to my card";
    let ask = || {
        let output = run(fluxmem(&store).args([
            "query", "--tenant", "acme", "--model", "hash-64", "--json", question,
        ]));
        assert!(output.status.success(), "{}", stderr(&output));
        output
    };
    let index = |extra: &[&str]| {
        let output = run(fluxmem(&store)
            .args(["store", "index", "--json"])
            .args(extra));
        assert!(output.status.success(), "{}", stderr(&output));
        let lines = String::from_utf8_lossy(&output.stdout).to_string();
        let hows: Vec<(String, String)> = (lines.lines())
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .map(|u| {
                (
                    u["tenant"].as_str().unwrap().into(),
                    u["how"].as_str().unwrap().into(),
                )
            })
            .collect();
        hows
    };
    let model_of = || {
        let manifest = fluxmem_store::Store::open(&store)
            .unwrap()
            .manifest()
            .unwrap();
        manifest.embedding_model.unwrap().id
    };
    let current = || {
        let manifest = fluxmem_store::Store::open(&store)
            .unwrap()
            .manifest()
            .unwrap();
        manifest.current_index("acme", &model_of()).cloned()
    };

    let from_shards = ask();
    let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        index(&[]),
        vec![pair("acme", "full"), pair("globex", "full")]
    );
    let entry = current().expect("acme's index is current");
    let from_index = ask();
    assert_eq!(from_index.stdout, from_shards.stdout);
    assert!(
        !stderr(&from_index).contains("warning"),
        "{}",
        stderr(&from_index)
    );

    // Damaged: a warning naming the file and the fix, and the same answer from the shards.
    let file = store.join(&entry.file);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[20] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let damaged = ask();
    assert_eq!(damaged.stdout, from_shards.stdout);
    let warning = stderr(&damaged);
    assert!(
        warning.contains("warning")
            && warning.contains(&entry.file)
            && warning.contains("--rebuild"),
        "{warning}"
    );
    assert_eq!(
        index(&[]),
        vec![pair("acme", "current"), pair("globex", "current")]
    );
    assert_eq!(
        index(&["--rebuild", "--tenant", "acme"]),
        vec![pair("acme", "full")]
    );
    assert!(!stderr(&ask()).contains("warning"));

    // A night of acme's makes its index stale: the query reads the shards, and answers as it
    // does from the index made again from the rows the night added.
    let more = dir.path().join("more.jsonl");
    std::fs::write(
        &more,
        r#"{"tenant":"acme","episode_id":"a3","task":"Refund damaged order 2001 to the card","steps":[{"observation":"User: my damaged order needs a refund to my card","action":"Issuing the refund."}],"outcome":{"success":true}}
"#,
    )
    .unwrap();
    night(&more);
    assert!(current().is_none(), "acme's index is stale after its night");
    let stale = ask();
    assert_ne!(
        stale.stdout, from_shards.stdout,
        "the new episode is in the answer"
    );
    assert_eq!(
        index(&[]),
        vec![pair("acme", "added"), pair("globex", "current")]
    );
    assert!(current().is_some());
    assert_eq!(ask().stdout, stale.stdout);
}
