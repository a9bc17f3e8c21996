//! Ingestion: agent logs and knowledge files in, graph nodes out, bad records quarantined.
//!
//! Formats ([`Format`]): fluxmem's own JSONL trajectory schema (`docs/trajectory-schema.md`),
//! knowledge documents (text/Markdown, chunked), LoCoMo conversations, tau-bench runs and
//! ALFWorld transcripts. [`ingest`] drives a whole batch into a store:
//!
//! - every record read is counted exactly once:
//!   `read = ingested + duplicates + quarantined + other_shards`;
//! - with [`IngestOptions::shard`], only the records the shard owns are stored or quarantined
//!   (records by their node id, rejections by file and line), the rest counted as `other_shards`;
//! - a bad record (bad JSON, wrong type, missing field, invalid UTF-8, oversize) goes to the
//!   run's quarantine file with its file, line, field and reason, and the batch goes on;
//! - node ids are content-addressed (a conversation's by its logged id), so a record already
//!   stored is a duplicate and adds nothing, unless it is a later, longer version of a stored
//!   conversation: then it replaces it under the same id, with an `episode_grown` edit (`grow`);
//! - a line or file must hold exactly one JSON value (content after it quarantines the record);
//!   lines end at `\n`, `\r\n` or a lone `\r`; timestamps must fall in the years 1970..=9999;
//! - what fluxmem writes (the store being written, other stores, exports, run reports) is never
//!   read back, and file links are read only with [`IngestOptions::follow_symlinks`]: what a walk
//!   leaves out is listed in [`IngestReport::skipped`], never dropped silently;
//! - commits happen every [`IngestOptions::batch_records`] new records, and after a file once
//!   the files (or bytes) read since the last commit reach [`IngestOptions::batch_files`] (or
//!   [`IngestOptions::batch_bytes`]), at points that depend only on the input, so a killed run
//!   started again ends with the same store; a directory of many small files makes a handful
//!   of commits, not one a file. The ledger records a file once a commit holds its records.
//!
//! ```no_run
//! use fluxmem_ingest::{ingest, IngestOptions, NoProgress};
//! let mut writer = fluxmem_store::Writer::open("fluxmem-store").unwrap();
//! let report = ingest(&mut writer, &["data/".into()], &IngestOptions::default(), "run-1", &mut NoProgress).unwrap();
//! assert_eq!(report.read, report.ingested + report.duplicates + report.quarantined + report.other_shards);
//! ```

mod alfworld;
mod chat;
mod compress;
mod docs;
mod error;
mod events;
mod grow;
mod jsonl;
mod layouts;
mod ledger;
mod locomo;
mod openai;
mod openinference;
mod otel;
pub mod outcome;
mod record;
mod source;
mod tau;
mod walk;

pub use compress::{
    Compression, MAX_DECOMPRESSED_BYTES, MAX_DECOMPRESSION_RATIO, RATIO_FLOOR_BYTES,
};

pub use alfworld::task_line as alfworld_task_line;
pub use docs::{chunk, Chunk};
pub use error::{Error, Result};
pub use ledger::LEDGER;
pub use record::{Parsed, Record, Rejected, EXCERPT_BYTES};
pub use walk::Skipped;

use fluxmem_graph::Graph;
use fluxmem_store::{CommitInfo, Shard, Writer};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use source::Source;

/// Input formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// fluxmem's JSONL trajectory schema.
    Jsonl,
    /// Text / Markdown knowledge documents.
    Docs,
    /// LoCoMo conversations.
    Locomo,
    /// tau-bench run results.
    TauBench,
    /// ALFWorld transcripts.
    Alfworld,
    /// OpenAI-style chat logs: one `{"messages": [...]}` conversation a line.
    OpenaiChat,
    /// OpenTelemetry GenAI traces as OTLP/JSON (`resourceSpans`).
    Otel,
}

impl Format {
    /// Parses a `--format` value (`auto` is `None`).
    pub fn parse(value: &str) -> Result<Option<Format>> {
        Ok(Some(match value {
            "auto" => return Ok(None),
            "jsonl" => Format::Jsonl,
            "docs" => Format::Docs,
            "locomo" => Format::Locomo,
            "tau-bench" => Format::TauBench,
            "alfworld" => Format::Alfworld,
            "openai-chat" => Format::OpenaiChat,
            "otel" => Format::Otel,
            other => {
                return Err(Error::Usage(format!(
                    "unknown format `{other}` (expected auto, jsonl, openai-chat, otel, docs, locomo, tau-bench or alfworld)"
                )))
            }
        }))
    }

    /// Guesses the format of `path` from its extension and first bytes.
    pub fn detect(path: &Path, bytes: &[u8]) -> Option<Format> {
        let extension = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or_default()
            .to_ascii_lowercase();
        match extension.as_str() {
            "jsonl" | "ndjson" => {
                // The first record tells fluxmem's schema from a chat log.
                // The first record tells fluxmem's schema from OTLP (the Collector's file
                // exporter) and from chat logs.
                let first = source::lines(bytes)
                    .find(|l| !l.iter().all(u8::is_ascii_whitespace))
                    .and_then(|l| std::str::from_utf8(l).ok())
                    .unwrap_or_default();
                return Some(if otel::looks_like(first) {
                    Format::Otel
                } else if openai::looks_like(first) {
                    Format::OpenaiChat
                } else {
                    Format::Jsonl
                });
            }
            "md" | "markdown" | "txt" | "text" | "rst" => return Some(Format::Docs),
            "json" => {}
            _ => return None,
        }
        let head = String::from_utf8_lossy(&bytes[..bytes.len().min(1 << 16)]);
        let trimmed = head.trim_start();
        let locomo = head.contains("\"speaker_a\"")
            || (head.contains("\"qa\"") && head.contains("\"evidence\""));
        if otel::looks_like(trimmed) {
            Some(Format::Otel)
        } else if trimmed.starts_with('[') && locomo {
            Some(Format::Locomo)
        } else if trimmed.starts_with('[') && head.contains("\"traj\"") {
            Some(Format::TauBench)
        } else if trimmed.starts_with('{') && head.contains("Your task is to:") {
            Some(Format::Alfworld)
        } else {
            None
        }
    }
}

/// How to ingest.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Force a format; `None` detects it per file.
    pub format: Option<Format>,
    /// Tenant of records that do not name one.
    pub tenant: String,
    /// Agent id of records that do not name one.
    pub agent_id: Option<String>,
    /// Records larger than this are quarantined.
    pub max_record_bytes: usize,
    /// Maximum words per document chunk.
    pub chunk_words: usize,
    /// Commit at least every this many records.
    pub batch_records: usize,
    /// Commit after a file once this many files were read since the last commit.
    pub batch_files: usize,
    /// Commit after a file once this many input bytes were read since the last commit.
    pub batch_bytes: u64,
    /// The part of the input this run owns (sharded runs); [`Shard::ALL`] by default.
    pub shard: Shard,
    /// Read symbolic links to files (`--follow-symlinks`); off by default, when a walk skips
    /// them (listed in [`IngestReport::skipped`]) and a link named as an input is quarantined.
    /// Links to directories are never followed inside a walk.
    pub follow_symlinks: bool,
    /// Read every input again, ignoring the store's ledger of files already ingested
    /// (`--reread`); see [`LEDGER`].
    pub reread: bool,
    /// The redaction of what an outcome judge reads ([`outcome::transcript`]): a pipeline's
    /// `[redact]`, else every kind.
    pub redact: fluxmem_redact::RedactConfig,
}

impl Default for IngestOptions {
    fn default() -> Self {
        IngestOptions {
            format: None,
            tenant: "default".into(),
            agent_id: None,
            max_record_bytes: 8 << 20,
            chunk_words: 120,
            batch_records: 5000,
            batch_files: 1000,
            batch_bytes: 256 << 20,
            shard: Shard::ALL,
            follow_symlinks: false,
            reread: false,
            redact: fluxmem_redact::RedactConfig::default(),
        }
    }
}

/// Counts of one ingestion run, as `fluxmem ingest --json` prints them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct IngestReport {
    /// Records read.
    pub read: u64,
    /// Records stored: new, or a longer version of a stored conversation (`grown`).
    pub ingested: u64,
    /// Of `ingested`: later, longer versions of a stored conversation, which replaced it
    /// (`episode_grown` edits; see `grow.rs`).
    pub grown: u64,
    /// Of `ingested`: versions of a stored conversation that contradict it (neither is a prefix
    /// of the other), stored as episodes of their own, marked `conflicts_with`.
    pub conflicting: u64,
    /// Records already stored (or seen earlier in this run).
    pub duplicates: u64,
    /// Records sent to the quarantine file.
    pub quarantined: u64,
    /// Records (and rejections) left to other shards of a sharded run.
    pub other_shards: u64,
    /// The quarantine file, if anything was quarantined (as text, lossily where not UTF-8).
    #[serde(serialize_with = "record::lossy_optional_path")]
    pub quarantine_file: Option<PathBuf>,
    /// Nodes added (a record can add several, e.g. a tau-bench run and its policy chunks).
    pub nodes_added: u64,
    /// Input files read.
    pub files: u64,
    /// Input files the ledger knew unchanged (same path, settings and size and mtime, or same
    /// content): not read again, not in `files` or `read`.
    pub unchanged_files: u64,
    /// Commits made.
    pub commits: u64,
    /// New episodes stored, by where their outcome came from (`logged`, `status`, `inferred`,
    /// `judged`, `none`; see [`outcome`]).
    pub outcomes: std::collections::BTreeMap<String, u64>,
    /// Runs the judge was asked about and failed on (they keep the rule's outcome).
    pub judge_errors: u64,
    /// Directories and links the input walk left out on purpose (fluxmem stores, exports and
    /// run reports; file links without `follow_symlinks`), with why. Not records: not in `read`.
    pub skipped: Vec<Skipped>,
}

/// Progress callbacks; the CLI draws a bar from them, tests ignore them.
/// Ingest counts input bytes; it names each file with [`Progress::working_on`], and tells
/// of each quarantined record (kind `quarantined`, the message of [`Rejected::describe`]) and
/// each input the walk left out (kind `skipped`, also in [`IngestReport::skipped`]) with
/// [`Progress::notice`].
pub use fluxmem_graph::{NoProgress, Progress};

/// Ingests every file under `inputs` into the store of `writer`.
///
/// Directories are walked in name order; nothing inside the store of `writer` (nor any other
/// fluxmem store, export or run report) is read, see [`Skipped`].
pub fn ingest(
    writer: &mut Writer,
    inputs: &[PathBuf],
    options: &IngestOptions,
    run_id: &str,
    progress: &mut dyn Progress,
) -> Result<IngestReport> {
    ingest_judged(writer, inputs, options, None, run_id, progress)
}

/// [`ingest`], with a `judge` that gives an outcome to each run whose log says none
/// ([`outcome::OutcomeJudge`]): a new one, or a stored conversation's later version (judged
/// again, as it now reads), as it is put in the batch, so before the batch commits. The judge
/// reads each run as a redacted [`outcome::transcript`]; a run it fails on keeps the rule's
/// outcome and the failure is a notice (kind `judge`) and a count
/// ([`IngestReport::judge_errors`]).
pub fn ingest_judged<'a>(
    writer: &'a mut Writer,
    inputs: &[PathBuf],
    options: &'a IngestOptions,
    judge: Option<&'a mut (dyn outcome::OutcomeJudge + 'a)>,
    run_id: &'a str,
    progress: &mut dyn Progress,
) -> Result<IngestReport> {
    let manifest = writer.manifest().clone();
    let known = writer.store().node_ids(&manifest)?;
    let quarantine_path = writer
        .store()
        .dir()
        .join("quarantine")
        .join(format!("{run_id}.jsonl"));
    let expanded = walk::expand(inputs, options, writer.store().dir());
    let writer_dir = writer.store().dir().to_path_buf();
    let main_dir = writer.staging_main();
    let mut run = Run {
        writer,
        options,
        run_id,
        known,
        pending: Graph::default(),
        pending_records: 0,
        report: IngestReport::default(),
        quarantine_path,
        quarantine: None,
        otel_spans: otel::Collected::default(),
        // The ledger of files already ingested (a shard's own, over its main store's).
        ledger: (!options.reread)
            .then(|| ledger::Ledger::open(&writer_dir, main_dir.as_deref(), options)),
        awaiting: Vec::new(),
        group: (0, 0),
        pending_replaces: false,
        deferred: Vec::new(),
        judge,
        redactor: fluxmem_redact::Redactor::new(options.redact.clone()),
        judged: 0,
    };
    for skipped in &expanded.skipped {
        progress.notice(
            "skipped",
            &format!("{}: {}", skipped.path.display(), skipped.reason),
        );
    }
    run.report.skipped = expanded.skipped;
    for rejected in expanded.rejected {
        run.accept(Parsed::Rejected(rejected), progress)?;
    }
    let files = expanded.files;
    let total: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    progress.start(total);
    if inputs.iter().any(|p| p.as_os_str() == "-") {
        run.stdin(progress)?;
        run.commit(progress)?;
    }
    for file in &files {
        let key = ledger::key_path(file);
        let stat = ledger::stat(file);
        // Bytes read to compare a changed file's hash are parsed from memory, not read again.
        let mut read = None;
        if let (Some(ledger), Some((size, mtime))) = (run.ledger.as_mut(), stat) {
            let unchanged = match ledger.seen(&key, size, mtime) {
                ledger::Seen::Unchanged => true,
                ledger::Seen::Maybe(hash) => match std::fs::read(file) {
                    Ok(bytes) if fluxmem_graph::sha256_hex(&bytes) == hash => {
                        ledger.record(key.clone(), size, mtime, hash)?;
                        true
                    }
                    other => {
                        read = Some(other);
                        false
                    }
                },
                ledger::Seen::New => false,
            };
            if unchanged {
                run.report.unchanged_files += 1;
                progress.working_on(&file.display().to_string());
                progress.advance(size);
                continue;
            }
        }
        let sha256 = run.file(file, read, progress)?;
        if let (Some(_), Some((size, mtime)), Some(sha256)) = (&run.ledger, stat, sha256) {
            run.awaiting.push((key, size, mtime, sha256));
        }
        run.group.0 += 1;
        run.group.1 += stat.map_or(0, |(size, _)| size);
        if run.group.0 >= options.batch_files.max(1) || run.group.1 >= options.batch_bytes {
            run.commit(progress)?;
        }
    }
    for parsed in otel::episodes(std::mem::take(&mut run.otel_spans), options) {
        run.accept(parsed, progress)?;
    }
    run.commit(progress)?;
    run.flush_quarantine()?;
    Ok(run.report)
}

/// How standard input is named in records and errors.
pub const STDIN: &str = "<stdin>";

/// Bytes of an input of unknown format kept in its quarantine record.
const UNKNOWN_EXCERPT_BYTES: usize = 256;

struct Run<'a> {
    writer: &'a mut Writer,
    options: &'a IngestOptions,
    run_id: &'a str,
    known: fluxmem_graph::IdSet,
    pending: Graph,
    pending_records: usize,
    report: IngestReport,
    quarantine_path: PathBuf,
    quarantine: Option<std::io::BufWriter<std::fs::File>>,
    /// OpenTelemetry spans (and GenAI events logged as log records) of the batch, grouped into
    /// episodes after the last file.
    otel_spans: otel::Collected,
    ledger: Option<ledger::Ledger>,
    /// Files read whole whose records wait for the next commit before the ledger records
    /// them: (key, size, mtime, SHA-256).
    awaiting: Vec<(String, u64, i128, String)>,
    /// Files and bytes read since the last commit.
    group: (usize, u64),
    /// The pending delta replaces stored episodes (grown conversations): it commits with
    /// [`Writer::commit`], not `commit_new`.
    pending_replaces: bool,
    /// Records of the batch that are versions of stored conversations, compared with the
    /// stored versions when the batch commits ([`Run::resolve_deferred`]).
    deferred: Vec<Record>,
    /// Gives outcomes to the runs whose log says none, as each is put in the batch.
    judge: Option<&'a mut dyn outcome::OutcomeJudge>,
    /// What the judge's transcripts pass before it reads them.
    redactor: fluxmem_redact::Redactor,
    /// Runs the judge was asked about so far.
    judged: usize,
}

impl Run<'_> {
    /// Reads (unless `read` holds the outcome of reading it already) and parses one file;
    /// returns the SHA-256 of its bytes when the ledger may record it (it was read, and it is
    /// not an OpenTelemetry file, whose spans wait for the batch).
    fn file(
        &mut self,
        path: &Path,
        read: Option<std::io::Result<Vec<u8>>>,
        progress: &mut dyn Progress,
    ) -> Result<Option<String>> {
        let shown = path.display().to_string();
        self.report.files += 1;
        let bytes = match read.unwrap_or_else(|| std::fs::read(path)) {
            Ok(bytes) => bytes,
            Err(e) => {
                let rejected =
                    Rejected::new(&shown, 0, "file", format!("cannot read: {e}"), b"", 0);
                self.accept(Parsed::Rejected(rejected), progress)?;
                return Ok(None);
            }
        };
        let sha256 = fluxmem_graph::sha256_hex(&bytes);
        let mtime = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .and_then(|d| i64::try_from(d.as_millis()).ok())
            // An mtime outside the years 1970..=9999 is no time at all for the store.
            .filter(|&ms| source::in_calendar(ms));
        let format = self.content(&shown, path, bytes, mtime, progress)?;
        Ok((format != Some(Format::Otel)).then_some(sha256))
    }

    fn flush_quarantine(&mut self) -> Result<()> {
        if let Some(file) = self.quarantine.as_mut() {
            file.flush().map_err(|source| Error::Quarantine {
                path: self.quarantine_path.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// Standard input (`-` among the inputs), read whole.
    fn stdin(&mut self, progress: &mut dyn Progress) -> Result<()> {
        self.report.files += 1;
        let mut bytes = Vec::new();
        if let Err(e) = std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut bytes) {
            let rejected = Rejected::new(STDIN, 0, "file", format!("cannot read: {e}"), b"", 0);
            return self.accept(Parsed::Rejected(rejected), progress);
        }
        // No name to detect the format from: `.jsonl` unless --format says otherwise.
        self.content(STDIN, Path::new("stdin.jsonl"), bytes, None, progress)
            .map(|_| ())
    }

    /// Parses the content of one input (`shown` in records and errors; `path` for detection);
    /// returns the format it was read as, if one was found.
    fn content(
        &mut self,
        shown: &str,
        path: &Path,
        bytes: Vec<u8>,
        mtime: Option<i64>,
        progress: &mut dyn Progress,
    ) -> Result<Option<Format>> {
        let read = bytes.len() as u64;
        let opened = match compress::open(path, bytes) {
            Ok(opened) => opened,
            Err(reason) => {
                // One record for the whole file, with no excerpt: the bytes are not text.
                let rejected = Rejected::new(shown, 0, "file", reason, b"", 0);
                progress.working_on(shown);
                progress.advance(read);
                return self
                    .accept(Parsed::Rejected(rejected), progress)
                    .map(|_| None);
            }
        };
        let bytes = opened.bytes;
        let Some(format) = self
            .options
            .format
            .or_else(|| Format::detect(&opened.detect_as, &bytes))
        else {
            let reason = "cannot tell the format from the name and content; pass --format";
            // A short excerpt only: an unknown file may be megabytes of binary data.
            let rejected = Rejected::new(
                shown,
                0,
                "file",
                reason,
                &bytes,
                self.options.max_record_bytes.min(UNKNOWN_EXCERPT_BYTES),
            );
            progress.working_on(shown);
            progress.advance(read);
            return self
                .accept(Parsed::Rejected(rejected), progress)
                .map(|_| None);
        };
        let source = Source {
            path: shown.to_string(),
            mtime,
            options: self.options,
            bytes: &bytes,
        };
        let mut spans = std::mem::take(&mut self.otel_spans);
        let mut emit = |parsed: Parsed| self.accept(parsed, progress);
        match format {
            Format::Jsonl => jsonl::parse(&source, &mut emit)?,
            Format::OpenaiChat => openai::parse(&source, &mut emit)?,
            Format::Docs => docs::parse(&source, &mut emit)?,
            Format::Locomo | Format::TauBench | Format::Alfworld | Format::Otel => {
                match std::str::from_utf8(&bytes) {
                    Err(e) => {
                        let reason = format!(
                            "invalid UTF-8 at byte {} (the whole file is quarantined)",
                            e.valid_up_to()
                        );
                        emit(Parsed::Rejected(source.reject(
                            source.line_at(e.valid_up_to()),
                            "file",
                            reason,
                            &bytes,
                        )))?;
                    }
                    Ok(text) => match format {
                        Format::Locomo => locomo::parse(&source, text, &mut emit)?,
                        Format::TauBench => tau::parse(&source, text, &mut emit)?,
                        // Spans are grouped into episodes once every file is read.
                        Format::Otel => otel::collect(&source, text, &mut spans, &mut emit)?,
                        _ => alfworld::parse(&source, text, &mut emit)?,
                    },
                }
            }
        }
        self.otel_spans = spans;
        progress.working_on(shown);
        progress.advance(read);
        Ok(Some(format))
    }

    fn accept(&mut self, parsed: Parsed, progress: &mut dyn Progress) -> Result<()> {
        match parsed {
            Parsed::Rejected(rejected)
                if !self
                    .options
                    .shard
                    .owns(&format!("{}\0{}", rejected.file, rejected.line)) =>
            {
                self.report.read += 1;
                self.report.other_shards += 1;
                Ok(())
            }
            Parsed::Rejected(rejected) => self.quarantine(rejected, progress),
            Parsed::Record(record) => {
                self.report.read += 1;
                let Some(own) = record.nodes.first() else {
                    return Ok(());
                };
                if !self.options.shard.owns(own.id.as_str()) {
                    self.report.other_shards += 1;
                    return Ok(());
                }
                if self.known.contains(own.id.as_str()) {
                    if !grow::versioned(own) {
                        self.report.duplicates += 1;
                        return Ok(());
                    }
                    // A version of a stored conversation: compared with the stored one at the
                    // next commit, all of the batch's in one read of the store. It does not
                    // count toward the batch (a duplicate never does), so a run resumed after
                    // a kill, which finds its committed records known, commits where the
                    // uninterrupted run did.
                    if !self.pending.nodes.contains_key(&own.id) {
                        self.deferred.push(record);
                        return Ok(());
                    }
                    return self.again(record, &BTreeMap::new(), progress);
                }
                self.store_record(record, false, progress);
                self.counted(progress)
            }
        }
    }

    /// One more record in the batch: commits when the batch is full.
    fn counted(&mut self, progress: &mut dyn Progress) -> Result<()> {
        self.pending_records += 1;
        if self.pending_records >= self.options.batch_records {
            self.commit(progress)?;
        }
        Ok(())
    }

    /// A record whose episode id is known (`stored`: the stored versions read for the batch),
    /// through [`Run::known_again`], then stored unless it adds nothing.
    fn again(
        &mut self,
        mut record: Record,
        stored: &BTreeMap<fluxmem_graph::NodeId, fluxmem_graph::Node>,
        progress: &mut dyn Progress,
    ) -> Result<()> {
        let replaces = match self.known_again(&mut record, stored, progress)? {
            grow::Growth::Nothing => {
                self.report.duplicates += 1;
                return Ok(());
            }
            grow::Growth::Grows | grow::Growth::Continues => {
                self.report.grown += 1;
                true
            }
            grow::Growth::Contradicts => {
                self.report.conflicting += 1;
                false
            }
        };
        self.store_record(record, replaces, progress);
        Ok(())
    }

    /// Puts a record's new nodes (and, when it `replaces` a stored episode, its first node)
    /// into the batch.
    fn store_record(&mut self, record: Record, replaces: bool, progress: &mut dyn Progress) {
        self.report.ingested += 1;
        for (i, mut node) in record.nodes.into_iter().enumerate() {
            let added = self.known.insert(node.id.as_str());
            if added || (i == 0 && replaces) {
                if node.episode().is_some() && added {
                    self.label(&mut node, progress);
                    *self
                        .report
                        .outcomes
                        .entry(node.outcome_source().to_string())
                        .or_default() += 1;
                }
                self.report.nodes_added += u64::from(added);
                self.pending.insert_node(node);
            }
        }
    }

    /// The batch's deferred records (versions of stored conversations), in their order: the
    /// stored versions read in one scan, then each compared and stored.
    fn resolve_deferred(&mut self, progress: &mut dyn Progress) -> Result<()> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        let records = std::mem::take(&mut self.deferred);
        let ids: BTreeSet<fluxmem_graph::NodeId> =
            records.iter().map(|r| r.nodes[0].id.clone()).collect();
        let stored = self.stored_nodes(ids)?;
        for record in records {
            self.again(record, &stored, progress)?;
        }
        Ok(())
    }

    /// A record whose episode id is known: compared with the stored version (this run's pending
    /// one first), see [`grow`]. A growth replaces the episode in the record (the record's loop
    /// stores it although its id is known, and an `episode_grown` edit holds the version it
    /// replaces); a contradiction gives it the id of where it parts from the stored one, which
    /// may itself be known: then it is compared with that version in turn.
    fn known_again(
        &mut self,
        record: &mut Record,
        read: &BTreeMap<fluxmem_graph::NodeId, fluxmem_graph::Node>,
        progress: &mut dyn Progress,
    ) -> Result<grow::Growth> {
        let Some(stored) = self.version(&record.nodes[0].id, read)? else {
            return Ok(grow::Growth::Nothing);
        };
        let growth = grow::compare(&stored, &record.nodes[0]);
        if growth != grow::Growth::Contradicts {
            return self.apply(record, &stored, growth, progress);
        }
        // It parts from the stored version: the id of where it parts, which may be known.
        if !self.set_apart(record, |new| grow::apart(&stored, new)) {
            return Ok(grow::Growth::Contradicts);
        }
        let Some(divergent) = self.version(&record.nodes[0].id, read)? else {
            return Ok(grow::Growth::Nothing);
        };
        match grow::compare(&divergent, &record.nodes[0]) {
            // It parts from that version too: an id of its whole content.
            grow::Growth::Contradicts => {
                if self.set_apart(record, |new| grow::whole(&divergent, new)) {
                    Ok(grow::Growth::Nothing)
                } else {
                    Ok(grow::Growth::Contradicts)
                }
            }
            growth => self.apply(record, &divergent, growth, progress),
        }
    }

    /// Gives the record's episode the id `apart` makes; whether that id is known.
    fn set_apart(
        &self,
        record: &mut Record,
        apart: impl FnOnce(fluxmem_graph::Node) -> fluxmem_graph::Node,
    ) -> bool {
        let node = apart(record.nodes.remove(0));
        let known = self.known.contains(node.id.as_str());
        record.nodes.insert(0, node);
        known
    }

    /// The version of episode `id` to compare with: this run's pending one, else the one read
    /// for the batch, else the store's.
    fn version(
        &self,
        id: &fluxmem_graph::NodeId,
        read: &BTreeMap<fluxmem_graph::NodeId, fluxmem_graph::Node>,
    ) -> Result<Option<fluxmem_graph::Node>> {
        match self.pending.nodes.get(id).or_else(|| read.get(id)) {
            Some(node) => Ok(Some(node.clone())),
            None => Ok(self.stored_nodes([id.clone()].into())?.remove(id)),
        }
    }

    /// Applies what [`grow::compare`] said of the record's episode against `stored`.
    fn apply(
        &mut self,
        record: &mut Record,
        stored: &fluxmem_graph::Node,
        growth: grow::Growth,
        progress: &mut dyn Progress,
    ) -> Result<grow::Growth> {
        let new = record.nodes.remove(0);
        match growth {
            grow::Growth::Nothing => {}
            grow::Growth::Grows | grow::Growth::Continues => {
                let at = new.created_at.unwrap_or(0);
                let mut node = grow::grown(stored, new, growth == grow::Growth::Continues);
                self.label(&mut node, progress);
                let reason = format!(
                    "a later version of the conversation: {} steps, were {}",
                    node.episode().map_or(0, |e| e.steps.len()),
                    stored.episode().map_or(0, |e| e.steps.len())
                );
                self.pending.edits.push(fluxmem_graph::Edit::new(
                    "ingest",
                    self.run_id,
                    fluxmem_graph::EPISODE_GROWN,
                    fluxmem_graph::Changed::Node(Some(stored), Some(&node)),
                    &reason,
                    at,
                ));
                self.pending_replaces |= !self.pending.nodes.contains_key(&node.id);
                record.nodes.insert(0, node);
            }
            grow::Growth::Contradicts => record.nodes.insert(0, new),
        }
        Ok(growth)
    }

    /// The stored nodes `ids` with their steps (those the store holds), in one scan.
    fn stored_nodes(
        &self,
        ids: BTreeSet<fluxmem_graph::NodeId>,
    ) -> Result<BTreeMap<fluxmem_graph::NodeId, fluxmem_graph::Node>> {
        let scan = fluxmem_store::Scan {
            nodes: true,
            nodes_of: Some(ids.clone()),
            steps: fluxmem_store::Rows::Of(ids),
            ..Default::default()
        };
        Ok(self
            .writer
            .store()
            .scan_at(self.writer.manifest(), &scan)?
            .nodes)
    }

    fn quarantine(&mut self, rejected: Rejected, progress: &mut dyn Progress) -> Result<()> {
        self.report.read += 1;
        self.report.quarantined += 1;
        progress.notice("quarantined", &rejected.describe());
        let path = self.quarantine_path.clone();
        let io = |source| Error::Quarantine {
            path: path.clone(),
            source,
        };
        if self.quarantine.is_none() {
            std::fs::create_dir_all(path.parent().expect("quarantine file has a parent"))
                .map_err(io)?;
            self.quarantine = Some(std::io::BufWriter::new(
                std::fs::File::create(&path).map_err(io)?,
            ));
            self.report.quarantine_file = Some(path.clone());
        }
        let file = self.quarantine.as_mut().expect("just opened");
        let line = serde_json::to_string(&rejected).expect("a rejection always serializes");
        writeln!(file, "{line}").map_err(io)?;
        Ok(())
    }

    /// Where an episode's outcome comes from ([`outcome::label`]), and with a judge, the
    /// judge's outcome when the log says none (the bar names each run judged).
    fn label(&mut self, node: &mut fluxmem_graph::Node, progress: &mut dyn Progress) {
        outcome::label(node);
        let Some(judge) = self.judge.as_deref_mut() else {
            return;
        };
        if !outcome::needs_judging(node) {
            return;
        }
        self.judged += 1;
        progress.working_on(&format!(
            "judging outcomes with {}: run {}",
            judge.model(),
            self.judged
        ));
        let shown = outcome::transcript(node, outcome::TRANSCRIPT_CHARS, &self.redactor);
        match judge.judge(&[shown]) {
            Ok(p) if p.len() == 1 => {
                let model = judge.model().to_string();
                outcome::judged(node, p[0], &model);
            }
            answer => {
                let why = match answer {
                    Err(e) => e,
                    Ok(p) => format!("{} answers for 1 run", p.len()),
                };
                self.report.judge_errors += 1;
                progress.notice(
                    "judge",
                    &format!(
                        "{}: the judge failed ({why}); the rule's outcome stays",
                        node.id
                    ),
                );
            }
        }
    }

    /// Commits the pending records (if any), then records in the ledger the files read whole
    /// before it, and starts a new group.
    fn commit(&mut self, progress: &mut dyn Progress) -> Result<()> {
        self.commit_pending(progress)?;
        self.group = (0, 0);
        if !self.awaiting.is_empty() {
            // The files' quarantined records too must be on disk before the ledger skips them.
            self.flush_quarantine()?;
            if let Some(ledger) = self.ledger.as_mut() {
                for (key, size, mtime, sha256) in std::mem::take(&mut self.awaiting) {
                    ledger.record(key, size, mtime, sha256)?;
                }
            }
        }
        Ok(())
    }

    fn commit_pending(&mut self, progress: &mut dyn Progress) -> Result<()> {
        self.resolve_deferred(progress)?;
        if self.pending.is_empty() {
            return Ok(());
        }
        // Quarantined records must be on disk before the commit that counts past them.
        if let Some(file) = self.quarantine.as_mut() {
            file.flush().map_err(|source| Error::Quarantine {
                path: self.quarantine_path.clone(),
                source,
            })?;
        }
        let summary = serde_json::json!({ "nodes": self.pending.nodes.len(), "records": self.pending_records });
        let info = CommitInfo {
            stage: "ingest".into(),
            run_id: self.run_id.to_string(),
            summary,
            progress: Default::default(),
        };
        // Only nodes whose ids the store does not hold (`known` says so, see `accept`): the
        // manifest's live counts carry forward; a delta replacing grown episodes commits whole.
        if std::mem::take(&mut self.pending_replaces) {
            self.writer.commit(&self.pending, info)?;
        } else {
            self.writer.commit_new(&self.pending, info)?;
        }
        self.pending = Graph::default();
        self.pending_records = 0;
        self.report.commits += 1;
        Ok(())
    }
}
