//! Spherical k-means on candle tensors: k-means++ seeding, cosine on L2-normalised vectors,
//! deterministic for a seed, scored in blocks of rows so the score matrix stays bounded.

use candle_core::{DType, Device, Tensor};

use serde::{Deserialize, Serialize};

use crate::Result;

/// Rows scored per block.
pub const KMEANS_BLOCK_ROWS: usize = 4096;

/// How to cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KMeansOptions {
    /// Number of clusters; `None` is the reference rule M = max(1, floor(sqrt(n / 2))).
    pub clusters: Option<usize>,
    /// Seed of the k-means++ draws.
    pub seed: u64,
    /// Lloyd iterations at most per restart.
    pub max_iterations: usize,
    /// Independent seedings; the one with the highest total cosine to its centroids wins.
    pub restarts: usize,
    /// Above this many rows, mini-batch k-means (Sculley 2010): Lloyd on a seeded sample of
    /// this many rows gives the centroids, `mini_batch_iterations` batches of `batch_size`
    /// rows drawn from all of them refine them, and one pass assigns every row.
    pub mini_batch_above: usize,
    /// Rows per mini-batch.
    pub batch_size: usize,
    /// Mini-batches.
    pub mini_batch_iterations: usize,
}

impl Default for KMeansOptions {
    fn default() -> Self {
        KMeansOptions {
            clusters: None,
            seed: 0,
            max_iterations: 100,
            restarts: 4,
            mini_batch_above: 20_000,
            batch_size: 1024,
            mini_batch_iterations: 100,
        }
    }
}

/// A clustering.
#[derive(Debug, Clone, PartialEq)]
pub struct Clustering {
    /// Cluster of each row.
    pub assignment: Vec<usize>,
    /// Unit-length centroids, one per cluster.
    pub centroids: Vec<Vec<f32>>,
    /// Cosine of each row to its centroid.
    pub similarity: Vec<f32>,
    /// Sum of `similarity` (higher is tighter).
    pub cohesion: f64,
    /// Lloyd iterations run by the winning restart.
    pub iterations: usize,
}

impl Clustering {
    /// Rows of each cluster, most representative (closest to the centroid) first, ties by row.
    pub fn members(&self) -> Vec<Vec<usize>> {
        let mut members = vec![Vec::new(); self.centroids.len()];
        for (row, &cluster) in self.assignment.iter().enumerate() {
            members[cluster].push(row);
        }
        for rows in &mut members {
            rows.sort_by(|&a, &b| {
                self.similarity[b]
                    .total_cmp(&self.similarity[a])
                    .then(a.cmp(&b))
            });
        }
        members
    }
}

/// The reference number of clusters for `n` items: max(1, floor(sqrt(n / 2))).
pub fn auto_clusters(n: usize) -> usize {
    ((n as f64 / 2.0).sqrt().floor() as usize).max(1)
}

/// A small deterministic generator (SplitMix64) so seeding needs no extra dependency.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Clusters `vectors` (all of one dimension) on `device`. Zero vectors are allowed (they have
/// cosine 0 to everything). With fewer vectors than clusters, k is reduced to the count.
pub fn kmeans(
    vectors: &[Vec<f32>],
    options: &KMeansOptions,
    device: &Device,
) -> Result<Clustering> {
    let n = vectors.len();
    if n == 0 {
        return Ok(Clustering {
            assignment: Vec::new(),
            centroids: Vec::new(),
            similarity: Vec::new(),
            cohesion: 0.0,
            iterations: 0,
        });
    }
    let k = options
        .clusters
        .unwrap_or_else(|| auto_clusters(n))
        .clamp(1, n);
    if n > options.mini_batch_above.max(k) {
        return mini_batch(vectors, k, options, device);
    }
    let dim = vectors[0].len();
    let flat: Vec<f32> = vectors.iter().flat_map(|v| normalized(v)).collect();
    let matrix = Tensor::from_vec(flat.clone(), (n, dim), device)?;
    let mut best: Option<Clustering> = None;
    for restart in 0..options.restarts.max(1) {
        let mut rng = SplitMix64::new(
            options
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add(restart as u64),
        );
        let seeds = plus_plus(&matrix, &flat, dim, k, &mut rng, device)?;
        let clustering = lloyd(&matrix, &flat, dim, seeds, options.max_iterations, device)?;
        // Strictly better only, so the earliest restart wins ties: deterministic.
        if best
            .as_ref()
            .is_none_or(|b| clustering.cohesion > b.cohesion + 1e-9)
        {
            best = Some(clustering);
        }
    }
    Ok(best.expect("at least one restart ran"))
}

/// Mini-batch k-means over `vectors` (more than `options.mini_batch_above` of them) with `k`
/// clusters; deterministic for the seed. Clusters no row is finally assigned to are dropped.
fn mini_batch(
    vectors: &[Vec<f32>],
    k: usize,
    options: &KMeansOptions,
    device: &Device,
) -> Result<Clustering> {
    let n = vectors.len();
    let dim = vectors[0].len();
    let mut rng = SplitMix64::new(
        options
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(0x6d69_6e69),
    );
    // A seeded sample (partial Fisher-Yates), in row order, clustered exactly.
    let size = options.mini_batch_above.max(k).min(n);
    let mut order: Vec<usize> = (0..n).collect();
    for i in 0..size {
        let j = i + (rng.next_u64() % (n - i) as u64) as usize;
        order.swap(i, j);
    }
    let mut sample: Vec<usize> = order[..size].to_vec();
    sample.sort_unstable();
    let rows: Vec<Vec<f32>> = sample.iter().map(|&i| vectors[i].clone()).collect();
    let exact = KMeansOptions {
        clusters: Some(k),
        mini_batch_above: usize::MAX,
        ..options.clone()
    };
    let start = kmeans(&rows, &exact, device)?;
    let mut centroids = start.centroids;
    let mut counts = vec![0f64; centroids.len()];
    start.assignment.iter().for_each(|&c| counts[c] += 1.0);
    // Mini-batches: each row pulls its nearest centroid towards it with rate 1 / (rows seen).
    let flat: Vec<f32> = vectors.iter().flat_map(|v| normalized(v)).collect();
    let batch = options.batch_size.max(1);
    for _ in 0..options.mini_batch_iterations {
        let picks: Vec<usize> = (0..batch)
            .map(|_| (rng.next_u64() % n as u64) as usize)
            .collect();
        let rows: Vec<f32> = picks
            .iter()
            .flat_map(|&i| flat[i * dim..(i + 1) * dim].iter().copied())
            .collect();
        let block = Tensor::from_vec(rows, (batch, dim), device)?;
        let sims = similarities(&block, &centroids, dim, device)?;
        let mut touched = vec![false; centroids.len()];
        for (&row, scores) in picks.iter().zip(&sims) {
            let (best, _) = argmax(scores);
            counts[best] += 1.0;
            let rate = (1.0 / counts[best]) as f32;
            for (c, x) in centroids[best]
                .iter_mut()
                .zip(&flat[row * dim..(row + 1) * dim])
            {
                *c = (1.0 - rate) * *c + rate * x;
            }
            touched[best] = true;
        }
        for (centroid, touched) in centroids.iter_mut().zip(touched) {
            if touched {
                fluxmem_models::normalize(centroid);
            }
        }
    }
    // One assignment pass over every row; empty clusters are dropped.
    let matrix = Tensor::from_vec(flat, (n, dim), device)?;
    let sims = similarities(&matrix, &centroids, dim, device)?;
    let picked: Vec<(usize, f32)> = sims.iter().map(|row| argmax(row)).collect();
    let mut used = vec![false; centroids.len()];
    picked.iter().for_each(|&(c, _)| used[c] = true);
    let mut remap = vec![usize::MAX; centroids.len()];
    let mut kept = Vec::new();
    for (c, centroid) in centroids.into_iter().enumerate() {
        if used[c] {
            remap[c] = kept.len();
            kept.push(centroid);
        }
    }
    let assignment: Vec<usize> = picked.iter().map(|&(c, _)| remap[c]).collect();
    let similarity: Vec<f32> = picked.iter().map(|&(_, s)| s).collect();
    let cohesion = similarity.iter().map(|&s| s as f64).sum();
    Ok(Clustering {
        assignment,
        centroids: kept,
        similarity,
        cohesion,
        iterations: options.mini_batch_iterations,
    })
}

/// The normalised mean of `rows` of `vectors` (a group's centroid).
pub(crate) fn mean_direction(rows: &[usize], vectors: &[Vec<f32>]) -> Vec<f32> {
    let mut mean = vec![0f32; vectors[rows[0]].len()];
    for &r in rows {
        mean.iter_mut().zip(&vectors[r]).for_each(|(m, v)| *m += v);
    }
    fluxmem_models::normalize(&mut mean);
    mean
}

fn normalized(vector: &[f32]) -> Vec<f32> {
    let mut v = vector.to_vec();
    fluxmem_models::normalize(&mut v);
    v
}

/// Cosine of every row of `matrix` with each centroid: (n x k), computed in row blocks.
fn similarities(
    matrix: &Tensor,
    centroids: &[Vec<f32>],
    dim: usize,
    device: &Device,
) -> Result<Vec<Vec<f32>>> {
    let n = matrix.dim(0)?;
    let flat: Vec<f32> = centroids.iter().flatten().copied().collect();
    let centers = Tensor::from_vec(flat, (centroids.len(), dim), device)?.t()?;
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    while start < n {
        let len = KMEANS_BLOCK_ROWS.min(n - start);
        let block = matrix.narrow(0, start, len)?.matmul(&centers)?;
        out.extend(block.to_dtype(DType::F32)?.to_vec2::<f32>()?);
        start += len;
    }
    Ok(out)
}

/// k-means++: the first centre uniformly, then each next one with probability proportional to
/// the squared cosine distance (1 - cos) to the nearest chosen centre.
fn plus_plus(
    matrix: &Tensor,
    flat: &[f32],
    dim: usize,
    k: usize,
    rng: &mut SplitMix64,
    device: &Device,
) -> Result<Vec<Vec<f32>>> {
    let n = flat.len() / dim.max(1);
    let row = |i: usize| flat[i * dim..(i + 1) * dim].to_vec();
    let first = (rng.next_f64() * n as f64) as usize % n;
    let mut centers = vec![row(first)];
    let mut distance: Vec<f64> = similarities(matrix, &centers, dim, device)?
        .iter()
        .map(|s| (1.0 - s[0] as f64).max(0.0))
        .collect();
    while centers.len() < k {
        let weights: Vec<f64> = distance.iter().map(|d| d * d).collect();
        let total: f64 = weights.iter().sum();
        let pick = if total <= 0.0 {
            // Every point coincides with a centre: take the first row not yet a centre.
            centers.len() % n
        } else {
            let mut target = rng.next_f64() * total;
            let mut chosen = n - 1;
            for (i, w) in weights.iter().enumerate() {
                if target < *w {
                    chosen = i;
                    break;
                }
                target -= w;
            }
            chosen
        };
        let center = row(pick);
        let sims = similarities(matrix, std::slice::from_ref(&center), dim, device)?;
        for (d, s) in distance.iter_mut().zip(sims) {
            *d = d.min((1.0 - s[0] as f64).max(0.0));
        }
        centers.push(center);
    }
    Ok(centers)
}

/// Lloyd iterations: assign to the most similar centroid, recompute centroids as normalised
/// means (a one-hot matrix product per block), until the assignment is stable.
fn lloyd(
    matrix: &Tensor,
    flat: &[f32],
    dim: usize,
    mut centroids: Vec<Vec<f32>>,
    max_iterations: usize,
    device: &Device,
) -> Result<Clustering> {
    let n = flat.len() / dim.max(1);
    let k = centroids.len();
    let mut assignment = vec![usize::MAX; n];
    let mut similarity = vec![0f32; n];
    let mut iterations = 0;
    loop {
        let sims = similarities(matrix, &centroids, dim, device)?;
        let mut changed = false;
        for (i, row) in sims.iter().enumerate() {
            let (best, score) = argmax(row);
            similarity[i] = score;
            if assignment[i] != best {
                assignment[i] = best;
                changed = true;
            }
        }
        if !changed || iterations >= max_iterations {
            break;
        }
        iterations += 1;
        centroids = update(matrix, &assignment, &similarity, k, dim, device)?;
    }
    let cohesion = similarity.iter().map(|&s| s as f64).sum();
    Ok(Clustering {
        assignment,
        centroids,
        similarity,
        cohesion,
        iterations,
    })
}

/// The index and value of the highest score (ties to the first).
pub(crate) fn argmax(row: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    for (j, &s) in row.iter().enumerate() {
        if s > best.1 {
            best = (j, s);
        }
    }
    best
}

/// New centroids: the normalised sum of each cluster's rows. An empty cluster takes the row
/// farthest from its own centroid (lowest similarity, ties by index), so k stays fixed.
fn update(
    matrix: &Tensor,
    assignment: &[usize],
    similarity: &[f32],
    k: usize,
    dim: usize,
    device: &Device,
) -> Result<Vec<Vec<f32>>> {
    let n = assignment.len();
    let mut sums = Tensor::zeros((k, dim), DType::F32, device)?;
    let mut start = 0;
    while start < n {
        let len = KMEANS_BLOCK_ROWS.min(n - start);
        let mut one_hot = vec![0f32; k * len];
        for (offset, &cluster) in assignment[start..start + len].iter().enumerate() {
            one_hot[cluster * len + offset] = 1.0;
        }
        let one_hot = Tensor::from_vec(one_hot, (k, len), device)?;
        sums = (sums + one_hot.matmul(&matrix.narrow(0, start, len)?)?)?;
        start += len;
    }
    let mut centroids: Vec<Vec<f32>> = sums.to_vec2::<f32>()?;
    let mut counts = vec![0usize; k];
    assignment.iter().for_each(|&c| counts[c] += 1);
    let mut taken: Vec<usize> = Vec::new();
    for cluster in 0..k {
        if counts[cluster] == 0 {
            let mut order: Vec<usize> = (0..n).filter(|i| !taken.contains(i)).collect();
            order.sort_by(|&a, &b| similarity[a].total_cmp(&similarity[b]).then(a.cmp(&b)));
            if let Some(&row) = order.first() {
                taken.push(row);
                centroids[cluster] = matrix.get(row)?.to_vec1::<f32>()?;
            }
        }
        fluxmem_models::normalize(&mut centroids[cluster]);
    }
    Ok(centroids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_rule_matches_the_reference() {
        assert_eq!(auto_clusters(0), 1);
        assert_eq!(auto_clusters(1), 1);
        assert_eq!(auto_clusters(24), 3);
        assert_eq!(auto_clusters(84), 6);
        assert_eq!(auto_clusters(200), 10);
    }

    #[test]
    fn splitmix_is_deterministic() {
        let (mut a, mut b) = (SplitMix64::new(7), SplitMix64::new(7));
        let draws: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        assert_eq!(draws, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_ne!(draws[0], draws[1]);
        assert!((0..1000)
            .map(|_| a.next_f64())
            .all(|x| (0.0..1.0).contains(&x)));
    }

    /// Four separable groups of 1,500 rows, clustered by mini-batch k-means (sample of 400,
    /// batches of 128): every group is one cluster, as exact k-means finds, and the same seed
    /// gives the same clustering.
    #[test]
    fn mini_batch_recovers_separable_clusters_deterministically() {
        let mut rng = SplitMix64::new(3);
        let vectors: Vec<Vec<f32>> = (0..1500)
            .map(|i| (0..16).map(|d| if d == (i % 4) * 4 { 1.0 } else { 0.0 } + 0.2 * (rng.next_f64() as f32 - 0.5)).collect())
            .collect();
        let options = KMeansOptions {
            clusters: Some(4),
            seed: 11,
            mini_batch_above: 400,
            batch_size: 128,
            mini_batch_iterations: 30,
            ..Default::default()
        };
        let fast = kmeans(&vectors, &options, &Device::Cpu).unwrap();
        assert_eq!(fast.centroids.len(), 4);
        for group in 0..4 {
            let clusters: std::collections::BTreeSet<usize> = (0..1500)
                .filter(|i| i % 4 == group)
                .map(|i| fast.assignment[i])
                .collect();
            assert_eq!(clusters.len(), 1, "group {group} is split: {clusters:?}");
        }
        assert_eq!(
            kmeans(&vectors, &options, &Device::Cpu).unwrap(),
            fast,
            "deterministic"
        );
        let exact = kmeans(
            &vectors,
            &KMeansOptions {
                mini_batch_above: usize::MAX,
                ..options.clone()
            },
            &Device::Cpu,
        )
        .unwrap();
        assert!(
            (fast.cohesion - exact.cohesion).abs() < 0.01 * exact.cohesion,
            "{} vs exact {}",
            fast.cohesion,
            exact.cohesion
        );
    }

    #[test]
    fn more_clusters_than_rows_and_zero_vectors_do_not_panic() {
        let vectors = vec![vec![0.0, 0.0], vec![1.0, 0.0]];
        let options = KMeansOptions {
            clusters: Some(5),
            ..Default::default()
        };
        let clustering = kmeans(&vectors, &options, &Device::Cpu).unwrap();
        assert_eq!(clustering.centroids.len(), 2);
        assert!(clustering.similarity.iter().all(|s| s.is_finite()));
        assert!(kmeans(&[], &options, &Device::Cpu)
            .unwrap()
            .assignment
            .is_empty());
    }
}
