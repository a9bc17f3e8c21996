//! Data flow of tool arguments: where each argument value of a call came from, found in the
//! episode itself, with no model and no tool names.
//!
//! For every call, each leaf of its arguments (a string or number of at least
//! [`MIN_TRACE_CHARS`] characters; `flights[0].date` is a leaf of `flights`) is looked up in
//! what the agent had seen before the call:
//!
//! - the **result of an earlier call**, the most recent one first: a JSON leaf equal to the
//!   value gives the call's tool and the leaf's path with array indexes as `[*]`
//!   (`get_user_details` → `payment_methods[*].id`); a result that is not JSON, or holds the
//!   value only inside a longer text, gives the tool with no path;
//! - the **user**: the task and the observations up to the call, each observation with the
//!   result texts of the calls before it taken out, hold the value (case-insensitive). Each
//!   observation is cleaned once, so the pass costs the episode's text times its calls, not
//!   that squared.
//!
//! Both may hold a value; both are recorded. Values themselves are never kept beyond the
//! analysis (they are instance data): only their sources leave this module.
//!
//! The same pass tells what each call's result did for the episode: whether a later call took
//! an argument from it ([`CallFlow::fed_later`]) and whether it was empty. A tool whose logged
//! results are all empty and never feed a later call records nothing the procedure needs (a
//! scratchpad): the miner leaves it out ([`ToolRoles`]).

use fluxmem_graph::Node;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// Argument values shorter than this (as text) are not traced: `1`, `no` or `NY` would be
/// found by chance in almost any earlier text.
pub const MIN_TRACE_CHARS: usize = 3;

/// Where an argument value came from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    /// The result of an earlier call of `tool`, at `path` (`""` when the value is inside a
    /// text result rather than a JSON leaf).
    Result { tool: String, path: String },
    /// The task or a message of the user before the call.
    User,
    /// A text command's value that the task names.
    Task,
    /// A text command's value that an earlier command (its verb, `go to`) also had.
    Command { verb: String },
    /// A text command's value that an observation before it shows: the one after the command
    /// with this verb (empty: the first observation, before any command).
    Seen { verb: String },
}

impl Source {
    /// How a skill says it.
    pub fn describe(&self) -> String {
        match self {
            Source::User => "from the user".to_string(),
            Source::Result { tool, path } if path.is_empty() => {
                format!("from the result of `{tool}`")
            }
            Source::Result { tool, path } => format!("from `{tool}` → `{path}`"),
            Source::Task => "named in the task".to_string(),
            Source::Command { verb } => format!("as in the last `{verb}`"),
            Source::Seen { verb } if verb.is_empty() => "seen at the start".to_string(),
            Source::Seen { verb } => format!("seen after `{verb}`"),
        }
    }
}

/// One call of an episode, as the data flow sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct CallFlow {
    /// Index of the step the call is in.
    pub step: usize,
    /// The tool.
    pub tool: String,
    /// For each top-level argument key (sorted), the sources of its traced leaves.
    pub sources: BTreeMap<String, BTreeSet<Source>>,
    /// Argument keys with at least one traced leaf (a value long enough to trace).
    pub traced: BTreeSet<String>,
    /// A later call of the episode took an argument value from this call's result.
    pub fed_later: bool,
    /// The result was logged and empty.
    pub empty_result: bool,
    /// The result was logged.
    pub has_result: bool,
    /// What the agent saw right before the call (its step's observation, the results of the
    /// calls before the step taken out) opens a line with an agreement ([`AGREEMENTS`]): the user said yes to it.
    pub agreed: bool,
}

/// Words that open a user's agreement (`yes, go ahead`). English only: a fleet in another
/// language sees no confirmations, never wrong ones.
pub const AGREEMENTS: [&str; 9] = [
    "yes",
    "yeah",
    "yep",
    "sure",
    "ok",
    "okay",
    "confirm",
    "confirmed",
    "proceed",
];

/// Whether a line opens with an agreement (within its first three words, after a role tag
/// such as `[user]`).
fn agrees(line: &str) -> bool {
    line.to_lowercase()
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .skip_while(|w| *w == "user")
        .take(3)
        .any(|w| AGREEMENTS.contains(&w))
}

/// The calls of `node`'s episode in order, with the sources of their arguments.
pub fn episode_flow(node: &Node) -> Vec<CallFlow> {
    let Some(episode) = node.episode() else {
        return Vec::new();
    };
    struct Earlier {
        tool: String,
        result: String,
        leaves: BTreeMap<String, String>,
        /// The call's own argument values: a result that echoes them fed nothing new.
        given: BTreeSet<String>,
    }
    let mut earlier: Vec<Earlier> = Vec::new();
    let mut out: Vec<CallFlow> = Vec::new();
    // What the user said so far: the task, then each observation with the results of the calls
    // before it taken out, each cleaned once as its step begins.
    let mut user_text = node.text.to_lowercase();
    for (index, step) in episode.steps.iter().enumerate() {
        let observation = earlier
            .iter()
            .filter(|e| e.result.len() >= MIN_TRACE_CHARS)
            .fold(step.observation.to_lowercase(), |text, e| {
                text.replace(&e.result, " ")
            });
        let agreed = observation.lines().any(agrees);
        user_text.push('\n');
        user_text.push_str(&observation);
        for call in &step.tool_calls {
            let arguments: BTreeMap<String, Value> =
                serde_json::from_str(&call.arguments).unwrap_or_default();
            let mut sources: BTreeMap<String, BTreeSet<Source>> = BTreeMap::new();
            let mut traced = BTreeSet::new();
            for (key, value) in &arguments {
                let entry = sources.entry(key.clone()).or_default();
                for leaf in leaf_values(value) {
                    if leaf.chars().count() < MIN_TRACE_CHARS {
                        continue;
                    }
                    traced.insert(key.clone());
                    if user_text.contains(&leaf) {
                        entry.insert(Source::User);
                    }
                    let holders: Vec<(usize, String)> = earlier
                        .iter()
                        .enumerate()
                        .filter_map(|(i, e)| {
                            e.leaves
                                .get(&leaf)
                                .map(|path| (i, path.clone()))
                                .or_else(|| e.result.contains(&leaf).then(|| (i, String::new())))
                        })
                        .collect();
                    // Every earlier call of another tool that returned the value (and was not
                    // given it) fed this one; the most recent is the source a skill names.
                    for (i, _) in &holders {
                        if earlier[*i].tool != call.name && !earlier[*i].given.contains(&leaf) {
                            // `out` and `earlier` hold the same calls, in order.
                            out[*i].fed_later = true;
                        }
                    }
                    if let Some((i, path)) = holders.last() {
                        entry.insert(Source::Result {
                            tool: earlier[*i].tool.clone(),
                            path: path.clone(),
                        });
                    }
                }
            }
            let result = call.result.as_deref().unwrap_or("").to_lowercase();
            out.push(CallFlow {
                step: index,
                tool: call.name.clone(),
                sources,
                traced,
                fed_later: false,
                empty_result: call.result.as_deref().is_some_and(|r| r.trim().is_empty()),
                has_result: call.result.is_some(),
                agreed,
            });
            earlier.push(Earlier {
                tool: call.name.clone(),
                leaves: result_leaves(&result),
                result,
                given: arguments.values().flat_map(leaf_values).collect(),
            });
        }
    }
    out
}

/// The traceable leaves of an argument value, lower-cased (numbers as JSON writes them).
fn leaf_values(value: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk(value, String::new(), &mut |_, leaf| out.push(leaf));
    out
}

/// The leaves of a JSON result, each with the first path it is found at (`[*]` for indexes).
fn result_leaves(result: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Ok(value) = serde_json::from_str::<Value>(result) {
        walk(&value, String::new(), &mut |path, leaf| {
            if leaf.chars().count() >= MIN_TRACE_CHARS {
                out.entry(leaf).or_insert(path);
            }
        });
    }
    out
}

fn walk(value: &Value, path: String, visit: &mut dyn FnMut(String, String)) {
    match value {
        Value::String(s) => visit(path, s.trim().to_lowercase()),
        Value::Number(n) => visit(path, n.to_string()),
        Value::Array(items) => {
            for item in items {
                walk(item, format!("{path}[*]"), visit);
            }
        }
        Value::Object(fields) => {
            for (key, item) in fields {
                let path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                walk(item, path, visit);
            }
        }
        Value::Bool(_) | Value::Null => {}
    }
}

/// Tool-name verbs that say a tool reads (`get_order`, `search_flights`): the convention of
/// tool APIs in general, not any one dataset's tool list.
pub const READ_VERBS: [&str; 8] = [
    "get", "search", "list", "find", "lookup", "read", "fetch", "query",
];

/// Whether the tool's name starts with a read verb (`get_order`, `listFiles`, `search`).
pub fn named_as_read(tool: &str) -> bool {
    let lower = tool.to_ascii_lowercase();
    READ_VERBS.iter().any(|verb| {
        lower.strip_prefix(verb).is_some_and(|rest| {
            rest.is_empty()
                || rest.starts_with(['_', '-', '.'])
                || tool[verb.len()..].starts_with(|c: char| c.is_ascii_uppercase())
        })
    })
}

/// What the calls of a set of episodes say about each tool, learned from the logs: a tool
/// whose logged results are all empty and never feed a later call is **noise** (it returns
/// nothing the procedure uses: a scratchpad); a tool named with a read verb, or whose results
/// feed a call of another tool in at least half of its calls, is a **reader**; of the rest,
/// a tool whose calls are mostly followed by a call of another such tool **prepares** that
/// call (a computation before a booking); the others are **acting** tools: their calls end a
/// line of work (a change, a transfer), and they name a procedure.
#[derive(Debug, Clone, Default)]
pub struct ToolRoles {
    /// Per tool: calls, calls that fed a later call, calls with a logged empty result, calls
    /// with a logged result, calls followed (in their episode) by a call of another tool that
    /// is neither noise nor a reader.
    counts: BTreeMap<String, [usize; 5]>,
}

impl ToolRoles {
    /// Learns the roles from `nodes`' episodes.
    pub fn learn<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> ToolRoles {
        let flows: Vec<Vec<CallFlow>> = nodes.into_iter().map(episode_flow).collect();
        let mut roles = ToolRoles::default();
        for call in flows.iter().flatten() {
            let entry = roles.counts.entry(call.tool.clone()).or_default();
            entry[0] += 1;
            entry[1] += usize::from(call.fed_later);
            entry[2] += usize::from(call.empty_result);
            entry[3] += usize::from(call.has_result);
        }
        let doers: BTreeSet<String> = roles
            .counts
            .keys()
            .filter(|t| !roles.is_noise(t) && !roles.is_reader(t))
            .cloned()
            .collect();
        for flow in &flows {
            for (i, call) in flow.iter().enumerate() {
                let followed = flow[i + 1..]
                    .iter()
                    .any(|later| later.tool != call.tool && doers.contains(&later.tool));
                if followed {
                    roles.counts.get_mut(&call.tool).expect("counted")[4] += 1;
                }
            }
        }
        roles
    }

    /// The tool records nothing the procedure needs: no call fed a later one and every logged
    /// result (at least one) is empty.
    pub fn is_noise(&self, tool: &str) -> bool {
        self.counts
            .get(tool)
            .is_some_and(|[_, fed, empty, logged, _]| *fed == 0 && *logged > 0 && empty == logged)
    }

    /// Named with a read verb, or its results feed another tool in at least half its calls.
    pub fn is_reader(&self, tool: &str) -> bool {
        named_as_read(tool)
            || self
                .counts
                .get(tool)
                .is_some_and(|[calls, fed, ..]| *calls > 0 && 2 * fed >= *calls)
    }

    /// Neither noise nor a reader, and not mostly followed by another tool that does work.
    pub fn is_acting(&self, tool: &str) -> bool {
        self.counts.get(tool).is_some_and(|[calls, .., followed]| {
            !self.is_noise(tool) && !self.is_reader(tool) && 2 * followed < *calls
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreements_open_a_line() {
        assert!(agrees("[user] yes, please go ahead"));
        assert!(agrees("ok"));
        assert!(agrees("[user] Sure thing."));
        assert!(!agrees("[user] i am not sure about the date"));
        assert!(!agrees("[get_order] {\"status\": \"confirmed\"}"));
    }

    #[test]
    fn read_verbs_are_whole_words_of_the_name() {
        for read in [
            "get_order",
            "search",
            "listFiles",
            "lookup-user",
            "fetch.page",
        ] {
            assert!(named_as_read(read), "{read}");
        }
        for act in ["getaway_book", "cancel_order", "listen", "update_query"] {
            assert!(!named_as_read(act), "{act}");
        }
    }
}
