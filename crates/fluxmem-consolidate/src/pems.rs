//! PEMS, the skill score of Stage III: PEMS = eta / ln(l) * (1 - delta).
//!
//! - `eta`: how well the skill agrees with episodes it was not mined from, in [0, 1]: a replay
//!   model's step accuracy acting with the skill, a judge's agreement with the logged outcomes,
//!   or (model-free, the default) sequence coverage of the successes and not of the failures.
//!   Which episodes measure it and which choose the rewrites: `mature.rs`'s module docs;
//! - `l`: the skill's length in tokens of the generator (or in words), clamped to l >= 2 so
//!   ln(l) > 0;
//! - `delta` = 1 - cos(this version's embedding, the previous version's), clamped to [0, 1];
//!   0 for a first version. A zero vector has cosine 0 to anything (delta 1), never NaN.
//! - optionally divided by the number of skills of the run (the reference code does).

use serde::{Deserialize, Serialize};

/// How skill length is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LengthUnit {
    /// Tokens of the generator's tokenizer (default).
    Tokens,
    /// Whitespace-separated words (the reference code).
    Words,
}

impl std::str::FromStr for LengthUnit {
    type Err = String;
    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "tokens" => Ok(LengthUnit::Tokens),
            "words" => Ok(LengthUnit::Words),
            other => Err(format!("length unit `{other}`: expected tokens or words")),
        }
    }
}

/// The switches of the score.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PemsOptions {
    /// Tokens or words.
    pub length: LengthUnit,
    /// Divide by the number of skills of the run (reference code); off by default.
    pub divide_by_skills: bool,
}

impl Default for PemsOptions {
    fn default() -> Self {
        PemsOptions {
            length: LengthUnit::Tokens,
            divide_by_skills: false,
        }
    }
}

/// One scored version of a skill: the score and its parts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PemsScore {
    /// The score.
    pub pems: f64,
    /// Agreement with the source episodes, in [0, 1].
    pub eta: f64,
    /// Length as counted (before the clamp).
    pub length: usize,
    /// 1 - cosine to the previous version, in [0, 1].
    pub delta: f64,
}

/// delta = 1 - cos(current, previous), clamped to [0, 1]; 0 without a previous version.
pub fn delta(current: &[f32], previous: Option<&[f32]>) -> f64 {
    match previous {
        None => 0.0,
        Some(previous) => (1.0 - fluxmem_models::cosine(current, previous) as f64).clamp(0.0, 1.0),
    }
}

/// PEMS of a version with agreement `eta`, `length` and `delta`, for a run of `skills` skills.
pub fn pems(
    eta: f64,
    length: usize,
    delta: f64,
    skills: usize,
    options: &PemsOptions,
) -> PemsScore {
    let l = length.max(2) as f64;
    let eta_clean = if eta.is_finite() {
        eta.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let delta_clean = if delta.is_finite() {
        delta.clamp(0.0, 1.0)
    } else {
        1.0
    };
    let mut score = eta_clean / l.ln() * (1.0 - delta_clean);
    if options.divide_by_skills {
        score /= skills.max(1) as f64;
    }
    PemsScore {
        pems: score,
        eta: eta_clean,
        length,
        delta: delta_clean,
    }
}

/// Words of `text`, the reference code's length.
pub fn word_count(text: &str) -> usize {
    text.split_whitespace().count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pems_follows_the_definition() {
        let options = PemsOptions::default();
        let score = pems(0.8, 20, 0.1, 3, &options);
        assert!((score.pems - 0.8 / (20f64).ln() * 0.9).abs() < 1e-12);
        let divided = pems(
            0.8,
            20,
            0.1,
            4,
            &PemsOptions {
                divide_by_skills: true,
                ..options
            },
        );
        assert!((divided.pems - score.pems / 4.0).abs() < 1e-12);
        assert_eq!(pems(0.0, 20, 0.0, 1, &options).pems, 0.0);
    }

    #[test]
    fn length_is_clamped_to_two() {
        let options = PemsOptions::default();
        let expected = 1.0 / (2f64).ln();
        for length in [0, 1, 2] {
            let score = pems(1.0, length, 0.0, 1, &options);
            assert!(score.pems.is_finite());
            assert!(
                (score.pems - expected).abs() < 1e-12,
                "l = {length}: {}",
                score.pems
            );
        }
        assert!(
            pems(1.0, 3, 0.0, 1, &options).pems < expected,
            "longer skills score lower"
        );
    }

    #[test]
    fn delta_handles_first_versions_zero_vectors_and_opposites() {
        assert_eq!(delta(&[1.0, 0.0], None), 0.0);
        assert!(delta(&[1.0, 0.0], Some(&[2.0, 0.0])).abs() < 1e-7);
        assert!((delta(&[1.0, 0.0], Some(&[0.0, 1.0])) - 1.0).abs() < 1e-7);
        assert_eq!(delta(&[1.0, 0.0], Some(&[-1.0, 0.0])), 1.0, "clamped to 1");
        for (a, b) in [
            ([0.0, 0.0], [1.0, 0.0]),
            ([1.0, 0.0], [0.0, 0.0]),
            ([0.0, 0.0], [0.0, 0.0]),
        ] {
            let d = delta(&a, Some(&b));
            assert!(d.is_finite() && d == 1.0, "{d}");
            assert_eq!(pems(1.0, 10, d, 1, &PemsOptions::default()).pems, 0.0);
        }
        let bad = pems(
            f64::NAN,
            10,
            f64::NAN,
            0,
            &PemsOptions {
                divide_by_skills: true,
                ..Default::default()
            },
        );
        assert_eq!(bad.pems, 0.0, "NaN inputs never produce a NaN score");
    }

    #[test]
    fn units_parse() {
        assert_eq!("words".parse::<LengthUnit>().unwrap(), LengthUnit::Words);
        assert!("bytes".parse::<LengthUnit>().is_err());
        assert_eq!(word_count(" a  b\nc "), 3);
    }
}
