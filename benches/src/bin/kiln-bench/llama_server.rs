//! `--compare llama-server`: llama.cpp's own `llama-server` (continuous batching, `-np`
//! slots) and `llama-bench` on the same GGUF, CPU backend, as built by
//! `cargo xtask llama-cpp` from the llama.cpp that the `llama-cpp-python` sdist vendors.
//! Neither is a dependency of kiln: the binaries are looked up in `--llama-cpp-dir`.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// A running `llama-server`, killed when dropped.
#[derive(Debug)]
pub struct LlamaServer {
    child: Child,
    pub addr: SocketAddr,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The flags that put `gpu_layers` layers on llama.cpp's GPU backend, with flash attention
/// (its faster attention there); none for its CPU backend.
fn gpu_flags(gpu_layers: Option<usize>) -> Vec<String> {
    gpu_layers.map_or_else(Vec::new, |n| {
        vec!["-ngl".into(), n.to_string(), "-fa".into(), "on".into()]
    })
}

/// The binary `name` in `dir`, or why not.
fn binary(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let p = dir.join(name);
    if !p.is_file() {
        bail!(
            "{} not found (build it with `cargo xtask llama-cpp`, or pass --llama-cpp-dir)",
            p.display()
        );
    }
    Ok(p)
}

impl LlamaServer {
    /// Starts `llama-server` on a free loopback port with `slots` parallel slots of `ctx`
    /// tokens each and `threads` threads (`gpu_layers` on its GPU backend), and waits until
    /// its `/health` answers 200. Its log goes to `log`.
    pub async fn start(
        dir: &Path,
        model: &Path,
        threads: usize,
        gpu_layers: Option<usize>,
        slots: usize,
        ctx: usize,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let bin = binary(dir, "llama-server")?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(&bin)
            .args(["-m"])
            .arg(model)
            .args(["-t", &threads.to_string(), "-tb", &threads.to_string()])
            // -c is shared by the slots.
            .args(["-np", &slots.to_string(), "-c", &(slots * ctx).to_string()])
            .args(gpu_flags(gpu_layers))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut server = Self { child, addr };
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "llama-server exited ({status}) before it served; see {}",
                    log.display()
                );
            }
            if health(addr).await {
                return Ok(server);
            }
            if Instant::now() > deadline {
                bail!(
                    "llama-server not healthy after 300 s; see {}",
                    log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// Whether `GET /health` answers 200.
async fn health(addr: SocketAddr) -> bool {
    use http_body_util::{BodyExt, Empty};
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let Ok((mut sender, conn)) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await
    else {
        return false;
    };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let Ok(req) = http::Request::get("/health")
        .header("host", addr.to_string())
        .body(Empty::<bytes::Bytes>::new())
    else {
        return false;
    };
    match sender.send_request(req).await {
        Ok(resp) => {
            let ok = resp.status().as_u16() == 200;
            let _ = resp.into_body().collect().await;
            ok
        }
        Err(_) => false,
    }
}

/// One `llama-bench -o json` result.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct BenchRow {
    pub model_type: String,
    pub model_size: u64,
    pub model_n_params: u64,
    pub backends: String,
    pub n_threads: usize,
    pub n_prompt: usize,
    pub n_gen: usize,
    /// Tokens already in the context when the test starts (`-d`; older builds lack it).
    #[serde(default)]
    pub n_depth: usize,
    pub avg_ts: f64,
    pub stddev_ts: f64,
    #[serde(default)]
    pub build_commit: String,
}

/// What one llama-bench run measures: `pp` prompt tokens, `tg` generated tokens, each test
/// after `depth` tokens of context.
#[derive(Debug, Clone, Copy)]
pub struct BenchTests {
    pub pp: usize,
    pub tg: usize,
    pub depth: usize,
}

/// `llama-bench -p pp -n tg -d depth -r reps -t threads -o json` on `model` (`gpu_layers`
/// on its GPU backend).
pub fn llama_bench(
    dir: &Path,
    model: &Path,
    threads: usize,
    gpu_layers: Option<usize>,
    tests: BenchTests,
    reps: usize,
) -> anyhow::Result<Vec<BenchRow>> {
    let bin = binary(dir, "llama-bench")?;
    let out = Command::new(&bin)
        .arg("-m")
        .arg(model)
        .args([
            "-t",
            &threads.to_string(),
            "-p",
            &tests.pp.to_string(),
            "-n",
            &tests.tg.to_string(),
            "-d",
            &tests.depth.to_string(),
        ])
        .args(gpu_flags(gpu_layers))
        .args(["-r", &reps.to_string(), "-o", "json"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "llama-bench exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    serde_json::from_slice(&out.stdout).context("reading llama-bench's JSON")
}
