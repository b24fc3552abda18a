//! `cargo xtask llama-cpp`: builds llama.cpp's `llama-server` and `llama-bench` (CPU backend)
//! into `target/llama.cpp/bin` from the llama.cpp that the `llama-cpp-python` source
//! distribution vendors, for `cargo xtask bench --compare llama-server`. Needs `cmake` and a
//! C++ compiler (Debian: `apt-get install cmake g++`); pip fetches the sdist. Nothing of it is
//! committed or linked into kiln.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

/// The sdist, pinned: its `vendor/llama.cpp` is the llama.cpp kiln compares with.
const SDIST: &str = "llama-cpp-python==0.3.36";

/// CPU flags chosen explicitly: `GGML_NATIVE` picks AMX on some CI-class VMs whose kernels do
/// not enable it (SIGILL at model load); the web UI is not fetched at build time.
const CMAKE_FLAGS: &[&str] = &[
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON",
    "-DGGML_AVX512_VNNI=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
];

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {what}"))?;
    if !status.success() {
        bail!("{what} exited with {status}");
    }
    Ok(())
}

pub(crate) fn run_cmd(args: &[String]) -> anyhow::Result<()> {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!(
            "usage: cargo xtask llama-cpp\n\nBuilds llama-server and llama-bench from {SDIST}'s vendored llama.cpp \
             into target/llama.cpp/bin (cmake and a C++ compiler needed)."
        );
        return Ok(());
    }
    if let Some(a) = args.first() {
        bail!("unexpected argument {a:?} (see --help)");
    }
    let root = crate::workspace_root().join("target").join("llama.cpp");
    let bin = root.join("bin");
    if bin.join("llama-server").is_file() && bin.join("llama-bench").is_file() {
        println!(
            "{} already holds llama-server and llama-bench",
            bin.display()
        );
        return Ok(());
    }
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let src = unpack(&root)?;
    let build = root.join("build");
    let mut configure = Command::new("cmake");
    configure
        .arg("-S")
        .arg(&src)
        .arg("-B")
        .arg(&build)
        .args(CMAKE_FLAGS);
    run(&mut configure, "cmake (configure; is cmake installed?)")?;
    let jobs = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .to_string();
    let mut make = Command::new("cmake");
    make.arg("--build").arg(&build).args([
        "--config",
        "Release",
        "-j",
        &jobs,
        "--target",
        "llama-server",
        "llama-bench",
    ]);
    run(&mut make, "cmake --build")?;
    std::fs::create_dir_all(&bin)?;
    for name in ["llama-server", "llama-bench"] {
        std::fs::copy(build.join("bin").join(name), bin.join(name))
            .with_context(|| format!("copying {name}"))?;
    }
    println!("built {}", bin.display());
    Ok(())
}

/// Downloads the sdist with pip and unpacks it; returns its vendored llama.cpp.
fn unpack(root: &Path) -> anyhow::Result<std::path::PathBuf> {
    let dl = root.join("sdist");
    std::fs::create_dir_all(&dl)?;
    let mut pip = Command::new("python3");
    pip.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        // The sdist itself; the build tools pip installs to read its metadata come as
        // wheels (`:all:` would build cmake from source first).
        "--no-binary",
        "llama-cpp-python",
        SDIST,
        "-d",
    ])
    .arg(&dl);
    run(&mut pip, "pip download")?;
    let archive = std::fs::read_dir(&dl)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".tar.gz"))
        .context("pip left no .tar.gz")?;
    let mut tar = Command::new("tar");
    tar.arg("xzf").arg(&archive).arg("-C").arg(root);
    run(&mut tar, "tar")?;
    let name = archive
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".tar.gz"))
        .context("the sdist's name")?;
    let src = root.join(name).join("vendor").join("llama.cpp");
    if !src.join("CMakeLists.txt").is_file() {
        bail!("{} has no CMakeLists.txt", src.display());
    }
    Ok(src)
}
