//! What an HTTP front door is configured with.

use std::sync::Arc;

use kiln_tokenizer::ChatTemplate;

/// HTTP settings; [`HttpConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// The model's name in `/v1/models` and in responses; a request naming another model is a
    /// 404.
    pub model_id: String,
    /// When set, every `/v1/` call must carry `Authorization: Bearer <key>`; `/health`,
    /// `/version` and `/metrics` stay open for probes and scrapers.
    pub api_key: Option<String>,
    /// Overrides the model's own chat template (`--chat-template FILE`).
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// `max_tokens` when a request leaves it unset (`None`: 16 for completions as in OpenAI's
    /// API, up to the context for chat).
    pub default_max_tokens: Option<usize>,
    /// The largest `max_tokens` accepted (`None`: the context length).
    pub max_tokens: Option<usize>,
    /// Largest request body; larger ones get a 413 before they are parsed.
    pub max_body_bytes: usize,
    /// Read special-token spellings in chat message content as control tokens (off: as the
    /// plain text they are, so a user cannot forge a turn).
    pub special_tokens_in_content: bool,
}

impl HttpConfig {
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            api_key: None,
            chat_template: None,
            default_max_tokens: None,
            max_tokens: None,
            max_body_bytes: 4 << 20,
            special_tokens_in_content: false,
        }
    }
}
