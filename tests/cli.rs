//! End-to-end tests of the `fluxmem` binary: the README's main job, exit codes, kill-and-resume,
//! lock contention, and reading the shards from Python (pyarrow, DuckDB).

use fluxmem_graph::{Embedding, Graph, NodeKind};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn shared_data() -> PathBuf {
    let dir = repo().join("../shared/data");
    assert!(dir.is_dir(), "the dev data is expected at {} (the project's shared/ folder beside the repo)", dir.display());
    dir
}

fn fluxmem(store: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_fluxmem"));
    command.arg("--store").arg(store).arg("--no-progress").env_remove("FLUXMEM_FAULT");
    command
}

fn run(command: &mut Command) -> Output {
    command.output().expect("the fluxmem binary runs")
}

fn stdout_json(output: &Output) -> Value {
    let text = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {text}\nstderr: {}", String::from_utf8_lossy(&output.stderr)))
}

#[test]
fn main_job_on_the_samples_ingests_and_prints_stats() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let output = run(fluxmem(&store).arg("ingest").arg(repo().join("data")));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("0 quarantined"), "{text}");
    let stats = stdout_json(&run(fluxmem(&store).args(["stats", "--json"])));
    assert_eq!(stats["nodes"]["episodic"], 7 + 4 + 6, "{stats}");
    assert_eq!(stats["nodes"]["procedural"], 0);
    assert_eq!(stats["edges"], serde_json::json!({"ground": 0, "distill": 0, "link": 0}));
    assert_eq!(stats["embedded"], 0);
    assert!(stats["manifest_version"].as_u64().unwrap() >= 1);
    let again = stdout_json(&run(fluxmem(&store).args(["ingest", "--json"]).arg(repo().join("data"))));
    assert_eq!(again["ingested"], 0, "{again}");
    assert_eq!(again["duplicates"], again["read"]);
    assert_eq!(again["quarantine_file"], Value::Null);
}

#[test]
fn quarantine_sets_exit_status_3_and_the_json_contract() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let output = run(fluxmem(&store).args(["ingest", "--json"]).arg(repo().join("tests/data/malformed/episodes.jsonl")));
    assert_eq!(output.status.code(), Some(3), "{}", String::from_utf8_lossy(&output.stderr));
    let report = stdout_json(&output);
    for key in ["read", "ingested", "duplicates", "quarantined", "quarantine_file"] {
        assert!(report.get(key).is_some(), "missing {key}: {report}");
    }
    assert_eq!(report["read"], 12);
    assert_eq!(report["quarantined"], 10);
    let quarantine = PathBuf::from(report["quarantine_file"].as_str().unwrap());
    assert_eq!(std::fs::read_to_string(quarantine).unwrap().lines().count(), 10);
    let missing = run(fluxmem(&store).args(["ingest", "/definitely/not/here.jsonl"]));
    assert_eq!(missing.status.code(), Some(3), "a missing input is quarantined, not fatal");
    let bad_format = run(fluxmem(&store).args(["ingest", "--format", "csv", "x"]));
    assert_eq!(bad_format.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad_format.stderr).contains("unknown format `csv`"));
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
    let output = run(fluxmem(&store).arg("ingest").arg(repo().join("data/trajectories.jsonl")));
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("locked by another writer") && stderr.contains(&format!("pid {}", std::process::id())), "{stderr}");
    drop(writer);
    assert!(run(fluxmem(&store).arg("ingest").arg(repo().join("data/trajectories.jsonl"))).status.success());
}

/// Inputs that take several commits: every dev file plus the samples, 300 records a commit.
fn resume_inputs() -> Vec<PathBuf> {
    let data = shared_data();
    vec![
        repo().join("data"),
        data.join("locomo/locomo10_dev.json"),
        data.join("tau-bench/gpt-4o-airline_dev.json"),
        data.join("alfworld/alfworld_3prompts_dev.json"),
    ]
}

fn ingest_cmd(store: &Path) -> Command {
    let mut command = fluxmem(store);
    command.args(["ingest", "--batch-records", "300"]).args(resume_inputs());
    command
}

/// The committed content of a store: every live shard's file name, rows and checksum.
fn shard_list(store: &Path) -> Vec<(String, u64, String)> {
    let manifest = fluxmem_store::Store::open(store).unwrap().manifest().unwrap();
    manifest.shards.into_iter().map(|s| (s.file, s.rows, s.sha256)).collect()
}

#[test]
fn killed_ingest_resumes_to_exactly_the_uninterrupted_store() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference");
    assert!(run(&mut ingest_cmd(&reference)).status.success());
    let expected = shard_list(&reference);
    let expected_graph = fluxmem_store::Store::open(&reference).unwrap().load().unwrap();
    let commits = fluxmem_store::Store::open(&reference).unwrap().manifest().unwrap().version;
    assert!(commits >= 8, "the input spans several commits ({commits})");

    // A crash exactly between the shard writes and the manifest rename of each commit, and
    // right after each rename.
    for version in 1..=commits {
        for point in ["before-manifest", "after-manifest"] {
            let store = dir.path().join(format!("crash-{point}-{version}"));
            let crashed = run(ingest_cmd(&store).env("FLUXMEM_FAULT", format!("{point}:{version}")));
            assert!(!crashed.status.success(), "the fault at {point}:{version} fired");
            let resumed = run(&mut ingest_cmd(&store));
            assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
            assert!(String::from_utf8_lossy(&resumed.stderr).contains("stale store lock"), "the crash left a stale lock");
            assert_eq!(shard_list(&store), expected, "store after a crash at {point}:{version} and a re-run");
            let orphans = std::fs::read_dir(store.join("shards")).unwrap().count();
            assert_eq!(orphans, expected.len(), "no leftover shard files");
            std::fs::remove_dir_all(&store).unwrap();
        }
    }

    // SIGKILL at arbitrary moments.
    for delay_ms in [20u64, 60, 120, 250, 400] {
        let store = dir.path().join(format!("kill-{delay_ms}"));
        let mut child = ingest_cmd(&store).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        let resumed = run(&mut ingest_cmd(&store));
        assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
        assert_eq!(shard_list(&store), expected, "store after SIGKILL at {delay_ms} ms and a re-run");
        assert_eq!(fluxmem_store::Store::open(&store).unwrap().load().unwrap(), expected_graph);
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
    let data = shared_data();
    let output = run(fluxmem(&store).arg("ingest").arg(data.join("locomo/locomo10_dev.json")).arg(repo().join("data")));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    // Embeddings come from the embed stage; here a few known vectors exercise the column type.
    let mut writer = fluxmem_store::Writer::open(&store).unwrap();
    let graph = writer.store().load().unwrap();
    let mut embeddings = Graph::default();
    for (i, id) in graph.nodes.keys().take(10).enumerate() {
        let vector = (0..8).map(|j| (i * 8 + j) as f32 / 100.0).collect();
        embeddings.upsert_embedding(Embedding { node_id: id.clone(), model_id: "test".into(), text_sha256: "x".into(), vector });
    }
    writer.commit(&embeddings, fluxmem_store::CommitInfo { stage: "test".into(), ..Default::default() }).unwrap();
    drop(writer);
    let count = |kind| graph.nodes.values().filter(|n| n.kind() == kind).count();
    let first_vector_value = embeddings.embeddings.values().next().unwrap().vector[0];
    let expected = serde_json::json!({
        "nodes": {"semantic": count(NodeKind::Semantic), "episodic": count(NodeKind::Episodic), "procedural": 0},
        "embedding_dim": 8,
        "embeddings": 10,
        "first_vector_value": first_vector_value,
        "probe": {"locator": "conv-26/D1:1", "text": "Caroline: Hey Mel! Good to see you! How have you been?"},
    });
    let output = run(Command::new(python()).arg(repo().join("tests/python/read_shards.py")).arg(&store).arg(expected.to_string()));
    assert!(
        output.status.success(),
        "python reader failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("ok:"));
}

#[test]
fn help_explains_every_flag() {
    let output = run(Command::new(env!("CARGO_BIN_EXE_fluxmem")).args(["ingest", "--help"]));
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in ["--format", "--tenant", "--agent", "--max-record-bytes", "--json", "--store", "--no-progress", "--batch-records"] {
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
    let body = NodeBody::Procedural(Skill { version: 1, previous_versions: vec![], source_episodes: vec!["epi-a".into()], pems_history: vec![0.3, 0.31] });
    let mut node = Node::new(body, "default", "Name: Clean \"it\"\nDescription: d\nSteps:\n1. wash\n", &["skill", "v1", "epi-a"]);
    for (key, value) in [("name", serde_json::json!("Clean \"it\"")), ("description", serde_json::json!("d: when\ndirty")), ("steps", serde_json::json!(["wash"]))] {
        node.metadata.insert(key.into(), value);
    }
    graph.upsert_node(node);
    let mut writer = fluxmem_store::Writer::open(&store).unwrap();
    writer.commit(&graph, fluxmem_store::CommitInfo { stage: "test".into(), ..Default::default() }).unwrap();
    drop(writer);
    let read_all = |out: &Path| {
        let mut files: Vec<(String, Vec<u8>)> = Vec::new();
        for path in [out.join("release.json"), out.join("clean-it/SKILL.md")] {
            files.push((path.display().to_string(), std::fs::read(&path).unwrap()));
        }
        files.into_iter().map(|(_, bytes)| bytes).collect::<Vec<_>>()
    };
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for out in [&a, &b] {
        let output = run(fluxmem(&store).args(["export", "skills", "--format", "skill-md", "--json", "--out"]).arg(out));
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(stdout_json(&output)["skills"], 1);
    }
    assert_eq!(read_all(&a), read_all(&b));
    let skill_md = String::from_utf8(read_all(&a)[1].clone()).unwrap();
    assert!(skill_md.contains("title: \"Clean \\\"it\\\"\"\ndescription: ") || skill_md.contains("description: \"d: when\\ndirty\""), "{skill_md}");
    assert!(skill_md.contains("pems: 0.31\n"), "{skill_md}");
    let bad = run(fluxmem(&store).args(["export", "skills", "--format", "yaml", "--out"]).arg(dir.path().join("c")));
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("expected skill-md, jsonl or parquet"));
    let bad = run(fluxmem(&store).args(["consolidate", "--clusters", "zero"]));
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--clusters `zero`"));
}
