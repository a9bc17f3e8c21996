//! Streamed reads of a keyed table's live rows, shard by shard.
//!
//! [`Store::scan`] builds one in-memory [`fluxmem_graph::Graph`]: every row read stays in memory
//! until the stage ends. A stage that only folds over the rows (credit assignment sums outcomes
//! per node, then decides edge by edge) streams them instead: [`Store::live`] reads the key
//! columns of every shard of the table once and marks each row live or superseded (the same
//! rule as compaction: the row of a key in the latest shard wins), and [`Live::edges`] /
//! [`Live::nodes`] then decode one shard at a time, live rows only. What stays in memory is one
//! bit per stored row and the shard being decoded, not the table.

use arrow_array::{Array, BooleanArray, RecordBatch};
use fluxmem_graph::{schema, Edge, EdgeKind, Embedding, Node, NodeId, Step};
use std::collections::BTreeMap;

use crate::keys::{key_columns, key_of, KeyMap, KeySet};
use crate::manifest::{Manifest, ShardEntry};
use crate::scan::{names_relation, sorted, text_column};
use crate::{shard, Result, Store};

/// A live edge row as [`Live::edges_deciding`] shows it: the key, weight, evidence, state and
/// the metadata as stored (JSON text).
#[derive(Debug, Clone, Copy)]
pub struct EdgeRow<'a> {
    /// Source node id.
    pub src: &'a str,
    /// Destination node id.
    pub dst: &'a str,
    /// Edge kind.
    pub kind: EdgeKind,
    /// Weight.
    pub weight: f32,
    /// Evidence.
    pub evidence: i64,
    /// Active.
    pub active: bool,
    /// Metadata, a JSON object as stored.
    pub metadata: &'a str,
    /// The metadata names a `relation` (a Stage II link).
    pub relation: bool,
}

/// The live rows of one keyed table (`nodes`, `edges` or `embeddings`) at one commit: see [`Store::live`].
pub struct Live<'s> {
    store: &'s Store,
    /// The table's shards in commit order, each with one flag per row (true: live).
    shards: Vec<(ShardEntry, Vec<bool>)>,
    live: u64,
}

impl Store {
    /// The live rows of `table` (`"nodes"`, `"edges"` or `"embeddings"`) at the commit `manifest` describes,
    /// ready to stream. Reads the keys only (key indexes, or key columns).
    ///
    /// Shards are read newest first: a row is live unless a later shard holds its key (within
    /// a shard, keys are unique: every shard is written in strict key order, and this checks
    /// it). A shard's keys come from its key index where it has a sound one (see `keys.rs`),
    /// else from its key columns. Only the keys of the shards after the oldest are kept (16 bytes each), so what this
    /// holds follows the newer shards, not the history: after compaction the oldest shard is
    /// the largest. A shard out of key order falls back to the map from every key to its
    /// winning row (16 bytes of hash and a position per live key, dropped before this returns).
    pub fn live(&self, manifest: &Manifest, table: &str) -> Result<Live<'_>> {
        let entries = sorted(manifest, table);
        if let Some(live) = self.live_newest_first(&entries)? {
            return Ok(live);
        }
        let last = winning_rows(self, table, entries.iter().map(|e| vec![e]))?;
        let mut shards: Vec<(ShardEntry, Vec<bool>)> = entries
            .into_iter()
            .map(|e| {
                let rows = e.rows as usize;
                (e, vec![false; rows])
            })
            .collect();
        for &(index, row) in last.values() {
            let flags = &mut shards[index].1;
            if row >= flags.len() {
                // The manifest's row count is short of the file's: grow rather than misread.
                flags.resize(row + 1, false);
            }
            flags[row] = true;
        }
        Ok(Live {
            store: self,
            shards,
            live: last.len() as u64,
        })
    }

    /// [`Store::live`] by reading the shards newest first; `None` when a shard is not in strict
    /// key order (its keys may repeat).
    fn live_newest_first(&self, entries: &[ShardEntry]) -> Result<Option<Live<'_>>> {
        let mut later = KeySet::default();
        let mut shards: Vec<(ShardEntry, Vec<bool>)> = Vec::with_capacity(entries.len());
        let mut live = 0u64;
        for (index, entry) in entries.iter().enumerate().rev() {
            let oldest = index == 0;
            // The shard's key index where it has a sound one, else made here from its key
            // columns (not kept: a reader holds no lock), which checks their order.
            let keys = shard::key_index(&self.dir, entry, false)?;
            if !keys.ordered {
                return Ok(None);
            }
            let mut flags = Vec::with_capacity(keys.len());
            for key in &keys.keys {
                let is_live = !later.contains(key);
                if is_live && !oldest {
                    later.insert(*key);
                }
                live += is_live as u64;
                flags.push(is_live);
            }
            shards.push((entry.clone(), flags));
        }
        shards.reverse();
        Ok(Some(Live {
            store: self,
            shards,
            live,
        }))
    }
}

impl Live<'_> {
    /// Live rows of the table.
    pub fn len(&self) -> u64 {
        self.live
    }

    /// True when the table has no live row.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Calls `f` with every live edge of the given kinds (every kind when `kinds` is empty), in
    /// shard order (not key order), each exactly once.
    pub fn edges(&self, kinds: &[EdgeKind], f: &mut dyn FnMut(Edge)) -> Result<()> {
        let kinds: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
        self.each_batch(None, &mut |entry, batch, live| {
            let kind = text_column(self.store, entry, batch, "kind")?;
            let batch = self.select(entry, batch, |i| {
                live[i] && (kinds.is_empty() || kinds.contains(&kind.value(i)))
            })?;
            for edge in schema::edges_from_batch(&batch)
                .map_err(|e| self.store.corrupt(entry, e.to_string()))?
            {
                f(edge);
            }
            Ok(())
        })
    }

    /// Calls `f` with every live node row, without its steps (`steps` are not read), in shard
    /// order, each exactly once.
    pub fn nodes(&self, f: &mut dyn FnMut(Node)) -> Result<()> {
        let no_steps: BTreeMap<NodeId, Vec<Step>> = BTreeMap::new();
        self.each_batch(None, &mut |entry, batch, live| {
            let batch = self.select(entry, batch, |i| live[i])?;
            for node in schema::nodes_from_batch_with(&batch, &no_steps, &|_| false)
                .map_err(|e| self.store.corrupt(entry, e.to_string()))?
            {
                f(node);
            }
            Ok(())
        })
    }

    /// Calls `f` with every live embedding row, vector included, in shard order, each exactly
    /// once: one shard's batch in memory at a time, not the table.
    pub fn embeddings(&self, f: &mut dyn FnMut(Embedding)) -> Result<()> {
        self.each_batch(None, &mut |entry, batch, live| {
            let batch = self.select(entry, batch, |i| live[i])?;
            for embedding in schema::embeddings_from_batch(&batch)
                .map_err(|e| self.store.corrupt(entry, e.to_string()))?
            {
                f(embedding);
            }
            Ok(())
        })
    }

    /// Calls `f` with the id of every live row of a `nodes` table, in shard order, each exactly
    /// once: the `id` column only.
    pub fn ids(&self, f: &mut dyn FnMut(&str)) -> Result<()> {
        self.each_batch(Some(&["id"]), &mut |entry, batch, live| {
            let id = text_column(self.store, entry, batch, "id")?;
            (0..batch.num_rows())
                .filter(|&r| live[r])
                .for_each(|r| f(id.value(r)));
            Ok(())
        })
    }

    /// Calls `f` with the node id, model id and text hash of every live row of an `embeddings`
    /// table, in shard order, each exactly once: three of the four columns, no vector decoded.
    pub fn embedding_keys(&self, f: &mut dyn FnMut(&str, &str, &str)) -> Result<()> {
        let columns = ["node_id", "model_id", "text_sha256"];
        self.each_batch(Some(&columns), &mut |entry, batch, live| {
            let text = |name: &str| text_column(self.store, entry, batch, name);
            let (node, model, hash) = (text("node_id")?, text("model_id")?, text("text_sha256")?);
            (0..batch.num_rows())
                .filter(|&r| live[r])
                .for_each(|r| f(node.value(r), model.value(r), hash.value(r)));
            Ok(())
        })
    }

    /// The ends of every live edge of the given kinds (every kind when `kinds` is empty), with
    /// whether its metadata names a `relation` (a Stage II link), in shard order: four of the
    /// ten columns, no weights, runs or metadata maps decoded, nothing allocated per row.
    pub fn edge_ends(
        &self,
        kinds: &[EdgeKind],
        f: &mut dyn FnMut(&str, &str, EdgeKind, bool),
    ) -> Result<()> {
        let columns = ["src", "dst", "kind", "metadata"];
        self.each_batch(Some(&columns), &mut |entry, batch, live| {
            let text = |name: &str| text_column(self.store, entry, batch, name);
            let (src, dst, kind, metadata) =
                (text("src")?, text("dst")?, text("kind")?, text("metadata")?);
            for row in (0..batch.num_rows()).filter(|&r| live[r]) {
                let kind = EdgeKind::parse(kind.value(row)).ok_or_else(|| {
                    self.store.corrupt(
                        entry,
                        format!("row {row}: unknown edge kind `{}`", kind.value(row)),
                    )
                })?;
                if !kinds.is_empty() && !kinds.contains(&kind) {
                    continue;
                }
                f(
                    src.value(row),
                    dst.value(row),
                    kind,
                    names_relation(metadata.value(row)),
                );
            }
            Ok(())
        })
    }

    /// Decides edge by edge from a light view of each live row (`EdgeRow`: no metadata map,
    /// no strings copied), and decodes whole only the rows `decide` picks, handing each to
    /// `then` with its decision, in shard order. `decide` returning an error names the row.
    pub fn edges_deciding<T>(
        &self,
        decide: &mut dyn FnMut(&EdgeRow<'_>) -> std::result::Result<Option<T>, String>,
        then: &mut dyn FnMut(Edge, T),
    ) -> Result<()> {
        use arrow_array::cast::AsArray;
        use arrow_array::types::{Float32Type, Int64Type};
        self.each_batch(None, &mut |entry, batch, live| {
            let text = |name: &str| text_column(self.store, entry, batch, name);
            let (src, dst, kind, metadata) =
                (text("src")?, text("dst")?, text("kind")?, text("metadata")?);
            let weight = batch
                .column_by_name("weight")
                .and_then(|c| c.as_primitive_opt::<Float32Type>())
                .ok_or_else(|| {
                    self.store
                        .corrupt(entry, "column `weight` is not f32".into())
                })?;
            let evidence = batch
                .column_by_name("evidence")
                .and_then(|c| c.as_primitive_opt::<Int64Type>())
                .ok_or_else(|| {
                    self.store
                        .corrupt(entry, "column `evidence` is not i64".into())
                })?;
            let active = batch
                .column_by_name("active")
                .and_then(|c| c.as_boolean_opt())
                .ok_or_else(|| {
                    self.store
                        .corrupt(entry, "column `active` is not boolean".into())
                })?;
            let mut picked = Vec::new();
            let mut mask = vec![false; batch.num_rows()];
            for row in (0..batch.num_rows()).filter(|&r| live[r]) {
                let kind = EdgeKind::parse(kind.value(row)).ok_or_else(|| {
                    self.store.corrupt(
                        entry,
                        format!("row {row}: unknown edge kind `{}`", kind.value(row)),
                    )
                })?;
                let view = EdgeRow {
                    src: src.value(row),
                    dst: dst.value(row),
                    kind,
                    weight: weight.value(row),
                    evidence: evidence.value(row),
                    // As the schema decodes it: a missing flag is active.
                    active: active.is_null(row) || active.value(row),
                    metadata: if metadata.is_null(row) {
                        "{}"
                    } else {
                        metadata.value(row)
                    },
                    relation: !metadata.is_null(row) && names_relation(metadata.value(row)),
                };
                if let Some(decision) = decide(&view)
                    .map_err(|reason| self.store.corrupt(entry, format!("row {row}: {reason}")))?
                {
                    mask[row] = true;
                    picked.push(decision);
                }
            }
            if picked.is_empty() {
                return Ok(());
            }
            let batch = self.select(entry, batch, |i| mask[i])?;
            let edges = schema::edges_from_batch(&batch)
                .map_err(|e| self.store.corrupt(entry, e.to_string()))?;
            for (edge, decision) in edges.into_iter().zip(picked) {
                then(edge, decision);
            }
            Ok(())
        })
    }

    /// The rows `keep` picks of one of `entry`'s batches.
    fn select(
        &self,
        entry: &ShardEntry,
        batch: &RecordBatch,
        keep: impl Fn(usize) -> bool,
    ) -> Result<RecordBatch> {
        let mask: BooleanArray = (0..batch.num_rows()).map(|i| Some(keep(i))).collect();
        arrow_select::filter::filter_record_batch(batch, &mask).map_err(|e| {
            self.store
                .corrupt(entry, format!("cannot filter rows: {e}"))
        })
    }

    /// Every batch of every shard (the `columns` asked for, all when `None`) with its rows'
    /// live flags.
    #[allow(clippy::type_complexity)] // a callback of (shard, batch, live flags)
    fn each_batch(
        &self,
        columns: Option<&[&str]>,
        f: &mut dyn FnMut(&ShardEntry, &RecordBatch, &[bool]) -> Result<()>,
    ) -> Result<()> {
        for (entry, flags) in &self.shards {
            if !flags.iter().any(|&l| l) {
                continue;
            }
            let mut start = 0usize;
            for batch in shard::batches(&self.store.dir, entry, columns)? {
                let batch = batch?;
                let end = start + batch.num_rows();
                let live = flags.get(start..end).ok_or_else(|| {
                    self.store.corrupt(
                        entry,
                        format!("{end} rows, the key columns had {}", flags.len()),
                    )
                })?;
                f(entry, &batch, live)?;
                start = end;
            }
        }
        Ok(())
    }
}

/// For each key of `table`, the position (group, row) of its winning row (the last one written).
/// `groups` come in commit order, each the shards of `table` whose rows are counted on from one
/// to the next. Reads only the key columns: the readers' fallback for a shard out of key order
/// ([`Store::live`]).
pub(crate) fn winning_rows<'e>(
    store: &Store,
    table: &str,
    groups: impl Iterator<Item = Vec<&'e ShardEntry>>,
) -> Result<KeyMap<(usize, usize)>> {
    let mut last: KeyMap<(usize, usize)> = KeyMap::default();
    let keys = key_columns(table);
    for (index, group) in groups.enumerate() {
        let mut row = 0usize;
        for entry in group {
            for batch in shard::open(&store.dir, entry, Some(keys), shard::DEFAULT_BATCH_ROWS)? {
                let batch = batch?;
                let strings: Vec<&arrow_array::StringArray> = keys
                    .iter()
                    .map(|name| text_column(store, entry, &batch, name))
                    .collect::<Result<_>>()?;
                let mut parts: Vec<&str> = Vec::with_capacity(strings.len());
                for i in 0..batch.num_rows() {
                    parts.clear();
                    parts.extend(strings.iter().map(|s| s.value(i)));
                    last.insert(key_of(&parts), (index, row));
                    row += 1;
                }
            }
        }
    }
    Ok(last)
}
