use anyhow::Context;
use fluxmem_connect::{connect_store, ConnectOptions};
use fluxmem_models::DeviceChoice;
use std::process::ExitCode;

use super::open_writer;
use crate::cli::{ConnectArgs, Settings};
use crate::progress::CountBar;

pub fn run(args: ConnectArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    // Flag values first, before a model is loaded or the store opened.
    let retrieval = super::retrieval_config(
        Some(&args.fusion),
        Some(&args.weights),
        0,
        &args.structure,
        fluxmem_connect::RetrievalConfig::serving(),
    )?;
    let device_choice: DeviceChoice = args.device.parse()?;
    let device = device_choice.device()?;
    let embedder = super::embedder(&args.model, &device_choice, None)?;
    let options = ConnectOptions {
        per_step: !args.per_task,
        ground_k: args.ground_k,
        link_k: args.link_k,
        commit_every: args.commit_every,
        retrieval,
        memory: args.memory_mb.get().saturating_mul(1 << 20),
        ..Default::default()
    };
    let mut writer = open_writer(settings)?;
    // Edges record the run that wrote them; the id depends only on the store state it started
    // from, so the same store and options always give the same shards.
    let run_id = super::stage_run_id(writer.manifest(), fluxmem_connect::STAGE);
    let mut bar = CountBar::new(settings.progress, "connect");
    let report = connect_store(
        &mut writer,
        embedder.as_ref(),
        &options,
        &run_id,
        &device,
        &mut bar,
    )
    .with_context(|| format!("connecting the store {}", settings.store.display()))?;
    bar.finish();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} episodes: {} connected now, {} already; {} ground and {} link edges ({} commits{})",
            report.episodes,
            report.connected,
            report.already,
            report.ground_edges,
            report.link_edges,
            report.commits,
            fits(&report)
        );
        if report.regrounded > 0 {
            println!(
                "{} of them were connected before and grew since (a conversation logged again, longer): connected again",
                report.regrounded
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// How the night fitted `--memory-mb`, when it took groups or spilled facts.
fn fits(report: &fluxmem_connect::ConnectReport) -> String {
    let mut parts = Vec::new();
    if report.groups > 1 {
        parts.push(format!("{} groups of episodes", report.groups));
    }
    if report.fact_partitions > 0 {
        parts.push(format!(
            "facts spilled to {} partitions",
            report.fact_partitions
        ));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("; {} to fit --memory-mb", parts.join(", "))
    }
}
