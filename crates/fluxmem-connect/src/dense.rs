//! Exact dense search: cosine by blocked matrix products on a candle device (CPU or GPU).

use candle_core::{DType, Device, Tensor};
use fluxmem_graph::{Graph, NodeId, NodeKind};

use crate::{Error, Result};

/// Rows of the matrix scored per block (bounds the score matrix kept in memory).
pub const BLOCK_ROWS: usize = 8192;

/// Longest inner dimension one matrix product reduces; see [`DenseIndex::scores`].
pub const REDUCE_CHUNK: usize = 512;

/// Fewest rows either side of a matrix product has (one more than the CPU kernels'
/// small-matrix limit of 64); see [`DenseIndex::scores`].
pub const MIN_ROWS: usize = 65;

/// L2-normalised vectors in one matrix.
#[derive(Debug, Clone)]
pub struct DenseIndex {
    matrix: Option<Tensor>,
    rows: usize,
    dim: usize,
    device: Device,
}

/// The vectors, each normalised, in one row-major block (one allocation; each row copied
/// whole, then normalised in place).
fn normalized_rows(vectors: &[Vec<f32>], dim: usize) -> Vec<f32> {
    let mut flat = vectors.concat();
    normalize_rows(&mut flat, dim);
    flat
}

/// Normalises each `dim`-long row of `flat` in place.
fn normalize_rows(flat: &mut [f32], dim: usize) {
    for row in flat.chunks_exact_mut(dim.max(1)) {
        fluxmem_models::normalize(row);
    }
}

impl DenseIndex {
    /// Indexes `vectors` (all of dimension `dim`) on `device`.
    pub fn new(vectors: &[Vec<f32>], dim: usize, device: &Device) -> Result<DenseIndex> {
        DenseIndex::from_rows(vectors.concat(), dim, device)
    }

    /// Indexes the vectors laid out row after row in `rows` (a multiple of `dim` long), as
    /// [`DenseIndex::new`] indexes the same vectors (each normalised the same way, bit for bit).
    pub fn from_rows(mut rows: Vec<f32>, dim: usize, device: &Device) -> Result<DenseIndex> {
        normalize_rows(&mut rows, dim);
        DenseIndex::from_normalized_rows(rows, dim, device)
    }

    /// Indexes rows normalised already (by [`fluxmem_models::normalize`], as a tenant index
    /// stores its episodes'), as [`DenseIndex::from_rows`] indexes the rows before it
    /// normalised them.
    pub fn from_normalized_rows(rows: Vec<f32>, dim: usize, device: &Device) -> Result<DenseIndex> {
        let count = rows.len().checked_div(dim).unwrap_or(0);
        let matrix = if count == 0 {
            None
        } else {
            Some(Tensor::from_vec(rows, (count, dim), device)?)
        };
        Ok(DenseIndex {
            matrix,
            rows: count,
            dim,
            device: device.clone(),
        })
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
    ///
    /// A score is a function of its query and row alone, bit for bit, whatever else is scored
    /// with it (so a sharded connect equals the single run). The CPU matrix kernels keep each
    /// output's reduction order fixed for a given inner length, except on paths this avoids:
    /// one or two queries or rows go through matrix-vector kernels, and products with both
    /// sides at most 64 rows through a small-matrix path, each with another order (so both
    /// sides are padded to at least [`MIN_ROWS`] rows by repeating their last row: cheap, a
    /// few hundred extra dot products at most), and an inner length over 512 is blocked by a
    /// cache-size rule that depends on the shape (so longer vectors are reduced here, in fixed
    /// chunks of [`REDUCE_CHUNK`] whose partial products are added in order).
    pub fn scores(&self, queries: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        let Some(matrix) = &self.matrix else {
            return Ok(vec![Vec::new(); queries.len()]);
        };
        if queries.is_empty() {
            return Ok(Vec::new());
        }
        let mut flat = normalized_rows(queries, self.dim);
        let query_rows = queries.len().max(MIN_ROWS);
        let last = flat.len() - self.dim;
        for _ in queries.len()..query_rows {
            flat.extend_from_within(last..last + self.dim);
        }
        let query = Tensor::from_vec(flat, (query_rows, self.dim), &self.device)?;
        let mut out = vec![Vec::with_capacity(self.rows); queries.len()];
        let mut start = 0;
        while start < self.rows {
            let len = BLOCK_ROWS.min(self.rows - start);
            let mut block = matrix.narrow(0, start, len)?;
            if len < MIN_ROWS {
                let last = block.narrow(0, len - 1, 1)?;
                let mut parts = vec![block.clone()];
                parts.extend(std::iter::repeat_n(last, MIN_ROWS - len));
                block = Tensor::cat(&parts, 0)?;
            }
            let scores: Vec<Vec<f32>> = self
                .block_scores(&query, &block)?
                .to_dtype(DType::F32)?
                .to_vec2()?;
            for (row, block_scores) in out.iter_mut().zip(scores) {
                row.extend(block_scores.into_iter().take(len));
            }
            start += len;
        }
        Ok(out)
    }

    /// `query x block^T`, the inner dimension reduced in chunks of at most [`REDUCE_CHUNK`].
    fn block_scores(&self, query: &Tensor, block: &Tensor) -> Result<Tensor> {
        let mut total: Option<Tensor> = None;
        let mut offset = 0;
        while offset < self.dim {
            let width = REDUCE_CHUNK.min(self.dim - offset);
            let part = query
                .narrow(1, offset, width)?
                .contiguous()?
                .matmul(&block.narrow(1, offset, width)?.contiguous()?.t()?)?;
            total = Some(match total {
                None => part,
                Some(sum) => (sum + part)?,
            });
            offset += width;
        }
        Ok(total.expect("an index has a dimension of at least 1"))
    }

    /// The `k` best (index, cosine) for one query, best first, ties by index. On the CPU each
    /// score is a dot product with the normalised query in a fixed order of its own ([`dot`]):
    /// the same on any machine, and cheaper than [`DenseIndex::top_k`], which pads one query
    /// to [`MIN_ROWS`] rows of a matrix product (its batched scores may differ from these in
    /// the last bits). On other devices, [`DenseIndex::top_k`].
    pub fn top_k_one(&self, query: &[f32], k: usize) -> Result<Vec<(usize, f32)>> {
        let Some(matrix) = &self.matrix else {
            return Ok(Vec::new());
        };
        if !self.device.is_cpu() || query.len() != self.dim {
            return Ok(self.top_k(&[query.to_vec()], k)?.remove(0));
        }
        let (storage, layout) = matrix.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            unreachable!("a CPU device's tensor is in CPU storage")
        };
        let start = layout.start_offset();
        let rows = &cpu.as_slice::<f32>()?[start..start + self.rows * self.dim];
        Ok(top_k_rows(rows, self.dim, query, k))
    }

    /// The `k` best (index, cosine) per query, best first, ties by index.
    pub fn top_k(&self, queries: &[Vec<f32>], k: usize) -> Result<Vec<Vec<(usize, f32)>>> {
        Ok(self
            .scores(queries)?
            .into_iter()
            .map(|scores| top_k(&scores, k))
            .collect())
    }
}

/// The `k` best (row, cosine) of `query` against `rows` (normalised vectors of `dim` values,
/// row after row), best first, ties by row: what [`DenseIndex::top_k_one`] ranks on the CPU,
/// for rows that are not in an index (a mapped tenant index's).
pub fn top_k_rows(rows: &[f32], dim: usize, query: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut query = query.to_vec();
    fluxmem_models::normalize(&mut query);
    let scores: Vec<f32> = (rows.chunks_exact(dim.max(1)))
        .map(|row| dot(&query, row))
        .collect();
    top_k(&scores, k)
}

/// `a . b` in a fixed order: eight running sums over the lanes of each group of eight values
/// (which the compiler keeps in one vector register), added pairwise, then the rest in order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let whole = a.len().min(b.len()) / 8 * 8;
    let mut sums = [0f32; 8];
    for (x, y) in a[..whole].chunks_exact(8).zip(b[..whole].chunks_exact(8)) {
        for lane in 0..8 {
            sums[lane] += x[lane] * y[lane];
        }
    }
    let mut total =
        ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        total += x * y;
    }
    total
}

/// What building an index does with a node that has no embedding of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unembedded {
    /// [`Error::NotEmbedded`], which names the fix (`connect`: every node must be a candidate).
    #[default]
    Fail,
    /// Leave the node out and count it (`query`: answer from what is embedded).
    Skip,
}

/// Nodes of one kind and tenant with their vectors, in id order, and how many were left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embedded {
    /// The nodes.
    pub ids: Vec<NodeId>,
    /// Their vectors, in the same order.
    pub vectors: Vec<Vec<f32>>,
    /// Nodes left out for lack of an embedding ([`Unembedded::Skip`]).
    pub skipped: usize,
}

/// The nodes of `kind` in `graph`, in id order, with their `model` vectors. A node without an
/// embedding of `model` is [`Error::NotEmbedded`], which names the fix. All tenants: use
/// [`embedded_in`] for an index that serves one tenant.
pub fn embedded(
    graph: &Graph,
    kind: NodeKind,
    model: &str,
) -> Result<(Vec<NodeId>, Vec<Vec<f32>>)> {
    let all = select(graph, kind, None, model, Unembedded::Fail)?;
    Ok((all.ids, all.vectors))
}

/// The nodes of `kind` and `tenant` in `graph`, in id order, with their `model` vectors; a node
/// without one fails or is skipped and counted, as `unembedded` says.
pub fn embedded_in(
    graph: &Graph,
    kind: NodeKind,
    tenant: &str,
    model: &str,
    unembedded: Unembedded,
) -> Result<Embedded> {
    select(graph, kind, Some(tenant), model, unembedded)
}

fn select(
    graph: &Graph,
    kind: NodeKind,
    tenant: Option<&str>,
    model: &str,
    unembedded: Unembedded,
) -> Result<Embedded> {
    let mut out = Embedded::default();
    let wanted = graph
        .nodes
        .values()
        .filter(|n| n.kind() == kind && tenant.is_none_or(|t| n.tenant == t));
    for node in wanted {
        match graph.embeddings.get(&(node.id.clone(), model.to_string())) {
            Some(embedding) => {
                out.ids.push(node.id.clone());
                out.vectors.push(embedding.vector.clone());
            }
            None if unembedded == Unembedded::Skip => out.skipped += 1,
            None => {
                return Err(Error::NotEmbedded {
                    node: node.id.to_string(),
                    model: model.to_string(),
                })
            }
        }
    }
    Ok(out)
}

/// The `k` highest (index, score) pairs, best first, ties broken by the lower index.
pub fn top_k(scores: &[f32], k: usize) -> Vec<(usize, f32)> {
    let order = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut ranked: Vec<(usize, f32)> = scores.iter().copied().enumerate().collect();
    // Partial selection (O(n) to find the k best, then O(k log k) to order them): the order is
    // total (score, then index), so the result is the same as a full sort's first k.
    if k == 0 {
        return Vec::new();
    }
    if k < ranked.len() {
        ranked.select_nth_unstable_by(k - 1, order);
        ranked.truncate(k);
    }
    ranked.sort_by(order);
    ranked
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_query_scores_the_same_alone_and_in_a_batch() {
        let vectors: Vec<Vec<f32>> = (0..300)
            .map(|i| {
                (0..24)
                    .map(|j| ((i * 24 + j) as f32 * 0.37).sin())
                    .collect()
            })
            .collect();
        let index = DenseIndex::new(&vectors, 24, &Device::Cpu).unwrap();
        let queries: Vec<Vec<f32>> = (0..7)
            .map(|q| (0..24).map(|j| ((q * 5 + j) as f32 * 0.91).cos()).collect())
            .collect();
        let batch = index.scores(&queries).unwrap();
        for (query, batched) in queries.iter().zip(&batch) {
            let alone = index.scores(std::slice::from_ref(query)).unwrap().remove(0);
            assert_eq!(
                &alone, batched,
                "bit for bit: batching the step queries changes no edge"
            );
        }
    }

    /// One query's scores in their own order: each the cosine (to rounding), the same however
    /// many rows there are, and ranked as brute force ranks them.
    #[test]
    fn one_query_scores_each_row_alone_and_ranks_by_cosine() {
        let vectors: Vec<Vec<f32>> = (0..300)
            .map(|i| {
                (0..21)
                    .map(|j| ((i * 21 + j) as f32 * 0.37).sin())
                    .collect()
            })
            .collect();
        let query: Vec<f32> = (0..21).map(|j| (j as f32 * 0.91).cos()).collect();
        let index = DenseIndex::new(&vectors, 21, &Device::Cpu).unwrap();
        let all = index.top_k_one(&query, 300).unwrap();
        let mut expected: Vec<(usize, f32)> = (vectors.iter().enumerate())
            .map(|(i, v)| (i, fluxmem_models::cosine(v, &query)))
            .collect();
        expected.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for ((i, got), (j, cosine)) in all.iter().zip(&expected) {
            assert!((got - cosine).abs() < 1e-5, "row {i}: {got} vs {cosine}");
            if (got - cosine).abs() > 1e-6 {
                continue;
            }
            assert_eq!(i, j);
        }
        let fewer = DenseIndex::new(&vectors[..17], 21, &Device::Cpu).unwrap();
        let scores: BTreeMap<usize, f32> = all.iter().copied().collect();
        for (i, score) in fewer.top_k_one(&query, 17).unwrap() {
            assert_eq!(score.to_bits(), scores[&i].to_bits(), "row {i}");
        }
    }

    #[test]
    fn partial_top_k_is_the_full_sort_prefix() {
        let scores: Vec<f32> = (0..500)
            .map(|i| ((i * 37 % 101) as f32 / 7.0).sin())
            .collect();
        let mut full: Vec<(usize, f32)> = scores.iter().copied().enumerate().collect();
        full.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for k in [0, 1, 5, 100, 499, 500, 600] {
            assert_eq!(
                top_k(&scores, k),
                full.iter().copied().take(k).collect::<Vec<_>>(),
                "k = {k}"
            );
        }
    }

    #[test]
    fn blocked_search_matches_brute_force() {
        let vectors: Vec<Vec<f32>> = (0..50)
            .map(|i| vec![(i as f32).sin(), (i as f32).cos(), 0.5])
            .collect();
        let index = DenseIndex::new(&vectors, 3, &Device::Cpu).unwrap();
        let query = vec![1.0, 0.0, 0.5];
        let got = index
            .top_k(std::slice::from_ref(&query), 5)
            .unwrap()
            .remove(0);
        let mut expected: Vec<(usize, f32)> = vectors
            .iter()
            .enumerate()
            .map(|(i, v)| (i, fluxmem_models::cosine(v, &query)))
            .collect();
        expected.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for (g, e) in got.iter().zip(&expected) {
            assert_eq!(g.0, e.0);
            assert!((g.1 - e.1).abs() < 1e-5);
        }
        assert!(DenseIndex::new(&[], 3, &Device::Cpu)
            .unwrap()
            .top_k(&[query], 3)
            .unwrap()[0]
            .is_empty());
    }

    /// A score depends on its query and row alone, bit for bit, not on how many other queries
    /// are scored at once or how many rows the index has: a sharded connect (each shard
    /// scoring its own episodes) must give the same weights as the single run.
    #[test]
    fn a_score_does_not_depend_on_the_other_queries_or_rows() {
        for dim in [384, 1100] {
            scores_are_independent_of_batch_mates(dim, 150);
            scores_are_independent_of_batch_mates(dim, 30);
        }
    }

    fn scores_are_independent_of_batch_mates(dim: usize, row_count: usize) {
        let vector = |i: usize| -> Vec<f32> {
            (0..dim)
                .map(|j| ((i * 7919 + j * 104729) % 1000) as f32 / 1000.0 - 0.5)
                .collect()
        };
        let rows: Vec<Vec<f32>> = (0..row_count).map(vector).collect();
        let queries: Vec<Vec<f32>> = (1000..1100).map(vector).collect();
        let index = DenseIndex::new(&rows, dim, &Device::Cpu).unwrap();
        let all = index.scores(&queries).unwrap();
        for count in [1, 2, 3, 4, 5, 17, 64, 65] {
            let some = index.scores(&queries[..count]).unwrap();
            for (q, (a, b)) in all.iter().zip(&some).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "dim {dim}, {row_count} rows: query {q} scored among {count} queries differs from among 100");
            }
        }
        for count in [1, 2, 3, 4, 5, 29, 31, 64, 65]
            .into_iter()
            .filter(|&c| c <= row_count)
        {
            let small = DenseIndex::new(&rows[..count], dim, &Device::Cpu)
                .unwrap()
                .scores(&queries)
                .unwrap();
            for (q, (a, b)) in all.iter().zip(&small).enumerate() {
                let same = a[..count]
                    .iter()
                    .zip(b)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "dim {dim}: query {q} against an index of {count} rows differs from {row_count} rows");
            }
        }
    }

    #[test]
    fn top_k_breaks_ties_by_index() {
        assert_eq!(
            top_k(&[0.5, 0.9, 0.5, 0.9], 3),
            vec![(1, 0.9), (3, 0.9), (0, 0.5)]
        );
    }
}
