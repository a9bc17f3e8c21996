//! `fluxmem store recover` and `fluxmem store compact`.

use std::process::ExitCode;

use crate::cli::{CompactArgs, RecoverArgs, Settings};

pub fn recover(args: RecoverArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let options = fluxmem_store::RecoverOptions {
        accept_loss: args.accept_loss,
    };
    let report = fluxmem_store::recover_with(&settings.store, options)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "rebuilt {} at version {}",
        settings.store.join("manifest.json").display(),
        report.version
    );
    if let Some(path) = &report.adopted_temporary {
        println!(
            "  adopted the complete temporary manifest {}",
            path.display()
        );
    }
    for (table, shards) in &report.shards {
        println!(
            "  {table:<10} {shards:>5} shard(s) {:>10} rows",
            report.rows.get(table).copied().unwrap_or(0)
        );
    }
    for (file, reason) in &report.rejected {
        println!("  left out (kept in place): {file}: {reason}");
    }
    for (file, output) in &report.superseded {
        println!(
            "  left out (kept in place): {file}: superseded by the compaction output {output}"
        );
    }
    for lost in &report.lost {
        println!(
            "  lost: {} ({} rows of {}, commit {})",
            lost.file, lost.rows, lost.table, lost.commit
        );
    }
    for note in &report.unproven {
        println!("  not proven: {note}");
    }
    Ok(ExitCode::SUCCESS)
}

pub fn compact(args: CompactArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    if !(0.0..1.0).contains(&args.max_dead_fraction) {
        anyhow::bail!(
            "--max-dead-fraction {}: expected a share in [0, 1)",
            args.max_dead_fraction
        );
    }
    // An existing store only: compacting must not create one.
    fluxmem_store::Store::open(&settings.store)?;
    let mut writer = super::open_writer(settings)?;
    let policy = fluxmem_store::CompactPolicy {
        max_dead_fraction: args.max_dead_fraction,
        merge_factor: args.merge_factor,
        min_level_rows: args.min_level_rows,
        ..Default::default()
    };
    let run_id = super::run_id("compact");
    let report = writer.compact(&policy, &run_id)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", super::run::compaction_line(&report));
    }
    Ok(ExitCode::SUCCESS)
}
