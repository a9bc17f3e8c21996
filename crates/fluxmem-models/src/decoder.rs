//! One batched decoder for the llama (SmolLM2, Llama) and qwen2 (Qwen2, Qwen2.5, Qwen2.5-Coder)
//! architectures on GGUF weights.
//!
//! Adapted from candle-transformers 0.11's `quantized_llama` and `quantized_qwen2`
//! (MIT/Apache-2.0), which run one sequence at a time with the KV cache inside the weights.
//! Here the weights are shared and read-only, and the state of a batch lives in a [`Cache`]:
//!
//! - **A batch of sequences.** Each row of the batch is one sequence with its own KV cache row.
//!   Prompts of different lengths are left-padded; a row's padding is masked out of attention
//!   as keys, and its real tokens take the positions they would have alone (per-row rotary
//!   positions), so a sequence's logits do not depend on its batch-mates beyond float rounding.
//! - **Forks and drops.** A [`Cache`] is a value (its tensors are reference-counted): a shared
//!   prompt prefix runs once and is cloned for each continuation; rows that finished decoding
//!   leave the batch ([`Cache::keep`]).
//! - **Any positions' logits.** [`Decoder::forward`] returns the logits of the positions asked
//!   for (the last by default), not of every position: the output projection of a 150k-token
//!   vocabulary over every position of a batch would be gigabytes.
//!
//! The rotary tables cover at most [`MAX_POSITIONS`] positions instead of the 32k context the
//! metadata may declare (fluxmem's prompts are a few thousand tokens).

use candle_core::quantized::{gguf_file, QMatMul};
use std::sync::Arc;

use crate::native::Native;
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::Embedding;
use candle_transformers::quantized_nn::RmsNorm;
use candle_transformers::utils::repeat_kv;

/// Positions the rotary tables cover (the model's usable context here).
pub const MAX_POSITIONS: usize = 8192;

/// Inputs of at most this many rows (tokens of all the batch's sequences together: a decode
/// step of a batch of up to 8) go through a matrix's second copy when it has one
/// ([`Decoder::with_small_inputs`]).
pub const SMALL_ROWS: usize = 8;

/// A weight matrix, held once, or twice: one copy for prompts (many rows: matrix products)
/// and one for decode steps (a few rows: matrix-vector products), each in the form that is
/// faster for its shape (f32 and Q8_0 on the CPU, docs/models.md); and a copy repacked for
/// fluxmem's own kernels where they beat candle's ([`crate::native`]).
#[derive(Debug, Clone)]
struct Lin {
    /// The matrix as loaded; `None` when its native copy takes every input.
    main: Option<QMatMul>,
    /// The copy for inputs of at most [`SMALL_ROWS`] rows.
    small: Option<QMatMul>,
    /// The copy repacked for fluxmem's kernels, of the matrix itself or of `small`, and the
    /// most input rows it takes.
    native: Option<(Arc<Native>, usize)>,
}

impl Lin {
    fn new(main: QMatMul) -> Result<Lin> {
        Ok(match Native::of(&main)? {
            Some(native) => Lin {
                main: None,
                small: None,
                native: Some((native, usize::MAX)),
            },
            None => Lin {
                main: Some(main),
                small: None,
                native: None,
            },
        })
    }

    /// Sets the copy for small inputs: repacked for the kernels when they run it (then not held
    /// twice), as given otherwise.
    fn set_small(&mut self, small: QMatMul) -> Result<()> {
        if self.main.is_none() {
            // The kernel already runs every input on the matrix itself.
            return Ok(());
        }
        match Native::of(&small)? {
            Some(native) => {
                self.native = Some((native, SMALL_ROWS));
                self.small = None;
            }
            None => self.small = Some(small),
        }
        Ok(())
    }
}

impl Module for Lin {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let rows = xs.elem_count() / xs.dim(D::Minus1)?.max(1);
        match (&self.main, &self.native, &self.small) {
            (_, Some((native, most)), _) if rows <= *most => native.forward(xs),
            (_, _, Some(copy)) if rows <= SMALL_ROWS => copy.forward(xs),
            (Some(main), _, _) => main.forward(xs),
            (None, _, _) => {
                candle_core::bail!("a weight matrix without a copy for inputs of {rows} rows")
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate: Lin,
    down: Lin,
    up: Lin,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let gate = self.gate.forward(xs)?;
        let up = self.up.forward(xs)?;
        self.down.forward(&(candle_nn::ops::silu(&gate)? * up)?)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    wq: Lin,
    wk: Lin,
    wv: Lin,
    /// q, k and v biases (qwen2; llama has none).
    bias: Option<(Tensor, Tensor, Tensor)>,
    wo: Lin,
    attention_norm: RmsNorm,
    mlp: Mlp,
    ffn_norm: RmsNorm,
}

/// The state of a batch of sequences: per layer, the keys and values of every position so far
/// (batch, kv heads, positions, head dim), and where each row's real tokens start.
#[derive(Debug, Clone)]
pub struct Cache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Per row: the first position that is not left padding.
    start: Vec<usize>,
    /// Positions held (padding included), the same for every row.
    len: usize,
}

impl Cache {
    /// Rows of the batch.
    pub fn rows(&self) -> usize {
        self.start.len()
    }

    /// Positions held, padding included.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has run yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps only the rows `rows` (in that order): sequences that finished leave the batch.
    pub fn keep(&mut self, rows: &[usize]) -> Result<()> {
        if rows.len() == self.rows() && rows.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(());
        }
        let device = self
            .layers
            .iter()
            .flatten()
            .next()
            .map(|(k, _)| k.device().clone());
        if let Some(device) = device {
            let index = Tensor::new(
                rows.iter()
                    .map(|&r| r as u32)
                    .collect::<Vec<_>>()
                    .as_slice(),
                &device,
            )?;
            for layer in self.layers.iter_mut().flatten() {
                *layer = (
                    layer.0.index_select(&index, 0)?,
                    layer.1.index_select(&index, 0)?,
                );
            }
        }
        self.start = rows.iter().map(|&r| self.start[r]).collect();
        Ok(())
    }

    /// The cache of row `row` alone, `rows` times over (a shared prefix forked for a batch of
    /// continuations).
    pub fn repeat_row(&self, row: usize, rows: usize) -> Result<Cache> {
        let mut out = self.clone();
        out.keep(&vec![row; rows])?;
        Ok(out)
    }
}

/// Where padding goes in a batch of rows of different lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Before the tokens ([`Decoder::forward_padded`], for generation: every row's last token
    /// is at the same position, so the rows decode on together; the padding is masked).
    Left,
    /// After the tokens, for scoring only: causal attention keeps a row's real tokens from
    /// seeing the pads after them, and no position after a row's last token is read.
    Right,
}

/// Model dimensions read from the GGUF metadata.
#[derive(Debug, Clone, Copy)]
struct Dims {
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    /// NEOX rotary pairs `(i, i + d/2)` (qwen2) rather than interleaved `(2i, 2i + 1)` (llama).
    neox: bool,
}

/// Decoder weights (read-only; the state of a batch is a [`Cache`]).
#[derive(Debug, Clone)]
pub struct Decoder {
    embeddings: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: Lin,
    cos: Tensor,
    sin: Tensor,
    neg_inf: Tensor,
    dims: Dims,
    positions: usize,
    device: Device,
}

fn rotary_tables(
    head_dim: usize,
    freq_base: f32,
    positions: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / freq_base.powf(i as f32 / head_dim as f32))
        .collect();
    let theta = Tensor::new(theta.as_slice(), device)?;
    let angles = Tensor::arange(0, positions as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((positions, 1))?
        .matmul(&theta.reshape((1, theta.elem_count()))?)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// The output projection: `output.weight`, or the token embeddings when they are tied.
fn output_matrix<R: std::io::Seek + std::io::Read>(
    ct: &gguf_file::Content,
    reader: &mut R,
    device: &Device,
) -> Result<QMatMul> {
    match ct.tensor(reader, "output.weight", device) {
        Ok(v) => QMatMul::from_qtensor(v),
        Err(_) => QMatMul::from_qtensor(ct.tensor(reader, "token_embd.weight", device)?),
    }
}

impl Decoder {
    /// Loads a `llama` or `qwen2` model from GGUF `ct` read from `reader`.
    pub fn from_gguf<R: std::io::Seek + std::io::Read>(
        ct: gguf_file::Content,
        reader: &mut R,
        device: &Device,
    ) -> Result<Self> {
        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let (neox, bias) = match arch.as_str() {
            "llama" => (false, false),
            "qwen2" => (true, true),
            other => candle_core::bail!("the batched decoder runs llama and qwen2, not `{other}`"),
        };
        let get = |key: &str| match ct.metadata.get(&format!("{arch}.{key}")) {
            None => candle_core::bail!("cannot find {arch}.{key} in the GGUF metadata"),
            Some(v) => Ok(v),
        };
        if get("expert_count").and_then(|v| v.to_u32()).unwrap_or(0) > 1 {
            candle_core::bail!("mixture-of-experts models are not supported");
        }
        let n_head = get("attention.head_count")?.to_u32()? as usize;
        let n_kv_head = get("attention.head_count_kv")?.to_u32()? as usize;
        let embedding_length = get("embedding_length")?.to_u32()? as usize;
        let context_length = get("context_length")
            .and_then(|v| v.to_u32())
            .unwrap_or(2048) as usize;
        let block_count = get("block_count")?.to_u32()? as usize;
        let eps = get("attention.layer_norm_rms_epsilon")?.to_f32()? as f64;
        let freq_base = get("rope.freq_base")
            .and_then(|m| m.to_f32())
            .unwrap_or(10000f32);
        let head_dim = embedding_length / n_head;
        let rope_dim = get("rope.dimension_count")
            .and_then(|v| v.to_u32())
            .map(|d| d as usize)
            .unwrap_or(head_dim);
        if rope_dim != head_dim {
            candle_core::bail!(
                "partial rotary embeddings ({rope_dim} of {head_dim} dimensions) are not supported"
            );
        }
        let positions = context_length.min(MAX_POSITIONS);

        let embeddings = ct
            .tensor(reader, "token_embd.weight", device)?
            .dequantize(device)?;
        let norm = RmsNorm::from_qtensor(ct.tensor(reader, "output_norm.weight", device)?, eps)?;
        let output = Lin::new(output_matrix(&ct, reader, device)?)?;
        let (cos, sin) = rotary_tables(head_dim, freq_base, positions, device)?;
        let mut layers = Vec::with_capacity(block_count);
        for i in 0..block_count {
            let mut t = |name: &str| ct.tensor(reader, &format!("blk.{i}.{name}"), device);
            let mut m = |name: &str| Lin::new(QMatMul::from_qtensor(t(name)?)?);
            let mlp = Mlp {
                gate: m("ffn_gate.weight")?,
                down: m("ffn_down.weight")?,
                up: m("ffn_up.weight")?,
            };
            let bias = if bias {
                Some((
                    t("attn_q.bias")?.dequantize(device)?,
                    t("attn_k.bias")?.dequantize(device)?,
                    t("attn_v.bias")?.dequantize(device)?,
                ))
            } else {
                None
            };
            let mut m = |name: &str| Lin::new(QMatMul::from_qtensor(t(name)?)?);
            layers.push(Layer {
                wq: m("attn_q.weight")?,
                wk: m("attn_k.weight")?,
                wv: m("attn_v.weight")?,
                bias,
                wo: m("attn_output.weight")?,
                attention_norm: RmsNorm::from_qtensor(t("attn_norm.weight")?, eps)?,
                ffn_norm: RmsNorm::from_qtensor(t("ffn_norm.weight")?, eps)?,
                mlp,
            });
        }
        Ok(Decoder {
            embeddings: Embedding::new(embeddings, embedding_length),
            layers,
            norm,
            output,
            cos,
            sin,
            neg_inf: Tensor::new(f32::NEG_INFINITY, device)?,
            dims: Dims {
                n_head,
                n_kv_head,
                head_dim,
                neox,
            },
            positions,
            device: device.clone(),
        })
    }

    /// Adds a second copy of every weight matrix, from `ct` (the same model, its matrices in
    /// another form), used for inputs of at most [`SMALL_ROWS`] rows: decode steps. The
    /// embeddings, norms and biases stay those of `self`.
    pub fn with_small_inputs<R: std::io::Seek + std::io::Read>(
        mut self,
        ct: gguf_file::Content,
        reader: &mut R,
        device: &Device,
    ) -> Result<Self> {
        self.output.set_small(output_matrix(&ct, reader, device)?)?;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let mut t = |name: &str| {
                QMatMul::from_qtensor(ct.tensor(reader, &format!("blk.{i}.{name}"), device)?)
            };
            layer.mlp.gate.set_small(t("ffn_gate.weight")?)?;
            layer.mlp.down.set_small(t("ffn_down.weight")?)?;
            layer.mlp.up.set_small(t("ffn_up.weight")?)?;
            layer.wq.set_small(t("attn_q.weight")?)?;
            layer.wk.set_small(t("attn_k.weight")?)?;
            layer.wv.set_small(t("attn_v.weight")?)?;
            layer.wo.set_small(t("attn_output.weight")?)?;
        }
        Ok(self)
    }

    /// An empty cache for a batch of `rows` sequences.
    pub fn cache(&self, rows: usize) -> Cache {
        Cache {
            layers: vec![None; self.layers.len()],
            start: vec![0; rows],
            len: 0,
        }
    }

    /// `rows` as one (rows, longest) input, `pad` filling the short rows on `side`.
    pub fn padded(&self, rows: &[Vec<u32>], pad: u32, side: Side) -> Result<Tensor> {
        let width = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows.len() * width);
        for tokens in rows {
            let padding = std::iter::repeat_n(pad, width - tokens.len());
            match side {
                Side::Left => ids.extend(padding.chain(tokens.iter().copied())),
                Side::Right => ids.extend(tokens.iter().copied().chain(padding)),
            }
        }
        Tensor::from_vec(ids, (rows.len(), width), &self.device)
    }

    /// Runs one token sequence per row, left-padded to the longest (`pad` fills, its positions
    /// masked), as the first forward of `cache`. Returns the logits (rows, vocab) of each row's
    /// last position.
    pub fn forward_padded(&self, rows: &[Vec<u32>], pad: u32, cache: &mut Cache) -> Result<Tensor> {
        let width = rows.iter().map(Vec::len).max().unwrap_or(0);
        if width == 0 || rows.len() != cache.rows() || !cache.is_empty() {
            candle_core::bail!(
                "forward_padded needs one non-empty sequence per row of an empty cache ({} rows, cache of {} holding {})",
                rows.len(),
                cache.rows(),
                cache.len
            );
        }
        for (row, tokens) in rows.iter().enumerate() {
            cache.start[row] = width - tokens.len();
        }
        let input = self.padded(rows, pad, Side::Left)?;
        let last: Vec<(usize, usize)> = (0..rows.len()).map(|r| (r, width - 1)).collect();
        self.forward(&input, cache, &last)
    }

    /// Runs `input` (rows, seq) after what `cache` holds, and returns the logits (n, vocab) at
    /// the `(row, position in input)` pairs of `at`, in that order.
    pub fn forward(
        &self,
        input: &Tensor,
        cache: &mut Cache,
        at: &[(usize, usize)],
    ) -> Result<Tensor> {
        let (b, seq) = input.dims2()?;
        if b != cache.rows() {
            candle_core::bail!("a batch of {b} rows on a cache of {}", cache.rows());
        }
        let past = cache.len;
        if past + seq > self.positions {
            candle_core::bail!(
                "{} positions exceed the model's usable context of {}",
                past + seq,
                self.positions
            );
        }
        let (cos, sin) = self.rotary(cache, seq)?;
        let mask = self.mask(cache, seq)?;
        let mut hidden = self.embeddings.forward(input)?;
        for (layer, slot) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let residual = hidden.clone();
            let attn = self.attention(
                layer,
                slot,
                &layer.attention_norm.forward(&hidden)?,
                mask.as_ref(),
                &cos,
                &sin,
                past,
            )?;
            let x = (attn + residual)?;
            let residual = x.clone();
            hidden = (layer.mlp.forward(&layer.ffn_norm.forward(&x)?)? + residual)?;
        }
        cache.len += seq;
        let index: Vec<u32> = at
            .iter()
            .map(|&(row, pos)| (row * seq + pos) as u32)
            .collect();
        let picked = hidden
            .reshape((b * seq, ()))?
            .index_select(&Tensor::new(index.as_slice(), &self.device)?, 0)?;
        self.output.forward(&self.norm.forward(&picked)?)
    }

    /// Cosine and sine tables for the next `seq` positions of every row: shared (seq, d/2)
    /// when no row is padded, per row (rows, seq, d/2) otherwise, so that a padded row's real
    /// tokens take the positions they would have alone.
    fn rotary(&self, cache: &Cache, seq: usize) -> Result<(Tensor, Tensor)> {
        if cache.start.iter().all(|&s| s == 0) {
            return Ok((
                self.cos.narrow(0, cache.len, seq)?,
                self.sin.narrow(0, cache.len, seq)?,
            ));
        }
        let index: Vec<u32> = cache
            .start
            .iter()
            .flat_map(|&start| (0..seq).map(move |t| (cache.len + t).saturating_sub(start) as u32))
            .collect();
        let index = Tensor::new(index.as_slice(), &self.device)?;
        let half = self.dims.head_dim / 2;
        let pick = |table: &Tensor| {
            table
                .index_select(&index, 0)?
                .reshape((cache.rows(), seq, half))
        };
        Ok((pick(&self.cos)?, pick(&self.sin)?))
    }

    /// The attention mask (rows, 1, seq, past + seq), 1 where a query must not see a key (a
    /// later position, or a row's left padding); none for a single unpadded step. A padding
    /// position sees itself only: a query that sees nothing would softmax to NaN, and its NaN
    /// values, even at weight 0, would reach the real rows through the attention product.
    fn mask(&self, cache: &Cache, seq: usize) -> Result<Option<Tensor>> {
        let padded = cache.start.iter().any(|&s| s > 0);
        if seq == 1 && !padded {
            return Ok(None);
        }
        let keys = cache.len + seq;
        let mut mask = Vec::with_capacity(cache.rows() * seq * keys);
        for &start in &cache.start {
            for t in 0..seq {
                let query = cache.len + t;
                mask.extend(
                    (0..keys).map(|key| u8::from(key > query || (key < start && key != query))),
                );
            }
        }
        Ok(Some(Tensor::from_vec(
            mask,
            (cache.rows(), 1, seq, keys),
            &self.device,
        )?))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        layer: &Layer,
        slot: &mut Option<(Tensor, Tensor)>,
        x: &Tensor,
        mask: Option<&Tensor>,
        cos: &Tensor,
        sin: &Tensor,
        past: usize,
    ) -> Result<Tensor> {
        let Dims {
            n_head,
            n_kv_head,
            head_dim,
            neox,
        } = self.dims;
        let (b, seq, n_embd) = x.dims3()?;
        let (mut q, mut k, mut v) = (
            layer.wq.forward(x)?,
            layer.wk.forward(x)?,
            layer.wv.forward(x)?,
        );
        if let Some((bq, bk, bv)) = &layer.bias {
            q = q.broadcast_add(bq)?;
            k = k.broadcast_add(bk)?;
            v = v.broadcast_add(bv)?;
        }
        let q = q
            .reshape((b, seq, n_head, head_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = k
            .reshape((b, seq, n_kv_head, head_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        let v = v
            .reshape((b, seq, n_kv_head, head_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        let rope = |x: &Tensor| {
            if neox {
                candle_nn::rotary_emb::rope(x, cos, sin)
            } else {
                candle_nn::rotary_emb::rope_i(x, cos, sin)
            }
        };
        let (q, k) = (rope(&q)?, rope(&k)?);
        let (k, v) = match slot.as_ref() {
            Some((k_cache, v_cache)) if past > 0 => (
                Tensor::cat(&[k_cache, &k], 2)?,
                Tensor::cat(&[v_cache, &v], 2)?,
            ),
            _ => (k, v),
        };
        *slot = Some((k.clone(), v.clone()));
        let k = repeat_kv(k, n_head / n_kv_head)?;
        let v = repeat_kv(v, n_head / n_kv_head)?;
        let att = (q.matmul(&k.t()?)? / (head_dim as f64).sqrt())?;
        let att = match mask {
            None => att,
            Some(mask) => {
                let mask = mask.broadcast_as(att.shape())?;
                mask.where_cond(&self.neg_inf.broadcast_as(att.shape().dims())?, &att)?
            }
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v.contiguous()?)?;
        let y = y.transpose(1, 2)?.reshape(&[b, seq, n_embd])?;
        layer.wo.forward(&y)
    }
}

/// Log-softmax over the last dimension of `logits` (n, vocab).
pub fn log_softmax_rows(logits: &Tensor) -> Result<Tensor> {
    candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)
}
