//! The Q6_K kernel ([`crate::native`]): input rows against a Q6_K weight matrix (the output
//! projection and about half the feed-forward down projections of a Q4_K_M file) on AVX-512
//! VNNI. candle runs a Q6_K matrix-vector product on an AVX2 block dot product, which `perf`
//! put at 20% of the 1.5B's decode step, as much as all of its Q4_K matrices.
//!
//! A Q6_K super-block holds 256 weights as 6-bit quants `u` (0..63) in 16 sub-blocks of 16,
//! each with an int8 scale `sc`, and one f16 factor: `w = d·sc·(u − 32)`. At load the matrix
//! is repacked into tiles of 16 output rows, as [`crate::q4k`]'s: per super-block, the low 4
//! bits of 32 groups of 8 weights for each of the 16 rows (4 bytes: weights `j` and `j + 4` of
//! the group in the low and high nibbles of byte `j`), the top 2 bits of 16 groups of 16
//! weights (4 bytes a row: weights `j`, `j + 4`, `j + 8`, `j + 12` in bits 0-1, 2-3, 4-5, 6-7
//! of byte `j`), the rows' scales as bytes and their factors as f32 (3,392 bytes for 16 x 256
//! weights, against 3,360 in the file). With the input quantized per super-block (`dx`,
//! [`SuperInput`]) a row's dot product is
//!
//! `dx · Σ_j d·sc_j · Σ_{i∈j} u_i·x_i − Σ_j d·sc_j · 32·dx·Σ_{i∈j} x_i`:
//!
//! per sub-block four `vpdpbusd` (the 6-bit quants are the unsigned operand, against the
//! input's 4 values broadcast to every lane) give 16 rows' products, then the sums are
//! converted and added times `d·sc·dx`, less `d·sc` times the offset term. A call runs up to 4
//! input rows against 2 tiles.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Result;

use crate::native::{drive_tiles, run_unit, SuperInput, SuperRow as Row, TileResults, SUPER, TILE};

/// Sub-blocks per super-block.
const SUBS: usize = 16;

/// Bytes of a tile's low bits ahead of the kernel's loads that it asks the cache for (half as
/// many of its high bits).
const PREFETCH: usize = 1024;

/// Bytes of a tile's low bits per super-block.
const TILE_LOW: usize = SUPER / 2 * TILE;

/// Bytes of a tile's high bits per super-block.
const TILE_HIGH: usize = SUPER / 4 * TILE;

/// A Q6_K matrix (out, k) repacked in tiles of [`TILE`] output rows (the last tile padded
/// with zero rows).
pub(crate) struct Q6KRows {
    out: usize,
    k: usize,
    /// Per tile and super-block: `[group of 8 weights][row][4 bytes]`, the low 4 bits.
    low: Vec<u8>,
    /// Per tile and super-block: `[group of 16 weights][row][4 bytes]`, the top 2 bits.
    high: Vec<u8>,
    /// Per tile and super-block: `[sub-block][row]`.
    scales: Vec<i8>,
    /// Per tile and super-block: the 16 rows' `d`.
    factors: Vec<f32>,
}

impl std::fmt::Debug for Q6KRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q6KRows({} x {})", self.out, self.k)
    }
}

impl Q6KRows {
    pub(crate) fn from_qtensor(q: &QTensor) -> Result<Q6KRows> {
        let (out, k) = q.shape().dims2()?;
        if q.dtype() != GgmlDType::Q6K {
            candle_core::bail!("a {:?} matrix is not Q6_K", q.dtype());
        }
        if k == 0 || k % SUPER != 0 {
            candle_core::bail!("a Q6_K matrix of row length {k}, not a multiple of {SUPER}");
        }
        let data = q.data()?;
        // A super-block: 128 bytes of low bits, 64 of high bits, 16 scales, d as f16.
        const BYTES: usize = SUPER / 2 + SUPER / 4 + SUBS + 2;
        let supers = k / SUPER;
        if data.len() != out * supers * BYTES {
            candle_core::bail!(
                "a Q6_K matrix of {out} x {k} holds {} bytes, not {}",
                data.len(),
                out * supers * BYTES
            );
        }
        let tiles = out.div_ceil(TILE);
        let mut low = vec![0u8; tiles * supers * TILE_LOW];
        // Padding rows keep scale 0: zero weights.
        let mut high = vec![0u8; tiles * supers * TILE_HIGH];
        let mut scales = vec![0i8; tiles * supers * SUBS * TILE];
        let mut factors = vec![0f32; tiles * supers * TILE];
        for o in 0..out {
            let (t, row) = (o / TILE, o % TILE);
            for s in 0..supers {
                let block = &data[(o * supers + s) * BYTES..(o * supers + s + 1) * BYTES];
                let at = t * supers + s;
                let (ql, qh) = (&block[..128], &block[128..192]);
                for j in 0..SUBS {
                    scales[(at * SUBS + j) * TILE + row] = block[192 + j] as i8;
                }
                factors[at * TILE + row] =
                    half::f16::from_le_bytes([block[208], block[209]]).to_f32();
                // The file's order (ggml's dequantize_row_q6_K): per 128 weights, 64 bytes of
                // low bits and 32 of high bits, in four runs of 32 weights.
                let quant = |v: usize| {
                    let (n, w) = (v / 128, v % 128);
                    let (g, l) = (w / 32, w % 32);
                    let lo = ql[64 * n + l + 32 * (g % 2)];
                    let lo = if g < 2 { lo & 0xF } else { lo >> 4 };
                    lo | (((qh[32 * n + l] >> (2 * g)) & 3) << 4)
                };
                let tile = &mut low[at * TILE_LOW..(at + 1) * TILE_LOW];
                for g in 0..SUPER / 8 {
                    for j in 0..4 {
                        tile[g * TILE * 4 + row * 4 + j] =
                            (quant(8 * g + j) & 0xF) | ((quant(8 * g + j + 4) & 0xF) << 4);
                    }
                }
                let tile = &mut high[at * TILE_HIGH..(at + 1) * TILE_HIGH];
                for p in 0..SUPER / 16 {
                    for j in 0..4 {
                        tile[p * TILE * 4 + row * 4 + j] = (0..4)
                            .map(|i| (quant(16 * p + 4 * i + j) >> 4) << (2 * i))
                            .sum();
                    }
                }
            }
        }
        Ok(Q6KRows {
            out,
            k,
            low,
            high,
            scales,
            factors,
        })
    }

    /// (out, k).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out, self.k)
    }

    /// Tile `t`'s super-blocks.
    fn tile(&self, t: usize) -> Tile<'_> {
        let supers = self.k / SUPER;
        let (a, b) = (t * supers, (t + 1) * supers);
        Tile {
            low: &self.low[a * TILE_LOW..b * TILE_LOW],
            high: &self.high[a * TILE_HIGH..b * TILE_HIGH],
            scales: &self.scales[a * SUBS * TILE..b * SUBS * TILE],
            factors: &self.factors[a * TILE..b * TILE],
        }
    }

    /// `rows` input rows of `k` values times the matrix: (rows, out).
    pub(crate) fn matmul(&self, values: &[f32], rows: usize) -> Vec<f32> {
        let (k, supers) = (self.k, self.k / SUPER);
        let input = SuperInput::quantize(values, k, sums);
        drive_tiles(self.out, rows, k, |tile, first, count, two, results| {
            let rows = |m: usize| input.row(first + m.min(count - 1), k, 0..supers);
            let x = [rows(0), rows(1), rows(2), rows(3)];
            run_unit::<Q6K>(
                [self.tile(tile), self.tile(tile + two as usize)],
                two,
                x,
                count,
                results,
            )
        })
    }
}

/// A super-block's 16 lanes of input sums: 32 (the quants' offset) times `dx` times each
/// sub-block's sum of quants.
fn sums(dx: f32, quants: &[i8]) -> [f32; 16] {
    let mut lanes = [0f32; 16];
    for (lane, q) in lanes.iter_mut().zip(quants.chunks_exact(SUPER / SUBS)) {
        *lane = 32.0 * dx * q.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
    lanes
}

/// A tile's super-blocks.
#[derive(Clone, Copy)]
struct Tile<'a> {
    low: &'a [u8],
    high: &'a [u8],
    scales: &'a [i8],
    factors: &'a [f32],
}

impl Tile<'_> {
    /// Row `row`'s quant `v` (0..63) of super-block `s`, its sub-block's scale, and `d`.
    fn weight(&self, s: usize, row: usize, v: usize) -> (u8, i8, f32) {
        let (g, j) = (v / 8, v % 8);
        let byte = self.low[s * TILE_LOW + g * TILE * 4 + row * 4 + j % 4];
        let low = if j < 4 { byte & 0xF } else { byte >> 4 };
        let (p, i) = (v / 16, v % 16);
        let high = (self.high[s * TILE_HIGH + p * TILE * 4 + row * 4 + i % 4] >> (2 * (i / 4))) & 3;
        (
            low | (high << 4),
            self.scales[(s * SUBS + v / 16) * TILE + row],
            self.factors[s * TILE + row],
        )
    }
}

crate::native::tile_kernel!(Q6K);

/// [`TileKernel::reference`], one weight at a time.
fn reference(w: Tile, x: Row) -> [f32; TILE] {
    let mut out = [0f32; TILE];
    for s in 0..x.scales.len() {
        for (row, y) in out.iter_mut().enumerate() {
            let (mut products, mut offsets) = (0f32, 0f32);
            for j in 0..SUBS {
                let (_, sc, d) = w.weight(s, row, 16 * j);
                let sc = d * sc as f32;
                let dot: i32 = (16 * j..16 * (j + 1))
                    .map(|v| w.weight(s, row, v).0 as i32 * x.quants[s * SUPER + v] as i32)
                    .sum();
                products += sc * dot as f32;
                offsets += sc * x.sums[16 * s + j];
            }
            *y += x.scales[s] * products - offsets;
        }
    }
    out
}

/// Per super-block and tile, the rows' `d`; per sub-block (two groups of 8 weights), the four
/// runs of 4 weights' 6-bit quants (low nibbles joined with their top bits) against the
/// input's four broadcast groups of 4, then per (row, tile) the integer sums converted and
/// added times `d·sc·dx`, less `d·sc` times the row's `32·dx·Σx`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn kernel_avx512<const M: usize, const N: usize>(
    w: [Tile; N],
    x: [Row<'_>; M],
    results: &mut TileResults,
) {
    use std::arch::x86_64::*;
    let supers = x[0].scales.len();
    let low4 = _mm512_set1_epi8(0x0F);
    let top = _mm512_set1_epi8(0x30);
    let mut acc = [[_mm512_setzero_ps(); N]; M];
    for s in 0..supers {
        // SAFETY (every load below): each tile holds `supers` super-blocks (2,048 low bytes,
        // 1,024 high bytes, 256 scales, 16 factors), each row `supers` (256 quants, 1 scale, 16
        // sums).
        let d: [__m512; N] = std::array::from_fn(|n| unsafe {
            _mm512_loadu_ps(w[n].factors.as_ptr().add(s * TILE))
        });
        let dx: [__m512; M] =
            std::array::from_fn(|m| unsafe { _mm512_set1_ps(*x[m].scales.get_unchecked(s)) });
        for j in 0..SUBS {
            let (lo_at, hi_at) = (
                s * TILE_LOW + 2 * j * TILE * 4,
                s * TILE_HIGH + j * TILE * 4,
            );
            let quants: [[__m512i; 4]; N] = std::array::from_fn(|n| unsafe {
                _mm_prefetch::<_MM_HINT_T0>(
                    w[n].low.as_ptr().wrapping_add(lo_at + PREFETCH) as *const i8
                );
                _mm_prefetch::<_MM_HINT_T0>(
                    w[n].low.as_ptr().wrapping_add(lo_at + PREFETCH + 64) as *const i8
                );
                _mm_prefetch::<_MM_HINT_T0>(
                    w[n].high.as_ptr().wrapping_add(hi_at + PREFETCH / 2) as *const i8
                );
                let first = _mm512_loadu_si512(w[n].low.as_ptr().add(lo_at) as *const _);
                let second =
                    _mm512_loadu_si512(w[n].low.as_ptr().add(lo_at + TILE * 4) as *const _);
                let high = _mm512_loadu_si512(w[n].high.as_ptr().add(hi_at) as *const _);
                // Weights 0-3, 4-7 of the first group and 8-11, 12-15 of the second: the low
                // nibbles, then the high ones, each with its two top bits moved to bits 4-5.
                [
                    _mm512_or_si512(
                        _mm512_and_si512(first, low4),
                        _mm512_and_si512(_mm512_slli_epi16(high, 4), top),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(first, 4), low4),
                        _mm512_and_si512(_mm512_slli_epi16(high, 2), top),
                    ),
                    _mm512_or_si512(_mm512_and_si512(second, low4), _mm512_and_si512(high, top)),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(second, 4), low4),
                        _mm512_and_si512(_mm512_srli_epi16(high, 2), top),
                    ),
                ]
            });
            let mut sums = [[_mm512_setzero_si512(); N]; M];
            for m in 0..M {
                let xq = x[m].quants.as_ptr();
                let four = |i: usize| unsafe {
                    _mm512_set1_epi32(std::ptr::read_unaligned(
                        xq.add(s * SUPER + 16 * j + 4 * i) as *const i32
                    ))
                };
                let inputs = [four(0), four(1), four(2), four(3)];
                for n in 0..N {
                    for i in 0..4 {
                        sums[m][n] = _mm512_dpbusd_epi32(sums[m][n], quants[n][i], inputs[i]);
                    }
                }
            }
            let scale: [__m512; N] = std::array::from_fn(|n| unsafe {
                _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        w[n].scales.as_ptr().add((s * SUBS + j) * TILE) as *const _,
                    ))),
                    d[n],
                )
            });
            for m in 0..M {
                let offset = unsafe { _mm512_set1_ps(*x[m].sums.get_unchecked(16 * s + j)) };
                for n in 0..N {
                    acc[m][n] = _mm512_fnmadd_ps(
                        scale[n],
                        offset,
                        _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(sums[m][n]),
                            _mm512_mul_ps(scale[n], dx[m]),
                            acc[m][n],
                        ),
                    );
                }
            }
        }
    }
    for m in 0..M {
        for n in 0..N {
            // SAFETY: a result holds 16 floats.
            unsafe { _mm512_storeu_ps(results[m * 2 + n].as_mut_ptr(), acc[m][n]) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::{cpu_has_kernel, Native};
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module, Tensor};

    /// The kernel against the weight-by-weight reference and against candle's own Q6_K matmul,
    /// for 1 to 9 input rows (every count of rows a call takes), an odd and an even number of
    /// tiles with padded last tiles, and rows of one to eight super-blocks; the repacked weights
    /// against candle's dequantization; and a row's outputs alone equal its outputs among
    /// others.
    #[test]
    fn the_kernel_matches_the_reference_and_candle() {
        eprintln!("AVX-512 VNNI kernel on this CPU: {}", cpu_has_kernel());
        for (out, k) in [(7usize, 256usize), (40, 512), (33, 2048)] {
            let weights: Vec<f32> = (0..out * k)
                .map(|i| {
                    ((i as f32 * 0.618).sin() * 3.0)
                        + if i % 97 == 0 { -9.0 } else { 0.0 }
                        + (i / k) as f32 * 0.1
                })
                .collect();
            let w = Tensor::from_vec(weights, (out, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q6K).unwrap();
            let dequantized: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
            let candle = QMatMul::from_qtensor(q).unwrap();
            let QMatMul::QTensor(q) = &candle else {
                unreachable!("a quantized matrix")
            };
            let repacked = Q6KRows::from_qtensor(q).unwrap();
            // The repacked layout gives back candle's weights.
            for (o, row) in dequantized.iter().enumerate() {
                let tile = repacked.tile(o / TILE);
                for (v, &expected) in row.iter().enumerate() {
                    let (u, sc, d) = tile.weight(v / SUPER, o % TILE, v % SUPER);
                    let value = d * sc as f32 * (u as f32 - 32.0);
                    assert!(
                        (value - expected).abs() <= 1e-5 * expected.abs().max(1.0),
                        "{out}x{k}: weight ({o}, {v}) is {value}, candle's {expected}"
                    );
                }
            }
            let native = Native::Q6K(repacked);
            let Native::Q6K(repacked) = &native else {
                unreachable!("a Q6_K matrix")
            };
            let mut alone: Vec<Vec<f32>> = Vec::new();
            for rows in [1usize, 2, 3, 5, 9] {
                let input: Vec<f32> = (0..rows * k)
                    .map(|i| (i as f32 * 0.377).cos() * 2.0)
                    .collect();
                let xs = Tensor::from_vec(input.clone(), (rows, k), &Device::Cpu).unwrap();
                let got: Vec<Vec<f32>> = native.forward(&xs).unwrap().to_vec2().unwrap();
                let theirs: Vec<Vec<f32>> = candle.forward(&xs).unwrap().to_vec2().unwrap();
                let quantized = SuperInput::quantize(&input, k, sums);
                let supers = k / SUPER;
                for r in 0..rows {
                    for o in 0..out {
                        let reference = super::reference(
                            repacked.tile(o / TILE),
                            quantized.row(r, k, 0..supers),
                        )[o % TILE];
                        let magnitude: f32 = (0..k)
                            .map(|i| (dequantized[o][i] * input[r * k + i]).abs())
                            .sum();
                        assert!(
                            (got[r][o] - reference).abs() <= 1e-5 * magnitude.max(1.0),
                            "{out}x{k}, row {r}, output {o}: {} against {reference}",
                            got[r][o]
                        );
                        let exact: f32 = (0..k).map(|i| dequantized[o][i] * input[r * k + i]).sum();
                        let loose = 1e-2 * magnitude.max(1.0);
                        assert!(
                            (got[r][o] - exact).abs() <= loose,
                            "{out}x{k}, row {r}, output {o}: {} against the exact {exact}",
                            got[r][o]
                        );
                        assert!(
                            (got[r][o] - theirs[r][o]).abs() <= loose,
                            "{out}x{k}, row {r}, output {o}: {} against candle's {}",
                            got[r][o],
                            theirs[r][o]
                        );
                    }
                }
                // The rows are a prefix of one sequence: row 0's outputs do not depend on how
                // many rows came with it.
                if rows == 1 {
                    alone = got.clone();
                }
                assert_eq!(
                    got[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    alone[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{out}x{k}: row 0 among {rows}"
                );
            }
        }
    }
}
