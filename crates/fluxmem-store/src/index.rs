//! Tenant vector indexes: what a query of one tenant needs to rank, in one file.
//!
//! A query ranks its tenant's episodes by the cosine of their vectors and its semantic nodes
//! by BM25 and cosine. Read from the shards, that is every episode row and every vector of the
//! tenant, decoded and inserted into a graph, on every query: at 100,000 episodes, seconds.
//! The night writes instead, per tenant and embedding model, `indexes/<name>.fxvi` (format in
//! [`file`]): one block per indexed kind ([`INDEXED_KINDS`]), each live node of the tenant of
//! that kind in id order (the order a graph holds them) with its vector of the model (the
//! episodes' stored normalised, as a query ranks them), or among the unembedded; then, for each
//! episode, the edges a query reads of it ([`EPISODE_EDGES`]). The manifest lists the file
//! ([`IndexEntry`]: its size, CRC-32, format and the version whose rows it holds); it is used
//! only while current ([`Manifest::current_index`]), so a commit of the tenant's nodes, vectors
//! or edges invalidates it and a reader falls back to the shards.
//!
//! A query maps the file ([`Store::map_index`]): it ranks the episodes from the vectors in
//! place, reads the edges of the ones it keeps, and opens no edge shard and no episode it
//! does not return.
//!
//! [`Writer::update_indexes`] brings indexes up to date under the writer lock. A tenant whose
//! index is current costs nothing; one whose index is stale is read again from the shards the
//! commits after it added (the previous file, plus those rows), unless a compaction merged
//! its older rows with newer ones, and then from all of its shards. The replaced file is
//! retired like a compacted shard (deleted two commits and a grace period later). An index
//! file is derived data: one that no manifest lists, or a temporary one, is garbage of this
//! module's own ([`sweep`]).

mod edges;
mod file;

pub use edges::{EpisodeEdges, EpisodeEnd, EPISODE_EDGES};
pub use file::MappedIndex;

use fluxmem_graph::{Edge, NodeId, NodeKind};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;

use crate::error::IoContext;
use crate::layout::{sync_dir, INDEXES};
use crate::manifest::{IndexEntry, LiveCounts, Manifest, INDEXED_TABLES, INDEX_FORMAT};
use crate::scan::{Rows, Scan};
use crate::store::{CommitInfo, Store, Writer};
use crate::{Error, Result};

/// The node kinds a tenant index holds: the ones a query ranks by vector.
pub const INDEXED_KINDS: [NodeKind; 2] = [NodeKind::Episodic, NodeKind::Semantic];

/// One kind's nodes of a tenant, with their vectors of one model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VectorBlock {
    /// The embedded nodes, in id order.
    pub ids: Vec<NodeId>,
    /// Their vectors, row after row (`ids.len() x dim`): normalised for the episodes, as
    /// embedded for the other kinds.
    pub vectors: Vec<f32>,
    /// The nodes without a vector of the model, in id order.
    pub unembedded: Vec<NodeId>,
}

/// A tenant's index: a [`VectorBlock`] per indexed kind.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantIndex {
    /// The tenant.
    pub tenant: String,
    /// The embedding model.
    pub model: String,
    /// The vectors' dimension (0 when no node is embedded).
    pub dim: usize,
    /// The blocks, by kind.
    pub blocks: BTreeMap<NodeKind, VectorBlock>,
    /// The edges of the episodic block's nodes (its rows, then its unembedded).
    pub edges: EpisodeEdges,
}

impl TenantIndex {
    /// The block of `kind` (empty when the tenant has no such node).
    pub fn block(&self, kind: NodeKind) -> &VectorBlock {
        static EMPTY: VectorBlock = VectorBlock {
            ids: Vec::new(),
            vectors: Vec::new(),
            unembedded: Vec::new(),
        };
        self.blocks.get(&kind).unwrap_or(&EMPTY)
    }

    /// The edges of `episodes` ([`EPISODE_EDGES`]) that the index holds; an id that is not one
    /// of the tenant's episodes has none. An error says what in the file is wrong.
    pub fn edges_of(&self, episodes: &BTreeSet<NodeId>) -> std::result::Result<Vec<Edge>, String> {
        let block = self.block(NodeKind::Episodic);
        let rows = (&block.ids[..], &block.unembedded[..]);
        self.edges
            .view()
            .of_episodes(episodes, rows, NodeId::as_str)
    }

    /// The episodic block's nodes in the order the edges are kept: its rows, then its
    /// unembedded.
    fn episodes(&self) -> impl Iterator<Item = &NodeId> {
        let block = self.block(NodeKind::Episodic);
        block.ids.iter().chain(&block.unembedded)
    }
}

/// How [`Writer::update_indexes`] brought one tenant's index up to date.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexHow {
    /// It was current: nothing read.
    Current,
    /// From the previous index and the rows committed after it.
    Added,
    /// From every shard of the tenant.
    Full,
}

/// What [`Writer::update_indexes`] did for one tenant.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct IndexUpdate {
    /// The tenant.
    pub tenant: String,
    /// How.
    pub how: IndexHow,
    /// Nodes with a vector of the model, all kinds (0 for a current index, which is not read).
    pub rows: usize,
    /// Nodes of the indexed kinds without a vector of the model, besides `rows`.
    pub unembedded: usize,
    /// Edges kept with the episodes (0 for a current index).
    pub edges: usize,
    /// The file's size.
    pub bytes: u64,
}

impl Store {
    /// The current index of `tenant` for `model` ([`Manifest::current_index`]), read and
    /// checked whole; `None` when there is none. A damaged file is [`Error::Corrupt`].
    pub fn read_index(
        &self,
        manifest: &Manifest,
        tenant: &str,
        model: &str,
    ) -> Result<Option<TenantIndex>> {
        match manifest.current_index(tenant, model) {
            Some(entry) => self.read_index_file(entry).map(Some),
            None => Ok(None),
        }
    }

    /// The current index of `tenant` for `model`, mapped for one query ([`MappedIndex`]: its
    /// head checked, each episode's edges checked when read); `None` when there is none. A
    /// damaged file is [`Error::Corrupt`].
    pub fn map_index(
        &self,
        manifest: &Manifest,
        tenant: &str,
        model: &str,
    ) -> Result<Option<MappedIndex>> {
        let Some(entry) = manifest.current_index(tenant, model) else {
            return Ok(None);
        };
        let (file, corrupt) = self.open_index(entry)?;
        let index = MappedIndex::map(&file).map_err(&corrupt)?;
        holds(entry, (index.tenant(), index.model())).map_err(corrupt)?;
        Ok(Some(index))
    }

    /// The file of `entry`, open and of the size the manifest says, with what makes a reason
    /// an error naming the file and the fix.
    fn open_index(
        &self,
        entry: &IndexEntry,
    ) -> Result<(std::fs::File, impl Fn(String) -> Error + use<'_>)> {
        let path = self.dir.join(&entry.file);
        let (shown, tenant) = (path.clone(), entry.tenant.clone());
        let corrupt = move |reason: String| Error::Corrupt {
            path: shown.clone(),
            reason: format!(
                "{reason}; `fluxmem store index --rebuild --tenant {tenant}` writes it again"
            ),
        };
        let file = std::fs::File::open(&path).map_err(|e| corrupt(format!("cannot open: {e}")))?;
        let size = file.metadata().at(&path)?.len();
        if size != entry.bytes {
            return Err(corrupt(format!(
                "{size} bytes, the manifest says {}",
                entry.bytes
            )));
        }
        Ok((file, corrupt))
    }

    /// The index file of `entry`, read whole (mapped, then copied into the owned form) and
    /// checked against its CRC-32.
    fn read_index_file(&self, entry: &IndexEntry) -> Result<TenantIndex> {
        let (file, corrupt) = self.open_index(entry)?;
        let bytes = file::map(&file).map_err(&corrupt)?;
        let crc = crc32fast::hash(&bytes);
        if crc != entry.crc32 {
            return Err(corrupt(format!(
                "CRC-32 {crc:08x}, the manifest says {:08x}",
                entry.crc32
            )));
        }
        let layout = file::Layout::parse(&bytes).map_err(&corrupt)?;
        holds(entry, (&layout.tenant, &layout.model)).map_err(corrupt)?;
        Ok(layout.owned(&bytes))
    }

    /// The tenants of the live nodes of `manifest`: those its `nodes` shards name, and those
    /// of the rows of the shards that name none.
    pub fn tenants(&self, manifest: &Manifest) -> Result<BTreeSet<String>> {
        let mut tenants = BTreeSet::new();
        let mut unnamed = Vec::new();
        for shard in manifest.shards.iter().filter(|s| s.table == "nodes") {
            match &shard.tenants {
                Some(named) => tenants.extend(named.iter().cloned()),
                None => unnamed.push(shard.clone()),
            }
        }
        if !unnamed.is_empty() {
            let cut = Manifest {
                shards: unnamed,
                ..manifest.clone()
            };
            tenants.extend(self.node_tenants(&cut)?.into_values());
        }
        Ok(tenants)
    }

    /// The index of `tenant` for `model` at `manifest`, from its shards; with `previous` (its
    /// index at an older version), from that index and the shards committed after it.
    fn build_index(
        &self,
        manifest: &Manifest,
        tenant: &str,
        model: &str,
        previous: Option<(u64, TenantIndex)>,
    ) -> Result<TenantIndex> {
        let corrupt = |reason: String| Error::Corrupt {
            path: self.dir.join(crate::layout::SHARDS),
            reason,
        };
        let (read, mut nodes, mut edges) = match previous {
            Some((version, index)) => {
                let episodes: Vec<NodeId> = index.episodes().cloned().collect();
                let edges =
                    edges::Gathered::from_file(&index.edges, &episodes).map_err(|reason| {
                        Error::Corrupt {
                            path: self.dir.join(INDEXES),
                            reason: format!("the previous index of tenant `{tenant}`: {reason}"),
                        }
                    })?;
                let read = manifest.since(version, &INDEXED_TABLES).added;
                (read, working(index), edges)
            }
            None => (manifest.clone(), BTreeMap::new(), Default::default()),
        };
        // Nodes first: a node written again keeps the vector it had unless a newer one comes.
        for (id, kind) in self.tenant_nodes(&read, tenant)? {
            let vector = nodes.remove(&id).and_then(|(_, v)| v);
            if INDEXED_KINDS.contains(&kind) {
                nodes.insert(id, (kind, vector));
            }
        }
        let ids: BTreeSet<NodeId> = nodes.keys().cloned().collect();
        let scan = Scan {
            vectors: Rows::Of(ids),
            tenant: Some(tenant.to_string()),
            ..Default::default()
        };
        for ((id, of), mut embedding) in self.scan_at(&read, &scan)?.embeddings {
            if of == model {
                if let Some((kind, vector)) = nodes.get_mut(&id) {
                    if file::normalised(*kind) {
                        fluxmem_graph::normalize(&mut embedding.vector);
                    }
                    *vector = Some(embedding.vector);
                }
            }
        }
        // Edges after nodes: every stage commits an edge with or after its ends, so the rows
        // added after the previous index hold every edge of an episode added after it.
        let episode = |id: &NodeId| matches!(nodes.get(id), Some((NodeKind::Episodic, _)));
        self.gather_edges(&read, tenant, &episode, &mut edges)?;
        let mut index = blocks_of(tenant, model, nodes).map_err(corrupt)?;
        index.edges = edges.finish(index.episodes());
        Ok(index)
    }

    /// Adds to `gathered` the episode edges ([`EPISODE_EDGES`]) of `tenant`'s shards in
    /// `manifest` whose episode end passes `episode` (the tenant's: a shard may hold other
    /// tenants' rows too), one shard at a time in commit order (later rows win), so that no
    /// more than one shard's edges are decoded at once.
    fn gather_edges(
        &self,
        manifest: &Manifest,
        tenant: &str,
        episode: &dyn Fn(&NodeId) -> bool,
        gathered: &mut edges::Gathered,
    ) -> Result<()> {
        let scan = Scan {
            edges: true,
            edge_kinds: EPISODE_EDGES.iter().map(|(kind, _)| *kind).collect(),
            tenant: Some(tenant.to_string()),
            ..Default::default()
        };
        let mut one = Manifest {
            shards: Vec::new(),
            ..manifest.clone()
        };
        for shard in crate::scan::sorted(manifest, "edges") {
            if shard.may_hold(tenant) {
                one.shards = vec![shard];
                for edge in self.scan_at(&one, &scan)?.edges.values() {
                    gathered.upsert(edge, episode);
                }
            }
        }
        Ok(())
    }
}

/// An index's nodes by id, with their kind and vector (`None`: unembedded).
type Working = BTreeMap<NodeId, (NodeKind, Option<Vec<f32>>)>;

fn working(index: TenantIndex) -> Working {
    let mut nodes = Working::new();
    let dim = index.dim.max(1);
    for (kind, block) in index.blocks {
        for (id, vector) in block.ids.into_iter().zip(block.vectors.chunks_exact(dim)) {
            nodes.insert(id, (kind, Some(vector.to_vec())));
        }
        for id in block.unembedded {
            nodes.insert(id, (kind, None));
        }
    }
    nodes
}

/// The blocks of `nodes`, in id order; an error when two vectors differ in length.
fn blocks_of(
    tenant: &str,
    model: &str,
    nodes: Working,
) -> std::result::Result<TenantIndex, String> {
    let dim = nodes
        .values()
        .find_map(|(_, v)| v.as_ref().map(Vec::len))
        .unwrap_or(0);
    let mut blocks: BTreeMap<NodeKind, VectorBlock> = BTreeMap::new();
    for (id, (kind, vector)) in nodes {
        let block = blocks.entry(kind).or_default();
        match vector {
            Some(vector) if vector.len() == dim => {
                block.ids.push(id);
                block.vectors.extend_from_slice(&vector);
            }
            Some(vector) => {
                return Err(format!(
                    "node {id}: a `{model}` vector of {} values, others have {dim}",
                    vector.len()
                ))
            }
            None => block.unembedded.push(id),
        }
    }
    Ok(TenantIndex {
        tenant: tenant.to_string(),
        model: model.to_string(),
        dim,
        blocks,
        edges: EpisodeEdges::default(),
    })
}

impl Writer {
    /// Brings the indexes of `tenants` (every tenant of the store when `None`) for `model` up
    /// to date in one commit (none when all are current): a current index is kept unread; a
    /// stale one is made again from the previous index and the shards committed after it, or
    /// from all of the tenant's shards when a compaction mixed its older rows with newer ones
    /// (or there is no previous index, or it cannot be read). Replaced files are retired.
    ///
    /// With `rebuild`, every index is made again from all of its tenant's shards, current or
    /// not (a current index whose file was damaged).
    pub fn update_indexes(
        &mut self,
        model: &str,
        tenants: Option<&[String]>,
        rebuild: bool,
        run_id: &str,
        progress: &mut dyn FnMut(&IndexUpdate),
    ) -> Result<Vec<IndexUpdate>> {
        self.check_not_staging("indexing")?;
        self.sweep_indexes()?;
        let manifest = self.manifest().clone();
        let store = self.store().clone();
        let tenants: BTreeSet<String> = match tenants {
            Some(named) => named.iter().cloned().collect(),
            None => store.tenants(&manifest)?,
        };
        let version = manifest.version;
        let mut updates = Vec::new();
        let mut written: Vec<IndexEntry> = Vec::new();
        for tenant in &tenants {
            // A current index whose file is gone or of another size is made again.
            let current = (!rebuild)
                .then(|| manifest.current_index(tenant, model))
                .flatten()
                .filter(|e| file_size(store.dir(), e) == Some(e.bytes));
            let update = match current {
                Some(entry) => IndexUpdate {
                    tenant: tenant.clone(),
                    how: IndexHow::Current,
                    rows: 0,
                    unembedded: 0,
                    edges: 0,
                    bytes: entry.bytes,
                },
                None => {
                    let previous = (!rebuild)
                        .then(|| previous_index(&store, &manifest, tenant, model))
                        .flatten();
                    let how = match previous {
                        Some(_) => IndexHow::Added,
                        None => IndexHow::Full,
                    };
                    let index = store.build_index(&manifest, tenant, model, previous)?;
                    let entry = write_index(store.dir(), &index, version)?;
                    let update = IndexUpdate {
                        tenant: tenant.clone(),
                        how,
                        rows: index.blocks.values().map(|b| b.ids.len()).sum(),
                        unembedded: index.blocks.values().map(|b| b.unembedded.len()).sum(),
                        edges: index.edges.len(),
                        bytes: entry.bytes,
                    };
                    written.push(entry);
                    update
                }
            };
            progress(&update);
            updates.push(update);
        }
        if !written.is_empty() {
            self.commit_indexes(written, model, run_id, &updates)?;
        }
        Ok(updates)
    }

    /// Lands a manifest that lists `written` in place of the same tenants' entries for the
    /// model, whose files are retired.
    fn commit_indexes(
        &mut self,
        written: Vec<IndexEntry>,
        model: &str,
        run_id: &str,
        updates: &[IndexUpdate],
    ) -> Result<()> {
        let mut manifest = self.manifest().clone();
        manifest
            .retire_indexes(|e| e.model == model && written.iter().any(|w| w.tenant == e.tenant));
        manifest.indexes.extend(written);
        manifest
            .indexes
            .sort_by(|a, b| (&a.tenant, &a.model).cmp(&(&b.tenant, &b.model)));
        // No row changes: the live counts that held still hold.
        if let Some(stats) = manifest.current_counts() {
            manifest.live_counts = Some(LiveCounts {
                version: manifest.version + 1,
                stats,
            });
        }
        manifest.version += 1;
        let summary = serde_json::json!({
            "model": model,
            "written": updates.iter().filter(|u| u.how != IndexHow::Current).count(),
            "current": updates.iter().filter(|u| u.how == IndexHow::Current).count(),
        });
        let info = CommitInfo {
            stage: "index".into(),
            run_id: run_id.to_string(),
            summary,
            progress: Default::default(),
        };
        self.land(manifest, info)
    }

    /// Deletes the files of `indexes/` that neither the manifest's indexes nor its retired
    /// files name: temporary files and indexes whose commit never landed. The folder holds
    /// only this module's derived files.
    fn sweep_indexes(&self) -> Result<()> {
        sweep(self.store().dir(), self.manifest())
    }
}

/// Whether a file that holds the index of `(tenant, model)` is the one `entry` lists; the
/// reason when it is not.
fn holds(entry: &IndexEntry, (tenant, model): (&str, &str)) -> std::result::Result<(), String> {
    if tenant == entry.tenant && model == entry.model {
        return Ok(());
    }
    Err(format!(
        "holds tenant `{tenant}` and model `{model}`, the manifest says `{}` and `{}`",
        entry.tenant, entry.model
    ))
}

/// The size of `entry`'s file, if it is there.
fn file_size(dir: &Path, entry: &IndexEntry) -> Option<u64> {
    std::fs::metadata(dir.join(&entry.file))
        .ok()
        .map(|m| m.len())
}

/// The index a stale one is made again from, when it can be: the listed index of `tenant`
/// for `model`, readable, with no shard of the tenant that a compaction mixed from rows before
/// and after it.
fn previous_index(
    store: &Store,
    manifest: &Manifest,
    tenant: &str,
    model: &str,
) -> Option<(u64, TenantIndex)> {
    let entry = manifest.index_entry(tenant, model)?;
    let since = manifest.since(entry.version, &INDEXED_TABLES);
    if since.mixed.shards.iter().any(|s| s.may_hold(tenant)) {
        return None;
    }
    let index = store.read_index_file(entry).ok()?;
    Some((entry.version, index))
}

/// Writes `index` (holding the rows of `version`) as a new file of `indexes/`: temporary file,
/// fsync, rename, fsync of the folder. Its entry for the manifest.
fn write_index(dir: &Path, index: &TenantIndex, version: u64) -> Result<IndexEntry> {
    let bytes = file::encode(index);
    let crc32 = crc32fast::hash(&bytes);
    let folder = dir.join(INDEXES);
    std::fs::create_dir_all(&folder).at(&folder)?;
    let tenant = fluxmem_graph::sha256_hex(format!("{}\n{}", index.tenant, index.model).as_bytes());
    let name = format!("{}-v{version:08}-{crc32:08x}.fxvi", &tenant[..16]);
    let path = folder.join(&name);
    let tmp = folder.join(format!("{name}.tmp-{}", std::process::id()));
    let mut file = std::fs::File::create(&tmp).at(&tmp)?;
    file.write_all(&bytes).at(&tmp)?;
    file.sync_all().at(&tmp)?;
    std::fs::rename(&tmp, &path).at(&path)?;
    sync_dir(&folder)?;
    Ok(IndexEntry {
        tenant: index.tenant.clone(),
        model: index.model.clone(),
        file: format!("{INDEXES}/{name}"),
        bytes: bytes.len() as u64,
        crc32,
        version,
        format: INDEX_FORMAT,
    })
}

/// Deletes what of `<dir>/indexes/` `manifest` does not name (its indexes and its retired
/// files): the folder holds only derived files of this module, and an unnamed one is a
/// temporary file or an index whose commit never landed.
pub(crate) fn sweep(dir: &Path, manifest: &Manifest) -> Result<()> {
    let folder = dir.join(INDEXES);
    let Ok(entries) = std::fs::read_dir(&folder) else {
        return Ok(());
    };
    let named: BTreeSet<&str> = (manifest.indexes.iter().map(|e| e.file.as_str()))
        .chain(manifest.retired.iter().map(|r| r.file.as_str()))
        .collect();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !named.contains(format!("{INDEXES}/{name}").as_str()) {
            std::fs::remove_file(entry.path()).at(&entry.path())?;
        }
    }
    Ok(())
}
