//! What the scenarios load: the in-process engine or a running server over gRPC. Both take a
//! token-id prompt, decode greedily with EOS ignored, and time each token's arrival; the
//! speculative scenario's chat jobs stop at EOS and turn speculation on or off per request.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_engine::{
    Built, Checkpoint, EngineHandle, EngineOptions, Event, KvSize, Request, ShutdownMode,
    SpecStats, SpeculativeConfig,
};
use kiln_model::{LoadOptions, ModelSource};
use kiln_server::pb;
use kiln_server::pb::generation_client::GenerationClient;
use kiln_server::pb::models_client::ModelsClient;
use kiln_tensor::Device;
use kiln_tokenizer::{ChatMessage, ChatOptions, Tokenizer};
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::stats::Sample;

/// One request of a scenario.
#[derive(Debug, Clone)]
pub struct Job {
    pub ids: Vec<u32>,
    pub new_tokens: usize,
}

/// One request of the speculative scenario: `user` as the one user message of the model's
/// chat template, greedy, ending at EOS or after `new_tokens`, drafting only if `speculate`.
#[derive(Debug, Clone)]
pub struct ChatJob {
    pub user: String,
    pub new_tokens: usize,
    pub speculate: bool,
}

/// Where requests go.
#[derive(Debug, Clone)]
pub enum Target {
    Engine(EngineHandle),
    Grpc(GenerationClient<Channel>),
}

/// Engine sizing for the in-process target.
#[derive(Debug, Clone, Copy)]
pub struct EngineSizing {
    pub kv_blocks: u32,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_waiting: usize,
    pub prefix_caching: bool,
    /// Configured only for the speculative scenario; the other scenarios' requests turn it off.
    pub speculative: Option<SpeculativeConfig>,
}

impl EngineSizing {
    /// These limits on `device` (`draft`: the draft model of the speculative scenario).
    fn options(&self, device: &Device, draft: Option<&Path>) -> EngineOptions {
        EngineOptions {
            kv_size: KvSize::Blocks(self.kv_blocks),
            prefix_caching: self.prefix_caching,
            max_num_seqs: Some(self.max_num_seqs),
            max_num_batched_tokens: Some(self.max_num_batched_tokens),
            max_waiting: Some(self.max_waiting),
            speculative: self.speculative,
            draft_model: draft.map(Path::to_path_buf),
            ..EngineOptions::new(device.clone())
        }
    }
}

/// Opens `path` (a `.gguf` file or an HF folder): its config and tokenizer, weights not yet
/// loaded.
pub fn open(path: &Path) -> anyhow::Result<Checkpoint> {
    // These errors name the file; `{:#}` prints their causes.
    Checkpoint::open(path, LoadOptions::default()).map_err(anyhow::Error::new)
}

/// Whether `c` is a GGUF file (llama.cpp can only load those).
pub fn is_gguf(c: &Checkpoint) -> bool {
    c.files()
        .is_some_and(|f| matches!(f.source(), ModelSource::Gguf(_)))
}

/// Uploads `checkpoint` to `device` and starts an engine sized by `s`, drafting with the model
/// at `draft` if given (built as `kiln serve` builds its engine).
pub fn start_engine(
    checkpoint: Checkpoint,
    device: &Device,
    s: &EngineSizing,
    draft: Option<&Path>,
) -> anyhow::Result<Built> {
    kiln_engine::build(checkpoint, &s.options(device, draft), &mut |_, _| {})
        .context("starting the engine")
}

/// `user` as the one user message of the model's chat template, the assistant's turn opened
/// (as `kiln serve` renders a chat prompt).
pub fn chat_text(tok: &Tokenizer, user: &str) -> anyhow::Result<String> {
    tok.apply_chat_template(
        &[ChatMessage::new("user", user)],
        &ChatOptions {
            add_generation_prompt: true,
        },
    )
    .map_err(|e| anyhow::anyhow!("the model's chat template: {e}"))
}

/// Connects to `addr` (`host:port`, with or without `http://`) and reads the served model's
/// facts.
pub async fn connect(addr: &str) -> anyhow::Result<(GenerationClient<Channel>, pb::ModelInfo)> {
    let uri = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let channel = Channel::from_shared(uri.clone())
        .with_context(|| format!("--grpc {addr}: not a valid address"))?
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .with_context(|| format!("--grpc {addr}: cannot connect (is `kiln serve` running?)"))?;
    let info = ModelsClient::new(channel.clone())
        .get_model_info(pb::GetModelInfoRequest::default())
        .await
        .with_context(|| format!("--grpc {addr}: Models.GetModelInfo"))?
        .into_inner();
    Ok((GenerationClient::new(channel), info))
}

impl Target {
    /// Runs one request to its end.
    pub async fn run(&self, job: Job) -> anyhow::Result<Sample> {
        match self {
            Target::Engine(e) => run_engine(e, job).await,
            Target::Grpc(c) => run_grpc(c.clone(), job).await,
        }
    }

    /// Runs one chat job to its end (EOS or `new_tokens`).
    pub async fn run_chat(&self, job: &ChatJob) -> anyhow::Result<Sample> {
        match self {
            Target::Engine(e) => {
                let mut r = Request::text(chat_text(e.tokenizer(), &job.user)?)
                    .max_new_tokens(job.new_tokens);
                r.speculate = job.speculate;
                let submitted = Instant::now();
                let stream = e.submit(r).context("submitting a request")?;
                collect_engine(stream, 0, job.new_tokens, submitted).await
            }
            Target::Grpc(c) => {
                let req = pb::GenerateRequest {
                    prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
                        messages: vec![pb::ChatMessage {
                            role: "user".into(),
                            content: job.user.clone(),
                            ..Default::default()
                        }],
                        ..Default::default()
                    })),
                    stopping: Some(pb::StoppingCriteria {
                        max_new_tokens: Some(u32::try_from(job.new_tokens).unwrap_or(u32::MAX)),
                        ..Default::default()
                    }),
                    speculative: Some(job.speculate),
                    ..grpc_request()
                };
                grpc_stream(c.clone(), req, 0, job.new_tokens).await
            }
        }
    }

    /// Submits every job at once and waits for all of them; samples in job order.
    pub async fn run_all(&self, jobs: Vec<Job>) -> anyhow::Result<Vec<Sample>> {
        let mut set = JoinSet::new();
        match self {
            // Submit all first (submission is synchronous), so they arrive together.
            Target::Engine(e) => {
                let mut streams = Vec::with_capacity(jobs.len());
                for (i, job) in jobs.into_iter().enumerate() {
                    let submitted = Instant::now();
                    let stream = e.submit(request(&job)).context("submitting a request")?;
                    streams.push((i, job, submitted, stream));
                }
                for (i, job, submitted, stream) in streams {
                    set.spawn(async move {
                        let s = collect_engine(stream, job.ids.len(), job.new_tokens, submitted)
                            .await?;
                        check_count(&s, &job)?;
                        Ok((i, s))
                    });
                }
            }
            Target::Grpc(c) => {
                for (i, job) in jobs.into_iter().enumerate() {
                    let c = c.clone();
                    set.spawn(async move { run_grpc(c, job).await.map(|s| (i, s)) });
                }
            }
        }
        let mut out = Vec::with_capacity(set.len());
        while let Some(joined) = set.join_next().await {
            out.push(joined.context("a request task failed")??);
        }
        out.sort_by_key(|(i, _)| *i);
        Ok(out.into_iter().map(|(_, s)| s).collect())
    }

    /// Drains and stops an in-process engine.
    pub async fn shutdown(&self) {
        if let Target::Engine(e) = self {
            e.shutdown(ShutdownMode::Drain).await;
        }
    }
}

/// Plain decoding: the engine speculates (when configured) for the speculative scenario only.
fn request(job: &Job) -> Request {
    let mut r = Request::tokens(job.ids.clone()).max_new_tokens(job.new_tokens);
    r.stopping.ignore_eos = true;
    r.speculate = false;
    r
}

async fn run_engine(e: &EngineHandle, job: Job) -> anyhow::Result<Sample> {
    let submitted = Instant::now();
    let stream = e.submit(request(&job)).context("submitting a request")?;
    let s = collect_engine(stream, job.ids.len(), job.new_tokens, submitted).await?;
    check_count(&s, &job)?;
    Ok(s)
}

/// Reads a request's events into a sample (`prompt` is a placeholder until the summary).
pub async fn collect_engine(
    mut stream: kiln_engine::RequestStream,
    prompt: usize,
    new_tokens: usize,
    submitted: Instant,
) -> anyhow::Result<Sample> {
    let mut s = Sample::new(submitted, prompt, new_tokens);
    while let Some(ev) = stream.recv().await {
        let now = Instant::now();
        match ev {
            Event::Delta(d) => {
                s.token_times.extend(d.token_ids.iter().map(|_| now));
                s.token_ids.extend(&d.token_ids);
            }
            Event::PromptLogprobs(_) => {}
            Event::Finished(sum) => {
                s.prompt_tokens = sum.usage.prompt_tokens;
                s.cached_prompt_tokens = sum.usage.cached_prompt_tokens;
                s.server_ttft = Some(sum.timing.time_to_first_token);
                s.spec = sum.timing.speculative;
                return Ok(s);
            }
            Event::Error(err) => return Err(err).context("the engine ended a request"),
        }
    }
    bail!("the engine closed a request's stream without a final event")
}

/// Greedy, token ids returned; the caller fills in the prompt and the stopping criteria.
fn grpc_request() -> pb::GenerateRequest {
    pb::GenerateRequest {
        sampling: Some(pb::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        // Count ids, not text: a text delta is empty while a character is incomplete.
        output: Some(pb::OutputOptions {
            return_token_ids: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn run_grpc(client: GenerationClient<Channel>, job: Job) -> anyhow::Result<Sample> {
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
            ids: job.ids.clone(),
        })),
        stopping: Some(pb::StoppingCriteria {
            max_new_tokens: Some(u32::try_from(job.new_tokens).unwrap_or(u32::MAX)),
            ignore_eos: true,
            ..Default::default()
        }),
        ..grpc_request()
    };
    let s = grpc_stream(client, req, job.ids.len(), job.new_tokens).await?;
    check_count(&s, &job)?;
    Ok(s)
}

/// Streams `req` into a sample (`prompt` is a placeholder until the usage arrives).
async fn grpc_stream(
    mut client: GenerationClient<Channel>,
    req: pb::GenerateRequest,
    prompt: usize,
    new_tokens: usize,
) -> anyhow::Result<Sample> {
    let submitted = Instant::now();
    let mut stream = client
        .generate_stream(req)
        .await
        .context("GenerateStream")?
        .into_inner();
    let mut s = Sample::new(submitted, prompt, new_tokens);
    while let Some(msg) = stream.message().await.context("GenerateStream")? {
        let now = Instant::now();
        for o in &msg.outputs {
            s.token_times.extend(o.token_ids.iter().map(|_| now));
            s.token_ids.extend(&o.token_ids);
        }
        if let Some(u) = msg.usage {
            s.prompt_tokens = u.prompt_tokens as usize;
            s.cached_prompt_tokens = u.cached_prompt_tokens as usize;
        }
        if let Some(t) = msg.timing {
            s.server_ttft = Some(Duration::from_nanos(t.time_to_first_token_ns));
            s.spec = SpecStats {
                proposed_tokens: t.spec_proposed_tokens,
                accepted_tokens: t.spec_accepted_tokens,
                verify_steps: t.spec_verify_steps,
            };
        }
    }
    Ok(s)
}

fn check_count(s: &Sample, job: &Job) -> anyhow::Result<()> {
    if s.token_ids.len() != job.new_tokens {
        bail!(
            "a request asked for {} tokens and got {} (prompt {} tokens): is the context too short?",
            job.new_tokens,
            s.token_ids.len(),
            job.ids.len()
        );
    }
    Ok(())
}

/// kiln's gRPC and HTTP (OpenAI and Anthropic) front doors on loopback over the bench's engine, as `kiln
/// serve` runs them (one `Serving` for both).
#[derive(Debug)]
pub struct FrontDoors {
    server: kiln_server::Server,
    http: kiln_http::HttpServer,
    grpc: GenerationClient<Channel>,
    model: String,
    /// The engine's, for the HTTP doors that take text prompts.
    tokenizer: Tokenizer,
}

/// Binds both front doors on `127.0.0.1:0`, attaches `engine` (its warm-up request) and
/// connects a gRPC client.
pub async fn front_doors(engine: EngineHandle) -> anyhow::Result<FrontDoors> {
    let model = "kiln-bench".to_owned();
    let tokenizer = engine.tokenizer().clone();
    let serving = std::sync::Arc::new(kiln_api::Serving::new(kiln_api::ServingConfig::default()));
    let local = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let server = kiln_server::Server::bind_with(
        local,
        None,
        kiln_server::ServerConfig::new(model.clone()),
        serving.clone(),
    )
    .await
    .context("binding kiln's gRPC front door")?;
    let http = kiln_http::HttpServer::bind(local, serving, kiln_api::ApiConfig::new(model.clone()))
        .await
        .context("binding kiln's HTTP front door")?;
    server
        .attach(engine)
        .await
        .context("attaching the engine to the front doors")?;
    let (grpc, _) = connect(&server.local_addr().to_string()).await?;
    Ok(FrontDoors {
        server,
        http,
        grpc,
        model,
        tokenizer,
    })
}

impl FrontDoors {
    pub fn grpc_door(&self) -> crate::serve::Door {
        crate::serve::Door::Grpc(self.grpc.clone())
    }

    /// The HTTP front door's `api`.
    pub fn http_door(&self, api: crate::serve::Api) -> crate::serve::Door {
        crate::serve::Door::Http {
            addr: self.http.local_addr(),
            model: self.model.clone(),
            api,
            tokenizer: Some(self.tokenizer.clone()),
        }
    }

    /// Closes both; this drains the engine (as `kiln serve` does on SIGTERM), so it comes
    /// after everything else that uses it.
    pub async fn close(self) {
        self.http.shutdown().await;
        self.server.shutdown().await;
    }
}
