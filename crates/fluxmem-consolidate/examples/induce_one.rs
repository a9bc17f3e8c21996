//! One skill induction on real episodes of a store, for trying prompts and generators:
//!
//! ```text
//! cargo run --example induce_one -- STORE GENERATOR LOCATOR_PART [EPISODES]
//! cargo run --example induce_one -- /tmp/alf smollm2-135m-instruct-q4_1 _clean_ 3
//! ```
//!
//! Picks the first EPISODES (default 3) episodes whose source locator (the record's name in
//! its file; ALFWorld names carry the task type, which the store itself never holds) contains
//! LOCATOR_PART (in id order), induces one skill (prompt budget 600, at most 200 new tokens, Q8 weights, CPU), and prints the prompt,
//! the skill or every rejected answer, the tokens and the time.

use fluxmem_consolidate::{induce_skill, ConsolidateOptions};
use fluxmem_graph::NodeKind;
use fluxmem_models::{DeviceChoice, Generator, WeightPath};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store, generator, filter, rest @ ..] = args.as_slice() else {
        return Err("usage: induce_one STORE GENERATOR LOCATOR_PART [EPISODES]".into());
    };
    let count: usize = rest.first().map(|n| n.parse()).transpose()?.unwrap_or(3);
    let graph = fluxmem_store::Store::open(store)?.load()?;
    let episodes: Vec<_> = graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Episodic && n.source_locator.contains(filter.as_str()))
        .take(count)
        .collect();
    let loaded = std::time::Instant::now();
    let mut generator =
        fluxmem_models::load_generator(generator, &DeviceChoice::Cpu, WeightPath::Q8)?;
    eprintln!(
        "{} episodes; generator {} loaded in {:.1}s",
        episodes.len(),
        generator.model_id(),
        loaded.elapsed().as_secs_f64()
    );
    let started = std::time::Instant::now();
    let options = ConsolidateOptions {
        prompt_budget: 600,
        max_tokens: 200,
        ..Default::default()
    };
    let result = induce_skill(&episodes, None, &mut generator, &options)?;
    let usage = generator.usage();
    match result {
        Ok(skill) => println!("SKILL\n{}", skill.render()),
        Err(attempts) => {
            for attempt in attempts {
                println!("REJECTED ({})\n{}\n", attempt.problem, attempt.raw);
            }
        }
    }
    println!(
        "{} calls, {} prompt + {} generated tokens, {:.1}s",
        usage.calls,
        usage.prompt_tokens,
        usage.generated_tokens,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
