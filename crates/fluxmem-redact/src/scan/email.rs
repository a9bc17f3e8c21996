//! E-mail addresses: `local@domain.tld`.
//!
//! The local part is 1 to 64 bytes of `[A-Za-z0-9._%+-]` not starting or ending with a dot;
//! the domain is at least two dot-separated labels of `[A-Za-z0-9-]` (1 to 63 bytes, no
//! leading or trailing hyphen, at most 253 bytes in all) whose last label, the top-level
//! domain, is two or more letters. A trailing dot or hyphen (end of a sentence) is not part of
//! the address. Quoted local parts and IP-literal domains are not recognised.

use super::Candidate;
use crate::Kind;

const MAX_LOCAL: usize = 64;
const MAX_DOMAIN: usize = 253;
const MAX_LABEL: usize = 63;

fn is_local(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'%' | b'+' | b'-')
}

fn is_domain(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'-')
}

/// Pushes every address in `bytes`. Linear: neither part can contain `@`, so each byte is
/// walked over at most once as part of a local part and once as part of a domain.
pub(super) fn scan(bytes: &[u8], out: &mut Vec<Candidate>) {
    for (at, _) in bytes.iter().enumerate().filter(|&(_, &byte)| byte == b'@') {
        let Some(start) = local_start(bytes, at) else {
            continue;
        };
        let Some(end) = domain_end(bytes, at + 1) else {
            continue;
        };
        out.push(Candidate::new(start, end, Kind::Email));
    }
}

/// Where the local part ending just before the `@` at `at` starts.
fn local_start(bytes: &[u8], at: usize) -> Option<usize> {
    let mut start = at;
    while start > 0 && is_local(bytes[start - 1]) {
        start -= 1;
    }
    while start < at && bytes[start] == b'.' {
        start += 1;
    }
    let length = at - start;
    (length > 0 && length <= MAX_LOCAL && bytes[at - 1] != b'.').then_some(start)
}

/// Where the domain starting at `from` ends, if it is a valid domain.
fn domain_end(bytes: &[u8], from: usize) -> Option<usize> {
    let mut end = from;
    while end < bytes.len() && is_domain(bytes[end]) {
        end += 1;
    }
    // An empty label ends the domain ("a@b.com..x" is "a@b.com").
    if let Some(double) = bytes[from..end]
        .windows(2)
        .position(|pair| pair[0] == b'.' && pair[1] == b'.')
    {
        end = from + double;
    }
    while end > from && matches!(bytes[end - 1], b'.' | b'-') {
        end -= 1;
    }
    let domain = &bytes[from..end];
    if domain.is_empty() || domain.len() > MAX_DOMAIN {
        return None;
    }
    let mut labels = 0;
    let mut last: &[u8] = &[];
    for label in domain.split(|&byte| byte == b'.') {
        let bad = label.is_empty()
            || label.len() > MAX_LABEL
            || label[0] == b'-'
            || label[label.len() - 1] == b'-';
        if bad {
            return None;
        }
        labels += 1;
        last = label;
    }
    let tld_ok = last.len() >= 2 && last.iter().all(u8::is_ascii_alphabetic);
    (labels >= 2 && tld_ok).then_some(end)
}

#[cfg(test)]
mod tests {
    use crate::scan::tests::spans;
    use crate::Kind;

    fn emails(text: &str) -> Vec<&str> {
        spans(text, Kind::Email)
    }

    #[test]
    fn finds_addresses() {
        assert_eq!(emails("write to bob@example.com."), vec!["bob@example.com"]);
        assert_eq!(
            emails("Bob <bob.smith+tag@mail.example.co.uk>"),
            vec!["bob.smith+tag@mail.example.co.uk"]
        );
        assert_eq!(
            emails("mailto:a_b-c%d@x-y.io, second@z.org"),
            vec!["a_b-c%d@x-y.io", "second@z.org"]
        );
        assert_eq!(emails("(ops@Example.COM)"), vec!["ops@Example.COM"]);
        assert_eq!(emails("x@y@b.com"), vec!["y@b.com"]);
        assert_eq!(emails("...lead@team.dev-"), vec!["lead@team.dev"]);
    }

    #[test]
    fn ignores_non_addresses() {
        for text in [
            "@handle",
            "user@",
            "user@localhost",
            "a@b.c",
            "a@b.c0m",
            "x@-bad.com",
            "a.@b.com",
            "meet @ 10.30",
            "@@",
            "a@.com",
        ] {
            assert!(emails(text).is_empty(), "{text}: {:?}", emails(text));
        }
        let long_local = format!("{}@example.com", "a".repeat(65));
        assert!(emails(&long_local).is_empty());
    }
}
