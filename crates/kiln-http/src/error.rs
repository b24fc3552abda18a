//! OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`) with the HTTP
//! status a client expects. The one place that maps an engine error kind to a status.

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use kiln_engine::{EngineError, NotServing, error_chain};
use serde::Serialize;

/// Which endpoint failed: engine field names become that endpoint's parameter names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    Chat,
    Completions,
}

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `rate_limit_error`, `server_error`, ...
    pub kind: &'static str,
    /// The offending request field, when one is to blame.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400 naming `param`.
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
                "this server needs an API key: send `Authorization: Bearer <key>`",
            )
        }
    }

    pub(crate) fn model_not_found(asked: &str, served: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                kiln_engine::model_not_served(asked, served),
            )
        }
    }

    pub(crate) fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route `{path}`"),
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

    pub(crate) fn not_serving(e: NotServing) -> Self {
        Self {
            code: Some("service_unavailable"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                e.to_string(),
            )
        }
    }

    /// Names the body's `param` for what the engine called `engine_field`.
    pub(crate) fn rename_param(&mut self, engine_field: &str, param: String) {
        if let Some(rest) = self.message.strip_prefix(engine_field) {
            self.message = format!("{param}{rest}");
        }
        self.param = Some(param);
    }

    /// The engine refused or ended a request.
    pub(crate) fn from_engine(e: &EngineError, api: Api) -> Self {
        let message = error_chain(e);
        match e {
            EngineError::InvalidArgument { field, .. } => {
                // The message names the field as the body does, like `param`.
                let param = param_name(field, api);
                let message = match message.strip_prefix(field.as_str()) {
                    Some(rest) => format!("{param}{rest}"),
                    None => message,
                };
                Self {
                    param: Some(param),
                    ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
                }
            }
            EngineError::Overloaded { .. } => Self {
                code: Some("rate_limit_exceeded"),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            },
            EngineError::DeadlineExceeded => Self {
                code: Some("timeout"),
                ..Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message)
            },
            EngineError::Cancelled(_) | EngineError::ShuttingDown => Self {
                code: Some("service_unavailable"),
                ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            },
            // The engine logged it, with its chain, when it ended the request.
            EngineError::Internal(_) => Self::internal(message),
        }
    }

    /// The JSON body (also what an SSE `data:` line carries after the headers went out).
    pub(crate) fn body_json(&self) -> String {
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| {
            r#"{"error":{"message":"error","type":"server_error","param":null,"code":null}}"#
                .to_owned()
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let json = [(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )];
        (self.status, json, self.body_json()).into_response()
    }
}

/// The engine names fields as its request types do (`sampling.temperature`,
/// `stopping.max_new_tokens`); OpenAI clients know them by their body names.
fn param_name(field: &str, api: Api) -> String {
    let name = match field {
        "prompt" | "prompt.token_ids" => match api {
            Api::Chat => "messages",
            Api::Completions => "prompt",
        },
        "stopping.max_new_tokens" => "max_tokens",
        "stopping.min_new_tokens" => "min_tokens",
        "output.top_logprobs" => match api {
            Api::Chat => "top_logprobs",
            Api::Completions => "logprobs",
        },
        other => {
            return other
                .strip_prefix("sampling.")
                .or_else(|| other.strip_prefix("stopping."))
                .or_else(|| other.strip_prefix("output."))
                .unwrap_or(other)
                .to_owned();
        }
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_fields_become_body_names() {
        for (engine, chat, completions) in [
            ("prompt", "messages", "prompt"),
            ("prompt.token_ids", "messages", "prompt"),
            ("sampling.temperature", "temperature", "temperature"),
            ("sampling.n", "n", "n"),
            ("stopping.max_new_tokens", "max_tokens", "max_tokens"),
            ("stopping.min_new_tokens", "min_tokens", "min_tokens"),
            ("stopping.stop", "stop", "stop"),
            (
                "stopping.stop_token_ids",
                "stop_token_ids",
                "stop_token_ids",
            ),
            ("output.top_logprobs", "top_logprobs", "logprobs"),
        ] {
            assert_eq!(param_name(engine, Api::Chat), chat);
            assert_eq!(param_name(engine, Api::Completions), completions);
        }
    }

    #[test]
    fn statuses_per_engine_error() {
        let e = EngineError::InvalidArgument {
            field: "sampling.top_p".into(),
            reason: "must be in (0, 1]".into(),
            source: None,
        };
        let a = ApiError::from_engine(&e, Api::Chat);
        assert_eq!(a.status, StatusCode::BAD_REQUEST);
        assert_eq!(a.param.as_deref(), Some("top_p"));
        let over = EngineError::Overloaded {
            waiting: 4,
            limit: 4,
        };
        assert_eq!(
            ApiError::from_engine(&over, Api::Chat).status,
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            ApiError::from_engine(&EngineError::ShuttingDown, Api::Completions).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
        let body: serde_json::Value =
            serde_json::from_str(&a.body_json()).unwrap_or(serde_json::Value::Null);
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(body["error"]["code"], serde_json::Value::Null);
        assert_eq!(body["error"]["message"], "top_p: must be in (0, 1]");
    }
}
