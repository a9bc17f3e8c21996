//! The module layering of the crate docs, checked: each module's code (its tests aside) names
//! only modules listed before it in [`ORDER`], so no two modules import each other, directly
//! or in a loop, and each file reads with only what is below it.

use std::collections::BTreeMap;

/// The modules, lowest first, grouped by layer as in the crate docs.
const ORDER: &[&str] = &[
    // format
    "error", "manifest", "lock", "layout", //
    // rows
    "keys", "shard", //
    // commit
    "store", "recover", //
    // read
    "scan", "merge", "live", //
    // rewrite
    "compact", "staging", "index",
];

/// Items re-exported by `lib.rs`, by the module that defines them.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut owner = BTreeMap::new();
    let flat = lib.replace('\n', " ");
    for statement in flat.split(';') {
        let Some(rest) = statement.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, items)) = rest.split_once("::") else {
            continue;
        };
        let items = items.trim().trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            owner.insert(item.to_string(), module.trim().to_string());
        }
    }
    owner
}

/// The modules `code` names through `crate::` paths (a re-exported item counts as its module).
fn named(code: &str, owner: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    let mut add = |name: &str| {
        let name = name.trim().split("::").next().unwrap_or("").trim();
        if ORDER.contains(&name) {
            found.push(name.to_string());
        } else if let Some(module) = owner.get(name) {
            found.push(module.clone());
        }
    };
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            group.split(',').for_each(&mut add);
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            add(&rest[..end]);
        }
    }
    found
}

/// A file's code without its comments and its unit tests.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn modules_import_only_the_layers_below_them() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let owner = reexports(&lib);
    assert_eq!(owner.get("Writer").map(String::as_str), Some("store"));
    let mut files: Vec<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|name| name.strip_suffix(".rs").map(str::to_string))
        .filter(|name| !matches!(name.as_str(), "lib" | "layers" | "testing"))
        .collect();
    files.sort();
    let mut listed: Vec<&str> = ORDER.to_vec();
    listed.sort();
    assert_eq!(files, listed, "every module of src/ has its place in ORDER");
    let mut upward = Vec::new();
    for (rank, module) in ORDER.iter().enumerate() {
        let text = std::fs::read_to_string(src.join(format!("{module}.rs"))).unwrap();
        for used in named(&code_of(&text), &owner) {
            let used_rank = ORDER.iter().position(|m| *m == used).unwrap();
            if used_rank >= rank && used != *module {
                upward.push(format!("{module} -> {used}"));
            }
        }
    }
    upward.sort();
    upward.dedup();
    assert!(
        upward.is_empty(),
        "imports that look up or sideways: {upward:?}"
    );
}

#[test]
fn the_check_sees_grouped_and_reexported_imports() {
    let owner = reexports("pub use store::{\n    CommitInfo, Store,\n};\npub use scan::Scan;");
    let code = code_of(
        "use crate::{keys, Store};\n// crate::compact in a comment\nfn f() { crate::scan::x(); }",
    );
    assert_eq!(named(&code, &owner), ["keys", "store", "scan"]);
}
