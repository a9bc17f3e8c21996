//! Step replay: what an agent does next, given a task and the steps so far, with or without a
//! skill. Shared by `fluxmem eval skills --replay` and by eta with a replay model
//! (`consolidate --eta replay:MODEL`), so that the score a skill is matured on is the score it
//! is evaluated on.
//!
//! - [`steps_of`]: the tool calls of a logged episode, each with the task and the history before
//!   it (messages and results clipped to `history_chars`, the most recent kept). An episode
//!   that calls no tool acts by text commands (`take apple 1 from countertop 2`): its commands
//!   are its steps, each read as its pattern (the command's verb and prepositions, `take <1>
//!   from <2>`, as mining reads it) with the slots' values as its arguments (`1`: `apple`);
//! - [`system_prompt`] / [`conversation`]: the tool list (names and argument keys) and the
//!   command patterns, both from the logs ([`tool_list`]), and one step's prompt, the skill's
//!   text added to the system prompt when given;
//! - [`parse_action`]: the first JSON object of a reply, as a tool call, a command or a
//!   message;
//! - [`score`]: the right tool (or command pattern); the right tool with exactly the right
//!   argument keys (the **step accuracy**; for a command, its pattern); and the share of the
//!   call's argument values that the history contains and the reply gives exactly;
//! - [`step_accuracy`]: the mean step accuracy of a model over steps, with a skill or without.
//!
//! A logged call is only the answer a step is scored against; nothing of it reaches the prompt
//! of its own step.

use fluxmem_graph::Node;
use fluxmem_models::{ChatMessage, GenerateParams, Generator};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};

use crate::Result;

/// A logged call to predict.
#[derive(Debug, Clone)]
pub struct ReplayStep {
    /// Index of the episode it came from (in the caller's list).
    pub episode: usize,
    /// The episode's task, clipped.
    pub task: String,
    /// What came before the call, clipped.
    pub history: String,
    /// The tool the episode called.
    pub tool: String,
    /// Its arguments.
    pub arguments: Map<String, Value>,
    /// Tools the episode called before it.
    pub called: Vec<String>,
}

/// A predicted action.
#[derive(Debug, Clone, PartialEq)]
pub struct Action {
    /// The tool called; empty for a message to the user.
    pub tool: String,
    /// Its arguments.
    pub arguments: Map<String, Value>,
}

/// One step's score.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepScore {
    /// The right tool.
    pub tool: bool,
    /// The right tool with exactly the right argument keys.
    pub args: bool,
    /// (values given exactly, values the history contains).
    pub values: (usize, usize),
}

/// The arguments of a logged call (a JSON object; anything else has none).
pub fn arguments(text: &str) -> Map<String, Value> {
    serde_json::from_str::<Map<String, Value>>(text).unwrap_or_default()
}

/// What the logged episodes act with: tools (with the union of each one's argument keys) and
/// text command patterns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tools {
    /// Every tool called, with its argument keys.
    pub calls: BTreeMap<String, BTreeSet<String>>,
    /// Every command pattern of the episodes that call no tool (`take <1> from <2>`).
    pub commands: BTreeSet<String>,
}

/// Every tool the episodes call, with the union of its argument keys, and the command patterns
/// of the episodes that call none.
pub fn tool_list<'g>(episodes: impl IntoIterator<Item = &'g Node>) -> Tools {
    let mut tools = Tools::default();
    for node in episodes {
        let Some(episode) = node.episode() else {
            continue;
        };
        if acts_by_commands(node) {
            for step in &episode.steps {
                if let Some((pattern, _)) = command(&step.action) {
                    tools.commands.insert(pattern);
                }
            }
            continue;
        }
        for call in episode.steps.iter().flat_map(|s| &s.tool_calls) {
            let keys = arguments(&call.arguments)
                .keys()
                .cloned()
                .collect::<Vec<_>>();
            tools
                .calls
                .entry(call.name.clone())
                .or_default()
                .extend(keys);
        }
    }
    tools
}

/// The system prompt: the tools, the command patterns, and the answer format.
pub fn system_prompt(tools: &Tools) -> String {
    let mut text = String::from("You are an agent that completes the user's task");
    let mut forms = Vec::new();
    if !tools.calls.is_empty() || tools.commands.is_empty() {
        text.push_str(" with tools. The tools and their argument keys:\n");
        for (tool, keys) in &tools.calls {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            text.push_str(&format!("- {tool}({})\n", keys.join(", ")));
        }
        forms.push("{\"tool\": \"<name>\", \"arguments\": {...}} to call a tool");
    }
    if !tools.commands.is_empty() {
        text.push_str(if tools.calls.is_empty() {
            " with text commands."
        } else {
            "\nIt may also act with text commands."
        });
        text.push_str(
            " The commands of earlier runs (<1>, <2>: an object or a place, named as the observations name it, number included):\n",
        );
        for pattern in &tools.commands {
            text.push_str(&format!("- {pattern}\n"));
        }
        forms.push("{\"action\": \"<command>\"} to run a command");
    }
    forms.push("{\"message\": \"<text>\"} to write to the user");
    text.push_str(&format!(
        "\nAnswer with the next action only, as one line of JSON: {}.",
        forms.join(", or ")
    ));
    text
}

/// The episode calls no tool and takes at least one text command: it acts by commands.
fn acts_by_commands(node: &Node) -> bool {
    node.episode().is_some_and(|e| {
        e.steps.iter().all(|s| s.tool_calls.is_empty())
            && e.steps.iter().any(|s| command(&s.action).is_some())
    })
}

/// A text command as its pattern (`take <1> from <2>`) and its slots' values as arguments
/// (`1`, `2`, ...; instance numbers are not part of them); `None` for a thought, free text
/// or nothing.
pub fn command(action: &str) -> Option<(String, Map<String, Value>)> {
    let signed = crate::mine::command_signature(action)?;
    let arguments = signed
        .slots
        .iter()
        .zip(&signed.values)
        .map(|(slot, value)| (slot.clone(), Value::from(value.clone())))
        .collect();
    Some((signed.key, arguments))
}

/// One step's prompt; `skill`: a skill's text, added to the system prompt.
pub fn conversation(system: &str, step: &ReplayStep, skill: Option<&str>) -> Vec<ChatMessage> {
    let mut system = system.to_string();
    if let Some(skill) = skill {
        system.push_str("\n\nA skill mined from earlier runs of tasks like this one:\n\n");
        system.push_str(skill);
    }
    vec![
        ChatMessage::new("system", system),
        ChatMessage::new(
            "user",
            format!(
                "Task: {}\n\nSo far:\n{}\n\nThe next action, as one line of JSON:",
                step.task, step.history
            ),
        ),
    ]
}

/// `text` trimmed to at most `chars` characters (an ellipsis marks a cut).
pub fn clip(text: &str, chars: usize) -> String {
    let text = text.trim();
    if text.chars().count() <= chars {
        return text.to_string();
    }
    text.chars().take(chars).collect::<String>() + "…"
}

/// The calls of one episode, each with the history before it (`index`: the episode's place in
/// the caller's list); the commands of an episode that acts by commands.
pub fn steps_of(index: usize, node: &Node, history_chars: usize) -> Vec<ReplayStep> {
    let Some(episode) = node.episode() else {
        return Vec::new();
    };
    let by_commands = acts_by_commands(node);
    let mut lines: Vec<String> = Vec::new();
    let mut called: Vec<String> = Vec::new();
    let mut out = Vec::new();
    let step_at = |lines: &[String], tool: String, arguments, called: &[String]| {
        let history = lines.join("\n");
        let start = history
            .char_indices()
            .rev()
            .nth(history_chars)
            .map_or(0, |(i, _)| i);
        ReplayStep {
            episode: index,
            task: clip(&node.text, 300),
            history: if start > 0 {
                format!("…{}", &history[start..])
            } else {
                history
            },
            tool,
            arguments,
            called: called.to_vec(),
        }
    };
    for step in &episode.steps {
        for line in step.observation.lines().filter(|l| !l.trim().is_empty()) {
            lines.push(clip(line, 160));
        }
        if by_commands {
            if let Some((pattern, slots)) = command(&step.action) {
                out.push(step_at(&lines, pattern.clone(), slots, &called));
                called.push(pattern);
            }
        }
        if !step.action.trim().is_empty() {
            lines.push(format!("[assistant] {}", clip(&step.action, 160)));
        }
        for call in &step.tool_calls {
            out.push(step_at(
                &lines,
                call.name.clone(),
                arguments(&call.arguments),
                &called,
            ));
            lines.push(format!(
                "[call] {} {}",
                call.name,
                clip(&call.arguments, 200)
            ));
            called.push(call.name.clone());
        }
    }
    out
}

/// The first JSON object in a reply, read as an action.
pub fn parse_action(reply: &str) -> Option<Action> {
    let start = reply.find('{')?;
    let value: Value = serde_json::Deserializer::from_str(&reply[start..])
        .into_iter::<Value>()
        .next()?
        .ok()?;
    let tool = match value.get("tool").or_else(|| value.get("name")) {
        Some(tool) => tool.as_str()?.to_string(),
        None => match value.get("action").or_else(|| value.get("command")) {
            Some(Value::String(text)) => {
                return Some(match command(text) {
                    Some((tool, arguments)) => Action { tool, arguments },
                    None => Action {
                        tool: String::new(),
                        arguments: Map::new(),
                    },
                });
            }
            // A message to the user: a readable action that calls no tool.
            _ if value.get("message").is_some() => String::new(),
            _ => return None,
        },
    };
    let arguments = match value.get("arguments").or_else(|| value.get("args")) {
        Some(Value::Object(map)) => map.clone(),
        Some(Value::String(text)) => arguments(text),
        _ => Map::new(),
    };
    Some(Action { tool, arguments })
}

/// Scores `action` (`None`: an unreadable reply) against the logged call.
pub fn score(step: &ReplayStep, action: Option<&Action>) -> StepScore {
    let history = step.history.to_lowercase();
    let traceable: Vec<(&String, &Value)> = step
        .arguments
        .iter()
        .filter(|(_, v)| {
            let text = match v {
                Value::String(s) => s.to_lowercase(),
                other => other.to_string(),
            };
            text.chars().count() >= crate::flow::MIN_TRACE_CHARS && history.contains(&text)
        })
        .collect();
    let Some(action) = action else {
        return StepScore {
            tool: false,
            args: false,
            values: (0, traceable.len()),
        };
    };
    let tool = action.tool == step.tool;
    let keys = |m: &Map<String, Value>| m.keys().cloned().collect::<BTreeSet<_>>();
    let args = tool && keys(&action.arguments) == keys(&step.arguments);
    let same = |a: &Value, b: &Value| match (a, b) {
        (Value::String(x), Value::String(y)) => x.trim().eq_ignore_ascii_case(y.trim()),
        _ => a == b,
    };
    let given = traceable
        .iter()
        .filter(|(k, v)| tool && action.arguments.get(*k).is_some_and(|p| same(p, v)))
        .count();
    StepScore {
        tool,
        args,
        values: (given, traceable.len()),
    }
}

/// The mean step accuracy of `generator` over `steps` (tools listed by `system`), with the
/// skill text `skill` or without; 0 for no steps. One prompt at a time (long prompts prefill
/// fastest that way on a CPU).
pub fn step_accuracy(
    steps: &[ReplayStep],
    system: &str,
    skill: Option<&str>,
    generator: &mut dyn Generator,
    params: &GenerateParams,
) -> Result<f64> {
    if steps.is_empty() {
        return Ok(0.0);
    }
    let mut right = 0usize;
    for step in steps {
        let reply = generator.generate(&conversation(system, step, skill), params)?;
        right += usize::from(score(step, parse_action(&reply.text).as_ref()).args);
    }
    Ok(right as f64 / steps.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluxmem_graph::{Episode, NodeBody, Outcome, Step};

    #[test]
    fn an_episode_of_text_commands_replays_its_commands() {
        let step = |observation: &str, action: &str| Step {
            observation: observation.into(),
            action: action.into(),
            ..Step::default()
        };
        let node = Node::new(
            NodeBody::Episodic(Episode {
                steps: vec![
                    step(
                        "You are in a room. You see a countertop 2.",
                        "go to countertop 2",
                    ),
                    step(
                        "On the countertop 2, you see an apple 1.",
                        "think: the apple is here.",
                    ),
                    step("OK.", "take apple 1 from countertop 2"),
                    step("You pick up the apple 1 from the countertop 2.", ""),
                ],
                outcome: Outcome {
                    success: Some(true),
                    reward: None,
                    feedback: None,
                },
            }),
            "t",
            "put an apple in the fridge",
            &["x"],
        );
        let steps = steps_of(0, &node, 1_500);
        let patterns: Vec<&str> = steps.iter().map(|s| s.tool.as_str()).collect();
        assert_eq!(
            patterns,
            ["go to <1>", "take <1> from <2>"],
            "the thought is no step"
        );
        assert!(
            !steps[1].history.contains("take apple"),
            "its own command is not shown"
        );
        assert!(steps[1].history.contains("[assistant] go to countertop 2"));
        assert_eq!(steps[1].called, ["go to <1>"]);
        let tools = tool_list([&node]);
        assert!(tools.calls.is_empty());
        let prompt = system_prompt(&tools);
        assert!(prompt.contains("- take <1> from <2>") && prompt.contains("\"action\""));
        assert!(!prompt.contains("\"tool\""), "no tool to call: {prompt}");
        // A reply with the command: its pattern and the value the history holds.
        let reply = r#"{"action": "take apple 1 from countertop 2"}"#;
        let s = score(&steps[1], parse_action(reply).as_ref());
        assert!(s.tool && s.args);
        assert_eq!(
            s.values,
            (2, 2),
            "apple and countertop are both in the history"
        );
        let s = score(
            &steps[1],
            parse_action(r#"{"action": "go to apple 1"}"#).as_ref(),
        );
        assert!(!s.tool && !s.args);
        let s = score(
            &steps[1],
            parse_action(r#"{"action": "take pear 1 from countertop 2"}"#).as_ref(),
        );
        assert!(s.tool && s.values == (1, 2));
    }

    #[test]
    fn replies_parse_and_score_tool_keys_and_traceable_values() {
        let step = ReplayStep {
            episode: 0,
            task: "cancel".into(),
            history: "[user] my id is mia_kim_11 and reservation ABC123".into(),
            tool: "cancel_reservation".into(),
            arguments: arguments(r#"{"reservation_id": "ABC123", "reason": "x"}"#),
            called: Vec::new(),
        };
        let reply = r#"Sure. {"tool": "cancel_reservation", "arguments": {"reservation_id": "abc123", "reason": "other"}} trailing"#;
        let s = score(&step, parse_action(reply).as_ref());
        assert!(s.tool && s.args);
        assert_eq!(
            s.values,
            (1, 1),
            "only ABC123 is in the history; it is given"
        );
        let wrong_keys = parse_action(
            r#"{"tool": "cancel_reservation", "arguments": "{\"reservation_id\": \"ABC123\"}"}"#,
        );
        let s = score(&step, wrong_keys.as_ref());
        assert!(s.tool && !s.args);
        assert_eq!(s.values, (1, 1));
        let s = score(&step, parse_action("I will cancel it.").as_ref());
        assert!(!s.tool && !s.args && s.values == (0, 1));
    }
}
