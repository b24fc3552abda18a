//! The one configuration every front door of a process reads: the model's names, auth,
//! defaults and limits. The gRPC and HTTP doors add only what is theirs (message sizes).

use std::sync::Arc;

use kiln_engine::{EngineInfo, SamplingParams};
use kiln_tokenizer::ChatTemplate;

use crate::error::{ApiError, Field};
use crate::reasoning::ReasoningParser;

/// Front-door settings; [`ApiConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The names the model answers to (`--model-id`, repeatable): the first is the name
    /// replies carry, all are listed by `/v1/models`, and a call naming any other is a 404.
    /// Agents send their own model names; an alias lets them in.
    pub model_ids: Vec<String>,
    /// When set, generation calls must carry it (`Authorization: Bearer <key>` or
    /// `x-api-key`); health, metrics and reflection stay open for probes and tools.
    pub api_key: Option<String>,
    /// Renders chat prompts instead of the model's own template (`--chat-template FILE`).
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// Read special-token spellings in chat message content as control tokens (off: as the
    /// plain text they are, so a user cannot forge a turn).
    pub special_tokens_in_content: bool,
    /// Values for sampling fields a call leaves unset, on every door (temperature 1 as in
    /// vLLM and the OpenAI API; a call sets 0 for greedy).
    pub default_sampling: SamplingParams,
    /// Tokens to generate when a call leaves it unset (`None`: up to the context, as vLLM
    /// does, except where a wire format defines its own default).
    pub default_max_tokens: Option<usize>,
    /// The most tokens a call may ask for (`None`: the context length).
    pub max_tokens: Option<usize>,
    /// Largest request body or message; larger ones are refused before they are parsed.
    pub max_request_bytes: usize,
    /// Splits `<think>…</think>` from the reply (`--reasoning-parser`).
    pub reasoning: Option<ReasoningParser>,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (0: none).
    pub responses_store: usize,
}

impl ApiConfig {
    /// The defaults, serving the model as `model_id`.
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_ids: vec![model_id.into()],
            api_key: None,
            chat_template: None,
            special_tokens_in_content: false,
            default_sampling: SamplingParams::default(),
            default_max_tokens: None,
            max_tokens: None,
            max_request_bytes: 4 << 20,
            reasoning: None,
            responses_store: 256,
        }
    }

    /// The name replies carry.
    pub fn model_id(&self) -> &str {
        self.model_ids.first().map_or("", String::as_str)
    }

    /// Whether `name` is one of the model's names.
    pub fn serves(&self, name: &str) -> bool {
        self.model_ids.iter().any(|m| m == name)
    }

    /// A call naming no model, or one of the model's names, passes.
    pub fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            Some(m) if !m.is_empty() && !self.serves(m) => Err(ApiError::ModelNotFound {
                asked: m.to_owned(),
                served: self.model_id().to_owned(),
            }),
            _ => Ok(()),
        }
    }

    /// The most tokens a call may ask for with this model.
    pub fn max_tokens_limit(&self, info: &EngineInfo) -> usize {
        self.max_tokens
            .unwrap_or(info.max_model_len)
            .min(info.max_model_len)
    }

    /// The tokens to generate when a call asks for `asked`: over the limit is refused;
    /// unset takes the server's default, else `wire_default` (a format's own, like the
    /// legacy completions' 16), else up to the context.
    pub fn max_tokens(
        &self,
        info: &EngineInfo,
        asked: Option<usize>,
        wire_default: Option<usize>,
    ) -> Result<MaxTokens, ApiError> {
        let limit = self.max_tokens_limit(info);
        if let Some(m) = asked
            && m > limit
        {
            return Err(ApiError::invalid(
                Field::MaxTokens,
                format!("{m} exceeds the limit {limit}"),
            ));
        }
        Ok(MaxTokens {
            asked,
            default: self
                .default_max_tokens
                .or(wire_default)
                .map(|m| m.min(limit)),
        })
    }
}

/// A call's generation length: what it asked for, and the default that holds when it did
/// not (`None`: up to the context).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxTokens {
    /// As the call asked (within the limit).
    pub asked: Option<usize>,
    /// What holds when it did not ask.
    pub default: Option<usize>,
}
