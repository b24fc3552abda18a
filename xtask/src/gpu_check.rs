//! `cargo xtask gpu-check [--peer] [--run] [FLAGS]`: bundles the GPU check for a machine with a
//! real GPU and, with `--run`, runs it here. The bundle, `target/gpu-check/` (under the 64 MiB
//! a device session carries), holds what such a short, offline session needs and may lack:
//! - `kiln-bench` from a release build, stripped of its debug line tables;
//! - in `lib/`, this machine's Vulkan loader, glvnd's libraries (which NVIDIA's Vulkan driver
//!   needs) and what `vulkaninfo` links;
//! - `vulkaninfo`, for the driver's integer dot product support (whether `dot4I8Packed`
//!   lowers to `OpSDot`: wgpu declares the capability where the device has
//!   `shaderIntegerDotProduct`);
//! - `vocab.gguf`, the default model's vocabulary alone (the models run.sh writes take it);
//! - `deepseek_v4/`, kiln-model's tiny DeepSeek-V4 model and its transformers goldens;
//! - the peer, where it is built (`--peer` builds it: `cargo xtask llama-cpp --vulkan`):
//!   llama.cpp's `llama-bench` and `llama-server` on its Vulkan backend, xz-compressed
//!   (`peer.tar.xz`);
//! - `run.sh`, which uses the carried libraries only where the machine has none, points the
//!   loader at NVIDIA's driver when its manifest is not where the loader looks (or writes one
//!   when it has none), prints the driver's integer dot product support, runs `kiln-bench
//!   gpu-check` (synthetic weights of real shapes from a seed, and the tiny V4 model), then writes
//!   a SmolLM2-shaped Q4_1 and a 7B-shaped Q4_0 GGUF from a seed and runs the bench: on the
//!   7B one with `--kernels experimental`, and with a peer on each, kiln against it: pp512,
//!   tg128 and 16-stream serving.
//!
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
# What the tensor-core and dp4a kernels depend on: wgpu declares the SPIR-V dot product
# capabilities (dot4I8Packed as OpSDot) where shaderIntegerDotProduct is true.
if [ -x "$here/vulkaninfo" ]; then
    echo "run.sh: the driver's integer dot product and cooperative matrix support:"
    "$here/vulkaninfo" 2>/dev/null | grep -E "deviceName|apiVersion|shaderIntegerDotProduct|integerDotProduct(4x8BitPacked|8Bit)SignedAccelerated|cooperativeMatrix|subgroupSize" | sort -u | sed 's/^/    /'
fi
# The tiny DeepSeek-V4 model and its transformers goldens, carried from kiln-model's fixtures.
if [ -d "$here/deepseek_v4" ]; then
    set -- --v4-fixtures "$here/deepseek_v4" "$@"
fi
"$here/kiln-bench" gpu-check "$@"
status=$?
# GGUFs of real shapes, written here from a seed with the default model's vocabulary: kiln's
# experimental kernels against its tested ones on the 7B-shaped one, and, with a peer in the
# bundle, kiln against llama.cpp's Vulkan build on each (RUN_MODELS=0 skips all of it).
if [ -f "$here/vocab.gguf" ] && [ "${RUN_MODELS:-1}" != 0 ]; then
    mkdir -p "$here/models"
    if [ -f "$here/peer.tar.xz" ]; then
        mkdir -p "$here/peer"
        tar -xJf "$here/peer.tar.xz" -C "$here/peer"
    else
        echo "run.sh: no peer in this bundle (cargo xtask gpu-check --peer carries llama.cpp's Vulkan build)"
    fi
    for m in smollm2:Q4_1 7b:Q4_0; do
        shape=${m%%:*}
        dtype=${m#*:}
        model="$here/models/$shape-$dtype.gguf"
        "$here/kiln-bench" write-gguf --shape "$shape" --dtype "$dtype" --vocab-from "$here/vocab.gguf" --out "$model" || status=1
        if [ "$shape" = 7b ]; then
            "$here/kiln-bench" --model "$model" --backend wgpu --scenarios single --levels 1 \
                --prompt-tokens 512 --new-tokens 128 --repetitions 2 --kernels experimental \
                --out "${OUT:-$here}/experimental-$shape-$dtype" || status=1
        fi
        if [ -d "$here/peer" ]; then
            "$here/kiln-bench" --model "$model" --backend wgpu --scenarios single,serve --levels 1 \
                --prompt-tokens 512 --new-tokens 128 --repetitions 2 \
                --serve-concurrency 16 --serve-requests 32 \
                --compare llama-server --llama-cpp-dir "$here/peer" --llama-gpu-layers 99 \
                --out "${OUT:-$here}/peer-$shape-$dtype" || status=1
        fi
    done
fi
exit $status
"#;

/// The libraries the bundle carries for machines that lack them: the Vulkan loader, and
/// glvnd's libraries, which NVIDIA's Vulkan driver (`libGLX_nvidia`) needs (a machine with
/// the driver and neither found no adapter until glvnd's were there); then what vulkaninfo
/// and the peer link. With the package that has each and whether the bundle can go without
/// it.
const CARRIED_LIBS: [(&str, &str, bool); 15] = [
    ("libvulkan.so.1", "libvulkan1", true),
    ("libGLdispatch.so.0", "libglvnd0", true),
    ("libGLX.so.0", "libglx0", false),
    ("libEGL.so.1", "libegl1", false),
    ("libGL.so.1", "libgl1", false),
    ("libOpenGL.so.0", "libopengl0", false),
    ("libGLESv2.so.2", "libgles2", false),
    // What vulkaninfo links beyond libc and libstdc++.
    ("libwayland-client.so.0", "libwayland-client0", false),
    ("libxcb.so.1", "libxcb1", false),
    ("libX11.so.6", "libx11-6", false),
    ("libXau.so.6", "libxau6", false),
    ("libXdmcp.so.6", "libxdmcp6", false),
    ("libbsd.so.0", "libbsd0", false),
    ("libmd.so.0", "libmd0", false),
    // The peer's CPU code's OpenMP.
    ("libgomp.so.1", "libgomp1", false),
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
            "usage: cargo xtask gpu-check [--peer] [--run [FLAGS]]\n\nBundles kiln-bench \
             (stripped), the Vulkan loader, vulkaninfo and run.sh into target/gpu-check/ for a \
             machine with a GPU, and llama.cpp's Vulkan build where it is built; --peer builds \
             it first (cargo xtask llama-cpp --vulkan); --run runs the bundle here too (a \
             CPU-type adapter is refused unless FLAGS has --allow-cpu-adapter). FLAGS go to \
             `kiln-bench gpu-check`."
        );
        return Ok(());
    }
    let (peer, args) = match args.split_first() {
        Some((f, rest)) if f == "--peer" => (true, rest),
        _ => (false, args),
    };
    let (run_here, flags) = match args.split_first() {
        Some((f, rest)) if f == "--run" => (true, rest),
        Some((f, _)) => bail!("unexpected argument {f:?} (see --help)"),
        None => (false, &[][..]),
    };
    if peer {
        crate::llama_cpp::build(crate::llama_cpp::Flavor::Vulkan)?;
    }
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
    match Command::new("sh")
        .args(["-c", "command -v vulkaninfo"])
        .output()
    {
        Ok(o) if o.status.success() => {
            let from = String::from_utf8_lossy(&o.stdout).trim().to_owned();
            std::fs::copy(&from, bundle.join("vulkaninfo"))
                .with_context(|| format!("copying {from}"))?;
            carried.push("vulkaninfo");
        }
        _ => eprintln!("gpu-check: not carried: vulkaninfo (Debian: apt-get install vulkan-tools)"),
    }
    carried.extend(carry_vocab(&root, &bundle)?);
    carried.push(carry_v4(&root, &bundle)?);
    if carry_peer(&bundle)? {
        carried.push("peer.tar.xz");
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
        "{}: {:.1} MiB (kiln-bench, run.sh; carried: {})",
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

/// Puts the default model's vocabulary alone in `bundle` (`vocab.gguf`: the models run.sh
/// writes take it) where the default model is here; none, with the reason printed, where not.
fn carry_vocab(root: &Path, bundle: &Path) -> anyhow::Result<Option<&'static str>> {
    let model = crate::fetch_model::model_dir().join(crate::fetch_model::MODELS[0].file_name);
    let vocab = bundle.join("vocab.gguf");
    let _ = std::fs::remove_file(&vocab);
    if !model.is_file() {
        println!(
            "gpu-check: no vocab.gguf carried: no {} (cargo xtask fetch-model); run.sh will \
             write no models",
            model.display()
        );
        return Ok(None);
    }
    run(
        Command::new(root.join("target/release/kiln-bench"))
            .args(["write-gguf", "--vocab-only", "--vocab-from"])
            .arg(&model)
            .arg("--out")
            .arg(&vocab),
        "kiln-bench write-gguf --vocab-only",
    )?;
    Ok(Some("vocab.gguf"))
}

/// Copies kiln-model's tiny DeepSeek-V4 model (its folder, as DeepSeek ships it in FP8 and
/// FP4, and its GGUF) and its transformers goldens (about 3 MiB) into
/// `bundle/deepseek_v4`, for `kiln-bench gpu-check --v4-fixtures`.
fn carry_v4(root: &Path, bundle: &Path) -> anyhow::Result<&'static str> {
    let from = root.join("crates/kiln-model/tests/fixtures/deepseek_v4");
    let to = bundle.join("deepseek_v4");
    for dir in ["tiny", "tiny-fp8"] {
        std::fs::create_dir_all(to.join(dir))
            .with_context(|| format!("creating {}", to.join(dir).display()))?;
    }
    for file in [
        "tiny/config.json",
        "tiny/model.safetensors",
        "tiny-fp8/config.json",
        "tiny-fp8/model.safetensors",
        "tiny-f32.gguf",
        "model_golden.safetensors",
    ] {
        std::fs::copy(from.join(file), to.join(file))
            .with_context(|| format!("copying {} into the bundle", from.join(file).display()))?;
    }
    Ok("deepseek_v4/")
}

/// Puts llama.cpp's Vulkan build (stripped, xz-compressed) in `bundle` where it is built;
/// false, with the reason printed, where it is not.
fn carry_peer(bundle: &Path) -> anyhow::Result<bool> {
    use crate::llama_cpp::{BINARIES, Flavor};
    let bin = Flavor::Vulkan.bin();
    let tarball = bundle.join("peer.tar.xz");
    let _ = std::fs::remove_file(&tarball);
    if !BINARIES.iter().all(|b| bin.join(b).is_file()) {
        println!(
            "gpu-check: no peer carried: {} has no Vulkan build (cargo xtask gpu-check --peer)",
            bin.display()
        );
        return Ok(false);
    }
    let stripped = bundle.join("peer-stripped");
    std::fs::create_dir_all(&stripped)?;
    for b in BINARIES {
        std::fs::copy(bin.join(b), stripped.join(b)).with_context(|| format!("copying {b}"))?;
        run(
            Command::new("strip").arg(stripped.join(b)),
            "strip (binutils)",
        )?;
    }
    run(
        Command::new("tar")
            .arg("-cJf")
            .arg(&tarball)
            .arg("-C")
            .arg(&stripped)
            .args(BINARIES),
        "tar -cJf (xz-utils)",
    )?;
    std::fs::remove_dir_all(&stripped)?;
    Ok(true)
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
