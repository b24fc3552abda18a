//! With no usable adapter, `--backend wgpu` is a clear error and `auto` falls back to the CPU.
//! The test re-runs itself as a child process with `WGPU_BACKEND=gl` (a backend this build does
//! not include), so no environment is changed in a running process.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::too_many_arguments,
    clippy::type_complexity
)]

use kiln_tensor::{BackendChoice, Device, DeviceOptions, TensorError};

const CHILD: &str = "KILN_NO_ADAPTER_CHILD";

#[test]
fn no_adapter_is_an_error_for_wgpu_and_a_fallback_for_auto() {
    if std::env::var(CHILD).is_err() {
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args([
                "no_adapter_is_an_error_for_wgpu_and_a_fallback_for_auto",
                "--exact",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .env("WGPU_BACKEND", "gl")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child failed:\n{text}");
        assert!(
            text.contains("1 passed"),
            "the child ran the checks:\n{text}"
        );
        return;
    }
    let e = Device::new(&DeviceOptions {
        backend: BackendChoice::Wgpu,
        ..DeviceOptions::default()
    })
    .unwrap_err();
    assert!(matches!(e, TensorError::NoAdapter(_)), "{e}");
    assert!(e.to_string().contains("no wgpu adapter"), "{e}");
    let d = Device::new(&DeviceOptions::default()).unwrap();
    assert!(d.is_cpu(), "auto falls back to the CPU backend");
}
