//! Decoded views of a text, so that an encoding does not hide what the detectors look for.
//!
//! - **Percent-encoding**: where a text holds `%XX` escapes, the detectors also run on its
//!   decoded form, and a match there covers the encoded bytes it came from
//!   (`alice.secret%40acme-corp.com` is an e-mail address).
//! - **Base64** (standard or URL-safe alphabet, padded or not): a token of
//!   [`BASE64_MIN_LEN`] or more such bytes that decodes to printable text is decoded, and when
//!   the detectors find anything in that text the whole token is a match of the first kind found.
//!
//! Only one level is decoded: the views run the plain detectors, not the views again.

use std::collections::BTreeSet;

use super::Candidate;
use crate::Kind;

/// Shortest token the base64 view decodes (12 bytes encode 9, the shortest e-mail-like text).
pub(crate) const BASE64_MIN_LEN: usize = 12;

/// Pushes the matches found in the decoded views of `bytes`, as spans of `bytes`.
pub(super) fn scan(bytes: &[u8], kinds: &BTreeSet<Kind>, out: &mut Vec<Candidate>) {
    percent(bytes, kinds, out);
    base64(bytes, kinds, out);
}

fn hex_value(byte: u8) -> Option<u8> {
    (byte as char).to_digit(16).map(|value| value as u8)
}

/// The percent-decoded view: each decoded byte keeps the span of `bytes` it came from.
fn percent(bytes: &[u8], kinds: &BTreeSet<Kind>, out: &mut Vec<Candidate>) {
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut origin: Vec<(usize, usize)> = Vec::with_capacity(bytes.len());
    let mut escapes = 0;
    let mut index = 0;
    while index < bytes.len() {
        let escape = (bytes[index] == b'%')
            .then(|| {
                Some((
                    hex_value(*bytes.get(index + 1)?)?,
                    hex_value(*bytes.get(index + 2)?)?,
                ))
            })
            .flatten();
        match escape {
            Some((high, low)) => {
                decoded.push(high * 16 + low);
                origin.push((index, index + 3));
                escapes += 1;
                index += 3;
            }
            None => {
                decoded.push(bytes[index]);
                origin.push((index, index + 1));
                index += 1;
            }
        }
    }
    if escapes == 0 {
        return;
    }
    for found in super::direct(&decoded, kinds) {
        out.push(Candidate::new(
            origin[found.start].0,
            origin[found.end - 1].1,
            found.kind,
        ));
    }
}

fn is_base64(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'+' | b'/' | b'-' | b'_')
}

/// The base64 view: tokens that decode to printable text, judged by what is inside.
fn base64(bytes: &[u8], kinds: &BTreeSet<Kind>, out: &mut Vec<Candidate>) {
    let mut index = 0;
    while index < bytes.len() {
        if !is_base64(bytes[index]) || super::before(bytes, index).is_some_and(is_base64) {
            index += 1;
            continue;
        }
        let start = index;
        while index < bytes.len() && is_base64(bytes[index]) {
            index += 1;
        }
        let body_end = index;
        while index < bytes.len() && index - body_end < 2 && bytes[index] == b'=' {
            index += 1;
        }
        if body_end - start < BASE64_MIN_LEN {
            continue;
        }
        let Some(text) = decode_printable(&bytes[start..body_end]) else {
            continue;
        };
        if let Some(found) = super::direct(&text, kinds).first() {
            out.push(Candidate::new(start, index, found.kind));
        }
    }
}

fn base64_value(byte: u8) -> Option<u32> {
    Some(match byte {
        b'A'..=b'Z' => byte - b'A',
        b'a'..=b'z' => byte - b'a' + 26,
        b'0'..=b'9' => byte - b'0' + 52,
        b'+' | b'-' => 62,
        b'/' | b'_' => 63,
        _ => return None,
    } as u32)
}

/// `body` (no padding) decoded, when it is valid base64 and the result is printable ASCII text
/// (tabs and line breaks allowed).
fn decode_printable(body: &[u8]) -> Option<Vec<u8>> {
    if body.len() % 4 == 1 {
        return None;
    }
    let mut decoded = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.chunks(4) {
        let mut word = 0u32;
        for (position, &byte) in chunk.iter().enumerate() {
            word |= base64_value(byte)? << (18 - 6 * position);
        }
        let produced = chunk.len() * 6 / 8;
        decoded.extend_from_slice(&word.to_be_bytes()[1..1 + produced]);
    }
    let printable = |byte: &u8| matches!(byte, b' '..=b'~' | b'\t' | b'\n' | b'\r');
    decoded.iter().all(printable).then_some(decoded)
}

#[cfg(test)]
mod tests {
    use super::decode_printable;
    use crate::scan::tests::spans;
    use crate::Kind;

    #[test]
    fn base64_decodes_both_alphabets_and_refuses_binary() {
        assert_eq!(
            decode_printable(b"aGVsbG8gd29ybGQ").unwrap(),
            b"hello world"
        );
        assert_eq!(decode_printable(b"aGk").unwrap(), b"hi");
        assert!(decode_printable(b"internationalization").is_none());
        assert!(decode_printable(b"a").is_none());
    }

    #[test]
    fn percent_encoded_and_base64_secrets_are_found() {
        assert_eq!(
            spans(
                "GET /reset?to=alice.secret%40acme-corp.com&x=1",
                Kind::Email
            ),
            vec!["alice.secret%40acme-corp.com"]
        );
        // base64 of "mail bob@example.com".
        assert_eq!(
            spans("blob bWFpbCBib2JAZXhhbXBsZS5jb20= end", Kind::Email),
            vec!["bWFpbCBib2JAZXhhbXBsZS5jb20="]
        );
        // Plain words and encoded text without a secret stay.
        assert!(spans("internationalization aGVsbG8gd29ybGQ 100%25", Kind::Email).is_empty());
    }
}
