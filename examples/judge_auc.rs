//! How well the LLM judge separates LoCoMo evidence turns from other turns of the same
//! conversation among the top dense candidates, next to plain MiniLM cosine (ROC AUC).
//!
//! cargo run --example judge_auc -- LOCOMO_JSON [--questions N] [--candidates K] [--seed S] [--weights prompts|dequantized|quantized|q8] [--model NAME] [--judges yesno,ql] [--batch B]
//!
//! Judges: `yesno` (`LlmJudge`, P(yes) of the first answer token) and `ql` (`QlJudge`, query
//! likelihood: log P(question | turn) - log P(question) per token).
//!
//! Questions of categories 1-4 with resolvable evidence are sampled with a seeded shuffle; for
//! each, the K turns of its conversation with the highest cosine to the question are the
//! candidates, labelled by whether they are evidence. Labels are used only to score.

use fluxmem_models::{cosine, DeviceChoice, Embedder, Judge, LlmJudge, QlJudge, WeightPath};
use serde_json::Value;
use std::collections::HashMap;

fn main() -> anyhow::Result<()> {
    // As the fluxmem binary does (before any thread starts).
    fluxmem_models::tune_thread_pool();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().ok_or_else(|| {
        anyhow::anyhow!("usage: judge_auc LOCOMO_JSON [--questions N] [--candidates K]")
    })?;
    let flag = |name: &str, default: &str| -> String {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| default.to_string())
    };
    let questions: usize = flag("--questions", "40").parse()?;
    let k: usize = flag("--candidates", "10").parse()?;
    let seed: u64 = flag("--seed", "7").parse()?;
    // The judges' own default (`prompts`) unless asked for another.
    let weights = match flag("--weights", "prompts").as_str() {
        "quantized" => WeightPath::Quantized,
        "q8" => WeightPath::Q8,
        "dequantized" => WeightPath::Dequantized,
        "prompts" => WeightPath::Prompts,
        other => anyhow::bail!("--weights {other}: one of prompts, dequantized, quantized, q8"),
    };
    let batch: usize = flag("--batch", &fluxmem_models::DEFAULT_BATCH.to_string()).parse()?;
    let data: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path)?)?;

    let embedder =
        fluxmem_models::load_embedder(fluxmem_models::DEFAULT_EMBEDDER, &DeviceChoice::Cpu)?;
    let model_name = flag("--model", fluxmem_models::DEFAULT_JUDGE);
    let mut judges: Vec<(String, Box<dyn Judge>)> = Vec::new();
    for name in flag("--judges", "yesno,ql").split(',') {
        let generator = fluxmem_models::load_generator(&model_name, &DeviceChoice::Cpu, weights)?
            .with_batch_size(batch);
        let model = fluxmem_models::Generator::model_id(&generator).to_string();
        match name {
            "yesno" => judges.push((
                format!("yes/no judge ({model}, {weights:?})"),
                Box::new(LlmJudge::new(generator)),
            )),
            "ql" => judges.push((
                format!("query likelihood ({model}, {weights:?})"),
                Box::new(QlJudge::new(generator)),
            )),
            other => anyhow::bail!("unknown judge `{other}` (yesno, ql)"),
        }
    }

    // (question, conversation index, evidence ids)
    let mut items: Vec<(String, usize, Vec<String>)> = Vec::new();
    let mut turns: Vec<Vec<(String, String)>> = Vec::new(); // per conversation: (dia_id, text)
    for (c, conversation) in data.iter().enumerate() {
        let sessions = conversation["conversation"].as_object().unwrap();
        let mut list = Vec::new();
        let mut keys: Vec<(u32, &Value)> = sessions
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("session_")?.parse().ok()?, v)))
            .filter(|(_, v)| v.is_array())
            .collect();
        keys.sort_by_key(|(n, _)| *n);
        for (_, session) in keys {
            for turn in session.as_array().unwrap() {
                let mut text = format!(
                    "{}: {}",
                    turn["speaker"].as_str().unwrap_or(""),
                    turn["text"].as_str().unwrap_or("")
                );
                if let Some(caption) = turn["blip_caption"].as_str() {
                    text.push_str(&format!(" [shares a photo: {caption}]"));
                }
                list.push((turn["dia_id"].as_str().unwrap_or("").to_string(), text));
            }
        }
        let ids: std::collections::HashSet<&str> = list.iter().map(|(id, _)| id.as_str()).collect();
        for qa in conversation["qa"].as_array().unwrap() {
            let category = qa["category"].as_u64().unwrap_or(0);
            let evidence: Vec<String> = qa["evidence"]
                .as_array()
                .map(|e| {
                    e.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            if (1..=4).contains(&category)
                && !evidence.is_empty()
                && evidence.iter().all(|e| ids.contains(e.as_str()))
            {
                items.push((
                    qa["question"].as_str().unwrap_or("").to_string(),
                    c,
                    evidence,
                ));
            }
        }
        turns.push(list);
    }
    // Seeded Fisher-Yates with a small LCG: the same seed always picks the same questions.
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    for i in (1..items.len()).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        items.swap(i, (state >> 33) as usize % (i + 1));
    }
    items.truncate(questions);

    let mut vectors: HashMap<usize, Vec<Vec<f32>>> = HashMap::new();
    let mut cosine_scores = Vec::new();
    let mut judge_scores: Vec<Vec<f32>> = vec![Vec::new(); judges.len()];
    let mut seconds = vec![0f64; judges.len()];
    let mut labels = Vec::new();
    for (question, c, evidence) in &items {
        let conversation = &turns[*c];
        let turn_vectors = match vectors.get(c) {
            Some(v) => v,
            None => {
                let texts: Vec<&str> = conversation.iter().map(|(_, t)| t.as_str()).collect();
                vectors.insert(*c, embedder.embed(&texts)?);
                &vectors[c]
            }
        };
        let q = embedder.embed(&[question.as_str()])?.remove(0);
        let mut ranked: Vec<(usize, f32)> = turn_vectors
            .iter()
            .enumerate()
            .map(|(i, v)| (i, cosine(&q, v)))
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked.truncate(k);
        let passages: Vec<&str> = ranked
            .iter()
            .map(|(i, _)| conversation[*i].1.as_str())
            .collect();
        for (j, (_, judge)) in judges.iter_mut().enumerate() {
            let started = std::time::Instant::now();
            judge_scores[j].extend(judge.score(question, &passages)?);
            seconds[j] += started.elapsed().as_secs_f64();
        }
        for (i, cos) in &ranked {
            labels.push(evidence.contains(&conversation[*i].0));
            cosine_scores.push(*cos);
        }
    }
    let positives = labels.iter().filter(|l| **l).count();
    println!(
        "{} questions x top-{k} dense candidates: {} pairs, {positives} evidence (batch {batch})",
        items.len(),
        labels.len()
    );
    println!("{:<56} {:>8} {:>10}", "scorer", "ROC AUC", "pairs/s");
    println!(
        "{:<56} {:>8.3} {:>10}",
        "MiniLM cosine",
        auc(&cosine_scores, &labels),
        ""
    );
    for (j, (name, judge)) in judges.iter().enumerate() {
        println!(
            "{name:<56} {:>8.3} {:>10.2}",
            auc(&judge_scores[j], &labels),
            labels.len() as f64 / seconds[j]
        );
        let blend: Vec<f32> = cosine_scores
            .iter()
            .zip(&judge_scores[j])
            .map(|(c, s)| c + 0.3 * s)
            .collect();
        println!(
            "{:<56} {:>8.3} {:>10}",
            "  cosine + 0.3 x that judge",
            auc(&blend, &labels),
            ""
        );
        let usage = judge.usage();
        println!(
            "  {} calls, {} prompt tokens run + {} served from a shared prefix, {:.1}s",
            usage.calls, usage.prompt_tokens, usage.cached_tokens, seconds[j]
        );
    }
    Ok(())
}

/// ROC AUC of `scores` against `labels` ([`fluxmem_eval::metrics::auc`]; NaN without both).
fn auc(scores: &[f32], labels: &[bool]) -> f64 {
    let positives: Vec<f32> = scores
        .iter()
        .zip(labels)
        .filter(|(_, l)| **l)
        .map(|(s, _)| *s)
        .collect();
    let negatives: Vec<f32> = scores
        .iter()
        .zip(labels)
        .filter(|(_, l)| !**l)
        .map(|(s, _)| *s)
        .collect();
    fluxmem_eval::metrics::auc(&positives, &negatives).unwrap_or(f64::NAN)
}
