//! One skill's life in a run: induction from its cluster (with a repair retry), then the PEMS
//! loop (score, rewrite, re-embed, re-score) until |delta PEMS| < epsilon or the round limit.

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
    /// Its score.
    pub score: PemsScore,
}

/// The result of maturing one cluster.
#[derive(Debug, Clone)]
pub enum Matured {
    /// A skill with every round.
    Skill {
        /// The rounds, in order.
        rounds: Vec<Round>,
        /// Index of the kept round (highest PEMS, earliest on ties).
        best: usize,
        /// The round at which |delta PEMS| < epsilon, if it happened.
        converged: Option<usize>,
        /// Rewrites that could not be read (the loop stopped there).
        rejected: Vec<Attempt>,
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
    /// Writes and rewrites skills.
    pub generator: &'a mut dyn Generator,
    /// Replays skills against episodes; `None`: eta is the logged success rate.
    pub judge: Option<&'a mut dyn Judge>,
}

/// What a cluster brings to the loop.
pub(crate) struct Job<'g> {
    /// Episodes, most representative first.
    pub episodes: Vec<&'g Node>,
    /// The previous version's text and vector, when this run updates a skill.
    pub previous: Option<(String, Vec<f32>)>,
}

/// Distinct episode words (see [`grounded_words`]) a skill must use to be about its episodes.
const MIN_GROUNDED_WORDS: usize = 2;

/// The vocabulary of the episodes as the generator sees them.
fn vocabulary(episodes: &[&Node]) -> BTreeSet<String> {
    episodes.iter().flat_map(|node| content_words(&prompt::episode_brief(node, false))).collect()
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
    let (shown, _) = match prompt::serialize_episodes(episodes, options.prompt_budget, true, &*generator) {
        Ok(serialized) => serialized,
        Err(error) => {
            attempts.push(model_error(error));
            return Ok(None);
        }
    };
    let messages = match previous {
        None => prompt::induce(&shown),
        Some(text) => prompt::update(text, &shown),
    };
    if let Some(skill) = generate_skill(generator, &messages, &params, &vocabulary, attempts) {
        return Ok(Some(skill));
    }
    // The retry: a different, shorter prompt over the two most representative episodes.
    let few = &episodes[..episodes.len().min(2)];
    let (shown, _) = match prompt::serialize_episodes(few, options.prompt_budget / 2, true, &*generator) {
        Ok(serialized) => serialized,
        Err(error) => {
            attempts.push(model_error(error));
            return Ok(None);
        }
    };
    Ok(generate_skill(generator, &prompt::retry(&shown), &params, &vocabulary, attempts))
}

pub(crate) fn mature(job: &Job<'_>, models: &mut Models<'_>, options: &ConsolidateOptions, skills: usize) -> Result<Matured> {
    let params = params(options);
    let vocabulary = vocabulary(&job.episodes);
    let mut attempts = Vec::new();
    let previous_text = job.previous.as_ref().map(|(text, _)| text.as_str());
    let Some(mut current) = induce_with(&job.episodes, previous_text, models.generator, options, &mut attempts)? else {
        return Ok(Matured::Failed { attempts });
    };
    let mut rejected = Vec::new();
    let mut rounds: Vec<Round> = Vec::new();
    let mut converged = None;
    let mut previous_vector = job.previous.as_ref().map(|(_, v)| v.clone());
    for round in 1..=options.max_rounds.max(1) {
        let text = current.render();
        let vector = models.embedder.embed(&[text.as_str()])?.remove(0);
        let (eta, disagreeing) = eta(&text, &job.episodes, models.judge.as_deref_mut(), options)?;
        let length = match options.pems.length {
            LengthUnit::Tokens => models.generator.count_tokens(&text)?,
            LengthUnit::Words => word_count(&text),
        };
        let score = pems(eta, length, delta(&vector, previous_vector.as_deref()), skills, &options.pems);
        let change = rounds.last().map(|r| (score.pems - r.score.pems).abs());
        rounds.push(Round { round, text, skill: current.clone(), vector: vector.clone(), score });
        if change.is_some_and(|c| c < options.epsilon) {
            converged = Some(round);
            break;
        }
        if round == options.max_rounds {
            break;
        }
        let shown: Vec<&Node> = disagreeing.iter().take(2).map(|&i| job.episodes[i]).collect();
        let evidence = match prompt::serialize_episodes(&shown, options.prompt_budget / 2, true, &*models.generator) {
            Ok((text, _)) if !shown.is_empty() => text,
            _ => String::new(),
        };
        let last = rounds.last().expect("a round was just pushed");
        let messages = prompt::rewrite(&last.text, eta, length, &evidence);
        // No retry for a rewrite: on unreadable output the loop stops and keeps the best round.
        match generate_skill(models.generator, &messages, &params, &vocabulary, &mut rejected) {
            Some(next) => current = next,
            None => break,
        }
        previous_vector = Some(vector);
    }
    let best = best_round(&rounds);
    Ok(Matured::Skill { rounds, best, converged, rejected })
}

/// The highest PEMS, the earliest on ties.
pub(crate) fn best_round(rounds: &[Round]) -> usize {
    let mut best = 0;
    for (i, round) in rounds.iter().enumerate() {
        if round.score.pems > rounds[best].score.pems {
            best = i;
        }
    }
    best
}

fn model_error(error: impl std::fmt::Display) -> Attempt {
    Attempt { raw: String::new(), problem: format!("model error: {error}") }
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

/// eta of `skill` over the episodes and the indexes of the episodes it disagrees with.
///
/// With a judge: the first `judge_episodes` episodes are replayed; an episode agrees when it
/// succeeded and the judge finds the skill consistent with it (P >= threshold), or it failed
/// and the judge does not. Episodes without a logged outcome count as successes. Without a
/// judge: the logged success rate (episodes without an outcome left out; 1 if none has one),
/// and the failed episodes are the disagreements.
fn eta<'j>(skill: &str, episodes: &[&Node], judge: Option<&mut (dyn Judge + 'j)>, options: &ConsolidateOptions) -> Result<(f64, Vec<usize>)> {
    let success = |node: &Node| node.episode().and_then(|e| e.outcome.success);
    match judge {
        Some(judge) => {
            let judged: Vec<&Node> = episodes.iter().copied().take(options.judge_episodes.max(1)).collect();
            let passages: Vec<String> = judged.iter().map(|n| prompt::episode_text(n)).collect();
            let passage_refs: Vec<&str> = passages.iter().map(String::as_str).collect();
            let scores = judge.score(&prompt::judge_query(skill), &passage_refs)?;
            let mut disagreeing = Vec::new();
            for (i, (node, p)) in judged.iter().zip(&scores).enumerate() {
                let consistent = *p >= options.judge_threshold;
                if consistent != success(node).unwrap_or(true) {
                    disagreeing.push(i);
                }
            }
            let n = judged.len().max(1) as f64;
            Ok(((judged.len() - disagreeing.len()) as f64 / n, disagreeing))
        }
        None => {
            let known: Vec<(usize, bool)> = episodes.iter().enumerate().filter_map(|(i, n)| success(n).map(|s| (i, s))).collect();
            if known.is_empty() {
                return Ok((1.0, Vec::new()));
            }
            let wins = known.iter().filter(|(_, s)| *s).count();
            let failed = known.iter().filter(|(_, s)| !*s).map(|(i, _)| *i).collect();
            Ok((wins as f64 / known.len() as f64, failed))
        }
    }
}
