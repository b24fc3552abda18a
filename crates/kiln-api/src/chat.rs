//! A conversation as every door hands it over, rendered into prompt tokens once: the chat
//! template (`--chat-template` over the model's own, ChatML when it has none), the tools as
//! transformers passes OpenAI tools, the special-token guard, the size check against the
//! context, and the grammar of a forced tool call.

use kiln_engine::{Constraint, EngineInfo, Request};
use kiln_tokenizer::{
    ChatOptions, ChatTemplate, Tokenizer, ToolChoice, ToolFormat, ToolSpec, push_tool,
};
use serde_json::{Map, Value, json};

use crate::config::ApiConfig;
use crate::error::{ApiError, Field, ToolPart};
use crate::reasoning::Reasoning;
use crate::reply::ReplyFormat;

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    /// OpenAI's newer name for a system message from the application.
    Developer,
    User,
    Assistant,
    /// A tool's result.
    Tool,
}

impl Role {
    /// Every role's wire name.
    pub const NAMES: [&'static str; 5] = ["system", "developer", "user", "assistant", "tool"];

    /// The role as templates read it.
    pub fn name(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::Developer => "developer",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }

    /// A role by its wire name (OpenAI's legacy `function` is a tool result).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "system" => Self::System,
            "developer" => Self::Developer,
            "user" => Self::User,
            "assistant" => Self::Assistant,
            "tool" | "function" => Self::Tool,
            _ => return None,
        })
    }
}

/// A call an assistant turn made, as history.
#[derive(Debug, Clone, PartialEq)]
pub struct PastCall {
    /// The call's id, which a tool result names.
    pub id: String,
    /// The function called.
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    /// The text (a message's parts joined).
    pub content: String,
    /// OpenAI's optional participant name.
    pub name: Option<String>,
    /// A tool result: the call it answers.
    pub tool_call_id: Option<String>,
    /// An assistant turn: the calls it made.
    pub tool_calls: Vec<PastCall>,
    /// An assistant turn: its reasoning, passed to the template as `reasoning_content`.
    pub reasoning: Option<String>,
    /// A tool result that reports a failure (Anthropic's `is_error`), passed to the
    /// template as `is_error`.
    pub is_error: bool,
}

impl Message {
    /// A message from `role`, nothing else set.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            name: None,
            tool_call_id: None,
            tool_calls: Vec::new(),
            reasoning: None,
            is_error: false,
        }
    }

    /// The message as templates read it (transformers' shape of OpenAI messages). A
    /// `developer` message is a `system` one for templates that know no `developer` role
    /// (Codex sends its instructions as one; Qwen3's template would drop it).
    fn to_template(&self, shape: TemplateShape) -> Value {
        let mut m = Map::new();
        let role = match self.role {
            Role::Developer if !shape.developer_role => Role::System,
            role => role,
        };
        m.insert("role".into(), role.name().into());
        m.insert("content".into(), self.content.clone().into());
        if let Some(n) = &self.name {
            m.insert("name".into(), n.clone().into());
        }
        if let Some(id) = &self.tool_call_id {
            m.insert("tool_call_id".into(), id.clone().into());
        }
        if !self.tool_calls.is_empty() {
            let calls = self
                .tool_calls
                .iter()
                .map(|c| {
                    let arguments = match shape.harmony {
                        true => serde_json::from_str(&c.arguments)
                            .unwrap_or_else(|_| Value::String(c.arguments.clone())),
                        false => Value::String(c.arguments.clone()),
                    };
                    json!({"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": arguments}})
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(r) = &self.reasoning {
            m.insert("reasoning_content".into(), r.clone().into());
            if shape.harmony {
                // GPT-OSS's template reads it as `thinking` (transformers passes both).
                m.insert("thinking".into(), r.clone().into());
            }
        }
        if self.is_error {
            m.insert("is_error".into(), true.into());
        }
        Value::Object(m)
    }
}

/// What a template expects of the messages it reads.
#[derive(Debug, Clone, Copy)]
struct TemplateShape {
    /// It knows the `developer` role.
    developer_role: bool,
    /// It writes Harmony (GPT-OSS's): it reads a past turn's reasoning as `thinking`, and a
    /// past call's arguments as a JSON value, not its text (transformers' convention: it
    /// writes them with `tojson`).
    harmony: bool,
}

impl TemplateShape {
    fn of(source: &str) -> Self {
        Self {
            developer_role: source.contains("developer"),
            harmony: crate::harmony::is_harmony_template(source),
        }
    }
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// 1 to 64 letters, digits, `_` and `-`.
    pub name: String,
    /// Shown to the template.
    pub description: Option<String>,
    /// The JSON Schema of its arguments (`None`: any object).
    pub parameters: Option<Value>,
}

/// What a door hands over: the conversation, its tools and how to render it.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
    /// `None`: `auto` with tools, `none` without.
    pub tool_choice: Option<ToolChoice>,
    /// End the prompt with the assistant's header (vLLM's `add_generation_prompt`).
    pub add_generation_prompt: bool,
    /// More template variables (`chat_template_kwargs`: `enable_thinking`, ...).
    pub template_kwargs: Map<String, Value>,
}

impl Conversation {
    /// `messages`, no tools, ending with the assistant's header.
    pub fn new(messages: Vec<Message>) -> Self {
        Self {
            messages,
            tools: Vec::new(),
            tool_choice: None,
            add_generation_prompt: true,
            template_kwargs: Map::new(),
        }
    }

    /// Turns thinking on or off for templates that read `enable_thinking` (Qwen3's, and
    /// others following it); `None` leaves the template's default.
    pub fn set_thinking(&mut self, on: Option<bool>) {
        if let Some(on) = on {
            self.template_kwargs
                .insert("enable_thinking".into(), Value::Bool(on));
        }
    }
}

/// A conversation rendered: the prompt's token ids, how to read the reply, and the grammar a
/// forced call is generated under.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The prompt's token ids, as rendered.
    pub ids: Vec<u32>,
    /// How to read the output.
    pub reply: ReplyFormat,
    /// A forced call's grammar (a `required` or named `tool_choice`).
    pub forced: Option<Constraint>,
    /// Token ids that end the reply besides the model's EOS ids (Harmony's `<|return|>` and
    /// `<|call|>`).
    pub stops: Vec<u32>,
}

/// What closes a think block the prompt left open, before a constrained answer.
const CLOSE_THINK: &str = "</think>\n\n";

impl Prepared {
    /// The prompt and a forced call's grammar into `r`. A forced call replaces any
    /// structured-output format the request had: it writes no message for a format to shape
    /// (the Agents SDK sends both when an agent has an output type). When the output starts
    /// inside a think block, the constraint (the call's or the format's) holds after the
    /// block is closed, so the answer, not the reasoning, is what it shapes.
    pub fn apply(self, r: &mut Request) -> ReplyFormat {
        r.prompt = kiln_engine::Prompt::TokenIds(self.ids);
        if let Some(grammar) = self.forced {
            r.constraint = Some(grammar);
        }
        r.stopping.stop_token_ids.extend(self.stops);
        if self.reply.harmony {
            // Its headers' markers are special tokens: the reply is read with them.
            r.output.skip_special_tokens = false;
        }
        if self.reply.reasoning.is_some_and(Reasoning::starts_inside) {
            r.constraint = r.constraint.take().map(|c| c.after(CLOSE_THINK));
        }
        self.reply
    }
}

/// The template a conversation is rendered with, and its source (which says the model's
/// tool-call syntax).
fn template<'a>(
    cfg: &'a ApiConfig,
    tok: &'a Tokenizer,
) -> (Option<&'a ChatTemplate>, Option<&'a str>) {
    let given = cfg.chat_template.as_deref();
    let source = given
        .map(ChatTemplate::source)
        .or_else(|| tok.default_chat_template_source());
    (given, source)
}

/// The tools as specs (checked) and as the template reads them.
fn tools(list: &[Tool]) -> Result<(Vec<ToolSpec>, Vec<Value>), ApiError> {
    let mut specs = Vec::with_capacity(list.len());
    let mut shown = Vec::with_capacity(list.len());
    for (index, t) in list.iter().enumerate() {
        push_tool(&mut specs, &t.name, t.parameters.clone()).map_err(|e| {
            let part = if e.in_parameters() {
                ToolPart::Parameters
            } else {
                ToolPart::Name
            };
            ApiError::invalid_because(Field::Tool { index, part }, "is not valid", e)
        })?;
        let parameters = specs
            .last()
            .map(|s| s.parameters.clone())
            .unwrap_or_default();
        let mut function = json!({"name": t.name, "parameters": parameters});
        if let Some(d) = &t.description {
            function["description"] = Value::String(d.clone());
        }
        shown.push(json!({"type": "function", "function": function}));
    }
    Ok((specs, shown))
}

impl Conversation {
    /// The conversation as the template `source` reads it: its messages, and the variables
    /// beside them (the tools `shown`, when they are on; `chat_template_kwargs`).
    fn template_inputs(
        &self,
        source: &str,
        shown: Option<Vec<Value>>,
    ) -> (Vec<Value>, Map<String, Value>) {
        let mut extra = self.template_kwargs.clone();
        if let Some(shown) = shown {
            extra.insert("tools".into(), Value::Array(shown));
        }
        let shape = TemplateShape::of(source);
        let messages = self.messages.iter().map(|m| m.to_template(shape)).collect();
        (messages, extra)
    }

    /// Renders and tokenizes the conversation for the model `info` describes.
    pub fn prepare(
        &self,
        tok: &Tokenizer,
        info: &EngineInfo,
        cfg: &ApiConfig,
    ) -> Result<Prepared, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                Field::Messages,
                "must hold at least one message",
            ));
        }
        let (specs, shown) = tools(&self.tools)?;
        let choice = match &self.tool_choice {
            Some(c) => c.clone(),
            None if specs.is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
        };
        choice.check(&specs).map_err(|e| {
            ApiError::invalid_because(Field::ToolChoice, "does not fit the tools", e)
        })?;
        let (given, source) = template(cfg, tok);
        let Some(source) = source else {
            return Err(ApiError::invalid(
                Field::Messages,
                "this model has no chat template (start the server with --chat-template FILE, \
                 or send a plain prompt)",
            ));
        };
        let tools_on = choice.tools_on(&specs);
        let (messages, extra) = self.template_inputs(source, tools_on.then_some(shown));
        let options = ChatOptions {
            add_generation_prompt: self.add_generation_prompt,
        };
        let rendered = tok
            .render_chat_for_tokens(
                given,
                &messages,
                &options,
                &extra,
                cfg.special_tokens_in_content,
            )
            .map_err(|e| ApiError::invalid_because(Field::Messages, "cannot be rendered", e))?;
        info.check_prompt_text(rendered.text())
            .map_err(|e| ApiError::invalid_because(Field::Messages, "is too long", e))?;
        let ids = tok
            .encode_chat(&rendered)
            .map_err(|e| ApiError::invalid_because(Field::Messages, "cannot be tokenized", e))?;
        let format = ToolFormat::for_template(source);
        let forced = choice.forced(&specs);
        let harmony = crate::harmony::is_harmony_template(source);
        if harmony && !forced.is_empty() {
            // As vLLM serves GPT-OSS: the model chooses its calls.
            return Err(ApiError::invalid(
                Field::ToolChoice,
                "must be `auto` or `none` for a Harmony (GPT-OSS) model, which chooses its calls",
            ));
        }
        let reasoning = cfg
            .reasoning
            .filter(|_| !harmony)
            .map(|p| Reasoning::for_prompt(p, rendered.text()));
        let stops = match harmony {
            true => crate::harmony::STOPS
                .iter()
                .filter_map(|s| tok.token_to_id(s))
                .collect(),
            false => Vec::new(),
        };
        Ok(Prepared {
            ids,
            reply: ReplyFormat {
                tools: tools_on.then_some(format),
                reasoning,
                harmony,
            },
            forced: (!forced.is_empty()).then(|| Constraint::Grammar(format.call_grammar(&forced))),
            stops,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use kiln_tokenizer::{ChatOptions, ChatTemplate};
    use serde_json::Value;

    use super::*;

    /// `tests/fixtures/harmony.json` (`scripts/make_harmony_fixtures.py`).
    fn fixture() -> Value {
        serde_json::from_str(include_str!("../tests/fixtures/harmony.json")).unwrap()
    }

    /// A fixture conversation as a door hands it over (a call's arguments as JSON text).
    fn conversation(case: &Value) -> Conversation {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let messages = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message {
                tool_call_id: m["tool_call_id"].as_str().map(str::to_owned),
                reasoning: m["reasoning_content"].as_str().map(str::to_owned),
                tool_calls: m["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| PastCall {
                        id: text(&c["id"]),
                        name: text(&c["function"]["name"]),
                        arguments: c["function"]["arguments"].to_string(),
                    })
                    .collect(),
                ..Message::new(
                    Role::parse(m["role"].as_str().unwrap()).unwrap(),
                    text(&m["content"]),
                )
            })
            .collect();
        let tools = case["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| Tool {
                name: text(&t["function"]["name"]),
                description: t["function"]["description"].as_str().map(str::to_owned),
                parameters: Some(t["function"]["parameters"].clone()),
            })
            .collect();
        Conversation {
            tools,
            ..Conversation::new(messages)
        }
    }

    /// GPT-OSS's chat template, rendered from what the doors hand over, writes what
    /// transformers renders from it; where the template writes Harmony as openai-harmony
    /// does (all but a past call's header and result), that is openai-harmony's text too.
    #[test]
    fn gpt_oss_conversations_render_as_transformers_and_openai_harmony_do() {
        let source = include_str!("../tests/fixtures/gpt_oss_chat_template.jinja");
        let template = ChatTemplate::new("gpt-oss", source).unwrap();
        let options = ChatOptions {
            add_generation_prompt: true,
        };
        let mut agreeing = 0;
        for case in fixture()["renderings"].as_array().unwrap() {
            let conv = conversation(case);
            let (_, shown) = tools(&conv.tools).unwrap();
            let on = (!shown.is_empty()).then_some(shown);
            let (messages, extra) = conv.template_inputs(source, on);
            let before = chrono::Local::now().format("%Y-%m-%d").to_string();
            let got = template
                .render_with(&messages, &options, &extra, None, None)
                .unwrap();
            let after = chrono::Local::now().format("%Y-%m-%d").to_string();
            let want = |key: &str, date: &str| case[key].as_str().unwrap().replace("{DATE}", date);
            let name = &case["name"];
            assert!(
                got == want("template", &before) || got == want("template", &after),
                "{name}:\n{got}\n{}",
                want("template", &after)
            );
            if case["harmony"] == case["template"] {
                agreeing += 1;
            }
        }
        assert_eq!(
            agreeing, 3,
            "the cases where openai-harmony's text is the template's"
        );
    }
}
