//! `cargo xtask llama-cpp [--vulkan]`: builds llama.cpp's `llama-server` and `llama-bench`
//! from the llama.cpp that the `llama-cpp-python` source distribution vendors:
//! - its CPU backend into `target/llama.cpp/bin`, for `cargo xtask bench --compare
//!   llama-server`;
//! - with `--vulkan`, its Vulkan backend (the CPU code AVX2 only: the GPU machine's CPU is not
//!   this one) into `target/llama.cpp-vulkan/bin`, the peer `cargo xtask gpu-check` carries.
//!   Needs Debian's `glslc`, `libvulkan-dev` and `spirv-headers`; where they are too old for
//!   llama.cpp's code or shaders, the error quotes the compiler's first error.
//!
//! Needs `cmake` and a C++ compiler (Debian: `apt-get install cmake g++`); pip fetches the
//! sdist. Nothing of it is committed or linked into kiln.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The sdist, pinned: its `vendor/llama.cpp` is the llama.cpp kiln compares with.
const SDIST: &str = "llama-cpp-python==0.3.36";

/// Flags of every build: CPU flags chosen explicitly (`GGML_NATIVE` picks AMX on some
/// CI-class VMs whose kernels do not enable it: SIGILL at model load), static binaries, the
/// web UI not fetched at build time.
const CMAKE_FLAGS: &[&str] = &[
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
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

/// Which llama.cpp backend a build is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// The CPU backend at this machine's AVX-512 (the bench runs here).
    Cpu,
    /// The Vulkan backend, its CPU code AVX2 only (it runs on the GPU machine).
    Vulkan,
}

impl Flavor {
    /// The folder under `target/` the build goes to.
    fn dir(self) -> &'static str {
        match self {
            Flavor::Cpu => "llama.cpp",
            Flavor::Vulkan => "llama.cpp-vulkan",
        }
    }

    fn cmake_flags(self) -> &'static [&'static str] {
        match self {
            Flavor::Cpu => &["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"],
            Flavor::Vulkan => &["-DGGML_AVX512=OFF", "-DGGML_VULKAN=ON"],
        }
    }

    /// Where its `llama-server` and `llama-bench` go.
    pub(crate) fn bin(self) -> PathBuf {
        crate::workspace_root()
            .join("target")
            .join(self.dir())
            .join("bin")
    }
}

/// The binaries a build makes.
pub(crate) const BINARIES: [&str; 2] = ["llama-server", "llama-bench"];

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
            "usage: cargo xtask llama-cpp [--vulkan]\n\nBuilds llama-server and llama-bench from {SDIST}'s vendored llama.cpp \
             into target/llama.cpp/bin (cmake and a C++ compiler needed); --vulkan: its Vulkan \
             backend into target/llama.cpp-vulkan/bin for the GPU check (also glslc, \
             libvulkan-dev and spirv-headers)."
        );
        return Ok(());
    }
    let flavor = match args {
        [] => Flavor::Cpu,
        [v] if v == "--vulkan" => Flavor::Vulkan,
        [a, ..] => bail!("unexpected argument {a:?} (see --help)"),
    };
    build(flavor)
}

/// Builds `flavor` unless its binaries are there.
pub(crate) fn build(flavor: Flavor) -> anyhow::Result<()> {
    let bin = flavor.bin();
    if BINARIES.iter().all(|b| bin.join(b).is_file()) {
        println!(
            "{} already holds llama-server and llama-bench",
            bin.display()
        );
        return Ok(());
    }
    let root = crate::workspace_root().join("target").join(flavor.dir());
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let src = unpack(&root)?;
    let build = root.join("build");
    let mut configure = Command::new("cmake");
    configure
        .arg("-S")
        .arg(&src)
        .arg("-B")
        .arg(&build)
        .args(CMAKE_FLAGS)
        .args(flavor.cmake_flags());
    if flavor == Flavor::Vulkan {
        // What the shaders will lack: glslc too old for an extension turns its shaders off.
        let out = configure
            .output()
            .context("running cmake (configure; is cmake installed?)")?;
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        for line in text
            .lines()
            .filter(|l| l.contains("not supported by glslc"))
        {
            println!("llama.cpp (Vulkan): {}", line.trim_start_matches("-- "));
        }
        if !out.status.success() {
            bail!(
                "cmake could not configure llama.cpp's Vulkan backend (Debian: apt-get install \
                 glslc libvulkan-dev spirv-headers):\n{}",
                text.lines()
                    .filter(|l| l.contains("Error") || l.contains("error"))
                    .take(5)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    } else {
        run(&mut configure, "cmake (configure; is cmake installed?)")?;
    }
    let jobs = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .to_string();
    let log = root.join("build.log");
    let mut make = Command::new("cmake");
    make.arg("--build")
        .arg(&build)
        .args(["--config", "Release", "-j", &jobs, "--target"])
        .args(BINARIES)
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::fs::File::options().append(true).open(&log)?);
    let status = make.status().context("running cmake --build")?;
    if !status.success() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let first = text
            .lines()
            .find(|l| l.contains("error:"))
            .unwrap_or("(no compiler error line; see the log)");
        bail!(
            "llama.cpp ({flavor:?}) did not build{}: {first}\nfull log: {}",
            if flavor == Flavor::Vulkan {
                format!(" with this machine's Vulkan headers ({})", vulkan_headers())
            } else {
                String::new()
            },
            log.display()
        );
    }
    std::fs::create_dir_all(&bin)?;
    for name in BINARIES {
        std::fs::copy(build.join("bin").join(name), bin.join(name))
            .with_context(|| format!("copying {name}"))?;
    }
    println!("built {}", bin.display());
    Ok(())
}

/// The Vulkan headers' version (`VK_HEADER_VERSION` in `vulkan_core.h`), as `1.3.239`.
fn vulkan_headers() -> String {
    let path = Path::new("/usr/include/vulkan/vulkan_core.h");
    let Ok(text) = std::fs::read_to_string(path) else {
        return format!("no {}", path.display());
    };
    let patch = text
        .lines()
        .find_map(|l| l.strip_prefix("#define VK_HEADER_VERSION "))
        .map(str::trim);
    let complete = text
        .lines()
        .find_map(|l| l.strip_prefix("#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, "))
        .map(|v| {
            v.split(',')
                .take(2)
                .map(str::trim)
                .collect::<Vec<_>>()
                .join(".")
        });
    match (complete, patch) {
        (Some(c), Some(p)) => format!("{c}.{p}, {}", path.display()),
        _ => path.display().to_string(),
    }
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
