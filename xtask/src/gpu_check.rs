//! `cargo xtask gpu-check [--run] [FLAGS]`: bundles the GPU check for a machine with a real
//! GPU and, with `--run`, runs it here. The bundle, `target/gpu-check/` (well under 64 MiB),
//! holds what such a short, offline session needs and may lack: `kiln-bench` from a release
//! build, stripped of its debug line tables; in `lib/`, this machine's Vulkan loader and
//! glvnd's libraries (which NVIDIA's Vulkan driver needs); and `run.sh`, which uses
//! those libraries only where the machine has none, points the loader at NVIDIA's driver when
//! its manifest is not where the loader looks (or writes one when it has none), and runs
//! `kiln-bench gpu-check` (synthetic weights of real shapes from a seed: no model carried).
//! FLAGS go to `kiln-bench gpu-check` with `--run` (`--help` there lists them).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

const RUN_SH: &str = r#"#!/bin/sh
# kiln's GPU check (cargo xtask gpu-check made this folder): run it on the machine with the
# GPU, from anywhere; FLAGS go to `kiln-bench gpu-check` (--help lists them).
here=$(cd "$(dirname "$0")" && pwd)
# The libraries carried in lib/ (the Vulkan loader, and glvnd's libraries that NVIDIA's Vulkan
# driver needs) are used only where the machine has none of its own.
mkdir -p "$here/use"
rm -f "$here/use/"*
for l in "$here"/lib/*; do
    name=$(basename "$l")
    if ! ldconfig -p 2>/dev/null | grep -q "$name "; then
        ln -s "$l" "$here/use/$name"
        echo "run.sh: using the carried $name"
    fi
done
export LD_LIBRARY_PATH="$here/use${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NVIDIA's driver whose Vulkan manifest is not where the loader looks (container images keep
# it under /usr/local/nvidia), or that has none: point the loader at it.
listed=
for d in /usr/share/vulkan/icd.d /etc/vulkan/icd.d; do
    if ls "$d"/nvidia*.json >/dev/null 2>&1; then listed=$d; fi
done
if [ -z "$VK_ICD_FILENAMES$VK_DRIVER_FILES$listed" ]; then
    manifest=
    for m in /usr/local/nvidia/share/vulkan/icd.d/nvidia*.json /usr/local/share/vulkan/icd.d/nvidia*.json; do
        if [ -f "$m" ]; then manifest=$m; break; fi
    done
    if [ -z "$manifest" ]; then
        lib=$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia.so.0/ {print $NF; exit}')
        if [ -n "$lib" ]; then
            printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$lib" > "$here/nvidia_icd.json"
            manifest="$here/nvidia_icd.json"
        fi
    fi
    if [ -n "$manifest" ]; then
        echo "run.sh: NVIDIA's Vulkan driver from $manifest"
        export VK_DRIVER_FILES="$manifest" VK_ICD_FILENAMES="$manifest"
    fi
fi
exec "$here/kiln-bench" gpu-check "$@"
"#;

/// The libraries the bundle carries for machines that lack them: the Vulkan loader, and
/// glvnd's libraries, which NVIDIA's Vulkan driver (`libGLX_nvidia`) needs (a machine with
/// the driver and neither found no adapter until glvnd's were there). With the package that
/// has each and whether the bundle can go without it.
const CARRIED_LIBS: [(&str, &str, bool); 7] = [
    ("libvulkan.so.1", "libvulkan1", true),
    ("libGLdispatch.so.0", "libglvnd0", true),
    ("libGLX.so.0", "libglx0", false),
    ("libEGL.so.1", "libegl1", false),
    ("libGL.so.1", "libgl1", false),
    ("libOpenGL.so.0", "libopengl0", false),
    ("libGLESv2.so.2", "libgles2", false),
];

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {what}"))?;
    if !status.success() {
        bail!("{what} exited with {status}");
    }
    Ok(())
}

/// The file this machine's `name` (a shared library) resolves to.
fn shared_lib(name: &str, package: &str) -> anyhow::Result<PathBuf> {
    let out = Command::new("ldconfig").arg("-p").output();
    let from_cache = out.ok().and_then(|o| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.trim_start().starts_with(&format!("{name} ")) && l.contains("x86-64"))
            .find_map(|l| l.rsplit(" => ").next().map(PathBuf::from))
    });
    let candidates = from_cache.into_iter().chain(
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"]
            .iter()
            .map(|d| Path::new(d).join(name)),
    );
    for c in candidates {
        if let Ok(real) = std::fs::canonicalize(&c) {
            return Ok(real);
        }
    }
    bail!("no {name} on this machine (Debian: apt-get install {package})")
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
    let lib_dir = bundle.join("lib");
    std::fs::create_dir_all(&lib_dir).with_context(|| format!("creating {}", lib_dir.display()))?;
    let mut carried = Vec::new();
    for (name, package, required) in CARRIED_LIBS {
        let from = match shared_lib(name, package) {
            Ok(f) => f,
            Err(e) if !required => {
                eprintln!("gpu-check: not carried: {e:#}");
                continue;
            }
            Err(e) => return Err(e),
        };
        std::fs::copy(&from, lib_dir.join(name))
            .with_context(|| format!("copying {}", from.display()))?;
        carried.push(name);
    }
    let script = bundle.join("run.sh");
    std::fs::write(&script, RUN_SH).context("writing run.sh")?;
    make_executable(&script)?;
    let size: u64 = [&bundle, &lib_dir]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten())
        .filter_map(Result::ok)
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum();
    println!(
        "{}: {:.1} MiB (kiln-bench, run.sh, lib/: {})",
        bundle.display(),
        size as f64 / (1u64 << 20) as f64,
        carried.join(" ")
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
