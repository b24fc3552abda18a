//! What a kiln test looks like with the testkit: the same op on every device under test (the
//! CPU reference backend first, then the wgpu adapter, which must exist unless
//! `KILN_TEST_ALLOW_NO_GPU=1` opts out), each held to the CPU reference's result, on a tiny
//! fixture checkpoint's reference logits; and where the default model is looked for.
//!
//! `cargo run --release -p kiln-testkit --example every_device`

use std::process::ExitCode;

use kiln_tensor::{Recorder, Tensor};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("every_device example: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // The tiny fixtures: one HF folder per architecture, with transformers' reference logits.
    for arch in ["llama3", "mistral", "qwen2", "qwen3", "gemma3"] {
        let dir = kiln_testkit::tiny_model_dir(arch);
        if !dir.join("config.json").is_file() || !dir.join("reference.json").is_file() {
            return Err(format!("{}: the tiny {arch} fixture is incomplete", dir.display()).into());
        }
    }
    println!(
        "tiny fixtures: {}",
        kiln_testkit::tiny_model_dir("").display()
    );
    // The first row of the llama3 fixture's reference logits, as the input of the check.
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        kiln_testkit::tiny_model_dir("llama3").join("reference.json"),
    )?)?;
    let row: Vec<f32> = reference["logits"][0]
        .as_array()
        .ok_or("reference.json: no `logits` rows")?
        .iter()
        .map(|v| {
            v.as_f64()
                .map(|x| x as f32)
                .ok_or("a logit is not a number")
        })
        .collect::<Result<_, _>>()?;

    // Every device under test: ("cpu", ..) first, then ("wgpu", ..). Without an adapter this
    // panics (a test fails loudly) unless KILN_TEST_ALLOW_NO_GPU=1.
    let mut want: Option<Vec<f32>> = None;
    for (name, dev) in kiln_testkit::devices() {
        let x = Tensor::from_f32(&dev, &[1, row.len()], &row)?;
        let mut rec = Recorder::new(&dev);
        let y = rec.softmax(&x)?;
        rec.submit()?;
        let got = y.to_f32_vec()?;
        let Some(reference) = &want else {
            let sum: f32 = got.iter().sum();
            println!(
                "{name:>4} ({}): softmax of {} logits, the reference (sums to {sum:.6})",
                dev.info().name,
                row.len()
            );
            want = Some(got);
            continue;
        };
        let err = got
            .iter()
            .zip(reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!(
            "{name:>4} ({}): softmax of {} logits, max error against cpu {err:.1e}",
            dev.info().name,
            row.len()
        );
        if err > 1e-5 {
            return Err(format!("{name}: softmax off the CPU reference by {err}").into());
        }
    }

    // The default model: tests that need it fail, never skip, when it is missing.
    match kiln_testkit::default_model_path() {
        Ok(p) => println!("default model: {}", p.display()),
        Err(e) => println!("default model: {e}"),
    }
    Ok(())
}
