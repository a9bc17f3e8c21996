//! Where an episode's outcome comes from, and the rule that presumes one where the log has none.
//!
//! Every episode leaves ingest with `metadata.outcome_source`:
//!
//! - `logged`: the log says it (an explicit success flag or reward, a demonstration);
//! - `status`: a span status said it (OTel ERROR: failure, OK: success);
//! - `inferred`: [`infer`]'s rule, with `metadata.outcome_rule` saying which part decided;
//! - `judged`: a local model read the run (set by the command that ran it);
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
}
