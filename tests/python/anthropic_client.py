"""kiln's Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the
official `anthropic` package: `messages.create` with `system` as a string and as blocks (same
greedy text), that text equal to `/v1/chat/completions` for the same message; `messages.stream()`
(`text_stream`, `get_final_message()`) and raw `stream=True` events in Anthropic's order, each SSE
`event:` name equal to its JSON `type`; a forced tool (`tool_choice` type tool) giving a
`tool_use` block whose `input` validates, whole and streamed, answered by a `tool_result` (and
one with `is_error`); `stop_sequences` ending on `stop_sequence`; `count_tokens` equal to the
whole prompt of the same create's usage (input_tokens plus cache reads); errors in Anthropic's shape (an image block, a malformed
`max_tokens`, a wrong key when one is given). Exits non-zero, saying what failed, if any check does.

Written against anthropic 2.17.0 (pydantic 2.14.4) and jsonschema 4.26.0. This SDK has no
`temperature` argument (it goes in `extra_body`), sends `api_key` as `Authorization: Bearer`,
and drops `ping` events and events without an `event:` line before the caller sees them.
Usage: anthropic_client.py HOST:PORT [API_KEY]   (kiln serve's --http-listen; the key kiln was
started with, also read from KILN_API_KEY; without one the auth checks are skipped)
"""
import json
import os
import sys
import time
import urllib.request

import anthropic
import jsonschema

QUESTION = "Name three colours."
SYSTEM = "You are a terse assistant. Answer in one line."
MAX = 24
GREEDY = {"temperature": 0}  # extra_body: the 2.x SDK has no temperature parameter
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
FORCED = {"type": "tool", "name": "get_weather"}
ORDER = ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
         "message_delta", "message_stop"]  # content_block_delta once or more


def prompt_tokens(u):
    """The whole prompt: Anthropic counts tokens read from the prompt cache apart from input_tokens."""
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


def check(ok, what):
    if not ok:
        sys.exit(f"FAIL: {what}")


def wait_until_healthy(wait_s):
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"FAIL: {base} not healthy after {wait_s:.0f} s")
        time.sleep(0.5)


def http(path, body=None, headers=None):
    """A plain request (no SDK): JSON in, the reply's bytes out."""
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01", **(headers or {})}
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(base + path, data, headers), timeout=120) as r:
        return r.read()


def collapse(types):
    return [t for i, t in enumerate(types) if not (t == "content_block_delta" and i and types[i - 1] == t)]


def check_message(m, what):
    check(m.type == "message" and m.role == "assistant" and m.id, f"{what}: {m}")
    check(m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= MAX, f"{what}: usage {m.usage}")
    check([b.type for b in m.content] == ["text"] and m.content[0].text, f"{what}: content {m.content}")
    check(m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None,
          f"{what}: stop {m.stop_reason} {m.stop_sequence!r}")
    check(m.stop_reason == "end_turn" or m.usage.output_tokens == MAX, f"{what}: max_tokens at {m.usage}")
    return m.content[0].text


def expect_400(field, **kw):
    try:
        create(max_tokens=MAX, **kw)
    except anthropic.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error") if isinstance(body.get("error"), dict) else {}
        check(body.get("type") == "error" and err.get("type") == "invalid_request_error"
              and isinstance(err.get("message"), str), f"not Anthropic's error shape: {e.body}")
        check(field in err["message"], f"the 400 does not name {field}: {e.body}")
        print(f"  {err['message']}")
        return
    sys.exit(f"FAIL: {list(kw)} was not refused")


address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8000"
key = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("KILN_API_KEY")
base = f"http://{address}"
print(f"waiting for kiln at {base}")
wait_until_healthy(float(os.environ.get("KILN_CLIENT_WAIT_S", "600")))
bearer = {"authorization": f"Bearer {key}"} if key else {}
model = json.loads(http("/v1/models", headers=bearer))["data"][0]["id"]
client = anthropic.Anthropic(base_url=base, api_key=key or "unused", max_retries=0, timeout=120)
create = client.messages.create
user = [{"role": "user", "content": QUESTION}]
print(f"model {model}")

print("messages.create: system as a string and as blocks; greedy text equals chat completions")
m = create(model=model, max_tokens=MAX, system=SYSTEM, messages=user, extra_body=GREEDY)
text = check_message(m, "system string")
m2 = create(model=model, max_tokens=MAX, system=[{"type": "text", "text": SYSTEM}], messages=user,
            extra_body=GREEDY)
check(check_message(m2, "system blocks") == text, f"system blocks {m2.content[0].text!r} != {text!r}")
plain = create(model=model, max_tokens=MAX, messages=user, extra_body=GREEDY)
greedy = check_message(plain, "no system")
chat = json.loads(http("/v1/chat/completions", {"model": model, "messages": user, "temperature": 0,
                                                "max_tokens": MAX}, bearer))
check(chat["choices"][0]["message"]["content"] == greedy,
      f"chat {chat['choices'][0]['message']['content']!r} != messages {greedy!r}")
print(f"  {text!r} ({m.stop_reason}); without system {greedy!r}")

print("messages.stream(): text_stream and get_final_message()")
with client.messages.stream(model=model, max_tokens=MAX, system=SYSTEM, messages=user, extra_body=GREEDY) as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
check(streamed == final.content[0].text == text, f"streamed {streamed!r}, final {final.content}, whole {text!r}")
check(final.stop_reason == m.stop_reason and prompt_tokens(final.usage) == prompt_tokens(m.usage)
      and final.usage.output_tokens == m.usage.output_tokens, f"stream final {final.stop_reason} {final.usage}")

print("stream=True: event order; on the wire each `event:` names its data's type")
events = list(create(model=model, max_tokens=MAX, system=SYSTEM, messages=user, extra_body=GREEDY, stream=True))
types = [e.type for e in events]
check(collapse(types) == ORDER, f"events {types}")
start = events[0].message
check(start.content == [] and prompt_tokens(start.usage) == prompt_tokens(m.usage) and start.id,
      f"message_start {start}")
check(events[1].index == 0 and events[1].content_block.type == "text", f"content_block_start {events[1]}")
deltas = [e.delta for e in events if e.type == "content_block_delta"]
check(all(d.type == "text_delta" for d in deltas) and "".join(d.text for d in deltas) == text, f"deltas {deltas}")
check(events[-2].delta.stop_reason == m.stop_reason and events[-2].usage.output_tokens == m.usage.output_tokens,
      f"message_delta {events[-2]}")
raw = http("/v1/messages", {"model": model, "max_tokens": MAX, "system": SYSTEM, "messages": user,
                            "temperature": 0, "stream": True}, {"x-api-key": key} if key else {}).decode()
wire = []
for block in raw.replace("\r\n", "\n").split("\n\n"):
    fields = {}  # SSE: `name: value` lines (one optional space); lines starting with `:` are comments
    for name, _, value in (line.partition(":") for line in block.split("\n") if line and line[0] != ":"):
        value = value.removeprefix(" ")
        fields[name] = f"{fields[name]}\n{value}" if name in fields else value
    if not fields:
        continue
    check("event" in fields and "data" in fields, f"SSE event without event:/data: lines: {block!r}")
    check(json.loads(fields["data"])["type"] == fields["event"],
          f"event {fields['event']} carries {fields['data']}")
    wire.append(fields["event"])
check(collapse([t for t in wire if t != "ping"]) == ORDER, f"on the wire: {wire}")

print("forced tool: tool_use whole and streamed, then tool_result (plain and is_error)")
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
t = create(model=model, max_tokens=120, messages=ask, tools=TOOLS, tool_choice=FORCED, extra_body=GREEDY)
uses = [b for b in t.content if b.type == "tool_use"]
check(t.stop_reason == "tool_use" and len(uses) == 1 and t.content[-1] is uses[0], f"forced tool: {t}")
use = uses[0]
check(use.name == "get_weather" and use.id, f"tool_use {use}")
jsonschema.validate(use.input, WEATHER)
with client.messages.stream(model=model, max_tokens=120, messages=ask, tools=TOOLS, tool_choice=FORCED,
                            extra_body=GREEDY) as s:
    final = s.get_final_message()
check(final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
      and final.content[-1].input == use.input, f"streamed tool_use {final.content} != {use.input}")
counted = client.messages.count_tokens(model=model, messages=ask, tools=TOOLS, tool_choice=FORCED)
check(counted.input_tokens == prompt_tokens(t.usage), f"count_tokens with tools {counted} != {t.usage}")
for result in [{"content": "18 degrees, clear sky"}, {"content": "unknown city", "is_error": True}]:
    turn = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in t.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, **result}]}]
    after = create(model=model, max_tokens=MAX, messages=turn, tools=TOOLS, tool_choice={"type": "none"},
                   extra_body=GREEDY)
    check_message(after, f"after tool_result {result}")
print(f"  {use.input} -> {after.content[0].text!r}")

print("stop_sequences end on the sequence, whole and streamed")
words = (w.strip(".,;:!?\"'()") for w in greedy.split()[1:])
word = next((w for w in words if len(w) >= 3 and greedy.find(w) > 0), None)
check(word, f"no word to stop on in the greedy text {greedy!r}")
s1 = create(model=model, max_tokens=MAX, messages=user, stop_sequences=[word], extra_body=GREEDY)
check(s1.stop_reason == "stop_sequence" and s1.stop_sequence == word,
      f"stop on {word!r}: {s1.stop_reason} {s1.stop_sequence!r}")
check("".join(b.text for b in s1.content) == greedy[:greedy.find(word)],
      f"stopped text {s1.content} vs {greedy!r}")
with client.messages.stream(model=model, max_tokens=MAX, messages=user, stop_sequences=[word],
                            extra_body=GREEDY) as s:
    final = s.get_final_message()
check(final.stop_reason == "stop_sequence" and final.stop_sequence == word, f"streamed stop {final}")
print(f"  stopped before {word!r}: {greedy[:greedy.find(word)]!r}")

print("count_tokens equals the create's input_tokens")
counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=user)
check(counted.input_tokens > 0 and counted.input_tokens == prompt_tokens(m.usage), f"{counted} vs {m.usage}")
bare = client.messages.count_tokens(model=model, messages=user)
check(bare.input_tokens == prompt_tokens(plain.usage), f"no system: {bare} vs {plain.usage}")

print("errors in Anthropic's shape")
png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
try:
    create(model=model, max_tokens=MAX, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
        {"type": "text", "text": "What is this?"}]}])
    sys.exit("FAIL: an image block was accepted by a text-only model")
except anthropic.BadRequestError as e:
    check(isinstance(e.body, dict) and e.body.get("type") == "error" and e.type == "invalid_request_error"
          and isinstance(e.api_message, str), f"image: not Anthropic's error shape: {e.body}")
    print(f"  image: {e.api_message}")
expect_400("max_tokens", model=model, messages=user, extra_body={"max_tokens": "many"})
if key:
    print("auth: x-api-key and bearer accepted, a wrong key refused")
    for header in ({"x-api-key": key}, {"authorization": f"Bearer {key}"}):
        reply = json.loads(http("/v1/messages/count_tokens", {"model": model, "messages": user}, header))
        check(reply.get("input_tokens") == bare.input_tokens, f"{list(header)}: {reply}")
    wrong = anthropic.Anthropic(base_url=base, api_key=key + "-wrong", max_retries=0, timeout=120)
    try:
        wrong.messages.count_tokens(model=model, messages=user)
        sys.exit("FAIL: a wrong key was accepted")
    except anthropic.AuthenticationError as e:
        check(isinstance(e.body, dict) and e.body.get("type") == "error" and e.type == "authentication_error",
              f"wrong key: {e.body}")
else:
    print("auth: skipped (no key given: pass one as argv[2] or KILN_API_KEY when kiln has --api-key)")
print("anthropic: all checks passed")
