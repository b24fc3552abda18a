//! What a caller submits and what comes back: plain Rust types (the server converts them to and
//! from protobuf at its edge).

use std::time::{Duration, Instant};

use crate::constraint::Constraint;
use crate::sampling::{SamplingParams, TokenLogprob};

/// The engine's id for a submitted request (unique per engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// The prompt, as text (encoded with the model's tokenizer, special tokens as it adds them) or
/// as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
}

/// When a sequence stops.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StoppingCriteria {
    /// Tokens to generate at most. A request whose prompt plus this exceeds the engine's
    /// `max_model_len` is refused; `None` means `default_max_new_tokens`. 0 (with
    /// [`OutputOptions::prompt_logprobs`]) scores the prompt and generates nothing.
    pub max_new_tokens: Option<usize>,
    /// A front door's default for an unset `max_new_tokens`: at most this many, fewer where
    /// the context leaves less room (a default never makes a request fail); `None` means up to
    /// the context length.
    pub default_max_new_tokens: Option<usize>,
    /// EOS, stop tokens and stop strings are ignored until this many tokens exist.
    pub min_new_tokens: usize,
    /// Stop strings: generation ends when the text contains one; it is left out of the text
    /// unless `include_stop_str_in_output`.
    pub stop: Vec<String>,
    /// Token ids that end generation (besides the model's EOS ids).
    pub stop_token_ids: Vec<u32>,
    pub include_stop_str_in_output: bool,
    /// Keep going past the model's EOS ids.
    pub ignore_eos: bool,
}

impl StoppingCriteria {
    /// Tokens to generate at most, given `room` left in the context after the prompt.
    pub fn max_new_tokens(&self, room: usize) -> usize {
        self.max_new_tokens
            .or(self.default_max_new_tokens)
            .map_or(room, |m| m.min(room))
    }
}

/// What each token event carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputOptions {
    /// The sampled token's log-probability (under the raw model distribution).
    pub logprobs: bool,
    /// That many most likely alternatives per token.
    pub top_logprobs: usize,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
    /// The log-probability of every prompt token after the first, each with that many most
    /// likely alternatives ([`Event::PromptLogprobs`], before the first delta). The whole
    /// prompt is computed, the prefix cache's blocks not reused: the LM head runs on every
    /// prompt position.
    pub prompt_logprobs: Option<usize>,
}

impl Default for OutputOptions {
    fn default() -> Self {
        Self {
            logprobs: false,
            top_logprobs: 0,
            skip_special_tokens: true,
            prompt_logprobs: None,
        }
    }
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The caller's own id, echoed in logs (the server's `request_id`).
    pub label: String,
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Seeds the per-sequence RNGs; `None` draws one. Same seed and prompt, same tokens,
    /// whatever else runs in the batch.
    pub seed: Option<u64>,
    /// Outputs to generate from the prompt (its KV blocks are shared by fork).
    pub n: usize,
    pub stopping: StoppingCriteria,
    pub output: OutputOptions,
    /// Lower runs first; ties go to the earlier arrival.
    pub priority: i32,
    /// When the request must be finished; afterwards it ends with
    /// [`EngineError::DeadlineExceeded`](crate::EngineError::DeadlineExceeded).
    pub deadline: Option<Instant>,
    /// Let the engine's speculative decoding (if configured) draft tokens for this request.
    pub speculate: bool,
    /// What every output must match (structured output); it ends as soon as it is complete.
    /// Such outputs sample on the CPU and do not speculate.
    pub constraint: Option<Constraint>,
}

impl Request {
    /// A text prompt with default settings: greedy, one output, up to the context length.
    pub fn text(prompt: impl Into<String>) -> Self {
        Self::new(Prompt::Text(prompt.into()))
    }

    /// A token-id prompt with default settings.
    pub fn tokens(ids: Vec<u32>) -> Self {
        Self::new(Prompt::TokenIds(ids))
    }

    fn new(prompt: Prompt) -> Self {
        Self {
            label: String::new(),
            prompt,
            sampling: SamplingParams::greedy(),
            seed: None,
            n: 1,
            stopping: StoppingCriteria::default(),
            output: OutputOptions::default(),
            priority: 0,
            deadline: None,
            speculate: true,
            constraint: None,
        }
    }

    pub fn max_new_tokens(mut self, n: usize) -> Self {
        self.stopping.max_new_tokens = Some(n);
        self
    }

    pub fn constrain(mut self, constraint: Constraint) -> Self {
        self.constraint = Some(constraint);
        self
    }

    pub fn sampling(mut self, params: SamplingParams, seed: u64) -> Self {
        self.sampling = params;
        self.seed = Some(seed);
        self
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// The model's context (or the engine's `max_model_len`) is full.
    ContextLength,
    /// The model produced an EOS id.
    EosToken,
    /// A stop string matched (the string).
    StopSequence(String),
    /// A stop token id was produced (the id).
    StopToken(u32),
    /// The request's constraint is complete: its grammar admits no further token.
    ConstraintComplete,
}

impl FinishReason {
    /// A short lowercase name (`length`, `context_length`, `eos_token`, `stop_sequence`,
    /// `stop_token`, `constraint_complete`), used as a metrics label.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::ContextLength => "context_length",
            Self::EosToken => "eos_token",
            Self::StopSequence(_) => "stop_sequence",
            Self::StopToken(_) => "stop_token",
            Self::ConstraintComplete => "constraint_complete",
        }
    }
}

/// Log-probability of one token (generated, or of the prompt) and its top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// `token`'s rank in its distribution: 1 for the most likely (ties by lower id).
    pub rank: usize,
    pub top: Vec<TokenLogprob>,
}

/// A prompt as the model scored it: its first token, which nothing predicts, then every later
/// one with its log-probability under the logits before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobs {
    pub first: u32,
    pub scores: Vec<TokenLogprobs>,
}

/// New output of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    /// Which of the `n` outputs.
    pub index: usize,
    pub token_ids: Vec<u32>,
    /// Text that is final: never ends inside a UTF-8 character, never holds part of a
    /// possible stop string.
    pub text: String,
    /// One entry per token when logprobs were asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// Set on the sequence's last delta.
    pub finish: Option<FinishReason>,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Over all `n` outputs.
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache at first admission.
    pub cached_prompt_tokens: usize,
}

/// Speculative decoding figures of one request (or of the engine so far).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Draft tokens proposed and verified.
    pub proposed_tokens: u64,
    /// Draft tokens the target model accepted.
    pub accepted_tokens: u64,
    /// Sequence steps that verified a draft (each also yields one token of the target's own).
    pub verify_steps: u64,
}

impl SpecStats {
    /// Accepted over proposed draft tokens (0 when nothing was proposed).
    pub fn acceptance_rate(&self) -> f64 {
        if self.proposed_tokens == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.proposed_tokens as f64
        }
    }

    /// Draft tokens accepted per verifying step (0 when none ran); each such step produced
    /// this plus one tokens.
    pub fn mean_accepted_length(&self) -> f64 {
        if self.verify_steps == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.verify_steps as f64
        }
    }
}

/// Where a finished request's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timing {
    /// Submission to first admission.
    pub queue: Duration,
    /// Submission to the first token.
    pub time_to_first_token: Duration,
    /// First token to last token.
    pub decode: Duration,
    /// Submission to the end.
    pub total: Duration,
    /// What speculative decoding did for this request (all zero when it did not run).
    pub speculative: SpecStats,
}

/// The last event of a successful request.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Finish reason of each output, by index.
    pub finish: Vec<FinishReason>,
    pub usage: Usage,
    pub timing: Timing,
}

/// What a request's stream yields: deltas, then exactly one `Finished` or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt's log-probabilities, when the request asked
    /// ([`OutputOptions::prompt_logprobs`]); sent once, before any delta.
    PromptLogprobs(PromptLogprobs),
    Delta(Delta),
    Finished(Summary),
    Error(crate::EngineError),
}

/// One output gathered from a whole stream.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SeqOutput {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub finish: Option<FinishReason>,
}

/// A whole request's result (what a unary call returns).
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The prompt's log-probabilities, when asked for.
    pub prompt_logprobs: Option<PromptLogprobs>,
    pub outputs: Vec<SeqOutput>,
    pub usage: Usage,
    pub timing: Timing,
}

/// Gathers a stream's events into an [`Output`].
#[derive(Debug, Default)]
pub(crate) struct OutputBuilder {
    prompt_logprobs: Option<PromptLogprobs>,
    outputs: Vec<SeqOutput>,
}

impl OutputBuilder {
    /// Takes one event; returns the result once the stream's last event arrived.
    pub(crate) fn push(&mut self, ev: Event) -> Option<Result<Output, crate::EngineError>> {
        match ev {
            Event::PromptLogprobs(lp) => {
                self.prompt_logprobs = Some(lp);
                None
            }
            Event::Delta(d) => {
                if self.outputs.len() <= d.index {
                    self.outputs.resize_with(d.index + 1, SeqOutput::default);
                }
                let o = &mut self.outputs[d.index];
                o.text.push_str(&d.text);
                o.token_ids.extend(d.token_ids);
                o.logprobs.extend(d.logprobs);
                if d.finish.is_some() {
                    o.finish = d.finish;
                }
                None
            }
            Event::Finished(s) => Some(Ok(Output {
                prompt_logprobs: self.prompt_logprobs.take(),
                outputs: std::mem::take(&mut self.outputs),
                usage: s.usage,
                timing: s.timing,
            })),
            Event::Error(e) => Some(Err(e)),
        }
    }
}
