#![doc = include_str!("../README.md")]
#![allow(clippy::panic)]

use std::path::PathBuf;
use std::sync::OnceLock;

use kiln_tensor::{BackendChoice, Device, DeviceOptions};

/// The default model's file name (what `cargo xtask fetch-model` fetches).
pub const DEFAULT_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The second model's file name: Gemma 3 270M, Q4_K_M (`cargo xtask fetch-model
/// gemma-3-270m`).
pub const GEMMA3_GGUF: &str = "gemma-3-270m-q4_k_m.gguf";

/// A tiny random-weight checkpoint (an HF folder: `config.json`, safetensors and
/// `reference.json`, the logits `transformers` computes for its token ids), one per
/// architecture: `llama3`, `mistral`, `qwen2`, `qwen3`, `gemma3`. Made by
/// `scripts/make_tiny_fixtures.py`; the crates that test models on it share it from here.
pub fn tiny_model_dir(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tiny")
        .join(arch)
}

/// Where `cargo xtask fetch-model` puts models: `$KILN_MODEL_DIR` or `<workspace>/models`.
pub fn model_dir() -> PathBuf {
    std::env::var_os("KILN_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"))
}

/// The default model is not where the tests look for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingModel {
    pub path: PathBuf,
}

impl std::fmt::Display for MissingModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is missing: run `cargo xtask fetch-model --all` (or set KILN_MODEL_DIR)",
            self.path.display()
        )
    }
}

impl std::error::Error for MissingModel {}

/// The default model's GGUF, or an error saying how to fetch it.
pub fn default_model_path() -> Result<PathBuf, MissingModel> {
    model_path(DEFAULT_GGUF)
}

/// `file` in [`model_dir`], or an error saying how to fetch it.
pub fn model_path(file: &str) -> Result<PathBuf, MissingModel> {
    let path = model_dir().join(file);
    if path.is_file() {
        Ok(path)
    } else {
        Err(MissingModel { path })
    }
}

/// The Gemma 3 model for tests: fails the test when it is missing (never a skip). Panicking
/// is the point, as in [`default_model`]: this crate is only a dev-dependency.
pub fn gemma3_model() -> PathBuf {
    model_path(GEMMA3_GGUF).unwrap_or_else(|e| panic!("{e}"))
}

/// [`default_model_path`] for tests: fails the test when the model is missing. Panicking is
/// the point: this crate is only a dev-dependency, and a missing model must fail, not skip.
pub fn default_model() -> PathBuf {
    default_model_path().unwrap_or_else(|e| panic!("{e}"))
}

/// Opens a wgpu device with `opts` (its backend forced to wgpu). No adapter fails the test
/// unless `KILN_TEST_ALLOW_NO_GPU=1`, which returns `None` with a warning.
pub fn wgpu_device(opts: DeviceOptions) -> Option<Device> {
    let opts = DeviceOptions {
        backend: BackendChoice::Wgpu,
        ..opts
    };
    match Device::new(&opts) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("KILN_TEST_ALLOW_NO_GPU").as_deref() == Ok("1") => {
            eprintln!(
                "WARNING: no wgpu adapter ({e}); KILN_TEST_ALLOW_NO_GPU=1 so only the CPU backend is tested"
            );
            None
        }
        // Fails the calling test on purpose (see the crate docs): never a silent pass.
        Err(e) => panic!(
            "no wgpu adapter: {e}. Install Mesa's Vulkan drivers (mesa-vulkan-drivers) or set \
             KILN_TEST_ALLOW_NO_GPU=1 to opt out explicitly"
        ),
    }
}

/// The default adapter with every optional feature it has, opened once per test binary.
pub fn wgpu() -> Option<Device> {
    static D: OnceLock<Option<Device>> = OnceLock::new();
    D.get_or_init(|| wgpu_device(DeviceOptions::default()))
        .clone()
}

/// The default adapter with the kernel family it would not pick itself forced on (the
/// GPU-shaped kernels on lavapipe), so both families are tested on one machine.
pub fn wgpu_other_kernels() -> Option<Device> {
    static D: OnceLock<Option<Device>> = OnceLock::new();
    D.get_or_init(|| {
        let natural = wgpu()?.cpu_shaped_kernels();
        wgpu_device(DeviceOptions {
            cpu_shaped_kernels: Some(!natural),
            ..DeviceOptions::default()
        })
    })
    .clone()
}

/// The native CPU backend at the best ISA this CPU has (and `KILN_CPU_ISA` allows), a thread
/// a core, opened once per test binary. It fails the calling test when the backend cannot
/// open (a bad `KILN_CPU_ISA`): on purpose, as a missing model or adapter does, since this
/// crate is only a dev-dependency.
pub fn native_cpu() -> Device {
    static D: OnceLock<Device> = OnceLock::new();
    D.get_or_init(|| Device::cpu().unwrap_or_else(|e| panic!("native CPU backend: {e}")))
        .clone()
}

/// The CPU reference, the native CPU backend and (unless explicitly opted out) the shared
/// wgpu device, named.
pub fn devices() -> Vec<(&'static str, Device)> {
    let mut v = vec![("reference", Device::reference()), ("cpu", native_cpu())];
    v.extend(wgpu().map(|d| ("wgpu", d)));
    v
}
