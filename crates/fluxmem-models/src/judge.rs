//! The `Judge` trait and its implementation on a [`Generator`] through the next-token
//! probabilities of "yes" and "no".

use crate::generator::{ChatMessage, Generator, Usage};
use crate::Result;

/// Scores how useful memory items are for a query, and whether a context suffices.
pub trait Judge {
    /// For each passage, a score in [0, 1]: does it help answer / act on `query`?
    fn score(&mut self, query: &str, passages: &[&str]) -> Result<Vec<f32>>;
    /// A score in [0, 1]: is `context` sufficient to answer / act on `query`?
    fn sufficient(&mut self, query: &str, context: &str) -> Result<f32>;
    /// Whether [`Judge::sufficient`] tests a whole context. False for query likelihood, whose
    /// score of a long context says that it is on the query's topic, not that it holds the
    /// answer (docs/refine.md): a verifier then tests the context's items one by one.
    fn judges_contexts(&self) -> bool {
        true
    }
    /// Model calls and tokens so far.
    fn usage(&self) -> Usage;
    /// The model behind the judge.
    fn model_id(&self) -> &str;
}

impl<J: Judge + ?Sized> Judge for Box<J> {
    fn score(&mut self, query: &str, passages: &[&str]) -> Result<Vec<f32>> {
        (**self).score(query, passages)
    }
    fn sufficient(&mut self, query: &str, context: &str) -> Result<f32> {
        (**self).sufficient(query, context)
    }
    fn judges_contexts(&self) -> bool {
        (**self).judges_contexts()
    }
    fn usage(&self) -> Usage {
        (**self).usage()
    }
    fn model_id(&self) -> &str {
        (**self).model_id()
    }
}

const SYSTEM: &str =
    "You judge whether a piece of memory is useful. Answer with one word: yes or no.";
/// The system prompt of [`LlmJudge::run_succeeded`].
const RUN_SYSTEM: &str =
    "You review the log of an AI agent's run. Answer with one word: yes or no.";
/// The question after a run's log.
const RUN_QUESTION: &str = "\nDid the agent do what the user asked, with no error left unresolved and no complaint from the user? Answer yes or no.";
const YES: [&str; 4] = ["yes", "Yes", " yes", " Yes"];
const NO: [&str; 4] = ["no", "No", " no", " No"];

/// A judge built on a generator: P(yes) / (P(yes) + P(no)) for the first answer token, where
/// each side sums the case and leading-space variants. The query part of the prompt is shared,
/// so it runs once per query, not once per passage.
pub struct LlmJudge<G: Generator> {
    generator: G,
    /// Characters of a passage shown to the model (long passages are cut).
    pub max_passage_chars: usize,
    /// The yes-probability of a content-free log ([`CONTENT_FREE`]), asked once.
    run_prior: Option<f32>,
}

/// The log a run's probability is calibrated against: one with no content, as in contextual
/// calibration (Zhao et al. 2021, "Calibrate Before Use").
const CONTENT_FREE: &str = "N/A";

impl<G: Generator> LlmJudge<G> {
    /// A judge on `generator`.
    pub fn new(generator: G) -> Self {
        LlmJudge {
            generator,
            max_passage_chars: 1200,
            run_prior: None,
        }
    }

    /// The generator back.
    pub fn into_inner(self) -> G {
        self.generator
    }

    fn yes_probability(&mut self, prefix: &str, suffixes: &[String]) -> Result<Vec<f32>> {
        let options: Vec<&str> = YES.iter().chain(NO.iter()).copied().collect();
        let log_probs = self
            .generator
            .next_token_logprobs(prefix, suffixes, &options)?;
        Ok(log_probs
            .iter()
            .map(|lp| {
                let yes = log_sum_exp(&lp[..YES.len()]);
                let no = log_sum_exp(&lp[YES.len()..]);
                1.0 / (1.0 + (no - yes).exp())
            })
            .collect())
    }

    /// For each run's log (the caller renders and clips it): the probability that the run did
    /// what its user asked. It is P(yes) as for [`Judge::score`], calibrated against the
    /// model's answer to a content-free log ([`CONTENT_FREE`], asked once): with `b` that
    /// answer's P(yes), `p (1 - b) / (p (1 - b) + (1 - p) b)`, so a run the model reads as no
    /// likelier done than nothing scores 0.5, whatever the model's lean to yes or no. The
    /// instruction is the shared prefix; each log is a suffix. Used to label the outcome of
    /// runs whose log says none (`fluxmem ingest --label-outcomes`).
    pub fn run_succeeded(&mut self, runs: &[String]) -> Result<Vec<f32>> {
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        let prior = match self.run_prior {
            Some(prior) => prior,
            None => {
                let prior = self.raw_run_succeeded(&[CONTENT_FREE.to_string()])?[0];
                self.run_prior = Some(prior);
                prior
            }
        };
        Ok(self
            .raw_run_succeeded(runs)?
            .into_iter()
            .map(|p| calibrated(p, prior))
            .collect())
    }

    fn raw_run_succeeded(&mut self, runs: &[String]) -> Result<Vec<f32>> {
        let (prefix, suffixes) =
            self.split_prompt_with(RUN_SYSTEM, "Log of the run:\n", runs, RUN_QUESTION);
        self.yes_probability(&prefix, &suffixes)
    }

    /// The prompt split where the per-item text starts: (shared prefix, per-item suffixes).
    fn split_prompt(&self, head: &str, items: &[String], tail: &str) -> (String, Vec<String>) {
        self.split_prompt_with(SYSTEM, head, items, tail)
    }

    fn split_prompt_with(
        &self,
        system: &str,
        head: &str,
        items: &[String],
        tail: &str,
    ) -> (String, Vec<String>) {
        let marker = "\u{1}ITEM\u{1}";
        let prompt = self.generator.chat_prompt(&[
            ChatMessage::new("system", system),
            ChatMessage::new("user", format!("{head}{marker}{tail}")),
        ]);
        let (prefix, rest) = prompt
            .split_once(marker)
            .expect("the marker is in the prompt");
        (
            prefix.to_string(),
            items.iter().map(|item| format!("{item}{rest}")).collect(),
        )
    }

    fn clip(&self, text: &str) -> String {
        clip(text, self.max_passage_chars)
    }
}

/// A judge by query likelihood: how much a passage raises the probability of the query,
/// `log P(query | passage) - log P(query)` per query token (the pointwise mutual information of
/// the two, as in UPR, Sachan et al. 2022), mapped to [0, 1] by a logistic. The model reads the
/// passage and is asked to write the question it answers; the query is scored as its reply, in
/// one padded forward per batch of passages ([`Generator::continuation_logprobs`]).
pub struct QlJudge<G: Generator> {
    generator: G,
    /// Characters of a passage shown to the model (long passages are cut).
    pub max_passage_chars: usize,
}

const QL_SYSTEM: &str = "You write the question that a piece of memory answers.";

impl<G: Generator> QlJudge<G> {
    /// A judge on `generator`.
    pub fn new(generator: G) -> Self {
        QlJudge {
            generator,
            max_passage_chars: 1200,
        }
    }

    /// The generator back.
    pub fn into_inner(self) -> G {
        self.generator
    }

    fn context(&self, passage: Option<&str>) -> String {
        let user = match passage {
            Some(p) => format!(
                "Memory:\n{}\n\nWrite a question that this memory answers.",
                clip(p, self.max_passage_chars)
            ),
            None => "Write a question.".to_string(),
        };
        self.generator.chat_prompt(&[
            ChatMessage::new("system", QL_SYSTEM),
            ChatMessage::new("user", user),
        ])
    }

    /// Per passage: `log P(query | passage) - log P(query)`, per query token.
    pub fn pmi(&mut self, query: &str, passages: &[&str]) -> Result<Vec<f32>> {
        let tokens = self.generator.count_tokens(query)?.max(1) as f32;
        let mut pairs: Vec<(String, String)> = passages
            .iter()
            .map(|p| (self.context(Some(p)), query.to_string()))
            .collect();
        pairs.push((self.context(None), query.to_string()));
        let log_probs = self.generator.continuation_logprobs(&pairs)?;
        let prior = log_probs[passages.len()];
        Ok(log_probs[..passages.len()]
            .iter()
            .map(|lp| (lp - prior) / tokens)
            .collect())
    }
}

fn clip(text: &str, chars: usize) -> String {
    match text.char_indices().nth(chars) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_string(),
    }
}

impl<G: Generator> Judge for QlJudge<G> {
    fn score(&mut self, query: &str, passages: &[&str]) -> Result<Vec<f32>> {
        if passages.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self
            .pmi(query, passages)?
            .into_iter()
            .map(|x| 1.0 / (1.0 + (-x).exp()))
            .collect())
    }

    fn sufficient(&mut self, query: &str, context: &str) -> Result<f32> {
        Ok(self.score(query, &[context])?[0])
    }

    fn judges_contexts(&self) -> bool {
        false
    }

    fn usage(&self) -> Usage {
        self.generator.usage()
    }

    fn model_id(&self) -> &str {
        self.generator.model_id()
    }
}

/// `p` divided by the prior `b` (and `1 - p` by `1 - b`), renormalised.
fn calibrated(p: f32, prior: f32) -> f32 {
    let b = prior.clamp(1e-6, 1.0 - 1e-6);
    let yes = p * (1.0 - b);
    let no = (1.0 - p) * b;
    if yes + no <= 0.0 {
        0.5
    } else {
        yes / (yes + no)
    }
}

fn log_sum_exp(values: &[f32]) -> f32 {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    max + values.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
}

impl<G: Generator> Judge for LlmJudge<G> {
    fn score(&mut self, query: &str, passages: &[&str]) -> Result<Vec<f32>> {
        if passages.is_empty() {
            return Ok(Vec::new());
        }
        let items: Vec<String> = passages.iter().map(|p| self.clip(p)).collect();
        let head = format!("Question: {query}\nPassage:\n");
        let tail = "\nDoes this passage help answer the question? Answer yes or no.";
        let (prefix, suffixes) = self.split_prompt(&head, &items, tail);
        self.yes_probability(&prefix, &suffixes)
    }

    fn sufficient(&mut self, query: &str, context: &str) -> Result<f32> {
        let head = format!("Question: {query}\nContext:\n");
        let tail = "\nIs this context enough to answer the question? Answer yes or no.";
        let (prefix, suffixes) = self.split_prompt(&head, &[self.clip(context)], tail);
        Ok(self.yes_probability(&prefix, &suffixes)?[0])
    }

    fn usage(&self) -> Usage {
        self.generator.usage()
    }

    fn model_id(&self) -> &str {
        self.generator.model_id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{GenerateParams, Generation};

    /// A generator whose "model" says yes exactly when the suffix mentions the word `refund`.
    struct Scripted {
        usage: Usage,
    }

    impl Generator for Scripted {
        fn model_id(&self) -> &str {
            "scripted"
        }
        fn chat_prompt(&self, messages: &[ChatMessage]) -> String {
            messages
                .iter()
                .map(|m| format!("[{}] {}\n", m.role, m.content))
                .collect::<String>()
                + "[assistant] "
        }
        fn generate(&mut self, _: &[ChatMessage], _: &GenerateParams) -> Result<Generation> {
            unreachable!("the judge only scores")
        }
        fn next_token_logprobs(
            &mut self,
            prefix: &str,
            suffixes: &[String],
            options: &[&str],
        ) -> Result<Vec<Vec<f32>>> {
            assert!(
                prefix.contains("Question: how do refunds work?"),
                "query is in the shared prefix: {prefix}"
            );
            self.usage.calls += suffixes.len();
            Ok(suffixes
                .iter()
                .map(|s| {
                    let yes = s.split("Does this").next().unwrap_or("").contains("refund");
                    options
                        .iter()
                        .map(|o| {
                            if o.to_lowercase().contains("yes") == yes {
                                -0.1
                            } else {
                                -5.0
                            }
                        })
                        .collect()
                })
                .collect())
        }
        fn continuation_logprobs(&mut self, pairs: &[(String, String)]) -> Result<Vec<f32>> {
            self.usage.calls += pairs.len();
            // The query is likelier after a passage that shares its word `refund`; the prior
            // context (no passage) sits in between.
            Ok(pairs
                .iter()
                .map(|(context, query)| {
                    match (
                        context.contains("Memory:"),
                        context.contains("refund") && query.contains("refund"),
                    ) {
                        (false, _) => -6.0,
                        (true, true) => -2.0,
                        (true, false) => -9.0,
                    }
                })
                .collect())
        }
        fn count_tokens(&self, text: &str) -> Result<usize> {
            Ok(text.split_whitespace().count())
        }
        fn usage(&self) -> Usage {
            self.usage
        }
    }

    #[test]
    fn yes_probability_ranks_passages_and_query_is_shared() {
        let mut judge = LlmJudge::new(Scripted {
            usage: Usage::default(),
        });
        let scores = judge
            .score(
                "how do refunds work?",
                &["refund within 30 days", "the weather is nice"],
            )
            .unwrap();
        assert!(scores[0] > 0.9 && scores[1] < 0.1, "{scores:?}");
        assert_eq!(judge.usage().calls, 2);
        assert!(judge.score("q", &[]).unwrap().is_empty());
    }

    #[test]
    fn run_success_is_asked_once_per_log_after_a_shared_instruction() {
        struct Runs(Usage);
        impl Generator for Runs {
            fn model_id(&self) -> &str {
                "runs"
            }
            fn chat_prompt(&self, messages: &[ChatMessage]) -> String {
                messages
                    .iter()
                    .map(|m| format!("[{}] {}\n", m.role, m.content))
                    .collect()
            }
            fn generate(&mut self, _: &[ChatMessage], _: &GenerateParams) -> Result<Generation> {
                unreachable!("the judge only scores")
            }
            fn next_token_logprobs(
                &mut self,
                prefix: &str,
                suffixes: &[String],
                options: &[&str],
            ) -> Result<Vec<Vec<f32>>> {
                assert!(prefix.contains("[system] You review the log"), "{prefix}");
                assert!(prefix.ends_with("Log of the run:\n"), "{prefix}");
                self.0.calls += suffixes.len();
                Ok(suffixes
                    .iter()
                    .map(|s| {
                        assert!(s.contains("Did the agent do what the user asked"), "{s}");
                        // The content-free log: a lean to no (P(yes) = 0.2); a run that
                        // says it refunded: 0.5; another: 0.1.
                        let p: f32 = if s.starts_with("N/A") {
                            0.2
                        } else if s.contains("refunded") {
                            0.5
                        } else {
                            0.1
                        };
                        options
                            .iter()
                            .map(|o| {
                                if o.to_lowercase().contains("yes") {
                                    p.ln()
                                } else {
                                    (1.0 - p).ln()
                                }
                            })
                            .collect()
                    })
                    .collect())
            }
            fn count_tokens(&self, text: &str) -> Result<usize> {
                Ok(text.split_whitespace().count())
            }
            fn usage(&self) -> Usage {
                self.0
            }
        }
        let mut judge = LlmJudge::new(Runs(Usage::default()));
        let p = judge
            .run_succeeded(&[
                "user: refund me\nagent: refunded".into(),
                "user: refund me\nagent: error".into(),
            ])
            .unwrap();
        // Calibrated against the content-free log's 0.2: 0.5 -> 0.8, and 0.1 -> 0.31.
        assert!((p[0] - 0.8).abs() < 1e-4, "{p:?}");
        assert!(
            (p[1] - 0.1 * 0.8 / (0.1 * 0.8 + 0.9 * 0.2)).abs() < 1e-4,
            "{p:?}"
        );
        assert_eq!(
            judge.usage().calls,
            3,
            "the content-free log once, then each run"
        );
        judge.run_succeeded(&["agent: refunded".into()]).unwrap();
        assert_eq!(judge.usage().calls, 4, "the prior is asked once");
        assert!(judge.run_succeeded(&[]).unwrap().is_empty());
    }

    #[test]
    fn query_likelihood_scores_the_lift_over_the_query_alone() {
        let mut judge = QlJudge::new(Scripted {
            usage: Usage::default(),
        });
        let pmi = judge
            .pmi(
                "how do refunds work?",
                &["refund within 30 days", "the weather is nice"],
            )
            .unwrap();
        // (-2 - -6) / 4 tokens and (-9 - -6) / 4.
        assert_eq!(pmi, vec![1.0, -0.75]);
        let scores = judge
            .score(
                "how do refunds work?",
                &["refund within 30 days", "the weather is nice"],
            )
            .unwrap();
        assert!(scores[0] > 0.5 && scores[1] < 0.5, "{scores:?}");
        // Two passages and the prior in one call.
        assert_eq!(judge.usage().calls, 6);
        assert!(judge.score("q", &[]).unwrap().is_empty());
    }

    #[test]
    fn log_sum_exp_is_stable() {
        assert!((log_sum_exp(&[0.0, 0.0]) - 2f32.ln()).abs() < 1e-6);
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY]), f32::NEG_INFINITY);
        assert!((log_sum_exp(&[-1000.0, -1000.0]) - (-1000.0 + 2f32.ln())).abs() < 1e-3);
    }
}
