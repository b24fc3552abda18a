//! Chat needs a template: a model without one answers chat with a 400 that says so (while
//! completions work), and `ApiConfig::chat_template` (`--chat-template FILE`) supplies one,
//! rendered as given. The tiny random llama with a byte-level tokenizer has none.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;

use kiln_api::{ApiConfig, Serving, ServingConfig};
use kiln_engine::{Engine, EngineConfig};
use kiln_http::HttpServer;
use kiln_kv::BlockManagerConfig;
use kiln_model::{LoadOptions, Model, ModelFiles};
use kiln_scheduler::SchedulerConfig;
use kiln_tensor::Device;
use kiln_tokenizer::{ChatTemplate, SpecialTokens, Tokenizer};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn server(template: Option<&str>) -> (HttpServer, Arc<Serving>) {
    let dir = kiln_testkit::tiny_model_dir("llama3");
    let files = ModelFiles::open(&dir, LoadOptions::default()).unwrap();
    let model = Model::load(&Device::Reference, files.config().clone(), files.weights()).unwrap();
    let tokenizer = Tokenizer::byte_level(SpecialTokens {
        eos: Some(2),
        ..Default::default()
    })
    .unwrap();
    assert!(tokenizer.chat_template().is_none());
    let cfg = EngineConfig::new(SchedulerConfig::new(BlockManagerConfig::new(64)));
    let serving = Arc::new(Serving::new(ServingConfig::default()));
    let mut http = ApiConfig::new("tiny");
    http.chat_template = template.map(|t| Arc::new(ChatTemplate::new("test", t).unwrap()));
    let server = HttpServer::bind("127.0.0.1:0".parse().unwrap(), serving.clone(), http)
        .await
        .unwrap();
    serving
        .attach(Engine::start(model, tokenizer, cfg).unwrap())
        .await
        .unwrap();
    (server, serving)
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, serde_json::from_str(body).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_template_chat_is_refused_and_completions_work() {
    let (http, _serving) = server(None).await;
    let addr = http.local_addr();
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let (code, body) = post(addr, "/v1/chat/completions", &chat).await;
    assert_eq!(code, 400, "{body}");
    assert_eq!(body["error"]["param"], "messages");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("no chat template") && msg.contains("--chat-template"),
        "{msg}"
    );
    let (code, body) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 3}),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    http.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_template_renders_the_chat_prompt() {
    // Byte-level tokens: the prompt's token count is the rendered text's length in bytes.
    let (http, _serving) = server(Some(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}>",
    ))
    .await;
    let addr = http.local_addr();
    let chat = json!({"messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                {"type": "text", "text": "there"}]}],
                      "max_tokens": 3, "temperature": 0});
    let (code, body) = post(addr, "/v1/chat/completions", &chat).await;
    assert_eq!(code, 200, "{body}");
    let rendered = "<system>be brief<user>hi\nthere>";
    assert_eq!(body["usage"]["prompt_tokens"], rendered.len());
    // The same text as a completion prompt gives the same greedy tokens.
    let (_, completion) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": rendered, "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(
        body["choices"][0]["message"]["content"],
        completion["choices"][0]["text"]
    );
    http.shutdown().await;
}
