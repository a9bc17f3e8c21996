//! API keys, tokens and other secrets.
//!
//! Known prefixes (the prefix must start a word; the body is the longest run of its bytes):
//!
//! | prefix | body | length of body |
//! |---|---|---|
//! | `sk-` (OpenAI, Anthropic `sk-ant-`, ...) | `[A-Za-z0-9_-]` | 20 or more |
//! | `sk_live_`, `pk_live_` (Stripe) | `[A-Za-z0-9]` | 16 or more |
//! | `ghp_`, `gho_` (GitHub) | `[A-Za-z0-9]` | 30 or more |
//! | `github_pat_` (GitHub) | `[A-Za-z0-9_]` | 22 or more |
//! | `xoxb-`, `xoxp-` (Slack) | `[A-Za-z0-9-]` | 10 or more |
//! | `AKIA`, `ASIA` (AWS access key ids) | `[A-Z0-9]` | exactly 16, not followed by a letter or digit |
//! | `AIza` (Google) | `[A-Za-z0-9_-]` | 30 or more |
//!
//! A prefix in another case (`akia...`, after a template lowercased the text) matches a body
//! in any case that holds a digit. A key split by spaces goes on across single spaces while
//! the next chunk is 4+ body bytes with a letter and a digit (`sk- Ab3d...`).
//!
//! JSON Web Tokens, whole or cut short: `eyJ` (the base64 of `{"`) + base64url, 10+ bytes in
//! all, then optional `.`-joined parts (payload, signature) of any length. `Bearer <token>` (any case): the token after one or more spaces,
//! `[A-Za-z0-9._~+/-]` and trailing `=`, at least 8 bytes with a digit, or 20 bytes with both
//! letter cases; only the token is replaced (`Bearer <secret>`).
//!
//! High-entropy strings: a token is a longest run of `[A-Za-z0-9_+/-]` plus up to two `=` of
//! padding (so `key=value` is two tokens). A token that looks like a path (a `/`-bounded
//! segment of three or more lowercase letters, as in `/usr/` or `/services/`, or both a `/`
//! and a `-`, which no base64 alphabet holds together, as in `send-certificate-2/SKILL`) is
//! split at `/` and its segments are judged one by one. A token or segment is a secret when it
//! - is at least [`ENTROPY_MIN_LEN`] (24) bytes long,
//! - has a lowercase letter, an uppercase letter and a digit (so lowercase hex such as SHA-256
//!   digests and fluxmem node ids, and UUIDs, are never secrets: their entropy can pass 4.0),
//! - is not camel-case-like (every capital directly followed by a lowercase letter, as in
//!   `getUserAccountBalance2024Report`), and
//! - has a Shannon entropy of at least [`ENTROPY_MIN_BITS`] (4.0) bits per byte, computed over
//!   its byte frequencies. Random base62/base64 strings of 32 or more bytes are almost always
//!   above 4.0; 24-byte ones are above it about nine times in ten.

use super::{before, is_word, Candidate};
use crate::Kind;

/// Shortest token the entropy rule judges.
pub const ENTROPY_MIN_LEN: usize = 24;
/// Least Shannon entropy, in bits per byte, of a token the entropy rule redacts.
pub const ENTROPY_MIN_BITS: f64 = 4.0;

/// Fewest bytes of a JWT's header and of its payload.
const JWT_PART_MIN: usize = 10;
/// Fewest bytes of a bearer token.
const BEARER_MIN: usize = 8;

struct Prefix {
    prefix: &'static [u8],
    body: fn(u8) -> bool,
    /// Fewest body bytes; with `exact`, the only allowed length.
    min: usize,
    exact: bool,
}

fn is_alnum(byte: u8) -> bool {
    byte.is_ascii_alphanumeric()
}

fn is_alnum_dash(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'-'
}

fn is_word_dash(byte: u8) -> bool {
    is_word(byte) || byte == b'-'
}

fn is_upper_digit(byte: u8) -> bool {
    byte.is_ascii_uppercase() || byte.is_ascii_digit()
}

const PREFIXES: &[Prefix] = &[
    Prefix {
        prefix: b"sk-",
        body: is_word_dash,
        min: 20,
        exact: false,
    },
    Prefix {
        prefix: b"sk_live_",
        body: is_alnum,
        min: 16,
        exact: false,
    },
    Prefix {
        prefix: b"pk_live_",
        body: is_alnum,
        min: 16,
        exact: false,
    },
    Prefix {
        prefix: b"ghp_",
        body: is_alnum,
        min: 30,
        exact: false,
    },
    Prefix {
        prefix: b"gho_",
        body: is_alnum,
        min: 30,
        exact: false,
    },
    Prefix {
        prefix: b"github_pat_",
        body: is_word,
        min: 22,
        exact: false,
    },
    Prefix {
        prefix: b"xoxb-",
        body: is_alnum_dash,
        min: 10,
        exact: false,
    },
    Prefix {
        prefix: b"xoxp-",
        body: is_alnum_dash,
        min: 10,
        exact: false,
    },
    Prefix {
        prefix: b"AKIA",
        body: is_upper_digit,
        min: 16,
        exact: true,
    },
    Prefix {
        prefix: b"ASIA",
        body: is_upper_digit,
        min: 16,
        exact: true,
    },
    Prefix {
        prefix: b"AIza",
        body: is_word_dash,
        min: 30,
        exact: false,
    },
];

/// Pushes every secret in `bytes`: prefixed keys, JWTs and bearer tokens, then high-entropy
/// tokens (the two may overlap; the redactor merges them).
pub(super) fn scan(bytes: &[u8], out: &mut Vec<Candidate>) {
    known_forms(bytes, out);
    high_entropy(bytes, out);
}

/// Prefixed keys, JWTs and bearer tokens. Attempts start only at word starts; a failed JWT
/// attempt is not retried inside the header it read, so the scan stays linear.
fn known_forms(bytes: &[u8], out: &mut Vec<Candidate>) {
    let mut jwt_floor = 0;
    let mut index = 0;
    while index < bytes.len() {
        if before(bytes, index).is_some_and(is_word) {
            index += 1;
            continue;
        }
        let found = match bytes[index] {
            b'e' if index >= jwt_floor => jwt_at(bytes, index, &mut jwt_floor),
            b'B' | b'b' => bearer_at(bytes, index),
            _ => prefixed_at(bytes, index),
        };
        match found {
            Some((start, end)) => {
                out.push(Candidate::new(start, end, Kind::Secret));
                index = end;
            }
            None => index += 1,
        }
    }
}

fn prefixed_at(bytes: &[u8], start: usize) -> Option<(usize, usize)> {
    let rest = &bytes[start..];
    PREFIXES.iter().find_map(|rule| {
        let head = rest.get(..rule.prefix.len())?;
        if !head.eq_ignore_ascii_case(rule.prefix) {
            return None;
        }
        // A prefix in another case (a template lowercased the text) takes a body in any case,
        // and must hold a digit so that ordinary words stay.
        let folded = head != rule.prefix;
        let body =
            |byte: u8| (rule.body)(byte) || (folded && (rule.body)(byte.to_ascii_uppercase()));
        let (end, length, has_digit) = key_body(bytes, start + rule.prefix.len(), &body, rule);
        let ok = if rule.exact {
            length == rule.min && !bytes.get(end).is_some_and(u8::is_ascii_alphanumeric)
        } else {
            length >= rule.min
        };
        (ok && (has_digit || !folded)).then_some((start, end))
    })
}

/// The body of a prefixed key from `from`: its end, its length without the spaces inside it,
/// and whether it holds a digit. A key split by a space goes on across single spaces while the
/// next chunk is [`SPLIT_CHUNK_MIN`] or more body bytes with a letter and a digit (`sk- Ab3d...`,
/// `sk-Ab3dEf6h Ij9kLm2n...`); an `exact` body stops at its length.
fn key_body(
    bytes: &[u8],
    from: usize,
    body: &dyn Fn(u8) -> bool,
    rule: &Prefix,
) -> (usize, usize, bool) {
    let mut end = from;
    let mut length = 0;
    let mut has_digit = false;
    loop {
        while end < bytes.len() && body(bytes[end]) && !(rule.exact && length == rule.min) {
            has_digit |= bytes[end].is_ascii_digit();
            end += 1;
            length += 1;
        }
        if bytes.get(end) != Some(&b' ') || (rule.exact && length == rule.min) {
            return (end, length, has_digit);
        }
        let chunk = bytes[end + 1..]
            .iter()
            .take_while(|&&byte| body(byte))
            .copied()
            .collect::<Vec<u8>>();
        let random = chunk.len() >= SPLIT_CHUNK_MIN
            && chunk.iter().any(u8::is_ascii_digit)
            && chunk.iter().any(u8::is_ascii_alphabetic);
        if !random {
            return (end, length, has_digit);
        }
        end += 1;
    }
}

/// Fewest bytes of a chunk that continues a key across a space ([`key_body`]).
const SPLIT_CHUNK_MIN: usize = 4;

fn is_base64url(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-'
}

/// The end of the base64url run starting at `from`.
fn base64url_end(bytes: &[u8], from: usize) -> usize {
    from + bytes[from.min(bytes.len())..]
        .iter()
        .take_while(|&&byte| is_base64url(byte))
        .count()
}

fn jwt_at(bytes: &[u8], start: usize, floor: &mut usize) -> Option<(usize, usize)> {
    if !bytes[start..].starts_with(b"eyJ") {
        return None;
    }
    let header_end = base64url_end(bytes, start);
    *floor = header_end;
    if header_end - start < JWT_PART_MIN {
        return None;
    }
    // A fragment (a token cut short, or its header alone) is still a token: `eyJ` is the
    // base64 of `{"`, which no word starts with.
    if bytes.get(header_end) != Some(&b'.') {
        return Some((start, header_end));
    }
    let payload_end = base64url_end(bytes, header_end + 1);
    let mut end = payload_end.max(header_end);
    if bytes.get(payload_end) == Some(&b'.') {
        let signature_end = base64url_end(bytes, payload_end + 1);
        if signature_end > payload_end + 1 {
            end = signature_end;
        }
    }
    Some((start, end))
}

fn is_bearer_char(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~' | b'+' | b'/')
}

fn bearer_at(bytes: &[u8], start: usize) -> Option<(usize, usize)> {
    let word = bytes.get(start..start + 6)?;
    if !word.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let mut token_start = start + 6;
    while bytes.get(token_start) == Some(&b' ') {
        token_start += 1;
    }
    if token_start == start + 6 {
        return None;
    }
    let mut end = token_start;
    while end < bytes.len() && is_bearer_char(bytes[end]) {
        end += 1;
    }
    // A full stop ends the sentence, not the token.
    while end > token_start && bytes[end - 1] == b'.' {
        end -= 1;
    }
    while bytes.get(end) == Some(&b'=') {
        end += 1;
    }
    let token = &bytes[token_start..end];
    let has = |test: fn(&u8) -> bool| token.iter().any(test);
    let looks_random = has(u8::is_ascii_digit)
        || (token.len() >= 20 && has(u8::is_ascii_uppercase) && has(u8::is_ascii_lowercase));
    (token.len() >= BEARER_MIN && looks_random).then_some((token_start, end))
}

fn is_token_char(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'+' | b'/' | b'-')
}

/// High-entropy tokens, in one pass over maximal runs.
fn high_entropy(bytes: &[u8], out: &mut Vec<Candidate>) {
    let mut index = 0;
    while index < bytes.len() {
        if !is_token_char(bytes[index]) {
            index += 1;
            continue;
        }
        let start = index;
        while index < bytes.len() && is_token_char(bytes[index]) {
            index += 1;
        }
        let mut padding = 0;
        while padding < 2 && bytes.get(index) == Some(&b'=') {
            index += 1;
            padding += 1;
        }
        judge_token(bytes, start, index, out);
    }
}

fn judge_token(bytes: &[u8], start: usize, end: usize, out: &mut Vec<Candidate>) {
    let token = &bytes[start..end];
    if token.len() < ENTROPY_MIN_LEN {
        return;
    }
    if !looks_like_path(token) {
        if is_high_entropy(token) {
            out.push(Candidate::new(start, end, Kind::Secret));
        }
        return;
    }
    let mut segment_start = start;
    for segment in token.split(|&byte| byte == b'/') {
        if is_high_entropy(segment) {
            out.push(Candidate::new(
                segment_start,
                segment_start + segment.len(),
                Kind::Secret,
            ));
        }
        segment_start += segment.len() + 1;
    }
}

/// A `/`-bounded segment of three or more lowercase letters (`/usr/`, `/services/`), or a
/// `/` and a `-` in one token (`send-certificate-2/SKILL`): standard base64 has `/` and no
/// `-`, URL-safe base64 `-` and no `/`, so such a token is names joined, not one key.
fn looks_like_path(token: &[u8]) -> bool {
    let segments = token.iter().filter(|&&byte| byte == b'/').count() + 1;
    if segments >= 2 && token.contains(&b'-') {
        return true;
    }
    segments >= 3
        && token
            .split(|&byte| byte == b'/')
            .enumerate()
            .any(|(index, segment)| {
                index > 0
                    && index + 1 < segments
                    && segment.len() >= 3
                    && segment.iter().all(u8::is_ascii_lowercase)
            })
}

/// The entropy rule for one token or path segment.
pub(crate) fn is_high_entropy(token: &[u8]) -> bool {
    if token.len() < ENTROPY_MIN_LEN {
        return false;
    }
    let has = |test: fn(&u8) -> bool| token.iter().any(test);
    if !(has(u8::is_ascii_lowercase) && has(u8::is_ascii_uppercase) && has(u8::is_ascii_digit)) {
        return false;
    }
    let camel_like = token.iter().enumerate().all(|(index, byte)| {
        !byte.is_ascii_uppercase() || token.get(index + 1).is_some_and(u8::is_ascii_lowercase)
    });
    !camel_like && shannon_entropy(token) >= ENTROPY_MIN_BITS
}

/// Shannon entropy of the byte frequencies of `token`, in bits per byte.
pub(crate) fn shannon_entropy(token: &[u8]) -> f64 {
    let mut counts = [0u32; 256];
    for &byte in token {
        counts[usize::from(byte)] += 1;
    }
    let total = token.len() as f64;
    counts
        .iter()
        .filter(|&&count| count > 0)
        .map(|&count| {
            let share = f64::from(count) / total;
            -share * share.log2()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::{is_high_entropy, shannon_entropy};
    use crate::scan::tests::spans;
    use crate::Kind;

    fn secrets(text: &str) -> Vec<&str> {
        spans(text, Kind::Secret)
    }

    #[test]
    fn entropy_of_simple_strings() {
        assert_eq!(shannon_entropy(b"aaaa"), 0.0);
        assert!((shannon_entropy(b"abcd") - 2.0).abs() < 1e-12);
        assert!((shannon_entropy(b"0123456789abcdef") - 4.0).abs() < 1e-12);
    }

    #[test]
    fn finds_prefixed_keys() {
        let keys = [
            "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t",
            "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
            "pk_live_51HqLyjWDarjtT1zdp7dcXYZ",
            "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
            "gho_16C7e42F292c6912E7710c838347Ae178B4a",
            "github_pat_11ABCDEFG0abcdefghijkl_mnopqrstuvwxyz0123456789",
            "xoxb-17653672481-19874698323-pdFZKVeTuE8sk7oOcBrzbqgy",
            "xoxp-1234567890-abcdefghij",
            "AKIAIOSFODNN7EXAMPLE",
            "AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe",
            // Disguises: lowercased, split by spaces.
            "akiaiosfodnn7acmexyz",
            "sk-proj-Ab3dEf6h Ij9kLm2nOp5qRs8t",
            "sk- Ab3dEf6hIj9kLm2nOp5q",
        ];
        for key in keys {
            let text = format!("key: {key} (rotate it)");
            assert_eq!(secrets(&text), vec![key], "{text}");
        }
    }

    #[test]
    fn ignores_prefix_lookalikes() {
        for text in [
            "use sk-learn for this",
            "task-1234567890abcdefghijklmnop",
            "AKIAIOSFODNN7EXAMPL",
            "AKIAIOSFODNN7EXAMPLE1",
            "xoxb-short",
            "ghp_tooShort123",
            "asiapacificregionalofficeholder",
            "sk-learn and more words",
        ] {
            assert!(secrets(text).is_empty(), "{text}: {:?}", secrets(text));
        }
    }

    #[test]
    fn finds_jwts_and_bearer_tokens() {
        let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U";
        let text = format!("token={jwt}; next");
        assert!(secrets(&text).contains(&jwt), "{:?}", secrets(&text));
        assert_eq!(
            secrets("Authorization: Bearer abc123def456ghi."),
            vec!["abc123def456ghi"]
        );
        assert_eq!(
            secrets("authorization: bearer dGhpcyBpcyBhIHRva2Vu=="),
            vec!["dGhpcyBpcyBhIHRva2Vu=="]
        );
        // Cut short: a header alone, or a payload's first bytes.
        assert_eq!(
            secrets("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIi… was cut"),
            vec!["eyJhbGciOiJIUzI1NiJ9.eyJzdWIi"]
        );
        assert_eq!(secrets("h=eyJhbGciOiJIUz"), vec!["eyJhbGciOiJIUz"]);
        assert!(secrets("the eyJ prefix, eyJhb").is_empty());
        assert!(secrets("the Bearer authentication scheme").is_empty());
        assert!(secrets("Bearer token").is_empty());
    }

    #[test]
    fn entropy_rule() {
        assert!(is_high_entropy(b"Zx9Qw3Er7Ty1Ui5Op2As8Df4Gh6Jk0L"));
        assert!(is_high_entropy(b"tR8vP2xL6qN4wK9mZ3bH7cJ5"));
        assert!(is_high_entropy(b"wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"));
        // Too short, lowercase hex, a UUID, camel case, one letter case only.
        assert!(!is_high_entropy(b"tR8vP2xL6qN4wK9mZ3bH7cJ"));
        assert!(!is_high_entropy(
            b"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        ));
        assert!(!is_high_entropy(b"123e4567-e89b-12d3-a456-426614174000"));
        assert!(!is_high_entropy(b"getUserAccountBalance2024Report"));
        assert!(!is_high_entropy(b"MyVeryLongClassNameForTesting123"));
        assert!(!is_high_entropy(b"HTTP_X_FORWARDED_FOR_HEADER_VALUE_2"));
    }

    #[test]
    fn high_entropy_tokens_in_text() {
        assert_eq!(
            secrets("aws_secret=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY done"),
            vec!["wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"]
        );
        assert_eq!(
            secrets(
                "https://hooks.example.com/services/T0A1B2C3D/B4E5F6G7H/Qm9Xr2LT7Kp4Wz8Nv3Jy6Hs1a"
            ),
            vec!["Qm9Xr2LT7Kp4Wz8Nv3Jy6Hs1a"]
        );
        for text in [
            "/usr/local/lib/python3/site-packages/Foo2/Bar3Baz",
            "node ep-3f2a9c0d4b5e6f708192a3b4c5d6e7f8 and sha ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            "fluxmem_consolidate_export_skills_2024_Final",
            "the quick brown fox jumps over the lazy dog",
            // An exported skill's file, its folder a slug with a number.
            "\"get-user-details-and-get-reservation-details-2/SKILL.md\"",
            "handle-flight-tasks-2/SKILL.md",
        ] {
            assert!(secrets(text).is_empty(), "{text}: {:?}", secrets(text));
        }
        // Split at `/`, a key in a segment is still one.
        assert_eq!(
            secrets("skill-folder/wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"),
            vec!["wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"]
        );
    }
}
