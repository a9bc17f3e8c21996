//! IP addresses.
//!
//! - IPv4: four decimal octets 0-255 without leading zeros (`10.0.0.1`), not glued to a letter,
//!   digit, underscore or dot on either side, so `1.2.3` and `1.2.3.4.5` (versions) and
//!   `999.1.1.1` are not addresses. A port or prefix length after it stays (`<ip>:8080`).
//! - IPv6: hex groups of 1 to 4 digits separated by `:`, either 8 groups, or at least 3 groups
//!   with one `::`; the last two groups may be a dotted IPv4 address (`::ffff:192.0.2.1` counts
//!   as 3). At least one decimal digit is required, so `abc::def` or `add::bad:cafe`-like words
//!   in code are not addresses, and neither are times (`12:30:45`) or MAC addresses (six
//!   groups). Short forms such as `::1` and `fe80::1` are left alone.

use super::{at, before, is_word, Candidate};
use crate::Kind;

/// Pushes every address in `bytes`. Attempts start only where a word begins and read at most
/// 45 bytes, so the scan is linear.
pub(super) fn scan(bytes: &[u8], out: &mut Vec<Candidate>) {
    let mut index = 0;
    while index < bytes.len() {
        match ipv6_at(bytes, index).or_else(|| bounded_ipv4_at(bytes, index)) {
            Some(end) => {
                out.push(Candidate::new(index, end, Kind::Ip));
                index = end;
            }
            None => index += 1,
        }
    }
}

/// A dotted quad starting at `start` (no context checks): its end.
pub(super) fn ipv4_at(bytes: &[u8], start: usize) -> Option<usize> {
    let mut pos = start;
    for octet in 0..4 {
        if octet > 0 {
            if bytes.get(pos) != Some(&b'.') {
                return None;
            }
            pos += 1;
        }
        let digits_start = pos;
        while pos < bytes.len() && pos - digits_start < 4 && bytes[pos].is_ascii_digit() {
            pos += 1;
        }
        let digits = &bytes[digits_start..pos];
        if digits.is_empty() || digits.len() > 3 || (digits.len() > 1 && digits[0] == b'0') {
            return None;
        }
        let value = digits
            .iter()
            .fold(0u32, |value, &digit| value * 10 + u32::from(digit - b'0'));
        if value > 255 {
            return None;
        }
    }
    Some(pos)
}

/// An IPv4 address at `start` that is not part of a longer word or dotted number.
fn bounded_ipv4_at(bytes: &[u8], start: usize) -> Option<usize> {
    if before(bytes, start).is_some_and(|byte| is_word(byte) || byte == b'.') {
        return None;
    }
    let end = ipv4_at(bytes, start)?;
    let glued = at(bytes, end, is_word)
        || (at(bytes, end, |byte| byte == b'.')
            && at(bytes, end + 1, |byte| byte.is_ascii_digit()));
    (!glued).then_some(end)
}

/// An IPv6 address at `start`: its end.
fn ipv6_at(bytes: &[u8], start: usize) -> Option<usize> {
    if before(bytes, start).is_some_and(|byte| is_word(byte) || byte == b':' || byte == b'.') {
        return None;
    }
    let mut pos = start;
    let mut compressed = false;
    if bytes[pos..].starts_with(b"::") {
        compressed = true;
        pos += 2;
    } else if !bytes[pos].is_ascii_hexdigit() {
        return None;
    }
    let mut end = pos;
    let mut groups = 0usize;
    let mut has_digit = false;
    loop {
        let group_start = pos;
        while pos < bytes.len() && pos - group_start < 5 && bytes[pos].is_ascii_hexdigit() {
            pos += 1;
        }
        let length = pos - group_start;
        if length == 0 {
            break;
        }
        if length > 4 {
            return None;
        }
        if at(bytes, pos, |byte| byte == b'.') {
            end = ipv4_at(bytes, group_start)?;
            groups += 2;
            has_digit = true;
            break;
        }
        has_digit |= bytes[group_start..pos].iter().any(u8::is_ascii_digit);
        groups += 1;
        end = pos;
        if groups > 8 {
            return None;
        }
        if bytes[pos..].starts_with(b"::") {
            if compressed {
                return None;
            }
            compressed = true;
            pos += 2;
            end = pos;
        } else if at(bytes, pos, |byte| byte == b':')
            && at(bytes, pos + 1, |byte| byte.is_ascii_hexdigit())
        {
            pos += 1;
        } else {
            break;
        }
    }
    let enough = if compressed {
        (3..=7).contains(&groups)
    } else {
        groups == 8
    };
    let glued = at(bytes, end, |byte| is_word(byte) || byte == b':')
        || (at(bytes, end, |byte| byte == b'.')
            && at(bytes, end + 1, |byte| byte.is_ascii_digit()));
    (enough && has_digit && !glued).then_some(end)
}

#[cfg(test)]
mod tests {
    use crate::scan::tests::spans;
    use crate::Kind;

    fn ips(text: &str) -> Vec<&str> {
        spans(text, Kind::Ip)
    }

    #[test]
    fn finds_ipv4() {
        assert_eq!(ips("host 10.0.0.1 is up"), vec!["10.0.0.1"]);
        assert_eq!(
            ips("from 192.168.1.254:8080 and 0.0.0.0/0"),
            vec!["192.168.1.254", "0.0.0.0"]
        );
        assert_eq!(ips("(255.255.255.255)."), vec!["255.255.255.255"]);
    }

    #[test]
    fn ignores_non_ipv4() {
        for text in [
            "999.1.1.1",
            "1.2.3",
            "v1.2.3.4",
            "1.2.3.4.5",
            "10.0.0.256",
            "01.2.3.4",
            "1.2.3.4a",
            "version 1.2.3 released",
            "2024.05.01",
        ] {
            assert!(ips(text).is_empty(), "{text}: {:?}", ips(text));
        }
    }

    #[test]
    fn finds_ipv6() {
        assert_eq!(ips("addr 2001:db8::1 ok"), vec!["2001:db8::1"]);
        assert_eq!(
            ips("[2001:0db8:85a3:0000:0000:8a2e:0370:7334]:443"),
            vec!["2001:0db8:85a3:0000:0000:8a2e:0370:7334"]
        );
        assert_eq!(
            ips("mapped ::ffff:192.0.2.1 here"),
            vec!["::ffff:192.0.2.1"]
        );
        assert_eq!(
            ips("fe80::1ff:fe23:4567:890a%eth0"),
            vec!["fe80::1ff:fe23:4567:890a"]
        );
    }

    #[test]
    fn ignores_non_ipv6() {
        for text in [
            "12:30:45",
            "00:1a:2b:3c:4d:5e",
            "std::vec::Vec",
            "abc::def",
            "a::b:c",
            "::1",
            "fe80::1",
            "1:2:3:4:5:6:7",
            "1::2::3",
        ] {
            assert!(ips(text).is_empty(), "{text}: {:?}", ips(text));
        }
    }
}
