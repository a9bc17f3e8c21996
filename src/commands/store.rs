//! `fluxmem store recover`, `fluxmem store compact` and `fluxmem store index`.

use std::process::ExitCode;

use crate::cli::{CompactArgs, IndexArgs, RecoverArgs, Settings};

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

pub fn index(args: IndexArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    // An existing store only: indexing must not create one.
    fluxmem_store::Store::open(&settings.store)?;
    let mut writer = super::open_writer(settings)?;
    let tenants = (!args.tenant.is_empty()).then_some(args.tenant.as_slice());
    let run_id = super::run_id("index");
    let json = args.json;
    let updates = index_tenants(&mut writer, tenants, args.rebuild, &run_id, &mut |update| {
        if json {
            println!(
                "{}",
                serde_json::to_string(update).expect("an update serialises")
            );
        } else {
            println!("{}", index_line(update));
        }
    })?;
    if updates.is_none() {
        eprintln!("nothing to index: the store holds no embedding yet (run `fluxmem embed`)");
    }
    Ok(ExitCode::SUCCESS)
}

/// Brings the indexes of `tenants` (every tenant when `None`) up to date for the store's
/// embedding model; `None` when the store has no embedding model yet.
pub(crate) fn index_tenants(
    writer: &mut fluxmem_store::Writer,
    tenants: Option<&[String]>,
    rebuild: bool,
    run_id: &str,
    progress: &mut dyn FnMut(&fluxmem_store::IndexUpdate),
) -> anyhow::Result<Option<Vec<fluxmem_store::IndexUpdate>>> {
    let Some(model) = writer.manifest().embedding_model.clone() else {
        return Ok(None);
    };
    if let Some(named) = tenants {
        let known = writer.store().tenants(writer.manifest())?;
        if let Some(unknown) = named.iter().find(|t| !known.contains(*t)) {
            anyhow::bail!(
                "--tenant `{unknown}`: the store has no node of that tenant (tenants: {})",
                known.into_iter().collect::<Vec<_>>().join(", ")
            );
        }
    }
    Ok(Some(writer.update_indexes(
        &model.id, tenants, rebuild, run_id, progress,
    )?))
}

/// One line of `store index` (and of `run`'s log) for one tenant.
pub(crate) fn index_line(update: &fluxmem_store::IndexUpdate) -> String {
    use fluxmem_store::IndexHow;
    let from = match update.how {
        IndexHow::Current => return format!("index {}: current, not read", update.tenant),
        IndexHow::Added => "from the previous index and the rows added since",
        IndexHow::Full => "from all of the tenant's shards",
    };
    format!(
        "index {}: {} nodes with a vector ({} more without), {} episode edges, {:.1} MB, {from}",
        update.tenant,
        update.rows,
        update.unembedded,
        update.edges,
        update.bytes as f64 / 1e6,
    )
}
