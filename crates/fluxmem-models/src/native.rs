//! fluxmem's own CPU kernels for quantized weight matrices, on AVX-512 VNNI: Q8_0
//! ([`crate::q8`]) and Q4_K ([`crate::q4k`]), and the driver that shares a product out between
//! candle's thread pool and the core's cache.
//!
//! candle's kernels for these formats are AVX2 block dot products, one input row at a time;
//! `perf` put most of a decode step in them and in converting the blocks' f16 scales (56% and
//! 8% on the 135M model). Here the weights are repacked at load, the inputs are quantized once
//! per product, and each kernel runs one weight row against one or four input rows, every
//! input row computed by the same instructions whatever its tile-mates (so a batch gives each
//! sequence the bits it gets alone).

use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{Device, Result, Tensor};

use crate::q4k::Q4KRows;
use crate::q6k::Q6KRows;
use crate::q8::Q8Rows;

/// Weights per K-quant super-block (Q4_K, Q6_K).
pub(crate) const SUPER: usize = 256;

/// Multiply-adds below which a product runs on the calling thread alone.
const PARALLEL_MACS: usize = 1 << 20;

/// Input rows a task runs against its output rows at a time.
const ROW_TILE: usize = 16;

/// True when quantized matrices are repacked for these kernels: the CPU runs them
/// ([`cpu_has_kernel`]) and they are not turned off (`FLUXMEM_Q8_KERNEL=candle`, for
/// side-by-side benches: candle's kernels then run every format).
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| cpu_has_kernel() && !std::env::var("FLUXMEM_Q8_KERNEL").is_ok_and(|v| v == "candle"))
}

/// True when this CPU has AVX-512 with VNNI and byte/word instructions.
pub(crate) fn cpu_has_kernel() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// The formats the kernels run: [`Native::of`] says which a loaded matrix keeps.
pub(crate) fn runs(dtype: GgmlDType) -> bool {
    available() && matches!(dtype, GgmlDType::Q8_0 | GgmlDType::Q4K | GgmlDType::Q6K)
}

/// A weight matrix repacked for one of the kernels.
#[derive(Debug)]
pub(crate) enum Native {
    Q8(Q8Rows),
    Q4K(Q4KRows),
    Q6K(Q6KRows),
}

/// Which inputs a matrix's native copy takes: every input (candle's copy is then dropped), or
/// inputs of at most this many rows (candle's copy takes the others).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Takes {
    Every,
    AtMost(usize),
}

impl Native {
    /// The repacked matrix of `matmul`, and the inputs it should take, when this CPU runs the
    /// kernels and they beat candle's for the matrix (docs/models.md): a Q8_0 or Q4_K matrix
    /// (every input: candle's copy is dropped), a Q6_K matrix (single-row inputs, decode
    /// steps; candle's repacked tiles take the others). `None` otherwise.
    pub(crate) fn of(matmul: &QMatMul) -> Result<Option<(Arc<Native>, Takes)>> {
        let QMatMul::QTensor(q) = matmul else { return Ok(None) };
        if !available() || !matches!(q.device(), Device::Cpu) {
            return Ok(None);
        }
        let (_, k) = q.shape().dims2()?;
        Ok(match q.dtype() {
            GgmlDType::Q8_0 => Some((Arc::new(Native::Q8(Q8Rows::from_qtensor(q)?)), Takes::Every)),
            GgmlDType::Q4K => Some((Arc::new(Native::Q4K(Q4KRows::from_qtensor(q)?)), Takes::Every)),
            GgmlDType::Q6K if k % SUPER == 0 => Some((Arc::new(Native::Q6K(Q6KRows::from_qtensor(q)?)), Takes::AtMost(1))),
            _ => None,
        })
    }

    /// `xs` (.., k) times the matrix's transpose: (.., out).
    pub(crate) fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let (out, k) = match self {
            Native::Q8(m) => m.dims(),
            Native::Q4K(m) => m.dims(),
            Native::Q6K(m) => m.dims(),
        };
        let dims = xs.dims().to_vec();
        let row = *dims.last().unwrap_or(&0);
        if row != k {
            candle_core::bail!("an input of row length {row} for a quantized matrix of row length {k}");
        }
        let values: Vec<f32> = xs.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        let rows = values.len() / k.max(1);
        let mut shape = dims;
        *shape.last_mut().expect("a matrix input has dimensions") = out;
        if rows == 0 || out == 0 {
            return Tensor::zeros(shape, candle_core::DType::F32, xs.device());
        }
        let y = match self {
            Native::Q8(m) => m.matmul(&values, rows),
            Native::Q4K(m) => m.matmul(&values, rows),
            Native::Q6K(m) => m.matmul(&values, rows),
        };
        Tensor::from_vec(y, shape, xs.device())
    }
}

/// Runs a product of `rows` input rows and `out` weight rows of length `k`: `dot(o, r, n,
/// span)` gives the dot products of weight row `o` with input rows `r..r + n` (`n` is 1 or 4)
/// over the values `span`, and the spans of a row are added in order. Returns (rows, out).
///
/// A task takes a few weight rows (about 64 KB, at `row_bytes` a row) and runs them against
/// the input rows [`ROW_TILE`] at a time, one span of `slice` values at a time, so that its
/// weights and a tile of inputs stay in the core's cache while each is used many times (a
/// prompt's hundreds of rows against a 9,000-wide matrix do not fit it whole). `slice` is a
/// multiple of the format's block pair or super-block; the kernels take a shorter last span.
pub(crate) fn drive<F>(out: usize, rows: usize, k: usize, row_bytes: usize, slice: usize, dot: F) -> Vec<f32>
where
    F: Fn(usize, usize, usize, Range<usize>) -> [f32; 4] + Sync,
{
    let chunk = ((64 << 10) / row_bytes.max(1)).clamp(4, 256);
    // One or two input rows fit the cache whole: slicing would only make a task read its
    // weight rows as many short interleaved runs, which the prefetchers follow less well.
    let slice = if rows <= 2 { k.max(1) } else { slice.max(1) };
    // A small product costs less than waking another thread.
    let parallel = candle_core::utils::get_num_threads() > 1 && out * k * rows >= PARALLEL_MACS;
    // (output row, input row) results, transposed back below.
    let mut transposed = vec![0f32; out * rows];
    let run = |c: usize, part: &mut [f32]| {
        let first = c * chunk;
        let outputs = part.len() / rows;
        for start in (0..k).step_by(slice) {
            let span = start..(start + slice).min(k);
            for tile in (0..rows).step_by(ROW_TILE) {
                let end = (tile + ROW_TILE).min(rows);
                for i in 0..outputs {
                    let results = &mut part[i * rows..(i + 1) * rows];
                    let mut r = tile;
                    // Four input rows at a time share each load of the weights.
                    while r + 4 <= end {
                        let four = dot(first + i, r, 4, span.clone());
                        for (y, v) in results[r..r + 4].iter_mut().zip(four) {
                            *y += v;
                        }
                        r += 4;
                    }
                    for r in r..end {
                        results[r] += dot(first + i, r, 1, span.clone())[0];
                    }
                }
            }
        }
    };
    let tasks = out.div_ceil(chunk);
    if parallel {
        // candle's own thread pool, the one its operations between these products run on:
        // a second pool's threads would compete with its spinning workers for the cores.
        let base = transposed.as_mut_ptr() as usize;
        let len = transposed.len();
        candle_core::utils::barrier_pool().execute_chunked(tasks, |range| {
            for c in range {
                let (from, to) = (c * chunk * rows, ((c + 1) * chunk * rows).min(len));
                // SAFETY: task `c` alone writes the results of its output rows, `from..to`,
                // a range within `transposed`, which outlives the call.
                let part = unsafe { std::slice::from_raw_parts_mut((base as *mut f32).add(from), to - from) };
                run(c, part);
            }
        });
    } else {
        for (c, part) in transposed.chunks_mut(chunk * rows).enumerate() {
            run(c, part);
        }
    }
    let mut y = vec![0f32; rows * out];
    for o in 0..out {
        for r in 0..rows {
            y[r * out + o] = transposed[o * rows + r];
        }
    }
    y
}

/// Input rows quantized per super-block as llama.cpp's Q8_K is, for the K-quant kernels: one
/// scale `dx` = max|x| / 127 per 256 values, each value rounded to the nearest of its
/// multiples, and 16 lanes of sums of quants per super-block in the form the format's kernel
/// subtracts (its mins, or its offset).
pub(crate) struct SuperInput {
    quants: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<f32>,
}

/// A span of an input row's super-blocks.
#[derive(Clone, Copy)]
pub(crate) struct SuperRow<'a> {
    pub(crate) quants: &'a [i8],
    pub(crate) scales: &'a [f32],
    pub(crate) sums: &'a [f32],
}

impl SuperInput {
    /// Quantizes rows of `k` values (a multiple of [`SUPER`]); `sums(dx, quants)` gives a
    /// super-block's 16 lanes of sums.
    pub(crate) fn quantize(values: &[f32], k: usize, sums: impl Fn(f32, &[i8]) -> [f32; 16]) -> SuperInput {
        debug_assert!(k % SUPER == 0);
        let supers = values.len() / SUPER;
        let mut input = SuperInput { quants: Vec::with_capacity(values.len()), scales: Vec::with_capacity(supers), sums: Vec::with_capacity(supers * 16) };
        for block in values.chunks_exact(SUPER) {
            let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let start = input.quants.len();
            input.quants.extend(block.iter().map(|&x| (x * id).round() as i8));
            input.scales.push(d);
            input.sums.extend(sums(d, &input.quants[start..]));
        }
        input
    }

    /// Row `r`'s super-blocks `supers` (rows of `k` values).
    pub(crate) fn row(&self, r: usize, k: usize, supers: std::ops::Range<usize>) -> SuperRow<'_> {
        let first = r * (k / SUPER);
        let (a, b) = (first + supers.start, first + supers.end);
        SuperRow { quants: &self.quants[a * SUPER..b * SUPER], scales: &self.scales[a..b], sums: &self.sums[a * 16..b * 16] }
    }
}

/// Output rows per tile of the tiled kernels (the lanes of a 512-bit vector of f32 or i32).
pub(crate) const TILE: usize = 16;

/// Input rows a tiled kernel call runs at most.
pub(crate) const TILE_ROWS: usize = 4;

/// What a tiled kernel call gives: `[m * 2 + n]` is input row `m`'s 16 outputs of tile `n`.
pub(crate) type TileResults = [[f32; TILE]; 2 * TILE_ROWS];

/// Runs a product of `rows` input rows and `out` weight rows of length `k` held in tiles of
/// [`TILE`] rows: `unit(tile, first, count, two, results)` runs tile `tile` (and `tile + 1`
/// when `two`) against input rows `first..first + count` (1 to [`TILE_ROWS`]). Returns (rows,
/// out).
///
/// Consecutive units share their tiles, which stay in the core's cache while the input rows
/// stream by; every input row is computed by the same instructions whatever its unit-mates.
pub(crate) fn drive_tiles<F>(out: usize, rows: usize, k: usize, unit: F) -> Vec<f32>
where
    F: Fn(usize, usize, usize, bool, &mut TileResults) + Sync,
{
    let tiles = out.div_ceil(TILE);
    let (pairs, groups) = (tiles.div_ceil(2), rows.div_ceil(TILE_ROWS));
    let mut y = vec![0f32; rows * out];
    let base = y.as_mut_ptr() as usize;
    let run = |u: usize| {
        let (pair, group) = (u / groups, u % groups);
        let (tile, first) = (pair * 2, group * TILE_ROWS);
        let count = (rows - first).min(TILE_ROWS);
        let two = tile + 1 < tiles;
        let mut results = [[0f32; TILE]; 2 * TILE_ROWS];
        unit(tile, first, count, two, &mut results);
        for m in 0..count {
            for n in 0..1 + two as usize {
                let start = (tile + n) * TILE;
                let width = out.saturating_sub(start).min(TILE);
                // SAFETY: unit `u` alone writes these outputs (its tiles' columns of its input
                // rows), all within `y`, which outlives the units.
                let dst = unsafe { std::slice::from_raw_parts_mut((base as *mut f32).add((first + m) * out + start), width) };
                dst.copy_from_slice(&results[m * 2 + n][..width]);
            }
        }
    };
    let units = pairs * groups;
    if candle_core::utils::get_num_threads() > 1 && out * k * rows >= PARALLEL_MACS {
        // candle's thread pool, as in `drive`.
        candle_core::utils::barrier_pool().execute_chunked(units, |range| range.for_each(run));
    } else {
        (0..units).for_each(run);
    }
    y
}
