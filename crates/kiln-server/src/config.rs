//! What the gRPC server is configured with: the front doors' shared [`ApiConfig`] and what
//! only gRPC has.

use kiln_api::ApiConfig;

/// `max_new_tokens` when neither the request nor the server sets one (the `kiln.v1` API's
/// documented default, as the legacy completions API has its 16).
pub const DEFAULT_MAX_NEW_TOKENS: usize = 256;

/// Server settings; [`ServerConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Names, auth, defaults and limits, shared with every other front door.
    pub api: ApiConfig,
    /// The model's architecture, as its config names it (reported by `GetModelInfo`).
    pub architecture: String,
    /// Largest response message: a unary reply holds `n` whole outputs with logprobs.
    pub max_response_bytes: usize,
}

impl ServerConfig {
    pub fn new(model_id: impl Into<String>) -> Self {
        Self::with(ApiConfig::new(model_id))
    }

    pub fn with(api: ApiConfig) -> Self {
        Self {
            api,
            architecture: String::new(),
            max_response_bytes: 64 << 20,
        }
    }
}
