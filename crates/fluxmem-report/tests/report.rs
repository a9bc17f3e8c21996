//! The report end to end: escaping, charts, empty records, degraded runs and their reasons,
//! run.json round trip (and older run.json files), atomic writes.

use fluxmem_report::{
    render_html, write_report, PemsSummary, QuarantineSample, QuarantineSummary, RunRecord,
    SkillSummary, StageRecord, UsageRecord,
};
use std::collections::BTreeMap;

const HOSTILE: &str = "<script>alert(1)</script> & \"quotes\"";

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs
        .iter()
        .map(|(kind, value)| (kind.to_string(), *value))
        .collect()
}

fn stage(
    name: &str,
    seconds: f64,
    counts_in: &[(&str, u64)],
    counts_out: &[(&str, u64)],
) -> StageRecord {
    StageRecord {
        name: name.into(),
        status: "done".into(),
        seconds,
        counts_in: counts(counts_in),
        counts_out: counts(counts_out),
        details: serde_json::json!({ "note": format!("{name} says {HOSTILE}") }),
    }
}

fn realistic() -> RunRecord {
    RunRecord {
        pipeline: "pipelines/demo.toml".into(),
        run_id: "night-7".into(),
        started_at: "2026-05-01T02:00:00Z".into(),
        finished_at: "2026-05-01T02:05:30Z".into(),
        status: "partial".into(),
        reasons: vec!["ingest: 21 records quarantined".into()],
        redacted: [("card".to_string(), 1), ("email".to_string(), 2)]
            .into_iter()
            .collect(),
        store: "store".into(),
        manifest_version_before: 3,
        manifest_version_after: 9,
        models: [
            ("embedder", "all-MiniLM-L6-v2@main"),
            ("generator", "qwen@main"),
        ]
        .into_iter()
        .map(|(role, model)| (role.to_string(), model.to_string()))
        .collect(),
        compaction: None,
        indexes: None,
        stages: vec![
            stage("ingest", 2.5, &[("records", 4321)], &[("nodes", 4300)]),
            stage("embed", 40.25, &[("nodes", 4300)], &[("embeddings", 4299)]),
            stage(
                "connect",
                12.0,
                &[("episodes", 210)],
                &[("ground edges", 1617)],
            ),
            stage("consolidate", 95.5, &[("episodes", 210)], &[("skills", 8)]),
        ],
        quarantine: QuarantineSummary {
            records: 21,
            files: vec!["store/quarantine/night-7.jsonl".into()],
            by_reason: counts(&[("missing field", 20), (HOSTILE, 1)]),
            samples: vec![QuarantineSample {
                file: "logs/a.jsonl".into(),
                line: Some(42),
                field: "task".into(),
                reason: "missing field `task`".into(),
            }],
        },
        model_usage: [(
            "generator".to_string(),
            UsageRecord {
                calls: 30,
                prompt_tokens: 123_456,
                generated_tokens: 7890,
            },
        )]
        .into_iter()
        .collect(),
        pems: Some(PemsSummary {
            skills: 8,
            mean_by_round: vec![0.11, 0.14, 0.15],
            converged_by_round: vec![1, 5, 8],
            cluster_sizes: vec![40, 31, 30, 25, 24, 22, 20, 18],
            top_skills: vec![
                SkillSummary {
                    id: "pro-1".into(),
                    name: HOSTILE.into(),
                    description: "desc with <b>bold</b> & 'apostrophes'".into(),
                    version: 2,
                    pems: 0.187,
                    support: 9,
                    pems_history: vec![0.12, 0.15, 0.187],
                    source_episodes: (0..9).map(|i| format!("epi-{i:02}")).collect(),
                },
                SkillSummary {
                    id: "pro-2".into(),
                    name: "Book a flight".into(),
                    description: "Search, compare, book.".into(),
                    version: 1,
                    pems: 0.15,
                    support: 3,
                    pems_history: vec![0.15],
                    source_episodes: vec!["epi-a".into(), "epi-b".into(), "epi-c".into()],
                },
            ],
        }),
        outputs: vec![
            "export/night-7".into(),
            "runs/night-7/run.json".into(),
            "runs/night-7/report.html".into(),
        ],
    }
}

/// Every `http://` or `https://` in the page, except the SVG namespace.
fn external_references(html: &str) -> Vec<String> {
    let svg_namespace = "http://www.w3.org/2000/svg";
    let mut found = Vec::new();
    for scheme in ["http://", "https://"] {
        for (at, _) in html.match_indices(scheme) {
            if !html[at..].starts_with(svg_namespace) {
                found.push(html[at..].chars().take(60).collect());
            }
        }
    }
    found
}

#[test]
fn report_realistic_record_renders_escaped_charts_and_counts() {
    let run = realistic();
    let html = render_html(&run).unwrap();

    assert!(!html.contains("<script"), "raw script tag in the page");
    assert!(
        html.contains("&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;quotes&quot;"),
        "skill name not escaped"
    );
    assert!(html.contains("desc with &lt;b&gt;bold&lt;/b&gt; &amp; &#39;apostrophes&#39;"));
    assert!(!html.contains("<b>bold</b>"));

    // stage timings, mean PEMS, converged by round, cluster sizes, and one sparkline per skill
    let svgs = html.matches("<svg").count();
    assert_eq!(
        svgs,
        4 + run.pems.as_ref().unwrap().top_skills.len(),
        "charts: {svgs}"
    );
    for heading in [
        "Stage timings",
        "Mean PEMS by round",
        "Skills converged by round",
        "Cluster sizes",
    ] {
        let at = html.find(heading).unwrap_or_else(|| panic!("no {heading}"));
        assert!(
            html[at..].find("<svg").is_some_and(|svg| svg < 400),
            "{heading} has no chart right after it"
        );
    }

    for name in ["ingest", "embed", "connect", "consolidate"] {
        assert!(
            html.contains(&format!("<strong>{name}</strong>")),
            "stage {name} missing"
        );
    }
    assert!(
        html.contains("4,321") && html.contains("4,299") && html.contains("1,617"),
        "stage counts missing"
    );
    assert!(
        html.contains("40.2 s") || html.contains("40.3 s"),
        "stage time missing"
    );
    assert!(html.contains("version 3 → 9 (6 new commits)"));
    assert!(html.contains("badge warn") && html.contains(">partial<"));
    assert!(html.contains("5 min 30 s"));
    assert!(
        html.contains("123,456") && html.contains("7,890"),
        "model usage missing"
    );
    assert!(
        html.contains("logs/a.jsonl:42"),
        "quarantine sample missing"
    );
    assert!(html.contains("<strong>21</strong> records quarantined"));
    assert!(
        html.contains("epi-00") && html.contains("epi-08"),
        "source episodes missing"
    );
    assert!(
        html.contains("0.120 → 0.150 → 0.187"),
        "PEMS history missing"
    );

    assert_eq!(external_references(&html), Vec::<String>::new());
    assert!(!html.contains("<link") && !html.contains("<img") && !html.contains("src="));
    assert_eq!(
        html,
        render_html(&run).unwrap(),
        "same record, different page"
    );
}

#[test]
fn report_degraded_record_shows_an_amber_badge_and_its_reasons_first() {
    let mut run = realistic();
    run.status = "degraded".into();
    run.reasons = vec![
        "consolidate: 0 of 6 clusters gave a skill (6 failed)".into(),
        format!("export: 0 skills exported ({HOSTILE})"),
    ];
    run.quarantine = QuarantineSummary::default();
    run.stages[3].status = "degraded: 0 of 6 clusters gave a skill (6 failed)".into();
    run.stages.push(StageRecord {
        name: "export".into(),
        status: "degraded: 0 skills exported".into(),
        ..Default::default()
    });
    run.stages[0].status = "partial: 1 of 6 clusters gave a skill (5 failed)".into();
    let html = render_html(&run).unwrap();

    // The run's badge names the status in words, in its own colour class (not partial's).
    assert!(
        html.contains(r#"<h1>fluxmem run <span class="badge degraded">degraded</span></h1>"#),
        "no degraded badge in the title"
    );
    assert!(html.contains(".badge.degraded {") && html.contains(".badge.warn {"));
    // The reasons are text, escaped, under the title and before the stage table.
    let reasons_at = html.find(r#"id="reasons""#).expect("no reasons block");
    assert!(reasons_at < html.find(r#"<dl class="meta">"#).unwrap());
    assert!(reasons_at < html.find(r#"<section id="stages">"#).unwrap());
    assert!(html.contains("Why the status is degraded:"));
    assert!(html.contains("<li>consolidate: 0 of 6 clusters gave a skill (6 failed)</li>"));
    assert!(html.contains(
        "<li>export: 0 skills exported (&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;quotes&quot;)</li>"
    ));
    assert!(!html.contains("<script"), "raw script tag in the page");
    // Stage badges: degraded stages amber, a partial stage stays distinct.
    assert!(html.contains(
        r#"<span class="badge degraded">degraded: 0 of 6 clusters gave a skill (6 failed)</span>"#
    ));
    assert!(html.contains(r#"<span class="badge degraded">degraded: 0 skills exported</span>"#));
    assert!(html.contains(
        r#"<span class="badge warn">partial: 1 of 6 clusters gave a skill (5 failed)</span>"#
    ));

    // An ok run has no reasons block.
    let ok = RunRecord {
        status: "ok".into(),
        ..Default::default()
    };
    let html = render_html(&ok).unwrap();
    assert!(
        html.contains(r#"<span class="badge ok">ok</span>"#) && !html.contains(r#"id="reasons""#)
    );
}

#[test]
fn report_run_json_without_reasons_still_reads() {
    // run.json files written before `reasons` existed.
    let mut value = serde_json::to_value(realistic()).unwrap();
    value
        .as_object_mut()
        .unwrap()
        .remove("reasons")
        .expect("reasons is serialised");
    let back: RunRecord = serde_json::from_value(value).unwrap();
    assert!(back.reasons.is_empty());
    assert_eq!(back.status, "partial");
}

#[test]
fn report_empty_record_says_there_is_nothing() {
    let html = render_html(&RunRecord::default()).unwrap();
    assert!(html.contains("no skills this run"));
    assert!(html.contains("no stages ran"));
    assert!(html.contains("no records quarantined"));
    assert!(html.contains("no model calls recorded"));
    assert!(!html.contains("<svg"), "a chart of no data");
    assert!(html.ends_with("</html>\n"));

    // PEMS present but empty, and degenerate values, still render
    let mut run = realistic();
    run.pems = Some(PemsSummary::default());
    assert!(render_html(&run).unwrap().contains("no skills this run"));
    // every induction failed: no skills, but the clusters are still drawn
    run.pems = Some(PemsSummary {
        cluster_sizes: vec![5, 3],
        ..Default::default()
    });
    let html = render_html(&run).unwrap();
    assert!(html.contains("no skills this run") && html.contains("Cluster sizes"));
    assert_eq!(
        html.matches("<svg").count(),
        2,
        "stage timings and cluster sizes only"
    );
    run.pems = Some(PemsSummary {
        skills: 1,
        mean_by_round: vec![f64::NAN],
        converged_by_round: vec![],
        cluster_sizes: vec![],
        top_skills: vec![SkillSummary {
            name: "only".into(),
            pems: f64::INFINITY,
            ..Default::default()
        }],
    });
    run.stages[0].seconds = f64::NAN;
    let html = render_html(&run).unwrap();
    assert!(html.contains("no clusters recorded") && html.contains("only"));
    assert!(
        !html.contains("NaN") && !html.contains("inf"),
        "non-finite values leaked into the page"
    );
}

#[test]
fn report_run_json_round_trips() {
    let run = realistic();
    let json = serde_json::to_string_pretty(&run).unwrap();
    let back: RunRecord = serde_json::from_str(&json).unwrap();
    assert_eq!(back, run);
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["pems"]["top_skills"][0]["name"], HOSTILE);
    assert_eq!(value["stages"][1]["counts_out"]["embeddings"], 4299);
    assert_eq!(value["quarantine"]["samples"][0]["line"], 42);
    assert_eq!(value["reasons"][0], "ingest: 21 records quarantined");
}

#[test]
fn report_write_report_writes_both_files_and_no_temporaries() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("runs").join("night-7");
    let run = realistic();
    let (json_path, html_path) = write_report(&target, &run).unwrap();
    assert_eq!(json_path, target.join("run.json"));
    assert_eq!(html_path, target.join("report.html"));

    let back: RunRecord =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(back, run);
    assert_eq!(
        std::fs::read_to_string(&html_path).unwrap(),
        render_html(&run).unwrap()
    );

    // a second run replaces both files
    let mut second = run.clone();
    second.run_id = "night-8".into();
    write_report(&target, &second).unwrap();
    assert!(std::fs::read_to_string(&json_path)
        .unwrap()
        .contains("night-8"));

    let mut names: Vec<String> = std::fs::read_dir(&target)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["report.html", "run.json"]);
}

#[test]
fn report_write_report_fails_cleanly_on_a_file_in_the_way() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, "x").unwrap();
    let error = write_report(&blocker, &realistic()).unwrap_err();
    assert!(error.to_string().contains("not-a-dir"), "{error}");

    // run.json is a directory: the rename fails and the temporary file is removed
    let target = dir.path().join("out");
    std::fs::create_dir_all(target.join("run.json").join("inner")).unwrap();
    assert!(write_report(&target, &realistic()).is_err());
    let names: Vec<String> = std::fs::read_dir(&target)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["run.json"]);
}

#[test]
fn report_counts_what_redaction_replaced() {
    let html = fluxmem_report::render_html(&realistic()).unwrap();
    assert!(
        html.contains("<h2>Redaction</h2>") && html.contains("1 card, 2 email"),
        "redaction counts per kind"
    );
    let quiet = fluxmem_report::render_html(&RunRecord {
        status: "ok".into(),
        ..Default::default()
    })
    .unwrap();
    assert!(quiet.contains("nothing redacted"));
}
