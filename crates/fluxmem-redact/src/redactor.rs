//! The [`Redactor`]: runs the detectors, resolves overlaps, writes placeholders.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::scan::{self, Candidate};
use crate::{Counts, Kind, RedactConfig};

/// Most passes over one text. A pass replaces matches with placeholders, which no detector
/// matches, so each pass that changes something removes original bytes and the passes end;
/// the second pass finds nothing in practice. Repeating until nothing changes is what makes
/// `redact(redact(x)) == redact(x)` hold even where a replacement changes a neighbour's
/// context.
const MAX_PASSES: usize = 8;

/// A text with its sensitive parts replaced, and how many of each kind there were.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redacted {
    /// The redacted text.
    pub text: String,
    /// What was replaced.
    pub counts: Counts,
}

/// Replaces emails, phone numbers, card numbers, IBANs, secrets and IP addresses with
/// placeholders, as configured. Cheap to share: redacting needs only `&self`.
#[derive(Debug, Clone)]
pub struct Redactor {
    config: RedactConfig,
    /// The non-empty allowed strings.
    allow: BTreeSet<String>,
}

impl Default for Redactor {
    /// Every kind, nothing allowed.
    fn default() -> Redactor {
        Redactor::new(RedactConfig::default())
    }
}

impl Redactor {
    /// A redactor for `config`.
    pub fn new(config: RedactConfig) -> Redactor {
        let allow = config
            .allow
            .iter()
            .filter(|entry| !entry.is_empty())
            .cloned()
            .collect();
        Redactor { config, allow }
    }

    /// The configuration this redactor was built from.
    pub fn config(&self) -> &RedactConfig {
        &self.config
    }

    /// False when the configuration is disabled or enables no kind: every text passes through.
    pub fn is_active(&self) -> bool {
        self.config.enabled && !self.config.kinds.is_empty()
    }

    /// `text` with its matches replaced, and their counts.
    pub fn redact(&self, text: &str) -> Redacted {
        let mut counts = Counts::new();
        let text = self.redact_into(text, &mut counts);
        Redacted { text, counts }
    }

    /// `text` with its matches replaced; the matches are added to `counts`.
    ///
    /// Overlapping matches (of one detector or several) are merged into one span, named by
    /// the match that starts first (the longest of those, then the more specific kind:
    /// card, iban, email, secret, ip, phone) and counted once, so no byte of any match is left.
    /// An e-mail address in angle brackets is replaced with its brackets (`Bob <email>`).
    pub fn redact_into(&self, text: &str, counts: &mut Counts) -> String {
        if !self.is_active() {
            return text.to_owned();
        }
        let mut current: Option<String> = None;
        for _ in 0..MAX_PASSES {
            let input = current.as_deref().unwrap_or(text);
            match self.pass(input, counts) {
                Some(next) => current = Some(next),
                None => break,
            }
        }
        current.unwrap_or_else(|| text.to_owned())
    }

    /// Redacts every string inside `value` (array items and object values, at any depth);
    /// object keys are left as they are. Matches are added to `counts`. Iterative, so deeply
    /// nested values cannot overflow the stack.
    pub fn redact_json(&self, value: &mut Value, counts: &mut Counts) {
        if !self.is_active() {
            return;
        }
        let mut stack: Vec<&mut Value> = vec![value];
        while let Some(node) = stack.pop() {
            match node {
                Value::String(text) => {
                    let redacted = self.redact_into(text.as_str(), counts);
                    *text = redacted;
                }
                Value::Array(items) => stack.extend(items.iter_mut()),
                Value::Object(map) => stack.extend(map.values_mut()),
                Value::Null | Value::Bool(_) | Value::Number(_) => {}
            }
        }
    }

    /// One pass: the redacted text, or `None` when nothing matched.
    fn pass(&self, text: &str, counts: &mut Counts) -> Option<String> {
        let bytes = text.as_bytes();
        let mut found = scan::candidates(bytes, &self.config.kinds);
        self.drop_allowed(text, &mut found);
        if found.is_empty() {
            return None;
        }
        found.sort_unstable_by(|a, b| {
            a.start
                .cmp(&b.start)
                .then(b.end.cmp(&a.end))
                .then(a.kind.rank().cmp(&b.kind.rank()))
        });
        let mut out = String::with_capacity(text.len());
        let mut cursor = 0;
        let mut index = 0;
        while index < found.len() {
            let first = found[index];
            let mut end = first.end;
            index += 1;
            while index < found.len() && found[index].start < end {
                end = end.max(found[index].end);
                index += 1;
            }
            let (start, end) = widen(bytes, first.kind, first.start, end, cursor);
            out.push_str(&text[cursor..start]);
            out.push_str(first.kind.placeholder());
            counts.add(first.kind, 1);
            cursor = end;
        }
        out.push_str(&text[cursor..]);
        Some(out)
    }

    /// Removes the candidates that equal an allowed string or lie inside an occurrence of one.
    fn drop_allowed(&self, text: &str, found: &mut Vec<Candidate>) {
        if self.allow.is_empty() || found.is_empty() {
            return;
        }
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for entry in &self.allow {
            spans.extend(
                text.match_indices(entry.as_str())
                    .map(|(at, _)| (at, at + entry.len())),
            );
        }
        spans.sort_unstable();
        // reach[i]: the furthest end among spans[..=i], so "some span starting at or before
        // `start` reaches `end`" is one binary search.
        let mut furthest = 0;
        let reach: Vec<usize> = spans
            .iter()
            .map(|&(_, end)| {
                furthest = furthest.max(end);
                furthest
            })
            .collect();
        found.retain(|candidate| {
            if self.allow.contains(&text[candidate.start..candidate.end]) {
                return false;
            }
            let before = spans.partition_point(|&(start, _)| start <= candidate.start);
            !(before > 0 && reach[before - 1] >= candidate.end)
        });
    }
}

/// An e-mail address directly inside `<` and `>` is replaced together with them.
fn widen(bytes: &[u8], kind: Kind, start: usize, end: usize, cursor: usize) -> (usize, usize) {
    let bracketed = kind == Kind::Email
        && start > cursor
        && bytes[start - 1] == b'<'
        && bytes.get(end) == Some(&b'>');
    if bracketed {
        (start - 1, end + 1)
    } else {
        (start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redact(text: &str) -> String {
        Redactor::default().redact(text).text
    }

    #[test]
    fn overlapping_matches_become_one_placeholder() {
        // The secret token starts first and covers the e-mail's local part.
        let out = Redactor::default().redact("Ab/Qm9Xr2LT7Kp4Wz8Nv3Jy6Hs1a@example.com");
        assert_eq!(out.text, "<secret>");
        assert_eq!(out.counts.total(), 1);
        // A bearer token that is also a JWT with high-entropy parts is one secret.
        let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U";
        let out = Redactor::default().redact(&format!("Authorization: Bearer {jwt}"));
        assert_eq!(out.text, "Authorization: Bearer <secret>");
        assert_eq!(out.counts.get(Kind::Secret), 1);
    }

    #[test]
    fn bracketed_email_takes_its_brackets() {
        assert_eq!(redact("From: Bob <bob@example.com>"), "From: Bob <email>");
        assert_eq!(redact("<bob@example.com"), "<<email>");
    }

    #[test]
    fn allowed_strings_survive() {
        let config = RedactConfig {
            allow: vec![
                "ops@example.com".into(),
                "call 555-123-4567 (test line)".into(),
                String::new(),
            ],
            ..RedactConfig::default()
        };
        let redactor = Redactor::new(config);
        let out = redactor.redact("ops@example.com, bob@example.com, <ops@example.com>, call 555-123-4567 (test line), 555-123-4567");
        assert_eq!(
            out.text,
            "ops@example.com, <email>, <ops@example.com>, call 555-123-4567 (test line), <phone>"
        );
        assert_eq!(out.counts.get(Kind::Email), 1);
        assert_eq!(out.counts.get(Kind::Phone), 1);
    }

    #[test]
    fn json_strings_are_redacted_keys_are_not() {
        let mut value = serde_json::json!({
            "bob@example.com": "mail bob@example.com",
            "nested": [{"ip": "10.0.0.1"}, 42, null, true, ["4111 1111 1111 1111"]],
        });
        let mut counts = Counts::new();
        Redactor::default().redact_json(&mut value, &mut counts);
        assert_eq!(
            value,
            serde_json::json!({
                "bob@example.com": "mail <email>",
                "nested": [{"ip": "<ip>"}, 42, null, true, ["<card>"]],
            })
        );
        assert_eq!(counts.total(), 3);
    }
}
