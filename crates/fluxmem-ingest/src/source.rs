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
    /// 1-based line of `offset` in the file.
    pub fn line_at(&self, offset: usize) -> usize {
        1 + self.bytes[..offset.min(self.bytes.len())].iter().filter(|&&b| b == b'\n').count()
    }

    /// 1-based line where `raw` (a slice of this file's text) starts.
    pub fn line_of(&self, raw: &RawValue) -> usize {
        let start = raw.get().as_ptr() as usize - self.bytes.as_ptr() as usize;
        self.line_at(start)
    }

    /// A node from this file: tenant, agent and provenance filled in.
    pub fn node(&self, body: NodeBody, text: &str, identity: &[&str], locator: String, created_at: Option<i64>) -> Node {
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
        node.agent_id = agent.map(str::to_string).or_else(|| self.options.agent_id.clone());
        node.source_file = self.path.clone();
        node.source_locator = locator;
        node.created_at = created_at.or(self.mtime);
        node
    }

    /// A rejection of `raw` at `line`.
    pub fn reject(&self, line: usize, locator: impl Into<String>, reason: impl Into<String>, raw: &[u8]) -> Rejected {
        Rejected::new(&self.path, line, locator, reason, raw, self.options.max_record_bytes)
    }

    /// Rejects `raw` if it is over the record size limit.
    pub fn check_size(&self, line: usize, locator: &str, raw: &[u8]) -> Option<Parsed> {
        let limit = self.options.max_record_bytes;
        (raw.len() > limit).then(|| {
            Parsed::Rejected(self.reject(
                line,
                locator,
                format!("record is {} bytes, over the limit of {limit} (--max-record-bytes)", raw.len()),
                raw,
            ))
        })
    }
}

/// Parses `raw` as `T`, naming the offending field on failure.
pub(crate) fn parse_at<'de, T: serde::Deserialize<'de>>(raw: &'de str) -> Result<T, (String, String)> {
    let mut deserializer = serde_json::Deserializer::from_str(raw);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        (field, strip_position(&inner.to_string()))
    })
}

/// serde_json appends ` at line L column C` relative to the record; we report file lines.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message.to_string(),
    }
}

/// Milliseconds since the epoch of an RFC 3339 timestamp or an integer (ms since epoch).
pub(crate) fn timestamp_ms(value: &serde_json::Value) -> Result<i64, String> {
    match value {
        serde_json::Value::Number(n) => n.as_i64().ok_or_else(|| format!("timestamp {n} is not an integer of ms")),
        serde_json::Value::String(s) => chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| t.timestamp_millis())
            .map_err(|e| format!("timestamp `{s}` is not RFC 3339: {e}")),
        other => Err(format!("timestamp must be an RFC 3339 string or ms integer, got {other}")),
    }
}
