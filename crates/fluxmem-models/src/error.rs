use std::path::PathBuf;

/// Errors of model loading, provisioning and inference.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A model's files are not in the cache.
    #[error("model `{name}` is not installed in {dir}; fetch it with: {command}")]
    Missing {
        /// Model name.
        name: String,
        /// Where it was looked for.
        dir: PathBuf,
        /// The exact command that installs it.
        command: String,
    },
    /// The manifest does not know this model.
    #[error("unknown model `{name}` (known: {known})")]
    Unknown {
        /// The requested name.
        name: String,
        /// The names the manifest lists.
        known: String,
    },
    /// A file's SHA-256 does not match the manifest.
    #[error("{path}: sha256 {actual}, the model manifest says {expected}")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The manifest's digest.
        expected: String,
        /// The file's digest.
        actual: String,
    },
    /// Fetching a model failed (hub unreachable and the PyPI fallback failed too).
    #[error("fetching model `{name}`: {reason}")]
    Fetch {
        /// Model name.
        name: String,
        /// What went wrong, for every source tried.
        reason: String,
    },
    /// A model file (config, manifest, GGUF metadata) is malformed.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An I/O error.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A tensor operation failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// Tokenization failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The model cannot do what was asked (a scoring mode it lacks).
    #[error("{model}: {reason}")]
    Unsupported {
        /// The model.
        model: String,
        /// What it cannot do.
        reason: String,
    },
    /// A `--device` value that cannot be used in this build or on this machine.
    #[error("device `{requested}`: {reason}")]
    Device {
        /// The requested device.
        requested: String,
        /// Why it cannot be used.
        reason: String,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) trait IoContext<T> {
    fn at(self, path: &std::path::Path) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T> {
        self.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}
