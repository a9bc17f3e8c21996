//! OpenAI-style chat logs: one conversation a line, `{"messages": [...]}` as logging proxies,
//! fine-tuning sets and most agent SDKs write them (docs/formats/openai-chat.md has the field
//! mapping).
//!
//! - One episode per conversation. The task is the first user message; each assistant
//!   message is a step (its text the action, its `tool_calls` the step's calls), and the user
//!   and tool messages before it are the step's observation. A tool message's content is the
//!   result of the call whose `id` its `tool_call_id` names (else of the latest open call of
//!   its `name`); a call without a result keeps none.
//! - `content` is a string, `null`, or a list of parts: `text` parts are joined, other parts
//!   (images, audio, files) are shown as `[image_url]` etc.
//! - System messages are chunked into semantic nodes shared by every conversation with the same
//!   prompt, as tau-bench's policies are.
//! - The outcome: a top-level `outcome` (`{"success", "reward", "feedback"}` or a boolean),
//!   else `metadata.success` / `metadata.reward`; none of them: outcome unknown.
//! - Tenant and agent: top-level `tenant` / `agent_id`, else `metadata.tenant` /
//!   `metadata.agent_id`, else the ingest options.
//! - Identity: a top-level `id` or `conversation_id` (or `metadata.conversation_id`) when
//!   there is one, else the hash of the messages; the same conversation logged twice is one
//!   episode.

use fluxmem_graph::{sha256_hex, Episode, NodeBody, Outcome, Step, ToolCall};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;

use crate::chat::{attach_result, push_observation, scalar_text};
use crate::jsonl::type_name;
use crate::source::{each_line, parse_at, Source};
use crate::{Parsed, Record};

#[derive(Deserialize)]
struct Conversation {
    messages: Vec<Message>,
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    conversation_id: Option<Value>,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    agent_id: Option<String>,
    #[serde(default)]
    outcome: Option<Value>,
    #[serde(default)]
    metadata: BTreeMap<String, Value>,
}

type Message = crate::chat::Message<Value>;

/// True when `line` (the first record of a `.jsonl` file) is a chat log, not fluxmem's schema.
pub(crate) fn looks_like(line: &str) -> bool {
    let Ok(Value::Object(object)) = serde_json::from_str::<Value>(line) else {
        return false;
    };
    object.get("messages").is_some_and(Value::is_array)
        && !object.contains_key("task")
        && !object.contains_key("steps")
}

/// Parses a chat-log file, one conversation per non-blank line.
pub(crate) fn parse(
    source: &Source,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    each_line(source, emit, |text, _, locator| {
        let conversation = parse_at::<Conversation>(text)?;
        Ok(Parsed::Record(self::conversation(
            source,
            locator,
            conversation,
        )?))
    })
}

/// The text of a message's `content`: a string, or its text parts joined (other parts named).
fn content_text(content: &Option<Value>, field: &str) -> Result<String, (String, String)> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out: Vec<String> = Vec::new();
            for (i, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
                match (kind, part.get("text")) {
                    ("text" | "input_text" | "output_text", Some(Value::String(text))) => {
                        out.push(text.clone())
                    }
                    ("text" | "input_text" | "output_text", _) => {
                        return Err((
                            format!("{field}[{i}].text"),
                            "a text part needs a string `text`".into(),
                        ))
                    }
                    (other, _) => out.push(format!("[{other}]")),
                }
            }
            Ok(out.join("\n"))
        }
        Some(other) => Err((
            field.into(),
            format!(
                "`content` must be a string, null or a list of parts, got {}",
                type_name(other)
            ),
        )),
    }
}

fn outcome(conversation: &Conversation) -> Result<Outcome, (String, String)> {
    let from_metadata = || Outcome {
        success: conversation
            .metadata
            .get("success")
            .and_then(Value::as_bool),
        reward: conversation.metadata.get("reward").and_then(Value::as_f64),
        feedback: None,
    };
    match &conversation.outcome {
        None | Some(Value::Null) => Ok(from_metadata()),
        Some(Value::Bool(success)) => Ok(Outcome {
            success: Some(*success),
            reward: None,
            feedback: None,
        }),
        Some(Value::Object(o)) => {
            let success = match o.get("success") {
                None | Some(Value::Null) => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(other) => {
                    return Err((
                        "outcome.success".into(),
                        format!("must be a boolean, got {}", type_name(other)),
                    ))
                }
            };
            let reward = match o.get("reward") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) => n.as_f64(),
                Some(other) => {
                    return Err((
                        "outcome.reward".into(),
                        format!("must be a number, got {}", type_name(other)),
                    ))
                }
            };
            let feedback = o
                .get("feedback")
                .and_then(Value::as_str)
                .map(str::to_string);
            Ok(Outcome {
                success,
                reward,
                feedback,
            })
        }
        Some(other) => Err((
            "outcome".into(),
            format!("must be an object or a boolean, got {}", type_name(other)),
        )),
    }
}

fn conversation(
    source: &Source,
    locator: &str,
    conversation: Conversation,
) -> Result<Record, (String, String)> {
    if conversation.messages.is_empty() {
        return Err((
            "messages".into(),
            "a conversation needs at least one message".into(),
        ));
    }
    let outcome = outcome(&conversation)?;
    let mut steps: Vec<Step> = Vec::new();
    // Per step, the ids of its calls (the same order as its `tool_calls`).
    let mut call_ids: Vec<Vec<Option<String>>> = Vec::new();
    let mut observation = String::new();
    let mut system: Vec<String> = Vec::new();
    let mut task = None;
    for (i, message) in conversation.messages.iter().enumerate() {
        let content = content_text(&message.content, &format!("messages[{i}].content"))?;
        match message.role.as_str() {
            "system" | "developer" => system.push(content),
            "assistant" => {
                let calls = message.tool_calls.iter().flatten();
                call_ids.push(calls.clone().map(|c| c.id.clone()).collect());
                steps.push(Step {
                    observation: std::mem::take(&mut observation),
                    action: content,
                    tool_calls: calls
                        .map(|call| ToolCall {
                            name: call.function.name.clone(),
                            arguments: scalar_text(&call.function.arguments),
                            result: None,
                        })
                        .collect(),
                    feedback: None,
                    timestamp: None,
                });
            }
            "tool" | "function" => {
                attach_result(
                    &mut steps,
                    &call_ids,
                    message.tool_call_id.as_deref(),
                    message.name.as_deref(),
                    &content,
                );
                push_observation(
                    &mut observation,
                    &format!("[{}] {content}", message.name.as_deref().unwrap_or("tool")),
                );
            }
            "user" => {
                if task.is_none() {
                    task = Some(content.clone());
                }
                push_observation(&mut observation, &format!("[user] {content}"));
            }
            other => {
                return Err((
                    format!("messages[{i}].role"),
                    format!(
                    "unknown role `{other}` (expected system, developer, user, assistant or tool)"
                ),
                ))
            }
        }
    }
    if !observation.is_empty() {
        steps.push(Step {
            observation,
            ..Step::default()
        });
    }
    let task = task.unwrap_or_default();
    let explicit_id = conversation
        .id
        .as_ref()
        .or(conversation.conversation_id.as_ref())
        .or(conversation.metadata.get("conversation_id"))
        .map(scalar_text);
    let identity = match &explicit_id {
        Some(id) => format!("id:{id}"),
        None => {
            let key: Vec<Value> = conversation
                .messages
                .iter()
                .map(|m| {
                    serde_json::json!([
                        m.role,
                        m.content,
                        m.tool_calls.as_ref().map(|c| c
                            .iter()
                            .map(|c| (c.function.name.clone(), c.function.arguments.clone()))
                            .collect::<Vec<_>>()),
                        m.tool_call_id
                    ])
                })
                .collect();
            format!(
                "messages:{}",
                sha256_hex(serde_json::to_string(&key).unwrap_or_default().as_bytes())
            )
        }
    };
    let tenant = conversation.tenant.clone().or_else(|| {
        conversation
            .metadata
            .get("tenant")
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    let agent = conversation.agent_id.clone().or_else(|| {
        conversation
            .metadata
            .get("agent_id")
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    let mut episode = source.node_of(
        tenant.as_deref(),
        agent.as_deref(),
        NodeBody::Episodic(Episode { steps, outcome }),
        &task,
        &["openai-chat", &identity],
        locator.to_string(),
        None,
    );
    let mut metadata: BTreeMap<String, Value> = conversation
        .metadata
        .iter()
        .map(|(k, v)| (format!("metadata.{k}"), v.clone()))
        .collect();
    if let Some(id) = explicit_id {
        metadata.insert("conversation_id".into(), Value::from(id));
    }
    metadata.insert("format".into(), Value::from("openai-chat"));
    episode.metadata = metadata;
    let mut nodes = vec![episode];
    for (i, prompt) in system
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.trim().is_empty())
    {
        // In the conversation's tenant: a prompt's nodes never mix tenants.
        nodes.extend(crate::tau::policy_nodes(
            source,
            &format!("{locator} system message {i}"),
            prompt,
            tenant.as_deref(),
            None,
        ));
    }
    Ok(Record { nodes })
}
