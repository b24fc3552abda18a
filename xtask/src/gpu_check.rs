//! `cargo xtask gpu-check [--run] [FLAGS]`: bundles the GPU check for a machine with a real
//! GPU and, with `--run`, runs it here. The bundle, `target/gpu-check/` (well under 64 MiB),
//! holds what such a short, offline session needs and may lack: `kiln-bench` from a release
//! build, stripped of its debug line tables; the Vulkan loader (`libvulkan.so.1`) of this
//! machine; and `run.sh`, which puts the loader on the library path, writes an ICD manifest
//! for NVIDIA's driver when the machine has the driver but no manifest, and runs
//! `kiln-bench gpu-check` (synthetic weights of real shapes from a seed: no model carried).
//! FLAGS go to `kiln-bench gpu-check` with `--run` (`--help` there lists them).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

const RUN_SH: &str = r#"#!/bin/sh
# kiln's GPU check (cargo xtask gpu-check made this folder): run it on the machine with the
# GPU, from anywhere; FLAGS go to `kiln-bench gpu-check` (--help lists them).
here=$(cd "$(dirname "$0")" && pwd)
# The Vulkan loader carried here, for machines that have none installed.
export LD_LIBRARY_PATH="$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NVIDIA's driver without its Vulkan ICD manifest: point the loader at the driver's library.
if [ -z "$VK_ICD_FILENAMES" ] && ! ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json >/dev/null 2>&1; then
    lib=$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia.so.0/ {print $NF; exit}')
    if [ -n "$lib" ]; then
        printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$lib" > "$here/nvidia_icd.json"
        export VK_ICD_FILENAMES="$here/nvidia_icd.json"
    fi
fi
exec "$here/kiln-bench" gpu-check "$@"
"#;

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {what}"))?;
    if !status.success() {
        bail!("{what} exited with {status}");
    }
    Ok(())
}

/// This machine's Vulkan loader: the file `libvulkan.so.1` resolves to.
fn vulkan_loader() -> anyhow::Result<PathBuf> {
    let out = Command::new("ldconfig").arg("-p").output();
    let from_cache = out.ok().and_then(|o| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.contains("libvulkan.so.1") && l.contains("x86-64"))
            .find_map(|l| l.rsplit(" => ").next().map(PathBuf::from))
    });
    let candidates = from_cache.into_iter().chain(
        [
            "/usr/lib/x86_64-linux-gnu/libvulkan.so.1",
            "/usr/lib64/libvulkan.so.1",
        ]
        .iter()
        .map(PathBuf::from),
    );
    for c in candidates {
        if let Ok(real) = std::fs::canonicalize(&c) {
            return Ok(real);
        }
    }
    bail!("no libvulkan.so.1 on this machine (Debian: apt-get install libvulkan1)")
}

pub(crate) fn run_cmd(args: &[String]) -> anyhow::Result<()> {
    if args.iter().any(|a| a == "-h" || a == "--help") && !args.iter().any(|a| a == "--run") {
        println!(
            "usage: cargo xtask gpu-check [--run [FLAGS]]\n\nBundles kiln-bench (stripped), the \
             Vulkan loader and run.sh into target/gpu-check/ for a machine with a GPU; --run \
             runs it here too (a CPU-type adapter is refused unless FLAGS has \
             --allow-cpu-adapter). FLAGS go to `kiln-bench gpu-check`."
        );
        return Ok(());
    }
    let (run_here, flags) = match args.split_first() {
        Some((f, rest)) if f == "--run" => (true, rest),
        Some((f, _)) => bail!("unexpected argument {f:?} (see --help)"),
        None => (false, &[][..]),
    };
    let root = crate::workspace_root();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(
        Command::new(cargo).current_dir(&root).args([
            "build",
            "--release",
            "-p",
            "kiln-benches",
            "--bin",
            "kiln-bench",
        ]),
        "cargo build -p kiln-benches --bin kiln-bench",
    )?;
    let bundle = root.join("target").join("gpu-check");
    std::fs::create_dir_all(&bundle).with_context(|| format!("creating {}", bundle.display()))?;
    let bin = bundle.join("kiln-bench");
    std::fs::copy(root.join("target/release/kiln-bench"), &bin).context("copying kiln-bench")?;
    run(
        Command::new("strip").arg("--strip-debug").arg(&bin),
        "strip (binutils)",
    )?;
    let loader = vulkan_loader()?;
    std::fs::copy(&loader, bundle.join("libvulkan.so.1"))
        .with_context(|| format!("copying {}", loader.display()))?;
    let script = bundle.join("run.sh");
    std::fs::write(&script, RUN_SH).context("writing run.sh")?;
    make_executable(&script)?;
    let size: u64 = std::fs::read_dir(&bundle)?
        .filter_map(Result::ok)
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "{}: {:.1} MiB (kiln-bench, libvulkan.so.1 from {}, run.sh)",
        bundle.display(),
        size as f64 / (1u64 << 20) as f64,
        loader.display()
    );
    if run_here {
        let mut cmd = Command::new(&script);
        cmd.args(flags);
        run(&mut cmd, "target/gpu-check/run.sh")?;
    }
    Ok(())
}

#[cfg(unix)]
fn make_executable(p: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", p.display()))
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> anyhow::Result<()> {
    Ok(())
}
