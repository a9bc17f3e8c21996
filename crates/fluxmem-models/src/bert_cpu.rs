//! A CPU forward pass for BERT encoders, written for throughput on a few cores.
//!
//! candle's `BertModel` runs every operation as a separate tensor op with a fresh output buffer,
//! pads every text of a batch to one length, runs attention as batched matrix products over the
//! padding, and evaluates the exact GELU one scalar `erf` at a time. This forward does the same
//! arithmetic with:
//! - **no padding**: the texts of a batch are packed row after row (`rows = sum of lengths`), the
//!   linear layers run as one matrix product over all rows, and attention runs per text and head
//!   over that text's own tokens only (what a padding mask computes, without the padded work);
//! - **fused projections**: query, key and value are one `hidden x 3 hidden` product, biases are
//!   written into the output before the product accumulates into it, and the residual is added
//!   the same way;
//! - **a vectorised GELU**: `erf` by a rational approximation (max abs error below 1e-6, tested)
//!   that the compiler turns into SIMD code;
//! - **buffers allocated once per batch** and reused by every layer.
//!
//! A text's vector depends on the text alone, bit for bit: fluxmem's matrix kernels (AVX-512,
//! AVX2, `mod kernel`) compute each output as one FMA chain over the inner dimension in order,
//! the `gemm` crate's (the one candle uses, for attention and on CPUs without AVX2) split work
//! over rows and columns only and pick their blocking of the reduced dimension from that
//! dimension alone, and attention sees only the text's own rows.
//! `tests/golden.rs` checks both this and the match with sentence-transformers.

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::bert::{Config, HiddenAct};
use gemm::Parallelism;
use std::collections::HashMap;
use std::path::Path;

use crate::{Error, Result};

struct Norm {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

/// A linear layer `y = x W^T + b`, `W` stored row-major as `[out, in]`, or (when `packed`)
/// in fluxmem's kernel's panels.
struct Linear {
    weight: Vec<f32>,
    bias: Vec<f32>,
    inputs: usize,
    outputs: usize,
    /// The fluxmem kernel the packed weights are for (`None`: row-major, the gemm crate's).
    packed: Option<Isa>,
}

/// Which of fluxmem's matrix kernels runs the linear layers. Both compute every output as the
/// same fused multiply-add chain over the inner dimension in order, from the same packed
/// panels, so they give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F: 12 rows x 32 columns per block.
    Avx512,
    /// AVX2 with FMA: 6 rows x 16 columns per block.
    Avx2,
}

/// Which kernel a forward asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KernelChoice {
    /// The best fluxmem kernel this CPU runs (AVX-512, else AVX2 with FMA), else the gemm crate's.
    Best,
    /// The AVX2 kernel (an error on a CPU without AVX2 and FMA).
    Avx2,
    /// The gemm crate's kernels.
    Gemm,
}

impl Linear {
    /// Repacks the weights for fluxmem's kernel `isa` when the shape suits it.
    fn pack(mut self, isa: Option<Isa>) -> Linear {
        #[cfg(target_arch = "x86_64")]
        if isa.is_some() && self.outputs.is_multiple_of(kernel::NR) {
            self.weight = kernel::pack(&self.weight, self.outputs, self.inputs);
            self.packed = isa;
        }
        let _ = isa;
        self
    }
}

struct Layer {
    /// Query, key and value stacked: `[3 hidden, hidden]`.
    qkv: Linear,
    attention_out: Linear,
    attention_norm: Norm,
    up: Linear,
    down: Linear,
    out_norm: Norm,
}

/// The BERT encoder's weights as plain row-major `f32` arrays.
pub(crate) struct CpuBert {
    hidden: usize,
    heads: usize,
    eps: f32,
    act: HiddenAct,
    word: Vec<f32>,
    position: Vec<f32>,
    /// Row 0 of the token-type table (every token has type 0).
    token_type: Vec<f32>,
    max_positions: usize,
    embedding_norm: Norm,
    layers: Vec<Layer>,
    /// Activation buffers hold a multiple of this many rows (the AVX-512 kernel's row block);
    /// the extra rows are zeros and never read back.
    row_block: usize,
}

struct Weights {
    tensors: HashMap<String, Tensor>,
    prefix: String,
    path: std::path::PathBuf,
}

impl Weights {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let key = format!("{}{name}", self.prefix);
        let tensor = self.tensors.get(&key).ok_or_else(|| Error::Format {
            path: self.path.clone(),
            reason: format!("tensor {key} is missing"),
        })?;
        if tensor.dims() != shape {
            return Err(Error::Format {
                path: self.path.clone(),
                reason: format!(
                    "tensor {key} has shape {:?}, expected {shape:?}",
                    tensor.dims()
                ),
            });
        }
        Ok(tensor
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// A layer norm's scale and shift, named `weight`/`bias` or (older checkpoints) `gamma`/`beta`.
    fn norm(&self, name: &str, size: usize) -> Result<Norm> {
        let has = |suffix: &str| {
            self.tensors
                .contains_key(&format!("{}{name}.{suffix}", self.prefix))
        };
        let (w, b) = if !has("weight") && has("gamma") {
            ("gamma", "beta")
        } else {
            ("weight", "bias")
        };
        Ok(Norm {
            weight: self.get(&format!("{name}.{w}"), &[size])?,
            bias: self.get(&format!("{name}.{b}"), &[size])?,
        })
    }

    fn linear(&self, name: &str, inputs: usize, outputs: usize) -> Result<Linear> {
        Ok(Linear {
            weight: self.get(&format!("{name}.weight"), &[outputs, inputs])?,
            bias: self.get(&format!("{name}.bias"), &[outputs])?,
            inputs,
            outputs,
            packed: None,
        })
    }
}

impl CpuBert {
    /// Reads the encoder from a safetensors checkpoint (with or without a `bert.` or
    /// `<model_type>.` prefix, as candle's loader accepts).
    /// `choice`: which matrix kernel runs the linear layers.
    pub(crate) fn load(weights: &Path, config: &Config, choice: KernelChoice) -> Result<CpuBert> {
        let tensors = candle_core::safetensors::load(weights, &Device::Cpu)?;
        let prefixes = [
            "".to_string(),
            "bert.".to_string(),
            config
                .model_type
                .as_ref()
                .map(|t| format!("{t}."))
                .unwrap_or_default(),
        ];
        let prefix = prefixes
            .iter()
            .find(|p| tensors.contains_key(&format!("{p}embeddings.word_embeddings.weight")))
            .cloned()
            .ok_or_else(|| Error::Format {
                path: weights.into(),
                reason: "no embeddings.word_embeddings.weight tensor".into(),
            })?;
        let w = Weights {
            tensors,
            prefix,
            path: weights.into(),
        };
        let h = config.hidden_size;
        if config.num_attention_heads == 0 || !h.is_multiple_of(config.num_attention_heads) {
            return Err(Error::Format {
                path: weights.into(),
                reason: "hidden size is not a multiple of the head count".into(),
            });
        }
        let kernel = match choice {
            KernelChoice::Best if avx512_available() => Some(Isa::Avx512),
            KernelChoice::Best | KernelChoice::Avx2 if avx2_available() => Some(Isa::Avx2),
            KernelChoice::Avx2 => {
                return Err(Error::Format {
                    path: weights.into(),
                    reason: "the AVX2 kernel was asked for on a CPU without AVX2 and FMA".into(),
                })
            }
            KernelChoice::Best | KernelChoice::Gemm => None,
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            let q = w.linear(&format!("{p}.attention.self.query"), h, h)?;
            let k = w.linear(&format!("{p}.attention.self.key"), h, h)?;
            let v = w.linear(&format!("{p}.attention.self.value"), h, h)?;
            let qkv = Linear {
                weight: [q.weight, k.weight, v.weight].concat(),
                bias: [q.bias, k.bias, v.bias].concat(),
                inputs: h,
                outputs: 3 * h,
                packed: None,
            };
            layers.push(Layer {
                qkv: qkv.pack(kernel),
                attention_out: w
                    .linear(&format!("{p}.attention.output.dense"), h, h)?
                    .pack(kernel),
                attention_norm: w.norm(&format!("{p}.attention.output.LayerNorm"), h)?,
                up: w
                    .linear(
                        &format!("{p}.intermediate.dense"),
                        h,
                        config.intermediate_size,
                    )?
                    .pack(kernel),
                down: w
                    .linear(&format!("{p}.output.dense"), config.intermediate_size, h)?
                    .pack(kernel),
                out_norm: w.norm(&format!("{p}.output.LayerNorm"), h)?,
            });
        }
        let token_type = w.get(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, h],
        )?;
        Ok(CpuBert {
            hidden: h,
            heads: config.num_attention_heads,
            eps: config.layer_norm_eps as f32,
            act: config.hidden_act,
            word: w.get("embeddings.word_embeddings.weight", &[config.vocab_size, h])?,
            position: w.get(
                "embeddings.position_embeddings.weight",
                &[config.max_position_embeddings, h],
            )?,
            token_type: token_type[..h].to_vec(),
            max_positions: config.max_position_embeddings,
            embedding_norm: w.norm("embeddings.LayerNorm", h)?,
            row_block: if kernel.is_some() { MR } else { 1 },
            layers,
        })
    }

    /// The fluxmem kernel the linear layers run (`None`: the `gemm` crate's). Every linear
    /// layer of a BERT whose hidden and intermediate sizes are multiples of 32 (all the
    /// sentence-transformers checkpoints we ship) is packed the same way as the first QKV one.
    pub(crate) fn isa(&self) -> Option<Isa> {
        self.layers.first().and_then(|l| l.qkv.packed)
    }

    /// The last hidden state of every token of every text, packed: text `t`'s rows start at
    /// the sum of the lengths before it. Texts must be non-empty and within the position table.
    pub(crate) fn forward(&self, texts: &[&[u32]]) -> Result<Vec<f32>> {
        let h = self.hidden;
        let real_rows: usize = texts.iter().map(|t| t.len()).sum();
        let rows = real_rows.div_ceil(self.row_block) * self.row_block;
        // Each text's first row and length.
        let mut spans = Vec::with_capacity(texts.len());
        let mut x = vec![0f32; rows * h];
        let mut row = 0;
        for tokens in texts {
            if tokens.is_empty() || tokens.len() > self.max_positions {
                return Err(Error::Tokenizer(format!(
                    "a text of {} tokens does not fit the model",
                    tokens.len()
                )));
            }
            spans.push((row, tokens.len()));
            for (position, &id) in tokens.iter().enumerate() {
                let id = id as usize;
                let word = self.word.get(id * h..(id + 1) * h).ok_or_else(|| {
                    Error::Tokenizer(format!("token id {id} is outside the vocabulary"))
                })?;
                let out = &mut x[row * h..(row + 1) * h];
                let pos = &self.position[position * h..(position + 1) * h];
                for j in 0..h {
                    out[j] = word[j] + self.token_type[j] + pos[j];
                }
                row += 1;
            }
        }
        layer_norm(&mut x, h, &self.embedding_norm, self.eps);
        let intermediate = self.layers.first().map_or(0, |l| l.up.outputs);
        let mut qkv = vec![0f32; rows * 3 * h];
        let mut context = vec![0f32; rows * h];
        let mut inner = vec![0f32; rows * intermediate];
        let mut next = vec![0f32; rows * h];
        for layer in &self.layers {
            linear(&x, rows, &layer.qkv, None, &mut qkv);
            self.attention(&qkv, &spans, &mut context);
            // x = norm(context W^T + b + x), then x = norm(act(x U^T + c) D^T + e + x)
            linear(&context, rows, &layer.attention_out, Some(&x), &mut next);
            std::mem::swap(&mut x, &mut next);
            layer_norm(&mut x, h, &layer.attention_norm, self.eps);
            linear(&x, rows, &layer.up, None, &mut inner);
            activate(&mut inner, self.act);
            linear(&inner, rows, &layer.down, Some(&x), &mut next);
            std::mem::swap(&mut x, &mut next);
            layer_norm(&mut x, h, &layer.out_norm, self.eps);
        }
        x.truncate(real_rows * h);
        Ok(x)
    }

    /// Scaled dot-product attention of every (text, head) over the text's own tokens, written
    /// into `context` (`rows x hidden`, heads side by side as the output projection expects).
    fn attention(&self, qkv: &[f32], spans: &[(usize, usize)], context: &mut [f32]) {
        use rayon::prelude::*;
        let h = self.hidden;
        let d = h / self.heads;
        let scale = 1.0 / (d as f32).sqrt();
        let out = SendPtr(context.as_mut_ptr());
        let tasks: Vec<(usize, usize, usize)> = spans
            .iter()
            .flat_map(|&(start, len)| (0..self.heads).map(move |head| (start, len, head)))
            .collect();
        tasks
            .par_iter()
            .for_each_init(Vec::new, |scores: &mut Vec<f32>, &(start, len, head)| {
                scores.clear();
                scores.resize(len * len, 0.0);
                let q = qkv[start * 3 * h + head * d..].as_ptr();
                let k = qkv[start * 3 * h + h + head * d..].as_ptr();
                let v = qkv[start * 3 * h + 2 * h + head * d..].as_ptr();
                let stride = (3 * h) as isize;
                // Safety: q, k and v point at `len` rows of `stride` inside `qkv` (the slices above
                // start inside it and the span's rows are within `rows`); `scores` holds len x len.
                unsafe {
                    gemm::gemm(
                        len,
                        len,
                        d,
                        scores.as_mut_ptr(),
                        1,
                        len as isize,
                        false,
                        q,
                        1,
                        stride,
                        k,
                        stride,
                        1,
                        0.0,
                        scale,
                        false,
                        false,
                        false,
                        Parallelism::None,
                    );
                }
                for row in scores.chunks_exact_mut(len) {
                    softmax(row);
                }
                // Safety: every task writes the `d` columns of its own head in its own text's rows,
                // so no two tasks touch the same element; the rows are within `context`.
                unsafe {
                    let dst = out.get().add(start * h + head * d);
                    gemm::gemm(
                        len,
                        d,
                        len,
                        dst,
                        1,
                        h as isize,
                        false,
                        scores.as_ptr(),
                        1,
                        len as isize,
                        v,
                        1,
                        stride,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        Parallelism::None,
                    );
                }
            });
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// Safety: used only to hand disjoint regions of one buffer to the attention tasks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// `out = x W^T + b (+ residual)`, for `rows` rows.
fn linear(x: &[f32], rows: usize, layer: &Linear, residual: Option<&[f32]>, out: &mut [f32]) {
    let (k, n) = (layer.inputs, layer.outputs);
    assert!(
        x.len() >= rows * k && out.len() >= rows * n,
        "linear layer buffers too small"
    );
    par_chunks(&mut out[..rows * n], PAR_ROWS * n, |block, chunk| {
        for (r, row) in chunk.chunks_exact_mut(n).enumerate() {
            row.copy_from_slice(&layer.bias);
            if let Some(residual) = residual {
                let r = block * PAR_ROWS + r;
                for (o, a) in row.iter_mut().zip(&residual[r * n..(r + 1) * n]) {
                    *o += a;
                }
            }
        }
    });
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = layer.packed {
        kernel::linear(x, rows, k, &layer.weight, n, out, isa);
        return;
    }
    // Safety: the asserts above bound every access; W is `[n, k]` row-major, read as `k x n`.
    unsafe {
        gemm::gemm(
            rows,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            true,
            x.as_ptr(),
            1,
            k as isize,
            layer.weight.as_ptr(),
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        );
    }
}

const MR: usize = 12;

/// Whether this CPU can run the AVX-512 kernel.
fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU can run the AVX2 kernel.
fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// fluxmem's matrix-product kernels for `out += x W^T`, weights packed once at load into
/// 32-column panels (`k x 32`, row after row), the rows of a block of [`MR`] interleaved, each
/// row's input broadcast one element at a time:
/// - AVX-512F: 12 rows by 32 columns per block, 24 accumulator registers;
/// - AVX2 with FMA: 6 rows by 16 columns (half a panel), 12 of the 16 registers, each 12-row
///   block done as two halves of rows times two halves of the panel.
///
/// Every output element is one fused multiply-add chain over `k` in order, starting from what
/// `out` holds (bias and residual), in both: a row's result does not depend on the other rows,
/// the thread count, or which of the two kernels ran (the same bits on AVX2 and AVX-512 CPUs).
#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{Isa, MR};
    use std::arch::x86_64::*;

    pub(super) const NR: usize = 32;

    /// `w` (`[n, k]` row-major) as `n / 32` panels of `k x 32`.
    pub(super) fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * k];
        for p in 0..n / NR {
            for kk in 0..k {
                for j in 0..NR {
                    out[(p * k + kk) * NR + j] = w[(p * NR + j) * k + kk];
                }
            }
        }
        out
    }

    /// `out[rows, n] += x[rows, k] W^T`; `rows` is a multiple of [`MR`]; `isa` is one this CPU
    /// has (checked before packing).
    pub(super) fn linear(
        x: &[f32],
        rows: usize,
        k: usize,
        packed: &[f32],
        n: usize,
        out: &mut [f32],
        isa: Isa,
    ) {
        use rayon::prelude::*;
        assert!(
            rows.is_multiple_of(MR)
                && x.len() >= rows * k
                && out.len() >= rows * n
                && packed.len() == n * k
        );
        let run = |lhs: &mut Vec<f32>, (x, out): (&[f32], &mut [f32])| {
            // The block's rows interleaved (`k x MR`), so the kernel reads them as one stream.
            lhs.resize(MR * k, 0.0);
            for (r, row) in x.chunks_exact(k).enumerate() {
                for (kk, &v) in row.iter().enumerate() {
                    lhs[kk * MR + r] = v;
                }
            }
            // Safety: the CPU has the instructions of `isa` (checked before packing); `lhs`
            // holds k x MR values, `out` MR rows of `n`, `packed` n * k values.
            unsafe {
                match isa {
                    Isa::Avx512 => {
                        block_avx512(lhs.as_ptr(), k, packed.as_ptr(), n, out.as_mut_ptr())
                    }
                    Isa::Avx2 => block_avx2(lhs.as_ptr(), k, packed.as_ptr(), n, out.as_mut_ptr()),
                }
            }
        };
        let x = &x[..rows * k];
        let out = &mut out[..rows * n];
        if rayon::current_num_threads() > 1 {
            x.par_chunks(MR * k)
                .zip(out.par_chunks_mut(MR * n))
                .for_each_init(Vec::new, run);
        } else {
            let mut lhs = Vec::new();
            x.chunks(MR * k)
                .zip(out.chunks_mut(MR * n))
                .for_each(|pair| run(&mut lhs, pair));
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn block_avx512(lhs: *const f32, k: usize, packed: *const f32, n: usize, out: *mut f32) {
        for p in 0..n / NR {
            let b = packed.add(p * k * NR);
            let o = out.add(p * NR);
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[0] = _mm512_loadu_ps(o.add(r * n));
                acc[1] = _mm512_loadu_ps(o.add(r * n + 16));
            }
            for kk in 0..k {
                let b0 = _mm512_loadu_ps(b.add(kk * NR));
                let b1 = _mm512_loadu_ps(b.add(kk * NR + 16));
                let a = lhs.add(kk * MR);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*a.add(r));
                    acc[0] = _mm512_fmadd_ps(a, b0, acc[0]);
                    acc[1] = _mm512_fmadd_ps(a, b1, acc[1]);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.add(r * n), acc[0]);
                _mm512_storeu_ps(o.add(r * n + 16), acc[1]);
            }
        }
    }

    /// Rows of one AVX2 register block.
    const MR2: usize = MR / 2;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_avx2(lhs: *const f32, k: usize, packed: *const f32, n: usize, out: *mut f32) {
        for p in 0..n / NR {
            for half in 0..2 {
                // Columns `p * 32 + half * 16 ..+ 16`, read from the panel with stride 32.
                let b = packed.add(p * k * NR + half * 16);
                for rows in 0..2 {
                    let o = out.add(rows * MR2 * n + p * NR + half * 16);
                    let mut acc = [[_mm256_setzero_ps(); 2]; MR2];
                    for (r, acc) in acc.iter_mut().enumerate() {
                        acc[0] = _mm256_loadu_ps(o.add(r * n));
                        acc[1] = _mm256_loadu_ps(o.add(r * n + 8));
                    }
                    for kk in 0..k {
                        let b0 = _mm256_loadu_ps(b.add(kk * NR));
                        let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
                        let a = lhs.add(kk * MR + rows * MR2);
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let a = _mm256_broadcast_ss(&*a.add(r));
                            acc[0] = _mm256_fmadd_ps(a, b0, acc[0]);
                            acc[1] = _mm256_fmadd_ps(a, b1, acc[1]);
                        }
                    }
                    for (r, acc) in acc.iter().enumerate() {
                        _mm256_storeu_ps(o.add(r * n), acc[0]);
                        _mm256_storeu_ps(o.add(r * n + 8), acc[1]);
                    }
                }
            }
        }
    }
}

/// Runs `f` over chunks of `chunk` elements of `x`, on rayon's threads when there are several.
fn par_chunks(x: &mut [f32], chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    use rayon::prelude::*;
    if rayon::current_num_threads() > 1 && x.len() > chunk {
        x.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else {
        x.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// Rows handed to one thread by the element-wise passes.
const PAR_ROWS: usize = 64;

fn layer_norm(x: &mut [f32], width: usize, norm: &Norm, eps: f32) {
    par_chunks(x, PAR_ROWS * width, |_, rows| {
        layer_norm_rows(rows, width, norm, eps)
    });
}

fn layer_norm_rows(x: &mut [f32], width: usize, norm: &Norm, eps: f32) {
    for row in x.chunks_exact_mut(width) {
        let mean = row.iter().sum::<f32>() / width as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / width as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, w), b) in row.iter_mut().zip(&norm.weight).zip(&norm.bias) {
            *v = (*v - mean) * inv * w + b;
        }
    }
}

fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    row.iter_mut().for_each(|v| *v = exp(*v - max));
    let sum: f32 = row.iter().sum();
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

fn activate(x: &mut [f32], act: HiddenAct) {
    par_chunks(x, 16 * 1024, |_, chunk| activate_chunk(chunk, act));
}

fn activate_chunk(x: &mut [f32], act: HiddenAct) {
    match act {
        HiddenAct::Gelu => x
            .iter_mut()
            .for_each(|v| *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2))),
        HiddenAct::GeluApproximate => x.iter_mut().for_each(|v| {
            let c = (2.0 / std::f32::consts::PI).sqrt();
            *v = 0.5 * *v * (1.0 + (c * (*v + 0.044715 * *v * *v * *v)).tanh());
        }),
        HiddenAct::Relu => x.iter_mut().for_each(|v| *v = v.max(0.0)),
    }
}

/// `e^x` for `x <= 0` (softmax inputs) by Cephes' `expf`: `x = n ln 2 + r`, a degree-5
/// polynomial for `e^r`, `2^n` from the exponent bits; branch-free and without libm calls, so
/// a loop over it vectorises. Relative error below 1e-6 (tested); `x < -87` gives about 0.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 0.0);
    // Round x / ln 2 to the nearest integer with the 1.5 * 2^23 trick (no libm `round`).
    let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5e-1;
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `erf(x)` by the rational approximation Eigen and XLA use for `f32` (odd degree-13 numerator
/// over even degree-8 denominator on `[-4, 4]`, where `erf` rounds to +-1 outside); branch-free,
/// so a loop over it vectorises.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    // Plain multiply-adds: `mul_add` is a libm call unless the whole crate targets FMA.
    let mut p = x2 * -2.726_142_3e-10 + 2.770_681_4e-8;
    p = x2 * p + -2.101_024e-6;
    p = x2 * p + -5.692_506_4e-5;
    p = x2 * p + -7.349_906_3e-4;
    p = x2 * p + -2.954_6e-3;
    p = x2 * p + -1.609_603_3e-2;
    let mut q = x2 * -1.456_607_2e-5 + -2.133_740_6e-4;
    q = x2 * q + -1.682_827e-3;
    q = x2 * q + -7.373_329e-3;
    q = x2 * q + -1.426_474e-2;
    x * p / q
}

#[cfg(test)]
mod tests {
    use super::{erf, exp};

    #[test]
    fn exp_approximation_is_within_1e_6_relative_of_std() {
        let mut worst = 0f64;
        for i in 0..=87_000 {
            let x = -(i as f32) / 1000.0;
            let want = (x as f64).exp();
            worst = worst.max((exp(x) as f64 - want).abs() / want);
        }
        assert!(worst < 1e-6, "max relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1e-37);
    }

    /// erf by its Taylor series in f64 (converges fast on the tested range) as the reference.
    fn erf_reference(x: f64) -> f64 {
        let mut term = x;
        let mut sum = x;
        for n in 1..200 {
            term *= -x * x / n as f64;
            let next = term / (2 * n + 1) as f64;
            sum += next;
            if next.abs() < 1e-17 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn erf_approximation_is_within_1e_6_of_the_series() {
        let mut worst = 0f64;
        for i in -3000..=3000 {
            let x = i as f64 / 1000.0;
            let err = (erf(x as f32) as f64 - erf_reference(x)).abs();
            worst = worst.max(err);
        }
        assert!(worst < 1e-6, "max abs error {worst}");
        assert_eq!(erf(10.0), erf(4.0), "clamped outside [-4, 4]");
        assert!((erf(10.0) - 1.0).abs() < 1e-6 && (erf(-10.0) + 1.0).abs() < 1e-6);
    }
}
