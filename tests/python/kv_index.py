"""A KV-aware router's index of one replica's prefix cache, built from the replica's KV-cache
events alone (vLLM's ZMQ format, as kiln publishes it), the way llm-d's KV-cache indexer builds
it: each stored block keyed by its parent's hash and its own token ids."""

import json
import urllib.request

import msgpack


class ReplicaIndex:
    """The messages of one publisher (by sequence number), applied in order to the index."""

    def __init__(self):
        self.messages = {}  # seq -> decoded payload
        self.applied = -1
        self.blocks = {}  # (parent hash, block tokens) -> hash
        self.block_size = None
        self.stored = self.removed = 0

    def take(self, seq_frame, payload):
        """One message's sequence frame (8 bytes, big-endian) and msgpack payload."""
        self.messages.setdefault(int.from_bytes(seq_frame, "big"), msgpack.unpackb(payload))

    def replay(self, socket, start=0, wait_ms=10_000):
        """Asks a replay ROUTER (through a DEALER, framed as a REQ would be: an empty
        delimiter, then the start sequence number) for every kept message from `start`."""
        socket.send_multipart([b"", start.to_bytes(8, "big")])
        n = 0
        while True:
            assert socket.poll(wait_ms), "no replay answer"
            empty, seq, payload = socket.recv_multipart()
            assert empty == b"", empty
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b"", payload
                return n
            self.take(seq, payload)
            n += 1

    def apply(self):
        """Applies the messages received since the last call; sequence numbers must run on
        without a gap."""
        for seq in sorted(s for s in self.messages if s > self.applied):
            assert seq == self.applied + 1, f"sequence gap: {self.applied} then {seq}"
            self.applied = seq
            batch = self.messages[seq]
            assert len(batch) in (2, 3), batch
            ts, events = batch[0], batch[1]
            assert isinstance(ts, float) and ts > 1.6e9, ts
            for e in events:
                self._event(e)

    def _event(self, e):
        kind = e[0]
        if kind == "BlockStored":
            hashes, parent, tokens, bs, lora_id, medium, lora_name = e[1:8]
            self.block_size = self.block_size or bs
            assert bs == self.block_size and len(tokens) == len(hashes) * bs, e
            assert medium == "GPU" and lora_id is None and lora_name is None, e
            for i, h in enumerate(hashes):
                self.blocks[(parent, tuple(tokens[i * bs : (i + 1) * bs]))] = h
                parent = h
            self.stored += 1
        elif kind == "BlockRemoved":
            gone = set(e[1])
            before = len(self.blocks)
            for k in [k for k, h in self.blocks.items() if h in gone]:
                del self.blocks[k]
            assert before - len(self.blocks) == len(gone), f"removed unknown blocks: {e}"
            self.removed += 1
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
        else:
            raise AssertionError(f"unknown event {e}")

    def cached_tokens(self, prompt):
        """Leading tokens of `prompt` (token ids) the replica holds, as the index predicts."""
        if not self.block_size:
            return 0
        parent, n = None, 0
        for i in range(0, len(prompt) - len(prompt) % self.block_size, self.block_size):
            h = self.blocks.get((parent, tuple(prompt[i : i + self.block_size])))
            if h is None:
                break
            parent, n = h, n + self.block_size
        return n


def drain(sub, on_message, quiet=0.15):
    """Reads a SUB socket's messages (topic, sequence, payload) until none arrives for `quiet`
    seconds."""
    while sub.poll(int(quiet * 1000)):
        on_message(*sub.recv_multipart())


def complete(http, prompt, max_tokens=1):
    """One greedy /v1/completions call with a prompt of token ids; returns the response."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://{http}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())
