use anyhow::Context;
use fluxmem_refine::{refine_store, CreditOptions};
use std::process::ExitCode;

use super::open_writer;
use crate::cli::{check_flag, Bound, RefineArgs, Settings};
use crate::progress::CountBar;

pub fn run(args: RefineArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    // Before the store is opened: a NaN or an infinity here makes every edge weight NaN.
    check_flag("--prior", args.prior, Bound::Positive)?;
    check_flag("--prune-below", args.prune_below, Bound::NonNegative)?;
    check_flag("--tolerance", args.tolerance, Bound::NonNegative)?;
    check_flag("--prior-drift", args.prior_drift, Bound::NonNegative)?;
    check_flag(
        "--max-delta-share",
        args.max_delta_share,
        Bound::NonNegative,
    )?;
    let options = CreditOptions {
        prior: args.prior,
        prune_below: args.prune_below,
        min_evidence: args.min_evidence,
        link_failures: !args.no_failure_links,
        max_failure_links: args.max_failure_links,
        tolerance: args.tolerance,
        prior_drift: args.prior_drift,
        commit_every: args.commit_every,
        full: args.full,
        max_delta_share: args.max_delta_share,
    };
    let mut writer = open_writer(settings)?;
    // The run id depends only on the store state it started from: same store, same shards.
    let run_id = super::stage_run_id(writer.manifest(), fluxmem_refine::STAGE);
    let mut bar = CountBar::new(settings.progress, "refine");
    let report = refine_store(&mut writer, &options, &run_id, &mut bar)
        .with_context(|| format!("refining the store {}", settings.store.display()))?;
    bar.finish();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let rates: Vec<String> = report
            .base_rate
            .iter()
            .map(|(t, p)| format!("{t} {p:.3}"))
            .collect();
        println!(
            "{} episodes ({} with outcomes; base success rate {}): {} edges reweighted, {} pruned, {} re-activated, {} failure->success links; {} edits ({} commits); {} edges read ({})",
            report.episodes,
            report.with_outcome,
            if rates.is_empty() { "-".to_string() } else { rates.join(", ") },
            report.reweighted,
            report.pruned,
            report.reactivated,
            report.expanded,
            report.edits,
            report.commits,
            report.edges_decided,
            if report.delta { "those added since the last run" } else { "every live edge" }
        );
    }
    Ok(ExitCode::SUCCESS)
}
