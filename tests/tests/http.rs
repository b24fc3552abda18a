//! The OpenAI-compatible front door over real sockets, beside gRPC on the same engine: greedy
//! text equal to gRPC's, streaming as OpenAI clients parse it, `n` with a seed, stop strings,
//! logprobs, every error status (400 naming the field, 401, 404, 413, 429, 503), a dropped
//! stream freeing its KV blocks within a step, an error after the SSE headers, and the shared
//! metrics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kiln_server::pb;
use kiln_tests::http::{SseStream, get, post, post_with};
use kiln_tests::{Options, TestServer, greedy};
use serde_json::{Value, json};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// The chunks' JSON, and whether the stream ended with `[DONE]`.
async fn read_chunks(s: &mut SseStream) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    while let Some(d) = s.next_data().await {
        if d == "[DONE]" {
            assert!(s.next_data().await.is_none(), "events after [DONE]");
            return (out, true);
        }
        out.push(serde_json::from_str(&d).unwrap_or_else(|e| panic!("{e}: {d}")));
    }
    (out, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_text_over_http_equals_grpc_and_follows_openais_schema() {
    let t = TestServer::start(Options::default()).await;
    let http = t.http_addr();
    let mut g = t.generation();

    // Completions: a text prompt and the same prompt as token ids.
    let grpc = g
        .generate(greedy("Once upon a time", 12))
        .await
        .unwrap()
        .into_inner();
    let want = &grpc.outputs[0].text;
    assert!(want.starts_with(", the city of Nova Haven"), "{want:?}");
    let r = post(
        http,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.headers.get("content-type").unwrap(),
        "application/json",
        "{:?}",
        r.headers
    );
    let c = r.json();
    assert_eq!(c["object"], "text_completion");
    assert!(c["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(c["model"], MODEL);
    assert!(c["created"].as_u64().unwrap() > 1_700_000_000);
    assert!(
        c["system_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("kiln-")
    );
    assert_eq!(c["choices"][0]["index"], 0);
    assert_eq!(c["choices"][0]["text"], *want);
    assert_eq!(c["choices"][0]["finish_reason"], "length");
    assert_eq!(c["choices"][0]["logprobs"], Value::Null);
    assert_eq!(
        c["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    let ids = post(
        http,
        "/v1/completions",
        &json!({"prompt": [6403, 1980, 253, 655], "max_tokens": 12, "temperature": 0}),
    )
    .await
    .json();
    assert_eq!(ids["choices"][0]["text"], *want, "{ids}");

    // Chat: the same messages through the model's template on both front doors.
    let msgs = [("user", "What is the capital of France?")];
    let chat_grpc = g
        .generate(pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
                messages: msgs
                    .iter()
                    .map(|(role, content)| pb::ChatMessage {
                        role: (*role).into(),
                        content: (*content).into(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })),
            ..greedy("", 16)
        })
        .await
        .unwrap()
        .into_inner();
    let r = post(
        http,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": msgs[0].1}],
                "max_tokens": 16, "temperature": 0, "user": "tests", "some_future_field": {"x": 1},
                "response_format": {"type": "text"}, "tool_choice": "auto"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let c = r.json();
    assert_eq!(c["object"], "chat.completion");
    assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        c["choices"][0]["message"]["content"],
        chat_grpc.outputs[0].text
    );
    assert_eq!(
        c["usage"]["prompt_tokens"],
        chat_grpc.usage.unwrap().prompt_tokens
    );
    // Content as an array of text parts renders as the string does.
    let parts = post(
        http,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": [{"type": "text", "text": msgs[0].1}]}],
                "max_completion_tokens": 16, "temperature": 0}),
    )
    .await
    .json();
    assert_eq!(
        parts["choices"][0]["message"]["content"],
        c["choices"][0]["message"]["content"]
    );

    // Models, version, health.
    let m = get(http, "/v1/models").await.json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["object"], "model");
    assert_eq!(m["data"][0]["max_model_len"], 2048);
    assert_eq!(get(http, &format!("/v1/models/{MODEL}")).await.status, 200);
    assert_eq!(
        get(http, "/version").await.json()["version"],
        env!("CARGO_PKG_VERSION")
    );
    let h = get(http, "/health").await;
    assert_eq!(
        (h.status, h.json()["status"].clone()),
        (200, json!("serving"))
    );
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_end_with_done_and_a_usage_chunk_and_match_whole_answers() {
    let t = TestServer::start(Options::default()).await;
    let http = t.http_addr();
    let body = json!({"messages": [{"role": "user", "content": "Tell me a joke."}],
                      "max_tokens": 20, "temperature": 0});
    let whole = post(http, "/v1/chat/completions", &body).await.json();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let mut s = SseStream::open(http, "/v1/chat/completions", &streamed).await;
    assert_eq!(s.status, 200);
    assert!(
        s.headers
            .get("content-type")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let (chunks, done) = read_chunks(&mut s).await;
    assert!(done, "no [DONE]");
    let id = chunks[0]["id"].clone();
    let mut text = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert!(
            c.get("usage").is_some(),
            "usage must be present (null) on every chunk: {c}"
        );
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (last, body_chunks) = chunks.split_last().unwrap();
    for c in body_chunks {
        assert_eq!(c["usage"], Value::Null);
        text.push_str(c["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!(text, whole["choices"][0]["message"]["content"]);
    let finish = &body_chunks.last().unwrap()["choices"][0];
    assert_eq!(
        finish["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert_eq!(last["choices"], json!([]));
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][k], whole["usage"][k], "{k}");
    }
    // The second run of the same prompt found its full blocks in the prefix cache.
    assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], 32);

    // Without include_usage no chunk has a usage field; completions stream the same way.
    let mut s = SseStream::open(
        http,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": true}),
    )
    .await;
    let (chunks, done) = read_chunks(&mut s).await;
    assert!(done);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, ", the city of Nova Haven was a");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_with_a_seed_stop_strings_logprobs_and_several_prompts() {
    let t = TestServer::start(Options::default()).await;
    let http = t.http_addr();

    // n = 2, seeded: two choices, the same again on a second call.
    let body = json!({"prompt": "The best food is", "n": 2, "seed": 7, "temperature": 0.8,
                      "max_tokens": 10});
    let a = post(http, "/v1/completions", &body).await.json();
    let b = post(http, "/v1/completions", &body).await.json();
    let texts = |c: &Value| -> Vec<(u64, String)> {
        c["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| {
                (
                    x["index"].as_u64().unwrap(),
                    x["text"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    assert_eq!(texts(&a).len(), 2, "{a}");
    assert_eq!(texts(&a)[0].0, 0);
    assert_eq!(texts(&a)[1].0, 1);
    assert_eq!(texts(&a), texts(&b));
    assert_eq!(a["usage"]["completion_tokens"], 20);

    // A stop string inside the greedy continuation ends it there, left out of the text.
    let s = post(
        http,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stop": [" Nova"]}),
    )
    .await
    .json();
    assert_eq!(s["choices"][0]["text"], ", the city of");
    assert_eq!(s["choices"][0]["finish_reason"], "stop");
    assert_eq!(s["choices"][0]["stop_reason"], " Nova");

    // Chat logprobs: one entry per token, the top alternatives, the sampled token first.
    let c = post(
        http,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    )
    .await
    .json();
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4, "{c}");
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], e["token"]);
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(
            e["bytes"].as_array().unwrap().len(),
            e["token"].as_str().unwrap().len()
        );
    }
    // Completions logprobs: parallel arrays.
    let c = post(
        http,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "logprobs": 1}),
    )
    .await
    .json();
    let lp = &c["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3, "{c}");
    assert_eq!(lp["text_offset"], json!([0, 1, 5]));
    assert_eq!(
        lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect::<String>(),
        c["choices"][0]["text"].as_str().unwrap()
    );

    // Two prompts, n = 2: choices 0-1 belong to the first prompt, 2-3 to the second.
    let m = post(
        http,
        "/v1/completions",
        &json!({"prompt": ["Once upon a time", "The capital of France is"], "n": 2,
                "max_tokens": 4, "temperature": 0}),
    )
    .await
    .json();
    let got = texts(&m);
    assert_eq!(got.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!(got[0].1, ", the city of");
    assert_eq!(got[0].1, got[1].1);
    assert_ne!(got[2].1, got[0].1);
    assert_eq!(m["usage"]["prompt_tokens"], 4 + 5);
    t.shutdown().await;
}

/// lm-eval's log-likelihood request (`local-completions`): token-id prompts, `echo`,
/// `max_tokens: 1`, `logprobs: 1`; each choice's arrays hold every prompt token (the first
/// `null`), then the generated one. The values are vLLM's `prompt_logprobs` and gRPC's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_prompts_as_lm_eval_reads_them() {
    let t = TestServer::start(Options::default()).await;
    let http = t.http_addr();
    let mut ids = Vec::new();
    for text in ["The capital of France is Paris", "Once upon a time"] {
        let r = post(
            http,
            "/tokenize",
            &json!({"model": MODEL, "prompt": text, "add_special_tokens": false}),
        )
        .await
        .json();
        assert_eq!(r["count"], r["tokens"].as_array().unwrap().len());
        assert!(r["max_model_len"].as_u64().unwrap() > 0);
        let back = post(http, "/detokenize", &json!({"tokens": r["tokens"]}))
            .await
            .json();
        assert_eq!(back["prompt"], text);
        ids.push(r["tokens"].clone());
    }
    let body = json!({"model": MODEL, "prompt": ids, "temperature": 0, "max_tokens": 1,
                      "logprobs": 1, "seed": 1234, "echo": true});
    let r = post(http, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let c = r.json();
    let choices = c["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (k, (choice, ids)) in choices.iter().zip(&ids).enumerate() {
        assert_eq!(choice["index"], k);
        let n = ids.as_array().unwrap().len();
        let lp = &choice["logprobs"];
        let (toks, lps, tops) = (&lp["tokens"], &lp["token_logprobs"], &lp["top_logprobs"]);
        assert_eq!(toks.as_array().unwrap().len(), n + 1, "{choice}");
        assert_eq!((&lps[0], &tops[0]), (&Value::Null, &Value::Null));
        let text: String = toks
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(choice["text"], text);
        for i in 1..=n {
            let own = lps[i].as_f64().unwrap();
            let top = tops[i].as_object().unwrap();
            // The token itself, and the most likely one: `is_greedy` compares the two.
            assert_eq!(top[toks[i].as_str().unwrap()].as_f64(), Some(own));
            let best = top
                .values()
                .map(|v| v.as_f64().unwrap())
                .fold(f64::MIN, f64::max);
            assert!(own <= best && own <= 0.0);
        }
        // The generated token is the greedy one: its own logprob is the best.
        let best = tops[n]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap());
        assert_eq!(best.fold(f64::MIN, f64::max), lps[n].as_f64().unwrap());
    }
    assert_eq!(c["usage"]["completion_tokens"], 2);

    // max_tokens 0: the prompt alone, with vLLM's prompt_logprobs holding the same values.
    let first = &ids[0];
    let r = post(
        http,
        "/v1/completions",
        &json!({"prompt": first, "max_tokens": 0, "echo": true, "logprobs": 1,
                "prompt_logprobs": 2}),
    )
    .await
    .json();
    let only = &r["choices"][0];
    assert_eq!(only["text"], "The capital of France is Paris");
    assert_eq!(only["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 0);
    let pl = only["prompt_logprobs"].as_array().unwrap();
    let lps = &choices[0]["logprobs"]["token_logprobs"];
    assert_eq!(pl.len(), first.as_array().unwrap().len());
    assert_eq!(pl[0], Value::Null);
    for (i, id) in first.as_array().unwrap().iter().enumerate().skip(1) {
        let pos = pl[i].as_object().unwrap();
        let own = &pos[&id.to_string()];
        assert_eq!(own["logprob"], lps[i], "position {i}");
        assert!(own["rank"].as_u64().unwrap() >= 1);
        assert!(pos.len() <= 3, "the token and two alternatives: {pos:?}");
        assert!(pos.values().any(|v| v["rank"] == 1));
    }
    // gRPC's prompt_logprobs: the same numbers.
    let mut g = t.generation();
    let mut req = greedy("The capital of France is Paris", 1);
    req.output = Some(pb::OutputOptions {
        prompt_logprobs: Some(0),
        ..Default::default()
    });
    let got = g.generate(req).await.unwrap().into_inner();
    assert_eq!(got.prompt_logprobs.len(), pl.len() - 1);
    for (i, p) in got.prompt_logprobs.iter().enumerate() {
        assert_eq!(f64::from(p.logprob), lps[i + 1].as_f64().unwrap());
    }

    // Streamed, the choice's first chunk starts with the prompt.
    let mut s = SseStream::open(
        http,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0,
                "echo": true, "stream": true}),
    )
    .await;
    let (chunks, done) = read_chunks(&mut s).await;
    assert!(done);
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or_default())
        .collect();
    assert!(
        chunks[0]["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Once upon a time"),
        "{chunks:?}"
    );
    assert_eq!(text, "Once upon a time, the");

    // /tokenizer_info: what lm-eval's remote tokenizer reads.
    let info = get(http, "/tokenizer_info").await.json();
    assert_eq!(info["eos_token"], "<|im_end|>");
    assert!(
        info["chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>")
    );
    assert!(info["model_max_length"].as_u64().unwrap() > 0);
    // /tokenize's chat form is the prompt chat completions runs.
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let n = post(http, "/tokenize", &json!({"messages": msgs}))
        .await
        .json()["count"]
        .clone();
    let c = post(
        http,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 1, "prompt_logprobs": 0}),
    )
    .await
    .json();
    assert_eq!(c["usage"]["prompt_tokens"], n);
    assert_eq!(
        c["prompt_logprobs"].as_array().unwrap().len() as u64,
        n.as_u64().unwrap()
    );
    let kv = t.wait_until_idle(Duration::from_secs(10)).await;
    assert_eq!(kv.used_blocks, 0);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_naming_the_field() {
    let t = TestServer::start(Options::default()).await;
    let http = t.http_addr();
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases: Vec<(&str, &str, Vec<u8>, u16, Value)> = vec![
        ("not JSON", "/v1/chat/completions", b"{\"messages\": [".to_vec(), 400, Value::Null),
        ("not an object", "/v1/completions", b"[1, 2]".to_vec(), 400, Value::Null),
        ("missing messages", "/v1/chat/completions", b"{}".to_vec(), 400, json!("messages")),
        ("missing prompt", "/v1/completions", b"{\"max_tokens\": 2}".to_vec(), 400, json!("prompt")),
        (
            "wrong type",
            "/v1/chat/completions",
            chat(json!({"temperature": "hot"})).to_string().into_bytes(),
            400,
            json!("temperature"),
        ),
        (
            "out of range",
            "/v1/chat/completions",
            chat(json!({"temperature": -1})).to_string().into_bytes(),
            400,
            json!("temperature"),
        ),
        (
            "top_p",
            "/v1/completions",
            json!({"prompt": "x", "top_p": 0}).to_string().into_bytes(),
            400,
            json!("top_p"),
        ),
        (
            "no messages",
            "/v1/chat/completions",
            json!({"messages": []}).to_string().into_bytes(),
            400,
            json!("messages"),
        ),
        (
            "bad role",
            "/v1/chat/completions",
            json!({"messages": [{"role": "robot", "content": "x"}]}).to_string().into_bytes(),
            400,
            json!("messages[0].role"),
        ),
        (
            "image part",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
                .to_string()
                .into_bytes(),
            400,
            json!("messages[0].content[0].type"),
        ),
        (
            "max_tokens over the context",
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 100000}).to_string().into_bytes(),
            400,
            json!("max_tokens"),
        ),
        (
            "prompt over the context",
            "/v1/completions",
            json!({"prompt": vec![504; 3000]}).to_string().into_bytes(),
            400,
            json!("prompt"),
        ),
        (
            "prompt plus max_tokens over the context",
            "/v1/completions",
            json!({"prompt": vec![504; 2000], "max_tokens": 100}).to_string().into_bytes(),
            400,
            json!("max_tokens"),
        ),
        (
            // Refused by its size, before the tokenizer spends seconds and gigabytes on it.
            "prompt text too long for any tokenization to fit",
            "/v1/completions",
            json!({"prompt": "hello ".repeat(600_000)}).to_string().into_bytes(),
            400,
            json!("prompt"),
        ),
        (
            "chat text too long for any tokenization to fit",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hello ".repeat(600_000)}]})
                .to_string()
                .into_bytes(),
            400,
            json!("messages"),
        ),
        (
            "token id outside the vocabulary",
            "/v1/completions",
            json!({"prompt": [504, 49152]}).to_string().into_bytes(),
            400,
            json!("prompt"),
        ),
        (
            "logprobs above the limit",
            "/v1/completions",
            json!({"prompt": "x", "echo": true, "logprobs": 1000}).to_string().into_bytes(),
            400,
            json!("logprobs"),
        ),
        (
            "a prompt_logprobs above the limit",
            "/v1/chat/completions",
            chat(json!({"prompt_logprobs": 1000})).to_string().into_bytes(),
            400,
            json!("prompt_logprobs"),
        ),
        (
            "echo with n > 1 and streaming",
            "/v1/completions",
            json!({"prompt": "x", "echo": true, "n": 2, "stream": true}).to_string().into_bytes(),
            400,
            json!("echo"),
        ),
        (
            "an empty text prompt with echo",
            "/v1/completions",
            json!({"prompt": "", "echo": true}).to_string().into_bytes(),
            400,
            json!("prompt"),
        ),
        (
            "an empty prompt list",
            "/v1/completions",
            json!({"prompt": []}).to_string().into_bytes(),
            400,
            json!("prompt"),
        ),
        (
            "prompt scored over the context",
            "/v1/completions",
            json!({"prompt": vec![504; 3000], "echo": true, "max_tokens": 0, "logprobs": 1})
                .to_string()
                .into_bytes(),
            400,
            json!("prompt"),
        ),
        (
            "a batch with one token id outside the vocabulary",
            "/v1/completions",
            json!({"prompt": [[504, 505], [504, 49152]], "echo": true, "max_tokens": 0})
                .to_string()
                .into_bytes(),
            400,
            json!("prompt"),
        ),
        (
            "max_tokens 0 with nothing to score",
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}).to_string().into_bytes(),
            400,
            json!("max_tokens"),
        ),
        (
            "detokenize outside the vocabulary",
            "/detokenize",
            json!({"tokens": [504, 49152]}).to_string().into_bytes(),
            400,
            json!("tokens"),
        ),
        (
            "tokenize for an unknown model",
            "/tokenize",
            json!({"model": "gpt-4o", "prompt": "x"}).to_string().into_bytes(),
            404,
            json!("model"),
        ),
        (
            "n = 0",
            "/v1/completions",
            json!({"prompt": "x", "n": 0}).to_string().into_bytes(),
            400,
            json!("n"),
        ),
        (
            "stop of the wrong shape",
            "/v1/completions",
            json!({"prompt": "x", "stop": 5}).to_string().into_bytes(),
            400,
            json!("stop"),
        ),
        (
            "logit_bias key",
            "/v1/completions",
            json!({"prompt": "x", "logit_bias": {"abc": 1}}).to_string().into_bytes(),
            400,
            json!("logit_bias"),
        ),
        (
            "top_logprobs without logprobs",
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 2})).to_string().into_bytes(),
            400,
            json!("top_logprobs"),
        ),
        (
            "stream_options without stream",
            "/v1/completions",
            json!({"prompt": "x", "stream_options": {"include_usage": true}}).to_string().into_bytes(),
            400,
            json!("stream_options"),
        ),
        (
            "an unknown response_format",
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "xml"}})).to_string().into_bytes(),
            400,
            json!("response_format.type"),
        ),
        (
            "a schema llguidance refuses",
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}))
            .to_string()
            .into_bytes(),
            400,
            json!("response_format.json_schema.schema"),
        ),
        (
            "a bad regex",
            "/v1/completions",
            json!({"prompt": "x", "structured_outputs": {"regex": "[a-"}})
                .to_string()
                .into_bytes(),
            400,
            json!("structured_outputs.regex"),
        ),
        (
            "a forced tool call",
            "/v1/chat/completions",
            chat(json!({"tool_choice": "required"})).to_string().into_bytes(),
            400,
            json!("tool_choice"),
        ),
        (
            "unknown model",
            "/v1/chat/completions",
            chat(json!({"model": "gpt-4o"})).to_string().into_bytes(),
            404,
            json!("model"),
        ),
        ("unknown route", "/v1/embeddings", b"{}".to_vec(), 404, Value::Null),
        (
            "oversized body",
            "/v1/completions",
            json!({"prompt": "x".repeat(5 << 20)}).to_string().into_bytes(),
            413,
            Value::Null,
        ),
    ];
    for (what, path, body, status, param) in cases {
        let r = post_with(http, path, body, &[]).await;
        assert_eq!(r.status, status, "{what}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["param"], param, "{what}: {e}");
        let msg = e["message"].as_str().unwrap();
        assert!(!msg.is_empty(), "{what}");
        if let Some(p) = param.as_str() {
            assert!(msg.contains(p), "{what}: {msg}");
        }
        if what.starts_with("prompt") || what.contains("too long") {
            // The words clients and routers match on to tell a context overflow.
            assert!(msg.contains("maximum context length"), "{what}: {msg}");
        }
        assert!(
            e.get("type").is_some() && e.get("code").is_some(),
            "{what}: {e}"
        );
    }
    // A method the route does not take.
    assert_eq!(get(http, "/v1/completions").await.status, 405);
    // Still serving, nothing leaked.
    let ok = post(
        http,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let kv = t.wait_until_idle(Duration::from_secs(10)).await;
    assert_eq!(kv.used_blocks, 0);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_loading_and_a_full_queue() {
    // Before a model is attached: 503 everywhere work is asked, /health says loading.
    let mut opts = Options {
        max_num_seqs: 1,
        max_waiting: 1,
        ..Options::default()
    };
    opts.server.api.api_key = Some("s3cret".into());
    let t = TestServer::bind(opts.server.clone()).await;
    let http = t.http_addr();
    let h = get(http, "/health").await;
    assert_eq!(
        (h.status, h.json()["status"].clone()),
        (503, json!("loading"))
    );
    let auth = [("authorization", "Bearer s3cret")];
    let hi = json!({"prompt": "Hello", "max_tokens": 2}).to_string();
    let r = post_with(http, "/v1/completions", hi.clone().into_bytes(), &auth).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "server_error");
    let engine = tokio::task::spawn_blocking(move || kiln_tests::start_engine(&opts))
        .await
        .unwrap();
    t.server.attach(engine).await.unwrap();
    assert_eq!(get(http, "/health").await.status, 200);

    // The key: /v1/ needs it; health, version and metrics stay open.
    let r = post_with(http, "/v1/completions", hi.clone().into_bytes(), &[]).await;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let wrong = [("authorization", "Bearer nope")];
    assert_eq!(
        post_with(http, "/v1/completions", hi.clone().into_bytes(), &wrong)
            .await
            .status,
        401
    );
    assert_eq!(get(http, "/metrics").await.status, 200);
    let r = post_with(http, "/v1/completions", hi.clone().into_bytes(), &auth).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.headers.contains_key("x-request-id"));

    // One running, one waiting, the next refused with 429.
    let long = json!({"prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": true,
                      "stream": true})
    .to_string();
    let open = |body: String| async move {
        let resp = SseStream::open_with(http, "/v1/completions", body.into_bytes(), &auth).await;
        assert_eq!(resp.status, 200);
        resp
    };
    let mut running = open(long.clone()).await;
    running.next_data().await.expect("first token");
    let waiting = open(long.clone()).await;
    let engine = t.server.engine().unwrap().clone();
    while engine.stats().await.unwrap().waiting != 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = post_with(http, "/v1/completions", hi.clone().into_bytes(), &auth).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    drop(running);
    drop(waiting);
    // (GetModelInfo would need the key too: ask the engine.)
    let idle = async {
        loop {
            let s = engine.stats().await.unwrap();
            if s.requests == 0 && s.kv.used_blocks == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), idle)
        .await
        .expect("idle after the streams were dropped");
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_aborts_within_one_step_and_frees_its_blocks() {
    let t = TestServer::start(Options::default()).await;
    let http = t.http_addr();
    let engine = t.server.engine().unwrap().clone();
    let long = json!({"prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": true,
                      "stream": true});
    let mut s = SseStream::open(http, "/v1/completions", &long).await;
    for _ in 0..2 {
        s.next_data().await.expect("a chunk");
    }
    let before = engine.stats().await.unwrap().steps;
    drop(s);
    let after = loop {
        let st = engine.stats().await.unwrap();
        if st.requests == 0 {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    // The server learns of the close when its next chunk's write fails: one step to produce
    // that chunk, the step in flight, and the abort before the next.
    assert!(
        after.steps <= before + 3,
        "{} steps after the drop",
        after.steps - before
    );
    assert_eq!(after.kv.used_blocks, 0);

    // A whole (non-streamed) call whose client gives up is aborted too.
    let call = tokio::spawn(async move {
        post(
            http,
            "/v1/completions",
            &json!({"prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": true}),
        )
        .await
    });
    while engine.stats().await.unwrap().running != 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    call.abort();
    let kv = t.wait_until_idle(Duration::from_secs(10)).await;
    assert_eq!((kv.used_blocks, kv.running_requests), (0, 0));
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_after_the_headers_is_an_error_event_and_metrics_are_shared() {
    let opts = Options {
        // The drain cancels at once whatever is still running.
        drain_timeout: Duration::ZERO,
        ..Options::default()
    };
    let t = TestServer::start(opts).await;
    let http = t.http_addr();
    let mut g = t.generation();
    g.generate(greedy("Hello", 2)).await.unwrap();
    post(
        http,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    post(
        http,
        "/v1/completions",
        &json!({"prompt": "Hello", "top_p": 5}),
    )
    .await;

    // The same exposition on the HTTP port as on the metrics listener, with both protocols.
    let text = get(http, "/metrics").await.body;
    for want in [
        r#"kiln_api_requests_total{protocol="grpc",endpoint="/kiln.v1.Generation/Generate",code="Ok"} 1"#,
        r#"kiln_api_requests_total{protocol="http",endpoint="/v1/completions",code="200"} 1"#,
        r#"kiln_api_requests_total{protocol="http",endpoint="/v1/completions",code="400"} 1"#,
        // The warm-up's 2 tokens, gRPC's 2 and HTTP's 2.
        "kiln_generation_tokens_total 6",
    ] {
        assert!(text.contains(want), "{want} missing from\n{text}");
    }
    let other = t.metrics().await;
    assert!(other.contains("kiln_generation_tokens_total 6"));
    assert!(text.ends_with("# EOF\n"));

    let mut s = SseStream::open(
        http,
        "/v1/completions",
        &json!({"prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": true, "stream": true}),
    )
    .await;
    s.next_data().await.expect("a chunk");
    let shutdown = async {
        t.shutdown().await;
    };
    let read = async {
        let rest = s.rest().await;
        let last = rest.last().cloned().unwrap_or_default();
        let e: Value = serde_json::from_str(&last).unwrap_or_else(|_| panic!("{rest:?}"));
        assert_eq!(e["error"]["type"], "server_error", "{e}");
        assert!(!rest.contains(&"[DONE]".to_owned()));
    };
    tokio::join!(shutdown, read);
}
