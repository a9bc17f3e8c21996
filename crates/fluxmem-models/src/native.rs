//! fluxmem's own CPU kernels for quantized weight matrices, on AVX-512 VNNI: Q8_0
//! ([`crate::q8`]), Q4_K ([`crate::q4k`]) and Q6_K ([`crate::q6k`]), and the driver that
//! shares a product out over candle's thread pool.
//!
//! candle runs these formats' matrix-vector products on AVX2 block dot products (`perf` put
//! most of a decode step in them and in converting the blocks' f16 scales), and its repacked
//! AVX-512 tiles for longer inputs take row lengths that are multiples of 256 only. Here each
//! matrix is repacked at load into tiles of 16 output rows, so that one `vpdpbusd` multiplies
//! 4 quants of each of the 16 rows by the same 4 input values (broadcast), and the inputs are
//! quantized once per product; a call runs up to 4 input rows against 2 tiles, the 8
//! accumulators independent chains. Every input row is computed by the same instructions
//! whatever its call-mates and whatever the thread count, so a prompt and a decode step, a batch
//! and a single sequence, compute a row the same way.

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

/// True when quantized matrices are repacked for these kernels: the CPU runs them
/// ([`cpu_has_kernel`]) and they are not turned off (`FLUXMEM_Q8_KERNEL=candle`, for
/// side-by-side benches: candle's kernels then run every format).
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        cpu_has_kernel() && !std::env::var("FLUXMEM_Q8_KERNEL").is_ok_and(|v| v == "candle")
    })
}

/// True when this CPU has AVX-512 with VNNI and byte/word instructions.
pub(crate) fn cpu_has_kernel() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vnni")
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

impl Native {
    /// The repacked matrix of `matmul` when it is a Q8_0, Q4_K or Q6_K matrix on the CPU and
    /// this CPU runs the kernels (they beat candle's at every input size measured,
    /// docs/models.md); `None` otherwise.
    pub(crate) fn of(matmul: &QMatMul) -> Result<Option<Arc<Native>>> {
        let QMatMul::QTensor(q) = matmul else {
            return Ok(None);
        };
        if !available() || !matches!(q.device(), Device::Cpu) {
            return Ok(None);
        }
        Ok(match q.dtype() {
            GgmlDType::Q8_0 => Some(Arc::new(Native::Q8(Q8Rows::from_qtensor(q)?))),
            GgmlDType::Q4K => Some(Arc::new(Native::Q4K(Q4KRows::from_qtensor(q)?))),
            GgmlDType::Q6K => Some(Arc::new(Native::Q6K(Q6KRows::from_qtensor(q)?))),
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
            candle_core::bail!(
                "an input of row length {row} for a quantized matrix of row length {k}"
            );
        }
        let values: Vec<f32> = xs
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?;
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
    pub(crate) fn quantize(
        values: &[f32],
        k: usize,
        sums: impl Fn(f32, &[i8]) -> [f32; 16],
    ) -> SuperInput {
        debug_assert!(k.is_multiple_of(SUPER));
        let supers = values.len() / SUPER;
        let mut input = SuperInput {
            quants: Vec::with_capacity(values.len()),
            scales: Vec::with_capacity(supers),
            sums: Vec::with_capacity(supers * 16),
        };
        for block in values.chunks_exact(SUPER) {
            let start = input.quants.len();
            let d = quantize_block(block, &mut input.quants);
            input.scales.push(d);
            input.sums.extend(sums(d, &input.quants[start..]));
        }
        input
    }

    /// Row `r`'s super-blocks `supers` (rows of `k` values).
    pub(crate) fn row(&self, r: usize, k: usize, supers: std::ops::Range<usize>) -> SuperRow<'_> {
        let first = r * (k / SUPER);
        let (a, b) = (first + supers.start, first + supers.end);
        SuperRow {
            quants: &self.quants[a * SUPER..b * SUPER],
            scales: &self.scales[a..b],
            sums: &self.sums[a * 16..b * 16],
        }
    }
}

/// Output rows per tile of the tiled kernels (the lanes of a 512-bit vector of f32 or i32).
pub(crate) const TILE: usize = 16;

/// Input rows a tiled kernel call runs at most.
pub(crate) const TILE_ROWS: usize = 4;

/// What a tiled kernel call gives: `[m * 2 + n]` is input row `m`'s 16 outputs of tile `n`.
pub(crate) type TileResults = [[f32; TILE]; 2 * TILE_ROWS];

/// One format's tiled kernel: its tiles and input rows, and the two ways to run them.
pub(crate) trait TileKernel {
    type Tile<'a>: Copy;
    type Row<'a>: Copy;

    /// One tile against one input row, one product at a time (the reference of the tests, and
    /// the kernel of CPUs without AVX-512 VNNI, which never repack: [`available`]).
    fn reference(w: Self::Tile<'_>, x: Self::Row<'_>) -> [f32; TILE];

    /// `M` input rows against `N` tiles into `results` ([`TileResults`]).
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VNNI.
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx512<const M: usize, const N: usize>(
        w: [Self::Tile<'_>; N],
        x: [Self::Row<'_>; M],
        results: &mut TileResults,
    );
}

/// Declares the format's kernel type `$kernel` and binds it to [`TileKernel`] with the calling
/// module's `Tile`, `Row`, `reference` (the weight-by-weight product) and `kernel_avx512` (its
/// `#[target_feature]` kernel, which a trait method cannot carry itself).
macro_rules! tile_kernel {
    ($kernel:ident) => {
        /// The format's kernel for [`run_unit`](crate::native::run_unit).
        struct $kernel;

        impl crate::native::TileKernel for $kernel {
            type Tile<'a> = Tile<'a>;
            type Row<'a> = Row<'a>;

            fn reference(w: Tile, x: Row) -> [f32; crate::native::TILE] {
                reference(w, x)
            }

            #[cfg(target_arch = "x86_64")]
            unsafe fn avx512<const M: usize, const N: usize>(
                w: [Tile; N],
                x: [Row; M],
                results: &mut crate::native::TileResults,
            ) {
                // SAFETY: the caller's.
                unsafe { kernel_avx512(w, x, results) }
            }
        }
    };
}
pub(crate) use tile_kernel;

/// `M` input rows against `N` tiles into `results`, on AVX-512 VNNI where the CPU has it.
fn kernel<'a, K: TileKernel, const M: usize, const N: usize>(
    w: [K::Tile<'a>; N],
    x: [K::Row<'a>; M],
    results: &mut TileResults,
) {
    #[cfg(target_arch = "x86_64")]
    if cpu_has_kernel() {
        // SAFETY: the CPU has the instructions the kernel is compiled for.
        return unsafe { K::avx512(w, x, results) };
    }
    for m in 0..M {
        for n in 0..N {
            results[m * 2 + n] = K::reference(w[n], x[m]);
        }
    }
}

/// A unit of [`drive_tiles`]: tile `w[0]` (and `w[1]` when `two`) against the first `count` of
/// the input rows `x`, with the kernel compiled for that many rows and tiles.
pub(crate) fn run_unit<'a, K: TileKernel>(
    w: [K::Tile<'a>; 2],
    two: bool,
    x: [K::Row<'a>; 4],
    count: usize,
    results: &mut TileResults,
) {
    let ([a, b], [x0, x1, x2, x3]) = (w, x);
    match (two, count) {
        (true, 4) => kernel::<K, 4, 2>([a, b], [x0, x1, x2, x3], results),
        (true, 3) => kernel::<K, 3, 2>([a, b], [x0, x1, x2], results),
        (true, 2) => kernel::<K, 2, 2>([a, b], [x0, x1], results),
        (true, _) => kernel::<K, 1, 2>([a, b], [x0], results),
        (false, 4) => kernel::<K, 4, 1>([a], [x0, x1, x2, x3], results),
        (false, 3) => kernel::<K, 3, 1>([a], [x0, x1, x2], results),
        (false, 2) => kernel::<K, 2, 1>([a], [x0, x1], results),
        (false, _) => kernel::<K, 1, 1>([a], [x0], results),
    }
}

/// Quantizes a block of values to int8 (appended to `quants`) as candle and llama.cpp do: the
/// scale max|x| / 127, each value rounded to the nearest of its multiples. Returns the scale.
pub(crate) fn quantize_block(block: &[f32], quants: &mut Vec<i8>) -> f32 {
    let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    quants.extend(block.iter().map(|&x| (x * id).round() as i8));
    d
}

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
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        (base as *mut f32).add((first + m) * out + start),
                        width,
                    )
                };
                dst.copy_from_slice(&results[m * 2 + n][..width]);
            }
        }
    };
    let units = pairs * groups;
    if candle_core::utils::get_num_threads() > 1 && out * k * rows >= PARALLEL_MACS {
        // candle's own thread pool, the one its operations between these products run on: a
        // second pool's threads would compete with its spinning workers for the cores.
        candle_core::utils::barrier_pool().execute_chunked(units, |range| range.for_each(run));
    } else {
        (0..units).for_each(run);
    }
    y
}
