//! One skill's life in a run: induction from its cluster (with a repair retry), then the PEMS
//! loop (score, rewrite, re-embed, re-score) until |delta PEMS| < epsilon or the round limit.
//!
//! **eta**, the agreement in PEMS = eta / ln(l) * (1 - delta), is measured on episodes the
//! procedure was not mined from: every [`HOLDOUT_EVERY`]-th episode of the cluster is kept
//! back, and the kept-back episodes are split in two (alternately):
//!
//! - the **choosing** half picks each rewrite (the step whose drop raises sequence coverage
//!   the most) and the kept round (the highest PEMS with the choosing half's eta);
//! - the **reporting** half gives the eta that is stored and reported, so that the rounds'
//!   choice does not inflate it.
//!
//! With fewer than 2 kept-back episodes both halves are the same episodes, and with too few
//! successes to keep any back both are the whole cluster (in-sample); the skill's `eta_source`
//! says which. eta itself is one of:
//!
//! - a **replay model** (`Models::replayer`): the step accuracy of a local model that is given
//!   the skill and, for each logged call of the measuring successes (at most
//!   `replay_steps`), the task and the steps so far, and must name the call's tool and argument
//!   keys ([`crate::replay`]): eta means "helps an agent act";
//! - a **judge** (`Models::judge`): the share of measuring episodes where the judge finds the
//!   skill consistent with a success or inconsistent with a failure;
//! - neither (the default, model-free): sequence coverage, how far each success follows the
//!   skill's steps in order (LCS) and each failure does not.
//!
//! A rewrite never adds a step (every step stays proven by the logs), and a round is kept only
//! when its PEMS on the choosing half beats the earlier rounds', so with a model a rewrite is kept
//! only when the model's eta rises enough to pay for it.

use fluxmem_graph::Node;
use fluxmem_models::{Embedder, GenerateParams, Generator, Judge};
use serde::Serialize;
use std::collections::BTreeSet;

use crate::parse::{content_words, grounded_words, parse_skill, SkillText};
use crate::pems::{delta, pems, word_count, LengthUnit, PemsScore};
use crate::prompt;
use crate::{ConsolidateOptions, Result};

/// One unreadable generator answer, kept verbatim.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Attempt {
    /// What the generator wrote.
    pub raw: String,
    /// Why it was rejected.
    pub problem: String,
}

/// One scored version of a skill inside a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Round {
    /// 1-based round number.
    pub round: usize,
    /// The version's text.
    pub text: String,
    /// The parsed version.
    #[serde(skip)]
    pub skill: SkillText,
    /// Its embedding.
    #[serde(skip)]
    pub vector: Vec<f32>,
    /// Its score (eta from the reporting episodes).
    pub score: PemsScore,
    /// Its score with eta from the choosing episodes, which picks the kept round.
    pub choice: PemsScore,
}

/// The result of maturing one cluster.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per cluster, moved a few times: boxing buys nothing
pub enum Matured {
    /// A skill with every round.
    Skill {
        /// The rounds, in order.
        rounds: Vec<Round>,
        /// Index of the kept round (highest PEMS, earliest on ties).
        best: usize,
        /// The round at which |delta PEMS| < epsilon, if it happened.
        converged: Option<usize>,
        /// Generator answers that were not used (unreadable or failing the skeleton check).
        rejected: Vec<Attempt>,
        /// The mined procedure.
        skeleton: crate::mine::Skeleton,
        /// Where the name and description came from.
        wording: Wording,
        /// How eta was measured.
        eta_scope: String,
        /// The episodes eta was measured on.
        measured_on: Vec<fluxmem_graph::NodeId>,
    },
    /// The cluster's successes share no procedure, so there is no skill to write.
    NoProcedure {
        /// Why, with the numbers.
        reason: String,
    },
    /// No readable skill: every answer, verbatim.
    Failed {
        /// The rejected answers (or the model error).
        attempts: Vec<Attempt>,
    },
}

/// The models a run uses.
pub struct Models<'a> {
    /// The store's embedding model.
    pub embedder: &'a dyn Embedder,
    /// Words skills (name, description); `None`: template skills from the mined procedure.
    pub generator: Option<&'a mut dyn Generator>,
    /// Judges skills against episodes; `None`: eta from the replay model or model-free.
    pub judge: Option<&'a mut dyn Judge>,
    /// Replays logged calls with the skill (eta = step accuracy, see the module docs); takes
    /// precedence over `judge`.
    pub replayer: Option<&'a mut dyn Generator>,
}

/// What a cluster brings to the loop.
pub(crate) struct Job<'g> {
    /// Episodes, most representative first.
    pub episodes: Vec<&'g Node>,
    /// The previous version's text and vector, when this run updates a skill.
    pub previous: Option<(String, Vec<f32>)>,
    /// What each of the tenant's tools does ([`crate::flow::ToolRoles`]).
    pub roles: &'g crate::flow::ToolRoles,
}

/// Distinct episode words (see [`grounded_words`]) a skill must use to be about its episodes.
const MIN_GROUNDED_WORDS: usize = 2;

/// The vocabulary of the episodes as the generator sees them.
fn vocabulary(episodes: &[&Node]) -> BTreeSet<String> {
    episodes
        .iter()
        .flat_map(|node| content_words(&prompt::episode_brief(node, false)))
        .collect()
}

/// Stop strings: the model inventing more logs instead of ending its answer.
const STOP: [&str; 4] = ["\nTask:", "\nLogs:", "<|im_start|>", "<start_of_turn>"];

fn params(options: &ConsolidateOptions) -> GenerateParams {
    GenerateParams {
        max_tokens: options.max_tokens,
        temperature: 0.0,
        top_p: None,
        seed: options.kmeans.seed,
        stop: STOP.iter().map(|s| s.to_string()).collect(),
    }
}

/// One induction (no PEMS loop): the skill `generator` writes for `episodes` (most
/// representative first; at most `options.prompt_budget` tokens of them shown), with the
/// retry prompt on unreadable output, or every rejected answer verbatim. `previous`: the
/// text of the version to update, if any.
pub fn induce_skill(
    episodes: &[&Node],
    previous: Option<&str>,
    generator: &mut dyn Generator,
    options: &ConsolidateOptions,
) -> Result<std::result::Result<SkillText, Vec<Attempt>>> {
    let mut attempts = Vec::new();
    let skill = induce_with(episodes, previous, generator, options, &mut attempts)?;
    Ok(skill.ok_or(attempts))
}

fn induce_with(
    episodes: &[&Node],
    previous: Option<&str>,
    generator: &mut dyn Generator,
    options: &ConsolidateOptions,
    attempts: &mut Vec<Attempt>,
) -> Result<Option<SkillText>> {
    let params = params(options);
    let vocabulary = vocabulary(episodes);
    let (shown, _) =
        match prompt::serialize_episodes(episodes, options.prompt_budget, true, &*generator) {
            Ok(serialized) => serialized,
            Err(error) => {
                attempts.push(model_error(error));
                return Ok(None);
            }
        };
    // Nothing from the logs reaches a model unredacted (emails, cards, keys in tool arguments);
    // the prompt's own example is ours and stays as it is.
    let shown = fluxmem_redact::Redactor::default().redact(&shown).text;
    let messages = match previous {
        None => prompt::induce(&shown),
        Some(text) => prompt::update(
            &fluxmem_redact::Redactor::default().redact(text).text,
            &shown,
        ),
    };
    if let Some(skill) = generate_skill(generator, &messages, &params, &vocabulary, attempts) {
        return Ok(Some(skill));
    }
    // The retry: a different, shorter prompt over the two most representative episodes.
    let few = &episodes[..episodes.len().min(2)];
    let (shown, _) =
        match prompt::serialize_episodes(few, options.prompt_budget / 2, true, &*generator) {
            Ok(serialized) => serialized,
            Err(error) => {
                attempts.push(model_error(error));
                return Ok(None);
            }
        };
    let shown = fluxmem_redact::Redactor::default().redact(&shown).text;
    Ok(generate_skill(
        generator,
        &prompt::retry(&shown),
        &params,
        &vocabulary,
        attempts,
    ))
}

/// Every `HOLDOUT_EVERY`-th episode (in representative order) is kept back from mining to
/// measure the skill, when enough successes remain to mine from.
pub(crate) const HOLDOUT_EVERY: usize = 3;

/// Which episodes mine the skeleton and which measure it.
struct Split<'g> {
    successes: Vec<&'g Node>,
    failures: Vec<&'g Node>,
    held_out: Vec<&'g Node>,
}

/// Episodes that measure a skill, read once: their step keys (coverage), the calls of their
/// successes (replay) and the episodes (judge).
struct Measuring<'g> {
    episodes: Vec<&'g Node>,
    measured: Vec<Measured>,
    steps: Vec<crate::replay::ReplayStep>,
}

/// Characters of history a replayed call is shown.
const REPLAY_HISTORY_CHARS: usize = 1_500;
/// Tokens a replayed reply may take (one JSON action).
const REPLAY_TOKENS: usize = 64;

impl<'g> Measuring<'g> {
    /// `replay_steps`: with a replay model, the calls replayed at most (0: all); `None`: no
    /// replay model, and no call is read out of the episodes.
    fn new(episodes: Vec<&'g Node>, replay_steps: Option<usize>) -> Self {
        let steps = match replay_steps {
            None => Vec::new(),
            Some(cap) => spread(
                episodes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| succeeded(n))
                    .flat_map(|(i, n)| crate::replay::steps_of(i, n, REPLAY_HISTORY_CHARS))
                    .collect(),
                cap,
            ),
        };
        Measuring {
            measured: measure(&episodes),
            steps,
            episodes,
        }
    }
}

/// At most `cap` of `items` (0: all), spread evenly over them in order.
fn spread<T>(items: Vec<T>, cap: usize) -> Vec<T> {
    if cap == 0 || items.len() <= cap {
        return items;
    }
    let len = items.len();
    let picked: BTreeSet<usize> = (0..cap).map(|i| i * len / cap).collect();
    items
        .into_iter()
        .enumerate()
        .filter(|(i, _)| picked.contains(i))
        .map(|(_, item)| item)
        .collect()
}

/// The choosing and reporting episodes of a split (see the module docs), and the words that
/// say which they are.
fn measuring_sets<'g>(
    split: &Split<'g>,
    all: &[&'g Node],
    replay_steps: Option<usize>,
) -> (Measuring<'g>, Option<Measuring<'g>>, &'static str) {
    if split.held_out.is_empty() {
        let scope = "in-sample (too few successes to keep some back)";
        return (Measuring::new(all.to_vec(), replay_steps), None, scope);
    }
    if split.held_out.len() < 2 {
        let scope = "held-out; rewrites chosen on the same episode (one kept back)";
        return (
            Measuring::new(split.held_out.clone(), replay_steps),
            None,
            scope,
        );
    }
    let half = |parity: usize| -> Vec<&'g Node> {
        split
            .held_out
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == parity)
            .map(|(_, n)| *n)
            .collect()
    };
    let (choose, report) = (half(0), half(1));
    (
        Measuring::new(report, replay_steps),
        Some(Measuring::new(choose, replay_steps)),
        "held-out; rewrites chosen on other kept-back episodes",
    )
}

fn succeeded(node: &Node) -> bool {
    node.episode()
        .and_then(|e| e.outcome.success)
        .unwrap_or(true)
}

fn split<'g>(episodes: &[&'g Node]) -> Split<'g> {
    let held: Vec<bool> = (0..episodes.len())
        .map(|i| i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1)
        .collect();
    let train_successes = episodes
        .iter()
        .zip(&held)
        .filter(|(n, h)| !**h && succeeded(n))
        .count();
    let holdout = train_successes >= 2 && held.iter().any(|h| *h);
    let mut out = Split {
        successes: Vec::new(),
        failures: Vec::new(),
        held_out: Vec::new(),
    };
    for (node, is_held) in episodes.iter().zip(&held) {
        if holdout && *is_held {
            out.held_out.push(node);
        } else if succeeded(node) {
            out.successes.push(node);
        } else {
            out.failures.push(node);
        }
    }
    out
}

/// The preconditions and pitfalls that speak only of kept steps (a rewrite that drops a step
/// drops what was said about it).
fn pitfalls_of(skeleton: &crate::mine::Skeleton, kept: &[usize]) -> Vec<String> {
    let dropped: Vec<&str> = (0..skeleton.steps.len())
        .filter(|i| !kept.contains(i))
        .map(|i| skeleton.steps[i].short.trim_end_matches('.'))
        .collect();
    skeleton
        .preconditions
        .iter()
        .chain(&skeleton.pitfalls)
        .filter(|p| !dropped.iter().any(|d| p.contains(d)))
        .cloned()
        .collect()
}

/// The decision points as the skill with the `kept` steps says them: a decision after a
/// dropped step is after the kept step before it.
fn decisions_of(skeleton: &crate::mine::Skeleton, kept: &[usize]) -> Vec<String> {
    skeleton
        .decisions
        .iter()
        .map(|decision| {
            let number = decision
                .after
                .and_then(|after| kept.iter().rposition(|&k| k <= after))
                .map(|position| position + 1);
            crate::decide::render(decision, number)
        })
        .collect()
}

/// What a skill's words came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Wording {
    /// `generator` (its name and description passed the checks) or `template`.
    pub source: String,
    /// Why the generator's words were not used, if it was asked.
    pub problem: Option<String>,
}

pub(crate) fn mature(
    job: &Job<'_>,
    models: &mut Models<'_>,
    options: &ConsolidateOptions,
    skills: usize,
) -> Result<Matured> {
    let split = split(&job.episodes);
    let Some(skeleton) =
        crate::mine::mine(&split.successes, &split.failures, &options.mine, job.roles)
    else {
        let reason = format!(
            "its {} successful episode(s) share no procedure: fewer than 2 steps are in at least {:.0}% of them",
            split.successes.len(),
            options.mine.min_support * 100.0
        );
        return Ok(Matured::NoProcedure { reason });
    };
    let replay_steps = models.replayer.is_some().then_some(options.replay_steps);
    let (report_set, choose_set, held) = measuring_sets(&split, &job.episodes, replay_steps);
    // A replay model needs logged tool calls to replay; a cluster of text actions is measured
    // model-free, and says so.
    let replay = models.replayer.is_some()
        && !report_set.steps.is_empty()
        && choose_set.as_ref().is_none_or(|c| !c.steps.is_empty());
    let eta_scope = if models.replayer.is_some() && !replay {
        format!("sequence coverage (no kept-back tool call to replay), {held}")
    } else {
        format!("{}, {held}", eta_name(models))
    };
    // The tools a replayed call may name: every tool the cluster's episodes call.
    let system = if replay {
        crate::replay::system_prompt(&crate::replay::tool_list(job.episodes.iter().copied()))
    } else {
        String::new()
    };
    let mut attempts = Vec::new();
    let (name, description, wording) = word(&skeleton, job, models, options, &mut attempts)?;
    let mut kept: Vec<usize> = (0..skeleton.steps.len()).collect();
    let mut rounds: Vec<Round> = Vec::new();
    let mut converged = None;
    let mut previous_vector = job.previous.as_ref().map(|(_, v)| v.clone());
    for round in 1..=options.max_rounds.max(1) {
        // Template words say what the kept steps do, so they follow the rewrites.
        let (name, description) = match wording.source.as_str() {
            "template" => template_words(&kept_only(&skeleton, &kept)),
            _ => (name.clone(), description.clone()),
        };
        let current = SkillText {
            name,
            description,
            steps: kept
                .iter()
                .map(|&i| skeleton.steps[i].text.clone())
                .collect(),
            pitfalls: pitfalls_of(&skeleton, &kept),
            decisions: decisions_of(&skeleton, &kept),
        };
        let text = current.render();
        let vector = models.embedder.embed(&[text.as_str()])?.remove(0);
        let keys: Vec<&str> = kept
            .iter()
            .map(|&i| skeleton.steps[i].key.as_str())
            .collect();
        let eta = measure_eta(&text, &keys, &report_set, models, options, &system, replay)?;
        let choice_eta = match &choose_set {
            Some(choose) => measure_eta(&text, &keys, choose, models, options, &system, replay)?,
            None => eta,
        };
        let length = match (options.pems.length, models.generator.as_deref()) {
            (LengthUnit::Tokens, Some(generator)) => generator.count_tokens(&text)?,
            _ => word_count(&text),
        };
        let delta = delta(&vector, previous_vector.as_deref());
        let score = pems(eta, length, delta, skills, &options.pems);
        let choice = pems(choice_eta, length, delta, skills, &options.pems);
        let change = rounds.last().map(|r| (choice.pems - r.choice.pems).abs());
        rounds.push(Round {
            round,
            text,
            skill: current,
            vector: vector.clone(),
            score,
            choice,
        });
        if change.is_some_and(|c| c < options.epsilon) {
            converged = Some(round);
            break;
        }
        if round == options.max_rounds {
            break;
        }
        // The rewrite: drop the one non-critical step whose absence raises sequence coverage
        // the most on the choosing episodes (never adds a step: every step stays proven by the
        // logs); whether it is kept is the next round's score on the same episodes.
        let choosing = choose_set.as_ref().unwrap_or(&report_set);
        match best_drop(&skeleton, &kept, &choosing.measured) {
            Some(positions) => {
                for position in positions.into_iter().rev() {
                    kept.remove(position);
                }
            }
            None => break,
        }
        previous_vector = Some(vector);
    }
    let best = best_round(&rounds);
    let measured_on = report_set.episodes.iter().map(|n| n.id.clone()).collect();
    Ok(Matured::Skill {
        rounds,
        best,
        converged,
        rejected: attempts,
        skeleton,
        wording,
        eta_scope,
        measured_on,
    })
}

/// The skill's name and description: the generator's when it writes readable ones that name
/// no tool the procedure lacks, else the template's from the skeleton.
fn word(
    skeleton: &crate::mine::Skeleton,
    job: &Job<'_>,
    models: &mut Models<'_>,
    options: &ConsolidateOptions,
    attempts: &mut Vec<Attempt>,
) -> Result<(String, String, Wording)> {
    let (template_name, template_description) = template_words(skeleton);
    let Some(generator) = models.generator.as_deref_mut() else {
        return Ok((
            template_name,
            template_description,
            Wording {
                source: "template".into(),
                problem: None,
            },
        ));
    };
    // The tasks of the successes the procedure was mined from (most representative first)
    // and its steps; nothing from the logs reaches the model unredacted.
    let redactor = fluxmem_redact::Redactor::default();
    let tasks: Vec<String> = job
        .episodes
        .iter()
        .filter(|n| succeeded(n))
        .take(NAMING_TASKS)
        .map(|n| redactor.redact(n.text.trim()).text)
        .collect();
    let steps: Vec<String> = skeleton
        .steps
        .iter()
        .map(|s| redactor.redact(&s.short).text)
        .collect();
    let messages = prompt::name_procedure(&tasks, &steps);
    // Two lines need few tokens; the options' limit still bounds every answer.
    let params = GenerateParams {
        max_tokens: NAMING_TOKENS.min(options.max_tokens),
        ..params(options)
    };
    let problem = match generator.generate(&messages, &params) {
        Err(error) => {
            attempts.push(model_error(error));
            attempts
                .last()
                .map(|a| a.problem.clone())
                .unwrap_or_default()
        }
        Ok(answer) => match prompt::parse_name(&answer.text) {
            Err(problem) => {
                attempts.push(Attempt {
                    raw: answer.text,
                    problem: problem.clone(),
                });
                problem
            }
            Ok((name, description)) => {
                let skill = SkillText {
                    name,
                    description,
                    steps: Vec::new(),
                    pitfalls: Vec::new(),
                    decisions: Vec::new(),
                };
                let instance = prompt::instance_word(
                    &format!("{} {}", skill.name, skill.description),
                    &skill.description,
                    &tasks,
                    &steps,
                );
                let problem = match instance {
                    Some(word) => Some(format!(
                        "names `{word}`, a detail of one request, not of the procedure"
                    )),
                    None if prompt::ungrounded_name(&skill.name, &tasks, &steps) => Some(format!(
                        "the name `{}` uses no word of the tasks or steps",
                        skill.name
                    )),
                    None => None,
                };
                if let Some(problem) = problem {
                    attempts.push(Attempt {
                        raw: answer.text,
                        problem: problem.clone(),
                    });
                    return Ok((
                        template_name,
                        template_description,
                        Wording {
                            source: "template".into(),
                            problem: Some(problem),
                        },
                    ));
                }
                match foreign_tool(&skill, skeleton, &job.episodes) {
                    None => {
                        return Ok((
                            skill.name,
                            skill.description,
                            Wording {
                                source: "generator".into(),
                                problem: None,
                            },
                        ))
                    }
                    Some(tool) => {
                        let problem = format!(
                            "names the tool `{tool}`, which the mined procedure does not use"
                        );
                        attempts.push(Attempt {
                            raw: answer.text,
                            problem: problem.clone(),
                        });
                        problem
                    }
                }
            }
        },
    };
    Ok((
        template_name,
        template_description,
        Wording {
            source: "template".into(),
            problem: Some(problem),
        },
    ))
}

/// Successes whose tasks the naming prompt shows.
const NAMING_TASKS: usize = 5;
/// Tokens a naming answer may take (two lines), unless `max_tokens` is lower.
const NAMING_TOKENS: usize = 80;

/// A tool the generator's skill names but the skeleton lacks: a tool of the cluster's episodes,
/// or any `snake_case` identifier that is neither a skeleton tool nor one of its argument names
/// (small models invent plausible tool names).
fn foreign_tool(
    skill: &SkillText,
    skeleton: &crate::mine::Skeleton,
    episodes: &[&Node],
) -> Option<String> {
    let used: BTreeSet<&str> = skeleton
        .steps
        .iter()
        .filter_map(|s| s.tool.as_deref())
        .collect();
    let arguments: BTreeSet<&str> = skeleton
        .steps
        .iter()
        .filter_map(|s| {
            s.key
                .strip_prefix("call ")
                .and_then(|k| k.split_once('('))
                .map(|(_, a)| a.trim_end_matches(')'))
        })
        .flat_map(|a| a.split(','))
        .collect();
    let text = format!(
        "{} {} {}",
        skill.name,
        skill.description,
        skill.steps.join(" ")
    );
    let words: BTreeSet<&str> = text
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    let from_episodes = episodes
        .iter()
        .flat_map(|n| crate::mine::signatures(n))
        .filter_map(|s| s.tool)
        .find(|tool| !used.contains(tool.as_str()) && words.contains(tool.as_str()));
    from_episodes.or_else(|| {
        words
            .iter()
            .find(|w| {
                w.contains('_')
                    && w.chars().any(char::is_alphabetic)
                    && !used.contains(*w)
                    && !arguments.contains(*w)
            })
            .map(|w| w.to_string())
    })
}

/// Name and description written from the skeleton alone. The name is what the procedure
/// changes (its tools that do more than read, `cancel_reservation` -> "Cancel reservation"),
/// else what the successes' tasks share.
fn template_words(skeleton: &crate::mine::Skeleton) -> (String, String) {
    let pattern = skeleton.task_pattern.trim();
    // The procedure in its tools' words: the first two distinct tools of the steps `keep` takes.
    let tools_named = |keep: &dyn Fn(&crate::mine::SkeletonStep) -> bool| -> String {
        let mut words: Vec<String> = Vec::new();
        for tool in skeleton
            .steps
            .iter()
            .filter(|s| keep(s))
            .filter_map(|s| s.tool.as_deref())
        {
            let human = tool.replace('_', " ");
            if !words.contains(&human) {
                words.push(human);
            }
        }
        words.into_iter().take(2).collect::<Vec<_>>().join(" and ")
    };
    // A name from the tasks' shared words starts with a shared word (the request's verb) and
    // holds a content word.
    let readable_pattern = !pattern.starts_with('…') && quoted_pattern(pattern).is_some();
    // Named by its acting tools; without one, by the tools its steps call: the tasks' words are
    // never a tool procedure's name (they are a user's message).
    let acting = tools_named(&|s| s.acting);
    let called = tools_named(&|_| true);
    let name = if !acting.is_empty() {
        acting
    } else if !called.is_empty() {
        called
    } else if readable_pattern {
        pattern.to_string()
    } else if let Some(verbs) = distinct_verbs(skeleton) {
        verbs
    } else {
        skeleton
            .steps
            .iter()
            .take(2)
            .map(|s| s.short.trim_end_matches('.').to_string())
            .collect::<Vec<_>>()
            .join(", then ")
    };
    let mut chars = name.chars();
    let name = chars
        .next()
        .map(|c| c.to_uppercase().collect::<String>() + chars.as_str())
        .unwrap_or_default();
    (name, template_description(skeleton))
}

/// The skeleton with only its `kept` steps.
fn kept_only(skeleton: &crate::mine::Skeleton, kept: &[usize]) -> crate::mine::Skeleton {
    crate::mine::Skeleton {
        steps: kept.iter().map(|&i| skeleton.steps[i].clone()).collect(),
        decisions: Vec::new(),
        preconditions: Vec::new(),
        pitfalls: Vec::new(),
        ..skeleton.clone()
    }
}

/// The description written from the skeleton: what its steps do, the tasks' shared words worth
/// quoting, and the runs the steps were mined from.
fn template_description(skeleton: &crate::mine::Skeleton) -> String {
    let contrast = match skeleton.failures {
        0 => String::new(),
        n => format!(", contrasted with {n} failed one(s)"),
    };
    let steps: Vec<&crate::mine::SkeletonStep> = skeleton.steps.iter().collect();
    let like = match quoted_pattern(skeleton.task_pattern.trim()) {
        Some(quote) => format!(" Use for requests like \"{quote}\"."),
        None => String::new(),
    };
    format!(
        "{}{like} Mined from {} successful run(s){contrast}; each step is in {} of them.",
        procedure_words(&steps),
        skeleton.successes,
        min_share_words(&steps)
    )
}

/// A text procedure's name from its steps: the verbs that occur once among them (the others
/// repeat: moving about, looking), the last two, joined (`Take and put`); `None` when every
/// verb repeats.
fn distinct_verbs(skeleton: &crate::mine::Skeleton) -> Option<String> {
    let verbs: Vec<&str> = skeleton
        .steps
        .iter()
        .filter(|s| s.tool.is_none())
        .map(text_verb)
        .map(|k| k.split(' ').next().unwrap_or(k))
        .collect();
    let once: Vec<&str> = verbs
        .iter()
        .copied()
        .filter(|v| verbs.iter().filter(|w| *w == v).count() == 1)
        .collect();
    let last: Vec<&str> = once[once.len().saturating_sub(2)..].to_vec();
    (!last.is_empty()).then(|| last.join(" and "))
}

/// A text action step's verb: its signature before the first slot (`go to` of `go to <1>`).
fn text_verb(step: &crate::mine::SkeletonStep) -> &str {
    crate::mine::key_verb(&step.key)
}

/// What the procedure does, in one sentence: the tools it calls, in order (``Calls `a`, then
/// `b`.``), or the verbs of its text actions (`Goes through: go to, take, put.`).
fn procedure_words(steps: &[&crate::mine::SkeletonStep]) -> String {
    let mut tools: Vec<String> = Vec::new();
    let mut verbs: Vec<String> = Vec::new();
    for step in steps {
        match &step.tool {
            Some(tool) => {
                let named = format!("`{tool}`");
                if !tools.contains(&named) {
                    tools.push(named);
                }
            }
            None => {
                let verb = text_verb(step).to_string();
                if !verbs.contains(&verb) {
                    verbs.push(verb);
                }
            }
        }
    }
    if !tools.is_empty() {
        format!("Calls {}.", tools.join(", then "))
    } else {
        format!("Goes through: {}.", verbs.join(", "))
    }
}

/// The part of the tasks' shared words worth quoting: the runs of shared words (between `…`)
/// that hold a content word ([`content_words`]), or `None` when none does (`… i … to …` says
/// nothing about the request).
fn quoted_pattern(pattern: &str) -> Option<String> {
    let mut kept: Vec<String> = Vec::new();
    let mut elided = false;
    for run in pattern.split('…') {
        let run = run.trim();
        if !run.is_empty() && !content_words(run).is_empty() {
            if elided || (!kept.is_empty()) {
                kept.push("…".to_string());
            }
            kept.push(run.to_string());
            elided = false;
        } else {
            elided = true;
        }
    }
    if kept.is_empty() {
        return None;
    }
    if elided {
        kept.push("…".to_string());
    }
    Some(kept.join(" "))
}

/// The lowest step support in words: "all", or "at least N%".
fn min_share_words(steps: &[&crate::mine::SkeletonStep]) -> String {
    let lowest = steps.iter().map(|s| s.support).fold(1.0, f64::min);
    if lowest >= 1.0 - 1e-12 {
        "all".to_string()
    } else {
        format!("at least {:.0}%", (lowest * 100.0).floor())
    }
}

/// A measuring episode as eta needs it: its outcome and its step signature keys, computed
/// once per skill (every round and every candidate drop reads them again).
pub(crate) struct Measured {
    success: bool,
    keys: Vec<String>,
}

pub(crate) fn measure(episodes: &[&Node]) -> Vec<Measured> {
    episodes
        .iter()
        .map(|node| Measured {
            success: succeeded(node),
            keys: crate::mine::signatures(node)
                .into_iter()
                .map(|s| s.key)
                .collect(),
        })
        .collect()
}

/// eta from sequence coverage: a success agrees as far as it follows the steps in order
/// (longest common subsequence over the steps), a failure as far as it does not.
fn coverage_eta(keys: &[&str], episodes: &[Measured]) -> f64 {
    if episodes.is_empty() {
        return 0.0;
    }
    let total: f64 = episodes
        .iter()
        .map(|episode| {
            let own: Vec<&str> = episode.keys.iter().map(String::as_str).collect();
            let covered = crate::mine::coverage_of_keys(keys, &own);
            if episode.success {
                covered
            } else {
                1.0 - covered
            }
        })
        .sum();
    total / episodes.len() as f64
}

/// The positions in `kept` (ascending) of the step whose removal raises eta the most (ties:
/// the earliest), if any removal raises it and at least 2 steps remain. A critical step is never
/// dropped, nor one whose result a kept later step reads ([`crate::mine::SkeletonStep::feeds`]):
/// the later step's arguments would come from a step the skill no longer names. A step between
/// two of the same step goes with the second of them (the runs take that step once there), so a
/// skill never shows one step twice in a row.
fn best_drop(
    skeleton: &crate::mine::Skeleton,
    kept: &[usize],
    episodes: &[Measured],
) -> Option<Vec<usize>> {
    let droppable = |position: usize| {
        let step = &skeleton.steps[kept[position]];
        !step.critical && !step.feeds.iter().any(|later| kept.contains(later))
    };
    let keys = |skip: &[usize]| -> Vec<&str> {
        kept.iter()
            .enumerate()
            .filter(|(p, _)| !skip.contains(p))
            .map(|(_, &i)| skeleton.steps[i].key.as_str())
            .collect()
    };
    let base = coverage_eta(&keys(&[]), episodes);
    let mut best: Option<(Vec<usize>, f64)> = None;
    for position in (0..kept.len()).filter(|&p| droppable(p)) {
        let mut drop = vec![position];
        if let (Some(before), Some(&after)) = (position.checked_sub(1), kept.get(position + 1)) {
            if skeleton.steps[kept[before]].key == skeleton.steps[after].key {
                if !droppable(position + 1) {
                    continue;
                }
                drop.push(position + 1);
            }
        }
        if kept.len() - drop.len() < 2 {
            continue;
        }
        let eta = coverage_eta(&keys(&drop), episodes);
        if eta > base + 1e-12 && best.as_ref().is_none_or(|(_, b)| eta > b + 1e-12) {
            best = Some((drop, eta));
        }
    }
    best.map(|(drop, _)| drop)
}

/// The highest PEMS on the choosing episodes, the earliest on ties.
pub(crate) fn best_round(rounds: &[Round]) -> usize {
    let mut best = 0;
    for (i, round) in rounds.iter().enumerate() {
        if round.choice.pems > rounds[best].choice.pems {
            best = i;
        }
    }
    best
}

fn model_error(error: impl std::fmt::Display) -> Attempt {
    Attempt {
        raw: String::new(),
        problem: format!("model error: {error}"),
    }
}

/// One generation, parsed; `None` when it is unreadable or uses fewer than
/// [`MIN_GROUNDED_WORDS`] words of the episodes (the answer is pushed to `attempts`). Model
/// errors count as failed attempts.
fn generate_skill(
    generator: &mut dyn Generator,
    messages: &[fluxmem_models::ChatMessage],
    params: &GenerateParams,
    vocabulary: &BTreeSet<String>,
    attempts: &mut Vec<Attempt>,
) -> Option<SkillText> {
    let raw = match generator.generate(messages, params) {
        Ok(generation) => generation.text,
        Err(error) => {
            attempts.push(model_error(error));
            return None;
        }
    };
    let parsed = parse_skill(&raw).and_then(|skill| {
        let grounded = grounded_words(&skill, vocabulary);
        if grounded.len() >= MIN_GROUNDED_WORDS {
            Ok(skill)
        } else {
            Err(format!(
                "not about its episodes: {} of their words ({}) where {MIN_GROUNDED_WORDS} are needed",
                grounded.len(),
                grounded.join(", ")
            ))
        }
    });
    match parsed {
        Ok(skill) => Some(skill),
        Err(problem) => {
            attempts.push(Attempt { raw, problem });
            None
        }
    }
}

/// What eta is measured with, as the skill's `eta_source` starts.
pub(crate) fn eta_name(models: &Models<'_>) -> String {
    if let Some(replayer) = models.replayer.as_deref() {
        format!("replay step accuracy ({})", replayer.model_id())
    } else if let Some(judge) = models.judge.as_deref() {
        format!("judge ({})", judge.model_id())
    } else {
        "sequence coverage".to_string()
    }
}

/// eta of a version on one set of measuring episodes (see the module docs); `replay`: with
/// the replay model (else with the judge, or model-free).
#[allow(clippy::too_many_arguments)] // the version, its episodes, the models and the prompt
fn measure_eta(
    text: &str,
    keys: &[&str],
    on: &Measuring<'_>,
    models: &mut Models<'_>,
    options: &ConsolidateOptions,
    system: &str,
    replay: bool,
) -> Result<f64> {
    if let Some(replayer) = models.replayer.as_deref_mut().filter(|_| replay) {
        let params = GenerateParams {
            max_tokens: REPLAY_TOKENS,
            ..params(options)
        };
        return crate::replay::step_accuracy(&on.steps, system, Some(text), replayer, &params);
    }
    match models
        .judge
        .as_deref_mut()
        .filter(|_| models.replayer.is_none())
    {
        Some(judge) => judge_eta(text, &on.episodes, judge, options),
        None => Ok(coverage_eta(keys, &on.measured)),
    }
}

/// eta with a judge: the first `judge_episodes` episodes are replayed; an episode agrees when
/// it succeeded and the judge finds the skill consistent with it (P >= threshold), or it failed
/// and the judge does not. Episodes without a logged outcome count as successes.
fn judge_eta(
    skill: &str,
    episodes: &[&Node],
    judge: &mut dyn Judge,
    options: &ConsolidateOptions,
) -> Result<f64> {
    let judged: Vec<&Node> = episodes
        .iter()
        .copied()
        .take(options.judge_episodes.max(1))
        .collect();
    let passages: Vec<String> = judged.iter().map(|n| prompt::episode_text(n)).collect();
    let passage_refs: Vec<&str> = passages.iter().map(String::as_str).collect();
    let scores = judge.score(&prompt::judge_query(skill), &passage_refs)?;
    let agreeing = judged
        .iter()
        .zip(&scores)
        .filter(|(node, p)| (**p >= options.judge_threshold) == succeeded(node))
        .count();
    Ok(agreeing as f64 / judged.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mine::{Skeleton, SkeletonStep};
    use fluxmem_graph::{Episode, NodeBody, Outcome, Step};

    fn episode(actions: &[&str], success: bool) -> Node {
        let steps = actions
            .iter()
            .map(|a| Step {
                action: a.to_string(),
                ..Step::default()
            })
            .collect();
        let body = NodeBody::Episodic(Episode {
            steps,
            outcome: Outcome {
                success: Some(success),
                reward: None,
                feedback: None,
            },
        });
        Node::new(
            body,
            "t",
            &actions.join(";"),
            &[&actions.join(";"), &success.to_string()],
        )
    }

    fn step(key: &str, critical: bool) -> SkeletonStep {
        SkeletonStep {
            key: key.into(),
            text: key.into(),
            short: key.into(),
            acting: false,
            tool: None,
            support: 1.0,
            failure_support: None,
            critical,
            feeds: Vec::new(),
        }
    }

    fn skeleton(critical_middle: bool) -> Skeleton {
        Skeleton {
            steps: vec![
                step("go to <1>", false),
                step("open <1>", critical_middle),
                step("take <1> from <2>", false),
            ],
            decisions: Vec::new(),
            preconditions: Vec::new(),
            pitfalls: Vec::new(),
            successes: 3,
            failures: 0,
            task_pattern: String::new(),
        }
    }

    #[test]
    fn a_rewrite_drops_the_step_that_kept_back_successes_skip_and_raises_eta() {
        let held = [
            episode(&["go to fridge 1", "take apple 1 from fridge 1"], true),
            episode(&["go to shelf 1", "take cup 1 from shelf 1"], true),
        ];
        let held = measure(&held.iter().collect::<Vec<&Node>>());
        let all = [0, 1, 2];
        let before = coverage_eta(&["go to <1>", "open <1>", "take <1> from <2>"], &held);
        assert!((before - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(
            best_drop(&skeleton(false), &all, &held),
            Some(vec![1]),
            "the open goes"
        );
        assert_eq!(
            coverage_eta(&["go to <1>", "take <1> from <2>"], &held),
            1.0,
            "eta rises to 1"
        );
        assert_eq!(
            best_drop(&skeleton(true), &all, &held),
            None,
            "a critical step is never dropped"
        );
        assert_eq!(
            best_drop(&skeleton(false), &[0, 2], &held),
            None,
            "two steps stay"
        );
    }

    #[test]
    fn a_description_quotes_only_the_shared_words_that_say_something() {
        assert_eq!(
            quoted_pattern("… refund order … i …").as_deref(),
            Some("… refund order …")
        );
        assert_eq!(
            quoted_pattern("hi … i'd like to … my flight reservation").as_deref(),
            Some("… i'd like to … my flight reservation")
        );
        assert_eq!(quoted_pattern("… i … to … of my …"), None);
        let mut moves = skeleton(false);
        moves.steps.push(step("go to <1>", false));
        moves.steps.push(step("put <1> in/on <2>", false));
        assert_eq!(
            distinct_verbs(&moves).as_deref(),
            Some("take and put"),
            "the moving about repeats; the last two verbs said once"
        );
        assert_eq!(quoted_pattern(""), None);
        let mut skeleton = skeleton(false);
        fn refs(steps: &[SkeletonStep]) -> Vec<&SkeletonStep> {
            steps.iter().collect()
        }
        let steps = |s: &Skeleton| -> Vec<SkeletonStep> { s.steps.clone() };
        assert_eq!(
            procedure_words(&refs(&steps(&skeleton))),
            "Goes through: go to, open, take."
        );
        skeleton.steps[0].tool = Some("get_order".into());
        skeleton.steps[2].tool = Some("refund_order".into());
        skeleton.steps[1].tool = Some("get_order".into());
        assert_eq!(
            procedure_words(&refs(&steps(&skeleton))),
            "Calls `get_order`, then `refund_order`."
        );
        assert_eq!(min_share_words(&refs(&steps(&skeleton))), "all");
        skeleton.steps[1].support = 0.5;
        assert_eq!(
            template_words(&kept_only(&skeleton, &[0, 2])).1,
            "Calls `get_order`, then `refund_order`. Mined from 3 successful run(s); each step is in all of them.",
            "the description speaks of the kept steps"
        );
    }

    #[test]
    fn a_drop_never_leaves_one_step_twice_in_a_row() {
        let held = [
            episode(&["go to fridge 1", "take cup 1 from fridge 1"], true),
            episode(&["go to desk 1", "take pen 1 from desk 1"], true),
        ];
        let held = measure(&held.iter().collect::<Vec<&Node>>());
        let mut twice = skeleton(false);
        twice.steps.insert(2, step("go to <1>", false));
        // go to, open, go to, take: the kept-back runs go once and never open.
        assert_eq!(
            best_drop(&twice, &[0, 1, 2, 3], &held),
            Some(vec![1, 2]),
            "the open goes with the second `go to`, not alone"
        );
        twice.steps[3].critical = true;
        twice.steps[2].critical = true;
        assert_eq!(
            best_drop(&twice, &[0, 1, 2, 3], &held),
            Some(vec![0]),
            "the second `go to` must stay, so the open stays; the first `go to` may go"
        );
        twice.steps[2] = step("look", false);
        twice.steps[3].critical = false;
        assert_eq!(best_drop(&twice, &[0, 1, 2, 3], &held), Some(vec![1]));
    }

    #[test]
    fn a_step_whose_result_a_kept_later_step_reads_is_never_dropped() {
        let held = [
            episode(&["go to fridge 1", "take apple 1 from fridge 1"], true),
            episode(&["go to shelf 1", "take cup 1 from shelf 1"], true),
        ];
        let held = measure(&held.iter().collect::<Vec<&Node>>());
        let mut fed = skeleton(false);
        fed.steps[1].feeds = vec![2];
        assert_eq!(
            best_drop(&fed, &[0, 1, 2], &held),
            None,
            "the open feeds the take: it stays although the kept-back runs skip it"
        );
        fed.steps.push(step("put <1> in <2>", false));
        assert_eq!(
            best_drop(&fed, &[0, 1, 3], &held),
            Some(vec![1]),
            "once the step it feeds is gone, it may go too"
        );
    }

    #[test]
    fn a_failure_that_follows_the_steps_lowers_eta() {
        let failure = episode(
            &[
                "go to fridge 1",
                "open fridge 1",
                "take apple 1 from fridge 1",
            ],
            false,
        );
        assert_eq!(
            coverage_eta(
                &["go to <1>", "open <1>", "take <1> from <2>"],
                &measure(&[&failure])
            ),
            0.0
        );
    }

    #[test]
    fn holdout_keeps_every_third_episode_back_when_enough_successes_remain() {
        let nodes: Vec<Node> = (0..6)
            .map(|i| episode(&[&format!("look {i}")], i != 4))
            .collect();
        let refs: Vec<&Node> = nodes.iter().collect();
        let s = split(&refs);
        assert_eq!(s.held_out.len(), 2);
        assert_eq!((s.successes.len(), s.failures.len()), (3, 1));
        let few = split(&refs[..2]);
        assert!(few.held_out.is_empty(), "too few to keep any back");
    }

    #[test]
    fn the_episodes_that_choose_rewrites_are_not_the_ones_that_report_eta() {
        let nodes: Vec<Node> = (0..12)
            .map(|i| episode(&[&format!("look {i}")], i != 4))
            .collect();
        let refs: Vec<&Node> = nodes.iter().collect();
        let ids = |m: &Measuring<'_>| -> BTreeSet<String> {
            m.episodes.iter().map(|n| n.id.to_string()).collect()
        };
        let s = split(&refs);
        assert_eq!(s.held_out.len(), 4);
        let (report, choose, scope) = measuring_sets(&s, &refs, None);
        let choose = choose.expect("4 kept back: two halves");
        assert!(ids(&report).is_disjoint(&ids(&choose)), "{scope}");
        let held: BTreeSet<String> = s.held_out.iter().map(|n| n.id.to_string()).collect();
        let union: BTreeSet<String> = ids(&report).union(&ids(&choose)).cloned().collect();
        assert_eq!(union, held, "every kept-back episode measures, none other");
        assert_eq!((report.episodes.len(), choose.episodes.len()), (2, 2));
        // One kept back: it both chooses and reports, and the scope says so.
        let one = split(&refs[..5]);
        assert_eq!(one.held_out.len(), 1);
        let (report, choose, scope) = measuring_sets(&one, &refs[..5], None);
        assert!(choose.is_none() && report.episodes.len() == 1);
        assert!(scope.contains("same episode"), "{scope}");
        // None kept back: in-sample, said.
        let none = split(&refs[..2]);
        let (report, choose, scope) = measuring_sets(&none, &refs[..2], None);
        assert!(choose.is_none() && report.episodes.len() == 2);
        assert!(scope.starts_with("in-sample"), "{scope}");
    }

    #[test]
    fn spread_takes_at_most_its_cap_evenly_and_in_order() {
        assert_eq!(spread((0..10).collect(), 4), vec![0, 2, 5, 7]);
        assert_eq!(spread((0..3).collect(), 4), vec![0, 1, 2]);
        assert_eq!(spread((0..3).collect(), 0), vec![0, 1, 2]);
    }
}
