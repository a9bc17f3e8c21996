//! Progress bars on stderr (indicatif), hidden when disabled.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-count bar for ingestion.
pub struct IngestBar {
    bar: ProgressBar,
    quarantined: u64,
}

impl IngestBar {
    pub fn new(enabled: bool) -> IngestBar {
        let bar = ProgressBar::with_draw_target(
            Some(0),
            if enabled {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        bar.set_style(
            ProgressStyle::with_template("{spinner} ingest [{bar:30}] {bytes}/{total_bytes} {msg}")
                .expect("static template is valid")
                .progress_chars("=> "),
        );
        IngestBar {
            bar,
            quarantined: 0,
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl fluxmem_graph::Progress for IngestBar {
    fn start(&mut self, total_bytes: u64) {
        self.bar.set_length(total_bytes);
    }

    fn advance(&mut self, bytes: u64) {
        self.bar.inc(bytes);
    }

    fn working_on(&mut self, file: &str) {
        let name = file.rsplit('/').next().unwrap_or(file);
        self.bar
            .set_message(format!("{name} ({} quarantined)", self.quarantined));
    }

    /// Quarantined records and the judge's failures are printed as they happen; skipped
    /// inputs are listed by the command from the report.
    fn notice(&mut self, kind: &str, message: &str) {
        match kind {
            "quarantined" => {
                self.quarantined += 1;
                self.bar.suspend(|| eprintln!("quarantined: {message}"));
            }
            "judge" => self.bar.suspend(|| eprintln!("judge: {message}")),
            _ => {}
        }
    }
}

/// A count bar for stages that process items.
pub struct CountBar {
    bar: ProgressBar,
}

impl CountBar {
    pub fn new(enabled: bool, stage: &str) -> CountBar {
        let bar = ProgressBar::with_draw_target(
            Some(0),
            if enabled {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "{{spinner}} {stage} [{{bar:30}}] {{pos}}/{{len}} ({{per_sec}}, eta {{eta}})"
            ))
            .expect("template is valid")
            .progress_chars("=> "),
        );
        CountBar { bar }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    /// `done` of `total` items are finished.
    pub fn set(&self, done: u64, total: u64) {
        self.bar.set_length(total);
        self.bar.set_position(done);
    }
}

impl fluxmem_graph::Progress for CountBar {
    fn start(&mut self, total: u64) {
        self.bar.set_length(total);
    }

    fn advance(&mut self, done: u64) {
        self.bar.inc(done);
    }
}
