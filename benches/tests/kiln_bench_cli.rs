//! The `kiln-bench` command line as `cargo xtask bench` runs it: help, and bad flags refused
//! before any work starts.

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
