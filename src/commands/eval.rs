use anyhow::Context;
use fluxmem_eval::locomo::{evaluate, LocomoOptions, LocomoReport, SERVED, SYSTEMS};
use fluxmem_models::DeviceChoice;
use std::process::ExitCode;

use crate::cli::{EvalSkillsArgs, LocomoArgs, Settings};
use crate::progress::CountBar;

pub fn locomo(args: LocomoArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let device_choice: DeviceChoice = args.device.parse()?;
    let device = device_choice.device()?;
    let retrieval = super::retrieval_config(
        Some(&args.fusion),
        Some(&args.weights),
        args.judge_top,
        &args.structure,
        fluxmem_connect::RetrievalConfig::serving(),
    )?;
    super::check_loop_flags(&args.refine)?;
    let embedder = fluxmem_models::load_embedder(&args.model, &device_choice)?;
    let mut judge = super::judge_from_flag(&args.judge, &device_choice)?;
    let options = LocomoOptions {
        conversations: args.conversations,
        include_adversarial: args.include_adversarial,
        categories: args.categories,
        budgets: args.budgets,
        sample: args.sample,
        seed: args.seed,
        retrieval: fluxmem_connect::RetrievalConfig {
            judge_top: if judge.is_some() {
                retrieval.judge_top
            } else {
                0
            },
            ..retrieval
        },
        refine: super::loop_options(&args.refine, args.refine_budget),
        through_graph: args.through_graph,
    };
    let mut generator = super::reshape_generator(&args.refine, &device_choice)?;
    let bar = CountBar::new(settings.progress, "eval");
    let mut progress = |done: usize, total: usize| bar.set(done as u64, total as u64);
    let report = evaluate(
        &args.data,
        &options,
        &embedder,
        judge.as_mut().map(|j| j as &mut dyn fluxmem_models::Judge),
        generator
            .as_mut()
            .map(|g| g as &mut dyn fluxmem_models::Generator),
        &device,
        &mut progress,
    )
    .with_context(|| format!("evaluating {}", args.data.display()))?;
    bar.finish();
    print_table(&report, &options.budgets);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
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
    for system in SYSTEMS.into_iter().chain([SERVED]) {
        let Some(result) = report.systems.get(system) else {
            continue;
        };
        let rows = std::iter::once(("all".to_string(), &result.overall))
            .chain(result.by_category.iter().map(|(c, s)| (c.clone(), s)));
        for (category, summary) in rows {
            let mut line = format!("{system:<8} {category:<8}");
            let cell = |value: Option<&f64>| {
                value.map_or_else(|| format!(" {:>7}", "-"), |v| format!(" {v:>7.3}"))
            };
            for k in fluxmem_eval::metrics::KS {
                line.push_str(&cell(summary.recall_at_k.get(&format!("recall@{k}"))));
            }
            for budget in budgets {
                line.push_str(&cell(summary.recall_at_budget.get(&budget.to_string())));
            }
            line.push_str(&format!(
                " {:>7.0} {:>5}",
                summary.mean_context_tokens, summary.questions
            ));
            println!("{line}");
        }
    }
    if let Some(served) = &report.served {
        println!(
            "served (through the store a night built): connect connected {} episodes ({} edges), credit changed {} edges; {} questions answered, {} ranked otherwise than `fluxmem` (top 50); Stage II: {} edits committed, {} commits refused",
            served.connected,
            served.edges,
            served.credited,
            served.questions,
            served.rankings_differ,
            served.edits_committed,
            served.commits_refused
        );
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
        let mut first = refine.first_sufficiency.clone();
        first.sort_by(f32::total_cmp);
        if !first.is_empty() {
            let at = |q: f64| first[((first.len() - 1) as f64 * q).round() as usize];
            println!(
                "refine: first-context sufficiency (scored questions) min {:.3} q1 {:.3} median {:.3} q3 {:.3} max {:.3}",
                at(0.0),
                at(0.25),
                at(0.5),
                at(0.75),
                at(1.0)
            );
        }
        let curve: Vec<String> = refine
            .recall_by_round
            .iter()
            .enumerate()
            .map(|(t, r)| format!("{t}: {r:.3}"))
            .collect();
        println!(
            "refine: recall of the loop context after round t: {}",
            curve.join(", ")
        );
        for (kind, effect) in &refine.edit_effects {
            println!(
                "refine: {kind}: {} fired, context recall raised {} lowered {} unchanged {}, mean change {:+.4}",
                effect.fired,
                effect.raised,
                effect.lowered,
                effect.fired - effect.raised - effect.lowered,
                effect.recall_change / effect.fired.max(1) as f64,
            );
        }
    }
    if report.judge_calls > 0 {
        println!(
            "judge: {} calls, {} prompt tokens",
            report.judge_calls, report.judge_prompt_tokens
        );
    }
}

pub fn skills(args: EvalSkillsArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    use fluxmem_eval::skills::{evaluate, prepare, GeneratorResult};
    let device_choice: DeviceChoice = args.device.parse()?;
    let device = device_choice.device()?;
    let weights = super::weight_path(&args.weights)?;
    let clusters = super::clusters_flag(&args.clusters)?;
    // Every generator named must exist before anything runs.
    let manifest = fluxmem_models::ModelManifest::load()?;
    for name in args.generators.iter().filter(|g| g.as_str() != "none") {
        check_generator(&manifest, "--generators", name)?;
    }
    let options = fluxmem_consolidate::ConsolidateOptions {
        kmeans: fluxmem_consolidate::KMeansOptions {
            clusters,
            seed: args.seed,
            ..Default::default()
        },
        split_by_procedure: !args.no_procedure_split,
        merge_by_procedure: !args.no_procedure_merge,
        ..Default::default()
    };
    let embedder = fluxmem_models::load_embedder(&args.model, &device_choice)?;
    eprintln!(
        "eval skills: ingesting and embedding {}",
        args.data.display()
    );
    let split: fluxmem_eval::replay::Split = args
        .split
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--split: {e}"))?;
    let mut replayer = match &args.replay {
        None => None,
        Some(model) => {
            check_generator(&manifest, "--replay", model)?;
            Some(fluxmem_models::load_generator(
                model,
                &device_choice,
                weights,
            )?)
        }
    };
    let holdout = replayer.is_some().then_some((split, args.seed));
    let prepared = prepare(&args.data, &embedder, holdout)
        .with_context(|| format!("preparing {}", args.data.display()))?;
    let mut results: Vec<GeneratorResult> = Vec::new();
    for name in &args.generators {
        eprintln!(
            "eval skills: consolidating {} episodes with generator {name}",
            prepared.episodes
        );
        let mut generator = match name.as_str() {
            "none" => None,
            model => Some(fluxmem_models::load_generator(
                model,
                &device_choice,
                weights,
            )?),
        };
        let mut models = fluxmem_consolidate::Models {
            embedder: &embedder,
            generator: generator
                .as_mut()
                .map(|g| g as &mut dyn fluxmem_models::Generator),
            judge: None,
            replayer: None,
        };
        let mut bar = CountBar::new(settings.progress, "consolidate");
        let mut result = evaluate(&prepared, name, &mut models, &options, &device, &mut bar)?;
        bar.finish();
        if let Some(replayer) = replayer.as_mut() {
            eprintln!(
                "eval skills: replaying {} unseen episodes with {} ({} skills)",
                prepared.unseen.len(),
                fluxmem_models::Generator::model_id(replayer),
                result.records.len()
            );
            let options = fluxmem_eval::replay::ReplayOptions {
                split,
                sample: args.replay_sample,
                seed: args.seed,
                ..Default::default()
            };
            result.replay = Some(fluxmem_eval::replay::replay(
                &prepared.unseen,
                &result.records,
                &result.served,
                replayer,
                &options,
                &mut |condition, done, total| {
                    eprintln!("eval skills: replay {condition}: {done} of {total} prompts")
                },
            )?);
        }
        results.push(result);
    }
    print_skills_table(&prepared, &results, args.per_task);
    if let Some(path) = &args.json {
        let json = serde_json::json!({ "data": args.data, "benchmark": prepared.benchmark, "episodes": prepared.episodes, "results": results });
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `name` (given with `flag`) is a generator of the model manifest.
fn check_generator(
    manifest: &fluxmem_models::ModelManifest,
    flag: &str,
    name: &str,
) -> anyhow::Result<()> {
    let spec = manifest
        .get(name)
        .with_context(|| format!("{flag} {name}"))?;
    if spec.kind != "generator" {
        anyhow::bail!(
            "{flag} {name}: `{name}` is a {}, not a generator",
            spec.kind
        );
    }
    Ok(())
}

fn print_skills_table(
    prepared: &fluxmem_eval::skills::Prepared,
    results: &[fluxmem_eval::skills::GeneratorResult],
    per_task: bool,
) {
    println!(
        "{}: {} episodes ({:?})",
        prepared.data.display(),
        prepared.episodes,
        prepared.benchmark
    );
    let scores_header = match prepared.benchmark {
        fluxmem_eval::skills::Benchmark::TauBench => format!(
            "{:>8} {:>7} {:>6} {:>9}",
            "coverage", "recall", "order", "precision"
        ),
        fluxmem_eval::skills::Benchmark::Alfworld => format!(
            "{:>6} {:>6} {:>9} {:>8}",
            "purity", "NMI", "verb prec", "verb rec"
        ),
    };
    println!(
        "{:<36} {:>8} {:>6} {:>13} {:>9} {:>6} {:>7} {:>7} {}",
        "generator",
        "clusters",
        "skills",
        "model-worded",
        "no proc.",
        "calls",
        "tokens",
        "seconds",
        scores_header
    );
    for r in results {
        let scores = match (&r.tau, &r.alfworld) {
            (Some(t), _) => format!(
                "{:>8.2} {:>7.2} {:>6.2} {:>9.2}",
                t.coverage, t.recall, t.order, t.precision
            ),
            (_, Some(a)) => format!(
                "{:>6.3} {:>6.3} {:>9.2} {:>8.2}",
                a.purity, a.nmi, a.verb_precision, a.verb_recall
            ),
            _ => String::new(),
        };
        println!(
            "{:<36} {:>8} {:>6} {:>13} {:>9} {:>6} {:>7} {:>7.1} {scores}",
            r.generator,
            r.clusters,
            r.skills,
            r.model_worded,
            r.no_procedure,
            r.calls,
            r.prompt_tokens + r.generated_tokens,
            r.seconds
        );
    }
    if let Some(t) = results.first().and_then(|r| r.tau.as_ref()) {
        println!("tau-bench: {} tasks, recall and order over {} with gold actions, precision over {} with a successful run", t.tasks, t.with_gold, t.with_success);
    }
    for r in results {
        println!(
            "generator {}: {} skill names taken from a task, {} names shared within a tenant, {} skills with another's steps, {} consecutive duplicate steps, {} duplicate pitfalls",
            r.generator,
            r.lint.names_from_tasks,
            r.lint.shared_names,
            r.lint.shared_steps,
            r.lint.consecutive_duplicate_steps,
            r.lint.duplicate_pitfalls
        );
    }
    for r in results {
        let Some(replay) = &r.replay else { continue };
        println!(
            "replay with {} ({} split): {} unseen successful episodes ({} served a skill by query), {} of {} steps ({} served); {} prompts, {} prompt + {} generated tokens, {:.0} s; {} unreadable replies; messages instead of a call: {:?}",
            replay.model,
            match replay.split {
                Some(fluxmem_eval::replay::Split::Task) => "task",
                _ => "episode",
            },
            replay.episodes,
            replay.served_episodes,
            replay.steps,
            replay.steps_available,
            replay.served_steps,
            replay.prompts,
            replay.prompt_tokens,
            replay.generated_tokens,
            replay.seconds,
            replay.unreadable,
            replay.messages
        );
        println!(
            "  {:<28} {:>6} {:>16} {:>6} {:>16} {:>7}",
            format!("generator {}", r.generator),
            "tool",
            "tool 95% CI",
            "args",
            "args 95% CI",
            "values"
        );
        for (name, c) in &replay.conditions {
            println!(
                "  {:<28} {:>6.3} {:>16} {:>6.3} {:>16} {:>7.3}",
                name,
                c.tool_accuracy,
                format!("[{:.3}, {:.3}]", c.tool_ci95[0], c.tool_ci95[1]),
                c.args_accuracy,
                format!("[{:.3}, {:.3}]", c.ci95[0], c.ci95[1]),
                c.values_accuracy
            );
        }
        for s in &replay.per_skill {
            println!(
                "    skill {:<40} steps {:>3}  args without {:.2}  with {:.2}  skill only {:.2}",
                format!("{:?}", s.skill),
                s.steps,
                s.without,
                s.with,
                s.skill_only
            );
        }
    }
    if per_task {
        for r in results {
            let Some(t) = &r.tau else { continue };
            println!("generator {}:", r.generator);
            let cell = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
            for row in &t.per_task {
                println!(
                    "  task {:>3}  coverage {:.2}  recall {}  order {}  precision {}  {:?}  gold {:?}  skill {:?}",
                    row.task,
                    row.coverage,
                    cell(row.recall),
                    cell(row.order),
                    cell(row.precision),
                    row.skill,
                    row.gold,
                    row.named
                );
            }
        }
    }
}

/// `fluxmem eval outcomes`: the outcome rule against logged outcomes, one table per file.
pub fn outcomes(args: crate::cli::EvalOutcomesArgs) -> anyhow::Result<ExitCode> {
    let device: fluxmem_models::DeviceChoice = args.device.parse()?;
    let mut judge = super::ModelOutcomeJudge::from_flag(&args.judge, &device)?;
    let mut results = Vec::new();
    for data in &args.data {
        let judging = judge.as_mut().map(|judge| fluxmem_eval::outcomes::Judging {
            judge,
            sample: args.sample,
            seed: args.seed,
        });
        results.push(fluxmem_eval::outcomes::outcome_rule(data, judging)?);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
        return Ok(ExitCode::SUCCESS);
    }
    for result in &results {
        println!(
            "{}: {} episodes with a logged outcome; the rule decides {:.0}% of them, {:.0}% of its decisions right",
            result.file,
            result.episodes,
            result.coverage() * 100.0,
            result.precision_of_decided() * 100.0
        );
        println!("  rule says    logged success  logged failure");
        for answer in ["success", "failure", "unknown"] {
            let [s, f] = result.table.get(answer).copied().unwrap_or_default();
            println!("  {answer:<12} {s:>14}  {f:>14}");
        }
        println!("  by the part of the rule that decided:");
        for (rule, [s, f]) in &result.by_rule {
            println!("    {rule:<48} {s:>4} success  {f:>4} failure");
        }
        if let Some(judged) = &result.judge {
            println!(
                "  the judge {} on {} of them (seeded sample), {:.0} s, {} characters a run on average:",
                judged.model, judged.episodes, judged.seconds, judged.mean_chars
            );
            println!("  answer       judge: logged success  logged failure | rule: logged success  logged failure");
            for answer in ["success", "failure", "unknown", "error"] {
                let [js, jf] = judged.table.get(answer).copied().unwrap_or_default();
                let [rs, rf] = judged.rule.get(answer).copied().unwrap_or_default();
                println!("  {answer:<12} {js:>21}  {jf:>14} | {rs:>20}  {rf:>14}");
            }
            match judged.auc() {
                Some(auc) => println!(
                    "  the judge's probabilities order success above failure with AUC {auc:.3}"
                ),
                None => {
                    println!("  AUC: none (the judge answered for runs of only one logged outcome)")
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
