//! The Q8_0 kernel ([`crate::native`]): input rows against a Q8_0 weight matrix, on AVX-512
//! VNNI.
//!
//! The weights are repacked at load into rows of int8 quants with f32 scales, and a pair of
//! 32-value blocks is one 512-bit `vpdpbusd` (the weight's magnitude times the input with the
//! weight's sign), one conversion and one fused multiply-add by the pair's two scales. Input
//! rows are quantized to Q8_0 as candle does (scale max|x| / 127, values rounded), so a result
//! differs from candle's by float rounding only: the scales stay f32 instead of f16, and the
//! products are summed in another order.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Result;

use crate::native::{cpu_has_kernel, drive};

/// Values per Q8_0 block.
const BLOCK: usize = 32;

/// Values of a row a kernel call covers ([`drive`]): 16 input rows' quants and expanded
/// scales (2 bytes a value) stay within a core's L1 cache.
const SLICE: usize = 1024;

/// Bytes of quants ahead of the kernel's loads that it asks the cache for.
const PREFETCH: usize = 1024;

/// A Q8_0 matrix (out, k) repacked for the kernel: per output row, its quants and the f32
/// scale of each block.
pub(crate) struct Q8Rows {
    out: usize,
    k: usize,
    quants: Vec<i8>,
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
        let blocks = out * k / BLOCK;
        if data.len() != blocks * BYTES {
            candle_core::bail!("a Q8_0 matrix of {out} x {k} holds {} bytes, not {}", data.len(), blocks * BYTES);
        }
        let mut quants = Vec::with_capacity(out * k);
        let mut scales = Vec::with_capacity(blocks);
        for block in data.chunks_exact(BYTES) {
            scales.push(half::f16::from_le_bytes([block[0], block[1]]).to_f32());
            quants.extend(block[2..].iter().map(|&b| b as i8));
        }
        Ok(Q8Rows { out, k, quants, scales })
    }

    /// (out, k).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out, self.k)
    }

    /// `rows` input rows of `k` values times the matrix: (rows, out).
    pub(crate) fn matmul(&self, values: &[f32], rows: usize) -> Vec<f32> {
        let (k, blocks) = (self.k, self.k / BLOCK);
        let (xq, xd, xe) = quantize(values, k);
        let row_bytes = k + blocks * 4;
        drive(self.out, rows, k, row_bytes, SLICE, |o, r, n, span| {
            let (b0, b1) = (span.start / BLOCK, span.end.div_ceil(BLOCK));
            let w = &self.quants[o * k + span.start..o * k + span.end];
            let ws = &self.scales[o * blocks + b0..o * blocks + b1];
            let x = |j: usize| &xq[(r + j) * k + span.start..(r + j) * k + span.end];
            let d = |j: usize| &xd[(r + j) * blocks + b0..(r + j) * blocks + b1];
            let e = |j: usize| &xe[((r + j) * blocks + b0) * 8..((r + j) * blocks + b1) * 8];
            if n == 4 {
                dot4(w, ws, [x(0), x(1), x(2), x(3)], [d(0), d(1), d(2), d(3)], [e(0), e(1), e(2), e(3)])
            } else {
                [dot(w, ws, x(0), d(0), e(0)), 0.0, 0.0, 0.0]
            }
        })
    }
}

/// Quantizes rows of `k` values to Q8_0 as candle does: per block of 32, the scale max|x| /
/// 127 and each value rounded to the nearest of its multiples (the scale kept as f32). Also
/// returns each scale repeated 8 times (the lanes a block's products land in, see `dot_avx512`).
fn quantize(values: &[f32], k: usize) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
    let mut quants = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(values.len() / BLOCK);
    debug_assert!(k % BLOCK == 0);
    for block in values.chunks_exact(BLOCK) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        scales.push(d);
        quants.extend(block.iter().map(|&x| (x * id).round() as i8));
    }
    let expanded = scales.iter().flat_map(|&d| [d; 8]).collect();
    (quants, scales, expanded)
}

/// The dot product of a weight row and an input row, both Q8_0 (quants and block scales;
/// `xe`: the input's scales, each repeated 8 times).
fn dot(w: &[i8], ws: &[f32], x: &[i8], xs: &[f32], xe: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if cpu_has_kernel() {
        // SAFETY: the CPU has the instructions the kernel is compiled for.
        return unsafe { dot_avx512(w, ws, [x], [xs], [xe])[0] };
    }
    let _ = xe;
    dot_scalar(w, ws, x, xs)
}

/// [`dot`] of one weight row with four input rows.
fn dot4(w: &[i8], ws: &[f32], x: [&[i8]; 4], xs: [&[f32]; 4], xe: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if cpu_has_kernel() {
        // SAFETY: the CPU has the instructions the kernel is compiled for.
        return unsafe { dot_avx512(w, ws, x, xs, xe) };
    }
    let _ = xe;
    [0, 1, 2, 3].map(|j| dot_scalar(w, ws, x[j], xs[j]))
}

/// The same dot product, one block at a time (the reference of the tests, and the odd last
/// block of the kernel).
fn dot_scalar(w: &[i8], ws: &[f32], x: &[i8], xs: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (b, (wb, xb)) in w.chunks_exact(BLOCK).zip(x.chunks_exact(BLOCK)).enumerate() {
        let d: i32 = wb.iter().zip(xb).map(|(&a, &c)| a as i32 * c as i32).sum();
        sum += ws[b] * xs[b] * d as f32;
    }
    sum
}

/// One weight row against `R` input rows. Per pair of blocks, the weights are loaded once:
/// their magnitudes (as unsigned bytes: -128 becomes 128), their signs, and their two scales
/// spread over the lanes the blocks' products land in (0-7, 8-15); per input row, one
/// `vpdpbusd` of the magnitudes with the input given the weights' signs, then the 16 sums
/// times the weight and input scales, added to the row's accumulator.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot_avx512<const R: usize>(w: &[i8], ws: &[f32], x: [&[i8]; R], xs: [&[f32]; R], xe: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let blocks = ws.len();
    let pairs = blocks / 2;
    let pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); R];
    for p in 0..pairs {
        // SAFETY: `w` and each `x` hold `blocks * 32` values, `ws` and each `xs` `blocks`
        // scales, each `xe` `blocks * 8`.
        // (Two scales as one unaligned 8-byte load: a row's scales start 4-byte aligned only.)
        let (wv, dw) = unsafe { (_mm512_loadu_si512(w.as_ptr().add(p * 2 * BLOCK) as *const _), _mm_castsi128_ps(_mm_loadl_epi64(ws.as_ptr().add(2 * p) as *const __m128i))) };
        // Ahead of the stream, as in the Q4_K kernel.
        _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(p * 2 * BLOCK + PREFETCH) as *const i8);
        let (magnitude, negative) = (_mm512_abs_epi8(wv), _mm512_movepi8_mask(wv));
        let dw = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(dw));
        for j in 0..R {
            let (xv, dx) = unsafe { (_mm512_loadu_si512(x[j].as_ptr().add(p * 2 * BLOCK) as *const _), _mm512_loadu_ps(xe[j].as_ptr().add(p * 16))) };
            let signed = _mm512_mask_sub_epi8(xv, negative, zero, xv);
            let sums = _mm512_dpbusd_epi32(zero, magnitude, signed);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw, dx), acc[j]);
        }
    }
    let mut out = [0f32; R];
    for j in 0..R {
        out[j] = _mm512_reduce_add_ps(acc[j]);
        if blocks % 2 == 1 {
            let last = blocks - 1;
            out[j] += dot_scalar(&w[last * BLOCK..], &ws[last..], &x[j][last * BLOCK..], &xs[j][last..]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::Native;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Tensor};

    /// The kernel against the block-by-block reference and against candle's own Q8_0 matmul,
    /// for 1 to 9 input rows, an even and an odd number of blocks, rows longer than a slice,
    /// and weights that reach -128.
    #[test]
    fn the_kernel_matches_the_reference_and_candle() {
        // Where the CPU lacks the instructions, `dot` is the reference itself: the comparison
        // with candle still runs.
        eprintln!("AVX-512 VNNI kernel on this CPU: {}", cpu_has_kernel());
        for (out, k) in [(40usize, 64usize), (33, 96), (70, 576), (12, SLICE + 96)] {
            let weights: Vec<f32> = (0..out * k).map(|i| ((i as f32 * 0.618).sin() * 3.0) + if i % 97 == 0 { -9.0 } else { 0.0 }).collect();
            let w_values = weights.clone();
            let w = Tensor::from_vec(weights, (out, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
            let candle = QMatMul::from_qtensor(q).unwrap();
            let native = match &candle {
                QMatMul::QTensor(q) => Native::Q8(Q8Rows::from_qtensor(q).unwrap()),
                _ => unreachable!("a quantized matrix"),
            };
            let Native::Q8(rows_of) = &native else { unreachable!("a Q8_0 matrix") };
            assert!(rows_of.quants.iter().any(|&v| v == -127 || v == -128), "weights reach the lowest quants");
            for rows in [1usize, 2, 5, 9] {
                let input: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.377).cos() * 2.0).collect();
                let xs = Tensor::from_vec(input.clone(), (rows, k), &Device::Cpu).unwrap();
                let got: Vec<Vec<f32>> = native.forward(&xs).unwrap().to_vec2().unwrap();
                let theirs: Vec<Vec<f32>> = candle_core::Module::forward(&candle, &xs).unwrap().to_vec2().unwrap();
                let (xq, xd, _) = quantize(&input, k);
                let blocks = k / BLOCK;
                for r in 0..rows {
                    for o in 0..out {
                        let reference = dot_scalar(&rows_of.quants[o * k..(o + 1) * k], &rows_of.scales[o * blocks..(o + 1) * blocks], &xq[r * k..(r + 1) * k], &xd[r * blocks..(r + 1) * blocks]);
                        let tolerance = 1e-4 * reference.abs().max(1.0);
                        assert!((got[r][o] - reference).abs() <= tolerance, "{out}x{k}, row {r}, output {o}: {} against {reference}", got[r][o]);
                        // candle keeps the input's scales as f16 (a relative error of 2^-11 on each
                        // block's products, 5e-4), against the size of the products summed.
                        let magnitude: f32 = (0..k).map(|i| (w_values[o * k + i] * input[r * k + i]).abs()).sum();
                        let loose = 2e-3 * magnitude.max(1.0);
                        assert!((got[r][o] - theirs[r][o]).abs() <= loose, "{out}x{k}, row {r}, output {o}: {} against candle's {}", got[r][o], theirs[r][o]);
                    }
                }
            }
        }
    }
}
