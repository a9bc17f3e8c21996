//! OpenInference (Arize Phoenix) spans read as GenAI ones: the attributes of a span with
//! `openinference.span.kind` and no `gen_ai.operation.name` are rewritten onto the GenAI
//! semantic conventions `otel.rs` reads, so one episode model serves both
//! (docs/formats/otel.md has the table):
//!
//! | OpenInference | GenAI |
//! |---|---|
//! | `openinference.span.kind` `AGENT` / `LLM` / `TOOL` | `gen_ai.operation.name` `invoke_agent` / `chat` / `execute_tool` |
//! | `llm.input_messages.<i>.message.*` (`system` role) | `gen_ai.system_instructions` |
//! | `llm.input_messages.<i>.message.*` (other roles) | `gen_ai.input.messages` |
//! | `llm.output_messages.<i>.message.*` | `gen_ai.output.messages` |
//! | `message.content`, `message.contents.<j>.message_content.text` | `text` parts |
//! | `message.tool_calls.<k>.tool_call.{id, function.name, function.arguments}` | `tool_call` parts |
//! | `message.tool_call_id` with the content (`tool` role) | a `tool_call_response` part |
//! | `tool.name`, else `tool_call.function.name` | `gen_ai.tool.name` |
//! | `tool_call.function.arguments`, else `input.value` (a `TOOL` span) | `gen_ai.tool.call.arguments` |
//! | `output.value` (a `TOOL` span) | `gen_ai.tool.call.result` |
//! | `tool_call.id` | `gen_ai.tool.call.id` |
//! | `input.value` of an `AGENT` span, as text | its user message (the task) |
//! | `agent.name` | `gen_ai.agent.name` |
//! | `session.id` | `gen_ai.conversation.id` |
//!
//! Other span kinds (`CHAIN`, `RETRIEVER`, `EMBEDDING`, ...) carry no step: a trace of only
//! those is quarantined with its kinds named, never read as an empty episode.

use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// `attributes` on the GenAI conventions when they are OpenInference's; unchanged otherwise.
pub(crate) fn as_gen_ai(mut attributes: BTreeMap<String, Value>) -> BTreeMap<String, Value> {
    if attributes.contains_key("gen_ai.operation.name") {
        return attributes;
    }
    let Some(kind) = attributes
        .get("openinference.span.kind")
        .and_then(Value::as_str)
        .map(str::to_ascii_uppercase)
    else {
        return attributes;
    };
    let text = |key: &str| attributes.get(key).and_then(Value::as_str);
    let value = |key: &str| attributes.get(key).cloned();
    let string = |key: &str| text(key).map(Value::from);
    // The GenAI attributes the span gets, computed from its own; one it already has is kept.
    let mut mapped: Vec<(&str, Option<Value>)> = vec![
        ("gen_ai.conversation.id", string("session.id")),
        ("gen_ai.agent.name", string("agent.name")),
    ];
    match kind.as_str() {
        "LLM" => {
            let (system, input) = messages(&attributes, "llm.input_messages.");
            let (_, output) = messages(&attributes, "llm.output_messages.");
            mapped.extend([
                ("gen_ai.operation.name", Some(json!("chat"))),
                (
                    "gen_ai.system_instructions",
                    (!system.is_empty()).then_some(Value::Array(system)),
                ),
                ("gen_ai.input.messages", Some(Value::Array(input))),
                ("gen_ai.output.messages", Some(Value::Array(output))),
            ]);
        }
        "TOOL" => mapped.extend([
            ("gen_ai.operation.name", Some(json!("execute_tool"))),
            (
                "gen_ai.tool.name",
                string("tool.name").or_else(|| string("tool_call.function.name")),
            ),
            (
                "gen_ai.tool.call.arguments",
                value("tool_call.function.arguments").or_else(|| value("input.value")),
            ),
            ("gen_ai.tool.call.result", value("output.value")),
            ("gen_ai.tool.call.id", value("tool_call.id")),
        ]),
        "AGENT" => {
            // The agent's input, when it is text (not a JSON document), is what the user asked.
            let plain = text("input.mime_type").is_none_or(|mime| mime.starts_with("text/"));
            let task = text("input.value")
                .filter(|task| plain && !task.trim().is_empty())
                .map(
                    |task| json!([{"role": "user", "parts": [{"type": "text", "content": task}]}]),
                );
            mapped.extend([
                ("gen_ai.operation.name", Some(json!("invoke_agent"))),
                ("gen_ai.input.messages", task),
            ]);
        }
        _ => {}
    }
    for (key, value) in mapped {
        if let Some(value) = value {
            attributes.entry(key.to_string()).or_insert(value);
        }
    }
    attributes
}

/// The messages flattened under `prefix` (`llm.input_messages.`), in index order, as GenAI
/// messages: the text parts of `system` ones, and the other messages.
fn messages(attributes: &BTreeMap<String, Value>, prefix: &str) -> (Vec<Value>, Vec<Value>) {
    // index -> field under `message.` -> value
    let mut by_index: BTreeMap<usize, BTreeMap<&str, &Value>> = BTreeMap::new();
    for (key, value) in attributes.range(prefix.to_string()..) {
        let Some(rest) = key.strip_prefix(prefix) else {
            break;
        };
        let Some((index, field)) = rest.split_once('.') else {
            continue;
        };
        let (Ok(index), Some(field)) = (index.parse::<usize>(), field.strip_prefix("message."))
        else {
            continue;
        };
        by_index.entry(index).or_default().insert(field, value);
    }
    let (mut system, mut other) = (Vec::new(), Vec::new());
    for fields in by_index.values() {
        let role = fields.get("role").and_then(|v| v.as_str()).unwrap_or("");
        let parts = parts(fields);
        if role == "system" {
            system.extend(parts);
        } else {
            other.push(json!({"role": role, "parts": parts}));
        }
    }
    (system, other)
}

/// One message's parts: its text, its contents' texts, its tool calls, and, for a tool's
/// message, the response to the call it names.
fn parts(fields: &BTreeMap<&str, &Value>) -> Vec<Value> {
    let text = |key: &str| fields.get(key).and_then(|v| v.as_str());
    let mut parts = Vec::new();
    if let (Some(id), Some(content)) = (text("tool_call_id"), text("content")) {
        parts.push(json!({"type": "tool_call_response", "id": id, "response": content}));
        return parts;
    }
    if let Some(content) = text("content").filter(|c| !c.is_empty()) {
        parts.push(json!({"type": "text", "content": content}));
    }
    // `contents.<j>.message_content.*` and `tool_calls.<k>.tool_call.*`, by index.
    let mut contents: BTreeMap<usize, Map<String, Value>> = BTreeMap::new();
    let mut calls: BTreeMap<usize, Map<String, Value>> = BTreeMap::new();
    for (field, value) in fields {
        let indexed = |prefix: &str, inner: &str| {
            let rest = field.strip_prefix(prefix)?;
            let (index, name) = rest.split_once('.')?;
            Some((
                index.parse::<usize>().ok()?,
                name.strip_prefix(inner)?.to_string(),
            ))
        };
        if let Some((j, name)) = indexed("contents.", "message_content.") {
            contents
                .entry(j)
                .or_default()
                .insert(name, (*value).clone());
        } else if let Some((k, name)) = indexed("tool_calls.", "tool_call.") {
            calls.entry(k).or_default().insert(name, (*value).clone());
        }
    }
    for content in contents.values() {
        let is_text = content
            .get("type")
            .and_then(Value::as_str)
            .is_none_or(|t| t == "text");
        if let Some(text) = content
            .get("text")
            .and_then(Value::as_str)
            .filter(|_| is_text)
        {
            parts.push(json!({"type": "text", "content": text}));
        }
    }
    for call in calls.values() {
        let mut part = json!({
            "type": "tool_call",
            "name": call.get("function.name").cloned().unwrap_or(Value::from("")),
            "arguments": call.get("function.arguments").cloned().unwrap_or(Value::Null),
        });
        if let Some(id) = call.get("id") {
            part["id"] = id.clone();
        }
        parts.push(part);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attributes(pairs: &[(&str, &str)]) -> BTreeMap<String, Value> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), Value::from(*v)))
            .collect()
    }

    #[test]
    fn llm_messages_become_gen_ai_messages_in_index_order() {
        let mapped = as_gen_ai(attributes(&[
            ("openinference.span.kind", "LLM"),
            ("llm.input_messages.0.message.role", "system"),
            ("llm.input_messages.0.message.content", "Be brief."),
            ("llm.input_messages.1.message.role", "user"),
            ("llm.input_messages.1.message.content", "Refund A-1"),
            ("llm.input_messages.10.message.role", "tool"),
            ("llm.input_messages.10.message.tool_call_id", "c1"),
            ("llm.input_messages.10.message.content", "{\"ok\":true}"),
            ("llm.input_messages.2.message.role", "assistant"),
            (
                "llm.input_messages.2.message.tool_calls.0.tool_call.id",
                "c1",
            ),
            (
                "llm.input_messages.2.message.tool_calls.0.tool_call.function.name",
                "get",
            ),
            (
                "llm.input_messages.2.message.tool_calls.0.tool_call.function.arguments",
                "{}",
            ),
            ("llm.output_messages.0.message.role", "assistant"),
            (
                "llm.output_messages.0.message.contents.0.message_content.type",
                "text",
            ),
            (
                "llm.output_messages.0.message.contents.0.message_content.text",
                "Done.",
            ),
            ("session.id", "s-1"),
        ]));
        assert_eq!(mapped["gen_ai.operation.name"], "chat");
        assert_eq!(mapped["gen_ai.conversation.id"], "s-1");
        assert_eq!(
            mapped["gen_ai.system_instructions"],
            json!([{"type": "text", "content": "Be brief."}])
        );
        let input = mapped["gen_ai.input.messages"].as_array().unwrap();
        let roles: Vec<&str> = input.iter().map(|m| m["role"].as_str().unwrap()).collect();
        // Index 10 sorts after 2 (numeric order, not the keys' text order).
        assert_eq!(roles, ["user", "assistant", "tool"]);
        assert_eq!(input[1]["parts"][0]["name"], "get");
        assert_eq!(input[2]["parts"][0]["type"], "tool_call_response");
        assert_eq!(input[2]["parts"][0]["id"], "c1");
        assert_eq!(
            mapped["gen_ai.output.messages"][0]["parts"][0]["content"],
            "Done."
        );
    }

    #[test]
    fn gen_ai_spans_and_spans_of_other_kinds_are_left_as_they_are() {
        let gen_ai = attributes(&[
            ("gen_ai.operation.name", "chat"),
            ("openinference.span.kind", "TOOL"),
            ("tool.name", "x"),
        ]);
        assert_eq!(as_gen_ai(gen_ai.clone()), gen_ai);
        let chain = attributes(&[("openinference.span.kind", "CHAIN"), ("input.value", "q")]);
        assert!(!as_gen_ai(chain).contains_key("gen_ai.operation.name"));
    }
}
