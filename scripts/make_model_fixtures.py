#!/usr/bin/env python3
"""Golden fixtures for kiln-model, made by hand with Hugging Face `transformers` (never by CI).

The references are the GGUF files of `cargo xtask fetch-model` loaded by `transformers`, which
dequantizes them to float32: the default model (SmolLM2-135M-Instruct, Q4_1, prompts encoded
without special tokens, as its tokenizer does) and gemma-3-270m (Q4_K_M, prompts encoded as its
tokenizer does by default: BOS first; one prompt longer than its 512-token sliding window). For
each prompt the fixture stores the prompt's token ids, the top-5 logits at every prompt
position, and 32 greedy steps (token, its logit, and the top-1/top-2 margin so tests can tell a
real disagreement from a near tie).

Setup (about 5.6 GB):
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch transformers accelerate gguf safetensors sentencepiece
    cargo xtask fetch-model --all
    /tmp/refvenv/bin/python scripts/make_model_fixtures.py [smollm2|gemma-3-270m ...]  (default: all)

`--hf-out DIR` also writes each model as the reference HF folder `DIR/<name>-hf/` (config.json,
tokenizer files, model.safetensors in float32 as transformers holds the dequantized weights,
tied LM head dropped), checked to reload to the same logits; large, never committed: it is what
kiln's own GGUF -> HF exporter can be compared with.
"""
import argparse
import json
import pathlib

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
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


# Public-domain text (Jane Austen, "Pride and Prejudice", 1813, the opening of chapter 1, and
# Abraham Lincoln's Gettysburg Address, 1863), long enough to cross gemma-3-270m's 512-token
# sliding window.
VERY_LONG = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard "
    "that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it is,\" "
    "returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. "
    "Bennet made no answer. \"Do you not want to know who has taken it?\" cried his wife "
    "impatiently. \"You want to tell me, and I have no objection to hearing it.\" This was "
    "invitation enough. \"Why, my dear, you must know, Mrs. Long says that Netherfield is taken "
    "by a young man of large fortune from the north of England; that he came down on Monday in a "
    "chaise and four to see the place, and was so much delighted with it, that he agreed with "
    "Mr. Morris immediately; that he is to take possession before Michaelmas, and some of his "
    "servants are to be in the house by the end of next week.\" \"What is his name?\" "
    "\"Bingley.\" \"Is he married or single?\" \"Oh! Single, my dear, to be sure! A single man "
    "of large fortune; four or five thousand a year. What a fine thing for our girls!\" \"How "
    "so? How can it affect them?\" \"My dear Mr. Bennet,\" replied his wife, \"how can you be "
    "so tiresome! You must know that I am thinking of his marrying one of them.\" \"Is that his "
    "design in settling here?\" \"Design! Nonsense, how can you talk so! But it is very likely "
    "that he may fall in love with one of them, and therefore you must visit him as soon as he "
    "comes.\" \"I see no occasion for that. You and the girls may go, or you may send them by "
    "themselves, which perhaps will be still better, for as you are as handsome as any of them, "
    "Mr. Bingley may like you the best of the party.\" \"My dear, you flatter me. I certainly "
    "have had my share of beauty, but I do not pretend to be anything extraordinary now. When a "
    "woman has five grown-up daughters, she ought to give over thinking of her own beauty.\"\n\n"
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. Now "
    "we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that "
    "war. We have come to dedicate a portion of that field, as a final resting place for those "
    "who here gave their lives that that nation might live. It is altogether fitting and proper "
    "that we should do this. But, in a larger sense, we can not dedicate, we can not consecrate, "
    "we can not hallow this ground. The brave men, living and dead, who struggled here, have "
    "consecrated it, far above our poor power to add or detract. The world will little note, "
    "nor long remember what we say here, but it can never forget what they did here. It is for "
    "us the living, rather, to be dedicated here to the unfinished work which they who fought "
    "here have thus far so nobly advanced. It is rather for us to be here dedicated to the great "
    "task remaining before us, that from these honored dead we take increased devotion to that "
    "cause for which they gave the last full measure of devotion, that we here highly resolve "
    "that these dead shall not have died in vain, that this nation, under God, shall have a new "
    "birth of freedom, and that government of the people, by the people, for the people, shall "
    "not perish from the earth.\n\nIn a few sentences, the two passages above are about"
)


def smollm2_prompts(tok):
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the tallest mountain in the world?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return [
        ("short", "The capital of France is"),
        ("story", "Once upon a time"),
        ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        ("chat", chat),
        ("french", "Le petit prince demanda au renard pourquoi"),
        ("long", LONG),
    ]


def gemma_prompts(tok):
    # The file has no chat template; Gemma's turn markup written out by hand instead.
    chat = ("<start_of_turn>user\nWhat is the tallest mountain in the world?<end_of_turn>\n"
            "<start_of_turn>model\n")
    return [
        ("japan", "The capital of Japan is"),
        ("story", "Once upon a time"),
        ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        ("chat", chat),
        ("french", "Le petit prince demanda au renard pourquoi"),
        ("long", LONG),
        ("very_long", VERY_LONG),
    ]


# name -> GGUF file, output, prompts, whether prompts get the tokenizer's special tokens, checks.
FIXTURES = {
    "smollm2": dict(
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        out=ROOT / "crates/kiln-model/tests/fixtures/smollm2_golden.json",
        prompts=smollm2_prompts,
        special_tokens=False,
        expect={},
    ),
    "gemma-3-270m": dict(
        gguf="gemma-3-270m-q4_k_m.gguf",
        out=ROOT / "crates/kiln-model/tests/fixtures/gemma3_270m_golden.json",
        prompts=gemma_prompts,
        special_tokens=True,  # BOS (2) first, as the tokenizer adds it
        expect={"japan": " Tokyo, and the capital of the world is New York."},
        min_prompt_tokens=600,  # one prompt past the 512-token sliding window
    ),
}


def write_hf_folder(model, tok, out, ids):
    """The model as an HF folder (`save_pretrained` refuses a model loaded from GGUF), reloaded
    and checked against the in-memory model on `ids`."""
    out.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    tok.save_pretrained(out)
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        a = model(torch.tensor([ids])).logits
        b = again(torch.tensor([ids])).logits
    assert torch.equal(a, b), float((a - b).abs().max())
    assert tok(TEXT_CHECK)["input_ids"] == AutoTokenizer.from_pretrained(out)(TEXT_CHECK)["input_ids"]
    print(f"wrote {out} (reloads to the same logits and token ids)")


TEXT_CHECK = "Le petit prince demanda au renard pourquoi, 1234 <start_of_turn> 東京"


def make(fixture, hf_out=None):
    spec = FIXTURES[fixture]
    gguf, out_path = spec["gguf"], spec["out"]
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODELS, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(MODELS, gguf_file=gguf, dtype=torch.float32)
    model.eval()
    prompts = spec["prompts"](tok)
    cases = []
    for name, text in prompts:
        ids = tok(text, add_special_tokens=spec["special_tokens"])["input_ids"]
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
                past = out.past_key_values if hasattr(out, "past_key_values") else out.cache
                last = out.logits[0, -1]
                t2 = torch.topk(last, 2)
                nxt = int(t2.indices[0])
                greedy.append({"id": nxt, "logit": float(t2.values[0]), "margin": float(t2.values[0] - t2.values[1])})
                seq.append(nxt)
                step_in = torch.tensor([[nxt]])
            # The cached decode path agrees with one forward pass over the whole sequence.
            whole = model(torch.tensor([seq[:-1]])).logits[0, -1]
            drift = float((whole - last).abs().max())
            assert drift < 1e-3, f"{name}: cached decode differs from a full pass by {drift}"
        cases.append({
            "name": name,
            "text": text,
            "prompt_ids": ids,
            "prompt_top5": prompt_top5,
            "greedy": greedy,
            "greedy_text": tok.decode([g["id"] for g in greedy]),
        })
        text_out = tok.decode([g["id"] for g in greedy])
        print(f"{name}: {len(ids)} prompt tokens -> {text_out!r} "
              f"(smallest greedy margin {min(g['margin'] for g in greedy):.4f})")
        if name in spec["expect"]:
            assert text_out.startswith(spec["expect"][name]), (name, text_out)
    longest = max(len(c["prompt_ids"]) for c in cases)
    assert longest >= spec.get("min_prompt_tokens", 0), longest
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": gguf,
        "reference": "transformers float32, GGUF dequantized on load",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    if spec["special_tokens"]:
        meta["prompt_encoding"] = "the tokenizer's default: special tokens added (BOS first)"
    out_path.write_text(json.dumps({"meta": meta, "cases": cases}, separators=(",", ":")) + "\n")
    print(f"wrote {out_path}")
    if hf_out is not None:
        write_hf_folder(model, tok, hf_out / f"{fixture}-hf", cases[0]["prompt_ids"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", help=f"fixtures, of {', '.join(FIXTURES)} (default: all)")
    ap.add_argument("--hf-out", type=pathlib.Path, help="also write DIR/<name>-hf/ (not committed)")
    args = ap.parse_args()
    for name in args.names:
        if name not in FIXTURES:
            ap.error(f"unknown fixture {name!r} (known: {', '.join(FIXTURES)})")
    for name in args.names or list(FIXTURES):
        make(name, args.hf_out)


if __name__ == "__main__":
    main()
