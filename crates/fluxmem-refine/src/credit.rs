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

use fluxmem_graph::{Changed, Edge, EdgeKind, Edit, Graph, Node, NodeId};
use fluxmem_store::{CommitInfo, Writer};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};

use crate::query::STAGE;
// Stage I's progress callbacks serve here too (counted in edges assessed).
use fluxmem_connect::Progress;
use crate::Result;

/// The maps keyed by node ids (millions of lookups a night): a fast hash, seeded fixed.
type Fast = foldhash::fast::FixedState;

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
    /// `refine_store` commits after this many changed edges (at least 1), so a night that
    /// moves millions of edges holds one commit's rows at a time, not all of them.
    pub commit_every: usize,
}

impl Default for CreditOptions {
    fn default() -> Self {
        CreditOptions { prior: 2.0, prune_below: 0.5, min_evidence: 3, link_failures: true, max_failure_links: 3, tolerance: 0.05, prior_drift: 0.02, commit_every: 100_000 }
    }
}

/// The progress marker that holds each tenant's base rate (the prior of the credits).
pub const BASE_RATE_MARKER: &str = "refine.base_rate";

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

/// What credit assignment needs of a node: its tenant and task (interned), its outcome, and
/// its time. One entry per node, not per edge; the node rows themselves are not kept.
#[derive(Clone, Copy)]
struct Info {
    tenant: u32,
    outcome: Option<f64>,
    episode: bool,
    /// The task (interned key) of an episode with an outcome.
    task: u32,
    time: i64,
}

/// The nodes as credit assignment sees them, built one node row at a time.
#[derive(Default)]
struct Nodes {
    info: HashMap<NodeId, Info, Fast>,
    tenants: Vec<String>,
    tenant_ids: HashMap<String, u32, Fast>,
    tasks: Vec<String>,
    task_ids: HashMap<String, u32, Fast>,
}

impl Nodes {
    fn add(&mut self, n: &Node) {
        let tenant = intern(&mut self.tenants, &mut self.tenant_ids, &n.tenant);
        let outcome = outcome(n);
        // The tenant is part of the task: a failure is never linked to another tenant's success.
        let task = match outcome {
            Some(_) => {
                let key = match n.metadata.get("task_id") {
                    Some(task) => format!("{}\0{}\0{task}", n.tenant, n.source_file),
                    None => format!("{}\0text\0{}", n.tenant, n.text),
                };
                intern(&mut self.tasks, &mut self.task_ids, &key)
            }
            None => 0,
        };
        let info = Info { tenant, outcome, episode: n.episode().is_some(), task, time: n.created_at.unwrap_or(0) };
        self.info.insert(n.id.clone(), info);
    }
}

fn intern(names: &mut Vec<String>, ids: &mut HashMap<String, u32, Fast>, name: &str) -> u32 {
    if let Some(&id) = ids.get(name) {
        return id;
    }
    let id = names.len() as u32;
    names.push(name.to_string());
    ids.insert(name.to_string(), id);
    id
}

/// Where the edges come from: an in-memory graph (in key order) or the store's live rows
/// streamed shard by shard ([`fluxmem_store::Live`]). Credit assignment reads them twice (sums,
/// then decisions) and keeps only the edges it changes.
trait Edges {
    /// Every edge of these kinds: source, destination, kind, and whether it names a `relation`.
    fn ends(&self, kinds: &[EdgeKind], f: &mut dyn FnMut(&str, &str, EdgeKind, bool)) -> Result<()>;
    /// Every edge as a [`View`] to `decide` on; the edges it gives a verdict, whole, to `then`.
    fn decide(&self, decide: &mut dyn FnMut(&View<'_>) -> Option<Verdict>, then: &mut dyn FnMut(Edge, Verdict)) -> Result<()>;
}

/// The credit keys of an edge's metadata, as stored (compared as JSON values, as the whole
/// metadata maps were).
#[derive(Debug, Default, serde::Deserialize)]
struct CreditMeta {
    #[serde(default)]
    stage1_weight: Option<Value>,
    #[serde(default)]
    stage1_evidence: Option<Value>,
    #[serde(default)]
    credit: Option<Value>,
    #[serde(default)]
    outcomes: Option<Value>,
    #[serde(default)]
    pruned_by: Option<Value>,
    /// The metadata names a `relation` (a Stage II link: never credited).
    #[serde(skip)]
    relation: bool,
}

impl CreditMeta {
    fn of(metadata: &BTreeMap<String, Value>) -> CreditMeta {
        CreditMeta {
            stage1_weight: metadata.get("stage1_weight").cloned(),
            stage1_evidence: metadata.get("stage1_evidence").cloned(),
            credit: metadata.get("credit").cloned(),
            outcomes: metadata.get("outcomes").cloned(),
            pruned_by: metadata.get("pruned_by").cloned(),
            relation: metadata.contains_key("relation"),
        }
    }

    /// The credit keys of stored metadata (`relation` is the store's to say: `EdgeRow`).
    fn parse(json: &str) -> std::result::Result<CreditMeta, String> {
        serde_json::from_str(json).map_err(|e| format!("metadata is not a JSON object: {e}"))
    }
}

/// What credit assignment decides on: an edge's key, weight, evidence, state and credit keys.
struct View<'a> {
    src: &'a str,
    dst: &'a str,
    kind: EdgeKind,
    weight: f32,
    evidence: i64,
    active: bool,
    meta: CreditMeta,
}

/// Why an edge's credit changes it.
#[derive(Debug, Clone, Copy)]
enum Why {
    Prune,
    Recovered,
    Credit,
}

/// What happens to an edge that changes.
enum Verdict {
    /// A cross-tenant edge, deactivated for good.
    Isolate,
    /// New credit (and maybe a new state).
    Credit { credit: f64, evidence: usize, stage1_weight: f64, stage1_evidence: i64, why: Why, kind: &'static str, reason: String },
}

impl Edges for Graph {
    fn ends(&self, kinds: &[EdgeKind], f: &mut dyn FnMut(&str, &str, EdgeKind, bool)) -> Result<()> {
        for e in self.edges.values().filter(|e| kinds.is_empty() || kinds.contains(&e.kind)) {
            f(e.src.as_str(), e.dst.as_str(), e.kind, !counts(e));
        }
        Ok(())
    }

    fn decide(&self, decide: &mut dyn FnMut(&View<'_>) -> Option<Verdict>, then: &mut dyn FnMut(Edge, Verdict)) -> Result<()> {
        for e in self.edges.values() {
            let view = View { src: e.src.as_str(), dst: e.dst.as_str(), kind: e.kind, weight: e.weight, evidence: e.evidence, active: e.active, meta: CreditMeta::of(&e.metadata) };
            if let Some(verdict) = decide(&view) {
                then(e.clone(), verdict);
            }
        }
        Ok(())
    }
}

impl Edges for fluxmem_store::Live<'_> {
    fn ends(&self, kinds: &[EdgeKind], f: &mut dyn FnMut(&str, &str, EdgeKind, bool)) -> Result<()> {
        Ok(self.edge_ends(kinds, f)?)
    }

    fn decide(&self, decide: &mut dyn FnMut(&View<'_>) -> Option<Verdict>, then: &mut dyn FnMut(Edge, Verdict)) -> Result<()> {
        Ok(self.edges_deciding(
            &mut |row| {
                let meta = CreditMeta { relation: row.relation, ..CreditMeta::parse(row.metadata)? };
                Ok(decide(&View { src: row.src, dst: row.dst, kind: row.kind, weight: row.weight, evidence: row.evidence, active: row.active, meta }))
            },
            then,
        )?)
    }
}

/// Pass 2's last source looked up, with what was found: edges come in runs of one source.
#[derive(Default)]
struct SrcMemo {
    src: Option<String>,
    info: Option<Info>,
    sum: Option<(u128, usize)>,
}

impl SrcMemo {
    fn remember(&mut self, src: &str) -> bool {
        if self.src.as_deref() == Some(src) {
            return true;
        }
        let key = self.src.get_or_insert_with(String::new);
        key.clear();
        key.push_str(src);
        false
    }

    /// `info[src]` and `behind[src]` (once `behind` is complete).
    fn info_and_sum(&mut self, info: &HashMap<NodeId, Info, Fast>, behind: &HashMap<NodeId, (u128, usize), Fast>, src: &str) -> (Option<Info>, Option<(u128, usize)>) {
        if !self.remember(src) {
            self.info = info.get(src).copied();
            self.sum = behind.get(src).copied();
        }
        (self.info, self.sum)
    }
}

/// Pass 1's current run of one source: its `info` looked up once, and the outcomes behind it
/// summed over the run, added to `behind` when the run ends.
#[derive(Default)]
struct Run {
    src: Option<String>,
    info: Option<Info>,
    sum: u128,
    n: usize,
}

impl Run {
    /// Makes `src` the current source (ending the run of another) and returns `info[src]`.
    fn enter(&mut self, src: &str, info: &HashMap<NodeId, Info, Fast>, behind: &mut HashMap<NodeId, (u128, usize), Fast>) -> Option<Info> {
        if self.src.as_deref() != Some(src) {
            self.flush(behind);
            let key = self.src.get_or_insert_with(String::new);
            key.clear();
            key.push_str(src);
            self.info = info.get(src).copied();
        }
        self.info
    }

    /// Adds the run's sum to `behind[src]`.
    fn flush(&mut self, behind: &mut HashMap<NodeId, (u128, usize), Fast>) {
        let Some(src) = self.src.as_deref().filter(|_| self.n > 0) else { return };
        match behind.get_mut(src) {
            Some(entry) => *entry = (entry.0 + self.sum, entry.1 + self.n),
            None => {
                behind.insert(NodeId(src.to_string()), (self.sum, self.n));
            }
        }
        self.sum = 0;
        self.n = 0;
    }
}

/// An edge credit assignment writes: the row it replaces (none for a new link), the new row,
/// the edit kind and its reason.
struct Change {
    before: Option<Edge>,
    next: Edge,
    kind: &'static str,
    reason: String,
}

/// Outcomes are summed in fixed point (2^-40), so a node's sum does not depend on the order its
/// edges are read in (key order in memory, shard order from the store): the same credits, to
/// the bit, however the store is laid out. 0/1 outcomes are exact; a fractional reward is
/// rounded to the nearest multiple of 2^-40 (an error below 1e-12 per outcome).
const FIXED: f64 = (1u64 << 40) as f64;

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
    let mut nodes = Nodes::default();
    graph.nodes.values().for_each(|n| nodes.add(n));
    let (changes, report) = assign_over(&nodes, graph, options, run_id, priors).expect("an in-memory graph reads without error");
    (changes.into_iter().map(|c| (c.next, c.kind, c.reason)).collect(), report)
}

/// The rule of [`assign_with_priors`] over any [`Edges`]: two passes, the first sums the
/// outcomes behind each semantic node and counts each failure's links, the second decides edge
/// by edge. The changes come back in edge key order, then the new links in task order, as one
/// in-memory pass over a `Graph` gives them.
fn assign_over(
    nodes: &Nodes,
    edges: &dyn Edges,
    options: &CreditOptions,
    run_id: &str,
    priors: &BTreeMap<String, f64>,
) -> Result<(Vec<Change>, CreditReport)> {
    let info = &nodes.info;
    let mut outcomes: Vec<(&NodeId, f64)> = info.iter().filter_map(|(id, i)| i.outcome.map(|r| (id, r))).collect();
    outcomes.sort_by(|a, b| a.0.cmp(b.0));
    let mut report = CreditReport {
        episodes: info.values().filter(|i| i.episode).count(),
        with_outcome: outcomes.len(),
        ..Default::default()
    };
    let mut per_tenant: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
    for (id, r) in &outcomes {
        let entry = per_tenant.entry(nodes.tenants[info[*id].tenant as usize].as_str()).or_default();
        entry.0 += r;
        entry.1 += 1;
    }
    let mut base: HashMap<u32, f64, Fast> = HashMap::default();
    for (tenant, (sum, n)) in &per_tenant {
        let now = (sum / *n as f64).clamp(0.05, 0.95);
        let used = match priors.get(*tenant) {
            Some(&prior) if (now - prior).abs() <= options.prior_drift => prior,
            _ => {
                report.base_rate_estimated.push(tenant.to_string());
                now
            }
        };
        base.insert(nodes.tenant_ids[*tenant], used);
        report.base_rate.insert(tenant.to_string(), used);
    }

    // Pass 1. Outcomes behind each semantic node, through its ground edges (stage-1 or refine,
    // active or pruned by credit: the credit is about the node, not about which edges are active
    // now). Only edges inside one tenant count: another tenant's outcomes never move a credit.
    // And the links each failure already has to successes of its task: they count towards the
    // cap, so a later night adds none once a failure has its links.
    // Read as ends only (no edge decoded); ids are copied only for the entries they create.
    // Edges come in key order within a shard, so runs of one source: its lookups are made once
    // a run, and its outcome sum is added up over the run, then stored (`Run`).
    let mut behind: HashMap<NodeId, (u128, usize), Fast> = HashMap::default();
    let mut failure_links: HashSet<(NodeId, NodeId), Fast> = HashSet::default();
    let mut run = Run::default();
    edges.ends(&[EdgeKind::Ground, EdgeKind::Link], &mut |src, dst, kind, relation| match kind {
        EdgeKind::Ground if !relation => {
            // An end missing from the store does not make the edge cross.
            let Some(d) = info.get(dst) else { return };
            let Some(r) = d.outcome else { return };
            if run.enter(src, info, &mut behind).is_none_or(|s| s.tenant == d.tenant) {
                run.sum += (r * FIXED).round() as u128;
                run.n += 1;
            }
        }
        EdgeKind::Link if options.link_failures => {
            let (Some(s), Some(d)) = (run.enter(src, info, &mut behind), info.get(dst)) else { return };
            if let (Some(a), Some(b)) = (s.outcome, d.outcome) {
                if a < 0.5 && b >= 0.5 && s.task == d.task {
                    failure_links.insert((NodeId(src.to_string()), NodeId(dst.to_string())));
                }
            }
        }
        _ => {}
    })?;
    run.flush(&mut behind);
    // Each failure's links to successes of its task (one per edge key).
    let mut linked: HashMap<&NodeId, usize, Fast> = HashMap::default();
    for (failure, _) in &failure_links {
        *linked.entry(failure).or_default() += 1;
    }

    // Pass 2: edge by edge, what changes, decided on a light view of the row (the stored
    // metadata's five credit keys, no map); only the rows that change are decoded whole.
    let mut changes = Vec::new();
    let mut memo = SrcMemo::default();
    let mut decide = |view: &View<'_>| -> Option<Verdict> {
        let (src_info, src_behind) = memo.info_and_sum(info, &behind, view.src);
        let (src_info, dst_info) = (src_info.as_ref(), info.get(view.dst));
        let within = match (src_info, dst_info) {
            (Some(s), Some(d)) => s.tenant == d.tenant,
            _ => true,
        };
        if !within {
            report.cross_tenant += 1;
            // Deactivated for good, unless it already is.
            if view.active || view.meta.pruned_by.as_ref().and_then(Value::as_str) != Some("isolation") {
                report.isolated += 1;
                return Some(Verdict::Isolate);
            }
            return None;
        }
        let dst_outcome = dst_info.and_then(|i| i.outcome);
        let dst_rate = dst_info.and_then(|i| base.get(&i.tenant)).copied();
        let (credit, evidence) = match view.kind {
            EdgeKind::Ground if !view.meta.relation => match (src_behind, dst_rate) {
                (Some((sum, n)), Some(p)) if dst_outcome.is_some() => {
                    let sum = sum as f64 / FIXED;
                    (((sum + options.prior * p) / (n as f64 + options.prior)) / p, n)
                }
                _ => return None,
            },
            EdgeKind::Link if !view.meta.relation && src_info.is_some_and(|i| i.episode) => match (dst_outcome, dst_rate) {
                (Some(r), Some(p)) => (((r + options.prior * p) / (1.0 + options.prior)) / p, 1),
                _ => return None,
            },
            _ => return None,
        };
        let meta = &view.meta;
        let stage1_weight = meta.stage1_weight.as_ref().and_then(Value::as_f64).unwrap_or(view.weight as f64);
        let stage1_evidence = meta.stage1_evidence.as_ref().and_then(Value::as_i64).unwrap_or(view.evidence);
        let pruned_by_credit = meta.pruned_by.as_ref().and_then(Value::as_str) == Some("credit");
        let (why, active) = if credit < options.prune_below && evidence >= options.min_evidence {
            if view.active {
                report.pruned += 1;
            }
            (Why::Prune, false)
        } else if !view.active && pruned_by_credit {
            report.reactivated += 1;
            (Why::Recovered, true)
        } else {
            (Why::Credit, view.active)
        };
        // The row as it would be written, compared with the stored one key by key (what
        // `same` compares on whole edges: the other metadata keys are not touched).
        let pruned_by_next = match why {
            Why::Prune => Some(Value::from("credit")),
            Why::Recovered => None,
            Why::Credit => meta.pruned_by.clone(),
        };
        let same = ((stage1_weight * credit) as f32 - view.weight).abs() <= 1e-6
            && stage1_evidence + evidence as i64 == view.evidence
            && active == view.active
            && meta.stage1_weight == Some(Value::from(stage1_weight))
            && meta.stage1_evidence == Some(Value::from(stage1_evidence))
            && meta.credit == Some(Value::from(round6(credit)))
            && meta.outcomes == Some(Value::from(evidence))
            && meta.pruned_by == pruned_by_next;
        let state_changed = view.active != active || meta.pruned_by != pruned_by_next;
        let moved = match meta.credit.as_ref().and_then(Value::as_f64) {
            Some(stored) => (stored - credit).abs() > options.tolerance,
            None => true,
        };
        if !state_changed && !moved && !same {
            report.within_tolerance += 1;
            return None;
        }
        if same {
            return None;
        }
        let (kind, reason) = match why {
            Why::Prune => ("link_prune", format!("credit {credit:.3} < {} over {evidence} outcomes: present in failures", options.prune_below)),
            Why::Recovered => ("credit", format!("credit {credit:.3} recovered over {evidence} outcomes")),
            Why::Credit => ("credit", format!("credit {credit:.3} over {evidence} outcomes (base rate {:.3})", dst_rate.unwrap_or_default())),
        };
        if kind == "credit" {
            report.reweighted += 1;
        }
        Some(Verdict::Credit { credit, evidence, stage1_weight, stage1_evidence, why, kind, reason })
    };
    let mut apply = |edge: Edge, verdict: Verdict| {
        let mut next = edge.clone();
        next.stage = STAGE.into();
        next.run_id = run_id.into();
        match verdict {
            Verdict::Isolate => {
                next.active = false;
                next.metadata.insert("pruned_by".into(), "isolation".into());
                changes.push(Change { before: Some(edge), next, kind: "link_prune", reason: "cross-tenant edge (isolation)".into() });
            }
            Verdict::Credit { credit, evidence, stage1_weight, stage1_evidence, why, kind, reason } => {
                next.metadata.insert("stage1_weight".into(), stage1_weight.into());
                next.metadata.insert("stage1_evidence".into(), stage1_evidence.into());
                next.metadata.insert("credit".into(), round6(credit).into());
                next.metadata.insert("outcomes".into(), evidence.into());
                next.weight = (stage1_weight * credit) as f32;
                next.evidence = stage1_evidence + evidence as i64;
                match why {
                    Why::Prune => {
                        next.active = false;
                        next.metadata.insert("pruned_by".into(), "credit".into());
                    }
                    Why::Recovered => {
                        next.active = true;
                        next.metadata.remove("pruned_by");
                    }
                    Why::Credit => {}
                }
                changes.push(Change { before: Some(edge), next, kind, reason });
            }
        }
    };
    edges.decide(&mut decide, &mut apply)?;
    // Key order, whatever order the edges were read in.
    changes.sort_by(|a, b| (&a.next.src, &a.next.dst, a.next.kind).cmp(&(&b.next.src, &b.next.dst, b.next.kind)));

    if options.link_failures {
        // Per task: its successes (with their times) and failures, in id order.
        let mut tasks: BTreeMap<&str, (Vec<(i64, &NodeId)>, Vec<&NodeId>)> = BTreeMap::new();
        for (id, r) in &outcomes {
            let i = &info[*id];
            let entry = tasks.entry(nodes.tasks[i.task as usize].as_str()).or_default();
            if *r >= 0.5 {
                entry.0.push((i.time, id));
            } else {
                entry.1.push(id);
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
                let at = info[*failure].time;
                let mut nearest: Vec<(u64, &NodeId)> = successes.iter().map(|(t, s)| ((t - at).unsigned_abs(), *s)).collect();
                nearest.sort_unstable();
                for (_, success) in nearest {
                    if budget == 0 {
                        break;
                    }
                    let pair = ((*failure).clone(), success.clone());
                    if failure_links.contains(&pair) {
                        continue;
                    }
                    budget -= 1;
                    let mut metadata = BTreeMap::new();
                    metadata.insert("relation".into(), Value::from("success_of_same_task"));
                    changes.push(Change {
                        before: None,
                        next: Edge {
                            src: pair.0,
                            dst: pair.1,
                            kind: EdgeKind::Link,
                            weight: 1.0,
                            evidence: 1,
                            stage: STAGE.into(),
                            run_id: run_id.into(),
                            created_at: at.max(info[success].time),
                            active: true,
                            metadata,
                        },
                        kind: "link_expand",
                        reason: "under-connection: this failed episode had no link to a success of the same task".into(),
                    });
                    report.expanded += 1;
                }
            }
        }
    }
    Ok((changes, report))
}

/// Runs credit assignment over the store and commits the changes (edges and edit log) in one
/// atomic commit; nothing is written when nothing changes.
///
/// Streams the store's live node rows (no steps) and live edges shard by shard
/// ([`fluxmem_store::Live`]): what stays in memory is one small entry per node (tenant, task,
/// outcome, time), each semantic node's outcome sum, each failure's link count, and the edges
/// that change, not the node rows or the edges. Reads no steps, vectors or edit log. Commits
/// edges and edits only.
pub fn refine_store(writer: &mut Writer, options: &CreditOptions, run_id: &str, progress: &mut dyn Progress) -> Result<CreditReport> {
    let manifest = writer.manifest().clone();
    let priors: BTreeMap<String, f64> = manifest.progress.get(BASE_RATE_MARKER).and_then(|v| serde_json::from_value(v.clone()).ok()).unwrap_or_default();
    let (changes, mut report, at) = {
        let store = writer.store();
        let mut nodes = Nodes::default();
        // The edit time is the data's: the newest episode, so reruns write the same shards.
        let mut at: Option<i64> = None;
        store.live(&manifest, "nodes")?.nodes(&mut |n| {
            if n.episode().is_some() {
                at = at.max(n.created_at);
            }
            nodes.add(&n);
        })?;
        let at = at.unwrap_or(0);
        let edges = store.live(&manifest, "edges")?;
        progress.start(edges.len());
        let (changes, report) = assign_over(&nodes, &edges, options, run_id, &priors)?;
        progress.advance(edges.len());
        (changes, report, at)
    };
    if changes.is_empty() {
        return Ok(report);
    }
    // In key order, `commit_every` edges a commit. The base rates go with the first: a run
    // interrupted after it resumes with the same priors and the same outcomes, so it finds
    // the edges already written within tolerance and makes the changes that were left.
    let rates = serde_json::to_value(&report.base_rate).expect("rates serialise");
    let mut progress: BTreeMap<String, Value> = [(BASE_RATE_MARKER.to_string(), rates)].into_iter().collect();
    let mut changes = changes.into_iter().peekable();
    while changes.peek().is_some() {
        let mut delta = Graph::default();
        for change in changes.by_ref().take(options.commit_every.max(1)) {
            delta.edits.push(Edit::new(STAGE, run_id, change.kind, Changed::Edge(change.before.as_ref(), Some(&change.next)), &change.reason, at));
            delta.upsert_edge(change.next);
        }
        report.edits += delta.edits.len();
        report.commits += 1;
        let summary = serde_json::to_value(&report).expect("the report serialises");
        writer.commit(&delta, CommitInfo { stage: STAGE.into(), run_id: run_id.into(), summary, progress: std::mem::take(&mut progress) })?;
    }
    Ok(report)
}

/// Edges whose credit is computed: Stage I edges and those credit assignment manages, not the
/// links of the query loop or of failure-success expansion.
fn counts(edge: &Edge) -> bool {
    edge.metadata.get("relation").is_none()
}

fn round6(value: f64) -> f64 {
    (value * 1e6).round() / 1e6
}

