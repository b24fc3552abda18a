//! Engine errors as gRPC statuses (the README's "Talking to the server"): never in-band. The one place that maps an
//! error kind to a status code; the message is the error with its whole chain of causes.

use kiln_engine::{EngineError, error_chain};
use tonic::Status;

pub(crate) fn from_engine(e: EngineError) -> Status {
    let message = error_chain(&e);
    match e {
        EngineError::InvalidArgument { .. } => Status::invalid_argument(message),
        EngineError::Overloaded { .. } => Status::resource_exhausted(message),
        EngineError::DeadlineExceeded => Status::deadline_exceeded(message),
        EngineError::Cancelled(why) => Status::cancelled(why),
        EngineError::ShuttingDown => Status::unavailable("the server is draining"),
        // The engine logged it, with its chain, when it ended the request.
        EngineError::Internal(_) => Status::internal(message),
    }
}

pub(crate) fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

/// A malformed `grpc-timeout` header is the client's error.
pub(crate) fn invalid_timeout(e: &crate::edge::BadTimeout) -> Status {
    Status::invalid_argument(e.to_string())
}
