//! An index file's bytes: writing them, and finding each part in them ([`Layout`]), for the
//! owned form a writer reads ([`TenantIndex`]) and the mapped form a query reads
//! ([`MappedIndex`]).
//!
//! ```text
//! magic "FXVIDX02" | tenant, model (u32 LE length + UTF-8 each) | dim (u32 LE) | blocks (u32 LE)
//! per block: kind (u32 length + name) | flags (u32: 1 when its vectors are stored normalised) |
//!            rows (u64) | unembedded (u64) | row ids (u32 length + UTF-8 each, sorted) |
//!            unembedded ids (the same) | zeros to a multiple of 64 bytes |
//!            vectors (rows x dim f32 LE)
//! the episodes' edges ([`super::edges`]): names, ends, CRC-32s, then their records
//! trailer: head (u64: the bytes before the edge records) | CRC-32 of the head (u32) | "FXVE"
//! ```
//!
//! The vectors start 64-byte aligned, so a mapped file's vectors are read in place. A query
//! checks the head's CRC-32 (the trailer's) and the records of each episode it reads against
//! that episode's own, so it reads no other edge; the manifest's CRC-32 of the whole file is
//! what a writer checks when it reads a previous index whole.

use fluxmem_graph::{Edge, NodeId, NodeKind};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use super::edges::EdgesLayout;
use super::{TenantIndex, VectorBlock};

const MAGIC: &[u8; 8] = b"FXVIDX02";
const TRAILER_MAGIC: &[u8; 4] = b"FXVE";
/// Bytes of the trailer.
const TRAILER: usize = 16;
/// A block's vectors start at a multiple of this many bytes.
const VECTOR_ALIGN: usize = 64;

/// Whether the index stores the vectors of `kind` normalised ([`fluxmem_graph::normalize`]):
/// the episodes', which a query ranks from the file as they are; not the semantic nodes',
/// which a query's semantic index takes as embedded (and normalises itself).
pub(crate) fn normalised(kind: NodeKind) -> bool {
    kind == NodeKind::Episodic
}

pub(super) fn put_text(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// Zeros up to a multiple of `align` bytes.
pub(super) fn pad(out: &mut Vec<u8>, align: usize) {
    out.resize(out.len().next_multiple_of(align), 0);
}

/// The file's bytes.
pub(super) fn encode(index: &TenantIndex) -> Vec<u8> {
    let vectors: usize = index.blocks.values().map(|b| b.vectors.len()).sum();
    let mut out = Vec::with_capacity(4096 + vectors * 4 + index.edges.bytes());
    out.extend_from_slice(MAGIC);
    put_text(&mut out, &index.tenant);
    put_text(&mut out, &index.model);
    out.extend_from_slice(&(index.dim as u32).to_le_bytes());
    out.extend_from_slice(&(index.blocks.len() as u32).to_le_bytes());
    for (kind, block) in &index.blocks {
        put_text(&mut out, kind.as_str());
        out.extend_from_slice(&u32::from(normalised(*kind)).to_le_bytes());
        out.extend_from_slice(&(block.ids.len() as u64).to_le_bytes());
        out.extend_from_slice(&(block.unembedded.len() as u64).to_le_bytes());
        for id in block.ids.iter().chain(&block.unembedded) {
            put_text(&mut out, id.as_str());
        }
        pad(&mut out, VECTOR_ALIGN);
        for value in &block.vectors {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    let head = index.edges.encode(&mut out);
    let crc = crc32fast::hash(&out[..head]);
    out.extend_from_slice(&(head as u64).to_le_bytes());
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(TRAILER_MAGIC);
    out
}

/// Reads a file's parts in order, each checked against what is left before the trailer.
pub(super) struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    end: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn left(&self) -> usize {
        self.end - self.at
    }

    /// The next `n` bytes' range.
    pub(super) fn take(&mut self, n: usize) -> Result<Range<usize>, String> {
        if n > self.left() {
            return Err(format!("truncated at byte {}", self.at));
        }
        self.at += n;
        Ok(self.at - n..self.at)
    }

    pub(super) fn u32(&mut self) -> Result<u32, String> {
        let range = self.take(4)?;
        Ok(u32::from_le_bytes(
            self.bytes[range].try_into().expect("4 bytes"),
        ))
    }

    /// A u64 count of items of at least `item` bytes each, checked against what is left.
    pub(super) fn count(&mut self, item: usize) -> Result<usize, String> {
        let range = self.take(8)?;
        let n = u64::from_le_bytes(self.bytes[range].try_into().expect("8 bytes"));
        if n.saturating_mul(item as u64) > self.left() as u64 {
            return Err(format!(
                "a count of {n} at byte {} is more than the file holds",
                self.at - 8
            ));
        }
        Ok(n as usize)
    }

    /// The range of the next text, checked to be UTF-8.
    pub(super) fn text_range(&mut self) -> Result<Range<usize>, String> {
        let n = self.u32()? as usize;
        let range = self.take(n)?;
        std::str::from_utf8(&self.bytes[range.clone()])
            .map_err(|_| format!("text at byte {} is not UTF-8", range.start))?;
        Ok(range)
    }

    pub(super) fn text(&mut self) -> Result<String, String> {
        let range = self.text_range()?;
        Ok(text(self.bytes, range).to_string())
    }

    /// Skips the zeros up to a multiple of `align` bytes.
    pub(super) fn pad(&mut self, align: usize) -> Result<(), String> {
        let to = self.at.next_multiple_of(align);
        self.take(to - self.at).map(|_| ())
    }
}

/// The text at `range` of `bytes` (checked to be UTF-8 when parsed).
fn text(bytes: &[u8], range: Range<usize>) -> &str {
    std::str::from_utf8(&bytes[range]).expect("checked when the layout was parsed")
}

/// Where one block's parts lie.
#[derive(Debug)]
pub(super) struct BlockLayout {
    ids: Vec<Range<usize>>,
    unembedded: Vec<Range<usize>>,
    vectors: Range<usize>,
}

/// Where each part of an index file lies, parsed and checked against the file's length.
#[derive(Debug)]
pub(super) struct Layout {
    pub(super) tenant: String,
    pub(super) model: String,
    dim: usize,
    blocks: BTreeMap<NodeKind, BlockLayout>,
    edges: EdgesLayout,
    /// The bytes the trailer's CRC-32 covers, and that CRC.
    head: usize,
    head_crc: u32,
}

impl Layout {
    pub(super) fn parse(bytes: &[u8]) -> Result<Layout, String> {
        if bytes.len() < MAGIC.len() + TRAILER || &bytes[..MAGIC.len()] != MAGIC {
            return Err("not a fluxmem tenant index of this build's format (bad magic)".into());
        }
        let trailer = &bytes[bytes.len() - TRAILER..];
        if &trailer[12..] != TRAILER_MAGIC {
            return Err("no trailer: the file is truncated".into());
        }
        let head = u64::from_le_bytes(trailer[..8].try_into().expect("8 bytes"));
        let head_crc = u32::from_le_bytes(trailer[8..12].try_into().expect("4 bytes"));
        let mut cursor = Cursor {
            bytes,
            at: MAGIC.len(),
            end: bytes.len() - TRAILER,
        };
        let tenant = cursor.text()?;
        let model = cursor.text()?;
        let dim = cursor.u32()? as usize;
        let count = cursor.u32()?;
        let mut blocks = BTreeMap::new();
        for _ in 0..count {
            let name = cursor.text()?;
            let kind =
                NodeKind::parse(&name).ok_or_else(|| format!("unknown node kind `{name}`"))?;
            if cursor.u32()? != u32::from(normalised(kind)) {
                return Err(format!(
                    "the `{name}` block's normalisation flag is not this build's"
                ));
            }
            let rows = cursor.count(4)?;
            let unembedded = cursor.count(4)?;
            let ids = (0..rows)
                .map(|_| cursor.text_range())
                .collect::<Result<Vec<_>, _>>()?;
            let missing = (0..unembedded)
                .map(|_| cursor.text_range())
                .collect::<Result<Vec<_>, _>>()?;
            cursor.pad(VECTOR_ALIGN)?;
            let values = rows
                .checked_mul(dim)
                .and_then(|v| v.checked_mul(4))
                .ok_or_else(|| format!("{rows} vectors of {dim} values"))?;
            let vectors = cursor.take(values)?;
            let block = BlockLayout {
                ids,
                unembedded: missing,
                vectors,
            };
            blocks.insert(kind, block);
        }
        let episodes = blocks
            .get(&NodeKind::Episodic)
            .map_or(0, |b| b.ids.len() + b.unembedded.len());
        let edges = EdgesLayout::parse(&mut cursor, episodes)?;
        edges.check(bytes)?;
        if head != edges.records_start() as u64 {
            return Err(format!(
                "the trailer says the edge records start at byte {head}, they start at {}",
                edges.records_start()
            ));
        }
        Ok(Layout {
            tenant,
            model,
            dim,
            blocks,
            edges,
            head: head as usize,
            head_crc,
        })
    }

    /// The owned form of the file `bytes` this layout was parsed from.
    pub(super) fn owned(&self, bytes: &[u8]) -> TenantIndex {
        let ids = |ranges: &[Range<usize>]| -> Vec<NodeId> {
            (ranges.iter())
                .map(|r| NodeId(text(bytes, r.clone()).to_string()))
                .collect()
        };
        let blocks = (self.blocks.iter())
            .map(|(kind, block)| {
                let vectors = bytes[block.vectors.clone()]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                    .collect();
                let block = VectorBlock {
                    ids: ids(&block.ids),
                    vectors,
                    unembedded: ids(&block.unembedded),
                };
                (*kind, block)
            })
            .collect();
        TenantIndex {
            tenant: self.tenant.clone(),
            model: self.model.clone(),
            dim: self.dim,
            blocks,
            edges: self.edges.owned(bytes),
        }
    }
}

/// `file` mapped into memory.
pub(super) fn map(file: &std::fs::File) -> Result<memmap2::Mmap, String> {
    // SAFETY: an index file is written whole under a temporary name, then renamed into place,
    // and never written again; deleting it (once retired) leaves a mapping whole.
    unsafe { memmap2::Mmap::map(file) }.map_err(|e| format!("cannot map: {e}"))
}

/// A tenant's index mapped into memory, as one query reads it: the head (ids, vectors, and
/// where each episode's edges lie) checked against its CRC-32 when mapped, and an episode's
/// edges against their own when read ([`MappedIndex::edges_of`]).
pub struct MappedIndex {
    map: memmap2::Mmap,
    layout: Layout,
}

impl MappedIndex {
    /// Maps `file` (of its manifest entry's size, checked by the caller) and checks its head;
    /// the reason when it is not a readable index.
    pub(super) fn map(file: &std::fs::File) -> Result<MappedIndex, String> {
        if cfg!(target_endian = "big") {
            return Err("a mapped index is read in place, as little-endian values".into());
        }
        let map = map(file)?;
        let layout = Layout::parse(&map)?;
        let crc = crc32fast::hash(&map[..layout.head]);
        if crc != layout.head_crc {
            return Err(format!(
                "the head's CRC-32 is {crc:08x}, the file says {:08x}",
                layout.head_crc
            ));
        }
        Ok(MappedIndex { map, layout })
    }

    /// The tenant.
    pub fn tenant(&self) -> &str {
        &self.layout.tenant
    }

    /// The embedding model.
    pub fn model(&self) -> &str {
        &self.layout.model
    }

    /// The vectors' dimension (0 when no node is embedded).
    pub fn dim(&self) -> usize {
        self.layout.dim
    }

    fn block(&self, kind: NodeKind) -> Option<&BlockLayout> {
        self.layout.blocks.get(&kind)
    }

    /// The ids of the embedded nodes of `kind`, in id order (the vectors' rows).
    pub fn ids(&self, kind: NodeKind) -> impl ExactSizeIterator<Item = &str> {
        let ranges = self.block(kind).map_or(&[][..], |b| &b.ids[..]);
        ranges.iter().map(|r| text(&self.map, r.clone()))
    }

    /// The id of the embedded node of `kind` at `row`.
    pub fn id(&self, kind: NodeKind, row: usize) -> Option<&str> {
        let range = self.block(kind)?.ids.get(row)?;
        Some(text(&self.map, range.clone()))
    }

    /// The nodes of `kind` without a vector of the model, in id order.
    pub fn unembedded(&self, kind: NodeKind) -> impl ExactSizeIterator<Item = &str> {
        let ranges = self.block(kind).map_or(&[][..], |b| &b.unembedded[..]);
        ranges.iter().map(|r| text(&self.map, r.clone()))
    }

    /// The vectors of `kind`, row after row, read in place (normalised when [`normalised`]
    /// says so).
    pub fn vectors(&self, kind: NodeKind) -> &[f32] {
        match self.block(kind) {
            Some(block) => bytemuck::cast_slice(&self.map[block.vectors.clone()]),
            None => &[],
        }
    }

    /// The edges of `episodes` ([`super::EPISODE_EDGES`]) that the index holds, each episode's
    /// checked against its CRC-32; an id that is not one of the tenant's episodes has none. An
    /// error says what in the file is wrong.
    pub fn edges_of(&self, episodes: &BTreeSet<NodeId>) -> Result<Vec<Edge>, String> {
        let Some(block) = self.block(NodeKind::Episodic) else {
            return Ok(Vec::new());
        };
        let rows = (&block.ids[..], &block.unembedded[..]);
        let view = self.layout.edges.view(&self.map);
        view.of_episodes(episodes, rows, |r| text(&self.map, r.clone()))
    }
}

impl std::fmt::Debug for MappedIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedIndex")
            .field("bytes", &self.map.len())
            .field("layout", &self.layout)
            .finish()
    }
}
