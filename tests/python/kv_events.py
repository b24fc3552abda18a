"""A KV-aware router's view of one kiln replica, built from its KV-cache events alone, read with
pyzmq + msgpack as llm-d's indexer reads vLLM's.

Usage:
  kv_events.py bind    tcp://127.0.0.1:PUB  tcp://127.0.0.1:REPLAY  HTTP_ADDR TOPIC
      kiln binds (--kv-events-endpoint tcp://*:PUB); this subscriber connects.
  kv_events.py connect tcp://127.0.0.1:PUB  tcp://127.0.0.1:REPLAY  HTTP_ADDR TOPIC
      this subscriber binds PUB; kiln connects to it (--kv-events-endpoint tcp://127.0.0.1:PUB).

Missed messages (before the subscription took hold) come from the replay socket. Then, for
prompts that share prefixes, the index predicts how many prompt tokens the replica has cached,
and the replica's own usage (`prompt_tokens_details.cached_tokens`) must say the same; blocks
evicted for room must leave the index as they leave the replica."""

import random
import sys
import time

import zmq

from kv_index import ReplicaIndex, complete, drain

mode, pub, replay_addr, http, topic = sys.argv[1:6]
ctx = zmq.Context.instance()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
if mode == "bind":
    sub.connect(pub)
elif mode == "connect":
    sub.bind(pub)
else:
    sys.exit(f"unknown mode {mode}")
index = ReplicaIndex()


def on_message(t, seq, payload):
    assert t == topic.encode(), (t, topic)
    index.take(seq, payload)


# Until the subscription holds (and, connecting, until kiln has reached us), requests are made
# and messages may be missed: replay fills the gap.
deadline = time.time() + 30
while not index.messages:
    assert time.time() < deadline, "no KV event arrived in 30 s"
    # A prompt of its own each time, so it stores a block the cache did not hold.
    complete(http, [random.randrange(100, 20000) for _ in range(20)])
    drain(sub, on_message, 0.5)
live = (min(index.messages), max(index.messages))
replay = ctx.socket(zmq.DEALER)
replay.connect(replay_addr)
replayed = index.replay(replay)
print(f"replayed {replayed} messages; live from {live[0]} .. {live[1]}")

drain(sub, on_message)
index.apply()
bs = index.block_size
assert bs, "no BlockStored yet"
rng = random.Random(3)
systems = [[rng.randrange(100, 20000) for _ in range(3 * bs)] for _ in range(3)]
hits = checked = 0
for i in range(40):
    # A shared "system prompt", a user part of its own, never a whole number of blocks.
    prompt = rng.choice(systems) + [rng.randrange(100, 20000) for _ in range(rng.randrange(1, 60))]
    if len(prompt) % bs == 0:
        prompt.append(5)
    drain(sub, on_message)
    index.apply()
    want = index.cached_tokens(prompt)
    got = complete(http, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert got == want, f"request {i}: the index predicts {want} cached tokens, kiln found {got}"
    hits += want > 0
    checked += 1
drain(sub, on_message)
index.apply()
print(
    f"{mode}: {len(index.messages)} messages ({index.stored} BlockStored, {index.removed} "
    f"BlockRemoved), {len(index.blocks)} blocks indexed; {checked} predictions exact, {hits} "
    "of them hits"
)
assert hits >= 10, hits
# The replica runs with a pool too small for every prompt: blocks were evicted, and the index
# followed (every prediction above stayed exact).
assert index.removed > 0, "no BlockRemoved: run kiln with a small --kv-cache-memory"
