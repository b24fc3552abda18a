"""How far llama.cpp's CPU backend is from transformers on the lm-eval golden's answers.

`tests/python/lm_eval_check.py` checks the native CPU backend (8-bit activations, as
llama.cpp's CPU backend) at a looser tolerance than the reference backend; this measures what
llama.cpp itself gives on the same items: every choice of a multiple-choice task of
`eval/lm_eval/goldens/smollm2_135m_q4_1.json` scored from the very ids lm-eval sends (context
then continuation, the continuation's log-softmax summed in float64), against the golden's
log-likelihood (lm-eval's hf model, transformers float32, the same GGUF). Prints the largest
and mean |llama.cpp - transformers| per choice.

Run by hand (never in CI), with llama-cpp-python installed as scripts/llama_cpp_golden_distance.py
says:
  /tmp/lcp/bin/python scripts/llama_cpp_lm_eval_distance.py [TASK]   (default kiln_mc)
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "eval/lm_eval/goldens/smollm2_135m_q4_1.json"
MODEL = ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def continuation_logprob(llm, context, continuation):
    ids = context + continuation
    llm.reset()
    llm.eval(ids)
    rows = np.array(llm.scores[: len(ids)], dtype=np.float64)
    total = 0.0
    for i in range(len(context), len(ids)):
        row = rows[i - 1]
        m = row.max()
        total += row[ids[i]] - (m + math.log(np.exp(row - m).sum()))
    return total


def main():
    task = sys.argv[1] if len(sys.argv) > 1 else "kiln_mc"
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))["tasks"][task]
    llm = Llama(model_path=str(MODEL), logits_all=True, n_ctx=2048, n_threads=2, verbose=False)
    diffs = [
        abs(continuation_logprob(llm, d["context_ids"], cont) - want)
        for d in golden["docs"]
        for cont, want in zip(d["continuation_ids"], d["loglikelihoods"])
    ]
    print(
        f"llama.cpp on {MODEL.name}, {task}: {len(diffs)} choices, "
        f"max |Δ| {max(diffs):.3g} nats, mean {sum(diffs) / len(diffs):.3g}"
    )


if __name__ == "__main__":
    main()
