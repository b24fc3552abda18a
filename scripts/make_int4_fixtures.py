#!/usr/bin/env python3
"""INT4/INT8 Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) for
kiln-model's `tests/int4.rs`, quantized and packed by the libraries' own code (run by hand,
never by CI):

- GPTQ: GPTQModel (`GPTQModel.load(..., QuantizeConfig(...)).quantize(...).save(...)`: real
  GPTQ on random calibration tokens, on the CPU; its on-disk `gptq` format, zeros stored minus
  one). Dequantized with GPTQModel's `TorchLinear.dequantize_weight` after its own v1 -> v2
  zero conversion.
- AWQ: AutoAWQ's `pseudo_quantize_tensor` (round to nearest with a zero point: AutoAWQ's
  search needs calibration on a GPU) and `WQLinear_GEMM.from_linear` (its GEMM packing);
  `config.json` gets AutoAWQ's own `to_transformers_dict()`. Dequantized with AutoAWQ's
  `dequantize_gemm`.
- compressed-tensors: its `apply_quantization_config`, `calculate_qparams` (min/max
  observers: round to nearest, as llm-compressor's QuantizationModifier without data) and
  `ModelCompressor(...).compress_model` / `update_config` (`pack-quantized`); the act-order
  case (`actorder: group`, a stored `weight_g_idx`, which compressed-tensors 0.13 dropped)
  packs each weight with 0.12.2's `PackedQuantizationCompressor.compress_weight` and a
  shuffled `g_idx`, a different order per weight. Dequantized with the compressor's own
  `decompress` (`decompress_weight` in 0.12).

Every dequantization runs with float32 scales, so the values are the exact products
(q - z) * scale that kiln's blocks hold (an f16 product would round them).

Each case folder under crates/kiln-model/tests/fixtures/int4/<case>/ holds the checkpoint
(`config.json` with the library's `quantization_config`, `model.safetensors`, a byte-level
`tokenizer.json`), `dequant.safetensors` (layer 0's seven projections as the library
dequantizes them, float32, `[out, in]`) and `reference.json`: for each prompt its ids, the
logits at every position and 12 greedy tokens, from `transformers` float32 on the checkpoint's
dequantized weights (transformers cannot run these formats on the CPU itself).

    python scripts/make_int4_fixtures.py [CASE...]            (no CASE: all of them)
    python scripts/make_int4_fixtures.py --smollm2 [CASE...]  SmolLM2 versions into models/

`--smollm2` reads the float32 folder `cargo xtask fetch-model --hf` writes
(models/SmolLM2-135M-Instruct-hf) and writes models/SmolLM2-135M-Instruct-<case>/ (not
committed), calibrated on `--calib FILE` (plain text; default: a few built-in paragraphs).

Needs: torch transformers safetensors compressed-tensors gptqmodel, and autoawq installed with
`--no-deps` (its GEMM packer and dequantizer are plain torch). Tested with torch 2.15,
transformers 5.24, compressed-tensors 0.20.1 (0.12.2 for the act-order case), gptqmodel 7.7.0,
autoawq 0.2.9. GPTQModel on a
2-core machine wants GPTQMODEL_CPU_WORKERS=2.
"""
import argparse
import json
import os
import pathlib
import shutil
import tempfile
import types

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/kiln-model/tests/fixtures/int4"
MODELS = ROOT / "models"
SMOL_HF = MODELS / "SmolLM2-135M-Instruct-hf"
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
PROMPTS = [[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84],
           [1, 200, 17, 99, 3, 250, 64]]
GREEDY = 12

# case -> (method, options); tiny-model group sizes are 32 (kiln's block) so a 64-wide layer
# has two groups; SmolLM2 gets 64, which divides its widths (576, 1536) as AWQ and the
# min/max grouping here need (128 does not divide 576).


def gptq_opts(bits, group_size, sym, desc_act=False):
    # act_group_aware (GPTQModel's default group-aware reordering) would need a group size
    # and makes g_idx trivial anyway; desc_act is the act-order kiln gathers inputs for.
    return dict(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                act_group_aware=False)


CASES = {
    "gptq_w4_sym_g32": ("gptq", gptq_opts(4, 32, sym=True)),
    "gptq_w4_asym_g32": ("gptq", gptq_opts(4, 32, sym=False)),
    "gptq_w4_asym_rows": ("gptq", gptq_opts(4, -1, sym=False)),
    "gptq_w4_desc_act": ("gptq", gptq_opts(4, 32, sym=False, desc_act=True)),
    "gptq_w8_sym_g32": ("gptq", gptq_opts(8, 32, sym=True)),
    "gptq_w8_asym_g32": ("gptq", gptq_opts(8, 32, sym=False)),
    "awq_w4_g32": ("awq", dict(group_size=32)),
    "ct_w4a16_sym_g32": ("ct", dict(bits=4, group_size=32, symmetric=True)),
    "ct_w4a16_asym_g32": ("ct", dict(bits=4, group_size=32, symmetric=False)),
    "ct_w8a16_asym_channel": ("ct", dict(bits=8, group_size=None, symmetric=False)),
    "ct_w4a16_actorder": ("ct_actorder", dict(bits=4, group_size=32, symmetric=True)),
}
SMOL_CASES = {
    "gptq-w4g64": ("gptq", gptq_opts(4, 64, sym=True)),
    "gptq-w4g64-desc-act": ("gptq", gptq_opts(4, 64, sym=False, desc_act=True)),
    "gptq-w8g64": ("gptq", gptq_opts(8, 64, sym=True)),
    "awq-w4g64": ("awq", dict(group_size=64)),
    "ct-w4a16-g64": ("ct", dict(bits=4, group_size=64, symmetric=True)),
    "ct-w4a16-asym-g64": ("ct", dict(bits=4, group_size=64, symmetric=False)),
}

CALIB_TEXT = """The history of the river valley begins with the farmers who settled its banks, cleared
the forests and built the first stone bridges. Over the centuries the villages grew into market
towns, and the towns into a city whose harbour traded grain, wool and timber with the coast.
A recipe for bread needs flour, water, salt and yeast. Mix them, knead the dough for ten
minutes, let it rise until doubled, shape it, and bake it in a hot oven until the crust is brown.
In mathematics, a prime number has exactly two divisors: one and itself. The first primes are
two, three, five, seven, eleven and thirteen, and there are infinitely many of them.
The committee met on Tuesday to discuss the budget. After a long debate, the members agreed to
fund the new library, repair the school roof and plant trees along the main street.
def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a
Once upon a time, a curious fox found a lantern in the snow. It glowed softly, and wherever the
fox carried it, the frozen flowers opened for a moment and then closed again behind it."""


def byte_tokenizer(d):
    from tokenizers import Tokenizer, models
    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0x00>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<0x01>", eos_token="<0x02>",
                                   pad_token="<0x00>")
    fast.save_pretrained(d)


def save_state(model, state, out):
    """`model.safetensors`, without the LM head when it is the tied embedding."""
    sd = {k: v.contiguous() for k, v in state.items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})


def tiny_source(d):
    """A random float32 llama (dims multiples of 32) and a byte-level tokenizer, in `d`."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(d)
    byte_tokenizer(d)


def calibration(tokenizer_dir, text, n=16, length=64):
    if text is None:
        g = torch.Generator().manual_seed(1)
        return [torch.randint(3, 256, (length,), generator=g).tolist() for _ in range(n)]
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(text)["input_ids"]
    return [ids[i:i + length] for i in range(0, max(1, len(ids) - length), length // 2)][:n]


def gptq(src, out, opts, calib):
    from gptqmodel import GPTQModel, QuantizeConfig
    qc = QuantizeConfig(**opts)
    model = GPTQModel.load(str(src), qc, device="cpu")
    model.quantize([{"input_ids": c, "attention_mask": [1] * len(c)} for c in calib],
                   batch_size=1)
    model.save(str(out))
    (out / "quant_log.csv").unlink(missing_ok=True)


def gptq_dequant(out, qc, prefix):
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module
    sd = load_file(out / "model.safetensors")
    rows, cols = sd[f"{prefix}.scales"].shape[1], sd[f"{prefix}.g_idx"].shape[0]
    m = TorchLinear(bits=qc["bits"], group_size=qc["group_size"], sym=qc["sym"],
                    desc_act=qc["desc_act"], in_features=cols, out_features=rows, bias=False,
                    pack_dtype=torch.int32)
    for k in ["qweight", "qzeros", "scales", "g_idx"]:
        getattr(m, k).data = sd[f"{prefix}.{k}"].clone()
    if qc.get("format", qc.get("checkpoint_format", "gptq")) == "gptq":
        convert_gptq_v1_to_v2_format_module(m, bits=qc["bits"], pack_dtype=torch.int32)
    m.scales.data = m.scales.data.float()
    return m.dequantize_weight().T.contiguous()


def awq(src, out, opts, calib):
    from awq.models._config import AwqConfig
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    gs = opts["group_size"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)
    # AwqQuantizer's round-to-nearest with zero points, through its own method.
    q = types.SimpleNamespace(group_size=gs, zero_point=True, w_bit=4)
    for layer in model.model.layers:
        for name in PROJ:
            parent, attr = name.split(".")
            lin = getattr(getattr(layer, parent), attr)
            lin.weight.data, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(q, lin.weight.data)
            setattr(getattr(layer, parent), attr, WQLinear_GEMM.from_linear(
                lin, 4, gs, init_only=False, scales=scales.t().contiguous(),
                zeros=zeros.t().contiguous()))
    save_state(model, model.state_dict(), out)
    cfg = json.loads((pathlib.Path(src) / "config.json").read_text())
    cfg["dtype"] = "float16"
    qcfg = AwqConfig(zero_point=True, q_group_size=gs, w_bit=4, version="GEMM")
    cfg["quantization_config"] = qcfg.to_transformers_dict()
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        if (pathlib.Path(src) / f).is_file():
            shutil.copy(pathlib.Path(src) / f, out / f)


def awq_dequant(out, qc, prefix):
    from awq.utils.packing_utils import dequantize_gemm
    sd = load_file(out / "model.safetensors")
    gs = qc["group_size"]
    w = dequantize_gemm(sd[f"{prefix}.qweight"], sd[f"{prefix}.qzeros"],
                        sd[f"{prefix}.scales"].float(), 4, gs)
    return w.T.contiguous()


def ct_args(opts, actorder=None):
    from compressed_tensors.quantization import QuantizationArgs
    return QuantizationArgs(num_bits=opts["bits"], type="int", symmetric=opts["symmetric"],
                            strategy="group" if opts["group_size"] else "channel",
                            group_size=opts["group_size"], actorder=actorder)


def ct_qparams(w, args, g_idx=None):
    """Min/max per (row, group) -> compressed-tensors' own scale and zero point."""
    from compressed_tensors.quantization.utils import calculate_qparams
    rows, cols = w.shape
    gs = args.group_size or cols
    if g_idx is None:
        g = w.reshape(rows, cols // gs, gs)
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        groups = int(g_idx.max()) + 1
        lo = torch.stack([w[:, g_idx == i].amin(-1) for i in range(groups)], 1)
        hi = torch.stack([w[:, g_idx == i].amax(-1) for i in range(groups)], 1)
    return calculate_qparams(lo, hi, args)


def ct(src, out, opts, calib):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)
    args = ct_args(opts)
    qcfg = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"])
    apply_quantization_config(model, qcfg)
    with torch.no_grad():
        for _, mod in model.named_modules():
            if hasattr(mod, "weight_scale"):
                s, z = ct_qparams(mod.weight.data, args)
                mod.weight_scale.data.copy_(s.reshape(mod.weight_scale.shape))
                mod.weight_zero_point.data.copy_(z.reshape(mod.weight_zero_point.shape))
    comp = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    comp.compress_model(model)
    save_state(model, model.state_dict(), out)
    shutil.copy(pathlib.Path(src) / "config.json", out / "config.json")
    comp.update_config(str(out))
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        if (pathlib.Path(src) / f).is_file():
            shutil.copy(pathlib.Path(src) / f, out / f)


def ct_actorder(src, out, opts, calib):
    """Legacy `actorder: group` checkpoints (a stored `weight_g_idx`): each weight packed by the
    compressor with its own shuffled group assignment."""
    import compressed_tensors
    try:
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
            PackedQuantizationCompressor)
    except ImportError:
        raise SystemExit(
            "ct_w4a16_actorder needs compressed-tensors <= 0.12 (later versions dropped g_idx):\n"
            "  pip install --no-deps --target /tmp/ct_old compressed-tensors==0.12.2\n"
            "  PYTHONPATH=/tmp/ct_old python scripts/make_int4_fixtures.py ct_w4a16_actorder")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)
    args = ct_args(opts, actorder="group")
    comp = PackedQuantizationCompressor()
    sd = {}
    gen = torch.Generator().manual_seed(5)
    for n, t in model.state_dict().items():
        prefix = n.removesuffix(".weight")
        if not any(prefix.endswith(p) for p in PROJ):
            sd[n] = t.contiguous()
            continue
        rows, cols = t.shape
        g_idx = (torch.arange(cols) // args.group_size)[torch.randperm(cols, generator=gen)]
        g_idx = g_idx.to(torch.int32)
        s, z = ct_qparams(t, args, g_idx)
        packed = comp.compress_weight(t, scale=s, quantization_args=args, zero_point=z,
                                      g_idx=g_idx)
        for k, v in packed.items():
            sd[f"{prefix}.{k}"] = v.contiguous()
        sd[f"{prefix}.weight_scale"] = s.contiguous()
        sd[f"{prefix}.weight_g_idx"] = g_idx.contiguous()
    save_state(model, sd, out)
    cfg = json.loads((pathlib.Path(src) / "config.json").read_text())
    cfg["quantization_config"] = {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(),
                                      "input_activations": None, "output_activations": None}},
        "format": "pack-quantized", "ignore": ["lm_head"], "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "version": compressed_tensors.__version__,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(pathlib.Path(src) / f, out / f)


def ct_dequant(out, qc, prefix):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    sd = load_file(out / "model.safetensors")
    group = next(iter(qc["config_groups"].values()))
    args = QuantizationArgs(**group["weights"])
    data = {k.removeprefix(prefix + "."): v for k, v in sd.items() if k.startswith(prefix + ".")}
    data["weight_scale"] = data["weight_scale"].float()
    try:  # compressed-tensors 0.13 and later
        from compressed_tensors.compressors.pack_quantized.base import (
            PackedQuantizationCompressor)
        scheme = QuantizationScheme(targets=group["targets"], weights=args)
        return PackedQuantizationCompressor.decompress(data, scheme)["weight"].float()
    except ImportError:
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
            PackedQuantizationCompressor)
        return PackedQuantizationCompressor().decompress_weight(data, args).float()


WRITERS = {"gptq": (gptq, gptq_dequant), "awq": (awq, awq_dequant), "ct": (ct, ct_dequant),
           "ct_actorder": (ct_actorder, ct_dequant)}


def dequantized_model(out, dequant):
    """transformers float32 on the checkpoint: float tensors upcast, projections dequantized."""
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = load_file(out / "model.safetensors")
    state = {}
    for n in model.state_dict():
        prefix = n.removesuffix(".weight")
        if n in sd:
            state[n] = sd[n].float()
        elif any(prefix.endswith(p) for p in PROJ):
            state[n] = dequant(out, qc, prefix)
        elif n == "lm_head.weight" and config.tie_word_embeddings:
            state[n] = sd["model.embed_tokens.weight"].float()
    model.load_state_dict(state, strict=True)
    return model.eval(), qc


def reference(model):
    cases = []
    with torch.no_grad():
        for ids in PROMPTS:
            logits = model(torch.tensor([ids])).logits[0]
            seq = list(ids)
            for _ in range(GREEDY):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            cases.append({"input_ids": ids, "greedy": seq[len(ids):],
                          "logits": [[round(float(x), 6) for x in r] for r in logits]})
    return cases


def write_case(name, method, opts, src, out, calib, fixture=True):
    write, dequant = WRITERS[method]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write(src, out, opts, calib)
    if fixture:
        model, qc = dequantized_model(out, dequant)
        deq = {f"model.layers.0.{p}.weight": dequant(out, qc, f"model.layers.0.{p}")
               for p in PROJ}
        save_file(deq, out / "dequant.safetensors")
        (out / "reference.json").write_text(json.dumps({"prompts": reference(model)},
                                                       separators=(",", ":")) + "\n")
        (out / "generation_config.json").unlink(missing_ok=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: {method} {opts} -> {out} ({size} bytes)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--smollm2", action="store_true",
                    help=f"quantize {SMOL_HF} into {MODELS}/SmolLM2-135M-Instruct-<case>")
    ap.add_argument("--calib", type=pathlib.Path, help="calibration text for --smollm2")
    ap.add_argument("--out", type=pathlib.Path, help=f"output folder (default {OUT} or {MODELS})")
    args = ap.parse_args()
    table = SMOL_CASES if args.smollm2 else CASES
    for c in args.cases:
        if c not in table:
            ap.error(f"unknown case {c!r} (known: {', '.join(table)})")
    names = args.cases or list(table)
    if args.smollm2:
        if not (SMOL_HF / "config.json").is_file():
            ap.error(f"{SMOL_HF} is missing: run `cargo xtask fetch-model --hf` first")
        text = args.calib.read_text() if args.calib else CALIB_TEXT
        calib = calibration(SMOL_HF, text)
        for name in names:
            method, opts = table[name]
            out = (args.out or MODELS) / f"SmolLM2-135M-Instruct-{name}"
            write_case(name, method, opts, SMOL_HF, out, calib, fixture=False)
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp)
        tiny_source(src)
        calib = calibration(src, None)
        for name in names:
            method, opts = table[name]
            write_case(name, method, opts, src, (args.out or OUT) / name, calib)


if __name__ == "__main__":
    main()
