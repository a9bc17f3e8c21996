//! fluxmem's quantized kernels against candle's, one matrix at a time, on the same QTensor and
//! the same threads: multiply-adds per second (GMAC/s) for 1, 4, 64 and 256 input rows, and
//! for one input row streaming 24 copies of the matrix (too large for the cache: a decode
//! step's regime) the file bytes read per second. Prints one table with the ratios.
//!
//! RAYON_NUM_THREADS=2 cargo run -p fluxmem-models --example kernel_bench [-- q8:8960x1536,q4k:1536x1536,...]

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use fluxmem_models::NativeMatrix;
use std::time::Instant;

const DEFAULT: &str = "q8:4864x896,q8:8960x1536,q8:151936x1536,q4k:8960x1536,q4k:1536x8960,q4k:1536x1536,q6k:1536x8960,q6k:151936x1536";

fn main() -> anyhow::Result<()> {
    fluxmem_models::tune_thread_pool();
    let shapes = std::env::args().nth(1).unwrap_or_else(|| DEFAULT.into());
    println!(
        "threads {}; GMAC/s fluxmem / candle (ratio)",
        candle_core::utils::get_num_threads()
    );
    println!("| matrix | rows 1 | rows 4 | rows 64 | rows 256 | streaming, 1 row, GB/s |");
    println!("|---|---|---|---|---|---|");
    for shape in shapes.split(',') {
        let (kind, dims) = shape
            .split_once(':')
            .ok_or_else(|| anyhow::anyhow!("`{shape}`: expected KIND:OUTxK"))?;
        let dtype = match kind {
            "q8" => GgmlDType::Q8_0,
            "q4k" => GgmlDType::Q4K,
            "q6k" => GgmlDType::Q6K,
            other => anyhow::bail!("`{other}`: expected q8, q4k or q6k"),
        };
        let (out, k) = dims
            .split_once('x')
            .ok_or_else(|| anyhow::anyhow!("`{dims}`: expected OUTxK"))?;
        let (out, k): (usize, usize) = (out.parse()?, k.parse()?);
        let w: Vec<f32> = (0..out * k).map(|i| (i as f32 * 0.618).sin()).collect();
        let w = Tensor::from_vec(w, (out, k), &Device::Cpu)?;
        let quantized = || -> anyhow::Result<QMatMul> {
            Ok(QMatMul::from_qtensor(QTensor::quantize(&w, dtype)?)?)
        };
        let candle = quantized()?;
        let Some(native) = NativeMatrix::of(&candle)? else {
            anyhow::bail!("this CPU does not run fluxmem's kernels (AVX-512 VNNI), or FLUXMEM_Q8_KERNEL=candle is set");
        };
        let mut row = format!("| {kind} {out} x {k} |");
        for rows in [1usize, 4, 64, 256] {
            let x = Tensor::from_vec(
                (0..rows * k)
                    .map(|i| (i as f32 * 0.3).cos())
                    .collect::<Vec<f32>>(),
                (rows, k),
                &Device::Cpu,
            )?;
            let reps = (2_000_000_000 / (out * k * rows)).clamp(2, 300);
            let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> anyhow::Result<f64> {
                f()?;
                let started = Instant::now();
                for _ in 0..reps {
                    f()?;
                }
                Ok((out * k * rows) as f64 * reps as f64 / started.elapsed().as_secs_f64() / 1e9)
            };
            let ours = time(&|| native.forward(&x))?;
            let theirs = time(&|| candle.forward(&x))?;
            row.push_str(&format!(
                " {ours:.1} / {theirs:.1} ({:.2}) |",
                ours / theirs
            ));
        }
        // 24 copies, one row each, best of 3 passes.
        let copies: Vec<QMatMul> = (0..24)
            .map(|_| quantized())
            .collect::<anyhow::Result<_>>()?;
        let natives: Vec<NativeMatrix> = copies
            .iter()
            .map(|q| NativeMatrix::of(q).map(|n| n.expect("the same format")))
            .collect::<candle_core::Result<_>>()?;
        let bytes = 24.0 * QTensor::quantize(&w, dtype)?.storage_size_in_bytes() as f64;
        let x = Tensor::from_vec(
            (0..k).map(|i| (i as f32 * 0.3).cos()).collect::<Vec<f32>>(),
            (1, k),
            &Device::Cpu,
        )?;
        let (mut ours, mut theirs) = (0f64, 0f64);
        for _ in 0..3 {
            let started = Instant::now();
            for n in &natives {
                n.forward(&x)?;
            }
            ours = ours.max(bytes / started.elapsed().as_secs_f64() / 1e9);
            let started = Instant::now();
            for q in &copies {
                q.forward(&x)?;
            }
            theirs = theirs.max(bytes / started.elapsed().as_secs_f64() / 1e9);
        }
        row.push_str(&format!(
            " {ours:.1} / {theirs:.1} ({:.2}) |",
            ours / theirs
        ));
        println!("{row}");
    }
    Ok(())
}
