//! Writing and verified reading of single Parquet shard files.

use arrow_array::RecordBatch;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::metadata::{KeyValue, PageIndexPolicy};
use parquet::file::properties::WriterProperties;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::error::IoContext;
use crate::keys::{self, IndexBuilder, KeyIndex};
use crate::manifest::{ShardEntry, SCHEMA_VERSION};
use crate::{Error, Result};

/// Key-value metadata key naming the table a shard belongs to.
pub(crate) const TABLE_KEY: &str = "fluxmem.table";
/// Key-value metadata key holding the schema version.
pub(crate) const VERSION_KEY: &str = "fluxmem.schema_version";
/// Key-value metadata key of a compaction's output: the shard files (a JSON array of their
/// paths) whose rows it holds, so that recovery can prove them superseded.
pub(crate) const MERGED_FROM_KEY: &str = "fluxmem.merged_from";

/// Rows of a shard's row group (the unit a writer buffers, and a reader's statistics cover).
pub(crate) const ROW_GROUP_ROWS: usize = 128 * 1024;

/// The writer properties of every shard of `table`.
fn properties(table: &str) -> WriterProperties {
    WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .set_key_value_metadata(Some(vec![
            KeyValue::new(TABLE_KEY.into(), table.to_string()),
            KeyValue::new(VERSION_KEY.into(), SCHEMA_VERSION.to_string()),
        ]))
        .build()
}

fn encode_error(table: &str) -> impl Fn(parquet::errors::ParquetError) -> Error + '_ {
    move |e| Error::Corrupt {
        path: format!("<new {table} shard>").into(),
        reason: format!("cannot encode: {e}"),
    }
}

/// Encodes `batch` as a Parquet file of `table` (in memory).
fn encode(table: &str, batch: &RecordBatch) -> Result<Vec<u8>> {
    let mut buffer = Vec::new();
    let parquet_error = encode_error(table);
    let mut writer = ArrowWriter::try_new(&mut buffer, batch.schema(), Some(properties(table)))
        .map_err(&parquet_error)?;
    writer.write(batch).map_err(&parquet_error)?;
    writer.close().map_err(&parquet_error)?;
    Ok(buffer)
}

/// The name of shard `part` of `table` in commit `commit` while a [`ShardWriter`] writes it.
/// Such a file of a commit above the manifest's version is an interrupted commit's garbage
/// ([`parse_temporary_name`]).
fn temporary_name(table: &str, commit: u64, part: usize) -> String {
    format!("{table}-{commit:08}-{part:03}.parquet.tmp")
}

/// The (table, commit) of a [`ShardWriter`]'s temporary file name; `None` for any other name.
pub(crate) fn parse_temporary_name(name: &str) -> Option<(String, u64)> {
    let stem = name.strip_suffix(".parquet.tmp")?;
    let mut parts = stem.rsplitn(3, '-');
    let part = parts.next()?;
    let commit = parts.next()?;
    let table = parts.next()?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if table.is_empty() || commit.len() < 8 || part.len() < 3 || !digits(commit) || !digits(part) {
        return None;
    }
    Some((table.into(), commit.parse().ok()?))
}

/// A file that hashes and counts what is written through it.
struct HashingFile {
    file: std::io::BufWriter<std::fs::File>,
    hasher: Sha256,
    bytes: u64,
}

impl Write for HashingFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Writes one shard a batch at a time, so that a shard larger than memory can be written
/// (compaction's merges). The file is written under a temporary name and renamed to its
/// content-addressed name by [`ShardWriter::finish`]. It writes with [`write`]'s properties
/// (row groups of [`ROW_GROUP_ROWS`]).
pub(crate) struct ShardWriter {
    dir: PathBuf,
    table: String,
    commit: u64,
    part: usize,
    temporary: PathBuf,
    writer: Option<ArrowWriter<HashingFile>>,
    rows: u64,
    index: Option<IndexBuilder>,
}

impl ShardWriter {
    /// Starts shard `part` of `table` for commit `commit` under `dir`.
    pub(crate) fn create(
        dir: &Path,
        table: &str,
        commit: u64,
        part: usize,
        schema: arrow_schema::SchemaRef,
    ) -> Result<ShardWriter> {
        let temporary = dir.join("shards").join(temporary_name(table, commit, part));
        let file = std::fs::File::create(&temporary).at(&temporary)?;
        let out = HashingFile {
            file: std::io::BufWriter::with_capacity(1 << 20, file),
            hasher: Sha256::new(),
            bytes: 0,
        };
        let writer = ArrowWriter::try_new(out, schema, Some(properties(table)))
            .map_err(encode_error(table))?;
        Ok(ShardWriter {
            dir: dir.to_path_buf(),
            table: table.into(),
            commit,
            part,
            temporary,
            writer: Some(writer),
            rows: 0,
            index: IndexBuilder::new(table),
        })
    }

    /// Appends `batch`'s rows.
    pub(crate) fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        let writer = self
            .writer
            .as_mut()
            .expect("a shard writer is open until finished");
        writer.write(batch).map_err(encode_error(&self.table))?;
        self.rows += batch.num_rows() as u64;
        if let Some(index) = &mut self.index {
            index.push(batch).map_err(|reason| Error::Corrupt {
                path: self.temporary.clone(),
                reason,
            })?;
        }
        Ok(())
    }

    /// Records in the file's metadata the shard files whose rows it holds ([`MERGED_FROM_KEY`]).
    pub(crate) fn merged_from(&mut self, files: &[String]) {
        let writer = self
            .writer
            .as_mut()
            .expect("a shard writer is open until finished");
        let list = serde_json::to_string(files).expect("file names serialise");
        writer.append_key_value_metadata(KeyValue::new(MERGED_FROM_KEY.into(), list));
    }

    /// Closes the file, makes it durable and gives it its content-addressed name.
    pub(crate) fn finish(mut self) -> Result<ShardEntry> {
        let writer = self.writer.take().expect("a shard writer is finished once");
        let out = writer.into_inner().map_err(encode_error(&self.table))?;
        let HashingFile {
            file,
            hasher,
            bytes,
        } = out;
        let file = file.into_inner().map_err(|e| Error::Io {
            path: self.temporary.clone(),
            source: e.into_error(),
        })?;
        file.sync_all().at(&self.temporary)?;
        let sha256 = fluxmem_graph::hex(&hasher.finalize());
        let name = format!(
            "shards/{}-{:08}-{:03}-{}.parquet",
            self.table,
            self.commit,
            self.part,
            &sha256[..12]
        );
        let path = self.dir.join(&name);
        std::fs::rename(&self.temporary, &path).at(&path)?;
        let entry = ShardEntry {
            table: self.table.clone(),
            file: name,
            rows: self.rows,
            bytes,
            sha256,
            commit: self.commit,
            rows_from: None,
            rows_through: None,
            tenants: None,
        };
        if let Some(index) = self.index.take() {
            keys::keep(&self.dir, &entry, &index.finish());
        }
        Ok(entry)
    }
}

impl Drop for ShardWriter {
    /// An unfinished writer (an error, an abandoned merge) removes its temporary file.
    fn drop(&mut self) {
        if self.writer.take().is_some() {
            let _ = std::fs::remove_file(&self.temporary);
        }
    }
}

/// Writes `batch` as a new shard of `table` for commit `commit` under `dir`, durably.
///
/// The file name carries the commit and a content hash, so a retried commit rewrites the same
/// file with the same bytes.
pub(crate) fn write(
    dir: &Path,
    table: &str,
    commit: u64,
    part: usize,
    batch: &RecordBatch,
) -> Result<ShardEntry> {
    let bytes = encode(table, batch)?;
    let sha256 = fluxmem_graph::sha256_hex(&bytes);
    let file = format!(
        "shards/{table}-{commit:08}-{part:03}-{}.parquet",
        &sha256[..12]
    );
    let path = dir.join(&file);
    let mut out = std::fs::File::create(&path).at(&path)?;
    out.write_all(&bytes).at(&path)?;
    out.sync_all().at(&path)?;
    let entry = ShardEntry {
        table: table.into(),
        file,
        rows: batch.num_rows() as u64,
        bytes: bytes.len() as u64,
        sha256,
        commit,
        rows_from: None,
        rows_through: None,
        tenants: None,
    };
    if let Some(mut index) = IndexBuilder::new(table) {
        index.push(batch).map_err(|reason| Error::Corrupt {
            path: path.clone(),
            reason,
        })?;
        keys::keep(dir, &entry, &index.finish());
    }
    Ok(entry)
}

/// Reads the shard `entry` under `dir`, verifying its checksum, table and row count.
pub(crate) fn read(
    dir: &Path,
    entry: &ShardEntry,
    columns: Option<&[&str]>,
) -> Result<Vec<RecordBatch>> {
    open(dir, entry, columns, DEFAULT_BATCH_ROWS)?.collect()
}

/// The batches of the shard `entry` under `dir`, [`DEFAULT_BATCH_ROWS`] rows at a time: what a
/// loop over a shard's rows reads, one batch in memory, not the shard ([`open`]).
pub(crate) fn batches(dir: &Path, entry: &ShardEntry, columns: Option<&[&str]>) -> Result<Batches> {
    open(dir, entry, columns, DEFAULT_BATCH_ROWS)
}

/// Rows of a batch that [`read`] and [`batches`] decode.
pub(crate) const DEFAULT_BATCH_ROWS: usize = 8192;

/// The batches of a shard, decoded one at a time as they are asked for ([`open`]).
pub(crate) struct Batches {
    reader: parquet::arrow::arrow_reader::ParquetRecordBatchReader,
    path: PathBuf,
}

impl Iterator for Batches {
    type Item = Result<RecordBatch>;

    fn next(&mut self) -> Option<Result<RecordBatch>> {
        let next = self.reader.next()?;
        Some(next.map_err(|e| Error::Corrupt {
            path: self.path.clone(),
            reason: format!("cannot decode: {e}"),
        }))
    }
}

/// Opens the shard `entry` under `dir` for reading `batch_rows` rows at a time: its size and
/// checksum are verified first (one pass over the file, in bounded memory), then its table tag,
/// schema version and row count (from the footer). Only `columns` are decoded (all: `None`).
pub(crate) fn open(
    dir: &Path,
    entry: &ShardEntry,
    columns: Option<&[&str]>,
    batch_rows: usize,
) -> Result<Batches> {
    let shard = Verified::open(dir, entry, PageIndexPolicy::Skip)?;
    let reader = shard
        .builder()?
        .project(columns)
        .with_batch_size(batch_rows.max(1))
        .build()
        .map_err(|e| shard.corrupt(format!("cannot read: {e}")))?;
    Ok(Batches {
        reader,
        path: shard.path,
    })
}

/// The rows of the shard `entry` whose text column `key` passes `keep`, [`DEFAULT_BATCH_ROWS`]
/// at a time, every column. The file is verified whole first (as [`open`] does); then the key
/// column is decoded, and the other columns are decoded at the selected rows only, their pages
/// without a selected row skipped (the offset index). `None`: no row passes, and nothing but
/// the key column was decoded.
pub(crate) fn select(
    dir: &Path,
    entry: &ShardEntry,
    key: &str,
    keep: &dyn Fn(&str) -> bool,
) -> Result<Option<Batches>> {
    use arrow_array::cast::AsArray;
    use arrow_array::{Array, BooleanArray};
    let shard = Verified::open(dir, entry, PageIndexPolicy::Optional)?;
    let keys = shard
        .builder()?
        .project(Some(&[key]))
        .with_batch_size(DEFAULT_BATCH_ROWS)
        .build()
        .map_err(|e| shard.corrupt(format!("cannot read: {e}")))?;
    let mut masks = Vec::new();
    for batch in keys {
        let batch = batch.map_err(|e| shard.corrupt(format!("cannot decode: {e}")))?;
        let values = batch
            .column_by_name(key)
            .and_then(|c| c.as_string_opt::<i32>())
            .ok_or_else(|| shard.corrupt(format!("column `{key}` is missing or not text")))?;
        masks.push(
            (0..values.len())
                .map(|i| Some(values.is_valid(i) && keep(values.value(i))))
                .collect::<BooleanArray>(),
        );
    }
    let selection = parquet::arrow::arrow_reader::RowSelection::from_filters(&masks);
    if !selection.selects_any() {
        return Ok(None);
    }
    let reader = shard
        .builder()?
        .project(None)
        .with_row_selection(selection)
        .with_batch_size(DEFAULT_BATCH_ROWS)
        .build()
        .map_err(|e| shard.corrupt(format!("cannot read: {e}")))?;
    Ok(Some(Batches {
        reader,
        path: shard.path,
    }))
}

/// A shard file whose size, checksum, table tag, schema version and row count were verified,
/// with its footer (and, as `offset_index` says, its offset index) read once for the readers
/// built on it.
struct Verified {
    file: std::fs::File,
    metadata: ArrowReaderMetadata,
    path: PathBuf,
}

impl Verified {
    fn open(dir: &Path, entry: &ShardEntry, offset_index: PageIndexPolicy) -> Result<Verified> {
        let path = dir.join(&entry.file);
        let corrupt = |reason: String| Error::Corrupt {
            path: path.clone(),
            reason,
        };
        let mut file = std::fs::File::open(&path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                corrupt("shard listed in the manifest is missing".into())
            } else {
                Error::Io {
                    path: path.clone(),
                    source,
                }
            }
        })?;
        let mut hasher = Sha256::new();
        let mut buffer = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = file.read(&mut buffer).at(&path)?;
            if n == 0 {
                break;
            }
            hasher.update(&buffer[..n]);
            bytes += n as u64;
        }
        if bytes != entry.bytes {
            return Err(corrupt(format!(
                "{bytes} bytes, the manifest says {}",
                entry.bytes
            )));
        }
        let actual = fluxmem_graph::hex(&hasher.finalize());
        if actual != entry.sha256 {
            return Err(corrupt(format!(
                "checksum mismatch: sha256 {actual}, the manifest says {}",
                entry.sha256
            )));
        }
        let options = ArrowReaderOptions::new().with_offset_index_policy(offset_index);
        let metadata = ArrowReaderMetadata::load(&file, options)
            .map_err(|e| corrupt(format!("not a readable Parquet file: {e}")))?;
        let tags = metadata
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .cloned()
            .unwrap_or_default();
        let lookup = |key: &str| {
            tags.iter()
                .find(|kv| kv.key == key)
                .and_then(|kv| kv.value.clone())
        };
        if lookup(TABLE_KEY).as_deref() != Some(entry.table.as_str()) {
            return Err(corrupt(format!(
                "not a fluxmem `{}` shard (table tag {:?})",
                entry.table,
                lookup(TABLE_KEY)
            )));
        }
        if lookup(VERSION_KEY) != Some(SCHEMA_VERSION.to_string()) {
            return Err(corrupt(format!(
                "shard schema version {:?}, expected {SCHEMA_VERSION}",
                lookup(VERSION_KEY)
            )));
        }
        let rows = metadata.metadata().file_metadata().num_rows();
        if rows as u64 != entry.rows {
            return Err(corrupt(format!(
                "{rows} rows, the manifest says {}",
                entry.rows
            )));
        }
        Ok(Verified {
            file,
            metadata,
            path,
        })
    }

    fn builder(&self) -> Result<Builder> {
        let file = self.file.try_clone().at(&self.path)?;
        Ok(Builder(ParquetRecordBatchReaderBuilder::new_with_metadata(
            file,
            self.metadata.clone(),
        )))
    }

    fn corrupt(&self, reason: String) -> Error {
        Error::Corrupt {
            path: self.path.clone(),
            reason,
        }
    }
}

/// A reader builder of a [`Verified`] shard.
struct Builder(ParquetRecordBatchReaderBuilder<std::fs::File>);

impl Builder {
    /// Only `columns` (all: `None`).
    fn project(self, columns: Option<&[&str]>) -> ParquetRecordBatchReaderBuilder<std::fs::File> {
        match columns {
            Some(columns) => {
                let mask = parquet::arrow::ProjectionMask::columns(
                    self.0.parquet_schema(),
                    columns.iter().copied(),
                );
                self.0.with_projection(mask)
            }
            None => self.0,
        }
    }
}

/// The parts of a shard file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardName {
    pub table: String,
    pub commit: u64,
    pub part: usize,
    pub sha_prefix: String,
}

/// Parses `<table>-<commit:08>-<part:03>-<sha256[..12]>.parquet`; `None` for any other name.
pub(crate) fn parse_shard_name(name: &str) -> Option<ShardName> {
    let stem = name.strip_suffix(".parquet")?;
    let mut parts = stem.rsplitn(4, '-');
    let sha_prefix = parts.next()?;
    let part = parts.next()?;
    let commit = parts.next()?;
    let table = parts.next()?;
    let hex = |s: &str| {
        s.len() == 12
            && s.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    };
    if table.is_empty() || commit.len() < 8 || part.len() < 3 || !hex(sha_prefix) {
        return None;
    }
    Some(ShardName {
        table: table.into(),
        commit: commit.parse().ok()?,
        part: part.parse().ok()?,
        sha_prefix: sha_prefix.into(),
    })
}

/// `entry`'s key index: read, or else made from the shard's key columns (and, with `keep`,
/// written for the next time).
pub(crate) fn key_index(dir: &Path, entry: &ShardEntry, keep: bool) -> Result<KeyIndex> {
    if let Some(index) = keys::read(dir, entry) {
        return Ok(index);
    }
    let mut builder = IndexBuilder::new(&entry.table).ok_or_else(|| Error::Corrupt {
        path: dir.join(&entry.file),
        reason: format!("table `{}` has no keys", entry.table),
    })?;
    let columns = keys::index_columns(&entry.table);
    for batch in open(dir, entry, Some(&columns), DEFAULT_BATCH_ROWS)? {
        builder.push(&batch?).map_err(|reason| Error::Corrupt {
            path: dir.join(&entry.file),
            reason,
        })?;
    }
    let index = builder.finish();
    if index.len() as u64 != entry.rows {
        return Err(Error::Corrupt {
            path: dir.join(&entry.file),
            reason: format!(
                "{} rows read, the manifest says {}",
                index.len(),
                entry.rows
            ),
        });
    }
    if keep {
        keys::keep(dir, entry, &index);
    }
    Ok(index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;
    use arrow_array::{ArrayRef, Int64Array, StringArray};
    use std::sync::Arc;

    #[test]
    fn shard_names_parse() {
        let parsed = parse_shard_name("edges-00000012-003-0123456789ab.parquet").unwrap();
        assert_eq!(
            parsed,
            ShardName {
                table: "edges".into(),
                commit: 12,
                part: 3,
                sha_prefix: "0123456789ab".into()
            }
        );
        for bad in [
            "edges-12-003-0123456789ab.parquet",
            "edges-00000012-003-0123.parquet",
            "x.parquet",
            "edges-00000012-003-0123456789ab.csv",
            "LOCK",
        ] {
            assert_eq!(parse_shard_name(bad), None, "{bad}");
        }
    }

    /// A shard of 20,000 rows (several batches and pages): `select` gives the rows whose key
    /// passes, every column, in order, and nothing (`None`) when no key passes.
    #[test]
    fn select_gives_the_rows_that_pass_and_none_when_none_does() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("shards")).unwrap();
        let ids = StringArray::from_iter_values((0..20_000).map(|i| format!("k{i:05}")));
        let n = Int64Array::from_iter_values(0..20_000);
        let batch = RecordBatch::try_from_iter([
            ("id", Arc::new(ids) as ArrayRef),
            ("n", Arc::new(n) as ArrayRef),
        ])
        .unwrap();
        let entry = write(dir.path(), "t", 1, 0, &batch).unwrap();
        assert!(select(dir.path(), &entry, "id", &|_| false)
            .unwrap()
            .is_none());
        let read: Vec<RecordBatch> = select(dir.path(), &entry, "id", &|k| k.ends_with("99"))
            .unwrap()
            .unwrap()
            .collect::<Result<_>>()
            .unwrap();
        let n: Vec<i64> = read
            .iter()
            .flat_map(|b| {
                b.column_by_name("n")
                    .unwrap()
                    .as_primitive::<Int64Type>()
                    .values()
                    .to_vec()
            })
            .collect();
        assert_eq!(
            n,
            (0..20_000).filter(|i| i % 100 == 99).collect::<Vec<i64>>()
        );
        let ids: Vec<String> = read
            .iter()
            .flat_map(|b| {
                b.column_by_name("id")
                    .unwrap()
                    .as_string::<i32>()
                    .iter()
                    .map(|v| v.unwrap().to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(ids.first().map(String::as_str), Some("k00099"));
        assert_eq!(ids.len(), 200);
    }
}
