#!/usr/bin/env python3
"""Golden fixtures for kiln-model, made by hand with Hugging Face `transformers` (never by CI).

The reference is the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) loaded by
`transformers`, which dequantizes it to float32. For each prompt the fixture stores the prompt's
token ids, the top-5 logits at every prompt position, and 32 greedy steps (token, its logit, and
the top-1/top-2 margin so tests can tell a real disagreement from a near tie).

Setup (about 5.6 GB):
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch transformers accelerate gguf safetensors sentencepiece
    cargo xtask fetch-model
    /tmp/refvenv/bin/python scripts/make_model_fixtures.py
"""
import json
import pathlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "crates/kiln-model/tests/fixtures/smollm2_golden.json"
STEPS = 32

LONG = (
    "The history of computing is a story of ideas that took centuries to mature. Early "
    "mechanical calculators, such as the devices built by Pascal and Leibniz in the seventeenth "
    "century, could add and multiply, but they could not be programmed. In the nineteenth "
    "century Charles Babbage designed the Analytical Engine, a machine with a store for numbers, "
    "a mill for arithmetic, and punched cards for instructions, and Ada Lovelace wrote what many "
    "consider the first program for it. Neither machine was finished in their lifetimes. A "
    "century later, electronic computers filled entire rooms, consumed enormous amounts of "
    "power, and were programmed by rewiring panels or feeding in paper tape. The invention of "
    "the transistor and then the integrated circuit shrank those machines by many orders of "
    "magnitude, and the personal computer brought computing into homes and schools. Today a "
    "phone in a pocket holds more processing power than all of the computers that guided the "
    "first missions to the Moon. Networks joined those machines together, first in universities "
    "and laboratories and then across the whole world, so that a message, a photograph or a "
    "scientific paper can travel between continents in a fraction of a second, and the next "
    "chapter of the story is"
)


def main():
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODELS, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(MODELS, gguf_file=GGUF, torch_dtype=torch.float32)
    model.eval()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the tallest mountain in the world?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = [
        ("short", "The capital of France is"),
        ("story", "Once upon a time"),
        ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        ("chat", chat),
        ("french", "Le petit prince demanda au renard pourquoi"),
        ("long", LONG),
    ]
    cases = []
    for name, text in prompts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
            top = torch.topk(logits, 5, dim=-1)
            prompt_top5 = [
                [[int(i), float(v)] for i, v in zip(top.indices[p], top.values[p])] for p in range(len(ids))
            ]
            seq = list(ids)
            greedy = []
            past = None
            step_in = torch.tensor([ids])
            for _ in range(STEPS):
                out = model(step_in, past_key_values=past, use_cache=True)
                past = out.past_key_values
                last = out.logits[0, -1]
                t2 = torch.topk(last, 2)
                nxt = int(t2.indices[0])
                greedy.append({"id": nxt, "logit": float(t2.values[0]), "margin": float(t2.values[0] - t2.values[1])})
                seq.append(nxt)
                step_in = torch.tensor([[nxt]])
        cases.append({
            "name": name,
            "text": text,
            "prompt_ids": ids,
            "prompt_top5": prompt_top5,
            "greedy": greedy,
            "greedy_text": tok.decode([g["id"] for g in greedy]),
        })
        print(f"{name}: {len(ids)} prompt tokens -> {tok.decode([g['id'] for g in greedy])!r}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": GGUF,
        "reference": "transformers float32, GGUF dequantized on load",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    OUT.write_text(json.dumps({"meta": meta, "cases": cases}, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
