#!/usr/bin/env python3
"""lm-eval golden for kiln's `/v1/completions` check (`tests/python/lm_eval_check.py`), made by
hand with lm-eval's `hf` model (never by CI).

The reference is the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) as the other fixture
scripts load it: `transformers` dequantizes it to float32, CPU, eval mode. The tokenizer is
the model's own as kiln-tokenizer's fixtures keep it (`crates/kiln-tokenizer/tests/fixtures/
smollm2/`, written by `scripts/make_tokenizer_fixtures.py`): transformers' GGUF conversion
splits digits as GPT-2 does, the model's tokenizer one digit a token, so the GGUF's own
converted tokenizer would give other ids for "100" or "24". The check passes the same
directory to lm-eval's `local-completions`, so both runs score the same token ids.

lm-eval runs the tasks under `--include-path` (default `eval/lm_eval/tasks`, the tasks
`kiln_mc` and `kiln_gen`) with `log_samples`, batch size 1, zero-shot. The golden holds, per
task, lm-eval's metrics and, per document:

- multiple_choice: each choice's log-likelihood and is_greedy as lm-eval's `hf` model gave
  them, the token ids `local-completions` will send (context and continuation, from lm-eval's
  own `_encode_pair` with the API model's tokenizer settings), and `greedy_margin`: how far the
  choice is from flipping is_greedy (for a greedy choice the least top-1 minus top-2
  log-probability over its tokens; otherwise the largest top-1 minus the token's own).
- generate_until: the raw generation (before lm-eval's filters), the filtered answer, its
  score, the prompt ids `local-completions` will send, the greedy ids up to the stop and
  `greedy_margin`, the least top-1 minus top-2 log-probability over those ids.

Every number lm-eval produced is checked against a plain forward pass of the same model over
the same ids (log-likelihoods within 1e-4 nats, the same generations), and the ids of lm-eval's
`hf` and `local-completions` encoders are asserted equal. Documents whose answer an error of
ROBUST_TOLERANCE nats could change are listed as near ties (pick items that are not).

Setup (the venv of the other fixture scripts plus lm-eval):
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch transformers accelerate gguf safetensors sentencepiece
    /tmp/refvenv/bin/pip install 'lm_eval[api,hf]'
    cargo xtask fetch-model
    /tmp/refvenv/bin/python scripts/make_lm_eval_goldens.py       (about 4 minutes on 2 cores)

A different task set: `--include-path DIR --tasks a,b --out FILE`.
"""

import argparse
import json
import math
import os
import pathlib
import platform
import re
import sys

import torch

# Offline: the tasks' data are local files, the model and tokenizer local too.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "eval/lm_eval"))
from provenance import file_hashes, rel, sha256_of  # noqa: E402

MODELS = ROOT / "models"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER = ROOT / "crates/kiln-tokenizer/tests/fixtures/smollm2"
INCLUDE = ROOT / "eval/lm_eval/tasks"
OUT = ROOT / "eval/lm_eval/goldens/smollm2_135m_q4_1.json"
TASKS = "kiln_mc,kiln_gen"
# Items are listed as near ties when an error of this many nats in a choice's log-likelihood
# (or in one token's log-probability) could change their answer: ten times the check's
# default tolerance, so that the answers stay put for a looser one too.
ROBUST_TOLERANCE = 0.01
# This script's own cross-check: lm-eval's hf model against a plain forward pass.
SELF_TOLERANCE = 1e-4





def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=str(MODELS), help="directory holding the GGUF")
    ap.add_argument("--gguf", default=GGUF, help="GGUF file name in --models")
    ap.add_argument("--tokenizer", default=str(TOKENIZER), help="HF tokenizer directory")
    ap.add_argument("--include-path", default=str(INCLUDE), help="lm-eval task directory")
    ap.add_argument("--tasks", default=TASKS, help="comma-separated task names")
    ap.add_argument("--out", default=str(OUT), help="golden JSON to write")
    args = ap.parse_args()

    import datasets
    import lm_eval
    import tokenizers
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model_path = pathlib.Path(args.models) / args.gguf
    lm = HFLM(
        pretrained=args.models,
        gguf_file=args.gguf,
        tokenizer=args.tokenizer,
        dtype="float32",
        device="cpu",
        batch_size=1,
    )
    lm.model.eval()
    # The encoder local-completions uses (tokenized requests, huggingface backend): no server
    # is contacted when the tokenizer is given.
    api = LocalCompletionsAPI(
        base_url="http://127.0.0.1:9/v1/completions",
        model="unused",
        tokenizer=args.tokenizer,
        tokenizer_backend="huggingface",
        tokenized_requests=True,
    )
    tasks = [t for t in args.tasks.split(",") if t]
    manager = TaskManager(include_path=args.include_path, include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
        batch_size=1,
    )

    def logprobs(ids):
        """float64 log-softmax of the float32 logits at every position of `ids`."""
        logits = lm.model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1)

    problems, near_ties = [], []
    golden_tasks = {}
    for task in tasks:
        cfg = out["configs"][task]
        output_type = cfg["output_type"]
        # "metric,filter" keys, as lm-eval reports them (a task may apply several filters).
        metrics = {k: v for k, v in out["results"][task].items() if "," in k and "_stderr" not in k}
        # log_samples has one entry a document and filter; the responses are the same in each.
        by_doc = {}
        for s in out["samples"][task]:
            entry = by_doc.setdefault(s["doc_id"], (s, {}, {}))
            entry[1].update({f"{m},{s['filter']}": s[m] for m in s["metrics"]})
            entry[2][s["filter"]] = s["filtered_resps"]
        docs = []
        for doc_id in sorted(by_doc):
            s, scores, filtered = by_doc[doc_id]
            if output_type == "multiple_choice":
                doc = mc_doc(s, cfg.get("target_delimiter", " "), lm, api, logprobs, problems)
                for what in mc_near_ties(doc, ROBUST_TOLERANCE):
                    near_ties.append(f"{task} doc {doc_id}: {what}")
            elif output_type == "generate_until":
                doc = gen_doc(s, filtered, lm, api, logprobs, problems)
                if doc["greedy_margin"] < 2 * ROBUST_TOLERANCE:
                    near_ties.append(f"{task} doc {doc_id}: greedy margin {doc['greedy_margin']:.4f}")
            else:
                sys.exit(f"{task}: output_type {output_type} is not covered by this golden")
            doc["scores"] = scores
            docs.append(doc)
        golden_tasks[task] = {
            "output_type": output_type,
            "version": out["versions"].get(task),
            "n_docs": len(docs),
            "metrics": metrics,
            "generation_kwargs": cfg.get("generation_kwargs"),
            "docs": docs,
        }
        print(f"{task}: {len(docs)} docs, " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    if problems:
        sys.exit("lm-eval's hf model and the plain forward pass disagree:\n  " + "\n  ".join(problems))
    for t in near_ties:
        print(f"near tie at {ROBUST_TOLERANCE} nats: {t}")

    golden = {
        "generated_by": "scripts/make_lm_eval_goldens.py",
        "reference": "lm-eval's hf model: transformers float32 on CPU, the GGUF dequantized on load, batch size 1",
        "provenance": {
            "lm_eval": lm_eval.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
            "datasets": datasets.__version__,
            "python": platform.python_version(),
            "model_file": model_path.name,
            "model_sha256": sha256_of(model_path),
            "tokenizer_files": file_hashes(args.tokenizer),
            "task_files": file_hashes(args.include_path),
        },
        "eos_token": lm.tokenizer.eos_token,
        "tasks": golden_tasks,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(dumps(golden) + "\n")
    print(f"wrote {rel(args.out)}")


def dumps(obj):
    """Indented JSON with each list of plain values (ids, log-likelihoods) on one line."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    return re.sub(
        r"\[\n([^\[\]{}]*?)\n\s*\]",
        lambda m: "[" + " ".join(line.strip() for line in m.group(1).split("\n")) + "]",
        text,
    )


def mc_near_ties(doc, tol):
    """What an error of `tol` nats a choice could change: acc's or acc_norm's pick (acc_norm
    divides each log-likelihood by its choice's length in characters) or a choice's is_greedy
    (a token's log-probability and its rival's may each move by `tol`)."""
    lls, lens = doc["loglikelihoods"], [len(c) for c in doc["choices"]]
    out = []
    for name, scale in (("acc", [1.0] * len(lls)), ("acc_norm", [1.0 / n for n in lens])):
        best = max(range(len(lls)), key=lambda i: lls[i] * scale[i])
        for i in range(len(lls)):
            gap = lls[best] * scale[best] - lls[i] * scale[i]
            if i != best and gap < tol * (scale[best] + scale[i]):
                out.append(f"{name}: choices {best} and {i} within {gap:.4g}")
    for i, margin in enumerate(doc["greedy_margin"]):
        if margin < 2 * tol:
            out.append(f"choice {i}: is_greedy margin {margin:.4g}")
    return out


def mc_doc(s, delimiter, lm, api, logprobs, problems):
    """One multiple-choice document: lm-eval's answers, checked against a plain forward pass."""
    where = f"doc {s['doc_id']}"
    lls, greedy, margins, conts, choices, ctx_ids = [], [], [], [], [], None
    for (context, continuation), ((ll, is_greedy),) in zip(s["arguments"], s["resps"]):
        ctx, cont = api._encode_pair(context, continuation)
        if (ctx, cont) != tuple(lm._encode_pair(context, continuation)):
            problems.append(f"{where}: hf and local-completions encode {continuation!r} differently")
        lp = logprobs(ctx + cont)
        own, margin_greedy, margin_not = 0.0, math.inf, 0.0
        all_greedy = True
        for i, tok in enumerate(cont):
            row = lp[len(ctx) + i - 1]
            top2 = torch.topk(row, 2)
            own += float(row[tok])
            if int(top2[1][0]) == tok:
                margin_greedy = min(margin_greedy, float(top2[0][0] - top2[0][1]))
            else:
                all_greedy = False
                margin_not = max(margin_not, float(top2[0][0] - row[tok]))
        if abs(own - ll) > SELF_TOLERANCE or all_greedy != is_greedy:
            problems.append(f"{where} {continuation!r}: lm-eval {ll} {is_greedy}, by hand {own} {all_greedy}")
        if ctx_ids is None:
            ctx_ids = ctx
        elif ctx != ctx_ids:
            problems.append(f"{where}: choices have different context ids (a context ending in a space?)")
        lls.append(ll)
        greedy.append(bool(is_greedy))
        margins.append(margin_greedy if all_greedy else margin_not)
        conts.append(cont)
        # lm-eval scores `delimiter + choice`; acc_norm divides by the choice's own length.
        choices.append(continuation[len(delimiter) :] if continuation.startswith(delimiter) else continuation)
    return {
        "doc_id": s["doc_id"],
        "target": s["target"],
        "choices": choices,
        "loglikelihoods": lls,
        "is_greedy": greedy,
        "greedy_margin": margins,
        "context_ids": ctx_ids,
        "continuation_ids": conts,
    }


def gen_doc(s, filtered, lm, api, logprobs, problems):
    """One generation document: lm-eval's text, checked against greedy decoding by hand."""
    where = f"doc {s['doc_id']}"
    ((context, gen_kwargs),) = s["arguments"]
    (text,) = s["resps"][0] if isinstance(s["resps"][0], list) else s["resps"]
    prompt = api.tok_encode(context)
    hf_prompt = lm.tok_encode(context)
    if prompt != hf_prompt:
        problems.append(f"{where}: hf and local-completions encode the prompt differently")
    until = list(gen_kwargs.get("until") or [])
    eos = lm.tokenizer.eos_token
    if eos not in until:
        until.append(eos)
    max_new = int(gen_kwargs.get("max_gen_toks", 256))
    ids, margin = [], math.inf
    for _ in range(max_new):
        row = logprobs(prompt + ids)[-1]
        top2 = torch.topk(row, 2)
        ids.append(int(top2[1][0]))
        margin = min(margin, float(top2[0][0] - top2[0][1]))
        if ids[-1] == lm.tokenizer.eos_token_id:
            break
        decoded = lm.tokenizer.decode(ids, skip_special_tokens=False)
        if any(u and u in decoded for u in until):
            break
    own = lm.tokenizer.decode(ids, skip_special_tokens=True)
    for u in until:
        if u:
            own = own.split(u)[0]
    if own != text:
        problems.append(f"{where}: lm-eval generated {text!r}, greedy decoding {own!r}")
    return {
        "doc_id": s["doc_id"],
        "target": s["target"],
        "generation": text,
        "filtered": {k: v[0] if isinstance(v, list) else v for k, v in filtered.items()},
        "prompt_ids": prompt,
        "greedy_ids": ids,
        "greedy_margin": margin,
    }


if __name__ == "__main__":
    main()
