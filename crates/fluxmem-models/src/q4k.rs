//! The Q4_K kernel ([`crate::native`]): input rows against a Q4_K weight matrix (the bulk of
//! a Q4_K_M file) on AVX-512 VNNI, as stored: no requantizing, half the bytes of Q8_0 to read
//! per decode step.
//!
//! A Q4_K super-block holds 256 weights as 4-bit quants `q` in 8 sub-blocks of 32, each with a
//! 6-bit scale `sc` and min `m`, and two f16 factors: `w = d·sc·q − dmin·m`. At load the quants
//! are reordered so that the low nibbles of 64 bytes are 64 consecutive weights (two
//! sub-blocks) and the high nibbles the next 64, the scales and mins are unpacked to bytes and
//! the factors to f32 (152 bytes a super-block, against 144 in the file). An input row is
//! quantized per super-block as llama.cpp's Q8_K is (one scale, amax / 127; values rounded),
//! with each sub-block's sum of quants kept, so that a row's dot product is
//!
//! `dx · (d · Σ_j sc_j · Σ_{i∈j} q_i·x_i − dmin · Σ_j m_j · Σ_{i∈j} x_i)`:
//!
//! per 64 weights one `vpdpbusd` (the nibbles are the unsigned operand), one conversion and one
//! multiply-add by the two sub-blocks' `d·sc`, and per super-block the min term from the sums.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Result;

use crate::native::{cpu_has_kernel, drive, SuperInput, SuperRow as Row, SUPER};

/// Sub-blocks per super-block.
const SUBS: usize = 8;

/// Values of a row a kernel call covers ([`drive`]): 16 input rows' quants and sums (1.25
/// bytes a value) stay within a core's L1 cache.
const SLICE: usize = 1536;

/// Bytes of quants ahead of the kernel's loads that it asks the cache for.
const PREFETCH: usize = 1024;

/// A Q4_K matrix (out, k) repacked for the kernel.
pub(crate) struct Q4KRows {
    out: usize,
    k: usize,
    /// 128 bytes a super-block: byte `i` of half `h` holds weight `128h + i` in its low nibble
    /// and weight `128h + 64 + i` in its high nibble.
    quants: Vec<u8>,
    /// 16 bytes a super-block: the 8 sub-blocks' scales, then their mins.
    scales: Vec<u8>,
    /// 2 a super-block: `d`, `dmin`.
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
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
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
        let supers = out * k / SUPER;
        if data.len() != supers * BYTES {
            candle_core::bail!("a Q4_K matrix of {out} x {k} holds {} bytes, not {}", data.len(), supers * BYTES);
        }
        let mut quants = vec![0u8; supers * SUPER / 2];
        let mut scales = vec![0u8; supers * 2 * SUBS];
        let mut factors = vec![0f32; supers * 2];
        let parts = quants.chunks_exact_mut(SUPER / 2).zip(scales.chunks_exact_mut(2 * SUBS)).zip(factors.chunks_exact_mut(2));
        for (block, ((quants, scales), factors)) in data.chunks_exact(BYTES).zip(parts) {
            factors[0] = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
            factors[1] = half::f16::from_le_bytes([block[2], block[3]]).to_f32();
            for j in 0..SUBS {
                (scales[j], scales[SUBS + j]) = scale_min(j, &block[4..16]);
            }
            // The file's order: per 64 weights, 32 bytes whose low nibbles are the first 32;
            // here byte `i` of half `h` pairs weights `128h + i` and `128h + 64 + i`.
            let qs = &block[16..];
            let weight = |v: usize| {
                let byte = qs[32 * (v / 64) + v % 32];
                if v % 64 < 32 { byte & 0xF } else { byte >> 4 }
            };
            for h in 0..2 {
                for i in 0..64 {
                    quants[64 * h + i] = weight(128 * h + i) | (weight(128 * h + 64 + i) << 4);
                }
            }
        }
        Ok(Q4KRows { out, k, quants, scales, factors })
    }

    /// (out, k).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out, self.k)
    }

    /// `rows` input rows of `k` values times the matrix: (rows, out).
    pub(crate) fn matmul(&self, values: &[f32], rows: usize) -> Vec<f32> {
        let (k, supers) = (self.k, self.k / SUPER);
        let input = SuperInput::quantize(values, k, sums);
        let row_bytes = k / 2 + supers * 24;
        drive(self.out, rows, k, row_bytes, SLICE, |o, r, n, span| {
            let (s0, s1) = (o * supers + span.start / SUPER, o * supers + span.end / SUPER);
            let w = Weights { quants: &self.quants[s0 * 128..s1 * 128], scales: &self.scales[s0 * 16..s1 * 16], factors: &self.factors[s0 * 2..s1 * 2] };
            let x = |j: usize| input.row(r + j, k, span.start / SUPER..span.end / SUPER);
            if n == 4 {
                dot(&w, [x(0), x(1), x(2), x(3)])
            } else {
                let [one] = dot(&w, [x(0)]);
                [one, 0.0, 0.0, 0.0]
            }
        })
    }
}

/// A span of a weight row's super-blocks.
struct Weights<'a> {
    quants: &'a [u8],
    scales: &'a [u8],
    factors: &'a [f32],
}

/// A super-block's 16 lanes of input sums: 0 for the 8 lanes of the scales, then `dx` times
/// each sub-block's sum of quants (the lanes of the mins).
fn sums(dx: f32, quants: &[i8]) -> [f32; 16] {
    let mut lanes = [0f32; 16];
    for (lane, q) in lanes[SUBS..].iter_mut().zip(quants.chunks_exact(SUPER / SUBS)) {
        *lane = dx * q.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
    lanes
}

/// The dot products of a weight row's span with `R` input rows' spans.
fn dot<const R: usize>(w: &Weights, x: [Row<'_>; R]) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    if cpu_has_kernel() {
        // SAFETY: the CPU has the instructions the kernel is compiled for.
        return unsafe { dot_avx512(w, x) };
    }
    x.map(|x| dot_scalar(w, x))
}

/// The same, one weight at a time (the reference of the tests).
fn dot_scalar(w: &Weights, x: Row) -> f32 {
    let mut sum = 0f32;
    for s in 0..w.factors.len() / 2 {
        let (d, dmin) = (w.factors[2 * s], w.factors[2 * s + 1]);
        let q = &w.quants[s * 128..(s + 1) * 128];
        let mut products = 0f32;
        let mut mins = 0f32;
        for j in 0..SUBS {
            let (sc, m) = (w.scales[16 * s + j] as f32, w.scales[16 * s + 8 + j] as f32);
            let mut dot = 0i32;
            for v in 32 * j..32 * (j + 1) {
                let (h, i) = (v / 128, v % 128);
                let byte = q[64 * h + i % 64];
                let nibble = if i < 64 { byte & 0xF } else { byte >> 4 };
                dot += nibble as i32 * x.quants[s * SUPER + v] as i32;
            }
            products += d * sc * dot as f32;
            mins += dmin * m * x.sums[16 * s + 8 + j];
        }
        sum += x.scales[s] * products - mins;
    }
    sum
}

/// One weight row against `R` input rows. Per super-block the weights are set up once: the
/// four 64-weight nibble vectors, and `d·sc` (lanes 0-7) and `dmin·m` (lanes 8-15) as floats,
/// from which each step takes its two sub-blocks' scales (lanes 0-7 and 8-15). Per input row,
/// four steps of `vpdpbusd`, conversion and multiply-add, then the super-block's sum times
/// `dx` less the mins against the row's sub-block sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot_avx512<const R: usize>(w: &Weights, x: [Row; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let supers = w.factors.len() / 2;
    let low = _mm512_set1_epi8(0x0F);
    let zero = _mm512_setzero_si512();
    // Lanes 0-7 take element 0, lanes 8-15 element 1.
    let pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let step = |s: i32| _mm512_set_epi32(2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s);
    let steps = [step(0), step(1), step(2), step(3)];
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..supers {
        // SAFETY: `w` holds `supers` super-blocks (128 quant bytes, 16 scale bytes, 2 factors
        // each) and every row `supers` (256 quants, 1 scale, 16 sums each).
        let (qa, qb, sm, dd) = unsafe {
            (
                _mm512_loadu_si512(w.quants.as_ptr().add(b * 128) as *const _),
                _mm512_loadu_si512(w.quants.as_ptr().add(b * 128 + 64) as *const _),
                _mm_loadu_si128(w.scales.as_ptr().add(b * 16) as *const _),
                _mm_castsi128_ps(_mm_loadl_epi64(w.factors.as_ptr().add(b * 2) as *const __m128i)),
            )
        };
        // Ahead of the stream: the hardware prefetchers alone leave a decode step short of the
        // memory's bandwidth.
        _mm_prefetch::<_MM_HINT_T0>(w.quants.as_ptr().wrapping_add(b * 128 + PREFETCH) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(w.quants.as_ptr().wrapping_add(b * 128 + PREFETCH + 64) as *const i8);
        let nibbles = [_mm512_and_si512(qa, low), _mm512_and_si512(_mm512_srli_epi16(qa, 4), low), _mm512_and_si512(qb, low), _mm512_and_si512(_mm512_srli_epi16(qb, 4), low)];
        let factors = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(dd));
        let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm)), factors);
        let scales = steps.map(|s| _mm512_permutexvar_ps(s, scaled));
        for j in 0..R {
            let xq = x[j].quants.as_ptr();
            // SAFETY: as above.
            let load = |s: usize| unsafe { _mm512_loadu_si512(xq.add(b * SUPER + 64 * s) as *const _) };
            let mut sum = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, nibbles[0], load(0))), scales[0]);
            for s in 1..4 {
                sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, nibbles[s], load(s))), scales[s], sum);
            }
            // SAFETY: as above.
            let (dx, sums) = unsafe { (_mm512_set1_ps(*x[j].scales.get_unchecked(b)), _mm512_loadu_ps(x[j].sums.as_ptr().add(b * 16))) };
            acc[j] = _mm512_fnmadd_ps(scaled, sums, _mm512_fmadd_ps(sum, dx, acc[j]));
        }
    }
    acc.map(|a| _mm512_reduce_add_ps(a))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::Native;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module, Tensor};

    /// The kernel against the weight-by-weight reference and against candle's own Q4_K matmul,
    /// for 1 to 9 input rows and rows of one super-block to longer than a slice; and the
    /// repacked weights against candle's dequantization.
    #[test]
    fn the_kernel_matches_the_reference_and_candle() {
        eprintln!("AVX-512 VNNI kernel on this CPU: {}", cpu_has_kernel());
        for (out, k) in [(7usize, 256usize), (40, 512), (9, SLICE + 512)] {
            let weights: Vec<f32> = (0..out * k).map(|i| ((i as f32 * 0.618).sin() * 3.0) + if i % 97 == 0 { -9.0 } else { 0.0 } + (i / k) as f32 * 0.1).collect();
            let w = Tensor::from_vec(weights, (out, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
            let dequantized: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
            let candle = QMatMul::from_qtensor(q).unwrap();
            let QMatMul::QTensor(q) = &candle else { unreachable!("a quantized matrix") };
            let repacked = Q4KRows::from_qtensor(q).unwrap();
            // The repacked layout gives back candle's weights.
            for o in 0..out {
                for v in 0..k {
                    let (s, i) = (o * (k / SUPER) + v / SUPER, v % SUPER);
                    let byte = repacked.quants[s * 128 + 64 * (i / 128) + i % 64];
                    let nibble = if i % 128 < 64 { byte & 0xF } else { byte >> 4 };
                    let j = i / 32;
                    let value = repacked.factors[2 * s] * repacked.scales[16 * s + j] as f32 * nibble as f32 - repacked.factors[2 * s + 1] * repacked.scales[16 * s + 8 + j] as f32;
                    assert!((value - dequantized[o][v]).abs() <= 1e-5 * dequantized[o][v].abs().max(1.0), "{out}x{k}: weight ({o}, {v}) is {value}, candle's {}", dequantized[o][v]);
                }
            }
            let native = Native::Q4K(repacked);
            let Native::Q4K(repacked) = &native else { unreachable!("a Q4_K matrix") };
            for rows in [1usize, 2, 5, 9] {
                let input: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.377).cos() * 2.0).collect();
                let xs = Tensor::from_vec(input.clone(), (rows, k), &Device::Cpu).unwrap();
                let got: Vec<Vec<f32>> = native.forward(&xs).unwrap().to_vec2().unwrap();
                let theirs: Vec<Vec<f32>> = candle.forward(&xs).unwrap().to_vec2().unwrap();
                let quantized = SuperInput::quantize(&input, k, sums);
                let supers = k / SUPER;
                for r in 0..rows {
                    for o in 0..out {
                        let w = Weights { quants: &repacked.quants[o * supers * 128..(o + 1) * supers * 128], scales: &repacked.scales[o * supers * 16..(o + 1) * supers * 16], factors: &repacked.factors[o * supers * 2..(o + 1) * supers * 2] };
                        let reference = dot_scalar(&w, quantized.row(r, k, 0..supers));
                        let magnitude: f32 = (0..k).map(|i| (dequantized[o][i] * input[r * k + i]).abs()).sum();
                        assert!((got[r][o] - reference).abs() <= 1e-5 * magnitude.max(1.0), "{out}x{k}, row {r}, output {o}: {} against {reference}", got[r][o]);
                        // candle quantizes the input to Q8_K with another scale (-128 / the
                        // largest value): both are within the input's rounding of the exact product.
                        let exact: f32 = (0..k).map(|i| dequantized[o][i] * input[r * k + i]).sum();
                        let loose = 1e-2 * magnitude.max(1.0);
                        assert!((got[r][o] - exact).abs() <= loose, "{out}x{k}, row {r}, output {o}: {} against the exact {exact}", got[r][o]);
                        assert!((got[r][o] - theirs[r][o]).abs() <= loose, "{out}x{k}, row {r}, output {o}: {} against candle's {}", got[r][o], theirs[r][o]);
                    }
                }
            }
        }
    }
}
