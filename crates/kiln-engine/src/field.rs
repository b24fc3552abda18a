//! The fields of a [`Request`](crate::Request) an error can blame, as a type: each front door
//! maps a [`Field`] to its own body's name in one `match`, instead of rewriting strings.

use std::fmt;

/// A request field an [`EngineError::InvalidArgument`](crate::EngineError) names. Its
/// `Display` is the field's path in the request (`sampling.temperature`), which is also its
/// path in the gRPC `GenerateRequest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    Prompt,
    PromptTokenIds,
    Temperature,
    TopP,
    MinP,
    RepetitionPenalty,
    PresencePenalty,
    FrequencyPenalty,
    LogitBias,
    N,
    MaxNewTokens,
    MinNewTokens,
    Stop,
    StopTokenIds,
    TopLogprobs,
    PromptLogprobs,
    Constraint(ConstraintKind),
}

/// Which kind of [`Constraint`](crate::Constraint) an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConstraintKind {
    JsonSchema,
    JsonObject,
    Regex,
    Choice,
    Grammar,
}

impl ConstraintKind {
    /// The kind's name in the request (`json_schema`, `regex`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::JsonSchema => "json_schema",
            Self::JsonObject => "json_object",
            Self::Regex => "regex",
            Self::Choice => "choice",
            Self::Grammar => "grammar",
        }
    }
}

impl Field {
    /// The field's path in the request.
    pub fn path(self) -> &'static str {
        match self {
            Self::Prompt => "prompt",
            Self::PromptTokenIds => "prompt.token_ids",
            Self::Temperature => "sampling.temperature",
            Self::TopP => "sampling.top_p",
            Self::MinP => "sampling.min_p",
            Self::RepetitionPenalty => "sampling.repetition_penalty",
            Self::PresencePenalty => "sampling.presence_penalty",
            Self::FrequencyPenalty => "sampling.frequency_penalty",
            Self::LogitBias => "sampling.logit_bias",
            Self::N => "sampling.n",
            Self::MaxNewTokens => "stopping.max_new_tokens",
            Self::MinNewTokens => "stopping.min_new_tokens",
            Self::Stop => "stopping.stop",
            Self::StopTokenIds => "stopping.stop_token_ids",
            Self::TopLogprobs => "output.top_logprobs",
            Self::PromptLogprobs => "output.prompt_logprobs",
            Self::Constraint(ConstraintKind::JsonSchema) => "constraint.json_schema",
            Self::Constraint(ConstraintKind::JsonObject) => "constraint.json_object",
            Self::Constraint(ConstraintKind::Regex) => "constraint.regex",
            Self::Constraint(ConstraintKind::Choice) => "constraint.choice",
            Self::Constraint(ConstraintKind::Grammar) => "constraint.grammar",
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.path())
    }
}
