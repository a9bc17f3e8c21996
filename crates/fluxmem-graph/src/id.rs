use sha2::{Digest, Sha256};
use std::fmt;

use crate::NodeKind;

/// A stable node id: `<kind prefix>-<32 hex digits of a SHA-256 of the node's content>`.
///
/// The same content always gives the same id, which is what makes ingestion idempotent.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct NodeId(pub String);

impl NodeId {
    /// The content-addressed id of a node of `kind` in `tenant` identified by `parts`.
    ///
    /// Parts are length-prefixed before hashing, so `["ab", "c"]` and `["a", "bc"]` differ.
    pub fn content(kind: NodeKind, tenant: &str, parts: &[&str]) -> NodeId {
        let mut hasher = Sha256::new();
        for part in std::iter::once(kind.as_str())
            .chain(std::iter::once(tenant))
            .chain(parts.iter().copied())
        {
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
    /// The ids as the keys of a map without values (the same tables as a set).
    ids: IdMap<()>,
}

/// The prefix and digest of a content-addressed id.
fn digest(id: &str) -> Option<(&str, u128)> {
    let (prefix, digits) = id.split_once('-')?;
    if digits.len() != 32
        || !digits
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    u128::from_str_radix(digits, 16).ok().map(|d| (prefix, d))
}

impl IdSet {
    /// True when `id` is in the set.
    pub fn contains(&self, id: &str) -> bool {
        self.ids.contains(id)
    }

    /// Adds `id`; false when it was there.
    pub fn insert(&mut self, id: &str) -> bool {
        self.ids.insert(id, ()).is_none()
    }

    /// Ids in the set.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when the set is empty.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// About what the set takes in memory: its tables' slots (16 bytes and a control byte
    /// each) and its other ids' strings (constant time: a night's facts ask it often).
    pub fn held_bytes(&self) -> usize {
        self.ids.held_bytes()
    }
}

/// A map from node ids held compactly: a content-addressed id (`<prefix>-<32 lower-case hex
/// digits>`, [`NodeId::content`]) as its 128-bit digest under its prefix, any other id as its
/// string ([`IdSet`] is one without values).
#[derive(Debug, Clone)]
pub struct IdMap<V> {
    digests: Vec<(String, std::collections::HashMap<u128, V>)>,
    other: std::collections::HashMap<String, V>,
    /// Bytes of the keys in `other`, kept as they are added.
    other_bytes: usize,
}

impl<V> Default for IdMap<V> {
    fn default() -> Self {
        IdMap {
            digests: Vec::new(),
            other: Default::default(),
            other_bytes: 0,
        }
    }
}

impl<V> IdMap<V> {
    /// The value of `id`.
    pub fn get(&self, id: &str) -> Option<&V> {
        match digest(id) {
            Some((prefix, digest)) => self
                .digests
                .iter()
                .find(|(p, _)| p == prefix)
                .and_then(|(_, map)| map.get(&digest)),
            None => self.other.get(id),
        }
    }

    /// True when `id` has a value.
    pub fn contains(&self, id: &str) -> bool {
        self.get(id).is_some()
    }

    /// Sets the value of `id`, returning the one it replaces.
    pub fn insert(&mut self, id: &str, value: V) -> Option<V> {
        match digest(id) {
            Some((prefix, digest)) => match self.digests.iter_mut().find(|(p, _)| p == prefix) {
                Some((_, map)) => map.insert(digest, value),
                None => {
                    self.digests.push((
                        prefix.to_string(),
                        std::iter::once((digest, value)).collect(),
                    ));
                    None
                }
            },
            None => {
                let old = self.other.insert(id.to_string(), value);
                if old.is_none() {
                    self.other_bytes += id.len();
                }
                old
            }
        }
    }

    /// Ids in the map.
    pub fn len(&self) -> usize {
        self.digests.iter().map(|(_, map)| map.len()).sum::<usize>() + self.other.len()
    }

    /// True when the map is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// About what the map takes in memory: its tables' slots (key, value and a control byte
    /// each) and its other ids' strings.
    pub fn held_bytes(&self) -> usize {
        let slot = std::mem::size_of::<(u128, V)>() + 1;
        let digests: usize = self
            .digests
            .iter()
            .map(|(p, map)| p.len() + map.capacity() * slot)
            .sum();
        digests + self.other_bytes + self.other.capacity() * (57 + std::mem::size_of::<V>())
    }

    /// The values, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.digests
            .iter()
            .flat_map(|(_, map)| map.values())
            .chain(self.other.values())
    }

    /// The ids (written back as strings) with their values, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (String, &V)> {
        let digests = self.digests.iter().flat_map(|(prefix, map)| {
            map.iter()
                .map(move |(digest, v)| (format!("{prefix}-{digest:032x}"), v))
        });
        digests.chain(self.other.iter().map(|(id, v)| (id.clone(), v)))
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
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
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
        for other in [
            format!("sem-{hex_a}"),
            format!("epi-{}", hex_a.to_uppercase()),
            format!("epi-+{}", &hex_a[1..]),
            format!("epi-{}", &hex_a[..31]),
        ] {
            assert!(!set.contains(&other), "{other}");
            assert!(set.insert(&other), "{other}");
            assert!(set.contains(&other), "{other}");
        }
        assert!(set.insert("doc-7") && set.contains("doc-7") && !set.contains("doc-8"));
        assert_eq!(set.len(), 6);
    }

    #[test]
    fn an_id_map_gives_back_each_id_and_value() {
        let ids: Vec<String> = (0..50)
            .map(|i| NodeId::content(NodeKind::Episodic, "t", &[&i.to_string()]).to_string())
            .chain(["doc-7".to_string(), "sem-ABC".to_string()])
            .collect();
        let mut map: IdMap<usize> = IdMap::default();
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(map.insert(id, i), None);
        }
        assert_eq!(map.insert(&ids[3], 99), Some(3), "a second insert replaces");
        assert_eq!(map.len(), ids.len());
        assert_eq!(map.get(&ids[3]), Some(&99));
        assert!(map.contains("doc-7") && !map.contains("doc-8"));
        let hex = ids[0].split_once('-').unwrap().1;
        assert!(!map.contains(&format!("sem-{hex}")), "another prefix");
        let mut back: Vec<(String, usize)> = map.iter().map(|(id, v)| (id, *v)).collect();
        back.sort();
        let mut expected: Vec<(String, usize)> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.clone(), if i == 3 { 99 } else { i }))
            .collect();
        expected.sort();
        assert_eq!(back, expected, "the ids come back as they went in");
        assert_eq!(
            map.values().sum::<usize>(),
            expected.iter().map(|(_, v)| v).sum::<usize>()
        );
    }
}
