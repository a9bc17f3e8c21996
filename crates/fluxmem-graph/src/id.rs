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
