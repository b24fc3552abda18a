"""Two kiln replicas behind nginx (deploy/nginx/kiln.conf): a bounded load of gRPC and HTTP
calls through nginx while replica A is drained with SIGTERM. Every call must complete (gRPC
calls refused with UNAVAILABLE are retried, as a gRPC retry policy does; nginx retries HTTP
503s and refused connections itself), and the load must move to replica B.

Usage: drain.py NGINX_GRPC NGINX_HTTP PID_A METRICS_A METRICS_B
(gRPC stubs from proto/ on PYTHONPATH)."""

import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request

import grpc
from kiln.v1 import generate_pb2, generate_pb2_grpc

nginx_grpc, nginx_http, pid_a, metrics_a, metrics_b = sys.argv[1:6]
pid_a = int(pid_a)
TOTAL, WORKERS, DRAIN_AFTER, TOKENS = 120, 6, 30, 16
# A gRPC call refused with UNAVAILABLE (it never ran) is retried this many times.
GRPC_ATTEMPTS = 5


def finished(metrics_addr):
    """Requests the replica has finished (kiln_requests_finished_total, every reason)."""
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10).read().decode()
    return sum(
        float(v) for v in re.findall(r"^kiln_requests_finished_total\{[^}]*\} (\S+)$", text, re.M)
    )


channel = grpc.insecure_channel(nginx_grpc)
stub = generate_pb2_grpc.GenerationStub(channel)


def call_grpc(i):
    req = generate_pb2.GenerateRequest(
        text=f"Request {i}: once upon a time",
        sampling=generate_pb2.SamplingParams(temperature=0),
        stopping=generate_pb2.StoppingCriteria(max_new_tokens=TOKENS, ignore_eos=True),
    )
    for attempt in range(1, GRPC_ATTEMPTS + 1):
        try:
            r = stub.Generate(req, timeout=120)
            assert r.usage.completion_tokens == TOKENS, r.usage
            return attempt
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == GRPC_ATTEMPTS:
                raise
            time.sleep(0.1 * attempt)


def call_http(i):
    body = json.dumps(
        {"prompt": f"Request {i}: once upon a time", "max_tokens": TOKENS, "temperature": 0,
         "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        f"http://{nginx_http}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == TOKENS, out
    return 1


lock = threading.Lock()
next_i = 0
results = []  # (i, protocol, started, attempts or None, error)


def worker():
    global next_i
    while True:
        with lock:
            i = next_i
            if i >= TOTAL:
                return
            next_i += 1
        protocol = "grpc" if i % 2 == 0 else "http"
        started = time.time()
        try:
            attempts = (call_grpc if protocol == "grpc" else call_http)(i)
            err = None
        except Exception as e:  # noqa: BLE001 -- every failure is reported below
            attempts, err = None, repr(e)
        with lock:
            results.append((i, protocol, started, attempts, err))


before_a, before_b = finished(metrics_a), finished(metrics_b)
threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
for t in threads:
    t.start()
while True:
    with lock:
        if len(results) >= DRAIN_AFTER:
            break
    time.sleep(0.01)
at_kill_a, at_kill_b = finished(metrics_a), finished(metrics_b)
killed = time.time()
os.kill(pid_a, signal.SIGTERM)
for t in threads:
    t.join()
after_b = finished(metrics_b)

failed = [r for r in results if r[3] is None]
retried = [r for r in results if r[3] and r[3] > 1]
late = [r for r in results if r[2] > killed + 0.5]
served_a = at_kill_a - before_a
served_b_after = after_b - at_kill_b
print(
    f"sent {len(results)}, completed {len(results) - len(failed)}, failed {len(failed)}, "
    f"gRPC calls retried after UNAVAILABLE {len(retried)}; before the drain A finished "
    f"{served_a:.0f} and B {at_kill_b - before_b:.0f}; after it B finished {served_b_after:.0f} "
    f"(calls started 0.5 s or more after SIGTERM: {len(late)})"
)
for r in failed:
    print("failed:", r)
assert len(results) == TOTAL and not failed, "calls were lost"
assert served_a > 0 and at_kill_b - before_b > 0, "nginx did not spread the load before the drain"
assert served_b_after >= len(late), "the load did not move to replica B"
