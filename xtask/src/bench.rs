//! `cargo xtask bench [FLAGS]`: the serving benchmarks. Fetches the default model
//! when no `--model` is given and it is missing, then runs the `kiln-bench` binary of
//! `kiln-benches` from a release build; xtask itself stays free of the engine crates.

use std::process::Command;

use anyhow::{Context, bail};

pub(crate) fn run(args: &[String]) -> anyhow::Result<()> {
    let has_model = args
        .iter()
        .any(|a| a == "--model" || a.starts_with("--model="));
    let wants_help = args.iter().any(|a| a == "-h" || a == "--help");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(crate::workspace_root()).args([
        "run",
        "--release",
        "-p",
        "kiln-benches",
        "--bin",
        "kiln-bench",
        "--",
    ]);
    // `bench moe` makes its own model and takes the default model's vocabulary.
    let moe = args.first().is_some_and(|a| a == "moe");
    let has_vocab = args.iter().any(|a| a.starts_with("--vocab-from"));
    if moe && !has_vocab && !wants_help {
        let model = crate::fetch_model::ensure_default_model()?;
        cmd.arg("moe").arg("--vocab-from").arg(model);
        let status = cmd
            .args(&args[1..])
            .status()
            .context("running kiln-bench moe")?;
        if !status.success() {
            bail!("kiln-bench moe exited with {status}");
        }
        return Ok(());
    }
    if !has_model && !wants_help && !moe {
        let model = crate::fetch_model::ensure_default_model()?;
        cmd.arg("--model").arg(model);
    }
    let status = cmd
        .args(args)
        .status()
        .context("running `cargo run -p kiln-benches --bin kiln-bench`")?;
    if !status.success() {
        bail!("kiln-bench exited with {status}");
    }
    Ok(())
}
