//! What is inside a GGUF file, as `gguf-dump` shows it: the header, the metadata (long arrays
//! summarised) and the tensors by storage type, and where each tensor's bytes lie.
//!
//! `cargo run --release -p kiln-gguf --example inspect [MODEL.gguf]` (default: the default
//! model, `models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by `cargo xtask fetch-model`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use kiln_gguf::{GgufFile, MetadataValue};

fn main() -> ExitCode {
    let path = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    match run(&path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inspect example: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    // Reads the header, metadata and tensor infos only; tensor data stays on disk.
    let file = GgufFile::open(path)?;
    println!(
        "{}: GGUF v{}, {} metadata keys, {} tensors, data at byte {} (alignment {})",
        file.source(),
        file.version(),
        file.metadata().len(),
        file.tensors().len(),
        file.data_offset(),
        file.alignment()
    );
    for (key, value) in file.metadata().iter() {
        println!("  {key} = {}", show(value));
    }

    // Tensors by storage type, with the bytes each type takes.
    let mut by_type: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in file.tensors() {
        let name = t
            .ggml_type
            .name()
            .map_or_else(|| format!("type {}", t.ggml_type.0), str::to_owned);
        let e = by_type.entry(name).or_default();
        e.0 += 1;
        e.1 += t.byte_size.unwrap_or(0);
    }
    for (ty, (n, bytes)) in &by_type {
        println!(
            "  {n:4} tensors of {ty:6} {:8.2} MiB",
            *bytes as f64 / (1 << 20) as f64
        );
    }
    let first = file.tensors().first().ok_or("the file holds no tensor")?;
    let range = first
        .data_range()
        .ok_or("the first tensor's type has no known layout")?;
    println!(
        "  first tensor: {} {:?} ({} elements) at bytes {}..{}",
        first.name, first.dims, first.n_elements, range.start, range.end
    );

    // Every tensor's bytes lie inside the file, aligned, one after another without overlap.
    let mut ranges: Vec<_> = file
        .tensors()
        .iter()
        .filter_map(|t| t.data_range())
        .collect();
    ranges.sort_by_key(|r| r.start);
    for w in ranges.windows(2) {
        if w[0].end > w[1].start {
            return Err(format!("tensor data overlaps at byte {}", w[1].start).into());
        }
    }
    let last_end = ranges.last().map_or(0, |r| r.end);
    if last_end > file.file_len() || ranges.iter().any(|r| r.start % file.alignment() != 0) {
        return Err("tensor data outside the file or unaligned".into());
    }
    if path.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf") {
        // The default model: a llama with 30 blocks of 9 tensors, plus embeddings and norm.
        let blocks = file
            .metadata()
            .get("llama.block_count")
            .and_then(|v| v.as_i128());
        if file.architecture() != Some("llama") || blocks != Some(30) {
            return Err(format!(
                "expected llama with 30 blocks, found {:?} with {blocks:?}",
                file.architecture()
            )
            .into());
        }
    }
    println!("ok");
    Ok(())
}

/// A scalar as its value (a long string cut short), an array as its type and length.
fn show(value: &MetadataValue) -> String {
    match value {
        MetadataValue::String(s) if s.chars().count() > 60 => {
            let cut: String = s.chars().take(60).collect();
            format!("{cut:?}… ({} bytes)", s.len())
        }
        MetadataValue::String(s) => format!("{s:?}"),
        MetadataValue::F32(x) => x.to_string(),
        MetadataValue::F64(x) => x.to_string(),
        MetadataValue::Bool(b) => b.to_string(),
        MetadataValue::Array(_) => value.describe(),
        other => other
            .as_i128()
            .map_or_else(|| other.describe(), |i| i.to_string()),
    }
}
