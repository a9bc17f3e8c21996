//! Writes `run.json` and `report.html` of a realistic sample run into the given directory.
//!
//! ```text
//! cargo run --example sample_report -- /tmp/report
//! ```

use fluxmem_report::{
    write_report, PemsSummary, QuarantineSample, QuarantineSummary, RunRecord, SkillSummary,
    StageRecord, UsageRecord,
};
use std::collections::BTreeMap;

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs
        .iter()
        .map(|(kind, value)| (kind.to_string(), *value))
        .collect()
}

fn stage(
    name: &str,
    status: &str,
    seconds: f64,
    counts_in: &[(&str, u64)],
    counts_out: &[(&str, u64)],
) -> StageRecord {
    StageRecord {
        name: name.into(),
        status: status.into(),
        seconds,
        counts_in: counts(counts_in),
        counts_out: counts(counts_out),
        details: serde_json::json!({ "stage": name, "run_id": "night-2026-05-01" }),
    }
}

/// A content-hash-like id: `prefix` and 32 hex digits derived from `seed` (SplitMix64).
fn hash_id(prefix: &str, seed: u64) -> String {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    format!("{prefix}-{:016x}{:016x}", mix(seed), mix(seed ^ 0xfeed))
}

fn skill(
    index: usize,
    name: &str,
    description: &str,
    history: &[f64],
    support: u64,
) -> SkillSummary {
    SkillSummary {
        id: hash_id("pro", index as u64),
        name: name.into(),
        description: description.into(),
        version: 1 + (index as i64 % 3),
        pems: history.iter().copied().fold(0.0, f64::max),
        support,
        pems_history: history.to_vec(),
        source_episodes: (0..support)
            .map(|episode| hash_id("epi", 1000 + index as u64 * 100 + episode))
            .collect(),
    }
}

/// A night over a small store: six stages, some quarantined records, a PEMS loop of five rounds.
fn sample() -> RunRecord {
    let skills = vec![
        skill(
            0,
            "Book a flight with a layover check",
            "Search, compare layovers, confirm with the user, then book.",
            &[0.142, 0.171, 0.183, 0.186],
            9,
        ),
        skill(
            1,
            "Refund a <damaged> item & notify",
            "Verify the order, check \"damaged\" policy, refund, send a note.",
            &[0.120, 0.158, 0.166],
            7,
        ),
        skill(
            2,
            "Change a reservation's passengers",
            "Look up the reservation, check fare rules, update, confirm.",
            &[0.131, 0.149, 0.152],
            6,
        ),
        skill(
            3,
            "Heat an object in the microwave",
            "Find the object, take it, open the microwave, heat it, put it back.",
            &[0.101, 0.133, 0.147, 0.150],
            12,
        ),
        skill(
            4,
            "<script>alert(1)</script> & \"quotes\"",
            "A skill name written by a small LLM with markup in it.",
            &[0.094, 0.118, 0.121],
            4,
        ),
        skill(
            5,
            "Clean a mug and put it in the cabinet",
            "Go to the sink, clean the mug, open the cabinet, put the mug inside.",
            &[0.088, 0.109, 0.112],
            5,
        ),
    ];
    RunRecord {
        pipeline: "pipelines/demo.toml".into(),
        run_id: "night-2026-05-01".into(),
        started_at: "2026-05-01T02:00:00Z".into(),
        finished_at: "2026-05-01T02:07:41Z".into(),
        status: "partial".into(),
        redacted: [("email".to_string(), 3)].into_iter().collect(),
        reasons: vec!["ingest: 17 records quarantined".into()],
        store: "/var/lib/fluxmem/store".into(),
        manifest_version_before: 41,
        manifest_version_after: 49,
        models: [
            ("embedder", "all-MiniLM-L6-v2@c9745ed"),
            ("generator", "qwen2.5-0.5b-instruct-q4_k_m@9217f5d"),
            ("judge", "qwen2.5-0.5b-instruct-q4_k_m@9217f5d"),
        ]
        .into_iter()
        .map(|(role, model)| (role.to_string(), model.to_string()))
        .collect(),
        compaction: None,
        indexes: None,
        stages: vec![
            stage(
                "ingest",
                "done",
                4.82,
                &[("files", 14), ("records", 1_204)],
                &[("nodes", 1_187), ("quarantined", 17)],
            ),
            stage(
                "embed",
                "done",
                61.3,
                &[("nodes", 1_187)],
                &[("embeddings", 1_160), ("cache hits", 27)],
            ),
            stage(
                "connect",
                "done",
                38.75,
                &[("episodes", 312)],
                &[("ground edges", 2_904), ("link edges", 1_248)],
            ),
            stage("refine", "nothing new", 0.41, &[("episodes", 0)], &[]),
            stage(
                "consolidate",
                "done",
                312.6,
                &[("episodes", 312), ("clusters", 12)],
                &[("skills", 12), ("versions", 4)],
            ),
            stage("export", "done", 0.93, &[("skills", 12)], &[("files", 14)]),
        ],
        quarantine: QuarantineSummary {
            records: 17,
            files: vec!["/var/lib/fluxmem/store/quarantine/night-2026-05-01.jsonl".into()],
            by_reason: counts(&[("missing field", 9), ("bad timestamp", 5), ("not JSON", 3)]),
            samples: vec![
                QuarantineSample {
                    file: "logs/2026-04-30/agent-a.jsonl".into(),
                    line: Some(88),
                    field: "task".into(),
                    reason: "missing field `task`".into(),
                },
                QuarantineSample {
                    file: "logs/2026-04-30/agent-b.jsonl".into(),
                    line: Some(3),
                    field: "timestamp".into(),
                    reason: "bad timestamp `yesterday`".into(),
                },
                QuarantineSample {
                    file: "logs/2026-04-30/notes.md".into(),
                    line: None,
                    field: "<body>".into(),
                    reason: "not JSON: expected value at line 1 column 1".into(),
                },
            ],
        },
        model_usage: [
            (
                "generator",
                UsageRecord {
                    calls: 58,
                    prompt_tokens: 96_410,
                    generated_tokens: 11_872,
                },
            ),
            (
                "judge",
                UsageRecord {
                    calls: 384,
                    prompt_tokens: 201_336,
                    generated_tokens: 384,
                },
            ),
            (
                "verifier",
                UsageRecord {
                    calls: 0,
                    prompt_tokens: 0,
                    generated_tokens: 0,
                },
            ),
        ]
        .into_iter()
        .map(|(role, usage)| (role.to_string(), usage))
        .collect(),
        pems: Some(PemsSummary {
            skills: 12,
            mean_by_round: vec![0.112, 0.139, 0.151, 0.155, 0.156],
            converged_by_round: vec![0, 2, 7, 10, 12],
            cluster_sizes: vec![41, 36, 33, 31, 28, 27, 24, 22, 21, 19, 16, 14],
            top_skills: skills,
        }),
        outputs: vec![
            "/var/lib/fluxmem/export/night-2026-05-01".into(),
            "/var/lib/fluxmem/runs/night-2026-05-01/run.json".into(),
            "/var/lib/fluxmem/runs/night-2026-05-01/report.html".into(),
        ],
    }
}

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: sample_report DIR");
        std::process::exit(2);
    };
    match write_report(std::path::Path::new(&dir), &sample()) {
        Ok((json, html)) => println!("{}\n{}", json.display(), html.display()),
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    }
}
