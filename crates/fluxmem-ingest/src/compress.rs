//! Compressed input: gzip (`.gz`) and Zstandard (`.zst`) files, told apart by their magic
//! bytes (the extension alone is not trusted) and decompressed whole before parsing. The format
//! is then detected from the name without the compression extension (`runs.jsonl.gz` is JSONL).

use std::io::Read;
use std::path::{Path, PathBuf};

/// A compression this reader understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// gzip (RFC 1952), also several concatenated members.
    Gzip,
    /// Zstandard frames.
    Zstd,
}

impl Compression {
    /// The compression of a file with these first bytes, if any.
    pub fn sniff(bytes: &[u8]) -> Option<Compression> {
        if bytes.starts_with(&[0x1f, 0x8b]) {
            Some(Compression::Gzip)
        } else if bytes.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Some(Compression::Zstd)
        } else {
            None
        }
    }

    fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }
}

/// Decompressed input that no record may exceed in total; a bigger file is one quarantined
/// record (a guard against decompression bombs).
pub const MAX_DECOMPRESSED_BYTES: u64 = 8 << 30;

/// What a file holds once decompressed: the bytes and the name to detect the format from.
pub(crate) struct Opened {
    /// The (decompressed) content.
    pub bytes: Vec<u8>,
    /// The path without the compression extension when the file was compressed.
    pub detect_as: PathBuf,
}

/// Decompresses `bytes` of `path` when they are gzip or zstd (by magic bytes); returns the
/// content as it is otherwise. A file whose name says `.gz` / `.zst` but whose bytes are not, or
/// that fails to decompress, is an error that names the compression and what went wrong.
pub(crate) fn open(path: &Path, bytes: Vec<u8>) -> Result<Opened, String> {
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let named = match extension.as_str() {
        "gz" | "gzip" => Some(Compression::Gzip),
        "zst" | "zstd" => Some(Compression::Zstd),
        _ => None,
    };
    let Some(compression) = Compression::sniff(&bytes) else {
        if let Some(named) = named {
            return Err(format!(
                "the name says {} but the content is not {} (no magic bytes)",
                named.name(),
                named.name()
            ));
        }
        return Ok(Opened {
            bytes,
            detect_as: path.to_path_buf(),
        });
    };
    let detect_as = if named.is_some() {
        path.with_extension("")
    } else {
        path.to_path_buf()
    };
    let mut out = Vec::new();
    let limit = MAX_DECOMPRESSED_BYTES + 1;
    let read = match compression {
        Compression::Gzip => flate2::read::MultiGzDecoder::new(&bytes[..])
            .take(limit)
            .read_to_end(&mut out),
        Compression::Zstd => match zstd::stream::read::Decoder::new(&bytes[..]) {
            Ok(decoder) => decoder.take(limit).read_to_end(&mut out),
            Err(e) => Err(e),
        },
    };
    match read {
        Err(e) => Err(format!(
            "{} data does not decompress after {} bytes: {e}",
            compression.name(),
            out.len()
        )),
        Ok(_) if out.len() as u64 > MAX_DECOMPRESSED_BYTES => Err(format!(
            "{} data decompresses to more than {MAX_DECOMPRESSED_BYTES} bytes",
            compression.name()
        )),
        Ok(_) => Ok(Opened {
            bytes: out,
            detect_as,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    #[test]
    fn gzip_and_zstd_decompress_and_drop_their_extension() {
        let data = b"{\"a\": 1}\n".repeat(100);
        let opened = open(Path::new("logs/runs.jsonl.gz"), gzip(&data)).unwrap();
        assert_eq!(
            (opened.bytes, opened.detect_as),
            (data.clone(), PathBuf::from("logs/runs.jsonl"))
        );
        let opened = open(
            Path::new("logs/runs.jsonl.zst"),
            zstd::encode_all(&data[..], 3).unwrap(),
        )
        .unwrap();
        assert_eq!(
            (opened.bytes, opened.detect_as),
            (data.clone(), PathBuf::from("logs/runs.jsonl"))
        );
        // Magic bytes decide, not the name.
        let opened = open(Path::new("logs/runs.jsonl"), gzip(&data)).unwrap();
        assert_eq!(opened.bytes, data);
        let plain = open(Path::new("logs/runs.jsonl"), data.clone()).unwrap();
        assert_eq!(plain.bytes, data);
    }

    #[test]
    fn broken_compressed_files_are_one_error() {
        let mut truncated = gzip(&b"x".repeat(10_000));
        truncated.truncate(truncated.len() / 2);
        let error = open(Path::new("a.gz"), truncated).err().unwrap();
        assert!(
            error.starts_with("gzip data does not decompress"),
            "{error}"
        );
        let error = open(Path::new("a.zst"), b"plain text".to_vec())
            .err()
            .unwrap();
        assert!(error.contains("the name says zstd"), "{error}");
    }
}
