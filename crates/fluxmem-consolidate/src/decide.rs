//! Decision points: where a cluster's successful runs part ways between two steps of the
//! skeleton.
//!
//! The aligned profile ([`crate::mine`]) puts every run's steps in one column order, so the
//! columns between two skeleton steps are what the runs did there besides the procedure. The
//! **branch columns** of a gap are the ones at least `branch_support` of the successes hold
//! (the others are one run's story). Runs are grouped by the branch columns they hold in the
//! gap; where there are two groups or more, the gap is a decision point and each group a
//! **path** with its run count (a group that holds none of them took none of these steps).
//!
//! A path of at least two runs may have an **observation** that tells it apart, the first of:
//! - an error that every run of the path met at the skeleton step right before the gap, and no
//!   other run of the decision did;
//! - a field of that step's results whose value every run of the path saw and no other run
//!   did (each of those saw the field with another value);
//! - a word of the path's own steps (`clean` of `clean \`object\` with sinkbasin`, `cancel` of
//!   `cancel_reservation`) that every run's task has and no other run's task has: the request
//!   asked for that path.
//!
//! Values that could be instance data (with a digit, long) are never observations, and one
//! run's value is never one (a path needs two runs to have one).

use fluxmem_graph::Node;
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

use crate::mine::Column;

/// Characters an observed value may have at most (longer is free text, not a category).
const MAX_VALUE_CHARS: usize = 32;
/// Paths a decision shows at most (the rest are counted together).
const MAX_PATHS: usize = 4;

/// Where the successful runs part ways.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// The skeleton step the runs part ways after (`None`: before the first step).
    pub after: Option<usize>,
    /// The successful runs aligned.
    pub runs: usize,
    /// The paths, most runs first; a path with no steps is the runs that took none of them.
    pub paths: Vec<Path>,
    /// Runs in paths not shown ([`MAX_PATHS`]).
    pub others: usize,
}

/// One way the runs went at a decision point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Path {
    /// The steps, as rules name them (`Call \`x\` with \`a\`.`); empty: none of the branch steps.
    pub steps: Vec<String>,
    /// Their signatures.
    pub keys: Vec<String>,
    /// The runs that took it.
    pub runs: usize,
    /// What those runs, and no other run of the decision, saw right before the decision.
    pub when: Option<String>,
}

/// The decision points of a skeleton: `profile` the aligned columns, `kept` the profile indices
/// of the skeleton's steps (in order), `successes` the aligned runs (the occurrences' episode
/// indices point into it), `branch_support` the share of the runs a branch column needs.
pub(crate) fn decisions(
    profile: &[Column],
    kept: &[usize],
    successes: &[&Node],
    branch_support: f64,
) -> Vec<Decision> {
    let runs = successes.len();
    let kept_keys: BTreeSet<&str> = kept.iter().map(|&i| profile[i].key.as_str()).collect();
    let tool_steps = kept
        .iter()
        .any(|&i| profile[i].occurrences[0].1.tool.is_some());
    let min_holders = crate::mine::runs_needed(branch_support, runs).max(1);
    let mut out = Vec::new();
    for gap in 0..=kept.len() {
        let start = if gap == 0 { 0 } else { kept[gap - 1] + 1 };
        let end = kept.get(gap).copied().unwrap_or(profile.len());
        let branch_columns: Vec<&Column> = profile[start..end]
            .iter()
            .filter(|c| {
                let first = &c.occurrences[0].1;
                c.key != crate::mine::MESSAGE
                    && !kept_keys.contains(c.key.as_str())
                    && (!tool_steps || first.tool.is_some())
                    && c.holders().len() >= min_holders
            })
            .collect();
        if branch_columns.is_empty() {
            continue;
        }
        let after = gap.checked_sub(1);
        let before = after.map(|a| &profile[kept[a]]);
        if let Some(decision) = decide(&branch_columns, before, successes, after) {
            out.push(decision);
        }
    }
    out
}

/// The decision at one gap, or `None` when every run went the same way.
fn decide(
    branch_columns: &[&Column],
    before: Option<&Column>,
    successes: &[&Node],
    after: Option<usize>,
) -> Option<Decision> {
    let runs = successes.len();
    // Each run's path: the branch columns it holds, in order, a repeated step once.
    let holders: Vec<BTreeSet<usize>> = branch_columns.iter().map(|c| c.holders()).collect();
    let mut groups: BTreeMap<Vec<&str>, Vec<usize>> = BTreeMap::new();
    for run in 0..runs {
        let mut keys: Vec<&str> = Vec::new();
        for (column, held) in branch_columns.iter().zip(&holders) {
            if held.contains(&run) && !keys.contains(&column.key.as_str()) {
                keys.push(column.key.as_str());
            }
        }
        groups.entry(keys).or_default().push(run);
    }
    if groups.len() < 2 {
        return None;
    }
    let mut ranked: Vec<(Vec<&str>, Vec<usize>)> = groups.into_iter().collect();
    // Most runs first; paths with steps before the empty one on ties; then by the keys.
    ranked.sort_by(|a, b| {
        b.1.len()
            .cmp(&a.1.len())
            .then(a.0.is_empty().cmp(&b.0.is_empty()))
            .then(a.0.cmp(&b.0))
    });
    let observed: Vec<Observed> = (0..runs)
        .map(|run| observe(before, run, successes[run]))
        .collect();
    let tasks: Vec<BTreeSet<String>> = successes.iter().map(|n| words(&n.text)).collect();
    let shown = ranked.len().min(MAX_PATHS);
    let others = ranked[shown..].iter().map(|(_, r)| r.len()).sum();
    let paths = ranked[..shown]
        .iter()
        .map(|(keys, members)| {
            let steps = keys
                .iter()
                .map(|key| {
                    let column = branch_columns
                        .iter()
                        .find(|c| c.key == *key)
                        .expect("a path's key is a branch column's");
                    crate::mine::render_short(column)
                })
                .collect();
            Path {
                steps,
                keys: keys.iter().map(|k| k.to_string()).collect(),
                runs: members.len(),
                when: telling(members, &observed, before).or_else(|| asked(members, &tasks, keys)),
            }
        })
        .collect();
    Some(Decision {
        after,
        runs,
        paths,
        others,
    })
}

/// What one run saw at the skeleton step before a decision: the scalar leaves of its results
/// (`path` → values) and the error it met there, if any.
#[derive(Default)]
struct Observed {
    leaves: BTreeMap<String, BTreeSet<String>>,
    error: Option<String>,
}

/// The results of `run`'s calls aligned to `before`.
fn observe(before: Option<&Column>, run: usize, node: &Node) -> Observed {
    let mut observed = Observed::default();
    let Some(before) = before else {
        return observed;
    };
    let Some(episode) = node.episode() else {
        return observed;
    };
    for (_, signed) in before.occurrences.iter().filter(|(e, _)| *e == run) {
        observed.error = observed.error.or_else(|| signed.error.clone());
        for &(step, call) in &signed.at {
            let result = episode
                .steps
                .get(step)
                .and_then(|s| s.tool_calls.get(call))
                .and_then(|c| c.result.as_deref());
            if let Some(value) = result.and_then(|r| serde_json::from_str::<Value>(r).ok()) {
                leaves(&value, String::new(), &mut observed.leaves);
            }
        }
    }
    observed
}

/// The scalar leaves of `value` by path (`a.b`, arrays as `[*]`), as their JSON text.
fn leaves(value: &Value, path: String, out: &mut BTreeMap<String, BTreeSet<String>>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                leaves(child, path, out);
            }
        }
        Value::Array(items) => {
            for item in items {
                leaves(item, format!("{path}[*]"), out);
            }
        }
        Value::Null => {}
        scalar => {
            out.entry(path).or_default().insert(scalar.to_string());
        }
    }
}

/// A value that names a category rather than an instance: a boolean, or a short string with no
/// digit.
fn is_category(json: &str) -> bool {
    match serde_json::from_str::<Value>(json) {
        Ok(Value::Bool(_)) => true,
        Ok(Value::String(text)) => {
            !text.trim().is_empty()
                && text.chars().count() <= MAX_VALUE_CHARS
                && !text.chars().any(|c| c.is_ascii_digit())
        }
        _ => false,
    }
}

/// The observation that tells `members` apart from the decision's other runs (see the module
/// docs), in the words a skill uses.
fn telling(members: &[usize], observed: &[Observed], before: Option<&Column>) -> Option<String> {
    let before = before?;
    if members.len() < 2 {
        return None;
    }
    let outside: Vec<&Observed> = (0..observed.len())
        .filter(|run| !members.contains(run))
        .map(|run| &observed[run])
        .collect();
    let inside: Vec<&Observed> = members.iter().map(|&run| &observed[run]).collect();
    let step = before.occurrences[0]
        .1
        .tool
        .as_deref()
        .map_or_else(|| before.key.clone(), |t| format!("`{t}`"));
    if inside.iter().all(|o| o.error.is_some()) && outside.iter().all(|o| o.error.is_none()) {
        let example = crate::mine::instance_free(
            &inside[0]
                .error
                .as_deref()
                .unwrap_or_default()
                .chars()
                .take(80)
                .collect::<String>(),
        )
        .replace('"', "'")
        .replace('\n', " ");
        return Some(format!("when {step} failed (\"{example}\")"));
    }
    let first = inside[0];
    for (path, values) in &first.leaves {
        for value in values.iter().filter(|v| is_category(v)) {
            let everyone_inside = inside
                .iter()
                .all(|o| o.leaves.get(path).is_some_and(|v| v.contains(value)));
            let nobody_outside = outside.iter().all(|o| {
                o.leaves
                    .get(path)
                    .is_some_and(|v| !v.is_empty() && !v.contains(value))
            });
            if everyone_inside && nobody_outside {
                return Some(format!("when {step} returned `{path}` = {value}"));
            }
        }
    }
    None
}

/// Lower-case words of a text (letters only, at least 3).
fn words(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !c.is_alphabetic())
        .filter(|w| w.chars().count() >= 3)
        .map(str::to_lowercase)
        .collect()
}

/// A word of the path's steps that the tasks of `members`, and of no other run, have.
fn asked(members: &[usize], tasks: &[BTreeSet<String>], keys: &[&str]) -> Option<String> {
    if members.len() < 2 {
        return None;
    }
    let own: Vec<String> = keys
        .iter()
        .flat_map(|k| {
            // A tool's name (not its argument keys), or a text action's words.
            let named = crate::mine::key_tool(k).unwrap_or(k);
            named
                .split(|c: char| !c.is_alphabetic())
                .filter(|w| w.chars().count() >= 3 && !crate::mine::is_frame_word(w))
                .map(str::to_lowercase)
        })
        .collect();
    own.into_iter()
        .find(|word| {
            (0..tasks.len()).all(|run| tasks[run].contains(word) == members.contains(&run))
        })
        .map(|word| format!("when the task says \"{word}\""))
}

/// How a decision reads in a skill. `step_number`: the 1-based number of the skill step the
/// runs part ways after (`None`: before the first step). One path of steps beside the runs that
/// took none is an optional detour (`After step 2, 1 of 4 successful runs also ...`); more are
/// a choice (`After step 2, the successful runs part ways: in 3 of 5 runs, ...`).
pub(crate) fn render(decision: &Decision, step_number: Option<usize>) -> String {
    let at = match step_number {
        Some(n) => format!("After step {n}"),
        None => "Before step 1".to_string(),
    };
    let steps_of = |path: &Path| -> String {
        path.steps
            .iter()
            .map(|s| lower_first(s.trim_end_matches('.')))
            .collect::<Vec<_>>()
            .join(", then ")
    };
    let when_of = |path: &Path| -> String {
        path.when
            .as_deref()
            .map(|w| format!(", {w},"))
            .unwrap_or_default()
    };
    let with_steps: Vec<&Path> = decision
        .paths
        .iter()
        .filter(|p| !p.steps.is_empty())
        .collect();
    if let ([detour], 0) = (with_steps.as_slice(), decision.others) {
        let also = format!(
            "{at}, {} of {} successful runs{} also {}; the others do not.",
            detour.runs,
            decision.runs,
            when_of(detour),
            steps_of(detour)
        );
        return also;
    }
    let mut said: Vec<String> = decision
        .paths
        .iter()
        .map(|path| {
            let share = format!("in {} of {} runs", path.runs, decision.runs);
            let when = path
                .when
                .as_deref()
                .map(|w| format!(", {w}"))
                .unwrap_or_default();
            let steps = if path.steps.is_empty() {
                "none of these steps".to_string()
            } else {
                steps_of(path)
            };
            format!("{share}{when}: {steps}")
        })
        .collect();
    if decision.others > 0 {
        said.push(format!(
            "in {} of {} runs: other combinations of them",
            decision.others, decision.runs
        ));
    }
    format!("{at}, the successful runs part ways: {}.", said.join("; "))
}

fn lower_first(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|c| c.to_lowercase().collect::<String>() + chars.as_str())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mine::{mine, MineOptions};
    use fluxmem_graph::{Step, ToolCall};

    fn call(name: &str, arguments: &str, result: &str) -> Step {
        Step {
            tool_calls: vec![ToolCall {
                name: name.into(),
                arguments: arguments.into(),
                result: Some(result.into()),
            }],
            ..Step::default()
        }
    }

    /// A run that looks a reservation up, then either transfers (a basic-economy booking) or
    /// changes it (any other cabin).
    fn run(id: &str, cabin: &str) -> Node {
        let lookup = call(
            "get_reservation",
            &format!(r#"{{"reservation_id":"{id}"}}"#),
            &format!(r#"{{"reservation_id":"{id}","cabin":"{cabin}","origin":"JFK"}}"#),
        );
        let next = if cabin == "basic" {
            vec![call("transfer", r#"{"summary":"basic fare"}"#, "ok")]
        } else {
            vec![
                call("search", r#"{"origin":"JFK"}"#, r#"[{"flight":"HAT001"}]"#),
                call(
                    "change",
                    &format!(r#"{{"reservation_id":"{id}","flight":"HAT001"}}"#),
                    "done",
                ),
            ]
        };
        let mut steps = vec![call(
            "get_user",
            r#"{"user_id":"mia_11"}"#,
            &format!(r#"{{"reservations":["{id}"]}}"#),
        )];
        steps.push(lookup);
        steps.extend(next);
        steps.push(call("send_note", r#"{"text":"bye now"}"#, "sent"));
        crate::mine::tests::succeeded(&format!("help with {id}"), steps, &[id])
    }

    #[test]
    fn runs_that_part_ways_show_each_path_with_its_support_and_what_tells_it_apart() {
        let runs = [
            run("AAA", "basic"),
            run("BBB", "economy"),
            run("CCC", "basic"),
            run("DDD", "business"),
            run("EEE", "basic"),
        ];
        let refs: Vec<&Node> = runs.iter().collect();
        let roles = crate::flow::ToolRoles::learn(refs.iter().copied());
        let skeleton = mine(&refs, &[], &MineOptions::default(), &roles).unwrap();
        let steps: Vec<&str> = skeleton
            .steps
            .iter()
            .map(|s| s.tool.as_deref().unwrap())
            .collect();
        assert_eq!(steps, ["get_user", "get_reservation", "send_note"]);
        assert_eq!(skeleton.decisions.len(), 1, "{:#?}", skeleton.decisions);
        let decision = &skeleton.decisions[0];
        assert_eq!(decision.after, Some(1), "after the reservation lookup");
        assert_eq!(decision.runs, 5);
        let paths: Vec<(Vec<&str>, usize, Option<&str>)> = decision
            .paths
            .iter()
            .map(|p| {
                (
                    p.steps.iter().map(String::as_str).collect(),
                    p.runs,
                    p.when.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            paths,
            [
                (
                    vec!["Call `transfer` with `summary`."],
                    3,
                    Some("when `get_reservation` returned `cabin` = \"basic\"")
                ),
                (
                    vec![
                        "Call `search` with `origin`.",
                        "Call `change` with `flight`, `reservation_id`."
                    ],
                    2,
                    None
                ),
            ],
            "two cabins take the change path: no one value tells it apart"
        );
        // Every stated support and observation holds in the runs themselves, counted here
        // without the miner: the runs calling the path's first tool after the lookup, and those
        // of them whose lookup returned the cabin.
        for path in &decision.paths {
            let tool = path.keys[0]
                .trim_start_matches("call ")
                .split('(')
                .next()
                .unwrap();
            let taking: Vec<&Node> = runs
                .iter()
                .filter(|n| {
                    let steps = &n.episode().unwrap().steps;
                    let lookup = steps
                        .iter()
                        .position(|s| s.tool_calls[0].name == "get_reservation")
                        .unwrap();
                    steps[lookup + 1..]
                        .iter()
                        .any(|s| s.tool_calls[0].name == tool)
                })
                .collect();
            assert_eq!(taking.len(), path.runs, "{tool}");
            if path.when.is_some() {
                let basic = |n: &&Node| {
                    n.episode().unwrap().steps[1].tool_calls[0]
                        .result
                        .as_deref()
                        .unwrap()
                        .contains(r#""cabin":"basic""#)
                };
                assert!(taking.iter().all(basic));
                assert_eq!(runs.iter().filter(basic).count(), path.runs);
            }
        }
        let text = render(decision, Some(2));
        assert_eq!(
            text,
            "After step 2, the successful runs part ways: in 3 of 5 runs, when `get_reservation` returned `cabin` = \"basic\": call `transfer` with `summary`; in 2 of 5 runs: call `search` with `origin`, then call `change` with `flight`, `reservation_id`."
        );
    }

    fn text_run(task: &str, actions: &[&str]) -> Node {
        let steps: Vec<(&str, &str)> = actions.iter().map(|action| ("", *action)).collect();
        crate::mine::tests::observed(task, &steps)
    }

    #[test]
    fn a_path_the_request_asked_for_says_so() {
        let path = |verb: &str, tool: &str, object: &str| -> Vec<String> {
            vec![
                format!("go to shelf 1"),
                format!("take {object} 1 from shelf 1"),
                format!("go to {tool} 1"),
                format!("{verb} {object} 1 with {tool} 1"),
                format!("go to fridge 1"),
                format!("put {object} 1 in/on fridge 1"),
            ]
        };
        let plain = |object: &str| -> Vec<String> {
            vec![
                format!("go to shelf 1"),
                format!("take {object} 1 from shelf 1"),
                format!("go to fridge 1"),
                format!("put {object} 1 in/on fridge 1"),
            ]
        };
        let runs: Vec<Node> = [
            (
                "clean some apple and put it in fridge",
                path("clean", "sinkbasin", "apple"),
            ),
            (
                "heat some egg and put it in fridge",
                path("heat", "microwave", "egg"),
            ),
            (
                "clean some cup and put it in fridge",
                path("clean", "sinkbasin", "cup"),
            ),
            ("put some pan in fridge", plain("pan")),
            (
                "heat some mug and put it in fridge",
                path("heat", "microwave", "mug"),
            ),
        ]
        .iter()
        .map(|(task, actions)| {
            let refs: Vec<&str> = actions.iter().map(String::as_str).collect();
            text_run(task, &refs)
        })
        .collect();
        let refs: Vec<&Node> = runs.iter().collect();
        let roles = crate::flow::ToolRoles::learn(refs.iter().copied());
        let skeleton = mine(&refs, &[], &MineOptions::default(), &roles).unwrap();
        let decision = skeleton
            .decisions
            .iter()
            .find(|d| d.paths.len() == 3)
            .unwrap_or_else(|| panic!("{:#?}", skeleton.decisions));
        let said: Vec<(Vec<&str>, usize, Option<&str>)> = decision
            .paths
            .iter()
            .map(|p| {
                (
                    p.steps.iter().map(String::as_str).collect(),
                    p.runs,
                    p.when.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            said,
            [
                (
                    vec!["Clean `object` with sinkbasin."],
                    2,
                    Some("when the task says \"clean\"")
                ),
                (
                    vec!["Heat `object` with microwave."],
                    2,
                    Some("when the task says \"heat\"")
                ),
                (vec![], 1, None),
            ],
            "{:#?}",
            skeleton.steps
        );
        // The tasks the observation names are exactly the runs of its path.
        for path in decision.paths.iter().filter(|p| p.when.is_some()) {
            let verb = path.keys[0].split(' ').next().unwrap();
            let asking = runs.iter().filter(|n| n.text.contains(verb)).count();
            let doing = runs
                .iter()
                .filter(|n| {
                    n.episode()
                        .unwrap()
                        .steps
                        .iter()
                        .any(|s| s.action.starts_with(verb))
                })
                .count();
            assert_eq!((asking, doing), (path.runs, path.runs));
        }
    }

    #[test]
    fn identifiers_and_one_run_values_are_never_observations() {
        // Two paths of one run each: every field differs, none may tell them apart.
        let runs = [run("AAA", "basic"), run("BBB", "economy")];
        let refs: Vec<&Node> = runs.iter().collect();
        let roles = crate::flow::ToolRoles::learn(refs.iter().copied());
        let skeleton = mine(&refs, &[], &MineOptions::default(), &roles).unwrap();
        assert_eq!(skeleton.decisions.len(), 1);
        assert!(skeleton.decisions[0].paths.iter().all(|p| p.when.is_none()));
        assert!(!is_category("\"AAA123\""));
        assert!(!is_category("42"));
        assert!(is_category("\"basic\"") && is_category("true"));
    }
}
