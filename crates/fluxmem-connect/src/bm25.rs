//! Okapi BM25 over node texts.

use std::collections::HashMap;

/// BM25 parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bm25Params {
    /// Term-frequency saturation.
    pub k1: f32,
    /// Length normalisation.
    pub b: f32,
    /// Index and query terms through [`stem`] (inflections meet: `camped`, `camping`, `camps`).
    pub stem: bool,
}

impl Default for Bm25Params {
    fn default() -> Self {
        Bm25Params {
            k1: 1.5,
            b: 0.75,
            stem: false,
        }
    }
}

/// A light English suffix stripper: the first of `-ingly -edly -ing -ed -s -ly` the word ends
/// with is cut when more than two letters remain, then a final `e` when more than three do
/// (`camped`, `camping`, `camps` -> `camp`; `love`, `loved`, `loves` -> `lov`). Not a
/// linguistic stemmer: it only has to bring a question's word and its evidence's inflection to
/// one term more often than it brings unrelated words together. Words with digits are left
/// alone.
pub fn stem(word: &str) -> &str {
    const SUFFIXES: [&str; 6] = ["ingly", "edly", "ing", "ed", "s", "ly"];
    if word.bytes().any(|b| b.is_ascii_digit()) {
        return word;
    }
    let mut root = word;
    if let Some(cut) = SUFFIXES.iter().find_map(|suffix| word.strip_suffix(suffix)) {
        if cut.chars().count() > 2 {
            root = cut;
        }
    }
    match root.strip_suffix('e') {
        Some(cut) if cut.chars().count() > 2 => cut,
        _ => root,
    }
}

/// [`terms`], stemmed when `stem` is set.
pub fn terms_with(text: &str, stem_terms: bool) -> Vec<String> {
    let words = terms(text);
    if !stem_terms {
        return words;
    }
    words.into_iter().map(|w| stem(&w).to_string()).collect()
}

/// Words that carry no retrieval signal.
const STOPWORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "by", "did", "do", "does", "for", "from", "had",
    "has", "have", "he", "her", "his", "i", "in", "is", "it", "its", "me", "my", "of", "on", "or",
    "she", "that", "the", "their", "them", "they", "this", "to", "was", "we", "were", "what",
    "when", "where", "which", "who", "why", "how", "will", "with", "you", "your",
];

/// Lower-cased alphanumeric terms of `text`, stopwords removed.
pub fn terms(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .filter(|w| !STOPWORDS.contains(&w.as_str()))
        .collect()
}

/// An inverted index over documents `0..n`.
#[derive(Debug, Clone)]
pub struct Bm25 {
    params: Bm25Params,
    postings: HashMap<String, Vec<(u32, u32)>>,
    lengths: Vec<f32>,
    average_length: f32,
}

impl Bm25 {
    /// Indexes `documents` (document `i` is `documents[i]`).
    pub fn new<S: AsRef<str>>(documents: &[S], params: Bm25Params) -> Bm25 {
        let mut postings: HashMap<String, Vec<(u32, u32)>> = HashMap::new();
        let mut lengths = Vec::with_capacity(documents.len());
        // Summed as integers, so the average does not depend on the order of the documents.
        let mut total = 0u64;
        for (doc, text) in documents.iter().enumerate() {
            let words = terms_with(text.as_ref(), params.stem);
            lengths.push(words.len() as f32);
            total += words.len() as u64;
            let mut counts: HashMap<String, u32> = HashMap::new();
            for word in words {
                *counts.entry(word).or_default() += 1;
            }
            for (word, count) in counts {
                postings.entry(word).or_default().push((doc as u32, count));
            }
        }
        let average_length = average_length(total, lengths.len());
        Bm25 {
            params,
            postings,
            lengths,
            average_length,
        }
    }

    /// Number of indexed documents.
    pub fn len(&self) -> usize {
        self.lengths.len()
    }

    /// True when nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }

    /// How many documents contain `term` (a term as [`terms`] produces it).
    pub fn document_frequency(&self, term: &str) -> usize {
        self.postings.get(term).map_or(0, Vec::len)
    }

    /// The BM25 score of every document for `query` (0 for documents sharing no term).
    pub fn scores(&self, query: &str) -> Vec<f32> {
        self.scores_in(query, self.lengths.len(), self.average_length, &|term| {
            self.document_frequency(term)
        })
    }

    /// [`Bm25::scores`] of these documents as part of a larger collection of `documents`
    /// documents, whose average length is `average_length` and where `df` documents contain a
    /// term: the scores one index over the whole collection gives them, bit for bit (each
    /// document's terms are added in the query's order, as there).
    pub fn scores_in(
        &self,
        query: &str,
        documents: usize,
        average_length: f32,
        df: &dyn Fn(&str) -> usize,
    ) -> Vec<f32> {
        let mut scores = vec![0f32; self.lengths.len()];
        let n = documents as f32;
        for term in query_terms(query, self.params.stem) {
            let Some(postings) = self.postings.get(&term) else {
                continue;
            };
            let df = df(&term) as f32;
            let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
            for &(doc, tf) in postings {
                let tf = tf as f32;
                let norm = 1.0 - self.params.b
                    + self.params.b * self.lengths[doc as usize] / average_length.max(1e-9);
                scores[doc as usize] +=
                    idf * tf * (self.params.k1 + 1.0) / (tf + self.params.k1 * norm);
            }
        }
        scores
    }
}

/// The distinct terms of a query, in their first order (the order scores add them in).
pub(crate) fn query_terms(query: &str, stem: bool) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    terms_with(query, stem)
        .into_iter()
        .filter(|term| seen.insert(term.clone()))
        .collect()
}

/// The average length of `documents` documents of `total` terms in all.
pub(crate) fn average_length(total: u64, documents: usize) -> f32 {
    if documents == 0 {
        0.0
    } else {
        total as f32 / documents as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_hand_computed_scores() {
        let docs = [
            "refund the order",
            "order a pizza",
            "restart the export job",
        ];
        let index = Bm25::new(&docs, Bm25Params::default());
        let scores = index.scores("refund order");
        // N = 3, avgdl = (2 + 2 + 3) / 3; doc 0 has "refund" (df 1) and "order" (df 2), length 2.
        let idf = |df: f32| (1.0f32 + (3.0 - df + 0.5) / (df + 0.5)).ln();
        let norm = 1.0 - 0.75 + 0.75 * 2.0 / (7.0 / 3.0);
        let term = |df: f32| idf(df) * 2.5 / (1.0 + 1.5 * norm);
        assert!(
            (scores[0] - (term(1.0) + term(2.0))).abs() < 1e-5,
            "{scores:?}"
        );
        assert!((scores[1] - term(2.0)).abs() < 1e-5);
        assert_eq!(scores[2], 0.0);
        assert_eq!(index.scores("the of and"), vec![0.0; 3], "stopwords only");
    }

    #[test]
    fn stemming_joins_inflections_and_leaves_short_words() {
        for (word, root) in [
            ("camped", "camp"),
            ("camping", "camp"),
            ("camps", "camp"),
            ("love", "lov"),
            ("loved", "lov"),
            ("loves", "lov"),
        ] {
            assert_eq!(stem(word), root, "{word}");
        }
        for word in ["sing", "is", "2023s", "bus", "adoption"] {
            assert_eq!(stem(word), word, "{word}");
        }
        // Off by default; on, a query word meets its inflection.
        let docs = ["we camped by the lake", "a quiet evening"];
        assert_eq!(
            Bm25::new(&docs, Bm25Params::default()).scores("camping"),
            vec![0.0, 0.0]
        );
        let stemmed = Bm25::new(
            &docs,
            Bm25Params {
                stem: true,
                ..Bm25Params::default()
            },
        )
        .scores("camping");
        assert!(stemmed[0] > 0.0 && stemmed[1] == 0.0, "{stemmed:?}");
    }
}
