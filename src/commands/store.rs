//! `fluxmem store recover`.

use std::process::ExitCode;

use crate::cli::{RecoverArgs, Settings};

pub fn recover(args: RecoverArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let report = fluxmem_store::recover(&settings.store)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("rebuilt {} at version {}", settings.store.join("manifest.json").display(), report.version);
    if let Some(path) = &report.adopted_temporary {
        println!("  adopted the complete temporary manifest {}", path.display());
    }
    for (table, shards) in &report.shards {
        println!("  {table:<10} {shards:>5} shard(s) {:>10} rows", report.rows.get(table).copied().unwrap_or(0));
    }
    for (file, reason) in &report.rejected {
        println!("  left out (kept in place): {file}: {reason}");
    }
    for note in &report.unproven {
        println!("  not proven: {note}");
    }
    Ok(ExitCode::SUCCESS)
}
