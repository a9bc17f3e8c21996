//! `fluxmem run PIPELINE.toml`: the nightly job, and the shard/merge contract a distributed
//! engine drives.

use anyhow::{bail, Context};
use fluxmem_embed::plan::{Plan, PlanModel};
use fluxmem_graph::Graph;
use fluxmem_models::{DeviceChoice, Embedder, Generator, Judge};
use fluxmem_report::{
    PemsSummary, QuarantineSample, QuarantineSummary, RunRecord, SkillSummary, StageRecord,
    UsageRecord,
};
use fluxmem_store::{CommitInfo, Shard, Store, Writer};
use serde_json::{json, Value};
use sha2::Digest;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use crate::cli::{RunArgs, Settings};
use crate::pipeline::{self, Input, Loaded, MAP_STAGES, STAGES};
use crate::progress::{CountBar, IngestBar};

pub fn run(args: RunArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let loaded = pipeline::load(&args.pipeline)?;
    let shard = check_stage_flags(&args)?;
    let store_dir = loaded
        .pipeline
        .store
        .as_ref()
        .map(|s| loaded.resolve(s))
        .unwrap_or_else(|| settings.store.clone());
    // Inputs are resolved before any work, so a missing input stops the run up front.
    let groups = resolve_inputs(&loaded)?;
    let run_id = run_id_of(&args, &loaded, &groups)?;
    check_outputs(&loaded, &args, &run_id, shard.is_some())?;
    let mut ctx = Ctx {
        loaded: &loaded,
        settings,
        run_id: run_id.clone(),
        device_choice: loaded.pipeline.models.device.parse()?,
        embedder: None,
        usage: BTreeMap::new(),
        pems: None,
        quarantine_files: Vec::new(),
        outputs: Vec::new(),
        quarantined: 0,
    };
    if let Some(count) = args.merge {
        return merge_shards(&loaded, &args, settings, &store_dir, &run_id, count);
    }
    if args.plan && args.stage.as_deref() == Some(fluxmem_embed::STAGE) {
        return plan_embed(&mut ctx, &store_dir);
    }
    if args.plan && args.stage.as_deref() == Some(fluxmem_connect::STAGE) {
        return plan_connect(&mut ctx, &store_dir);
    }
    if args.plan {
        return plan_shards(&ctx, &store_dir);
    }
    if let Some(shard) = shard {
        return run_shard(&mut ctx, &args, &store_dir, &groups, shard);
    }
    let stages: Vec<&str> = match args.stage.as_deref() {
        Some(stage) => vec![stage],
        None => STAGES.to_vec(),
    };
    let started_at = now();
    let mut writer = open_main(&store_dir, settings)?;
    let mut record = new_record(&loaded, &run_id, &store_dir, &writer, &stages, started_at)?;
    let failure = run_stages(&mut ctx, &mut writer, &groups, &stages, &mut record)?;
    if failure.is_none() && args.stage.is_none() && loaded.pipeline.compact.enabled {
        record.compaction = Some(compact(&mut writer, &loaded, &run_id)?);
    }
    if failure.is_none() && args.stage.is_none() {
        // Derived data: an index that cannot be made leaves queries on the shards, not the
        // night undone.
        record.indexes = match index(&mut writer, &run_id) {
            Ok(updates) => updates,
            Err(error) => {
                eprintln!("warning: {error:#}; queries read the shards until `fluxmem store index` succeeds");
                Some(json!({ "error": format!("{error:#}") }))
            }
        };
    }
    record.manifest_version_after = writer.manifest().version;
    drop(writer);
    let record = finish_record(&mut ctx, record, &args, failure.as_ref())?;
    if let Some(error) = failure {
        return Err(error);
    }
    Ok(if record.status == DEGRADED {
        ExitCode::from(crate::EXIT_DEGRADED)
    } else if record.quarantine.records > 0 {
        ExitCode::from(crate::EXIT_QUARANTINED)
    } else {
        ExitCode::SUCCESS
    })
}

/// Checks `--stage`, `--shard` and `--merge` together; the shard, if any.
fn check_stage_flags(args: &RunArgs) -> anyhow::Result<Option<Shard>> {
    if let Some(stage) = &args.stage {
        if !STAGES.contains(&stage.as_str()) {
            bail!("--stage `{stage}`: expected one of {}", STAGES.join(", "));
        }
    }
    let shard: Option<Shard> = args.shard.as_deref().map(str::parse).transpose()?;
    if shard.is_some() || args.merge.is_some() {
        match args.stage.as_deref() {
            Some(stage) if MAP_STAGES.contains(&stage) => {}
            Some(stage) => bail!(
                "--shard and --merge apply to the map stages ({}), not `{stage}`, which runs once",
                MAP_STAGES.join(", ")
            ),
            None => bail!(
                "--shard and --merge need --stage (one of {})",
                MAP_STAGES.join(", ")
            ),
        }
        if shard.is_some() && args.merge.is_some() {
            bail!("--shard and --merge are separate steps: run every shard, then merge once");
        }
    }
    if args.plan {
        let planned = [
            fluxmem_embed::STAGE,
            fluxmem_connect::STAGE,
            fluxmem_consolidate::STAGE,
        ];
        if !args.stage.as_deref().is_some_and(|s| planned.contains(&s)) {
            bail!(
                "--plan plans the shards of a sharded embed (the texts to embed), connect (its \
                 ground queries to embed) or consolidate (the clusters): it needs --stage embed, \
                 connect or consolidate"
            );
        }
        if shard.is_some() || args.merge.is_some() {
            bail!("--plan is the step before the shards: run it once, then every --shard, then --merge");
        }
    }
    // Run ids name a directory under `report.dir` and quarantine files: never a path.
    if let Some(id) = &args.run_id {
        pipeline::check_run_id(id).map_err(|e| anyhow::anyhow!("--run-id {e}"))?;
    }
    Ok(shard)
}

/// Each input's files; a required pattern that matches nothing stops the run, an optional one
/// is a warning.
fn resolve_inputs(loaded: &Loaded) -> anyhow::Result<Vec<(&Input, Vec<PathBuf>)>> {
    let mut groups: Vec<(&Input, Vec<PathBuf>)> = Vec::new();
    let mut warnings = Vec::new();
    for (i, input) in loaded.pipeline.inputs.iter().enumerate() {
        let (files, unmatched) = pipeline::expand(loaded, input)?;
        for pattern in unmatched {
            if input.required {
                bail!("{}: key `inputs[{i}].paths`: `{pattern}` matches no file (set `required = false` to allow)", loaded.path.display());
            }
            warnings.push(format!("inputs[{i}]: `{pattern}` matches no file"));
        }
        groups.push((input, files));
    }
    for warning in &warnings {
        eprintln!("warning: {warning}");
    }
    Ok(groups)
}

/// `--run-id`, or the default one of the pipeline and its inputs.
fn run_id_of(
    args: &RunArgs,
    loaded: &Loaded,
    groups: &[(&Input, Vec<PathBuf>)],
) -> anyhow::Result<String> {
    if let Some(id) = &args.run_id {
        return Ok(id.clone());
    }
    let id = default_run_id(loaded, groups);
    pipeline::check_run_id(&id).map_err(|e| {
        anyhow::anyhow!(
            "{}: key `name`: the default run id {e}",
            loaded.path.display()
        )
    })?;
    Ok(id)
}

/// `--merge N`: commits the N staging stores of `--stage` to the main store.
fn merge_shards(
    loaded: &Loaded,
    args: &RunArgs,
    settings: &Settings,
    store_dir: &Path,
    run_id: &str,
    count: usize,
) -> anyhow::Result<ExitCode> {
    let stage = args.stage.as_deref().expect("checked above");
    if stage == fluxmem_embed::STAGE {
        if let Some(plan) = Plan::open(store_dir, run_id)? {
            return commit_embed(loaded, settings, store_dir, run_id, plan);
        }
    }
    if stage == fluxmem_connect::STAGE {
        if let Some(plan) = Plan::open_for(store_dir, stage, run_id)? {
            return commit_connect(loaded, settings, store_dir, run_id, plan);
        }
    }
    let mut writer = open_main(store_dir, settings)?;
    let started = Instant::now();
    let mut info = CommitInfo {
        stage: format!("merge-{stage}"),
        run_id: format!("{stage}@{run_id}"),
        ..Default::default()
    };
    // What a stage records once all its shards are in (connect: the grown episodes handled),
    // from the version the shards started from (the merge checks it is still the store's).
    if stage == fluxmem_connect::STAGE {
        let (key, value) =
            fluxmem_connect::merged_progress(writer.store(), &writer.manifest().clone())?;
        info.progress.insert(key, value);
        // The retrieval the shards grounded with, as they recorded it (none when no shard
        // committed: the store's record stands).
        if let Some(config) = fluxmem_connect::staged_retrieval(writer.store(), count)? {
            let (key, value) = fluxmem_connect::retrieval_progress(&config);
            info.progress.insert(key, value);
        }
    }
    // Consolidate's shards that planned once: each must have followed the plan.
    if stage == fluxmem_consolidate::STAGE {
        let planned =
            fluxmem_consolidate::shared_plan_merge(&writer, &format!("{stage}@{run_id}"), count)?;
        info.progress.extend(planned);
    }
    let report = writer
        .merge_staging(stage, count, info)
        .with_context(|| format!("merging the {count} shards of `{stage}`"))?;
    if stage == fluxmem_consolidate::STAGE {
        fluxmem_consolidate::sweep_shared_plans(&writer)?;
    }
    mark_done(&mut writer, stage, run_id, &json!({ "shards": count }))?;
    let record = StageRecord {
        name: stage.into(),
        status: if report.committed {
            "merged".into()
        } else {
            "merged earlier (cleanup only)".into()
        },
        seconds: started.elapsed().as_secs_f64(),
        counts_out: counts(&[
            ("shards", count),
            ("nodes", report.nodes),
            ("edges", report.edges),
            ("embeddings", report.embeddings),
            ("edits", report.edits),
        ]),
        details: serde_json::to_value(&report)?,
        ..Default::default()
    };
    add_stage_to_report(loaded, run_id, store_dir, &record)?;
    println!("{}", serde_json::to_string(&record)?);
    Ok(ExitCode::SUCCESS)
}

/// `--shard I/N`: runs `--stage` for shard I of N into its staging store.
fn run_shard(
    ctx: &mut Ctx<'_>,
    args: &RunArgs,
    store_dir: &Path,
    groups: &[(&Input, Vec<PathBuf>)],
    shard: Shard,
) -> anyhow::Result<ExitCode> {
    let stage = args.stage.as_deref().expect("checked above");
    if [fluxmem_embed::STAGE, fluxmem_connect::STAGE].contains(&stage) {
        if let Some(plan) = Plan::open_for(store_dir, stage, &ctx.run_id)? {
            return execute_embed(ctx, &plan, shard);
        }
    }
    let mut writer = Writer::open_staging(store_dir, stage, shard)?;
    eprintln!(
        "fluxmem run: {stage}, shard {shard}, staging store {}",
        writer.store().dir().display()
    );
    let record = ctx.stage(stage, &mut writer, groups, shard)?;
    // A consolidate shard that followed the run's shared plan says so; the merge checks.
    let note = match record.details.get("shared_plan") {
        Some(Value::String(sha256)) => json!({ "shared_plan": sha256 }),
        _ => Value::Null,
    };
    writer.finish_staging_with(&format!("{stage}@{}", ctx.run_id), note)?;
    println!("{}", serde_json::to_string(&record)?);
    Ok(if record.status.starts_with(DEGRADED) {
        ExitCode::from(crate::EXIT_DEGRADED)
    } else if ctx.quarantined > 0 {
        ExitCode::from(crate::EXIT_QUARANTINED)
    } else {
        ExitCode::SUCCESS
    })
}

/// `--stage embed --plan`: plans the texts the run's embed shards give the model, in the
/// store's `scratch/embed/<run id>/` ([`fluxmem_embed::plan`]). The shards then execute the
/// plan's buckets they own and the merge commits their vectors.
fn plan_embed(ctx: &mut Ctx<'_>, store_dir: &Path) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let options = embed_options(ctx.loaded, Shard::ALL);
    let run_id = ctx.run_id.clone();
    let writer = open_main(store_dir, ctx.settings)?;
    let models = &ctx.loaded.pipeline.models;
    let (name, device) = (models.embedder.clone(), models.device.clone());
    let model = PlanModel::of(&name, &device, ctx.embedder()?);
    let plan = fluxmem_embed::plan::plan(&writer, &model, &options, &run_id)
        .context("planning the embed shards")?;
    print_planned(&plan, started, ["nodes", "nodes to embed", "lacking"])
}

/// Prints the record of a plan of texts for the model: its header, where it is (the folder the
/// workers read and write), and its counts named by `[what the stage looked at, the line's
/// words for what it works on, the record's name for them]`.
fn print_planned(
    plan: &Plan,
    started: Instant,
    [seen, line, worked]: [&str; 3],
) -> anyhow::Result<ExitCode> {
    let header = plan.header();
    eprintln!(
        "  {} of {} {line}, {} texts for the model in {} buckets: {}",
        header.lacking,
        header.nodes,
        header.items,
        header.buckets,
        plan.dir().display()
    );
    let swept = plan.swept();
    for removed in &swept.removed {
        eprintln!(
            "  removed a plan no commit can take (its store moved since, by another commit): {}",
            removed.display()
        );
    }
    for (dir, error) in &swept.failed {
        eprintln!(
            "warning: could not remove the stale plan {}: {error}; remove it by hand",
            dir.display()
        );
    }
    let mut details = serde_json::to_value(header)?;
    details["dir"] = plan.dir().display().to_string().into();
    details["swept"] = swept
        .removed
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let record = StageRecord {
        name: header.stage.clone(),
        status: "planned".into(),
        seconds: started.elapsed().as_secs_f64(),
        counts_in: counts(&[(seen, header.nodes)]),
        counts_out: counts(&[(worked, header.lacking), ("items", header.items)]),
        details,
    };
    println!("{}", serde_json::to_string(&record)?);
    Ok(ExitCode::SUCCESS)
}

/// The end of a plan's commit: the stage marked done for the run, the plan removed (it is
/// garbage once committed and marked; a failed removal is a warning), the record added to the
/// run's report and printed.
fn committed(
    writer: &mut Writer,
    (loaded, store_dir, run_id): (&Loaded, &Path, &str),
    plan: Plan,
    record: StageRecord,
) -> anyhow::Result<ExitCode> {
    let digest = json!({ "plan": plan.header().digest });
    mark_done_with(writer, (&record.name, run_id), &digest, digest.clone())?;
    if let Err(error) = plan.remove() {
        eprintln!(
            "warning: {error}; remove the {} plan's folder by hand",
            record.name
        );
    }
    add_stage_to_report(loaded, run_id, store_dir, &record)?;
    println!("{}", serde_json::to_string(&record)?);
    Ok(ExitCode::SUCCESS)
}

/// `--stage embed|connect --shard I/N` when the run has a plan of the stage's texts: embeds the
/// texts of the plan's buckets `b` with `b mod N = I`, into result files of the plan (no
/// staging store, no lock).
fn execute_embed(ctx: &mut Ctx<'_>, plan: &Plan, shard: Shard) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let stage = plan.header().stage.clone();
    let batch_size = ctx.loaded.pipeline.embed.batch_size;
    let mut bar = CountBar::new(ctx.settings.progress, &stage);
    let embedder = ctx.embedder()?;
    let owns = |bucket: u32| bucket as usize % shard.count == shard.index;
    let worker = format!("shard-{}-of-{}", shard.index, shard.count);
    let report = plan
        .execute_buckets(embedder, &owns, batch_size, &worker, &mut bar)
        .with_context(|| format!("executing shard {shard} of the {stage} plan"))?;
    bar.finish();
    eprintln!(
        "fluxmem run: {stage}, shard {shard}: {} texts of {} buckets embedded for plan {}",
        report.items,
        report.buckets,
        &plan.header().digest[..16]
    );
    let record = StageRecord {
        name: stage,
        status: "executed".into(),
        seconds: started.elapsed().as_secs_f64(),
        counts_out: counts(&[
            ("items", report.items),
            ("buckets", report.buckets),
            ("files", report.files),
        ]),
        details: json!({ "plan": plan.header().digest, "report": report }),
        ..Default::default()
    };
    println!("{}", serde_json::to_string(&record)?);
    Ok(ExitCode::SUCCESS)
}

/// `--stage embed --merge N` when the run has a plan: checks every result against the plan and
/// commits the vectors (the shards an in-process embed writes), then removes the plan.
fn commit_embed(
    loaded: &Loaded,
    settings: &Settings,
    store_dir: &Path,
    run_id: &str,
    plan: Plan,
) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let stage = fluxmem_embed::STAGE;
    let mut writer = open_main(store_dir, settings)?;
    let vectors = plan.results().context("reading the embed plan's results")?;
    let options = embed_options(loaded, Shard::ALL);
    let mut bar = CountBar::new(settings.progress, "embed commit");
    let report = plan
        .commit(&mut writer, &vectors, &options, &mut bar)
        .context("committing the embed plan")?;
    bar.finish();
    let digest = plan.header().digest.clone();
    eprintln!(
        "  {} nodes: {} embedded, {} from the cache, {} already had a vector (plan {})",
        report.nodes,
        report.embedded,
        report.cached,
        report.already,
        &digest[..16]
    );
    let record = StageRecord {
        name: stage.into(),
        status: "merged".into(),
        seconds: started.elapsed().as_secs_f64(),
        counts_in: counts(&[("nodes", report.nodes), ("already", report.already)]),
        counts_out: counts(&[
            ("embedded", report.embedded),
            ("cached", report.cached),
            ("commits", report.commits),
        ]),
        details: json!({ "plan": digest, "report": report }),
    };
    committed(&mut writer, (loaded, store_dir, run_id), plan, record)
}

/// `--stage connect --plan`: plans the texts connect gives the model (the dense form of the
/// ground queries of the episodes it would connect), in the store's
/// `scratch/embed/connect@<run id>/` ([`fluxmem_connect::planned_queries`],
/// [`fluxmem_embed::plan::plan_texts`]). The shards then embed the plan's buckets they own and
/// the merge connects with their vectors.
fn plan_connect(ctx: &mut Ctx<'_>, store_dir: &Path) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let stage = fluxmem_connect::STAGE;
    let c = ctx.loaded.pipeline.connect.clone();
    if !c.enabled {
        // Nothing to plan: the shards find no plan and skip the stage as well.
        let record = disabled();
        println!("{}", serde_json::to_string(&record)?);
        return Ok(ExitCode::SUCCESS);
    }
    let options = connect_options(&c, Shard::ALL);
    let run_id = ctx.run_id.clone();
    let device = ctx.device_choice.device()?;
    let writer = open_main(store_dir, ctx.settings)?;
    let models = &ctx.loaded.pipeline.models;
    let (name, device_name) = (models.embedder.clone(), models.device.clone());
    let model = PlanModel::of(&name, &device_name, ctx.embedder()?);
    let planned =
        fluxmem_connect::planned_queries(&writer, (&model.id, model.dim), &options, &device)
            .context("planning connect's ground queries")?;
    let texts: BTreeMap<String, String> = (planned.texts.into_iter())
        .map(|text| (fluxmem_graph::sha256_hex(text.as_bytes()), text))
        .collect();
    let what = fluxmem_embed::plan::Planned {
        stage,
        run_id: &run_id,
        version: writer.manifest().version,
        nodes: planned.episodes,
        lacking: planned.todo,
        settings: connect_settings(&options),
    };
    let plan = fluxmem_embed::plan::plan_texts(&writer, &what, &model, &texts)
        .context("writing the connect plan")?;
    print_planned(&plan, started, ["episodes", "episodes to connect", "todo"])
}

/// `--stage connect --merge N` when the run has a connect plan: checks every result against
/// the plan, then runs connect with the results in the model's place (the edges and shards an
/// in-process connect writes), then removes the plan.
fn commit_connect(
    loaded: &Loaded,
    settings: &Settings,
    store_dir: &Path,
    run_id: &str,
    plan: Plan,
) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let stage = fluxmem_connect::STAGE;
    if !loaded.pipeline.connect.enabled {
        bail!("--stage connect --merge: the pipeline's connect stage is disabled");
    }
    let mut writer = open_main(store_dir, settings)?;
    plan.check_unmoved(writer.manifest())
        .context("committing the connect plan")?;
    let digest = plan.header().digest.clone();
    let options = fluxmem_connect::ConnectOptions {
        plan: Some(digest.clone()),
        ..connect_options(&loaded.pipeline.connect, Shard::ALL)
    };
    if plan.header().settings != connect_settings(&options) {
        bail!(
            "{}: the plan was made with connect settings {} and the pipeline now has {}: its \
             queries may not be the ones connect asks for; plan again",
            plan.dir().display(),
            plan.header().settings,
            connect_settings(&options)
        );
    }
    let vectors = plan
        .results()
        .context("reading the connect plan's results")?;
    let device: DeviceChoice = loaded.pipeline.models.device.parse()?;
    let mut bar = CountBar::new(settings.progress, "connect commit");
    let report = fluxmem_connect::connect_store(
        &mut writer,
        &vectors,
        &options,
        &format!("{stage}@{run_id}"),
        &device.device()?,
        &mut bar,
    )
    .context("committing the connect plan")?;
    bar.finish();
    eprintln!(
        "  {} episodes: {} connected now; {} ground and {} link edges (plan {})",
        report.episodes,
        report.connected,
        report.ground_edges,
        report.link_edges,
        &digest[..16]
    );
    let record = StageRecord {
        name: stage.into(),
        status: "merged".into(),
        seconds: started.elapsed().as_secs_f64(),
        counts_in: counts(&[("episodes", report.episodes), ("already", report.already)]),
        counts_out: counts(&[
            ("connected", report.connected),
            ("ground_edges", report.ground_edges),
            ("link_edges", report.link_edges),
            ("commits", report.commits),
        ]),
        details: json!({ "plan": digest, "report": report }),
    };
    committed(&mut writer, (loaded, store_dir, run_id), plan, record)
}

/// What connect's planned texts depend on: one query per step or per task, and the retrieval
/// (its entity setting takes the speakers' names out of the dense queries).
fn connect_settings(options: &fluxmem_connect::ConnectOptions) -> Value {
    json!({ "per_step": options.per_step, "retrieval": options.retrieval })
}

/// How the pipeline connects (`shard`: the episodes a run owns).
fn connect_options(c: &pipeline::Connect, shard: Shard) -> fluxmem_connect::ConnectOptions {
    fluxmem_connect::ConnectOptions {
        per_step: c.per_step,
        ground_k: c.ground_k,
        link_k: c.link_k,
        commit_every: c.commit_every,
        shard,
        memory: c.memory_mb.saturating_mul(1 << 20),
        ..Default::default()
    }
}

/// How the pipeline embeds (`shard`: the nodes a run owns).
fn embed_options(loaded: &Loaded, shard: Shard) -> fluxmem_embed::EmbedOptions {
    fluxmem_embed::EmbedOptions {
        batch_size: 256,
        commit_every: loaded.pipeline.embed.commit_every,
        shard,
        window: loaded.pipeline.embed.window,
        ..Default::default()
    }
}

/// `--stage consolidate --plan`: plans the clusters of the run's consolidate shards once, in
/// the main store ([`fluxmem_consolidate::plan_shared`]).
fn plan_shards(ctx: &Ctx<'_>, store_dir: &Path) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    if !ctx.loaded.pipeline.consolidate.enabled {
        // The shards will skip the stage too: nothing to plan, and nothing for the merge to check.
        let record = StageRecord {
            name: fluxmem_consolidate::STAGE.into(),
            ..disabled()
        };
        println!("{}", serde_json::to_string(&record)?);
        return Ok(ExitCode::SUCCESS);
    }
    let options = ctx.consolidate_options(Shard::ALL)?;
    let model = model_id(&ctx.loaded.pipeline.models.embedder);
    let device = ctx.device_choice.device()?;
    let mut writer = open_main(store_dir, ctx.settings)?;
    let report = fluxmem_consolidate::plan_shared(
        &mut writer,
        &model,
        &options,
        &format!("{}@{}", fluxmem_consolidate::STAGE, ctx.run_id),
        &device,
    )
    .with_context(|| format!("planning the clusters of `{}`", fluxmem_consolidate::STAGE))?;
    eprintln!(
        "  {} episodes in {} clusters planned for the shards{}",
        report.episodes,
        report.clusters,
        if report.reused {
            " (planned earlier)"
        } else {
            ""
        }
    );
    let record = StageRecord {
        name: fluxmem_consolidate::STAGE.into(),
        status: "planned".into(),
        seconds: started.elapsed().as_secs_f64(),
        counts_out: counts(&[("clusters", report.clusters), ("episodes", report.episodes)]),
        details: serde_json::to_value(&report)?,
        ..Default::default()
    };
    println!("{}", serde_json::to_string(&record)?);
    Ok(ExitCode::SUCCESS)
}

/// The run's record before its stages: where, when, and the models the stages will use.
fn new_record(
    loaded: &Loaded,
    run_id: &str,
    store_dir: &Path,
    writer: &Writer,
    stages: &[&str],
    started_at: String,
) -> anyhow::Result<RunRecord> {
    let p = &loaded.pipeline;
    let mut record = RunRecord {
        pipeline: loaded.path.display().to_string(),
        run_id: run_id.to_string(),
        started_at,
        store: store_dir.display().to_string(),
        manifest_version_before: writer.manifest().version,
        ..Default::default()
    };
    record
        .models
        .insert("embedder".into(), model_id(&p.models.embedder));
    if p.consolidate.enabled && stages.contains(&"consolidate") {
        record
            .models
            .insert("generator".into(), model_id(&p.models.generator));
        if let Some(judge) = fluxmem_models::judge_model(&p.models.judge)? {
            record.models.insert("judge".into(), model_id(&judge));
        }
        if let Some(replayer) = fluxmem_models::eta_model(&p.consolidate.eta)? {
            record.models.insert("eta".into(), model_id(&replayer));
        }
    }
    Ok(record)
}

/// Runs `stages` in order on the main store, skipping those this run id finished before
/// (resume). A stage's failure stops the run: it is returned, with its record kept.
fn run_stages(
    ctx: &mut Ctx<'_>,
    writer: &mut Writer,
    groups: &[(&Input, Vec<PathBuf>)],
    stages: &[&str],
    record: &mut RunRecord,
) -> anyhow::Result<Option<anyhow::Error>> {
    let run_id = ctx.run_id.clone();
    for (i, stage) in stages.iter().enumerate() {
        eprintln!("fluxmem run: [{}/{}] {stage}", i + 1, stages.len());
        let done = writer
            .manifest()
            .progress
            .get(&format!("pipeline.{stage}"))
            .and_then(|m| m.get("run_id"))
            .and_then(Value::as_str)
            == Some(run_id.as_str());
        if done {
            eprintln!("  already done for this run id ({run_id}); skipped");
            record.stages.push(StageRecord {
                name: stage.to_string(),
                status: "done earlier in this run (resumed)".into(),
                ..Default::default()
            });
            continue;
        }
        match ctx.stage(stage, writer, groups, Shard::ALL) {
            Ok(stage_record) => {
                mark_done(writer, stage, &run_id, &json!(stage_record.counts_out))?;
                record.stages.push(stage_record);
            }
            Err(error) => {
                record.stages.push(StageRecord {
                    name: stage.to_string(),
                    status: format!("failed: {error:#}"),
                    ..Default::default()
                });
                return Ok(Some(error.context(format!("stage `{stage}`"))));
            }
        }
    }
    Ok(None)
}

/// Compacts the store after the night's stages; the compaction report.
fn compact(writer: &mut Writer, loaded: &Loaded, run_id: &str) -> anyhow::Result<Value> {
    eprintln!("fluxmem run: compacting the store");
    let started = std::time::Instant::now();
    let report = writer
        .compact(&loaded.pipeline.compact.policy(), run_id)
        .context("compacting the store after the stages")?;
    eprintln!(
        "  {} ({:.1}s)",
        compaction_line(&report),
        started.elapsed().as_secs_f64()
    );
    Ok(serde_json::to_value(&report)?)
}

/// Brings every tenant's vector index up to date after the night's stages (and its
/// compaction, which keeps an index current); what was done per tenant, `None` when the store
/// has no embedding yet.
fn index(writer: &mut Writer, run_id: &str) -> anyhow::Result<Option<Value>> {
    eprintln!("fluxmem run: indexing the tenants");
    let started = std::time::Instant::now();
    let updates = super::store::index_tenants(writer, None, false, run_id, &mut |update| {
        eprintln!("  {}", super::store::index_line(update));
    })
    .context("indexing the tenants after the stages")?;
    eprintln!("  ({:.1}s)", started.elapsed().as_secs_f64());
    Ok(updates.map(serde_json::to_value).transpose()?)
}

/// Completes the run's record (usage, PEMS, quarantine, outputs; the earlier stage records
/// of the run id), settles its status, and writes and prints it, redacted.
fn finish_record(
    ctx: &mut Ctx<'_>,
    mut record: RunRecord,
    args: &RunArgs,
    failure: Option<&anyhow::Error>,
) -> anyhow::Result<RunRecord> {
    let loaded = ctx.loaded;
    let p = &loaded.pipeline;
    record.model_usage = ctx.usage.clone();
    record.pems = ctx.pems.take();
    record.quarantine = quarantine_summary(&ctx.quarantine_files)?;
    record.outputs = ctx.outputs.clone();
    record.finished_at = now();
    let report_dir = loaded.resolve(&p.report.dir).join(&ctx.run_id);
    accumulate(
        &mut record,
        &report_dir.join(fluxmem_report::RUN_JSON),
        args.stage.is_some(),
    );
    // After `accumulate`: a resumed run (or one stage of a distributed run) is judged on every
    // stage record of the run id, not only on the stages this call ran.
    settle(&mut record, failure);
    for file in [fluxmem_report::RUN_JSON, fluxmem_report::REPORT_HTML] {
        let path = report_dir.join(file).display().to_string();
        if !record.outputs.contains(&path) {
            record.outputs.push(path);
        }
    }
    let record = redacted(record, &p.redact)?;
    let (json_path, html_path) = fluxmem_report::write_report(&report_dir, &record)?;
    if args.json {
        println!("{}", serde_json::to_string(&record)?);
    } else {
        print_summary(&record);
        println!(
            "run report: {} ({})",
            html_path.display(),
            json_path.display()
        );
    }
    Ok(record)
}

/// Checks the output targets of this call before any work (before the store is opened or
/// created), so that a report or export directory that cannot be written is not found only
/// after the stages ran: `<report.dir>/<run id>` (written by every call but a shard's) and,
/// when the export stage runs, `export.out`. Errors name the file, the key and the path.
fn check_outputs(loaded: &Loaded, args: &RunArgs, run_id: &str, shard: bool) -> anyhow::Result<()> {
    let p = &loaded.pipeline;
    let fail = |key: &str, error: String| {
        anyhow::anyhow!("{}: key `{key}`: {error}", loaded.path.display())
    };
    if !shard {
        pipeline::check_output_dir(&loaded.resolve(&p.report.dir).join(run_id))
            .map_err(|e| fail("report.dir", e))?;
    }
    let exports = p.export.enabled
        && !shard
        && args.merge.is_none()
        && args.stage.as_deref().is_none_or(|stage| stage == "export");
    if exports {
        pipeline::check_export_out(&loaded.resolve(&p.export.out))
            .map_err(|e| fail("export.out", e))?;
    }
    Ok(())
}

/// The status word of a run (and the prefix of a stage status) when a stage that was meant to
/// produce something produced nothing.
const DEGRADED: &str = "degraded";
/// The status word of a run (and the prefix of a stage status) when a stage produced only part
/// of what it was meant to, or records were quarantined.
const PARTIAL: &str = "partial";

/// Sets the run's `status` and `reasons` from its stage records, its quarantine and the error
/// that stopped it, if any:
/// - a stage status `degraded: <detail>` gives the reason `<stage>: <detail>` and makes the run
///   `degraded`; `partial: <detail>` gives the same kind of reason and makes it `partial`;
/// - quarantined records give the reason `ingest: N records quarantined` (unless ingest is
///   already degraded for it: every record read was quarantined) and make the run `partial`;
/// - precedence: `failed: <error>` over `degraded` over `partial` over `ok`. The reasons are
///   kept with a failure too (what had gone wrong before the run stopped).
fn settle(record: &mut RunRecord, failure: Option<&anyhow::Error>) {
    let mut reasons = Vec::new();
    let (mut degraded, mut partial, mut ingest_degraded) = (false, false, false);
    for stage in &record.stages {
        if let Some(detail) = stage_detail(&stage.status, DEGRADED) {
            degraded = true;
            ingest_degraded |= stage.name == "ingest";
            reasons.push(format!("{}: {detail}", stage.name));
        } else if let Some(detail) = stage_detail(&stage.status, PARTIAL) {
            partial = true;
            reasons.push(format!("{}: {detail}", stage.name));
        }
    }
    let quarantined = record.quarantine.records;
    if quarantined > 0 {
        partial = true;
        if !ingest_degraded {
            reasons.push(format!(
                "ingest: {quarantined} record{} quarantined",
                if quarantined == 1 { "" } else { "s" }
            ));
        }
    }
    record.status = match failure {
        Some(error) => format!("failed: {error:#}"),
        None if degraded => DEGRADED.into(),
        None if partial => PARTIAL.into(),
        None => "ok".into(),
    };
    record.reasons = reasons;
}

/// `<word>: <detail>` -> `<detail>` (a bare `<word>` -> the word itself); `None` for other
/// statuses.
fn stage_detail<'s>(status: &'s str, word: &'s str) -> Option<&'s str> {
    let rest = status.strip_prefix(word)?;
    if rest.is_empty() {
        Some(word)
    } else {
        rest.strip_prefix(':').map(str::trim)
    }
}

struct Ctx<'a> {
    loaded: &'a Loaded,
    settings: &'a Settings,
    run_id: String,
    device_choice: DeviceChoice,
    embedder: Option<Box<dyn Embedder>>,
    usage: BTreeMap<String, UsageRecord>,
    pems: Option<PemsSummary>,
    quarantine_files: Vec<PathBuf>,
    outputs: Vec<String>,
    quarantined: u64,
}

impl Ctx<'_> {
    fn embedder(&mut self) -> anyhow::Result<&dyn Embedder> {
        if self.embedder.is_none() {
            let p = &self.loaded.pipeline;
            if super::hash_dim(&p.models.embedder).is_none() {
                ensure_model(&p.models.embedder)?;
            }
            self.embedder = Some(super::embedder(
                &p.models.embedder,
                &self.device_choice,
                Some(p.embed.batch_size),
            )?);
        }
        Ok(self.embedder.as_deref().expect("just loaded"))
    }

    fn stage(
        &mut self,
        stage: &str,
        writer: &mut Writer,
        groups: &[(&Input, Vec<PathBuf>)],
        shard: Shard,
    ) -> anyhow::Result<StageRecord> {
        let started = Instant::now();
        let mut record = match stage {
            "ingest" => self.ingest(writer, groups, shard)?,
            "embed" => self.embed(writer, shard)?,
            "connect" => self.connect(writer, shard)?,
            "refine" => self.refine(writer)?,
            "consolidate" => self.consolidate(writer, shard)?,
            "export" => self.export(writer)?,
            other => bail!("unknown stage `{other}`"),
        };
        record.name = stage.into();
        record.seconds = started.elapsed().as_secs_f64();
        Ok(record)
    }

    fn ingest(
        &mut self,
        writer: &mut Writer,
        groups: &[(&Input, Vec<PathBuf>)],
        shard: Shard,
    ) -> anyhow::Result<StageRecord> {
        let p = &self.loaded.pipeline;
        if groups.is_empty() {
            return Ok(StageRecord {
                status: "no inputs".into(),
                ..Default::default()
            });
        }
        let mut judge =
            super::ModelOutcomeJudge::from_flag(&p.ingest.label_outcomes, &self.device_choice)
                .context("key `ingest.label_outcomes`")?;
        let mut total = fluxmem_ingest::IngestReport::default();
        let mut reports = Vec::new();
        for (i, (input, files)) in groups.iter().enumerate() {
            if files.is_empty() {
                continue;
            }
            let options = fluxmem_ingest::IngestOptions {
                format: fluxmem_ingest::Format::parse(&input.format)?,
                tenant: input.tenant.clone(),
                agent_id: input.agent.clone(),
                max_record_bytes: p.ingest.max_record_bytes,
                chunk_words: p.ingest.chunk_words,
                batch_records: p.ingest.batch_records,
                batch_files: p.ingest.batch_files,
                batch_bytes: fluxmem_ingest::IngestOptions::default().batch_bytes,
                shard,
                follow_symlinks: false,
                reread: p.ingest.reread,
                redact: p.redact.clone(),
            };
            let mut bar = IngestBar::new(self.settings.progress);
            let run = format!("{}-inputs{i}", quarantine_name(&self.run_id));
            let judge = judge
                .as_mut()
                .map(|j| j as &mut dyn fluxmem_ingest::outcome::OutcomeJudge);
            let report =
                fluxmem_ingest::ingest_judged(writer, files, &options, judge, &run, &mut bar)
                    .with_context(|| {
                        format!(
                            "ingesting inputs[{i}] into {}",
                            writer.store().dir().display()
                        )
                    })?;
            bar.finish();
            total.read += report.read;
            total.ingested += report.ingested;
            total.duplicates += report.duplicates;
            total.quarantined += report.quarantined;
            total.other_shards += report.other_shards;
            total.nodes_added += report.nodes_added;
            total.files += report.files;
            total.unchanged_files += report.unchanged_files;
            total.commits += report.commits;
            total.judge_errors += report.judge_errors;
            if let Some(file) = &report.quarantine_file {
                self.quarantine_files.push(file.clone());
            }
            reports.push(json!({ "input": i, "files": files.len(), "report": report }));
        }
        self.quarantined += total.quarantined;
        if total.judge_errors > 0 {
            eprintln!(
                "  the outcome judge failed on {} runs: they keep the rule's outcome",
                total.judge_errors
            );
        }
        eprintln!(
            "  read {} records from {} files ({} unchanged files not read again): {} ingested, {} duplicates, {} quarantined{}",
            total.read,
            total.files,
            total.unchanged_files,
            total.ingested,
            total.duplicates,
            total.quarantined,
            if shard.count > 1 { format!(", {} left to other shards", total.other_shards) } else { String::new() }
        );
        // Every record this run (or shard) read and owned went to quarantine: nothing came in.
        let status = if total.quarantined > 0 && total.ingested + total.duplicates == 0 {
            format!(
                "{DEGRADED}: all {} record{} read were quarantined",
                total.quarantined,
                if total.quarantined == 1 { "" } else { "s" }
            )
        } else if total.ingested == 0 && total.quarantined == 0 {
            "nothing new".into()
        } else {
            "done".into()
        };
        Ok(StageRecord {
            status,
            counts_in: counts64(&[
                ("files", total.files),
                ("unchanged_files", total.unchanged_files),
                ("records", total.read),
            ]),
            counts_out: counts64(&[
                ("ingested", total.ingested),
                ("duplicates", total.duplicates),
                ("quarantined", total.quarantined),
                ("other_shards", total.other_shards),
                ("nodes_added", total.nodes_added),
                ("commits", total.commits),
            ]),
            details: json!(reports),
            ..Default::default()
        })
    }

    fn embed(&mut self, writer: &mut Writer, shard: Shard) -> anyhow::Result<StageRecord> {
        let run_id = format!("embed@{}", self.run_id);
        let mut bar = CountBar::new(self.settings.progress, "embed");
        let options = embed_options(self.loaded, shard);
        let embedder = self.embedder()?;
        let report = fluxmem_embed::embed_store(writer, embedder, &options, &run_id, &mut bar)?;
        bar.finish();
        eprintln!(
            "  {} nodes: {} embedded, {} from the cache, {} already had a vector",
            report.nodes, report.embedded, report.cached, report.already
        );
        Ok(StageRecord {
            status: if report.embedded + report.cached == 0 {
                "nothing new".into()
            } else {
                "done".into()
            },
            counts_in: counts(&[("nodes", report.nodes), ("already", report.already)]),
            counts_out: counts(&[
                ("embedded", report.embedded),
                ("cached", report.cached),
                ("commits", report.commits),
            ]),
            details: serde_json::to_value(&report)?,
            ..Default::default()
        })
    }

    fn connect(&mut self, writer: &mut Writer, shard: Shard) -> anyhow::Result<StageRecord> {
        let c = self.loaded.pipeline.connect.clone();
        if !c.enabled {
            return Ok(disabled());
        }
        let device = self.device_choice.device()?;
        let run_id = format!("connect@{}", self.run_id);
        let progress = self.settings.progress;
        let embedder = self.embedder()?;
        let options = connect_options(&c, shard);
        let mut bar = CountBar::new(progress, "connect");
        let report =
            fluxmem_connect::connect_store(writer, embedder, &options, &run_id, &device, &mut bar)?;
        bar.finish();
        eprintln!(
            "  {} episodes: {} connected now; {} ground and {} link edges",
            report.episodes, report.connected, report.ground_edges, report.link_edges
        );
        Ok(StageRecord {
            status: if report.connected == 0 {
                "nothing new".into()
            } else {
                "done".into()
            },
            counts_in: counts(&[("episodes", report.episodes), ("already", report.already)]),
            counts_out: counts(&[
                ("connected", report.connected),
                ("ground_edges", report.ground_edges),
                ("link_edges", report.link_edges),
                ("commits", report.commits),
            ]),
            details: serde_json::to_value(&report)?,
            ..Default::default()
        })
    }

    fn refine(&mut self, writer: &mut Writer) -> anyhow::Result<StageRecord> {
        let r = &self.loaded.pipeline.refine;
        if !r.enabled {
            return Ok(disabled());
        }
        let options = fluxmem_refine::CreditOptions {
            prior: r.prior,
            prune_below: r.prune_below,
            min_evidence: r.min_evidence,
            link_failures: r.failure_links,
            max_failure_links: r.max_failure_links,
            tolerance: r.tolerance,
            prior_drift: r.prior_drift,
            commit_every: r.commit_every,
            ..fluxmem_refine::CreditOptions::default()
        };
        let mut bar = CountBar::new(self.settings.progress, "refine");
        let report = fluxmem_refine::refine_store(
            writer,
            &options,
            &format!("refine@{}", self.run_id),
            &mut bar,
        )?;
        bar.finish();
        eprintln!(
            "  {} edges reweighted ({} of the {} edges read moved within the tolerance, kept), {} pruned, {} re-activated, {} failure->success links",
            report.reweighted, report.within_tolerance, report.edges_decided, report.pruned, report.reactivated, report.expanded
        );
        Ok(StageRecord {
            status: if report.edits + report.stats_written == 0 {
                "nothing new".into()
            } else {
                "done".into()
            },
            counts_in: counts(&[
                ("episodes", report.episodes),
                ("with_outcome", report.with_outcome),
            ]),
            counts_out: counts(&[
                ("reweighted", report.reweighted),
                ("pruned", report.pruned),
                ("reactivated", report.reactivated),
                ("expanded", report.expanded),
                ("edits", report.edits),
            ]),
            details: serde_json::to_value(&report)?,
            ..Default::default()
        })
    }

    fn consolidate(&mut self, writer: &mut Writer, shard: Shard) -> anyhow::Result<StageRecord> {
        let c = self.loaded.pipeline.consolidate.clone();
        if !c.enabled {
            return Ok(disabled());
        }
        let models = self.loaded.pipeline.models.clone();
        let device = self.device_choice.device()?;
        let mut generator = if models.generator == "none" {
            None
        } else {
            ensure_model(&models.generator)?;
            Some(fluxmem_models::load_generator(
                &models.generator,
                &self.device_choice,
                super::weight_path(&models.generator_weights)?,
            )?)
        };
        if let Some(judge) = fluxmem_models::judge_model(&models.judge)? {
            ensure_model(&judge)?;
        }
        if let Some(replayer) = fluxmem_models::eta_model(&c.eta)? {
            ensure_model(&replayer)?;
        }
        let mut replayer = super::replayer_from_flag(&c.eta, &models.judge, &self.device_choice)?;
        let mut judge = super::judge_from_flag(&models.judge, &self.device_choice)?;
        let options = self.consolidate_options(shard)?;
        let run_id = format!("consolidate@{}", self.run_id);
        let progress = self.settings.progress;
        let embedder = self.embedder()?;
        let mut stage_models = fluxmem_consolidate::Models {
            embedder,
            generator: generator.as_mut().map(|g| g as &mut dyn Generator),
            judge: judge.as_mut().map(|j| j as &mut dyn Judge),
            replayer: replayer.as_mut().map(|r| r as &mut dyn Generator),
        };
        let mut bar = CountBar::new(progress, "consolidate");
        let report = fluxmem_consolidate::consolidate_store(
            writer,
            &mut stage_models,
            &options,
            &run_id,
            &device,
            &mut bar,
        )?;
        bar.finish();
        eprintln!("  {}", report.summary_line());
        if let Some(line) = super::consolidate::assignment_line(&report) {
            eprintln!("  {line}");
        }
        let usage = |u: &fluxmem_consolidate::TokenUsage| UsageRecord {
            calls: u.calls as u64,
            prompt_tokens: u.prompt_tokens as u64,
            generated_tokens: u.generated_tokens as u64,
        };
        self.usage
            .insert("generator".into(), usage(&report.generator));
        if report.judge.calls > 0 {
            // The model that measured eta: a replay model (`consolidate.eta`) or the judge.
            let key = if c.eta == "coverage" { "judge" } else { "eta" };
            self.usage.insert(key.into(), usage(&report.judge));
        }
        self.pems = Some(pems_summary(
            &report,
            &writer
                .store()
                .scan(&fluxmem_store::Scan {
                    nodes: true,
                    node_kinds: vec![fluxmem_graph::NodeKind::Procedural],
                    ..Default::default()
                })?
                .0,
        ));
        Ok(StageRecord {
            status: report.status(),
            counts_in: counts(&report.counts_in()),
            counts_out: counts(&report.counts_out()),
            details: serde_json::to_value(&report)?,
            ..Default::default()
        })
    }

    /// The consolidate stage's settings from the pipeline, for `shard` of the run.
    fn consolidate_options(
        &self,
        shard: Shard,
    ) -> anyhow::Result<fluxmem_consolidate::ConsolidateOptions> {
        let (c, m) = (
            &self.loaded.pipeline.consolidate,
            &self.loaded.pipeline.models,
        );
        Ok(fluxmem_consolidate::ConsolidateOptions {
            kmeans: fluxmem_consolidate::KMeansOptions {
                clusters: pipeline::clusters(&c.clusters)?,
                seed: self.loaded.pipeline.seed,
                ..Default::default()
            },
            successful_only: c.successful_only,
            pems: fluxmem_consolidate::PemsOptions {
                length: c.length.parse().map_err(anyhow::Error::msg)?,
                divide_by_skills: c.divide_by_skills,
            },
            max_rounds: c.max_rounds,
            epsilon: c.epsilon,
            prompt_budget: c.prompt_budget,
            max_tokens: c.max_tokens,
            judge_episodes: c.judge_episodes,
            replay_steps: c.replay_steps,
            outcomes: super::outcomes_flag("key `consolidate.outcomes`", &c.outcomes)?,
            reinduce_share: c.reinduce_share,
            assign: c.assign,
            recluster_share: c.recluster_share,
            models: fluxmem_consolidate::ModelNames {
                embedder: m.embedder.clone(),
                embed_batch: Some(self.loaded.pipeline.embed.batch_size),
                generator: m.generator.clone(),
                generator_weights: m.generator_weights.clone(),
                judge: m.judge.clone(),
                eta: c.eta.clone(),
                device: m.device.clone(),
            },
            shard,
            ..Default::default()
        })
    }

    fn export(&mut self, writer: &mut Writer) -> anyhow::Result<StageRecord> {
        let e = self.loaded.pipeline.export.clone();
        if !e.enabled {
            return Ok(disabled());
        }
        let out = self.loaded.resolve(&e.out);
        let options = fluxmem_consolidate::ExportOptions {
            format: e.format.parse().map_err(anyhow::Error::msg)?,
            tenant: e.tenant.clone(),
            min_pems: e.min_pems,
            min_eta: e.min_eta,
            min_support: e.min_support,
        };
        let store = Store::open(writer.store().dir())?;
        let redactor = fluxmem_redact::Redactor::new(self.loaded.pipeline.redact.clone());
        let report = fluxmem_consolidate::export_skills_with(&store, &out, &options, &redactor)
            .with_context(|| format!("exporting skills to {}", out.display()))?;
        eprintln!(
            "  {} skills exported to {} ({} filtered out)",
            report.skills,
            out.display(),
            report.filtered_out
        );
        self.outputs.push(out.display().to_string());
        // An enabled export that wrote no skill gave the user an empty release.
        let status = if report.skills == 0 {
            let why = if report.filtered_out > 0 {
                format!("{} left out by min_pems / min_support", report.filtered_out)
            } else {
                match &e.tenant {
                    Some(tenant) => format!("the store has no skill of tenant `{tenant}`"),
                    None => "the store has no skill".to_string(),
                }
            };
            format!("{DEGRADED}: 0 skills exported ({why})")
        } else {
            "done".into()
        };
        Ok(StageRecord {
            status,
            counts_out: counts(&[
                ("skills", report.skills),
                ("filtered_out", report.filtered_out),
                ("files", report.files.len()),
            ]),
            details: serde_json::to_value(&report)?,
            ..Default::default()
        })
    }
}

/// The run record as it may leave the store: every string passed through the redaction of the
/// pipeline's `[redact]`; `redacted` counts what this and the export replaced, per kind.
fn redacted(record: RunRecord, config: &fluxmem_redact::RedactConfig) -> anyhow::Result<RunRecord> {
    let redactor = fluxmem_redact::Redactor::new(config.clone());
    let mut counts = fluxmem_redact::Counts::new();
    for stage in record.stages.iter().filter(|s| s.name == "export") {
        if let Ok(exported) =
            serde_json::from_value::<fluxmem_redact::Counts>(stage.details["redacted"].clone())
        {
            counts.merge(&exported);
        }
    }
    let mut value = serde_json::to_value(&record)?;
    redactor.redact_json(&mut value, &mut counts);
    let mut record: RunRecord = serde_json::from_value(value)?;
    record.redacted = counts
        .iter()
        .map(|(kind, n)| (kind.to_string(), n))
        .collect();
    Ok(record)
}

/// One line on a compaction: what it merged and the amplification it left, per keyed table.
pub fn compaction_line(report: &fluxmem_store::CompactReport) -> String {
    let tables: Vec<String> = report
        .tables
        .iter()
        .map(|(table, t)| {
            format!(
                "{table} {}->{} shards, {} rows for {} live (x{:.2})",
                t.shards_before,
                t.shards_after,
                t.rows_after,
                t.live_rows,
                t.amplification()
            )
        })
        .collect();
    let done = if report.committed {
        format!("{} shard files retired", report.retired)
    } else {
        "nothing to compact".into()
    };
    format!("{done}; {}", tables.join("; "))
}

/// One run id, one report: a run started again, or run stage by stage (a distributed run:
/// merges and global stages one call each), adds to the `run.json` already written for the run
/// id. Stages this call did not run (or skipped as done earlier) keep their earlier records;
/// the first start time and the first store version are kept.
fn accumulate(record: &mut RunRecord, path: &Path, stage_only: bool) {
    let Ok(bytes) = std::fs::read(path) else {
        return;
    };
    let Ok(earlier) = serde_json::from_slice::<RunRecord>(&bytes) else {
        eprintln!(
            "warning: {} is not a run record; writing a new one",
            path.display()
        );
        return;
    };
    if earlier.run_id != record.run_id {
        return;
    }
    let mut stages: Vec<StageRecord> = Vec::new();
    for name in STAGES {
        let now = record.stages.iter().find(|s| s.name == name);
        let before = earlier.stages.iter().find(|s| s.name == name);
        let resumed = now.is_some_and(|s| s.status.starts_with("done earlier"));
        match (now, before) {
            (Some(_), Some(before)) if resumed => stages.push(before.clone()),
            (Some(now), _) => stages.push(now.clone()),
            (None, Some(before)) => stages.push(before.clone()),
            (None, None) => {}
        }
    }
    record.stages = stages;
    if record
        .compaction
        .as_ref()
        .is_none_or(|c| c["committed"] != true)
        && earlier.compaction.is_some()
    {
        record.compaction = earlier.compaction.clone();
    }
    if record.indexes.is_none() {
        record.indexes = earlier.indexes.clone();
    }
    record.started_at = earlier.started_at.clone();
    record.manifest_version_before = record
        .manifest_version_before
        .min(earlier.manifest_version_before);
    for (role, model) in earlier.models {
        record.models.entry(role).or_insert(model);
    }
    for (role, usage) in earlier.model_usage {
        record.model_usage.entry(role).or_insert(usage);
    }
    if record.pems.is_none() {
        record.pems = earlier.pems;
    }
    if stage_only || record.quarantine.records == 0 {
        let mut files = earlier.quarantine.files.clone();
        files.extend(
            record
                .quarantine
                .files
                .iter()
                .filter(|f| !earlier.quarantine.files.contains(f))
                .cloned(),
        );
        if record.quarantine.records == 0 {
            record.quarantine = earlier.quarantine;
        }
        record.quarantine.files = files;
    }
    for output in earlier.outputs {
        if !record.outputs.contains(&output) {
            record.outputs.push(output);
        }
    }
}

/// A merge's stage record joins the run's report.
fn add_stage_to_report(
    loaded: &Loaded,
    run_id: &str,
    store_dir: &Path,
    stage: &StageRecord,
) -> anyhow::Result<()> {
    let dir = loaded.resolve(&loaded.pipeline.report.dir).join(run_id);
    let mut record = RunRecord {
        pipeline: loaded.path.display().to_string(),
        run_id: run_id.into(),
        started_at: now(),
        finished_at: now(),
        stages: vec![stage.clone()],
        ..Default::default()
    };
    if let Ok(store) = Store::open(store_dir) {
        let version = store.manifest()?.version;
        record.store = store.dir().display().to_string();
        record.manifest_version_before = version;
        record.manifest_version_after = version;
    }
    accumulate(&mut record, &dir.join(fluxmem_report::RUN_JSON), true);
    settle(&mut record, None);
    fluxmem_report::write_report(&dir, &record)?;
    Ok(())
}

fn disabled() -> StageRecord {
    StageRecord {
        status: "skipped (disabled)".into(),
        ..Default::default()
    }
}

fn counts(pairs: &[(&str, usize)]) -> BTreeMap<String, u64> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), *v as u64))
        .collect()
}

fn counts64(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn open_main(dir: &Path, settings: &Settings) -> anyhow::Result<Writer> {
    super::open_writer_at(dir, settings)
        .with_context(|| format!("opening the store {}", dir.display()))
}

/// Records in the manifest that `stage` finished for `run_id`, so a resumed run skips it.
fn mark_done(writer: &mut Writer, stage: &str, run_id: &str, counts: &Value) -> anyhow::Result<()> {
    mark_done_with(writer, (stage, run_id), counts, Value::Null)
}

/// [`mark_done`] with the commit's `summary` (a plan's commit marks its stage done under the
/// plan's digest, so a merge killed before it removed the plan can run again).
fn mark_done_with(
    writer: &mut Writer,
    (stage, run_id): (&str, &str),
    counts: &Value,
    summary: Value,
) -> anyhow::Result<()> {
    let progress = [(
        format!("pipeline.{stage}"),
        json!({ "run_id": run_id, "counts": counts }),
    )]
    .into_iter()
    .collect();
    let info = CommitInfo {
        stage: format!("{stage}-done"),
        run_id: run_id.into(),
        summary,
        progress,
    };
    writer.commit(&Graph::default(), info)?;
    Ok(())
}

/// The default run id: the pipeline name and a hash of the pipeline file and of every input
/// file's path, size and modification time. Same inputs and config, same id: a re-run resumes.
fn default_run_id(loaded: &Loaded, groups: &[(&Input, Vec<PathBuf>)]) -> String {
    let mut hash = sha2::Sha256::new();
    hash.update(&loaded.bytes);
    let mut files: Vec<PathBuf> = Vec::new();
    for (_, paths) in groups {
        for path in paths {
            collect_files(path, &mut files);
        }
    }
    for file in files {
        let meta = std::fs::metadata(&file).ok();
        let mtime = meta
            .as_ref()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        hash.update(
            format!(
                "{}\0{}\0{:?}\n",
                file.display(),
                meta.map(|m| m.len()).unwrap_or(0),
                mtime
            )
            .as_bytes(),
        );
    }
    let digest: String = hash
        .finalize()
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{}-{digest}", loaded.pipeline.name)
}

fn collect_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .map(|e| e.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        entries.sort();
        for entry in entries {
            if !std::fs::symlink_metadata(&entry)
                .map(|m| m.file_type().is_symlink())
                .unwrap_or(true)
            {
                collect_files(&entry, out);
            }
        }
    } else {
        out.push(path.to_path_buf());
    }
}

/// Quarantine file names are made from run ids; keep them to safe characters.
fn quarantine_name(run_id: &str) -> String {
    run_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.@".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn model_id(name: &str) -> String {
    fluxmem_models::ModelManifest::load()
        .ok()
        .and_then(|m| m.get(name).ok().map(|s| s.model_id()))
        .unwrap_or_else(|| name.to_string())
}

/// Fetches a model into the cache on first use.
fn ensure_model(name: &str) -> anyhow::Result<()> {
    Ok(fluxmem_models::ensure_installed(name, &mut |line| {
        eprintln!("fluxmem run: {line}")
    })?)
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn pems_summary(report: &fluxmem_consolidate::ConsolidateReport, graph: &Graph) -> PemsSummary {
    let rounds = report
        .skills
        .iter()
        .map(|s| s.rounds.len())
        .max()
        .unwrap_or(0);
    // A skill that stopped early keeps its last score in later rounds.
    let mean_by_round = (0..rounds)
        .map(|r| {
            let scores: Vec<f64> = report
                .skills
                .iter()
                .filter_map(|s| {
                    s.rounds
                        .get(r.min(s.rounds.len().saturating_sub(1)))
                        .map(|x| x.pems)
                })
                .collect();
            if scores.is_empty() {
                0.0
            } else {
                scores.iter().sum::<f64>() / scores.len() as f64
            }
        })
        .collect();
    let converged_by_round = (1..=rounds)
        .map(|r| {
            report
                .skills
                .iter()
                .filter(|s| s.converged_round.is_some_and(|c| c <= r))
                .count() as u64
        })
        .collect();
    let mut top: Vec<SkillSummary> = fluxmem_consolidate::skill_records(graph)
        .into_iter()
        .map(|s| SkillSummary {
            id: s.id.clone(),
            name: s.name.clone(),
            description: s.description.clone(),
            version: s.version,
            pems: s.pems,
            support: s.support as u64,
            pems_history: s.pems_history.clone(),
            source_episodes: s.source_episodes.clone(),
        })
        .collect();
    top.sort_by(|a, b| b.pems.total_cmp(&a.pems).then(a.id.cmp(&b.id)));
    top.truncate(10);
    PemsSummary {
        skills: report.skills.len() as u64,
        mean_by_round,
        converged_by_round,
        cluster_sizes: report
            .cluster_list
            .iter()
            .map(|c| c.episodes.len() as u64)
            .collect(),
        top_skills: top,
    }
}

/// Reads this run's quarantine files: counts by reason and the first samples.
fn quarantine_summary(files: &[PathBuf]) -> anyhow::Result<QuarantineSummary> {
    let mut summary = QuarantineSummary::default();
    for file in files {
        summary.files.push(file.display().to_string());
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let value: Value = serde_json::from_str(line)
                .with_context(|| format!("{}: not a quarantine record", file.display()))?;
            summary.records += 1;
            let reason = value["reason"].as_str().unwrap_or_default().to_string();
            // Group by the reason's first clause (reasons carry record-specific details after it).
            let key = reason
                .split([':', '('])
                .next()
                .unwrap_or_default()
                .trim()
                .to_string();
            *summary.by_reason.entry(key).or_default() += 1;
            if summary.samples.len() < 20 {
                summary.samples.push(QuarantineSample {
                    file: value["file"].as_str().unwrap_or_default().to_string(),
                    line: value["line"].as_u64(),
                    field: value["field"].as_str().unwrap_or_default().to_string(),
                    reason,
                });
            }
        }
    }
    Ok(summary)
}

fn print_summary(record: &RunRecord) {
    println!(
        "run {} of {}: {}",
        record.run_id, record.pipeline, record.status
    );
    for reason in &record.reasons {
        println!("  - {reason}");
    }
    for stage in &record.stages {
        let out: Vec<String> = stage
            .counts_out
            .iter()
            .filter(|(_, v)| **v > 0)
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        println!(
            "  {:<12} {:>7.1}s  {:<34} {}",
            stage.name,
            stage.seconds,
            stage.status,
            out.join(", ")
        );
    }
    if record.quarantine.records > 0 {
        println!(
            "  {} records quarantined: {}",
            record.quarantine.records,
            record.quarantine.files.join(", ")
        );
    }
    println!(
        "store {} at version {} (was {})",
        record.store, record.manifest_version_after, record.manifest_version_before
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quarantine_names_are_safe() {
        assert_eq!(quarantine_name("demo-ab12/x y"), "demo-ab12_x_y");
    }

    fn stage(name: &str, status: &str) -> StageRecord {
        StageRecord {
            name: name.into(),
            status: status.into(),
            ..Default::default()
        }
    }

    #[test]
    fn settle_ranks_failed_over_degraded_over_partial_over_ok() {
        let mut record = RunRecord {
            stages: vec![stage("ingest", "done"), stage("export", "nothing new")],
            ..Default::default()
        };
        settle(&mut record, None);
        assert_eq!((record.status.as_str(), record.reasons.len()), ("ok", 0));

        record.quarantine.records = 2;
        settle(&mut record, None);
        assert_eq!(record.status, "partial");
        assert_eq!(record.reasons, ["ingest: 2 records quarantined"]);

        record.stages.push(stage(
            "consolidate",
            "degraded: 0 of 6 clusters gave a skill (6 failed)",
        ));
        record.stages.push(stage(
            "export",
            "degraded: 0 skills exported (the store has no skill)",
        ));
        settle(&mut record, None);
        assert_eq!(record.status, "degraded");
        assert_eq!(
            record.reasons,
            [
                "consolidate: 0 of 6 clusters gave a skill (6 failed)",
                "export: 0 skills exported (the store has no skill)",
                "ingest: 2 records quarantined",
            ]
        );

        settle(&mut record, Some(&anyhow::anyhow!("disk full")));
        assert_eq!(record.status, "failed: disk full");
        assert_eq!(record.reasons.len(), 3, "the reasons stay with a failure");

        // Every record was quarantined: one reason, from the ingest stage.
        let mut record = RunRecord {
            stages: vec![stage(
                "ingest",
                "degraded: all 3 records read were quarantined",
            )],
            ..Default::default()
        };
        record.quarantine.records = 3;
        settle(&mut record, None);
        assert_eq!(record.status, "degraded");
        assert_eq!(
            record.reasons,
            ["ingest: all 3 records read were quarantined"]
        );

        // A partial stage and nothing else.
        let mut record = RunRecord {
            stages: vec![stage(
                "consolidate",
                "partial: 1 of 6 clusters gave a skill (5 failed)",
            )],
            ..Default::default()
        };
        settle(&mut record, None);
        assert_eq!(record.status, "partial");
        assert_eq!(
            record.reasons,
            ["consolidate: 1 of 6 clusters gave a skill (5 failed)"]
        );
        assert_eq!(stage_detail("degraded", DEGRADED), Some("degraded"));
        assert_eq!(stage_detail("degradedness", DEGRADED), None);
    }
}
