//! `cargo xtask fetch-model --hf`: an HF model folder built from a GGUF with kiln's
//! own code (`kiln_model::export::write_hf_folder`), so HF loading is tested offline without a
//! second download.

use std::path::Path;

use anyhow::{Context, bail};
use kiln_model::StDtype;
use kiln_model::export::{HfExport, write_hf_folder};
use kiln_tokenizer::Tokenizer;

pub(crate) const DIR_NAME: &str = "SmolLM2-135M-Instruct-hf";

const FILES: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
];

/// `f32` (default), `f16` or `bf16`.
pub(crate) fn parse_dtype(s: &str) -> anyhow::Result<StDtype> {
    Ok(match s {
        "f32" => StDtype::F32,
        "f16" => StDtype::F16,
        "bf16" => StDtype::BF16,
        other => bail!("--hf-dtype {other}: expected f32, f16 or bf16"),
    })
}

/// Writes the HF folder `out` from `gguf` unless it is complete already.
pub(crate) fn write(gguf: &Path, out: &Path, dtype: StDtype, force: bool) -> anyhow::Result<()> {
    if !force && FILES.iter().all(|f| out.join(f).is_file()) {
        println!("{} is present (use --force to rebuild it)", out.display());
        return Ok(());
    }
    let tokenizer = Tokenizer::from_gguf_file(gguf)
        .with_context(|| format!("building the tokenizer of {}", gguf.display()))?;
    let json = tokenizer
        .inner()
        .to_string(true)
        .map_err(|e| anyhow::anyhow!("serializing the tokenizer of {}: {e}", gguf.display()))?;
    // A stale weights file would make a half-written folder look complete.
    let _ = std::fs::remove_file(out.join("model.safetensors"));
    write_hf_folder(
        gguf,
        out,
        &HfExport {
            dtype,
            tokenizer_json: Some(json),
        },
    )?;
    println!("wrote {} ({} weights)", out.display(), dtype.name());
    Ok(())
}
