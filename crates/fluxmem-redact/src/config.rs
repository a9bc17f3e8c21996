//! The redaction settings, as written in a pipeline's `[redact]` table.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::Kind;

/// What to redact. Every field may be left out of a `[redact]` table; the defaults redact every
/// kind and allow nothing. Unknown fields and unknown kind names are errors.
///
/// ```toml
/// [redact]
/// enabled = true
/// kinds = ["email", "phone", "card", "iban", "secret", "ip"]
/// allow = ["support@example.com", "127.0.0.1"]
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedactConfig {
    /// When false, [`Redactor`](crate::Redactor) returns every text unchanged.
    pub enabled: bool,
    /// The detectors that run (default: all of [`Kind::ALL`]). An empty set redacts nothing.
    pub kinds: BTreeSet<Kind>,
    /// Exact strings that are never redacted: a match equal to one of them, or lying inside
    /// an occurrence of one of them, is kept. Empty strings are ignored.
    pub allow: Vec<String>,
}

impl Default for RedactConfig {
    fn default() -> RedactConfig {
        RedactConfig {
            enabled: true,
            kinds: Kind::ALL.into_iter().collect(),
            allow: Vec::new(),
        }
    }
}

impl RedactConfig {
    /// A configuration that redacts nothing.
    pub fn disabled() -> RedactConfig {
        RedactConfig {
            enabled: false,
            ..RedactConfig::default()
        }
    }

    /// The default configuration limited to `kinds`.
    pub fn only(kinds: impl IntoIterator<Item = Kind>) -> RedactConfig {
        RedactConfig {
            kinds: kinds.into_iter().collect(),
            ..RedactConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_fields_take_defaults() {
        let config: RedactConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, RedactConfig::default());
        assert!(config.enabled);
        assert_eq!(config.kinds.len(), Kind::ALL.len());

        let config: RedactConfig =
            serde_json::from_str(r#"{"kinds": ["email", "ip"], "allow": ["a@b.io"]}"#).unwrap();
        assert_eq!(config.kinds, BTreeSet::from([Kind::Email, Kind::Ip]));
        assert_eq!(config.allow, vec!["a@b.io".to_owned()]);
    }

    #[test]
    fn unknown_fields_and_kinds_are_errors() {
        assert!(serde_json::from_str::<RedactConfig>(r#"{"enable": true}"#).is_err());
        let error = serde_json::from_str::<RedactConfig>(r#"{"kinds": ["ssn"]}"#).unwrap_err();
        assert!(error.to_string().contains("ssn"), "{error}");
    }
}
