//! The `Embedder` trait and a deterministic fake for tests of code that needs embeddings.

use crate::Result;
use sha2::{Digest, Sha256};

/// Turns texts into fixed-size vectors. Implementations are deterministic: the same text
/// always gives the same vector.
pub trait Embedder: Send + Sync {
    /// Identifies the model and its revision; stored with every embedding.
    fn model_id(&self) -> &str;
    /// Vector dimension.
    fn dim(&self) -> usize;
    /// One vector per text, in order.
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>>;
    /// Number of model tokens in `text` (without truncation).
    fn count_tokens(&self, text: &str) -> Result<usize>;
}

/// A fake embedder for tests: feature hashing of lower-cased words into `dim` buckets,
/// L2-normalised, so texts sharing words have a high cosine. No weights needed.
#[derive(Debug, Clone)]
pub struct HashEmbedder {
    dim: usize,
    model_id: String,
}

impl HashEmbedder {
    /// A hashing embedder of `dim` dimensions.
    pub fn new(dim: usize) -> HashEmbedder {
        HashEmbedder {
            dim: dim.max(1),
            model_id: format!("hash-{dim}"),
        }
    }
}

impl Embedder for HashEmbedder {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        Ok(texts
            .iter()
            .map(|text| {
                let mut vector = vec![0f32; self.dim];
                for word in words(text) {
                    // The first 48 bits of the word's SHA-256 (its first 12 hex digits).
                    let digest = Sha256::digest(word.as_bytes());
                    let bucket = digest[..6]
                        .iter()
                        .fold(0u64, |acc, &b| (acc << 8) | b as u64)
                        as usize
                        % self.dim;
                    vector[bucket] += 1.0;
                }
                normalize(&mut vector);
                vector
            })
            .collect())
    }

    fn count_tokens(&self, text: &str) -> Result<usize> {
        Ok(words(text).count())
    }
}

fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
}

/// Scales a vector to unit length (kept with the graph's types: a tenant index stores its
/// episodes' vectors normalised by it, bit for bit as a ranking normalises them).
pub use fluxmem_graph::normalize;

/// Cosine similarity of two vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norms =
        a.iter().map(|v| v * v).sum::<f32>().sqrt() * b.iter().map(|v| v * v).sum::<f32>().sqrt();
    if norms > 0.0 {
        dot / norms
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_embedder_is_deterministic_and_normalised() {
        let embedder = HashEmbedder::new(64);
        let vectors = embedder
            .embed(&[
                "refund the order",
                "Refund the ORDER",
                "restart the job",
                "",
            ])
            .unwrap();
        assert_eq!(vectors[0], vectors[1]);
        assert!((cosine(&vectors[0], &vectors[0]) - 1.0).abs() < 1e-6);
        assert!(cosine(&vectors[0], &vectors[2]) < cosine(&vectors[0], &vectors[1]));
        assert!(vectors[3].iter().all(|v| *v == 0.0));
        assert_eq!(cosine(&vectors[3], &vectors[0]), 0.0);
    }

    #[test]
    fn hash_buckets_are_the_first_twelve_hex_digits_of_the_word_hash() {
        // The bucket rule stores' `hash-*` vectors were made with: word hash as hex, its first
        // 12 digits as a number, modulo the dimension.
        let embedder = HashEmbedder::new(384);
        let text = "restart the payment job after the refund order";
        let mut expected = vec![0f32; 384];
        for word in words(text) {
            let digest = fluxmem_graph::sha256_hex(word.as_bytes());
            expected[u64::from_str_radix(&digest[..12], 16).unwrap() as usize % 384] += 1.0;
        }
        normalize(&mut expected);
        assert_eq!(embedder.embed(&[text]).unwrap()[0], expected);
    }
}
