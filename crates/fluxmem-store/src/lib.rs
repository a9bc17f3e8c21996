//! The embedded fluxmem store: a local directory of Parquet shards plus a manifest.
//!
//! Layout:
//! ```text
//! <store>/manifest.json          the commit: schema version, shard list with rows + sha256
//! <store>/shards/<table>-<commit>-<part>-<sha>.parquet
//! <store>/keys/<shard file name>.keys   a keyed shard's row keys, hashed (derived; see keys.rs)
//! <store>/indexes/<name>.fxvi    a tenant's episode and fact vectors (derived; see index.rs)
//! <store>/LOCK                   the writer lock (OS advisory lock + holder description)
//! <store>/staging/<stage>-<I>-of-<N>/   a shard's staging store (sharded runs, see below)
//! ```
//! A commit writes and syncs its new shards, then replaces `manifest.json` by atomic rename
//! (tantivy's `meta.json` pattern). Readers ([`Store`]) take no lock and see either the old
//! commit or the new one. Every shard is verified against the manifest's checksum, table tag,
//! schema version and row count when read; a mismatch is [`Error::Corrupt`] naming the file.
//! One [`Writer`] at a time: a second one gets [`Error::Locked`]; a lock left by a crashed
//! writer is taken over and reported through [`Writer::stale_lock`].
//!
//! Safety: a commit replaces the manifest only if it is still the one the writer read or wrote
//! last (compare and swap on its SHA-256), so a writer whose lock was lost fails with
//! [`Error::Conflict`] instead of overwriting another writer's commit. On open, a writer
//! deletes only what an interrupted commit on top of the current manifest left (shards whose
//! commit number is above the manifest's version, temporary manifests); other unlisted files
//! are kept ([`Writer::unlisted_shards`]). A directory with shards but no manifest is refused
//! ([`Error::NoManifest`]); [`recover`] rebuilds its manifest from the shards and reports what
//! it could not prove.
//!
//! Shards are append-only: a later commit's row replaces an earlier row with the same key
//! (node `id`, edge `src,dst,kind`, embedding `node_id,model_id`); the `edits` table (the edit
//! log) only grows, in commit order. [`Writer::compact`] keeps rows stored / live rows at most
//! 1.5 with a log-structured merge policy (see [`CompactPolicy`]); [`Writer::replace`] writes
//! everything as one commit (model migration).
//!
//! Sharded runs: [`Writer::open_staging`] opens the staging store of shard I of N of a stage.
//! It reads as the main store plus its own commits (its manifest lists the main store's shards
//! by relative path) and writes only its own shards, so N shards can run at once, anywhere the
//! store directory is mounted. [`Writer::merge_staging`] then commits the union of the N
//! shards' own data to the main store in one atomic commit and removes the staging stores.
//!
//! Modules, in layers (lowest first; each module imports only modules listed before it, which
//! the unit test `layers::modules_import_only_the_layers_below_them` checks, so each file reads
//! with only what is below it):
//! 1. **format**: `error`; `manifest` (the commit's JSON); `lock` (the writer lock); `layout`
//!    (the directory's names, the manifest's atomic compare-and-swap write, directory syncs);
//! 2. **rows**: `keys` (row keys and their index files); `shard` (writing and verified reading
//!    of one Parquet file, shard names);
//! 3. **commit**: `store` ([`Store`], [`Writer`]: opening, committing, retiring files);
//!    `recover` (a manifest rebuilt from the shards);
//! 4. **read**: `scan` (filtered, projected reads into a graph); `merge` (streamed k-way merges
//!    of shards by key); `live` (streamed live rows of one table);
//! 5. **rewrite**: `compact` ([`Writer::compact`]); `staging` (sharded runs' staging stores);
//!    `index` (tenant vector indexes, [`Writer::update_indexes`], [`Store::read_index`]).
//!
//! ```
//! use fluxmem_graph::{Graph, Node, NodeBody, Semantic};
//! use fluxmem_store::{CommitInfo, Store, Writer};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let mut graph = Graph::default();
//! graph.insert_node(Node::new(
//!     NodeBody::Semantic(Semantic { source: "doc".into(), position: 0, time: None, group: None }),
//!     "default", "The sky is blue.", &["doc", "0"],
//! ));
//! let mut writer = Writer::open(dir.path()).unwrap();
//! writer.commit(&graph, CommitInfo { stage: "ingest".into(), ..Default::default() }).unwrap();
//! drop(writer);
//! let loaded = Store::open(dir.path()).unwrap().load().unwrap();
//! assert_eq!(loaded, graph);
//! ```

mod error;
mod layout;
mod lock;
mod manifest;

mod keys;
mod shard;

mod recover;
mod store;

mod live;
mod scan;

mod compact;
mod index;
mod merge;
mod staging;

#[cfg(test)]
mod layers;
#[cfg(test)]
mod testing;

pub use compact::{CompactPolicy, CompactReport, TableCompaction};
pub use error::{Error, Result};
pub use index::{
    EpisodeEdges, EpisodeEnd, IndexHow, IndexUpdate, MappedIndex, TenantIndex, VectorBlock,
    EPISODE_EDGES, INDEXED_KINDS,
};
pub use layout::{write_atomically, SCRATCH, STAGING};
pub use live::{EdgeRow, Live};
pub use lock::WriterLock;
pub use manifest::{
    CommitRecord, EmbeddingModel, IndexEntry, LiveCounts, Manifest, RetiredShard, ShardEntry,
    Since, FORMAT, INDEXED_TABLES, SCHEMA_VERSION,
};
pub use recover::{recover, recover_with, LostShard, RecoverOptions, RecoverReport};
pub use scan::{EdgeHead, Rows, Scan};
pub use staging::{
    staged_by, staging_dir, staging_manifest, staging_note, MergeReport, Shard, CARRIED_LOGS,
};
pub use store::{
    CommitInfo, Store, Writer, DEFAULT_RETIRED_GRACE, HISTORY, KEEP_RETIRED_COMMITS,
    MANIFEST_COMMIT_LOG,
};
