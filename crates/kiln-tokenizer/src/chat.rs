//! Chat templates: the model's Jinja template rendered with `minijinja`, as Hugging Face
//! `apply_chat_template` renders it; ChatML when the model has none.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, context};
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
/// `raise_exception(msg)`, and a `tojson` that formats like Python's `json.dumps`.
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
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TokenizerError::TemplateSyntax {
                name: name.clone(),
                detail: describe(&e),
            })?;
        Ok(Self { name, source, env })
    }

    /// The ChatML template.
    pub fn chatml() -> Result<Self> {
        Self::new("chatml", CHATML_TEMPLATE)
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; `bos_token`/`eos_token` are the strings templates refer to.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
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
            })
            .map_err(fail)
    }
}

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

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String> {
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

    #[test]
    fn raise_exception_and_syntax_errors_are_reported() {
        let err = render("{{ raise_exception('roles must alternate') }}", &[])
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
}
