//! Command-line arguments (data only) and the settings they resolve to.

use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;

/// fluxmem turns agent logs into an evolving memory graph and distilled, versioned skills,
/// with local models only.
///
/// Exit status: 0 success; 1 fatal error; 2 usage error; 3 the work was done but some input
/// records were quarantined (see the quarantine file named in the output).
#[derive(Debug, Parser)]
#[command(name = "fluxmem", version, about, long_about)]
pub struct Cli {
    /// Store directory (created by the first write).
    #[arg(long, global = true, env = "FLUXMEM_STORE", default_value = "./fluxmem-store")]
    pub store: PathBuf,

    /// Never draw progress bars (they are also off when stderr is not a terminal).
    #[arg(long, global = true)]
    pub no_progress: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Ingest agent logs and knowledge files into the store.
    ///
    /// Bad records never stop the batch: each goes to `<store>/quarantine/<run>.jsonl` with its
    /// file, line, field and reason. Re-ingesting the same input adds nothing.
    Ingest(IngestArgs),
    /// Print node, edge and embedding counts of the store.
    Stats(StatsArgs),
}

/// `fluxmem ingest`.
#[derive(Debug, Args)]
pub struct IngestArgs {
    /// Files or directories to ingest (directories are walked; hidden entries are skipped).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,

    /// Input format: auto (by extension and content), jsonl (fluxmem trajectories), docs
    /// (text/Markdown), locomo, tau-bench, alfworld.
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

/// Global settings, resolved once from the command line and the environment.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The store directory.
    pub store: PathBuf,
    /// Draw progress bars.
    pub progress: bool,
}

impl From<&Cli> for Settings {
    fn from(cli: &Cli) -> Self {
        Settings { store: cli.store.clone(), progress: !cli.no_progress && std::io::stderr().is_terminal() }
    }
}
