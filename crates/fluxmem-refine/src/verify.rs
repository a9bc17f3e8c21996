//! Self-verification: does the context suffice for the query, and which items help?
//!
//! Two verifiers: [`JudgeVerifier`] asks the judge model (P(yes) of "is this enough?" and of
//! "does this passage help?"); [`CoverageVerifier`] is the deterministic fallback, which checks
//! that the query's key terms (terms found in at most a fifth of the memory) occur in the
//! context. Neither sees answers or evidence labels: their only inputs are the query and the
//! memory text.

use fluxmem_connect::{terms, SemanticIndex};
use fluxmem_models::{Judge, Usage};
use std::collections::BTreeSet;

use crate::Result;

/// Feedback on a context, from the query and the memory alone.
pub trait Verifier {
    /// A score in [0, 1]: is `context` enough for `query`?
    fn sufficient(&mut self, query: &str, context: &str) -> Result<f32>;
    /// For each item, a score in [0, 1]: does it help with `query`?
    fn item_scores(&mut self, query: &str, items: &[&str]) -> Result<Vec<f32>>;
    /// The sufficiency score at or above which the loop stops.
    fn sufficient_at(&self) -> f32;
    /// Item scores below this mark distractors.
    fn distractor_below(&self) -> f32;
    /// Model calls and tokens so far.
    fn usage(&self) -> Usage;
    /// `judge:<model>` or `coverage`.
    fn name(&self) -> String;
}

/// The verifier of a loop: the judge when there is one, else the coverage fallback over `index`.
pub fn verifier<'a>(
    judge: Option<&'a mut dyn Judge>,
    index: &'a SemanticIndex,
) -> Box<dyn Verifier + 'a> {
    match judge {
        Some(judge) => Box::new(JudgeVerifier::new(judge)),
        None => Box::new(CoverageVerifier::new(index)),
    }
}

/// The judge model as the verifier.
///
/// A judge that tests whole contexts ([`Judge::judges_contexts`]) says whether the context
/// suffices. One that does not (query likelihood) is asked about the context's first
/// `top_lines` lines instead, and the context's sufficiency is the best of their scores: one
/// item the judge finds strongly relevant near the top. Item scores are remembered per query
/// and line, so the lines of a context are judged once across rounds.
pub struct JudgeVerifier<'a> {
    judge: &'a mut dyn Judge,
    /// Stop when P(sufficient) reaches this (default 0.5).
    pub sufficient_at: f32,
    /// Items the judge scores below this are distractors (default 0.3).
    pub distractor_below: f32,
    /// Lines of a context judged for sufficiency by a judge of items (default 8).
    pub top_lines: usize,
    scores: std::collections::HashMap<(String, String), f32>,
}

impl<'a> JudgeVerifier<'a> {
    /// A verifier on `judge`.
    pub fn new(judge: &'a mut dyn Judge) -> Self {
        JudgeVerifier {
            judge,
            sufficient_at: 0.5,
            distractor_below: 0.3,
            top_lines: 8,
            scores: Default::default(),
        }
    }

    /// The judge's scores of `items`, each judged once per query.
    fn scores(&mut self, query: &str, items: &[&str]) -> Result<Vec<f32>> {
        let key = |item: &str| (query.to_string(), item.to_string());
        let mut new: Vec<&str> = items
            .iter()
            .copied()
            .filter(|item| !self.scores.contains_key(&key(item)))
            .collect();
        new.sort_unstable();
        new.dedup();
        if !new.is_empty() {
            for (item, score) in new.iter().zip(self.judge.score(query, &new)?) {
                self.scores.insert(key(item), score);
            }
        }
        Ok(items.iter().map(|item| self.scores[&key(item)]).collect())
    }
}

impl Verifier for JudgeVerifier<'_> {
    fn sufficient(&mut self, query: &str, context: &str) -> Result<f32> {
        if self.judge.judges_contexts() {
            return Ok(self.judge.sufficient(query, context)?);
        }
        let lines: Vec<&str> = context
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(self.top_lines)
            .collect();
        Ok(self.scores(query, &lines)?.into_iter().fold(0.0, f32::max))
    }
    fn item_scores(&mut self, query: &str, items: &[&str]) -> Result<Vec<f32>> {
        self.scores(query, items)
    }
    fn sufficient_at(&self) -> f32 {
        self.sufficient_at
    }
    fn distractor_below(&self) -> f32 {
        self.distractor_below
    }
    fn usage(&self) -> Usage {
        self.judge.usage()
    }
    fn name(&self) -> String {
        format!("judge:{}", self.judge.model_id())
    }
}

/// The deterministic fallback: key-term coverage.
///
/// The key terms of a query are its terms (lower-cased, stopwords removed) that occur in at
/// least one and at most `max_df` (20% by default) of the indexed memory items: rare enough to
/// identify what the query is about, present somewhere so they can be covered. The context is
/// sufficient when its first `top_lines` (8 by default) items contain every key term; an item's score is the fraction of key terms it
/// contains, so an item with none is a distractor. A query without key terms is sufficient as is.
pub struct CoverageVerifier<'a> {
    index: &'a SemanticIndex,
    /// Largest document frequency of a key term, as a fraction of the memory.
    pub max_df: f32,
    /// Only the first this many context lines count towards sufficiency (the items an agent
    /// reads first); `None`: the whole context.
    pub top_lines: Option<usize>,
    checks: usize,
}

impl<'a> CoverageVerifier<'a> {
    /// A verifier over the memory `index`.
    pub fn new(index: &'a SemanticIndex) -> Self {
        CoverageVerifier {
            index,
            max_df: 0.2,
            top_lines: Some(8),
            checks: 0,
        }
    }

    /// The key terms of `query`.
    pub fn key_terms(&self, query: &str) -> BTreeSet<String> {
        let limit = ((self.index.len() as f32 * self.max_df).floor() as usize).max(1);
        terms(query)
            .into_iter()
            .filter(|t| {
                let df = self.index.document_frequency(t);
                df >= 1 && df <= limit
            })
            .collect()
    }

    fn covered(key: &BTreeSet<String>, text: &str) -> usize {
        let words: BTreeSet<String> = terms(text).into_iter().collect();
        key.iter().filter(|t| words.contains(*t)).count()
    }
}

impl Verifier for CoverageVerifier<'_> {
    fn sufficient(&mut self, query: &str, context: &str) -> Result<f32> {
        self.checks += 1;
        let key = self.key_terms(query);
        if key.is_empty() {
            return Ok(1.0);
        }
        let head: String = match self.top_lines {
            Some(n) => context.lines().take(n).collect::<Vec<_>>().join("\n"),
            None => context.to_string(),
        };
        Ok(Self::covered(&key, &head) as f32 / key.len() as f32)
    }
    fn item_scores(&mut self, query: &str, items: &[&str]) -> Result<Vec<f32>> {
        self.checks += items.len();
        let key = self.key_terms(query);
        Ok(items
            .iter()
            .map(|item| {
                if key.is_empty() {
                    1.0
                } else {
                    Self::covered(&key, item) as f32 / key.len() as f32
                }
            })
            .collect())
    }
    fn sufficient_at(&self) -> f32 {
        1.0
    }
    fn distractor_below(&self) -> f32 {
        1e-6
    }
    fn usage(&self) -> Usage {
        // No model runs: the checks are counted as calls with no tokens.
        Usage {
            calls: self.checks,
            ..Usage::default()
        }
    }
    fn name(&self) -> String {
        "coverage".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scores a passage by its number (`"item 7"` -> 0.7); counts the passages it was asked about.
    struct Numbered {
        whole: bool,
        asked: usize,
    }

    impl Judge for Numbered {
        fn score(&mut self, _query: &str, passages: &[&str]) -> fluxmem_models::Result<Vec<f32>> {
            self.asked += passages.len();
            Ok(passages
                .iter()
                .map(|p| p.trim_start_matches("item ").parse::<f32>().unwrap() / 10.0)
                .collect())
        }
        fn sufficient(&mut self, _query: &str, _context: &str) -> fluxmem_models::Result<f32> {
            Ok(0.99)
        }
        fn judges_contexts(&self) -> bool {
            self.whole
        }
        fn usage(&self) -> Usage {
            Usage::default()
        }
        fn model_id(&self) -> &str {
            "numbered"
        }
    }

    #[test]
    fn a_judge_of_items_tests_the_context_by_its_best_top_line() {
        let context = (0..10)
            .map(|i| format!("item {}", [2, 1, 3, 0, 4, 1, 2, 3, 9, 9][i]))
            .collect::<Vec<_>>()
            .join("\n");
        let mut judge = Numbered {
            whole: false,
            asked: 0,
        };
        let mut verifier = JudgeVerifier::new(&mut judge);
        // The best of the first 8 lines (0.4): the two 0.9 lines come after them.
        assert!((verifier.sufficient("q", &context).unwrap() - 0.4).abs() < 1e-6);
        let lines: Vec<&str> = context.lines().collect();
        let scores = verifier.item_scores("q", &lines).unwrap();
        assert!(
            (scores[8] - 0.9).abs() < 1e-6 && (scores[3] - 0.0).abs() < 1e-6,
            "{scores:?}"
        );
        // Each distinct line was judged once: 5 distinct in the first 8, then only "item 9".
        assert_eq!(judge.asked, 6);
        // A judge of whole contexts is asked about the context itself.
        let mut whole = Numbered {
            whole: true,
            asked: 0,
        };
        assert_eq!(
            JudgeVerifier::new(&mut whole)
                .sufficient("q", &context)
                .unwrap(),
            0.99
        );
        assert_eq!(whole.asked, 0);
    }
}
