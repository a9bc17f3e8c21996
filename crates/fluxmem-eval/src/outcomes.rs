//! `fluxmem eval outcomes`: ingest's outcome rule ([`fluxmem_ingest::outcome::infer`]) against
//! the outcomes a file logs, with the logged outcomes hidden from the rule.
//!
//! Each file is ingested into a temporary store as a night would; every episode with a logged
//! outcome is then given to the rule without it (the rule reads only the steps), and the
//! rule's answer (success, failure or unknown) is tallied against the logged one. The logged
//! outcome is read only to score.

use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

use crate::Result;

/// The rule's answers against the logged outcomes of one file.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OutcomeConfusion {
    /// The file.
    pub file: String,
    /// Episodes with a logged outcome.
    pub episodes: usize,
    /// `[logged success, logged failure]` counts of each answer: `success`, `failure`,
    /// `unknown`.
    pub table: BTreeMap<String, [usize; 2]>,
    /// The same, by the part of the rule that decided.
    pub by_rule: BTreeMap<String, [usize; 2]>,
}

impl OutcomeConfusion {
    /// Share of the rule's decided answers (success or failure) that match the log.
    pub fn precision_of_decided(&self) -> f64 {
        let right = self.table.get("success").map_or(0, |c| c[0])
            + self.table.get("failure").map_or(0, |c| c[1]);
        let decided: usize = ["success", "failure"]
            .iter()
            .filter_map(|k| self.table.get(*k))
            .map(|c| c[0] + c[1])
            .sum();
        if decided == 0 {
            0.0
        } else {
            right as f64 / decided as f64
        }
    }

    /// Share of the episodes the rule decides.
    pub fn coverage(&self) -> f64 {
        let unknown = self.table.get("unknown").map_or(0, |c| c[0] + c[1]);
        if self.episodes == 0 {
            0.0
        } else {
            1.0 - unknown as f64 / self.episodes as f64
        }
    }
}

/// Ingests `data` into a temporary store and scores the rule on its logged outcomes.
pub fn outcome_rule(data: &Path) -> Result<OutcomeConfusion> {
    let dir = tempfile::tempdir().map_err(|source| crate::Error::Io {
        path: std::env::temp_dir(),
        source,
    })?;
    let store = dir.path().join("store");
    let mut writer = fluxmem_store::Writer::open(&store)?;
    fluxmem_ingest::ingest(
        &mut writer,
        &[data.to_path_buf()],
        &fluxmem_ingest::IngestOptions::default(),
        "eval-outcomes",
        &mut fluxmem_ingest::NoProgress,
    )?;
    // The episodes with their steps; nothing else of the store is needed.
    let graph = writer.store().scan_at(
        writer.manifest(),
        &fluxmem_store::Scan {
            nodes: true,
            node_kinds: vec![fluxmem_graph::NodeKind::Episodic],
            steps: fluxmem_store::Rows::All,
            ..Default::default()
        },
    )?;
    let mut out = OutcomeConfusion {
        file: data.display().to_string(),
        ..Default::default()
    };
    for node in graph.nodes.values() {
        let Some(episode) = node.episode() else {
            continue;
        };
        let Some(logged) = episode.outcome.success else {
            continue;
        };
        if node.outcome_source() != "logged" && node.outcome_source() != "status" {
            continue;
        }
        let mut hidden = episode.clone();
        hidden.outcome = fluxmem_graph::Outcome::default();
        let inferred = fluxmem_ingest::outcome::infer(&hidden);
        let answer = match inferred.success {
            Some(true) => "success",
            Some(false) => "failure",
            None => "unknown",
        };
        let column = usize::from(!logged);
        out.episodes += 1;
        out.table.entry(answer.to_string()).or_default()[column] += 1;
        out.by_rule.entry(inferred.rule.to_string()).or_default()[column] += 1;
    }
    Ok(out)
}
