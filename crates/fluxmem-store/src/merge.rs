//! Compaction's merges in bounded memory: a k-way merge by key over the members' shards.
//!
//! Every keyed shard is written in key order (from a [`Graph`](fluxmem_graph::Graph)'s maps,
//! or by this merge), so a merge reads each member shard a batch at a time, keeps the rows the
//! liveness pass marked as winning, and writes them in key order, a batch at a time, through
//! [`ShardWriter`]: the same rows in the same order as decoding every member into a graph and
//! writing it, in memory that does not grow with the members (a batch per member shard, a
//! batch of output, and the writer's row group). A `steps` shard follows its `nodes` shard (the
//! same commit and part) in the same order, and is read alongside it.
//!
//! A member that is not in key order (no writer of this crate makes one) or whose steps do not
//! follow its nodes stops the merge with [`Stop::Unordered`] before anything is committed; the
//! caller then merges in memory ([`crate::compact`]).

use arrow_array::cast::AsArray;
use arrow_array::Array;
use fluxmem_graph::{schema, Edge, EdgeKey, Embedding, Node, NodeId, Step};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::path::Path;

use crate::manifest::ShardEntry;
use crate::shard::{self, Batches, ShardWriter};
use crate::{Error, Result};

/// Why a streaming merge stopped.
pub(crate) enum Stop {
    /// A member shard is not in key order, or its steps do not follow its nodes (the reason).
    Unordered(String),
    /// Reading or writing failed.
    Failed(Error),
}

impl From<Error> for Stop {
    fn from(error: Error) -> Self {
        Stop::Failed(error)
    }
}

type Flow<T> = std::result::Result<T, Stop>;

/// A row of a keyed table: its order in a shard.
pub(crate) trait Keyed: Sized {
    type Order: Ord + Clone;
    fn order(&self) -> Self::Order;
}

impl Keyed for Node {
    type Order = NodeId;
    fn order(&self) -> NodeId {
        self.id.clone()
    }
}

impl Keyed for Edge {
    type Order = EdgeKey;
    fn order(&self) -> EdgeKey {
        self.key()
    }
}

impl Keyed for Embedding {
    type Order = (NodeId, String);
    fn order(&self) -> (NodeId, String) {
        (self.node_id.clone(), self.model_id.clone())
    }
}

/// One member shard being read: its rows in order, decoded a batch at a time.
pub(crate) struct Run<'a, T: Keyed> {
    /// The member's unit, and the position in it of the next row (the liveness pass's
    /// coordinates).
    pub unit: usize,
    pub row: usize,
    pub file: String,
    pub batches: Box<dyn Iterator<Item = Flow<Vec<T>>> + 'a>,
    items: std::vec::IntoIter<T>,
    previous: Option<T::Order>,
}

impl<'a, T: Keyed> Run<'a, T> {
    pub(crate) fn new(
        unit: usize,
        row: usize,
        file: String,
        batches: Box<dyn Iterator<Item = Flow<Vec<T>>> + 'a>,
    ) -> Self {
        Run {
            unit,
            row,
            file,
            batches,
            items: Vec::new().into_iter(),
            previous: None,
        }
    }

    /// The next row of this run that wins its key, checking the run's order on the way.
    fn next_winner(&mut self, live: &[&[bool]]) -> Flow<Option<T>> {
        loop {
            let item = match self.items.next() {
                Some(item) => item,
                None => match self.batches.next() {
                    None => return Ok(None),
                    Some(batch) => {
                        self.items = batch?.into_iter();
                        continue;
                    }
                },
            };
            let order = item.order();
            if self
                .previous
                .as_ref()
                .is_some_and(|previous| *previous >= order)
            {
                return Err(Stop::Unordered(format!(
                    "{}: row {} is not in key order",
                    self.file, self.row
                )));
            }
            self.previous = Some(order);
            let row = self.row;
            self.row += 1;
            if live
                .get(self.unit)
                .and_then(|flags| flags.get(row))
                .copied()
                .unwrap_or(false)
            {
                return Ok(Some(item));
            }
        }
    }
}

/// Where a merge's rows go, a batch at a time.
pub(crate) trait Sink<T> {
    fn write(&mut self, rows: &[T]) -> Result<()>;
    /// The finished shards (none when no row was written).
    fn finish(self) -> Result<Vec<ShardEntry>>;
}

/// Merges `runs` by key, writing the winning rows to `sink` `batch_rows` at a time.
pub(crate) fn merge<T: Keyed, S: Sink<T>>(
    runs: Vec<Run<'_, T>>,
    live: &[&[bool]],
    batch_rows: usize,
    mut sink: S,
) -> Flow<Vec<ShardEntry>> {
    let mut runs = runs;
    let mut heads: Vec<Option<T>> = Vec::with_capacity(runs.len());
    let mut heap: BinaryHeap<Reverse<(T::Order, usize)>> = BinaryHeap::new();
    for (index, run) in runs.iter_mut().enumerate() {
        let head = run.next_winner(live)?;
        if let Some(row) = &head {
            heap.push(Reverse((row.order(), index)));
        }
        heads.push(head);
    }
    let mut buffer: Vec<T> = Vec::with_capacity(batch_rows);
    while let Some(Reverse((_, index))) = heap.pop() {
        buffer.push(heads[index].take().expect("a run in the heap has a head"));
        if buffer.len() >= batch_rows {
            sink.write(&buffer)?;
            buffer.clear();
        }
        if let Some(row) = runs[index].next_winner(live)? {
            heap.push(Reverse((row.order(), index)));
            heads[index] = Some(row);
        }
    }
    if !buffer.is_empty() {
        sink.write(&buffer)?;
    }
    Ok(sink.finish()?)
}

/// A shard writer opened at the first batch (its schema comes with it).
struct Lazy<'p> {
    dir: &'p Path,
    table: &'static str,
    version: u64,
    part: Option<usize>,
    next_part: &'p mut dyn FnMut() -> usize,
    writer: Option<ShardWriter>,
}

impl<'p> Lazy<'p> {
    fn write(&mut self, batch: &arrow_array::RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        if self.writer.is_none() {
            let part = *self.part.get_or_insert_with(|| (self.next_part)());
            self.writer = Some(ShardWriter::create(
                self.dir,
                self.table,
                self.version,
                part,
                batch.schema(),
            )?);
        }
        self.writer.as_mut().expect("opened").write(batch)
    }

    fn finish(self) -> Result<Option<ShardEntry>> {
        self.writer.map(ShardWriter::finish).transpose()
    }
}

fn graph_error(dir: &Path, source: fluxmem_graph::Error) -> Error {
    Error::Graph {
        path: dir.to_path_buf(),
        source,
    }
}

/// Nodes and their steps, under one part number.
pub(crate) struct NodeSink<'p> {
    dir: &'p Path,
    nodes: Lazy<'p>,
    steps: Option<ShardWriter>,
}

impl<'p> NodeSink<'p> {
    pub(crate) fn new(
        dir: &'p Path,
        version: u64,
        next_part: &'p mut dyn FnMut() -> usize,
    ) -> Self {
        NodeSink {
            dir,
            nodes: Lazy {
                dir,
                table: "nodes",
                version,
                part: None,
                next_part,
                writer: None,
            },
            steps: None,
        }
    }
}

impl Sink<Node> for NodeSink<'_> {
    fn write(&mut self, rows: &[Node]) -> Result<()> {
        let (nodes, steps) =
            schema::nodes_to_batches(rows).map_err(|e| graph_error(self.dir, e))?;
        self.nodes.write(&nodes)?;
        if steps.num_rows() > 0 {
            if self.steps.is_none() {
                let part = self
                    .nodes
                    .part
                    .expect("the nodes shard opened with its first rows");
                self.steps = Some(ShardWriter::create(
                    self.dir,
                    "steps",
                    self.nodes.version,
                    part,
                    steps.schema(),
                )?);
            }
            self.steps.as_mut().expect("opened").write(&steps)?;
        }
        Ok(())
    }

    fn finish(self) -> Result<Vec<ShardEntry>> {
        let mut entries: Vec<ShardEntry> = self.nodes.finish()?.into_iter().collect();
        entries.extend(self.steps.map(ShardWriter::finish).transpose()?);
        Ok(entries)
    }
}

/// Edges.
pub(crate) struct EdgeSink<'p> {
    dir: &'p Path,
    edges: Lazy<'p>,
}

impl<'p> EdgeSink<'p> {
    pub(crate) fn new(
        dir: &'p Path,
        version: u64,
        next_part: &'p mut dyn FnMut() -> usize,
    ) -> Self {
        EdgeSink {
            dir,
            edges: Lazy {
                dir,
                table: "edges",
                version,
                part: None,
                next_part,
                writer: None,
            },
        }
    }
}

impl Sink<Edge> for EdgeSink<'_> {
    fn write(&mut self, rows: &[Edge]) -> Result<()> {
        let batch = schema::edges_to_batch(rows).map_err(|e| graph_error(self.dir, e))?;
        self.edges.write(&batch)
    }

    fn finish(self) -> Result<Vec<ShardEntry>> {
        Ok(self.edges.finish()?.into_iter().collect())
    }
}

/// Embeddings, a shard per model (a store holds one; the map keeps the rule of
/// [`crate::store::write_shards`]).
pub(crate) struct EmbeddingSink<'p> {
    dir: &'p Path,
    version: u64,
    next_part: &'p mut dyn FnMut() -> usize,
    by_model: BTreeMap<String, ShardWriter>,
}

impl<'p> EmbeddingSink<'p> {
    pub(crate) fn new(
        dir: &'p Path,
        version: u64,
        next_part: &'p mut dyn FnMut() -> usize,
    ) -> Self {
        EmbeddingSink {
            dir,
            version,
            next_part,
            by_model: BTreeMap::new(),
        }
    }
}

impl Sink<Embedding> for EmbeddingSink<'_> {
    fn write(&mut self, rows: &[Embedding]) -> Result<()> {
        let mut by_model: BTreeMap<&str, Vec<&Embedding>> = BTreeMap::new();
        for row in rows {
            by_model.entry(row.model_id.as_str()).or_default().push(row);
        }
        for (model, rows) in by_model {
            let batch = schema::embeddings_to_batch(rows[0].vector.len(), rows.iter().copied())
                .map_err(|e| graph_error(self.dir, e))?;
            if !self.by_model.contains_key(model) {
                let part = (self.next_part)();
                self.by_model.insert(
                    model.to_string(),
                    ShardWriter::create(
                        self.dir,
                        "embeddings",
                        self.version,
                        part,
                        batch.schema(),
                    )?,
                );
            }
            self.by_model
                .get_mut(model)
                .expect("opened")
                .write(&batch)?;
        }
        Ok(())
    }

    fn finish(self) -> Result<Vec<ShardEntry>> {
        self.by_model
            .into_values()
            .map(ShardWriter::finish)
            .collect()
    }
}

/// The decoded batches of an `edges` or `embeddings` shard.
pub(crate) fn rows_of<'a, T: 'a>(
    dir: &'a Path,
    entry: &ShardEntry,
    batch_rows: usize,
    decode: fn(&arrow_array::RecordBatch) -> fluxmem_graph::Result<Vec<T>>,
) -> Result<Box<dyn Iterator<Item = Flow<Vec<T>>> + 'a>> {
    let file = entry.file.clone();
    let batches = shard::open(dir, entry, None, batch_rows)?;
    Ok(Box::new(batches.map(move |batch| {
        let batch = batch?;
        decode(&batch).map_err(|e| {
            Stop::Failed(Error::Corrupt {
                path: dir.join(&file),
                reason: e.to_string(),
            })
        })
    })))
}

/// The nodes of a `nodes` shard with their steps from the `steps` shard of the same commit and
/// part, read alongside: before a batch of nodes is decoded, steps are read until one belongs
/// to a node past the batch's last id.
pub(crate) struct NodeRows<'a> {
    dir: &'a Path,
    nodes: Batches,
    nodes_file: String,
    steps: Option<Batches>,
    steps_file: String,
    pending: BTreeMap<NodeId, Vec<Step>>,
}

impl<'a> NodeRows<'a> {
    pub(crate) fn open(
        dir: &'a Path,
        nodes: &ShardEntry,
        steps: Option<&ShardEntry>,
        batch_rows: usize,
    ) -> Result<Self> {
        Ok(NodeRows {
            dir,
            nodes: shard::open(dir, nodes, None, batch_rows)?,
            nodes_file: nodes.file.clone(),
            steps: steps
                .map(|entry| shard::open(dir, entry, None, batch_rows))
                .transpose()?,
            steps_file: steps.map(|entry| entry.file.clone()).unwrap_or_default(),
            pending: BTreeMap::new(),
        })
    }

    fn corrupt(&self, file: &str, source: fluxmem_graph::Error) -> Stop {
        Stop::Failed(Error::Corrupt {
            path: self.dir.join(file),
            reason: source.to_string(),
        })
    }

    fn next_batch(&mut self) -> Flow<Option<Vec<Node>>> {
        let Some(batch) = self.nodes.next() else {
            let more_steps = match &mut self.steps {
                Some(steps) => steps.next().transpose()?.is_some_and(|b| b.num_rows() > 0),
                None => false,
            };
            if !self.pending.is_empty() || more_steps {
                return Err(Stop::Unordered(format!(
                    "{}: steps of episodes that {} does not hold in order",
                    self.steps_file, self.nodes_file
                )));
            }
            return Ok(None);
        };
        let batch = batch?;
        let ids = batch
            .column_by_name("id")
            .and_then(|c| c.as_string_opt::<i32>())
            .ok_or_else(|| {
                Stop::Failed(Error::Corrupt {
                    path: self.dir.join(&self.nodes_file),
                    reason: "column `id` is not text".into(),
                })
            })?;
        if ids.is_empty() {
            return Ok(Some(Vec::new()));
        }
        let last_id = ids.value(ids.len() - 1).to_string();
        while let Some(steps) = &mut self.steps {
            if self
                .pending
                .last_key_value()
                .is_some_and(|(id, _)| id.as_str() > last_id.as_str())
            {
                break;
            }
            match steps.next() {
                None => self.steps = None,
                Some(steps) => {
                    let steps = steps?;
                    if let Err(e) = schema::steps_from_batch(&steps, &mut self.pending) {
                        let file = self.steps_file.clone();
                        return Err(self.corrupt(&file, e));
                    }
                }
            }
        }
        // The steps of the nodes up to `last_id` are all read; they leave `pending` with them.
        let rest = self.pending.split_off(&NodeId(format!("{last_id}\0")));
        let claimed = std::mem::replace(&mut self.pending, rest);
        let nodes = match schema::nodes_from_batch(&batch, &claimed) {
            Ok(nodes) => nodes,
            Err(e) => {
                let file = self.nodes_file.clone();
                return Err(self.corrupt(&file, e));
            }
        };
        let held: std::collections::HashSet<&str> = (0..ids.len()).map(|i| ids.value(i)).collect();
        if let Some(orphan) = claimed.keys().find(|id| !held.contains(id.as_str())) {
            return Err(Stop::Unordered(format!(
                "{}: steps of `{orphan}` out of its nodes' order in {}",
                self.steps_file, self.nodes_file
            )));
        }
        Ok(Some(nodes))
    }
}

impl Iterator for NodeRows<'_> {
    type Item = Flow<Vec<Node>>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch().transpose()
    }
}

/// Concatenates `entries` (edit shards, in log order) into one shard, a batch at a time.
pub(crate) fn concatenate_edits(
    dir: &Path,
    entries: &[&ShardEntry],
    version: u64,
    next_part: &mut dyn FnMut() -> usize,
    batch_rows: usize,
) -> Result<Vec<ShardEntry>> {
    let mut out = Lazy {
        dir,
        table: "edits",
        version,
        part: None,
        next_part,
        writer: None,
    };
    for entry in entries {
        for batch in shard::open(dir, entry, None, batch_rows)? {
            let edits = schema::edits_from_batch(&batch?).map_err(|e| Error::Corrupt {
                path: dir.join(&entry.file),
                reason: e.to_string(),
            })?;
            out.write(&schema::edits_to_batch(&edits).map_err(|e| graph_error(dir, e))?)?;
        }
    }
    // Edit rows have no key: only this record lets recovery drop the inputs a crash left.
    if let Some(writer) = out.writer.as_mut() {
        let files: Vec<String> = entries.iter().map(|e| e.file.clone()).collect();
        writer.merged_from(&files);
    }
    Ok(out.finish()?.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluxmem_graph::EdgeKind;

    fn edge(src: &str, dst: &str, weight: f32) -> Edge {
        Edge {
            src: NodeId(src.into()),
            dst: NodeId(dst.into()),
            kind: EdgeKind::Link,
            weight,
            evidence: 1,
            stage: "t".into(),
            run_id: "r".into(),
            created_at: 0,
            active: true,
            metadata: BTreeMap::new(),
        }
    }

    /// A run over `batches` of unit `unit`.
    fn run(unit: usize, batches: Vec<Vec<Edge>>) -> Run<'static, Edge> {
        Run::new(
            unit,
            0,
            format!("unit-{unit}"),
            Box::new(batches.into_iter().map(Ok)),
        )
    }

    /// Keeps what it is given.
    struct Collect<'c>(&'c mut Vec<Vec<Edge>>);

    impl Sink<Edge> for Collect<'_> {
        fn write(&mut self, rows: &[Edge]) -> Result<()> {
            self.0.push(rows.to_vec());
            Ok(())
        }
        fn finish(self) -> Result<Vec<ShardEntry>> {
            Ok(Vec::new())
        }
    }

    /// The winners as the liveness pass would mark them: the last unit holding a key wins.
    fn winners(units: &[Vec<Edge>]) -> Vec<Vec<bool>> {
        let mut last = std::collections::HashMap::new();
        for (unit, rows) in units.iter().enumerate() {
            for (row, edge) in rows.iter().enumerate() {
                last.insert(edge.key(), (unit, row));
            }
        }
        let mut flags: Vec<Vec<bool>> = units.iter().map(|rows| vec![false; rows.len()]).collect();
        for (unit, row) in last.into_values() {
            flags[unit][row] = true;
        }
        flags
    }

    fn slices(flags: &[Vec<bool>]) -> Vec<&[bool]> {
        flags.iter().map(Vec::as_slice).collect()
    }

    #[test]
    fn merges_runs_by_key_keeping_only_the_winning_rows_in_batches() {
        let old = vec![
            edge("a", "x", 1.0),
            edge("b", "x", 1.0),
            edge("c", "x", 1.0),
            edge("e", "x", 1.0),
        ];
        let new = vec![
            edge("b", "x", 2.0),
            edge("d", "x", 2.0),
            edge("e", "x", 2.0),
        ];
        let last = winners(&[old.clone(), new.clone()]);
        // The old unit's rows come in two batches, split inside the run.
        let runs = vec![
            run(0, vec![old[..3].to_vec(), old[3..].to_vec()]),
            run(1, vec![new.clone()]),
        ];
        let mut written = Vec::new();
        let entries = merge(runs, &slices(&last), 2, Collect(&mut written))
            .map_err(|_| "merge stopped")
            .unwrap();
        assert!(entries.is_empty());
        let sizes: Vec<usize> = written.iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![2, 2, 1], "written two rows at a time");
        let rows: Vec<(String, f32)> = written
            .concat()
            .iter()
            .map(|e| (e.src.0.clone(), e.weight))
            .collect();
        let expected: Vec<(String, f32)> =
            [("a", 1.0), ("b", 2.0), ("c", 1.0), ("d", 2.0), ("e", 2.0)]
                .iter()
                .map(|(s, w)| (s.to_string(), *w))
                .collect();
        assert_eq!(rows, expected, "key order, the newest row of each key");
    }

    #[test]
    fn a_run_out_of_key_order_stops_the_merge() {
        let rows = vec![edge("b", "x", 1.0), edge("a", "x", 1.0)];
        let last = winners(std::slice::from_ref(&rows));
        let mut written = Vec::new();
        match merge(
            vec![run(0, vec![rows])],
            &slices(&last),
            8,
            Collect(&mut written),
        ) {
            Err(Stop::Unordered(reason)) => assert!(
                reason.contains("unit-0") && reason.contains("row 1"),
                "{reason}"
            ),
            Err(Stop::Failed(e)) => panic!("failed instead: {e}"),
            Ok(_) => panic!("an unordered run merged"),
        }
        // A row that loses its key is checked too: order is the run's, not the winners'.
        let rows = vec![edge("b", "x", 1.0), edge("a", "x", 1.0)];
        let last = winners(&[rows.clone(), vec![edge("a", "x", 2.0)]]);
        let stopped = merge(
            vec![run(0, vec![rows])],
            &slices(&last),
            8,
            Collect(&mut Vec::new()),
        );
        assert!(matches!(stopped, Err(Stop::Unordered(_))));
    }
}
