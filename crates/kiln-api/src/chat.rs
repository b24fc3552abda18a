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
    fn to_template(&self, developer_role: bool) -> Value {
        let mut m = Map::new();
        let role = match self.role {
            Role::Developer if !developer_role => Role::System,
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
                    json!({"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(r) = &self.reasoning {
            m.insert("reasoning_content".into(), r.clone().into());
        }
        if self.is_error {
            m.insert("is_error".into(), true.into());
        }
        Value::Object(m)
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
        let mut extra = self.template_kwargs.clone();
        if tools_on {
            extra.insert("tools".into(), Value::Array(shown));
        }
        let developer_role = source.contains("developer");
        let messages: Vec<Value> = self
            .messages
            .iter()
            .map(|m| m.to_template(developer_role))
            .collect();
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
        let reasoning = cfg
            .reasoning
            .map(|p| Reasoning::for_prompt(p, rendered.text()));
        Ok(Prepared {
            ids,
            reply: ReplyFormat {
                tools: tools_on.then_some(format),
                reasoning,
            },
            forced: (!forced.is_empty()).then(|| Constraint::Grammar(format.call_grammar(&forced))),
        })
    }
}
