//! The OpenAI wire types kiln reads and writes: request bodies of `/v1/chat/completions` and
//! `/v1/completions` (OpenAI's fields plus the extras vLLM accepts; unknown fields are ignored,
//! as OpenAI's own server does) and the response objects, field for field.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Fields both endpoints take.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<u32>,
    /// A string or an array of strings; kept raw so a bad shape gets a clear message.
    pub stop: Option<Value>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string key) to a bias in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Accepted and logged, as OpenAI does for abuse tracking.
    pub user: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    // vLLM's extras.
    /// -1 or 0: off.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<u32>,
    pub skip_special_tokens: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM: the log-probability of every prompt token with this many alternatives
    /// (`prompt_logprobs` in the response: `null` first, then `{token_id: {logprob, rank,
    /// decoded_token}}` a position).
    pub prompt_logprobs: Option<u32>,
    /// Structured output, OpenAI's way: `{"type": "text" | "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    pub response_format: Option<Value>,
    /// Structured output, vLLM's way: one of `json` (a schema, as an object or JSON text),
    /// `regex`, `choice`, `grammar` (llguidance's Lark syntax) or `json_object: true`.
    pub structured_outputs: Option<Value>,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
pub(crate) struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `POST /v1/chat/completions`: these fields and [`Common`]'s, read from the same body (two
/// passes rather than `#[serde(flatten)]`, which would hide the failing field's name).
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    pub max_completion_tokens: Option<u32>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    /// vLLM: end the prompt with the assistant header (default true).
    pub add_generation_prompt: Option<bool>,
    /// OpenAI function tools, passed to the chat template as transformers passes them.
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto` (the default with tools), `required`, or
    /// `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<Value>,
    /// vLLM: more template variables (`{"enable_thinking": false}` turns Qwen3's thinking off).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// One message as sent; `content` is a string, an array of parts, or null (an assistant turn
/// that only calls tools).
#[derive(Debug, Deserialize)]
pub(crate) struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Value,
    pub name: Option<String>,
    pub tool_call_id: Option<String>,
    pub tool_calls: Option<Value>,
    /// An assistant turn's reasoning, by DeepSeek's name (llama.cpp, Open WebUI) ...
    pub reasoning_content: Option<String>,
    /// ... or vLLM's.
    pub reasoning: Option<String>,
}

/// `POST /v1/completions`: these fields and [`Common`]'s.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    /// A string, an array of strings, an array of token ids, or an array of those.
    pub prompt: Value,
    /// The number of most likely alternatives per token (0: only the sampled token's).
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl From<kiln_engine::Usage> for Usage {
    fn from(u: kiln_engine::Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_prompt_tokens,
            },
        }
    }
}

/// `chat.completion`.
#[derive(Debug, Serialize)]
pub(crate) struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then per position the prompt
/// token and the most likely ones, by token id.
pub(crate) type PromptLogprobs = Vec<Option<serde_json::Map<String, Value>>>;

#[derive(Debug, Serialize)]
pub(crate) struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's extra: the stop string or token id that ended the output.
    pub stop_reason: Option<Value>,
}

#[derive(Debug, Serialize)]
pub(crate) struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the reply is only tool calls (or only reasoning).
    pub content: Option<String>,
    /// With `--reasoning-parser`: the reasoning, under both names clients read (vLLM's
    /// `reasoning`, and DeepSeek's `reasoning_content`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One tool call of a message; in a stream delta it also carries `index`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ToolCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct FunctionCall {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

/// `chat.completion.chunk`.
#[derive(Debug, Serialize)]
pub(crate) struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChunkChoice>,
    /// `null` on every chunk but the last when usage was asked for; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    /// vLLM's, on the first chunk, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<Value>,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Reasoning deltas, under both names (as in [`AssistantMessage`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// Chat logprobs: one entry per generated token.
#[derive(Debug, Serialize)]
pub(crate) struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// `text_completion` (both whole and streamed: OpenAI uses one object name for both).
#[derive(Debug, Serialize)]
pub(crate) struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
pub(crate) struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<Value>,
    /// vLLM's, when asked for (on the choice's first chunk when streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// The legacy completions logprobs layout: parallel arrays (`null` at an echoed prompt's
/// first token, which nothing predicts). Every logprob is written as the f64 of its f32, in
/// `token_logprobs` as in `top_logprobs`, so a client comparing a token's with the best of its
/// alternatives (lm-eval's `is_greedy`) reads the same number for the same value.
#[derive(Debug, Default, Serialize)]
pub(crate) struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f64>>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// vLLM's extra: the context length.
    pub max_model_len: usize,
}
