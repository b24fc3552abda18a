//! The llama-bench style table: `| model | size | params | backend | threads | test | t/s |`
//! with `ppN` (prompt processing: prompt tokens / TTFT of the single stream) and `tgN` (text
//! generation: its decode rate), `mean ± std` over `--repetitions` runs; with `--compare
//! llama-server`, llama.cpp's own `llama-bench` rows on the same GGUF beside them.

use serde::Serialize;

use crate::llama_server::BenchRow;
use crate::scenarios::Single;

/// One row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub model: String,
    pub size_bytes: u64,
    pub params: u64,
    pub backend: String,
    pub threads: String,
    pub test: String,
    pub mean: f64,
    pub std: f64,
}

/// Mean and sample standard deviation.
fn mean_std(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n.max(1.0);
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// kiln's rows from repeated single-stream runs.
pub fn kiln_rows(
    runs: &[Single],
    model: &str,
    size_bytes: u64,
    params: u64,
    backend: &str,
    threads: &str,
) -> Vec<Row> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    let pp: Vec<f64> = runs.iter().filter_map(|s| s.prefill_tokens_per_s).collect();
    let tg: Vec<f64> = runs.iter().filter_map(|s| s.decode_tokens_per_s).collect();
    let row = |test: String, v: &[f64]| {
        let (mean, std) = mean_std(v);
        Row {
            model: model.to_owned(),
            size_bytes,
            params,
            backend: backend.to_owned(),
            threads: threads.to_owned(),
            test,
            mean,
            std,
        }
    };
    vec![
        row(format!("pp{}", first.prompt_tokens), &pp),
        row(format!("tg{}", first.new_tokens), &tg),
    ]
}

/// llama-bench's own rows.
pub fn llama_rows(rows: &[BenchRow]) -> Vec<Row> {
    rows.iter()
        .map(|r| Row {
            model: r.model_type.clone(),
            size_bytes: r.model_size,
            params: r.model_n_params,
            backend: format!("llama.cpp {}", r.backends),
            threads: r.n_threads.to_string(),
            test: if r.n_gen > 0 {
                format!("tg{}", r.n_gen)
            } else {
                format!("pp{}", r.n_prompt)
            },
            mean: r.avg_ts,
            std: r.stddev_ts,
        })
        .collect()
}

pub fn print(rows: &[Row]) {
    println!("| model | size | params | backend | threads | test | t/s |");
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: |");
    for r in rows {
        println!(
            "| {} | {:.2} MiB | {:.2} M | {} | {} | {} | {:.2} ± {:.2} |",
            r.model,
            r.size_bytes as f64 / (1u64 << 20) as f64,
            r.params as f64 / 1e6,
            r.backend,
            r.threads,
            r.test,
            r.mean,
            r.std
        );
    }
    println!();
}
