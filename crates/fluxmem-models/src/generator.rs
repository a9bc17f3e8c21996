//! The `Generator` trait: chat generation and next-token scoring by a local language model.

use crate::Result;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role`.
    pub fn new(role: &str, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Sampling settings. `temperature == 0` is greedy decoding; otherwise sampling is seeded.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Maximum new tokens.
    pub max_tokens: usize,
    /// Sampling temperature (0: greedy).
    pub temperature: f64,
    /// Nucleus sampling threshold.
    pub top_p: Option<f64>,
    /// RNG seed.
    pub seed: u64,
    /// Extra stop strings (the template's end-of-turn token always stops).
    pub stop: Vec<String>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            temperature: 0.0,
            top_p: None,
            seed: 42,
            stop: Vec::new(),
        }
    }
}

/// The result of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated text (without the stop token / string).
    pub text: String,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Why generation ended: `stop` (end of turn or stop string) or `length`.
    pub finish: &'static str,
}

/// Token counts of scoring calls, for cost reporting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens run through the model.
    pub prompt_tokens: usize,
    /// Prompt tokens served from a shared-prefix cache instead.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Calls.
    pub calls: usize,
}

/// A local language model.
pub trait Generator: Send {
    /// Model name and revision.
    fn model_id(&self) -> &str;
    /// The model's chat template applied to `messages`, ending where the assistant's reply starts.
    fn chat_prompt(&self, messages: &[ChatMessage]) -> String;
    /// Generates the assistant's reply to `messages`.
    fn generate(&mut self, messages: &[ChatMessage], params: &GenerateParams)
        -> Result<Generation>;
    /// For each suffix: the log-probabilities of the next token being each of `options`'
    /// first tokens, after the prompt text `prefix + suffix`. The prefix is run once and its
    /// cache shared by all suffixes.
    fn next_token_logprobs(
        &mut self,
        prefix: &str,
        suffixes: &[String],
        options: &[&str],
    ) -> Result<Vec<Vec<f32>>>;
    /// Generates the replies to several conversations, in their order: the same replies as
    /// [`Generator::generate`] on each (each sequence samples with its own generator seeded by
    /// `params.seed`), up to float rounding, run together where the model can batch.
    fn generate_batch(
        &mut self,
        conversations: &[Vec<ChatMessage>],
        params: &GenerateParams,
    ) -> Result<Vec<Generation>> {
        conversations
            .iter()
            .map(|messages| self.generate(messages, params))
            .collect()
    }
    /// For each `(context, continuation)` pair: log P(continuation | context), the sum of the
    /// log-probabilities of the continuation's tokens after the context's (each text tokenized
    /// on its own, both non-empty). Query-likelihood scoring is built on it.
    fn continuation_logprobs(&mut self, _pairs: &[(String, String)]) -> Result<Vec<f32>> {
        Err(crate::Error::Unsupported {
            model: self.model_id().to_string(),
            reason: "no continuation scoring".into(),
        })
    }
    /// Number of tokens in `text`.
    fn count_tokens(&self, text: &str) -> Result<usize>;
    /// Token usage so far.
    fn usage(&self) -> Usage;
}
