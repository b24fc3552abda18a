//! Engine errors as gRPC statuses (DESIGN.md §5): never in-band.

use kiln_engine::EngineError;
use tonic::Status;

pub(crate) fn from_engine(e: EngineError) -> Status {
    match e {
        EngineError::InvalidArgument { field, reason } => {
            Status::invalid_argument(format!("{field}: {reason}"))
        }
        e @ EngineError::Overloaded { .. } => Status::resource_exhausted(e.to_string()),
        EngineError::DeadlineExceeded => Status::deadline_exceeded("deadline exceeded"),
        EngineError::Cancelled(why) => Status::cancelled(why),
        EngineError::ShuttingDown => Status::unavailable("the server is draining"),
        EngineError::Internal(why) => Status::internal(why),
    }
}

pub(crate) fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}
