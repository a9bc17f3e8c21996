//! `fluxmem eval skills --replay MODEL`: does a skill help an agent act?
//!
//! The logged episodes are split, seeded, into the ones consolidation sees and the ones it does
//! not ([`Split`]: by episode, or by task so that no task is on both sides). For every tool
//! call of the unseen successful episodes (the **steps**; for episodes that act by text
//! commands, every command, read as its pattern: `take <1> from <2>`), a local model gets the
//! tool list (names and argument keys, or the command patterns, from the logs), the task and
//! the steps so far (messages and results clipped), and is asked for the next action as JSON.
//! Three conditions, on the same steps:
//!
//! - `without`: no skill;
//! - `with`: the skill `fluxmem query` serves first for the task ([`served_skills`]: the
//!   skills inherited through the distill edges of the seen episodes closest to it), its text
//!   added to the system prompt; a task served no skill gets the `without` prompt and reply;
//! - `skill_only`: no model: the skill's next step not yet taken (the skill's calls matched in
//!   order against the calls made so far).
//!
//! Scores per step: **tool** (the right tool), **args** (the right tool with exactly the right
//! argument keys: the step accuracy), **values** (of the target's argument values that the
//! prompt's history contains, the share given exactly; steps with none are left out of it).
//! Each mean comes with a bootstrap 95% interval (1,000 resamples of the steps, seeded).
//!
//! The scorer reads the logged calls of unseen episodes only as the answers to score against;
//! nothing of them reaches consolidation.

use fluxmem_consolidate::replay::{
    conversation, parse_action, score, steps_of, system_prompt, tool_list, Action, ReplayStep,
    StepScore,
};
use fluxmem_consolidate::SkillRecord;
use fluxmem_graph::{Node, NodeId, NodeKind};
use fluxmem_models::{ChatMessage, Embedder, GenerateParams, Generator};
use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

use crate::skills::mean;
use crate::Result;

/// How episodes are split into seen and unseen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Split {
    /// Each episode on its own.
    Episode,
    /// Each task on its own: every run of a task is on the same side.
    Task,
}

impl std::str::FromStr for Split {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "episode" => Ok(Split::Episode),
            "task" => Ok(Split::Task),
            other => Err(format!("`{other}` is not a split: use episode or task")),
        }
    }
}

/// Share of the episodes (or tasks) kept unseen.
pub const UNSEEN_SHARE: f64 = 0.25;

/// Whether the item with this key is unseen, by a seeded hash (the same on every machine).
pub fn unseen(key: &str, seed: u64) -> bool {
    let digest = Sha256::digest(format!("{seed}:{key}").as_bytes());
    let draw = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
    (draw % 10_000) as f64 / 10_000.0 < UNSEEN_SHARE
}

/// What the replay runs.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The split the unseen episodes came from (reported).
    pub split: Split,
    /// Steps replayed at most (seeded sample, the same for every condition); 0: all.
    pub sample: usize,
    /// Seed of the sample, the bootstrap and generation.
    pub seed: u64,
    /// Prompts per generation call (1: one at a time, which prefills long prompts fastest
    /// on a CPU; padded batches of long prompts were slower here).
    pub batch: usize,
    /// Characters of history kept (the most recent).
    pub history_chars: usize,
    /// Tokens a reply may take.
    pub max_tokens: usize,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            split: Split::Episode,
            sample: 0,
            seed: 0,
            batch: 1,
            history_chars: 1_500,
            max_tokens: 64,
        }
    }
}

/// The scores of one condition.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ConditionScores {
    /// Share of steps with the right tool.
    pub tool_accuracy: f64,
    /// Share of steps with the right tool and argument keys (step accuracy).
    pub args_accuracy: f64,
    /// Mean share of the traceable argument values given exactly.
    pub values_accuracy: f64,
    /// Bootstrap 95% interval of `args_accuracy`.
    pub ci95: [f64; 2],
    /// Bootstrap 95% interval of `tool_accuracy`.
    pub tool_ci95: [f64; 2],
    /// Steps scored.
    pub steps: usize,
}

/// One skill's steps (those whose task retrieval gave it).
#[derive(Debug, Clone, Default, Serialize)]
pub struct SkillReplay {
    /// The skill's name.
    pub skill: String,
    /// Steps whose task picked it.
    pub steps: usize,
    /// Step accuracy without and with it, and from it alone.
    pub without: f64,
    /// With it.
    pub with: f64,
    /// The skill alone.
    pub skill_only: f64,
}

/// The replay's report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplayReport {
    /// The model.
    pub model: String,
    /// The split.
    pub split: Option<Split>,
    /// Unseen successful episodes.
    pub episodes: usize,
    /// Of them, those whose task `query` serves a skill.
    pub served_episodes: usize,
    /// Steps scored (after sampling).
    pub steps: usize,
    /// Steps there were before sampling.
    pub steps_available: usize,
    /// Steps whose task `query` serves a skill (the others have the same prompt, and reply, in
    /// `with` as in `without`).
    pub served_steps: usize,
    /// `without`, `with`, `skill_only`.
    pub conditions: BTreeMap<String, ConditionScores>,
    /// Per skill.
    pub per_skill: Vec<SkillReplay>,
    /// Prompts run.
    pub prompts: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// Wall seconds of the generations.
    pub seconds: f64,
    /// Scored steps, both model conditions together, whose reply held no readable action
    /// (scored wrong).
    pub unreadable: usize,
    /// Replies to messages instead of a tool call.
    pub messages: BTreeMap<String, usize>,
    /// The first replies of each model condition, verbatim, with the call they should have
    /// made (for reading what the model does).
    pub examples: Vec<ReplayExample>,
}

/// One reply, verbatim.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplayExample {
    /// `without` or `with`.
    pub condition: String,
    /// The tool the logged run called.
    pub expected_tool: String,
    /// The model's reply.
    pub reply: String,
}

/// Replies kept verbatim per model condition.
const EXAMPLES: usize = 3;

/// Replays the unseen `episodes` with and without `skills`.
pub fn replay(
    episodes: &[Node],
    skills: &[SkillRecord],
    served: &BTreeMap<NodeId, NodeId>,
    generator: &mut dyn Generator,
    options: &ReplayOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<ReplayReport> {
    let successful: Vec<&Node> = episodes
        .iter()
        .filter(|n| n.episode().and_then(|e| e.outcome.success) == Some(true))
        .collect();
    let tools = tool_list(episodes);
    let mut targets: Vec<ReplayStep> = successful
        .iter()
        .enumerate()
        .flat_map(|(i, node)| steps_of(i, node, options.history_chars))
        .collect();
    let available = targets.len();
    if options.sample > 0 && options.sample < targets.len() {
        let mut keyed: Vec<(Vec<u8>, ReplayStep)> = targets
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                let key = Sha256::digest(format!("{}:{i}", options.seed).as_bytes()).to_vec();
                (key, t)
            })
            .collect();
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        keyed.truncate(options.sample);
        targets = keyed.into_iter().map(|(_, t)| t).collect();
        targets.sort_by_key(|t| t.episode);
    }
    let picked: Vec<Option<usize>> = (successful.iter())
        .map(|node| {
            let skill = served.get(&node.id)?;
            skills.iter().position(|s| s.id == skill.as_str())
        })
        .collect();
    let system = system_prompt(&tools);
    let mut report = ReplayReport {
        model: generator.model_id().to_string(),
        split: Some(options.split),
        episodes: successful.len(),
        steps: targets.len(),
        steps_available: available,
        served_episodes: picked.iter().flatten().count(),
        ..Default::default()
    };
    let conversation = |target: &ReplayStep, skill: Option<&SkillRecord>| -> Vec<ChatMessage> {
        conversation(&system, target, skill.map(skill_text).as_deref())
    };
    // A step whose task is served no skill has the same prompt in both conditions: `with`
    // takes `without`'s reply there, not a second generation.
    let without: Vec<Vec<ChatMessage>> = targets.iter().map(|t| conversation(t, None)).collect();
    let served_steps: Vec<usize> = (0..targets.len())
        .filter(|&i| picked[targets[i].episode].is_some())
        .collect();
    let with: Vec<Vec<ChatMessage>> = (served_steps.iter())
        .map(|&i| conversation(&targets[i], picked[targets[i].episode].map(|s| &skills[s])))
        .collect();
    report.served_steps = served_steps.len();
    let params = GenerateParams {
        max_tokens: options.max_tokens,
        seed: options.seed,
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let mut predictions: BTreeMap<&str, Vec<Option<Action>>> = BTreeMap::new();
    let all: Vec<usize> = (0..targets.len()).collect();
    for (name, conversations, steps) in
        [("without", &without, &all), ("with", &with, &served_steps)]
    {
        let mut out = Vec::new();
        for chunk in conversations.chunks(options.batch.max(1)) {
            let generations = if chunk.len() == 1 {
                vec![generator.generate(&chunk[0], &params)?]
            } else {
                generator.generate_batch(chunk, &params)?
            };
            progress(name, out.len() + chunk.len(), conversations.len());
            for generation in generations {
                report.prompts += 1;
                report.prompt_tokens += generation.prompt_tokens;
                report.generated_tokens += generation.generated_tokens;
                if out.len() < EXAMPLES {
                    report.examples.push(ReplayExample {
                        condition: name.to_string(),
                        expected_tool: targets[steps[out.len()]].tool.clone(),
                        reply: generation.text.clone(),
                    });
                }
                out.push(parse_action(&generation.text));
            }
        }
        let mut actions = predictions
            .get("without")
            .cloned()
            .unwrap_or_else(|| vec![None; targets.len()]);
        for (&i, action) in steps.iter().zip(out) {
            actions[i] = action;
        }
        for action in &actions {
            report.unreadable += usize::from(action.is_none());
            if action.as_ref().is_some_and(|a| a.tool.is_empty()) {
                *report.messages.entry(name.to_string()).or_default() += 1;
            }
        }
        predictions.insert(name, actions);
    }
    report.seconds = started.elapsed().as_secs_f64();
    let skill_only: Vec<Option<Action>> = targets
        .iter()
        .map(|t| picked[t.episode].and_then(|i| next_skill_step(&skills[i], &t.called)))
        .collect();
    predictions.insert("skill_only", skill_only);
    let mut per_step: BTreeMap<&str, Vec<StepScore>> = BTreeMap::new();
    for (name, actions) in &predictions {
        let scores = targets
            .iter()
            .zip(actions)
            .map(|(t, a)| score(t, a.as_ref()))
            .collect();
        per_step.insert(name, scores);
    }
    for (name, scores) in &per_step {
        report
            .conditions
            .insert(name.to_string(), summarize(scores, options.seed));
    }
    let mut by_skill: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, target) in targets.iter().enumerate() {
        if let Some(skill) = picked[target.episode] {
            by_skill.entry(skill).or_default().push(i);
        }
    }
    for (skill, steps) in by_skill {
        let mean = |name: &str| {
            steps
                .iter()
                .map(|&i| f64::from(u8::from(per_step[name][i].args)))
                .sum::<f64>()
                / steps.len() as f64
        };
        report.per_skill.push(SkillReplay {
            skill: skills[skill].name.clone(),
            steps: steps.len(),
            without: mean("without"),
            with: mean("with"),
            skill_only: mean("skill_only"),
        });
    }
    Ok(report)
}

/// The text of a skill as the `with` condition shows it.
pub fn skill_text(skill: &SkillRecord) -> String {
    let mut text = format!("# {}\n\n{}\n\nSteps:\n", skill.name, skill.description);
    for (i, step) in skill.steps.iter().enumerate() {
        text.push_str(&format!("{}. {step}\n", i + 1));
    }
    if !skill.decisions.is_empty() {
        text.push_str("\nDecision points:\n");
        for decision in &skill.decisions {
            text.push_str(&format!("- {decision}\n"));
        }
    }
    if !skill.pitfalls.is_empty() {
        text.push_str("\nChecks:\n");
        for pitfall in &skill.pitfalls {
            text.push_str(&format!("- {pitfall}\n"));
        }
    }
    text
}

/// For each episode, the skill `fluxmem query --tenant T "<task>"` serves first, read from the
/// store consolidation wrote: the query's ranking ([`fluxmem_connect::serve`], the retrieval
/// the store records, [`fluxmem_connect::serve::DEFAULT_EPISODES`] episodes) inherits skills
/// through the distill edges of the seen episodes closest to the task; the first of them is the
/// skill an agent given query's answer would read. Episodes whose ranking holds no skill are
/// left out of the map.
pub fn served_skills(
    store: &fluxmem_store::Store,
    episodes: &[Node],
    embedder: &dyn Embedder,
    device: &candle_core::Device,
) -> Result<BTreeMap<NodeId, NodeId>> {
    let mut served = BTreeMap::new();
    for node in episodes {
        let query_vector = embedder.embed(&[node.text.as_str()])?.remove(0);
        let request = fluxmem_connect::serve::Request {
            tenant: Some(&node.tenant),
            model: embedder.model_id(),
            query_vector: &query_vector,
            episodes: fluxmem_connect::serve::DEFAULT_EPISODES,
            all_edges: false,
            configure: &|recorded| recorded,
        };
        let answer = fluxmem_connect::serve::read(store, &request, device)?;
        let (head, _) = answer.retriever.retrieve_split(
            &answer.graph,
            &node.text,
            &query_vector,
            &answer.config,
            None,
            request.episodes,
        )?;
        let skill = head.into_iter().map(|(id, ..)| id).find(|id| {
            answer
                .graph
                .nodes
                .get(id)
                .is_some_and(|n| n.kind() == NodeKind::Procedural)
        });
        if let Some(skill) = skill {
            served.insert(node.id.clone(), skill);
        }
    }
    Ok(served)
}

/// The skill's steps as calls: the tool after "call" and the argument keys named after it
/// (outside the parentheses that say where values come from). A skill of text commands (no
/// step calls a tool): each step read as a command (`Take `object` from `source`.` is `take <1>
/// from <2>`), its slots' names standing for the values it leaves open.
fn skill_calls(skill: &SkillRecord) -> Vec<Action> {
    if skill
        .steps
        .iter()
        .all(|s| fluxmem_consolidate::step_call(s).is_none())
    {
        return skill
            .steps
            .iter()
            .filter_map(|s| skill_command(s))
            .collect();
    }
    let mut out = Vec::new();
    for step in &skill.steps {
        let Some((tool, after)) = fluxmem_consolidate::step_call(step) else {
            continue;
        };
        // The argument keys: the closed code spans outside the parentheses.
        let plain = outside_parentheses(after);
        let spans: Vec<&str> = plain.split('`').collect();
        let keys: Map<String, Value> = spans
            .iter()
            .skip(1)
            .step_by(2)
            .take((spans.len() - 1) / 2)
            .map(|key| (key.to_string(), Value::Null))
            .collect();
        out.push(Action {
            tool: tool.to_string(),
            arguments: keys,
        });
    }
    out
}

/// A text step of a skill as a command: backticks and the closing period dropped, and a loop's
/// "For each `x`, " before it.
fn skill_command(step: &str) -> Option<Action> {
    let mut text = step.trim();
    if text.starts_with("For each ") {
        text = text.split_once(", ").map_or(text, |(_, rest)| rest);
    }
    // Where the values come from is not part of the command.
    let text = without_origins(text).trim_end_matches('.').replace('`', "");
    let (tool, arguments) = fluxmem_consolidate::replay::command(&text)?;
    let arguments = arguments
        .into_iter()
        .map(|(k, _)| (k, Value::Null))
        .collect();
    Some(Action { tool, arguments })
}

/// A step without what it says in parentheses (where values come from, run counts), its
/// spaces collapsed: `Take `object` (named in the task in 3 of 3 runs) from `source`.` is
/// `Take `object` from `source`.`.
pub(crate) fn without_origins(step: &str) -> String {
    outside_parentheses(step)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace(" .", ".")
}

/// A skill step's text outside parentheses (where values come from, run counts); a
/// parenthesis inside a code span (`` `x` ``) is text, and a code span inside parentheses is
/// left out with them.
fn outside_parentheses(step: &str) -> String {
    let (mut depth, mut inside, mut out) = (0usize, false, String::new());
    for c in step.chars() {
        match c {
            '(' if !inside => depth += 1,
            ')' if !inside => depth = depth.saturating_sub(1),
            '`' if depth == 0 => {
                inside = !inside;
                out.push(c);
            }
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// The skill's first step not yet taken: its calls matched in order against the calls made.
fn next_skill_step(skill: &SkillRecord, called: &[String]) -> Option<Action> {
    let steps = skill_calls(skill);
    let mut next = 0;
    for tool in called {
        if let Some(offset) = steps[next..].iter().position(|s| &s.tool == tool) {
            next += offset + 1;
        }
    }
    steps.get(next).cloned()
}

fn summarize(scores: &[StepScore], seed: u64) -> ConditionScores {
    let tool: Vec<f64> = scores.iter().map(|s| f64::from(u8::from(s.tool))).collect();
    let args: Vec<f64> = scores.iter().map(|s| f64::from(u8::from(s.args))).collect();
    let values: Vec<f64> = scores
        .iter()
        .filter(|s| s.values.1 > 0)
        .map(|s| s.values.0 as f64 / s.values.1 as f64)
        .collect();
    ConditionScores {
        tool_accuracy: mean(&tool),
        args_accuracy: mean(&args),
        values_accuracy: mean(&values),
        ci95: bootstrap(&args, seed),
        tool_ci95: bootstrap(&tool, seed),
        steps: scores.len(),
    }
}

/// Resamples of the bootstrap.
pub const BOOTSTRAP_RESAMPLES: usize = 1_000;

/// Percentile bootstrap 95% interval of the mean of `values` (seeded SplitMix64 draws).
pub fn bootstrap(values: &[f64], seed: u64) -> [f64; 2] {
    if values.is_empty() {
        return [0.0, 0.0];
    }
    let mut draws = fluxmem_consolidate::SplitMix64::new(seed ^ 0x9e37_79b9_7f4a_7c15);
    let n = values.len();
    let mut means: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| {
            (0..n)
                .map(|_| values[(draws.next_u64() % n as u64) as usize])
                .sum::<f64>()
                / n as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (BOOTSTRAP_RESAMPLES - 1) as f64).round()) as usize];
    [at(0.025), at(0.975)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `with` condition gets the skill `query` serves: the one distilled from the seen
    /// episodes closest to the task, of the task's tenant only; none where query serves none.
    #[test]
    fn the_replay_reads_the_skill_query_serves_for_the_task() {
        use fluxmem_graph::{Edge, EdgeKind, Graph, NodeBody};
        use fluxmem_models::HashEmbedder;
        let embedder = HashEmbedder::new(64);
        let mut graph = Graph::default();
        let add = |graph: &mut Graph, body: NodeBody, tenant: &str, text: &str| {
            let node = Node::new(body, tenant, text, &[text]);
            let id = node.id.clone();
            graph.upsert_node(node);
            id
        };
        let episode = || NodeBody::Episodic(fluxmem_graph::Episode::default());
        let skill = || NodeBody::Procedural(fluxmem_graph::Skill::default());
        let distill = |src: &NodeId, dst: &NodeId| Edge {
            src: src.clone(),
            dst: dst.clone(),
            kind: EdgeKind::Distill,
            weight: 1.0,
            evidence: 1,
            stage: "test".into(),
            run_id: "r".into(),
            created_at: 0,
            active: true,
            metadata: Default::default(),
        };
        let refund = add(&mut graph, skill(), "t", "Refund an order");
        let address = add(&mut graph, skill(), "t", "Change an address");
        for i in 0..3 {
            let text = format!("please refund my order number {i}");
            let e = add(&mut graph, episode(), "t", &text);
            graph.upsert_edge(distill(&e, &refund));
            let text = format!("change the delivery address of shipment {i}");
            let e = add(&mut graph, episode(), "t", &text);
            graph.upsert_edge(distill(&e, &address));
        }
        // Tenant `u` logged the same requests and has no skill.
        for i in 0..3 {
            add(
                &mut graph,
                episode(),
                "u",
                &format!("please refund my order number {i}"),
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let mut writer = fluxmem_store::Writer::open(dir.path()).unwrap();
        writer.commit(&graph, Default::default()).unwrap();
        let progress = &mut fluxmem_embed::NoProgress;
        fluxmem_embed::embed_store(&mut writer, &embedder, &Default::default(), "r", progress)
            .unwrap();
        let unseen = |tenant: &str, text: &str| Node::new(episode(), tenant, text, &[text, "u"]);
        let tasks = [
            unseen("t", "refund my order number 7 please"),
            unseen("t", "change the delivery address of shipment 9"),
            unseen("u", "please refund my order number 7"),
        ];
        let served =
            served_skills(writer.store(), &tasks, &embedder, &candle_core::Device::Cpu).unwrap();
        assert_eq!(served.get(&tasks[0].id), Some(&refund));
        assert_eq!(served.get(&tasks[1].id), Some(&address));
        assert_eq!(
            served.get(&tasks[2].id),
            None,
            "another tenant's skill is never served"
        );
        assert_eq!(served.len(), 2);
    }

    fn skill(steps: &[&str]) -> SkillRecord {
        SkillRecord {
            steps: steps.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_skill_alone_predicts_its_next_untaken_step_with_its_keys() {
        let s = skill(&[
            "Call `get_user_details` with `user_id` (from the user in 3 of 3 runs).",
            "For each `reservation_id`, call `get_reservation_details` with `reservation_id` (from `get_user_details` → `reservations[*]` in 3 of 3 runs).",
            "Call `cancel_reservation` with `reservation_id` (from the user in 2 of 3 runs), `reason`.",
        ]);
        let next = |called: &[&str]| {
            let called: Vec<String> = called.iter().map(|c| c.to_string()).collect();
            next_skill_step(&s, &called)
                .map(|a| (a.tool, a.arguments.keys().cloned().collect::<Vec<_>>()))
        };
        assert_eq!(
            next(&[]),
            Some(("get_user_details".into(), vec!["user_id".into()]))
        );
        assert_eq!(
            next(&["get_user_details", "think"]),
            Some((
                "get_reservation_details".into(),
                vec!["reservation_id".into()]
            ))
        );
        assert_eq!(
            next(&["get_user_details", "get_reservation_details"]),
            Some((
                "cancel_reservation".into(),
                vec!["reason".into(), "reservation_id".into()]
            ))
        );
        assert_eq!(
            next(&[
                "get_user_details",
                "get_reservation_details",
                "cancel_reservation"
            ]),
            None
        );
    }

    #[test]
    fn a_skill_of_commands_predicts_its_next_command_pattern() {
        let s = skill(&[
            "Go to `place`.",
            // Where values come from (in parentheses) is not part of the command.
            "For each `object`, take `object` (named in the task in 2 of 2 runs) from `source` (as in the last `go to` in 2 of 2 runs).",
            "Clean `object` (as in the last `take` in 2 of 2 runs) with sinkbasin.",
        ]);
        let next = |called: &[&str]| {
            let called: Vec<String> = called.iter().map(|c| c.to_string()).collect();
            next_skill_step(&s, &called)
                .map(|a| (a.tool, a.arguments.keys().cloned().collect::<Vec<_>>()))
        };
        assert_eq!(next(&[]), Some(("go to <1>".into(), vec!["1".into()])));
        assert_eq!(
            next(&["go to <1>", "open <1>"]),
            Some(("take <1> from <2>".into(), vec!["1".into(), "2".into()]))
        );
        assert_eq!(
            next(&["go to <1>", "take <1> from <2>"]),
            Some(("clean <1> with <2>".into(), vec!["1".into(), "2".into()]))
        );
        // The logged command the step is scored against reads the same way.
        let logged = fluxmem_consolidate::replay::command("clean apple 1 with sinkbasin 1");
        assert_eq!(
            logged.map(|(pattern, _)| pattern).as_deref(),
            Some("clean <1> with <2>")
        );
    }

    #[test]
    fn the_bootstrap_interval_holds_the_mean_and_narrows_with_more_steps() {
        let few: Vec<f64> = (0..10).map(|i| f64::from(u8::from(i % 2 == 0))).collect();
        let many: Vec<f64> = (0..1000).map(|i| f64::from(u8::from(i % 2 == 0))).collect();
        let [lo, hi] = bootstrap(&few, 1);
        assert!(lo < 0.5 && 0.5 < hi, "{lo} {hi}");
        let [lo2, hi2] = bootstrap(&many, 1);
        assert!(
            lo2 <= 0.5 && 0.5 <= hi2 && hi2 - lo2 < hi - lo,
            "{lo2} {hi2}"
        );
        assert_eq!(bootstrap(&few, 1), bootstrap(&few, 1), "seeded");
    }

    #[test]
    fn the_split_is_seeded_and_near_its_share() {
        let unseen_count = (0..4000).filter(|i| unseen(&i.to_string(), 7)).count();
        assert!((800..1200).contains(&unseen_count), "{unseen_count}");
        assert_eq!(unseen("task-3", 7), unseen("task-3", 7));
        assert!((0..50).any(|i| unseen(&i.to_string(), 7) != unseen(&i.to_string(), 8)));
    }
}
