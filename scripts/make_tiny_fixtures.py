#!/usr/bin/env python3
"""Tiny random-weight models and their logits from Hugging Face `transformers`, for kiln-model's
architecture tests (run by hand, never by CI; needs torch, transformers, safetensors).

Each fixture folder holds `config.json`, `model.safetensors` (float32) and `reference.json`
(input ids and the float32 logits at every position). The configs exercise what the default
model does not: Mistral's sliding window, Qwen2's q/k/v biases, Llama 3's rope scaling, an
untied LM head and a head_dim override; Gemma 3 (text only) with sliding and full attention
layers mixed, a RoPE base per layer type (linear scaling on the full ones), q/k norms,
`query_pre_attn_scalar`, `(1 + w)` norms, GELU-tanh, a scaled embedding and final logit
soft-capping; Qwen3's q/k RMSNorm with a head_dim independent of hidden / heads.

    python scripts/make_tiny_fixtures.py [NAME...] [--out DIR]   (no NAME: all of them)
"""
import argparse
import json
import pathlib

import torch
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          Qwen2Config, Qwen3Config)

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/kiln-testkit/fixtures/tiny"
SEQ = 40

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

CONFIGS = {
    "llama3": LlamaConfig(
        **COMMON,
        head_dim=32,  # head_dim override: 4 heads x 32 != hidden 64
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "mistral": MistralConfig(**COMMON, rope_theta=10000.0, sliding_window=7),
    "qwen2": Qwen2Config(**{**COMMON, "tie_word_embeddings": True}, rope_theta=1000000.0,
                         use_sliding_window=False),
    # 4 layers: sliding, sliding, full, sliding (not a simple alternation), window 8 over 40
    # tokens; RoPE base 10000 on sliding layers, 100000 with linear scaling x4 on full ones;
    # scores scaled by 24^-0.5 although head_dim is 32 (and hidden / heads is 16).
    "gemma3": Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=10.0,
        attn_logit_softcapping=None,
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    ),
    # q/k RMSNorm over each head, no biases, head_dim 32 while hidden / heads is 16, GQA 4:2.
    "qwen3": Qwen3Config(**{**COMMON, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
                         head_dim=32, rope_theta=1000000.0, attention_bias=False,
                         use_sliding_window=False),
}

# Gemma's RMSNorm scales by (1 + w): its norm weights are drawn around 0, not 1; its embedding
# is drawn wider (it is the tied LM head too) so that the logits before the cap of 10 reach
# about 12: tanh bends them measurably without saturating.
ZERO_CENTRED_NORMS = {"gemma3"}
EMBED_STD = {"gemma3": 0.25}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", help=f"fixtures to write, of {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help=f"output folder (default {OUT})")
    args = ap.parse_args()
    for name in args.names:
        if name not in CONFIGS:
            ap.error(f"unknown fixture {name!r} (known: {', '.join(CONFIGS)})")
    for name in args.names or list(CONFIGS):
        cfg = CONFIGS[name]
        torch.manual_seed(1234)
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        # Larger-than-default weights so attention patterns are not near-uniform.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.08)
            for n, p in model.named_parameters():
                if "norm" in n:
                    if name in ZERO_CENTRED_NORMS:
                        p.uniform_(-0.2, 0.2)
                    else:
                        p.uniform_(0.8, 1.2)
                if n == "model.embed_tokens.weight" and name in EMBED_STD:
                    p.normal_(0.0, EMBED_STD[name])
        model.eval()
        ids = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = model(ids).logits[0]
        d = args.out / name
        d.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, d / "model.safetensors", metadata={"format": "pt"})
        cfg.save_pretrained(d)
        (d / "reference.json").write_text(json.dumps({
            "input_ids": ids[0].tolist(),
            "logits": [[round(float(x), 6) for x in row] for row in logits],
        }, separators=(",", ":")) + "\n")
        print(f"{name}: {sum(v.numel() for v in state.values())} params -> {d}; logits std "
              f"{float(logits.std()):.3f}, max |logit| {float(logits.abs().max()):.3f}")


if __name__ == "__main__":
    main()
