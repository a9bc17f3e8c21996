//! GenAI events as OTLP log records (`resourceLogs` -> `scopeLogs` -> `logRecords`), the way
//! instrumentations that follow the v1.30 GenAI conventions log message content: the
//! OpenTelemetry project's openai-v2 instrumentation, with content capture on, puts no content
//! on its spans and emits, in each model call's span context, one log record per input message
//! and per choice. The Collector's file exporter writes them as export requests of their own,
//! in the same file as the spans or another one of the batch.
//!
//! Each record names its event by `eventName` (or, from older SDKs, the `event.name`
//! attribute) and its span by `traceId` and `spanId`; a span's events are taken in time order
//! (`timeUnixNano`, else `observedTimeUnixNano`), and the same event read twice counts once. Once every file of a batch is read, the
//! events are put on their spans as the latest conventions carry them ([`attach`]), so the rest
//! of the reader sees one shape:
//!
//! - `gen_ai.system.message`, `gen_ai.user.message`, `gen_ai.assistant.message` and
//!   `gen_ai.tool.message`, in the order logged, become the span's `gen_ai.input.messages`
//!   (`content` a text part; an assistant's `tool_calls` tool-call parts; a tool message a
//!   `tool_call_response` part answering its `id`);
//! - `gen_ai.choice` events, by their `index`, become `gen_ai.output.messages`;
//! - `gen_ai.evaluation.result` events are the span's evaluations, as the same event logged on
//!   the span is (docs/formats/outcomes.md).
//!
//! A span that carries its messages as attributes keeps them. A record that is no GenAI event,
//! or whose span is not among the batch's spans, is rejected with its file, line and reason:
//! never dropped.

use serde_json::{json, Value};
use std::collections::BTreeMap;

use crate::otel::{any_value, attributes, SpanRec};
use crate::source::Source;
use crate::Parsed;

/// The message events, by event name, with the role of their message.
const MESSAGES: [(&str, &str); 4] = [
    ("gen_ai.system.message", "system"),
    ("gen_ai.user.message", "user"),
    ("gen_ai.assistant.message", "assistant"),
    ("gen_ai.tool.message", "tool"),
];
/// The event of one choice of a model's answer.
const CHOICE: &str = "gen_ai.choice";

/// One GenAI event of a batch, waiting for its span.
#[derive(Debug, Clone)]
pub(crate) struct EventRec {
    file: String,
    line: usize,
    locator: String,
    trace: String,
    span: String,
    name: String,
    /// `timeUnixNano`, else `observedTimeUnixNano` (0 when neither).
    time: u64,
    body: Value,
    attributes: BTreeMap<String, Value>,
    /// The record as read (its quarantine excerpt, if its span is missing).
    raw: String,
}

impl EventRec {
    /// What makes two records the same event: the same record in a second file, or an export
    /// retried, is read once.
    fn identity(&self) -> (String, String, String, u64, String, String) {
        (
            self.trace.clone(),
            self.span.clone(),
            self.name.clone(),
            self.time,
            self.body.to_string(),
            serde_json::to_string(&self.attributes).expect("JSON values serialise"),
        )
    }
}

/// A log record's time in nanoseconds: `timeUnixNano`, else `observedTimeUnixNano` (OTLP/JSON
/// writes them as decimal strings); 0 when neither is a number.
fn time_of(record: &Value) -> u64 {
    ["timeUnixNano", "observedTimeUnixNano"]
        .iter()
        .filter_map(|key| match record.get(*key)? {
            Value::String(s) => s.parse::<u64>().ok(),
            Value::Number(n) => n.as_u64(),
            _ => None,
        })
        .find(|&t| t > 0)
        .unwrap_or(0)
}

/// Reads the log records of one export request (`resourceLogs`); `line`: its line in a JSON
/// Lines file.
pub(crate) fn collect_logs(
    source: &Source,
    root: &Value,
    line: Option<usize>,
    events: &mut Vec<EventRec>,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let at = |path: String| match line {
        Some(n) => format!("line {n}: {path}"),
        None => path,
    };
    let list = |value: &Value, key: &str| -> Vec<Value> {
        value
            .get(key)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    for (r, resource_logs) in list(root, "resourceLogs").iter().enumerate() {
        for (s, scope) in list(resource_logs, "scopeLogs").iter().enumerate() {
            for (k, record) in list(scope, "logRecords").iter().enumerate() {
                let locator = at(format!("resourceLogs[{r}].scopeLogs[{s}].logRecords[{k}]"));
                let raw = record.to_string();
                let reject = |field: &str, reason: String| {
                    Parsed::Rejected(
                        source
                            .reject(line.unwrap_or(0), &locator, reason, raw.as_bytes())
                            .field(field),
                    )
                };
                let attributes = record
                    .get("attributes")
                    .and_then(Value::as_array)
                    .map(|a| attributes(a))
                    .unwrap_or_default();
                let name = [
                    record.get("eventName").and_then(Value::as_str),
                    attributes.get("event.name").and_then(Value::as_str),
                ]
                .into_iter()
                .flatten()
                .find(|n| !n.is_empty())
                .unwrap_or("")
                .to_string();
                if !is_read(&name) {
                    let reason = format!(
                        "a log record that is no GenAI event fluxmem reads (event name `{name}`); see docs/formats/otel.md"
                    );
                    emit(reject("eventName", reason))?;
                    continue;
                }
                let id = |key: &str| {
                    record
                        .get(key)
                        .and_then(Value::as_str)
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                };
                let (Some(trace), Some(span)) = (id("traceId"), id("spanId")) else {
                    let reason = format!(
                        "the GenAI event `{name}` names no span (traceId and spanId): it belongs to no model call"
                    );
                    emit(reject("spanId", reason))?;
                    continue;
                };
                events.push(EventRec {
                    file: source.path.clone(),
                    line: line.unwrap_or(0),
                    locator: format!("{locator} (event {name} of span {span})"),
                    trace,
                    span,
                    name,
                    time: time_of(record),
                    body: record.get("body").map(any_value).unwrap_or(Value::Null),
                    attributes,
                    raw,
                });
            }
        }
    }
    Ok(())
}

/// The event names this module reads.
fn is_read(name: &str) -> bool {
    MESSAGES.iter().any(|(event, _)| *event == name)
        || name == CHOICE
        || name == crate::otel::EVALUATION_EVENT
}

/// Puts each event on its span (see the module docs), in time order (read order where times
/// tie), once however often it was read (the same trace, span, name, time, body and
/// attributes); the events whose span is not among `spans` come back rejected.
pub(crate) fn attach(spans: &mut [SpanRec], events: Vec<EventRec>) -> Vec<Parsed> {
    let index: BTreeMap<(String, String), usize> = spans
        .iter()
        .enumerate()
        .map(|(i, s)| ((s.trace.clone(), s.id.clone()), i))
        .collect();
    let mut by_span: BTreeMap<usize, Vec<EventRec>> = BTreeMap::new();
    let mut rejected = Vec::new();
    // The same event twice (a file ingested twice in one batch, a copy, a retried export)
    // counts once.
    let mut seen = std::collections::BTreeSet::new();
    for event in events {
        if !seen.insert(event.identity()) {
            continue;
        }
        match index.get(&(event.trace.clone(), event.span.clone())) {
            Some(&i) => by_span.entry(i).or_default().push(event),
            None => {
                let reason = format!(
                    "the GenAI event `{}` is of span {} of trace {}, which is not among the spans read with it; ingest its traces in the same run",
                    event.name, event.span, event.trace
                );
                rejected.push(Parsed::Rejected(
                    crate::Rejected::new(
                        &event.file,
                        event.line,
                        event.locator,
                        reason,
                        event.raw.as_bytes(),
                        usize::MAX,
                    )
                    .field("spanId"),
                ));
            }
        }
    }
    for (i, mut events) in by_span {
        // In time order; the order read where times tie (a stable sort).
        events.sort_by_key(|e| e.time);
        on_span(&mut spans[i], events);
    }
    rejected
}

/// One span's events, in the order they were logged.
fn on_span(span: &mut SpanRec, events: Vec<EventRec>) {
    let mut input = Vec::new();
    let mut choices: Vec<(i64, Value)> = Vec::new();
    for event in events {
        if let Some((_, role)) = MESSAGES.iter().find(|(name, _)| *name == event.name) {
            input.push(message(role, &event.body));
        } else if event.name == CHOICE {
            let index = event.body.get("index").and_then(Value::as_i64).unwrap_or(0);
            let said = event.body.get("message").cloned().unwrap_or(Value::Null);
            let role = said
                .get("role")
                .and_then(Value::as_str)
                .unwrap_or("assistant");
            let mut output = message(role, &said);
            if let Some(reason) = event.body.get("finish_reason") {
                output["finish_reason"] = reason.clone();
            }
            choices.push((index, output));
        } else {
            span.evaluations
                .push(crate::otel::evaluation(&event.attributes));
        }
    }
    choices.sort_by_key(|(index, _)| *index);
    for (key, messages) in [
        ("gen_ai.input.messages", input),
        (
            "gen_ai.output.messages",
            choices.into_iter().map(|(_, m)| m).collect(),
        ),
    ] {
        if !messages.is_empty() && !span.attributes.contains_key(key) {
            span.attributes
                .insert(key.to_string(), Value::Array(messages));
        }
    }
}

/// A message event's body (`content`, `tool_calls`, `id`) as a message of the latest
/// conventions (`role` and `parts`).
fn message(role: &str, body: &Value) -> Value {
    let content = body.get("content").filter(|c| !c.is_null());
    let mut parts = Vec::new();
    if role == "tool" {
        parts.push(json!({
            "type": "tool_call_response",
            "id": body.get("id").cloned().unwrap_or(Value::Null),
            "response": content.cloned().unwrap_or(Value::Null),
        }));
    } else if let Some(content) = content {
        let text = match content {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        parts.push(json!({"type": "text", "content": text}));
    }
    for call in body
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let function = call.get("function").cloned().unwrap_or(Value::Null);
        parts.push(json!({
            "type": "tool_call",
            "id": call.get("id").cloned().unwrap_or(Value::Null),
            "name": function.get("name").cloned().unwrap_or(Value::Null),
            "arguments": function.get("arguments").cloned().unwrap_or(Value::Null),
        }));
    }
    json!({"role": role, "parts": parts})
}
