use std::path::PathBuf;

/// Fatal ingestion errors. Bad records are not errors: they are quarantined
/// ([`crate::Rejected`]) and the batch goes on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store failed (I/O, lock, corruption).
    #[error(transparent)]
    Store(#[from] fluxmem_store::Error),
    /// The quarantine file could not be written.
    #[error("quarantine file {path}: {source}")]
    Quarantine {
        /// The quarantine file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The ledger of ingested files could not be written.
    #[error("ingest ledger {path}: {source}")]
    Ledger {
        /// The ledger file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A `--format` value or an input that no format recognises when one was required.
    #[error("{0}")]
    Usage(String),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
