//! Phone numbers and payment card numbers, both read from one scan over "digit runs".
//!
//! A digit run is an optional `+`, an optional `(`, then groups of digits joined by a gap of
//! one `)`, one of ` `, `-`, `.`, and one `(`, in that order, each optional but not all absent
//! (`+1 (555) 123-4567`, `4111 1111 1111 1111`, `06 12 34 56 78`). A run glued to a letter,
//! digit or underscore, or to a `.`/`-`/`/`/`,`/`+` that is itself glued to one, is not a
//! phone number (`#W2378156`, `ZFA04Y`, `v2-555-123-4567`).
//!
//! **Phone**: a whole run of 9 to 15 digits with balanced parentheses that is either
//! - international: starts with `+` (at most 8 groups), or
//! - national with a trunk prefix: 2 to 6 groups, first digit `0`, every group 2+ digits
//!   (`020 7946 0958`, `06 12 34 56 78`, `(030) 1234 5678`), or
//! - North American: groups of 3-3-4 digits, optionally after a `1` (`(555) 123-4567`,
//!   `1-555-123-4567`, `555.123.4567`),
//!
//! and that contains no date (`2024-05-01 14` is not a phone number: three groups shaped
//! year-month-day or day-month-year with the same `-` or `.` between them) and is not a dotted
//! quad (an IPv4 address). A bare string of ten digits is a phone number when it has the North
//! American plan's shape (an area code starting with 2-9: `5551234567`, or
//! `15551234567` with the country code); other bare digit strings (`123456789`, order numbers,
//! Unix times, which start with 1) are not.
//!
//! **Card**: a window of consecutive groups of a run, written as one group of 13 to 19 digits,
//! or as 4-4-4-N (N 1 to 4), 4-4-4-4-N (N 1 to 3), 4-6-5 or 4-6-4 with one separator (all
//! spaces or all hyphens), whose first digit is 3, 4, 5 or 6 or whose first two are 22-27 (the
//! card networks' ranges; this also keeps compact timestamps like `20240501123045` out), and
//! whose digits pass the Luhn check. The same number typed with odd spacing is a card too: any
//! window of groups of at most 6 digits, joined by single spaces or hyphens (mixed allowed), 13
//! to 19 digits in all, with a network prefix and a valid Luhn check (`4111 11 11 1111 1111`,
//! `4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1`, `4111 1111-1111 1111`).

use super::{before, is_word, Candidate};
use crate::Kind;

/// Fewest digits of a phone number.
pub const PHONE_MIN_DIGITS: usize = 9;
/// Most digits of a phone number (the E.164 maximum).
pub const PHONE_MAX_DIGITS: usize = 15;

/// Where a run ends and what surrounds it; its digit groups live in a reused buffer.
struct Run {
    start: usize,
    end: usize,
    plus: bool,
    balanced: bool,
}

/// A group of digits: `bytes[start..end]`.
type Group = (usize, usize);

fn group_len(group: Group) -> usize {
    group.1 - group.0
}

/// Pushes the phone numbers (when `phones`) and card numbers (when `cards`) in `bytes`.
/// Linear: every byte is read by one run, and card windows span at most five groups.
pub(super) fn scan(bytes: &[u8], phones: bool, cards: bool, out: &mut Vec<Candidate>) {
    let mut groups: Vec<Group> = Vec::new();
    let mut index = 0;
    while index < bytes.len() {
        if !starts_run(bytes, index) {
            index += 1;
            continue;
        }
        let run = read_run(bytes, index, &mut groups);
        let open_before = boundary_before(bytes, run.start);
        let open_after = boundary_after(bytes, run.end);
        if phones && open_before && open_after && is_phone(bytes, &run, &groups) {
            out.push(Candidate::new(run.start, run.end, Kind::Phone));
        }
        if cards {
            let last = groups[groups.len() - 1];
            push_cards(
                bytes,
                &groups,
                open_before,
                boundary_after(bytes, last.1),
                out,
            );
        }
        index = run.end.max(index + 1);
    }
}

fn is_digit_at(bytes: &[u8], index: usize) -> bool {
    bytes.get(index).is_some_and(u8::is_ascii_digit)
}

/// True when a digit run starts at `index`: a digit, or `+` / `(` / `+(` before one.
fn starts_run(bytes: &[u8], index: usize) -> bool {
    match bytes[index] {
        b'0'..=b'9' => true,
        b'+' if bytes.get(index + 1) == Some(&b'(') => is_digit_at(bytes, index + 2),
        b'+' | b'(' => is_digit_at(bytes, index + 1),
        _ => false,
    }
}

/// Reads the run starting at `start` (where [`starts_run`] holds) into `groups`.
fn read_run(bytes: &[u8], start: usize, groups: &mut Vec<Group>) -> Run {
    groups.clear();
    let mut pos = start;
    let plus = bytes[pos] == b'+';
    if plus {
        pos += 1;
    }
    let mut open = false;
    if bytes[pos] == b'(' {
        open = true;
        pos += 1;
    }
    loop {
        let group_start = pos;
        while pos < bytes.len() && bytes[pos].is_ascii_digit() {
            pos += 1;
        }
        groups.push((group_start, pos));
        match next_group(bytes, pos, &mut open) {
            Some(next) => pos = next,
            None => break,
        }
    }
    let mut end = pos;
    if open && bytes.get(end) == Some(&b')') {
        end += 1;
        open = false;
    }
    Run {
        start,
        end,
        plus,
        balanced: !open,
    }
}

/// Reads the gap after a group ending at `pos`: where the next group starts, if one follows.
fn next_group(bytes: &[u8], pos: usize, open: &mut bool) -> Option<usize> {
    let mut next = pos;
    let close = bytes.get(next) == Some(&b')');
    if close {
        if !*open {
            return None;
        }
        next += 1;
    }
    let separator = match bytes.get(next) {
        Some(&byte) if matches!(byte, b' ' | b'-' | b'.') => {
            next += 1;
            Some(byte)
        }
        _ => None,
    };
    let reopen = bytes.get(next) == Some(&b'(');
    if reopen {
        if *open && !close {
            return None;
        }
        next += 1;
    }
    if next == pos || (separator == Some(b'.') && (close || reopen)) || !is_digit_at(bytes, next) {
        return None;
    }
    *open = reopen || (*open && !close);
    Some(next)
}

/// The byte before a run may not glue it to a word or a longer number.
fn boundary_before(bytes: &[u8], start: usize) -> bool {
    match before(bytes, start) {
        None => true,
        Some(byte) if is_word(byte) => false,
        Some(b'.' | b'-' | b'/' | b',' | b'+') => {
            !before(bytes, start - 1).is_some_and(|byte| byte.is_ascii_alphanumeric())
        }
        Some(_) => true,
    }
}

/// The byte after a run may not glue it to a word or a longer number.
fn boundary_after(bytes: &[u8], end: usize) -> bool {
    match bytes.get(end) {
        None => true,
        Some(&byte) if is_word(byte) => false,
        Some(b'.' | b'-' | b'/' | b',') => {
            !bytes.get(end + 1).is_some_and(u8::is_ascii_alphanumeric)
        }
        Some(_) => true,
    }
}

/// The bytes between groups `index` and `index + 1`.
fn gap<'a>(bytes: &'a [u8], groups: &[Group], index: usize) -> &'a [u8] {
    &bytes[groups[index].1..groups[index + 1].0]
}

fn is_phone(bytes: &[u8], run: &Run, groups: &[Group]) -> bool {
    let digits: usize = groups.iter().map(|&group| group_len(group)).sum();
    if !run.balanced || !(PHONE_MIN_DIGITS..=PHONE_MAX_DIGITS).contains(&digits) {
        return false;
    }
    if run.plus {
        return groups.len() <= 8;
    }
    if has_date(bytes, groups) || is_dotted_quad(bytes, groups) {
        return false;
    }
    let lengths: Vec<usize> = groups.iter().map(|&group| group_len(group)).collect();
    let trunk = (2..=6).contains(&lengths.len())
        && bytes[groups[0].0] == b'0'
        && lengths.iter().all(|&length| length >= 2);
    let first = groups[0].0;
    let north_american = match lengths.as_slice() {
        [3, 3, 4] => true,
        [1, 3, 3, 4] => bytes[first] == b'1',
        [10] => is_nanp(&bytes[first..first + 10]),
        [11] => bytes[first] == b'1' && is_nanp(&bytes[first + 1..first + 11]),
        _ => false,
    };
    trunk || north_american
}

/// Ten digits in the North American numbering plan's shape: an area code starting with 2-9
/// (`5551234567`). Unix times in seconds (`1714567890`) start with 1.
fn is_nanp(digits: &[u8]) -> bool {
    digits.len() == 10 && digits[0] >= b'2'
}

/// Three consecutive groups shaped like a date (`2024-05-01`, `01.05.2024`) with the same
/// `-` or `.` between them.
fn has_date(bytes: &[u8], groups: &[Group]) -> bool {
    let year = |group: Group| {
        group_len(group) == 4
            && (bytes[group.0..].starts_with(b"19") || bytes[group.0..].starts_with(b"20"))
    };
    let small = |group: Group| (1..=2).contains(&group_len(group));
    (0..groups.len().saturating_sub(2)).any(|index| {
        let (first, second) = (gap(bytes, groups, index), gap(bytes, groups, index + 1));
        let same_separator = first.len() == 1 && first == second && matches!(first[0], b'-' | b'.');
        let (a, b, c) = (groups[index], groups[index + 1], groups[index + 2]);
        same_separator && ((year(a) && small(b) && small(c)) || (small(a) && small(b) && year(c)))
    })
}

/// Four groups of at most three digits joined by dots: an IPv4 address or a version.
fn is_dotted_quad(bytes: &[u8], groups: &[Group]) -> bool {
    groups.len() == 4
        && groups.iter().all(|&group| group_len(group) <= 3)
        && (0..3).all(|index| gap(bytes, groups, index) == b".")
}

/// Pushes the card numbers among the windows of `groups`. `open_before` / `open_after` say
/// whether the run's first group / last group may start / end a card.
fn push_cards(
    bytes: &[u8],
    groups: &[Group],
    open_before: bool,
    open_after: bool,
    out: &mut Vec<Candidate>,
) {
    let mut index = 0;
    while index < groups.len() {
        match card_at(bytes, groups, index, open_before || index > 0, open_after) {
            Some(last) => {
                out.push(Candidate::new(groups[index].0, groups[last].1, Kind::Card));
                index = last + 1;
            }
            None => index += 1,
        }
    }
}

/// The last group of the longest card window starting at group `first`, if any.
fn card_at(
    bytes: &[u8],
    groups: &[Group],
    first: usize,
    open_before: bool,
    open_after: bool,
) -> Option<usize> {
    if !open_before {
        return None;
    }
    let count = groups.len();
    let len = |index: usize| group_len(groups[index]);
    let mut lasts = [None; 4];
    if (13..=19).contains(&len(first)) {
        lasts[0] = Some(first);
    }
    if first + 2 < count
        && len(first) == 4
        && len(first + 1) == 6
        && matches!(len(first + 2), 4 | 5)
    {
        lasts[1] = Some(first + 2);
    }
    if first + 3 < count
        && (first..first + 3).all(|index| len(index) == 4)
        && (1..=4).contains(&len(first + 3))
    {
        lasts[2] = Some(first + 3);
        if len(first + 3) == 4 && first + 4 < count && (1..=3).contains(&len(first + 4)) {
            lasts[3] = Some(first + 4);
        }
    }
    let mut best: Option<(usize, usize)> = None;
    if let Some((digits, last)) = loose_card_at(bytes, groups, first, open_after) {
        best = Some((digits, last));
    }
    for last in lasts.into_iter().flatten() {
        if last + 1 == count && !open_after {
            continue;
        }
        let Some(digits) = card_digits(bytes, groups, first, last) else {
            continue;
        };
        if best.is_none_or(|(most, _)| digits.len() > most) {
            best = Some((digits.len(), last));
        }
    }
    best.map(|(_, last)| last)
}

/// The longest window of groups from `first` in any grouping (the disguise of a number typed
/// with odd spacing, `4111 11 11 1111 1111` or `4 1 1 1 ...`): groups of at most
/// [`LOOSE_GROUP_MAX`] digits, each gap one space or one hyphen (mixed allowed), 13 to 19 digits
/// in all, a card network's prefix and a valid Luhn check. Returns its digit count and last group.
fn loose_card_at(
    bytes: &[u8],
    groups: &[Group],
    first: usize,
    open_after: bool,
) -> Option<(usize, usize)> {
    let mut digits: Vec<u8> = Vec::new();
    let mut best = None;
    for last in first..groups.len() {
        if last > first && !matches!(gap(bytes, groups, last - 1), b" " | b"-") {
            break;
        }
        if group_len(groups[last]) > LOOSE_GROUP_MAX {
            break;
        }
        digits.extend_from_slice(&bytes[groups[last].0..groups[last].1]);
        if digits.len() > 19 {
            break;
        }
        let closes = last + 1 < groups.len() || open_after;
        if digits.len() >= 13 && closes && is_card_number(&digits) {
            best = Some((digits.len(), last));
        }
    }
    best
}

/// Longest group of a card number in any grouping ([`loose_card_at`]): the 4-6-5 form's 6.
const LOOSE_GROUP_MAX: usize = 6;

/// True when ASCII `digits` start with a card network's prefix (3-6, or 22-27) and pass Luhn.
fn is_card_number(digits: &[u8]) -> bool {
    let network = match digits[0] {
        b'3'..=b'6' => true,
        b'2' => (b'2'..=b'7').contains(&digits[1]),
        _ => false,
    };
    network && luhn(digits)
}

/// The digits of groups `first..=last` when they form a valid card number.
fn card_digits(bytes: &[u8], groups: &[Group], first: usize, last: usize) -> Option<Vec<u8>> {
    let separator: &[u8] = if first < last {
        gap(bytes, groups, first)
    } else {
        b""
    };
    let separators_ok = (first..last).all(|index| {
        let between = gap(bytes, groups, index);
        between == separator && (between == b" " || between == b"-")
    });
    if !separators_ok {
        return None;
    }
    let digits: Vec<u8> = (first..=last)
        .flat_map(|index| bytes[groups[index].0..groups[index].1].iter().copied())
        .collect();
    is_card_number(&digits).then_some(digits)
}

/// The Luhn checksum of ASCII digits.
pub(crate) fn luhn(digits: &[u8]) -> bool {
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(position, &digit)| {
            let value = u32::from(digit - b'0');
            if position % 2 == 1 {
                let doubled = value * 2;
                if doubled > 9 {
                    doubled - 9
                } else {
                    doubled
                }
            } else {
                value
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

#[cfg(test)]
mod tests {
    use super::luhn;
    use crate::scan::tests::spans;
    use crate::Kind;

    fn phones(text: &str) -> Vec<&str> {
        spans(text, Kind::Phone)
    }

    fn cards(text: &str) -> Vec<&str> {
        spans(text, Kind::Card)
    }

    #[test]
    fn luhn_checksum() {
        assert!(luhn(b"4111111111111111"));
        assert!(luhn(b"378282246310005"));
        assert!(!luhn(b"4111111111111112"));
        assert!(!luhn(b"4111111111111121"));
    }

    #[test]
    fn finds_phone_numbers() {
        assert_eq!(
            phones("call +1 (555) 123-4567 now"),
            vec!["+1 (555) 123-4567"]
        );
        assert_eq!(
            phones("uk +44 20 7946 0958, fr +33 6 12 34 56 78."),
            vec!["+44 20 7946 0958", "+33 6 12 34 56 78"]
        );
        assert_eq!(phones("tel:+15551234567"), vec!["+15551234567"]);
        assert_eq!(
            phones("call 5551234567 or 15551234567"),
            vec!["5551234567", "15551234567"]
        );
        assert_eq!(
            phones("(555) 123-4567 or 555.123.4567 or 1-555-123-4567"),
            vec!["(555) 123-4567", "555.123.4567", "1-555-123-4567"]
        );
        assert_eq!(
            phones("office 020 7946 0958; mobile 06 12 34 56 78; (030) 1234 5678"),
            vec!["020 7946 0958", "06 12 34 56 78", "(030) 1234 5678"]
        );
    }

    #[test]
    fn ignores_dates_times_amounts_and_ids() {
        let texts = [
            "on 2024-05-01 at 14:30:00",
            "2024-05-01 14:30",
            "01.05.2024 12",
            "total 1 234 567 890 EUR",
            "$1,234,567.89",
            "order 123456789 shipped",
            "unix 1714567890",
            "id 0551234567 and 25551234567",
            "reservation ZFA04Y, user #W2378156",
            "ids W2378156-555-1234 and abc555-123-4567",
            "3 4 5 6 7 8 9 10 11",
            "version 10.20.30.40",
            "555-123-4567.txt",
            "(555 123-4567",
            "1234 5678 9012",
        ];
        for text in texts {
            assert!(phones(text).is_empty(), "{text}: {:?}", phones(text));
        }
    }

    #[test]
    fn finds_luhn_valid_cards() {
        assert_eq!(
            cards("card 4111 1111 1111 1111 exp 12/26"),
            vec!["4111 1111 1111 1111"]
        );
        assert_eq!(cards("4111-1111-1111-1111"), vec!["4111-1111-1111-1111"]);
        assert_eq!(cards("pan=4111111111111111;"), vec!["4111111111111111"]);
        assert_eq!(cards("amex 3782 822463 10005."), vec!["3782 822463 10005"]);
        // Odd groupings of the same digits (a disguise, not a layout).
        for text in [
            "4111 11 11 1111 1111",
            "4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1",
            "4111 1111-1111 1111",
            "41 11-11 11 11 11 11 11",
            "41111 1111 1111 111",
        ] {
            assert_eq!(cards(&format!("pay with {text} today")), vec![text]);
        }
        assert_eq!(
            cards("mc 5500 0000 0000 0004 and visa 4012888888881881"),
            vec!["5500 0000 0000 0004", "4012888888881881"]
        );
    }

    #[test]
    fn ignores_invalid_cards() {
        let texts = [
            "4111 1111 1111 1112",
            "4111111111111121",
            "x4111111111111111",
            "4111111111111111x",
            "20240501123045",
            "1111 1111 1111 1117",
            "2024-05-01",
        ];
        for text in texts {
            assert!(cards(text).is_empty(), "{text}: {:?}", cards(text));
        }
    }
}
