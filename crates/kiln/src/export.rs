//! `kiln export-hf`: a GGUF file written as a Hugging Face folder (`config.json`,
//! `tokenizer.json`, `tokenizer_config.json`, `model.safetensors`) by kiln's own exporter
//! (`kiln_model::export`), so HF loading is tested offline without a second download.

use std::path::PathBuf;

use kiln_engine::error_chain;
use kiln_model::StDtype;
use kiln_model::export::{HfExport, write_hf_folder};
use kiln_tokenizer::Tokenizer;

/// The weight type of the exported safetensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportDtype {
    /// Exact for dequantized GGUF weights
    F32,
    F16,
    Bf16,
}

/// `kiln export-hf`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExportHfArgs {
    /// The .gguf file to export
    #[arg(long, value_name = "GGUF")]
    pub model: PathBuf,
    /// The folder to write (created if missing; its files are replaced)
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Weight type of model.safetensors
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: ExportDtype,
}

pub fn run(args: &ExportHfArgs) -> Result<(), String> {
    let gguf = &args.model;
    let dtype = match args.dtype {
        ExportDtype::F32 => StDtype::F32,
        ExportDtype::F16 => StDtype::F16,
        ExportDtype::Bf16 => StDtype::BF16,
    };
    let tokenizer = Tokenizer::from_gguf_file(gguf)
        .map_err(|e| format!("{}: its tokenizer: {}", gguf.display(), error_chain(&e)))?;
    let json = tokenizer
        .inner()
        .to_string(true)
        .map_err(|e| format!("{}: serializing its tokenizer: {e}", gguf.display()))?;
    // A stale weights file would make a half-written folder look complete.
    let _ = std::fs::remove_file(args.out.join("model.safetensors"));
    write_hf_folder(
        gguf,
        &args.out,
        &HfExport {
            dtype,
            tokenizer_json: Some(json),
        },
    )
    .map_err(|e| format!("{}: {}", gguf.display(), error_chain(&e)))?;
    println!("wrote {} ({} weights)", args.out.display(), dtype.name());
    Ok(())
}
