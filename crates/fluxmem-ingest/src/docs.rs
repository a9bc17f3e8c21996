//! Knowledge documents (text, Markdown) chunked into semantic nodes.

use fluxmem_graph::{NodeBody, Semantic};

use crate::source::{str_lines, Source};
use crate::{Parsed, Record};

/// A chunk of a document.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    /// The chunk's text (paragraphs joined by blank lines).
    pub text: String,
    /// 1-based line of the chunk's first line.
    pub line: usize,
    /// The Markdown heading the chunk sits under, if any.
    pub section: Option<String>,
}

/// Splits `text` into chunks of at most `max_words` words.
///
/// A Markdown heading starts a new chunk and names the section of the chunks under it;
/// paragraphs (separated by blank lines) are packed whole while they fit; a paragraph longer
/// than the limit is split at word boundaries. Blank chunks are never produced. Lines end at
/// `\n`, `\r\n` or a lone `\r`.
pub fn chunk(text: &str, max_words: usize) -> Vec<Chunk> {
    let max_words = max_words.max(1);
    let mut chunks = Vec::new();
    let mut section: Option<String> = None;
    let mut current = Pending::default();
    let mut paragraph = Pending::default();
    let mut in_fence = false;
    for (index, line) in str_lines(text).enumerate() {
        let line_no = index + 1;
        let trimmed = line.trim();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_fence = !in_fence;
        }
        if !in_fence && is_heading(trimmed) {
            current.absorb(
                std::mem::take(&mut paragraph),
                max_words,
                &section,
                &mut chunks,
            );
            current.flush(&section, &mut chunks);
            section =
                Some(trimmed.trim_start_matches('#').trim().to_string()).filter(|s| !s.is_empty());
        } else if trimmed.is_empty() {
            current.absorb(
                std::mem::take(&mut paragraph),
                max_words,
                &section,
                &mut chunks,
            );
        } else {
            paragraph.push_line(line_no, line);
        }
    }
    current.absorb(paragraph, max_words, &section, &mut chunks);
    current.flush(&section, &mut chunks);
    chunks
}

/// A Markdown ATX heading: 1-6 `#` then a space (or nothing).
fn is_heading(line: &str) -> bool {
    let hashes = line.chars().take_while(|&c| c == '#').count();
    (1..=6).contains(&hashes)
        && line[hashes..]
            .chars()
            .next()
            .is_none_or(char::is_whitespace)
}

#[derive(Default)]
struct Pending {
    text: String,
    line: usize,
    words: usize,
}

impl Pending {
    fn push_line(&mut self, line_no: usize, line: &str) {
        if self.text.is_empty() {
            self.line = line_no;
        } else {
            self.text.push('\n');
        }
        self.text.push_str(line.trim_end());
        self.words += line.split_whitespace().count();
    }

    /// Adds a finished paragraph to this chunk, flushing first if it would not fit.
    fn absorb(
        &mut self,
        paragraph: Pending,
        max_words: usize,
        section: &Option<String>,
        out: &mut Vec<Chunk>,
    ) {
        if paragraph.text.is_empty() {
            return;
        }
        if self.words + paragraph.words > max_words {
            self.flush(section, out);
        }
        if paragraph.words > max_words {
            let words: Vec<&str> = paragraph.text.split_whitespace().collect();
            for piece in words.chunks(max_words) {
                out.push(Chunk {
                    text: piece.join(" "),
                    line: paragraph.line,
                    section: section.clone(),
                });
            }
            return;
        }
        if self.text.is_empty() {
            self.line = paragraph.line;
        } else {
            self.text.push_str("\n\n");
        }
        self.text.push_str(&paragraph.text);
        self.words += paragraph.words;
    }

    fn flush(&mut self, section: &Option<String>, out: &mut Vec<Chunk>) {
        if !self.text.trim().is_empty() {
            out.push(Chunk {
                text: std::mem::take(&mut self.text),
                line: self.line,
                section: section.clone(),
            });
        }
        *self = Pending::default();
    }
}

/// Parses a text or Markdown document into one record per chunk.
pub(crate) fn parse(
    source: &Source,
    emit: &mut dyn FnMut(Parsed) -> crate::Result<()>,
) -> crate::Result<()> {
    let text = match std::str::from_utf8(source.bytes) {
        Ok(text) => text,
        Err(e) => {
            let line = source.line_at(e.valid_up_to());
            let reason = format!(
                "invalid UTF-8 at byte {} (the whole document is quarantined)",
                e.valid_up_to()
            );
            return emit(Parsed::Rejected(source.reject(
                line,
                "document",
                reason,
                source.bytes,
            )));
        }
    };
    let name = source
        .path
        .rsplit('/')
        .next()
        .unwrap_or(&source.path)
        .to_string();
    for (position, chunk) in chunk(text, source.options.chunk_words)
        .into_iter()
        .enumerate()
    {
        let locator = format!("chunk {position} (line {})", chunk.line);
        if let Some(rejected) = source.check_size(chunk.line, &locator, chunk.text.as_bytes()) {
            emit(rejected)?;
            continue;
        }
        let body = NodeBody::Semantic(Semantic {
            source: name.clone(),
            position: position as i64,
            time: None,
            group: chunk.section.clone(),
        });
        let node = source.node(
            body,
            &chunk.text,
            &[&name, &position.to_string(), &chunk.text],
            locator,
            None,
        );
        emit(Parsed::Record(Record { nodes: vec![node] }))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headings_start_sections_and_paragraphs_pack() {
        let text = "intro line\n\n# Policy\n\none two three\n\nfour five\n\n## Baggage\nsix seven eight nine ten eleven\n";
        let chunks = chunk(text, 5);
        assert_eq!(chunks.len(), 4, "{chunks:?}");
        assert_eq!(
            chunks[0],
            Chunk {
                text: "intro line".into(),
                line: 1,
                section: None
            }
        );
        assert_eq!(
            chunks[1],
            Chunk {
                text: "one two three\n\nfour five".into(),
                line: 5,
                section: Some("Policy".into())
            }
        );
        assert_eq!(chunks[2].text, "six seven eight nine ten");
        assert_eq!(chunks[3].text, "eleven");
        assert_eq!(chunks[3].section.as_deref(), Some("Baggage"));
        assert_eq!(chunks[2].line, 10);
    }

    #[test]
    fn hashes_in_code_fences_and_hashtags_are_not_headings() {
        let text = "# Title\n\n```sh\n# a shell comment\n```\n\n#hashtag text\n";
        let chunks = chunk(text, 100);
        assert_eq!(chunks.len(), 1, "{chunks:?}");
        assert_eq!(chunks[0].section.as_deref(), Some("Title"));
        assert!(
            chunks[0].text.contains("# a shell comment") && chunks[0].text.contains("#hashtag")
        );
    }

    #[test]
    fn cr_only_documents_are_read_as_lines() {
        let chunks = chunk("# Title\r\rfirst\r\rsecond\r", 1);
        assert_eq!(chunks.len(), 2, "{chunks:?}");
        assert_eq!((chunks[0].text.as_str(), chunks[0].line), ("first", 3));
        assert_eq!((chunks[1].text.as_str(), chunks[1].line), ("second", 5));
        assert_eq!(chunks[1].section.as_deref(), Some("Title"));
    }

    #[test]
    fn empty_and_blank_documents_have_no_chunks() {
        assert!(chunk("", 10).is_empty());
        assert!(chunk("\n\n   \n#\n", 10).is_empty());
    }
}
