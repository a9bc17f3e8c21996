//! The GPU check of `scripts/gpu-check.sh`: what a session lent a GPU runs, from a binary built
//! where cargo is (the GPU machine has none) and carried over with its assets. One table:
//!
//! - **golden vectors**: all-minilm-l6-v2 on the device against the sentence-transformers
//!   reference (`tests/data/golden/`), when its weights are on the machine (a GPU machine cannot
//!   fetch them, and they are too large to carry: there the row says so);
//! - **invariance**: the same texts embedded on the device at batch 1, 7, 64 and 256 and in a
//!   shuffled order, with weights of MiniLM's shape (random, seeded: the same on any machine):
//!   how many texts get bit-identical vectors in every setting, and the largest difference;
//! - **against the CPU**: the largest difference between the device's vectors and the CPU's
//!   native forward on the same weights;
//! - **throughput**: embedding tokens/s on the device at batch 256 and 1024;
//! - **generation**: tokens/s at batch 1 and 16 with a generator, when it is installed.
//!
//! `--device cpu` is the dry run CI makes: the device path is candle's forward (the one CUDA
//! runs), the reference the native CPU forward.
//!
//!     gpu_check --prepare MODEL_DIR --assets DIR      (where the model is: writes the assets)
//!     gpu_check --device cpu|cuda --assets DIR [--texts N] [--generator NAME] [--out FILE]
//!
//! Exits non-zero when a vector is not finite, or the golden vectors or the CPU comparison are
//! off by more than 1e-3 (cosine 0.999): the numbers are for the table, the exit for CI.

use candle_core::{Device, Tensor};
use fluxmem_models::{
    BertBackend, ChatMessage, DeviceChoice, Embedder, GenerateParams, Generator, SentenceEmbedder,
    WeightPath,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The model files copied into the assets (the weights are not: they are replaced by random
/// ones of the same shapes, listed in `shapes.json`).
const MODEL_FILES: [&str; 5] = [
    "config.json",
    "tokenizer.json",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
];

/// The largest difference allowed against a reference (golden vectors, the CPU).
const TOLERANCE: f32 = 1e-3;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let assets =
        PathBuf::from(value("--assets").unwrap_or_else(|| "target/gpu-check/assets".into()));
    if let Some(model) = value("--prepare") {
        return prepare(Path::new(&model), &assets);
    }
    let choice: DeviceChoice = value("--device").unwrap_or_else(|| "cuda".into()).parse()?;
    let device = choice.device()?;
    let texts = texts(value("--texts").map_or(Ok(1024), |n| n.parse())?);
    let generator = value("--generator").unwrap_or_else(|| "smollm2-135m-instruct-q4_1".into());
    let mut table = Table::default();
    table.row("device", &format!("{device:?}"), "", true);
    golden(&assets, &choice, &mut table)?;
    let model = shaped_model(&assets)?;
    invariance(model.path(), &device, &texts, &mut table)?;
    throughput(model.path(), &device, &texts, &mut table)?;
    generation(&generator, &choice, &mut table);
    let text = table.render();
    print!("{text}");
    if let Some(out) = value("--out") {
        std::fs::write(&out, &text)?;
    }
    if table.failed() {
        anyhow::bail!("gpu check failed: see the rows marked FAIL");
    }
    Ok(())
}

/// The check's table: one row per measurement.
#[derive(Default)]
struct Table {
    rows: Vec<(String, String, String, bool)>,
}

impl Table {
    fn row(&mut self, check: &str, setting: &str, result: &str, ok: bool) {
        self.rows
            .push((check.into(), setting.into(), result.into(), ok));
    }

    fn failed(&self) -> bool {
        self.rows.iter().any(|r| !r.3)
    }

    fn render(&self) -> String {
        let mut text = String::from("| check | setting | result | ok |\n|---|---|---|---|\n");
        for (check, setting, result, ok) in &self.rows {
            let ok = if *ok { "ok" } else { "FAIL" };
            text.push_str(&format!("| {check} | {setting} | {result} | {ok} |\n"));
        }
        text
    }
}

/// Copies the model's small files into `assets` and lists its tensors' names and shapes.
fn prepare(model: &Path, assets: &Path) -> anyhow::Result<()> {
    for file in MODEL_FILES {
        let to = assets.join(file);
        std::fs::create_dir_all(to.parent().expect("a file in a folder"))?;
        std::fs::copy(model.join(file), &to)?;
    }
    let tensors = candle_core::safetensors::load(model.join("model.safetensors"), &Device::Cpu)?;
    let shapes: BTreeMap<&String, Vec<usize>> = tensors
        .iter()
        .map(|(name, tensor)| (name, tensor.dims().to_vec()))
        .collect();
    std::fs::write(assets.join("shapes.json"), serde_json::to_string(&shapes)?)?;
    let golden =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden/all-minilm-l6-v2.json");
    std::fs::copy(golden, assets.join("golden.json"))?;
    eprintln!("gpu_check: assets written to {}", assets.display());
    Ok(())
}

/// A model folder with the assets' files and random weights of the listed shapes: seeded
/// (splitmix64), so the same on every machine; layer norms start at weight 1, bias 0.
fn shaped_model(assets: &Path) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    for file in MODEL_FILES {
        let to = dir.path().join(file);
        std::fs::create_dir_all(to.parent().expect("a file in a folder"))?;
        std::fs::copy(assets.join(file), &to)?;
    }
    let shapes: BTreeMap<String, Vec<usize>> =
        serde_json::from_str(&std::fs::read_to_string(assets.join("shapes.json"))?)?;
    let mut state = 42u64;
    let mut tensors = std::collections::HashMap::new();
    for (name, shape) in &shapes {
        let count: usize = shape.iter().product();
        let layer_norm = name.contains("LayerNorm");
        let values: Vec<f32> = (0..count)
            .map(|_| {
                match (
                    layer_norm,
                    name.ends_with("weight") || name.ends_with("gamma"),
                ) {
                    (true, true) => 1.0,
                    (true, false) => 0.0,
                    _ => (splitmix(&mut state) as f64 / u64::MAX as f64 - 0.5) as f32 * 0.1,
                }
            })
            .collect();
        tensors.insert(
            name.clone(),
            Tensor::from_vec(values, shape.as_slice(), &Device::Cpu)?,
        );
    }
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors"))?;
    Ok(dir)
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` texts of different lengths (3 to 60 words), the same on every machine.
fn texts(n: usize) -> Vec<String> {
    let words = [
        "refund",
        "order",
        "flight",
        "the",
        "customer",
        "asked",
        "for",
        "a",
        "change",
        "of",
        "seat",
        "payment",
        "card",
        "was",
        "declined",
        "agent",
        "checked",
        "policy",
        "before",
        "cancel",
        "reservation",
        "baggage",
        "upgrade",
        "business",
        "class",
    ];
    let mut state = 7u64;
    (0..n)
        .map(|_| {
            let len = 3 + (splitmix(&mut state) % 58) as usize;
            (0..len)
                .map(|_| words[(splitmix(&mut state) % words.len() as u64) as usize])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// The largest absolute difference between two sets of vectors, and how many are bit-identical.
fn compare(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, usize) {
    let mut largest = 0f32;
    let mut same = 0;
    for (x, y) in a.iter().zip(b) {
        let diff = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        largest = largest.max(diff);
        same += usize::from(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
    (largest, same)
}

fn finite(vectors: &[Vec<f32>]) -> bool {
    vectors.iter().flatten().all(|v| v.is_finite())
}

/// The device's forward: candle's (the CUDA path), also on the CPU.
fn on_device(dir: &Path, device: &Device, batch: usize) -> anyhow::Result<SentenceEmbedder> {
    Ok(
        SentenceEmbedder::load_with(dir, "minilm-shape", device, BertBackend::Candle)?
            .with_batch_size(batch),
    )
}

fn golden(assets: &Path, choice: &DeviceChoice, table: &mut Table) -> anyhow::Result<()> {
    let embedder = match fluxmem_models::load_embedder_with(
        fluxmem_models::DEFAULT_EMBEDDER,
        choice,
        BertBackend::Candle,
    ) {
        Ok(embedder) => embedder,
        Err(e) => {
            let result = format!("not run: {e}");
            table.row("golden vectors", "all-minilm-l6-v2", &result, true);
            return Ok(());
        }
    };
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(assets.join("golden.json"))?)?;
    let sentences: Vec<&str> = golden["sentences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str())
        .collect();
    let expected: Vec<Vec<f32>> = serde_json::from_value(golden["vectors"].clone())?;
    let got = embedder.embed(&sentences)?;
    let (largest, _) = compare(&got, &expected);
    let ok = finite(&got) && got.len() == expected.len() && largest < TOLERANCE;
    table.row(
        "golden vectors",
        &format!("all-minilm-l6-v2, {} sentences", sentences.len()),
        &format!("largest difference {largest:.2e}"),
        ok,
    );
    Ok(())
}

fn invariance(
    dir: &Path,
    device: &Device,
    texts: &[String],
    table: &mut Table,
) -> anyhow::Result<()> {
    let texts: Vec<&str> = texts.iter().take(256).map(String::as_str).collect();
    let reference = on_device(dir, device, 64)?.embed(&texts)?;
    for batch in [1, 7, 256] {
        let got = on_device(dir, device, batch)?.embed(&texts)?;
        let (largest, same) = compare(&got, &reference);
        table.row(
            "invariance",
            &format!("batch {batch} vs 64, {} texts", texts.len()),
            &format!("{same} bit-identical, largest difference {largest:.2e}"),
            finite(&got),
        );
    }
    // A shuffled order (seeded), put back in place.
    let mut order: Vec<usize> = (0..texts.len()).collect();
    let mut state = 11u64;
    for i in (1..order.len()).rev() {
        order.swap(i, (splitmix(&mut state) % (i as u64 + 1)) as usize);
    }
    let shuffled: Vec<&str> = order.iter().map(|&i| texts[i]).collect();
    let got = on_device(dir, device, 64)?.embed(&shuffled)?;
    let mut back = vec![Vec::new(); got.len()];
    for (vector, &i) in got.into_iter().zip(&order) {
        back[i] = vector;
    }
    let (largest, same) = compare(&back, &reference);
    table.row(
        "invariance",
        "shuffled order, batch 64",
        &format!("{same} bit-identical, largest difference {largest:.2e}"),
        finite(&back),
    );
    let cpu = SentenceEmbedder::load_with(dir, "minilm-shape", &Device::Cpu, BertBackend::Native)?
        .with_batch_size(64)
        .embed(&texts)?;
    let (largest, same) = compare(&reference, &cpu);
    table.row(
        "against the CPU",
        "native CPU forward, same weights",
        &format!("{same} bit-identical, largest difference {largest:.2e}"),
        largest < TOLERANCE,
    );
    Ok(())
}

fn throughput(
    dir: &Path,
    device: &Device,
    texts: &[String],
    table: &mut Table,
) -> anyhow::Result<()> {
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    for batch in [256, 1024] {
        let embedder = on_device(dir, device, batch)?;
        let tokens: usize = embedder.tokenize(&texts)?.iter().map(Vec::len).sum();
        embedder.embed(&texts[..texts.len().min(batch)])?; // warm-up
        let started = Instant::now();
        let vectors = embedder.embed(&texts)?;
        let seconds = started.elapsed().as_secs_f64();
        table.row(
            "embedding throughput",
            &format!("batch {batch}, {} texts, {tokens} tokens", texts.len()),
            &format!("{:.0} tokens/s", tokens as f64 / seconds),
            finite(&vectors),
        );
    }
    Ok(())
}

/// Generation tokens/s at batch 1 and 16 (32 greedy tokens each), when `name` is installed.
fn generation(name: &str, choice: &DeviceChoice, table: &mut Table) {
    for batch in [1, 16] {
        let result = (|| -> anyhow::Result<String> {
            let mut generator =
                fluxmem_models::load_generator(name, choice, WeightPath::Quantized)?
                    .with_batch_size(batch);
            let conversations: Vec<Vec<ChatMessage>> = (0..batch)
                .map(|i| {
                    vec![ChatMessage::new(
                        "user",
                        format!("Write a story about lighthouse {i}."),
                    )]
                })
                .collect();
            let params = GenerateParams {
                max_tokens: 32,
                ..GenerateParams::default()
            };
            let started = Instant::now();
            let out = generator.generate_batch(&conversations, &params)?;
            let tokens: usize = out.iter().map(|g| g.generated_tokens).sum();
            Ok(format!(
                "{:.1} tokens/s ({tokens} tokens)",
                tokens as f64 / started.elapsed().as_secs_f64()
            ))
        })();
        let setting = format!("{name}, batch {batch}");
        match result {
            Ok(result) => table.row("generation", &setting, &result, true),
            Err(e) => table.row("generation", &setting, &format!("not run: {e}"), true),
        }
    }
}
