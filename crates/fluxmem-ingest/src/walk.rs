//! Expanding the inputs of a batch into the files to read.
//!
//! Directories are walked in name order and hidden entries are left out. What fluxmem writes
//! is never read back as input: the store being written (and anything inside it), any other
//! fluxmem store and its `quarantine/` and `staging/` folders, skill exports and run reports
//! are skipped, each reported as a [`Skipped`]. Symbolic links to files are read only with
//! [`IngestOptions::follow_symlinks`] (a walk skips and reports them otherwise); links to
//! directories are never followed inside a walk (no loops), and are quarantined as before.
//! A path named explicitly is refused (quarantined, [`Rejected`]) when it is a link and links
//! are not followed, or when it is a file inside a fluxmem store.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::{IngestOptions, Rejected};

/// A directory or link that an input walk left out on purpose, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// The path as walked (under the input that led to it); written as text, lossily where
    /// it is not UTF-8 (a report must not fail on a file name).
    #[serde(serialize_with = "crate::record::lossy_path")]
    pub path: PathBuf,
    /// Why it was not read.
    pub reason: String,
}

/// The inputs of a batch, expanded.
#[derive(Debug, Default)]
pub(crate) struct Expanded {
    /// Files to read, in order.
    pub files: Vec<PathBuf>,
    /// Inputs that cannot or must not be read (missing, unreadable, refused), to quarantine.
    pub rejected: Vec<Rejected>,
    /// Directories and links left out on purpose.
    pub skipped: Vec<Skipped>,
}

/// Expands `inputs` for a batch written to the store at `store`.
pub(crate) fn expand(inputs: &[PathBuf], options: &IngestOptions, store: &Path) -> Expanded {
    let mut walk = Walk {
        follow_symlinks: options.follow_symlinks,
        store: canonical(store),
        out: Expanded::default(),
    };
    // `-` is standard input, read by the caller.
    for input in inputs.iter().filter(|p| p.as_os_str() != "-") {
        walk.input(input);
    }
    walk.out
}

struct Walk {
    follow_symlinks: bool,
    /// The store being written, canonicalized.
    store: PathBuf,
    out: Expanded,
}

impl Walk {
    /// One path named by the caller (command line or a pipeline's `[[inputs]]`).
    fn input(&mut self, input: &Path) {
        let is_link = std::fs::symlink_metadata(input).is_ok_and(|m| m.file_type().is_symlink());
        if is_link && !self.follow_symlinks {
            let reason = format!(
                "is a symbolic link{}; links are not followed: pass --follow-symlinks to read it",
                target_of(input)
            );
            return self.reject(input, reason);
        }
        if input.is_dir() {
            self.dir(input);
        } else if input.is_file() {
            match self.in_a_store(input) {
                Some(reason) => self.reject(input, reason),
                None => self.out.files.push(input.to_path_buf()),
            }
        } else {
            self.reject(
                input,
                "input does not exist or is not a regular file".into(),
            );
        }
    }

    /// Walks `dir` in name order, unless it is fluxmem's own output.
    fn dir(&mut self, dir: &Path) {
        if let Some(reason) = self.own_output(dir) {
            return self.skip(dir.to_path_buf(), reason);
        }
        let mut entries: Vec<PathBuf> = match std::fs::read_dir(dir) {
            Ok(entries) => entries.flatten().map(|e| e.path()).collect(),
            Err(e) => return self.reject(dir, format!("cannot read directory: {e}")),
        };
        entries.sort();
        for path in entries {
            if !path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'))
            {
                self.entry(path);
            }
        }
    }

    /// One directory entry: walked, read, skipped (a file link) or quarantined (unreadable
    /// metadata, a directory link, a broken link, a pipe or a device).
    fn entry(&mut self, path: PathBuf) {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            return self.reject(&path, "cannot read file metadata".into());
        };
        if meta.is_dir() {
            self.dir(&path);
        } else if meta.is_file() {
            self.out.files.push(path);
        } else if meta.file_type().is_symlink() && path.is_file() {
            self.file_link(path);
        } else {
            self.reject(
                &path,
                "not a regular file (directory link, pipe or device); not read".into(),
            );
        }
    }

    /// A link to a file met in a walk: read only when links are followed, and never when its
    /// target lies in a fluxmem store.
    fn file_link(&mut self, path: PathBuf) {
        if !self.follow_symlinks {
            let reason = format!(
                "symbolic link{} not followed (pass --follow-symlinks to read it)",
                target_of(&path)
            );
            return self.skip(path, reason);
        }
        match self.in_a_store(&path) {
            Some(reason) => self.skip(path, reason),
            None => self.out.files.push(path),
        }
    }

    /// Why the file `path` must not be read: it lies (after resolving links) in the store being
    /// written or in another fluxmem store.
    fn in_a_store(&self, path: &Path) -> Option<String> {
        let real = canonical(path);
        if real.starts_with(&self.store) {
            return Some(format!(
                "inside the store being written ({}); fluxmem does not ingest its own store",
                self.store.display()
            ));
        }
        real.ancestors().skip(1).find_map(|dir| {
            store_marker(dir).map(|why| {
                format!(
                    "inside the fluxmem store {} ({why}); fluxmem does not ingest its stores",
                    dir.display()
                )
            })
        })
    }

    /// Why the directory `dir` is fluxmem's own output and must not be walked, if it is.
    fn own_output(&self, dir: &Path) -> Option<String> {
        let real = canonical(dir);
        if real.starts_with(&self.store) {
            return Some(format!(
                "the store being written ({}) or a folder inside it",
                self.store.display()
            ));
        }
        if let Some(why) = store_marker(dir) {
            return Some(format!("a fluxmem store ({why})"));
        }
        let name = real
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name == "quarantine" || name == fluxmem_store::STAGING || name == fluxmem_store::SCRATCH
        {
            if let Some(why) = real.parent().and_then(store_marker) {
                return Some(format!("the {name}/ folder of a fluxmem store ({why})"));
            }
        }
        output_marker(dir)
    }

    fn skip(&mut self, path: PathBuf, reason: String) {
        self.out.skipped.push(Skipped { path, reason });
    }

    fn reject(&mut self, path: &Path, reason: String) {
        self.out.rejected.push(Rejected::new(
            &path.display().to_string(),
            0,
            "file",
            reason,
            b"",
            0,
        ));
    }
}

/// How `dir` shows itself to be a fluxmem store, if it is one: a `manifest.json` with
/// `"format": "fluxmem-store"`, or a `shards/` folder next to a `LOCK` file.
fn store_marker(dir: &Path) -> Option<&'static str> {
    if format_of(&dir.join("manifest.json")).as_deref() == Some(fluxmem_store::FORMAT) {
        Some("its manifest.json has format fluxmem-store")
    } else if dir.join("shards").is_dir() && dir.join("LOCK").is_file() {
        Some("it holds shards/ and LOCK")
    } else {
        None
    }
}

/// How `dir` shows itself to be a fluxmem skill export (a `release.json` whose `format`
/// starts with `fluxmem`) or run report (`run.json` with `report.html`), if it is one.
fn output_marker(dir: &Path) -> Option<String> {
    if format_of(&dir.join("release.json")).is_some_and(|format| format.starts_with("fluxmem")) {
        Some("a fluxmem export (its release.json has a fluxmem format)".into())
    } else if dir.join("run.json").is_file() && dir.join("report.html").is_file() {
        Some("a fluxmem run report (it holds run.json and report.html)".into())
    } else {
        None
    }
}

/// The string `format` of the JSON object in the file `path`, if there is one.
fn format_of(path: &Path) -> Option<String> {
    #[derive(Deserialize)]
    struct Tagged {
        format: Option<String>,
    }
    if !path.is_file() {
        return None;
    }
    let bytes = std::fs::read(path).ok()?;
    serde_json::from_slice::<Tagged>(&bytes).ok()?.format
}

/// ` (to <target>)` for a link whose target can be read, else nothing.
fn target_of(link: &Path) -> String {
    std::fs::read_link(link)
        .map(|target| format!(" (to {})", target.display()))
        .unwrap_or_default()
}

/// `path` with links and `..` resolved, or as given when that fails.
fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}
