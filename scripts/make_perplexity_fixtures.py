#!/usr/bin/env python3
"""Perplexity reference fixtures for `kiln perplexity`, made by hand with Hugging Face
`transformers` (never by CI).

The reference is the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) loaded exactly as
`make_model_fixtures.py` loads it: `transformers` dequantizes it to float32, eval mode, no grad.
The text is `crates/kiln/tests/fixtures/perplexity/persuasion_ch1-2.txt`: the first two chapters
of Jane Austen's "Persuasion" (1817/1818; public domain: the author died in 1817), exactly as
the Debian package `r-cran-janeaustenr` 1.0.0-1 ships it (its data come from Project
Gutenberg's plain-text eBook #105; the Gutenberg header and licence are not part of that data
and not part of the fixture). `--extract-text` rebuilds the file from that package and checks it
is unchanged; see README.md beside the text.

Scoring, as transformers' perplexity guide ("Perplexity of fixed-length models") computes it:
the text file is read whole (UTF-8, final newline included) and tokenized with
`add_special_tokens=False` (no BOS, as this model's tokenizer does by default); a case may keep
only the first N token ids. Windows start at 0, stride, 2*stride, ... and hold up to `context`
tokens; the loop stops after the window that reaches the end. Each window is one forward pass
over its own tokens (no state carried between windows). With stride == context (kiln's default)
every token of a window but its first is scored, predicted from the window's tokens before it:
the window's loss is the mean NLL of its len-1 predicted tokens, nll_sum += loss * (len-1), and
ppl = exp(nll_sum / scored); a trailing window of one token scores nothing (the guide's loop
would add NaN * 0 = NaN there; both computations here skip it). With stride < context a window
scores only the tokens no earlier window scored (the guide's `labels[:, :-trg_len] = -100`), so
every token after the first is scored exactly once; the guide then weights that window's loss by
trg_len - 1 although trg_len tokens were scored, so its overall mean differs slightly from the
exact one stored here (both are printed; the per-window losses agree).

Two computations are asserted to agree for every window: (1) per-token NLL from float64
log_softmax of the float32 logits, summed in float64 (stored); (2) the guide's loop verbatim:
`model(input_ids, labels=target_ids).loss` with `-100` masking, accumulated as it does.

Each fixture `crates/kiln/tests/fixtures/perplexity/smollm2_<case>.json` holds the text file's
name and SHA-256, the token counts, `add_special_tokens: false`, the token ids used, context,
stride, per-window {begin, end, scored_tokens, nll_sum, mean_nll} and totals {scored_tokens,
nll_sum, mean_nll, ppl}; floats are Python floats (float64). No logits.

Setup (about 5.6 GB):
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch transformers accelerate gguf safetensors sentencepiece
    cargo xtask fetch-model
    /tmp/refvenv/bin/python scripts/make_perplexity_fixtures.py [CASE ...]  (default: all; about
        20 minutes on 2 CPU cores, most of it the two whole-text cases)

To rebuild the text (needs nothing but Python 3 and `apt-get download`):
    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb /tmp/ja
    python3 scripts/make_perplexity_fixtures.py --extract-text /tmp/ja
"""
import argparse
import bz2
import gzip
import hashlib
import json
import lzma
import math
import pathlib
import re
import struct
import zlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "crates/kiln/tests/fixtures/perplexity"
TEXT = OUT / "persuasion_ch1-2.txt"

# name -> (tokens kept: None for the whole text, context, stride)
CASES = {
    "ctx512": (None, 512, 512),  # the whole text, kiln's default context
    "ctx128": (None, 128, 128),
    "first1024_ctx128": (1024, 128, 128),  # small enough for the CPU reference backend
    "first257_ctx128": (257, 128, 128),  # ends in a one-token window that scores nothing
    "first1024_ctx128_stride64": (1024, 128, 64),  # overlapping windows
}


def windows(n, context, stride):
    """(begin, end, first scored position) of each window, as the guide's loop visits them."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n:
            break
    return out


def guide_loop(model, ids, context, stride):
    """The guide's loop, as written there (one sequence, batch 1), skipping windows with nothing
    to score. Returns (per-window loss, nll_sum, n_tokens)."""
    import torch

    encodings = torch.tensor([ids])
    seq_len = encodings.size(1)
    nll_sum, n_tokens, prev_end_loc, losses = 0.0, 0, 0, []
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + context, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        num_valid_tokens = (target_ids != -100).sum().item()
        num_loss_tokens = num_valid_tokens - target_ids.size(0)  # internal label shift
        if num_loss_tokens > 0:
            with torch.no_grad():
                neg_log_likelihood = model(input_ids, labels=target_ids).loss
            losses.append(float(neg_log_likelihood))
            nll_sum += float(neg_log_likelihood) * num_loss_tokens
            n_tokens += num_loss_tokens
        else:
            losses.append(None)
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return losses, nll_sum, n_tokens


def make(name, model, all_ids, text_sha):
    import torch

    keep, context, stride = CASES[name]
    ids = all_ids if keep is None else all_ids[:keep]
    assert keep is None or len(all_ids) >= keep, (len(all_ids), keep)
    wins, nll_total, scored_total = [], 0.0, 0
    for begin, end, first in windows(len(ids), context, stride):
        scored = end - first
        nll = 0.0
        if scored > 0:
            with torch.no_grad():
                logits = model(torch.tensor([ids[begin:end]])).logits[0]  # float32 [len, vocab]
            logp = torch.log_softmax(logits.double(), dim=-1)
            pos = torch.arange(first - begin, end - begin)  # positions of the scored tokens
            targets = torch.tensor(ids[first:end])
            token_nll = -logp[pos - 1, targets]  # token at p predicted by the logits at p - 1
            nll = float(token_nll.sum())
        wins.append({"begin": begin, "end": end, "scored_tokens": scored, "nll_sum": nll,
                     "mean_nll": nll / scored if scored else None})
        nll_total += nll
        scored_total += scored
    # Non-overlapping windows lose each window's first token; overlapping ones lose only token 0.
    expect = len(ids) - len(wins) if stride >= context else len(ids) - 1
    assert scored_total == expect, (scored_total, expect)
    mean = nll_total / scored_total
    ppl = math.exp(mean)

    losses, g_sum, g_tokens = guide_loop(model, ids, context, stride)
    assert len(losses) == len(wins)
    for w, loss in zip(wins, losses):
        if w["scored_tokens"] == 0:
            assert loss is None, (name, w)
            continue
        # float32 loss of transformers vs the float64 computation: ~1e-6 relative.
        assert abs(loss - w["mean_nll"]) <= 1e-5 * max(1.0, w["mean_nll"]), (name, w, loss)
    g_mean = g_sum / g_tokens
    if stride >= context:
        assert g_tokens == scored_total, (g_tokens, scored_total)
        assert abs(g_mean - mean) <= 1e-5 * mean, (name, g_mean, mean)
    print(f"{name}: {len(ids)} tokens, context {context}, stride {stride}, {len(wins)} windows, "
          f"{scored_total} scored: mean NLL {mean:.6f}, PPL {ppl:.4f} "
          f"(guide loop: mean NLL {g_mean:.6f}, PPL {math.exp(g_mean):.4f}, {g_tokens} tokens)")

    fixture = {
        "meta": {
            "model": GGUF,
            "reference": "transformers float32, GGUF dequantized on load; NLL from float64 "
                         "log_softmax of float32 logits, summed in float64",
            "scoring": "transformers perplexity guide: windows of up to `context` tokens every "
                       "`stride` tokens, each one forward pass; a window scores the tokens at "
                       "positions [max(previous end, begin + 1), end); ppl = exp(nll_sum / scored)",
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "name": name,
        "text_file": TEXT.name,
        "text_sha256": text_sha,
        "text_tokens": len(all_ids),
        "tokens": len(ids),
        "add_special_tokens": False,
        "context": context,
        "stride": stride,
        "token_ids": ids,
        "windows": wins,
        "total": {"scored_tokens": scored_total, "nll_sum": nll_total, "mean_nll": mean,
                  "ppl": ppl},
    }
    path = OUT / f"smollm2_{name}.json"
    path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {path}")


# --- the text, from the Debian package r-cran-janeaustenr (R lazy-load data, read without R) ---

def _r_unserialize(b):
    """Enough of R's XDR serialization for the package's data: vectors, pairlists, symbols."""
    p = 0

    def i32():
        nonlocal p
        p += 4
        return struct.unpack(">i", b[p - 4:p])[0]

    def item():
        nonlocal p
        flags = i32()
        t = flags & 0xFF
        if t == 254:  # NILVALUE_SXP
            return None
        if t == 9:  # CHARSXP
            n = i32()
            if n < 0:
                return None
            p += n
            return b[p - n:p].decode("utf-8")
        if t == 1:  # SYMSXP
            sym = ("sym", item())
            refs.append(sym)
            return sym
        if t == 255:  # REFSXP
            return refs[(flags >> 8 or i32()) - 1]
        if t == 2:  # LISTSXP: {tag: value}
            attr = item() if flags & (1 << 9) else None  # noqa: F841
            tag = item() if flags & (1 << 10) else None
            car, cdr = item(), item()
            return {tag[1] if tag else None: car, **(cdr or {})}
        n = i32()
        if t in (16, 19):  # STRSXP, VECSXP
            v = [item() for _ in range(n)]
        elif t in (10, 13):  # LGLSXP, INTSXP
            v, p = list(struct.unpack(f">{n}i", b[p:p + 4 * n])), p + 4 * n
        elif t == 14:  # REALSXP
            v, p = list(struct.unpack(f">{n}d", b[p:p + 8 * n])), p + 8 * n
        else:
            raise ValueError(f"unsupported R type {t}")
        attrs = item() if flags & (1 << 9) else {}
        names = attrs.get("names")
        return dict(zip(names, v)) if names else v

    refs = []
    assert b[:2] == b"X\n", b[:2]
    p = 2
    version, _, _ = i32(), i32(), i32()
    if version == 3:
        n = i32()  # native encoding name
        p += n
    return item()


def _r_block(b):
    n, rest = struct.unpack(">I", b[:4])[0], b[4:]
    kind = rest[:1]
    out = (bz2.decompress(rest[1:]) if kind in (b"Z", b"2") else lzma.decompress(rest[1:])
           if kind == b"X" else rest[1:] if kind == b"0" else zlib.decompress(rest))
    assert len(out) == n
    return out


def extract_text(deb_root):
    prefix = pathlib.Path(deb_root) / "usr/lib/R/site-library/janeaustenr/data/Rdata"
    rdx = prefix.with_suffix(".rdx").read_bytes()
    index = _r_unserialize(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else _r_block(rdx))
    off, length = (int(x) for x in index["variables"]["persuasion"])
    with open(prefix.with_suffix(".rdb"), "rb") as f:
        f.seek(off)
        lines = _r_unserialize(_r_block(f.read(length)))
    start = lines.index("Chapter 1")
    stop = lines.index("Chapter 3")
    # The lines as shipped (Gutenberg's hard wraps and double spaces kept), runs of blank lines
    # between chapters folded to one blank line.
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines[start:stop])).strip() + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    ap.add_argument("--extract-text", metavar="DIR",
                    help="rebuild the text from r-cran-janeaustenr unpacked at DIR and stop")
    args = ap.parse_args()
    if args.extract_text:
        text = extract_text(args.extract_text)
        if TEXT.exists() and TEXT.read_text(encoding="utf-8") != text:
            raise SystemExit(f"{TEXT} differs from the text extracted from {args.extract_text}")
        TEXT.parent.mkdir(parents=True, exist_ok=True)
        TEXT.write_text(text, encoding="utf-8")
        print(f"wrote {TEXT} ({len(text)} characters, {len(text.split())} words)")
        return
    for name in args.cases:
        if name not in CASES:
            ap.error(f"unknown case {name!r} (known: {', '.join(CASES)})")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODELS, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(MODELS, gguf_file=GGUF, dtype=torch.float32)
    model.eval()
    raw = TEXT.read_bytes()
    all_ids = tok(raw.decode("utf-8"), add_special_tokens=False)["input_ids"]
    print(f"{TEXT.name}: {len(raw)} bytes, {len(all_ids)} tokens")
    for name in args.cases or list(CASES):
        make(name, model, all_ids, hashlib.sha256(raw).hexdigest())


if __name__ == "__main__":
    main()
