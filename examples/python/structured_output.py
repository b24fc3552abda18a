"""Structured output and tool calls through the official OpenAI Python client, checked by
`jsonschema` itself:
every JSON-schema request of the test set (nested objects, arrays with bounds, enums,
patterns, bounded numbers, nullable fields), greedy and sampled under several seeds, whole and
streamed, returns output that validates; vLLM's `structured_outputs` (regex, choice, grammar,
json) is honoured; an invalid schema, regex or grammar is a 400 naming the field; forced tool
calls (`tool_choice` required or named, whole and streamed) come back as `tool_calls` whose
arguments validate against the function's parameters, and round-trip as history. Exits
non-zero, saying what failed, if any check does.

Install: pip install openai jsonschema
Run:     python3 examples/python/structured_output.py [HOST:PORT]   (kiln serve's --http-listen)
"""
import json
import re
import sys
import time
import urllib.request

import jsonschema
import openai
from openai import OpenAI


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
            sys.exit(f"FAIL: {address} not healthy after {wait_s} s")
        time.sleep(0.5)


SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": ["string", "null"], "maxLength": 40},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["id", "items", "status"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "celsius": {"type": "number", "minimum": -60, "maximum": 60},
            "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
            "wind": {
                "anyOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "properties": {"kmh": {"type": "integer", "minimum": 0, "maximum": 200}},
                        "required": ["kmh"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
        "required": ["city", "celsius", "sky", "wind"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "array",
        "items": {"type": "string", "maxLength": 10},
        "minItems": 2,
        "maxItems": 4,
    },
    "flag": {"type": "boolean"},
}

PROMPTS = {
    "person": "Describe a fictional person as JSON.",
    "order": "Write an example shop order as JSON.",
    "weather": "Give today's weather in Paris as JSON.",
    "tags": "List a few tags for a blog post about baking bread, as a JSON array.",
    "flag": "Is water wet? Answer in JSON.",
}


MODEL = None  # the served model's id, from /v1/models


def chat(client, prompt, max_tokens=160, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        **kw,
    )


def main():
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8000"
    wait_until_healthy(address, 600)
    client = OpenAI(base_url=f"http://{address}/v1", api_key="unused", timeout=300)
    global MODEL
    MODEL = client.models.list().data[0].id

    # Every schema: greedy, and sampled under three seeds; validated by jsonschema.
    checked = 0
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        for temperature, seed in [(0.0, None), (0.9, 1), (0.9, 2), (0.9, 3)]:
            r = chat(client, PROMPTS[name], response_format=fmt, temperature=temperature, seed=seed)
            text = r.choices[0].message.content
            what = f"{name} (temperature {temperature}, seed {seed}): {text!r}"
            check(r.choices[0].finish_reason == "stop", f"{what} ended {r.choices[0].finish_reason}")
            try:
                jsonschema.validate(json.loads(text), schema)
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                sys.exit(f"FAIL: {what} does not validate: {e}")
            checked += 1
    print(f"json_schema: {checked} outputs validate")

    # Streamed: the deltas join to valid output, the last chunk says stop.
    schema = SCHEMAS["order"]
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema}}
    parts, finish = [], None
    for chunk in chat(client, PROMPTS["order"], response_format=fmt, temperature=0.7, seed=5, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(parts)
    jsonschema.validate(json.loads(text), schema)
    check(finish == "stop", f"streamed order ended {finish}")
    print(f"streamed json_schema validates: {text}")

    # json_object: any object.
    r = chat(
        client,
        "Give a JSON object with the keys name and colour for a cat.",
        response_format={"type": "json_object"},
        temperature=0.0,
    )
    check(r.choices[0].finish_reason == "stop", f"json_object ended {r.choices[0].finish_reason}")
    check(isinstance(json.loads(r.choices[0].message.content), dict), "json_object is not an object")

    # vLLM's structured_outputs: regex, choice, grammar, json; n > 1 all match.
    r = chat(
        client,
        "Make up a licence plate.",
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}-[A-Z]{2}"}},
        temperature=0.9,
        seed=4,
        n=3,
    )
    for c in r.choices:
        check(re.fullmatch("[A-Z]{2}-[0-9]{3}-[A-Z]{2}", c.message.content), f"regex: {c.message.content!r}")
    choices = ["positive", "negative", "neutral"]
    r = chat(
        client,
        "Sentiment of 'I love this bread!'",
        extra_body={"structured_outputs": {"choice": choices}},
        temperature=0.0,
    )
    check(r.choices[0].message.content in choices, f"choice: {r.choices[0].message.content!r}")
    grammar = 'start: NUM OP NUM\nNUM: /[0-9]{1,3}/\nOP: " + " | " - "'
    r = chat(
        client,
        "Write a sum.",
        extra_body={"structured_outputs": {"grammar": grammar}},
        temperature=0.9,
        seed=6,
    )
    check(re.fullmatch(r"[0-9]{1,3} [+-] [0-9]{1,3}", r.choices[0].message.content), f"grammar: {r.choices[0].message.content!r}")
    r = client.completions.create(
        model=MODEL,
        prompt="A JSON list of two colours:",
        max_tokens=40,
        extra_body={"structured_outputs": {"json": SCHEMAS["tags"]}},
        temperature=0.0,
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["tags"])
    print("structured_outputs: regex, choice, grammar, json match")

    # Bad constraints: 400 naming the field, before anything runs.
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}}, "structured_outputs.grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ]
    for kw, field in bad:
        try:
            chat(client, "hi", **kw)
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            where = f"{body.get('param')} {body.get('message')}"
            check(field in where, f"{kw}: the 400 does not name {field}: {where}")
            continue
        sys.exit(f"FAIL: {kw} was not refused")
    print(f"bad constraints: {len(bad)} refused with 400")

    # Tool calls: forced (required, or one named function) calls parse and validate.
    weather = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}},
    ]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]

    def check_call(call, name):
        check(call.type == "function" and call.id, f"tool call without id/type: {call}")
        check(call.function.name == name, f"called {call.function.name}, expected {name}")
        params = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
        jsonschema.validate(json.loads(call.function.arguments), params)

    for choice, name in [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]:
        for temperature, seed in [(0.0, None), (0.9, 7)]:
            r = client.chat.completions.create(model=MODEL, messages=question, tools=tools, tool_choice=choice,
                                               max_tokens=120, temperature=temperature, seed=seed)
            c = r.choices[0]
            check(c.finish_reason == "tool_calls", f"{choice}: finish_reason {c.finish_reason}")
            check(c.message.tool_calls and len(c.message.tool_calls) == 1, f"{choice}: {c.message}")
            call = c.message.tool_calls[0]
            check_call(call, name or call.function.name)
    # Streamed: the deltas carry the call with its id.
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=question, tools=tools, tool_choice="required",
                                                max_tokens=120, temperature=0.0, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    check(finish == "tool_calls" and len(calls) == 1, f"streamed call: {calls} {finish}")
    streamed = calls[0]
    check(streamed["id"], "streamed call has no id")
    params = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == streamed["name"])
    jsonschema.validate(json.loads(streamed["arguments"]), params)
    # Round trip: the call and its result as history, then an answer in text.
    r = client.chat.completions.create(model=MODEL, messages=question, tools=tools, tool_choice="required", max_tokens=120, temperature=0.0)
    call = r.choices[0].message.tool_calls[0]
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none", max_tokens=32, temperature=0.0)
    check(r.choices[0].message.content and not r.choices[0].message.tool_calls, f"after the tool result: {r.choices[0].message}")
    for kw, field in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                      ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name")]:
        try:
            client.chat.completions.create(model=MODEL, messages=question, max_tokens=8, **{"tools": tools, **kw})
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            check(body.get("param") == field, f"{kw}: param {body.get('param')}, expected {field}")
            continue
        sys.exit(f"FAIL: {kw} was not refused")
    print("tool calls: required, named, streamed and round trip")
    print("structured output: all checks passed")


if __name__ == "__main__":
    main()
