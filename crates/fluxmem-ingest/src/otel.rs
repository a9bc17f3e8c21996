//! OpenTelemetry GenAI traces as OTLP/JSON files (`resourceSpans` -> `scopeSpans` -> `spans`,
//! and the GenAI events of `resourceLogs`),
//! following the GenAI semantic conventions of semantic-conventions v1.41.0 (Development
//! status); docs/formats/otel.md has the field mapping.
//!
//! Spans are collected from every OTel file of a batch first and grouped into episodes at the
//! end, so a trace or a conversation split across files is one episode:
//! - an episode per `invoke_agent` span (`gen_ai.operation.name`) with the spans below it;
//!   agent spans with the same `gen_ai.conversation.id` are one episode across traces; a trace
//!   without an agent span is one episode; a span whose parent is not in the batch joins its
//!   trace's first agent span; spans of different tenants are never one episode (a trace
//!   across two tenants' services gives each tenant its own);
//! - `chat` spans give steps from `gen_ai.output.messages` (text and `tool_call` parts),
//!   `execute_tool` spans give the calls' results (matched by `gen_ai.tool.call.id`; a span
//!   without one answers the first open call of its tool, equal arguments first; else a step
//!   of their own with `gen_ai.tool.name` / `.call.arguments` / `.call.result`); a tool span
//!   with status ERROR is its step's feedback; a `tool_call_response` part in a later chat
//!   span's input answers the open call with its id (instrumentations without tool spans);
//! - OpenInference spans (`openinference.span.kind`) are first rewritten onto these names
//!   (`openinference.rs`);
//! - GenAI events logged as log records (`resourceLogs`: the openai-v2 instrumentation's
//!   messages, evaluation events) are first put on the spans they name (`events.rs`);
//! - the task is the first user text of `gen_ai.input.messages`; `gen_ai.system_instructions`
//!   becomes shared semantic nodes, as tau-bench's policies do;
//! - the outcome: the agent span's `fluxmem.outcome.success` / `fluxmem.outcome.reward`
//!   attributes, else its status (OK: success, ERROR: failure, unset: unknown);
//! - tenant: resource attribute `fluxmem.tenant`, else `service.name`, else the ingest
//!   options'; agent: `gen_ai.agent.id`, else `gen_ai.agent.name`, else the options'.

use fluxmem_graph::{Episode, Node, NodeBody, Outcome, Step, ToolCall};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

use crate::source::Source;
use crate::{IngestOptions, Parsed, Record};

/// One span, with what an episode needs of it and of its file.
#[derive(Debug, Clone)]
pub(crate) struct SpanRec {
    file: String,
    locator: String,
    mtime: Option<i64>,
    pub(crate) trace: String,
    pub(crate) id: String,
    parent: Option<String>,
    start_ns: u64,
    pub(crate) attributes: BTreeMap<String, Value>,
    resource: BTreeMap<String, Value>,
    status: i64,
    status_message: String,
    /// The first `exception` event's `exception.type: exception.message`.
    exception: Option<String>,
    /// Its `gen_ai.evaluation.result` events: (verdict, what they say).
    pub(crate) evaluations: Vec<(Option<bool>, String)>,
}

/// What the OTel files of a batch hold: spans, and GenAI events logged as log records
/// (`events.rs`), put on their spans once every file is read.
#[derive(Debug, Clone, Default)]
pub(crate) struct Collected {
    pub(crate) spans: Vec<SpanRec>,
    pub(crate) events: Vec<crate::events::EventRec>,
}

impl SpanRec {
    fn operation(&self) -> &str {
        self.attributes
            .get("gen_ai.operation.name")
            .and_then(Value::as_str)
            .unwrap_or("")
    }
    fn text(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).and_then(Value::as_str)
    }
    /// A model call: a `chat`, `text_completion` or `generate_content` span.
    fn is_model_call(&self) -> bool {
        matches!(
            self.operation(),
            "chat" | "text_completion" | "generate_content"
        )
    }
    /// Where spans of a batch stand in time: start, then span id.
    fn start_key(&self) -> (u64, &str) {
        (self.start_ns, &self.id)
    }
    /// What a failed span says: the first non-empty of its status message, its `exception`
    /// event's `exception.type: exception.message`, and `error.type`.
    fn error_message(&self) -> Option<String> {
        [
            Some(self.status_message.clone()),
            self.exception.clone(),
            self.text("error.type").map(str::to_string),
        ]
        .into_iter()
        .flatten()
        .find(|m| !m.trim().is_empty())
    }
    /// The tenant of the span's resource: `fluxmem.tenant`, else `service.name`, else `fallback`.
    fn tenant<'a>(&'a self, fallback: &'a str) -> &'a str {
        self.resource
            .get("fluxmem.tenant")
            .or_else(|| self.resource.get("service.name"))
            .and_then(Value::as_str)
            .unwrap_or(fallback)
    }
}

/// True when the head of a `.json` file, or the first line of a `.jsonl` one, is an OTLP/JSON
/// trace or log export.
pub(crate) fn looks_like(head: &str) -> bool {
    head.trim_start().starts_with('{')
        && (head.contains("\"resourceSpans\"") || head.contains("\"resourceLogs\""))
}

/// An OTLP attribute value as JSON (`{"stringValue": "x"}` -> `"x"`, `intValue` strings to
/// numbers, arrays and key-value lists recursively).
pub(crate) fn any_value(value: &Value) -> Value {
    let Some(object) = value.as_object() else {
        return Value::Null;
    };
    if let Some(v) = object.get("stringValue") {
        return v.clone();
    }
    if let Some(v) = object.get("boolValue") {
        return v.clone();
    }
    if let Some(v) = object.get("intValue") {
        return match v {
            Value::String(s) => s
                .parse::<i64>()
                .map(Value::from)
                .unwrap_or_else(|_| v.clone()),
            other => other.clone(),
        };
    }
    if let Some(v) = object.get("doubleValue") {
        return v.clone();
    }
    if let Some(values) = object
        .get("arrayValue")
        .and_then(|a| a.get("values"))
        .and_then(Value::as_array)
    {
        return Value::Array(values.iter().map(any_value).collect());
    }
    if let Some(values) = object
        .get("kvlistValue")
        .and_then(|a| a.get("values"))
        .and_then(Value::as_array)
    {
        return Value::Object(attributes(values).into_iter().collect());
    }
    Value::Null
}

pub(crate) fn attributes(list: &[Value]) -> BTreeMap<String, Value> {
    list.iter()
        .filter_map(|kv| {
            Some((
                kv.get("key")?.as_str()?.to_string(),
                any_value(kv.get("value")?),
            ))
        })
        .collect()
}

/// Reads the spans of one OTLP/JSON file into `spans`: one export request (`resourceSpans`), or
/// JSON Lines of them as the OpenTelemetry Collector's file exporter writes (one request a
/// line), told apart by content: the file is JSON Lines when its first non-blank line is a
/// whole JSON object. A file, line or span that is not OTLP is rejected (the rest goes on).
pub(crate) fn collect(
    source: &Source,
    text: &str,
    spans: &mut Collected,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let first = text.lines().enumerate().find(|(_, l)| !l.trim().is_empty());
    let json_lines = first
        .is_some_and(|(_, l)| matches!(serde_json::from_str::<Value>(l), Ok(Value::Object(_))));
    if !json_lines {
        let root: Value = match serde_json::from_str(text) {
            Ok(root) => root,
            Err(e) => {
                return emit(Parsed::Rejected(source.reject(
                    e.line(),
                    "file",
                    format!("not OTLP/JSON: {e}"),
                    source.bytes,
                )))
            }
        };
        return collect_request(source, &root, None, spans, emit);
    }
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let line_no = index + 1;
        let locator = format!("line {line_no}");
        if let Some(rejected) = source.check_size(line_no, &locator, line.as_bytes()) {
            emit(rejected)?;
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(root) => collect_request(source, &root, Some(line_no), spans, emit)?,
            Err(e) => emit(Parsed::Rejected(source.reject(
                line_no,
                &locator,
                format!("not an OTLP/JSON export request: {e}"),
                line.as_bytes(),
            )))?,
        }
    }
    Ok(())
}

/// Reads the spans, or the log records, of one export request (`line`: its line in a JSON
/// Lines file).
fn collect_request(
    source: &Source,
    root: &Value,
    line: Option<usize>,
    collected: &mut Collected,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let at = |path: String| match line {
        Some(n) => format!("line {n}: {path}"),
        None => path,
    };
    let logs = root.get("resourceLogs").is_some_and(Value::is_array);
    if logs {
        crate::events::collect_logs(source, root, line, &mut collected.events, emit)?;
        if root.get("resourceSpans").is_none() {
            return Ok(());
        }
    }
    let spans = &mut collected.spans;
    let Some(resource_spans) = root.get("resourceSpans").and_then(Value::as_array) else {
        return emit(Parsed::Rejected(
            source
                .reject(
                    line.unwrap_or(1),
                    at("file".into()),
                    "not OTLP/JSON: no `resourceSpans` or `resourceLogs` array",
                    b"",
                )
                .field("resourceSpans"),
        ));
    };
    for (r, resource_span) in resource_spans.iter().enumerate() {
        let resource = resource_span
            .get("resource")
            .and_then(|r| r.get("attributes"))
            .and_then(Value::as_array)
            .map(|a| attributes(a))
            .unwrap_or_default();
        let scopes = resource_span
            .get("scopeSpans")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for (s, scope) in scopes.iter().enumerate() {
            let list = scope
                .get("spans")
                .and_then(Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or_default();
            for (k, span) in list.iter().enumerate() {
                let locator = at(format!("resourceSpans[{r}].scopeSpans[{s}].spans[{k}]"));
                let raw = span.to_string();
                let reject = |field: &str, reason: &str| {
                    Parsed::Rejected(
                        source
                            .reject(line.unwrap_or(0), &locator, reason, raw.as_bytes())
                            .field(field),
                    )
                };
                let id_of = |key: &str| {
                    span.get(key)
                        .and_then(Value::as_str)
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                };
                let (Some(trace), Some(id)) = (id_of("traceId"), id_of("spanId")) else {
                    let field = if id_of("traceId").is_none() {
                        "traceId"
                    } else {
                        "spanId"
                    };
                    emit(reject(field, "a span needs a non-empty traceId and spanId"))?;
                    continue;
                };
                let start_ns = match span.get("startTimeUnixNano") {
                    None => 0,
                    Some(Value::String(s)) => match s.parse::<u64>() {
                        Ok(ns) => ns,
                        Err(_) => {
                            emit(reject("startTimeUnixNano", "not a number of nanoseconds"))?;
                            continue;
                        }
                    },
                    Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
                    Some(_) => {
                        emit(reject("startTimeUnixNano", "not a number of nanoseconds"))?;
                        continue;
                    }
                };
                // A field of the wrong type is an error naming its path, never read as absent.
                let attributes = match span.get("attributes") {
                    None | Some(Value::Null) => BTreeMap::new(),
                    Some(Value::Array(list)) => crate::openinference::as_gen_ai(attributes(list)),
                    Some(_) => {
                        emit(reject("attributes", "not an array of key-value attributes"))?;
                        continue;
                    }
                };
                let status = span.get("status");
                if status.is_some_and(|s| !s.is_object() && !s.is_null()) {
                    emit(reject("status", "not an object with `code` and `message`"))?;
                    continue;
                }
                let exception = events(span, "exception")
                    .next()
                    .and_then(|e| e.get("attributes").and_then(Value::as_array))
                    .map(|list| {
                        let a = self::attributes(list);
                        let field = |k: &str| a.get(k).map(text_of).unwrap_or_default();
                        match (field("exception.type"), field("exception.message")) {
                            (t, m) if t.is_empty() => m,
                            (t, m) if m.is_empty() => t,
                            (t, m) => format!("{t}: {m}"),
                        }
                    });
                let evaluations = events(span, EVALUATION_EVENT)
                    .filter_map(|e| e.get("attributes").and_then(Value::as_array))
                    .map(|list| evaluation(&self::attributes(list)))
                    .collect();
                spans.push(SpanRec {
                    file: source.path.clone(),
                    locator: format!("{locator} (span {id})"),
                    mtime: source.mtime,
                    trace,
                    id,
                    parent: id_of("parentSpanId"),
                    start_ns,
                    attributes,
                    resource: resource.clone(),
                    status: status
                        .and_then(|s| s.get("code"))
                        .and_then(Value::as_i64)
                        .unwrap_or(0),
                    status_message: status
                        .and_then(|s| s.get("message"))
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                    exception,
                    evaluations,
                });
            }
        }
    }
    Ok(())
}

/// A span's events named `name`, in order.
fn events<'a>(span: &'a Value, name: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    span.get("events")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(move |e| e.get("name").and_then(Value::as_str) == Some(name))
}

/// The messages of a `gen_ai.*.messages` attribute (a JSON string or an array).
fn messages(span: &SpanRec, key: &str) -> Vec<Value> {
    match span.attributes.get(key) {
        Some(Value::String(s)) => serde_json::from_str::<Vec<Value>>(s).unwrap_or_default(),
        Some(Value::Array(a)) => a.clone(),
        _ => Vec::new(),
    }
}

fn parts(message: &Value) -> &[Value] {
    message
        .get("parts")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

fn part_text(part: &Value) -> Option<String> {
    (part.get("type").and_then(Value::as_str) == Some("text")).then(|| {
        part.get("content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    })
}

/// An attribute or part value as text; an absent (null) one is empty.
fn text_of(value: &Value) -> String {
    if value.is_null() {
        String::new()
    } else {
        crate::chat::scalar_text(value)
    }
}

/// Groups the collected spans into episodes (one record each).
pub(crate) fn episodes(collected: Collected, options: &IngestOptions) -> Vec<Parsed> {
    // The same span twice (a file ingested twice in one batch) counts once.
    let mut by_id: BTreeMap<(String, String), SpanRec> = BTreeMap::new();
    for span in collected.spans {
        by_id
            .entry((span.trace.clone(), span.id.clone()))
            .or_insert(span);
    }
    let mut spans: Vec<SpanRec> = by_id.into_values().collect();
    // GenAI events logged as log records go on their spans; those of no span read are rejected.
    let mut out = crate::events::attach(&mut spans, collected.events);
    let index: BTreeMap<(&str, &str), usize> = spans
        .iter()
        .enumerate()
        .map(|(i, s)| ((s.trace.as_str(), s.id.as_str()), i))
        .collect();
    let is_agent = |i: usize| spans[i].operation() == "invoke_agent";
    // The first agent span of each trace (by start time), for spans whose parents are missing.
    let mut first_agent: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, span) in spans.iter().enumerate() {
        if is_agent(i) {
            let entry = first_agent.entry(span.trace.as_str()).or_insert(i);
            if span.start_key() < spans[*entry].start_key() {
                *entry = i;
            }
        }
    }
    // Each span's agent: itself, its nearest agent ancestor, or its trace's first agent.
    let agent_of = |i: usize| -> Option<usize> {
        let mut at = i;
        let mut seen = BTreeSet::new();
        loop {
            if is_agent(at) {
                return Some(at);
            }
            if !seen.insert(at) {
                break;
            }
            match spans[at]
                .parent
                .as_deref()
                .and_then(|p| index.get(&(spans[at].trace.as_str(), p)))
            {
                Some(&parent) => at = parent,
                None => break,
            }
        }
        first_agent.get(spans[i].trace.as_str()).copied()
    };
    let conversation = |i: usize| spans[i].text("gen_ai.conversation.id").map(str::to_string);
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for i in 0..spans.len() {
        let group = match agent_of(i) {
            Some(agent) => match conversation(agent) {
                Some(id) => format!("conversation:{id}"),
                None => format!("agent:{}/{}", spans[agent].trace, spans[agent].id),
            },
            None => format!("trace:{}", spans[i].trace),
        };
        // Tenants never mix: a trace that crosses services of two tenants gives each its own
        // episode, grouped the same way within the tenant.
        let key = format!("{group}@{}", spans[i].tenant(&options.tenant));
        groups.entry(key).or_default().push(i);
    }
    for members in groups.values_mut() {
        members.sort_by(|&a, &b| spans[a].start_key().cmp(&spans[b].start_key()));
    }
    let groups = stitch(groups, &spans);
    for (key, members) in groups {
        let group: Vec<&SpanRec> = members.iter().map(|&i| &spans[i]).collect();
        out.push(understood(episode(&key, &group, options), &group));
    }
    out
}

/// Joins the runs that client-side instrumentation splits into one trace per model call: a
/// group with no agent span (`trace:` key) whose first model call's input messages continue
/// what an earlier such group of its tenant said so far (its last call's input and output
/// messages, as a prefix; the tool results answered after it) joins that group, under its
/// key. Of several earlier groups, the one with the longest such prefix; each `members` is in
/// start order, and so is the joined one.
fn stitch(groups: BTreeMap<String, Vec<usize>>, spans: &[SpanRec]) -> BTreeMap<String, Vec<usize>> {
    let is_call = |i: &usize| spans[*i].is_model_call();
    // The model calls of each group without an agent span, in the order of their first call.
    let mut runs: Vec<(&String, usize, usize)> = groups
        .iter()
        .filter(|(key, _)| key.starts_with("trace:"))
        .filter_map(|(key, members)| {
            let first = *members.iter().find(|i| is_call(i))?;
            let last = *members.iter().rev().find(|i| is_call(i))?;
            Some((key, first, last))
        })
        .collect();
    runs.sort_by(|a, b| spans[a.1].start_key().cmp(&spans[b.1].start_key()));
    // What each run said so far, by the hash of its tenant and messages -> its key.
    let mut said: std::collections::HashMap<[u8; 32], String> = Default::default();
    let mut joins: BTreeMap<String, String> = BTreeMap::new();
    for &(key, first, last) in &runs {
        let tenant = key.rsplit_once('@').map_or("", |(_, t)| t);
        let input = prefix_hashes(tenant, &messages(&spans[first], "gen_ai.input.messages"));
        if let Some(earlier) = input.iter().rev().find_map(|h| said.get(h)) {
            joins.insert(key.clone(), earlier.clone());
        }
        let mut so_far = messages(&spans[last], "gen_ai.input.messages");
        so_far.extend(messages(&spans[last], "gen_ai.output.messages"));
        if let Some(&whole) = prefix_hashes(tenant, &so_far).last() {
            said.insert(whole, key.clone());
        }
    }
    if joins.is_empty() {
        return groups;
    }
    // Each joined group's root: the first run of its chain (every join points earlier).
    let root = |key: &String| {
        let mut key = key.clone();
        while let Some(earlier) = joins.get(&key) {
            key = earlier.clone();
        }
        key
    };
    let mut out: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (key, members) in &groups {
        out.entry(root(key)).or_default().extend(members);
    }
    for members in out.values_mut() {
        members.sort_by(|&a, &b| spans[a].start_key().cmp(&spans[b].start_key()));
    }
    out
}

/// For each k, the hash of the tenant and the first k messages, each message read as what it
/// says (its role and its parts' types, texts, call ids, names, arguments and responses;
/// arguments compared as JSON), so that a message logged again in a later call's input, without
/// the fields only an output carries (`finish_reason`), hashes the same.
fn prefix_hashes(tenant: &str, messages: &[Value]) -> Vec<[u8; 32]> {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(tenant.as_bytes());
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        hasher.update([0]);
        hasher.update(role.as_bytes());
        for part in parts(message) {
            let field = |key: &str| {
                part.get(key).map_or(String::new(), |v| match v {
                    Value::String(s) => serde_json::from_str::<Value>(s)
                        .ok()
                        .filter(|_| key == "arguments")
                        .map_or_else(|| s.clone(), |parsed| parsed.to_string()),
                    other => other.to_string(),
                })
            };
            for key in ["type", "content", "id", "name", "arguments", "response"] {
                hasher.update([1]);
                hasher.update(field(key).as_bytes());
            }
        }
        out.push(hasher.clone().finalize().into());
    }
    out
}

/// The group's episode, or, when no span of it was understood (no task, no step), a rejection
/// that says what the spans were: never a silent empty episode.
fn understood(record: Record, group: &[&SpanRec]) -> Parsed {
    let node = &record.nodes[0];
    let empty = node.text.trim().is_empty() && node.episode().is_some_and(|e| e.steps.is_empty());
    if !empty {
        return Parsed::Record(record);
    }
    let lead = group[0];
    let kinds: BTreeSet<String> = group
        .iter()
        .map(|s| {
            let operation = s.operation();
            if !operation.is_empty() {
                format!("gen_ai.operation.name={operation}")
            } else if let Some(kind) = s.text("openinference.span.kind") {
                format!("openinference.span.kind={kind}")
            } else {
                "no gen_ai.operation.name".to_string()
            }
        })
        .collect();
    let reason = format!(
        "{} span(s) of trace {} give no task and no step: none is a GenAI span fluxmem reads ({}); see docs/formats/otel.md",
        group.len(),
        lead.trace,
        kinds.into_iter().collect::<Vec<_>>().join(", ")
    );
    Parsed::Rejected(crate::Rejected::new(
        &lead.file,
        0,
        lead.locator.clone(),
        reason,
        b"",
        usize::MAX,
    ))
}

fn episode(key: &str, spans: &[&SpanRec], options: &IngestOptions) -> Record {
    let agents: Vec<&SpanRec> = spans
        .iter()
        .copied()
        .filter(|s| s.operation() == "invoke_agent")
        .collect();
    let lead = agents.first().copied().unwrap_or(spans[0]);
    let transcript = Transcript::of(spans);
    let (outcome, from_status) = with_evaluation(
        match agents.last() {
            Some(agent) => outcome_of(agent),
            None => last_call_outcome(spans),
        },
        spans,
    );
    // Every span of a group has this tenant (it is part of the group key).
    let tenant = lead.tenant(&options.tenant).to_string();
    let agent = lead
        .text("gen_ai.agent.id")
        .or_else(|| lead.text("gen_ai.agent.name"))
        .map(str::to_string)
        .or_else(|| options.agent_id.clone());
    let created_at = spans
        .iter()
        .filter(|s| s.start_ns > 0)
        .map(|s| (s.start_ns / 1_000_000) as i64)
        .min()
        .filter(|&ms| crate::source::in_calendar(ms))
        .or(lead.mtime);
    let task = transcript.task.unwrap_or_else(|| {
        lead.text("gen_ai.agent.name")
            .map(|a| format!("{a} run"))
            .unwrap_or_default()
    });
    // The lead span's file, as the source of the episode and of its prompt's nodes.
    let source = Source {
        path: lead.file.clone(),
        mtime: created_at,
        options,
        bytes: &[],
    };
    let mut node = source.node_of(
        Some(&tenant),
        agent.as_deref(),
        NodeBody::Episodic(Episode {
            steps: transcript.steps,
            outcome,
        }),
        &task,
        &["otel", key],
        lead.locator.clone(),
        None,
    );
    describe(&mut node, key, spans, lead, from_status);
    let mut nodes = vec![node];
    for prompt in &transcript.system {
        let locator = format!("{} gen_ai.system_instructions", lead.locator);
        nodes.extend(crate::tau::policy_nodes(
            &source,
            &locator,
            prompt,
            Some(&tenant),
            agent.as_deref(),
        ));
    }
    Record { nodes }
}

/// What a group's spans say, in start order: the steps, the task (the first user message),
/// and the distinct system instructions.
struct Transcript {
    steps: Vec<Step>,
    task: Option<String>,
    system: Vec<String>,
    /// Call id -> (step, call) of the calls a chat span requested, for the tool spans that
    /// answer them.
    calls: BTreeMap<String, (usize, usize)>,
}

impl Transcript {
    fn of(spans: &[&SpanRec]) -> Transcript {
        let mut transcript = Transcript {
            steps: Vec::new(),
            task: None,
            system: Vec::new(),
            calls: BTreeMap::new(),
        };
        for span in spans {
            let input = messages(span, "gen_ai.input.messages");
            if transcript.task.is_none() {
                transcript.task = input
                    .iter()
                    .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
                    .flat_map(|m| parts(m).iter().filter_map(part_text))
                    .next();
            }
            let system_messages = input
                .iter()
                .filter(|m| m.get("role").and_then(Value::as_str) == Some("system"))
                .map(|m| {
                    parts(m)
                        .iter()
                        .filter_map(part_text)
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .collect::<Vec<_>>();
            for text in system_instructions(span).into_iter().chain(system_messages) {
                if !text.is_empty() && !transcript.system.contains(&text) {
                    transcript.system.push(text);
                }
            }
            let timestamp = (span.start_ns > 0)
                .then_some((span.start_ns / 1_000_000) as i64)
                .filter(|&ms| crate::source::in_calendar(ms));
            if span.is_model_call() {
                transcript.answered_in_input(&input);
                transcript.model_call(span, timestamp);
            } else if span.operation() == "execute_tool" {
                transcript.tool_call(span, timestamp);
            }
        }
        transcript
    }

    /// A model call: a step per output message, its text the action, its tool calls the
    /// step's (their results come with the tool spans).
    fn model_call(&mut self, span: &SpanRec, timestamp: Option<i64>) {
        for message in messages(span, "gen_ai.output.messages") {
            let mut action = Vec::new();
            let mut tool_calls = Vec::new();
            for part in parts(&message) {
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => action.push(
                        part.get("content")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                    ),
                    Some("tool_call") => {
                        if let Some(id) = part.get("id").and_then(Value::as_str) {
                            self.calls
                                .insert(id.to_string(), (self.steps.len(), tool_calls.len()));
                        }
                        tool_calls.push(ToolCall {
                            name: part
                                .get("name")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string(),
                            arguments: part.get("arguments").map(text_of).unwrap_or_default(),
                            result: None,
                        });
                    }
                    _ => {}
                }
            }
            self.steps.push(Step {
                observation: String::new(),
                action: action.join("\n"),
                tool_calls,
                feedback: None,
                timestamp,
            });
        }
    }

    /// A tool's execution: the result of the call a model requested (by call id), or a step
    /// of its own when no model call requested it.
    fn tool_call(&mut self, span: &SpanRec, timestamp: Option<i64>) {
        let result = span.attributes.get("gen_ai.tool.call.result").map(text_of);
        // A failed tool's message: the status message, else the `exception` event's, else
        // `error.type`, else the result it returned, else just "error".
        let feedback =
            (span.status == 2 || span.attributes.contains_key("error.type")).then(|| {
                span.error_message()
                    .or_else(|| result.clone().filter(|m| !m.trim().is_empty()))
                    .unwrap_or_else(|| "error".to_string())
            });
        let requested = match span.text("gen_ai.tool.call.id") {
            Some(id) => self.calls.get(id).copied(),
            None => self.unanswered(span),
        };
        match requested {
            Some((s, c)) if self.steps[s].tool_calls[c].result.is_none() => {
                self.steps[s].tool_calls[c].result = result;
                if feedback.is_some() {
                    self.steps[s].feedback = feedback;
                }
            }
            _ => self.steps.push(Step {
                observation: String::new(),
                action: String::new(),
                tool_calls: vec![ToolCall {
                    name: span
                        .text("gen_ai.tool.name")
                        .unwrap_or(&span.locator)
                        .to_string(),
                    arguments: span
                        .attributes
                        .get("gen_ai.tool.call.arguments")
                        .map(text_of)
                        .unwrap_or_default(),
                    result,
                }],
                feedback,
                timestamp,
            }),
        }
    }

    /// The call a tool span without a call id answers: the first requested call of its tool
    /// with no result yet whose arguments are the span's (compared as JSON), else the first of
    /// its tool with no result.
    fn unanswered(&self, span: &SpanRec) -> Option<(usize, usize)> {
        let name = span.text("gen_ai.tool.name")?;
        let arguments = span
            .attributes
            .get("gen_ai.tool.call.arguments")
            .map(text_of);
        let json = |text: &str| serde_json::from_str::<Value>(text).ok();
        let wanted = arguments.as_deref().and_then(json);
        let open: Vec<(usize, usize)> = self
            .steps
            .iter()
            .enumerate()
            .flat_map(|(s, step)| {
                step.tool_calls
                    .iter()
                    .enumerate()
                    .filter(|(_, call)| call.name == name && call.result.is_none())
                    .map(move |(c, _)| (s, c))
            })
            .collect();
        open.iter()
            .copied()
            .find(|&(s, c)| {
                wanted.is_some() && json(&self.steps[s].tool_calls[c].arguments) == wanted
            })
            .or_else(|| open.first().copied())
    }

    /// The tool results a model call's input carries (`tool_call_response` parts, which an
    /// instrumentation without tool spans logs only there): each answers the requested call
    /// with its id that has no result yet.
    fn answered_in_input(&mut self, input: &[Value]) {
        for message in input {
            for part in parts(message) {
                if part.get("type").and_then(Value::as_str) != Some("tool_call_response") {
                    continue;
                }
                let Some(&(s, c)) = part
                    .get("id")
                    .and_then(Value::as_str)
                    .and_then(|id| self.calls.get(id))
                else {
                    continue;
                };
                let call = &mut self.steps[s].tool_calls[c];
                if call.result.is_none() {
                    call.result = part.get("response").map(text_of);
                }
            }
        }
    }
}

/// A span's `gen_ai.system_instructions` as text (its text parts, one per line).
fn system_instructions(span: &SpanRec) -> Option<String> {
    let instructions = span.attributes.get("gen_ai.system_instructions")?;
    let parsed: Vec<Value> = match instructions {
        Value::String(s) => serde_json::from_str(s)
            .unwrap_or_else(|_| vec![serde_json::json!({"type": "text", "content": s})]),
        Value::Array(a) => a.clone(),
        _ => Vec::new(),
    };
    let text: Vec<String> = parsed.iter().filter_map(part_text).collect();
    (!text.is_empty()).then(|| text.join("\n"))
}

/// The GenAI conventions' event with the result of evaluating an operation.
pub(crate) const EVALUATION_EVENT: &str = "gen_ai.evaluation.result";

/// Score labels that say an evaluated answer is right, and wrong (the conventions' examples and
/// their plain variants). Other labels, and a score value without a label (its scale is the
/// evaluator's), give no verdict.
const PASSING: [&str; 6] = ["pass", "passed", "correct", "relevant", "success", "true"];
const FAILING: [&str; 7] = [
    "fail",
    "failed",
    "incorrect",
    "not_relevant",
    "irrelevant",
    "failure",
    "false",
];

/// One evaluation event's verdict (from its score label) and its words: `name: label
/// (explanation)`.
pub(crate) fn evaluation(attributes: &BTreeMap<String, Value>) -> (Option<bool>, String) {
    let field = |k: &str| attributes.get(k).map(text_of).unwrap_or_default();
    let label = field("gen_ai.evaluation.score.label").to_lowercase();
    let verdict = if PASSING.contains(&label.as_str()) {
        Some(true)
    } else if FAILING.contains(&label.as_str()) {
        Some(false)
    } else {
        None
    };
    let mut said = format!("{}: {}", field("gen_ai.evaluation.name"), label);
    let explanation = field("gen_ai.evaluation.explanation");
    if !explanation.is_empty() {
        said.push_str(&format!(" ({explanation})"));
    }
    (verdict, said)
}

/// The verdict of a run's evaluation events: a failure when one says the answer is wrong, else
/// a success when one says it is right; with the first deciding event's words.
fn evaluated(spans: &[&SpanRec]) -> Option<(bool, String)> {
    let all: Vec<&(Option<bool>, String)> = spans.iter().flat_map(|s| &s.evaluations).collect();
    all.iter()
        .find(|(v, _)| *v == Some(false))
        .or_else(|| all.iter().find(|(v, _)| *v == Some(true)))
        .map(|(v, said)| (v == &Some(true), said.clone()))
}

/// The run's outcome with its evaluation events: an explicit outcome attribute and an ERROR
/// status stand; otherwise an evaluation's verdict is the outcome (logged, with its words as
/// feedback), before an OK status.
fn with_evaluation((outcome, from_status): (Outcome, bool), spans: &[&SpanRec]) -> (Outcome, bool) {
    let explicit = outcome.success.is_some() && !from_status;
    let errored = from_status && outcome.success == Some(false);
    match evaluated(spans) {
        Some((passed, said)) if !explicit && !errored => (
            Outcome {
                success: Some(passed),
                reward: outcome.reward,
                feedback: Some(format!("evaluation {said}")),
            },
            false,
        ),
        _ => (outcome, from_status),
    }
}

/// The outcome the last agent span gives, and whether its status (not an explicit
/// attribute) gave it.
fn outcome_of(agent: &SpanRec) -> (Outcome, bool) {
    let logged = agent
        .attributes
        .get("fluxmem.outcome.success")
        .and_then(Value::as_bool);
    let status = match agent.status {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    };
    let reward = agent
        .attributes
        .get("fluxmem.outcome.reward")
        .and_then(Value::as_f64);
    let feedback = (agent.status == 2 && !agent.status_message.is_empty())
        .then(|| agent.status_message.clone());
    let outcome = Outcome {
        success: logged.or(status),
        reward,
        feedback,
    };
    (outcome, logged.is_none() && status.is_some())
}

/// The outcome of a run with no agent span (client-side instrumentation): a failure when its
/// last model call failed (status ERROR: an HTTP error, a timeout), with that call's message;
/// else none (ingest's rule decides).
fn last_call_outcome(spans: &[&SpanRec]) -> (Outcome, bool) {
    match spans.iter().rev().find(|s| s.is_model_call()) {
        Some(call) if call.status == 2 => {
            let outcome = Outcome {
                success: Some(false),
                reward: None,
                feedback: call.error_message(),
            };
            (outcome, true)
        }
        _ => (Outcome::default(), false),
    }
}

/// The episode node's metadata: the format, where its outcome came from, and the spans,
/// traces and files it was read from.
fn describe(node: &mut Node, key: &str, spans: &[&SpanRec], lead: &SpanRec, from_status: bool) {
    let files: BTreeSet<&str> = spans.iter().map(|s| s.file.as_str()).collect();
    node.metadata.insert("format".into(), Value::from("otel"));
    if from_status {
        node.metadata
            .insert("outcome_source".into(), Value::from("status"));
    }
    node.metadata.insert("otel.group".into(), Value::from(key));
    node.metadata
        .insert("otel.spans".into(), Value::from(spans.len()));
    node.metadata.insert(
        "otel.traces".into(),
        Value::from(
            spans
                .iter()
                .map(|s| s.trace.as_str())
                .collect::<BTreeSet<_>>()
                .len(),
        ),
    );
    node.metadata.insert(
        "otel.files".into(),
        Value::Array(files.iter().map(|f| Value::from(*f)).collect()),
    );
    if let Some(id) = lead.text("gen_ai.conversation.id") {
        node.metadata
            .insert("conversation_id".into(), Value::from(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(status: i64, evaluations: &[(Option<bool>, &str)]) -> SpanRec {
        SpanRec {
            file: String::new(),
            locator: String::new(),
            mtime: None,
            trace: "t".into(),
            id: "s".into(),
            parent: None,
            start_ns: 0,
            attributes: BTreeMap::new(),
            resource: BTreeMap::new(),
            status,
            status_message: String::new(),
            exception: None,
            evaluations: evaluations
                .iter()
                .map(|(v, s)| (*v, s.to_string()))
                .collect(),
        }
    }

    #[test]
    fn an_evaluation_decides_the_outcome_unless_the_log_or_an_error_already_does() {
        let label = |l: &str| {
            let attributes: BTreeMap<String, Value> =
                [("gen_ai.evaluation.score.label".to_string(), Value::from(l))].into();
            evaluation(&attributes).0
        };
        assert_eq!(
            (label("PASS"), label("incorrect"), label("4")),
            (Some(true), Some(false), None)
        );
        let judged = |status: i64, evaluations: &[(Option<bool>, &str)]| {
            let agent = span(status, evaluations);
            with_evaluation(outcome_of(&agent), &[&agent])
        };
        // A failing verdict wins over a passing one, and over an OK status.
        let (outcome, from_status) =
            judged(1, &[(Some(true), "a: pass"), (Some(false), "b: fail")]);
        assert_eq!((outcome.success, from_status), (Some(false), false));
        assert_eq!(outcome.feedback.as_deref(), Some("evaluation b: fail"));
        // An ERROR status stands.
        let (outcome, from_status) = judged(2, &[(Some(true), "a: pass")]);
        assert_eq!((outcome.success, from_status), (Some(false), true));
        // No verdict: the status, or nothing.
        assert_eq!(judged(0, &[(None, "a: 4")]).0.success, None);
        // An explicit outcome attribute stands.
        let mut agent = span(0, &[(Some(false), "a: fail")]);
        agent
            .attributes
            .insert("fluxmem.outcome.success".into(), Value::from(true));
        let (outcome, _) = with_evaluation(outcome_of(&agent), &[&agent]);
        assert_eq!(outcome.success, Some(true));
    }
}
