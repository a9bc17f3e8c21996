use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

use crate::error::IoContext;
use crate::{Error, Result};

/// The tables a tenant's vector index is made from.
pub const INDEXED_TABLES: [&str; 3] = ["nodes", "embeddings", "edges"];

/// The format of the tenant index files this build writes and reads; an index of another
/// format is not current, and is made again from the shards.
pub const INDEX_FORMAT: u32 = 2;

/// The store format name written in every manifest.
pub const FORMAT: &str = "fluxmem-store";
/// The schema version this build writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

/// The manifest: the one file that says what a commit of the store contains.
///
/// It is written last, by atomic rename, so a reader sees either the previous commit or the new
/// one. Shards not listed here are leftovers of an interrupted commit and are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Schema version of the shards.
    pub schema_version: u32,
    /// Commit counter: 0 for an empty store, +1 per commit.
    pub version: u64,
    /// The embedding model of every stored embedding, once there is one.
    pub embedding_model: Option<EmbeddingModel>,
    /// Every live shard, in commit order (later rows win for the same key).
    pub shards: Vec<ShardEntry>,
    /// One record per commit.
    pub commits: Vec<CommitRecord>,
    /// Per-stage progress markers (what each stage has finished), for incremental runs.
    #[serde(default)]
    pub progress: BTreeMap<String, Value>,
    /// Shard files a compaction took out of the manifest, kept on disk for readers of an
    /// earlier manifest until a later commit deletes them (see `compact`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retired: Vec<RetiredShard>,
    /// The live row counts, exact as of commit `version` (see [`LiveCounts`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_counts: Option<LiveCounts>,
    /// Tenant vector indexes (`indexes/`, derived data: see the `index` module), at most one
    /// per tenant and model. One is used only while it is current ([`Manifest::current_index`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub indexes: Vec<IndexEntry>,
}

/// One tenant's index file: the ids and vectors of its episodic and semantic nodes for one
/// embedding model, and the ground and distill edges of its episodes, as of commit `version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexEntry {
    /// The tenant.
    pub tenant: String,
    /// The embedding model of its vectors.
    pub model: String,
    /// Path relative to the store directory (`indexes/...`).
    pub file: String,
    /// Bytes in the file.
    pub bytes: u64,
    /// CRC-32 of the file's bytes, checked when a writer reads a previous index whole. (A
    /// query maps the file and checks CRC-32s the file holds: of its head, and of each
    /// episode's edges it reads; a SHA-256 of the head would cost as much as the query.)
    pub crc32: u32,
    /// The manifest version whose rows it holds.
    pub version: u64,
    /// The file's format ([`INDEX_FORMAT`]; 1, the vectors alone, when absent).
    #[serde(default = "first_index_format")]
    pub format: u32,
}

fn first_index_format() -> u32 {
    1
}

/// Live node, active edge and embedded node counts that hold for one commit, so `stats` reads
/// them from the manifest instead of the key columns of every shard.
///
/// They are set by compaction (which reads every key index anyway) and carried forward only
/// by commits that add rows under keys the store does not hold ([`crate::Writer::commit_new`]:
/// ingest's new nodes, embed's new vectors). Any other commit leaves them behind at an older
/// version, where they no longer count: readers then count from the shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveCounts {
    /// The commit the counts hold for.
    pub version: u64,
    /// The counts.
    pub stats: fluxmem_graph::GraphStats,
}

/// A shard or index file that left the manifest and waits for deletion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredShard {
    /// Path relative to the store directory.
    pub file: String,
    /// The manifest version that dropped it.
    pub version: u64,
    /// When it was dropped (Unix milliseconds); absent in manifests written before this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_ms: Option<i64>,
}

/// The model behind the stored embeddings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbeddingModel {
    /// Model id.
    pub id: String,
    /// Vector dimension.
    pub dim: usize,
}

/// One shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// `nodes`, `steps`, `edges` or `embeddings`.
    pub table: String,
    /// Path relative to the store directory.
    pub file: String,
    /// Rows in the file.
    pub rows: u64,
    /// Bytes in the file.
    pub bytes: u64,
    /// SHA-256 of the file.
    pub sha256: String,
    /// The commit that wrote it.
    pub commit: u64,
    /// For a compaction's output: the oldest commit whose rows it holds (the `commit`, or the
    /// `rows_from`, of the oldest shard it merged). Absent for a commit's own shard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_from: Option<u64>,
    /// For a compaction's output: the newest commit whose rows it holds. Absent for a
    /// commit's own shard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_through: Option<u64>,
    /// The tenants whose rows the shard holds, sorted, when the writer knew them all and they
    /// are at most [`ShardEntry::MAX_TENANTS`]; absent otherwise (a shard written before this
    /// was recorded, rows whose nodes the writer could not place, more tenants than that).
    /// A reader of one tenant skips a shard whose list does not name it, unopened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<String>>,
}

impl ShardEntry {
    /// The most tenants a shard's entry names: every command reads the manifest, so a shard of
    /// many tenants' rows records none (it is read as holding any) rather than make the
    /// manifest grow with the fleet. 64 short names stay within a few times an entry's other
    /// fields.
    pub const MAX_TENANTS: usize = 64;

    /// Whether the shard may hold rows of `tenant`: unless its entry names its tenants and
    /// not this one.
    pub fn may_hold(&self, tenant: &str) -> bool {
        self.tenants
            .as_ref()
            .is_none_or(|tenants| tenants.binary_search_by(|t| t.as_str().cmp(tenant)).is_ok())
    }

    /// The list to record for a shard whose rows' tenants are `tenants` (`None`: some row's
    /// tenant is unknown): sorted and without repeats, or `None` past [`Self::MAX_TENANTS`].
    pub fn tenant_list<'a>(
        tenants: Option<impl IntoIterator<Item = &'a str>>,
    ) -> Option<Vec<String>> {
        let set: std::collections::BTreeSet<&str> = tenants?.into_iter().collect();
        (set.len() <= Self::MAX_TENANTS).then(|| set.into_iter().map(str::to_string).collect())
    }

    /// The list to record for a shard whose rows come from `members`: the union of their
    /// lists ([`Self::tenant_list`]), `None` when one of them names none.
    pub fn union_of_tenants<'a>(
        members: impl IntoIterator<Item = &'a ShardEntry>,
    ) -> Option<Vec<String>> {
        let named: Option<Vec<&str>> = members.into_iter().try_fold(Vec::new(), |mut all, m| {
            all.extend(m.tenants.as_ref()?.iter().map(String::as_str));
            Some(all)
        });
        Self::tenant_list(named)
    }

    /// The commits whose rows the shard holds, oldest and newest: its own commit for a
    /// commit's shard; for a compaction's output, the span of the shards it merged.
    pub fn rows_span(&self) -> (u64, u64) {
        (
            self.rows_from.unwrap_or(self.commit),
            self.rows_through.unwrap_or(self.commit),
        )
    }
}

/// What the commits after a version added ([`Manifest::since`]), as two manifests cut to
/// those shards.
#[derive(Debug, Clone)]
pub struct Since {
    /// Shards whose every row was committed after the version.
    pub added: Manifest,
    /// Shards that may hold rows from before the version too.
    pub mixed: Manifest,
}

/// What a commit was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommitRecord {
    /// The manifest version it produced.
    pub version: u64,
    /// The stage that committed (`ingest`, `embed`...).
    pub stage: String,
    /// The run id.
    pub run_id: String,
    /// When (RFC 3339, UTC).
    pub at: String,
    /// Stage-specific counts.
    pub summary: Value,
}

impl Manifest {
    /// The manifest of a store with nothing in it.
    pub fn empty() -> Manifest {
        Manifest {
            format: FORMAT.into(),
            schema_version: SCHEMA_VERSION,
            version: 0,
            embedding_model: None,
            shards: Vec::new(),
            commits: Vec::new(),
            progress: BTreeMap::new(),
            retired: Vec::new(),
            live_counts: Some(LiveCounts {
                version: 0,
                stats: fluxmem_graph::GraphStats::default(),
            }),
            indexes: Vec::new(),
        }
    }

    /// Takes the index entries `which` selects out of the manifest and retires their files as
    /// of the next commit (deleted like compacted shards, two commits and a grace period
    /// later): `replace` and a lossy `recover` retire them all, a newer index the one it
    /// replaces.
    pub(crate) fn retire_indexes(&mut self, which: impl Fn(&IndexEntry) -> bool) {
        let at_ms = Some(chrono::Utc::now().timestamp_millis());
        let version = self.version + 1;
        let (retired, kept): (Vec<IndexEntry>, Vec<IndexEntry>) = std::mem::take(&mut self.indexes)
            .into_iter()
            .partition(|e| which(e));
        self.indexes = kept;
        self.retired
            .extend(retired.into_iter().map(|e| RetiredShard {
                file: e.file,
                version,
                at_ms,
            }));
    }

    /// The index of `tenant` for `model` if it is current: of this build's format, and no
    /// shard of [`INDEXED_TABLES`] committed after the version it holds may hold the tenant's
    /// rows. (A compaction of older rows keeps it current; any new row of the tenant, or a
    /// shard that does not name its tenants, makes it stale.)
    pub fn current_index(&self, tenant: &str, model: &str) -> Option<&IndexEntry> {
        let entry = self.index_entry(tenant, model)?;
        let since = self.since(entry.version, &INDEXED_TABLES);
        let mut newer = since.added.shards.iter().chain(&since.mixed.shards);
        newer.all(|s| !s.may_hold(tenant)).then_some(entry)
    }

    /// The listed index of `tenant` for `model` in this build's format ([`INDEX_FORMAT`]),
    /// current or not.
    pub fn index_entry(&self, tenant: &str, model: &str) -> Option<&IndexEntry> {
        (self.indexes.iter())
            .find(|e| e.tenant == tenant && e.model == model && e.format == INDEX_FORMAT)
    }

    /// The live counts, if they hold for this manifest's commit.
    pub fn current_counts(&self) -> Option<fluxmem_graph::GraphStats> {
        self.live_counts
            .filter(|c| c.version == self.version)
            .map(|c| c.stats)
    }

    /// What the commits after `version` added to `tables` (a stage that has seen the store at
    /// `version` reads these only): the shards whose rows all came after it (`added`), and
    /// those that may mix rows from both sides (`mixed`: a compaction merged them, or a shard
    /// whose span is not known, such as a compaction output of an older build or a shard
    /// recovery found on disk). Every row committed after `version` is in one of the two.
    pub fn since(&self, version: u64, tables: &[&str]) -> Since {
        let compactions: std::collections::BTreeSet<u64> = self
            .commits
            .iter()
            .filter(|c| c.stage == "compact")
            .map(|c| c.version)
            .collect();
        let recorded: std::collections::BTreeSet<u64> =
            self.commits.iter().map(|c| c.version).collect();
        let cut = |shards: Vec<ShardEntry>| Manifest {
            shards,
            commits: Vec::new(),
            progress: BTreeMap::new(),
            retired: Vec::new(),
            live_counts: None,
            indexes: Vec::new(),
            ..self.clone()
        };
        let (mut added, mut mixed) = (Vec::new(), Vec::new());
        for entry in self
            .shards
            .iter()
            .filter(|s| tables.contains(&s.table.as_str()))
        {
            let (from, through) = entry.rows_span();
            if through <= version {
                continue;
            }
            // A shard without a span is a commit's own only if its commit is on record and
            // was not a compaction.
            let own = entry.rows_from.is_some()
                || (recorded.contains(&entry.commit) && !compactions.contains(&entry.commit));
            if from > version && own {
                added.push(entry.clone());
            } else {
                mixed.push(entry.clone());
            }
        }
        Since {
            added: cut(added),
            mixed: cut(mixed),
        }
    }

    /// Reads and checks the manifest at `path`.
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = std::fs::read(path).at(path)?;
        let value: Value = serde_json::from_slice(&text).map_err(|e| Error::Corrupt {
            path: path.into(),
            reason: format!("manifest is not JSON: {e}"),
        })?;
        if value.get("format").and_then(Value::as_str) != Some(FORMAT) {
            return Err(Error::Corrupt {
                path: path.into(),
                reason: format!("not a {FORMAT} manifest"),
            });
        }
        let found = value
            .get("schema_version")
            .and_then(Value::as_u64)
            .unwrap_or(0) as u32;
        if found != SCHEMA_VERSION {
            return Err(Error::UnsupportedVersion {
                path: path.into(),
                found,
                supported: SCHEMA_VERSION,
            });
        }
        serde_json::from_value(value).map_err(|e| Error::Corrupt {
            path: path.into(),
            reason: format!("bad manifest: {e}"),
        })
    }
}
