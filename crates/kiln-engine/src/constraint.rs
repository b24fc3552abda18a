//! Structured output: a request's [`Constraint`] compiled by `llguidance` into a token-level
//! matcher over kiln's tokenizer ([`ConstraintCompiler`]), and each constrained output's [`Guide`]: the
//! allowed-token mask for its next token, computed on a worker thread while the step runs,
//! and the token it is told once sampling picked it.
//!
//! How a step overlaps: the mask for token N+1 depends on token N, so it cannot be computed
//! before token N is sampled; it starts on a rayon worker the moment token N is committed
//! (at admission for the first token), while the step loop sends the deltas and runs the next
//! forward pass, and sampling waits for it only if it is not done by then
//! (`kiln_structured_output_mask_wait_seconds`). Unconstrained sequences never touch any of
//! this. Constrained outputs sample on the CPU (their row is read back) and do not speculate.

use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kiln_tokenizer::{EncodeOptions, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::EngineError;
use crate::field::{ConstraintKind, Field};
use crate::metrics::EngineMetrics;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON value valid under this JSON Schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text in the language of this grammar (llguidance's Lark syntax; `start` is the start
    /// rule).
    Grammar(String),
    /// Exactly `text`, then what `then` admits: a reasoning model's output, whose prompt left
    /// a think block open, closes it before the constrained answer.
    After { text: String, then: Box<Constraint> },
}

impl Constraint {
    /// Which kind it is, as an error about it names it.
    pub fn kind(&self) -> ConstraintKind {
        match self {
            Self::JsonSchema(_) => ConstraintKind::JsonSchema,
            Self::JsonObject => ConstraintKind::JsonObject,
            Self::Regex(_) => ConstraintKind::Regex,
            Self::Choice(_) => ConstraintKind::Choice,
            Self::Grammar(_) => ConstraintKind::Grammar,
            Self::After { then, .. } => then.kind(),
        }
    }

    /// This constraint after exactly `text`.
    pub fn after(self, text: impl Into<String>) -> Self {
        Self::After {
            text: text.into(),
            then: Box::new(self),
        }
    }

    /// The llguidance grammar. JSON comes out compact, as Python's `json.dumps` writes it
    /// (`", "` between items, `": "` after keys, no other whitespace), unless the schema's own
    /// `x-guidance` options say otherwise: free whitespace lets a small model pad forever.
    fn grammar(&self) -> Result<TopLevelGrammar, BadConstraint> {
        Ok(match self {
            Self::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            Self::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&json!({"type": "object"})))
            }
            Self::Regex(rx) => {
                if rx.is_empty() {
                    return Err(BadConstraint::Empty);
                }
                TopLevelGrammar::from_regex(rx)
            }
            Self::Choice(_) => TopLevelGrammar::from_lark(format!("start: {}", self.lark_body()?)),
            Self::Grammar(g) => {
                if g.trim().is_empty() {
                    return Err(BadConstraint::Empty);
                }
                TopLevelGrammar::from_lark(g.clone())
            }
            Self::After { text, then } => {
                let literal = Value::String(text.clone()).to_string();
                TopLevelGrammar::from_lark(match then.as_ref() {
                    // A grammar's own start rule becomes the part after the text.
                    Self::Grammar(g) => {
                        if g.trim().is_empty() {
                            return Err(BadConstraint::Empty);
                        }
                        format!("start: {literal} kiln_then\n{}", rename_start(g))
                    }
                    then => format!("start: {literal} {}", then.lark_body()?),
                })
            }
        })
    }

    /// The constraint as one Lark expression (all but a whole grammar have one).
    fn lark_body(&self) -> Result<String, BadConstraint> {
        Ok(match self {
            Self::JsonSchema(schema) => format!("%json {}", compact(schema)),
            Self::JsonObject => format!("%json {}", compact(&json!({"type": "object"}))),
            Self::Regex(rx) => {
                if rx.is_empty() {
                    return Err(BadConstraint::Empty);
                }
                format!("/{}/", rx.replace('/', "\\/"))
            }
            Self::Choice(choices) => {
                if choices.is_empty() {
                    return Err(BadConstraint::NoChoices);
                }
                if let Some(i) = choices.iter().position(String::is_empty) {
                    return Err(BadConstraint::EmptyChoice(i));
                }
                // A JSON string is a Lark string literal with the same escapes.
                let literals: Vec<String> = choices
                    .iter()
                    .map(|c| Value::String(c.clone()).to_string())
                    .collect();
                format!("({})", literals.join(" | "))
            }
            Self::Grammar(_) => return Err(BadConstraint::NotAnExpression),
            Self::After { text, then } => {
                format!("{} {}", Value::String(text.clone()), then.lark_body()?)
            }
        })
    }
}

/// `g` with its `start` rule (a line starting `start:`) renamed `kiln_then`.
fn rename_start(g: &str) -> String {
    g.lines()
        .map(|line| {
            let body = line.trim_start();
            let indent = &line[..line.len() - body.len()];
            match body.strip_prefix("start").map(str::trim_start) {
                Some(rest) if rest.starts_with(':') => format!("{indent}kiln_then{rest}"),
                _ => line.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `schema` with kiln's JSON layout: compact, as Python's `json.dumps` writes it (`", "`
/// between items, `": "` after keys, no other whitespace), unless the schema's own
/// `x-guidance` options say otherwise: free whitespace lets a small model pad forever.
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert(json!({
            "whitespace_flexible": false,
            "item_separator": ", ",
            "key_separator": ": ",
        }));
    }
    schema
}

/// Why a constraint cannot be compiled before llguidance sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadConstraint {
    #[error("is empty")]
    Empty,
    #[error("lists no choices")]
    NoChoices,
    #[error("choice {0} is empty")]
    EmptyChoice(usize),
    #[error("a whole grammar cannot be part of another constraint")]
    NotAnExpression,
}

/// The tokenizer as llguidance sees it: the byte trie of every token, and encoding through
/// kiln's own tokenizer (so forced tokens are the ones the model was trained on).
struct KilnTokEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for KilnTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let plain = EncodeOptions {
            add_special_tokens: false,
            ..EncodeOptions::default()
        };
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode_with(text, plain) {
                Ok(enc) => enc.ids,
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles constraints into llguidance matchers over one model's tokenizer (the engine builds
/// one on the first constrained request: the token trie and llguidance's token slices take a
/// moment for a large vocabulary). Public so tools can drive a matcher themselves (the bench
/// times masks by replaying outputs through one).
pub struct ConstraintCompiler {
    factory: ParserFactory,
    /// The model's EOS ids: allowed together whenever the grammar allows its EOS.
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for ConstraintCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintCompiler")
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// Why constrained decoding is unavailable for a model, or failed for an output.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConstraintError {
    #[error("the model has no EOS token to end a constrained output with")]
    NoEos,
    #[error(
        "the tokenizer's decoder is neither byte-level nor SentencePiece, so its tokens have \
         no bytes of their own"
    )]
    NoTokenBytes,
    #[error("a vocabulary of {0} tokens does not fit llguidance's u32 token ids")]
    VocabularyTooLarge(usize),
    #[error("llguidance's parser factory")]
    Factory(#[source] Cause),
    #[error("the grammar refused token {token}")]
    Refused {
        token: u32,
        #[source]
        source: Cause,
    },
    #[error("computing the next token's mask")]
    Mask(#[source] Cause),
    /// A mask or token asked for after the grammar ended the output.
    #[error("the output has ended")]
    Ended,
    /// The mask worker went away without its result (it panicked).
    #[error("the structured-output worker was lost")]
    WorkerLost,
}

/// llguidance's error, shared (a mask's error is kept and reported to each read of it).
pub type Cause = Arc<dyn std::error::Error + Send + Sync>;

fn cause(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Cause {
    Arc::from(e.into())
}

impl ConstraintCompiler {
    /// A compiler for `tokenizer`, whose first `eos` id is the one llguidance allows when a
    /// constraint may end. `Err` says why constrained decoding is unavailable (the tokenizer's
    /// tokens have no bytes of their own, or the model has no EOS).
    pub fn new(tokenizer: &Tokenizer, eos: &[u32]) -> Result<Self, ConstraintError> {
        let &tok_eos = eos.first().ok_or(ConstraintError::NoEos)?;
        let tokens = tokenizer
            .token_bytes()
            .ok_or(ConstraintError::NoTokenBytes)?;
        let words: Vec<Vec<u8>> = tokens
            .into_iter()
            .map(|t| {
                if t.special {
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend(t.bytes);
                    marked
                } else {
                    t.bytes
                }
            })
            .collect();
        let vocab = u32::try_from(words.len())
            .map_err(|_| ConstraintError::VocabularyTooLarge(words.len()))?;
        let info = TokRxInfo::new(vocab, tok_eos);
        let env: TokEnv = Arc::new(KilnTokEnv {
            trie: TokTrie::from(&info, &words),
            tokenizer: tokenizer.clone(),
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Factory(cause(e)))?;
        factory.quiet();
        Ok(Self {
            factory,
            eos: eos.into(),
        })
    }

    /// The constraint's matcher, fresh; an invalid schema, regex or grammar is an
    /// `InvalidArgument` naming the field and what llguidance found wrong.
    pub fn compile(&self, c: &Constraint) -> Result<Matcher, EngineError> {
        let field = Field::Constraint(c.kind());
        let grammar = c
            .grammar()
            .map_err(|e| EngineError::invalid_because(field, "cannot be compiled", e))?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| EngineError::invalid(field, first_line(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(EngineError::invalid(field, first_line(&e)));
        }
        Ok(matcher)
    }

    pub(crate) fn eos(&self) -> Arc<[u32]> {
        self.eos.clone()
    }
}

/// llguidance's errors can carry the whole grammar after the first line; a client needs the
/// reason.
fn first_line(e: &str) -> String {
    let line = e.lines().next().unwrap_or(e).trim();
    let mut s: String = line.chars().take(500).collect();
    if s.len() < line.len() {
        s.push('…');
    }
    s
}

/// A mask computed on a worker, and the matcher it was computed with.
struct Computed {
    matcher: Box<Matcher>,
    mask: Result<SimpleVob, ConstraintError>,
    took: Duration,
}

enum State {
    /// A worker is computing the mask for the next token.
    Computing(mpsc::Receiver<Computed>),
    /// The mask for the next token is here.
    Ready {
        matcher: Box<Matcher>,
        mask: Result<SimpleVob, ConstraintError>,
    },
    /// The worker went away without its result (it panicked).
    Lost,
}

/// One constrained output: its matcher and the mask for its next token.
pub(crate) struct Guide {
    state: State,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").finish_non_exhaustive()
    }
}

/// What a committed token did to the grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Committed {
    /// More tokens may follow; the next mask is being computed.
    Going,
    /// The grammar is complete and admits nothing more: the output ends here.
    Complete,
}

impl Guide {
    /// Starts computing the first token's mask at once.
    pub fn new(matcher: Matcher, eos: Arc<[u32]>) -> Self {
        Self {
            state: spawn(Box::new(matcher), eos.clone()),
            eos,
        }
    }

    /// A copy at the same point of the grammar (for the other outputs of `n > 1`), computing
    /// its own mask.
    pub fn fork(&mut self, metrics: &EngineMetrics) -> Result<Self, ConstraintError> {
        self.wait(metrics);
        match &self.state {
            State::Ready { matcher, .. } => Ok(Self {
                state: spawn(Box::new(matcher.deep_clone()), self.eos.clone()),
                eos: self.eos.clone(),
            }),
            _ => Err(ConstraintError::WorkerLost),
        }
    }

    fn wait(&mut self, metrics: &EngineMetrics) {
        if let State::Computing(rx) = &self.state {
            let t = Instant::now();
            self.state = match rx.recv() {
                Ok(c) => {
                    metrics.mask_wait.observe(t.elapsed().as_secs_f64());
                    metrics.mask_compute.observe(c.took.as_secs_f64());
                    State::Ready {
                        matcher: c.matcher,
                        mask: c.mask,
                    }
                }
                Err(_) => State::Lost,
            };
        }
    }

    /// The ids allowed next, one bit each (bit `id % 32` of word `id / 32`); every EOS id when
    /// the grammar allows EOS. Waits for the worker if it is still computing.
    pub fn mask(&mut self, metrics: &EngineMetrics) -> Result<&[u32], ConstraintError> {
        self.wait(metrics);
        match &mut self.state {
            State::Ready { mask: Ok(mask), .. } => Ok(mask.as_slice()),
            State::Ready { mask: Err(e), .. } => Err(e.clone()),
            State::Computing(_) | State::Lost => Err(ConstraintError::WorkerLost),
        }
    }

    /// Tells the grammar the token sampling picked (from the mask) and starts the next mask.
    pub fn commit(
        &mut self,
        token: u32,
        metrics: &EngineMetrics,
    ) -> Result<Committed, ConstraintError> {
        self.wait(metrics);
        let State::Ready { mut matcher, .. } = std::mem::replace(&mut self.state, State::Lost)
        else {
            return Err(ConstraintError::WorkerLost);
        };
        if self.eos.contains(&token) {
            // Only reachable when the grammar allowed its EOS: the output is complete.
            self.state = State::Ready {
                matcher,
                mask: Err(ConstraintError::Ended),
            };
            return Ok(Committed::Complete);
        }
        matcher
            .consume_token(token)
            .map_err(|e| ConstraintError::Refused {
                token,
                source: cause(e),
            })?;
        if matcher.is_stopped() {
            self.state = State::Ready {
                matcher,
                mask: Err(ConstraintError::Ended),
            };
            return Ok(Committed::Complete);
        }
        self.state = spawn(matcher, self.eos.clone());
        Ok(Committed::Going)
    }
}

/// Computes `matcher`'s next mask on a rayon worker; every id of `eos` is allowed when the
/// first (the one llguidance knows) is.
fn spawn(matcher: Box<Matcher>, eos: Arc<[u32]>) -> State {
    let (tx, rx) = mpsc::sync_channel(1);
    rayon::spawn(move || {
        let mut matcher = matcher;
        let t = Instant::now();
        let mut mask = matcher
            .compute_mask()
            .map_err(|e| ConstraintError::Mask(cause(e)));
        if let Ok(m) = &mut mask
            && eos.first().is_some_and(|&e| m.is_allowed(e))
        {
            let len = m.len();
            for &e in eos.iter().filter(|&&e| (e as usize) < len) {
                m.allow_token(e);
            }
        }
        let took = t.elapsed();
        let _ = tx.send(Computed {
            matcher,
            mask,
            took,
        });
    });
    State::Computing(rx)
}
