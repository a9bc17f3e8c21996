//! The qwen2 architecture on the real Qwen2.5-Coder-0.5B-Instruct checkpoint (Q4_K_M). Needs
//! `fluxmem models fetch qwen2.5-coder-0.5b-instruct-q4_k_m` (scripts/test.sh does it); a
//! missing model fails with that command.

use fluxmem_models::{ChatMessage, DeviceChoice, GenerateParams, Generator, WeightPath};

const MODEL: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";

fn generator(path: WeightPath) -> fluxmem_models::GgufGenerator {
    fluxmem_models::load_generator(MODEL, &DeviceChoice::Cpu, path)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The tokenizer built from the GGUF metadata (qwen2 pre-tokenizer) gives exactly the ids
/// llama.cpp gives for the same file. Reference ids from llama-cpp-python 0.3.36:
/// `Llama(model_path=..., vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)`.
#[test]
fn qwen2_tokenizer_matches_llama_cpp() {
    let generator = generator(WeightPath::Quantized);
    let tokenizer = generator.tokenizer();
    let cases: [(&str, &[u32]); 6] = [
        ("Hello world", &[9707, 1879]),
        (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
            &[151644, 8948, 198, 3430, 9814, 13, 151645, 198, 151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198],
        ),
        (
            "Émojis 🚀, café and 東京 at 10:45!",
            &[26789, 6355, 82726, 11162, 248, 222, 11, 51950, 323, 60596, 109, 46553, 518, 220, 16, 15, 25, 19, 20, 0],
        ),
        ("  two  spaces\n\ttab\n\n\nend", &[220, 1378, 220, 12621, 198, 58149, 1406, 408]),
        (
            "I'm sure they'll call get_reservation_details(reservation_id='ZFA04Y') for $1,234.56.",
            &[40, 2776, 2704, 807, 3278, 1618, 633, 96548, 13260, 4590, 8768, 842, 1131, 57, 3627, 15, 19, 56, 863, 369, 400, 16, 11, 17, 18, 19, 13, 20, 21, 13],
        ),
        ("don't DON'T We've 12345 x=y+1;", &[15007, 944, 44273, 17323, 1205, 3003, 220, 16, 17, 18, 19, 20, 856, 29368, 10, 16, 26]),
    ];
    for (text, expected) in cases {
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(ids, expected, "tokens of {text:?}");
        assert_eq!(
            tokenizer.decode(&ids, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
    }
}

/// ChatML, greedy decoding that stops at `<|im_end|>`, and an answer a 0.5B instruct model
/// gets right; the same on Q8_0 weights.
#[test]
fn qwen2_generates_a_correct_answer_and_stops_at_end_of_turn() {
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new(
            "user",
            "What is the capital of France? Answer in one sentence.",
        ),
    ];
    let params = GenerateParams {
        max_tokens: 40,
        ..Default::default()
    };
    for path in [WeightPath::Quantized, WeightPath::Q8] {
        let mut generator = generator(path);
        assert_eq!(
            generator.chat_prompt(&messages[1..]),
            "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"
        );
        let first = generator.generate(&messages, &params).unwrap();
        assert_eq!(first.finish, "stop", "{path:?}: {:?}", first.text);
        assert!(first.text.contains("Paris"), "{path:?}: {:?}", first.text);
        let again = generator.generate(&messages, &params).unwrap();
        assert_eq!(first, again, "{path:?}: greedy decoding is deterministic");
    }
}

/// Scoring with a shared prefix (the prefix run once, its KV cache forked per suffix) gives the
/// same next-token distribution as running each prompt whole. On f32 weights (the judge's
/// path) the two agree to 1e-3; on the file's Q4_K weights candle's quantized kernels round
/// differently for different row counts (0.06 apart in log-probability here), so that path is
/// not compared. The prefix ends at a token boundary (a newline), as the judge's prompts do.
#[test]
fn qwen2_shared_prefix_scoring_equals_scoring_each_prompt_whole() {
    let mut generator = generator(WeightPath::Dequantized);
    let prefix = "<|im_start|>user\nIs the sky blue on a clear day?\nPassage:\n";
    let suffixes = vec![
        "Clear skies look blue.<|im_end|>\n<|im_start|>assistant\n".to_string(),
        "Grass is green.<|im_end|>\n<|im_start|>assistant\n".to_string(),
    ];
    let shared = generator
        .next_token_logprobs(prefix, &suffixes, &["Yes", "No"])
        .unwrap();
    for (suffix, scores) in suffixes.iter().zip(&shared) {
        let whole = generator
            .next_token_logprobs("", &[format!("{prefix}{suffix}")], &["Yes", "No"])
            .unwrap();
        for (a, b) in scores.iter().zip(&whole[0]) {
            assert!((a - b).abs() < 1e-3, "shared {a} vs whole {b}");
        }
    }
}

/// The 1.5B checkpoint (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M as shipped) loads, shares the
/// 0.5B's tokenizer and answers correctly.
#[test]
fn qwen2_1_5b_generates_a_correct_answer() {
    let mut generator = fluxmem_models::load_generator(
        "qwen2.5-coder-1.5b-instruct-q4_k_m",
        &DeviceChoice::Cpu,
        WeightPath::Quantized,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let ids = generator
        .tokenizer()
        .encode("Hello world", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids, [9707, 1879]);
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new(
            "user",
            "What is the capital of France? Answer in one sentence.",
        ),
    ];
    let answer = generator
        .generate(
            &messages,
            &GenerateParams {
                max_tokens: 40,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(answer.finish, "stop", "{:?}", answer.text);
    assert!(answer.text.contains("Paris"), "{:?}", answer.text);
}
