//! Chat templates: the model's Jinja template rendered with `minijinja`, as Hugging Face
//! `apply_chat_template` renders it; ChatML when the model has none.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, context};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TokenizerError};

/// The template used for models that ship none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// How to render a conversation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChatOptions {
    /// End with the header of an assistant turn, so the model writes the reply.
    pub add_generation_prompt: bool,
}

/// A compiled chat template.
///
/// Rendering matches Python Jinja as Hugging Face configures it: `trim_blocks` and
/// `lstrip_blocks` on, Python string methods (`.strip()`, `.startswith()`, ...),
/// `raise_exception(msg)`, `strftime_now(format)` (the local time, as transformers gives it:
/// GPT-OSS's and Llama 3's templates write the date), and a `tojson` that formats like
/// Python's `json.dumps`.
#[derive(Debug)]
pub struct ChatTemplate {
    name: String,
    source: String,
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source`; `name` says where it came from in error messages.
    pub fn new(name: impl Into<String>, source: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TokenizerError::TemplateSyntax {
                name: name.clone(),
                detail: describe(&e),
            })?;
        Ok(Self { name, source, env })
    }

    /// Reads a template file as transformers does: a Jinja file (`chat_template.jinja`), or a
    /// JSON file whose `chat_template` field holds it (`tokenizer_config.json`,
    /// `chat_template.json`; a list of named templates gives the one named `default`).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_owned(),
            source,
        })?;
        let field = |detail: &str| TokenizerError::ConfigField {
            path: path.to_owned(),
            field: "chat_template".into(),
            detail: detail.into(),
        };
        let source = match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Object(map)) => match map.get("chat_template") {
                Some(serde_json::Value::String(t)) => t.clone(),
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .ok_or_else(|| field("a list of templates without one named `default`"))?
                    .to_owned(),
                Some(_) => return Err(field("expected a string or a list of named templates")),
                None => return Err(field("missing (a JSON file must hold the template there)")),
            },
            // Not a JSON object: the file is the template itself.
            _ => text,
        };
        Self::new(path.display().to_string(), source)
    }

    /// The ChatML template.
    pub fn chatml() -> Result<Self> {
        Self::new("chatml", CHATML_TEMPLATE)
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; `bos_token`/`eos_token` are the strings templates refer to. A
    /// message is anything that serializes to a map with `role` and `content` ([`ChatMessage`],
    /// or a JSON object that also carries `name`, `tool_call_id` or `tool_calls` for templates
    /// that read them).
    pub fn render<M: Serialize>(
        &self,
        messages: &[M],
        options: &ChatOptions,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<String> {
        self.render_with(messages, options, &NoExtra {}, bos_token, eos_token)
    }

    /// [`render`](Self::render) with more variables for the template, as the keyword arguments
    /// of transformers' `apply_chat_template`: `extra` serializes to a map, such as
    /// `{"tools": [...], "enable_thinking": false}`. Its keys may not replace `messages`,
    /// `add_generation_prompt`, `bos_token` or `eos_token`.
    pub fn render_with<M: Serialize, E: Serialize>(
        &self,
        messages: &[M],
        options: &ChatOptions,
        extra: &E,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<String> {
        let fail = |e: Error| TokenizerError::TemplateRender {
            name: self.name.clone(),
            detail: describe(&e),
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(fail)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => options.add_generation_prompt,
                bos_token => bos_token.unwrap_or_default(),
                eos_token => eos_token.unwrap_or_default(),
                ..Value::from_serialize(extra)
            })
            .map_err(fail)
    }
}

/// No extra template variables.
#[derive(Serialize)]
struct NoExtra {}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// The local time in strftime's `format` (Python's codes, which chrono shares); a code it
/// does not know is an error naming the format.
fn strftime_now(format: String) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: `{format}` is not a strftime format"),
        )
    })?;
    Ok(out)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`, the
/// way Hugging Face's template environment defines `tojson`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if ensure_ascii == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: ensure_ascii=true is not supported",
        ));
    }
    let mut out = String::new();
    write_py_json(&value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_py_json(
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    let string = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String | ValueKind::Bytes => {
            out.push_str(&string(v.as_str().unwrap_or_default()))
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                out.push_str(&string(&key.to_string()));
                out.push_str(": ");
                write_py_json(&v.get_item(key)?, indent, sort, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        _ => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                write_py_json(item, indent, sort, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render<M: Serialize>(source: &str, messages: &[M]) -> Result<String> {
        ChatTemplate::new("test", source)?.render(
            messages,
            &ChatOptions::default(),
            Some("<s>"),
            Some("</s>"),
        )
    }

    #[test]
    fn chatml_renders_with_and_without_generation_prompt() -> Result<()> {
        let t = ChatTemplate::chatml()?;
        let msgs = [ChatMessage::new("user", "hi")];
        assert_eq!(
            t.render(&msgs, &ChatOptions::default(), None, None)?,
            "<|im_start|>user\nhi<|im_end|>\n"
        );
        let opts = ChatOptions {
            add_generation_prompt: true,
        };
        assert_eq!(
            t.render(&msgs, &opts, None, None)?,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        Ok(())
    }

    #[test]
    fn python_methods_filters_and_special_tokens() -> Result<()> {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role.startswith('us') %}[{{ m.content.strip() | upper }}]{% else %}{{ m['content'] | length }}{% endif %}{% endfor %}{{ eos_token }}";
        let out = render(
            src,
            &[
                ChatMessage::new("user", "  a b  "),
                ChatMessage::new("assistant", "xyz"),
            ],
        )?;
        assert_eq!(out, "<s>[A B]3</s>");
        Ok(())
    }

    #[test]
    fn tojson_formats_like_python() -> Result<()> {
        let out = render(
            "{{ messages | tojson }}",
            &[ChatMessage::new("user", "é<\"")],
        )?;
        assert_eq!(out, r#"[{"role": "user", "content": "é<\""}]"#);
        let out = render(
            "{{ messages[0] | tojson(indent=2) }}",
            &[ChatMessage::new("a", "b")],
        )?;
        assert_eq!(out, "{\n  \"role\": \"a\",\n  \"content\": \"b\"\n}");
        Ok(())
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hugging_face() -> Result<()> {
        let src = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}";
        assert_eq!(render(src, &[ChatMessage::new("u", "x")])?, "x\n");
        Ok(())
    }

    /// `strftime_now` writes the local date as Python's strftime does, and names a format it
    /// cannot write.
    #[test]
    fn strftime_now_writes_the_date() {
        let before = chrono::Local::now().date_naive();
        let got = render::<ChatMessage>("{{ strftime_now('%Y-%m-%d|%d %b %Y') }}", &[]).unwrap();
        let after = chrono::Local::now().date_naive();
        let want = |d: chrono::NaiveDate| d.format("%Y-%m-%d|%d %b %Y").to_string();
        assert!(got == want(before) || got == want(after), "{got}");
        let ymd: Vec<u32> = got[..10].split('-').map(|p| p.parse().unwrap()).collect();
        assert!(ymd[0] >= 2024 && (1..=12).contains(&ymd[1]), "{got}");
        let err = render::<ChatMessage>("{{ strftime_now('%Q') }}", &[])
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("`%Q` is not a strftime format")),
            "{err:?}"
        );
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_reported() {
        let err = render::<ChatMessage>("{{ raise_exception('roles must alternate') }}", &[])
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.starts_with("chat template `test` failed")
                    && e.contains("roles must alternate")),
            "{err:?}"
        );
        let err = ChatTemplate::new("broken", "{% for m in messages %}")
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.starts_with("chat template `broken` does not compile")),
            "{err:?}"
        );
    }

    #[test]
    fn template_files_as_transformers_reads_them() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("kiln-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| TokenizerError::Io {
            path: dir.clone(),
            source,
        })?;
        let write = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).map(|()| p)
        };
        let msgs = [ChatMessage::new("user", "hi")];
        let cases = [
            ("t.jinja", "{{ messages[0].content }}!"),
            (
                "tokenizer_config.json",
                r#"{"chat_template": "{{ messages[0].content }}!"}"#,
            ),
            (
                "named.json",
                r#"{"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ messages[0].content }}!"}]}"#,
            ),
        ];
        for (name, text) in cases {
            let path = write(name, text).map_err(|source| TokenizerError::Io {
                path: name.into(),
                source,
            })?;
            let t = ChatTemplate::from_file(&path)?;
            assert_eq!(t.render(&msgs, &ChatOptions::default(), None, None)?, "hi!");
        }
        let bad =
            write("bad.json", r#"{"eos_token": "</s>"}"#).map_err(|source| TokenizerError::Io {
                path: "bad.json".into(),
                source,
            })?;
        let err = ChatTemplate::from_file(&bad).err().map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("bad.json") && e.contains("`chat_template`")),
            "{err:?}"
        );
        let err = ChatTemplate::from_file(dir.join("missing.jinja"))
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("missing.jinja") && e.contains("cannot read")),
            "{err:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn messages_may_carry_fields_templates_read() -> Result<()> {
        let msgs = serde_json::json!([
            {"role": "user", "content": "weather?"},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ]);
        let msgs = msgs.as_array().cloned().unwrap_or_default();
        let out = render(
            "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %};{% endfor %}",
            &msgs,
        );
        assert_eq!(out?, "user:weather?;tool:sunny(call_1);");
        Ok(())
    }
}
