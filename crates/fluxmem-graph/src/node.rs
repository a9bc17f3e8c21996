use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

use crate::NodeId;

/// The three layers of the memory graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeKind {
    /// Static knowledge used as evidence.
    Semantic,
    /// One task and its trajectory.
    Episodic,
    /// A skill distilled from episodes.
    Procedural,
}

impl NodeKind {
    /// All kinds, in storage order.
    pub const ALL: [NodeKind; 3] = [NodeKind::Semantic, NodeKind::Episodic, NodeKind::Procedural];

    /// The name stored in the `kind` column.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeKind::Semantic => "semantic",
            NodeKind::Episodic => "episodic",
            NodeKind::Procedural => "procedural",
        }
    }

    /// Parses a `kind` column value.
    pub fn parse(value: &str) -> Option<NodeKind> {
        NodeKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == value)
    }

    pub(crate) fn id_prefix(self) -> &'static str {
        match self {
            NodeKind::Semantic => "sem",
            NodeKind::Episodic => "epi",
            NodeKind::Procedural => "pro",
        }
    }
}

/// A node of the memory graph: the fields every layer has, plus the layer's own [`NodeBody`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// Content-addressed id.
    pub id: NodeId,
    /// Tenant / namespace; `default` when the input does not say.
    pub tenant: String,
    /// The agent that produced the record, where known.
    pub agent_id: Option<String>,
    /// The file the node came from (as given on the command line), or the stage that made it.
    pub source_file: String,
    /// Where in that file: `line 12`, `conv-26/D1:3`, `runs[4]`, `chunk 2`.
    pub source_locator: String,
    /// When the record says it was created (milliseconds since the Unix epoch, UTC); for
    /// records without a time, the source file's modification time; `None` if neither exists.
    pub created_at: Option<i64>,
    /// The node's main text: the fact (semantic), the task (episodic), the skill (procedural).
    pub text: String,
    /// Free metadata: everything the input carried that has no column of its own.
    pub metadata: BTreeMap<String, Value>,
    /// The layer-specific part.
    pub body: NodeBody,
}

/// The layer-specific part of a [`Node`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum NodeBody {
    /// A semantic node.
    Semantic(Semantic),
    /// An episodic node.
    Episodic(Episode),
    /// A procedural node.
    Procedural(Skill),
}

/// Semantic fields: where the fact sits in its source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Semantic {
    /// The source document or conversation (`conv-26`, `policy.md`).
    pub source: String,
    /// Position inside the source (turn index, chunk index), 0-based.
    pub position: i64,
    /// The time as the source writes it (`1:56 pm on 8 May, 2023`), if any.
    pub time: Option<String>,
    /// A grouping inside the source (a dialogue session, a document section), if any.
    pub group: Option<String>,
}

/// Episodic fields: the trajectory and how it ended.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Episode {
    /// Ordered steps.
    pub steps: Vec<Step>,
    /// The outcome.
    pub outcome: Outcome,
}

/// One step of a trajectory: what the agent saw, what it did, and what it was told.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Step {
    /// What the agent observed before acting (user message, tool result, environment text).
    pub observation: String,
    /// What the agent did (message, command), empty if it only called tools.
    pub action: String,
    /// Tool calls made in this step.
    pub tool_calls: Vec<ToolCall>,
    /// Per-step feedback (tool error, user correction), if any.
    pub feedback: Option<String>,
    /// When the step happened (ms since epoch, UTC), if logged.
    pub timestamp: Option<i64>,
}

/// A tool call and its result.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ToolCall {
    /// Tool name.
    pub name: String,
    /// Arguments as JSON text.
    pub arguments: String,
    /// The tool's result, if logged.
    pub result: Option<String>,
}

/// How an episode ended.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Outcome {
    /// Success flag, `None` when the log does not say.
    pub success: Option<bool>,
    /// Reward, if logged.
    pub reward: Option<f64>,
    /// Final feedback, if logged.
    pub feedback: Option<String>,
}

/// Procedural fields: a versioned skill and where it came from.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Skill {
    /// Version, starting at 1.
    pub version: i64,
    /// Ids of the previous versions of this skill, oldest first.
    pub previous_versions: Vec<NodeId>,
    /// Episodes the skill was distilled from.
    pub source_episodes: Vec<NodeId>,
    /// PEMS score of each refinement round, in order.
    pub pems_history: Vec<f64>,
}

impl NodeBody {
    /// The layer of this body.
    pub fn kind(&self) -> NodeKind {
        match self {
            NodeBody::Semantic(_) => NodeKind::Semantic,
            NodeBody::Episodic(_) => NodeKind::Episodic,
            NodeBody::Procedural(_) => NodeKind::Procedural,
        }
    }
}

impl Node {
    /// A node whose id is the content address of `body`'s kind, `tenant` and `identity`.
    ///
    /// `identity` lists what makes the record unique (source name, locator, text...); the
    /// caller picks it so that the same record always maps to the same id. Provenance fields
    /// start empty; set them with the struct fields.
    pub fn new(body: NodeBody, tenant: &str, text: &str, identity: &[&str]) -> Node {
        Node {
            id: NodeId::content(body.kind(), tenant, identity),
            tenant: tenant.to_string(),
            agent_id: None,
            source_file: String::new(),
            source_locator: String::new(),
            created_at: None,
            text: text.to_string(),
            metadata: BTreeMap::new(),
            body,
        }
    }

    /// The layer of this node.
    pub fn kind(&self) -> NodeKind {
        self.body.kind()
    }

    /// The episode body, if this is an episodic node.
    pub fn episode(&self) -> Option<&Episode> {
        match &self.body {
            NodeBody::Episodic(episode) => Some(episode),
            _ => None,
        }
    }

    /// Where an episode's outcome came from: its `metadata.outcome_source` (`logged`, `status`,
    /// `inferred`, `judged` or `none`, set by ingest), else `logged` when it has an outcome (a
    /// store written before sources were recorded) and `none` when it has not.
    pub fn outcome_source(&self) -> &str {
        match self.metadata.get("outcome_source").and_then(Value::as_str) {
            Some(source) => source,
            None if self.episode().is_some_and(|e| e.outcome.success.is_some()) => "logged",
            None => "none",
        }
    }
}

impl Node {
    /// The text the embed stage embeds for this node: the fact (semantic), the task followed by
    /// the actions taken (episodic), the skill (procedural). The embedder truncates it at its
    /// maximum length, so the task always comes first.
    pub fn embedding_text(&self) -> String {
        match &self.body {
            NodeBody::Episodic(episode) => {
                let mut text = self.text.clone();
                for step in &episode.steps {
                    let action = step.action.trim();
                    let tools: Vec<&str> =
                        step.tool_calls.iter().map(|c| c.name.as_str()).collect();
                    if !action.is_empty() || !tools.is_empty() {
                        text.push_str("\n- ");
                        text.push_str(action);
                        if !tools.is_empty() {
                            text.push_str(&format!(" [{}]", tools.join(", ")));
                        }
                    }
                }
                text
            }
            _ => self.text.clone(),
        }
    }
}
