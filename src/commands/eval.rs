use anyhow::Context;
use fluxmem_eval::locomo::{evaluate, LocomoOptions, LocomoReport, SYSTEMS};
use fluxmem_models::DeviceChoice;
use std::process::ExitCode;

use crate::cli::{LocomoArgs, Settings};
use crate::progress::CountBar;

pub fn locomo(args: LocomoArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let device_choice: DeviceChoice = args.device.parse()?;
    let device = device_choice.device()?;
    let embedder = fluxmem_models::load_embedder(&args.model, &device_choice)?;
    let mut judge = super::judge_from_flag(&args.judge, &device_choice)?;
    let options = LocomoOptions {
        conversations: args.conversations,
        include_adversarial: args.include_adversarial,
        budgets: args.budgets,
        sample: args.sample,
        seed: args.seed,
        retrieval: super::retrieval_config(&args.fusion, &args.weights, if judge.is_some() { args.judge_top } else { 0 })?,
        refine: super::loop_options(&args.refine, args.refine_budget),
    };
    let mut generator = super::reshape_generator(&args.refine, &device_choice)?;
    let bar = CountBar::new(settings.progress, "eval");
    let mut progress = |done: usize, total: usize| bar.set(done as u64, total as u64);
    let report = evaluate(
        &args.data,
        &options,
        &embedder,
        judge.as_mut().map(|j| j as &mut dyn fluxmem_models::Judge),
        generator.as_mut().map(|g| g as &mut dyn fluxmem_models::Generator),
        &device,
        &mut progress,
    )
    .with_context(|| format!("evaluating {}", args.data.display()))?;
    bar.finish();
    print_table(&report, &options.budgets);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(report: &LocomoReport, budgets: &[usize]) {
    let evidence = &report.evidence;
    println!(
        "{} questions; evidence ids: {} resolved, {} normalised, {} unresolved; {} questions without resolvable evidence",
        report.questions,
        evidence.resolved,
        evidence.normalized,
        evidence.unresolved.len(),
        evidence.questions_without_evidence
    );
    for (id, tokens) in &report.conversation_tokens {
        println!("conversation {id}: {tokens} tokens in full");
    }
    let mut header = format!("{:<8} {:<8}", "system", "category");
    for k in fluxmem_eval::metrics::KS {
        header.push_str(&format!(" {:>7}", format!("R@{k}")));
    }
    for budget in budgets {
        header.push_str(&format!(" {:>7}", format!("R@{budget}t")));
    }
    header.push_str(&format!(" {:>7} {:>5}", "tokens", "n"));
    println!("{header}");
    for system in SYSTEMS {
        let Some(result) = report.systems.get(system) else { continue };
        let rows = std::iter::once(("all".to_string(), &result.overall)).chain(result.by_category.iter().map(|(c, s)| (c.clone(), s)));
        for (category, summary) in rows {
            let mut line = format!("{system:<8} {category:<8}");
            let cell = |value: Option<&f64>| value.map_or_else(|| format!(" {:>7}", "-"), |v| format!(" {v:>7.3}"));
            for k in fluxmem_eval::metrics::KS {
                line.push_str(&cell(summary.recall_at_k.get(&format!("recall@{k}"))));
            }
            for budget in budgets {
                line.push_str(&cell(summary.recall_at_budget.get(&budget.to_string())));
            }
            line.push_str(&format!(" {:>7.0} {:>5}", summary.mean_context_tokens, summary.questions));
            println!("{line}");
        }
    }
    let refine = &report.refine;
    if refine.rounds > 0 {
        println!(
            "refine: T={} at {} tokens, verifier {}{}; {} of {} questions sufficient, {:.2} edit rounds each; attributions {:?}; edits {:?} ({} persisted); verifier {:.1} calls and {:.0} prompt tokens per question",
            refine.rounds,
            refine.budget,
            refine.verifier,
            refine.generator.as_deref().map(|g| format!(", reshape generator {g} ({} calls, {} tokens)", refine.generator_calls, refine.generator_tokens)).unwrap_or_default(),
            refine.sufficient,
            refine.questions,
            refine.mean_edit_rounds,
            refine.attributions,
            refine.edits_attempted,
            refine.edits_persisted,
            refine.verifier_calls_per_question,
            refine.verifier_tokens_per_question,
        );
    }
    if report.judge_calls > 0 {
        println!("judge: {} calls, {} prompt tokens", report.judge_calls, report.judge_prompt_tokens);
    }
}
