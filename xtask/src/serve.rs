//! `cargo xtask serve [FLAGS]`: the README's first command. Fetches the default model when it
//! is missing, then runs `kiln serve --model <it> FLAGS` from a release build.

use std::process::Command;

use anyhow::{Context, bail};

pub(crate) fn run(args: &[String]) -> anyhow::Result<()> {
    let model = crate::fetch_model::ensure_default_model()?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(crate::workspace_root())
        .args(["run", "--release", "-p", "kiln", "--", "serve", "--model"])
        .arg(&model)
        .args(args)
        .status()
        .context("running `cargo run -p kiln -- serve`")?;
    if !status.success() {
        bail!("kiln serve exited with {status}");
    }
    Ok(())
}
