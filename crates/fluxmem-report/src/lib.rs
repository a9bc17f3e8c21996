//! The record and report of one pipeline run (`fluxmem run PIPELINE.toml`).
//!
//! - [`RunRecord`] (with [`StageRecord`], [`QuarantineSummary`], [`UsageRecord`],
//!   [`PemsSummary`], [`SkillSummary`]): what the run did, serialised as `run.json`.
//! - [`render_html`]: one self-contained HTML page of the record: header (the status as a badge
//!   that names it: green `ok`, amber `degraded`, orange `partial`, red `failed`, and under it
//!   the record's `reasons`), stage table and timing chart, PEMS curve, skills converged by
//!   round, cluster sizes, top skills with their provenance, quarantine and model usage. Charts
//!   are SVG drawn by `plotters` and inlined; the page has no script and references nothing
//!   outside itself. All record text is HTML-escaped (skill names come from a generator). The
//!   same record always gives the same bytes.
//! - [`write_report`]: writes `run.json` and `report.html` into a directory, each by atomic
//!   rename of a temporary file in that directory.
//!
//! ```
//! use fluxmem_report::{render_html, write_report, RunRecord, StageRecord};
//! let mut run = RunRecord { run_id: "night-1".into(), status: "ok".into(), ..Default::default() };
//! run.stages.push(StageRecord { name: "ingest".into(), status: "done".into(), seconds: 1.5, ..Default::default() });
//! let html = render_html(&run).unwrap();
//! assert!(html.contains("no skills this run"));
//! let dir = tempfile::tempdir().unwrap();
//! let (json, page) = write_report(dir.path(), &run).unwrap();
//! assert!(json.ends_with("run.json") && page.ends_with("report.html"));
//! ```

mod charts;
mod html;
mod record;

pub use html::render_html;
pub use record::{
    PemsSummary, QuarantineSample, QuarantineSummary, RunRecord, SkillSummary, StageRecord,
    UsageRecord,
};

use std::io::Write as _;
use std::path::{Path, PathBuf};

/// The record's file name inside the report directory.
pub const RUN_JSON: &str = "run.json";
/// The report's file name inside the report directory.
pub const REPORT_HTML: &str = "report.html";

/// Errors of the report crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The record could not be serialised to JSON.
    #[error("serialising the run record: {0}")]
    Json(#[from] serde_json::Error),
    /// A chart could not be drawn.
    #[error("drawing the `{chart}` chart: {message}")]
    Chart {
        /// Which chart.
        chart: String,
        /// What the plotting library said.
        message: String,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Writes `run.json` (pretty JSON) and `report.html` into `dir`, creating `dir` if needed, and
/// returns their paths. Each file is written to a temporary file in `dir`, synced, then renamed
/// over the final name, so a reader sees the old file or the new one; no temporary file is left
/// behind, even on error. The HTML is rendered before anything is written.
pub fn write_report(dir: &Path, run: &RunRecord) -> Result<(PathBuf, PathBuf)> {
    let mut json = serde_json::to_string_pretty(run)?;
    json.push('\n');
    let html = render_html(run)?;
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let json_path = dir.join(RUN_JSON);
    let html_path = dir.join(REPORT_HTML);
    write_atomically(&json_path, json.as_bytes())?;
    write_atomically(&html_path, html.as_bytes())?;
    sync_dir(dir);
    Ok((json_path, html_path))
}

/// Writes `bytes` to `.<name>.tmp-<pid>` next to `path`, syncs it and renames it to `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })()
    .map_err(|source| Error::Io {
        path: temp.clone(),
        source,
    })
    .and_then(|()| {
        std::fs::rename(&temp, path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    });
    if written.is_err() {
        // Best effort: the error that matters is the one being returned.
        let _ = std::fs::remove_file(&temp);
    }
    written
}

/// Syncs the directory so the renames survive a crash (best effort: not every platform can
/// open a directory).
fn sync_dir(dir: &Path) {
    if let Ok(handle) = std::fs::File::open(dir) {
        let _ = handle.sync_all();
    }
}
