//! Where an episode's outcome comes from, and the rule that presumes one where the log has none.
//!
//! Every episode leaves ingest with `metadata.outcome_source`:
//!
//! - `logged`: the log says it (an explicit success flag or reward, a demonstration);
//! - `status`: a span status said it (OTel ERROR: failure, OK: success);
//! - `inferred`: [`infer`]'s rule, with `metadata.outcome_rule` saying which part decided;
//! - `judged`: a local model read the run ([`OutcomeJudge`], `ingest --label-outcomes MODEL`)
//!   where the log says nothing (the rule's runs, `inferred` or `none`): success when its
//!   probability of success is at least [`JUDGED_SUCCESS_AT`], with `metadata.outcome_probability`
//!   and `metadata.outcome_judge` (the model) beside it;
//! - `none`: nothing says, and the rule abstains (the outcome stays unknown).
//!
//! The rule, stated before it was measured (docs/formats/outcomes.md has its confusion table on
//! dev data whose outcomes were hidden from it):
//!
//! - **failure** when the run's last acting step ended in a tool error (a step's feedback), when
//!   a tool's error was never followed by a call of the same tool without one, or when the
//!   user's words after the agent's final answer complain ([`COMPLAINTS`]);
//! - **success** (presumed) when the run ended with an answer to the user (a message, not a
//!   tool call), with no error in that step and no complaint after it;
//! - **unknown** otherwise: a run that ended on a tool call (a hand-off, a cut log) or has no
//!   acting step.
//!
//! It reads no tool name and no task word: only where the run ended, errors, and the user's
//! last words.

use fluxmem_graph::{Episode, Node, NodeBody};
use serde_json::Value;

/// A local model that reads runs and says whether each did what its user asked
/// (`fluxmem ingest --label-outcomes MODEL`). Ingest gives it the runs whose log says no
/// outcome, each as a redacted [`transcript`].
pub trait OutcomeJudge {
    /// The model's name, stored with each outcome it gives.
    fn model(&self) -> &str;
    /// For each transcript, the probability that the run succeeded; an error leaves those runs
    /// with the rule's outcome, and says so.
    fn judge(&mut self, transcripts: &[String]) -> std::result::Result<Vec<f32>, String>;
}

/// A judged run succeeded when the judge's probability is at least this: the middle, stated
/// before measuring (docs/formats/outcomes.md has the judge's confusion table).
pub const JUDGED_SUCCESS_AT: f32 = 0.5;

/// Characters of a run a judge reads (about 900 tokens): the first line (the request) and as
/// many of the last lines as fit, where a run's outcome shows.
pub const TRANSCRIPT_CHARS: usize = 3_000;

/// Characters of one line of a transcript (a message, a call, a result).
const LINE_CHARS: usize = 400;

/// Whether a judge is asked about this episode: its log says no outcome (the rule's, or none).
pub fn needs_judging(node: &Node) -> bool {
    node.episode().is_some() && matches!(node.outcome_source(), "inferred" | "none")
}

/// A run as a judge reads it, at most `max_chars` characters: what the agent observed (the
/// user's messages and tool results, as the parser tagged them), said (`[agent]`) and called
/// (`[agent calls]`), with errors (`[error]`); a result is shown after its call only when the
/// next observation does not carry it. Each line passes `redactor` whole, before any line is
/// cut, so no secret is left in part at a cut. A longer run keeps its first line and its last
/// lines (with the count of those left out). The outcome is never shown.
pub fn transcript(node: &Node, max_chars: usize, redactor: &fluxmem_redact::Redactor) -> String {
    let Some(episode) = node.episode() else {
        return String::new();
    };
    let mut lines: Vec<String> = Vec::new();
    if episode
        .steps
        .first()
        .is_none_or(|s| s.observation.trim().is_empty())
    {
        lines.push(format!("[task] {}", node.text.trim()));
    }
    for (i, step) in episode.steps.iter().enumerate() {
        let next = episode
            .steps
            .get(i + 1)
            .map_or("", |s| s.observation.as_str());
        if !step.observation.trim().is_empty() {
            lines.push(step.observation.trim().to_string());
        }
        if !step.action.trim().is_empty() {
            lines.push(format!("[agent] {}", step.action.trim()));
        }
        for call in &step.tool_calls {
            lines.push(format!("[agent calls] {}({})", call.name, call.arguments));
            if let Some(result) = call.result.as_deref().map(str::trim) {
                let head: String = result.chars().take(40).collect();
                if !result.is_empty() && !next.contains(&head) {
                    lines.push(format!("[{} returns] {result}", call.name));
                }
            }
        }
        if let Some(error) = step.feedback.as_deref().filter(|f| !f.trim().is_empty()) {
            lines.push(format!("[error] {}", error.trim()));
        }
    }
    let lines: Vec<String> = lines
        .iter()
        .map(|l| clip_line(&redactor.redact(l).text, LINE_CHARS))
        .collect();
    fit(&lines, max_chars)
}

fn clip_line(line: &str, chars: usize) -> String {
    let flat = line.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(chars) {
        Some((at, _)) => format!("{}...", &flat[..at]),
        None => flat,
    }
}

/// The first line and as many last lines as fit in `max_chars`.
fn fit(lines: &[String], max_chars: usize) -> String {
    let size = |l: &String| l.chars().count() + 1;
    if lines.iter().map(size).sum::<usize>() <= max_chars || lines.len() < 2 {
        return lines.join("\n");
    }
    let mut room = max_chars.saturating_sub(size(&lines[0]) + 40);
    let mut tail = Vec::new();
    for line in lines[1..].iter().rev() {
        if size(line) > room {
            break;
        }
        room -= size(line);
        tail.push(line.as_str());
    }
    tail.reverse();
    let left_out = lines.len() - 1 - tail.len();
    let mut out = vec![
        lines[0].clone(),
        format!("[... {left_out} lines left out ...]"),
    ];
    out.extend(tail.into_iter().map(str::to_string));
    out.join("\n")
}

/// Gives a run the judge's outcome: success when `probability`, rounded to the 3 decimals
/// stored, is at least [`JUDGED_SUCCESS_AT`]. The rule's `outcome_rule`, if any, stays as what
/// the rule said.
pub fn judged(node: &mut Node, probability: f32, model: &str) {
    let NodeBody::Episodic(episode) = &mut node.body else {
        return;
    };
    // The stored probability decides: what the node says is what it holds.
    let rounded = (f64::from(probability) * 1000.0).round() / 1000.0;
    episode.outcome.success = Some(rounded >= f64::from(JUDGED_SUCCESS_AT));
    node.metadata
        .insert("outcome_source".into(), Value::from("judged"));
    node.metadata
        .insert("outcome_probability".into(), Value::from(rounded));
    node.metadata
        .insert("outcome_judge".into(), Value::from(model));
}

/// The `metadata.outcome_source` values.
pub const SOURCES: [&str; 5] = ["logged", "status", "inferred", "judged", "none"];

/// Words of a user turn that complain about the answer (lower case, matched as substrings of
/// the lower-cased text). A language's words, not any dataset's; fixed before measuring.
pub const COMPLAINTS: [&str; 14] = [
    "not what i asked",
    "not what i wanted",
    "that's wrong",
    "that is wrong",
    "incorrect",
    "doesn't work",
    "does not work",
    "didn't work",
    "did not work",
    "not working",
    "still not",
    "useless",
    "frustrat",
    "not helpful",
];

/// What the rule decided and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inferred {
    /// `Some(true)` presumed success, `Some(false)` failure, `None` unknown.
    pub success: Option<bool>,
    /// Which part of the rule decided.
    pub rule: &'static str,
}

/// The rule (see the module docs) on one episode.
pub fn infer(episode: &Episode) -> Inferred {
    let decided = |success, rule| Inferred { success, rule };
    let Some(last) = episode
        .steps
        .iter()
        .rposition(|s| !s.action.trim().is_empty() || !s.tool_calls.is_empty())
    else {
        return decided(None, "no acting step");
    };
    let step = &episode.steps[last];
    let errored =
        |s: &fluxmem_graph::Step| s.feedback.as_deref().is_some_and(|f| !f.trim().is_empty());
    if errored(step) {
        return decided(Some(false), "ended in a tool error");
    }
    // An error no later call of the same tool recovered from.
    let unrecovered = episode.steps.iter().enumerate().any(|(i, s)| {
        errored(s)
            && s.tool_calls.iter().any(|failed| {
                !episode.steps[i + 1..].iter().any(|later| {
                    !errored(later) && later.tool_calls.iter().any(|c| c.name == failed.name)
                })
            })
    });
    if unrecovered {
        return decided(
            Some(false),
            "a tool error no later call of that tool recovered",
        );
    }
    let after: String = episode.steps[last + 1..]
        .iter()
        .map(|s| s.observation.to_lowercase())
        .collect::<Vec<_>>()
        .join("\n");
    if COMPLAINTS.iter().any(|c| after.contains(c)) {
        return decided(Some(false), "the user complained after the last answer");
    }
    if !step.tool_calls.is_empty() {
        return decided(None, "ended on a tool call, not an answer");
    }
    decided(Some(true), "ended with an answer, no error, no complaint")
}

/// Sets `metadata.outcome_source` on an episode that has none (parsers set `status` where a
/// span status decided), and where the log gives no outcome, the rule's.
pub fn label(node: &mut Node) {
    let NodeBody::Episodic(episode) = &mut node.body else {
        return;
    };
    if node.metadata.contains_key("outcome_source") {
        return;
    }
    let source = if episode.outcome.success.is_some() || episode.outcome.reward.is_some() {
        "logged"
    } else {
        let inferred = infer(episode);
        episode.outcome.success = inferred.success;
        node.metadata
            .insert("outcome_rule".into(), Value::from(inferred.rule));
        if inferred.success.is_some() {
            "inferred"
        } else {
            "none"
        }
    };
    node.metadata
        .insert("outcome_source".into(), Value::from(source));
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluxmem_graph::{Outcome, Step, ToolCall};

    fn step(observation: &str, action: &str, call: Option<&str>, feedback: Option<&str>) -> Step {
        Step {
            observation: observation.into(),
            action: action.into(),
            tool_calls: call
                .map(|name| ToolCall {
                    name: name.into(),
                    arguments: "{}".into(),
                    result: Some("{}".into()),
                })
                .into_iter()
                .collect(),
            feedback: feedback.map(str::to_string),
            timestamp: None,
        }
    }

    fn episode(steps: Vec<Step>) -> Episode {
        Episode {
            steps,
            outcome: Outcome::default(),
        }
    }

    #[test]
    fn the_rule_reads_where_the_run_ended_errors_and_the_users_last_words() {
        let answered = episode(vec![
            step("[user] refund order 7", "", Some("lookup"), None),
            step("[lookup] {}", "Done: refunded.", None, None),
            step("[user] thanks!", "", None, None),
        ]);
        assert_eq!(infer(&answered).success, Some(true));
        let complained = episode(vec![
            step("[user] refund order 7", "", Some("lookup"), None),
            step("[lookup] {}", "Done: refunded.", None, None),
            step("[user] No, that's wrong, it was order 8", "", None, None),
        ]);
        assert_eq!(infer(&complained).success, Some(false));
        let errored = episode(vec![step(
            "[user] refund order 7",
            "",
            Some("refund"),
            Some("Error: no such order"),
        )]);
        assert_eq!(infer(&errored).success, Some(false));
        let apologised = episode(vec![
            step(
                "[user] refund order 7",
                "",
                Some("refund"),
                Some("Error: timeout"),
            ),
            step("[refund] Error: timeout", "Sorry, it failed.", None, None),
        ]);
        assert_eq!(infer(&apologised).success, Some(false));
        let retried = episode(vec![
            step(
                "[user] refund order 7",
                "",
                Some("refund"),
                Some("Error: timeout"),
            ),
            step("[refund] Error: timeout", "", Some("refund"), None),
            step("[refund] {}", "Refunded.", None, None),
        ]);
        assert_eq!(infer(&retried).success, Some(true));
        let handed_off = episode(vec![
            step("[user] refund order 7", "", Some("lookup"), None),
            step("[lookup] {}", "", Some("escalate"), None),
        ]);
        assert_eq!(infer(&handed_off).success, None);
        assert_eq!(
            infer(&episode(vec![step("[user] hi", "", None, None)])).success,
            None
        );
    }

    #[test]
    fn a_logged_outcome_is_kept_and_an_unknown_one_gets_the_rules_with_its_source() {
        let body = |success| {
            NodeBody::Episodic(Episode {
                steps: vec![step("[user] hi", "Hello!", None, None)],
                outcome: Outcome {
                    success,
                    ..Outcome::default()
                },
            })
        };
        let mut logged = Node::new(body(Some(false)), "t", "hi", &["a"]);
        label(&mut logged);
        assert_eq!(logged.outcome_source(), "logged");
        assert_eq!(logged.episode().unwrap().outcome.success, Some(false));
        let mut unknown = Node::new(body(None), "t", "hi", &["b"]);
        let id = unknown.id.clone();
        label(&mut unknown);
        assert_eq!(unknown.outcome_source(), "inferred");
        assert_eq!(unknown.episode().unwrap().outcome.success, Some(true));
        assert_eq!(
            unknown.id, id,
            "labelling never changes an episode's identity"
        );
        let mut status = Node::new(body(Some(true)), "t", "hi", &["c"]);
        status
            .metadata
            .insert("outcome_source".into(), Value::from("status"));
        label(&mut status);
        assert_eq!(status.outcome_source(), "status");
    }

    #[test]
    fn a_transcript_shows_the_run_without_its_outcome_and_keeps_the_end_of_a_long_one() {
        let mut steps = vec![
            step("[user] refund order 7", "", Some("refund"), None),
            step("[refund] {}", "Refunded order 7.", None, None),
        ];
        steps[0].tool_calls[0].result = Some("{}".into());
        let mut body = episode(steps);
        body.outcome.success = Some(true);
        let node = Node::new(NodeBody::Episodic(body), "t", "refund order 7", &["r"]);
        assert_eq!(
            transcript(&node, TRANSCRIPT_CHARS, &fluxmem_redact::Redactor::default()),
            "[user] refund order 7\n[agent calls] refund({})\n[refund] {}\n[agent] Refunded order 7."
        );
        // A result no later observation carries is shown after its call; errors are said.
        let mut steps = vec![step("", "", Some("lookup"), Some("Error: timeout"))];
        steps[0].tool_calls[0].result = Some("Error: timeout".into());
        let node = Node::new(NodeBody::Episodic(episode(steps)), "t", "find it", &["s"]);
        assert_eq!(
            transcript(&node, TRANSCRIPT_CHARS, &fluxmem_redact::Redactor::default()),
            "[task] find it\n[agent calls] lookup({})\n[lookup returns] Error: timeout\n[error] Error: timeout"
        );
        // A long run: the first line, a count of what was left out, and the last lines.
        let steps = (0..50)
            .map(|i| step(&format!("[user] message number {i}"), "ok", None, None))
            .collect();
        let node = Node::new(NodeBody::Episodic(episode(steps)), "t", "long", &["l"]);
        let text = transcript(&node, 300, &fluxmem_redact::Redactor::default());
        assert!(text.chars().count() <= 300, "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "[user] message number 0");
        assert!(lines[1].starts_with("[... ") && lines[1].ends_with(" lines left out ...]"));
        assert_eq!(*lines.last().unwrap(), "[agent] ok");
        assert!(lines[lines.len() - 2] == "[user] message number 49");
    }

    #[test]
    fn a_judged_run_keeps_its_identity_and_says_who_judged_it() {
        let mut node = Node::new(
            NodeBody::Episodic(episode(vec![step("[user] hi", "Hello!", None, None)])),
            "t",
            "hi",
            &["j"],
        );
        label(&mut node);
        assert!(needs_judging(&node));
        let id = node.id.clone();
        judged(&mut node, 0.2345, "judge-model");
        assert_eq!(node.id, id);
        assert_eq!(node.outcome_source(), "judged");
        assert_eq!(node.episode().unwrap().outcome.success, Some(false));
        assert_eq!(node.metadata["outcome_probability"], Value::from(0.235));
        assert_eq!(node.metadata["outcome_judge"], Value::from("judge-model"));
        assert!(!needs_judging(&node), "a judged run is not judged again");
        judged(&mut node, JUDGED_SUCCESS_AT, "judge-model");
        assert_eq!(node.episode().unwrap().outcome.success, Some(true));
        // Just under the threshold, stored as 0.5: a success, as the stored value says.
        judged(&mut node, 0.4996, "judge-model");
        assert_eq!(node.metadata["outcome_probability"], Value::from(0.5));
        assert_eq!(node.episode().unwrap().outcome.success, Some(true));
    }
}
