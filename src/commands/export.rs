use anyhow::Context;
use fluxmem_consolidate::{export_skills, ExportOptions};
use std::process::ExitCode;

use crate::cli::{ExportSkillsArgs, Settings};

pub fn skills(args: ExportSkillsArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let format = args.format.parse().map_err(anyhow::Error::msg)?;
    if let Some(min_pems) = args.min_pems {
        crate::cli::check_flag("--min-pems", min_pems, crate::cli::Bound::Finite)?;
    }
    // The cheap checks of the export directory, before the store is loaded.
    crate::pipeline::check_export_out(&args.out).map_err(|e| anyhow::anyhow!("--out {e}"))?;
    let store = fluxmem_store::Store::open(&settings.store)?;
    if let Some(min_eta) = args.min_eta {
        crate::cli::check_flag("--min-eta", min_eta, crate::cli::Bound::Finite)?;
    }
    let options = ExportOptions {
        format,
        tenant: args.tenant,
        min_pems: args.min_pems,
        min_eta: args.min_eta,
        min_support: args.min_support,
    };
    let report = export_skills(&store, &args.out, &options)
        .with_context(|| format!("exporting skills to {}", args.out.display()))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let change = if report.unchanged {
            "unchanged: the release in place held these skills already".to_string()
        } else {
            format!(
                "{} added, {} updated, {} retired",
                report.added, report.updated, report.retired
            )
        };
        println!(
            "{} skills exported to {} ({} left out by the filters; {change}); release manifest {}",
            report.skills,
            args.out.display(),
            report.filtered_out,
            report.release.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
