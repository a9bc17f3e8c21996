//! Batch Stage II: credit assignment from logged outcomes (`fluxmem refine`).
//!
//! Every episode with a logged outcome contributes `r = 1` (success) or `r = 0` (failure); an
//! episode with only a reward uses the reward clamped to [0, 1]. Per tenant, with `p` the base
//! success rate (clamped to [0.05, 0.95]) and `alpha` the prior strength:
//!
//! - a semantic node `s` grounded in `n_s` episodes with outcomes summing to `S_s` has the
//!   smoothed lift `credit(s) = ((S_s + alpha * p) / (n_s + alpha)) / p`: above 1 when the
//!   episodes it supported succeed more often than usual, below 1 when they fail more often.
//!   Each ground edge `s -> e` gets `weight = w1 * credit(s)`, where `w1` is the edge's Stage I
//!   weight (kept in `metadata.stage1_weight`), and `evidence = e1 + n_s` (Stage I evidence plus
//!   the outcomes that were counted);
//! - a link edge `a -> b` between episodes gets `weight = w1 * credit(b)`,
//!   `credit(b) = ((r_b + alpha * p) / (1 + alpha)) / p`: links lead to successes more strongly;
//! - **Link Prune**: an edge whose credit is below `prune_below` with at least `min_evidence`
//!   outcomes behind it is deactivated (re-activated by a later run if its credit recovers);
//! - **Link Expand**: a failed episode gets a link (`relation: success_of_same_task`) to the
//!   successful episodes of the same task (same tenant, and same `task_id` metadata and source
//!   file, or the same task text) nearest in time, `max_failure_links` (3) at most:
//!   under-connection, the failure lacked what the success had.
//! - **Isolation**: tenants never mix. Base rates, credit sums and links are per tenant; an
//!   edge joining two tenants' nodes (left by an older store) gives and gets no credit and is
//!   deactivated (`pruned_by: isolation`, reason `cross-tenant edge (isolation)`), for good.
//!
//! Weights are recomputed from all outcomes in the store on every run, so the update is
//! idempotent (a second run over the same store changes nothing) and incremental (new
//! episodes move the credits). Every change is an [`Edit`] in the same atomic commit.
//!
//! **A night writes what moved.** Two rules keep a night's writes in proportion to what its
//! outcomes changed, not to the history:
//! - the base rate `p` of a tenant is a *prior* kept in the store (progress marker
//!   `refine.base_rate`) and re-estimated only when the tenant's current rate drifts from it by
//!   more than `prior_drift` (a new rate would move every edge of the tenant);
//! - an edge is rewritten only when its credit moved by more than `tolerance` since it was last
//!   written, when it is pruned or re-activated, or when it has no credit yet. An edge that is
//!   not rewritten keeps the `evidence` and `outcomes` of its last write. As a tenant's history
//!   grows, one night's outcomes move each credit by less, and fewer edges are rewritten.

use fluxmem_graph::{Changed, Edge, EdgeKey, EdgeKind, Edit, Graph, Node, NodeId};
use fluxmem_store::{CommitInfo, Writer};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

use crate::query::STAGE;
// Stage I's progress callbacks serve here too (counted in edges assessed).
use fluxmem_connect::Progress;
use crate::Result;

/// Settings of the batch credit assignment.
#[derive(Debug, Clone, Serialize)]
pub struct CreditOptions {
    /// Prior strength `alpha` (pseudo-outcomes at the base rate).
    pub prior: f64,
    /// Edges whose credit falls below this are pruned...
    pub prune_below: f64,
    /// ...once at least this many outcomes are behind them.
    pub min_evidence: usize,
    /// Link failed episodes to successful episodes of the same task.
    pub link_failures: bool,
    /// Links per failed episode at most: to the successes of its task nearest in time (ties by
    /// id). Without a cap the links grow as failures x successes of a task.
    pub max_failure_links: usize,
    /// An edge is rewritten when its credit moved by more than this since its last write (0:
    /// on any change).
    pub tolerance: f64,
    /// A tenant's stored base rate is re-estimated when the current rate differs by more.
    pub prior_drift: f64,
}

impl Default for CreditOptions {
    fn default() -> Self {
        CreditOptions { prior: 2.0, prune_below: 0.5, min_evidence: 3, link_failures: true, max_failure_links: 3, tolerance: 0.05, prior_drift: 0.02 }
    }
}

/// The progress marker that holds each tenant's base rate (the prior of the credits).
pub const BASE_RATE_MARKER: &str = "refine.base_rate";

/// What credit assignment needs of a node, looked up once per edge end.
struct Info<'g> {
    tenant: &'g str,
    outcome: Option<f64>,
    episode: bool,
}

/// What a refine run did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CreditReport {
    /// Episodes in the store.
    pub episodes: usize,
    /// Episodes with a logged outcome.
    pub with_outcome: usize,
    /// Base success rate per tenant.
    pub base_rate: BTreeMap<String, f64>,
    /// Edges whose weight or evidence changed.
    pub reweighted: usize,
    /// Edges whose credit moved by no more than the tolerance: not rewritten.
    pub within_tolerance: usize,
    /// Tenants whose base rate was (re-)estimated this run.
    pub base_rate_estimated: Vec<String>,
    /// Edges pruned by this run.
    pub pruned: usize,
    /// Edges re-activated by this run.
    pub reactivated: usize,
    /// Links added from failures to successes of the same task.
    pub expanded: usize,
    /// Edges joining two tenants' nodes (left by an older store): never credited.
    pub cross_tenant: usize,
    /// Cross-tenant edges this run deactivated.
    pub isolated: usize,
    /// Edit records written.
    pub edits: usize,
    /// Commits made (0 when nothing changed).
    pub commits: usize,
}

/// The outcome of an episode in [0, 1], if logged.
pub fn outcome(node: &Node) -> Option<f64> {
    let episode = node.episode()?;
    match (episode.outcome.success, episode.outcome.reward) {
        (Some(true), _) => Some(1.0),
        (Some(false), _) => Some(0.0),
        (None, Some(reward)) if reward.is_finite() => Some(reward.clamp(0.0, 1.0)),
        _ => None,
    }
}

/// The new state of every edge the outcomes speak to, and the links to add; the graph is not
/// changed. Returns (changed edges with their edit kind and reason, report counts).
pub fn assign(graph: &Graph, options: &CreditOptions, run_id: &str) -> (Vec<(Edge, &'static str, String)>, CreditReport) {
    assign_with_priors(graph, options, run_id, &BTreeMap::new())
}

/// [`assign`] with the stored base rates `priors` (per tenant): a tenant's prior is used while
/// its current rate stays within `prior_drift` of it; otherwise (or without one) the current
/// rate is used and named in `base_rate_estimated`. `report.base_rate` holds the rates used.
pub fn assign_with_priors(
    graph: &Graph,
    options: &CreditOptions,
    run_id: &str,
    priors: &BTreeMap<String, f64>,
) -> (Vec<(Edge, &'static str, String)>, CreditReport) {
    // One hashed look-up per node id instead of B-tree searches over long ids: the loops below
    // visit every edge.
    let info: HashMap<&NodeId, Info> = graph
        .nodes
        .values()
        .map(|n| (&n.id, Info { tenant: n.tenant.as_str(), outcome: outcome(n), episode: n.episode().is_some() }))
        .collect();
    let outcomes: BTreeMap<&NodeId, f64> = info.iter().filter_map(|(id, i)| i.outcome.map(|r| (*id, r))).collect();
    let mut report = CreditReport {
        episodes: info.values().filter(|i| i.episode).count(),
        with_outcome: outcomes.len(),
        ..Default::default()
    };
    let mut per_tenant: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
    for (id, r) in &outcomes {
        let entry = per_tenant.entry(info[*id].tenant).or_default();
        entry.0 += r;
        entry.1 += 1;
    }
    let mut base: BTreeMap<&str, f64> = BTreeMap::new();
    for (tenant, (sum, n)) in &per_tenant {
        let now = (sum / *n as f64).clamp(0.05, 0.95);
        match priors.get(*tenant) {
            Some(&prior) if (now - prior).abs() <= options.prior_drift => {
                base.insert(tenant, prior);
            }
            _ => {
                base.insert(tenant, now);
                report.base_rate_estimated.push(tenant.to_string());
            }
        }
    }
    report.base_rate = base.iter().map(|(t, p)| (t.to_string(), *p)).collect();
    let rate = |id: &NodeId| info.get(id).and_then(|i| base.get(i.tenant)).copied();
    let within_tenant = |edge: &Edge| match (info.get(&edge.src), info.get(&edge.dst)) {
        (Some(src), Some(dst)) => src.tenant == dst.tenant,
        _ => true,
    };
    let outcome_of = |id: &NodeId| info.get(id).and_then(|i| i.outcome);
    // Outcomes behind each semantic node, through its ground edges (stage-1 or refine, active or
    // pruned by credit: the credit is about the node, not about which edges are active now).
    // Only edges inside one tenant count: another tenant's outcomes never move a credit.
    let mut behind: HashMap<&NodeId, (f64, usize)> = HashMap::new();
    for edge in graph.edges.values().filter(|e| e.kind == EdgeKind::Ground && counts(e) && within_tenant(e)) {
        if let Some(r) = outcome_of(&edge.dst) {
            let entry = behind.entry(&edge.src).or_default();
            entry.0 += r;
            entry.1 += 1;
        }
    }
    let mut changes = Vec::new();
    for edge in graph.edges.values() {
        if !within_tenant(edge) {
            report.cross_tenant += 1;
            if let Some(change) = isolate(edge, run_id) {
                report.isolated += 1;
                changes.push(change);
            }
            continue;
        }
        let (credit, evidence) = match edge.kind {
            EdgeKind::Ground if counts(edge) => match (behind.get(&edge.src), rate(&edge.dst)) {
                (Some(&(sum, n)), Some(p)) if outcome_of(&edge.dst).is_some() => (((sum + options.prior * p) / (n as f64 + options.prior)) / p, n),
                _ => continue,
            },
            EdgeKind::Link if counts(edge) && info.get(&edge.src).is_some_and(|i| i.episode) => {
                match (outcome_of(&edge.dst), rate(&edge.dst)) {
                    (Some(r), Some(p)) => (((r + options.prior * p) / (1.0 + options.prior)) / p, 1),
                    _ => continue,
                }
            }
            _ => continue,
        };
        let mut next = edge.clone();
        let stage1_weight = edge.metadata.get("stage1_weight").and_then(Value::as_f64).unwrap_or(edge.weight as f64);
        let stage1_evidence = edge.metadata.get("stage1_evidence").and_then(Value::as_i64).unwrap_or(edge.evidence);
        next.metadata.insert("stage1_weight".into(), stage1_weight.into());
        next.metadata.insert("stage1_evidence".into(), stage1_evidence.into());
        next.metadata.insert("credit".into(), round6(credit).into());
        next.metadata.insert("outcomes".into(), evidence.into());
        next.weight = (stage1_weight * credit) as f32;
        next.evidence = stage1_evidence + evidence as i64;
        let pruned_by_credit = edge.metadata.get("pruned_by").and_then(Value::as_str) == Some("credit");
        // The reason is written only for an edge that changes (most are within tolerance).
        enum Why {
            Prune,
            Recovered,
            Credit,
        }
        let why = if credit < options.prune_below && evidence >= options.min_evidence {
            next.active = false;
            next.metadata.insert("pruned_by".into(), "credit".into());
            if edge.active {
                report.pruned += 1;
            }
            Why::Prune
        } else if !edge.active && pruned_by_credit {
            next.active = true;
            next.metadata.remove("pruned_by");
            report.reactivated += 1;
            Why::Recovered
        } else {
            Why::Credit
        };
        let state_changed = edge.active != next.active || edge.metadata.get("pruned_by") != next.metadata.get("pruned_by");
        let moved = match edge.metadata.get("credit").and_then(Value::as_f64) {
            Some(stored) => (stored - credit).abs() > options.tolerance,
            None => true,
        };
        if !state_changed && !moved && !same(edge, &next) {
            report.within_tolerance += 1;
            continue;
        }
        if !same(edge, &next) {
            next.stage = STAGE.into();
            next.run_id = run_id.into();
            let (kind, reason) = match why {
                Why::Prune => ("link_prune", format!("credit {credit:.3} < {} over {evidence} outcomes: present in failures", options.prune_below)),
                Why::Recovered => ("credit", format!("credit {credit:.3} recovered over {evidence} outcomes")),
                Why::Credit => ("credit", format!("credit {credit:.3} over {evidence} outcomes (base rate {:.3})", rate(&edge.dst).unwrap_or_default())),
            };
            if kind == "credit" {
                report.reweighted += 1;
            }
            changes.push((next, kind, reason));
        }
    }
    if options.link_failures {
        // The tenant is part of the task: a failure is never linked to another tenant's success.
        let task_key = |n: &Node| -> String {
            match n.metadata.get("task_id") {
                Some(task) => format!("{}\0{}\0{task}", n.tenant, n.source_file),
                None => format!("{}\0text\0{}", n.tenant, n.text),
            }
        };
        let time = |id: &NodeId| graph.nodes[id].created_at.unwrap_or(0);
        // Per task: its successes (with their times) and failures; each node's task, once.
        let mut tasks: BTreeMap<String, (Vec<(i64, &NodeId)>, Vec<&NodeId>)> = BTreeMap::new();
        let mut task_of: HashMap<&NodeId, (String, bool)> = HashMap::new();
        for (id, r) in &outcomes {
            let key = task_key(&graph.nodes[*id]);
            let entry = tasks.entry(key.clone()).or_default();
            if *r >= 0.5 {
                entry.0.push((time(id), id));
            } else {
                entry.1.push(id);
            }
            task_of.insert(id, (key, *r >= 0.5));
        }
        // The links each failure already has to successes of its task, from one pass over the
        // links (not a look-up per failure and success): they count towards the cap, so a later
        // night adds none once a failure has its links.
        let mut linked: HashMap<&NodeId, usize> = HashMap::new();
        for edge in graph.edges.values().filter(|e| e.kind == EdgeKind::Link) {
            if let (Some((a, false)), Some((b, true))) = (task_of.get(&edge.src), task_of.get(&edge.dst)) {
                if a == b {
                    *linked.entry(&edge.src).or_default() += 1;
                }
            }
        }
        for (successes, failures) in tasks.values() {
            for failure in failures {
                let existing = linked.get(*failure).copied().unwrap_or(0);
                let mut budget = options.max_failure_links.saturating_sub(existing);
                if budget == 0 || existing >= successes.len() {
                    continue;
                }
                // The successes nearest in time, ties by id.
                let at = time(failure);
                let mut nearest: Vec<(u64, &NodeId)> = successes.iter().map(|(t, s)| ((t - at).unsigned_abs(), *s)).collect();
                nearest.sort_unstable();
                for (_, success) in nearest {
                    if budget == 0 {
                        break;
                    }
                    let key = EdgeKey { src: (*failure).clone(), dst: success.clone(), kind: EdgeKind::Link };
                    if graph.edges.contains_key(&key) {
                        continue;
                    }
                    budget -= 1;
                    let mut metadata = BTreeMap::new();
                    metadata.insert("relation".into(), Value::from("success_of_same_task"));
                    changes.push((
                        Edge {
                            src: key.src,
                            dst: key.dst,
                            kind: EdgeKind::Link,
                            weight: 1.0,
                            evidence: 1,
                            stage: STAGE.into(),
                            run_id: run_id.into(),
                            created_at: at.max(time(success)),
                            active: true,
                            metadata,
                        },
                        "link_expand",
                        "under-connection: this failed episode had no link to a success of the same task".into(),
                    ));
                    report.expanded += 1;
                }
            }
        }
    }
    (changes, report)
}

/// Runs credit assignment over the store and commits the changes (edges and edit log) in one
/// atomic commit; nothing is written when nothing changes.
///
/// Reads node rows and edges only (no steps, vectors or edit log): credit needs outcomes,
/// tenants and tasks. It commits edges and edits only, never the step-less nodes it read.
pub fn refine_store(writer: &mut Writer, options: &CreditOptions, run_id: &str, progress: &mut dyn Progress) -> Result<CreditReport> {
    let (graph, _) = writer.store().scan(&fluxmem_store::Scan::nodes_and_edges())?;
    progress.start(graph.edges.len() as u64);
    let priors: BTreeMap<String, f64> = writer
        .manifest()
        .progress
        .get(BASE_RATE_MARKER)
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default();
    let (changes, mut report) = assign_with_priors(&graph, options, run_id, &priors);
    progress.advance(graph.edges.len() as u64);
    if changes.is_empty() {
        return Ok(report);
    }
    // The edit time is the data's: the newest episode, so reruns write the same shards.
    let at = graph.nodes.values().filter(|n| n.episode().is_some()).filter_map(|n| n.created_at).max().unwrap_or(0);
    let mut delta = Graph::default();
    for (edge, kind, reason) in changes {
        let before = graph.edges.get(&edge.key());
        delta.edits.push(Edit::new(STAGE, run_id, kind, Changed::Edge(before, Some(&edge)), &reason, at));
        delta.upsert_edge(edge);
    }
    report.edits = delta.edits.len();
    let summary = serde_json::to_value(&report).expect("the report serialises");
    // The rates used become the priors of the next run (only with the changes they made).
    let rates = serde_json::to_value(&report.base_rate).expect("rates serialise");
    let progress = [(BASE_RATE_MARKER.to_string(), rates)].into_iter().collect();
    writer.commit(&delta, CommitInfo { stage: STAGE.into(), run_id: run_id.into(), summary, progress })?;
    report.commits = 1;
    Ok(report)
}

/// A cross-tenant edge deactivated for good (`pruned_by: isolation`; credit never re-activates
/// it), or `None` when it already is.
fn isolate(edge: &Edge, run_id: &str) -> Option<(Edge, &'static str, String)> {
    let mut next = edge.clone();
    next.active = false;
    next.metadata.insert("pruned_by".into(), "isolation".into());
    if same(edge, &next) {
        return None;
    }
    next.stage = STAGE.into();
    next.run_id = run_id.into();
    Some((next, "link_prune", "cross-tenant edge (isolation)".into()))
}

/// Edges whose credit is computed: Stage I edges and those credit assignment manages, not the
/// links of the query loop or of failure-success expansion.
fn counts(edge: &Edge) -> bool {
    edge.metadata.get("relation").is_none()
}

fn round6(value: f64) -> f64 {
    (value * 1e6).round() / 1e6
}

/// True when `next` says the same as `edge` (weights to 1e-6), ignoring who wrote it last.
fn same(edge: &Edge, next: &Edge) -> bool {
    (edge.weight - next.weight).abs() <= 1e-6
        && edge.evidence == next.evidence
        && edge.active == next.active
        && edge.metadata == next.metadata
}
