"""kiln's Responses API (`/v1/responses`) through the official `openai` package: string and item
input with `instructions`, greedy text equal to `/v1/chat/completions` for the same
conversation, usage; streaming with `create(stream=True)` and the `responses.stream()` helper
(typed events in OpenAI's order, `sequence_number` increasing from 0, deltas joining to the final
text); a stored response retrieved, continued by `previous_response_id`, deleted (then 404); a
forced function call whose arguments validate, streamed, and answered by `function_call_output`;
`text.format` json_schema output that validates; 400s naming the malformed field. Exits non-zero,
saying what failed, if any check does.

Written against openai 3.63.0 (pydantic 2.14.4) and jsonschema 4.26.0.
Usage: responses_client.py HOST:PORT   (kiln serve's --http-listen; KILN_API_KEY if it has a key)
"""
import json
import os
import sys
import time
import urllib.request

import jsonschema
import openai
from openai import OpenAI

QUESTION = "Name three colours."
MAX = 24  # max_output_tokens / max_tokens of the greedy text checks
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True}]
FORCED = {"type": "function", "name": "get_weather"}
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
          "required": ["colour"], "additionalProperties": False}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "colour", "schema": COLOUR, "strict": True}}


def check(ok, what):
    if not ok:
        sys.exit(f"FAIL: {what}")


def wait_until_healthy(address, wait_s):
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/health", timeout=10) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"FAIL: {address} not healthy after {wait_s:.0f} s")
        time.sleep(0.5)


def check_finished(r, limit, what):
    """A whole response: id, status, usage; `incomplete` only for running out of tokens."""
    check(r.object == "response" and r.id.startswith("resp"), f"{what}: id/object {r.id!r} {r.object!r}")
    u = r.usage
    check(u is not None and u.input_tokens > 0 and 0 < u.output_tokens <= limit
          and u.total_tokens == u.input_tokens + u.output_tokens, f"{what}: usage {u}")
    if r.status == "incomplete":
        check(r.incomplete_details and r.incomplete_details.reason == "max_output_tokens"
              and u.output_tokens == limit, f"{what}: incomplete {r.incomplete_details}, {u}")
    else:
        check(r.status == "completed", f"{what}: status {r.status!r}")


def check_events(events, kind, what):
    """OpenAI's event order for one output item (`message` or `function_call`); returns the
    joined deltas, the terminal event's response and the finished item."""
    types = [e.type for e in events]
    seq = [e.sequence_number for e in events]
    check(seq and seq[0] == 0 and all(a < b for a, b in zip(seq, seq[1:])), f"{what}: sequence_number {seq}")
    delta, done = {"message": ("response.output_text.delta", "response.output_text.done"),
                   "function_call": ("response.function_call_arguments.delta",
                                     "response.function_call_arguments.done")}[kind]
    final = events[-1].response
    terminal = "response.incomplete" if final.status == "incomplete" else "response.completed"
    part = ["response.content_part.added"] if kind == "message" else []
    want = ["response.created", "response.in_progress", "response.output_item.added", *part, delta,
            done, *(["response.content_part.done"] if part else []), "response.output_item.done", terminal]
    collapsed = [t for i, t in enumerate(types) if not (t == delta and i and types[i - 1] == delta)]
    check(collapsed == want, f"{what}: events {types}, expected {want} (one or more deltas)")
    first = events[0].response
    check(first.id == final.id and first.id.startswith("resp") and first.status == "in_progress",
          f"{what}: response.created {first.id!r} {first.status!r}, final {final.id!r}")
    added = next(e for e in events if e.type == "response.output_item.added").item
    item = next(e for e in events if e.type == "response.output_item.done").item
    check(added.type == item.type == kind and item.id and added.id == item.id,
          f"{what}: added {added}, done {item}")
    deltas = [e for e in events if e.type == delta]
    check(all(e.item_id == item.id and e.output_index == 0 for e in deltas), f"{what}: delta item ids")
    joined = "".join(e.delta for e in deltas)
    done_event = next(e for e in events if e.type == done)
    check((done_event.text if kind == "message" else done_event.arguments) == joined,
          f"{what}: {done} does not repeat the joined deltas {joined!r}")
    check([o.type for o in final.output] == [kind], f"{what}: final output {final.output}")
    return joined, final, item


address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8000"
print(f"waiting for kiln at http://{address}")
wait_until_healthy(address, float(os.environ.get("KILN_CLIENT_WAIT_S", "600")))
client = OpenAI(base_url=f"http://{address}/v1", api_key=os.environ.get("KILN_API_KEY", "unused"),
                max_retries=0, timeout=120)
model = client.models.list().data[0].id
create = client.responses.create
print(f"model {model}")

print("string input: greedy text equals /v1/chat/completions")
r = create(model=model, input=QUESTION, temperature=0, max_output_tokens=MAX, store=True)
check_finished(r, MAX, "string input")
text = r.output_text
check(text and [o.type for o in r.output] == ["message"], f"string input: output {r.output}")
msg = r.output[0]
check(msg.role == "assistant" and msg.id and msg.status in ("completed", "incomplete")
      and [c.type for c in msg.content] == ["output_text"], f"string input: message item {msg}")
chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                      temperature=0, max_tokens=MAX)
check(chat.choices[0].message.content == text,
      f"chat {chat.choices[0].message.content!r} != responses {text!r}")
check(chat.usage.prompt_tokens == r.usage.input_tokens, f"prompt tokens: chat {chat.usage}, responses {r.usage}")
print(f"  {text!r} ({r.status}, {r.usage.output_tokens} tokens)")

print("item input, with and without instructions")
items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
r2 = create(model=model, input=items, temperature=0, max_output_tokens=MAX)
check_finished(r2, MAX, "item input")
check(r2.output_text == text, f"item input {r2.output_text!r} != string input {text!r}")
system = "You are a terse assistant. Answer in one line."
r3 = create(model=model, instructions=system, input=items, temperature=0, max_output_tokens=MAX)
check_finished(r3, MAX, "instructions")
chat = client.chat.completions.create(
    model=model, temperature=0, max_tokens=MAX,
    messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
check(r3.output_text == chat.choices[0].message.content,
      f"instructions {r3.output_text!r} != chat with that system message {chat.choices[0].message.content!r}")
print(f"  {r3.output_text!r}")

print("create(stream=True): typed events in order")
events = list(create(model=model, input=QUESTION, temperature=0, max_output_tokens=MAX, stream=True))
joined, final, _ = check_events(events, "message", "stream")
check(joined == text == final.output_text, f"streamed {joined!r} / final {final.output_text!r} != {text!r}")
check(final.usage and final.usage.output_tokens == r.usage.output_tokens, f"stream usage {final.usage}")

print("responses.stream(): json_schema text")
with client.responses.stream(model=model, input="Pick a colour. Answer in JSON.", text=JSON_FORMAT,
                             temperature=0, max_output_tokens=100) as stream:
    events = list(stream)
    final = stream.get_final_response()
joined, _, _ = check_events(events, "message", "stream helper")
check(final.status == "completed" and joined == final.output_text, f"stream helper: {final.status} {joined!r}")
jsonschema.validate(json.loads(final.output_text), COLOUR)
whole = create(model=model, input="Pick a colour. Answer in JSON.", text=JSON_FORMAT, temperature=0,
               max_output_tokens=100)
check(whole.status == "completed" and whole.output_text == final.output_text,
      f"json_schema whole {whole.output_text!r} ({whole.status}) != streamed {final.output_text!r}")
print(f"  {final.output_text}")

print("retrieve, previous_response_id, delete")
got = client.responses.retrieve(r.id)
check(got.id == r.id and got.status == r.status and got.output_text == text, f"retrieved {got}")
follow = "Name three more."
r4 = create(model=model, input=follow, previous_response_id=r.id, temperature=0, max_output_tokens=MAX)
check_finished(r4, MAX, "previous_response_id")
check(r4.previous_response_id == r.id, f"previous_response_id echoed as {r4.previous_response_id!r}")
chat = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX, messages=[
    {"role": "user", "content": QUESTION}, {"role": "assistant", "content": text},
    {"role": "user", "content": follow}])
check(r4.usage.input_tokens == chat.usage.prompt_tokens and r4.output_text == chat.choices[0].message.content,
      f"continued {r4.output_text!r} ({r4.usage.input_tokens} in) != chat with the history "
      f"{chat.choices[0].message.content!r} ({chat.usage.prompt_tokens} in)")
client.responses.delete(r.id)
try:
    client.responses.retrieve(r.id)
    sys.exit(f"FAIL: {r.id} still retrievable after delete")
except openai.NotFoundError:
    pass
try:
    create(model=model, input=follow, previous_response_id=r.id, max_output_tokens=MAX)
    sys.exit("FAIL: previous_response_id of a deleted response was accepted")
except (openai.NotFoundError, openai.BadRequestError) as e:
    body = e.body if isinstance(e.body, dict) else {}
    check("previous_response_id" in f"{body.get('param')} {body.get('message')}", f"deleted previous: {e.body}")

print("forced function call, whole and streamed, then function_call_output")
ask = "What is the weather in Paris?"
r5 = create(model=model, input=ask, tools=TOOLS, tool_choice=FORCED, temperature=0, max_output_tokens=120)
check(r5.status == "completed", f"forced call: status {r5.status}")
calls = [o for o in r5.output if o.type == "function_call"]
check(len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id, f"forced call: {r5.output}")
call = calls[0]
jsonschema.validate(json.loads(call.arguments), WEATHER)
with client.responses.stream(model=model, input=ask, tools=TOOLS, tool_choice=FORCED, temperature=0,
                             max_output_tokens=120) as stream:
    events = list(stream)
    final = stream.get_final_response()
joined, _, item = check_events(events, "function_call", "streamed call")
check(item.name == "get_weather" and joined == item.arguments == call.arguments,
      f"streamed call {item.name} {joined!r} != whole {call.arguments!r}")
check(final.output[0].parsed_arguments == json.loads(call.arguments), f"parsed {final.output[0]}")
history = [{"role": "user", "content": ask}, *[o.model_dump(exclude_none=True) for o in r5.output],
           {"type": "function_call_output", "call_id": call.call_id,
            "output": json.dumps({"celsius": 18, "sky": "clear"})}]
r6 = create(model=model, input=history, tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=MAX)
check_finished(r6, MAX, "after function_call_output")
check(r6.output_text and all(o.type == "message" for o in r6.output), f"after the tool result: {r6.output}")
print(f"  {call.arguments} -> {r6.output_text!r}")

print("errors name the field")
for field, kw in [("temperature", {"input": QUESTION, "extra_body": {"temperature": "hot"}}),
                  ("input", {"input": [{"type": "message", "role": "wizard", "content": "hi"}]}),
                  ("tool_choice", {"input": ask, "tools": TOOLS,
                                   "tool_choice": {"type": "function", "name": "nope"}})]:
    try:
        create(model=model, max_output_tokens=MAX, **kw)
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        where = f"{body.get('param')} {body.get('message')}"
        check(field in where, f"{kw}: the 400 does not name {field}: {e.body}")
        print(f"  {where}")
        continue
    sys.exit(f"FAIL: {kw} was not refused")
print("responses: all checks passed")
