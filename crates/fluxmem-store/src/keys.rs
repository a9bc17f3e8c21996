//! Key indexes: each keyed shard's row keys, hashed, in a small file beside the store's shards.
//!
//! Which rows of a keyed table are live (no later shard holds their key) is decided from the
//! keys of every shard. Decoding the key columns of a shard and hashing its keys costs more
//! than everything else compaction does on a quiet night, and it would be paid for every
//! shard of the history every night. So every `nodes`, `edges` and `embeddings` shard gets,
//! when it is written, a key index `keys/<shard file name>.keys`:
//!
//! ```text
//! magic "FXKEYS01" | the shard's sha256 (64 hex bytes) | rows (u64 LE) | aux width (u8) |
//! ordered (u8) | sha256 of all the above and the body (32 bytes) | body: rows x 16-byte
//! keys, rows x aux
//! ```
//!
//! - **keys**: each row's key as the liveness pass hashes it ([`key_of`]), in row order;
//! - **aux**: what the live counts need of the row: for nodes its kind's code, for edges 0
//!   when inactive, else its kind's code plus 1 (one byte); for embeddings the hash of the
//!   node id (16 bytes: a node with vectors of two models counts once);
//! - **ordered**: the shard's keys are in strict key order (the order every writer of this
//!   crate writes), so they do not repeat within it.
//!
//! An index is derived data: it names the shard it was made from by the shard's checksum,
//! and carries its own. One that is missing, damaged, or made from another file is not used;
//! compaction (which holds the writer lock) makes it again from the shard, and a reader decodes
//! the shard's key columns instead. Writing one is best effort: a commit whose shard got no
//! index still lands. A shard's index is deleted with the shard, and an index whose shard file
//! is gone, or a temporary one, is garbage of this module's own.

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use fluxmem_graph::{EdgeKind, NodeKind};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::error::IoContext;
use crate::layout::SHARDS;
use crate::manifest::ShardEntry;
use crate::{Error, Result};

/// A row's key: the first 16 bytes of the SHA-256 of its key columns ([`key_of`]).
pub(crate) type Key = [u8; 16];

/// A map keyed by row keys: a key is already a hash, so a fast hash of it is enough; seeded
/// fixed, so nothing depends on a per-process seed.
/// A row's key: the first 16 bytes of the SHA-256 of its key columns ([`key_of`]).
pub(crate) type KeyMap<V> = HashMap<Key, V, foldhash::fast::FixedState>;

/// A set of row keys, hashed as [`KeyMap`]'s keys are.
/// A row's key: the first 16 bytes of the SHA-256 of its key columns ([`key_of`]).
pub(crate) type KeySet = HashSet<Key, foldhash::fast::FixedState>;

pub(crate) fn key_of(parts: &[&str]) -> Key {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update(part.as_bytes());
        hasher.update([0]);
    }
    hasher.finalize()[..16].try_into().expect("16 bytes")
}

/// Compaction's row codes for the live counts: a node row's code is its kind's index here...
pub(crate) const NODE_CODES: [NodeKind; 3] =
    [NodeKind::Semantic, NodeKind::Episodic, NodeKind::Procedural];
/// ...an edge row's is 0 when inactive, else its kind's index here plus 1.
pub(crate) const EDGE_CODES: [EdgeKind; 3] = [EdgeKind::Ground, EdgeKind::Distill, EdgeKind::Link];

pub(crate) fn key_columns(table: &str) -> &'static [&'static str] {
    match table {
        "nodes" => &["id"],
        "edges" => &["src", "dst", "kind"],
        _ => &["node_id", "model_id"],
    }
}

/// The directory of key indexes, beside `shards/`.
pub const KEYS: &str = "keys";

const MAGIC: &[u8; 8] = b"FXKEYS01";
const HEADER: usize = 8 + 64 + 8 + 1 + 1 + 32;

/// One shard's keys (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KeyIndex {
    pub keys: Vec<Key>,
    aux: Vec<u8>,
    width: usize,
    /// The keys are in strict key order (unique within the shard).
    pub ordered: bool,
}

impl KeyIndex {
    /// Row `row`'s aux bytes.
    pub fn aux(&self, row: usize) -> &[u8] {
        &self.aux[row * self.width..(row + 1) * self.width]
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }
}

/// Bytes of aux per row of `table`; `None` for a table without keys (`steps`, `edits`).
fn aux_width(table: &str) -> Option<usize> {
    match table {
        "nodes" | "edges" => Some(1),
        "embeddings" => Some(16),
        _ => None,
    }
}

/// Makes a table's key index from its batches, in row order.
pub(crate) struct IndexBuilder {
    table: String,
    index: KeyIndex,
    previous: Vec<String>,
}

impl IndexBuilder {
    /// A builder for `table`; `None` when the table has no keys.
    pub fn new(table: &str) -> Option<IndexBuilder> {
        let width = aux_width(table)?;
        Some(IndexBuilder {
            table: table.into(),
            index: KeyIndex {
                keys: Vec::new(),
                aux: Vec::new(),
                width,
                ordered: true,
            },
            previous: Vec::new(),
        })
    }

    /// Adds `batch`'s rows; the batch holds the key columns and, for nodes, `kind`, for
    /// edges, `kind` and `active`. The error names what is wrong with the batch.
    pub fn push(&mut self, batch: &RecordBatch) -> std::result::Result<(), String> {
        let text = |name: &str| {
            batch
                .column_by_name(name)
                .and_then(|c| c.as_string_opt::<i32>())
                .ok_or_else(|| format!("column `{name}` is missing or not text"))
        };
        let keys: Vec<&arrow_array::StringArray> = key_columns(&self.table)
            .iter()
            .map(|name| text(name))
            .collect::<std::result::Result<_, _>>()?;
        let kinds = if self.table == "embeddings" {
            None
        } else {
            Some(text("kind")?)
        };
        let active = if self.table == "edges" {
            Some(
                batch
                    .column_by_name("active")
                    .and_then(|c| c.as_boolean_opt())
                    .ok_or("column `active` is missing or not boolean")?,
            )
        } else {
            None
        };
        self.index.keys.reserve(batch.num_rows());
        let mut parts: Vec<&str> = Vec::with_capacity(keys.len());
        for i in 0..batch.num_rows() {
            parts.clear();
            parts.extend(keys.iter().map(|s| s.value(i)));
            if self.index.ordered
                && !self.previous.is_empty()
                && key_order(&self.table, &self.previous, &parts) != std::cmp::Ordering::Less
            {
                self.index.ordered = false;
            }
            if self.index.ordered {
                self.previous.resize(parts.len(), String::new());
                for (buffer, part) in self.previous.iter_mut().zip(&parts) {
                    buffer.clear();
                    buffer.push_str(part);
                }
            }
            self.index.keys.push(key_of(&parts));
            match (self.table.as_str(), kinds) {
                ("nodes", Some(kinds)) => {
                    let kind = NodeKind::parse(kinds.value(i)).ok_or_else(|| {
                        format!("row {i}: unknown node kind `{}`", kinds.value(i))
                    })?;
                    self.index.aux.push(
                        NODE_CODES
                            .iter()
                            .position(|k| *k == kind)
                            .expect("every kind has a code") as u8,
                    );
                }
                (_, Some(kinds)) => {
                    let kind = EdgeKind::parse(kinds.value(i)).ok_or_else(|| {
                        format!("row {i}: unknown edge kind `{}`", kinds.value(i))
                    })?;
                    let code = EDGE_CODES
                        .iter()
                        .position(|k| *k == kind)
                        .expect("every kind has a code") as u8;
                    let active = active.is_some_and(|a| !a.is_null(i) && a.value(i));
                    self.index.aux.push(if active { code + 1 } else { 0 });
                }
                _ => self.index.aux.extend_from_slice(&key_of(&[parts[0]])),
            }
        }
        Ok(())
    }

    pub fn finish(self) -> KeyIndex {
        self.index
    }
}

/// The order of two rows' keys (`a` before `b`: `Less`) as shards are written: node ids, then
/// for edges the destination and the kind (in [`EdgeKind`]'s order), for embeddings the model.
fn key_order(table: &str, a: &[String], b: &[&str]) -> std::cmp::Ordering {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let order = if table == "edges" && i == 2 {
            EdgeKind::parse(x).cmp(&EdgeKind::parse(y))
        } else {
            x.as_str().cmp(y)
        };
        if order.is_ne() {
            return order;
        }
    }
    std::cmp::Ordering::Equal
}

/// The columns [`IndexBuilder::push`] reads of `table`.
pub(crate) fn index_columns(table: &str) -> Vec<&'static str> {
    let mut columns = key_columns(table).to_vec();
    match table {
        "nodes" => columns.push("kind"),
        "edges" => columns.extend(["kind", "active"]),
        _ => {}
    }
    columns
}

/// The index file of `entry` under the store directory `dir`: in the `keys/` beside the
/// `shards/` that holds the shard (a staging store's manifest names the main store's shards by
/// a path into the main store, whose indexes are the main store's).
fn path(dir: &Path, entry: &ShardEntry) -> PathBuf {
    index_path(dir, &entry.file)
}

fn index_path(dir: &Path, file: &str) -> PathBuf {
    let shard = dir.join(file);
    let store = shard.parent().and_then(Path::parent).unwrap_or(dir);
    store.join(KEYS).join(format!("{}.keys", file_name(file)))
}

fn file_name(file: &str) -> &str {
    file.rsplit('/').next().unwrap_or(file)
}

/// Writes `entry`'s key index where it can: an index is derived data, so a failure (a full
/// disk, a read-only `keys/`) leaves the shard without one (readers decode its key columns;
/// compaction tries again) rather than failing the commit that wrote the shard.
pub(crate) fn keep(dir: &Path, entry: &ShardEntry, index: &KeyIndex) {
    let _ = write(dir, entry, index);
}

/// Writes `index` as `entry`'s key index: a temporary file renamed into place. Not synced: a
/// torn index fails its checksum and is made again.
pub(crate) fn write(dir: &Path, entry: &ShardEntry, index: &KeyIndex) -> Result<()> {
    let path = path(dir, entry);
    let folder = path.parent().unwrap_or(dir);
    std::fs::create_dir_all(folder).at(folder)?;
    let mut body = Vec::with_capacity(index.keys.len() * (16 + index.width));
    for key in &index.keys {
        body.extend_from_slice(key);
    }
    body.extend_from_slice(&index.aux);
    let mut bytes = Vec::with_capacity(HEADER + body.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(entry.sha256.as_bytes());
    bytes.extend_from_slice(&(index.keys.len() as u64).to_le_bytes());
    bytes.push(index.width as u8);
    bytes.push(index.ordered as u8);
    let digest = checksum(&bytes, &body);
    bytes.extend_from_slice(&digest);
    bytes.extend_from_slice(&body);
    let temporary = path.with_extension("keys.tmp");
    std::fs::write(&temporary, &bytes).at(&temporary)?;
    std::fs::rename(&temporary, &path).at(&path)?;
    Ok(())
}

/// The SHA-256 of an index's header fields (all but the checksum) and body.
fn checksum(header: &[u8], body: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(header);
    hasher.update(body);
    hasher.finalize().into()
}

/// `entry`'s key index, if its file is there, whole, and made from this shard.
pub(crate) fn read(dir: &Path, entry: &ShardEntry) -> Option<KeyIndex> {
    let width = aux_width(&entry.table)?;
    let bytes = std::fs::read(path(dir, entry)).ok()?;
    if bytes.len() < HEADER
        || &bytes[..8] != MAGIC
        || entry.sha256.len() != 64
        || &bytes[8..72] != entry.sha256.as_bytes()
    {
        return None;
    }
    let rows = u64::from_le_bytes(bytes[72..80].try_into().ok()?);
    if rows != entry.rows || bytes[80] as usize != width || bytes[81] > 1 {
        return None;
    }
    let body = &bytes[HEADER..];
    if body.len() as u64 != rows * (16 + width as u64)
        || checksum(&bytes[..82], body)[..] != bytes[82..114]
    {
        return None;
    }
    let (keys, aux) = body.split_at(rows as usize * 16);
    let keys = keys
        .chunks_exact(16)
        .map(|k| k.try_into().expect("16 bytes"))
        .collect();
    Some(KeyIndex {
        keys,
        aux: aux.to_vec(),
        width,
        ordered: bytes[81] == 1,
    })
}

/// Deletes the key index of the shard file `file` (a path under the store), if any.
pub(crate) fn remove(dir: &Path, file: &str) -> Result<()> {
    let path = index_path(dir, file);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io { path, source: e }),
        _ => Ok(()),
    }
}

/// Deletes the key indexes (and temporary index files) in `keys/` whose shard `keep` says the
/// store no longer holds: garbage of this module's own (see the module docs). Returns how many.
pub(crate) fn sweep(dir: &Path, keep: &dyn Fn(&str) -> bool) -> Result<usize> {
    let folder = dir.join(KEYS);
    let Ok(entries) = std::fs::read_dir(&folder) else {
        return Ok(0);
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let shard = name
            .strip_suffix(".keys.tmp")
            .or_else(|| name.strip_suffix(".keys"));
        let Some(shard) = shard else { continue };
        if name.ends_with(".tmp") || !keep(&format!("{}/{shard}", SHARDS)) {
            std::fs::remove_file(entry.path()).at(&entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CommitInfo, Writer};
    use fluxmem_graph::Graph;

    /// A commit writes each keyed shard's index; it holds the keys the liveness pass hashes
    /// and the edges' states, and an index that is damaged, or made from another shard, is
    /// not used (and made again from the shard).
    #[test]
    fn a_commit_writes_key_indexes_that_are_checked_before_use() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::open(dir.path()).unwrap();
        let mut delta = Graph::default();
        for i in 0..5 {
            delta.upsert_edge(crate::testing::test_edge(i, 1.0, i != 2));
        }
        writer
            .commit(
                &delta,
                CommitInfo {
                    stage: "t".into(),
                    ..Default::default()
                },
            )
            .unwrap();
        let entry = writer
            .manifest
            .shards
            .iter()
            .find(|s| s.table == "edges")
            .unwrap()
            .clone();
        let index = read(dir.path(), &entry).expect("the commit wrote the index");
        let expected: Vec<Key> = delta
            .edges
            .values()
            .map(|e| key_of(&[e.src.as_str(), e.dst.as_str(), e.kind.as_str()]))
            .collect();
        assert_eq!(index.keys, expected);
        assert!(index.ordered);
        let codes: Vec<u8> = (0..5).map(|i| index.aux(i)[0]).collect();
        assert_eq!(
            codes,
            vec![1, 1, 0, 1, 1],
            "ground is code 0 + 1; the inactive edge is 0"
        );
        // Made from the shard, it is the same.
        std::fs::remove_file(path(dir.path(), &entry)).unwrap();
        assert!(read(dir.path(), &entry).is_none());
        assert_eq!(
            crate::shard::key_index(dir.path(), &entry, true).unwrap(),
            index
        );
        assert_eq!(read(dir.path(), &entry).as_ref(), Some(&index), "kept");
        // One flipped byte of the body: not used.
        let file = path(dir.path(), &entry);
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&file, &bytes).unwrap();
        assert!(read(dir.path(), &entry).is_none(), "a damaged body");
        assert_eq!(
            crate::shard::key_index(dir.path(), &entry, false).unwrap(),
            index
        );
        // Another shard's index under this shard's name: not used.
        let other = ShardEntry {
            sha256: "0".repeat(64),
            ..entry.clone()
        };
        write(dir.path(), &other, &index).unwrap();
        assert!(read(dir.path(), &entry).is_none(), "made from another file");
        // A sweep keeps what the store holds and deletes the rest.
        write(
            dir.path(),
            &ShardEntry {
                file: "shards/edges-00000009-000-abcdef012345.parquet".into(),
                ..entry.clone()
            },
            &index,
        )
        .unwrap();
        std::fs::write(dir.path().join(KEYS).join("x.keys.tmp"), b"").unwrap();
        let listed = entry.file.clone();
        assert_eq!(sweep(dir.path(), &|file| file == listed).unwrap(), 2);
        assert!(path(dir.path(), &entry).exists());
        // A staging store names the main store's shards by a path into it: their indexes are
        // the main store's.
        let staging = dir.path().join("staging").join("connect-1-of-2");
        std::fs::create_dir_all(&staging).unwrap();
        write(dir.path(), &entry, &index).unwrap();
        let seen_from_staging = ShardEntry {
            file: format!("../../{}", entry.file),
            ..entry.clone()
        };
        assert_eq!(read(&staging, &seen_from_staging).as_ref(), Some(&index));
    }
}
