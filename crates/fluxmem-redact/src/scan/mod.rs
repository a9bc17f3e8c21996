//! The detectors. Each one scans the text's bytes once and pushes the spans it matches; the
//! redactor resolves overlaps and writes placeholders.
//!
//! All detectors match ASCII only, so every span starts and ends on a `char` boundary: a span
//! starts at an ASCII byte and ends right after one.

mod decoded;
mod email;
mod iban;
mod ip;
mod number;
mod secret;

use std::collections::BTreeSet;

use crate::Kind;

pub use number::{PHONE_MAX_DIGITS, PHONE_MIN_DIGITS};
pub use secret::{ENTROPY_MIN_BITS, ENTROPY_MIN_LEN};

/// A detected span `start..end` (byte offsets) of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) kind: Kind,
}

impl Candidate {
    pub(crate) fn new(start: usize, end: usize, kind: Kind) -> Candidate {
        debug_assert!(start < end, "empty match");
        Candidate { start, end, kind }
    }
}

/// Every match of the enabled `kinds` in `bytes` and in its decoded views (percent-encoding,
/// base64: see `decoded.rs`), in no particular order; matches of different detectors may
/// overlap.
pub(crate) fn candidates(bytes: &[u8], kinds: &BTreeSet<Kind>) -> Vec<Candidate> {
    let mut found = direct(bytes, kinds);
    decoded::scan(bytes, kinds, &mut found);
    found
}

/// The matches of the detectors on `bytes` as written.
fn direct(bytes: &[u8], kinds: &BTreeSet<Kind>) -> Vec<Candidate> {
    let on = |kind: Kind| kinds.contains(&kind);
    let mut found = Vec::new();
    if on(Kind::Email) {
        email::scan(bytes, &mut found);
    }
    if on(Kind::Phone) || on(Kind::Card) {
        number::scan(bytes, on(Kind::Phone), on(Kind::Card), &mut found);
    }
    if on(Kind::Iban) {
        iban::scan(bytes, &mut found);
    }
    if on(Kind::Secret) {
        secret::scan(bytes, &mut found);
    }
    if on(Kind::Ip) {
        ip::scan(bytes, &mut found);
    }
    found
}

/// A letter, digit or underscore: the bytes that glue a match to a longer word or identifier.
pub(crate) fn is_word(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// The byte before `index`, if any.
fn before(bytes: &[u8], index: usize) -> Option<u8> {
    index.checked_sub(1).map(|previous| bytes[previous])
}

/// True when `bytes[index]` exists and satisfies `test`.
fn at(bytes: &[u8], index: usize, test: impl Fn(u8) -> bool) -> bool {
    bytes.get(index).is_some_and(|&byte| test(byte))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The texts of the matches of `kind` in `text`, in order, without duplicates (two rules of
    /// one detector may report the same span).
    pub(crate) fn spans(text: &str, kind: Kind) -> Vec<&str> {
        let mut found: Vec<Candidate> = candidates(text.as_bytes(), &BTreeSet::from([kind]));
        found.sort_by_key(|candidate| (candidate.start, candidate.end));
        found.dedup();
        found
            .into_iter()
            .map(|candidate| &text[candidate.start..candidate.end])
            .collect()
    }

    #[test]
    fn each_detector_only_reports_its_kind() {
        let text = "bob@example.com, +44 20 7946 0958, 4111 1111 1111 1111, GB82 WEST 1234 5698 7654 32, 10.0.0.1";
        for kind in Kind::ALL {
            let found = candidates(text.as_bytes(), &BTreeSet::from([kind]));
            assert!(
                found.iter().all(|candidate| candidate.kind == kind),
                "{kind}: {found:?}"
            );
        }
        assert_eq!(spans(text, Kind::Email), vec!["bob@example.com"]);
        assert_eq!(spans(text, Kind::Ip), vec!["10.0.0.1"]);
        assert_eq!(spans(text, Kind::Iban), vec!["GB82 WEST 1234 5698 7654 32"]);
        assert_eq!(spans(text, Kind::Card), vec!["4111 1111 1111 1111"]);
        assert_eq!(spans(text, Kind::Phone), vec!["+44 20 7946 0958"]);
    }
}
