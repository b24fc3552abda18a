//! The `kiln-bench` command line as `cargo xtask bench` runs it: help, bad flags refused
//! before any work starts, the profile on wgpu's no-op backend, and `gpu-check`'s refusal of
//! a CPU-type adapter.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Output};

fn kiln_bench(args: &[&str], backend_env: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln-bench"));
    cmd.args(args);
    match backend_env {
        Some(v) => cmd.env("KILN_BACKEND", v),
        None => cmd.env_remove("KILN_BACKEND"),
    };
    cmd.output().unwrap()
}

#[test]
fn help_lists_every_flag_and_exits_0() {
    let o = kiln_bench(&["--help"], None);
    assert!(o.status.success());
    let help = String::from_utf8(o.stdout).unwrap();
    for flag in [
        "--model",
        "--backend",
        "KILN_BACKEND",
        "--grpc",
        "--scenarios",
        "--levels",
        "--prompt-tokens",
        "--new-tokens",
        "--sweep-prompt-tokens",
        "--sweep-new-tokens",
        "--prefix-tokens",
        "--prefix-question-tokens",
        "--prefix-new-tokens",
        "--prefix-requests",
        "--speculative",
        "--draft-model",
        "--num-speculative-tokens",
        "--spec-new-tokens",
        "--threads",
        "--compare",
        "--out",
        "--kv-blocks",
        "--max-num-seqs",
        "--max-batched-tokens",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    assert!(!help.contains("issue"), "{help}");
}

#[test]
fn bad_flags_and_a_bad_kiln_backend_exit_2() {
    for (args, env, needle) in [
        (&["--model", "m", "--bogus"][..], None, "--bogus"),
        (&["--model", "m", "--levels", "1,x"][..], None, "'x'"),
        (&["--model", "m"][..], Some("tpu"), "KILN_BACKEND"),
        (&["--levels", "4"][..], None, "--model"),
    ] {
        let o = kiln_bench(args, env);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: stderr lacks {needle:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// The profile on wgpu's no-op backend (`WGPU_BACKEND=noop WGPU_NOOP_BACKEND=1`): every step
/// is recorded, encoded and submitted and nothing runs, so what it reports is kiln's and wgpu's
/// host time with no driver's. Checks that the path stays open and reports that time.
#[test]
fn the_profile_runs_on_the_no_op_backend_and_reports_host_time() {
    let model = kiln_testkit::default_model();
    let out = std::env::temp_dir().join(format!("kiln-bench-noop-{}", std::process::id()));
    let o = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args(["--model", model.to_str().unwrap(), "--backend", "wgpu"])
        .args(["--scenarios", "profile", "--prompt-tokens", "32", "--out"])
        .arg(&out)
        .env("WGPU_BACKEND", "noop")
        .env("WGPU_NOOP_BACKEND", "1")
        .env_remove("KILN_BACKEND")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("latest.json")).unwrap()).unwrap();
    std::fs::remove_dir_all(&out).ok();
    assert_eq!(report["device"]["backend"], "noop", "{stdout}");
    let decode = report["profile"]["decode"].as_array().unwrap();
    let batches: Vec<u64> = decode
        .iter()
        .map(|s| s["batch"].as_u64().unwrap())
        .collect();
    assert_eq!(batches, [1, 16, 64], "{stdout}");
    for s in decode {
        let launches: f64 = s["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["launches_per_step"].as_f64().unwrap())
            .sum();
        assert!(launches >= 100.0, "{s}");
        for f in ["host_record_ms_per_step", "host_encode_ms_per_step"] {
            assert!(s[f].as_f64().unwrap() > 0.0, "{f}: {s}");
        }
    }
}

/// `gpu-check` reports only from a GPU. On a CPU-type adapter (lavapipe, CI's) it refuses,
/// says why and exits 3; on a GPU, its quick form checks the kernel family and reports.
#[test]
fn gpu_check_refuses_a_cpu_type_adapter_and_checks_a_gpu() {
    let Some(dev) = kiln_testkit::wgpu() else {
        return; // KILN_TEST_ALLOW_NO_GPU=1 opted out, with a warning
    };
    let out = std::env::temp_dir().join(format!("kiln-gpu-check-{}", std::process::id()));
    let o = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args(["gpu-check", "--quick", "--shapes", "smollm2", "--out"])
        .arg(&out)
        .env_remove("KILN_BACKEND")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    if dev.info().device_type == "cpu" {
        assert_eq!(o.status.code(), Some(3), "{stdout}\n{stderr}");
        assert!(
            stderr.contains("refusing to report") && stderr.contains("CPU-type adapter"),
            "{stderr}"
        );
        assert!(
            !out.join("gpu-check.json").exists(),
            "a refusal wrote a report"
        );
    } else {
        assert!(o.status.success(), "{stdout}\n{stderr}");
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("gpu-check.json")).unwrap())
                .unwrap();
        assert_eq!(report["gpu_result"], true, "{stdout}");
        let checks = report["checks"].as_array().unwrap();
        assert!(checks.len() > 100, "{stdout}");
        assert!(checks.iter().all(|c| c["ok"] == true), "{stdout}");
    }
    std::fs::remove_dir_all(&out).ok();
}
