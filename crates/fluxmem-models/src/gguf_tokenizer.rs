//! Tokenizers for GGUF models built from the GGUF metadata, for checkpoints that ship no
//! `tokenizer.json`.
//!
//! Byte-level BPE (`tokenizer.ggml.model = gpt2`, e.g. SmolLM2): the vocabulary and merges from
//! the metadata, digits split one by one, then GPT-2 byte-level pre-tokenization without a
//! prefix space (as SmolLM2's reference `tokenizer.json` does; candle's `TokenizerFromGguf`
//! adds a prefix space and so disagrees with it). Control tokens (`<|im_start|>`...) are added
//! as special tokens so they encode to one id.

use candle_core::quantized::gguf_file::{Content, Value};
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::{Error, Result};

fn strings(content: &Content, key: &str, path: &Path) -> Result<Vec<String>> {
    let bad = |reason: &str| Error::Format { path: path.into(), reason: format!("GGUF metadata `{key}`: {reason}") };
    match content.metadata.get(key) {
        Some(Value::Array(values)) => values
            .iter()
            .map(|v| v.to_string().map(|s| s.to_string()).map_err(|_| bad("not strings")))
            .collect(),
        Some(_) => Err(bad("not an array")),
        None => Err(bad("missing")),
    }
}

/// Builds the tokenizer described by the GGUF metadata of `content` (read from `path`).
pub fn tokenizer_from_gguf(content: &Content, path: &Path) -> Result<Tokenizer> {
    let kind = content.metadata.get("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
    if kind != "gpt2" {
        return Err(Error::Format {
            path: path.into(),
            reason: format!("tokenizer model `{kind}` in the GGUF metadata is not supported; put a tokenizer.json beside the model"),
        });
    }
    let tokens = strings(content, "tokenizer.ggml.tokens", path)?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let merges: Vec<(String, String)> = strings(content, "tokenizer.ggml.merges", path)?
        .into_iter()
        .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| Error::Format { path: path.into(), reason: format!("BPE from GGUF: {e}") })?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre = Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]);
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    if let Some(Value::Array(types)) = content.metadata.get("tokenizer.ggml.token_type") {
        let specials: Vec<AddedToken> = types
            .iter()
            .enumerate()
            .filter(|(_, t)| t.to_i32().ok() == Some(3))
            .filter_map(|(i, _)| tokens.get(i))
            .map(|t| AddedToken::from(t.clone(), true))
            .collect();
        tokenizer.add_special_tokens(specials).map_err(|e| Error::Tokenizer(e.to_string()))?;
    }
    Ok(tokenizer)
}
