//! Sentence-transformers BERT-family embedders (all-MiniLM-L6-v2 and kin) on candle.
//!
//! Loads `config.json` + `model.safetensors` + `tokenizer.json`, the pooling mode from
//! `1_Pooling/config.json`, the maximum sequence length from `sentence_bert_config.json` and
//! whether to L2-normalise from `modules.json`, as the sentence-transformers library does.
//! The tokenizer's own fixed padding/truncation is replaced: texts are truncated at the model's
//! max length and padded to a *bucket* length that depends on their own token count only (the
//! next multiple of [`PAD_BUCKET`]), and a batch holds texts of one bucket. A text's vector is
//! therefore a function of the text alone, bit for bit, whichever texts share its batch: the
//! matrix shapes it goes through (sequence length, and so every reduction's length and order)
//! never depend on its batch-mates. On the CPU the rows of a batch are computed independently
//! (the matrix-product kernels split work over rows and columns, never over the reduced
//! dimension), so the batch's row count does not matter; on a GPU, whose libraries may pick an
//! algorithm by shape, every batch is padded to the full batch size with copies of its last
//! text. This is what makes a sharded embed stage give the same vectors as an unsharded one.
//!
//! On the CPU the default forward is [`BertBackend::Native`] (`bert_cpu.rs`): texts are packed
//! without padding, so buckets do not apply, and a text's vector is again a function of the text
//! alone. [`BertBackend::Candle`] keeps candle's `BertModel` (any device).

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use std::path::Path;
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::bert_cpu::{CpuBert, Isa, KernelChoice};
use crate::embedder::{normalize, Embedder};
use crate::error::IoContext;
use crate::{Error, Result};

/// Padded sequence lengths are multiples of this (capped at the model's max length).
pub const PAD_BUCKET: usize = 16;

/// The padded length of a text of `tokens` tokens: its own length rounded up to the next
/// multiple of [`PAD_BUCKET`], at most `max_len`.
pub fn bucket_len(tokens: usize, max_len: usize) -> usize {
    tokens
        .max(1)
        .div_ceil(PAD_BUCKET)
        .saturating_mul(PAD_BUCKET)
        .min(max_len.max(tokens))
}

/// How token vectors become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Mean of the non-padding token vectors.
    Mean,
    /// The first (`[CLS]`) token vector.
    Cls,
}

/// Which forward pass runs the encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BertBackend {
    /// fluxmem's own CPU forward: packed texts without padding, fused projections, a vectorised
    /// GELU, and fluxmem's matrix kernel: AVX-512 where the CPU has AVX-512F, else AVX2 with
    /// FMA, else the `gemm` crate's (CPU only; the default there).
    Native,
    /// The native forward with the AVX2 kernel even where the CPU has AVX-512 (what CPUs
    /// without AVX-512 run; selectable so that tests and benchmarks compare the two kernels on
    /// one machine). Loading fails on a CPU without AVX2 and FMA.
    NativeAvx2,
    /// The native forward with the `gemm` crate's matrix kernels only (what CPUs without AVX2
    /// run; kept selectable for tests and benchmarks).
    NativePortable,
    /// candle-transformers' `BertModel` on padded buckets (any device; the default on a GPU).
    Candle,
}

impl BertBackend {
    /// The default forward on `device`: native on the CPU, candle elsewhere.
    pub fn for_device(device: &Device) -> BertBackend {
        if device.is_cpu() {
            BertBackend::Native
        } else {
            BertBackend::Candle
        }
    }
}

enum Encoder {
    Native(CpuBert),
    Candle(BertModel),
}

/// A BERT sentence embedder.
pub struct SentenceEmbedder {
    model: Encoder,
    backend: BertBackend,
    tokenizer: Tokenizer,
    /// The same tokenizer without truncation, for counting tokens.
    counter: Tokenizer,
    device: Device,
    model_id: String,
    dim: usize,
    max_len: usize,
    pooling: Pooling,
    normalize: bool,
    batch_size: usize,
    workers: usize,
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).at(path)?;
    serde_json::from_str(&text).map_err(|e| Error::Format {
        path: path.into(),
        reason: e.to_string(),
    })
}

impl SentenceEmbedder {
    /// Loads the checkpoint in `dir` on `device`; `model_id` is recorded with every vector. The
    /// CPU runs [`BertBackend::Native`], other devices [`BertBackend::Candle`].
    pub fn load(dir: &Path, model_id: &str, device: &Device) -> Result<SentenceEmbedder> {
        Self::load_with(dir, model_id, device, BertBackend::for_device(device))
    }

    /// [`SentenceEmbedder::load`] with the forward pass chosen; `Native` needs the CPU.
    pub fn load_with(
        dir: &Path,
        model_id: &str,
        device: &Device,
        backend: BertBackend,
    ) -> Result<SentenceEmbedder> {
        let config_path = dir.join("config.json");
        let config: Config =
            serde_json::from_value(read_json(&config_path)?).map_err(|e| Error::Format {
                path: config_path.clone(),
                reason: e.to_string(),
            })?;
        let pooling_path = dir.join("1_Pooling/config.json");
        let pooling = if pooling_path.exists() {
            let value = read_json(&pooling_path)?;
            if value["pooling_mode_mean_tokens"].as_bool() == Some(true) {
                Pooling::Mean
            } else if value["pooling_mode_cls_token"].as_bool() == Some(true) {
                Pooling::Cls
            } else {
                return Err(Error::Format {
                    path: pooling_path,
                    reason: "only mean and CLS pooling are supported".into(),
                });
            }
        } else {
            Pooling::Mean
        };
        let st_config = dir.join("sentence_bert_config.json");
        let max_len = if st_config.exists() {
            read_json(&st_config)?["max_seq_length"].as_u64()
        } else {
            None
        }
        .map(|n| n as usize)
        .unwrap_or(config.max_position_embeddings)
        .min(config.max_position_embeddings);
        let modules = dir.join("modules.json");
        let normalize = modules.exists() && read_json(&modules)?.to_string().contains("Normalize");
        let tokenizer_path = dir.join("tokenizer.json");
        let mut tokenizer = Tokenizer::from_file(&tokenizer_path).map_err(|e| Error::Format {
            path: tokenizer_path.clone(),
            reason: e.to_string(),
        })?;
        tokenizer.with_padding(None);
        let mut counter = tokenizer.clone();
        counter
            .with_truncation(None)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_len,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let weights = dir.join("model.safetensors");
        let model = match backend {
            BertBackend::Native | BertBackend::NativeAvx2 | BertBackend::NativePortable
                if !device.is_cpu() =>
            {
                return Err(Error::Format {
                    path: weights,
                    reason: "the native BERT forward runs on the CPU only".into(),
                })
            }
            BertBackend::Native => {
                Encoder::Native(CpuBert::load(&weights, &config, KernelChoice::Best)?)
            }
            BertBackend::NativeAvx2 => {
                Encoder::Native(CpuBert::load(&weights, &config, KernelChoice::Avx2)?)
            }
            BertBackend::NativePortable => {
                Encoder::Native(CpuBert::load(&weights, &config, KernelChoice::Gemm)?)
            }
            BertBackend::Candle => {
                // Safety: the file is memory-mapped read-only; the cache is not modified while in use.
                let vb = unsafe {
                    VarBuilder::from_mmaped_safetensors(&[&weights], DType::F32, device)?
                };
                Encoder::Candle(BertModel::load(vb, &config)?)
            }
        };
        Ok(SentenceEmbedder {
            model,
            backend,
            tokenizer,
            counter,
            device: device.clone(),
            model_id: model_id.to_string(),
            dim: config.hidden_size,
            max_len,
            pooling,
            normalize,
            batch_size: 32,
            workers: 1,
        })
    }

    /// Sets how many texts go through the model at once (default 32).
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// Runs whole batches on `workers` threads at once (CPU only). Each worker should then
    /// use one thread for its matrix products: set `RAYON_NUM_THREADS=1` (as
    /// `benches/embed_vs_python.py` does); otherwise the workers fight over the cores.
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = if self.device.is_cpu() {
            workers.max(1)
        } else {
            1
        };
        self
    }

    /// The forward pass in use (as asked for at load).
    pub fn backend(&self) -> BertBackend {
        self.backend
    }

    /// The matrix kernel the linear layers run: `avx512` or `avx2` (fluxmem's, native forward),
    /// `gemm` (the gemm crate's, native forward on a CPU without AVX2, or `NativePortable`) or
    /// `candle`.
    pub fn kernel(&self) -> &'static str {
        match &self.model {
            Encoder::Native(model) => match model.isa() {
                Some(Isa::Avx512) => "avx512",
                Some(Isa::Avx2) => "avx2",
                None => "gemm",
            },
            Encoder::Candle(_) => "candle",
        }
    }

    /// Maximum tokens per text; longer texts are truncated.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Token ids of every text (truncated), in order.
    pub fn tokenize(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(encodings
            .into_iter()
            .map(|e| e.get_ids().to_vec())
            .collect())
    }

    /// Embeds one batch of tokenized texts with the native forward: packed, no padding.
    fn embed_packed(&self, model: &CpuBert, batch: &[&Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let texts: Vec<&[u32]> = batch.iter().map(|t| t.as_slice()).collect();
        let hidden = model.forward(&texts)?;
        let mut start = 0;
        let mut vectors = Vec::with_capacity(texts.len());
        for tokens in &texts {
            let rows = &hidden[start * self.dim..(start + tokens.len()) * self.dim];
            let mut vector = match self.pooling {
                Pooling::Cls => rows[..self.dim].to_vec(),
                Pooling::Mean => {
                    let mut sum = vec![0f32; self.dim];
                    for row in rows.chunks_exact(self.dim) {
                        sum.iter_mut().zip(row).for_each(|(s, v)| *s += v);
                    }
                    let n = tokens.len() as f32;
                    sum.iter_mut().for_each(|s| *s /= n);
                    sum
                }
            };
            if self.normalize {
                normalize(&mut vector);
            }
            vectors.push(vector);
            start += tokens.len();
        }
        Ok(vectors)
    }

    /// Embeds one batch of tokenized texts of one bucket, padded to `padded` tokens (and, on
    /// a GPU, to `batch_size` rows).
    fn embed_batch(
        &self,
        model: &BertModel,
        batch: &[&Vec<u32>],
        padded: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let longest = padded.max(1);
        let real_rows = batch.len();
        let mut rows: Vec<&Vec<u32>> = batch.to_vec();
        if !self.device.is_cpu() {
            if let Some(&last) = batch.last() {
                rows.resize(self.batch_size.max(real_rows), last);
            }
        }
        let batch = &rows[..];
        let mut ids = Vec::with_capacity(batch.len() * longest);
        let mut mask = Vec::with_capacity(batch.len() * longest);
        for tokens in batch {
            ids.extend(tokens.iter().copied());
            ids.extend(std::iter::repeat_n(0u32, longest - tokens.len()));
            mask.extend(std::iter::repeat_n(1u32, tokens.len()));
            mask.extend(std::iter::repeat_n(0u32, longest - tokens.len()));
        }
        let shape = (batch.len(), longest);
        let ids = Tensor::from_vec(ids, shape, &self.device)?;
        let mask = Tensor::from_vec(mask, shape, &self.device)?;
        let token_types = ids.zeros_like()?;
        let hidden = model.forward(&ids, &token_types, Some(&mask))?;
        let pooled = match self.pooling {
            Pooling::Cls => hidden.narrow(1, 0, 1)?.squeeze(1)?,
            Pooling::Mean => {
                let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
                let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
                let counts = mask.sum(1)?.clamp(1e-9f32, f32::MAX)?;
                summed.broadcast_div(&counts)?
            }
        };
        let mut vectors: Vec<Vec<f32>> = pooled.to_dtype(DType::F32)?.to_vec2()?;
        vectors.truncate(real_rows);
        if self.normalize {
            vectors.iter_mut().for_each(|v| normalize(v));
        }
        Ok(vectors)
    }
}

impl Embedder for SentenceEmbedder {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let tokenized = self.tokenize(texts)?;
        let native = matches!(self.model, Encoder::Native(_));
        // The native forward packs texts without padding: one "bucket" for all, longest first.
        let bucket = |i: usize| {
            if native {
                0
            } else {
                bucket_len(tokenized[i].len(), self.max_len)
            }
        };
        // Longest bucket first; a batch never spans two buckets (see the module docs).
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| {
            (
                std::cmp::Reverse(bucket(i)),
                std::cmp::Reverse(tokenized[i].len()),
                i,
            )
        });
        let mut batches: Vec<Vec<usize>> = Vec::new();
        for group in order.chunk_by(|&a, &b| bucket(a) == bucket(b)) {
            batches.extend(group.chunks(self.batch_size).map(<[usize]>::to_vec));
        }
        let run = |batch: &Vec<usize>| -> Result<Vec<Vec<f32>>> {
            let tokens: Vec<&Vec<u32>> = batch.iter().map(|&i| &tokenized[i]).collect();
            match &self.model {
                Encoder::Native(model) => self.embed_packed(model, &tokens),
                Encoder::Candle(model) => self.embed_batch(model, &tokens, bucket(batch[0])),
            }
        };
        let results: Vec<Result<Vec<Vec<f32>>>> = if self.workers > 1 && batches.len() > 1 {
            let workers = self.workers.min(batches.len());
            #[allow(clippy::type_complexity)] // each worker's (batch index, vectors) results
            let mut per_worker: Vec<Vec<(usize, Result<Vec<Vec<f32>>>)>> =
                std::thread::scope(|scope| {
                    let handles: Vec<_> = (0..workers)
                        .map(|worker| {
                            let batches = &batches;
                            let run = &run;
                            scope.spawn(move || {
                                (worker..batches.len())
                                    .step_by(workers)
                                    .map(|b| (b, run(&batches[b])))
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("embedding worker panicked"))
                        .collect()
                });
            let mut flat: Vec<(usize, Result<Vec<Vec<f32>>>)> =
                per_worker.drain(..).flatten().collect();
            flat.sort_by_key(|(b, _)| *b);
            flat.into_iter().map(|(_, r)| r).collect()
        } else {
            batches.iter().map(run).collect()
        };
        let mut out = vec![Vec::new(); texts.len()];
        for (batch, vectors) in batches.iter().zip(results) {
            for (&index, vector) in batch.iter().zip(vectors?) {
                out[index] = vector;
            }
        }
        Ok(out)
    }

    fn count_tokens(&self, text: &str) -> Result<usize> {
        let encoding = self
            .counter
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().len())
    }
}
