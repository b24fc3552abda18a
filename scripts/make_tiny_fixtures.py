#!/usr/bin/env python3
"""Tiny random-weight models and their logits from Hugging Face `transformers`, for kiln-model's
architecture tests (run by hand, never by CI; needs torch, transformers, safetensors).

Each fixture folder holds `config.json`, `model.safetensors` (float32) and `reference.json`
(input ids and the float32 logits at every position). The configs exercise what the default
model does not: Mistral's sliding window, Qwen2's q/k/v biases, Llama 3's rope scaling, an
untied LM head and a head_dim override; Gemma 3 (text only) with sliding and full attention
layers mixed, a RoPE base per layer type (linear scaling on the full ones), q/k norms,
`query_pre_attn_scalar`, `(1 + w)` norms, GELU-tanh, a scaled embedding and final logit
soft-capping; Qwen3's q/k RMSNorm with a head_dim independent of hidden / heads, and Qwen3 with
YaRN RoPE scaling (`qwen3_yarn`).

    python scripts/make_tiny_fixtures.py [NAME...] [--out DIR]   (no NAME: all of them)
"""
import argparse
import json
import pathlib
import subprocess
import sys

import torch
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                          MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/kiln-testkit/fixtures/tiny"
SEQ = 40
# Greedy steps after the prompt, for the fixtures that store a continuation.
STEPS = 16

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
    # Qwen3 with YaRN: 4x an original context of 32 (the prompt is 40), attention factor
    # 0.1·ln 4 + 1 on cos and sin.
    "qwen3_yarn": Qwen3Config(**{**COMMON, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
                              head_dim=32, attention_bias=False, use_sliding_window=False,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                               "factor": 4.0,
                                               "original_max_position_embeddings": 32}),
    # 8 experts of 32, top-3 renormalised (Qwen3-30B-A3B's norm_topk_prob), q/k norms.
    "qwen3moe": Qwen3MoeConfig(**{**COMMON, "rms_norm_eps": 1e-6}, head_dim=32,
                               moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                               rope_theta=1000000.0, attention_bias=False,
                               use_sliding_window=False),
    # Top-k weights as the softmax over all experts gave them, and layer 0 a dense MLP.
    "qwen3moe_dense": Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3, "rms_norm_eps": 1e-6},
                                     head_dim=32, moe_intermediate_size=32, num_experts=6,
                                     num_experts_per_tok=2, norm_topk_prob=False,
                                     decoder_sparse_step=1, mlp_only_layers=[0],
                                     rope_theta=1000000.0, attention_bias=False,
                                     use_sliding_window=False),
    # 8 experts of 32 (intermediate_size is the expert's), top-2.
    "mixtral": MixtralConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=8,
                             num_experts_per_tok=2, rope_theta=1000000.0, sliding_window=None),
    # GPT-OSS: 8 experts of 32 with biases, top-3 then softmax with the router's bias, the
    # clamped SwiGLU, attention sinks, q/k/v/o biases, sliding (window 8 over the 40-token
    # prompt) and full layers alternating, YaRN 4x an original 32 untruncated as released.
    "gpt_oss": GptOssConfig(**{**COMMON, "intermediate_size": 32, "num_hidden_layers": 4},
                            head_dim=32, num_local_experts=8, num_experts_per_tok=3,
                            sliding_window=8, attention_bias=True,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                             "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False,
                                             "original_max_position_embeddings": 32}),
}

# Fixtures that also get a copy with MXFP4 experts in OpenAI's layout (`<name>_mxfp4`).
OPENAI_MXFP4 = {"gpt_oss"}
# Fixtures that store a greedy continuation; those converted to GGUF as well.
GREEDY = {"qwen3moe", "qwen3moe_dense", "mixtral", "gpt_oss"}
GGUF = {"qwen3moe", "mixtral", "gpt_oss"}
GGUF_TYPES = ["f32", "q8_0"]

# Gemma's RMSNorm scales by (1 + w): its norm weights are drawn around 0, not 1; its embedding
# is drawn wider (it is the tied LM head too) so that the logits before the cap of 10 reach
# about 12: tanh bends them measurably without saturating.
ZERO_CENTRED_NORMS = {"gemma3"}
EMBED_STD = {"gemma3": 0.25}


def greedy(model, ids):
    """STEPS greedy tokens after `ids`, each with its top-1/top-2 logit margin."""
    seq = ids[0].tolist()
    tokens, margins = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            last = model(torch.tensor([seq])).logits[0, -1]
            top = torch.topk(last, 2)
            tokens.append(int(top.indices[0]))
            margins.append(round(float(top.values[0] - top.values[1]), 6))
            seq.append(tokens[-1])
    return {"tokens": tokens, "margins": margins}


def byte_tokenizer(d):
    """A byte-level BPE tokenizer of 256 tokens (the fixtures' vocabulary), saved as
    `tokenizer.json`: the converter reads a folder's vocabulary from it, and llama.cpp wants
    merges, so two of the byte tokens give way to two merges (the fixtures are fed ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:-2]
    merges = [("\u0120", "t"), ("h", "e")]
    vocab = {c: i for i, c in enumerate(alphabet + ["".join(m) for m in merges])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)


# The converter names a BPE vocabulary's pre-tokenizer by hashing how it splits a test text,
# and knows only published tokenizers' hashes; the byte tokenizer above is none of them. Its
# pre-tokenizer is GPT-2's byte-level one, which is what the converter is told here. Nothing
# else of the conversion (metadata, tensor names, layouts, quantization) is touched.
CONVERT = """
import runpy, sys
sys.path.insert(0, sys.argv.pop(1))
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(converter, d, name):
    """The folder as GGUF files of each type in GGUF_TYPES, by llama.cpp's converter."""
    for t in GGUF_TYPES:
        out = d / f"model-{t}.gguf"
        subprocess.run([sys.executable, "-c", CONVERT, str(converter.parent), str(converter),
                        str(d), "--outfile", str(out), "--outtype", t],
                       check=True, stdout=subprocess.DEVNULL)
        print(f"{name}: {out.name} ({out.stat().st_size} bytes)")


def llama_cpp_mxfp4(d):
    """`model-mxfp4.gguf`: the F32 file quantized by llama.cpp's own quantizer as its
    `MXFP4_MOE` type does it (experts MXFP4, the other matrices Q8_0)."""
    import ctypes
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    src, out = d / "model-f32.gguf", d / "model-mxfp4.gguf"
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama.cpp's quantizer failed on {src} ({rc})")
    print(f"{out.name} ({out.stat().st_size} bytes) by llama.cpp's quantizer")


def openai_mxfp4(d, ids):
    """`<d>_mxfp4`: the folder with its experts in MXFP4 as OpenAI released GPT-OSS
    (`*_blocks [experts, out, in/32, 16]`: element 2j in the low nibble of byte j, 2j + 1 in
    the high; `*_scales [experts, out, in/32]`: e8m0), quantized by gguf-py's MXFP4 encoder
    and laid out again; its reference is transformers' own dequantization of that layout
    (`Mxfp4Config(dequantize=True)`), in float32."""
    import numpy as np
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file
    from transformers import Mxfp4Config
    out = d.with_name(d.name + "_mxfp4")
    out.mkdir(exist_ok=True)
    tensors = {}
    for k, v in load_file(d / "model.safetensors").items():
        if not k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[k] = v
            continue
        w = v.transpose(1, 2).contiguous().numpy()  # transformers' [in, out] to [out, in]
        e, o, i = w.shape
        q = quantize(w.reshape(e * o, i), gguf.GGMLQuantizationType.MXFP4)
        q = q.reshape(e, o, i // 32, 17)
        # ggml's block: the scale, then elements j and j + 16 in byte j's low and high nibbles.
        values = np.concatenate([q[..., 1:] & 0x0F, q[..., 1:] >> 4], axis=-1)
        tensors[k + "_blocks"] = torch.from_numpy((values[..., 0::2] | (values[..., 1::2] << 4))
                                                  .astype(np.uint8))
        tensors[k + "_scales"] = torch.from_numpy(np.ascontiguousarray(q[..., 0]))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    model = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits[0]
    reference = {
        "input_ids": ids[0].tolist(),
        "logits": [[round(float(x), 6) for x in row] for row in logits],
        "greedy": greedy(model, ids),
    }
    (out / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    print(f"{out.name}: MXFP4 experts as released; greedy {reference['greedy']['tokens']}")


def llama_cpp_greedy(d, ids):
    """Each GGUF's greedy continuation under llama.cpp (llama-cpp-python), with margins."""
    import numpy as np
    from llama_cpp import Llama
    for t in GGUF_TYPES + ["mxfp4"]:
        path = d / f"model-{t}.gguf"
        llm = Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
        seq = list(ids)
        tokens, margins = [], []
        for _ in range(STEPS):
            llm.reset()
            llm.eval(seq)
            last = np.array(llm.scores[len(seq) - 1], dtype=np.float64)
            order = np.argsort(-last, kind="stable")
            tokens.append(int(order[0]))
            margins.append(round(float(last[order[0]] - last[order[1]]), 6))
            seq.append(tokens[-1])
        (d / f"reference-{t}.json").write_text(json.dumps(
            {"input_ids": list(ids), "greedy": {"tokens": tokens, "margins": margins}},
            separators=(",", ":")) + "\n")
        print(f"{path.name} under llama.cpp: {tokens}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", help=f"fixtures to write, of {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help=f"output folder (default {OUT})")
    ap.add_argument("--converter", type=pathlib.Path,
                    help="llama.cpp's convert_hf_to_gguf.py: also write the GGUF files")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also store each GGUF's greedy continuation under llama-cpp-python")
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
                if n.endswith("self_attn.sinks"):
                    # Sinks near the scores' scale take a real share of each softmax.
                    p.normal_(0.5, 1.0)
        model.eval()
        ids = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = model(ids).logits[0]
        d = args.out / name
        d.mkdir(parents=True, exist_ok=True)
        if name in GREEDY:
            # transformers 5 holds experts fused (`experts.gate_up_proj`); save_pretrained
            # writes them as published checkpoints have them, one tensor per expert.
            model.save_pretrained(d)
            # Its sampling defaults, which no test reads.
            (d / "generation_config.json").unlink(missing_ok=True)
        else:
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            if cfg.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file(state, d / "model.safetensors", metadata={"format": "pt"})
            cfg.save_pretrained(d)
        reference = {
            "input_ids": ids[0].tolist(),
            "logits": [[round(float(x), 6) for x in row] for row in logits],
        }
        if name in GREEDY:
            reference["greedy"] = greedy(model, ids)
        (d / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")
        if name in OPENAI_MXFP4:
            openai_mxfp4(d, ids)
        if name in GGUF and args.converter:
            byte_tokenizer(d)
            convert(args.converter, d, name)
            if args.llama_cpp:
                llama_cpp_mxfp4(d)
                llama_cpp_greedy(d, ids[0].tolist())
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params -> {d}; logits std "
              f"{float(logits.std()):.3f}, max |logit| {float(logits.abs().max()):.3f}")


if __name__ == "__main__":
    main()
