//! Stage I of FluxMem: initial connection formation.
//!
//! - [`Bm25`]: lexical scores over semantic nodes (k1 1.5, b 0.75 by default);
//! - [`DenseIndex`]: exact cosine search by blocked matrix products on a candle device;
//! - [`fuse`]: the hybrid score, either the paper's plain sum or the reference code's weighted
//!   sum of min-max normalised signals over the candidate pool ([`FusionMode`]);
//! - [`SemanticIndex`]: BM25 + dense (+ optional [`fluxmem_models::Judge`]) retrieval;
//! - [`Retriever`]: the whole Stage I ranking: skills inherited through `distill` edges from
//!   the closest episodes, those episodes, then semantic nodes;
//! - tenants ([`tenants`], [`resolve_tenant`]): every index serves one tenant; connect and
//!   retrieval never see another tenant's nodes;
//! - [`serve`]: one query's part of a store, read in proportion, and its retriever: what
//!   `query` serves and `eval locomo --through-graph` measures;
//! - [`pack`]: the retrieved items serialised into a context under a token budget, each item
//!   carrying its id, source, time, signals and why it was included.
//!
//! ```
//! use fluxmem_connect::{Bm25, Bm25Params};
//! let index = Bm25::new(&["refund the order", "restart the job"], Bm25Params::default());
//! let scores = index.scores("refund");
//! assert!(scores[0] > 0.0 && scores[1] == 0.0);
//! ```

mod bm25;
mod connect;
mod context;
mod dense;
mod facts;
mod fusion;
mod retrieve;
mod retriever;
pub mod serve;
mod tenant;

pub use bm25::{stem, terms, terms_with, Bm25, Bm25Params};
pub use connect::{
    connect_store, merged_progress, planned_queries, recorded_retrieval, retrieval_progress,
    staged_retrieval, ConnectOptions, ConnectReport, NoProgress, PlannedQueries, Progress,
    DEFAULT_MEMORY, RETRIEVAL_MARKER, STAGE,
};
pub use context::{line, pack, Context, ContextItem};
pub use dense::{
    embedded, embedded_in, top_k, top_k_rows, DenseIndex, Embedded, Unembedded, BLOCK_ROWS,
};
pub use fusion::{fuse, min_max, FusionMode, FusionWeights, Signals};
pub use retrieve::{
    Candidate, Lift, RetrievalConfig, SemanticIndex, Units, DEFAULT_ADJACENCY, DEFAULT_ENTITY,
};
pub use retriever::{semantic_entry, structure_note, Entry, Episodes, Retriever};
pub use tenant::{resolve_tenant, resolve_tenant_among, tenants, DEFAULT_TENANT};

/// Errors of Stage I.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor operation failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] fluxmem_store::Error),
    /// The judge or the embedder failed.
    #[error(transparent)]
    Model(#[from] fluxmem_models::Error),
    /// A node to retrieve over has no embedding of the model.
    #[error("node {node} has no `{model}` embedding; run `fluxmem embed` first")]
    NotEmbedded {
        /// The node.
        node: String,
        /// The model.
        model: String,
    },
    /// Two vectors of one model differ in length.
    #[error("node {node} has a `{model}` embedding of {got} dimensions, {expected} expected; run `fluxmem embed --reembed`")]
    Dimension {
        /// The node.
        node: String,
        /// The model.
        model: String,
        /// The length of the tenant's other vectors.
        expected: usize,
        /// Its length.
        got: usize,
    },
    /// A scratch file of connect's fact search (see [`ConnectOptions::memory`]) could not be
    /// written or read.
    #[error("connect's scratch file {}: {source}", .path.display())]
    Scratch {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// A retriever built with its episodes ranked for one query ([`Episodes::Ranked`]) was
    /// asked for another query, or for more episodes than were ranked.
    #[error("the episodes were ranked once, for one query vector, and {ranked} kept; {asked} were asked for, or for another vector")]
    Ranked {
        /// Episodes asked for.
        asked: usize,
        /// Episodes ranked.
        ranked: usize,
    },
    /// The store holds several tenants and the caller named none.
    #[error("the store holds {} tenants ({}); choose one with --tenant", .tenants.len(), .tenants.join(", "))]
    TenantRequired {
        /// The store's tenants, sorted.
        tenants: Vec<String>,
    },
    /// A shard of a sharded connect recorded a retrieval setting that another shard did not
    /// (their edges would mix rankings), or a record that is not a setting: the merge stops.
    #[error("shard {}: {reason}", .path.display())]
    StagedRetrieval {
        /// The shard's staging store.
        path: std::path::PathBuf,
        /// What it recorded, and what was expected.
        reason: String,
    },
    /// The named tenant has no node in the store.
    #[error("tenant `{tenant}` has no nodes in the store (its tenants: {})", .tenants.join(", "))]
    UnknownTenant {
        /// The tenant asked for.
        tenant: String,
        /// The store's tenants, sorted.
        tenants: Vec<String>,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
