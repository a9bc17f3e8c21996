//! Procedure mining: the steps a cluster's successful episodes share, proven by the logs, with
//! no model.
//!
//! 1. Each episode becomes a sequence of **step signatures**. A tool call is its tool name and
//!    sorted argument keys (`call get_order(order_id)`); its argument values become slots named
//!    after their keys (`<order_id>`). A short text action (an ALFWorld command, a shell-like
//!    command) is its verb and the shape of its arguments (`take <1> from <2>`): content words
//!    between prepositions are slots, instance numbers are dropped. A long free-text turn (a
//!    message to the user) is `message the user`; ReAct `think:` lines are not actions.
//!    Consecutive repeats collapse into one signature.
//! 2. The successes' sequences are aligned by **progressive multiple alignment over LCS**: the
//!    first (most representative) sequence is the profile; each next one is aligned to it by a
//!    longest common subsequence of signatures; matched columns count one more supporter,
//!    unmatched elements become new columns in place. A column's **support** is the share of
//!    successes aligned to it.
//! 3. The **skeleton** is the profile's columns with support >= `min_support`, in profile order.
//!    A skill never holds a step under that share: that rule is what keeps skills free of
//!    invented steps. A column that some runs replace with another (every run lacking it took
//!    a step the skill does not hold, at the same place, that no run holding it took) is one
//!    side of an either-or, not a step. Where the runs part ways between two steps, the
//!    columns at least `branch_support` of them hold are a **decision point**
//!    ([`crate::decide`]): each path with its runs, and what tells it apart when something
//!    does.
//! 4. Against the cluster's **failures**: a step whose success support exceeds its failure
//!    support by `critical_gap` is **critical**; a pair A -> B that every success holding both
//!    runs in that order, while some failure runs B without A before it, is a **precondition**
//!    ("run A before B").
//! 5. **Pitfalls** come from per-step feedback: tool results that are errors, step feedback, and
//!    text actions answered by "Nothing happens".
//!
//! 6. **Data flow** ([`crate::flow`]): a tool step says where each argument's value came from
//!    in the runs aligned to it (the user, or an earlier call's result at a JSON path), with
//!    counts; a step repeated with other values is a loop ("for each"); an acting step most
//!    runs take right after the user agreed says so. Tool roles (reader, noise, acting) are
//!    learned per tenant from its logs: noise calls (a scratchpad) are not steps, acting tools
//!    name the skill.
//!
//! A text action's slot whose value is the same in every supporting occurrence (at least two)
//! is shown as that value (`clean `object` with sinkbasin`); tool argument values are never
//! shown (they are instance data: ids, names, amounts, possibly personal), and a check's error
//! example loses its words with digits. A skill needs [`MineOptions::min_successes`] (2).

use crate::flow::{Source, ToolRoles};
use fluxmem_graph::Node;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Thresholds of the miner.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MineOptions {
    /// A step needs at least this share of the successes (default 0.5) ...
    pub min_support: f64,
    /// ... and at least this many of them, when there are that many (default 2: with two
    /// successes a step must be in both, so a skill is never the union of two stories).
    pub min_count: usize,
    /// Columns at least this share (and not steps) are the paths of decision points.
    pub branch_support: f64,
    /// A step is critical when its success support minus its failure support is at least this.
    pub critical_gap: f64,
    /// Steps kept at most (the best supported, in order).
    pub max_steps: usize,
    /// A skill needs at least this many successes (default 2: one success is one story, not
    /// a procedure).
    pub min_successes: usize,
}

impl Default for MineOptions {
    fn default() -> Self {
        MineOptions {
            min_support: 0.5,
            min_count: 2,
            branch_support: 0.25,
            critical_gap: 0.5,
            max_steps: 12,
            min_successes: 2,
        }
    }
}

/// One step of an episode: its signature, its slot values and what went wrong, if anything.
#[derive(Debug, Clone, PartialEq)]
pub struct Signed {
    /// The signature (the alignment key).
    pub key: String,
    /// The tool, for a tool call.
    pub tool: Option<String>,
    /// Slot names, in order (argument keys, or `1`, `2`... for text actions).
    pub slots: Vec<String>,
    /// The words around the slots of a text action (`["take", "from"]`), empty for tools.
    pub frame: Vec<String>,
    /// Slot values, in slot order.
    pub values: Vec<String>,
    /// An error the step met (tool error, feedback, "Nothing happens").
    pub error: Option<String>,
    /// For a tool call, the sources of each slot's value, in slot order ([`crate::flow`]).
    pub sources: Vec<BTreeSet<Source>>,
    /// For a tool call, whether each slot's value was long enough to trace.
    pub traced: Vec<bool>,
    /// The slots whose values changed between consecutive repeats of the step (a loop:
    /// "for each").
    pub varying: BTreeSet<String>,
    /// For a tool call, the user agreed right before it ([`crate::flow::CallFlow::agreed`]).
    pub agreed: bool,
    /// For a tool call, where it is in the episode: (step index, call index), one per
    /// collapsed repeat.
    pub at: Vec<(usize, usize)>,
}

/// A step of a skeleton.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SkeletonStep {
    /// The signature.
    pub key: String,
    /// The step as a skill shows it, with where its arguments come from (`Call \`get_order\`
    /// with \`order_id\` (from the user, 3 of 3 runs).`).
    pub text: String,
    /// The step alone (`Call \`get_order\` with \`order_id\`.`), as rules and checks name it.
    pub short: String,
    /// The tool is an acting one ([`crate::flow::ToolRoles`]), for a tool call.
    pub acting: bool,
    /// The tool, for a tool call.
    pub tool: Option<String>,
    /// Share of the successes aligned to it.
    pub support: f64,
    /// Share of the failures that contain it (`None` without failures).
    pub failure_support: Option<f64>,
    /// Successes have it and failures lack it.
    pub critical: bool,
    /// The later steps (indices into the skeleton's steps) that take an argument from this
    /// step's result in at least half of their runs: the step is where their values come from.
    pub feeds: Vec<usize>,
}

/// The procedure a cluster's successes share.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Skeleton {
    /// The steps, in order.
    pub steps: Vec<SkeletonStep>,
    /// Where the successes part ways between steps ([`crate::decide`]).
    pub decisions: Vec<crate::decide::Decision>,
    /// "Run A before B" rules.
    pub preconditions: Vec<String>,
    /// What went wrong at the skeleton's steps.
    pub pitfalls: Vec<String>,
    /// Successes aligned.
    pub successes: usize,
    /// Failures contrasted.
    pub failures: usize,
    /// What the successes' tasks share (other words as `…`).
    pub task_pattern: String,
}

/// Words that separate the slots of a text action: English prepositions. A token of
/// prepositions joined by `/` (`in/on`) is one too ([`is_frame_word`]).
const FRAME_WORDS: [&str; 11] = [
    "to", "from", "in", "on", "into", "onto", "with", "at", "under", "for", "of",
];

/// A preposition, or prepositions joined by `/`.
pub(crate) fn is_frame_word(word: &str) -> bool {
    word.split('/').all(|part| FRAME_WORDS.contains(&part))
}
/// The signature of a free-text turn.
pub(crate) const MESSAGE: &str = "message the user";
/// Text actions longer than this are free text (a message), not a command.
const MAX_COMMAND_WORDS: usize = 10;

/// The episode's steps as signatures, consecutive repeats collapsed (a repeat with other
/// values marks those slots as varying: a loop).
pub fn signatures(node: &Node) -> Vec<Signed> {
    let Some(episode) = node.episode() else {
        return Vec::new();
    };
    let mut flows = crate::flow::episode_flow(node).into_iter();
    let mut out: Vec<Signed> = Vec::new();
    // The task's and observations' words, read once, when a command needs them.
    let mut words: Option<EpisodeWords> = None;
    for (index, step) in episode.steps.iter().enumerate() {
        let next_observation = episode
            .steps
            .get(index + 1)
            .map(|s| s.observation.as_str())
            .unwrap_or("");
        let mut signed: Vec<Signed> = if step.tool_calls.is_empty() {
            text_signature(&step.action, next_observation)
                .map(|mut signed| {
                    if !signed.values.is_empty() {
                        let words = words.get_or_insert_with(|| EpisodeWords::of(node, episode));
                        signed.sources = text_sources(&signed, words, episode, index, &out);
                    }
                    signed
                })
                .into_iter()
                .collect()
        } else {
            step.tool_calls
                .iter()
                .enumerate()
                .map(|(at, call)| {
                    let mut signed = tool_signature(call, flows.next());
                    signed.at.push((index, at));
                    signed
                })
                .collect()
        };
        if let (Some(feedback), Some(last)) = (&step.feedback, signed.last_mut()) {
            last.error.get_or_insert_with(|| feedback.clone());
        }
        for item in signed.drain(..) {
            push_collapsed(&mut out, item);
        }
    }
    out
}

/// An episode's task and observations as lower-case words (letters and digits).
struct EpisodeWords {
    task: Vec<String>,
    observations: Vec<Vec<String>>,
}

impl EpisodeWords {
    fn of(node: &Node, episode: &fluxmem_graph::Episode) -> EpisodeWords {
        EpisodeWords {
            task: lower_words(&node.text),
            observations: episode
                .steps
                .iter()
                .map(|s| lower_words(&s.observation))
                .collect(),
        }
    }
}

fn lower_words(text: &str) -> Vec<String> {
    text.to_lowercase()
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// Where each value of the text command `signed` (the episode's step `index`) came from, one
/// source a value, the first that holds: an earlier command of the episode (`earlier`, the
/// latest with the value), the task, an observation before the command (the latest that shows
/// it); none of these is an empty set. A value is found as whole words (`words`), any case.
fn text_sources(
    signed: &Signed,
    words: &EpisodeWords,
    episode: &fluxmem_graph::Episode,
    index: usize,
    earlier: &[Signed],
) -> Vec<BTreeSet<Source>> {
    let holds = |text: &[String], value: &str| {
        let wanted: Vec<&str> = value.split_whitespace().collect();
        !wanted.is_empty() && text.windows(wanted.len()).any(|w| w == wanted.as_slice())
    };
    let verb_of = |step: &fluxmem_graph::Step| {
        text_signature(&step.action, "")
            .and_then(|s| s.frame.first().cloned())
            .unwrap_or_default()
    };
    signed
        .values
        .iter()
        .map(|value| {
            let command = earlier
                .iter()
                .rev()
                .find(|s| s.tool.is_none() && s.values.contains(value))
                .and_then(|s| s.frame.first())
                .map(|verb| Source::Command { verb: verb.clone() });
            let source = command
                .or_else(|| holds(&words.task, value).then_some(Source::Task))
                .or_else(|| {
                    (0..=index)
                        .rev()
                        .find(|&j| holds(&words.observations[j], value))
                        .map(|j| Source::Seen {
                            verb: j
                                .checked_sub(1)
                                .map_or(String::new(), |a| verb_of(&episode.steps[a])),
                        })
                });
            source.into_iter().collect()
        })
        .collect()
}

/// Appends `item` to `out`, or folds it into the last step when it repeats it.
fn push_collapsed(out: &mut Vec<Signed>, item: Signed) {
    match out.last_mut() {
        Some(previous) if previous.key == item.key => absorb_repeat(previous, item),
        _ => out.push(item),
    }
}

/// Folds a consecutive repeat of a step into the first: its error when the first had none,
/// its sources, and the slots whose value changed.
fn absorb_repeat(previous: &mut Signed, repeat: Signed) {
    if previous.error.is_none() {
        previous.error = repeat.error;
    }
    for (slot, (before, after)) in previous
        .slots
        .iter()
        .zip(previous.values.iter().zip(&repeat.values))
    {
        if before != after {
            previous.varying.insert(slot.clone());
        }
    }
    for (mine, theirs) in previous.sources.iter_mut().zip(repeat.sources) {
        mine.extend(theirs);
    }
    previous.at.extend(repeat.at);
}

/// The tool a call's signature names (`call get_order(order_id)` is `get_order`); `None` for a
/// text action's.
pub(crate) fn key_tool(key: &str) -> Option<&str> {
    key.strip_prefix("call ")
        .map(|call| call.split('(').next().unwrap_or(call))
}

/// A text action's signature before its first slot (`go to <1>` is `go to`).
pub(crate) fn key_verb(key: &str) -> &str {
    key.split(" <").next().unwrap_or(key)
}

fn tool_signature(call: &fluxmem_graph::ToolCall, flow: Option<crate::flow::CallFlow>) -> Signed {
    let arguments: BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&call.arguments).unwrap_or_default();
    let slots: Vec<String> = arguments.keys().cloned().collect();
    let values = arguments.values().map(|v| v.to_string()).collect();
    let error = call
        .result
        .as_deref()
        .filter(|r| is_error(r))
        .map(str::to_string);
    let flow = flow
        .filter(|f| f.tool == call.name)
        .unwrap_or_else(|| crate::flow::CallFlow {
            step: 0,
            tool: call.name.clone(),
            sources: BTreeMap::new(),
            traced: BTreeSet::new(),
            fed_later: false,
            empty_result: false,
            has_result: false,
            agreed: false,
        });
    Signed {
        key: format!("call {}({})", call.name, slots.join(",")),
        tool: Some(call.name.clone()),
        sources: slots
            .iter()
            .map(|s| flow.sources.get(s).cloned().unwrap_or_default())
            .collect(),
        traced: slots.iter().map(|s| flow.traced.contains(s)).collect(),
        agreed: flow.agreed,
        slots,
        frame: Vec::new(),
        values,
        error,
        varying: BTreeSet::new(),
        at: Vec::new(),
    }
}

fn is_error(result: &str) -> bool {
    let head: String = result
        .trim_start()
        .chars()
        .take(40)
        .collect::<String>()
        .to_lowercase();
    head.starts_with("error")
        || head.contains("\"error\"")
        || head.starts_with("failed")
        || head.starts_with("exception")
}

/// A text command's signature (its pattern and slot values); `None` for a thought, free text
/// (a message) or nothing. What the replay reads a command as.
pub(crate) fn command_signature(action: &str) -> Option<Signed> {
    text_signature(action, "").filter(|s| s.key != MESSAGE)
}

fn text_signature(action: &str, next_observation: &str) -> Option<Signed> {
    let action = action.trim();
    let lower = action.to_lowercase();
    if action.is_empty() || lower.starts_with("think:") || lower.starts_with("think ") {
        return None;
    }
    let words: Vec<String> = lower
        .split_whitespace()
        .map(|w| {
            w.trim_matches(|c: char| !c.is_alphanumeric() && c != '/' && c != '_')
                .to_string()
        })
        .filter(|w| !w.is_empty())
        .collect();
    let sentence = action.contains(". ") || action.ends_with('?') || action.ends_with('!');
    if words.is_empty() || words.len() > MAX_COMMAND_WORDS || sentence {
        return Some(Signed {
            key: MESSAGE.into(),
            tool: None,
            slots: Vec::new(),
            frame: vec![MESSAGE.into()],
            values: Vec::new(),
            error: None,
            sources: Vec::new(),
            traced: Vec::new(),
            varying: BTreeSet::new(),
            agreed: false,
            at: Vec::new(),
        });
    }
    let (verb, rest) = if words.len() > 1 && words[0] == "go" && words[1] == "to" {
        ("go to".to_string(), &words[2..])
    } else {
        (words[0].clone(), &words[1..])
    };
    let mut frame = vec![verb];
    let mut values: Vec<String> = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    let flush = |current: &mut Vec<&str>, values: &mut Vec<String>, frame: &mut Vec<String>| {
        if !current.is_empty() {
            values.push(current.join(" "));
            frame.push(String::new());
            current.clear();
        }
    };
    for word in rest {
        if is_frame_word(word) {
            flush(&mut current, &mut values, &mut frame);
            frame.push(word.clone());
        } else if word.chars().all(|c| c.is_ascii_digit()) {
            // Instance numbers (`apple 1`) are not part of what the step does.
        } else {
            current.push(word);
        }
    }
    flush(&mut current, &mut values, &mut frame);
    let mut slot = 0;
    let key: Vec<String> = frame
        .iter()
        .map(|w| {
            if w.is_empty() {
                slot += 1;
                format!("<{slot}>")
            } else {
                w.clone()
            }
        })
        .collect();
    let error = next_observation
        .trim()
        .to_lowercase()
        .starts_with("nothing happens")
        .then(|| "Nothing happens.".to_string());
    Some(Signed {
        key: key.join(" "),
        tool: None,
        slots: (1..=values.len()).map(|i| i.to_string()).collect(),
        frame,
        values,
        error,
        sources: Vec::new(),
        traced: Vec::new(),
        varying: BTreeSet::new(),
        agreed: false,
        at: Vec::new(),
    })
}

/// A column of the alignment profile.
#[derive(Debug, Clone)]
pub(crate) struct Column {
    pub(crate) key: String,
    /// The occurrences aligned to it (successes only), with their episode index.
    pub(crate) occurrences: Vec<(usize, Signed)>,
}

impl Column {
    /// The runs (episode indices) aligned to it.
    pub(crate) fn holders(&self) -> BTreeSet<usize> {
        self.occurrences.iter().map(|(e, _)| *e).collect()
    }
}

/// The fewest of `runs` runs that make up `share` of them (a share just over a whole number
/// of runs is that number).
pub(crate) fn runs_needed(share: f64, runs: usize) -> usize {
    ((share * runs as f64) - 1e-9).ceil() as usize
}

/// Longest common subsequence of two key sequences: the matched (i, j) pairs, in order.
pub(crate) fn lcs_pairs(a: &[&str], b: &[&str]) -> Vec<(usize, usize)> {
    let (n, m) = (a.len(), b.len());
    let mut table = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            table[i][j] = if a[i] == b[j] {
                table[i + 1][j + 1] + 1
            } else {
                table[i + 1][j].max(table[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut pairs) = (0, 0, Vec::new());
    while i < n && j < m {
        if a[i] == b[j] {
            pairs.push((i, j));
            i += 1;
            j += 1;
        } else if table[i + 1][j] >= table[i][j + 1] {
            i += 1;
        } else {
            j += 1;
        }
    }
    pairs
}

/// Length of the longest common subsequence of two key sequences.
pub fn lcs_len(a: &[&str], b: &[&str]) -> usize {
    lcs_pairs(a, b).len()
}

/// Aligns the sequences progressively into a profile of columns.
fn align(sequences: &[Vec<Signed>]) -> Vec<Column> {
    let mut profile: Vec<Column> = Vec::new();
    for (episode, sequence) in sequences.iter().enumerate() {
        let profile_keys: Vec<String> = profile.iter().map(|c| c.key.clone()).collect();
        let profile_refs: Vec<&str> = profile_keys.iter().map(String::as_str).collect();
        let keys: Vec<&str> = sequence.iter().map(|s| s.key.as_str()).collect();
        let pairs = lcs_pairs(&profile_refs, &keys);
        let mut merged: Vec<Column> = Vec::with_capacity(profile.len() + sequence.len());
        let (mut i, mut j) = (0, 0);
        let mut old = std::mem::take(&mut profile).into_iter();
        for (pi, sj) in pairs
            .into_iter()
            .chain(std::iter::once((usize::MAX, usize::MAX)))
        {
            let profile_end = pi.min(profile_keys.len());
            let sequence_end = sj.min(keys.len());
            while i < profile_end {
                merged.push(old.next().expect("profile column"));
                i += 1;
            }
            while j < sequence_end {
                merged.push(Column {
                    key: sequence[j].key.clone(),
                    occurrences: vec![(episode, sequence[j].clone())],
                });
                j += 1;
            }
            if pi == usize::MAX {
                break;
            }
            let mut column = old.next().expect("matched profile column");
            column.occurrences.push((episode, sequence[sj].clone()));
            merged.push(column);
            i += 1;
            j += 1;
        }
        profile = merged;
    }
    profile
}

/// The skeleton of `successes` (most representative first) contrasted with `failures`, or
/// `None` when the successes are fewer than `min_successes` or share fewer than 2 steps.
/// `roles` (learned from the tenant's episodes) says which tools are noise and which act.
pub fn mine(
    successes: &[&Node],
    failures: &[&Node],
    options: &MineOptions,
    roles: &ToolRoles,
) -> Option<Skeleton> {
    let n = successes.len();
    if n == 0 || n < options.min_successes {
        return None;
    }
    let steps_of = |node: &&Node| without_noise(signatures(node), roles);
    let sequences: Vec<Vec<Signed>> = successes.iter().map(steps_of).collect();
    let failed: Vec<Vec<Signed>> = failures.iter().map(steps_of).collect();
    let profile = align(&sequences);
    let holders = |column: &Column| column.holders().len();
    let support = |column: &Column| holders(column) as f64 / n as f64;
    let min_count = options.min_count.min(n);
    // A free-text turn to the user aligns (it keeps the order of what is around it) but is not
    // a step: it says nothing a skill can follow.
    let mut kept: Vec<(usize, f64)> = profile
        .iter()
        .enumerate()
        .filter(|(_, c)| c.key != MESSAGE && holders(c) >= min_count)
        .map(|(i, c)| (i, support(c)))
        .filter(|(_, s)| *s + 1e-12 >= options.min_support)
        .collect();
    // The other side of an either-or is itself a pattern: as many runs as a step needs.
    let min_branch = runs_needed(options.branch_support, n);
    kept = without_alternatives(&profile, kept, n, min_branch.max(min_count));
    // A column next to another of the same step is one step (the alignment split a repeat).
    let one_step_each = |kept: &mut Vec<(usize, f64)>| {
        kept.dedup_by(|later, earlier| {
            let same = profile[later.0].key == profile[earlier.0].key;
            if same {
                earlier.1 = earlier.1.max(later.1);
            }
            same
        })
    };
    one_step_each(&mut kept);
    if kept.len() > options.max_steps {
        let mut by_support = kept.clone();
        by_support.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let keep: BTreeSet<usize> = by_support
            .into_iter()
            .take(options.max_steps)
            .map(|(i, _)| i)
            .collect();
        kept.retain(|(i, _)| keep.contains(i));
        // Cutting the steps between two of the same step leaves them next to each other.
        one_step_each(&mut kept);
    }
    let failure_share = |key: &str| {
        (!failed.is_empty()).then(|| {
            failed
                .iter()
                .filter(|f| f.iter().any(|s| s.key == key))
                .count() as f64
                / failed.len() as f64
        })
    };
    let steps: Vec<SkeletonStep> = kept
        .iter()
        .map(|&(i, share)| {
            let column = &profile[i];
            let failure_support = failure_share(&column.key);
            let tool = column.occurrences[0].1.tool.clone();
            let acting = tool.as_deref().is_some_and(|t| roles.is_acting(t));
            SkeletonStep {
                key: column.key.clone(),
                text: render_step(column, acting),
                short: render_short(column),
                acting,
                tool,
                support: share,
                failure_support,
                critical: failure_support
                    .is_some_and(|f| share - f >= options.critical_gap - 1e-12),
                feeds: Vec::new(),
            }
        })
        .collect();
    let columns: Vec<&Column> = kept.iter().map(|&(i, _)| &profile[i]).collect();
    let steps = with_feeds(steps, &columns);
    if steps.len() < 2 {
        return None;
    }
    let kept_columns: Vec<usize> = kept.iter().map(|&(i, _)| i).collect();
    let decisions =
        crate::decide::decisions(&profile, &kept_columns, successes, options.branch_support);
    let preconditions = preconditions(&steps, &sequences, &failed);
    let pitfalls = pitfalls(&steps, &sequences, &failed);
    Some(Skeleton {
        steps,
        decisions,
        preconditions,
        pitfalls,
        successes: n,
        failures: failures.len(),
        task_pattern: task_pattern(successes),
    })
}

/// `kept` (profile index, support) without the steps that are one side of an either-or: a
/// column some runs lack is an alternative, not a step, when every run lacking it took,
/// between its neighbouring kept columns, another step of the same kind that the skill does not
/// hold, that at least `min_branch` runs hold and no run holding it does ([`crate::decide`]
/// shows such paths as a decision point).
fn without_alternatives(
    profile: &[Column],
    kept: Vec<(usize, f64)>,
    runs: usize,
    min_branch: usize,
) -> Vec<(usize, f64)> {
    let kept_keys: BTreeSet<&str> = kept.iter().map(|&(i, _)| profile[i].key.as_str()).collect();
    let alternative = |position: usize| -> bool {
        let index = kept[position].0;
        let own = profile[index].holders();
        if own.len() >= runs {
            return false;
        }
        let start = position.checked_sub(1).map_or(0, |p| kept[p].0 + 1);
        let end = kept.get(position + 1).map_or(profile.len(), |k| k.0);
        let is_tool = profile[index].occurrences[0].1.tool.is_some();
        let mut elsewhere: BTreeSet<usize> = BTreeSet::new();
        for (i, column) in profile.iter().enumerate().take(end).skip(start) {
            let other = column.holders();
            if i == index
                || column.key == MESSAGE
                || kept_keys.contains(column.key.as_str())
                || column.occurrences[0].1.tool.is_some() != is_tool
                || other.len() < min_branch
                || !other.is_disjoint(&own)
            {
                continue;
            }
            elsewhere.extend(other);
        }
        (0..runs).all(|run| own.contains(&run) || elsewhere.contains(&run))
    };
    let drop: Vec<bool> = (0..kept.len()).map(alternative).collect();
    kept.into_iter()
        .zip(drop)
        .filter(|(_, d)| !d)
        .map(|(k, _)| k)
        .collect()
}

/// Each step with the later steps that read its result ([`SkeletonStep::feeds`]): a later
/// step is fed by the nearest earlier step of the tool that most of its runs (at least half)
/// took an argument value from.
fn with_feeds(mut steps: Vec<SkeletonStep>, columns: &[&Column]) -> Vec<SkeletonStep> {
    for (later, column) in columns.iter().enumerate().skip(1) {
        let runs = column.occurrences.len();
        let mut readers: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, signed) in &column.occurrences {
            let tools: BTreeSet<&str> = signed
                .sources
                .iter()
                .flatten()
                .filter_map(|source| match source {
                    Source::Result { tool, .. } => Some(tool.as_str()),
                    _ => None,
                })
                .collect();
            for tool in tools {
                *readers.entry(tool).or_default() += 1;
            }
        }
        for (tool, count) in readers {
            if 2 * count < runs {
                continue;
            }
            let feeder = (0..later)
                .rev()
                .find(|&i| steps[i].tool.as_deref() == Some(tool));
            if let Some(feeder) = feeder {
                steps[feeder].feeds.push(later);
            }
        }
    }
    steps
}

/// The tool a mined step calls and the text after its name: the backticked name after "call"
/// or "Call" (``Call `get_order` with ...``, ``For each `x`, call `get_order` ...``); a step
/// also names its arguments and the tools their values come from, which are not calls.
pub fn step_call(step: &str) -> Option<(&str, &str)> {
    step.match_indices("all `").find_map(|(at, _)| {
        let word_start = at.checked_sub(1)?;
        let starts = matches!(&step[word_start..at], "c" | "C")
            && (word_start == 0 || step[..word_start].ends_with(' '));
        if !starts {
            return None;
        }
        let (tool, after) = step[at + "all `".len()..].split_once('`')?;
        let plain = !tool.is_empty()
            && tool
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        plain.then_some((tool, after))
    })
}

/// The episode's signatures without calls of noise tools, repeats that their removal made
/// consecutive collapsed again.
fn without_noise(sequence: Vec<Signed>, roles: &ToolRoles) -> Vec<Signed> {
    let mut out: Vec<Signed> = Vec::with_capacity(sequence.len());
    for item in sequence {
        if item.tool.as_deref().is_some_and(|t| roles.is_noise(t)) {
            continue;
        }
        push_collapsed(&mut out, item);
    }
    out
}

/// A tool step with where each argument comes from, counted over the column's runs:
/// ``Call `refund_order` with `order_id` (from the user in 3 of 3 runs).``; a step that the
/// runs repeat with other values for one slot is a loop (``For each `reservation_id`: ...``);
/// an acting step that most runs make right after the user agreed says so first.
fn render_step(column: &Column, acting: bool) -> String {
    let first = &column.occurrences[0].1;
    if first.tool.is_none() {
        return render_text(column, true);
    }
    let runs = column.occurrences.len();
    let looping: BTreeMap<&String, usize> =
        column
            .occurrences
            .iter()
            .fold(BTreeMap::new(), |mut counts, (_, s)| {
                for slot in &s.varying {
                    *counts.entry(slot).or_default() += 1;
                }
                counts
            });
    let loop_slot = looping
        .iter()
        .filter(|(_, c)| 2 * **c >= runs)
        .max_by_key(|(slot, c)| (**c, std::cmp::Reverse(**slot)))
        .map(|(slot, _)| slot.as_str());
    let slots: Vec<String> = first
        .slots
        .iter()
        .enumerate()
        .map(|(i, slot)| match slot_origin(column, i) {
            Some(origin) => format!("`{slot}` ({origin})"),
            None => format!("`{slot}`"),
        })
        .collect();
    let tool = first.tool.as_deref().unwrap_or_default();
    let call = if slots.is_empty() {
        format!("`{tool}`")
    } else {
        format!("`{tool}` with {}", slots.join(", "))
    };
    let agreed = column.occurrences.iter().filter(|(_, s)| s.agreed).count();
    let confirm = if acting && 2 * agreed > runs {
        format!("After the user confirms ({agreed} of {runs} runs), ")
    } else {
        String::new()
    };
    let text = match loop_slot {
        Some(slot) => format!("for each `{slot}`, call {call}."),
        None => format!("call {call}."),
    };
    let mut line = confirm + &text;
    if let Some(first) = line.get(0..1) {
        line = first.to_uppercase() + &line[1..];
    }
    line
}

/// Where the values of slot `i` came from over the column's runs: the two most frequent
/// sources with their counts; else whether the value was the same in every run.
fn slot_origin(column: &Column, i: usize) -> Option<String> {
    let runs = column.occurrences.len();
    let mut counts: BTreeMap<&Source, usize> = BTreeMap::new();
    for (_, signed) in &column.occurrences {
        for source in signed.sources.get(i).into_iter().flatten() {
            *counts.entry(source).or_default() += 1;
        }
    }
    let mut ranked: Vec<(&Source, usize)> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    if !ranked.is_empty() {
        let said: Vec<String> = ranked
            .iter()
            .take(2)
            .map(|(source, count)| format!("{} in {count} of {runs} runs", source.describe()))
            .collect();
        return Some(said.join("; "));
    }
    let first = column.occurrences[0].1.values.get(i);
    let constant = column
        .occurrences
        .iter()
        .all(|(_, s)| s.values.get(i) == first);
    if constant && runs > 1 {
        return Some(format!("the same value in all {runs} runs"));
    }
    let traced = column
        .occurrences
        .iter()
        .any(|(_, s)| s.traced.get(i).copied().unwrap_or(false));
    traced.then(|| "not in the user's messages or earlier results".to_string())
}

/// How a column reads in a skill, without data flow (rules and checks name steps this way).
pub(crate) fn render_short(column: &Column) -> String {
    render_text(column, false)
}

/// A column as text; with `origins`, a text command's open slots say where their values came
/// from (``Take `object` (named in the task in 3 of 3 runs) from ...``).
fn render_text(column: &Column, origins: bool) -> String {
    let first = &column.occurrences[0].1;
    // A value is shown only when at least two runs agree on it (one run's value is instance
    // data, not part of the procedure).
    let constant = |slot: usize| -> Option<&str> {
        let value = first.values.get(slot)?;
        (column.occurrences.len() >= 2
            && column
                .occurrences
                .iter()
                .all(|(_, s)| s.values.get(slot) == Some(value)))
        .then_some(value.as_str())
    };
    if let Some(tool) = &first.tool {
        let slots: Vec<String> = first.slots.iter().map(|s| format!("`{s}`")).collect();
        return if slots.is_empty() {
            format!("Call `{tool}`.")
        } else {
            format!("Call `{tool}` with {}.", slots.join(", "))
        };
    }
    let mut slot = 0;
    let mut words: Vec<String> = Vec::new();
    for (position, word) in first.frame.iter().enumerate() {
        if word.is_empty() {
            let previous = first.frame[..position]
                .iter()
                .rev()
                .find(|w| !w.is_empty())
                .map(String::as_str)
                .unwrap_or("");
            words.push(match constant(slot) {
                Some(value) => value.to_string(),
                // A code span: no Markdown escape is needed, so the raw text reads clean.
                None => {
                    let named = format!("`{}`", slot_type(previous, position == 1));
                    match slot_origin(column, slot).filter(|_| origins) {
                        Some(origin) => format!("{named} ({origin})"),
                        None => named,
                    }
                }
            });
            slot += 1;
        } else {
            words.push(word.clone());
        }
    }
    let mut text = words.join(" ");
    if let Some(first_char) = text.get(0..1) {
        text = format!("{}{}", first_char.to_uppercase(), &text[1..]);
    }
    text.push('.');
    text
}

/// A readable name for a text action's slot, from the word before it.
fn slot_type(previous: &str, right_after_verb: bool) -> &'static str {
    // `in/on` reads as its first preposition.
    let previous = previous.split('/').next().unwrap_or(previous);
    match previous {
        "go to" | "to" | "at" => "place",
        "from" => "source",
        "in" | "on" | "into" | "onto" | "under" => "receptacle",
        "with" => "tool",
        _ if right_after_verb => "object",
        _ => "value",
    }
}

/// Pairs of skeleton steps that every success holding both runs in order, and some failure
/// runs the second of without the first before it.
fn preconditions(
    steps: &[SkeletonStep],
    successes: &[Vec<Signed>],
    failures: &[Vec<Signed>],
) -> Vec<String> {
    let first = |sequence: &[Signed], key: &str| sequence.iter().position(|s| s.key == key);
    let mut rules = Vec::new();
    for (a_index, a) in steps.iter().enumerate() {
        for b in steps.iter().skip(a_index + 1) {
            if a.key == b.key {
                continue;
            }
            let ordered = successes
                .iter()
                .all(|s| match (first(s, &a.key), first(s, &b.key)) {
                    (Some(x), Some(y)) => x < y,
                    _ => true,
                });
            let broken = failures
                .iter()
                .any(|f| match (first(f, &a.key), first(f, &b.key)) {
                    (Some(x), Some(y)) => x > y,
                    (None, Some(_)) => true,
                    _ => false,
                });
            if ordered && broken {
                let rule = format!(
                    "{} must come before: {}",
                    trim_period(&a.short),
                    trim_period(&b.short)
                );
                if !rules.contains(&rule) {
                    rules.push(rule);
                }
            }
        }
    }
    rules.truncate(5);
    rules
}

fn trim_period(text: &str) -> &str {
    text.strip_suffix('.').unwrap_or(text)
}

/// Errors met at the skeleton's steps, in any episode of the cluster: one check per step
/// (a step that is in the skeleton twice is said once), with the most frequent error (digits
/// aside) as its example.
fn pitfalls(
    steps: &[SkeletonStep],
    successes: &[Vec<Signed>],
    failures: &[Vec<Signed>],
) -> Vec<String> {
    let mut out = Vec::new();
    let mut said = BTreeSet::new();
    for step in steps {
        if !said.insert(step.key.as_str()) {
            continue;
        }
        let occurrences: Vec<&Signed> = successes
            .iter()
            .chain(failures)
            .flatten()
            .filter(|s| s.key == step.key)
            .collect();
        let mut kinds: BTreeMap<String, (usize, &str)> = BTreeMap::new();
        for error in occurrences.iter().filter_map(|s| s.error.as_deref()) {
            let kind: String = error
                .chars()
                .take(120)
                .map(|c| if c.is_ascii_digit() { '#' } else { c })
                .collect();
            kinds.entry(kind).or_insert((0, error)).0 += 1;
        }
        let errors: usize = kinds.values().map(|(count, _)| count).sum();
        let Some((_, (count, example))) = kinds
            .iter()
            .max_by(|a, b| a.1 .0.cmp(&b.1 .0).then(b.0.cmp(a.0)))
        else {
            continue;
        };
        let example = instance_free(&example.chars().take(120).collect::<String>())
            .replace('"', "'")
            .replace('\n', " ");
        let most = if kinds.len() > 1 {
            format!(" ({count} of them with \"{example}\")")
        } else {
            format!(" with \"{example}\"")
        };
        out.push(format!(
            "{}: {errors} of {} logged runs of this step failed{most}; check before calling it",
            trim_period(&step.short),
            occurrences.len(),
        ));
    }
    out
}

/// An error message without its instance data: a word holding a digit (an id, a date, an
/// amount) becomes `…`.
pub(crate) fn instance_free(text: &str) -> String {
    text.split(' ')
        .map(|word| {
            if word.chars().any(|c| c.is_ascii_digit()) {
                let end: String = word
                    .chars()
                    .rev()
                    .take_while(|c| matches!(c, ',' | '.' | ';' | ':' | ')'))
                    .collect();
                format!("…{}", end.chars().rev().collect::<String>())
            } else {
                word.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The words most of the successes' tasks share, in the first task's order; other words `…`.
/// Each task is redacted first: splitting, lowercasing and truncating would otherwise disguise
/// a secret from the redaction that runs on the finished skill (an AWS key id lowercased and
/// cut short is no longer one).
fn task_pattern(successes: &[&Node]) -> String {
    let redactor = fluxmem_redact::Redactor::default();
    let words = |node: &Node| -> Vec<String> {
        redactor
            .redact(&node.text)
            .text
            .split_whitespace()
            .map(|w| {
                w.trim_matches(|c: char| !c.is_alphanumeric())
                    .to_lowercase()
            })
            .filter(|w| !w.is_empty())
            .collect()
    };
    // Distinct tasks: the same request run twice is still one user's message.
    let mut all: Vec<Vec<String>> = Vec::new();
    for task in successes.iter().map(|n| words(n)) {
        if !all.contains(&task) {
            all.push(task);
        }
    }
    let Some(first) = all.first() else {
        return String::new();
    };
    if all.len() < 2 {
        return String::new();
    }
    // Shared: in at least half of the distinct tasks and in at least two, so a pattern is never
    // one user's message.
    let needed = all.len().div_ceil(2).max(2);
    let shared = |word: &str| all.iter().filter(|w| w.iter().any(|x| x == word)).count() >= needed;
    let mut pattern: Vec<&str> = Vec::new();
    for word in first {
        if word.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if shared(word) {
            pattern.push(word);
        } else if pattern.last() != Some(&"…") {
            pattern.push("…");
        }
    }
    let mut text = pattern.join(" ");
    if text.chars().count() > 80 {
        text = text.chars().take(79).collect::<String>() + "…";
    }
    text
}

/// The acting tools an episode calls ([`ToolRoles::is_acting`], learned from the episode's
/// cluster).
fn acting_tools(node: &Node, roles: &ToolRoles) -> BTreeSet<String> {
    signatures(node)
        .into_iter()
        .filter_map(|s| s.tool)
        .filter(|t| roles.is_acting(t))
        .collect()
}

/// A success for grouping by procedure: logged as one, or of unknown outcome.
fn counts_as_success(node: &Node) -> bool {
    node.episode()
        .and_then(|e| e.outcome.success)
        .unwrap_or(true)
}

/// Splits clusters whose successes follow different procedures: within a cluster, successes
/// are grouped by the set of acting tools they call; each set held by at least `min_count`
/// successes becomes its own cluster (when there are two such sets, or one and other successes
/// that do not follow it), the rest of the successes stay together, and each failure joins the
/// group whose acting tools overlap its own the most (Jaccard; ties to the earlier group), so
/// no group is failures only. Clusters whose successes call no tools, or all share one set,
/// are left as they are. Rows keep their
/// representative order; a new group's centroid is the normalised mean of its rows. The
/// same input always gives the same groups.
pub fn split_by_procedure<'g>(
    members: &[Vec<usize>],
    centroids: &[Vec<f32>],
    vectors: &[Vec<f32>],
    node: impl Fn(usize) -> &'g Node,
    roles: &ToolRoles,
    min_count: usize,
) -> (Vec<Vec<usize>>, Vec<Vec<f32>>) {
    let success = |r: usize| counts_as_success(node(r));
    let (mut out_members, mut out_centroids) = (Vec::new(), Vec::new());
    for (rows, centroid) in members.iter().zip(centroids) {
        let acting: Vec<BTreeSet<String>> =
            rows.iter().map(|&r| acting_tools(node(r), roles)).collect();
        let mut counts: BTreeMap<&BTreeSet<String>, usize> = BTreeMap::new();
        for (i, &r) in rows.iter().enumerate() {
            if success(r) && !acting[i].is_empty() {
                *counts.entry(&acting[i]).or_default() += 1;
            }
        }
        // Groups in order of their first success, so the most representative leads.
        let mut keys: Vec<&BTreeSet<String>> = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            if success(r)
                && counts
                    .get(&acting[i])
                    .is_some_and(|&n| n >= min_count.max(2))
                && !keys.contains(&&acting[i])
            {
                keys.push(&acting[i]);
            }
        }
        // One shared set splits too when other successes do not follow it: a procedure that
        // enough successes share is not diluted by the ones that do something else.
        let others = rows
            .iter()
            .enumerate()
            .any(|(i, &r)| success(r) && !keys.contains(&&acting[i]));
        if keys.is_empty() || (keys.len() == 1 && !others) {
            out_members.push(rows.clone());
            out_centroids.push(centroid.clone());
            continue;
        }
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); keys.len() + 1];
        for (i, &r) in rows.iter().enumerate() {
            let group = match keys.iter().position(|k| **k == acting[i]) {
                Some(g) => g,
                None if success(r) => keys.len(),
                None => {
                    let jaccard = |k: &BTreeSet<String>| {
                        let union = k.union(&acting[i]).count().max(1);
                        k.intersection(&acting[i]).count() as f64 / union as f64
                    };
                    let mut best = 0;
                    for (g, k) in keys.iter().enumerate() {
                        if jaccard(k) > jaccard(keys[best]) + 1e-12 {
                            best = g;
                        }
                    }
                    best
                }
            };
            groups[group].push(r);
        }
        for group in groups.into_iter().filter(|g| !g.is_empty()) {
            out_centroids.push(crate::kmeans::mean_direction(&group, vectors));
            out_members.push(group);
        }
    }
    (out_members, out_centroids)
}

/// Merges the groups of one tenant that follow one procedure ([`procedure_parts`]). A merged
/// group takes the place of its first part, its rows in descending `similarity` (ties by
/// row), its centroid the normalised mean of its rows. The same input always gives the same
/// groups.
pub fn merge_by_procedure<'g>(
    members: &[Vec<usize>],
    centroids: &[Vec<f32>],
    vectors: &[Vec<f32>],
    similarity: &[f32],
    node: impl Fn(usize) -> &'g Node,
    roles: &ToolRoles,
    min_count: usize,
) -> (Vec<Vec<usize>>, Vec<Vec<f32>>) {
    let parts = procedure_parts(members, node, roles, min_count);
    let (mut out_members, mut out_centroids) = (Vec::new(), Vec::new());
    for part in parts {
        if let [g] = part[..] {
            out_members.push(members[g].clone());
            out_centroids.push(centroids[g].clone());
            continue;
        }
        let rows = merged_rows(&part, members, similarity);
        out_centroids.push(crate::kmeans::mean_direction(&rows, vectors));
        out_members.push(rows);
    }
    (out_members, out_centroids)
}

/// The rows of the groups `part` as one group, in descending `similarity` (ties by row).
pub fn merged_rows(part: &[usize], members: &[Vec<usize>], similarity: &[f32]) -> Vec<usize> {
    let mut rows: Vec<usize> = part.iter().flat_map(|&g| members[g].clone()).collect();
    rows.sort_by(|&a, &b| similarity[b].total_cmp(&similarity[a]).then(a.cmp(&b)));
    rows
}

/// Which groups of one tenant follow one procedure: a group's procedure is the non-empty set
/// of acting tools that a strict majority of its successes call, when at least `min_count`
/// (and 2) of them do; groups with the same procedure form one part (k-means parts episodes by
/// what they asked, and one procedure serves many askings). Groups without a procedure
/// (successes that only read, text actions, no majority) are parts alone. Parts list group
/// indices, in order of their first group.
pub fn procedure_parts<'g>(
    members: &[Vec<usize>],
    node: impl Fn(usize) -> &'g Node,
    roles: &ToolRoles,
    min_count: usize,
) -> Vec<Vec<usize>> {
    let procedure = |rows: &[usize]| -> Option<BTreeSet<String>> {
        let successes: Vec<usize> = rows
            .iter()
            .copied()
            .filter(|&r| counts_as_success(node(r)))
            .collect();
        let mut counts: BTreeMap<BTreeSet<String>, usize> = BTreeMap::new();
        for &r in &successes {
            *counts.entry(acting_tools(node(r), roles)).or_default() += 1;
        }
        counts
            .into_iter()
            .find(|(set, n)| !set.is_empty() && 2 * n > successes.len() && *n >= min_count.max(2))
            .map(|(set, _)| set)
    };
    // Each output group: the input groups it holds, in order of the first.
    let mut parts: Vec<Vec<usize>> = Vec::new();
    let mut by_procedure: BTreeMap<BTreeSet<String>, usize> = BTreeMap::new();
    for (g, rows) in members.iter().enumerate() {
        match procedure(rows) {
            Some(set) => match by_procedure.get(&set) {
                Some(&out) => parts[out].push(g),
                None => {
                    by_procedure.insert(set, parts.len());
                    parts.push(vec![g]);
                }
            },
            None => parts.push(vec![g]),
        }
    }
    parts
}

/// How well an episode follows a skeleton's steps: the longest common subsequence of the
/// steps and the episode's signatures, over the number of steps (1 = every step, in order).
pub fn coverage(step_keys: &[&str], episode: &Node) -> f64 {
    let signed = signatures(episode);
    let keys: Vec<&str> = signed.iter().map(|s| s.key.as_str()).collect();
    coverage_of_keys(step_keys, &keys)
}

/// [`coverage`] over an episode's signature keys already computed.
pub fn coverage_of_keys(step_keys: &[&str], episode_keys: &[&str]) -> f64 {
    if step_keys.is_empty() {
        return 0.0;
    }
    lcs_len(step_keys, episode_keys) as f64 / step_keys.len() as f64
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use fluxmem_graph::{Episode, NodeBody, Outcome, Step, ToolCall};

    fn episode(task: &str, actions: &[&str], success: bool) -> Node {
        let steps = actions
            .iter()
            .map(|a| match a.strip_prefix("tool:") {
                Some(spec) => {
                    let (name, args) = spec.split_once(' ').unwrap_or((spec, "{}"));
                    let (args, result) = args
                        .split_once(" => ")
                        .map_or((args, None), |(a, r)| (a, Some(r.to_string())));
                    Step {
                        tool_calls: vec![ToolCall {
                            name: name.into(),
                            arguments: args.into(),
                            result,
                        }],
                        ..Step::default()
                    }
                }
                None => Step {
                    action: a.to_string(),
                    ..Step::default()
                },
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
            task,
            &[task, &actions.join("|"), &success.to_string()],
        )
    }

    /// The roles a tenant of these episodes would have.
    fn roles_of(successes: &[&Node], failures: &[&Node]) -> ToolRoles {
        ToolRoles::learn(successes.iter().chain(failures).copied())
    }

    #[test]
    fn text_actions_become_slotted_signatures() {
        let node = episode(
            "clean an apple",
            &[
                "think: where is it",
                "go to countertop 1",
                "take apple 1 from countertop 1",
                "clean apple 1 with sinkbasin 1",
            ],
            true,
        );
        let keys: Vec<String> = signatures(&node).into_iter().map(|s| s.key).collect();
        assert_eq!(
            keys,
            ["go to <1>", "take <1> from <2>", "clean <1> with <2>"]
        );
    }

    #[test]
    fn the_skeleton_keeps_shared_steps_with_support_and_constants() {
        let a = episode(
            "clean some apple and put it in fridge",
            &[
                "go to countertop 1",
                "take apple 1 from countertop 1",
                "go to sinkbasin 1",
                "clean apple 1 with sinkbasin 1",
                "go to fridge 1",
                "put apple 1 in/on fridge 1",
            ],
            true,
        );
        let b = episode(
            "clean some lettuce and put it in fridge",
            &[
                "go to diningtable 1",
                "take lettuce 1 from diningtable 1",
                "go to sinkbasin 1",
                "clean lettuce 1 with sinkbasin 1",
                "go to fridge 1",
                "put lettuce 1 in/on fridge 1",
            ],
            true,
        );
        let c = episode(
            "clean some egg and put it in fridge",
            &[
                "go to cabinet 2",
                "open cabinet 2",
                "go to countertop 2",
                "take egg 1 from countertop 2",
                "go to sinkbasin 1",
                "clean egg 1 with sinkbasin 1",
                "go to fridge 1",
                "put egg 1 in/on fridge 1",
            ],
            true,
        );
        let skeleton = mine(
            &[&a, &b, &c],
            &[],
            &MineOptions::default(),
            &roles_of(&[&a, &b, &c], &[]),
        )
        .unwrap();
        let texts: Vec<&str> = skeleton.steps.iter().map(|s| s.short.as_str()).collect();
        assert!(texts.contains(&"Take `object` from `source`."), "{texts:?}");
        assert!(
            texts.contains(&"Clean `object` with sinkbasin."),
            "constant slot shown: {texts:?}"
        );
        assert!(texts.contains(&"Put `object` in/on fridge."), "{texts:?}");
        assert!(
            !texts.iter().any(|t| t.starts_with("Open")),
            "one success of three is under the share: {texts:?}"
        );
        assert!(skeleton.steps.iter().all(|s| s.support >= 0.5));
        assert!(
            skeleton.decisions.iter().any(|d| d
                .paths
                .iter()
                .any(|p| p.steps == ["Open `object`."] && p.runs == 1 && d.runs == 3)),
            "the open is one run's path, its value not shown: {:#?}",
            skeleton.decisions
        );
        assert_eq!(skeleton.task_pattern, "clean some … and put it in fridge");
        // One request run twice is one user's message: no pattern.
        assert_eq!(task_pattern(&[&a, &a]), "");
        let take = texts.iter().position(|t| t.starts_with("Take")).unwrap();
        let clean = texts.iter().position(|t| t.starts_with("Clean")).unwrap();
        assert!(take < clean, "order kept");
    }

    #[test]
    fn failures_give_critical_steps_preconditions_and_pitfalls() {
        let ok1 = episode(
            "cancel",
            &[
                r#"tool:get_reservation_details {"reservation_id":"A1"}"#,
                r#"tool:cancel_reservation {"reservation_id":"A1"}"#,
            ],
            true,
        );
        let ok2 = episode(
            "cancel 2",
            &[
                r#"tool:get_user_details {"user_id":"u"}"#,
                r#"tool:get_reservation_details {"reservation_id":"B2"}"#,
                r#"tool:cancel_reservation {"reservation_id":"B2"}"#,
            ],
            true,
        );
        let bad = episode(
            "cancel 3",
            &[r#"tool:cancel_reservation {"reservation_id":"C3"} => Error: reservation not found"#],
            false,
        );
        let options = MineOptions {
            min_support: 0.75,
            ..MineOptions::default()
        };
        let skeleton = mine(
            &[&ok1, &ok2],
            &[&bad],
            &options,
            &roles_of(&[&ok1, &ok2], &[&bad]),
        )
        .unwrap();
        let texts: Vec<&str> = skeleton.steps.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "Call `get_reservation_details` with `reservation_id`.",
                "Call `cancel_reservation` with `reservation_id`."
            ]
        );
        assert!(skeleton.steps[0].critical && !skeleton.steps[1].critical);
        assert_eq!(
            skeleton.preconditions.len(),
            1,
            "{:?}",
            skeleton.preconditions
        );
        assert!(skeleton.preconditions[0].starts_with("Call `get_reservation_details`"));
        assert!(
            skeleton.pitfalls[0].contains("reservation not found"),
            "{:?}",
            skeleton.pitfalls
        );
        assert!(
            !texts.iter().any(|t| t.contains("A1") || t.contains("B2")),
            "instance values never shown"
        );
    }

    /// A tau-bench-like change: the user id from the task, the payment method from the user
    /// record, a scratchpad call with an empty result between them, and a loop over
    /// reservations in one run.
    fn change_run(user: &str, card: &str, reservations: &[&str], success: bool) -> Node {
        let task = format!("hi, i am {user} and i want to pay with my card");
        let profile = format!(
            r#"{{"name": "x", "payment_methods": [{{"id": "gift_card_1"}}, {{"id": "{card}"}}], "reservations": [{}]}}"#,
            reservations
                .iter()
                .map(|r| format!("\"{r}\""))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut actions = vec![
            format!(r#"tool:get_user_details {{"user_id":"{user}"}} => {profile}"#),
            r#"tool:think {"thought":"the user wants to pay"} => "#.to_string(),
        ];
        for r in reservations {
            actions.push(format!(
                r#"tool:get_reservation_details {{"reservation_id":"{r}"}} => {{"reservation_id": "{r}", "status": "ok"}}"#
            ));
        }
        actions.push(format!(
            r#"tool:pay_balance {{"payment_id":"{card}","reservation_id":"{}"}} => receipt"#,
            reservations[0]
        ));
        let refs: Vec<&str> = actions.iter().map(String::as_str).collect();
        episode(&task, &refs, success)
    }

    /// Checks a data-flow claim against an episode independently of `flow.rs`: the value of
    /// `slot` in the call of `tool` is a leaf at `path` of an earlier `source` result.
    fn holds(node: &Node, tool: &str, slot: &str, source: &str, path: &str) -> bool {
        let steps = &node.episode().unwrap().steps;
        let position = steps
            .iter()
            .position(|s| s.tool_calls.iter().any(|c| c.name == tool));
        let Some(position) = position else {
            return false;
        };
        let call = steps[position]
            .tool_calls
            .iter()
            .find(|c| c.name == tool)
            .unwrap();
        let arguments: serde_json::Value = serde_json::from_str(&call.arguments).unwrap();
        let value = &arguments[slot];
        let leaves = |result: &serde_json::Value| -> Vec<serde_json::Value> {
            let mut current = vec![result.clone()];
            for part in path.split('.') {
                let (key, all) = match part.strip_suffix("[*]") {
                    Some(key) => (key, true),
                    None => (part, false),
                };
                current = current
                    .iter()
                    .map(|v| v[key].clone())
                    .flat_map(|v| {
                        if all {
                            v.as_array().cloned().unwrap_or_default()
                        } else {
                            vec![v]
                        }
                    })
                    .collect();
            }
            current
        };
        steps[..position]
            .iter()
            .flat_map(|s| &s.tool_calls)
            .any(|c| {
                c.name == source
                    && c.result
                        .as_deref()
                        .and_then(|r| serde_json::from_str(r).ok())
                        .is_some_and(|r| leaves(&r).contains(value))
            })
    }

    #[test]
    fn steps_say_where_their_arguments_come_from_with_the_support_the_runs_give() {
        let runs = [
            change_run("mia_kim_11", "credit_card_42", &["ABC123"], true),
            change_run("noah_lee_22", "credit_card_17", &["QWE456", "ZXC789"], true),
            change_run("ava_cho_33", "credit_card_99", &["RTY321", "FGH654"], true),
        ];
        let refs: Vec<&Node> = runs.iter().collect();
        let skeleton = mine(&refs, &[], &MineOptions::default(), &roles_of(&refs, &[])).unwrap();
        let texts: Vec<&str> = skeleton.steps.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "Call `get_user_details` with `user_id` (from the user in 3 of 3 runs).",
                "For each `reservation_id`, call `get_reservation_details` with `reservation_id` (from `get_user_details` → `reservations[*]` in 3 of 3 runs).",
                "Call `pay_balance` with `payment_id` (from `get_user_details` → `payment_methods[*].id` in 3 of 3 runs), `reservation_id` (from `get_reservation_details` → `reservation_id` in 3 of 3 runs)."
            ],
            "{texts:#?}"
        );
        // The user record feeds both later steps, the reservation the payment.
        let feeds: Vec<&[usize]> = skeleton.steps.iter().map(|s| s.feeds.as_slice()).collect();
        assert_eq!(feeds, [&[1, 2][..], &[2][..], &[][..]]);
        // The scratchpad tool (every result empty, never used later) is not a step; the tool
        // whose results feed nothing is the acting one and names the procedure.
        assert!(!texts.iter().any(|t| t.contains("think")));
        assert_eq!(
            skeleton
                .steps
                .iter()
                .filter(|s| s.acting)
                .map(|s| s.tool.as_deref().unwrap())
                .collect::<Vec<_>>(),
            ["pay_balance"]
        );
        // Every claim of a result source holds in as many runs as it says.
        for (tool, slot, source, path, claimed) in [
            (
                "pay_balance",
                "payment_id",
                "get_user_details",
                "payment_methods[*].id",
                3,
            ),
            (
                "get_reservation_details",
                "reservation_id",
                "get_user_details",
                "reservations[*]",
                3,
            ),
        ] {
            let holding = runs
                .iter()
                .filter(|n| holds(n, tool, slot, source, path))
                .count();
            assert_eq!(holding, claimed, "{tool}.{slot} from {source} {path}");
        }
        // One success is not a procedure.
        assert!(mine(
            &refs[..1],
            &[],
            &MineOptions::default(),
            &roles_of(&refs[..1], &[])
        )
        .is_none());
    }

    /// A successful run of text commands with the observation before each (`(observation,
    /// action)`).
    pub(crate) fn observed(task: &str, steps: &[(&str, &str)]) -> Node {
        let actions: Vec<&str> = steps.iter().map(|(_, action)| *action).collect();
        let steps = steps
            .iter()
            .map(|(observation, action)| Step {
                observation: observation.to_string(),
                action: action.to_string(),
                ..Step::default()
            })
            .collect();
        succeeded(task, steps, &[task, &actions.join(";")])
    }

    /// A successful run of tenant `t` with `steps`, its id from `identity`.
    pub(crate) fn succeeded(task: &str, steps: Vec<Step>, identity: &[&str]) -> Node {
        let body = NodeBody::Episodic(Episode {
            steps,
            outcome: Outcome {
                success: Some(true),
                reward: None,
                feedback: None,
            },
        });
        Node::new(body, "t", task, identity)
    }

    #[test]
    fn text_commands_say_where_their_values_come_from_with_the_support_the_runs_give() {
        let run = |object: &str, place: &str| {
            observed(
                &format!("Your task is to: put some {object} on diningtable."),
                &[
                    (
                        &format!("You are in a room. You see a {place} 1 and a sofa 1."),
                        &format!("go to {place} 1"),
                    ),
                    (
                        &format!("On the {place} 1, you see a {object} 1."),
                        &format!("take {object} 1 from {place} 1"),
                    ),
                    (
                        &format!("You pick up the {object} 1."),
                        "go to diningtable 1",
                    ),
                    (
                        "On the diningtable 1, you see nothing.",
                        &format!("put {object} 1 in/on diningtable 1"),
                    ),
                ],
            )
        };
        let runs = [
            run("apple", "countertop"),
            run("egg", "cabinet"),
            run("mug", "shelf"),
        ];
        let refs: Vec<&Node> = runs.iter().collect();
        let skeleton = mine(&refs, &[], &MineOptions::default(), &roles_of(&refs, &[])).unwrap();
        let texts: Vec<&str> = skeleton.steps.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "Go to `place` (seen at the start in 3 of 3 runs).",
                "Take `object` (named in the task in 3 of 3 runs) from `source` (as in the last `go to` in 3 of 3 runs).",
                "Go to diningtable.",
                "Put `object` (as in the last `take` in 3 of 3 runs) in/on diningtable.",
            ],
            "{texts:#?}"
        );
        // Every claim holds in every run, checked on the raw text.
        for node in &runs {
            let steps = &node.episode().unwrap().steps;
            let word = |action: &str, at: usize| action.split(' ').nth(at).unwrap().to_string();
            let (place, object) = (word(&steps[0].action, 2), word(&steps[1].action, 1));
            assert!(steps[0].observation.contains(&place), "seen at the start");
            assert!(node.text.contains(&object), "named in the task");
            assert_eq!(word(&steps[1].action, 4), place, "as in the last go to");
            assert_eq!(word(&steps[3].action, 1), object, "as in the last take");
        }
        // The skill's step without data flow, as rules and the replay read it.
        assert_eq!(skeleton.steps[1].short, "Take `object` from `source`.");
    }

    #[test]
    fn the_called_tool_is_read_off_a_step() {
        assert_eq!(
            step_call("Call `get_order` with `order_id` (from the user in 2 of 2 runs)."),
            Some((
                "get_order",
                " with `order_id` (from the user in 2 of 2 runs)."
            ))
        );
        assert_eq!(
            step_call("For each `x`, call `fetch.page` with `x`.").map(|c| c.0),
            Some("fetch.page")
        );
        assert_eq!(step_call("Recall `x` later."), None);
        assert_eq!(step_call("Go to `place`."), None);
    }

    #[test]
    fn error_examples_lose_their_instance_data() {
        assert_eq!(
            instance_free("Error: flight HAT030 not available on date 2024-05-13."),
            "Error: flight … not available on date …."
        );
        assert_eq!(instance_free("not enough seats"), "not enough seats");
    }

    #[test]
    fn successes_without_a_shared_procedure_give_no_skeleton() {
        let a = episode("a", &["open drawer 1", "look"], true);
        let b = episode("b", &["inventory", "go to bed 1"], true);
        let c = episode("c", &["examine book 1", "use desklamp 1"], true);
        assert!(mine(
            &[&a, &b, &c],
            &[],
            &MineOptions::default(),
            &roles_of(&[&a, &b, &c], &[])
        )
        .is_none());
        assert!(mine(&[], &[&a], &MineOptions::default(), &roles_of(&[], &[&a])).is_none());
    }

    /// A call of `name` on one id: readers (`get_`) return what the next call takes (the id),
    /// acting tools a receipt. The roles are learned from that, not from the names.
    fn call(name: &str) -> String {
        let result = if name.starts_with("get_") {
            r#"{"id": "r-100"}"#
        } else {
            "done"
        };
        format!(r#"tool:{name} {{"id":"r-100"}} => {result}"#)
    }

    #[test]
    fn clusters_split_by_the_acting_tools_of_their_successes() {
        let nodes = [
            episode(
                "cancel 1",
                &[
                    &call("get_reservation_details"),
                    &call("cancel_reservation"),
                ],
                true,
            ),
            episode(
                "change 1",
                &[
                    &call("get_reservation_details"),
                    &call("update_reservation_flights"),
                ],
                true,
            ),
            episode(
                "cancel 2",
                &[&call("get_user_details"), &call("cancel_reservation")],
                true,
            ),
            episode(
                "change 2",
                &[
                    &call("get_user_details"),
                    &call("update_reservation_flights"),
                ],
                true,
            ),
            episode(
                "change 3",
                &[
                    &call("update_reservation_flights"),
                    &call("send_certificate"),
                ],
                false,
            ),
            episode("odd", &[&call("book_reservation")], true),
        ];
        let vectors: Vec<Vec<f32>> = (0..nodes.len()).map(|i| vec![1.0, i as f32]).collect();
        let roles = ToolRoles::learn(nodes.iter());
        let (members, centroids) = split_by_procedure(
            &[vec![0, 1, 2, 3, 4, 5]],
            &[vec![1.0, 0.0]],
            &vectors,
            |r| &nodes[r],
            &roles,
            2,
        );
        assert_eq!(
            members,
            vec![vec![0, 2], vec![1, 3, 4], vec![5]],
            "cancel, change (with the failure that changed), the rest"
        );
        assert_eq!(centroids.len(), 3);
        assert!(centroids
            .iter()
            .all(|c| (c.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-5));
        // One procedure only: left alone.
        let (same, _) = split_by_procedure(
            &[vec![0, 2]],
            &[vec![1.0, 0.0]],
            &vectors,
            |r| &nodes[r],
            &roles,
            2,
        );
        assert_eq!(same, vec![vec![0, 2]]);
        // One procedure that two successes share and a success that does something else: split.
        let (one, _) = split_by_procedure(
            &[vec![0, 2, 5]],
            &[vec![1.0, 0.0]],
            &vectors,
            |r| &nodes[r],
            &roles,
            2,
        );
        assert_eq!(one, vec![vec![0, 2], vec![5]]);
    }

    #[test]
    fn merge_by_procedure_joins_the_groups_of_one_procedure() {
        let nodes = [
            episode(
                "cancel a",
                &[&call("get_booking"), &call("cancel_booking")],
                true,
            ),
            episode("cancel b", &[&call("cancel_booking")], true),
            episode("read", &[&call("get_booking")], true),
            episode(
                "cancel c",
                &[&call("get_booking"), &call("cancel_booking")],
                true,
            ),
            episode("cancel d", &[&call("cancel_booking")], true),
            episode("cancel e", &[&call("cancel_booking")], false),
            episode("move", &[&call("move_booking")], true),
            episode("move 2", &[&call("move_booking")], true),
        ];
        let vectors: Vec<Vec<f32>> = (0..nodes.len()).map(|i| vec![1.0, i as f32]).collect();
        let similarity: Vec<f32> = (0..nodes.len()).map(|i| 1.0 - i as f32 / 10.0).collect();
        let roles = ToolRoles::learn(nodes.iter());
        let groups = [vec![0, 1], vec![2], vec![3, 4, 5], vec![6, 7]];
        let centroids = vec![vec![1.0, 0.0]; groups.len()];
        let (members, merged) = merge_by_procedure(
            &groups,
            &centroids,
            &vectors,
            &similarity,
            |r| &nodes[r],
            &roles,
            2,
        );
        assert_eq!(
            members,
            vec![vec![0, 1, 3, 4, 5], vec![2], vec![6, 7]],
            "the two cancel groups are one, in the first's place; the reader and move stay"
        );
        assert_eq!(merged.len(), 3);
        assert_eq!(
            merged[1], centroids[1],
            "a group left alone keeps its centroid"
        );
        // Under two successes of a procedure, or no majority: no merge.
        let (alone, _) = merge_by_procedure(
            &[vec![0], vec![1]],
            &centroids[..2],
            &vectors,
            &similarity,
            |r| &nodes[r],
            &roles,
            2,
        );
        assert_eq!(alone, vec![vec![0], vec![1]]);
        let (split_vote, _) = merge_by_procedure(
            &[vec![0, 1], vec![3, 6, 7, 4]],
            &centroids[..2],
            &vectors,
            &similarity,
            |r| &nodes[r],
            &roles,
            2,
        );
        assert_eq!(
            split_vote,
            vec![vec![0, 1], vec![3, 6, 7, 4]],
            "2 of 4 is no majority"
        );
    }

    #[test]
    fn lcs_len_counts_the_common_subsequence() {
        assert_eq!(lcs_len(&["a", "b", "c", "d"], &["b", "d", "a"]), 2);
        assert_eq!(lcs_len(&[], &["a"]), 0);
    }

    #[test]
    fn coverage_is_the_in_order_share_of_steps() {
        let node = episode(
            "x",
            &[
                "go to sinkbasin 1",
                "take apple 1 from sinkbasin 1",
                "clean apple 1 with sinkbasin 1",
            ],
            true,
        );
        assert_eq!(coverage(&["go to <1>", "clean <1> with <2>"], &node), 1.0);
        assert_eq!(coverage(&["clean <1> with <2>", "go to <1>"], &node), 0.5);
        assert_eq!(coverage(&[], &node), 0.0);
    }
}
