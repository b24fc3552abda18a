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
            test: match (r.n_gen, r.n_depth) {
                (0, 0) => format!("pp{}", r.n_prompt),
                (0, d) => format!("pp{} @ d{d}", r.n_prompt),
                (n, 0) => format!("tg{n}"),
                (n, d) => format!("tg{n} @ d{d}"),
            },
            mean: r.avg_ts,
            std: r.stddev_ts,
        })
        .collect()
}

/// A row's rate as a ratio to llama.cpp's row of the same test (`pp512`, `tg128`; llama's
/// decode rows name their depth, `tg128 @ d512`), where there is one and this row is not it.
pub fn vs_llama(row: &Row, rows: &[Row]) -> Option<f64> {
    let kind = |t: &str| t.split(" @").next().unwrap_or(t).to_owned();
    if row.backend.starts_with("llama.cpp") {
        return None;
    }
    rows.iter()
        .find(|o| o.backend.starts_with("llama.cpp") && kind(&o.test) == kind(&row.test))
        .map(|o| row.mean / o.mean)
}

pub fn print(rows: &[Row]) {
    println!("| model | size | params | backend | threads | test | t/s | vs llama.cpp |");
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |");
    for r in rows {
        println!(
            "| {} | {:.2} MiB | {:.2} M | {} | {} | {} | {:.2} ± {:.2} | {} |",
            r.model,
            r.size_bytes as f64 / (1u64 << 20) as f64,
            r.params as f64 / 1e6,
            r.backend,
            r.threads,
            r.test,
            r.mean,
            r.std,
            vs_llama(r, rows).map_or(String::new(), |x| format!("{x:.2}x"))
        );
    }
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row as this llama-bench build writes it (`-p 0 -n 4 -d 8 -o json`, fields kiln reads),
    /// and one from a build before `-d` (no `n_depth`).
    #[test]
    fn llama_bench_rows_name_their_depth() {
        let with: BenchRow = serde_json::from_str(
            r#"{"model_type":"llama 256M Q4_1","model_size":96576768,"model_n_params":134515008,
            "backends":"CPU","n_threads":2,"n_prompt":0,"n_gen":4,"n_depth":8,
            "avg_ts":90.776695,"stddev_ts":0.0,"build_commit":"0c1e570"}"#,
        )
        .unwrap();
        let mut older = with.clone();
        older.n_depth = 0;
        older.n_gen = 0;
        older.n_prompt = 512;
        let rows = llama_rows(&[with, older]);
        assert_eq!(rows[0].test, "tg4 @ d8");
        assert_eq!(rows[0].backend, "llama.cpp CPU");
        assert_eq!(rows[1].test, "pp512");
        let no_depth: BenchRow = serde_json::from_str(
            r#"{"model_type":"m","model_size":1,"model_n_params":1,"backends":"CPU",
            "n_threads":2,"n_prompt":0,"n_gen":128,"avg_ts":1.0,"stddev_ts":0.0}"#,
        )
        .unwrap();
        assert_eq!(llama_rows(&[no_depth])[0].test, "tg128");
    }

    #[test]
    fn kiln_rows_are_put_against_llama_rows_of_the_same_test() {
        let row = |backend: &str, test: &str, mean: f64| Row {
            model: "m".into(),
            size_bytes: 1,
            params: 1,
            backend: backend.into(),
            threads: "2".into(),
            test: test.into(),
            mean,
            std: 0.0,
        };
        let rows = [
            row("kiln wgpu", "pp512", 300.0),
            row("kiln wgpu", "tg128", 50.0),
            row("kiln wgpu", "pp64", 1.0),
            row("llama.cpp Vulkan", "pp512", 200.0),
            row("llama.cpp Vulkan", "tg128 @ d512", 100.0),
        ];
        assert_eq!(vs_llama(&rows[0], &rows), Some(1.5));
        assert_eq!(vs_llama(&rows[1], &rows), Some(0.5));
        assert_eq!(
            vs_llama(&rows[2], &rows),
            None,
            "no llama.cpp row of that test"
        );
        assert_eq!(vs_llama(&rows[3], &rows), None, "llama.cpp's own row");
    }
}
