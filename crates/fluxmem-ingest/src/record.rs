use fluxmem_graph::Node;
use serde::Serialize;

/// One input record turned into nodes. The first node is the record's own (its id decides
/// whether the record is a duplicate); the rest are derived from it (for example the policy
/// chunks of a tau-bench system prompt) and are added when not yet stored.
#[derive(Debug, Clone)]
pub struct Record {
    /// The record's nodes, own node first.
    pub nodes: Vec<Node>,
}

/// A record that could not be ingested, with everything needed to find and fix it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rejected {
    /// The input file.
    pub file: String,
    /// 1-based line where the record starts (0 when unknown).
    pub line: usize,
    /// The record inside the file (`conv-26/D1:3`, `runs[4]`), when more precise than a line.
    pub locator: String,
    /// The offending field (`steps[2].observation`), when one field is to blame.
    pub field: Option<String>,
    /// What is wrong.
    pub reason: String,
    /// The record as read (lossy UTF-8), its first [`EXCERPT_BYTES`] at most (less where the
    /// record size limit is lower); the whole record stays in the input file, found by
    /// `offset`, `bytes` and `sha256`.
    pub raw: String,
    /// The excerpt's exact bytes in hex when they are not valid UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_hex: Option<String>,
    /// The whole record's length in bytes.
    pub bytes: usize,
    /// SHA-256 of the whole record's bytes.
    pub sha256: String,
    /// Byte offset of the record in the (decompressed) input, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<usize>,
}

/// Most bytes of a rejected record kept in the quarantine file: a few KB say what the record
/// is; its length, hash and offset find the rest in the input (a file of huge bad records must
/// not make a quarantine file as large, or larger once escaped).
pub const EXCERPT_BYTES: usize = 4096;

/// What a parser hands to the ingestion driver for each record it reads.
#[derive(Debug, Clone)]
pub enum Parsed {
    /// A good record.
    Record(Record),
    /// A bad record, to quarantine.
    Rejected(Rejected),
}

impl Rejected {
    /// A rejection of `raw` at `file`:`line`.
    pub fn new(
        file: &str,
        line: usize,
        locator: impl Into<String>,
        reason: impl Into<String>,
        raw: &[u8],
        cap: usize,
    ) -> Self {
        let mut end = raw.len().min(cap).min(EXCERPT_BYTES);
        // Do not cut a UTF-8 character in half (that would make valid input look invalid).
        while end < raw.len() && end > 0 && (raw[end] & 0b1100_0000) == 0b1000_0000 {
            end -= 1;
        }
        let whole = raw;
        let capped = &raw[..end];
        let (raw, raw_hex) = match std::str::from_utf8(capped) {
            Ok(text) => (text.to_string(), None),
            Err(_) => (
                String::from_utf8_lossy(capped).into_owned(),
                Some(hex(capped)),
            ),
        };
        Rejected {
            file: file.into(),
            line,
            locator: locator.into(),
            field: None,
            reason: reason.into(),
            raw,
            raw_hex,
            bytes: whole.len(),
            sha256: fluxmem_graph::sha256_hex(whole),
            offset: None,
        }
    }

    /// One line for a person: `file:line (locator, field f): reason`.
    pub fn describe(&self) -> String {
        let field = self
            .field
            .as_deref()
            .map(|f| format!(", field {f}"))
            .unwrap_or_default();
        format!(
            "{}:{} ({}{}): {}",
            self.file, self.line, self.locator, field, self.reason
        )
    }

    /// The same rejection, at byte `offset` of its input.
    pub fn at_offset(mut self, offset: usize) -> Self {
        self.offset = Some(offset);
        self
    }

    /// The same rejection, blaming `field`.
    pub fn field(mut self, field: impl Into<String>) -> Self {
        let field = field.into();
        if !field.is_empty() && field != "." && field != "?" {
            self.field = Some(field);
        }
        self
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Serialises a path as text, lossily where it is not UTF-8 (serde's own refuses such a path,
/// and a report must not fail after its data was committed).
pub(crate) fn lossy_path<S: serde::Serializer>(
    path: &std::path::Path,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    serializer.serialize_str(&path.to_string_lossy())
}

/// [`lossy_path`] of an optional path (`null` when absent).
pub(crate) fn lossy_optional_path<S: serde::Serializer>(
    path: &Option<std::path::PathBuf>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    match path {
        Some(path) => lossy_path(path, serializer),
        None => serializer.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    /// A report names a file whose name is not UTF-8 instead of failing to print.
    #[cfg(unix)]
    #[test]
    fn a_report_prints_a_path_that_is_not_utf8() {
        use std::os::unix::ffi::OsStrExt;
        let path = std::path::PathBuf::from(std::ffi::OsStr::from_bytes(b"logs/a\xffb.jsonl"));
        assert!(
            serde_json::to_value(&path).is_err(),
            "serde's own refuses it"
        );
        let report = crate::IngestReport {
            quarantine_file: Some(path.clone()),
            skipped: vec![crate::Skipped {
                path,
                reason: "a link".into(),
            }],
            ..Default::default()
        };
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["quarantine_file"], "logs/a\u{fffd}b.jsonl");
        assert_eq!(json["skipped"][0]["path"], "logs/a\u{fffd}b.jsonl");
        let empty = serde_json::to_value(crate::IngestReport::default()).unwrap();
        assert_eq!(empty["quarantine_file"], serde_json::Value::Null);
    }
}
