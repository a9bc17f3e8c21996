//! The Q8_0 kernel ([`crate::native`]): input rows against a Q8_0 weight matrix, on AVX-512
//! VNNI, for the matrices whose row length candle's own repacked tiles do not take (not a
//! multiple of 256: most of SmolLM2-135M's and Qwen2.5-0.5B's).
//!
//! The weights are repacked at load into tiles of 16 output rows: per 32-value block, 8 groups
//! of 4 values for each of the 16 rows (64 bytes, offset by 128 to make them unsigned), and
//! the 16 rows' f32 scales. One `vpdpbusd` of a group against an input row's 4 values (the same
//! 4 bytes in every lane) then gives 64 products for 16 outputs at once, with no horizontal
//! sums. A call runs up to 4 input rows against 2 tiles: each weight load serves 4 input rows
//! and each broadcast 2 tiles, and the 8 accumulators are independent chains. Per block and
//! (row, tile), the integer sums are converted, less 128 times the input block's sum of quants
//! (the offset), and added times the weight and input scales. Input rows are quantized to Q8_0
//! as candle does (scale max|x| / 127, values rounded), so a result differs from candle's by
//! float rounding only (candle keeps the input scales as f16).
//!
//! Every input row is computed by the same instructions whatever its tile-mates, so a batch
//! gives each sequence the bits it gets alone.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Result;

use crate::native::{drive_tiles, quantize_block, run_unit, TileResults, TILE};

/// Values per Q8_0 block.
const BLOCK: usize = 32;

/// A Q8_0 matrix (out, k) repacked in tiles of [`TILE`] output rows (the last tile padded
/// with zero rows).
pub(crate) struct Q8Rows {
    out: usize,
    k: usize,
    /// Per tile and block: `[group of 4 values][row][4 bytes]`, each quant plus 128.
    quants: Vec<u8>,
    /// Per tile and block: the 16 rows' scales.
    scales: Vec<f32>,
}

impl std::fmt::Debug for Q8Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q8Rows({} x {})", self.out, self.k)
    }
}

impl Q8Rows {
    pub(crate) fn from_qtensor(q: &QTensor) -> Result<Q8Rows> {
        let (out, k) = q.shape().dims2()?;
        if q.dtype() != GgmlDType::Q8_0 {
            candle_core::bail!("a {:?} matrix is not Q8_0", q.dtype());
        }
        if k == 0 || k % BLOCK != 0 {
            candle_core::bail!("a Q8_0 matrix of row length {k}, not a multiple of {BLOCK}");
        }
        let data = q.data()?;
        // A block: the scale as f16, then 32 quants.
        const BYTES: usize = 2 + BLOCK;
        let blocks = k / BLOCK;
        if data.len() != out * blocks * BYTES {
            candle_core::bail!(
                "a Q8_0 matrix of {out} x {k} holds {} bytes, not {}",
                data.len(),
                out * blocks * BYTES
            );
        }
        let tiles = out.div_ceil(TILE);
        // Padding rows: quants of 0 (128 offset) and scale 0.
        let mut quants = vec![128u8; tiles * blocks * BLOCK * TILE];
        let mut scales = vec![0f32; tiles * blocks * TILE];
        for o in 0..out {
            let (t, row) = (o / TILE, o % TILE);
            for b in 0..blocks {
                let block = &data[(o * blocks + b) * BYTES..(o * blocks + b + 1) * BYTES];
                let at = (t * blocks + b) * TILE;
                scales[at + row] = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
                let tile = &mut quants[at * BLOCK..(at + TILE) * BLOCK];
                for (i, &v) in block[2..].iter().enumerate() {
                    tile[(i / 4) * TILE * 4 + row * 4 + i % 4] = (v as i8 as i16 + 128) as u8;
                }
            }
        }
        Ok(Q8Rows {
            out,
            k,
            quants,
            scales,
        })
    }

    /// (out, k).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out, self.k)
    }

    /// `rows` input rows of `k` values times the matrix: (rows, out).
    pub(crate) fn matmul(&self, values: &[f32], rows: usize) -> Vec<f32> {
        let input = quantize(values, self.k);
        let blocks = self.k / BLOCK;
        let w = |t: usize| Tile {
            quants: &self.quants[t * blocks * BLOCK * TILE..(t + 1) * blocks * BLOCK * TILE],
            scales: &self.scales[t * blocks * TILE..(t + 1) * blocks * TILE],
        };
        drive_tiles(
            self.out,
            rows,
            self.k,
            |tile, first, count, two, results| {
                let rows = |m: usize| input.row(first + m.min(count - 1), blocks);
                let x = [rows(0), rows(1), rows(2), rows(3)];
                run_unit::<Q8>([w(tile), w(tile + two as usize)], two, x, count, results)
            },
        )
    }
}

/// A tile's blocks.
#[derive(Clone, Copy)]
struct Tile<'a> {
    quants: &'a [u8],
    scales: &'a [f32],
}

/// Input rows quantized to Q8_0.
struct Input {
    quants: Vec<i8>,
    /// Per block: the scale.
    scales: Vec<f32>,
    /// Per block: 128 times the sum of its quants (the weights' offset, taken back).
    offsets: Vec<f32>,
}

/// An input row's blocks.
#[derive(Clone, Copy)]
struct Row<'a> {
    quants: &'a [i8],
    scales: &'a [f32],
    offsets: &'a [f32],
}

impl Input {
    fn row(&self, r: usize, blocks: usize) -> Row<'_> {
        let (a, b) = (r * blocks, (r + 1) * blocks);
        Row {
            quants: &self.quants[a * BLOCK..b * BLOCK],
            scales: &self.scales[a..b],
            offsets: &self.offsets[a..b],
        }
    }
}

/// Quantizes rows of `k` values to Q8_0 as candle does: per block of 32, the scale max|x| /
/// 127 and each value rounded to the nearest of its multiples (the scale kept as f32).
fn quantize(values: &[f32], k: usize) -> Input {
    debug_assert!(k.is_multiple_of(BLOCK));
    let blocks = values.len() / BLOCK;
    let mut input = Input {
        quants: Vec::with_capacity(values.len()),
        scales: Vec::with_capacity(blocks),
        offsets: Vec::with_capacity(blocks),
    };
    for block in values.chunks_exact(BLOCK) {
        let start = input.quants.len();
        let d = quantize_block(block, &mut input.quants);
        input.scales.push(d);
        input
            .offsets
            .push(128.0 * input.quants[start..].iter().map(|&v| v as i32).sum::<i32>() as f32);
    }
    input
}

crate::native::tile_kernel!(Q8);

/// [`TileKernel::reference`].
fn reference(w: Tile, x: Row) -> [f32; TILE] {
    let mut out = [0f32; TILE];
    for (b, (&dx, &offset)) in x.scales.iter().zip(x.offsets).enumerate() {
        for (row, y) in out.iter_mut().enumerate() {
            let mut sum = 0i32;
            for i in 0..BLOCK {
                sum += w.quants[b * BLOCK * TILE + (i / 4) * TILE * 4 + row * 4 + i % 4] as i32
                    * x.quants[b * BLOCK + i] as i32;
            }
            *y += (sum as f32 - offset) * (w.scales[b * TILE + row] * dx);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn kernel_avx512<const M: usize, const N: usize>(
    w: [Tile; N],
    x: [Row; M],
    results: &mut TileResults,
) {
    use std::arch::x86_64::*;
    let blocks = x[0].scales.len();
    let mut acc = [[_mm512_setzero_ps(); N]; M];
    for b in 0..blocks {
        let mut sums = [[_mm512_setzero_si512(); N]; M];
        for g in 0..BLOCK / 4 {
            // SAFETY: each tile holds `blocks` blocks of 512 quant bytes and 16 scales, each
            // row `blocks` blocks of 32 quants, a scale and an offset.
            let weights: [__m512i; N] = std::array::from_fn(|n| unsafe {
                _mm512_loadu_si512(
                    w[n].quants.as_ptr().add(b * BLOCK * TILE + g * TILE * 4) as *const _
                )
            });
            for m in 0..M {
                let four = unsafe {
                    _mm512_set1_epi32(std::ptr::read_unaligned(
                        x[m].quants.as_ptr().add(b * BLOCK + g * 4) as *const i32,
                    ))
                };
                for n in 0..N {
                    sums[m][n] = _mm512_dpbusd_epi32(sums[m][n], weights[n], four);
                }
            }
        }
        let scales: [__m512; N] =
            std::array::from_fn(|n| unsafe { _mm512_loadu_ps(w[n].scales.as_ptr().add(b * TILE)) });
        for m in 0..M {
            let (dx, offset) = unsafe {
                (
                    _mm512_set1_ps(*x[m].scales.get_unchecked(b)),
                    _mm512_set1_ps(*x[m].offsets.get_unchecked(b)),
                )
            };
            for n in 0..N {
                let sum = _mm512_sub_ps(_mm512_cvtepi32_ps(sums[m][n]), offset);
                acc[m][n] = _mm512_fmadd_ps(sum, _mm512_mul_ps(scales[n], dx), acc[m][n]);
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
    use candle_core::{Device, Tensor};

    /// The kernel against the product of candle's dequantized weights with the quantized input,
    /// and against candle's own Q8_0 matmul, for 1 to 9 input rows (every count of rows a call
    /// takes), an odd and an even number of tiles with padded last tiles, and weights that reach
    /// -128; and a row's outputs alone equal its outputs among others.
    #[test]
    fn the_kernel_matches_the_reference_and_candle() {
        eprintln!("AVX-512 VNNI kernel on this CPU: {}", cpu_has_kernel());
        for (out, k) in [(40usize, 64usize), (33, 96), (70, 576), (12, 1120)] {
            let weights: Vec<f32> = (0..out * k)
                .map(|i| ((i as f32 * 0.618).sin() * 3.0) + if i % 97 == 0 { -9.0 } else { 0.0 })
                .collect();
            let w_values = weights.clone();
            let w = Tensor::from_vec(weights, (out, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
            let dequantized: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
            let candle = QMatMul::from_qtensor(q).unwrap();
            let native = match &candle {
                QMatMul::QTensor(q) => Native::Q8(Q8Rows::from_qtensor(q).unwrap()),
                _ => unreachable!("a quantized matrix"),
            };
            let Native::Q8(tiles) = &native else {
                unreachable!("a Q8_0 matrix")
            };
            assert!(
                tiles.quants.iter().any(|&v| v <= 1),
                "weights reach the lowest quants"
            );
            let mut alone: Vec<Vec<f32>> = Vec::new();
            for rows in [1usize, 2, 3, 5, 9] {
                let input: Vec<f32> = (0..rows * k)
                    .map(|i| (i as f32 * 0.377).cos() * 2.0)
                    .collect();
                let xs = Tensor::from_vec(input.clone(), (rows, k), &Device::Cpu).unwrap();
                let got: Vec<Vec<f32>> = native.forward(&xs).unwrap().to_vec2().unwrap();
                let theirs: Vec<Vec<f32>> = candle_core::Module::forward(&candle, &xs)
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                let quantized = quantize(&input, k);
                for r in 0..rows {
                    for o in 0..out {
                        let reference: f32 = (0..k)
                            .map(|i| {
                                dequantized[o][i]
                                    * quantized.quants[r * k + i] as f32
                                    * quantized.scales[(r * k + i) / BLOCK]
                            })
                            .sum();
                        let magnitude: f32 = (0..k)
                            .map(|i| (w_values[o * k + i] * input[r * k + i]).abs())
                            .sum();
                        assert!(
                            (got[r][o] - reference).abs() <= 1e-5 * magnitude.max(1.0),
                            "{out}x{k}, row {r}, output {o}: {} against {reference}",
                            got[r][o]
                        );
                        // candle keeps the input's scales as f16 (a relative error of 2^-11 on each
                        // block's products, 5e-4), against the size of the products summed.
                        let loose = 2e-3 * magnitude.max(1.0);
                        assert!(
                            (got[r][o] - theirs[r][o]).abs() <= loose,
                            "{out}x{k}, row {r}, output {o}: {} against candle's {}",
                            got[r][o],
                            theirs[r][o]
                        );
                    }
                }
                // The rows are the same inputs each time (a prefix of one sequence): row r's
                // outputs do not depend on how many rows came with it.
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
