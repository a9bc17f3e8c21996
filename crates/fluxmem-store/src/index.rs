//! Tenant vector indexes: what a query of one tenant needs to rank, in one file.
//!
//! A query ranks its tenant's episodes by the cosine of their vectors and its semantic nodes
//! by BM25 and cosine. Read from the shards, that is every episode row and every vector of the
//! tenant, decoded and inserted into a graph, on every query: at 100,000 episodes, seconds.
//! The night writes instead, per tenant and embedding model, `indexes/<name>.fxvi`:
//!
//! ```text
//! magic "FXVIDX01" | tenant, model (u32 LE length + UTF-8 each) | dim (u32 LE) | blocks (u32 LE)
//! per block: kind (u32 length + name) | rows (u64) | unembedded (u64) |
//!            row ids (u32 length + UTF-8 each, sorted) | unembedded ids (the same) |
//!            vectors (rows x dim f32 LE, as stored)
//! ```
//!
//! one block per indexed kind ([`INDEXED_KINDS`]): each live node of the tenant of that kind,
//! in id order (the order a graph holds them), with its vector of the model, or among the
//! unembedded. The manifest lists the file ([`IndexEntry`]: its size, CRC-32 and the version
//! whose rows it holds); it is used only while current ([`Manifest::current_index`]), so a
//! commit of the tenant's nodes or vectors invalidates it and a reader falls back to the shards.
//!
//! [`Writer::update_indexes`] brings indexes up to date under the writer lock. A tenant whose
//! index is current costs nothing; one whose index is stale is read again from the shards the
//! commits after it added (the previous file, plus those rows), unless a compaction merged
//! its older rows with newer ones, and then from all of its shards. The replaced file is
//! retired like a compacted shard (deleted two commits and a grace period later). An index
//! file is derived data: one that no manifest lists, or a temporary one, is garbage of this
//! module's own ([`sweep`]).

use fluxmem_graph::{NodeId, NodeKind};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;

use crate::error::IoContext;
use crate::layout::{sync_dir, INDEXES};
use crate::manifest::{IndexEntry, LiveCounts, Manifest, INDEXED_TABLES};
use crate::scan::{Rows, Scan};
use crate::store::{CommitInfo, Store, Writer};
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"FXVIDX01";

/// The node kinds a tenant index holds: the ones a query ranks by vector.
pub const INDEXED_KINDS: [NodeKind; 2] = [NodeKind::Episodic, NodeKind::Semantic];

/// One kind's nodes of a tenant, with their vectors of one model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VectorBlock {
    /// The embedded nodes, in id order.
    pub ids: Vec<NodeId>,
    /// Their vectors, row after row (`ids.len() x dim`), as stored.
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

    /// The index file of `entry`, checked against it: read once, straight into the vectors'
    /// memory, its CRC-32 computed on the way.
    fn read_index_file(&self, entry: &IndexEntry) -> Result<TenantIndex> {
        let path = self.dir.join(&entry.file);
        let corrupt = |reason: String| Error::Corrupt {
            path: path.clone(),
            reason: format!(
                "{reason}; `fluxmem store index --rebuild --tenant {}` writes it again",
                entry.tenant
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
        let mut reader = Reader {
            inner: std::io::BufReader::with_capacity(1 << 16, file),
            crc: crc32fast::Hasher::new(),
            at: 0,
            size,
        };
        let index = decode(&mut reader).map_err(|e| match e {
            Fault::Io(source) => Error::Io {
                path: path.clone(),
                source,
            },
            Fault::Bad(reason) => corrupt(reason),
        })?;
        let crc = reader.crc.finalize();
        if crc != entry.crc32 {
            return Err(corrupt(format!(
                "CRC-32 {crc:08x}, the manifest says {:08x}",
                entry.crc32
            )));
        }
        if index.tenant != entry.tenant || index.model != entry.model {
            return Err(corrupt(format!(
                "holds tenant `{}` and model `{}`, the manifest says `{}` and `{}`",
                index.tenant, index.model, entry.tenant, entry.model
            )));
        }
        Ok(index)
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
        let (read, mut nodes) = match previous {
            Some((version, index)) => (
                manifest.since(version, &INDEXED_TABLES).added,
                working(index),
            ),
            None => (manifest.clone(), BTreeMap::new()),
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
        for ((id, of), embedding) in self.scan_at(&read, &scan)?.embeddings {
            if of == model {
                if let Some((_, vector)) = nodes.get_mut(&id) {
                    *vector = Some(embedding.vector);
                }
            }
        }
        blocks_of(tenant, model, nodes).map_err(|reason| Error::Corrupt {
            path: self.dir.join(crate::layout::SHARDS),
            reason,
        })
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
    let entry = (manifest.indexes.iter()).find(|e| e.tenant == tenant && e.model == model)?;
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
    let bytes = encode(index);
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

fn put_text(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// The file's bytes ([the module docs](self)).
fn encode(index: &TenantIndex) -> Vec<u8> {
    let vectors: usize = index.blocks.values().map(|b| b.vectors.len()).sum();
    let mut out = Vec::with_capacity(64 + vectors * 4);
    out.extend_from_slice(MAGIC);
    put_text(&mut out, &index.tenant);
    put_text(&mut out, &index.model);
    out.extend_from_slice(&(index.dim as u32).to_le_bytes());
    out.extend_from_slice(&(index.blocks.len() as u32).to_le_bytes());
    for (kind, block) in &index.blocks {
        put_text(&mut out, kind.as_str());
        out.extend_from_slice(&(block.ids.len() as u64).to_le_bytes());
        out.extend_from_slice(&(block.unembedded.len() as u64).to_le_bytes());
        for id in block.ids.iter().chain(&block.unembedded) {
            put_text(&mut out, id.as_str());
        }
        for value in &block.vectors {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    out
}

/// Why a file could not be decoded.
enum Fault {
    Io(std::io::Error),
    Bad(String),
}

impl From<String> for Fault {
    fn from(reason: String) -> Fault {
        Fault::Bad(reason)
    }
}

/// Reads [`encode`]'s bytes, to the end of the file.
fn decode(reader: &mut Reader<impl std::io::Read>) -> std::result::Result<TenantIndex, Fault> {
    let mut magic = [0u8; 8];
    reader.fill(&mut magic)?;
    if &magic != MAGIC {
        return Err(Fault::Bad("not a fluxmem tenant index (bad magic)".into()));
    }
    let tenant = reader.text()?;
    let model = reader.text()?;
    let dim = reader.u32()? as usize;
    let count = reader.u32()?;
    let mut blocks = BTreeMap::new();
    for _ in 0..count {
        let name = reader.text()?;
        let kind = NodeKind::parse(&name).ok_or_else(|| format!("unknown node kind `{name}`"))?;
        let rows = reader.count()?;
        let unembedded = reader.count()?;
        let ids = (0..rows)
            .map(|_| reader.text().map(NodeId))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let missing = (0..unembedded)
            .map(|_| reader.text().map(NodeId))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let values = rows
            .checked_mul(dim)
            .filter(|v| (*v as u64) * 4 <= reader.left());
        let values = values.ok_or_else(|| {
            format!("{rows} vectors of {dim} values do not fit in what is left of the file")
        })?;
        let mut vectors = vec![0f32; values];
        reader.fill(bytemuck::cast_slice_mut(&mut vectors))?;
        if cfg!(target_endian = "big") {
            for value in &mut vectors {
                *value = f32::from_bits(value.to_bits().swap_bytes());
            }
        }
        blocks.insert(
            kind,
            VectorBlock {
                ids,
                vectors,
                unembedded: missing,
            },
        );
    }
    if reader.left() != 0 {
        return Err(Fault::Bad(format!(
            "{} bytes after the last block",
            reader.left()
        )));
    }
    Ok(TenantIndex {
        tenant,
        model,
        dim,
        blocks,
    })
}

/// A file read in order, its CRC-32 computed on the way; reads past `size` fail.
struct Reader<R> {
    inner: R,
    crc: crc32fast::Hasher,
    at: u64,
    size: u64,
}

impl<R: std::io::Read> Reader<R> {
    fn left(&self) -> u64 {
        self.size - self.at
    }

    fn fill(&mut self, buf: &mut [u8]) -> std::result::Result<(), Fault> {
        if buf.len() as u64 > self.left() {
            return Err(Fault::Bad(format!("truncated at byte {}", self.at)));
        }
        self.inner.read_exact(buf).map_err(Fault::Io)?;
        self.crc.update(buf);
        self.at += buf.len() as u64;
        Ok(())
    }

    fn u32(&mut self) -> std::result::Result<u32, Fault> {
        let mut b = [0u8; 4];
        self.fill(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// A u64 count of items of at least 4 bytes each, checked against what is left.
    fn count(&mut self) -> std::result::Result<usize, Fault> {
        let mut b = [0u8; 8];
        self.fill(&mut b)?;
        let n = u64::from_le_bytes(b);
        if n.saturating_mul(4) > self.left() {
            return Err(Fault::Bad(format!(
                "a count of {n} at byte {} is more than the file holds",
                self.at - 8
            )));
        }
        Ok(n as usize)
    }

    fn text(&mut self) -> std::result::Result<String, Fault> {
        let n = self.u32()? as u64;
        if n > self.left() {
            return Err(Fault::Bad(format!("truncated at byte {}", self.at)));
        }
        let at = self.at;
        let mut bytes = vec![0u8; n as usize];
        self.fill(&mut bytes)?;
        String::from_utf8(bytes).map_err(|_| Fault::Bad(format!("text at byte {at} is not UTF-8")))
    }
}
