//! One module per subcommand.

mod connect;
mod consolidate;
mod embed;
mod eval;
mod export;
mod ingest;
mod models;
mod query;
mod refine;
mod run;
mod stats;
mod store;

pub(crate) use models::weight_path;
use std::process::ExitCode;

use crate::cli::{Command, Settings};

/// Runs a subcommand, returning the exit status it earned.
pub fn run(command: Command, settings: &Settings) -> anyhow::Result<ExitCode> {
    match command {
        Command::Ingest(args) => ingest::run(args, settings),
        Command::Stats(args) => stats::run(args, settings),
        Command::Embed(args) => embed::run(args, settings),
        Command::Models(command) => models::run(command),
        Command::Query(args) => query::run(args, settings),
        Command::Connect(args) => connect::run(args, settings),
        Command::Refine(args) => refine::run(args, settings),
        Command::Run(args) => run::run(args, settings),
        Command::Eval(crate::cli::EvalCommand::Locomo(args)) => eval::locomo(args, settings),
        Command::Eval(crate::cli::EvalCommand::Skills(args)) => eval::skills(args, settings),
        Command::Eval(crate::cli::EvalCommand::Outcomes(args)) => eval::outcomes(args),
        Command::Consolidate(args) => consolidate::run(args, settings),
        Command::Export(crate::cli::ExportCommand::Skills(args)) => export::skills(args, settings),
        Command::Store(crate::cli::StoreCommand::Recover(args)) => store::recover(args, settings),
        Command::Store(crate::cli::StoreCommand::Compact(args)) => store::compact(args, settings),
        Command::Store(crate::cli::StoreCommand::Index(args)) => store::index(args, settings),
    }
}

/// The embedder `name` names: a BERT embedder of the model manifest, or `hash-<dim>`, the
/// weight-free hashing embedder (a word's bucket in `dim` dimensions; no semantics, no model to
/// fetch). The hash embedder is for benchmarks of the store-bound stages (`benches/scale
/// --embedder hash-384`) and for trying the chain without weights, not for retrieval.
pub fn embedder(
    name: &str,
    device: &fluxmem_models::DeviceChoice,
    batch_size: Option<usize>,
) -> anyhow::Result<Box<dyn fluxmem_models::Embedder>> {
    Ok(fluxmem_models::open_embedder(name, device, batch_size)?)
}

/// The dimension of a weight-free hashing embedder's name (`hash-<dim>`); `None` for any other
/// name, an error for a `hash-` name without a dimension from 1 to 65536.
pub fn hash_dim(name: &str) -> Option<anyhow::Result<usize>> {
    let dim = name.strip_prefix("hash-")?;
    Some(
        dim.parse()
            .ok()
            .filter(|d| (1..=65536).contains(d))
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "{name}: a hash embedder is hash-<dim>, dim a whole number from 1 to 65536"
                )
            }),
    )
}

/// A run id: the stage, the UTC time and the process id.
pub fn run_id(stage: &str) -> String {
    format!(
        "{stage}-{}-{}",
        chrono::Utc::now().format("%Y%m%dT%H%M%S%.3fZ"),
        std::process::id()
    )
}

/// The run id of a stage that writes ids into the store (`connect`, `refine`, `consolidate`):
/// `<stage>@v<V>`, where V is the version the stage's work started from, the last commit not
/// made by `stage` itself. The id follows from the work, not the attempt: a run killed after
/// some commits and started again carries on under the same id, so its edges, edits and
/// locators match an uninterrupted run's.
pub fn stage_run_id(manifest: &fluxmem_store::Manifest, stage: &str) -> String {
    let base = match manifest.commits.iter().rev().find(|c| c.stage != stage) {
        Some(commit) => commit.version,
        // Every commit the manifest still logs is this stage's: the work started before the
        // first of them.
        None => manifest
            .commits
            .first()
            .map_or(manifest.version, |first| first.version.saturating_sub(1)),
    };
    format!("{stage}@v{base}")
}

/// Opens the store for writing and warns about a recovered stale lock.
pub fn open_writer(settings: &Settings) -> anyhow::Result<fluxmem_store::Writer> {
    open_writer_at(&settings.store, settings)
}

/// The writer of the store at `dir`, waiting `--wait` seconds for a held lock, and saying so
/// (and when it took over a stale lock) on stderr.
pub fn open_writer_at(
    dir: &std::path::Path,
    settings: &Settings,
) -> anyhow::Result<fluxmem_store::Writer> {
    let wait = settings.wait;
    let writer = fluxmem_store::Writer::open_waiting(dir, wait, |holder| {
        eprintln!(
            "waiting up to {}s for the store lock held by {holder}",
            wait.as_secs()
        );
    })?;
    if let Some(holder) = writer.stale_lock() {
        eprintln!(
            "warning: recovered a stale store lock left by {holder} (it did not exit cleanly)"
        );
    }
    Ok(writer)
}

/// Stage I settings: `base` (the serving retrieval, [`fluxmem_connect::RetrievalConfig::serving`],
/// or in `query` the one the store's connect recorded) with what the `--fusion`, `--weights`,
/// `--units`, `--adjacency` and `--entity` flags set, and the judge's share.
pub fn retrieval_config(
    fusion: Option<&str>,
    weights: Option<&[f32]>,
    judge_top: usize,
    structure: &crate::cli::StructureArgs,
    base: fluxmem_connect::RetrievalConfig,
) -> anyhow::Result<fluxmem_connect::RetrievalConfig> {
    Ok(retrieval_overrides(fusion, weights, judge_top, structure)?(
        base,
    ))
}

/// The retrieval flags, checked: a function that sets what they name over any base settings
/// (the defaults, or what the store recorded).
pub fn retrieval_overrides(
    fusion: Option<&str>,
    weights: Option<&[f32]>,
    judge_top: usize,
    structure: &crate::cli::StructureArgs,
) -> anyhow::Result<impl Fn(fluxmem_connect::RetrievalConfig) -> fluxmem_connect::RetrievalConfig> {
    let fusion: Option<fluxmem_connect::FusionMode> = fusion
        .map(|f| f.parse().map_err(anyhow::Error::msg))
        .transpose()?;
    let weights = match weights {
        None => None,
        Some(weights) => {
            crate::cli::check_weights(weights)?;
            let [dense, bm25, judge] = weights else {
                anyhow::bail!(
                    "--weights takes three numbers (dense, BM25, judge), got {}",
                    weights.len()
                );
            };
            Some(fluxmem_connect::FusionWeights {
                dense: *dense,
                bm25: *bm25,
                judge: *judge,
            })
        }
    };
    let units: Option<fluxmem_connect::Units> = (structure.units.as_deref())
        .map(|u| u.parse().map_err(anyhow::Error::msg))
        .transpose()?;
    for (flag, value) in [
        ("--adjacency", structure.adjacency),
        ("--entity", structure.entity),
    ] {
        if let Some(value) = value {
            crate::cli::check_f32_flag(flag, value, crate::cli::Bound::NonNegative)?;
        }
    }
    let (adjacency, entity) = (structure.adjacency, structure.entity);
    Ok(move |base| {
        let mut config = fluxmem_connect::RetrievalConfig { judge_top, ..base };
        config.fusion = fusion.unwrap_or(config.fusion);
        config.weights = weights.unwrap_or(config.weights);
        config.units = units.unwrap_or(config.units);
        config.adjacency = adjacency.unwrap_or(config.adjacency);
        config.entity = entity.unwrap_or(config.entity);
        config
    })
}

/// The judge named by `--judge`: `none`, `llm` (the default judge model) or a generator's name
/// from the model manifest, scoring by yes/no; `ql` or `ql:MODEL`, scoring by query likelihood.
/// Judging is prompt processing: the weights that prefill fastest for the model's size
/// (`WeightPath::Prompts`: Q8_0 where fluxmem's kernels run, else f32 up to 0.5B parameters
/// and as stored above; docs/models.md).
pub fn judge_from_flag(
    name: &str,
    device: &fluxmem_models::DeviceChoice,
) -> anyhow::Result<Option<Box<dyn fluxmem_models::Judge>>> {
    Ok(fluxmem_models::open_judge(name, device)?
        .map(|judge| judge as Box<dyn fluxmem_models::Judge>))
}

/// `--label-outcomes MODEL` (`ingest.label_outcomes`): a yes/no judge on a generator that
/// reads each run with no logged outcome ([`fluxmem_models::LlmJudge::run_succeeded`]).
pub struct ModelOutcomeJudge {
    judge: fluxmem_models::LlmJudge<fluxmem_models::GgufGenerator>,
    model: String,
}

impl ModelOutcomeJudge {
    /// The judge a `--label-outcomes` setting names: `llm` (the default judge model) or a
    /// generator's name, with the weights that prefill fastest; `None` for `none`.
    pub fn from_flag(
        name: &str,
        device: &fluxmem_models::DeviceChoice,
    ) -> anyhow::Result<Option<Self>> {
        if fluxmem_models::judge_is_ql(name) {
            anyhow::bail!("--label-outcomes `{name}`: a run is judged by yes or no; name `llm` or a generator");
        }
        let Some(model) = fluxmem_models::judge_model(name)? else {
            return Ok(None);
        };
        let generator =
            fluxmem_models::load_generator(&model, device, fluxmem_models::WeightPath::Prompts)?;
        Ok(Some(ModelOutcomeJudge {
            judge: fluxmem_models::LlmJudge::new(generator),
            model,
        }))
    }

    /// Calls and tokens so far.
    pub fn usage(&self) -> fluxmem_models::Usage {
        fluxmem_models::Judge::usage(&self.judge)
    }
}

impl fluxmem_ingest::outcome::OutcomeJudge for ModelOutcomeJudge {
    fn model(&self) -> &str {
        &self.model
    }
    fn judge(&mut self, transcripts: &[String]) -> Result<Vec<f32>, String> {
        self.judge
            .run_succeeded(transcripts)
            .map_err(|e| e.to_string())
    }
}

/// The replay model an eta setting names (`coverage`: none), with the weights that prefill
/// fastest (replay is mostly prompt processing); an error when a judge is also named.
pub fn replayer_from_flag(
    eta: &str,
    judge: &str,
    device: &fluxmem_models::DeviceChoice,
) -> anyhow::Result<Option<fluxmem_models::GgufGenerator>> {
    Ok(fluxmem_models::open_replayer(eta, judge, device)?)
}

/// A list of outcome sources (`--outcomes`, `consolidate.outcomes`): comma-separated names
/// of [`fluxmem_consolidate::OUTCOME_SOURCES`], at least one.
pub fn outcomes_flag(name: &str, value: &str) -> anyhow::Result<Vec<String>> {
    let sources: Vec<String> = value
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let known = fluxmem_consolidate::OUTCOME_SOURCES;
    if let Some(bad) = sources.iter().find(|s| !known.contains(&s.as_str())) {
        anyhow::bail!(
            "{name} `{value}`: unknown source `{bad}`; expected some of {}",
            known.join(", ")
        );
    }
    if sources.is_empty() {
        anyhow::bail!(
            "{name} `{value}`: name at least one of {}",
            known.join(", ")
        );
    }
    Ok(sources)
}

/// The `--clusters` flag: `auto` (None) or a positive number of clusters per tenant.
pub fn clusters_flag(value: &str) -> anyhow::Result<Option<usize>> {
    match value {
        "auto" => Ok(None),
        value => match value.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => anyhow::bail!("--clusters `{value}`: expected auto or a positive number"),
        },
    }
}

/// Checks the Stage II loop flags' values (before anything is loaded).
pub fn check_loop_flags(args: &crate::cli::LoopArgs) -> anyhow::Result<()> {
    if let Some(at) = args.sufficient_at {
        crate::cli::check_f32_flag("--sufficient-at", at, crate::cli::Bound::NonNegative)?;
    }
    crate::cli::check_f32_flag(
        "--merge-above",
        args.merge_above,
        crate::cli::Bound::NonNegative,
    )?;
    Ok(())
}

/// Stage II loop settings from the `--refine-*` flags ([`check_loop_flags`] checked them).
pub fn loop_options(args: &crate::cli::LoopArgs, budget: usize) -> fluxmem_refine::LoopOptions {
    fluxmem_refine::LoopOptions {
        rounds: args.refine_rounds,
        budget,
        expand_k: args.expand_k,
        reshape_below: args.reshape_below,
        merge_above: args.merge_above,
        sufficient_at: args.sufficient_at,
        ..Default::default()
    }
}

/// The generator of Node Reshape named by `--reshape-generator`, loaded with Q8_0 weights.
pub fn reshape_generator(
    args: &crate::cli::LoopArgs,
    device: &fluxmem_models::DeviceChoice,
) -> anyhow::Result<Option<fluxmem_models::GgufGenerator>> {
    match &args.reshape_generator {
        None => Ok(None),
        Some(name) => Ok(Some(fluxmem_models::load_generator(
            name,
            device,
            fluxmem_models::WeightPath::Q8,
        )?)),
    }
}
