//! Batched generation and scoring on the real checkpoints (SmolLM2-135M, llama; Qwen2.5-0.5B,
//! qwen2): a batch gives each sequence what it gets alone. Compared on f32 weights, where the
//! batched and single forwards agree to float rounding (candle's quantized kernels round
//! differently for different row counts, see tests/qwen2.rs), and on the Q8 path, where
//! fluxmem's own kernels compute a row the same way whatever the rows beside it (on a CPU with
//! AVX-512 VNNI; elsewhere candle's kernels run it and that case is not compared). Needs the
//! models of scripts/test.sh; a missing model fails with the command that fetches it.

use fluxmem_models::{
    ChatMessage, DeviceChoice, GenerateParams, Generator, Judge, LlmJudge, QlJudge, WeightPath,
};

fn generator(name: &str, batch: usize) -> fluxmem_models::GgufGenerator {
    generator_with(name, batch, WeightPath::Dequantized)
}

fn generator_with(name: &str, batch: usize, path: WeightPath) -> fluxmem_models::GgufGenerator {
    fluxmem_models::load_generator(name, &DeviceChoice::Cpu, path)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_batch_size(batch)
}

/// Conversations of different lengths: the batch is left-padded.
fn conversations() -> Vec<Vec<ChatMessage>> {
    [
        "What is the capital of France?",
        "Name three colours.",
        "Write one sentence about a lighthouse keeper who lives alone on a small rocky island far out at sea.",
        "2+2=?",
        "List the steps to refund an order: look it up, check the policy, then what?",
    ]
    .iter()
    .map(|q| vec![ChatMessage::new("system", "You are brief."), ChatMessage::new("user", *q)])
    .collect()
}

/// Greedy, seeded sampling and a stop string (`all`), or greedy only (the slower 0.5B model).
fn check_batch_equals_one_at_a_time(model: &str, all: bool) {
    check_batch_equals_one_at_a_time_on(model, all, WeightPath::Dequantized);
}

fn check_batch_equals_one_at_a_time_on(model: &str, all: bool, path: WeightPath) {
    let conversations = conversations();
    let mut batched = generator_with(model, 4, path);
    let mut alone = generator_with(model, 1, path);
    let params = [
        GenerateParams {
            max_tokens: 24,
            ..Default::default()
        },
        GenerateParams {
            max_tokens: 16,
            temperature: 0.8,
            seed: 3,
            ..Default::default()
        },
        GenerateParams {
            max_tokens: 24,
            stop: vec![".".into()],
            ..Default::default()
        },
    ];
    let params = if all { &params[..] } else { &params[..1] };
    for params in params {
        // 5 conversations in batches of 4: a full batch (sequences leave it as they finish)
        // and a batch of one.
        let together = batched.generate_batch(&conversations, params).unwrap();
        let each: Vec<_> = conversations
            .iter()
            .map(|m| alone.generate(m, params).unwrap())
            .collect();
        assert_eq!(together, each, "{model}, {params:?}");
        assert!(
            together.iter().any(|g| g.generated_tokens > 3),
            "{together:?}"
        );
    }
    assert_eq!(
        batched.usage().calls,
        5 * params.len(),
        "every sequence is one call"
    );
}

#[test]
fn batched_generation_gives_each_conversation_its_own_reply_llama() {
    check_batch_equals_one_at_a_time("smollm2-135m-instruct-q4_1", true);
}

#[test]
fn batched_generation_gives_each_conversation_its_own_reply_qwen2() {
    check_batch_equals_one_at_a_time("qwen2.5-coder-0.5b-instruct-q4_k_m", false);
}

/// The 0.5B file's Q4_K and Q6_K matrices kept, its Q5_0 ones requantized to Q8_0: all three
/// of fluxmem's kernels, with sequences of different lengths left-padded in one batch.
#[test]
fn batched_generation_on_fluxmem_kernels_gives_each_conversation_its_own_reply() {
    if !fluxmem_models::native_kernels() {
        eprintln!("this CPU has no AVX-512 VNNI: candle's kernels run the Q8 path, not compared");
        return;
    }
    check_batch_equals_one_at_a_time_on(
        "qwen2.5-coder-0.5b-instruct-q4_k_m",
        false,
        WeightPath::Q8,
    );
}

#[test]
fn continuation_scoring_agrees_with_next_token_scoring_and_with_itself_in_a_batch() {
    let mut batched = generator("smollm2-135m-instruct-q4_1", 8);
    let context = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of France is";
    assert_eq!(
        batched.count_tokens(" Paris").unwrap(),
        1,
        "a one-token continuation"
    );
    // One token: the same log-probability as the next-token path (one sequence, last logits).
    let one = batched
        .continuation_logprobs(&[(context.to_string(), " Paris".to_string())])
        .unwrap()[0];
    let next = batched
        .next_token_logprobs(context, &[String::new()], &[" Paris"])
        .unwrap()[0][0];
    assert!((one - next).abs() < 1e-3, "{one} vs {next}");
    // Longer continuations, scored alone and in one right-padded batch with others.
    let pairs: Vec<(String, String)> = [
        (context, " Paris."),
        (context, " Berlin."),
        (context, " Paris, a city on the Seine."),
        (
            "<|im_start|>user\nBananas are",
            " yellow fruit that grow in bunches on large plants.",
        ),
        ("Hi", " there"),
    ]
    .iter()
    .map(|(c, q)| (c.to_string(), q.to_string()))
    .collect();
    let together = batched.continuation_logprobs(&pairs).unwrap();
    let mut alone = generator("smollm2-135m-instruct-q4_1", 1);
    for (pair, lp) in pairs.iter().zip(&together) {
        let single = alone
            .continuation_logprobs(std::slice::from_ref(pair))
            .unwrap()[0];
        assert!(
            (single - lp).abs() < 1e-3,
            "{pair:?}: {single} alone vs {lp} in a batch"
        );
        assert!(lp.is_finite() && *lp < 0.0);
    }
    assert_eq!(
        batched.count_tokens(" Berlin.").unwrap(),
        batched.count_tokens(" Paris.").unwrap()
    );
    assert!(
        together[0] > together[1],
        "Paris is likelier than Berlin: {together:?}"
    );
    assert!(
        batched
            .continuation_logprobs(&[(String::new(), "x".into())])
            .is_err(),
        "an empty context is refused"
    );
}

#[test]
fn judges_score_the_same_in_a_batch_and_prefer_the_passage_that_answers() {
    let query = "When did Caroline go to the LGBTQ support group?";
    let passages = [
        "Caroline: I went to a LGBTQ support group yesterday and it was so powerful.",
        "Melanie: I'm swamped with the kids & work.",
        "Melanie: We went camping last weekend with the kids, it was a lot of fun.",
    ];
    let yes_no = |batch| {
        LlmJudge::new(generator("smollm2-135m-instruct-q4_1", batch))
            .score(query, &passages)
            .unwrap()
    };
    let (batched, single) = (yes_no(8), yes_no(1));
    for (a, b) in batched.iter().zip(&single) {
        assert!((a - b).abs() < 1e-4, "{batched:?} vs {single:?}");
    }
    let mut ql = QlJudge::new(generator("smollm2-135m-instruct-q4_1", 8));
    let scores = ql.score(query, &passages).unwrap();
    assert!(scores.iter().all(|s| (0.0..=1.0).contains(s)), "{scores:?}");
    assert!(
        scores[0] > scores[1] && scores[0] > scores[2],
        "the answering passage lifts the query most: {scores:?}"
    );
    let mut ql_single = QlJudge::new(generator("smollm2-135m-instruct-q4_1", 1));
    for (a, b) in scores
        .iter()
        .zip(ql_single.score(query, &passages).unwrap())
    {
        assert!((a - b).abs() < 1e-4);
    }
}
