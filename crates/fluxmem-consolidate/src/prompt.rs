//! The prompts of Stage III and the serialisation of episodes under a token budget.

use fluxmem_graph::Node;
use fluxmem_models::{ChatMessage, Generator};

use crate::Result;

/// Characters of a single action or tool argument shown to the model.
const MAX_ACTION_CHARS: usize = 160;
/// Actions shown per episode at most.
const MAX_ACTIONS: usize = 30;

pub(crate) const SYSTEM: &str = "You write reusable skills for AI agents: short, general step-by-step procedures learned from past task logs.";

const FORMAT: &str = "Answer in exactly this format and nothing else:\n\
Name: <a short name for the skill>\n\
Description: <one sentence: when to use this skill>\n\
Steps:\n\
1. <first step>\n\
2. <next step>\n\
(3 to 8 steps; general, without object numbers or ids)";

/// The outcome label shown to the model.
pub fn outcome_label(node: &Node) -> &'static str {
    match node.episode().and_then(|e| e.outcome.success) {
        Some(true) => "success",
        Some(false) => "failure",
        None => "outcome unknown",
    }
}

/// An episode as the model sees it: the task, then the actions and tool calls.
pub fn episode_text(node: &Node) -> String {
    let mut text = format!("Task: {}\nActions:", clip(node.text.trim(), 600));
    let mut shown = 0;
    for step in node.episode().into_iter().flat_map(|e| &e.steps) {
        if shown == MAX_ACTIONS {
            text.push_str("\n- ...");
            break;
        }
        let action = step.action.trim();
        let mut line = String::new();
        if !action.is_empty() {
            line.push_str(&clip(action, MAX_ACTION_CHARS));
        }
        for call in &step.tool_calls {
            if !line.is_empty() {
                line.push_str("; ");
            }
            line.push_str(&format!("{}({})", call.name, clip(&call.arguments, MAX_ACTION_CHARS)));
        }
        if !line.is_empty() {
            text.push_str("\n- ");
            text.push_str(&line);
            shown += 1;
        }
    }
    text
}

/// The episodes, most representative first, as numbered blocks with their outcomes, while
/// they fit in `budget` tokens of `generator` (the first one is always shown, cut if needed).
pub fn serialize_episodes(episodes: &[&Node], budget: usize, show_outcome: bool, generator: &dyn Generator) -> Result<(String, usize)> {
    let mut out = String::new();
    let mut used = 0;
    let mut shown = 0;
    for (i, node) in episodes.iter().enumerate() {
        let outcome = if show_outcome { format!(" ({})", outcome_label(node)) } else { String::new() };
        let mut block = format!("Episode {}{}:\n{}\n\n", i + 1, outcome, episode_text(node));
        let mut tokens = generator.count_tokens(&block)?;
        if used + tokens > budget {
            if shown > 0 {
                break;
            }
            // Cut the first episode to the budget (by characters, a safe over-estimate of tokens).
            block = format!("{}\n...\n\n", clip(&block, budget.saturating_mul(3)));
            tokens = generator.count_tokens(&block)?;
        }
        out.push_str(&block);
        used += tokens;
        shown += 1;
    }
    Ok((out, shown))
}

fn clip(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_string(),
    }
}

/// First induction of a skill from a cluster.
pub fn induce(episodes: &str) -> Vec<ChatMessage> {
    let user = format!(
        "Here are logs of similar tasks done by an agent, with their outcomes.\n\n{episodes}\
         Write one reusable skill that would help the agent do tasks like these: follow what the successful \
         episodes did and avoid what the failed ones did.\n{FORMAT}"
    );
    vec![ChatMessage::new("system", SYSTEM), ChatMessage::new("user", user)]
}

/// A new version of an existing skill from the cluster's episodes (old and new).
pub fn update(previous: &str, episodes: &str) -> Vec<ChatMessage> {
    let user = format!(
        "An agent has this skill:\n\n{previous}\n\nHere are logs of tasks of this kind, including new ones, with their outcomes.\n\n\
         {episodes}Update the skill so it covers these tasks: keep what still holds, fix what the logs contradict.\n{FORMAT}"
    );
    vec![ChatMessage::new("system", SYSTEM), ChatMessage::new("user", user)]
}

/// The repair prompt after unparseable output.
pub fn repair(mut messages: Vec<ChatMessage>, raw: &str, problem: &str) -> Vec<ChatMessage> {
    messages.push(ChatMessage::new("assistant", raw));
    messages.push(ChatMessage::new(
        "user",
        format!("That answer could not be read ({problem}). Write the skill again.\n{FORMAT}"),
    ));
    messages
}

/// A rewrite of the current version for the next PEMS round.
pub fn rewrite(current: &str, eta: f64, length: usize, disagreements: &str) -> Vec<ChatMessage> {
    let evidence = if disagreements.is_empty() {
        String::new()
    } else {
        format!("It does not fit these logged episodes well:\n\n{disagreements}")
    };
    let user = format!(
        "Here is a skill for an agent:\n\n{current}\n\nIt agrees with {:.0}% of the episodes it was learned from and is {length} tokens long. \
         {evidence}Rewrite it to be more accurate and more concise: keep the steps that matter, drop the rest.\n{FORMAT}",
        eta * 100.0
    );
    vec![ChatMessage::new("system", SYSTEM), ChatMessage::new("user", user)]
}

/// The judge's query for replaying `skill` against one episode.
pub fn judge_query(skill: &str) -> String {
    format!("Would an agent following this skill act as in the episode below?\nSkill:\n{skill}")
}
