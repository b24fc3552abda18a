"""kiln's /metrics as a vLLM-built router or dashboard reads it, parsed by prometheus_client's
own OpenMetrics parser: vLLM's families with their types and `model_name` label, equal to
kiln's own figures. Usage: vllm_metrics.py HOST:PORT MODEL_NAME (the HTTP or metrics port of a
`kiln serve` that has served some requests)."""

import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families

addr, model = sys.argv[1], sys.argv[2]
text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=30).read().decode()
families = {f.name: f for f in text_string_to_metric_families(text)}


def value(family, sample=None, **labels):
    """The one sample of `family` named `sample` (the family's name by default)."""
    f = families[family]
    found = [
        s.value
        for s in f.samples
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{sample or family} {labels}: {found}"
    return found[0]


# (vLLM's family, its type, kiln's family and sample it mirrors)
mapping = [
    ("vllm:num_requests_running", "gauge", "kiln_requests_running", None),
    ("vllm:kv_cache_usage_perc", "gauge", "kiln_kv_cache_usage_ratio", None),
    ("vllm:gpu_cache_usage_perc", "gauge", "kiln_kv_cache_usage_ratio", None),
    ("vllm:prompt_tokens", "counter", "kiln_prompt_tokens", "_total"),
    ("vllm:generation_tokens", "counter", "kiln_generation_tokens", "_total"),
    ("vllm:prefix_cache_queries", "counter", "kiln_prefix_cache_query_tokens", "_total"),
    ("vllm:prefix_cache_hits", "counter", "kiln_prefix_cache_hit_tokens", "_total"),
    ("vllm:num_preemptions", "counter", "kiln_preemptions", "_total"),
    ("vllm:spec_decode_num_drafts", "counter", "kiln_spec_decode_verify_steps", "_total"),
    ("vllm:spec_decode_num_draft_tokens", "counter", "kiln_spec_decode_proposed_tokens", "_total"),
    ("vllm:spec_decode_num_accepted_tokens", "counter", "kiln_spec_decode_accepted_tokens", "_total"),
    ("vllm:time_to_first_token_seconds", "histogram", "kiln_time_to_first_token_seconds", "_count"),
    ("vllm:inter_token_latency_seconds", "histogram", "kiln_inter_token_latency_seconds", "_count"),
    ("vllm:e2e_request_latency_seconds", "histogram", "kiln_e2e_request_latency_seconds", "_count"),
    ("vllm:request_queue_time_seconds", "histogram", "kiln_queue_time_seconds", "_count"),
]
for name, kind, ours, suffix in mapping:
    f = families.get(name)
    assert f is not None, f"{name} missing"
    assert f.type == kind, f"{name} is a {f.type}, not a {kind}"
    theirs = value(name, name + (suffix or ""), model_name=model, engine="0")
    mine = value(ours, ours + (suffix or ""))
    assert theirs == mine, f"{name} {theirs} != {ours} {mine}"
    print(f"{name + (suffix or '')} = {theirs}")

# vLLM counts preempted requests as waiting.
waiting = value("vllm:num_requests_waiting", model_name=model)
assert waiting == value("kiln_requests_waiting") + value("kiln_requests_preempted"), waiting
info = [s for s in families["vllm:cache_config_info"].samples if s.labels.get("model_name") == model]
assert len(info) == 1 and info[0].value == 1, info
blocks = value("kiln_kv_cache_total_blocks")
assert info[0].labels["num_gpu_blocks"] == str(int(blocks)), info[0].labels
assert int(info[0].labels["block_size"]) > 0, info[0].labels
print(f"vllm:cache_config_info {info[0].labels}")
assert value("vllm:generation_tokens", "vllm:generation_tokens_total", model_name=model) > 0
