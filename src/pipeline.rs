//! Pipeline files: what `fluxmem run PIPELINE.toml` reads, checked before any work starts.
//!
//! Relative paths in a pipeline file (inputs, store, export and report directories) are
//! relative to the directory of the pipeline file, so a nightly job runs the same from any
//! working directory. Unknown keys and bad values are errors naming the file and the key.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::cli::Bound;

/// A whole pipeline file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Pipeline {
    /// A name for the pipeline (run ids start with it).
    pub name: String,
    /// The store directory (default: the global `--store`, `./fluxmem-store`).
    pub store: Option<PathBuf>,
    /// Seed of every seeded step (clustering).
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// The models.
    #[serde(default)]
    pub models: Models,
    /// The inputs of the ingest stage.
    #[serde(default)]
    pub inputs: Vec<Input>,
    /// Stage settings.
    #[serde(default)]
    pub ingest: Ingest,
    /// See [`Embed`].
    #[serde(default)]
    pub embed: Embed,
    /// See [`Connect`].
    #[serde(default)]
    pub connect: Connect,
    /// See [`Refine`].
    #[serde(default)]
    pub refine: Refine,
    /// See [`Consolidate`].
    #[serde(default)]
    pub consolidate: Consolidate,
    /// See [`Export`].
    #[serde(default)]
    pub export: Export,
    /// See [`Report`].
    #[serde(default)]
    pub report: Report,
    /// See [`Compact`].
    #[serde(default)]
    pub compact: Compact,
    /// `[redact]`: what is replaced before anything leaves the store (exported skills, prompts,
    /// the run report): `enabled` (default true), `kinds` (default all: email, phone, card,
    /// iban, secret, ip), `allow` (exact strings never redacted).
    #[serde(default)]
    pub redact: fluxmem_redact::RedactConfig,
}

fn default_seed() -> u64 {
    42
}

fn yes() -> bool {
    true
}

/// `[models]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Models {
    /// Embedding model name, or `hash-<dim>` for the weight-free hashing embedder (tests and
    /// plumbing benches: it embeds no meaning).
    pub embedder: String,
    /// Generator (skill induction and rewriting).
    pub generator: String,
    /// Weights of the generator: quantized, f32 or q8. (`generator = "none"`: skills are worded
    /// from the mined procedure by a template, no model.)
    pub generator_weights: String,
    /// Judge: none, llm (the default judge model) or a generator's name from the model manifest
    /// (yes/no scoring); ql or ql:MODEL (query-likelihood scoring).
    pub judge: String,
    /// auto, cpu, cuda, cuda:N or metal.
    pub device: String,
}

impl Default for Models {
    fn default() -> Self {
        Models {
            embedder: fluxmem_models::DEFAULT_EMBEDDER.into(),
            generator: fluxmem_models::DEFAULT_GENERATOR.into(),
            generator_weights: "q8".into(),
            judge: "none".into(),
            device: "auto".into(),
        }
    }
}

/// `[[inputs]]`: a set of files with one format and tenant.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// Files, directories or glob patterns (`logs/*.jsonl`, `logs/**/*.json`).
    pub paths: Vec<String>,
    /// auto, jsonl, openai-chat, otel, docs, locomo, tau-bench or alfworld.
    #[serde(default = "auto")]
    pub format: String,
    /// Tenant of records that do not name one.
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// Agent id of records that do not name one.
    pub agent: Option<String>,
    /// A pattern that matches nothing is an error (false: a warning in the run report).
    #[serde(default = "yes")]
    pub required: bool,
}

fn auto() -> String {
    "auto".into()
}

fn default_tenant() -> String {
    "default".into()
}

/// `[ingest]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Ingest {
    /// Records larger than this are quarantined.
    pub max_record_bytes: usize,
    /// Maximum words per document chunk.
    pub chunk_words: usize,
    /// Commit at least every this many records.
    pub batch_records: usize,
    /// Commit after a file once this many files were read since the last commit.
    pub batch_files: usize,
    /// Read every input again, ignoring the ledger of files already ingested.
    pub reread: bool,
    /// Outcomes of runs whose log says none, read by a local model: `none` (ingest's rule
    /// only), `llm` (the default judge model) or a generator's name (`ingest --label-outcomes`).
    pub label_outcomes: String,
}

impl Default for Ingest {
    fn default() -> Self {
        let defaults = fluxmem_ingest::IngestOptions::default();
        Ingest {
            max_record_bytes: defaults.max_record_bytes,
            chunk_words: defaults.chunk_words,
            batch_records: defaults.batch_records,
            batch_files: defaults.batch_files,
            reread: defaults.reread,
            label_outcomes: "none".into(),
        }
    }
}

/// `[embed]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Embed {
    /// Texts per forward pass.
    pub batch_size: usize,
    /// Commit after this many newly embedded nodes.
    pub commit_every: usize,
    /// Nodes read and embedded at once (rounded up to a multiple of `commit_every`): the
    /// stage's memory follows this, not the night's size.
    pub window: usize,
}

impl Default for Embed {
    fn default() -> Self {
        Embed {
            batch_size: 32,
            commit_every: 2048,
            window: fluxmem_embed::EmbedOptions::default().window,
        }
    }
}

/// `[connect]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Connect {
    /// Run the stage.
    pub enabled: bool,
    /// One retrieval per step (the paper) or per task.
    pub per_step: bool,
    /// Ground edges per retrieval.
    pub ground_k: usize,
    /// Link edges per episode.
    pub link_k: usize,
    /// Commit after this many episodes.
    pub commit_every: usize,
    /// MiB connect may hold for the night: half for the link search (the night's episode
    /// vectors and neighbours, the score blocks), a quarter for a group of the night's
    /// episodes whole, a quarter for the facts (see `--memory-mb`).
    pub memory_mb: usize,
}

impl Default for Connect {
    fn default() -> Self {
        Connect {
            enabled: true,
            per_step: true,
            ground_k: 2,
            link_k: 5,
            commit_every: 500,
            memory_mb: fluxmem_connect::DEFAULT_MEMORY >> 20,
        }
    }
}

/// `[refine]`: batch credit assignment from logged outcomes.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Refine {
    /// Run the stage.
    pub enabled: bool,
    /// Prior strength.
    pub prior: f64,
    /// Prune edges whose credit falls below this...
    pub prune_below: f64,
    /// ...with at least this many outcomes behind them.
    pub min_evidence: usize,
    /// Link failed episodes to successes of the same task.
    pub failure_links: bool,
    /// Links per failed episode at most (the successes nearest in time).
    pub max_failure_links: usize,
    /// Rewrite an edge only when its credit moved by more than this since its last write.
    pub tolerance: f64,
    /// Re-estimate a tenant's stored base rate when the current one differs by more.
    pub prior_drift: f64,
    /// Commit after this many changed edges.
    pub commit_every: usize,
}

impl Default for Refine {
    fn default() -> Self {
        let d = fluxmem_refine::CreditOptions::default();
        Refine {
            enabled: true,
            prior: d.prior,
            prune_below: d.prune_below,
            min_evidence: d.min_evidence,
            failure_links: d.link_failures,
            max_failure_links: d.max_failure_links,
            tolerance: d.tolerance,
            prior_drift: d.prior_drift,
            commit_every: d.commit_every,
        }
    }
}

/// `[consolidate]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Consolidate {
    /// Run the stage.
    pub enabled: bool,
    /// `auto` (max(1, floor(sqrt(n/2)))) or a number, as a string or an integer.
    pub clusters: toml::Value,
    /// Cluster only successful episodes.
    pub successful_only: bool,
    /// Scored versions per skill at most.
    pub max_rounds: usize,
    /// Stop when |delta PEMS| < epsilon.
    pub epsilon: f64,
    /// `tokens` or `words`.
    pub length: String,
    /// Divide PEMS by the number of skills (the reference code).
    pub divide_by_skills: bool,
    /// Generator tokens of episodes in `induce_skill`'s whole-skill prompt; the naming prompt
    /// of consolidation (at most 5 task lines and the mined steps) does not use it.
    pub prompt_budget: usize,
    /// Generated tokens per answer at most.
    pub max_tokens: usize,
    /// Episodes the judge replays per version.
    pub judge_episodes: usize,
    /// eta: `coverage` (model-free), `replay` or `replay:MODEL` (a model's step accuracy with
    /// the skill on kept-back runs); not with `models.judge`.
    pub eta: String,
    /// With a replay eta: logged calls replayed per measurement at most (0: all).
    pub replay_steps: usize,
    /// Outcome sources to believe, comma-separated (see `consolidate --outcomes`).
    pub outcomes: String,
    /// A skill is re-induced only when its cluster gained or lost at least this share of its
    /// source episodes (0: on any change).
    pub reinduce_share: f64,
    /// New episodes join the clusters of their tenant's skills instead of k-means running again.
    pub assign: bool,
    /// With `assign`: a tenant is clustered again when more than this share of its episodes
    /// fits no existing cluster.
    pub recluster_share: f64,
}

impl Default for Consolidate {
    fn default() -> Self {
        let d = fluxmem_consolidate::ConsolidateOptions::default();
        Consolidate {
            enabled: true,
            clusters: toml::Value::String("auto".into()),
            successful_only: d.successful_only,
            max_rounds: d.max_rounds,
            epsilon: d.epsilon,
            length: "tokens".into(),
            divide_by_skills: false,
            prompt_budget: d.prompt_budget,
            max_tokens: d.max_tokens,
            judge_episodes: d.judge_episodes,
            eta: "coverage".into(),
            replay_steps: d.replay_steps,
            outcomes: d.outcomes.join(","),
            reinduce_share: d.reinduce_share,
            assign: d.assign,
            recluster_share: d.recluster_share,
        }
    }
}

/// `[export]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Export {
    /// Run the stage.
    pub enabled: bool,
    /// skill-md, jsonl or parquet.
    pub format: String,
    /// Output directory.
    pub out: PathBuf,
    /// Only this tenant.
    pub tenant: Option<String>,
    /// Only skills with at least this PEMS.
    pub min_pems: Option<f64>,
    /// Only skills whose eta is at least this (one under it is retired, with the reason).
    pub min_eta: Option<f64>,
    /// Only skills with at least this many source episodes.
    pub min_support: usize,
}

impl Default for Export {
    fn default() -> Self {
        Export {
            enabled: true,
            format: "skill-md".into(),
            out: "skills".into(),
            tenant: None,
            min_pems: None,
            min_eta: None,
            min_support: 1,
        }
    }
}

/// `[compact]`: the store's compaction after a full run (`fluxmem store compact` runs it by
/// hand). See `fluxmem_store::CompactPolicy`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Compact {
    /// Compact after a full run that did not fail.
    pub enabled: bool,
    /// A shard with more than this share of superseded rows is rewritten (1/3 bounds rows
    /// stored / live rows at 1.5).
    pub max_dead_fraction: f64,
    /// Shards of one level merged once this many gather.
    pub merge_factor: usize,
    /// Live rows of the smallest level.
    pub min_level_rows: u64,
}

impl Default for Compact {
    fn default() -> Self {
        let d = fluxmem_store::CompactPolicy::default();
        Compact {
            enabled: true,
            max_dead_fraction: d.max_dead_fraction,
            merge_factor: d.merge_factor,
            min_level_rows: d.min_level_rows,
        }
    }
}

impl Compact {
    /// The store's policy of these settings.
    pub fn policy(&self) -> fluxmem_store::CompactPolicy {
        fluxmem_store::CompactPolicy {
            max_dead_fraction: self.max_dead_fraction,
            merge_factor: self.merge_factor,
            min_level_rows: self.min_level_rows,
            ..Default::default()
        }
    }
}

/// `[report]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Report {
    /// Runs write `<dir>/<run id>/run.json` and `report.html`.
    pub dir: PathBuf,
}

impl Default for Report {
    fn default() -> Self {
        Report { dir: "runs".into() }
    }
}

/// The stages, in order.
pub const STAGES: [&str; 6] = [
    "ingest",
    "embed",
    "connect",
    "refine",
    "consolidate",
    "export",
];
/// The stages that can run as `--shard I/N` and be merged (consolidate: its clusters planned
/// once with `--plan`, every shard induces the skills of the planned clusters it owns).
pub const MAP_STAGES: [&str; 4] = ["ingest", "embed", "connect", "consolidate"];

/// A pipeline read from a file, with its paths resolved.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The file.
    pub path: PathBuf,
    /// Its bytes (part of the default run id).
    pub bytes: Vec<u8>,
    /// The settings.
    pub pipeline: Pipeline,
    /// The directory relative paths are resolved against.
    pub base: PathBuf,
}

impl Loaded {
    /// `path` resolved against the pipeline file's directory.
    pub fn resolve(&self, path: &Path) -> PathBuf {
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.base.join(path)
        }
    }
}

/// Reads and checks a pipeline file: syntax, unknown keys, and every value, before any work.
pub fn load(path: &Path) -> anyhow::Result<Loaded> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("reading the pipeline file {}", path.display()))?;
    let text = String::from_utf8(bytes.clone())
        .map_err(|e| anyhow::anyhow!("{}: not UTF-8 ({e})", path.display()))?;
    let pipeline: Pipeline = toml::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
    check(&pipeline).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let base = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    Ok(Loaded {
        path: path.to_path_buf(),
        bytes,
        pipeline,
        base,
    })
}

/// The value checks, each naming its key.
fn check(p: &Pipeline) -> anyhow::Result<()> {
    // The default run id is `<name>-<12 hex>`: a name that keeps to the run id rule gives a
    // valid run id.
    if p.name.len() > NAME_MAX || check_run_id(&p.name).is_err() {
        bail!(
            "key `name`: `{}`: must be 1 to {NAME_MAX} {RUN_ID_CHARS} (run ids start with it)",
            p.name
        );
    }
    for (i, input) in p.inputs.iter().enumerate() {
        if input.paths.is_empty() {
            bail!("key `inputs[{i}].paths`: empty; list at least one file, directory or pattern");
        }
        fluxmem_ingest::Format::parse(&input.format)
            .map_err(|e| anyhow::anyhow!("key `inputs[{i}].format`: {e}"))?;
        if input.tenant.trim().is_empty() {
            bail!("key `inputs[{i}].tenant`: empty");
        }
        for pattern in &input.paths {
            glob::Pattern::new(pattern).map_err(|e| {
                anyhow::anyhow!("key `inputs[{i}].paths`: bad pattern `{pattern}`: {e}")
            })?;
        }
    }
    let positive = |key: &str, value: usize| -> anyhow::Result<()> {
        if value == 0 {
            bail!("key `{key}`: must be at least 1");
        }
        Ok(())
    };
    positive("ingest.batch_records", p.ingest.batch_records)?;
    positive("ingest.batch_files", p.ingest.batch_files)?;
    positive("ingest.chunk_words", p.ingest.chunk_words)?;
    positive("ingest.max_record_bytes", p.ingest.max_record_bytes)?;
    positive("embed.batch_size", p.embed.batch_size)?;
    positive("embed.commit_every", p.embed.commit_every)?;
    positive("embed.window", p.embed.window)?;
    positive("connect.commit_every", p.connect.commit_every)?;
    positive("connect.memory_mb", p.connect.memory_mb)?;
    positive("consolidate.max_rounds", p.consolidate.max_rounds)?;
    positive("consolidate.prompt_budget", p.consolidate.prompt_budget)?;
    positive("consolidate.max_tokens", p.consolidate.max_tokens)?;
    if let Err(e) = fluxmem_models::judge_model(&p.models.judge) {
        bail!("key `models.judge`: {e}");
    }
    crate::commands::outcomes_flag("key `consolidate.outcomes`", &p.consolidate.outcomes)?;
    match fluxmem_models::eta_model(&p.consolidate.eta) {
        Err(e) => bail!("key `consolidate.eta`: {e}"),
        Ok(Some(_)) if p.models.judge != "none" => bail!(
            "key `consolidate.eta` = `{}` with `models.judge` = `{}`: eta is measured one way; name one",
            p.consolidate.eta,
            p.models.judge
        ),
        Ok(_) => {}
    }
    p.models
        .device
        .parse::<fluxmem_models::DeviceChoice>()
        .map_err(|e| anyhow::anyhow!("key `models.device`: {e}"))?;
    crate::commands::weight_path(&p.models.generator_weights)
        .map_err(|e| anyhow::anyhow!("key `models.generator_weights`: {e}"))?;
    let manifest = fluxmem_models::ModelManifest::load()
        .map_err(|e| anyhow::anyhow!("the model manifest: {e}"))?;
    for (key, name) in [
        ("models.embedder", &p.models.embedder),
        ("models.generator", &p.models.generator),
    ] {
        if key == "models.generator" && name == "none" {
            continue;
        }
        // The weight-free hashing embedder (tests, plumbing benches) is no model file.
        if let (true, Some(dim)) = (key == "models.embedder", crate::commands::hash_dim(name)) {
            dim.map_err(|e| anyhow::anyhow!("key `{key}`: {e}"))?;
            continue;
        }
        if let Err(e) = manifest.get(name) {
            bail!("key `{key}`: {e}");
        }
    }
    // A NaN or an infinity in any of these would turn every edge weight or score it reaches
    // into NaN.
    let number = |key: &str, value: f64, bound: Bound| {
        bound
            .check(value)
            .map_err(|rule| anyhow::anyhow!("key `{key}`: {rule}"))
    };
    number("refine.prior", p.refine.prior, Bound::Positive)?;
    number(
        "refine.prune_below",
        p.refine.prune_below,
        Bound::NonNegative,
    )?;
    number("refine.tolerance", p.refine.tolerance, Bound::NonNegative)?;
    number(
        "refine.prior_drift",
        p.refine.prior_drift,
        Bound::NonNegative,
    )?;
    positive("refine.commit_every", p.refine.commit_every)?;
    number(
        "compact.max_dead_fraction",
        p.compact.max_dead_fraction,
        Bound::NonNegative,
    )?;
    if p.compact.max_dead_fraction >= 1.0 {
        bail!(
            "key `compact.max_dead_fraction`: {} is not a share below 1",
            p.compact.max_dead_fraction
        );
    }
    clusters(&p.consolidate.clusters)?;
    number(
        "consolidate.epsilon",
        p.consolidate.epsilon,
        Bound::NonNegative,
    )?;
    number(
        "consolidate.reinduce_share",
        p.consolidate.reinduce_share,
        Bound::NonNegative,
    )?;
    number(
        "consolidate.recluster_share",
        p.consolidate.recluster_share,
        Bound::NonNegative,
    )?;
    if let Some(min_pems) = p.export.min_pems {
        number("export.min_pems", min_pems, Bound::Finite)?;
    }
    if let Some(min_eta) = p.export.min_eta {
        number("export.min_eta", min_eta, Bound::Finite)?;
    }
    p.consolidate
        .length
        .parse::<fluxmem_consolidate::LengthUnit>()
        .map_err(|e| anyhow::anyhow!("key `consolidate.length`: {e}"))?;
    p.export
        .format
        .parse::<fluxmem_consolidate::ExportFormat>()
        .map_err(|e| anyhow::anyhow!("key `export.format`: {e}"))?;
    Ok(())
}

/// What a run id may hold, after "1 to 128": run ids name a directory under `report.dir`
/// (`<report.dir>/<run id>/run.json`) and quarantine files, so they keep to one plain file name.
pub const RUN_ID_CHARS: &str =
    "ASCII letters, digits, `.`, `_` or `-`, not starting with `.` or `-`";
/// The longest run id.
pub const RUN_ID_MAX: usize = 128;
/// The longest pipeline name: `<name>-<12 hex>`, the default run id, stays within [`RUN_ID_MAX`].
const NAME_MAX: usize = RUN_ID_MAX - 13;

/// Checks a run id (`--run-id`, or the default one): 1 to [`RUN_ID_MAX`] ASCII letters, digits,
/// `.`, `_` or `-`, not starting with `.` or `-`; so never a path (`../x`, `/tmp/x`), `.` or `..`.
/// `Err` says the rule.
pub fn check_run_id(id: &str) -> Result<(), String> {
    let ok = (1..=RUN_ID_MAX).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !id.starts_with(['.', '-']);
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{id}`: a run id must be 1 to {RUN_ID_MAX} {RUN_ID_CHARS}"
        ))
    }
}

/// `consolidate.clusters`: `None` for auto.
pub fn clusters(value: &toml::Value) -> anyhow::Result<Option<usize>> {
    match value {
        toml::Value::String(s) if s == "auto" => Ok(None),
        toml::Value::Integer(n) if *n > 0 => Ok(Some(*n as usize)),
        toml::Value::String(s) => match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => bail!("key `consolidate.clusters`: `{s}`: expected auto or a positive number"),
        },
        other => bail!("key `consolidate.clusters`: `{other}`: expected auto or a positive number"),
    }
}

/// Checks, before any work, that `dir` can be made a directory this process writes into: it is
/// a directory we may write into, or it does not exist and its nearest existing ancestor is
/// one (the writer creates it, with its parents). `Err` names the path at fault.
pub fn check_output_dir(dir: &Path) -> Result<(), String> {
    for ancestor in dir.ancestors() {
        let at = if ancestor.as_os_str().is_empty() {
            Path::new(".")
        } else {
            ancestor
        };
        match std::fs::metadata(at) {
            Ok(meta) if meta.is_dir() => {
                return if writable(at) {
                    Ok(())
                } else if at == dir {
                    Err(format!(
                        "{}: a directory this process may not write into",
                        dir.display()
                    ))
                } else {
                    Err(format!(
                        "{}: cannot be created: {} is a directory this process may not write into",
                        dir.display(),
                        at.display()
                    ))
                };
            }
            Ok(_) if at == dir => {
                return Err(format!("{}: exists and is not a directory", dir.display()))
            }
            Ok(_) => {
                return Err(format!(
                    "{}: cannot be created: {} exists and is not a directory",
                    dir.display(),
                    at.display()
                ))
            }
            Err(e) if missing(&e) => {
                // A link to nothing: `create_dir_all` cannot make a directory there.
                if std::fs::symlink_metadata(at).is_ok_and(|m| m.file_type().is_symlink()) {
                    return Err(format!(
                        "{}: {} is a symbolic link to nothing",
                        dir.display(),
                        at.display()
                    ));
                }
            }
            Err(e) => return Err(format!("{}: {e}", at.display())),
        }
    }
    Ok(())
}

/// Checks `out`, the export directory, before any work, with the cheap checks of
/// `fluxmem_consolidate::export_skills` (which replaces only a missing or empty directory or an
/// earlier export): it needs a name of its own, its parent must be a directory we can write
/// into (or be creatable), and if it exists it must be a directory that is empty or an earlier
/// fluxmem export (a `release.json` with `"format": "fluxmem-skills"` listing every other
/// entry). `Err` names the path at fault.
pub fn check_export_out(out: &Path) -> Result<(), String> {
    let dir = match std::fs::canonicalize(out) {
        Ok(real) => real,
        Err(e) if missing(&e) => out.to_path_buf(),
        Err(e) => return Err(format!("{}: {e}", out.display())),
    };
    if dir.file_name().is_none() {
        return Err(format!(
            "{}: the export directory needs a name of its own (not `..` or a root)",
            out.display()
        ));
    }
    let parent = match dir.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    // The release is written into a sibling of `out` and renamed into place.
    check_output_dir(parent)?;
    // What the export itself refuses: a non-directory, a non-empty directory that is not an
    // earlier export, an earlier export holding entries its release does not list.
    fluxmem_consolidate::check_export_target(&dir).map_err(|e| e.to_string())
}

/// A path that is not there: missing, or below something that is not a directory.
fn missing(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
    )
}

/// Whether this process may create entries in the directory `dir`.
#[cfg(unix)]
fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // Safety: `path` is a NUL-terminated string that lives across the call; access(2) only reads it.
    unsafe { libc::access(path.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

/// Whether this process may create entries in the directory `dir` (not known here: the write
/// will tell).
#[cfg(not(unix))]
fn writable(_dir: &Path) -> bool {
    true
}

/// The files of one input: each pattern resolved against `base`; directories as given
/// (ingest walks them); patterns expanded in sorted order. Returns the files and the patterns
/// that matched nothing.
pub fn expand(loaded: &Loaded, input: &Input) -> anyhow::Result<(Vec<PathBuf>, Vec<String>)> {
    let mut files = Vec::new();
    let mut unmatched = Vec::new();
    for pattern in &input.paths {
        let full = loaded.resolve(Path::new(pattern));
        let text = full.to_string_lossy().into_owned();
        if !text.contains(['*', '?', '[']) {
            if full.exists() {
                files.push(full);
            } else {
                unmatched.push(pattern.clone());
            }
            continue;
        }
        let mut matched: Vec<PathBuf> = glob::glob(&text)
            .with_context(|| format!("pattern `{pattern}`"))?
            .filter_map(|entry| entry.ok())
            .collect();
        matched.sort();
        if matched.is_empty() {
            unmatched.push(pattern.clone());
        }
        files.extend(matched);
    }
    Ok((files, unmatched))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> anyhow::Result<Loaded> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.toml");
        std::fs::write(&path, text).unwrap();
        load(&path)
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_file_and_key() {
        let unknown = parse("name = \"x\"\n[embed]\nbatch = 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            unknown.contains("p.toml") && unknown.contains("unknown field `batch`"),
            "{unknown}"
        );
        let bad = parse("name = \"x\"\n[models]\njudge = \"maybe\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            bad.contains("p.toml") && bad.contains("key `models.judge`"),
            "{bad}"
        );
        let eta = parse("name = \"x\"\n[consolidate]\neta = \"judge\"\n")
            .unwrap_err()
            .to_string();
        assert!(eta.contains("key `consolidate.eta`"), "{eta}");
        let both =
            parse("name = \"x\"\n[models]\njudge = \"llm\"\n[consolidate]\neta = \"replay\"\n")
                .unwrap_err()
                .to_string();
        assert!(both.contains("eta is measured one way"), "{both}");
        let replay = parse("name = \"x\"\n[consolidate]\neta = \"replay\"\n").unwrap();
        assert_eq!(replay.pipeline.consolidate.eta, "replay");
        let clusters = parse("name = \"x\"\n[consolidate]\nclusters = 0\n")
            .unwrap_err()
            .to_string();
        assert!(
            clusters.contains("key `consolidate.clusters`"),
            "{clusters}"
        );
        let format = parse("name = \"x\"\n[[inputs]]\npaths = [\"a\"]\nformat = \"csv\"\n")
            .unwrap_err()
            .to_string();
        assert!(format.contains("key `inputs[0].format`"), "{format}");
        let model = parse("name = \"x\"\n[models]\ngenerator = \"gpt-9\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            model.contains("key `models.generator`") && model.contains("gpt-9"),
            "{model}"
        );
        let zero = parse("name = \"x\"\n[embed]\nbatch_size = 0\n")
            .unwrap_err()
            .to_string();
        assert!(zero.contains("key `embed.batch_size`"), "{zero}");
        assert!(parse("name = \"x\"\n").is_ok());
    }

    #[test]
    fn the_shipped_pipelines_are_valid() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let demo = load(&root.join("pipelines/demo.toml")).unwrap();
        assert_eq!(demo.pipeline.name, "demo");
        assert_eq!(
            demo.resolve(demo.pipeline.store.as_ref().unwrap()),
            root.join("pipelines/../fluxmem-store")
        );
        let (files, unmatched) = expand(&demo, &demo.pipeline.inputs[0]).unwrap();
        assert!(unmatched.is_empty() && files.len() == 2, "{files:?}");
        let nightly = load(&root.join("pipelines/nightly.toml")).unwrap();
        assert_eq!(nightly.pipeline.consolidate.max_rounds, 5);
        assert_eq!(nightly.pipeline.models.judge, "llm");
    }

    #[test]
    fn numbers_must_be_finite_and_in_range() {
        for (text, key) in [
            ("[refine]\nprior = inf\n", "refine.prior"),
            ("[refine]\nprior = 0.0\n", "refine.prior"),
            ("[refine]\nprune_below = nan\n", "refine.prune_below"),
            ("[refine]\nprune_below = -0.5\n", "refine.prune_below"),
            ("[consolidate]\nepsilon = inf\n", "consolidate.epsilon"),
            ("[consolidate]\nepsilon = -1.0\n", "consolidate.epsilon"),
            ("[export]\nmin_pems = -inf\n", "export.min_pems"),
            ("[export]\nmin_pems = nan\n", "export.min_pems"),
        ] {
            let error = parse(&format!("name = \"x\"\n{text}"))
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("p.toml")
                    && error.contains(&format!("key `{key}`"))
                    && error.contains("must be a finite number"),
                "{text}: {error}"
            );
        }
        assert!(
            parse("name = \"x\"\n[refine]\nprune_below = 0.0\n[export]\nmin_pems = -0.25\n")
                .is_ok()
        );
    }

    #[test]
    fn run_ids_and_names_are_plain_file_names() {
        let longest = "x".repeat(RUN_ID_MAX);
        for good in [
            "night",
            "demo-0123456789ab",
            "nightly-2026-11-29",
            "a.b_c-d",
            "0",
            longest.as_str(),
        ] {
            assert!(check_run_id(good).is_ok(), "{good}");
        }
        let too_long = "x".repeat(RUN_ID_MAX + 1);
        for bad in [
            "",
            "../../x",
            "/tmp/x",
            "..",
            ".",
            ".hidden",
            "-x",
            "a/b",
            "a\\b",
            "a b",
            "a:b",
            "caf\u{e9}",
            too_long.as_str(),
        ] {
            let error = check_run_id(bad).unwrap_err();
            assert!(
                error.contains("a run id must be 1 to 128 ASCII letters"),
                "{bad}: {error}"
            );
        }
        // The default run id `<name>-<12 hex>` keeps to the rule.
        assert!(parse(&format!("name = \"{}\"\n", "n".repeat(NAME_MAX))).is_ok());
        for name in [
            "n".repeat(NAME_MAX + 1),
            ".x".into(),
            "-x".into(),
            "a/b".into(),
            String::new(),
        ] {
            let error = parse(&format!("name = \"{name}\"\n"))
                .unwrap_err()
                .to_string();
            assert!(error.contains("key `name`"), "{name}: {error}");
        }
    }

    #[test]
    fn output_targets_are_checked_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "x").unwrap();
        assert!(check_output_dir(dir.path()).is_ok());
        assert!(
            check_output_dir(&dir.path().join("new/deeper")).is_ok(),
            "created with its parents"
        );
        let error = check_output_dir(&file).unwrap_err();
        assert!(
            error.contains("exists and is not a directory")
                && error.contains(&file.display().to_string()),
            "{error}"
        );
        let error = check_output_dir(&file.join("run")).unwrap_err();
        assert!(
            error.contains("cannot be created")
                && error.contains(&format!("{} exists and is not a directory", file.display())),
            "{error}"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let locked = dir.path().join("locked");
            std::fs::create_dir(&locked).unwrap();
            std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
            // Root writes anywhere: then there is nothing to refuse.
            if std::fs::create_dir(locked.join("probe")).is_err() {
                let error = check_output_dir(&locked.join("runs")).unwrap_err();
                assert!(error.contains("may not write into"), "{error}");
                assert!(check_export_out(&locked.join("skills")).is_err());
            }
            std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
        }

        // The export directory: what `export_skills` would refuse.
        assert!(
            check_export_out(&dir.path().join("skills")).is_ok(),
            "missing: created"
        );
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert!(check_export_out(&empty).is_ok(), "empty: replaced");
        assert!(check_export_out(&file)
            .unwrap_err()
            .contains("exists and is not a directory"));
        assert!(check_export_out(&file.join("skills"))
            .unwrap_err()
            .contains("is not a directory"));
        let busy = dir.path().join("busy");
        std::fs::create_dir(&busy).unwrap();
        std::fs::write(busy.join("notes.txt"), "mine").unwrap();
        assert!(check_export_out(&busy)
            .unwrap_err()
            .contains("holds no release.json"));
        let other = dir.path().join("other");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(
            other.join("release.json"),
            r#"{"format": "something-else"}"#,
        )
        .unwrap();
        assert!(check_export_out(&other)
            .unwrap_err()
            .contains("not a fluxmem skill release"));
        let earlier = dir.path().join("earlier");
        std::fs::create_dir_all(earlier.join("a")).unwrap();
        std::fs::write(earlier.join("a/SKILL.md"), "skill").unwrap();
        std::fs::write(
            earlier.join("release.json"),
            r#"{"format": "fluxmem-skills", "files": ["a/SKILL.md"]}"#,
        )
        .unwrap();
        assert!(
            check_export_out(&earlier).is_ok(),
            "an earlier export: replaced"
        );
        std::fs::write(earlier.join("a/notes.txt"), "mine").unwrap();
        let error = check_export_out(&earlier).unwrap_err();
        assert!(
            error.contains("a/notes.txt") && error.contains("does not list"),
            "{error}"
        );
        assert!(check_export_out(Path::new("/"))
            .unwrap_err()
            .contains("a name of its own"));
    }

    #[test]
    fn clusters_accept_auto_or_a_positive_number() {
        assert_eq!(clusters(&toml::Value::String("auto".into())).unwrap(), None);
        assert_eq!(clusters(&toml::Value::Integer(4)).unwrap(), Some(4));
        assert_eq!(clusters(&toml::Value::String("3".into())).unwrap(), Some(3));
        assert!(clusters(&toml::Value::Integer(-1)).is_err());
    }
}
