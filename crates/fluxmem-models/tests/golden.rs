//! The candle embedder against vectors from the Python reference (sentence-transformers),
//! committed in `tests/data/golden/`. Needs the model installed: `fluxmem models fetch
//! all-minilm-l6-v2` (scripts/test.sh does it); a missing model fails with that command.

use fluxmem_models::{cosine, BertBackend, DeviceChoice, Embedder, SentenceEmbedder};
use serde_json::Value;

fn golden() -> (Vec<String>, Vec<Vec<f32>>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/golden/all-minilm-l6-v2.json"
    );
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let sentences = data["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    let vectors = data["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    (sentences, vectors)
}

fn device() -> DeviceChoice {
    std::env::var("FLUXMEM_TEST_DEVICE")
        .unwrap_or_else(|_| "cpu".into())
        .parse::<DeviceChoice>()
        .unwrap()
}

/// The default embedder of the test device (on the CPU: the native forward).
fn embedder(batch_size: usize) -> SentenceEmbedder {
    fluxmem_models::load_embedder(fluxmem_models::DEFAULT_EMBEDDER, &device())
        .unwrap_or_else(|e| panic!("{e}"))
        .with_batch_size(batch_size)
}

/// Every forward pass the test device runs: on the CPU the native one (with its best kernel),
/// the native one with the AVX2 kernel (x86-64 CPUs with AVX2 and FMA), the native one with
/// portable kernels, and candle's.
fn backends() -> Vec<BertBackend> {
    if matches!(device(), DeviceChoice::Cpu) {
        let mut all = vec![BertBackend::Native];
        if has_avx2() {
            all.push(BertBackend::NativeAvx2);
        }
        all.extend([BertBackend::NativePortable, BertBackend::Candle]);
        all
    } else {
        vec![BertBackend::Candle]
    }
}

fn embedder_with(backend: BertBackend, batch_size: usize) -> SentenceEmbedder {
    fluxmem_models::load_embedder_with(fluxmem_models::DEFAULT_EMBEDDER, &device(), backend)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_batch_size(batch_size)
}

#[test]
fn the_cpu_default_is_the_native_forward() {
    if matches!(device(), DeviceChoice::Cpu) {
        let embedder = embedder(32);
        assert_eq!(embedder.backend(), BertBackend::Native);
        assert_ne!(embedder.kernel(), "candle");
        let portable = embedder_with(BertBackend::NativePortable, 32);
        assert_eq!(
            (portable.backend(), portable.kernel()),
            (BertBackend::NativePortable, "gemm")
        );
        if has_avx2() {
            assert_ne!(
                embedder.kernel(),
                "gemm",
                "a CPU with AVX2 and FMA runs fluxmem's kernel"
            );
            assert_eq!(embedder_with(BertBackend::NativeAvx2, 32).kernel(), "avx2");
        }
    }
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The AVX2 and the AVX-512 kernel compute each output as the same fused multiply-add chain:
/// the same vectors to the bit, so stores embedded on either kind of CPU agree. (On a CPU
/// without AVX-512 the default runs the AVX2 kernel, and the two are trivially equal.)
#[test]
fn the_avx2_kernel_gives_the_default_kernels_bits() {
    if !matches!(device(), DeviceChoice::Cpu) || !has_avx2() {
        return;
    }
    let (sentences, _) = golden();
    let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let default = embedder(5);
    let avx2 = embedder_with(BertBackend::NativeAvx2, 5);
    assert_eq!(
        (default.backend(), avx2.backend()),
        (BertBackend::Native, BertBackend::NativeAvx2)
    );
    assert_eq!(
        default.embed(&refs).unwrap(),
        avx2.embed(&refs).unwrap(),
        "{} vs avx2",
        default.kernel()
    );
}

#[test]
fn matches_sentence_transformers_reference() {
    let (sentences, expected) = golden();
    let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();
    for backend in backends() {
        for batch_size in [1, 5, 32] {
            let got = embedder_with(backend, batch_size).embed(&refs).unwrap();
            assert_eq!(got.len(), expected.len());
            for ((sentence, got), want) in sentences.iter().zip(&got).zip(&expected) {
                assert_eq!(got.len(), 384);
                let similarity = cosine(got, want);
                assert!(
                    similarity >= 0.9999,
                    "{backend:?}: cosine {similarity} for {sentence:?} at batch size {batch_size}"
                );
                let max_diff = got
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    max_diff < 1e-4,
                    "{backend:?}: max abs diff {max_diff} for {sentence:?}"
                );
            }
        }
    }
}

#[test]
fn counts_tokens_without_truncation_and_truncates_embedding_input() {
    let embedder = embedder(32);
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    assert!(embedder.count_tokens(&long).unwrap() > 500);
    assert_eq!(embedder.count_tokens("hello world").unwrap(), 2);
    let ids = embedder.tokenize(&[&long]).unwrap();
    assert_eq!(
        ids[0].len(),
        embedder.max_len(),
        "input truncated at the model's max length"
    );
    assert_eq!(embedder.max_len(), 256);
}

/// A text's vector depends on the text alone, bit for bit: alone, among batch-mates of other
/// lengths (which used to change its padding), at any batch size and position. This is what
/// lets a sharded embed stage (each shard batching a different subset) equal the unsharded run.
#[test]
fn a_vector_does_not_depend_on_its_batch_mates() {
    let (sentences, _) = golden();
    let mut texts: Vec<String> = sentences.clone();
    texts.push("A much longer text than the others, so that a batch padded to its longest member would pad every short text far beyond its own length, which changes the reduction lengths in attention and pooling.".into());
    texts.push("ok".into());
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    for backend in backends() {
        let single = embedder_with(backend, 32);
        let alone: Vec<Vec<f32>> = refs
            .iter()
            .map(|t| single.embed(&[t]).unwrap().remove(0))
            .collect();
        for batch_size in [1, 3, 32] {
            let together = embedder_with(backend, batch_size).embed(&refs).unwrap();
            for ((text, a), b) in refs.iter().zip(&alone).zip(&together) {
                let same_bits = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same_bits, "{backend:?}: {text:?} alone differs from its vector in a batch of {batch_size}");
            }
        }
        let mut reversed = refs.clone();
        reversed.reverse();
        let back = embedder_with(backend, 4).embed(&reversed).unwrap();
        for (a, b) in alone.iter().rev().zip(&back) {
            assert_eq!(a, b, "{backend:?}: order of the input does not matter");
        }
    }
}

#[test]
fn bucket_lengths_depend_on_the_text_only() {
    use fluxmem_models::{bucket_len, PAD_BUCKET};
    assert_eq!(PAD_BUCKET, 16);
    assert_eq!(bucket_len(1, 256), 16);
    assert_eq!(bucket_len(16, 256), 16);
    assert_eq!(bucket_len(17, 256), 32);
    assert_eq!(bucket_len(256, 256), 256);
    assert_eq!(bucket_len(250, 250), 250, "capped at the max length");
}
