//! The three-step embed (plan, execute, commit) against a real store: the shards it commits
//! are the in-process run's, byte for byte, however the plan is executed; the commit refuses
//! what does not match the plan.

use arrow_array::RecordBatch;
use fluxmem_embed::plan::{plan, Plan, PlanModel, Swept, BUCKETS};
use fluxmem_embed::{embed_store, EmbedOptions, NoProgress};
use fluxmem_graph::{Embedding, Graph, Node, NodeBody, NodeId, Semantic};
use fluxmem_models::{Embedder, HashEmbedder};
use fluxmem_store::{CommitInfo, Store, Writer};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;
use common::Scripted;

fn commit_texts(dir: &Path, source: &str, texts: &[String]) {
    let mut graph = Graph::default();
    for (i, text) in texts.iter().enumerate() {
        let body = NodeBody::Semantic(Semantic {
            source: source.into(),
            position: i as i64,
            time: None,
            group: None,
        });
        let tenant = if i % 3 == 0 { "acme" } else { "default" };
        graph.insert_node(Node::new(body, tenant, text, &[source, &i.to_string()]));
    }
    Writer::open(dir)
        .unwrap()
        .commit(
            &graph,
            CommitInfo {
                stage: "ingest".into(),
                ..Default::default()
            },
        )
        .unwrap();
}

/// A store with an embedded history of 80 texts and a new night of 240 nodes (200 texts, some
/// repeated within the night, 30 repeating the history's).
fn night_store() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let history: Vec<String> = (0..80).map(|i| format!("history note {i}")).collect();
    commit_texts(dir.path(), "history", &history);
    let mut writer = Writer::open(dir.path()).unwrap();
    embed_store(
        &mut writer,
        &HashEmbedder::new(16),
        &options(),
        "embed@history",
        &mut NoProgress,
    )
    .unwrap();
    drop(writer);
    let night: Vec<String> = (0..240)
        .map(|i| match i % 8 {
            0 => format!("history note {}", i % 30),
            _ => format!("night note {} about {}", i % 170, i % 5),
        })
        .collect();
    commit_texts(dir.path(), "night", &night);
    dir
}

fn options() -> EmbedOptions {
    EmbedOptions {
        batch_size: 32,
        commit_every: 40,
        window: 80,
        ..Default::default()
    }
}

/// The store's shards: table, rows and SHA-256, in commit order.
fn shards(dir: &Path) -> Vec<(String, u64, String)> {
    Store::open(dir)
        .unwrap()
        .manifest()
        .unwrap()
        .shards
        .iter()
        .map(|s| (s.table.clone(), s.rows, s.sha256.clone()))
        .collect()
}

/// The vectors an in-process embed gives the store at `dir`.
fn in_process(dir: &Path) -> BTreeMap<(NodeId, String), Embedding> {
    let mut writer = Writer::open(dir).unwrap();
    let model = HashEmbedder::new(16);
    embed_store(
        &mut writer,
        &model,
        &options(),
        "embed@night",
        &mut NoProgress,
    )
    .unwrap();
    writer.store().load().unwrap().embeddings
}

fn planned(dir: &Path) -> Plan {
    let writer = Writer::open(dir).unwrap();
    let model = PlanModel::of("hash-16", "cpu", &HashEmbedder::new(16));
    plan(&writer, &model, &options(), "night").unwrap()
}

fn commit(dir: &Path, plan: &Plan) -> fluxmem_embed::Result<fluxmem_embed::EmbedReport> {
    let vectors = plan.results()?;
    let mut writer = Writer::open(dir).unwrap();
    plan.commit(&mut writer, &vectors, &options(), &mut NoProgress)
}

/// Every row of the plan, in one list of single-row batches.
fn rows(plan: &Plan) -> Vec<RecordBatch> {
    plan.items(&|_| true)
        .unwrap()
        .iter()
        .flat_map(|(_, b)| (0..b.num_rows()).map(|i| b.slice(i, 1)).collect::<Vec<_>>())
        .collect()
}

#[test]
fn a_plan_executed_any_way_commits_the_shards_of_an_in_process_run() {
    let reference = night_store();
    let model = Scripted::failing_first(0);
    let mut writer = Writer::open(reference.path()).unwrap();
    let report = embed_store(
        &mut writer,
        &model,
        &options(),
        "embed@night",
        &mut NoProgress,
    )
    .unwrap();
    drop(writer);
    let expected = shards(reference.path());
    assert!(
        report.embedded > 100 && report.cached > 30 && report.commits > 3,
        "{report:?}"
    );

    // One worker, every bucket, 256 texts a call.
    let one = night_store();
    let plan1 = planned(one.path());
    assert_eq!(
        plan1.header().items,
        report.embedded,
        "the plan holds the texts the model embeds"
    );
    let worker = Scripted::failing_first(0);
    plan1
        .execute_buckets(&worker, &|_| true, 256, "w0", &mut NoProgress)
        .unwrap();
    let committed = commit(one.path(), &plan1).unwrap();
    assert_eq!(committed, report);
    assert_eq!(shards(one.path()), expected);

    // Two workers of their buckets, 7 texts a call, the second worker first.
    let two = night_store();
    let plan2 = planned(two.path());
    assert_eq!(
        plan2.header().digest,
        plan1.header().digest,
        "the same store plans the same"
    );
    for w in [1u32, 0] {
        plan2
            .execute_buckets(
                &Scripted::failing_first(0),
                &move |b| b % 2 == w,
                7,
                &format!("w{w}"),
                &mut NoProgress,
            )
            .unwrap();
    }
    commit(two.path(), &plan2).unwrap();
    assert_eq!(shards(two.path()), expected);

    // The rows shuffled (a seeded permutation) into three workers' lists, 5 texts a call; the
    // first worker dies on its first batch and is retried; a bucket also executed twice.
    let three = night_store();
    let plan3 = planned(three.path());
    let mut all = rows(&plan3);
    let mut state = 7u64;
    for i in (1..all.len()).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        all.swap(i, (state >> 33) as usize % (i + 1));
    }
    let chunk = all.len().div_ceil(3);
    for (w, part) in all.chunks(chunk).enumerate() {
        let part = arrow_select::concat::concat_batches(&part[0].schema(), part).unwrap();
        let worker = Scripted::failing_first(usize::from(w == 0));
        let results = match plan3.execute(&part, &worker, 5) {
            Err(first) => {
                assert!(first.to_string().contains("simulated crash"), "{first}");
                plan3.execute(&part, &worker, 5).unwrap()
            }
            Ok(results) => results,
        };
        plan3.write_results(&format!("s{w}"), &results).unwrap();
    }
    plan3
        .execute_buckets(
            &Scripted::failing_first(0),
            &|b| b == 3,
            11,
            "again",
            &mut NoProgress,
        )
        .unwrap();
    commit(three.path(), &plan3).unwrap();
    assert_eq!(shards(three.path()), expected);
    plan3.remove().unwrap();
    assert!(!three.path().join("scratch/embed/night").exists());
}

#[test]
fn the_commit_refuses_what_does_not_match_the_plan() {
    let dir = night_store();
    let plan = planned(dir.path());
    assert_eq!(plan.header().buckets, BUCKETS);
    // Half the buckets executed: the others are named.
    plan.execute_buckets(
        &Scripted::failing_first(0),
        &|b| b % 2 == 0,
        64,
        "even",
        &mut NoProgress,
    )
    .unwrap();
    let missing = commit(dir.path(), &plan).unwrap_err().to_string();
    assert!(
        missing.contains("have no vector") && missing.contains("buckets [1,"),
        "{missing}"
    );
    plan.execute_buckets(
        &Scripted::failing_first(0),
        &|b| b % 2 == 1,
        64,
        "odd",
        &mut NoProgress,
    )
    .unwrap();

    let one = plan.items(&|_| true).unwrap()[0].1.slice(0, 1);
    let good = plan.execute(&one, &Scripted::failing_first(0), 1).unwrap();
    // Another vector for a planned key: non-determinism (or an altered result).
    let mut altered = HashEmbedder::new(16).embed(&["something else"]).unwrap();
    let changed = results_with(&good, None, Some(altered.remove(0)));
    plan.write_results("altered", &changed).unwrap();
    let error = commit(dir.path(), &plan).unwrap_err().to_string();
    assert!(
        error.contains("not deterministic") && error.contains("altered.parquet"),
        "{error}"
    );
    std::fs::remove_file(plan.dir().join("results/altered.parquet")).unwrap();
    // A key the plan does not hold.
    let foreign = results_with(&good, Some(("key", &"0".repeat(64))), None);
    plan.write_results("foreign", &foreign).unwrap();
    let error = commit(dir.path(), &plan).unwrap_err().to_string();
    assert!(error.contains("is not in the plan"), "{error}");
    std::fs::remove_file(plan.dir().join("results/foreign.parquet")).unwrap();
    // A row of another plan.
    let stale = results_with(&good, Some(("plan", "an earlier plan")), None);
    plan.write_results("stale", &stale).unwrap();
    let error = commit(dir.path(), &plan).unwrap_err().to_string();
    assert!(error.contains("not this plan"), "{error}");
    std::fs::remove_file(plan.dir().join("results/stale.parquet")).unwrap();
    // A key that is no SHA-256 at all.
    let malformed = results_with(&good, Some(("key", "not a key")), None);
    plan.write_results("malformed", &malformed).unwrap();
    let error = commit(dir.path(), &plan).unwrap_err().to_string();
    assert!(error.contains("is not in the plan"), "{error}");
    std::fs::remove_file(plan.dir().join("results/malformed.parquet")).unwrap();
    // Each refused commit removed the file its checked vectors waited in.
    let left: Vec<String> = std::fs::read_dir(plan.dir().join("results"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !name.ends_with(".parquet"))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // The store moved since the plan: plan again.
    commit_texts(dir.path(), "late", &["a late note".to_string()]);
    let moved = commit(dir.path(), &plan).unwrap_err().to_string();
    assert!(
        moved.contains("plan again") && moved.contains("ingest"),
        "{moved}"
    );

    // A tampered items file is refused when the plan is opened.
    let items = plan.dir().join("items.parquet");
    let mut bytes = std::fs::read(&items).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    std::fs::write(&items, bytes).unwrap();
    let error = Plan::open(dir.path(), "night").unwrap_err().to_string();
    assert!(error.contains("SHA-256"), "{error}");
}

/// A commit killed after some of its commits resumes from them (its own commits do not make the
/// plan stale) and ends with the vectors of an uninterrupted one.
#[test]
fn a_killed_commit_resumes() {
    let expected = in_process(night_store().path());

    let dir = night_store();
    let plan = planned(dir.path());
    plan.execute_buckets(
        &Scripted::failing_first(0),
        &|_| true,
        64,
        "w",
        &mut NoProgress,
    )
    .unwrap();
    let vectors = plan.results().unwrap();
    let before = Store::open(dir.path()).unwrap().manifest().unwrap().version;
    {
        // Killed in its third model call: two commits are in.
        let dying = Dying {
            inner: &vectors,
            calls: AtomicUsize::new(0),
        };
        let mut writer = Writer::open(dir.path()).unwrap();
        assert!(plan
            .commit(&mut writer, &dying, &options(), &mut NoProgress)
            .is_err());
    }
    let after = Store::open(dir.path()).unwrap().manifest().unwrap().version;
    assert!(after > before, "some commits went in before the kill");
    // Planning another run meanwhile keeps this plan: only its own commits moved the store.
    let other = fluxmem_embed::plan::plan(
        &Writer::open(dir.path()).unwrap(),
        &PlanModel::of("hash-16", "cpu", &HashEmbedder::new(16)),
        &options(),
        "other",
    )
    .unwrap();
    assert_eq!(other.swept(), &Swept::default());
    let reopened = Plan::open(dir.path(), "night").unwrap().unwrap();
    commit(dir.path(), &reopened).unwrap();
    assert_eq!(
        Store::open(dir.path()).unwrap().load().unwrap().embeddings,
        expected
    );
}

/// Planning removes the plans no commit can take any more (their store moved since, by a
/// commit not theirs) and keeps the rest: a plan of another run at the same version, a folder
/// that holds no plan record, the new plan itself.
#[test]
fn planning_removes_the_plans_no_commit_can_take() {
    let dir = night_store();
    let model = PlanModel::of("hash-16", "cpu", &HashEmbedder::new(16));
    let plan_for = |run_id: &str| {
        let writer = Writer::open(dir.path()).unwrap();
        plan(&writer, &model, &options(), run_id).unwrap()
    };
    let abandoned = plan_for("abandoned");
    let beside = plan_for("beside");
    assert_eq!(beside.swept(), &Swept::default());
    let unknown = abandoned.dir().parent().unwrap().join("not-a-plan");
    std::fs::create_dir_all(&unknown).unwrap();
    std::fs::write(unknown.join("notes.txt"), "kept").unwrap();
    // The store moves by a commit that is no plan's: both plans are stale.
    commit_texts(dir.path(), "later", &["a later note".to_string()]);
    let fresh = plan_for("fresh");
    let mut expected = vec![abandoned.dir().to_path_buf(), beside.dir().to_path_buf()];
    expected.sort();
    assert_eq!(fresh.swept().removed, expected);
    assert!(fresh.swept().failed.is_empty());
    assert!(!abandoned.dir().exists() && !beside.dir().exists());
    assert!(fresh.dir().join("plan.json").is_file() && unknown.join("notes.txt").is_file());
    // The stale plan's run would have been refused: it is gone, so planning it again is the way.
    assert!(Plan::open(dir.path(), "abandoned").unwrap().is_none());
}

/// The plan's vectors, failing from the third call on.
struct Dying<'a> {
    inner: &'a dyn Embedder,
    calls: AtomicUsize,
}

impl Embedder for Dying<'_> {
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }
    fn dim(&self) -> usize {
        self.inner.dim()
    }
    fn embed(&self, texts: &[&str]) -> fluxmem_models::Result<Vec<Vec<f32>>> {
        if self.calls.fetch_add(1, Ordering::SeqCst) >= 2 {
            return Err(fluxmem_models::Error::Tokenizer("killed".into()));
        }
        self.inner.embed(texts)
    }
    fn count_tokens(&self, text: &str) -> fluxmem_models::Result<usize> {
        self.inner.count_tokens(text)
    }
}

/// `results` with one string column replaced by a value, or its vectors by `vector`.
fn results_with(
    results: &RecordBatch,
    column: Option<(&str, &str)>,
    vector: Option<Vec<f32>>,
) -> RecordBatch {
    use arrow_array::builder::{FixedSizeListBuilder, Float32Builder};
    use arrow_array::{ArrayRef, StringArray};
    use std::sync::Arc;
    let mut columns: Vec<ArrayRef> = results.columns().to_vec();
    if let Some((name, value)) = column {
        let i = results.schema().index_of(name).unwrap();
        columns[i] = Arc::new(StringArray::from(vec![value; results.num_rows()]));
    }
    if let Some(vector) = vector {
        let i = results.schema().index_of("vector").unwrap();
        let field = match results.schema().field(i).data_type() {
            arrow_schema::DataType::FixedSizeList(f, _) => f.clone(),
            other => panic!("{other}"),
        };
        let mut list =
            FixedSizeListBuilder::new(Float32Builder::new(), vector.len() as i32).with_field(field);
        for _ in 0..results.num_rows() {
            list.values().append_slice(&vector);
            list.append(true);
        }
        columns[i] = Arc::new(list.finish());
    }
    RecordBatch::try_new(results.schema(), columns).unwrap()
}

/// A grown episode's stale vector holds its old text, which a later node of the night repeats:
/// the commit replaces the stale vector in an earlier window than the node's, so the plan must
/// list the old text (a stale vector is no holder), and the commit ends with the vectors of an
/// in-process run.
#[test]
fn a_text_only_a_stale_vector_held_is_planned() {
    let episode = common::conversation;
    let store = || {
        let dir = tempfile::tempdir().unwrap();
        let short = episode(&["look the order up"]);
        let mut first = Graph::default();
        first.insert_node(short.clone());
        let ingest = || CommitInfo {
            stage: "ingest".into(),
            ..Default::default()
        };
        let mut writer = Writer::open(dir.path()).unwrap();
        writer.commit(&first, ingest()).unwrap();
        embed_store(
            &mut writer,
            &HashEmbedder::new(16),
            &options(),
            "r1",
            &mut NoProgress,
        )
        .unwrap();
        // The next night: the conversation grew, and a new node (its id after the episode's,
        // in a later window) has the episode's old text.
        let long = episode(&["look the order up", "refund it"]);
        let mut night = Graph::default();
        night.insert_node(long.clone());
        night.edits.push(common::grown(&short, &long));
        let old_text = short.embedding_text();
        let mut fillers: Vec<String> = (0..120).map(|i| format!("filler {i}")).collect();
        fillers.push(old_text);
        for (i, text) in fillers.iter().enumerate() {
            let body = NodeBody::Semantic(Semantic {
                source: "doc".into(),
                position: i as i64,
                time: None,
                group: None,
            });
            night.insert_node(Node::new(body, "default", text, &["doc", &i.to_string()]));
        }
        // The precondition: the repeating node comes after the episode, a window later.
        let mut ids: Vec<_> = night.nodes.keys().cloned().collect();
        ids.sort();
        let text_of = |id: &fluxmem_graph::NodeId| night.nodes[id].embedding_text();
        let at = ids
            .iter()
            .position(|id| text_of(id) == short.embedding_text())
            .unwrap();
        let grown_at = ids.iter().position(|id| *id == long.id).unwrap();
        assert!(grown_at < 40 && at >= options().window, "{grown_at} {at}");
        writer.commit(&night, ingest()).unwrap();
        (dir, long.id.clone())
    };
    let expected = in_process(store().0.path());
    let (dir, grown) = store();
    let plan = planned(dir.path());
    let repeated = rows(&plan).len();
    plan.execute_buckets(&HashEmbedder::new(16), &|_| true, 64, "w", &mut NoProgress)
        .unwrap();
    commit(dir.path(), &plan).unwrap();
    let graph = Store::open(dir.path()).unwrap().load().unwrap();
    assert_eq!(graph.embeddings, expected);
    assert_eq!(
        repeated, 122,
        "120 fillers, the grown text and the old one, each once"
    );
    assert!(graph.embeddings.keys().any(|(id, _)| *id == grown));
}
