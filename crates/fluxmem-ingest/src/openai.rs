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
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    functions: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<Value>,
    #[serde(default)]
    response_id: Option<Value>,
}

type Message = crate::chat::Message<Value>;

/// True when `line` (the first record of a `.jsonl` file) is a chat log in one of the
/// [`crate::layouts`], not fluxmem's schema.
pub(crate) fn looks_like(line: &str) -> bool {
    serde_json::from_str::<Value>(line).is_ok_and(|v| crate::layouts::recognised(&v))
}

/// One good line, read.
struct Line {
    line: usize,
    locator: String,
    /// The normalised conversation (to build it again under another identity), and its layout.
    value: Value,
    layout: crate::layouts::Layout,
    /// Its tenant (the record's, else none: the options').
    tenant: String,
    explicit_id: Option<String>,
    /// One key per message (role, text, calls, the call answered), for prefixes.
    keys: Vec<String>,
    record: Record,
}

/// A line of the file, in order.
enum Entry {
    AsIs(Parsed),
    Line(Box<Line>),
}

/// Parses a chat-log file, one conversation (or model call) per non-blank line, then joins the
/// versions of one conversation ([`versions`]): the longest is the episode, and a version that
/// is a prefix of it adds nothing (a duplicate); a version with the same id that is not a
/// prefix is an episode of its own, marked `conflicts_with`.
pub(crate) fn parse(
    source: &Source,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let mut lines: Vec<Box<Line>> = Vec::new();
    let mut order: Vec<Entry> = Vec::new();
    each_line(
        source,
        &mut |parsed| {
            order.push(Entry::AsIs(parsed));
            Ok(())
        },
        |text, line, locator| {
            let value = parse_at::<Value>(text)?;
            let (value, layout) = crate::layouts::normalise(value)?;
            let conversation: Conversation = serde_path_to_error::deserialize(value.clone())
                .map_err(|e| (e.path().to_string(), e.into_inner().to_string()))?;
            let keys = message_keys(&conversation);
            let tenant = tenant_of(&conversation).unwrap_or_default();
            let explicit_id = explicit_id(&conversation);
            let record = self::conversation(source, locator, conversation, layout, None)?;
            lines.push(Box::new(Line {
                line,
                locator: locator.to_string(),
                value,
                layout,
                tenant,
                explicit_id,
                keys,
                record,
            }));
            // A placeholder the loop below replaces with the line.
            Ok(Parsed::Record(Record { nodes: Vec::new() }))
        },
    )?;
    // Put each read line in its place among the rejections (a placeholder record has no
    // nodes; a real one always has its episode).
    let mut read = lines.into_iter();
    for entry in order.iter_mut() {
        if matches!(entry, Entry::AsIs(Parsed::Record(r)) if r.nodes.is_empty()) {
            *entry = Entry::Line(read.next().expect("one line per placeholder"));
        }
    }
    let lines: Vec<&Line> = order
        .iter()
        .filter_map(|e| match e {
            Entry::Line(line) => Some(&**line),
            Entry::AsIs(_) => None,
        })
        .collect();
    let heads = versions(&lines);
    let mut emitted = vec![false; lines.len()];
    let mut index = 0;
    for entry in &order {
        let line = match entry {
            Entry::AsIs(parsed) => {
                emit(parsed.clone())?;
                continue;
            }
            Entry::Line(line) => line,
        };
        let at = index;
        index += 1;
        match heads[at] {
            Version::Head { versions } => {
                if !emitted[at] {
                    emitted[at] = true;
                    emit(Parsed::Record(with_versions(&line.record, versions)))?;
                }
            }
            Version::PrefixOf(head) => {
                if !emitted[head] {
                    emitted[head] = true;
                    let Version::Head { versions } = heads[head] else {
                        unreachable!("a prefix points at a head")
                    };
                    emit(Parsed::Record(with_versions(&lines[head].record, versions)))?;
                }
                // The head's own record again: the driver counts it as a duplicate.
                emit(Parsed::Record(lines[head].record.clone()))?;
            }
            Version::Conflict(head) => {
                let conversation: Conversation =
                    serde_json::from_value(line.value.clone()).expect("read once already");
                let identity = format!(
                    "id:{}#{}",
                    line.explicit_id.as_deref().unwrap_or_default(),
                    sha256_hex(line.keys.join("\n").as_bytes())
                );
                let mut record = self::conversation(
                    source,
                    &line.locator,
                    conversation,
                    line.layout,
                    Some(identity),
                )
                .expect("read once already");
                record.nodes[0].metadata.insert(
                    "conflicts_with".into(),
                    Value::from(lines[head].locator.clone()),
                );
                emit(Parsed::Record(record))?;
            }
        }
    }
    Ok(())
}

/// A record whose episode says how many logged versions it joins (when more than one).
fn with_versions(record: &Record, versions: usize) -> Record {
    let mut record = record.clone();
    if versions > 1 {
        record.nodes[0]
            .metadata
            .insert("versions".into(), Value::from(versions));
    }
    record
}

/// What a line is among the versions of its conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    /// The longest version: the episode, joining `versions` lines.
    Head { versions: usize },
    /// A prefix of the head at this index: adds nothing.
    PrefixOf(usize),
    /// The same id as the head at this index, but not a prefix of it.
    Conflict(usize),
}

/// The versions of each conversation among `lines`, within a tenant: lines with the same
/// explicit id, and lines without one whose messages are a prefix of another line's (the model
/// calls of one agent run, as a proxy logs them: each call's messages continue the previous
/// call's, with the answer and the tool results). Each line's head is its longest extension
/// (ties: the later line).
fn versions(lines: &[&Line]) -> Vec<Version> {
    let longer = |a: usize, b: usize| {
        (lines[a].keys.len(), lines[a].line) > (lines[b].keys.len(), lines[b].line)
    };
    let is_prefix = |a: &Line, b: &Line| b.keys.starts_with(&a.keys);
    let mut out: Vec<Version> = vec![Version::Head { versions: 1 }; lines.len()];
    // By explicit id.
    let mut by_id: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
    for (i, line) in lines.iter().enumerate() {
        if let Some(id) = &line.explicit_id {
            by_id.entry((&line.tenant, id)).or_default().push(i);
        }
    }
    for members in by_id.values() {
        let head = members
            .iter()
            .copied()
            .reduce(|a, b| if longer(b, a) { b } else { a })
            .expect("a group has a member");
        for &i in members.iter().filter(|&&i| i != head) {
            out[i] = if is_prefix(lines[i], lines[head]) {
                Version::PrefixOf(head)
            } else {
                Version::Conflict(head)
            };
        }
    }
    // Without an id: prefixes, found by the hash of every prefix of every line.
    let prefix_hashes = |line: &Line| -> Vec<String> {
        let mut hash = sha256_hex(line.tenant.as_bytes());
        line.keys
            .iter()
            .map(|key| {
                hash = sha256_hex(format!("{hash}\n{key}").as_bytes());
                hash.clone()
            })
            .collect()
    };
    let anonymous: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].explicit_id.is_none())
        .collect();
    let hashes: BTreeMap<usize, Vec<String>> = anonymous
        .iter()
        .map(|&i| (i, prefix_hashes(lines[i])))
        .collect();
    let mut whole: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for &i in &anonymous {
        if let Some(last) = hashes[&i].last() {
            whole.entry(last.as_str()).or_default().push(i);
        }
    }
    // The longest strict extension of each line.
    let mut extension: BTreeMap<usize, usize> = BTreeMap::new();
    for &b in &anonymous {
        let n = hashes[&b].len();
        for hash in &hashes[&b][..n.saturating_sub(1)] {
            for &a in whole.get(hash.as_str()).into_iter().flatten() {
                let best = extension.entry(a).or_insert(b);
                if longer(b, *best) {
                    *best = b;
                }
            }
        }
    }
    for &a in &anonymous {
        let mut head = a;
        while let Some(&next) = extension.get(&head) {
            head = next;
        }
        if head != a {
            out[a] = Version::PrefixOf(head);
        }
    }
    for i in 0..out.len() {
        if let Version::PrefixOf(head) = out[i] {
            if let Version::Head { versions } = &mut out[head] {
                *versions += 1;
            }
        }
    }
    out
}

/// One key per message: its role, text, calls (name and arguments) and the call it answers.
fn message_keys(conversation: &Conversation) -> Vec<String> {
    conversation
        .messages
        .iter()
        .map(|m| {
            let text = content_text(&m.content, "").unwrap_or_default();
            let calls: Vec<(String, String)> = m
                .tool_calls
                .iter()
                .flatten()
                .map(|c| (c.function.name.clone(), scalar_text(&c.function.arguments)))
                .collect();
            serde_json::json!([m.role, text, calls, m.tool_call_id]).to_string()
        })
        .collect()
}

fn explicit_id(conversation: &Conversation) -> Option<String> {
    conversation
        .id
        .as_ref()
        .or(conversation.conversation_id.as_ref())
        .or(conversation.metadata.get("conversation_id"))
        .map(scalar_text)
}

fn tenant_of(conversation: &Conversation) -> Option<String> {
    conversation.tenant.clone().or_else(|| {
        conversation
            .metadata
            .get("tenant")
            .and_then(Value::as_str)
            .map(str::to_string)
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
    layout: crate::layouts::Layout,
    identity: Option<String>,
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
    let explicit_id = explicit_id(&conversation);
    let identity = match (identity, &explicit_id) {
        (Some(identity), _) => identity,
        (None, Some(id)) => format!("id:{id}"),
        (None, None) => {
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
    let tenant = tenant_of(&conversation);
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
    metadata.insert("layout".into(), Value::from(layout.name()));
    for (key, value) in [
        ("tools", &conversation.tools),
        ("functions", &conversation.functions),
        ("parallel_tool_calls", &conversation.parallel_tool_calls),
        ("response_id", &conversation.response_id),
    ] {
        if let Some(value) = value.as_ref().filter(|v| !v.is_null()) {
            metadata.insert(key.into(), value.clone());
        }
    }
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
