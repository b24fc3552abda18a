//! Tokenizers loaded from a Hugging Face model folder.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde_json::Value;

use crate::error::{Result, TokenizerError};
use crate::gguf::bos_eos_processor;
use crate::tokenizer::{SpecialTokens, Tokenizer};

/// Reads `dir/name`, or `None` if it does not exist.
fn read_optional(dir: &Path, name: &str) -> Result<Option<(PathBuf, String)>> {
    let path = dir.join(name);
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(Some((path, s))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io { path, source }),
    }
}

fn read_json(dir: &Path, name: &str) -> Result<Option<(PathBuf, Value)>> {
    let Some((path, text)) = read_optional(dir, name)? else {
        return Ok(None);
    };
    let value = serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.clone(),
        source,
    })?;
    Ok(Some((path, value)))
}

fn field_err(path: &Path, field: &str, detail: impl Into<String>) -> TokenizerError {
    TokenizerError::ConfigField {
        path: path.to_owned(),
        field: field.to_owned(),
        detail: detail.into(),
    }
}

/// A special token field: a string, an `AddedToken` object with `content`, or null.
fn token_field<'a>(path: &Path, config: &'a Value, field: &str) -> Result<Option<&'a str>> {
    match config.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s)),
            _ => Err(field_err(path, field, "object without a string `content`")),
        },
        Some(other) => Err(field_err(
            path,
            field,
            format!("expected a string, found {other}"),
        )),
    }
}

fn bool_field(path: &Path, config: &Value, field: &str) -> Result<Option<bool>> {
    match config.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(field_err(
            path,
            field,
            format!("expected a bool, found {other}"),
        )),
    }
}

/// `chat_template`: a string, or a list of `{name, template}` (the `default` one is used).
fn template_field(path: &Path, config: &Value) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let named = |want: Option<&str>| {
                list.iter()
                    .find(|t| want.is_none_or(|w| t.get("name").and_then(Value::as_str) == Some(w)))
            };
            named(Some("default"))
                .or_else(|| named(None))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(|s| Some(s.to_owned()))
                .ok_or_else(|| field_err(path, "chat_template", "list without a `template` string"))
        }
        Some(other) => Err(field_err(
            path,
            "chat_template",
            format!("expected a string or list, found {other}"),
        )),
    }
}

/// `eos_token_id` of generation_config.json: one id or a list.
fn id_list(path: &Path, config: &Value, field: &str) -> Result<Vec<u32>> {
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| field_err(path, field, format!("{v} is not a token id")))
    };
    match config.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

pub(crate) fn from_dir(dir: &Path) -> Result<Tokenizer> {
    let (json_path, json) =
        read_optional(dir, "tokenizer.json")?.ok_or_else(|| TokenizerError::Io {
            path: dir.join("tokenizer.json"),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        })?;
    let mut tok =
        tokenizers::Tokenizer::from_str(&json).map_err(|source| TokenizerError::Build {
            source_name: json_path.display().to_string(),
            source,
        })?;

    let config = read_json(dir, "tokenizer_config.json")?;
    let (config_path, config) = match &config {
        Some((p, v)) => (p.clone(), v.clone()),
        None => (dir.join("tokenizer_config.json"), Value::Null),
    };
    let id_of = |field: &str| -> Result<Option<u32>> {
        match token_field(&config_path, &config, field)? {
            None => Ok(None),
            Some(t) => tok.token_to_id(t).map(Some).ok_or_else(|| {
                field_err(
                    &config_path,
                    field,
                    format!("`{t}` is not in the vocabulary"),
                )
            }),
        }
    };
    let bos = id_of("bos_token")?;
    let eos = id_of("eos_token")?;
    let unk = id_of("unk_token")?;
    let pad = id_of("pad_token")?;

    let (gen_path, gen_config) = match read_json(dir, "generation_config.json")? {
        Some((p, v)) => (p, v),
        None => (dir.join("generation_config.json"), Value::Null),
    };
    let mut stop_ids = id_list(&gen_path, &gen_config, "eos_token_id")?;
    let eos = eos.or_else(|| stop_ids.first().copied());
    if let Some(e) = eos {
        stop_ids.retain(|&id| id != e);
        stop_ids.insert(0, e);
    }
    let bos = bos.or(id_list(&gen_path, &gen_config, "bos_token_id")?
        .first()
        .copied());

    // As transformers does: explicit add_bos_token / add_eos_token rebuild the post-processor.
    let add_bos = bool_field(&config_path, &config, "add_bos_token")?;
    let add_eos = bool_field(&config_path, &config, "add_eos_token")?;
    if add_bos.is_some() || add_eos.is_some() {
        let named =
            |want: Option<bool>, id: Option<u32>, field: &str| -> Result<Option<(String, u32)>> {
                match (want, id) {
                    (Some(true), Some(id)) => Ok(tok.id_to_token(id).map(|t| (t, id))),
                    (Some(true), None) => Err(field_err(
                        &config_path,
                        field,
                        "is true but the token is not set",
                    )),
                    _ => Ok(None),
                }
            };
        let post = bos_eos_processor(
            named(add_bos, bos, "add_bos_token")?,
            named(add_eos, eos, "add_eos_token")?,
        )?;
        tok.with_post_processor(Some(post));
    }

    let template = match read_optional(dir, "chat_template.jinja")? {
        Some((_, t)) => Some(t),
        None => template_field(&config_path, &config)?,
    };
    let specials = SpecialTokens {
        bos,
        eos,
        stop_ids,
        unk,
        pad,
        add_bos: false,
        add_eos: false,
    };
    Tokenizer::new(tok, specials, template.as_deref())
}
