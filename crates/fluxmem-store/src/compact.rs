//! Compaction: a log-structured merge policy over the append-only shards.
//!
//! Every commit appends shards, and a row replaced by a later commit stays in its old shard
//! ("dead"). Compaction keeps the store in proportion to its live data:
//!
//! - **Live rows.** For each keyed table (`nodes` with their `steps`, `edges`, `embeddings`),
//!   only the key indexes of its shards are read ([`crate::keys`]; made from the key columns
//!   where one is missing), and a row is live when no later row holds its key.
//! - **Rewrite.** A unit (one shard; for `nodes`, the `nodes` and `steps` shards of one commit)
//!   whose dead share is above [`CompactPolicy::max_dead_fraction`] is rewritten with its live
//!   rows only. With 1/3, every unit is at least two-thirds live afterwards, so rows stored /
//!   live rows <= 1.5 after any number of nights.
//! - **Merge** (tantivy's log merge policy). Units fall in levels by live rows (level `L` holds
//!   `min_level_rows * merge_factor^L` rows and up); once a level holds `merge_factor` units,
//!   they are merged into one, so a table has O(merge_factor * log n) shards and a row is
//!   rewritten O(log n) times over its life.
//! - **Edits** (the edit log, no key) are concatenated, never dropped: the trailing run of
//!   same-level shards merges once it is `merge_factor` long, which keeps the log's order.
//! - **Streaming.** A merge reads its members a batch at a time and writes the winning rows in
//!   key order a batch at a time (`merge.rs`), so its memory does not follow the members' size.
//!
//! What a compaction writes holds only live rows, so its shards take the newest position (the
//! compaction's own commit number): no later shard holds their keys, and the dead rows they
//! replace lose to them as before. The merged-away files leave the manifest at once but stay on
//! disk ("retired", listed in the manifest) for [`CompactPolicy::keep_commits`] more commits,
//! so a reader that read the previous manifest can still read them; readers that find one
//! gone reload the manifest ([`crate::Store::load`]). Retired files are deleted by a later
//! commit, and never while a sharded run's staging store (which reads the main store's
//! shards by path) exists.

use fluxmem_graph::{schema, EdgeKind, Graph, GraphStats, NodeId, NodeKind, Step};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

use crate::keys::{KeySet, EDGE_CODES, NODE_CODES};
use crate::layout::{fault_point, staging_in_progress, sync_dir, SHARDS, STAGING};
use crate::manifest::{LiveCounts, Manifest, RetiredShard, ShardEntry};
use crate::merge::{self, EdgeSink, EmbeddingSink, Keyed, NodeRows, NodeSink, Run, Stop};
use crate::scan::sorted;
use crate::store::write_shards;
use crate::{keys, shard, CommitInfo, Error, Result, Writer};

/// When compaction rewrites and merges shards.
#[derive(Debug, Clone, Serialize)]
pub struct CompactPolicy {
    /// A unit whose share of dead (superseded) rows is above this is rewritten with its live
    /// rows. 1/3 bounds rows stored / live rows at 1.5.
    pub max_dead_fraction: f64,
    /// Units of one level merged into one once this many gather (at least 2).
    pub merge_factor: usize,
    /// Live rows of the smallest level.
    pub min_level_rows: u64,
    /// Rows a merge decodes at a time from each member shard, and writes at a time: a merge
    /// streams its members by key (see `merge.rs`), so its memory follows this, not the
    /// members' size.
    pub batch_rows: usize,
}

impl Default for CompactPolicy {
    fn default() -> Self {
        CompactPolicy {
            max_dead_fraction: 1.0 / 3.0,
            merge_factor: 8,
            min_level_rows: 1000,
            batch_rows: 4096,
        }
    }
}

/// What compaction found and did for one table.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TableCompaction {
    /// Shard files before and after.
    pub shards_before: usize,
    /// See `shards_before`.
    pub shards_after: usize,
    /// Rows stored before and after (for `nodes`, node rows; steps follow their nodes).
    pub rows_before: u64,
    /// See `rows_before`.
    pub rows_after: u64,
    /// Live rows (the same before and after).
    pub live_rows: u64,
    /// Bytes of the table's shards before and after.
    pub bytes_before: u64,
    /// See `bytes_before`.
    pub bytes_after: u64,
    /// Units rewritten because of their dead rows.
    pub rewritten: usize,
    /// Units merged by level.
    pub merged: usize,
    /// Merges done in memory, each with the reason: a member shard not in key order (none in a
    /// store this version wrote; the other merges stream).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub in_memory: Vec<String>,
}

impl TableCompaction {
    /// Rows stored per live row after compaction (1 when the table is empty).
    pub fn amplification(&self) -> f64 {
        if self.live_rows == 0 {
            1.0
        } else {
            self.rows_after as f64 / self.live_rows as f64
        }
    }
}

/// What a compaction did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompactReport {
    /// Per table (`nodes`, `edges`, `embeddings`, `edits`).
    pub tables: BTreeMap<String, TableCompaction>,
    /// Files that left the manifest (kept on disk for a while).
    pub retired: usize,
    /// True when a commit was made (false: nothing to do).
    pub committed: bool,
    /// True when the pass wrote the live counts to the manifest (with its merges, or on
    /// their own when nothing needed merging but the manifest's counts were out of date).
    pub counted: bool,
}

/// A keyed table's unit: the shards compacted together (for `nodes`, the nodes and steps
/// shards of one commit).
struct Unit {
    entries: Vec<ShardEntry>,
    rows: u64,
    live: u64,
    /// Per row of the unit's table shards (in order): true when live.
    flags: Vec<bool>,
}

fn level(rows: u64, policy: &CompactPolicy) -> u32 {
    let mut level = 0;
    let mut bound = policy.min_level_rows.max(1) * policy.merge_factor as u64;
    while rows >= bound {
        level += 1;
        bound = bound.saturating_mul(policy.merge_factor as u64);
    }
    level
}

/// What a compaction pass writes and retires, over its tables.
#[derive(Default)]
struct Outputs {
    /// The shards written.
    written: Vec<ShardEntry>,
    /// The files merged away.
    removed: BTreeSet<String>,
    /// The next part number of the pass's commit.
    part: usize,
}

/// The sets of units merged into one: each level that holds `merge_factor` units or more,
/// and, of the other levels, the units whose dead share is above `max_dead_fraction` (each
/// level's together). Counts the rewritten and merged units in `stats`.
fn merge_sets(
    units: &[Unit],
    policy: &CompactPolicy,
    stats: &mut TableCompaction,
) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    let mut selected: BTreeSet<usize> = BTreeSet::new();
    for (index, unit) in units.iter().enumerate() {
        let dead = unit.rows - unit.live;
        if unit.rows > 0 && dead as f64 > policy.max_dead_fraction * unit.rows as f64 {
            selected.insert(index);
            stats.rewritten += 1;
        }
        groups
            .entry(level(unit.live, policy))
            .or_default()
            .push(index);
    }
    let mut sets: Vec<Vec<usize>> = Vec::new();
    for members in groups.values() {
        if members.len() >= policy.merge_factor {
            stats.merged += members.len();
            sets.push(members.clone());
        } else {
            let lone: Vec<usize> = members
                .iter()
                .copied()
                .filter(|i| selected.contains(i))
                .collect();
            if !lone.is_empty() {
                sets.push(lone);
            }
        }
    }
    sets
}

impl Writer {
    /// Compacts the store by `policy` in one atomic commit (see the module docs); nothing is
    /// written when nothing needs it. Refused while a sharded run's staging store exists (its
    /// merge needs the store version it started from).
    ///
    /// A merge can fill the next level, so passes repeat (each its own commit, at most 8)
    /// until one finds nothing to do; the report spans them all.
    pub fn compact(&mut self, policy: &CompactPolicy, run_id: &str) -> Result<CompactReport> {
        let mut total = self.compact_pass(policy, run_id)?;
        for _ in 1..8 {
            if !total.committed {
                break;
            }
            let next = self.compact_pass(policy, run_id)?;
            if !next.committed {
                break;
            }
            total.retired += next.retired;
            for (table, after) in next.tables {
                let entry = total.tables.entry(table).or_default();
                entry.rewritten += after.rewritten;
                entry.merged += after.merged;
                entry.in_memory.extend(after.in_memory);
                (entry.shards_after, entry.rows_after, entry.bytes_after) =
                    (after.shards_after, after.rows_after, after.bytes_after);
            }
        }
        Ok(total)
    }

    fn compact_pass(&mut self, policy: &CompactPolicy, run_id: &str) -> Result<CompactReport> {
        let dir = self.store.dir.clone();
        self.check_not_staging("compacting")?;
        let policy = CompactPolicy {
            merge_factor: policy.merge_factor.max(2),
            ..policy.clone()
        };
        keys::sweep(&dir, &|file| dir.join(file).exists())?;
        let manifest = self.manifest.clone();
        let version = manifest.version + 1;
        let mut report = CompactReport::default();
        let mut out = Outputs::default();
        let mut counts = GraphStats::default();
        for table in ["nodes", "edges", "embeddings"] {
            let (stats, table_counts) =
                self.compact_table(&manifest, table, &policy, version, &mut out)?;
            counts = counts + table_counts;
            report.tables.insert(table.to_string(), stats);
        }
        let edits = self.compact_edits(&manifest, &policy, version, &mut out)?;
        report.tables.insert("edits".into(), edits);
        if out.removed.is_empty() {
            self.commit_counts(manifest, version, counts, run_id, &mut report)?;
        } else {
            self.commit_outputs(manifest, version, counts, out, run_id, &mut report)?;
        }
        let manifest = self.manifest.clone();
        self.finish_report(&mut report, &manifest);
        Ok(report)
    }

    /// Refuses to compact while a sharded run's staging store exists (its merge needs the
    /// store version it started from), and to compact a staging store.
    /// Refuses `what` (a commit that moves the main store's version without a stage's data:
    /// compacting, indexing) while a sharded run is in progress, whose merge needs the version
    /// its shards started from, and in a staging store.
    pub(crate) fn check_not_staging(&self, what: &str) -> Result<()> {
        let dir = &self.store.dir;
        if staging_in_progress(dir) {
            return Err(Error::Staging {
                path: dir.join(STAGING),
                reason: format!("a sharded run is in progress (staging stores exist); merge or remove it before {what}"),
            });
        }
        if self.manifest.progress.contains_key("staging") {
            return Err(Error::Staging {
                path: dir.clone(),
                reason: format!("this is a sharded run's staging store (it reads the main store's shards); run {what} on the main store after the merge"),
            });
        }
        Ok(())
    }

    /// Rewrites and merges the units of a keyed table that the policy selects; what it found
    /// and did, and the counts of the table's live rows.
    fn compact_table(
        &mut self,
        manifest: &Manifest,
        table: &str,
        policy: &CompactPolicy,
        version: u64,
        out: &mut Outputs,
    ) -> Result<(TableCompaction, GraphStats)> {
        let (units, counts) = self.live_units(manifest, table)?;
        let mut stats = TableCompaction {
            shards_before: units
                .iter()
                .map(|u| u.entries.iter().filter(|e| e.table == table).count())
                .sum(),
            rows_before: units.iter().map(|u| u.rows).sum(),
            live_rows: units.iter().map(|u| u.live).sum(),
            bytes_before: units.iter().flat_map(|u| &u.entries).map(|e| e.bytes).sum(),
            ..Default::default()
        };
        for members in merge_sets(&units, policy, &mut stats) {
            let start = out.part;
            let written = match self.merge_streaming(
                table,
                &members,
                &units,
                version,
                &mut out.part,
                policy.batch_rows,
            ) {
                Ok(written) => written,
                Err(Stop::Failed(error)) => return Err(error),
                Err(Stop::Unordered(reason)) => {
                    // A member out of key order (not one this crate wrote): merged in memory.
                    out.part = start;
                    stats.in_memory.push(reason);
                    let graph = self.live_rows_of(table, &members, &units)?;
                    self.write_graph(&graph, version, &mut out.part)?
                }
            };
            for index in &members {
                out.removed
                    .extend(units[*index].entries.iter().map(|e| e.file.clone()));
            }
            out.written.extend(spanning(
                written,
                members.iter().flat_map(|&i| &units[i].entries),
            ));
        }
        Ok((stats, counts))
    }

    /// The edit log: the trailing run of same-level shards, concatenated once it is
    /// `merge_factor` long.
    fn compact_edits(
        &mut self,
        manifest: &Manifest,
        policy: &CompactPolicy,
        version: u64,
        out: &mut Outputs,
    ) -> Result<TableCompaction> {
        let edits: Vec<ShardEntry> = sorted(manifest, "edits");
        let mut stats = TableCompaction {
            shards_before: edits.len(),
            rows_before: edits.iter().map(|e| e.rows).sum(),
            live_rows: edits.iter().map(|e| e.rows).sum(),
            bytes_before: edits.iter().map(|e| e.bytes).sum(),
            ..Default::default()
        };
        let Some(last) = edits.last() else {
            return Ok(stats);
        };
        let tail_level = level(last.rows, policy);
        let run: Vec<&ShardEntry> = edits
            .iter()
            .rev()
            .take_while(|e| level(e.rows, policy) == tail_level)
            .collect();
        if run.len() >= policy.merge_factor {
            let in_order: Vec<&ShardEntry> = run.iter().rev().copied().collect();
            let mut next_part = || {
                out.part += 1;
                out.part - 1
            };
            let written = merge::concatenate_edits(
                &self.store.dir,
                &in_order,
                version,
                &mut next_part,
                policy.batch_rows,
            )?;
            out.written
                .extend(spanning(written, in_order.iter().copied()));
            out.removed.extend(in_order.iter().map(|e| e.file.clone()));
            stats.merged = run.len();
        }
        Ok(stats)
    }

    /// Nothing to merge: when the live counts are new, a commit of the counts alone.
    fn commit_counts(
        &mut self,
        mut manifest: Manifest,
        version: u64,
        counts: GraphStats,
        run_id: &str,
        report: &mut CompactReport,
    ) -> Result<()> {
        if manifest.current_counts() == Some(counts) {
            return Ok(());
        }
        manifest.version = version;
        manifest.live_counts = Some(LiveCounts {
            version,
            stats: counts,
        });
        let summary = serde_json::json!({ "counted": true });
        self.land(
            manifest,
            CommitInfo {
                stage: "compact".into(),
                run_id: run_id.into(),
                summary,
                progress: Default::default(),
            },
        )?;
        report.counted = true;
        Ok(())
    }

    /// Commits the written shards in place of the merged-away ones, which stay on disk as
    /// retired files.
    fn commit_outputs(
        &mut self,
        mut manifest: Manifest,
        version: u64,
        counts: GraphStats,
        out: Outputs,
        run_id: &str,
        report: &mut CompactReport,
    ) -> Result<()> {
        if !out.written.is_empty() {
            sync_dir(&self.store.dir.join(SHARDS))?;
        }
        fault_point("before-manifest", version);
        report.retired = out.removed.len();
        manifest.shards.retain(|s| !out.removed.contains(&s.file));
        manifest.shards.extend(out.written);
        manifest
            .retired
            .extend(out.removed.iter().map(|file| RetiredShard {
                file: file.clone(),
                version,
                at_ms: Some(chrono::Utc::now().timestamp_millis()),
            }));
        manifest.version = version;
        // Compaction keeps every live row: the counts of the old shards hold for the new ones.
        manifest.live_counts = Some(LiveCounts {
            version,
            stats: counts,
        });
        report.counted = true;
        let summary = serde_json::to_value(&*report).expect("the report serialises");
        let info = CommitInfo {
            stage: "compact".into(),
            run_id: run_id.into(),
            summary,
            progress: Default::default(),
        };
        self.land(manifest, info)?;
        fault_point("after-manifest", version);
        report.committed = true;
        Ok(())
    }

    /// Fills the after-columns of `report` from `manifest`.
    fn finish_report(&self, report: &mut CompactReport, manifest: &Manifest) {
        for (table, stats) in report.tables.iter_mut() {
            let entries: Vec<&ShardEntry> = manifest
                .shards
                .iter()
                .filter(|s| &s.table == table)
                .collect();
            stats.shards_after = entries.len();
            stats.rows_after = entries.iter().map(|e| e.rows).sum();
            let steps: u64 = if table == "nodes" {
                manifest
                    .shards
                    .iter()
                    .filter(|s| s.table == "steps")
                    .map(|s| s.bytes)
                    .sum()
            } else {
                0
            };
            stats.bytes_after = entries.iter().map(|e| e.bytes).sum::<u64>() + steps;
        }
    }

    /// The units of `table` in commit order, each with its rows' liveness, and the counts of
    /// the table's live rows (nodes by kind, active edges by kind, nodes with a vector).
    ///
    /// Reads each shard's key index ([`crate::keys`]; made from the shard, and kept, where it
    /// is missing or damaged), not the shards: units newest first, a row is live unless a later
    /// row holds its key. The keys of every unit but the oldest are held (16 bytes each), so
    /// what this holds follows the newer units; the oldest unit's keys are only looked up
    /// (when it is one shard in key order, its keys do not repeat).
    fn live_units(&self, manifest: &Manifest, table: &str) -> Result<(Vec<Unit>, GraphStats)> {
        let entries = sorted(manifest, table);
        let mut units: Vec<Unit> = Vec::new();
        for entry in entries {
            let joins_previous = table == "nodes"
                && units
                    .last()
                    .is_some_and(|u| u.entries[0].commit == entry.commit);
            if joins_previous {
                let unit = units.last_mut().expect("checked");
                unit.rows += entry.rows;
                unit.entries.push(entry);
            } else {
                units.push(Unit {
                    rows: entry.rows,
                    entries: vec![entry],
                    live: 0,
                    flags: Vec::new(),
                });
            }
        }
        if table == "nodes" {
            for unit in &mut units {
                let commit = unit.entries[0].commit;
                unit.entries.extend(
                    manifest
                        .shards
                        .iter()
                        .filter(|s| s.table == "steps" && s.commit == commit)
                        .cloned(),
                );
            }
        }
        let dir = &self.store.dir;
        let mut later = KeySet::default();
        let mut embedded = KeySet::default();
        let mut counts = GraphStats::default();
        for (index, unit) in units.iter_mut().enumerate().rev() {
            let shards: Vec<&ShardEntry> =
                unit.entries.iter().filter(|e| e.table == table).collect();
            let indexes: Vec<keys::KeyIndex> = shards
                .iter()
                .map(|e| shard::key_index(dir, e, true))
                .collect::<Result<_>>()?;
            let look_only = index == 0 && indexes.len() == 1 && indexes[0].ordered;
            let mut flags = vec![false; indexes.iter().map(|i| i.len()).sum()];
            let mut offset = flags.len();
            // Within a unit too the last row of a key wins: rows newest first.
            for keys in indexes.iter().rev() {
                offset -= keys.len();
                for row in (0..keys.len()).rev() {
                    let key = &keys.keys[row];
                    let live = if look_only {
                        !later.contains(key)
                    } else {
                        later.insert(*key)
                    };
                    if !live {
                        continue;
                    }
                    flags[offset + row] = true;
                    let aux = keys.aux(row);
                    match table {
                        "nodes" => match NODE_CODES.get(aux[0] as usize) {
                            Some(NodeKind::Semantic) => counts.semantic += 1,
                            Some(NodeKind::Episodic) => counts.episodic += 1,
                            Some(NodeKind::Procedural) => counts.procedural += 1,
                            None => {
                                return Err(self.store.corrupt(
                                    shards[0],
                                    format!("key index: unknown node code {}", aux[0]),
                                ))
                            }
                        },
                        "edges" => match aux[0]
                            .checked_sub(1)
                            .map(|code| EDGE_CODES.get(code as usize))
                        {
                            None => {}
                            Some(Some(EdgeKind::Ground)) => counts.ground += 1,
                            Some(Some(EdgeKind::Distill)) => counts.distill += 1,
                            Some(Some(EdgeKind::Link)) => counts.link += 1,
                            Some(None) => {
                                return Err(self.store.corrupt(
                                    shards[0],
                                    format!("key index: unknown edge code {}", aux[0]),
                                ))
                            }
                        },
                        _ => {
                            embedded.insert(aux.try_into().expect("16 bytes"));
                        }
                    }
                }
            }
            unit.live = flags.iter().filter(|&&f| f).count() as u64;
            unit.flags = flags;
        }
        counts.embedded = embedded.len();
        Ok((units, counts))
    }

    /// Writes the live rows of `members` (indices of `units` of `table`) as shards of commit
    /// `version`, merging the members' shards by key a batch at a time (`merge.rs`).
    #[allow(clippy::too_many_arguments)]
    fn merge_streaming(
        &self,
        table: &str,
        members: &[usize],
        units: &[Unit],
        version: u64,
        part: &mut usize,
        batch_rows: usize,
    ) -> std::result::Result<Vec<ShardEntry>, Stop> {
        let dir = self.store.dir.as_path();
        let live: Vec<&[bool]> = units.iter().map(|u| u.flags.as_slice()).collect();
        let last = live.as_slice();
        let mut next_part = || {
            *part += 1;
            *part - 1
        };
        let part_of = |entry: &ShardEntry| {
            let name = entry.file.rsplit('/').next().unwrap_or(&entry.file);
            shard::parse_shard_name(name).map(|parsed| parsed.part)
        };
        match table {
            "nodes" => {
                let mut runs = Vec::new();
                for &index in members {
                    let unit = &units[index];
                    let steps: Vec<&ShardEntry> =
                        unit.entries.iter().filter(|e| e.table == "steps").collect();
                    let mut paired = 0;
                    let mut row = 0usize;
                    for entry in unit.entries.iter().filter(|e| e.table == "nodes") {
                        let part = part_of(entry);
                        let own = steps
                            .iter()
                            .copied()
                            .find(|s| part.is_some() && part_of(s) == part);
                        paired += usize::from(own.is_some());
                        runs.push(Run::new(
                            index,
                            row,
                            entry.file.clone(),
                            Box::new(NodeRows::open(dir, entry, own, batch_rows)?),
                        ));
                        row += entry.rows as usize;
                    }
                    if paired != steps.len() {
                        return Err(Stop::Unordered(format!(
                            "commit {}: a steps shard without its nodes shard's part",
                            unit.entries[0].commit
                        )));
                    }
                }
                merge::merge(
                    runs,
                    last,
                    batch_rows,
                    NodeSink::new(dir, version, &mut next_part),
                )
            }
            "edges" => {
                let runs = Self::runs(dir, members, units, batch_rows, schema::edges_from_batch)?;
                merge::merge(
                    runs,
                    last,
                    batch_rows,
                    EdgeSink::new(dir, version, &mut next_part),
                )
            }
            _ => {
                let runs = Self::runs(
                    dir,
                    members,
                    units,
                    batch_rows,
                    schema::embeddings_from_batch,
                )?;
                merge::merge(
                    runs,
                    last,
                    batch_rows,
                    EmbeddingSink::new(dir, version, &mut next_part),
                )
            }
        }
    }

    /// A run per shard of `members` (edges or embeddings: a unit is one shard).
    fn runs<'a, T: Keyed + 'a>(
        dir: &'a std::path::Path,
        members: &[usize],
        units: &[Unit],
        batch_rows: usize,
        decode: fn(&arrow_array::RecordBatch) -> fluxmem_graph::Result<Vec<T>>,
    ) -> Result<Vec<Run<'a, T>>> {
        let mut runs = Vec::new();
        for &index in members {
            let mut row = 0usize;
            for entry in &units[index].entries {
                runs.push(Run::new(
                    index,
                    row,
                    entry.file.clone(),
                    merge::rows_of(dir, entry, batch_rows, decode)?,
                ));
                row += entry.rows as usize;
            }
        }
        Ok(runs)
    }

    /// The live rows of `members` (units of `table`) as a graph: the merge of members that are
    /// not in key order (see [`Writer::merge_streaming`]).
    fn live_rows_of(&self, table: &str, members: &[usize], units: &[Unit]) -> Result<Graph> {
        let dir = &self.store.dir;
        let mut graph = Graph::default();
        for &index in members {
            let unit = &units[index];
            let wins = |row: usize| unit.flags.get(row).copied().unwrap_or(false);
            let mut row = 0usize;
            match table {
                "nodes" => {
                    let mut steps: BTreeMap<NodeId, Vec<Step>> = BTreeMap::new();
                    for entry in unit.entries.iter().filter(|e| e.table == "steps") {
                        for batch in shard::batches(dir, entry, None)? {
                            let batch = batch?;
                            schema::steps_from_batch(&batch, &mut steps)
                                .map_err(|e| corrupt(dir, entry, e))?;
                        }
                    }
                    for entry in unit.entries.iter().filter(|e| e.table == "nodes") {
                        for batch in shard::batches(dir, entry, None)? {
                            let batch = batch?;
                            for node in schema::nodes_from_batch(&batch, &steps)
                                .map_err(|e| corrupt(dir, entry, e))?
                            {
                                if wins(row) {
                                    graph.upsert_node(node);
                                }
                                row += 1;
                            }
                        }
                    }
                }
                "edges" => {
                    for entry in &unit.entries {
                        for batch in shard::batches(dir, entry, None)? {
                            let batch = batch?;
                            for edge in schema::edges_from_batch(&batch)
                                .map_err(|e| corrupt(dir, entry, e))?
                            {
                                if wins(row) {
                                    graph.upsert_edge(edge);
                                }
                                row += 1;
                            }
                        }
                    }
                }
                _ => {
                    for entry in &unit.entries {
                        for batch in shard::batches(dir, entry, None)? {
                            let batch = batch?;
                            for embedding in schema::embeddings_from_batch(&batch)
                                .map_err(|e| corrupt(dir, entry, e))?
                            {
                                if wins(row) {
                                    graph.upsert_embedding(embedding);
                                }
                                row += 1;
                            }
                        }
                    }
                }
            }
        }
        Ok(graph)
    }

    /// Writes `graph`'s tables as shards of commit `version`, parts numbered on from `part`
    /// (one compaction commit writes many shards of a table).
    fn write_graph(
        &self,
        graph: &Graph,
        version: u64,
        part: &mut usize,
    ) -> Result<Vec<ShardEntry>> {
        // The tenants are the members' ([`spanning`]).
        write_shards(&self.store.dir, graph, version, &|_| None, &mut |_| {
            *part += 1;
            *part - 1
        })
    }
}

/// A compaction's output shards, each marked with the commits whose rows its `members` held
/// ([`ShardEntry::rows_span`]): their rows keep their age for readers that follow a store
/// from a version on ([`Manifest::since`]). Each also names the tenants its members named
/// (their union; none when a member names none): it holds some of their rows and no others.
fn spanning<'a>(
    mut written: Vec<ShardEntry>,
    members: impl Iterator<Item = &'a ShardEntry> + Clone,
) -> Vec<ShardEntry> {
    let (from, through) = members
        .clone()
        .map(ShardEntry::rows_span)
        .fold((u64::MAX, 0), |(a, b), (c, d)| (a.min(c), b.max(d)));
    let tenants = ShardEntry::union_of_tenants(members);
    for entry in &mut written {
        entry.rows_from = Some(from);
        entry.rows_through = Some(through);
        entry.tenants = tenants.clone();
    }
    written
}

fn corrupt(dir: &std::path::Path, entry: &ShardEntry, source: fluxmem_graph::Error) -> Error {
    Error::Corrupt {
        path: dir.join(&entry.file),
        reason: source.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard out of key order (written by hand: no writer of this crate makes one) is merged
    /// in memory, with the same live rows.
    #[test]
    fn a_member_out_of_key_order_is_merged_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::open(dir.path()).unwrap();
        for night in 0..3 {
            let mut delta = Graph::default();
            for i in night * 5..night * 5 + 10 {
                delta.upsert_edge(crate::testing::test_edge(i, night as f32, true));
            }
            writer
                .commit(
                    &delta,
                    CommitInfo {
                        stage: "t".into(),
                        run_id: "r".into(),
                        ..Default::default()
                    },
                )
                .unwrap();
        }
        let expected = writer.store().load().unwrap();
        // The first edge shard, its rows reversed, in place of the original.
        let mut manifest = writer.manifest.clone();
        let at = manifest
            .shards
            .iter()
            .position(|s| s.table == "edges")
            .unwrap();
        let original = manifest.shards[at].clone();
        let batch = shard::read(dir.path(), &original, None).unwrap().remove(0);
        let reversed: arrow_array::UInt32Array = (0..batch.num_rows() as u32).rev().collect();
        let columns = batch
            .columns()
            .iter()
            .map(|c| arrow_select::take::take(c, &reversed, None).unwrap())
            .collect();
        let batch = arrow_array::RecordBatch::try_new(batch.schema(), columns).unwrap();
        manifest.shards[at] =
            shard::write(dir.path(), "edges", original.commit, 7, &batch).unwrap();
        manifest.version += 1;
        writer
            .land(
                manifest,
                CommitInfo {
                    stage: "t".into(),
                    run_id: "r".into(),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(
            writer.store().load().unwrap(),
            expected,
            "the reversed shard holds the same rows"
        );
        // The streamed live rows over it (a shard out of key order: the winning-row map) are
        // the loaded edges, each once.
        let live = writer.store().live(&writer.manifest, "edges").unwrap();
        let mut streamed = BTreeMap::new();
        live.edges(&[], &mut |e| {
            assert!(streamed.insert(e.key(), e).is_none(), "each live edge once")
        })
        .unwrap();
        assert_eq!(live.len() as usize, expected.edges.len());
        assert_eq!(streamed, expected.edges);
        let policy = CompactPolicy {
            merge_factor: 2,
            min_level_rows: 1,
            batch_rows: 4,
            ..Default::default()
        };
        let report = writer.compact(&policy, "c").unwrap();
        assert!(report.tables["edges"].merged >= 2, "{report:?}");
        assert_eq!(
            report.tables["edges"].in_memory.len(),
            1,
            "the merge holding the reversed shard: {report:?}"
        );
        assert_eq!(
            writer.store().load().unwrap(),
            expected,
            "the same live rows after the merge"
        );
        // No temporary file of the abandoned streaming merge is left.
        let names: Vec<String> = std::fs::read_dir(dir.path().join("shards"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }
}
