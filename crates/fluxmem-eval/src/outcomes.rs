//! `fluxmem eval outcomes`: ingest's outcome rule ([`fluxmem_ingest::outcome::infer`]) against
//! the outcomes a file logs, with the logged outcomes hidden from the rule.
//!
//! Each file is ingested into a temporary store as a night would; every episode with a logged
//! outcome is then given to the rule without it (the rule reads only the steps), and the
//! rule's answer (success, failure or unknown) is tallied against the logged one. The logged
//! outcome is read only to score.
//!
//! With a judge ([`Judging`], `eval outcomes --judge MODEL`), a seeded sample of the same
//! episodes is also read by the judge as ingest's `--label-outcomes` would read it (the
//! redacted [`fluxmem_ingest::outcome::transcript`], which never shows the outcome) and its
//! answers are tallied the same way, beside the rule's on the same sample.

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
    /// The judge's answers on a sample, when one was asked.
    pub judge: Option<JudgeConfusion>,
}

/// A judge's answers (`success`, `failure`, `error`) against the logged outcomes of a sample,
/// with the rule's (`success`, `failure`, `unknown`) on the same episodes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JudgeConfusion {
    /// The judge's model.
    pub model: String,
    /// Episodes judged (the sample).
    pub episodes: usize,
    /// `[logged success, logged failure]` counts of each of the judge's answers.
    pub table: BTreeMap<String, [usize; 2]>,
    /// The rule's answers on the same episodes.
    pub rule: BTreeMap<String, [usize; 2]>,
    /// Mean characters of a transcript the judge read.
    pub mean_chars: usize,
    /// Seconds the judge took.
    pub seconds: f64,
    /// Each judged episode: its id, the logged outcome and the judge's probability of success.
    pub answers: Vec<(String, bool, Option<f32>)>,
}

impl JudgeConfusion {
    /// How well the judge's probabilities order the sample: the chance that a logged success
    /// scores above a logged failure (ties count half), whatever the threshold; `None` without
    /// both.
    pub fn auc(&self) -> Option<f64> {
        let scores = |logged: bool| -> Vec<f32> {
            self.answers
                .iter()
                .filter(|(_, l, _)| *l == logged)
                .filter_map(|(_, _, p)| *p)
                .collect()
        };
        crate::metrics::auc(&scores(true), &scores(false))
    }
}

/// A judge for [`outcome_rule`] and which episodes it reads.
pub struct Judging<'a> {
    /// The judge.
    pub judge: &'a mut dyn fluxmem_ingest::outcome::OutcomeJudge,
    /// Episodes judged at most (a seeded sample; 0: all).
    pub sample: usize,
    /// The sample's seed.
    pub seed: u64,
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

/// Ingests `data` into a temporary store and scores the rule on its logged outcomes, and, with
/// `judging`, the judge on a sample of them.
pub fn outcome_rule(data: &Path, judging: Option<Judging<'_>>) -> Result<OutcomeConfusion> {
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
    let mut scored = Vec::new();
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
        let inferred = rule_on(episode);
        let column = usize::from(!logged);
        out.episodes += 1;
        out.table.entry(answer(inferred.success)).or_default()[column] += 1;
        out.by_rule.entry(inferred.rule.to_string()).or_default()[column] += 1;
        scored.push((node, logged));
    }
    if let Some(judging) = judging {
        out.judge = Some(judge(scored, judging));
    }
    Ok(out)
}

/// The rule on an episode with its outcome hidden.
fn rule_on(episode: &fluxmem_graph::Episode) -> fluxmem_ingest::outcome::Inferred {
    let mut hidden = episode.clone();
    hidden.outcome = fluxmem_graph::Outcome::default();
    fluxmem_ingest::outcome::infer(&hidden)
}

fn answer(success: Option<bool>) -> String {
    match success {
        Some(true) => "success",
        Some(false) => "failure",
        None => "unknown",
    }
    .to_string()
}

/// The judge on a seeded sample of the scored episodes (in id order before sampling).
fn judge(scored: Vec<(&fluxmem_graph::Node, bool)>, judging: Judging<'_>) -> JudgeConfusion {
    let sample = match judging.sample {
        0 => scored,
        n => crate::locomo::seeded_sample(scored, n, judging.seed),
    };
    let redactor = fluxmem_redact::Redactor::default();
    let started = std::time::Instant::now();
    let mut out = JudgeConfusion {
        model: judging.judge.model().to_string(),
        ..Default::default()
    };
    let mut chars = 0;
    for (node, logged) in sample {
        let column = usize::from(!logged);
        let shown = fluxmem_ingest::outcome::transcript(
            node,
            fluxmem_ingest::outcome::TRANSCRIPT_CHARS,
            &redactor,
        );
        chars += shown.chars().count();
        let p = match judging.judge.judge(&[shown]) {
            Ok(p) if p.len() == 1 => Some(p[0]),
            _ => None,
        };
        let said = match p {
            Some(p) => answer(Some(p >= fluxmem_ingest::outcome::JUDGED_SUCCESS_AT)),
            None => "error".to_string(),
        };
        out.table.entry(said).or_default()[column] += 1;
        let rule = rule_on(node.episode().expect("scored episodes are episodes"));
        out.rule.entry(answer(rule.success)).or_default()[column] += 1;
        out.answers.push((node.id.to_string(), logged, p));
        out.episodes += 1;
    }
    out.mean_chars = chars / out.episodes.max(1);
    out.seconds = started.elapsed().as_secs_f64();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_counts_the_pairs_a_judge_orders_right_and_ties_as_half() {
        let answer = |logged: bool, p: Option<f32>| ("e".to_string(), logged, p);
        let mut judged = JudgeConfusion {
            answers: vec![
                answer(true, Some(0.9)),
                answer(true, Some(0.4)),
                answer(false, Some(0.4)),
                answer(false, Some(0.1)),
                answer(false, None),
            ],
            ..Default::default()
        };
        // Pairs: (0.9, 0.4) (0.9, 0.1) (0.4, 0.1) right, (0.4, 0.4) a tie: 3.5 of 4.
        assert_eq!(judged.auc(), Some(0.875));
        judged.answers.retain(|(_, logged, _)| *logged);
        assert_eq!(judged.auc(), None);
    }
}
