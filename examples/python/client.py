"""A kiln gRPC client: waits for the server, then tokenizes and generates greedily.

Stubs: python3 -m grpc_tools.protoc -I proto --python_out=OUT --grpc_python_out=OUT proto/kiln/v1/*.proto
Run:   PYTHONPATH=OUT python3 examples/python/client.py [HOST:PORT]
"""
import os
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kiln.v1 import generate_pb2, generate_pb2_grpc, models_pb2, models_pb2_grpc
from kiln.v1 import tokenize_pb2, tokenize_pb2_grpc

TIMEOUT = 300  # seconds per call: a hung server fails instead of hanging

# What each model's own tokenizer and transformers' greedy decoding give (the
# golden fixtures): ids of "The capital of France is", and the greedy continuation of
# "Once upon a time".
EXPECTED = {
    "SmolLM2": ([504, 3575, 282, 4649, 314], ", the city of Nova Haven"),
    # Gemma's tokenizer adds BOS (2).
    "gemma-3": ([2, 818, 5279, 529, 7001, 563], ", there was a little girl named Lily."),
}


def wait_until_serving(channel, wait_s):
    # The server loads and warms up the model first; UNAVAILABLE until then is normal.
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
        if time.monotonic() > deadline:
            sys.exit(f"not SERVING after {wait_s:.0f} s")
        time.sleep(1)


address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
print(f"waiting for kiln at {address}")
# Retry a refused connection every second instead of backing off for up to two minutes.
with grpc.insecure_channel(address, options=[("grpc.max_reconnect_backoff_ms", 1000)]) as channel:
    wait_until_serving(channel, float(os.environ.get("KILN_CLIENT_WAIT_S", "600")))

    models = models_pb2_grpc.ModelsStub(channel)
    info = models.GetModelInfo(models_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    print(f"model {info.model_id}, context length {info.context_length}")
    known = [k for k in EXPECTED if k.lower() in info.model_id.lower()]
    assert known, f"no expectations for model {info.model_id}"
    want_ids, want_text = EXPECTED[known[0]]

    tokenization = tokenize_pb2_grpc.TokenizationStub(channel)
    prompt = tokenize_pb2.TokenizeRequest(text="The capital of France is")
    ids = list(tokenization.Tokenize(prompt, timeout=TIMEOUT).token_ids)
    assert ids == want_ids, ids

    generation = generate_pb2_grpc.GenerationStub(channel)
    request = generate_pb2.GenerateRequest(
        text="Once upon a time",
        sampling=generate_pb2.SamplingParams(temperature=0),  # greedy
        stopping=generate_pb2.StoppingCriteria(max_new_tokens=12),
    )
    out = generation.Generate(request, timeout=TIMEOUT).outputs[0]
    print(f"Once upon a time{out.text}")
    assert out.text.startswith(want_text), out.text
    reason = generate_pb2.FinishReason.Name(out.finish.reason)
    assert reason == "LENGTH", reason

    # Streamed: text deltas as tokens come; usage (and timing) on the last message.
    text, last = "", generate_pb2.GenerateResponse()
    for last in generation.GenerateStream(request, timeout=TIMEOUT):
        text += "".join(o.text for o in last.outputs if o.index == 0)
    assert text == out.text, (text, out.text)
    assert last.usage.completion_tokens == 12, last.usage
print("ok")
