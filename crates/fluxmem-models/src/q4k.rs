//! The Q4_K kernel ([`crate::native`]): input rows against a Q4_K weight matrix (the bulk of
//! a Q4_K_M file) on AVX-512 VNNI, as stored: no requantizing, half the bytes of Q8_0 to read
//! per decode step.
//!
//! A Q4_K super-block holds 256 weights as 4-bit quants `q` in 8 sub-blocks of 32, each with a
//! 6-bit scale `sc` and min `m`, and two f16 factors: `w = d·sc·q − dmin·m`. At load the
//! matrix is repacked into tiles of 16 output rows, as [`crate::q8`]'s: per super-block, 32
//! groups of 8 weights for each of the 16 rows (4 bytes: weights `j` and `j + 4` of the group
//! in the low and high nibbles of byte `j`), the rows' scales and mins as bytes and their
//! factors as f32 (2,432 bytes for 16 x 256 weights, against 2,304 in the file). An input row
//! is quantized per super-block as llama.cpp's Q8_K is (one scale `dx`, amax / 127; values
//! rounded; [`SuperInput`]), so that a row's dot product is
//!
//! `dx · (d · Σ_j sc_j · Σ_{i∈j} q_i·x_i − dmin · Σ_j m_j · Σ_{i∈j} x_i)`:
//!
//! per group two `vpdpbusd` (the nibbles are the unsigned operand, against the input's 4
//! values broadcast to every lane) give 16 rows' products, and per sub-block the sums are
//! converted and added times `d·sc·dx`, less `dmin·m` times the sub-block's input sum. A call
//! runs up to 4 input rows against 2 tiles.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Result;

use crate::native::{drive_tiles, run_unit, SuperInput, SuperRow as Row, TileResults, SUPER, TILE};

/// Sub-blocks per super-block.
const SUBS: usize = 8;

/// Bytes of a tile's quants ahead of the kernel's loads that it asks the cache for.
const PREFETCH: usize = 1024;

/// Bytes of a tile's quants per super-block.
const TILE_QUANTS: usize = SUPER / 2 * TILE;

/// A Q4_K matrix (out, k) repacked in tiles of [`TILE`] output rows (the last tile padded with
/// zero rows).
pub(crate) struct Q4KRows {
    out: usize,
    k: usize,
    /// Per tile and super-block: `[group of 8 weights][row][4 bytes]`.
    quants: Vec<u8>,
    /// Per tile and super-block: `[sub-block][row]` scales, then `[sub-block][row]` mins.
    scales: Vec<u8>,
    /// Per tile and super-block: the 16 rows' `d`, then their `dmin`.
    factors: Vec<f32>,
}

impl std::fmt::Debug for Q4KRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q4KRows({} x {})", self.out, self.k)
    }
}

/// Sub-block `j`'s 6-bit scale and min from a super-block's 12 packed bytes (ggml's
/// `get_scale_min_k4`).
fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl Q4KRows {
    pub(crate) fn from_qtensor(q: &QTensor) -> Result<Q4KRows> {
        let (out, k) = q.shape().dims2()?;
        if q.dtype() != GgmlDType::Q4K {
            candle_core::bail!("a {:?} matrix is not Q4_K", q.dtype());
        }
        if k == 0 || k % SUPER != 0 {
            candle_core::bail!("a Q4_K matrix of row length {k}, not a multiple of {SUPER}");
        }
        let data = q.data()?;
        // A super-block: d and dmin as f16, 12 bytes of packed scales and mins, 128 of quants.
        const BYTES: usize = 4 + 12 + SUPER / 2;
        let supers = k / SUPER;
        if data.len() != out * supers * BYTES {
            candle_core::bail!(
                "a Q4_K matrix of {out} x {k} holds {} bytes, not {}",
                data.len(),
                out * supers * BYTES
            );
        }
        let tiles = out.div_ceil(TILE);
        let mut quants = vec![0u8; tiles * supers * TILE_QUANTS];
        let mut scales = vec![0u8; tiles * supers * 2 * SUBS * TILE];
        let mut factors = vec![0f32; tiles * supers * 2 * TILE];
        for o in 0..out {
            let (t, row) = (o / TILE, o % TILE);
            for s in 0..supers {
                let block = &data[(o * supers + s) * BYTES..(o * supers + s + 1) * BYTES];
                let at = t * supers + s;
                factors[at * 2 * TILE + row] =
                    half::f16::from_le_bytes([block[0], block[1]]).to_f32();
                factors[at * 2 * TILE + TILE + row] =
                    half::f16::from_le_bytes([block[2], block[3]]).to_f32();
                for j in 0..SUBS {
                    let (sc, m) = scale_min(j, &block[4..16]);
                    scales[at * 2 * SUBS * TILE + j * TILE + row] = sc;
                    scales[at * 2 * SUBS * TILE + (SUBS + j) * TILE + row] = m;
                }
                // The file's order: per 64 weights, 32 bytes whose low nibbles are the first 32.
                let qs = &block[16..];
                let weight = |v: usize| {
                    let byte = qs[32 * (v / 64) + v % 32];
                    if v % 64 < 32 {
                        byte & 0xF
                    } else {
                        byte >> 4
                    }
                };
                let tile = &mut quants[at * TILE_QUANTS..(at + 1) * TILE_QUANTS];
                for g in 0..SUPER / 8 {
                    for j in 0..4 {
                        tile[g * TILE * 4 + row * 4 + j] =
                            weight(8 * g + j) | (weight(8 * g + j + 4) << 4);
                    }
                }
            }
        }
        Ok(Q4KRows {
            out,
            k,
            quants,
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
            quants: &self.quants[a * TILE_QUANTS..b * TILE_QUANTS],
            scales: &self.scales[a * 2 * SUBS * TILE..b * 2 * SUBS * TILE],
            factors: &self.factors[a * 2 * TILE..b * 2 * TILE],
        }
    }

    /// `rows` input rows of `k` values times the matrix: (rows, out).
    pub(crate) fn matmul(&self, values: &[f32], rows: usize) -> Vec<f32> {
        let (k, supers) = (self.k, self.k / SUPER);
        let input = SuperInput::quantize(values, k, sums);
        drive_tiles(self.out, rows, k, |tile, first, count, two, results| {
            let rows = |m: usize| input.row(first + m.min(count - 1), k, 0..supers);
            let x = [rows(0), rows(1), rows(2), rows(3)];
            run_unit::<Q4K>(
                [self.tile(tile), self.tile(tile + two as usize)],
                two,
                x,
                count,
                results,
            )
        })
    }
}

/// A tile's super-blocks.
#[derive(Clone, Copy)]
struct Tile<'a> {
    quants: &'a [u8],
    scales: &'a [u8],
    factors: &'a [f32],
}

impl Tile<'_> {
    /// Row `row`'s weight `v` of super-block `s` as (quant, scale, min, d, dmin).
    fn weight(&self, s: usize, row: usize, v: usize) -> (u8, u8, u8, f32, f32) {
        let (g, j) = (v / 8, v % 8);
        let byte = self.quants[s * TILE_QUANTS + g * TILE * 4 + row * 4 + j % 4];
        let q = if j < 4 { byte & 0xF } else { byte >> 4 };
        let sub = v / 32;
        let scales = &self.scales[s * 2 * SUBS * TILE..];
        let factors = &self.factors[s * 2 * TILE..];
        (
            q,
            scales[sub * TILE + row],
            scales[(SUBS + sub) * TILE + row],
            factors[row],
            factors[TILE + row],
        )
    }
}

/// A super-block's 16 lanes of input sums: 0 for the 8 lanes of the scales, then `dx` times
/// each sub-block's sum of quants (the lanes of the mins).
fn sums(dx: f32, quants: &[i8]) -> [f32; 16] {
    let mut lanes = [0f32; 16];
    for (lane, q) in lanes[SUBS..]
        .iter_mut()
        .zip(quants.chunks_exact(SUPER / SUBS))
    {
        *lane = dx * q.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
    lanes
}

crate::native::tile_kernel!(Q4K);

/// [`TileKernel::reference`], one weight at a time.
fn reference(w: Tile, x: Row) -> [f32; TILE] {
    let mut out = [0f32; TILE];
    for s in 0..x.scales.len() {
        for (row, y) in out.iter_mut().enumerate() {
            let (mut products, mut mins) = (0f32, 0f32);
            for j in 0..SUBS {
                let (_, sc, m, d, dmin) = w.weight(s, row, 32 * j);
                let dot: i32 = (32 * j..32 * (j + 1))
                    .map(|v| w.weight(s, row, v).0 as i32 * x.quants[s * SUPER + v] as i32)
                    .sum();
                products += d * sc as f32 * dot as f32;
                mins += dmin * m as f32 * x.sums[16 * s + SUBS + j];
            }
            *y += x.scales[s] * products - mins;
        }
    }
    out
}

/// Per super-block and tile, the rows' `d` and `dmin`; per sub-block, its scales and mins as
/// floats times those; per group of 8 weights, the low and high nibbles against the input's
/// two broadcast groups of 4; per sub-block and (row, tile), the integer sums converted and
/// added times `d·sc·dx`, less `dmin·m` times the row's `dx·Σx`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn kernel_avx512<const M: usize, const N: usize>(
    w: [Tile; N],
    x: [Row<'_>; M],
    results: &mut TileResults,
) {
    use std::arch::x86_64::*;
    let supers = x[0].scales.len();
    let low = _mm512_set1_epi8(0x0F);
    let mut acc = [[_mm512_setzero_ps(); N]; M];
    for s in 0..supers {
        // SAFETY (every load below): each tile holds `supers` super-blocks (2,048 quant bytes,
        // 256 scale and min bytes, 32 factors), each row `supers` (256 quants, 1 scale, 16 sums).
        let d: [__m512; N] = std::array::from_fn(|n| unsafe {
            _mm512_loadu_ps(w[n].factors.as_ptr().add(s * 2 * TILE))
        });
        let dmin: [__m512; N] = std::array::from_fn(|n| unsafe {
            _mm512_loadu_ps(w[n].factors.as_ptr().add(s * 2 * TILE + TILE))
        });
        let dx: [__m512; M] =
            std::array::from_fn(|m| unsafe { _mm512_set1_ps(*x[m].scales.get_unchecked(s)) });
        for j in 0..SUBS {
            let mut sums = [[_mm512_setzero_si512(); N]; M];
            for gg in 0..4 {
                let g = 4 * j + gg;
                let at = s * TILE_QUANTS + g * TILE * 4;
                let packed: [__m512i; N] = std::array::from_fn(|n| unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(
                        w[n].quants.as_ptr().wrapping_add(at + PREFETCH) as *const i8
                    );
                    _mm512_loadu_si512(w[n].quants.as_ptr().add(at) as *const _)
                });
                let lo: [__m512i; N] = std::array::from_fn(|n| _mm512_and_si512(packed[n], low));
                let hi: [__m512i; N] =
                    std::array::from_fn(|n| _mm512_and_si512(_mm512_srli_epi16(packed[n], 4), low));
                for m in 0..M {
                    let xq = x[m].quants.as_ptr();
                    let (a, b) = unsafe {
                        (
                            _mm512_set1_epi32(std::ptr::read_unaligned(
                                xq.add(s * SUPER + 8 * g) as *const i32
                            )),
                            _mm512_set1_epi32(std::ptr::read_unaligned(
                                xq.add(s * SUPER + 8 * g + 4) as *const i32,
                            )),
                        )
                    };
                    for n in 0..N {
                        sums[m][n] = _mm512_dpbusd_epi32(
                            _mm512_dpbusd_epi32(sums[m][n], lo[n], a),
                            hi[n],
                            b,
                        );
                    }
                }
            }
            let bytes = |n: usize, at: usize| unsafe {
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                    w[n].scales.as_ptr().add(s * 2 * SUBS * TILE + at * TILE) as *const _,
                )))
            };
            let scale: [__m512; N] = std::array::from_fn(|n| _mm512_mul_ps(bytes(n, j), d[n]));
            let min: [__m512; N] =
                std::array::from_fn(|n| _mm512_mul_ps(bytes(n, SUBS + j), dmin[n]));
            for m in 0..M {
                let sum_x = unsafe { _mm512_set1_ps(*x[m].sums.get_unchecked(16 * s + SUBS + j)) };
                for n in 0..N {
                    acc[m][n] = _mm512_fnmadd_ps(
                        min[n],
                        sum_x,
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

    /// The kernel against the weight-by-weight reference and against candle's own Q4_K matmul,
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
            let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
            let dequantized: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
            let candle = QMatMul::from_qtensor(q).unwrap();
            let QMatMul::QTensor(q) = &candle else {
                unreachable!("a quantized matrix")
            };
            let repacked = Q4KRows::from_qtensor(q).unwrap();
            // The repacked layout gives back candle's weights.
            for (o, row) in dequantized.iter().enumerate() {
                let tile = repacked.tile(o / TILE);
                for (v, &expected) in row.iter().enumerate() {
                    let (q, sc, m, d, dmin) = tile.weight(v / SUPER, o % TILE, v % SUPER);
                    let value = d * sc as f32 * q as f32 - dmin * m as f32;
                    assert!(
                        (value - expected).abs() <= 1e-5 * expected.abs().max(1.0),
                        "{out}x{k}: weight ({o}, {v}) is {value}, candle's {expected}"
                    );
                }
            }
            let native = Native::Q4K(repacked);
            let Native::Q4K(repacked) = &native else {
                unreachable!("a Q4_K matrix")
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
                        // candle quantizes the input to Q8_K with another scale (-128 / the
                        // largest value): both are within the input's rounding of the exact product.
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
