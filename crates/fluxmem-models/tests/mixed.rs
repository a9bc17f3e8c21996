//! The mixed weight path (f32 for prompts, Q8_0 for decode steps) on SmolLM2-135M. Needs
//! `fluxmem models fetch smollm2-135m-instruct-q4_1` (scripts/test.sh does it); a missing model
//! fails with that command.

use fluxmem_models::{
    ChatMessage, DeviceChoice, GenerateParams, Generator, GgufGenerator, WeightPath,
};

const MODEL: &str = "smollm2-135m-instruct-q4_1";

fn load(path: WeightPath) -> GgufGenerator {
    fluxmem_models::load_generator(MODEL, &DeviceChoice::Cpu, path)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn scores(generator: &mut GgufGenerator, prefix: &str) -> Vec<f32> {
    generator
        .next_token_logprobs(
            prefix,
            &[String::new()],
            &["cat", "sky", "group", "the", "camping"],
        )
        .unwrap()
        .remove(0)
}

fn distance(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A prompt of many tokens runs on the f32 copy (nearer the f32 weights' log-probabilities
/// than the Q8_0 weights'; its one-position output projection runs on Q8_0); a step of a few
/// tokens runs on the Q8_0 copy (nearer the Q8_0 weights', whose embeddings are Q8_0 too);
/// generation works.
#[test]
fn mixed_weights_run_prompts_on_f32_and_steps_on_q8() {
    let (mut f32, mut q8, mut mixed) = (
        load(WeightPath::Dequantized),
        load(WeightPath::Q8),
        load(WeightPath::Mixed),
    );
    let long = "Caroline went to an LGBTQ support group yesterday, and Melanie went camping with her kids last weekend. She said the";
    let short = "The sky is";
    assert!(mixed.count_tokens(long).unwrap() > fluxmem_models::SMALL_ROWS);
    assert!(mixed.count_tokens(short).unwrap() <= fluxmem_models::SMALL_ROWS);
    // The prompt's layers run on f32; its output projection (one position) on Q8_0.
    let (m, q, f) = (
        scores(&mut mixed, long),
        scores(&mut q8, long),
        scores(&mut f32, long),
    );
    assert_ne!(
        q, f,
        "Q8_0 and f32 differ on this prompt (else the next check proves nothing)"
    );
    assert!(
        distance(&m, &f) < distance(&m, &q),
        "a long prompt: the f32 copy (to f32 {}, to Q8_0 {})",
        distance(&m, &f),
        distance(&m, &q)
    );
    let (m, q, f) = (
        scores(&mut mixed, short),
        scores(&mut q8, short),
        scores(&mut f32, short),
    );
    assert_ne!(
        q, f,
        "Q8_0 and f32 differ on this prompt (else the next check proves nothing)"
    );
    assert!(
        distance(&m, &q) < distance(&m, &f),
        "a short step: the Q8_0 copy (to Q8_0 {}, to f32 {})",
        distance(&m, &q),
        distance(&m, &f)
    );
    let reply = mixed
        .generate(
            &[ChatMessage::new("user", "Name a colour.")],
            &GenerateParams {
                max_tokens: 8,
                ..GenerateParams::default()
            },
        )
        .unwrap();
    assert!(
        reply.generated_tokens > 0 && !reply.text.trim().is_empty(),
        "{reply:?}"
    );
}
