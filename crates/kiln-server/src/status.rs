//! Errors as gRPC statuses (the README's "Talking to the server"): never in-band. The one
//! place that maps an error kind to a status code and a field to its path in the
//! `GenerateRequest`; the message is the error with its whole chain of causes.

use std::borrow::Cow;

use kiln_api::{ApiError, ErrorKind, Field, ToolPart};
use kiln_engine::EngineError;
use tonic::Status;

/// A field as its path in the request message (`prompt.chat.tools[2].name`), the chat
/// being at `chat`; `forced`: the request's constraint is a forced call's grammar.
fn path(f: Field, chat: &str, forced: bool) -> Cow<'static, str> {
    match f {
        Field::Engine(kiln_engine::Field::Constraint(_)) if forced => {
            format!("{chat}.tool_choice").into()
        }
        Field::Engine(e) => e.path().into(),
        Field::Model => "model".into(),
        Field::Messages => chat.to_owned().into(),
        Field::Message { index, part } => {
            format!("{chat}.messages[{index}].{}", part.name()).into()
        }
        Field::Tool { index, part } => {
            let part = match part {
                ToolPart::Name => "name",
                ToolPart::Parameters => "parameters_json",
            };
            format!("{chat}.tools[{index}].{part}").into()
        }
        Field::ToolChoice => format!("{chat}.tool_choice").into(),
        Field::MaxTokens => "stopping.max_new_tokens".into(),
    }
}

/// An error of a `Generate` call (its chat at `prompt.chat`).
pub(crate) fn from_api(e: &ApiError) -> Status {
    from_api_in(e, "prompt.chat", false)
}

/// The engine's refusal of a `Generate` call whose constraint is a forced call's grammar
/// when `forced`.
pub(crate) fn refused(e: EngineError, forced: bool) -> Status {
    from_api_in(&ApiError::Engine(e), "prompt.chat", forced)
}

/// An error of a call whose chat is at `chat`.
pub(crate) fn from_api_in(e: &ApiError, chat: &str, forced: bool) -> Status {
    if let ApiError::Engine(EngineError::Cancelled(why)) = e {
        return Status::cancelled(why.clone());
    }
    if let ApiError::Engine(EngineError::ShuttingDown) = e {
        return Status::unavailable("the server is draining");
    }
    let message = e.message(|f| path(f, chat, forced));
    match e.kind() {
        ErrorKind::Invalid => Status::invalid_argument(message),
        ErrorKind::ModelNotFound => Status::not_found(message),
        ErrorKind::Overloaded => Status::resource_exhausted(message),
        ErrorKind::Unavailable => Status::unavailable(message),
        ErrorKind::Timeout => Status::deadline_exceeded(message),
        ErrorKind::Cancelled => Status::cancelled(message),
        // The engine logged it, with its chain, when it ended the request.
        ErrorKind::Internal => Status::internal(message),
    }
}

pub(crate) fn from_engine(e: EngineError) -> Status {
    from_api(&ApiError::Engine(e))
}

/// A malformed field only the gRPC message has.
pub(crate) fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

/// A malformed `grpc-timeout` header is the client's error.
pub(crate) fn invalid_timeout(e: &crate::edge::BadTimeout) -> Status {
    Status::invalid_argument(e.to_string())
}
