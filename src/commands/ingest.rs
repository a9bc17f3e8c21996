use anyhow::Context;
use fluxmem_ingest::{Format, IngestOptions};
use std::process::ExitCode;

use super::{open_writer, run_id};
use crate::cli::{IngestArgs, Settings};
use crate::progress::IngestBar;

pub fn run(args: IngestArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let options = IngestOptions {
        format: Format::parse(&args.format)?,
        tenant: args.tenant,
        agent_id: args.agent,
        max_record_bytes: args.max_record_bytes,
        chunk_words: args.chunk_words,
        batch_records: args.batch_records.max(1),
        batch_files: args.batch_files.max(1),
        batch_bytes: IngestOptions::default().batch_bytes,
        shard: fluxmem_store::Shard::ALL,
        follow_symlinks: args.follow_symlinks,
        reread: args.reread,
        ..IngestOptions::default()
    };
    let device: fluxmem_models::DeviceChoice = args.device.parse()?;
    let mut judge = match &args.label_outcomes {
        Some(name) => super::ModelOutcomeJudge::from_flag(name, &device)?,
        None => None,
    };
    let mut writer = open_writer(settings)?;
    let mut bar = IngestBar::new(settings.progress);
    let run = run_id("ingest");
    let report = fluxmem_ingest::ingest_judged(
        &mut writer,
        &args.paths,
        &options,
        judge
            .as_mut()
            .map(|j| j as &mut dyn fluxmem_ingest::outcome::OutcomeJudge),
        &run,
        &mut bar,
    )
    .with_context(|| format!("ingesting into {}", settings.store.display()))?;
    bar.finish();
    // Left out on purpose (fluxmem's own output, links not followed): said, never silent.
    for skipped in &report.skipped {
        eprintln!("skipped: {}: {}", skipped.path.display(), skipped.reason);
    }
    if args.json {
        // The whole report (`IngestReport`: every count, `grown` and `conflicting` too), and
        // the judge's use.
        let mut json = serde_json::to_value(&report)?;
        json["judge"] = serde_json::json!(judge.as_ref().map(|j| serde_json::json!({
            "model": fluxmem_ingest::outcome::OutcomeJudge::model(j),
            "calls": j.usage().calls,
            "prompt_tokens": j.usage().prompt_tokens,
        })));
        println!("{json}");
    } else {
        println!(
            "read {} records from {} files: {} ingested, {} duplicates, {} quarantined ({} nodes added, {} commits)",
            report.read, report.files, report.ingested, report.duplicates, report.quarantined, report.nodes_added, report.commits
        );
        if report.grown + report.conflicting > 0 {
            println!(
                "{} of the ingested are longer versions of stored conversations (replaced them, `episode_grown` edits), {} contradict a stored version (kept apart, `conflicts_with`)",
                report.grown, report.conflicting
            );
        }
        if report.unchanged_files > 0 {
            println!(
                "{} files unchanged since they were ingested: not read again (--reread reads them)",
                report.unchanged_files
            );
        }
        if report.judge_errors > 0 {
            println!(
                "the judge failed on {} runs: they keep the rule's outcome (each is on stderr)",
                report.judge_errors
            );
        }
        if let Some(path) = &report.quarantine_file {
            println!("quarantine file: {}", path.display());
        }
        if !report.outcomes.is_empty() {
            let parts: Vec<String> = report
                .outcomes
                .iter()
                .map(|(source, n)| format!("{n} {source}"))
                .collect();
            println!(
                "outcomes of the new episodes: {} (inferred: ingest's rule, judged: --label-outcomes, see docs/formats/outcomes.md)",
                parts.join(", ")
            );
        }
        let (stats, manifest) = writer.store().stats()?;
        super::stats::print_table(&stats, manifest.version, &settings.store);
    }
    Ok(if report.quarantined > 0 {
        ExitCode::from(crate::EXIT_QUARANTINED)
    } else {
        ExitCode::SUCCESS
    })
}
