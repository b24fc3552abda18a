//! `--compare llama-cpp`: the single-stream scenario through llama-cpp-python (llama.cpp's
//! CPU backend) on the same GGUF, prompt and thread count, for kiln/llama.cpp ratios.
//! llama-cpp-python is not a dependency of kiln: it is used when importable.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// Prefill of the prompt in one `eval` (the first token greedily from its logits), then
/// `new - 1` single-token `eval`s, each followed by a greedy pick. Reads its job as JSON on
/// stdin, prints one JSON line.
const SCRIPT: &str = r#"
import json, sys, time
import llama_cpp

cfg = json.load(sys.stdin)
ids, new, threads = cfg["prompt_ids"], cfg["new_tokens"], cfg["threads"]
llm = llama_cpp.Llama(
    model_path=cfg["model"], n_threads=threads, n_threads_batch=threads,
    n_ctx=cfg["n_ctx"], n_batch=cfg["n_batch"], n_gpu_layers=0,
    verbose=False, logits_all=False,
)
n_vocab = llm.n_vocab()
try:
    import numpy as np
except ImportError:
    np = None

def last_logits():
    # The low-level API first (recent versions keep no scores without logits_all), then what
    # older versions filled in.
    for get in (
        lambda: llama_cpp.llama_get_logits_ith(llm.ctx, -1),
        lambda: llama_cpp.llama_get_logits(llm.ctx),
    ):
        try:
            ptr = get()
            if ptr:
                return ptr
        except Exception:
            pass
    return llm._scores[-1, :]

def greedy():
    row = last_logits()
    if np is not None:
        a = row if isinstance(row, np.ndarray) else np.ctypeslib.as_array(row, shape=(n_vocab,))
        return int(np.argmax(a))
    best, best_i = None, 0
    for i in range(n_vocab):
        if best is None or row[i] > best:
            best, best_i = row[i], i
    return best_i

# Warm-up (buffers, thread pool), then start from an empty context.
llm.eval(ids[:16])
greedy()
llm.reset()

t0 = time.perf_counter()
llm.eval(ids)
tok = greedy()
t1 = time.perf_counter()
out, gaps, prev = [tok], [], t1
for _ in range(new - 1):
    llm.eval([tok])
    tok = greedy()
    now = time.perf_counter()
    gaps.append(now - prev)
    prev = now
    out.append(tok)
info = ""
try:
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
except Exception:
    pass
print(json.dumps({
    "version": getattr(llama_cpp, "__version__", "unknown"),
    "system_info": info,
    "ttft_s": t1 - t0,
    "decode_s": prev - t1,
    "gaps_s": gaps,
    "token_ids": out,
}))
"#;

#[derive(Debug, Deserialize)]
struct RawResult {
    version: String,
    system_info: String,
    ttft_s: f64,
    decode_s: f64,
    gaps_s: Vec<f64>,
    token_ids: Vec<u32>,
}

/// llama.cpp's single stream, and kiln's over it.
#[derive(Debug, Clone, Serialize)]
pub struct LlamaCpp {
    pub python: String,
    pub version: String,
    pub system_info: String,
    pub threads: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub ttft_ms: f64,
    pub prefill_tokens_per_s: f64,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub decode_tokens_per_s: Option<f64>,
    /// kiln's prefill tokens/s over llama.cpp's.
    pub kiln_prefill_ratio: Option<f64>,
    /// kiln's decode tokens/s over llama.cpp's.
    pub kiln_decode_ratio: Option<f64>,
    /// Leading generated tokens on which the two greedy continuations agree.
    pub matching_leading_tokens: usize,
}

/// The interpreter: `$KILN_PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("KILN_PYTHON")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// `Err` with the reason and how to fix it when `llama_cpp` cannot be imported.
pub fn check_importable(python: &str) -> anyhow::Result<()> {
    let out = Command::new(python)
        .args(["-c", "import llama_cpp"])
        .stdin(Stdio::null())
        .output();
    let hint = "install it with `pip install llama-cpp-python` (it builds llama.cpp from source), \
                or point KILN_PYTHON at an interpreter that has it";
    match out {
        Err(e) => bail!("cannot run {python} ({e}); {hint}"),
        Ok(o) if !o.status.success() => {
            let err = String::from_utf8_lossy(&o.stderr);
            let last = err.lines().last().unwrap_or("").trim();
            bail!("{python} cannot import llama_cpp ({last}); {hint}")
        }
        Ok(_) => Ok(()),
    }
}

/// Runs a llama-cpp-python `script` (it reads `job` as JSON on stdin and prints its result as
/// its last JSON line) and reads that result.
pub fn run_script<R: serde::de::DeserializeOwned>(
    python: &str,
    script: &str,
    job: &serde_json::Value,
) -> anyhow::Result<R> {
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {python}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(job.to_string().as_bytes())
            .context("writing the job to llama-cpp-python")?;
    }
    let out = child
        .wait_with_output()
        .context("waiting for llama-cpp-python")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(6).collect();
        bail!(
            "llama-cpp-python exited with {}: {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    }
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("llama-cpp-python printed no result")?;
    serde_json::from_str(line).context("reading llama-cpp-python's result")
}

/// Runs the script; `kiln` is kiln's single stream on the same prompt.
pub fn run(
    python: &str,
    model: &Path,
    prompt_ids: &[u32],
    new_tokens: usize,
    threads: usize,
    kiln: &crate::scenarios::Single,
) -> anyhow::Result<LlamaCpp> {
    let job = serde_json::json!({
        "model": model,
        "prompt_ids": prompt_ids,
        "new_tokens": new_tokens,
        "threads": threads,
        "n_ctx": (prompt_ids.len() + new_tokens + 64).max(2048),
        "n_batch": prompt_ids.len().clamp(1, 512),
    });
    let r: RawResult = run_script(python, SCRIPT, &job)?;
    let mut gaps: Vec<std::time::Duration> = r
        .gaps_s
        .iter()
        .map(|&s| std::time::Duration::from_secs_f64(s.max(0.0)))
        .collect();
    gaps.sort_unstable();
    let prefill = prompt_ids.len() as f64 / r.ttft_s.max(1e-9);
    let decode = (r.decode_s > 0.0).then(|| new_tokens.saturating_sub(1) as f64 / r.decode_s);
    let matching = kiln
        .token_ids
        .iter()
        .zip(&r.token_ids)
        .take_while(|(a, b)| a == b)
        .count();
    Ok(LlamaCpp {
        python: python.to_owned(),
        version: r.version,
        system_info: r.system_info,
        threads,
        prompt_tokens: prompt_ids.len(),
        new_tokens,
        ttft_ms: r.ttft_s * 1e3,
        prefill_tokens_per_s: prefill,
        itl_p50_ms: crate::stats::pct_ms(&gaps, 50),
        itl_p99_ms: crate::stats::pct_ms(&gaps, 99),
        decode_tokens_per_s: decode,
        kiln_prefill_ratio: crate::scenarios::ratio(kiln.prefill_tokens_per_s, Some(prefill)),
        kiln_decode_ratio: crate::scenarios::ratio(kiln.decode_tokens_per_s, decode),
        matching_leading_tokens: matching,
    })
}
