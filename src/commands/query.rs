use anyhow::Context as _;
use fluxmem_connect::{
    pack, resolve_tenant_among, semantic_entry, DenseIndex, Entry, Episodes, Retriever, Unembedded,
};
use fluxmem_graph::{EdgeKind, Embedding, Graph, NodeId, NodeKind};
use fluxmem_models::{DeviceChoice, Generator, Judge};
use fluxmem_refine::{refine_query, LoopModels, Neighbours};
use fluxmem_store::{CommitInfo, Rows, Scan};
use std::collections::BTreeSet;
use std::process::ExitCode;

use crate::cli::{QueryArgs, Settings};

pub fn run(args: QueryArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let device_choice: DeviceChoice = args.device.parse()?;
    let device = device_choice.device()?;
    super::check_loop_flags(&args.refine)?;
    let config_over = |base| {
        super::retrieval_config(
            args.fusion.as_deref(),
            args.weights.as_deref(),
            args.judge_top,
            &args.structure,
            base,
        )
    };
    // The flags are checked before the store is read.
    config_over(fluxmem_connect::RetrievalConfig::serving())?;
    let store = fluxmem_store::Store::open(&settings.store)?;
    let embedder = super::embedder(&args.model, &device_choice, None)?;
    let mut judge = super::judge_from_flag(&args.judge, &device_choice)?;
    let query_vector = embedder.embed(&[args.text.as_str()])?.remove(0);
    // Stage II's loop walks the tenant's edges and may merge episodes; without it, the ranking
    // reads no steps, and only the edges of the episodes it retrieves, at the same version as
    // the nodes (read again from the new version when a compaction deleted a shard between).
    let all_edges = args.refine.refine_rounds > 0;
    let model = embedder.model_id();
    let (mut graph, tenant, manifest, mut config, retriever) = loop {
        // Without Stage II, a named tenant with a current index is read from it: its episodes
        // ranked from the index and their edges taken from it, then one read of its semantic
        // nodes, the ranked episodes and their skills.
        let indexed = match (all_edges, args.tenant.as_deref()) {
            (false, Some(tenant)) => {
                read_indexed(&store, tenant, model, &device, &query_vector, args.episodes)?
            }
            _ => None,
        };
        let (mut graph, tenant, manifest, episodes) = match indexed {
            Some(read) => (read.graph, read.tenant, read.manifest, Some(read.episodes)),
            None => {
                let (graph, tenant, manifest) =
                    read_tenant(&store, args.tenant.as_deref(), all_edges)?;
                (graph, tenant, manifest, None)
            }
        };
        // The ranking the store's ground edges were made with (at the version read), unless a
        // flag says otherwise.
        let recorded = fluxmem_connect::recorded_retrieval(&manifest).unwrap_or_else(|e| {
            eprintln!(
                "warning: the store's `{}` is not a retrieval setting ({e}); ranking with the defaults",
                fluxmem_connect::RETRIEVAL_MARKER
            );
            None
        });
        let config =
            config_over(recorded.unwrap_or_else(fluxmem_connect::RetrievalConfig::serving))?;
        // Only the tenant's nodes; those not embedded yet are left out and counted.
        let Some(episodes) = episodes else {
            let retriever = Retriever::build_units(
                &graph,
                &tenant,
                model,
                &device,
                Unembedded::Skip,
                config.units,
            )?;
            if !all_edges {
                let retrieved = retriever.episodes(&query_vector, args.episodes)?;
                let retrieved = retrieved.into_iter().map(|(id, _)| id).collect();
                match edges_of(&store, &manifest, &tenant, retrieved) {
                    Ok(edges) => graph.edges = edges.edges,
                    Err(_) if store.manifest()?.version != manifest.version => continue,
                    Err(error) => return Err(error.into()),
                }
            }
            break (graph, tenant, manifest, config, retriever);
        };
        let retriever =
            Retriever::build_indexed(&graph, &tenant, model, &device, config.units, episodes)?;
        break (graph, tenant, manifest, config, retriever);
    };
    let read_version = manifest.version;
    let not_embedded = retriever.not_embedded();
    if not_embedded > 0 {
        eprintln!("warning: {not_embedded} nodes of tenant `{tenant}` have no `{}` embedding and were left out; run `fluxmem embed`", embedder.model_id());
    }
    if judge.is_none() {
        config.judge_top = 0;
    }
    // With entities on, the dense signal reads the query without the speakers it names.
    let dense_vector = match retriever.semantic().dense_query(&args.text, &config) {
        Some(text) => embedder.embed(&[text.as_str()])?.remove(0),
        None => query_vector.clone(),
    };
    let (head, semantic) = retriever.retrieve_split_dense(
        &graph,
        &args.text,
        &query_vector,
        &dense_vector,
        &config,
        judge.as_mut().map(|j| j as &mut dyn Judge),
        args.episodes,
    )?;
    let count = |text: &str| {
        embedder
            .count_tokens(text)
            .map_err(fluxmem_connect::Error::from)
    };
    let entries: Vec<Entry> = if args.refine.refine_rounds == 0 {
        head.into_iter()
            .chain(semantic.iter().map(semantic_entry))
            .collect()
    } else {
        // Skills and episodes first; the loop refines the facts under what is left of the budget.
        let head_tokens = pack(&graph, &head, args.budget, &count)?.tokens;
        let options =
            super::loop_options(&args.refine, args.budget.saturating_sub(head_tokens + 1));
        let mut generator = super::reshape_generator(&args.refine, &device_choice)?;
        let neighbours = Neighbours::build(&graph, &tenant);
        let mut verifier = fluxmem_refine::verifier(
            judge.as_mut().map(|j| j as &mut dyn Judge),
            retriever.semantic(),
        );
        let mut models = LoopModels {
            verifier: &mut *verifier,
            embedder: embedder.as_ref(),
            generator: generator.as_mut().map(|g| g as &mut dyn Generator),
            count_tokens: &count,
        };
        let run_id = format!("query@v{read_version}");
        let at = chrono::Utc::now().timestamp_millis();
        let outcome = refine_query(
            &graph,
            retriever.semantic(),
            &neighbours,
            &args.text,
            &semantic,
            &mut models,
            &options,
            &run_id,
            at,
        )?;
        for (t, round) in outcome.rounds.iter().enumerate() {
            eprintln!(
                "refine round {t}: sufficiency {:.2} over {} items -> {}{}",
                round.sufficiency,
                round.items,
                round.attribution,
                round
                    .edit
                    .as_deref()
                    .map(|e| format!(", {e}"))
                    .unwrap_or_default()
            );
        }
        let usage = models.verifier.usage();
        eprintln!(
            "refine: verifier {} ({} calls, {} prompt tokens)",
            models.verifier.name(),
            usage.calls,
            usage.prompt_tokens
        );
        if !outcome.delta.is_empty() {
            let mut writer = super::open_writer(settings)?;
            writer.know_tenants(graph.nodes.values().map(|n| (&n.id, n.tenant.as_str())));
            let summary =
                serde_json::json!({ "query": args.text, "edits": outcome.delta.edits.len() });
            let info = CommitInfo {
                stage: "refine".into(),
                run_id,
                summary,
                progress: Default::default(),
            };
            let committed = commit_at(&mut writer, read_version, &outcome.delta, info)
                .with_context(|| {
                    format!("committing the refinement to {}", settings.store.display())
                })?;
            match committed {
                Ok(()) => eprintln!(
                    "refine: {} edits committed to the store",
                    outcome.delta.edits.len()
                ),
                Err(now) => eprintln!(
                    "refine: not committed: the store moved from version {read_version}, which this query read, to {now} (another writer committed); the {} edits were computed on what it no longer is, run the query again to refine",
                    outcome.delta.edits.len()
                ),
            }
        } else if !outcome.attempted.is_empty() {
            eprintln!(
                "refine: the context stayed insufficient; {} attempted edits were not kept",
                outcome.attempted.len()
            );
        }
        for node in outcome.new_nodes {
            graph.insert_node(node);
        }
        head.into_iter().chain(outcome.ranking).collect()
    };
    // Reshaped nodes may live only in the loop's delta: pack against the graph with it.
    let context = pack(&graph, &entries, args.budget, &count)?;
    // What leaves the store passes the redactor, unless a trusted caller turns it off.
    let redactor = if args.no_redact {
        fluxmem_redact::Redactor::new(fluxmem_redact::RedactConfig {
            enabled: false,
            ..Default::default()
        })
    } else {
        fluxmem_redact::Redactor::default()
    };
    let mut redacted = fluxmem_redact::Counts::new();
    if args.json {
        let mut report = serde_json::to_value(&context)?;
        redactor.redact_json(&mut report, &mut redacted);
        if let Some(object) = report.as_object_mut() {
            object.insert("tenant".into(), tenant.clone().into());
            object.insert("not_embedded".into(), not_embedded.into());
            object.insert("redacted".into(), serde_json::to_value(&redacted)?);
        }
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{}", redactor.redact_into(&context.text(), &mut redacted));
        eprintln!(
            "{} items, {} of {} tokens",
            context.items.len(),
            context.tokens,
            context.budget
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The query's tenant and its part of the store, read at one manifest version (returned):
/// the tenant's node ids (one pass over the id, tenant and kind columns when the tenant is
/// named and holds nodes; else which tenant owns each node, to resolve it), then that tenant's
/// nodes, edges and vectors through row filters on their id columns ([`served`]). Other
/// tenants' rows are never decoded.
fn read_tenant(
    store: &fluxmem_store::Store,
    requested: Option<&str>,
    all: bool,
) -> anyhow::Result<(fluxmem_graph::Graph, String, fluxmem_store::Manifest)> {
    let served = |tenant: &str, ids: &BTreeSet<NodeId>| served(tenant, ids, all);
    let (read, manifest) = store.read_current(|manifest| {
        if let Some(tenant) = requested {
            let ids = store.tenant_node_ids(manifest, tenant, &[])?;
            if !ids.is_empty() {
                let graph = store.scan_at(manifest, &served(tenant, &ids))?;
                return Ok(Ok((graph, tenant.to_string())));
            }
        }
        let owners = store.node_tenants(manifest)?;
        let known: std::collections::BTreeSet<&String> = owners.values().collect();
        let tenant = match resolve_tenant_among(known.into_iter().cloned().collect(), requested) {
            Ok(tenant) => tenant,
            Err(error) => return Ok(Err(error)),
        };
        let ids: BTreeSet<NodeId> = owners
            .into_iter()
            .filter(|(_, t)| *t == tenant)
            .map(|(id, _)| id)
            .collect();
        let graph = store.scan_at(manifest, &served(&tenant, &ids))?;
        Ok(Ok((graph, tenant)))
    })?;
    let (graph, tenant) = read?;
    Ok((graph, tenant, manifest))
}

/// What a query reads of its tenant: with Stage II (`all`), its nodes with their steps, the
/// edges from them and their vectors (the loop walks the edges, and a node it merges keeps the
/// first one's body); without, its nodes and vectors only (the ranking's edges are read once
/// it knows its episodes, [`edges_of`]), not the episodes' steps, which neither the ranking
/// nor the context's lines read and which are most of an episode's bytes.
fn served(tenant: &str, ids: &BTreeSet<NodeId>, all: bool) -> Scan {
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
    manifest: fluxmem_store::Manifest,
    /// The tenant's episodes for [`Retriever::build_indexed`]: ranked for the query, and the
    /// count of those without a vector.
    episodes: (Episodes, usize),
}

/// The query's part of `tenant` read through the tenant's current index for `model`
/// ([`fluxmem_store::Store::map_index`]): the `k` episodes closest to `query_vector`, ranked
/// from the mapped file, and their edges, kept with it; then one read of the nodes: the
/// ranked episodes, the skills their edges lead to and the tenant's semantic nodes (vectors
/// from the index). No edge shard is opened. `None` when the tenant has no current index, or
/// (with a warning) when its file cannot be read.
fn read_indexed(
    store: &fluxmem_store::Store,
    tenant: &str,
    model: &str,
    device: &candle_core::Device,
    query_vector: &[f32],
    k: usize,
) -> anyhow::Result<Option<Indexed>> {
    let damaged = |reason: &dyn std::fmt::Display| {
        eprintln!("warning: {reason}; reading tenant `{tenant}` from its shards instead");
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
        let episodes = rank_indexed(&index, device, query_vector, k)?;
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
    device: &candle_core::Device,
    query_vector: &[f32],
    k: usize,
) -> anyhow::Result<Vec<(NodeId, f32)>> {
    let (rows, dim) = (index.vectors(NodeKind::Episodic), index.dim());
    let ranked = if device.is_cpu() && query_vector.len() == dim {
        fluxmem_connect::top_k_rows(rows, dim, query_vector, k)
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
    store: &fluxmem_store::Store,
    manifest: &fluxmem_store::Manifest,
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

/// Commits `delta` only when the store is still at `read_version`, the version it was computed
/// from (compare and swap: the writer holds the lock, so nothing commits between the check and
/// the commit); `Err(version now)` when another writer committed in between, and nothing is
/// written.
fn commit_at(
    writer: &mut fluxmem_store::Writer,
    read_version: u64,
    delta: &fluxmem_graph::Graph,
    info: CommitInfo,
) -> fluxmem_store::Result<Result<(), u64>> {
    let now = writer.manifest().version;
    if now != read_version {
        return Ok(Err(now));
    }
    writer.commit(delta, info)?;
    Ok(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluxmem_graph::{Edge, Embedding, Graph, Node, NodeBody};
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
        let config = fluxmem_connect::RetrievalConfig::serving();
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
            let indexed = read_indexed(&store, "t", model, &device, &vector, k)
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
