//! Writing and verified reading of single Parquet shard files.

use arrow_array::RecordBatch;
use bytes::Bytes;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use std::io::Write;
use std::path::Path;

use crate::error::IoContext;
use crate::manifest::{ShardEntry, SCHEMA_VERSION};
use crate::{Error, Result};

/// Key-value metadata key naming the table a shard belongs to.
pub(crate) const TABLE_KEY: &str = "fluxmem.table";
/// Key-value metadata key holding the schema version.
pub(crate) const VERSION_KEY: &str = "fluxmem.schema_version";

/// Encodes `batch` as a Parquet file of `table` (in memory).
fn encode(table: &str, batch: &RecordBatch) -> Result<Vec<u8>> {
    let properties = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_key_value_metadata(Some(vec![
            KeyValue::new(TABLE_KEY.into(), table.to_string()),
            KeyValue::new(VERSION_KEY.into(), SCHEMA_VERSION.to_string()),
        ]))
        .build();
    let mut buffer = Vec::new();
    let parquet_error = |e: parquet::errors::ParquetError| Error::Corrupt {
        path: format!("<new {table} shard>").into(),
        reason: format!("cannot encode: {e}"),
    };
    let mut writer = ArrowWriter::try_new(&mut buffer, batch.schema(), Some(properties)).map_err(parquet_error)?;
    writer.write(batch).map_err(parquet_error)?;
    writer.close().map_err(parquet_error)?;
    Ok(buffer)
}

/// Writes `batch` as a new shard of `table` for commit `commit` under `dir`, durably.
///
/// The file name carries the commit and a content hash, so a retried commit rewrites the same
/// file with the same bytes.
pub(crate) fn write(dir: &Path, table: &str, commit: u64, part: usize, batch: &RecordBatch) -> Result<ShardEntry> {
    let bytes = encode(table, batch)?;
    let sha256 = fluxmem_graph::sha256_hex(&bytes);
    let file = format!("shards/{table}-{commit:08}-{part:03}-{}.parquet", &sha256[..12]);
    let path = dir.join(&file);
    let mut out = std::fs::File::create(&path).at(&path)?;
    out.write_all(&bytes).at(&path)?;
    out.sync_all().at(&path)?;
    Ok(ShardEntry { table: table.into(), file, rows: batch.num_rows() as u64, bytes: bytes.len() as u64, sha256, commit })
}

/// Reads the shard `entry` under `dir`, verifying its checksum, table and row count.
pub(crate) fn read(dir: &Path, entry: &ShardEntry, columns: Option<&[&str]>) -> Result<Vec<RecordBatch>> {
    let path = dir.join(&entry.file);
    let corrupt = |reason: String| Error::Corrupt { path: path.clone(), reason };
    let bytes = std::fs::read(&path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            corrupt("shard listed in the manifest is missing".into())
        } else {
            Error::Io { path: path.clone(), source }
        }
    })?;
    if bytes.len() as u64 != entry.bytes {
        return Err(corrupt(format!("{} bytes, the manifest says {}", bytes.len(), entry.bytes)));
    }
    let actual = fluxmem_graph::sha256_hex(&bytes);
    if actual != entry.sha256 {
        return Err(corrupt(format!("checksum mismatch: sha256 {actual}, the manifest says {}", entry.sha256)));
    }
    let builder = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(bytes))
        .map_err(|e| corrupt(format!("not a readable Parquet file: {e}")))?;
    let metadata = builder.metadata().file_metadata().key_value_metadata().cloned().unwrap_or_default();
    let lookup = |key: &str| metadata.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.clone());
    if lookup(TABLE_KEY).as_deref() != Some(entry.table.as_str()) {
        return Err(corrupt(format!("not a fluxmem `{}` shard (table tag {:?})", entry.table, lookup(TABLE_KEY))));
    }
    if lookup(VERSION_KEY) != Some(SCHEMA_VERSION.to_string()) {
        return Err(corrupt(format!("shard schema version {:?}, expected {SCHEMA_VERSION}", lookup(VERSION_KEY))));
    }
    let builder = match columns {
        Some(columns) => {
            let mask = parquet::arrow::ProjectionMask::columns(builder.parquet_schema(), columns.iter().copied());
            builder.with_projection(mask)
        }
        None => builder,
    };
    let reader = builder.build().map_err(|e| corrupt(format!("cannot read: {e}")))?;
    let batches = reader.collect::<Result<Vec<_>, _>>().map_err(|e| corrupt(format!("cannot decode: {e}")))?;
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    if rows as u64 != entry.rows {
        return Err(corrupt(format!("{rows} rows, the manifest says {}", entry.rows)));
    }
    Ok(batches)
}
