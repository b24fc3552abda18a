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

import json
import random
import sys
import time
import urllib.request

import msgpack
import zmq

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


def complete(prompt, max_tokens=1):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://{http}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


messages = {}  # seq -> decoded payload
block_size = None


def take(frames):
    t, seq, payload = frames
    assert t == topic.encode(), (t, topic)
    seq = int.from_bytes(seq, "big")
    messages[seq] = msgpack.unpackb(payload)


def drain(quiet=0.15):
    """Reads live messages until none arrives for `quiet` seconds."""
    while sub.poll(int(quiet * 1000)):
        take(sub.recv_multipart())


# Until the subscription holds (and, connecting, until kiln has reached us), requests are made
# and messages may be missed: replay fills the gap.
deadline = time.time() + 30
while not messages:
    assert time.time() < deadline, "no KV event arrived in 30 s"
    # A prompt of its own each time, so it stores a block the cache did not hold.
    complete([random.randrange(100, 20000) for _ in range(20)])
    drain(0.5)
# A DEALER, framed as a REQ would be (empty delimiter, then the start sequence number): one
# request, many replies, which a REQ socket would refuse after the first.
replay = ctx.socket(zmq.DEALER)
replay.connect(replay_addr)
replay.send_multipart([b"", (0).to_bytes(8, "big")])
replayed = 0
while True:
    assert replay.poll(10_000), "no replay answer in 10 s"
    empty, seq, payload = replay.recv_multipart()
    assert empty == b"", empty
    seq = int.from_bytes(seq, "big", signed=True)
    if seq == -1:
        assert payload == b""
        break
    messages.setdefault(seq, msgpack.unpackb(payload))
    replayed += 1
print(f"replayed {replayed} messages; live from {min(messages)} .. {max(messages)}")

# The router's index: (parent hash, block tokens) -> hash, kept in sequence order.
index = {}
applied = -1


def apply_all():
    global applied, block_size
    drain()
    for seq in sorted(s for s in messages if s > applied):
        assert seq == applied + 1, f"sequence gap: {applied} then {seq}"
        applied = seq
        batch = messages[seq]
        assert len(batch) in (2, 3), batch
        ts, events = batch[0], batch[1]
        assert isinstance(ts, float) and ts > 1.6e9, ts
        for e in events:
            kind = e[0]
            if kind == "BlockStored":
                hashes, parent, tokens, bs, lora_id, medium, lora_name = e[1:8]
                block_size = block_size or bs
                assert bs == block_size and len(tokens) == len(hashes) * bs, e
                assert medium == "GPU" and lora_id is None and lora_name is None, e
                for i, h in enumerate(hashes):
                    index[(parent, tuple(tokens[i * bs : (i + 1) * bs]))] = h
                    parent = h
            elif kind == "BlockRemoved":
                gone = set(e[1])
                before = len(index)
                for k in [k for k, h in index.items() if h in gone]:
                    del index[k]
                assert before - len(index) == len(gone), f"removed unknown blocks: {e}"
            elif kind == "AllBlocksCleared":
                index.clear()
            else:
                raise AssertionError(f"unknown event {e}")


def predicted(prompt):
    parent, n = None, 0
    for i in range(0, len(prompt) - len(prompt) % block_size, block_size):
        h = index.get((parent, tuple(prompt[i : i + block_size])))
        if h is None:
            break
        parent, n = h, n + block_size
    return n


apply_all()
assert block_size, "no BlockStored yet"
rng = random.Random(3)
systems = [[rng.randrange(100, 20000) for _ in range(3 * block_size)] for _ in range(3)]
hits = checked = 0
for i in range(40):
    # A shared "system prompt", a user part of its own, never a whole number of blocks.
    prompt = rng.choice(systems) + [rng.randrange(100, 20000) for _ in range(rng.randrange(1, 60))]
    if len(prompt) % block_size == 0:
        prompt.append(5)
    apply_all()
    want = predicted(prompt)
    got = complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert got == want, f"request {i}: the index predicts {want} cached tokens, kiln found {got}"
    hits += want > 0
    checked += 1
apply_all()
stored = sum(1 for m in messages.values() for e in m[1] if e[0] == "BlockStored")
removed = sum(1 for m in messages.values() for e in m[1] if e[0] == "BlockRemoved")
print(
    f"{mode}: {len(messages)} messages ({stored} BlockStored, {removed} BlockRemoved), "
    f"{len(index)} blocks indexed; {checked} predictions exact, {hits} of them hits"
)
assert hits >= 10, hits
# The replica runs with a pool too small for every prompt: blocks were evicted, and the index
# followed (every prediction above stayed exact).
assert removed > 0, "no BlockRemoved: run kiln with a small --kv-cache-memory" 
