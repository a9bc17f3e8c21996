//! Arrow schemas of the four stored tables and the mapping between them and the graph model.
//!
//! | table | one row per | key |
//! |---|---|---|
//! | `nodes` | node (all layers; layer columns are null for other layers) | `id` |
//! | `steps` | step of an episodic node | (`episode_id`, `step_index`) |
//! | `edges` | edge | (`src`, `dst`, `kind`) |
//! | `embeddings` | (node, model) pair; `vector` is `FixedSizeList<Float32, dim>` | (`node_id`, `model_id`) |
//! | `edits` | recorded change (the edit log; append-only, rows kept in commit order) | `id` |
//!
//! Free-form maps (`metadata`, `tool_calls`) are JSON text so every Parquet reader can load
//! them; timestamps are `Timestamp(Millisecond, "UTC")`.

use arrow_array::builder::{
    BooleanBuilder, FixedSizeListBuilder, Float32Builder, Float64Builder, Int64Builder,
    ListBuilder, StringBuilder, TimestampMillisecondBuilder,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int64Type, TimestampMillisecondType};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::{
    Edge, EdgeKind, Edit, Embedding, Episode, Error, Node, NodeBody, NodeId, NodeKind, Outcome,
    Result, Semantic, Skill, Step,
};

/// Names of the stored tables, in the order a commit writes them.
pub const TABLES: [&str; 5] = ["nodes", "steps", "edges", "embeddings", "edits"];

fn timestamp() -> DataType {
    DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()))
}

fn utf8_list() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)))
}

/// Schema of the `nodes` table.
pub fn nodes_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("kind", DataType::Utf8, false),
        Field::new("tenant", DataType::Utf8, false),
        Field::new("agent_id", DataType::Utf8, true),
        Field::new("source_file", DataType::Utf8, false),
        Field::new("source_locator", DataType::Utf8, false),
        Field::new("created_at", timestamp(), true),
        Field::new("text", DataType::Utf8, false),
        Field::new("metadata", DataType::Utf8, false),
        Field::new("source", DataType::Utf8, true),
        Field::new("position", DataType::Int64, true),
        Field::new("time", DataType::Utf8, true),
        Field::new("section", DataType::Utf8, true),
        Field::new("success", DataType::Boolean, true),
        Field::new("reward", DataType::Float64, true),
        Field::new("outcome_feedback", DataType::Utf8, true),
        Field::new("step_count", DataType::Int64, true),
        Field::new("version", DataType::Int64, true),
        Field::new("previous_versions", utf8_list(), true),
        Field::new("source_episodes", utf8_list(), true),
        Field::new(
            "pems_history",
            DataType::List(Arc::new(Field::new("item", DataType::Float64, true))),
            true,
        ),
    ]))
}

/// Schema of the `steps` table.
pub fn steps_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("episode_id", DataType::Utf8, false),
        Field::new("step_index", DataType::Int64, false),
        Field::new("observation", DataType::Utf8, false),
        Field::new("action", DataType::Utf8, false),
        Field::new("tool_calls", DataType::Utf8, false),
        Field::new("feedback", DataType::Utf8, true),
        Field::new("timestamp", timestamp(), true),
    ]))
}

/// Schema of the `edges` table.
pub fn edges_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("src", DataType::Utf8, false),
        Field::new("dst", DataType::Utf8, false),
        Field::new("kind", DataType::Utf8, false),
        Field::new("weight", DataType::Float32, false),
        Field::new("evidence", DataType::Int64, false),
        Field::new("stage", DataType::Utf8, false),
        Field::new("run_id", DataType::Utf8, false),
        Field::new("created_at", timestamp(), false),
        Field::new("active", DataType::Boolean, false),
        Field::new("metadata", DataType::Utf8, false),
    ]))
}

/// Schema of the `embeddings` table for vectors of `dim` floats.
pub fn embeddings_schema(dim: i32) -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("node_id", DataType::Utf8, false),
        Field::new("model_id", DataType::Utf8, false),
        Field::new("text_sha256", DataType::Utf8, false),
        Field::new(
            "vector",
            DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, true)), dim),
            false,
        ),
    ]))
}

/// A metadata map as the shards hold it: JSON text.
pub fn metadata_json(metadata: &BTreeMap<String, Value>) -> String {
    serde_json::to_string(metadata).expect("a map of JSON values always serializes")
}

/// The `nodes` and `steps` batches of `nodes`.
pub fn nodes_to_batches<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
) -> Result<(RecordBatch, RecordBatch)> {
    let mut b = NodeBuilders::default();
    let mut s = StepBuilders::default();
    for node in nodes {
        b.push(node);
        if let NodeBody::Episodic(episode) = &node.body {
            for (index, step) in episode.steps.iter().enumerate() {
                s.push(&node.id, index, step);
            }
        }
    }
    Ok((b.finish()?, s.finish()?))
}

#[derive(Default)]
struct NodeBuilders {
    id: StringBuilder,
    kind: StringBuilder,
    tenant: StringBuilder,
    agent_id: StringBuilder,
    source_file: StringBuilder,
    source_locator: StringBuilder,
    created_at: TimestampMillisecondBuilder,
    text: StringBuilder,
    metadata: StringBuilder,
    source: StringBuilder,
    position: Int64Builder,
    time: StringBuilder,
    section: StringBuilder,
    success: BooleanBuilder,
    reward: Float64Builder,
    outcome_feedback: StringBuilder,
    step_count: Int64Builder,
    version: Int64Builder,
    previous_versions: ListBuilder<StringBuilder>,
    source_episodes: ListBuilder<StringBuilder>,
    pems_history: ListBuilder<Float64Builder>,
}

impl NodeBuilders {
    fn push(&mut self, node: &Node) {
        self.id.append_value(node.id.as_str());
        self.kind.append_value(node.kind().as_str());
        self.tenant.append_value(&node.tenant);
        self.agent_id.append_option(node.agent_id.as_deref());
        self.source_file.append_value(&node.source_file);
        self.source_locator.append_value(&node.source_locator);
        self.created_at.append_option(node.created_at);
        self.text.append_value(&node.text);
        self.metadata.append_value(metadata_json(&node.metadata));
        let semantic = match &node.body {
            NodeBody::Semantic(semantic) => Some(semantic),
            _ => None,
        };
        self.source
            .append_option(semantic.map(|s| s.source.as_str()));
        self.position.append_option(semantic.map(|s| s.position));
        self.time
            .append_option(semantic.and_then(|s| s.time.as_deref()));
        self.section
            .append_option(semantic.and_then(|s| s.group.as_deref()));
        let episode = node.episode();
        self.success
            .append_option(episode.and_then(|e| e.outcome.success));
        self.reward
            .append_option(episode.and_then(|e| e.outcome.reward));
        self.outcome_feedback
            .append_option(episode.and_then(|e| e.outcome.feedback.as_deref()));
        self.step_count
            .append_option(episode.map(|e| e.steps.len() as i64));
        match &node.body {
            NodeBody::Procedural(skill) => {
                self.version.append_value(skill.version);
                append_ids(&mut self.previous_versions, &skill.previous_versions);
                append_ids(&mut self.source_episodes, &skill.source_episodes);
                self.pems_history.values().append_slice(&skill.pems_history);
                self.pems_history.append(true);
            }
            _ => {
                self.version.append_null();
                self.previous_versions.append_null();
                self.source_episodes.append_null();
                self.pems_history.append_null();
            }
        }
    }

    fn finish(mut self) -> Result<RecordBatch> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.id.finish()),
            Arc::new(self.kind.finish()),
            Arc::new(self.tenant.finish()),
            Arc::new(self.agent_id.finish()),
            Arc::new(self.source_file.finish()),
            Arc::new(self.source_locator.finish()),
            Arc::new(self.created_at.finish().with_timezone("UTC")),
            Arc::new(self.text.finish()),
            Arc::new(self.metadata.finish()),
            Arc::new(self.source.finish()),
            Arc::new(self.position.finish()),
            Arc::new(self.time.finish()),
            Arc::new(self.section.finish()),
            Arc::new(self.success.finish()),
            Arc::new(self.reward.finish()),
            Arc::new(self.outcome_feedback.finish()),
            Arc::new(self.step_count.finish()),
            Arc::new(self.version.finish()),
            Arc::new(self.previous_versions.finish()),
            Arc::new(self.source_episodes.finish()),
            Arc::new(self.pems_history.finish()),
        ];
        Ok(RecordBatch::try_new(nodes_schema(), columns)?)
    }
}

fn append_ids(builder: &mut ListBuilder<StringBuilder>, ids: &[NodeId]) {
    for id in ids {
        builder.values().append_value(id.as_str());
    }
    builder.append(true);
}

#[derive(Default)]
struct StepBuilders {
    episode_id: StringBuilder,
    step_index: Int64Builder,
    observation: StringBuilder,
    action: StringBuilder,
    tool_calls: StringBuilder,
    feedback: StringBuilder,
    timestamp: TimestampMillisecondBuilder,
}

impl StepBuilders {
    fn push(&mut self, episode: &NodeId, index: usize, step: &Step) {
        self.episode_id.append_value(episode.as_str());
        self.step_index.append_value(index as i64);
        self.observation.append_value(&step.observation);
        self.action.append_value(&step.action);
        self.tool_calls.append_value(
            serde_json::to_string(&step.tool_calls).expect("tool calls always serialize"),
        );
        self.feedback.append_option(step.feedback.as_deref());
        self.timestamp.append_option(step.timestamp);
    }

    fn finish(mut self) -> Result<RecordBatch> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.episode_id.finish()),
            Arc::new(self.step_index.finish()),
            Arc::new(self.observation.finish()),
            Arc::new(self.action.finish()),
            Arc::new(self.tool_calls.finish()),
            Arc::new(self.feedback.finish()),
            Arc::new(self.timestamp.finish().with_timezone("UTC")),
        ];
        Ok(RecordBatch::try_new(steps_schema(), columns)?)
    }
}

/// The `edges` batch of `edges`.
pub fn edges_to_batch<'a>(edges: impl IntoIterator<Item = &'a Edge>) -> Result<RecordBatch> {
    let (mut src, mut dst, mut kind) = (
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
    );
    let (mut weight, mut evidence) = (Float32Builder::new(), Int64Builder::new());
    let (mut stage, mut run_id, mut metadata) = (
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
    );
    let (mut created_at, mut active) = (TimestampMillisecondBuilder::new(), BooleanBuilder::new());
    for edge in edges {
        src.append_value(edge.src.as_str());
        dst.append_value(edge.dst.as_str());
        kind.append_value(edge.kind.as_str());
        weight.append_value(edge.weight);
        evidence.append_value(edge.evidence);
        stage.append_value(&edge.stage);
        run_id.append_value(&edge.run_id);
        created_at.append_value(edge.created_at);
        active.append_value(edge.active);
        metadata.append_value(metadata_json(&edge.metadata));
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(src.finish()),
        Arc::new(dst.finish()),
        Arc::new(kind.finish()),
        Arc::new(weight.finish()),
        Arc::new(evidence.finish()),
        Arc::new(stage.finish()),
        Arc::new(run_id.finish()),
        Arc::new(created_at.finish().with_timezone("UTC")),
        Arc::new(active.finish()),
        Arc::new(metadata.finish()),
    ];
    Ok(RecordBatch::try_new(edges_schema(), columns)?)
}

/// The `embeddings` batch of `embeddings`, which must all have `dim` floats.
pub fn embeddings_to_batch<'a>(
    dim: usize,
    embeddings: impl IntoIterator<Item = &'a Embedding>,
) -> Result<RecordBatch> {
    let (mut node_id, mut model_id, mut text_sha) = (
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
    );
    let mut vector = FixedSizeListBuilder::new(Float32Builder::new(), dim as i32)
        .with_field(Arc::new(Field::new("item", DataType::Float32, true)));
    for (row, embedding) in embeddings.into_iter().enumerate() {
        if embedding.vector.len() != dim {
            return Err(Error::Value {
                row,
                column: "vector".into(),
                reason: format!(
                    "{} floats for node {}, expected {dim}",
                    embedding.vector.len(),
                    embedding.node_id
                ),
            });
        }
        node_id.append_value(embedding.node_id.as_str());
        model_id.append_value(&embedding.model_id);
        text_sha.append_value(&embedding.text_sha256);
        vector.values().append_slice(&embedding.vector);
        vector.append(true);
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(node_id.finish()),
        Arc::new(model_id.finish()),
        Arc::new(text_sha.finish()),
        Arc::new(vector.finish()),
    ];
    Ok(RecordBatch::try_new(
        embeddings_schema(dim as i32),
        columns,
    )?)
}

/// Whether a column of type `actual` can be read as `expected`. A list's item field may have
/// any name and nullability: arrow-rs writes `item`, pyarrow and Spark write the Parquet
/// standard's `element`, and both are the same list. Fixed-size lists (vectors) may have any
/// length: the dimension is checked against the manifest elsewhere.
fn compatible(expected: &DataType, actual: &DataType) -> bool {
    match (expected, actual) {
        (DataType::FixedSizeList(_, _), DataType::FixedSizeList(_, _)) => true,
        (DataType::List(a), DataType::List(b)) => compatible(a.data_type(), b.data_type()),
        (expected, actual) => expected == actual,
    }
}

/// Typed access to the columns of a batch, checking names and types against a schema.
struct Columns<'a> {
    batch: &'a RecordBatch,
}

impl<'a> Columns<'a> {
    fn new(batch: &'a RecordBatch, expected: &Schema) -> Result<Self> {
        for field in expected.fields() {
            let actual = batch
                .schema()
                .field_with_name(field.name())
                .map(|f| f.data_type().clone())
                .map_err(|_| Error::Schema {
                    column: field.name().clone(),
                    reason: "missing".into(),
                })?;
            if !compatible(field.data_type(), &actual) {
                return Err(Error::Schema {
                    column: field.name().clone(),
                    reason: format!("type {actual}, expected {}", field.data_type()),
                });
            }
        }
        Ok(Columns { batch })
    }

    fn array(&self, name: &str) -> &'a ArrayRef {
        self.batch
            .column_by_name(name)
            .expect("checked in Columns::new")
    }

    fn str(&self, name: &str, row: usize) -> Option<&'a str> {
        let array = self.array(name).as_string::<i32>();
        array.is_valid(row).then(|| array.value(row))
    }

    fn req_str(&self, name: &str, row: usize) -> Result<&'a str> {
        self.str(name, row).ok_or_else(|| Error::Value {
            row,
            column: name.into(),
            reason: "null".into(),
        })
    }

    fn i64(&self, name: &str, row: usize) -> Option<i64> {
        let array = self.array(name).as_primitive::<Int64Type>();
        array.is_valid(row).then(|| array.value(row))
    }

    fn timestamp(&self, name: &str, row: usize) -> Option<i64> {
        let array = self.array(name).as_primitive::<TimestampMillisecondType>();
        array.is_valid(row).then(|| array.value(row))
    }

    fn bool(&self, name: &str, row: usize) -> Option<bool> {
        let array = self.array(name).as_boolean();
        array.is_valid(row).then(|| array.value(row))
    }

    fn f64(&self, name: &str, row: usize) -> Option<f64> {
        let array = self.array(name).as_primitive::<Float64Type>();
        array.is_valid(row).then(|| array.value(row))
    }

    fn metadata(&self, name: &str, row: usize) -> Result<BTreeMap<String, Value>> {
        let text = self.req_str(name, row)?;
        serde_json::from_str(text).map_err(|e| Error::Value {
            row,
            column: name.into(),
            reason: e.to_string(),
        })
    }

    fn id_list(&self, name: &str, row: usize) -> Vec<NodeId> {
        let list = self.array(name).as_list::<i32>();
        let values = list.value(row);
        let strings = values.as_string::<i32>();
        strings
            .iter()
            .map(|v| NodeId(v.unwrap_or_default().to_string()))
            .collect()
    }

    fn f64_list(&self, name: &str, row: usize) -> Vec<f64> {
        let list = self.array(name).as_list::<i32>();
        let values = list.value(row);
        values
            .as_primitive::<Float64Type>()
            .iter()
            .map(|v| v.unwrap_or(f64::NAN))
            .collect()
    }
}

/// Nodes from a `nodes` batch; episodic nodes get their steps from `steps` (by episode id).
pub fn nodes_from_batch(
    batch: &RecordBatch,
    steps: &BTreeMap<NodeId, Vec<Step>>,
) -> Result<Vec<Node>> {
    nodes_from_batch_with(batch, steps, &|_| true)
}

/// [`nodes_from_batch`] for a read that left some episodes' steps unread: only an episode for
/// which `steps_read` is true must have as many steps in `steps` as its `step_count` says; the
/// others come back with no steps.
pub fn nodes_from_batch_with(
    batch: &RecordBatch,
    steps: &BTreeMap<NodeId, Vec<Step>>,
    steps_read: &dyn Fn(&NodeId) -> bool,
) -> Result<Vec<Node>> {
    let c = Columns::new(batch, &nodes_schema())?;
    let mut nodes = Vec::with_capacity(batch.num_rows());
    for row in 0..batch.num_rows() {
        let id = NodeId(c.req_str("id", row)?.to_string());
        let kind_text = c.req_str("kind", row)?;
        let kind = NodeKind::parse(kind_text).ok_or_else(|| Error::Value {
            row,
            column: "kind".into(),
            reason: format!("unknown kind `{kind_text}`"),
        })?;
        let body = match kind {
            NodeKind::Semantic => NodeBody::Semantic(Semantic {
                source: c.req_str("source", row)?.to_string(),
                position: c.i64("position", row).unwrap_or_default(),
                time: c.str("time", row).map(str::to_string),
                group: c.str("section", row).map(str::to_string),
            }),
            NodeKind::Episodic => NodeBody::Episodic(Episode {
                steps: steps.get(&id).cloned().unwrap_or_default(),
                outcome: Outcome {
                    success: c.bool("success", row),
                    reward: c.f64("reward", row),
                    feedback: c.str("outcome_feedback", row).map(str::to_string),
                },
            }),
            NodeKind::Procedural => NodeBody::Procedural(Skill {
                version: c.i64("version", row).unwrap_or(1),
                previous_versions: c.id_list("previous_versions", row),
                source_episodes: c.id_list("source_episodes", row),
                pems_history: c.f64_list("pems_history", row),
            }),
        };
        if let NodeBody::Episodic(episode) = &body {
            let expected = c.i64("step_count", row).unwrap_or_default();
            if episode.steps.len() as i64 != expected && steps_read(&id) {
                return Err(Error::Value {
                    row,
                    column: "step_count".into(),
                    reason: format!(
                        "episode {id} lists {expected} steps but {} are stored",
                        episode.steps.len()
                    ),
                });
            }
        }
        nodes.push(Node {
            id,
            tenant: c.req_str("tenant", row)?.to_string(),
            agent_id: c.str("agent_id", row).map(str::to_string),
            source_file: c.req_str("source_file", row)?.to_string(),
            source_locator: c.req_str("source_locator", row)?.to_string(),
            created_at: c.timestamp("created_at", row),
            text: c.req_str("text", row)?.to_string(),
            metadata: c.metadata("metadata", row)?,
            body,
        });
    }
    Ok(nodes)
}

/// Steps from a `steps` batch, added to `into` by episode id in step order.
pub fn steps_from_batch(batch: &RecordBatch, into: &mut BTreeMap<NodeId, Vec<Step>>) -> Result<()> {
    let c = Columns::new(batch, &steps_schema())?;
    for row in 0..batch.num_rows() {
        let episode = NodeId(c.req_str("episode_id", row)?.to_string());
        let index = c.i64("step_index", row).unwrap_or_default();
        let steps = into.entry(episode).or_default();
        if index != steps.len() as i64 {
            return Err(Error::Value {
                row,
                column: "step_index".into(),
                reason: format!("{index} out of order"),
            });
        }
        let tool_calls =
            serde_json::from_str(c.req_str("tool_calls", row)?).map_err(|e| Error::Value {
                row,
                column: "tool_calls".into(),
                reason: e.to_string(),
            })?;
        steps.push(Step {
            observation: c.req_str("observation", row)?.to_string(),
            action: c.req_str("action", row)?.to_string(),
            tool_calls,
            feedback: c.str("feedback", row).map(str::to_string),
            timestamp: c.timestamp("timestamp", row),
        });
    }
    Ok(())
}

/// Edges from an `edges` batch.
pub fn edges_from_batch(batch: &RecordBatch) -> Result<Vec<Edge>> {
    let c = Columns::new(batch, &edges_schema())?;
    let weights = c.array("weight").as_primitive::<Float32Type>();
    let mut edges = Vec::with_capacity(batch.num_rows());
    for row in 0..batch.num_rows() {
        let kind_text = c.req_str("kind", row)?;
        let kind = EdgeKind::parse(kind_text).ok_or_else(|| Error::Value {
            row,
            column: "kind".into(),
            reason: format!("unknown kind `{kind_text}`"),
        })?;
        edges.push(Edge {
            src: NodeId(c.req_str("src", row)?.to_string()),
            dst: NodeId(c.req_str("dst", row)?.to_string()),
            kind,
            weight: weights.value(row),
            evidence: c.i64("evidence", row).unwrap_or_default(),
            stage: c.req_str("stage", row)?.to_string(),
            run_id: c.req_str("run_id", row)?.to_string(),
            created_at: c.timestamp("created_at", row).unwrap_or_default(),
            active: c.bool("active", row).unwrap_or(true),
            metadata: c.metadata("metadata", row)?,
        });
    }
    Ok(edges)
}

/// Embeddings from an `embeddings` batch.
pub fn embeddings_from_batch(batch: &RecordBatch) -> Result<Vec<Embedding>> {
    let c = Columns::new(batch, &embeddings_schema(0))?;
    let vectors = c.array("vector").as_fixed_size_list();
    let mut embeddings = Vec::with_capacity(batch.num_rows());
    for row in 0..batch.num_rows() {
        let values = vectors.value(row);
        let floats = values.as_primitive::<Float32Type>();
        embeddings.push(Embedding {
            node_id: NodeId(c.req_str("node_id", row)?.to_string()),
            model_id: c.req_str("model_id", row)?.to_string(),
            text_sha256: c.req_str("text_sha256", row)?.to_string(),
            vector: floats.values().to_vec(),
        });
    }
    Ok(embeddings)
}

/// Schema of the `edits` table (the edit log).
pub fn edits_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("run_id", DataType::Utf8, false),
        Field::new("stage", DataType::Utf8, false),
        Field::new("kind", DataType::Utf8, false),
        Field::new("target", DataType::Utf8, false),
        Field::new("before", DataType::Utf8, true),
        Field::new("after", DataType::Utf8, true),
        Field::new("reason", DataType::Utf8, false),
        Field::new("at", timestamp(), false),
    ]))
}

/// The `edits` batch of `edits`.
pub fn edits_to_batch<'a>(edits: impl IntoIterator<Item = &'a Edit>) -> Result<RecordBatch> {
    let mut columns: Vec<StringBuilder> = (0..8).map(|_| StringBuilder::new()).collect();
    let mut at = TimestampMillisecondBuilder::new();
    for edit in edits {
        let values = [
            &edit.id,
            &edit.run_id,
            &edit.stage,
            &edit.kind,
            &edit.target,
        ];
        for (builder, value) in columns.iter_mut().zip(values) {
            builder.append_value(value);
        }
        columns[5].append_option(edit.before.as_deref());
        columns[6].append_option(edit.after.as_deref());
        columns[7].append_value(&edit.reason);
        at.append_value(edit.at);
    }
    let mut arrays: Vec<ArrayRef> = columns
        .iter_mut()
        .map(|b| Arc::new(b.finish()) as ArrayRef)
        .collect();
    arrays.push(Arc::new(at.finish().with_timezone("UTC")));
    Ok(RecordBatch::try_new(edits_schema(), arrays)?)
}

/// Edits from an `edits` batch, in row order.
pub fn edits_from_batch(batch: &RecordBatch) -> Result<Vec<Edit>> {
    let c = Columns::new(batch, &edits_schema())?;
    let mut edits = Vec::with_capacity(batch.num_rows());
    for row in 0..batch.num_rows() {
        edits.push(Edit {
            id: c.req_str("id", row)?.to_string(),
            run_id: c.req_str("run_id", row)?.to_string(),
            stage: c.req_str("stage", row)?.to_string(),
            kind: c.req_str("kind", row)?.to_string(),
            target: c.req_str("target", row)?.to_string(),
            before: c.str("before", row).map(str::to_string),
            after: c.str("after", row).map(str::to_string),
            reason: c.req_str("reason", row)?.to_string(),
            at: c.timestamp("at", row).unwrap_or_default(),
        });
    }
    Ok(edits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_compatible_whatever_their_item_field_is_called() {
        let ours = DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)));
        let pyarrow = DataType::List(Arc::new(Field::new("element", DataType::Utf8, false)));
        assert!(
            compatible(&ours, &pyarrow),
            "arrow-rs `item` vs the Parquet standard's `element`"
        );
        let numbers = DataType::List(Arc::new(Field::new("element", DataType::Int64, true)));
        assert!(
            !compatible(&ours, &numbers),
            "the item type still has to match"
        );
        assert!(!compatible(&DataType::Utf8, &DataType::Int64));
    }

    /// A nodes batch whose list columns name their items `element` (as pyarrow writes them)
    /// reads like ours.
    #[test]
    fn a_batch_with_element_named_lists_reads() {
        let node = crate::Node::new(
            crate::NodeBody::Procedural(crate::Skill {
                version: 1,
                source_episodes: vec![NodeId::from("epi-a")],
                pems_history: vec![0.5],
                ..Default::default()
            }),
            "t",
            "skill",
            &["x"],
        );
        let (batch, _) = nodes_to_batches([&node]).unwrap();
        let fields: Vec<Arc<Field>> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| match f.data_type() {
                DataType::List(item) => Arc::new(Field::new(
                    f.name(),
                    DataType::List(Arc::new(Field::new(
                        "element",
                        item.data_type().clone(),
                        true,
                    ))),
                    f.is_nullable(),
                )),
                _ => f.clone(),
            })
            .collect();
        let columns: Vec<ArrayRef> = batch
            .columns()
            .iter()
            .zip(&fields)
            .map(|(column, field)| match field.data_type() {
                DataType::List(item) => {
                    let list = column.as_list::<i32>();
                    Arc::new(arrow_array::ListArray::new(
                        item.clone(),
                        list.offsets().clone(),
                        list.values().clone(),
                        list.nulls().cloned(),
                    )) as ArrayRef
                }
                _ => column.clone(),
            })
            .collect();
        let renamed = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap();
        let read = nodes_from_batch(&renamed, &BTreeMap::new()).unwrap();
        assert_eq!(read, vec![node]);
    }
}
