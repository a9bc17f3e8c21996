//! Connect's fact search when the semantic nodes do not fit their share of the memory budget.
//!
//! The facts (id, tenant, text) and the vectors of the store's other nodes are spilled to
//! scratch files in the store's `scratch/connect/` folder, then split by a hash of the node id
//! into partitions that each fit the share. A batch of ground queries is scored against one
//! partition at a time: a pass over the facts' texts counts the document frequencies of the
//! batch's terms, then a pass over the partitions, each joined with its vectors, scores every
//! fact against the queries of its tenant and keeps, per query, the `dense_pool` best by cosine
//! and the `bm25_pool` best by BM25, each with both signals. The pool they form is fused as in
//! [`crate::SemanticIndex::hybrid`].
//!
//! Structure is computed once, after the split, from every fact's place (source, group,
//! position) and speaker: each fact's neighbours in its group and its speaker, by ordinal (12
//! bytes a fact, held for the search; about 30 more a fact and each group's key while they are
//! computed), and, with context units, each fact's BM25 text with the previous unit of its
//! group joined (written into its partition in place of its text; a fact's share of the budget
//! counts it).
//!
//! The ranking is the one a [`crate::SemanticIndex`] over all of a tenant's facts gives, bit
//! for bit, units and structure lifts included: a cosine depends on its query and row alone
//! ([`DenseIndex::scores`]), a BM25 score on the tenant's statistics and the fact's own terms
//! (the context text with context units; [`Bm25::scores_in`]), the pool is the
//! same set (ties by id, as the index orders its nodes by id), and min-max fusion does not
//! depend on the pool's order. The scratch files are this run's own: the folder is emptied
//! of them when the search is dropped, and when a later run finds them left by a run that
//! died (the writer lock makes connect the store's only writer).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use candle_core::Device;
use fluxmem_graph::{Node, NodeId};

use crate::bm25::{average_length, query_terms, terms_with, Bm25, Bm25Params};
use crate::dense::DenseIndex;
use crate::fusion::{fuse, Signals};
use crate::retrieve::{
    dense_query_among, lifts, named_speakers, speaker_key, unit_text, RetrievalConfig, Units,
};
use crate::{Error, Result};

/// The folder of connect's scratch files, inside the store's [`fluxmem_store::SCRATCH`].
pub(crate) const FOLDER: &str = "connect";

/// Most partitions (files open at once while splitting); past `MAX_PARTITIONS` times the
/// share, a partition holds more than the share.
pub(crate) const MAX_PARTITIONS: usize = 256;

/// Fact rows scored in one matrix product (bounds the score matrix of a batch).
const BLOCK: usize = 2048;

/// What a fact takes in memory when its partition is loaded: its id and text (held, and as
/// BM25 postings), its vector (raw and normalised), and bookkeeping.
pub(crate) fn fact_bytes(id: &str, text: &str, dim: usize) -> usize {
    id.len() + 3 * text.len() + 8 * dim + 256
}

/// A query of a batch: its tenant, its text and its vector.
pub(crate) struct Query<'a> {
    pub tenant: &'a str,
    pub text: &'a str,
    pub vector: &'a [f32],
}

/// The scratch files of one run, being written: every fact, then the other nodes' vectors.
pub(crate) struct Spill {
    dir: Scratch,
    facts: BufWriter<File>,
    /// Tenants numbered by first sight, as the files hold them.
    numbers: HashMap<String, u32>,
    stats: Vec<Stats>,
    bytes: usize,
    dim: usize,
    units: Units,
    failure: Option<Error>,
}

/// A tenant's collection statistics: facts and their terms in all.
#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    facts: usize,
    terms: u64,
}

/// One fact of a partition: id, tenant, text and time (`created_at`, 0 when unknown), its
/// place in its source, and its speaker as queries name it.
struct Fact {
    id: String,
    tenant: u32,
    text: String,
    time: i64,
    place: Option<Place>,
    speaker: Option<String>,
}

/// Where a fact sits: its source, its group in the source, its position.
struct Place {
    source: String,
    group: Option<String>,
    position: i64,
}

/// No neighbour, no speaker.
const NONE: u32 = u32::MAX;

/// The structure of the spilled facts, by ordinal.
#[derive(Default)]
struct Structure {
    /// The facts before and after each in its group ([`NONE`]: none).
    neighbours: Vec<[u32; 2]>,
    /// Each fact's speaker, an index into its tenant's `speakers` ([`NONE`]: none).
    speaker_of: Vec<u32>,
    /// Per tenant number, its speakers as queries name them, sorted.
    speakers: Vec<Vec<String>>,
}

/// A fact of a loaded partition: its ordinal (its place in the id order of all the facts),
/// text and vector.
type Loaded = (u32, String, Vec<f32>);

/// The facts spilled and split, ready to search.
pub(crate) struct SpilledFacts {
    dir: Scratch,
    partitions: usize,
    numbers: HashMap<String, u32>,
    stats: Vec<Stats>,
    dim: usize,
    model: String,
    units: Units,
    structure: Structure,
}

/// The best candidates of a query so far: (cosine, BM25, ordinal), best first, ties by
/// ordinal (that is, by id).
type Kept = Vec<Row>;

/// A scored fact: (cosine, BM25, ordinal).
type Row = (f32, f32, u32);

fn io<T>(path: &Path, result: std::io::Result<T>) -> Result<T> {
    result.map_err(|source| Error::Scratch {
        path: path.to_path_buf(),
        source,
    })
}

/// Deletes the scratch files connect writes (and nothing else) from `dir`, then `dir` if it is
/// left empty.
pub(crate) fn sweep(dir: &Path) -> Result<()> {
    // A link is not connect's folder: nothing behind it is deleted.
    if std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
        return Ok(());
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if ours(&name) {
            io(&entry.path(), std::fs::remove_file(entry.path()))?;
        }
    }
    // Kept when it holds anything not ours, and so is the store's scratch folder above it.
    if std::fs::remove_dir(dir).is_ok() {
        if let Some(parent) = dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
    Ok(())
}

/// `all.facts`, `all.vectors`, and `p<N>.` `facts`, `vectors`, `ords`, `prev` or `tmp`.
fn ours(name: &str) -> bool {
    let Some((stem, ext)) = name.rsplit_once('.') else {
        return false;
    };
    let stem_ok = stem == "all"
        || stem
            .strip_prefix('p')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    stem_ok && matches!(ext, "facts" | "vectors" | "ords" | "prev" | "tmp")
}

/// A stable partition of a node id (FNV-1a: the same on every machine).
fn partition_of(id: &str, partitions: usize) -> usize {
    let mut hash: u64 = 0xcbf29ce484222325;
    for byte in id.bytes() {
        hash ^= byte as u64;
        hash = hash.wrapping_mul(0x100000001b3);
    }
    (hash % partitions as u64) as usize
}

fn put_str(out: &mut impl Write, s: &str) -> std::io::Result<()> {
    out.write_all(&(s.len() as u32).to_le_bytes())?;
    out.write_all(s.as_bytes())
}

fn put_u32(out: &mut impl Write, v: u32) -> std::io::Result<()> {
    out.write_all(&v.to_le_bytes())
}

/// A fact record: tenant, id, text, time, then a byte of flags (1: a place follows, 2: a
/// group in it, 4: a speaker), the place (source, group, position) and the speaker.
fn put_fact(out: &mut impl Write, fact: &Fact) -> std::io::Result<()> {
    put_u32(out, fact.tenant)?;
    put_str(out, &fact.id)?;
    put_str(out, &fact.text)?;
    out.write_all(&fact.time.to_le_bytes())?;
    let group = fact.place.as_ref().and_then(|p| p.group.as_deref());
    let flags = u8::from(fact.place.is_some())
        | (u8::from(group.is_some()) << 1)
        | (u8::from(fact.speaker.is_some()) << 2);
    out.write_all(&[flags])?;
    if let Some(place) = &fact.place {
        put_str(out, &place.source)?;
        if let Some(group) = group {
            put_str(out, group)?;
        }
        out.write_all(&place.position.to_le_bytes())?;
    }
    if let Some(speaker) = &fact.speaker {
        put_str(out, speaker)?;
    }
    Ok(())
}

fn get_i64(input: &mut impl Read) -> std::io::Result<i64> {
    let mut bytes = [0u8; 8];
    input.read_exact(&mut bytes)?;
    Ok(i64::from_le_bytes(bytes))
}

fn need_string(input: &mut impl Read) -> std::io::Result<String> {
    let len = need_u32(input)?;
    get_string(input, len)
}

/// The next u32, or `None` at the end of the file.
fn get_u32(input: &mut impl Read) -> std::io::Result<Option<u32>> {
    let mut bytes = [0u8; 4];
    match input.read_exact(&mut bytes) {
        Ok(()) => Ok(Some(u32::from_le_bytes(bytes))),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(e),
    }
}

fn get_string(input: &mut impl Read, len: u32) -> std::io::Result<String> {
    let mut bytes = vec![0u8; len as usize];
    input.read_exact(&mut bytes)?;
    String::from_utf8(bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

fn need_u32(input: &mut impl Read) -> std::io::Result<u32> {
    get_u32(input)?.ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "a record is cut short")
    })
}

/// A facts file read record by record.
struct FactReader {
    input: BufReader<File>,
    path: PathBuf,
}

/// A fact with its ordinal in the partition and its stored vector, if it has one.
type NumberedFact = (u32, Fact, Option<Vec<f32>>);
impl FactReader {
    fn open(path: &Path) -> Result<FactReader> {
        Ok(FactReader {
            input: BufReader::new(io(path, File::open(path))?),
            path: path.to_path_buf(),
        })
    }

    /// The next record, or `None` at the end.
    fn next(&mut self) -> Result<Option<Fact>> {
        let input = &mut self.input;
        let record = (|| -> std::io::Result<Option<Fact>> {
            let Some(tenant) = get_u32(input)? else {
                return Ok(None);
            };
            let id = need_string(input)?;
            let text = need_string(input)?;
            let time = get_i64(input)?;
            let mut flags = [0u8; 1];
            input.read_exact(&mut flags)?;
            let place = if flags[0] & 1 != 0 {
                let source = need_string(input)?;
                let group = if flags[0] & 2 != 0 {
                    Some(need_string(input)?)
                } else {
                    None
                };
                Some(Place {
                    source,
                    group,
                    position: get_i64(input)?,
                })
            } else {
                None
            };
            let speaker = if flags[0] & 4 != 0 {
                Some(need_string(input)?)
            } else {
                None
            };
            Ok(Some(Fact {
                id,
                tenant,
                text,
                time,
                place,
                speaker,
            }))
        })();
        io(&self.path, record)
    }
}

/// Reads a facts file's records.
fn read_facts(path: &Path, f: &mut dyn FnMut(Fact)) -> Result<()> {
    let mut reader = FactReader::open(path)?;
    while let Some(fact) = reader.next()? {
        f(fact);
    }
    Ok(())
}

/// Reads a vectors file: (id, vector) records.
fn read_vectors(path: &Path, f: &mut dyn FnMut(String, Vec<f32>)) -> Result<()> {
    let mut input = BufReader::new(io(path, File::open(path))?);
    let mut next = || -> std::io::Result<Option<(String, Vec<f32>)>> {
        let Some(len) = get_u32(&mut input)? else {
            return Ok(None);
        };
        let id = get_string(&mut input, len)?;
        let dim = need_u32(&mut input)? as usize;
        let mut bytes = vec![0u8; dim * 4];
        input.read_exact(&mut bytes)?;
        Ok(Some((
            id,
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        )))
    };
    while let Some((id, vector)) = io(path, next())? {
        f(id, vector);
    }
    Ok(())
}

fn write_vector(out: &mut impl Write, id: &str, vector: &[f32]) -> std::io::Result<()> {
    put_str(out, id)?;
    put_u32(out, vector.len() as u32)?;
    for v in vector {
        out.write_all(&v.to_le_bytes())?;
    }
    Ok(())
}

impl Spill {
    /// Starts the scratch files in `dir` (which connect swept of a dead run's files when it
    /// started), for vectors of `dim` dimensions and facts indexed as `units` says.
    pub(crate) fn create(dir: &Path, dim: usize, units: Units) -> Result<Spill> {
        if std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(Error::Scratch {
                path: dir.to_path_buf(),
                source: std::io::Error::other("a link where connect keeps its scratch files"),
            });
        }
        io(dir, std::fs::create_dir_all(dir))?;
        let path = dir.join("all.facts");
        let facts = BufWriter::new(io(&path, File::create(&path))?);
        Ok(Spill {
            dir: Scratch(dir.to_path_buf()),
            facts,
            numbers: HashMap::new(),
            stats: Vec::new(),
            bytes: 0,
            dim,
            units,
            failure: None,
        })
    }

    /// Spills a fact (a failure is kept for [`Spill::vectors`] to return).
    pub(crate) fn add(&mut self, node: &Node) {
        if self.failure.is_some() {
            return;
        }
        let tenant = match self.numbers.get(&node.tenant) {
            Some(&t) => t,
            None => {
                let t = self.stats.len() as u32;
                self.numbers.insert(node.tenant.clone(), t);
                self.stats.push(Stats::default());
                t
            }
        };
        self.stats[tenant as usize].facts += 1;
        self.bytes += fact_bytes(node.id.as_str(), &node.text, self.dim);
        if self.units.previous {
            // Its context text holds the previous unit's too (held, and as postings): about as
            // much again.
            self.bytes += 3 * node.text.len();
        }
        let place = match &node.body {
            fluxmem_graph::NodeBody::Semantic(s) => Some(Place {
                source: s.source.clone(),
                group: s.group.clone(),
                position: s.position,
            }),
            _ => None,
        };
        let fact = Fact {
            id: node.id.to_string(),
            tenant,
            text: node.text.clone(),
            time: node.created_at.unwrap_or(0),
            place,
            speaker: speaker_key(node),
        };
        if let Err(source) = put_fact(&mut self.facts, &fact) {
            self.failure = Some(Error::Scratch {
                path: self.dir.join("all.facts"),
                source,
            });
        }
    }

    /// Spills every vector of `model` in the store but those of `skip` (the episodes), then
    /// splits facts and vectors into partitions of about `share` bytes each.
    pub(crate) fn vectors(
        mut self,
        store: &fluxmem_store::Store,
        manifest: &fluxmem_store::Manifest,
        model: &str,
        skip: &dyn Fn(&NodeId) -> bool,
        share: usize,
    ) -> Result<SpilledFacts> {
        if let Some(e) = self.failure.take() {
            return Err(e);
        }
        let facts_path = self.dir.join("all.facts");
        io(&facts_path, self.facts.flush())?;
        let vectors_path = self.dir.join("all.vectors");
        let mut out = BufWriter::new(io(&vectors_path, File::create(&vectors_path))?);
        let mut failure = None;
        store
            .live(manifest, "embeddings")?
            .embeddings(&mut |embedding| {
                if failure.is_some() || embedding.model_id != model || skip(&embedding.node_id) {
                    return;
                }
                if let Err(e) =
                    write_vector(&mut out, embedding.node_id.as_str(), &embedding.vector)
                {
                    failure = Some(e);
                }
            })?;
        if let Some(source) = failure {
            return Err(Error::Scratch {
                path: vectors_path,
                source,
            });
        }
        io(&vectors_path, out.flush())?;
        drop(out);
        let partitions = self.bytes.div_ceil(share.max(1)).clamp(2, MAX_PARTITIONS);
        let mut spilled = SpilledFacts {
            dir: self.dir,
            partitions,
            numbers: self.numbers,
            stats: self.stats,
            dim: self.dim,
            model: model.to_string(),
            units: self.units,
            structure: Structure::default(),
        };
        spilled.split(&facts_path, &vectors_path)?;
        spilled.structure()?;
        Ok(spilled)
    }
}

impl SpilledFacts {
    /// Partitions the facts are split into.
    pub(crate) fn partitions(&self) -> usize {
        self.partitions
    }

    fn path(&self, partition: usize, ext: &str) -> PathBuf {
        self.dir.join(format!("p{partition}.{ext}"))
    }

    /// Splits the two spill files by node id into the partitions and deletes them; then sorts
    /// each partition's facts by id and numbers every fact by its place in the id order of
    /// all of them (`p<N>.ords`, one u32 per fact of `p<N>.facts`), so that a candidate is
    /// kept as 12 bytes and ties still break by id.
    fn split(&self, facts: &Path, vectors: &Path) -> Result<()> {
        let open = |ext: &str| self.create_all(ext);
        let mut outs = open("facts")?;
        let mut failure: Option<(usize, std::io::Error)> = None;
        read_facts(facts, &mut |fact| {
            let p = partition_of(&fact.id, self.partitions);
            if let Err(e) = put_fact(&mut outs[p], &fact) {
                failure.get_or_insert((p, e));
            }
        })?;
        self.finish_split(outs, failure.take(), "facts")?;
        let mut outs = open("vectors")?;
        read_vectors(vectors, &mut |id, vector| {
            let p = partition_of(&id, self.partitions);
            if let Err(e) = write_vector(&mut outs[p], &id, &vector) {
                failure.get_or_insert((p, e));
            }
        })?;
        self.finish_split(outs, failure, "vectors")?;
        io(facts, std::fs::remove_file(facts))?;
        io(vectors, std::fs::remove_file(vectors))?;
        // Each partition in id order (it fits the share).
        for p in 0..self.partitions {
            let mut facts: Vec<Fact> = Vec::new();
            read_facts(&self.path(p, "facts"), &mut |fact| facts.push(fact))?;
            facts.sort_by(|a, b| a.id.cmp(&b.id));
            let tmp = self.path(p, "tmp");
            let mut out = BufWriter::new(io(&tmp, File::create(&tmp))?);
            for fact in &facts {
                io(&tmp, put_fact(&mut out, fact))?;
            }
            io(&tmp, out.flush())?;
            drop(out);
            io(&tmp, std::fs::rename(&tmp, self.path(p, "facts")))?;
        }
        // The ordinals: a merge of the sorted partitions.
        let mut readers: Vec<FactReader> = (0..self.partitions)
            .map(|p| FactReader::open(&self.path(p, "facts")))
            .collect::<Result<_>>()?;
        let mut ords = open("ords")?;
        let mut heads: std::collections::BinaryHeap<std::cmp::Reverse<(String, usize)>> =
            Default::default();
        for (p, reader) in readers.iter_mut().enumerate() {
            if let Some(fact) = reader.next()? {
                heads.push(std::cmp::Reverse((fact.id, p)));
            }
        }
        let mut ordinal: u32 = 0;
        while let Some(std::cmp::Reverse((_, p))) = heads.pop() {
            io(&self.path(p, "ords"), put_u32(&mut ords[p], ordinal))?;
            ordinal = ordinal.checked_add(1).expect("fewer than 2^32 facts");
            if let Some(fact) = readers[p].next()? {
                heads.push(std::cmp::Reverse((fact.id, p)));
            }
        }
        self.finish_split(ords, None, "ords")
    }

    /// A new file `p<N>.<ext>` for every partition.
    fn create_all(&self, ext: &str) -> Result<Vec<BufWriter<File>>> {
        (0..self.partitions)
            .map(|p| self.path(p, ext))
            .map(|path| Ok(BufWriter::new(io(&path, File::create(&path))?)))
            .collect()
    }

    /// Every fact's neighbours in its group and its speaker, by ordinal, and the tenants'
    /// BM25 statistics of the facts as the units index them; with context units, each fact's
    /// text in its partition is replaced by its BM25 text (the previous unit of its group
    /// joined, [`unit_text`]). Groups are a tenant's facts of one source and group, ordered by
    /// position, then id (ordinal), as [`crate::SemanticIndex`] orders them.
    fn structure(&mut self) -> Result<()> {
        let total: usize = self.stats.iter().map(|s| s.facts).sum();
        let stem = self.units.stem;
        let all: HashSet<u32> = (0..self.stats.len() as u32).collect();
        let mut groups: HashMap<(u32, String, Option<String>), u32> = HashMap::new();
        // (group, position, ordinal) of every fact with a place.
        let mut members: Vec<(u32, i64, u32)> = Vec::new();
        let mut tenant_of = vec![0u32; total];
        let mut own_terms = vec![0u32; total];
        let mut partition_of_fact = vec![0u16; total];
        let mut speaker_names: HashMap<String, u32> = HashMap::new();
        let mut speaker_name_of = vec![NONE; total];
        for p in 0..self.partitions {
            self.numbered(p, &all, &mut |ordinal, fact| {
                let o = ordinal as usize;
                tenant_of[o] = fact.tenant;
                own_terms[o] = terms_with(&fact.text, stem).len() as u32;
                partition_of_fact[o] = p as u16;
                if let Some(place) = fact.place {
                    let next = groups.len() as u32;
                    let group = *groups
                        .entry((fact.tenant, place.source, place.group))
                        .or_insert(next);
                    members.push((group, place.position, ordinal));
                }
                if let Some(speaker) = fact.speaker {
                    let next = speaker_names.len() as u32;
                    speaker_name_of[o] = *speaker_names.entry(speaker).or_insert(next);
                }
            })?;
        }
        drop(groups);
        members.sort_unstable();
        let mut neighbours = vec![[NONE, NONE]; total];
        for pair in members.windows(2) {
            if pair[0].0 == pair[1].0 {
                let (a, b) = (pair[0].2, pair[1].2);
                neighbours[a as usize][1] = b;
                neighbours[b as usize][0] = a;
            }
        }
        drop(members);
        let (speakers, speaker_of) = tenant_speakers(
            &speaker_names,
            &speaker_name_of,
            &tenant_of,
            self.stats.len(),
        );
        for stats in &mut self.stats {
            stats.terms = 0;
        }
        for (o, &tenant) in tenant_of.iter().enumerate() {
            let before = neighbours[o][0];
            let joined = if self.units.previous && before != NONE {
                own_terms[before as usize]
            } else {
                0
            };
            self.stats[tenant as usize].terms += u64::from(own_terms[o]) + u64::from(joined);
        }
        if self.units.previous {
            self.join_previous(&neighbours, &partition_of_fact)?;
        }
        self.structure = Structure {
            neighbours,
            speaker_of,
            speakers,
        };
        Ok(())
    }

    /// Replaces each fact's text in its partition with its text and the previous unit's of its
    /// group: the previous texts are first routed to the partitions of the facts they precede
    /// (`p<N>.prev`), then each partition is written again with them.
    fn join_previous(&self, neighbours: &[[u32; 2]], partition_of_fact: &[u16]) -> Result<()> {
        let all: HashSet<u32> = (0..self.stats.len() as u32).collect();
        let mut outs = self.create_all("prev")?;
        let mut failure: Option<(usize, std::io::Error)> = None;
        for p in 0..self.partitions {
            self.numbered(p, &all, &mut |ordinal, fact| {
                let next = neighbours[ordinal as usize][1];
                if next == NONE {
                    return;
                }
                let q = partition_of_fact[next as usize] as usize;
                let written =
                    put_u32(&mut outs[q], next).and_then(|()| put_str(&mut outs[q], &fact.text));
                if let Err(e) = written {
                    failure.get_or_insert((q, e));
                }
            })?;
        }
        self.finish_split(outs, failure.take(), "prev")?;
        for p in 0..self.partitions {
            let prev_path = self.path(p, "prev");
            let mut before: HashMap<u32, String> = HashMap::new();
            {
                let mut input = BufReader::new(io(&prev_path, File::open(&prev_path))?);
                while let Some(ordinal) = io(&prev_path, get_u32(&mut input))? {
                    before.insert(ordinal, io(&prev_path, need_string(&mut input))?);
                }
            }
            let tmp = self.path(p, "tmp");
            let mut out = BufWriter::new(io(&tmp, File::create(&tmp))?);
            self.numbered(p, &all, &mut |ordinal, mut fact| {
                fact.text = unit_text(&fact.text, before.get(&ordinal).map(String::as_str));
                if let Err(e) = put_fact(&mut out, &fact) {
                    failure.get_or_insert((p, e));
                }
            })?;
            if let Some((_, source)) = failure.take() {
                return Err(Error::Scratch { path: tmp, source });
            }
            io(&tmp, out.flush())?;
            drop(out);
            io(&tmp, std::fs::rename(&tmp, self.path(p, "facts")))?;
            io(&prev_path, std::fs::remove_file(&prev_path))?;
        }
        Ok(())
    }

    /// What the dense signal reads of `query` from `tenant` ([`crate::SemanticIndex::dense_query`]).
    pub(crate) fn dense_query(
        &self,
        tenant: &str,
        query: &str,
        config: &RetrievalConfig,
    ) -> Option<String> {
        let t = self.tenant_number(tenant)?;
        dense_query_among(&self.structure.speakers[t as usize], query, config)
    }

    fn finish_split(
        &self,
        outs: Vec<BufWriter<File>>,
        failure: Option<(usize, std::io::Error)>,
        ext: &str,
    ) -> Result<()> {
        if let Some((p, source)) = failure {
            return Err(Error::Scratch {
                path: self.path(p, ext),
                source,
            });
        }
        for (p, mut out) in outs.into_iter().enumerate() {
            io(&self.path(p, ext), out.flush())?;
        }
        Ok(())
    }

    fn tenant_number(&self, tenant: &str) -> Option<u32> {
        self.numbers.get(tenant).copied()
    }

    /// The facts of partition `p` (in id order) with their ordinals, those of `tenants` only.
    fn numbered(
        &self,
        p: usize,
        tenants: &HashSet<u32>,
        f: &mut dyn FnMut(u32, Fact),
    ) -> Result<()> {
        let path = self.path(p, "ords");
        let mut ords = BufReader::new(io(&path, File::open(&path))?);
        let mut failure = None;
        read_facts(
            &self.path(p, "facts"),
            &mut |fact| match get_u32(&mut ords) {
                Ok(Some(ordinal)) if failure.is_none() => {
                    if tenants.contains(&fact.tenant) {
                        f(ordinal, fact);
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => {
                    failure.get_or_insert(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "fewer ordinals than facts",
                    ));
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            },
        )?;
        failure.map_or(Ok(()), |source| Err(Error::Scratch { path, source }))
    }

    /// The facts of `tenants` in partition `p` (in id order), each with its ordinal and its
    /// vector of the model if it has one.
    fn joined(&self, p: usize, tenants: &HashSet<u32>) -> Result<Vec<NumberedFact>> {
        let mut facts: Vec<(u32, Fact)> = Vec::new();
        self.numbered(p, tenants, &mut |ordinal, fact| facts.push((ordinal, fact)))?;
        let wanted: HashSet<&str> = facts.iter().map(|(_, f)| f.id.as_str()).collect();
        let mut vectors: HashMap<String, Vec<f32>> = HashMap::new();
        read_vectors(&self.path(p, "vectors"), &mut |id, vector| {
            if wanted.contains(id.as_str()) {
                vectors.insert(id, vector);
            }
        })?;
        drop(wanted);
        Ok(facts
            .into_iter()
            .map(|(ordinal, fact)| {
                let vector = vectors.remove(&fact.id);
                (ordinal, fact, vector)
            })
            .collect())
    }

    /// What is wrong with a fact's vector, if anything: none, or not of the model's dimension.
    fn problem(&self, id: &str, vector: Option<&[f32]>) -> Option<Error> {
        match vector {
            None => Some(Error::NotEmbedded {
                node: id.to_string(),
                model: self.model.clone(),
            }),
            Some(v) if v.len() != self.dim => Some(Error::Dimension {
                node: id.to_string(),
                model: self.model.clone(),
                expected: self.dim,
                got: v.len(),
            }),
            Some(_) => None,
        }
    }

    /// Loads partition `p`: the facts of `tenants` with their vectors, by tenant, in id order.
    /// A fact without a sound vector ([`SpilledFacts::check`] names the first) is an error.
    fn load(&self, p: usize, tenants: &HashSet<u32>) -> Result<BTreeMap<u32, Vec<Loaded>>> {
        let mut out: BTreeMap<u32, Vec<Loaded>> = BTreeMap::new();
        for (ordinal, fact, vector) in self.joined(p, tenants)? {
            if let Some(problem) = self.problem(&fact.id, vector.as_deref()) {
                return Err(problem);
            }
            out.entry(fact.tenant).or_default().push((
                ordinal,
                fact.text,
                vector.expect("checked"),
            ));
        }
        Ok(out)
    }

    /// Checks that every fact of `tenants` has a vector of the model's dimension. As the
    /// whole indexes are built, tenant by tenant in name order, each over its facts in id
    /// order, the first fact named is the first in id order of the first such tenant.
    pub(crate) fn check(&self, tenants: &[&str]) -> Result<()> {
        let numbers: HashSet<u32> = tenants
            .iter()
            .filter_map(|t| self.tenant_number(t))
            .collect();
        // Per tenant, its first fact (in id order) without a sound vector.
        let mut first: BTreeMap<u32, (String, Error)> = BTreeMap::new();
        for p in 0..self.partitions {
            for (_, fact, vector) in self.joined(p, &numbers)? {
                let Some(problem) = self.problem(&fact.id, vector.as_deref()) else {
                    continue;
                };
                if first
                    .get(&fact.tenant)
                    .is_none_or(|(known, _)| fact.id < *known)
                {
                    first.insert(fact.tenant, (fact.id, problem));
                }
            }
        }
        let by_name = tenants
            .iter()
            .filter_map(|t| self.tenant_number(t).map(|n| (*t, n)))
            .collect::<BTreeMap<&str, u32>>();
        match by_name.values().find_map(|n| first.remove(n)) {
            Some((_, problem)) => Err(problem),
            None => Ok(()),
        }
    }

    /// The fused ranking of each query's pool, its best `take` (node, score, node time), best
    /// first, ties by id. The queries are taken in batches whose pools fit `share` bytes, each
    /// batch with its own passes over the partitions.
    pub(crate) fn search(
        &self,
        queries: &[Query<'_>],
        config: &RetrievalConfig,
        take: usize,
        share: usize,
        device: &Device,
    ) -> Result<Vec<Vec<(NodeId, f32, i64)>>> {
        let per_query = (config.dense_pool + config.bm25_pool) * std::mem::size_of::<Row>() * 2
            + self.dim * 8
            + 1024;
        let batch = (share / per_query).max(1);
        let mut out = Vec::with_capacity(queries.len());
        for part in queries.chunks(batch) {
            out.extend(self.search_batch(part, config, take, device)?);
        }
        Ok(out)
    }

    fn search_batch(
        &self,
        queries: &[Query<'_>],
        config: &RetrievalConfig,
        take: usize,
        device: &Device,
    ) -> Result<Vec<Vec<(NodeId, f32, i64)>>> {
        let params = Bm25Params {
            stem: self.units.stem,
            ..Bm25Params::default()
        };
        // Each query's tenant (None: a tenant without facts) and terms.
        let tenant_of: Vec<Option<u32>> = queries
            .iter()
            .map(|q| self.tenant_number(q.tenant))
            .collect();
        let terms: Vec<Vec<String>> = queries
            .iter()
            .map(|q| query_terms(q.text, params.stem))
            .collect();
        let mut wanted: HashMap<u32, HashSet<&str>> = HashMap::new();
        for (tenant, terms) in tenant_of.iter().zip(&terms) {
            if let Some(t) = tenant {
                wanted
                    .entry(*t)
                    .or_default()
                    .extend(terms.iter().map(String::as_str));
            }
        }
        // Document frequencies of the batch's terms, per tenant.
        let mut df: HashMap<u32, HashMap<String, usize>> = HashMap::new();
        for p in 0..self.partitions {
            read_facts(&self.path(p, "facts"), &mut |fact| {
                let Some(terms) = wanted.get(&fact.tenant) else {
                    return;
                };
                let counts = df.entry(fact.tenant).or_default();
                let mut seen: HashSet<String> = HashSet::new();
                for term in terms_with(&fact.text, params.stem) {
                    if terms.contains(term.as_str()) && seen.insert(term.clone()) {
                        *counts.entry(term).or_default() += 1;
                    }
                }
            })?;
        }
        let tenants: HashSet<u32> = wanted.keys().copied().collect();
        let mut dense_kept: Vec<Kept> = vec![Vec::new(); queries.len()];
        let mut bm25_kept: Vec<Kept> = vec![Vec::new(); queries.len()];
        for p in 0..self.partitions {
            for (tenant, facts) in self.load(p, &tenants)? {
                let asked: Vec<usize> = (0..queries.len())
                    .filter(|&q| tenant_of[q] == Some(tenant))
                    .collect();
                let stats = self.stats[tenant as usize];
                let average = average_length(stats.terms, stats.facts);
                let no_df = HashMap::new();
                let tenant_df = df.get(&tenant).unwrap_or(&no_df);
                let query_vectors: Vec<Vec<f32>> =
                    asked.iter().map(|&q| queries[q].vector.to_vec()).collect();
                for block in facts.chunks(BLOCK) {
                    let texts: Vec<&str> = block.iter().map(|(_, text, _)| text.as_str()).collect();
                    let bm25 = Bm25::new(&texts, params);
                    let vectors: Vec<Vec<f32>> = block.iter().map(|(_, _, v)| v.clone()).collect();
                    let index = DenseIndex::new(&vectors, self.dim, device)?;
                    drop(vectors);
                    for (&q, cosines) in asked.iter().zip(index.scores(&query_vectors)?) {
                        let lexical =
                            bm25.scores_in(queries[q].text, stats.facts, average, &|term| {
                                tenant_df.get(term).copied().unwrap_or(0)
                            });
                        let rows: Vec<Row> = block
                            .iter()
                            .zip(cosines)
                            .zip(lexical)
                            .map(|(((ordinal, _, _), d), b)| (d, b, *ordinal))
                            .collect();
                        keep(
                            &mut dense_kept[q],
                            &rows,
                            config.dense_pool,
                            |r| r.0,
                            |_| true,
                        );
                        keep(
                            &mut bm25_kept[q],
                            &rows,
                            config.bm25_pool,
                            |r| r.1,
                            |r| r.1 > 0.0,
                        );
                    }
                }
            }
        }
        let named: Vec<Vec<u32>> = queries
            .iter()
            .zip(&tenant_of)
            .map(|(q, tenant)| match tenant {
                Some(t) if config.entity > 0.0 => {
                    named_speakers(&self.structure.speakers[*t as usize], q.text)
                }
                _ => Vec::new(),
            })
            .collect();
        let ranked: Vec<Vec<(u32, f32)>> = dense_kept
            .into_iter()
            .zip(bm25_kept)
            .zip(&named)
            .map(|((dense, bm25), named)| fused(dense, bm25, config, take, &self.structure, named))
            .collect();
        // The ids and times of the facts ranked.
        let mut named: HashMap<u32, (NodeId, i64)> = ranked
            .iter()
            .flatten()
            .map(|&(ordinal, _)| (ordinal, (NodeId(String::new()), 0)))
            .collect();
        for p in 0..self.partitions {
            self.numbered(p, &tenants, &mut |ordinal, fact| {
                if let Some(slot) = named.get_mut(&ordinal) {
                    *slot = (NodeId(fact.id), fact.time);
                }
            })?;
        }
        Ok(ranked
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .map(|(ordinal, score)| {
                        let (id, time) = named[&ordinal].clone();
                        (id, score, time)
                    })
                    .collect()
            })
            .collect())
    }
}

/// The scratch folder of a run: swept of the run's files when dropped, whether the run ends
/// or fails.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = sweep(&self.0);
    }
}

/// Keeps in `kept` the `k` best of `kept` and `rows` by `score` (ties by ordinal) among the
/// rows `admit` lets in.
fn keep(
    kept: &mut Kept,
    rows: &[Row],
    k: usize,
    score: impl Fn(&Row) -> f32,
    admit: impl Fn(&Row) -> bool,
) {
    if k == 0 {
        return;
    }
    let order = |a: &Row, b: &Row| score(b).total_cmp(&score(a)).then(a.2.cmp(&b.2));
    // Only a row at least as good as the `k`-th kept can enter (an equal score may win its
    // tie by ordinal).
    let floor = (kept.len() == k).then(|| score(&kept[k - 1]));
    let mut ranked: Vec<Row> = rows
        .iter()
        .filter(|r| admit(r) && floor.is_none_or(|f| score(r).total_cmp(&f).is_ge()))
        .copied()
        .collect();
    if ranked.is_empty() {
        return;
    }
    if k < ranked.len() {
        ranked.select_nth_unstable_by(k - 1, order);
        ranked.truncate(k);
    }
    kept.extend(ranked);
    kept.sort_by(order);
    kept.truncate(k);
}

/// Per tenant number, its speakers (sorted names), and each fact's speaker as an index into
/// its tenant's list, from the facts' speaker names (`names`, interned; `name_of` by ordinal).
fn tenant_speakers(
    names: &HashMap<String, u32>,
    name_of: &[u32],
    tenant_of: &[u32],
    tenants: usize,
) -> (Vec<Vec<String>>, Vec<u32>) {
    let mut by_number: Vec<&str> = vec![""; names.len()];
    for (name, &n) in names {
        by_number[n as usize] = name;
    }
    let mut speakers: Vec<Vec<String>> = vec![Vec::new(); tenants];
    for (&name, &tenant) in name_of.iter().zip(tenant_of) {
        if name != NONE {
            speakers[tenant as usize].push(by_number[name as usize].to_string());
        }
    }
    for list in &mut speakers {
        list.sort_unstable();
        list.dedup();
    }
    let speaker_of = name_of
        .iter()
        .zip(tenant_of)
        .map(|(&name, &tenant)| {
            if name == NONE {
                return NONE;
            }
            let list = &speakers[tenant as usize];
            list.binary_search_by(|s| s.as_str().cmp(by_number[name as usize]))
                .expect("listed") as u32
        })
        .collect();
    (speakers, speaker_of)
}

/// The pool of a query (its dense and BM25 candidates), fused, lifted by structure (the
/// query's `named` speakers) and ranked: the best `take` (ordinal, score).
fn fused(
    dense: Kept,
    bm25: Kept,
    config: &RetrievalConfig,
    take: usize,
    structure: &Structure,
    named: &[u32],
) -> Vec<(u32, f32)> {
    // In ordinal order, that is in id order, as the index holds its pool.
    let mut pool: BTreeMap<u32, (f32, f32)> = BTreeMap::new();
    for (d, b, ordinal) in dense.into_iter().chain(bm25) {
        pool.insert(ordinal, (d, b));
    }
    let signals: Vec<Signals> = pool
        .values()
        .map(|&(dense, bm25)| Signals {
            dense,
            bm25,
            judge: None,
        })
        .collect();
    let scores = fuse(config.fusion, &config.weights, &signals);
    let ordinals: Vec<u32> = pool.into_keys().collect();
    let slot = |o: u32| {
        (o != NONE)
            .then(|| ordinals.binary_search(&o).ok())
            .flatten()
    };
    let lift = lifts(
        &scores,
        |k| structure.neighbours[ordinals[k] as usize].map(slot),
        |k| {
            let s = structure.speaker_of[ordinals[k] as usize];
            s != NONE && named.binary_search(&s).is_ok()
        },
        config,
        !named.is_empty(),
    );
    let mut ranked: Vec<(u32, f32)> = ordinals
        .iter()
        .zip(scores)
        .zip(lift)
        .map(|((&o, fused), lift)| (o, fused + lift.total()))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.truncate(take);
    ranked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_its_own_scratch_files_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let scratch = dir.path().join("connect");
        std::fs::create_dir_all(&scratch).unwrap();
        for name in ["all.facts", "all.vectors", "p0.facts", "p12.vectors"] {
            std::fs::write(scratch.join(name), b"x").unwrap();
        }
        std::fs::write(scratch.join("notes.txt"), b"keep").unwrap();
        std::fs::write(scratch.join("p.facts"), b"keep").unwrap();
        sweep(&scratch).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&scratch)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["notes.txt", "p.facts"]);
        std::fs::remove_file(scratch.join("notes.txt")).unwrap();
        std::fs::remove_file(scratch.join("p.facts")).unwrap();
        std::fs::write(scratch.join("p3.facts"), b"x").unwrap();
        sweep(&scratch).unwrap();
        assert!(
            !scratch.exists() && !dir.path().exists(),
            "an emptied folder goes too, and its emptied parent"
        );
    }
}
