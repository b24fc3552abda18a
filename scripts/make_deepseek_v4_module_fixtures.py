#!/usr/bin/env python3
"""Goldens for kiln's DeepSeek-V4 parts, from transformers' own modules.

Writes into crates/kiln-model/tests/fixtures/deepseek_v4/, beside their config
(compressor_config.json):

compressor.safetensors: one random-weight DeepseekV4HCACompressor (ratio 8) and one
DeepseekV4CSACompressor (ratio 4, with its DeepseekV4Indexer, top-k 3 of up to 10 entries),
run over 41 tokens of random hidden states in chunks of 5, 3, 1, 1, 9, 2, 12, 8 tokens
(boundaries inside windows, a chunk that closes none, one that closes several) through
transformers' DeepseekV4CSACache / DeepseekV4HCACache, as generate() runs them. Saved:

- every weight (transformers' names), the hidden states `x` [41, hidden] and the query
  low-rank activations `qr` [41, q_lora_rank];
- `hca.entries` / `csa.entries` / `csa.index_keys`: every compressed entry, after the last
  chunk (entries never change once emitted);
- `csa.topk`: for every token, the indexer's picks ([41, 3], -1 where none is visible), as
  the call that ran it returned them; stored as float32 (small integers, exact).

hyper.safetensors: one random DeepseekV4HyperConnection (4 streams, 20 Sinkhorn iterations)
and one DeepseekV4HyperHead over random streams [7, 4, 64]: the weights (`hc.fn`, `hc.base`,
`hc.scale`, `head.hc_fn`, `head.hc_base`, `head.hc_scale`), the streams `x`, and what the
modules return (`hc.post`, `hc.comb`, `hc.collapsed`, `head.out`); and, for a random sublayer
output `y` [7, 64], the streams after it as DeepseekV4DecoderLayer mixes them (`hc.after`).

tiny/: a random DeepseekV4ForCausalLM (sliding, CSA and HCA layers, HCA pooling every 128
tokens; the first MoE layer hash-routed; 256 tokens) as save_pretrained writes it, and
model_golden.safetensors: its 173 `input_ids`, run through a DynamicCache in `chunks` (the
chunks above, then 100, 1, 1, 30: past HCA's first window); each layer's attention input and
output (`attn_in.L`, `attn_out.L`, as DeepseekV4Attention saw and returned them), each
layer's MoE input and output (`mlp_in.L`, `mlp_out.L`, DeepseekV4SparseMoeBlock's), the
logits of every token (`logits`); and greedy continuations through the cache: random prompts
of 5, 13 and 130 tokens (`gen.prompt.i`), their 24 new tokens (`gen.greedy.i`) and each
step's top-1/top-2 margin (`gen.margin.i`).

tiny-f32.gguf: the tiny model as DeepSeek publishes V4 (the hub's config names, DeepSeek's
tensor names, routed experts drawn on the MXFP4 grid and stored as FP4 codes with e8m0
scales, the linears DeepSeek ships in FP8 drawn on its grid, the float model holding the same
values; the byte-level tokenizer of
make_tiny_fixtures.py), converted by llama.cpp's convert_hf_to_gguf.py (`--outtype f32`; the
converter always writes the routed experts as MXFP4), and tiny-q8_0.gguf, the same with the
attention and shared-expert linears stored in FP8 with 128 x 128 block scales (the converter
writes them dequantised as Q8_0, whatever `--outtype`; the model's values are on that grid),
converted from tiny-fp8/, that folder as DeepSeek ships it (FP8 linears with ue8m0 `.scale`
tensors a 128 x 128 block, FP4 experts), which kiln loads packed;
and llama.cpp's own run of each (llama-cpp-python 0.3.36, CPU) into model_golden.safetensors:
`llama_cpp.logits` (F32 file) and `llama_cpp_q8_0.logits` of the 173 tokens in one batch,
`llama_cpp.greedy.i` and `llama_cpp_q8_0.greedy.i` of the three prompts.

Run by hand with transformers >= 5.17 (tested with 5.25.0), torch, gguf and llama-cpp-python
0.3.36; CI never runs it:
    python scripts/make_deepseek_v4_module_fixtures.py CONVERTER
where CONVERTER is llama.cpp's convert_hf_to_gguf.py (the llama-cpp-python 0.3.36 sdist's
vendor/llama.cpp has DeepSeek-V4's).
"""

import json
import pathlib
import sys

import torch
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/kiln-model/tests/fixtures/deepseek_v4"
# llama.cpp's convert_hf_to_gguf.py (the llama-cpp-python 0.3.36 sdist's): the first argument.
CONVERTER = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else None
CHUNKS = [5, 3, 1, 1, 9, 2, 12, 8]
TOKENS = sum(CHUNKS)

CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.5,
    "q_lora_rank": 24,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 6,
    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 3,
    "vocab_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}


class Layers:
    """What the modules read of a cache: `.layers[layer_idx]`."""

    def __init__(self, *layers):
        self.layers = list(layers)


def randomize(module, gen):
    for name, p in module.named_parameters():
        with torch.no_grad():
            if name.endswith("kv_norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("position_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def main():
    config = DeepseekV4Config(**CONFIG)
    gen = torch.Generator().manual_seed(48)
    hca = m.DeepseekV4HCACompressor(config).float()
    csa = m.DeepseekV4CSACompressor(config).float()
    randomize(hca, gen)
    randomize(csa, gen)
    x = torch.randn(TOKENS, config.hidden_size, generator=gen)
    qr = torch.randn(TOKENS, config.q_lora_rank, generator=gen)

    cache = Layers(m.DeepseekV4CSACache(config), m.DeepseekV4HCACache(config))
    picks = []
    csa.indexer.register_forward_hook(lambda _m, _i, out: picks.append(out[0]))
    start = 0
    with torch.no_grad():
        for n in CHUNKS:
            pos = torch.arange(start, start + n).unsqueeze(0)
            hs, q = x[start : start + n].unsqueeze(0), qr[start : start + n].unsqueeze(0)
            csa_kv, _ = csa(hs, q, pos, cache, 0)
            hca_kv, _ = hca(hs, q, pos, cache, 1)
            start += n
    topk = torch.full((TOKENS, config.index_topk), -1, dtype=torch.int32)
    row = 0
    for p in picks:
        topk[row : row + p.shape[0], : p.shape[1]] = p.to(torch.int32)
        row += p.shape[0]

    tensors = {f"hca.{k}": v.detach().contiguous() for k, v in hca.state_dict().items()}
    tensors.update({f"csa.{k}": v.detach().contiguous() for k, v in csa.state_dict().items()})
    tensors = {k: v for k, v in tensors.items() if "inv_freq" not in k}
    tensors.update(
        {
            "x": x,
            "qr": qr,
            "hca.entries": hca_kv[0, 0].contiguous(),
            "csa.entries": csa_kv[0, 0].contiguous(),
            "csa.index_keys": cache.layers[0].compressed_kv["indexer"][0].contiguous(),
            "csa.topk": topk.float(),
        }
    )
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(tensors, OUT / "compressor.safetensors")
    saved = dict(CONFIG, model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"])
    saved["chunks"] = CHUNKS
    (OUT / "compressor_config.json").write_text(json.dumps(saved, indent=2) + "\n")
    for k, v in sorted(tensors.items()):
        print(k, tuple(v.shape), v.dtype)
    hyper(config, gen)
    model(gen)


def hyper(config, gen):
    hc = m.DeepseekV4HyperConnection(config).float()
    head = m.DeepseekV4HyperHead(config).float()
    with torch.no_grad():
        for module in (hc, head):
            for name, p in module.named_parameters():
                if "scale" in name:
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen))
                elif "base" in name:
                    p.copy_(torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        x = torch.randn(1, 7, config.hc_mult, config.hidden_size, generator=gen)
        y = torch.randn(1, 7, config.hidden_size, generator=gen)
        post, comb, collapsed = hc(x)
        after = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
        out = head(x)
    tensors = {
        "hc.fn": hc.fn,
        "hc.base": hc.base,
        "hc.scale": hc.scale,
        "head.hc_fn": head.hc_fn,
        "head.hc_base": head.hc_base,
        "head.hc_scale": head.hc_scale,
        "x": x[0],
        "y": y[0],
        "hc.post": post[0],
        "hc.comb": comb[0],
        "hc.collapsed": collapsed[0],
        "hc.after": after[0],
        "head.out": out[0],
    }
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(tensors, OUT / "hyper.safetensors")
    for k, v in sorted(tensors.items()):
        print(k, tuple(v.shape), v.dtype)



# Greedy continuations: prompt lengths and new tokens (all within max_position_embeddings).
PROMPTS = [5, 13, 130]
NEW_TOKENS = 24
# The model's chunks: the compressors' ones, then past HCA's first window of 128.
MODEL_CHUNKS = CHUNKS + [100, 1, 1, 30]

MODEL = dict(
    CONFIG,
    num_hidden_layers=3,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    # HCA at DeepSeek's 128 (llama.cpp's converter takes only 0, 4 and 128).
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    max_position_embeddings=256,
    num_hash_layers=1,
    num_experts_per_tok=2,
    num_local_experts=4,
    swiglu_limit=1.5,
    routed_scaling_factor=1.5,
    # The byte-level tokenizer's 256 tokens (make_tiny_fixtures.byte_tokenizer), which
    # llama.cpp's converter needs beside the weights.
    vocab_size=256,
    # llama.cpp Hadamard-rotates the indexer's q and k: a multiple of 64.
    index_head_dim=64,
    # Whole Q8_0 blocks in every row of wq_b (the converter writes FP8 linears as Q8_0).
    q_lora_rank=32,
)


def mxfp4_grid(w):
    """`w` [.., cols] rounded onto the MXFP4 grid by gguf-py's encoder (its decoder back)."""
    import gguf
    from gguf.quants import dequantize, quantize

    a = w.detach().float().reshape(-1, w.shape[-1]).numpy()
    q = quantize(a, gguf.GGMLQuantizationType.MXFP4)
    return torch.from_numpy(dequantize(q, gguf.GGMLQuantizationType.MXFP4)).reshape(w.shape)


def fp8_linear(name):
    """Whether DeepSeek ships tensor `name` in FP8: named as its checkpoint names it, or as
    transformers' module names the parameter at run time (which differ from the saved
    names: `self_attn.q_a_proj` is saved as `attn.wq_a`)."""
    return name.endswith(("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
                          "attn.wo_b.weight", "indexer.wq_b.weight", "shared_experts.w1.weight",
                          "shared_experts.w2.weight", "shared_experts.w3.weight",
                          "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_proj.weight",
                          "self_attn.o_a_proj.weight", "self_attn.o_b_proj.weight", "indexer.q_b_proj.weight",
                          "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                          "shared_experts.down_proj.weight"))


def fp8_block(w):
    """`w` [rows, cols] in FP8 e4m3 with an e8m0 scale a 128 x 128 block, as DeepSeek stores
    its linears: (the codes, the scale bytes, the values they hold)."""
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(br, bc, dtype=torch.uint8)
    values = torch.empty(rows, cols)
    for i in range(br):
        for j in range(bc):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].detach().float()
            e = int(torch.ceil(torch.log2(blk.abs().max().clamp(min=1e-30) / 448.0)))
            q = (blk / 2.0**e).to(torch.float8_e4m3fn)
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = q
            scales[i, j] = e + 127
            values[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = q.float() * 2.0**e
    return codes, scales, values


def mxfp4_pack(w):
    """DeepSeek's FP4 storage of grid values `w` [rows, cols]: codes two a byte (element 2i
    in the low nibble) and one e8m0 byte a 32 inputs."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    rows, cols = w.shape
    q = quantize(w.float().numpy(), gguf.GGMLQuantizationType.MXFP4).reshape(rows, cols // 32, 17)
    # ggml's block: the scale byte, then elements j and j + 16 in byte j's low and high nibbles.
    codes = np.concatenate([q[..., 1:] & 0x0F, q[..., 1:] >> 4], axis=-1).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(packed), torch.from_numpy(np.ascontiguousarray(q[..., 0]))


def tiny_fixtures():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import make_tiny_fixtures

    return make_tiny_fixtures


def deepseek_folder(tiny, out, fp8):
    """`tiny` (as transformers saved it) as DeepSeek publishes V4 into the folder `out` (the
    hub's config names, DeepSeek's tensor names, routed experts in FP4 with e8m0 scales and,
    with `fp8`, the attention and shared-expert linears in FP8 with their block scales), with
    the byte-level tokenizer."""
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)

    saved = json.loads((tiny / "config.json").read_text())
    rates = saved["compress_rates"]
    ratio = {"sliding_attention": 0, **rates}
    hub = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": saved["vocab_size"],
        "hidden_size": saved["hidden_size"],
        "num_hidden_layers": saved["num_hidden_layers"],
        "num_attention_heads": saved["num_attention_heads"],
        "num_key_value_heads": 1,
        "head_dim": saved["head_dim"],
        "qk_rope_head_dim": saved["qk_rope_head_dim"],
        "q_lora_rank": saved["q_lora_rank"],
        "o_groups": saved["o_groups"],
        "o_lora_rank": saved["o_lora_rank"],
        "sliding_window": saved["sliding_window"],
        "compress_ratios": [ratio[t] for t in saved["layer_types"]],
        "rope_theta": saved["rope_parameters"]["main"]["rope_theta"],
        "compress_rope_theta": saved["compress_rope_theta"],
        "rope_scaling": {k: saved["rope_parameters"]["compress"][k] for k in
                         ("type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")},
        "index_n_heads": saved["index_n_heads"],
        "index_head_dim": saved["index_head_dim"],
        "index_topk": saved["index_topk"],
        "hc_mult": saved["hc_mult"],
        "hc_sinkhorn_iters": saved["hc_sinkhorn_iters"],
        "hc_eps": saved["hc_eps"],
        "n_routed_experts": saved["n_routed_experts"],
        "num_experts_per_tok": saved["num_experts_per_tok"],
        "n_shared_experts": 1,
        "moe_intermediate_size": saved["moe_intermediate_size"],
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": saved["routed_scaling_factor"],
        "num_hash_layers": 1,
        "swiglu_limit": saved["swiglu_limit"],
        "rms_norm_eps": saved["rms_norm_eps"],
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "max_position_embeddings": saved["max_position_embeddings"],
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (out / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    tensors = {}
    for k, v in load_file(tiny / "model.safetensors").items():
        name = k.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        name = name.replace("hc_head.hc_", "hc_head_").replace(".attn.norm.weight", ".attn.kv_norm.weight")
        if ".ffn.experts." in name:
            packed, scale = mxfp4_pack(v)
            tensors[name] = packed
            tensors[name.removesuffix(".weight") + ".scale"] = scale
        elif fp8 and fp8_linear(name):
            codes, scale, _ = fp8_block(v)
            tensors[name] = codes
            tensors[name.removesuffix(".weight") + ".scale"] = scale
        else:
            tensors[name] = v.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    tiny_fixtures().byte_tokenizer(out)


def convert(folder, gguf, converter):
    """llama.cpp's converter on a DeepSeek-format `folder` into `gguf` (`--outtype f32`; it
    writes dequantised FP8 linears as Q8_0)."""
    import subprocess

    subprocess.run([sys.executable, "-c", tiny_fixtures().CONVERT, str(converter.parent), str(converter),
                    str(folder), "--outtype", "f32", "--outfile", str(gguf), "--model-name", "tiny-deepseek-v4"],
                   check=True)
    print("wrote", gguf)


def llama_cpp_run(gguf, ids, tensors, key):
    """llama.cpp (llama-cpp-python, CPU) on the converter's GGUF: the logits of all the tokens
    in one batch (`<key>.logits`) and its greedy continuations of the same prompts
    (`<key>.greedy.i`), for the distance kiln is compared with on the same file."""
    import llama_cpp
    import numpy as np

    m = llama_cpp.Llama(str(gguf), n_ctx=256, logits_all=True, verbose=False)
    m.eval(ids.tolist())
    out = {f"{key}.logits": torch.from_numpy(np.array(m.scores[: len(ids)], dtype=np.float32))}
    for i in range(len(PROMPTS)):
        m.reset()
        m.eval(tensors[f"gen.prompt.{i}"].long().tolist())
        greedy = []
        for _ in range(NEW_TOKENS):
            t = int(np.argmax(m.scores[m.n_tokens - 1]))
            greedy.append(t)
            m.eval([t])
        out[f"{key}.greedy.{i}"] = torch.tensor(greedy, dtype=torch.float32)
    return out


def model(gen):
    config = DeepseekV4Config(**MODEL)
    torch.manual_seed(48)
    lm = DeepseekV4ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("position_bias", "sinks", "base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        # Routed experts on the MXFP4 grid (FP4 e2m1 codes, an e8m0 scale a 32 inputs), the
        # attention and shared-expert linears on FP8 e4m3's (an e8m0 scale a 128 x 128 block),
        # as DeepSeek ships them: the float model and the packed copies hold the same values.
        for name, p in lm.named_parameters():
            if ".experts." in name and "shared" not in name:
                p.copy_(mxfp4_grid(p))
            elif fp8_linear(name):
                p.copy_(fp8_block(p)[2])
        # Every linear DeepSeek ships in FP8 is on the grid: nine a layer (the indexer's in
        # CSA layers) besides the routed experts.
        on_grid = [n for n, _ in lm.named_parameters() if fp8_linear(n)]
        assert len(on_grid) == 8 * config.num_hidden_layers + sum(
            t == "compressed_sparse_attention" for t in config.layer_types), on_grid
        for name, b in lm.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(config.num_local_experts, generator=gen)[: config.num_experts_per_tok] for _ in range(config.vocab_size)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    ids = torch.randint(0, config.vocab_size, (sum(MODEL_CHUNKS),), generator=gen)
    seen = {}

    def hook(layer):
        def record(_m, args, kwargs, out):
            seen.setdefault(f"attn_in.{layer}", []).append(args[0][0])
            seen.setdefault(f"attn_out.{layer}", []).append(out[0][0])

        return record

    def mlp_hook(layer):
        def record(_m, args, kwargs, out):
            seen.setdefault(f"mlp_in.{layer}", []).append(args[0][0])
            seen.setdefault(f"mlp_out.{layer}", []).append(out[0])

        return record

    for i, layer in enumerate(lm.model.layers):
        layer.self_attn.register_forward_hook(hook(i), with_kwargs=True)
        layer.mlp.register_forward_hook(mlp_hook(i), with_kwargs=True)
    cache = DynamicCache(config=config)
    logits = []
    start = 0
    with torch.no_grad():
        for n in MODEL_CHUNKS:
            out = lm(input_ids=ids[start : start + n].unsqueeze(0), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0])
            start += n
    tensors = {k: torch.cat(v).contiguous() for k, v in seen.items()}
    tensors["logits"] = torch.cat(logits).contiguous()
    tensors["input_ids"] = ids.float()
    tensors["chunks"] = torch.tensor(MODEL_CHUNKS, dtype=torch.float32)
    # Greedy continuations: the prompt, then one token at a time through the cache, each the
    # argmax of the logits before it (EOS included: generate()'s min_new_tokens would mask it).
    for i, n in enumerate(PROMPTS):
        prompt = torch.randint(0, config.vocab_size, (n,), generator=gen)
        cache = DynamicCache(config=config)
        greedy, step, margins = [], prompt, []
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits = lm(input_ids=step.unsqueeze(0), past_key_values=cache, use_cache=True).logits[0, -1]
                top = logits.topk(2)
                margins.append(float(top.values[0] - top.values[1]))
                greedy.append(int(top.indices[0]))
                step = top.indices[:1]
        tensors[f"gen.prompt.{i}"] = prompt.float()
        tensors[f"gen.greedy.{i}"] = torch.tensor(greedy, dtype=torch.float32)
        tensors[f"gen.margin.{i}"] = torch.tensor(margins, dtype=torch.float32)
    tiny = OUT / "tiny"
    lm.save_pretrained(tiny)
    (tiny / "generation_config.json").unlink(missing_ok=True)
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        deepseek_folder(tiny, pathlib.Path(scratch), fp8=False)
        convert(scratch, OUT / "tiny-f32.gguf", CONVERTER)
    deepseek_folder(tiny, OUT / "tiny-fp8", fp8=True)
    convert(OUT / "tiny-fp8", OUT / "tiny-q8_0.gguf", CONVERTER)
    tensors.update(llama_cpp_run(OUT / "tiny-f32.gguf", ids, tensors, "llama_cpp"))
    tensors.update(llama_cpp_run(OUT / "tiny-q8_0.gguf", ids, tensors, "llama_cpp_q8_0"))
    save_file(tensors, OUT / "model_golden.safetensors")
    for k, v in sorted(tensors.items()):
        print(k, tuple(v.shape), v.dtype)


if __name__ == "__main__":
    main()
