//! Prompt-processing and decode throughput of the default generator, quantized weights against
//! dequantized-at-load weights, on the CPU.
//!
//! cargo run --example generator_bench [-- --model NAME] [--repeat N]

use fluxmem_models::{ChatMessage, DeviceChoice, GenerateParams, Generator, WeightPath};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let repeat: usize = args.iter().position(|a| a == "--repeat").and_then(|i| args.get(i + 1)).map_or(Ok(3), |v| v.parse())?;
    let model = args.iter().position(|a| a == "--model").and_then(|i| args.get(i + 1)).cloned();
    let model = model.as_deref().unwrap_or(fluxmem_models::DEFAULT_GENERATOR);
    let passage = "Caroline: I went to a LGBTQ support group yesterday and it was so powerful. \
                   Melanie: That's great! I'm swamped with the kids and work, but we went camping last weekend. ";
    let prefill_prompt = format!("{}\nSummarise the conversation above.", passage.repeat(6));
    println!("{model}");
    println!("{:<14} {:>8} {:>14} {:>14} {:>12}", "weights", "load s", "prefill tok/s", "decode tok/s", "prompt tok");
    for (name, path) in [("as stored", WeightPath::Quantized), ("f32 at load", WeightPath::Dequantized), ("Q8_0 at load", WeightPath::Q8)] {
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
        let messages = [ChatMessage::new("user", "Write a long story about a lighthouse keeper.")];
        let params = GenerateParams { max_tokens: 64, ..GenerateParams::default() };
        let short_prompt = generator.count_tokens(&generator.chat_prompt(&messages))?;
        let mut decode = 0f64;
        for _ in 0..repeat {
            let started = Instant::now();
            let generation = generator.generate(&messages, &params)?;
            let seconds = started.elapsed().as_secs_f64() - prefill * short_prompt as f64 / tokens as f64;
            decode = decode.max(generation.generated_tokens as f64 / seconds);
        }
        println!("{name:<14} {load:>8.2} {:>14.1} {decode:>14.1} {tokens:>12}", tokens as f64 / prefill);
    }
    Ok(())
}
