//! The run record: what one pipeline run did, written as `run.json`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Everything one `fluxmem run` did, in the order a person reads it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RunRecord {
    /// The pipeline file as given on the command line.
    pub pipeline: String,
    /// The run's id (also the name of its quarantine file).
    pub run_id: String,
    /// When the run started, RFC 3339 UTC.
    pub started_at: String,
    /// When the run finished, RFC 3339 UTC.
    pub finished_at: String,
    /// `ok`; `partial` (records were quarantined, or a stage gave only part of what it was
    /// meant to: some consolidate clusters gave no skill); `degraded` (a stage that was meant
    /// to produce something produced nothing: every cluster failed, an enabled export wrote no
    /// skill, every record read was quarantined); or `failed: <message>` (a stage stopped the
    /// run). `failed` wins over `degraded`, `degraded` over `partial`.
    pub status: String,
    /// Why the status is not `ok`, one human-readable line each (`consolidate: 0 of 6 clusters
    /// gave a skill (6 failed)`); empty for an `ok` run. Absent in run records written before
    /// the field existed, which read as empty.
    #[serde(default)]
    pub reasons: Vec<String>,
    /// The store directory.
    pub store: String,
    /// The store's manifest version before the run.
    pub manifest_version_before: u64,
    /// The store's manifest version after the run.
    pub manifest_version_after: u64,
    /// Model id per role (`embedder`, `generator`, `judge`).
    pub models: BTreeMap<String, String>,
    /// The stages in the order they ran.
    pub stages: Vec<StageRecord>,
    /// What the store's compaction after the stages did (`fluxmem_store::CompactReport` as
    /// JSON); `None` when it did not run. Absent in older records.
    #[serde(default)]
    pub compaction: Option<serde_json::Value>,
    /// The tenant vector indexes brought up to date after the compaction (one
    /// `fluxmem_store::IndexUpdate` per tenant, as JSON); `None` when that did not run. Absent
    /// in older records.
    #[serde(default)]
    pub indexes: Option<serde_json::Value>,
    /// Records rejected by ingest.
    pub quarantine: QuarantineSummary,
    /// Calls and tokens per model role (`generator`, `judge`, `verifier`).
    pub model_usage: BTreeMap<String, UsageRecord>,
    /// The PEMS summary of consolidation; `None` when no skill was scored this run.
    pub pems: Option<PemsSummary>,
    /// Files and directories the run wrote (export directory, `run.json`, `report.html`).
    pub outputs: Vec<String>,
    /// What redaction replaced before anything left the store (the export and this record),
    /// per kind (`email`, `phone`, `card`, `iban`, `secret`, `ip`).
    #[serde(default)]
    pub redacted: BTreeMap<String, u64>,
}

/// One stage of a run.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StageRecord {
    /// `ingest`, `embed`, `connect`, `refine`, `consolidate` or `export`.
    pub name: String,
    /// `done`, `skipped (disabled)`, `nothing new`, `partial: <numbers>` (part of what the
    /// stage was meant to produce, e.g. `partial: 1 of 6 clusters gave a skill (5 failed)`),
    /// `degraded: <numbers>` (nothing of it, e.g. `degraded: 0 skills exported`) or
    /// `failed: <message>`. A distributed run's map stages also say `merged`.
    pub status: String,
    /// Wall time of the stage in seconds.
    pub seconds: f64,
    /// What the stage read, by kind (e.g. `files`, `records`, `episodes`).
    pub counts_in: BTreeMap<String, u64>,
    /// What the stage wrote, by kind (e.g. `nodes`, `edges`, `skills`).
    pub counts_out: BTreeMap<String, u64>,
    /// The stage's own JSON report, kept as it is.
    pub details: serde_json::Value,
}

/// The records ingest rejected this run.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct QuarantineSummary {
    /// How many records were quarantined.
    pub records: u64,
    /// The quarantine files written this run.
    pub files: Vec<String>,
    /// Record count per reason.
    pub by_reason: BTreeMap<String, u64>,
    /// A few rejected records (at most 20), in the order they were met.
    pub samples: Vec<QuarantineSample>,
}

/// One rejected record.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct QuarantineSample {
    /// The input file.
    pub file: String,
    /// The line in that file, when the format has lines.
    pub line: Option<u64>,
    /// The field that was wrong.
    pub field: String,
    /// Why the record was rejected.
    pub reason: String,
}

/// Calls and tokens of one model role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct UsageRecord {
    /// Model calls.
    pub calls: u64,
    /// Prompt tokens read.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
}

/// The PEMS loop of consolidation, over all skills scored this run.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PemsSummary {
    /// Skills scored this run.
    pub skills: u64,
    /// Mean PEMS over the skills after round r (index 0 is round 1).
    pub mean_by_round: Vec<f64>,
    /// How many skills had converged by round r (index 0 is round 1).
    pub converged_by_round: Vec<u64>,
    /// Episodes per cluster.
    pub cluster_sizes: Vec<u64>,
    /// The best skills, best PEMS first, at most 10.
    pub top_skills: Vec<SkillSummary>,
}

/// One skill and where it came from.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SkillSummary {
    /// The skill's node id.
    pub id: String,
    /// Its name (written by a generator: any text).
    pub name: String,
    /// Its description (written by a generator: any text).
    pub description: String,
    /// Its version number.
    pub version: i64,
    /// Its PEMS.
    pub pems: f64,
    /// How many episodes it was distilled from.
    pub support: u64,
    /// PEMS of every scored round over all its versions, oldest first.
    pub pems_history: Vec<f64>,
    /// The ids of the episodes it was distilled from.
    pub source_episodes: Vec<String>,
}
