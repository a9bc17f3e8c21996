use anyhow::Context;
use fluxmem_consolidate::{
    consolidate_store, ConsolidateOptions, ConsolidateReport, KMeansOptions, Models, PemsOptions,
};
use fluxmem_models::{DeviceChoice, Generator, Judge};
use std::process::ExitCode;

use super::open_writer;
use crate::cli::{ConsolidateArgs, Settings};
use crate::progress::CountBar;

pub fn run(args: ConsolidateArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let options = options(&args)?;
    let device_choice: DeviceChoice = args.device.parse()?;
    let device = device_choice.device()?;
    let embedder = super::embedder(&args.model, &device_choice, None)?;
    let mut generator = match args.generator.as_str() {
        "none" => None,
        name => Some(fluxmem_models::load_generator(
            name,
            &device_choice,
            super::models::weight_path(&args.weights)?,
        )?),
    };
    let mut replayer = super::replayer_from_flag(&args.eta, &args.judge, &device_choice)?;
    let mut judge = super::judge_from_flag(&args.judge, &device_choice)?;
    let mut writer = open_writer(settings)?;
    // Nodes, edges and edits record the run; the id depends only on the store state it started
    // from, so the same store and options always give the same shards.
    let run_id = super::stage_run_id(writer.manifest(), fluxmem_consolidate::STAGE);
    let mut models = Models {
        embedder: embedder.as_ref(),
        generator: generator.as_mut().map(|g| g as &mut dyn Generator),
        judge: judge.as_mut().map(|j| j as &mut dyn Judge),
        replayer: replayer.as_mut().map(|r| r as &mut dyn Generator),
    };
    let mut bar = CountBar::new(settings.progress, "consolidate");
    let started = std::time::Instant::now();
    let report = consolidate_store(
        &mut writer,
        &mut models,
        &options,
        &run_id,
        &device,
        &mut bar,
    )
    .with_context(|| format!("consolidating the store {}", settings.store.display()))?;
    bar.finish();
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let mut json = serde_json::to_value(&report)?;
        json["seconds"] = serde_json::Value::from((seconds * 1000.0).round() / 1000.0);
        println!("{json}");
    } else {
        print_human(&report, seconds);
    }
    Ok(ExitCode::SUCCESS)
}

fn options(args: &ConsolidateArgs) -> anyhow::Result<ConsolidateOptions> {
    let clusters = super::clusters_flag(&args.clusters)?;
    if args.max_rounds == 0 {
        anyhow::bail!("--max-rounds must be at least 1");
    }
    crate::cli::check_flag("--epsilon", args.epsilon, crate::cli::Bound::NonNegative)?;
    crate::cli::check_flag(
        "--reinduce-share",
        args.reinduce_share,
        crate::cli::Bound::NonNegative,
    )?;
    crate::cli::check_flag(
        "--recluster-share",
        args.recluster_share,
        crate::cli::Bound::NonNegative,
    )?;
    let length = args.length.parse().map_err(anyhow::Error::msg)?;
    Ok(ConsolidateOptions {
        kmeans: KMeansOptions {
            clusters,
            seed: args.seed,
            ..Default::default()
        },
        successful_only: args.successful_only,
        pems: PemsOptions {
            length,
            divide_by_skills: args.divide_by_skills,
        },
        max_rounds: args.max_rounds,
        epsilon: args.epsilon,
        prompt_budget: args.prompt_budget,
        max_tokens: args.max_tokens,
        judge_episodes: args.judge_episodes,
        replay_steps: args.replay_steps,
        outcomes: super::outcomes_flag("--outcomes", &args.outcomes)?,
        tenant: args.tenant.clone(),
        retry_failed: args.retry_failed,
        split_by_procedure: !args.no_procedure_split,
        merge_by_procedure: !args.no_procedure_merge,
        reinduce_share: args.reinduce_share,
        assign: !args.recluster,
        recluster_share: args.recluster_share,
        ..Default::default()
    })
}

/// One line on the tenants whose new episodes joined their skills' clusters (`None` when k-means
/// clustered every tenant).
pub fn assignment_line(report: &ConsolidateReport) -> Option<String> {
    (report.tenants_assigned > 0).then(|| {
        format!(
            "{} tenant(s) took their new episodes into their skills' clusters (no k-means), {} clustered again; {} episode(s) fit no cluster and wait for a re-clustering",
            report.tenants_assigned, report.tenants_clustered, report.unassigned
        )
    })
}

/// The episodes by outcome source, as one line.
pub fn outcomes_line(report: &ConsolidateReport) -> String {
    let parts: Vec<String> = report
        .outcome_sources
        .iter()
        .map(|(source, n)| format!("{n} {source}"))
        .collect();
    format!("outcomes of the episodes read: {}", parts.join(", "))
}

fn print_human(report: &ConsolidateReport, seconds: f64) {
    println!(
        "{} episodes in {} clusters: {} new skills, {} updated, {} unchanged, {} kept, {} failed ({} sharing no procedure, {} failed earlier); {} commit(s), {:.1}s",
        report.episodes,
        report.clusters,
        report.skills_new,
        report.skills_updated,
        report.skills_unchanged,
        report.skills_kept,
        report.failed,
        report.no_procedure,
        report.failed_earlier,
        report.commits,
        seconds
    );
    if let Some(line) = assignment_line(report) {
        println!("{line}");
    }
    println!("{}", outcomes_line(report));
    println!(
        "generator {}: {} calls, {} prompt + {} generated tokens; eta from {}{}",
        report.generator_model,
        report.generator.calls,
        report.generator.prompt_tokens,
        report.generator.generated_tokens,
        report.eta_source,
        report
            .judge_model
            .as_ref()
            .map(|_| format!(
                ": {} calls, {} prompt + {} generated tokens",
                report.judge.calls, report.judge.prompt_tokens, report.judge.generated_tokens
            ))
            .unwrap_or_default()
    );
    for skill in &report.skills {
        let history: Vec<String> = skill
            .rounds
            .iter()
            .map(|r| format!("{:.4}", r.pems))
            .collect();
        let converged = skill
            .converged_round
            .map(|r| format!("converged at round {r}"))
            .unwrap_or_else(|| "round limit".into());
        println!(
            "  {} v{} {:?}: {} episodes, PEMS [{}] ({converged}, kept round {}), {:.1}s",
            skill.id,
            skill.version,
            skill.name,
            skill.support,
            history.join(", "),
            skill.best_round,
            skill.seconds
        );
        if !skill.absorbed.is_empty() {
            let ids: Vec<&str> = skill.absorbed.iter().map(|id| id.as_str()).collect();
            println!(
                "    takes the place of {} (one procedure): {}",
                ids.len(),
                ids.join(", ")
            );
        }
    }
    for failure in &report.failures {
        let problem = failure
            .attempts
            .last()
            .map(|a| a.problem.as_str())
            .unwrap_or("");
        println!(
            "  failed {} ({} episodes): {problem}; raw output kept in the edit log",
            failure.target,
            failure.episodes.len()
        );
    }
}
