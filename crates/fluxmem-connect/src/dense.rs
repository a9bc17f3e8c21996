//! Exact dense search: cosine by blocked matrix products on a candle device (CPU or GPU).

use candle_core::{DType, Device, Tensor};
use fluxmem_graph::{Graph, NodeId, NodeKind};

use crate::{Error, Result};

/// Rows of the matrix scored per block (bounds the score matrix kept in memory).
pub const BLOCK_ROWS: usize = 8192;

/// L2-normalised vectors in one matrix.
#[derive(Debug, Clone)]
pub struct DenseIndex {
    matrix: Option<Tensor>,
    rows: usize,
    dim: usize,
    device: Device,
}

fn normalized(vector: &[f32]) -> Vec<f32> {
    let mut v = vector.to_vec();
    fluxmem_models::normalize(&mut v);
    v
}

impl DenseIndex {
    /// Indexes `vectors` (all of dimension `dim`) on `device`.
    pub fn new(vectors: &[Vec<f32>], dim: usize, device: &Device) -> Result<DenseIndex> {
        let rows = vectors.len();
        let matrix = if rows == 0 {
            None
        } else {
            let flat: Vec<f32> = vectors.iter().flat_map(|v| normalized(v)).collect();
            Some(Tensor::from_vec(flat, (rows, dim), device)?)
        };
        Ok(DenseIndex { matrix, rows, dim, device: device.clone() })
    }

    /// Indexes `vectors`, taking the dimension from the first (an empty index has none).
    pub fn from_vectors(vectors: &[Vec<f32>], device: &Device) -> Result<DenseIndex> {
        DenseIndex::new(vectors, vectors.first().map_or(0, Vec::len), device)
    }

    /// Number of indexed vectors.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// True when nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Cosine of every indexed vector with each query: one row of scores per query.
    pub fn scores(&self, queries: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        let Some(matrix) = &self.matrix else { return Ok(vec![Vec::new(); queries.len()]) };
        if queries.is_empty() {
            return Ok(Vec::new());
        }
        let flat: Vec<f32> = queries.iter().flat_map(|q| normalized(q)).collect();
        let query = Tensor::from_vec(flat, (queries.len(), self.dim), &self.device)?;
        let mut out = vec![Vec::with_capacity(self.rows); queries.len()];
        let mut start = 0;
        while start < self.rows {
            let len = BLOCK_ROWS.min(self.rows - start);
            let block = matrix.narrow(0, start, len)?;
            let scores: Vec<Vec<f32>> = query.matmul(&block.t()?)?.to_dtype(DType::F32)?.to_vec2()?;
            for (row, block_scores) in out.iter_mut().zip(scores) {
                row.extend(block_scores);
            }
            start += len;
        }
        Ok(out)
    }

    /// The `k` best (index, cosine) per query, best first, ties by index.
    pub fn top_k(&self, queries: &[Vec<f32>], k: usize) -> Result<Vec<Vec<(usize, f32)>>> {
        Ok(self.scores(queries)?.into_iter().map(|scores| top_k(&scores, k)).collect())
    }
}

/// The nodes of `kind` in `graph`, in id order, with their `model` vectors. A node without an
/// embedding of `model` is [`Error::NotEmbedded`], which names the fix.
pub fn embedded(graph: &Graph, kind: NodeKind, model: &str) -> Result<(Vec<NodeId>, Vec<Vec<f32>>)> {
    let mut ids = Vec::new();
    let mut vectors = Vec::new();
    for node in graph.nodes.values().filter(|n| n.kind() == kind) {
        let embedding = graph
            .embeddings
            .get(&(node.id.clone(), model.to_string()))
            .ok_or_else(|| Error::NotEmbedded { node: node.id.to_string(), model: model.to_string() })?;
        ids.push(node.id.clone());
        vectors.push(embedding.vector.clone());
    }
    Ok((ids, vectors))
}

/// The `k` highest (index, score) pairs, best first, ties broken by the lower index.
pub fn top_k(scores: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut ranked: Vec<(usize, f32)> = scores.iter().copied().enumerate().collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.truncate(k);
    ranked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocked_search_matches_brute_force() {
        let vectors: Vec<Vec<f32>> = (0..50).map(|i| vec![(i as f32).sin(), (i as f32).cos(), 0.5]).collect();
        let index = DenseIndex::new(&vectors, 3, &Device::Cpu).unwrap();
        let query = vec![1.0, 0.0, 0.5];
        let got = index.top_k(&[query.clone()], 5).unwrap().remove(0);
        let mut expected: Vec<(usize, f32)> =
            vectors.iter().enumerate().map(|(i, v)| (i, fluxmem_models::cosine(v, &query))).collect();
        expected.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for (g, e) in got.iter().zip(&expected) {
            assert_eq!(g.0, e.0);
            assert!((g.1 - e.1).abs() < 1e-5);
        }
        assert!(DenseIndex::new(&[], 3, &Device::Cpu).unwrap().top_k(&[query], 3).unwrap()[0].is_empty());
    }

    #[test]
    fn top_k_breaks_ties_by_index() {
        assert_eq!(top_k(&[0.5, 0.9, 0.5, 0.9], 3), vec![(1, 0.9), (3, 0.9), (0, 0.5)]);
    }
}
