//! The edges an index keeps with each of its episodes: what a query reads of the episodes it
//! ranks ([`EPISODE_EDGES`]), so that a query through the index opens no edge shard.
//!
//! After the blocks, the file holds:
//!
//! ```text
//! names (u64 count; u32 length + UTF-8 each) | episodes (u64: the episodic block's rows, then
//! its unembedded nodes) | zeros to a multiple of 8 bytes |
//! ends (u64 LE per episode: where its records end, counted in records) |
//! CRC-32s (u32 LE per episode: of its records) |
//! records (44 bytes each, LE: other end, kind, stage, run, metadata (u32 numbers of names),
//!          weight (f32), evidence, created_at (i64), active (u32))
//! ```
//!
//! Each text is a name, stored once (the kinds, stages, runs, metadata and most other ends
//! repeat); an episode's records are in the order of their other end's id, then kind.

use fluxmem_graph::{Edge, EdgeKind, NodeId};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;

use super::file::{pad, put_text, Cursor};

/// Which end of an edge is the episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpisodeEnd {
    /// The edge starts at the episode.
    Src,
    /// The edge ends at the episode.
    Dst,
}

/// The edges a query reads of each episode it ranks, which a tenant's index keeps with the
/// episode: the ground edges into it (its facts' support) and the distill edges out of it
/// (its skills).
pub const EPISODE_EDGES: [(EdgeKind, EpisodeEnd); 2] = [
    (EdgeKind::Ground, EpisodeEnd::Dst),
    (EdgeKind::Distill, EpisodeEnd::Src),
];

/// The episode end of `edge` when it is one of [`EPISODE_EDGES`], with its other end.
fn ends(edge: &Edge) -> Option<(&NodeId, &NodeId)> {
    let (_, end) = EPISODE_EDGES.iter().find(|(kind, _)| *kind == edge.kind)?;
    Some(match end {
        EpisodeEnd::Src => (&edge.src, &edge.dst),
        EpisodeEnd::Dst => (&edge.dst, &edge.src),
    })
}

/// Bytes of one record.
const RECORD: usize = 44;

/// The edges of an index's episodes, owned: each episode's records, after the episode before.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EpisodeEdges {
    names: Vec<String>,
    /// Per episode, where its records end (u64 LE, counted in records).
    ends: Vec<u8>,
    records: Vec<u8>,
}

impl EpisodeEdges {
    /// Edges in all.
    pub fn len(&self) -> usize {
        self.records.len() / RECORD
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// About the bytes of the file's form.
    pub(super) fn bytes(&self) -> usize {
        self.names.iter().map(|n| n.len() + 4).sum::<usize>()
            + self.ends.len() * 3 / 2
            + self.records.len()
            + 32
    }

    pub(super) fn view(&self) -> EdgesView<'_> {
        EdgesView {
            names: NameTable::Owned(&self.names),
            ends: &self.ends,
            crcs: None,
            records: &self.records,
        }
    }

    /// Appends the file's form; the length of the file before the records (the head).
    pub(super) fn encode(&self, out: &mut Vec<u8>) -> usize {
        out.extend_from_slice(&(self.names.len() as u64).to_le_bytes());
        for name in &self.names {
            put_text(out, name);
        }
        let view = self.view();
        let episodes = self.ends.len() / 8;
        out.extend_from_slice(&(episodes as u64).to_le_bytes());
        pad(out, 8);
        out.extend_from_slice(&self.ends);
        for row in 0..episodes {
            let crc = crc32fast::hash(&self.records[view.span(row)]);
            out.extend_from_slice(&crc.to_le_bytes());
        }
        let head = out.len();
        out.extend_from_slice(&self.records);
        head
    }
}

/// Where the episodes' edges lie in a file.
#[derive(Debug)]
pub(super) struct EdgesLayout {
    /// Where each name lies (decoded when an edge that uses it is read).
    names: Vec<Range<usize>>,
    ends: Range<usize>,
    crcs: Range<usize>,
    records: Range<usize>,
}

impl EdgesLayout {
    /// Parses the edges of `episodes` episodes, to the end of what `cursor` holds.
    pub(super) fn parse(cursor: &mut Cursor<'_>, episodes: usize) -> Result<EdgesLayout, String> {
        let count = cursor.count(4)?;
        let names = (0..count)
            .map(|_| cursor.text_range())
            .collect::<Result<Vec<_>, _>>()?;
        let listed = cursor.count(12)?;
        if listed != episodes {
            return Err(format!(
                "edges for {listed} episodes, the episodic block holds {episodes}"
            ));
        }
        cursor.pad(8)?;
        let ends = cursor.take(episodes * 8)?;
        let crcs = cursor.take(episodes * 4)?;
        let records = cursor.take(cursor.left())?;
        let layout = EdgesLayout {
            names,
            ends,
            crcs,
            records,
        };
        Ok(layout)
    }

    /// Checks the ends against the records' length (once the head is known to be sound).
    pub(super) fn check(&self, bytes: &[u8]) -> Result<(), String> {
        let view = self.view(bytes);
        let episodes = self.ends.len() / 8;
        let ends: Vec<u64> = (0..episodes).map(|row| view.end(row)).collect();
        if ends.windows(2).any(|w| w[0] > w[1]) {
            return Err("the episodes' edge ends decrease".into());
        }
        let total = ends.last().copied().unwrap_or(0);
        if total.checked_mul(RECORD as u64) != Some(self.records.len() as u64) {
            return Err(format!(
                "{total} edge records, {} bytes of them in the file",
                self.records.len()
            ));
        }
        Ok(())
    }

    /// Where the records start: the end of the head.
    pub(super) fn records_start(&self) -> usize {
        self.records.start
    }

    pub(super) fn view<'a>(&'a self, bytes: &'a [u8]) -> EdgesView<'a> {
        EdgesView {
            names: NameTable::Mapped(bytes, &self.names),
            ends: &bytes[self.ends.clone()],
            crcs: Some(&bytes[self.crcs.clone()]),
            records: &bytes[self.records.clone()],
        }
    }

    pub(super) fn owned(&self, bytes: &[u8]) -> EpisodeEdges {
        let view = self.view(bytes);
        let names = (0..self.names.len() as u32).map(|n| view.names.get(n));
        EpisodeEdges {
            names: names.map(|n| n.unwrap_or_default().to_string()).collect(),
            ends: bytes[self.ends.clone()].to_vec(),
            records: bytes[self.records.clone()].to_vec(),
        }
    }
}

/// The names of an owned index, or of a mapped file (where each lies in it).
#[derive(Clone, Copy)]
enum NameTable<'a> {
    Owned(&'a [String]),
    Mapped(&'a [u8], &'a [Range<usize>]),
}

impl<'a> NameTable<'a> {
    fn get(&self, n: u32) -> Option<&'a str> {
        match *self {
            NameTable::Owned(names) => names.get(n as usize).map(String::as_str),
            NameTable::Mapped(bytes, ranges) => ranges.get(n as usize).map(|range| {
                std::str::from_utf8(&bytes[range.clone()]).expect("checked when parsed")
            }),
        }
    }

    fn len(&self) -> usize {
        match *self {
            NameTable::Owned(names) => names.len(),
            NameTable::Mapped(_, ranges) => ranges.len(),
        }
    }
}

/// The episodes' edges of an owned index or of a mapped file.
#[derive(Clone, Copy)]
pub(super) struct EdgesView<'a> {
    names: NameTable<'a>,
    ends: &'a [u8],
    /// Each episode's CRC-32 of its records (a mapped file's, which is not checked whole).
    crcs: Option<&'a [u8]>,
    records: &'a [u8],
}

impl<'a> EdgesView<'a> {
    fn end(&self, row: usize) -> u64 {
        let at = row * 8;
        u64::from_le_bytes(self.ends[at..at + 8].try_into().expect("8 bytes"))
    }

    /// The bytes of the records of the episode at `row` (of the episodic block's rows, then
    /// its unembedded).
    fn span(&self, row: usize) -> Range<usize> {
        if (row + 1) * 8 > self.ends.len() {
            return 0..0;
        }
        let start = if row == 0 { 0 } else { self.end(row - 1) };
        start as usize * RECORD..self.end(row) as usize * RECORD
    }

    fn records_of(&self, row: usize) -> impl Iterator<Item = Record> + 'a {
        let records = &self.records[self.span(row)];
        records.chunks_exact(RECORD).map(Record::read)
    }

    /// The edges of `episodes` that the index holds, an episode's row found by its id among
    /// the episodic block's rows (`ids`), then its unembedded nodes (`unembedded`), both in
    /// id order and named by `id`; an id found in neither has none. An error says what in the
    /// file is wrong.
    pub(super) fn of_episodes<'t, T>(
        &self,
        episodes: &BTreeSet<NodeId>,
        (ids, unembedded): (&'t [T], &'t [T]),
        id: impl Fn(&'t T) -> &'t str,
    ) -> Result<Vec<Edge>, String> {
        let find = |among: &'t [T], episode: &str| among.binary_search_by(|t| id(t).cmp(episode));
        let mut edges = Vec::new();
        for episode in episodes {
            let row = match find(ids, episode.as_str()) {
                Ok(row) => row,
                Err(_) => match find(unembedded, episode.as_str()) {
                    Ok(row) => ids.len() + row,
                    Err(_) => continue,
                },
            };
            edges.extend(self.of(row, episode)?);
        }
        Ok(edges)
    }

    /// The edges of `episode`, the episode at `row`; an error says what in the file is wrong.
    fn of(&self, row: usize, episode: &NodeId) -> Result<Vec<Edge>, String> {
        if let Some(crcs) = self.crcs {
            let want = u32::from_le_bytes(crcs[row * 4..row * 4 + 4].try_into().expect("4 bytes"));
            let crc = crc32fast::hash(&self.records[self.span(row)]);
            if crc != want {
                return Err(format!(
                    "the edges of episode {episode} have CRC-32 {crc:08x}, the file says {want:08x}"
                ));
            }
        }
        let name = |n: u32| {
            self.names
                .get(n)
                .ok_or_else(|| format!("name {n} of {} in the edges", self.names.len()))
        };
        self.records_of(row)
            .map(|record| {
                let kind = name(record.kind)?;
                let (kind, end) = (EPISODE_EDGES.iter())
                    .find(|(k, _)| k.as_str() == kind)
                    .ok_or_else(|| format!("`{kind}` is not an episode edge's kind"))?;
                let other = NodeId(name(record.other)?.to_string());
                let (src, dst) = match end {
                    EpisodeEnd::Src => (episode.clone(), other),
                    EpisodeEnd::Dst => (other, episode.clone()),
                };
                let metadata = name(record.metadata)?;
                Ok(Edge {
                    src,
                    dst,
                    kind: *kind,
                    weight: record.weight,
                    evidence: record.evidence,
                    stage: name(record.stage)?.to_string(),
                    run_id: name(record.run)?.to_string(),
                    created_at: record.created_at,
                    active: record.active,
                    metadata: serde_json::from_str(metadata)
                        .map_err(|e| format!("edge metadata `{metadata}`: {e}"))?,
                })
            })
            .collect()
    }
}

/// One edge of an episode, its texts as numbers of names.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Record {
    other: u32,
    kind: u32,
    stage: u32,
    run: u32,
    metadata: u32,
    weight: f32,
    evidence: i64,
    created_at: i64,
    active: bool,
}

impl Record {
    fn read(bytes: &[u8]) -> Record {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let i64_at = |at: usize| i64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        Record {
            other: u32_at(0),
            kind: u32_at(4),
            stage: u32_at(8),
            run: u32_at(12),
            metadata: u32_at(16),
            weight: f32::from_bits(u32_at(20)),
            evidence: i64_at(24),
            created_at: i64_at(32),
            active: u32_at(40) != 0,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        for n in [self.other, self.kind, self.stage, self.run, self.metadata] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(&self.weight.to_bits().to_le_bytes());
        out.extend_from_slice(&self.evidence.to_le_bytes());
        out.extend_from_slice(&self.created_at.to_le_bytes());
        out.extend_from_slice(&u32::from(self.active).to_le_bytes());
    }
}

/// Texts numbered in the order they were first given.
#[derive(Default)]
struct Names {
    list: Vec<String>,
    at: HashMap<String, u32>,
}

impl Names {
    fn number(&mut self, text: &str) -> u32 {
        if let Some(&n) = self.at.get(text) {
            return n;
        }
        let n = self.list.len() as u32;
        self.list.push(text.to_string());
        self.at.insert(text.to_string(), n);
        n
    }
}

/// The episodes' edges while an index is made: each episode's records by episode id, a later
/// edge replacing an earlier one with the same other end and kind (as a later row of the same
/// key wins in the shards).
#[derive(Default)]
pub(crate) struct Gathered {
    names: Names,
    of: BTreeMap<NodeId, Vec<Record>>,
}

impl Gathered {
    /// The edges of a previous file, whose episodes are `episodes` (its rows, in order); an
    /// error when a record names a name the file does not hold.
    pub(crate) fn from_file(edges: &EpisodeEdges, episodes: &[NodeId]) -> Result<Gathered, String> {
        let mut gathered = Gathered::default();
        let view = edges.view();
        let numbers: Vec<u32> = (edges.names.iter())
            .map(|name| gathered.names.number(name))
            .collect();
        let renumber = |n: u32| {
            (numbers.get(n as usize).copied())
                .ok_or_else(|| format!("name {n} of {} in the edges", numbers.len()))
        };
        for (row, episode) in episodes.iter().enumerate() {
            let records = view.records_of(row).map(|r| {
                Ok(Record {
                    other: renumber(r.other)?,
                    kind: renumber(r.kind)?,
                    stage: renumber(r.stage)?,
                    run: renumber(r.run)?,
                    metadata: renumber(r.metadata)?,
                    ..r
                })
            });
            let records = records.collect::<Result<Vec<_>, String>>()?;
            gathered.of.insert(episode.clone(), records);
        }
        Ok(gathered)
    }

    /// Adds `edge` when it is one of [`EPISODE_EDGES`] and its episode end passes `episode`,
    /// in place of the episode's edge with the same other end and kind.
    pub(crate) fn upsert(&mut self, edge: &Edge, episode: &dyn Fn(&NodeId) -> bool) {
        let Some((episode, other)) = ends(edge).filter(|(e, _)| episode(e)) else {
            return;
        };
        let record = Record {
            other: self.names.number(other.as_str()),
            kind: self.names.number(edge.kind.as_str()),
            stage: self.names.number(&edge.stage),
            run: self.names.number(&edge.run_id),
            metadata: self
                .names
                .number(&fluxmem_graph::schema::metadata_json(&edge.metadata)),
            weight: edge.weight,
            evidence: edge.evidence,
            created_at: edge.created_at,
            active: edge.active,
        };
        let records = self.of.entry(episode.clone()).or_default();
        match (records.iter_mut()).find(|r| r.other == record.other && r.kind == record.kind) {
            Some(old) => *old = record,
            None => records.push(record),
        }
    }

    /// The file's form for `episodes` (the episodic block's rows, in order); the edges of any
    /// other node are left out. Names are numbered in the order the records use them, and an
    /// episode's records are in the order of their other end, then kind, so the same edges
    /// give the same bytes.
    pub(crate) fn finish<'a>(self, episodes: impl IntoIterator<Item = &'a NodeId>) -> EpisodeEdges {
        let mut out = Names::default();
        let mut ends = Vec::new();
        let mut records = Vec::new();
        let text = |n: u32| self.names.list[n as usize].as_str();
        for episode in episodes {
            let mut mine: Vec<&Record> = self.of.get(episode).into_iter().flatten().collect();
            mine.sort_by(|a, b| (text(a.other), text(a.kind)).cmp(&(text(b.other), text(b.kind))));
            for record in mine {
                let record = Record {
                    other: out.number(text(record.other)),
                    kind: out.number(text(record.kind)),
                    stage: out.number(text(record.stage)),
                    run: out.number(text(record.run)),
                    metadata: out.number(text(record.metadata)),
                    ..*record
                };
                record.write(&mut records);
            }
            ends.extend_from_slice(&((records.len() / RECORD) as u64).to_le_bytes());
        }
        EpisodeEdges {
            names: out.list,
            ends,
            records,
        }
    }
}
