//! Redaction of personal data and secrets in everything that leaves the fluxmem store:
//! exported skills, prompts sent to a generator, `report.html`, and the edit log's raw model
//! outputs when they are exported.
//!
//! - [`Redactor`]: built from a [`RedactConfig`] (which a pipeline's `[redact]` table parses
//!   straight into), replaces each match with a readable placeholder and counts them
//!   ([`Redacted`], [`Counts`]); [`Redactor::redact_json`] does the same for every string
//!   inside a JSON value, leaving keys alone.
//! - [`Kind`]: the detectors, each with its placeholder.
//!
//! | kind | placeholder | matches | does not match |
//! |---|---|---|---|
//! | `email` | `<email>` | `bob.smith+tag@mail.example.co.uk`; in angle brackets the brackets go too (`Bob <email>`) | `@handle`, `user@localhost`, `a@b.c`, local parts over 64 bytes |
//! | `phone` | `<phone>` | 9-15 digits: `+` forms (`+1 (555) 123-4567`, `+15551234567`); national forms with a leading `0` (`020 7946 0958`, `06 12 34 56 78`); North American 3-3-4 (`(555) 123-4567`, `555.123.4567`) | dates (`2024-05-01 14`), times, bare digit strings (`123456789`, Unix times), amounts (`1 234 567 890`), ids glued to letters (`#W2378156`, `ZFA04Y`), dotted quads |
//! | `card` | `<card>` | 13-19 digits, compact or in 4-4-4-4 / 4-6-5 / 4-6-4 groups with one kind of separator (space or `-`), network prefix 3-6 or 22-27, Luhn-valid (`4111 1111 1111 1111`) | Luhn-invalid numbers, mixed separators, digits glued to letters, compact timestamps (`20240501123045`) |
//! | `iban` | `<iban>` | two capitals, two check digits, 11-30 capitals/digits, compact or in blocks of four, mod-97 valid (`GB82 WEST 1234 5698 7654 32`) | a failing check (`GB82 WEST 1234 5698 7654 33`), lowercase |
//! | `secret` | `<secret>` | prefixed keys (`sk-`, `sk_live_`, `pk_live_`, `ghp_`, `gho_`, `github_pat_`, `xoxb-`, `xoxp-`, `AKIA`/`ASIA` + 16, `AIza`), JWTs (`eyJ...`), the token of `Bearer <token>`, and high-entropy tokens: 24+ bytes of `[A-Za-z0-9_+/-]` (plus `=` padding) with a lowercase letter, a capital and a digit, not camel case, Shannon entropy >= 4.0 bits per byte | lowercase hex (SHA-256 digests, fluxmem node ids), UUIDs, identifiers like `getUserAccountBalance2024Report`, paths (split at `/` and judged by segment), `sk-learn` |
//! | `ip` | `<ip>` | IPv4 with octets 0-255 (`10.0.0.1`); IPv6 with 8 groups or 3+ groups and `::` (`2001:db8::1`, `::ffff:192.0.2.1`) | `999.1.1.1`, versions (`1.2.3`, `1.2.3.4.5`, `v1.2.3.4`), times, MAC addresses, `::1`, `fe80::1`, `std::vec` |
//!
//! The thresholds are the constants and tables of the detector modules; the entropy rule's are
//! [`ENTROPY_MIN_LEN`] and [`ENTROPY_MIN_BITS`], the phone's [`PHONE_MIN_DIGITS`] and
//! [`PHONE_MAX_DIGITS`].
//!
//! Overlapping matches are merged into one placeholder named by the match that starts first
//! (then the longest, then the more specific kind), so no byte of any match survives. Strings
//! in [`RedactConfig::allow`] are never redacted. Redaction is deterministic, linear in the
//! text's length, and idempotent: no detector matches a placeholder, and a text is passed over
//! again until nothing changes (in practice once more).
//!
//! ```
//! use fluxmem_redact::{Kind, RedactConfig, Redactor};
//!
//! let redactor = Redactor::new(RedactConfig::default());
//! let out = redactor.redact("mail bob@example.com or call +1 (555) 123-4567; card 4111 1111 1111 1111");
//! assert_eq!(out.text, "mail <email> or call <phone>; card <card>");
//! assert_eq!(out.counts.get(Kind::Card), 1);
//! assert_eq!(out.counts.total(), 3);
//! assert_eq!(redactor.redact(&out.text).text, out.text);
//!
//! // A `[redact]` table, here as JSON: only e-mails, one address allowed.
//! let config: RedactConfig = serde_json::from_str(r#"{"kinds": ["email"], "allow": ["ops@example.com"]}"#).unwrap();
//! let out = Redactor::new(config).redact("ops@example.com, bob@example.com, 10.0.0.1");
//! assert_eq!(out.text, "ops@example.com, <email>, 10.0.0.1");
//! ```

mod config;
mod kind;
mod redactor;
mod scan;

pub use config::RedactConfig;
pub use kind::{Counts, Kind};
pub use redactor::{Redacted, Redactor};
pub use scan::{ENTROPY_MIN_BITS, ENTROPY_MIN_LEN, PHONE_MAX_DIGITS, PHONE_MIN_DIGITS};

/// Errors of the redaction crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A kind name that is not one of `email`, `phone`, `card`, `iban`, `secret`, `ip`.
    #[error(
        "unknown redaction kind `{name}` (expected one of email, phone, card, iban, secret, ip)"
    )]
    UnknownKind {
        /// The name as given.
        name: String,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
