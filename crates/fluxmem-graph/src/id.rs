use sha2::{Digest, Sha256};
use std::fmt;

use crate::NodeKind;

/// A stable node id: `<kind prefix>-<32 hex digits of a SHA-256 of the node's content>`.
///
/// The same content always gives the same id, which is what makes ingestion idempotent.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub String);

impl NodeId {
    /// The content-addressed id of a node of `kind` in `tenant` identified by `parts`.
    ///
    /// Parts are length-prefixed before hashing, so `["ab", "c"]` and `["a", "bc"]` differ.
    pub fn content(kind: NodeKind, tenant: &str, parts: &[&str]) -> NodeId {
        let mut hasher = Sha256::new();
        for part in std::iter::once(kind.as_str()).chain(std::iter::once(tenant)).chain(parts.iter().copied()) {
            hasher.update((part.len() as u64).to_le_bytes());
            hasher.update(part.as_bytes());
        }
        let digest = hasher.finalize();
        NodeId(format!("{}-{}", kind.id_prefix(), hex(&digest[..16])))
    }

    /// The id as a string slice.
    #[inline]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

// Ordered and hashed as its string, so sets of ids can be asked about a `&str`.
impl std::borrow::Borrow<str> for NodeId {
    #[inline]
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for NodeId {
    fn from(value: &str) -> Self {
        NodeId(value.to_string())
    }
}

/// A set of node ids held compactly: a content-addressed id (`<prefix>-<32 lower-case hex
/// digits>`, [`NodeId::content`]) as its 128-bit digest under its prefix (16 bytes an id,
/// against about 100 for the string in a tree), any other id as its string. Membership is
/// exact: an id maps to one entry and an entry to one id.
#[derive(Debug, Default, Clone)]
pub struct IdSet {
    /// Per prefix (a handful), the digests of its ids.
    digests: Vec<(String, std::collections::HashSet<u128>)>,
    other: std::collections::HashSet<String>,
}

impl IdSet {
    /// The prefix and digest of a content-addressed id.
    fn digest(id: &str) -> Option<(&str, u128)> {
        let (prefix, digits) = id.split_once('-')?;
        if digits.len() != 32 || !digits.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return None;
        }
        u128::from_str_radix(digits, 16).ok().map(|d| (prefix, d))
    }

    /// True when `id` is in the set.
    pub fn contains(&self, id: &str) -> bool {
        match IdSet::digest(id) {
            Some((prefix, digest)) => self.digests.iter().any(|(p, set)| p == prefix && set.contains(&digest)),
            None => self.other.contains(id),
        }
    }

    /// Adds `id`; false when it was there.
    pub fn insert(&mut self, id: &str) -> bool {
        match IdSet::digest(id) {
            Some((prefix, digest)) => match self.digests.iter_mut().find(|(p, _)| p == prefix) {
                Some((_, set)) => set.insert(digest),
                None => {
                    self.digests.push((prefix.to_string(), std::iter::once(digest).collect()));
                    true
                }
            },
            None => self.other.insert(id.to_string()),
        }
    }

    /// Ids in the set.
    pub fn len(&self) -> usize {
        self.digests.iter().map(|(_, set)| set.len()).sum::<usize>() + self.other.len()
    }

    /// True when the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Lower-case hex SHA-256 of `bytes` (checksums, text hashes for the embedding cache).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lower-case hex of `bytes`, two digits a byte (a table lookup, not `fmt`: ids and text
/// hashes are made millions of times a night).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &byte in bytes {
        out.push(DIGITS[(byte >> 4) as usize] as char);
        out.push(DIGITS[(byte & 15) as usize] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_length_prefixed() {
        let a = NodeId::content(NodeKind::Semantic, "t", &["ab", "c"]);
        let b = NodeId::content(NodeKind::Semantic, "t", &["a", "bc"]);
        assert_ne!(a, b);
        assert_eq!(a, NodeId::content(NodeKind::Semantic, "t", &["ab", "c"]));
        assert!(a.as_str().starts_with("sem-"));
        assert_eq!(a.as_str().len(), 4 + 32);
        let other_tenant = NodeId::content(NodeKind::Semantic, "u", &["ab", "c"]);
        assert_ne!(a, other_tenant);
    }

    #[test]
    fn sha256_matches_known_vector() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}

#[cfg(test)]
mod id_set_tests {
    use super::*;

    #[test]
    fn an_id_set_holds_each_id_exactly() {
        let a = NodeId::content(NodeKind::Episodic, "t", &["a"]);
        let hex_a = a.as_str().split_once('-').unwrap().1.to_string();
        let mut set = IdSet::default();
        assert!(set.insert(a.as_str()));
        assert!(!set.insert(a.as_str()), "twice");
        assert!(set.contains(a.as_str()));
        // The same digits under another prefix, in upper case, or signed are other ids.
        for other in [format!("sem-{hex_a}"), format!("epi-{}", hex_a.to_uppercase()), format!("epi-+{}", &hex_a[1..]), format!("epi-{}", &hex_a[..31])] {
            assert!(!set.contains(&other), "{other}");
            assert!(set.insert(&other), "{other}");
            assert!(set.contains(&other), "{other}");
        }
        assert!(set.insert("doc-7") && set.contains("doc-7") && !set.contains("doc-8"));
        assert_eq!(set.len(), 6);
    }
}
