//! `kiln serve` as an operator runs it: the real binary on port 0 (with prompt-lookup
//! speculative decoding on), a real gRPC client, SIGTERM while a stream is in flight (the
//! stream finishes, the process exits 0), an open `Health.Watch` at exit, a second SIGTERM
//! during the drain, and bad flags.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_server::pb;
use kiln_server::pb::generation_client::GenerationClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn model() -> String {
    kiln_testkit::default_model().display().to_string()
}

/// A `kiln serve` child on port 0 (CPU backend, 64 MiB of KV), SERVING.
struct Serve {
    child: Child,
    channel: tonic::transport::Channel,
    http: std::net::SocketAddr,
}

impl Serve {
    async fn start(extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["serve", "--model", &model(), "--backend", "cpu"])
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "off"])
            .args(["--http-listen", "127.0.0.1:0"])
            .args(["--kv-cache-memory", "67108864"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // "kiln: listening on 127.0.0.1:PORT (metrics: off, http: http://127.0.0.1:PORT)"
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .split_whitespace()
            .nth(3)
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_owned();
        let http = line
            .trim_end()
            .trim_end_matches(')')
            .rsplit("http://")
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no HTTP address in {line:?}"));
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        kiln_tests::wait_for_health(&channel, ServingStatus::Serving, Duration::from_secs(120))
            .await;
        Self {
            child,
            channel,
            http,
        }
    }

    fn signal(&self, name: &str) {
        let kill = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
    }

    /// Waits (at most `within`) for the process to exit: its status and its log.
    async fn exit(mut self, within: Duration) -> (std::process::ExitStatus, String) {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > within {
                let _ = self.child.kill();
                panic!("still running {within:?} after the signal");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let mut log = String::new();
        std::io::Read::read_to_string(&mut self.child.stderr.take().unwrap(), &mut log).unwrap();
        (status, log)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_stream_in_flight_and_exits_zero() {
    // Speculating changes no greedy token: the text checked below is plain decoding's.
    let serve = Serve::start(&["--speculative", "ngram"]).await;
    let (channel, http) = (serve.channel.clone(), serve.http);

    // The OpenAI front door serves from the same engine.
    let (code, body) = kiln_tests::http_get(http, "/health").await;
    assert_eq!((code, body.as_str()), (200, r#"{"status":"serving"}"#));

    let mut g = GenerationClient::new(channel);
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(
            "Once upon a time".into(),
        )),
        sampling: Some(pb::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(pb::StoppingCriteria {
            max_new_tokens: Some(32),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = g.generate_stream(req).await.unwrap().into_inner();
    let mut text = String::new();
    let first = stream.message().await.unwrap().expect("first token");
    text.push_str(&first.outputs[0].text);

    serve.signal("TERM");

    let mut last = first;
    while let Some(msg) = stream.message().await.expect("the stream drains") {
        for o in &msg.outputs {
            text.push_str(&o.text);
        }
        last = msg;
    }
    assert_eq!(last.usage.unwrap().completion_tokens, 32);
    let timing = last.timing.unwrap();
    assert!(timing.spec_verify_steps > 0, "never speculated: {timing:?}");
    assert!(text.starts_with(", the city of Nova Haven"), "{text:?}");

    let (status, log) = serve.exit(Duration::from_secs(30)).await;
    assert!(status.success(), "exit {status:?}; log:\n{log}");
    assert!(log.contains("draining"), "{log}");
    assert!(log.contains("server stopped"), "{log}");
}

/// An open `Health.Watch` stream never ends on its own: the shutdown still takes at most
/// `--drain-timeout` plus the one-second close grace (it waited five seconds before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_health_watch_does_not_hold_the_exit() {
    let serve = Serve::start(&["--drain-timeout", "1"]).await;
    let mut health = HealthClient::new(serve.channel.clone());
    let mut watch = health
        .watch(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().expect("the current status");
    assert_eq!(first.status(), ServingStatus::Serving);
    serve.signal("TERM");
    let start = Instant::now();
    let (status, log) = serve.exit(Duration::from_secs(30)).await;
    let took = start.elapsed();
    assert!(status.success(), "exit {status:?}; log:\n{log}");
    // Nothing was in flight: no drain wait, one second of grace, and slack for a busy machine.
    assert!(
        took < Duration::from_millis(3500),
        "took {took:?}; log:\n{log}"
    );
    drop(watch);
}

/// A second SIGTERM during the drain exits at once, non-zero, without waiting for the
/// generation still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_exits_at_once() {
    let serve = Serve::start(&["--drain-timeout", "120"]).await;
    let mut g = GenerationClient::new(serve.channel.clone());
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(
            "Once upon a time".into(),
        )),
        stopping: Some(pb::StoppingCriteria {
            max_new_tokens: Some(1500),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = g.generate_stream(req).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("first token");
    serve.signal("TERM");
    // The first signal is being handled (the drain has begun) once new work is refused.
    let start = Instant::now();
    loop {
        let refused = g
            .generate(kiln_tests::greedy("Hi", 1))
            .await
            .is_err_and(|e| e.code() == tonic::Code::Unavailable);
        if refused {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "never draining");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    serve.signal("TERM");
    let (status, log) = serve.exit(Duration::from_secs(10)).await;
    assert!(!status.success(), "exit {status:?}; log:\n{log}");
    assert!(log.contains("SIGTERM again"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    drop(stream);
}

#[test]
fn serve_refuses_bad_flags_with_one_line() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .args(args)
            .output()
            .unwrap()
    };
    let m = model();
    for (args, needle) in [
        (
            vec!["--model", &m, "--listen", "nowhere"],
            "--listen nowhere",
        ),
        (vec!["--model", &m, "--kv-dtype", "f8"], "--kv-dtype f8"),
        (
            vec!["--model", &m, "--max-num-seqs", "many"],
            "--max-num-seqs many",
        ),
        (
            vec!["--model", "/no/such/model.gguf"],
            "/no/such/model.gguf",
        ),
        (vec!["--listen", "127.0.0.1:0"], "missing --model"),
        (
            vec!["--model", &m, "--http-listen", "nowhere"],
            "--http-listen nowhere",
        ),
        (
            vec!["--model", &m, "--chat-template", "/no/such/template.jinja"],
            "--chat-template /no/such/template.jinja",
        ),
        (
            vec!["--model", &m, "--speculative", "sometimes"],
            "--speculative sometimes",
        ),
        (
            vec![
                "--model",
                &m,
                "--speculative",
                "ngram",
                "--prompt-lookup-min",
                "0",
            ],
            "--prompt-lookup-min/max",
        ),
    ] {
        let o = run(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(
            err.contains(needle),
            "{args:?}: stderr lacks {needle:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}
