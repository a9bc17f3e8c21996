//! `fluxmem eval locomo`: retrieval recall on LoCoMo conversations.
//!
//! Each conversation is ingested into a fresh temporary store (its turns become semantic
//! nodes) and embedded. Every question is then answered by each system from the question text
//! alone: retrieval never sees the answer or the evidence ids, which are read separately
//! ([`Gold`]) and used only to score the ranking afterwards.
//!
//! The [`SYSTEMS`] rank over the conversation's graph held in memory. With
//! [`LocomoOptions::through_graph`], the store also goes through the rest of a night (connect
//! with the evaluation's retrieval, batch credit assignment, the tenant's index) and a fifth
//! system, [`SERVED`], answers each question as `fluxmem query --tenant` does, through
//! [`fluxmem_connect::serve`]: read from the store in proportion, at one manifest version, its
//! Stage II edits committed to the store at that version and read back by the next question.

use candle_core::Device;
use fluxmem_connect::{pack, Candidate, Entry, RetrievalConfig, SemanticIndex};
use fluxmem_graph::{Graph, NodeId};
use fluxmem_models::{Embedder, Generator, Judge};
use fluxmem_refine::{refine_query, LoopModels, LoopOptions, Neighbours, Verifier};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

use crate::metrics::{recall, QuestionResult, Summary, KS};
use crate::{Error, Result};

/// The systems evaluated side by side.
pub const SYSTEMS: [&str; 4] = ["bm25", "dense", "hybrid", "fluxmem"];

/// The system that answers through the store a night built ([`LocomoOptions::through_graph`]).
pub const SERVED: &str = "served";

/// What to evaluate.
#[derive(Debug, Clone)]
pub struct LocomoOptions {
    /// Conversations to use (all when empty).
    pub conversations: Vec<String>,
    /// Include category 5 (adversarial) questions.
    pub include_adversarial: bool,
    /// Only these categories (1-5; all of 1-4, and 5 with `include_adversarial`, when empty).
    pub categories: Vec<u64>,
    /// Context budgets (tokens of the default embedder's tokenizer).
    pub budgets: Vec<usize>,
    /// Evaluate a seeded sample of this many questions (all when `None`).
    pub sample: Option<usize>,
    /// Seed of the sample.
    pub seed: u64,
    /// Stage I settings of the `fluxmem` system, [`RetrievalConfig::serving`] by default, its
    /// units included (`hybrid` is the same fusion without the judge and without structure,
    /// `adjacency` 0, over plain units).
    pub retrieval: RetrievalConfig,
    /// Stage II of the `fluxmem` system: the self-verification loop (`rounds` 0: Stage I only).
    /// The loop packs under `refine.budget`; the other budgets pack its final ranking.
    pub refine: LoopOptions,
    /// Also answer through the store: run the night's other stages on each conversation's
    /// store and score [`SERVED`] beside the others (see the module docs).
    pub through_graph: bool,
}

impl Default for LocomoOptions {
    fn default() -> Self {
        LocomoOptions {
            conversations: Vec::new(),
            include_adversarial: false,
            categories: Vec::new(),
            budgets: vec![256, 512, 1024, 2048],
            sample: None,
            seed: 0,
            retrieval: RetrievalConfig::serving(),
            refine: LoopOptions {
                rounds: 0,
                ..LoopOptions::default()
            },
            through_graph: false,
        }
    }
}

/// A question as retrieval sees it: its text (and its category, for grouping results).
#[derive(Debug, Clone)]
pub struct Question {
    /// Conversation id.
    pub conversation: String,
    /// The question text.
    pub text: String,
    /// LoCoMo category (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial).
    pub category: u64,
}

/// What scoring needs and retrieval must never see.
#[derive(Debug, Clone)]
pub struct Gold {
    /// Evidence dialogue ids, as written in the data.
    pub evidence: Vec<String>,
}

/// Counts of evidence ids.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EvidenceCounts {
    /// Evidence ids in the evaluated questions.
    pub total: usize,
    /// Ids that name a turn as written.
    pub resolved: usize,
    /// Malformed ids that name a turn once normalised (`D30:05` -> `D30:5`).
    pub normalized: usize,
    /// Ids that name no turn (reported, not fatal).
    pub unresolved: Vec<String>,
    /// Questions left out because none of their evidence resolves.
    pub questions_without_evidence: usize,
}

/// The report, as `--json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct LocomoReport {
    /// Questions scored.
    pub questions: usize,
    /// Results per system.
    pub systems: BTreeMap<String, SystemReport>,
    /// Tokens of each full conversation (every turn's context line), for reference.
    pub conversation_tokens: BTreeMap<String, usize>,
    /// Evidence id resolution.
    pub evidence: EvidenceCounts,
    /// The judge and generator calls of the `fluxmem` system.
    pub judge_calls: usize,
    /// Prompt tokens the judge ran.
    pub judge_prompt_tokens: usize,
    /// What Stage II did in the `fluxmem` system.
    pub refine: RefineSummary,
    /// SHA-256 of every system's ranking (top 50 node ids) of every question and of the edit
    /// log: equal fingerprints mean equal retrieval. Scoring data does not enter it.
    pub fingerprint: String,
    /// What the night and the serving path did, with [`LocomoOptions::through_graph`].
    pub served: Option<ServedSummary>,
}

/// The [`SERVED`] system's night and queries, summed over the conversations.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServedSummary {
    /// Episodes connect connected (LoCoMo turns are facts: none unless the data holds runs).
    pub connected: usize,
    /// Ground and link edges connect wrote.
    pub edges: usize,
    /// Edges batch credit assignment reweighted, pruned, reactivated or added.
    pub credited: usize,
    /// Questions answered through the store.
    pub questions: usize,
    /// Questions whose ranking differs from the `fluxmem` system's (top 50 node ids).
    pub rankings_differ: usize,
    /// Stage II edits committed to the store by the served loops.
    pub edits_committed: usize,
    /// Commits refused because the store had moved (none in a run of its own).
    pub commits_refused: usize,
}

/// Stage II in the evaluation: rounds, edits and what they cost.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RefineSummary {
    /// Maximum rounds T.
    pub rounds: usize,
    /// Budget the loop packs under.
    pub budget: usize,
    /// `coverage` or `judge:<model>`.
    pub verifier: String,
    /// The generator used by Node Reshape, if any.
    pub generator: Option<String>,
    /// Questions the loop ran on.
    pub questions: usize,
    /// Questions whose final context the verifier found sufficient.
    pub sufficient: usize,
    /// Mean edit rounds per question.
    pub mean_edit_rounds: f64,
    /// Edits applied in loops, by kind (including those of loops that failed and were dropped).
    pub edits_attempted: BTreeMap<String, usize>,
    /// Edit records persisted into the conversation graphs.
    pub edits_persisted: usize,
    /// Attributions made, by cause.
    pub attributions: BTreeMap<String, usize>,
    /// Per edit kind, what the edits did to the recall of the loop's context (scored after the
    /// loop, from the contexts of the rounds before and after each edit).
    pub edit_effects: BTreeMap<String, EditEffect>,
    /// Per scored question, the verifier's sufficiency score of the first context (the Stage I
    /// context), in question order: its distribution sets a threshold without labels.
    pub first_sufficiency: Vec<f32>,
    /// Mean recall of the loop's context after round t, t = 0..=T, over the scored questions
    /// (a loop that ended earlier keeps its last context): the curve over rounds of one run.
    pub recall_by_round: Vec<f64>,
    /// Verifier calls (judge prompts; for the coverage verifier, checks without a model).
    pub verifier_calls: usize,
    /// Prompt tokens the verifier ran.
    pub verifier_prompt_tokens: usize,
    /// Generator calls of Node Reshape.
    pub generator_calls: usize,
    /// Generator prompt + generated tokens.
    pub generator_tokens: usize,
    /// Verifier calls per question.
    pub verifier_calls_per_question: f64,
    /// Verifier prompt tokens per question.
    pub verifier_tokens_per_question: f64,
}

/// What the edits of one kind did to recall at the loop's budget: each edit is scored by the
/// recall of the context after it minus that of the context before it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EditEffect {
    /// Edit rounds that applied an edit of this kind, in loops of scored questions (loops that
    /// failed included).
    pub fired: usize,
    /// Edits after which the context held more of the evidence.
    pub raised: usize,
    /// Edits after which it held less.
    pub lowered: usize,
    /// Sum of the recall changes (the mean is `recall_change / fired`).
    pub recall_change: f64,
}

/// One system's results.
#[derive(Debug, Clone, Serialize)]
pub struct SystemReport {
    /// Overall averages.
    #[serde(flatten)]
    pub overall: Summary,
    /// Averages per category.
    pub by_category: BTreeMap<String, Summary>,
}

/// Reads a LoCoMo file into conversations (raw JSON), questions and their gold evidence.
#[allow(clippy::type_complexity)] // the two lists the doc names; an alias would hide them
pub fn read(path: &Path, options: &LocomoOptions) -> Result<(Vec<Value>, Vec<(Question, Gold)>)> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.into(),
        source,
    })?;
    let data: Vec<Value> = serde_json::from_str(&text).map_err(|e| Error::Data {
        path: path.into(),
        reason: format!("not a LoCoMo array: {e}"),
    })?;
    let wanted = |id: &str| {
        options.conversations.is_empty() || options.conversations.iter().any(|c| c == id)
    };
    let conversations: Vec<Value> = data
        .into_iter()
        .filter(|c| c["sample_id"].as_str().is_some_and(wanted))
        .collect();
    for id in &options.conversations {
        if !conversations
            .iter()
            .any(|c| c["sample_id"].as_str() == Some(id))
        {
            return Err(Error::Data {
                path: path.into(),
                reason: format!("no conversation `{id}`"),
            });
        }
    }
    if let Some(bad) = options.categories.iter().find(|c| !(1..=5).contains(*c)) {
        return Err(Error::Data {
            path: path.into(),
            reason: format!("no category {bad}: LoCoMo's are 1 to 5"),
        });
    }
    let wanted_category = |category: u64| {
        if options.categories.is_empty() {
            (1..=4).contains(&category) || (options.include_adversarial && category == 5)
        } else {
            options.categories.contains(&category)
        }
    };
    let mut questions = Vec::new();
    for conversation in &conversations {
        let id = conversation["sample_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        for qa in conversation["qa"].as_array().into_iter().flatten() {
            let category = qa["category"].as_u64().unwrap_or(0);
            if !wanted_category(category) {
                continue;
            }
            let evidence = qa["evidence"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| e.as_str().map(str::to_string))
                .collect();
            let question = Question {
                conversation: id.clone(),
                text: qa["question"].as_str().unwrap_or_default().to_string(),
                category,
            };
            questions.push((question, Gold { evidence }));
        }
    }
    if let Some(n) = options.sample {
        questions = seeded_sample(questions, n, options.seed);
    }
    Ok((conversations, questions))
}

/// The same `n` items for the same seed: a seeded Fisher-Yates shuffle, then the first `n`,
/// returned in their original order.
pub fn seeded_sample<T>(items: Vec<T>, n: usize, seed: u64) -> Vec<T> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    for i in (1..order.len()).rev() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        order.swap(i, (state >> 33) as usize % (i + 1));
    }
    let mut keep: Vec<usize> = order.into_iter().take(n).collect();
    keep.sort_unstable();
    let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
    keep.into_iter().filter_map(|i| slots[i].take()).collect()
}

/// Normalises a malformed dialogue id (`D:11:26` -> `D11:26`, `D30:05` -> `D30:5`).
fn normalize_dia_id(id: &str) -> Option<String> {
    let numbers: Vec<u32> = id
        .trim_start_matches('D')
        .split(':')
        .filter(|p| !p.is_empty())
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    match numbers.as_slice() {
        [session, turn] => Some(format!("D{session}:{turn}")),
        _ => None,
    }
}

/// Runs the evaluation. `progress` is called once per question scored.
pub fn evaluate(
    path: &Path,
    options: &LocomoOptions,
    embedder: &dyn Embedder,
    mut judge: Option<&mut dyn Judge>,
    mut generator: Option<&mut dyn Generator>,
    device: &Device,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LocomoReport> {
    let (conversations, questions) = read(path, options)?;
    let mut evaluation = Evaluation::new(options, questions.len(), generator.as_deref());
    let mut models = Models {
        embedder,
        judge: &mut judge,
        generator: &mut generator,
        device,
    };
    for conversation in &conversations {
        evaluation.conversation(conversation, &questions, &mut models, progress)?;
    }
    let judge_usage = judge.as_ref().map(|j| j.usage()).unwrap_or_default();
    Ok(evaluation.report(judge_usage, generator.as_deref()))
}

/// The models an evaluation runs with.
struct Models<'m, 'j, 'g> {
    embedder: &'m dyn Embedder,
    judge: &'m mut Option<&'j mut dyn Judge>,
    generator: &'m mut Option<&'g mut dyn Generator>,
    device: &'m Device,
}

/// An evaluation in progress: what is counted and scored, conversation after conversation.
struct Evaluation<'o> {
    options: &'o LocomoOptions,
    total: usize,
    done: usize,
    skipped: usize,
    evidence: EvidenceCounts,
    results: BTreeMap<&'static str, Vec<(u64, QuestionResult)>>,
    conversation_tokens: BTreeMap<String, usize>,
    /// `hybrid` is the configured fusion without the judge and without structure, over each
    /// turn's own text: plain hybrid retrieval, what a store of items without a graph gives.
    hybrid_config: RetrievalConfig,
    refine: RefineSummary,
    verifier_usage: fluxmem_models::Usage,
    fingerprint: Sha256,
    served: Option<ServedSummary>,
}

/// What one conversation's questions are answered from.
struct Conversation<'c> {
    id: &'c str,
    graph: Graph,
    dia_ids: BTreeMap<String, NodeId>,
    index: SemanticIndex,
    /// The `fluxmem` system's units: the same nodes and vectors, turns indexed with context.
    units: SemanticIndex,
    neighbours: Neighbours,
    /// The store a night built, with [`LocomoOptions::through_graph`].
    night: Option<Night>,
}

/// A conversation's store after the night's stages, and what the last served query read.
struct Night {
    writer: fluxmem_store::Writer,
    tenant: String,
    /// The part of the store the last question was answered from (its context packs from it).
    graph: Graph,
    /// Holds the store's folder (dropped last: after the writer releases its lock).
    _dir: tempfile::TempDir,
}

/// Each system's ranking of one question, in [`SYSTEMS`] order, then [`SERVED`].
type Rankings = Vec<(&'static str, Vec<Entry>)>;

/// Each round of the loop: its edit (if any), its context and the verifier's sufficiency.
type LoopRounds = Vec<(Option<String>, Vec<NodeId>, f32)>;

/// Counts a text's tokens.
type Count<'a> = dyn Fn(&str) -> fluxmem_connect::Result<usize> + 'a;

impl<'o> Evaluation<'o> {
    fn new(options: &'o LocomoOptions, total: usize, generator: Option<&dyn Generator>) -> Self {
        Evaluation {
            options,
            total,
            done: 0,
            skipped: 0,
            evidence: EvidenceCounts::default(),
            results: (SYSTEMS.iter())
                .chain(options.through_graph.then_some(&SERVED))
                .map(|s| (*s, Vec::new()))
                .collect(),
            conversation_tokens: BTreeMap::new(),
            hybrid_config: RetrievalConfig {
                judge_top: 0,
                adjacency: 0.0,
                entity: 0.0,
                ..options.retrieval.clone()
            },
            refine: RefineSummary {
                rounds: options.refine.rounds,
                budget: options.refine.budget,
                generator: generator.map(|g| g.model_id().to_string()),
                ..Default::default()
            },
            verifier_usage: fluxmem_models::Usage::default(),
            fingerprint: Sha256::new(),
            served: None,
        }
    }

    /// One conversation: its own store (so one tenant; retrieval and the loop run in it), then
    /// its questions in their order against one evolving graph: links that earlier questions'
    /// loops persisted are there for later ones.
    fn conversation(
        &mut self,
        conversation: &Value,
        questions: &[(Question, Gold)],
        models: &mut Models<'_, '_, '_>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<()> {
        let embedder = models.embedder;
        let id = conversation["sample_id"].as_str().unwrap_or_default();
        let (dir, mut writer, graph, dia_ids) = build_store(conversation, embedder)?;
        let tenant = fluxmem_connect::resolve_tenant(&graph, None)?;
        let index = SemanticIndex::build(&graph, &tenant, embedder.model_id(), models.device)?;
        let night = match self.options.through_graph {
            true => {
                let summary = self.served.get_or_insert_with(Default::default);
                run_night(&mut writer, self.options, models, summary)?;
                Some(Night {
                    writer,
                    tenant: tenant.clone(),
                    graph: Graph::default(),
                    _dir: dir,
                })
            }
            false => None,
        };
        let mut conversation = Conversation {
            id,
            units: index.with_units(self.options.retrieval.units),
            neighbours: Neighbours::build(&graph, &tenant),
            index,
            graph,
            dia_ids,
            night,
        };
        // Every ranking packs the same lines again and again: count each line's tokens once.
        let memo: std::cell::RefCell<std::collections::HashMap<String, usize>> = Default::default();
        let count = |text: &str| -> fluxmem_connect::Result<usize> {
            if let Some(&n) = memo.borrow().get(text) {
                return Ok(n);
            }
            let n = embedder.count_tokens(text)?;
            memo.borrow_mut().insert(text.to_string(), n);
            Ok(n)
        };
        let all_lines: Vec<String> = (0..conversation.index.len())
            .map(|i| fluxmem_connect::line(&conversation.graph, conversation.index.id(i)))
            .collect();
        self.conversation_tokens.insert(
            id.to_string(),
            embedder.count_tokens(&all_lines.join("\n"))?,
        );
        for (position, (question, gold)) in questions
            .iter()
            .filter(|(q, _)| q.conversation == id)
            .enumerate()
        {
            let (rankings, loop_rounds) =
                self.rank(&mut conversation, question, position, models, &count)?;
            self.score_question(
                &conversation,
                question.category,
                gold,
                rankings,
                &loop_rounds,
                &count,
            )?;
            progress(self.done + self.skipped, self.total);
        }
        for edit in &conversation.graph.edits {
            self.fingerprint.update(
                format!(
                    "{}\0{}\0{}\0",
                    edit.kind,
                    edit.target,
                    edit.after.as_deref().unwrap_or("")
                )
                .as_bytes(),
            );
        }
        Ok(())
    }

    /// Every system's ranking for one question, from the question text only, fingerprinted;
    /// and the rounds of the loop when Stage II runs.
    fn rank(
        &mut self,
        conversation: &mut Conversation<'_>,
        question: &Question,
        position: usize,
        models: &mut Models<'_, '_, '_>,
        count: &Count<'_>,
    ) -> Result<(Rankings, LoopRounds)> {
        let options = self.options;
        let embedder = models.embedder;
        let query_vector = embedder.embed(&[question.text.as_str()])?.remove(0);
        let index = &conversation.index;
        let all = index.len();
        // With entities on, the `fluxmem` system's dense signal reads the question without
        // the speakers it names.
        let dense_vector = match conversation
            .units
            .dense_query(&question.text, &options.retrieval)
        {
            Some(text) => embedder.embed(&[text.as_str()])?.remove(0),
            None => query_vector.clone(),
        };
        let stage1 = conversation.units.hybrid(
            &question.text,
            &dense_vector,
            &options.retrieval,
            models.judge.as_deref_mut(),
        )?;
        let (fluxmem, loop_rounds) = if options.refine.rounds == 0 {
            (entries(&stage1), Vec::new())
        } else {
            self.refine_loop(conversation, question, position, &stage1, models, count)?
        };
        let served = match conversation.night.as_mut() {
            Some(night) => {
                Some(self.served_answer(night, question, &query_vector, models, count)?)
            }
            None => None,
        };
        let index = &conversation.index;
        let mut rankings: Rankings = vec![
            ("bm25", entries(&index.bm25(&question.text, all))),
            ("dense", entries(&index.dense(&query_vector, all)?)),
            (
                "hybrid",
                entries(&index.hybrid(&question.text, &query_vector, &self.hybrid_config, None)?),
            ),
            ("fluxmem", fluxmem),
        ];
        if let Some(served) = served {
            let top = |ranking: &[Entry]| -> Vec<NodeId> {
                ranking.iter().take(50).map(|(id, ..)| id.clone()).collect()
            };
            let summary = self.served.get_or_insert_with(Default::default);
            summary.questions += 1;
            summary.rankings_differ += usize::from(top(&served) != top(&rankings[3].1));
            rankings.push((SERVED, served));
        }
        for (system, ranking) in &rankings {
            self.fingerprint
                .update(format!("{}\0{position}\0{system}\0", conversation.id).as_bytes());
            for (node, ..) in ranking.iter().take(50) {
                self.fingerprint.update(node.as_str().as_bytes());
                self.fingerprint.update(b"\0");
            }
        }
        Ok((rankings, loop_rounds))
    }

    /// Stage II on one question: the loop's final ranking and its rounds. Its edits persist in
    /// the conversation's graph.
    fn refine_loop(
        &mut self,
        conversation: &mut Conversation<'_>,
        question: &Question,
        position: usize,
        stage1: &[Candidate],
        models: &mut Models<'_, '_, '_>,
        count: &Count<'_>,
    ) -> Result<(Vec<Entry>, LoopRounds)> {
        let refine = &mut self.refine;
        let mut boxed = fluxmem_refine::verifier(
            models.judge.as_deref_mut().map(|j| j as &mut dyn Judge),
            &conversation.units,
        );
        let verifier: &mut dyn Verifier = &mut *boxed;
        let before = verifier.usage();
        refine.verifier = verifier.name();
        let mut loop_models = LoopModels {
            verifier,
            embedder: models.embedder,
            generator: models
                .generator
                .as_deref_mut()
                .map(|g| g as &mut dyn Generator),
            count_tokens: count,
        };
        let run_id = format!("eval-refine@{}", conversation.id);
        let outcome = refine_query(
            &conversation.graph,
            &conversation.units,
            &conversation.neighbours,
            &question.text,
            stage1,
            &mut loop_models,
            &self.options.refine,
            &run_id,
            position as i64,
        )?;
        let after = loop_models.verifier.usage();
        self.verifier_usage.calls += after.calls - before.calls;
        self.verifier_usage.prompt_tokens += after.prompt_tokens - before.prompt_tokens;
        refine.questions += 1;
        refine.sufficient += usize::from(outcome.sufficient);
        refine.mean_edit_rounds +=
            outcome.rounds.iter().filter(|r| r.edit.is_some()).count() as f64;
        for round in &outcome.rounds {
            *refine
                .attributions
                .entry(round.attribution.clone())
                .or_default() += 1;
        }
        let loop_rounds = outcome
            .rounds
            .iter()
            .map(|r| (r.edit.clone(), r.context.clone(), r.sufficiency))
            .collect();
        for edit in &outcome.attempted {
            *refine.edits_attempted.entry(edit.kind.clone()).or_default() += 1;
        }
        refine.edits_persisted += outcome.delta.edits.len();
        conversation.graph.apply(outcome.delta);
        // Nodes of a dropped loop stay without edges: its last context may show them.
        for node in outcome.new_nodes {
            conversation.graph.insert_node(node);
        }
        Ok((outcome.ranking, loop_rounds))
    }

    /// One question answered as `fluxmem query --tenant` answers it from the night's store
    /// ([`fluxmem_connect::serve`]), with the evaluation's retrieval settings (as `query`'s
    /// flags set them over the recorded ones) and its default number of episodes. With Stage
    /// II, the loop runs on what was read and its edits are committed at the version read; the
    /// next question reads them from the store.
    fn served_answer(
        &mut self,
        night: &mut Night,
        question: &Question,
        query_vector: &[f32],
        models: &mut Models<'_, '_, '_>,
        count: &Count<'_>,
    ) -> Result<Vec<Entry>> {
        let options = self.options;
        let embedder = models.embedder;
        let configure = |_recorded| options.retrieval.clone();
        let request = fluxmem_connect::serve::Request {
            tenant: Some(&night.tenant),
            model: embedder.model_id(),
            query_vector,
            episodes: fluxmem_connect::serve::DEFAULT_EPISODES,
            all_edges: options.refine.rounds > 0,
            configure: &configure,
        };
        let served = fluxmem_connect::serve::read(night.writer.store(), &request, models.device)?;
        let (mut graph, retriever, mut config) = (served.graph, served.retriever, served.config);
        if models.judge.is_none() {
            config.judge_top = 0;
        }
        let dense_vector = match retriever.semantic().dense_query(&question.text, &config) {
            Some(text) => embedder.embed(&[text.as_str()])?.remove(0),
            None => query_vector.to_vec(),
        };
        let (head, semantic) = retriever.retrieve_split_dense(
            &graph,
            &question.text,
            query_vector,
            &dense_vector,
            &config,
            models.judge.as_deref_mut(),
            request.episodes,
        )?;
        if options.refine.rounds == 0 {
            night.graph = graph;
            return Ok((head.into_iter())
                .chain(semantic.iter().map(fluxmem_connect::semantic_entry))
                .collect());
        }
        let loop_options = LoopOptions {
            budget: fluxmem_connect::serve::facts_budget(
                &graph,
                &head,
                options.refine.budget,
                count,
            )?,
            ..options.refine.clone()
        };
        let mut verifier = fluxmem_refine::verifier(
            models.judge.as_deref_mut().map(|j| j as &mut dyn Judge),
            retriever.semantic(),
        );
        let mut loop_models = LoopModels {
            verifier: &mut *verifier,
            embedder,
            generator: models
                .generator
                .as_deref_mut()
                .map(|g| g as &mut dyn Generator),
            count_tokens: count,
        };
        let read_version = served.manifest.version;
        let run_id = format!("query@v{read_version}");
        let outcome = refine_query(
            &graph,
            retriever.semantic(),
            &Neighbours::build(&graph, &night.tenant),
            &question.text,
            &semantic,
            &mut loop_models,
            &loop_options,
            &run_id,
            read_version as i64,
        )?;
        let summary = self.served.get_or_insert_with(Default::default);
        if !outcome.delta.is_empty() {
            let info = fluxmem_store::CommitInfo {
                stage: fluxmem_refine::STAGE.into(),
                run_id,
                summary: serde_json::json!({ "edits": outcome.delta.edits.len() }),
                progress: Default::default(),
            };
            match fluxmem_connect::serve::commit_at(
                &mut night.writer,
                read_version,
                &outcome.delta,
                info,
            )? {
                Ok(()) => summary.edits_committed += outcome.delta.edits.len(),
                Err(_) => summary.commits_refused += 1,
            }
        }
        for node in outcome.new_nodes {
            graph.insert_node(node);
        }
        night.graph = graph;
        Ok(head.into_iter().chain(outcome.ranking).collect())
    }

    /// Scores one question's rankings and loop rounds: only now is the gold evidence read.
    fn score_question(
        &mut self,
        conversation: &Conversation<'_>,
        category: u64,
        gold: &Gold,
        rankings: Rankings,
        loop_rounds: &LoopRounds,
        count: &Count<'_>,
    ) -> Result<()> {
        let graph = &conversation.graph;
        let Some(evidence_ids) = resolve(&gold.evidence, &conversation.dia_ids, &mut self.evidence)
        else {
            self.evidence.questions_without_evidence += 1;
            self.skipped += 1;
            return Ok(());
        };
        // Each round's context recall, once: for the edits and for the curve over rounds.
        let round_recalls: Vec<f64> = loop_rounds
            .iter()
            .map(|(_, context, _)| recall(&turns(graph, context), &evidence_ids))
            .collect();
        let edits: Vec<Option<&str>> = loop_rounds
            .iter()
            .map(|(edit, ..)| edit.as_deref())
            .collect();
        let refine = &mut self.refine;
        score_edits(&edits, &round_recalls, &mut refine.edit_effects);
        if let (Some(first), Some(&last)) = (loop_rounds.first(), round_recalls.last()) {
            refine.first_sufficiency.push(first.2);
            refine
                .recall_by_round
                .resize(self.options.refine.rounds + 1, 0.0);
            for (t, sum) in refine.recall_by_round.iter_mut().enumerate() {
                *sum += round_recalls.get(t).copied().unwrap_or(last);
            }
        }
        for (system, ranking) in rankings {
            // A served context packs from what the store gave its query.
            let graph = match (system, &conversation.night) {
                (SERVED, Some(night)) => &night.graph,
                _ => graph,
            };
            let result = score(graph, &ranking, &evidence_ids, &self.options.budgets, count)?;
            self.results
                .get_mut(system)
                .expect("every system has a slot")
                .push((category, result));
        }
        self.done += 1;
        Ok(())
    }

    /// The report: each system's summaries, overall and by category, and Stage II's means.
    fn report(
        mut self,
        judge_usage: fluxmem_models::Usage,
        generator: Option<&dyn Generator>,
    ) -> LocomoReport {
        let refine = &mut self.refine;
        if let Some(generator) = generator {
            let usage = generator.usage();
            refine.generator_calls = usage.calls;
            refine.generator_tokens = usage.prompt_tokens + usage.generated_tokens;
        }
        let scored = refine.first_sufficiency.len().max(1) as f64;
        refine
            .recall_by_round
            .iter_mut()
            .for_each(|sum| *sum /= scored);
        if refine.questions > 0 {
            let usage = &self.verifier_usage;
            refine.mean_edit_rounds /= refine.questions as f64;
            refine.verifier_calls = usage.calls;
            refine.verifier_prompt_tokens = usage.prompt_tokens;
            refine.verifier_calls_per_question = usage.calls as f64 / refine.questions as f64;
            refine.verifier_tokens_per_question =
                usage.prompt_tokens as f64 / refine.questions as f64;
        }
        LocomoReport {
            questions: self.done,
            systems: self
                .results
                .into_iter()
                .map(|(system, per_question)| (system.to_string(), system_report(&per_question)))
                .collect(),
            conversation_tokens: self.conversation_tokens,
            evidence: self.evidence,
            judge_calls: judge_usage.calls,
            judge_prompt_tokens: judge_usage.prompt_tokens,
            refine: self.refine,
            fingerprint: self
                .fingerprint
                .finalize()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            served: self.served,
        }
    }
}

/// A system's summaries over its questions: overall, and by category (those with questions).
fn system_report(per_question: &[(u64, QuestionResult)]) -> SystemReport {
    let all: Vec<&QuestionResult> = per_question.iter().map(|(_, r)| r).collect();
    let mut by_category = BTreeMap::new();
    for category in 1..=5u64 {
        let of: Vec<&QuestionResult> = per_question
            .iter()
            .filter(|(c, _)| *c == category)
            .map(|(_, r)| r)
            .collect();
        if !of.is_empty() {
            by_category.insert(category.to_string(), Summary::of(&of));
        }
    }
    SystemReport {
        overall: Summary::of(&all),
        by_category,
    }
}

/// Node ids of `evidence`, or `None` when none resolves.
fn resolve(
    evidence: &[String],
    dia_ids: &BTreeMap<String, NodeId>,
    counts: &mut EvidenceCounts,
) -> Option<Vec<NodeId>> {
    let mut ids = Vec::new();
    // A few entries hold several ids in one string (`D8:6; D9:17`).
    let split = evidence
        .iter()
        .flat_map(|e| e.split(|c: char| c == ';' || c == ',' || c.is_whitespace()))
        .filter(|e| !e.is_empty());
    for raw in split {
        let raw = raw.to_string();
        counts.total += 1;
        if let Some(id) = dia_ids.get(&raw) {
            counts.resolved += 1;
            ids.push(id.clone());
        } else if let Some(id) = normalize_dia_id(&raw).and_then(|n| dia_ids.get(&n)) {
            counts.normalized += 1;
            ids.push(id.clone());
        } else {
            counts.unresolved.push(raw);
        }
    }
    ids.sort();
    ids.dedup();
    (!ids.is_empty()).then_some(ids)
}

/// Adds what each edit of a loop did to the recall of its context: per round of the loop, in
/// order, the edit applied after it (if any) and the recall of its context.
fn score_edits(
    edits: &[Option<&str>],
    recalls: &[f64],
    effects: &mut BTreeMap<String, EditEffect>,
) {
    for (t, edit) in edits
        .iter()
        .enumerate()
        .take(recalls.len().saturating_sub(1))
    {
        let Some(kind) = edit else { continue };
        let change = recalls[t + 1] - recalls[t];
        let effect = effects.entry(kind.to_string()).or_default();
        effect.fired += 1;
        effect.raised += usize::from(change > 0.0);
        effect.lowered += usize::from(change < 0.0);
        effect.recall_change += change;
    }
}

fn entries(candidates: &[Candidate]) -> Vec<Entry> {
    candidates
        .iter()
        .map(|c| (c.node_id.clone(), c.signals, c.score, String::new()))
        .collect()
}

/// The turns a retrieved node holds: itself, or for a reshaped node the turns it `covers`.
fn turns(graph: &Graph, ids: &[NodeId]) -> Vec<NodeId> {
    let mut out = Vec::new();
    for id in ids {
        match graph
            .nodes
            .get(id)
            .and_then(|n| n.metadata.get("covers"))
            .and_then(Value::as_array)
        {
            Some(covers) => out.extend(covers.iter().filter_map(Value::as_str).map(NodeId::from)),
            None => out.push(id.clone()),
        }
    }
    out
}

fn score(
    graph: &Graph,
    ranking: &[Entry],
    evidence: &[NodeId],
    budgets: &[usize],
    count: &dyn Fn(&str) -> fluxmem_connect::Result<usize>,
) -> Result<QuestionResult> {
    let ids: Vec<NodeId> = ranking.iter().map(|(id, ..)| id.clone()).collect();
    let mut result = QuestionResult::default();
    for (i, k) in KS.iter().enumerate() {
        result.recall_at_k[i] = recall(&turns(graph, &ids[..ids.len().min(*k)]), evidence);
    }
    for &budget in budgets {
        let context = pack(graph, ranking, budget, count)?;
        let packed: Vec<NodeId> = context
            .items
            .iter()
            .map(|item| item.node_id.clone())
            .collect();
        result
            .recall_at_budget
            .insert(budget, recall(&turns(graph, &packed), evidence));
        result.context_tokens.insert(budget, context.tokens);
    }
    Ok(result)
}

/// The rest of a night on a conversation's embedded store, as `fluxmem run` runs it: connect
/// (grounding with the evaluation's retrieval, which it records), batch credit assignment, and
/// the tenant's index. Counts go to `summary`.
fn run_night(
    writer: &mut fluxmem_store::Writer,
    options: &LocomoOptions,
    models: &Models<'_, '_, '_>,
    summary: &mut ServedSummary,
) -> Result<()> {
    let run_id = "eval-night";
    let connect = fluxmem_connect::ConnectOptions {
        retrieval: options.retrieval.clone(),
        ..Default::default()
    };
    let connected = fluxmem_connect::connect_store(
        writer,
        models.embedder,
        &connect,
        run_id,
        models.device,
        &mut fluxmem_connect::NoProgress,
    )?;
    summary.connected += connected.connected;
    summary.edges += connected.ground_edges + connected.link_edges;
    let credit = fluxmem_refine::refine_store(
        writer,
        &fluxmem_refine::CreditOptions::default(),
        run_id,
        &mut fluxmem_connect::NoProgress,
    )?;
    summary.credited += credit.reweighted + credit.pruned + credit.reactivated + credit.expanded;
    writer.update_indexes(models.embedder.model_id(), None, false, run_id, &mut |_| {})?;
    Ok(())
}

/// Ingests one conversation into a fresh temporary store and embeds it; returns the store's
/// folder (removed when dropped), its writer, the graph and the map from dialogue id to node id.
#[allow(clippy::type_complexity)] // the four parts the doc names
fn build_store(
    conversation: &Value,
    embedder: &dyn Embedder,
) -> Result<(
    tempfile::TempDir,
    fluxmem_store::Writer,
    Graph,
    BTreeMap<String, NodeId>,
)> {
    let dir = tempfile::tempdir().map_err(|source| Error::Io {
        path: std::env::temp_dir(),
        source,
    })?;
    let input = dir.path().join("conversation.json");
    let mut sole = conversation.clone();
    if let Some(object) = sole.as_object_mut() {
        // QA items are not memory: they never enter the store.
        object.remove("qa");
    }
    std::fs::write(
        &input,
        serde_json::to_vec(&vec![sole]).expect("JSON serialises"),
    )
    .map_err(|source| Error::Io {
        path: input.clone(),
        source,
    })?;
    let mut writer = fluxmem_store::Writer::open(dir.path().join("store"))?;
    let options = fluxmem_ingest::IngestOptions {
        format: Some(fluxmem_ingest::Format::Locomo),
        ..Default::default()
    };
    let report = fluxmem_ingest::ingest(
        &mut writer,
        &[input],
        &options,
        "eval",
        &mut fluxmem_ingest::NoProgress,
    )?;
    if report.quarantined > 0 {
        return Err(Error::Data {
            path: "conversation".into(),
            reason: format!("{} turns could not be ingested", report.quarantined),
        });
    }
    fluxmem_embed::embed_store(
        &mut writer,
        embedder,
        &Default::default(),
        "eval",
        &mut fluxmem_embed::NoProgress,
    )?;
    let graph = writer.store().load()?;
    let dia_ids = graph
        .nodes
        .values()
        .filter_map(|n| {
            n.metadata
                .get("dia_id")
                .and_then(Value::as_str)
                .map(|d| (d.to_string(), n.id.clone()))
        })
        .collect();
    Ok((dir, writer, graph, dia_ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_dialogue_ids_normalise() {
        assert_eq!(normalize_dia_id("D30:05").as_deref(), Some("D30:5"));
        assert_eq!(normalize_dia_id("D:11:26").as_deref(), Some("D11:26"));
        assert_eq!(normalize_dia_id("D1"), None);
        assert_eq!(normalize_dia_id("Dx:1"), None);
    }

    #[test]
    fn evidence_strings_with_several_ids_resolve_and_repeats_count_once() {
        let dia_ids: BTreeMap<String, NodeId> = [("D1:1", "sem-a"), ("D2:1", "sem-b")]
            .into_iter()
            .map(|(d, n)| (d.to_string(), NodeId::from(n)))
            .collect();
        let mut counts = EvidenceCounts::default();
        let evidence = vec![
            "D1:1; D2:1".to_string(),
            "D2:01".to_string(),
            "D7:7".to_string(),
        ];
        let ids = resolve(&evidence, &dia_ids, &mut counts).unwrap();
        assert_eq!(ids, vec![NodeId::from("sem-a"), NodeId::from("sem-b")]);
        assert_eq!(
            (counts.total, counts.resolved, counts.normalized),
            (4, 2, 1)
        );
        assert_eq!(counts.unresolved, vec!["D7:7".to_string()]);
    }

    #[test]
    fn each_edit_is_scored_by_the_recall_it_moved() {
        let ids = |names: &[&str]| names.iter().map(|n| NodeId::from(*n)).collect::<Vec<_>>();
        let evidence = ids(&["e1", "e2"]);
        let contexts = [
            ids(&["a", "b"]),
            ids(&["a", "e1"]),
            ids(&["e1", "c"]),
            ids(&["e1", "e2"]),
        ];
        let recalls: Vec<f64> = contexts
            .iter()
            .map(|c| recall(&turns(&Graph::default(), c), &evidence))
            .collect();
        let edits = [
            Some("link_expand"),
            Some("link_prune"),
            Some("link_expand"),
            None,
        ];
        let mut effects = BTreeMap::new();
        score_edits(&edits, &recalls, &mut effects);
        let expand = &effects["link_expand"];
        assert_eq!((expand.fired, expand.raised, expand.lowered), (2, 2, 0));
        assert!(
            (expand.recall_change - 1.0).abs() < 1e-12,
            "0 -> 0.5, then 0.5 -> 1: {expand:?}"
        );
        let prune = &effects["link_prune"];
        assert_eq!((prune.fired, prune.raised, prune.lowered), (1, 0, 0));
        assert_eq!(prune.recall_change, 0.0);
        // A loop that ends after its first round scores nothing.
        let mut none = BTreeMap::new();
        score_edits(&edits[3..], &recalls[3..], &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn categories_select_questions_and_unknown_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.json");
        let qa: Vec<Value> = (1..=5)
            .map(
                |c| serde_json::json!({"question": format!("q{c}"), "category": c, "evidence": []}),
            )
            .collect();
        std::fs::write(
            &path,
            serde_json::json!([{"sample_id": "c1", "conversation": {}, "qa": qa}]).to_string(),
        )
        .unwrap();
        let categories_of = |options: &LocomoOptions| -> Vec<u64> {
            read(&path, options)
                .unwrap()
                .1
                .iter()
                .map(|(q, _)| q.category)
                .collect()
        };
        assert_eq!(categories_of(&LocomoOptions::default()), vec![1, 2, 3, 4]);
        assert_eq!(
            categories_of(&LocomoOptions {
                include_adversarial: true,
                ..LocomoOptions::default()
            }),
            vec![1, 2, 3, 4, 5]
        );
        assert_eq!(
            categories_of(&LocomoOptions {
                categories: vec![1, 4],
                ..LocomoOptions::default()
            }),
            vec![1, 4]
        );
        assert_eq!(
            categories_of(&LocomoOptions {
                categories: vec![5],
                ..LocomoOptions::default()
            }),
            vec![5]
        );
        let err = read(
            &path,
            &LocomoOptions {
                categories: vec![6],
                ..LocomoOptions::default()
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("no category 6"), "{err}");
    }

    #[test]
    fn seeded_sample_is_stable_and_ordered() {
        let a = seeded_sample((0..100).collect(), 10, 3);
        assert_eq!(a, seeded_sample((0..100).collect(), 10, 3));
        assert_ne!(a, seeded_sample((0..100).collect(), 10, 4));
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(seeded_sample((0..5).collect::<Vec<i32>>(), 10, 1).len(), 5);
    }
}
