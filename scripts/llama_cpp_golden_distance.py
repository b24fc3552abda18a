"""How far llama.cpp's CPU backend is from transformers on kiln's golden fixtures.

The native CPU backend quantizes activations to 8 bits as llama.cpp's does, so it cannot meet
the f32 goldens' bound; its bound is this distance (crates/kiln-model/tests/common/golden.rs,
`Tolerance::INT8_X`). Measured the way the golden test measures kiln: every prompt position's
reference top-5 logits, then greedy decoding (the prefill's last position is step 0), each
step's greedy logit compared while the pick equals the reference's. Prints, per fixture, the
largest |llama.cpp - transformers| and the largest reference top-1/top-2 margin at which
llama.cpp's pick differed (at a prompt position, or in greedy decoding).

Run by hand (never in CI):
  python3 -m venv /tmp/lcp && /tmp/lcp/bin/pip install numpy
  # the CPU flags of `cargo xtask llama-cpp` (GGML_NATIVE picks AMX, which dies with SIGILL here)
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
    /tmp/lcp/bin/pip install llama-cpp-python==0.3.36
  /tmp/lcp/bin/python scripts/llama_cpp_golden_distance.py [MODELS_DIR]
"""
import json
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "crates/kiln-model/tests/fixtures"
PAIRS = [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2_golden.json"),
    ("gemma-3-270m-q4_k_m.gguf", "gemma3_270m_golden.json"),
]


def measure(model_path, fixture):
    cases = json.loads(fixture.read_text())["cases"]
    longest = max(len(c["prompt_ids"]) + len(c["greedy"]) for c in cases)
    llm = Llama(str(model_path), n_ctx=longest + 8, n_threads=2, logits_all=True, verbose=False)
    worst, worst_rel, flip_margin, diverged = 0.0, 0.0, 0.0, 0
    for c in cases:
        ids = c["prompt_ids"]
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)])
        for p, top in enumerate(c["prompt_top5"]):
            for tok, want in top:
                d = abs(float(scores[p][tok]) - want)
                worst = max(worst, d)
                worst_rel = max(worst_rel, d / max(abs(want), 1.0))
            if int(np.argmax(scores[p])) != top[0][0]:
                flip_margin = max(flip_margin, top[0][1] - top[1][1])
        last = scores[len(ids) - 1]
        for step, g in enumerate(c["greedy"]):
            pick = int(np.argmax(last))
            if pick != g["id"]:
                flip_margin = max(flip_margin, g["margin"])
                diverged += 1
                break
            d = abs(float(last[g["id"]]) - g["logit"])
            worst = max(worst, d)
            worst_rel = max(worst_rel, d / max(abs(g["logit"]), 1.0))
            if step + 1 == len(c["greedy"]):
                break
            llm.eval([pick])
            last = np.array(llm.scores[llm.n_tokens - 1])
    return worst, worst_rel, flip_margin, diverged, len(cases)


def main():
    models = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models"
    for gguf, fixture in PAIRS:
        worst, rel, flip, div, n = measure(models / gguf, FIXTURES / fixture)
        print(
            f"{gguf}: max |logit - transformers| = {worst:.4f} (relative {rel:.4f}); "
            f"greedy diverged in {div}/{n} sequences; picks differed at reference margins up to "
            f"{flip:.4f}"
        )


if __name__ == "__main__":
    main()
