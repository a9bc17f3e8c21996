//! Serving one query from a store: the query's tenant read at one manifest version, in
//! proportion to what the ranking needs, and the [`Retriever`] that ranks it.
//!
//! `fluxmem query` and `fluxmem eval locomo --through-graph` answer through this module, so
//! what the evaluation measures is what the store serves. [`read`] reads:
//!
//! - through the tenant's index (`fluxmem_store::Store::map_index`), when the tenant is named,
//!   the index is current and Stage II does not run: the `k` episodes closest to the query
//!   ranked from the mapped file, their edges kept with it, then one read of the tenant's
//!   semantic nodes, those episodes and the skills their edges lead to. No edge shard is
//!   opened;
//! - else from the shards, through row filters on the tenant's ids: its nodes and vectors, and
//!   the edges of the episodes the ranking retrieves ([`fluxmem_store::EPISODE_EDGES`]); with
//!   Stage II (`all_edges`), every edge from the tenant's nodes and the episodes' steps too (the
//!   loop walks the edges, and a node it merges keeps the first one's body).
//!
//! Other tenants' rows are never decoded. The ranking is the retrieval the store's connect
//! recorded ([`crate::RETRIEVAL_MARKER`]), [`RetrievalConfig::serving`] when it recorded none,
//! with the caller's overrides on top. A read that a commit races (a compaction deleting a
//! shard it was reading) starts again at the new version. A query that changes the store (Stage
//! II's kept edits) commits at the version it read, never over a commit it did not see
//! ([`commit_at`]).

use candle_core::Device;
use fluxmem_graph::{EdgeKind, Embedding, Graph, NodeId, NodeKind};
use fluxmem_store::{CommitInfo, Manifest, Rows, Scan, Store, Writer};
use std::collections::BTreeSet;

use crate::dense::{top_k_rows, DenseIndex, Unembedded};
use crate::retrieve::RetrievalConfig;
use crate::retriever::{Episodes, Retriever};
use crate::tenant::resolve_tenant_among;
use crate::Result;

/// Episodes a query retrieves unless asked otherwise (`fluxmem query --episodes`).
pub const DEFAULT_EPISODES: usize = 3;

/// What one query asks of the store.
pub struct Request<'a> {
    /// The tenant to answer from; the store's only tenant when `None`.
    pub tenant: Option<&'a str>,
    /// The embedding model of the query vector (the store's vectors of it are read).
    pub model: &'a str,
    /// The query's vector.
    pub query_vector: &'a [f32],
    /// Episodes the ranking retrieves.
    pub episodes: usize,
    /// Stage II runs: read every edge of the tenant and the episodes' steps.
    pub all_edges: bool,
    /// The caller's changes to the recorded retrieval (flags).
    pub configure: &'a dyn Fn(RetrievalConfig) -> RetrievalConfig,
}

/// The query's part of the store and its retrieval.
pub struct Served {
    /// The tenant's part of the store that the ranking reads.
    pub graph: Graph,
    /// The tenant answered from.
    pub tenant: String,
    /// The version read.
    pub manifest: Manifest,
    /// The ranking's settings: recorded, then configured.
    pub config: RetrievalConfig,
    /// The tenant's retrieval.
    pub retriever: Retriever,
    /// What the caller should tell the user: a damaged index read around, a recorded retrieval
    /// that is not a setting.
    pub warnings: Vec<String>,
}

/// Reads the query's part of the store at one manifest version and builds its retrieval (see
/// the module docs). Nodes of the tenant without a vector of the model are left out and
/// counted ([`Retriever::not_embedded`]).
pub fn read(store: &Store, request: &Request<'_>, device: &Device) -> Result<Served> {
    let mut warnings = Vec::new();
    loop {
        let indexed = match (request.all_edges, request.tenant) {
            (false, Some(tenant)) => read_indexed(store, tenant, request, device, &mut warnings)?,
            _ => None,
        };
        let (mut graph, tenant, manifest, episodes) = match indexed {
            Some(read) => (read.graph, read.tenant, read.manifest, Some(read.episodes)),
            None => {
                let (graph, tenant, manifest) =
                    read_tenant(store, request.tenant, request.all_edges)?;
                (graph, tenant, manifest, None)
            }
        };
        let recorded = crate::recorded_retrieval(&manifest).unwrap_or_else(|e| {
            warnings.push(format!(
                "the store's `{}` is not a retrieval setting ({e}); ranking with the defaults",
                crate::RETRIEVAL_MARKER
            ));
            None
        });
        let config = (request.configure)(recorded.unwrap_or_else(RetrievalConfig::serving));
        let (model, units) = (request.model, config.units);
        let retriever = match episodes {
            Some(episodes) => {
                Retriever::build_indexed(&graph, &tenant, model, device, units, episodes)?
            }
            None => {
                let retriever = Retriever::build_units(
                    &graph,
                    &tenant,
                    model,
                    device,
                    Unembedded::Skip,
                    units,
                )?;
                if !request.all_edges {
                    let retrieved = retriever.episodes(request.query_vector, request.episodes)?;
                    let retrieved = retrieved.into_iter().map(|(id, _)| id).collect();
                    match edges_of(store, &manifest, &tenant, retrieved) {
                        Ok(edges) => graph.edges = edges.edges,
                        Err(_) if store.manifest()?.version != manifest.version => continue,
                        Err(error) => return Err(error.into()),
                    }
                }
                retriever
            }
        };
        return Ok(Served {
            graph,
            tenant,
            manifest,
            config,
            retriever,
            warnings,
        });
    }
}

/// What Stage II's loop may pack the facts under once the ranking's head (its skills and
/// episodes, which come first) is packed: the budget less the head's tokens and the line break
/// after them; the whole budget without a head.
pub fn facts_budget(
    graph: &Graph,
    head: &[crate::Entry],
    budget: usize,
    count: &dyn Fn(&str) -> Result<usize>,
) -> Result<usize> {
    if head.is_empty() {
        return Ok(budget);
    }
    let head_tokens = crate::pack(graph, head, budget, count)?.tokens;
    Ok(budget.saturating_sub(head_tokens + 1))
}

/// Commits `delta` only when the store is still at `read_version`, the version it was computed
/// from (compare and swap: the writer holds the lock, so nothing commits between the check and
/// the commit); `Err(version now)` when another writer committed in between, and nothing is
/// written.
pub fn commit_at(
    writer: &mut Writer,
    read_version: u64,
    delta: &Graph,
    info: CommitInfo,
) -> fluxmem_store::Result<std::result::Result<(), u64>> {
    let now = writer.manifest().version;
    if now != read_version {
        return Ok(Err(now));
    }
    writer.commit(delta, info)?;
    Ok(Ok(()))
}

/// The query's tenant and its part of the store, read at one manifest version (returned):
/// the tenant's node ids (one pass over the id, tenant and kind columns when the tenant is
/// named and holds nodes; else which tenant owns each node, to resolve it), then that tenant's
/// nodes, edges and vectors through row filters on their id columns ([`scan_of`]).
fn read_tenant(
    store: &Store,
    requested: Option<&str>,
    all: bool,
) -> Result<(Graph, String, Manifest)> {
    let (read, manifest) = store.read_current(|manifest| {
        if let Some(tenant) = requested {
            let ids = store.tenant_node_ids(manifest, tenant, &[])?;
            if !ids.is_empty() {
                let graph = store.scan_at(manifest, &scan_of(tenant, &ids, all))?;
                return Ok(Ok((graph, tenant.to_string())));
            }
        }
        let owners = store.node_tenants(manifest)?;
        let known: BTreeSet<&String> = owners.values().collect();
        let tenant = match resolve_tenant_among(known.into_iter().cloned().collect(), requested) {
            Ok(tenant) => tenant,
            Err(error) => return Ok(Err(error)),
        };
        let ids: BTreeSet<NodeId> = owners
            .into_iter()
            .filter(|(_, t)| *t == tenant)
            .map(|(id, _)| id)
            .collect();
        let graph = store.scan_at(manifest, &scan_of(&tenant, &ids, all))?;
        Ok(Ok((graph, tenant)))
    })?;
    let (graph, tenant) = read?;
    Ok((graph, tenant, manifest))
}

/// What a query reads of its tenant: with Stage II (`all`), its nodes with their steps, the
/// edges from them and their vectors; without, its nodes and vectors only (the ranking's edges
/// are read once it knows its episodes, [`edges_of`]), not the episodes' steps, which neither
/// the ranking nor the context's lines read and which are most of an episode's bytes.
fn scan_of(tenant: &str, ids: &BTreeSet<NodeId>, all: bool) -> Scan {
    if all {
        return Scan::of_tenant(tenant, ids);
    }
    Scan {
        steps: Rows::None,
        edges: false,
        ..Scan::of_tenant(tenant, ids)
    }
}

/// What a query read through its tenant's index.
struct Indexed {
    /// The tenant's semantic nodes with their vectors, the ranked episodes, the edges the
    /// ranking reads of them (kept with the index) and the skills those lead to.
    graph: Graph,
    tenant: String,
    manifest: Manifest,
    /// The tenant's episodes for [`Retriever::build_indexed`]: ranked for the query, and the
    /// count of those without a vector.
    episodes: (Episodes, usize),
}

/// The query's part of `tenant` read through the tenant's current index for the request's
/// model (see the module docs). `None` when the tenant has no current index, or (with a
/// warning) when its file cannot be read.
fn read_indexed(
    store: &Store,
    tenant: &str,
    request: &Request<'_>,
    device: &Device,
    warnings: &mut Vec<String>,
) -> Result<Option<Indexed>> {
    let (model, query_vector) = (request.model, request.query_vector);
    let mut damaged = |reason: &dyn std::fmt::Display| {
        warnings.push(format!(
            "{reason}; reading tenant `{tenant}` from its shards instead"
        ));
    };
    loop {
        let manifest = store.manifest()?;
        let index = match store.map_index(&manifest, tenant, model) {
            Ok(Some(index)) => index,
            Ok(None) => return Ok(None),
            Err(_) if store.manifest()?.version != manifest.version => continue,
            Err(error) => {
                damaged(&error);
                return Ok(None);
            }
        };
        let episodes = rank_indexed(&index, device, query_vector, request.episodes)?;
        let retrieved: BTreeSet<NodeId> = episodes.iter().map(|(id, _)| id.clone()).collect();
        let edges = match index.edges_of(&retrieved) {
            Ok(edges) => edges,
            Err(reason) => {
                damaged(&format!("the index of tenant `{tenant}` is damaged ({reason}); `fluxmem store index --rebuild --tenant {tenant}` writes it again"));
                return Ok(None);
            }
        };
        // The ranked episodes, the skills their distill edges lead to, and the semantic nodes.
        let skills = (edges.iter())
            .filter(|e| e.kind == EdgeKind::Distill)
            .map(|e| e.dst.clone());
        let semantic = (index.ids(NodeKind::Semantic))
            .chain(index.unembedded(NodeKind::Semantic))
            .map(|id| NodeId(id.to_string()));
        let of = Scan {
            nodes: true,
            nodes_of: Some(semantic.chain(retrieved).chain(skills).collect()),
            tenant: Some(tenant.to_string()),
            ..Default::default()
        };
        let mut graph = match store.scan_at(&manifest, &of) {
            Ok(graph) => graph,
            Err(_) if store.manifest()?.version != manifest.version => continue,
            Err(error) => return Err(error.into()),
        };
        edges.into_iter().for_each(|e| graph.upsert_edge(e));
        let rows = (index.vectors(NodeKind::Semantic)).chunks_exact(index.dim().max(1));
        for (id, vector) in index.ids(NodeKind::Semantic).zip(rows) {
            graph.upsert_embedding(Embedding {
                node_id: NodeId(id.to_string()),
                model_id: model.to_string(),
                text_sha256: String::new(),
                vector: vector.to_vec(),
            });
        }
        let ranked = Episodes::Ranked {
            query: query_vector.to_vec(),
            best: episodes,
            of: index.ids(NodeKind::Episodic).len(),
        };
        return Ok(Some(Indexed {
            graph,
            tenant: index.tenant().to_string(),
            manifest,
            episodes: (ranked, index.unembedded(NodeKind::Episodic).len()),
        }));
    }
}

/// The `k` episodes of a mapped index closest to `query_vector`, best first, with their
/// cosines: ranked from the file's normalised vectors in place on the CPU, as
/// [`DenseIndex::top_k_one`] ranks the same vectors read from the shards (elsewhere, through
/// one).
fn rank_indexed(
    index: &fluxmem_store::MappedIndex,
    device: &Device,
    query_vector: &[f32],
    k: usize,
) -> Result<Vec<(NodeId, f32)>> {
    let (rows, dim) = (index.vectors(NodeKind::Episodic), index.dim());
    let ranked = if device.is_cpu() && query_vector.len() == dim {
        top_k_rows(rows, dim, query_vector, k)
    } else {
        DenseIndex::from_normalized_rows(rows.to_vec(), dim, device)?.top_k_one(query_vector, k)?
    };
    let id = |row: usize| {
        index
            .id(NodeKind::Episodic, row)
            .map(|id| NodeId(id.to_string()))
    };
    Ok(ranked
        .into_iter()
        .filter_map(|(row, cos)| Some((id(row)?, cos)))
        .collect())
}

/// The edges the ranking reads of the `retrieved` episodes of `tenant`, at `manifest`
/// ([`fluxmem_store::EPISODE_EDGES`]: the distill edges from them, their skills, and the ground
/// edges to them, their facts' support), from the edge shards.
fn edges_of(
    store: &Store,
    manifest: &Manifest,
    tenant: &str,
    retrieved: BTreeSet<NodeId>,
) -> fluxmem_store::Result<Graph> {
    use fluxmem_store::EpisodeEnd;
    let mut graph = Graph::default();
    if retrieved.is_empty() {
        return Ok(graph);
    }
    for (kind, end) in fluxmem_store::EPISODE_EDGES {
        let ends = Some(retrieved.clone());
        let (edges_from, edges_to) = match end {
            EpisodeEnd::Src => (ends, None),
            EpisodeEnd::Dst => (None, ends),
        };
        let scan = Scan {
            edges: true,
            edge_kinds: vec![kind],
            edges_from,
            edges_to,
            tenant: Some(tenant.to_string()),
            ..Default::default()
        };
        graph.edges.extend(store.scan_at(manifest, &scan)?.edges);
    }
    Ok(graph)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluxmem_graph::{Edge, Node, NodeBody};
    use fluxmem_models::{Embedder, HashEmbedder};

    /// Two tenants' episodes, facts and skills, embedded, with ground edges from every fact to
    /// most episodes, distill edges from episodes to skills, and links between episodes.
    fn tenants_store(dir: &std::path::Path, embedder: &HashEmbedder) {
        let mut graph = Graph::default();
        let add = |graph: &mut Graph, node: Node| {
            let text = node.embedding_text();
            graph.upsert_embedding(Embedding {
                node_id: node.id.clone(),
                model_id: embedder.model_id().to_string(),
                text_sha256: fluxmem_graph::sha256_hex(text.as_bytes()),
                vector: embedder.embed(&[text.as_str()]).unwrap().remove(0),
            });
            let id = node.id.clone();
            graph.upsert_node(node);
            id
        };
        let edge = |src: &NodeId, dst: &NodeId, kind, weight: f32| Edge {
            src: src.clone(),
            dst: dst.clone(),
            kind,
            weight,
            evidence: 1,
            stage: "test".into(),
            run_id: "r".into(),
            created_at: 0,
            active: true,
            metadata: Default::default(),
        };
        for tenant in ["t", "u"] {
            let episodes: Vec<NodeId> = (0..8)
                .map(|i| {
                    let body = NodeBody::Episodic(fluxmem_graph::Episode::default());
                    let text = format!("refund order {i} for a customer of {tenant}");
                    add(&mut graph, Node::new(body, tenant, &text, &[&text]))
                })
                .collect();
            let facts: Vec<NodeId> = (0..5)
                .map(|i| {
                    let body = NodeBody::Semantic(fluxmem_graph::Semantic {
                        source: "policy".into(),
                        position: i,
                        time: None,
                        group: None,
                    });
                    let text = format!("policy {i}: refunds of order {i} need a receipt");
                    add(&mut graph, Node::new(body, tenant, &text, &[&text]))
                })
                .collect();
            let skills: Vec<NodeId> = (0..2)
                .map(|i| {
                    let body = NodeBody::Procedural(fluxmem_graph::Skill::default());
                    let text = format!("Refund skill {i}");
                    add(&mut graph, Node::new(body, tenant, &text, &[&text]))
                })
                .collect();
            for (e, episode) in episodes.iter().enumerate() {
                for (f, fact) in facts.iter().enumerate().filter(|(f, _)| (e + f) % 3 != 0) {
                    let weight = 0.1 + ((e * 5 + f) % 7) as f32 / 10.0;
                    graph.upsert_edge(edge(fact, episode, EdgeKind::Ground, weight));
                }
                graph.upsert_edge(edge(episode, &skills[e % 2], EdgeKind::Distill, 1.0));
                let next = &episodes[(e + 1) % episodes.len()];
                graph.upsert_edge(edge(episode, next, EdgeKind::Link, 0.5));
            }
        }
        let mut writer = fluxmem_store::Writer::open(dir).unwrap();
        writer.commit(&graph, CommitInfo::default()).unwrap();
    }

    /// A query without Stage II reads only the edges of the episodes it retrieves, and ranks
    /// exactly as with every edge of its tenant read; through the tenant's index, it reads the
    /// same edges and ranks the same.
    #[test]
    fn a_query_reads_the_edges_of_its_episodes_and_ranks_as_with_all() {
        let dir = tempfile::tempdir().unwrap();
        let embedder = HashEmbedder::new(64);
        tenants_store(dir.path(), &embedder);
        let mut writer = fluxmem_store::Writer::open(dir.path()).unwrap();
        let model = embedder.model_id();
        writer
            .update_indexes(model, None, false, "r", &mut |_| {})
            .unwrap();
        let store = fluxmem_store::Store::open(dir.path()).unwrap();
        let config = RetrievalConfig::serving();
        assert!(config.ground_support > 0.0);
        let device = candle_core::Device::Cpu;
        let rank = |graph: &Graph, text: &str, k: usize| {
            let retriever = Retriever::build_units(
                graph,
                "t",
                embedder.model_id(),
                &device,
                Unembedded::Fail,
                config.units,
            )
            .unwrap();
            let vector = embedder.embed(&[text]).unwrap().remove(0);
            let ranked = retriever
                .retrieve_split_dense(graph, text, &vector, &vector, &config, None, k)
                .unwrap();
            let episodes: BTreeSet<NodeId> = retriever
                .episodes(&vector, k)
                .unwrap()
                .into_iter()
                .map(|(id, _)| id)
                .collect();
            (ranked, episodes)
        };
        let (whole, _, manifest) = read_tenant(&store, Some("t"), true).unwrap();
        assert!(whole.edges.values().any(|e| e.kind == EdgeKind::Link));
        for (text, k) in [("refund order 3", 2), ("a receipt for order 1", 3)] {
            let (expected, retrieved) = rank(&whole, text, k);
            let skills = expected
                .0
                .iter()
                .filter(|(id, ..)| id.as_str().starts_with("pro"));
            assert!(skills.count() > 0, "the ranking inherits skills");
            let (mut few, _, _) = read_tenant(&store, Some("t"), false).unwrap();
            assert!(few.edges.is_empty());
            few.edges = edges_of(&store, &manifest, "t", retrieved.clone())
                .unwrap()
                .edges;
            // Exactly the distill edges from the retrieved episodes and the ground edges to them.
            let mut wanted = whole.edges.clone();
            wanted.retain(|_, e| match e.kind {
                EdgeKind::Distill => retrieved.contains(&e.src),
                EdgeKind::Ground => retrieved.contains(&e.dst),
                EdgeKind::Link => false,
            });
            assert!(!wanted.is_empty());
            assert_eq!(few.edges, wanted, "{text}");
            assert_eq!(rank(&few, text, k).0, expected, "{text}");

            let vector = embedder.embed(&[text]).unwrap().remove(0);
            let request = Request {
                tenant: Some("t"),
                model,
                query_vector: &vector,
                episodes: k,
                all_edges: false,
                configure: &|config| config,
            };
            let indexed = read_indexed(&store, "t", &request, &device, &mut Vec::new())
                .unwrap()
                .expect("the tenant's index is current");
            assert_eq!(indexed.graph.edges, wanted, "{text}: the index keeps them");
            let retriever = Retriever::build_indexed(
                &indexed.graph,
                "t",
                model,
                &device,
                config.units,
                indexed.episodes,
            )
            .unwrap();
            let ranked = retriever
                .retrieve_split_dense(&indexed.graph, text, &vector, &vector, &config, None, k)
                .unwrap();
            assert_eq!(
                ranked, expected,
                "{text}: the same ranking through the index"
            );
        }
    }

    #[test]
    fn a_refinement_commits_only_over_the_version_it_read() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = fluxmem_store::Writer::open(dir.path()).unwrap();
        let node = |text: &str| {
            fluxmem_graph::Node::new(
                fluxmem_graph::NodeBody::Episodic(fluxmem_graph::Episode::default()),
                "t",
                text,
                &[text],
            )
        };
        let mut first = fluxmem_graph::Graph::default();
        first.upsert_node(node("one"));
        writer.commit(&first, CommitInfo::default()).unwrap();
        let read_version = writer.manifest().version;
        let mut delta = fluxmem_graph::Graph::default();
        delta.upsert_node(node("two"));
        // Another commit lands after the read: the refinement is not written over it.
        let mut other = fluxmem_graph::Graph::default();
        other.upsert_node(node("three"));
        writer.commit(&other, CommitInfo::default()).unwrap();
        let moved = commit_at(&mut writer, read_version, &delta, CommitInfo::default()).unwrap();
        assert_eq!(moved, Err(read_version + 1));
        let store = fluxmem_store::Store::open(dir.path()).unwrap();
        assert_eq!(store.load().unwrap().nodes.len(), 2, "nothing written");
        // At the version it read, it commits.
        let now = writer.manifest().version;
        assert_eq!(
            commit_at(&mut writer, now, &delta, CommitInfo::default()).unwrap(),
            Ok(())
        );
        assert_eq!(store.load().unwrap().nodes.len(), 3);
    }
}
