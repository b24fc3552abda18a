"""Harmony (GPT-OSS's channels) through the official `openai` package: `kiln serve` started with
GPT-OSS's chat template reads a reply's `analysis` channel as `reasoning_content`, its `final`
channel as `content` and a `commentary` message to `functions.NAME` as a tool call, whole and
streamed. The CI model does not speak Harmony, so a regex (vLLM's `structured_outputs`) makes
it write Harmony's markers. Exits non-zero, saying what failed, if any check does.

Written against openai 3.63.0.
Usage: harmony_client.py HOST:PORT   (kiln serve's --http-listen, with
       --chat-template crates/kiln-api/tests/fixtures/gpt_oss_chat_template.jinja)
"""
import json
import os
import sys

from openai import OpenAI

ANSWER = (r"<\|channel\|>analysis<\|message\|>[a-z]{3,8}<\|end\|>"
          r"<\|start\|>assistant<\|channel\|>final<\|message\|>(Red|Blue|Green)")
CALL = (r"<\|channel\|>analysis<\|message\|>[a-z]{3,8}<\|end\|>"
        r"<\|start\|>assistant<\|channel\|>commentary to=functions\.get_weather "
        r'<\|constrain\|>json<\|message\|>\{"city":"(Oslo|Rome)"\}')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def check(ok, what):
    if not ok:
        sys.exit(f"FAIL: {what}")


address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8000"
client = OpenAI(base_url=f"http://{address}/v1", api_key=os.environ.get("KILN_API_KEY", "unused"),
                max_retries=0, timeout=600)
model = client.models.list().data[0].id

r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=64,
                                   extra_body={"structured_outputs": {"regex": ANSWER}})
m = r.choices[0].message
thought = (m.model_extra or {}).get("reasoning_content")
check(isinstance(thought, str) and thought.isalpha() and thought.islower(),
      f"analysis as reasoning_content: {m}")
check(m.content in ("Red", "Blue", "Green"), f"final as content: {m}")
check(r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason!r}")

reasoning, content = "", ""
for chunk in client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=64, stream=True,
        extra_body={"structured_outputs": {"regex": ANSWER}}):
    if chunk.choices:
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
check((reasoning, content) == (thought, m.content),
      f"streamed {(reasoning, content)!r}, whole {(thought, m.content)!r}")

r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0,
                                   max_tokens=96, extra_body={"structured_outputs": {"regex": CALL}})
choice = r.choices[0]
check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason!r}")
calls = choice.message.tool_calls or []
check(len(calls) == 1 and calls[0].function.name == "get_weather", f"tool calls {calls}")
check(json.loads(calls[0].function.arguments)["city"] in ("Oslo", "Rome"), f"arguments {calls}")
check(not choice.message.content, f"no content beside the call: {choice.message}")
print(f"harmony: reasoning {thought!r}, content {m.content!r}, call {calls[0].function.arguments}")
