//! Robust parsing of a generator's skill: small models wrap it in code fences, bold the keys,
//! mix formats or emit JSON. Accepted: a `Name:` / `Description:` / `Steps:` block (keys in any
//! case, with Markdown decoration), or a JSON object with `name`, `description` and `steps`
//! (a list of strings or one string).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A parsed skill.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkillText {
    /// Short name.
    pub name: String,
    /// One or two sentences on when to use it.
    pub description: String,
    /// The steps, in order.
    pub steps: Vec<String>,
}

/// Characters kept of a name.
const MAX_NAME_CHARS: usize = 80;

impl SkillText {
    /// The skill as stored in the node's text and exported as the body:
    /// `Name: ...`, `Description: ...`, `Steps:` and numbered lines.
    pub fn render(&self) -> String {
        let mut text = format!("Name: {}\nDescription: {}\nSteps:\n", self.name, self.description);
        for (i, step) in self.steps.iter().enumerate() {
            text.push_str(&format!("{}. {}\n", i + 1, step));
        }
        text
    }
}

/// Why an output is not a skill.
pub fn parse_skill(output: &str) -> Result<SkillText, String> {
    let text = strip_fences(output);
    if let Some(skill) = parse_json(&text) {
        return validate(skill);
    }
    validate(parse_keyed(&text)?)
}

fn validate(mut skill: SkillText) -> Result<SkillText, String> {
    skill.name = clean(&skill.name).chars().take(MAX_NAME_CHARS).collect::<String>().trim().to_string();
    skill.description = clean(&skill.description);
    skill.steps = skill.steps.iter().map(|s| clean(s)).filter(|s| !s.is_empty()).collect();
    dedup_consecutive(&mut skill.steps);
    if skill.name.is_empty() {
        return Err("no `Name:` line".into());
    }
    if skill.steps.is_empty() {
        return Err("no steps".into());
    }
    if skill.description.is_empty() {
        skill.description = skill.name.clone();
    }
    Ok(skill)
}

/// Small models loop: a step repeated back to back is kept once.
fn dedup_consecutive(steps: &mut Vec<String>) {
    steps.dedup_by(|a, b| a.eq_ignore_ascii_case(b));
}

/// Removes Markdown decoration and surrounding quotes, collapses whitespace.
fn clean(text: &str) -> String {
    let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    collapsed.trim_matches(|c: char| c == '*' || c == '_' || c == '`' || c == '"' || c == '#' || c.is_whitespace()).to_string()
}

/// The content of the first fenced block if there is one, else the text.
fn strip_fences(output: &str) -> String {
    let trimmed = output.trim();
    if let Some(start) = trimmed.find("```") {
        let after = &trimmed[start + 3..];
        let body_start = after.find('\n').map_or(after.len(), |i| i + 1);
        let body = &after[body_start..];
        let end = body.find("```").unwrap_or(body.len());
        let inner = body[..end].trim();
        if !inner.is_empty() {
            return inner.to_string();
        }
    }
    trimmed.to_string()
}

fn parse_json(text: &str) -> Option<SkillText> {
    let start = text.find('{')?;
    let end = text.rfind('}')?;
    let value: Value = serde_json::from_str(text.get(start..=end)?).ok()?;
    let field = |names: &[&str]| names.iter().find_map(|n| value.get(*n).or_else(|| value.get(n.to_uppercase())).cloned());
    let as_text = |v: Option<Value>| match v {
        Some(Value::String(s)) => s,
        Some(other @ (Value::Number(_) | Value::Bool(_))) => other.to_string(),
        _ => String::new(),
    };
    let steps = match field(&["steps", "Steps", "procedure"]) {
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|item| match item {
                Value::String(s) => strip_marker(&s).to_string(),
                other => other.to_string(),
            })
            .collect(),
        Some(Value::String(s)) => s.lines().map(|l| strip_marker(l).to_string()).collect(),
        _ => Vec::new(),
    };
    Some(SkillText { name: as_text(field(&["name", "Name", "title"])), description: as_text(field(&["description", "Description"])), steps })
}

#[derive(PartialEq)]
enum Section {
    None,
    Description,
    Steps,
}

fn parse_keyed(text: &str) -> Result<SkillText, String> {
    let mut skill = SkillText { name: String::new(), description: String::new(), steps: Vec::new() };
    let mut section = Section::None;
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if let Some((key, value)) = key_value(line) {
            match key.as_str() {
                "name" | "skill" | "skill name" | "title" if skill.name.is_empty() => {
                    skill.name = value.to_string();
                    section = Section::None;
                    continue;
                }
                "description" | "when to use" | "summary" => {
                    skill.description = value.to_string();
                    section = Section::Description;
                    continue;
                }
                "steps" | "procedure" | "instructions" => {
                    section = Section::Steps;
                    if !value.is_empty() {
                        skill.steps.push(strip_marker(value).to_string());
                    }
                    continue;
                }
                _ => {}
            }
        }
        let marker = strip_marker(line);
        let is_item = marker.len() < line.len();
        match section {
            Section::Steps => skill.steps.push(marker.to_string()),
            _ if is_item && !skill.name.is_empty() => {
                section = Section::Steps;
                skill.steps.push(marker.to_string());
            }
            Section::Description => {
                skill.description.push(' ');
                skill.description.push_str(line);
            }
            Section::None => {}
        }
    }
    Ok(skill)
}

/// `Key: value` with Markdown decoration around the key (`**Name:**`, `## Steps`, `- Name:`).
fn key_value(line: &str) -> Option<(String, &str)> {
    let bare = line.trim_start_matches(|c: char| c == '#' || c == '-' || c == '*' || c.is_whitespace());
    let (key, value) = match bare.split_once(':') {
        Some((key, value)) => (key, value),
        // A heading without a colon: `## Steps`.
        None if line.starts_with('#') => (bare, ""),
        None => return None,
    };
    let key = key.trim_matches(|c: char| c == '*' || c == '_' || c.is_whitespace()).to_lowercase();
    if key.is_empty() || key.len() > 20 {
        return None;
    }
    Some((key, value.trim_start_matches(['*', '_']).trim()))
}

/// A list marker removed: `1.`, `2)`, `-`, `*`, `Step 3:`.
fn strip_marker(line: &str) -> &str {
    let line = line.trim();
    let lower = line.to_lowercase();
    if lower.starts_with("step ") {
        if let Some((head, rest)) = line.split_once([':', '.', ')']) {
            if head[5..].trim().chars().all(|c| c.is_ascii_digit()) {
                return rest.trim();
            }
        }
    }
    let digits = line.chars().take_while(|c| c.is_ascii_digit()).count();
    if digits > 0 && digits < 4 {
        let rest = &line[digits..];
        if let Some(rest) = rest.strip_prefix('.').or_else(|| rest.strip_prefix(')')) {
            return rest.trim();
        }
    }
    for bullet in ["- ", "* ", "• "] {
        if let Some(rest) = line.strip_prefix(bullet) {
            return rest.trim();
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_keyed_format() {
        let skill = parse_skill("Name: Clean an object\nDescription: Wash a thing.\nSteps:\n1. Find it.\n2. Take it.\n3. Clean it at the sink.").unwrap();
        assert_eq!(skill.name, "Clean an object");
        assert_eq!(skill.description, "Wash a thing.");
        assert_eq!(skill.steps, vec!["Find it.", "Take it.", "Clean it at the sink."]);
        assert_eq!(parse_skill(&skill.render()).unwrap(), skill, "render is parseable");
    }

    #[test]
    fn markdown_fences_and_bold_keys() {
        let output = "Sure! Here is the skill:\n```markdown\n**Name:** Book a flight\n**Description:** For booking.\n## Steps\n- Get the user id\n- Search flights\n- Search flights\n```\nHope it helps";
        let skill = parse_skill(output).unwrap();
        assert_eq!(skill.name, "Book a flight");
        assert_eq!(skill.steps, vec!["Get the user id", "Search flights"], "looped step kept once");
    }

    #[test]
    fn json_format() {
        let skill = parse_skill("```json\n{\"name\": \"Refund\", \"description\": \"d\", \"steps\": [\"1. check\", \"pay\"]}\n```").unwrap();
        assert_eq!(skill.steps, vec!["check", "pay"]);
        let skill = parse_skill("{\"name\": \"Refund\", \"steps\": \"1. check\\n2. pay\"}").unwrap();
        assert_eq!(skill.description, "Refund", "a missing description falls back to the name");
        assert_eq!(skill.steps, vec!["check", "pay"]);
    }

    #[test]
    fn junk_is_an_error() {
        assert!(parse_skill("").is_err());
        assert!(parse_skill("I cannot help with that.").is_err());
        assert!(parse_skill("Name: x").is_err(), "no steps");
        assert!(parse_skill("1. a\n2. b").is_err(), "no name");
        assert!(parse_skill("{\"steps\": [\"a\"]}").is_err());
    }

    #[test]
    fn multi_line_description_and_step_prefixes() {
        let skill = parse_skill("Skill name: Heat food\nDescription: Use the microwave\nto heat.\nStep 1: open it\nStep 2: heat it").unwrap();
        assert_eq!(skill.description, "Use the microwave to heat.");
        assert_eq!(skill.steps, vec!["open it", "heat it"]);
    }
}
