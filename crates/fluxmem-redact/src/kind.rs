//! What can be redacted ([`Kind`]) and how much was ([`Counts`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// One family of sensitive text, with its own detector and placeholder.
///
/// Serialised (and parsed, in a `[redact]` table) as its lowercase [`name`](Kind::name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// E-mail addresses, replaced by `<email>`.
    Email,
    /// Phone numbers, replaced by `<phone>`.
    Phone,
    /// Payment card numbers (Luhn-valid), replaced by `<card>`.
    Card,
    /// International bank account numbers (mod-97 valid), replaced by `<iban>`.
    Iban,
    /// API keys, tokens and other high-entropy strings, replaced by `<secret>`.
    Secret,
    /// IPv4 and IPv6 addresses, replaced by `<ip>`.
    Ip,
}

impl Kind {
    /// Every kind, in declaration (and serialisation) order.
    pub const ALL: [Kind; 6] = [
        Kind::Email,
        Kind::Phone,
        Kind::Card,
        Kind::Iban,
        Kind::Secret,
        Kind::Ip,
    ];

    /// The lowercase name used in configuration files and counts: `email`, `phone`, `card`,
    /// `iban`, `secret` or `ip`.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Email => "email",
            Kind::Phone => "phone",
            Kind::Card => "card",
            Kind::Iban => "iban",
            Kind::Secret => "secret",
            Kind::Ip => "ip",
        }
    }

    /// The text that replaces a match: the name in angle brackets (`<email>`, ...). No detector
    /// matches a placeholder, so redacted text can be redacted again without change.
    pub const fn placeholder(self) -> &'static str {
        match self {
            Kind::Email => "<email>",
            Kind::Phone => "<phone>",
            Kind::Card => "<card>",
            Kind::Iban => "<iban>",
            Kind::Secret => "<secret>",
            Kind::Ip => "<ip>",
        }
    }

    /// Tie-break between matches of the same span: the more specific detector wins (a 15-digit
    /// run that is both a valid card and a phone number is a card). Lower is stronger.
    pub(crate) const fn rank(self) -> u8 {
        match self {
            Kind::Card => 0,
            Kind::Iban => 1,
            Kind::Email => 2,
            Kind::Secret => 3,
            Kind::Ip => 4,
            Kind::Phone => 5,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Kind {
    type Err = Error;

    /// Parses a lowercase name (`"email"`, `"phone"`, `"card"`, `"iban"`, `"secret"`, `"ip"`).
    fn from_str(name: &str) -> Result<Kind, Error> {
        Kind::ALL
            .into_iter()
            .find(|kind| kind.name() == name)
            .ok_or_else(|| Error::UnknownKind {
                name: name.to_owned(),
            })
    }
}

/// How many matches of each kind were replaced. Kinds with no match are absent; serialises as
/// a JSON object such as `{"email": 2, "card": 1}` (kinds in [`Kind::ALL`] order).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Counts {
    by_kind: BTreeMap<Kind, u64>,
}

impl Counts {
    /// No matches yet.
    pub fn new() -> Counts {
        Counts::default()
    }

    /// Adds `n` matches of `kind` (adding zero changes nothing).
    pub fn add(&mut self, kind: Kind, n: u64) {
        if n > 0 {
            *self.by_kind.entry(kind).or_insert(0) += n;
        }
    }

    /// Adds every count of `other` to these.
    pub fn merge(&mut self, other: &Counts) {
        for (&kind, &n) in &other.by_kind {
            self.add(kind, n);
        }
    }

    /// The number of matches of `kind`.
    pub fn get(&self, kind: Kind) -> u64 {
        self.by_kind.get(&kind).copied().unwrap_or(0)
    }

    /// The number of matches of all kinds together.
    pub fn total(&self) -> u64 {
        self.by_kind.values().sum()
    }

    /// True when nothing was redacted.
    pub fn is_empty(&self) -> bool {
        self.by_kind.is_empty()
    }

    /// The kinds with at least one match and their counts, in [`Kind::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (Kind, u64)> + '_ {
        self.by_kind.iter().map(|(&kind, &n)| (kind, n))
    }

    /// The counts as a map (only kinds with at least one match).
    pub fn as_map(&self) -> &BTreeMap<Kind, u64> {
        &self.by_kind
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in Kind::ALL {
            assert_eq!(kind.to_string(), kind.name());
            assert_eq!(kind.name().parse::<Kind>().unwrap(), kind);
            assert_eq!(kind.placeholder(), format!("<{kind}>"));
            assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{kind}\""));
        }
        assert!(
            matches!("Email".parse::<Kind>(), Err(Error::UnknownKind { name }) if name == "Email")
        );
        assert!("ssn".parse::<Kind>().is_err());
    }

    #[test]
    fn counts_add_merge_total() {
        let mut counts = Counts::new();
        assert!(counts.is_empty());
        counts.add(Kind::Card, 2);
        counts.add(Kind::Email, 1);
        counts.add(Kind::Ip, 0);
        let mut other = Counts::new();
        other.add(Kind::Card, 1);
        counts.merge(&other);
        assert_eq!(counts.get(Kind::Card), 3);
        assert_eq!(counts.get(Kind::Ip), 0);
        assert_eq!(counts.total(), 4);
        assert_eq!(
            counts.iter().collect::<Vec<_>>(),
            vec![(Kind::Email, 1), (Kind::Card, 3)]
        );
        assert_eq!(
            serde_json::to_string(&counts).unwrap(),
            r#"{"email":1,"card":3}"#
        );
    }
}
