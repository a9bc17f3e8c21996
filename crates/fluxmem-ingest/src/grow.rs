//! A conversation logged again, longer, in a later batch or night.
//!
//! A record whose episode id the store (or this run) already holds is the same conversation
//! (ids come from the conversation's identity: its logged id, or its content). It is compared
//! with the stored version, step by step:
//! - **adds nothing**: the same steps (or fewer: an older version arriving late), and no result,
//!   feedback or outcome the stored one lacks. A duplicate.
//! - **grows it**: the stored steps are the first steps of the new one (the same actions and
//!   calls; a result or feedback the stored step lacked may be filled in) and the new one has
//!   more steps, a result more, or an outcome the stored one lacked. The new version replaces the
//!   stored episode under the same id, counts `versions`, and an edit (`episode_grown`, stage
//!   `ingest`) holds the version it replaced, so the change is in the edit log and can be undone.
//! - **continues it**: the same task, and every step of the new one logged after the stored
//!   one's last step (by their timestamps): the next turn of the conversation, as a tracer
//!   exports it (a trace a turn, the earlier turns' spans not sent again). The new steps are
//!   appended to the stored ones, and the rest is as for a growth.
//! - **contradicts it**: anything else (another task, a step that differs). The new version is an
//!   episode of its own, with an id of where it parts from the stored one (its task and steps
//!   up to the first that differs) and `conflicts_with` naming the stored
//!   one; nothing stored changes.

use fluxmem_graph::{sha256_hex, Node, NodeBody, NodeId, Step};
use serde_json::Value;

/// What a record of a known episode does to the stored version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Growth {
    /// Nothing new: a duplicate.
    Nothing,
    /// The stored version is a prefix of the new one, which adds to it.
    Grows,
    /// The new one holds the steps that came after the stored ones.
    Continues,
    /// Neither is a prefix of the other.
    Contradicts,
}

/// Whether an episode's id can be shared by a later version with other content: its identity
/// is a logged conversation id (chat logs with an `id`) or a trace's grouping (OTel spans,
/// which may arrive over several batches). Other formats' ids hold the content: a known id is
/// the same record, and nothing is read back to compare.
pub(crate) fn versioned(node: &Node) -> bool {
    node.episode().is_some()
        && (node.metadata.contains_key("conversation_id")
            || node.metadata.get("format").and_then(Value::as_str) == Some("otel"))
}

/// How `new` relates to `stored`, two versions of one episode id.
pub(crate) fn compare(stored: &Node, new: &Node) -> Growth {
    let (Some(old), Some(fresh)) = (stored.episode(), new.episode()) else {
        return Growth::Nothing;
    };
    if stored.text != new.text {
        return Growth::Contradicts;
    }
    match (
        extends(&old.steps, &fresh.steps),
        extends(&fresh.steps, &old.steps),
    ) {
        (Some(filled), _) => {
            if fresh.steps.len() > old.steps.len() || filled || outcome_gained(stored, new) {
                Growth::Grows
            } else {
                Growth::Nothing
            }
        }
        // An older version arriving late: it adds nothing the stored one lacks.
        (None, Some(_)) => Growth::Nothing,
        (None, None) if continues(&old.steps, &fresh.steps) => Growth::Continues,
        (None, None) => Growth::Contradicts,
    }
}

/// The new version's log says an outcome (the parser's: a field, a status, an evaluation)
/// that the stored version's does not: the stored one had none from the log (inferred by
/// ingest's rule, a judge's, or none), or another one.
fn outcome_gained(stored: &Node, new: &Node) -> bool {
    let (Some(old), Some(fresh)) = (stored.episode(), new.episode()) else {
        return false;
    };
    let said = fresh.outcome.success.is_some() || fresh.outcome.reward.is_some();
    let unlogged = matches!(stored.outcome_source(), "inferred" | "judged" | "none");
    said && (unlogged
        || fresh.outcome.success != old.outcome.success
        || fresh.outcome.reward != old.outcome.reward)
}

/// Every step of `fresh` was logged after the last step of `stored` (both with timestamps).
fn continues(stored: &[Step], fresh: &[Step]) -> bool {
    let Some(last) = stored.iter().filter_map(|s| s.timestamp).max() else {
        return false;
    };
    !fresh.is_empty() && fresh.iter().all(|s| s.timestamp.is_some_and(|t| t > last))
}

/// `Some(filled)` when `longer` starts with the steps of `shorter` (each the same step, or
/// with something filled in that it lacked; `filled` says whether anything was).
fn extends(shorter: &[Step], longer: &[Step]) -> Option<bool> {
    if longer.len() < shorter.len() {
        return None;
    }
    let mut filled = false;
    for (before, after) in shorter.iter().zip(longer) {
        filled |= step_change(before, after)?;
    }
    Some(filled)
}

/// `Some(filled)` when `after` is `before` with, at most, a result, feedback or observation
/// filled in that `before` lacked (`filled` says whether one was); `None` when they differ.
fn step_change(before: &Step, after: &Step) -> Option<bool> {
    if before.action != after.action || before.tool_calls.len() != after.tool_calls.len() {
        return None;
    }
    let mut filled = false;
    let mut field = |old: Option<&str>, new: Option<&str>| -> bool {
        match (old, new) {
            (None, Some(_)) => {
                filled = true;
                true
            }
            (old, new) => old == new,
        }
    };
    for (old, new) in before.tool_calls.iter().zip(&after.tool_calls) {
        if old.name != new.name
            || !same_arguments(&old.arguments, &new.arguments)
            || !field(old.result.as_deref(), new.result.as_deref())
        {
            return None;
        }
    }
    let observation = |s: &str| (!s.is_empty()).then_some(s.to_string());
    let observed = field(
        observation(&before.observation).as_deref(),
        observation(&after.observation).as_deref(),
    );
    (observed && field(before.feedback.as_deref(), after.feedback.as_deref())).then_some(filled)
}

/// Arguments as the same JSON (key order and spacing aside), else as the same text.
fn same_arguments(a: &str, b: &str) -> bool {
    match (
        serde_json::from_str::<Value>(a),
        serde_json::from_str::<Value>(b),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// `new` as the version that grows `stored` (`continues`: after its steps, which come first):
/// the same id, `versions` counting both, the first version's creation time kept.
pub(crate) fn grown(stored: &Node, mut new: Node, continues: bool) -> Node {
    if let (true, Some(old), NodeBody::Episodic(fresh)) =
        (continues, stored.episode(), &mut new.body)
    {
        let later = std::mem::take(&mut fresh.steps);
        fresh.steps = old.steps.iter().cloned().chain(later).collect();
    }
    let versions = |node: &Node| node.metadata.get("versions").and_then(Value::as_u64);
    let total = versions(stored).unwrap_or(1) + versions(&new).unwrap_or(1);
    new.metadata.insert("versions".into(), Value::from(total));
    new.created_at = stored.created_at.or(new.created_at);
    new
}

/// `new` as an episode of its own beside the `stored` version it contradicts, `conflicts_with`
/// naming the stored episode. Its id comes from where it parts from the stored one (its task
/// and its steps up to the first that differs), so a later, longer version of the same
/// divergent conversation has the same id and grows it, and the same version again is a
/// duplicate.
pub(crate) fn apart(stored: &Node, new: Node) -> Node {
    let (old, fresh) = match (stored.episode(), new.episode()) {
        (Some(old), Some(fresh)) => (old.steps.as_slice(), fresh.steps.as_slice()),
        _ => (&[][..], &[][..]),
    };
    let parts = old
        .iter()
        .zip(fresh)
        .take_while(|(a, b)| step_change(a, b).is_some())
        .count();
    let head = &fresh[..(parts + 1).min(fresh.len())];
    let signature: Vec<(&str, Vec<(&str, &str)>)> = head
        .iter()
        .map(|s| {
            (
                s.action.as_str(),
                s.tool_calls
                    .iter()
                    .map(|c| (c.name.as_str(), c.arguments.as_str()))
                    .collect(),
            )
        })
        .collect();
    let content = serde_json::to_string(&(&new.text, signature)).unwrap_or_default();
    beside(
        stored,
        new,
        &format!("{}#{}", stored.id, sha256_hex(content.as_bytes())),
    )
}

/// `new` apart from `stored` under an id of its whole content (a version that parts from the
/// stored one and from the divergent version [`apart`] names too).
pub(crate) fn whole(stored: &Node, new: Node) -> Node {
    let content = serde_json::to_string(&new.body).unwrap_or_default();
    let identity = format!("{}#whole#{}", stored.id, sha256_hex(content.as_bytes()));
    beside(stored, new, &identity)
}

/// `new` under the id of `identity`, marked as contradicting `stored`.
fn beside(stored: &Node, mut new: Node, identity: &str) -> Node {
    new.id = NodeId::content(new.kind(), &new.tenant, &[identity]);
    new.metadata
        .insert("conflicts_with".into(), Value::from(stored.id.to_string()));
    new
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluxmem_graph::{Episode, NodeBody, Outcome, ToolCall};

    fn node(task: &str, steps: Vec<Step>, success: Option<bool>) -> Node {
        Node::new(
            NodeBody::Episodic(Episode {
                steps,
                outcome: Outcome {
                    success,
                    reward: None,
                    feedback: None,
                },
            }),
            "t",
            task,
            &["conversation-1"],
        )
    }

    fn call(name: &str, arguments: &str, result: Option<&str>) -> Step {
        Step {
            tool_calls: vec![ToolCall {
                name: name.into(),
                arguments: arguments.into(),
                result: result.map(str::to_string),
            }],
            ..Step::default()
        }
    }

    #[test]
    fn a_longer_version_grows_a_shorter_one_and_anything_else_is_apart_or_nothing() {
        let short = node(
            "refund A-1",
            vec![call("get_order", r#"{"id": "A-1"}"#, None)],
            None,
        );
        let long = node(
            "refund A-1",
            vec![
                call("get_order", r#"{ "id":"A-1" }"#, Some("delivered")),
                call("refund_order", r#"{"id": "A-1"}"#, Some("done")),
            ],
            Some(true),
        );
        assert_eq!(compare(&short, &long), Growth::Grows);
        assert_eq!(
            compare(&long, &short),
            Growth::Nothing,
            "an older version late"
        );
        assert_eq!(compare(&long, &long), Growth::Nothing);
        let filled = node(
            "refund A-1",
            vec![call("get_order", r#"{"id": "A-1"}"#, Some("delivered"))],
            None,
        );
        assert_eq!(
            compare(&short, &filled),
            Growth::Grows,
            "a result filled in"
        );
        let other = node(
            "refund A-1",
            vec![call("get_order", r#"{"id": "B-2"}"#, None)],
            None,
        );
        assert_eq!(compare(&short, &other), Growth::Contradicts);
        let changed = node(
            "refund A-1",
            vec![call("get_order", r#"{"id": "A-1"}"#, Some("lost"))],
            None,
        );
        assert_eq!(compare(&filled, &changed), Growth::Contradicts);
        let grown = grown(&short, long.clone(), false);
        assert_eq!(
            (grown.id.clone(), grown.metadata["versions"].clone()),
            (short.id.clone(), Value::from(2))
        );
        let at = |step: Step, t: i64| Step {
            timestamp: Some(t),
            ..step
        };
        let turn1 = node(
            "refund A-1",
            vec![at(call("get_order", r#"{"id": "A-1"}"#, Some("ok")), 10)],
            None,
        );
        let turn2 = node(
            "refund A-1",
            vec![at(
                call("refund_order", r#"{"id": "A-1"}"#, Some("done")),
                20,
            )],
            Some(true),
        );
        assert_eq!(compare(&turn1, &turn2), Growth::Continues);
        assert_eq!(
            compare(&turn2, &turn1),
            Growth::Contradicts,
            "not before it"
        );
        let whole = super::grown(&turn1, turn2, true);
        let names: Vec<&str> = whole
            .episode()
            .unwrap()
            .steps
            .iter()
            .map(|s| s.tool_calls[0].name.as_str())
            .collect();
        assert_eq!(names, ["get_order", "refund_order"]);
        // The same steps with an outcome the log says, over one ingest's rule inferred.
        let mut inferred = long.clone();
        inferred
            .metadata
            .insert("outcome_source".into(), Value::from("inferred"));
        let mut judged = long.clone();
        if let NodeBody::Episodic(e) = &mut judged.body {
            e.outcome.success = Some(false);
        }
        assert_eq!(
            compare(&inferred, &judged),
            Growth::Grows,
            "a logged verdict"
        );
        let mut logged = long.clone();
        logged
            .metadata
            .insert("outcome_source".into(), Value::from("logged"));
        assert_eq!(compare(&logged, &long), Growth::Nothing, "the same verdict");
        let apart = apart(&short, other);
        assert_ne!(apart.id, short.id);
        assert_eq!(apart.metadata["conflicts_with"], short.id.to_string());
    }
}
