//! The routes of the doors agents use: OpenAI's Responses API and Anthropic's Messages API.
//! Each call is one assistant turn: rendered through the front doors' shared core, submitted,
//! and answered whole or streamed through [`TurnStream`] with the door's own events.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use kiln_api::echo;
use kiln_engine::{EngineError, EngineHandle, Output, RequestStream};
use serde_json::json;

use crate::anthropic::{self, MessagesRequest, MessagesWriter};
use crate::error::{ConstraintVia, Door, ErrorReply};
use crate::responses::{self, ResponsesRequest};
use crate::responses_out::{self, ResponsesWriter};
use crate::server::{
    App, body, fields, log_done, log_start, off_the_workers, unavailable, unix_now,
};
use crate::turn::TurnStream;

/// The engine for new work, in `door`'s error shape.
fn engine(app: &App, door: Door) -> Result<EngineHandle, ErrorReply> {
    app.serving.for_work().cloned().map_err(unavailable(door))
}

fn submit(
    engine: &EngineHandle,
    r: kiln_engine::Request,
    door: Door,
    via: Option<ConstraintVia>,
) -> Result<RequestStream, ErrorReply> {
    engine
        .submit(r)
        .map_err(|e: EngineError| ErrorReply::from_api(&e.into(), door, via))
}

/// A whole turn's single output, and its usage.
async fn collect(
    events: RequestStream,
    door: Door,
) -> Result<(kiln_engine::SeqOutput, kiln_engine::Usage), ErrorReply> {
    // Dropping this future (the client left) drops the stream: the engine aborts it.
    let out: Output = events
        .collect()
        .await
        .map_err(|e| ErrorReply::from_api(&e.into(), door, None))?;
    let usage = out.usage;
    let first = out.outputs.into_iter().next().unwrap_or_default();
    Ok((first, usage))
}

fn sse<W: crate::turn::Writer>(stream: TurnStream<W>) -> Response {
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// `POST /v1/responses`.
pub(crate) async fn create_response(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Response, ErrorReply> {
    let v = body(req, app.cfg.max_request_bytes).await?;
    let request: ResponsesRequest = fields(&v)?;
    let engine = engine(&app, Door::Responses)?;
    let id = responses_out::hex_id("resp");
    log_start(&id, request.user.as_deref());
    let label = id.clone();
    let (mut plan, events, tokenizer) = off_the_workers(app.clone(), move |app| {
        let tok = engine.tokenizer();
        let mut plan = responses::plan(&request, &label, tok, engine.info(), &app.cfg, &app.store)?;
        let request =
            std::mem::replace(&mut plan.request, kiln_engine::Request::tokens(Vec::new()));
        let events = submit(&engine, request, Door::Responses, plan.via)?;
        Ok((plan, events, tok.clone()))
    })
    .await?;
    let model = app.cfg.model_id().to_owned();
    let ctx = responses_out::Ctx::new(id, &mut plan, model, unix_now(), tokenizer, &app.store);
    if plan.stream {
        let writer = ResponsesWriter::new(ctx);
        return Ok(sse(TurnStream::new(events, plan.reply.stream(), writer)));
    }
    let (out, usage) = collect(events, Door::Responses).await?;
    log_done(&ctx.id, &usage);
    let reply = plan.reply.read(&out.text, out.finish.as_ref());
    let items = responses_out::items(&ctx, &reply);
    Ok(axum::Json(ctx.finished(&reply, items, &usage)).into_response())
}

fn no_response(id: &str) -> ErrorReply {
    ErrorReply::not_found(format!(
        "no stored response `{}` (unknown, deleted or evicted)",
        echo(id)
    ))
}

/// `GET /v1/responses/{id}`.
pub(crate) async fn get_response(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ErrorReply> {
    let r = app.store.response(&id).ok_or_else(|| no_response(&id))?;
    Ok(axum::Json(r).into_response())
}

/// `DELETE /v1/responses/{id}`.
pub(crate) async fn delete_response(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ErrorReply> {
    if !app.store.delete(&id) {
        return Err(no_response(&id));
    }
    Ok(
        axum::Json(json!({"id": id, "object": "response.deleted", "deleted": true}))
            .into_response(),
    )
}

/// A Messages body, read with errors in Anthropic's shape.
async fn messages_body(app: &App, req: Request) -> Result<MessagesRequest, ErrorReply> {
    let v = body(req, app.cfg.max_request_bytes)
        .await
        .map_err(|e| e.shaped_for(Door::Messages))?;
    fields(&v).map_err(|e| e.shaped_for(Door::Messages))
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Response, ErrorReply> {
    let request = messages_body(&app, req).await?;
    let engine = engine(&app, Door::Messages)?;
    let id = format!("msg_{:024x}", rand::random::<u128>() >> 32);
    log_start(&id, None);
    let label = id.clone();
    let (plan, events) = off_the_workers(app.clone(), move |app| {
        let plan = anthropic::plan(
            &request,
            &label,
            engine.tokenizer(),
            engine.info(),
            &app.cfg,
        )?;
        let events = submit(&engine, plan.request.clone(), Door::Messages, plan.via)?;
        Ok((plan, events))
    })
    .await
    .map_err(|e| e.shaped_for(Door::Messages))?;
    let model = app.cfg.model_id().to_owned();
    if plan.stream {
        let writer = MessagesWriter::new(id, model, plan.prompt_tokens);
        return Ok(sse(TurnStream::new(events, plan.reply.stream(), writer)));
    }
    let (out, usage) = collect(events, Door::Messages).await?;
    log_done(&id, &usage);
    let reply = plan.reply.read(&out.text, out.finish.as_ref());
    Ok(axum::Json(anthropic::message(&id, &model, &reply, &usage)).into_response())
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as a create would render it.
pub(crate) async fn count_tokens(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Response, ErrorReply> {
    let request = messages_body(&app, req).await?;
    let engine = app
        .serving
        .loaded()
        .cloned()
        .map_err(unavailable(Door::Messages))?;
    let n = off_the_workers(app.clone(), move |app| {
        anthropic::count(&request, engine.tokenizer(), engine.info(), &app.cfg)
    })
    .await
    .map_err(|e| e.shaped_for(Door::Messages))?;
    Ok(axum::Json(json!({"input_tokens": n})).into_response())
}
