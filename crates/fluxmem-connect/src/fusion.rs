//! Hybrid scores: the paper's plain sum, or the reference code's weighted sum of min-max
//! normalised signals.

use serde::{Deserialize, Serialize};

/// How signals combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FusionMode {
    /// cosine + BM25 + judge, raw (the paper's formula).
    Sum,
    /// w_dense * mm(cosine) + w_bm25 * mm(BM25) + w_judge * mm(judge), each min-max normalised
    /// over the candidate pool (the reference code).
    Weighted,
}

impl std::str::FromStr for FusionMode {
    type Err = String;
    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "sum" => Ok(FusionMode::Sum),
            "weighted" => Ok(FusionMode::Weighted),
            other => Err(format!("fusion `{other}`: expected sum or weighted")),
        }
    }
}

/// Signal weights of the weighted mode.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FusionWeights {
    /// Dense cosine weight.
    pub dense: f32,
    /// BM25 weight.
    pub bm25: f32,
    /// Judge weight.
    pub judge: f32,
}

impl Default for FusionWeights {
    fn default() -> Self {
        FusionWeights {
            dense: 1.0,
            bm25: 0.5,
            judge: 0.3,
        }
    }
}

/// One candidate's raw signals.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Signals {
    /// Cosine with the query.
    pub dense: f32,
    /// BM25 score.
    pub bm25: f32,
    /// Judge score in [0, 1], when the judge ran on this candidate.
    pub judge: Option<f32>,
}

/// Min-max normalisation to [0, 1]; a constant signal maps to 0.
pub fn min_max(values: &[f32]) -> Vec<f32> {
    let min = values.iter().copied().fold(f32::INFINITY, f32::min);
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let range = max - min;
    values
        .iter()
        .map(|v| if range > 0.0 { (v - min) / range } else { 0.0 })
        .collect()
}

/// The fused score of every candidate of a pool. In weighted mode a candidate the judge did not
/// score gets the pool's lowest judge value for that term.
pub fn fuse(mode: FusionMode, weights: &FusionWeights, pool: &[Signals]) -> Vec<f32> {
    match mode {
        FusionMode::Sum => pool
            .iter()
            .map(|s| s.dense + s.bm25 + s.judge.unwrap_or(0.0))
            .collect(),
        FusionMode::Weighted => {
            let dense = min_max(&pool.iter().map(|s| s.dense).collect::<Vec<_>>());
            let bm25 = min_max(&pool.iter().map(|s| s.bm25).collect::<Vec<_>>());
            let judged: Vec<f32> = pool.iter().filter_map(|s| s.judge).collect();
            let floor = judged.iter().copied().fold(f32::INFINITY, f32::min);
            let judge = if judged.is_empty() {
                vec![0.0; pool.len()]
            } else {
                min_max(
                    &pool
                        .iter()
                        .map(|s| s.judge.unwrap_or(floor))
                        .collect::<Vec<_>>(),
                )
            };
            (0..pool.len())
                .map(|i| {
                    weights.dense * dense[i] + weights.bm25 * bm25[i] + weights.judge * judge[i]
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_mode_normalises_each_signal() {
        let pool = [
            Signals {
                dense: 0.9,
                bm25: 0.0,
                judge: None,
            },
            Signals {
                dense: 0.5,
                bm25: 10.0,
                judge: None,
            },
            Signals {
                dense: 0.7,
                bm25: 5.0,
                judge: None,
            },
        ];
        let fused = fuse(FusionMode::Weighted, &FusionWeights::default(), &pool);
        assert!((fused[0] - 1.0).abs() < 1e-6);
        assert!((fused[1] - 0.5).abs() < 1e-6);
        assert!((fused[2] - (0.5 + 0.25)).abs() < 1e-6);
        let sum = fuse(FusionMode::Sum, &FusionWeights::default(), &pool);
        assert!((sum[1] - 10.5).abs() < 1e-6);
    }

    #[test]
    fn judge_term_counts_only_when_present() {
        let pool = [
            Signals {
                dense: 0.5,
                bm25: 1.0,
                judge: Some(0.9),
            },
            Signals {
                dense: 0.5,
                bm25: 1.0,
                judge: Some(0.1),
            },
        ];
        let fused = fuse(FusionMode::Weighted, &FusionWeights::default(), &pool);
        assert!(
            (fused[0] - 0.3).abs() < 1e-6 && fused[1].abs() < 1e-6,
            "{fused:?}"
        );
        let sum = fuse(FusionMode::Sum, &FusionWeights::default(), &pool);
        assert!((sum[0] - 2.4).abs() < 1e-6);
        assert_eq!(min_max(&[2.0, 2.0]), vec![0.0, 0.0]);
    }
}
