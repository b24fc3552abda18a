//! Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! The result is a real `tokenizers::Tokenizer` shaped like the one Hugging Face builds for the
//! same vocabulary: byte-level BPE from tokens + merges for `gpt2`, SentencePiece-style BPE with
//! merges recovered from the scores for `llama`.

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
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper};

use crate::error::{Result, TokenizerError};
use crate::pieces::byte_level_decoding;
use crate::pretok;
use crate::tokenizer::{SpecialTokens, Tokenizer};

const SOURCE: &str = "GGUF metadata";

/// llama.cpp's token types.
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

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
    tokens: &'a [String],
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
    Ok(Common {
        tokens,
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

fn sentencepiece_bpe(md: &Metadata) -> Result<Tokenizer> {
    let c = read_common(md, true)?;
    let scores = md
        .get_f32s("tokenizer.ggml.scores")?
        .ok_or_else(|| meta_err("tokenizer.ggml.scores", "missing (needed for `llama`)"))?;
    if scores.len() != c.tokens.len() {
        return Err(meta_err(
            "tokenizer.ggml.scores",
            format!("{} scores for {} tokens", scores.len(), c.tokens.len()),
        ));
    }
    let vocab: Vocab = c.tokens.iter().cloned().zip(0u32..).collect();
    let merges = merges_from_scores(c.tokens, scores, &vocab);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab.clone(), merges)
        .fuse_unk(true)
        .byte_fallback(true);
    if let Some(unk) = c.specials.unk.and_then(|id| c.tokens.get(id as usize)) {
        builder = builder.unk_token(unk.clone());
    }
    let bpe = builder.build().map_err(build_err)?;
    let add_space_prefix = md
        .get_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let scheme = if add_space_prefix {
        PrependScheme::First
    } else {
        PrependScheme::Never
    };
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("\u{2581}", " ").map_err(build_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Metaspace::new('\u{2581}', scheme, false)))
        .with_decoder(Some(DecoderSequence::new(decoders)));
    finish(tok, c, |_| true, |t| vocab.contains_key(t))
}

/// SentencePiece BPE merges: every split of a token into two tokens, best merged score first
/// (ties: longer left piece, then longer right piece, then file order), as Hugging Face
/// recovers them.
fn merges_from_scores(tokens: &[String], scores: &[f32], vocab: &Vocab) -> Vec<(String, String)> {
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    let mut local = Vec::new();
    for (token, &score) in tokens.iter().zip(scores) {
        local.clear();
        for (i, _) in token.char_indices().skip(1) {
            let (l, r) = token.split_at(i);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                local.push((li, ri, l, r));
            }
        }
        local.sort_by_key(|&(li, ri, _, _)| (li, ri));
        merges.extend(local.iter().map(|&(_, _, l, r)| (l, r, score)));
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
