//! vLLM's `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`: a prompt (or a
//! chat, rendered exactly as chat completions renders it) to the token ids the engine would
//! run, ids back to text, and the tokenizer's special tokens and chat template. With the three,
//! a client needs no tokenizer files of its own (lm-eval's `tokenizer_backend=remote`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use kiln_engine::{EngineHandle, Prompt};
use kiln_tokenizer::{DecodeOptions, EncodeOptions};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::convert;
use crate::error::{Door, ErrorReply};
use crate::openai::{ChatRequest, Common};
use crate::server::{App, body, fields, off_the_workers, unavailable};

/// `/tokenize` with a `prompt`.
#[derive(Debug, Deserialize)]
struct TokenizePrompt {
    model: Option<String>,
    prompt: String,
    /// BOS/EOS as the model's tokenizer adds them (default true, as vLLM).
    add_special_tokens: Option<bool>,
}

#[derive(Debug, Serialize)]
struct Tokens {
    tokens: Vec<u32>,
    count: usize,
    max_model_len: usize,
}

/// `/tokenizer_info`: what a client needs to tokenize as the server does, through it.
#[derive(Debug, Serialize)]
struct TokenizerInfo {
    tokenizer_class: &'static str,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    /// The template chat prompts are rendered with (`--chat-template`, else the model's).
    chat_template: Option<String>,
    model_max_length: usize,
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

#[derive(Debug, Serialize)]
struct Detokenized {
    prompt: String,
}

/// `POST /tokenize`: `{model, prompt, add_special_tokens}` or a chat completion's
/// `{model, messages, ...}` → `{tokens, count, max_model_len}`.
pub(crate) async fn tokenize(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Response, ErrorReply> {
    let (v, engine) = body_and_engine(&app, req).await?;
    off_the_workers(app.clone(), move |app| {
        let (tok, info) = (engine.tokenizer(), engine.info());
        let tokens = if v.get("messages").is_some() {
            let (common, chat): (Common, ChatRequest) = (fields(&v)?, fields(&v)?);
            let plan = convert::chat(&chat, &common, "tokenize", tok, info, &app.cfg)?;
            match plan.requests.into_iter().next().map(|r| r.prompt) {
                Some(Prompt::TokenIds(ids)) => ids,
                Some(Prompt::Text(t)) => tok.encode(&t).map_err(untokenizable)?,
                None => return Err(ErrorReply::internal("the chat rendered no prompt")),
            }
        } else {
            let body: TokenizePrompt = fields(&v)?;
            app.cfg
                .check_model(body.model.as_deref())
                .map_err(convert::core(Door::Completions, None))?;
            let options = EncodeOptions {
                add_special_tokens: body.add_special_tokens.unwrap_or(true),
                ..EncodeOptions::default()
            };
            tok.encode_with(&body.prompt, options)
                .map_err(untokenizable)?
                .ids
        };
        Ok(axum::Json(Tokens {
            count: tokens.len(),
            tokens,
            max_model_len: info.max_model_len,
        })
        .into_response())
    })
    .await
}

/// `GET /tokenizer_info`.
pub(crate) async fn tokenizer_info(State(app): State<Arc<App>>) -> Result<Response, ErrorReply> {
    let engine = app
        .serving
        .loaded()
        .map_err(unavailable(Door::Completions))?;
    let (tok, info) = (engine.tokenizer(), engine.info());
    let spelled = |id: Option<u32>| id.and_then(|id| tok.id_to_token(id));
    let template = match &app.cfg.chat_template {
        Some(t) => Some(t.source().to_owned()),
        None => tok.chat_template().map(|t| t.source().to_owned()),
    };
    Ok(axum::Json(TokenizerInfo {
        tokenizer_class: "PreTrainedTokenizerFast",
        bos_token: spelled(info.bos),
        eos_token: spelled(info.eos_ids.first().copied()),
        pad_token: None,
        chat_template: template,
        model_max_length: info.max_model_len,
    })
    .into_response())
}

/// The request's JSON body and the engine it is for (refused while none is loaded).
async fn body_and_engine(app: &App, req: Request) -> Result<(Value, EngineHandle), ErrorReply> {
    let v = body(req, app.cfg.max_request_bytes).await?;
    let engine = app
        .serving
        .loaded()
        .map_err(unavailable(Door::Completions))?;
    Ok((v, engine.clone()))
}

fn untokenizable(e: kiln_tokenizer::TokenizerError) -> ErrorReply {
    ErrorReply::invalid("prompt", format!("cannot be tokenized: {e}"))
}

/// `POST /detokenize`: `{model, tokens}` → `{prompt}` (special tokens kept).
pub(crate) async fn detokenize(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Response, ErrorReply> {
    let (v, engine) = body_and_engine(&app, req).await?;
    let body: DetokenizeRequest = fields(&v)?;
    app.cfg
        .check_model(body.model.as_deref())
        .map_err(convert::core(Door::Completions, None))?;
    let vocab = engine.info().vocab_size;
    if let Some(bad) = body.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ErrorReply::invalid(
            "tokens",
            format!("token id {bad} is outside the vocabulary (0..{vocab})"),
        ));
    }
    let keep = DecodeOptions {
        skip_special_tokens: false,
    };
    let prompt = engine
        .tokenizer()
        .decode_with(&body.tokens, keep)
        .map_err(|e| ErrorReply::invalid("tokens", format!("cannot be decoded: {e}")))?;
    Ok(axum::Json(Detokenized { prompt }).into_response())
}
