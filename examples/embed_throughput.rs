//! Embedding throughput of fluxmem's candle embedder on a file of texts (one per line).
//! Used by `benches/embed_vs_python.py`, which runs the Python reference in the same script.
//!
//! cargo run --example embed_throughput -- FILE [--batch-size N] [--workers N] [--repeat N] [--backend native|native-portable|candle]
//! Prints one JSON object: sentences, tokens, seconds (best of the repeats).

use fluxmem_models::{BertBackend, DeviceChoice, Embedder};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let file = args.first().ok_or_else(|| {
        anyhow::anyhow!("usage: embed_throughput FILE [--batch-size N] [--workers N]")
    })?;
    let flag = |name: &str, default: usize| -> anyhow::Result<usize> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(args
                .get(i + 1)
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?
                .parse()?),
            None => Ok(default),
        }
    };
    let batch_size = flag("--batch-size", 32)?;
    let workers = flag("--workers", 1)?;
    let repeat = flag("--repeat", 1)?;
    let text = std::fs::read_to_string(file)?;
    let texts: Vec<&str> = text.lines().collect();
    let backend = match args
        .iter()
        .position(|a| a == "--backend")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
    {
        None | Some("native") => BertBackend::Native,
        Some("native-avx2") => BertBackend::NativeAvx2,
        Some("native-portable") => BertBackend::NativePortable,
        Some("candle") => BertBackend::Candle,
        Some(other) => anyhow::bail!(
            "--backend is native, native-avx2, native-portable or candle, not {other}"
        ),
    };
    let embedder = fluxmem_models::load_embedder_with(
        fluxmem_models::DEFAULT_EMBEDDER,
        &DeviceChoice::Cpu,
        backend,
    )?
    .with_batch_size(batch_size)
    .with_workers(workers);
    let tokens: usize = embedder.tokenize(&texts)?.iter().map(Vec::len).sum();
    embedder.embed(&texts[..texts.len().min(64)])?; // warm-up
    let mut best = f64::MAX;
    for _ in 0..repeat.max(1) {
        let started = std::time::Instant::now();
        let vectors = embedder.embed(&texts)?;
        best = best.min(started.elapsed().as_secs_f64());
        assert_eq!(vectors.len(), texts.len());
    }
    println!(
        "{}",
        serde_json::json!({"sentences": texts.len(), "tokens": tokens, "seconds": best, "batch_size": batch_size, "workers": workers, "backend": format!("{backend:?}"), "kernel": embedder.kernel(),
            "rayon_threads": std::env::var("RAYON_NUM_THREADS").ok()})
    );
    Ok(())
}
