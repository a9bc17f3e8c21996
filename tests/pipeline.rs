//! `fluxmem run`: the pipeline end to end, a second night that only processes what is new, a run
//! killed inside each stage that resumes to exactly the uninterrupted store, sharded map
//! stages that merge to the same store as the unsharded run, and a run status that tells the
//! truth (a stage that produced nothing makes the run `degraded`, exit status 4).

use fluxmem_graph::Graph;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::walk;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fluxmem() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_fluxmem"));
    command.arg("--no-progress").env_remove("FLUXMEM_FAULT");
    command
}

fn run(command: &mut Command) -> Output {
    command.output().expect("the fluxmem binary runs")
}

fn ok(output: Output) -> Output {
    assert!(
        output.status.success(),
        "status {:?}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn json_line(output: &Output) -> Value {
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// A run that got to its end (no error): exit status 0, 3 (records quarantined) or 4
/// (degraded). Returns the exit status.
fn done(output: &Output) -> i32 {
    let code = output.status.code();
    assert!(
        matches!(code, Some(0 | 3 | 4)),
        "status {:?}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    code.unwrap()
}

/// The JSON record of a run that got to its end (`--json`), checked against its exit status:
/// 4 when `degraded`, else 3 when records were quarantined, else 0; and `reasons` is empty
/// exactly when the status is `ok`.
fn finished(output: &Output) -> Value {
    let code = done(output);
    let record = json_line(output);
    let expected = if record["status"] == "degraded" {
        4
    } else if record["quarantine"]["records"].as_u64().unwrap_or(0) > 0 {
        3
    } else {
        0
    };
    assert_eq!(code, expected, "exit status of {record}");
    let reasons = record["reasons"]
        .as_array()
        .unwrap_or_else(|| panic!("no reasons list in {record}"));
    assert_eq!(record["status"] == "ok", reasons.is_empty(), "{record}");
    record
}

/// The consolidate and export statuses say what those stages produced, and the run is
/// `degraded` exactly when a stage is: every cluster without a skill is `degraded: 0 of N
/// clusters gave a skill`, some failed `partial: K of N ...`; clusters whose successes share no
/// procedure are said in a `done` / `nothing new` status (`(1 of 2 clusters share no
/// procedure, so no skill)`) unless no cluster gave a skill; an export of no skill is
/// `degraded: 0 skills exported`. (The real generator decides only the words.)
fn assert_truthful(record: &Value) {
    let consolidate = stage(record, "consolidate");
    let status = consolidate["status"].as_str().unwrap();
    let n = |key: &str| consolidate["counts_out"][key].as_u64().unwrap_or(0);
    let gave = n("skills_new") + n("skills_updated") + n("skills_unchanged");
    let no_procedure = consolidate["details"]["no_procedure"].as_u64().unwrap_or(0);
    let failed = n("failed") - no_procedure
        + consolidate["details"]["failed_earlier"]
            .as_u64()
            .unwrap_or(0);
    let clusters = gave + failed + no_procedure;
    if gave == 0 && failed + no_procedure > 0 {
        assert!(
            status.starts_with(&format!("degraded: 0 of {clusters} clusters gave a skill")),
            "{consolidate}"
        );
    } else if failed > 0 {
        assert!(
            status.starts_with(&format!(
                "partial: {gave} of {clusters} clusters gave a skill"
            )),
            "{consolidate}"
        );
    } else if no_procedure > 0 {
        assert!(
            status.ends_with(&format!(
                "({no_procedure} of {clusters} clusters share no procedure, so no skill)"
            )),
            "{consolidate}"
        );
        assert!(
            status.starts_with("done") || status.starts_with("nothing new"),
            "{consolidate}"
        );
    } else {
        assert!(status == "done" || status == "nothing new", "{consolidate}");
    }
    let export = stage(record, "export");
    let exported = export["counts_out"]["skills"].as_u64().unwrap();
    assert_eq!(
        export["status"]
            .as_str()
            .unwrap()
            .starts_with("degraded: 0 skills exported"),
        exported == 0,
        "{export}"
    );
    let degraded = record["stages"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["status"].as_str().unwrap().starts_with("degraded"));
    assert_eq!(record["status"] == "degraded", degraded, "{record}");
}

/// A pipeline file in `dir` over `logs/` (everything in it) and the knowledge sample, with
/// consolidation cut down to one cluster and short answers so the real generator stays quick.
fn pipeline(dir: &Path, consolidate: bool) -> PathBuf {
    let knowledge = repo().join("data/knowledge");
    let text = format!(
        r#"name = "test"
store = "store"
seed = 7

[[inputs]]
paths = ["logs/*.jsonl", "{knowledge}/*.md"]

[[inputs]]
paths = ["logs/*.json"]
format = "alfworld"
tenant = "alfworld"
required = false

[connect]
ground_k = 2
link_k = 3

[consolidate]
enabled = {consolidate}
clusters = 1
max_rounds = 1
prompt_budget = 160
max_tokens = 40

[export]
enabled = {consolidate}
format = "jsonl"
out = "skills"

[report]
dir = "runs"
"#,
        knowledge = knowledge.display()
    );
    std::fs::create_dir_all(dir.join("logs")).unwrap();
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn add_log(dir: &Path, name: &str) {
    std::fs::copy(
        repo().join("data").join(name),
        dir.join("logs").join(Path::new(name).file_name().unwrap()),
    )
    .unwrap();
}

fn stage<'a>(record: &'a Value, name: &str) -> &'a Value {
    record["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no stage {name} in {record}"))
}

fn shard_list(store: &Path) -> Vec<(String, u64, String)> {
    let manifest = fluxmem_store::Store::open(store)
        .unwrap()
        .manifest()
        .unwrap();
    manifest
        .shards
        .iter()
        .map(|s| (s.file.clone(), s.rows, s.sha256.clone()))
        .collect()
}

#[test]
fn pipeline_runs_end_to_end_and_the_second_night_is_incremental() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), true);
    add_log(dir.path(), "trajectories.jsonl");
    let night1 = finished(&run(fluxmem().arg("run").arg(&file).arg("--json")));
    // The map stages and refine always do their work here; how many clusters give a skill is up
    // to the real generator, and the statuses (and the run's) must say so.
    for name in ["ingest", "embed", "connect", "refine"] {
        assert!(
            stage(&night1, name)["status"]
                .as_str()
                .unwrap()
                .starts_with("done"),
            "{name}: {}",
            stage(&night1, name)
        );
    }
    assert_truthful(&night1);
    let nodes1 = stage(&night1, "ingest")["counts_out"]["nodes_added"]
        .as_u64()
        .unwrap();
    assert_eq!(
        stage(&night1, "embed")["counts_out"]["embedded"]
            .as_u64()
            .unwrap(),
        nodes1,
        "night 1 embeds every node"
    );
    let run_dir = dir
        .path()
        .join("runs")
        .join(night1["run_id"].as_str().unwrap());
    let html = std::fs::read_to_string(run_dir.join("report.html")).unwrap();
    assert!(
        html.contains("<svg") && html.contains("consolidate"),
        "the report has charts and stages"
    );
    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("run.json")).unwrap()).unwrap();
    assert_eq!(on_disk["run_id"], night1["run_id"]);
    assert!(
        dir.path().join("skills/release.json").is_file(),
        "export ran"
    );
    let clusters = &stage(&night1, "consolidate")["details"]["cluster_list"];
    assert_eq!(
        clusters.as_array().map(Vec::len),
        Some(2),
        "one cluster per tenant (acme, globex) as configured: {clusters}"
    );

    // Night 2: one more log file. Only its records are ingested, embedded and connected.
    add_log(dir.path(), "alfworld/react_sample.json");
    let night2 = finished(&run(fluxmem().arg("run").arg(&file).arg("--json")));
    assert_truthful(&night2);
    assert_ne!(night2["run_id"], night1["run_id"], "new inputs, new run id");
    let ingest = &stage(&night2, "ingest")["counts_out"];
    assert_eq!(
        ingest["ingested"], 6,
        "the 6 ALFWorld transcripts are new: {ingest}"
    );
    let nodes2 = ingest["nodes_added"].as_u64().unwrap();
    assert_eq!(
        stage(&night2, "embed")["counts_out"]["embedded"]
            .as_u64()
            .unwrap(),
        nodes2,
        "night 2 embeds only night 2's nodes"
    );
    let skills1 = stage(&night1, "consolidate")["counts_out"]["skills_new"]
        .as_u64()
        .unwrap();
    assert_eq!(
        stage(&night2, "embed")["counts_in"]["already"]
            .as_u64()
            .unwrap(),
        nodes1 + skills1,
        "night 1's nodes and skills"
    );
    assert_eq!(
        stage(&night2, "connect")["counts_out"]["connected"],
        6,
        "only the new episodes are connected"
    );
    // A third tenant now: the ALFWorld tenant gets its own cluster; night 1's clusters are
    // matched to what night 1 made (unchanged skills, or failures not retried), not redone.
    let consolidate = &stage(&night2, "consolidate")["details"];
    let statuses: Vec<&str> = consolidate["cluster_list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses.len(), 3, "{consolidate}");
    // Night 1's clusters: an unchanged skill, and the cluster that shares no procedure reported
    // again from its recorded edit (no new failure, so it was not mined again).
    let kept = statuses
        .iter()
        .filter(|s| matches!(**s, "unchanged" | "failed_earlier" | "no_procedure"))
        .count();
    assert_eq!(
        kept, 2,
        "night 1's clusters are not consolidated from scratch again: {statuses:?}"
    );
    let refailed = consolidate["failures"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["tenant"] != "alfworld")
        .count();
    assert_eq!(
        refailed, 0,
        "no new failure record for night 1's clusters: {consolidate}"
    );

    // The same inputs again: the same run id, every stage already done, nothing written.
    let version = fluxmem_store::Store::open(dir.path().join("store"))
        .unwrap()
        .manifest()
        .unwrap()
        .version;
    let output = run(fluxmem().arg("run").arg(&file).arg("--json"));
    let again = finished(&output);
    assert_eq!(again["run_id"], night2["run_id"]);
    assert_eq!(
        (&again["status"], &again["reasons"]),
        (&night2["status"], &night2["reasons"]),
        "the same verdict: {again}"
    );
    // Every stage is skipped, and the run's report keeps night 2's records of them (same
    // statuses, counts and timings: nothing ran again).
    let skipped = String::from_utf8_lossy(&output.stderr)
        .matches("already done for this run id")
        .count();
    assert_eq!(skipped, 6, "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(again["stages"], night2["stages"], "{again}");
    let after = fluxmem_store::Store::open(dir.path().join("store"))
        .unwrap()
        .manifest()
        .unwrap();
    assert_eq!(
        after.version,
        version,
        "nothing committed; the last commit: {:?}\n{}",
        after.commits.last(),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The export's release manifest as bytes (text), with the value of `created_at` blanked (the
/// time of the store's last commit, which a resumed run makes at another moment): everything
/// else, floats' last digits included, must be the same bytes (issue 40.5).
fn release(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("skills/release.json")).ok()?;
    let mut blanked = 0;
    let lines: Vec<String> = text
        .lines()
        .map(|line| match line.split_once("\"created_at\":") {
            Some((indent, _)) if indent == "  " => {
                blanked += 1;
                format!("{indent}\"created_at\": <blanked>")
            }
            _ => line.to_string(),
        })
        .collect();
    assert_eq!(
        blanked, 1,
        "release.json has one top-level created_at:\n{text}"
    );
    Some(lines.join("\n"))
}

/// Removes what a run made, keeping the pipeline file and the logs (same paths, same file
/// times: the same input).
fn reset(dir: &Path) {
    for made in ["store", "skills", "runs"] {
        let _ = std::fs::remove_dir_all(dir.join(made));
    }
}

#[test]
fn a_run_killed_inside_each_stage_resumes_to_exactly_the_uninterrupted_store() {
    // Two settings: without consolidation for the early stages (fast), with it for the last two.
    for consolidate in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let file = pipeline(dir.path(), consolidate);
        add_log(dir.path(), "trajectories.jsonl");
        // Exit 4 is possible with consolidation: the real generator may give no skill.
        let verdict = done(&run(fluxmem()
            .arg("run")
            .arg(&file)
            .args(["--run-id", "night"])));
        let expected = shard_list(&dir.path().join("store"));
        let release = release(dir.path());
        let manifest = fluxmem_store::Store::open(dir.path().join("store"))
            .unwrap()
            .manifest()
            .unwrap();
        let first = |stage: &str| {
            manifest
                .commits
                .iter()
                .find(|c| c.stage == stage)
                .unwrap_or_else(|| panic!("no {stage} commit"))
                .version
        };
        // Killed between writing a stage's shards and its manifest, or (for the export) right
        // after the last commit before it.
        let faults: Vec<String> = if consolidate {
            vec![
                format!("before-manifest:{}", first("consolidate")),
                format!("after-manifest:{}", first("consolidate-done")),
            ]
        } else {
            ["ingest", "embed", "connect", "refine"]
                .iter()
                .map(|s| format!("before-manifest:{}", first(s)))
                .collect()
        };
        for fault in faults {
            reset(dir.path());
            let killed = run(fluxmem()
                .arg("run")
                .arg(&file)
                .args(["--run-id", "night"])
                .env("FLUXMEM_FAULT", &fault));
            assert!(!killed.status.success(), "{fault}: the run was aborted");
            let resumed = done(&run(fluxmem()
                .arg("run")
                .arg(&file)
                .args(["--run-id", "night"])));
            assert_eq!(
                resumed, verdict,
                "{fault}: the resumed run ends with the uninterrupted run's exit status"
            );
            assert_eq!(
                shard_list(&dir.path().join("store")),
                expected,
                "{fault}: the resumed store is the uninterrupted one"
            );
            assert_eq!(self::release(dir.path()), release, "{fault}: same export");
        }
    }
}

fn graph(store: &Path) -> Graph {
    fluxmem_store::Store::open(store).unwrap().load().unwrap()
}

#[test]
fn sharded_map_stages_merge_to_the_unsharded_store() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    add_log(dir.path(), "trajectories.jsonl");
    add_log(dir.path(), "alfworld/react_sample.json");
    ok(run(fluxmem()
        .arg("run")
        .arg(&file)
        .args(["--run-id", "night"])));
    let whole = graph(&dir.path().join("store"));

    // The same pipeline, each map stage as 3 shards run one by one, then merged.
    let sharded_file = dir.path().join("sharded.toml");
    std::fs::write(
        &sharded_file,
        std::fs::read_to_string(&file)
            .unwrap()
            .replace("store = \"store\"", "store = \"sharded\"")
            .replace("dir = \"runs\"", "dir = \"sharded-runs\""),
    )
    .unwrap();
    for stage in ["ingest", "embed", "connect"] {
        for i in 0..3 {
            let shard = format!("{i}/3");
            let record = json_line(&ok(run(fluxmem()
                .arg("run")
                .arg(&sharded_file)
                .args(["--run-id", "night", "--stage", stage, "--shard", &shard]))));
            assert_eq!(record["name"], stage);
        }
        let merged = json_line(&ok(run(fluxmem()
            .arg("run")
            .arg(&sharded_file)
            .args(["--run-id", "night", "--stage", stage, "--merge", "3"]))));
        assert_eq!(merged["status"], "merged", "{merged}");
        assert!(
            !dir.path()
                .join("sharded/staging")
                .join(format!("{stage}-0-of-3"))
                .exists(),
            "staging removed"
        );
    }
    ok(run(fluxmem()
        .arg("run")
        .arg(&sharded_file)
        .args(["--run-id", "night", "--stage", "refine"])));
    let sharded = graph(&dir.path().join("sharded"));
    // The stage-by-stage calls add up to one report for the run id.
    let record: Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("sharded-runs/night/run.json")).unwrap(),
    )
    .unwrap();
    let statuses: Vec<(&str, &str)> = record["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["status"].as_str().unwrap()))
        .collect();
    assert_eq!(
        statuses,
        [
            ("ingest", "merged"),
            ("embed", "merged"),
            ("connect", "merged"),
            ("refine", "done")
        ],
        "{record}"
    );

    assert_eq!(whole.nodes, sharded.nodes, "same nodes");
    assert_eq!(
        whole.embeddings.keys().collect::<Vec<_>>(),
        sharded.embeddings.keys().collect::<Vec<_>>()
    );
    for (key, a) in &whole.embeddings {
        let b = &sharded.embeddings[key];
        let worst = a
            .vector
            .iter()
            .zip(&b.vector)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-6, "{key:?}: embeddings differ by {worst}");
    }
    assert_eq!(
        whole.edges.keys().collect::<Vec<_>>(),
        sharded.edges.keys().collect::<Vec<_>>(),
        "same edge set"
    );
    for (key, a) in &whole.edges {
        let b = &sharded.edges[key];
        assert!(
            (a.weight - b.weight).abs() <= 1e-5,
            "{key:?}: weight {} vs {}",
            a.weight,
            b.weight
        );
        assert_eq!(
            (a.active, a.evidence, &a.run_id, a.created_at),
            (b.active, b.evidence, &b.run_id, b.created_at),
            "{key:?}"
        );
    }
    let edits = |g: &Graph| {
        g.edits
            .iter()
            .map(|e| (e.kind.clone(), e.target.clone(), e.run_id.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(edits(&whole), edits(&sharded), "same edit log");
    assert!(!whole.edges.is_empty() && !whole.edits.is_empty());
    // Every shard but the edit log's names the tenants of its rows, the merges' too.
    shards_name_their_tenants(&dir.path().join("store"), &whole);
    shards_name_their_tenants(&dir.path().join("sharded"), &sharded);
}

/// Every shard of the store at `dir` (whose whole graph is `whole`) but the edit log's and the
/// steps' (named as their nodes') names its tenants, and they are the tenants of its rows: a
/// node's, an edge's source's, a vector's node's.
fn shards_name_their_tenants(dir: &Path, whole: &Graph) {
    let store = fluxmem_store::Store::open(dir).unwrap();
    let manifest = store.manifest().unwrap();
    let tenant = |id: &fluxmem_graph::NodeId| whole.nodes[id].tenant.clone();
    for shard in manifest
        .shards
        .iter()
        .filter(|s| !matches!(s.table.as_str(), "edits" | "steps"))
    {
        let named = shard
            .tenants
            .clone()
            .unwrap_or_else(|| panic!("{} names no tenant", shard.file));
        // The shard, with the steps of its commit (a node row needs its steps).
        let alone = fluxmem_store::Manifest {
            shards: (manifest.shards.iter())
                .filter(|s| s == &shard || (s.table == "steps" && s.commit == shard.commit))
                .cloned()
                .collect(),
            ..manifest.clone()
        };
        let rows = store.scan_at(&alone, &fluxmem_store::Scan::all()).unwrap();
        let held: BTreeSet<String> = (rows.nodes.values().map(|n| n.tenant.clone()))
            .chain(rows.edges.values().map(|e| tenant(&e.src)))
            .chain(rows.embeddings.keys().map(|(id, _)| tenant(id)))
            .collect();
        assert!(!held.is_empty(), "{}", shard.file);
        assert_eq!(
            held.into_iter().collect::<Vec<_>>(),
            named,
            "{}",
            shard.file
        );
    }
}

/// A sharded consolidate plans its clusters once (`--stage consolidate --plan`): every shard
/// handles the planned clusters it owns, even where its own k-means would cluster differently
/// (here its pipeline asks for other clusters, a stand-in for a shard on another CPU or a GPU
/// that rounds differently), and the merge gives the skills of the run in one process. A shard
/// run with other settings than the plan's is refused; one that clustered on its own is refused
/// at the merge, by name.
#[test]
fn a_sharded_consolidate_follows_one_cluster_plan() {
    let dir = tempfile::tempdir().unwrap();
    pipeline(dir.path(), true);
    add_log(dir.path(), "trajectories.jsonl");
    add_log(dir.path(), "alfworld/react_sample.json");
    let write = |name: &str, store: &str, seed: u64, clusters: u64| -> PathBuf {
        let text = std::fs::read_to_string(pipeline(dir.path(), true))
            .unwrap()
            .replace("store = \"store\"", &format!("store = \"{store}\""))
            .replace(
                "seed = 7",
                &format!("seed = {seed}\n\n[models]\ngenerator = \"none\""),
            )
            .replace("clusters = 1", &format!("clusters = {clusters}"))
            .replace("[export]\nenabled = true", "[export]\nenabled = false")
            .replace("dir = \"runs\"", &format!("dir = \"{store}-runs\""));
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let whole_file = write("whole.toml", "whole", 7, 3);
    let other_clusters = write("other.toml", "other", 7, 2);
    let sharded_file = write("sharded.toml", "sharded", 7, 3);
    // The shards' pipeline: the sharded store, clustered otherwise (another number of
    // clusters: a stand-in for a shard whose k-means would round differently).
    let shard_file = write("shard.toml", "sharded", 7, 2);
    let skill_nodes = |store: &str| -> Vec<fluxmem_graph::Node> {
        let graph = graph(&dir.path().join(store));
        graph
            .nodes
            .into_values()
            .filter(|n| n.kind() == fluxmem_graph::NodeKind::Procedural)
            .collect()
    };
    let skills = |store: &str| -> Vec<(String, String)> {
        skill_nodes(store)
            .into_iter()
            .map(|n| (n.id.to_string(), n.text))
            .collect()
    };
    for file in [&whole_file, &other_clusters] {
        ok(run(fluxmem()
            .arg("run")
            .arg(file)
            .args(["--run-id", "night"])));
    }
    let whole = skills("whole");
    assert!(whole.len() >= 2, "{whole:?}");
    assert_ne!(
        whole,
        skills("other"),
        "the shards' settings cluster differently, so a shard that clustered on its own would differ"
    );

    for stage in ["ingest", "embed", "connect", "refine"] {
        ok(run(fluxmem()
            .arg("run")
            .arg(&sharded_file)
            .args(["--run-id", "night", "--stage", stage])));
    }
    let consolidate = |file: &Path, run_id: &str, extra: &[&str]| {
        run(fluxmem()
            .arg("run")
            .arg(file)
            .args(["--run-id", run_id, "--stage", "consolidate"])
            .args(extra))
    };
    let planned = json_line(&ok(consolidate(&sharded_file, "night", &["--plan"])));
    assert_eq!(planned["status"], "planned", "{planned}");
    let clusters = planned["details"]["clusters"].as_u64().unwrap();
    // A shard run with other settings than the plan records (its clustering aside, which the
    // plan settled) is refused by name: the plan is what a worker that keeps its models runs.
    let two_rounds = |file: &Path, name: &str| -> PathBuf {
        let text = std::fs::read_to_string(file).unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, text.replace("max_rounds = 1", "max_rounds = 2")).unwrap();
        path
    };
    let other_rounds = two_rounds(&shard_file, "rounds.toml");
    let refused = consolidate(&other_rounds, "night", &["--shard", "0/3"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success()
            && stderr.contains("max_rounds")
            && stderr.contains("shared cluster plan"),
        "{stderr}"
    );
    // A shard whose clusters give no skill is degraded (exit 4), not failed.
    let shard_ok = |output: Output| {
        assert!(
            matches!(output.status.code(), Some(0 | 4)),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        output
    };
    let (mut handled, mut induced) = (0, 0);
    for i in 0..3 {
        let record = json_line(&shard_ok(consolidate(
            &shard_file,
            "night",
            &["--shard", &format!("{i}/3")],
        )));
        let details = &record["details"];
        assert_eq!(
            details["shared_plan"], planned["details"]["sha256"],
            "{record}"
        );
        handled +=
            details["clusters"].as_u64().unwrap() - details["other_shards"].as_u64().unwrap();
        induced += details["skills_new"].as_u64().unwrap();
    }
    assert_eq!(
        handled, clusters,
        "every planned cluster is handled by one shard"
    );
    assert!(induced >= 2, "the shards induced the skills");
    // A finished shard run again has nothing left to do (it does not induce its skills again).
    for i in 0..3 {
        let again = json_line(&shard_ok(consolidate(
            &shard_file,
            "night",
            &["--shard", &format!("{i}/3")],
        )));
        let details = &again["details"];
        assert_eq!(
            (&details["commits"], &details["skills_new"]),
            (&Value::from(0), &Value::from(0)),
            "{again}"
        );
        assert_eq!(details["shared_plan"], planned["details"]["sha256"]);
    }
    let merged = json_line(&ok(consolidate(&sharded_file, "night", &["--merge", "3"])));
    assert_eq!(merged["status"], "merged", "{merged}");
    assert_eq!(
        skill_nodes("sharded"),
        skill_nodes("whole"),
        "the skills of the run in one process, metadata included"
    );
    let store = dir.path().join("sharded");
    let manifest = fluxmem_store::Store::open(&store)
        .unwrap()
        .manifest()
        .unwrap();
    assert!(
        manifest
            .progress
            .get(fluxmem_consolidate::SHARED_PLAN_MARKER)
            .is_none_or(Value::is_null),
        "the merge closes the plan"
    );
    let left: Vec<_> = std::fs::read_dir(store.join("scratch/consolidate"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "the plan's file is gone: {left:?}");

    // A plan file changed after planning is refused by the shard that reads it.
    ok(consolidate(&sharded_file, "again", &["--plan"]));
    let plan_file = std::fs::read_dir(store.join("scratch/consolidate"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("shared-")
        })
        .expect("the plan is a file in scratch/consolidate");
    let original = std::fs::read(&plan_file).unwrap();
    std::fs::write(&plan_file, [&original[..], b" "].concat()).unwrap();
    let tampered = consolidate(&shard_file, "again", &["--shard", "0/2"]);
    let stderr = String::from_utf8_lossy(&tampered.stderr);
    assert!(
        !tampered.status.success() && stderr.contains("does not match the hash"),
        "{stderr}"
    );
    std::fs::write(&plan_file, &original).unwrap();
    // A shard run under another run id finds no plan for it and clusters on its own.
    shard_ok(consolidate(&shard_file, "again", &["--shard", "0/2"]));
    shard_ok(consolidate(&shard_file, "other", &["--shard", "1/2"]));
    let refused = consolidate(&sharded_file, "again", &["--merge", "2"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success()
            && stderr.contains("shard 1/2")
            && stderr.contains("shared cluster plan"),
        "{stderr}"
    );
    // Planning again under the same settings reuses the plan; under others it plans anew.
    let same = json_line(&ok(consolidate(&sharded_file, "again", &["--plan"])));
    assert_eq!(same["details"]["reused"], true, "{same}");
    let rounds_file = two_rounds(&sharded_file, "sharded-rounds.toml");
    let replanned = json_line(&ok(consolidate(&rounds_file, "again", &["--plan"])));
    assert_eq!(replanned["details"]["reused"], false, "{replanned}");
    assert_ne!(replanned["details"]["sha256"], same["details"]["sha256"]);
    // A shard killed after its first cluster's commit (of a fresh store: every cluster has
    // work) resumes only with the plan's settings.
    let resume_file = write("resume.toml", "resume", 7, 3);
    for stage in ["ingest", "embed", "connect", "refine"] {
        ok(run(fluxmem()
            .arg("run")
            .arg(&resume_file)
            .args(["--run-id", "night", "--stage", stage])));
    }
    ok(consolidate(&resume_file, "night", &["--plan"]));
    let version = fluxmem_store::Store::open(dir.path().join("resume"))
        .unwrap()
        .manifest()
        .unwrap()
        .version;
    let killed = run(fluxmem()
        .arg("run")
        .arg(&resume_file)
        .args([
            "--run-id",
            "night",
            "--stage",
            "consolidate",
            "--shard",
            "0/1",
        ])
        .env("FLUXMEM_FAULT", format!("after-manifest:{}", version + 1)));
    assert!(!killed.status.success(), "the fault stops the shard");
    let other_rounds = two_rounds(&resume_file, "resume-rounds.toml");
    let refused = consolidate(&other_rounds, "night", &["--shard", "0/1"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("max_rounds: the plan's 1, this shard's 2"),
        "{stderr}"
    );
    let resumed = json_line(&shard_ok(consolidate(
        &resume_file,
        "night",
        &["--shard", "0/1"],
    )));
    assert_eq!(resumed["details"]["resumed"], true, "{resumed}");
    ok(consolidate(&resume_file, "night", &["--merge", "1"]));
    assert_eq!(skill_nodes("resume"), skill_nodes("whole"));
}

#[test]
fn bad_pipelines_and_flags_are_clear_errors_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    let text = std::fs::read_to_string(&file).unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, text.replace("link_k = 3", "link_k = 3\nlink_kk = 4")).unwrap();
    let output = run(fluxmem().arg("run").arg(&bad));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr.contains("bad.toml") && stderr.contains("link_kk"),
        "{stderr}"
    );
    assert!(!dir.path().join("store").exists(), "nothing was started");
    // A required input that matches nothing names the key.
    std::fs::write(&bad, text.replace("logs/*.jsonl", "missing/*.jsonl")).unwrap();
    let stderr = String::from_utf8_lossy(&run(fluxmem().arg("run").arg(&bad)).stderr).into_owned();
    assert!(
        stderr.contains("inputs[0].paths") && stderr.contains("missing/*.jsonl"),
        "{stderr}"
    );
    // --shard only on map stages; merge of shards that never ran names the fix.
    let stderr = String::from_utf8_lossy(
        &run(fluxmem()
            .arg("run")
            .arg(&file)
            .args(["--stage", "refine", "--shard", "0/2"]))
        .stderr,
    )
    .into_owned();
    assert!(stderr.contains("map stages"), "{stderr}");
    add_log(dir.path(), "trajectories.jsonl");
    let output = run(fluxmem()
        .arg("run")
        .arg(&file)
        .args(["--stage", "ingest", "--merge", "2"]));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("--shard 0/2"),
        "{stderr}"
    );
    // The hashing embedder's name needs a dimension.
    std::fs::write(&bad, format!("{text}\n[models]\nembedder = \"hash-0\"\n")).unwrap();
    let output = run(fluxmem().arg("run").arg(&bad));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.code() == Some(1)
            && stderr.contains("models.embedder")
            && stderr.contains("hash-<dim>"),
        "{stderr}"
    );
}

/// A pipeline may name the weight-free hashing embedder (`hash-<dim>`: tests and plumbing
/// benches): its stages run with it and the store holds its vectors.
#[test]
fn a_pipeline_runs_with_the_hashing_embedder() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, format!("{text}\n[models]\nembedder = \"hash-64\"\n")).unwrap();
    add_log(dir.path(), "trajectories.jsonl");
    ok(run(fluxmem()
        .arg("run")
        .arg(&file)
        .args(["--run-id", "night"])));
    let graph = graph(&dir.path().join("store"));
    assert!(!graph.embeddings.is_empty());
    assert!(
        graph
            .embeddings
            .values()
            .all(|e| e.model_id == "hash-64" && e.vector.len() == 64),
        "every vector is the hashing embedder's"
    );
    assert!(graph
        .edges
        .values()
        .any(|e| e.kind == fluxmem_graph::EdgeKind::Ground));
}

#[test]
fn a_run_that_exports_no_skill_is_degraded_and_exits_4() {
    // Consolidation off, export on: the store has no skill, so the export the pipeline asks for
    // is empty. No generator is involved, so the verdict is deterministic.
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    let text = std::fs::read_to_string(&file).unwrap();
    let exporting = text.replace("[export]\nenabled = false", "[export]\nenabled = true");
    assert_ne!(exporting, text, "the export is switched on");
    std::fs::write(&file, exporting).unwrap();
    add_log(dir.path(), "trajectories.jsonl");
    let output = run(fluxmem()
        .arg("run")
        .arg(&file)
        .args(["--run-id", "empty", "--json"]));
    assert_eq!(
        output.status.code(),
        Some(4),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let record = finished(&output);
    assert_eq!(record["status"], "degraded", "{record}");
    let reason = "export: 0 skills exported (the store has no skill)";
    assert_eq!(record["reasons"], serde_json::json!([reason]), "{record}");
    for name in ["ingest", "embed", "connect", "refine"] {
        assert!(
            stage(&record, name)["status"]
                .as_str()
                .unwrap()
                .starts_with("done"),
            "{name}: {}",
            stage(&record, name)
        );
    }
    assert_eq!(
        stage(&record, "consolidate")["status"],
        "skipped (disabled)"
    );
    let export = stage(&record, "export");
    assert_eq!(
        export["status"], "degraded: 0 skills exported (the store has no skill)",
        "{export}"
    );
    assert_eq!(export["counts_out"]["skills"], 0);

    // run.json says the same; the report names the status in words, with the reason above the
    // stage table.
    let run_dir = dir.path().join("runs/empty");
    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("run.json")).unwrap()).unwrap();
    assert_eq!(
        (&on_disk["status"], &on_disk["reasons"]),
        (&record["status"], &record["reasons"])
    );
    let html = std::fs::read_to_string(run_dir.join("report.html")).unwrap();
    assert!(
        html.contains(r#"<span class="badge degraded">degraded</span>"#),
        "no degraded badge in the header"
    );
    let reason_at = html.find(reason).expect("the reason is in the report");
    assert!(
        reason_at < html.find(r#"<section id="stages">"#).unwrap(),
        "the reason comes before the stage table"
    );

    // The same run again (every stage done earlier): the same verdict, in words too.
    let again = run(fluxmem().arg("run").arg(&file).args(["--run-id", "empty"]));
    assert_eq!(
        again.status.code(),
        Some(4),
        "stderr: {}",
        String::from_utf8_lossy(&again.stderr)
    );
    let stdout = String::from_utf8_lossy(&again.stdout);
    assert!(
        stdout.contains(": degraded") && stdout.contains(&format!("- {reason}")),
        "{stdout}"
    );
}

#[test]
fn a_run_whose_every_record_is_quarantined_is_degraded_not_just_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("logs")).unwrap();
    std::fs::write(
        dir.path().join("logs/bad.jsonl"),
        "{\"task\": 42}\n{\"steps\": []}\n[1, 2, 3]\n",
    )
    .unwrap();
    let file = dir.path().join("pipeline.toml");
    std::fs::write(&file, "name = \"bad\"\nstore = \"store\"\n\n[[inputs]]\npaths = [\"logs/bad.jsonl\"]\n\n[report]\ndir = \"runs\"\n").unwrap();
    // The ingest stage alone: no model is needed for the verdict.
    let output = run(fluxmem()
        .arg("run")
        .arg(&file)
        .args(["--run-id", "bad", "--stage", "ingest", "--json"]));
    assert_eq!(
        output.status.code(),
        Some(4),
        "degraded (4) wins over quarantined (3); stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let record = finished(&output);
    assert_eq!(record["status"], "degraded", "{record}");
    assert_eq!(record["quarantine"]["records"], 3, "{record}");
    assert_eq!(
        stage(&record, "ingest")["status"],
        "degraded: all 3 records read were quarantined"
    );
    assert_eq!(
        record["reasons"],
        serde_json::json!(["ingest: all 3 records read were quarantined"]),
        "{record}"
    );
}

#[test]
fn a_pipeline_with_a_non_finite_number_is_refused_before_any_stage_runs() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    add_log(dir.path(), "trajectories.jsonl");
    let text = std::fs::read_to_string(&file).unwrap();
    let cases = [
        (
            format!("{text}\n[refine]\nprune_below = nan\n"),
            "refine.prune_below",
            "NaN",
        ),
        (
            format!("{text}\n[refine]\nprior = inf\n"),
            "refine.prior",
            "inf",
        ),
        (
            text.replace("max_rounds = 1", "max_rounds = 1\nepsilon = -inf"),
            "consolidate.epsilon",
            "-inf",
        ),
        (
            text.replace("format = \"jsonl\"", "format = \"jsonl\"\nmin_pems = nan"),
            "export.min_pems",
            "NaN",
        ),
    ];
    for (bad, key, value) in cases {
        assert_ne!(bad, text);
        std::fs::write(&file, &bad).unwrap();
        // Even the ingest stage alone, which does not use the value: the file is refused whole.
        let stages: [&[&str]; 2] = [&["--stage", "ingest"], &[]];
        for stage in stages {
            let output = run(fluxmem().arg("run").arg(&file).args(stage));
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(output.status.code(), Some(1), "{key} {stage:?}: {stderr}");
            assert!(
                stderr.contains(&file.display().to_string())
                    && stderr.contains(&format!("key `{key}`: `{value}`: must be a finite number")),
                "{key}: {stderr}"
            );
            assert!(
                !dir.path().join("store").exists(),
                "{key}: no stage ran, no store was created"
            );
            assert!(
                !dir.path().join("runs").exists(),
                "{key}: no report was written"
            );
        }
    }
}

#[test]
fn a_run_id_that_is_not_a_plain_name_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    add_log(dir.path(), "trajectories.jsonl");
    let outside = dir.path().join("outside");
    let ids = [
        "../../x".to_string(),
        "../outside".into(),
        outside.display().to_string(),
        "..".into(),
        ".hidden".into(),
        "-x".into(),
        "a/b".into(),
        "x".repeat(129),
    ];
    for id in ids {
        let output = run(fluxmem()
            .arg("run")
            .arg(&file)
            .args(["--stage", "ingest"])
            .arg(format!("--run-id={id}")));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{id}: {stderr}");
        assert!(
            stderr.contains("--run-id")
                && stderr.contains("a run id must be 1 to 128 ASCII letters, digits"),
            "{id}: {stderr}"
        );
        assert!(
            !dir.path().join("store").exists(),
            "{id}: nothing was started"
        );
        assert!(
            !dir.path().join("runs").exists() && !outside.exists(),
            "{id}: no report was written"
        );
    }
    // A plain id still names the report directory.
    done(&run(fluxmem().arg("run").arg(&file).args([
        "--stage",
        "ingest",
        "--run-id",
        "night.1_a-B",
    ])));
    assert!(dir.path().join("runs/night.1_a-B/run.json").is_file());
}

#[test]
fn output_targets_that_cannot_be_written_are_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    add_log(dir.path(), "trajectories.jsonl");
    let refused = |args: &[&str], key: &str, path: &Path, why: &str| {
        let output = run(fluxmem().arg("run").arg(&file).args(args));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{key} {args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("key `{key}`"))
                && stderr.contains(&path.display().to_string())
                && stderr.contains(why),
            "{key} {args:?}: {stderr}"
        );
        assert!(
            !dir.path().join("store").exists(),
            "{key} {args:?}: found before the store was opened"
        );
    };
    // report.dir is a regular file: found before the store is created, not after the stages.
    let runs = dir.path().join("runs");
    std::fs::write(&runs, "not a directory").unwrap();
    refused(&[], "report.dir", &runs, "exists and is not a directory");
    refused(
        &["--stage", "ingest"],
        "report.dir",
        &runs,
        "exists and is not a directory",
    );
    refused(
        &["--run-id", "night", "--stage", "ingest", "--merge", "2"],
        "report.dir",
        &runs,
        "exists and is not a directory",
    );
    std::fs::remove_file(&runs).unwrap();

    // export.out, when the export runs: a regular file, then a directory that is neither empty
    // nor an earlier export.
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(
        &file,
        text.replace("[export]\nenabled = false", "[export]\nenabled = true"),
    )
    .unwrap();
    let skills = dir.path().join("skills");
    std::fs::write(&skills, "not a directory").unwrap();
    refused(&[], "export.out", &skills, "exists and is not a directory");
    refused(
        &["--stage", "export"],
        "export.out",
        &skills,
        "exists and is not a directory",
    );
    std::fs::remove_file(&skills).unwrap();
    std::fs::create_dir(&skills).unwrap();
    std::fs::write(skills.join("notes.txt"), "mine").unwrap();
    refused(&[], "export.out", &skills, "holds no release.json");
    refused(
        &["--stage", "export"],
        "export.out",
        &skills,
        "holds no release.json",
    );
    std::fs::write(
        skills.join("release.json"),
        r#"{"format": "something-else"}"#,
    )
    .unwrap();
    refused(&[], "export.out", &skills, "not a fluxmem skill release");
    assert_eq!(
        std::fs::read_to_string(skills.join("notes.txt")).unwrap(),
        "mine",
        "left as it was"
    );
    // A stage that does not export does not need export.out.
    done(&run(fluxmem()
        .arg("run")
        .arg(&file)
        .args(["--stage", "ingest"])));
}

/// The Agent Skills reference validator (`agentskills`, PyPI `skills-ref`, installed into
/// `.venv` by scripts/test.sh; `FLUXMEM_AGENTSKILLS` overrides).
fn agentskills() -> PathBuf {
    if let Ok(path) = std::env::var("FLUXMEM_AGENTSKILLS") {
        return PathBuf::from(path);
    }
    let path = repo().join(".venv/bin/agentskills");
    assert!(path.exists(), "no agentskills validator: run `bash scripts/test.sh` (it installs tests/python/requirements.txt into .venv) or set FLUXMEM_AGENTSKILLS");
    path
}

/// Secrets in the disguises issue 40's probes found leaking: an AWS key id (which a
/// description template may lowercase), a card number with odd spacing, an `sk-` key split by
/// a space, an e-mail percent-encoded in a query string, a bare ten-digit phone number and a JWT
/// cut short.
const DISGUISED: &str = "Key AKIAIOSFODNN7ACMEXYZ, card 4111 11 11 1111 1111, token sk-proj-Ab3dEf6h Ij9kLm2nOp5qRs8t, reset https://x.example/r?to=alice.secret%40acme-corp.com, call 5551234567, jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIi";

/// Fails when any secret of [`DISGUISED`] is readable in `text`: compared without case, spaces
/// or hyphens between digits, and percent-decoded.
fn assert_no_disguised_secret(text: &str) {
    let folded = text.to_lowercase().replace("%40", "@");
    let squeezed: String = folded.chars().filter(|c| *c != ' ').collect();
    let digits_joined = squeezed.replace('-', "");
    // Distinctive prefixes, so that a secret cut short (a description truncated) counts too.
    for (secret, haystack) in [
        ("akiaiosfodnn7", &squeezed),
        ("4111111111111111", &digits_joined),
        ("ab3def6h", &squeezed),
        ("ij9klm2n", &squeezed),
        ("alice.secret", &folded),
        ("5551234567", &digits_joined),
        ("eyjhbgci", &squeezed),
    ] {
        assert!(
            !haystack.contains(secret),
            "`{secret}` left the store in disguise"
        );
    }
}
/// Template skills (no generator) from every sample format: the run is `ok`, every cluster of
/// the samples gives a skill, and every exported SKILL.md passes the Agent Skills reference
/// validator, with its provenance next to it.
#[test]
fn template_skills_from_the_samples_pass_the_agent_skills_validator() {
    let dir = tempfile::tempdir().unwrap();
    let data = repo().join("data");
    let text = format!(
        r#"name = "skills"
store = "store"
seed = 42

[models]
generator = "none"

[[inputs]]
paths = ["{data}/trajectories.jsonl", "{data}/knowledge/*.md"]

[[inputs]]
paths = ["{data}/tau-bench/*.json"]
format = "tau-bench"
tenant = "airline"

[[inputs]]
paths = ["{data}/alfworld/*.json"]
format = "alfworld"
tenant = "alfworld"

[[inputs]]
paths = ["private.jsonl"]

[export]
format = "skill-md"
out = "skills"

[report]
dir = "runs"
"#,
        data = data.display()
    );
    let file = dir.path().join("pipeline.toml");
    std::fs::write(&file, text).unwrap();
    // Two runs of a tenant whose logs carry personal data in tasks, tool arguments and errors.
    let private: String = (1..=2)
        .map(|i| {
            serde_json::json!({
                "tenant": "private", "episode_id": format!("p-{i}"),
                "task": format!("Email the invoice to alice{i}@example.com and charge card 4111 1111 1111 1111. {DISGUISED}"),
                "steps": [
                    {"observation": "User wants the invoice", "action": "Looking it up.",
                     "tool_calls": [{"name": "find_invoice", "arguments": {"email": format!("alice{i}@example.com")}, "result": "Error: no invoice for alice@example.com"}]},
                    {"observation": "found", "action": "Sending.",
                     "tool_calls": [{"name": "send_invoice", "arguments": {"to": format!("alice{i}@example.com"), "card": "4111 1111 1111 1111"}, "result": "ok"}]}
                ],
                "outcome": {"success": true}
            })
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(dir.path().join("private.jsonl"), private).unwrap();
    let output = run(fluxmem().args(["run", "--json"]).arg(&file));
    let record = finished(&output);
    // The samples' acme tenant is one cluster of unrelated tasks whose successes share no
    // procedure: that cluster honestly gives no skill, which the consolidate status says; the
    // run is `ok` (no cluster failed).
    assert_eq!(record["status"], "ok", "{record}");
    // Nothing personal leaves the store: not the skills, not the run report.
    let mut leaving = String::new();
    for path in walk(&dir.path().join("skills"))
        .into_iter()
        .chain(walk(&dir.path().join("runs")))
    {
        leaving.push_str(&std::fs::read_to_string(&path).unwrap());
    }
    // And what `query` prints for the tenant (redacted unless --no-redact).
    let store = dir.path().join("store");
    let query = ok(run(fluxmem().arg("query").arg("--store").arg(&store).args(
        [
            "--tenant",
            "private",
            "--budget",
            "4096",
            "Email the invoice",
        ],
    )));
    let printed = String::from_utf8_lossy(&query.stdout).into_owned();
    assert!(
        printed.contains("invoice"),
        "the query finds the tenant's facts: {printed}"
    );
    leaving.push_str(&printed);
    for secret in [
        "alice1@example.com",
        "alice@example.com",
        "4111 1111 1111 1111",
    ] {
        assert!(!leaving.contains(secret), "`{secret}` left the store");
    }
    assert_no_disguised_secret(&leaving);
    let raw = ok(run(fluxmem().arg("query").arg("--store").arg(&store).args(
        [
            "--tenant",
            "private",
            "--budget",
            "4096",
            "--no-redact",
            "Email the invoice",
        ],
    )));
    assert!(
        String::from_utf8_lossy(&raw.stdout).contains("alice1@example.com")
            || String::from_utf8_lossy(&raw.stdout).contains("alice2@example.com"),
        "--no-redact prints the store's text as it is"
    );
    assert!(
        leaving.contains("<email>"),
        "placeholders keep the text readable"
    );
    assert!(
        record["redacted"]["email"].as_u64().unwrap_or(0) > 0,
        "counted per kind: {}",
        record["redacted"]
    );
    let consolidate = stage(&record, "consolidate");
    assert_eq!(
        consolidate["counts_out"]["failed"], consolidate["details"]["no_procedure"],
        "only clusters without a shared procedure fail: {consolidate}"
    );
    let skills = dir.path().join("skills");
    let folders: Vec<PathBuf> = std::fs::read_dir(&skills)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    assert!(
        folders.len() >= 3,
        "at least 3 skills from the samples: {folders:?}"
    );
    for folder in &folders {
        let check = run(Command::new(agentskills()).arg("validate").arg(folder));
        assert!(
            check.status.success(),
            "agentskills validate {}:\n{}{}",
            folder.display(),
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        let provenance: Value =
            serde_json::from_slice(&std::fs::read(folder.join("provenance.json")).unwrap())
                .unwrap();
        assert!(
            provenance["source_episodes"]
                .as_array()
                .is_some_and(|e| !e.is_empty()),
            "{provenance}"
        );
    }
    assert!(skills.join("CHANGES.md").is_file());
}

/// A sharded night with a conversation that grew: the connect merge records the grown episodes
/// as handled (each shard connected again those it owns), so the next connect does not connect
/// them again.
#[test]
fn a_sharded_connect_merge_records_the_grown_episodes_handled() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    add_log(dir.path(), "trajectories.jsonl");
    // The fixture's two versions of one conversation, logged on two nights.
    let versions: Vec<String> =
        std::fs::read_to_string(repo().join("tests/data/formats/openai-grown.jsonl"))
            .unwrap()
            .lines()
            .map(|l| format!("{l}\n"))
            .collect();
    std::fs::write(dir.path().join("logs/chat-1.jsonl"), &versions[0]).unwrap();
    ok(run(fluxmem()
        .arg("run")
        .arg(&file)
        .args(["--run-id", "night-1"])));
    std::fs::write(dir.path().join("logs/chat-2.jsonl"), &versions[1]).unwrap();
    for stage in ["ingest", "embed", "connect"] {
        for i in 0..2 {
            let shard = format!("{i}/2");
            ok(run(fluxmem().arg("run").arg(&file).args([
                "--run-id", "night-2", "--stage", stage, "--shard", &shard,
            ])));
        }
        ok(run(fluxmem().arg("run").arg(&file).args([
            "--run-id", "night-2", "--stage", stage, "--merge", "2",
        ])));
    }
    let store = fluxmem_store::Store::open(dir.path().join("store")).unwrap();
    let manifest = store.manifest().unwrap();
    let grown = store
        .edited_nodes(&manifest, fluxmem_graph::EPISODE_GROWN)
        .unwrap();
    assert!(!grown.is_empty(), "the fixture's conversation grew");
    assert_eq!(
        manifest.progress.get("connect.grown_edits"),
        Some(&Value::from(grown.len())),
        "{:?}",
        manifest.progress
    );
    // Connect again, unsharded: nothing to connect again.
    let record = finished(&run(fluxmem()
        .arg("run")
        .arg(&file)
        .args(["--run-id", "again", "--stage", "connect", "--json"])));
    assert_eq!(
        stage(&record, "connect")["status"],
        "nothing new",
        "{record}"
    );
}

/// A sharded embed that plans first: the shards (one retried, in any order) embed the plan's
/// buckets, a merge before every bucket is in names the missing ones, and the merge commits the
/// shards of an unsharded embed, byte for byte (MiniLM computes a text's vector whatever the
/// batch it is in). Then connect, planned the same way, commits an unsharded connect's shards.
#[test]
fn a_planned_sharded_embed_and_connect_commit_the_shards_of_unsharded_ones() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), false);
    add_log(dir.path(), "trajectories.jsonl");
    add_log(dir.path(), "alfworld/react_sample.json");
    let planned_file = dir.path().join("planned.toml");
    std::fs::write(
        &planned_file,
        std::fs::read_to_string(&file)
            .unwrap()
            .replace("store = \"store\"", "store = \"planned\"")
            .replace("dir = \"runs\"", "dir = \"planned-runs\""),
    )
    .unwrap();
    let step = |file: &Path, args: &[&str]| {
        let mut command = fluxmem();
        command
            .arg("run")
            .arg(file)
            .args(["--run-id", "night", "--stage"])
            .args(args);
        run(&mut command)
    };
    for file in [&file, &planned_file] {
        ok(step(file, &["ingest"]));
    }
    ok(step(&file, &["embed"]));

    let plan = json_line(&ok(step(&planned_file, &["embed", "--plan"])));
    assert_eq!(plan["status"], "planned", "{plan}");
    assert!(plan["counts_out"]["items"].as_u64().unwrap() > 10, "{plan}");
    for shard in ["1/3", "0/3"] {
        let executed = json_line(&ok(step(&planned_file, &["embed", "--shard", shard])));
        assert_eq!(executed["status"], "executed", "{executed}");
        assert_eq!(executed["details"]["plan"], plan["details"]["digest"]);
    }
    let early = step(&planned_file, &["embed", "--merge", "3"]);
    let stderr = String::from_utf8_lossy(&early.stderr);
    assert!(
        !early.status.success() && stderr.contains("have no vector"),
        "{stderr}"
    );
    // The buckets named are shard 2's (b mod 3 = 2).
    let named = stderr
        .split("buckets [")
        .nth(1)
        .unwrap()
        .split(']')
        .next()
        .unwrap();
    let buckets: Vec<u32> = named.split(", ").map(|b| b.parse().unwrap()).collect();
    assert!(
        !buckets.is_empty() && buckets.iter().all(|b| b % 3 == 2),
        "{stderr}"
    );
    for shard in ["2/3", "1/3"] {
        ok(step(&planned_file, &["embed", "--shard", shard]));
    }
    let merged = json_line(&ok(step(&planned_file, &["embed", "--merge", "3"])));
    assert_eq!(merged["status"], "merged", "{merged}");
    assert_eq!(merged["details"]["plan"], plan["details"]["digest"]);
    assert!(!dir.path().join("planned/scratch/embed/night").exists());
    let whole = shard_list(&dir.path().join("store"));
    assert!(whole.iter().any(|(file, _, _)| file.contains("embeddings")));
    assert_eq!(shard_list(&dir.path().join("planned")), whole);

    // Connect's model work too: the ground queries' texts planned, embedded by shards (one run
    // twice), and the edges committed by one writer with their vectors: an in-process
    // connect's shards, byte for byte.
    ok(step(&file, &["connect"]));
    let plan = json_line(&ok(step(&planned_file, &["connect", "--plan"])));
    assert_eq!(plan["status"], "planned", "{plan}");
    assert_eq!(plan["details"]["stage"], "connect", "{plan}");
    assert!(plan["counts_out"]["items"].as_u64().unwrap() > 10, "{plan}");
    assert!(dir
        .path()
        .join("planned/scratch/embed/connect@night")
        .is_dir());
    for shard in ["1/2", "0/2", "1/2"] {
        let executed = json_line(&ok(step(&planned_file, &["connect", "--shard", shard])));
        assert_eq!(executed["status"], "executed", "{executed}");
        assert_eq!(executed["details"]["plan"], plan["details"]["digest"]);
    }
    // Planned with one query per step: a merge under one query per task is refused.
    let per_task = dir.path().join("per-task.toml");
    std::fs::write(
        &per_task,
        std::fs::read_to_string(&planned_file)
            .unwrap()
            .replace("[connect]\n", "[connect]\nper_step = false\n"),
    )
    .unwrap();
    let refused = step(&per_task, &["connect", "--merge", "2"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("connect settings"),
        "{stderr}"
    );
    let merged = json_line(&ok(step(&planned_file, &["connect", "--merge", "2"])));
    assert_eq!(merged["status"], "merged", "{merged}");
    assert!(
        merged["counts_out"]["ground_edges"].as_u64().unwrap() > 0,
        "{merged}"
    );
    assert!(!dir
        .path()
        .join("planned/scratch/embed/connect@night")
        .exists());
    let whole = shard_list(&dir.path().join("store"));
    assert!(whole.iter().any(|(file, _, _)| file.contains("edges")));
    assert_eq!(shard_list(&dir.path().join("planned")), whole);
}

/// Slurm's submit script as a night runs it: its chain of jobs, each run in order by a stand-in
/// for `sbatch` (the job's script run at once; an array once per task, with
/// `SLURM_ARRAY_TASK_ID` and `SLURM_ARRAY_TASK_COUNT` set), plans, shards and merges embed,
/// connect and consolidate, runs refine and export once, and gives the store and skills of
/// `fluxmem run`. The scheduler is the stand-in; the scripts and the binary are the real ones.
#[test]
fn the_slurm_chain_plans_shards_and_merges_to_the_store_of_one_run() {
    let dir = tempfile::tempdir().unwrap();
    pipeline(dir.path(), true);
    add_log(dir.path(), "trajectories.jsonl");
    add_log(dir.path(), "alfworld/react_sample.json");
    let write = |name: &str, store: &str| -> PathBuf {
        let text = std::fs::read_to_string(pipeline(dir.path(), true))
            .unwrap()
            .replace("store = \"store\"", &format!("store = \"{store}\""))
            .replace("seed = 7", "seed = 7\n\n[models]\ngenerator = \"none\"")
            .replace("clusters = 1", "clusters = 3")
            .replace("out = \"skills\"", &format!("out = \"{store}-skills\""))
            .replace("dir = \"runs\"", &format!("dir = \"{store}-runs\""));
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let whole_file = write("whole.toml", "whole");
    let slurm_file = write("slurm.toml", "slurm");
    ok(run(fluxmem()
        .arg("run")
        .arg(&whole_file)
        .args(["--run-id", "night"])));

    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let sbatch = bin.join("sbatch");
    std::fs::write(
        &sbatch,
        r#"#!/usr/bin/env bash
# A stand-in for sbatch: runs the job's script now (an array: each task in order), logs the job's
# name and prints its id. Its options before the script: --job-name=, --array=0-K, others.
set -euo pipefail
name="" array=""
while [[ $# -gt 1 ]]; do
  case $1 in
    --job-name=*) name=${1#--job-name=} ;;
    --array=*) array=${1#--array=0-} ;;
  esac
  shift
done
echo "$name" >> "$SBATCH_LOG"
if [[ -n $array ]]; then
  for ((i = 0; i <= array; i++)); do
    SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_COUNT=$((array + 1)) bash "$1" >&2
  done
else
  bash "$1" >&2
fi
wc -l < "$SBATCH_LOG"
"#,
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&sbatch, std::fs::Permissions::from_mode(0o755)).unwrap();
    let log = dir.path().join("sbatch.log");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let submitted = run(Command::new("bash")
        .arg(repo().join("integrations/slurm/submit-nightly.sh"))
        .arg(&slurm_file)
        .args(["2", "night"])
        .env("PATH", path)
        .env("SBATCH_LOG", &log)
        .env("FLUXMEM_BIN", env!("CARGO_BIN_EXE_fluxmem"))
        .env_remove("FLUXMEM_FAULT"));
    let stdout = String::from_utf8_lossy(&submitted.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&submitted.stderr);
    assert!(submitted.status.success(), "{stdout}\n{stderr}");
    let jobs = std::fs::read_to_string(&log).unwrap();
    let expected = [
        "fluxmem-ingest",
        "fluxmem-merge-ingest",
        "fluxmem-plan-embed",
        "fluxmem-embed",
        "fluxmem-merge-embed",
        "fluxmem-plan-connect",
        "fluxmem-connect",
        "fluxmem-merge-connect",
        "fluxmem-refine",
        "fluxmem-plan-consolidate",
        "fluxmem-consolidate",
        "fluxmem-merge-consolidate",
        "fluxmem-export",
    ];
    assert_eq!(jobs.lines().collect::<Vec<_>>(), expected, "{stdout}");
    // Consolidate planned once; the merge, which refuses a shard that did not follow the plan,
    // committed (the chain went on to export).
    assert!(
        stderr.contains("clusters planned for the shards"),
        "{stderr}"
    );

    let (whole, slurm) = (
        graph(&dir.path().join("whole")),
        graph(&dir.path().join("slurm")),
    );
    assert_eq!(whole.nodes, slurm.nodes, "the same nodes, skills included");
    assert!(
        whole
            .nodes
            .values()
            .any(|n| n.kind() == fluxmem_graph::NodeKind::Procedural),
        "the night made skills"
    );
    assert_eq!(
        whole.edges.keys().collect::<Vec<_>>(),
        slurm.edges.keys().collect::<Vec<_>>(),
        "the same edges"
    );
    let skills =
        |store: &str| std::fs::read(dir.path().join(format!("{store}-skills/skills.jsonl")));
    assert_eq!(
        skills("whole").unwrap(),
        skills("slurm").unwrap(),
        "the same export"
    );
}
