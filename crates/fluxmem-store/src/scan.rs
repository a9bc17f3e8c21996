//! Projected, filtered reads: a stage reads the tables, columns and rows it needs, not the
//! whole graph.

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use fluxmem_graph::{schema, Edge, EdgeKind, Embedding, Graph, GraphStats, NodeId, NodeKind, Step};
use std::collections::{BTreeMap, BTreeSet};

use crate::layout::MANIFEST;
use crate::manifest::{Manifest, ShardEntry};
use crate::{shard, Error, Result, Store};

/// Which rows of a table a [`Scan`] reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Rows {
    /// None of them (the table's shards are not opened).
    #[default]
    None,
    /// All of them.
    All,
    /// Those of these node ids (`steps`: the episode; `embeddings`: the node).
    Of(BTreeSet<NodeId>),
}

impl Rows {
    fn wants(&self) -> bool {
        !matches!(self, Rows::None)
    }
}

/// A scan's filter on ids, as the row filters ask it (once per row of every shard read):
/// the ids' strings in a hash set (foldhash: a fast hash of short strings), so a row costs a
/// hash and a comparison, not a walk down a tree of string comparisons.
enum Wanted<'a> {
    All,
    Of(std::collections::HashSet<&'a str, foldhash::fast::FixedState>),
    None,
}

impl<'a> Wanted<'a> {
    fn rows(rows: &'a Rows) -> Wanted<'a> {
        match rows {
            Rows::All => Wanted::All,
            Rows::Of(ids) => Wanted::set(ids),
            Rows::None => Wanted::None,
        }
    }

    /// The ids of `only`; every id when there is no filter.
    fn only(only: Option<&'a BTreeSet<NodeId>>) -> Wanted<'a> {
        only.map_or(Wanted::All, Wanted::set)
    }

    fn set(ids: &'a BTreeSet<NodeId>) -> Wanted<'a> {
        Wanted::Of(ids.iter().map(NodeId::as_str).collect())
    }

    /// True when the rows of `id` are read.
    fn contains(&self, id: &str) -> bool {
        match self {
            Wanted::All => true,
            Wanted::Of(ids) => ids.contains(id),
            Wanted::None => false,
        }
    }
}

/// What to read of the store. [`Scan::all`] is the whole graph ([`Store::load`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scan {
    /// Node rows (without their steps unless `steps` asks).
    pub nodes: bool,
    /// With `nodes`: only the rows of these ids (`None`: every row). Rows are filtered on the
    /// `id` column before any is decoded.
    pub nodes_of: Option<BTreeSet<NodeId>>,
    /// With `nodes`: only the nodes of these kinds (empty: every kind). Without `nodes_of`,
    /// rows are filtered on the `kind` column before any is decoded (export reads the skills,
    /// not the history's episodes).
    pub node_kinds: Vec<NodeKind>,
    /// The steps of episodes; an episode whose steps are not read has none in the result.
    pub steps: Rows,
    /// Edge rows.
    pub edges: bool,
    /// With `edges`: only the edges of these kinds (empty: every kind). Rows are filtered on
    /// the `kind` column before any is decoded.
    pub edge_kinds: Vec<EdgeKind>,
    /// With `edges`: only the edges from these node ids (`None`: every edge). Rows are
    /// filtered on the `src` column before any is decoded; the kinds are then checked on the
    /// rows that pass.
    pub edges_from: Option<BTreeSet<NodeId>>,
    /// With `edges`: only the edges to these node ids (`None`: every edge). Without
    /// `edges_from`, rows are filtered on the `dst` column before any is decoded; with it, the
    /// ends are checked on the rows that pass.
    pub edges_to: Option<BTreeSet<NodeId>>,
    /// Embedding rows with their vectors.
    pub vectors: Rows,
    /// Every embedding's key and text hash, without its vector (an empty `vector`), where
    /// `vectors` does not read the row whole. Reads three of the four columns.
    pub embedding_keys: bool,
    /// The edit log.
    pub edits: bool,
    /// With `edits`: only the records of these kinds (empty: every kind), in log order.
    pub edit_kinds: Vec<String>,
    /// Only rows of this tenant are wanted (the id filters above say which): a shard whose
    /// entry names its tenants and not this one is skipped unopened ([`ShardEntry::may_hold`]).
    pub tenant: Option<String>,
}

impl Scan {
    /// Everything.
    pub fn all() -> Scan {
        Scan {
            nodes: true,
            steps: Rows::All,
            edges: true,
            vectors: Rows::All,
            edits: true,
            ..Default::default()
        }
    }

    /// What one tenant's reader reads: its nodes with their steps, the edges from them and
    /// their vectors, filtered on the id columns before any row is decoded (`ids`: the
    /// tenant's node ids, from [`Store::tenant_node_ids`]), in the shards that may hold the
    /// tenant's rows.
    pub fn of_tenant(tenant: &str, ids: &BTreeSet<NodeId>) -> Scan {
        Scan {
            nodes: true,
            nodes_of: Some(ids.clone()),
            steps: Rows::Of(ids.clone()),
            edges: true,
            edges_from: Some(ids.clone()),
            vectors: Rows::Of(ids.clone()),
            tenant: Some(tenant.to_string()),
            ..Default::default()
        }
    }

    /// Node rows and edges, no steps, vectors or edits. (Credit assignment, which only folds
    /// over them, streams them instead: [`Store::live`].)
    pub fn nodes_and_edges() -> Scan {
        Scan {
            nodes: true,
            edges: true,
            ..Default::default()
        }
    }
}

impl Store {
    /// The whole graph of the current commit. A shard that cannot be read while the manifest
    /// has moved on (a compaction retired and, commits later, deleted it) makes the read start
    /// again from the new manifest; any other failure is returned.
    pub fn load(&self) -> Result<Graph> {
        self.scan(&Scan::all()).map(|(graph, _)| graph)
    }

    /// The whole graph of the commit `manifest` describes, every shard verified.
    pub fn load_at(&self, manifest: &Manifest) -> Result<Graph> {
        self.scan_at(manifest, &Scan::all())
    }

    /// Ids of all stored nodes (reads only the `id` column), held compactly ([`fluxmem_graph::IdSet`]:
    /// 16 bytes a content-addressed id).
    pub fn node_ids(&self, manifest: &Manifest) -> Result<fluxmem_graph::IdSet> {
        let mut ids = fluxmem_graph::IdSet::default();
        for entry in manifest.shards.iter().filter(|s| s.table == "nodes") {
            for batch in shard::batches(&self.dir, entry, Some(&["id"]))? {
                let batch = batch?;
                let column = batch.column(0);
                let strings = arrow_array::cast::AsArray::as_string::<i32>(column.as_ref());
                for id in strings.iter().flatten() {
                    ids.insert(id);
                }
            }
        }
        Ok(ids)
    }

    /// Counts of the current commit, with its manifest: from the manifest when its
    /// [`crate::LiveCounts`] hold for the commit, else counted from the shards
    /// ([`Store::count_live`]).
    pub fn stats(&self) -> Result<(GraphStats, Manifest)> {
        self.read_current(|manifest| {
            // Counts from the manifest alone would hide a lost shard: check the files are there.
            if let Some(gone) = manifest
                .shards
                .iter()
                .find(|s| !self.dir.join(&s.file).is_file())
            {
                return Err(Error::Corrupt {
                    path: self.dir.join(&gone.file),
                    reason: "shard listed in the manifest is missing; `fluxmem store recover` says what is lost and can commit a manifest without it (--accept-loss)".into(),
                });
            }
            match manifest.current_counts() {
                Some(stats) => Ok(stats),
                None => self.count_live(manifest),
            }
        })
    }

    /// Counts of the commit of `manifest`, from the shards: reads the key and kind columns of
    /// nodes, edges and embeddings (and edges' `active` and `metadata`), nothing else.
    pub fn count_live(&self, manifest: &Manifest) -> Result<GraphStats> {
        let embedded: BTreeSet<NodeId> = self
            .embedding_keys(manifest)?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        let active_edges = self
            .edge_heads(manifest)?
            .into_iter()
            .filter(|(_, head)| head.active)
            .map(|((_, _, kind), _)| kind);
        Ok(GraphStats::count(
            self.node_kinds(manifest)?.into_values(),
            active_edges,
            embedded.len(),
        ))
    }

    /// The part of the current commit's graph that `scan` asks for, read through column
    /// projection and row filters. A read that fails while the manifest has moved on (a
    /// compaction retired a shard and, its grace over, deleted it) starts again from the new
    /// manifest, as often as the manifest keeps moving; a failure at an unchanged manifest is
    /// returned (that is real damage).
    pub fn scan(&self, scan: &Scan) -> Result<(Graph, Manifest)> {
        self.read_current(|manifest| self.scan_at(manifest, scan))
    }

    /// Runs `read` on the current manifest; when it fails and the manifest has moved on
    /// meanwhile, runs it again on the new one, as often as the manifest keeps moving. The
    /// one place lock-free readers recover from a compaction deleting what they were reading.
    pub fn read_current<T>(
        &self,
        mut read: impl FnMut(&Manifest) -> Result<T>,
    ) -> Result<(T, Manifest)> {
        let mut manifest = self.manifest()?;
        loop {
            match read(&manifest) {
                Ok(value) => return Ok((value, manifest)),
                Err(error) => {
                    let now = self.manifest()?;
                    if now.version == manifest.version {
                        return Err(error);
                    }
                    manifest = now;
                }
            }
        }
    }

    /// [`Store::scan`] at the commit `manifest` describes.
    pub fn scan_at(&self, manifest: &Manifest, scan: &Scan) -> Result<Graph> {
        let mut graph = Graph::default();
        let commits: BTreeSet<u64> = manifest.shards.iter().map(|s| s.commit).collect();
        let edge_kinds: Vec<&str> = scan.edge_kinds.iter().map(|k| k.as_str()).collect();
        let node_kinds: Vec<&str> = scan.node_kinds.iter().map(|k| k.as_str()).collect();
        let edit_kinds: Vec<&str> = scan.edit_kinds.iter().map(String::as_str).collect();
        let steps_of = Wanted::rows(&scan.steps);
        let nodes_of = Wanted::only(scan.nodes_of.as_ref());
        let edges_from = Wanted::only(scan.edges_from.as_ref());
        let edges_to = Wanted::only(scan.edges_to.as_ref());
        let vectors_of = Wanted::rows(&scan.vectors);
        let wanted = |s: &ShardEntry| scan.tenant.as_deref().is_none_or(|t| s.may_hold(t));
        for commit in commits {
            let shards: Vec<&ShardEntry> = manifest
                .shards
                .iter()
                .filter(|s| s.commit == commit && wanted(s))
                .collect();
            let mut steps: BTreeMap<NodeId, Vec<Step>> = BTreeMap::new();
            if scan.nodes && scan.steps.wants() {
                for entry in shards.iter().filter(|s| s.table == "steps") {
                    let of = |v: &str| steps_of.contains(v);
                    let only = matches!(scan.steps, Rows::Of(_))
                        .then_some(("episode_id", &of as &dyn Fn(&str) -> bool));
                    for batch in self.rows_where(entry, only)? {
                        let batch = batch?;
                        schema::steps_from_batch(&batch, &mut steps)
                            .map_err(|e| self.corrupt(entry, e.to_string()))?;
                    }
                }
            }
            for entry in shards {
                match entry.table.as_str() {
                    "steps" => {}
                    "nodes" if scan.nodes => {
                        let steps_read = |id: &NodeId| steps_of.contains(id.as_str());
                        let of_ids = |v: &str| nodes_of.contains(v);
                        let of_kinds = |v: &str| node_kinds.contains(&v);
                        let only = match (&scan.nodes_of, node_kinds.is_empty()) {
                            (Some(_), _) => Some(("id", &of_ids as &dyn Fn(&str) -> bool)),
                            (None, false) => Some(("kind", &of_kinds as &dyn Fn(&str) -> bool)),
                            (None, true) => None,
                        };
                        for batch in self.rows_where(entry, only)? {
                            let batch = batch?;
                            let nodes = schema::nodes_from_batch_with(&batch, &steps, &steps_read)
                                .map_err(|e| self.corrupt(entry, e.to_string()))?;
                            // Filtered on `id`, the kinds are left to check (a node's id fixes its kind).
                            let kinds_left = scan.nodes_of.is_some() && !scan.node_kinds.is_empty();
                            nodes
                                .into_iter()
                                .filter(|n| !kinds_left || scan.node_kinds.contains(&n.kind()))
                                .for_each(|n| graph.upsert_node(n));
                        }
                    }
                    "edges" if scan.edges => {
                        let of_kinds = |v: &str| edge_kinds.contains(&v);
                        let from = |v: &str| edges_from.contains(v);
                        let to = |v: &str| edges_to.contains(v);
                        let only = match (&scan.edges_from, &scan.edges_to) {
                            (Some(_), _) => Some(("src", &from as &dyn Fn(&str) -> bool)),
                            (None, Some(_)) => Some(("dst", &to as &dyn Fn(&str) -> bool)),
                            (None, None) if !edge_kinds.is_empty() => {
                                Some(("kind", &of_kinds as &dyn Fn(&str) -> bool))
                            }
                            (None, None) => None,
                        };
                        // What the row filter did not check is checked on the decoded rows.
                        let wanted = |e: &Edge| {
                            edges_from.contains(e.src.as_str())
                                && edges_to.contains(e.dst.as_str())
                                && (edge_kinds.is_empty() || scan.edge_kinds.contains(&e.kind))
                        };
                        for batch in self.rows_where(entry, only)? {
                            let batch = batch?;
                            let edges = schema::edges_from_batch(&batch)
                                .map_err(|e| self.corrupt(entry, e.to_string()))?;
                            edges
                                .into_iter()
                                .filter(wanted)
                                .for_each(|e| graph.upsert_edge(e));
                        }
                    }
                    "edits" if scan.edits => {
                        let of = |v: &str| edit_kinds.contains(&v);
                        for batch in self.rows_where(
                            entry,
                            (!edit_kinds.is_empty())
                                .then_some(("kind", &of as &dyn Fn(&str) -> bool)),
                        )? {
                            let batch = batch?;
                            graph.edits.extend(
                                schema::edits_from_batch(&batch)
                                    .map_err(|e| self.corrupt(entry, e.to_string()))?,
                            );
                        }
                    }
                    "embeddings" if scan.vectors.wants() || scan.embedding_keys => {
                        self.scan_embeddings(entry, scan, &vectors_of, &mut graph)?
                    }
                    "nodes" | "edges" | "edits" | "embeddings" => {}
                    other => {
                        return Err(Error::Corrupt {
                            path: self.dir.join(MANIFEST),
                            reason: format!("unknown table `{other}` for {}", entry.file),
                        })
                    }
                }
            }
        }
        Ok(graph)
    }

    /// Every live edge's key with whether it is active and whether its metadata names a
    /// `relation` (Stage II links), reading five of the ten columns and decoding no weights,
    /// runs, times or metadata maps.
    pub fn edge_heads(
        &self,
        manifest: &Manifest,
    ) -> Result<BTreeMap<(NodeId, NodeId, EdgeKind), EdgeHead>> {
        let mut heads = BTreeMap::new();
        let columns = ["src", "dst", "kind", "active", "metadata"];
        for entry in sorted(manifest, "edges") {
            for batch in shard::batches(&self.dir, &entry, Some(&columns))? {
                let batch = batch?;
                let text = |name: &str| text_column(self, &entry, &batch, name);
                let (src, dst, kind, metadata) =
                    (text("src")?, text("dst")?, text("kind")?, text("metadata")?);
                let active = batch
                    .column_by_name("active")
                    .and_then(|c| c.as_boolean_opt())
                    .ok_or_else(|| self.corrupt(&entry, "column `active` is not boolean".into()))?;
                for row in 0..batch.num_rows() {
                    let kind = EdgeKind::parse(kind.value(row)).ok_or_else(|| {
                        self.corrupt(
                            &entry,
                            format!("row {row}: unknown edge kind `{}`", kind.value(row)),
                        )
                    })?;
                    let head = EdgeHead {
                        active: !active.is_null(row) && active.value(row),
                        relation: names_relation(metadata.value(row)),
                    };
                    heads.insert(
                        (
                            NodeId(src.value(row).to_string()),
                            NodeId(dst.value(row).to_string()),
                            kind,
                        ),
                        head,
                    );
                }
            }
        }
        Ok(heads)
    }

    /// The nodes the edit records of `kind` target, in log order (one per record; the edit
    /// log's kind column first, then only those records).
    pub fn edited_nodes(&self, manifest: &Manifest, kind: &str) -> Result<Vec<NodeId>> {
        let scan = Scan {
            edits: true,
            edit_kinds: vec![kind.to_string()],
            ..Default::default()
        };
        Ok(self
            .scan_at(manifest, &scan)?
            .edits
            .iter()
            .filter_map(|e| e.target.strip_prefix("node:"))
            .map(NodeId::from)
            .collect())
    }

    /// Live node ids with their tenant (two columns of `nodes`): what a reader of one tenant
    /// needs to know which rows to read.
    pub fn node_tenants(&self, manifest: &Manifest) -> Result<BTreeMap<NodeId, String>> {
        let mut tenants = BTreeMap::new();
        for entry in sorted(manifest, "nodes") {
            for batch in shard::batches(&self.dir, &entry, Some(&["id", "tenant"]))? {
                let batch = batch?;
                let (ids, tenant) = (
                    text_column(self, &entry, &batch, "id")?,
                    text_column(self, &entry, &batch, "tenant")?,
                );
                for row in 0..batch.num_rows() {
                    tenants.insert(
                        NodeId(ids.value(row).to_string()),
                        tenant.value(row).to_string(),
                    );
                }
            }
        }
        Ok(tenants)
    }

    /// Ids of the live nodes of `tenant` whose kind is one of `kinds` (every kind when empty),
    /// in one pass over three columns of `nodes` (id, tenant, kind), in the shards that may
    /// hold the tenant's rows ([`ShardEntry::may_hold`]): other tenants' ids are never kept.
    pub fn tenant_node_ids(
        &self,
        manifest: &Manifest,
        tenant: &str,
        kinds: &[NodeKind],
    ) -> Result<BTreeSet<NodeId>> {
        Ok(self
            .tenant_nodes(manifest, tenant)?
            .into_iter()
            .filter(|(_, kind)| kinds.is_empty() || kinds.contains(kind))
            .map(|(id, _)| id)
            .collect())
    }

    /// The live nodes of `tenant` with their kind, as [`Store::tenant_node_ids`] reads them.
    pub(crate) fn tenant_nodes(
        &self,
        manifest: &Manifest,
        tenant: &str,
    ) -> Result<BTreeMap<NodeId, NodeKind>> {
        let mut nodes = BTreeMap::new();
        for entry in sorted(manifest, "nodes")
            .into_iter()
            .filter(|s| s.may_hold(tenant))
        {
            for batch in shard::batches(&self.dir, &entry, Some(&["id", "tenant", "kind"]))? {
                let batch = batch?;
                let (id, owner, kind) = (
                    text_column(self, &entry, &batch, "id")?,
                    text_column(self, &entry, &batch, "tenant")?,
                    text_column(self, &entry, &batch, "kind")?,
                );
                for row in 0..batch.num_rows() {
                    if owner.value(row) != tenant {
                        continue;
                    }
                    let parsed = NodeKind::parse(kind.value(row)).ok_or_else(|| {
                        self.corrupt(
                            &entry,
                            format!("row {row}: unknown node kind `{}`", kind.value(row)),
                        )
                    })?;
                    nodes.insert(NodeId(id.value(row).to_string()), parsed);
                }
            }
        }
        Ok(nodes)
    }

    /// Live node ids with their kind (two columns of `nodes`).
    pub fn node_kinds(&self, manifest: &Manifest) -> Result<BTreeMap<NodeId, NodeKind>> {
        let mut kinds = BTreeMap::new();
        for entry in sorted(manifest, "nodes") {
            for batch in shard::batches(&self.dir, &entry, Some(&["id", "kind"]))? {
                let batch = batch?;
                let (ids, kind) = (
                    text_column(self, &entry, &batch, "id")?,
                    text_column(self, &entry, &batch, "kind")?,
                );
                for row in 0..batch.num_rows() {
                    let parsed = NodeKind::parse(kind.value(row)).ok_or_else(|| {
                        self.corrupt(
                            &entry,
                            format!("row {row}: unknown node kind `{}`", kind.value(row)),
                        )
                    })?;
                    kinds.insert(NodeId(ids.value(row).to_string()), parsed);
                }
            }
        }
        Ok(kinds)
    }

    /// Live embedding keys (node id, model id), two columns of `embeddings`.
    pub fn embedding_keys(&self, manifest: &Manifest) -> Result<BTreeSet<(NodeId, String)>> {
        let mut keys = BTreeSet::new();
        for entry in sorted(manifest, "embeddings") {
            for batch in shard::batches(&self.dir, &entry, Some(&["node_id", "model_id"]))? {
                let batch = batch?;
                let (ids, models) = (
                    text_column(self, &entry, &batch, "node_id")?,
                    text_column(self, &entry, &batch, "model_id")?,
                );
                for row in 0..batch.num_rows() {
                    keys.insert((
                        NodeId(ids.value(row).to_string()),
                        models.value(row).to_string(),
                    ));
                }
            }
        }
        Ok(keys)
    }

    fn scan_embeddings(
        &self,
        entry: &ShardEntry,
        scan: &Scan,
        vectors_of: &Wanted<'_>,
        graph: &mut Graph,
    ) -> Result<()> {
        if scan.vectors == Rows::All || !scan.embedding_keys {
            // Whole rows only (all of them, or the filtered ones).
            let of = |v: &str| vectors_of.contains(v);
            let only = matches!(scan.vectors, Rows::Of(_))
                .then_some(("node_id", &of as &dyn Fn(&str) -> bool));
            for batch in self.rows_where(entry, only)? {
                let batch = batch?;
                let embeddings = schema::embeddings_from_batch(&batch)
                    .map_err(|e| self.corrupt(entry, e.to_string()))?;
                embeddings
                    .into_iter()
                    .for_each(|e| graph.upsert_embedding(e));
            }
            return Ok(());
        }
        // Keys of every row; the vectors of the rows asked for whole.
        let columns = ["node_id", "model_id", "text_sha256"];
        let mut wanted = BTreeSet::new();
        for batch in shard::batches(&self.dir, entry, Some(&columns))? {
            let batch = batch?;
            let strings: Vec<_> = columns
                .iter()
                .map(|name| text_column(self, entry, &batch, name))
                .collect::<Result<_>>()?;
            for row in 0..batch.num_rows() {
                let node_id = strings[0].value(row);
                if vectors_of.contains(node_id) {
                    wanted.insert(NodeId(node_id.to_string()));
                }
                graph.upsert_embedding(Embedding {
                    node_id: NodeId(node_id.to_string()),
                    model_id: strings[1].value(row).to_string(),
                    text_sha256: strings[2].value(row).to_string(),
                    vector: Vec::new(),
                });
            }
        }
        if !wanted.is_empty() {
            for batch in self.rows_where(entry, Some(("node_id", &|v: &str| wanted.contains(v))))? {
                let batch = batch?;
                let embeddings = schema::embeddings_from_batch(&batch)
                    .map_err(|e| self.corrupt(entry, e.to_string()))?;
                embeddings
                    .into_iter()
                    .for_each(|e| graph.upsert_embedding(e));
            }
        }
        Ok(())
    }

    /// The batches of the shard `entry`: every row, or with `only = (column, keep)` the rows
    /// whose text `column` passes `keep`, the other columns decoded for those rows only.
    #[allow(clippy::type_complexity)] // the column filter and the batches' iterator, both spelled out
    fn rows_where(
        &self,
        entry: &ShardEntry,
        only: Option<(&str, &dyn Fn(&str) -> bool)>,
    ) -> Result<std::iter::Flatten<std::option::IntoIter<shard::Batches>>> {
        let batches = match only {
            None => Some(shard::batches(&self.dir, entry, None)?),
            Some((column, keep)) => shard::select(&self.dir, entry, column, keep)?,
        };
        Ok(batches.into_iter().flatten())
    }

    pub(crate) fn corrupt(&self, entry: &ShardEntry, reason: String) -> Error {
        Error::Corrupt {
            path: self.dir.join(&entry.file),
            reason,
        }
    }
}

/// What [`Store::edge_heads`] tells of an edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeHead {
    /// The edge is active.
    pub active: bool,
    /// Its metadata has a `relation` (a Stage II link: expand, prune, failure-success).
    pub relation: bool,
}

/// Whether an edge's metadata (JSON text) names a `relation` (a Stage II link), parsed only
/// when the key may be there.
pub(crate) fn names_relation(metadata: &str) -> bool {
    metadata.contains("\"relation\"")
        && serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(metadata)
            .map(|m| m.contains_key("relation"))
            .unwrap_or(false)
}

/// The shards of `table` in commit order (later rows win).
pub(crate) fn sorted(manifest: &Manifest, table: &str) -> Vec<ShardEntry> {
    let mut entries: Vec<ShardEntry> = manifest
        .shards
        .iter()
        .filter(|s| s.table == table)
        .cloned()
        .collect();
    entries.sort_by(|a, b| (a.commit, &a.file).cmp(&(b.commit, &b.file)));
    entries
}

/// The text column `name` of a shard's batch.
pub(crate) fn text_column<'b>(
    store: &Store,
    entry: &ShardEntry,
    batch: &'b RecordBatch,
    name: &str,
) -> Result<&'b arrow_array::StringArray> {
    batch
        .column_by_name(name)
        .and_then(|c| c.as_string_opt::<i32>())
        .ok_or_else(|| store.corrupt(entry, format!("column `{name}` is not text")))
}
