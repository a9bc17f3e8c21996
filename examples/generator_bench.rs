//! Prompt-processing and decode throughput of the default generator, quantized weights against
//! dequantized-at-load weights, on the CPU; with `--batches 1,4,8,16`, batched decode instead:
//! tokens/s of `generate_batch` over that many different prompts, per weight path, and the
//! ratio to batch 1.
//!
//! cargo run --example generator_bench [-- --model NAME] [--repeat N] [--batches LIST] [--weights LIST]

use fluxmem_models::{ChatMessage, DeviceChoice, GenerateParams, Generator, WeightPath};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    // As the fluxmem binary does (before any thread starts).
    fluxmem_models::tune_thread_pool();
    let args: Vec<String> = std::env::args().collect();
    let repeat: usize = args
        .iter()
        .position(|a| a == "--repeat")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(3), |v| v.parse())?;
    let model = args
        .iter()
        .position(|a| a == "--model")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let model = model
        .as_deref()
        .unwrap_or(fluxmem_models::DEFAULT_GENERATOR);
    let passage = "Caroline: I went to a LGBTQ support group yesterday and it was so powerful. \
                   Melanie: That's great! I'm swamped with the kids and work, but we went camping last weekend. ";
    let prefill_prompt = format!("{}\nSummarise the conversation above.", passage.repeat(6));
    let paths = [
        ("as stored", "stored", WeightPath::Quantized),
        ("f32 at load", "f32", WeightPath::Dequantized),
        ("Q8_0 at load", "q8", WeightPath::Q8),
        ("f32 + Q8_0", "mixed", WeightPath::Mixed),
    ];
    let wanted = args
        .iter()
        .position(|a| a == "--weights")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "stored,f32,q8,mixed".into());
    let paths: Vec<_> = paths
        .into_iter()
        .filter(|(_, short, _)| wanted.split(',').any(|w| w == *short))
        .collect();
    println!("{model}");
    if let Some(batches) = args
        .iter()
        .position(|a| a == "--batches")
        .and_then(|i| args.get(i + 1))
    {
        let batches: Vec<usize> = batches
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        return batched(model, &paths, &batches, repeat);
    }
    println!(
        "{:<14} {:>8} {:>14} {:>14} {:>12}",
        "weights", "load s", "prefill tok/s", "decode tok/s", "prompt tok"
    );
    for (name, _, path) in paths {
        let started = Instant::now();
        let mut generator = fluxmem_models::load_generator(model, &DeviceChoice::Cpu, path)?;
        let load = started.elapsed().as_secs_f64();
        let prefix = generator.chat_prompt(&[ChatMessage::new("user", prefill_prompt.clone())]);
        let tokens = generator.count_tokens(&prefix)?;
        let mut prefill = f64::MAX;
        for _ in 0..repeat {
            let started = Instant::now();
            generator.next_token_logprobs(&prefix, &[String::new()], &["The"])?;
            prefill = prefill.min(started.elapsed().as_secs_f64());
        }
        let messages = [ChatMessage::new(
            "user",
            "Write a long story about a lighthouse keeper.",
        )];
        let params = GenerateParams {
            max_tokens: 64,
            ..GenerateParams::default()
        };
        let short_prompt = generator.count_tokens(&generator.chat_prompt(&messages))?;
        let mut decode = 0f64;
        for _ in 0..repeat {
            let started = Instant::now();
            let generation = generator.generate(&messages, &params)?;
            let seconds =
                started.elapsed().as_secs_f64() - prefill * short_prompt as f64 / tokens as f64;
            decode = decode.max(generation.generated_tokens as f64 / seconds);
        }
        println!(
            "{name:<14} {load:>8.2} {:>14.1} {decode:>14.1} {tokens:>12}",
            tokens as f64 / prefill
        );
    }
    Ok(())
}

/// Batched decode: `batch` different short prompts decoded together for 32 tokens each (a
/// sequence that ends early leaves the batch), best of `repeat`. Tokens/s counts generated
/// tokens over the whole call, prefill included, so batch 1 is the plain `generate` loop.
fn batched(
    model: &str,
    paths: &[(&str, &str, WeightPath)],
    batches: &[usize],
    repeat: usize,
) -> anyhow::Result<()> {
    let topics = [
        "a lighthouse keeper",
        "a baker",
        "a robot",
        "a river",
        "a mountain",
        "a city",
        "a cat",
        "a ship",
    ];
    println!(
        "{:<14} {:>6} {:>12} {:>14} {:>10}",
        "weights", "batch", "generated", "tok/s", "x batch 1"
    );
    for (name, _, path) in paths {
        let mut base = None;
        for &batch in batches {
            let mut generator = fluxmem_models::load_generator(model, &DeviceChoice::Cpu, *path)?
                .with_batch_size(batch);
            let conversations: Vec<Vec<ChatMessage>> = (0..batch)
                .map(|i| {
                    vec![ChatMessage::new(
                        "user",
                        format!(
                            "Write a long story about {} (number {i}).",
                            topics[i % topics.len()]
                        ),
                    )]
                })
                .collect();
            let params = GenerateParams {
                max_tokens: 32,
                ..GenerateParams::default()
            };
            let mut best = 0f64;
            let mut tokens = 0;
            for _ in 0..repeat {
                let started = Instant::now();
                let out = generator.generate_batch(&conversations, &params)?;
                tokens = out.iter().map(|g| g.generated_tokens).sum::<usize>();
                best = best.max(tokens as f64 / started.elapsed().as_secs_f64());
            }
            let ratio = best / *base.get_or_insert(best);
            println!("{name:<14} {batch:>6} {tokens:>12} {best:>14.1} {ratio:>10.2}");
        }
    }
    Ok(())
}
