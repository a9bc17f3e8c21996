//! The GGUF generator and the judge on the real SmolLM2-135M-Instruct checkpoint. Needs
//! `fluxmem models fetch smollm2-135m-instruct-q4_1` (scripts/test.sh does it); a missing model
//! fails with that command.

use fluxmem_models::{
    ChatMessage, DeviceChoice, GenerateParams, Generator, Judge, LlmJudge, WeightPath,
};

fn generator(path: WeightPath) -> fluxmem_models::GgufGenerator {
    fluxmem_models::load_generator("smollm2-135m-instruct-q4_1", &DeviceChoice::Cpu, path)
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn tokenizer_from_gguf_round_trips_and_keeps_special_tokens_whole() {
    let generator = generator(WeightPath::Quantized);
    let prompt = generator.chat_prompt(&[ChatMessage::new("user", "hi")]);
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        generator.count_tokens("<|im_start|>").unwrap(),
        1,
        "control tokens stay whole"
    );
    assert_eq!(generator.count_tokens("<|im_end|>").unwrap(), 1);
    let tokenizer = generator.tokenizer();
    for text in [
        prompt.as_str(),
        "Émojis 🚀, café and 東京 at 10:45!",
        "  two  spaces\n\ttab",
    ] {
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(
            tokenizer.decode(&ids, false).unwrap(),
            text,
            "byte-level BPE round trip"
        );
    }
    // Digits are split one by one, as SmolLM2's reference tokenizer does.
    assert_eq!(generator.count_tokens("2024").unwrap(), 4);
    // No prefix space is added: "Hello" is one token, like " Hello" but a different one.
    assert_eq!(generator.count_tokens("Hello").unwrap(), 1);
}

#[test]
fn greedy_generation_is_deterministic_and_stops_at_end_of_turn() {
    let mut generator = generator(WeightPath::Dequantized);
    let messages = [ChatMessage::new(
        "user",
        "What is the capital of France? Answer in one sentence.",
    )];
    let params = GenerateParams {
        max_tokens: 40,
        ..GenerateParams::default()
    };
    let first = generator.generate(&messages, &params).unwrap();
    let second = generator.generate(&messages, &params).unwrap();
    assert_eq!(first, second);
    assert_eq!(first.finish, "stop");
    assert!(first.text.contains("Paris"), "{first:?}");
    let sampled = GenerateParams {
        temperature: 0.9,
        seed: 7,
        max_tokens: 20,
        ..GenerateParams::default()
    };
    assert_eq!(
        generator.generate(&messages, &sampled).unwrap(),
        generator.generate(&messages, &sampled).unwrap(),
        "seeded sampling repeats"
    );
    let stopped = GenerateParams {
        stop: vec!["capital".into()],
        ..params
    };
    assert!(!generator
        .generate(&messages, &stopped)
        .unwrap()
        .text
        .contains("capital"));
    assert_eq!(generator.usage().calls, 5);
}

#[test]
fn dequantized_weights_give_the_same_next_token_distribution() {
    let prefix = "<|im_start|>user\nName a primary colour.";
    let suffixes = vec!["<|im_end|>\n<|im_start|>assistant\n".to_string()];
    let options = ["Red", "Blue", "The", "Yellow"];
    let quantized = generator(WeightPath::Quantized)
        .next_token_logprobs(prefix, &suffixes, &options)
        .unwrap();
    let dense = generator(WeightPath::Dequantized)
        .next_token_logprobs(prefix, &suffixes, &options)
        .unwrap();
    // The quantized path also quantizes activations to 8 bits for its dot products, so the
    // two paths agree closely but not exactly.
    for (q, d) in quantized[0].iter().zip(&dense[0]) {
        assert!((q - d).abs() < 0.3, "log-probs {quantized:?} vs {dense:?}");
    }
    let argmax = |v: &Vec<f32>| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    assert_eq!(argmax(&quantized[0]), argmax(&dense[0]));
}

#[test]
fn shared_prefix_scoring_equals_scoring_each_prompt_whole() {
    let mut generator = generator(WeightPath::Dequantized);
    let prefix = "<|im_start|>user\nQuestion: where is the Eiffel tower?\nPassage:\n";
    let suffixes: Vec<String> = ["It stands in Paris.", "Bananas are yellow."]
        .iter()
        .map(|p| format!("{p}\nUseful? Answer yes or no.<|im_end|>\n<|im_start|>assistant\n"))
        .collect();
    let shared = generator
        .next_token_logprobs(prefix, &suffixes, &["yes", "no"])
        .unwrap();
    for (suffix, shared) in suffixes.iter().zip(&shared) {
        let whole = generator
            .next_token_logprobs("", &[format!("{prefix}{suffix}")], &["yes", "no"])
            .unwrap();
        for (a, b) in shared.iter().zip(&whole[0]) {
            assert!((a - b).abs() < 0.05, "{shared:?} vs {whole:?}");
        }
    }
}

#[test]
fn judge_prefers_the_passage_that_answers() {
    let mut judge = LlmJudge::new(generator(WeightPath::Dequantized));
    let scores = judge
        .score(
            "When did Caroline go to the LGBTQ support group?",
            &[
                "Caroline: I went to a LGBTQ support group yesterday and it was so powerful.",
                "Melanie: I'm swamped with the kids & work.",
            ],
        )
        .unwrap();
    assert!(scores.iter().all(|s| (0.0..=1.0).contains(s)));
    assert!(scores[0] > scores[1], "{scores:?}");
    let usage = judge.usage();
    assert_eq!(usage.calls, 2);
    assert!(usage.cached_tokens > 0, "the query prefix is shared");
}

#[test]
fn gemma3_sentencepiece_tokenizer_from_gguf() {
    let generator = fluxmem_models::load_generator(
        "gemma3-270m-q4_k_m",
        &DeviceChoice::Cpu,
        WeightPath::Quantized,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let prompt = generator.chat_prompt(&[
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "hi"),
    ]);
    assert_eq!(
        prompt,
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    );
    for special in ["<bos>", "<start_of_turn>", "<end_of_turn>"] {
        assert_eq!(
            generator.count_tokens(special).unwrap(),
            1,
            "{special} is one token"
        );
    }
    assert_eq!(
        generator.count_tokens("Hello world").unwrap(),
        2,
        "`Hello` `▁world`"
    );
    let tokenizer = generator.tokenizer();
    for text in [
        prompt.as_str(),
        "Émojis 🚀, café and 東京 at 10:45!",
        "  two  spaces\n\ttab",
    ] {
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(
            tokenizer.decode(&ids, false).unwrap(),
            text,
            "SentencePiece round trip"
        );
    }
}
