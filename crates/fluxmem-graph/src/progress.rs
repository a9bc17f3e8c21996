//! The one progress interface of every long stage (ingest, embed, connect, refine,
//! consolidate). Stages report through it; only the binary draws it (progress bars on stderr),
//! and library callers pass [`NoProgress`].

/// Progress callbacks. Every method has an empty default, so a caller implements only what it
/// shows.
pub trait Progress {
    /// `total` units of work lie ahead, in the stage's own unit (ingest: input bytes; embed:
    /// nodes; connect and refine: episodes or sources; consolidate: clusters).
    fn start(&mut self, _total: u64) {}
    /// `done` more units are done.
    fn advance(&mut self, _done: u64) {}
    /// The item now worked on, for display (ingest: the file being read).
    fn working_on(&mut self, _item: &str) {}
    /// Something to tell the user as it happens, of a `kind` (ingest: `quarantined` for a
    /// rejected record, `skipped` for an input the walk left out); it is also in the stage's
    /// report.
    fn notice(&mut self, _kind: &str, _message: &str) {}
}

/// A [`Progress`] that shows nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
