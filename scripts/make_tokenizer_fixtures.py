#!/usr/bin/env python3
"""Regenerates kiln-tokenizer's golden fixtures from the reference Python tokenizer.

Run by hand, never by CI or tests:

    python3 -m venv /tmp/tokvenv
    /tmp/tokvenv/bin/pip install transformers gguf tokenizers jinja2
    cargo xtask fetch-model
    /tmp/tokvenv/bin/python scripts/make_tokenizer_fixtures.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]

It loads the default model's tokenizer from its GGUF with `transformers`
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), saves the converted `tokenizer.json`,
`tokenizer_config.json` (and `chat_template.jinja` when transformers writes one) under
`crates/kiln-tokenizer/tests/fixtures/smollm2/`, and writes `smollm2_golden.json` beside that
folder: ids with and without special tokens, offsets, decodes, and chat template renderings.

One correction is applied to what transformers builds. The file names its pre-tokenizer
`tokenizer.ggml.pre = smollm`; transformers (5.24) has no entry for that name and falls back to
plain GPT-2 byte-level splitting, while the model's own tokenizer (and llama.cpp's `smollm`)
first splits every numeric character on its own (`Digits(individual_digits=True)`). The two
differ on text like " ½" or " Ⅻ". The script installs the model's pre-tokenizer and records,
per case, the ids transformers would give without the correction when they differ
(`ids_transformers_unpatched`), so the difference stays visible.
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile

from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "crates", "kiln-tokenizer", "tests", "fixtures")
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

CORPUS = [
    "The capital of France is",
    "Hello, world!",
    "Once upon a time",
    "",
    " ",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     inner      spaces",
    "tabs\tand\ttabs\t\t\tmore",
    "line one\nline two\n\nline four\n",
    "windows\r\nline\r\nendings",
    "\n\n\n",
    " \t \n \t ",
    "It's, we're, they've, I'm, you'll, he'd -- contractions.",
    "UPPER lower MiXeD CaSe",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 0xFF 1,000,000",
    "Dates 2024-11-29 and times 09:53:07",
    "Fractions ½ ¾, superscripts x² y³, Roman Ⅻ, Arabic-Indic ٣٤٥, fullwidth １２３",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}",
    "<div class=\"box\">&nbsp;<a href='https://example.invalid/?q=1&r=2'>link</a></div>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "{\"key\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "中文文本：今天天气很好。",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 문장입니다.",
    "Русский текст: Привет, мир! Ёжик.",
    "Ελληνικά: Γειά σου Κόσμε",
    "עברית ועربي: مرحبا بالعالم",
    "हिन्दी में पाठ",
    "Combining: e\u0301 a\u0300 n\u0303 o\u0308 (decomposed) vs é à ñ ö (composed)",
    "Zalgo: Z\u0351\u0353\u0300A\u0346\u0315L\u031aG\u0300O",
    "Zero\u200bwidth\u200djoiner\ufeffbom",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text<|im_start|>",
    "<repo_name>kiln<file_sep>src/main.rs<filename>x<gh_stars>10",
    "<|im_start|><|im_start|><|im_end|>",
    "< |im_start| > not special",
    "a" * 64,
    "ab" * 40,
    "!!!???...,,,;;;:::---___===+++***",
    "~`@#$%^&*()[]{}|\\/<>",
    "A sentence with a URL https://example.invalid/path?x=1 and an email a.b@example.invalid.",
    "Mixed: café naïve coöperate résumé Ångström façade",
    "Math: ∀x∈ℝ, ∃y: x² + y² ≥ 0 ⇒ √(x²) = |x|",
    "Currency: $100, €200, £300, ¥400, ₹500, ₿0.01",
    "Long word: pneumonoultramicroscopicsilicovolcanoconiosis",
    "   \n\tindented code block\n\t\tdeeper\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "\u00a0non-breaking\u00a0space and\u3000ideographic space",
    "Control chars: \x01\x02\x7f end",
    "Private use: \ue000\U000f0000",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke\nabout Rust."},
    ],
    [
        {"role": "user", "content": "  spaces and <|im_end|> inside  "},
        {"role": "assistant", "content": "ok"},
    ],
]


def read_gguf_pre(model):
    from gguf import GGUFReader

    field = GGUFReader(model).fields.get("tokenizer.ggml.pre")
    return field.contents() if field is not None else None


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
    with open(model, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model)), gguf_file=os.path.basename(model))
    backend = tok.backend_tokenizer
    unpatched = backend.pre_tokenizer
    gguf_pre = read_gguf_pre(model)
    if gguf_pre == "smollm" and unpatched.__class__.__name__ == "ByteLevel":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )

    out_dir = os.path.join(FIXTURES, "smollm2")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            src = os.path.join(tmp, name)
            dst = os.path.join(out_dir, name)
            if os.path.exists(src):
                shutil.copyfile(src, dst)
            elif os.path.exists(dst):
                os.remove(dst)

    cases = []
    for text in CORPUS:
        with_special = backend.encode(text, add_special_tokens=True)
        without = backend.encode(text, add_special_tokens=False)
        # The transformers front end must agree with the backend it wraps.
        assert tok(text)["input_ids"] == with_special.ids, text
        backend.pre_tokenizer, patched = unpatched, backend.pre_tokenizer
        raw_ids = backend.encode(text, add_special_tokens=True).ids
        backend.pre_tokenizer = patched
        case = {}
        if raw_ids != with_special.ids:
            case["ids_transformers_unpatched"] = raw_ids
        cases.append(
            {
                "text": text,
                "ids": with_special.ids,
                "ids_no_special": without.ids,
                "offsets": [list(o) for o in with_special.offsets],
                "decode": backend.decode(with_special.ids, skip_special_tokens=False),
                "decode_skip_special": backend.decode(with_special.ids, skip_special_tokens=True),
                **case,
            }
        )

    chats = []
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            chats.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "rendered": rendered})

    golden = {
        "generated_by": "scripts/make_tokenizer_fixtures.py",
        "model_file": os.path.basename(model),
        "model_sha256": sha256,
        "tokenizer_ggml_pre": gguf_pre,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "vocab_size": backend.get_vocab_size(with_added_tokens=True),
        "cases": cases,
        "chats": chats,
    }
    with open(os.path.join(FIXTURES, "smollm2_golden.json"), "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases and {len(chats)} chat renderings to {FIXTURES}")


if __name__ == "__main__":
    main()
