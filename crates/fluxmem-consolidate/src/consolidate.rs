//! The `consolidate` stage: cluster, match clusters to existing skills, mature, commit.

use candle_core::Device;
use fluxmem_graph::{
    sha256_hex, Changed, Edge, EdgeKind, Edit, Embedding, Graph, Node, NodeBody, NodeId, NodeKind,
    Skill,
};
use fluxmem_models::Usage;
use fluxmem_store::{CommitInfo, Rows, Scan, Writer};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::flow::ToolRoles;
use crate::kmeans::{kmeans, KMeansOptions};
use crate::mature::{mature, Attempt, Job, Matured, Models, Round};
use crate::pems::{PemsOptions, PemsScore};
use crate::{Error, Result};

/// The stage name written on nodes, edges, edits and commits.
pub const STAGE: &str = "consolidate";

/// The outcome sources an episode's `outcome_source` can name, besides `none`.
pub const OUTCOME_SOURCES: [&str; 4] = ["logged", "status", "inferred", "judged"];

/// How to consolidate. A sharded run's shared plan records them ([`plan_shared`]): every shard
/// runs with the plan's settings (see [`shared_settings`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConsolidateOptions {
    /// Clustering (number of clusters, seed).
    pub kmeans: KMeansOptions,
    /// Cluster only episodes logged as successful (default: all, outcomes shown to the generator).
    pub successful_only: bool,
    /// PEMS switches.
    pub pems: PemsOptions,
    /// Scored versions per skill at most (round 1 is the induced version).
    pub max_rounds: usize,
    /// Stop when |PEMS_k - PEMS_(k-1)| < epsilon.
    pub epsilon: f64,
    /// Generator tokens of episodes shown in the induction prompt.
    pub prompt_budget: usize,
    /// Generated tokens per answer at most.
    pub max_tokens: usize,
    /// Episodes the judge replays per version (most representative first).
    pub judge_episodes: usize,
    /// Judge probability at which a skill counts as consistent with an episode.
    pub judge_threshold: f32,
    /// The outcome sources consolidation believes (`logged`, `status`, `inferred`, `judged`;
    /// see `fluxmem_ingest::outcome`): an episode whose outcome came from another source is
    /// treated as of unknown outcome. Default: all four.
    pub outcomes: Vec<String>,
    /// With a replay model: logged calls replayed per eta measurement at most (spread evenly
    /// over the measuring episodes' calls; 0: all).
    pub replay_steps: usize,
    /// Only this tenant (default: every tenant, each clustered on its own).
    pub tenant: Option<String>,
    /// A cluster updates an existing skill when at least this share of the skill's source
    /// episodes is in it ...
    pub match_overlap: f64,
    /// ... or when its centroid has at least this cosine to the skill's embedding.
    pub match_similarity: f32,
    /// Try again clusters that failed in an earlier run with the same episodes.
    pub retry_failed: bool,
    /// Procedure mining thresholds (a step's minimum support, branches, critical steps).
    pub mine: crate::mine::MineOptions,
    /// Split a k-means cluster whose successes end in different acting tools (see
    /// `mine::split_by_procedure`) before mining (default true).
    pub split_by_procedure: bool,
    /// Merge the clusters of a tenant that follow one procedure (see
    /// `mine::merge_by_procedure`) before mining (default true): one skill per
    /// procedure, with the support of every cluster that follows it.
    #[serde(default = "yes")]
    pub merge_by_procedure: bool,
    /// A cluster matched to an existing skill re-induces it only when it gained, or lost, at
    /// least this share of the skill's source episodes; below, the skill is kept as it is
    /// (status `kept`). 0: re-induce on any change.
    pub reinduce_share: f64,
    /// Assign a tenant's new episodes to the clusters of its existing skills instead of
    /// clustering it again (see [`assign`]), when at most `recluster_share` of its episodes fit
    /// none of them.
    pub assign: bool,
    /// With `assign`: the share of a tenant's episodes that may fit no existing cluster before
    /// the tenant is clustered again (they wait for that night, unclustered).
    pub recluster_share: f64,
    /// The models the run loads, by the names the pipeline gives them (consolidation is given
    /// the models, and reads none of these): a shared plan records them, so that a worker that
    /// keeps its models loaded across shards loads the run's.
    pub models: ModelNames,
    /// The clusters this run handles (sharded runs: every shard takes the clusters it owns, by
    /// their member set, from the run's shared plan, [`plan_shared`], or without one clusters
    /// the store itself); all by default. Not a setting a plan records.
    #[serde(skip, default = "all_shards")]
    pub shard: fluxmem_store::Shard,
}

fn yes() -> bool {
    true
}

fn all_shards() -> fluxmem_store::Shard {
    fluxmem_store::Shard::ALL
}

/// The models of a consolidation, by the names a pipeline gives them (`[models]`,
/// `consolidate.eta`, `embed.batch_size`); loaded by the caller (the binary, or fluxmem_py's
/// `ConsolidateExecutor` from a shared plan).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelNames {
    /// The embedder (`hash-<dim>` or a model of the manifest).
    pub embedder: String,
    /// Texts a forward of the embedder (`None`: the model's default).
    pub embed_batch: Option<usize>,
    /// The generator, or `none` (skills worded by template).
    pub generator: String,
    /// The generator's weights (`quantized`, `dequantized`, `q8`, `mixed`).
    pub generator_weights: String,
    /// The judge setting (`none`, `llm`, `ql`, `MODEL`, `ql:MODEL`).
    pub judge: String,
    /// The eta setting (`coverage`, `replay`, `replay:MODEL`).
    pub eta: String,
    /// The device the run was planned on (`auto`, `cpu`, `cuda:N`, `metal`): a worker's default,
    /// which it may override (a GPU worker of a CPU plan); not compared between plan and shard.
    pub device: String,
}

impl Default for ConsolidateOptions {
    fn default() -> Self {
        ConsolidateOptions {
            kmeans: KMeansOptions::default(),
            successful_only: false,
            pems: PemsOptions::default(),
            max_rounds: 5,
            epsilon: 0.01,
            prompt_budget: 1500,
            max_tokens: 320,
            judge_episodes: 8,
            judge_threshold: 0.5,
            replay_steps: 8,
            outcomes: OUTCOME_SOURCES.iter().map(|s| s.to_string()).collect(),
            tenant: None,
            match_overlap: 0.5,
            match_similarity: 0.9,
            retry_failed: false,
            mine: crate::mine::MineOptions::default(),
            split_by_procedure: true,
            merge_by_procedure: true,
            reinduce_share: 0.2,
            assign: true,
            recluster_share: 0.05,
            models: ModelNames::default(),
            shard: fluxmem_store::Shard::ALL,
        }
    }
}

/// Token counts of one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TokenUsage {
    /// Model calls.
    pub calls: usize,
    /// Prompt tokens run.
    pub prompt_tokens: usize,
    /// Prompt tokens served from a shared-prefix cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
}

impl TokenUsage {
    fn between(before: Usage, after: Usage) -> TokenUsage {
        TokenUsage {
            calls: after.calls - before.calls,
            prompt_tokens: after.prompt_tokens - before.prompt_tokens,
            cached_tokens: after.cached_tokens - before.cached_tokens,
            generated_tokens: after.generated_tokens - before.generated_tokens,
        }
    }
}

/// One matured skill of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SkillReport {
    /// The new node.
    pub id: NodeId,
    /// Tenant.
    pub tenant: String,
    /// Skill name.
    pub name: String,
    /// `new` or `updated`.
    pub status: String,
    /// Version of the new node.
    pub version: i64,
    /// Other skills of the tenant this version takes the place of: their clusters became its
    /// cluster (one procedure), so they are among its previous versions ([`absorbed_skills`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub absorbed: Vec<NodeId>,
    /// Source episodes.
    pub support: usize,
    /// Every round's score, in order.
    pub rounds: Vec<PemsScore>,
    /// The kept round (1-based).
    pub best_round: usize,
    /// The round at which the score converged, if it did.
    pub converged_round: Option<usize>,
    /// Generator use for this skill.
    pub generator: TokenUsage,
    /// Judge use for this skill.
    pub judge: TokenUsage,
    /// Wall time for this skill.
    pub seconds: f64,
}

/// A cluster without a readable skill, with every answer kept verbatim.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailedCluster {
    /// Tenant.
    pub tenant: String,
    /// `cluster:<hash of its episode ids>`, the edit-log target.
    pub target: String,
    /// The cluster's episodes.
    pub episodes: Vec<NodeId>,
    /// The rejected answers.
    pub attempts: Vec<Attempt>,
}

/// One cluster and what became of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterReport {
    /// Tenant.
    pub tenant: String,
    /// Its episodes, most representative first.
    pub episodes: Vec<NodeId>,
    /// `new`, `updated`, `unchanged`, `failed` or `failed_earlier`.
    pub status: String,
    /// The skill node it maps to (the new version, or the unchanged one).
    pub skill: Option<NodeId>,
}

/// What the stage did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ConsolidateReport {
    /// Episodes clustered.
    pub episodes: usize,
    /// Episode and skill nodes read from the store: with a tenant, that tenant's only.
    pub nodes_read: usize,
    /// Clusters formed.
    pub clusters: usize,
    /// Skills created.
    pub skills_new: usize,
    /// Skills given a new version.
    pub skills_updated: usize,
    /// Clusters whose skill already covers exactly their episodes.
    pub skills_unchanged: usize,
    /// Clusters whose membership moved by less than `reinduce_share` of their skill's source
    /// episodes: the skill is kept, not re-induced.
    pub skills_kept: usize,
    /// Skills that a new version of another skill of their tenant took the place of (one
    /// procedure: [`SkillReport::absorbed`]).
    pub skills_absorbed: usize,
    /// Clusters left to other shards of a sharded run.
    pub other_shards: usize,
    /// Tenants whose new episodes were assigned to the clusters of their skills (no k-means).
    pub tenants_assigned: usize,
    /// Tenants clustered with k-means.
    pub tenants_clustered: usize,
    /// Episodes of assigned tenants that fit no existing cluster: left for the next re-clustering.
    pub unassigned: usize,
    /// Clusters that failed in this run.
    pub failed: usize,
    /// Clusters skipped because the same episodes failed in an earlier run.
    pub failed_earlier: usize,
    /// Clusters whose successes share no procedure (no skill to write; also counted in `failed`).
    pub no_procedure: usize,
    /// What eta was measured with: `sequence coverage`, `judge (MODEL)` or `replay step
    /// accuracy (MODEL)`.
    pub eta_source: String,
    /// The generator.
    pub generator_model: String,
    /// The model that measured eta (replay model or judge), if any.
    pub judge_model: Option<String>,
    /// The embedding model.
    pub embedding_model: String,
    /// Episodes read, by the source of their outcome; a source not believed
    /// ([`ConsolidateOptions::outcomes`]) is counted as `SOURCE (not believed)`.
    pub outcome_sources: BTreeMap<String, usize>,
    /// Generator use of the whole run.
    pub generator: TokenUsage,
    /// Judge use of the whole run.
    pub judge: TokenUsage,
    /// Commits made (one per cluster that changed the store).
    pub commits: usize,
    /// True when this run finished the cluster plan of a run that was killed (its clusters, in
    /// its order, under its run id), rather than clustering anew.
    pub resumed: bool,
    /// The hash of the shared cluster plan this shard of a sharded run followed
    /// ([`plan_shared`]); `None` when the run clustered on its own.
    pub shared_plan: Option<String>,
    /// Matured skills.
    pub skills: Vec<SkillReport>,
    /// Failed clusters.
    pub failures: Vec<FailedCluster>,
    /// Every cluster.
    pub cluster_list: Vec<ClusterReport>,
}

impl ConsolidateReport {
    /// What the run read, by the names a stage record counts it with.
    pub fn counts_in(&self) -> [(&'static str, usize); 3] {
        [
            ("episodes", self.episodes),
            ("clusters", self.clusters),
            ("unassigned", self.unassigned),
        ]
    }

    /// What the run made, by the names a stage record counts it with.
    pub fn counts_out(&self) -> [(&'static str, usize); 6] {
        [
            ("skills_new", self.skills_new),
            ("skills_updated", self.skills_updated),
            ("skills_unchanged", self.skills_unchanged),
            ("skills_kept", self.skills_kept),
            ("failed", self.failed),
            ("commits", self.commits),
        ]
    }

    /// One line for people on what became of the clusters.
    pub fn summary_line(&self) -> String {
        format!(
            "{} episodes in {} clusters: {} new skills, {} updated, {} unchanged, {} kept (moved less than the re-induce share), {} failed ({} sharing no procedure)",
            self.episodes,
            self.clusters,
            self.skills_new,
            self.skills_updated,
            self.skills_unchanged,
            self.skills_kept,
            self.failed,
            self.no_procedure
        )
    }

    /// The run's status from its counts. A cluster gave a skill when it got a new skill, a new
    /// version or kept an unchanged one; it gave none when induction failed this run or failed
    /// in an earlier run and was not retried (`failed_earlier`). A cluster whose successes share
    /// no procedure gives no skill by design (a skill holds only proven steps): that is a
    /// finding, said in the status, not a failure, unless no cluster gave a skill at all.
    /// - some clusters failed, none gave one: `degraded: 0 of N clusters gave a skill (...)`;
    /// - some failed, some gave one: `partial: K of N clusters gave a skill (...)`;
    /// - none failed: `done`, or `nothing new` when every skill was unchanged (or there were no
    ///   clusters), followed by `(K of N clusters share no procedure, so no skill)` when some do.
    pub fn status(&self) -> String {
        let gave = self.skills_new + self.skills_updated + self.skills_unchanged + self.skills_kept;
        let no_procedure = self.no_procedure.min(self.failed);
        let failed = self.failed - no_procedure;
        let none = failed + self.failed_earlier;
        let clusters = gave + none + no_procedure;
        if none > 0 || (gave == 0 && no_procedure > 0) {
            let mut why = Vec::new();
            if failed > 0 {
                why.push(format!("{failed} failed"));
            }
            if no_procedure > 0 {
                why.push(format!("{no_procedure} sharing no procedure"));
            }
            if self.failed_earlier > 0 {
                why.push(format!(
                    "{} failed in an earlier run, not retried",
                    self.failed_earlier
                ));
            }
            let word = if gave == 0 { "degraded" } else { "partial" };
            return format!(
                "{word}: {gave} of {clusters} clusters gave a skill ({})",
                why.join(", ")
            );
        }
        let status = if self.skills_new + self.skills_updated == 0 {
            "nothing new"
        } else {
            "done"
        };
        if no_procedure > 0 {
            format!(
                "{status} ({no_procedure} of {clusters} clusters share no procedure, so no skill)"
            )
        } else {
            status.into()
        }
    }
}

/// Progress callbacks.
pub use fluxmem_graph::{NoProgress, Progress};

/// How the edit of a cluster that shares no procedure starts its reason.
const NO_PROCEDURE_REASON: &str = "no skill for a cluster of ";

/// Consolidates the store's episodes into skills, committing after every cluster.
pub fn consolidate_store(
    writer: &mut Writer,
    models: &mut Models<'_>,
    options: &ConsolidateOptions,
    run_id: &str,
    device: &Device,
    progress: &mut dyn Progress,
) -> Result<ConsolidateReport> {
    let model = models.embedder.model_id().to_string();
    let Snapshot {
        graph,
        outcome_sources,
        tenants,
        roles,
    } = snapshot(writer, options, &model)?;
    let judge_model = models
        .replayer
        .as_ref()
        .map(|r| r.model_id().to_string())
        .or_else(|| models.judge.as_ref().map(|j| j.model_id().to_string()));
    let mut report = ConsolidateReport {
        eta_source: crate::mature::eta_name(models),
        generator_model: generator_id(models),
        judge_model,
        embedding_model: model.clone(),
        outcome_sources,
        nodes_read: graph.nodes.len(),
        ..Default::default()
    };
    let generator_start = generator_usage(models);
    let judge_start = eta_model_usage(models);
    let latest = latest_skills(&graph);
    // Clusters that failed before, and whether they failed for sharing no procedure (a finding
    // that holds as long as the cluster's members do, so it is reported again, not re-mined).
    let failed_before: BTreeMap<&str, bool> = graph
        .edits
        .iter()
        .filter(|e| e.stage == STAGE && e.kind == "skill_failed")
        .map(|e| (e.target.as_str(), e.reason.starts_with(NO_PROCEDURE_REASON)))
        .collect();
    // A killed run's plan first (this shard's), then a sharded run's shared plan, else
    // clusters of its own.
    let (plans, run_id) = match open_plan(writer, &graph, options)? {
        Some((plans, stored, tally)) => {
            // A killed shard of a shared plan resumes only with the plan's settings.
            if stored.shared.is_some() {
                resumed_shard_settings(writer, &stored.run_id, options)?;
            }
            report.resumed = true;
            report.shared_plan = stored.shared;
            tally.apply(&mut report);
            (plans, stored.run_id)
        }
        None => match shared_plan(writer, &graph, options, run_id)? {
            Some((plans, tally, sha256)) => {
                report.shared_plan = Some(sha256);
                tally.apply(&mut report);
                (plans, run_id.to_string())
            }
            None => {
                let (plans, tally) =
                    plan_clusters(&graph, &tenants, &roles, &latest, &model, options, device)?;
                tally.apply(&mut report);
                (plans, run_id.to_string())
            }
        },
    };
    let run_id = run_id.as_str();
    progress.start(plans.len() as u64);
    // The count of clusters handled belongs to the plan it was saved with: a run that did not
    // resume one (a staging store inherits its main store's markers) starts at 0.
    let done = if report.resumed {
        done_count(writer)
    } else {
        0
    };
    // The last cluster with work: its commit closes the plan.
    let last = plans
        .iter()
        .rposition(|plan| settled(plan, options, &failed_before).is_none());
    // The plan's file: the open marker's when resuming, else written with the run's first
    // commit (the marker then stays in the manifest until the last commit clears it). Any
    // other plan file is a dead run's (killed before its first commit landed: no marker names
    // it) and goes.
    let resumed_marker = if report.resumed {
        open_marker(writer).cloned()
    } else {
        None
    };
    sweep_plans(writer.store().dir(), resumed_marker.as_ref())?;
    let mut plan_saved = resumed_marker.is_some();
    let mut delta = Graph::default();
    for (position, plan) in plans.iter().enumerate() {
        if position < done {
            // Committed before the run was killed; its commit is in the store.
            progress.advance(1);
            continue;
        }
        let cluster = handle(
            plan,
            &graph,
            &roles[&plan.tenant],
            models,
            options,
            run_id,
            &failed_before,
            &mut delta,
            &mut report,
        )?;
        // One commit per cluster: a run killed later keeps the generation done so far. The
        // plan rides on the run's first commit and the count of clusters handled on every one,
        // so the run started again finishes exactly the clusters left. No later cluster reads
        // this one's delta (each works from the snapshot read above).
        if !delta.is_empty() {
            let summary = json!({
                "tenant": cluster.tenant, "status": cluster.status, "episodes": cluster.episodes.len(),
                "generator": report.generator_model, "judge": report.judge_model,
            });
            let mut marker = BTreeMap::new();
            if Some(position) == last {
                marker.insert(PLAN_MARKER.to_string(), Value::Null);
                marker.insert(DONE_MARKER.to_string(), Value::Null);
                if let Some(sha256) = &report.shared_plan {
                    marker.insert(SHARED_DONE_MARKER.to_string(), json!(sha256));
                }
            } else {
                if !plan_saved {
                    let plan = StoredPlan::of(
                        run_id,
                        shard_key(options),
                        &plans,
                        Tally::of(&report),
                        report.shared_plan.clone(),
                    );
                    let saved = save_plan(writer.store().dir(), &plan, PLAN_PREFIX)?;
                    marker.insert(PLAN_MARKER.to_string(), saved);
                    plan_saved = true;
                }
                marker.insert(DONE_MARKER.to_string(), json!(position + 1));
            }
            writer.commit(
                &delta,
                CommitInfo {
                    stage: STAGE.into(),
                    run_id: run_id.into(),
                    summary,
                    progress: marker,
                },
            )?;
            report.commits += 1;
            delta = Graph::default();
        }
        report.cluster_list.push(cluster);
        progress.advance(1);
    }
    close_plan(writer, run_id)?;
    sweep_plans(writer.store().dir(), None)?;
    report.generator = TokenUsage::between(generator_start, generator_usage(models));
    report.judge = TokenUsage::between(judge_start, eta_model_usage(models));
    Ok(report)
}

/// What the model that measures eta (replay model or judge) has used so far.
fn eta_model_usage(models: &Models<'_>) -> Usage {
    match (&models.replayer, &models.judge) {
        (Some(replayer), _) => replayer.usage(),
        (None, Some(judge)) => judge.usage(),
        (None, None) => Usage::default(),
    }
}

/// The manifest progress key of an unfinished run's cluster plan: the name, hash and shard of
/// the file that holds it (`scratch/consolidate/plan-*.json`, a [`StoredPlan`]).
pub const PLAN_MARKER: &str = "consolidate.plan";
/// The manifest progress key of how many of the plan's clusters are handled.
pub const DONE_MARKER: &str = "consolidate.done";

/// Counts of the planning step, kept with the plan so a resumed run reports what the run it
/// finishes planned.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Tally {
    episodes: usize,
    clusters: usize,
    other_shards: usize,
    tenants_assigned: usize,
    tenants_clustered: usize,
    unassigned: usize,
}

impl Tally {
    fn of(report: &ConsolidateReport) -> Tally {
        Tally {
            episodes: report.episodes,
            clusters: report.clusters,
            other_shards: report.other_shards,
            tenants_assigned: report.tenants_assigned,
            tenants_clustered: report.tenants_clustered,
            unassigned: report.unassigned,
        }
    }

    fn apply(&self, report: &mut ConsolidateReport) {
        report.episodes = self.episodes;
        report.clusters = self.clusters;
        report.other_shards = self.other_shards;
        report.tenants_assigned = self.tenants_assigned;
        report.tenants_clustered = self.tenants_clustered;
        report.unassigned = self.unassigned;
    }
}

/// The cluster plan of a run, as the store keeps it while the run is unfinished: every
/// cluster in the order the run handles them, with the skill each updates (by id).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredPlan {
    run_id: String,
    /// The shard this plan is for (`Shard`'s index and count), so a sharded run never follows
    /// another shard's plan.
    shard: (usize, usize),
    tally: Tally,
    clusters: Vec<StoredCluster>,
    /// The hash of the shared plan these clusters come from, if any ([`plan_shared`]).
    #[serde(default)]
    shared: Option<String>,
    /// A shared plan's settings: every shard runs with them ([`shared_settings`]).
    #[serde(default)]
    settings: Option<ConsolidateOptions>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredCluster {
    tenant: String,
    index: usize,
    episodes: Vec<NodeId>,
    weights: Vec<f32>,
    previous: Option<NodeId>,
    /// The other skills the cluster's new version takes the place of.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    absorbed: Vec<NodeId>,
    skills: usize,
}

impl StoredPlan {
    fn of(
        run_id: &str,
        shard: (usize, usize),
        plans: &[Plan<'_>],
        tally: Tally,
        shared: Option<String>,
    ) -> StoredPlan {
        StoredPlan {
            run_id: run_id.to_string(),
            shard,
            tally,
            shared,
            settings: None,
            clusters: plans
                .iter()
                .map(|plan| StoredCluster {
                    tenant: plan.tenant.clone(),
                    index: plan.index,
                    episodes: plan.episodes.clone(),
                    weights: plan.weights.clone(),
                    previous: plan.previous.map(|node| node.id.clone()),
                    absorbed: plan.absorbed.iter().map(|node| node.id.clone()).collect(),
                    skills: plan.skills,
                })
                .collect(),
        }
    }
}

/// The folder of the plan files of unfinished runs, inside the store's scratch folder. Only
/// consolidate writes there, under the writer lock.
const PLAN_FOLDER: &str = "consolidate";

/// The file names of a run's own plan (`plan-<hash>.json`) and of a sharded run's shared one
/// (`shared-<hash>.json`), in `scratch/consolidate/`.
const PLAN_PREFIX: &str = "plan-";
const SHARED_PREFIX: &str = "shared-";

/// Writes `plan` to `scratch/consolidate/<prefix><sha256 prefix>.json` (a temporary file,
/// synced, renamed) and returns the manifest marker that names it: the plan of a fleet's night
/// holds every episode id, so it lives in a file of its own and the manifest, rewritten at
/// every commit, holds only its name and hash.
fn save_plan(dir: &Path, plan: &StoredPlan, prefix: &str) -> Result<Value> {
    let bytes = serde_json::to_vec(plan).expect("plans serialise");
    let sha256 = sha256_hex(&bytes);
    let folder = dir.join(fluxmem_store::SCRATCH).join(PLAN_FOLDER);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    std::fs::create_dir_all(&folder).map_err(io(&folder))?;
    let name = format!("{prefix}{}.json", &sha256[..16]);
    fluxmem_store::write_atomically(&folder.join(&name), &bytes)?;
    Ok(json!({
        "file": format!("{}/{PLAN_FOLDER}/{name}", fluxmem_store::SCRATCH),
        "sha256": sha256,
        "shard": [plan.shard.0, plan.shard.1],
    }))
}

/// The plan the marker `marker` names, checked against its hash.
fn load_plan(dir: &Path, marker: &Value) -> Result<StoredPlan> {
    let file = marker["file"].as_str().ok_or_else(|| Error::Plan {
        reason: format!("the store's `{PLAN_MARKER}` names no file: {marker}"),
    })?;
    let path = dir.join(file);
    let bytes = std::fs::read(&path).map_err(|source| Error::Io {
        path: path.clone(),
        source,
    })?;
    if Some(sha256_hex(&bytes).as_str()) != marker["sha256"].as_str() {
        return Err(Error::Plan {
            reason: format!(
                "{} does not match the hash its marker records",
                path.display()
            ),
        });
    }
    serde_json::from_slice(&bytes).map_err(|e| Error::Plan {
        reason: format!("{} is unreadable: {e}", path.display()),
    })
}

/// True for the names [`save_plan`] writes with `prefix`: `<prefix><16 hex>.json` and its
/// temporary `.<prefix><16 hex>.json.tmp-<pid>` ([`fluxmem_store::write_atomically`]; before
/// it, `.<prefix><16 hex>.json.tmp`).
fn plan_file_name(name: &str, prefix: &str) -> bool {
    let temporary = |n: &'_ str| -> Option<usize> {
        if let Some(base) = n.strip_suffix(".tmp") {
            return Some(base.len());
        }
        let (base, pid) = n.rsplit_once(".tmp-")?;
        pid.bytes()
            .all(|b| b.is_ascii_digit())
            .then_some(base.len())
    };
    let name = match name.strip_prefix('.') {
        Some(hidden) => temporary(hidden).map_or(name, |end| &hidden[..end]),
        None => name,
    };
    name.strip_prefix(prefix)
        .and_then(|n| n.strip_suffix(".json"))
        .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Removes the plan files (and their temporaries) that `keep` (an open marker) does not name.
fn sweep_plans(dir: &Path, keep: Option<&Value>) -> Result<()> {
    sweep_prefixed(dir, PLAN_PREFIX, keep)
}

/// Removes the files of `prefix` (and their temporaries) in `scratch/consolidate/` that `keep`
/// does not name.
fn sweep_prefixed(dir: &Path, prefix: &str, keep: Option<&Value>) -> Result<()> {
    let folder = dir.join(fluxmem_store::SCRATCH).join(PLAN_FOLDER);
    let Ok(entries) = std::fs::read_dir(&folder) else {
        return Ok(());
    };
    let kept = keep.and_then(|m| m["file"].as_str());
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let relative = format!("{}/{PLAN_FOLDER}/{name}", fluxmem_store::SCRATCH);
        let ours = plan_file_name(&name, prefix);
        if ours && Some(relative.as_str()) != kept {
            std::fs::remove_file(entry.path()).map_err(|source| Error::Io {
                path: entry.path(),
                source,
            })?;
        }
    }
    Ok(())
}

/// What a run reads before it plans: the graph (episodes, skills, distill edges, failures)
/// with the outcomes it believes (counted by source), each tenant's episodes with their
/// vectors, and what each tenant's tools do.
struct Snapshot {
    graph: Graph,
    outcome_sources: BTreeMap<String, usize>,
    tenants: TenantEpisodes,
    roles: BTreeMap<String, ToolRoles>,
}

/// Reads the store as a run does (one tenant's rows only with `options.tenant`); vectors of
/// another model than the store's are an error.
fn snapshot(writer: &mut Writer, options: &ConsolidateOptions, model: &str) -> Result<Snapshot> {
    let mut graph = read(writer, options.tenant.as_deref())?;
    // The skills' edges and vectors name the episodes read: their shards name their tenants.
    writer.know_tenants(graph.nodes.values().map(|n| (&n.id, n.tenant.as_str())));
    let outcome_sources = believe_outcomes(&mut graph, options);
    if let Some(stored) = &writer.manifest().embedding_model {
        if stored.id != model {
            return Err(Error::ModelMismatch {
                store_model: stored.id.clone(),
                model: model.to_string(),
            });
        }
    }
    let tenants = episodes_by_tenant(&graph, options, model)?;
    // What each tool does, learned from all of a tenant's episodes (the same on a resumed or
    // sharded run: it depends on the snapshot only).
    let roles: BTreeMap<String, ToolRoles> = tenants
        .iter()
        .map(|(tenant, (ids, _))| {
            (
                tenant.clone(),
                ToolRoles::learn(ids.iter().map(|id| &graph.nodes[id])),
            )
        })
        .collect();
    Ok(Snapshot {
        graph,
        outcome_sources,
        tenants,
        roles,
    })
}

/// The manifest progress key of a sharded run's shared cluster plan ([`plan_shared`]): the
/// file that holds it, its hash, the run it is for and the store version it was made at.
pub const SHARED_PLAN_MARKER: &str = "consolidate.shared_plan";

/// The progress key, in a shard's staging store, of the shared plan whose clusters the shard
/// has all handled (its hash): a shard run again after that has nothing left to do.
const SHARED_DONE_MARKER: &str = "consolidate.shared_done";

/// What [`plan_shared`] did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SharedPlanReport {
    /// Clusters planned, over every shard.
    pub clusters: usize,
    /// Episodes clustered.
    pub episodes: usize,
    /// The plan's hash (each shard's finish note names it; the merge checks).
    pub sha256: String,
    /// True when the store already held this run's plan (planning again changes nothing).
    pub reused: bool,
}

/// Plans a sharded run's clusters once, for all its shards. It reads the store as a run would,
/// clusters each tenant (or assigns its new episodes to its skills' clusters), and records the
/// plan in the store: a file `scratch/consolidate/shared-<hash>.json` and the marker
/// [`SHARED_PLAN_MARKER`] naming it, its hash and `run_id`, committed. Every shard of the run
/// then handles the clusters of the plan it owns instead of clustering on its own, so no shard
/// depends on another's floating point (k-means on another CPU or a GPU), and each cluster is
/// handled by exactly one shard ([`shared_plan_merge`] checks that each followed it). Planning
/// again for the same run reuses the recorded plan.
pub fn plan_shared(
    writer: &mut Writer,
    model: &str,
    options: &ConsolidateOptions,
    run_id: &str,
    device: &Device,
) -> Result<SharedPlanReport> {
    // The recorded plan holds while its commit is the store's last (a night's new data makes a
    // new plan) and its settings are the run's (other settings make a new plan).
    let options = ConsolidateOptions {
        shard: fluxmem_store::Shard::ALL,
        ..options.clone()
    };
    if let Some(marker) = shared_marker(writer, run_id)
        .filter(|m| m["version"].as_u64() == Some(writer.manifest().version))
    {
        let stored = load_plan(writer.store().dir(), marker)?;
        if settings_changed(stored.settings.as_ref(), &options, Compared::Plan).is_empty() {
            return Ok(SharedPlanReport {
                clusters: stored.clusters.len(),
                episodes: stored.tally.episodes,
                sha256: marker["sha256"].as_str().unwrap_or_default().to_string(),
                reused: true,
            });
        }
    }
    let Snapshot {
        graph,
        tenants,
        roles,
        ..
    } = snapshot(writer, &options, model)?;
    let latest = latest_skills(&graph);
    let (plans, tally) = plan_clusters(&graph, &tenants, &roles, &latest, model, &options, device)?;
    let report = SharedPlanReport {
        clusters: plans.len(),
        episodes: tally.episodes,
        ..Default::default()
    };
    let stored = StoredPlan {
        settings: Some(options.clone()),
        ..StoredPlan::of(run_id, (0, 1), &plans, tally, None)
    };
    let mut marker = save_plan(writer.store().dir(), &stored, SHARED_PREFIX)?;
    marker["run_id"] = json!(run_id);
    // The version of the commit that records it: shards check they start from it.
    marker["version"] = json!(writer.manifest().version + 1);
    let sha256 = marker["sha256"].as_str().unwrap_or_default().to_string();
    writer.commit(
        &Graph::default(),
        CommitInfo {
            stage: STAGE.into(),
            run_id: run_id.into(),
            summary: json!({ "plan": "shared", "clusters": report.clusters }),
            progress: [(SHARED_PLAN_MARKER.to_string(), marker.clone())]
                .into_iter()
                .collect(),
        },
    )?;
    // Older plans' files, once the marker no longer names them.
    sweep_prefixed(writer.store().dir(), SHARED_PREFIX, Some(&marker))?;
    Ok(SharedPlanReport { sha256, ..report })
}

/// The store's shared plan marker for `run_id`, if any (a staging store sees its main
/// store's).
fn shared_marker<'w>(writer: &'w Writer, run_id: &str) -> Option<&'w Value> {
    writer
        .manifest()
        .progress
        .get(SHARED_PLAN_MARKER)
        .filter(|marker| marker["run_id"] == run_id)
}

/// The shared plan of a sharded run ([`plan_shared`]), if the store holds one for `run_id`:
/// the clusters this shard owns, the plan's counts (the clusters of the other shards in
/// `other_shards`), and the plan's hash.
#[allow(clippy::type_complexity)] // the three parts of the plan, named in the doc
fn shared_plan<'g>(
    writer: &Writer,
    graph: &'g Graph,
    options: &ConsolidateOptions,
    run_id: &str,
) -> Result<Option<(Vec<Plan<'g>>, Tally, String)>> {
    // Only a shard of a sharded run (a staging store) follows a shared plan.
    let Some(main) = writer.staging_main() else {
        return Ok(None);
    };
    let Some(marker) = shared_marker(writer, run_id) else {
        return Ok(None);
    };
    let base = writer
        .manifest()
        .progress
        .get("staging")
        .and_then(|s| s["base_version"].as_u64());
    if base != marker["version"].as_u64() {
        return Err(Error::Plan {
            reason: format!(
                "the run's shared cluster plan was made at store version {}, this shard started from version {}; plan again (--plan), then run the shards",
                marker["version"], base.map_or("?".into(), |b| b.to_string())
            ),
        });
    }
    let stored = load_plan(&main, marker)?;
    check_shard_settings(&stored, marker, options)?;
    let mut tally = stored.tally;
    let (owned, others): (Vec<StoredCluster>, Vec<StoredCluster>) = stored
        .clusters
        .into_iter()
        .partition(|c| options.shard.owns(&cluster_target(&c.episodes)));
    tally.other_shards = others.len();
    let sha256 = marker["sha256"].as_str().unwrap_or_default().to_string();
    // Run again after it handled all its clusters: nothing is left to do.
    if writer.manifest().progress.get(SHARED_DONE_MARKER) == Some(&json!(sha256)) {
        return Ok(Some((Vec::new(), tally, sha256)));
    }
    Ok(Some((stored_plans(graph, owned)?, tally, sha256)))
}

/// Refuses a killed shard of a shared plan (`run_id`'s) that resumes with other settings than
/// the plan's; nothing to check once the plan's marker is gone (merged).
fn resumed_shard_settings(
    writer: &Writer,
    run_id: &str,
    options: &ConsolidateOptions,
) -> Result<()> {
    let (Some(main), Some(marker)) = (writer.staging_main(), shared_marker(writer, run_id)) else {
        return Ok(());
    };
    check_shard_settings(&load_plan(&main, marker)?, marker, options)
}

/// Before the merge of a sharded run's `count` consolidate shards: when the store holds a
/// shared plan for `run_id`, checks that every shard followed it (its finish note names the
/// plan's hash; a shard that clustered on its own is an error naming it) and returns the
/// progress that clears the marker with the merge's commit. `None`: the run has no shared
/// plan. [`sweep_shared_plans`] then deletes the file.
pub fn shared_plan_merge(
    writer: &Writer,
    run_id: &str,
    count: usize,
) -> Result<Option<(String, Value)>> {
    let Some(marker) = shared_marker(writer, run_id) else {
        return Ok(None);
    };
    let main = writer.store().dir();
    for index in 0..count {
        let shard = fluxmem_store::Shard { index, count };
        // A shard that never ran or never finished is the merge's to name.
        let Some(note) = fluxmem_store::staging_note(main, STAGE, shard)? else {
            continue;
        };
        if note["shared_plan"] != marker["sha256"] {
            let how = match note["shared_plan"].as_str() {
                Some(other) => {
                    format!("it followed another plan ({other}), made before the run planned again")
                }
                None => "it clustered on its own".to_string(),
            };
            return Err(Error::Plan {
                reason: format!(
                    "shard {shard} of `{STAGE}` did not follow the run's shared cluster plan ({}): {how}, so its clusters may overlap another shard's; run it again with --shard {shard}",
                    marker["file"].as_str().unwrap_or("?")
                ),
            });
        }
    }
    Ok(Some((SHARED_PLAN_MARKER.to_string(), Value::Null)))
}

/// Deletes the shared plan files (`scratch/consolidate/shared-*.json`) that the store's
/// marker no longer names: after a merge cleared it, all of them.
pub fn sweep_shared_plans(writer: &Writer) -> Result<()> {
    let keep = writer
        .manifest()
        .progress
        .get(SHARED_PLAN_MARKER)
        .filter(|m| !m.is_null());
    sweep_prefixed(writer.store().dir(), SHARED_PREFIX, keep)
}

/// What a shard's settings are compared with its plan's for: a shard that runs the plan
/// ([`Compared::Shard`]: the clustering-only settings aside, which the plan settled, as the
/// clusters are the plan's whatever a shard's own), or planning again ([`Compared::Plan`]:
/// every setting, clustering included). The device is never compared (a worker may run on
/// another) nor the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compared {
    Shard,
    Plan,
}

/// The k-means settings that only shape the clusters (the seed is not one of them: it also
/// seeds the generator and is written on every skill).
const CLUSTERING_ONLY: [&str; 6] = [
    "clusters",
    "max_iterations",
    "restarts",
    "mini_batch_above",
    "batch_size",
    "mini_batch_iterations",
];

/// The settings of `options` that differ from a shared plan's `recorded` ones, sorted by name
/// (`max_rounds`, `models.generator`, ...), each with the plan's value and `options`' (JSON
/// text), compared for `what`. A plan that recorded no settings (made before plans recorded
/// them) differs in `settings`.
fn settings_changed(
    recorded: Option<&ConsolidateOptions>,
    options: &ConsolidateOptions,
    what: Compared,
) -> Vec<(String, String, String)> {
    let Some(recorded) = recorded else {
        return vec![("settings".into(), "none recorded".into(), String::new())];
    };
    let compared = |o: &ConsolidateOptions| {
        let mut value = serde_json::to_value(o).expect("options serialise");
        value["models"]["device"] = Value::Null;
        if what == Compared::Shard {
            for key in CLUSTERING_ONLY {
                value["kmeans"][key] = Value::Null;
            }
        }
        value
    };
    let (recorded, options) = (compared(recorded), compared(options));
    let mut changed = Vec::new();
    let mut differ = |name: String, was: &Value, now: &Value| {
        if was != now {
            changed.push((name, was.to_string(), now.to_string()));
        }
    };
    for (key, value) in options.as_object().expect("an object") {
        match (value, &recorded[key]) {
            (Value::Object(inner), Value::Object(was)) => {
                for (k, v) in inner {
                    differ(format!("{key}.{k}"), was.get(k).unwrap_or(&Value::Null), v);
                }
            }
            (value, was) => differ(key.clone(), was, value),
        }
    }
    changed.sort();
    changed
}

/// Refuses a shard whose settings are not its run's shared plan's (`stored`, named by
/// `marker`), naming each setting that differs with both values.
fn check_shard_settings(
    stored: &StoredPlan,
    marker: &Value,
    options: &ConsolidateOptions,
) -> Result<()> {
    let changed = settings_changed(stored.settings.as_ref(), options, Compared::Shard);
    if changed.is_empty() {
        return Ok(());
    }
    let file = marker["file"].as_str().unwrap_or("?");
    let reason = if stored.settings.is_none() {
        format!(
            "the run's shared cluster plan ({file}) records no settings (made by an older fluxmem): plan again (--plan)"
        )
    } else {
        let listed: Vec<String> = changed
            .iter()
            .map(|(name, plan, shard)| format!("{name}: the plan's {plan}, this shard's {shard}"))
            .collect();
        format!(
            "shard {} does not run with the settings of the run's shared cluster plan ({file}): {}; run the shard with the plan's settings, or plan again (--plan) with these",
            options.shard,
            listed.join("; ")
        )
    };
    Err(Error::Plan { reason })
}

/// A sharded run's shared cluster plan as a worker needs it: the settings every shard runs with
/// (the models by name among them) and the plan's hash.
#[derive(Debug, Clone)]
pub struct SharedSettings {
    /// The run's settings (shard: all).
    pub options: ConsolidateOptions,
    /// The plan's hash, which each shard's finish note names.
    pub sha256: String,
}

/// The shared cluster plan that the store at `store` holds for `run_id` (the stage's run id,
/// `consolidate@<run id>`, as [`plan_shared`] was given it), if any: its settings and hash,
/// checked against the hash its marker records. A plan the store has moved past, or made
/// before plans recorded their settings, is an error that says to plan again.
pub fn shared_settings(store: &Path, run_id: &str) -> Result<Option<SharedSettings>> {
    let manifest = fluxmem_store::Store::open(store)?.manifest()?;
    let Some(marker) = manifest
        .progress
        .get(SHARED_PLAN_MARKER)
        .filter(|marker| marker["run_id"] == run_id)
    else {
        return Ok(None);
    };
    // A plan the store moved past is refused here, as each of its shards would refuse it.
    if marker["version"].as_u64() != Some(manifest.version) {
        return Err(Error::Plan {
            reason: format!(
                "the shared cluster plan of run `{run_id}` was made at store version {}, the store is at version {}; plan again (--plan)",
                marker["version"], manifest.version
            ),
        });
    }
    let stored = load_plan(store, marker)?;
    let options = stored.settings.ok_or_else(|| Error::Plan {
        reason: format!(
            "the shared cluster plan of run `{run_id}` records no settings (made by an older fluxmem); plan again (--plan)"
        ),
    })?;
    Ok(Some(SharedSettings {
        options,
        sha256: marker["sha256"].as_str().unwrap_or_default().to_string(),
    }))
}

/// The store's open plan marker, if any.
fn open_marker(writer: &Writer) -> Option<&Value> {
    writer
        .manifest()
        .progress
        .get(PLAN_MARKER)
        .filter(|v| !v.is_null())
}

/// Plans every tenant's clusters: assigned to the clusters of its latest skills where they
/// still fit, clustered anew otherwise. Empty clusters (k-means may leave one) are no work.
#[allow(clippy::too_many_arguments)] // the snapshot's parts and the run's settings, each read once
fn plan_clusters<'g>(
    graph: &'g Graph,
    tenants: &TenantEpisodes,
    roles: &BTreeMap<String, ToolRoles>,
    latest: &[&'g Node],
    model: &str,
    options: &ConsolidateOptions,
    device: &Device,
) -> Result<(Vec<Plan<'g>>, Tally)> {
    let mut tally = Tally::default();
    let mut plans = Vec::new();
    for (tenant, (ids, vectors)) in tenants {
        tally.episodes += ids.len();
        let existing: Vec<&Node> = latest
            .iter()
            .copied()
            .filter(|n| &n.tenant == tenant)
            .collect();
        let assigned = if options.assign {
            assign(ids, vectors, &existing, options.recluster_share)
        } else {
            None
        };
        let (members, similarity, matches, absorbed) = match assigned {
            Some(assigned) => {
                tally.tenants_assigned += 1;
                tally.unassigned += assigned.unassigned;
                // Skills whose clusters now follow one procedure become one.
                let parts: Vec<Vec<usize>> = if options.merge_by_procedure {
                    crate::mine::procedure_parts(
                        &assigned.members,
                        |r| &graph.nodes[&ids[r]],
                        &roles[tenant],
                        options.mine.min_count,
                    )
                } else {
                    (0..assigned.members.len()).map(|g| vec![g]).collect()
                };
                let members = parts
                    .iter()
                    .map(|part| {
                        crate::mine::merged_rows(part, &assigned.members, &assigned.similarity)
                    })
                    .collect();
                let matches = parts.iter().map(|part| assigned.skills[part[0]]).collect();
                let absorbed = parts
                    .iter()
                    .map(|part| {
                        part[1..]
                            .iter()
                            .filter_map(|&g| assigned.skills[g])
                            .collect()
                    })
                    .collect();
                (members, assigned.similarity, matches, absorbed)
            }
            None => {
                tally.tenants_clustered += 1;
                let clustering = kmeans(vectors, &options.kmeans, device)?;
                let (members, centroids) = if options.split_by_procedure {
                    crate::mine::split_by_procedure(
                        &clustering.members(),
                        &clustering.centroids,
                        vectors,
                        |r| &graph.nodes[&ids[r]],
                        &roles[tenant],
                        options.mine.min_count,
                    )
                } else {
                    (clustering.members(), clustering.centroids.clone())
                };
                let (members, centroids) = if options.merge_by_procedure {
                    crate::mine::merge_by_procedure(
                        &members,
                        &centroids,
                        vectors,
                        &clustering.similarity,
                        |r| &graph.nodes[&ids[r]],
                        &roles[tenant],
                        options.mine.min_count,
                    )
                } else {
                    (members, centroids)
                };
                let matches =
                    match_skills(&members, ids, &centroids, &existing, graph, model, options);
                let absorbed = absorbed_skills(&members, ids, &matches, &existing);
                (members, clustering.similarity, matches, absorbed)
            }
        };
        tally.clusters += members.iter().filter(|rows| !rows.is_empty()).count();
        for (index, rows) in members.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let episodes: Vec<NodeId> = rows.iter().map(|&r| ids[r].clone()).collect();
            if !options.shard.owns(&cluster_target(&episodes)) {
                tally.other_shards += 1;
                continue;
            }
            let weights: Vec<f32> = rows.iter().map(|&r| similarity[r]).collect();
            plans.push(Plan {
                tenant: tenant.clone(),
                index,
                grown: grown_members(graph, &episodes),
                episodes,
                weights,
                previous: matches[index],
                absorbed: absorbed[index].clone(),
                skills: members.len(),
            });
        }
    }
    Ok((plans, tally))
}

/// What a killed run's stored plan says besides its clusters: its run id and the shared plan
/// it came from.
struct Resumed {
    run_id: String,
    shared: Option<String>,
}

/// The plan of a killed run of this shard, if the store holds one: its clusters (each skill it
/// updates looked up in `graph`), its run id and shared plan, and its planning counts.
#[allow(clippy::type_complexity)] // the three parts of the plan, named in the doc
fn open_plan<'g>(
    writer: &Writer,
    graph: &'g Graph,
    options: &ConsolidateOptions,
) -> Result<Option<(Vec<Plan<'g>>, Resumed, Tally)>> {
    let Some(marker) = open_marker(writer) else {
        return Ok(None);
    };
    // A staging store inherits its main store's markers: another shard's plan is not ours.
    let shard = shard_key(options);
    if marker["shard"] != json!([shard.0, shard.1]) {
        return Ok(None);
    }
    let stored = load_plan(writer.store().dir(), marker)?;
    if stored.shard != shard {
        return Ok(None);
    }
    let plans = stored_plans(graph, stored.clusters)?;
    let resumed = Resumed {
        run_id: stored.run_id,
        shared: stored.shared,
    };
    Ok(Some((plans, resumed, stored.tally)))
}

/// The clusters of a stored plan, each skill it updates looked up in `graph`; a skill or an
/// episode the store lacks is an error.
fn stored_plans(graph: &Graph, clusters: Vec<StoredCluster>) -> Result<Vec<Plan<'_>>> {
    let mut plans = Vec::with_capacity(clusters.len());
    for cluster in clusters {
        let skill = |id: &NodeId| {
            graph.nodes.get(id).ok_or_else(|| Error::Plan {
                reason: format!("the stored plan updates skill {id}, which the store lacks"),
            })
        };
        let previous = cluster.previous.as_ref().map(skill).transpose()?;
        let absorbed = cluster
            .absorbed
            .iter()
            .map(skill)
            .collect::<Result<Vec<_>>>()?;
        if let Some(missing) = cluster
            .episodes
            .iter()
            .find(|id| !graph.nodes.contains_key(*id))
        {
            return Err(Error::Plan {
                reason: format!("the stored plan's episode {missing} is not in the store"),
            });
        }
        plans.push(Plan {
            tenant: cluster.tenant,
            index: cluster.index,
            grown: grown_members(graph, &cluster.episodes),
            episodes: cluster.episodes,
            weights: cluster.weights,
            previous,
            absorbed,
            skills: cluster.skills,
        });
    }
    Ok(plans)
}

/// The shard a plan is for, as stored.
fn shard_key(options: &ConsolidateOptions) -> (usize, usize) {
    (options.shard.index, options.shard.count)
}

/// How many clusters of the store's unfinished plan are handled (0 without one).
fn done_count(writer: &Writer) -> usize {
    writer
        .manifest()
        .progress
        .get(DONE_MARKER)
        .and_then(Value::as_u64)
        .map_or(0, |done| done as usize)
}

/// Clears the plan markers if they are still open once every cluster is handled (the last
/// cluster with work clears them with its commit, so this commits only if that cluster,
/// against expectation, changed nothing).
fn close_plan(writer: &mut Writer, run_id: &str) -> Result<()> {
    if open_marker(writer).is_none() {
        return Ok(());
    }
    let progress = [PLAN_MARKER, DONE_MARKER]
        .into_iter()
        .map(|key| (key.to_string(), Value::Null))
        .collect();
    writer.commit(
        &Graph::default(),
        CommitInfo {
            stage: STAGE.into(),
            run_id: run_id.into(),
            summary: json!({ "plan": "finished" }),
            progress,
        },
    )?;
    Ok(())
}

/// A tenant's episodes assigned to the clusters of its latest skills.
pub struct Assigned<'g> {
    /// Rows of each skill's cluster, most representative first (ties by row).
    pub members: Vec<Vec<usize>>,
    /// Cosine of each row to its cluster's centroid (0 for unassigned rows).
    pub similarity: Vec<f32>,
    /// The skill of each cluster.
    pub skills: Vec<Option<&'g Node>>,
    /// Episodes that fit no cluster.
    pub unassigned: usize,
}

/// Assigns a tenant's episodes (`ids`, in id order, with their `vectors`) to the clusters its
/// latest `skills` were distilled from, instead of clustering again: a skill's cluster is its
/// source episodes, its centroid their normalised mean, and its radius the lowest cosine of a
/// source to that centroid. An episode in no skill's sources joins the cluster of the nearest
/// centroid (ties to the first skill in id order) when it is within that cluster's radius (it
/// does not widen the cluster: the distortion bound), and fits none otherwise.
///
/// `None` (cluster again) when there are no skills, when two skills share a source (they come
/// from different clusterings), when a skill has no source left among the episodes, or when
/// more than `recluster_share` of the episodes fit no cluster. Centroids and radii come from
/// the sources alone, so the result does not depend on the order new episodes arrive in.
pub fn assign<'g>(
    ids: &[NodeId],
    vectors: &[Vec<f32>],
    skills: &[&'g Node],
    recluster_share: f64,
) -> Option<Assigned<'g>> {
    if skills.is_empty() || ids.is_empty() {
        return None;
    }
    let mut skills: Vec<&'g Node> = skills.to_vec();
    skills.sort_by(|a, b| a.id.cmp(&b.id));
    let row: BTreeMap<&NodeId, usize> = ids.iter().enumerate().map(|(r, id)| (id, r)).collect();
    let mut owner: Vec<Option<usize>> = vec![None; ids.len()];
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); skills.len()];
    for (s, skill) in skills.iter().enumerate() {
        for id in &skill_of(skill).source_episodes {
            if let Some(&r) = row.get(id) {
                if owner[r].is_some_and(|o| o != s) {
                    return None;
                }
                if owner[r].is_none() {
                    owner[r] = Some(s);
                    members[s].push(r);
                }
            }
        }
    }
    if members.iter().any(Vec::is_empty) {
        return None;
    }
    let centroids: Vec<Vec<f32>> = members
        .iter()
        .map(|rows| crate::kmeans::mean_direction(rows, vectors))
        .collect();
    let mut similarity = vec![0f32; ids.len()];
    for (rows, centroid) in members.iter().zip(&centroids) {
        for &r in rows {
            similarity[r] = fluxmem_models::cosine(&vectors[r], centroid);
        }
    }
    let radius: Vec<f32> = members
        .iter()
        .map(|rows| {
            rows.iter()
                .map(|&r| similarity[r])
                .fold(f32::INFINITY, f32::min)
        })
        .collect();
    let mut unassigned = 0;
    for r in (0..ids.len()).filter(|&r| owner[r].is_none()) {
        let cosines: Vec<f32> = centroids
            .iter()
            .map(|centroid| fluxmem_models::cosine(&vectors[r], centroid))
            .collect();
        let (best, best_cosine) = crate::kmeans::argmax(&cosines);
        if best_cosine >= radius[best] {
            members[best].push(r);
            similarity[r] = best_cosine;
        } else {
            unassigned += 1;
        }
    }
    if unassigned as f64 > recluster_share * ids.len() as f64 {
        return None;
    }
    for rows in &mut members {
        rows.sort_by(|&a, &b| similarity[b].total_cmp(&similarity[a]).then(a.cmp(&b)));
    }
    Some(Assigned {
        members,
        similarity,
        skills: skills.into_iter().map(Some).collect(),
        unassigned,
    })
}

/// Forgets the outcomes of episodes whose source `options.outcomes` does not name (they count
/// as unknown), and counts the episodes (of the options' tenant) by source.
fn believe_outcomes(graph: &mut Graph, options: &ConsolidateOptions) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for node in graph.nodes.values_mut() {
        if options.tenant.as_ref().is_some_and(|t| t != &node.tenant) {
            continue;
        }
        let source = node.outcome_source().to_string();
        let NodeBody::Episodic(episode) = &mut node.body else {
            continue;
        };
        let believed = source == "none" || options.outcomes.contains(&source);
        let key = if believed {
            source
        } else {
            episode.outcome.success = None;
            format!("{source} (not believed)")
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
}

/// What consolidation reads of the store: the episodes and skills (not the facts: a filtered
/// scan reads the kind column, then only their rows) with the episodes' steps (mining needs
/// their tool calls), their vectors, the distill edges (a new version retires its
/// predecessor's) and the `skill_failed` records of the edit log; not the facts, the ground
/// and link edges or the rest of the edit log, which are most of a store.
fn read(writer: &Writer, tenant: Option<&str>) -> Result<Graph> {
    let store = writer.store();
    // One tenant's run reads that tenant's episodes and skills only: their ids come from one
    // pass over the id, tenant and kind columns of the node shards, and every other read is
    // filtered on them before a row is decoded.
    let ids: Option<BTreeSet<NodeId>> = match tenant {
        None => None,
        Some(tenant) => Some(store.tenant_node_ids(
            writer.manifest(),
            tenant,
            &[NodeKind::Episodic, NodeKind::Procedural],
        )?),
    };
    let scan = Scan {
        nodes: true,
        nodes_of: ids.clone(),
        node_kinds: vec![NodeKind::Episodic, NodeKind::Procedural],
        steps: ids.clone().map_or(Rows::All, Rows::Of),
        edges: true,
        edge_kinds: vec![EdgeKind::Distill],
        edges_from: ids,
        edits: true,
        edit_kinds: vec!["skill_failed".into()],
        tenant: tenant.map(str::to_string),
        ..Default::default()
    };
    let mut graph = store.scan_at(writer.manifest(), &scan)?;
    let wanted: BTreeSet<NodeId> = graph
        .nodes
        .values()
        .filter(|n| matches!(n.kind(), NodeKind::Episodic | NodeKind::Procedural))
        .map(|n| n.id.clone())
        .collect();
    let vectors = store.scan_at(
        writer.manifest(),
        &Scan {
            vectors: Rows::Of(wanted),
            tenant: tenant.map(str::to_string),
            ..Default::default()
        },
    )?;
    graph.embeddings = vectors.embeddings;
    Ok(graph)
}

fn generator_usage(models: &Models<'_>) -> Usage {
    models
        .generator
        .as_ref()
        .map(|g| g.usage())
        .unwrap_or_default()
}

/// The generator's model id, or `none` for template skills.
fn generator_id(models: &Models<'_>) -> String {
    models
        .generator
        .as_ref()
        .map_or_else(|| "none".to_string(), |g| g.model_id().to_string())
}

/// The edit target that names a cluster: a hash of its sorted member ids.
fn cluster_target(episodes: &[NodeId]) -> String {
    let sorted: BTreeSet<&str> = episodes.iter().map(|id| id.as_str()).collect();
    let key: Vec<&str> = sorted.into_iter().collect();
    format!("cluster:{}", &sha256_hex(key.join("\n").as_bytes())[..32])
}

/// The members of a cluster that grew since they were first stored (a conversation logged
/// again, longer: ingest's `metadata.versions`, more than 1), with their version counts. A
/// skill records them (`metadata.source_versions`) beside its source ids, and a cluster's
/// outcome record is keyed by them too ([`state_target`]): a member that grows changes what
/// the cluster was mined from although its id stays.
fn grown_members(graph: &Graph, episodes: &[NodeId]) -> BTreeMap<String, u64> {
    episodes
        .iter()
        .filter_map(|id| {
            let versions = graph.nodes.get(id)?.metadata.get("versions")?.as_u64()?;
            (versions > 1).then(|| (id.to_string(), versions))
        })
        .collect()
}

/// The edit target of a cluster's outcome record: [`cluster_target`] of its members, and of
/// the versions of those that grew when any did (so a record of a cluster none of whose
/// members grew keeps its target).
fn state_target(plan: &Plan<'_>) -> String {
    if plan.grown.is_empty() {
        return cluster_target(&plan.episodes);
    }
    let versioned: Vec<NodeId> = plan
        .episodes
        .iter()
        .map(|id| match plan.grown.get(id.as_str()) {
            Some(versions) => NodeId(format!("{id}#{versions}")),
            None => id.clone(),
        })
        .collect();
    cluster_target(&versioned)
}

/// The sources of `previous` (a skill) still in the cluster whose version differs from the one
/// the skill was mined from (a skill without `source_versions` was mined from first versions).
/// A member that is not a source counts as gained already.
fn regrown(plan: &Plan<'_>, previous: &Node) -> usize {
    let before = previous.metadata.get("source_versions");
    let sources: BTreeSet<&str> = skill_of(previous)
        .source_episodes
        .iter()
        .map(|id| id.as_str())
        .collect();
    plan.grown
        .iter()
        .filter(|(id, _)| sources.contains(id.as_str()))
        .filter(|(id, versions)| {
            before
                .and_then(|b| b.get(id.as_str()))
                .and_then(Value::as_u64)
                .unwrap_or(1)
                != **versions
        })
        .count()
}

/// One cluster to handle.
struct Plan<'g> {
    tenant: String,
    index: usize,
    episodes: Vec<NodeId>,
    weights: Vec<f32>,
    previous: Option<&'g Node>,
    /// Other skills of the tenant whose clusters became this one: its new version takes their
    /// place too ([`absorbed_skills`]).
    absorbed: Vec<&'g Node>,
    skills: usize,
    /// The members that grew (conversations logged again, longer), with their version counts
    /// ([`grown_members`]).
    grown: BTreeMap<String, u64>,
}

type TenantEpisodes = BTreeMap<String, (Vec<NodeId>, Vec<Vec<f32>>)>;

/// The episodes to cluster, per tenant, in id order, with their vectors.
fn episodes_by_tenant(
    graph: &Graph,
    options: &ConsolidateOptions,
    model: &str,
) -> Result<TenantEpisodes> {
    let mut tenants: TenantEpisodes = BTreeMap::new();
    for node in graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Episodic)
    {
        if options.tenant.as_ref().is_some_and(|t| t != &node.tenant) {
            continue;
        }
        if options.successful_only && node.episode().and_then(|e| e.outcome.success) != Some(true) {
            continue;
        }
        let embedding = graph
            .embeddings
            .get(&(node.id.clone(), model.to_string()))
            .ok_or_else(|| Error::NotEmbedded {
                node: node.id.to_string(),
                model: model.to_string(),
            })?;
        let entry = tenants.entry(node.tenant.clone()).or_default();
        entry.0.push(node.id.clone());
        entry.1.push(embedding.vector.clone());
    }
    Ok(tenants)
}

/// The latest version of every skill: procedural nodes no other node lists as a previous version.
pub fn latest_skills(graph: &Graph) -> Vec<&Node> {
    let superseded: BTreeSet<&NodeId> = graph
        .nodes
        .values()
        .filter_map(|n| match &n.body {
            NodeBody::Procedural(skill) => Some(skill.previous_versions.iter()),
            _ => None,
        })
        .flatten()
        .collect();
    graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Procedural && !superseded.contains(&n.id))
        .collect()
}

fn skill_of(node: &Node) -> &Skill {
    match &node.body {
        NodeBody::Procedural(skill) => skill,
        _ => unreachable!("only procedural nodes are skills"),
    }
}

/// For each cluster, the existing skills of its tenant that no cluster updates and whose
/// sources all lie in it, when it updates another skill: its new version takes their place
/// (their procedure is its procedure now), so no skill outlives its cluster beside the one that
/// holds its episodes. In id order; an unmatched skill whose sources are spread over clusters
/// stays as it is.
fn absorbed_skills<'g>(
    members: &[Vec<usize>],
    ids: &[NodeId],
    matches: &[Option<&'g Node>],
    existing: &[&'g Node],
) -> Vec<Vec<&'g Node>> {
    let mut cluster_of: BTreeMap<&NodeId, usize> = BTreeMap::new();
    for (c, rows) in members.iter().enumerate() {
        cluster_of.extend(rows.iter().map(|&r| (&ids[r], c)));
    }
    let matched: BTreeSet<&NodeId> = matches.iter().flatten().map(|n| &n.id).collect();
    let mut absorbed: Vec<Vec<&'g Node>> = vec![Vec::new(); members.len()];
    let mut unmatched: Vec<&'g Node> = existing
        .iter()
        .copied()
        .filter(|n| !matched.contains(&n.id))
        .collect();
    unmatched.sort_by(|a, b| a.id.cmp(&b.id));
    for skill in unmatched {
        let clusters: BTreeSet<usize> = skill_of(skill)
            .source_episodes
            .iter()
            .filter_map(|id| cluster_of.get(id).copied())
            .collect();
        if let [c] = clusters.into_iter().collect::<Vec<_>>()[..] {
            if matches[c].is_some() {
                absorbed[c].push(skill);
            }
        }
    }
    absorbed
}

/// For each cluster, the existing skill it updates: candidates pass the overlap or the
/// similarity threshold; pairs are taken best first (overlap + cosine, ties by cluster, skill id),
/// each skill and cluster at most once.
fn match_skills<'g>(
    members: &[Vec<usize>],
    ids: &[NodeId],
    centroids: &[Vec<f32>],
    existing: &[&'g Node],
    graph: &Graph,
    model: &str,
    options: &ConsolidateOptions,
) -> Vec<Option<&'g Node>> {
    let mut candidates: Vec<(f64, usize, usize)> = Vec::new();
    for (c, rows) in members.iter().enumerate() {
        let cluster: BTreeSet<&NodeId> = rows.iter().map(|&r| &ids[r]).collect();
        for (s, node) in existing.iter().enumerate() {
            let sources = &skill_of(node).source_episodes;
            let shared = sources.iter().filter(|id| cluster.contains(id)).count();
            let overlap = if sources.is_empty() {
                0.0
            } else {
                shared as f64 / sources.len() as f64
            };
            let cosine = graph
                .embeddings
                .get(&(node.id.clone(), model.to_string()))
                .map_or(0.0, |e| fluxmem_models::cosine(&e.vector, &centroids[c]));
            if overlap >= options.match_overlap || cosine >= options.match_similarity {
                candidates.push((overlap + cosine as f64, c, s));
            }
        }
    }
    candidates.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(existing[a.2].id.cmp(&existing[b.2].id))
    });
    let mut matched = vec![None; members.len()];
    let mut used = BTreeSet::new();
    for (_, c, s) in candidates {
        if matched[c].is_none() && used.insert(s) {
            matched[c] = Some(existing[s]);
        }
    }
    matched
}

/// The status of a cluster that needs no work, or `None` when it does: `unchanged` (the
/// skill's sources are the cluster, none grown since), `kept` (changed by less than
/// `reinduce_share`), `no_procedure` (the same members, at the same versions, shared no
/// procedure before) or `failed_earlier`.
fn settled(
    plan: &Plan<'_>,
    options: &ConsolidateOptions,
    failed_before: &BTreeMap<&str, bool>,
) -> Option<&'static str> {
    let sorted: BTreeSet<&NodeId> = plan.episodes.iter().collect();
    // Skills to take the place of need a new version.
    if !plan.absorbed.is_empty() {
        return None;
    }
    if let Some(previous) = plan.previous {
        let sources: BTreeSet<&NodeId> = skill_of(previous).source_episodes.iter().collect();
        // A member that grew since the skill was mined counts as one gained.
        let regrown = regrown(plan, previous);
        if sources == sorted && regrown == 0 {
            return Some("unchanged");
        }
        if options.reinduce_share > 0.0 {
            let base = sources.len().max(1) as f64;
            let gained = (sorted.difference(&sources).count() + regrown) as f64 / base;
            let lost = sources.difference(&sorted).count() as f64 / base;
            if gained < options.reinduce_share && lost < options.reinduce_share {
                return Some("kept");
            }
        }
        return None;
    }
    match failed_before.get(state_target(plan).as_str()) {
        // Mining is deterministic: the same members still share no procedure.
        Some(true) => Some("no_procedure"),
        Some(false) if !options.retry_failed => Some("failed_earlier"),
        _ => None,
    }
}

#[allow(clippy::too_many_arguments)]
fn handle(
    plan: &Plan<'_>,
    graph: &Graph,
    roles: &ToolRoles,
    models: &mut Models<'_>,
    options: &ConsolidateOptions,
    run_id: &str,
    failed_before: &BTreeMap<&str, bool>,
    delta: &mut Graph,
    report: &mut ConsolidateReport,
) -> Result<ClusterReport> {
    if let Some(status) = settled(plan, options, failed_before) {
        count_settled(status, report);
        return Ok(ClusterReport {
            tenant: plan.tenant.clone(),
            episodes: plan.episodes.clone(),
            status: status.into(),
            skill: plan.previous.map(|node| node.id.clone()),
        });
    }
    let job = job_of(plan, graph, roles, models.embedder.model_id());
    let usage_before = (
        generator_usage(models),
        models.judge.as_ref().map(|j| j.usage()).unwrap_or_default(),
    );
    let started = std::time::Instant::now();
    let matured = mature(&job, models, options, plan.skills)?;
    let result = Outcome {
        plan,
        run_id,
        created_at: job
            .episodes
            .iter()
            .filter_map(|n| n.created_at)
            .max()
            .unwrap_or(0),
        delta,
        report,
    };
    Ok(match matured {
        Matured::NoProcedure { reason } => {
            let attempts = vec![Attempt {
                raw: String::new(),
                problem: reason,
            }];
            result.failed(attempts, true)
        }
        Matured::Failed { attempts } => result.failed(attempts, false),
        Matured::Skill {
            rounds,
            best,
            converged,
            rejected,
            skeleton,
            wording,
            eta_scope,
            measured_on,
        } => {
            let mined = Mined {
                skeleton: &skeleton,
                wording: &wording,
                eta_scope: &eta_scope,
                measured_on: &measured_on,
            };
            let node = skill_node(
                plan,
                &rounds,
                best,
                converged,
                &rejected,
                &mined,
                models,
                options,
                run_id,
                result.created_at,
                &cluster_key(plan),
            );
            let mut result = result;
            let mut skill = result.kept(graph, node, &rounds, best, models.embedder.model_id());
            skill.converged_round = converged;
            skill.generator = TokenUsage::between(usage_before.0, generator_usage(models));
            skill.judge = models
                .judge
                .as_ref()
                .map(|j| TokenUsage::between(usage_before.1, j.usage()))
                .unwrap_or_default();
            skill.seconds = started.elapsed().as_secs_f64();
            let cluster = ClusterReport {
                tenant: plan.tenant.clone(),
                episodes: plan.episodes.clone(),
                status: skill.status.clone(),
                skill: Some(skill.id.clone()),
            };
            result.report.skills.push(skill);
            cluster
        }
    })
}

/// Counts a cluster left as it was (see [`settled`]).
fn count_settled(status: &str, report: &mut ConsolidateReport) {
    match status {
        "unchanged" => report.skills_unchanged += 1,
        "kept" => report.skills_kept += 1,
        "no_procedure" => {
            report.failed += 1;
            report.no_procedure += 1;
        }
        _ => report.failed_earlier += 1,
    }
}

/// A cluster's episodes, with the skill it updates (its text and vector), as maturing reads
/// them.
fn job_of<'g>(plan: &Plan<'g>, graph: &'g Graph, roles: &'g ToolRoles, model: &str) -> Job<'g> {
    let previous = plan.previous.map(|node| {
        let vector = graph
            .embeddings
            .get(&(node.id.clone(), model.to_string()))
            .map(|e| e.vector.clone());
        (node.text.clone(), vector.unwrap_or_default())
    });
    Job {
        episodes: plan.episodes.iter().map(|id| &graph.nodes[id]).collect(),
        previous,
        roles,
    }
}

/// The key of a cluster's skill: its episodes' ids, sorted.
fn cluster_key<'p>(plan: &'p Plan<'_>) -> Vec<&'p str> {
    let sorted: BTreeSet<&NodeId> = plan.episodes.iter().collect();
    sorted.iter().map(|id| id.as_str()).collect()
}

/// A matured skill's status: `updated` where the cluster had one, else `new`.
fn result_status(plan: &Plan<'_>) -> &'static str {
    if plan.previous.is_some() {
        "updated"
    } else {
        "new"
    }
}

/// Where a matured cluster's result is written: the night's delta and report.
struct Outcome<'a, 'p> {
    plan: &'a Plan<'p>,
    run_id: &'a str,
    /// The newest episode's time: the skill's and the edits' (the data's, not the clock's).
    created_at: i64,
    delta: &'a mut Graph,
    report: &'a mut ConsolidateReport,
}

impl Outcome<'_, '_> {
    /// A cluster that gave no skill: a `skill_failed` edit with its attempts, and the counts.
    fn failed(self, attempts: Vec<Attempt>, no_procedure: bool) -> ClusterReport {
        let plan = self.plan;
        let target = state_target(plan);
        let after =
            json!({ "tenant": plan.tenant, "episodes": plan.episodes, "attempts": attempts });
        let reason = match attempts.first() {
            Some(attempt) if no_procedure => format!(
                "{NO_PROCEDURE_REASON}{} episodes: {}",
                plan.episodes.len(),
                attempt.problem
            ),
            _ => format!(
                "no readable skill for a cluster of {} episodes",
                plan.episodes.len()
            ),
        };
        let after = serde_json::to_string(&after).expect("JSON values serialise");
        let identity = format!("{STAGE}\0{}\0skill_failed\0{target}\0{after}", self.run_id);
        self.delta.edits.push(Edit {
            id: sha256_hex(identity.as_bytes())[..32].to_string(),
            run_id: self.run_id.into(),
            stage: STAGE.into(),
            kind: "skill_failed".into(),
            target: target.clone(),
            before: None,
            after: Some(after),
            reason,
            at: self.created_at,
        });
        self.report.failed += 1;
        self.report.no_procedure += usize::from(no_procedure);
        self.report.failures.push(FailedCluster {
            tenant: plan.tenant.clone(),
            target,
            episodes: plan.episodes.clone(),
            attempts,
        });
        ClusterReport {
            tenant: plan.tenant.clone(),
            episodes: plan.episodes.clone(),
            status: if no_procedure {
                "no_procedure"
            } else {
                "failed"
            }
            .into(),
            skill: None,
        }
    }

    /// A matured skill: its node and records in the delta, its count; its line in the
    /// report, less what the caller measured (rounds' convergence, usage, time).
    fn kept(
        &mut self,
        graph: &Graph,
        node: Node,
        rounds: &[Round],
        best: usize,
        model: &str,
    ) -> SkillReport {
        let plan = self.plan;
        record(
            self.delta,
            graph,
            plan,
            &node,
            &rounds[best],
            model,
            self.run_id,
        );
        if plan.previous.is_some() {
            self.report.skills_updated += 1;
        } else {
            self.report.skills_new += 1;
        }
        self.report.skills_absorbed += plan.absorbed.len();
        let skill = SkillReport {
            id: node.id.clone(),
            tenant: plan.tenant.clone(),
            name: rounds[best].skill.name.clone(),
            status: result_status(plan).into(),
            version: skill_of(&node).version,
            absorbed: plan.absorbed.iter().map(|n| n.id.clone()).collect(),
            support: plan.episodes.len(),
            rounds: rounds.iter().map(|r| r.score).collect(),
            best_round: best + 1,
            converged_round: None,
            generator: TokenUsage::default(),
            judge: TokenUsage::default(),
            seconds: 0.0,
        };
        self.delta.upsert_node(node);
        skill
    }
}

/// What mining gave a matured cluster, for the skill node's metadata.
struct Mined<'a> {
    skeleton: &'a crate::mine::Skeleton,
    wording: &'a crate::mature::Wording,
    eta_scope: &'a str,
    measured_on: &'a [NodeId],
}

/// The skill node of a matured cluster: its id depends only on the lineage and version (or, for
/// a first version, on the source episodes), so the same store and seed give the same ids.
#[allow(clippy::too_many_arguments)]
fn skill_node(
    plan: &Plan<'_>,
    rounds: &[Round],
    best: usize,
    converged: Option<usize>,
    rejected: &[Attempt],
    mined: &Mined<'_>,
    models: &Models<'_>,
    options: &ConsolidateOptions,
    run_id: &str,
    created_at: i64,
    key: &[&str],
) -> Node {
    let kept = &rounds[best];
    let (version, previous_versions, mut history, lineage) = match plan.previous {
        Some(previous) => {
            let skill = skill_of(previous);
            let lineage = previous
                .metadata
                .get("lineage")
                .and_then(Value::as_str)
                .unwrap_or(previous.id.as_str())
                .to_string();
            let mut versions = skill.previous_versions.clone();
            versions.push(previous.id.clone());
            for absorbed in &plan.absorbed {
                versions.extend(skill_of(absorbed).previous_versions.iter().cloned());
                versions.push(absorbed.id.clone());
            }
            (
                skill.version + 1,
                versions,
                skill.pems_history.clone(),
                Some(lineage),
            )
        }
        None => (1, Vec::new(), Vec::new(), None),
    };
    history.extend(rounds.iter().map(|r| r.score.pems));
    let body = NodeBody::Procedural(Skill {
        version,
        previous_versions,
        source_episodes: plan.episodes.clone(),
        pems_history: history,
    });
    let version_text = version.to_string();
    let joined = key.join("\n");
    let identity: Vec<&str> = match &lineage {
        Some(lineage) => vec!["skill", lineage.as_str(), version_text.as_str()],
        None => vec!["skill", "v1", joined.as_str()],
    };
    let mut node = Node::new(body, &plan.tenant, &kept.text, &identity);
    let lineage = lineage.unwrap_or_else(|| node.id.to_string());
    node.source_file = STAGE.into();
    node.source_locator = format!("{run_id}/cluster {}", plan.index);
    node.created_at = Some(
        plan.previous
            .and_then(|p| p.created_at)
            .unwrap_or(0)
            .max(created_at),
    );
    let metadata = [
        ("name", json!(kept.skill.name)),
        ("description", json!(kept.skill.description)),
        ("steps", json!(kept.skill.steps)),
        ("lineage", json!(lineage)),
        (
            "rounds",
            serde_json::to_value(rounds).expect("rounds serialise"),
        ),
        ("best_round", json!(best + 1)),
        ("converged_round", json!(converged)),
        (
            "rejected_answers",
            serde_json::to_value(rejected).expect("attempts serialise"),
        ),
        ("measured_on", json!(mined.measured_on)),
        ("pitfalls", json!(kept.skill.pitfalls)),
        ("decisions", json!(kept.skill.decisions)),
        (
            "skeleton",
            serde_json::to_value(mined.skeleton).expect("skeletons serialise"),
        ),
        (
            "wording",
            serde_json::to_value(mined.wording).expect("wording serialises"),
        ),
        ("eta_source", json!(mined.eta_scope)),
        ("generator", json!(generator_id(models))),
        (
            "judge",
            json!(models.judge.as_ref().map(|j| j.model_id().to_string())),
        ),
        ("embedding_model", json!(models.embedder.model_id())),
        ("length_unit", json!(options.pems.length)),
        ("divide_by_skills", json!(options.pems.divide_by_skills)),
        ("seed", json!(options.kmeans.seed)),
    ];
    node.metadata
        .extend(metadata.into_iter().map(|(k, v)| (k.to_string(), v)));
    if !plan.absorbed.is_empty() {
        let ids: Vec<&str> = plan.absorbed.iter().map(|n| n.id.as_str()).collect();
        node.metadata.insert("absorbed".into(), json!(ids));
    }
    // The versions of the sources that grew (none: the field is left out).
    if !plan.grown.is_empty() {
        node.metadata
            .insert("source_versions".into(), json!(plan.grown));
    }
    node
}

/// The node's distill edges, its embedding, the retired edges of the previous version, and the
/// edit records of all of them.
fn record(
    delta: &mut Graph,
    graph: &Graph,
    plan: &Plan<'_>,
    node: &Node,
    kept: &Round,
    model: &str,
    run_id: &str,
) {
    let at = node.created_at.unwrap_or(0);
    let kind = if plan.previous.is_some() {
        "skill_version"
    } else {
        "skill_induce"
    };
    let reason = format!(
        "distilled from {} episodes; PEMS {:.4} (eta {:.3}, length {}, delta {:.3})",
        plan.episodes.len(),
        kept.score.pems,
        kept.score.eta,
        kept.score.length,
        kept.score.delta
    );
    delta.edits.push(Edit::new(
        STAGE,
        run_id,
        kind,
        Changed::Node(None, Some(node)),
        &reason,
        at,
    ));
    for previous in plan.previous.iter().chain(&plan.absorbed) {
        for edge in graph
            .edges
            .values()
            .filter(|e| e.kind == EdgeKind::Distill && e.dst == previous.id && e.active)
        {
            let mut retired = edge.clone();
            retired.active = false;
            retired.run_id = run_id.into();
            retired.stage = STAGE.into();
            let why = format!(
                "superseded by version {} ({})",
                skill_of(node).version,
                node.id
            );
            delta.edits.push(Edit::new(
                STAGE,
                run_id,
                "distill_retire",
                Changed::Edge(Some(edge), Some(&retired)),
                &why,
                at,
            ));
            delta.upsert_edge(retired);
        }
    }
    for (episode, weight) in plan.episodes.iter().zip(&plan.weights) {
        let episode_time = graph
            .nodes
            .get(episode)
            .and_then(|n| n.created_at)
            .unwrap_or(0);
        let edge = Edge {
            src: episode.clone(),
            dst: node.id.clone(),
            kind: EdgeKind::Distill,
            weight: *weight,
            evidence: 1,
            stage: STAGE.into(),
            run_id: run_id.into(),
            created_at: episode_time.max(at),
            active: true,
            metadata: Default::default(),
        };
        delta.edits.push(Edit::new(
            STAGE,
            run_id,
            "distill",
            Changed::Edge(None, Some(&edge)),
            "source episode of the skill",
            at,
        ));
        delta.upsert_edge(edge);
    }
    delta.upsert_embedding(Embedding {
        node_id: node.id.clone(),
        model_id: model.into(),
        text_sha256: sha256_hex(node.embedding_text().as_bytes()),
        vector: kept.vector.clone(),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn consolidate_report(
        new: usize,
        updated: usize,
        unchanged: usize,
        failed: usize,
        failed_earlier: usize,
    ) -> ConsolidateReport {
        ConsolidateReport {
            clusters: new + updated + unchanged + failed + failed_earlier,
            skills_new: new,
            skills_updated: updated,
            skills_unchanged: unchanged,
            failed,
            failed_earlier,
            ..Default::default()
        }
    }

    /// A shard runs with its plan's settings, but for the clustering-only ones (the plan's), the
    /// device and the shard; planning again compares the clustering too. What differs is named
    /// with both values.
    #[test]
    fn a_shard_differs_from_its_plan_in_the_settings_it_runs_with() {
        let plan = ConsolidateOptions {
            models: ModelNames {
                generator: "gen".into(),
                device: "cpu".into(),
                ..Default::default()
            },
            ..Default::default()
        };
        let names = |changed: Vec<(String, String, String)>| -> Vec<String> {
            changed.into_iter().map(|(name, _, _)| name).collect()
        };
        let clustered_otherwise = ConsolidateOptions {
            kmeans: KMeansOptions {
                clusters: Some(2),
                restarts: plan.kmeans.restarts + 1,
                ..plan.kmeans.clone()
            },
            models: ModelNames {
                device: "cuda:0".into(),
                ..plan.models.clone()
            },
            shard: fluxmem_store::Shard { index: 1, count: 2 },
            ..plan.clone()
        };
        let same = settings_changed(Some(&plan), &clustered_otherwise, Compared::Shard);
        assert_eq!(names(same), Vec::<String>::new());
        let replanned = settings_changed(Some(&plan), &clustered_otherwise, Compared::Plan);
        assert_eq!(names(replanned), ["kmeans.clusters", "kmeans.restarts"]);
        // The seed also seeds the generator and is written on every skill: a shard's to share.
        let other = ConsolidateOptions {
            max_rounds: plan.max_rounds + 1,
            kmeans: KMeansOptions {
                seed: plan.kmeans.seed + 1,
                ..plan.kmeans.clone()
            },
            models: ModelNames {
                generator: "other".into(),
                ..plan.models.clone()
            },
            ..plan.clone()
        };
        let changed = settings_changed(Some(&plan), &other, Compared::Shard);
        assert_eq!(
            changed[2],
            (
                "models.generator".into(),
                "\"gen\"".into(),
                "\"other\"".into()
            )
        );
        assert_eq!(
            names(changed),
            ["kmeans.seed", "max_rounds", "models.generator"]
        );
        assert_eq!(
            names(settings_changed(None, &plan, Compared::Shard)),
            ["settings"]
        );
        // What a plan file holds reads back as the same settings.
        let text = serde_json::to_string(&plan).unwrap();
        let read: ConsolidateOptions = serde_json::from_str(&text).unwrap();
        assert_eq!(read, plan);
    }

    #[test]
    fn consolidate_status_says_how_many_clusters_gave_a_skill() {
        assert_eq!(
            consolidate_report(0, 0, 0, 6, 0).status(),
            "degraded: 0 of 6 clusters gave a skill (6 failed)"
        );
        assert_eq!(
            consolidate_report(1, 0, 0, 5, 0).status(),
            "partial: 1 of 6 clusters gave a skill (5 failed)"
        );
        assert_eq!(
            consolidate_report(0, 0, 1, 1, 2).status(),
            "partial: 1 of 4 clusters gave a skill (1 failed, 2 failed in an earlier run, not retried)"
        );
        assert_eq!(
            consolidate_report(0, 0, 0, 0, 2).status(),
            "degraded: 0 of 2 clusters gave a skill (2 failed in an earlier run, not retried)"
        );
        // Clusters whose successes share no procedure are a finding, not a failure.
        let mut report = consolidate_report(5, 0, 0, 1, 0);
        report.no_procedure = 1;
        assert_eq!(
            report.status(),
            "done (1 of 6 clusters share no procedure, so no skill)"
        );
        let mut report = consolidate_report(5, 0, 0, 2, 0);
        report.no_procedure = 1;
        assert_eq!(
            report.status(),
            "partial: 5 of 7 clusters gave a skill (1 failed, 1 sharing no procedure)"
        );
        let mut report = consolidate_report(0, 0, 0, 2, 0);
        report.no_procedure = 2;
        assert_eq!(
            report.status(),
            "degraded: 0 of 2 clusters gave a skill (2 sharing no procedure)"
        );
        assert_eq!(consolidate_report(2, 1, 0, 0, 0).status(), "done");
        assert_eq!(consolidate_report(0, 0, 3, 0, 0).status(), "nothing new");
        assert_eq!(consolidate_report(0, 0, 0, 0, 0).status(), "nothing new");
    }

    /// A killed run resumes with the skills each cluster takes the place of; a plan without
    /// any stores no field for them (plans written before keep their hash).
    #[test]
    fn a_stored_plan_keeps_the_skills_a_cluster_absorbs() {
        let skill = |name: &str| {
            let body = NodeBody::Procedural(Skill {
                version: 1,
                previous_versions: Vec::new(),
                source_episodes: Vec::new(),
                pems_history: Vec::new(),
            });
            Node::new(body, "t", name, &[name])
        };
        let (first, second) = (skill("first"), skill("second"));
        let mut graph = Graph::default();
        graph.upsert_node(first.clone());
        graph.upsert_node(second.clone());
        fn plan<'g>(previous: &'g Node, absorbed: Vec<&'g Node>) -> Plan<'g> {
            Plan {
                tenant: "t".into(),
                index: 0,
                episodes: Vec::new(),
                weights: Vec::new(),
                previous: Some(previous),
                absorbed,
                skills: 1,
                grown: BTreeMap::new(),
            }
        }
        let stored = StoredPlan::of(
            "run",
            (0, 1),
            &[plan(&first, vec![&second])],
            Tally::default(),
            None,
        );
        let text = serde_json::to_string(&stored).unwrap();
        let read: StoredPlan = serde_json::from_str(&text).unwrap();
        let plans = stored_plans(&graph, read.clusters).unwrap();
        assert_eq!(plans[0].previous.map(|n| &n.id), Some(&first.id));
        let absorbed: Vec<&NodeId> = plans[0].absorbed.iter().map(|n| &n.id).collect();
        assert_eq!(absorbed, [&second.id]);
        let plain = StoredPlan::of(
            "run",
            (0, 1),
            &[plan(&first, Vec::new())],
            Tally::default(),
            None,
        );
        let text = serde_json::to_string(&plain).unwrap();
        assert!(!text.contains("absorbed"), "{text}");
        // A plan naming a skill the store lacks is refused, not followed.
        let mut missing = graph.clone();
        missing.nodes.remove(&second.id);
        assert!(stored_plans(&missing, stored.clusters).is_err());
    }

    /// The sweep removes exactly the names `save_plan` writes: its files and the temporaries
    /// `fluxmem_store::write_atomically` leaves when killed, nothing else.
    #[test]
    fn plan_files_and_their_temporaries_are_recognised() {
        let hex = "0123456789abcdef";
        for ours in [
            format!("plan-{hex}.json"),
            format!(".plan-{hex}.json.tmp-4242"),
            format!(".plan-{hex}.json.tmp"),
        ] {
            assert!(plan_file_name(&ours, "plan-"), "{ours}");
        }
        for other in [
            format!("plan-{hex}.jsonl"),
            format!(".plan-{hex}.json.tmp-x"),
            format!("shared-{hex}.json"),
            format!("plan-{}.json", &hex[..15]),
            "notes.txt".to_string(),
        ] {
            assert!(!plan_file_name(&other, "plan-"), "{other}");
        }
    }
}
