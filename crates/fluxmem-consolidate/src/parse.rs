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
    /// Preconditions and pitfalls, from the logs (empty for a generator's own skill).
    #[serde(default)]
    pub pitfalls: Vec<String>,
    /// Where the successful runs part ways, from the logs ([`crate::decide`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<String>,
}

/// Characters kept of a name.
const MAX_NAME_CHARS: usize = 80;

impl SkillText {
    /// The skill as stored in the node's text and exported as the body:
    /// `Name: ...`, `Description: ...`, `Steps:` and numbered lines.
    pub fn render(&self) -> String {
        let mut text = format!(
            "Name: {}\nDescription: {}\nSteps:\n",
            self.name, self.description
        );
        for (i, step) in self.steps.iter().enumerate() {
            text.push_str(&format!("{}. {}\n", i + 1, step));
        }
        if !self.decisions.is_empty() {
            text.push_str("Decision points:\n");
            for decision in &self.decisions {
                text.push_str(&format!("- {decision}\n"));
            }
        }
        if !self.pitfalls.is_empty() {
            text.push_str("Pitfalls:\n");
            for pitfall in &self.pitfalls {
                text.push_str(&format!("- {pitfall}\n"));
            }
        }
        text
    }
}

/// Steps kept at most (small models loop; the rest is noise).
const MAX_STEPS: usize = 10;

/// The skill in a generator's output, or why there is none. Besides the format checks, a
/// skill needs a name and at least 2 distinct steps that are not template placeholders
/// (`[1]`, `<first step>`, `1. 2. 3.`), and must not be a copy of the prompt's one-shot
/// example ([`crate::prompt::EXAMPLE_NAME`]).
pub fn parse_skill(output: &str) -> Result<SkillText, String> {
    let mut skill = parse_skill_text(output)?;
    if copies_example(&skill) {
        return Err("copied the prompt's example skill".into());
    }
    // A single step lifted from the example is dropped; what is left must still be a skill.
    let example = example_steps();
    skill
        .steps
        .retain(|step| !example.contains(&normalized(step)));
    if skill.steps.len() < 2 {
        return Err("fewer than 2 steps besides the one copied from the prompt's example".into());
    }
    Ok(skill)
}

fn normalized(text: &str) -> String {
    text.chars()
        .filter(|c| c.is_alphanumeric())
        .collect::<String>()
        .to_lowercase()
}

fn example_steps() -> Vec<String> {
    parse_skill_text(crate::prompt::EXAMPLE_SKILL)
        .map(|e| e.steps.iter().map(|s| normalized(s)).collect())
        .unwrap_or_default()
}

/// [`parse_skill`] without the example-copy check.
pub(crate) fn parse_skill_text(output: &str) -> Result<SkillText, String> {
    let text = strip_fences(output);
    if let Some(skill) = parse_json(&text) {
        return validate(skill);
    }
    validate(parse_keyed(&text)?)
}

/// The name of the example, or at least two of its steps, reproduced.
fn copies_example(skill: &SkillText) -> bool {
    let example = example_steps();
    let copied_steps = skill
        .steps
        .iter()
        .filter(|s| example.contains(&normalized(s)))
        .count();
    normalized(&skill.name) == normalized(crate::prompt::EXAMPLE_NAME) || copied_steps >= 2
}

/// The outcome labels of the prompt's episodes, which small models copy into names.
const OUTCOME_LABELS: [&str; 3] = ["(success)", "(failure)", "(outcome unknown)"];

fn without_labels(text: &str) -> String {
    OUTCOME_LABELS
        .iter()
        .fold(text.to_string(), |text, label| text.replace(label, ""))
        .trim()
        .to_string()
}

fn validate(mut skill: SkillText) -> Result<SkillText, String> {
    skill.name = without_labels(&skill.name);
    skill.description = without_labels(&skill.description);
    skill.name = clean(&skill.name)
        .chars()
        .take(MAX_NAME_CHARS)
        .collect::<String>()
        .trim()
        .to_string();
    skill.description = clean(&skill.description);
    if skill.name.is_empty() {
        return Err("no `Name:` line".into());
    }
    if is_placeholder(&skill.name) {
        return Err(format!(
            "the name `{}` is a template placeholder",
            skill.name
        ));
    }
    if skill.steps.is_empty() {
        return Err("no steps".into());
    }
    let mut steps: Vec<String> = Vec::new();
    for step in skill.steps.iter().map(|s| clip_step(&clean(s))) {
        if step.is_empty() || is_placeholder(&step) {
            continue;
        }
        // A step seen before: the model is looping; what follows is not the skill.
        if steps.iter().any(|s| s.eq_ignore_ascii_case(&step)) {
            break;
        }
        steps.push(step);
        if steps.len() == MAX_STEPS {
            break;
        }
    }
    if steps.len() < 2 {
        return Err(format!(
            "{} real step(s) (at least 2 distinct steps that are not placeholders needed)",
            steps.len()
        ));
    }
    skill.steps = steps;
    if skill.description.is_empty() || is_placeholder(&skill.description) {
        skill.description = skill.name.clone();
    }
    Ok(skill)
}

/// Words too common to show that a skill is about its episodes.
const STOPWORDS: [&str; 44] = [
    "about", "after", "again", "also", "before", "each", "every", "from", "have", "into", "just",
    "make", "more", "most", "need", "only", "other", "over", "same", "some", "step", "steps",
    "skill", "sure", "task", "tasks", "than", "that", "their", "them", "then", "there", "they",
    "this", "under", "until", "used", "user", "using", "very", "want", "what", "when", "with",
];

/// The content words of `text`: lowercase alphabetic runs of at least 4 letters, no stopwords.
pub(crate) fn content_words(text: &str) -> std::collections::BTreeSet<String> {
    text.split(|c: char| !c.is_alphabetic())
        .filter(|w| w.chars().count() >= 4)
        .map(str::to_lowercase)
        .filter(|w| !STOPWORDS.contains(&w.as_str()))
        .collect()
}

/// The distinct content words of the skill's name, description and steps that occur in
/// `source` (the words of its episodes) and not in the prompt's example. A skill about its
/// episodes shares some of their vocabulary; one that does not is the example's domain or
/// invented (small models write "Use a phone to make a phone call" for kitchen tasks).
pub(crate) fn grounded_words(
    skill: &SkillText,
    source: &std::collections::BTreeSet<String>,
) -> Vec<String> {
    let example = content_words(&format!(
        "{}\n{}",
        crate::prompt::EXAMPLE_SKILL,
        crate::prompt::EXAMPLE_LOGS
    ));
    let text = format!(
        "{}\n{}\n{}",
        skill.name,
        skill.description,
        skill.steps.join("\n")
    );
    content_words(&text)
        .into_iter()
        .filter(|w| source.contains(w) && !example.contains(w))
        .collect()
}

/// Characters of a step; longer ones are where a small model looped inside a line.
const MAX_STEP_CHARS: usize = 200;

/// A step over [`MAX_STEP_CHARS`] cut to its first clause (`;`), or at a word boundary.
fn clip_step(step: &str) -> String {
    if step.chars().count() <= MAX_STEP_CHARS {
        return step.to_string();
    }
    if let Some((first, _)) = step.split_once(';') {
        if first.chars().count() <= MAX_STEP_CHARS {
            return first.trim().to_string();
        }
    }
    let cut: String = step.chars().take(MAX_STEP_CHARS).collect();
    match cut.rfind(' ') {
        Some(at) => cut[..at].to_string(),
        None => cut,
    }
}

/// Template debris rather than content: fewer than 3 letters (`[1]`, `1. 2. 3.`, `...`), a
/// bracketed placeholder (`<first step>`, `[step]`), or a bare template word.
fn is_placeholder(text: &str) -> bool {
    let text = text.trim();
    if text.chars().filter(|c| c.is_alphabetic()).count() < 3 {
        return true;
    }
    let bracketed = |open: char, close: char| {
        text.contains(open) && text.contains(close) && text.find(open) < text.rfind(close)
    };
    if bracketed('<', '>')
        || (text.starts_with('[') && text.ends_with(']'))
        || (text.starts_with('{') && text.ends_with('}'))
    {
        return true;
    }
    let lower = text.trim_end_matches('.').to_lowercase();
    [
        "name",
        "skill name",
        "description",
        "step",
        "steps",
        "first step",
        "next step",
        "a short name for the skill",
    ]
    .contains(&lower.as_str())
}

/// Removes Markdown decoration and surrounding quotes, collapses whitespace.
fn clean(text: &str) -> String {
    let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    collapsed
        .trim_matches(|c: char| {
            c == '*' || c == '_' || c == '`' || c == '"' || c == '#' || c.is_whitespace()
        })
        .to_string()
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
    let field = |names: &[&str]| {
        names.iter().find_map(|n| {
            value
                .get(*n)
                .or_else(|| value.get(n.to_uppercase()))
                .cloned()
        })
    };
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
    Some(SkillText {
        name: as_text(field(&["name", "Name", "title"])),
        description: as_text(field(&["description", "Description"])),
        steps,
        pitfalls: Vec::new(),
        decisions: Vec::new(),
    })
}

#[derive(PartialEq)]
enum Section {
    None,
    Description,
    Steps,
}

/// The first skill block of the text. Lenient about what small models write: keys in any case
/// with Markdown decoration; an empty `Name:` followed by the name on the next line; no
/// `Name:` key at all when the first line is a short plain line followed by a list (the answer
/// to a prompt ending in `Name:`); unnumbered lines under `Steps:`. The block ends at a second
/// `Name:`, or at a plain paragraph after a blank line once steps have started (trailing
/// chatter); looping steps are cut in validation.
fn parse_keyed(text: &str) -> Result<SkillText, String> {
    let mut skill = SkillText {
        name: String::new(),
        description: String::new(),
        steps: Vec::new(),
        pitfalls: Vec::new(),
        decisions: Vec::new(),
    };
    let mut section = Section::None;
    let mut first_plain: Option<String> = None;
    let mut expect_name = false;
    let mut after_blank = false;
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() {
            after_blank = true;
            continue;
        }
        let blank_before = std::mem::take(&mut after_blank);
        if let Some((key, value)) = key_value(line) {
            match key.as_str() {
                "name" | "skill" | "skill name" | "title" => {
                    if !skill.name.is_empty() || !skill.steps.is_empty() {
                        break;
                    }
                    skill.name = value.to_string();
                    expect_name = value.is_empty();
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
        if expect_name && !is_item {
            skill.name = line.to_string();
            expect_name = false;
            continue;
        }
        if blank_before && !is_item && !skill.steps.is_empty() {
            break;
        }
        match section {
            Section::Steps => skill.steps.push(marker.to_string()),
            _ if is_item && (!skill.name.is_empty() || first_plain.is_some()) => {
                section = Section::Steps;
                skill.steps.push(marker.to_string());
            }
            Section::Description => {
                skill.description.push(' ');
                skill.description.push_str(line);
            }
            Section::None => {
                if skill.name.is_empty() && first_plain.is_none() && !is_item {
                    first_plain = Some(line.to_string());
                }
            }
        }
    }
    if skill.name.is_empty() {
        // Not a lead-in such as `Here is the skill:`.
        if let Some(line) =
            first_plain.filter(|l| l.chars().count() <= MAX_NAME_CHARS && !l.ends_with(':'))
        {
            skill.name = line;
        }
    }
    Ok(skill)
}

/// `Key: value` with Markdown decoration around the key (`**Name:**`, `## Steps`, `- Name:`).
fn key_value(line: &str) -> Option<(String, &str)> {
    let bare =
        line.trim_start_matches(|c: char| c == '#' || c == '-' || c == '*' || c.is_whitespace());
    let (key, value) = match bare.split_once(':') {
        Some((key, value)) => (key, value),
        // A heading without a colon: `## Steps`.
        None if line.starts_with('#') => (bare, ""),
        None => return None,
    };
    let key = key
        .trim_matches(|c: char| c == '*' || c == '_' || c.is_whitespace())
        .to_lowercase();
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
        assert_eq!(
            skill.steps,
            vec!["Find it.", "Take it.", "Clean it at the sink."]
        );
        assert_eq!(
            parse_skill(&skill.render()).unwrap(),
            skill,
            "render is parseable"
        );
    }

    #[test]
    fn markdown_fences_and_bold_keys() {
        let output = "Sure! Here is the skill:\n```markdown\n**Name:** Book a flight\n**Description:** For booking.\n## Steps\n- Get the user id\n- Search flights\n- Search flights\n```\nHope it helps";
        let skill = parse_skill(output).unwrap();
        assert_eq!(skill.name, "Book a flight");
        assert_eq!(
            skill.steps,
            vec!["Get the user id", "Search flights"],
            "looped step kept once"
        );
    }

    #[test]
    fn json_format() {
        let skill = parse_skill("```json\n{\"name\": \"Refund\", \"description\": \"d\", \"steps\": [\"1. check\", \"pay\"]}\n```").unwrap();
        assert_eq!(skill.steps, vec!["check", "pay"]);
        let skill =
            parse_skill("{\"name\": \"Refund\", \"steps\": \"1. check\\n2. pay\"}").unwrap();
        assert_eq!(
            skill.description, "Refund",
            "a missing description falls back to the name"
        );
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

    /// What SmolLM2-135M answered to the old placeholder-template prompt (kept in the failed
    /// clusters of the first ALFWorld run).
    #[test]
    fn recorded_small_model_junk_is_rejected() {
        let copied = "1. [1]\n2. [2]\n3. [3]\n4. [4]\n5. [5]\n6. [6]\n7. [7]\n8. [8]\n\nThis skill is a general skill that can be applied to any task, and it is a step-by-step process that can be applied to any task.";
        assert!(parse_skill(copied).is_err());
        let counted = "1. 1. 2. 3. 4. 5. 6. 7. 8.\n\nEpisode 1:\n1. 1. 2. 3. 4. 5. 6. 7. 8.\n\nEpisode 2:\n1. 1. 2. 3. 4.";
        assert!(parse_skill(counted).is_err());
        let template = "Name: <a short name for the skill>\nDescription: <one sentence: when to use this skill>\nSteps:\n1. <first step>\n2. <next step>";
        assert!(parse_skill(template).unwrap_err().contains("placeholder"));
        let bracket_steps = "Name: Put things away\nSteps:\n1. [1]\n2. [2]\n3. Go to the shelf.";
        assert!(
            parse_skill(bracket_steps)
                .unwrap_err()
                .contains("1 real step"),
            "one real step is not a skill"
        );
        let one_step =
            "Name: Heat it\nSteps:\n1. Heat it in the microwave.\n2. Heat it in the microwave.";
        assert!(parse_skill(one_step).is_err(), "a looped step is one step");
    }

    #[test]
    fn a_copy_of_the_prompt_example_is_rejected() {
        let example = crate::prompt::EXAMPLE_SKILL;
        assert_eq!(
            parse_skill(example).unwrap_err(),
            "copied the prompt's example skill"
        );
        // Renamed, but the example's steps.
        let renamed = example.replace(
            crate::prompt::EXAMPLE_NAME,
            "Put a clean lettuce on the table",
        );
        assert!(parse_skill(&renamed).is_err());
        // Same name, other steps.
        let same_name = format!(
            "Name: {}\nSteps:\n1. Go to the sink.\n2. Wash the lettuce.",
            crate::prompt::EXAMPLE_NAME.to_lowercase()
        );
        assert!(parse_skill(&same_name).is_err());
        // One step lifted from the example is dropped, the rest kept.
        let one_shared = "Name: Clean the lettuce\nSteps:\n1. Open the mail app and start a new message.\n2. Take the lettuce.\n3. Rinse it in the sink.";
        assert_eq!(
            parse_skill(one_shared).unwrap().steps,
            vec!["Take the lettuce.", "Rinse it in the sink."]
        );
        let one_left =
            "Name: Clean the lettuce\nSteps:\n1. Attach the file.\n2. Rinse it in the sink.";
        assert!(parse_skill(one_left).is_err(), "one real step left");
    }

    #[test]
    fn lenient_about_what_small_models_write() {
        // The answer to a prompt ending in `Name:`: the name comes without its key.
        let skill = parse_skill(" Heat and place an object\nDescription: Use to heat food.\nSteps:\n1. Find the object.\n2. Heat it with the microwave.\n3. Put it in place.").unwrap();
        assert_eq!(skill.name, "Heat and place an object");
        assert_eq!(skill.steps.len(), 3);
        // An empty `Name:` with the name on the next line; steps without numbers.
        let skill =
            parse_skill("Name:\nCool a drink\nSteps:\nOpen the fridge.\nPut the drink inside.")
                .unwrap();
        assert_eq!(
            (skill.name.as_str(), skill.steps.len()),
            ("Cool a drink", 2)
        );
        // A bare name line followed by a list, then chatter after a blank line.
        let skill = parse_skill("Find and examine an object\n1. Go to the desk.\n2. Take the book.\n3. Turn on the lamp.\n\nThis skill helps the agent in many situations.\nIt is very useful.").unwrap();
        assert_eq!(skill.name, "Find and examine an object");
        assert_eq!(
            skill.steps,
            vec!["Go to the desk.", "Take the book.", "Turn on the lamp."]
        );
        assert_eq!(skill.description, skill.name);
        // A loop: the block ends at the second `Name:` and at the first repeated step.
        let skill = parse_skill("Name: Clean a thing\nSteps:\n1. Take it.\n2. Rinse it in the sink.\n3. Take it.\n4. Rinse it in the sink.\nName: Clean a thing\nSteps:\n1. Take it.").unwrap();
        assert_eq!(skill.steps, vec!["Take it.", "Rinse it in the sink."]);
        // Outcome labels copied from the prompt are dropped.
        let skill = parse_skill("Name: Clean the kitchen (success)\nDescription: Clean it (success)\nSteps:\n1. Go to the sink.\n2. Rinse it.").unwrap();
        assert_eq!(
            (skill.name.as_str(), skill.description.as_str()),
            ("Clean the kitchen", "Clean it")
        );
        // A lead-in line is not a name.
        assert!(parse_skill("Here is the skill:\n1. Go to the desk.\n2. Take the book.").is_err());
        // At most ten steps.
        let long: String = (1..=30)
            .map(|i| format!("{i}. Do thing number {i}.\n"))
            .collect();
        assert_eq!(
            parse_skill(&format!("Name: Long one\nSteps:\n{long}"))
                .unwrap()
                .steps
                .len(),
            MAX_STEPS
        );
        // A step looping inside its line is cut to its first clause.
        let looping: Vec<String> = (1..40).map(|i| format!("open the sinkbasin {i}")).collect();
        let skill = parse_skill(&format!(
            "Name: Wash\nSteps:\n1. Go to the sink.\n2. {}",
            looping.join("; ")
        ))
        .unwrap();
        assert_eq!(skill.steps[1], "open the sinkbasin 1");
    }

    #[test]
    fn grounding_counts_episode_words_outside_the_example() {
        let source = content_words("Task: put a clean lettuce in diningtable (success)\nActions: go to fridge; take lettuce from fridge; clean lettuce with sinkbasin; open drawer");
        let grounded = parse_skill("Name: Clean lettuce\nSteps:\n1. Take the lettuce from the fridge.\n2. Rinse it in the sinkbasin.").unwrap();
        assert_eq!(
            grounded_words(&grounded, &source),
            vec!["clean", "fridge", "lettuce", "sinkbasin", "take"]
        );
        // The example's domain: "open" and "message" are the example's words, "phone" is nobody's.
        let invented = parse_skill("Name: Use a phone to make a phone call\nSteps:\n1. Open the phone app and start a new message.\n2. Use the phone to make a call.").unwrap();
        assert!(grounded_words(&invented, &source).is_empty());
    }
}
