//! Stage III of FluxMem: long-term consolidation of episodes into versioned skills, and the
//! export of the skill set for online services.
//!
//! - [`kmeans`]: spherical k-means (k-means++ seeding, cosine on normalised vectors, seeded,
//!   blocked matrix products on a candle device); M defaults to max(1, floor(sqrt(n / 2))).
//! - [`consolidate_store`]: clusters each tenant's episodes (k-means, then split and merged by
//!   procedure: `mine::split_by_procedure`, `mine::merge_by_procedure`), induces one skill per cluster with
//!   a [`fluxmem_models::Generator`] (one-shot prompt, lenient parsing, one retry prompt, failed clusters kept
//!   with the raw output), matures it with the PEMS loop ([`pems()`]: score, rewrite,
//!   re-embed, re-score until |delta PEMS| < epsilon or the round limit), and commits procedural
//!   nodes, `distill` edges, skill embeddings and edit records in one store commit. Re-running on
//!   a grown store gives matched skills a new version instead of duplicating them; when the
//!   clusters of several skills turn out to follow one procedure, the new version takes the
//!   place of all of them (they become its previous versions).
//! - [`skill_records`]: the latest skills as a release lists them; skills of one tenant that
//!   share a name gain what their procedure alone shows (`Take and put, with open`).
//! - [`export_skills`]: the latest version of every skill as `SKILL.md` folders, JSONL or
//!   Parquet, with a release manifest (`release.json`); byte-identical for the same store.
//!
//! The stage depends on the model traits only, so it runs in tests with
//! [`fluxmem_models::HashEmbedder`] and a scripted generator.
//!
//! ```
//! use fluxmem_consolidate::{pems, PemsOptions};
//! // eta 1, length 2 (the clamp), no change from the previous version: 1 / ln 2.
//! let score = pems(1.0, 1, 0.0, 1, &PemsOptions::default());
//! assert!((score.pems - 1.0 / 2f64.ln()).abs() < 1e-12);
//! ```

mod consolidate;
mod decide;
mod export;
pub mod flow;
mod kmeans;
mod mature;
mod mine;
mod parse;
mod pems;
mod prompt;
pub mod replay;

pub use consolidate::{
    consolidate_store, latest_skills, plan_shared, shared_plan_merge, shared_settings,
    sweep_shared_plans, ClusterReport, ConsolidateOptions, ConsolidateReport, FailedCluster,
    ModelNames, NoProgress, Progress, SharedPlanReport, SharedSettings, SkillReport, TokenUsage,
    OUTCOME_SOURCES, SHARED_PLAN_MARKER, STAGE,
};
pub use export::{
    check_export_target, export_skills, export_skills_with, skill_records, ExportFormat,
    ExportOptions, ExportReport, SkillRecord, CHANGES_FILE, PROVENANCE_FILE, RELEASE_FILE,
};
pub use kmeans::{auto_clusters, kmeans, Clustering, KMeansOptions, SplitMix64, KMEANS_BLOCK_ROWS};
pub use mature::{induce_skill, Attempt, Matured, Models, Round, Wording};
pub use mine::{
    coverage, lcs_len, mine, signatures, step_call, MineOptions, Signed, Skeleton, SkeletonStep,
};
pub use parse::{parse_skill, SkillText};
pub use pems::{delta, pems, word_count, LengthUnit, PemsOptions, PemsScore};
pub use prompt::{episode_brief, episode_text, outcome_label, EXAMPLE_NAME};

use std::path::PathBuf;

/// Errors of Stage III and the export.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor operation failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] fluxmem_store::Error),
    /// The embedder, generator or judge failed.
    #[error(transparent)]
    Model(#[from] fluxmem_models::Error),
    /// An episode to cluster has no embedding of the model.
    #[error("episode {node} has no `{model}` embedding; run `fluxmem embed` first")]
    NotEmbedded {
        /// The episode.
        node: String,
        /// The model.
        model: String,
    },
    /// The configured embedder is not the store's.
    #[error("the store's embeddings are from `{store_model}`, not `{model}`; pass the store's model (skill embeddings must be comparable)")]
    ModelMismatch {
        /// The store's model.
        store_model: String,
        /// The configured one.
        model: String,
    },
    /// Reading or writing an export file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The export directory holds files that are not an earlier export.
    #[error(
        "{path}: the export directory is not empty and holds no {}; refusing to write into it",
        RELEASE_FILE
    )]
    OutputNotEmpty {
        /// The directory.
        path: PathBuf,
    },
    /// Encoding the Parquet export failed.
    #[error("{path}: cannot encode the skills as Parquet: {reason}")]
    Encode {
        /// The file.
        path: PathBuf,
        /// The cause.
        reason: String,
    },
    /// The cluster plan an unfinished run left in the store cannot be followed (unreadable, or
    /// naming a node the store lacks): the store was changed by hand or damaged.
    #[error("cannot resume the unfinished consolidation: {reason}")]
    Plan {
        /// What is wrong with the plan.
        reason: String,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
