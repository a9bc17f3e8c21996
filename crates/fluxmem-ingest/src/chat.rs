//! What chat-shaped logs share (tau-bench runs, OpenAI-style chat logs): the tool-call shape,
//! matching a tool message to the call it answers, and observations built from messages.

use fluxmem_graph::Step;
use serde::Deserialize;
use serde_json::Value;

/// One message of a chat log; `C` is what its `content` may be (tau-bench: a string; OpenAI
/// chat logs: a string, null or a list of parts).
#[derive(Deserialize)]
pub(crate) struct Message<C> {
    pub role: String,
    #[serde(default)]
    pub content: Option<C>,
    #[serde(default)]
    pub tool_calls: Option<Vec<Call>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

/// A JSON scalar as text: a string as it is, anything else as JSON (`7`, `true`).
pub(crate) fn scalar_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// One entry of an assistant message's `tool_calls`.
#[derive(Deserialize)]
pub(crate) struct Call {
    #[serde(default)]
    pub id: Option<String>,
    pub function: Function,
}

/// The called function.
#[derive(Deserialize)]
pub(crate) struct Function {
    pub name: String,
    #[serde(default)]
    pub arguments: Value,
}

/// Puts a tool result on the call that asked for it: the latest open call whose id (from
/// `call_ids`, per step in the order of its `tool_calls`) is `tool_call_id`, else (no id
/// logged) the latest open call named `name`. A result starting with `Error` is also the step's
/// feedback. A result that answers no open call is left to the observation only.
pub(crate) fn attach_result(
    steps: &mut [Step],
    call_ids: &[Vec<Option<String>>],
    tool_call_id: Option<&str>,
    name: Option<&str>,
    content: &str,
) {
    let open_call = |by_id: bool, steps: &[Step]| -> Option<(usize, usize)> {
        (0..steps.len()).rev().find_map(|s| {
            steps[s]
                .tool_calls
                .iter()
                .enumerate()
                .rev()
                .find_map(|(c, call)| {
                    let matches = if by_id {
                        tool_call_id.is_some()
                            && call_ids
                                .get(s)
                                .and_then(|i| i.get(c))
                                .and_then(|id| id.as_deref())
                                == tool_call_id
                    } else {
                        tool_call_id.is_none() && Some(call.name.as_str()) == name
                    };
                    (call.result.is_none() && matches).then_some((s, c))
                })
        })
    };
    if let Some((s, c)) = open_call(true, steps).or_else(|| open_call(false, steps)) {
        steps[s].tool_calls[c].result = Some(content.to_string());
        if content.starts_with("Error") {
            steps[s].feedback = Some(content.to_string());
        }
    }
}

/// Appends `text` to an observation, one message a line.
pub(crate) fn push_observation(observation: &mut String, text: &str) {
    if !observation.is_empty() {
        observation.push('\n');
    }
    observation.push_str(text);
}
