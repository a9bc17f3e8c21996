use anyhow::Context as _;
use fluxmem_connect::{pack, semantic_entry, Entry};
use fluxmem_models::{DeviceChoice, Generator, Judge};
use fluxmem_refine::{refine_query, LoopModels, Neighbours};
use fluxmem_store::CommitInfo;
use std::process::ExitCode;

use crate::cli::{QueryArgs, Settings};

pub fn run(args: QueryArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let device_choice: DeviceChoice = args.device.parse()?;
    let device = device_choice.device()?;
    super::check_loop_flags(&args.refine)?;
    // The flags are checked before the store is read.
    let configure = super::retrieval_overrides(
        args.fusion.as_deref(),
        args.weights.as_deref(),
        args.judge_top,
        &args.structure,
    )?;
    let store = fluxmem_store::Store::open(&settings.store)?;
    let embedder = super::embedder(&args.model, &device_choice, None)?;
    let mut judge = super::judge_from_flag(&args.judge, &device_choice)?;
    let query_vector = embedder.embed(&[args.text.as_str()])?.remove(0);
    // Stage II's loop walks the tenant's edges and may merge episodes; without it, the ranking
    // reads no steps, and only the edges of the episodes it retrieves, at the same version as
    // the nodes (read again from the new version when a compaction deleted a shard between).
    let all_edges = args.refine.refine_rounds > 0;
    let request = fluxmem_connect::serve::Request {
        tenant: args.tenant.as_deref(),
        model: embedder.model_id(),
        query_vector: &query_vector,
        episodes: args.episodes,
        all_edges,
        configure: &configure,
    };
    let served = fluxmem_connect::serve::read(&store, &request, &device)?;
    for warning in &served.warnings {
        eprintln!("warning: {warning}");
    }
    let fluxmem_connect::serve::Served {
        mut graph,
        tenant,
        manifest,
        mut config,
        retriever,
        ..
    } = served;
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
        let facts_budget =
            fluxmem_connect::serve::facts_budget(&graph, &head, args.budget, &count)?;
        let options = super::loop_options(&args.refine, facts_budget);
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
            let committed =
                fluxmem_connect::serve::commit_at(&mut writer, read_version, &outcome.delta, info)
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
