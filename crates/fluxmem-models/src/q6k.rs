//! The Q6_K kernel ([`crate::native`]): single input rows against a Q6_K weight matrix (the
//! output projection and about half the feed-forward down projections of a Q4_K_M file) on
//! AVX-512 VNNI. candle runs a Q6_K matrix-vector product on an AVX2 block dot product (its
//! repacked tiles take two rows or more), which `perf` put at 20% of the 1.5B's decode step,
//! as much as all of its Q4_K matrices.
//!
//! A Q6_K super-block holds 256 weights as 6-bit quants `u` (0..63) in 16 sub-blocks of 16,
//! each with an int8 scale `sc`, and one f16 factor: `w = d·sc·(u − 32)`. At load the low 4
//! bits are laid out as [`crate::q4k`]'s nibbles (64 consecutive weights in the low nibbles
//! of 64 bytes, the next 64 in the high nibbles), the top 2 bits as a plane of 64 bytes whose
//! bits `2s, 2s + 1` are those of weights `64s..64s + 63`, the scales stay bytes and `d`
//! becomes f32 (212 bytes a super-block, against 210 in the file). With the input quantized
//! per super-block (`dx`, [`SuperInput`]) a row's dot product is
//!
//! `dx · Σ_j d·sc_j · Σ_{i∈j} u_i·x_i − Σ_j d·sc_j · 32·dx·Σ_{i∈j} x_i`:
//!
//! per 64 weights one `vpdpbusd` (the 6-bit quants are the unsigned operand), one conversion
//! and one multiply-add by the four sub-blocks' `d·sc`, and per super-block the offset term.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Result;

use crate::native::{cpu_has_kernel, drive, SuperInput, SuperRow as Row, SUPER};

/// Sub-blocks per super-block.
const SUBS: usize = 16;

/// Values of a row a kernel call covers ([`drive`]).
const SLICE: usize = 1536;

/// Bytes of low bits ahead of the kernel's loads that it asks the cache for (half as many of
/// the high bits).
const PREFETCH: usize = 1024;

/// A Q6_K matrix (out, k) repacked for the kernel.
pub(crate) struct Q6KRows {
    out: usize,
    k: usize,
    /// 128 bytes a super-block: byte `i` of half `h` holds the low 4 bits of weight `128h + i`
    /// in its low nibble and of weight `128h + 64 + i` in its high nibble.
    low: Vec<u8>,
    /// 64 bytes a super-block: bits `2s, 2s + 1` of byte `i` are the top 2 bits of weight
    /// `64s + i`.
    high: Vec<u8>,
    /// 16 a super-block.
    scales: Vec<i8>,
    /// 1 a super-block: `d`.
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
        let supers = out * k / SUPER;
        if data.len() != supers * BYTES {
            candle_core::bail!("a Q6_K matrix of {out} x {k} holds {} bytes, not {}", data.len(), supers * BYTES);
        }
        let mut low = vec![0u8; supers * SUPER / 2];
        let mut high = vec![0u8; supers * SUPER / 4];
        let mut scales = vec![0i8; supers * SUBS];
        let mut factors = vec![0f32; supers];
        let parts = low.chunks_exact_mut(SUPER / 2).zip(high.chunks_exact_mut(SUPER / 4)).zip(scales.chunks_exact_mut(SUBS)).zip(factors.iter_mut());
        for (block, (((low, high), scales), factor)) in data.chunks_exact(BYTES).zip(parts) {
            let (ql, qh) = (&block[..128], &block[128..192]);
            for (s, &b) in scales.iter_mut().zip(&block[192..208]) {
                *s = b as i8;
            }
            *factor = half::f16::from_le_bytes([block[208], block[209]]).to_f32();
            // The file's order (ggml's dequantize_row_q6_K): per 128 weights, 64 bytes of low
            // bits and 32 of high bits, in four runs of 32 weights.
            let quant = |v: usize| {
                let (n, w) = (v / 128, v % 128);
                let (g, l) = (w / 32, w % 32);
                let lo = ql[64 * n + l + 32 * (g % 2)];
                let lo = if g < 2 { lo & 0xF } else { lo >> 4 };
                lo | (((qh[32 * n + l] >> (2 * g)) & 3) << 4)
            };
            for h in 0..2 {
                for i in 0..64 {
                    low[64 * h + i] = (quant(128 * h + i) & 0xF) | ((quant(128 * h + 64 + i) & 0xF) << 4);
                }
            }
            for (i, byte) in high.iter_mut().enumerate() {
                *byte = (0..4).map(|s| (quant(64 * s + i) >> 4) << (2 * s)).sum();
            }
        }
        Ok(Q6KRows { out, k, low, high, scales, factors })
    }

    /// (out, k).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out, self.k)
    }

    /// `rows` input rows of `k` values times the matrix: (rows, out).
    pub(crate) fn matmul(&self, values: &[f32], rows: usize) -> Vec<f32> {
        let (k, supers) = (self.k, self.k / SUPER);
        let input = SuperInput::quantize(values, k, sums);
        let row_bytes = supers * 212;
        drive(self.out, rows, k, row_bytes, SLICE, |o, r, n, span| {
            let (s0, s1) = (o * supers + span.start / SUPER, o * supers + span.end / SUPER);
            let w = Weights { low: &self.low[s0 * 128..s1 * 128], high: &self.high[s0 * 64..s1 * 64], scales: &self.scales[s0 * SUBS..s1 * SUBS], factors: &self.factors[s0..s1] };
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

/// A super-block's 16 lanes of input sums: 32 (the quants' offset) times `dx` times each
/// sub-block's sum of quants.
fn sums(dx: f32, quants: &[i8]) -> [f32; 16] {
    let mut lanes = [0f32; 16];
    for (lane, q) in lanes.iter_mut().zip(quants.chunks_exact(SUPER / SUBS)) {
        *lane = 32.0 * dx * q.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
    lanes
}

/// A span of a weight row's super-blocks.
struct Weights<'a> {
    low: &'a [u8],
    high: &'a [u8],
    scales: &'a [i8],
    factors: &'a [f32],
}

impl Weights<'_> {
    /// Super-block `s`'s quant `v` (0..63).
    fn quant(&self, s: usize, v: usize) -> u8 {
        let byte = self.low[s * 128 + 64 * (v / 128) + v % 64];
        let low = if v % 128 < 64 { byte & 0xF } else { byte >> 4 };
        low | (((self.high[s * 64 + v % 64] >> (2 * (v / 64))) & 3) << 4)
    }
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
    for s in 0..w.factors.len() {
        let d = w.factors[s];
        let mut products = 0f32;
        let mut offsets = 0f32;
        for j in 0..SUBS {
            let sc = d * w.scales[SUBS * s + j] as f32;
            let dot: i32 = (16 * j..16 * (j + 1)).map(|v| w.quant(s, v) as i32 * x.quants[s * SUPER + v] as i32).sum();
            products += sc * dot as f32;
            offsets += sc * x.sums[16 * s + j];
        }
        sum += x.scales[s] * products - offsets;
    }
    sum
}

/// One weight row against `R` input rows. Per super-block the weights are set up once: the
/// four 64-weight vectors of 6-bit quants, and `d·sc` as 16 floats, from which each step takes
/// its four sub-blocks' scales (lanes 4 at a time). Per input row, four steps of `vpdpbusd`,
/// conversion and multiply-add, then the super-block's sum times `dx` less the offset term.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot_avx512<const R: usize>(w: &Weights, x: [Row<'_>; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let supers = w.factors.len();
    let low4 = _mm512_set1_epi8(0x0F);
    let low2 = _mm512_set1_epi8(0x03);
    let zero = _mm512_setzero_si512();
    // Step `s` takes sub-block `4s + lane / 4` for each lane.
    let step = |s: i32| _mm512_set_epi32(4 * s + 3, 4 * s + 3, 4 * s + 3, 4 * s + 3, 4 * s + 2, 4 * s + 2, 4 * s + 2, 4 * s + 2, 4 * s + 1, 4 * s + 1, 4 * s + 1, 4 * s + 1, 4 * s, 4 * s, 4 * s, 4 * s);
    let steps = [step(0), step(1), step(2), step(3)];
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..supers {
        // SAFETY: `w` holds `supers` super-blocks (128 low bytes, 64 high bytes, 16 scales, 1
        // factor each) and every row `supers` (256 quants, 1 scale, 16 sums each).
        let (qa, qb, qh, sc, d) = unsafe {
            (
                _mm512_loadu_si512(w.low.as_ptr().add(b * 128) as *const _),
                _mm512_loadu_si512(w.low.as_ptr().add(b * 128 + 64) as *const _),
                _mm512_loadu_si512(w.high.as_ptr().add(b * 64) as *const _),
                _mm_loadu_si128(w.scales.as_ptr().add(b * SUBS) as *const _),
                _mm512_set1_ps(*w.factors.get_unchecked(b)),
            )
        };
        // Ahead of the streams, as in the Q4_K kernel.
        _mm_prefetch::<_MM_HINT_T0>(w.low.as_ptr().wrapping_add(b * 128 + PREFETCH) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(w.low.as_ptr().wrapping_add(b * 128 + PREFETCH + 64) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(w.high.as_ptr().wrapping_add(b * 64 + PREFETCH / 2) as *const i8);
        let nibbles = [_mm512_and_si512(qa, low4), _mm512_and_si512(_mm512_srli_epi16(qa, 4), low4), _mm512_and_si512(qb, low4), _mm512_and_si512(_mm512_srli_epi16(qb, 4), low4)];
        let quants = [
            _mm512_or_si512(nibbles[0], _mm512_slli_epi16(_mm512_and_si512(qh, low2), 4)),
            _mm512_or_si512(nibbles[1], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2), low2), 4)),
            _mm512_or_si512(nibbles[2], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4), low2), 4)),
            _mm512_or_si512(nibbles[3], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 6), low2), 4)),
        ];
        let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), d);
        let scales = steps.map(|s| _mm512_permutexvar_ps(s, scaled));
        for j in 0..R {
            let xq = x[j].quants.as_ptr();
            // SAFETY: as above.
            let load = |s: usize| unsafe { _mm512_loadu_si512(xq.add(b * SUPER + 64 * s) as *const _) };
            let mut sum = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, quants[0], load(0))), scales[0]);
            for s in 1..4 {
                sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, quants[s], load(s))), scales[s], sum);
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

    /// The kernel against the weight-by-weight reference and against candle's own Q6_K matmul,
    /// for 1 to 9 input rows and rows of one super-block to longer than a slice; and the
    /// repacked weights against candle's dequantization.
    #[test]
    fn the_kernel_matches_the_reference_and_candle() {
        eprintln!("AVX-512 VNNI kernel on this CPU: {}", cpu_has_kernel());
        for (out, k) in [(7usize, 256usize), (40, 512), (9, SLICE + 512)] {
            let weights: Vec<f32> = (0..out * k).map(|i| ((i as f32 * 0.618).sin() * 3.0) + if i % 97 == 0 { -9.0 } else { 0.0 } + (i / k) as f32 * 0.1).collect();
            let w = Tensor::from_vec(weights, (out, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q6K).unwrap();
            let dequantized: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
            let candle = QMatMul::from_qtensor(q).unwrap();
            let QMatMul::QTensor(q) = &candle else { unreachable!("a quantized matrix") };
            let repacked = Q6KRows::from_qtensor(q).unwrap();
            let supers = k / SUPER;
            fn weights_of(m: &Q6KRows, o: usize, supers: usize) -> Weights<'_> {
                Weights { low: &m.low[o * supers * 128..(o + 1) * supers * 128], high: &m.high[o * supers * 64..(o + 1) * supers * 64], scales: &m.scales[o * supers * SUBS..(o + 1) * supers * SUBS], factors: &m.factors[o * supers..(o + 1) * supers] }
            }
            // The repacked layout gives back candle's weights.
            for o in 0..out {
                let w = weights_of(&repacked, o, supers);
                for v in 0..k {
                    let (s, i) = (v / SUPER, v % SUPER);
                    let value = w.factors[s] * w.scales[SUBS * s + i / 16] as f32 * (w.quant(s, i) as f32 - 32.0);
                    assert!((value - dequantized[o][v]).abs() <= 1e-5 * dequantized[o][v].abs().max(1.0), "{out}x{k}: weight ({o}, {v}) is {value}, candle's {}", dequantized[o][v]);
                }
            }
            let native = Native::Q6K(repacked);
            let Native::Q6K(repacked) = &native else { unreachable!("a Q6_K matrix") };
            for rows in [1usize, 2, 5, 9] {
                let input: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.377).cos() * 2.0).collect();
                let xs = Tensor::from_vec(input.clone(), (rows, k), &Device::Cpu).unwrap();
                let got: Vec<Vec<f32>> = native.forward(&xs).unwrap().to_vec2().unwrap();
                let theirs: Vec<Vec<f32>> = candle.forward(&xs).unwrap().to_vec2().unwrap();
                let quantized = SuperInput::quantize(&input, k, sums);
                for r in 0..rows {
                    for o in 0..out {
                        let reference = dot_scalar(&weights_of(repacked, o, supers), quantized.row(r, k, 0..supers));
                        let magnitude: f32 = (0..k).map(|i| (dequantized[o][i] * input[r * k + i]).abs()).sum();
                        assert!((got[r][o] - reference).abs() <= 1e-5 * magnitude.max(1.0), "{out}x{k}, row {r}, output {o}: {} against {reference}", got[r][o]);
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
