//! ALFWorld transcripts (the ReAct prompt set): a JSON object from a name
//! (`react_<type>_<i>`, `act_<type>_<i>`) to one transcript: the room, `Your task is to: ...`,
//! then `> action` lines each followed by the environment's observation.
//!
//! The transcripts are expert demonstrations that reach their goal, so episodes are stored
//! with `success: true`, `metadata.outcome_source = "logged"` and `metadata.outcome_rule =
//! "expert demonstration"`.

use fluxmem_graph::{sha256_hex, Episode, NodeBody, Outcome, Step};
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::BTreeMap;

use crate::jsonl::type_name;
use crate::source::{parse_at, Source};
use crate::{Parsed, Record};

const TASK_MARKER: &str = "Your task is to:";

/// Parses an ALFWorld transcript file.
pub(crate) fn parse(
    source: &Source,
    text: &str,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let entries: BTreeMap<String, &RawValue> = match parse_at(text) {
        Ok(entries) => entries,
        Err((field, reason)) => {
            let rejected = source.reject(
                1,
                "file",
                format!("not an ALFWorld object: {reason}"),
                source.bytes,
            );
            return emit(Parsed::Rejected(rejected.field(field)));
        }
    };
    // Report in file order, not key order, so line numbers read naturally.
    let mut entries: Vec<(String, &RawValue)> = entries.into_iter().collect();
    entries.sort_by_key(|(_, raw)| raw.get().as_ptr() as usize);
    for (name, raw) in entries {
        let line = source.line_of(raw);
        if let Some(rejected) = source.check_size(line, &name, raw.get().as_bytes()) {
            emit(rejected)?;
            continue;
        }
        let parsed = match parse_at::<Value>(raw.get()) {
            Ok(Value::String(transcript)) => match transcript_record(source, &name, &transcript) {
                Ok(record) => Parsed::Record(record),
                Err(reason) => Parsed::Rejected(
                    source
                        .reject(line, &name, reason, raw.get().as_bytes())
                        .field(&name),
                ),
            },
            Ok(other) => Parsed::Rejected(
                source
                    .reject(
                        line,
                        &name,
                        format!("transcript must be a string, got {}", type_name(&other)),
                        raw.get().as_bytes(),
                    )
                    .field(&name),
            ),
            Err((_, reason)) => Parsed::Rejected(
                source
                    .reject(line, &name, reason, raw.get().as_bytes())
                    .field(&name),
            ),
        };
        emit(parsed)?;
    }
    Ok(())
}

/// The words of a transcript's `Your task is to:` line after the marker, trimmed (its closing
/// period kept); `None` without such a line.
pub fn task_line(transcript: &str) -> Option<&str> {
    let task_at = transcript.find(TASK_MARKER)?;
    let line = transcript[task_at..].lines().next().unwrap_or_default();
    Some(line[TASK_MARKER.len()..].trim())
}

/// Splits a transcript into the task and its steps.
pub(crate) fn split_transcript(transcript: &str) -> Result<(String, Vec<Step>), String> {
    let Some(task_line) = task_line(transcript) else {
        return Err(format!("no `{TASK_MARKER}` line in the transcript"));
    };
    let task = task_line.trim_end_matches('.').to_string();
    let mut steps = Vec::new();
    let mut observation = String::new();
    for line in transcript.lines() {
        match line.trim_start().strip_prefix("> ") {
            Some(action) => steps.push(Step {
                observation: std::mem::take(&mut observation).trim().to_string(),
                action: action.trim().to_string(),
                ..Step::default()
            }),
            None => {
                observation.push_str(line);
                observation.push('\n');
            }
        }
    }
    if steps.is_empty() {
        return Err("no `> action` lines in the transcript".into());
    }
    let last = observation.trim();
    if !last.is_empty() {
        steps.push(Step {
            observation: last.to_string(),
            ..Step::default()
        });
    }
    Ok((task, steps))
}

fn transcript_record(source: &Source, name: &str, transcript: &str) -> Result<Record, String> {
    let (task, steps) = split_transcript(transcript)?;
    let outcome = Outcome {
        success: Some(true),
        reward: Some(1.0),
        feedback: None,
    };
    let mut node = source.node(
        NodeBody::Episodic(Episode { steps, outcome }),
        &task,
        &["alfworld", name, &sha256_hex(transcript.as_bytes())],
        name.to_string(),
        None,
    );
    // The trajectory's name (its `source_locator`) encodes the benchmark's task type, an
    // evaluation label: nothing of it goes into the metadata, where a stage could read it.
    // The file says these runs reach their goal: a logged outcome, of a demonstration.
    node.metadata
        .insert("outcome_source".into(), Value::from("logged"));
    node.metadata
        .insert("outcome_rule".into(), Value::from("expert demonstration"));
    Ok(Record { nodes: vec![node] })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transcript_splits_into_steps() {
        let text = "You are in a room.\nYour task is to: put a clean lettuce in diningtable.\n> go to fridge 1\nThe fridge 1 is closed.\n> think: ok\nOK.\n";
        let (task, steps) = split_transcript(text).unwrap();
        assert_eq!(task, "put a clean lettuce in diningtable");
        assert_eq!(steps.len(), 3);
        assert!(steps[0].observation.starts_with("You are in a room."));
        assert_eq!(steps[0].action, "go to fridge 1");
        assert_eq!(steps[1].observation, "The fridge 1 is closed.");
        assert_eq!(steps[1].action, "think: ok");
        assert_eq!(steps[2].observation, "OK.");
        assert_eq!(steps[2].action, "");
        assert!(split_transcript("no task here").is_err());
    }
}
