"""lm-eval's `local-completions` model against `kiln serve`, compared with the golden that
`scripts/make_lm_eval_goldens.py` made with lm-eval's `hf` model (transformers, float32) on
the same weights.

Usage: lm_eval_check.py URL MODEL_GGUF GOLDEN [--tasks a,b] [--include-path DIR]
           [--tokenizer DIR | --remote-tokenizer] [--model-name NAME] [--tolerance NATS]
           [--batch-size N]

URL is the completions endpoint (http://127.0.0.1:8071/v1/completions). lm-eval sends token
ids (`tokenized_requests=True`) encoded with the model's own tokenizer files (`--tokenizer`,
by default kiln-tokenizer's SmolLM2 fixture; the golden records their SHA-256, as it does the
GGUF's and the task files', and each is checked before anything runs), or, with
`--remote-tokenizer`, by the server itself (lm-eval's `tokenizer_backend=remote`: kiln's
`/tokenizer_info`, `/tokenize` and `/detokenize`; the ids it then sends are still compared
with the golden's). Needs `lm_eval[api]` and `transformers` only: no torch, no network but
the server.

Checks, per task of the golden:
- multiple_choice: every choice's log-likelihood within TOLERANCE nats of the golden's, the
  same is_greedy, the same acc and acc_norm per document;
- generate_until: the same text per document and the same exact_match;
- the ids lm-eval sends equal the golden's.
A document whose golden answer an error of TOLERANCE could change (two choices within
2 × TOLERANCE, a greedy token's lead over the next below 2 × TOLERANCE) may differ: it is
listed, not failed, and the metric may then differ by what such documents explain.

Exits non-zero, naming each difference, when anything else differs.
"""

import argparse
import json
import os
import pathlib
import sys
import urllib.parse
import urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "eval/lm_eval"))
from provenance import file_hashes, sha256_of  # noqa: E402

TOKENIZER = ROOT / "crates/kiln-tokenizer/tests/fixtures/smollm2"
INCLUDE = ROOT / "eval/lm_eval/tasks"
TASKS = "kiln_mc,kiln_gen"
# Nats a choice's log-likelihood (a sum over its tokens) may differ from the golden's.
# Measured on kiln_mc: `kiln serve --backend reference --kv-dtype f32` within 6.3e-5 nats a
# choice (2e-5 a token); the native CPU backend (8-bit activations as llama.cpp's, f16 KV
# cache) within 0.43 (mean 0.10). Pass --tolerance 0.5 to check that backend; answers near
# a tie may then differ (kiln_mc's acc_norm does on one document).
TOLERANCE = 1e-3




def served_model(url):
    """The one model `/v1/models` lists (lm-eval itself never asks)."""
    parts = urllib.parse.urlsplit(url)
    models_url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/v1/models", "", ""))
    try:
        with urllib.request.urlopen(models_url, timeout=30) as r:
            data = json.load(r)["data"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"lm-eval check: GET {models_url} failed: {e}")
    if len(data) != 1:
        sys.exit(f"{models_url} lists {len(data)} models; pass --model-name")
    return data[0]["id"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="completions endpoint, e.g. http://127.0.0.1:8071/v1/completions")
    ap.add_argument("model", help="the GGUF the server serves (its SHA-256 must be the golden's)")
    ap.add_argument("golden", help="golden JSON from scripts/make_lm_eval_goldens.py")
    ap.add_argument("--tasks", default=TASKS, help=f"comma-separated task names (default {TASKS})")
    ap.add_argument("--include-path", default=str(INCLUDE), help="lm-eval task directory")
    ap.add_argument("--tokenizer", default=str(TOKENIZER), help="HF tokenizer directory")
    ap.add_argument(
        "--remote-tokenizer",
        action="store_true",
        help="tokenize through the server (lm-eval's tokenizer_backend=remote) instead",
    )
    ap.add_argument("--model-name", help="model name to send (default: the one /v1/models lists)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"nats a choice (default {TOLERANCE})")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts a request (default 1)")
    args = ap.parse_args()
    tol = args.tolerance

    golden = json.loads(pathlib.Path(args.golden).read_text(encoding="utf-8"))
    tasks = [t for t in args.tasks.split(",") if t]
    prov = golden["provenance"]
    stale = []
    if sha256_of(args.model) != prov["model_sha256"]:
        stale.append(f"{args.model} is not the model the golden was made from ({prov['model_file']})")
    inputs = [("task", args.include_path, prov["task_files"])]
    if not args.remote_tokenizer:
        inputs.append(("tokenizer", args.tokenizer, prov["tokenizer_files"]))
    for what, directory, want in inputs:
        have = file_hashes(directory)
        for path in sorted(set(have) | set(want)):
            if have.get(path) != want.get(path):
                stale.append(f"{what} file {path} is not as the golden recorded it")
    missing = [t for t in tasks if t not in golden["tasks"]]
    if missing:
        stale.append(f"the golden has no task {', '.join(missing)}")
    if stale:
        sys.exit(
            "lm-eval check: the golden was not made from these inputs (the tasks or tokenizer changed:"
            " rerun scripts/make_lm_eval_goldens.py):\n  " + "\n  ".join(stale)
        )

    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    name = args.model_name or served_model(args.url)
    tokenizer = {"tokenizer_backend": "huggingface", "tokenizer": args.tokenizer}
    if args.remote_tokenizer:
        tokenizer = {"tokenizer_backend": "remote"}
    lm = LocalCompletionsAPI(
        model=name,
        base_url=args.url,
        **tokenizer,
        tokenized_requests=True,
        num_concurrent=1,
        max_retries=1,
        batch_size=args.batch_size,
    )
    try:
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=TaskManager(include_path=args.include_path, include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )
    except Exception as e:  # noqa: BLE001 - any failure of the run is the check's failure
        body = getattr(getattr(e, "response", None), "text", None)
        sys.exit(
            f"lm-eval check: lm-eval failed against {args.url}: {type(e).__name__}: {e}"
            + (f"\n  the server said: {body}" if body else "")
        )

    failures, notes, rows = [], [], []
    for task in tasks:
        want = golden["tasks"][task]
        # log_samples has one entry a document and filter; the responses are the same in each.
        got = {}
        for s in out["samples"][task]:
            entry = got.setdefault(s["doc_id"], (s, {}))
            entry[1].update({f"{m},{s['filter']}": s[m] for m in s["metrics"]})
        if sorted(got) != [d["doc_id"] for d in want["docs"]]:
            failures.append(f"{task}: lm-eval ran documents {sorted(got)}, the golden has {want['n_docs']}")
            continue
        if want["output_type"] == "multiple_choice":
            row = check_mc(task, want, got, lm, tol, failures, notes)
        else:
            row = check_gen(task, want, got, lm, tol, failures, notes)
        metrics = out["results"][task]
        for metric, value in want["metrics"].items():  # "metric,filter" as lm-eval reports them
            have = metrics.get(metric)
            shown = f"{metric} {value:.4f}→{have:.4f}" if have is not None else f"{metric} missing"
            row["metrics"].append(shown)
            if have is None:
                failures.append(f"{task}: lm-eval reported no {metric}")
            elif abs(have - value) > 1e-9 and not row["explained"].get(metric):
                failures.append(f"{task}: {metric} {have:.4f}, golden {value:.4f}")
            elif abs(have - value) > 1e-9:
                notes.append(f"{task}: {metric} {have:.4f}, golden {value:.4f}: near-tie documents differ")
        rows.append(row)

    print(f"\nlm-eval check against {args.url} ({name}), tolerance {tol:g} nats a choice")
    header = ("task", "docs", "choices", "max |Δ|", "mean |Δ|", "same text")
    print(f"{header[0]:<12}" + "".join(f" {h:>9}" for h in header[1:]) + "  metrics (golden→kiln)")
    for r in rows:
        cells = [
            f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r[k]) if r.get(k) is not None else "-"
            for k in ("docs", "choices", "max", "mean", "same")
        ]
        print(f"{r['task']:<12}" + "".join(f" {c:>9}" for c in cells) + f"  {', '.join(r['metrics'])}")
    for n in notes:
        print(f"note: {n}")
    if failures:
        print(f"\nlm-eval check FAILED ({len(failures)}):", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        if any("is_greedy" in f for f in failures):
            print(
                "  (lm-eval's is_greedy is token_logprobs[i] == max(top_logprobs[i].values()) exactly:"
                " both must be the same float, written the same way)",
                file=sys.stderr,
            )
        sys.exit(1)
    print("lm-eval check passed")


def check_mc(task, want, got, lm, tol, failures, notes):
    """Per-choice log-likelihoods and is_greedy, the ids sent, and acc / acc_norm per doc."""
    diffs, explained = [], {}
    for doc in want["docs"]:
        s, scores = got[doc["doc_id"]]
        where = f"{task} doc {doc['doc_id']}"
        if len(s["resps"]) != len(doc["loglikelihoods"]):
            failures.append(f"{where}: {len(s['resps'])} choices, golden {len(doc['loglikelihoods'])}")
            continue
        within = True
        for i, ((context, continuation), resp) in enumerate(zip(s["arguments"], s["resps"])):
            ll, is_greedy = resp[0]
            ctx, cont = lm._encode_pair(context, continuation)
            if ctx != doc["context_ids"] or cont != doc["continuation_ids"][i]:
                failures.append(f"{where} choice {i}: token ids sent differ from the golden's (tokenizer?)")
            d = abs(ll - doc["loglikelihoods"][i])
            diffs.append(d)
            if not d <= tol:  # NaN fails too
                within = False
                failures.append(
                    f"{where} choice {i} {continuation!r}: log-likelihood {ll:.6f},"
                    f" golden {doc['loglikelihoods'][i]:.6f} (|Δ| {d:.3g})"
                )
            if bool(is_greedy) != doc["is_greedy"][i]:
                margin = doc["greedy_margin"][i]
                msg = f"{where} choice {i}: is_greedy {is_greedy}, golden {doc['is_greedy'][i]} (margin {margin:.3g})"
                (notes if margin < 2 * tol else failures).append(msg)
        lls, lens = doc["loglikelihoods"], [len(c) for c in doc["choices"]]
        scales = {"acc": [1.0] * len(lens), "acc_norm": [1.0 / n for n in lens]}
        for key, value in doc["scores"].items():
            if scores.get(key) == value:
                continue
            msg = f"{where}: {key} {scores.get(key)}, golden {value}"
            scale = scales.get(key.split(",")[0])
            if scale is None:  # another metric of the log-likelihoods, all within the tolerance
                near = within
            else:  # the pick can move only where two scores are within the tolerance's reach
                best = max(range(len(lls)), key=lambda j: lls[j] * scale[j])
                near = any(
                    j != best and lls[best] * scale[best] - lls[j] * scale[j] < tol * (scale[best] + scale[j])
                    for j in range(len(lls))
                )
            if near:
                explained[key] = True
                notes.append(msg + " (near tie)")
            else:
                failures.append(msg)
    return {
        "task": task,
        "docs": len(want["docs"]),
        "choices": len(diffs),
        "max": max(diffs) if diffs else None,
        "mean": sum(diffs) / len(diffs) if diffs else None,
        "metrics": [],
        "explained": explained,
    }


def check_gen(task, want, got, lm, tol, failures, notes):
    """Generated text per doc, the prompt ids sent, and each doc's score."""
    same, explained = 0, {}
    for doc in want["docs"]:
        s, _scores = got[doc["doc_id"]]
        where = f"{task} doc {doc['doc_id']}"
        ((context, _gen_kwargs),) = s["arguments"]
        if lm.tok_encode(context) != doc["prompt_ids"]:
            failures.append(f"{where}: prompt ids sent differ from the golden's (tokenizer?)")
        text = s["resps"][0][0] if isinstance(s["resps"][0], list) else s["resps"][0]
        if text == doc["generation"]:
            same += 1
            continue
        margin = doc["greedy_margin"]
        msg = f"{where}: generated {text!r}, golden {doc['generation']!r} (greedy margin {margin:.3g})"
        if margin < 2 * tol:
            notes.append(msg)
            for metric in want["metrics"]:
                explained[metric] = True
        else:
            failures.append(msg)
    return {
        "task": task,
        "docs": len(want["docs"]),
        "same": f"{same}/{len(want['docs'])}",
        "metrics": [],
        "explained": explained,
    }


if __name__ == "__main__":
    main()
