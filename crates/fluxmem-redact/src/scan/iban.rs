//! International bank account numbers (ISO 13616).
//!
//! Two capital letters (country), two check digits, then capitals and digits up to 15 to 34
//! characters in all, either compact (`GB82WEST12345698765432`) or printed in blocks of four
//! separated by single spaces with a last block of 1 to 4 (`GB82 WEST 1234 5698 7654 32`);
//! only numbers whose mod-97 check gives 1 match. Not glued to a letter, digit or underscore;
//! lowercase IBANs are not recognised.

use super::{before, is_word, Candidate};
use crate::Kind;

const MIN_LEN: usize = 15;
const MAX_LEN: usize = 34;

fn is_iban_char(byte: u8) -> bool {
    byte.is_ascii_uppercase() || byte.is_ascii_digit()
}

/// Pushes every valid IBAN in `bytes`. Attempts start only at word starts and read at most
/// about 42 bytes, so the scan is linear.
pub(super) fn scan(bytes: &[u8], out: &mut Vec<Candidate>) {
    let mut index = 0;
    while index + 4 <= bytes.len() {
        if let Some(end) = iban_at(bytes, index) {
            out.push(Candidate::new(index, end, Kind::Iban));
            index = end;
        } else {
            index += 1;
        }
    }
}

/// The number of IBAN characters (capitals and digits) from `from` on, counting at most
/// `MAX_LEN + 1`.
fn block_len(bytes: &[u8], from: usize) -> usize {
    bytes[from.min(bytes.len())..]
        .iter()
        .take(MAX_LEN + 1)
        .take_while(|&&byte| is_iban_char(byte))
        .count()
}

fn glued_after(bytes: &[u8], end: usize) -> bool {
    bytes.get(end).is_some_and(|&byte| is_word(byte))
}

/// A valid IBAN starting at `start`: its end.
fn iban_at(bytes: &[u8], start: usize) -> Option<usize> {
    let head = &bytes[start..start + 4];
    let head_ok = head[0].is_ascii_uppercase()
        && head[1].is_ascii_uppercase()
        && head[2].is_ascii_digit()
        && head[3].is_ascii_digit();
    if !head_ok || before(bytes, start).is_some_and(is_word) {
        return None;
    }
    let compact = block_len(bytes, start);
    if compact > 4 {
        let end = start + compact;
        let fits = (MIN_LEN..=MAX_LEN).contains(&compact) && !glued_after(bytes, end);
        return (fits && mod97_ok(&bytes[start..end])).then_some(end);
    }
    // Printed form: "GB82" then blocks of four separated by one space, the last one shorter.
    let mut chars: Vec<u8> = head.to_vec();
    let mut pos = start + 4;
    let mut ends: Vec<(usize, usize)> = Vec::new();
    while bytes.get(pos) == Some(&b' ') {
        let block = pos + 1;
        let length = block_len(bytes, block);
        if length == 0
            || length > 4
            || chars.len() + length > MAX_LEN
            || glued_after(bytes, block + length)
        {
            break;
        }
        chars.extend_from_slice(&bytes[block..block + length]);
        pos = block + length;
        if chars.len() >= MIN_LEN {
            ends.push((chars.len(), pos));
        }
        if length < 4 {
            break;
        }
    }
    ends.iter()
        .rev()
        .find(|&&(count, _)| mod97_ok(&chars[..count]))
        .map(|&(_, end)| end)
}

/// The ISO 7064 mod-97 check: the first four characters moved to the end, letters read as
/// 10-35, the number modulo 97 is 1.
fn mod97_ok(chars: &[u8]) -> bool {
    let mut remainder: u32 = 0;
    for &byte in chars[4..].iter().chain(&chars[..4]) {
        remainder = if byte.is_ascii_digit() {
            (remainder * 10 + u32::from(byte - b'0')) % 97
        } else {
            (remainder * 100 + u32::from(byte - b'A') + 10) % 97
        };
    }
    remainder == 1
}

#[cfg(test)]
mod tests {
    use crate::scan::tests::spans;
    use crate::Kind;

    fn ibans(text: &str) -> Vec<&str> {
        spans(text, Kind::Iban)
    }

    #[test]
    fn finds_valid_ibans() {
        assert_eq!(
            ibans("pay to GB82 WEST 1234 5698 7654 32 today"),
            vec!["GB82 WEST 1234 5698 7654 32"]
        );
        assert_eq!(
            ibans("GB82WEST12345698765432."),
            vec!["GB82WEST12345698765432"]
        );
        assert_eq!(
            ibans("iban: DE89 3704 0044 0532 0130 00, thanks"),
            vec!["DE89 3704 0044 0532 0130 00"]
        );
        assert_eq!(
            ibans("FR14 2004 1010 0505 0001 3M02 606 and NL91ABNA0417164300"),
            vec!["FR14 2004 1010 0505 0001 3M02 606", "NL91ABNA0417164300"]
        );
    }

    #[test]
    fn ignores_invalid_ibans() {
        for text in [
            "GB82 WEST 1234 5698 7654 33",
            "GB83WEST12345698765432",
            "xGB82WEST12345698765432",
            "GB82WEST12345698765432x",
            "gb82 west 1234 5698 7654 32",
            "AB12",
            "GB82 WEST",
        ] {
            assert!(ibans(text).is_empty(), "{text}: {:?}", ibans(text));
        }
    }
}
