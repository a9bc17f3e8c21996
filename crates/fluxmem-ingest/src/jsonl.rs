//! fluxmem's own JSONL trajectory format: one episode (or fact) per line.
//! The schema is documented in `docs/trajectory-schema.md`.

use fluxmem_graph::{Episode, NodeBody, Outcome, Semantic, Step, ToolCall};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;

use crate::source::{each_line, parse_at, timestamp_ms, Source};
use crate::{Parsed, Record};

#[derive(Deserialize)]
struct Probe {
    #[serde(rename = "type", default)]
    kind: Option<String>,
}

#[derive(Deserialize)]
struct EpisodeRecord {
    task: String,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    agent_id: Option<String>,
    #[serde(default)]
    episode_id: Option<String>,
    #[serde(default)]
    started_at: Option<Value>,
    #[serde(default)]
    steps: Vec<StepRecord>,
    #[serde(default)]
    outcome: OutcomeRecord,
    #[serde(default)]
    metadata: BTreeMap<String, Value>,
    #[serde(flatten)]
    extra: BTreeMap<String, Value>,
}

#[derive(Deserialize)]
struct StepRecord {
    #[serde(default)]
    observation: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    tool_calls: Vec<ToolCallRecord>,
    #[serde(default)]
    feedback: Option<String>,
    #[serde(default)]
    timestamp: Option<Value>,
}

#[derive(Deserialize)]
struct ToolCallRecord {
    name: String,
    #[serde(default)]
    arguments: Value,
    #[serde(default)]
    result: Option<Value>,
}

#[derive(Deserialize, Default)]
struct OutcomeRecord {
    #[serde(default)]
    success: Option<bool>,
    #[serde(default)]
    reward: Option<f64>,
    #[serde(default)]
    feedback: Option<String>,
}

#[derive(Deserialize)]
struct FactRecord {
    text: String,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    agent_id: Option<String>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    position: Option<i64>,
    #[serde(default)]
    time: Option<String>,
    #[serde(default)]
    section: Option<String>,
    #[serde(default)]
    metadata: BTreeMap<String, Value>,
    #[serde(flatten)]
    extra: BTreeMap<String, Value>,
}

/// Parses a JSONL file, one record per non-blank line. Lines end at `\n`, `\r\n` or a lone
/// `\r`; a line must hold exactly one JSON value (content after it quarantines the line).
pub(crate) fn parse(
    source: &Source,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    each_line(source, emit, |text, line_no, _| {
        parse_line(source, line_no, text)
    })
}

fn parse_line(source: &Source, line_no: usize, text: &str) -> Result<Parsed, (String, String)> {
    let value: Value = parse_at(text)?;
    if !value.is_object() {
        return Err((
            String::new(),
            format!("a record must be a JSON object, got {}", type_name(&value)),
        ));
    }
    let probe: Probe = parse_at(text)?;
    let canonical = value.to_string();
    match probe.kind.as_deref().unwrap_or("episode") {
        "episode" => episode(source, line_no, text, &canonical),
        "fact" => fact(source, line_no, text),
        other => Err((
            "type".into(),
            format!("unknown record type `{other}` (expected `episode` or `fact`)"),
        )),
    }
}

fn episode(
    source: &Source,
    line_no: usize,
    text: &str,
    canonical: &str,
) -> Result<Parsed, (String, String)> {
    let mut record: EpisodeRecord = parse_at(text)?;
    let started_at = optional_timestamp("started_at".into(), record.started_at.as_ref())?;
    let mut steps = Vec::with_capacity(record.steps.len());
    for (index, step) in record.steps.into_iter().enumerate() {
        let timestamp =
            optional_timestamp(format!("steps[{index}].timestamp"), step.timestamp.as_ref())?;
        steps.push(Step {
            observation: step.observation,
            action: step.action,
            tool_calls: step
                .tool_calls
                .into_iter()
                .map(|call| ToolCall {
                    name: call.name,
                    arguments: json_text(call.arguments),
                    result: call.result.map(json_text),
                })
                .collect(),
            feedback: step.feedback,
            timestamp,
        });
    }
    record.extra.remove("type");
    let mut metadata = record.metadata;
    merge_extra(&mut metadata, record.extra);
    let outcome = Outcome {
        success: record.outcome.success,
        reward: record.outcome.reward,
        feedback: record.outcome.feedback,
    };
    let episode_id = record.episode_id.unwrap_or_default();
    if !episode_id.is_empty() {
        metadata.insert("episode_id".into(), Value::String(episode_id.clone()));
    }
    let mut node = source.node_of(
        record.tenant.as_deref(),
        record.agent_id.as_deref(),
        NodeBody::Episodic(Episode { steps, outcome }),
        &record.task,
        &["episode", &episode_id, canonical],
        format!("line {line_no}"),
        started_at,
    );
    node.metadata = metadata;
    Ok(Parsed::Record(Record { nodes: vec![node] }))
}

fn fact(source: &Source, line_no: usize, text: &str) -> Result<Parsed, (String, String)> {
    let mut record: FactRecord = parse_at(text)?;
    record.extra.remove("type");
    let name = source
        .path
        .rsplit('/')
        .next()
        .unwrap_or(&source.path)
        .to_string();
    let origin = record.source.unwrap_or(name);
    let position = record.position.unwrap_or(line_no as i64 - 1);
    let mut metadata = record.metadata;
    merge_extra(&mut metadata, record.extra);
    let mut node = source.node_of(
        record.tenant.as_deref(),
        record.agent_id.as_deref(),
        NodeBody::Semantic(Semantic {
            source: origin.clone(),
            position,
            time: record.time,
            group: record.section,
        }),
        &record.text,
        &[&origin, &position.to_string(), &record.text],
        format!("line {line_no}"),
        None,
    );
    node.metadata = metadata;
    Ok(Parsed::Record(Record { nodes: vec![node] }))
}

/// The timestamp in `field`, if the record has one; an error names the field (it must be in the
/// years 1970..=9999, see [`timestamp_ms`]).
fn optional_timestamp(
    field: String,
    value: Option<&Value>,
) -> Result<Option<i64>, (String, String)> {
    match value {
        None => Ok(None),
        Some(value) => match timestamp_ms(&field, value) {
            Ok(ms) => Ok(Some(ms)),
            Err(reason) => Err((field, reason)),
        },
    }
}

/// Adds unknown top-level fields to the metadata; a name the metadata already uses is kept
/// under `field:<name>` so neither value is lost.
fn merge_extra(metadata: &mut BTreeMap<String, Value>, extra: BTreeMap<String, Value>) {
    for (key, value) in extra {
        let key = if metadata.contains_key(&key) {
            format!("field:{key}")
        } else {
            key
        };
        metadata.insert(key, value);
    }
}

fn json_text(value: Value) -> String {
    match value {
        Value::String(s) => s,
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

pub(crate) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
