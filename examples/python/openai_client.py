"""kiln through the official OpenAI Python client: waits for the server, then checks chat and
completions (whole and streamed), n and seed, stop strings, error objects, and that a dropped
stream aborts its request and frees its KV blocks. Exits non-zero, saying what failed, if any
check does.

Install: pip install openai
Run:     python3 examples/python/openai_client.py [HOST:PORT]   (kiln serve's --http-listen)
"""
import os
import re
import sys
import time
import urllib.request

import openai
from openai import OpenAI

PROMPT = "Once upon a time"
GREEDY = ", the city of Nova Haven"  # what transformers gives SmolLM2-135M-Instruct


def check(ok, what):
    if not ok:
        sys.exit(f"FAIL: {what}")


def get(path):
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
        return reply.status, reply.read().decode()


def wait_until_healthy(wait_s):
    # /health is 503 while the model loads and warms up, and refused before the port opens.
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if get("/health")[0] == 200:
                return
        except OSError:  # refused, reset, timed out, or an HTTP error status such as 503
            pass
        if time.monotonic() > deadline:
            sys.exit(f"FAIL: /health not 200 after {wait_s:.0f} s")
        time.sleep(1)


def metric(text, name):
    """The sum of a Prometheus metric's samples (over its labels)."""
    values = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    check(values, f"/metrics has no {name}")
    return sum(float(v) for v in values)


def expect_error(kind, param, call, **kwargs):
    try:
        call(model=kwargs.pop("model", model), **kwargs)
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}  # the inner `error` object
        check(isinstance(e, kind) and body.get("param") == param,
              f"wanted {kind.__name__} naming {param!r}, got {e.status_code}: {e.body}")
        print(f"  {kind.__name__}: {body.get('message')}")
        return
    sys.exit(f"FAIL: {kwargs} did not raise {kind.__name__}")


address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8000"
print(f"waiting for kiln at http://{address}")
wait_until_healthy(float(os.environ.get("KILN_CLIENT_WAIT_S", "600")))
client = OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=300)
chat, completions = client.chat.completions.create, client.completions.create

models = client.models.list().data
check(len(models) == 1, f"/v1/models: {models}")
model = models[0].id
print(f"model {model}")

print("chat, whole and streamed")
messages = [{"role": "user", "content": "Name three colours."}]
reply = chat(model=model, messages=messages, temperature=0, max_tokens=12)
check(reply.object == "chat.completion" and len(reply.choices) == 1, f"chat: {reply}")
choice, usage = reply.choices[0], reply.usage
check(choice.message.role == "assistant" and choice.message.content, f"chat: {choice}")
check(choice.finish_reason in ("stop", "length"), f"chat finish_reason: {choice}")
check(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, f"usage: {usage}")
check(0 < usage.completion_tokens <= 12, f"usage: {usage}")
print(f"  {choice.message.content!r} ({choice.finish_reason}, {usage.completion_tokens} tokens)")

chunks = list(chat(model=model, messages=messages, temperature=0, max_tokens=12, stream=True,
                   stream_options={"include_usage": True}))
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check(text == choice.message.content, f"streamed chat {text!r} != {choice.message.content!r}")
last = chunks[-1]
check(last.choices == [] and last.usage is not None, f"last chunk carries no usage: {last}")
check(last.usage.completion_tokens == usage.completion_tokens, f"stream usage: {last.usage}")

print("completions, whole and streamed")
reply = completions(model=model, prompt=PROMPT, temperature=0, max_tokens=12)
check(reply.object == "text_completion", f"completion: {reply}")
greedy = reply.choices[0].text
print(f"  {PROMPT}{greedy}")
check(greedy.startswith(GREEDY), f"greedy text {greedy!r} does not start with {GREEDY!r}")
check(reply.choices[0].finish_reason == "length", f"completion: {reply.choices[0]}")
check(reply.usage.completion_tokens == 12, f"completion usage: {reply.usage}")
stream = completions(model=model, prompt=PROMPT, temperature=0, max_tokens=12, stream=True)
text = "".join(c.choices[0].text for c in stream if c.choices)
check(text == greedy, f"streamed completion {text!r} != {greedy!r}")

print("n=2 with a seed is reproducible")
sampled = [chat(model=model, messages=messages, n=2, seed=1234, temperature=0.8, max_tokens=12)
           for _ in range(2)]
for r in sampled:
    check(sorted(c.index for c in r.choices) == [0, 1], f"n=2 choices: {r.choices}")
first, again = ([c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
                for r in sampled)
check(first == again, f"same seed, different texts: {first} vs {again}")
print(f"  {first}")

print("stop strings, whole and streamed")
reply = completions(model=model, prompt=PROMPT, temperature=0, max_tokens=12, stop=[" Nova"])
stopped = reply.choices[0]
check(stopped.finish_reason == "stop", f"stop: {stopped}")
check(stopped.text == greedy.split(" Nova")[0], f"stop: {stopped.text!r} (greedy {greedy!r})")
stream = completions(model=model, prompt=PROMPT, temperature=0, max_tokens=12, stop=[" Nova"],
                     stream=True)
parts = [c.choices[0] for c in stream if c.choices]
text = "".join(p.text for p in parts)
check(text == stopped.text and parts[-1].finish_reason == "stop", f"streamed stop: {parts}")
print(f"  {PROMPT}{stopped.text} (stopped before ' Nova')")

print("errors")
expect_error(openai.BadRequestError, "temperature", chat, messages=messages, temperature=-1)
expect_error(openai.BadRequestError, "messages", chat, messages=[])
expect_error(openai.BadRequestError, "messages[0].role", chat,
             messages=[{"role": "wizard", "content": "hi"}])
expect_error(openai.BadRequestError, "prompt", completions, prompt=[])
expect_error(openai.BadRequestError, "max_tokens", completions, prompt=PROMPT,
             extra_body={"max_tokens": "twelve"})
expect_error(openai.NotFoundError, "model", completions, model="no-such-model", prompt=PROMPT)

print("a dropped stream aborts its request")
before = metric(get("/metrics")[1], "kiln_generation_tokens_total")
stream = completions(model=model, prompt=PROMPT, temperature=0, max_tokens=200, stream=True,
                     extra_body={"ignore_eos": True})
next(iter(stream))
stream.close()
deadline = time.monotonic() + 30
while True:
    text = get("/metrics")[1]
    used = metric(text, "kiln_kv_cache_used_blocks")
    running = metric(text, "kiln_requests_running")
    if used == 0 and running == 0:
        break
    check(time.monotonic() < deadline, f"30 s on: {used} KV blocks used, {running} running")
    time.sleep(0.2)
generated = metric(text, "kiln_generation_tokens_total") - before
check(generated < 200, f"the dropped request still generated {generated:.0f} of 200 tokens")
print(f"  aborted after {generated:.0f} tokens; no KV blocks in use")
print("ok")
