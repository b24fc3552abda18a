"""Waits until every HOST:PORT given answers GET /health with 200 (kiln's HTTP port, or nginx in
front of it). Usage: wait_serving.py SECONDS HOST:PORT..."""

import sys
import time
import urllib.request

within = float(sys.argv[1])
deadline = time.time() + within
for addr in sys.argv[2:]:
    while True:
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.time() < deadline, f"{addr} not serving after {within:.0f} s"
        time.sleep(0.5)
