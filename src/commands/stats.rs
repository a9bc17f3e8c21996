use fluxmem_graph::GraphStats;
use std::path::Path;
use std::process::ExitCode;

use crate::cli::{Settings, StatsArgs};

pub fn run(args: StatsArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let store = fluxmem_store::Store::open(&settings.store)?;
    let (stats, manifest) = store.stats()?;
    if args.json {
        let json = serde_json::json!({
            "nodes": {"semantic": stats.semantic, "episodic": stats.episodic, "procedural": stats.procedural},
            "edges": {"ground": stats.ground, "distill": stats.distill, "link": stats.link},
            "embedded": stats.embedded,
            "manifest_version": manifest.version,
        });
        println!("{json}");
    } else {
        print_table(&stats, manifest.version, &settings.store);
    }
    Ok(ExitCode::SUCCESS)
}

/// The human-readable stats table.
pub fn print_table(stats: &GraphStats, version: u64, store: &Path) {
    println!("store {} (manifest version {version})", store.display());
    println!(
        "  nodes   semantic {:>8}  episodic {:>8}  procedural {:>6}",
        stats.semantic, stats.episodic, stats.procedural
    );
    println!(
        "  edges   ground   {:>8}  distill  {:>8}  link       {:>6}",
        stats.ground, stats.distill, stats.link
    );
    println!("  embedded nodes {:>8}", stats.embedded);
}
