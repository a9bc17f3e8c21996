//! Export of the skill set: the latest version of every skill, as `SKILL.md` folders (the
//! layout agent runtimes load as "agent skills"), JSONL or Parquet, plus a release manifest.
//!
//! Nothing in the output depends on the wall clock or on the export directory: the creation
//! time is the store's last commit time, records and folders are in a fixed order, so
//! exporting the same store twice gives byte-identical files.

use arrow_array::builder::{Float64Builder, ListBuilder, StringBuilder};
use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, UInt64Array};
use fluxmem_graph::{sha256_hex, Graph, Node, NodeBody};
use fluxmem_store::Store;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::consolidate::latest_skills;
use crate::{Error, Result};

/// The release manifest's file name, in the export directory.
pub const RELEASE_FILE: &str = "release.json";

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
            other => Err(format!("export format `{other}`: expected skill-md, jsonl or parquet")),
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
    /// Only skills with at least this many source episodes.
    pub min_support: usize,
}

/// One exported skill.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
    /// Version, from 1.
    pub version: i64,
    /// Current PEMS (the kept round's score).
    pub pems: f64,
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
    /// Files written, relative to the output directory.
    pub files: Vec<String>,
    /// The release manifest.
    pub release: PathBuf,
}

fn text(node: &Node, key: &str) -> String {
    node.metadata.get(key).and_then(Value::as_str).unwrap_or_default().to_string()
}

/// The latest version of every skill in `graph`, as export records, ordered by (tenant, slug, id).
pub fn skill_records(graph: &Graph) -> Vec<SkillRecord> {
    let mut records: Vec<SkillRecord> = latest_skills(graph)
        .into_iter()
        .filter_map(|node| {
            let NodeBody::Procedural(skill) = &node.body else { return None };
            let best = node.metadata.get("best_round").and_then(Value::as_u64).unwrap_or(0) as usize;
            let rounds = node.metadata.get("rounds").and_then(Value::as_array).map_or(0, Vec::len);
            // The kept round is `best` of this version's rounds, which end the history.
            let pems = match (rounds, best) {
                (r, b) if r > 0 && b > 0 && b <= r && skill.pems_history.len() >= r => skill.pems_history[skill.pems_history.len() - r + b - 1],
                _ => skill.pems_history.last().copied().unwrap_or(0.0),
            };
            let name = Some(text(node, "name")).filter(|n| !n.is_empty()).unwrap_or_else(|| node.id.to_string());
            let steps = node.metadata.get("steps").and_then(Value::as_array).map_or_else(Vec::new, |s| {
                s.iter().filter_map(Value::as_str).map(str::to_string).collect()
            });
            Some(SkillRecord {
                id: node.id.to_string(),
                lineage: Some(text(node, "lineage")).filter(|l| !l.is_empty()).unwrap_or_else(|| node.id.to_string()),
                tenant: node.tenant.clone(),
                slug: slugify(&name),
                description: text(node, "description"),
                name,
                body: node.text.clone(),
                steps,
                version: skill.version,
                pems,
                pems_history: skill.pems_history.clone(),
                support: skill.source_episodes.len(),
                source_episodes: skill.source_episodes.iter().map(|id| id.to_string()).collect(),
                previous_versions: skill.previous_versions.iter().map(|id| id.to_string()).collect(),
                eta_source: text(node, "eta_source"),
                generator: text(node, "generator"),
                judge: node.metadata.get("judge").and_then(Value::as_str).map(str::to_string),
                content_sha256: String::new(),
            })
        })
        .collect();
    records.sort_by(|a, b| (&a.tenant, &a.slug, &a.id).cmp(&(&b.tenant, &b.slug, &b.id)));
    // Unique slugs inside the release: the second `foo` becomes `foo-2`.
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for record in &mut records {
        let count = seen.entry(record.slug.clone()).or_insert(0);
        *count += 1;
        if *count > 1 {
            record.slug = format!("{}-{}", record.slug, count);
        }
        record.content_sha256 = sha256_hex(serde_json::to_string(&*record).expect("records serialise").as_bytes());
    }
    records
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
    let mut slug: String = slug.trim_end_matches('-').chars().take(64).collect();
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
            c if (c as u32) < 0x20 || c == '\u{7f}' => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Exports the latest skills of the store to `out`. An existing earlier export there (a
/// directory with a [`RELEASE_FILE`]) is replaced; any other non-empty directory is refused.
pub fn export_skills(store: &Store, out: &Path, options: &ExportOptions) -> Result<ExportReport> {
    let manifest = store.manifest()?;
    let graph = store.load_at(&manifest)?;
    let all = skill_records(&graph);
    let total = all.len();
    let records: Vec<SkillRecord> = all
        .into_iter()
        .filter(|r| options.tenant.as_ref().is_none_or(|t| t == &r.tenant))
        .filter(|r| options.min_pems.is_none_or(|min| r.pems >= min))
        .filter(|r| r.support >= options.min_support)
        .collect();
    prepare(out)?;
    let mut files = Vec::new();
    match options.format {
        ExportFormat::SkillMd => {
            for record in &records {
                let dir = out.join(&record.slug);
                std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
                write(&dir.join("SKILL.md"), skill_md(record).as_bytes())?;
                files.push(format!("{}/SKILL.md", record.slug));
            }
        }
        ExportFormat::Jsonl => {
            let mut body = String::new();
            for record in &records {
                body.push_str(&serde_json::to_string(record).expect("records serialise"));
                body.push('\n');
            }
            write(&out.join("skills.jsonl"), body.as_bytes())?;
            files.push("skills.jsonl".into());
        }
        ExportFormat::Parquet => {
            let path = out.join("skills.parquet");
            write(&path, &parquet_bytes(&records, &path)?)?;
            files.push("skills.parquet".into());
        }
    }
    let release = release_manifest(&manifest, &graph, &records, options, &files);
    let release_path = out.join(RELEASE_FILE);
    let mut bytes = serde_json::to_vec_pretty(&release).expect("JSON values serialise");
    bytes.push(b'\n');
    write(&release_path, &bytes)?;
    Ok(ExportReport { skills: records.len(), filtered_out: total - records.len(), files, release: release_path })
}

fn io(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.to_path_buf(), source }
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| io(path, e))
}

/// Creates `out`, or clears the files an earlier export listed in its release manifest.
fn prepare(out: &Path) -> Result<()> {
    if !out.exists() {
        return std::fs::create_dir_all(out).map_err(|e| io(out, e));
    }
    let entries: Vec<_> = std::fs::read_dir(out).map_err(|e| io(out, e))?.flatten().collect();
    if entries.is_empty() {
        return Ok(());
    }
    let release = out.join(RELEASE_FILE);
    let listed = std::fs::read(&release).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    let Some(listed) = listed else { return Err(Error::OutputNotEmpty { path: out.to_path_buf() }) };
    let files: BTreeSet<&str> = listed["files"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    for file in files {
        // Only plain relative paths an export writes (`slug/SKILL.md`, `skills.jsonl`).
        if file.split('/').any(|part| part.is_empty() || part == "." || part == "..") {
            continue;
        }
        let path = out.join(file);
        if path.is_file() {
            std::fs::remove_file(&path).map_err(|e| io(&path, e))?;
        }
        if let Some(parent) = path.parent().filter(|p| *p != out) {
            let _ = std::fs::remove_dir(parent); // only if now empty
        }
    }
    std::fs::remove_file(&release).map_err(|e| io(&release, e))
}

fn skill_md(record: &SkillRecord) -> String {
    let mut text = String::from("---\n");
    text.push_str(&format!("name: {}\n", yaml_string(&record.slug)));
    text.push_str(&format!("description: {}\n", yaml_string(&record.description)));
    text.push_str(&format!("title: {}\n", yaml_string(&record.name)));
    text.push_str(&format!("version: {}\n", record.version));
    text.push_str(&format!("pems: {}\n", yaml_number(record.pems)));
    text.push_str(&format!("support: {}\n", record.support));
    text.push_str("source_episodes:\n");
    for id in &record.source_episodes {
        text.push_str(&format!("  - {}\n", yaml_string(id)));
    }
    text.push_str(&format!("id: {}\n", yaml_string(&record.id)));
    text.push_str(&format!("lineage: {}\n", yaml_string(&record.lineage)));
    text.push_str(&format!("tenant: {}\n", yaml_string(&record.tenant)));
    text.push_str(&format!("content_sha256: {}\n", yaml_string(&record.content_sha256)));
    text.push_str("---\n\n");
    text.push_str(&format!("# {}\n\n{}\n\n## Steps\n\n", record.name, record.description));
    for (i, step) in record.steps.iter().enumerate() {
        text.push_str(&format!("{}. {}\n", i + 1, step));
    }
    text
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
        "created_at": manifest.commits.last().map(|c| c.at.clone()),
        "store": { "manifest_version": manifest.version, "schema_version": manifest.schema_version },
        "models": {
            "embedding": manifest.embedding_model.as_ref().map(|m| m.id.clone()),
            "generators": generators,
            "judges": judges,
        },
        "filters": { "tenant": options.tenant, "min_pems": options.min_pems, "min_support": options.min_support },
        "release_sha256": sha256_hex(hashes.join("\n").as_bytes()),
        "skills": records.iter().map(|r| json!({
            "id": r.id, "lineage": r.lineage, "slug": r.slug, "name": r.name, "tenant": r.tenant,
            "version": r.version, "pems": r.pems, "support": r.support, "content_sha256": r.content_sha256,
        })).collect::<Vec<_>>(),
        "files": files,
    })
}

fn parquet_bytes(records: &[SkillRecord], path: &Path) -> Result<Vec<u8>> {
    use arrow_schema::{DataType, Field, Schema};
    let strings = |f: fn(&SkillRecord) -> &str| -> ArrayRef { Arc::new(StringArray::from_iter_values(records.iter().map(f))) };
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
        Field::new("pems_history", DataType::List(Arc::new(Field::new("item", DataType::Float64, true))), true),
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
        Arc::new(Int64Array::from_iter_values(records.iter().map(|r| r.version))),
        Arc::new(Float64Array::from_iter_values(records.iter().map(|r| r.pems))),
        Arc::new(history.finish()),
        Arc::new(UInt64Array::from_iter_values(records.iter().map(|r| r.support as u64))),
        lists(|r| &r.source_episodes),
        lists(|r| &r.previous_versions),
        strings(|r| &r.eta_source),
        strings(|r| &r.generator),
        Arc::new(StringArray::from(records.iter().map(|r| r.judge.clone()).collect::<Vec<_>>())),
        strings(|r| &r.content_sha256),
    ];
    let encode = |reason: String| Error::Encode { path: path.to_path_buf(), reason };
    let batch = RecordBatch::try_new(Arc::new(schema), columns).map_err(|e| encode(e.to_string()))?;
    let properties = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .build();
    let mut buffer = Vec::new();
    let mut writer = parquet::arrow::ArrowWriter::try_new(&mut buffer, batch.schema(), Some(properties)).map_err(|e| encode(e.to_string()))?;
    writer.write(&batch).map_err(|e| encode(e.to_string()))?;
    writer.close().map_err(|e| encode(e.to_string()))?;
    Ok(buffer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_and_yaml_quoting() {
        assert_eq!(slugify("Put a *clean* Object in/on a Receptacle!"), "put-a-clean-object-in-on-a-receptacle");
        assert_eq!(slugify("???"), "skill");
        assert_eq!(slugify(&"a".repeat(100)).len(), 64);
        assert_eq!(yaml_string("say \"hi\"\n\\ \u{1}"), "\"say \\\"hi\\\"\\n\\\\ \\x01\"");
        assert_eq!(yaml_number(0.25), "0.25");
        assert_eq!(yaml_number(f64::NAN), ".nan");
        assert_eq!("jsonl".parse::<ExportFormat>().unwrap(), ExportFormat::Jsonl);
        assert!("yaml".parse::<ExportFormat>().is_err());
    }
}
