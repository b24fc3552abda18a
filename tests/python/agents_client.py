"""kiln behind the `openai-agents` SDK: an `Agent` with one `@function_tool` (`add`) on the SDK's
default model class, `OpenAIResponsesModel` (so every turn is a `/v1/responses` call), with
tracing off. SmolLM2-135M will not pick a tool by itself, so the runs force it:
`ModelSettings(tool_choice="add", temperature=0)`.

1. `Runner.run`, `tool_use_behavior="stop_on_first_tool"`: the model calls `add`, the SDK runs it
   with the arguments kiln produced, and the run ends with the tool's result as its output.
2. The same through `Runner.run_streamed` (kiln's typed SSE events, parsed by the SDK).
3. Two turns: the tool switches itself off once it has run (`is_enabled`), so the second request
   carries the `function_call` and `function_call_output` items as history and the agent answers
   in its `output_type` (a json_schema `text.format`), which the SDK validates.

Exits non-zero, saying what failed, if any check does.

Written against openai-agents 0.24.0, openai 3.63.0 (pydantic 2.14.4).
Usage: agents_client.py HOST:PORT   (kiln serve's --http-listen; KILN_API_KEY if it has a key)
"""
import asyncio
import os
import sys
import time
import urllib.request

from openai import AsyncOpenAI
from pydantic import BaseModel

from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, ToolCallItem,
                    ToolCallOutputItem, function_tool, set_tracing_disabled)

calls = []  # (a, b) for every time the model's call ran `add`


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


def add(a: int, b: int) -> int:
    """Add two integers and return their sum.

    Args:
        a: The first integer.
        b: The second integer.
    """
    calls.append((a, b))
    return a + b


class Answer(BaseModel):
    result: int


def check_tool_run(result, what):
    """One call of `add` ran with integer arguments; the run's items say so."""
    check(len(calls) == 1, f"{what}: add ran {len(calls)} times: {calls}")
    a, b = calls[0]
    check(isinstance(a, int) and isinstance(b, int), f"{what}: add got {calls[0]}")
    kinds = [type(i).__name__ for i in result.new_items]
    check(any(isinstance(i, ToolCallItem) for i in result.new_items)
          and any(isinstance(i, ToolCallOutputItem) for i in result.new_items), f"{what}: items {kinds}")
    check(result.raw_responses and all(r.response_id and r.response_id.startswith("resp")
                                       for r in result.raw_responses),
          f"{what}: response ids {[r.response_id for r in result.raw_responses]}")
    return a + b


async def main():
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8000"
    print(f"waiting for kiln at http://{address}")
    wait_until_healthy(address, float(os.environ.get("KILN_CLIENT_WAIT_S", "600")))
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"http://{address}/v1", api_key=os.environ.get("KILN_API_KEY", "unused"),
                         max_retries=0, timeout=120)
    model_id = (await client.models.list()).data[0].id
    model = OpenAIResponsesModel(model=model_id, openai_client=client)
    forced = ModelSettings(tool_choice="add", temperature=0, max_tokens=128)
    question = "What is 2 plus 3? Use the add tool."
    print(f"model {model_id}")

    print("Runner.run: forced call, stop_on_first_tool")
    agent = Agent(name="calculator", instructions="You add numbers with the add tool.", model=model,
                  tools=[function_tool(add)], model_settings=forced, tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(agent, question, max_turns=2)
    total = check_tool_run(result, "run")
    # stop_on_first_tool's final output is the tool's output as the SDK recorded it (text in 0.24).
    check(str(result.final_output) == str(total) and len(result.raw_responses) == 1,
          f"run: final output {result.final_output!r} after {len(result.raw_responses)} turns, add gave {total}")
    usage = result.context_wrapper.usage
    check(usage.requests == 1 and usage.input_tokens > 0 and usage.output_tokens > 0, f"run: usage {usage}")
    print(f"  add{calls[0]} = {result.final_output}")

    print("Runner.run_streamed: the same, over SSE")
    calls.clear()
    streamed = Runner.run_streamed(agent, question, max_turns=2)
    kinds = [event.type async for event in streamed.stream_events()]
    check(streamed.is_complete and "raw_response_event" in kinds and "run_item_stream_event" in kinds,
          f"streamed: complete {streamed.is_complete}, events {sorted(set(kinds))}")
    total = check_tool_run(streamed, "streamed")
    check(str(streamed.final_output) == str(total),
          f"streamed: final output {streamed.final_output!r}, add gave {total}")
    print(f"  add{calls[0]} = {streamed.final_output}")

    print("two turns: the tool result goes back as history, the answer is an output_type")
    calls.clear()
    once = function_tool(add, is_enabled=lambda ctx, agent: not calls)
    agent = Agent(name="calculator", instructions="You add numbers with the add tool.", model=model,
                  tools=[once], model_settings=forced, output_type=Answer)
    result = await Runner.run(agent, question, max_turns=3)
    check_tool_run(result, "two turns")
    check(len(result.raw_responses) == 2 and isinstance(result.final_output, Answer),
          f"two turns: {len(result.raw_responses)} responses, final output {result.final_output!r}")
    print(f"  add{calls[0]}, then {result.final_output!r}")
    await client.close()
    print("agents: all checks passed")


if __name__ == "__main__":
    asyncio.run(main())
