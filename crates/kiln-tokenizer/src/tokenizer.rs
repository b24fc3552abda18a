//! The `Tokenizer`: a loaded `tokenizers::Tokenizer` plus what the model says about its special
//! tokens and chat template.

use std::sync::{Arc, OnceLock};

use aho_corasick::AhoCorasick;

use crate::chat::{ChatMessage, ChatOptions, ChatTemplate};
use crate::detok::IncrementalDetokenizer;
use crate::error::{Result, TokenizerError};
use crate::pieces::{Piece, PieceTable, Scheme};

/// The model's special tokens and how encoding uses them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// The end-of-sequence token the model was trained with.
    pub eos: Option<u32>,
    /// Every id that ends generation: `eos` first, then any others the model lists
    /// (`generation_config.json`'s `eos_token_id` list, GGUF end-of-turn ids).
    pub stop_ids: Vec<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Padding token.
    pub pad: Option<u32>,
    /// Whether encoding with special tokens puts `bos` in front.
    pub add_bos: bool,
    /// Whether encoding with special tokens puts `eos` at the end.
    pub add_eos: bool,
}

/// How to encode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add the model's BOS/EOS as its post-processor says (the default, as Hugging Face does).
    pub add_special_tokens: bool,
    /// Compute byte offsets of each token in the input.
    pub offsets: bool,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        Self {
            add_special_tokens: true,
            offsets: false,
        }
    }
}

/// How to decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Leave out special tokens (`<|im_end|>` and the like).
    pub skip_special_tokens: bool,
}

/// The result of encoding one text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Encoding {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Byte range of each token in the input text (empty unless asked for); added special
    /// tokens such as BOS get `(0, 0)`.
    pub offsets: Vec<(usize, usize)>,
}

/// One token's bytes (see [`Tokenizer::token_bytes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBytes {
    pub bytes: Vec<u8>,
    /// An added special token (its bytes are its name, such as `<|im_end|>`).
    pub special: bool,
}

/// A tokenizer for one model. Cheap to clone (shared inside).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    tokenizer: tokenizers::Tokenizer,
    specials: SpecialTokens,
    chat_template: Option<ChatTemplate>,
    pieces: PieceTable,
    vocab_size: u32,
    longest_token: usize,
    /// Finds special tokens' spellings in text (built on first use).
    spellings: OnceLock<Option<AhoCorasick>>,
    /// The tokenizer with special tokens read as plain text (built on first use).
    plain: OnceLock<tokenizers::Tokenizer>,
}

impl Tokenizer {
    /// Wraps a `tokenizers::Tokenizer`. `chat_template` is the model's Jinja template, if it
    /// has one (compiled now, so a broken template fails here). `add_bos`/`add_eos` in
    /// `specials` are recomputed from what the tokenizer's post-processor really does.
    pub fn new(
        tokenizer: tokenizers::Tokenizer,
        mut specials: SpecialTokens,
        chat_template: Option<&str>,
    ) -> Result<Self> {
        let chat_template = chat_template
            .map(|source| ChatTemplate::new("model", source))
            .transpose()?;
        let pieces = PieceTable::build(&tokenizer);
        let vocab_size = pieces.len();
        // An unknown decoder has no byte table: its vocabulary's spellings bound it instead.
        let longest_token = match pieces.scheme() {
            Scheme::Generic => (0..vocab_size)
                .filter_map(|id| tokenizer.id_to_token(id))
                .map(|t| t.len())
                .max()
                .unwrap_or(1)
                .max(1),
            _ => pieces.longest(),
        };
        let probe = tokenizer
            .encode_fast("", true)
            .map_err(|source| TokenizerError::Encode { source })?;
        let ids = probe.get_ids();
        specials.add_bos = specials.bos.is_some() && ids.first() == specials.bos.as_ref();
        specials.add_eos = specials.eos.is_some() && ids.last() == specials.eos.as_ref();
        if let Some(eos) = specials.eos
            && !specials.stop_ids.contains(&eos)
        {
            specials.stop_ids.insert(0, eos);
        }
        Ok(Self {
            inner: Arc::new(Inner {
                tokenizer,
                specials,
                chat_template,
                pieces,
                vocab_size,
                longest_token,
                spellings: OnceLock::new(),
                plain: OnceLock::new(),
            }),
        })
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner.tokenizer
    }

    /// Special tokens and whether encoding adds BOS/EOS.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.inner.specials
    }

    /// Ids run from 0 to this, exclusive (added tokens included).
    pub fn vocab_size(&self) -> u32 {
        self.inner.vocab_size
    }

    /// The most bytes of text one token stands for (special tokens included): a text of `n`
    /// bytes needs at least `n / longest_token_bytes()` tokens (before normalization), which
    /// bounds a prompt without tokenizing it.
    pub fn longest_token_bytes(&self) -> usize {
        self.inner.longest_token
    }

    /// The first special token `text` spells, if any (`<|im_start|>` in a user's message).
    pub fn spelled_special(&self, text: &str) -> Option<String> {
        let finder = self.inner.spellings.get_or_init(|| {
            let spellings: Vec<String> = self
                .inner
                .tokenizer
                .get_added_tokens_decoder()
                .into_values()
                .filter(|t| t.special && !t.content.is_empty())
                .map(|t| t.content)
                .collect();
            AhoCorasick::new(&spellings).ok()
        });
        let m = finder.as_ref()?.find(text)?;
        Some(text[m.range()].to_owned())
    }

    /// Token ids of `text` with special-token spellings read as the plain text they are,
    /// nothing added.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let plain = self.inner.plain.get_or_init(|| {
            let mut t = self.inner.tokenizer.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = plain
            .encode_fast(text, false)
            .map_err(|source| TokenizerError::Encode { source })?;
        Ok(enc.get_ids().to_vec())
    }

    /// The id of a token string (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tokenizer.token_to_id(token)
    }

    /// The token string of an id, as the vocabulary spells it (`Ġ` for a byte-level space).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tokenizer.id_to_token(id)
    }

    /// Whether `id` is a special token (skipped by `skip_special_tokens`).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.pieces.is_special(id)
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.inner.chat_template.as_ref()
    }

    pub(crate) fn pieces(&self) -> &PieceTable {
        &self.inner.pieces
    }

    /// Token ids of `text`, special tokens added as the model does by default.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_with(text, EncodeOptions::default())?.ids)
    }

    /// Encodes with explicit options.
    pub fn encode_with(&self, text: &str, options: EncodeOptions) -> Result<Encoding> {
        let tok = &self.inner.tokenizer;
        let enc = if options.offsets {
            tok.encode(text, options.add_special_tokens)
        } else {
            tok.encode_fast(text, options.add_special_tokens)
        }
        .map_err(|source| TokenizerError::Encode { source })?;
        Ok(convert(enc, options.offsets))
    }

    /// Encodes many texts (in parallel inside `tokenizers`).
    pub fn encode_batch(&self, texts: &[&str], options: EncodeOptions) -> Result<Vec<Encoding>> {
        let tok = &self.inner.tokenizer;
        let inputs = texts.to_vec();
        let encs = if options.offsets {
            tok.encode_batch(inputs, options.add_special_tokens)
        } else {
            tok.encode_batch_fast(inputs, options.add_special_tokens)
        }
        .map_err(|source| TokenizerError::Encode { source })?;
        Ok(encs
            .into_iter()
            .map(|e| convert(e, options.offsets))
            .collect())
    }

    /// Text of `ids`, special tokens kept.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, DecodeOptions::default())
    }

    /// Decodes with explicit options. Ids outside the vocabulary are an error.
    pub fn decode_with(&self, ids: &[u32], options: DecodeOptions) -> Result<String> {
        self.check_ids(ids)?;
        self.inner
            .tokenizer
            .decode(ids, options.skip_special_tokens)
            .map_err(|source| TokenizerError::Decode { source })
    }

    pub(crate) fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| !self.inner.pieces.contains(id)) {
            Some(&id) => Err(TokenizerError::UnknownTokenId {
                id,
                vocab_size: self.inner.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// Every id's bytes as the decoder writes them, special tokens flagged: what a token-level
    /// grammar engine (llguidance's token trie) walks. `None` when the decoder is neither
    /// GPT-2 byte-level nor SentencePiece-style (the bytes of a token are then not defined on
    /// their own); ids missing from the vocabulary get no bytes.
    pub fn token_bytes(&self) -> Option<Vec<TokenBytes>> {
        let pieces = self.pieces();
        if pieces.scheme() == Scheme::Generic {
            return None;
        }
        let bytes = (0..pieces.len())
            .map(|id| TokenBytes {
                bytes: match pieces.piece(id) {
                    Some(Piece::Bytes(b)) => b.to_vec(),
                    Some(Piece::Byte(b)) => vec![b],
                    None => Vec::new(),
                },
                special: pieces.is_special(id),
            })
            .collect();
        Some(bytes)
    }

    /// A detokenizer that turns ids, fed one at a time, into UTF-8-safe text deltas.
    pub fn detokenizer(&self, options: DecodeOptions) -> IncrementalDetokenizer {
        IncrementalDetokenizer::new(self.clone(), options)
    }

    /// Renders `messages` with the model's chat template; a model without one gets ChatML
    /// only when its vocabulary has ChatML's `<|im_start|>`/`<|im_end|>` tokens (a model
    /// trained on other markup, Gemma's GGUF say, would get a prompt it never saw).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<String> {
        self.apply_chat_template_with(messages, options, &serde_json::Map::new())
    }

    /// [`apply_chat_template`](Self::apply_chat_template) with more template variables (see
    /// [`render_chat_with`](Self::render_chat_with)); messages may be JSON objects that carry
    /// tool fields.
    pub fn apply_chat_template_with<M: serde::Serialize, E: serde::Serialize>(
        &self,
        messages: &[M],
        options: &ChatOptions,
        extra: &E,
    ) -> Result<String> {
        match &self.inner.chat_template {
            Some(template) => self.render_chat_with(template, messages, options, extra),
            None if self.has_chatml() => {
                self.render_chat_with(&ChatTemplate::chatml()?, messages, options, extra)
            }
            None => Err(TokenizerError::NoChatTemplate),
        }
    }

    /// The source of the template [`apply_chat_template`](Self::apply_chat_template) renders
    /// with, if any.
    pub fn default_chat_template_source(&self) -> Option<&str> {
        match &self.inner.chat_template {
            Some(t) => Some(t.source()),
            None if self.has_chatml() => Some(crate::chat::CHATML_TEMPLATE),
            None => None,
        }
    }

    fn has_chatml(&self) -> bool {
        self.token_to_id("<|im_start|>").is_some() && self.token_to_id("<|im_end|>").is_some()
    }

    /// Renders `messages` with `template` (say, one given on the command line), passing this
    /// tokenizer's BOS and EOS token strings.
    pub fn render_chat<M: serde::Serialize>(
        &self,
        template: &ChatTemplate,
        messages: &[M],
        options: &ChatOptions,
    ) -> Result<String> {
        self.render_chat_with(template, messages, options, &serde_json::Map::new())
    }

    /// [`render_chat`](Self::render_chat) with more template variables, as the keyword
    /// arguments of transformers' `apply_chat_template` (`{"tools": [...]}`, say).
    pub fn render_chat_with<M: serde::Serialize, E: serde::Serialize>(
        &self,
        template: &ChatTemplate,
        messages: &[M],
        options: &ChatOptions,
        extra: &E,
    ) -> Result<String> {
        let bos = self.inner.specials.bos.and_then(|id| self.id_to_token(id));
        let eos = self.inner.specials.eos.and_then(|id| self.id_to_token(id));
        template.render_with(messages, options, extra, bos.as_deref(), eos.as_deref())
    }
}

fn convert(enc: tokenizers::Encoding, offsets: bool) -> Encoding {
    Encoding {
        ids: enc.get_ids().to_vec(),
        offsets: if offsets {
            enc.get_offsets().to_vec()
        } else {
            Vec::new()
        },
    }
}
