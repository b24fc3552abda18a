//! Tidy: the crate dependency graph points one way (DESIGN.md §2, ARCHITECTURE.md), only
//! the server crate may know protobuf, and the README shows the Python client as it is.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

/// Each library crate and the kiln crates it may depend on.
const ALLOWED: &[(&str, &[&str])] = &[
    ("kiln-gguf", &[]),
    ("kiln-tensor", &[]),
    ("kiln-tokenizer", &["kiln-gguf"]),
    ("kiln-kv", &["kiln-tensor"]),
    ("kiln-model", &["kiln-tensor", "kiln-kv", "kiln-gguf"]),
    ("kiln-scheduler", &["kiln-kv"]),
    // Test support: only ever a dev-dependency.
    ("kiln-testkit", &["kiln-tensor"]),
    (
        "kiln-engine",
        &[
            "kiln-tensor",
            "kiln-kv",
            "kiln-model",
            "kiln-scheduler",
            "kiln-tokenizer",
        ],
    ),
    ("kiln-server", &["kiln-engine", "kiln-tokenizer"]),
];

const PROTOBUF: &[&str] = &["prost", "tonic", "protox"];

/// Package names in a manifest's `[dependencies]` table (not dev- or build-dependencies).
fn dependencies(manifest: &str) -> Vec<String> {
    let mut in_deps = false;
    let mut out = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if in_deps
            && let Some((name, _)) = line.split_once(['=', '.'])
            && !name.trim().is_empty()
            && !name.starts_with('#')
        {
            out.push(name.trim().to_owned());
        }
    }
    out
}

#[test]
fn crate_dependencies_point_one_way() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates");
    let mut checked = 0;
    for entry in std::fs::read_dir(&crates).unwrap() {
        let dir = entry.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let deps = dependencies(&manifest);
        if name != "kiln-server" {
            for p in PROTOBUF {
                assert!(
                    !deps
                        .iter()
                        .any(|d| d == p || d.starts_with(&format!("{p}-"))),
                    "{name} depends on {p}: only kiln-server knows protobuf"
                );
            }
        }
        let Some((_, allowed)) = ALLOWED.iter().find(|(c, _)| *c == name) else {
            continue; // the binary sits on top
        };
        for d in deps.iter().filter(|d| d.starts_with("kiln")) {
            assert!(
                allowed.contains(&d.as_str()),
                "{name} must not depend on {d} (allowed: {allowed:?})"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, ALLOWED.len(), "a library crate is missing");
}

#[test]
fn the_parser_reads_only_the_dependencies_table() {
    let m = "[package]\nname = \"x\"\n[dependencies]\nkiln-kv.workspace = true\nrand = \"0.9\"\n\
             [dev-dependencies]\nkiln-model.workspace = true\n";
    assert_eq!(dependencies(m), vec!["kiln-kv", "rand"]);
}

/// The bodies of the README's ```python fenced blocks.
fn python_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut body: Option<String> = None;
    for line in markdown.lines() {
        match &mut body {
            None if line.trim_end() == "```python" => body = Some(String::new()),
            None => {}
            Some(b) if line.trim_end() == "```" => {
                blocks.push(std::mem::take(b));
                body = None;
            }
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
        }
    }
    blocks
}

#[test]
fn readme_python_client_is_the_example_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let client = std::fs::read_to_string(root.join("examples/python/client.py")).unwrap();
    assert!(
        python_blocks(&readme).contains(&client),
        "README.md shows no ```python block equal to examples/python/client.py: \
         copy the file into the README"
    );
}

#[test]
fn python_blocks_are_read_whole() {
    let md = "text\n```python\nimport grpc\n\nprint(1)\n```\n```sh\nls\n```\n";
    assert_eq!(python_blocks(md), vec!["import grpc\n\nprint(1)\n"]);
}
