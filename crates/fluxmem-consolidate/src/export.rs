//! Export of the skill set: the latest version of every skill, as `SKILL.md` folders (the
//! layout agent runtimes load as "agent skills"), JSONL or Parquet, plus a release manifest.
//!
//! Nothing in the output depends on the wall clock or on the export directory: the creation
//! time is the store's last commit time, records and folders are in a fixed order, so
//! exporting the same store twice gives byte-identical files.
//!
//! A release is written whole into a temporary sibling of the export directory, synced, and
//! moved into place by rename (see [`export_skills`]), so no one ever sees a release without
//! its [`RELEASE_FILE`].

use arrow_array::builder::{Float64Builder, ListBuilder, StringBuilder};
use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, UInt64Array};
use fluxmem_graph::{sha256_hex, Graph, Node, NodeBody, NodeKind};
use fluxmem_store::Store;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::consolidate::latest_skills;
use crate::{Error, Result};

/// The release manifest's file name, in the export directory.
pub const RELEASE_FILE: &str = "release.json";

/// The longest slug (the agent-skills limit on a skill's `name`).
const MAX_SLUG: usize = 64;

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExportFormat {
    /// One folder per skill with a `SKILL.md`.
    SkillMd,
    /// `skills.jsonl`, one record per line.
    Jsonl,
    /// `skills.parquet`.
    Parquet,
}

impl std::str::FromStr for ExportFormat {
    type Err = String;
    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "skill-md" => Ok(ExportFormat::SkillMd),
            "jsonl" => Ok(ExportFormat::Jsonl),
            "parquet" => Ok(ExportFormat::Parquet),
            other => Err(format!(
                "export format `{other}`: expected skill-md, jsonl or parquet"
            )),
        }
    }
}

/// What to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The format.
    pub format: ExportFormat,
    /// Only this tenant.
    pub tenant: Option<String>,
    /// Only skills whose current PEMS is at least this.
    pub min_pems: Option<f64>,
    /// Only skills whose kept round's eta (how well the steps match the held-out episodes) is at
    /// least this; a skill that falls under it is retired in the release's changes, with the
    /// reason.
    pub min_eta: Option<f64>,
    /// Only skills with at least this many source episodes.
    pub min_support: usize,
}

/// One exported skill.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct SkillRecord {
    /// Node id of this version.
    pub id: String,
    /// Id of the skill's first version (stable across versions).
    pub lineage: String,
    /// Tenant.
    pub tenant: String,
    /// Folder name: the name in lower-case words joined by hyphens, unique in the release.
    pub slug: String,
    /// Name as the generator wrote it.
    pub name: String,
    /// When to use it.
    pub description: String,
    /// The skill text (name, description, steps).
    pub body: String,
    /// Steps.
    pub steps: Vec<String>,
    /// Preconditions and pitfalls mined from the logs.
    #[serde(default)]
    pub pitfalls: Vec<String>,
    /// Where the successful runs part ways ([`crate::SkillText::decisions`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<String>,
    /// Version, from 1.
    pub version: i64,
    /// Current PEMS (the kept round's score).
    pub pems: f64,
    /// The kept round's eta, when recorded.
    pub eta: Option<f64>,
    /// Every round's PEMS over all versions.
    pub pems_history: Vec<f64>,
    /// Number of source episodes.
    pub support: usize,
    /// Source episode ids.
    pub source_episodes: Vec<String>,
    /// Earlier versions' ids, oldest first.
    pub previous_versions: Vec<String>,
    /// Where eta came from (`judge` or `logged_success_rate`).
    pub eta_source: String,
    /// Generator that wrote it.
    pub generator: String,
    /// Judge that scored it, if any.
    pub judge: Option<String>,
    /// SHA-256 of this record's canonical JSON (without this field).
    pub content_sha256: String,
}

/// What the export wrote.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExportReport {
    /// Skills exported.
    pub skills: usize,
    /// Latest skills left out by the filters.
    pub filtered_out: usize,
    /// Skills new since the release this one replaced.
    pub added: usize,
    /// Skills with a new version since then.
    pub updated: usize,
    /// Skills that release had and this one has not.
    pub retired: usize,
    /// True when the release in place already held exactly these skills of this store
    /// version: it is written again byte for byte, and nothing is added, updated or retired.
    pub unchanged: bool,
    /// What redaction replaced, per kind.
    pub redacted: fluxmem_redact::Counts,
    /// Files written, relative to the output directory.
    pub files: Vec<String>,
    /// The release manifest.
    pub release: PathBuf,
}

fn text(node: &Node, key: &str) -> String {
    node.metadata
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// The latest version of every skill in `graph`, as export records, ordered by (tenant, slug, id).
pub fn skill_records(graph: &Graph) -> Vec<SkillRecord> {
    let (mut records, verbs): (Vec<SkillRecord>, Vec<ProcedureVerbs>) = latest_skills(graph)
        .into_iter()
        .filter_map(|node| {
            let NodeBody::Procedural(skill) = &node.body else {
                return None;
            };
            let best = node
                .metadata
                .get("best_round")
                .and_then(Value::as_u64)
                .unwrap_or(0) as usize;
            let rounds = node
                .metadata
                .get("rounds")
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            // The kept round is `best` of this version's rounds, which end the history.
            let pems = match (rounds, best) {
                (r, b) if r > 0 && b > 0 && b <= r && skill.pems_history.len() >= r => {
                    skill.pems_history[skill.pems_history.len() - r + b - 1]
                }
                _ => skill.pems_history.last().copied().unwrap_or(0.0),
            };
            let eta = node
                .metadata
                .get("rounds")
                .and_then(|r| r.get(best.checked_sub(1)?))
                .and_then(|r| r["score"]["eta"].as_f64());
            let name = Some(text(node, "name"))
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| node.id.to_string());
            let list = |key: &str| -> Vec<String> {
                node.metadata
                    .get(key)
                    .and_then(Value::as_array)
                    .map_or_else(Vec::new, |s| {
                        s.iter()
                            .filter_map(Value::as_str)
                            .map(str::to_string)
                            .collect()
                    })
            };
            let steps = list("steps");
            let pitfalls = list("pitfalls");
            let decisions = list("decisions");
            let verbs = procedure_verbs(node, &steps);
            let record = SkillRecord {
                id: node.id.to_string(),
                lineage: Some(text(node, "lineage"))
                    .filter(|l| !l.is_empty())
                    .unwrap_or_else(|| node.id.to_string()),
                tenant: node.tenant.clone(),
                slug: slugify(&name),
                description: text(node, "description"),
                name,
                body: node.text.clone(),
                steps,
                pitfalls,
                decisions,
                version: skill.version,
                pems,
                eta,
                pems_history: skill.pems_history.clone(),
                support: skill.source_episodes.len(),
                source_episodes: skill
                    .source_episodes
                    .iter()
                    .map(|id| id.to_string())
                    .collect(),
                previous_versions: skill
                    .previous_versions
                    .iter()
                    .map(|id| id.to_string())
                    .collect(),
                eta_source: text(node, "eta_source"),
                generator: text(node, "generator"),
                judge: node
                    .metadata
                    .get("judge")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                content_sha256: String::new(),
            };
            Some((record, verbs))
        })
        .unzip();
    name_apart(&mut records, &verbs);
    records.sort_by(|a, b| (&a.tenant, &a.slug, &a.id).cmp(&(&b.tenant, &b.slug, &b.id)));
    let bases: Vec<String> = records.iter().map(|r| r.slug.clone()).collect();
    for (record, slug) in records.iter_mut().zip(unique_slugs(&bases)) {
        record.slug = slug;
        record.content_sha256 = sha256_hex(
            serde_json::to_string(&*record)
                .expect("records serialise")
                .as_bytes(),
        );
    }
    records
}

/// What a skill shows it goes through, from its stored skeleton: the verbs (a tool's name in
/// words, a text action's words before its first slot) of the skeleton steps it kept (those
/// whose text is one of `shown` steps; a rewrite drops some) and of the paths of its decision
/// points, each once, in order.
#[derive(Debug, Default)]
struct ProcedureVerbs {
    steps: Vec<String>,
    branches: Vec<String>,
}

fn procedure_verbs(node: &Node, shown: &[String]) -> ProcedureVerbs {
    let skeleton = node.metadata.get("skeleton");
    let keys = |pointer: &str| -> Vec<String> {
        let mut verbs: Vec<String> = Vec::new();
        let found = skeleton
            .and_then(|s| s.pointer(pointer))
            .and_then(Value::as_array);
        for key in found
            .into_iter()
            .flatten()
            .filter_map(|k| match k.as_str() {
                Some(key) => Some(key),
                None => {
                    let text = k.get("text").and_then(Value::as_str)?;
                    shown.iter().any(|s| s == text).then_some(())?;
                    k.get("key").and_then(Value::as_str)
                }
            })
        {
            let verb = key_verb(key);
            if !verb.is_empty() && !verbs.contains(&verb) {
                verbs.push(verb);
            }
        }
        verbs
    };
    let mut branches: Vec<String> = Vec::new();
    let decisions = skeleton
        .and_then(|s| s.get("decisions"))
        .and_then(Value::as_array);
    for (d, decision) in decisions.into_iter().flatten().enumerate() {
        let paths = decision.get("paths").and_then(Value::as_array);
        for p in 0..paths.map_or(0, Vec::len) {
            for verb in keys(&format!("/decisions/{d}/paths/{p}/keys")) {
                if !branches.contains(&verb) {
                    branches.push(verb);
                }
            }
        }
    }
    ProcedureVerbs {
        steps: keys("/steps"),
        branches,
    }
}

/// A step signature's verb: a tool call's tool in words (`call send_certificate(a)` ->
/// `send certificate`), a text action's words before its first slot (`go to <1>` -> `go to`);
/// empty for a message to the user.
fn key_verb(key: &str) -> String {
    if key == crate::mine::MESSAGE {
        return String::new();
    }
    match crate::mine::key_tool(key) {
        Some(tool) => tool.replace('_', " "),
        None => crate::mine::key_verb(key).to_string(),
    }
}

/// Tells apart the skills of one tenant that share a name (case aside): each gains what its
/// procedure has that none of the others has, its first two such step verbs (`Take and put,
/// with open`), else its first two such branch verbs (`Take and put, sometimes use`); a skill
/// with neither keeps its name (the same procedure twice, which its slug's suffix then tells
/// apart). The body's `Name:` line follows the name.
fn name_apart(records: &mut [SkillRecord], verbs: &[ProcedureVerbs]) {
    let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
    for (i, record) in records.iter().enumerate() {
        groups
            .entry((record.tenant.clone(), record.name.to_lowercase()))
            .or_default()
            .push(i);
    }
    for members in groups.values().filter(|m| m.len() > 1) {
        for &i in members {
            let others = members.iter().filter(|&&j| j != i).map(|&j| &verbs[j]);
            let (mut steps, mut all): (BTreeSet<&str>, BTreeSet<&str>) = Default::default();
            for other in others {
                steps.extend(other.steps.iter().map(String::as_str));
                all.extend(
                    other
                        .steps
                        .iter()
                        .chain(&other.branches)
                        .map(String::as_str),
                );
            }
            let own = |verbs: &[String], others: &BTreeSet<&str>| -> Vec<String> {
                verbs
                    .iter()
                    .filter(|v| !others.contains(v.as_str()))
                    .take(2)
                    .cloned()
                    .collect()
            };
            let own_steps = own(&verbs[i].steps, &steps);
            let own_branches = own(&verbs[i].branches, &all);
            let qualifier = if !own_steps.is_empty() {
                format!("with {}", own_steps.join(" and "))
            } else if !own_branches.is_empty() {
                format!("sometimes {}", own_branches.join(" or "))
            } else {
                continue;
            };
            let record = &mut records[i];
            let name = format!("{}, {qualifier}", record.name);
            if let Some(rest) = record
                .body
                .strip_prefix(&format!("Name: {}\n", record.name))
            {
                record.body = format!("Name: {name}\n{rest}");
            }
            record.slug = slugify(&name);
            record.name = name;
        }
    }
}

/// Unique slugs for `bases` (in release order), deterministically: the first record with a base
/// slug keeps it, and every base slug is reserved before any suffix is handed out, so a skill
/// genuinely named `foo-2` keeps `foo-2`; a later duplicate `foo` gets the first of `foo-2`,
/// `foo-3`, ... that no record holds yet (the stem shortened so the slug stays within
/// [`MAX_SLUG`] characters).
fn unique_slugs(bases: &[String]) -> Vec<String> {
    let mut taken: BTreeSet<String> = BTreeSet::new();
    let keeps: Vec<bool> = bases
        .iter()
        .map(|base| taken.insert(base.clone()))
        .collect();
    let mut slugs = Vec::with_capacity(bases.len());
    for (base, keep) in bases.iter().zip(keeps) {
        if keep {
            slugs.push(base.clone());
            continue;
        }
        let mut n = 2usize;
        loop {
            let suffix = format!("-{n}");
            let stem: String = base
                .chars()
                .take(MAX_SLUG.saturating_sub(suffix.len()))
                .collect();
            let candidate = format!("{}{suffix}", stem.trim_end_matches('-'));
            if taken.insert(candidate.clone()) {
                slugs.push(candidate);
                break;
            }
            n += 1;
        }
    }
    slugs
}

/// Lower-case ASCII letters and digits joined by single hyphens, at most 64 characters.
fn slugify(name: &str) -> String {
    let mut slug = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.is_empty() && !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let mut slug: String = slug.trim_end_matches('-').chars().take(MAX_SLUG).collect();
    slug = slug.trim_end_matches('-').to_string();
    if slug.is_empty() {
        "skill".into()
    } else {
        slug
    }
}

/// A YAML double-quoted scalar.
fn yaml_string(value: &str) -> String {
    let mut out = String::from("\"");
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Exports the latest skills of the store to `out`.
///
/// The release is written whole into a temporary sibling of `out` (`.<name>.tmp-<pid>-<n>`,
/// same parent, so the same file system), every file and folder of it is fsynced, and it is
/// then moved into place by rename; on any error the temporary directory is removed. So `out`
/// never holds a release without its [`RELEASE_FILE`]: it holds the previous release or the
/// new one (or, only if the process dies between the two renames of a replace, nothing, with
/// the previous release still whole in `.<name>.old-<pid>-<n>`).
///
/// What `out` may be (a symbolic link is followed, and the directory it points to replaced):
/// - missing: it is created, with its parents;
/// - an empty directory: it is replaced by the release;
/// - an earlier export (a directory with a fluxmem [`RELEASE_FILE`] whose `files` list every
///   other file in it): it is renamed aside to `.<name>.old-<pid>-<n>`, the new release renamed
///   into place, and the old directory deleted (it is provably ours: it held only what our
///   release manifest lists);
/// - anything else is refused and left as it is: a non-empty directory without a readable
///   [`RELEASE_FILE`] ([`Error::OutputNotEmpty`]), and an earlier export that also holds files
///   or folders its [`RELEASE_FILE`] does not list, or whose [`RELEASE_FILE`] is not a fluxmem
///   skill release ([`Error::Io`] naming them). Unlisted files are neither deleted nor carried
///   over into the new release: move them away, or export elsewhere.
///
/// Leftovers of a killed export (`.<name>.tmp-<pid>-<n>`, `.<name>.old-<pid>-<n>` next to
/// `out`) are removed by the next export to `out` once its release is in place, when the
/// process that made them is provably gone (no `/proc/<pid>` where `/proc` is mounted);
/// otherwise they are kept, since another export may be using them. The temporary names never
/// reach the output, which stays byte-identical across runs. An `out` inside the store's own
/// directory is refused.
pub fn export_skills(store: &Store, out: &Path, options: &ExportOptions) -> Result<ExportReport> {
    export_skills_with(store, out, options, &fluxmem_redact::Redactor::default())
}

/// [`export_skills`] with an explicit redaction pass (the default redacts every kind): every
/// text of a record (name, description, steps, pitfalls, body) passes `redactor` before it is
/// written, and its content hash is taken after; the counts are in the report.
pub fn export_skills_with(
    store: &Store,
    out: &Path,
    options: &ExportOptions,
    redactor: &fluxmem_redact::Redactor,
) -> Result<ExportReport> {
    // Skills are procedural node rows: no other node, steps, edges, vectors or edit log are
    // read, so an export's memory follows the skills, not the history.
    let scan = fluxmem_store::Scan {
        nodes: true,
        node_kinds: vec![NodeKind::Procedural],
        ..Default::default()
    };
    let (mut graph, manifest) = store.scan(&scan)?;
    let mut redacted = fluxmem_redact::Counts::new();
    let all: Vec<SkillRecord> = skill_records(&graph)
        .into_iter()
        .map(|r| redact_record(r, redactor, &mut redacted))
        .collect();
    let total = all.len();
    // Why each skill left out is left out (said when a release retires it).
    let mut left_out: BTreeMap<String, String> = BTreeMap::new();
    let mut records: Vec<SkillRecord> = Vec::new();
    for record in all {
        let reason = if options.tenant.as_ref().is_some_and(|t| t != &record.tenant) {
            Some(format!(
                "tenant `{}` is not exported (--tenant)",
                record.tenant
            ))
        } else if let Some(min) = options.min_pems.filter(|&min| record.pems < min) {
            Some(format!(
                "PEMS {:.4} is under the export's minimum {min}",
                record.pems
            ))
        } else if let (Some(min), Some(eta)) = (options.min_eta, record.eta) {
            (eta < min).then(|| format!("eta {eta:.3} fell under the export's minimum {min}"))
        } else {
            None
        };
        let reason = reason.or_else(|| {
            (record.support < options.min_support).then(|| {
                format!(
                    "{} source episodes, under the export's minimum {}",
                    record.support, options.min_support
                )
            })
        });
        match reason {
            Some(reason) => {
                left_out.insert(record.lineage.clone(), reason);
            }
            None => records.push(record),
        }
    }
    if options.format == ExportFormat::SkillMd {
        read_eval_episodes(store, &mut graph, &records)?;
    }
    let target = Target::resolve(out)?;
    target.refuse_inside(store.dir())?;
    let existing = inspect(&target.dir)?;
    let previous = previous_release(&target.dir);
    let unchanged = previous
        .as_ref()
        .is_some_and(|previous| same_release(previous, &manifest, &records));
    let changes = changes(previous.as_ref(), unchanged, &records, &left_out);
    std::fs::create_dir_all(&target.parent).map_err(|e| io(&target.parent, e))?;
    let scratch = Scratch::create(target.sibling("tmp"))?;
    let mut last_pass = LastPass {
        redactor,
        counts: fluxmem_redact::Counts::new(),
    };
    let files = write_release(
        &scratch.path,
        out,
        &manifest,
        &graph,
        &records,
        options,
        &changes,
        &mut last_pass,
    )?;
    redacted.merge(&last_pass.counts);
    target.install(scratch, existing)?;
    target.sweep_stale();
    // Against the release in place: an unchanged one repeats its own list of changes.
    let count = |kind: &str| {
        if unchanged {
            0
        } else {
            changes.iter().filter(|c| c["change"] == kind).count()
        }
    };
    Ok(ExportReport {
        skills: records.len(),
        filtered_out: total - records.len(),
        added: count("added"),
        updated: count("updated"),
        retired: count("retired"),
        unchanged,
        redacted,
        files,
        release: out.join(RELEASE_FILE),
    })
}

/// `record` with its texts redacted and its content hash taken again.
fn redact_record(
    mut record: SkillRecord,
    redactor: &fluxmem_redact::Redactor,
    counts: &mut fluxmem_redact::Counts,
) -> SkillRecord {
    if !redactor.is_active() {
        return record;
    }
    let mut redact = |text: &mut String| *text = redactor.redact_into(text, counts);
    redact(&mut record.name);
    redact(&mut record.description);
    redact(&mut record.body);
    record.steps.iter_mut().for_each(&mut redact);
    record.pitfalls.iter_mut().for_each(&mut redact);
    record.decisions.iter_mut().for_each(&mut redact);
    record.content_sha256 = String::new();
    record.content_sha256 = sha256_hex(
        serde_json::to_string(&record)
            .expect("records serialise")
            .as_bytes(),
    );
    record
}

/// True when `previous` (a release manifest) holds exactly `records`' skills, exported from
/// the store version of `manifest`.
fn same_release(
    previous: &Value,
    manifest: &fluxmem_store::Manifest,
    records: &[SkillRecord],
) -> bool {
    let same_store = previous["store"]["manifest_version"].as_u64() == Some(manifest.version);
    let old_ids: BTreeSet<&str> = previous["skills"]
        .as_array()
        .map(|skills| skills.iter().filter_map(|s| s["id"].as_str()).collect())
        .unwrap_or_default();
    let new_ids: BTreeSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
    same_store && old_ids == new_ids
}

/// The changes file of every release.
pub const CHANGES_FILE: &str = "CHANGES.md";

/// The release manifest of an earlier export in `dir`, if it is one of ours.
fn previous_release(dir: &Path) -> Option<Value> {
    let value: Value = serde_json::from_slice(&std::fs::read(dir.join(RELEASE_FILE)).ok()?).ok()?;
    (value["format"] == "fluxmem-skills").then_some(value)
}

/// What changed since `previous` (the release this one replaces): skills `added` (a lineage it
/// did not have), `updated` (a new version of a lineage, with the version, PEMS and eta before
/// and after), `unchanged` and `retired` (a lineage it had that this release has not: its cluster
/// is gone, or a filter such as the eta minimum leaves it out, with the reason from `left_out`;
/// listed, never dropped silently). Re-exporting the same store state (`unchanged`, see
/// [`same_release`]) keeps the previous release's list, so the output stays byte-identical.
fn changes(
    previous: Option<&Value>,
    unchanged: bool,
    records: &[SkillRecord],
    left_out: &BTreeMap<String, String>,
) -> Vec<Value> {
    let old: Vec<&Value> = previous
        .and_then(|p| p["skills"].as_array())
        .map(|s| s.iter().collect())
        .unwrap_or_default();
    if let Some(list) = previous
        .filter(|_| unchanged)
        .and_then(|p| p["changes"].as_array())
    {
        return list.clone();
    }
    let by_lineage: BTreeMap<&str, &Value> = old
        .iter()
        .filter_map(|s| Some((s["lineage"].as_str()?, *s)))
        .collect();
    let mut out = Vec::new();
    let now: BTreeSet<&str> = records.iter().map(|r| r.lineage.as_str()).collect();
    for record in records {
        let after = json!({ "id": record.id, "version": record.version, "pems": record.pems, "eta": record.eta });
        let entry = match by_lineage.get(record.lineage.as_str()) {
            None => {
                json!({ "change": "added", "lineage": record.lineage, "slug": record.slug, "name": record.name, "after": after })
            }
            Some(before) if before["id"] == record.id.as_str() => {
                json!({ "change": "unchanged", "lineage": record.lineage, "slug": record.slug, "name": record.name, "after": after })
            }
            Some(before) => json!({
                "change": "updated", "lineage": record.lineage, "slug": record.slug, "name": record.name,
                "before": { "id": before["id"], "version": before["version"], "pems": before["pems"], "eta": before["eta"] },
                "after": after,
            }),
        };
        out.push(entry);
    }
    for (lineage, before) in &by_lineage {
        if !now.contains(lineage) {
            out.push(json!({
                "change": "retired", "lineage": lineage, "slug": before["slug"], "name": before["name"],
                "before": { "id": before["id"], "version": before["version"], "pems": before["pems"], "eta": before["eta"] },
                "reason": left_out.get(*lineage).cloned().unwrap_or_else(|| retired_reason(before, records)),
            }));
        }
    }
    out
}

/// Why a skill of the previous release has no latest version now: another skill's version
/// took its place (it is among that version's previous versions: one procedure), or its
/// cluster is gone.
fn retired_reason(before: &Value, records: &[SkillRecord]) -> String {
    let id = before["id"].as_str().unwrap_or_default();
    match records
        .iter()
        .find(|r| r.previous_versions.iter().any(|p| p == id))
    {
        Some(record) => format!(
            "one procedure with {} (`{}`), whose version {} takes its place",
            record.name, record.slug, record.version
        ),
        None => "its cluster is gone: no latest skill of the store has this lineage".into(),
    }
}

/// `CHANGES.md`: the changes as a service operator reads them.
fn changes_md(changes: &[Value]) -> String {
    let mut text = String::from("# Changes in this release\n");
    for (kind, title) in [
        ("added", "Added"),
        ("updated", "Updated"),
        ("retired", "Retired"),
        ("unchanged", "Unchanged"),
    ] {
        let items: Vec<&Value> = changes.iter().filter(|c| c["change"] == kind).collect();
        if items.is_empty() {
            continue;
        }
        text.push_str(&format!("\n## {title} ({})\n\n", items.len()));
        for item in items {
            let name = markdown_inline(item["name"].as_str().unwrap_or_default());
            let slug = item["slug"].as_str().unwrap_or_default();
            let score = |side: &Value| {
                let number = |key: &str| {
                    side[key]
                        .as_f64()
                        .map_or("?".to_string(), |v| format!("{v:.4}"))
                };
                format!(
                    "v{} PEMS {} eta {}",
                    side["version"],
                    number("pems"),
                    number("eta")
                )
            };
            let line = match kind {
                "updated" => format!(
                    "- {name} (`{slug}`): {} -> {}\n",
                    score(&item["before"]),
                    score(&item["after"])
                ),
                "retired" => format!(
                    "- {name} (`{slug}`): {}; {}\n",
                    score(&item["before"]),
                    item["reason"].as_str().unwrap_or_default()
                ),
                _ => format!("- {name} (`{slug}`): {}\n", score(&item["after"])),
            };
            text.push_str(&line);
        }
    }
    text
}

/// The redaction pass every exported text goes through last, after templating, truncation and
/// serialisation: what the record-level pass could not see (a secret a template changed the
/// case of, or one that spans two fields) is caught in the file as written.
struct LastPass<'a> {
    redactor: &'a fluxmem_redact::Redactor,
    counts: fluxmem_redact::Counts,
}

impl LastPass<'_> {
    fn text(&mut self, text: &str) -> String {
        self.redactor.redact_into(text, &mut self.counts)
    }

    fn json(&mut self, mut value: Value) -> Value {
        self.redactor.redact_json(&mut value, &mut self.counts);
        value
    }
}

/// The name of a skill folder's eval cases, under `evals/` (the Agent Skills layout).
const EVALS_FILE: &str = "evals.json";

/// Cases at most in a skill's `evals/evals.json`.
const MAX_EVAL_CASES: usize = 5;

/// The ids of the episodes a skill's eta was measured on (its `measured_on` metadata).
fn measured_on(graph: &Graph, record: &SkillRecord) -> Vec<String> {
    graph
        .nodes
        .get(&fluxmem_graph::NodeId::from(record.id.as_str()))
        .and_then(|n| n.metadata.get("measured_on"))
        .and_then(Value::as_array)
        .map(|ids| {
            ids.iter()
                .filter_map(|id| id.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Adds to `graph` the episodes (with their steps) that the released skills' eval cases are
/// built from: a projected read of those rows only.
fn read_eval_episodes(store: &Store, graph: &mut Graph, records: &[SkillRecord]) -> Result<()> {
    let ids: BTreeSet<fluxmem_graph::NodeId> = records
        .iter()
        .flat_map(|r| measured_on(graph, r))
        .map(|id| fluxmem_graph::NodeId::from(id.as_str()))
        .collect();
    if ids.is_empty() {
        return Ok(());
    }
    let scan = fluxmem_store::Scan {
        nodes: true,
        nodes_of: Some(ids.clone()),
        steps: fluxmem_store::Rows::Of(ids),
        ..Default::default()
    };
    let (episodes, _) = store.scan(&scan)?;
    graph.nodes.extend(episodes.nodes);
    Ok(())
}

/// A skill's eval cases in the Agent Skills format (`skill_name`, `evals`: `id`, `prompt`,
/// `expected_output`, `files`, `assertions`): one case per successful episode that eta was
/// measured on (the episodes kept back from mining when the cluster had enough successes, as
/// `source` says), at most [`MAX_EVAL_CASES`]. The prompt is the episode's task; the expected
/// output is its tool calls in order; the assertions are the calls the skill's steps name, in
/// their order, and its checks. An agent run on the prompt with the skill can be graded on
/// them.
fn evals_json(record: &SkillRecord, graph: &Graph) -> Value {
    let kept_back = record.eta_source.contains("held-out");
    let source = if kept_back {
        "an episode kept back from mining"
    } else {
        "an episode the skill was mined from (too few successes to keep some back)"
    };
    let measured = measured_on(graph, record);
    let calls: Vec<String> = record
        .steps
        .iter()
        .filter_map(|step| crate::mine::step_call(step).map(|(tool, _)| tool.to_string()))
        .collect();
    let mut assertions: Vec<String> = calls
        .iter()
        .map(|tool| format!("The agent calls `{tool}`."))
        .collect();
    if calls.len() > 1 {
        assertions.push(format!(
            "The calls come in this order: {}.",
            calls
                .iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    // Checks and orders are assertions; the paths some runs took at a decision are not (a
    // case takes one of them), nor the lines skills stored before decision points said them in.
    assertions.extend(
        record
            .pitfalls
            .iter()
            .filter(|p| !p.starts_with(LEGACY_BRANCH_PREFIX))
            .map(|p| format!("It heeds: {p}")),
    );
    let cases: Vec<Value> = measured
        .iter()
        .filter_map(|id| graph.nodes.get(&fluxmem_graph::NodeId::from(id.as_str())))
        .filter(|n| n.episode().and_then(|e| e.outcome.success) == Some(true))
        .take(MAX_EVAL_CASES)
        .enumerate()
        .map(|(i, episode)| {
            let tools: Vec<String> = episode
                .episode()
                .into_iter()
                .flat_map(|e| &e.steps)
                .flat_map(|s| &s.tool_calls)
                .map(|c| format!("`{}`", c.name))
                .collect();
            json!({
                "id": i + 1,
                "prompt": episode.text.trim(),
                "expected_output": if tools.is_empty() {
                    "The task is done as in the logged run.".to_string()
                } else {
                    format!("The task is done with these tool calls, in order: {}.", tools.join(", "))
                },
                "files": [],
                "assertions": assertions,
                "source": source,
            })
        })
        .collect();
    json!({ "skill_name": record.slug, "evals": cases })
}

/// How a pitfall line of a skill stored before decision points began when it told of another
/// path some runs took (not a check).
const LEGACY_BRANCH_PREFIX: &str = "Some runs also take another path:";

/// Writes the release's files and its manifest into `dir` (the temporary directory), each
/// fsynced, then fsyncs every folder; returns the files, relative to the release. `out`, the
/// final directory, only names files in error messages.
#[allow(clippy::too_many_arguments)] // the release's inputs, each read once; a struct would only rename them
fn write_release(
    dir: &Path,
    out: &Path,
    manifest: &fluxmem_store::Manifest,
    graph: &Graph,
    records: &[SkillRecord],
    options: &ExportOptions,
    changes: &[Value],
    last_pass: &mut LastPass,
) -> Result<Vec<String>> {
    let mut files = Vec::new();
    write(
        &dir.join(CHANGES_FILE),
        last_pass.text(&changes_md(changes)).as_bytes(),
    )?;
    files.push(CHANGES_FILE.to_string());
    match options.format {
        ExportFormat::SkillMd => {
            for record in records {
                let folder = dir.join(&record.slug);
                // Slugs are unique, so a folder that already exists would be a bug: fail.
                std::fs::create_dir(&folder).map_err(|e| io(&folder, e))?;
                write(
                    &folder.join("SKILL.md"),
                    last_pass.text(&skill_md(record)).as_bytes(),
                )?;
                let provenance = serde_json::to_vec_pretty(&last_pass.json(provenance(record)))
                    .expect("provenance serialises");
                write(&folder.join(PROVENANCE_FILE), &provenance)?;
                let evals_dir = folder.join("evals");
                std::fs::create_dir(&evals_dir).map_err(|e| io(&evals_dir, e))?;
                let evals = serde_json::to_vec_pretty(&last_pass.json(evals_json(record, graph)))
                    .expect("evals serialise");
                write(&evals_dir.join(EVALS_FILE), &evals)?;
                sync_dir(&evals_dir)?;
                sync_dir(&folder)?;
                files.push(format!("{}/SKILL.md", record.slug));
                files.push(format!("{}/{PROVENANCE_FILE}", record.slug));
                files.push(format!("{}/evals/{EVALS_FILE}", record.slug));
            }
        }
        ExportFormat::Jsonl => {
            let mut body = String::new();
            for record in records {
                // The record's texts passed the redactor field by field (`redact_record`), and
                // serialising does not change them.
                body.push_str(&serde_json::to_string(record).expect("records serialise"));
                body.push('\n');
            }
            write(&dir.join("skills.jsonl"), body.as_bytes())?;
            files.push("skills.jsonl".into());
        }
        ExportFormat::Parquet => {
            let bytes = parquet_bytes(records, &out.join("skills.parquet"))?;
            write(&dir.join("skills.parquet"), &bytes)?;
            files.push("skills.parquet".into());
        }
    }
    let release = last_pass.json(release_manifest(
        manifest, graph, records, options, &files, changes,
    ));
    let mut bytes = serde_json::to_vec_pretty(&release).expect("JSON values serialise");
    bytes.push(b'\n');
    write(&dir.join(RELEASE_FILE), &bytes)?;
    sync_dir(dir)?;
    Ok(files)
}

fn io(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// An I/O error of our own, with `message`, on `path`.
fn refused(path: &Path, message: String) -> Error {
    io(path, std::io::Error::other(message))
}

/// Writes `bytes` to a new file at `path` and fsyncs it.
fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    injected_failure(path)?;
    let mut file = std::fs::File::create(path).map_err(|e| io(path, e))?;
    file.write_all(bytes).map_err(|e| io(path, e))?;
    file.sync_all().map_err(|e| io(path, e))
}

/// Fsyncs the directory `dir`, so the entries created or renamed in it survive a crash. Only
/// on Unix, where a directory opens as a file.
fn sync_dir(dir: &Path) -> Result<()> {
    if cfg!(unix) {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(dir, e))?;
    }
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// Test hook: how many more files [`write`] writes before it fails (`None`: never fails).
    static WRITES_BEFORE_FAILURE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

#[cfg(test)]
fn injected_failure(path: &Path) -> Result<()> {
    WRITES_BEFORE_FAILURE.with(|left| match left.get() {
        Some(0) => Err(refused(path, "injected write failure".into())),
        Some(n) => {
            left.set(Some(n - 1));
            Ok(())
        }
        None => Ok(()),
    })
}

#[cfg(not(test))]
fn injected_failure(_: &Path) -> Result<()> {
    Ok(())
}

/// Tells the temporary and the set-aside directories of concurrent exports of one process apart.
static EXPORTS: AtomicU64 = AtomicU64::new(0);

/// What the export directory holds before the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Existing {
    /// Nothing.
    Missing,
    /// An empty directory.
    Empty,
    /// An earlier export, every file of it listed in its release manifest.
    Export,
}

/// Where a release goes: the export directory (links resolved), its parent and its name.
struct Target {
    dir: PathBuf,
    parent: PathBuf,
    name: OsString,
    /// `<pid>-<n>`, unique to this export.
    tag: String,
}

impl Target {
    fn resolve(out: &Path) -> Result<Target> {
        let dir = match std::fs::canonicalize(out) {
            Ok(real) => real,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => out.to_path_buf(),
            Err(e) => return Err(io(out, e)),
        };
        let Some(name) = dir.file_name().map(|n| n.to_os_string()) else {
            return Err(refused(
                out,
                "the export directory needs a name of its own (not `..` or a root)".into(),
            ));
        };
        let parent = match dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let tag = format!(
            "{}-{}",
            std::process::id(),
            EXPORTS.fetch_add(1, Ordering::Relaxed)
        );
        Ok(Target {
            dir,
            parent,
            name,
            tag,
        })
    }

    /// Refuses an export directory inside the store directory `store` (or the store itself):
    /// the release would sit among the shards, and a store's cleanup could not tell it apart.
    fn refuse_inside(&self, store: &Path) -> Result<()> {
        let store = std::fs::canonicalize(store).map_err(|e| io(store, e))?;
        // The export directory may not exist yet: judge by its nearest existing ancestor.
        let absolute = match std::env::current_dir() {
            Ok(cwd) => cwd.join(&self.dir),
            Err(e) => return Err(io(&self.dir, e)),
        };
        let mut existing = absolute.as_path();
        while !existing.exists() {
            match existing.parent() {
                Some(parent) => existing = parent,
                None => break,
            }
        }
        let real = std::fs::canonicalize(existing)
            .map_err(|e| io(existing, e))?
            .join(absolute.strip_prefix(existing).unwrap_or(Path::new("")));
        if real.starts_with(&store) {
            return Err(refused(
                &self.dir,
                format!(
                    "is inside the store {}; export to a directory outside it",
                    store.display()
                ),
            ));
        }
        Ok(())
    }

    /// Removes the leftovers of killed exports to this directory (`.<name>.tmp-<pid>-<n>`,
    /// `.<name>.old-<pid>-<n>`) whose process is provably gone; returns how many.
    fn sweep_stale(&self) -> usize {
        if !Path::new("/proc/self").exists() {
            return 0; // no way to prove a process gone
        }
        let mut prefix = OsString::from(".");
        prefix.push(&self.name);
        let prefix = prefix.to_string_lossy().into_owned();
        let Ok(entries) = std::fs::read_dir(&self.parent) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            let Some(tag) = rest
                .strip_prefix(".tmp-")
                .or_else(|| rest.strip_prefix(".old-"))
            else {
                continue;
            };
            let Some((pid, counter)) = tag.split_once('-') else {
                continue;
            };
            let ours = pid.parse::<u32>().is_ok() && counter.parse::<u64>().is_ok();
            let alive = Path::new("/proc").join(pid).exists();
            if ours && !alive && std::fs::remove_dir_all(entry.path()).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    /// `<parent>/.<name>.<what>-<tag>`.
    fn sibling(&self, what: &str) -> PathBuf {
        let mut name = OsString::from(".");
        name.push(&self.name);
        name.push(format!(".{what}-{}", self.tag));
        self.parent.join(name)
    }

    /// Moves the finished release in `scratch` to the export directory (see [`export_skills`]).
    fn install(&self, scratch: Scratch, existing: Existing) -> Result<()> {
        let old = self.sibling("old");
        match existing {
            Existing::Missing => {}
            Existing::Empty => std::fs::remove_dir(&self.dir).map_err(|e| io(&self.dir, e))?,
            Existing::Export => std::fs::rename(&self.dir, &old).map_err(|e| io(&self.dir, e))?,
        }
        if let Err(error) = std::fs::rename(&scratch.path, &self.dir) {
            // Best effort: put back what was there; the error that matters is the rename's.
            match existing {
                Existing::Missing => {}
                Existing::Empty => {
                    let _ = std::fs::create_dir(&self.dir);
                }
                Existing::Export => {
                    let _ = std::fs::rename(&old, &self.dir);
                }
            }
            return Err(io(&self.dir, error));
        }
        scratch.installed();
        sync_dir(&self.parent)?;
        if existing == Existing::Export {
            std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
        }
        Ok(())
    }
}

/// The temporary directory a release is written into; removed when dropped, unless installed.
struct Scratch {
    path: PathBuf,
    installed: bool,
}

impl Scratch {
    fn create(path: PathBuf) -> Result<Scratch> {
        if std::fs::symlink_metadata(&path).is_ok() {
            // Same pid and counter: a leftover of a killed export of an earlier process.
            std::fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
        }
        std::fs::create_dir(&path).map_err(|e| io(&path, e))?;
        Ok(Scratch {
            path,
            installed: false,
        })
    }

    fn installed(mut self) {
        self.installed = true;
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.installed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Checks, without writing anything, that [`export_skills`] may write its release to `dir`:
/// missing, empty, or an earlier export holding only what its release lists.
pub fn check_export_target(dir: &Path) -> Result<()> {
    inspect(dir).map(|_| ())
}

/// What `dir` holds, refusing anything the export may not replace (see [`export_skills`]).
fn inspect(dir: &Path) -> Result<Existing> {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::Missing),
        Err(e) => return Err(io(dir, e)),
        Ok(metadata) if !metadata.is_dir() => {
            return Err(refused(dir, "exists and is not a directory".into()))
        }
        Ok(_) => {}
    }
    if std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .next()
        .is_none()
    {
        return Ok(Existing::Empty);
    }
    let release = dir.join(RELEASE_FILE);
    let listed = std::fs::read(&release)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    let Some(listed) = listed else {
        return Err(Error::OutputNotEmpty {
            path: dir.to_path_buf(),
        });
    };
    if listed.get("format").and_then(Value::as_str) != Some("fluxmem-skills") {
        return Err(refused(dir, format!("its {RELEASE_FILE} is not a fluxmem skill release; refusing to replace the directory")));
    }
    let mut files: BTreeSet<String> = BTreeSet::from([RELEASE_FILE.to_string()]);
    let mut folders: BTreeSet<String> = BTreeSet::new();
    for file in listed
        .get("files")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        let parts: Vec<&str> = file.split('/').collect();
        // Only plain relative paths, as an export writes them (`slug/SKILL.md`, `skills.jsonl`).
        if parts
            .iter()
            .any(|part| part.is_empty() || *part == "." || *part == "..")
        {
            continue;
        }
        for end in 1..parts.len() {
            folders.insert(parts[..end].join("/"));
        }
        files.insert(file.to_string());
    }
    let mut unlisted = Vec::new();
    find_unlisted(dir, "", &files, &folders, &mut unlisted)?;
    if unlisted.is_empty() {
        return Ok(Existing::Export);
    }
    const SHOWN: usize = 5;
    let more = if unlisted.len() > SHOWN {
        format!(" and {} more", unlisted.len() - SHOWN)
    } else {
        String::new()
    };
    Err(refused(
        dir,
        format!(
            "the earlier export here also holds {} that its {RELEASE_FILE} does not list ({}{more}); refusing to replace it \
             (they would be lost): move them away or export elsewhere",
            if unlisted.len() == 1 { "an entry".to_string() } else { format!("{} entries", unlisted.len()) },
            unlisted[..unlisted.len().min(SHOWN)].join(", "),
        ),
    ))
}

/// Appends to `unlisted` the entries under `dir` (at `prefix` in the release) that are neither a
/// listed regular file nor a folder of one; in name order, folders with a trailing `/`.
fn find_unlisted(
    dir: &Path,
    prefix: &str,
    files: &BTreeSet<String>,
    folders: &BTreeSet<String>,
    unlisted: &mut Vec<String>,
) -> Result<()> {
    let mut entries = std::fs::read_dir(dir)
        .and_then(|entries| entries.collect::<std::io::Result<Vec<_>>>())
        .map_err(|e| io(dir, e))?;
    entries.sort_by_key(|entry| entry.file_name());
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        let relative = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        // Not followed: a link is never a listed file or folder.
        let kind = entry.file_type().map_err(|e| io(&entry.path(), e))?;
        if kind.is_dir() && folders.contains(&relative) {
            find_unlisted(&entry.path(), &relative, files, folders, unlisted)?;
        } else if !(kind.is_file() && files.contains(&relative)) {
            unlisted.push(if kind.is_dir() {
                format!("{relative}/")
            } else {
                relative
            });
        }
    }
    Ok(())
}

/// The provenance file next to each `SKILL.md`.
pub const PROVENANCE_FILE: &str = "provenance.json";

/// Longest description the Agent Skills format allows.
const MAX_DESCRIPTION_CHARS: usize = 1024;

/// Everything a service may want to trace a skill back to the logs.
fn provenance(record: &SkillRecord) -> Value {
    json!({
        "id": record.id,
        "lineage": record.lineage,
        "version": record.version,
        "tenant": record.tenant,
        "pems": record.pems,
        "pems_history": record.pems_history,
        "support": record.support,
        "source_episodes": record.source_episodes,
        "previous_versions": record.previous_versions,
        "eta_source": record.eta_source,
        "generator": record.generator,
        "judge": record.judge,
        "content_sha256": record.content_sha256,
    })
}

/// `SKILL.md` in the Agent Skills format: front matter with only `name` (the folder name),
/// `description` (at most 1024 characters) and `metadata` (string values: our provenance in
/// short; the whole of it is in `provenance.json`), then the body. Text from the logs or a
/// model is escaped, so it cannot open a heading, a list, HTML or front matter.
fn skill_md(record: &SkillRecord) -> String {
    let mut text = String::from("---\n");
    text.push_str(&format!("name: {}\n", yaml_string(&record.slug)));
    let description: String = if record.description.chars().count() > MAX_DESCRIPTION_CHARS {
        record
            .description
            .chars()
            .take(MAX_DESCRIPTION_CHARS - 1)
            .collect::<String>()
            + "…"
    } else {
        record.description.clone()
    };
    text.push_str(&format!("description: {}\n", yaml_string(&description)));
    text.push_str("metadata:\n");
    let metadata = [
        ("title", record.name.clone()),
        ("id", record.id.clone()),
        ("lineage", record.lineage.clone()),
        ("version", record.version.to_string()),
        ("tenant", record.tenant.clone()),
        ("pems", yaml_number(record.pems)),
        ("support", record.support.to_string()),
        ("eta_source", record.eta_source.clone()),
        ("generator", record.generator.clone()),
        ("content_sha256", record.content_sha256.clone()),
        ("provenance", PROVENANCE_FILE.to_string()),
    ];
    for (key, value) in metadata {
        text.push_str(&format!("  {key}: {}\n", yaml_string(&value)));
    }
    text.push_str("---\n\n");
    text.push_str(&format!(
        "# {}\n\n{}\n\n## Steps\n\n",
        markdown_inline(&record.name),
        markdown_inline(&record.description)
    ));
    for (i, step) in record.steps.iter().enumerate() {
        text.push_str(&format!("{}. {}\n", i + 1, markdown_inline(step)));
    }
    if !record.decisions.is_empty() {
        text.push_str("\n## Decision points\n\n");
        for decision in &record.decisions {
            text.push_str(&format!("- {}\n", markdown_inline(decision)));
        }
    }
    if !record.pitfalls.is_empty() {
        text.push_str("\n## Pitfalls\n\n");
        for pitfall in &record.pitfalls {
            text.push_str(&format!("- {}\n", markdown_inline(pitfall)));
        }
    }
    text
}

/// Text as one line of Markdown that renders as itself: line breaks become spaces, and the
/// characters that open structure or markup (`\\ < > * _ [ ] #` and a leading `-`, `+`, `=`,
/// `|`, digit-dot) are backslash-escaped. Backticks are kept (tool names are code spans), but an
/// odd one out is escaped so a span cannot swallow the rest of the line.
pub(crate) fn markdown_inline(text: &str) -> String {
    let flat: String = text
        .split(['\n', '\r'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let balanced = flat.matches('`').count().is_multiple_of(2);
    let mut out = String::with_capacity(flat.len() + 8);
    let mut in_code = false;
    for (i, c) in flat.chars().enumerate() {
        if c == '`' && balanced {
            // Inside a code span nothing is markup, and a backslash would show.
            in_code = !in_code;
            out.push(c);
            continue;
        }
        let structural = i == 0 && matches!(c, '-' | '+' | '=' | '|' | '>');
        if !in_code
            && (matches!(c, '\\' | '<' | '>' | '*' | '_' | '[' | ']' | '#' | '`') || structural)
        {
            out.push('\\');
        }
        out.push(c);
    }
    // `12. text` or `3) text` would start an ordered list.
    let digits = out.chars().take_while(char::is_ascii_digit).count();
    if digits > 0 && (out[digits..].starts_with('.') || out[digits..].starts_with(')')) {
        out.insert(digits, '\\');
    }
    out
}

/// A float as YAML reads it back exactly (Rust's shortest round-trip form; `.nan`/`.inf` spelled out).
fn yaml_number(value: f64) -> String {
    if value.is_nan() {
        ".nan".into()
    } else if value.is_infinite() {
        if value > 0.0 { ".inf" } else { "-.inf" }.into()
    } else {
        format!("{value:?}")
    }
}

fn release_manifest(
    manifest: &fluxmem_store::Manifest,
    graph: &Graph,
    records: &[SkillRecord],
    options: &ExportOptions,
    files: &[String],
    changes: &[Value],
) -> Value {
    let ids: BTreeSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
    let mut generators = BTreeSet::new();
    let mut judges = BTreeSet::new();
    for node in graph.nodes.values().filter(|n| ids.contains(n.id.as_str())) {
        generators.insert(text(node, "generator"));
        if let Some(judge) = node.metadata.get("judge").and_then(Value::as_str) {
            judges.insert(judge.to_string());
        }
    }
    generators.remove("");
    let hashes: Vec<&str> = records.iter().map(|r| r.content_sha256.as_str()).collect();
    json!({
        "format": "fluxmem-skills",
        "format_version": 1,
        "skill_format": options.format,
        // Data time, not commit time: the latest source time of the skills released, so two
        // runs over the same logs give the same release on any machine.
        "created_at": records
            .iter()
            .filter_map(|r| graph.nodes.get(&fluxmem_graph::NodeId::from(r.id.as_str())).and_then(|n| n.created_at))
            .max()
            .and_then(chrono::DateTime::from_timestamp_millis)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
        "store": { "manifest_version": manifest.version, "schema_version": manifest.schema_version },
        "models": {
            "embedding": manifest.embedding_model.as_ref().map(|m| m.id.clone()),
            "generators": generators,
            "judges": judges,
        },
        "filters": { "tenant": options.tenant, "min_pems": options.min_pems, "min_eta": options.min_eta, "min_support": options.min_support },
        "release_sha256": sha256_hex(hashes.join("\n").as_bytes()),
        "skills": records.iter().map(|r| json!({
            "id": r.id, "lineage": r.lineage, "slug": r.slug, "name": r.name, "tenant": r.tenant,
            "version": r.version, "pems": r.pems, "eta": r.eta, "support": r.support, "content_sha256": r.content_sha256,
        })).collect::<Vec<_>>(),
        "changes": changes,
        "files": files,
    })
}

fn parquet_bytes(records: &[SkillRecord], path: &Path) -> Result<Vec<u8>> {
    use arrow_schema::{DataType, Field, Schema};
    let strings = |f: fn(&SkillRecord) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(records.iter().map(f)))
    };
    let lists = |f: fn(&SkillRecord) -> &Vec<String>| -> ArrayRef {
        let mut builder = ListBuilder::new(StringBuilder::new());
        for record in records {
            for value in f(record) {
                builder.values().append_value(value);
            }
            builder.append(true);
        }
        Arc::new(builder.finish())
    };
    let mut history = ListBuilder::new(Float64Builder::new());
    for record in records {
        history.values().append_slice(&record.pems_history);
        history.append(true);
    }
    let utf8_list = DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)));
    let schema = Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("lineage", DataType::Utf8, false),
        Field::new("tenant", DataType::Utf8, false),
        Field::new("slug", DataType::Utf8, false),
        Field::new("name", DataType::Utf8, false),
        Field::new("description", DataType::Utf8, false),
        Field::new("body", DataType::Utf8, false),
        Field::new("steps", utf8_list.clone(), true),
        Field::new("version", DataType::Int64, false),
        Field::new("pems", DataType::Float64, false),
        Field::new(
            "pems_history",
            DataType::List(Arc::new(Field::new("item", DataType::Float64, true))),
            true,
        ),
        Field::new("support", DataType::UInt64, false),
        Field::new("source_episodes", utf8_list.clone(), true),
        Field::new("previous_versions", utf8_list, true),
        Field::new("eta_source", DataType::Utf8, false),
        Field::new("generator", DataType::Utf8, false),
        Field::new("judge", DataType::Utf8, true),
        Field::new("content_sha256", DataType::Utf8, false),
    ]);
    let columns: Vec<ArrayRef> = vec![
        strings(|r| &r.id),
        strings(|r| &r.lineage),
        strings(|r| &r.tenant),
        strings(|r| &r.slug),
        strings(|r| &r.name),
        strings(|r| &r.description),
        strings(|r| &r.body),
        lists(|r| &r.steps),
        Arc::new(Int64Array::from_iter_values(
            records.iter().map(|r| r.version),
        )),
        Arc::new(Float64Array::from_iter_values(
            records.iter().map(|r| r.pems),
        )),
        Arc::new(history.finish()),
        Arc::new(UInt64Array::from_iter_values(
            records.iter().map(|r| r.support as u64),
        )),
        lists(|r| &r.source_episodes),
        lists(|r| &r.previous_versions),
        strings(|r| &r.eta_source),
        strings(|r| &r.generator),
        Arc::new(StringArray::from(
            records.iter().map(|r| r.judge.clone()).collect::<Vec<_>>(),
        )),
        strings(|r| &r.content_sha256),
    ];
    let encode = |reason: String| Error::Encode {
        path: path.to_path_buf(),
        reason,
    };
    let batch =
        RecordBatch::try_new(Arc::new(schema), columns).map_err(|e| encode(e.to_string()))?;
    let properties = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .build();
    let mut buffer = Vec::new();
    let mut writer =
        parquet::arrow::ArrowWriter::try_new(&mut buffer, batch.schema(), Some(properties))
            .map_err(|e| encode(e.to_string()))?;
    writer.write(&batch).map_err(|e| encode(e.to_string()))?;
    writer.close().map_err(|e| encode(e.to_string()))?;
    Ok(buffer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_and_yaml_quoting() {
        assert_eq!(
            slugify("Put a *clean* Object in/on a Receptacle!"),
            "put-a-clean-object-in-on-a-receptacle"
        );
        assert_eq!(slugify("???"), "skill");
        assert_eq!(slugify(&"a".repeat(100)).len(), 64);
        assert_eq!(
            yaml_string("say \"hi\"\n\\ \u{1}"),
            "\"say \\\"hi\\\"\\n\\\\ \\x01\""
        );
        assert_eq!(yaml_number(0.25), "0.25");
        assert_eq!(yaml_number(f64::NAN), ".nan");
        assert_eq!(
            "jsonl".parse::<ExportFormat>().unwrap(),
            ExportFormat::Jsonl
        );
        assert!("yaml".parse::<ExportFormat>().is_err());
    }

    /// A first-version skill named `name`, distilled from the episode `episode`.
    fn skill(name: &str, episode: &str) -> Node {
        let body = NodeBody::Procedural(fluxmem_graph::Skill {
            version: 1,
            previous_versions: Vec::new(),
            source_episodes: vec![fluxmem_graph::NodeId::from(episode)],
            pems_history: vec![0.5],
        });
        let mut node = Node::new(
            body,
            "default",
            &format!("Name: {name}\nSteps:\n1. one\n2. two\n"),
            &["test", name, episode],
        );
        node.metadata.insert("name".into(), json!(name));
        node.metadata
            .insert("description".into(), json!(format!("Use for {name}.")));
        node.metadata.insert("steps".into(), json!(["one", "two"]));
        node
    }

    fn graph_of(skills: &[(&str, &str)]) -> Graph {
        let mut graph = Graph::default();
        for (name, episode) in skills {
            graph.upsert_node(skill(name, episode));
        }
        graph
    }

    fn slugs(records: &[SkillRecord]) -> BTreeSet<&str> {
        records.iter().map(|r| r.slug.as_str()).collect()
    }

    #[test]
    fn slugs_stay_unique_when_a_name_looks_like_a_suffix() {
        let graph = graph_of(&[("Foo", "e1"), ("Foo", "e2"), ("Foo 2", "e3")]);
        let records = skill_records(&graph);
        assert_eq!(
            slugs(&records),
            BTreeSet::from(["foo", "foo-2", "foo-3"]),
            "{records:#?}"
        );
        assert_eq!(
            records.iter().find(|r| r.name == "Foo 2").unwrap().slug,
            "foo-2",
            "a genuine `foo-2` keeps its slug"
        );
        assert_eq!(skill_records(&graph), records, "deterministic");

        let graph = graph_of(&[
            ("Foo", "e1"),
            ("Foo", "e2"),
            ("foo-2", "e3"),
            ("Foo 2", "e4"),
            ("foo 3", "e5"),
        ]);
        let records = skill_records(&graph);
        assert_eq!(
            slugs(&records),
            BTreeSet::from(["foo", "foo-2", "foo-2-2", "foo-3", "foo-4"]),
            "{records:#?}"
        );
        assert_eq!(
            records.iter().find(|r| r.name == "foo 3").unwrap().slug,
            "foo-3"
        );

        // Suffixed slugs stay within the length limit, and unique.
        let long = "a".repeat(80);
        let records = skill_records(&graph_of(&[
            (long.as_str(), "e1"),
            (long.as_str(), "e2"),
            (long.as_str(), "e3"),
        ]));
        assert_eq!(slugs(&records).len(), 3, "{records:#?}");
        assert!(
            records.iter().all(|r| r.slug.len() <= MAX_SLUG),
            "{records:#?}"
        );
    }

    /// `skill` with a stored skeleton: its step keys and one decision's paths' keys.
    fn with_skeleton(mut node: Node, steps: &[&str], paths: &[&[&str]]) -> Node {
        node.metadata.insert("steps".into(), json!(steps));
        let steps: Vec<Value> = steps
            .iter()
            .map(|k| json!({ "key": k, "text": k }))
            // A step of its own that a rewrite dropped: not what the skill shows.
            .chain([json!({ "key": format!("drop {} <1>", node.id), "text": "dropped" })])
            .collect();
        let paths: Vec<Value> = paths.iter().map(|keys| json!({ "keys": keys })).collect();
        node.metadata.insert(
            "skeleton".into(),
            json!({ "steps": steps, "decisions": [{ "paths": paths }] }),
        );
        node
    }

    #[test]
    fn skills_of_one_tenant_that_share_a_name_are_told_apart_by_their_procedure() {
        let walk = [
            "go to <1>",
            "take <1> from <2>",
            "go to <1>",
            "put <1> in/on <2>",
        ];
        let opened = [
            "go to <1>",
            "open <1>",
            "take <1> from <2>",
            "put <1> in/on <2>",
        ];
        let mut graph = Graph::default();
        for node in [
            with_skeleton(
                skill("Take and put", "e1"),
                &walk,
                &[&["cool <1> with <2>"]],
            ),
            with_skeleton(
                skill("Take and put", "e2"),
                &walk,
                &[&["cool <1> with <2>"], &["use <1>"], &[]],
            ),
            with_skeleton(
                skill("take and put", "e3"),
                &opened,
                &[&["clean <1> with <2>"]],
            ),
            with_skeleton(
                skill("Send certificate", "e4"),
                &[
                    "call get_user_details(user_id)",
                    "call send_certificate(amount,user_id)",
                ],
                &[],
            ),
            with_skeleton(
                skill("Send certificate", "e5"),
                &[
                    "call get_user_details(user_id)",
                    "call send_certificate(amount,user_id)",
                ],
                &[],
            ),
        ] {
            graph.upsert_node(node);
        }
        let mut other = with_skeleton(skill("Take and put", "e6"), &opened, &[]);
        other.tenant = "other".into();
        graph.upsert_node(other);
        let records = skill_records(&graph);
        let named = |episode: &str| {
            records
                .iter()
                .find(|r| r.source_episodes == [episode])
                .unwrap()
        };
        assert_eq!(named("e1").name, "Take and put", "nothing of its own");
        assert_eq!(named("e2").name, "Take and put, sometimes use");
        assert_eq!(named("e3").name, "take and put, with open");
        assert_eq!(named("e3").slug, "take-and-put-with-open");
        assert!(
            named("e3")
                .body
                .starts_with("Name: take and put, with open\n"),
            "{}",
            named("e3").body
        );
        assert_eq!(
            named("e6").name,
            "Take and put",
            "another tenant's is apart already"
        );
        // The same procedure twice keeps its name; the slug tells the two apart.
        assert_eq!(named("e4").name, "Send certificate");
        assert_eq!(named("e5").name, "Send certificate");
        assert_eq!(
            slugs(&records),
            BTreeSet::from([
                "send-certificate",
                "send-certificate-2",
                "take-and-put",
                "take-and-put-2",
                "take-and-put-sometimes-use",
                "take-and-put-with-open",
            ]),
            "{records:#?}"
        );
        assert_eq!(skill_records(&graph), records, "deterministic");
    }

    /// Names in `dir`, sorted.
    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Every file under `dir` with its bytes, sorted by relative path.
    fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else {
                    out.push((
                        path.strip_prefix(dir).unwrap().display().to_string(),
                        std::fs::read(&path).unwrap(),
                    ));
                }
            }
        }
        out.sort();
        out
    }

    fn fail_after(writes: Option<usize>) {
        WRITES_BEFORE_FAILURE.with(|left| left.set(writes));
    }

    #[test]
    fn a_failed_export_keeps_the_previous_release_and_leaves_no_temporary_directory() {
        let dir = tempfile::tempdir().unwrap();
        let store_dir = dir.path().join("store");
        let mut writer = fluxmem_store::Writer::open(&store_dir).unwrap();
        let graph = graph_of(&[("Wash lettuce", "e1"), ("Book a flight", "e2")]);
        writer
            .commit(
                &graph,
                fluxmem_store::CommitInfo {
                    stage: "test".into(),
                    ..Default::default()
                },
            )
            .unwrap();
        drop(writer);
        let store = Store::open(&store_dir).unwrap();
        let parent = dir.path().join("exports");
        let out = parent.join("skills");
        let md = ExportOptions {
            format: ExportFormat::SkillMd,
            tenant: None,
            min_pems: None,
            min_eta: None,
            min_support: 0,
        };

        // A first export that fails half-way (the second SKILL.md) leaves nothing behind.
        fail_after(Some(1));
        let failed = export_skills(&store, &out, &md);
        fail_after(None);
        assert!(failed.is_err());
        assert_eq!(
            entries(&parent),
            Vec::<String>::new(),
            "no partial release and no temporary directory"
        );

        let report = export_skills(&store, &out, &md).unwrap();
        assert_eq!(report.skills, 2);
        let before = tree(&out);
        assert_eq!(
            before.len(),
            8,
            "two SKILL.md, their provenance.json and evals/evals.json, CHANGES.md and the release manifest"
        );
        assert_eq!(entries(&parent), vec!["skills"]);

        // A replacing export that fails before (0) or at (1) its release manifest: the
        // previous release stays whole, with its release.json.
        let jsonl = ExportOptions {
            format: ExportFormat::Jsonl,
            ..md.clone()
        };
        for writes in 0..2 {
            fail_after(Some(writes));
            let failed = export_skills(&store, &out, &jsonl);
            fail_after(None);
            assert!(failed.is_err(), "failure after {writes} writes");
            assert_eq!(
                tree(&out),
                before,
                "the previous release is untouched after {writes} writes"
            );
            assert_eq!(
                entries(&parent),
                vec!["skills"],
                "no temporary directory left after {writes} writes"
            );
        }

        // And without a failure the replace goes through, leaving nothing next to it.
        export_skills(&store, &out, &jsonl).unwrap();
        assert_eq!(
            entries(&out),
            vec![CHANGES_FILE, RELEASE_FILE, "skills.jsonl"]
        );
        assert_eq!(entries(&parent), vec!["skills"]);
    }
}

#[cfg(test)]
mod markdown_tests {
    use super::markdown_inline;

    #[test]
    fn step_text_cannot_open_structure_and_code_spans_stay_literal() {
        assert_eq!(
            markdown_inline("Call `get_order` with <order_id>."),
            "Call `get_order` with \\<order\\_id\\>."
        );
        assert_eq!(
            markdown_inline("# heading\n---\nname: x"),
            "\\# heading --- name: x"
        );
        assert_eq!(markdown_inline("- item"), "\\- item");
        assert_eq!(markdown_inline("12. not a list"), "12\\. not a list");
        assert_eq!(markdown_inline("odd ` tick"), "odd \\` tick");
        assert_eq!(markdown_inline("[link](x) *em*"), "\\[link\\](x) \\*em\\*");
    }
}
