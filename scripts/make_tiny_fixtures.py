#!/usr/bin/env python3
"""Tiny random-weight models and their logits from Hugging Face `transformers`, for kiln-model's
architecture tests (run by hand, never by CI; needs torch, transformers, safetensors).

Each fixture folder holds `config.json`, `model.safetensors` (float32) and `reference.json`
(input ids and the float32 logits at every position). The configs exercise what the default
model does not: Mistral's sliding window, Qwen2's q/k/v biases, Llama 3's rope scaling, an
untied LM head and a head_dim override.
"""
import json
import pathlib

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/kiln-model/tests/fixtures/tiny"
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
}


def main():
    for name, cfg in CONFIGS.items():
        torch.manual_seed(1234)
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        # Larger-than-default weights so attention patterns are not near-uniform.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.08)
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.8, 1.2)
        model.eval()
        ids = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = model(ids).logits[0]
        d = OUT / name
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
        print(f"{name}: {sum(v.numel() for v in state.values())} params -> {d}")


if __name__ == "__main__":
    main()
