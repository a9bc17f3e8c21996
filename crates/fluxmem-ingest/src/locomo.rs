//! LoCoMo conversations: every dialogue turn becomes a semantic node. QA items, observations
//! and summaries are evaluation material or generated text, not memory, and are not ingested.

use fluxmem_graph::{NodeBody, Semantic};
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::BTreeMap;

use crate::jsonl::type_name;
use crate::source::{in_calendar, parse_at, Source};
use crate::{Parsed, Record};

/// Parses a LoCoMo file (a JSON array of conversations).
pub(crate) fn parse(
    source: &Source,
    text: &str,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let conversations: Vec<&RawValue> = match parse_at(text) {
        Ok(list) => list,
        Err((field, reason)) => {
            return emit(Parsed::Rejected(
                source
                    .reject(
                        1,
                        "file",
                        format!("not a LoCoMo array: {reason}"),
                        source.bytes,
                    )
                    .field(field),
            ))
        }
    };
    for (index, raw) in conversations.into_iter().enumerate() {
        conversation(source, index, raw, emit)?;
    }
    Ok(())
}

fn conversation(
    source: &Source,
    index: usize,
    raw: &RawValue,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let line = source.line_of(raw);
    let locator = format!("conversations[{index}]");
    let reject = |field: &str, reason: String| {
        Parsed::Rejected(
            source
                .reject(line, &locator, reason, raw.get().as_bytes())
                .field(field),
        )
    };
    let top: BTreeMap<String, &RawValue> = match parse_at(raw.get()) {
        Ok(top) => top,
        Err((field, reason)) => {
            return emit(reject(
                &field,
                format!("conversation is not an object: {reason}"),
            ))
        }
    };
    let sample_id = match top.get("sample_id").map(|v| parse_at::<String>(v.get())) {
        Some(Ok(id)) => id,
        _ => return emit(reject("sample_id", "missing or not a string".into())),
    };
    let Some(conversation_raw) = top.get("conversation") else {
        return emit(reject("conversation", "missing".into()));
    };
    let fields: BTreeMap<String, &RawValue> = match parse_at(conversation_raw.get()) {
        Ok(fields) => fields,
        Err((_, reason)) => return emit(reject("conversation", reason)),
    };
    let mut sessions: Vec<(u32, &RawValue)> = fields
        .iter()
        .filter_map(|(key, value)| {
            Some((key.strip_prefix("session_")?.parse::<u32>().ok()?, *value))
        })
        .collect();
    sessions.sort_by_key(|(number, _)| *number);
    let mut position = 0i64;
    for (number, session_raw) in sessions {
        let session_key = format!("session_{number}");
        let date_time: Option<String> = fields
            .get(&format!("{session_key}_date_time"))
            .and_then(|v| parse_at::<String>(v.get()).ok());
        let turns: Vec<&RawValue> = match parse_at(session_raw.get()) {
            Ok(turns) => turns,
            Err((_, reason)) => {
                let line = source.line_of(session_raw);
                let rejected = source.reject(
                    line,
                    format!("{sample_id}/{session_key}"),
                    reason,
                    session_raw.get().as_bytes(),
                );
                emit(Parsed::Rejected(
                    rejected.field(format!("conversation.{session_key}")),
                ))?;
                continue;
            }
        };
        let created_at = date_time.as_deref().and_then(parse_session_time);
        let bad_time = created_at.filter(|&ms| !in_calendar(ms)).map(|_| {
            let shown = date_time.as_deref().unwrap_or_default();
            format!("`conversation.{session_key}_date_time`: session time `{shown}` is outside the years 1970..=9999")
        });
        for (turn_index, turn_raw) in turns.into_iter().enumerate() {
            let turn = Turn {
                sample_id: &sample_id,
                session_key: &session_key,
                date_time: &date_time,
                created_at,
                bad_time: bad_time.as_deref(),
                turn_index,
                position,
            };
            emit(turn.parse(source, turn_raw))?;
            position += 1;
        }
    }
    Ok(())
}

struct Turn<'a> {
    sample_id: &'a str,
    session_key: &'a str,
    date_time: &'a Option<String>,
    created_at: Option<i64>,
    /// Why the session's time cannot be stored (outside the years 1970..=9999): every turn of
    /// the session is quarantined with it.
    bad_time: Option<&'a str>,
    turn_index: usize,
    position: i64,
}

impl Turn<'_> {
    fn parse(&self, source: &Source, raw: &RawValue) -> Parsed {
        let line = source.line_of(raw);
        let fallback = format!(
            "{}/{}[{}]",
            self.sample_id, self.session_key, self.turn_index
        );
        if let Some(rejected) = source.check_size(line, &fallback, raw.get().as_bytes()) {
            return rejected;
        }
        let reject = |field: &str, reason: String| {
            Parsed::Rejected(
                source
                    .reject(line, &fallback, reason, raw.get().as_bytes())
                    .field(field),
            )
        };
        if let Some(reason) = self.bad_time {
            return reject(
                &format!("conversation.{}_date_time", self.session_key),
                reason.to_string(),
            );
        }
        let object: BTreeMap<String, Value> = match parse_at(raw.get()) {
            Ok(object) => object,
            Err((_, reason)) => return reject("", format!("turn is not an object: {reason}")),
        };
        let string = |key: &str| object.get(key).and_then(Value::as_str);
        let Some(dia_id) = string("dia_id") else {
            return reject(
                "dia_id",
                format!(
                    "missing or not a string ({})",
                    object.get("dia_id").map_or("missing", type_name)
                ),
            );
        };
        let Some(speaker) = string("speaker") else {
            return reject("speaker", "missing or not a string".into());
        };
        let Some(said) = string("text") else {
            return reject(
                "text",
                format!(
                    "missing or not a string ({})",
                    object.get("text").map_or("missing", type_name)
                ),
            );
        };
        let mut text = format!("{speaker}: {said}");
        if let Some(caption) = string("blip_caption") {
            text.push_str(&format!(" [shares a photo: {caption}]"));
        }
        let locator = format!("{}/{dia_id}", self.sample_id);
        let body = NodeBody::Semantic(Semantic {
            source: self.sample_id.to_string(),
            position: self.position,
            time: self.date_time.clone(),
            group: Some(self.session_key.to_string()),
        });
        let mut node = source.node(
            body,
            &text,
            &[self.sample_id, dia_id, &text],
            locator,
            self.created_at,
        );
        node.metadata = object
            .into_iter()
            .filter(|(key, _)| key != "text")
            .collect();
        Parsed::Record(Record { nodes: vec![node] })
    }
}

/// Parses LoCoMo's session times (`1:56 pm on 8 May, 2023`) as UTC milliseconds.
pub(crate) fn parse_session_time(text: &str) -> Option<i64> {
    let normalized = text.trim().to_uppercase();
    chrono::NaiveDateTime::parse_from_str(&normalized, "%I:%M %p ON %d %B, %Y")
        .ok()
        .map(|t| t.and_utc().timestamp_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_times_parse() {
        let ms = parse_session_time("1:56 pm on 8 May, 2023").expect("parses");
        let expected = chrono::NaiveDate::from_ymd_opt(2023, 5, 8)
            .unwrap()
            .and_hms_opt(13, 56, 0)
            .unwrap();
        assert_eq!(ms, expected.and_utc().timestamp_millis());
        assert!(parse_session_time("yesterday").is_none());
        assert!(
            !in_calendar(parse_session_time("1:56 pm on 8 May, 1969").expect("parses")),
            "before 1970"
        );
    }
}
