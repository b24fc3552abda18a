//! Why a call is refused, with the field to blame as a type. Each front door turns an
//! [`ApiError`] into its own status and body in one place: the [`ErrorKind`] picks the status,
//! [`Field`] becomes that door's name for the field.

use std::borrow::Cow;
use std::error::Error;
use std::fmt;

use kiln_engine::{Cause, EngineError, error_chain};

use crate::serving::NotServing;

/// A field of a call, as every door has it in some form of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// A field of the engine request (sampling, stopping, output, constraint).
    Engine(kiln_engine::Field),
    /// The model's name.
    Model,
    /// The conversation as a whole (none, no template for it, too long).
    Messages,
    /// One message of the conversation.
    Message {
        index: usize,
        part: MessagePart,
    },
    /// One tool definition.
    Tool {
        index: usize,
        part: ToolPart,
    },
    ToolChoice,
    /// The largest number of tokens to generate, over the server's limit.
    MaxTokens,
}

/// Which part of a message an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessagePart {
    Role,
    Content,
    ToolCalls,
}

/// Which part of a tool definition an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolPart {
    Name,
    Parameters,
}

impl From<kiln_engine::Field> for Field {
    fn from(f: kiln_engine::Field) -> Self {
        Self::Engine(f)
    }
}

/// A neutral path, for logs (each door names fields its own way).
impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Engine(e) => f.write_str(e.path()),
            Self::Model => f.write_str("model"),
            Self::Messages => f.write_str("messages"),
            Self::Message { index, part } => write!(f, "messages[{index}].{}", part.name()),
            Self::Tool { index, part } => write!(f, "tools[{index}].{}", part.name()),
            Self::ToolChoice => f.write_str("tool_choice"),
            Self::MaxTokens => f.write_str("max_tokens"),
        }
    }
}

impl MessagePart {
    /// The part's name in OpenAI's message shape.
    pub fn name(self) -> &'static str {
        match self {
            Self::Role => "role",
            Self::Content => "content",
            Self::ToolCalls => "tool_calls",
        }
    }
}

impl ToolPart {
    /// The part's name in OpenAI's tool shape.
    pub fn name(self) -> &'static str {
        match self {
            Self::Name => "name",
            Self::Parameters => "parameters",
        }
    }
}

/// What went wrong, as a door picks its status from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The call is malformed (400, INVALID_ARGUMENT).
    Invalid,
    /// It names a model this server does not serve (404, NOT_FOUND).
    ModelNotFound,
    /// The waiting queue is full (429 or 529, RESOURCE_EXHAUSTED).
    Overloaded,
    /// Loading, draining or shutting down (503 or 529, UNAVAILABLE).
    Unavailable,
    /// Its deadline passed (504, DEADLINE_EXCEEDED).
    Timeout,
    /// Aborted (CANCELLED).
    Cancelled,
    /// kiln's own fault (500, INTERNAL).
    Internal,
}

/// Why a call is refused or ended.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field of the call is malformed.
    #[error("{field}: {reason}")]
    Invalid {
        field: Field,
        reason: String,
        /// What refused it, when something did (the template, the tokenizer).
        #[source]
        source: Option<Cause>,
    },
    /// The call names a model this server does not serve.
    #[error(
        "model `{}` is not served here (this server serves `{served}`)",
        echo(asked)
    )]
    ModelNotFound { asked: String, served: String },
    /// Loading or draining.
    #[error(transparent)]
    NotServing(#[from] NotServing),
    /// The engine refused or ended the request.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl ApiError {
    /// `field` is malformed: `reason` says how.
    pub fn invalid(field: impl Into<Field>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            reason: reason.into(),
            source: None,
        }
    }

    /// `field` was refused by `source` (kept as the cause).
    pub fn invalid_because(
        field: impl Into<Field>,
        reason: impl Into<String>,
        source: impl Error + Send + Sync + 'static,
    ) -> Self {
        Self::Invalid {
            field: field.into(),
            reason: reason.into(),
            source: Some(std::sync::Arc::new(source)),
        }
    }

    /// The error with the tool it names renumbered by `wire` (a door that dropped some tools,
    /// hosted ones, before handing the rest over names them by their place in its body).
    pub fn renumber_tool(mut self, wire: impl Fn(usize) -> usize) -> Self {
        if let Self::Invalid {
            field: Field::Tool { index, .. },
            ..
        } = &mut self
        {
            *index = wire(*index);
        }
        self
    }

    /// What went wrong, as a door picks its status.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid { .. } => ErrorKind::Invalid,
            Self::ModelNotFound { .. } => ErrorKind::ModelNotFound,
            Self::NotServing(_) => ErrorKind::Unavailable,
            Self::Engine(e) => match e {
                EngineError::InvalidArgument { .. } => ErrorKind::Invalid,
                EngineError::Overloaded { .. } => ErrorKind::Overloaded,
                EngineError::DeadlineExceeded => ErrorKind::Timeout,
                EngineError::Cancelled(_) => ErrorKind::Cancelled,
                EngineError::ShuttingDown => ErrorKind::Unavailable,
                EngineError::Internal(_) => ErrorKind::Internal,
            },
        }
    }

    /// The field to blame, when one is.
    pub fn field(&self) -> Option<Field> {
        match self {
            Self::Invalid { field, .. } => Some(*field),
            Self::Engine(EngineError::InvalidArgument { field, .. }) => Some(Field::Engine(*field)),
            Self::ModelNotFound { .. } => Some(Field::Model),
            _ => None,
        }
    }

    /// What is wrong, with every cause, without the field's name: a door writes
    /// `<its name for the field>: <detail>`.
    pub fn detail(&self) -> String {
        let (reason, source): (&str, Option<&(dyn Error + 'static)>) = match self {
            Self::Invalid { reason, source, .. } => (
                reason,
                source.as_deref().map(|s| s as &(dyn Error + 'static)),
            ),
            Self::Engine(e @ EngineError::InvalidArgument { reason, .. }) => (reason, e.source()),
            Self::Engine(e) => return error_chain(e),
            other => return other.to_string(),
        };
        match source {
            Some(s) => format!("{reason}: {}", error_chain(s)),
            None => reason.to_owned(),
        }
    }

    /// The whole message, the field named as `name` spells it.
    pub fn message(&self, name: impl Fn(Field) -> Cow<'static, str>) -> String {
        match self.field() {
            Some(f) if !matches!(self, Self::ModelNotFound { .. }) => {
                format!("{}: {}", name(f), self.detail())
            }
            _ => self.detail(),
        }
    }
}

/// What error messages and logs echo of a name a caller sent: at most this many characters.
const ECHO_CHARS: usize = 64;

/// `s` as messages echo it: its first 64 characters, and `…` when it was longer (a 3 MiB name
/// must not come back in every message and log line).
pub fn echo(s: &str) -> Cow<'_, str> {
    match s.char_indices().nth(ECHO_CHARS) {
        Some((cut, _)) => format!("{}…", &s[..cut]).into(),
        None => s.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_field_the_door_s_way() {
        let e = ApiError::invalid(
            Field::Tool {
                index: 2,
                part: ToolPart::Name,
            },
            "expected 1 to 64 letters",
        );
        assert_eq!(e.kind(), ErrorKind::Invalid);
        assert_eq!(e.to_string(), "tools[2].name: expected 1 to 64 letters");
        let body = e.message(|f| match f {
            Field::Tool { index, .. } => format!("tools[{index}].function.name").into(),
            other => other.to_string().into(),
        });
        assert_eq!(body, "tools[2].function.name: expected 1 to 64 letters");
        let engine = ApiError::from(EngineError::InvalidArgument {
            field: kiln_engine::Field::TopP,
            reason: "must be in (0, 1]".into(),
            source: None,
        });
        assert_eq!(
            engine.field(),
            Some(Field::Engine(kiln_engine::Field::TopP))
        );
        assert_eq!(
            engine.message(|_| "top_p".into()),
            "top_p: must be in (0, 1]"
        );
        let far = ApiError::ModelNotFound {
            asked: "x".repeat(100),
            served: "m".into(),
        };
        assert_eq!(far.kind(), ErrorKind::ModelNotFound);
        assert!(
            far.message(|_| "model".into())
                .starts_with(&format!("model `{}…`", "x".repeat(64)))
        );
    }
}
