//! `report.html`: one self-contained page (inline CSS and SVG, no script, no external resource).

use crate::charts;
use crate::record::{
    PemsSummary, QuarantineSummary, RunRecord, SkillSummary, StageRecord, UsageRecord,
};
use crate::Result;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Source episode ids shown before the rest are folded away.
const EPISODES_SHOWN: usize = 4;

const STYLE: &str = r#"
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #f4f5f7; color: #22262b; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 20px 40px; }
header, section { background: #fff; border: 1px solid #dde1e6; border-radius: 8px; padding: 16px 20px; margin-bottom: 18px; }
h1 { font-size: 22px; margin: 0 0 12px; display: flex; align-items: center; gap: 12px; flex-wrap: wrap; }
h2 { font-size: 17px; margin: 0 0 12px; }
h3 { font-size: 14px; margin: 0 0 6px; color: #444a52; }
dl.meta { display: grid; grid-template-columns: max-content 1fr; gap: 4px 16px; margin: 0; }
dl.meta dt { color: #5b626b; }
dl.meta dd { margin: 0; overflow-wrap: anywhere; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; }
code { background: #f0f2f4; padding: 1px 4px; border-radius: 3px; overflow-wrap: anywhere; }
.badge { display: inline-block; padding: 2px 10px; border-radius: 999px; font-size: 13px; font-weight: 600; border: 1px solid; }
.badge.ok { background: #e6f4ea; color: #1e6b34; border-color: #9fd3ae; }
.badge.warn { background: #fff4e0; color: #8a5300; border-color: #f0c67a; }
.badge.degraded { background: #ffe08a; color: #5c3d00; border-color: #d4a000; }
.badge.fail { background: #fde8e8; color: #a11d1d; border-color: #f0a3a3; }
.badge.neutral { background: #eef0f3; color: #444a52; border-color: #cfd4da; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 6px 8px; border-bottom: 1px solid #e6e9ed; vertical-align: top; }
th { font-size: 12px; text-transform: uppercase; letter-spacing: .03em; color: #5b626b; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.narrow { width: auto; min-width: 60%; }
tr.total td { font-weight: 600; border-top: 2px solid #d3d8de; }
ul.counts { list-style: none; margin: 0; padding: 0; }
ul.counts li { white-space: nowrap; }
ul.counts span { color: #5b626b; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(500px, 1fr)); gap: 16px; margin-top: 14px; }
figure { margin: 0; }
figure svg { display: block; max-width: 100%; height: auto; border: 1px solid #e6e9ed; border-radius: 6px; }
figcaption { font-size: 12px; color: #5b626b; margin-top: 4px; }
.empty { color: #5b626b; font-style: italic; margin: 4px 0; }
.skill-name { font-weight: 600; overflow-wrap: anywhere; }
.skill-desc { color: #444a52; overflow-wrap: anywhere; }
.history { font-size: 12px; color: #5b626b; }
.episodes { display: flex; flex-wrap: wrap; gap: 4px; align-items: center; }
.episodes span { color: #5b626b; font-size: 12px; }
details summary { cursor: pointer; color: #3b6ea8; }
details pre { max-height: 320px; overflow: auto; background: #f7f8fa; border: 1px solid #e6e9ed; padding: 8px; margin: 6px 0 0; white-space: pre-wrap; overflow-wrap: anywhere; }
.summary-line { margin: 0 0 8px; }
.reasons { border: 1px solid #cfd4da; border-left-width: 5px; border-radius: 6px; background: #f7f8fa; padding: 8px 14px; margin: 0 0 14px; }
.reasons.degraded { border-color: #d4a000; background: #fff8dc; }
.reasons.warn { border-color: #f0c67a; background: #fffaf0; }
.reasons.fail { border-color: #f0a3a3; background: #fff5f5; }
.reasons p { margin: 0 0 4px; }
.reasons ul { margin: 0; padding-left: 20px; }
.reasons li { overflow-wrap: anywhere; }
footer { color: #6b727b; font-size: 12px; text-align: center; }
"#;

/// Escapes text for HTML element content and quoted attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for character in text.chars() {
        match character {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            other => out.push(other),
        }
    }
    out
}

/// Formats a count with thousands separators: `1234567` -> `1,234,567`.
fn count(value: u64) -> String {
    let digits = value.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

fn seconds(value: f64) -> String {
    if !value.is_finite() {
        "–".to_string()
    } else if value < 10.0 {
        format!("{value:.2} s")
    } else {
        format!("{value:.1} s")
    }
}

fn pems_value(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.3}")
    } else {
        "–".to_string()
    }
}

/// The badge class of a run or stage status (the status text is always shown too, so the
/// colour is never the only sign): green `ok`/`done`, red `failed`, amber `degraded` (a stage
/// produced nothing of what it was meant to), light orange `partial` (part of it, or records
/// quarantined), grey for the rest (`nothing new`, `skipped (disabled)`, `merged`).
fn status_class(status: &str) -> &'static str {
    match status {
        "ok" | "done" => "ok",
        _ if status.starts_with("failed") => "fail",
        _ if status.starts_with("degraded") => "degraded",
        _ if status.starts_with("partial") => "warn",
        _ => "neutral",
    }
}

fn badge(status: &str) -> String {
    format!(
        r#"<span class="badge {}">{}</span>"#,
        status_class(status),
        escape(status)
    )
}

/// The run's wall time, when both times parse as RFC 3339.
fn duration(run: &RunRecord) -> Option<String> {
    let start = chrono::DateTime::parse_from_rfc3339(&run.started_at).ok()?;
    let end = chrono::DateTime::parse_from_rfc3339(&run.finished_at).ok()?;
    let total = (end - start).num_seconds();
    if total < 0 {
        return None;
    }
    let (hours, minutes, secs) = (total / 3600, total / 60 % 60, total % 60);
    Some(if hours > 0 {
        format!("{hours} h {minutes:02} min {secs:02} s")
    } else if minutes > 0 {
        format!("{minutes} min {secs:02} s")
    } else {
        format!("{secs} s")
    })
}

/// Renders the run as one self-contained HTML page; the same record gives the same bytes.
pub fn render_html(run: &RunRecord) -> Result<String> {
    let mut page = String::with_capacity(64 * 1024);
    let title = format!("fluxmem run {}", run.run_id);
    let _ = write!(
        page,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n",
        escape(&title)
    );
    header(&mut page, run);
    stages(&mut page, &run.stages)?;
    skills(&mut page, run.pems.as_ref())?;
    quarantine(&mut page, &run.quarantine);
    redaction(&mut page, &run.redacted);
    usage(&mut page, &run.model_usage);
    outputs(&mut page, &run.outputs);
    page.push_str(
        "<footer>Written by fluxmem-report. The same data is in <code>run.json</code> next to this file.</footer>\n\
         </main>\n</body>\n</html>\n",
    );
    Ok(page)
}

fn header(page: &mut String, run: &RunRecord) {
    let _ = write!(
        page,
        "<header>\n<h1>fluxmem run {}</h1>\n",
        badge(&run.status)
    );
    reasons(page, run);
    let _ = writeln!(page, "<dl class=\"meta\">");
    let mut item = |label: &str, value: String| {
        let _ = writeln!(page, "<dt>{label}</dt><dd>{value}</dd>");
    };
    item(
        "pipeline",
        format!("<code>{}</code>", escape(&run.pipeline)),
    );
    item("run id", format!("<code>{}</code>", escape(&run.run_id)));
    item("started", escape(&run.started_at));
    item("finished", escape(&run.finished_at));
    if let Some(duration) = duration(run) {
        item("duration", duration);
    }
    item("store", format!("<code>{}</code>", escape(&run.store)));
    let commits = run
        .manifest_version_after
        .saturating_sub(run.manifest_version_before);
    item(
        "manifest",
        format!(
            "version {} → {} ({} new commit{})",
            run.manifest_version_before,
            run.manifest_version_after,
            commits,
            if commits == 1 { "" } else { "s" }
        ),
    );
    if run.models.is_empty() {
        item(
            "models",
            "<span class=\"empty\">none recorded</span>".to_string(),
        );
    }
    for (role, model) in &run.models {
        item(&escape(role), format!("<code>{}</code>", escape(model)));
    }
    page.push_str("</dl>\n</header>\n");
}

/// Why the run is not `ok`, right under the title: the status word in text, then one line per
/// reason (nothing when there is no reason).
fn reasons(page: &mut String, run: &RunRecord) {
    if run.reasons.is_empty() {
        return;
    }
    let word = run.status.split(':').next().unwrap_or_default().trim();
    let word = if word.is_empty() {
        "not recorded"
    } else {
        word
    };
    let _ = writeln!(
        page,
        "<div class=\"reasons {}\" id=\"reasons\">\n<p><strong>Why the status is {}:</strong></p>\n<ul>",
        status_class(&run.status),
        escape(word)
    );
    for reason in &run.reasons {
        let _ = writeln!(page, "<li>{}</li>", escape(reason));
    }
    page.push_str("</ul>\n</div>\n");
}

fn count_list(counts: &BTreeMap<String, u64>) -> String {
    if counts.is_empty() {
        return "–".to_string();
    }
    let mut out = String::from("<ul class=\"counts\">");
    for (kind, value) in counts {
        let _ = write!(
            out,
            "<li><span>{}</span> {}</li>",
            escape(kind),
            count(*value)
        );
    }
    out.push_str("</ul>");
    out
}

fn stage_details(details: &serde_json::Value) -> String {
    let empty = match details {
        serde_json::Value::Null => true,
        serde_json::Value::Object(map) => map.is_empty(),
        serde_json::Value::Array(items) => items.is_empty(),
        _ => false,
    };
    if empty {
        return "–".to_string();
    }
    let pretty = serde_json::to_string_pretty(details).unwrap_or_else(|_| details.to_string());
    format!(
        "<details><summary>report</summary><pre>{}</pre></details>",
        escape(&pretty)
    )
}

fn stages(page: &mut String, stages: &[StageRecord]) -> Result<()> {
    page.push_str("<section id=\"stages\">\n<h2>Stages</h2>\n");
    if stages.is_empty() {
        page.push_str("<p class=\"empty\">no stages ran</p>\n</section>\n");
        return Ok(());
    }
    page.push_str(
        "<table>\n<thead><tr><th>stage</th><th>status</th><th class=\"num\">time</th>\
         <th>in</th><th>out</th><th>details</th></tr></thead>\n<tbody>\n",
    );
    for stage in stages {
        let _ = writeln!(
            page,
            "<tr><td><strong>{}</strong></td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&stage.name),
            badge(&stage.status),
            seconds(stage.seconds),
            count_list(&stage.counts_in),
            count_list(&stage.counts_out),
            stage_details(&stage.details),
        );
    }
    let total: f64 = stages
        .iter()
        .map(|stage| stage.seconds)
        .filter(|s| s.is_finite())
        .sum();
    let _ = writeln!(
        page,
        "<tr class=\"total\"><td>total</td><td></td><td class=\"num\">{}</td><td></td><td></td><td></td></tr>",
        seconds(total)
    );
    page.push_str("</tbody>\n</table>\n<div class=\"charts\">\n");
    let bars: Vec<(String, f64)> = stages
        .iter()
        .map(|stage| (stage.name.clone(), stage.seconds))
        .collect();
    figure(
        page,
        "Stage timings",
        &charts::horizontal_bars("stage timings", &bars, "s")?,
        "wall time per stage, seconds",
    );
    page.push_str("</div>\n</section>\n");
    Ok(())
}

fn figure(page: &mut String, title: &str, svg: &str, caption: &str) {
    let _ = writeln!(
        page,
        "<figure><h3>{}</h3>\n{svg}\n<figcaption>{}</figcaption></figure>",
        escape(title),
        escape(caption)
    );
}

fn skills(page: &mut String, pems: Option<&PemsSummary>) -> Result<()> {
    page.push_str("<section id=\"skills\">\n<h2>Skills and PEMS</h2>\n");
    let Some(pems) = pems.filter(|pems| pems.skills > 0 || !pems.top_skills.is_empty()) else {
        page.push_str("<p class=\"empty\">no skills this run</p>\n");
        // Clusters without skills (every induction failed) are still worth seeing.
        if let Some(sizes) = pems
            .map(|pems| &pems.cluster_sizes)
            .filter(|sizes| !sizes.is_empty())
        {
            page.push_str("<div class=\"charts\">\n");
            cluster_chart(page, sizes)?;
            page.push_str("</div>\n");
        }
        page.push_str("</section>\n");
        return Ok(());
    };
    let rounds = pems.mean_by_round.len();
    let converged = pems.converged_by_round.last().copied().unwrap_or(0);
    let _ = writeln!(
        page,
        "<p class=\"summary-line\">{} skill{} scored over {} round{}; {} converged; {} cluster{}.</p>",
        count(pems.skills),
        if pems.skills == 1 { "" } else { "s" },
        rounds,
        if rounds == 1 { "" } else { "s" },
        count(converged),
        count(pems.cluster_sizes.len() as u64),
        if pems.cluster_sizes.len() == 1 { "" } else { "s" },
    );
    page.push_str("<div class=\"charts\">\n");
    if pems.mean_by_round.is_empty() {
        page.push_str("<p class=\"empty\">no PEMS rounds recorded</p>\n");
    } else {
        let svg = charts::round_line("mean PEMS by round", &pems.mean_by_round, "mean PEMS")?;
        figure(
            page,
            "Mean PEMS by round",
            &svg,
            "mean PEMS over the skills after each round of the loop",
        );
    }
    if !pems.converged_by_round.is_empty() {
        let svg = charts::vertical_bars(
            "converged by round",
            &pems.converged_by_round,
            1,
            "round",
            "skills",
        )?;
        figure(
            page,
            "Skills converged by round",
            &svg,
            &format!(
                "skills whose PEMS had converged by each round, of {}",
                pems.skills
            ),
        );
    }
    if pems.cluster_sizes.is_empty() {
        page.push_str("<p class=\"empty\">no clusters recorded</p>\n");
    } else {
        cluster_chart(page, &pems.cluster_sizes)?;
    }
    page.push_str("</div>\n");
    top_skills(page, &pems.top_skills)?;
    page.push_str("</section>\n");
    Ok(())
}

fn cluster_chart(page: &mut String, sizes: &[u64]) -> Result<()> {
    let svg = charts::vertical_bars("cluster sizes", sizes, 1, "cluster", "episodes")?;
    figure(
        page,
        "Cluster sizes",
        &svg,
        "episodes per cluster, in cluster order",
    );
    Ok(())
}

fn top_skills(page: &mut String, skills: &[SkillSummary]) -> Result<()> {
    page.push_str("<h3 style=\"margin-top:18px\">Top skills</h3>\n");
    if skills.is_empty() {
        page.push_str("<p class=\"empty\">no skills listed</p>\n");
        return Ok(());
    }
    page.push_str(
        "<table>\n<thead><tr><th class=\"num\">#</th><th>skill</th><th class=\"num\">version</th>\
         <th class=\"num\">PEMS</th><th class=\"num\">support</th><th>PEMS history</th><th>source episodes</th></tr></thead>\n<tbody>\n",
    );
    for (rank, skill) in skills.iter().enumerate() {
        let history = skill
            .pems_history
            .iter()
            .map(|value| pems_value(*value))
            .collect::<Vec<_>>()
            .join(" → ");
        let spark = if skill.pems_history.is_empty() {
            String::new()
        } else {
            charts::sparkline("PEMS history", &skill.pems_history)?
        };
        let _ = writeln!(
            page,
            "<tr><td class=\"num\">{}</td><td><div class=\"skill-name\">{}</div><div class=\"skill-desc\">{}</div>\
             <div><code>{}</code></div></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td>{spark}<div class=\"history\">{}</div></td><td>{}</td></tr>",
            rank + 1,
            escape(&skill.name),
            escape(&skill.description),
            escape(&skill.id),
            skill.version,
            pems_value(skill.pems),
            count(skill.support),
            if history.is_empty() { "–".to_string() } else { escape(&history) },
            episode_list(&skill.source_episodes),
        );
    }
    page.push_str("</tbody>\n</table>\n");
    Ok(())
}

fn episode_list(episodes: &[String]) -> String {
    if episodes.is_empty() {
        return "–".to_string();
    }
    // Ids are long content hashes: show a few short forms, every full id one click away.
    let mut out = String::from("<div class=\"episodes\">");
    for id in episodes.iter().take(EPISODES_SHOWN) {
        let _ = write!(
            out,
            "<code title=\"{}\">{}</code>",
            escape(id),
            escape(&short_id(id))
        );
    }
    if episodes.len() > EPISODES_SHOWN {
        let _ = write!(out, "<span>+{}</span>", episodes.len() - EPISODES_SHOWN);
    }
    out.push_str("</div>");
    let all: String = episodes
        .iter()
        .map(|id| format!("{}\n", escape(id)))
        .collect();
    let _ = write!(
        out,
        "<details><summary>all {} ids</summary><pre>{all}</pre></details>",
        episodes.len()
    );
    out
}

/// The first 12 characters of an id (`epi-` and 8 hex digits), marked as cut when longer.
fn short_id(id: &str) -> String {
    if id.chars().count() <= 14 {
        id.to_string()
    } else {
        format!("{}…", id.chars().take(12).collect::<String>())
    }
}

/// What redaction replaced before the export and this report left the store.
fn redaction(page: &mut String, redacted: &std::collections::BTreeMap<String, u64>) {
    page.push_str("<section id=\"redaction\">\n<h2>Redaction</h2>\n");
    if redacted.values().all(|n| *n == 0) {
        page.push_str("<p class=\"empty\">nothing redacted</p>\n</section>\n");
        return;
    }
    let parts: Vec<String> = redacted
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(kind, n)| format!("{} {}", count(*n), escape(kind)))
        .collect();
    page.push_str(&format!(
        "<p class=\"summary-line\">Replaced by placeholders: {}.</p>\n</section>\n",
        parts.join(", ")
    ));
}

fn quarantine(page: &mut String, quarantine: &QuarantineSummary) {
    page.push_str("<section id=\"quarantine\">\n<h2>Quarantine</h2>\n");
    if quarantine.records == 0 && quarantine.samples.is_empty() {
        page.push_str("<p class=\"empty\">no records quarantined</p>\n</section>\n");
        return;
    }
    let _ = writeln!(
        page,
        "<p class=\"summary-line\"><strong>{}</strong> record{} quarantined.</p>",
        count(quarantine.records),
        if quarantine.records == 1 { "" } else { "s" }
    );
    if !quarantine.files.is_empty() {
        page.push_str("<h3>Files</h3>\n<ul>\n");
        for file in &quarantine.files {
            let _ = writeln!(page, "<li><code>{}</code></li>", escape(file));
        }
        page.push_str("</ul>\n");
    }
    if !quarantine.by_reason.is_empty() {
        page.push_str("<h3>By reason</h3>\n<table class=\"narrow\">\n<thead><tr><th>reason</th><th class=\"num\">records</th></tr></thead>\n<tbody>\n");
        for (reason, records) in &quarantine.by_reason {
            let _ = writeln!(
                page,
                "<tr><td>{}</td><td class=\"num\">{}</td></tr>",
                escape(reason),
                count(*records)
            );
        }
        page.push_str("</tbody>\n</table>\n");
    }
    if !quarantine.samples.is_empty() {
        let _ = writeln!(
            page,
            "<h3 style=\"margin-top:14px\">Samples (first {})</h3>",
            quarantine.samples.len()
        );
        page.push_str("<table>\n<thead><tr><th>file:line</th><th>field</th><th>reason</th></tr></thead>\n<tbody>\n");
        for sample in &quarantine.samples {
            let place = match sample.line {
                Some(line) => format!("{}:{line}", sample.file),
                None => sample.file.clone(),
            };
            let _ = writeln!(
                page,
                "<tr><td><code>{}</code></td><td><code>{}</code></td><td>{}</td></tr>",
                escape(&place),
                escape(&sample.field),
                escape(&sample.reason)
            );
        }
        page.push_str("</tbody>\n</table>\n");
    }
    page.push_str("</section>\n");
}

fn usage(page: &mut String, usage: &BTreeMap<String, UsageRecord>) {
    page.push_str("<section id=\"usage\">\n<h2>Model usage</h2>\n");
    if usage.is_empty() {
        page.push_str("<p class=\"empty\">no model calls recorded</p>\n</section>\n");
        return;
    }
    page.push_str(
        "<table class=\"narrow\">\n<thead><tr><th>role</th><th class=\"num\">calls</th><th class=\"num\">prompt tokens</th>\
         <th class=\"num\">generated tokens</th></tr></thead>\n<tbody>\n",
    );
    let mut total = UsageRecord::default();
    for (role, record) in usage {
        total.calls += record.calls;
        total.prompt_tokens += record.prompt_tokens;
        total.generated_tokens += record.generated_tokens;
        let _ = writeln!(
            page,
            "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
            escape(role),
            count(record.calls),
            count(record.prompt_tokens),
            count(record.generated_tokens)
        );
    }
    let _ = writeln!(
        page,
        "<tr class=\"total\"><td>total</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
        count(total.calls),
        count(total.prompt_tokens),
        count(total.generated_tokens)
    );
    page.push_str("</tbody>\n</table>\n</section>\n");
}

fn outputs(page: &mut String, outputs: &[String]) {
    page.push_str("<section id=\"outputs\">\n<h2>Outputs</h2>\n");
    if outputs.is_empty() {
        page.push_str("<p class=\"empty\">no files recorded</p>\n");
    } else {
        page.push_str("<ul>\n");
        for output in outputs {
            let _ = writeln!(page, "<li><code>{}</code></li>", escape(output));
        }
        page.push_str("</ul>\n");
    }
    page.push_str("</section>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_escape_covers_markup_and_quotes() {
        assert_eq!(
            escape(r#"<a href='x'>"&"</a>"#),
            "&lt;a href=&#39;x&#39;&gt;&quot;&amp;&quot;&lt;/a&gt;"
        );
    }

    #[test]
    fn report_counts_are_grouped() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1234567), "1,234,567");
    }

    #[test]
    fn report_duration_needs_both_times() {
        let mut run = RunRecord {
            started_at: "2026-05-01T02:00:00Z".into(),
            finished_at: "2026-05-01T02:03:07Z".into(),
            ..Default::default()
        };
        assert_eq!(duration(&run).as_deref(), Some("3 min 07 s"));
        run.finished_at = "later".into();
        assert_eq!(duration(&run), None);
    }

    #[test]
    fn report_status_badges_name_the_status() {
        assert!(badge("ok").contains("badge ok"));
        assert!(badge("partial").contains("badge warn"));
        assert!(badge("partial: 1 of 6 clusters gave a skill").contains("badge warn"));
        assert!(badge("degraded").contains("badge degraded"));
        assert!(badge("degraded: 0 skills exported").contains(">degraded: 0 skills exported<"));
        assert!(badge("failed: <disk>").contains("badge fail"));
        assert!(badge("failed: <disk>").contains("failed: &lt;disk&gt;"));
    }
}
