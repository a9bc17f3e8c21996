//! `fluxmem eval skills`: how good the skills of Stage III are, per generator, on a benchmark
//! with gold labels that fluxmem never sees.
//!
//! The data file is ingested and embedded once into a temporary store ([`prepare`]); each
//! generator then consolidates its own copy of that store ([`evaluate`]) and its skills (the
//! export's records) are scored:
//! - **tau-bench** (gold `info.task.actions`, read here only): per task, the skill holding most
//!   of the task's runs is the task's skill, and
//!   - coverage: the share of the task's runs that skill holds;
//!   - tool recall: the share of the gold tools the skill names;
//!   - order: LCS of the gold tool sequence and the skill's over the gold length;
//!   - precision: the share of the skill's named tools that the task's successful runs called.
//!
//!   Recall and order are means over the tasks with gold actions, precision over the tasks with
//!   a successful run.
//! - **ALFWorld** (the task type in each transcript's name, read here only): purity and NMI of
//!   the clusters against the task type, and the skills' action verbs against their source
//!   transcripts' (verb precision: the skill's verbs that its sources use; verb recall: the
//!   verbs most of its sources use that the skill names).
//!
//! A tool is "named" by a skill when a step writes it in backticks (`` `cancel_reservation` ``),
//! which is how mined steps are worded.

use fluxmem_consolidate::{
    consolidate_store, skill_records, ConsolidateOptions, Models, Progress, SkillRecord,
};
use fluxmem_graph::{Graph, NodeBody};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The benchmarks `eval skills` scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Benchmark {
    /// tau-bench run results (a JSON array of runs with `task_id` and `info.task.actions`).
    TauBench,
    /// ALFWorld transcripts (a JSON object of named transcripts, `<style>_<task type>_<n>`).
    Alfworld,
}

/// The data, ingested and embedded once, and its gold labels.
pub struct Prepared {
    dir: tempfile::TempDir,
    /// The data file.
    pub data: PathBuf,
    /// Which benchmark it is.
    pub benchmark: Benchmark,
    /// tau-bench: gold tool names per task id.
    gold_actions: BTreeMap<String, Vec<String>>,
    /// Episodes ingested (the seen ones, with a holdout).
    pub episodes: usize,
    /// With a holdout: the unseen episodes, ingested apart (consolidation never reads them).
    pub unseen: Vec<fluxmem_graph::Node>,
}

impl Prepared {
    fn store(&self) -> PathBuf {
        self.dir.path().join("store")
    }
}

/// Ingests and embeds `data` (tau-bench or ALFWorld, detected from the file) into a temporary
/// store, and reads its gold labels.
/// With `holdout`, the runs are split first ([`crate::replay::unseen`]; tau-bench by episode
/// index or by task id, ALFWorld by transcript name or by task line): only the seen part is
/// ingested into the store consolidation reads; the unseen part is ingested into a store of
/// its own and kept in [`Prepared::unseen`].
pub fn prepare(
    data: &Path,
    embedder: &dyn fluxmem_models::Embedder,
    holdout: Option<(crate::replay::Split, u64)>,
) -> Result<Prepared> {
    let bytes = std::fs::read(data).map_err(|source| Error::Io {
        path: data.into(),
        source,
    })?;
    let benchmark = match fluxmem_ingest::Format::detect(data, &bytes) {
        Some(fluxmem_ingest::Format::TauBench) => Benchmark::TauBench,
        Some(fluxmem_ingest::Format::Alfworld) => Benchmark::Alfworld,
        other => {
            return Err(Error::Data {
                path: data.into(),
                reason: format!(
                    "`eval skills` scores tau-bench or ALFWorld data; this file reads as {other:?}"
                ),
            })
        }
    };
    let gold_actions = match benchmark {
        Benchmark::TauBench => tau_gold(data, &bytes)?,
        Benchmark::Alfworld => BTreeMap::new(),
    };
    let dir = tempfile::tempdir().map_err(|source| Error::Io {
        path: std::env::temp_dir(),
        source,
    })?;
    let format = match benchmark {
        Benchmark::TauBench => fluxmem_ingest::Format::TauBench,
        Benchmark::Alfworld => fluxmem_ingest::Format::Alfworld,
    };
    let (inputs, unseen) = match holdout {
        None => (data.to_path_buf(), Vec::new()),
        Some((split, seed)) => {
            let (seen, unseen) = match benchmark {
                Benchmark::TauBench => split_runs(data, &bytes, split, seed)?,
                Benchmark::Alfworld => split_transcripts(data, &bytes, split, seed)?,
            };
            let seen_path = dir.path().join("seen.json");
            let unseen_path = dir.path().join("unseen.json");
            for (path, runs) in [(&seen_path, &seen), (&unseen_path, &unseen)] {
                std::fs::write(path, serde_json::to_vec(runs).expect("runs serialise")).map_err(
                    |source| Error::Io {
                        path: path.clone(),
                        source,
                    },
                )?;
            }
            let unseen_store = dir.path().join("unseen-store");
            let mut writer = fluxmem_store::Writer::open(&unseen_store)?;
            fluxmem_ingest::ingest(
                &mut writer,
                &[unseen_path],
                &fluxmem_ingest::IngestOptions {
                    format: Some(format),
                    ..Default::default()
                },
                "eval",
                &mut fluxmem_ingest::NoProgress,
            )?;
            let graph = writer.store().load()?;
            let nodes: Vec<fluxmem_graph::Node> = graph
                .nodes
                .into_values()
                .filter(|n| n.episode().is_some())
                .collect();
            (seen_path, nodes)
        }
    };
    let mut writer = fluxmem_store::Writer::open(dir.path().join("store"))?;
    let options = fluxmem_ingest::IngestOptions {
        format: Some(format),
        ..Default::default()
    };
    let report = fluxmem_ingest::ingest(
        &mut writer,
        &[inputs],
        &options,
        "eval",
        &mut fluxmem_ingest::NoProgress,
    )?;
    if report.quarantined > 0 {
        return Err(Error::Data {
            path: data.into(),
            reason: format!("{} records could not be ingested", report.quarantined),
        });
    }
    fluxmem_embed::embed_store(
        &mut writer,
        embedder,
        &Default::default(),
        "eval",
        &mut fluxmem_embed::NoProgress,
    )?;
    // One record per run or transcript, each one episode (its first node).
    let episodes = report.ingested as usize;
    drop(writer);
    Ok(Prepared {
        dir,
        data: data.into(),
        benchmark,
        gold_actions,
        episodes,
        unseen,
    })
}

/// ALFWorld transcripts (an object of name to transcript) split into (seen, unseen) by
/// [`crate::replay::unseen`]: the key is the transcript's name (episode split) or its
/// `Your task is to:` line (task split, so that the runs of one task stay on one side).
fn split_transcripts(
    path: &Path,
    bytes: &[u8],
    split: crate::replay::Split,
    seed: u64,
) -> Result<(Value, Value)> {
    let transcripts: serde_json::Map<String, Value> =
        serde_json::from_slice(bytes).map_err(|e| Error::Data {
            path: path.into(),
            reason: format!("not a JSON object of transcripts: {e}"),
        })?;
    let (mut seen, mut unseen) = (serde_json::Map::new(), serde_json::Map::new());
    for (name, transcript) in transcripts {
        let key = match split {
            crate::replay::Split::Episode => format!("run {name}"),
            crate::replay::Split::Task => {
                let text = transcript.as_str().unwrap_or_default();
                let task = fluxmem_ingest::alfworld_task_line(text).unwrap_or(name.as_str());
                format!("task {}", task.trim())
            }
        };
        if crate::replay::unseen(&key, seed) {
            unseen.insert(name, transcript);
        } else {
            seen.insert(name, transcript);
        }
    }
    Ok((Value::Object(seen), Value::Object(unseen)))
}

/// The runs of a tau-bench file split into (seen, unseen) by [`crate::replay::unseen`]: the
/// key is the run's index (episode split) or its task id (task split).
fn split_runs(
    path: &Path,
    bytes: &[u8],
    split: crate::replay::Split,
    seed: u64,
) -> Result<(Value, Value)> {
    let runs: Vec<Value> = serde_json::from_slice(bytes).map_err(|e| Error::Data {
        path: path.into(),
        reason: format!("not a JSON array of runs: {e}"),
    })?;
    let (mut seen, mut unseen) = (Vec::new(), Vec::new());
    for (i, run) in runs.into_iter().enumerate() {
        let key = match split {
            crate::replay::Split::Episode => format!("run {i}"),
            crate::replay::Split::Task => format!("task {}", run["task_id"]),
        };
        if crate::replay::unseen(&key, seed) {
            unseen.push(run);
        } else {
            seen.push(run);
        }
    }
    Ok((Value::Array(seen), Value::Array(unseen)))
}

fn tau_gold(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, Vec<String>>> {
    let runs: Vec<Value> = serde_json::from_slice(bytes).map_err(|e| Error::Data {
        path: path.into(),
        reason: format!("not a JSON array of runs: {e}"),
    })?;
    let mut gold = BTreeMap::new();
    for (i, run) in runs.iter().enumerate() {
        let task = match &run["task_id"] {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => {
                return Err(Error::Data {
                    path: path.into(),
                    reason: format!("run {i}: field `task_id` is missing"),
                })
            }
        };
        let actions = run["info"]["task"]["actions"]
            .as_array()
            .map_or_else(Vec::new, |a| {
                a.iter()
                    .filter_map(|action| action["name"].as_str().map(str::to_string))
                    .collect()
            });
        gold.entry(task).or_insert(actions);
    }
    Ok(gold)
}

/// One generator's consolidation and the scores of its skills.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GeneratorResult {
    /// `none` or the generator's model name.
    pub generator: String,
    /// Wall seconds of the consolidation.
    pub seconds: f64,
    /// Generator calls, prompt and generated tokens.
    pub calls: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// Clusters.
    pub clusters: usize,
    /// Skills.
    pub skills: usize,
    /// Skills whose name and description the generator wrote (the rest are template-worded).
    pub model_worded: usize,
    /// Clusters whose successes share no procedure.
    pub no_procedure: usize,
    /// Clusters that failed otherwise.
    pub failed: usize,
    /// tau-bench scores.
    pub tau: Option<TauScores>,
    /// ALFWorld scores.
    pub alfworld: Option<AlfworldScores>,
    /// What a reader would object to in the skills' text.
    pub lint: SkillLint,
    /// With `--replay`: the replay of the unseen episodes with and without these skills.
    pub replay: Option<crate::replay::ReplayReport>,
    /// With a holdout: per unseen episode, the skill `fluxmem query` serves first for its task
    /// from the store this consolidation wrote (none: left out).
    #[serde(skip)]
    pub served: BTreeMap<fluxmem_graph::NodeId, fluxmem_graph::NodeId>,
    /// The skills (as exported).
    pub records: Vec<SkillRecord>,
}

/// tau-bench scores: means and one row per task.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TauScores {
    /// Mean coverage over all tasks.
    pub coverage: f64,
    /// Mean tool recall over the tasks with gold actions.
    pub recall: f64,
    /// Mean order over the tasks with gold actions.
    pub order: f64,
    /// Mean precision over the tasks with a successful run.
    pub precision: f64,
    /// Tasks; with gold actions; with a successful run.
    pub tasks: usize,
    /// Tasks with gold actions.
    pub with_gold: usize,
    /// Tasks with a successful run.
    pub with_success: usize,
    /// Per task.
    pub per_task: Vec<TaskRow>,
}

/// One tau-bench task.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TaskRow {
    /// Task id.
    pub task: String,
    /// The skill holding most of its runs.
    pub skill: String,
    /// Coverage.
    pub coverage: f64,
    /// Tool recall (with gold actions).
    pub recall: Option<f64>,
    /// Order (with gold actions).
    pub order: Option<f64>,
    /// Precision (with a successful run).
    pub precision: Option<f64>,
    /// Gold tool sequence.
    pub gold: Vec<String>,
    /// The skill's named tools.
    pub named: Vec<String>,
}

/// What a reader would object to in a set of skills (issue 41's checks), counted.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SkillLint {
    /// Skills whose name (lower-cased, at least three words) is a part of an episode's task:
    /// named after a user's message.
    pub names_from_tasks: usize,
    /// Steps equal to the step before them.
    pub consecutive_duplicate_steps: usize,
    /// Pitfall lines said twice in one skill.
    pub duplicate_pitfalls: usize,
    /// Skills whose name (case aside) an earlier skill of their tenant already has.
    pub shared_names: usize,
    /// Skills whose steps (where values come from aside) an earlier skill of their tenant
    /// already has: one procedure shown twice.
    pub shared_steps: usize,
}

fn lint(graph: &Graph, records: &[SkillRecord]) -> SkillLint {
    let tasks: Vec<String> = graph
        .nodes
        .values()
        .filter(|n| matches!(n.body, NodeBody::Episodic(_)))
        .map(|n| n.text.to_lowercase())
        .collect();
    let mut out = SkillLint::default();
    let mut names: BTreeSet<(&str, String)> = BTreeSet::new();
    let mut procedures: BTreeSet<(&str, Vec<String>)> = BTreeSet::new();
    for record in records {
        if !names.insert((record.tenant.as_str(), record.name.to_lowercase())) {
            out.shared_names += 1;
        }
        let steps: Vec<String> = record
            .steps
            .iter()
            .map(|s| crate::replay::without_origins(s))
            .collect();
        if !steps.is_empty() && !procedures.insert((record.tenant.as_str(), steps)) {
            out.shared_steps += 1;
        }
        let name = record.name.to_lowercase().replace('…', " ");
        let words: Vec<&str> = name.split_whitespace().collect();
        if words.len() >= 3 && tasks.iter().any(|t| t.contains(&words.join(" "))) {
            out.names_from_tasks += 1;
        }
        out.consecutive_duplicate_steps += record.steps.windows(2).filter(|w| w[0] == w[1]).count();
        let distinct: BTreeSet<&String> = record.pitfalls.iter().collect();
        out.duplicate_pitfalls += record.pitfalls.len() - distinct.len();
    }
    out
}

/// ALFWorld scores.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AlfworldScores {
    /// Cluster purity against the task type.
    pub purity: f64,
    /// Normalised mutual information (arithmetic mean normalisation) against the task type.
    pub nmi: f64,
    /// Mean over skills: the share of the skill's verbs that its source transcripts use.
    pub verb_precision: f64,
    /// Mean over skills: the share of the verbs most of its sources use that the skill names.
    pub verb_recall: f64,
}

/// Consolidates a copy of the prepared store with `models` and scores the skills.
pub fn evaluate(
    prepared: &Prepared,
    label: &str,
    models: &mut Models<'_>,
    options: &ConsolidateOptions,
    device: &candle_core::Device,
    progress: &mut dyn Progress,
) -> Result<GeneratorResult> {
    let copy = tempfile::tempdir().map_err(|source| Error::Io {
        path: std::env::temp_dir(),
        source,
    })?;
    let store = copy.path().join("store");
    copy_store(&prepared.store(), &store)?;
    let mut writer = fluxmem_store::Writer::open(&store)?;
    let started = std::time::Instant::now();
    let report = consolidate_store(
        &mut writer,
        models,
        options,
        "eval-skills",
        device,
        progress,
    )
    .map_err(|e| Error::Data {
        path: prepared.data.clone(),
        reason: format!("consolidate with generator {label}: {e}"),
    })?;
    let seconds = started.elapsed().as_secs_f64();
    let graph = writer.store().load()?;
    let records = skill_records(&graph);
    let model_worded = records
        .iter()
        .filter(|r| {
            let node = graph.nodes.get(&fluxmem_graph::NodeId::from(r.id.as_str()));
            node.and_then(|n| n.metadata.get("wording"))
                .and_then(|w| w.get("source"))
                .and_then(Value::as_str)
                == Some("generator")
        })
        .count();
    let mut result = GeneratorResult {
        generator: label.into(),
        seconds,
        calls: report.generator.calls,
        prompt_tokens: report.generator.prompt_tokens,
        generated_tokens: report.generator.generated_tokens,
        clusters: report.clusters,
        skills: records.len(),
        model_worded,
        no_procedure: report.no_procedure,
        failed: report.failed - report.no_procedure.min(report.failed),
        ..Default::default()
    };
    match prepared.benchmark {
        Benchmark::TauBench => {
            result.tau = Some(score_tau(&graph, &records, &prepared.gold_actions))
        }
        Benchmark::Alfworld => {
            let clusters: Vec<Vec<String>> = report
                .cluster_list
                .iter()
                .map(|c| c.episodes.iter().map(|id| id.to_string()).collect())
                .collect();
            let labels = alfworld_labels(&prepared.data)?;
            result.alfworld = Some(score_alfworld(&graph, &records, &clusters, &labels));
        }
    }
    result.lint = lint(&graph, &records);
    if !prepared.unseen.is_empty() {
        result.served = crate::replay::served_skills(
            writer.store(),
            &prepared.unseen,
            models.embedder,
            device,
        )?;
    }
    result.records = records;
    Ok(result)
}

fn copy_store(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).map_err(|source| Error::Io {
        path: to.into(),
        source,
    })?;
    for entry in std::fs::read_dir(from).map_err(|source| Error::Io {
        path: from.into(),
        source,
    })? {
        let entry = entry.map_err(|source| Error::Io {
            path: from.into(),
            source,
        })?;
        let (source_path, target) = (entry.path(), to.join(entry.file_name()));
        if entry.file_name() == "LOCK" {
            continue;
        }
        if source_path.is_dir() {
            copy_store(&source_path, &target)?;
        } else {
            std::fs::copy(&source_path, &target).map_err(|source| Error::Io {
                path: source_path.clone(),
                source,
            })?;
        }
    }
    Ok(())
}

/// The tools a skill calls: in each step, the backticked identifier after "call" (a step also
/// names its arguments and the tools their values come from, which are not calls), in order.
pub fn named_tools(record: &SkillRecord) -> Vec<String> {
    let mut tools = Vec::new();
    for step in &record.steps {
        if let Some((tool, _)) = fluxmem_consolidate::step_call(step) {
            tools.push(tool.to_string());
        }
    }
    tools
}

/// The mean of `values` (0 for none).
pub(crate) fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

fn score_tau(
    graph: &Graph,
    records: &[SkillRecord],
    gold: &BTreeMap<String, Vec<String>>,
) -> TauScores {
    // Runs per task, and the tools each run called.
    let mut runs: BTreeMap<String, Vec<(String, bool, BTreeSet<String>)>> = BTreeMap::new();
    for node in graph.nodes.values() {
        let NodeBody::Episodic(episode) = &node.body else {
            continue;
        };
        let task = match node.metadata.get("task_id") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => continue,
        };
        if !gold.contains_key(&task) {
            continue;
        }
        let used: BTreeSet<String> = episode
            .steps
            .iter()
            .flat_map(|s| s.tool_calls.iter().map(|c| c.name.clone()))
            .collect();
        runs.entry(task).or_default().push((
            node.id.to_string(),
            episode.outcome.success == Some(true),
            used,
        ));
    }
    let sources: Vec<BTreeSet<&str>> = records
        .iter()
        .map(|r| r.source_episodes.iter().map(String::as_str).collect())
        .collect();
    #[allow(clippy::type_complexity)] // `runs` by task, sorted below
    let mut tasks: Vec<(&String, &Vec<(String, bool, BTreeSet<String>)>)> = runs.iter().collect();
    tasks.sort_by_key(|(task, _)| (task.parse::<i64>().unwrap_or(i64::MAX), (*task).clone()));
    let (mut coverage, mut recall, mut order, mut precision) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut per_task = Vec::new();
    for (task, episodes) in tasks {
        let held = |i: usize| {
            episodes
                .iter()
                .filter(|(id, _, _)| sources[i].contains(id.as_str()))
                .count()
        };
        // The skill holding most of the task's runs; ties go to the smaller id.
        let best = (0..records.len()).max_by(|&a, &b| {
            held(a)
                .cmp(&held(b))
                .then(records[b].id.cmp(&records[a].id))
        });
        let gold_tools = &gold[task];
        let (name, named, held_runs) = match best {
            Some(i) => (records[i].name.clone(), named_tools(&records[i]), held(i)),
            None => (String::new(), Vec::new(), 0),
        };
        let mut row = TaskRow {
            task: task.clone(),
            skill: name,
            coverage: held_runs as f64 / episodes.len() as f64,
            gold: gold_tools.clone(),
            named: named.clone(),
            ..Default::default()
        };
        coverage.push(row.coverage);
        if !gold_tools.is_empty() {
            let gold_set: BTreeSet<&String> = gold_tools.iter().collect();
            let r = gold_set.iter().filter(|t| named.contains(t)).count() as f64
                / gold_set.len() as f64;
            let gold_names: Vec<&str> = gold_tools.iter().map(String::as_str).collect();
            let named_names: Vec<&str> = named.iter().map(String::as_str).collect();
            let o = fluxmem_consolidate::lcs_len(&gold_names, &named_names) as f64
                / gold_tools.len() as f64;
            recall.push(r);
            order.push(o);
            row.recall = Some(r);
            row.order = Some(o);
        }
        let wins: Vec<&BTreeSet<String>> = episodes
            .iter()
            .filter(|(_, success, _)| *success)
            .map(|(_, _, used)| used)
            .collect();
        if !wins.is_empty() {
            let successful: BTreeSet<&String> = wins.iter().flat_map(|u| u.iter()).collect();
            let p = named.iter().filter(|t| successful.contains(t)).count() as f64
                / named.len().max(1) as f64;
            precision.push(p);
            row.precision = Some(p);
        }
        per_task.push(row);
    }
    TauScores {
        coverage: mean(&coverage),
        recall: mean(&recall),
        order: mean(&order),
        precision: mean(&precision),
        tasks: coverage.len(),
        with_gold: recall.len(),
        with_success: precision.len(),
        per_task,
    }
}

/// The verb of an action or a step: its first word, lower-cased (`go to` is one verb).
fn verb(text: &str) -> Option<String> {
    let mut words = text
        .split_whitespace()
        .map(|w| {
            w.trim_matches(|c: char| !c.is_alphanumeric())
                .to_lowercase()
        })
        .filter(|w| !w.is_empty());
    let first = words.next()?;
    if first == "go" && words.next().as_deref() == Some("to") {
        return Some("go to".into());
    }
    Some(first)
}

/// The ALFWorld task type of each trajectory of the data file, by name: the label the
/// clusters are scored against, read from the source file (`<style>_<task type>_<n>` names),
/// never from the store.
fn alfworld_labels(data: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(data).map_err(|source| Error::Io {
        path: data.into(),
        source,
    })?;
    let value: Value = serde_json::from_str(&text).map_err(|e| Error::Data {
        path: data.into(),
        reason: format!("not JSON: {e}"),
    })?;
    let names = value.as_object().map(|o| o.keys()).into_iter().flatten();
    Ok(names
        .filter_map(|name| Some((name.clone(), name.split('_').nth(1)?.to_string())))
        .collect())
}

fn score_alfworld(
    graph: &Graph,
    records: &[SkillRecord],
    clusters: &[Vec<String>],
    labels: &BTreeMap<String, String>,
) -> AlfworldScores {
    let node = |id: &str| graph.nodes.get(&fluxmem_graph::NodeId::from(id));
    let task_type = |id: &str| -> Option<String> {
        node(id)
            .and_then(|n| labels.get(&n.source_locator))
            .cloned()
    };
    // Purity and NMI over the clustered episodes with a task type.
    let labelled: Vec<Vec<String>> = clusters
        .iter()
        .map(|c| c.iter().filter_map(|id| task_type(id)).collect())
        .collect();
    let n: usize = labelled.iter().map(Vec::len).sum();
    let mut purity = 0.0;
    let mut nmi = 0.0;
    if n > 0 {
        let mut classes: BTreeMap<&str, usize> = BTreeMap::new();
        let mut joint: Vec<BTreeMap<&str, usize>> = Vec::new();
        for cluster in &labelled {
            let mut counts = BTreeMap::new();
            for label in cluster {
                *counts.entry(label.as_str()).or_insert(0) += 1;
                *classes.entry(label.as_str()).or_insert(0) += 1;
            }
            purity += counts.values().max().copied().unwrap_or(0) as f64;
            joint.push(counts);
        }
        purity /= n as f64;
        let n = n as f64;
        let entropy = |counts: &mut dyn Iterator<Item = usize>| -> f64 {
            counts
                .filter(|&c| c > 0)
                .map(|c| c as f64 / n)
                .map(|p| -p * p.ln())
                .sum()
        };
        let h_clusters = entropy(&mut labelled.iter().map(Vec::len));
        let h_classes = entropy(&mut classes.values().copied());
        let mut mutual = 0.0;
        for (cluster, counts) in labelled.iter().zip(&joint) {
            for (label, &count) in counts {
                let p = count as f64 / n;
                mutual += p * (p / ((cluster.len() as f64 / n) * (classes[label] as f64 / n))).ln();
            }
        }
        let denominator = (h_clusters + h_classes) / 2.0;
        nmi = if denominator > 0.0 {
            mutual / denominator
        } else {
            1.0
        };
    }
    let (mut precision, mut recall) = (Vec::new(), Vec::new());
    for record in records {
        let skill_verbs: BTreeSet<String> = record.steps.iter().filter_map(|s| verb(s)).collect();
        let mut source_verbs: BTreeMap<String, usize> = BTreeMap::new();
        let mut sources = 0;
        for id in &record.source_episodes {
            let Some(source) = node(id) else { continue };
            let NodeBody::Episodic(episode) = &source.body else {
                continue;
            };
            sources += 1;
            let verbs: BTreeSet<String> = episode
                .steps
                .iter()
                .filter_map(|s| verb(&s.action))
                .filter(|v| v != "think")
                .collect();
            for v in verbs {
                *source_verbs.entry(v).or_insert(0) += 1;
            }
        }
        if sources == 0 || skill_verbs.is_empty() {
            continue;
        }
        precision.push(
            skill_verbs
                .iter()
                .filter(|v| source_verbs.contains_key(*v))
                .count() as f64
                / skill_verbs.len() as f64,
        );
        let common: Vec<&String> = source_verbs
            .iter()
            .filter(|(_, &c)| 2 * c > sources)
            .map(|(v, _)| v)
            .collect();
        if !common.is_empty() {
            recall.push(
                common.iter().filter(|v| skill_verbs.contains(**v)).count() as f64
                    / common.len() as f64,
            );
        }
    }
    AlfworldScores {
        purity,
        nmi,
        verb_precision: mean(&precision),
        verb_recall: mean(&recall),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(steps: &[&str]) -> SkillRecord {
        SkillRecord {
            steps: steps.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn named_tools_are_the_called_tools_in_order() {
        let r = record(&[
            "Call `get_reservation_details` with `reservation_id` (from the user in 2 of 2 runs).",
            "For each `flight_id`, call `cancel_reservation` with `flight_id` (from `search_flights` → `[*].id` in 2 of 2 runs).",
            "Confirm with the user.",
        ]);
        assert_eq!(
            named_tools(&r),
            vec!["get_reservation_details", "cancel_reservation"]
        );
    }

    #[test]
    fn lint_counts_what_a_reader_objects_to() {
        let named = |tenant: &str, name: &str, steps: &[&str], pitfalls: &[&str]| SkillRecord {
            tenant: tenant.into(),
            name: name.into(),
            pitfalls: pitfalls.iter().map(|s| s.to_string()).collect(),
            ..record(steps)
        };
        let mut graph = Graph::default();
        graph.upsert_node(fluxmem_graph::Node::new(
            NodeBody::Episodic(Default::default()),
            "a",
            "Hi I'd like to change my flight please",
            &["episode"],
        ));
        let records = [
            named("a", "Change my flight", &["x", "y"], &[]),
            named("a", "change MY flight", &["x", "x", "y"], &["p", "p"]),
            named("b", "Change my flight", &["x"], &["p", "q"]),
            named("a", "Take and put", &["x"], &[]),
            named(
                "a",
                "Take and put, with open",
                &["x (from the user in 2 of 2 runs)"],
                &[],
            ),
        ];
        let lint = lint(&graph, &records);
        assert_eq!(lint.names_from_tasks, 3);
        assert_eq!(lint.shared_names, 1, "another tenant's same name is apart");
        assert_eq!(lint.shared_steps, 1, "the same steps, data flow aside");
        assert_eq!(lint.consecutive_duplicate_steps, 1);
        assert_eq!(lint.duplicate_pitfalls, 1);
    }

    #[test]
    fn verbs_treat_go_to_as_one() {
        assert_eq!(verb("Go to <place>.").as_deref(), Some("go to"));
        assert_eq!(
            verb("take apple 1 from countertop 2").as_deref(),
            Some("take")
        );
        assert_eq!(verb("  ").as_deref(), None);
    }
}
