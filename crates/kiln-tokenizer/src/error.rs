//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong loading or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON or does not have the expected shape.
    #[error("{}: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// What the JSON parser said (with line and column).
        #[source]
        source: serde_json::Error,
    },
    /// A field of a config file has a value this crate cannot use.
    #[error("{}: field `{field}`: {detail}", path.display())]
    ConfigField {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The `tokenizers` library rejected a tokenizer definition.
    #[error("{source_name}: cannot build tokenizer: {source}")]
    Build {
        /// The file (or `GGUF metadata`) the definition came from.
        source_name: String,
        /// What `tokenizers` said.
        #[source]
        source: tokenizers::Error,
    },
    /// The GGUF container could not be read.
    #[error(transparent)]
    Gguf(#[from] kiln_gguf::GgufError),
    /// A `tokenizer.ggml.*` key is missing or has the wrong shape.
    #[error("GGUF metadata `{key}`: {detail}")]
    GgufMetadata {
        /// The key.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer kind this crate does not build.
    #[error("GGUF tokenizer model `{model}` is not supported (kiln supports `gpt2` and `llama`)")]
    UnknownModel {
        /// The value of `tokenizer.ggml.model`.
        model: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not know.
    #[error("GGUF pre-tokenizer `{pre}` is not supported (kiln supports {supported})")]
    UnknownPreTokenizer {
        /// The value of `tokenizer.ggml.pre`.
        pre: String,
        /// The names that are supported.
        supported: String,
    },
    /// A tokenizer built from a GGUF file failed; says which file.
    #[error("{}: {source}", path.display())]
    InFile {
        /// The GGUF file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: Box<TokenizerError>,
    },
    /// Encoding failed inside `tokenizers`.
    #[error("cannot encode text: {source}")]
    Encode {
        /// What `tokenizers` said.
        #[source]
        source: tokenizers::Error,
    },
    /// Decoding failed inside `tokenizers`.
    #[error("cannot decode ids: {source}")]
    Decode {
        /// What `tokenizers` said.
        #[source]
        source: tokenizers::Error,
    },
    /// An id outside the vocabulary was given to decode.
    #[error("token id {id} is not in the vocabulary (size {vocab_size})")]
    UnknownTokenId {
        /// The id.
        id: u32,
        /// Ids run from 0 to this, exclusive.
        vocab_size: u32,
    },
    /// A chat template does not compile.
    /// The model has no chat template and its vocabulary has no ChatML tokens to fall back on.
    #[error(
        "the model has no chat template (and no ChatML tokens to fall back on): pass one with --chat-template"
    )]
    NoChatTemplate,
    #[error("chat template `{name}` does not compile: {detail}")]
    TemplateSyntax {
        /// Where the template came from.
        name: String,
        /// The error, with line number.
        detail: String,
    },
    /// Message content that spells special tokens is kept plain text by tokenizing it apart
    /// from the template's own text; a template that rewrites that content (trims it, say)
    /// leaves no faithful place to cut.
    #[error(
        "messages[{message}].content spells special tokens (such as `{token}`) and the chat \
         template rewrites it, so it cannot be kept plain text: remove the control tokens"
    )]
    ContentRewritten {
        /// The message's index.
        message: usize,
        /// One special token it spells.
        token: String,
    },
    /// A chat template failed while rendering, or called `raise_exception`.
    #[error("chat template `{name}` failed: {detail}")]
    TemplateRender {
        /// Where the template came from.
        name: String,
        /// The error, with line number, or the template's own message.
        detail: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
