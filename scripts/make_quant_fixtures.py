#!/usr/bin/env python3
"""Write the GGUF block-format fixtures of kiln-tensor's `quant_fixtures` test.

Run by hand (CI never runs Python), from the repository root:

    python scripts/make_quant_fixtures.py [models/gemma-3-270m-q4_k_m.gguf]

with the `gguf` and `numpy` packages installed. For each format it writes, under
crates/kiln-tensor/tests/fixtures/quant/:

- `<TYPE>.blocks`: raw GGUF block bytes;
- `<TYPE>.f32`: what `gguf.quants.dequantize` makes of them, little-endian f32;

and `manifest.json` saying where each format's blocks came from. kiln's CPU dequantization
must reproduce the f32 values bit for bit.

Blocks of Q4_K, Q6_K, Q5_0 and Q8_0 are taken from the real Gemma 3 270M Q4_K_M file (a few
from the start and the middle of several tensors). No local file has Q2_K, Q3_K, Q5_K, Q5_1 or
BF16, so their blocks are RANDOM BYTES (fixed seed) whose f16 scales are overwritten with
finite values (and BF16 values are kept finite), which exercises every quant bit pattern but
not a real quantizer's output. MXFP4's blocks are half gguf's own quantizer's output (random
normal values at several magnitudes) and half random bytes whose E8M0 exponents run over
0..=250 (subnormal halves included; larger ones would overflow f32 at the biggest quants).

FP8 is kiln's own block (an f32 scale, 32 E4M3 codes: DeepSeek's and transformers' FP8
checkpoints, repacked); no GGUF tool knows it, so its values come from torch's own
`float8_e4m3fn` (every code but NaN's, subnormals included, under random f32 scales and powers
of two as DeepSeek's ue8m0 scales are), which needs `torch` too.
"""

import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

OUT = Path("crates/kiln-tensor/tests/fixtures/quant")
FROM_FILE = [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0]
RANDOM = [T.Q2_K, T.Q3_K, T.Q5_K, T.Q5_1, T.BF16]
# Blocks a format: fewer of the big super-blocks.
N_SMALL, N_SUPER = 48, 16
# Byte offsets of the f16 scales in each random format's block.
F16_FIELDS = {
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q5_K: [0, 2],
    T.Q5_1: [0, 2],
}


def n_blocks(t):
    return N_SUPER if GGML_QUANT_SIZES[t][0] == 256 else N_SMALL


def from_file(path):
    reader = GGUFReader(path)
    picked = {}
    for t in FROM_FILE:
        tensors = [x for x in reader.tensors if x.tensor_type == t]
        if not tensors:
            sys.exit(f"{path} has no {t.name} tensor")
        _, block_bytes = GGML_QUANT_SIZES[t]
        want = n_blocks(t)
        # Half the blocks from the first tensors' starts, half from their middles.
        chunks, names = [], []
        per = max(1, want // (2 * min(4, len(tensors))))
        for x in tensors[:4]:
            raw = np.asarray(x.data).view(np.uint8).reshape(-1)
            nb = raw.size // block_bytes
            for start in (0, nb // 2):
                chunks.append(raw[start * block_bytes:(start + per) * block_bytes])
            names.append(x.name)
        raw = np.concatenate(chunks)[: want * block_bytes]
        picked[t] = (raw, f"{Path(path).name}: tensors {', '.join(names)} (starts and middles)")
    return picked


def random_blocks(rng):
    picked = {}
    for t in RANDOM:
        want = n_blocks(t)
        if t == T.BF16:
            vals = rng.standard_normal(want * 32).astype(np.float32) * 3.0
            bits = (vals.view(np.uint32) >> 16).astype(np.uint16)
            # Random mantissa bits, finite values only.
            bits ^= rng.integers(0, 128, size=bits.size, dtype=np.uint16)
            picked[t] = (bits.view(np.uint8), "random finite bf16 values (seed 18)")
            continue
        _, block_bytes = GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(want, block_bytes), dtype=np.uint8)
        for at in F16_FIELDS[t]:
            scale = (rng.standard_normal(want) * 0.02).astype(np.float16)
            raw[:, at:at + 2] = scale.view(np.uint8).reshape(want, 2)
        picked[t] = (raw.reshape(-1), "random bytes with finite f16 scales (seed 18)")
    return picked


def mxfp4_blocks(rng):
    """Half gguf's quantizer on random values, half random bytes with exponents 0..=250."""
    from gguf.quants import quantize
    half = N_SMALL // 2
    vals = rng.standard_normal((half, 32)).astype(np.float32)
    vals *= np.float32(2.0) ** rng.integers(-12, 8, size=(half, 1)).astype(np.float32)
    quantized = np.asarray(quantize(vals, T.MXFP4), dtype=np.uint8).reshape(half, 17)
    raw = rng.integers(0, 256, size=(half, 17), dtype=np.uint8)
    raw[:, 0] = np.linspace(0, 250, half).astype(np.uint8)
    blocks = np.concatenate([quantized, raw]).reshape(-1)
    return {T.MXFP4: (blocks, "gguf's quantizer on random normal values x 2^-12..2^7, and "
                      "random bytes with exponents 0..=250 (seed 18)")}


def fp8_blocks():
    """kiln's FP8 blocks and torch's values of them: (blocks, values, source)."""
    import torch

    rng = np.random.default_rng(8)
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    codes = np.concatenate([codes, rng.choice(codes, size=N_SMALL * 32 - codes.size)])
    codes = codes.reshape(N_SMALL, 32)
    scales = (rng.standard_normal(N_SMALL) * 0.01).astype(np.float32)
    scales[::2] = np.float32(2.0) ** rng.integers(-20, 4, size=scales[::2].size).astype(np.float32)
    decoded = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float()
    values = (decoded * torch.from_numpy(scales)[:, None]).numpy().astype("<f4").reshape(-1)
    blocks = np.concatenate([scales.astype("<f4").view(np.uint8).reshape(N_SMALL, 4), codes], axis=1)
    return blocks.reshape(-1), values, ("every E4M3 code but NaN's and random ones, under random f32 "
                                        "scales and powers of two; values by torch's float8_e4m3fn (seed 8)")


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "models/gemma-3-270m-q4_k_m.gguf"
    OUT.mkdir(parents=True, exist_ok=True)
    picked = from_file(path)
    rng = np.random.default_rng(18)
    picked.update(random_blocks(rng))
    picked.update(mxfp4_blocks(rng))
    manifest = {}
    for t, (raw, source) in picked.items():
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        values = dequantize(raw, t).astype("<f4").reshape(-1)
        assert np.all(np.isfinite(values)), t.name
        (OUT / f"{t.name}.blocks").write_bytes(raw.tobytes())
        (OUT / f"{t.name}.f32").write_bytes(values.tobytes())
        manifest[t.name] = {"blocks_bytes": int(raw.size), "values": int(values.size), "source": source}
    raw, values, source = fp8_blocks()
    (OUT / "FP8.blocks").write_bytes(raw.tobytes())
    (OUT / "FP8.f32").write_bytes(values.tobytes())
    manifest["FP8"] = {"blocks_bytes": int(raw.size), "values": int(values.size), "source": source}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
