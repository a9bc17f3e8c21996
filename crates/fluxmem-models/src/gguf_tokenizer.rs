//! Tokenizers for GGUF models built from the GGUF metadata, for checkpoints that ship no
//! `tokenizer.json`.
//!
//! - Byte-level BPE (`tokenizer.ggml.model = gpt2`): the vocabulary and merges from the
//!   metadata, and the pre-tokenizer `tokenizer.ggml.pre` names:
//!   - `qwen2` (Qwen2, Qwen2.5): NFC normalization, then Qwen's split pattern (contractions,
//!     letter runs with one leading non-letter, single digits, punctuation runs, newlines,
//!     spaces), then byte-level mapping without GPT-2's own regex, as Qwen's `tokenizer.json`
//!     does;
//!   - otherwise (SmolLM2): digits split one by one, then GPT-2 byte-level pre-tokenization
//!     without a prefix space (as SmolLM2's reference `tokenizer.json` does; candle's
//!     `TokenizerFromGguf` adds a prefix space and so disagrees with it).
//! - SentencePiece BPE (`tokenizer.ggml.model = llama`, e.g. Gemma 3): spaces become `▁`, merges
//!   are derived from the piece scores the way the Hugging Face converter does (every split of a
//!   piece into two known pieces, ranked by the piece's score), unknown bytes fall back to
//!   `<0xNN>` pieces; no dummy prefix space (Gemma's setting).
//!
//! Control tokens (`<|im_start|>`, `<start_of_turn>`...) are added as special tokens so they
//! encode to one id; user-defined pieces are matched whole before BPE.

use candle_core::quantized::gguf_file::{Content, Value};
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::SplitDelimiterBehavior;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::{Error, Result};

fn strings(content: &Content, key: &str, path: &Path) -> Result<Vec<String>> {
    let bad = |reason: &str| Error::Format {
        path: path.into(),
        reason: format!("GGUF metadata `{key}`: {reason}"),
    };
    match content.metadata.get(key) {
        Some(Value::Array(values)) => values
            .iter()
            .map(|v| {
                v.to_string()
                    .map(|s| s.to_string())
                    .map_err(|_| bad("not strings"))
            })
            .collect(),
        Some(_) => Err(bad("not an array")),
        None => Err(bad("missing")),
    }
}

/// Builds the tokenizer described by the GGUF metadata of `content` (read from `path`).
pub fn tokenizer_from_gguf(content: &Content, path: &Path) -> Result<Tokenizer> {
    let kind = content
        .metadata
        .get("tokenizer.ggml.model")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    let tokens = strings(content, "tokenizer.ggml.tokens", path)?;
    let mut tokenizer = match kind.as_str() {
        "gpt2" => byte_level_bpe(content, &tokens, path)?,
        "llama" => sentencepiece_bpe(content, &tokens, path)?,
        other => {
            return Err(Error::Format {
                path: path.into(),
                reason: format!("tokenizer model `{other}` in the GGUF metadata is not supported; put a tokenizer.json beside the model"),
            })
        }
    };
    add_special_tokens(&mut tokenizer, content, &tokens)?;
    Ok(tokenizer)
}

/// Qwen2's pre-tokenizer split pattern, as in its `tokenizer.json`.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level_bpe(content: &Content, tokens: &[String], path: &Path) -> Result<Tokenizer> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = strings(content, "tokenizer.ggml.merges", path)?
        .into_iter()
        .filter_map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
        })
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| Error::Format {
            path: path.into(),
            reason: format!("BPE from GGUF: {e}"),
        })?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre_name = content
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    let pre = match pre_name.as_str() {
        "qwen2" => {
            let split = Split::new(
                SplitPattern::Regex(QWEN2_PATTERN.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| Error::Tokenizer(format!("qwen2 pre-tokenizer: {e}")))?;
            tokenizer
                .with_normalizer(Some(NFC))
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
            ])
        }
        _ => Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]),
    };
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

fn sentencepiece_bpe(content: &Content, tokens: &[String], path: &Path) -> Result<Tokenizer> {
    let scores: Vec<f32> = match content.metadata.get("tokenizer.ggml.scores") {
        Some(Value::Array(values)) => values.iter().map(|v| v.to_f32().unwrap_or(0.0)).collect(),
        _ => vec![0.0; tokens.len()],
    };
    let types = token_types(content);
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    // Merges as the Hugging Face SentencePiece converter derives them: each normal piece split
    // into two known pieces, all such pairs ranked by the merged piece's score (best first).
    let mut merges: Vec<(f32, u32, u32, &str, &str)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types.get(id).copied().unwrap_or(1) != 1 {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (vocab.get(left), vocab.get(right)) {
                merges.push((scores.get(id).copied().unwrap_or(0.0), l, r, left, right));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect();
    let unk = types
        .iter()
        .position(|&t| t == 2)
        .and_then(|i| tokens.get(i))
        .cloned();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(|e| Error::Format {
        path: path.into(),
        reason: format!("BPE from GGUF: {e}"),
    })?;
    let mut tokenizer = Tokenizer::new(bpe);
    let space = Replace::new(" ", "\u{2581}").map_err(|e| Error::Tokenizer(e.to_string()))?;
    tokenizer
        .with_normalizer(Some(space))
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let unspace = Replace::new("\u{2581}", " ").map_err(|e| Error::Tokenizer(e.to_string()))?;
    tokenizer.with_decoder(Some(DecoderSequence::new(vec![
        DecoderWrapper::Replace(unspace),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ])));
    Ok(tokenizer)
}

fn token_types(content: &Content) -> Vec<i32> {
    match content.metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(values)) => values.iter().map(|v| v.to_i32().unwrap_or(1)).collect(),
        _ => Vec::new(),
    }
}

/// Control tokens (type 3) become special tokens; user-defined pieces (type 4) are matched whole.
fn add_special_tokens(
    tokenizer: &mut Tokenizer,
    content: &Content,
    tokens: &[String],
) -> Result<()> {
    let types = token_types(content);
    let pick = |wanted: i32| -> Vec<AddedToken> {
        types
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == wanted)
            .filter_map(|(i, _)| tokens.get(i))
            .map(|t| AddedToken::from(t.clone(), wanted == 3).normalized(false))
            .collect()
    };
    tokenizer
        .add_special_tokens(pick(3))
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    tokenizer
        .add_tokens(pick(4))
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    Ok(())
}
