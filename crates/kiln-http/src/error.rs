//! Error answers in each door's own shape, with the HTTP status its clients expect: OpenAI's
//! `{"error": {"message", "type", "param", "code"}}` and Anthropic's `{"type": "error",
//! "error": {"type", "message"}}`. The one place that maps an error kind to a status and a
//! field to each door's body name.

use std::borrow::Cow;

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use kiln_api::{ApiError, ErrorKind, Field, ToolPart};
use kiln_engine::{ConstraintKind, Field as EngineField};
use serde::Serialize;

/// Which endpoint answers: it names the body's fields and picks the error shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Door {
    Chat,
    Completions,
    Responses,
    Messages,
}

/// The shape error bodies take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    OpenAi,
    Anthropic,
}

impl Door {
    pub(crate) fn shape(self) -> Shape {
        match self {
            Self::Messages => Shape::Anthropic,
            _ => Shape::OpenAi,
        }
    }
}

/// Which body field a structured-output constraint came from, so an error about it names
/// that field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConstraintVia {
    ResponseFormat,
    StructuredOutputs,
    ToolChoice,
    /// Responses' `text.format`.
    TextFormat,
    /// Messages' `output_config.format`.
    OutputConfig,
}

/// A field as `door`'s body names it.
pub(crate) fn param(f: Field, door: Door, via: Option<ConstraintVia>) -> Cow<'static, str> {
    use Door::*;
    let s: &'static str = match (f, door) {
        (Field::Engine(EngineField::Constraint(kind)), _) => {
            return constraint_param(kind, via);
        }
        (Field::Engine(e), _) => match (e, door) {
            (EngineField::Prompt | EngineField::PromptTokenIds, Completions) => "prompt",
            (EngineField::Prompt | EngineField::PromptTokenIds, Chat | Messages) => "messages",
            (EngineField::Prompt | EngineField::PromptTokenIds, Responses) => "input",
            (EngineField::MaxNewTokens, Chat | Completions | Messages) => "max_tokens",
            (EngineField::MaxNewTokens, Responses) => "max_output_tokens",
            (EngineField::MinNewTokens, _) => "min_tokens",
            (EngineField::TopLogprobs, Completions) => "logprobs",
            (EngineField::TopLogprobs, _) => "top_logprobs",
            (EngineField::PromptLogprobs, _) => "prompt_logprobs",
            (EngineField::Temperature, _) => "temperature",
            (EngineField::TopP, _) => "top_p",
            (EngineField::MinP, _) => "min_p",
            (EngineField::RepetitionPenalty, _) => "repetition_penalty",
            (EngineField::PresencePenalty, _) => "presence_penalty",
            (EngineField::FrequencyPenalty, _) => "frequency_penalty",
            (EngineField::LogitBias, _) => "logit_bias",
            (EngineField::N, _) => "n",
            (EngineField::Stop, Messages) => "stop_sequences",
            (EngineField::Stop, _) => "stop",
            (EngineField::StopTokenIds, _) => "stop_token_ids",
            (EngineField::Constraint(_), _) => "constraint",
        },
        (Field::Model, _) => "model",
        (Field::Messages, Responses) => "input",
        (Field::Messages, _) => "messages",
        (Field::Message { index, part }, Responses) => {
            return format!("input[{index}].{}", part.name()).into();
        }
        (Field::Message { index, part }, _) => {
            return format!("messages[{index}].{}", part.name()).into();
        }
        (Field::Tool { index, part }, Chat) => {
            return format!("tools[{index}].function.{}", part.name()).into();
        }
        (Field::Tool { index, part }, _) => {
            let part = match (part, door) {
                (ToolPart::Parameters, Messages) => "input_schema",
                (part, _) => part.name(),
            };
            return format!("tools[{index}].{part}").into();
        }
        (Field::ToolChoice, _) => "tool_choice",
        (Field::MaxTokens, Responses) => "max_output_tokens",
        (Field::MaxTokens, _) => "max_tokens",
    };
    s.into()
}

fn constraint_param(kind: ConstraintKind, via: Option<ConstraintVia>) -> Cow<'static, str> {
    use ConstraintVia::*;
    match (via, kind) {
        (Some(ResponseFormat), ConstraintKind::JsonSchema) => {
            "response_format.json_schema.schema".into()
        }
        (Some(ResponseFormat), _) => "response_format".into(),
        (Some(ToolChoice), _) => "tool_choice".into(),
        (Some(TextFormat), ConstraintKind::JsonSchema) => "text.format.schema".into(),
        (Some(TextFormat), _) => "text.format".into(),
        (Some(OutputConfig), _) => "output_config.format".into(),
        (Some(StructuredOutputs), ConstraintKind::JsonSchema) => "structured_outputs.json".into(),
        (Some(StructuredOutputs), kind) => format!("structured_outputs.{}", kind.name()).into(),
        (None, kind) => format!("constraint.{}", kind.name()).into(),
    }
}

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorReply {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `rate_limit_error`, `server_error`, ...
    pub kind: &'static str,
    /// The offending request field, when one is to blame.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    shape: Shape,
}

#[derive(Serialize)]
struct OpenAiBody<'a> {
    error: OpenAiInner<'a>,
}

#[derive(Serialize)]
struct OpenAiInner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

#[derive(Serialize)]
struct AnthropicBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: AnthropicInner<'a>,
}

#[derive(Serialize)]
struct AnthropicInner<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: &'a str,
}

impl ErrorReply {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            shape: Shape::OpenAi,
        }
    }

    /// This error in `shape`.
    pub(crate) fn shaped(mut self, shape: Shape) -> Self {
        self.shape = shape;
        self
    }

    /// This error in `door`'s shape.
    pub(crate) fn shaped_for(self, door: Door) -> Self {
        self.shaped(door.shape())
    }

    /// 400 naming `param` (a field only the wire has).
    pub(crate) fn invalid(param: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        let param = param.into();
        Self {
            message: format!("{param}: {reason}"),
            param: Some(param),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "")
        }
    }

    /// 500: kiln's own fault (logged where it happened).
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self {
            code: Some("internal_error"),
            ..Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
        }
    }

    /// 400 about the body as a whole (not JSON, not an object).
    pub(crate) fn bad_body(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub(crate) fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "this server needs an API key: send `Authorization: Bearer <key>` or \
                 `x-api-key: <key>`",
            )
        }
    }

    pub(crate) fn not_found(what: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", what)
    }

    pub(crate) fn no_route(path: &str) -> Self {
        Self::not_found(format!("no route `{path}`"))
    }

    pub(crate) fn method_not_allowed(path: &str, method: &http::Method) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{path} does not take {method}"),
        )
    }

    pub(crate) fn too_large(limit: usize) -> Self {
        Self {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is over the limit of {limit} bytes"),
            )
        }
    }

    /// The front-door core or the engine refused or ended a call of `door` (whose constraint,
    /// if any, came from `via`).
    pub(crate) fn from_api(e: &ApiError, door: Door, via: Option<ConstraintVia>) -> Self {
        let message = e.message(|f| param(f, door, via));
        let reply = match e.kind() {
            ErrorKind::Invalid => Self {
                param: e.field().map(|f| param(f, door, via).into_owned()),
                ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
            },
            ErrorKind::ModelNotFound => Self {
                param: Some("model".into()),
                code: Some("model_not_found"),
                ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
            },
            ErrorKind::Overloaded => Self {
                code: Some("rate_limit_exceeded"),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            },
            ErrorKind::Timeout => Self {
                code: Some("timeout"),
                ..Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message)
            },
            ErrorKind::Unavailable | ErrorKind::Cancelled => Self {
                code: Some("service_unavailable"),
                ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            },
            // The engine logged it, with its chain, when it ended the request.
            ErrorKind::Internal => Self::internal(message),
        };
        reply.shaped(door.shape())
    }

    /// Anthropic's error `type` for this status (529 `overloaded_error` for a full queue or
    /// a drain, as Anthropic's API answers when it cannot take work).
    fn anthropic(&self) -> (StatusCode, &'static str) {
        match self.status.as_u16() {
            400 => (self.status, "invalid_request_error"),
            401 => (self.status, "authentication_error"),
            403 => (self.status, "permission_error"),
            404 => (self.status, "not_found_error"),
            413 => (self.status, "request_too_large"),
            429 | 503 => (
                StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                "overloaded_error",
            ),
            504 => (self.status, "timeout_error"),
            s if s < 500 => (self.status, "invalid_request_error"),
            _ => (self.status, "api_error"),
        }
    }

    /// The JSON body (also what an SSE event carries after the headers went out).
    pub(crate) fn body_json(&self) -> String {
        let json = match self.shape {
            Shape::OpenAi => serde_json::to_string(&OpenAiBody {
                error: OpenAiInner {
                    message: &self.message,
                    kind: self.kind,
                    param: self.param.as_deref(),
                    code: self.code,
                },
            }),
            Shape::Anthropic => serde_json::to_string(&AnthropicBody {
                kind: "error",
                error: AnthropicInner {
                    kind: self.anthropic().1,
                    message: &self.message,
                },
            }),
        };
        json.unwrap_or_else(|_| {
            r#"{"error":{"message":"error","type":"server_error","param":null,"code":null}}"#
                .to_owned()
        })
    }

    fn status_code(&self) -> StatusCode {
        match self.shape {
            Shape::OpenAi => self.status,
            Shape::Anthropic => self.anthropic().0,
        }
    }
}

impl IntoResponse for ErrorReply {
    fn into_response(self) -> Response {
        let json = [(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )];
        (self.status_code(), json, self.body_json()).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_engine::EngineError;

    #[test]
    fn engine_fields_become_each_door_s_names() {
        for (engine, chat, completions, responses, messages) in [
            (
                EngineField::Prompt,
                "messages",
                "prompt",
                "input",
                "messages",
            ),
            (
                EngineField::Temperature,
                "temperature",
                "temperature",
                "temperature",
                "temperature",
            ),
            (EngineField::N, "n", "n", "n", "n"),
            (
                EngineField::MaxNewTokens,
                "max_tokens",
                "max_tokens",
                "max_output_tokens",
                "max_tokens",
            ),
            (
                EngineField::MinNewTokens,
                "min_tokens",
                "min_tokens",
                "min_tokens",
                "min_tokens",
            ),
            (EngineField::Stop, "stop", "stop", "stop", "stop_sequences"),
            (
                EngineField::TopLogprobs,
                "top_logprobs",
                "logprobs",
                "top_logprobs",
                "top_logprobs",
            ),
        ] {
            let f = Field::Engine(engine);
            assert_eq!(param(f, Door::Chat, None), chat);
            assert_eq!(param(f, Door::Completions, None), completions);
            assert_eq!(param(f, Door::Responses, None), responses);
            assert_eq!(param(f, Door::Messages, None), messages);
        }
        let tool = Field::Tool {
            index: 1,
            part: ToolPart::Parameters,
        };
        assert_eq!(
            param(tool, Door::Chat, None),
            "tools[1].function.parameters"
        );
        assert_eq!(param(tool, Door::Messages, None), "tools[1].input_schema");
        let schema = Field::Engine(EngineField::Constraint(ConstraintKind::JsonSchema));
        assert_eq!(
            param(schema, Door::Chat, Some(ConstraintVia::ResponseFormat)),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            param(schema, Door::Responses, Some(ConstraintVia::TextFormat)),
            "text.format.schema"
        );
    }

    #[test]
    fn statuses_and_shapes() {
        let e = ApiError::from(EngineError::InvalidArgument {
            field: EngineField::TopP,
            reason: "must be in (0, 1]".into(),
            source: None,
        });
        let a = ErrorReply::from_api(&e, Door::Chat, None);
        assert_eq!(a.status, StatusCode::BAD_REQUEST);
        assert_eq!(a.param.as_deref(), Some("top_p"));
        let body: serde_json::Value =
            serde_json::from_str(&a.body_json()).unwrap_or(serde_json::Value::Null);
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(body["error"]["code"], serde_json::Value::Null);
        assert_eq!(body["error"]["message"], "top_p: must be in (0, 1]");
        let over = ApiError::from(EngineError::Overloaded {
            waiting: 4,
            limit: 4,
        });
        assert_eq!(
            ErrorReply::from_api(&over, Door::Chat, None).status,
            StatusCode::TOO_MANY_REQUESTS
        );
        let anthropic = ErrorReply::from_api(&over, Door::Messages, None);
        assert_eq!(anthropic.status_code().as_u16(), 529);
        let body: serde_json::Value =
            serde_json::from_str(&anthropic.body_json()).unwrap_or(serde_json::Value::Null);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "overloaded_error");
        let bad = ErrorReply::from_api(&e, Door::Messages, None);
        let body: serde_json::Value =
            serde_json::from_str(&bad.body_json()).unwrap_or(serde_json::Value::Null);
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["message"], "top_p: must be in (0, 1]");
    }
}
