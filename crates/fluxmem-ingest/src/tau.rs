//! tau-bench runs: one episode per run. Assistant messages are actions, user messages and tool
//! results are observations, the reward is the outcome. The system prompt (the domain policy)
//! is chunked into semantic nodes, shared by every run that carries the same prompt.
//!
//! `info.task` (the user simulator's hidden instruction and the gold actions) and
//! `info.reward_info` are evaluation labels, not something the agent saw: they are not stored,
//! and the episode's metadata lists them under `omitted_fields` so the omission is not silent.

use fluxmem_graph::{sha256_hex, Episode, NodeBody, Outcome, Semantic, Step, ToolCall};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::BTreeMap;

use crate::chat::{attach_result, push_observation, scalar_text};
use crate::docs::chunk;
use crate::source::{parse_at, Source};
use crate::{Parsed, Record};

#[derive(Deserialize)]
struct Run {
    task_id: Value,
    #[serde(default)]
    trial: Option<Value>,
    reward: f64,
    traj: Vec<Message>,
    #[serde(default)]
    info: BTreeMap<String, Value>,
}

type Message = crate::chat::Message<String>;

/// Parses a tau-bench results file (a JSON array of runs).
pub(crate) fn parse(
    source: &Source,
    text: &str,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let runs: Vec<&RawValue> = match parse_at(text) {
        Ok(runs) => runs,
        Err((field, reason)) => {
            let rejected = source.reject(
                1,
                "file",
                format!("not a tau-bench array: {reason}"),
                source.bytes,
            );
            return emit(Parsed::Rejected(rejected.field(field)));
        }
    };
    for (index, raw) in runs.into_iter().enumerate() {
        let line = source.line_of(raw);
        let locator = format!("runs[{index}]");
        if let Some(rejected) = source.check_size(line, &locator, raw.get().as_bytes()) {
            emit(rejected)?;
            continue;
        }
        let parsed = match parse_at::<Run>(raw.get()) {
            Ok(run) => Parsed::Record(run_record(source, &locator, run)),
            Err((field, reason)) => Parsed::Rejected(
                source
                    .reject(line, &locator, reason, raw.get().as_bytes())
                    .field(field),
            ),
        };
        emit(parsed)?;
    }
    Ok(())
}

fn run_record(source: &Source, locator: &str, run: Run) -> Record {
    let task_id = scalar_text(&run.task_id);
    let trial = run.trial.as_ref().map(scalar_text).unwrap_or_default();
    let trajectory_hash = sha256_hex(
        serde_json::to_string(&run.traj.iter().map(message_key).collect::<Vec<_>>())
            .unwrap_or_default()
            .as_bytes(),
    );
    let mut steps: Vec<Step> = Vec::new();
    // Per step, the ids of its calls (the same order as its `tool_calls`).
    let call_ids: Vec<Vec<Option<String>>> = run
        .traj
        .iter()
        .filter(|m| m.role == "assistant")
        .map(|m| {
            m.tool_calls
                .iter()
                .flatten()
                .map(|c| c.id.clone())
                .collect()
        })
        .collect();
    let mut observation = String::new();
    let mut policy = None;
    let mut task = None;
    for message in &run.traj {
        let content = message.content.clone().unwrap_or_default();
        match message.role.as_str() {
            "system" => policy = Some(content),
            "assistant" => {
                let tool_calls = message.tool_calls.iter().flatten().map(|call| ToolCall {
                    name: call.function.name.clone(),
                    arguments: match &call.function.arguments {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    },
                    result: None,
                });
                steps.push(Step {
                    observation: std::mem::take(&mut observation),
                    action: content,
                    tool_calls: tool_calls.collect(),
                    feedback: None,
                    timestamp: None,
                });
            }
            "tool" => {
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
            _ => {
                if task.is_none() && message.role == "user" {
                    task = Some(content.clone());
                }
                push_observation(&mut observation, &format!("[{}] {content}", message.role));
            }
        }
    }
    if !observation.is_empty() {
        steps.push(Step {
            observation,
            ..Step::default()
        });
    }
    let success = run.reward >= 1.0 - 1e-9;
    let outcome = Outcome {
        success: Some(success),
        reward: Some(run.reward),
        feedback: None,
    };
    let task = task.unwrap_or_default();
    let mut metadata = BTreeMap::new();
    metadata.insert("task_id".to_string(), run.task_id.clone());
    if let Some(trial) = &run.trial {
        metadata.insert("trial".to_string(), trial.clone());
    }
    for (key, value) in &run.info {
        if key != "task" && key != "reward_info" {
            metadata.insert(format!("info.{key}"), value.clone());
        }
    }
    let omitted: Vec<Value> = ["info.task", "info.reward_info"]
        .iter()
        .filter(|k| run.info.contains_key(&k[5..]))
        .map(|k| Value::from(*k))
        .collect();
    metadata.insert("omitted_fields".into(), Value::Array(omitted));
    let mut episode = source.node(
        NodeBody::Episodic(Episode { steps, outcome }),
        &task,
        &["tau-bench", &task_id, &trial, &trajectory_hash],
        locator.to_string(),
        None,
    );
    episode.metadata = metadata;
    let mut nodes = vec![episode];
    if let Some(policy) = policy {
        nodes.extend(policy_nodes(
            source,
            &format!("{locator}.traj[0]"),
            &policy,
            None,
            None,
        ));
    }
    Record { nodes }
}

/// The system prompt as semantic chunks; the source name is content-derived, so every run
/// (in any file) carrying the same prompt shares the same nodes (within a tenant: `tenant`, or
/// the ingest options'; `agent`, else the options', names who logged it).
pub(crate) fn policy_nodes(
    source: &Source,
    locator: &str,
    policy: &str,
    tenant: Option<&str>,
    agent: Option<&str>,
) -> Vec<fluxmem_graph::Node> {
    let name = format!("system-prompt-{}", &sha256_hex(policy.as_bytes())[..12]);
    chunk(policy, source.options.chunk_words)
        .into_iter()
        .enumerate()
        .map(|(position, chunk)| {
            let body = NodeBody::Semantic(Semantic {
                source: name.clone(),
                position: position as i64,
                time: None,
                group: chunk.section.clone(),
            });
            let chunk_locator = format!(
                "{locator} chunk {position} (line {} of the prompt)",
                chunk.line
            );
            source.node_of(
                tenant,
                agent,
                body,
                &chunk.text,
                &[&name, &position.to_string(), &chunk.text],
                chunk_locator,
                None,
            )
        })
        .collect()
}

fn message_key(message: &Message) -> Value {
    serde_json::json!({
        "role": message.role,
        "content": message.content,
        "tool_calls": message.tool_calls.as_ref().map(|calls| calls.iter().map(|c| (c.function.name.clone(), c.function.arguments.clone())).collect::<Vec<_>>()),
        "tool_call_id": message.tool_call_id,
    })
}
