//! Tidy: the crate dependency graph points one way (ARCHITECTURE.md), checked on the resolved
//! graph (`cargo metadata`), transitive dependencies included: the bookkeeping crates and
//! xtask link no GPU stack (xtask no kiln crate), only the server crate (and what sits on it)
//! links protobuf, the front doors' core (kiln-api) no wire format; the README shows the Python client as it is; and `unsafe` appears only in
//! the native CPU backend's dispatch module and the GPU side's opt-in to wgpu's experimental
//! features, each block with a `// SAFETY:` line.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Each library crate and the kiln crates it may depend on directly.
const ALLOWED: &[(&str, &[&str])] = &[
    ("kiln-gguf", &[]),
    ("kiln-tensor", &[]),
    ("kiln-tokenizer", &["kiln-gguf"]),
    ("kiln-kv", &[]),
    ("kiln-attention", &["kiln-tensor", "kiln-kv"]),
    (
        "kiln-model",
        &["kiln-tensor", "kiln-kv", "kiln-attention", "kiln-gguf"],
    ),
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
    // What every front door shares; it speaks no wire format (see NO_WIRE).
    ("kiln-api", &["kiln-engine", "kiln-tokenizer"]),
    (
        "kiln-server",
        &["kiln-api", "kiln-engine", "kiln-tokenizer"],
    ),
    // The other front door: beside kiln-server, never on it (it must not link protobuf).
    ("kiln-http", &["kiln-api", "kiln-engine", "kiln-tokenizer"]),
    // Automation that must build in seconds: it runs the kiln binary for what needs kiln.
    ("xtask", &[]),
];

/// Crates that are pure CPU logic: nothing they link, however indirectly, is a GPU stack.
const NO_GPU: &[&str] = &[
    "kiln-gguf",
    "kiln-tokenizer",
    "kiln-kv",
    "kiln-scheduler",
    "xtask",
];
const GPU: &[&str] = &["wgpu", "naga"];

/// Only these (the server and what sits on top of it) may link protobuf.
const PROTOBUF_USERS: &[&str] = &["kiln-server", "kiln", "kiln-tests", "kiln-benches"];
const PROTOBUF: &[&str] = &["prost", "tonic", "protox"];

/// The front doors' shared core knows no wire format: no HTTP framework, no gRPC.
const NO_WIRE: &[&str] = &["kiln-api", "kiln-engine"];
const WIRE: &[&str] = &["axum", "tonic", "prost", "hyper"];

/// Whether `name` is the package `family` or one of its `family-*` crates.
fn in_family(name: &str, family: &[&str]) -> bool {
    family
        .iter()
        .any(|f| name == *f || name.starts_with(&format!("{f}-")))
}

/// The resolved graph for this machine's target: package name -> names of its normal
/// (not dev-, not build-) dependencies.
struct Graph {
    deps: BTreeMap<String, BTreeSet<String>>,
    workspace: BTreeSet<String>,
}

impl Graph {
    fn load() -> Self {
        let host = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
            .arg("-vV")
            .output()
            .expect("run rustc -vV");
        let host = String::from_utf8(host.stdout).unwrap();
        let host = host
            .lines()
            .find_map(|l| l.strip_prefix("host: "))
            .expect("rustc -vV names the host")
            .to_owned();
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        // Offline: the build that runs this test already fetched every host package.
        let out = Command::new(env!("CARGO"))
            .current_dir(&root)
            .args(["metadata", "--format-version", "1", "--offline"])
            .args(["--filter-platform", &host])
            .output()
            .expect("run cargo metadata");
        assert!(
            out.status.success(),
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self::parse(&serde_json::from_slice(&out.stdout).unwrap())
    }

    fn parse(meta: &Value) -> Self {
        let name_of: BTreeMap<&str, &str> = meta["packages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
            .collect();
        let workspace = meta["workspace_members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| name_of[id.as_str().unwrap()].to_owned())
            .collect();
        let mut deps = BTreeMap::new();
        for node in meta["resolve"]["nodes"].as_array().unwrap() {
            let normal: Vec<String> = node["deps"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| {
                    d["dep_kinds"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|k| k["kind"].is_null())
                })
                .map(|d| name_of[d["pkg"].as_str().unwrap()].to_owned())
                .collect();
            // Two versions of one crate share a name: their edges merge.
            deps.entry(name_of[node["id"].as_str().unwrap()].to_owned())
                .or_insert_with(BTreeSet::new)
                .extend(normal);
        }
        Self { deps, workspace }
    }

    fn direct(&self, name: &str) -> impl Iterator<Item = &String> {
        self.deps.get(name).into_iter().flatten()
    }

    /// Everything `name` links, however indirectly.
    fn closure(&self, name: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![name.to_owned()];
        while let Some(n) = todo.pop() {
            for d in self.deps.get(&n).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    }

    /// Why `from` links `to`: the dependency path, for the failure message.
    fn path(&self, from: &str, to: &str) -> Vec<String> {
        let mut parent: BTreeMap<String, String> = BTreeMap::new();
        let mut todo = std::collections::VecDeque::from([from.to_owned()]);
        while let Some(n) = todo.pop_front() {
            if n == to {
                let mut path = vec![n.clone()];
                let mut at = n;
                while let Some(p) = parent.get(&at) {
                    path.push(p.clone());
                    at = p.clone();
                }
                path.reverse();
                return path;
            }
            for d in self.deps.get(&n).into_iter().flatten() {
                if d != from && !parent.contains_key(d) {
                    parent.insert(d.clone(), n.clone());
                    todo.push_back(d.clone());
                }
            }
        }
        Vec::new()
    }
}

/// The rules on a graph; `Err` says which crate breaks which.
fn check(g: &Graph) -> Result<usize, String> {
    let mut checked = 0;
    for name in &g.workspace {
        let closure = g.closure(name);
        if !PROTOBUF_USERS.contains(&name.as_str())
            && let Some(p) = closure.iter().find(|d| in_family(d, PROTOBUF))
        {
            return Err(format!(
                "{name} links {p} ({}): only kiln-server knows protobuf",
                g.path(name, p).join(" -> ")
            ));
        }
        if NO_WIRE.contains(&name.as_str())
            && let Some(p) = closure.iter().find(|d| in_family(d, WIRE))
        {
            return Err(format!(
                "{name} links {p} ({}): the front doors' core speaks no wire format",
                g.path(name, p).join(" -> ")
            ));
        }
        if NO_GPU.contains(&name.as_str())
            && let Some(p) = closure.iter().find(|d| in_family(d, GPU))
        {
            return Err(format!(
                "{name} links {p} ({}): it must build without a GPU stack",
                g.path(name, p).join(" -> ")
            ));
        }
        let Some((_, allowed)) = ALLOWED.iter().find(|(c, _)| c == name) else {
            continue; // the binary, the harness and benches sit on top
        };
        for d in g.direct(name).filter(|d| d.starts_with("kiln")) {
            if !allowed.contains(&d.as_str()) {
                return Err(format!(
                    "{name} must not depend on {d} (allowed: {allowed:?})"
                ));
            }
        }
        checked += 1;
    }
    Ok(checked)
}

#[test]
fn crate_dependencies_point_one_way() {
    let g = Graph::load();
    let checked = check(&g).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(checked, ALLOWED.len(), "a library crate is missing");
    // Every crate folder is in the table (or is the binary on top).
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates");
    for entry in std::fs::read_dir(&crates).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            name == "kiln" || ALLOWED.iter().any(|(c, _)| *c == name),
            "crates/{name} has no rule in ALLOWED"
        );
    }
}

/// The check itself: a GPU stack reached through a chain of crates, or protobuf reached by the
/// engine, is caught and the chain named.
#[test]
fn transitive_dependencies_are_caught() {
    let graph = |edges: &[(&str, &str)]| {
        let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            deps.entry((*a).into()).or_default().insert((*b).into());
            deps.entry((*b).into()).or_default();
        }
        let workspace = ["kiln-kv", "kiln-scheduler", "kiln-tensor", "kiln-engine"]
            .into_iter()
            .map(String::from)
            .collect();
        Graph { deps, workspace }
    };
    let ok = graph(&[
        ("kiln-scheduler", "kiln-kv"),
        ("kiln-tensor", "wgpu"),
        ("kiln-engine", "kiln-scheduler"),
        ("kiln-engine", "kiln-tensor"),
    ]);
    assert_eq!(check(&ok), Ok(4));
    let gpu = graph(&[
        ("kiln-scheduler", "kiln-kv"),
        ("kiln-kv", "kiln-tensor"),
        ("kiln-tensor", "wgpu"),
        ("wgpu", "wgpu-core"),
    ]);
    let e = check(&gpu).unwrap_err();
    assert!(
        e.contains("kiln-kv links wgpu (kiln-kv -> kiln-tensor -> wgpu)")
            || e.contains(
                "kiln-scheduler links wgpu (kiln-scheduler -> kiln-kv -> kiln-tensor -> wgpu)"
            ),
        "{e}"
    );
    let proto = graph(&[("kiln-engine", "tonic-health"), ("tonic-health", "prost")]);
    let e = check(&proto).unwrap_err();
    assert!(e.starts_with("kiln-engine links "), "{e}");
    let wire = graph(&[("kiln-engine", "axum"), ("axum", "hyper")]);
    let e = check(&wire).unwrap_err();
    assert!(
        e.contains("kiln-engine links axum (kiln-engine -> axum)")
            || e.contains("kiln-engine links hyper (kiln-engine -> axum -> hyper)"),
        "{e}"
    );
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

/// The files where `unsafe` may appear: the calls into `#[target_feature]` kernels, and the
/// one call that opens wgpu's experimental features (`--kernels experimental`).
const UNSAFE_HOMES: [&str; 2] = [
    "crates/kiln-tensor/src/cpu/dispatch.rs",
    "crates/kiln-tensor/src/gpu/experimental.rs",
];

/// Lines of `src` (a Rust file) that use `unsafe` (blocks, fns, impls, or allowing the lint),
/// comments aside, and those of its `unsafe {` blocks without a `// SAFETY:` line above.
fn unsafe_uses(src: &str) -> (Vec<usize>, Vec<usize>) {
    let (mut uses, mut unexplained) = (Vec::new(), Vec::new());
    let mut prev = "";
    for (i, line) in src.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let used = code.contains("unsafe {")
            || code.contains("unsafe fn")
            || code.contains("unsafe impl")
            || code.contains("unsafe_code");
        if used {
            uses.push(i + 1);
            if code.contains("unsafe {") && !prev.trim_start().starts_with("// SAFETY:") {
                unexplained.push(i + 1);
            }
        }
        prev = line;
    }
    (uses, unexplained)
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

#[test]
fn unsafe_lives_only_in_its_two_homes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for top in ["crates", "xtask", "benches", "tests", "fuzz"] {
        rust_files(&root.join(top), &mut files);
    }
    let mut found = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if rel == "xtask/tests/tidy.rs" {
            continue;
        }
        let (uses, unexplained) = unsafe_uses(&std::fs::read_to_string(&f).unwrap());
        if UNSAFE_HOMES.contains(&rel.as_str()) {
            if !uses.is_empty() {
                found.push(rel.clone());
            }
            assert!(
                unexplained.is_empty(),
                "{rel}: unsafe blocks without a `// SAFETY:` line above, lines {unexplained:?}"
            );
        } else {
            assert!(
                uses.is_empty(),
                "{rel} uses unsafe (lines {uses:?}): only {UNSAFE_HOMES:?} may"
            );
        }
    }
    assert_eq!(
        found.len(),
        UNSAFE_HOMES.len(),
        "each of {UNSAFE_HOMES:?} holds its calls"
    );
}

#[test]
fn unsafe_uses_are_found() {
    let src = "// unsafe { in a comment }\nlet a = 1;\nunsafe { f() }\n// SAFETY: checked\nunsafe { g() }\n#![allow(unsafe_code)]\n";
    assert_eq!(unsafe_uses(src), (vec![3, 5, 6], vec![3]));
}
