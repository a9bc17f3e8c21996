//! The Qwen2 architecture (Qwen2, Qwen2.5, Qwen2.5-Coder) on GGUF weights.
//!
//! Adapted from candle-transformers 0.11's `quantized_qwen2` (MIT/Apache-2.0). Two changes:
//! the model is `Clone` (its KV cache is a value, so a shared prompt prefix can be run once and
//! forked, as the llama path does), and the rotary tables cover at most [`MAX_POSITIONS`]
//! positions instead of the 32k context the metadata declares (fluxmem's prompts are a few
//! thousand tokens; the tables would otherwise cost 16 MB per model copy for nothing).

use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::Embedding;
use candle_transformers::quantized_nn::RmsNorm;
use candle_transformers::utils::{build_causal_mask, repeat_kv};

/// Positions the rotary tables cover (the model's usable context here).
pub const MAX_POSITIONS: usize = 8192;

#[derive(Debug, Clone)]
struct Mlp {
    gate: QMatMul,
    down: QMatMul,
    up: QMatMul,
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
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    bq: Tensor,
    bk: Tensor,
    bv: Tensor,
    wo: QMatMul,
    attention_norm: RmsNorm,
    mlp: Mlp,
    ffn_norm: RmsNorm,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    cos: Tensor,
    sin: Tensor,
    neg_inf: Tensor,
    kv_cache: Option<(Tensor, Tensor)>,
}

impl Layer {
    fn rotary(&self, x: &Tensor, index_pos: usize) -> Result<Tensor> {
        let (_b, _h, seq_len, _d) = x.dims4()?;
        let cos = self.cos.narrow(0, index_pos, seq_len)?;
        let sin = self.sin.narrow(0, index_pos, seq_len)?;
        candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)
    }

    fn attention(&mut self, x: &Tensor, mask: Option<&Tensor>, index_pos: usize) -> Result<Tensor> {
        let (b, seq_len, n_embd) = x.dims3()?;
        let q = self.wq.forward(x)?.broadcast_add(&self.bq)?;
        let k = self.wk.forward(x)?.broadcast_add(&self.bk)?;
        let v = self.wv.forward(x)?.broadcast_add(&self.bv)?;
        let q = q.reshape((b, seq_len, self.n_head, self.head_dim))?.transpose(1, 2)?.contiguous()?;
        let k = k.reshape((b, seq_len, self.n_kv_head, self.head_dim))?.transpose(1, 2)?.contiguous()?;
        let v = v.reshape((b, seq_len, self.n_kv_head, self.head_dim))?.transpose(1, 2)?.contiguous()?;
        let q = self.rotary(&q, index_pos)?;
        let k = self.rotary(&k, index_pos)?;
        let (k, v) = match &self.kv_cache {
            Some((k_cache, v_cache)) if index_pos > 0 => (Tensor::cat(&[k_cache, &k], 2)?, Tensor::cat(&[v_cache, &v], 2)?),
            _ => (k, v),
        };
        self.kv_cache = Some((k.clone(), v.clone()));
        let k = repeat_kv(k, self.n_head / self.n_kv_head)?;
        let v = repeat_kv(v, self.n_head / self.n_kv_head)?;
        let att = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
        let att = match mask {
            None => att,
            Some(mask) => {
                let mask = mask.broadcast_as(att.shape())?;
                mask.where_cond(&self.neg_inf.broadcast_as(att.shape().dims())?, &att)?
            }
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v.contiguous()?)?;
        let y = y.transpose(1, 2)?.reshape(&[b, seq_len, n_embd])?;
        self.wo.forward(&y)
    }
}

/// Qwen2 weights and KV cache.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    embeddings: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: QMatMul,
}

fn rotary_tables(head_dim: usize, freq_base: f32, positions: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..head_dim).step_by(2).map(|i| 1f32 / freq_base.powf(i as f32 / head_dim as f32)).collect();
    let theta = Tensor::new(theta.as_slice(), device)?;
    let angles = Tensor::arange(0, positions as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((positions, 1))?
        .matmul(&theta.reshape((1, theta.elem_count()))?)?;
    Ok((angles.cos()?, angles.sin()?))
}

impl ModelWeights {
    /// Loads the model from GGUF `content` read from `reader`.
    pub fn from_gguf<R: std::io::Seek + std::io::Read>(ct: gguf_file::Content, reader: &mut R, device: &Device) -> Result<Self> {
        let get = |key: &str| match ct.metadata.get(key) {
            None => candle_core::bail!("cannot find {key} in the GGUF metadata"),
            Some(v) => Ok(v),
        };
        let head_count = get("qwen2.attention.head_count")?.to_u32()? as usize;
        let head_count_kv = get("qwen2.attention.head_count_kv")?.to_u32()? as usize;
        let embedding_length = get("qwen2.embedding_length")?.to_u32()? as usize;
        let context_length = get("qwen2.context_length")?.to_u32()? as usize;
        let block_count = get("qwen2.block_count")?.to_u32()? as usize;
        let eps = get("qwen2.attention.layer_norm_rms_epsilon")?.to_f32()? as f64;
        let freq_base = get("qwen2.rope.freq_base").and_then(|m| m.to_f32()).unwrap_or(10000f32);
        let head_dim = embedding_length / head_count;
        let neg_inf = Tensor::new(f32::NEG_INFINITY, device)?;

        let embeddings = ct.tensor(reader, "token_embd.weight", device)?.dequantize(device)?;
        let norm = RmsNorm::from_qtensor(ct.tensor(reader, "output_norm.weight", device)?, eps)?;
        let output = match ct.tensor(reader, "output.weight", device) {
            Ok(v) => QMatMul::from_qtensor(v)?,
            // Tied word embeddings.
            Err(_) => QMatMul::from_qtensor(ct.tensor(reader, "token_embd.weight", device)?)?,
        };
        let (cos, sin) = rotary_tables(head_dim, freq_base, context_length.min(MAX_POSITIONS), device)?;
        let mut layers = Vec::with_capacity(block_count);
        for i in 0..block_count {
            let mut t = |name: &str| ct.tensor(reader, &format!("blk.{i}.{name}"), device);
            let mlp = Mlp {
                gate: QMatMul::from_qtensor(t("ffn_gate.weight")?)?,
                down: QMatMul::from_qtensor(t("ffn_down.weight")?)?,
                up: QMatMul::from_qtensor(t("ffn_up.weight")?)?,
            };
            layers.push(Layer {
                wq: QMatMul::from_qtensor(t("attn_q.weight")?)?,
                wk: QMatMul::from_qtensor(t("attn_k.weight")?)?,
                wv: QMatMul::from_qtensor(t("attn_v.weight")?)?,
                bq: t("attn_q.bias")?.dequantize(device)?,
                bk: t("attn_k.bias")?.dequantize(device)?,
                bv: t("attn_v.bias")?.dequantize(device)?,
                wo: QMatMul::from_qtensor(t("attn_output.weight")?)?,
                attention_norm: RmsNorm::from_qtensor(t("attn_norm.weight")?, eps)?,
                ffn_norm: RmsNorm::from_qtensor(t("ffn_norm.weight")?, eps)?,
                mlp,
                n_head: head_count,
                n_kv_head: head_count_kv,
                head_dim,
                cos: cos.clone(),
                sin: sin.clone(),
                neg_inf: neg_inf.clone(),
                kv_cache: None,
            });
        }
        Ok(ModelWeights { embeddings: Embedding::new(embeddings, embedding_length), layers, norm, output })
    }

    /// Runs `x` (batch, seq) starting at `index_pos` (the KV cache holds the earlier positions);
    /// returns the last position's logits (batch, vocab).
    pub fn forward(&mut self, x: &Tensor, index_pos: usize) -> Result<Tensor> {
        let (_b, seq_len) = x.dims2()?;
        let mask = if seq_len == 1 { None } else { Some(build_causal_mask(seq_len, index_pos, x.device())?) };
        let mut hidden = self.embeddings.forward(x)?;
        for layer in self.layers.iter_mut() {
            let residual = hidden.clone();
            let attn = layer.attention(&layer.attention_norm.forward(&hidden)?, mask.as_ref(), index_pos)?;
            let x = (attn + residual)?;
            let residual = x.clone();
            hidden = (layer.mlp.forward(&layer.ffn_norm.forward(&x)?)? + residual)?;
        }
        let x = self.norm.forward(&hidden)?;
        let x = x.i((.., seq_len - 1, ..))?;
        self.output.forward(&x)
    }
}
