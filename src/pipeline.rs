//! Pipeline files: what `fluxmem run PIPELINE.toml` reads, checked before any work starts.
//!
//! Relative paths in a pipeline file (inputs, store, export and report directories) are
//! relative to the directory of the pipeline file, so a nightly job runs the same from any
//! working directory. Unknown keys and bad values are errors naming the file and the key.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

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
    /// Embedding model name.
    pub embedder: String,
    /// Generator (skill induction and rewriting).
    pub generator: String,
    /// Weights of the generator: quantized, f32 or q8.
    pub generator_weights: String,
    /// Judge: none or llm (the default generator scores).
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
    /// auto, jsonl, docs, locomo, tau-bench or alfworld.
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
}

impl Default for Ingest {
    fn default() -> Self {
        let defaults = fluxmem_ingest::IngestOptions::default();
        Ingest { max_record_bytes: defaults.max_record_bytes, chunk_words: defaults.chunk_words, batch_records: defaults.batch_records }
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
}

impl Default for Embed {
    fn default() -> Self {
        Embed { batch_size: 32, commit_every: 2048 }
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
}

impl Default for Connect {
    fn default() -> Self {
        Connect { enabled: true, per_step: true, ground_k: 2, link_k: 5, commit_every: 500 }
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
}

impl Default for Refine {
    fn default() -> Self {
        let d = fluxmem_refine::CreditOptions::default();
        Refine { enabled: true, prior: d.prior, prune_below: d.prune_below, min_evidence: d.min_evidence, failure_links: d.link_failures }
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
    /// Generator tokens of episodes in the induction prompt.
    pub prompt_budget: usize,
    /// Generated tokens per answer at most.
    pub max_tokens: usize,
    /// Episodes the judge replays per version.
    pub judge_episodes: usize,
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
    /// Only skills with at least this many source episodes.
    pub min_support: usize,
}

impl Default for Export {
    fn default() -> Self {
        Export { enabled: true, format: "skill-md".into(), out: "skills".into(), tenant: None, min_pems: None, min_support: 1 }
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
pub const STAGES: [&str; 6] = ["ingest", "embed", "connect", "refine", "consolidate", "export"];
/// The stages that can run as `--shard I/N` and be merged.
pub const MAP_STAGES: [&str; 3] = ["ingest", "embed", "connect"];

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
    let bytes = std::fs::read(path).with_context(|| format!("reading the pipeline file {}", path.display()))?;
    let text = String::from_utf8(bytes.clone()).map_err(|e| anyhow::anyhow!("{}: not UTF-8 ({e})", path.display()))?;
    let pipeline: Pipeline = toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
    check(&pipeline).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let base = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    Ok(Loaded { path: path.to_path_buf(), bytes, pipeline, base })
}

/// The value checks, each naming its key.
fn check(p: &Pipeline) -> anyhow::Result<()> {
    if p.name.trim().is_empty() || !p.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        bail!("key `name`: `{}` must be non-empty letters, digits, `-`, `_` or `.`", p.name);
    }
    for (i, input) in p.inputs.iter().enumerate() {
        if input.paths.is_empty() {
            bail!("key `inputs[{i}].paths`: empty; list at least one file, directory or pattern");
        }
        fluxmem_ingest::Format::parse(&input.format).map_err(|e| anyhow::anyhow!("key `inputs[{i}].format`: {e}"))?;
        if input.tenant.trim().is_empty() {
            bail!("key `inputs[{i}].tenant`: empty");
        }
        for pattern in &input.paths {
            glob::Pattern::new(pattern).map_err(|e| anyhow::anyhow!("key `inputs[{i}].paths`: bad pattern `{pattern}`: {e}"))?;
        }
    }
    let positive = |key: &str, value: usize| -> anyhow::Result<()> {
        if value == 0 {
            bail!("key `{key}`: must be at least 1");
        }
        Ok(())
    };
    positive("ingest.batch_records", p.ingest.batch_records)?;
    positive("ingest.chunk_words", p.ingest.chunk_words)?;
    positive("ingest.max_record_bytes", p.ingest.max_record_bytes)?;
    positive("embed.batch_size", p.embed.batch_size)?;
    positive("embed.commit_every", p.embed.commit_every)?;
    positive("connect.commit_every", p.connect.commit_every)?;
    positive("consolidate.max_rounds", p.consolidate.max_rounds)?;
    positive("consolidate.prompt_budget", p.consolidate.prompt_budget)?;
    positive("consolidate.max_tokens", p.consolidate.max_tokens)?;
    if !matches!(p.models.judge.as_str(), "none" | "llm") {
        bail!("key `models.judge`: `{}`: expected none or llm", p.models.judge);
    }
    p.models.device.parse::<fluxmem_models::DeviceChoice>().map_err(|e| anyhow::anyhow!("key `models.device`: {e}"))?;
    crate::commands::weight_path(&p.models.generator_weights).map_err(|e| anyhow::anyhow!("key `models.generator_weights`: {e}"))?;
    let manifest = fluxmem_models::ModelManifest::load().map_err(|e| anyhow::anyhow!("the model manifest: {e}"))?;
    for (key, name) in [("models.embedder", &p.models.embedder), ("models.generator", &p.models.generator)] {
        if let Err(e) = manifest.get(name) {
            bail!("key `{key}`: {e}");
        }
    }
    if !(p.refine.prior > 0.0) {
        bail!("key `refine.prior`: must be positive");
    }
    clusters(&p.consolidate.clusters)?;
    if !(p.consolidate.epsilon >= 0.0) {
        bail!("key `consolidate.epsilon`: must be zero or positive");
    }
    p.consolidate.length.parse::<fluxmem_consolidate::LengthUnit>().map_err(|e| anyhow::anyhow!("key `consolidate.length`: {e}"))?;
    p.export.format.parse::<fluxmem_consolidate::ExportFormat>().map_err(|e| anyhow::anyhow!("key `export.format`: {e}"))?;
    Ok(())
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
        let mut matched: Vec<PathBuf> =
            glob::glob(&text).with_context(|| format!("pattern `{pattern}`"))?.filter_map(|entry| entry.ok()).collect();
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
        let unknown = parse("name = \"x\"\n[embed]\nbatch = 3\n").unwrap_err().to_string();
        assert!(unknown.contains("p.toml") && unknown.contains("unknown field `batch`"), "{unknown}");
        let bad = parse("name = \"x\"\n[models]\njudge = \"maybe\"\n").unwrap_err().to_string();
        assert!(bad.contains("p.toml") && bad.contains("key `models.judge`"), "{bad}");
        let clusters = parse("name = \"x\"\n[consolidate]\nclusters = 0\n").unwrap_err().to_string();
        assert!(clusters.contains("key `consolidate.clusters`"), "{clusters}");
        let format = parse("name = \"x\"\n[[inputs]]\npaths = [\"a\"]\nformat = \"csv\"\n").unwrap_err().to_string();
        assert!(format.contains("key `inputs[0].format`"), "{format}");
        let model = parse("name = \"x\"\n[models]\ngenerator = \"gpt-9\"\n").unwrap_err().to_string();
        assert!(model.contains("key `models.generator`") && model.contains("gpt-9"), "{model}");
        let zero = parse("name = \"x\"\n[embed]\nbatch_size = 0\n").unwrap_err().to_string();
        assert!(zero.contains("key `embed.batch_size`"), "{zero}");
        assert!(parse("name = \"x\"\n").is_ok());
    }

    #[test]
    fn the_shipped_pipelines_are_valid() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let demo = load(&root.join("pipelines/demo.toml")).unwrap();
        assert_eq!(demo.pipeline.name, "demo");
        assert_eq!(demo.resolve(demo.pipeline.store.as_ref().unwrap()), root.join("pipelines/../fluxmem-store"));
        let (files, unmatched) = expand(&demo, &demo.pipeline.inputs[0]).unwrap();
        assert!(unmatched.is_empty() && files.len() == 2, "{files:?}");
        let nightly = load(&root.join("pipelines/nightly.toml")).unwrap();
        assert_eq!(nightly.pipeline.consolidate.max_rounds, 5);
        assert_eq!(nightly.pipeline.models.judge, "llm");
    }

    #[test]
    fn clusters_accept_auto_or_a_positive_number() {
        assert_eq!(clusters(&toml::Value::String("auto".into())).unwrap(), None);
        assert_eq!(clusters(&toml::Value::Integer(4)).unwrap(), Some(4));
        assert_eq!(clusters(&toml::Value::String("3".into())).unwrap(), Some(3));
        assert!(clusters(&toml::Value::Integer(-1)).is_err());
    }
}
