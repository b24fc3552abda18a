#![doc = include_str!("../README.md")]

mod chat;
mod config;
pub mod edge;
mod error;
pub mod harmony;
mod params;
mod reasoning;
mod reply;
mod serving;

pub use chat::{Conversation, Message, PastCall, Prepared, Role, Tool};
pub use config::{ApiConfig, MaxTokens};
pub use error::{ApiError, ErrorKind, Field, MessagePart, ToolPart, echo};
pub use params::SamplingOverlay;
pub use reasoning::{Reasoning, ReasoningParser, ReasoningStream, Split, UnknownParser};
pub use reply::{Finish, Piece, Reply, ReplyFormat, ReplyStream};
pub use serving::{
    AttachError, Health, MetricsCompat, NotServing, Protocol, Serving, ServingConfig,
};
