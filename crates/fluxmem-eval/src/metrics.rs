//! Retrieval metrics and their aggregation per category.

use serde::Serialize;
use std::collections::BTreeMap;

/// The cut-offs of `recall@k`.
pub const KS: [usize; 4] = [5, 10, 20, 50];

/// ROC AUC by the rank-sum formula: the share of (positive, negative) pairs whose positive
/// scores higher, ties counted half; `None` without both.
pub fn auc(positives: &[f32], negatives: &[f32]) -> Option<f64> {
    if positives.is_empty() || negatives.is_empty() {
        return None;
    }
    let mut wins = 0.0;
    for p in positives {
        for n in negatives {
            wins += if p > n {
                1.0
            } else if p == n {
                0.5
            } else {
                0.0
            };
        }
    }
    Some(wins / (positives.len() * negatives.len()) as f64)
}

/// Share of `evidence` found in `retrieved` (1.0 when all of it is there).
pub fn recall<T: PartialEq>(retrieved: &[T], evidence: &[T]) -> f64 {
    if evidence.is_empty() {
        return 0.0;
    }
    evidence.iter().filter(|e| retrieved.contains(e)).count() as f64 / evidence.len() as f64
}

/// One question's results for one system.
#[derive(Debug, Clone, Default)]
pub struct QuestionResult {
    /// recall@k for each of [`KS`].
    pub recall_at_k: [f64; 4],
    /// recall@budget per budget.
    pub recall_at_budget: BTreeMap<usize, f64>,
    /// Context tokens used per budget.
    pub context_tokens: BTreeMap<usize, usize>,
}

/// Averages over questions.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Questions averaged.
    pub questions: usize,
    /// `recall@5`, `recall@10`, ... and the rest, flattened into this map.
    #[serde(flatten)]
    pub recall_at_k: BTreeMap<String, f64>,
    /// recall@budget by budget.
    #[serde(rename = "recall@budget")]
    pub recall_at_budget: BTreeMap<String, f64>,
    /// Mean context tokens at the reference budget (1024 when evaluated, else the largest).
    pub mean_context_tokens: f64,
    /// Mean context tokens by budget.
    pub context_tokens: BTreeMap<String, f64>,
}

impl Summary {
    /// Averages `results`.
    pub fn of(results: &[&QuestionResult]) -> Summary {
        let n = results.len().max(1) as f64;
        let mut summary = Summary {
            questions: results.len(),
            ..Summary::default()
        };
        if results.is_empty() {
            return summary;
        }
        for (i, k) in KS.iter().enumerate() {
            summary.recall_at_k.insert(
                format!("recall@{k}"),
                results.iter().map(|r| r.recall_at_k[i]).sum::<f64>() / n,
            );
        }
        let budgets: Vec<usize> = results
            .first()
            .map(|r| r.recall_at_budget.keys().copied().collect())
            .unwrap_or_default();
        for budget in &budgets {
            let recall = results
                .iter()
                .map(|r| r.recall_at_budget[budget])
                .sum::<f64>()
                / n;
            let tokens = results
                .iter()
                .map(|r| r.context_tokens[budget] as f64)
                .sum::<f64>()
                / n;
            summary.recall_at_budget.insert(budget.to_string(), recall);
            summary.context_tokens.insert(budget.to_string(), tokens);
        }
        let reference = if budgets.contains(&1024) {
            Some(1024)
        } else {
            budgets.last().copied()
        };
        summary.mean_context_tokens =
            reference.map_or(0.0, |b| summary.context_tokens[&b.to_string()]);
        summary
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recall_counts_found_evidence() {
        assert_eq!(recall(&[1, 2, 3], &[2, 9]), 0.5);
        assert_eq!(recall(&[1, 2, 3], &[3, 1]), 1.0);
        assert_eq!(recall::<i32>(&[], &[1]), 0.0);
        assert_eq!(recall(&[1], &[] as &[i32]), 0.0);
    }

    #[test]
    fn summary_averages_per_budget() {
        let mut a = QuestionResult {
            recall_at_k: [1.0, 1.0, 1.0, 1.0],
            ..Default::default()
        };
        a.recall_at_budget.insert(256, 1.0);
        a.context_tokens.insert(256, 200);
        let mut b = QuestionResult {
            recall_at_k: [0.0, 0.5, 1.0, 1.0],
            ..Default::default()
        };
        b.recall_at_budget.insert(256, 0.0);
        b.context_tokens.insert(256, 100);
        let summary = Summary::of(&[&a, &b]);
        assert_eq!(summary.recall_at_k["recall@5"], 0.5);
        assert_eq!(summary.recall_at_k["recall@10"], 0.75);
        assert_eq!(summary.recall_at_budget["256"], 0.5);
        assert_eq!(summary.mean_context_tokens, 150.0);
        let json = serde_json::to_value(&summary).unwrap();
        assert_eq!(json["recall@budget"]["256"], 0.5);
        assert_eq!(json["recall@20"], 1.0);
    }
}
