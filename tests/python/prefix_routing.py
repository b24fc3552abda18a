"""Prefix-aware routing on paper, measured: a chat workload over two kiln replicas, routed
round-robin and then by an llm-d-style precise prefix-cache scorer that knows what each replica
caches from its KV events alone. Prints the prefix-cache hit rate (cached prompt tokens over
prompt tokens, as each replica reports them) under both routings.

Usage: prefix_routing.py A_HTTP A_EVENTS A_REPLAY B_HTTP B_EVENTS B_REPLAY
(each replica started with --kv-events-endpoint 'tcp://*:PORT' --kv-events-replay-endpoint
'tcp://*:PORT' and the default pool, large enough that nothing is evicted).

The workload: conversations that share one of a few system prompts; each turn sends the whole
history so far (system prompt, earlier turns and replies) plus a new user message, as chat
clients do. The two routings get different conversations with the same shape, so the second
finds nothing the first left in the caches."""

import random
import sys

import zmq

from kv_index import ReplicaIndex, complete, drain

a_http, a_events, a_replay, b_http, b_events, b_replay = sys.argv[1:7]
ctx = zmq.Context.instance()


class Replica:
    def __init__(self, name, http, events, replay):
        self.name, self.http = name, http
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(events)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.index = ReplicaIndex()

    def sync(self):
        drain(self.sub, lambda _t, seq, payload: self.index.take(seq, payload), 0.05)
        self.index.apply()


replicas = [Replica("A", a_http, a_events, a_replay), Replica("B", b_http, b_events, b_replay)]
for r in replicas:
    # The warm-up's events were published before we subscribed.
    r.index.replay(r.replay)
    r.sync()
BS = replicas[0].index.block_size
assert BS, "no events from replica A"


def workload(seed, systems=4, conversations=12, turns=4):
    """(conversation, prompt) in arrival order: conversations interleave."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(100, 20000) for _ in range(n)]  # noqa: E731
    sys_prompts = [words(3 * BS) for _ in range(systems)]
    history = {c: list(rng.choice(sys_prompts)) for c in range(conversations)}
    left = {c: turns for c in range(conversations)}
    while left:
        c = rng.choice(sorted(left))
        history[c] += words(rng.randrange(8, 24))  # the user's message
        yield c, list(history[c])
        history[c] += words(rng.randrange(8, 24))  # the reply, as the client keeps it
        left[c] -= 1
        if not left[c]:
            del left[c]


def run(route, seed):
    prompt_tokens = cached = 0
    sent = {r.name: 0 for r in replicas}
    for i, (conv, prompt) in enumerate(workload(seed)):
        for r in replicas:
            r.sync()
        r = route(i, prompt)
        usage = complete(r.http, prompt)["usage"]
        prompt_tokens += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        sent[r.name] += 1
    return cached / prompt_tokens, prompt_tokens, cached, sent


def round_robin(i, prompt):
    return replicas[i % len(replicas)]


def prefix_aware(i, prompt):
    """llm-d's precise prefix-cache scorer: the replica whose cache holds the longest prefix
    of the prompt; ties (a new conversation) alternate, as the load scorer would spread them."""
    scores = [r.index.cached_tokens(prompt) for r in replicas]
    best = max(scores)
    tied = [r for r, s in zip(replicas, scores) if s == best]
    return tied[i % len(tied)]


results = {}
for name, route, seed in (("round-robin", round_robin, 11), ("prefix-aware", prefix_aware, 12)):
    rate, prompt_tokens, cached, sent = run(route, seed)
    results[name] = rate
    print(
        f"{name:13} prefix-cache hit rate {rate:6.1%} ({cached} of {prompt_tokens} prompt "
        f"tokens cached; requests A {sent['A']}, B {sent['B']})"
    )
assert results["prefix-aware"] > results["round-robin"], results
