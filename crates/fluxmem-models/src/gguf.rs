//! GGUF chat models on candle's quantized architectures: llama (SmolLM2, Llama, ...), qwen2
//! (Qwen2.5, Qwen2.5-Coder; a cloneable copy of candle's `quantized_qwen2`) and Gemma 3.
//!
//! Two weight paths: [`WeightPath::Quantized`] keeps the file's quantized matrices (small,
//! decode-friendly); [`WeightPath::Dequantized`] expands every matrix to f32 once at load time
//! and runs dense matrix products, which is much faster for prompt processing on CPUs where
//! candle has no SIMD kernel for the file's quantization (Q4_1 on x86). The judge is
//! prefill-bound, so it uses the dense path by default.

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_transformers::generation::LogitsProcessor;
use candle_transformers::models::quantized_gemma3;
use std::path::Path;
use tokenizers::Tokenizer;

use crate::decoder::{Cache, Decoder, Side};
use crate::error::IoContext;
use crate::generator::{ChatMessage, GenerateParams, Generation, Generator, Usage};
use crate::gguf_tokenizer::tokenizer_from_gguf;
use crate::{Error, Result};

/// How the weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPath {
    /// As stored in the file.
    Quantized,
    /// Expanded to f32 at load time.
    Dequantized,
    /// Re-quantized to Q8_0 at load time, except the formats that run as fast as stored: on a
    /// CPU with AVX-512 VNNI, Q4_K (fluxmem's kernel for decode steps, candle's tiles for
    /// prompts) and Q6_K (candle's tiles) stay as they are. The generators' default.
    Q8,
    /// Both: f32 for prompts and Q8_0 for decode steps (inputs of at most
    /// [`crate::decoder::SMALL_ROWS`] rows), for llama and qwen2 (Gemma 3 runs on f32). Holds
    /// both copies: about 5.1 bytes a parameter.
    Mixed,
    /// The faster for prompt processing (the judges' work): on a CPU with AVX-512 VNNI,
    /// [`WeightPath::Q8`] (fluxmem's tiled kernels prefill 1.5-2.5x faster than f32 on every
    /// model measured); elsewhere by the model's size, f32 for a file of at most
    /// [`PROMPT_F32_MAX_BYTES`] (0.5B parameters and smaller) and the weights as stored above
    /// (docs/models.md).
    Prompts,
}

impl std::str::FromStr for WeightPath {
    type Err = String;
    /// The names of the weight paths a user picks (`models.generator_weights`, `--weights`):
    /// `quantized`, `dequantized`, `q8` or `mixed`.
    fn from_str(value: &str) -> std::result::Result<Self, String> {
        match value {
            "quantized" => Ok(WeightPath::Quantized),
            "dequantized" => Ok(WeightPath::Dequantized),
            "q8" => Ok(WeightPath::Q8),
            "mixed" => Ok(WeightPath::Mixed),
            other => Err(format!(
                "`{other}`: expected quantized, dequantized, q8 or mixed"
            )),
        }
    }
}

/// The largest GGUF file [`WeightPath::Prompts`] expands to f32 (Qwen2.5-Coder-0.5B Q4_K_M is
/// 491 MB, the 1.5B 1,117 MB).
pub const PROMPT_F32_MAX_BYTES: u64 = 700 << 20;

impl WeightPath {
    /// The path a model file of `bytes` loads with: [`WeightPath::Prompts`] chooses by size,
    /// the others are themselves.
    pub fn resolve(self, bytes: u64) -> WeightPath {
        match self {
            WeightPath::Prompts if crate::native::available() => WeightPath::Q8,
            WeightPath::Prompts if bytes <= PROMPT_F32_MAX_BYTES => WeightPath::Dequantized,
            WeightPath::Prompts => WeightPath::Quantized,
            other => other,
        }
    }
}

enum Model {
    /// llama and qwen2: the batched decoder.
    Decoder(Decoder),
    Gemma3(quantized_gemma3::ModelWeights),
}

/// The state of one sequence: a decoder cache, or (Gemma 3, whose KV cache lives in its
/// weights) a copy of the model.
#[derive(Clone)]
enum State {
    Decoder(Cache),
    Gemma3(quantized_gemma3::ModelWeights),
}

impl Model {
    /// Whether a prompt can continue from a cloned KV cache with several tokens at once.
    /// candle 0.11's quantized Gemma 3 builds a mismatched mask (f32 vs u32) when
    /// `index_pos > 0` and more than one token is fed, so Gemma prompts run whole.
    fn continues_from_cache(&self) -> bool {
        matches!(self, Model::Decoder(_))
    }

    /// A fresh state for one sequence.
    fn start(&self) -> State {
        match self {
            Model::Decoder(decoder) => State::Decoder(decoder.cache(1)),
            Model::Gemma3(model) => State::Gemma3(model.clone()),
        }
    }
}

/// Chat formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Template {
    /// `<|im_start|>role\n...<|im_end|>` (SmolLM2, Qwen).
    ChatMl,
    /// `<start_of_turn>user\n...<end_of_turn>` (Gemma).
    Gemma,
}

/// A GGUF chat model.
pub struct GgufGenerator {
    model: Model,
    tokenizer: Tokenizer,
    device: Device,
    model_id: String,
    template: Template,
    stop_ids: Vec<u32>,
    context_length: usize,
    usage: Usage,
    batch_size: usize,
}

/// Sequences [`GgufGenerator`] runs together by default (see docs/models.md for the table).
pub const DEFAULT_BATCH: usize = 16;

impl GgufGenerator {
    /// Loads `dir/model.gguf` (and `dir/tokenizer.json` when present) on `device`.
    pub fn load(
        dir: &Path,
        model_id: &str,
        device: &Device,
        path: WeightPath,
    ) -> Result<GgufGenerator> {
        let file_path = dir.join("model.gguf");
        let mut file = std::fs::File::open(&file_path).at(&file_path)?;
        let path = path.resolve(file.metadata().at(&file_path)?.len());
        let content = gguf_file::Content::read(&mut file).map_err(|e| Error::Format {
            path: file_path.clone(),
            reason: format!("not a GGUF file: {e}"),
        })?;
        let architecture = metadata_string(&content, "general.architecture").unwrap_or_default();
        let tokenizer_json = dir.join("tokenizer.json");
        let tokenizer = if tokenizer_json.exists() {
            Tokenizer::from_file(&tokenizer_json).map_err(|e| Error::Format {
                path: tokenizer_json,
                reason: e.to_string(),
            })?
        } else {
            tokenizer_from_gguf(&content, &file_path)?
        };
        let mut context_length = content
            .metadata
            .get(&format!("{architecture}.context_length"))
            .and_then(|v| v.to_u32().ok())
            .unwrap_or(2048) as usize;
        if architecture == "qwen2" || architecture == "llama" {
            context_length = context_length.min(crate::decoder::MAX_POSITIONS);
        }
        // The decode-step copy of the mixed path, read before the file is handed on.
        let small =
            if path == WeightPath::Mixed && (architecture == "llama" || architecture == "qwen2") {
                let mut cursor = std::io::Cursor::new(requantized_gguf(
                    &content,
                    &mut file,
                    &file_path,
                    GgmlDType::Q8_0,
                )?);
                Some((gguf_file::Content::read(&mut cursor)?, cursor))
            } else {
                None
            };
        let (content, mut reader): (gguf_file::Content, Box<dyn ReadSeek>) = match path {
            WeightPath::Quantized => (content, Box::new(file)),
            WeightPath::Dequantized | WeightPath::Q8 | WeightPath::Mixed | WeightPath::Prompts => {
                let target = if path == WeightPath::Q8 {
                    GgmlDType::Q8_0
                } else {
                    GgmlDType::F32
                };
                let bytes = requantized_gguf(&content, &mut file, &file_path, target)?;
                let mut cursor = std::io::Cursor::new(bytes);
                let content = gguf_file::Content::read(&mut cursor)?;
                (content, Box::new(cursor))
            }
        };
        let model = match architecture.as_str() {
            "llama" | "qwen2" => {
                let decoder = Decoder::from_gguf(content, &mut reader, device)?;
                Model::Decoder(match small {
                    Some((content, mut cursor)) => {
                        decoder.with_small_inputs(content, &mut cursor, device)?
                    }
                    None => decoder,
                })
            }
            "gemma3" => Model::Gemma3(quantized_gemma3::ModelWeights::from_gguf(
                content,
                &mut reader,
                device,
            )?),
            other => {
                return Err(Error::Format {
                    path: file_path,
                    reason: format!(
                        "architecture `{other}` is not supported (llama, qwen2, gemma3)"
                    ),
                })
            }
        };
        let template = if architecture == "gemma3" {
            Template::Gemma
        } else {
            Template::ChatMl
        };
        let stop_tokens: &[&str] = match template {
            Template::ChatMl => &["<|im_end|>", "<|endoftext|>"],
            Template::Gemma => &["<end_of_turn>", "<eos>"],
        };
        let stop_ids = stop_tokens
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t))
            .collect();
        Ok(GgufGenerator {
            model,
            tokenizer,
            device: device.clone(),
            model_id: model_id.into(),
            template,
            stop_ids,
            context_length,
            usage: Usage::default(),
            batch_size: DEFAULT_BATCH,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Runs at most `batch_size` sequences together in [`Generator::generate_batch`],
    /// [`Generator::next_token_logprobs`] and [`Generator::continuation_logprobs`] (at least 1;
    /// 1 runs them one at a time).
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// Sequences run together.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The token that fills padding (never attended to: any id would do).
    fn pad_id(&self) -> u32 {
        self.stop_ids.first().copied().unwrap_or(0)
    }

    fn check_context(&self, positions: usize) -> Result<()> {
        if positions > self.context_length {
            return Err(Error::Tokenizer(format!(
                "prompt of {positions} tokens exceeds the model's context of {}",
                self.context_length
            )));
        }
        Ok(())
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Runs `tokens` of one sequence after what `state` holds (`position` tokens); returns
    /// the last position's logits.
    fn run(&self, state: &mut State, tokens: &[u32], position: usize) -> Result<Tensor> {
        self.check_context(position + tokens.len())?;
        let input = Tensor::new(tokens, &self.device)?.unsqueeze(0)?;
        let logits = match (&self.model, state) {
            (Model::Decoder(decoder), State::Decoder(cache)) => {
                decoder.forward(&input, cache, &[(0, tokens.len() - 1)])?
            }
            (Model::Gemma3(_), State::Gemma3(model)) => model.forward(&input, position)?,
            _ => unreachable!("a state always comes from its own model"),
        };
        Ok(logits.squeeze(0)?.to_dtype(candle_core::DType::F32)?)
    }

    /// [`Generator::generate_batch`] on the decoder: prompts sorted by length (less padding),
    /// `batch_size` at a time, each batch prefilled in one padded forward and decoded one token
    /// a step for all its unfinished sequences; a sequence that finishes leaves the batch.
    fn decode_batches(
        &self,
        decoder: &Decoder,
        prompts: &[Vec<u32>],
        params: &GenerateParams,
    ) -> Result<Vec<Generation>> {
        let order = by_length(prompts.len(), |i| prompts[i].len());
        let mut out: Vec<Option<Generation>> = vec![None; prompts.len()];
        let temperature = (params.temperature > 0.0).then_some(params.temperature);
        for chunk in order.chunks(self.batch_size) {
            let rows: Vec<Vec<u32>> = chunk.iter().map(|&i| prompts[i].clone()).collect();
            let width = rows.iter().map(Vec::len).max().unwrap_or(0);
            self.check_context(width)?;
            let mut cache = decoder.cache(rows.len());
            let mut logits = decoder.forward_padded(&rows, self.pad_id(), &mut cache)?;
            // Per sequence, as `generate` would run it alone: its own seeded sampler.
            let mut samplers: Vec<LogitsProcessor> = chunk
                .iter()
                .map(|_| LogitsProcessor::new(params.seed, temperature, params.top_p))
                .collect();
            let mut generated: Vec<Vec<u32>> = vec![Vec::new(); chunk.len()];
            let mut texts: Vec<String> = vec![String::new(); chunk.len()];
            let mut finish: Vec<&'static str> = vec!["length"; chunk.len()];
            // Batch row -> sequence of the chunk.
            let mut active: Vec<usize> = (0..chunk.len()).collect();
            while !active.is_empty() {
                let mut next_active = Vec::new();
                let mut next_tokens = Vec::new();
                for (row, &seq) in active.iter().enumerate() {
                    if generated[seq].len() >= params.max_tokens {
                        continue;
                    }
                    let next = samplers[seq]
                        .sample(&logits.get(row)?.to_dtype(candle_core::DType::F32)?)?;
                    if self.stop_ids.contains(&next) {
                        finish[seq] = "stop";
                        continue;
                    }
                    generated[seq].push(next);
                    let mut text = self
                        .tokenizer
                        .decode(&generated[seq], true)
                        .map_err(|e| Error::Tokenizer(e.to_string()))?;
                    if let Some(at) = params
                        .stop
                        .iter()
                        .filter_map(|s| text.find(s.as_str()))
                        .min()
                    {
                        text.truncate(at);
                        texts[seq] = text;
                        finish[seq] = "stop";
                        continue;
                    }
                    texts[seq] = text;
                    if generated[seq].len() < params.max_tokens {
                        next_active.push((row, seq));
                        next_tokens.push(next);
                    }
                }
                if next_active.is_empty() {
                    break;
                }
                self.check_context(cache.len() + 1)?;
                cache.keep(&next_active.iter().map(|&(row, _)| row).collect::<Vec<_>>())?;
                let input = Tensor::from_vec(next_tokens, (next_active.len(), 1), &self.device)?;
                let at: Vec<(usize, usize)> = (0..next_active.len()).map(|r| (r, 0)).collect();
                logits = decoder.forward(&input, &mut cache, &at)?;
                active = next_active.into_iter().map(|(_, seq)| seq).collect();
            }
            for (k, &i) in chunk.iter().enumerate() {
                out[i] = Some(Generation {
                    text: std::mem::take(&mut texts[k]),
                    prompt_tokens: prompts[i].len(),
                    generated_tokens: generated[k].len(),
                    finish: finish[k],
                });
            }
        }
        Ok(out
            .into_iter()
            .map(|g| g.expect("every prompt is in one chunk"))
            .collect())
    }

    /// [`Generator::continuation_logprobs`] on token ids: per pair, the continuation tokens'
    /// log-probabilities summed. The decoder runs `batch_size` pairs in one padded forward and
    /// reads the logits of the continuation's positions only; Gemma feeds the continuation one
    /// token at a time after the context.
    fn score_pairs(&mut self, pairs: &[(Vec<u32>, Vec<u32>)]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; pairs.len()];
        if let Model::Decoder(decoder) = &self.model {
            let order = by_length(pairs.len(), |i| pairs[i].0.len() + pairs[i].1.len());
            for chunk in order.chunks(self.batch_size) {
                let rows: Vec<Vec<u32>> = chunk
                    .iter()
                    .map(|&i| [pairs[i].0.as_slice(), pairs[i].1.as_slice()].concat())
                    .collect();
                let width = rows.iter().map(Vec::len).max().unwrap_or(0);
                self.check_context(width)?;
                // Right padding: a row's real tokens never see the pads after them.
                let mut at = Vec::new();
                let mut targets = Vec::new();
                for (row, &i) in chunk.iter().enumerate() {
                    let (context, continuation) = (&pairs[i].0, &pairs[i].1);
                    for (j, &token) in continuation.iter().enumerate() {
                        // The logits at the token before predict it.
                        at.push((row, context.len() + j - 1));
                        targets.push(token);
                    }
                }
                let mut cache = decoder.cache(rows.len());
                let input = decoder.padded(&rows, self.pad_id(), Side::Right)?;
                let log_probs =
                    crate::decoder::log_softmax_rows(&decoder.forward(&input, &mut cache, &at)?)?
                        .to_vec2::<f32>()?;
                let mut k = 0;
                for &i in chunk {
                    for _ in 0..pairs[i].1.len() {
                        out[i] += log_probs[k][targets[k] as usize];
                        k += 1;
                    }
                    self.usage.calls += 1;
                    self.usage.prompt_tokens += pairs[i].0.len() + pairs[i].1.len();
                }
            }
            return Ok(out);
        }
        for (i, (context, continuation)) in pairs.iter().enumerate() {
            let mut state = self.model.start();
            let mut logits = self.run(&mut state, context, 0)?;
            for (j, &token) in continuation.iter().enumerate() {
                out[i] += option_logprobs(&logits, &[token])?[0];
                if j + 1 < continuation.len() {
                    logits = self.run(&mut state, &[token], context.len() + j)?;
                }
            }
            self.usage.calls += 1;
            self.usage.prompt_tokens += context.len() + continuation.len();
        }
        Ok(out)
    }
}

/// Indices `0..n` in order of `len` (ties by index): rows of similar lengths batched together
/// pad less.
fn by_length(n: usize, len: impl Fn(usize) -> usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (len(i), i));
    order
}

/// Log-probabilities of `ids` under the next-token `logits`.
fn option_logprobs(logits: &Tensor, ids: &[u32]) -> Result<Vec<f32>> {
    let log_probs = candle_nn::ops::log_softmax(logits, 0)?.to_vec1::<f32>()?;
    Ok(ids.iter().map(|&id| log_probs[id as usize]).collect())
}

trait ReadSeek: std::io::Read + std::io::Seek {}
impl<T: std::io::Read + std::io::Seek> ReadSeek for T {}

fn metadata_string(content: &gguf_file::Content, key: &str) -> Option<String> {
    content
        .metadata
        .get(key)
        .and_then(|v| v.to_string().ok())
        .cloned()
}

/// The GGUF file re-encoded (in memory) with every quantized matrix converted to `target`
/// (f32: dense matmuls; Q8_0: fast quantized kernels). Tensors whose row length does not fit
/// the target's block size stay as they are.
fn requantized_gguf(
    content: &gguf_file::Content,
    file: &mut std::fs::File,
    path: &Path,
    target: GgmlDType,
) -> Result<Vec<u8>> {
    let mut tensors: Vec<(String, QTensor)> = Vec::with_capacity(content.tensor_infos.len());
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let tensor = content.tensor(file, name, &Device::Cpu)?;
        let tensor = match tensor.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => tensor,
            dtype if dtype == target => tensor,
            // Where fluxmem's Q4_K kernel and candle's AVX-512 VNNI tiles run, a Q4_K or Q6_K
            // matrix is as fast as stored as it is requantized, and requantizing it to Q8_0
            // would read more bytes a decode step, lose a little precision and take longer to
            // load (docs/models.md).
            GgmlDType::Q4K | GgmlDType::Q6K
                if target == GgmlDType::Q8_0 && crate::native::runs(GgmlDType::Q4K) =>
            {
                tensor
            }
            _ => {
                let row = tensor.shape().dims().last().copied().unwrap_or(0);
                if row % target.block_size() == 0 {
                    QTensor::quantize(&tensor.dequantize(&Device::Cpu)?, target)?
                } else {
                    tensor
                }
            }
        };
        tensors.push((name.clone(), tensor));
    }
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &metadata, &tensor_refs).map_err(|e| Error::Format {
        path: path.into(),
        reason: format!("re-encoding dequantized weights: {e}"),
    })?;
    Ok(out.into_inner())
}

impl Generator for GgufGenerator {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn chat_prompt(&self, messages: &[ChatMessage]) -> String {
        let mut prompt = String::new();
        match self.template {
            Template::ChatMl => {
                for message in messages {
                    prompt.push_str(&format!(
                        "<|im_start|>{}\n{}<|im_end|>\n",
                        message.role, message.content
                    ));
                }
                prompt.push_str("<|im_start|>assistant\n");
            }
            Template::Gemma => {
                // Gemma has no system role: the system text opens the first user turn.
                prompt.push_str("<bos>");
                let mut pending_system = String::new();
                for message in messages {
                    match message.role.as_str() {
                        "system" => pending_system = format!("{}\n\n", message.content),
                        role => {
                            let role = if role == "assistant" { "model" } else { "user" };
                            let text = format!(
                                "{}{}",
                                std::mem::take(&mut pending_system),
                                message.content
                            );
                            prompt
                                .push_str(&format!("<start_of_turn>{role}\n{text}<end_of_turn>\n"));
                        }
                    }
                }
                prompt.push_str("<start_of_turn>model\n");
            }
        }
        prompt
    }

    fn generate(
        &mut self,
        messages: &[ChatMessage],
        params: &GenerateParams,
    ) -> Result<Generation> {
        let prompt = self.encode(&self.chat_prompt(messages))?;
        let mut model = self.model.start();
        let temperature = (params.temperature > 0.0).then_some(params.temperature);
        let mut sampler = LogitsProcessor::new(params.seed, temperature, params.top_p);
        let mut logits = self.run(&mut model, &prompt, 0)?;
        let mut generated: Vec<u32> = Vec::new();
        let mut finish = "length";
        let mut text = String::new();
        while generated.len() < params.max_tokens {
            let next = sampler.sample(&logits)?;
            if self.stop_ids.contains(&next) {
                finish = "stop";
                break;
            }
            generated.push(next);
            text = self
                .tokenizer
                .decode(&generated, true)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            if let Some(at) = params
                .stop
                .iter()
                .filter_map(|s| text.find(s.as_str()))
                .min()
            {
                text.truncate(at);
                finish = "stop";
                break;
            }
            logits = self.run(&mut model, &[next], prompt.len() + generated.len() - 1)?;
        }
        self.usage.calls += 1;
        self.usage.prompt_tokens += prompt.len();
        self.usage.generated_tokens += generated.len();
        Ok(Generation {
            text,
            prompt_tokens: prompt.len(),
            generated_tokens: generated.len(),
            finish,
        })
    }

    fn next_token_logprobs(
        &mut self,
        prefix: &str,
        suffixes: &[String],
        options: &[&str],
    ) -> Result<Vec<Vec<f32>>> {
        let option_ids: Vec<u32> = options
            .iter()
            .map(|o| {
                self.encode(o)?
                    .first()
                    .copied()
                    .ok_or_else(|| Error::Tokenizer(format!("option `{o}` has no tokens")))
            })
            .collect::<Result<_>>()?;
        if !self.model.continues_from_cache() {
            let whole: Vec<String> = suffixes
                .iter()
                .map(|suffix| format!("{prefix}{suffix}"))
                .collect();
            let mut out = Vec::with_capacity(whole.len());
            for prompt in &whole {
                let ids = self.encode(prompt)?;
                let logits = self.run(&mut self.model.start(), &ids, 0)?;
                out.push(option_logprobs(&logits, &option_ids)?);
                self.usage.calls += 1;
                self.usage.prompt_tokens += ids.len();
            }
            return Ok(out);
        }
        let prefix_ids = self.encode(prefix)?;
        let mut base = self.model.start();
        let prefix_logits = if prefix_ids.is_empty() {
            None
        } else {
            Some(self.run(&mut base, &prefix_ids, 0)?)
        };
        self.usage.prompt_tokens += prefix_ids.len();
        let suffix_ids: Vec<Vec<u32>> = suffixes
            .iter()
            .map(|s| self.encode(s))
            .collect::<Result<_>>()?;
        if prefix_logits.is_none() && suffix_ids.iter().any(Vec::is_empty) {
            return Err(Error::Tokenizer(
                "nothing to score: empty prefix and suffix".into(),
            ));
        }
        let mut out = vec![Vec::new(); suffixes.len()];
        // Suffixes with tokens run `batch_size` at a time after the prefix's cache, forked once
        // per batch row, right-padded; an empty suffix takes the prefix's own logits.
        for i in (0..suffixes.len()).filter(|&i| suffix_ids[i].is_empty()) {
            out[i] = option_logprobs(prefix_logits.as_ref().expect("checked above"), &option_ids)?;
        }
        let decoder = match &self.model {
            Model::Decoder(decoder) if self.batch_size > 1 => Some(decoder),
            _ => None,
        };
        let order: Vec<usize> = by_length(suffixes.len(), |i| suffix_ids[i].len())
            .into_iter()
            .filter(|&i| !suffix_ids[i].is_empty())
            .collect();
        for chunk in order.chunks(if decoder.is_some() {
            self.batch_size
        } else {
            1
        }) {
            let logits: Vec<Tensor> = match (decoder, &base) {
                (Some(decoder), State::Decoder(cache)) => {
                    let rows: Vec<Vec<u32>> =
                        chunk.iter().map(|&i| suffix_ids[i].clone()).collect();
                    self.check_context(
                        prefix_ids.len() + rows.iter().map(Vec::len).max().unwrap_or(0),
                    )?;
                    let mut cache = cache.repeat_row(0, rows.len())?;
                    let at: Vec<(usize, usize)> = rows
                        .iter()
                        .enumerate()
                        .map(|(r, t)| (r, t.len() - 1))
                        .collect();
                    let input = decoder.padded(&rows, self.pad_id(), Side::Right)?;
                    let all = decoder
                        .forward(&input, &mut cache, &at)?
                        .to_dtype(candle_core::DType::F32)?;
                    (0..rows.len())
                        .map(|r| all.get(r))
                        .collect::<candle_core::Result<_>>()?
                }
                _ => vec![self.run(&mut base.clone(), &suffix_ids[chunk[0]], prefix_ids.len())?],
            };
            for (&i, logits) in chunk.iter().zip(&logits) {
                out[i] = option_logprobs(logits, &option_ids)?;
            }
        }
        for ids in &suffix_ids {
            self.usage.calls += 1;
            self.usage.prompt_tokens += ids.len();
            self.usage.cached_tokens += prefix_ids.len();
        }
        Ok(out)
    }

    fn generate_batch(
        &mut self,
        conversations: &[Vec<ChatMessage>],
        params: &GenerateParams,
    ) -> Result<Vec<Generation>> {
        let Model::Decoder(decoder) = &self.model else {
            return conversations
                .iter()
                .map(|messages| self.generate(messages, params))
                .collect();
        };
        if self.batch_size <= 1 {
            return conversations
                .iter()
                .map(|messages| self.generate(messages, params))
                .collect();
        }
        let prompts: Vec<Vec<u32>> = conversations
            .iter()
            .map(|m| self.encode(&self.chat_prompt(m)))
            .collect::<Result<_>>()?;
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(Error::Tokenizer(format!(
                "conversation {i} has an empty prompt"
            )));
        }
        let generations = self.decode_batches(decoder, &prompts, params)?;
        for generation in &generations {
            self.usage.calls += 1;
            self.usage.prompt_tokens += generation.prompt_tokens;
            self.usage.generated_tokens += generation.generated_tokens;
        }
        Ok(generations)
    }

    fn continuation_logprobs(&mut self, pairs: &[(String, String)]) -> Result<Vec<f32>> {
        let mut ids = Vec::with_capacity(pairs.len());
        for (i, (context, continuation)) in pairs.iter().enumerate() {
            let (context, continuation) = (self.encode(context)?, self.encode(continuation)?);
            if context.is_empty() || continuation.is_empty() {
                return Err(Error::Tokenizer(format!(
                    "pair {i}: the context and the continuation must both have tokens"
                )));
            }
            ids.push((context, continuation));
        }
        self.score_pairs(&ids)
    }

    fn count_tokens(&self, text: &str) -> Result<usize> {
        Ok(self.encode(text)?.len())
    }

    fn usage(&self) -> Usage {
        self.usage
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Prompts` expands the small models to f32 and keeps the larger ones as stored (the 135M
    /// and 0.5B files against the 1.5B's, by their sizes as shipped).
    #[test]
    fn prompt_weights_follow_the_model_size() {
        let sizes = [
            (98_362_432, "SmolLM2-135M Q4_1"),
            (491_400_064, "Qwen2.5-Coder-0.5B Q4_K_M"),
            (1_117_320_768, "Qwen2.5-Coder-1.5B Q4_K_M"),
        ];
        if crate::native::available() {
            for (bytes, file) in sizes {
                assert_eq!(
                    WeightPath::Prompts.resolve(bytes),
                    WeightPath::Q8,
                    "{file}: fluxmem's kernels"
                );
            }
        } else {
            assert_eq!(
                WeightPath::Prompts.resolve(sizes[0].0),
                WeightPath::Dequantized,
                "{}",
                sizes[0].1
            );
            assert_eq!(
                WeightPath::Prompts.resolve(sizes[1].0),
                WeightPath::Dequantized,
                "{}",
                sizes[1].1
            );
            assert_eq!(
                WeightPath::Prompts.resolve(sizes[2].0),
                WeightPath::Quantized,
                "{}",
                sizes[2].1
            );
        }
        for path in [
            WeightPath::Quantized,
            WeightPath::Dequantized,
            WeightPath::Q8,
            WeightPath::Mixed,
        ] {
            assert_eq!(
                path.resolve(1_117_320_768),
                path,
                "the others are themselves"
            );
        }
    }
}
