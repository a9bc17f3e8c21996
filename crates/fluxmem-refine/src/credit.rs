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
//! Weights follow all outcomes in the store, so the update is idempotent (a second run over
//! the same store changes nothing) and incremental (new episodes move the credits). Every
//! change is an [`Edit`] in the same commit as the edge it changes.
//!
//! **A night reads what it added.** Each semantic node keeps its credit's sufficient statistics
//! ([`CreditStats`], under [`STATS_KEY`] in its metadata), and the last commit of a complete
//! run leaves a watermark ([`WATERMARK_MARKER`]); the next run reads the edges added since and
//! only the old edges of the nodes whose credit moved out of their edges' stored range (see
//! [`refine_store`]). It commits what a pass over every edge commits.
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

use fluxmem_graph::{Changed, Edge, EdgeKind, Edit, Graph, Node, NodeId, NodeKind};
use fluxmem_store::{CommitInfo, Manifest, Scan, Since, Store, Writer};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::query::STAGE;
// Stage I's progress callbacks serve here too (counted in edges assessed).
use crate::Result;
use fluxmem_connect::Progress;

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
    /// Read every live edge even where the watermark of the last complete run would let the
    /// run read only what was added since (the same changes either way; a check, or a rebuild
    /// of the statistics).
    pub full: bool,
    /// A night whose new (or mixed, see [`fluxmem_store::Manifest::since`]) edge rows are more
    /// than this share of the stored edge rows is read as a full pass, which streams the edges
    /// where a delta pass holds the night's edges decoded. The changes are the same either way.
    pub max_delta_share: f64,
}

impl Default for CreditOptions {
    fn default() -> Self {
        CreditOptions {
            prior: 2.0,
            prune_below: 0.5,
            min_evidence: 3,
            link_failures: true,
            max_failure_links: 3,
            tolerance: 0.05,
            prior_drift: 0.02,
            commit_every: 100_000,
            full: false,
            max_delta_share: 0.5,
        }
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
    /// Edges decided on whose credit moved by no more than the tolerance: not rewritten (in a
    /// delta pass, among the edges it decided on only: see `edges_decided`).
    pub within_tolerance: usize,
    /// Tenants whose base rate was (re-)estimated this run.
    pub base_rate_estimated: Vec<String>,
    /// Edges pruned by this run.
    pub pruned: usize,
    /// Edges re-activated by this run.
    pub reactivated: usize,
    /// Links added from failures to successes of the same task.
    pub expanded: usize,
    /// Edges decided on that join two tenants' nodes (left by an older store): never credited
    /// (in a delta pass, among the edges it decided on only).
    pub cross_tenant: usize,
    /// Cross-tenant edges this run deactivated.
    pub isolated: usize,
    /// Edit records written.
    pub edits: usize,
    /// Commits made (0 when nothing changed).
    pub commits: usize,
    /// The run read only what the commits after the last complete run added (its watermark),
    /// not every edge.
    pub delta: bool,
    /// Edges decided on: every live edge in a full pass; in a delta pass, the night's and the
    /// ground edges of the `whole_nodes`.
    pub edges_decided: usize,
    /// Nodes whose every ground edge a delta pass read (their credit left the stored range of
    /// their edges' credits, crossed the prune line, or a counted edge was rewritten).
    pub whole_nodes: usize,
    /// Semantic nodes whose credit statistics were written.
    pub stats_written: usize,
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
    /// A semantic node (the source of ground edges, and the holder of [`CreditStats`]).
    semantic: bool,
    /// The task (interned key) of an episode with an outcome.
    task: u32,
    time: i64,
}

/// The nodes as credit assignment sees them, built one node row at a time.
#[derive(Default)]
struct Nodes {
    info: HashMap<NodeId, Info, Fast>,
    /// The stored statistics of the semantic nodes that have them ([`STATS_KEY`]).
    stats: HashMap<NodeId, CreditStats, Fast>,
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
        let info = Info {
            tenant,
            outcome,
            episode: n.episode().is_some(),
            semantic: n.kind() == NodeKind::Semantic,
            task,
            time: n.created_at.unwrap_or(0),
        };
        self.info.insert(n.id.clone(), info);
        if info.semantic {
            if let Some(stats) = n
                .metadata
                .get(STATS_KEY)
                .and_then(|v| serde_json::from_value::<CreditStats>(v.clone()).ok())
            {
                self.stats.insert(n.id.clone(), stats);
            }
        }
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
    fn ends(&self, kinds: &[EdgeKind], f: &mut dyn FnMut(&str, &str, EdgeKind, bool))
        -> Result<()>;
    /// Every edge as a [`View`] to `decide` on; the edges it gives a verdict, whole, to `then`.
    fn decide(
        &self,
        decide: &mut dyn FnMut(&View<'_>) -> Option<Verdict>,
        then: &mut dyn FnMut(Edge, Verdict),
    ) -> Result<()>;
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
    Credit {
        credit: f64,
        evidence: usize,
        stage1_weight: f64,
        stage1_evidence: i64,
        why: Why,
        kind: &'static str,
        reason: String,
    },
}

impl Edges for Graph {
    fn ends(
        &self,
        kinds: &[EdgeKind],
        f: &mut dyn FnMut(&str, &str, EdgeKind, bool),
    ) -> Result<()> {
        for e in self
            .edges
            .values()
            .filter(|e| kinds.is_empty() || kinds.contains(&e.kind))
        {
            f(e.src.as_str(), e.dst.as_str(), e.kind, !counts(e));
        }
        Ok(())
    }

    fn decide(
        &self,
        decide: &mut dyn FnMut(&View<'_>) -> Option<Verdict>,
        then: &mut dyn FnMut(Edge, Verdict),
    ) -> Result<()> {
        for e in self.edges.values() {
            let view = View {
                src: e.src.as_str(),
                dst: e.dst.as_str(),
                kind: e.kind,
                weight: e.weight,
                evidence: e.evidence,
                active: e.active,
                meta: CreditMeta::of(&e.metadata),
            };
            if let Some(verdict) = decide(&view) {
                then(e.clone(), verdict);
            }
        }
        Ok(())
    }
}

impl Edges for fluxmem_store::Live<'_> {
    fn ends(
        &self,
        kinds: &[EdgeKind],
        f: &mut dyn FnMut(&str, &str, EdgeKind, bool),
    ) -> Result<()> {
        Ok(self.edge_ends(kinds, f)?)
    }

    fn decide(
        &self,
        decide: &mut dyn FnMut(&View<'_>) -> Option<Verdict>,
        then: &mut dyn FnMut(Edge, Verdict),
    ) -> Result<()> {
        Ok(self.edges_deciding(
            &mut |row| {
                let meta = CreditMeta {
                    relation: row.relation,
                    ..CreditMeta::parse(row.metadata)?
                };
                Ok(decide(&View {
                    src: row.src,
                    dst: row.dst,
                    kind: row.kind,
                    weight: row.weight,
                    evidence: row.evidence,
                    active: row.active,
                    meta,
                }))
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
    sum: Option<(u64, usize)>,
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
    fn info_and_sum(
        &mut self,
        info: &HashMap<NodeId, Info, Fast>,
        behind: &HashMap<NodeId, (u64, usize), Fast>,
        src: &str,
    ) -> (Option<Info>, Option<(u64, usize)>) {
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
    sum: u64,
    n: usize,
}

impl Run {
    /// Makes `src` the current source (ending the run of another) and returns `info[src]`.
    fn enter(
        &mut self,
        src: &str,
        info: &HashMap<NodeId, Info, Fast>,
        behind: &mut HashMap<NodeId, (u64, usize), Fast>,
    ) -> Option<Info> {
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
    fn flush(&mut self, behind: &mut HashMap<NodeId, (u64, usize), Fast>) {
        let Some(src) = self.src.as_deref().filter(|_| self.n > 0) else {
            return;
        };
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

/// Outcomes are summed in fixed point (2^-32), so a node's sum does not depend on the order its
/// edges are read in (key order in memory, shard order from the store, the stored sum plus a
/// night's): the same credits, to the bit, however the store is laid out. 0/1 outcomes are
/// exact; a fractional reward is rounded to the nearest multiple of 2^-32 (an error below
/// 1.2e-10 per outcome). A u64 sum holds 2^32 outcomes of 1 behind one node.
const FIXED: f64 = (1u64 << 32) as f64;

/// The outcome a ground edge (not a Stage II link) from a node `s` to an episode `d` counts
/// towards `s`'s credit, in units of 2^-32: `d`'s outcome, when it has one and the two are of
/// one tenant (a source missing from the store does not make the edge cross). The one rule of
/// the full pass, the night's sums and a whole node's recount.
fn counted(s: Option<&Info>, d: &Info) -> Option<u64> {
    let r = d.outcome?;
    s.is_none_or(|s| s.tenant == d.tenant)
        .then(|| (r * FIXED).round() as u64)
}

/// The metadata key under which a semantic node keeps its credit statistics ([`CreditStats`]).
pub const STATS_KEY: &str = "credit_stats";

/// The progress marker of the last complete credit run: the store version its last commit
/// made and the settings it ran with. The next run reads only what later commits added (and
/// the edges of the nodes whose credit then moves), unless the settings differ, a base rate is
/// re-estimated, or a compaction merged rows from both sides of that version.
pub const WATERMARK_MARKER: &str = "refine.credit_watermark";

/// The sufficient statistics of a semantic node's credit, kept in its metadata under
/// [`STATS_KEY`] and written in the same commit as the edges whose outcomes they count: the
/// outcomes behind the node (`sum` in units of 2^-32, and their number `n`), and the lowest and
/// highest credit its credited ground edges hold as stored (`lo`, `hi`). With them a night
/// adds its new outcomes to the sum and knows, without reading the node's edges, whether any of
/// them moved by more than the tolerance.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct CreditStats {
    /// Sum of the outcomes behind the node, in units of 2^-32.
    pub sum: u64,
    /// Outcomes behind the node.
    pub n: u64,
    /// Lowest credit a credited ground edge of the node holds.
    pub lo: f64,
    /// Highest credit a credited ground edge of the node holds.
    pub hi: f64,
}

/// [`WATERMARK_MARKER`]'s value.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
struct Watermark {
    version: u64,
    settings: String,
}

/// The settings a stored credit depends on: a run with others reads everything.
fn settings(options: &CreditOptions) -> String {
    format!(
        "credit-v2 fixed=2^-32 prior={} prune_below={} min_evidence={} tolerance={} link_failures={} max_failure_links={}",
        options.prior, options.prune_below, options.min_evidence, options.tolerance, options.link_failures, options.max_failure_links
    )
}

/// The new state of every edge the outcomes speak to, and the links to add; the graph is not
/// changed. Returns (changed edges with their edit kind and reason, report counts).
pub fn assign(
    graph: &Graph,
    options: &CreditOptions,
    run_id: &str,
) -> (Vec<(Edge, &'static str, String)>, CreditReport) {
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
    let mut report = CreditReport::default();
    let (outcomes, base) = rates(&nodes, options, priors, &mut report);
    let assigned = assign_over(&nodes, &outcomes, &base, graph, options, run_id, report)
        .expect("an in-memory graph reads without error");
    (
        assigned
            .changes
            .into_iter()
            .map(|c| (c.next, c.kind, c.reason))
            .collect(),
        assigned.report,
    )
}

/// The episodes with an outcome (in id order) and each tenant's base rate: its prior while the
/// current rate stays within `prior_drift` of it, else the current rate (named in
/// `base_rate_estimated`). Fills the report's counts of episodes and rates.
#[allow(clippy::type_complexity)] // (outcomes by episode, priors by task), both documented above
fn rates<'n>(
    nodes: &'n Nodes,
    options: &CreditOptions,
    priors: &BTreeMap<String, f64>,
    report: &mut CreditReport,
) -> (Vec<(&'n NodeId, f64)>, HashMap<u32, f64, Fast>) {
    let info = &nodes.info;
    let mut outcomes: Vec<(&NodeId, f64)> = info
        .iter()
        .filter_map(|(id, i)| i.outcome.map(|r| (id, r)))
        .collect();
    outcomes.sort_by(|a, b| a.0.cmp(b.0));
    report.episodes = info.values().filter(|i| i.episode).count();
    report.with_outcome = outcomes.len();
    let mut per_tenant: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
    for (id, r) in &outcomes {
        let entry = per_tenant
            .entry(nodes.tenants[info[*id].tenant as usize].as_str())
            .or_default();
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
    (outcomes, base)
}

/// What a credit pass computed: the changes (edges in key order, then the new links in task
/// order), the report, the outcomes behind each node, and the credits each node's credited
/// ground edges hold after the changes (lowest, highest) for the edges the pass decided on.
struct Assigned {
    changes: Vec<Change>,
    report: CreditReport,
    behind: HashMap<NodeId, (u64, usize), Fast>,
    ranges: HashMap<NodeId, (f64, f64), Fast>,
}

/// The edge-by-edge rule, over the outcomes `behind` each node and the tenants' base rates.
struct Decider<'a> {
    info: &'a HashMap<NodeId, Info, Fast>,
    behind: &'a HashMap<NodeId, (u64, usize), Fast>,
    base: &'a HashMap<u32, f64, Fast>,
    options: &'a CreditOptions,
    memo: SrcMemo,
    /// Per source, the lowest and highest credit its credited ground edges hold after the
    /// decisions (written or kept).
    ranges: HashMap<NodeId, (f64, f64), Fast>,
}

impl<'a> Decider<'a> {
    /// A decider over these outcomes and base rates, with no decision made yet.
    fn new(
        info: &'a HashMap<NodeId, Info, Fast>,
        behind: &'a HashMap<NodeId, (u64, usize), Fast>,
        base: &'a HashMap<u32, f64, Fast>,
        options: &'a CreditOptions,
    ) -> Self {
        Decider {
            info,
            behind,
            base,
            options,
            memo: SrcMemo::default(),
            ranges: HashMap::default(),
        }
    }
}

impl Decider<'_> {
    /// What changes of an edge, decided on a light view of the row (the stored metadata's five
    /// credit keys, no map).
    fn decide(&mut self, view: &View<'_>, report: &mut CreditReport) -> Option<Verdict> {
        let options = self.options;
        let (src_info, src_behind) = self.memo.info_and_sum(self.info, self.behind, view.src);
        let (src_info, dst_info) = (src_info.as_ref(), self.info.get(view.dst));
        let within = match (src_info, dst_info) {
            (Some(s), Some(d)) => s.tenant == d.tenant,
            _ => true,
        };
        if !within {
            report.cross_tenant += 1;
            // Deactivated for good, unless it already is.
            if view.active
                || view.meta.pruned_by.as_ref().and_then(Value::as_str) != Some("isolation")
            {
                report.isolated += 1;
                return Some(Verdict::Isolate);
            }
            return None;
        }
        let dst_outcome = dst_info.and_then(|i| i.outcome);
        let dst_rate = dst_info.and_then(|i| self.base.get(&i.tenant)).copied();
        let (credit, evidence) = match view.kind {
            EdgeKind::Ground if !view.meta.relation => match (src_behind, dst_rate) {
                (Some((sum, n)), Some(p)) if dst_outcome.is_some() => {
                    (credit_of(sum, n, p, options.prior), n)
                }
                _ => return None,
            },
            EdgeKind::Link if !view.meta.relation && src_info.is_some_and(|i| i.episode) => {
                match (dst_outcome, dst_rate) {
                    (Some(r), Some(p)) => {
                        (((r + options.prior * p) / (1.0 + options.prior)) / p, 1)
                    }
                    _ => return None,
                }
            }
            _ => return None,
        };
        let meta = &view.meta;
        let stage1_weight = meta
            .stage1_weight
            .as_ref()
            .and_then(Value::as_f64)
            .unwrap_or(view.weight as f64);
        let stage1_evidence = meta
            .stage1_evidence
            .as_ref()
            .and_then(Value::as_i64)
            .unwrap_or(view.evidence);
        let pruned_by_credit = meta.pruned_by.as_ref().and_then(Value::as_str) == Some("credit");
        let (why, active) = if prunes(credit, evidence, options) {
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
        let stored = meta.credit.as_ref().and_then(Value::as_f64);
        let moved = match stored {
            Some(stored) => (stored - credit).abs() > options.tolerance,
            None => true,
        };
        let writes = !same && (state_changed || moved);
        if view.kind == EdgeKind::Ground {
            // The credit this edge holds after the run: the new one when written, else the stored.
            let holds = if writes {
                round6(credit)
            } else {
                stored.unwrap_or(round6(credit))
            };
            match self.ranges.get_mut(view.src) {
                Some(range) => *range = (range.0.min(holds), range.1.max(holds)),
                None => {
                    self.ranges
                        .insert(NodeId(view.src.to_string()), (holds, holds));
                }
            }
        }
        if !writes {
            if !same {
                report.within_tolerance += 1;
            }
            return None;
        }
        let (kind, reason) = match why {
            Why::Prune => (
                "link_prune",
                format!(
                    "credit {credit:.3} < {} over {evidence} outcomes: present in failures",
                    options.prune_below
                ),
            ),
            Why::Recovered => (
                "credit",
                format!("credit {credit:.3} recovered over {evidence} outcomes"),
            ),
            Why::Credit => (
                "credit",
                format!(
                    "credit {credit:.3} over {evidence} outcomes (base rate {:.3})",
                    dst_rate.unwrap_or_default()
                ),
            ),
        };
        if kind == "credit" {
            report.reweighted += 1;
        }
        Some(Verdict::Credit {
            credit,
            evidence,
            stage1_weight,
            stage1_evidence,
            why,
            kind,
            reason,
        })
    }
}

/// The smoothed lift of the outcomes behind a node (`sum` in units of 2^-32 over `n`) at base
/// rate `p`.
fn credit_of(sum: u64, n: usize, p: f64, prior: f64) -> f64 {
    let sum = sum as f64 / FIXED;
    ((sum + prior * p) / (n as f64 + prior)) / p
}

/// Link Prune's test: a credit below the line with enough outcomes behind it.
fn prunes(credit: f64, evidence: usize, options: &CreditOptions) -> bool {
    credit < options.prune_below && evidence >= options.min_evidence
}

/// The row a verdict writes in place of `edge`.
fn change(edge: Edge, verdict: Verdict, run_id: &str) -> Change {
    let mut next = edge.clone();
    next.stage = STAGE.into();
    next.run_id = run_id.into();
    match verdict {
        Verdict::Isolate => {
            next.active = false;
            next.metadata.insert("pruned_by".into(), "isolation".into());
            Change {
                before: Some(edge),
                next,
                kind: "link_prune",
                reason: "cross-tenant edge (isolation)".into(),
            }
        }
        Verdict::Credit {
            credit,
            evidence,
            stage1_weight,
            stage1_evidence,
            why,
            kind,
            reason,
        } => {
            next.metadata
                .insert("stage1_weight".into(), stage1_weight.into());
            next.metadata
                .insert("stage1_evidence".into(), stage1_evidence.into());
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
            Change {
                before: Some(edge),
                next,
                kind,
                reason,
            }
        }
    }
}

/// The light view of a whole edge.
fn view_of(e: &Edge) -> View<'_> {
    View {
        src: e.src.as_str(),
        dst: e.dst.as_str(),
        kind: e.kind,
        weight: e.weight,
        evidence: e.evidence,
        active: e.active,
        meta: CreditMeta::of(&e.metadata),
    }
}

/// Whether a link from `src` to `dst` joins a failure to a success of its task (it counts
/// towards the failure's cap of links).
fn joins_failure_to_success(info: &HashMap<NodeId, Info, Fast>, src: &str, dst: &str) -> bool {
    match (info.get(src), info.get(dst)) {
        (Some(s), Some(d)) => {
            matches!((s.outcome, d.outcome), (Some(a), Some(b)) if a < 0.5 && b >= 0.5 && s.task == d.task)
        }
        _ => false,
    }
}

/// The rule of [`assign_with_priors`] over any [`Edges`]: two passes, the first sums the
/// outcomes behind each semantic node and counts each failure's links, the second decides edge
/// by edge. The changes come back in edge key order, then the new links in task order, as one
/// in-memory pass over a `Graph` gives them.
fn assign_over(
    nodes: &Nodes,
    outcomes: &[(&NodeId, f64)],
    base: &HashMap<u32, f64, Fast>,
    edges: &dyn Edges,
    options: &CreditOptions,
    run_id: &str,
    mut report: CreditReport,
) -> Result<Assigned> {
    let info = &nodes.info;
    // Pass 1. Outcomes behind each semantic node, through its ground edges (stage-1 or refine,
    // active or pruned by credit: the credit is about the node, not about which edges are active
    // now). Only edges inside one tenant count: another tenant's outcomes never move a credit.
    // And the links each failure already has to successes of its task: they count towards the
    // cap, so a later night adds none once a failure has its links.
    // Read as ends only (no edge decoded); ids are copied only for the entries they create.
    // Edges come in key order within a shard, so runs of one source: its lookups are made once
    // a run, and its outcome sum is added up over the run, then stored (`Run`).
    let mut behind: HashMap<NodeId, (u64, usize), Fast> = HashMap::default();
    let mut failure_links: HashSet<(NodeId, NodeId), Fast> = HashSet::default();
    let mut run = Run::default();
    edges.ends(
        &[EdgeKind::Ground, EdgeKind::Link],
        &mut |src, dst, kind, relation| match kind {
            EdgeKind::Ground if !relation => {
                let Some(d) = info.get(dst).filter(|d| d.outcome.is_some()) else {
                    return;
                };
                if let Some(units) = counted(run.enter(src, info, &mut behind).as_ref(), d) {
                    run.sum += units;
                    run.n += 1;
                }
            }
            EdgeKind::Link if options.link_failures && joins_failure_to_success(info, src, dst) => {
                failure_links.insert((NodeId(src.to_string()), NodeId(dst.to_string())));
            }
            _ => {}
        },
    )?;
    run.flush(&mut behind);

    // Pass 2: edge by edge, what changes; only the rows that change are decoded whole.
    let mut changes = Vec::new();
    let mut decider = Decider::new(info, &behind, base, options);
    edges.decide(
        &mut |view| decider.decide(view, &mut report),
        &mut |edge, verdict| changes.push(change(edge, verdict, run_id)),
    )?;
    let ranges = std::mem::take(&mut decider.ranges);
    // Key order, whatever order the edges were read in.
    changes.sort_by(|a, b| {
        (&a.next.src, &a.next.dst, a.next.kind).cmp(&(&b.next.src, &b.next.dst, b.next.kind))
    });
    expand(
        nodes,
        outcomes,
        &failure_links,
        options,
        run_id,
        None,
        &mut changes,
        &mut report,
    );
    Ok(Assigned {
        changes,
        report,
        behind,
        ranges,
    })
}

/// Link Expand over failures: each failure (of those in `only`, when given) gets links to the
/// successes of its task nearest in time (ties by id), up to `max_failure_links` counting the
/// links in `failure_links` it already has. Appends the new links to `changes` in task order.
#[allow(clippy::too_many_arguments)]
fn expand(
    nodes: &Nodes,
    outcomes: &[(&NodeId, f64)],
    failure_links: &HashSet<(NodeId, NodeId), Fast>,
    options: &CreditOptions,
    run_id: &str,
    only: Option<&HashSet<&NodeId, Fast>>,
    changes: &mut Vec<Change>,
    report: &mut CreditReport,
) {
    if !options.link_failures {
        return;
    }
    let info = &nodes.info;
    // Each failure's links to successes of its task (one per edge key).
    let mut linked: HashMap<&NodeId, usize, Fast> = HashMap::default();
    for (failure, _) in failure_links {
        *linked.entry(failure).or_default() += 1;
    }
    // Per task: its successes (with their times) and failures, in id order.
    #[allow(clippy::type_complexity)] // task -> (successes with times, failures)
    let mut tasks: BTreeMap<&str, (Vec<(i64, &NodeId)>, Vec<&NodeId>)> = BTreeMap::new();
    for (id, r) in outcomes {
        let i = &info[*id];
        let entry = tasks
            .entry(nodes.tasks[i.task as usize].as_str())
            .or_default();
        if *r >= 0.5 {
            entry.0.push((i.time, id));
        } else if only.is_none_or(|only| only.contains(id)) {
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
            let mut nearest: Vec<(u64, &NodeId)> = successes
                .iter()
                .map(|(t, s)| ((t - at).unsigned_abs(), *s))
                .collect();
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

/// The nodes a delta pass touched, beyond the changes: the sources whose statistics it
/// recomputes, and of those, the ones whose every edge it decided on.
struct Touched {
    sources: BTreeSet<NodeId>,
    whole: BTreeSet<NodeId>,
}

/// Credit assignment over what the commits after the watermark added (`since`), with the
/// statistics stored on the semantic nodes; equal, change for change, to a full pass over the
/// store (`assign_over`), and `None` when the store does not let it be (a ground edge from a
/// node that is missing or not semantic, which holds no statistics).
///
/// - The night's edges are read whole (the live edge rows of `since.added` and `since.mixed`).
///   A ground edge whose outcomes were never counted (no `outcomes` in its metadata) adds its
///   episode's outcome to its node's stored sum.
/// - A node whose new credit leaves the stored range of its edges' credits by more than the
///   tolerance, or crosses the prune line, or that has a counted edge among those read, or
///   that has no statistics and is not new, has all its ground edges read (a filtered scan on
///   `src`), its outcomes counted from them, and every one decided on. Every other node's old
///   edges keep their credit, as a full pass would keep them.
/// - The night's edges are decided on with the full rule.
/// - Link Expand considers the night's failures, and the older failures of tasks that had
///   fewer than `max_failure_links` successes and gained one: every other failure has its
///   links already. The links of those older failures, and of failures not new for certain
///   (see `new_nodes`), are read by a filtered scan; a new failure's are among those read.
#[allow(clippy::too_many_arguments)]
fn assign_delta(
    store: &Store,
    manifest: &Manifest,
    since: &Since,
    nodes: &Nodes,
    outcomes: &[(&NodeId, f64)],
    base: &HashMap<u32, f64, Fast>,
    options: &CreditOptions,
    run_id: &str,
    mut report: CreditReport,
    progress: &mut dyn Progress,
) -> Result<Option<(Assigned, Touched)>> {
    let info = &nodes.info;
    let night = night_nodes(store, manifest, since)?;
    let mut edges = night_edges(store, since)?;
    let Some(mut night_credit) = contributions(&edges, nodes, options) else {
        return Ok(None);
    };
    night_credit.find_moved(nodes, &night.new, base, options);
    night_credit.read_whole(store, manifest, info, &mut edges)?;
    progress.start(edges.len() as u64);
    let only = if options.link_failures {
        failures_to_expand(
            store,
            manifest,
            outcomes,
            &night,
            info,
            options,
            &mut night_credit,
        )?
    } else {
        HashSet::default()
    };
    let NightCredit {
        behind,
        added,
        whole,
        failure_links,
    } = night_credit;

    // The night's edges and the whole nodes' edges, decided in key order.
    let mut changes = Vec::new();
    let mut decider = Decider::new(info, &behind, base, options);
    let decided = edges.len() as u64;
    for e in edges.into_values() {
        if let Some(verdict) = decider.decide(&view_of(&e), &mut report) {
            changes.push(change(e, verdict, run_id));
        }
    }
    progress.advance(decided);
    let mut ranges = std::mem::take(&mut decider.ranges);
    // A node decided on only for its new edges keeps its old edges' credits too.
    for src in added.difference(&whole) {
        if let (Some(old), Some(range)) = (
            nodes.stats.get(src).filter(|s| s.n > 0),
            ranges.get_mut(src),
        ) {
            *range = (range.0.min(old.lo), range.1.max(old.hi));
        }
    }
    expand(
        nodes,
        outcomes,
        &failure_links,
        options,
        run_id,
        Some(&only),
        &mut changes,
        &mut report,
    );
    report.delta = true;
    report.edges_decided = decided as usize;
    let sources = added.union(&whole).cloned().collect();
    Ok(Some((
        Assigned {
            changes,
            report,
            behind,
            ranges,
        },
        Touched { sources, whole },
    )))
}

/// The nodes of the commits since the watermark.
struct NightNodes {
    /// New for certain: those ingest added since (ingest writes only ids the store does not
    /// hold).
    new: HashSet<NodeId, Fast>,
    /// The rows of other stages' commits since, and of shards that may mix old and new rows
    /// (a compaction merged them): they may be rewrites of old nodes. Link Expand reads their
    /// links from the store, and a fact among them without statistics is counted whole.
    uncertain: HashSet<NodeId, Fast>,
}

fn night_nodes(store: &Store, manifest: &Manifest, since: &Since) -> Result<NightNodes> {
    let ingests: BTreeSet<u64> = manifest
        .commits
        .iter()
        .filter(|c| c.stage == "ingest")
        .map(|c| c.version)
        .collect();
    let (mut ingested, mut other) = (since.added.clone(), since.mixed.clone());
    ingested
        .shards
        .retain(|s| s.table == "nodes" && ingests.contains(&s.commit));
    other.shards.retain(|s| s.table == "nodes");
    other.shards.extend(
        since
            .added
            .shards
            .iter()
            .filter(|s| s.table == "nodes" && !ingests.contains(&s.commit))
            .cloned(),
    );
    let mut new: HashSet<NodeId, Fast> = HashSet::default();
    store.live(&ingested, "nodes")?.ids(&mut |id| {
        new.insert(NodeId(id.to_string()));
    })?;
    let mut uncertain: HashSet<NodeId, Fast> = HashSet::default();
    store.live(&other, "nodes")?.ids(&mut |id| {
        if !new.contains(id) {
            uncertain.insert(NodeId(id.to_string()));
        }
    })?;
    Ok(NightNodes { new, uncertain })
}

/// The edges added since, and those of mixed shards (reading an old edge again changes
/// nothing: a counted one has its node read whole, the others decide as before).
type EdgeMap = BTreeMap<(NodeId, NodeId, EdgeKind), Edge>;

fn night_edges(store: &Store, since: &Since) -> Result<EdgeMap> {
    let mut read = since.added.clone();
    read.shards.extend(
        since
            .mixed
            .shards
            .iter()
            .filter(|s| s.table == "edges")
            .cloned(),
    );
    let mut edges = EdgeMap::new();
    store.live(&read, "edges")?.edges(&[], &mut |e| {
        edges.insert((e.src.clone(), e.dst.clone(), e.kind), e);
    })?;
    Ok(edges)
}

/// What the night's edges add to the stored statistics.
struct NightCredit {
    /// Each source's outcome sum and count: the stored ones plus the night's contributions
    /// (the whole nodes' counted again from all their edges).
    behind: HashMap<NodeId, (u64, usize), Fast>,
    /// The sources of the night's ground edges that add to their node's sum.
    added: BTreeSet<NodeId>,
    /// The sources whose every ground edge is read and decided on.
    whole: BTreeSet<NodeId>,
    /// The failure -> success links Link Expand considers.
    failure_links: HashSet<(NodeId, NodeId), Fast>,
}

/// The night's contributions, its rewritten counted edges, and its failure links; `None` when
/// a ground edge comes from a node not in the store or not semantic (it holds no statistics:
/// the full pass).
fn contributions(edges: &EdgeMap, nodes: &Nodes, options: &CreditOptions) -> Option<NightCredit> {
    let info = &nodes.info;
    let mut credit = NightCredit {
        behind: nodes
            .stats
            .iter()
            .map(|(id, s)| (id.clone(), (s.sum, s.n as usize)))
            .collect(),
        added: BTreeSet::new(),
        whole: BTreeSet::new(),
        failure_links: HashSet::default(),
    };
    for e in edges.values() {
        match e.kind {
            EdgeKind::Ground if counts(e) => {
                let (Some(d), s) = (info.get(&e.dst), info.get(&e.src)) else {
                    continue;
                };
                let Some(units) = counted(s, d) else { continue };
                if !s.is_some_and(|s| s.semantic) {
                    return None;
                }
                if e.metadata.contains_key("outcomes") {
                    // Counted before and read again: its node is counted again, whole.
                    credit.whole.insert(e.src.clone());
                } else {
                    let entry = credit.behind.entry(e.src.clone()).or_default();
                    entry.0 += units;
                    entry.1 += 1;
                    credit.added.insert(e.src.clone());
                }
            }
            EdgeKind::Link
                if options.link_failures
                    && joins_failure_to_success(info, e.src.as_str(), e.dst.as_str()) =>
            {
                credit.failure_links.insert((e.src.clone(), e.dst.clone()));
            }
            _ => {}
        }
    }
    Some(credit)
}

impl NightCredit {
    /// Marks whole the nodes whose old edges may change: a node without statistics that is not
    /// new (it may have counted edges), and one whose credit leaves the stored range or
    /// crosses the prune line.
    fn find_moved(
        &mut self,
        nodes: &Nodes,
        new: &HashSet<NodeId, Fast>,
        base: &HashMap<u32, f64, Fast>,
        options: &CreditOptions,
    ) {
        let info = &nodes.info;
        for src in &self.added {
            if !nodes.stats.contains_key(src) && !new.contains(src) {
                self.whole.insert(src.clone());
            }
        }
        for src in &self.added {
            let Some(old) = nodes.stats.get(src).filter(|s| s.n > 0) else {
                continue;
            };
            let Some(p) = info.get(src).and_then(|i| base.get(&i.tenant)).copied() else {
                continue;
            };
            let (sum, n) = self.behind[src];
            let now = credit_of(sum, n, p, options.prior);
            let was = credit_of(old.sum, old.n as usize, p, options.prior);
            if prunes(now, n, options) != prunes(was, old.n as usize, options)
                || (old.lo - now).abs() > options.tolerance
                || (old.hi - now).abs() > options.tolerance
            {
                self.whole.insert(src.clone());
            }
        }
    }

    /// Every ground edge of the whole nodes joins `edges`, and their outcomes are counted
    /// from those edges (the rule of the full pass), not from the stored sums.
    fn read_whole(
        &mut self,
        store: &Store,
        manifest: &Manifest,
        info: &HashMap<NodeId, Info, Fast>,
        edges: &mut EdgeMap,
    ) -> Result<()> {
        if self.whole.is_empty() {
            return Ok(());
        }
        let scan = Scan {
            edges: true,
            edges_from: Some(self.whole.clone()),
            edge_kinds: vec![EdgeKind::Ground],
            ..Default::default()
        };
        for src in &self.whole {
            self.behind.remove(src);
        }
        for (key, e) in store.scan_at(manifest, &scan)?.edges {
            if let Some(units) = info
                .get(&e.dst)
                .filter(|_| counts(&e))
                .and_then(|d| counted(info.get(&e.src), d))
            {
                let entry = self.behind.entry(e.src.clone()).or_default();
                entry.0 += units;
                entry.1 += 1;
            }
            edges.insert((key.src, key.dst, key.kind), e);
        }
        Ok(())
    }
}

/// Link Expand's failures: the night's, and those of tasks with fewer than
/// `max_failure_links` successes before that gained one. The links of those older failures,
/// and of failures not new for certain, are read by a filtered scan and join `failure_links`;
/// a new failure's are among the night's edges.
fn failures_to_expand<'s>(
    store: &Store,
    manifest: &Manifest,
    outcomes: &'s [(&NodeId, f64)],
    night: &NightNodes,
    info: &HashMap<NodeId, Info, Fast>,
    options: &CreditOptions,
    credit: &mut NightCredit,
) -> Result<HashSet<&'s NodeId, Fast>> {
    let mut only: HashSet<&NodeId, Fast> = HashSet::default();
    let mut tasks: HashMap<u32, (usize, bool, Vec<&NodeId>), Fast> = HashMap::default();
    let mut older: BTreeSet<NodeId> = BTreeSet::new();
    for (id, r) in outcomes {
        let new = night.new.contains(*id);
        let maybe = night.uncertain.contains(*id);
        let entry = tasks.entry(info[*id].task).or_default();
        if *r >= 0.5 {
            // A success that may be new counts as gained, not as one the task had.
            if new || maybe {
                entry.1 = true;
            } else {
                entry.0 += 1;
            }
        } else if new {
            only.insert(id);
        } else if maybe {
            only.insert(id);
            older.insert((*id).clone());
        } else {
            entry.2.push(id);
        }
    }
    for (old_successes, gained, failures) in tasks.values() {
        if *gained && *old_successes < options.max_failure_links {
            older.extend(failures.iter().map(|id| (*id).clone()));
            only.extend(failures.iter().copied());
        }
    }
    if !older.is_empty() {
        let scan = Scan {
            edges: true,
            edges_from: Some(older),
            edge_kinds: vec![EdgeKind::Link],
            ..Default::default()
        };
        for (key, _) in store.scan_at(manifest, &scan)?.edges {
            if joins_failure_to_success(info, key.src.as_str(), key.dst.as_str()) {
                credit.failure_links.insert((key.src, key.dst));
            }
        }
    }
    Ok(only)
}

/// Runs credit assignment over the store and commits the changes (edges, their edit records,
/// and the statistics of the semantic nodes whose outcomes moved).
///
/// After a complete run, the next reads only what later commits added ([`assign_delta`]):
/// the node rows are streamed (one small entry per node: tenant, task, outcome, time, and a
/// semantic node's [`CreditStats`]), the night's edges read whole, and old edges only for the
/// nodes whose credit moved. Without a watermark, with other settings, when a tenant's base
/// rate is re-estimated, or when a compaction merged old and new rows into one shard, it reads
/// every live edge twice ([`fluxmem_store::Live`]: ends, then decisions) and keeps only the
/// edges it changes.
///
/// Commits hold `commit_every` changed edges or more: a node's ground edges and its statistics
/// always go in one commit, so an interrupted run leaves every node's statistics equal to the
/// outcomes its stored edges count, and the next run resumes from them.
pub fn refine_store(
    writer: &mut Writer,
    options: &CreditOptions,
    run_id: &str,
    progress: &mut dyn Progress,
) -> Result<CreditReport> {
    let manifest = writer.manifest().clone();
    let priors: BTreeMap<String, f64> = manifest
        .progress
        .get(BASE_RATE_MARKER)
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default();
    let watermark: Option<Watermark> = manifest
        .progress
        .get(WATERMARK_MARKER)
        .and_then(|v| serde_json::from_value(v.clone()).ok());
    let settings = settings(options);
    let night = Pass {
        store: writer.store(),
        manifest: &manifest,
        options,
        run_id,
    };
    let (nodes, at) = night.read_nodes()?;
    let (assigned, touched) =
        night.assign(&nodes, &priors, watermark.as_ref(), &settings, progress)?;
    let Assigned {
        changes,
        mut report,
        behind,
        ranges,
    } = assigned;
    let stats = changed_stats(&nodes, touched.as_ref(), &behind, &ranges);
    // The changed edges' shards name their tenants.
    let ends: Vec<(&NodeId, &str)> = changes
        .iter()
        .flat_map(|c| [&c.next.src, &c.next.dst])
        .filter_map(|id| {
            Some((
                id,
                nodes.tenants[nodes.info.get(id)?.tenant as usize].as_str(),
            ))
        })
        .collect();
    writer.know_tenants(ends);
    drop(nodes);
    let rows = stats_rows(writer.store(), &manifest, &stats)?;
    report.stats_written = rows.len();
    report.whole_nodes = touched.as_ref().map_or(0, |t| t.whole.len());
    if changes.is_empty() && rows.is_empty() {
        return Ok(report);
    }
    let commits = Commits {
        run_id,
        settings: &settings,
        at,
        full: touched.is_none(),
    };
    commits.write(writer, changes, rows, options.commit_every, report)
}

/// One credit assignment pass over a store at one manifest.
struct Pass<'a> {
    store: &'a Store,
    manifest: &'a Manifest,
    options: &'a CreditOptions,
    run_id: &'a str,
}

impl Pass<'_> {
    /// One stream of the live node rows, and the edit time: the data's, the newest episode's,
    /// so reruns write the same shards.
    fn read_nodes(&self) -> Result<(Nodes, i64)> {
        let mut nodes = Nodes::default();
        let mut at: Option<i64> = None;
        self.store.live(self.manifest, "nodes")?.nodes(&mut |n| {
            if n.episode().is_some() {
                at = at.max(n.created_at);
            }
            nodes.add(&n);
        })?;
        Ok((nodes, at.unwrap_or(0)))
    }

    /// The changes: from a delta pass over what came after the watermark where it holds for
    /// these settings and the night is small enough, else from a full pass (which streams the
    /// edges; `Touched` is then `None`).
    fn assign(
        &self,
        nodes: &Nodes,
        priors: &BTreeMap<String, f64>,
        watermark: Option<&Watermark>,
        settings: &str,
        progress: &mut dyn Progress,
    ) -> Result<(Assigned, Option<Touched>)> {
        let (store, manifest, options) = (self.store, self.manifest, self.options);
        let mut report = CreditReport::default();
        let (outcomes, base) = rates(nodes, options, priors, &mut report);
        // A night that added more than `max_delta_share` of the stored edge rows is read as a
        // full pass: it streams the edges, where a delta pass holds the night's edges decoded.
        let edge_rows = |m: &Manifest| {
            m.shards
                .iter()
                .filter(|s| s.table == "edges")
                .map(|s| s.rows)
                .sum::<u64>() as f64
        };
        let since = watermark
            .filter(|w| {
                !options.full && w.settings == settings && report.base_rate_estimated.is_empty()
            })
            .map(|w| manifest.since(w.version, &["nodes", "edges"]))
            .filter(|since| {
                edge_rows(&since.added) + edge_rows(&since.mixed)
                    <= options.max_delta_share * edge_rows(manifest)
            });
        if let Some(since) = &since {
            let delta = assign_delta(
                store,
                manifest,
                since,
                nodes,
                &outcomes,
                &base,
                options,
                self.run_id,
                report.clone(),
                progress,
            )?;
            if let Some((assigned, touched)) = delta {
                return Ok((assigned, Some(touched)));
            }
        }
        let edges = store.live(manifest, "edges")?;
        progress.start(edges.len());
        report.edges_decided = edges.len() as usize;
        let assigned = assign_over(
            nodes,
            &outcomes,
            &base,
            &edges,
            options,
            self.run_id,
            report,
        )?;
        progress.advance(edges.len());
        Ok((assigned, None))
    }
}

/// The statistics that change: every node's after a full pass, the touched ones' after a
/// delta.
fn changed_stats(
    nodes: &Nodes,
    touched: Option<&Touched>,
    behind: &HashMap<NodeId, (u64, usize), Fast>,
    ranges: &HashMap<NodeId, (f64, f64), Fast>,
) -> BTreeMap<NodeId, CreditStats> {
    let candidates: Vec<&NodeId> = match touched {
        Some(t) => t.sources.iter().collect(),
        None => behind.keys().collect(),
    };
    let mut stats: BTreeMap<NodeId, CreditStats> = BTreeMap::new();
    for src in candidates {
        let (Some(&(sum, n)), Some(&(lo, hi))) = (behind.get(src), ranges.get(src)) else {
            continue;
        };
        if n == 0 {
            continue;
        }
        let next = CreditStats {
            sum,
            n: n as u64,
            lo,
            hi,
        };
        if nodes.stats.get(src) != Some(&next) {
            stats.insert(src.clone(), next);
        }
    }
    stats
}

/// The semantic nodes whose statistics change, read (a filtered scan) and given them.
fn stats_rows(
    store: &Store,
    manifest: &Manifest,
    stats: &BTreeMap<NodeId, CreditStats>,
) -> Result<BTreeMap<NodeId, Node>> {
    let mut rows: BTreeMap<NodeId, Node> = BTreeMap::new();
    if stats.is_empty() {
        return Ok(rows);
    }
    let scan = Scan {
        nodes: true,
        nodes_of: Some(stats.keys().cloned().collect()),
        node_kinds: vec![NodeKind::Semantic],
        ..Default::default()
    };
    for (id, mut node) in store.scan_at(manifest, &scan)?.nodes {
        if let Some(next) = stats.get(&id) {
            node.metadata.insert(
                STATS_KEY.into(),
                serde_json::to_value(next).expect("statistics serialise"),
            );
            rows.insert(id, node);
        }
    }
    Ok(rows)
}

/// How a pass's changes are committed.
struct Commits<'a> {
    run_id: &'a str,
    settings: &'a str,
    /// The edit time.
    at: i64,
    /// A full pass (it clears the watermark first).
    full: bool,
}

impl Commits<'_> {
    /// Commits the changes in key order, `commit_every` edges a commit or more: a commit ends
    /// only between two sources, and a node's statistics go with its edges. The base rates go
    /// with the first commit (a run interrupted after it resumes with the same priors and the
    /// same outcomes, so it finds the edges already written within tolerance and makes the
    /// changes that were left); the watermark with the last. A full pass clears the watermark
    /// first: until it completes, the statistics of the nodes it has not reached are not to be
    /// trusted.
    fn write(
        &self,
        writer: &mut Writer,
        changes: Vec<Change>,
        mut rows: BTreeMap<NodeId, Node>,
        commit_every: usize,
        mut report: CreditReport,
    ) -> Result<CreditReport> {
        let starts = commit_starts(&changes, commit_every);
        let count = starts.len();
        let rates = serde_json::to_value(&report.base_rate).expect("rates serialise");
        let mut changes = changes.into_iter();
        for index in 0..count {
            let len = starts.get(index + 1).copied().unwrap_or(usize::MAX) - starts[index];
            let mut delta = Graph::default();
            for change in changes.by_ref().take(len) {
                if let Some(node) = rows.remove(&change.next.src) {
                    delta.upsert_node(node);
                }
                delta.edits.push(Edit::new(
                    STAGE,
                    self.run_id,
                    change.kind,
                    Changed::Edge(change.before.as_ref(), Some(&change.next)),
                    &change.reason,
                    self.at,
                ));
                delta.upsert_edge(change.next);
            }
            let mut progress: BTreeMap<String, Value> = BTreeMap::new();
            if index == 0 {
                progress.insert(BASE_RATE_MARKER.to_string(), rates.clone());
                if self.full && count > 1 {
                    progress.insert(WATERMARK_MARKER.to_string(), Value::Null);
                }
            }
            if index + 1 == count {
                // Statistics of nodes with no changed edge (a full pass filling them in) go
                // with the last.
                for (_, node) in std::mem::take(&mut rows) {
                    delta.upsert_node(node);
                }
                let mark = Watermark {
                    version: writer.manifest().version + 1,
                    settings: self.settings.to_string(),
                };
                progress.insert(
                    WATERMARK_MARKER.to_string(),
                    serde_json::to_value(mark).expect("the watermark serialises"),
                );
            }
            report.edits += delta.edits.len();
            report.commits += 1;
            let summary = serde_json::to_value(&report).expect("the report serialises");
            writer.commit(
                &delta,
                CommitInfo {
                    stage: STAGE.into(),
                    run_id: self.run_id.into(),
                    summary,
                    progress,
                },
            )?;
        }
        Ok(report)
    }
}

/// Where each commit starts: after `commit_every` edges, at the next change of source.
fn commit_starts(changes: &[Change], commit_every: usize) -> Vec<usize> {
    let mut starts: Vec<usize> = vec![0];
    for i in 1..changes.len() {
        if i - starts[starts.len() - 1] >= commit_every.max(1)
            && changes[i].next.src != changes[i - 1].next.src
        {
            starts.push(i);
        }
    }
    starts
}

/// Edges whose credit is computed: Stage I edges and those credit assignment manages, not the
/// links of the query loop or of failure-success expansion.
fn counts(edge: &Edge) -> bool {
    !edge.metadata.contains_key("relation")
}

fn round6(value: f64) -> f64 {
    (value * 1e6).round() / 1e6
}
