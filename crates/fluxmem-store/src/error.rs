use std::path::PathBuf;

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O operation on a store file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A shard or the manifest is damaged or does not belong here: checksum mismatch,
    /// unreadable Parquet, wrong table, row count that does not match the manifest.
    #[error("data corruption in {path}: {reason}")]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// What was found.
        reason: String,
    },
    /// The store was written by a fluxmem with another schema version.
    #[error("{path}: store schema version {found}, this fluxmem reads version {supported}")]
    UnsupportedVersion {
        /// The manifest.
        path: PathBuf,
        /// The version in the manifest.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The directory holds no fluxmem store (no manifest).
    #[error(
        "{path}: no fluxmem store here (no manifest.json); run `fluxmem ingest` to create one"
    )]
    NotAStore {
        /// The directory.
        path: PathBuf,
    },
    /// The directory holds shard files (or a temporary manifest) but no `manifest.json`: a
    /// store whose manifest was lost. Nothing is written or deleted there until it is
    /// recovered.
    #[error(
        "{path}: holds {shards} shard file(s) and {temporary} temporary manifest(s) but no manifest.json: \
         this is a store whose manifest was lost, not a new store; nothing was changed. \
         Run `fluxmem --store {path} store recover` to rebuild the manifest from the shards"
    )]
    NoManifest {
        /// The store directory.
        path: PathBuf,
        /// Files in `shards/`.
        shards: usize,
        /// `manifest.json.tmp-*` files.
        temporary: usize,
    },
    /// A commit found that the manifest it was about to replace is not the one it started
    /// from: another writer committed meanwhile. The commit is abandoned; nothing is deleted.
    #[error("{path}: commit refused: {reason}")]
    Conflict {
        /// The manifest.
        path: PathBuf,
        /// What was found.
        reason: String,
    },
    /// `recover` was asked to rebuild the manifest of a store that has a readable one.
    #[error("{path}: {reason}")]
    Recover {
        /// The store directory.
        path: PathBuf,
        /// Why recovery did not run.
        reason: String,
    },
    /// Another process holds the writer lock.
    #[error("{path}: store is locked by another writer ({holder}); wait for it to finish")]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// What the lock file says about its holder.
        holder: String,
    },
    /// A commit would mix embedding models or dimensions in one store.
    #[error(
        "embedding model mismatch: the store holds `{store_model}` ({store_dim} dims), this commit has `{model}` ({dim} dims); \
         run `fluxmem embed --reembed` to migrate the store to a new model"
    )]
    ModelMismatch {
        /// The store's model.
        store_model: String,
        /// The store's dimension.
        store_dim: usize,
        /// The committed model.
        model: String,
        /// The committed dimension.
        dim: usize,
    },
    /// A sharded run's staging stores cannot be merged (missing, unfinished or stale shard).
    #[error("{path}: {reason}")]
    Staging {
        /// The staging store.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A `--shard` value is not `I/N` with I < N.
    #[error("shard `{value}`: {reason}")]
    BadShard {
        /// The value given.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// Mapping a shard to the graph model failed.
    #[error("{path}: {source}")]
    Graph {
        /// The shard.
        path: PathBuf,
        /// The mapping error.
        source: fluxmem_graph::Error,
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
