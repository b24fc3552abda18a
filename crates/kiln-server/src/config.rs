//! What a server is configured with: the model's public name, auth, defaults and limits.

use std::time::Duration;

use std::sync::Arc;

use kiln_engine::SamplingParams;
use kiln_tokenizer::ChatTemplate;

/// Server settings; [`ServerConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name clients see (`ModelInfo.model_id`; a request naming another model is
    /// NOT_FOUND).
    pub model_id: String,
    /// The model's architecture, as its config names it (reported by `GetModelInfo`).
    pub architecture: String,
    /// When set, every `kiln.v1` call must carry `authorization: Bearer <key>`; health and
    /// reflection stay open so probes and tools work.
    pub api_key: Option<String>,
    /// Values for sampling fields a request leaves unset (temperature 1 as in vLLM and the
    /// OpenAI API; a request sets 0 for greedy).
    pub default_sampling: SamplingParams,
    /// `max_new_tokens` when a request leaves it unset.
    pub default_max_new_tokens: usize,
    /// The largest `max_new_tokens` accepted (`None`: the context length).
    pub max_new_tokens: Option<usize>,
    /// Largest request message: a context's worth of token ids or text is far below it, and
    /// anything larger is refused before it is decoded.
    pub max_request_bytes: usize,
    /// Read special-token spellings in chat message content as control tokens (off: as the
    /// plain text they are, so a user cannot forge a turn).
    pub special_tokens_in_content: bool,
    /// Largest response message: a unary reply holds `n` whole outputs with logprobs.
    pub max_response_bytes: usize,
    /// How long a drain (SIGTERM) lets requests in flight finish before cancelling them.
    pub drain_timeout: Duration,
    /// Renders `chat` prompts instead of the model's own template (`--chat-template FILE`).
    pub chat_template: Option<Arc<ChatTemplate>>,
}

impl ServerConfig {
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            architecture: String::new(),
            api_key: None,
            default_sampling: SamplingParams::default(),
            default_max_new_tokens: 256,
            max_new_tokens: None,
            max_request_bytes: 4 << 20,
            max_response_bytes: 64 << 20,
            drain_timeout: Duration::from_secs(30),
            chat_template: None,
            special_tokens_in_content: false,
        }
    }
}
