//! Stage III end to end on a temporary store with fake models: a hashing embedder, a scripted
//! generator and a scripted judge (no weights).

use candle_core::Device;
use fluxmem_consolidate::*;
use fluxmem_graph::{Embedding, Episode, Graph, Node, NodeBody, NodeKind, Outcome, Step};
use fluxmem_models::{ChatMessage, Embedder, GenerateParams, Generation, Generator, HashEmbedder, Judge, Usage};
use fluxmem_store::{CommitInfo, Store, Writer};
use std::path::Path;

type Script = Box<dyn FnMut(&[ChatMessage]) -> String + Send>;

/// A generator that answers with a script of the conversation.
struct Scripted {
    script: Script,
    usage: Usage,
}

impl Scripted {
    fn new(script: impl FnMut(&[ChatMessage]) -> String + Send + 'static) -> Scripted {
        Scripted { script: Box::new(script), usage: Usage::default() }
    }
}

impl Generator for Scripted {
    fn model_id(&self) -> &str {
        "scripted@1"
    }
    fn chat_prompt(&self, messages: &[ChatMessage]) -> String {
        messages.iter().map(|m| format!("[{}] {}\n", m.role, m.content)).collect()
    }
    fn generate(&mut self, messages: &[ChatMessage], _: &GenerateParams) -> fluxmem_models::Result<Generation> {
        let text = (self.script)(messages);
        self.usage.calls += 1;
        self.usage.prompt_tokens += self.count_tokens(&self.chat_prompt(messages))?;
        self.usage.generated_tokens += self.count_tokens(&text)?;
        Ok(Generation { text, prompt_tokens: 0, generated_tokens: 0, finish: "stop" })
    }
    fn next_token_logprobs(&mut self, _: &str, suffixes: &[String], options: &[&str]) -> fluxmem_models::Result<Vec<Vec<f32>>> {
        Ok(vec![vec![0.0; options.len()]; suffixes.len()])
    }
    fn count_tokens(&self, text: &str) -> fluxmem_models::Result<usize> {
        Ok(text.split_whitespace().count())
    }
    fn usage(&self) -> Usage {
        self.usage
    }
}

/// A judge that finds a skill consistent with an episode when they share the family word.
struct FamilyJudge {
    usage: Usage,
}

impl Judge for FamilyJudge {
    fn score(&mut self, query: &str, passages: &[&str]) -> fluxmem_models::Result<Vec<f32>> {
        self.usage.calls += passages.len();
        Ok(passages.iter().map(|p| if FAMILIES.iter().any(|f| query.contains(f) && p.contains(f)) { 0.9 } else { 0.1 }).collect())
    }
    fn sufficient(&mut self, _: &str, _: &str) -> fluxmem_models::Result<f32> {
        Ok(0.5)
    }
    fn usage(&self) -> Usage {
        self.usage
    }
    fn model_id(&self) -> &str {
        "family-judge"
    }
}

const FAMILIES: [&str; 3] = ["lettuce", "flight", "invoice"];

fn family_words(family: &str) -> &'static str {
    match family {
        "lettuce" => "wash lettuce sink clean basin rinse",
        "flight" => "book flight airline seat passenger cabin",
        _ => "invoice payment refund billing ledger account",
    }
}

/// An episode of `family`; the last of each family fails.
fn episode(family: &str, i: usize, success: bool) -> Node {
    let words = family_words(family);
    let steps = (0..3)
        .map(|s| Step { observation: format!("obs {s}"), action: format!("{family} step {s} {words}"), ..Default::default() })
        .collect();
    let outcome = Outcome { success: Some(success), reward: None, feedback: None };
    let text = format!("Task {i}: {family} {words}");
    let mut node = Node::new(NodeBody::Episodic(Episode { steps, outcome }), "default", &text, &[family, &i.to_string()]);
    node.created_at = Some(1_000 + i as i64);
    node
}

/// Writes episodes and their hash embeddings.
fn add_episodes(store: &Path, episodes: Vec<Node>) {
    let embedder = HashEmbedder::new(64);
    let mut graph = Graph::default();
    for node in episodes {
        let text = node.embedding_text();
        let vector = embedder.embed(&[text.as_str()]).unwrap().remove(0);
        graph.upsert_embedding(Embedding {
            node_id: node.id.clone(),
            model_id: embedder.model_id().into(),
            text_sha256: fluxmem_graph::sha256_hex(text.as_bytes()),
            vector,
        });
        graph.upsert_node(node);
    }
    let mut writer = Writer::open(store).unwrap();
    writer.commit(&graph, CommitInfo { stage: "test".into(), ..Default::default() }).unwrap();
}

fn three_families(per_family: usize) -> Vec<Node> {
    FAMILIES.iter().flat_map(|f| (0..per_family).map(move |i| episode(f, i, i + 1 < per_family))).collect()
}

/// Names the skill after the family the prompt's first episode belongs to; rewrites drop the
/// last step until two are left.
fn family_skill(messages: &[ChatMessage]) -> String {
    let prompt = &messages.last().unwrap().content;
    let family = FAMILIES.iter().copied().min_by_key(|f| prompt.find(f).unwrap_or(usize::MAX)).unwrap();
    let steps = if prompt.starts_with("Here is a skill") {
        let current = prompt.lines().filter(|l| l.starts_with(|c: char| c.is_ascii_digit())).count();
        current.saturating_sub(1).max(2)
    } else {
        4
    };
    let mut text = format!("Name: Handle {family} tasks\nDescription: Use for {family} work.\nSteps:\n");
    for s in 0..steps {
        let word = family_words(family).split(' ').nth(s % 6).unwrap();
        text.push_str(&format!("{}. do the {family} {word} thing number {s}\n", s + 1));
    }
    text
}

fn options(clusters: usize) -> ConsolidateOptions {
    ConsolidateOptions { kmeans: KMeansOptions { clusters: Some(clusters), seed: 7, ..Default::default() }, ..Default::default() }
}

fn run(store: &Path, generator: &mut dyn Generator, judge: Option<&mut dyn Judge>, options: &ConsolidateOptions) -> ConsolidateReport {
    let embedder = HashEmbedder::new(64);
    let mut writer = Writer::open(store).unwrap();
    let run_id = format!("consolidate@v{}", writer.manifest().version);
    let judge = judge.map(|j| -> &mut dyn Judge { j });
    let mut models = Models { embedder: &embedder, generator, judge };
    consolidate_store(&mut writer, &mut models, options, &run_id, &Device::Cpu, &mut NoProgress).unwrap()
}

fn load(store: &Path) -> Graph {
    Store::open(store).unwrap().load().unwrap()
}

#[test]
fn kmeans_recovers_separable_clusters_deterministically() {
    let mut rng = SplitMix64::new(3);
    let centers = [[1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]];
    let mut vectors = Vec::new();
    let mut truth = Vec::new();
    for i in 0..60 {
        let c = i % 3;
        vectors.push(centers[c].iter().map(|v| v + (rng.next_f64() as f32 - 0.5) * 0.3).collect::<Vec<f32>>());
        truth.push(c);
    }
    let options = KMeansOptions { clusters: Some(3), seed: 11, ..Default::default() };
    let clustering = kmeans(&vectors, &options, &Device::Cpu).unwrap();
    for c in 0..3 {
        let predicted: std::collections::BTreeSet<usize> = (0..60).filter(|&i| truth[i] == c).map(|i| clustering.assignment[i]).collect();
        assert_eq!(predicted.len(), 1, "true cluster {c} split across {predicted:?}");
    }
    let distinct: std::collections::BTreeSet<usize> = clustering.assignment.iter().copied().collect();
    assert_eq!(distinct.len(), 3);
    assert_eq!(kmeans(&vectors, &options, &Device::Cpu).unwrap(), clustering, "same seed, same clustering");
    let members = clustering.members();
    for rows in &members {
        assert!(rows.windows(2).all(|w| clustering.similarity[w[0]] >= clustering.similarity[w[1]]), "most representative first");
    }
    let auto = kmeans(&vectors, &KMeansOptions { clusters: None, ..options }, &Device::Cpu).unwrap();
    assert_eq!(auto.centroids.len(), auto_clusters(60));
}

#[test]
fn consolidation_commits_skills_edges_embeddings_and_edits_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    add_episodes(&store, three_families(4));
    let before = Store::open(&store).unwrap().manifest().unwrap().version;
    let mut generator = Scripted::new(family_skill);
    let report = run(&store, &mut generator, None, &options(3));
    assert_eq!((report.episodes, report.clusters, report.skills_new, report.failed, report.commits), (12, 3, 3, 0, 1));
    assert_eq!(report.eta_source, "logged success rate (no judge)");
    assert_eq!(Store::open(&store).unwrap().manifest().unwrap().version, before + 1, "one atomic commit");
    let graph = load(&store);
    let stats = graph.stats();
    assert_eq!((stats.procedural, stats.distill), (3, 12));
    for skill in &report.skills {
        let node = &graph.nodes[&skill.id];
        let family = FAMILIES.iter().find(|f| skill.name.contains(*f)).expect("named after a family");
        let NodeBody::Procedural(body) = &node.body else { panic!("a skill node") };
        assert_eq!(body.version, 1);
        assert_eq!(body.source_episodes.len(), 4);
        for episode in &body.source_episodes {
            assert!(graph.nodes[episode].text.contains(family), "cluster of one family");
        }
        assert_eq!(body.pems_history.len(), skill.rounds.len());
        // eta without a judge is the logged success rate: 3 of 4 succeeded.
        assert!(skill.rounds.iter().all(|r| (r.eta - 0.75).abs() < 1e-9), "{:?}", skill.rounds);
        assert_eq!(skill.rounds[0].delta, 0.0, "a first version has no previous one");
        assert!(graph.embeddings.contains_key(&(node.id.clone(), "hash-64".to_string())));
        assert!(node.text.starts_with("Name: Handle"));
        assert!(skill.generator.calls >= 1);
    }
    let kinds: Vec<&str> = graph.edits.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "skill_induce").count(), 3);
    assert_eq!(kinds.iter().filter(|k| **k == "distill").count(), 12);
    assert_eq!(report.generator.calls, generator.usage().calls);
}

#[test]
fn pems_loop_stops_on_convergence_or_at_the_round_limit() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    add_episodes(&store, three_families(3));
    // The same skill every time: delta 0, same eta and length, |delta PEMS| = 0 at round 2.
    let fixed = "Name: Do it\nDescription: d\nSteps:\n1. wash the lettuce\n2. rinse the basin\n".to_string();
    let mut generator = Scripted::new(move |_| fixed.clone());
    let report = run(&store, &mut generator, None, &options(1));
    let skill = &report.skills[0];
    assert_eq!((skill.rounds.len(), skill.converged_round, skill.best_round), (2, Some(2), 1));
    assert_eq!(report.generator.calls, 2, "induction + one rewrite");

    // Ever-changing rewrites never converge: five rounds, then stop.
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    add_episodes(&store, three_families(3));
    let mut count = 0;
    let mut generator = Scripted::new(move |_| {
        count += 1;
        let words: Vec<String> = (0..count * 7).map(|w| format!("w{}x{}", count, w)).collect();
        format!("Name: Skill {count}\nDescription: d\nSteps:\n1. {}\n2. rinse the lettuce\n", words.join(" "))
    });
    let report = run(&store, &mut generator, None, &options(1));
    let skill = &report.skills[0];
    assert_eq!((skill.rounds.len(), skill.converged_round), (5, None));
    assert!(skill.rounds.windows(2).all(|w| (w[1].pems - w[0].pems).abs() >= 0.01));
    let best = skill.rounds.iter().map(|r| r.pems).fold(f64::MIN, f64::max);
    assert_eq!(skill.rounds[skill.best_round - 1].pems, best, "the best round is kept");
    let graph = load(&store);
    let node = &graph.nodes[&skill.id];
    assert_eq!(node.metadata["rounds"].as_array().unwrap().len(), 5, "every version kept");
    assert_eq!(node.text, node.metadata["rounds"][skill.best_round - 1]["text"].as_str().unwrap());
}

#[test]
fn malformed_output_is_repaired_or_kept_as_a_failed_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    add_episodes(&store, three_families(2));
    // Junk first, a good answer to the repair prompt.
    let mut generator = Scripted::new(|messages| {
        if messages.last().unwrap().content.starts_with("Write one skill for these logs") {
            "```\n**Name:** Fixed\nSteps:\n- wash the lettuce\n- book the flight\n```".into()
        } else if messages.last().unwrap().content.starts_with("Here is a skill") {
            "**Name:** Fixed\nSteps:\n- wash the lettuce\n- book the flight".into()
        } else {
            "I am a small model and I like turtles.".into()
        }
    });
    let report = run(&store, &mut generator, None, &ConsolidateOptions { max_rounds: 2, ..options(1) });
    assert_eq!((report.skills_new, report.failed), (1, 0));
    assert_eq!(report.skills[0].name, "Fixed");

    // Junk always: the cluster is recorded as failed with every raw answer, nothing crashes.
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    add_episodes(&store, three_families(2));
    let mut generator = Scripted::new(|_| "Name: only a name, no steps".into());
    let report = run(&store, &mut generator, None, &options(2));
    assert_eq!((report.skills_new, report.failed, report.commits), (0, 2, 1));
    let failure = &report.failures[0];
    assert_eq!(failure.attempts.len(), 2, "the answer and the retried answer");
    assert!(failure.attempts.iter().all(|a| a.raw == "Name: only a name, no steps" && a.problem == "no steps"));
    let graph = load(&store);
    assert_eq!(graph.stats().procedural, 0);
    let failed: Vec<_> = graph.edits.iter().filter(|e| e.kind == "skill_failed").collect();
    assert_eq!(failed.len(), 2);
    assert!(failed[0].after.as_ref().unwrap().contains("only a name, no steps"), "raw output kept in the edit log");
    let episodes_in_failures: usize = report.failures.iter().map(|f| f.episodes.len()).sum();
    assert_eq!(episodes_in_failures, 6, "no episode lost");

    // Readable but about something else (the example's domain): rejected, kept as failed.
    let dir2 = tempfile::tempdir().unwrap();
    let other = dir2.path().join("store");
    add_episodes(&other, three_families(2));
    let invented = "Name: Use a phone to make a phone call\nSteps:\n1. Open the phone app and start a new message.\n2. Make the phone call.";
    let mut phone = Scripted::new(move |_| invented.into());
    let report_other = run(&other, &mut phone, None, &options(1));
    assert_eq!((report_other.skills_new, report_other.failed), (0, 1));
    assert!(report_other.failures[0].attempts.iter().all(|a| a.problem.starts_with("not about its episodes: 0 of their words")));

    // A second run does not retry the same clusters (nothing to commit) unless asked.
    let version = Store::open(&store).unwrap().manifest().unwrap().version;
    let again = run(&store, &mut generator, None, &options(2));
    assert_eq!((again.failed_earlier, again.commits), (2, 0));
    assert_eq!(Store::open(&store).unwrap().manifest().unwrap().version, version);
    let retried = run(&store, &mut generator, None, &ConsolidateOptions { retry_failed: true, ..options(2) });
    assert_eq!(retried.failed, 2);
}

#[test]
fn reconsolidation_is_idempotent_and_a_grown_store_bumps_versions() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    add_episodes(&store, three_families(4));
    let mut generator = Scripted::new(family_skill);
    let first = run(&store, &mut generator, None, &options(3));
    let graph = load(&store);
    let manifest = Store::open(&store).unwrap().manifest().unwrap();

    let second = run(&store, &mut generator, None, &options(3));
    assert_eq!((second.skills_unchanged, second.skills_new, second.skills_updated, second.commits), (3, 0, 0, 0));
    assert_eq!(Store::open(&store).unwrap().manifest().unwrap(), manifest, "a second run changes nothing");

    // Same store content and seed in another directory: the same skill nodes and ids.
    let other = dir.path().join("other");
    add_episodes(&other, three_families(4));
    run(&other, &mut Scripted::new(family_skill), None, &options(3));
    let skills = |g: &Graph| g.nodes.values().filter(|n| n.kind() == NodeKind::Procedural).cloned().collect::<Vec<_>>();
    assert_eq!(skills(&load(&other)), skills(&graph), "deterministic skill nodes");

    // Two more lettuce episodes: the lettuce skill gets version 2, nothing is duplicated.
    add_episodes(&store, vec![episode("lettuce", 10, true), episode("lettuce", 11, true)]);
    let third = run(&store, &mut generator, None, &options(3));
    assert_eq!((third.skills_updated, third.skills_new, third.skills_unchanged), (1, 0, 2));
    let grown = load(&store);
    assert_eq!(grown.stats().procedural, 4, "the old version stays stored");
    let latest = latest_skills(&grown);
    assert_eq!(latest.len(), 3);
    let updated = &grown.nodes[&third.skills[0].id];
    let NodeBody::Procedural(body) = &updated.body else { panic!() };
    let old = first.skills.iter().find(|s| s.name.contains("lettuce")).unwrap();
    assert_eq!((body.version, body.previous_versions.clone(), body.source_episodes.len()), (2, vec![old.id.clone()], 6));
    assert_eq!(updated.metadata["lineage"], serde_json::json!(old.id.as_str()));
    assert!(body.pems_history.len() > old.rounds.len(), "history continues across versions");
    assert!(third.skills[0].rounds[0].delta >= 0.0);
    let active_into_old = grown.edges.values().filter(|e| e.dst == old.id && e.active).count();
    assert_eq!(active_into_old, 0, "the old version's distill edges are retired");
    assert_eq!(grown.edges.values().filter(|e| e.dst == updated.id && e.active).count(), 6);
    assert!(grown.edits.iter().any(|e| e.kind == "distill_retire"));
    // And the export shows only the latest version.
    let records = skill_records(&grown);
    assert_eq!(records.len(), 3);
    assert!(records.iter().any(|r| r.id == updated.id.as_str() && r.version == 2 && r.previous_versions == vec![old.id.to_string()]));
}

#[test]
fn judge_eta_counts_consistent_successes_and_inconsistent_failures() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    add_episodes(&store, three_families(4));
    let mut generator = Scripted::new(family_skill);
    let mut judge = FamilyJudge { usage: Usage::default() };
    let report = run(&store, &mut generator, Some(&mut judge), &options(3));
    assert_eq!(report.eta_source, "judge");
    assert_eq!(report.judge_model.as_deref(), Some("family-judge"));
    assert!(report.judge.calls > 0);
    // The judge finds every skill consistent with its own family's episodes: the 3 successes
    // agree, the failure does not.
    for skill in &report.skills {
        assert!((skill.rounds[0].eta - 0.75).abs() < 1e-9, "{:?}", skill.rounds[0]);
    }
    let graph = load(&store);
    assert!(graph.nodes.values().filter(|n| n.kind() == NodeKind::Procedural).all(|n| n.metadata["eta_source"] == "judge"));
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push((path.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn export_is_byte_identical_and_filters() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    add_episodes(&store, three_families(4));
    run(&store, &mut Scripted::new(family_skill), None, &options(3));
    let handle = Store::open(&store).unwrap();
    for format in [ExportFormat::SkillMd, ExportFormat::Jsonl, ExportFormat::Parquet] {
        let options = ExportOptions { format, tenant: None, min_pems: None, min_support: 0 };
        let (a, b) = (dir.path().join(format!("{format:?}-a")), dir.path().join(format!("{format:?}-b")));
        let report = export_skills(&handle, &a, &options).unwrap();
        assert_eq!(report.skills, 3);
        export_skills(&handle, &b, &options).unwrap();
        assert_eq!(files(&a), files(&b), "{format:?} export is byte-identical");
        // Exporting again into the same directory replaces the earlier export.
        export_skills(&handle, &a, &options).unwrap();
        assert_eq!(files(&a), files(&b));
    }
    let md = dir.path().join("SkillMd-a");
    let release: serde_json::Value = serde_json::from_slice(&std::fs::read(md.join(RELEASE_FILE)).unwrap()).unwrap();
    let manifest = handle.manifest().unwrap();
    assert_eq!(release["created_at"], serde_json::json!(manifest.commits.last().unwrap().at), "time from the store, not the clock");
    assert_eq!(release["store"]["manifest_version"], manifest.version);
    assert_eq!(release["models"]["generators"], serde_json::json!(["scripted@1"]));
    assert_eq!(release["skills"].as_array().unwrap().len(), 3);
    let slug = release["skills"][0]["slug"].as_str().unwrap();
    let skill_md = std::fs::read_to_string(md.join(slug).join("SKILL.md")).unwrap();
    assert!(skill_md.starts_with(&format!("---\nname: \"{slug}\"\ndescription: \"Use for ")), "{skill_md}");
    for key in ["\nversion: 1\n", "\npems: ", "\nsupport: 4\n", "\nsource_episodes:\n  - \"epi-", "\n---\n\n# Handle ", "## Steps\n\n1. "] {
        assert!(skill_md.contains(key), "SKILL.md lacks {key:?}:\n{skill_md}");
    }
    let jsonl = std::fs::read_to_string(dir.path().join("Jsonl-a/skills.jsonl")).unwrap();
    let record: serde_json::Value = serde_json::from_str(jsonl.lines().next().unwrap()).unwrap();
    assert!(record["pems_history"].as_array().is_some_and(|h| !h.is_empty()));

    let none = ExportOptions { format: ExportFormat::Jsonl, tenant: None, min_pems: None, min_support: 5 };
    let report = export_skills(&handle, &dir.path().join("none"), &none).unwrap();
    assert_eq!((report.skills, report.filtered_out), (0, 3));
    let other_tenant = ExportOptions { tenant: Some("other".into()), min_support: 0, ..none.clone() };
    assert_eq!(export_skills(&handle, &dir.path().join("tenant"), &other_tenant).unwrap().skills, 0);
    let high = ExportOptions { min_pems: Some(10.0), min_support: 0, ..none };
    assert_eq!(export_skills(&handle, &dir.path().join("high"), &high).unwrap().skills, 0);

    let foreign = dir.path().join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let error = export_skills(&handle, &foreign, &ExportOptions { format: ExportFormat::Jsonl, tenant: None, min_pems: None, min_support: 0 });
    assert!(matches!(error, Err(Error::OutputNotEmpty { .. })), "{error:?}");
}
