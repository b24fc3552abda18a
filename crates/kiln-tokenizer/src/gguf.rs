//! Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! The result is a real `tokenizers::Tokenizer` shaped like the one Hugging Face builds for the
//! same vocabulary: byte-level BPE from tokens + merges for `gpt2`, SentencePiece-style BPE with
//! merges recovered from the vocabulary for `llama` (Llama's shape, or Gemma's for the `gemma*`
//! architectures, as transformers picks them).

use std::borrow::Cow;
use std::collections::HashSet;

use kiln_gguf::Metadata;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, SplitDelimiterBehavior};

use crate::error::{Result, TokenizerError};
use crate::pieces::byte_level_decoding;
use crate::pretok;
use crate::tokenizer::{SpecialTokens, Tokenizer};

const SOURCE: &str = "GGUF metadata";

/// llama.cpp's token types.
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Control tokens that end a turn in well-known chat formats. llama.cpp stops on these too when
/// the file names no `eot_token_id` (Gemma's files don't; its `generation_config.json` lists
/// `<end_of_turn>` beside `<eos>`).
const END_OF_TURN: [&str; 3] = ["<end_of_turn>", "<|im_end|>", "<|eot_id|>"];

fn meta_err(key: &str, detail: impl Into<String>) -> TokenizerError {
    TokenizerError::GgufMetadata {
        key: key.to_owned(),
        detail: detail.into(),
    }
}

fn build_err(source: impl Into<tokenizers::Error>) -> TokenizerError {
    TokenizerError::Build {
        source_name: SOURCE.to_owned(),
        source: source.into(),
    }
}

/// What both tokenizer kinds read.
struct Common<'a> {
    tokens: Cow<'a, [String]>,
    types: Vec<i64>,
    specials: SpecialTokens,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<&'a str>,
}

fn read_common(md: &Metadata, default_add_bos: bool) -> Result<Common<'_>> {
    let tokens = md
        .get_strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| meta_err("tokenizer.ggml.tokens", "missing"))?;
    let types = match md.get_i64s("tokenizer.ggml.token_type")? {
        Some(t) if t.len() != tokens.len() => {
            return Err(meta_err(
                "tokenizer.ggml.token_type",
                format!("{} entries for {} tokens", t.len(), tokens.len()),
            ));
        }
        Some(t) => t,
        None => Vec::new(),
    };
    let id = |key: &str| -> Result<Option<u32>> {
        match md.get_u32(key)? {
            Some(id) if id as usize >= tokens.len() => Err(meta_err(
                key,
                format!("id {id} is outside the {}-token vocabulary", tokens.len()),
            )),
            other => Ok(other),
        }
    };
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let mut stop_ids: Vec<u32> = eos.into_iter().collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(extra) = id(key)?
            && !stop_ids.contains(&extra)
        {
            stop_ids.push(extra);
        }
    }
    if md.get_u32("tokenizer.ggml.eot_token_id")?.is_none() {
        for (id, (token, &ty)) in (0u32..).zip(tokens.iter().zip(&types)) {
            if ty == TYPE_CONTROL
                && END_OF_TURN.contains(&token.as_str())
                && !stop_ids.contains(&id)
            {
                stop_ids.push(id);
            }
        }
    }
    Ok(Common {
        tokens: Cow::Borrowed(tokens),
        types,
        specials: SpecialTokens {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos,
            stop_ids,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos: false,
            add_eos: false,
        },
        add_bos: md
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(default_add_bos),
        add_eos: md
            .get_bool("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false),
        chat_template: md.get_str("tokenizer.chat_template")?,
    })
}

/// Builds the tokenizer a GGUF file describes.
pub(crate) fn from_metadata(md: &Metadata) -> Result<Tokenizer> {
    let model = md
        .get_str("tokenizer.ggml.model")?
        .ok_or_else(|| meta_err("tokenizer.ggml.model", "missing"))?;
    match model {
        "gpt2" => byte_level_bpe(md),
        "llama" => sentencepiece_bpe(md),
        other => Err(TokenizerError::UnknownModel {
            model: other.to_owned(),
        }),
    }
}

fn byte_level_bpe(md: &Metadata) -> Result<Tokenizer> {
    let c = read_common(md, false)?;
    let merges = md
        .get_strings("tokenizer.ggml.merges")?
        .ok_or_else(|| meta_err("tokenizer.ggml.merges", "missing (needed for `gpt2`)"))?;
    let alphabet: HashSet<char> = byte_level_decoding().into_keys().collect();
    let mut char_of_byte = ['\0'; 256];
    for (c, b) in byte_level_decoding() {
        char_of_byte[usize::from(b)] = c;
    }
    // Tokens outside the byte alphabet are stored as plain text; spell them byte-level so
    // the BPE model can reach them.
    let spell = |t: &str| -> String {
        if t.chars().all(|c| alphabet.contains(&c)) {
            t.to_owned()
        } else {
            t.bytes().map(|b| char_of_byte[usize::from(b)]).collect()
        }
    };
    let vocab: Vocab = c
        .tokens
        .iter()
        .zip(0u32..)
        .map(|(t, i)| (spell(t), i))
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| {
                    meta_err("tokenizer.ggml.merges", format!("entry {m:?} has no space"))
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab.clone(), merges)
        .build()
        .map_err(build_err)?;
    let (normalizer, pre) = pretok::for_name(md.get_str("tokenizer.ggml.pre")?)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_normalizer(normalizer)
        .map_err(build_err)?
        .with_pre_tokenizer(Some(pre))
        .with_decoder(Some(ByteLevel::default()));
    let in_alphabet = |t: &str| t.chars().all(|c| alphabet.contains(&c));
    finish(tok, c, |t| in_alphabet(t), |t| vocab.contains_key(t))
}

/// Which Hugging Face class a SentencePiece vocabulary becomes; transformers picks it by
/// `general.architecture`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpmShape {
    /// `LlamaTokenizer`: `Metaspace` (a `▁` prefix unless `add_space_prefix` is false), merges
    /// ranked by the file's scores.
    Llama,
    /// `GemmaTokenizer`: a normalizer turns spaces into `▁`, no prefix. Gemma files store tokens
    /// of several spaces as real spaces (respelled as `▁`s here), and their scores do not follow
    /// the merge order: the order of the tokens in the file does.
    Gemma,
}

fn sentencepiece_bpe(md: &Metadata) -> Result<Tokenizer> {
    let mut c = read_common(md, true)?;
    let shape = match md.get_str("general.architecture")? {
        Some("gemma" | "gemma2" | "gemma3") => SpmShape::Gemma,
        _ => SpmShape::Llama,
    };
    let file_scores = md
        .get_f32s("tokenizer.ggml.scores")?
        .ok_or_else(|| meta_err("tokenizer.ggml.scores", "missing (needed for `llama`)"))?;
    if file_scores.len() != c.tokens.len() {
        return Err(meta_err(
            "tokenizer.ggml.scores",
            format!("{} scores for {} tokens", file_scores.len(), c.tokens.len()),
        ));
    }
    let scores: Cow<'_, [f32]> = match shape {
        SpmShape::Llama => Cow::Borrowed(file_scores),
        SpmShape::Gemma => {
            if c.tokens.iter().any(|t| spaces_as_metaspace(t).is_some()) {
                let respelled = c
                    .tokens
                    .iter()
                    .map(|t| spaces_as_metaspace(t).unwrap_or_else(|| t.clone()))
                    .collect();
                c.tokens = Cow::Owned(respelled);
            }
            // Exact in f32: vocabularies stay far below 2^24 tokens.
            Cow::Owned((0..c.tokens.len()).map(|i| -(i as f32)).collect())
        }
    };
    let vocab: Vocab = c.tokens.iter().cloned().zip(0u32..).collect();
    let merges = merges_from_scores(&c.tokens, &scores, &vocab);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab.clone(), merges)
        .fuse_unk(true)
        .byte_fallback(true);
    if let Some(unk) = c.specials.unk.and_then(|id| c.tokens.get(id as usize)) {
        builder = builder.unk_token(unk.clone());
    }
    let bpe = builder.build().map_err(build_err)?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("\u{2581}", " ").map_err(build_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    let mut tok = tokenizers::Tokenizer::new(bpe);
    match shape {
        SpmShape::Llama => {
            let add_space_prefix = md
                .get_bool("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(true);
            let scheme = if add_space_prefix {
                PrependScheme::First
            } else {
                PrependScheme::Never
            };
            if add_space_prefix {
                decoders.push(Strip::new(' ', 1, 0).into());
            }
            tok.with_pre_tokenizer(Some(Metaspace::new('\u{2581}', scheme, false)));
        }
        SpmShape::Gemma => {
            // After the normalizer there is no space left to split on; the split is kept so
            // the pipeline is the one Hugging Face serializes for Gemma.
            let split = Split::new(
                SplitPattern::String(" ".into()),
                SplitDelimiterBehavior::MergedWithPrevious,
                false,
            )
            .map_err(build_err)?;
            tok.with_normalizer(Some(Replace::new(" ", "\u{2581}").map_err(build_err)?))
                .map_err(build_err)?
                .with_pre_tokenizer(Some(split));
        }
    }
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    finish(tok, c, |_| true, |t| vocab.contains_key(t))
}

/// A Gemma token made only of whitespace, at least one of it a space, spelled with one `▁` per
/// character, as transformers respells it; `None` for any other token.
fn spaces_as_metaspace(token: &str) -> Option<String> {
    // Python's `str.isspace`, which also counts the separators U+001C..U+001F.
    let py_space = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
    (token.contains(' ') && token.chars().all(py_space))
        .then(|| "\u{2581}".repeat(token.chars().count()))
}

/// SentencePiece BPE merges: every split of a token into two tokens, best merged score first
/// (ties: longer left piece, then longer right piece, then file order), as Hugging Face
/// recovers them. A token listed twice counts once, at its first place with its last id's
/// score (a Python dict's order and value).
fn merges_from_scores(tokens: &[String], scores: &[f32], vocab: &Vocab) -> Vec<(String, String)> {
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    let mut local = Vec::new();
    let mut seen: HashSet<&str> = HashSet::with_capacity(tokens.len());
    for token in tokens {
        if !seen.insert(token.as_str()) {
            continue;
        }
        let Some(score) = vocab.get(token).and_then(|&id| scores.get(id as usize)) else {
            continue;
        };
        local.clear();
        for (i, _) in token.char_indices().skip(1) {
            let (l, r) = token.split_at(i);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                local.push((li, ri, l, r));
            }
        }
        local.sort_by_key(|&(li, ri, _, _)| (li, ri));
        merges.extend(local.iter().map(|&(_, _, l, r)| (l, r, *score)));
    }
    let chars = |s: &str| s.chars().count();
    merges.sort_by(|a, b| {
        b.2.partial_cmp(&a.2)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| chars(b.0).cmp(&chars(a.0)))
            .then_with(|| chars(b.1).cmp(&chars(a.1)))
    });
    merges
        .into_iter()
        .map(|(l, r, _)| (l.to_owned(), r.to_owned()))
        .collect()
}

/// Adds control/user-defined tokens, BOS/EOS post-processing, and wraps it all.
fn finish(
    mut tok: tokenizers::Tokenizer,
    c: Common<'_>,
    may_be_special: impl Fn(&str) -> bool,
    in_vocab: impl Fn(&str) -> bool,
) -> Result<Tokenizer> {
    let typed = |ty: i64| {
        c.tokens
            .iter()
            .zip(&c.types)
            .filter(move |&(_, &t)| t == ty)
            .map(|(tok, _)| tok.as_str())
    };
    let named = [
        c.specials.bos,
        c.specials.eos,
        c.specials.unk,
        c.specials.pad,
    ];
    let mut seen = HashSet::new();
    let special: Vec<AddedToken> = named
        .iter()
        .flatten()
        .filter_map(|&id| c.tokens.get(id as usize))
        .map(String::as_str)
        .chain(typed(TYPE_CONTROL))
        .filter(|t| may_be_special(t) && seen.insert(*t))
        .map(|t| AddedToken::from(t, true).normalized(false))
        .collect();
    tok.add_special_tokens(special).map_err(build_err)?;
    let user: Vec<AddedToken> = typed(TYPE_USER_DEFINED)
        .filter(|t| in_vocab(t))
        .map(|t| AddedToken::from(t, false).normalized(false))
        .collect();
    tok.add_tokens(user).map_err(build_err)?;

    let name = |id: Option<u32>| id.and_then(|id| c.tokens.get(id as usize)).cloned();
    let post = bos_eos_processor(
        name(c.specials.bos)
            .zip(c.specials.bos)
            .filter(|_| c.add_bos),
        name(c.specials.eos)
            .zip(c.specials.eos)
            .filter(|_| c.add_eos),
    )?;
    tok.with_post_processor(Some(post));
    Tokenizer::new(tok, c.specials, c.chat_template)
}

/// The post-processor Hugging Face writes for `add_bos_token` / `add_eos_token`.
pub(crate) fn bos_eos_processor(
    bos: Option<(String, u32)>,
    eos: Option<(String, u32)>,
) -> Result<TemplateProcessing> {
    let b = |ty: u8| {
        bos.as_ref()
            .map(|(t, _)| format!("{t}:{ty} "))
            .unwrap_or_default()
    };
    let e = |ty: u8| {
        eos.as_ref()
            .map(|(t, _)| format!(" {t}:{ty}"))
            .unwrap_or_default()
    };
    let single = format!("{}$A:0{}", b(0), e(0));
    let pair = format!("{single} {}$B:1{}", b(1), e(1));
    TemplateProcessing::builder()
        .try_single(single.as_str())
        .map_err(build_err)?
        .try_pair(pair.as_str())
        .map_err(build_err)?
        .special_tokens(bos.into_iter().chain(eos).collect::<Vec<_>>())
        .build()
        .map_err(build_err)
}
