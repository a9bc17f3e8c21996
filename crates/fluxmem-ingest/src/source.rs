//! What every parser knows about the file it reads.

use fluxmem_graph::{Node, NodeBody};
use serde_json::value::RawValue;

use crate::{IngestOptions, Parsed, Rejected};

/// One input file being parsed.
pub(crate) struct Source<'a> {
    /// The path as the user gave it (shown in errors and stored as `source_file`).
    pub path: String,
    /// The file's modification time (ms since epoch): `created_at` of records without a time.
    pub mtime: Option<i64>,
    /// Ingestion options.
    pub options: &'a IngestOptions,
    /// The whole file, for byte offset -> line lookups.
    pub bytes: &'a [u8],
}

impl<'a> Source<'a> {
    /// 1-based line of `offset` in the file, counting `\n`, `\r\n` and a lone `\r` as line
    /// ends (the same lines [`lines`] yields).
    pub fn line_at(&self, offset: usize) -> usize {
        let end = offset.min(self.bytes.len());
        let head = &self.bytes[..end];
        if !head.contains(&b'\r') {
            return 1 + head.iter().filter(|&&b| b == b'\n').count();
        }
        1 + (0..end).filter(|&i| ends_line(self.bytes, i)).count()
    }

    /// 1-based line where `raw` (a slice of this file's text) starts.
    pub fn line_of(&self, raw: &RawValue) -> usize {
        let start = raw.get().as_ptr() as usize - self.bytes.as_ptr() as usize;
        self.line_at(start)
    }

    /// A node from this file: tenant, agent and provenance filled in.
    pub fn node(
        &self,
        body: NodeBody,
        text: &str,
        identity: &[&str],
        locator: String,
        created_at: Option<i64>,
    ) -> Node {
        self.node_of(None, None, body, text, identity, locator, created_at)
    }

    /// A node from this file owned by `tenant` / `agent` when the record names them.
    #[allow(clippy::too_many_arguments)]
    pub fn node_of(
        &self,
        tenant: Option<&str>,
        agent: Option<&str>,
        body: NodeBody,
        text: &str,
        identity: &[&str],
        locator: String,
        created_at: Option<i64>,
    ) -> Node {
        let mut node = Node::new(body, tenant.unwrap_or(&self.options.tenant), text, identity);
        node.agent_id = agent
            .map(str::to_string)
            .or_else(|| self.options.agent_id.clone());
        node.source_file = self.path.clone();
        node.source_locator = locator;
        node.created_at = created_at.or(self.mtime);
        node
    }

    /// A rejection of `raw` at `line`.
    pub fn reject(
        &self,
        line: usize,
        locator: impl Into<String>,
        reason: impl Into<String>,
        raw: &[u8],
    ) -> Rejected {
        let rejected = Rejected::new(
            &self.path,
            line,
            locator,
            reason,
            raw,
            self.options.max_record_bytes,
        );
        // A record cut from the input knows where it sits in it.
        let start = self.bytes.as_ptr() as usize;
        let at = raw.as_ptr() as usize;
        if !raw.is_empty() && at >= start && at + raw.len() <= start + self.bytes.len() {
            rejected.at_offset(at - start)
        } else {
            rejected
        }
    }

    /// Rejects `raw` if it is over the record size limit.
    pub fn check_size(&self, line: usize, locator: &str, raw: &[u8]) -> Option<Parsed> {
        let limit = self.options.max_record_bytes;
        (raw.len() > limit).then(|| {
            Parsed::Rejected(self.reject(
                line,
                locator,
                format!(
                    "record is {} bytes, over the limit of {limit} (--max-record-bytes)",
                    raw.len()
                ),
                raw,
            ))
        })
    }
}

/// Parses `raw` as `T`, naming the offending field on failure.
///
/// `raw` must hold exactly one JSON value: anything but whitespace after it is an error
/// (`trailing content after the JSON value at column N`, columns in bytes from 1), never
/// dropped silently.
/// Runs `parse` on every non-blank line of a one-record-a-line file (JSONL, chat logs) with
/// the line's text and number; a line over the size limit, not UTF-8, or that `parse` refuses
/// (with the field and reason) is quarantined with its line, and the rest of the file goes on.
pub(crate) fn each_line(
    source: &Source,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
    mut parse: impl FnMut(&str, usize, &str) -> Result<Parsed, (String, String)>,
) -> crate::Result<()> {
    for (index, raw_line) in lines(source.bytes).enumerate() {
        let line_no = index + 1;
        if raw_line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let locator = format!("line {line_no}");
        if let Some(rejected) = source.check_size(line_no, &locator, raw_line) {
            emit(rejected)?;
            continue;
        }
        let parsed = match std::str::from_utf8(raw_line) {
            Err(e) => Parsed::Rejected(source.reject(
                line_no,
                &locator,
                format!("invalid UTF-8 at byte {} of the line", e.valid_up_to()),
                raw_line,
            )),
            Ok(text) => parse(text, line_no, &locator).unwrap_or_else(|(field, reason)| {
                Parsed::Rejected(
                    source
                        .reject(line_no, &locator, reason, raw_line)
                        .field(field),
                )
            }),
        };
        emit(parsed)?;
    }
    Ok(())
}

pub(crate) fn parse_at<'de, T: serde::Deserialize<'de>>(
    raw: &'de str,
) -> Result<T, (String, String)> {
    let mut deserializer = serde_json::Deserializer::from_str(raw);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        (field, strip_position(&inner.to_string()))
    })?;
    deserializer
        .end()
        .map_err(|e| (String::new(), trailing_reason(&e)))?;
    Ok(value)
}

/// The reason for content after the value; the line is named when the text has several.
fn trailing_reason(error: &serde_json::Error) -> String {
    let column = error.column();
    match error.line() {
        0 | 1 => format!("trailing content after the JSON value at column {column}"),
        line => format!("trailing content after the JSON value at column {column} of line {line}"),
    }
}

/// serde_json appends ` at line L column C` relative to the record; we report file lines.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message.to_string(),
    }
}

/// Whether `bytes[i]` ends a line: a `\n`, or a `\r` that is not the first half of `\r\n`.
fn ends_line(bytes: &[u8], i: usize) -> bool {
    match bytes[i] {
        b'\n' => true,
        b'\r' => bytes.get(i + 1) != Some(&b'\n'),
        _ => false,
    }
}

/// The byte ranges of the lines of `bytes`, without their terminators. Lines end at `\n`,
/// `\r\n` or a lone `\r` (old Mac files); a terminator at the very end does not start another
/// line and an empty input has no lines. The `i`-th range is line `i + 1` as
/// [`Source::line_at`] counts.
pub(crate) fn line_spans(bytes: &[u8]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= bytes.len() {
            return None;
        }
        let rest = &bytes[start..];
        let (len, terminator) = match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            Some(at) if rest[at] == b'\r' && rest.get(at + 1) == Some(&b'\n') => (at, 2),
            Some(at) => (at, 1),
            None => (rest.len(), 0),
        };
        let span = start..start + len;
        start += len + terminator;
        Some(span)
    })
}

/// The lines of `bytes` (see [`line_spans`]).
pub(crate) fn lines(bytes: &[u8]) -> impl Iterator<Item = &[u8]> + '_ {
    line_spans(bytes).map(move |span| &bytes[span])
}

/// The lines of `text` (see [`line_spans`]); like [`str::lines`], but a lone `\r` ends a line too.
pub(crate) fn str_lines(text: &str) -> impl Iterator<Item = &str> + '_ {
    // Spans end at ASCII bytes, so they always fall on character boundaries.
    line_spans(text.as_bytes()).map(move |span| text.get(span).unwrap_or_default())
}

/// The last millisecond timestamps may have: 9999-12-31T23:59:59.999Z.
pub(crate) const MAX_TIMESTAMP_MS: i64 = 253_402_300_799_999;

/// Whether `ms` (since the epoch) falls in the years 1970..=9999, the range every timestamp
/// the store writes must be in (DuckDB and Arrow readers reject the whole table otherwise).
pub(crate) fn in_calendar(ms: i64) -> bool {
    (0..=MAX_TIMESTAMP_MS).contains(&ms)
}

/// Milliseconds since the epoch of `field`, an RFC 3339 timestamp or an integer (ms since the
/// epoch), in the years 1970..=9999. Errors name `field`.
pub(crate) fn timestamp_ms(field: &str, value: &serde_json::Value) -> Result<i64, String> {
    let out_of_range = |shown: String| {
        format!("`{field}`: timestamp {shown} is outside the years 1970..=9999 (ms since the epoch must be in 0..={MAX_TIMESTAMP_MS})")
    };
    let ms = match value {
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(ms) => ms,
            None if n.is_u64() => return Err(out_of_range(n.to_string())),
            None => return Err(format!("`{field}`: timestamp {n} is not an integer of ms")),
        },
        serde_json::Value::String(s) => match chrono::DateTime::parse_from_rfc3339(s) {
            Ok(t) => t.timestamp_millis(),
            Err(e) => return Err(format!("`{field}`: timestamp `{s}` is not RFC 3339: {e}")),
        },
        other => {
            return Err(format!(
                "`{field}`: timestamp must be an RFC 3339 string or ms integer, got {other}"
            ))
        }
    };
    if in_calendar(ms) {
        Ok(ms)
    } else {
        Err(out_of_range(value.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_end_at_lf_crlf_and_lone_cr() {
        let bytes = b"a\nb\r\nc\rd\r\re\n";
        let got: Vec<&[u8]> = lines(bytes).collect();
        let want: [&[u8]; 6] = [b"a", b"b", b"c", b"d", b"", b"e"];
        assert_eq!(got, want);
        assert_eq!(lines(b"").count(), 0);
        let single: Vec<&[u8]> = lines(b"x").collect();
        assert_eq!(single, [&b"x"[..]]);
        assert_eq!(str_lines("one\rtwo\r").collect::<Vec<_>>(), ["one", "two"]);
        let options = IngestOptions::default();
        let source = Source {
            path: "f".into(),
            mtime: None,
            options: &options,
            bytes,
        };
        // Each line starts on the line `lines` numbers it.
        let starts: Vec<usize> = line_spans(bytes)
            .map(|span| source.line_at(span.start))
            .collect();
        assert_eq!(starts, [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn trailing_content_after_a_value_is_an_error() {
        let (_, reason) =
            parse_at::<serde_json::Value>(r#"{"task":"a"} {"task":"b"}"#).unwrap_err();
        assert_eq!(reason, "trailing content after the JSON value at column 14");
        let (_, reason) = parse_at::<serde_json::Value>("[1,\n2] x").unwrap_err();
        assert_eq!(
            reason,
            "trailing content after the JSON value at column 4 of line 2"
        );
        assert!(
            parse_at::<serde_json::Value>("{\"a\":1}  \t\r\n").is_ok(),
            "trailing whitespace is fine"
        );
    }

    #[test]
    fn timestamps_outside_the_calendar_are_refused() {
        use serde_json::json;
        assert_eq!(timestamp_ms("t", &json!(0)), Ok(0));
        assert_eq!(
            timestamp_ms("t", &json!(MAX_TIMESTAMP_MS)),
            Ok(MAX_TIMESTAMP_MS)
        );
        assert_eq!(timestamp_ms("t", &json!("1970-01-01T00:00:00Z")), Ok(0));
        for bad in [
            json!(i64::MAX),
            json!(-1),
            json!(MAX_TIMESTAMP_MS + 1),
            json!(u64::MAX),
            json!("1969-12-31T23:59:59Z"),
            json!("9999-12-31T23:59:59-01:00"),
        ] {
            let reason = timestamp_ms("started_at", &bad).unwrap_err();
            assert!(
                reason.contains("`started_at`") && reason.contains("outside the years 1970..=9999"),
                "{bad}: {reason}"
            );
        }
    }
}
