//! Compressed input: gzip (`.gz`) and Zstandard (`.zst`) files, told apart by their magic
//! bytes (the extension alone is not trusted) and decompressed before parsing. The format is
//! then detected from the name without the compression extension (`runs.jsonl.gz` is JSONL).
//!
//! Decompression reads the stream a buffer at a time and stops as soon as the output passes
//! [`Limits::allowed`]: [`MAX_DECOMPRESSION_RATIO`] times the compressed size (at least
//! [`RATIO_FLOOR_BYTES`]), never more than [`MAX_DECOMPRESSED_BYTES`]. A file past it is one
//! quarantined record that says so, so a small decompression bomb costs a bounded amount of
//! memory instead of up to 8 GiB. The parsed content is still held in memory whole; the limit
//! bounds how much.

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

/// Decompressed bytes allowed per compressed byte. The rule, set before measuring: agent logs
/// (JSON text) compress 5 to 20 times with gzip or zstd; ten times the top of that range leaves
/// room for repetitive logs, while a run of one byte (deflate reaches about 1,000:1, zstd far
/// more) is refused.
pub const MAX_DECOMPRESSION_RATIO: u64 = 200;

/// Output always allowed, whatever the ratio: a small file may decompress to this much.
pub const RATIO_FLOOR_BYTES: u64 = 16 << 20;

/// How much a compressed file may decompress to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub ratio: u64,
    pub floor: u64,
    pub max: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            ratio: MAX_DECOMPRESSION_RATIO,
            floor: RATIO_FLOOR_BYTES,
            max: MAX_DECOMPRESSED_BYTES,
        }
    }
}

impl Limits {
    /// The most `compressed` bytes may decompress to.
    pub fn allowed(&self, compressed: u64) -> u64 {
        compressed
            .saturating_mul(self.ratio)
            .max(self.floor)
            .min(self.max)
    }
}

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
    open_with(path, bytes, Limits::default())
}

fn open_with(path: &Path, bytes: Vec<u8>, limits: Limits) -> Result<Opened, String> {
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
    let allowed = limits.allowed(bytes.len() as u64);
    // One byte past the allowance tells a file that reaches it from one that exceeds it.
    let limit = allowed + 1;
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
        Ok(_) if out.len() as u64 > allowed => Err(format!(
            "{} data of {} bytes decompresses to more than {allowed} bytes (at most {} times \
             its size, at least {} and at most {} bytes are read): a decompression bomb or not \
             a log",
            compression.name(),
            bytes.len(),
            limits.ratio,
            limits.floor,
            limits.max
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
    fn decompression_stops_at_the_ratio_limit() {
        // 4 MiB of NUL bytes compress to a few KB: far past 200 times.
        let bomb = vec![0u8; 4 << 20];
        let limits = Limits {
            ratio: 200,
            floor: 1 << 20,
            max: 8 << 30,
        };
        for (name, compressed) in [
            ("nul.jsonl.gz", gzip(&bomb)),
            ("nul.jsonl.zst", zstd::encode_all(&bomb[..], 3).unwrap()),
        ] {
            let allowed = limits.allowed(compressed.len() as u64);
            assert!(allowed < bomb.len() as u64, "{name}: the test needs a bomb");
            let error = open_with(Path::new(name), compressed, limits)
                .err()
                .unwrap();
            assert!(
                error.contains(&format!("decompresses to more than {allowed} bytes")),
                "{name}: {error}"
            );
        }
        // Ordinary logs (JSON text, well under the ratio) pass whole, as does anything under
        // the floor.
        let log: Vec<u8> = (0..20_000)
            .flat_map(|i| format!("{{\"step\": {i}, \"tool\": \"t{}\"}}\n", i % 7).into_bytes())
            .collect();
        let opened = open_with(Path::new("a.jsonl.gz"), gzip(&log), limits).unwrap();
        assert_eq!(opened.bytes, log);
        let small = vec![0u8; 1 << 20];
        let opened = open_with(Path::new("b.gz"), gzip(&small), limits).unwrap();
        assert_eq!(opened.bytes.len(), small.len(), "the floor is allowed");
        // The default is the stated rule.
        let default = Limits::default();
        assert_eq!(default.allowed(1_000), RATIO_FLOOR_BYTES);
        assert_eq!(default.allowed(1 << 20), 200 << 20);
        assert_eq!(default.allowed(1 << 40), MAX_DECOMPRESSED_BYTES);
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
