//! Stage II of FluxMem: feedback-driven refinement.
//!
//! Two entry points share one vocabulary of edits (Link Expand, Link Prune, Node Reshape), each
//! recorded as a [`fluxmem_graph::Edit`] in the store's edit log:
//!
//! - [`refine_query`]: the query-time self-verification loop. A [`Verifier`] (the judge, or the
//!   deterministic [`CoverageVerifier`]) decides whether the context suffices; a failure is
//!   attributed to over-connection, granularity or under-connection and the matching edit is
//!   applied, for at most T rounds under a fixed token budget. Edits that end in a sufficient
//!   context persist; see the [`query`] module for the rules.
//! - [`refine_store`]: batch credit assignment over logged episodes and their outcomes (edge
//!   weights and evidence up for what successes had, down for what failures had, pruning and
//!   failure-to-success links); see the [`credit`] module for the update rule.
//!
//! The verifier sees the query and the memory text only, never answers or evidence labels.

pub mod credit;
pub mod query;
mod verify;

pub use credit::{
    assign, assign_with_priors, outcome, refine_store, CreditOptions, CreditReport, CreditStats,
    BASE_RATE_MARKER, STATS_KEY, WATERMARK_MARKER,
};
/// Progress of [`refine_store`] (edges assessed): Stage I's callbacks, shared.
pub use fluxmem_connect::{NoProgress, Progress};
pub use query::{
    refine_query, LoopModels, LoopOptions, LoopOutcome, Neighbours, Round, DEFAULT_MERGE_ABOVE,
    STAGE,
};
pub use verify::{verifier, CoverageVerifier, JudgeVerifier, Verifier};

/// Errors of Stage II.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Retrieval or packing failed.
    #[error(transparent)]
    Connect(#[from] fluxmem_connect::Error),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] fluxmem_store::Error),
    /// A model (verifier, embedder, generator) failed.
    #[error(transparent)]
    Model(#[from] fluxmem_models::Error),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
