//! Evaluation harnesses. [`locomo`] measures retrieval recall on LoCoMo for fluxmem and for
//! baseline systems (BM25, dense, hybrid) in one run, overall and per question category.
//! [`skills`] measures Stage III's skills per generator against tau-bench gold actions and
//! ALFWorld task types. Gold labels are read only to score, never by the system.

pub mod locomo;
pub mod metrics;
pub mod outcomes;
pub mod replay;
pub mod skills;

/// Errors of the evaluation harnesses.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading an input failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The data file is not what the harness expects.
    #[error("{path}: {reason}")]
    Data {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] fluxmem_store::Error),
    /// Ingestion failed.
    #[error(transparent)]
    Ingest(#[from] fluxmem_ingest::Error),
    /// Embedding failed.
    #[error(transparent)]
    Embed(#[from] fluxmem_embed::Error),
    /// A model failed.
    #[error(transparent)]
    Model(#[from] fluxmem_models::Error),
    /// Retrieval failed.
    #[error(transparent)]
    Connect(#[from] fluxmem_connect::Error),
    /// Stage II failed.
    #[error(transparent)]
    Refine(#[from] fluxmem_refine::Error),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
