//! `cargo xtask fetch-model --hf`: an HF model folder built from a GGUF by `kiln export-hf`
//! (kiln's own exporter, run from a release build: xtask itself links none of kiln), so HF
//! loading is tested offline without a second download.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

pub(crate) const DIR_NAME: &str = "SmolLM2-135M-Instruct-hf";

const FILES: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
];

/// The weight types `kiln export-hf --dtype` takes.
const DTYPES: [&str; 3] = ["f32", "f16", "bf16"];

/// `f32` (default), `f16` or `bf16`.
pub(crate) fn parse_dtype(s: &str) -> anyhow::Result<&'static str> {
    match DTYPES.iter().find(|&&d| d == s) {
        Some(d) => Ok(d),
        None => bail!("--hf-dtype {s}: expected f32, f16 or bf16"),
    }
}

/// Writes the HF folder `out` from `gguf` unless it is complete already.
pub(crate) fn write(gguf: &Path, out: &Path, dtype: &str, force: bool) -> anyhow::Result<()> {
    if !force && FILES.iter().all(|f| out.join(f).is_file()) {
        println!("{} is present (use --force to rebuild it)", out.display());
        return Ok(());
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(crate::workspace_root())
        .args([
            "run",
            "--release",
            "-p",
            "kiln",
            "--",
            "export-hf",
            "--model",
        ])
        .arg(gguf)
        .arg("--out")
        .arg(out)
        .args(["--dtype", dtype])
        .status()
        .context("running `cargo run -p kiln -- export-hf`")?;
    if !status.success() {
        bail!("kiln export-hf exited with {status}");
    }
    Ok(())
}
