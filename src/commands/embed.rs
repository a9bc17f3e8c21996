use anyhow::Context;
use fluxmem_embed::{embed_store, EmbedOptions};
use fluxmem_models::DeviceChoice;
use std::process::ExitCode;

use super::{open_writer, run_id};
use crate::cli::{EmbedArgs, Settings};
use crate::progress::CountBar;

pub fn run(args: EmbedArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let device: DeviceChoice = args.device.parse()?;
    let embedder = super::embedder(&args.model, &device, Some(args.batch_size))?;
    let mut writer = open_writer(settings)?;
    let options = EmbedOptions {
        batch_size: 256,
        commit_every: args.commit_every,
        reembed: args.reembed,
        window: args.window.get(),
        ..Default::default()
    };
    let mut bar = CountBar::new(settings.progress, "embed");
    let started = std::time::Instant::now();
    let report = embed_store(
        &mut writer,
        embedder.as_ref(),
        &options,
        &run_id("embed"),
        &mut bar,
    )
    .with_context(|| format!("embedding the store {}", settings.store.display()))?;
    bar.finish();
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let mut json = serde_json::to_value(&report)?;
        json["model"] = serde_json::Value::from(embedder.model_id());
        json["seconds"] = serde_json::Value::from((seconds * 1000.0).round() / 1000.0);
        println!("{json}");
    } else {
        println!(
            "{} nodes: {} embedded, {} from the cache, {} already had a vector ({} commits, {:.1}s, model {})",
            report.nodes,
            report.embedded,
            report.cached,
            report.already,
            report.commits,
            seconds,
            embedder.model_id()
        );
        if report.changed > 0 {
            println!(
                "{} of them grew since their vector was made (a conversation logged again, longer): their stale vectors were replaced",
                report.changed
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
