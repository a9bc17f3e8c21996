use fluxmem_models::{
    cache_dir, ChatMessage, DeviceChoice, Embedder, GenerateParams, Generator, Judge, LlmJudge,
    ModelManifest, WeightPath,
};
use std::process::ExitCode;

use crate::cli::ModelsCommand;

pub fn run(command: ModelsCommand) -> anyhow::Result<ExitCode> {
    let manifest = ModelManifest::load()?;
    let cache = cache_dir();
    match command {
        ModelsCommand::List { json } => {
            let rows: Vec<serde_json::Value> = manifest
                .models
                .iter()
                .map(|m| {
                    serde_json::json!({
                        "name": m.name, "kind": m.kind, "architecture": m.architecture,
                        "installed": m.is_installed(&cache), "dir": m.dir(&cache), "model_id": m.model_id(),
                        "description": m.description,
                    })
                })
                .collect();
            if json {
                println!("{}", serde_json::Value::Array(rows));
            } else {
                println!("model cache: {}", cache.display());
                for m in &manifest.models {
                    let state = if m.is_installed(&cache) {
                        "installed"
                    } else {
                        "missing  "
                    };
                    println!("  {state}  {:<28} {:<9} {}", m.name, m.kind, m.description);
                }
            }
        }
        ModelsCommand::Fetch { names } => {
            let wanted: Vec<&str> = if names.is_empty() {
                manifest.models.iter().map(|m| m.name.as_str()).collect()
            } else {
                names.iter().map(String::as_str).collect()
            };
            for name in wanted {
                manifest
                    .get(name)?
                    .fetch(&cache, &mut |line| eprintln!("{line}"))?;
            }
        }
        ModelsCommand::Generate {
            model,
            device,
            weights,
            max_tokens,
            temperature,
            seed,
            system,
            prompt,
        } => {
            let mut generator = fluxmem_models::load_generator(
                &model,
                &device.parse::<DeviceChoice>()?,
                weight_path(&weights)?,
            )?;
            let mut messages = Vec::new();
            if let Some(system) = system {
                messages.push(ChatMessage::new("system", system));
            }
            messages.push(ChatMessage::new("user", prompt));
            let params = GenerateParams {
                max_tokens,
                temperature,
                seed,
                ..GenerateParams::default()
            };
            let started = std::time::Instant::now();
            let generation = generator.generate(&messages, &params)?;
            println!("{}", generation.text);
            eprintln!(
                "{} prompt tokens, {} generated ({}), {:.2}s",
                generation.prompt_tokens,
                generation.generated_tokens,
                generation.finish,
                started.elapsed().as_secs_f64()
            );
        }
        ModelsCommand::Judge {
            model,
            device,
            query,
            passages,
        } => {
            let generator = fluxmem_models::load_generator(
                &model,
                &device.parse::<DeviceChoice>()?,
                WeightPath::Prompts,
            )?;
            let mut judge = LlmJudge::new(generator);
            let refs: Vec<&str> = passages.iter().map(String::as_str).collect();
            println!("{}", serde_json::to_string(&judge.score(&query, &refs)?)?);
        }
        ModelsCommand::Embed {
            model,
            device,
            texts,
        } => {
            let embedder = fluxmem_models::load_embedder(&model, &device.parse::<DeviceChoice>()?)?;
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let vectors = embedder.embed(&refs)?;
            println!("{}", serde_json::to_string(&vectors)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn weight_path(value: &str) -> anyhow::Result<WeightPath> {
    value.parse().map_err(|e| anyhow::anyhow!("--weights {e}"))
}
