#!/usr/bin/env python3
"""The configs kiln-model's DeepSeek-V4 KV-arithmetic test reads, checked by transformers.

Writes crates/kiln-model/tests/fixtures/deepseek_v4/:
- v4_flash_config.json: DeepSeek-V4-Flash's config.json in the hub's own names (DeepSeek's:
  compress_ratios with the MTP layer's entry last, num_hash_layers, qk_rope_head_dim,
  rope_scaling), with the published values; transformers' DeepseekV4Config must read it back
  to 2 sliding, 21 CSA and 20 HCA layers;
- transformers_default_config.json: DeepseekV4Config() as transformers saves it (its own
  names; V4-Pro's layer schedule);
- v32_default_config.json: DeepseekV32Config() as transformers saves it (V3.2's MLA shape).

Run by hand with transformers >= 5.17 (tested with 5.25.0); CI never runs it:
    python scripts/make_deepseek_v4_kv_fixtures.py
"""

import json
import pathlib
import tempfile

import transformers
from transformers import DeepseekV32Config, DeepseekV4Config

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/kiln-model/tests/fixtures/deepseek_v4"

LAYERS = 43
# Two sliding-only layers, then CSA (ratio 4) on even and HCA (128) on odd layers; the MTP
# layer's 0 last.
COMPRESS_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, LAYERS)] + [0]

FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 4096,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": COMPRESS_RATIOS,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 3,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "hidden_act": "silu",
    "attention_bias": False,
    "topk_method": "noaux_tc",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def saved(config) -> dict:
    """The config as transformers' save_pretrained writes it."""
    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d)
        return json.loads((pathlib.Path(d) / "config.json").read_text())


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    read = DeepseekV4Config(**FLASH)
    kinds = read.layer_types
    counts = {k: kinds.count(k) for k in set(kinds)}
    assert counts == {
        "sliding_attention": 2,
        "compressed_sparse_attention": 21,
        "heavily_compressed_attention": 20,
    }, counts
    assert read.qk_rope_head_dim == 64 and read.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    files = {
        "v4_flash_config.json": FLASH,
        "transformers_default_config.json": saved(DeepseekV4Config()),
        "v32_default_config.json": saved(DeepseekV32Config()),
    }
    for name, cfg in files.items():
        (OUT / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        print("wrote", OUT / name)
    print("transformers", transformers.__version__)


if __name__ == "__main__":
    main()
