//! Shared test setup: the default model file and the devices under test.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod golden;

use std::path::PathBuf;
use std::sync::OnceLock;

use kiln_tensor::{BackendChoice, Device, DeviceOptions};

pub const DEFAULT_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$KILN_MODEL_DIR` or `<workspace>/models`; fails loudly when the model is missing.
pub fn model_path() -> PathBuf {
    let dir = std::env::var_os("KILN_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"));
    let p = dir.join(DEFAULT_GGUF);
    assert!(
        p.exists(),
        "{} is missing: run `cargo xtask fetch-model` (or set KILN_MODEL_DIR)",
        p.display()
    );
    p
}

/// The CPU reference and, unless explicitly opted out, the wgpu adapter.
pub fn devices() -> Vec<(&'static str, Device)> {
    static G: OnceLock<Option<Device>> = OnceLock::new();
    let g = G.get_or_init(|| {
        match Device::new(&DeviceOptions {
            backend: BackendChoice::Wgpu,
            ..DeviceOptions::default()
        }) {
            Ok(d) => Some(d),
            Err(e) if std::env::var("KILN_TEST_ALLOW_NO_GPU").as_deref() == Ok("1") => {
                eprintln!("WARNING: no wgpu adapter ({e}); only the CPU backend is tested");
                None
            }
            Err(e) => panic!(
                "no wgpu adapter: {e}; install mesa-vulkan-drivers or set KILN_TEST_ALLOW_NO_GPU=1"
            ),
        }
    });
    let mut v = vec![("cpu", Device::cpu())];
    v.extend(g.clone().map(|d| ("wgpu", d)));
    v
}
