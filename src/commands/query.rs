use fluxmem_connect::{pack, Retriever};
use fluxmem_models::{DeviceChoice, Embedder, Judge};
use std::process::ExitCode;

use crate::cli::{QueryArgs, Settings};

pub fn run(args: QueryArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let device_choice: DeviceChoice = args.device.parse()?;
    let device = device_choice.device()?;
    let store = fluxmem_store::Store::open(&settings.store)?;
    let graph = store.load()?;
    let embedder = fluxmem_models::load_embedder(&args.model, &device_choice)?;
    let retriever = Retriever::build(&graph, embedder.model_id(), &device)?;
    let mut judge = super::judge_from_flag(&args.judge, &device_choice)?;
    let config = super::retrieval_config(&args.fusion, &args.weights, if judge.is_some() { args.judge_top } else { 0 })?;
    let query_vector = embedder.embed(&[args.text.as_str()])?.remove(0);
    let entries = retriever.retrieve(
        &graph,
        &args.text,
        &query_vector,
        &config,
        judge.as_mut().map(|j| j as &mut dyn Judge),
        args.episodes,
    )?;
    let count = |text: &str| embedder.count_tokens(text).map_err(fluxmem_connect::Error::from);
    let context = pack(&graph, &entries, args.budget, &count)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&context)?);
    } else {
        println!("{}", context.text());
        eprintln!("{} items, {} of {} tokens", context.items.len(), context.tokens, context.budget);
    }
    Ok(ExitCode::SUCCESS)
}
